"""KvxferConnector: vLLM's KV connector API, handed to its scheduler
half or its worker half."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
    KVConnectorTransferResults, KVConnectorWorkerMetadata, SupportsHMA)

from kvxfer.vllm.bidi import check as check_bidi
from kvxfer.vllm.common import (KvxferConnectorMetadata,
                                KvxferHandshakeMetadata, check_config)
from kvxfer.vllm.hybrid import Tables
from kvxfer.vllm.metrics import KvxferConnectorStats, KvxferPromMetrics
from kvxfer.vllm.scheduler import _Scheduler
from kvxfer.vllm.worker import _Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT)
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class KvxferWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers tell the scheduler after a step (vLLM's
    build_connector_worker_meta, the ranks' aggregated): the pools of a
    client made (rank -> its tables' pool ids), which a hybrid request's
    reservation names. Here, not in common.py: the worker half imports
    no more of vLLM (tests/gpu/vllm_layerwise.py's shim)."""

    pools: Dict[int, List[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata
                  ) -> "KvxferWorkerMetadata":
        if isinstance(other, KvxferWorkerMetadata):
            self.pools.update(other.pools)
        return self


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector on kvxferd (see the module's documentation).

    The scheduler-side instance keeps the requests' transfer state and
    reserves offers; each worker-side instance is one kvxfer rank.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)
        check_config(vllm_config)
        # a hybrid model's KV cache groups as kvxfer block tables (refused
        # here, naming the group, when they cannot be)
        tables = Tables(kv_cache_config,
                        vllm_config.parallel_config.tensor_parallel_size)
        tables.check_parallel(
            vllm_config.parallel_config.tensor_parallel_size,
            vllm_config.model_config.get_total_num_kv_heads())
        check_bidi(vllm_config, tables)  # multi-turn reuse (bidi.py)
        self._sched: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(vllm_config, tables=tables)
        else:
            self._worker = _Worker(vllm_config, tables=tables)

    # -- scheduler side ---------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request,
                                                      num_computed_tokens)

    def on_new_request(self, request: "Request") -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def update_state_after_alloc(self, request: "Request",
                                 blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks,
                                             num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput"
                             ) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self,
                                connector_output: "KVConnectorOutput"
                                ) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: Any
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(
            self, request: "Request", block_ids: Tuple[List[int], ...]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM's hybrid memory allocator (SupportsHMA): the request's
        block ids of every KV cache group, each group a kvxfer table."""
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: Dict[Tuple[int, int], Any]) -> None:
        """Every worker's daemon address (get_handshake_metadata), which
        the scheduler hands its workers in the next step's metadata."""
        assert self._sched is not None
        self._sched.set_rank_addresses(metadata)

    def set_xfer_handshake_metadata(self, metadata: Dict[int, Any]
                                    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware(
            {(0, tp): m for tp, m in metadata.items()})

    # -- worker side ------------------------------------------------------

    def get_handshake_metadata(self) -> Optional[KvxferHandshakeMetadata]:
        assert self._worker is not None
        return self._worker.handshake()

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata
                           ) -> None:
        # before the forward: a preempted request's layer-wise offer is
        # cancelled before its freed blocks are written again
        assert self._worker is not None
        if isinstance(kv_connector_metadata, KvxferConnectorMetadata):
            self._worker.drop_preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext",
                      **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self._worker.save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self._worker.end_save(meta)

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        assert self._worker is not None
        return self._worker.get_finished()

    def get_transfer_results(self, finished_req_ids: Set[str]
                             ) -> KVConnectorTransferResults:
        """get_finished, and (hybrid models) the fetches that failed:
        vLLM takes those by request, as its block ids are per group."""
        assert self._worker is not None
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._worker.take_failed_recving())

    def build_connector_worker_meta(self) -> Optional[KvxferWorkerMetadata]:
        """The pools of a client the worker made anew (new ids), for the
        scheduler's hybrid reservations."""
        assert self._worker is not None
        pools = self._worker.new_pools()
        return None if pools is None else KvxferWorkerMetadata(pools=pools)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    # -- metrics (metrics.py) ---------------------------------------------

    def get_kv_connector_stats(self) -> Optional["KVConnectorStats"]:
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return None if data is None else KvxferConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> Optional["KVConnectorStats"]:
        return KvxferConnectorStats(data=data) if data is not None \
            else KvxferConnectorStats()

    @classmethod
    def build_prom_metrics(
            cls, vllm_config: "VllmConfig",
            metric_types: Dict[type["PromMetric"], type["PromMetricT"]],
            labelnames: List[str],
            per_engine_labelvalues: Dict[int, List[object]]
    ) -> Optional["KVConnectorPromMetrics"]:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()
