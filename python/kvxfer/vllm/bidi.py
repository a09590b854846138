"""Multi-turn reuse (kv_connector_extra_config.bidirectional_kv_xfer,
the key and params flow of vLLM's NixlConnector): the decode keeps a
finished request's KV (prompt and generated tokens) as a kvxfer offer and
returns params for the next turn; the next turn's prefill fetches that
prefix from the decode into its own blocks, computes the rest and offers
the whole prompt to a decode as usual.

- Turn 1's decode, at request_finished (a request it fetched from a
  prefill, finished by length or stop): reserves an offer of its
  ``num_computed_tokens`` tokens under ``decoder_kv_blocks_ttl`` (vLLM's
  key, seconds, default 480: the offer's lease), publishes its blocks
  (the workers' publish path) and returns ``do_remote_decode: True`` with
  the offer's params, ``remote_num_tokens`` and
  ``remote_blocks_expiry_time`` (wall clock). vLLM holds the blocks until
  the offer ends: fetched, released, or at its lease.
- The proxy sends those params with turn 2 to a prefill (as vLLM's proxy
  does for NIXL); the prefill fetches the tokens its prefix cache lacks
  (under kv_recompute_threshold, as vLLM's pull: fewer are computed),
  computes the rest and offers turn 2 (do_remote_decode) as usual; the
  decode of turn 2 fetches only what its prefix cache lacks.
- A turn-2 prefill waiting in its queue renews the offer's lease
  (renew_leases); one not renewed past its expiry is not fetched: the
  prefill computes (as vLLM's _is_turn2_read_expired declines the
  read). One released or
  gone fails the fetch: load errors, vLLM's kv_load_failure_policy (as a
  NIXL read that fails). A prefill that does not fetch it (a full prefix
  hit, the threshold, an abort) releases it.

Both instances publish and fetch: kv_role kv_both, refused otherwise."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import kvxfer
from kvxfer.vllm.common import (PARAMS_KEY, Recv, Send, _b64, _extra,
                                _params_of, log, request_key)
from kvxfer.vllm.layerwise import flag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

KEY = "bidirectional_kv_xfer"
TTL_KEY = "decoder_kv_blocks_ttl"  # vLLM's: seconds the decode holds it
EXPIRY_KEY = "remote_blocks_expiry_time"  # vLLM's param (here wall clock)
DONE_KEY = "_kvxfer_bidi_done"  # the prefill took (or refused) it
RENEW_KEY = "_kvxfer_bidi_renew"  # since when its lease is renewed
EXPIRY_MARGIN_S = 1.0  # an offer this close to its expiry is computed


def fetch_key(request_id: str) -> bytes:
    """The prefill's key of its fetch of a decode's offer: not the
    request's own key, which its offer to the next decode reserves."""
    return request_key(request_id + "#bidi")


def _ttl_ms(extra: Dict[str, Any]) -> int:
    """decoder_kv_blocks_ttl in ms: seconds above 0, else refused."""
    v = extra.get(TTL_KEY, 480)
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    if isinstance(v, bool) or not 0 < f < float("inf"):
        raise kvxfer.InvalidArgument(
            -1, f"kv_connector_extra_config.{TTL_KEY}: {v!r} is not a "
            "number of seconds above 0")
    return max(1, int(round(f * 1000)))


def check(vllm_config: "VllmConfig", tables: Any) -> None:
    """Refuse, naming the options, what multi-turn reuse cannot serve:
    at __init__ (scheduler and workers), before KV caches exist."""
    extra = _extra(vllm_config)
    _ttl_ms(extra)
    if not flag(extra, KEY, False):
        return
    role = vllm_config.kv_transfer_config.kv_role
    if role != "kv_both":
        raise kvxfer.InvalidArgument(
            -1, f"kv_connector_extra_config.{KEY} needs kv_role kv_both "
            f"(got kv_role {role}): the decode offers its KV and the "
            "prefill fetches it")
    if flag(extra, "layerwise_load", False):
        raise kvxfer.Unsupported(
            -1, f"kv_connector_extra_config.{KEY} with layerwise_load: "
            "the prefill's fetch of the last turn is not layer-wise")
    if tables.hybrid:
        raise kvxfer.Unsupported(
            -1, f"kv_connector_extra_config.{KEY}: not for a model of "
            "several KV cache groups (hybrid)")


class Bidi:
    """The scheduler side of multi-turn reuse (sched: its _Scheduler)."""

    def __init__(self, vllm_config: "VllmConfig", sched: Any) -> None:
        """The config (check() refused what it cannot serve)."""
        extra = _extra(vllm_config)
        self.on = flag(extra, KEY, False)
        self.sched = sched
        self.ttl_ms = _ttl_ms(extra)

    # -- the prefill of turn 2 ------------------------------------------

    def _offer(self, request: "Request") -> Optional[Dict[str, Any]]:
        """The params of a decode's offer this request may fetch."""
        p = request.kv_transfer_params
        if self.on and p and p.get("do_remote_decode") and \
                PARAMS_KEY in p and not p.get(DONE_KEY):
            return p
        return None

    def _end(self, p: Dict[str, Any], request: "Request") -> int:
        """The tokens the fetch fills: the offer's, within the prompt
        but its last token (vLLM computes one to sample)."""
        try:
            n = int(p.get("remote_num_tokens") or 0)
        except (TypeError, ValueError):
            n = 0  # params not ours: computed, the offer released
        return max(0, min(n, int(request.num_prompt_tokens) - 1))

    def _expired(self, p: Dict[str, Any]) -> bool:
        t = p.get(EXPIRY_KEY)
        return isinstance(t, (int, float)) and \
            time.time() + EXPIRY_MARGIN_S >= float(t)

    def on_new_request(self, request: "Request") -> None:
        """A turn-2 prefill waiting in the queue renews the decode's
        offer's lease, as a decode renews a prefill's (renew_leases)."""
        p = self._offer(request)
        if p is None or not self.sched.renew_leases:
            return
        try:
            params = _params_of(p)
        except kvxfer.Error:
            return  # refused by matched, logged there
        lease = self.sched._params_lease_ms(params)
        if lease:  # 0: a daemon before 2.6, which cannot renew
            self.sched._waiting[request.request_id] = (request, params,
                                                       lease)
            p[RENEW_KEY] = time.monotonic()

    def _gone(self, request: "Request", p: Dict[str, Any]) -> bool:
        """The offer ended before the fetch: a renewal found it gone (the
        scheduler dropped the request from its renewals), or, not
        renewed since the request came, its expiry time is (nearly)
        reached."""
        since = p.get(RENEW_KEY)
        if since is not None:
            if request.request_id not in self.sched._waiting:
                return True
            if self.sched._last_renew > since:
                return False  # renewed: its expiry time is past news
        return self._expired(p)

    def matched(self, request: "Request", num_computed_tokens: int
                ) -> Optional[Tuple[int, bool]]:
        """get_num_new_matched_tokens of a turn-2 prefill (None: not one).
        The offer is fetched asynchronously, or not at all (0)."""
        p = self._offer(request)
        if p is None:
            return None
        try:
            _params_of(p)
        except kvxfer.Error as e:
            p[DONE_KEY] = True
            log.error("request %s: %s; it is computed here",
                      request.request_id, e)
            return 0, False
        if self._gone(request, p):
            log.warning("request %s: the decode's offer of the last turn "
                        "ended; it is computed here", request.request_id)
            p[DONE_KEY] = True  # freed at its lease
            return 0, False
        count = self._end(p, request) - num_computed_tokens
        if count <= 0 or count < self.sched.recompute_below:
            return 0, False  # computed here; released after allocation
        return count, True

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                    num_external_tokens: int) -> None:
        """update_state_after_alloc of a turn-2 prefill: the fetch of the
        tokens its prefix cache lacks, or the offer released."""
        p = self._offer(request)
        if p is None:
            return
        p[DONE_KEY] = True  # one transfer per request
        rid = request.request_id
        try:
            params = _params_of(p)
        except kvxfer.Error:
            return  # logged by matched
        if num_external_tokens <= 0:
            self.sched._release(rid, params)  # not needed: freed now
            return
        n = self._end(p, request)
        need = math.ceil(n / self.sched.block_size)
        ids = self.sched.tables.plain(blocks.get_block_ids())
        self.sched._meta.recvs[rid] = Recv(
            key=fetch_key(rid), params=params, block_ids=ids[:need],
            skip_tokens=n - num_external_tokens, num_tokens=n)
        self.sched._inflight.add(rid)

    def abandoned(self, request: "Request") -> None:
        """request_finished of a turn-2 prefill never allocated (an
        abort): the decode's offer released now, not at its lease."""
        p = self._offer(request)
        if p is None:
            return
        p[DONE_KEY] = True
        try:
            self.sched._release_finished(request.request_id, _params_of(p))
        except kvxfer.Error as e:
            log.error("request %s: %s", request.request_id, e)

    # -- the decode of turn 1 -------------------------------------------

    def decode_finished(self, request: "Request", block_ids: Any
                        ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """request_finished of a request this instance decoded (no
        do_remote_decode): with the key on, its KV offered for turn 2;
        (True, params) holds its blocks until the offer ends."""
        from vllm.v1.request import RequestStatus
        p = request.kv_transfer_params
        if not self.on or not p or PARAMS_KEY not in p or \
                request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                       RequestStatus.FINISHED_STOPPED):
            return False, None
        rid = request.request_id
        n = int(request.num_computed_tokens)
        groups = block_ids if block_ids and isinstance(
            block_ids[0], (list, tuple)) else [block_ids or []]
        ids = self.sched.tables.plain(groups)
        need = math.ceil(n / self.sched.block_size)
        if n <= 0 or len(ids) < need:
            return False, None
        params = self._reserve(rid, n)
        if params is None:
            return False, None  # turn 2's prefill computes it all
        self.sched._meta.sends[rid] = Send(key=request_key(rid),
                                           block_ids=ids[:need],
                                           num_tokens=n)
        lease_ms = self.sched._params_lease_ms(params) or self.ttl_ms
        return True, {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            PARAMS_KEY: _b64(params),
            "remote_engine_id": self.sched.instance_id,
            "remote_request_id": rid,
            "remote_num_tokens": n,
            EXPIRY_KEY: time.time() + lease_ms / 1000,
        }

    def _reserve(self, rid: str, n: int) -> Optional[bytes]:
        """The offer's reservation, under what is left of the finished
        requests' budget (None: not made, logged)."""
        left = self.sched._finish_left()
        if left is None:
            return None
        key = request_key(rid)

        def one(c: kvxfer.Client, t: float) -> bytes:
            return c.reserve(self.sched.instance_id, key, n, t,
                             lease_ms=self.ttl_ms)
        try:
            return self.sched._timed(one, left)
        except kvxfer.Closed:
            return None  # gone or slow: logged once
        except kvxfer.Error as e:
            log.error("request %s: kvxfer reserve of its KV for the next "
                      "turn failed: %s", rid, e)
            return None
