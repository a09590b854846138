"""TensorRT-LLM's KV cache transceiver on kvxfer: a ``KvCacheTransceiver``
for the PyTorch backend's executor (docs/engines/trtllm.md).

Each executor rank is one kvxfer rank, with the KV cache manager's
primary pool (``get_unique_primary_pool()``, the ``trtllm`` layout) as its
pool. The context side publishes a finished prefill's blocks under the
request's id and hands the params on in its ``ContextPhaseParams``
(``disagg_info_endpoint``, ``"kvx1:" + base64``), which the serving layer
copies into the generation request's ``ctx_info_endpoint``; the
generation side fetches into its own blocks with them. kvxferd plans
heterogeneous TP and PP; its terminal events become the requests' states
(``DISAGG_CONTEXT_COMPLETE``, ``DISAGG_GENERATION_TRANS_COMPLETE``,
``DISAGG_TRANS_ERROR``). Faults and the daemon going away end requests
with ``DISAGG_TRANS_ERROR``: no kvxfer exception leaves a method the
executor calls.

Enable it with :func:`install` before the executor is built (TensorRT-LLM's
``CacheTransceiverConfig.backend`` cannot name kvxfer); set
``cache_transceiver_config.backend`` as for any transceiver (it turns
transfers on; the daemon picks the transport).

Written from TensorRT-LLM's source (the ``KvCacheTransceiver`` ABC of
``tensorrt_llm/_torch/disaggregation/kv_cache_transceiver.py`` at
0b42ceaf8df6 and the files docs/engines/trtllm.md lists) and tested
against a stand-in with the same signatures (tests/trtllm). It has not
run inside TensorRT-LLM. Generation-first requests are fetched by key
(``get_disaggregated_params``' ``"kvx0:"`` endpoint, the shared
``disagg_request_id`` as the key), their first and draft tokens riding as
the aux payload. Layer-wise sending, several attention windows or head
counts, beam search, host offload and block reuse on the generation side
are not handled.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import sys
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from tensorrt_llm._torch.disaggregation.kv_cache_transceiver import (
    CtxTransferStatus, GenTransferStatus, KvCacheTransceiver)
from tensorrt_llm.bindings import LlmRequestState
from tensorrt_llm.bindings.executor import ContextPhaseParams
from tensorrt_llm.disaggregated_params import DisaggScheduleStyle

import kvxfer
from kvxfer._outage import (DAEMON_GONE, Outage, gone_event, nudge,
                            retrying)

__all__ = ["KvxferTransceiver", "install", "ENDPOINT_PREFIX",
           "BY_KEY_PREFIX", "params_of", "source_of"]

log = logging.getLogger("kvxfer.trtllm")

#: the ``ctx_info_endpoint`` of a request published by this transceiver
#: starts with this; base64 of kvxfer's context params follows
ENDPOINT_PREFIX = "kvx1:"
#: generation-first: the ``ctx_info_endpoint`` a context instance hands
#: out before any prefill (get_disaggregated_params), then
#: ``<instance id>@<its rank 0's daemon address>``
BY_KEY_PREFIX = "kvx0:"

# TensorRT-LLM's DataType names (tensorrt_llm.bindings.DataType) to kvxfer's
_DTYPES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "FP8": "fp8",
           "INT8": "int8"}

# outcomes queued for the next status call
_OK, _ERROR, _CANCELLED = "ok", "error", "cancelled"


def request_id(req: Any) -> int:
    """The id TensorRT-LLM's transceivers track a request by: its
    disaggregated params' ``disagg_request_id`` when set, else its
    ``request_id`` (the ABC's docstring)."""
    p = getattr(req, "py_disaggregated_params", None)
    rid = getattr(p, "disagg_request_id", None) if p is not None else None
    return int(rid if rid is not None else req.request_id)


def _key(rid: int) -> bytes:
    return kvxfer.key_bytes(rid)


def _endpoint(req: Any) -> Any:
    """A generation request's ``ctx_info_endpoint`` (its disaggregated
    params'; else its ``ContextPhaseParams``' ``disagg_info_endpoint``);
    the first of a list."""
    p = getattr(req, "py_disaggregated_params", None)
    ep = getattr(p, "ctx_info_endpoint", None) if p is not None else None
    if not ep:
        cpp = getattr(req, "context_phase_params", None)
        ep = getattr(cpp, "disagg_info_endpoint", None)
    if isinstance(ep, (list, tuple)):
        ep = ep[0] if ep else None
    return ep


def _not_kvxfer(ep: Any) -> kvxfer.InvalidArgument:
    shown = ep if not isinstance(ep, str) else ep[:40]
    return kvxfer.InvalidArgument(
        -1, f"ctx_info_endpoint: {shown!r} holds no kvxfer params (expected "
        f"{ENDPOINT_PREFIX!r} + base64, or {BY_KEY_PREFIX!r} + instance@"
        "address; the context instance must run kvxfer's transceiver)")


def _context_key(req: Any) -> int:
    """The context side's id of a generation-first request: the
    disaggregated params' ``ctx_request_id``, else ``disagg_request_id``
    (the id both sides share)."""
    p = req.py_disaggregated_params
    for rid in (getattr(p, "ctx_request_id", None),
                getattr(p, "disagg_request_id", None)):
        if rid is not None:
            return int(rid)
    raise kvxfer.InvalidArgument(
        -1, "disaggregated params: a generation-first request needs "
        "ctx_request_id or disagg_request_id")


def source_of(req: Any) -> Any:
    """Where a generation request's KV comes from: its kvxfer context
    params (bytes, context-first), or ``(context instance, its rank 0's
    daemon address, context key)`` (generation-first, fetched by key).
    Raises InvalidArgument naming what it found instead."""
    ep = _endpoint(req)
    if isinstance(ep, str) and ep.startswith(BY_KEY_PREFIX):
        inst, at, addr = ep[len(BY_KEY_PREFIX):].rpartition("@")
        if not inst or not at or not addr:
            raise _not_kvxfer(ep)
        return inst, addr, _context_key(req)
    return params_of(req)


def params_of(req: Any) -> bytes:
    """kvxfer's context params of a generation request: its
    ``ctx_info_endpoint``, ``"kvx1:" + base64``. Raises InvalidArgument
    naming what it found instead."""
    ep = _endpoint(req)
    if not isinstance(ep, str) or not ep.startswith(ENDPOINT_PREFIX):
        raise _not_kvxfer(ep)
    try:
        return base64.b64decode(ep[len(ENDPOINT_PREFIX):], validate=True)
    except ValueError as e:
        raise kvxfer.InvalidArgument(
            -1, f"ctx_info_endpoint: not base64 after {ENDPOINT_PREFIX!r} "
            f"({e})") from None


def _generation_first(req: Any) -> bool:
    p = getattr(req, "py_disaggregated_params", None)
    style = getattr(p, "schedule_style", None) if p is not None else None
    return style == DisaggScheduleStyle.GENERATION_FIRST


def _pack_aux(req: Any) -> bytes:
    """What a generation-first transfer carries besides the KV (V2's aux
    slot): the first generated token(s) and the draft tokens."""
    return json.dumps({
        "first_gen_tokens": [int(t) for t in req.get_last_tokens()],
        "draft_tokens": [int(t) for t in
                         (getattr(req, "py_draft_tokens", None) or [])],
    }).encode()


def _apply_aux(req: Any, aux: bytes) -> None:
    """Set the tokens a generation-first transfer carried on the request,
    as TensorRT-LLM's Python transceiver does. Raises ValueError for
    bytes that are not what _pack_aux makes."""
    d = json.loads(aux.decode())
    first = [int(t) for t in d["first_gen_tokens"]]
    draft = [int(t) for t in d["draft_tokens"]]
    req.py_first_gen_tokens = first
    req.py_draft_tokens = draft
    if req.context_phase_params is None:
        req.context_phase_params = ContextPhaseParams(
            first_gen_tokens=first, req_id=req.py_request_id,
            opaque_state=b"", draft_tokens=draft, ctx_dp_rank=0,
            disagg_info_endpoint="")
    else:
        req.context_phase_params.first_gen_tokens = first
        req.context_phase_params.draft_tokens = draft


def _role(role: Any, attention_dp: bool) -> kvxfer.Role:
    """The kvxfer role: given, else $KVXFER_TRTLLM_ROLE, else both (a
    TensorRT-LLM instance serves context-only and generation-only
    requests alike); generation under attention DP, which kvxfer allows
    on the generation side only."""
    r = role or os.environ.get("KVXFER_TRTLLM_ROLE")
    if r is None:
        return kvxfer.Role.GENERATION if attention_dp else kvxfer.Role.BOTH
    if isinstance(r, str):
        try:
            return kvxfer.Role[r.upper()]
        except KeyError:
            raise kvxfer.InvalidArgument(
                -1, f"role: {r!r} (expected context, generation or "
                "both)") from None
    return kvxfer.Role(r)


def _heads(kvm: Any) -> Tuple[int, int]:
    """(total KV heads of the model, KV heads of this rank) of a KV cache
    manager with one head count for every attention layer."""
    total = kvm.num_kv_heads
    if not isinstance(total, int):
        counts = {h for h in total if h}
        if len(counts) != 1:
            raise kvxfer.Unsupported(
                -15, f"num_kv_heads: {sorted(counts)} (kvxfer's transceiver "
                "takes one KV head count for every attention layer)")
        total = counts.pop()
    local = {h for h in kvm.num_kv_heads_per_layer if h}
    if len(local) != 1:
        raise kvxfer.Unsupported(
            -15, f"num_kv_heads_per_layer: {sorted(local)} (expected one "
            "head count)")
    return int(total), int(local.pop())


def _dtype(kvm: Any) -> str:
    name = str(getattr(kvm.dtype, "name", kvm.dtype)).split(".")[-1]
    try:
        return _DTYPES[name.upper()]
    except KeyError:
        raise kvxfer.Unsupported(
            -15, f"dtype: {kvm.dtype!r} (kvxfer moves "
            f"{', '.join(sorted(_DTYPES))})") from None


class KvxferTransceiver(KvCacheTransceiver):
    """One executor rank's transceiver: a kvxfer rank whose pool is the
    KV cache manager's primary pool.

    Built as TensorRT-LLM builds its own (``mapping``, ``dist``,
    ``kv_cache_manager``, ``cache_transceiver_config``), on every rank at
    once: the constructor's collectives (the instance id from rank 0, the
    daemon addresses, the layers of each PP rank) are ``dist``'s.
    ``socket`` (else $KVXFER_SOCKET), ``instance_id`` (else
    $KVXFER_TRTLLM_INSTANCE, else a uuid from rank 0), ``role`` (else
    $KVXFER_TRTLLM_ROLE, else both) and ``timeout`` (seconds a daemon
    call may take; else $KVXFER_TRTLLM_TIMEOUT_S, else 10) are kvxfer's.
    Raises kvxfer's errors when the rank cannot start (no daemon, a pool
    the daemon refuses); after that no method raises one.
    """

    def __init__(self, mapping: Any, dist: Any, kv_cache_manager: Any,
                 cache_transceiver_config: Any, *,
                 socket: Optional[str] = None,
                 instance_id: Optional[str] = None, role: Any = None,
                 timeout: Optional[float] = None) -> None:
        cfg = cache_transceiver_config
        self.kv_transfer_timeout_ms: Optional[int] = getattr(
            cfg, "kv_transfer_timeout_ms", None)
        self._send_wait = (getattr(
            cfg, "kv_transfer_sender_future_timeout_ms", None) or 1000) / 1e3
        self._recv_wait = (getattr(
            cfg, "kv_transfer_poll_interval_ms", None) or 5000) / 1e3
        if getattr(mapping, "cp_size", 1) != 1:
            raise kvxfer.Unsupported(
                -15, f"cp_size: {mapping.cp_size} (kvxfer moves KV of "
                "instances without context parallelism)")
        self._mapping, self._dist, self._kvm = mapping, dist, kv_cache_manager
        adp = bool(getattr(mapping, "enable_attention_dp", False))
        self.socket = socket or os.environ.get("KVXFER_SOCKET") or \
            kvxfer.DEFAULT_SOCKET
        self.timeout = float(timeout if timeout is not None else
                             os.environ.get("KVXFER_TRTLLM_TIMEOUT_S", 10))
        self.role = _role(role, adp)
        if adp and self.role != kvxfer.Role.GENERATION:
            raise kvxfer.Unsupported(
                -15, f"role: {self.role.name.lower()} under attention DP "
                "(kvxfer takes attention DP on generation instances only)")
        tp, pp = mapping.tp_size, mapping.pp_size
        self.rank = mapping.pp_rank * tp + mapping.tp_rank
        self._world = tp * pp
        self.instance_id = instance_id or \
            os.environ.get("KVXFER_TRTLLM_INSTANCE") or self._broadcast_id()
        # attention layers of this PP rank, as the C++ transceiver counts
        # them (layers without KV heads are not in the pool's layers)
        layers = sum(1 for h in kv_cache_manager.num_kv_heads_per_layer if h)
        per_pp = [int(n) for n in dist.pp_allgather(layers)] if pp > 1 \
            else [layers]
        total_heads, heads = _heads(kv_cache_manager)
        gen_adp = adp and self.role == kvxfer.Role.GENERATION
        self._parallel = kvxfer.Parallel(
            tp=tp, pp=pp, total_layers=sum(per_pp),
            total_kv_heads=total_heads, layers_per_pp=per_pp,
            attention_dp=tp if gen_adp else 0)
        self._dp_rank = mapping.tp_rank if gen_adp else 0
        self._tokens_per_block = int(kv_cache_manager.tokens_per_block)
        prim = kv_cache_manager.get_unique_primary_pool()
        self._prim = prim
        layout = kvxfer.Layout.preset(
            "trtllm", num_layers=layers, num_heads=heads,
            head_dim=kv_cache_manager.head_dim,
            dtype=_dtype(kv_cache_manager),
            tokens_per_block=self._tokens_per_block,
            num_blocks=int(prim.shape[0]),
            kv_factor=int(kv_cache_manager.kv_factor))
        # the head placement the daemon checks: TensorRT-LLM gives TP rank
        # r heads [r*h, (r+1)*h) when the heads divide evenly (all of them
        # under attention DP); replicated heads are left unsaid
        if gen_adp and heads == total_heads:
            layout = layout.with_first_head(0)
        elif not adp and heads * tp == total_heads:
            layout = layout.with_first_head(mapping.tp_rank * heads)
        self._layout = layout
        self.client: Optional[kvxfer.Client] = None
        self.pool: Optional[kvxfer.Pool] = None
        self._send: Dict[bytes, Any] = {}  # key -> context request
        self._recv: Dict[bytes, Any] = {}  # key -> generation request
        self._ctx_done: List[Tuple[Any, str]] = []  # (request, outcome)
        self._gen_done: List[Tuple[Any, str]] = []
        self._next_connect = 0.0
        self._shut = False
        self._outage = Outage(log, f"kvxfer transceiver of "
                              f"{self.instance_id} rank {self.rank}")
        client = self._open()
        try:
            mine = client.daemon_address
            addrs = [str(a) for a in dist.allgather(mine)] \
                if self._world > 1 else [mine]
            self._addresses = addrs
            self._attach(client)
        except BaseException:
            client.close()
            raise
        log.info("kvxfer rank %d/%d of %s (%s): %d layers, %d heads, "
                 "pool %d (%s)", self.rank, self._world, self.instance_id,
                 self.role.name.lower(), layers, heads, self.pool.id,
                 self.pool.kind)

    # -- the connection ----------------------------------------------------

    def _broadcast_id(self) -> str:
        if self._world == 1:
            return f"trtllm-{uuid.uuid4()}"
        name = f"trtllm-{uuid.uuid4()}" if self._dist.rank == 0 else None
        return str(self._dist.broadcast(name, 0))

    def _open(self) -> kvxfer.Client:
        return kvxfer.Client(self.socket, instance_id=self.instance_id,
                             role=self.role, rank=self.rank,
                             parallel=self._parallel, timeout=self.timeout)

    def _attach(self, client: kvxfer.Client) -> None:
        """Join and register the pool on a new client (the caller closes
        it on an error)."""
        client.join(self._addresses)
        self.pool = client.register_pool(self._prim, self._layout)
        self.client = client

    def _reconnect(self) -> None:
        """Make the client again after the library gave it up (it
        reconnects by itself otherwise): at each call 5 ms apart while no
        daemon listens, a second apart after one refused us. No collective
        (the ranks are not in step here): the ranks that were on this
        rank's daemon are on its new run, whose address names that run;
        the others' daemons did not change."""
        if self.client is not None or self._shut:
            return
        now = time.monotonic()
        if now < self._next_connect:
            return
        client = None
        try:
            client = self._open()
            was, now_at = self._addresses[self.rank], client.daemon_address
            self._addresses = [now_at if a == was else a
                               for a in self._addresses]
            self._attach(client)
        except kvxfer.Error as e:
            if client is not None:
                client.close()
            nobody = isinstance(e, (kvxfer.IOFailure, kvxfer.Closed))
            self._next_connect = now + (0.005 if nobody else 1.0)
            self._outage.lost(e, "transfers fail")
            return
        self._outage.back("connected to kvxferd again")

    def _lost(self, e: kvxfer.Error) -> None:
        """A call found the daemon gone. The library ends the requests in
        flight (PEER_GONE events in the next poll) and reconnects; a client
        it gave up on is closed here and its requests ended now."""
        self._outage.lost(e, "transfers fail")
        c = self.client
        if c is None or not c.closed:
            return
        c.close()
        self.client = None
        self.pool = None
        self._end_all()

    def _end_all(self) -> None:
        """End every transfer in flight here (no event will come)."""
        self._ctx_done += [(r, _ERROR) for r in self._send.values()]
        self._gen_done += [(r, _ERROR) for r in self._recv.values()]
        self._send.clear()
        self._recv.clear()

    def _call(self, fn: Any) -> Any:
        """fn(client, pool), once more when the call found the daemon gone
        and a new one already listens: on the same client when the library
        reconnects (retrying), else on a client made anew here. Raises
        what the last try raised."""
        c = self.client
        assert c is not None
        try:
            return retrying(c, fn, c, self.pool)
        except DAEMON_GONE as e:
            self._lost(e)
            if self.client is not None:
                raise  # the library is reconnecting: it ends the request
            self._reconnect()
            if self.client is None:
                raise
            return fn(self.client, self.pool)

    def _abandon(self, key: bytes) -> None:
        """After a refused publish or fetch: cancel the key, so that the
        instance's other ranks, whose call may have been taken, end it
        too. Errors here change nothing."""
        c = self.client
        if c is None:
            return
        try:
            c.cancel(key)
        except kvxfer.NotFound:
            pass  # no rank's call was taken
        except kvxfer.Error as e:
            log.debug("cancelling %r after a refusal: %s", key, e)

    # -- the event pump ----------------------------------------------------

    def _pump(self, at_least: int, timeout: Optional[float]) -> None:
        """One kvx_poll: its events go to the side that owns their key."""
        c = self.client
        if c is None:
            return
        try:
            nudge(c)
            batch: Any = c.poll(at_least, timeout)
        except kvxfer.Error as e:
            self._lost(e)
            return
        for ev in batch:
            self._on_event(ev)
        if c.closed:  # the library gave up (reconnection off): make anew
            self._lost(kvxfer.Closed(-20, "the client is closed"))

    def _on_event(self, ev: kvxfer.Event) -> None:
        if ev.kind == kvxfer.EventKind.RECONNECTED:
            self._outage.back(ev.message)
            return
        gone = gone_event(ev)
        if gone:
            self._outage.lost(ev.error, "transfers fail")
        req = self._send.pop(ev.key, None)
        if req is not None:
            # a CANCELLED one was not cancelled here (that pops the key):
            # another rank gave the request up after a refusal
            if not ev.ok and not gone:
                log.warning("request %s: KV send ended %s: %s",
                            request_id(req), kvxfer.status_name(ev.code),
                            ev.message)
            self._ctx_done.append((req, _OK if ev.ok else _ERROR))
            return
        req = self._recv.pop(ev.key, None)
        if req is None:
            return  # cancelled here, or ended already
        if ev.ok and _generation_first(req):
            try:
                _apply_aux(req, ev.aux)
            except (ValueError, KeyError, TypeError) as e:
                log.error("request %s: the transfer's aux is not the first "
                          "and draft tokens (%s)", request_id(req), e)
                self._gen_done.append((req, _ERROR))
                return
            self._gen_done.append((req, _OK))
        elif ev.ok:
            self._gen_done.append((req, _OK))
        elif ev.kind == kvxfer.EventKind.CANCELLED or \
                ev.code == kvxfer.Cancelled.code:
            # the context side cancelled it (or another rank of ours)
            self._gen_done.append((req, _CANCELLED))
        else:
            if not gone:
                log.warning("request %s: KV receive failed (%s: %s)",
                            request_id(req), kvxfer.status_name(ev.code),
                            ev.message)
            self._gen_done.append((req, _ERROR))

    def _wait(self, side: Dict[bytes, Any], at_least: Optional[int],
              wait: float) -> None:
        """The poll of a status call: non-blocking for 0, one bounded wait
        for N > 0, and for None polls until ``side`` has nothing in flight
        (bounded by kv_transfer_timeout_ms when it is set)."""
        self._reconnect()
        if at_least is None:
            end = math.inf if self.kv_transfer_timeout_ms is None else \
                time.monotonic() + self.kv_transfer_timeout_ms / 1e3
            while side and self.client is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._pump(len(side), min(1.0, left))
        elif at_least > 0 and side:
            self._pump(int(at_least), wait)
        else:
            self._pump(0, 0)

    # -- the context side --------------------------------------------------

    def _blocks(self, req: Any) -> List[int]:
        """The request's blocks that hold its prompt, in token order."""
        n = -(-int(req.prompt_len) // self._tokens_per_block)
        return [int(b) for b in self._kvm.get_cache_indices(req)][:n]

    def _synchronize(self) -> None:
        """kvxfer reads a GPU pool on its own streams: the forward pass
        that wrote the request's KV must be complete first."""
        if self.pool is not None and self.pool.kind == "gpu":
            import torch
            torch.cuda.synchronize()

    def respond_and_send_async(self, req: Any) -> None:
        """Publish the request's prompt blocks; its ContextPhaseParams
        carry the params (``disagg_info_endpoint``). A refused publish
        sets DISAGG_TRANS_ERROR and reports the request in the next
        check_context_transfer_status's errors."""
        req.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        rid = request_id(req)
        key = _key(rid)
        if key in self._send:
            log.warning("request %s: already being sent", rid)
            return
        self._reconnect()
        if self.client is None:
            self._fail_send(req)
            return
        try:
            blocks = self._blocks(req)
            self._synchronize()
            aux = _pack_aux(req) if _generation_first(req) else None
            params = self._call(lambda c, pool: c.publish(
                key, pool, blocks, int(req.prompt_len), aux=aux))
        except DAEMON_GONE as e:
            self._lost(e)
            self._fail_send(req)
            return
        except kvxfer.Error as e:
            log.error("request %s: kvxfer publish refused: %s", rid, e)
            self._abandon(key)
            self._fail_send(req)
            return
        self._send[key] = req
        req.context_phase_params = ContextPhaseParams(
            first_gen_tokens=[], req_id=rid, opaque_state=None,
            draft_tokens=None, ctx_dp_rank=0,
            disagg_info_endpoint=ENDPOINT_PREFIX +
            base64.b64encode(params).decode())

    def _fail_send(self, req: Any) -> None:
        req.state = LlmRequestState.DISAGG_TRANS_ERROR
        self._ctx_done.append((req, _ERROR))

    def check_context_transfer_status(
            self, at_least_request_num: Optional[int],
            mark_complete: bool = False) -> Any:
        """One poll (see _wait), then the sends that ended since the last
        call: completed ones (DISAGG_CONTEXT_COMPLETE with
        ``mark_complete``) and failed ones (DISAGG_TRANS_ERROR). Sends
        cancelled by cancel_request are not reported (the ABC's rule)."""
        self._wait(self._send, at_least_request_num, self._send_wait)
        done, self._ctx_done = self._ctx_done, []
        completed: List[int] = []
        errors: List[int] = []
        for req, outcome in done:
            if outcome == _OK:
                if mark_complete:
                    req.state = LlmRequestState.DISAGG_CONTEXT_COMPLETE
                completed.append(request_id(req))
            else:
                req.state = LlmRequestState.DISAGG_TRANS_ERROR
                errors.append(request_id(req))
        return CtxTransferStatus(completed, errors)

    # -- the generation side -----------------------------------------------

    def request_and_receive_async(self, req: Any) -> None:
        """Fetch the request's KV into its blocks with the params its
        ``ctx_info_endpoint`` carries. A refused fetch sets
        DISAGG_TRANS_ERROR (reported in the next status call's errors)."""
        req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
        rid = request_id(req)
        key = _key(rid)
        if key in self._recv:
            log.warning("request %s: already being received", rid)
            return
        try:
            source = source_of(req)
        except kvxfer.Error as e:
            log.error("request %s: %s", rid, e)
            self._fail_recv(req)
            return
        self._reconnect()
        if self.client is None:
            self._fail_recv(req)
            return
        blocks = self._blocks(req)
        try:
            if isinstance(source, bytes):
                self._call(lambda c, pool: c.fetch(
                    key, source, pool, blocks, dp_rank=self._dp_rank))
            else:
                inst, addr, ckey = source
                self._call(lambda c, pool: c.fetch_by_key(
                    key, inst, addr, ckey, pool, blocks,
                    dp_rank=self._dp_rank))
        except DAEMON_GONE as e:
            self._lost(e)
            self._fail_recv(req)
            return
        except kvxfer.Error as e:
            log.error("request %s: kvxfer fetch refused: %s", rid, e)
            self._abandon(key)
            self._fail_recv(req)
            return
        self._recv[key] = req

    def _fail_recv(self, req: Any) -> None:
        req.state = LlmRequestState.DISAGG_TRANS_ERROR
        self._gen_done.append((req, _ERROR))

    def request_and_receive_sync(self, req: Any) -> None:
        """The async receive, then polls until it ends (bounded by
        kv_transfer_timeout_ms; past it the fetch is cancelled and the
        request fails). Other requests' events wait for the next status
        call. Every rank must call it alike (kvx_poll's lockstep)."""
        self.request_and_receive_async(req)
        key = _key(request_id(req))
        end = math.inf if self.kv_transfer_timeout_ms is None else \
            time.monotonic() + self.kv_transfer_timeout_ms / 1e3
        while key in self._recv and self.client is not None:
            left = end - time.monotonic()
            if left <= 0:
                log.warning("request %s: KV receive timed out after %d ms",
                            request_id(req), self.kv_transfer_timeout_ms)
                self._recv.pop(key, None)
                self._abandon(key)
                self._fail_recv(req)
                break
            self._pump(1, min(self._recv_wait, left))
        mine = [d for d in self._gen_done if d[0] is req]
        self._gen_done = [d for d in self._gen_done if d[0] is not req]
        for r, outcome in mine:
            self._settle_recv(r, outcome)

    def _settle_recv(self, req: Any, outcome: str) -> None:
        if outcome == _OK:
            req.state = LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE
        elif outcome == _ERROR:
            req.state = LlmRequestState.DISAGG_TRANS_ERROR
        # cancelled: the caller decides (the ABC's rule)

    def check_gen_transfer_status(
            self, at_least_request_num: Optional[int]) -> Any:
        """One poll (see _wait), then the receives that ended since the
        last call: DISAGG_GENERATION_TRANS_COMPLETE or DISAGG_TRANS_ERROR,
        and those the context side cancelled (state left to the caller)."""
        self._wait(self._recv, at_least_request_num, self._recv_wait)
        done, self._gen_done = self._gen_done, []
        completed: List[int] = []
        errors: List[int] = []
        cancelled: List[Any] = []
        for req, outcome in done:
            self._settle_recv(req, outcome)
            if outcome == _OK:
                completed.append(request_id(req))
            elif outcome == _CANCELLED:
                cancelled.append(req)
            else:
                errors.append(request_id(req))
        return GenTransferStatus(completed, errors, cancelled)

    def check_gen_transfer_complete(self) -> bool:
        return not self._recv

    # -- cancellation and the rest of the ABC ------------------------------

    def cancel_request(self, req: Any) -> bool:
        """kvx_cancel_key: True once the daemon will never touch the
        request's blocks again (also when it had ended already); False
        when the daemon could not be asked (the executor retries). The
        request is then forgotten: no status call reports it."""
        key = _key(request_id(req))
        if key not in self._send and key not in self._recv:
            return True
        c = self.client
        if c is not None:
            try:
                c.cancel(key)
            except kvxfer.NotFound:
                pass  # its event is queued: it is over
            except DAEMON_GONE as e:
                self._lost(e)
                return False
            except kvxfer.Error as e:
                log.error("request %s: kvxfer cancel failed: %s",
                          request_id(req), e)
                return False
        self._send.pop(key, None)
        self._recv.pop(key, None)
        return True

    def has_inflight_transfer(self, req: Any) -> bool:
        key = _key(request_id(req))
        return key in self._send or key in self._recv

    def supports_inflight_request_cancellation(self) -> bool:
        # cancel_request forgets a cancelled send, while the executor's
        # in-flight cancellation path waits for the transceiver to report
        # it: keep the executor on its ordinary path
        return False

    def has_poisoned_transfer_buffer(self) -> bool:
        return False  # no engine-side transfer buffer

    def prepare_context_requests(self, requests: List[Any]) -> None:
        """Generation-first context requests are schedulable at once
        (CONTEXT_INIT): kvxfer needs nothing from the generation side
        before the prefill; its fetch by key waits for the publish."""
        for req in requests:
            req.state = LlmRequestState.CONTEXT_INIT

    def get_disaggregated_params(self) -> Dict[str, Any]:
        """What a generation-first request needs to find this instance:
        ``ctx_info_endpoint`` ``["kvx0:<instance id>@<rank 0's daemon
        address>"]``; the generation side fetches by key, the key being
        the request id both sides share."""
        return {"ctx_dp_rank": 0, "ctx_info_endpoint": [
            f"{BY_KEY_PREFIX}{self.instance_id}@{self._addresses[0]}"]}

    def shutdown(self) -> None:
        """Close the kvxfer rank: the daemon ends its requests (the other
        side's get PEER_GONE). Idempotent."""
        self._shut = True
        c, self.client, self.pool = self.client, None, None
        if c is not None:
            c.close()


def install() -> None:
    """Make TensorRT-LLM build :class:`KvxferTransceiver`: replaces
    ``create_kv_cache_transceiver`` in its module and in every module
    already imported that holds it by name. Call it before the executor
    is built (in each executor process). Transfers stay off when
    ``cache_transceiver_config.backend`` is None, as before."""
    from tensorrt_llm._torch.disaggregation import kv_cache_transceiver as m
    orig = m.create_kv_cache_transceiver
    if getattr(orig, "kvxfer", False):
        return

    def create_kv_cache_transceiver(mapping: Any, dist: Any,
                                    kv_cache_manager: Any,
                                    attention_type: Any,
                                    cache_transceiver_config: Any,
                                    mamba_cache_manager: Any = None,
                                    **_: Any) -> Any:
        cfg = cache_transceiver_config
        if cfg is None or cfg.backend is None:
            return None
        if mamba_cache_manager is not None:
            raise kvxfer.Unsupported(
                -15, "mamba_cache_manager: kvxfer's transceiver moves "
                "attention KV only")
        return KvxferTransceiver(mapping, dist, kv_cache_manager, cfg)

    create_kv_cache_transceiver.kvxfer = True  # type: ignore[attr-defined]
    for mod in list(sys.modules.values()):
        if getattr(mod, "create_kv_cache_transceiver", None) is orig:
            setattr(mod, "create_kv_cache_transceiver",
                    create_kv_cache_transceiver)
