"""Leases and the scheduler's daemon calls (issue 37, item 4), through
vLLM's own Scheduler and connectors (harness.Engine):

- the prefill sets its offers' lease (``lease_s``), carried in
  kv_transfer_params; the decode renews the leases of the requests
  waiting in its queue, so a queue longer than the lease still gets the
  prefill's bytes (and, without renewal, does not);
- the prefill's scheduler reserves a step's requests in one round trip
  (reserve_many), and a hung daemon costs a step at most its budget
  (``step_budget_ms``): its requests go without params and their decodes
  compute the prompt.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, List

import pytest
import torch

from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

import kvxfer
from kvxfer.vllm.scheduler import LEASE_KEY

from harness import (KV_HEADS, LAYERS, TOKEN, Engine, landed, load_errors,
                     pattern, prefill, prompt_of, run)


def hold_queue(d: Engine, seconds: float) -> None:
    """d's scheduler steps for ``seconds`` admitting no waiting request
    (its running slots taken), as a busy decode does: the connector's
    scheduler half runs every step, the queue does not move."""
    keep = d.sched.max_num_active_reqs
    d.sched.max_num_active_reqs = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            d.step()
            time.sleep(0.01)
    finally:
        d.sched.max_num_active_reqs = keep


def decode_after_queue(p: Engine, d: Engine, rid: str, seconds: float
                       ) -> List[torch.Tensor]:
    """A request prefilled on p waits ``seconds`` in d's queue, then runs:
    the KV d holds for its prompt once it has its first token."""
    prompt = prompt_of(40, 11)
    params = prefill(p, rid, prompt)
    assert params[LEASE_KEY] == 1000
    assert kvxfer.params_info(
        kvxfer.vllm.common._params_of(params)).lease_ms == 1000
    d.add(rid, prompt, 2, params)
    hold_queue(d, seconds)
    seen = {}

    def done() -> bool:
        if rid in d.sched.requests and "kv" not in seen and \
                d.sched.requests[rid].num_computed_tokens >= 40:
            seen["kv"] = d.kv_of(rid, 40)
        if landed(d, rid) and "kv" not in seen:
            seen["kv"] = d.kv_of(rid, 40)
        return rid in d.outputs
    run([p, d], done)
    assert d.tokens[rid] == [TOKEN] * 2
    return seen["kv"]


def test_queue_longer_than_the_lease_renewed(engines):
    """Lease 1 s set by the prefill, the request held 3 s in the decode's
    queue: the decode's scheduler renews it, and the decode gets every
    byte the prefill wrote."""
    p = engines(extra={"lease_s": 1})
    d = engines(salt=0.5)  # what it computes itself differs
    kv = decode_after_queue(p, d, "req-lr", 3.0)
    assert not load_errors(d)
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][:39],
                           pattern(prompt_of(40, 11), 0, 39, layer,
                                   range(KV_HEADS)))


def test_queue_longer_than_the_lease_not_renewed(engines):
    """The same without renewal (renew_leases false): the offer ends at
    its lease while the request waits, and the decode computes the prompt
    itself (its own KV, not the prefill's)."""
    p = engines(extra={"lease_s": 1})
    d = engines(salt=0.5, extra={"renew_leases": False})
    kv = decode_after_queue(p, d, "req-ln", 3.0)
    assert load_errors(d)  # the fetch found the offer gone
    for layer in range(LAYERS):
        assert not torch.equal(kv[layer][:39],
                               pattern(prompt_of(40, 11), 0, 39, layer,
                                       range(KV_HEADS)))


def count_calls(monkeypatch) -> dict:
    """How often the scheduler called the daemon, per Client method."""
    calls = {"reserve": 0, "reserve_many": 0, "items": 0}
    real_many, real_one = kvxfer.Client.reserve_many, kvxfer.Client.reserve

    def many(self, instance_id, items, *a, **kw):
        calls["reserve_many"] += 1
        calls["items"] += len(items)
        return real_many(self, instance_id, items, *a, **kw)

    def one(self, *a, **kw):
        calls["reserve"] += 1
        return real_one(self, *a, **kw)
    monkeypatch.setattr(kvxfer.Client, "reserve_many", many)
    monkeypatch.setattr(kvxfer.Client, "reserve", one)
    return calls


def test_a_step_reserves_in_one_round_trip(engines, monkeypatch):
    """Eight remote-decode prefills scheduled in one step: one
    reserve_many for all, no reserve per request; each decode then gets
    its prefill's bytes."""
    calls = count_calls(monkeypatch)
    p, d = engines(), engines(salt=0.5)
    prompts = {f"req-m{i}": prompt_of(20 + i, 30 + i) for i in range(8)}
    for rid, prompt in prompts.items():
        p.add(rid, prompt, 1, {"do_remote_decode": True})
    run([p], lambda: all(r in p.outputs for r in prompts))
    assert calls == {"reserve": 0, "reserve_many": 1, "items": 8}
    seen = {}
    for rid, prompt in prompts.items():
        params = p.outputs[rid].kv_transfer_params
        assert params and params["remote_num_tokens"] == len(prompt)
        d.add(rid, prompt, 1, dict(params))

    def done() -> bool:
        for rid, prompt in prompts.items():
            if landed(d, rid) and rid not in seen:
                seen[rid] = d.kv_of(rid, len(prompt) - 1)
        return all(r in d.outputs for r in prompts)
    run([p, d], done)
    assert not load_errors(d)
    for rid, prompt in prompts.items():
        n = len(prompt) - 1
        for layer in range(LAYERS):
            assert torch.equal(seen[rid][layer],
                               pattern(prompt, 0, n, layer, range(KV_HEADS)))


def scheduler_step(e: Engine) -> None:
    """One step of e's scheduler alone (its workers left out: they call
    the daemon too): every scheduled prompt computed, one token sampled."""
    so = e.sched.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = e.sched.requests[rid]
        sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens
                       else [])
    mro = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled)
    for eco in e.sched.update_from_output(so, mro).values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                e.outputs[o.request_id] = o


def test_hung_daemon_costs_a_step_its_budget(engines, own_daemon):
    """The daemon stopped (SIGSTOP) while eight prefills are scheduled:
    the scheduler's step comes back (the reservation gives up at
    step_budget_ms, 100 ms, where the per-request reserves waited
    timeout_s, 5 s, each), the requests finish without params (their
    decodes compute the prompt), and once the daemon runs again the next
    prefill is reserved and gets its params."""
    p = engines(sock=own_daemon.sock, extra={"step_budget_ms": 100})
    for i in range(8):
        p.add(f"req-h{i}", prompt_of(20, 50 + i), 1,
              {"do_remote_decode": True})
    pid = own_daemon.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        scheduler_step(p)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    # one budget, not a timeout_s (5 s) per request, as request_finished
    # waited before
    assert took < 2.5, took  # half a timeout_s: never one
    for i in range(8):
        out: Any = p.outputs[f"req-h{i}"]
        assert out.kv_transfer_params is None
    # left alone a second (QUIET_S), then reserved again
    time.sleep(1.1)
    prefill(p, "req-h-after", prompt_of(20, 60))


def test_hung_daemon_costs_an_abort_its_budget(engines, own_daemon):
    """The decode's release of an aborted request's offer (before vLLM
    gave it blocks) with the daemon stopped: the abort comes back under
    step_budget_ms (the release of before waited timeout_s, 5 s), and the
    decode takes requests again once the daemon runs."""
    p = engines(sock=own_daemon.sock)
    d = engines(sock=own_daemon.sock, extra={"step_budget_ms": 100})
    prompt = prompt_of(40, 70)
    params = prefill(p, "req-ha", prompt)
    p.step()  # published
    d.add("req-ha", prompt, 4, params)
    pid = own_daemon.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        d.sched.finish_requests("req-ha", RequestStatus.FINISHED_ABORTED)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < 2.5, took  # half a timeout_s: never one
    time.sleep(1.1)  # QUIET_S
    prompt = prompt_of(30, 71)
    params = prefill(p, "req-hb", prompt)
    d.add("req-hb", prompt, 2, params)
    run([p, d], lambda: "req-hb" in d.outputs)
    assert not load_errors(d)


@pytest.mark.parametrize("key,value", [("lease_s", -1), ("lease_s", "x"),
                                       ("step_budget_ms", 0),
                                       ("step_budget_ms", True)])
def test_bad_lease_config_is_refused_by_name(engines, key, value):
    """A lease or budget that is no number above 0 stops the engine at
    start-up, naming the key."""
    with pytest.raises(kvxfer.InvalidArgument,
                       match=f"kv_connector_extra_config.{key}"):
        engines(extra={key: value})


@pytest.mark.parametrize("layerwise", [True, False])
def test_prefill_longer_than_the_lease(engines, layerwise):
    """Lease 1 s; the prefill's 100 tokens computed in chunks of 32 over
    about 1.6 s (a busy prefill: 0.4 s a step). The offer is reserved at
    the first chunk, so its lease would end before the prompt is
    computed: the prefill's scheduler renews its own reservations while
    their requests compute, and the decode gets every byte."""
    p = engines(chunk=32, per_layer=True,
                extra={"lease_s": 1, "layerwise": layerwise})
    d = engines(salt=0.5)
    prompt = prompt_of(100, 80)
    p.add("req-pl", prompt, 1, {"do_remote_decode": True})
    while "req-pl" not in p.outputs:
        p.step()
        time.sleep(0.4)
    assert p.computed["req-pl"] == [32, 32, 32, 4]
    params = dict(p.outputs["req-pl"].kv_transfer_params)
    d.add("req-pl", prompt, 2, params)
    seen = {}

    def loaded() -> bool:
        if landed(d, "req-pl") and "kv" not in seen:
            seen["kv"] = d.kv_of("req-pl", 99)
        return "req-pl" in d.outputs
    run([p, d], loaded)
    assert not load_errors(d)
    assert d.computed["req-pl"][0] == 1
    for layer in range(LAYERS):
        assert torch.equal(seen["kv"][layer],
                           pattern(prompt, 0, 99, layer, range(KV_HEADS)))
