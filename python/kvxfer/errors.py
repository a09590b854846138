"""kvx_status_t codes as exceptions.

Every call that fails raises a subclass of :class:`Error` chosen by the
code, carrying the daemon's message (``kvx_last_error``), which names the
field at fault. The codes are the daemon's own: a refused request raises
exactly the class of the code the daemon saw.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "Error", "InvalidArgument", "NoMemory", "IOFailure", "CallTimeout",
    "ProtocolError", "VersionMismatch", "PermissionDenied", "NotFound",
    "AlreadyExists", "StateError", "AuthError", "Cancelled", "TimedOut",
    "PeerGone", "Unsupported", "LimitReached", "ShuttingDown",
    "LayoutError", "ConfigMismatch", "Closed", "Busy", "error_class",
    "status_name", "status_str",
]


class Error(Exception):
    """A kvxfer call failed.

    Attributes:
        code: the kvx_status_t code (negative int).
        name: its short identifier, as kvx_status_name() (``"AUTH"``).
        message: the daemon's (or library's) message, may be ``""``.
    """

    code: int = 0  # set on the subclasses; instances carry the real one
    name: str = "UNKNOWN"

    def __init__(self, code: int, message: str = "") -> None:
        self.code = code
        self.name = status_name(code)
        self.message = message
        super().__init__(code, message)

    def __str__(self) -> str:
        text = self.message or status_str(self.code)
        return f"{self.name}: {text}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code}, {self.message!r})"


class InvalidArgument(Error, ValueError):
    """KVX_ERR_INVALID (-1): a field or argument is invalid."""

    code = -1
    name = "INVALID"


class NoMemory(Error):
    """KVX_ERR_NOMEM (-2): out of memory."""

    code = -2
    name = "NOMEM"


class IOFailure(Error):
    """KVX_ERR_IO (-3): socket or system call failed."""

    code = -3
    name = "IO"


class CallTimeout(Error):
    """KVX_ERR_TIMEOUT (-4): the call's own timeout passed."""

    code = -4
    name = "TIMEOUT"


class ProtocolError(Error):
    """KVX_ERR_PROTOCOL (-5): malformed or oversized frame."""

    code = -5
    name = "PROTOCOL"


class VersionMismatch(Error):
    """KVX_ERR_VERSION (-6): protocol major version differs."""

    code = -6
    name = "VERSION"


class PermissionDenied(Error):
    """KVX_ERR_PERM (-7): peer not allowed by uid/gid lists."""

    code = -7
    name = "PERM"


class NotFound(Error, LookupError):
    """KVX_ERR_NOT_FOUND (-8): unknown request, pool or instance."""

    code = -8
    name = "NOT_FOUND"


class AlreadyExists(Error):
    """KVX_ERR_EXISTS (-9): already published/fetched/registered."""

    code = -9
    name = "EXISTS"


class StateError(Error):
    """KVX_ERR_STATE (-10): not allowed in this state."""

    code = -10
    name = "STATE"


class AuthError(Error):
    """KVX_ERR_AUTH (-11): capability token does not match."""

    code = -11
    name = "AUTH"


class Cancelled(Error):
    """KVX_ERR_CANCELLED (-12): request was cancelled."""

    code = -12
    name = "CANCELLED"


class TimedOut(Error):
    """KVX_ERR_TIMED_OUT (-13): a daemon deadline (lease, fetch) expired."""

    code = -13
    name = "TIMED_OUT"


class PeerGone(Error):
    """KVX_ERR_PEER_GONE (-14): the other side disconnected."""

    code = -14
    name = "PEER_GONE"


class Unsupported(Error):
    """KVX_ERR_UNSUPPORTED (-15): not available in this build/config."""

    code = -15
    name = "UNSUPPORTED"


class LimitReached(Error):
    """KVX_ERR_LIMIT (-16): a configured limit was reached."""

    code = -16
    name = "LIMIT"


class ShuttingDown(Error):
    """KVX_ERR_SHUTDOWN (-17): the daemon is draining."""

    code = -17
    name = "SHUTDOWN"


class LayoutError(Error):
    """KVX_ERR_LAYOUT (-18): layout invalid or does not fit the pool."""

    code = -18
    name = "LAYOUT"


class ConfigMismatch(Error):
    """KVX_ERR_MISMATCH (-19): the two sides' configurations differ."""

    code = -19
    name = "MISMATCH"


class Closed(Error):
    """KVX_ERR_CLOSED (-20): the connection is closed."""

    code = -20
    name = "CLOSED"


class Busy(Error):
    """KVX_ERR_BUSY (-21): resource in use."""

    code = -21
    name = "BUSY"


_BY_CODE: Dict[int, Type[Error]] = {
    c.code: c for c in Error.__subclasses__()}
_NAMES: Dict[int, str] = {0: "OK"}
_NAMES.update((c, k.name) for c, k in _BY_CODE.items())


def error_class(code: int) -> Type[Error]:
    """The exception class of a kvx_status_t code (``Error`` if unknown)."""
    return _BY_CODE.get(code, Error)


def status_name(code: int) -> str:
    """kvx_status_name(): ``"AUTH"`` for -11, ``"UNKNOWN"`` if unknown."""
    return _NAMES.get(code, "UNKNOWN")


def status_str(code: int) -> str:
    """kvx_status_str(): the library's text for a code."""
    from . import _lib
    try:
        s = _lib.lib().kvx_status_str(code)
    except ImportError:
        return status_name(code).lower()
    return s.decode() if s else ""


def make_error(code: int, message: Optional[str]) -> Error:
    """An instance of the right class for code."""
    return error_class(code)(code, message or "")
