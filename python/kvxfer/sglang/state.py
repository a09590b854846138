"""SGLang's state beside the KV (``KVArgs.state_types``) as kvxfer block
tables of their own.

**Mamba**: state slots.

A Mamba (SSM) model keeps, beside its KV pages, a fixed-size state per
request: its conv and temporal states, one slot of each state tensor
(``KVArgs.state_types`` MAMBA, ``state_data_ptrs`` / ``state_item_lens``,
the slot in the request's ``state_indices``). Each set of state tensors
with one slot size is a pool of one-token blocks here, a block per slot,
a layer per tensor, and moves as a state slot (``kvxfer.Group.state``)
with the request's KV, under its lease, fence and terminal event.

A slot's bytes are this rank's TP share of the state, laid out as
SGLang's pools lay it; between two attention TP sizes SGLang reslices
each tensor along its own axis (``state_dim_per_tensor``), which a
kvxfer head range does not describe, so the state moves between equal
attention TP sizes only (the receiver refuses others by name).

**SWA**: a hybrid model's sliding-window layers keep their KV in a pool
of their own (``SWAKVPool``'s MHA sub-pool: its buffers as the KV's, K of
every layer then V, pages of ``page_size`` tokens), and a request sends
only the pages of its window (``state_indices``: the window's pages, from
the window's first page to the last). Here that pool is a KV table of
the request whose blocks start at the window (``kvxfer.Group`` with
``first_block``; the decode skips the tokens before its own window):
heads split over TP as the KV's do, so any two TP sizes work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from ..errors import InvalidArgument, Unsupported
from ..layout import DType, Layout
from .common import _geometry

_MAX_UNIT = 65536  # bytes of one "head": kvxfer's head_dim limit


@dataclass
class StatePool:
    """One pool of state slots: tensors of one slot size of one type."""

    state: int  # index in KVArgs.state_types
    layout: Layout
    regions: List[Tuple[int, int]]  # (ptr, nbytes), the layout's order
    window: bool = False  # SWA: a KV table from the window on


def _unit(item: int) -> int:
    """The largest divisor of ``item`` of at most _MAX_UNIT bytes."""
    for d in range(min(item, _MAX_UNIT), 0, -1):
        if item % d == 0:
            return d
    return 1


def state_pools(args: KVArgs) -> List[StatePool]:
    """The pools of ``args``'s state types; Unsupported for a type that
    is not a state slot (SWA, DSA, ... are KV of their own)."""
    types = list(getattr(args, "state_types", None) or [])
    ptrs = list(getattr(args, "state_data_ptrs", None) or [])
    lens = list(getattr(args, "state_data_lens", None) or [])
    items = list(getattr(args, "state_item_lens", None) or [])
    out: List[StatePool] = []
    for i, st in enumerate(types):
        name = str(getattr(st, "value", st))
        if st == StateType.SWA:
            out.append(_window_pool(args, i, ptrs, lens, items))
            continue
        if st != StateType.MAMBA:
            raise Unsupported(
                -15, f"kvxfer.sglang: state_types[{i}] {name} is not "
                "supported yet (Mamba slots and SWA windows are): "
                "docs/engines/sglang.md")
        if not (i < len(ptrs) and i < len(lens) and i < len(items)) or \
                not len(ptrs[i]) == len(lens[i]) == len(items[i]) or \
                not ptrs[i]:
            raise InvalidArgument(
                -1, f"kvxfer.sglang: state {i} ({name}): state_data_ptrs, "
                "state_data_lens and state_item_lens must give one "
                "non-empty list each, of one length")
        by_size: dict = {}
        for j, (p, n, it) in enumerate(zip(ptrs[i], lens[i], items[i])):
            p, n, it = int(p), int(n), int(it)
            if it <= 0 or n < it:
                raise InvalidArgument(
                    -1, f"kvxfer.sglang: state {i} ({name}) tensor {j}: "
                    f"{n} bytes hold no slot of {it} bytes")
            by_size.setdefault(it, []).append((p, n))
        for item, regions in by_size.items():
            unit = _unit(item)
            slots = min(n for _, n in regions) // item
            layout = Layout.custom(
                name="sglang-state", num_layers=len(regions), kv_factor=1,
                num_heads=item // unit, head_dim=unit, dtype=DType.INT8,
                tokens_per_block=1, num_blocks=slots, kv_stride=0,
                block_stride=item, token_stride=item, head_stride=unit,
                parts=[(r, 0) for r in range(len(regions))])
            out.append(StatePool(i, layout, regions))
    return out


def _window_pool(args: KVArgs, i: int, ptrs: List[Any], lens: List[Any],
                 items: List[Any]) -> StatePool:
    """The SWA sub-pool as a KV pool (the KV's geometry)."""
    layout = getattr(args, "swa_kv_cache_layout", None)
    if layout != "nhd":
        raise Unsupported(
            -15, f"kvxfer.sglang: state_types[{i}] swa in a "
            f"{layout or 'non-MHA'} layout (swa_kv_cache_layout): only an "
            "MHA sub-pool of NHD pages is supported")
    if not (i < len(ptrs) and i < len(lens) and i < len(items)):
        raise InvalidArgument(-1, f"kvxfer.sglang: state {i} (swa): no "
                              "state_data_ptrs, state_data_lens or "
                              "state_item_lens")
    view = _SubPool(args, ptrs[i], lens[i], items[i])
    try:
        geo = _geometry(view, False)  # type: ignore[arg-type]
    except InvalidArgument as e:
        raise InvalidArgument(e.code, f"state {i} (swa): {e.message}"
                              ) from None
    return StatePool(i, geo.layout, geo.regions, window=True)


class _SubPool:
    """A KVArgs whose KV buffers are a state's (_geometry reads these)."""

    def __init__(self, args: KVArgs, ptrs: Any, lens: Any,
                 items: Any) -> None:
        self.kv_data_ptrs, self.kv_data_lens = list(ptrs), list(lens)
        self.kv_item_lens = list(items)
        self.kv_head_num = getattr(args, "kv_head_num", 0)
        self.total_kv_head_num = getattr(args, "total_kv_head_num", 0)
        self.page_size = args.page_size
        self.kv_cache_dtype_str = getattr(args, "kv_cache_dtype_str", None)
        self.num_draft_entries = 0


def indices_of(state_indices: Optional[Sequence[Any]],
               pools: Sequence[StatePool], num_states: int
               ) -> List[List[int]]:
    """Each state type's indices, flat, from SGLang's ``state_indices``
    (per type: a Mamba slot, or a list holding an array of one; an SWA
    window's pages). Raises ValueError naming what is wrong."""
    given = list(state_indices or [])
    if len(given) != num_states:
        raise ValueError(f"state_indices: {len(given)} entries for "
                         f"{num_states} state types")
    out = [_flat(s) for s in given]
    for sp in pools:
        n = len(out[sp.state])
        if not sp.window and n != 1:
            raise ValueError(f"state_indices[{sp.state}]: {n} slots (a "
                             "state slot type has one per request)")
        if sp.window and n == 0:
            raise ValueError(f"state_indices[{sp.state}]: no page of the "
                             "sliding window")
    return out


def _flat(s: Any) -> List[int]:
    flat: List[int] = []
    stack = [s]
    while stack:
        x = stack.pop()
        if x is None:
            continue
        if hasattr(x, "cpu"):
            x = x.cpu().numpy()
        if hasattr(x, "tolist"):
            x = x.tolist()
        if isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        else:
            flat.append(int(x))
    return flat
