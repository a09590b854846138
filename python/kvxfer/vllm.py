"""vLLM's KV connector on kvxfer: prefill/decode disaggregation in one
config line (tested against vLLM 0.33.0, the version this module pins)::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_both"}'

The flow is the one vLLM's proxy drives for its NIXL connector. A request
sent to the prefill instance with ``kv_transfer_params
{"do_remote_decode": true}`` and ``max_tokens 1`` finishes there; the
prefill scheduler reserves the request's offer on kvxferd
(:meth:`kvxfer.Client.reserve`) and returns its params, at once, in the
request's ``kv_transfer_params``; its workers publish the request's blocks
the next step and free them when kvxfer says the offer ended. The proxy
hands those params to the decode instance, whose scheduler allocates
blocks and whose workers fetch into them; the request runs once kvxfer's
COMPLETE arrives. Heterogeneous TP, PP and layouts between the two
instances are kvxferd's job; this module has no mapping code.

Faults, as vLLM expects them: a fetch that fails (the prefill instance
died, the offer timed out, params that do not fit) reports the request's
blocks from ``get_block_ids_with_load_errors`` so that vLLM's
``kv_load_failure_policy`` applies (``recompute``: the decode computes the
prompt itself); a decode request aborted while its KV moves is cancelled
(fenced: no byte is written after the CANCELLED event) before vLLM frees
its blocks; a decode that needs no transfer (its prefix cache holds the
whole prompt) or is aborted before it started releases the prefill's
blocks at once.

The daemon going away (a restart, an upgrade, a crash) costs the requests
in flight, never the engine: no exception from kvxfer leaves a method
vLLM's step calls. A decode's fetch in flight reports its blocks as load
errors (``kv_load_failure_policy``), a prefill's send is reported finished
so that its blocks are freed; while the daemon is gone, a prefill returns
no params (its decode computes the prompt) and a decode fetches nothing
(load errors). The library reconnects by itself (pools stay registered);
a client it gave up on (reconnection off, a call that timed out) is made
again here. The next requests go through kvxfer again, without an engine
restart. Each outage is logged once, and the return.

``kv_connector_extra_config`` keys (all optional):

``socket``
    kvxferd's socket (default ``$KVXFER_SOCKET``, else
    ``/run/kvxfer/kvxferd.sock``).
``timeout_s``
    the timeout of each call to the daemon (default 10 s).
``instance_id``
    this instance's kvxfer name (default vLLM's ``engine_id``).
``recompute_below_tokens``
    a decode that misses fewer prompt tokens than this (its prefix cache
    holds the rest) computes them itself and releases the prefill's
    blocks instead of fetching (default 0: always fetch what is missing).
``rank_addresses``
    the daemon address of every rank, in kvxfer rank order, when the
    ranks run on several nodes and torch.distributed is not set up to
    gather them (default: gathered, or this node's daemon for all).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)

import kvxfer
from kvxfer._outage import (DAEMON_GONE, Outage, gone_event, nudge,
                            retrying)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvxferConnector", "KvxferConnectorMetadata", "VLLM_VERSION",
           "layout_of_kv_caches"]

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


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers (vLLM pickles it to them)."""

    sends: Dict[str, Send] = field(default_factory=dict)
    recvs: Dict[str, Recv] = field(default_factory=dict)
    cancels: Set[str] = field(default_factory=set)


# -- the layout of vLLM's KV cache tensors ---------------------------------


def _layer_index(name: str) -> int:
    """The layer number in a vLLM layer name ("model.layers.3.self_attn
    .attn" -> 3), as vLLM's extract_layer_index finds it."""
    nums = [int(x) for x in re.findall(r"\.(\d+)\.", "." + name + ".")]
    if len(nums) != 1:
        raise kvxfer.InvalidArgument(
            -1, f"kv cache layer name {name!r}: expected exactly one layer "
            "number in it")
    return nums[0]


def layout_of_kv_caches(kv_caches: Dict[str, torch.Tensor], *,
                        head_size: int, head_size_v: Optional[int] = None,
                        block_size: int, num_blocks: Optional[int] = None,
                        use_mla: bool = False
                        ) -> Tuple[kvxfer.Layout, List[torch.Tensor],
                                   List[str]]:
    """The kvxfer layout of vLLM's per-layer KV cache views, and the
    memory regions it addresses.

    vLLM 0.33 views every attention layer's cache as ``[B, H, N, C]``
    (blocks, KV heads, tokens per block, content bytes as the cache dtype),
    C being a token's K then its V (``head_size + head_size_v`` elements;
    MLA: the latent, one head, no V), over one allocation whose physical
    order the resolved ``KVCacheLayout`` (LBNHC, LBHNC, BLHNC, ...) chose.
    The tensors' strides say where everything is, whatever that order:
    the layout takes its strides from them, and each (layer, K/V) part
    lies at its tensor's offset in the allocation behind it. Returns
    (layout, regions, layer names in layer order).
    """
    if not kv_caches:
        raise kvxfer.InvalidArgument(-1, "register_kv_caches: no KV caches")
    names = sorted(kv_caches, key=_layer_index)
    idx = [_layer_index(n) for n in names]
    if len(set(idx)) != len(idx):
        raise kvxfer.InvalidArgument(
            -1, f"kv caches: two tensors for one layer ({names})")
    first = kv_caches[names[0]]
    shape, stride, dtype = tuple(first.shape), first.stride(), first.dtype
    if first.dim() != 4:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: shape {shape}; this connector "
            "knows vLLM 0.33's [blocks, heads, tokens, content] views")
    hv = head_size if head_size_v is None else head_size_v
    if use_mla:
        hv = 0
    nb, heads, tpb, content = shape
    if content != head_size + hv:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: {content} elements per token and "
            f"head, expected head_size {head_size} + {hv}")
    if hv not in (0, head_size):
        raise kvxfer.Unsupported(
            -1, f"K head size {head_size} and V head size {hv} differ")
    if tpb != block_size:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: {tpb} tokens per kernel block, "
            f"vLLM's block size is {block_size} (kernel block splitting is "
            "not supported)")
    if stride[3] != 1:
        raise kvxfer.Unsupported(
            -1, f"kv cache of {names[0]}: a token's content is not "
            f"contiguous (strides {stride})")
    for n in names[1:]:
        t = kv_caches[n]
        if (tuple(t.shape), t.stride(), t.dtype) != (shape, stride, dtype):
            raise kvxfer.Unsupported(
                -1, f"kv caches of {names[0]} and {n} differ in shape, "
                "strides or dtype (hybrid models: not yet)")
    if num_blocks is not None and nb < num_blocks:
        raise kvxfer.InvalidArgument(
            -1, f"kv caches hold {nb} blocks, the config says {num_blocks}")
    es = first.element_size()
    # the allocations behind the views: one region each
    regions: List[torch.Tensor] = []
    bases: List[int] = []
    parts: List[Tuple[int, int]] = []
    for n in names:
        t = kv_caches[n]
        st = t.untyped_storage()
        base = st.data_ptr()
        if base not in bases:
            bases.append(base)
            regions.append(torch.empty(0, dtype=torch.uint8,
                                       device=t.device).set_(
                st, 0, (st.nbytes(),)))
        r = bases.index(base)
        off = t.data_ptr() - base
        parts.append((r, off))
        if hv:
            parts.append((r, off + head_size * es))
    layout = kvxfer.Layout.custom(
        num_layers=len(names), kv_factor=1 if hv == 0 else 2,
        num_heads=heads, head_dim=head_size, dtype=dtype,
        tokens_per_block=tpb, num_blocks=nb,
        kv_stride=head_size * es if hv else 0,
        block_stride=stride[0] * es, token_stride=stride[2] * es,
        head_stride=stride[1] * es, parts=parts, name="vllm")
    return layout, regions, names


# -- the connector ---------------------------------------------------------


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


class KvxferConnector(KVConnectorBase_V1):
    """vLLM's KV connector on kvxferd (see the module's documentation).

    The scheduler-side instance keeps the requests' transfer state and
    reserves offers; each worker-side instance is one kvxfer rank.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)
        self._sched: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(vllm_config)
        else:
            self._worker = _Worker(vllm_config)

    # -- scheduler side ---------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request,
                                                      num_computed_tokens)

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

    # -- worker side ------------------------------------------------------

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

    def get_block_ids_with_load_errors(self) -> Set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()


class _Scheduler:
    """The scheduler side: which requests fetch, publish, release or
    cancel, and the offers' params (kvx_reserve)."""

    def __init__(self, vllm_config: "VllmConfig") -> None:
        extra = _extra(vllm_config)
        self.socket = _socket(extra)
        self.timeout = float(extra.get("timeout_s", 10.0))
        self.instance_id = _instance_id(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.recompute_below = int(extra.get("recompute_below_tokens", 0))
        self._client: Optional[kvxfer.Client] = None
        self._meta = KvxferConnectorMetadata()
        self._inflight: Set[str] = set()  # fetches the workers run
        self._outage = Outage(log, f"kvxfer scheduler of {self.instance_id}")

    def client(self) -> kvxfer.Client:
        """A connection without Hello (the scheduler is no rank), made on
        first use: the workers' daemon is up by then. The library
        reconnects it when the daemon restarts; one it gave up on
        (reconnection off, a call that timed out) is made anew here."""
        c = self._client
        if c is not None and c.closed:
            c.close()
            c = self._client = None
        if c is None:
            c = self._client = kvxfer.Client(self.socket,
                                             timeout=self.timeout)
        return c

    def _daemon(self, fn: Any, *args: Any) -> Any:
        """fn(client, *args) on the daemon (kvxfer.Error when it fails;
        Closed while the daemon is gone, logged once per outage)."""
        try:
            c = self.client()
            nudge(c)
            out = retrying(c, fn, c, *args)
        except DAEMON_GONE as e:
            self._outage.lost(e, "prefills return no params (their decodes "
                              "compute the prompt)")
            raise kvxfer.Closed(kvxfer.Closed.code, e.message) from None
        self._outage.back("kvxferd is back")
        return out

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except kvxfer.Error as e:  # pragma: no cover - close() ends it
                log.debug("closing the scheduler's kvxfer client: %s", e)
            self._client = None

    @staticmethod
    def _remote(request: "Request") -> Optional[Dict[str, Any]]:
        """The request's params when it is to be fetched from a prefill."""
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill") and PARAMS_KEY in p:
            return p
        return None

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int
                                   ) -> Tuple[int, bool]:
        p = self._remote(request)
        if p is None:
            return 0, False
        try:
            _params_of(p)
        except kvxfer.Error as e:
            p["do_remote_prefill"] = False
            log.error("request %s: %s; it is computed here",
                      request.request_id, e)
            return 0, False
        n = min(int(p.get("remote_num_tokens") or 0),
                len(request.prompt_token_ids or ()))
        count = n - num_computed_tokens
        if count <= 0 or count < self.recompute_below:
            return 0, False  # computed here; the prefill's blocks released
        return count, True

    def update_state_after_alloc(self, request: "Request",
                                 blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        p = self._remote(request)
        if p is None:
            return
        p["do_remote_prefill"] = False  # one transfer per request
        try:
            params = _params_of(p)
        except kvxfer.Error as e:
            log.error("request %s: %s; it is computed here",
                      request.request_id, e)
            return
        if num_external_tokens <= 0:
            # the prefix cache holds it all: free the prefill's blocks
            self._release(request.request_id, params)
            return
        n = min(int(p.get("remote_num_tokens") or 0),
                len(request.prompt_token_ids or ()))
        ids = list(blocks.get_block_ids()[0])
        need = math.ceil(n / self.block_size)
        self._meta.recvs[request.request_id] = Recv(
            key=request_key(request.request_id), params=params,
            block_ids=ids[:need], skip_tokens=n - num_external_tokens)
        self._inflight.add(request.request_id)

    def _release(self, request_id: str, params: bytes) -> None:
        try:
            self._daemon(kvxfer.Client.release, params)
        except kvxfer.NotFound:
            pass  # ended already (its lease, or the prefill went away)
        except kvxfer.Closed:
            pass  # logged once; freed at the lease, or gone with a daemon
        except kvxfer.Error as e:
            log.warning("request %s: releasing the prefill's blocks: %s "
                        "(they are freed at the offer's lease)",
                        request_id, e)

    def build_connector_meta(self) -> KvxferConnectorMetadata:
        meta, self._meta = self._meta, KvxferConnectorMetadata()
        return meta

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        for r in out.finished_recving or ():
            self._inflight.discard(r)

    def request_finished(self, request: "Request", block_ids: Any
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus
        p = request.kv_transfer_params
        if not p:
            return False, None
        rid = request.request_id
        if p.get("do_remote_prefill") and PARAMS_KEY in p:
            # finished before its blocks were allocated (aborted): the
            # prefill's blocks are released now, not at their lease
            p["do_remote_prefill"] = False
            try:
                self._release(rid, _params_of(p))
            except kvxfer.Error as e:
                log.error("request %s: %s", rid, e)
            return False, None
        if rid in self._inflight:
            # aborted while its KV moves: vLLM holds the blocks until the
            # workers report the (fenced) cancel as finished_recving
            self._meta.cancels.add(rid)
            self._meta.recvs.pop(rid, None)
            return False, None
        if not p.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: nothing to send
        groups = block_ids if block_ids and isinstance(
            block_ids[0], (list, tuple)) else [block_ids or []]
        ids = list(groups[0])
        n = request.num_computed_tokens
        need = math.ceil(n / self.block_size)
        if n <= 0 or len(ids) < need:
            return False, None
        key = request_key(rid)
        try:
            params = self._daemon(kvxfer.Client.reserve, self.instance_id,
                                  key, n)
        except kvxfer.Closed:
            return False, None  # the daemon is gone (logged once)
        except kvxfer.Error as e:
            # no transfer: the decode gets no params and computes itself
            log.error("request %s: kvxfer reserve failed: %s", rid, e)
            return False, None
        self._meta.sends[rid] = Send(key=key, block_ids=ids[:need],
                                     num_tokens=n)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: _b64(params),
            "remote_engine_id": self.instance_id,
            "remote_request_id": rid,
            "remote_num_tokens": n,
        }


class _Worker:
    """One worker: a kvxfer rank with the worker's KV caches as its pool."""

    def __init__(self, vllm_config: "VllmConfig") -> None:
        self.cfg = vllm_config
        extra = _extra(vllm_config)
        self.socket = _socket(extra)
        self.timeout = float(extra.get("timeout_s", 10.0))
        self.instance_id = _instance_id(vllm_config)
        self.rank_addresses = extra.get("rank_addresses")
        self.client: Optional[kvxfer.Client] = None
        self.pool: Optional[kvxfer.Pool] = None
        self.gpu = False
        self._sending: Dict[bytes, str] = {}  # key -> request id
        self._recving: Dict[bytes, Tuple[str, List[int], int]] = {}
        self._done_send: Set[str] = set()
        self._done_recv: Set[str] = set()
        self._load_errors: Set[int] = set()
        self._kv_caches: Optional[Dict[str, torch.Tensor]] = None
        self._next_connect = 0.0  # when a client given up is made again
        self._outage = Outage(log, f"kvxfer worker of {self.instance_id}")

    def register(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self._connect()

    def _connect(self) -> None:
        """Connect as this worker's rank, join, register the KV caches."""
        kv_caches = self._kv_caches
        assert kv_caches is not None
        mc = self.cfg.model_config
        cc = self.cfg.cache_config
        use_mla = bool(getattr(mc, "use_mla", False))
        layout, regions, names = layout_of_kv_caches(
            kv_caches, head_size=mc.get_head_size(),
            block_size=cc.block_size, use_mla=use_mla)
        tp_rank, tp, pp_rank, pp = parallel_rank(self.cfg)
        total_heads = 1 if use_mla else mc.get_total_num_kv_heads()
        if not use_mla and layout.num_heads * tp == total_heads:
            layout = layout.with_first_head(tp_rank * layout.num_heads)
        rank = pp_rank * tp + tp_rank
        self.client = None
        client = kvxfer.Client(
            self.socket, instance_id=self.instance_id,
            role=_role(self.cfg.kv_transfer_config.kv_role), rank=rank,
            parallel=kvxfer.Parallel(
                tp=tp, pp=pp, total_layers=mc.get_total_num_hidden_layers()
                if hasattr(mc, "get_total_num_hidden_layers")
                else mc.hf_config.num_hidden_layers,
                total_kv_heads=total_heads),
            timeout=self.timeout)
        try:
            client.join(self._addresses(client, tp * pp))
            self.gpu = regions[0].is_cuda
            self.pool = client.register_regions(
                layout, regions, device="cuda" if self.gpu else "host",
                keep=kv_caches)
        except BaseException:
            client.close()
            raise
        self.client = client
        log.info("kvxfer rank %d/%d of %s: %d layers (%s), pool %d",
                 rank, tp * pp, self.instance_id, len(names),
                 "GPU" if self.gpu else "host", self.pool.id)

    def _addresses(self, client: kvxfer.Client, world: int) -> List[str]:
        if self.rank_addresses:
            addrs = [str(a) for a in self.rank_addresses]
            if len(addrs) != world:
                raise kvxfer.InvalidArgument(
                    -1, f"rank_addresses: {len(addrs)} for {world} ranks")
            return addrs
        mine = client.daemon_address
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized() and \
                    dist.get_world_size() == world > 1:
                out: List[Any] = [None] * world
                dist.all_gather_object(out, mine)
                return [str(a) for a in out]
        except (ImportError, RuntimeError) as e:  # pragma: no cover
            log.warning("gathering the ranks' daemon addresses: %s; "
                        "assuming one node", e)
        return [mine] * world

    def start(self, meta: KvxferConnectorMetadata) -> None:
        if self._kv_caches is None:
            if meta.sends or meta.recvs:
                raise kvxfer.StateError(
                    -1, "kvxfer connector: transfers before "
                    "register_kv_caches")
            return
        self._reconnect()
        if self.client is not None and (meta.sends or meta.recvs):
            nudge(self.client)
        if self.client is None or self.pool is None:
            # no daemon to talk to: the step's work ends here
            for rid in meta.sends:
                self._done_send.add(rid)
            for rid, r in meta.recvs.items():
                self._fail_recv(rid, r.block_ids, r.skip_tokens)
            return
        # No stream sync before a publish: vLLM finishes a request in
        # update_from_output, after it read the token its last forward
        # sampled, so every kernel that wrote the request's KV (earlier
        # on the same stream) has completed.
        # a step's publishes, then its fetches, each in one round trip
        # (kvx_publish, kvx_fetch with items); an item refused fails alone,
        # with its own message
        sends = list(meta.sends.items())
        for at in range(0, len(sends), MANY_MAX):
            part = sends[at:at + MANY_MAX]
            res = self._many(
                self.client.publish_many,
                [(s.key, self.pool, s.block_ids, s.num_tokens)
                 for _, s in part],
                lambda s: self.client.publish(s[0], s[1], s[2], s[3]))
            for (rid, s), r in zip(part, res):
                if isinstance(r, kvxfer.Error):
                    # the decode's fetch fails (and recomputes); free now
                    if not isinstance(r, DAEMON_GONE):
                        log.error("request %s: kvxfer publish failed: %s",
                                  rid, r)
                    self._done_send.add(rid)
                else:
                    self._sending[s.key] = rid
        recvs = list(meta.recvs.items())
        for at in range(0, len(recvs), MANY_MAX):
            part = recvs[at:at + MANY_MAX]
            res = self._many(
                self.client.fetch_many,
                [(r.key, r.params, self.pool, r.block_ids, r.skip_tokens)
                 for _, r in part],
                lambda f: self.client.fetch(f[0], f[1], f[2], f[3],
                                            skip_tokens=f[4]))
            for (rid, r), e in zip(part, res):
                if isinstance(e, kvxfer.Error):
                    if not isinstance(e, DAEMON_GONE):
                        log.error("request %s: kvxfer fetch refused: %s",
                                  rid, e)
                    self._fail_recv(rid, r.block_ids, r.skip_tokens)
                else:
                    self._recving[r.key] = (rid, r.block_ids, r.skip_tokens)
        for rid in meta.cancels:
            key = request_key(rid)
            if key not in self._recving:
                continue
            try:
                self.client.cancel(key)
            except kvxfer.NotFound:
                pass  # ended already: its event is on the way
            except DAEMON_GONE as e:
                self._lost(e)  # it ends with the daemon's other requests
            except kvxfer.Error as e:
                log.error("request %s: kvxfer cancel failed: %s", rid, e)

    def _many(self, many: Any, items: List[Any], one: Any) -> List[Any]:
        """many(items): one entry per item (a result or its error). An
        item the library refuses before sending (a bad block id) fails
        the whole call: then each goes alone, so it fails alone. With the
        daemon gone, every item fails with that error."""
        assert self.client is not None
        try:
            return retrying(self.client, many, items)
        except DAEMON_GONE as e:
            self._lost(e)
            return [e] * len(items)
        except kvxfer.Error:
            res: List[Any] = []
            for it in items:
                try:
                    res.append(one(it))
                except kvxfer.Error as e:
                    res.append(e)
            return res

    def _lost(self, e: kvxfer.Error) -> None:
        """A call found the daemon gone. The library ends the requests in
        flight with PEER_GONE events in the next poll and reconnects; a
        client it gave up on is closed here, its requests ended by this
        worker, and made anew by _reconnect."""
        self._outage.lost(e, "fetches fail (load errors) and sends end")
        c = self.client
        if c is None or not c.closed:
            return
        try:
            c.close()  # the daemon, if it still runs, ends our requests
        except kvxfer.Error as why:  # pragma: no cover - close() ends it
            log.debug("closing the kvxfer client: %s", why)
        self.client = None
        self.pool = None
        self._end_all()

    def _end_all(self) -> None:
        """End every request in flight here (no event will come)."""
        for rid in self._sending.values():
            self._done_send.add(rid)
        for rid, blocks, skip in self._recving.values():
            self._fail_recv(rid, blocks, skip)
        self._sending.clear()
        self._recving.clear()

    def _reconnect(self) -> None:
        """Make the client again after the library gave it up: at each
        step 5 ms apart while no daemon listens (an attempt costs a
        connect()), a second apart after one refused us."""
        if self.client is not None or self._kv_caches is None:
            return
        now = time.monotonic()
        if now < self._next_connect:
            return
        try:
            self._connect()
        except kvxfer.Error as e:
            nobody = isinstance(e, (kvxfer.IOFailure, kvxfer.Closed))
            self._next_connect = now + (0.005 if nobody else 1.0)
            self._outage.lost(e, "fetches fail (load errors) and sends end")
            return
        self._outage.back("connected to kvxferd again")

    def _fail_recv(self, rid: str, block_ids: List[int], skip: int) -> None:
        bs = self.cfg.cache_config.block_size
        self._load_errors.update(block_ids[skip // bs:])
        self._done_recv.add(rid)

    def get_finished(self) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        self._reconnect()
        if self.client is not None:
            # every step on every rank, pending work or not: the ranks of
            # an instance read the same batches in lockstep. With the
            # daemon gone the library's batch ends the requests in flight
            # (PEER_GONE); then polls fail until it reconnects.
            try:
                nudge(self.client)
                batch: Any = self.client.poll(0, 0)
            except kvxfer.Error as e:
                batch = ()
                self._lost(e)
            for ev in batch:
                self._on_event(ev)
        sending, self._done_send = self._done_send, set()
        recving, self._done_recv = self._done_recv, set()
        return sending or None, recving or None

    def _on_event(self, ev: kvxfer.Event) -> None:
        if ev.kind == kvxfer.EventKind.RECONNECTED:
            self._outage.back(ev.message)
            return
        # the library's end of a request the daemon took with it: the
        # outage is logged once, not each request
        gone = gone_event(ev)
        if gone:
            self._outage.lost(ev.error, "fetches fail (load errors) and "
                              "sends end")
        rid = self._sending.pop(ev.key, None)
        if rid is not None:
            if not ev.ok and not gone:
                log.warning("request %s: offer ended %s: %s", rid,
                            kvxfer.status_name(ev.code), ev.message)
            self._done_send.add(rid)
            return
        got = self._recving.pop(ev.key, None)
        if got is None:
            return
        rid, blocks, skip = got
        if ev.ok or ev.kind == kvxfer.EventKind.CANCELLED:
            self._done_recv.add(rid)
            return
        if not gone:
            log.warning("request %s: KV fetch failed (%s: %s)", rid,
                        kvxfer.status_name(ev.code), ev.message)
        self._fail_recv(rid, blocks, skip)

    def take_load_errors(self) -> Set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        self._kv_caches = None  # not made again
        if self.client is not None:
            try:
                self.client.close()  # the daemon ends this rank's requests
            except kvxfer.Error as e:  # pragma: no cover - close() ends it
                log.debug("closing the kvxfer client: %s", e)
            self.client = None
            self.pool = None
