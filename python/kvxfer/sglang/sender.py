"""KvxferKVSender: one request of a prefill rank."""

from __future__ import annotations

import time
from typing import Any, List, Optional, Set

from sglang.srt.disaggregation.base.conn import (BaseKVSender, KVPoll,
                                                 KVTransferMetric)
from sglang.srt.environ import envs

from ..client import Event, key_bytes
from ..errors import Error
from .bootstrap import BootstrapError, register_dp_rank
from .common import KvxferTransferError, _pack_aux, end_key
from .manager import KvxferKVManager, _cancel

# -- prefill ----------------------------------------------------------------

class KvxferKVSender(BaseKVSender):
    """One request of a prefill rank (SGLang's KV sender).

    A room is two kvxfer offers of this rank: the room's (its pages; the
    room's bootstrap room as key), layer-wise and growing chunk by chunk
    while streaming, and its end offer (key ``ROOM.end``: the aux rows,
    the state slots and one token), published by the last chunk, since
    an offer's aux and groups are given when it is published.

    KVPoll: WaitingForInput from the start (fetch by key needs no
    handshake: the decode side finds the offers by the room) until the
    last chunk, Transferring then, Success when the decode side has read
    both offers (the context side's COMPLETE of each), Failed on any
    other event or a refused call.
    """

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str,
                 bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.key = key_bytes(self.bootstrap_room)
        self.num_kv_indices: Optional[int] = None
        self.aux_index: Optional[int] = None
        self._pages: List[Any] = []
        self._num_pages = 0
        self._num_tokens = 0
        self._state = KVPoll.WaitingForInput
        self._reason = ""
        self._code = 0
        self.end_key = end_key(self.key)
        self._opened = False  # the room's offer
        self._ended = False  # the room's end offer
        self._done: Set[bytes] = set()  # keys complete (or cancelled)
        self._start: Optional[float] = None
        self._metric = KVTransferMetric()
        mgr._watch(self.key, self)
        mgr._watch(self.end_key, self)
        self._place(req_has_disagg_prefill_dp_rank)

    def _place(self, routed: bool) -> None:
        """With several prefill DP groups, how the decode learns this
        room's group, as CommonKVSender does it: the room modulo the
        groups (``follow_bootstrap_room``: a room dispatched elsewhere
        fails, naming SGLang's switch), or ``/register_dp_rank`` on the
        bootstrap server when the prefill balances its groups itself
        (one row per room, from the group's rank 0). ``routed``: the
        router named the group in the request; the decode has it too."""
        t = self.kv_mgr.topology
        if t.dp_groups == 1 or routed:
            return
        follow = t.load_balance_method == "follow_bootstrap_room"
        force = envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get()
        if follow and not force:
            if self.bootstrap_room % t.dp_groups != t.dp_group:
                self._fail(
                    f"follow_bootstrap_room conflict: dispatched to DP "
                    f"group {t.dp_group} but bootstrap_room "
                    f"{self.bootstrap_room} implies "
                    f"{self.bootstrap_room % t.dp_groups}. Set "
                    "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to "
                    "allow mixed routing")
            return
        if t.rank != 0:
            return
        try:
            register_dp_rank(self.bootstrap_addr, self.bootstrap_room,
                             t.dp_group)
        except BootstrapError as e:
            self._fail(f"registering the room's DP group: {e}")

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None
             ) -> None:
        """The request will send ``num_kv_indices`` pages; its aux rows
        are row ``aux_index`` of the metadata buffers."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # the last chunk publishes, even with no new page
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: Optional[List] = None,
             num_kv_tokens: Optional[int] = None, **_: Any) -> None:
        """One prefill chunk's pages (the last chunk's complete
        ``num_kv_indices``). Streaming (KVXFER_SGLANG_STREAM, the
        default): the first chunk opens a layer-wise offer of the room,
        each chunk appends its pages and marks its tokens ready, so they
        move while later chunks are computed; else the last chunk
        publishes every page. Either way the last chunk publishes the
        room's end offer (see :class:`KvxferKVSender`). A forward ran:
        the rank's GPU pace is set first (KvxferKVManager.pace)."""
        self.kv_mgr.pace()
        if self._state in (KVPoll.Success, KVPoll.Failed) or \
                self._ended:
            return
        if self.num_kv_indices is None:
            self._fail("send() before init(): SGLang's scheduler inits a "
                       "sender when its bootstrap is done")
            return
        if hasattr(kv_indices, "cpu"):  # a CPU tensor
            kv_indices = kv_indices.cpu().numpy()
        pages = [int(p) for p in kv_indices]
        if self._num_pages + len(pages) > self.num_kv_indices:
            self._fail(f"{self._num_pages + len(pages)} pages sent for a "
                       f"request of {self.num_kv_indices}")
            return
        self._pages.extend(pages)
        self._num_pages += len(pages)
        page = int(self.kv_mgr.kv_args.page_size)
        self._num_tokens += (int(num_kv_tokens) if num_kv_tokens is not None
                             else len(pages) * page)
        last = self._num_pages == self.num_kv_indices
        if self._start is None:
            self._start = time.perf_counter()
        try:
            if self.kv_mgr.stream:
                self._stream(pages, last)
            elif last:
                self._publish_whole()
            if last:
                self._publish_end(state_indices)
        except Error as e:
            self._fail(str(e), e.code)

    def _stream(self, pages: List[int], last: bool) -> None:
        """This chunk's pages into the room's layer-wise offer, its
        tokens ready on every layer of this rank. The offer holds whole
        pages (a chunk does not know the prompt's length; the last
        page's tail moves too, into the decode's own last page)."""
        m, page = self.kv_mgr, int(self.kv_mgr.kv_args.page_size)
        if not self._opened:
            if not pages:
                return  # nothing to open the offer with yet
            m.call(lambda c: c.publish(self.key, m.pool, pages,
                                       num_tokens=self.num_kv_indices * page,
                                       layerwise=True))
            self._opened = True
        elif pages:
            m.call(lambda c: c.append_blocks(self.key, m.pool, pages))
        ready = None if last else self._num_tokens
        m.call(lambda c: c.layers_ready(self.key, 0, m.layout.num_layers,
                                        tokens=ready))

    def _publish_whole(self) -> None:
        m = self.kv_mgr
        m.call(lambda c: c.publish(self.key, m.pool, self._pages,
                                   num_tokens=self._num_tokens))
        self._opened = True

    def _publish_end(self, state_indices: Optional[List]) -> None:
        """The room's end offer: what exists only once the last chunk ran,
        the aux rows (the last PP stage's: it computed the first token)
        and the request's state slots (the last chunk's
        ``state_indices``, state.py), with one token, token 0 of the last
        page, which the room's offer moves as well."""
        m = self.kv_mgr
        groups = None
        if m.num_states:
            try:
                groups = m.state_groups(state_indices, self._num_pages,
                                        self._num_tokens)
            except ValueError as e:
                self._fail(f"kvxfer.sglang: {e}")
                return
        aux = None
        last = m.topology.pp_rank == m.topology.pp_size - 1
        if m.aux_ptrs and self.aux_index is not None and last:
            aux = _pack_aux(m.aux_ptrs, m.aux_lens, m.aux_items,
                            int(self.aux_index))
        m.call(lambda c: c.publish(self.end_key, m.pool, self._pages[-1:],
                                   num_tokens=1, aux=aux, groups=groups))
        self._ended = True
        self._state = KVPoll.Transferring
        self._metric.transfer_total_bytes = (
            self._num_pages * sum(m.kv_args.kv_item_lens))

    def _on_event(self, ev: Event) -> None:
        if self._state in (KVPoll.Success, KVPoll.Failed):
            return
        if not ev.ok:
            self._fail(str(ev.error), ev.code)
            return
        self._done.add(ev.key)
        if self._state == KVPoll.Transferring and \
                self._done >= {self.key, self.end_key}:
            self._state = KVPoll.Success
            self._unwatch()
            if self._start is not None:
                self._metric.transfer_latency_s = (time.perf_counter()
                                                   - self._start)

    def _fail(self, reason: str, code: int = 0) -> None:
        """Failed with ``reason``; an offer of the room still open is
        cancelled (the decode's fetch ends CANCELLED)."""
        if self._state not in (KVPoll.Success, KVPoll.Failed):
            self._state = KVPoll.Failed
            self._reason = reason
            self._code = code
            self._cancel_open()
            self._unwatch()

    def _cancel_open(self) -> None:
        for key, opened in ((self.key, self._opened),
                            (self.end_key, self._ended)):
            if opened and key not in self._done:
                _cancel(self.kv_mgr, key)
                self._done.add(key)

    def _unwatch(self) -> None:
        self.kv_mgr._unwatch(self.key, self)
        self.kv_mgr._unwatch(self.end_key, self)

    def poll(self) -> KVPoll:
        if self._state == KVPoll.Transferring:
            self.kv_mgr.pump()
        return self._state

    def get_transfer_metric(self) -> KVTransferMetric:
        return self._metric

    def failure_exception(self) -> None:
        self._fail("failed for an unknown reason")
        self.clear()
        raise KvxferTransferError(self.bootstrap_room, self._reason,
                                  self._code)

    def abort(self) -> None:
        """Cancel: the room's offers are ended on the daemon (the decode
        side's fetch fails with CANCELLED); the request polls Failed."""
        self._fail("aborted by SGLang (AbortReq)")

    def clear(self) -> None:
        """Forget the request. One still in flight is cancelled first."""
        self._fail("cleared while transferring")
        self._unwatch()

