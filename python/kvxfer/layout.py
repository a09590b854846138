"""Layouts: where each K/V element of a pool lives (kvx_layout_t)."""

from __future__ import annotations

import ctypes
import enum
from typing import Any, Iterable, Optional, Sequence, Tuple

from . import _lib
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
            return cls(dtype)
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
    """How (layer, kv, block, token, head, dim) map to bytes in a pool::

        offset = layer_offsets[layer] + kv*kv_stride + block*block_stride
                 + token*token_stride + head*head_stride + dim*elem_size

    num_layers / num_heads are this rank's (after the PP / TP split).
    Build one with :meth:`preset` (the engines' layouts) or :meth:`custom`.
    Layouts are immutable; the ``with_*`` methods return changed copies.
    """

    __slots__ = ("_c",)

    def __init__(self, c: _lib.Layout) -> None:
        self._c = c

    @classmethod
    def preset(cls, preset: str, *, num_layers: int, num_heads: int,
               head_dim: int, dtype: Any, tokens_per_block: int,
               num_blocks: int, kv_factor: int = 2) -> "Layout":
        """A named preset (kvx_layout_preset): ``"trtllm"``,
        ``"vllm-nhd"``, ``"vllm-hnd"``, ``"flashinfer"``, ``"sglang"``
        (tokens_per_block 1), ``"mla"`` (kv_factor 1, num_heads 1).
        Per-layer presets place the layers one after another.

        Raises InvalidArgument for an unknown preset or a shape it refuses.
        """
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
               num_blocks: int, layer_offsets: Sequence[int],
               kv_stride: int, block_stride: int, token_stride: int,
               head_stride: int, elem_size: Optional[int] = None,
               name: str = "custom") -> "Layout":
        """A layout given stride by stride (bytes). The daemon checks it
        when a pool is registered (LayoutError names the problem)."""
        if len(layer_offsets) != num_layers:
            raise InvalidArgument(-1, f"layer_offsets: {len(layer_offsets)} "
                                  f"entries for num_layers {num_layers}")
        if num_layers > _lib.MAX_LAYERS:
            raise InvalidArgument(-1, f"num_layers: {num_layers} > "
                                  f"{_lib.MAX_LAYERS}")
        dt = DType.of(dtype)
        c = _lib.Layout()
        c.preset = name.encode()[:15]
        c.num_layers, c.kv_factor = num_layers, kv_factor
        c.num_heads, c.head_dim = num_heads, head_dim
        c.elem_size = dt.size if elem_size is None else elem_size
        c.dtype = int(dt)
        c.tokens_per_block, c.num_blocks = tokens_per_block, num_blocks
        for i, off in enumerate(layer_offsets):
            c.layer_offset[i] = off
        c.kv_stride, c.block_stride = kv_stride, block_stride
        c.token_stride, c.head_stride = token_stride, head_stride
        return cls(c)

    def _copy(self) -> _lib.Layout:
        c = _lib.Layout()
        ctypes.pointer(c)[0] = self._c
        return c

    def with_layer_offsets(self, offsets: Iterable[int]) -> "Layout":
        """This layout with other layer_offsets (one per layer)."""
        offs = list(offsets)
        if len(offs) != self.num_layers:
            raise InvalidArgument(-1, f"layer_offsets: {len(offs)} entries "
                                  f"for num_layers {self.num_layers}")
        c = self._copy()
        for i, off in enumerate(offs):
            c.layer_offset[i] = off
        return Layout(c)

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
    kv_stride = property(lambda self: int(self._c.kv_stride))
    block_stride = property(lambda self: int(self._c.block_stride))
    token_stride = property(lambda self: int(self._c.token_stride))
    head_stride = property(lambda self: int(self._c.head_stride))

    @property
    def layer_offsets(self) -> Tuple[int, ...]:
        """Byte offset of each layer in the pool."""
        return tuple(self._c.layer_offset[: self.num_layers])

    @property
    def span(self) -> int:
        """Bytes the layout spans: the smallest pool size that holds it."""
        return int(_lib.lib().kvx_layout_span(ctypes.byref(self._c)))

    @property
    def layer_span(self) -> int:
        """Bytes one layer spans from its layer offset."""
        c = self._copy()
        c.num_layers = 1
        c.layer_offset[0] = 0
        return int(_lib.lib().kvx_layout_span(ctypes.byref(c)))

    def offset(self, layer: int, kv: int, block: int, token: int = 0,
               head: int = 0) -> int:
        """Byte offset of element (layer, kv, block, token, head, dim 0)."""
        for name, v, n in (("layer", layer, self.num_layers),
                           ("kv", kv, self.kv_factor),
                           ("block", block, self.num_blocks),
                           ("token", token, self.tokens_per_block),
                           ("head", head, self.num_heads)):
            if not 0 <= v < n:
                raise InvalidArgument(-1, f"{name}: {v} out of range "
                                      f"(expected 0..{n - 1})")
        return int(_lib.lib().kvx_layout_offset(
            ctypes.byref(self._c), layer, kv, block, token, head))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Layout)
                and bytes(self._c) == bytes(other._c))

    def __hash__(self) -> int:
        return hash(bytes(self._c))

    def __repr__(self) -> str:
        return (f"Layout({self.preset_name!r}, num_layers={self.num_layers}, "
                f"kv_factor={self.kv_factor}, num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype.name.lower()}, "
                f"tokens_per_block={self.tokens_per_block}, "
                f"num_blocks={self.num_blocks}, span={self.span})")


