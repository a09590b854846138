"""Multi-turn reuse (kv_connector_extra_config.bidirectional_kv_xfer, as
vLLM's NixlConnector names it), through vLLM's own Scheduler and
connectors (harness.Engine): turn 1 prefill -> decode; the decode offers
the request's KV (prompt and generated tokens) at its end and returns
params for turn 2; the proxy sends them with turn 2 (the prompt extended
by turn 1's output and new user tokens) to the prefill, which fetches
that prefix from the decode, computes the new tokens and offers turn 2 to
the decode, which fetches what its prefix cache lacks."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import pytest
import torch

from vllm.v1.request import RequestStatus

import kvxfer
from kvxfer.vllm.common import PARAMS_KEY, _params_of

from harness import (BLOCK, KV_HEADS, LAYERS, TOKEN, Engine, load_errors,
                     pattern, prefill, prompt_of, reported, run,
                     worker)

ON = {"bidirectional_kv_xfer": True}
EXPIRY_KEY = "remote_blocks_expiry_time"  # vLLM's param (wall clock here)
P_SALT, D_SALT = 0.0, 0.5  # each engine's own KV differs


def turn1(p: Engine, d: Engine, rid: str, prompt: List[int], out: int
          ) -> Tuple[Dict[str, Any], List[torch.Tensor], int]:
    """Turn 1: prefilled on p, decoded on d (out tokens). Returns the
    params d returned, d's KV of the tokens it offers (its blocks are held
    for the offer) and their count."""
    params = prefill(p, rid, prompt)
    d.add(rid, prompt, out, params)
    run([p, d], lambda: rid in d.outputs)
    assert d.tokens[rid] == [TOKEN] * out
    back = d.outputs[rid].kv_transfer_params
    n = len(prompt) + out - 1  # the last sampled token has no KV yet
    kv = d.kv_in(d.blocks_of(rid), n) if back else []
    return back, kv, n


def kv_equal(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("cold", [False, True])
def test_turn2_reuses_the_decodes_kv(engines, cold):
    """Turn 2's prefill holds the decode's bytes for turn 1's tokens
    (those its prefix cache lacks: all of them when it is cold), computes
    only the new tokens, and turn 2's decode gets the rest of the prefill's
    bytes byte for byte."""
    p = engines(extra=ON, salt=P_SALT)
    d = engines(extra=ON, salt=D_SALT)
    prompt = prompt_of(40, 3)
    back, dkv, n = turn1(p, d, "t1", prompt, 20)
    assert back and back["do_remote_decode"] is True, back
    assert back["do_remote_prefill"] is False and PARAMS_KEY in back
    assert back["remote_num_tokens"] == n == 59
    assert back[EXPIRY_KEY] > time.time()
    assert kvxfer.params_info(_params_of(back)).num_tokens == n
    # the decode's bytes of its own tokens differ from the prefill's
    mine = [pattern(prompt + d.tokens["t1"], 40, n, layer,
                    range(KV_HEADS), P_SALT) for layer in range(LAYERS)]
    assert not kv_equal([k[40:n] for k in dkv], mine)
    if cold:
        p.sched.reset_prefix_cache()
    hit = 0 if cold else 32  # the prefill's cached blocks of the prompt
    prompt2 = prompt + d.tokens["t1"] + prompt_of(25, 4)  # 85 tokens
    seen: Dict[str, Any] = {}
    p.add("t2", prompt2, 1, {**back})
    run([p, d], lambda: "t2" in p.outputs)
    assert not load_errors(p)
    # the prefill computed the new tokens only, after the fetch
    assert sum(p.computed["t2"]) == len(prompt2) - n
    assert p.computed["t2"][0] == len(prompt2) - n
    t2_blocks = p.blocks_of("t2")
    pkv = p.kv_in(t2_blocks, len(prompt2))
    assert kv_equal([k[hit:n] for k in pkv], [k[hit:n] for k in dkv])
    # the rest computed by the prefill itself
    for layer in range(LAYERS):
        assert torch.equal(pkv[layer][n:],
                           pattern(prompt2, n, len(prompt2), layer,
                                   range(KV_HEADS), P_SALT))
    # the decode released its blocks once the prefill fetched them
    assert reported(d, "finished_sending", "t1") == 1
    # turn 2's decode: fetches what its prefix cache lacks
    params2 = p.outputs["t2"].kv_transfer_params
    assert params2["do_remote_prefill"] is True
    assert params2["remote_num_tokens"] == len(prompt2)

    def done() -> bool:
        r = d.sched.requests.get("t2")
        if r is not None and "kv" not in seen and \
                r.num_computed_tokens >= len(prompt2):
            seen["kv"] = d.kv_of("t2", len(prompt2) - 1)
        return "t2" in d.outputs
    d.add("t2", prompt2, 2, dict(params2))
    run([p, d], done)
    assert not load_errors(d)
    # 3 full blocks of turn 1 cached on the decode; the rest fetched
    fetched = len(prompt2) - 1 - (n // BLOCK) * BLOCK
    assert d.computed["t2"][0] == 1, d.computed["t2"]
    assert fetched > 0
    assert kv_equal(seen["kv"], [k[:len(prompt2) - 1] for k in pkv])


def test_off_no_offer_at_the_decodes_end(engines):
    """bidirectional_kv_xfer off (the default): the decode returns no
    params and frees its blocks at once (no send to report)."""
    p = engines()
    d = engines(salt=D_SALT)
    back, _, _ = turn1(p, d, "off", prompt_of(40, 5), 4)
    assert back is None
    assert reported(d, "finished_sending", "off") == 0
    assert "off" not in d.sched.requests


def turn2_computed(p: Engine, d: Engine, back: Dict[str, Any],
                   prompt2: List[int], rid: str) -> List[torch.Tensor]:
    p.add(rid, prompt2, 1, {**back})
    run([p, d], lambda: rid in p.outputs)
    assert p.tokens[rid] == [TOKEN]
    return p.kv_in(p.blocks_of(rid), len(prompt2))


def test_expired_offer_is_computed(engines):
    """The decode's offer past its lease (decoder_kv_blocks_ttl): turn 2's
    prefill does not fetch it and computes the prompt itself, with no load
    error; the decode's blocks were freed at the lease."""
    p = engines(extra=ON, salt=P_SALT)
    d = engines(extra={**ON, "decoder_kv_blocks_ttl": 1}, salt=D_SALT)
    prompt = prompt_of(40, 6)
    back, _, n = turn1(p, d, "e1", prompt, 8)
    assert back and back[EXPIRY_KEY] <= time.time() + 1.01
    run([d], lambda: reported(d, "finished_sending", "e1") == 1,
        timeout=10)
    p.sched.reset_prefix_cache()
    prompt2 = prompt + d.tokens["e1"] + prompt_of(10, 7)
    pkv = turn2_computed(p, d, back, prompt2, "e2")
    assert not load_errors(p)
    assert sum(p.computed["e2"]) == len(prompt2)
    for layer in range(LAYERS):
        assert torch.equal(pkv[layer],
                           pattern(prompt2, 0, len(prompt2), layer,
                                   range(KV_HEADS), P_SALT))


def hold_queue(e: Engine, seconds: float) -> None:
    """e's scheduler steps for ``seconds`` admitting no waiting request,
    as a busy instance does (its running slots taken)."""
    keep = e.sched.max_num_active_reqs
    e.sched.max_num_active_reqs = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            e.step()
            time.sleep(0.01)
    finally:
        e.sched.max_num_active_reqs = keep


@pytest.mark.parametrize("renew", [True, False])
def test_turn2_waiting_renews_the_offer(engines, renew):
    """Turn 2 waits 3 s in the prefill's queue, the decode's offer's lease
    1 s: the prefill renews it (renew_leases) and fetches the decode's
    bytes; without renewal the offer ends and the prefill computes the
    prompt itself, with no load error."""
    p = engines(extra={**ON, "renew_leases": renew}, salt=P_SALT)
    d = engines(extra={**ON, "decoder_kv_blocks_ttl": 1}, salt=D_SALT)
    prompt = prompt_of(40, 16)
    back, dkv, n = turn1(p, d, "w1", prompt, 8)
    assert back
    p.sched.reset_prefix_cache()
    prompt2 = prompt + d.tokens["w1"] + prompt_of(10, 17)
    p.add("w2", prompt2, 1, {**back})
    hold_queue(p, 3.0)
    run([p, d], lambda: "w2" in p.outputs)
    assert not load_errors(p)
    pkv = p.kv_in(p.blocks_of("w2"), len(prompt2))
    if renew:
        assert sum(p.computed["w2"]) == len(prompt2) - n
        assert kv_equal([k[:n] for k in pkv], dkv)
    else:
        assert sum(p.computed["w2"]) == len(prompt2)
        for layer in range(LAYERS):
            assert torch.equal(pkv[layer],
                               pattern(prompt2, 0, len(prompt2), layer,
                                       range(KV_HEADS), P_SALT))


def test_released_offer_is_computed(engines):
    """The decode's offer released before turn 2 fetches it: the fetch
    fails (load errors, vLLM's recompute policy) and the prefill computes
    the prompt itself; turn 2 finishes."""
    p = engines(extra=ON, salt=P_SALT)
    d = engines(extra=ON, salt=D_SALT)
    prompt = prompt_of(40, 8)
    back, _, n = turn1(p, d, "r1", prompt, 8)
    assert back
    d.sched.connector._sched.client().release(_params_of(back))
    run([d], lambda: reported(d, "finished_sending", "r1") == 1,
        timeout=10)
    p.sched.reset_prefix_cache()
    prompt2 = prompt + d.tokens["r1"] + prompt_of(10, 9)
    pkv = turn2_computed(p, d, back, prompt2, "r2")
    assert load_errors(p)
    for layer in range(LAYERS):
        assert torch.equal(pkv[layer],
                           pattern(prompt2, 0, len(prompt2), layer,
                                   range(KV_HEADS), P_SALT))


def test_prefix_cache_hit_releases_the_offer(engines):
    """Turn 2 sent to a prefill whose prefix cache holds all of turn 1's
    offered tokens (the same turn 2 again): nothing is fetched, and the
    decode's offer is released at once rather than held to its lease."""
    p = engines(extra=ON, salt=P_SALT)
    d = engines(extra=ON, salt=D_SALT)
    prompt = prompt_of(48, 10)
    back, _, n = turn1(p, d, "h1", prompt, 17)  # n = 64: 4 full blocks
    assert n == 64
    prompt2 = prompt + d.tokens["h1"] + prompt_of(10, 11)
    turn2_computed(p, d, {**back}, prompt2, "h2")  # fetched
    assert reported(d, "finished_sending", "h1") == 1
    # a second turn-1 offer of the same tokens, for a prefill that has
    # them all cached now
    back2, _, _ = turn1(p, d, "h3", prompt, 17)
    assert back2
    turn2_computed(p, d, back2, prompt2, "h4")
    assert sum(p.computed["h4"]) == len(prompt2) - n
    run([p, d], lambda: reported(d, "finished_sending", "h3") == 1,
        timeout=5)
    assert not load_errors(p)


def test_below_the_recompute_threshold_computed(engines):
    """kv_recompute_threshold applies to turn 2's fetch as to any (as
    vLLM's pull does): fewer missing tokens are computed by the prefill,
    and the decode's offer is released at once, not held to its lease."""
    p = engines(extra={**ON, "kv_recompute_threshold": 100}, salt=P_SALT)
    d = engines(extra=ON, salt=D_SALT)
    prompt = prompt_of(40, 12)
    back, _, n = turn1(p, d, "k1", prompt, 8)
    assert back
    p.sched.reset_prefix_cache()
    prompt2 = prompt + d.tokens["k1"] + prompt_of(10, 13)
    pkv = turn2_computed(p, d, back, prompt2, "k2")
    assert sum(p.computed["k2"]) == len(prompt2)
    run([p, d], lambda: reported(d, "finished_sending", "k1") == 1,
        timeout=5)
    assert not load_errors(p)
    for layer in range(LAYERS):
        assert torch.equal(pkv[layer],
                           pattern(prompt2, 0, len(prompt2), layer,
                                   range(KV_HEADS), P_SALT))


@pytest.mark.parametrize("when", ["queued", "fetching"])
def test_turn2_aborted_releases_the_offer(engines, monkeypatch, when):
    """Turn 2 aborted on the prefill before its blocks were allocated, or
    while its fetch runs: the decode's offer ends now (released, or
    fetched and the fetch cancelled), not at its lease; the prefill's
    blocks come back."""
    cancelled: List[bytes] = []
    real = kvxfer.Client.cancel

    def cancel(self, key, *a, **kw):
        cancelled.append(bytes(key))
        return real(self, key, *a, **kw)
    monkeypatch.setattr(kvxfer.Client, "cancel", cancel)
    p = engines(extra=ON, salt=P_SALT)
    d = engines(extra=ON, salt=D_SALT)
    prompt = prompt_of(40, 14)
    back, _, _ = turn1(p, d, "a1", prompt, 8)
    assert back
    free = p.free_blocks()
    prompt2 = prompt + d.tokens["a1"] + prompt_of(10, 15)
    p.add("a2", prompt2, 1, {**back})
    if when == "fetching":
        # allocated, the fetch started; its end not polled this step
        w = worker(p)
        monkeypatch.setattr(w, "get_finished", lambda: (None, None))
        p.step()
        monkeypatch.undo()  # Client.cancel's wrapper goes too
        monkeypatch.setattr(kvxfer.Client, "cancel", cancel)
        assert "a2" in p.sched.connector._sched._inflight
    p.sched.finish_requests("a2", RequestStatus.FINISHED_ABORTED)
    run([p, d], lambda: reported(d, "finished_sending", "a1") == 1 and
        p.free_blocks() == free, timeout=5)
    assert not load_errors(p)
    # the fetch (its own key, not the request's) is cancelled
    from kvxfer.vllm.bidi import fetch_key
    assert cancelled == ([fetch_key("a2")] if when == "fetching" else [])


def test_bad_turn2_params_computed(engines):
    """Turn 2 with a remote_num_tokens that is no number: the prefill
    computes the prompt (nothing into vLLM's step) and releases the
    decode's offer."""
    p = engines(extra=ON, salt=P_SALT)
    d = engines(extra=ON, salt=D_SALT)
    prompt = prompt_of(40, 18)
    back, _, _ = turn1(p, d, "b1", prompt, 8)
    assert back
    p.sched.reset_prefix_cache()
    prompt2 = prompt + d.tokens["b1"] + prompt_of(10, 19)
    turn2_computed(p, d, {**back, "remote_num_tokens": "many"}, prompt2,
                   "b2")
    assert sum(p.computed["b2"]) == len(prompt2)
    run([p, d], lambda: reported(d, "finished_sending", "b1") == 1,
        timeout=5)
    assert not load_errors(p)


@pytest.mark.parametrize("extra,role,what", [
    ({**ON}, "kv_producer", "kv_role"),
    ({**ON}, "kv_consumer", "kv_role"),
    ({"bidirectional_kv_xfer": "maybe"}, "kv_both",
     "bidirectional_kv_xfer"),
    ({**ON, "decoder_kv_blocks_ttl": 0}, "kv_both",
     "decoder_kv_blocks_ttl"),
    ({**ON, "layerwise_load": True}, "kv_both", "layerwise_load"),
])
def test_bad_config_refused(daemon, model_dir, extra, role, what):
    """A configuration multi-turn reuse cannot serve is refused at
    __init__, naming the options."""
    with pytest.raises(kvxfer.Error) as e:
        Engine(model_dir, daemon.sock, "bad-bidi", extra=extra, role=role)
    assert what in str(e.value)
    assert "bidirectional_kv_xfer" in str(e.value) or \
        what == "decoder_kv_blocks_ttl"


def test_hybrid_model_refused(daemon, model_dir):
    """A hybrid model (full attention and sliding window groups) with the
    key: refused at __init__, naming it."""
    from hybrid_harness import HybridEngine
    with pytest.raises(kvxfer.Unsupported) as e:
        HybridEngine(model_dir, daemon.sock, "bad-bidi-hy", "FWFW",
                     extra=ON)
    assert "bidirectional_kv_xfer" in str(e.value)
    assert "hybrid" in str(e.value)
