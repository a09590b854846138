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

from harness import (BLOCK, HEAD, KV_HEADS, TOKEN, landed, load_errors,
                     pattern, prompt_of, run, vllm_config)
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


def _state_of(e: HybridEngine, rid: str, name: str, r: int = 0
              ) -> torch.Tensor:
    ids = [b for b in e.blocks_in(rid, name) if b]
    nbytes = e.specs[name].real_page_size_bytes
    return e.ranks[r]["caches"][name][ids[0], 0, 0, :nbytes].clone()


@pytest.fixture(params=["SD", "DS"])
def conv_layout(request, monkeypatch):
    """vLLM's SSM conv state layout (VLLM_SSM_CONV_STATE_LAYOUT): SD, its
    default, (kernel - 1, channels); DS (channels, kernel - 1)."""
    from vllm.model_executor.layers.mamba import mamba_utils
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    mamba_utils.get_conv_state_layout.cache_clear()
    yield request.param
    mamba_utils.get_conv_state_layout.cache_clear()


def mamba_decode(p: HybridEngine, d: HybridEngine, rid: str,
                 prompt: List[int]) -> Dict[Any, Any]:
    """Prefill on p, decode on d: each decode rank's blocks and state
    pages once the KV landed, before the decode computed anything."""
    p_free = p.free_blocks()
    params = hy_prefill(p, rid, prompt)
    assert params["remote_num_tokens"] == len(prompt) - 1
    d.add(rid, prompt, 2, params)
    seen: Dict[Any, Any] = {}

    def loaded():
        if landed(d, rid) and not seen:
            for r in range(d.tp):
                seen.update({(r, k): v for k, v in
                             snapshot(d, rid, r).items()})
                for name in d.layer_names:
                    if "mixer" in name:
                        seen[(r, name, "state")] = _state_of(d, rid, name,
                                                             r)
        return rid in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    assert d.tokens[rid] == [TOKEN] * 2
    assert d.computed[rid][0] == 1, d.computed[rid]
    return seen


def check_mamba(d: HybridEngine, seen: Dict[Any, Any],
                prompt: List[int]) -> None:
    """Every decode rank's state page is its share of the prefill's state
    after n - 1 tokens, its attention KV the prefill's pattern."""
    n = len(prompt) - 1
    heads = KV_HEADS // d.tp
    for r in range(d.tp):
        for name in d.layer_names:
            layer = layer_of(name)
            if "mixer" in name:
                want = state_pattern(prompt, n, layer, d.tp, r)
                assert torch.equal(seen[(r, name, "state")], want), \
                    (name, r)
                continue
            ids, cache = seen[(r, name)]
            want = pattern(prompt, 0, n, layer,
                           range(r * heads, (r + 1) * heads))
            got = torch.stack([cache[ids[t // BLOCK], :, t % BLOCK]
                               for t in range(n)])
            assert torch.equal(got, want), name


@pytest.mark.parametrize("tp", [1, 2])
def test_attention_and_mamba(hybrid, conv_layout, tp):
    """Attention + Mamba2 layers: the Mamba state moves as state slots
    (one block a request) beside the attention KV. The prefill computes
    the prompt but its last token (the decode computes that one on the
    state it received, as with vLLM's NIXL connector): each decode
    rank's state page equals its share of the prefill's after n - 1
    tokens, byte for byte, in either conv layout."""
    p = hybrid("FMFM", tp=tp)
    d = hybrid("FMFM", tp=tp, layout="LBHNC", salt=0.5)
    assert len(p.kcc.kv_cache_groups) == 2, p.kcc.kv_cache_groups
    prompt = prompt_of(45, 33)
    check_mamba(d, mamba_decode(p, d, "req-m", prompt), prompt)


@pytest.mark.parametrize("conv_layout", ["DS"], indirect=True)
def test_mamba_state_tp2_to_tp1(hybrid, conv_layout):
    """With vLLM's DS conv layout the state follows kvxfer's TP rule: the
    conv state moves as one table per sub-projection (x, B, C: their
    channels are the units) and the SSM state as one (its heads), so a
    prefill of TP 2 gives a decode of TP 1 the whole state: x of rank 0
    then rank 1, B likewise, C likewise, then every head."""
    p = hybrid("FMFM", tp=2)
    d = hybrid("FMFM", tp=1, salt=0.5)
    assert len(worker_tables(d)) == 1 + 4  # the KV, x, B, C, SSM
    prompt = prompt_of(45, 38)
    check_mamba(d, mamba_decode(p, d, "req-s", prompt), prompt)


def worker_tables(e: HybridEngine) -> List[Any]:
    w = e.ranks[0]["conn"]._worker
    return [w.pool] + list(w.group_pools)


@pytest.mark.parametrize("conv_layout", ["SD"], indirect=True)
def test_mamba_state_between_tp_sizes_refused(hybrid, conv_layout,
                                              caplog):
    """With vLLM's default SD conv layout a channel is a strided column of
    the conv state, which a kvxfer layout's unit (contiguous elements)
    cannot be: the page is one unit per TP rank, and prefill TP 2 ->
    decode TP 1 is refused by kvxferd, naming the mismatch (each rank's
    page is another size); the decode reports the request in
    failed_recving (vLLM refuses block-level errors for several groups)
    and vLLM recomputes the prompt (kv_load_failure_policy recompute)."""
    p = hybrid("FMFM", tp=2)
    d = hybrid("FMFM", tp=1, salt=0.5)
    assert len(worker_tables(d)) == 1 + 1
    prompt = prompt_of(45, 34)
    params = hy_prefill(p, "req-x", prompt)
    d.add("req-x", prompt, 2, params)
    run([p, d], lambda: "req-x" in d.outputs)
    assert d.tokens["req-x"] == [TOKEN] * 2
    assert not load_errors(d)  # by request, not by block
    assert [k.failed_recving for k in d.kv_outputs
            if k.failed_recving] == [{"req-x"}]
    assert "MISMATCH: head_dim: context 1600, generation 3200" in \
        caplog.text
    # recomputed on the decode: all 45 prompt tokens, its own KV
    assert d.computed["req-x"][0] == 45, d.computed["req-x"]


@pytest.fixture
def hybrid_own(own_daemon, model_dir):
    made: List[HybridEngine] = []

    def make(kinds: str, **kw: Any) -> HybridEngine:
        role = "prefill" if not made else "decode"
        e = HybridEngine(model_dir, own_daemon.sock,
                         f"hy-{role}-{next(_n)}", kinds, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def test_hybrid_daemon_killed_then_back(hybrid_own, own_daemon):
    """kill -9 of kvxferd with a hybrid request's offer published: the
    decode's fetch fails by request (failed_recving), vLLM recomputes;
    a new daemon on the same socket, and the next request moves every
    group byte for byte (the library registers the groups' pools again
    under the ids the scheduler reserves with)."""
    p, d = hybrid_own("FWFW"), hybrid_own("FWFW", salt=0.5)
    prompt = prompt_of(50, 36)
    params = hy_prefill(p, "req-k1", prompt)
    own_daemon.kill9()
    d.add("req-k1", prompt, 2, params)
    run([p, d], lambda: "req-k1" in d.outputs)
    assert [k.failed_recving for k in d.kv_outputs
            if k.failed_recving] == [{"req-k1"}]
    assert d.computed["req-k1"][0] == 50  # recomputed
    own_daemon.start()
    prompt = prompt_of(50, 37)
    params = hy_prefill(p, "req-k2", prompt)
    d.add("req-k2", prompt, 2, params)
    seen: Dict[str, Any] = {}

    def loaded():
        if landed(d, "req-k2") and not seen:
            seen.update(snapshot(d, "req-k2"))
        return "req-k2" in d.outputs
    run([p, d], loaded)
    assert d.computed["req-k2"][0] == 1, d.computed["req-k2"]
    n = 49
    first = max(0, n - (WINDOW - 1)) // BLOCK
    for name, (ids, cache) in seen.items():
        layer = layer_of(name)
        lo = first * BLOCK if layer % 2 else 0
        want = pattern(prompt, lo, n, layer, range(KV_HEADS))
        got = torch.stack([cache[ids[t // BLOCK], :, t % BLOCK]
                           for t in range(lo, n)])
        assert torch.equal(got, want), name


def test_hybrid_new_client_new_pool_ids(hybrid_own, own_daemon,
                                        monkeypatch):
    """A worker's client made anew (the library's reconnection off, or a
    call that timed out) registers its pools under new ids: the decode's
    ranks registered first on the restarted daemon, the prefill's after.
    The scheduler reserves a hybrid request with rank 0's pool ids: it
    takes the new ones, and the next request moves every group."""
    monkeypatch.setenv("KVXFER_RECONNECT", "0")
    p, d = hybrid_own("FWFW"), hybrid_own("FWFW", salt=0.5)
    before = [q.id for q in worker_tables(p)]
    own_daemon.kill9()
    own_daemon.start()
    for e in (d, d, p, p):  # each finds the daemon gone, then connects
        e.step()
    after = [q.id for q in worker_tables(p)]
    assert after != before
    prompt = prompt_of(50, 38)
    params = hy_prefill(p, "req-k3", prompt)
    d.add("req-k3", prompt, 2, params)
    seen: Dict[str, Any] = {}

    def loaded():
        if landed(d, "req-k3") and not seen:
            seen.update(snapshot(d, "req-k3"))
        return "req-k3" in d.outputs
    run([p, d], loaded)
    assert d.computed["req-k3"][0] == 1, d.computed["req-k3"]
    n = 49
    first = max(0, n - (WINDOW - 1)) // BLOCK
    for name, (ids, cache) in seen.items():
        layer = layer_of(name)
        lo = first * BLOCK if layer % 2 else 0
        want = pattern(prompt, lo, n, layer, range(KV_HEADS))
        got = torch.stack([cache[ids[t // BLOCK], :, t % BLOCK]
                           for t in range(lo, n)])
        assert torch.equal(got, want), name


def _moved_bytes(d: HybridEngine) -> List[int]:
    """The bytes_transferred of the decode's fetches, as its workers
    reported them to vLLM's metrics."""
    return [b for k in d.kv_outputs if k.kv_connector_stats
            for b in k.kv_connector_stats.data["bytes_transferred"]]


@pytest.mark.parametrize("conv_layout", ["SD", "DS"], indirect=True)
@pytest.mark.parametrize("kinds,n", [("FWFW", 70), ("FMFM", 45)])
def test_hybrid_bytes_transferred(hybrid, conv_layout, kinds, n):
    """vllm:kvxfer_bytes_transferred of a hybrid model's fetch: the bytes
    each table wrote, the full attention layers' tokens, the sliding
    window's from its first kept block (tokens 32..69 of 70), a Mamba
    state's page once per layer (not a page a token)."""
    p, d = hybrid(kinds), hybrid(kinds, salt=0.5)
    prompt = prompt_of(n, 39)
    params = hy_prefill(p, "req-hb", prompt)
    d.add("req-hb", prompt, 2, params)
    run([p, d], lambda: "req-hb" in d.outputs)
    offered = params["remote_num_tokens"]
    token = KV_HEADS * 2 * HEAD * 4  # a layer's K and V of a token
    specs = specs_of(kinds, 1)
    want = 0
    for name, spec in specs.items():
        if kinds[layer_of(name)] == "F":
            want += token * offered
        elif kinds[layer_of(name)] == "W":
            first = max(0, offered - 1 - (WINDOW - 1)) // BLOCK
            want += token * (offered - first * BLOCK)
        else:
            want += spec.real_page_size_bytes
    assert _moved_bytes(d) == [want]
