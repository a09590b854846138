"""What the classes of kvxfer.sglang share: settings, the error SGLang
sees, the KV buffers as a kvxfer pool, the aux rows."""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.base.conn import KVArgs

from .._pace import HOLD_MS, pace_config
from ..errors import InvalidArgument, Unsupported
from ..layout import DType, Layout
from ..memory import host_buffer_of, span_of

SGLANG_VERSION = "0.5.23"  # the base classes this backend was written for

log = logging.getLogger("kvxfer.sglang")

_AUX_MAGIC = b"KVXS"
_AUX_VERSION = 1
_PUMP_INTERVAL = 0.0005  # seconds between two polls of the daemon


def end_key(key: bytes) -> bytes:
    """The key of a room's end offer (sender.py): the room's, then
    ``.end`` (a room's key is its decimal digits, so none is another's)."""
    return key + b".end"


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _env_int(name: str, default: int) -> Any:
    """An integer environment variable: its value, ``default`` when unset
    or empty, the string itself when it is no integer (for the refusal
    to show)."""
    given = os.environ.get(name)
    if not given:
        return default
    try:
        return int(given)
    except ValueError:
        return given


GPU_PACE = "KVXFER_SGLANG_GPU_PACE"
GPU_PACE_HOLD = "KVXFER_SGLANG_GPU_PACE_HOLD_MS"


def _gpu_pace() -> Tuple[int, int]:
    """(bytes a millisecond, hold in ms) of the rank's GPU pace from
    KVXFER_SGLANG_GPU_PACE (0 or unset: none) and
    KVXFER_SGLANG_GPU_PACE_HOLD_MS; raises InvalidArgument naming the
    variable (kvxfer/_pace.py)."""
    return pace_config(_env_int(GPU_PACE, 0),
                       _env_int(GPU_PACE_HOLD, HOLD_MS),
                       (GPU_PACE, GPU_PACE_HOLD))


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

