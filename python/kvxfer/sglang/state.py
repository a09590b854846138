"""SGLang's per-request state beside the KV as kvxfer state slots.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from ..errors import InvalidArgument, Unsupported
from ..layout import DType, Layout

_MAX_UNIT = 65536  # bytes of one "head": kvxfer's head_dim limit


@dataclass
class StatePool:
    """One pool of state slots: tensors of one slot size of one type."""

    state: int  # index in KVArgs.state_types
    layout: Layout
    regions: List[Tuple[int, int]]  # (ptr, nbytes) per tensor


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
        if st != StateType.MAMBA:
            raise Unsupported(
                -15, f"kvxfer.sglang: state_types[{i}] {name} is not "
                "supported yet (Mamba state slots are; SWA, DSA and the "
                "others are KV tables of their own): "
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


def slots_of(state_indices: Optional[Sequence[Any]],
             num_states: int) -> List[int]:
    """The request's slot of each state type, from SGLang's
    ``state_indices`` (per type: the slot, or a list holding an array of
    one slot, as decode.py and prefill.py give a Mamba slot). Raises
    ValueError naming what is wrong."""
    given = list(state_indices or [])
    if len(given) != num_states:
        raise ValueError(f"state_indices: {len(given)} entries for "
                         f"{num_states} state types")
    out = []
    for i, s in enumerate(given):
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
        if len(flat) != 1:
            raise ValueError(f"state_indices[{i}]: {len(flat)} slots (a "
                             "state slot type has one per request)")
        out.append(flat[0])
    return out
