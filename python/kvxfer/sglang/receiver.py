"""KvxferKVReceiver: one request of a decode rank."""

from __future__ import annotations

import time
from typing import Any, List, Optional, Set

from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from ..client import Event, Group, key_bytes
from ..errors import Error, NotFound, PeerGone
from .common import KvxferTransferError, _unpack_aux, end_key
from .bootstrap import GroupLocator
from .manager import KvxferKVManager, _cancel

# -- decode -----------------------------------------------------------------

class KvxferKVReceiver(BaseKVReceiver):
    """One request of a decode rank (SGLang's KV receiver).

    KVPoll: Bootstrapping until the prefill DP group the room goes to is
    known (its bootstrap server answered with the group's rank 0),
    WaitingForInput until ``send_metadata`` names the pages, Transferring
    while the fetch by key runs, then Success (the KV is in the pages and
    the prefill's aux rows in row ``aux_index`` of the metadata buffers)
    or Failed with kvxfer's reason.
    """

    require_staging = False  # read by SGLang's staging path
    abort_notified = False  # read when deferred release is on (it is not)

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.key = key_bytes(self.bootstrap_room)
        self.aux_index: Optional[int] = None
        self.conclude_state: Optional[int] = None
        self.prefill_dp_rank: Optional[int] = None
        self._group: Optional[GroupLocator] = None
        self._state = KVPoll.Bootstrapping
        self._reason = ""
        self._code = 0
        self.end_key = end_key(self.key)
        self._fetched: List[bytes] = []  # keys fetched
        self._done: Set[bytes] = set()  # keys complete (or cancelled)
        self._inited_at: Optional[float] = None
        mgr._watch(self.key, self)
        mgr._watch(self.end_key, self)

    def init(self, prefill_dp_rank: int = 0) -> None:
        """The room goes to prefill DP group ``prefill_dp_rank`` (SGLang's
        decode queue chose it from ``prefill_info_table``): find that
        group's kvxfer instance on the bootstrap server (looked up once
        per group); poll() retries until KVXFER_SGLANG_BOOTSTRAP_TIMEOUT
        when it does not answer yet."""
        self.prefill_dp_rank = int(prefill_dp_rank or 0)
        self._inited_at = time.monotonic()
        self._resolve()

    def _resolve(self) -> None:
        m, addr = self.kv_mgr, self.bootstrap_addr
        d = int(self.prefill_dp_rank or 0)
        if m.try_ensure_parallel_info(addr):
            groups = m.prefill_info_table[addr].dp_size
            if not 0 <= d < groups:
                self._fail(f"prefill_dp_rank {d}: the prefill at {addr} "
                           f"has {groups} DP groups")
                return
            self._group = m.group_locator(addr, d)
            if self._group is not None:
                self._state = KVPoll.WaitingForInput
                return
        if (self._inited_at is not None and time.monotonic()
                - self._inited_at > m.bootstrap_timeout):
            self._fail(f"no kvxfer prefill instance at bootstrap server "
                       f"{addr} after {m.bootstrap_timeout:g} s: "
                       f"{m.lookup_error(addr)}")

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None,
                      destination: Any = None, **_: Any) -> None:
        """Fetch the room's KV into pages ``kv_indices`` by key, from the
        prefill DP group found at init; the aux rows go to row
        ``aux_index``. The pages cover the prompt from token
        ``decode_prefix_len`` (the decode radix cache holds the tokens
        before it): the fetch skips those tokens (:meth:`_blocks`)."""
        if self._state != KVPoll.WaitingForInput:
            if self._state == KVPoll.Bootstrapping:
                self._fail("send_metadata() before the prefill instance "
                           "was found (init)")
            return
        if str(getattr(destination, "value", destination or "device")) \
                != "device":
            self._fail("a host KV destination is not supported by "
                       "kvxfer.sglang: SGLang's host KV pool is pinned "
                       "memory, which kvxferd cannot map (host pools lie "
                       "in a memfd); the manager says "
                       "supports_host_destination False")
            return
        self.aux_index = aux_index
        if hasattr(kv_indices, "cpu"):
            kv_indices = kv_indices.cpu().numpy()
        m = self.kv_mgr
        # the lookup again when it was forgotten since init (a restart)
        g = m.group_locator(self.bootstrap_addr,
                            int(self.prefill_dp_rank or 0)) or self._group
        assert g is not None
        skip = int(decode_prefix_len or 0)
        given = [int(p) for p in kv_indices]
        pages = self._blocks(given, skip)
        groups = self._state_groups(state_indices,
                                    len(pages) if pages else len(given))
        if pages is None or groups is None or not self._same_pages():
            return
        self._state = KVPoll.Transferring
        m.pace()  # before the fetch's copies start (poll())
        try:
            m.call(lambda c: c.fetch_by_key(self.key, g.instance_id,
                                            g.address, self.key, m.pool,
                                            pages, skip_tokens=skip))
            self._fetched.append(self.key)
            # the end offer: token 0 of the last page (the room's offer
            # moves it too), the aux rows, the state slots (sender.py)
            m.call(lambda c: c.fetch_by_key(self.end_key, g.instance_id,
                                            g.address, self.end_key,
                                            m.pool, given[-1:],
                                            groups=groups or None))
            self._fetched.append(self.end_key)
        except Error as e:
            self._fail(str(e), e.code)

    def _same_pages(self) -> bool:
        """The end offer's token lies in the prefill's last page, read
        into this side's: the two sides' pages must be the same size
        (as SGLang requires of every backend)."""
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        mine = int(self.kv_mgr.kv_args.page_size)
        if info is not None and info.page_size not in (None, mine):
            self._fail(f"page size mismatch: the prefill's is "
                       f"{info.page_size}, this decode's {mine} (both "
                       "servers must use the same --page-size)")
            return False
        return True

    def _state_groups(self, state_indices: Optional[List],
                      num_pages: int) -> Optional[List[Group]]:
        """The request's state tables as groups (state.py), for a request
        of ``num_pages`` pages; None (and Failed) when SGLang's
        state_indices do not fit, or when state slots would move between
        two attention TP sizes."""
        m = self.kv_mgr
        if not m.num_states:
            return []
        info = m.prefill_info_table.get(self.bootstrap_addr)
        if m.has_slots and info is not None and \
                info.attn_tp_size != m.tp_size:
            self._fail(f"state slots ({m.num_states} state types) move "
                       "between equal attention TP sizes only: prefill "
                       f"{info.attn_tp_size}, decode {m.tp_size}")
            return None
        try:
            return m.state_groups(state_indices, num_pages, None)
        except ValueError as e:
            self._fail(f"kvxfer.sglang: {e}")
            return None

    def _blocks(self, pages: List[int], skip: int) -> Optional[List[int]]:
        """The fetch's block table for ``pages`` holding the tokens from
        ``skip`` on: kvxfer's covers the prompt from token 0 and writes
        none of the ``skip`` tokens, so the cached prefix's pages (which
        SGLang does not pass) are stood in for by as many other pages of
        the pool, never written: the lowest ids ``pages`` lacks. None
        (and Failed) when that cannot be done."""
        if not skip:
            return pages
        page = int(self.kv_mgr.kv_args.page_size)
        if skip < 0 or skip % page:
            self._fail(f"decode_prefix_len {skip} is not a whole number of "
                       f"pages of {page} tokens")
            return None
        if not pages:
            self._fail(f"decode_prefix_len {skip}: no page left to fetch "
                       "into (the decode holds the whole prompt)")
            return None
        taken, need = set(pages), skip // page
        stand_in = []
        for b in range(self.kv_mgr.layout.num_blocks):
            if len(stand_in) == need:
                break
            if b not in taken:
                stand_in.append(b)
        if len(stand_in) < need:
            self._fail(f"decode_prefix_len {skip}: {need} pages before "
                       f"the {len(pages)} given pass the pool's "
                       f"{self.kv_mgr.layout.num_blocks} pages")
            return None
        return stand_in + pages

    def _on_event(self, ev: Event) -> None:
        if self._state != KVPoll.Transferring:
            return
        if not ev.ok:
            if ev.code in (NotFound.code, PeerGone.code):
                self.kv_mgr.forget_prefill(self.bootstrap_addr)
            self._fail(str(ev.error), ev.code)
            return
        m = self.kv_mgr
        self._done.add(ev.key)
        if ev.key == self.end_key and m.aux_ptrs and \
                self.aux_index is not None:
            try:
                _unpack_aux(ev.aux, m.aux_ptrs, m.aux_lens, m.aux_items,
                            int(self.aux_index))
            except ValueError as e:
                self._fail(f"kvxfer.sglang: {e}")
                return
        if self._done >= {self.key, self.end_key}:
            self._state = KVPoll.Success
            self._unwatch()

    def _fail(self, reason: str, code: int = 0) -> None:
        """Failed with ``reason``; a fetch of the room still running is
        cancelled first (no page is written after this returns)."""
        if self._state not in (KVPoll.Success, KVPoll.Failed):
            self._state = KVPoll.Failed
            self._reason = reason
            self._code = code
            self.conclude_state = KVPoll.Failed
            for key in self._fetched:
                if key not in self._done:
                    _cancel(self.kv_mgr, key)
                    self._done.add(key)
            self._unwatch()

    def _unwatch(self) -> None:
        self.kv_mgr._unwatch(self.key, self)
        self.kv_mgr._unwatch(self.end_key, self)

    def poll(self) -> KVPoll:
        """While the fetch runs, the rank's GPU pace is set
        (KvxferKVManager.pace): the decode's loop polls its receivers at
        each step, and a fetch in flight is what copies onto its GPU."""
        if self._state == KVPoll.Bootstrapping and \
                self._inited_at is not None:
            self._resolve()
        elif self._state == KVPoll.Transferring:
            self.kv_mgr.pace()
            self.kv_mgr.pump()
        return self._state

    def failure_exception(self) -> None:
        self._fail("failed for an unknown reason")
        self.clear()
        raise KvxferTransferError(self.bootstrap_room, self._reason,
                                  self._code)

    def abort(self) -> None:
        """Cancel the fetches: when this returns the daemon writes none of
        the pages any more; the request polls Failed."""
        self._fail("aborted by SGLang (AbortReq)")

    def is_abort_release_safe(self) -> bool:
        # a kvxfer cancel is a fence: once it returned, no write follows
        return self._state != KVPoll.Transferring

    def clear(self) -> None:
        """Forget the request. A fetch still running is cancelled first."""
        self._fail("cleared while transferring")
        self._unwatch()

