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

/* Address of element row `row` (kv, token, head order) inside a unit. */
struct unit_addr {
    const uint8_t *src;
    uint8_t *dst;
    uint64_t s_kv, s_tok, s_head, d_kv, d_tok, d_head;
    uint32_t nheads, ntok;
};

__device__ static inline void row_ptrs(const unit_addr &a, uint32_t row,
                                       const uint8_t **s, uint8_t **d)
{
    const uint32_t h = row % a.nheads;
    const uint32_t rest = row / a.nheads;
    const uint32_t t = rest % a.ntok;
    const uint32_t kv = rest / a.ntok;
    *s = a.src + kv * a.s_kv + t * a.s_tok + h * a.s_head;
    *d = a.dst + kv * a.d_kv + t * a.d_tok + h * a.d_head;
}

/* One warp per unit at a time (warp-strided over the chunk's units); the
 * lanes of the warp stride over the unit's 16-byte vectors, UNROLL loads
 * in flight per lane before the stores, so reads over NVLink or PCIe
 * keep enough bytes outstanding. */
__global__ void kvx_copy_kernel(gpu_plan_t p, uint64_t u0, uint64_t u1)
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
        unit_addr a;
        a.src = s->src.base + s->src.layer_offset[layer - s->src_layer_base] +
                (uint64_t)s->src.blocks[g.src_blk] * s->src.block_stride +
                (uint64_t)g.src_tok * s->src.token_stride +
                (uint64_t)(s->head0 - s->src_head_base) * s->src.head_stride;
        a.dst = p.dst.base + p.dst.layer_offset[layer - s->dst_layer_base] +
                (uint64_t)p.dst.blocks[g.dst_blk] * p.dst.block_stride +
                (uint64_t)g.dst_tok * p.dst.token_stride +
                (uint64_t)(s->head0 - s->dst_head_base) * p.dst.head_stride;
        a.s_kv = s->src.kv_stride;
        a.s_tok = s->src.token_stride;
        a.s_head = s->src.head_stride;
        a.d_kv = p.dst.kv_stride;
        a.d_tok = p.dst.token_stride;
        a.d_head = p.dst.head_stride;
        a.nheads = s->nheads;
        a.ntok = g.n;
        const uint32_t rows = p.kv_factor * g.n * s->nheads;
        const int vec_ok =
            ((((uintptr_t)a.src | (uintptr_t)a.dst | a.s_kv | a.s_tok |
               a.s_head | a.d_kv | a.d_tok | a.d_head | p.row_bytes) &
              15) == 0);
        if (vec_ok) {
            const uint32_t vpr = p.row_bytes / 16;
            const uint32_t nvec = rows * vpr;
            for (uint32_t base = lane; base < nvec; base += 32 * UNROLL) {
                uint4 v[UNROLL];
                uint4 *dp[UNROLL];
#pragma unroll
                for (int k = 0; k < UNROLL; k++) {
                    const uint32_t i = base + k * 32;
                    dp[k] = nullptr;
                    if (i < nvec) {
                        const uint32_t row = i / vpr, col = i - row * vpr;
                        const uint8_t *sp;
                        uint8_t *d;
                        row_ptrs(a, row, &sp, &d);
                        v[k] = ((const uint4 *)sp)[col];
                        dp[k] = (uint4 *)d + col;
                    }
                }
#pragma unroll
                for (int k = 0; k < UNROLL; k++)
                    if (dp[k])
                        *dp[k] = v[k];
            }
        } else {
            const uint64_t nbytes = (uint64_t)rows * p.row_bytes;
            for (uint64_t i = lane; i < nbytes; i += 32) {
                const uint32_t row = (uint32_t)(i / p.row_bytes);
                const uint32_t col = (uint32_t)(i - (uint64_t)row * p.row_bytes);
                const uint8_t *sp;
                uint8_t *d;
                row_ptrs(a, row, &sp, &d);
                d[col] = sp[col];
            }
        }
    }
}

extern "C" int gpu_kernel_launch(const gpu_plan_t *d, uint64_t u0,
                                 uint64_t u1, unsigned ctas, void *stream)
{
    if (u1 <= u0)
        return 0;
    kvx_copy_kernel<<<ctas, 256, 0, (cudaStream_t)stream>>>(*d, u0, u1);
    return (int)cudaGetLastError();
}
