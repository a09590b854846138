"""A stand-in for the parts of TensorRT-LLM that kvxfer.trtllm touches,
with the names, import paths and method signatures TensorRT-LLM has, so
that the transceiver can be driven as the PyTorch executor drives it
without TensorRT-LLM's C++ bindings or a GPU.

Written (no code copied) from these files of NVIDIA/TensorRT-LLM, read
from a stored index of its main branch of 2026:

- tensorrt_llm/_torch/disaggregation/kv_cache_transceiver.py at
  0b42ceaf8df61f7056963d1b34a53a3a684595de: the ``KvCacheTransceiver`` ABC
  (abstract: respond_and_send_async, request_and_receive_sync,
  request_and_receive_async, check_context_transfer_status(
  at_least_request_num, mark_complete=False), check_gen_transfer_status(
  at_least_request_num), check_gen_transfer_complete, cancel_request ->
  bool, prepare_context_requests, get_disaggregated_params; with defaults:
  has_inflight_transfer, supports_inflight_request_cancellation,
  has_poisoned_transfer_buffer, commit_blocks_for_reuse, shutdown, ...),
  ``CtxTransferStatus`` and ``GenTransferStatus`` (NamedTuples),
  ``create_kv_cache_transceiver(mapping, dist, kv_cache_manager,
  attention_type, cache_transceiver_config, mamba_cache_manager=None)``;
- tensorrt_llm/_torch/disaggregation/orchestration/coordinator.py at
  05132475bfc2498e0762f808d73619ea70941ef6: how the executor calls it
  (:class:`Executor` below follows it);
- tensorrt_llm/_torch/disaggregation/transceiver.py at
  00620eb025e7c24895986e1042380bd1be4426d9 (``KvCacheTransceiverV2``): the
  ``ContextPhaseParams`` keywords, ``dist.broadcast`` / ``allgather`` /
  ``pp_allgather``, the block list cut to ceil(prompt_len /
  tokens_per_block);
- tensorrt_llm/disaggregated_params.py at
  01009a33a704c61e2c183c40514d7fb59159ab09: ``DisaggregatedParams``,
  ``DisaggScheduleStyle``;
- tensorrt_llm/_torch/disaggregation/native/auxiliary.py at
  14e2dcd60eaed301d67c7eb73477aeb1ddefe030: what a generation-first
  transfer carries (``request.get_last_tokens()``,
  ``request.py_draft_tokens``), and V2's ``_apply_aux`` (transceiver.py
  above): ``py_first_gen_tokens``, ``py_draft_tokens``,
  ``context_phase_params``;
- tensorrt_llm/_torch/pyexecutor/resource_manager.py (KVCacheManager:
  pp_layers, num_layers, num_kv_heads, num_kv_heads_per_layer,
  total_num_kv_heads_per_layer, head_dim, tokens_per_block, kv_factor,
  dtype, get_cache_indices(request, window_size=None),
  get_unique_primary_pool()) as of 001541bad83b84ae4c5c4a279e464572d5f690f7;
  the pool's shape [blocks, layers, kv_factor, heads*tokens*head_dim]
  from cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp
  (WindowBlockManager::allocatePools), index excerpts, commit not pinned;
- cpp/include/tensorrt_llm/batch_manager/llmRequest.h (index excerpt,
  commit not pinned): the ``LlmRequestState`` names and values.

The values of ``LlmRequestState`` that this tree's excerpt lacked
(``DISAGG_CONTEXT_WAIT_SCHEDULER``) are made up; kvxfer.trtllm uses the
names only. What is not here was not needed: LlmRequest has only the
fields the transceiver and the coordinator read.
"""

from __future__ import annotations

import enum
import math
import random
import sys
import threading
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional

import torch

import kvxfer

# -- tensorrt_llm.bindings ---------------------------------------------------


class LlmRequestState(enum.IntEnum):
    UNKNOWN = 0
    ENCODER_INIT = 1
    DISAGG_GENERATION_INIT = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    CONTEXT_INIT = 10
    DISAGG_CONTEXT_INIT_AND_TRANS = 11
    DISAGG_GENERATION_TRANS_COMPLETE = 12
    GENERATION_IN_PROGRESS = 13
    GENERATION_TO_COMPLETE = 14
    GENERATION_COMPLETE = 20
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 21
    DISAGG_CONTEXT_COMPLETE = 22
    DISAGG_CONTEXT_WAIT_SCHEDULER = 23  # made up: not in the excerpt
    DISAGG_TRANS_ERROR = -1


class DataType(enum.IntEnum):
    """tensorrt_llm.bindings.DataType (the names kvxfer.trtllm maps)."""

    FLOAT = 0
    HALF = 1
    INT8 = 2
    BF16 = 7
    FP8 = 8


_TORCH = {DataType.FLOAT: torch.float32, DataType.HALF: torch.float16,
          DataType.BF16: torch.bfloat16, DataType.INT8: torch.int8}


# -- tensorrt_llm.bindings.executor ------------------------------------------


class ContextPhaseParams:
    """The binding's keyword constructor; attributes as its properties."""

    def __init__(self, first_gen_tokens: Optional[List[int]], req_id: int,
                 opaque_state: Optional[bytes],
                 draft_tokens: Optional[List[int]],
                 ctx_dp_rank: Optional[int] = None,
                 disagg_info_endpoint: Optional[str] = None) -> None:
        self.first_gen_tokens = list(first_gen_tokens or [])
        self.req_id = req_id
        self.opaque_state = opaque_state
        self.draft_tokens = draft_tokens
        self.ctx_dp_rank = ctx_dp_rank
        self.disagg_info_endpoint = disagg_info_endpoint


# -- tensorrt_llm.disaggregated_params ---------------------------------------


class DisaggScheduleStyle(enum.IntEnum):
    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


@dataclass
class DisaggregatedParams:
    request_type: Optional[str] = None
    first_gen_tokens: Optional[List[int]] = None
    ctx_request_id: Optional[int] = None
    opaque_state: Optional[bytes] = None
    draft_tokens: Optional[List[int]] = None
    disagg_request_id: Optional[int] = None
    ctx_dp_rank: Optional[int] = None
    ctx_info_endpoint: Optional[Any] = None
    schedule_style: Optional[DisaggScheduleStyle] = None


# -- tensorrt_llm.llmapi.llm_args, tensorrt_llm.mapping -----------------------


@dataclass
class CacheTransceiverConfig:
    backend: Optional[str] = None
    transceiver_runtime: Optional[str] = "auto"
    max_tokens_in_buffer: Optional[int] = None
    kv_transfer_timeout_ms: Optional[int] = 60000
    kv_transfer_sender_future_timeout_ms: Optional[int] = 1000
    kv_transfer_poll_interval_ms: Optional[int] = 5000
    kv_cache_bounce_size_mb: int = 0
    enable_pipelined_transfer: bool = False


class Mapping:
    """rank = pp_rank * tp_size + tp_rank (cp 1)."""

    def __init__(self, world_size: int = 1, rank: int = 0,
                 tp_size: int = 1, pp_size: int = 1, cp_size: int = 1,
                 enable_attention_dp: bool = False) -> None:
        assert world_size == tp_size * pp_size * cp_size
        self.world_size, self.rank = world_size, rank
        self.tp_size, self.pp_size, self.cp_size = tp_size, pp_size, cp_size
        self.enable_attention_dp = enable_attention_dp
        self.tp_rank = rank % tp_size
        self.pp_rank = rank // (tp_size * cp_size)
        self.gpus_per_node = 8

    def pp_layers(self, num_layers: int) -> List[int]:
        """This PP rank's layers: contiguous, the first ranks one more."""
        per = [len(a) for a in _split(num_layers, self.pp_size)]
        start = sum(per[:self.pp_rank])
        return list(range(start, start + per[self.pp_rank]))


def _split(n: int, parts: int) -> List[List[int]]:
    base, extra = divmod(n, parts)
    out, at = [], 0
    for p in range(parts):
        k = base + (1 if p < extra else 0)
        out.append(list(range(at, at + k)))
        at += k
    return out


# -- tensorrt_llm._torch.distributed.communicator.Distributed ----------------


class _Exchange:
    """The ranks of one instance, as threads of this process."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: List[Any] = [None] * n

    def gather(self, rank: int, obj: Any) -> List[Any]:
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class Distributed:
    """The collectives the transceivers call, over threads."""

    def __init__(self, mapping: Mapping, ex: _Exchange) -> None:
        self.mapping, self.ex = mapping, ex
        self.rank, self.world_size = mapping.rank, mapping.world_size
        self.tp_size, self.pp_size = mapping.tp_size, mapping.pp_size

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self.ex.gather(self.rank, obj)[root]

    def allgather(self, obj: Any) -> List[Any]:
        return self.ex.gather(self.rank, obj)

    def pp_allgather(self, obj: Any) -> List[Any]:
        tp = self.mapping.tp_size
        every = self.ex.gather(self.rank, obj)
        return [every[p * tp + self.mapping.tp_rank]
                for p in range(self.mapping.pp_size)]

    def tp_allgather(self, obj: Any) -> List[Any]:
        tp = self.mapping.tp_size
        every = self.ex.gather(self.rank, obj)
        return every[self.mapping.pp_rank * tp:(self.mapping.pp_rank + 1)
                     * tp]


# -- the transceiver ABC -----------------------------------------------------


class CtxTransferStatus(NamedTuple):
    completed_request_ids: List[int]
    error_request_ids: List[int]


class GenTransferStatus(NamedTuple):
    completed_request_ids: List[int]
    error_request_ids: List[int]
    cancelled_requests: List[Any]


class KvCacheTransceiver(ABC):
    """The ABC's methods and defaults (signatures only)."""

    kv_transfer_timeout_ms: Optional[int]

    @property
    def pipeline_transfer_enabled(self) -> bool:
        return False

    def has_inflight_transfer(self, req: Any) -> bool:
        return False

    def has_retired_send_session(self, req: Any) -> bool:
        return False

    @abstractmethod
    def respond_and_send_async(self, req: Any) -> None: ...

    @abstractmethod
    def request_and_receive_sync(self, req: Any) -> None: ...

    @abstractmethod
    def request_and_receive_async(self, req: Any) -> None: ...

    @abstractmethod
    def check_context_transfer_status(
            self, at_least_request_num: Optional[int],
            mark_complete: bool = False) -> CtxTransferStatus: ...

    @abstractmethod
    def check_gen_transfer_status(
            self, at_least_request_num: Optional[int]) -> GenTransferStatus:
        ...

    @abstractmethod
    def check_gen_transfer_complete(self) -> bool: ...

    @abstractmethod
    def cancel_request(self, req: Any) -> bool: ...

    def supports_inflight_request_cancellation(self) -> bool:
        return False

    def has_poisoned_transfer_buffer(self) -> bool:
        return False

    @abstractmethod
    def prepare_context_requests(self, requests: List[Any]) -> None: ...

    @abstractmethod
    def get_disaggregated_params(self) -> Dict[str, Any]: ...

    def commit_blocks_for_reuse(self, req: Any) -> None:
        pass

    def get_data_transceiver_state(self) -> bytes:
        return b""

    def get_status_dump(self) -> str:
        return ""

    def shutdown(self) -> None:
        pass


class EngineTransceiver(KvCacheTransceiver):
    """What the stand-in's own create_kv_cache_transceiver returns (the
    engine's transceiver, to be replaced by kvxfer.trtllm.install)."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.kv_transfer_timeout_ms = None

    def respond_and_send_async(self, req: Any) -> None: ...
    def request_and_receive_sync(self, req: Any) -> None: ...
    def request_and_receive_async(self, req: Any) -> None: ...

    def check_context_transfer_status(self, at_least_request_num: Any,
                                      mark_complete: bool = False) -> Any:
        return CtxTransferStatus([], [])

    def check_gen_transfer_status(self, at_least_request_num: Any) -> Any:
        return GenTransferStatus([], [], [])

    def check_gen_transfer_complete(self) -> bool:
        return True

    def cancel_request(self, req: Any) -> bool:
        return True

    def prepare_context_requests(self, requests: List[Any]) -> None: ...

    def get_disaggregated_params(self) -> Dict[str, Any]:
        return {}


def create_kv_cache_transceiver(mapping: Any, dist: Any,
                                kv_cache_manager: Any, attention_type: Any,
                                cache_transceiver_config: Any,
                                mamba_cache_manager: Any = None) -> Any:
    if cache_transceiver_config is None or \
            cache_transceiver_config.backend is None:
        return None
    return EngineTransceiver(mapping, dist, kv_cache_manager)


# -- LlmRequest and KVCacheManager -------------------------------------------


class LlmRequest:
    """The fields of tensorrt_llm._torch.pyexecutor.llm_request.LlmRequest
    the transceivers read and write."""

    def __init__(self, request_id: int, prompt_len: int,
                 disagg: Optional[DisaggregatedParams] = None,
                 context_only: bool = False) -> None:
        self.request_id = request_id
        self.py_request_id = request_id
        self.prompt_len = prompt_len
        self.py_disaggregated_params = disagg
        self.context_phase_params: Optional[ContextPhaseParams] = None
        self.is_context_only_request = context_only
        self.is_generation_only_request = not context_only and \
            disagg is not None
        self.state = LlmRequestState.DISAGG_GENERATION_INIT \
            if self.is_generation_only_request else \
            LlmRequestState.CONTEXT_INIT
        self.last_tokens: List[int] = [0]  # the prefill's sampled token
        self.py_draft_tokens: List[int] = []
        self.py_first_gen_tokens: Optional[List[int]] = None

    def get_last_tokens(self) -> List[int]:
        """The last token of each beam (the binding's get_last_tokens)."""
        return list(self.last_tokens)


class BlockAllocator:
    """One instance's block ids: every rank of it gets the same (one
    scheduler decides for all, as TensorRT-LLM's does), shuffled."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: Dict[int, List[int]] = {}

    def table(self, request_id: int, num_tokens: int,
              tokens_per_block: int) -> List[int]:
        if request_id not in self.tables:
            n = -(-num_tokens // tokens_per_block)
            self.tables[request_id], self.free = self.free[:n], \
                self.free[n:]
        return self.tables[request_id]


class KVCacheManager:
    """One rank's KV cache manager: the primary pool is a CPU tensor in
    a kvxfer.HostBuffer, [blocks, local layers, kv_factor,
    heads * tokens_per_block * head_dim]."""

    def __init__(self, mapping: Mapping, alloc: BlockAllocator, *,
                 num_layers: int, num_kv_heads: Any, head_dim: int,
                 tokens_per_block: int, num_blocks: int,
                 dtype: DataType = DataType.HALF, kv_factor: int = 2,
                 extra_tokens: int = 0) -> None:
        self.mapping, self.alloc = mapping, alloc
        self.pp_layers = mapping.pp_layers(num_layers)
        self.num_layers = num_layers
        self.num_local_layers = len(self.pp_layers)
        tp = 1 if mapping.enable_attention_dp else mapping.tp_size
        self.num_kv_heads = num_kv_heads
        heads = num_kv_heads if isinstance(num_kv_heads, int) else \
            num_kv_heads[0]
        per = (heads + tp - 1) // tp
        self.num_kv_heads_per_layer = [per] * self.num_local_layers
        # per TP rank, as TensorRT-LLM's is (not the model's total)
        self.total_num_kv_heads_per_layer = [per] * num_layers
        self.head_dim = head_dim
        self.tokens_per_block = tokens_per_block
        self.kv_factor = kv_factor
        self.dtype = dtype
        self.extra_tokens = extra_tokens
        tdt = _TORCH.get(dtype, torch.uint8)
        shape = (num_blocks, self.num_local_layers, kv_factor,
                 per * tokens_per_block * head_dim)
        size = math.prod(shape) * torch.tensor([], dtype=tdt).element_size()
        self.buffer = kvxfer.HostBuffer(size)
        self.pool = self.buffer.torch(tdt, shape)
        self.pool.zero_()

    def get_unique_primary_pool(self) -> torch.Tensor:
        return self.pool

    def get_cache_indices(self, request: LlmRequest,
                          window_size: Optional[int] = None) -> List[int]:
        # a generation request holds room for the tokens it will decode:
        # more blocks than its prompt's
        return list(self.alloc.table(request.py_request_id,
                                     request.prompt_len + self.extra_tokens,
                                     self.tokens_per_block))

    def view(self) -> torch.Tensor:
        """[blocks, layers, kv, heads, tokens, dim] of the pool."""
        return self.pool.view(self.pool.shape[0], self.num_local_layers,
                              self.kv_factor,
                              self.num_kv_heads_per_layer[0],
                              self.tokens_per_block, self.head_dim)


# -- installing the modules --------------------------------------------------

_MODULES = {
    "tensorrt_llm": {},
    "tensorrt_llm.bindings": {"LlmRequestState": LlmRequestState,
                              "DataType": DataType},
    "tensorrt_llm.bindings.executor": {
        "ContextPhaseParams": ContextPhaseParams},
    "tensorrt_llm.disaggregated_params": {
        "DisaggregatedParams": DisaggregatedParams,
        "DisaggScheduleStyle": DisaggScheduleStyle},
    "tensorrt_llm.llmapi": {},
    "tensorrt_llm.llmapi.llm_args": {
        "CacheTransceiverConfig": CacheTransceiverConfig},
    "tensorrt_llm.mapping": {"Mapping": Mapping},
    "tensorrt_llm._torch": {},
    "tensorrt_llm._torch.disaggregation": {},
    "tensorrt_llm._torch.disaggregation.kv_cache_transceiver": {
        "KvCacheTransceiver": KvCacheTransceiver,
        "CtxTransferStatus": CtxTransferStatus,
        "GenTransferStatus": GenTransferStatus,
        "create_kv_cache_transceiver": create_kv_cache_transceiver},
    # where the executor's creator imports it by name
    "tensorrt_llm._torch.pyexecutor": {},
    "tensorrt_llm._torch.pyexecutor.py_executor_creator": {
        "create_kv_cache_transceiver": create_kv_cache_transceiver},
}


def install_modules() -> None:
    """Put the stand-in's modules in sys.modules under TensorRT-LLM's
    names (replacing a real TensorRT-LLM: the tests run against this)."""
    for name, attrs in _MODULES.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # type: ignore[attr-defined]  # a package
        sys.modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, mod)
