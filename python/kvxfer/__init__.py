"""kvxfer: move LLM KV cache between inference instances through kvxferd.

Pure Python over ``libkvxfer.so.1`` (ctypes; no compiler needed). The
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

from ._version import __version__
from .client import (DEFAULT_SOCKET, Batch, Client, Event, EventKind,
                     HostPool, Parallel, Pool, Role)
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
    "status_str", "LibraryNotFound",
]


def version() -> str:
    """kvxfer's version (kvxfer.h's KVX_VERSION_STRING). Loads the library
    first, so that it fails (LibraryNotFound) where calls would."""
    from . import _lib as lib
    lib.lib()
    return __version__


def library_path() -> str:
    """The file libkvxfer was loaded from."""
    from . import _lib as lib
    return lib.path()
