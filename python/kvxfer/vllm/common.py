"""What the vLLM connector's halves share: the params in
kv_transfer_params, request keys, the config, ranks and the metadata the
scheduler sends the workers each step."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import \
    KVConnectorMetadata

import kvxfer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

VLLM_VERSION = "0.33.0"  # the version the tests run against
MANY_MAX = 256  # kvx_publish / kvx_fetch with items: items a call

log = logging.getLogger("kvxfer.vllm")

# the key in kv_transfer_params that carries kvxfer's context params
PARAMS_KEY = "kvxfer_params"


def request_key(request_id: str) -> bytes:
    """The kvxfer key of a vLLM request id: its UTF-8, or, past kvxfer's
    128 bytes, a SHA-256 of it (vLLM's ids are ~50 bytes)."""
    k = request_id.encode()
    if len(k) <= kvxfer.MAX_KEY:
        return k
    return b"sha256:" + hashlib.sha256(k).hexdigest().encode()


def _b64(params: bytes) -> str:
    return base64.b64encode(params).decode()


def _params_of(p: Dict[str, Any]) -> bytes:
    try:
        return base64.b64decode(p[PARAMS_KEY], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise kvxfer.InvalidArgument(
            -1, f"kv_transfer_params[{PARAMS_KEY!r}] is not base64 kvxfer "
            f"params ({e})") from None


# -- what the scheduler tells the workers each step ------------------------


@dataclass
class Send:
    """A finished prefill request to publish: its blocks and tokens."""

    key: bytes
    block_ids: List[int]
    num_tokens: int


@dataclass
class Recv:
    """A decode request to fetch: the prefill's params, this request's
    blocks (all of its prompt's, in order) and the tokens it holds."""

    key: bytes
    params: bytes
    block_ids: List[int]
    skip_tokens: int
    sync: bool = False  # layerwise_load: the step's forward reads it
    num_tokens: int = 0  # the offer's tokens (the fetch moves the rest
    #                      after skip_tokens; the metrics' bytes)


@dataclass
class LayerChunk:
    """A prefill chunk of a request offered layer-wise: once this step's
    forward wrote a layer, that layer holds the request's tokens
    ``[0, tokens)``. ``publish``: its first chunk (the offer is
    published with ``blocks``); else ``blocks`` are appended."""

    key: bytes
    blocks: List[int]
    num_tokens: int
    tokens: int
    publish: bool


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers (vLLM pickles it to them)."""

    sends: Dict[str, Send] = field(default_factory=dict)
    recvs: Dict[str, Recv] = field(default_factory=dict)
    cancels: Set[str] = field(default_factory=set)
    # layer-wise offers (layerwise.py): this step's chunks; the finished
    # requests (True: sent, report once the offer ends; False: aborted,
    # cancel it first); the preempted ones (cancel, report nothing)
    chunks: Dict[str, LayerChunk] = field(default_factory=dict)
    lw_finished: Dict[str, bool] = field(default_factory=dict)
    lw_dropped: Set[str] = field(default_factory=set)


# -- the metrics' observations (metrics.py makes vLLM's stats of them) ------

# the same names and units as NixlConnector's where they overlap
STAT_KEYS = ("transfer_duration", "bytes_transferred",
             "num_failed_transfers", "num_kv_expired_reqs",
             "layerwise_exposed_time")


def new_tally() -> Dict[str, List[float]]:
    """An interval's observations: a list per STAT_KEYS entry."""
    return {k: [] for k in STAT_KEYS}


# -- the config --------------------------------------------------------------


def _extra(vllm_config: "VllmConfig") -> Dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config
                or {})


def _socket(extra: Dict[str, Any]) -> str:
    return str(extra.get("socket") or os.environ.get("KVXFER_SOCKET")
               or kvxfer.DEFAULT_SOCKET)


def _instance_id(vllm_config: "VllmConfig") -> str:
    extra = _extra(vllm_config)
    iid = extra.get("instance_id") or \
        vllm_config.kv_transfer_config.engine_id
    if not iid:
        raise kvxfer.InvalidArgument(
            -1, "kv_transfer_config: no engine_id and no "
            "kv_connector_extra_config.instance_id")
    return str(iid)


def parallel_rank(vllm_config: "VllmConfig") -> Tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) of this worker: vLLM's
    model-parallel groups when they are set up, else the parallel config's
    global rank (tp fastest, as vLLM numbers its workers)."""
    pc = vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    try:
        from vllm.distributed.parallel_state import (
            get_pp_group, get_tensor_model_parallel_rank,
            model_parallel_is_initialized)
        if model_parallel_is_initialized():
            return (get_tensor_model_parallel_rank(), tp,
                    get_pp_group().rank_in_group, pp)
    except ImportError:  # pragma: no cover - vLLM moved them
        pass
    r = pc.rank % (tp * pp)
    return r % tp, tp, r // tp, pp


def _role(kv_role: Optional[str]) -> kvxfer.Role:
    return {"kv_producer": kvxfer.Role.CONTEXT,
            "kv_consumer": kvxfer.Role.GENERATION}.get(kv_role or "",
                                                       kvxfer.Role.BOTH)
