"""The vLLM connector's metrics through vLLM's own classes (make
test-vllm): the workers' KVConnectorStats, added up by vLLM's
KVOutputAggregator, carried in the Scheduler's SchedulerStats, then
rebuilt by vLLM's KVConnectorLogging (the stats log line) and observed by
vLLM's KVConnectorProm into ``vllm:kvxfer_*`` Prometheus metrics."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any, Dict, List

import pytest
import torch
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.parser import text_string_to_metric_families

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging, KVConnectorProm)
from vllm.v1.request import RequestStatus

from conftest import Daemon
from harness import (HEAD, KV_HEADS, LAYERS, Engine, landed, load_errors,
                     pattern, prefill, prompt_of, run)

from test_layerwise import early_params


def metrics(e: Engine) -> Dict[str, float]:
    """The engine's stats as vLLM's Prometheus logger would export them:
    {sample name: value} of the vllm:kvxfer_* samples."""
    reg = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = partial(Gauge, registry=reg)
        _counter_cls = partial(Counter, registry=reg)
        _histogram_cls = partial(Histogram, registry=reg)
    prom = Prom(e.vc, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom.prom_metrics is not None  # build_prom_metrics made them
    for s in e.stats:
        if s.kv_connector_stats is not None:
            prom.observe(s.kv_connector_stats, 0)
    out = {}
    text = generate_latest(reg).decode()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("vllm:kvxfer_") and \
                    smp.labels.get("le") is None:
                out[smp.name] = smp.value
    return out


def log_line(e: Engine) -> List[str]:
    """The stats log line vLLM's KVConnectorLogging writes."""
    lg = KVConnectorLogging(e.vc.kv_transfer_config)
    for s in e.stats:
        if s.kv_connector_stats is not None:
            lg.observe(s.kv_connector_stats)
    lines: List[str] = []
    lg.log(lambda fmt, *a: lines.append(fmt % a))
    return lines


def kv_bytes(tokens: int) -> int:
    """The bytes of tokens' KV over every layer and head (float32 K|V):
    what the prefill wrote for them."""
    return tokens * LAYERS * KV_HEADS * 2 * HEAD * 4


def test_transfer_time_and_bytes(engines):
    """A 40-token prompt to a TP 2 decode: one transfer per decode rank,
    the bytes together those of the KV the prefill wrote (checked in the
    decode's blocks too), no failure; the log line says the same."""
    p = engines(per_layer=True)
    d = engines(tp=2, log_stats=True)
    prompt = prompt_of(40, 41)
    params = prefill(p, "req-m", prompt)
    d.add("req-m", prompt, 2, params)
    got = {}

    def loaded():
        if landed(d, "req-m") and not got:
            got["kv"] = [d.kv_of("req-m", 40, r) for r in range(2)]
        return "req-m" in d.outputs
    run([p, d], loaded)
    for layer in range(LAYERS):
        kv = torch.cat([got["kv"][r][layer] for r in range(2)], dim=1)
        assert torch.equal(kv, pattern(prompt, 0, 40, layer,
                                       range(KV_HEADS)))
    m = metrics(d)
    assert m["vllm:kvxfer_xfer_time_seconds_count"] == 2
    assert m["vllm:kvxfer_xfer_time_seconds_sum"] > 0
    assert m["vllm:kvxfer_bytes_transferred_count"] == 2
    assert m["vllm:kvxfer_bytes_transferred_sum"] == kv_bytes(40)
    assert m["vllm:kvxfer_num_failed_transfers_total"] == 0
    assert m["vllm:kvxfer_num_kv_expired_reqs_total"] == 0
    assert m["vllm:kvxfer_layerwise_exposed_seconds_count"] == 0
    (line,) = log_line(d)
    assert "Num successful transfers=2" in line, line
    assert f"Avg MB per transfer={round(kv_bytes(20) / 2 ** 20, 3)}" \
        in line, line


def test_prefix_held_counts_the_rest(engines):
    """The decode's prefix cache holds 32 of 40 tokens: the bytes are
    those of the 8 tokens that moved."""
    p, d = engines(), engines(log_stats=True)
    prompt = prompt_of(40, 42)
    d.add("warm", prompt[:33], 1)
    run([d], lambda: "warm" in d.outputs)
    params = prefill(p, "req-pm", prompt)
    d.add("req-pm", prompt, 2, params)
    run([p, d], lambda: "req-pm" in d.outputs)
    m = metrics(d)
    assert m["vllm:kvxfer_bytes_transferred_sum"] == kv_bytes(8)


def test_failed_transfer(engines):
    """A prefill aborted between its chunks: the decode's fetch fails (its
    blocks are load errors), one failed transfer."""
    p = engines(per_layer=True, chunk=32)
    d = engines(log_stats=True)
    prompt = prompt_of(100, 43)
    p.add("req-f", prompt, 1, {"do_remote_decode": True})
    p.step()
    d.add("req-f", prompt, 2, early_params(p, "req-f"))
    d.step()
    p.sched.finish_requests("req-f", RequestStatus.FINISHED_ABORTED)
    run([p, d], lambda: "req-f" in d.outputs)
    assert load_errors(d)
    m = metrics(d)
    assert m["vllm:kvxfer_num_failed_transfers_total"] == 1
    assert m["vllm:kvxfer_xfer_time_seconds_count"] == 0
    (line,) = log_line(d)
    assert "Num failed transfers=1" in line, line


@pytest.mark.parametrize("layerwise", [True, False])
def test_expired_lease(engines, tmp_path, layerwise):
    """An offer no decode fetches ends at its lease (offer_lease_ms 300):
    one expired request on the prefill, whose blocks are freed then."""
    dm = Daemon(tmp_path, "deadlines:\n  offer_lease_ms: 300\n")
    try:
        p = engines(sock=dm.sock, per_layer=True, log_stats=True,
                    extra={"layerwise": layerwise})
        p_free = p.free_blocks()
        prefill(p, "req-e", prompt_of(40, 44))
        run([p], lambda: p.free_blocks() == p_free)
        m = metrics(p)
        assert m["vllm:kvxfer_num_kv_expired_reqs_total"] == 1
        (line,) = log_line(p)
        assert "Num KV expired reqs=1" in line, line
    finally:
        p.close()
        dm.stop()


def test_layerwise_exposed_time(engines):
    """layerwise_load: the decode's forward waited for a layer the
    prefill had not marked yet; that wait is the exposed time."""
    p = engines(per_layer=True)
    d = engines(per_layer=True, log_stats=True,
                extra={"layerwise_load": True})
    prompt = prompt_of(40, 45)
    seen: Dict[str, Any] = {}
    go, passed0 = threading.Event(), threading.Event()
    d.after_layer = lambda e, r, layer: passed0.set() if layer == 0 else 0
    errors: List[BaseException] = []

    def decode() -> None:
        try:
            go.wait(10)
            d.add("req-x", prompt, 2, seen["early"])
            run([d], lambda: "req-x" in d.outputs)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            passed0.set()

    def prefill_layer(e: Engine, r: int, layer: int) -> None:
        if layer == 0 and "early" not in seen:
            seen["early"] = early_params(p, "req-x")
            go.set()
            assert passed0.wait(10)
    p.after_layer = prefill_layer
    t = threading.Thread(target=decode)
    t.start()
    p.add("req-x", prompt, 1, {"do_remote_decode": True})
    run([p], lambda: "req-x" in p.outputs)
    t.join(20)
    assert not errors, errors
    m = metrics(d)
    # the step that loaded (it waited for layer 1 at least)
    assert m["vllm:kvxfer_layerwise_exposed_seconds_count"] == 1
    assert m["vllm:kvxfer_layerwise_exposed_seconds_sum"] > 0
    assert m["vllm:kvxfer_bytes_transferred_sum"] == kv_bytes(40)
