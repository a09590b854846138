"""SGLang's disaggregation transfer backend on kvxfer (SGLang 0.5.23).

The four classes SGLang's scheduler builds for a transfer backend
(``sglang/srt/disaggregation/base/conn.py``), moving the KV cache through
kvxferd by **fetch by key**: the key of a request is its bootstrap room
(an int; kvxfer sends its decimal digits), so nothing but the room has to
travel between the prefill and the decode instance.

* :class:`KvxferKVManager`, one per scheduler rank: a :class:`kvxfer.Client`
  for the rank, its KV buffers registered as one pool of regions (a K and a
  V buffer per layer, or one latent buffer per layer for MLA), the event
  pump, and (prefill rank 0) the registration with the bootstrap server.
* :class:`KvxferKVSender` (prefill): collects the pages of every prefill
  chunk and publishes them once, with the aux rows, on the last one.
* :class:`KvxferKVReceiver` (decode): looks the prefill instance up on its
  bootstrap server, fetches by key into its pages, and writes the aux rows
  the prefill published into its own metadata buffers on completion.
* :class:`KvxferKVBootstrapServer` (prefill main process): a small HTTP
  server that maps its address to the prefill instance's kvxfer name and
  the daemon address of its rank 0.

Heterogeneous TP, deadlines and cancellation are the daemon's: each rank
says its TP rank and size in its Hello, and the daemons plan the slices.
SGLang's backend list is closed; docs/engines/sglang.md gives the patch
that makes ``--disaggregation-transfer-backend kvxfer`` pick these classes,
and lists what is not supported yet.

Settings come from the environment (SGLang has no free-form backend
config): ``KVXFER_SGLANG_SOCKET`` (the daemon's socket),
``KVXFER_SGLANG_INSTANCE`` (this instance's kvxfer name),
``KVXFER_SGLANG_DEVICE`` (``auto``, ``cuda`` or ``host``),
``KVXFER_SGLANG_RANK_ADDRESSES`` (every rank's daemon address, in rank
order, for an instance spread over several nodes),
``KVXFER_SGLANG_BOOTSTRAP_TIMEOUT`` (seconds, default 30) and
``KVXFER_SGLANG_AUX_BYTES`` (the daemon's ``limits.aux_bytes``, default
65536).
"""

from __future__ import annotations

import ctypes
import http.server
import json
import logging
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.base.conn import (BaseKVBootstrapServer,
                                                 BaseKVManager,
                                                 BaseKVReceiver,
                                                 BaseKVSender, KVArgs, KVPoll,
                                                 KVTransferMetric)

from ._outage import DAEMON_GONE, Outage, gone_event, nudge, retrying
from .client import (DEFAULT_SOCKET, Client, Event, EventKind, Parallel,
                     Pool, key_bytes)
from .errors import (Error, InvalidArgument, NotFound, PeerGone,
                     Unsupported)
from .layout import DType, Layout
from .memory import host_buffer_of, span_of

__all__ = ["KvxferKVManager", "KvxferKVSender", "KvxferKVReceiver",
           "KvxferKVBootstrapServer", "KvxferTransferError",
           "SGLANG_VERSION"]

SGLANG_VERSION = "0.5.23"  # the base classes this backend was written for

log = logging.getLogger(__name__)

_BOOTSTRAP_PATH = "/kvxfer/v1/prefill"
_BOOTSTRAP_MAX_BODY = 4096  # a registration is ~200 bytes
_AUX_MAGIC = b"KVXS"
_AUX_VERSION = 1
_PUMP_INTERVAL = 0.0005  # seconds between two polls of the daemon


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _mode_name(mode: Any) -> str:
    """"prefill" or "decode" from SGLang's DisaggregationMode (or a str)."""
    name = str(getattr(mode, "value", mode)).lower()
    if name not in ("prefill", "decode"):
        raise InvalidArgument(-1, f"kvxfer.sglang: disaggregation_mode "
                              f"{mode!r} (expected prefill or decode)")
    return name


def _http_host(host: str) -> str:
    """A host to connect to for one an SGLang server binds."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return host


class KvxferTransferError(Exception):
    """A transfer of the room ``bootstrap_room`` failed: raised by
    ``failure_exception()`` with kvxfer's reason (``"TIMED_OUT: ..."``,
    ``"PEER_GONE: ..."``: the name of the kvxfer status, then the
    daemon's message). ``code`` is the kvxfer status (0 when the failure
    was not kvxfer's)."""

    is_from_another_rank = False  # SGLang logs it once per rank

    def __init__(self, bootstrap_room: int, failure_reason: str,
                 code: int = 0) -> None:
        super().__init__(bootstrap_room, failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.code = code

    def __str__(self) -> str:
        return (f"kvxfer transfer of room {self.bootstrap_room} failed: "
                f"{self.failure_reason}")


# -- memory ---------------------------------------------------------------

class _HostMemory:
    """Raw host memory [ptr, ptr + nbytes), as span_of reads it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


class _CudaMemory:
    """Raw CUDA memory [ptr, ptr + nbytes), as span_of reads it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
            "version": 3}


def _in_host_buffer(ptr: int, nbytes: int) -> bool:
    try:
        host_buffer_of(span_of(_HostMemory(ptr, nbytes)))
        return True
    except InvalidArgument:
        return False


def _choose_device(ptrs: Sequence[int], lens: Sequence[int],
                   wanted: str) -> str:
    """"host" or "cuda" for the KV buffers: KVXFER_SGLANG_DEVICE, or (auto)
    host when they lie in kvxfer.HostBuffers, CUDA when none does."""
    if wanted not in ("auto", "host", "cuda"):
        raise InvalidArgument(-1, f"KVXFER_SGLANG_DEVICE: {wanted!r} "
                              "(expected auto, host or cuda)")
    inside = [_in_host_buffer(p, n) for p, n in zip(ptrs, lens)]
    if wanted == "cuda" or (wanted == "auto" and not any(inside)):
        return "cuda"
    for i, ok in enumerate(inside):
        if not ok:
            raise InvalidArgument(
                -1, f"kvxfer.sglang: kv_data_ptrs[{i}] (0x{ptrs[i]:x}, "
                f"{lens[i]} bytes) does not lie in a kvxfer.HostBuffer, "
                "while other KV buffers do: host KV buffers must all be "
                "allocated in kvxfer.HostBuffer (the daemon maps them), "
                "CUDA ones all on the GPU")
    return "host"


def _dtype_of(name: Optional[str]) -> Optional[DType]:
    """kvxfer's dtype for SGLang's kv_cache_dtype_str, None if unknown
    ("auto", fp4, ...)."""
    if not name:
        return None
    n = str(name).lower().replace("torch.", "")
    if n.startswith("fp8") or n.startswith("float8"):
        return DType.FP8
    try:
        return DType.of(n)
    except InvalidArgument:
        return None


@dataclass
class _Geometry:
    """What the manager made of KVArgs: the layout, the regions in the
    layout's order, and the model's size for the Hello."""

    layout: Layout
    regions: List[Tuple[int, int]]  # (ptr, nbytes), the layout's order
    total_layers: int
    total_kv_heads: int


def _geometry(args: KVArgs, is_mla: bool) -> _Geometry:
    """The pool SGLang's KV buffers make, from KVArgs (raises
    InvalidArgument / Unsupported naming the field)."""
    ptrs = [int(p) for p in args.kv_data_ptrs]
    lens = [int(n) for n in args.kv_data_lens]
    items = [int(n) for n in args.kv_item_lens]
    page = int(args.page_size)
    if not ptrs or len(lens) != len(ptrs) or len(items) != len(ptrs):
        raise InvalidArgument(
            -1, f"kvxfer.sglang: kv_data_ptrs ({len(ptrs)}), kv_data_lens "
            f"({len(lens)}) and kv_item_lens ({len(items)}) must be "
            "non-empty lists of one length")
    if getattr(args, "num_draft_entries", 0):
        raise Unsupported(-15, "kvxfer.sglang: the draft model's KV "
                          "(speculative decoding, num_draft_entries "
                          f"{args.num_draft_entries}) is not supported yet")
    if page <= 0:
        raise InvalidArgument(-1, f"kvxfer.sglang: page_size {page}")
    if len(set(items)) != 1:
        raise InvalidArgument(
            -1, "kvxfer.sglang: kv_item_lens differ between buffers "
            f"({sorted(set(items))}): one layout must describe every layer")
    item = items[0]
    for i, (n, it) in enumerate(zip(lens, items)):
        if it <= 0 or n < it:
            raise InvalidArgument(
                -1, f"kvxfer.sglang: kv_data_lens[{i}] {n} holds no page "
                f"of kv_item_lens[{i}] {it} bytes")
    if item % page:
        raise InvalidArgument(
            -1, f"kvxfer.sglang: kv_item_lens {item} is not page_size "
            f"{page} tokens of whole bytes")
    num_blocks = min(lens) // item
    row = item // page  # bytes of one token of one layer
    if is_mla:
        heads, total_heads = 1, 1
        num_layers = len(ptrs)
        order = list(range(num_layers))
    else:
        if len(ptrs) % 2:
            raise InvalidArgument(
                -1, f"kvxfer.sglang: {len(ptrs)} kv_data_ptrs: an MHA pool "
                "gives a K and a V buffer per layer (K of every layer, then "
                "V of every layer)")
        heads = int(getattr(args, "kv_head_num", 0) or 0)
        total_heads = int(getattr(args, "total_kv_head_num", 0) or 0)
        if heads <= 0 or total_heads <= 0:
            raise InvalidArgument(
                -1, "kvxfer.sglang: kv_head_num and total_kv_head_num must "
                f"be set for an MHA pool (got {heads}, {total_heads})")
        num_layers = len(ptrs) // 2
        # SGLang lists K of every layer, then V; the layout wants them
        # layer by layer
        order = [i for a in range(num_layers)
                 for i in (a, num_layers + a)]
    if row % heads:
        raise InvalidArgument(
            -1, f"kvxfer.sglang: {row} bytes per token do not split into "
            f"kv_head_num {heads} heads")
    head_bytes = row // heads
    dtype = _dtype_of(getattr(args, "kv_cache_dtype_str", None))
    if dtype is None or head_bytes % dtype.size:
        dtype = DType.INT8  # bytes: both sides derive it the same way
    head_dim = head_bytes // dtype.size
    regions = [(ptrs[i], lens[i]) for i in order]
    if is_mla:
        layout = Layout.preset("mla", num_layers=num_layers, kv_factor=1,
                               num_heads=1, head_dim=head_dim, dtype=dtype,
                               tokens_per_block=page,
                               num_blocks=num_blocks).split(1)
    else:
        # SGLang's MHA buffers are [token][head][dim], a page being
        # page_size consecutive tokens: the "sglang" preset's strides with
        # a block per page (the preset itself has a block per token)
        layout = Layout.custom(
            name="sglang", num_layers=num_layers, kv_factor=2,
            num_heads=heads, head_dim=head_dim, dtype=dtype,
            tokens_per_block=page, num_blocks=num_blocks, kv_stride=0,
            block_stride=item, token_stride=row, head_stride=head_bytes,
            parts=[(r, 0) for r in range(len(regions))])
    return _Geometry(layout, regions, num_layers, total_heads)


# -- the aux rows -----------------------------------------------------------

def _pack_aux(ptrs: Sequence[int], lens: Sequence[int],
              items: Sequence[int], index: int) -> bytes:
    """Row ``index`` of every aux buffer (host memory), behind a header
    naming the row sizes so that the receiver can check them."""
    head = struct.pack(f"<4sHH{len(items)}I", _AUX_MAGIC, _AUX_VERSION,
                       len(items), *items)
    rows = []
    for i, (p, n, it) in enumerate(zip(ptrs, lens, items)):
        if not 0 <= index < n // it:
            raise InvalidArgument(
                -1, f"kvxfer.sglang: aux_index {index} outside aux buffer "
                f"{i} ({n // it} rows)")
        rows.append(ctypes.string_at(p + index * it, it))
    return head + b"".join(rows)


def _unpack_aux(aux: bytes, ptrs: Sequence[int], lens: Sequence[int],
                items: Sequence[int], index: int) -> None:
    """Write the rows of an aux payload into row ``index`` of this side's
    aux buffers (ValueError when their sizes differ)."""
    if len(aux) < 8 or aux[:4] != _AUX_MAGIC:
        raise ValueError(f"aux payload of {len(aux)} bytes is not kvxfer."
                         "sglang's (another backend or version published "
                         "this room?)")
    version, n = struct.unpack_from("<HH", aux, 4)
    if version != _AUX_VERSION:
        raise ValueError(f"aux payload version {version} (this side "
                         f"reads {_AUX_VERSION})")
    theirs = list(struct.unpack_from(f"<{n}I", aux, 8))
    if theirs != list(items):
        raise ValueError(f"the prefill's aux rows are {theirs} bytes, this "
                         f"side's {list(items)}: the two instances' "
                         "metadata buffers differ (model or options)")
    off = 8 + 4 * n
    if len(aux) != off + sum(items):
        raise ValueError(f"aux payload of {len(aux)} bytes, expected "
                         f"{off + sum(items)}")
    for i, (p, size, it) in enumerate(zip(ptrs, lens, items)):
        if not 0 <= index < size // it:
            raise ValueError(f"aux_index {index} outside aux buffer {i} "
                             f"({size // it} rows)")
        ctypes.memmove(p + index * it, aux[off:off + it], it)
        off += it


# -- the manager ------------------------------------------------------------

@dataclass
class _PrefillInfo:
    """A prefill instance as its bootstrap server describes it. SGLang's
    decode queue reads ``dp_size`` and ``follow_bootstrap_room`` from the
    manager's ``prefill_info_table`` to choose a prefill DP rank."""

    instance_id: str
    address: str  # the daemon of its rank 0
    tp_size: int = 1
    dp_size: int = 1
    follow_bootstrap_room: bool = True


class KvxferKVManager(BaseKVManager):
    """One scheduler rank's side of kvxfer (SGLang's KV manager).

    Connects to the node's kvxferd as rank ``kv_args.engine_rank`` of this
    instance (role context on a prefill, generation on a decode), registers
    the KV buffers of ``kv_args`` as one pool of regions and joins. A
    prefill's rank 0 then registers the instance with the bootstrap server
    (``register_to_bootstrap``). Raises :class:`kvxfer.InvalidArgument`
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
        self._check_supported(args, server_args)
        geo = _geometry(args, self.is_mla_backend)
        self.layout = geo.layout
        self.tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.rank = int(args.engine_rank)
        if not 0 <= self.rank < self.tp_size:
            raise InvalidArgument(-1, f"kvxfer.sglang: engine_rank "
                                  f"{self.rank} outside tp_size "
                                  f"{self.tp_size}")
        self.aux_ptrs = [int(p) for p in (args.aux_data_ptrs or [])]
        self.aux_lens = [int(n) for n in (args.aux_data_lens or [])]
        self.aux_items = [int(n) for n in (args.aux_item_lens or [])]
        self._check_aux()
        self.instance_id = _env("KVXFER_SGLANG_INSTANCE",
                                self._default_instance_id())
        self.bootstrap_timeout = float(_env("KVXFER_SGLANG_BOOTSTRAP_TIMEOUT",
                                            "30"))
        self.prefill_info_table: Dict[str, _PrefillInfo] = {}
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
            parallel=Parallel(tp=self.tp_size,
                              total_layers=geo.total_layers,
                              total_kv_heads=geo.total_kv_heads))
        self.client = client
        try:
            self.pool = self._register(geo, self._device)
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
        if int(getattr(sa, "pp_size", 1) or 1) != 1:
            no("pipeline parallelism (pp_size > 1)")
        if int(getattr(sa, "dp_size", 1) or 1) != 1 or \
                getattr(sa, "enable_dp_attention", False):
            no("data parallelism (dp_size > 1, DP attention)")
        if int(getattr(sa, "attn_cp_size", 1) or 1) != 1 or \
                int(getattr(sa, "dcp_size", 1) or 1) != 1:
            no("context parallelism (attn_cp_size, dcp_size > 1)")
        if getattr(sa, "enable_kv_cache_sharding", False):
            no("KV cache sharding (pages spread over the ranks)")
        if getattr(sa, "disaggregation_enable_kv_checksum", False):
            no("--disaggregation-enable-kv-checksum (each rank's digest "
               "would make the ranks' aux payloads differ)")
        states = getattr(args, "state_types", None)
        if states:
            names = [str(getattr(s, "value", s)) for s in states]
            no(f"state beside the KV ({', '.join(names)}: Mamba, SWA, ...)")

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
        """The same on every rank of this instance, different from any
        other instance's: its nodes' shared dist_init_addr (else this
        host's name) and the port that names it."""
        sa = self.server_args
        where = getattr(sa, "dist_init_addr", None) or socket.gethostname()
        if self.mode == "prefill":
            port = getattr(sa, "disaggregation_bootstrap_port", 8998)
        else:
            port = getattr(sa, "port", 30000)
        return f"sglang-{self.mode}-{where}-{port}"[:128]

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

    def _rank_addresses(self) -> List[str]:
        """Every rank's daemon address, for join: given by
        KVXFER_SGLANG_RANK_ADDRESSES, else this daemon's for every rank
        (an instance on one node)."""
        given = os.environ.get("KVXFER_SGLANG_RANK_ADDRESSES")
        if given:
            addrs = [a.strip() for a in given.split(",") if a.strip()]
            if len(addrs) != self.tp_size:
                raise InvalidArgument(
                    -1, f"KVXFER_SGLANG_RANK_ADDRESSES: {len(addrs)} "
                    f"addresses for tp_size {self.tp_size}")
            return addrs
        nnodes = int(getattr(self.server_args, "nnodes", 1) or 1)
        if nnodes != 1:
            raise Unsupported(
                -15, f"kvxfer.sglang: an instance on {nnodes} nodes needs "
                "KVXFER_SGLANG_RANK_ADDRESSES (each rank's daemon address, "
                "in rank order)")
        return [self.client.daemon_address] * self.tp_size

    # -- bootstrap ---------------------------------------------------------

    def bootstrap_address(self) -> str:
        """host:port of this prefill instance's bootstrap server."""
        sa = self.server_args
        host = _http_host(str(getattr(sa, "host", "127.0.0.1")))
        return f"{host}:{getattr(sa, 'disaggregation_bootstrap_port', 8998)}"

    def register_to_bootstrap(self) -> None:
        """Prefill rank 0: tell the bootstrap server this instance's kvxfer
        name and rank-0 daemon address; retried until
        KVXFER_SGLANG_BOOTSTRAP_TIMEOUT (the server starts beside the
        schedulers). Other ranks have nothing to say."""
        if self.mode != "prefill" or self.rank != 0:
            return
        self._put_bootstrap(self.bootstrap_timeout)

    def _put_bootstrap(self, timeout: float) -> None:
        address = self.client.daemon_address
        body = json.dumps({"instance_id": self.instance_id,
                           "address": address,
                           "tp_size": self.tp_size}).encode()
        url = f"http://{self.bootstrap_address()}{_BOOTSTRAP_PATH}"
        end = time.monotonic() + timeout
        while True:
            req = urllib.request.Request(
                url, data=body, method="PUT",
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    r.read()
                self._registered_address = address
                return
            except (urllib.error.URLError, OSError) as e:
                if time.monotonic() > end:
                    raise IOError(f"kvxfer.sglang: cannot register with "
                                  f"the bootstrap server {url}: {e}") from e
                time.sleep(0.2)

    def _daemon_moved(self) -> None:
        """After the client reconnected: the new daemon has an address of
        its own. A prefill's rank 0 tells the bootstrap server (decode
        ranks look it up again); a decode forgets the prefill instances
        it knew, whose daemons may have restarted with it."""
        if self.mode == "decode":
            self.prefill_info_table.clear()
            return
        if self.rank != 0:
            return
        try:
            if self.client.daemon_address == self._registered_address:
                return
            self._put_bootstrap(0)  # one try; the next reconnect retries
        except (Error, OSError) as e:
            log.warning("kvxfer.sglang: registering the new daemon "
                        "address with the bootstrap server: %s", e)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: look the prefill instance behind ``bootstrap_addr`` up
        (once; SGLang's decode queue calls this before it inits
        receivers). False while its server does not answer or its rank 0
        has not registered yet (:meth:`lookup_error` says why)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        url = f"http://{bootstrap_addr}{_BOOTSTRAP_PATH}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                raw = r.read(_BOOTSTRAP_MAX_BODY + 1)
            d = json.loads(raw)
            info = _PrefillInfo(instance_id=str(d["instance_id"]),
                                address=str(d["address"]),
                                tp_size=int(d.get("tp_size", 1)))
        except urllib.error.HTTPError as e:
            why = e.read(512).decode(errors="replace").strip()
            self._lookup_errors[bootstrap_addr] = f"{url}: {e.code} {why}"
            return False
        except (urllib.error.URLError, OSError, ValueError, KeyError,
                TypeError) as e:
            self._lookup_errors[bootstrap_addr] = f"{url}: {e}"
            return False
        self.prefill_info_table[bootstrap_addr] = info
        self._lookup_errors.pop(bootstrap_addr, None)
        return True

    def lookup_error(self, bootstrap_addr: str) -> str:
        """Why the last lookup of ``bootstrap_addr`` failed."""
        return self._lookup_errors.get(bootstrap_addr, "not looked up yet")

    def forget_prefill(self, bootstrap_addr: str) -> None:
        """Drop a cached prefill instance (it went away: look it up anew)."""
        self.prefill_info_table.pop(bootstrap_addr, None)

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


# -- prefill ----------------------------------------------------------------

class KvxferKVSender(BaseKVSender):
    """One request of a prefill rank (SGLang's KV sender).

    KVPoll: WaitingForInput from the start (fetch by key needs no
    handshake: the decode side finds the offer by its room), Transferring
    once the last chunk is published, then Success when the decode side
    has read the KV (the context side's COMPLETE), Failed on any other
    event or a refused publish.
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
        self._published = False
        self._start: Optional[float] = None
        self._metric = KVTransferMetric()
        mgr._watch(self.key, self)

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
        """One prefill chunk's pages. kvxfer offers cannot grow yet, so the
        pages are kept until the last chunk (its pages complete
        ``num_kv_indices``), which publishes them all with the aux rows."""
        if self._state in (KVPoll.Success, KVPoll.Failed) or self._published:
            return
        if self.num_kv_indices is None:
            self._fail("send() before init(): SGLang's scheduler inits a "
                       "sender when its bootstrap is done")
            return
        if hasattr(kv_indices, "cpu"):  # a CPU tensor
            kv_indices = kv_indices.cpu().numpy()
        pages = [int(p) for p in kv_indices]
        self._pages.extend(pages)
        self._num_pages += len(pages)
        page = int(self.kv_mgr.kv_args.page_size)
        self._num_tokens += (int(num_kv_tokens) if num_kv_tokens is not None
                             else len(pages) * page)
        if self._num_pages > self.num_kv_indices:
            self._fail(f"{self._num_pages} pages sent for a request of "
                       f"{self.num_kv_indices}")
        elif self._num_pages == self.num_kv_indices:
            self._publish()

    def _publish(self) -> None:
        m = self.kv_mgr
        self._start = time.perf_counter()
        try:
            aux = None
            if m.aux_ptrs and self.aux_index is not None:
                aux = _pack_aux(m.aux_ptrs, m.aux_lens, m.aux_items,
                                int(self.aux_index))
            m.call(lambda c: c.publish(self.key, m.pool, self._pages,
                                       num_tokens=self._num_tokens,
                                       aux=aux))
        except Error as e:
            self._fail(str(e), e.code)
            return
        self._published = True
        self._state = KVPoll.Transferring
        self._metric.transfer_total_bytes = (
            self._num_pages * sum(m.kv_args.kv_item_lens))

    def _on_event(self, ev: Event) -> None:
        if self._state != KVPoll.Transferring:
            return
        if ev.ok:
            self._state = KVPoll.Success
            self.kv_mgr._unwatch(self.key, self)
            if self._start is not None:
                self._metric.transfer_latency_s = (time.perf_counter()
                                                   - self._start)
        else:
            self._fail(str(ev.error), ev.code)

    def _fail(self, reason: str, code: int = 0) -> None:
        if self._state not in (KVPoll.Success, KVPoll.Failed):
            self._state = KVPoll.Failed
            self._reason = reason
            self._code = code
            self.kv_mgr._unwatch(self.key, self)

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
        """Cancel: a published offer is ended on the daemon (the decode
        side's fetch fails with CANCELLED); the request polls Failed."""
        if self._state in (KVPoll.Success, KVPoll.Failed):
            return
        if self._published:
            _cancel(self.kv_mgr, self.key)
        self._fail("aborted by SGLang (AbortReq)")

    def clear(self) -> None:
        """Forget the request. One still in flight is cancelled first."""
        if self._state == KVPoll.Transferring:
            _cancel(self.kv_mgr, self.key)
            self._fail("cleared while transferring")
        self.kv_mgr._unwatch(self.key, self)


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


# -- decode -----------------------------------------------------------------

class KvxferKVReceiver(BaseKVReceiver):
    """One request of a decode rank (SGLang's KV receiver).

    KVPoll: Bootstrapping until the prefill instance behind
    ``bootstrap_addr`` is known (its bootstrap server answered),
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
        self._info: Optional[_PrefillInfo] = None
        self._state = KVPoll.Bootstrapping
        self._reason = ""
        self._code = 0
        self._fetched = False
        self._inited_at: Optional[float] = None
        mgr._watch(self.key, self)

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Find the prefill instance (its bootstrap server, looked up once
        per address); poll() retries until KVXFER_SGLANG_BOOTSTRAP_TIMEOUT
        when it does not answer yet."""
        if prefill_dp_rank:
            self._fail(f"prefill_dp_rank {prefill_dp_rank}: prefill data "
                       "parallelism is not supported by kvxfer.sglang yet")
            return
        self._inited_at = time.monotonic()
        self._resolve()

    def _resolve(self) -> None:
        m = self.kv_mgr
        if m.try_ensure_parallel_info(self.bootstrap_addr):
            self._info = m.prefill_info_table[self.bootstrap_addr]
            self._state = KVPoll.WaitingForInput
        elif (self._inited_at is not None and time.monotonic()
              - self._inited_at > m.bootstrap_timeout):
            self._fail(f"no kvxfer prefill instance at bootstrap server "
                       f"{self.bootstrap_addr} after "
                       f"{m.bootstrap_timeout:g} s: "
                       f"{m.lookup_error(self.bootstrap_addr)}")

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None,
                      destination: Any = None, **_: Any) -> None:
        """Fetch the room's KV into pages ``kv_indices`` (they cover the
        prompt from token 0) by key, from the prefill instance found at
        init; the aux rows go to row ``aux_index``."""
        if self._state != KVPoll.WaitingForInput:
            if self._state == KVPoll.Bootstrapping:
                self._fail("send_metadata() before the prefill instance "
                           "was found (init)")
            return
        if decode_prefix_len:
            self._fail(f"decode_prefix_len {decode_prefix_len}: the decode "
                       "radix cache is not supported by kvxfer.sglang yet")
            return
        if str(getattr(destination, "value", destination or "device")) \
                != "device":
            self._fail("a host KV destination is not supported by "
                       "kvxfer.sglang")
            return
        if any(s is not None for s in (state_indices or [])):
            self._fail("state indices (Mamba, SWA, ...) are not supported "
                       "by kvxfer.sglang yet")
            return
        self.aux_index = aux_index
        if hasattr(kv_indices, "cpu"):
            kv_indices = kv_indices.cpu().numpy()
        m = self.kv_mgr
        if self.bootstrap_addr not in m.prefill_info_table:
            # forgotten since init (the daemons restarted): look it up anew
            m.try_ensure_parallel_info(self.bootstrap_addr)
        info = m.prefill_info_table.get(self.bootstrap_addr, self._info)
        assert info is not None
        pages = [int(p) for p in kv_indices]
        try:
            m.call(lambda c: c.fetch_by_key(self.key, info.instance_id,
                                            info.address, self.key, m.pool,
                                            pages))
        except Error as e:
            self._fail(str(e), e.code)
            return
        self._fetched = True
        self._state = KVPoll.Transferring

    def _on_event(self, ev: Event) -> None:
        if self._state != KVPoll.Transferring:
            return
        if not ev.ok:
            if ev.code in (NotFound.code, PeerGone.code):
                self.kv_mgr.forget_prefill(self.bootstrap_addr)
            self._fail(str(ev.error), ev.code)
            return
        m = self.kv_mgr
        if m.aux_ptrs and self.aux_index is not None:
            try:
                _unpack_aux(ev.aux, m.aux_ptrs, m.aux_lens, m.aux_items,
                            int(self.aux_index))
            except ValueError as e:
                self._fail(f"kvxfer.sglang: {e}")
                return
        self._state = KVPoll.Success
        m._unwatch(self.key, self)

    def _fail(self, reason: str, code: int = 0) -> None:
        if self._state not in (KVPoll.Success, KVPoll.Failed):
            self._state = KVPoll.Failed
            self._reason = reason
            self._code = code
            self.conclude_state = KVPoll.Failed
            self.kv_mgr._unwatch(self.key, self)

    def poll(self) -> KVPoll:
        if self._state == KVPoll.Bootstrapping and \
                self._inited_at is not None:
            self._resolve()
        elif self._state == KVPoll.Transferring:
            self.kv_mgr.pump()
        return self._state

    def failure_exception(self) -> None:
        self._fail("failed for an unknown reason")
        self.clear()
        raise KvxferTransferError(self.bootstrap_room, self._reason,
                                  self._code)

    def abort(self) -> None:
        """Cancel the fetch: when this returns the daemon writes none of
        the pages any more; the request polls Failed."""
        if self._state in (KVPoll.Success, KVPoll.Failed):
            return
        if self._fetched:
            _cancel(self.kv_mgr, self.key)
        self._fail("aborted by SGLang (AbortReq)")

    def is_abort_release_safe(self) -> bool:
        # a kvxfer cancel is a fence: once it returned, no write follows
        return self._state != KVPoll.Transferring

    def clear(self) -> None:
        """Forget the request. A fetch still running is cancelled first."""
        if self._state == KVPoll.Transferring:
            _cancel(self.kv_mgr, self.key)
            self._fail("cleared while transferring")
        self.kv_mgr._unwatch(self.key, self)


# -- the bootstrap server -------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("kvxfer.sglang bootstrap: " + fmt, *args)

    def _reply(self, code: int, body: Any) -> None:
        data = (json.dumps(body) if not isinstance(body, str)
                else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json"
                         if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, "OK")
        elif self.path == _BOOTSTRAP_PATH:
            info = self.server.owner.prefill
            if info is None:
                self._reply(404, {"error": "no kvxfer prefill instance has "
                                  "registered here yet"})
            else:
                self._reply(200, info)
        else:
            self._reply(404, {"error": f"no such path {self.path}"})

    def do_PUT(self) -> None:
        if self.path != _BOOTSTRAP_PATH:
            self._reply(404, {"error": f"no such path {self.path}"})
            return
        try:
            n = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            n = -1
        if not 0 < n <= _BOOTSTRAP_MAX_BODY:
            self._reply(400, {"error": f"Content-Length: {n} (expected 1.."
                              f"{_BOOTSTRAP_MAX_BODY})"})
            return
        try:
            d = json.loads(self.rfile.read(n))
            info = {"instance_id": d["instance_id"], "address": d["address"],
                    "tp_size": int(d.get("tp_size", 1))}
            for k in ("instance_id", "address"):
                if not isinstance(info[k], str) or not 0 < len(info[k]) \
                        <= 192:
                    raise ValueError(f"{k}: expected a string of 1..192 "
                                     "characters")
        except (ValueError, KeyError, TypeError) as e:
            self._reply(400, {"error": f"bad registration: {e}"})
            return
        self.server.owner.prefill = info
        log.info("kvxfer.sglang bootstrap: prefill instance %s, rank 0 at "
                 "%s", info["instance_id"], info["address"])
        self._reply(200, {"ok": True})


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: "KvxferKVBootstrapServer"


class KvxferKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's bootstrap server (SGLang starts it in the
    prefill's main process on ``--disaggregation-bootstrap-port``).

    It serves one JSON object, ``GET /kvxfer/v1/prefill``: the instance's
    kvxfer name (``instance_id``), the daemon address of its rank 0
    (``address``) and its ``tp_size``, which its rank 0's manager puts
    there at start (``PUT`` of the same path); 404 until then. ``GET
    /health`` answers ``OK``. That is all a decode rank needs to fetch by
    key: the daemons do the rest. It runs in a daemon thread; ``port`` 0
    picks a free port (``self.port`` says which).
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.prefill: Optional[Dict[str, Any]] = None
        bind = "" if host in ("0.0.0.0", "") else host
        self._httpd = _HTTPServer((bind, int(port)), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="kvxfer-bootstrap", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """host:port a decode rank reaches it at (its bootstrap_addr)."""
        return f"{_http_host(self.host)}:{self.port}"

    def close(self) -> None:
        """Stop serving. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()
