"""KvxferConnector: vLLM's KV connector API, handed to its scheduler
half or its worker half."""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Dict, List, Optional, Set,
                    Tuple)

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
    KVConnectorTransferResults, SupportsHMA)

from kvxfer.vllm.common import (KvxferConnectorMetadata,
                                KvxferHandshakeMetadata, check_config)
from kvxfer.vllm.hybrid import Tables
from kvxfer.vllm.scheduler import _Scheduler
from kvxfer.vllm.worker import _Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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
        return self._sched.build_connector_meta()

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

    def start_load_kv(self, forward_context: "ForwardContext",
                      **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request runs once its whole KV landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # the prefill publishes whole requests (request_finished)

    def wait_for_save(self) -> None:
        return

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

    def get_block_ids_with_load_errors(self) -> Set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()
