"""Range checks for what the package hands libkvxfer through ctypes.

ctypes converts a Python int to a C integer modulo the type's width, and
says nothing: ``num_tokens=2**32 + 16`` reaches the daemon as 16, and -1
as 4294967295. Every integer (and every timeout) the package passes to
the library goes through one of these first, so that a value the C type
cannot hold raises :class:`InvalidArgument` naming the argument, the
value and the range, before anything is sent. The values the type holds
but the call refuses are the library's and the daemon's to name.

The client, layouts and memory use them; nothing here is public.
"""

from __future__ import annotations

import array
import ctypes
import math
import numbers
import operator
from typing import Any, Tuple

from .errors import InvalidArgument

U32_MAX = 2**32 - 1  # uint32_t: token, layer and block counts, ids
U64_MAX = 2**64 - 1  # uint64_t: byte sizes, offsets, strides, pointers
INT_MAX = 2**31 - 1  # int: file descriptors, timeout_ms


def _is_bool(value: Any) -> bool:
    # numpy's bool is no int (no __index__), but says so less clearly
    t = type(value)
    return isinstance(value, bool) or (
        t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"))


def integer(name: str, value: Any, hi: int = U32_MAX, lo: int = 0) -> int:
    """``value`` as an int in ``lo..hi`` (default: a uint32_t) for the C
    argument ``name``: an int, or an integer scalar of numpy or torch
    (anything with ``__index__``). A bool, a float (even ``40.0``: a
    count computed by a division is a bug whether or not it divides) or a
    value outside the range raises InvalidArgument."""
    v = None
    if not _is_bool(value):
        try:
            v = operator.index(value)
        except TypeError:
            pass
    if v is None:
        raise InvalidArgument(
            -1, f"{name}: {value!r} ({type(value).__name__}) is not an "
            f"integer; expected an int in {lo}..{hi}")
    if not lo <= v <= hi:
        raise InvalidArgument(
            -1, f"{name}: {v} is out of range; expected an int in "
            f"{lo}..{hi}")
    return v


def timeout_ms(name: str, seconds: Any, zero: bool = False) -> int:
    """A timeout in seconds as the library's ``int timeout_ms``: None is
    -1 (no deadline); a positive time rounds to the nearest millisecond,
    at least 1; 0 only where ``zero`` (poll: now). NaN, infinities,
    negative times, bools, non-numbers and more than INT_MAX ms (about
    24.8 days) raise InvalidArgument (None is how to wait forever)."""
    if seconds is None:
        return -1
    most = INT_MAX / 1000
    expect = (f"expected seconds {'>= 0' if zero else '> 0'} and at most "
              f"{most}, or None (no deadline)")
    if _is_bool(seconds) or not isinstance(seconds, numbers.Real):
        raise InvalidArgument(-1, f"{name}: {seconds!r} "
                              f"({type(seconds).__name__}) is not a number;"
                              f" {expect}")
    t = float(seconds)
    if not (t > 0 or (zero and t == 0)) or math.isinf(t):
        raise InvalidArgument(-1, f"{name}: {seconds!r} is out of range; "
                              f"{expect}")
    if t == 0:
        return 0
    ms = max(1, int(round(t * 1000)))
    if ms > INT_MAX:
        raise InvalidArgument(-1, f"{name}: {seconds!r} is out of range; "
                              f"{expect}")
    return ms


def u32_array(name: str, values: Any) -> Tuple[Any, int, Any]:
    """``(pointer, count, keep-alive)`` of ``values`` as a uint32_t array
    (block ids, layers per PP rank): a 1-d numpy integer array, a CPU
    tensor, or any sequence of ints (:func:`integer`'s). An element that
    is not an integer or lies outside 0..U32_MAX raises InvalidArgument
    naming it (``blocks[3]: -1 is out of range ...``); nothing is cast."""
    if hasattr(values, "__array_interface__"):
        import numpy as np
        a = np.asarray(values)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise InvalidArgument(
                -1, f"{name}: a {a.ndim}-d {a.dtype} array; expected a 1-d "
                f"integer array of values in 0..{U32_MAX}")
        if a.size and (int(a.min()) < 0 or int(a.max()) > U32_MAX):
            for i, v in enumerate(a.tolist()):
                integer(f"{name}[{i}]", v)
        a = np.ascontiguousarray(a, dtype=np.uint32)
        return ctypes.c_void_p(a.ctypes.data), int(a.size), a
    if hasattr(values, "tolist"):  # torch tensors, array.array, ...
        values = values.tolist()
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument(-1, f"{name}: {type(values).__name__}; "
                              "expected a sequence of ints")
    try:
        vals = values if isinstance(values, (list, tuple)) else list(values)
    except TypeError:
        raise InvalidArgument(-1, f"{name}: {type(values).__name__} is not "
                              "a sequence of ints") from None
    arr = None
    if not any(type(v) is not int for v in vals):
        try:
            arr = array.array("I", vals)
        except OverflowError:
            pass
    if arr is None:  # numpy or torch scalars, or one is wrong: say which
        arr = array.array("I", [integer(f"{name}[{i}]", v)
                                for i, v in enumerate(vals)])
    assert arr.itemsize == 4
    ptr, n = arr.buffer_info()
    return ctypes.c_void_p(ptr), n, arr
