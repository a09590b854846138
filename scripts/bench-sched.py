#!/usr/bin/env python3
"""The prefill scheduler's time per step in kvxfer calls (issue 37, item
4): a step of N remote-decode prefills (default 256) reserved by the vLLM
connector's scheduler half in one round trip (reserve_many, what
kvxfer.vllm does now), against the baseline measured in the same run: one
synchronous reserve per request (what its request_finished did before).

Both go through the connector's own _Scheduler (its client, its outage
handling) against a real kvxferd of BUILD with one context rank joined
and a pool registered; the steps alternate the two forms, and every
reservation is released between steps (not timed), so the daemon holds
the same state for each. Prints each form's median and p90 per step and
the ratio.

    build/venv-vllm/bin/python scripts/bench-sched.py [--steps 30]
        [--requests 256] [--build build]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))

import kvxfer  # noqa: E402
from kvxfer.vllm.common import request_key  # noqa: E402
from kvxfer.vllm.scheduler import _Scheduler  # noqa: E402


def start_daemon(build: str, tmp: str) -> Tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "kvxferd.sock")
    cfg = os.path.join(tmp, "kvxferd.yaml")
    with open(cfg, "w") as f:
        f.write(f"socket:\n  path: {sock}\n")
    log = open(os.path.join(tmp, "kvxferd.log"), "wb")
    proc = subprocess.Popen([os.path.join(build, "kvxferd"), "--config",
                             cfg], stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 10
    while True:
        try:
            kvxfer.Client(sock, timeout=0.2).close()
            return proc, sock
        except kvxfer.Error:
            if proc.poll() is not None or time.monotonic() > end:
                raise SystemExit("kvxferd did not start (see "
                                 f"{tmp}/kvxferd.log)")
            time.sleep(0.02)


def scheduler(sock: str, instance: str) -> _Scheduler:
    """The connector's scheduler half, on a config with what it reads."""
    extra = {"socket": sock, "timeout_s": 10, "step_budget_ms": 10000}
    vc = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra,
                                           engine_id=instance),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                        pipeline_parallel_size=1))
    return _Scheduler(vc)  # type: ignore[arg-type]


def step_one_by_one(s: _Scheduler, reqs: List[Tuple[str, int]]
                    ) -> List[bytes]:
    """The baseline: request_finished's reserve, once per request."""
    return [s._daemon(kvxfer.Client.reserve, s.instance_id,
                      request_key(rid), n) for rid, n in reqs]


def step_batched(s: _Scheduler, reqs: List[Tuple[str, int]]) -> List[bytes]:
    """What the connector does now: the step's reservations together."""
    for rid, n in reqs:
        s._to_reserve[rid] = (request_key(rid), n)
    s._daemon_step()
    got = [s._reserved.pop(rid)[0] for rid, _ in reqs]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvx-bench-sched-")
    proc, sock = start_daemon(a.build, tmp)
    inst = "bench-prefill"
    try:
        rank = kvxfer.Client(sock, instance_id=inst, role="context",
                             parallel=kvxfer.Parallel(total_layers=2,
                                                      total_kv_heads=4))
        rank.join([rank.daemon_address])
        rank.create_host_pool(kvxfer.Layout.preset(
            "vllm-nhd", num_layers=2, num_heads=4, head_dim=64,
            dtype="bf16", tokens_per_block=16, num_blocks=64))
        s = scheduler(sock, inst)
        router = kvxfer.Client(sock)
        times: dict = {"one_by_one": [], "reserve_many": []}
        forms: Any = {"one_by_one": step_one_by_one,
                      "reserve_many": step_batched}
        n = 0
        for step in range(a.steps + 2):  # the first two warm up
            order = list(forms) if step % 2 else list(forms)[::-1]
            for name in order:
                reqs = [(f"req-{n + i}", a.tokens) for i in range(a.requests)]
                n += a.requests
                t0 = time.perf_counter()
                params = forms[name](s, reqs)
                took = time.perf_counter() - t0
                assert len(params) == a.requests and all(params)
                if step >= 2:
                    times[name].append(took * 1000)
                for p in params:  # untimed: the same daemon state each step
                    router.release(p)
        router.close()
        s.close()
        rank.close()
    finally:
        proc.terminate()
        proc.wait()
    print(f"prefill scheduler, kvxfer calls per step of {a.requests} "
          f"requests ({a.steps} steps each, alternating; "
          f"{os.cpu_count()} CPUs)")
    med = {}
    for name, ts in times.items():
        ts.sort()
        med[name] = statistics.median(ts)
        p90 = ts[int(0.9 * (len(ts) - 1))]
        print(f"  {name:13s} median {med[name]:8.2f} ms   p90 {p90:8.2f} ms"
              f"   per request {med[name] * 1000 / a.requests:7.1f} us")
    print(f"  ratio (one_by_one / reserve_many): "
          f"{med['one_by_one'] / med['reserve_many']:.1f}x")


if __name__ == "__main__":
    main()
