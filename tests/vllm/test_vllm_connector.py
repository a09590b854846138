"""kvxfer.vllm against vLLM's own code (make test-vllm).

Two vLLM "engines" in this process, a prefill and a decode instance: each
is vLLM's real Scheduler (with its KV cache manager, prefix cache and
request classes) plus one worker-side KvxferConnector per TP rank, both
made by vLLM's KVConnectorFactory from the one config line. Each rank's
KV cache is vLLM 0.33's per-layer [blocks, heads, tokens, K|V] views
(create_kv_cache_views) over host memory the daemon can map. A step runs
as vLLM's model runner does without a model: the connector's worker
lifecycle through vLLM's KVConnectorModelRunnerMixin, the ranks' outputs
through vLLM's KVOutputAggregator, then Scheduler.update_from_output. The
"forward" writes a pattern into the KV of the tokens it computes (a
function of token, position, layer, head and element), so the decode's
blocks can be checked byte for byte against what its prefill wrote.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List

import pytest
import torch

from vllm.v1.kv_cache_interface import (FullAttentionSpec,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

import kvxfer
import kvxfer.vllm as kv_vllm

from harness import (BLOCK, HEAD, KV_HEADS, LAYERS, TOKEN,
                     Engine, kv_tensor, landed, load_errors, pattern,
                     prefill, prompt_of, reported, run, worker)

# a prefill that offers whole requests (after they finished), not
# layer-wise (test_layerwise.py)
WHOLE = {"layerwise": False}


def test_remote_prefill(engines):
    p, d = engines(), engines(layout="LBHNC")  # another layout, HND
    prompt = prompt_of(40, 1)
    p_free = p.free_blocks()
    params = prefill(p, "req-a", prompt)
    assert p.free_blocks() < p_free  # held for the transfer
    d.add("req-a", prompt, 4, params)
    seen = {}

    def loaded():
        if landed(d, "req-a") and "kv" not in seen:
            # before the decode writes anything: all 40 from the transfer
            seen["kv"] = d.kv_of("req-a", 40)
        return "req-a" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    assert d.tokens["req-a"] == [TOKEN] * 4
    # the decode computed only the last prompt token, then 3 decodes
    assert d.computed["req-a"][0] == 1, d.computed["req-a"]
    # against the pattern the prefill wrote (its blocks are free by now)
    for layer in range(LAYERS):
        assert torch.equal(seen["kv"][layer][:39],
                           pattern(prompt, 0, 39, layer, range(KV_HEADS)))


def test_prefill_tp2_to_decode_tp1(engines):
    p, d = engines(tp=2), engines(tp=1, layout="BLHNC")
    prompt = prompt_of(70, 2)
    p_free = p.free_blocks()
    params = prefill(p, "req-tp", prompt)
    d.add("req-tp", prompt, 2, params)
    got = {}

    def loaded():
        if landed(d, "req-tp") and not got:
            # each prefill rank wrote its heads (its blocks may be free
            # already): together, every head of every token
            got["kv"] = d.kv_of("req-tp", 69)
        return "req-tp" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(got["kv"][layer],
                           pattern(prompt, 0, 69, layer, range(KV_HEADS)))
    assert d.computed["req-tp"][0] == 1
    assert d.tokens["req-tp"] == [TOKEN] * 2


def test_prefix_held_fetches_the_rest(engines):
    """The decode's prefix cache holds 32 of 40 tokens: only tokens 32..39
    move (skip_tokens), into the blocks after the cached ones."""
    p, d = engines(), engines()
    prompt = prompt_of(40, 3)
    d.add("warm", prompt[:33], 1)  # caches two full blocks (32 tokens)
    run([d], lambda: "warm" in d.outputs)
    params = prefill(p, "req-p", prompt)
    d.add("req-p", prompt, 2, params)
    seen = {}

    def loaded():
        if landed(d, "req-p") and not seen:
            seen["kv"] = d.kv_of("req-p", 40)
            seen["blocks"] = d.blocks_of("req-p")
        return "req-p" in d.outputs
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(seen["kv"][layer][:39],
                           pattern(prompt, 0, 39, layer, range(KV_HEADS)))
    assert d.computed["req-p"][0] == 1


def test_full_prefix_hit_releases(engines):
    """Nothing worth moving (under recompute_below_tokens): the decode
    computes the last token itself and the prefill's blocks are freed at
    once by a release, not at the offer's lease."""
    p, d = engines(), engines(extra={"recompute_below_tokens": BLOCK})
    prompt = prompt_of(33, 4)
    d.add("warm", prompt, 1)  # caches 2 full blocks: 32 of 33 tokens
    run([d], lambda: "warm" in d.outputs)
    p_free = p.free_blocks()
    params = prefill(p, "req-h", prompt)
    t0 = time.monotonic()
    d.add("req-h", prompt, 2, params)
    run([p, d], lambda: "req-h" in d.outputs and p.free_blocks() == p_free)
    assert time.monotonic() - t0 < 5  # the lease is 30 s
    assert d.computed["req-h"][0] == 1  # token 32 computed, nothing moved
    assert d.tokens["req-h"] == [TOKEN] * 2


def test_abort_while_transferring(engines, daemon):
    """A decode request aborted while its fetch waits (the prefill has not
    published yet) is cancelled; vLLM frees its blocks only after the
    fenced cancel, and the prefill's offer ends too. (A whole-request
    offer: a layer-wise one is published before the decode fetches.)"""
    p, d = engines(extra=WHOLE), engines()
    prompt = prompt_of(40, 5)
    p_free, d_free = p.free_blocks(), d.free_blocks()
    p.add("req-x", prompt, 1, {"do_remote_decode": True})
    run([p], lambda: "req-x" in p.outputs)
    params = dict(p.outputs["req-x"].kv_transfer_params)
    # the decode starts fetching before the prefill's workers publish
    d.add("req-x", prompt, 4, params)
    d.step()
    req = d.sched.requests["req-x"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = d.blocks_of("req-x")
    d.sched.finish_requests("req-x", RequestStatus.FINISHED_ABORTED)
    assert d.free_blocks() < d_free  # held until the cancel is fenced
    run([d], lambda: d.free_blocks() == d_free)
    assert "req-x" not in d.sched.requests
    # no byte landed in the decode's blocks, even after the prefill
    # publishes and its offer ends
    run([p], lambda: p.free_blocks() == p_free, timeout=40)
    caches = d.ranks[0]["caches"]
    for name in d.layer_names:
        assert not caches[name][blocks].any()


def test_prefill_death_recomputes(engines):
    """The prefill instance dies after handing out params: the decode's
    fetch fails, vLLM gets the request's blocks as load errors and, under
    kv_load_failure_policy recompute, computes the whole prompt itself."""
    p, d = engines(), engines()
    prompt = prompt_of(40, 6)
    p.add("req-d", prompt, 1, {"do_remote_decode": True})
    run([p], lambda: "req-d" in p.outputs)
    params = dict(p.outputs["req-d"].kv_transfer_params)
    p.close()  # its ranks leave before publishing: the offer ends
    d.add("req-d", prompt, 3, params)
    seen = {}

    def done():
        req = d.sched.requests.get("req-d")
        if req is not None and req.num_computed_tokens >= 40 and not seen:
            seen["kv"] = d.kv_of("req-d", 40)
        return "req-d" in d.outputs
    run([d], done)
    assert d.tokens["req-d"] == [TOKEN] * 3
    # the load failed: the decode computed all 40 prompt tokens itself
    assert d.computed["req-d"][0] == 40, d.computed["req-d"]
    for layer, kv in enumerate(seen["kv"]):
        assert torch.equal(kv, pattern(prompt, 0, 40, layer,
                                       range(KV_HEADS)))


def test_bad_params_are_computed_locally(engines):
    """Params that are not kvxfer's: a clear log line, no transfer, the
    decode computes the prompt."""
    d = engines()
    d.add("req-b", prompt_of(20, 7), 1,
          {"do_remote_prefill": True, "kvxfer_params": "not base64!",
           "remote_num_tokens": 20})
    run([d], lambda: "req-b" in d.outputs)
    assert d.tokens["req-b"] == [TOKEN]


def test_layouts_follow_the_tensors():
    """The layout read from the views addresses the same bytes as the
    views themselves, in every vLLM 0.33 KVCacheLayout."""
    heads = 2
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads,
                             head_size=HEAD, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    for lay in KVCacheLayout:
        kt = kv_tensor(spec, 8, names, lay)
        raw = torch.zeros(kt.size, dtype=torch.int8)
        views = create_kv_cache_views(raw, spec, 8, lay, kt)
        caches = dict(zip(reversed(names), reversed(views)))  # any order
        layout, regions, order = kv_vllm.layout_of_kv_caches(
            caches, head_size=HEAD, block_size=BLOCK)
        assert order == names and len(regions) == 1
        base = raw.data_ptr()
        for layer in range(LAYERS):
            for kv in range(2):
                for (b, t, h, e) in ((0, 0, 0, 0), (3, 5, 1, 7),
                                     (7, BLOCK - 1, heads - 1, HEAD - 1)):
                    el = views[layer][b, h, t, kv * HEAD + e]
                    want = el.data_ptr() - base
                    assert layout.offset(layer, kv, b, t, h) + 4 * e == want, \
                        (lay, layer, kv, b, t, h, e)


def test_abort_before_scheduled_releases(engines):
    """A decode request aborted before vLLM gave it blocks never fetches:
    its prefill's blocks are released at once, not at the lease."""
    p, d = engines(), engines()
    prompt = prompt_of(40, 8)
    p_free = p.free_blocks()
    params = prefill(p, "req-r", prompt)
    p.step()  # the prefill's workers publish
    assert p.free_blocks() < p_free
    d.add("req-r", prompt, 4, params)
    d.sched.finish_requests("req-r", RequestStatus.FINISHED_ABORTED)
    t0 = time.monotonic()
    run([p], lambda: p.free_blocks() == p_free)
    assert time.monotonic() - t0 < 5  # the lease is 30 s


def test_no_daemon_is_a_clear_error(model_dir, tmp_path):
    """A worker whose daemon is not there fails at register_kv_caches,
    naming the socket."""
    with pytest.raises(kvxfer.Error) as e:
        Engine(model_dir, str(tmp_path / "none.sock"), "lonely")
    assert "none.sock" in str(e.value)


# -- the daemon goes away (issue 35) ----------------------------------------


def kill_mid_transfer(p: Engine, d: Engine, daemon: Any) -> Dict[str, Any]:
    """Two prefill requests and a decode fetch in flight (whole-request
    offers, WHOLE: published the step after the request finished), then
    kill -9 of the daemon; the engines step until each request ended once. Returns
    what the checks need."""
    p_free = p.free_blocks()
    pa, pb = prompt_of(40, 21), prompt_of(40, 22)
    prefill(p, "req-ka", pa)  # its offer is published at the next step
    params_b = prefill(p, "req-kb", pb)  # reserved, not published yet
    d.add("req-kb", pb, 4, params_b)
    d.step()  # the decode's fetch waits for the offer
    assert d.sched.requests["req-kb"].status == \
        RequestStatus.WAITING_FOR_REMOTE_KVS
    assert worker(p).client.state.in_flight == 1  # req-ka's offer
    assert worker(d).client.state.in_flight == 1  # req-kb's fetch
    blocks_b = d.blocks_of("req-kb")[:3]
    daemon.kill9()
    seen: Dict[str, Any] = {}

    def ended():
        if load_errors(d) and "outcome" not in seen:
            # the step that reported the load error has run, the
            # recompute has not: the fetch wrote nothing
            seen["outcome"] = d.kv_in(blocks_b, 40)
        req = d.sched.requests.get("req-kb")
        if req is not None and req.status == RequestStatus.RUNNING:
            # vLLM gave the recompute the blocks again (in another order)
            seen["blocks"] = d.blocks_of("req-kb")[:3]
        if "req-kb" in d.outputs and "recomputed" not in seen:
            seen["recomputed"] = d.kv_in(seen["blocks"], 40)
        return "recomputed" in seen and p.free_blocks() == p_free
    run([p, d], ended)
    # one outcome each: the sends finished (their blocks free), the fetch
    # a load error of its blocks, which vLLM recomputed
    assert reported(p, "finished_sending", "req-ka") == 1
    assert reported(p, "finished_sending", "req-kb") == 1
    assert reported(d, "finished_recving", "req-kb") == 1
    assert load_errors(d) == [set(blocks_b)]
    for kv in seen["outcome"]:
        assert not kv.any()
    assert d.tokens["req-kb"] == [TOKEN] * 4
    assert d.computed["req-kb"][0] == 40, d.computed["req-kb"]
    for layer, kv in enumerate(seen["recomputed"]):
        assert torch.equal(kv, pattern(pb, 0, 40, layer, range(KV_HEADS)))
    assert set(seen["blocks"]) == set(blocks_b)
    # while it is gone: a prefill returns no params (its decode computes
    # the prompt), nothing raises
    p.add("req-kd", prompt_of(20, 24), 1, {"do_remote_decode": True})
    run([p], lambda: "req-kd" in p.outputs)
    assert p.outputs["req-kd"].kv_transfer_params is None
    assert p.free_blocks() == p_free
    return {"blocks_b": seen["blocks"], "pb": pb, "p_free": p_free}


def after_restart(p: Engine, d: Engine, daemon: Any, was: Dict[str, Any]
                  ) -> None:
    """A new daemon on the same socket: the next request moves through
    kvxfer byte for byte, and the lost fetch's blocks stay as the decode
    computed them."""
    daemon.start()
    pc = prompt_of(40, 23)
    params = prefill(p, "req-kc", pc)
    d.add("req-kc", pc, 2, params)
    seen = {}

    def loaded():
        if landed(d, "req-kc") and "kv" not in seen:
            seen["kv"] = d.kv_of("req-kc", 40)
            seen["blocks"] = d.blocks_of("req-kc")
        return "req-kc" in d.outputs and p.free_blocks() == was["p_free"]
    run([p, d], loaded)
    assert d.computed["req-kc"][0] == 1, d.computed["req-kc"]  # moved
    for layer in range(LAYERS):  # the prefill's KV (its salt), not ours
        assert torch.equal(seen["kv"][layer][:39],
                           pattern(pc, 0, 39, layer, range(KV_HEADS),
                                   p.salt))
    assert load_errors(d) == [set(was["blocks_b"])]  # none since
    # nothing of req-kb's transfer landed once the new daemon was up: its
    # full blocks that req-kc did not take hold what the decode computed
    kept = [(i, b) for i, b in enumerate(was["blocks_b"][:2])
            if b not in seen["blocks"]]
    assert kept, (was["blocks_b"], seen["blocks"])
    for i, b in kept:
        for layer, kv in enumerate(d.kv_in([b], BLOCK)):
            assert torch.equal(kv, pattern(was["pb"], i * BLOCK,
                                           (i + 1) * BLOCK, layer,
                                           range(KV_HEADS)))


def outage_lines(caplog) -> List[str]:
    """The connector's log lines about the daemon's loss and return."""
    return [r.getMessage() for r in caplog.records
            if r.name == "kvxfer.vllm" and "kvxferd" in r.getMessage()
            and r.levelno >= logging.WARNING]


def test_daemon_killed_mid_transfer(engines, own_daemon, caplog):
    """kill -9 of kvxferd with a prefill's offer published (not fetched
    yet), another reserved but not published, and the decode's fetch of
    it waiting: both engines carry on (no exception leaves a connector
    method), each request ends once (the sends finished, their blocks
    freed; the fetch's blocks load errors, recomputed under
    kv_load_failure_policy recompute), nothing lands in the decode's
    blocks; a new daemon on the same socket and the next request goes
    through kvxfer again, with the library's reconnection, no restart."""
    daemon = own_daemon
    p = engines(salt=0.5, sock=daemon.sock, extra=WHOLE)
    d = engines(sock=daemon.sock)
    was = kill_mid_transfer(p, d, daemon)
    for e in (p, d):  # the library reconnects them, not closed
        assert worker(e).client.state.status == \
            kvxfer.ClientStatus.RECONNECTING
    after_restart(p, d, daemon, was)
    for e in (p, d):
        st = worker(e).client.state
        assert st.status == kvxfer.ClientStatus.CONNECTED
        assert st.incarnation == 1
    # logged once per outage and side, and the return
    lines = outage_lines(caplog)
    for who in (f"worker of {p.name}", f"worker of {d.name}",
                f"scheduler of {p.name}"):
        mine = [m for m in lines if who in m]
        assert len(mine) == 2, lines
        assert "kvxferd unavailable" in mine[0]
        assert "transfers resume" in mine[1]


def test_daemon_killed_reconnection_off(engines, own_daemon, monkeypatch):
    """The same with the library's reconnection off (KVXFER_RECONNECT=0):
    the clients close, the connector makes its worker's and scheduler's
    clients again once the daemon is back."""
    monkeypatch.setenv("KVXFER_RECONNECT", "0")
    daemon = own_daemon
    p = engines(salt=0.5, sock=daemon.sock, extra=WHOLE)
    d = engines(sock=daemon.sock)
    was = kill_mid_transfer(p, d, daemon)
    after_restart(p, d, daemon, was)
    for e in (p, d):
        st = worker(e).client.state
        assert st.status == kvxfer.ClientStatus.CONNECTED
        assert st.incarnation == 0  # a new client


@pytest.mark.parametrize("bad", ["forty", [40], 39.5])
def test_bad_remote_num_tokens_computed_locally(engines, bad, caplog):
    """kvxfer's params with a remote_num_tokens that is no token count (the
    proxy's input): logged naming it, the decode computes the prompt, and
    nothing raises into vLLM's scheduler."""
    p, d = engines(), engines()
    prompt = prompt_of(20, 8)
    params = prefill(p, "req-bn", prompt)
    params["remote_num_tokens"] = bad
    d.add("req-bn", prompt, 1, params)
    run([d], lambda: "req-bn" in d.outputs)
    assert d.tokens["req-bn"] == [TOKEN]
    assert d.computed["req-bn"][0] == 20
    assert "kv_transfer_params['remote_num_tokens']" in caplog.text
