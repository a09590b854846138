"""Hybrid models through kvxfer.vllm (make test-vllm): vLLM's hybrid
memory allocator with KvxferConnector (SupportsHMA), a KVCacheConfig made
by vLLM's own planning functions from per-layer specs (full attention +
sliding window, attention + Mamba), vLLM's Scheduler, and the bytes of
every group checked against what the prefill wrote."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.factory import \
    KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole, supports_hma)
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec,
                                        KVCacheConfig, KVCacheGroupSpec)

import kvxfer
import kvxfer.vllm as kv_vllm

from harness import (BLOCK, HEAD, KV_HEADS, TOKEN, landed, pattern,
                     prompt_of, run, vllm_config)
from hybrid_harness import (WINDOW, HybridEngine, layer_of, specs_of,
                            state_pattern)


_n = iter(range(1, 1000))


@pytest.fixture
def hybrid(daemon, model_dir):
    made: List[HybridEngine] = []

    def make(kinds: str, tp: int = 1, **kw: Any) -> HybridEngine:
        role = "prefill" if not made else "decode"
        e = HybridEngine(model_dir, daemon.sock, f"hy-{role}-{next(_n)}",
                         kinds, tp=tp, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def hy_prefill(p: HybridEngine, rid: str, prompt: List[int]) -> dict:
    p.add(rid, prompt, 1, {"do_remote_decode": True})
    run([p], lambda: rid in p.outputs)
    params = p.outputs[rid].kv_transfer_params
    assert params and params["do_remote_prefill"] is True, params
    return dict(params)


def snapshot(e: HybridEngine, rid: str, r: int = 0) -> Dict[str, Any]:
    """Rank r's blocks of every layer of rid: name -> (ids, tensor)."""
    caches = e.ranks[r]["caches"]
    out = {}
    for name in e.layer_names:
        ids = e.blocks_in(rid, name)
        out[name] = (ids, caches[name].clone())
    return out


def test_connector_supports_hma():
    """vLLM keeps its hybrid memory allocator on with this connector."""
    assert supports_hma(kv_vllm.KvxferConnector)


def test_full_and_sliding_window(hybrid):
    """Full attention + sliding-window layers (two KV cache groups): the
    full group's blocks move whole, the window's only the blocks it
    keeps; every byte of both equals the prefill's pattern."""
    p, d = hybrid("FWFW"), hybrid("FWFW", layout="LBHNC")
    groups = p.kcc.kv_cache_groups
    assert len(groups) == 2, groups
    prompt = prompt_of(70, 31)
    p_free = p.free_blocks()
    params = hy_prefill(p, "req-h", prompt)
    d.add("req-h", prompt, 2, params)
    seen: Dict[str, Any] = {}

    def loaded():
        if landed(d, "req-h") and not seen:
            seen.update(snapshot(d, "req-h"))
        return "req-h" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    assert d.tokens["req-h"] == [TOKEN] * 2
    assert d.computed["req-h"][0] == 1, d.computed["req-h"]
    n = 69  # the decode computes token 69 itself
    first = max(0, n - (WINDOW - 1)) // BLOCK  # the window's first block
    assert first == 2
    for name, (ids, cache) in seen.items():
        layer = layer_of(name)
        sliding = layer % 2 == 1
        lo = first * BLOCK if sliding else 0
        if sliding:  # below the window: nothing moved there
            for b in ids[:first]:
                assert b == 0 or not cache[b].any(), (name, ids)
        want = pattern(prompt, lo, n, layer, range(KV_HEADS))
        got = torch.stack([cache[ids[t // BLOCK], :, t % BLOCK]
                           for t in range(lo, n)])
        assert torch.equal(got, want), name


def test_full_and_sliding_window_tp2_to_tp1(hybrid):
    """The same model, prefill TP 2 -> decode TP 1: each group's heads
    of both prefill ranks land side by side (kvxfer's TP rule applied to
    the window group too)."""
    p, d = hybrid("FWFW", tp=2), hybrid("FWFW", layout="BLHNC")
    prompt = prompt_of(50, 32)
    p_free = p.free_blocks()
    params = hy_prefill(p, "req-t", prompt)
    d.add("req-t", prompt, 2, params)
    seen: Dict[str, Any] = {}

    def loaded():
        if landed(d, "req-t") and not seen:
            seen.update(snapshot(d, "req-t"))
        return "req-t" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    n = 49
    first = max(0, n - (WINDOW - 1)) // BLOCK
    for name, (ids, cache) in seen.items():
        layer = layer_of(name)
        lo = first * BLOCK if layer % 2 else 0
        want = pattern(prompt, lo, n, layer, range(KV_HEADS))
        got = torch.stack([cache[ids[t // BLOCK], :, t % BLOCK]
                           for t in range(lo, n)])
        assert torch.equal(got, want), name


def test_refused_groups_name_the_group(model_dir, daemon):
    """A KV cache group the connector cannot move is refused when vLLM
    makes the connector, naming the group and its spec."""
    vc = vllm_config(model_dir, daemon.sock, "hy-refused")
    spec = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=4,
                                     head_size=HEAD, dtype=torch.float32,
                                     attention_chunk_size=64)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                         specs_of("F", 1)["model.layers.0.self_attn.attn"]),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], spec)])
    for side in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(kvxfer.Unsupported) as e:
            KVConnectorFactory.create_connector(vc, side, kcc)
        assert "kv_cache_groups[1]: ChunkedLocalAttentionSpec layers" in \
            str(e.value)
