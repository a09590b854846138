"""Layer-wise transfer through the vLLM connector (make test-vllm):
save_kv_layer, wait_for_save and wait_for_layer_load driven by the
harness's layer-by-layer forward inside vLLM's connector lifecycle
(harness.Engine(per_layer=True)). Host memory: a layer is ready when its
save_kv_layer is called (no CUDA event)."""

from __future__ import annotations

import threading
from typing import Any, Dict

import torch

from vllm.v1.request import RequestStatus

import kvxfer
import kvxfer.vllm as kv_vllm

from harness import (HEAD, KV_HEADS, LAYERS, TOKEN, Engine, landed,
                     load_errors, pattern, prefill, prompt_of, run, worker)


def early_params(p: Engine, rid: str) -> Dict[str, Any]:
    """The params the prefill's request_finished will return, read from
    its scheduler half once the request's first chunk is scheduled (what a
    router that starts the decode early would hand it)."""
    got = p.sched.connector._sched.lw.params_of(rid)
    assert got is not None, f"{rid}: no layer-wise offer"
    return dict(got)


def sender(e: Engine, r: int = 0) -> Any:
    return worker(e, r).lw


def test_fetch_runs_behind_the_forward(engines):
    """The decode's fetch starts while the prefill's forward is between
    its layers: layer 0 lands in the decode's blocks before the prefill
    marked its last layer ready; then every byte equals what the prefill
    wrote and the prefill's final params are the ones handed early."""
    p, d = engines(per_layer=True), engines()
    prompt = prompt_of(40, 31)
    p_free = p.free_blocks()
    key = kv_vllm.request_key("req-lw")
    seen: Dict[str, Any] = {}

    def after_layer(e: Engine, r: int, layer: int) -> None:
        if layer != 0 or "early" in seen:
            return
        seen["early"] = early_params(p, "req-lw")
        d.add("req-lw", prompt, 4, dict(seen["early"]))
        d.step()  # the decode's scheduler and workers: its fetch starts
        c = worker(d).client
        run([], lambda: c.fetch_progress(key)[0] >= 1)
        # the state now: layer 0 landed at the decode, the prefill has
        # marked layer 0 only, the decode's fetch is not over
        seen["progress"] = c.fetch_progress(key)
        seen["marked"] = sender(p).last_marked[key]
        seen["kv0"] = d.kv_of("req-lw", 40)[0].clone()
    p.after_layer = after_layer
    p.add("req-lw", prompt, 1, {"do_remote_decode": True})
    run([p], lambda: "req-lw" in p.outputs)
    assert seen["marked"] == 1 < LAYERS
    done, total, ended = seen["progress"]
    assert (done, total, ended) == (1, LAYERS, False), seen["progress"]
    assert torch.equal(seen["kv0"],
                       pattern(prompt, 0, 40, 0, range(KV_HEADS)))
    params = p.outputs["req-lw"].kv_transfer_params
    for k in (kv_vllm.PARAMS_KEY, "remote_num_tokens", "do_remote_prefill"):
        assert params[k] == seen["early"][k], k
    got = {}

    def loaded():
        if landed(d, "req-lw") and not got:
            got["kv"] = d.kv_of("req-lw", 40)
        return "req-lw" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(got["kv"][layer],
                           pattern(prompt, 0, 40, layer, range(KV_HEADS)))
    assert d.tokens["req-lw"] == [TOKEN] * 4
    assert d.computed["req-lw"][0] == 1  # the transfer brought the rest


def test_proxy_flow_layerwise(engines):
    """vLLM's proxy flow (params after the prefill finished), TP 2 to 1:
    the offer was published and its layers marked during the forward (one
    mark per layer and rank), the bytes are the prefill's."""
    p, d = engines(tp=2, per_layer=True), engines(layout="LBHNC")
    # the ranks join with the addresses of vLLM's handshake at their first
    # step: an instance's first request is reserved before they did, so
    # it moves whole (docs/engines/vllm.md, "Not yet"); this one is not
    # the first
    p.step()
    prompt = prompt_of(50, 32)
    p_free = p.free_blocks()
    params = prefill(p, "req-px", prompt)
    for r in range(2):
        assert sender(p, r).marks_made == LAYERS  # save_kv_layer's marks
    d.add("req-px", prompt, 2, params)
    got = {}

    def loaded():
        if landed(d, "req-px") and not got:
            got["kv"] = d.kv_of("req-px", 49)
        return "req-px" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(got["kv"][layer],
                           pattern(prompt, 0, 49, layer, range(KV_HEADS)))


def test_layerwise_off(engines):
    """layerwise false: no layer is marked; the offer is published whole
    the step after the request finished, and the transfer is the same."""
    p, d = engines(per_layer=True, extra={"layerwise": False}), engines()
    prompt = prompt_of(40, 33)
    p.add("req-off", prompt, 1, {"do_remote_decode": True})
    p.step()  # its only prefill chunk: nothing is offered yet
    assert p.sched.connector._sched.lw.params_of("req-off") is None
    run([p], lambda: "req-off" in p.outputs)
    params = dict(p.outputs["req-off"].kv_transfer_params)
    assert sender(p).marks_made == 0
    d.add("req-off", prompt, 2, params)
    got = {}

    def loaded():
        if landed(d, "req-off") and not got:
            got["kv"] = d.kv_of("req-off", 39)
        return "req-off" in d.outputs
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(got["kv"][layer],
                           pattern(prompt, 0, 39, layer, range(KV_HEADS)))


def test_bad_switch_is_refused(engines):
    try:
        engines(extra={"layerwise": "sometimes"})
    except kvxfer.InvalidArgument as e:
        assert "kv_connector_extra_config.layerwise" in str(e)
    else:
        raise AssertionError("layerwise 'sometimes' was taken")


def test_chunked_prefill(engines):
    """A 100-token prompt in chunks of 32 tokens: the offer is published
    with the first chunk's blocks, the next chunks append theirs
    (append_blocks) and mark their tokens (layers_ready's tokens); the
    decode's fetch, started after the first chunk, waits for the rest and
    gets every byte."""
    p, d = engines(per_layer=True, chunk=32), engines()
    prompt = prompt_of(100, 34)
    key = kv_vllm.request_key("req-ch")
    p_free = p.free_blocks()
    seen: Dict[str, Any] = {}

    def after_layer(e: Engine, r: int, layer: int) -> None:
        if layer == LAYERS - 1 and "early" not in seen:
            seen["early"] = early_params(p, "req-ch")
            d.add("req-ch", prompt, 2, seen["early"])
            d.step()
            # the decode's fetch is in flight (fetch_progress answers),
            # tokens 32..99 not computed yet by the prefill
            seen["progress"] = worker(d).client.fetch_progress(key)
            seen["computed"] = p.sched.requests["req-ch"].num_computed_tokens
    p.after_layer = after_layer
    p.add("req-ch", prompt, 1, {"do_remote_decode": True})
    run([p], lambda: "req-ch" in p.outputs)
    assert p.computed["req-ch"] == [32, 32, 32, 4], p.computed["req-ch"]
    assert seen["computed"] == 32
    assert seen["progress"][2] is False  # not ended: waits for chunks
    got = {}

    def loaded():
        if landed(d, "req-ch") and not got:
            got["kv"] = d.kv_of("req-ch", 100)
        return "req-ch" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(got["kv"][layer][:99],
                           pattern(prompt, 0, 99, layer, range(KV_HEADS)))
    assert d.computed["req-ch"][0] == 1
    assert not load_errors(d)


def test_prefill_aborted_mid_chunks(engines):
    """A prefill aborted between its chunks: its offer is cancelled
    (fenced) before vLLM frees its blocks; the decode that fetches it
    early gets load errors and computes the prompt (recompute)."""
    p, d = engines(per_layer=True, chunk=32), engines()
    prompt = prompt_of(100, 35)
    p_free = p.free_blocks()
    p.add("req-ab", prompt, 1, {"do_remote_decode": True})
    p.step()  # the first chunk: offered, its layers marked
    params = early_params(p, "req-ab")
    d.add("req-ab", prompt, 2, params)
    d.step()
    p.sched.finish_requests("req-ab", RequestStatus.FINISHED_ABORTED)
    # held until the workers cancelled the offer, then freed
    assert p.free_blocks() < p_free
    run([p, d], lambda: p.free_blocks() == p_free and "req-ab" in d.outputs)
    assert load_errors(d)  # its blocks (all of them: nothing was cached)
    assert d.computed["req-ab"][0] == 100  # recomputed here
    assert d.tokens["req-ab"] == [TOKEN] * 2


def test_decode_layer_load(engines):
    """layerwise_load: the decode loads synchronously and its forward
    waits for each layer (wait_for_layer_load, fetch_progress): the
    decode's forward passed layer 0 while the prefill had not marked its
    last layer; its first token's step used every transferred byte."""
    p = engines(per_layer=True)
    d = engines(per_layer=True, extra={"layerwise_load": True})
    prompt = prompt_of(40, 36)
    key = kv_vllm.request_key("req-ll")
    seen: Dict[str, Any] = {}
    go = threading.Event()
    passed0 = threading.Event()

    def decode_layer(e: Engine, r: int, layer: int) -> None:
        if layer == 0 and "marked" not in seen:
            seen["marked"] = sender(p).last_marked.get(key)
            seen["kv0"] = d.kv_of("req-ll", 40)[0].clone()
            seen["blocks"] = d.blocks_of("req-ll")
            passed0.set()
    d.after_layer = decode_layer
    errors = []

    def decode() -> None:
        try:
            go.wait(10)
            d.add("req-ll", prompt, 3, seen["early"])
            run([d], lambda: "req-ll" in d.outputs)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            passed0.set()

    def prefill_layer(e: Engine, r: int, layer: int) -> None:
        if layer == 0 and "early" not in seen:
            seen["early"] = early_params(p, "req-ll")
            go.set()
            assert passed0.wait(10), "the decode's forward never passed " \
                "layer 0"
    p.after_layer = prefill_layer
    t = threading.Thread(target=decode)
    t.start()
    p.add("req-ll", prompt, 1, {"do_remote_decode": True})
    run([p], lambda: "req-ll" in p.outputs)
    t.join(20)
    assert not errors, errors
    assert seen["marked"] == 1 < LAYERS
    assert torch.equal(seen["kv0"][:39],
                       pattern(prompt, 0, 39, 0, range(KV_HEADS)))
    assert worker(d).loader.waits >= LAYERS
    # scheduled at once (a synchronous load), computed only the last token
    assert d.computed["req-ll"][0] == 1
    assert d.tokens["req-ll"] == [TOKEN] * 3
    assert not load_errors(d)
    # its blocks, free now but not reused
    for layer, kv in enumerate(d.kv_in(seen["blocks"], 39)):
        assert torch.equal(kv, pattern(prompt, 0, 39, layer,
                                       range(KV_HEADS)))


def test_preempted_prefill(engines):
    """A layer-wise prefill preempted between its chunks (a decoding
    request that came first needs its next block): its offer is
    cancelled before the forward writes its freed blocks again
    (handle_preemptions), the decode that fetched it early gets load
    errors and recomputes, and the prefill, run again, finishes without
    params (its decode computes the prompt); every block is free at the
    end."""
    # 8 usable blocks, 3 tokens a step: "long" (64 tokens) decodes a
    # token a step, req-pe prefills 2; at long's 81st token req-pe holds
    # 3 blocks (32 tokens), none is free, and vLLM preempts req-pe
    p = engines(per_layer=True, chunk=3, num_blocks=9)
    d = engines()
    p_free = p.free_blocks()
    p.add("long", prompt_of(64, 37), 40)
    run([p], lambda: len(p.tokens["long"]) >= 1)
    prompt = prompt_of(48, 38)
    p.add("req-pe", prompt, 1, {"do_remote_decode": True})
    p.step()  # its first chunk: offered
    d.add("req-pe", prompt, 2, early_params(p, "req-pe"))
    d.step()
    # what the worker knows when the preempting step's forward is about
    # to write its first layer (wait_for_layer_load)
    w, before = worker(p), []
    wait_layer = w.wait_layer

    def watch(name: str) -> None:
        m = sender(p)._meta
        if name == p.layer_names[0] and m is not None and \
                "req-pe" in m.lw_dropped:
            before.append("req-pe" in sender(p)._offers)
        wait_layer(name)
    w.wait_layer = watch
    run([p], lambda: p.sched.requests["req-pe"].num_preemptions > 0)
    assert before == [False]  # cancelled before the forward (once)
    run([p, d], lambda: "req-pe" in d.outputs and "req-pe" in p.outputs
        and "long" in p.outputs, timeout=30)
    assert load_errors(d)
    assert d.computed["req-pe"][0] == 48  # recomputed
    assert p.outputs["req-pe"].kv_transfer_params is None
    assert p.free_blocks() == p_free


def test_decode_layer_load_daemon_gone(engines, own_daemon, monkeypatch):
    """layerwise_load with the decode's client given up (the daemon
    killed, the library's reconnection off) when vLLM schedules the
    synchronous load: the load fails into load errors and a recompute,
    and reports no finished_recving (vLLM asserts that a request in
    finished_recving waits for its KV or has finished: this one runs)."""
    monkeypatch.setenv("KVXFER_RECONNECT", "0")
    p = engines(sock=own_daemon.sock, per_layer=True)
    d = engines(sock=own_daemon.sock, per_layer=True, salt=0.5,
                extra={"layerwise_load": True})
    prompt = prompt_of(40, 39)
    params = prefill(p, "req-lg", prompt)
    own_daemon.kill9()
    d.step()  # its poll finds the daemon gone: the client is closed
    assert worker(d).client is None
    d.add("req-lg", prompt, 2, params)
    run([d], lambda: "req-lg" in d.outputs)
    assert not any("req-lg" in (k.finished_recving or ())
                   for k in d.kv_outputs)
    assert load_errors(d)
    assert d.computed["req-lg"][0] == 1  # scheduled as loaded
    assert sum(d.computed["req-lg"]) > 40  # then recomputed
    assert d.tokens["req-lg"] == [TOKEN] * 2


def test_decode_layer_load_prefix_hit(engines):
    """layerwise_load with the decode's prefix cache holding 32 of 40
    tokens: the synchronous fetch moves tokens 32..39 only, the decode
    computes the last prompt token, and its blocks hold its own KV for
    0..31 and the prefill's for 32..38; one transfer of 8 tokens' bytes
    in the metrics."""
    p = engines(per_layer=True)
    d = engines(per_layer=True, salt=0.5, extra={"layerwise_load": True})
    prompt = prompt_of(40, 40)
    d.add("warm", prompt[:33], 1)  # caches two full blocks (32 tokens)
    run([d], lambda: "warm" in d.outputs)
    since = len(d.kv_outputs)
    params = prefill(p, "req-lp", prompt)
    d.add("req-lp", prompt, 2, params)
    seen = {}

    def after(e: Engine, r: int, layer: int) -> None:
        if layer == LAYERS - 1 and "kv" not in seen and \
                "req-lp" in e.sched.requests:
            seen["kv"] = d.kv_of("req-lp", 40)
    d.after_layer = after
    run([p, d], lambda: "req-lp" in d.outputs)
    assert d.computed["req-lp"][0] == 1
    assert not load_errors(d)
    for layer in range(LAYERS):
        kv = seen["kv"][layer]
        assert torch.equal(kv[:32], pattern(prompt, 0, 32, layer,
                                            range(KV_HEADS), 0.5))
        assert torch.equal(kv[32:39], pattern(prompt, 32, 39, layer,
                                              range(KV_HEADS)))
    moved = [b for k in d.kv_outputs[since:] if k.kv_connector_stats
             for b in k.kv_connector_stats.data["bytes_transferred"]]
    assert moved == [8 * LAYERS * KV_HEADS * 2 * HEAD * 4]  # float32


def test_preempted_prefill_whole(engines):
    """layerwise false: the reservation reserve_many made when the
    prefill was first scheduled outlives its preemption (nothing was
    published yet) and is published at its finish with the blocks it
    was computed into again; the decode gets every byte."""
    p = engines(per_layer=True, chunk=3, num_blocks=9,
                extra={"layerwise": False})
    d = engines(salt=0.5)
    p_free = p.free_blocks()
    p.add("long", prompt_of(64, 37), 40)
    run([p], lambda: len(p.tokens["long"]) >= 1)
    prompt = prompt_of(48, 38)
    p.add("req-pw", prompt, 1, {"do_remote_decode": True})
    run([p], lambda: p.sched.requests["req-pw"].num_preemptions > 0)
    run([p], lambda: "req-pw" in p.outputs and "long" in p.outputs,
        timeout=30)
    params = p.outputs["req-pw"].kv_transfer_params
    assert params is not None
    d.add("req-pw", prompt, 2, dict(params))
    got = {}

    def loaded():
        if landed(d, "req-pw") and not got:
            got["kv"] = d.kv_of("req-pw", 47)
        return "req-pw" in d.outputs and p.free_blocks() == p_free
    run([p, d], loaded)
    assert not load_errors(d)
    assert d.computed["req-pw"][0] == 1
    for layer in range(LAYERS):
        assert torch.equal(got["kv"][layer],
                           pattern(prompt, 0, 47, layer, range(KV_HEADS)))
