"""kvxfer: move LLM KV cache between inference instances through kvxferd.

Pure Python over ``libkvxfer.so.2`` (ctypes; no compiler needed). The
library is found in this order: ``$KVXFER_LIB``, ``kvxfer/_libs/`` (the
wheel bundles it there), the source tree's ``build/``, then the system's
(see docs/python.md).

    import kvxfer
    with kvxfer.Client(instance_id="prefill-0", role="context",
                       parallel=kvxfer.Parallel(total_layers=32,
                                                total_kv_heads=8)) as c:
        c.join([c.daemon_address])
        layout = kvxfer.Layout.preset("vllm-nhd", num_layers=32,
                                      num_heads=8, head_dim=128,
                                      dtype="bf16", tokens_per_block=16,
                                      num_blocks=1024)
        pool = c.create_host_pool(layout)
        params = c.publish(7, pool, [0, 1, 2], num_tokens=40)
"""

import dataclasses

from ._version import __version__
from .client import (DEFAULT_SOCKET, MAX_KEY, Batch, Client, ClientState,
                     ClientStatus, Event, EventKind, Group, HostPool, Key,
                     Parallel, Pool, Role, key_bytes)
from .errors import (AlreadyExists, AuthError, Busy, CallTimeout, Cancelled,
                     Closed, ConfigMismatch, Error, InvalidArgument,
                     IOFailure, LayoutError, LimitReached, NoMemory,
                     NotFound, PeerGone, PermissionDenied, ProtocolError,
                     ShuttingDown, StateError, TimedOut, Unsupported,
                     VersionMismatch, error_class, status_name, status_str)
from .layout import PRESETS, DType, Layout
from .memory import HostBuffer
from ._lib import LibraryNotFound

__all__ = [
    "__version__", "version", "library_path", "DEFAULT_SOCKET", "Client",
    "Role", "Parallel", "Pool", "HostPool", "HostBuffer", "Layout", "DType",
    "PRESETS", "Event", "EventKind", "Batch", "Error", "InvalidArgument",
    "NoMemory", "IOFailure", "CallTimeout", "ProtocolError",
    "VersionMismatch", "PermissionDenied", "NotFound", "AlreadyExists",
    "StateError", "AuthError", "Cancelled", "TimedOut", "PeerGone",
    "Unsupported", "LimitReached", "ShuttingDown", "LayoutError",
    "ConfigMismatch", "Closed", "Busy", "error_class", "status_name",
    "status_str", "LibraryNotFound", "ParamsInfo", "params_info", "Key",
    "MAX_KEY", "key_bytes", "Group", "ClientStatus", "ClientState",
]


def version() -> str:
    """The loaded libkvxfer's version (kvx_version(), 3.0), which may be
    newer than this package's ``__version__`` (the kvxfer.h it binds).
    Loads the library first, so that it fails (LibraryNotFound) where
    calls would."""
    from . import _lib as lib
    return lib.lib().kvx_version().decode()


@dataclasses.dataclass(frozen=True)
class ParamsInfo:
    """What a context params blob says (kvx_params_info). A generation rank
    with ``tokens_per_block`` T fetches into ceil(num_tokens / T) blocks."""

    instance_id: str
    request_id: int  # the key's int form (its decimal digits); 0 if none
    num_tokens: int
    tokens_per_block: int
    context_ranks: int
    num_layers: int
    num_kv_heads: int
    rank0_address: str
    key: bytes = b""  # the context side's request key
    # the offer's lease, ms (kvx_params_lease, 2.6): renew it (see
    # Client.renew) before it runs out; 0 for params of an older daemon
    lease_ms: int = 0

    def blocks_for(self, tokens_per_block: int) -> int:
        """The blocks a rank with ``tokens_per_block`` fetches into."""
        return -(-self.num_tokens // tokens_per_block)


def params_info(params: bytes) -> ParamsInfo:
    """Decode context params (kvx_params_info); raises
    :class:`InvalidArgument` naming what is wrong with them."""
    import ctypes
    from . import _lib as lib
    from .errors import make_error
    params = bytes(params)
    out = lib.ParamsInfo()
    rc = lib.lib().kvx_params_info(params, len(params), ctypes.byref(out))
    if rc:
        msg = lib.lib().kvx_last_error(None)
        raise make_error(rc, msg.decode(errors="replace") if msg else "")
    lease = ctypes.c_uint32(0)
    rc = lib.lib().kvx_params_lease(params, len(params), ctypes.byref(lease))
    if rc:
        msg = lib.lib().kvx_last_error(None)
        raise make_error(rc, msg.decode(errors="replace") if msg else "")
    return ParamsInfo(
        lease_ms=int(lease.value),
        instance_id=out.instance_id.decode(errors="replace"),
        request_id=int(out.request_id), num_tokens=int(out.num_tokens),
        tokens_per_block=int(out.tokens_per_block),
        context_ranks=int(out.context_ranks),
        num_layers=int(out.num_layers), num_kv_heads=int(out.num_kv_heads),
        rank0_address=out.rank0_address.decode(errors="replace"),
        key=bytes(out.key[: out.key_len]))


def library_path() -> str:
    """The file libkvxfer was loaded from."""
    from . import _lib as lib
    return lib.path()
