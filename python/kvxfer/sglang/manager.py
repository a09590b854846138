"""KvxferKVManager: one SGLang scheduler rank's side of kvxfer."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from sglang.srt.disaggregation.base.conn import (BaseKVManager, KVArgs,
                                                 KVPoll)

from .._outage import DAEMON_GONE, Outage, gone_event, nudge, retrying
from .._pace import GpuPacer
from ..client import (DEFAULT_SOCKET, Client, EventKind, Group, Parallel,
                      Pool)
from ..errors import Error, InvalidArgument, NotFound, Unsupported
from . import bootstrap as boot
from .common import (_PUMP_INTERVAL, GPU_PACE, _choose_device,
                     _CudaMemory, _env, _geometry, _Geometry, _gpu_pace,
                     _HostMemory, _mode_name, log)
from .state import StatePool, indices_of, state_pools
from .topology import Topology, topology_of

# -- the manager ------------------------------------------------------------

def _layers_per_pp(t: Topology, geo: _Geometry) -> List[int]:
    """Every PP stage's layer count, as kvxfer's Hello wants it: this
    rank's own without PP; with PP, SGLang's own partition
    (SGLANG_PP_LAYER_PARTITION, which get_pp_indices reads on every
    rank), since a stage knows only its own layers and SGLang's even
    split cannot be told from one stage's count."""
    if t.pp_size == 1:
        return [geo.total_layers]
    given = os.environ.get("SGLANG_PP_LAYER_PARTITION")
    if not given:
        raise Unsupported(
            -15, f"kvxfer.sglang: pipeline parallelism (pp_size "
            f"{t.pp_size}) needs every stage's layer count, and a stage "
            "knows only its own: set SGLANG_PP_LAYER_PARTITION (SGLang's "
            "own, e.g. 30,31 for 61 layers over 2 stages) on every rank")
    try:
        parts = [int(x) for x in given.split(",")]
    except ValueError:
        parts = []
    if len(parts) != t.pp_size or min(parts) < 1:
        raise InvalidArgument(
            -1, f"SGLANG_PP_LAYER_PARTITION {given!r}: expected "
            f"{t.pp_size} positive layer counts")
    if parts[t.pp_rank] != geo.total_layers:
        raise InvalidArgument(
            -1, f"SGLANG_PP_LAYER_PARTITION {given!r} gives PP stage "
            f"{t.pp_rank} {parts[t.pp_rank]} layers; its KV buffers hold "
            f"{geo.total_layers}")
    return parts



class KvxferKVManager(BaseKVManager):
    """One scheduler rank's side of kvxfer (SGLang's KV manager).

    Connects to the node's kvxferd as a rank of its attention-DP group's
    kvxfer instance (topology.py; role context on a prefill, generation on
    a decode), registers the KV buffers of ``kv_args`` as one pool of
    regions and joins. A prefill rank then puts its row on the bootstrap
    server (``register_to_bootstrap``). Raises :class:`kvxfer.InvalidArgument`
    for KV buffers it cannot describe and :class:`kvxfer.Unsupported` for
    SGLang features this backend does not carry yet.
    """

    def __init__(self, args: KVArgs, disaggregation_mode: Any,
                 server_args: Any, is_mla_backend: Optional[bool] = False
                 ) -> None:
        self.kv_args = args
        self.server_args = server_args
        self.disaggregation_mode = disaggregation_mode
        self.mode = _mode_name(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        # the GPU pace while the engine computes (pace(), kvxfer/_pace.py)
        self.pacer = GpuPacer(*_gpu_pace(), log, GPU_PACE)
        self._check_supported(args, server_args)
        geo = _geometry(args, self.is_mla_backend)
        self.layout = geo.layout
        self._states = state_pools(args)
        self.num_states = len(getattr(args, "state_types", None) or [])
        self.topology: Topology = topology_of(args, server_args, self.mode)
        self.tp_size = self.topology.attn_tp_size  # of this DP group
        self.rank = self.topology.rank
        self.layers_per_pp = _layers_per_pp(self.topology, geo)
        self.aux_ptrs = [int(p) for p in (args.aux_data_ptrs or [])]
        self.aux_lens = [int(n) for n in (args.aux_data_lens or [])]
        self.aux_items = [int(n) for n in (args.aux_item_lens or [])]
        self._check_aux()
        self.instance_id = self._instance_id()
        self.bootstrap_timeout = float(_env("KVXFER_SGLANG_BOOTSTRAP_TIMEOUT",
                                            "30"))
        # prefill: each chunk's pages move as they are computed (sender.py)
        self.stream = _env("KVXFER_SGLANG_STREAM", "1") != "0"
        # what SGLang's decode queue reads (dp_size, follow_bootstrap_room)
        self.prefill_info_table: Dict[str, boot.PrefillServerInfo] = {}
        self._groups: Dict[Tuple[str, int], boot.GroupLocator] = {}
        self._lookup_errors: Dict[str, str] = {}
        self._waiters: Dict[bytes, Any] = {}
        self._lock = threading.RLock()
        self._last_pump = 0.0
        self._geo = geo
        self._device = _choose_device([int(p) for p in args.kv_data_ptrs],
                                      [int(n) for n in args.kv_data_lens],
                                      _env("KVXFER_SGLANG_DEVICE", "auto"))
        self._outage = Outage(log, f"kvxfer.sglang {self.mode} rank "
                              f"{self.rank} of {self.instance_id}")
        self._closed = False
        self._next_connect = 0.0
        self._registered_address = ""  # what the bootstrap server has
        self._connect()
        try:
            if self.mode == "prefill":
                self.register_to_bootstrap()
        except BaseException:
            self.client.close()
            raise

    def _connect(self) -> None:
        """Connect as this rank, register the KV buffers, join (the
        library does it again by itself when the daemon restarts; this
        runs again only for a client it gave up on)."""
        geo = self._geo
        client = Client(
            _env("KVXFER_SGLANG_SOCKET", DEFAULT_SOCKET),
            instance_id=self.instance_id,
            role="context" if self.mode == "prefill" else "generation",
            rank=self.rank,
            parallel=Parallel(tp=self.tp_size, pp=self.topology.pp_size,
                              total_layers=sum(self.layers_per_pp),
                              total_kv_heads=geo.total_kv_heads,
                              layers_per_pp=self.layers_per_pp))
        self.client = client
        try:
            self.pool = self._register(geo, self._device)
            self.state_pools = [self._register_state(sp)
                                for sp in self._states]
            client.join(self._rank_addresses())
        except BaseException:
            client.close()
            raise

    # -- set-up ------------------------------------------------------------

    @staticmethod
    def _check_supported(args: KVArgs, sa: Any) -> None:
        def no(what: str) -> None:
            raise Unsupported(-15, f"kvxfer.sglang: {what} is not "
                              "supported yet (docs/engines/sglang.md)")
        if getattr(sa, "enable_kv_cache_sharding", False):
            no("KV cache sharding (pages spread over the ranks)")
        if getattr(sa, "disaggregation_enable_kv_checksum", False):
            no("--disaggregation-enable-kv-checksum (each rank's digest "
               "would make the ranks' aux payloads differ)")

    def _check_aux(self) -> None:
        n = len(self.aux_ptrs)
        if len(self.aux_lens) != n or len(self.aux_items) != n:
            raise InvalidArgument(
                -1, f"kvxfer.sglang: aux_data_ptrs ({n}), aux_data_lens "
                f"({len(self.aux_lens)}) and aux_item_lens "
                f"({len(self.aux_items)}) must have one length")
        limit = int(_env("KVXFER_SGLANG_AUX_BYTES", "65536"))
        size = 8 + 4 * n + sum(self.aux_items)
        if size > limit:
            raise InvalidArgument(
                -1, f"kvxfer.sglang: a request's aux rows take {size} bytes "
                f"(rows of {self.aux_items} bytes), more than the daemon's "
                f"limits.aux_bytes {limit}: raise limits.aux_bytes and set "
                "KVXFER_SGLANG_AUX_BYTES to it")

    def _default_instance_id(self) -> str:
        """The same on every rank of this attention-DP group, different
        from any other group's or instance's: its nodes' shared
        dist_init_addr (else this host's name), the port that names the
        SGLang instance, and the group."""
        sa = self.server_args
        where = getattr(sa, "dist_init_addr", None) or socket.gethostname()
        if self.mode == "prefill":
            port = getattr(sa, "disaggregation_bootstrap_port", 8998)
        else:
            port = getattr(sa, "port", 30000)
        return f"sglang-{self.mode}-{where}-{port}"[:120]

    def _instance_id(self) -> str:
        """KVXFER_SGLANG_INSTANCE (else the default), with ``-dpG`` when
        the SGLang instance has several DP groups (topology.py)."""
        base = _env("KVXFER_SGLANG_INSTANCE", self._default_instance_id())
        t = self.topology
        return base if t.dp_groups == 1 else f"{base}-dp{t.dp_group}"

    def _register(self, geo: _Geometry, device: str) -> Pool:
        if device == "host":
            mem: List[Any] = [_HostMemory(p, n) for p, n in geo.regions]
        else:
            mem = [_CudaMemory(p, n) for p, n in geo.regions]
        try:
            return self.client.register_regions(geo.layout, mem)
        except Error as e:
            if device == "cuda":
                raise type(e)(e.code, "kvxfer.sglang: the KV buffers lie in "
                              "no kvxfer.HostBuffer, so they were "
                              f"registered as CUDA memory, which failed: "
                              f"{e.message} (host KV buffers must be "
                              "allocated in kvxfer.HostBuffer)") from None
            raise type(e)(e.code, f"kvxfer.sglang: registering the KV "
                          f"buffers: {e.message}") from None

    def _register_state(self, sp: StatePool) -> Pool:
        mem = [(_HostMemory if self._device == "host" else _CudaMemory)(p, n)
               for p, n in sp.regions]
        try:
            return self.client.register_regions(sp.layout, mem)
        except Error as e:
            raise type(e)(e.code, f"kvxfer.sglang: registering the "
                          f"buffers of state {sp.state}: {e.message}"
                          ) from None

    def state_groups(self, state_indices: Optional[List], num_pages: int,
                     num_tokens: Optional[int]) -> List[Group]:
        """The request's state tables as kvxfer groups, in the pools'
        order (state.py): a slot each for Mamba, the window's pages for
        SWA, the window starting ``len(window)`` pages before the end of
        the request's ``num_pages``; ``num_tokens`` on the prefill (its
        prompt), None on the decode, which skips the tokens before its
        window. Raises ValueError when ``state_indices`` do not fit."""
        idx = indices_of(state_indices, self._states, self.num_states)
        page = int(self.kv_args.page_size)
        out = []
        for sp, pool in zip(self._states, self.state_pools):
            ids = idx[sp.state]
            if not sp.window:
                out.append(Group.state(pool, ids[0]))
                continue
            first = num_pages - len(ids)
            if first < 0:
                raise ValueError(f"state_indices[{sp.state}]: a window of "
                                 f"{len(ids)} pages in a request of "
                                 f"{num_pages}")
            if num_tokens is not None:
                out.append(Group(pool, ids, num_tokens=num_tokens,
                                 first_block=first))
            else:
                out.append(Group(pool, ids, first_block=first,
                                 skip_tokens=first * page))
        return out

    @property
    def has_slots(self) -> bool:
        """Whether a state type is a slot (Mamba; state.py)."""
        return any(not sp.window for sp in self._states)

    def _rank_addresses(self) -> List[str]:
        """Every rank's daemon address in this group's instance, for
        join: from KVXFER_SGLANG_RANK_ADDRESSES (this group's ranks, or
        every TP rank of the SGLang instance in TP rank order, of which
        the group's are taken), else this daemon's for every rank (a
        group on one node, as a group of one rank always is)."""
        t = self.topology
        given = os.environ.get("KVXFER_SGLANG_RANK_ADDRESSES")
        if given:
            addrs = [a.strip() for a in given.split(",") if a.strip()]
            whole = t.attn_tp_size * t.attn_dp_size
            if len(addrs) == whole and whole != t.attn_tp_size:
                first = t.attn_dp_rank * t.attn_tp_size
                addrs = addrs[first:first + t.attn_tp_size]
            if len(addrs) != t.size:
                raise InvalidArgument(
                    -1, f"KVXFER_SGLANG_RANK_ADDRESSES: {len(addrs)} "
                    f"addresses for a group of {t.size} ranks (attention "
                    f"TP {t.attn_tp_size}) or an instance of "
                    f"{whole} TP ranks")
            return addrs
        nnodes = int(getattr(self.server_args, "nnodes", 1) or 1)
        if nnodes != 1 and t.size != 1:
            raise Unsupported(
                -15, f"kvxfer.sglang: an instance on {nnodes} nodes whose "
                f"attention-TP groups have {t.size} ranks needs "
                "KVXFER_SGLANG_RANK_ADDRESSES (each rank's daemon address, "
                "in rank order)")
        return [self.client.daemon_address] * t.size

    # -- bootstrap ---------------------------------------------------------

    def bootstrap_address(self) -> str:
        """host:port of this prefill instance's bootstrap server, as
        CommonKVManager finds it: the host of --dist-init-addr on an
        instance over several nodes, else --host (a wildcard as the
        loopback)."""
        sa = self.server_args
        dist = getattr(sa, "dist_init_addr", None)
        if dist:
            host = str(dist).rsplit(":", 1)[0].strip("[]")
        else:
            host = str(getattr(sa, "host", "127.0.0.1"))
            host = {"0.0.0.0": "127.0.0.1", "::": "::1",
                    "": "127.0.0.1"}.get(host, host)
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{getattr(sa, 'disaggregation_bootstrap_port', 8998)}"

    def _route_row(self, address: str) -> Dict[str, Any]:
        """This rank's row for ``PUT /route``, CommonKVManager's fields,
        ``rank_ip`` naming its daemon and instance (bootstrap.py)."""
        t, sa, a = self.topology, self.server_args, self.kv_args
        return {
            "attn_tp_size": t.attn_tp_size, "attn_tp_rank": t.attn_tp_rank,
            "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": t.attn_dp_size, "attn_dp_rank": t.attn_dp_rank,
            "pp_size": t.pp_size, "pp_rank": t.pp_rank,
            "system_dp_size": t.system_dp_size,
            "system_dp_rank": t.system_dp_rank,
            "rank_ip": boot.locator_ip(address, self.instance_id),
            "rank_port": t.rank,
            "page_size": int(a.page_size),
            "kv_cache_dtype": getattr(a, "kv_cache_dtype_str", None),
            "kv_layout": getattr(a, "kv_layout", None),
            "load_balance_method": t.load_balance_method,
            "prefill_http_port": getattr(sa, "port", None),
            "decode_allocation_policy": getattr(
                sa, "disaggregation_decode_allocation_policy", "early"),
        }

    def register_to_bootstrap(self) -> None:
        """Prefill: put this rank's row on the bootstrap server (every
        rank, as CommonKVManager does: the server answers decodes once
        all rows are in); retried until KVXFER_SGLANG_BOOTSTRAP_TIMEOUT
        (the server starts beside the schedulers)."""
        if self.mode != "prefill":
            return
        self._put_bootstrap(self.bootstrap_timeout)

    def _put_bootstrap(self, timeout: float) -> None:
        address = self.client.daemon_address
        try:
            boot.put_route(self.bootstrap_address(),
                           self._route_row(address), timeout)
        except boot.BootstrapError as e:
            raise IOError(f"kvxfer.sglang: cannot register with the "
                          f"bootstrap server: {e}") from None
        self._registered_address = address

    def _daemon_moved(self) -> None:
        """After the client reconnected: the new daemon has an address of
        its own. A prefill rank puts its row again (decodes look it up
        again); a decode forgets the prefill instances it knew, whose
        daemons may have restarted with it."""
        if self.mode == "decode":
            self.prefill_info_table.clear()
            self._groups.clear()
            return
        try:
            if self.client.daemon_address == self._registered_address:
                return
            self._put_bootstrap(0)  # one try; the next reconnect retries
        except (Error, OSError) as e:
            log.warning("kvxfer.sglang: registering the new daemon "
                        "address with the bootstrap server: %s", e)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: the prefill's parallel info behind ``bootstrap_addr``
        (once; SGLang's decode queue calls this before it inits
        receivers, and reads ``dp_size`` and ``follow_bootstrap_room``
        of ``prefill_info_table`` to choose a prefill DP rank). False
        while its server does not answer or not every prefill rank has
        registered yet (:meth:`lookup_error` says why)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            info = boot.prefill_info(bootstrap_addr)
        except boot.BootstrapError as e:
            self._lookup_errors[bootstrap_addr] = str(e)
            return False
        self.prefill_info_table[bootstrap_addr] = info
        self._lookup_errors.pop(bootstrap_addr, None)
        return True

    def group_locator(self, bootstrap_addr: str,
                      dp_group: int) -> Optional[boot.GroupLocator]:
        """Decode: the kvxfer instance of prefill DP group ``dp_group``
        behind ``bootstrap_addr`` and its rank 0's daemon (looked up once
        per group); None when the lookup failed (:meth:`lookup_error`)."""
        k = (bootstrap_addr, int(dp_group))
        if k not in self._groups:
            try:
                self._groups[k] = boot.group_locator(bootstrap_addr,
                                                     int(dp_group))
            except boot.BootstrapError as e:
                self._lookup_errors[bootstrap_addr] = str(e)
                return None
        return self._groups[k]

    def lookup_error(self, bootstrap_addr: str) -> str:
        """Why the last lookup of ``bootstrap_addr`` failed."""
        return self._lookup_errors.get(bootstrap_addr, "not looked up yet")

    def forget_prefill(self, bootstrap_addr: str) -> None:
        """Drop a cached prefill instance (it went away: look it up anew)."""
        self.prefill_info_table.pop(bootstrap_addr, None)
        for k in [k for k in self._groups if k[0] == bootstrap_addr]:
            del self._groups[k]

    # -- the daemon going away -----------------------------------------------

    def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """fn(client, *args, **kw) for a sender or receiver: made with a
        client again if the library gave this one up, once more when it
        was the call that found the daemon gone (the library reconnects
        inside the next). Raises kvxfer.Error; the daemon's absence is
        logged once per outage."""
        with self._lock:
            self._revive()
            c = self.client
            nudge(c)
            incarnation = c.incarnation
            try:
                out = retrying(c, fn, c, *args, **kw)
            except DAEMON_GONE as e:
                self._lost(e)
                raise
            if c.incarnation != incarnation:
                self._outage.back("kvxferd is back")
                self._daemon_moved()
            return out

    def _lost(self, e: Error) -> None:
        """The daemon is gone. The library ended the requests in flight
        (PEER_GONE events) and reconnects; a client it gave up on
        (reconnection off, a call that timed out) is closed here, its
        rooms in flight failed, and made again by the next call."""
        self._outage.lost(e, "the rooms in flight fail and new ones are "
                          "refused")
        if not self.client.closed:
            return
        self.client.close()
        for who in list(self._waiters.values()):
            if who._state == KVPoll.Transferring:
                who._fail(f"kvxferd went away: {e}", e.code)

    def _revive(self) -> None:
        """A client the library gave up on, made again (5 ms apart while
        no daemon listens, a second after one refused us)."""
        if self._closed or not self.client.closed:
            return
        now = time.monotonic()
        if now < self._next_connect:
            return
        try:
            self._connect()
        except Error as e:
            nobody = isinstance(e, DAEMON_GONE)
            self._next_connect = now + (0.005 if nobody else 1.0)
            self._outage.lost(e, "the rooms in flight fail and new ones "
                              "are refused")
            return
        self._outage.back("connected to kvxferd again")
        self._daemon_moved()

    # -- the GPU pace --------------------------------------------------------

    def pace(self) -> None:
        """The engine computes: set this rank's GPU pace
        (KVXFER_SGLANG_GPU_PACE) for the next hold, at most once a
        quarter of it (kvxfer/_pace.py). SGLang 0.5.23 calls a backend
        at no point of every step: a prefill sender's send() (after each
        forward, per chunk) and a decode receiver's poll() while its
        fetch runs call this. Never raises: a daemon gone goes to the
        outage handling, other failures are logged once."""
        if not self.pacer.per_ms:
            return
        with self._lock:
            c = self.client
            if self._closed or c.closed:
                return  # the next call or pump makes a client again
            incarnation = c.incarnation
            gone = self.pacer.step(c)
            if gone is not None:
                self._lost(gone)
            elif c.incarnation != incarnation:  # reconnected inside it
                self._outage.back("kvxferd is back")
                self._daemon_moved()

    # -- events ------------------------------------------------------------

    def _watch(self, key: bytes, who: Any) -> None:
        with self._lock:
            self._waiters[key] = who

    def _unwatch(self, key: bytes, who: Any) -> None:
        with self._lock:
            if self._waiters.get(key) is who:
                del self._waiters[key]

    def pump(self, force: bool = False) -> None:
        """Read this rank's pending kvxfer events (a non-blocking poll) and
        hand each to the sender or receiver of its key. Senders and
        receivers call it from their poll(); polls closer than half a
        millisecond share one."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_pump < _PUMP_INTERVAL:
                return
            self._last_pump = now
            self._revive()
            try:
                nudge(self.client)
                batch = self.client.poll(at_least=0, timeout=0)
            except Error as e:
                # the daemon is gone: the library's batch ended the rooms
                # in flight already (PEER_GONE), unless it gave up
                self._lost(e)
                return
            for ev in batch:
                if ev.kind == EventKind.RECONNECTED:
                    self._outage.back(ev.message)
                    self._daemon_moved()
                    continue
                if gone_event(ev):
                    self._outage.lost(ev.error, "the rooms in flight fail "
                                      "and new ones are refused")
                who = self._waiters.get(ev.key)
                if who is not None:
                    who._on_event(ev)

    def close(self) -> None:
        """Close the rank's connection: the daemon ends its requests (the
        other side sees PEER_GONE) and drops the pool. Idempotent."""
        self._closed = True
        self.client.close()

    def teardown(self) -> None:
        """SGLang's role-switch teardown: release the transfer resources."""
        self.close()



def _cancel(mgr: KvxferKVManager, key: bytes) -> None:
    """kvx_cancel_key; NotFound means its end is queued already, and a
    daemon that went away took the request with it."""
    try:
        mgr.client.cancel(key)
    except NotFound:
        pass
    except DAEMON_GONE as e:
        mgr._lost(e)
    except Error as e:
        log.warning("kvxfer.sglang: cancel of %s: %s", key.decode(), e)

