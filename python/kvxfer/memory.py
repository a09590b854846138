"""Memory a pool can be made of, and finding it behind arrays and tensors.

The daemon maps a pool's memory into its own address space, so host
memory must be a file it can receive: a memfd sealed against shrinking.
:class:`HostBuffer` is one, mapped here; numpy arrays, memoryviews and CPU
tensors made on it can be registered. GPU memory (PyTorch CUDA tensors,
CuPy arrays, anything with ``__cuda_array_interface__``, raw device
pointers) is shared by the library through CUDA IPC or a VMM fd.

numpy, torch and cupy are never imported here: objects are recognised by
their attributes.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from ._check import U64_MAX, integer
from .errors import InvalidArgument

__all__ = ["HostBuffer"]

_buffers: "weakref.WeakSet[HostBuffer]" = weakref.WeakSet()


class HostBuffer(mmap.mmap):
    """Host memory the daemon can map: an anonymous memfd of ``size`` bytes,
    sealed against shrinking and growing, mapped shared into this process.

    It is an :class:`mmap.mmap` (buffer protocol, slicing, ``len()``), and::

        buf.numpy(np.float16, (2, 1024))   # a numpy view of its bytes
        buf.torch(torch.bfloat16)           # a CPU tensor on its bytes

    Arrays and tensors made on it keep the mapping alive; they can be
    registered as pools (``Client.register_pool``), whole or in part. The
    memfd is closed when the buffer is garbage collected; the daemon keeps
    its own mapping of a registered pool until the pool is deregistered.
    """

    fd: int
    address: int

    def __new__(cls, size: int, name: str = "kvxfer-pool") -> "HostBuffer":
        size = integer("size", size, U64_MAX, 1)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # allocated here, charged to this process: the daemon charges
            # a pool's unallocated pages to its memory budget
            os.posix_fallocate(fd, 0, size)
            # sealed size: the daemon refuses a pool that could shrink
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK
                        | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self = super().__new__(cls, fd, size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        anchor = ctypes.c_char.from_buffer(self)
        self.address = ctypes.addressof(anchor)
        del anchor  # (an export would forbid close())
        weakref.finalize(self, os.close, fd)
        _buffers.add(self)
        return self

    def numpy(self, dtype: Any = "uint8", shape: Any = None,
              offset: int = 0) -> Any:
        """A numpy array on the buffer's bytes (needs numpy)."""
        import numpy as np
        dt = np.dtype(dtype)
        count = -1 if shape is None else int(np.prod(shape))
        a = np.frombuffer(self, dtype=dt, count=count, offset=offset)
        return a if shape is None else a.reshape(shape)

    def torch(self, dtype: Any = None, shape: Any = None,
              offset: int = 0) -> Any:
        """A CPU tensor on the buffer's bytes (needs torch)."""
        import torch  # type: ignore[import-not-found]
        import warnings
        dt = torch.uint8 if dtype is None else dtype
        count = -1 if shape is None else int(torch.Size(shape).numel())
        with warnings.catch_warnings():  # "the buffer is not writable": it is
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(self, dtype=dt, count=count, offset=offset)
        return t if shape is None else t.reshape(shape)

    def __repr__(self) -> str:
        return f"<kvxfer.HostBuffer fd={self.fd} size={len(self)}>"


@dataclass
class Span:
    """One piece of memory behind an object: [ptr, ptr + nbytes)."""

    kind: str  # "host" or "gpu"
    ptr: int
    nbytes: int
    device: Optional[int] = None  # CUDA device index when known


def _host_span(ptr: int, nbytes: int) -> Span:
    return Span("host", ptr, nbytes)


def span_of(obj: Any, size: Optional[int] = None,
            device: Optional[str] = None) -> Span:
    """The memory behind one array, tensor, buffer or pointer."""
    if isinstance(obj, HostBuffer):
        return _host_span(obj.address, len(obj))
    if isinstance(obj, bool):
        raise InvalidArgument(-1, "memory: a bool is not memory")
    if isinstance(obj, int):
        if size is None:
            raise InvalidArgument(-1, "size: a raw pointer needs size= "
                                  "(bytes)")
        if device not in ("cuda", "host"):
            raise InvalidArgument(-1, "device: a raw pointer needs "
                                  "device='cuda' or device='host'")
        return Span("gpu" if device == "cuda" else "host",
                    integer("memory", obj, U64_MAX, 1),
                    integer("size", size, U64_MAX, 1))
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch" and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise InvalidArgument(-1, "memory: the tensor is not contiguous")
        nbytes = obj.numel() * obj.element_size()
        if obj.is_cuda:
            return Span("gpu", obj.data_ptr(), nbytes, obj.device.index)
        if obj.device.type != "cpu":
            raise InvalidArgument(-1, f"memory: tensors on {obj.device} "
                                  "cannot be pools (CPU or CUDA only)")
        return _host_span(obj.data_ptr(), nbytes)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return Span("gpu", cai["data"][0], _nbytes(obj, cai),
                    _cupy_device(obj))
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        return _host_span(ai["data"][0], _nbytes(obj, ai))
    if isinstance(obj, memoryview):
        if not obj.c_contiguous:
            raise InvalidArgument(-1, "memory: the memoryview is not "
                                  "contiguous")
        if obj.readonly:
            raise InvalidArgument(-1, "memory: the memoryview is read-only")
        anchor = (ctypes.c_char * obj.nbytes).from_buffer(obj)
        ptr = ctypes.addressof(anchor)
        del anchor
        return _host_span(ptr, obj.nbytes)
    raise InvalidArgument(-1, f"memory: {type(obj).__name__} is not a numpy "
                          "array, torch tensor, CuPy array, memoryview, "
                          "HostBuffer or pointer")


def _nbytes(obj: Any, iface: dict) -> int:
    strides = iface.get("strides")
    shape = iface["shape"]
    itemsize = int(iface["typestr"][2:])  # "<f2": order, kind, bytes
    n = 1
    for s in shape:
        n *= s
    if strides is not None:
        # C-contiguous strides are allowed (numpy gives them at times)
        expect = itemsize
        for dim, st in zip(reversed(shape), reversed(strides)):
            if dim > 1 and st != expect:
                raise InvalidArgument(-1, "memory: the array is not "
                                      "C-contiguous")
            expect *= dim
    return n * itemsize


def _cupy_device(obj: Any) -> Optional[int]:
    dev = getattr(obj, "device", None)
    return getattr(dev, "id", None)


def host_buffer_of(span: Span) -> HostBuffer:
    """The HostBuffer holding span, or InvalidArgument saying what to do."""
    for buf in list(_buffers):
        if buf.closed:
            continue
        if buf.address <= span.ptr and \
                span.ptr + span.nbytes <= buf.address + len(buf):
            return buf
    raise InvalidArgument(
        -1, "memory: host memory must lie in a kvxfer.HostBuffer (a sealed "
        "memfd the daemon can map); allocate it with kvxfer.HostBuffer(size) "
        "or Client.create_host_pool(layout), or register your own memfd with "
        "Client.register_host_fd()")
