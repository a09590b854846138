"""Layouts: where each K/V element of a pool lives (kvx_layout_t)."""

from __future__ import annotations

import ctypes
import enum
from typing import Any, Iterable, Optional, Sequence, Tuple

from . import _lib
from ._check import U32_MAX, U64_MAX, integer
from .errors import InvalidArgument

__all__ = ["DType", "Layout", "PRESETS"]

PRESETS = ("trtllm", "vllm-nhd", "vllm-hnd", "flashinfer", "sglang", "mla")


class DType(enum.IntEnum):
    """kvx_dtype_t."""

    UNSPECIFIED = 0
    FP32 = 1
    FP16 = 2
    BF16 = 3
    FP8 = 4
    INT8 = 5

    @property
    def size(self) -> int:
        """Bytes per element (kvx_dtype_size)."""
        return int(_lib.lib().kvx_dtype_size(int(self)))

    @classmethod
    def of(cls, dtype: Any) -> "DType":
        """A DType from a DType, its name ("bf16"), or a torch / numpy
        dtype (torch.bfloat16, numpy.float16, ...)."""
        if isinstance(dtype, DType):
            return dtype
        if isinstance(dtype, int):
            v = integer("dtype", dtype, max(cls), min(cls))
            return cls(v)
        name = str(dtype).lower().replace("torch.", "")
        aliases = {
            "float32": "fp32", "float": "fp32", "float16": "fp16",
            "half": "fp16", "bfloat16": "bf16", "int8": "int8",
            "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
            "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
        }
        name = aliases.get(name, name)
        out = ctypes.c_int()
        if _lib.lib().kvx_dtype_parse(name.encode(), ctypes.byref(out)) != 0:
            raise InvalidArgument(-1, f"dtype: {dtype!r} is not one of "
                                  "fp32, fp16, bf16, fp8, int8")
        return cls(out.value)


class Layout:
    """How (layer, kv, block, token, head, dim) map to bytes in a pool.

    A pool is a list of memory regions (one allocation, one tensor per
    layer, or a K and a V tensor per layer); each (layer, kv) *part* of
    the layout lies in one region, at an offset::

        region, base = part(layer, kv)
        offset = base + block*block_stride + token*token_stride
                 + head*head_stride + dim*elem_size      (in that region)

    With no explicit parts (the presets) the pool is one region and
    ``part(layer, kv) = (0, layer*layer_stride + kv*kv_stride)``.
    num_layers / num_heads are this rank's (after the PP / TP split).
    Build one with :meth:`preset` (the engines' layouts) or :meth:`custom`;
    :meth:`split` moves the parts into a region per layer or per K and V.
    Layouts are immutable; the ``with_*`` methods return changed copies.
    """

    __slots__ = ("_c", "_parts")

    def __init__(self, c: _lib.Layout,
                 parts: Optional[ctypes.Array] = None) -> None:
        self._c = c
        self._parts = parts  # owns what c.parts points at
        if parts is not None:
            c.parts = ctypes.cast(parts, ctypes.POINTER(_lib.LayoutPart))
            c.num_parts = len(parts)
        else:
            c.parts = None
            c.num_parts = 0

    @classmethod
    def preset(cls, preset: str, *, num_layers: int, num_heads: int,
               head_dim: int, dtype: Any, tokens_per_block: int,
               num_blocks: int, kv_factor: int = 2) -> "Layout":
        """A named preset (kvx_layout_preset): ``"trtllm"``,
        ``"vllm-nhd"``, ``"vllm-hnd"``, ``"flashinfer"``, ``"sglang"``
        (tokens_per_block 1), ``"mla"`` (kv_factor 1, num_heads 1).
        One region; per-layer presets place the layers one after another.

        Raises InvalidArgument for an unknown preset or a shape it refuses.
        """
        num_layers, kv_factor, num_heads, head_dim, tokens_per_block, \
            num_blocks = _u32s(num_layers=num_layers, kv_factor=kv_factor,
                               num_heads=num_heads, head_dim=head_dim,
                               tokens_per_block=tokens_per_block,
                               num_blocks=num_blocks)
        c = _lib.Layout()
        rc = _lib.lib().kvx_layout_preset(
            preset.encode(), num_layers, kv_factor, num_heads, head_dim,
            int(DType.of(dtype)), tokens_per_block, num_blocks,
            ctypes.byref(c))
        if rc:
            raise InvalidArgument(
                rc, f"layout preset {preset!r} refuses num_layers="
                f"{num_layers} kv_factor={kv_factor} num_heads={num_heads} "
                f"head_dim={head_dim} dtype={dtype} tokens_per_block="
                f"{tokens_per_block} num_blocks={num_blocks} (known: "
                f"{', '.join(PRESETS)}; sglang needs tokens_per_block 1, "
                "mla kv_factor 1 and num_heads 1)")
        return cls(c)

    @classmethod
    def custom(cls, *, num_layers: int, kv_factor: int, num_heads: int,
               head_dim: int, dtype: Any, tokens_per_block: int,
               num_blocks: int, kv_stride: int, block_stride: int,
               token_stride: int, head_stride: int,
               layer_stride: int = 0,
               layer_offsets: Optional[Sequence[int]] = None,
               parts: Optional[Sequence[Tuple[int, int]]] = None,
               elem_size: Optional[int] = None,
               name: str = "custom") -> "Layout":
        """A layout given stride by stride (bytes). The layers lie
        ``layer_stride`` apart in one region, or at ``layer_offsets`` (one
        per layer, in one region), or each (layer, kv) part where
        ``parts`` says: ``(region, offset)`` pairs, num_layers*kv_factor
        of them, layer-major. The daemon checks it when a pool is
        registered (LayoutError names the problem)."""
        num_layers = integer("num_layers", num_layers, _lib.MAX_LAYERS)
        dt = DType.of(dtype)
        c = _lib.Layout()
        c.preset = name.encode()[:15]
        c.num_layers = num_layers
        c.kv_factor, c.num_heads, c.head_dim, c.tokens_per_block, \
            c.num_blocks = _u32s(kv_factor=kv_factor, num_heads=num_heads,
                                 head_dim=head_dim,
                                 tokens_per_block=tokens_per_block,
                                 num_blocks=num_blocks)
        c.elem_size = dt.size if elem_size is None else \
            integer("elem_size", elem_size)
        c.dtype = int(dt)
        for f, v in (("layer_stride", layer_stride), ("kv_stride", kv_stride),
                     ("block_stride", block_stride),
                     ("token_stride", token_stride),
                     ("head_stride", head_stride)):
            setattr(c, f, integer(f, v, U64_MAX))
        out = cls(c)
        if layer_offsets is not None and parts is not None:
            raise InvalidArgument(-1, "layer_offsets and parts: give one")
        if layer_offsets is not None:
            return out.with_layer_offsets(layer_offsets)
        if parts is not None:
            return out.with_parts(parts)
        return out

    def _copy(self) -> "Layout":
        c = _lib.Layout()
        ctypes.pointer(c)[0] = self._c
        parts = None
        if self._parts is not None:
            parts = (_lib.LayoutPart * len(self._parts))()
            ctypes.memmove(parts, self._parts, ctypes.sizeof(parts))
        return Layout(c, parts)

    def with_parts(self, parts: Iterable[Tuple[int, int]]) -> "Layout":
        """This layout with every (layer, kv) part at ``(region, offset)``:
        num_layers*kv_factor pairs, layer-major (layer 0's K, its V,
        layer 1's K, ...)."""
        ps = list(parts)
        n = self.num_layers * self.kv_factor
        if len(ps) != n:
            raise InvalidArgument(-1, f"parts: {len(ps)} entries for "
                                  f"num_layers {self.num_layers} x "
                                  f"kv_factor {self.kv_factor}")
        arr = (_lib.LayoutPart * n)()
        for i, (region, off) in enumerate(ps):
            arr[i].region = integer(f"parts[{i}].region", region)
            arr[i].offset = integer(f"parts[{i}].offset", off, U64_MAX)
        out = self._copy()
        return Layout(out._c, arr)

    def with_first_head(self, head: Optional[int]) -> "Layout":
        """This layout saying that its pool holds the model's KV heads
        from ``head`` on (None: not said). The daemon refuses a pool whose
        first head is not the one the TP rule gives its rank
        (LayoutError), instead of moving the wrong heads."""
        # stored plus one: 0 says "not said"
        first = 0 if head is None else \
            integer("first_head", head, U32_MAX - 1) + 1
        out = self._copy()
        out._c.first_head = first
        return out

    def with_layer_offsets(self, offsets: Iterable[int]) -> "Layout":
        """This layout with the layers at ``offsets`` (one per layer) in
        one region; a layer's V lies kv_stride after its K."""
        offs = [integer(f"layer_offsets[{i}]", off, U64_MAX)
                for i, off in enumerate(offsets)]
        if len(offs) != self.num_layers:
            raise InvalidArgument(-1, f"layer_offsets: {len(offs)} entries "
                                  f"for num_layers {self.num_layers}")
        return self.with_parts((0, off + kv * self.kv_stride)
                               for off in offs
                               for kv in range(self.kv_factor))

    def split(self, regions_per_layer: int = 1) -> "Layout":
        """This layout over a region per layer (``1``, as vLLM's per-layer
        tensors) or a K and a V region per layer (``2``, as SGLang's):
        kvx_layout_split. Each region must then hold
        :meth:`region_span` bytes."""
        regions_per_layer = integer("regions_per_layer", regions_per_layer)
        out = self._copy()
        n = self.num_layers * self.kv_factor
        arr = (_lib.LayoutPart * n)()
        rc = _lib.lib().kvx_layout_split(ctypes.byref(out._c),
                                         regions_per_layer, arr, n)
        if rc:
            raise InvalidArgument(rc, f"split: regions_per_layer "
                                  f"{regions_per_layer} (expected 1, or 2 "
                                  "with kv_factor 2) of a layout in one "
                                  "region")
        return Layout(out._c, arr)

    # the fields, read-only
    preset_name = property(lambda self: self._c.preset.decode(),
                           doc="Preset name ('' or 'custom' if none).")
    num_layers = property(lambda self: int(self._c.num_layers))
    kv_factor = property(lambda self: int(self._c.kv_factor))
    num_heads = property(lambda self: int(self._c.num_heads))
    head_dim = property(lambda self: int(self._c.head_dim))
    elem_size = property(lambda self: int(self._c.elem_size))
    dtype = property(lambda self: DType(self._c.dtype))
    tokens_per_block = property(lambda self: int(self._c.tokens_per_block))
    num_blocks = property(lambda self: int(self._c.num_blocks))
    layer_stride = property(lambda self: int(self._c.layer_stride))
    kv_stride = property(lambda self: int(self._c.kv_stride))
    block_stride = property(lambda self: int(self._c.block_stride))
    token_stride = property(lambda self: int(self._c.token_stride))
    head_stride = property(lambda self: int(self._c.head_stride))
    first_head = property(
        lambda self: int(self._c.first_head) - 1 if self._c.first_head
        else None,
        doc="The model's first KV head the pool holds, if said.")

    @property
    def parts(self) -> Tuple[Tuple[int, int], ...]:
        """``(region, offset)`` of every (layer, kv) part, layer-major."""
        return tuple((self.region(a, k), self.offset(a, k, 0))
                     for a in range(self.num_layers)
                     for k in range(self.kv_factor))

    @property
    def layer_offsets(self) -> Tuple[int, ...]:
        """Byte offset of each layer's first part (K) in its region."""
        return tuple(self.offset(a, 0, 0) for a in range(self.num_layers))

    @property
    def num_regions(self) -> int:
        """Regions the layout addresses (kvx_layout_num_regions)."""
        return int(_lib.lib().kvx_layout_num_regions(ctypes.byref(self._c)))

    def region_span(self, region: int) -> int:
        """Bytes the layout spans in ``region``: the smallest size of that
        region (kvx_layout_region_span)."""
        return int(_lib.lib().kvx_layout_region_span(
            ctypes.byref(self._c), integer("region", region)))

    def region(self, layer: int, kv: int) -> int:
        """The region part (layer, kv) lies in (kvx_layout_region)."""
        layer, kv = self._in_range(layer, kv, 0, 0, 0)[:2]
        return int(_lib.lib().kvx_layout_region(ctypes.byref(self._c),
                                                layer, kv))

    @property
    def span(self) -> int:
        """Bytes a one-region layout spans: the smallest pool size that
        holds it (0 for a layout over several regions)."""
        return int(_lib.lib().kvx_layout_span(ctypes.byref(self._c)))

    @property
    def layer_span(self) -> int:
        """Bytes one layer (its K and V, kv_stride apart) spans."""
        c = _lib.Layout()
        ctypes.pointer(c)[0] = self._c
        c.num_layers = 1
        c.parts = None
        c.num_parts = 0
        return int(_lib.lib().kvx_layout_span(ctypes.byref(c)))

    @property
    def part_span(self) -> int:
        """Bytes one (layer, kv) part spans from its offset."""
        c = _lib.Layout()
        ctypes.pointer(c)[0] = self._c
        c.num_layers = c.kv_factor = 1
        c.parts = None
        c.num_parts = 0
        return int(_lib.lib().kvx_layout_span(ctypes.byref(c)))

    def _in_range(self, layer: int, kv: int, block: int, token: int,
                  head: int) -> Tuple[int, ...]:
        return tuple(integer(name, v, n - 1) for name, v, n in (
            ("layer", layer, self.num_layers), ("kv", kv, self.kv_factor),
            ("block", block, self.num_blocks),
            ("token", token, self.tokens_per_block),
            ("head", head, self.num_heads)))

    def offset(self, layer: int, kv: int, block: int, token: int = 0,
               head: int = 0) -> int:
        """Byte offset of element (layer, kv, block, token, head, dim 0) in
        its region (:meth:`region` says which)."""
        at = self._in_range(layer, kv, block, token, head)
        return int(_lib.lib().kvx_layout_offset(ctypes.byref(self._c), *at))

    def _key(self) -> bytes:
        c = _lib.Layout()
        ctypes.pointer(c)[0] = self._c
        c.parts = None
        parts = bytes(self._parts) if self._parts is not None else b""
        return bytes(c) + parts

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Layout({self.preset_name!r}, num_layers={self.num_layers}, "
                f"kv_factor={self.kv_factor}, num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype.name.lower()}, "
                f"tokens_per_block={self.tokens_per_block}, "
                f"num_blocks={self.num_blocks}, "
                f"regions={self.num_regions}, span={self.span})")


def _u32s(**values: Any) -> Tuple[int, ...]:
    """The uint32_t fields of a layout, checked, in the order given."""
    return tuple(integer(k, v) for k, v in values.items())
