/*
 * gpu_kernel — the gather/scatter kernel: copies plan units between any
 * two layouts, reading or writing peer GPU memory (NVLink/PCIe P2P) or
 * mapped host memory. Rows are head_dim * elem_size bytes and move as
 * 16-byte vectors when every address and stride is 16-byte aligned, else
 * as bytes. Any CTA budget works (warps stride over units); the budget is
 * the caller's, since the GPUs are busy running the model.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu_desc.h"

__device__ static inline uint32_t slice_of(const gpu_plan_t *p, uint64_t u)
{
    uint32_t i = 0;
    while (i + 1 < p->nslices && p->slices[i + 1].unit_begin <= u)
        i++;
    return i;
}

#define UNROLL 8

/* A unit's rows as (up to) three strided dimensions around a contiguous
 * run; dimensions contiguous on both sides are merged into the run, as on
 * the host (plan.c copy_strided), so matching layouts copy whole 32 KiB
 * runs with no per-vector index arithmetic. */
struct dims {
    uint64_t n[3], ss[3], ds[3];
    int nd;
    uint64_t run;
};

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

/* One warp per unit at a time (warp-strided over the chunk's units). Long
 * runs: lanes stride over one run's 16-byte vectors, UNROLL loads in
 * flight per lane. Short runs: lanes take (run, vector) pairs. */
__global__ void __launch_bounds__(512, 1)
kvx_copy_kernel(gpu_plan_t p, uint64_t u0, uint64_t u1)
{
    const unsigned lane = threadIdx.x & 31;
    const uint64_t warp =
        (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) >> 5;
    const uint64_t nwarps = ((uint64_t)gridDim.x * blockDim.x) >> 5;
    const uint32_t nsegs = p.nsegs;
    for (uint64_t u = u0 + warp; u < u1; u += nwarps) {
        const gpu_slice_t *s = &p.slices[slice_of(&p, u)];
        const uint64_t r = u - s->unit_begin;
        const uint32_t layer = s->layer0 + (uint32_t)(r / nsegs);
        const gpu_seg_t g = p.segs[r % nsegs];
        const uint8_t *src =
            s->src.base + s->src.layer_offset[layer - s->src_layer_base] +
            (uint64_t)s->src.blocks[g.src_blk] * s->src.block_stride +
            (uint64_t)g.src_tok * s->src.token_stride +
            (uint64_t)(s->head0 - s->src_head_base) * s->src.head_stride;
        uint8_t *dst =
            p.dst.base + p.dst.layer_offset[layer - s->dst_layer_base] +
            (uint64_t)p.dst.blocks[g.dst_blk] * p.dst.block_stride +
            (uint64_t)g.dst_tok * p.dst.token_stride +
            (uint64_t)(s->head0 - s->dst_head_base) * p.dst.head_stride;
        dims d;
        d.nd = 3;
        d.run = p.row_bytes;
        d.n[0] = s->nheads;
        d.ss[0] = s->src.head_stride;
        d.ds[0] = p.dst.head_stride;
        d.n[1] = g.n;
        d.ss[1] = s->src.token_stride;
        d.ds[1] = p.dst.token_stride;
        d.n[2] = p.kv_factor;
        d.ss[2] = s->src.kv_stride;
        d.ds[2] = p.dst.kv_stride;
        merge(d);
        const uint64_t nruns = d.n[0] * d.n[1] * d.n[2];
        uint64_t align = (uintptr_t)src | (uintptr_t)dst | d.run;
        for (int i = 0; i < 3; i++)
            align |= d.ss[i] | d.ds[i];
        if (align & 15) { /* unaligned rows: bytes */
            for (uint64_t i = lane; i < nruns * d.run; i += 32) {
                uint64_t so, dof, run = i / d.run, col = i - run * d.run;
                run_off(d, run, &so, &dof);
                dst[dof + col] = src[so + col];
            }
            continue;
        }
        const uint64_t vpr = d.run / 16;
        if (vpr >= 32) {
            for (uint64_t run = 0; run < nruns; run++) {
                uint64_t so, dof;
                run_off(d, run, &so, &dof);
                const uint4 *s4 = (const uint4 *)(src + so);
                uint4 *d4 = (uint4 *)(dst + dof);
                for (uint64_t base = lane; base < vpr; base += 32 * UNROLL) {
                    uint4 v[UNROLL];
#pragma unroll
                    for (int k = 0; k < UNROLL; k++)
                        if (base + k * 32 < vpr)
                            v[k] = s4[base + k * 32];
#pragma unroll
                    for (int k = 0; k < UNROLL; k++)
                        if (base + k * 32 < vpr)
                            d4[base + k * 32] = v[k];
                }
            }
        } else {
            /* short runs (layout conversion): lanes take (run, vector)
             * pairs; 32-bit index math, a shift when the run is a power
             * of two vectors (64-bit division costs ~100 instructions) */
            const uint32_t v32 = (uint32_t)vpr;
            const uint32_t nvec = (uint32_t)(nruns * vpr);
            const int pow2 = (v32 & (v32 - 1)) == 0;
            const uint32_t shift = __ffs(v32) - 1;
            const uint32_t n0 = (uint32_t)d.n[0], n1 = (uint32_t)d.n[1];
            for (uint32_t base = lane; base < nvec; base += 32 * UNROLL) {
                uint4 v[UNROLL];
                uint4 *dp[UNROLL];
#pragma unroll
                for (int k = 0; k < UNROLL; k++) {
                    const uint32_t i = base + k * 32;
                    dp[k] = nullptr;
                    if (i < nvec) {
                        const uint32_t run = pow2 ? i >> shift : i / v32;
                        const uint32_t col = i - run * v32;
                        const uint32_t a = run % n0, rest = run / n0;
                        const uint32_t b = rest % n1, c = rest / n1;
                        const uint64_t so =
                            a * d.ss[0] + b * d.ss[1] + c * d.ss[2];
                        const uint64_t dof =
                            a * d.ds[0] + b * d.ds[1] + c * d.ds[2];
                        v[k] = ((const uint4 *)(src + so))[col];
                        dp[k] = (uint4 *)(dst + dof) + col;
                    }
                }
#pragma unroll
                for (int k = 0; k < UNROLL; k++)
                    if (dp[k])
                        *dp[k] = v[k];
            }
        }
    }
}

extern "C" int gpu_kernel_launch(const gpu_plan_t *d, uint64_t u0,
                                 uint64_t u1, unsigned ctas, void *stream)
{
    if (u1 <= u0)
        return 0;
    kvx_copy_kernel<<<ctas, 512, 0, (cudaStream_t)stream>>>(*d, u0, u1);
    return (int)cudaGetLastError();
}
