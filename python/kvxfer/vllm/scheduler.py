"""The connector's scheduler half: which requests fetch, publish,
release or cancel, and the offers' params."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

import kvxfer
from kvxfer._outage import DAEMON_GONE, Outage, nudge, retrying
from kvxfer.vllm.common import (PARAMS_KEY, KvxferConnectorMetadata, Recv,
                                Send, _b64, _extra, _instance_id,
                                _params_of, _socket, log, request_key)
from kvxfer.vllm.layerwise import LayerPlanner, flag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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
        # the decode loads synchronously, its forward layer by layer
        self.layerwise_load = flag(extra, "layerwise_load", False)
        self.lw = LayerPlanner(flag(extra, "layerwise", True),
                               self.block_size, self.instance_id,
                               self._reserve_layerwise)

    def _reserve_layerwise(self, key: bytes, num_tokens: int) -> bytes:
        return self._daemon(kvxfer.Client.reserve, self.instance_id, key,
                            num_tokens)

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
        n = min(int(p.get("remote_num_tokens") or 0),
                len(request.prompt_token_ids or ()))
        if self.layerwise_load:
            n = min(n, len(request.prompt_token_ids or ()) - 1)
        return n

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
            block_ids=ids[:need],
            skip_tokens=self._loaded_end(p, request) - num_external_tokens,
            sync=self.layerwise_load, num_tokens=n)
        if not self.layerwise_load:
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

    def build_connector_meta(self, so: Optional["SchedulerOutput"] = None
                             ) -> KvxferConnectorMetadata:
        if so is not None:
            self.lw.plan(so, self._meta)  # layer-wise offers' chunks
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
        lw = self.lw.finished(request, self._meta)
        if lw is not None:
            return lw  # offered layer-wise (layerwise.py)
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
