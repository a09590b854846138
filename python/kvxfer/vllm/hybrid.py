"""Hybrid models (vLLM's hybrid memory allocator): a request's KV cache
groups as kvxfer block tables.

vLLM gives a hybrid model's request one block table per KV cache group
(full attention, sliding window, Mamba state). kvxfer carries them as one
request: the first full-attention group is the plain table (the pool
registered as before), every other group one more table (a
:class:`kvxfer.Group`) in a pool of its own layout, over the same memory
(vLLM's groups overlay one allocation; a block id belongs to one group at
a time). The request keeps one offer, one lease, one fence and one
terminal event (docs/protocol.md, "Several block tables").

- A sliding-window group offers only the blocks its window keeps: those
  holding the tokens from ``num_tokens - 1 - num_retained_tokens`` on,
  the ones the decode reads when it computes the last prompt token (its
  ``first_block``; the blocks below were freed by vLLM already).
- A Mamba group is moved as state slots: pools of one-token blocks, a
  block being a request's state page, the request's state block as the
  one block; with vLLM's DS conv layout one table per conv
  sub-projection and one for the SSM state, whose units (channels,
  heads) follow kvxfer's TP rule (:func:`state_parts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

import kvxfer

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0  # vLLM's BlockPool keeps block 0 as its null block
MAX_TABLES = 8  # KVX_MAX_GROUPS: block tables of a request, the first too
FULL, WINDOW, STATE = "full", "window", "state"


@dataclass
class Table:
    """One more block table of a request, as the scheduler sends it to
    the workers: table k + 1 is the worker's pool k + 1."""

    blocks: List[int]
    num_tokens: int
    first_block: int = 0
    skip_tokens: int = 0


@dataclass
class _Part:
    """The part of a Mamba state page one table moves: bytes from
    offset, units (what TP splits: channels of a conv sub-projection,
    heads of the temporal state) of unit_elems elements of dtype."""

    offset: int
    units: int
    unit_elems: int
    dtype: Any


@dataclass
class _Group:
    gid: int  # the index in kv_cache_config.kv_cache_groups
    kind: str
    spec: Any
    layer_names: List[str]
    part: Optional[_Part] = None  # STATE: the page's part of this table


def state_parts(spec: Any, tp: int) -> List[_Part]:
    """How a Mamba group's state page splits into tables whose units
    follow kvxfer's TP rule (a rank's units are one range of the
    model's): with vLLM's DS conv state layout ((channels, kernel - 1)),
    one table per conv sub-projection (Mamba1: x; Mamba2: x, B, C; GDN:
    Q, K, V), its channels as units, as vLLM's own
    derive_mamba_conv_split decomposes them, and one for the temporal
    (SSM) state, its heads as units. Otherwise (the default SD layout,
    whose channels are not contiguous; other Mamba kinds; a state every
    TP rank holds whole): the page as one unit per rank, which moves
    between equal TP sizes only."""
    whole = [_Part(0, 1, int(spec.real_page_size_bytes), torch.int8)]
    if len(spec.shapes) != 2 or getattr(spec, "tp_replicated", False):
        return whole
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import \
            ssm_conv_transfer_utils as conv
        if not conv.is_conv_state_dim_first():
            return whole
        split = conv.derive_mamba_conv_split(spec, tp)
    except (ImportError, NotImplementedError, AssertionError):
        return whole
    rows = split.conv_rows
    parts = []
    off = 0
    for dim, nbytes in zip(split.local_proj_dims, split.proj_bytes):
        parts.append(_Part(off, dim, rows, spec.dtypes[0]))
        off += nbytes
    ssm = spec.shapes[1]
    unit = 1
    for x in ssm[1:]:
        unit *= x
    parts.append(_Part(off, ssm[0], unit, spec.dtypes[1]))
    return parts


def _kind(spec: Any) -> Optional[str]:
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec,
                                            SlidingWindowSpec)
    if isinstance(spec, SlidingWindowSpec):
        return WINDOW
    if isinstance(spec, FullAttentionSpec):
        return FULL
    if isinstance(spec, MambaSpec):
        return STATE
    return None


def _check_attention(gid: int, spec: Any) -> None:
    """Refuse an attention group whose page is not a token's K then V of
    head_size elements each (or MLA's one latent), naming the field:
    what layout_of_kv_caches would refuse at register_kv_caches."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec
    if not isinstance(spec, AttentionSpec):
        return
    at = f"kv_cache_groups[{gid}] ({type(spec).__name__})"
    for f in ("state_content_bytes", "num_head_slots"):
        if getattr(spec, f, None) is not None:
            raise kvxfer.Unsupported(
                -1, f"{at}.{f}: {getattr(spec, f)}; KvxferConnector moves "
                "pages of one K and one V per head and token")
    hv = getattr(spec, "head_size_v", spec.head_size)
    if not isinstance(spec, MLAAttentionSpec) and hv != spec.head_size:
        raise kvxfer.Unsupported(
            -1, f"{at}.head_size_v: {hv}, head_size {spec.head_size}; "
            "KvxferConnector moves K and V of one head size")


class Tables:
    """How a KVCacheConfig's groups map to a request's kvxfer block
    tables (one group: the plain table alone, as before hybrid models)."""

    def __init__(self, kv_cache_config: Optional["KVCacheConfig"],
                 tp: int = 1) -> None:
        self.groups: List[_Group] = []
        if kv_cache_config is None:
            return
        groups = [(gid, g) for gid, g in
                  enumerate(kv_cache_config.kv_cache_groups)
                  if getattr(g, "enable_kv_transfer", True)]
        for gid, g in groups:
            _check_attention(gid, g.kv_cache_spec)
        if len(groups) <= 1:
            return  # one table: the connector as before hybrid models
        for gid, g in groups:
            kind = _kind(g.kv_cache_spec)
            if kind is None:
                raise kvxfer.Unsupported(
                    -1, f"kv_cache_groups[{gid}]: "
                    f"{type(g.kv_cache_spec).__name__} layers "
                    f"({', '.join(g.layer_names[:3])}...): KvxferConnector "
                    "moves full attention, sliding window and Mamba groups "
                    "(or run with --disable-hybrid-kv-cache-manager)")
            if kind == STATE:
                for part in state_parts(g.kv_cache_spec, tp):
                    self.groups.append(_Group(gid, kind, g.kv_cache_spec,
                                              list(g.layer_names), part))
                continue
            self.groups.append(_Group(gid, kind, g.kv_cache_spec,
                                      list(g.layer_names)))
        full = [g for g in self.groups if g.kind == FULL]
        if not full:
            raise kvxfer.Unsupported(
                -1, "kv_cache_groups: no full attention group; "
                "KvxferConnector needs one as a request's first table")
        self.groups.remove(full[0])
        self.groups.insert(0, full[0])
        if len(self.groups) > MAX_TABLES:
            raise kvxfer.Unsupported(
                -1, f"kv_cache_groups: {len(self.groups)} block tables "
                "(a Mamba group's state: one per conv sub-projection and "
                f"one for the SSM state), kvxfer moves at most {MAX_TABLES}"
                " a request")

    @property
    def hybrid(self) -> bool:
        return bool(self.groups)

    @property
    def has_state(self) -> bool:
        return any(g.kind == STATE for g in self.groups)

    def truncate_for_prefill(self, request: Any) -> None:
        """A prefill of a model with Mamba state computes all prompt
        tokens but the last (as vLLM's NIXL connector does): its state
        is then the one the decode needs to compute that last token
        itself, which it must (vLLM recomputes the last prompt token of a
        fully loaded prompt, and a recurrent state cannot take a token
        twice). The decode loads the tokens the prefill computed."""
        p = request.kv_transfer_params
        if not self.has_state or not p or not p.get("do_remote_decode") \
                or p.get("_kvxfer_truncated"):
            return
        if request.prompt_token_ids is None or \
                request.num_prompt_tokens < 2:
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        p["_kvxfer_truncated"] = True

    def check_parallel(self, tp: int, total_kv_heads: int) -> None:
        """Refuse what kvxfer's rules for the other tables cannot say
        (docs/protocol.md, "The shape of the other tables"): a group's
        heads replicated over TP ranks."""
        for g in self.groups[1:]:
            if g.kind != STATE and tp > total_kv_heads:
                raise kvxfer.Unsupported(
                    -1, f"tensor_parallel_size {tp} > {total_kv_heads} KV "
                    f"heads: kv_cache_groups[{g.gid}]'s heads are "
                    "replicated over TP ranks, which kvxfer's other block "
                    "tables cannot say (run with "
                    "--disable-hybrid-kv-cache-manager)")

    # -- the scheduler: a request's tables -------------------------------

    def _window_first(self, g: _Group, n: int) -> int:
        """The first block of a sliding-window group the decode reads:
        the one holding token n - 1 - num_retained_tokens."""
        keep = g.spec.num_retained_tokens
        return max(0, n - 1 - keep) // g.spec.block_size

    def block_size(self, default: int) -> int:
        """Tokens per block of the plain table."""
        return self.groups[0].spec.block_size if self.hybrid else default

    def plain(self, block_ids: Sequence[Sequence[int]]) -> List[int]:
        """The plain table of a request's block ids (one list per KV cache
        group, vLLM's order)."""
        if not self.hybrid:
            return list(block_ids[0])
        return list(block_ids[self.groups[0].gid])

    def sends(self, block_ids: Sequence[Sequence[int]], n: int
              ) -> Optional[List[Table]]:
        """The other tables a prefill offers for n tokens; None when a
        group lacks blocks it should hold (nothing can be offered)."""
        out: List[Table] = []
        for g in self.groups[1:]:
            ids = list(block_ids[g.gid])
            if g.kind == STATE:
                slot = self._state_slot(ids)
                if slot is None:
                    return None
                out.append(Table([slot], 1))
                continue
            need = math.ceil(n / g.spec.block_size)
            first = self._window_first(g, n) if g.kind == WINDOW else 0
            blocks = ids[first:need]
            if len(blocks) != need - first or NULL_BLOCK in blocks:
                return None
            out.append(Table(blocks, n, first_block=first))
        return out

    def recvs(self, block_ids: Sequence[Sequence[int]], n: int, skip: int
              ) -> Optional[List[Table]]:
        """The destination of each other table of a decode loading tokens
        [skip, n); None when a group has no blocks for them."""
        out: List[Table] = []
        for g in self.groups[1:]:
            ids = list(block_ids[g.gid])
            if g.kind == STATE:
                slot = self._state_slot(ids)
                if slot is None:
                    return None
                out.append(Table([slot], 1))
                continue
            bs = g.spec.block_size
            need = math.ceil(n / bs)
            s = skip
            if g.kind == WINDOW:
                s = max(skip, self._window_first(g, n) * bs)
            first = s // bs
            blocks = ids[first:need]
            if len(blocks) != need - first or NULL_BLOCK in blocks:
                return None
            out.append(Table(blocks, 0, first_block=first, skip_tokens=s))
        return out

    @staticmethod
    def _state_slot(ids: List[int]) -> Optional[int]:
        """The block holding a request's Mamba state (mamba_cache_mode
        "none": its one block)."""
        real = [b for b in ids if b != NULL_BLOCK]
        return real[0] if len(real) == 1 else None

    def groups_of(self, pools: Sequence[Any], tables: Sequence[Table], *,
                  fetch: bool) -> List[kvxfer.Group]:
        """kvxfer.Groups of a request's other tables in pools[1:]."""
        out = []
        for pool, t in zip(pools[1:], tables):
            if fetch:
                out.append(kvxfer.Group(pool, t.blocks,
                                        first_block=t.first_block,
                                        skip_tokens=t.skip_tokens))
            else:
                out.append(kvxfer.Group(pool, t.blocks,
                                        num_tokens=t.num_tokens,
                                        first_block=t.first_block))
        return out

    def reserved(self, pools: Sequence[int], tables: Sequence[Table]
                 ) -> List[kvxfer.Group]:
        """The groups of a reservation: pools, tokens, no blocks."""
        return [kvxfer.Group(p, [], num_tokens=t.num_tokens,
                             first_block=t.first_block)
                for p, t in zip(pools[1:], tables)]

    # -- the worker: a pool per table ------------------------------------

    def layer_sets(self, kv_caches: Dict[str, torch.Tensor]
                   ) -> List[Tuple[_Group, Dict[str, torch.Tensor]]]:
        """Each table's group and its layers' caches on this worker."""
        out = []
        for g in self.groups:
            caches = {n: kv_caches[n] for n in g.layer_names
                      if n in kv_caches}
            if not caches:
                raise kvxfer.InvalidArgument(
                    -1, f"register_kv_caches: no cache of kv_cache_groups"
                    f"[{g.gid}]'s layers ({g.layer_names[:3]}...)")
            out.append((g, caches))
        return out


def state_layout(caches: Dict[str, torch.Tensor], spec: Any,
                 names: List[str], part: _Part
                 ) -> Tuple[kvxfer.Layout, List[torch.Tensor]]:
    """The layout of one part of a Mamba group's per-layer state pages as
    state slots: one-token blocks (a block is a request's page), the
    part's units as heads of unit_elems elements. vLLM 0.33 views a Mamba
    layer's cache as ``[blocks, 1, 1, page bytes]`` (int8) over the
    allocation the groups share; MambaBase packs the states in the page
    one after another."""
    first = caches[names[0]]
    if first.dim() != 4 or first.shape[1] != 1 or first.shape[2] != 1:
        raise kvxfer.Unsupported(
            -1, f"Mamba cache of {names[0]}: shape {tuple(first.shape)}; "
            "this connector knows vLLM 0.33's [blocks, 1, 1, bytes] views")
    content = int(spec.real_page_size_bytes)
    if first.element_size() != 1 or first.shape[3] < content:
        raise kvxfer.Unsupported(
            -1, f"Mamba cache of {names[0]}: {first.dtype} "
            f"{tuple(first.shape)}, expected the page's bytes (int8)")
    es = torch.tensor([], dtype=part.dtype).element_size()
    unit = part.unit_elems * es
    assert part.offset + part.units * unit <= content
    nb = first.shape[0]
    stride = first.stride()
    regions: List[torch.Tensor] = []
    bases: List[int] = []
    parts: List[Tuple[int, int]] = []
    for n in names:
        t = caches[n]
        if tuple(t.shape) != tuple(first.shape) or t.stride() != stride:
            raise kvxfer.Unsupported(
                -1, f"Mamba caches of {names[0]} and {n} differ in shape or "
                "strides")
        st = t.untyped_storage()
        base = st.data_ptr()
        if base not in bases:
            bases.append(base)
            regions.append(torch.empty(0, dtype=torch.uint8,
                                       device=t.device).set_(
                st, 0, (st.nbytes(),)))
        parts.append((bases.index(base), t.data_ptr() - base + part.offset))
    layout = kvxfer.Layout.custom(
        num_layers=len(names), kv_factor=1, num_heads=part.units,
        head_dim=part.unit_elems, dtype=part.dtype,
        tokens_per_block=1, num_blocks=nb, kv_stride=0,
        block_stride=stride[0], token_stride=part.units * unit,
        head_stride=unit, parts=parts, name="vllm-state")
    return layout, regions


def register_tables(client: kvxfer.Client, tables: Tables,
                    kv_caches: Dict[str, torch.Tensor], device: str
                    ) -> List[kvxfer.Pool]:
    """A pool for each table but the plain one, over the caches of its
    group's layers (the allocation vLLM's groups share)."""
    from kvxfer.vllm.layout import layout_of_kv_caches
    pools = []
    for g, caches in tables.layer_sets(kv_caches)[1:]:
        if g.kind == STATE:
            names = sorted(caches, key=_layer_key)
            assert g.part is not None
            layout, regions = state_layout(caches, g.spec, names, g.part)
        else:
            layout, regions, _ = layout_of_kv_caches(
                caches, head_size=g.spec.head_size,
                head_size_v=g.spec.head_size_v,
                block_size=g.spec.block_size)
        pools.append(client.register_regions(layout, regions, device=device,
                                             keep=kv_caches))
    return pools


def _layer_key(name: str) -> int:
    from kvxfer.vllm.layout import _layer_index
    return _layer_index(name)
