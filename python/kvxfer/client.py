"""Client: one engine rank's connection to kvxferd (kvx_client_t)."""

from __future__ import annotations

import ctypes
import enum
import json
import threading
from dataclasses import dataclass, field
from typing import (Any, Iterator, List, Optional, Sequence, Tuple, Union)

from . import _lib
from ._check import INT_MAX, U64_MAX, integer, timeout_ms, u32_array
from .errors import Closed, Error, InvalidArgument, make_error, status_str
from .layout import Layout
from .memory import HostBuffer, Span, host_buffer_of, span_of

__all__ = ["Client", "Role", "Parallel", "Pool", "HostPool", "EventKind",
           "Event", "Batch", "ClientStatus", "ClientState", "DEFAULT_SOCKET"]

DEFAULT_SOCKET = "/run/kvxfer/kvxferd.sock"

Timeout = Optional[float]
Key = Union[bytes, bytearray, memoryview, str, int]
MAX_KEY = 128


def key_bytes(key: Key) -> bytes:
    """A request key as the daemon sees it: bytes as they are, a str as
    its UTF-8, an int as its decimal digits (what kvx_publish(42) sends:
    b"42"). Raises InvalidArgument for an empty or over-long key."""
    if isinstance(key, int):  # a bool too: refused as one
        k = str(integer("key", key, U64_MAX)).encode()
    elif isinstance(key, str):
        k = key.encode()
    elif isinstance(key, (bytes, bytearray, memoryview)):
        k = bytes(key)
    else:
        raise InvalidArgument(
            -1, f"key: {type(key).__name__} (expected bytes, str or int)")
    if not 1 <= len(k) <= MAX_KEY:
        raise InvalidArgument(
            -1, f"key: {len(k)} bytes (a key is 1 to {MAX_KEY} bytes)")
    return k
_DEFAULT: Any = object()  # "the client's default timeout"


class Role(enum.IntEnum):
    """kvx_role_t."""

    CONTEXT = 1
    GENERATION = 2
    BOTH = 3


@dataclass
class Parallel:
    """kvx_parallel_t: the instance's parallel configuration.

    ``layers_per_pp``: layers held by each PP rank (None = even split,
    remainder to the first ranks). ``attention_dp``: generation side only,
    the tp ranks form that many groups (0/1 = off).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    total_layers: int = 0
    total_kv_heads: int = 0
    layers_per_pp: Optional[Sequence[int]] = None
    attention_dp: int = 0


class EventKind(enum.IntEnum):
    """kvx_event_kind_t."""

    COMPLETE = 1
    ERROR = 2
    CANCELLED = 3
    TIMED_OUT = 4
    #: made by the library, not a request's end: the client is connected
    #: to a new daemon (no key; last in the new daemon's first batch)
    RECONNECTED = 5


class ClientStatus(enum.IntEnum):
    """kvx_client_status_t."""

    CONNECTED = 1
    RECONNECTING = 2  # the daemon went away; calls try to reconnect
    CLOSED = 3  # unusable for good (or close() was called)


@dataclass(frozen=True)
class ClientState:
    """What :attr:`Client.state` says (kvx_client_state).

    ``incarnation``: reconnections so far (0: the first daemon);
    ``attempts``: failed attempts since the connection was lost;
    ``in_flight``: requests the library would end with ``PEER_GONE``;
    ``next_attempt``: seconds until the next attempt may go;
    ``message``: why it is not connected ("" when it is)."""

    status: ClientStatus
    incarnation: int = 0
    attempts: int = 0
    in_flight: int = 0
    next_attempt: float = 0.0
    message: str = ""


@dataclass(frozen=True)
class Event:
    """A terminal event of one request (kvx_event_t).

    ``code`` is the kvx_status_t (0 for COMPLETE); ``message`` the daemon's
    reason. ``error`` gives the matching exception (None when complete).
    ``aux``: on the generation side's COMPLETE, the aux payload the
    context side published with the KV (``b""``: none; other events never
    carry one).
    """

    kind: Union[EventKind, int]  # an int: a kind newer than this package
    request_id: int  # the key's int form (its decimal digits); 0 if none
    code: int = 0
    message: str = ""
    key: bytes = b""  # the request's key (this side's)
    aux: bytes = b""  # generation side, COMPLETE: the published aux

    @property
    def ok(self) -> bool:
        """True for COMPLETE."""
        return self.kind == EventKind.COMPLETE

    @property
    def error(self) -> Optional[Error]:
        """The event as an exception instance (None for COMPLETE)."""
        if self.ok:
            return None
        return make_error(self.code, self.message)

    def raise_for_status(self) -> "Event":
        """Raise :attr:`error` unless the request completed; returns self."""
        err = self.error
        if err is not None:
            raise err
        return self


@dataclass(frozen=True)
class Batch:
    """Batch ``seq`` of this rank's terminal events (kvx_batch_t); batch k
    has the same events on every rank of the instance. Iterable."""

    seq: int
    events: Tuple[Event, ...] = field(default_factory=tuple)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)


class Pool:
    """A registered pool. Pass it (or its ``id``) to publish / fetch.

    Holds a reference to the memory it was made of, so that the memory
    outlives the registration. ``deregister()`` (or leaving a ``with``
    block) ends it; closing the client ends all of them.
    """

    def __init__(self, client: "Client", pool_id: int, layout: Layout,
                 size: int, kind: str, memory: Any) -> None:
        self.id = pool_id
        self.layout = layout
        self.size = size
        self.kind = kind  # "host" or "gpu"
        self.memory = memory
        self._client: Optional[Client] = client

    @property
    def registered(self) -> bool:
        """False after deregister() or the client's close()."""
        return self._client is not None and not self._client.closed

    def deregister(self, timeout: Timeout = _DEFAULT) -> None:
        """kvx_pool_deregister. Idempotent."""
        c, self._client = self._client, None
        if c is not None and not c.closed:
            c._call("kvx_pool_deregister", self.id, c._ms(timeout))

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deregister()

    def __repr__(self) -> str:
        return (f"<kvxfer.{type(self).__name__} id={self.id} {self.kind} "
                f"size={self.size} {self.layout.preset_name}>")


class HostPool(Pool):
    """A pool in a :class:`HostBuffer` made for it (create_host_pool)."""

    buffer: HostBuffer

    @property
    def array(self) -> Any:
        """The pool's bytes as a numpy uint8 array (needs numpy)."""
        return self.buffer.numpy()

    def memoryview(self) -> memoryview:
        """The pool's bytes as a writable memoryview."""
        return memoryview(self.buffer)


PoolRef = Union[Pool, int]
Blocks = Any  # a sequence of ints, a numpy integer array, a CPU tensor


def _pool_id(pool: PoolRef, name: str = "pool") -> int:
    return pool.id if isinstance(pool, Pool) else integer(name, pool)


@dataclass
class Group:
    """One more block table of a request (hybrid models; kvx_group_t):
    a KV group in a pool of its own layout (sliding-window layers: its
    ``blocks`` may start at ``first_block``), or a state slot (Mamba's
    convolution or SSM state: a pool of one-token blocks, ``num_tokens``
    1 and the slot as the one block; see :meth:`Group.state`). On
    :meth:`Client.publish` give ``num_tokens``; on :meth:`Client.fetch`
    ``skip_tokens`` (the group's tokens not moved)."""
    pool: "PoolRef"
    blocks: "Blocks"
    num_tokens: int = 0
    first_block: int = 0
    skip_tokens: int = 0

    @classmethod
    def state(cls, pool: "PoolRef", slot: int) -> "Group":
        """A state slot: block ``slot`` of a pool of one-token blocks."""
        return cls(pool, [slot], num_tokens=1)


def _groups(groups: Sequence[Group]) -> Tuple[Any, int, Any]:
    """(array, count, keep-alive) of groups as kvx_group_t."""
    arr = (_lib.Group * len(groups))()
    keep = []
    for i, g in enumerate(groups):
        if not isinstance(g, Group):
            raise InvalidArgument(-1, f"groups[{i}]: expected a kvxfer.Group")
        at = f"groups[{i}]"
        ptr, n, k = u32_array(f"{at}.blocks", g.blocks)
        keep.append(k)
        arr[i].pool_id = _pool_id(g.pool, f"{at}.pool")
        arr[i].blocks = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint32))
        arr[i].num_blocks = n
        arr[i].num_tokens = integer(f"{at}.num_tokens", g.num_tokens)
        arr[i].first_block = integer(f"{at}.first_block", g.first_block)
        arr[i].skip_tokens = integer(f"{at}.skip_tokens", g.skip_tokens)
    return arr, len(groups), keep


def _buf(b: bytes, keep: List[Any]) -> Any:
    """A C copy of b (kept alive in keep), as a void pointer."""
    cb = ctypes.create_string_buffer(b, max(len(b), 1))
    keep.append(cb)
    return ctypes.cast(cb, ctypes.c_void_p)


def _blocks(a: Any, at: str, pool: PoolRef, blocks: Blocks,
            keep: List[Any]) -> None:
    """The pool and blocks of a kvx_publish_args_t or kvx_fetch_args_t;
    ``at`` names the item in errors ("" for a single call)."""
    a.pool_id = _pool_id(pool, f"{at}pool")
    ptr, n, kp = u32_array(f"{at}blocks", blocks)
    keep.append(kp)
    a.blocks = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint32))
    a.num_blocks = n


def _group_args(a: Any, groups: Optional[Sequence[Group]], bit: int,
                keep: List[Any]) -> None:
    if groups:
        garr, gn, gkeep = _groups(groups)
        keep += [garr, gkeep]
        a.groups = ctypes.cast(garr, ctypes.POINTER(_lib.Group))
        a.num_groups = gn
        a.field_mask |= bit


def _publish_args(a: Any, at: str, key: Key, pool: PoolRef, blocks: Blocks,
                  num_tokens: int, params: Any, keep: List[Any], *,
                  aux: Optional[bytes] = None, layerwise: bool = False,
                  groups: Optional[Sequence[Group]] = None,
                  lease_ms: Optional[int] = None) -> None:
    """Fill a kvx_publish_args_t (kvx_publish, 3.0): its buffers are kept
    alive in keep; the params land in ``params``."""
    k = key_bytes(key)
    a.field_mask = (_lib.PUBLISH_FIELD_KEY | _lib.PUBLISH_FIELD_BLOCKS |
                    _lib.PUBLISH_FIELD_NUM_TOKENS |
                    _lib.PUBLISH_FIELD_PARAMS)
    a.key = _buf(k, keep)
    a.key_len = len(k)
    a.num_tokens = integer(f"{at}num_tokens", num_tokens)
    _blocks(a, at, pool, blocks, keep)
    a.params = ctypes.pointer(params)
    keep.append(a.params)
    if aux:
        b = bytes(aux)
        a.aux = _buf(b, keep)
        a.aux_len = len(b)
        a.field_mask |= _lib.PUBLISH_FIELD_AUX
    if layerwise:
        a.flags = _lib.PUBLISH_LAYERWISE
        a.field_mask |= _lib.PUBLISH_FIELD_FLAGS
    if lease_ms:
        a.lease_ms = integer(f"{at}lease_ms", lease_ms)
        a.field_mask |= _lib.PUBLISH_FIELD_LEASE
    _group_args(a, groups, _lib.PUBLISH_FIELD_GROUPS, keep)


def _fetch_args(a: Any, at: str, key: Key, pool: PoolRef, blocks: Blocks,
                keep: List[Any], *, params: Optional[bytes] = None,
                context: Optional[Tuple[str, str, Key]] = None,
                skip_tokens: int = 0, dp_rank: int = 0,
                groups: Optional[Sequence[Group]] = None) -> None:
    """Fill a kvx_fetch_args_t (kvx_fetch, 3.0): with ``params``, or by
    key with ``context`` = (instance, address, key)."""
    k = key_bytes(key)
    a.field_mask = (_lib.FETCH_FIELD_KEY | _lib.FETCH_FIELD_BLOCKS |
                    _lib.FETCH_FIELD_SKIP_TOKENS | _lib.FETCH_FIELD_DP_RANK)
    a.key = _buf(k, keep)
    a.key_len = len(k)
    a.skip_tokens = integer(f"{at}skip_tokens", skip_tokens)
    a.dp_rank = integer(f"{at}dp_rank", dp_rank)
    _blocks(a, at, pool, blocks, keep)
    if context is not None:
        inst, addr, ckey = context
        ck = key_bytes(ckey)
        ib, ab = inst.encode(), addr.encode()
        keep += [ib, ab]
        a.context_instance = ib
        a.context_address = ab
        a.context_key = _buf(ck, keep)
        a.context_key_len = len(ck)
        a.field_mask |= _lib.FETCH_FIELD_CONTEXT
    else:
        pb = bytes(params or b"")
        a.params = _buf(pb, keep)
        a.params_len = len(pb)
        a.field_mask |= _lib.FETCH_FIELD_PARAMS
    _group_args(a, groups, _lib.FETCH_FIELD_GROUPS, keep)


class Client:
    """A connection to kvxferd for one engine rank (kvx_client_t).

    ::

        with kvxfer.Client(instance_id="prefill-0", role="context",
                           parallel=kvxfer.Parallel(total_layers=32,
                                                    total_kv_heads=8)) as c:
            c.join([c.daemon_address])
            ...

    With ``instance_id`` None the client connects without Hello (an
    *observer*: status, requests) and may say :meth:`hello` later.

    Every call blocks until the daemon answers or ``timeout`` seconds pass
    (per call, default the client's; None = wait forever) and raises a
    subclass of :class:`kvxfer.Error` on failure, carrying the daemon's
    message. A client may be shared by threads: calls are serialized (the
    library is one thread at a time per connection).
    """

    def __init__(self, socket_path: Optional[str] = None, *,
                 instance_id: Optional[str] = None,
                 role: Union[Role, str, int, None] = None,
                 rank: int = 0, parallel: Optional[Parallel] = None,
                 timeout: Timeout = 5.0,
                 protocol_version: Optional[Tuple[int, int]] = None,
                 spin_us: Optional[int] = None,
                 reconnect: Optional[bool] = None) -> None:
        self._h = ctypes.c_void_p()
        self._lock = threading.RLock()
        self.timeout = timeout
        self.socket_path = socket_path or DEFAULT_SOCKET
        lib = _lib.lib()
        path = self.socket_path.encode()
        if instance_id is None:
            rc = lib.kvx_connect_observer(path, self._ms(_DEFAULT),
                                          ctypes.byref(self._h))
        else:
            hello, keep = self._hello_struct(instance_id, role, rank,
                                             parallel, protocol_version)
            rc = lib.kvx_connect(path, ctypes.byref(hello),
                                 self._ms(_DEFAULT), ctypes.byref(self._h))
            del keep
        if rc:
            msg = lib.kvx_last_error(None)
            self._h = ctypes.c_void_p()
            raise make_error(rc, msg.decode(errors="replace") if msg else "")
        try:
            if spin_us is not None:
                self.set_spin_us(spin_us)
            if reconnect is not None:
                self.set_reconnect(reconnect)
        except Exception:
            self.close()
            raise

    # -- plumbing ---------------------------------------------------------

    def _ms(self, timeout: Timeout) -> int:
        t = self.timeout if timeout is _DEFAULT else timeout
        return timeout_ms("timeout", t)

    def _call(self, fn: str, *args: Any) -> None:
        with self._lock:
            if not self._h:
                raise Closed(-20, "the client is closed")
            lib = _lib.lib()
            rc = getattr(lib, fn)(self._h, *args)
            if rc:
                msg = lib.kvx_last_error(self._h)
                raise make_error(rc, msg.decode(errors="replace")
                                 if msg else "")

    @staticmethod
    def _hello_struct(instance_id: str, role: Any, rank: int,
                      parallel: Optional[Parallel],
                      version: Optional[Tuple[int, int]]) -> Tuple[Any, Any]:
        if role is None:
            raise InvalidArgument(-1, "role: needed with instance_id")
        expect = "expected context, generation or both"
        if isinstance(role, str):
            try:
                role = Role[role.upper()]
            except KeyError:
                raise InvalidArgument(-1, f"role: {role!r} ({expect})") \
                    from None
        role = Role(integer("role", role, max(Role), min(Role)))
        p = parallel or Parallel()
        h = _lib.Hello()
        iid = instance_id.encode()
        h.instance_id = iid
        h.role = int(role)
        h.rank = integer("rank", rank)
        hp = h.parallel
        for f in ("tp", "pp", "cp", "total_layers", "total_kv_heads",
                  "attention_dp"):
            setattr(hp, f, integer(f"parallel.{f}", getattr(p, f)))
        lpp = None
        if p.layers_per_pp is not None:
            ptr, n, lpp = u32_array("parallel.layers_per_pp",
                                    p.layers_per_pp)
            hp.layers_per_pp = ctypes.cast(ptr,
                                           ctypes.POINTER(ctypes.c_uint32))
            hp.num_layers_per_pp = n
        if version is not None:
            major, minor = version
            h.version_major = integer("protocol_version[0]", major)
            h.version_minor = integer("protocol_version[1]", minor)
        return h, (iid, lpp)

    # -- connection -------------------------------------------------------

    @property
    def state(self) -> ClientState:
        """The connection's state (kvx_client_state): connected, or the
        daemon went away and calls reconnect, or closed for good. Sends
        nothing; a daemon that closed the connection shows at once."""
        with self._lock:
            if not self._h:
                return ClientState(ClientStatus.CLOSED,
                                   message="the client is closed")
            st = _lib.ClientState()
            st.size = ctypes.sizeof(st)
            rc = _lib.lib().kvx_client_state(self._h, ctypes.byref(st))
            if rc:
                raise make_error(rc, "kvx_client_state refused the struct")
            return ClientState(
                ClientStatus(st.status), int(st.incarnation),
                int(st.attempts), int(st.in_flight),
                st.next_attempt_ms / 1000.0,
                st.message.decode(errors="replace"))

    @property
    def closed(self) -> bool:
        """True after close(), or once the client is unusable for good: the
        daemon went away with reconnection off, or a call timed out (the
        daemon may still hold its requests: close it and connect anew).
        False while it reconnects (:attr:`alive` says whether it is
        connected now)."""
        return self.state.status == ClientStatus.CLOSED

    @property
    def alive(self) -> bool:
        """True while connected to a daemon (False while the daemon is
        gone and the client reconnects, and once it is closed)."""
        return self.state.status == ClientStatus.CONNECTED

    @property
    def incarnation(self) -> int:
        """Reconnections so far: 0 on the first daemon, then one more each
        time the library connected to a new one (an :class:`Event` of kind
        ``RECONNECTED`` says so once, in a batch)."""
        return self.state.incarnation

    def set_reconnect(self, enabled: bool = True, *,
                      backoff: Tuple[float, float] = (0.05, 1.0),
                      attempt_timeout: float = 2.0) -> None:
        """How the client reconnects once the daemon goes away
        (kvx_set_reconnect): on by default (``KVXFER_RECONNECT=0`` turns
        it off for every client). Attempts go inside calls (the library
        has no thread), the first at once, then after ``backoff[0]``
        seconds doubling up to ``backoff[1]``; one takes at most
        ``attempt_timeout`` seconds and never more than its call's
        timeout. Off: a lost daemon closes the client."""
        def ms(name: str, t: float) -> int:
            if t is None:
                raise InvalidArgument(-1, f"{name}: None (expected seconds "
                                      "> 0)")
            return timeout_ms(name, t)

        o = _lib.Reconnect()
        o.size = ctypes.sizeof(o)
        o.enabled = 1 if enabled else 0
        o.backoff_min_ms = ms("backoff[0]", backoff[0])
        o.backoff_max_ms = ms("backoff[1]", backoff[1])
        o.attempt_timeout_ms = ms("attempt_timeout", attempt_timeout)
        self._call("kvx_set_reconnect", ctypes.byref(o))

    def close(self) -> None:
        """Close the connection (kvx_close). The daemon ends this rank's
        offers and fetches and drops its pools. Idempotent."""
        with self._lock:
            h, self._h = self._h, ctypes.c_void_p()
            if h:
                _lib.lib().kvx_close(h)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def hello(self, instance_id: str, role: Union[Role, str, int],
              rank: int = 0, parallel: Optional[Parallel] = None,
              timeout: Timeout = _DEFAULT,
              protocol_version: Optional[Tuple[int, int]] = None) -> None:
        """Say Hello on an observer connection (kvx_hello)."""
        h, keep = self._hello_struct(instance_id, role, rank, parallel,
                                     protocol_version)
        self._call("kvx_hello", ctypes.byref(h), self._ms(timeout))
        del keep

    def set_spin_us(self, spin_us: int) -> None:
        """How long each call looks for the daemon's reply before its
        thread sleeps on the socket (kvx_set_spin_us), in microseconds;
        0: never spin. Default: ``KVXFER_SPIN_US``, else 50. At most
        100000."""
        self._call("kvx_set_spin_us", integer("spin_us", spin_us))

    @property
    def daemon_address(self) -> str:
        """This daemon's address, to allgather among the instance's ranks
        and pass to :meth:`join` (kvx_daemon_address): the new daemon's
        once the client reconnected (read each time, not kept)."""
        buf = ctypes.create_string_buffer(1024)
        self._call("kvx_daemon_address", buf, len(buf))
        return buf.value.decode()

    def join(self, rank_addresses: Sequence[str],
             consumers: Optional[Sequence[str]] = None,
             timeout: Timeout = _DEFAULT) -> None:
        """Tell the daemon where every rank of this instance is served
        (kvx_join); every local rank joins with the same list. A context
        instance may name the generation instances that can fetch its
        requests by key (``consumers``, each ``"INSTANCE"``, of this
        instance's uid, or ``"UID:INSTANCE"``; kvx_join_consumers); None:
        any instance of this instance's uid, on any daemon."""
        enc = [a.encode() for a in rank_addresses]
        arr = (ctypes.c_char_p * max(1, len(enc)))(*enc)
        cons = [c.encode() for c in (consumers or [])]
        carr = (ctypes.c_char_p * max(1, len(cons)))(*cons)
        self._call("kvx_join_consumers", arr, len(enc),
                   carr if cons else None, len(cons), self._ms(timeout))

    # -- pools ------------------------------------------------------------

    def create_host_pool(self, layout: Layout, size: Optional[int] = None,
                         timeout: Timeout = _DEFAULT) -> HostPool:
        """A new host-memory pool (a sealed memfd shared with the daemon,
        as kvx_pool_create_host makes) of ``size`` bytes (default
        ``layout.span``). Its bytes: ``pool.array`` (numpy),
        ``pool.memoryview()``, ``pool.buffer.torch()``. The memory lives as
        long as any of those do, even after deregister()."""
        buf = HostBuffer(layout.span if size is None else size)
        pool = self.register_host_fd(buf.fd, 0, len(buf), layout,
                                     timeout=timeout)
        hp = HostPool(self, pool.id, layout, len(buf), "host", buf)
        hp.buffer = buf
        pool._client = None  # hp owns the registration now
        return hp

    def register_host_fd(self, fd: int, offset: int, size: int,
                         layout: Layout,
                         timeout: Timeout = _DEFAULT) -> Pool:
        """Bytes [offset, offset + size) of a memfd of yours as a pool
        (kvx_pool_register_host). The memfd must be sealed against
        shrinking (F_SEAL_SHRINK); you keep the fd and your mapping."""
        pid = ctypes.c_uint32()
        self._call("kvx_pool_register_host", ctypes.byref(layout._c),
                   integer("fd", fd, INT_MAX),
                   integer("offset", offset, U64_MAX),
                   integer("size", size, U64_MAX), ctypes.byref(pid),
                   self._ms(timeout))
        return Pool(self, pid.value, layout, size, "host", fd)

    def register_pool(self, memory: Any, layout: Layout, *,
                      size: Optional[int] = None,
                      device: Optional[str] = None,
                      timeout: Timeout = _DEFAULT) -> Pool:
        """Register memory you have as a pool described by ``layout``.

        ``memory`` is one of:

        * a CUDA tensor (PyTorch), CuPy array or any object with
          ``__cuda_array_interface__`` (contiguous): kvx_pool_register_gpu
          (a slice of a larger allocation works, and PyTorch's expandable
          segments);
        * a numpy array, CPU tensor, memoryview or :class:`HostBuffer`
          whose bytes lie in a HostBuffer: kvx_pool_register_host;
        * a list of per-layer tensors/arrays (one per layer of the layout,
          as vLLM keeps them): a pool of a region per tensor, the layout
          split per layer (:meth:`Layout.split`) unless it has parts;
        * a pair ``(k_tensors, v_tensors)`` of such lists (a K and a V
          tensor per layer, as SGLang keeps them): a region per tensor,
          the layout split per K and V;
        * an int: a raw pointer, with ``size`` (bytes) and ``device``
          (``"cuda"``, or ``"host"`` inside a HostBuffer).

        Host tensors of a list may lie in one HostBuffer or several; CUDA
        tensors on one device, in one allocation or many (each allocation
        is shared once). Each region is its tensor's bytes; the layout
        must fit in them. The pool keeps a reference to ``memory``.
        """
        if isinstance(memory, (list, tuple)):
            items, layout = self._regions_of(memory, layout)
            return self.register_regions(layout, items, device=device,
                                         timeout=timeout, keep=memory)
        if size is not None:
            size = integer("size", size, U64_MAX, 1)
        span = span_of(memory, size, device)
        if size is not None and not isinstance(memory, int):
            if size > span.nbytes:
                raise InvalidArgument(-1, f"size: {size} is more than the "
                                      f"{span.nbytes} bytes of memory")
            span.nbytes = size
        pid = ctypes.c_uint32()
        if span.kind == "host":
            buf = host_buffer_of(span)
            self._call("kvx_pool_register_host", ctypes.byref(layout._c),
                       buf.fd, span.ptr - buf.address, span.nbytes,
                       ctypes.byref(pid), self._ms(timeout))
        else:
            self._call("kvx_pool_register_gpu", ctypes.byref(layout._c),
                       ctypes.c_void_p(span.ptr), span.nbytes,
                       ctypes.byref(pid), self._ms(timeout))
        return Pool(self, pid.value, layout, span.nbytes, span.kind, memory)

    @staticmethod
    def _regions_of(memory: Sequence[Any],
                    layout: Layout) -> Tuple[List[Any], Layout]:
        """The regions of a list (per layer) or a (K list, V list) pair,
        and the layout addressing them in that order."""
        L = layout.num_layers
        pair = (len(memory) == 2 and all(isinstance(m, (list, tuple))
                                         for m in memory))
        if pair:
            k, v = memory
            if layout.kv_factor != 2 or len(k) != L or len(v) != L:
                raise InvalidArgument(-1, f"memory: {len(k)} K and {len(v)} "
                                      f"V tensors for a layout of {L} "
                                      f"layers x kv_factor "
                                      f"{layout.kv_factor}")
            items = [t for a in range(L) for t in (k[a], v[a])]
            per = 2
        else:
            if len(memory) != L:
                raise InvalidArgument(-1, f"memory: {len(memory)} per-layer "
                                      f"tensors for a layout of {L} layers")
            items = list(memory)
            per = 1
        if layout.num_regions == 1 and len(items) > 1:
            layout = layout.split(per)
        return items, layout

    def register_regions(self, layout: Layout, regions: Sequence[Any], *,
                         device: Optional[str] = None,
                         timeout: Timeout = _DEFAULT,
                         keep: Any = None) -> Pool:
        """Register a pool of regions (kvx_pool_register_host_regions /
        kvx_pool_register_gpu_regions): ``regions[i]`` is the memory of
        the layout's region i (a tensor, array, HostBuffer slice), all host
        or all CUDA on one device. The layout's parts name the regions
        (:meth:`Layout.split`, :meth:`Layout.with_parts`)."""
        if not regions or len(regions) > _lib.MAX_REGIONS:
            raise InvalidArgument(-1, f"regions: {len(regions)} (expected "
                                  f"1..{_lib.MAX_REGIONS})")
        spans = [span_of(m, None, device) for m in regions]
        kinds = {s.kind for s in spans}
        if len(kinds) != 1:
            raise InvalidArgument(-1, "regions: host and GPU memory in one "
                                  "pool (register two pools)")
        kind = spans[0].kind
        n = len(spans)
        pid = ctypes.c_uint32()
        if kind == "host":
            arr = (_lib.HostRegion * n)()
            for i, sp in enumerate(spans):
                buf = host_buffer_of(sp)
                arr[i].fd, arr[i].offset = buf.fd, sp.ptr - buf.address
                arr[i].size = sp.nbytes
            self._call("kvx_pool_register_host_regions",
                       ctypes.byref(layout._c), arr, n, ctypes.byref(pid),
                       self._ms(timeout))
        else:
            garr = (_lib.GpuRegion * n)()
            for i, sp in enumerate(spans):
                garr[i].dev_ptr, garr[i].size = sp.ptr, sp.nbytes
            self._call("kvx_pool_register_gpu_regions",
                       ctypes.byref(layout._c), garr, n, ctypes.byref(pid),
                       self._ms(timeout))
        return Pool(self, pid.value, layout, sum(sp.nbytes for sp in spans),
                    kind, regions if keep is None else keep)

    def deregister(self, pool: PoolRef, timeout: Timeout = _DEFAULT) -> None:
        """kvx_pool_deregister (same as ``pool.deregister()``)."""
        if isinstance(pool, Pool):
            pool.deregister(timeout)
        else:
            self._call("kvx_pool_deregister", _pool_id(pool),
                       self._ms(timeout))

    # -- requests ---------------------------------------------------------

    def publish(self, key: Key, pool: PoolRef, blocks: Blocks,
                num_tokens: int, timeout: Timeout = _DEFAULT, *,
                aux: Optional[bytes] = None,
                layerwise: bool = False,
                groups: Optional[Sequence[Group]] = None,
                lease_ms: Optional[int] = None) -> bytes:
        """Offer the KV of request ``key`` in ``blocks`` of ``pool``
        (kvx_publish). ``key``: bytes, a str (its UTF-8) or an int
        (its decimal digits, as kvx_publish makes it), 1 to 128 bytes.

        ``aux``: opaque bytes (first output token, logprobs), at most the
        daemon's ``limits.aux_bytes`` (64 KiB by default; more raises
        :class:`LimitReached`), that the generation side's COMPLETE event
        carries as :attr:`Event.aux`. Any rank may pass it; the first
        non-empty one is kept and another rank's must be equal or empty
        (else :class:`ConfigMismatch`). Pass the same aux on every rank:
        a fetch that reads only some ranks may complete before the others
        publish.

        ``layerwise``: offer the blocks before their KV exists
        (KVX_PUBLISH_LAYERWISE); no layer is read until
        :meth:`layers_ready` names it, so the transfer runs behind the
        prefill's forward pass.

        ``groups``: the request's other block tables (:class:`Group`:
        sliding-window layers, state slots), every rank the same, in the
        same order (KVX_PUBLISH_FIELD_GROUPS); with ``layerwise`` each table's
        layers are made ready on their own (:meth:`layers_ready`'s
        ``group``).

        ``lease_ms`` (2.6): the offer's lease, how long the daemon holds
        it for a fetch unless renewed (:meth:`renew`); None or 0: the
        daemon's ``deadlines.offer_lease_ms``. Over its
        ``deadlines.offer_lease_max_ms``: :class:`InvalidArgument`. The
        params carry it (:func:`kvxfer.params_info`'s ``lease_ms``).

        Returns the context params: opaque bytes, identical on every rank,
        for the router to hand to the generation side.
        """
        keep: List[Any] = []
        params = _lib.ContextParams()
        a = _lib.PublishArgs()
        _publish_args(a, "", key, pool, blocks, num_tokens, params, keep,
                      aux=aux, layerwise=layerwise, groups=groups,
                      lease_ms=lease_ms)
        a.field_mask |= _lib.PUBLISH_FIELD_TIMEOUT
        a.timeout_ms = self._ms(timeout)
        self._call("kvx_publish", ctypes.byref(a))
        del keep
        try:
            return ctypes.string_at(params.data, params.len)
        finally:
            _lib.lib().kvx_context_params_free(ctypes.byref(params))

    def fetch(self, key: Key, params: bytes, pool: PoolRef,
              blocks: Blocks, *, skip_tokens: int = 0,
              dp_rank: Optional[int] = None,
              groups: Optional[Sequence[Group]] = None,
              timeout: Timeout = _DEFAULT) -> None:
        """Fill ``blocks`` of ``pool`` with the KV the context ``params``
        name, writing tokens >= ``skip_tokens`` (kvx_fetch). ``key``
        is this side's name of the request (its events and :meth:`cancel`
        use it). With attention DP, ``dp_rank`` names the receiving group.
        ``groups``: the destination of each of the offer's other block
        tables, in its order (:class:`Group` with ``skip_tokens``;
        KVX_FETCH_FIELD_GROUPS). Returns once the daemon accepted the fetch; its
        end arrives as an :class:`Event` from :meth:`poll`."""
        keep: List[Any] = []
        a = _lib.FetchArgs()
        _fetch_args(a, "", key, pool, blocks, keep, params=params,
                    skip_tokens=skip_tokens,
                    dp_rank=0 if dp_rank is None else dp_rank,
                    groups=groups)
        a.field_mask |= _lib.FETCH_FIELD_TIMEOUT
        a.timeout_ms = self._ms(timeout)
        self._call("kvx_fetch", ctypes.byref(a))
        del keep

    def publish_many(self, items: Sequence[Tuple[Key, PoolRef, Blocks, int]],
                     timeout: Timeout = _DEFAULT) -> List[Any]:
        """Publish many requests in one round trip (kvx_publish with
        items), as a scheduler step's batch: ``items`` are ``(key, pool,
        blocks, num_tokens)``, at most 256. Returns one entry per item, in
        order: its context params (bytes), or the error it got, with the
        daemon's message for that item (an exception instance, not
        raised: the other items are published). An invalid item raises
        before anything is sent."""
        n = len(items)
        arr = (_lib.PublishArgs * max(n, 1))()
        params = (_lib.ContextParams * max(n, 1))()
        keep: List[Any] = []
        for i, (key, pool, blocks, num_tokens) in enumerate(items):
            _publish_args(arr[i], f"items[{i}].", key, pool, blocks,
                          num_tokens, params[i], keep)
        res = self._many("kvx_publish", _lib.PublishArgs, arr, n, timeout)
        lib = _lib.lib()
        for i, r in enumerate(res):
            if r is None:
                p = params[i]
                res[i] = ctypes.string_at(p.data, p.len)
                lib.kvx_context_params_free(ctypes.byref(params[i]))
        return res

    def fetch_many(self, items: Sequence[Tuple[Any, ...]],
                   *, skip_tokens: int = 0,
                   timeout: Timeout = _DEFAULT) -> List[Any]:
        """Fetch many requests in one round trip (kvx_fetch with items):
        ``items`` are ``(key, params, pool, blocks)`` or ``(key, params,
        pool, blocks, skip_tokens)`` (else ``skip_tokens``), at most 256.
        Returns one entry per item: None when the daemon took the fetch
        (its end arrives as an :class:`Event`), or the error it got, with
        the daemon's message for that item (an exception instance, not
        raised)."""
        skip = integer("skip_tokens", skip_tokens)
        n = len(items)
        arr = (_lib.FetchArgs * max(n, 1))()
        keep: List[Any] = []
        for i, item in enumerate(items):
            if len(item) not in (4, 5):
                raise InvalidArgument(-1, f"items[{i}]: (key, params, pool, "
                                      "blocks[, skip_tokens])")
            key, params, pool, blocks = item[:4]
            _fetch_args(arr[i], f"items[{i}].", key, pool, blocks, keep,
                        params=params,
                        skip_tokens=item[4] if len(item) == 5 else skip)
        return self._many("kvx_fetch", _lib.FetchArgs, arr, n, timeout)

    def _many(self, fn: str, args: Any, arr: Any, n: int,
              timeout: Timeout) -> List[Any]:
        """Run a batch of kvx_publish or kvx_fetch (3.0, its items arr[0,
        n)): per item None (taken) or its error, with its own code and
        the daemon's message for it. A failure of the call itself
        (nothing sent: an invalid item; the connection lost) is raised."""
        bit = 1 << 7  # KVX_*_FIELD_OUTCOME, the same bit for both verbs
        out = (_lib.Outcome * max(n, 1))()
        for i in range(n):
            arr[i].field_mask |= bit
            arr[i].outcome = ctypes.pointer(out[i])
        batch = args()
        batch.field_mask = (1 << 9) | (1 << 8)  # ITEMS | TIMEOUT
        batch.items = ctypes.cast(arr, ctypes.POINTER(args))
        batch.num_items = n
        return self._call_items(fn, batch, out, n, timeout)

    def _call_items(self, fn: str, args: Any, out: Any, n: int,
                    timeout: Timeout) -> List[Optional[Error]]:
        """fn(args), a call with an outcome per item (out[0, n)): per item
        None (done) or its error, with its own code and the daemon's
        message for it. A failure of the call itself, no item answered
        (nothing sent, the connection lost, the timeout), is raised."""
        with self._lock:
            if not self._h:
                raise Closed(-20, "the client is closed")
            lib = _lib.lib()
            args.timeout_ms = self._ms(timeout)
            rc = getattr(lib, fn)(self._h, ctypes.byref(args))
            msg = lib.kvx_last_error(self._h) if rc else None
        if rc and not any(out[i].answered for i in range(n)):
            raise make_error(rc, msg.decode(errors="replace") if msg else "")
        res: List[Optional[Error]] = [None] * n
        for i in range(n):
            if out[i].code:
                text = out[i].message.decode(errors="replace")
                res[i] = make_error(out[i].code, f"{fn}: item {i}: {text}")
        return res

    def poll(self, at_least: int = 1,
             timeout: Optional[float] = 0.1) -> Batch:
        """This rank's next batch of terminal events (kvx_poll): sealed once
        ``at_least`` events are pending or ``timeout`` seconds pass
        (possibly empty). ``timeout`` 0: sealed now with what is pending
        (the non-blocking poll of a scheduler step); None: no deadline,
        sealed once ``at_least`` events are pending (as every call's
        None). Every rank of an instance gets the same batch k, so SPMD
        ranks call poll in lockstep."""
        n = integer("at_least", at_least)
        ms = timeout_ms("timeout", timeout, zero=True)
        out = ctypes.POINTER(_lib.Batch)()
        self._call("kvx_poll", n, ms, ctypes.byref(out))
        try:
            b = out.contents
            events = tuple(
                Event(kind=_kind(e.kind), request_id=int(e.request_id),
                      code=int(e.code),
                      message=(e.message or b"").decode(errors="replace"),
                      key=ctypes.string_at(e.key, e.key_len)
                      if e.key_len else b"",
                      aux=ctypes.string_at(e.aux, e.aux_len)
                      if e.aux_len else b"")
                for e in b.events[: b.num_events])
            return Batch(seq=int(b.seq), events=events)
        finally:
            _lib.lib().kvx_batch_free(out)

    def layers_ready(self, key: Key, first: int, count: int = 1, *,
                     tokens: Optional[int] = None, event: Any = None,
                     group: int = 0,
                     timeout: Timeout = _DEFAULT) -> None:
        """Layers ``[first, first + count)`` of this rank's pool hold the
        KV of ``key``, published with ``layerwise=True`` (kvx_ready).
        Host pools: call it once they are written.
        GPU pools: pass ``event``, an interprocess CUDA event recorded on
        the stream after the work that writes them (a
        ``torch.cuda.Event(interprocess=True)``, or the 64 bytes of its
        ``ipc_handle()``): the daemon copies those layers once that record
        is reached, and the engine never synchronises. Use an event per
        layer (or a ring deeper than the layers in flight).

        ``tokens`` (a chunked prefill): the layers hold tokens
        ``[0, tokens)`` only; None: all of them. ``group``: the block
        table whose layers these are (0: the plain one, k + 1: the
        publish's ``groups[k]``)."""
        k = key_bytes(key)
        first, count = integer("first", first), integer("count", count)
        toks = 0 if tokens is None else integer("tokens", tokens)
        group = integer("group", group)
        ev = None
        if event is not None:
            ev = event if isinstance(event, (bytes, bytearray)) else \
                event.ipc_handle()
            ev = bytes(ev)
            if len(ev) != 64:
                raise InvalidArgument(-1, f"event: {len(ev)} bytes (a "
                                      "cudaIpcEventHandle_t has 64)")
        keep: List[Any] = []
        a = _lib.ReadyArgs(
            field_mask=_lib.READY_FIELD_KEY | _lib.READY_FIELD_LAYERS |
            _lib.READY_FIELD_TOKENS | _lib.READY_FIELD_GROUP |
            _lib.READY_FIELD_CUDA_EVENT | _lib.READY_FIELD_TIMEOUT,
            key=_buf(k, keep),
            key_len=len(k), first=first, count=count, tokens=toks,
            group=group, timeout_ms=self._ms(timeout))
        if ev is not None:
            a.cuda_event = _buf(ev, keep)
        self._call("kvx_ready", ctypes.byref(a))
        del keep

    def append_blocks(self, key: Key, pool: PoolRef, blocks: Blocks,
                      timeout: Timeout = _DEFAULT) -> None:
        """A chunked prefill: the next blocks of a layer-wise offer of
        ``key``, in token order after those given before, from the pool
        it was published from (kvx_append_blocks); a layer-wise publish
        may give only the first chunk's blocks."""
        k = key_bytes(key)
        pid = _pool_id(pool)
        ptr, n, keep = u32_array("blocks", blocks)
        self._call("kvx_append_blocks", k, len(k), pid, ptr, n,
                   self._ms(timeout))
        del keep

    def fetch_progress(self, key: Key, timeout: Timeout = _DEFAULT, *,
                       group: int = 0) -> Tuple[int, int, bool]:
        """``(layers_done, num_layers, ended)`` of this rank's fetch of
        ``key`` (kvx_progress): layers ``[0, layers_done)`` of its
        pool have landed, so attention may start on them while later
        layers arrive; ``ended``: its event is coming. ``group``: that
        block table of a fetch with groups (k + 1: ``groups[k]``, its own
        pool's layers). Raises :class:`NotFound` once the fetch is over."""
        k = key_bytes(key)
        group = integer("group", group)
        done, total, ended = ctypes.c_uint32(), ctypes.c_uint32(), \
            ctypes.c_int()
        keep: List[Any] = []
        a = _lib.ProgressArgs(
            field_mask=_lib.PROGRESS_FIELD_KEY | _lib.PROGRESS_FIELD_GROUP |
            _lib.PROGRESS_FIELD_LAYERS | _lib.PROGRESS_FIELD_ENDED |
            _lib.PROGRESS_FIELD_TIMEOUT,
            key=_buf(k, keep),
            key_len=len(k), group=group,
            layers_done=ctypes.pointer(done), num_layers=ctypes.pointer(total),
            ended=ctypes.pointer(ended), timeout_ms=self._ms(timeout))
        self._call("kvx_progress", ctypes.byref(a))
        del keep
        return int(done.value), int(total.value), bool(ended.value)

    def cancel(self, key: Key, timeout: Timeout = _DEFAULT) -> None:
        """Cancel request ``key`` (published or fetched by this instance)
        (kvx_cancel_key). On return the daemon will never again read or
        write its blocks."""
        k = key_bytes(key)
        self._call("kvx_cancel_key", k, len(k), self._ms(timeout))

    def reserve(self, instance_id: str, key: Key, num_tokens: int,
                timeout: Timeout = _DEFAULT, *,
                pool: Optional[PoolRef] = None,
                groups: Optional[Sequence[Group]] = None,
                lease_ms: Optional[int] = None) -> bytes:
        """For the instance's scheduler (a client without Hello, of the
        uid that owns the instance): reserve the offer of ``key`` for
        ``num_tokens`` and get its context params now, the bytes the
        ranks' :meth:`publish` will return (kvx_reserve). Call it on the
        daemon of the instance's rank 0 once a rank registered a pool.

        A hybrid model (2.4): ``groups`` as the ranks will publish them, each :class:`Group` naming a pool of its layout
        that a rank registered, ``num_tokens`` and ``first_block``, and no
        blocks (``Group(pool, [], num_tokens=...)``); ``pool``: the plain
        table's pool (needed when the instance's pools differ in layout,
        as a hybrid model's do). ``lease_ms`` (2.6): the offer's lease, as
        :meth:`publish`'s; the ranks' publishes give the same or none."""
        k = key_bytes(key)
        num_tokens = integer("num_tokens", num_tokens)
        pid = 0 if pool is None else _pool_id(pool)
        params = _lib.ContextParams()
        groups = list(groups or ())
        arr = (_lib.Group * max(1, len(groups)))()
        for i, g in enumerate(groups):
            if not isinstance(g, Group):
                raise InvalidArgument(-1, f"groups[{i}]: expected a "
                                      "kvxfer.Group")
            if len(g.blocks) or g.skip_tokens:
                raise InvalidArgument(
                    -1, f"groups[{i}]: a reservation names no blocks and "
                    "skips no tokens (the ranks' publishes give the blocks)")
            at = f"groups[{i}]"
            arr[i].pool_id = _pool_id(g.pool, f"{at}.pool")
            arr[i].num_tokens = integer(f"{at}.num_tokens", g.num_tokens)
            arr[i].first_block = integer(f"{at}.first_block", g.first_block)
        keep: List[Any] = []
        a = _lib.ReserveArgs(
            field_mask=_lib.RESERVE_FIELD_KEY | _lib.RESERVE_FIELD_INSTANCE |
            _lib.RESERVE_FIELD_NUM_TOKENS | _lib.RESERVE_FIELD_PARAMS |
            _lib.RESERVE_FIELD_POOL | _lib.RESERVE_FIELD_GROUPS |
            _lib.RESERVE_FIELD_TIMEOUT,
            key=_buf(k, keep),
            key_len=len(k), instance_id=instance_id.encode(),
            num_tokens=num_tokens, params=ctypes.pointer(params),
            pool_id=pid, groups=ctypes.cast(arr, ctypes.POINTER(_lib.Group)),
            num_groups=len(groups), timeout_ms=self._ms(timeout))
        if lease_ms:
            a.lease_ms = integer("lease_ms", lease_ms)
            a.field_mask |= _lib.RESERVE_FIELD_LEASE
        self._call("kvx_reserve", ctypes.byref(a))
        del keep
        try:
            return ctypes.string_at(params.data, params.len)
        finally:
            _lib.lib().kvx_context_params_free(ctypes.byref(params))

    def reserve_many(self, instance_id: str,
                     items: Sequence[Tuple[Key, int]],
                     timeout: Timeout = _DEFAULT, *,
                     lease_ms: Optional[int] = None) -> List[Any]:
        """A scheduler's step of reservations in one round trip (2.6:
        kvx_reserve with items, KVX_RESERVE_FIELD_ITEMS): ``items`` are
        ``(key, num_tokens)`` of instance ``instance_id``, at most 256,
        each reserved as :meth:`reserve` does (plain table, ``lease_ms``
        for all). Returns one entry per item, in order: its context params
        (bytes), or the error it got, with the daemon's message for that
        item (an exception instance, not raised: the other items are
        reserved). An invalid item, or a failure of the exchange itself
        (the connection lost, the timeout), raises."""
        n = len(items)
        if n > 256:
            raise InvalidArgument(-1, f"reserve_many: {n} items (at most "
                                  "256)")
        arr = (_lib.ReserveArgs * max(n, 1))()
        params = (_lib.ContextParams * max(n, 1))()
        out = (_lib.Outcome * max(n, 1))()
        keep: List[Any] = []
        inst = instance_id.encode()
        lease = integer("lease_ms", lease_ms) if lease_ms else 0
        for i, item in enumerate(items):
            if len(item) != 2:
                raise InvalidArgument(-1, f"items[{i}]: (key, num_tokens)")
            key, num_tokens = item
            k = key_bytes(key)
            a = arr[i]
            a.field_mask = (
                _lib.RESERVE_FIELD_KEY | _lib.RESERVE_FIELD_INSTANCE |
                _lib.RESERVE_FIELD_NUM_TOKENS | _lib.RESERVE_FIELD_PARAMS |
                _lib.RESERVE_FIELD_OUTCOME |
                (_lib.RESERVE_FIELD_LEASE if lease else 0))
            a.key = _buf(k, keep)
            a.key_len = len(k)
            a.instance_id = inst
            a.num_tokens = integer(f"items[{i}].num_tokens", num_tokens)
            a.params = ctypes.pointer(params[i])
            a.outcome = ctypes.pointer(out[i])
            keep += [a.params, a.outcome]
            a.lease_ms = lease
        batch = _lib.ReserveArgs()
        batch.field_mask = (_lib.RESERVE_FIELD_ITEMS |
                            _lib.RESERVE_FIELD_TIMEOUT)
        batch.items = ctypes.cast(arr, ctypes.POINTER(_lib.ReserveArgs))
        batch.num_items = n
        errs = self._call_items("kvx_reserve", batch, out, n, timeout)
        del keep
        lib = _lib.lib()
        res: List[Any] = []
        for i in range(n):
            p = params[i]
            res.append(errs[i] or ctypes.string_at(p.data, p.len))
            lib.kvx_context_params_free(ctypes.byref(p))
        return res

    def renew(self, params: Sequence[bytes],
              timeout: Timeout = _DEFAULT) -> List[Optional[Error]]:
        """Renew the leases of offers (2.6, kvx_renew): on every daemon of
        each offer's context ranks its deadline becomes now + its lease
        (:func:`kvxfer.params_info`'s ``lease_ms``). For the generation
        side (a rank, or a router or scheduler client without Hello)
        while it holds params it has not fetched yet, about every third
        of the lease. ``params``: 1 to 256, sent in one write. Returns
        one entry per params, in order: None (renewed; also an offer being
        fetched, which its fetch's timeout bounds), or the error it got
        (an exception instance, not raised): :class:`NotFound` once the
        offer ended (fetched, released, expired), :class:`AuthError`,
        :class:`Unsupported` (a daemon before 2.6 serves a rank). A
        failure of the exchange itself raises."""
        blobs = [bytes(p) for p in params]
        n = len(blobs)
        if not 1 <= n <= 256:
            raise InvalidArgument(-1, f"renew: {n} params (1 to 256)")
        arr = (_lib.ContextParams * n)()
        out = (_lib.Outcome * n)()
        keep: List[Any] = []
        for i, b in enumerate(blobs):
            if not b:
                raise InvalidArgument(-1, f"renew: params[{i}] is empty")
            cb = ctypes.create_string_buffer(b, len(b))
            keep.append(cb)
            arr[i].data = ctypes.cast(cb, ctypes.POINTER(ctypes.c_uint8))
            arr[i].len = len(b)
        a = _lib.RenewArgs(
            field_mask=_lib.RENEW_FIELD_PARAMS | _lib.RENEW_FIELD_OUTCOMES |
            _lib.RENEW_FIELD_TIMEOUT,
            params=ctypes.cast(arr, ctypes.POINTER(_lib.ContextParams)),
            num_params=n,
            outcomes=ctypes.cast(out, ctypes.POINTER(_lib.Outcome)))
        res = self._call_items("kvx_renew", a, out, n, timeout)
        del keep
        return res

    def gpu_pace(self, bytes_per_ms: int, hold_ms: int = 0,
                 timeout: Timeout = _DEFAULT) -> None:
        """Set the pace at which the daemon's copies may start on the GPUs
        of this rank's pools, registered now or later (3.2, kvx_gpu_pace):
        ``bytes_per_ms`` bytes a millisecond (at most 1 TiB; 0 withdraws
        this rank's pace). Each device goes at the lowest of ``gpu.pace``
        and the paces of the ranks with a GPU pool there (only ``gpu.pace``
        where GPU pools of more than one uid share it). The pace lapses
        ``hold_ms`` (at most 60000) after the call unless the rank calls
        again: an engine calls it each step while it decodes, and copies
        go at full speed once it stops; 0 holds it until changed or the
        client closes. A reconnection sets it again for what is left of
        its hold. Raises :class:`InvalidArgument` (a bound, naming the
        field), :class:`StateError` (no Hello: only a rank sets a pace),
        :class:`VersionMismatch` (the daemon is before protocol 2.8)."""
        per_ms = integer("bytes_per_ms", bytes_per_ms, hi=U64_MAX)
        hold = integer("hold_ms", hold_ms)
        self._call("kvx_gpu_pace", per_ms, hold, self._ms(timeout))

    def fetch_by_key(self, key: Key, context_instance: str,
                     context_address: str, context_key: Key, pool: PoolRef,
                     blocks: Blocks, *, skip_tokens: int = 0,
                     dp_rank: int = 0,
                     groups: Optional[Sequence[Group]] = None,
                     timeout: Timeout = _DEFAULT) -> None:
        """:meth:`fetch` without params (kvx_fetch by key,
        KVX_FETCH_FIELD_CONTEXT): the daemons
        find the offer of ``context_key`` of ``context_instance``, whose
        rank 0 is served by the daemon at ``context_address``, waiting for
        its publish or reservation under the fetch timeout. ``groups``:
        as :meth:`fetch`'s. The outcome comes
        as an :class:`Event` for ``key``."""
        keep: List[Any] = []
        a = _lib.FetchArgs()
        _fetch_args(a, "", key, pool, blocks, keep,
                    context=(context_instance, context_address, context_key),
                    skip_tokens=skip_tokens, dp_rank=dp_rank, groups=groups)
        a.field_mask |= _lib.FETCH_FIELD_TIMEOUT
        a.timeout_ms = self._ms(timeout)
        self._call("kvx_fetch", ctypes.byref(a))
        del keep

    def release(self, params: Optional[bytes] = None, *,
                context_instance: Optional[str] = None,
                context_address: Optional[str] = None,
                context_key: Optional[Key] = None,
                timeout: Timeout = _DEFAULT) -> None:
        """Release a published (or reserved) request without a transfer:
        its offer ends at once on every daemon of its context ranks, which
        get COMPLETE with the message ``"released"``, and its blocks are
        free. Name it by its ``params`` (kvx_release), or by
        ``context_instance``, ``context_address`` (its rank 0's daemon)
        and ``context_key`` (kvx_release_by_key). Works on a client
        without Hello (a router or scheduler). Raises :class:`StateError`
        while it is being fetched (cancel that fetch instead),
        :class:`NotFound` when there is no such offer, :class:`AuthError`
        for a token that is not the offer's, :class:`PermissionDenied`
        when the instance lets no router release by key."""
        if params is not None:
            if context_instance or context_address or context_key:
                raise InvalidArgument(-1, "release: params or a key, not "
                                      "both")
            params = bytes(params)
            self._call("kvx_release", params, len(params), self._ms(timeout))
            return
        if not (context_instance and context_address and
                context_key is not None):
            raise InvalidArgument(-1, "release: params, or context_instance,"
                                  " context_address and context_key")
        k = key_bytes(context_key)
        self._call("kvx_release_by_key", context_instance.encode(),
                   context_address.encode(), k, len(k), self._ms(timeout))

    # -- observing --------------------------------------------------------

    def _json(self, fn: str, timeout: Timeout) -> Any:
        p = ctypes.c_void_p()
        self._call(fn, ctypes.byref(p), self._ms(timeout))
        assert p.value is not None  # the library sets it on success
        try:
            return json.loads(ctypes.string_at(p.value).decode())
        finally:
            _lib.free(p.value)

    def status(self, timeout: Timeout = _DEFAULT) -> dict:
        """The daemon's status (kvx_status_json) as a dict."""
        return self._json("kvx_status_json", timeout)

    def requests(self, timeout: Timeout = _DEFAULT) -> List[dict]:
        """In-flight requests (kvx_requests_json) as a list of dicts."""
        return self._json("kvx_requests_json", timeout)

    def __repr__(self) -> str:
        state = self.state.status.name.lower()
        return f"<kvxfer.Client {self.socket_path} {state}>"


def _kind(k: int) -> Union[EventKind, int]:
    try:
        return EventKind(k)
    except ValueError:  # a kind newer than this package
        return k
