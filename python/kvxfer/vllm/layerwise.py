"""Layer-wise transfer in the vLLM connector: a prefill's offer is
published when its first prefill chunk is scheduled, and each layer is
made ready as the forward writes it, so a fetch copies the early layers
while the later ones are computed (kvxfer's layer-wise offers:
``publish(layerwise=True)``, ``layers_ready``, ``append_blocks``).

The scheduler half (:class:`LayerPlanner`) takes the offer the scheduler
reserved at the request's first scheduled chunk (its step's
``reserve_many``) and tells the workers each chunk (its new blocks and
the tokens its forward completes); the params go to the decode from
``request_finished`` as for a whole-request offer. The worker
half (:class:`LayerSender`) publishes at the step's first
``save_kv_layer`` (vLLM may start the step's loads after the forward, so
not in ``start_load_kv``), marks each layer ready from ``save_kv_layer``
(GPU pools: with an interprocess CUDA event recorded on the forward's
stream, so nothing synchronises), and in ``wait_for_save`` the layers no
``save_kv_layer`` named. A request's blocks are freed once vLLM finished
it and its offer ended, never before (an offer may complete before the
prefill samples its token).

The decode half (:class:`LayerLoader`): with ``layerwise_load`` the
decode loads synchronously (vLLM schedules the request at once and runs
its forward while the KV lands) and ``wait_for_layer_load`` waits for
each layer with ``fetch_progress``.

``kv_connector_extra_config``: ``layerwise`` (default true) turns the
prefill's layer-wise offers off (whole-request offers, published after
the request finished); ``layerwise_load`` (default false) turns the
decode's layer-wise loading on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Optional,
                    Set, Tuple)

import kvxfer
from kvxfer._outage import DAEMON_GONE
from kvxfer.vllm.common import (PARAMS_KEY, KvxferConnectorMetadata,
                                LayerChunk, _b64, log, request_key)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def flag(extra: Dict[str, Any], name: str, default: bool) -> bool:
    """A boolean of kv_connector_extra_config (true/false, 1/0, or the
    strings "true"/"false"); anything else is refused by name."""
    v = extra.get(name, default)
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    raise kvxfer.InvalidArgument(
        -1, f"kv_connector_extra_config.{name}: {v!r}, expected true or "
        "false")


# -- the scheduler half ----------------------------------------------------


@dataclass
class _Offer:
    """A request offered layer-wise, as the scheduler follows it."""

    request: "Request"
    key: bytes
    params: bytes
    num_tokens: int
    given: int = 0  # blocks the workers were given
    tokens: int = 0  # tokens the scheduled chunks complete
    dropped: bool = False  # preempted: the offer is cancelled


class LayerPlanner:
    """The scheduler side of layer-wise offers."""

    def __init__(self, on: bool, block_size: int, instance_id: str,
                 take: Callable[[str], Optional[bytes]]) -> None:
        self.on = on
        self.block_size = block_size
        self.instance_id = instance_id
        # request id -> the params the scheduler reserved for it this
        # step (its _reserve_step), now the layer-wise offer's; None: none
        self._take = take
        self._new: Dict[str, "Request"] = {}  # not scheduled yet
        self._offers: Dict[str, _Offer] = {}

    def has(self, request_id: str) -> bool:
        """The request is (or was, preempted) offered layer-wise."""
        return request_id in self._offers

    def on_new_request(self, request: "Request") -> None:
        p = request.kv_transfer_params
        if self.on and p and p.get("do_remote_decode"):
            self._new[request.request_id] = request

    def params_of(self, request_id: str) -> Optional[Dict[str, Any]]:
        """The kv_transfer_params request_finished will return for a
        request offered layer-wise (known from its first chunk on)."""
        o = self._offers.get(request_id)
        return None if o is None or o.dropped else self._params(o)

    def _params(self, o: _Offer) -> Dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: _b64(o.params),
            "remote_engine_id": self.instance_id,
            "remote_request_id": o.request.request_id,
            "remote_num_tokens": o.num_tokens,
        }

    def plan(self, so: "SchedulerOutput", meta: KvxferConnectorMetadata
             ) -> None:
        """This step's chunks of layer-wise offers, into meta (called in
        build_connector_meta, before vLLM advances num_computed_tokens)."""
        for rid in so.preempted_req_ids or ():
            o = self._offers.get(rid)
            if o is not None and not o.dropped:
                # its blocks are freed: the daemon must read no more
                o.dropped = True
                meta.lw_dropped.add(rid)
        state = getattr(so, "kv_connector_block_state", None)
        if state is None and self._new:
            # not vLLM 0.33's scheduler: no block tables for the chunks
            log.error("layer-wise offers need vLLM's kv_connector_block_"
                      "state; this instance publishes whole requests")
            self.on = False
            self._new.clear()
        for rid, n in so.num_scheduled_tokens.items():
            o = self._offers.get(rid)
            if o is None:
                req = self._new.pop(rid, None)
                if req is None:
                    continue
                o = self._offer(req)
                if o is None:
                    continue
            if o.dropped:
                continue
            end = min(o.request.num_computed_tokens + n, o.num_tokens)
            if end <= o.tokens:
                continue  # decoding on the prefill: nothing to offer
            ids = self._block_ids(state, o.request)
            need = math.ceil(end / self.block_size)
            meta.chunks[rid] = LayerChunk(
                key=o.key, blocks=list(ids[o.given:need]),
                num_tokens=o.num_tokens, tokens=end, publish=o.given == 0)
            o.given, o.tokens = need, end

    @staticmethod
    def _block_ids(state: Any, request: "Request") -> List[int]:
        ids = state.get_block_ids(request.request_id) if state else None
        return list(ids[0]) if ids else []

    def _offer(self, request: "Request") -> Optional[_Offer]:
        """The offer of a request's first chunk, with the reservation the
        scheduler made for it this step; None: not reserved (the daemon
        refused, was gone or slow: logged there), it goes whole."""
        rid = request.request_id
        params = self._take(rid)
        if params is None:
            return None
        o = self._offers[rid] = _Offer(request=request, key=request_key(rid),
                                       params=params,
                                       num_tokens=request.num_prompt_tokens)
        return o

    def finished(self, request: "Request", meta: KvxferConnectorMetadata
                 ) -> Optional[Tuple[bool, Optional[Dict[str, Any]]]]:
        """request_finished of a request offered layer-wise; None for any
        other (the whole-request path applies)."""
        from vllm.v1.request import RequestStatus
        rid = request.request_id
        self._new.pop(rid, None)
        o = self._offers.pop(rid, None)
        if o is None:
            return None
        if o.dropped:
            # preempted after its offer was made: its blocks were freed
            # then and the offer cancelled; the decode computes the prompt
            return False, None
        sent = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED) and \
            o.tokens >= o.num_tokens
        # the workers report the request once its offer ended (aborted:
        # once they cancelled it); vLLM holds its blocks till then
        meta.lw_finished[rid] = sent
        return True, self._params(o) if sent else None


# -- the worker half: the prefill's sender ---------------------------------


@dataclass
class _Sent:
    """A layer-wise offer on a worker."""

    key: bytes
    ended: bool = False  # its event came (or none will)
    finished: bool = False  # vLLM finished the request (lw_finished)


class LayerSender:
    """The worker side of layer-wise offers: publish, append, mark the
    layers ready, and say which requests' blocks may be freed."""

    RING = 2  # events per layer: a step's records, and the one before

    def __init__(self, worker: Any) -> None:
        self.w = worker  # the connector's _Worker
        self._offers: Dict[str, _Sent] = {}  # request id -> offer
        self._by_key: Dict[bytes, str] = {}
        self._meta: Optional[KvxferConnectorMetadata] = None
        self._step: List[Tuple[str, bytes, int]] = []  # rid, key, tokens
        self._marked = 0  # leading layers marked this step
        self._layer: Dict[str, int] = {}  # layer name -> pool layer
        self._num_layers = 0
        self._events: List[Any] = []
        self._next_event = 0
        self._done: Set[str] = set()
        self.marks_made = 0  # layers_ready calls that succeeded
        self.last_marked: Dict[bytes, int] = {}  # key -> layers marked

    def set_layers(self, names: List[str]) -> None:
        """The pool's layer names, in its layer order."""
        self._layer = {n: i for i, n in enumerate(names)}
        self._num_layers = len(names)

    # -- a step --------------------------------------------------------

    def begin(self, meta: KvxferConnectorMetadata) -> None:
        """The step's layer-wise work before its first layer is marked:
        drops, finishes, publishes and appends (once per step)."""
        if meta is self._meta:
            return
        self._meta, self._step, self._marked = meta, [], 0
        for rid in meta.lw_dropped:
            o = self._offers.pop(rid, None)
            if o is not None:
                self._by_key.pop(o.key, None)
                self._cancel(rid, o.key)
        for rid, sent in meta.lw_finished.items():
            o = self._offers.get(rid)
            if o is None:
                self._done.add(rid)  # never published here
                continue
            o.finished = True
            if not sent and not o.ended:
                self._cancel(rid, o.key)
                o.ended = True
            self._report(rid)
        c = self.w.client
        pool = self.w.pool
        for rid, ch in meta.chunks.items():
            if c is None or pool is None:
                if ch.publish:
                    self._offers[rid] = _Sent(key=ch.key, ended=True)
                continue
            o = self._offers.get(rid)
            try:
                if ch.publish:
                    c.publish(ch.key, pool, ch.blocks, ch.num_tokens,
                              layerwise=True)
                    o = self._offers[rid] = _Sent(key=ch.key)
                    self._by_key[ch.key] = rid
                elif o is None or o.ended:
                    continue
                elif ch.blocks:
                    c.append_blocks(ch.key, pool, ch.blocks)
            except kvxfer.Error as e:
                self._failed(rid, ch, e)
                continue
            self._step.append((rid, ch.key, ch.tokens))

    def _failed(self, rid: str, ch: LayerChunk, e: kvxfer.Error) -> None:
        """A publish or append refused: the offer ends here (its fetch
        fails, and the decode recomputes); blocks freed at the finish."""
        if isinstance(e, DAEMON_GONE):
            self.w._lost(e)
        elif not isinstance(e, (kvxfer.NotFound, kvxfer.Cancelled)):
            log.error("request %s: kvxfer layer-wise %s failed: %s", rid,
                      "publish" if ch.publish else "append_blocks", e)
        o = self._offers.get(rid)
        if o is None:
            o = self._offers[rid] = _Sent(key=ch.key)
        if not o.ended and not ch.publish:
            self._cancel(rid, ch.key)
        o.ended = True
        self._by_key.pop(ch.key, None)
        self._report(rid)

    def layer_saved(self, layer_name: str, kv_layer: Any) -> None:
        """save_kv_layer: the forward wrote layer_name (and every layer
        before it that no call named)."""
        if not self._step:
            return
        i = self._layer.get(layer_name)
        if i is None or i < self._marked:
            return
        self._mark(i + 1, kv_layer)

    def end_step(self) -> None:
        """wait_for_save: the layers no save_kv_layer named are ready once
        the forward's work so far is."""
        if self._step and self._marked < self._num_layers:
            self._mark(self._num_layers, None)
        self._step = []

    def _mark(self, upto: int, kv_layer: Any) -> None:
        first, count = self._marked, upto - self._marked
        self._marked = upto
        ev = self._record(kv_layer)
        c = self.w.client
        if c is None:
            return
        for rid, key, tokens in self._step:
            o = self._offers.get(rid)
            if o is None or o.ended:
                continue
            try:
                c.layers_ready(key, first, count, tokens=tokens, event=ev)
                self.marks_made += 1
                self.last_marked[key] = upto
            except (kvxfer.NotFound, kvxfer.Cancelled):
                pass  # ended: its event is on the way (or came)
            except DAEMON_GONE as e:
                self.w._lost(e)
                return
            except kvxfer.Error as e:
                log.error("request %s: kvxfer layers_ready failed: %s",
                          rid, e)
                self._cancel(rid, key)
                o.ended = True
                self._report(rid)

    def _record(self, kv_layer: Any) -> Any:
        """An interprocess CUDA event recorded on the current stream, for a
        GPU pool (host pools: None, the layers are written already)."""
        if not self.w.gpu:
            return None
        import torch
        n = max(1, self._num_layers) * self.RING
        if not self._events:
            self._events = [torch.cuda.Event(interprocess=True)
                            for _ in range(n)]
        ev = self._events[self._next_event]
        self._next_event = (self._next_event + 1) % n
        dev = kv_layer.device if kv_layer is not None else None
        ev.record(torch.cuda.current_stream(dev))
        return ev

    def _cancel(self, rid: str, key: bytes) -> None:
        """Cancel an offer, fenced: the daemon reads none of its blocks
        once this returns (or the daemon is gone)."""
        c = self.w.client
        if c is None:
            return
        try:
            c.cancel(key)
        except kvxfer.NotFound:
            pass  # ended already
        except DAEMON_GONE as e:
            self.w._lost(e)
        except kvxfer.Error as e:
            log.error("request %s: kvxfer cancel failed: %s", rid, e)

    # -- ends --------------------------------------------------------------

    def has(self, key: bytes) -> bool:
        """An offer of key is layer-wise here, not ended."""
        return key in self._by_key

    def on_event(self, ev: kvxfer.Event) -> bool:
        """An event of a layer-wise offer (True: it was one)."""
        rid = self._by_key.pop(ev.key, None)
        if rid is None:
            return False
        o = self._offers.get(rid)
        if o is not None:
            if not ev.ok and ev.kind != kvxfer.EventKind.CANCELLED:
                log.warning("request %s: layer-wise offer ended %s: %s",
                            rid, kvxfer.status_name(ev.code), ev.message)
            o.ended = True
            self._report(rid)
        return True

    def end_all(self) -> None:
        """The client is gone: no event will come for any offer."""
        for rid, o in list(self._offers.items()):
            o.ended = True
            self._report(rid)
        self._by_key.clear()
        self._step = []

    def _report(self, rid: str) -> None:
        o = self._offers.get(rid)
        if o is not None and o.ended and o.finished:
            del self._offers[rid]
            self._by_key.pop(o.key, None)
            self._done.add(rid)

    def take_done(self) -> Set[str]:
        """Requests whose blocks vLLM may free now (finished_sending)."""
        out, self._done = self._done, set()
        return out


# -- the worker half: the decode's loader ----------------------------------


class LayerLoader:
    """wait_for_layer_load of synchronous loads (``layerwise_load``): the
    forward reaches a layer once every fetch of this step has landed it."""

    POLL_S = 0.0001

    def __init__(self, worker: Any) -> None:
        self.w = worker
        self._layer: Dict[str, int] = {}
        self._waiting: Dict[bytes, int] = {}  # key -> layers seen landed
        self.sync: Set[bytes] = set()  # synchronous loads not ended
        self.waits = 0  # layers waited for (for the tests' assertions)
        self._waited = 0.0  # seconds the forward waited this step

    def set_layers(self, names: List[str]) -> None:
        self._layer = {n: i for i, n in enumerate(names)}

    def started(self, keys: List[bytes]) -> None:
        """The step's fetches the forward reads (start_load_kv; [] at its
        wait_for_save)."""
        self._waiting = {k: 0 for k in keys}

    def ended(self, key: bytes) -> bool:
        """A fetch ended: True when it was a synchronous load."""
        if key not in self.sync:
            return False
        self.sync.discard(key)
        return True

    def wait(self, layer_name: str, timeout_s: float) -> None:
        """Block until layer_name landed for every fetch of the step (or
        the fetch ended: its event tells how)."""
        i = self._layer.get(layer_name)
        if i is None or self.w.client is None or not self._waiting:
            return
        t0 = time.monotonic()
        end = t0 + timeout_s
        try:
            self._wait(i, layer_name, end, timeout_s)
        finally:
            self._waited += time.monotonic() - t0

    def take_waited(self) -> float:
        """Seconds the step's forward waited for layers in flight (the
        transfer time layer-wise loading left exposed)."""
        out, self._waited = self._waited, 0.0
        return out

    def _wait(self, i: int, layer_name: str, end: float,
              timeout_s: float) -> None:
        c = self.w.client
        for key in list(self._waiting):
            while self._waiting[key] <= i:
                try:
                    done, _, ended = c.fetch_progress(key)
                except (kvxfer.NotFound, kvxfer.Cancelled):
                    done, ended = 1 << 30, True  # over
                except kvxfer.Error as e:
                    if isinstance(e, DAEMON_GONE):
                        self.w._lost(e)
                    self._waiting.clear()
                    return
                self._waiting[key] = done
                if done > i or ended:
                    self._waiting[key] = max(done, i + 1)
                    break
                if time.monotonic() > end:
                    log.warning("layer %s: not loaded in %.1f s; the "
                                "forward goes on (the fetch's end "
                                "reports it)", layer_name, timeout_s)
                    self._waiting.clear()
                    return
                time.sleep(self.POLL_S)
        self.waits += 1
