"""Layouts: presets, the offset formula, refusals."""

import pytest

import kvxfer
from kvxfer import DType, Layout


def nhd():
    return Layout.preset("vllm-nhd", num_layers=4, num_heads=2, head_dim=64,
                         dtype="bf16", tokens_per_block=16, num_blocks=8)


def test_preset_fields_and_offsets():
    lo = nhd()
    assert (lo.num_layers, lo.kv_factor, lo.num_heads, lo.head_dim) == \
        (4, 2, 2, 64)
    assert lo.dtype is DType.BF16 and lo.elem_size == 2
    assert lo.preset_name == "vllm-nhd"
    # [kv][block][token][head][dim] per layer, layers back to back
    assert lo.head_stride == 128 and lo.token_stride == 256
    assert lo.block_stride == 16 * 256 and lo.kv_stride == 8 * 16 * 256
    assert lo.layer_span == 2 * lo.kv_stride
    assert lo.layer_offsets == tuple(i * lo.layer_span for i in range(4))
    assert lo.layer_stride == lo.layer_span and lo.num_regions == 1
    assert lo.span == 4 * lo.layer_span == lo.region_span(0)
    assert lo.offset(1, 1, 2, 3, 1) == (lo.layer_span + lo.kv_stride
                                        + 2 * lo.block_stride + 3 * 256 + 128)


@pytest.mark.parametrize("preset", kvxfer.PRESETS)
def test_every_preset_spans_its_blocks(preset):
    tpb = 1 if preset == "sglang" else 16
    kv, heads = (1, 1) if preset == "mla" else (2, 4)
    lo = Layout.preset(preset, num_layers=3, kv_factor=kv, num_heads=heads,
                       head_dim=32, dtype="fp16", tokens_per_block=tpb,
                       num_blocks=5)
    assert lo.span == 3 * kv * heads * 32 * 2 * tpb * 5


def test_refusals_raise_invalid_argument():
    with pytest.raises(kvxfer.InvalidArgument, match="unknown-preset"):
        Layout.preset("unknown-preset", num_layers=1, num_heads=1,
                      head_dim=1, dtype="bf16", tokens_per_block=1,
                      num_blocks=1)
    with pytest.raises(kvxfer.InvalidArgument):
        Layout.preset("sglang", num_layers=1, num_heads=1, head_dim=8,
                      dtype="bf16", tokens_per_block=16, num_blocks=1)
    with pytest.raises(kvxfer.InvalidArgument, match="dtype"):
        DType.of("fp64")
    with pytest.raises(kvxfer.InvalidArgument, match="block"):
        nhd().offset(0, 0, 8)


def test_dtype_names():
    assert DType.of("bf16") is DType.BF16
    assert DType.of("float16") is DType.FP16
    assert DType.of("torch.bfloat16") is DType.BF16
    assert DType.of(DType.FP8).size == 1


def test_custom_and_with_layer_offsets_are_copies():
    lo = nhd()
    moved = lo.with_layer_offsets([0, 10**6, 2 * 10**6, 3 * 10**6])
    assert moved.layer_offsets[1] == 10**6 and lo.layer_offsets[1] != 10**6
    assert moved != lo and nhd() == lo
    c = Layout.custom(num_layers=4, kv_factor=2, num_heads=2, head_dim=64,
                      dtype="bf16", tokens_per_block=16, num_blocks=8,
                      layer_offsets=lo.layer_offsets, kv_stride=lo.kv_stride,
                      block_stride=lo.block_stride,
                      token_stride=lo.token_stride,
                      head_stride=lo.head_stride)
    assert c.span == lo.span and c.preset_name == "custom"
    s = Layout.custom(num_layers=4, kv_factor=2, num_heads=2, head_dim=64,
                      dtype="bf16", tokens_per_block=16, num_blocks=8,
                      layer_stride=lo.layer_stride, kv_stride=lo.kv_stride,
                      block_stride=lo.block_stride,
                      token_stride=lo.token_stride,
                      head_stride=lo.head_stride)
    assert s == lo.with_layer_offsets(lo.layer_offsets) or s.span == lo.span


def test_split_per_layer_and_per_kv():
    lo = nhd()
    per_layer = lo.split()
    assert per_layer.num_regions == 4 and per_layer.span == 0
    assert per_layer.region_span(3) == lo.layer_span
    assert per_layer.parts[:2] == ((0, 0), (0, lo.kv_stride))
    assert per_layer.offset(2, 1, 3) == lo.offset(2, 1, 3) - 2 * lo.layer_span
    per_kv = lo.split(2)
    assert per_kv.num_regions == 8 and per_kv.region(3, 1) == 7
    assert per_kv.region_span(7) == lo.part_span == lo.kv_stride
    assert per_kv.offset(3, 1, 2) == 2 * lo.block_stride
    # copies: the original is untouched, equal layouts compare equal
    assert lo.num_regions == 1 and lo.split() == per_layer
    assert per_layer != per_kv
    with pytest.raises(kvxfer.InvalidArgument, match="split"):
        per_layer.split()
    with pytest.raises(kvxfer.InvalidArgument, match="split"):
        lo.split(3)
    moved = lo.with_parts([(a, kv * 7) for a in range(4) for kv in range(2)])
    assert moved.num_regions == 4 and moved.offset(1, 1, 0) == 7
    with pytest.raises(kvxfer.InvalidArgument, match="parts: 3 entries"):
        lo.with_parts([(0, 0)] * 3)
