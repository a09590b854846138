"""The connector's worker half: one kvxfer rank with the worker's KV
caches as its pool; it publishes, fetches and reports what ended."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch

import kvxfer
from kvxfer._outage import (DAEMON_GONE, Outage, gone_event, nudge,
                            retrying)
from kvxfer.vllm.common import (MANY_MAX, KvxferConnectorMetadata,
                                KvxferHandshakeMetadata, Recv, _extra,
                                _instance_id, _role, _socket, log,
                                new_tally, parallel_rank, request_key)
from kvxfer.vllm.bidi import fetch_key
from kvxfer.vllm.hybrid import STATE, Tables, register_tables
from kvxfer.vllm.layerwise import LayerLoader, LayerSender
from kvxfer.vllm.layout import layout_of_kv_caches
from kvxfer.vllm.pace import GpuPacer

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _token_bytes(caches: Dict[str, torch.Tensor]) -> int:
    """A token's K and V in attention caches (vLLM's views: [blocks, KV
    heads, tokens, K|V] in shape order)."""
    return sum(t.shape[1] * t.shape[3] * t.element_size()
               for t in caches.values())


def _table_bytes(tables: Tables, kv_caches: Dict[str, torch.Tensor]
                 ) -> List[Tuple[int, int]]:
    """Per table but the plain one: (a state slot's bytes, 0) for a part
    of a Mamba state, (0, a token's bytes) for attention."""
    out = []
    for g, caches in tables.layer_sets(kv_caches)[1:] \
            if tables.hybrid else ():
        if g.kind == STATE and g.part is not None:
            es = torch.tensor([], dtype=g.part.dtype).element_size()
            out.append((g.part.units * g.part.unit_elems * es
                        * len(caches), 0))
        else:
            out.append((0, _token_bytes(caches)))
    return out


class _Worker:
    """One worker: a kvxfer rank with the worker's KV caches as its pool."""

    def __init__(self, vllm_config: "VllmConfig",
                 tables: Optional[Tables] = None) -> None:
        self.cfg = vllm_config
        self.tables = tables or Tables(None)
        self.group_pools: List[kvxfer.Pool] = []  # tables 1.. (hybrid)
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
        self._failed_recv: Set[str] = set()  # hybrid models' failures
        self._kv_caches: Optional[Dict[str, torch.Tensor]] = None
        self.rank = 0
        self._gathered: Optional[List[str]] = None  # from the handshake
        self._joined = False
        self._join_refused = False  # logged; tried again by a new client
        self._new_pools = False  # a client made anew: its pools' ids
        self._next_connect = 0.0  # when a client given up is made again
        self._outage = Outage(log, f"kvxfer worker of {self.instance_id}")
        self.lw = LayerSender(self)  # layer-wise offers (layerwise.py)
        self.loader = LayerLoader(self)
        self.pacer = GpuPacer(extra)  # gpu_pace (pace.py)
        # the metrics (metrics.py): this interval's observations, each
        # fetch's start and bytes, and this rank's bytes per token
        self.tally = new_tally()
        self._fetch_t0: Dict[bytes, Tuple[float, int]] = {}
        self._token_bytes = 0  # the plain table's, a token
        # each other table's (hybrid): (a state slot's bytes, or 0; a
        # token's bytes, or 0)
        self._table_bytes: List[Tuple[int, int]] = []

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
        tp_rank, tp, pp_rank, pp = parallel_rank(self.cfg)
        plain, total_layers = kv_caches, None
        if self.tables.hybrid:  # the first full-attention group's layers
            plain = self.tables.layer_sets(kv_caches)[0][1]
            total_layers = len(plain) * pp
        layout, regions, names = layout_of_kv_caches(
            plain, head_size=mc.get_head_size(),
            block_size=self.tables.block_size(cc.block_size),
            use_mla=use_mla)
        total_heads = 1 if use_mla else mc.get_total_num_kv_heads()
        if not use_mla and layout.num_heads * tp == total_heads:
            layout = layout.with_first_head(tp_rank * layout.num_heads)
        rank = pp_rank * tp + tp_rank
        self.client = None
        client = kvxfer.Client(
            self.socket, instance_id=self.instance_id,
            role=_role(self.cfg.kv_transfer_config.kv_role), rank=rank,
            parallel=kvxfer.Parallel(
                tp=tp, pp=pp, total_layers=total_layers
                or (mc.get_total_num_hidden_layers()
                    if hasattr(mc, "get_total_num_hidden_layers")
                    else mc.hf_config.num_hidden_layers),
                total_kv_heads=total_heads),
            timeout=self.timeout)
        self.rank = rank
        self._joined = False
        self._join_refused = False
        try:
            addrs = self._addresses(client, tp * pp)
            if addrs is not None:
                client.join(addrs)  # else at the handshake's addresses
                self._joined = True
                if self._gathered is not None and not self.rank_addresses:
                    self._gathered = addrs
            self.gpu = regions[0].is_cuda
            self.pool = client.register_regions(
                layout, regions, device="cuda" if self.gpu else "host",
                keep=kv_caches)
            self.group_pools = register_tables(
                client, self.tables, kv_caches,
                "cuda" if self.gpu else "host")
        except BaseException:
            client.close()
            raise
        self.client = client
        self._new_pools = True
        self._token_bytes = _token_bytes(plain)
        self._table_bytes = _table_bytes(self.tables, kv_caches)
        self.lw.set_layers(names)
        self.loader.set_layers(names)
        log.info("kvxfer rank %d/%d of %s: %d layers (%s), pool %d",
                 rank, tp * pp, self.instance_id, len(names),
                 "GPU" if self.gpu else "host", self.pool.id)

    def _addresses(self, client: kvxfer.Client, world: int
                   ) -> Optional[List[str]]:
        """Every rank's daemon address: rank_addresses when configured,
        this daemon's alone for one rank, else those the scheduler
        handed down from vLLM's handshake metadata (None until then)."""
        if self.rank_addresses:
            return [str(a) for a in self.rank_addresses]
        if world == 1:
            return [client.daemon_address]
        if self._gathered is None:
            return None
        return self._moved(client)

    def _moved(self, client: kvxfer.Client) -> List[str]:
        """The gathered addresses with this rank's daemon at its address
        now: a daemon restarted since they were gathered (or since the last
        join) has another, and refuses its old one (not this daemon); the
        ranks that shared it moved with it."""
        assert self._gathered is not None
        old, now = self._gathered[self.rank], client.daemon_address
        return [now if a == old else a for a in self._gathered]

    def handshake(self) -> Optional[KvxferHandshakeMetadata]:
        """This rank and its daemon's address, for vLLM's handshake
        metadata (None before register_kv_caches)."""
        if self.client is None:
            return None
        pools = [] if self.pool is None else \
            [self.pool.id] + [p.id for p in self.group_pools]
        return KvxferHandshakeMetadata(rank=self.rank,
                                       address=self.client.daemon_address,
                                       pools=pools)

    def _join(self) -> None:
        """Join with the addresses vLLM's handshake gathered, once they
        came; at each step until it is made while the daemon is gone (a
        refusal: logged, tried again by the next client)."""
        c = self.client
        if c is None or self._joined or self._join_refused or \
                self._gathered is None:
            return
        addrs = self._moved(c)
        try:
            try:
                retrying(c, c.join, addrs)
            except kvxfer.InvalidArgument:
                if self._moved(c) == addrs:
                    raise
                # the call reconnected to a restarted daemon, which
                # refused its old address: again with its new one
                addrs = self._moved(c)
                c.join(addrs)
        except DAEMON_GONE as e:
            self._lost(e)  # tried again at the next step
            return
        except kvxfer.Error as e:
            self._join_refused = True
            log.error("kvxfer rank %d of %s: join with the ranks' daemon "
                      "addresses failed: %s", self.rank, self.instance_id,
                      e)
            return
        self._gathered = addrs
        self._joined = True

    def start(self, meta: KvxferConnectorMetadata) -> None:
        if self._kv_caches is None:
            if meta.sends or meta.recvs:
                raise kvxfer.StateError(
                    -1, "kvxfer connector: transfers before "
                    "register_kv_caches")
            return
        if meta.addresses is not None:
            self._gathered = list(meta.addresses)
        self._reconnect()  # a new client joins with them itself
        self._join()
        if meta.forward:  # the engine computes: kvxfer's copies paced
            gone = self.pacer.step(self.client)
            if gone is not None:
                self._lost(gone)
        if self.client is not None and (meta.sends or meta.recvs):
            nudge(self.client)
        # synchronous loads (layerwise_load) end without finished_recving,
        # also those that fail here: vLLM runs them already
        self.loader.sync.update(r.key for r in meta.recvs.values() if r.sync)
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
                lambda s: self.client.publish(s[0], s[1], s[2], s[3]),
                [s.groups for _, s in part])
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
                                            skip_tokens=f[4]),
                [r.groups for _, r in part])
            for (rid, r), e in zip(part, res):
                if isinstance(e, kvxfer.Error):
                    if not isinstance(e, DAEMON_GONE):
                        log.error("request %s: kvxfer fetch refused: %s",
                                  rid, e)
                    self._fail_recv(rid, r.block_ids, r.skip_tokens)
                else:
                    self._recving[r.key] = (rid, r.block_ids, r.skip_tokens)
                    self._fetch_t0[r.key] = (time.monotonic(),
                                             self._fetch_bytes(r))
        self.loader.started([r.key for _, r in recvs
                             if r.sync and r.key in self._recving])
        for rid in meta.cancels:
            key = request_key(rid)
            if key not in self._recving:
                key = fetch_key(rid)  # of a decode's offer (bidi.py)
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

    def _many(self, many: Any, items: List[Any], one: Any,
              groups: Optional[List[Any]] = None) -> List[Any]:
        """many(items): one entry per item (a result or its error). An
        item the library refuses before sending (a bad block id) fails
        the whole call: then each goes alone, so it fails alone. With the
        daemon gone, every item fails with that error. A hybrid model's
        items (groups: each item's other tables) go one by one, with
        their groups."""
        assert self.client is not None
        if self.tables.hybrid and groups is not None:
            return self._with_groups(
                items, groups, fetch=many == self.client.fetch_many)
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

    def _with_groups(self, items: List[Any], groups: List[Any], *,
                     fetch: bool) -> List[Any]:
        """Each publish or fetch alone, with its request's other block
        tables in this rank's pools of them (kvxfer.Group)."""
        assert self.client is not None
        pools = [self.pool] + list(self.group_pools)
        res: List[Any] = []
        for it, tables in zip(items, groups):
            gs = self.tables.groups_of(pools, tables, fetch=fetch)
            try:
                if fetch:
                    res.append(retrying(
                        self.client, self.client.fetch, it[0], it[1], it[2],
                        it[3], skip_tokens=it[4], groups=gs))
                else:
                    res.append(retrying(
                        self.client, self.client.publish, it[0], it[1],
                        it[2], it[3], groups=gs))
            except DAEMON_GONE as e:
                # the rest fail with it, as in _many
                self._lost(e)
                return res + [e] * (len(items) - len(res))
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
        self.lw.end_all()

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
        if self.tables.hybrid:
            # block ids are a group's own: vLLM takes a hybrid model's
            # failures by request (failed_recving), never by block
            self._failed_recv.add(rid)
        else:
            bs = self.cfg.cache_config.block_size
            self._load_errors.update(block_ids[skip // bs:])
        self.tally["num_failed_transfers"].append(1)
        self._fetch_t0.pop(request_key(rid), None)
        if self.loader.ended(request_key(rid)):
            return  # a synchronous load: vLLM waits for no finished_recving
        self._done_recv.add(rid)

    def _fetch_bytes(self, r: Recv) -> int:
        """The bytes a fetch writes into this rank's KV cache: the plain
        table's tokens after those held, and each other table's: a
        sliding window's from its first kept block, a Mamba state's slot
        once."""
        out = max(0, r.num_tokens - r.skip_tokens) * self._token_bytes
        for (slot, token), t in zip(self._table_bytes, r.groups):
            out += slot * len(t.blocks) + \
                token * max(0, r.num_tokens - t.skip_tokens)
        return out

    def take_failed_recving(self) -> Set[str]:
        """The requests whose fetch failed (hybrid models), reported with
        finished_recving by get_transfer_results."""
        out, self._failed_recv = self._failed_recv, set()
        return out

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
        self._done_send |= self.lw.take_done()
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
        if ev.kind == kvxfer.EventKind.TIMED_OUT and (
                ev.key in self._sending or self.lw.has(ev.key)):
            # an offer no fetch took within its lease
            self.tally["num_kv_expired_reqs"].append(1)
        if self.lw.on_event(ev):
            return  # a layer-wise offer's end
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
        t0 = self._fetch_t0.pop(ev.key, None)
        if ev.ok and t0 is not None:
            # from the fetch's submission to its end, as this rank saw it
            self.tally["transfer_duration"].append(time.monotonic() - t0[0])
            self.tally["bytes_transferred"].append(t0[1])
        if (ev.ok or ev.kind == kvxfer.EventKind.CANCELLED) and \
                self.loader.ended(ev.key):
            return  # a synchronous load, over (its forward ran)
        if ev.ok or ev.kind == kvxfer.EventKind.CANCELLED:
            self._done_recv.add(rid)
            return
        if not gone:
            log.warning("request %s: KV fetch failed (%s: %s)", rid,
                        kvxfer.status_name(ev.code), ev.message)
        self._fail_recv(rid, blocks, skip)

    # -- layer-wise (layerwise.py) ---------------------------------------

    def save_layer(self, meta: KvxferConnectorMetadata, layer_name: str,
                   kv_layer: torch.Tensor) -> None:
        """save_kv_layer: the step's layer-wise publishes at its first
        call, then the layer marked ready."""
        if self._kv_caches is None:
            return
        self.lw.begin(meta)
        self.lw.layer_saved(layer_name, kv_layer)

    def end_save(self, meta: KvxferConnectorMetadata) -> None:
        """wait_for_save: the layers no save_kv_layer named marked."""
        exposed = self.loader.take_waited()
        if exposed > 0:
            self.tally["layerwise_exposed_time"].append(exposed)
        self.loader.started([])
        if self._kv_caches is None:
            return
        self.lw.begin(meta)
        self.lw.end_step()

    def drop_preempted(self, meta: KvxferConnectorMetadata) -> None:
        """handle_preemptions: the step's layer-wise work now, before the
        forward, so preempted requests' offers are cancelled first."""
        if self._kv_caches is not None and meta.lw_dropped:
            self.lw.begin(meta)

    def wait_layer(self, layer_name: str) -> None:
        """wait_for_layer_load: the step's synchronous loads hold the
        layer (layerwise_load)."""
        self.loader.wait(layer_name, self.timeout)

    def take_stats(self) -> Optional[Dict[str, List[float]]]:
        """The interval's observations (None: there were none)."""
        if not any(self.tally.values()):
            return None
        out, self.tally = self.tally, new_tally()
        return out

    def new_pools(self) -> Optional[Dict[int, List[int]]]:
        """{rank: its tables' pool ids} after a client was made (anew: its
        registration gave them new ids), for the scheduler's reservations
        of hybrid requests; None when they did not change."""
        if not self._new_pools or self.pool is None:
            return None
        self._new_pools = False
        return {self.rank: [self.pool.id] + [p.id for p in
                                             self.group_pools]}

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
