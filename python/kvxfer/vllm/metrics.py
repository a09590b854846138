"""The vLLM connector's metrics: vLLM's KVConnectorStats and
KVConnectorPromMetrics, so that ``vllm:kvxfer_*`` stands in vLLM's
``/metrics`` and its stats log beside ``vllm:nixl_*``, with the same
meanings where they overlap.

Each worker records its observations (worker.py, ``_Worker.tally``); vLLM
collects them every step (``get_kv_connector_stats``), adds the ranks'
together (``KVOutputAggregator``), hands them to its stat loggers in the
scheduler's stats, and each logger rebuilds them with
``build_kv_connector_stats`` (the log line) or observes them into the
Prometheus metrics ``build_prom_metrics`` made:

``vllm:kvxfer_xfer_time_seconds`` (histogram; nixl's
``vllm:nixl_xfer_time_seconds``)
    a fetch's time, from its submission by the decode's worker to its
    end seen by that worker (successful fetches, per rank);
``vllm:kvxfer_bytes_transferred`` (histogram; ``vllm:nixl_bytes_transferred``)
    the bytes a successful fetch wrote into the rank's KV cache (its
    tokens after those the decode held, times the rank's bytes a token;
    a hybrid model's: each table's, a sliding window's from its first
    kept block, a Mamba state's page once);
``vllm:kvxfer_num_failed_transfers`` (counter;
``vllm:nixl_num_failed_transfers``)
    fetches that failed (their blocks went to ``kv_load_failure_policy``):
    refused, ended with an error, or lost with the daemon; cancels are not
    failures;
``vllm:kvxfer_num_kv_expired_reqs`` (counter;
``vllm:nixl_num_kv_expired_reqs``, counted on the prefill instance)
    offers that no fetch took within their lease
    (``deadlines.offer_lease_ms``), per rank;
``vllm:kvxfer_layerwise_exposed_seconds`` (histogram; no nixl
equivalent)
    a decode step's time in ``wait_for_layer_load`` (``layerwise_load``):
    the part of a layer-wise load its forward did not hide.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Union

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvxfer.vllm.common import STAT_KEYS, new_tally

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# NixlPromMetrics' buckets, for side-by-side dashboards
TIME_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75,
                1.0, 5.0]
EXPOSED_BUCKETS = [0.0001, 0.0005, 0.001] + TIME_BUCKETS
BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]  # 2 KiB..8 GiB


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """An interval's observations of the connector's workers (their
    tally: a list per STAT_KEYS entry, serialisable as vLLM needs)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        for k in STAT_KEYS:  # an older worker's payload lacks a key
            self.data.setdefault(k, [])

    def reset(self) -> None:
        self.data: Dict[str, List[Union[int, float]]] = new_tally()

    def clone_and_reset(self) -> "KvxferConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in STAT_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k in STAT_KEYS:
                self.data[k].extend(other.data.get(k, ()))
        return self

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data["transfer_duration"])

    def reduce(self) -> Dict[str, Union[int, float]]:
        """The stats log line's values (NixlConnector's names where they
        mean the same)."""
        t = self.data["transfer_duration"]
        mb = [b / 2 ** 20 for b in self.data["bytes_transferred"]]
        exposed = self.data["layerwise_exposed_time"]
        n = len(t)
        out: Dict[str, Union[int, float]] = {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(sum(t) / n * 1e3, 3) if n else 0,
            "P90 xfer time (ms)": round(_p90(t) * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(sum(mb) / n, 3) if n else 0,
            "Throughput (MB/s)": round(sum(mb) / sum(t), 3)
            if n and sum(t) > 0 else 0,
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Num KV expired reqs": len(self.data["num_kv_expired_reqs"]),
            "Layer-wise exposed time (ms)": round(sum(exposed) * 1e3, 3),
        }
        return out


def _p90(xs: List[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


class KvxferPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvxfer_*`` Prometheus metrics (see the module)."""

    def __init__(self, vllm_config: "VllmConfig",
                 metric_types: Dict[type[PromMetric], type[PromMetricT]],
                 labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames,
                         per_engine_labelvalues)

        def hist(name: str, doc: str, buckets: List[float]) -> Any:
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc,
                                    buckets=buckets, labelnames=labelnames),
                per_engine_labelvalues)

        def counter(name: str, doc: str) -> Any:
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc,
                                  labelnames=labelnames),
                per_engine_labelvalues)

        self.hists = {
            "transfer_duration": hist(
                "vllm:kvxfer_xfer_time_seconds",
                "Histogram of kvxfer KV cache fetch times (a decode rank's "
                "fetch, from its submission to its end).", TIME_BUCKETS),
            "bytes_transferred": hist(
                "vllm:kvxfer_bytes_transferred",
                "Histogram of bytes a kvxfer KV cache fetch wrote into a "
                "decode rank's KV cache.", BYTES_BUCKETS),
            "layerwise_exposed_time": hist(
                "vllm:kvxfer_layerwise_exposed_seconds",
                "Histogram of a decode step's time waiting in "
                "wait_for_layer_load for KV layers in flight (layerwise_"
                "load): the transfer time the forward did not hide.",
                EXPOSED_BUCKETS),
        }
        self.counters = {
            "num_failed_transfers": counter(
                "vllm:kvxfer_num_failed_transfers",
                "Number of failed kvxfer KV cache fetches (refused, ended "
                "with an error, or lost with the daemon)."),
            "num_kv_expired_reqs": counter(
                "vllm:kvxfer_num_kv_expired_reqs",
                "Number of kvxfer offers no fetch took within their lease "
                "(deadlines.offer_lease_ms). NOTE: tracked on the prefill "
                "instance."),
        }

    def observe(self, transfer_stats_data: Dict[str, Any],
                engine_idx: int = 0) -> None:
        for k, h in self.hists.items():
            for v in transfer_stats_data.get(k, ()):
                h[engine_idx].observe(v)
        for k, c in self.counters.items():
            for v in transfer_stats_data.get(k, ()):
                c[engine_idx].inc(v)
