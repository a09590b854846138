"""Loading libkvxfer and its C declarations (ctypes mirrors of kvxfer.h).

Nothing here is public: the rest of the package calls ``lib()`` and the
structures below. The structures must match kvxfer.h field for field;
tests/test_abi.py compiles a small C program and compares every size and
offset with these.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import (POINTER, Structure, c_char, c_char_p, c_int, c_size_t,
                    c_uint, c_uint8, c_uint32, c_uint64, c_void_p)
from typing import List, Optional

MAX_LAYERS = 1024  # KVX_MAX_LAYERS
MAX_RANKS = 1024  # KVX_MAX_RANKS
MAX_REGIONS = 4096  # KVX_MAX_REGIONS
SONAME = "libkvxfer.so.2"

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# where a wheel (or `pip install ./python` after make) puts the library
# and, for a wheel, the shared libraries it needs that a machine may lack
_BUNDLE_DIR = os.path.join(_PKG_DIR, "_libs")


class Parallel(Structure):
    _fields_ = [
        ("tp", c_uint32), ("pp", c_uint32), ("cp", c_uint32),
        ("total_layers", c_uint32),
        ("total_kv_heads", c_uint32),
        ("layers_per_pp", POINTER(c_uint32)),
        ("num_layers_per_pp", c_uint32),
        ("attention_dp", c_uint32),
    ]


class LayoutPart(Structure):
    _fields_ = [("region", c_uint32), ("reserved", c_uint32),
                ("offset", c_uint64)]


class Layout(Structure):
    _fields_ = [
        ("preset", c_char * 16),
        ("num_layers", c_uint32), ("kv_factor", c_uint32),
        ("num_heads", c_uint32), ("head_dim", c_uint32),
        ("elem_size", c_uint32),
        ("dtype", c_int),
        ("tokens_per_block", c_uint32), ("num_blocks", c_uint32),
        ("layer_stride", c_uint64),
        ("kv_stride", c_uint64), ("block_stride", c_uint64),
        ("token_stride", c_uint64), ("head_stride", c_uint64),
        ("parts", POINTER(LayoutPart)),
        ("num_parts", c_uint32),
        ("first_head", c_uint32),
    ]


class HostRegion(Structure):
    _fields_ = [("fd", c_int), ("offset", c_uint64), ("size", c_uint64)]


class GpuRegion(Structure):
    _fields_ = [("dev_ptr", c_void_p), ("size", c_uint64)]


class Hello(Structure):
    _fields_ = [
        ("instance_id", c_char_p),
        ("role", c_int),
        ("rank", c_uint32),
        ("parallel", Parallel),
        ("version_major", c_uint32), ("version_minor", c_uint32),
    ]


class ContextParams(Structure):
    _fields_ = [("data", POINTER(c_uint8)), ("len", c_size_t)]


class Group(Structure):
    _fields_ = [
        ("pool_id", c_uint32),
        ("blocks", POINTER(c_uint32)),
        ("num_blocks", c_uint32),
        ("num_tokens", c_uint32),
        ("first_block", c_uint32),
        ("skip_tokens", c_uint32),
    ]


class PublishItem(Structure):
    _fields_ = [
        ("key", c_void_p),
        ("key_len", c_size_t),
        ("pool_id", c_uint32),
        ("blocks", POINTER(c_uint32)),
        ("num_blocks", c_uint32),
        ("num_tokens", c_uint32),
        ("params", ContextParams),
        ("status", ctypes.c_int),
    ]


class FetchItem(Structure):
    _fields_ = [
        ("key", c_void_p),
        ("key_len", c_size_t),
        ("params", c_void_p),
        ("params_len", c_size_t),
        ("pool_id", c_uint32),
        ("blocks", POINTER(c_uint32)),
        ("num_blocks", c_uint32),
        ("skip_tokens", c_uint32),
        ("dp_rank", c_uint32),
        ("status", ctypes.c_int),
    ]


class Outcome(Structure):
    _fields_ = [("code", c_int), ("answered", c_int),
                ("message", c_char * 512)]


# kvx_publish_args_t / kvx_fetch_args_t: field_mask says which members
# are set (kvxfer.h, 3.0)
PUBLISH_FIELD_KEY = 1 << 0
PUBLISH_FIELD_BLOCKS = 1 << 1
PUBLISH_FIELD_NUM_TOKENS = 1 << 2
PUBLISH_FIELD_PARAMS = 1 << 3
PUBLISH_FIELD_AUX = 1 << 4
PUBLISH_FIELD_GROUPS = 1 << 5
PUBLISH_FIELD_FLAGS = 1 << 6
PUBLISH_FIELD_OUTCOME = 1 << 7
PUBLISH_FIELD_TIMEOUT = 1 << 8
PUBLISH_FIELD_ITEMS = 1 << 9
PUBLISH_FIELD_LEASE = 1 << 10  # 2.6
PUBLISH_LAYERWISE = 1 << 0
FETCH_FIELD_KEY = 1 << 0
FETCH_FIELD_BLOCKS = 1 << 1
FETCH_FIELD_PARAMS = 1 << 2
FETCH_FIELD_CONTEXT = 1 << 3
FETCH_FIELD_SKIP_TOKENS = 1 << 4
FETCH_FIELD_DP_RANK = 1 << 5
FETCH_FIELD_GROUPS = 1 << 6
FETCH_FIELD_OUTCOME = 1 << 7
FETCH_FIELD_TIMEOUT = 1 << 8
FETCH_FIELD_ITEMS = 1 << 9


class PublishArgs(Structure):
    pass


PublishArgs._fields_ = [
    ("field_mask", c_uint64),
    ("key", c_void_p),
    ("key_len", c_size_t),
    ("pool_id", c_uint32),
    ("blocks", POINTER(c_uint32)),
    ("num_blocks", c_uint32),
    ("num_tokens", c_uint32),
    ("params", POINTER(ContextParams)),
    ("aux", c_void_p),
    ("aux_len", c_size_t),
    ("groups", POINTER(Group)),
    ("num_groups", c_uint32),
    ("flags", c_uint32),
    ("outcome", POINTER(Outcome)),
    ("timeout_ms", c_int),
    ("items", POINTER(PublishArgs)),
    ("num_items", c_size_t),
    ("lease_ms", c_uint32),
]


class FetchArgs(Structure):
    pass


FetchArgs._fields_ = [
    ("field_mask", c_uint64),
    ("key", c_void_p),
    ("key_len", c_size_t),
    ("pool_id", c_uint32),
    ("blocks", POINTER(c_uint32)),
    ("num_blocks", c_uint32),
    ("params", c_void_p),
    ("params_len", c_size_t),
    ("context_instance", c_char_p),
    ("context_address", c_char_p),
    ("context_key", c_void_p),
    ("context_key_len", c_size_t),
    ("skip_tokens", c_uint32),
    ("dp_rank", c_uint32),
    ("groups", POINTER(Group)),
    ("num_groups", c_uint32),
    ("outcome", POINTER(Outcome)),
    ("timeout_ms", c_int),
    ("items", POINTER(FetchArgs)),
    ("num_items", c_size_t),
]


# kvx_ready_args_t / kvx_progress_args_t / kvx_reserve_args_t (3.0)
READY_FIELD_KEY = 1 << 0
READY_FIELD_LAYERS = 1 << 1
READY_FIELD_TOKENS = 1 << 2
READY_FIELD_GROUP = 1 << 3
READY_FIELD_CUDA_EVENT = 1 << 4
READY_FIELD_TIMEOUT = 1 << 5
PROGRESS_FIELD_KEY = 1 << 0
PROGRESS_FIELD_GROUP = 1 << 1
PROGRESS_FIELD_LAYERS = 1 << 2
PROGRESS_FIELD_ENDED = 1 << 3
PROGRESS_FIELD_TIMEOUT = 1 << 4
RESERVE_FIELD_KEY = 1 << 0
RESERVE_FIELD_INSTANCE = 1 << 1
RESERVE_FIELD_NUM_TOKENS = 1 << 2
RESERVE_FIELD_PARAMS = 1 << 3
RESERVE_FIELD_POOL = 1 << 4
RESERVE_FIELD_GROUPS = 1 << 5
RESERVE_FIELD_TIMEOUT = 1 << 6
RESERVE_FIELD_LEASE = 1 << 7  # 2.6
RESERVE_FIELD_OUTCOME = 1 << 8
RESERVE_FIELD_ITEMS = 1 << 9
# kvx_renew_args_t (2.6)
RENEW_FIELD_PARAMS = 1 << 0
RENEW_FIELD_OUTCOMES = 1 << 1
RENEW_FIELD_TIMEOUT = 1 << 2


class ReadyArgs(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("key", c_void_p),
        ("key_len", c_size_t),
        ("first", c_uint32),
        ("count", c_uint32),
        ("tokens", c_uint32),
        ("group", c_uint32),
        ("cuda_event", c_void_p),
        ("timeout_ms", c_int),
    ]


class ProgressArgs(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("key", c_void_p),
        ("key_len", c_size_t),
        ("group", c_uint32),
        ("layers_done", POINTER(c_uint32)),
        ("num_layers", POINTER(c_uint32)),
        ("ended", POINTER(c_int)),
        ("timeout_ms", c_int),
    ]


class ReserveArgs(Structure):
    pass


ReserveArgs._fields_ = [
    ("field_mask", c_uint64),
    ("key", c_void_p),
    ("key_len", c_size_t),
    ("instance_id", c_char_p),
    ("num_tokens", c_uint32),
    ("params", POINTER(ContextParams)),
    ("pool_id", c_uint32),
    ("groups", POINTER(Group)),
    ("num_groups", c_uint32),
    ("timeout_ms", c_int),
    ("lease_ms", c_uint32),
    ("outcome", POINTER(Outcome)),
    ("items", POINTER(ReserveArgs)),
    ("num_items", c_size_t),
]


class RenewArgs(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("params", POINTER(ContextParams)),
        ("num_params", c_size_t),
        ("outcomes", POINTER(Outcome)),
        ("timeout_ms", c_int),
    ]


class ParamsInfo(Structure):
    _fields_ = [
        ("instance_id", ctypes.c_char * 129),
        ("key", c_uint8 * 128),
        ("key_len", c_uint32),
        ("request_id", c_uint64),
        ("num_tokens", c_uint32),
        ("tokens_per_block", c_uint32),
        ("context_ranks", c_uint32),
        ("num_layers", c_uint32),
        ("num_kv_heads", c_uint32),
        ("rank0_address", ctypes.c_char * 192),
    ]


class Event(Structure):
    _fields_ = [
        ("request_id", c_uint64),
        ("kind", c_int),
        ("code", c_int),
        ("message", c_char_p),
        ("key", POINTER(c_uint8)),
        ("key_len", c_uint32),
        ("aux", POINTER(c_uint8)),
        ("aux_len", c_uint32),
    ]


class ClientState(Structure):
    _fields_ = [
        ("size", c_uint32),
        ("status", c_int),
        ("incarnation", c_uint32),
        ("attempts", c_uint32),
        ("in_flight", c_uint32),
        ("next_attempt_ms", c_uint32),
        ("message", c_char * 512),
    ]


class Reconnect(Structure):
    _fields_ = [
        ("size", c_uint32),
        ("enabled", c_int),
        ("backoff_min_ms", c_uint32),
        ("backoff_max_ms", c_uint32),
        ("attempt_timeout_ms", c_uint32),
    ]


class Batch(Structure):
    _fields_ = [
        ("seq", c_uint64),
        ("num_events", c_uint32),
        ("events", POINTER(Event)),
    ]


# name -> (restype, argtypes), exactly kvxfer.h's 55 functions (the 2.x
# variants included, deprecated in 3.0: kvx_publish and kvx_fetch are
# the 3.0 calls)
_client_p = c_void_p
_PROTOS = {
    "kvx_status_str": (c_char_p, [c_int]),
    "kvx_status_name": (c_char_p, [c_int]),
    "kvx_dtype_parse": (c_int, [c_char_p, POINTER(c_int)]),
    "kvx_dtype_name": (c_char_p, [c_int]),
    "kvx_dtype_size": (c_uint, [c_int]),
    "kvx_layout_preset": (c_int, [c_char_p, c_uint32, c_uint32, c_uint32,
                                  c_uint32, c_int, c_uint32, c_uint32,
                                  POINTER(Layout)]),
    "kvx_layout_split": (c_int, [POINTER(Layout), c_uint32,
                                 POINTER(LayoutPart), c_uint32]),
    "kvx_layout_num_regions": (c_uint32, [POINTER(Layout)]),
    "kvx_layout_region_span": (c_uint64, [POINTER(Layout), c_uint32]),
    "kvx_layout_region": (c_uint32, [POINTER(Layout), c_uint32, c_uint32]),
    "kvx_layout_span": (c_uint64, [POINTER(Layout)]),
    "kvx_layout_offset": (c_uint64, [POINTER(Layout), c_uint32, c_uint32,
                                     c_uint32, c_uint32, c_uint32]),
    "kvx_connect": (c_int, [c_char_p, POINTER(Hello), c_int,
                            POINTER(_client_p)]),
    "kvx_close": (None, [_client_p]),
    "kvx_connect_observer": (c_int, [c_char_p, c_int, POINTER(_client_p)]),
    "kvx_hello": (c_int, [_client_p, POINTER(Hello), c_int]),
    "kvx_last_error": (c_char_p, [_client_p]),
    "kvx_set_spin_us": (c_int, [_client_p, c_uint32]),
    "kvx_daemon_address": (c_int, [_client_p, c_char_p, c_size_t]),
    "kvx_client_state": (c_int, [_client_p, POINTER(ClientState)]),
    "kvx_set_reconnect": (c_int, [_client_p, POINTER(Reconnect)]),
    "kvx_join": (c_int, [_client_p, POINTER(c_char_p), c_uint32, c_int]),
    "kvx_pool_create_host": (c_int, [_client_p, POINTER(Layout), c_uint64,
                                     POINTER(c_void_p), POINTER(c_uint32),
                                     c_int]),
    "kvx_pool_register_host": (c_int, [_client_p, POINTER(Layout), c_int,
                                       c_uint64, c_uint64, POINTER(c_uint32),
                                       c_int]),
    "kvx_pool_register_gpu": (c_int, [_client_p, POINTER(Layout), c_void_p,
                                      c_uint64, POINTER(c_uint32), c_int]),
    "kvx_pool_register_host_regions": (c_int, [_client_p, POINTER(Layout),
                                               POINTER(HostRegion), c_uint32,
                                               POINTER(c_uint32), c_int]),
    "kvx_pool_register_gpu_regions": (c_int, [_client_p, POINTER(Layout),
                                              POINTER(GpuRegion), c_uint32,
                                              POINTER(c_uint32), c_int]),
    "kvx_pool_deregister": (c_int, [_client_p, c_uint32, c_int]),
    "kvx_context_params_free": (None, [POINTER(ContextParams)]),
    "kvx_version": (c_char_p, []),
    "kvx_publish": (c_int, [_client_p, POINTER(PublishArgs)]),
    "kvx_publish_key": (c_int, [_client_p, c_char_p, c_size_t, c_uint32,
                                c_void_p, c_uint32, c_uint32, c_char_p,
                                c_size_t, POINTER(ContextParams), c_int]),
    "kvx_fetch_key": (c_int, [_client_p, c_char_p, c_size_t, c_char_p,
                              c_size_t, c_uint32, c_void_p, c_uint32,
                              c_uint32, c_uint32, c_int]),
    "kvx_cancel_key": (c_int, [_client_p, c_char_p, c_size_t, c_int]),
    "kvx_publish_groups": (c_int, [_client_p, c_char_p, c_size_t, c_uint32,
                                   c_void_p, c_uint32, c_uint32,
                                   POINTER(Group), c_uint32, c_char_p,
                                   c_size_t, c_int, POINTER(ContextParams),
                                   c_int]),
    "kvx_group_tokens_ready": (c_int, [_client_p, c_char_p, c_size_t,
                                       c_uint32, c_uint32, c_uint32,
                                       c_uint32, c_char_p, c_int]),
    "kvx_fetch_by_key_groups": (c_int, [_client_p, c_char_p, c_size_t,
                                        c_char_p, c_char_p, c_char_p,
                                        c_size_t, c_uint32, c_void_p,
                                        c_uint32, c_uint32, c_uint32,
                                        POINTER(Group), c_uint32, c_int]),
    "kvx_publish_many": (c_int, [_client_p, POINTER(PublishItem), c_size_t,
                                 c_int]),
    "kvx_fetch_many": (c_int, [_client_p, POINTER(FetchItem), c_size_t,
                               c_int]),
    "kvx_fetch_groups": (c_int, [_client_p, c_char_p, c_size_t, c_char_p,
                                 c_size_t, c_uint32, c_void_p, c_uint32,
                                 c_uint32, c_uint32, POINTER(Group), c_uint32,
                                 c_int]),
    "kvx_publish_layerwise": (c_int, [_client_p, c_char_p, c_size_t,
                                      c_uint32, c_void_p, c_uint32, c_uint32,
                                      c_char_p, c_size_t,
                                      POINTER(ContextParams), c_int]),
    "kvx_layers_ready": (c_int, [_client_p, c_char_p, c_size_t, c_uint32,
                                 c_uint32, c_char_p, c_int]),
    "kvx_tokens_ready": (c_int, [_client_p, c_char_p, c_size_t, c_uint32,
                                 c_uint32, c_uint32, c_char_p, c_int]),
    "kvx_append_blocks": (c_int, [_client_p, c_char_p, c_size_t, c_uint32,
                                  c_void_p, c_uint32, c_int]),
    "kvx_fetch_progress": (c_int, [_client_p, c_char_p, c_size_t,
                                   POINTER(c_uint32), POINTER(c_uint32),
                                   POINTER(c_int), c_int]),
    "kvx_group_fetch_progress": (c_int, [_client_p, c_char_p, c_size_t,
                                         c_uint32, POINTER(c_uint32),
                                         POINTER(c_uint32), POINTER(c_int),
                                         c_int]),
    "kvx_reserve": (c_int, [_client_p, POINTER(ReserveArgs)]),
    "kvx_ready": (c_int, [_client_p, POINTER(ReadyArgs)]),
    "kvx_progress": (c_int, [_client_p, POINTER(ProgressArgs)]),
    "kvx_reserve_groups": (c_int, [_client_p, c_char_p, c_char_p, c_size_t,
                                   c_uint32, c_uint32, POINTER(Group),
                                   c_uint32, POINTER(ContextParams), c_int]),
    "kvx_fetch_by_key": (c_int, [_client_p, c_char_p, c_size_t, c_char_p,
                                 c_char_p, c_char_p, c_size_t, c_uint32,
                                 c_void_p, c_uint32, c_uint32, c_uint32,
                                 c_int]),
    "kvx_join_consumers": (c_int, [_client_p, POINTER(c_char_p), c_uint32,
                                   POINTER(c_char_p), c_uint32, c_int]),
    "kvx_release_by_key": (c_int, [_client_p, c_char_p, c_char_p, c_char_p,
                                   c_size_t, c_int]),
    "kvx_fetch": (c_int, [_client_p, POINTER(FetchArgs)]),
    "kvx_fetch_dp": (c_int, [_client_p, c_uint64, c_char_p, c_size_t,
                             c_uint32, c_void_p, c_uint32, c_uint32,
                             c_uint32, c_int]),
    "kvx_poll": (c_int, [_client_p, c_uint32, c_int,
                         POINTER(POINTER(Batch))]),
    "kvx_batch_free": (None, [POINTER(Batch)]),
    "kvx_cancel": (c_int, [_client_p, c_uint64, c_int]),
    "kvx_release": (c_int, [_client_p, c_char_p, c_size_t, c_int]),
    "kvx_params_info": (c_int, [c_char_p, c_size_t, POINTER(ParamsInfo)]),
    "kvx_params_lease": (c_int, [c_char_p, c_size_t, POINTER(c_uint32)]),
    "kvx_renew": (c_int, [_client_p, POINTER(RenewArgs)]),
    "kvx_gpu_pace": (c_int, [_client_p, c_uint64, c_uint32, c_int]),  # 3.2
    # the JSON is malloc'd: kept as a void pointer so that it can be freed
    "kvx_status_json": (c_int, [_client_p, POINTER(c_void_p), c_int]),
    "kvx_requests_json": (c_int, [_client_p, POINTER(c_void_p), c_int]),
}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None
_libc: Optional[ctypes.CDLL] = None


class LibraryNotFound(ImportError):
    """libkvxfer.so.2 could not be found or loaded (see ``candidates()``)."""


def candidates() -> List[str]:
    """Where the library is looked for, in order (see docs/python.md)."""
    out = []
    env = os.environ.get("KVXFER_LIB")
    if env:
        out.append(env)
    out.append(os.path.join(_BUNDLE_DIR, SONAME))
    # running from the source tree: python/kvxfer -> ../../build
    repo = os.path.dirname(os.path.dirname(_PKG_DIR))
    build = os.environ.get("KVX_BUILD", "build")
    out.append(os.path.join(repo, build, SONAME))
    found = ctypes.util.find_library("kvxfer")
    if found:
        out.append(found)
    out.append(SONAME)  # the dynamic loader's own search (ld.so.cache, ...)
    return out


def _preload_bundled() -> None:
    """Load the libraries a wheel bundles beside libkvxfer (libprotobuf-c),
    so that its DT_NEEDED entries resolve to them by soname. One may need
    another: load what loads, again, until nothing more does."""
    if not os.path.isdir(_BUNDLE_DIR):
        return
    left = [os.path.join(_BUNDLE_DIR, n) for n in sorted(os.listdir(_BUNDLE_DIR))
            if ".so" in n and not n.startswith("libkvxfer")]
    while left:
        failed = []
        for p in left:
            try:
                ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(p)
        if len(failed) == len(left):
            return  # loading libkvxfer will name what is missing
        left = failed


def _declare(dll: ctypes.CDLL) -> None:
    for name, (res, args) in _PROTOS.items():
        fn = getattr(dll, name)
        fn.restype = res
        fn.argtypes = args


def lib() -> ctypes.CDLL:
    """The loaded libkvxfer (loaded on first use)."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for cand in candidates():
            if os.sep in cand and not os.path.exists(cand):
                continue
            try:
                if cand.startswith(_BUNDLE_DIR):
                    _preload_bundled()
                dll = ctypes.CDLL(cand)
                _declare(dll)
            except (OSError, AttributeError) as e:
                errors.append(f"{cand}: {e}")
                continue
            _lib, _path = dll, cand
            return dll
        raise LibraryNotFound(
            "libkvxfer.so.2 not found; looked at: "
            + "; ".join(errors or candidates())
            + " (set KVXFER_LIB to its path, build it with make, or install "
            "the kvxfer wheel that bundles it)")


def path() -> str:
    """File name the library was loaded from."""
    lib()
    assert _path is not None
    return _path


def free(ptr: int) -> None:
    """free() for memory the library malloc'd and hands over (JSON)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None)
        _libc.free.argtypes = [c_void_p]
        _libc.free.restype = None
    _libc.free(ptr)
