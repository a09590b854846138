"""The layout of vLLM's KV cache tensors, as a kvxfer layout."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch

import kvxfer


def _layer_index(name: str) -> int:
    """The layer number in a vLLM layer name ("model.layers.3.self_attn
    .attn" -> 3), as vLLM's extract_layer_index finds it."""
    nums = [int(x) for x in re.findall(r"\.(\d+)\.", "." + name + ".")]
    if len(nums) != 1:
        raise kvxfer.InvalidArgument(
            -1, f"kv cache layer name {name!r}: expected exactly one layer "
            "number in it")
    return nums[0]


def layout_of_kv_caches(kv_caches: Dict[str, torch.Tensor], *,
                        head_size: int, head_size_v: Optional[int] = None,
                        block_size: int, num_blocks: Optional[int] = None,
                        use_mla: bool = False
                        ) -> Tuple[kvxfer.Layout, List[torch.Tensor],
                                   List[str]]:
    """The kvxfer layout of vLLM's per-layer KV cache views, and the
    memory regions it addresses.

    vLLM 0.33 views every attention layer's cache as ``[B, H, N, C]``
    (blocks, KV heads, tokens per block, content bytes as the cache dtype),
    C being a token's K then its V (``head_size + head_size_v`` elements;
    MLA: the latent, one head, no V), over one allocation whose physical
    order the resolved ``KVCacheLayout`` (LBNHC, LBHNC, BLHNC, ...) chose.
    The tensors' strides say where everything is, whatever that order:
    the layout takes its strides from them, and each (layer, K/V) part
    lies at its tensor's offset in the allocation behind it. Returns
    (layout, regions, layer names in layer order).
    """
    if not kv_caches:
        raise kvxfer.InvalidArgument(-1, "register_kv_caches: no KV caches")
    names = sorted(kv_caches, key=_layer_index)
    idx = [_layer_index(n) for n in names]
    if len(set(idx)) != len(idx):
        raise kvxfer.InvalidArgument(
            -1, f"kv caches: two tensors for one layer ({names})")
    first = kv_caches[names[0]]
    shape, stride, dtype = tuple(first.shape), first.stride(), first.dtype
    if first.dim() != 4:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: shape {shape}; this connector "
            "knows vLLM 0.33's [blocks, heads, tokens, content] views")
    hv = head_size if head_size_v is None else head_size_v
    if use_mla:
        hv = 0
    nb, heads, tpb, content = shape
    if content != head_size + hv:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: {content} elements per token and "
            f"head, expected head_size {head_size} + {hv}")
    if hv not in (0, head_size):
        raise kvxfer.Unsupported(
            -1, f"K head size {head_size} and V head size {hv} differ")
    if tpb != block_size:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: {tpb} tokens per kernel block, "
            f"vLLM's block size is {block_size} (kernel block splitting is "
            "not supported)")
    if stride[3] != 1:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: a token's content is not "
            f"contiguous (strides {stride})")
    for n in names[1:]:
        t = kv_caches[n]
        if (tuple(t.shape), t.stride(), t.dtype) != (shape, stride, dtype):
            raise kvxfer.Unsupported(
                -1, f"kv caches of {names[0]} and {n} differ in shape, "
                "strides or dtype (hybrid models: not yet)")
    if num_blocks is not None and nb < num_blocks:
        raise kvxfer.InvalidArgument(
            -1, f"kv caches hold {nb} blocks, the config says {num_blocks}")
    es = first.element_size()
    # the allocations behind the views: one region each
    regions: List[torch.Tensor] = []
    bases: List[int] = []
    parts: List[Tuple[int, int]] = []
    for n in names:
        t = kv_caches[n]
        st = t.untyped_storage()
        base = st.data_ptr()
        if base not in bases:
            bases.append(base)
            regions.append(torch.empty(0, dtype=torch.uint8,
                                       device=t.device).set_(
                st, 0, (st.nbytes(),)))
        r = bases.index(base)
        off = t.data_ptr() - base
        parts.append((r, off))
        if hv:
            parts.append((r, off + head_size * es))
    layout = kvxfer.Layout.custom(
        num_layers=len(names), kv_factor=1 if hv == 0 else 2,
        num_heads=heads, head_dim=head_size, dtype=dtype,
        tokens_per_block=tpb, num_blocks=nb,
        kv_stride=head_size * es if hv else 0,
        block_stride=stride[0] * es, token_stride=stride[2] * es,
        head_stride=stride[1] * es, parts=parts, name="vllm")
    return layout, regions, names
