"""PyTorch tensors as kvxfer GPU pools, as an engine registers them.

Run by make test-gpu twice: once with the caching allocator's defaults,
once with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (a tensor then
spans several VMM allocations mapped back to back). Each case moves every
block of a pool from one tensor to another through a real kvxferd and
checks the bytes: the destination equals the source, and every byte of
the enclosing tensors outside the destination is unchanged.

    python3 torch_pools.py SOCKET SHIM_SO
Prints one line per case and "N passed, N failed" last.
"""
import ctypes
import os
import sys

import torch

LAYERS, HEADS, HEAD_DIM, TPB, BLOCKS = 4, 8, 128, 16, 64
PRESETS = ["vllm-nhd", "vllm-hnd", "trtllm", "flashinfer"]


class Shim:
    def __init__(self, path: str, sock: str):
        self.lib = ctypes.CDLL(path)
        self.lib.kvxt_span.restype = ctypes.c_uint64
        self.lib.kvxt_span.argtypes = [ctypes.c_char_p] + [ctypes.c_uint32] * 5
        self.lib.kvxt_transfer.restype = ctypes.c_int
        self.lib.kvxt_transfer.argtypes = (
            [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
            + [ctypes.c_uint32] * 5
            + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
               ctypes.c_char_p, ctypes.c_size_t])
        self.sock = sock.encode()
        self.req = 0

    def span(self, preset: str, layers: int = LAYERS, blocks: int = BLOCKS) -> int:
        return self.lib.kvxt_span(preset.encode(), layers, HEADS, HEAD_DIM,
                                  TPB, blocks)

    def transfer(self, tag: str, preset: str, src: torch.Tensor,
                 dst: torch.Tensor, layers: int = LAYERS,
                 blocks: int = BLOCKS) -> None:
        err = ctypes.create_string_buffer(1024)
        self.req += 1
        torch.cuda.synchronize()
        rc = self.lib.kvxt_transfer(self.sock, tag.encode(), preset.encode(),
                                    layers, HEADS, HEAD_DIM, TPB, blocks,
                                    src.data_ptr(), dst.data_ptr(), self.req,
                                    err, len(err))
        if rc:
            raise RuntimeError(f"kvxt_transfer {rc}: {err.value.decode()}")


def check(big: torch.Tensor, before: torch.Tensor, src: torch.Tensor,
          dst: torch.Tensor) -> str:
    """'' when dst == src and nothing else in big changed, else why."""
    torch.cuda.synchronize()
    if not torch.equal(dst, src):
        wrong = (dst != src).nonzero()
        return (f"{wrong.numel()} destination bytes differ, first at "
                f"{int(wrong[0])}")
    lo = dst.data_ptr() - big.data_ptr()
    hi = lo + dst.numel()
    if not torch.equal(big[:lo], before[:lo]):
        return "bytes before the destination changed"
    if not torch.equal(big[hi:], before[hi:]):
        return "bytes after the destination changed"
    return ""


def main() -> int:
    sock, shim_path = sys.argv[1], sys.argv[2]
    shim = Shim(shim_path, sock)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
    gen = torch.Generator(device="cuda").manual_seed(14)
    passed = failed = 0

    def case(name, fn):
        nonlocal passed, failed
        try:
            why = fn()
        except Exception as e:  # a refusal is a failure with its reason
            why = str(e)
        if why:
            failed += 1
            print(f"FAIL torch {name} [{conf}]: {why}", flush=True)
        else:
            passed += 1
            print(f"ok torch {name} [{conf}]", flush=True)

    def rand_bytes(n):
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda",
                             generator=gen)

    # two pools as slices of one tensor: unaligned to their allocation,
    # back to back and with a gap, either order
    for i, preset in enumerate(PRESETS):
        span = shim.span(preset)
        for order in ("src-first", "dst-first"):
            def two_slices(preset=preset, span=span, order=order, i=i):
                gap = 0 if order == "src-first" else 4096 * (i + 1)
                off = 512 * (i + 3)
                big = rand_bytes(off + 2 * span + gap + (1 << 20))
                a = big[off:off + span]
                b = big[off + span + gap:off + 2 * span + gap]
                src, dst = (a, b) if order == "src-first" else (b, a)
                before = big.clone()
                shim.transfer(f"sl{i}{order[0]}", preset, src, dst)
                return check(big, before, before[src.data_ptr() -
                                                 big.data_ptr():][:span], dst)
            case(f"slices-{preset}-{order}", two_slices)

    # tensors the caching allocator placed inside its segments, after
    # other tensors
    def segment_offset(t):
        """Where t starts inside the allocator's segment that holds it."""
        p = t.data_ptr()
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= p < seg["address"] + seg["total_size"]:
                return p - seg["address"]
        return None

    def allocator_placed():
        # tensors under 10 MB share the allocator's 20 MiB segments: a
        # first one takes the start, the pools come after it, inside the
        # segment (checked: the test is about that)
        blocks = 16
        span = shim.span("vllm-nhd", blocks=blocks)
        pads = [torch.empty(1_500_000, dtype=torch.uint8, device="cuda")]
        src = rand_bytes(span)
        dst = torch.zeros(span, dtype=torch.uint8, device="cuda")
        offs = (segment_offset(src), segment_offset(dst))
        if None in offs or offs == (0, 0):
            return f"neither pool inside its segment (offsets {offs})"
        shim.transfer("alloc", "vllm-nhd", src, dst, blocks=blocks)
        torch.cuda.synchronize()
        del pads
        if not torch.equal(src, dst):
            return "destination differs"
        print(f"  allocator placed the pools at segment offsets {offs}",
              flush=True)
        return ""
    case("caching-allocator-placed", allocator_placed)

    # a per-layer view: layers 1.. of a [layers, 2, blocks, tpb, heads,
    # head_dim] bf16 KV tensor (vllm-nhd's shape), a slice at one layer's
    # offset
    def layer_slice():
        shape = (LAYERS + 1, 2, BLOCKS, TPB, HEADS, HEAD_DIM)
        k_src = torch.randn(shape, dtype=torch.bfloat16, device="cuda",
                            generator=gen)
        k_dst = torch.randn(shape, dtype=torch.bfloat16, device="cuda",
                            generator=gen)
        before = k_dst.clone()
        shim.transfer("layer", "vllm-nhd", k_src[1:], k_dst[1:],
                      layers=LAYERS)
        torch.cuda.synchronize()
        if not torch.equal(k_dst[1:], k_src[1:]):
            return "layers 1.. differ"
        if not torch.equal(k_dst[0], before[0]):
            return "layer 0, outside the pool, changed"
        return ""
    case("per-layer-slice", layer_slice)

    # a large pool: with expandable segments, several physical allocations
    def large():
        blocks = 1024
        span = shim.span("trtllm", blocks=blocks)
        big = rand_bytes(span * 2 + 8192)
        src, dst = big[4096:4096 + span], big[4096 + span:4096 + 2 * span]
        before = big.clone()
        shim.transfer("large", "trtllm", src, dst, blocks=blocks)
        return check(big, before, before[4096:4096 + span], dst)
    case("large-pool", large)

    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
