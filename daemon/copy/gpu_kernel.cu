/*
 * gpu_kernel — the gather/scatter kernel: copies plan units between any
 * two layouts, reading or writing peer GPU memory (NVLink/PCIe P2P) or
 * mapped host memory. Rows are head_dim * elem_size bytes and move as
 * 16-byte vectors when every address and stride is 16-byte aligned, else
 * as bytes. Any CTA budget works; the budget is the caller's, since the
 * GPUs are busy running the model.
 *
 * Work is handed out dynamically: a launch's units are cut into pieces of
 * about PIECE_BYTES (a part of a long unit, or a few short units), and
 * each warp takes the next piece from a counter in device memory, so all
 * warps finish together and the next launch on the stream waits for no
 * straggler. Pieces are small (4 KiB: one batch of UNROLL 16-byte loads
 * per lane), which also keeps the warps of a launch close together in
 * memory. The counter is reset by the last warp of the launch; the
 * launches of one device are serialized on its stream (gpu.c), so one
 * counter per device serves them all (a faulted kernel leaves it dirty,
 * but a fault also ends the context).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu_desc.h"

/* Measured on two H200s over NVLink (issue #3): 4 KiB pieces did as well
 * as 2 KiB ones and better than 8, 16 and 64 KiB ones or a static
 * assignment; 256-thread CTAs matched 512 at 64 CTAs but lost 13-33% of
 * the throughput at 8-32 CTAs. Overridable with -D for measurements. */
#ifndef THREADS
#define THREADS 512
#endif
#ifndef PIECE_BYTES
#define PIECE_BYTES (4u << 10)
#endif
#ifndef UNROLL
#define UNROLL 8
#endif
#define MAX_PARTS 64

__device__ static unsigned long long next_piece; /* of the running launch */
__device__ static unsigned int warps_done;

__device__ static inline uint32_t slice_of(const gpu_plan_t *p, uint64_t u)
{
    uint32_t i = 0;
    while (i + 1 < p->nslices && p->slices[i + 1].unit_begin <= u)
        i++;
    return i;
}

/* A unit's rows as (up to) three strided dimensions around a contiguous
 * run; dimensions contiguous on both sides are merged into the run, as on
 * the host (plan.c copy_strided), so matching layouts copy whole 32 KiB
 * runs with no per-vector index arithmetic. */
struct dims {
    uint64_t n[3], ss[3], ds[3];
    int nd;
    uint64_t run;
};

/* A K to V step that equals the run (two regions that happen to lie back
 * to back in the device's address space) merges too: the bytes are
 * contiguous there, whatever allocations back them. Keeping the kv
 * dimension apart for that case cost 8% of the within-GPU bandwidth
 * (docs/benchmarks.md, "Engine API"). */
__device__ static inline void merge(dims &d)
{
    for (int merged = 1; merged;) {
        merged = 0;
        for (int i = 0; i < d.nd; i++)
            if (d.n[i] == 1 || (d.ss[i] == d.run && d.ds[i] == d.run)) {
                d.run *= d.n[i];
                d.nd--;
                d.n[i] = d.n[d.nd];
                d.ss[i] = d.ss[d.nd];
                d.ds[i] = d.ds[d.nd];
                merged = 1;
                break;
            }
    }
    for (int i = d.nd; i < 3; i++) {
        d.n[i] = 1;
        d.ss[i] = d.ds[i] = 0;
    }
}

/* Offsets of run r (0 <= r < n0*n1*n2). */
__device__ static inline void run_off(const dims &d, uint64_t r, uint64_t *so,
                                      uint64_t *dof)
{
    const uint64_t a = r % d.n[0], rest = r / d.n[0];
    const uint64_t b = rest % d.n[1], c = rest / d.n[1];
    *so = a * d.ss[0] + b * d.ss[1] + c * d.ss[2];
    *dof = a * d.ds[0] + b * d.ds[1] + c * d.ds[2];
}

/* Where unit u starts in a packed buffer (plan order, no gaps). */
__device__ static inline uint64_t packed_off(const gpu_plan_t &p, uint64_t u)
{
    const gpu_slice_t *s = &p.slices[slice_of(&p, u)];
    const uint64_t r = u - s->unit_begin;
    const uint64_t per_tok = (uint64_t)s->nheads * p.kv_factor * p.row_bytes;
    return s->packed_begin +
           ((r / p.nsegs) * p.seg_tok[p.nsegs] + p.seg_tok[r % p.nsegs]) *
               per_tok;
}

struct packed_arg {
    uint8_t *base; /* the slot, at unit u0 */
    uint64_t off0; /* packed_off(u0) */
    int mode;      /* GPU_PACKED_* */
};

/* Unit u resolved: its first source and destination bytes, its dimensions,
 * and its size in elements: 16-byte vectors when aligned, else bytes. */
struct unit {
    const uint8_t *src;
    uint8_t *dst;
    dims d;
    uint64_t nruns, nelem;
    int bytes; /* unaligned: copied byte by byte */
};

__device__ static __forceinline__ void
unit_get(const gpu_plan_t &p, uint64_t u, unit &x, const packed_arg &pk)
{
    const gpu_slice_t *s = &p.slices[slice_of(&p, u)];
    const uint64_t r = u - s->unit_begin;
    const uint32_t layer = s->layer0 + (uint32_t)(r / p.nsegs);
    const gpu_seg_t g = p.segs[r % p.nsegs];
    /* a packed side is not bound: its tables are empty, never read.
     * Addresses are integers here: the K to V step of two regions may be
     * "negative" */
    dims &d = x.d;
    d.ss[2] = d.ds[2] = 0;
    if (pk.mode != GPU_PACKED_SCATTER) {
        const uint64_t *sp =
            s->src.part + (uint64_t)(layer - s->src_layer_base) * p.kv_factor;
        x.src = (const uint8_t *)(uintptr_t)(
            sp[0] + (uint64_t)s->src.blocks[g.src_blk] * s->src.block_stride +
            (uint64_t)g.src_tok * s->src.token_stride +
            (uint64_t)(s->head0 - s->src_head_base) * s->src.head_stride);
        if (p.kv_factor > 1)
            d.ss[2] = sp[1] - sp[0];
    }
    if (pk.mode != GPU_PACKED_GATHER) {
        const uint64_t *dp =
            p.dst.part + (uint64_t)(layer - s->dst_layer_base) * p.kv_factor;
        x.dst = (uint8_t *)(uintptr_t)(
            dp[0] + (uint64_t)p.dst.blocks[g.dst_blk] * p.dst.block_stride +
            (uint64_t)g.dst_tok * p.dst.token_stride +
            (uint64_t)(s->head0 - s->dst_head_base) * p.dst.head_stride);
        if (p.kv_factor > 1)
            d.ds[2] = dp[1] - dp[0];
    }
    d.nd = 3;
    d.run = p.row_bytes;
    d.n[0] = s->nheads;
    d.ss[0] = s->src.head_stride;
    d.ds[0] = p.dst.head_stride;
    d.n[1] = g.n;
    d.ss[1] = s->src.token_stride;
    d.ds[1] = p.dst.token_stride;
    d.n[2] = p.kv_factor;
    if (pk.mode != GPU_PACKED_NONE) { /* one side is the slot */
        uint8_t *at = pk.base + (packed_off(p, u) - pk.off0);
        uint64_t *st = pk.mode == GPU_PACKED_GATHER ? d.ds : d.ss;
        st[0] = p.row_bytes;
        st[1] = (uint64_t)s->nheads * p.row_bytes;
        st[2] = (uint64_t)g.n * s->nheads * p.row_bytes;
        if (pk.mode == GPU_PACKED_GATHER)
            x.dst = at;
        else
            x.src = at;
    }
    merge(d);
    x.nruns = d.n[0] * d.n[1] * d.n[2];
    uint64_t align = (uintptr_t)x.src | (uintptr_t)x.dst | d.run;
    for (int i = 0; i < 3; i++)
        align |= d.ss[i] | d.ds[i];
    x.bytes = (align & 15) != 0;
    x.nelem = x.nruns * (x.bytes ? d.run : d.run / 16);
}

/* Copy elements [lo, hi) of unit x (vectors, or bytes when unaligned),
 * the whole warp together. Long runs: lanes stride over one run's
 * vectors, UNROLL loads in flight per lane. Short runs: lanes take (run,
 * vector) pairs. */
__device__ static __forceinline__ void
unit_copy(const unit &x, uint64_t lo, uint64_t hi, unsigned lane)
{
    const dims &d = x.d;
    if (x.bytes) {
        for (uint64_t i = lo + lane; i < hi; i += 32) {
            uint64_t so, dof, run = i / d.run, col = i - run * d.run;
            run_off(d, run, &so, &dof);
            x.dst[dof + col] = x.src[so + col];
        }
        return;
    }
    const uint64_t vpr = d.run / 16;
    if (vpr >= 32) {
        for (uint64_t run = lo / vpr, rb = run * vpr; rb < hi;
             run++, rb += vpr) {
            uint64_t so, dof;
            run_off(d, run, &so, &dof);
            const uint4 *s4 = (const uint4 *)(x.src + so);
            uint4 *d4 = (uint4 *)(x.dst + dof);
            const uint64_t c0 = lo > rb ? lo - rb : 0;
            const uint64_t c1 = hi - rb < vpr ? hi - rb : vpr;
            for (uint64_t base = c0 + lane; base < c1; base += 32 * UNROLL) {
                uint4 v[UNROLL];
#pragma unroll
                for (int k = 0; k < UNROLL; k++)
                    if (base + k * 32 < c1)
                        v[k] = s4[base + k * 32];
#pragma unroll
                for (int k = 0; k < UNROLL; k++)
                    if (base + k * 32 < c1)
                        d4[base + k * 32] = v[k];
            }
        }
        return;
    }
    /* short runs (layout conversion): lanes take (run, vector) pairs;
     * 32-bit index math, a shift when the run is a power of two vectors
     * (64-bit division costs ~100 instructions) */
    const uint32_t v32 = (uint32_t)vpr;
    const uint32_t end = (uint32_t)hi;
    const int pow2 = (v32 & (v32 - 1)) == 0;
    const uint32_t shift = __ffs(v32) - 1;
    const uint32_t n0 = (uint32_t)d.n[0], n1 = (uint32_t)d.n[1];
    for (uint32_t base = (uint32_t)lo + lane; base < end;
         base += 32 * UNROLL) {
        uint4 v[UNROLL];
        uint4 *dp[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            const uint32_t i = base + k * 32;
            dp[k] = nullptr;
            if (i < end) {
                const uint32_t run = pow2 ? i >> shift : i / v32;
                const uint32_t col = i - run * v32;
                const uint32_t a = run % n0, rest = run / n0;
                const uint32_t b = rest % n1, c = rest / n1;
                const uint64_t so = a * d.ss[0] + b * d.ss[1] + c * d.ss[2];
                const uint64_t dof =
                    a * d.ds[0] + b * d.ds[1] + c * d.ds[2];
                v[k] = ((const uint4 *)(x.src + so))[col];
                dp[k] = (uint4 *)(x.dst + dof) + col;
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; k++)
            if (dp[k])
                *dp[k] = v[k];
    }
}

/* Piece t of the launch: units [u0 + t*per, +per) whole when parts == 1,
 * else part t % parts of unit u0 + t / parts, cut at multiples of 32
 * elements (a warp's accesses stay whole 512-byte spans where the runs
 * allow). */
__device__ static __forceinline__ void
piece_copy(const gpu_plan_t &p, uint64_t u0, uint64_t u1, uint32_t parts,
           uint32_t per, uint64_t t, unsigned lane, const packed_arg &pk)
{
    unit x;
    if (parts == 1) {
        uint64_t u = u0 + t * per, e = u + per < u1 ? u + per : u1;
        for (; u < e; u++) {
            unit_get(p, u, x, pk);
            unit_copy(x, 0, x.nelem, lane);
        }
        return;
    }
    unit_get(p, u0 + t / parts, x, pk);
    const uint32_t k = (uint32_t)(t % parts);
    const uint64_t n32 = (x.nelem + 31) / 32;
    uint64_t lo = n32 * k / parts * 32, hi = n32 * (k + 1) / parts * 32;
    if (hi > x.nelem)
        hi = x.nelem;
    if (lo < hi)
        unit_copy(x, lo, hi, lane);
}

__global__ void __launch_bounds__(THREADS, 1)
kvx_copy_kernel(gpu_plan_t p, uint64_t u0, uint64_t u1, uint32_t parts,
                uint32_t per, uint8_t *packed, int packed_mode)
{
    const unsigned lane = threadIdx.x & 31;
    packed_arg pk = {packed, 0, packed_mode};
    if (packed_mode != GPU_PACKED_NONE)
        pk.off0 = packed_off(p, u0);
    const uint64_t npieces =
        parts > 1 ? (u1 - u0) * parts : (u1 - u0 + per - 1) / per;
    const uint64_t warp =
        (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) >> 5;
    const uint64_t nwarps = ((uint64_t)gridDim.x * blockDim.x) >> 5;
    /* the first piece is the warp's own; the rest come from the counter,
     * each fetched while the one before copies */
    for (uint64_t t = warp; t < npieces;) {
        unsigned long long n = 0;
        if (lane == 0)
            n = atomicAdd(&next_piece, 1ull);
        piece_copy(p, u0, u1, parts, per, t, lane, pk);
        t = nwarps + __shfl_sync(0xffffffffu, n, 0);
    }
    if (lane == 0) {
        if (atomicAdd(&warps_done, 1u) == nwarps - 1) {
            /* every warp has taken its last piece: reset for the next
             * launch, which the stream starts after this one ends */
            atomicExch(&next_piece, 0ull);
            atomicExch(&warps_done, 0u);
        }
    }
}

extern "C" int gpu_kernel_launch(const gpu_plan_t *d, uint64_t u0,
                                 uint64_t u1, uint64_t bytes, unsigned ctas,
                                 void *stream, uint8_t *packed,
                                 int packed_mode)
{
    if (u1 <= u0)
        return 0;
    /* pieces of about PIECE_BYTES: parts of a large unit, or whole units
     * grouped (the units of a launch are of one shape, give or take a
     * segment cut at a block boundary), but no fewer pieces than warps
     * where the units allow, so small launches spread over every warp */
    const uint64_t n = u1 - u0, unit = bytes / n;
    const uint64_t warps = (uint64_t)ctas * (THREADS / 32);
    uint64_t parts = 1, per = 1;
    if (unit >= PIECE_BYTES) {
        parts = (unit + PIECE_BYTES / 2) / PIECE_BYTES;
        parts = parts < MAX_PARTS ? parts : MAX_PARTS;
    } else if (unit) {
        per = PIECE_BYTES / unit;
        uint64_t spread = n / warps;
        per = per < spread ? per : spread;
        per = per ? per : 1;
    }
    /* an error an earlier call left on this thread (a failed allocation)
     * must not pass for this launch's: clear it, launch, then ask */
    (void)cudaGetLastError();
    kvx_copy_kernel<<<ctas, THREADS, 0, (cudaStream_t)stream>>>(
        *d, u0, u1, (uint32_t)parts, (uint32_t)per, packed, packed_mode);
    return (int)cudaGetLastError();
}
