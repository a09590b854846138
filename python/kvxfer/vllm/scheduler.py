"""The connector's scheduler half: which requests fetch, publish,
release or cancel, and the offers' params."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import kvxfer
from kvxfer._outage import DAEMON_GONE, Outage, nudge, retrying
from kvxfer.vllm.bidi import Bidi
from kvxfer.vllm.common import (MANY_MAX, PARAMS_KEY,
                                KvxferConnectorMetadata, Recv, Send, _b64,
                                _extra, _instance_id, _params_of, _socket,
                                addresses_of, log, pools_of,
                                recompute_threshold, request_key)
from kvxfer.vllm.hybrid import Tables
from kvxfer.vllm.layerwise import LayerPlanner, flag

# kv_transfer_params: the offer's lease in ms (the params say it too)
LEASE_KEY = "kvxfer_lease_ms"

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _remote_tokens(p: Dict[str, Any]) -> int:
    """kv_transfer_params' remote_num_tokens (0 when absent); one that is
    no token count: InvalidArgument, naming it (the proxy's input)."""
    v = p.get("remote_num_tokens") or 0
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # a JSON number some proxy wrote as 40.0
    if isinstance(v, bool) or not isinstance(v, int):
        raise kvxfer.InvalidArgument(
            -1, f"kv_transfer_params['remote_num_tokens']: {v!r} is not a "
            "token count")
    return v


class _Scheduler:
    """The scheduler side: which requests fetch, publish, release or
    cancel, and the offers' params (kvx_reserve)."""

    def __init__(self, vllm_config: "VllmConfig",
                 tables: Optional[Tables] = None) -> None:
        extra = _extra(vllm_config)
        self.socket = _socket(extra)
        self.timeout = float(extra.get("timeout_s", 10.0))
        self.instance_id = _instance_id(vllm_config)
        self.tables = tables or Tables(None)
        self.block_size = self.tables.block_size(
            vllm_config.cache_config.block_size)
        self._pools: List[int] = []  # rank 0's pool of each table
        self.recompute_below = recompute_threshold(extra)
        pc = vllm_config.parallel_config
        self.world = pc.tensor_parallel_size * pc.pipeline_parallel_size
        self._client: Optional[kvxfer.Client] = None
        self._meta = KvxferConnectorMetadata()
        self._inflight: Set[str] = set()  # fetches the workers run
        self._outage = Outage(log, f"kvxfer scheduler of {self.instance_id}")
        self._lease_init(extra)
        # the decode loads synchronously, its forward layer by layer
        # (a hybrid model's groups move whole requests: not layer-wise)
        self.layerwise_load = flag(extra, "layerwise_load", False) and \
            not self.tables.hybrid
        # layer-wise offers take the reservations _reserve_step made
        self.lw = LayerPlanner(flag(extra, "layerwise", True) and
                               not self.tables.hybrid,
                               self.block_size, self.instance_id,
                               self._take_reservation)
        self.bidi = Bidi(vllm_config, self)  # multi-turn reuse (bidi.py)

    def _take_reservation(self, request_id: str) -> Optional[bytes]:
        """The params reserved for a request (_reserve_step), now the
        layer-wise offer's; None: none (the finish tries again)."""
        got = self._reserved.pop(request_id, None)
        return None if got is None else got[0]

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
        got = self.bidi.matched(request, num_computed_tokens)
        if got is not None:
            return got  # a decode's offer of the last turn (bidi.py)
        p = self._remote(request)
        if p is None:
            return 0, False
        try:
            _params_of(p)
            _remote_tokens(p)
        except kvxfer.Error as e:
            p["do_remote_prefill"] = False
            log.error("request %s: %s; it is computed here",
                      request.request_id, e)
            return 0, False
        n = self._loaded_end(p, request)
        count = n - num_computed_tokens
        if count <= 0 or count < self.recompute_below:
            return 0, False  # computed here; the prefill's blocks released
        return count, not self.layerwise_load

    def _loaded_end(self, p: Dict[str, Any], request: "Request") -> int:
        """The end of the prompt tokens vLLM counts as loaded: the
        offer's, but a synchronous load (layerwise_load) leaves vLLM the
        last prompt token to compute in the step that loads (the fetch
        still writes it, before the forward reaches its layer)."""
        n = min(_remote_tokens(p), len(request.prompt_token_ids or ()))
        if self.layerwise_load:
            n = min(n, len(request.prompt_token_ids or ()) - 1)
        return n

    def update_state_after_alloc(self, request: "Request",
                                 blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._note_prefill(request)
        self.bidi.after_alloc(request, blocks, num_external_tokens)
        p = self._remote(request)
        self._waiting.pop(request.request_id, None)  # its fetch takes it
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
        n = min(_remote_tokens(p), len(request.prompt_token_ids or ()))
        ids = self.tables.plain(blocks.get_block_ids())
        need = math.ceil(n / self.block_size)
        skip = self._loaded_end(p, request) - num_external_tokens
        tables = self.tables.recvs(blocks.get_block_ids(), n, skip) \
            if self.tables.hybrid else []
        if tables is None:
            # the fetch is refused (its groups missing): load errors
            log.error("request %s: a KV cache group has no blocks for "
                      "tokens [%d, %d)", request.request_id, skip, n)
            tables = []
        self._meta.recvs[request.request_id] = Recv(
            key=request_key(request.request_id), params=params,
            block_ids=ids[:need], skip_tokens=skip, groups=tables,
            sync=self.layerwise_load, num_tokens=n)
        if not self.layerwise_load:
            self._inflight.add(request.request_id)

    def _release(self, request_id: str, params: bytes) -> None:
        """Released at the end of the step's scheduling (_release_step),
        under its budget: no daemon call in vLLM's scheduling loop."""
        self._to_release.append((request_id, params))

    def _release_finished(self, request_id: str, params: bytes) -> None:
        """Released now (an abort may come while the engine is idle, with
        no step to come), under the finished requests' budget."""
        left = self._finish_left()
        if left is None:
            return  # freed at the offer's lease
        try:
            self._release_now(request_id, params, left)
        except kvxfer.Closed:
            pass  # logged once; freed at the lease, or gone with a daemon

    def _release_now(self, request_id: str, params: bytes,
                     timeout: float) -> None:
        def release(c: kvxfer.Client, p: bytes, t: float) -> None:
            c.release(p, timeout=t)
        try:
            self._timed(release, params, timeout)
        except kvxfer.NotFound:
            pass  # ended already (its lease, or the prefill went away)
        except kvxfer.Closed:
            raise  # logged once; freed at the lease, or gone with a daemon
        except kvxfer.Error as e:
            log.warning("request %s: releasing the prefill's blocks: %s "
                        "(they are freed at the offer's lease)",
                        request_id, e)

    def set_rank_addresses(self, metadata: Dict[Any, Any]) -> None:
        """The workers' daemon addresses (vLLM's handshake metadata) go
        to the workers in the next step's metadata: they join with them."""
        addrs = addresses_of(metadata, self.world)
        if addrs is not None:
            self._meta.addresses = addrs
        self._pools = pools_of(metadata)

    def build_connector_meta(self, so: Optional["SchedulerOutput"] = None
                             ) -> KvxferConnectorMetadata:
        self._finish_end = None  # the next finished requests' budget
        self._daemon_step()
        if so is not None:
            self.lw.plan(so, self._meta)  # layer-wise offers' chunks
        meta, self._meta = self._meta, KvxferConnectorMetadata()
        meta.forward = bool(so is not None and
                            so.total_num_scheduled_tokens)  # gpu_pace
        return meta

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        for r in out.finished_recving or ():
            self._inflight.discard(r)
        # rank 0 made a client (anew: its pools have new ids); the
        # connector's KvxferWorkerMetadata
        pools = getattr(getattr(out, "kv_connector_worker_meta", None),
                        "pools", None)
        if isinstance(pools, dict) and 0 in pools:
            self._pools = list(pools[0])

    def request_finished(self, request: "Request", block_ids: Any
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus
        p = request.kv_transfer_params
        if not p:
            return False, None
        rid = request.request_id
        self._waiting.pop(rid, None)
        self._computing.pop(rid, None)  # its lease is the decode's now
        if p.get("do_remote_prefill") and PARAMS_KEY in p:
            # finished before its blocks were allocated (aborted): the
            # prefill's blocks are released now, not at their lease
            p["do_remote_prefill"] = False
            try:
                self._release_finished(rid, _params_of(p))
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
            return self.bidi.decode_finished(request, block_ids)
        self.bidi.abandoned(request)
        # reserved when it was first scheduled (_reserve_step): no daemon
        # call here, in vLLM's loop over the step's finished requests
        self._to_reserve.pop(rid, None)
        got = self._reserved.pop(rid, None)
        late = self._retry.pop(rid, None)
        lw = self.lw.finished(request, self._meta)
        if lw is not None:  # offered layer-wise (layerwise.py)
            if lw[1] is not None:
                lw[1][LEASE_KEY] = self._params_lease_ms(
                    _params_of(lw[1]))
            return lw
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: its reservation ends at its lease
        groups = block_ids if block_ids and isinstance(
            block_ids[0], (list, tuple)) else [block_ids or []]
        ids = self.tables.plain(groups)
        tables: List[Any] = []
        if self.tables.hybrid:
            # a hybrid request's groups are known now: reserved here, one
            # call under the finished requests' budget
            n = request.num_computed_tokens
            tables = self.tables.sends(groups, n)
            if tables is None or not self._pools:
                log.error("request %s: %s; its decode computes the prompt",
                          rid, "a KV cache group lacks blocks"
                          if tables is None
                          else "no pools from the workers' handshake")
                return False, None
            got = self._reserve_groups(rid, n, tables) if n > 0 else None
        elif got is None and late is not None:
            got = self._reserve_late(rid, late)
        if got is None:
            return False, None  # not reserved in time: the decode computes
        params, n = got
        need = math.ceil(n / self.block_size)
        if request.num_computed_tokens < n or len(ids) < need:
            return False, None
        key = request_key(rid)
        self._meta.sends[rid] = Send(key=key, block_ids=ids[:need],
                                     num_tokens=n, groups=tables)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: _b64(params),
            "remote_engine_id": self.instance_id,
            "remote_request_id": rid,
            "remote_num_tokens": n,
            LEASE_KEY: self._params_lease_ms(params),
        }

    # -- leases and the step's daemon calls (issue 37, item 4) -------------
    #
    # The prefill reserves the step's new remote-decode requests in one
    # round trip (reserve_many) when they are first scheduled, under the
    # lease it chose (lease_s); the decode renews, in one round trip per
    # 256, the leases of the requests waiting in its queue, every third
    # of the shortest. Both run in build_connector_meta under one budget
    # per step (step_budget_ms): a call that does not come back in time
    # leaves its requests without params (their decodes compute the
    # prompt), and the daemon is left alone for QUIET_S, so a hung one
    # costs one budget a second, never a stalled scheduler.

    QUIET_S = 1.0

    @staticmethod
    def _positive(extra: Dict[str, Any], key: str, default: Any) -> Any:
        """extra[key] as a number above 0 (default when absent); else
        InvalidArgument naming the key, at start-up."""
        v = extra.get(key, default)
        if v is None:
            return None
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = float("nan")
        if isinstance(v, bool) or not 0 < f < float("inf"):
            raise kvxfer.InvalidArgument(
                -1, f"kv_connector_extra_config.{key}: {v!r} is not a "
                "number above 0")
        return f

    def _lease_init(self, extra: Dict[str, Any]) -> None:
        self.step_budget = self._positive(extra, "step_budget_ms", 50) / 1e3
        lease = self._positive(extra, "lease_s", None)
        self.lease_ms = max(1, int(round(lease * 1000))) if lease else 0
        self.renew_leases = bool(extra.get("renew_leases", True))
        # prefill: rid -> (key, tokens) to reserve this step; rid ->
        # (params, tokens) reserved
        self._to_reserve: Dict[str, Tuple[bytes, int]] = {}
        self._reserved: Dict[str, Tuple[bytes, int]] = {}
        # decode: rid -> (request, params, lease ms) waiting in the queue
        self._waiting: Dict[str, Tuple[Any, bytes, int]] = {}
        # prefill: rid -> (None, params, lease ms) reserved, its prompt
        # not computed yet: renewed as the decode's waiting requests are,
        # so a prefill longer than the lease keeps its offer
        self._computing: Dict[str, Tuple[Any, bytes, int]] = {}
        # prefill: rid -> tokens of a reservation to try again when the
        # request finishes (the instance was not on the daemon yet: a
        # daemon restarted under its ranks; or the budget was spent),
        # under one budget for the step's finished requests
        self._retry: Dict[str, int] = {}
        # decode: offers to release at the step's end
        self._to_release: List[Tuple[str, bytes]] = []
        self._finish_end: Optional[float] = None
        self._last_renew = 0.0
        self._quiet_until = 0.0

    @staticmethod
    def _params_lease_ms(params: bytes) -> int:
        try:
            return kvxfer.params_info(params).lease_ms
        except kvxfer.Error:
            return 0

    def on_new_request(self, request: "Request") -> None:
        """A decode request with a prefill's params: renewed while it
        waits (its lease is in the params). A remote-decode prefill:
        noted for a layer-wise offer; of a model with Mamba state, it
        computes all its prompt but the last token."""
        self.tables.truncate_for_prefill(request)
        self.lw.on_new_request(request)
        self.bidi.on_new_request(request)  # a decode's offer: renewed
        p = self._remote(request)
        if p is None or not self.renew_leases:
            return
        try:
            params = _params_of(p)
        except kvxfer.Error:
            return  # refused by get_num_new_matched_tokens, logged there
        lease = self._params_lease_ms(params)
        if lease:  # 0: a daemon before 2.6, which cannot renew
            self._waiting[request.request_id] = (request, params, lease)

    def _note_prefill(self, request: "Request") -> None:
        """A remote-decode prefill scheduled: reserved at the step's end
        for its prompt's tokens (max_tokens 1: what it computes)."""
        p = request.kv_transfer_params
        rid = request.request_id
        if not p or not p.get("do_remote_decode") or self.tables.hybrid \
                or rid in self._reserved or rid in self._to_reserve or \
                self.lw.has(rid):
            return  # a hybrid one: reserved when it finished
        n = int(request.num_prompt_tokens)
        if n > 0:
            self._to_reserve[rid] = (request_key(rid), n)

    def _daemon_step(self) -> None:
        """The step's reservations, renewals and releases, within the
        budget."""
        if not self._to_reserve and not self._to_release and \
                not self._renew_due():
            return
        now = time.monotonic()
        end = now + self.step_budget
        if now < self._quiet_until:
            self._to_reserve.clear()  # no params: their decodes compute
            self._to_release.clear()  # freed at their leases
            return
        try:
            self._reserve_step(end)
            self._renew_step(end)
            self._release_step(end)
        except kvxfer.Closed:
            # gone, or too slow (_timed): logged once; the offers not
            # released are freed at their leases (or went with the daemon)
            self._to_release.clear()
        self._to_reserve.clear()

    def _release_step(self, end: float) -> None:
        """The prefills' blocks the decode does not need (a full prefix
        hit, an abort before allocation), one release each; what the
        budget leaves goes at the next step."""
        while self._to_release:
            left = self._left(end)
            if left is None:
                return
            rid, params = self._to_release.pop(0)
            self._release_now(rid, params, left)

    @staticmethod
    def _left(end: float) -> Optional[float]:
        """What is left of the step's budget, None when it is spent (the
        rest waits for the next step, or goes without params)."""
        left = end - time.monotonic()
        return left if left >= 0.001 else None

    def _timed(self, fn: Any, *args: Any) -> Any:
        """self._daemon(fn, *args) for a call under the step's budget: one
        that runs out of it leaves the daemon alone for QUIET_S (a daemon
        gone is tried again at once: the library reconnects cheaply)."""
        def call(c: kvxfer.Client, *a: Any) -> Any:
            try:
                return fn(c, *a)
            except kvxfer.CallTimeout:
                self._quiet_until = time.monotonic() + self.QUIET_S
                raise
        return self._daemon(call, *args)

    def _reserve_many(self, c: kvxfer.Client, items: List[Tuple[bytes, int]],
                      timeout: float) -> List[Any]:
        return c.reserve_many(self.instance_id, items, timeout,
                              lease_ms=self.lease_ms or None)

    def _reserve_step(self, end: float) -> None:
        """self._daemon() raises Closed for a call that ran out of time
        (CallTimeout is one of DAEMON_GONE: the client gave up, the next
        call makes another)."""
        todo = list(self._to_reserve.items())
        for i in range(0, len(todo), MANY_MAX):
            part = todo[i:i + MANY_MAX]
            items = [(key, n) for _, (key, n) in part]
            left = self._left(end)
            try:
                if left is None:
                    raise kvxfer.Closed(kvxfer.Closed.code, "no budget left")
                res = self._timed(self._reserve_many, items, left)
            except kvxfer.Closed:
                if time.monotonic() >= self._quiet_until:
                    # gone (the library reconnects), not slow: again at
                    # their end
                    for rid, (_, n) in todo[i:]:
                        self._retry[rid] = n
                raise
            except kvxfer.Error as e:
                log.error("kvxfer reserve of %d requests failed: %s; their "
                          "decodes compute the prompt", len(items), e)
                continue
            for (rid, (_, n)), r in zip(part, res):
                if isinstance(r, bytes):
                    self._reserved[rid] = (r, n)
                    lease = self._params_lease_ms(r)
                    if lease:
                        self._computing[rid] = (None, r, lease)
                elif isinstance(r, (kvxfer.NotFound, kvxfer.StateError)):
                    self._retry[rid] = n  # the ranks not there (yet)
                else:
                    log.error("request %s: kvxfer reserve failed: %s", rid,
                              r)

    def _finish_left(self) -> Optional[float]:
        """What is left of the budget of the requests finished since the
        last step's scheduling (None: spent, or the daemon left alone)."""
        now = time.monotonic()
        if now < self._quiet_until:
            return None
        if self._finish_end is None:
            self._finish_end = now + self.step_budget
        return self._left(self._finish_end)

    def _reserve_late(self, rid: str, n: int) -> Optional[Tuple[bytes, int]]:
        """The reservation of a finished request that its step could not
        make, under what is left of the finished requests' budget."""
        left = self._finish_left()
        if left is None:
            return None
        key = request_key(rid)

        def one(c: kvxfer.Client, t: float) -> bytes:
            return c.reserve(self.instance_id, key, n, t,
                             lease_ms=self.lease_ms or None)
        try:
            return self._timed(one, left), n
        except kvxfer.Closed:
            return None  # gone or slow: logged once
        except kvxfer.Error as e:
            log.error("request %s: kvxfer reserve failed: %s", rid, e)
            return None

    def _reserve_groups(self, rid: str, n: int, tables: List[Any]
                        ) -> Optional[Tuple[bytes, int]]:
        """The reservation of a finished hybrid request with its groups
        (their first blocks are known only now), under what is left of
        the finished requests' budget."""
        left = self._finish_left()
        if left is None:
            return None
        key = request_key(rid)
        gs = self.tables.reserved(self._pools, tables)

        def one(c: kvxfer.Client, t: float) -> bytes:
            return c.reserve(self.instance_id, key, n, t,
                             pool=self._pools[0], groups=gs,
                             lease_ms=self.lease_ms or None)
        try:
            return self._timed(one, left), n
        except kvxfer.Closed:
            return None  # gone or slow: logged once
        except kvxfer.Error as e:
            log.error("request %s: kvxfer reserve failed: %s", rid, e)
            return None

    def _renew_due(self) -> bool:
        leases = [lease for _, _, lease in self._waiting.values()] + \
            [lease for _, _, lease in self._computing.values()]
        if not leases:
            return False
        every = min(leases) / 3000
        return time.monotonic() - self._last_renew >= every

    def _renew_step(self, end: float) -> None:
        if not self._renew_due():
            return
        self._last_renew = time.monotonic()
        todo = list(self._waiting.items()) + list(self._computing.items())
        for i in range(0, len(todo), MANY_MAX):
            part = todo[i:i + MANY_MAX]
            left = self._left(end)
            if left is None:
                self._last_renew = 0.0  # due again next step
                return
            try:
                res = self._timed(kvxfer.Client.renew,
                                  [v[1] for _, v in part], left)
            except kvxfer.Closed:
                raise
            except kvxfer.Error as e:
                log.warning("kvxfer renew of %d leases failed: %s",
                            len(part), e)
                continue
            self._renewed(part, res)

    def _renewed(self, part: List[Tuple[str, Tuple[Any, bytes, int]]],
                 res: List[Optional[kvxfer.Error]]) -> None:
        """An offer whose lease cannot be renewed is gone (or soon): its
        request computes the prompt here instead of fetching."""
        for (rid, (request, _, _)), err in zip(part, res):
            if err is None:
                continue
            if request is None:
                # the prefill's own (cancelled: preempted; or expired):
                # its finish returns params or not as before
                self._computing.pop(rid, None)
                continue
            self._waiting.pop(rid, None)
            if isinstance(err, kvxfer.Unsupported):
                log.warning("request %s: %s; its lease is not renewed",
                            rid, err)
                continue
            p = request.kv_transfer_params or {}
            p["do_remote_prefill"] = False
            log.warning("request %s: the prefill's offer ended (%s); it is "
                        "computed here", rid, err)
