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

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata, KVConnectorMetadata)

import kvxfer
from kvxfer.vllm.hybrid import Table
from kvxfer.vllm.pace import pace_config

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
    groups: List[Table] = field(default_factory=list)  # hybrid models


@dataclass
class Recv:
    """A decode request to fetch: the prefill's params, this request's
    blocks (all of its prompt's, in order) and the tokens it holds."""

    key: bytes
    params: bytes
    block_ids: List[int]
    skip_tokens: int
    groups: List[Table] = field(default_factory=list)  # hybrid models
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
    # the daemon address of every rank, in kvxfer rank order: once, after
    # vLLM handed the scheduler its workers' handshake metadata
    addresses: Optional[List[str]] = None
    # layer-wise offers (layerwise.py): this step's chunks; the finished
    # requests (True: sent, report once the offer ends; False: aborted,
    # cancel it first); the preempted ones (cancel, report nothing)
    chunks: Dict[str, LayerChunk] = field(default_factory=dict)
    lw_finished: Dict[str, bool] = field(default_factory=dict)
    lw_dropped: Set[str] = field(default_factory=set)
    # the step runs a forward (tokens scheduled): the workers set their
    # GPU pace (pace.py)
    forward: bool = False


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler at start-up (vLLM's
    get_handshake_metadata): its kvxfer rank and its daemon's address."""

    rank: int
    address: str
    pools: List[int] = field(default_factory=list)  # its tables' pools


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


# -- what the connector refuses at __init__ ---------------------------------


def recompute_threshold(extra: Dict[str, Any]) -> int:
    """kv_recompute_threshold (vLLM's name, as its NIXL connector reads
    it), or recompute_below_tokens (this connector's earlier name): a
    decode missing fewer prompt tokens than this computes them itself.
    Default 0: always fetch what is missing."""
    got = {k: extra[k] for k in ("kv_recompute_threshold",
                                 "recompute_below_tokens") if k in extra}
    vals = set()
    for k, v in got.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise kvxfer.InvalidArgument(
                -1, f"kv_connector_extra_config.{k}: {v!r}, expected a "
                "token count (an integer >= 0)")
        vals.add(v)
    if len(vals) > 1:
        raise kvxfer.InvalidArgument(
            -1, "kv_connector_extra_config: kv_recompute_threshold "
            f"{got['kv_recompute_threshold']} and recompute_below_tokens "
            f"{got['recompute_below_tokens']} differ (recompute_below_tokens"
            " is the old name of kv_recompute_threshold: give one)")
    return vals.pop() if vals else 0


def check_config(vllm_config: "VllmConfig") -> None:
    """Refuse, naming the option, a configuration this connector cannot
    serve: at __init__, before vLLM allocates anything, rather than at
    register_kv_caches or at the first transfer."""
    extra = _extra(vllm_config)
    _instance_id(vllm_config)
    t = extra.get("timeout_s", 10.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or \
            not t > 0:
        raise kvxfer.InvalidArgument(
            -1, f"kv_connector_extra_config.timeout_s: {t!r}, expected "
            "seconds > 0")
    recompute_threshold(extra)
    pace_config(extra)
    pc = vllm_config.parallel_config
    world = pc.tensor_parallel_size * pc.pipeline_parallel_size
    addrs = extra.get("rank_addresses")
    if addrs is not None:
        if not isinstance(addrs, (list, tuple)) or \
                not all(isinstance(a, str) and a for a in addrs):
            raise kvxfer.InvalidArgument(
                -1, "kv_connector_extra_config.rank_addresses: expected a "
                "list of daemon addresses (kvxfer rank order)")
        if len(addrs) != world:
            raise kvxfer.InvalidArgument(
                -1, f"kv_connector_extra_config.rank_addresses: "
                f"{len(addrs)} addresses for {world} ranks (tensor_parallel"
                f"_size {pc.tensor_parallel_size} x pipeline_parallel_size "
                f"{pc.pipeline_parallel_size})")
    for opt in ("decode_context_parallel_size",
                "prefill_context_parallel_size"):
        n = int(getattr(pc, opt, 1) or 1)
        if n > 1:
            raise kvxfer.Unsupported(
                -1, f"parallel_config.{opt}: {n}; KvxferConnector moves "
                "the KV of instances without context parallelism")


def addresses_of(metadata: Dict[Any, Any], world: int
                 ) -> Optional[List[str]]:
    """The daemon address of every rank, in kvxfer rank order, from the
    workers' handshake metadata vLLM merged for the scheduler (keyed by
    (pp_rank, tp_rank)); None, logged, when a rank is missing."""
    by_rank: Dict[int, str] = {}
    for m in metadata.values():
        if isinstance(m, KvxferHandshakeMetadata):
            by_rank[m.rank] = m.address
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        log.error("kvxfer: no daemon address from ranks %s of %d in vLLM's "
                  "handshake metadata: the ranks do not join, transfers "
                  "fail (or set kv_connector_extra_config.rank_addresses)",
                  missing, world)
        return None
    return [by_rank[r] for r in range(world)]


def pools_of(metadata: Dict[Any, Any]) -> List[int]:
    """Rank 0's pool of each block table (its handshake metadata), which
    a hybrid request's reservation names."""
    for m in metadata.values():
        if isinstance(m, KvxferHandshakeMetadata) and m.rank == 0:
            return list(m.pools)
    return []
