/*
 * gpu_walk — how the GPU copy kernel walks a launch: the cut into pieces
 * (host), a unit's addresses and shape (once per unit or part), and each
 * lane's cursor over the unit's elements (a few integer operations per
 * 16-byte vector, no division on the way).
 *
 * Plain C over gpu_desc.h's structs, so that the kernel (gpu_kernel.cu),
 * the host that cuts a launch and the CPU test that runs the same walk
 * over host memory (tests/unit/test_plan.c) share every index: what the
 * test proves on the CPU is what the GPU computes. Nothing here loads or
 * stores pool data, synchronizes or allocates.
 */
#ifndef KVX_GPU_WALK_H
#define KVX_GPU_WALK_H

#include <stdint.h>

#include "gpu_desc.h"

#ifdef __CUDACC__
#define GPU_FN static __host__ __device__ __forceinline__
#define GPU_UNROLL _Pragma("unroll")
#else
#define GPU_FN static inline
#define GPU_UNROLL
#endif
#ifdef __CUDA_ARCH__
#define GPU_UMULHI(a, b) __umulhi((a), (b))
#else
#define GPU_UMULHI(a, b) ((uint32_t)(((uint64_t)(a) * (b)) >> 32))
#endif

/* A warp's piece is about GPU_PIECE_BYTES: a part of a unit (a power of
 * two of parts, cut at multiples of GPU_PART_ALIGN bytes, so a warp's
 * accesses stay whole 512-byte spans where the runs allow) or a few
 * whole small units. Small launches are cut finer, down to
 * GPU_PIECE_MIN, so that every warp gets a piece. */
#ifndef GPU_PIECE_BYTES /* -D for measurements */
#define GPU_PIECE_BYTES (16u << 10)
#endif
#define GPU_PIECE_MIN (2u << 10)
#define GPU_PART_ALIGN 512u
/* The kernel's indices within a unit are 32-bit: gpu.c refuses a plan
 * whose units may be larger, or whose slices have 2^32 units or more
 * (neither is near any real model's). */
#define GPU_UNIT_MAX (1ull << 31)

/* n / d by a multiply: m = floor((2^32 - 1) / d) gives a quotient at most
 * two short for every n < 2^32; two corrections make it exact. */
GPU_FN gpu_fdiv_t gpu_fdiv_make(uint32_t d)
{
    gpu_fdiv_t f;
    f.d = d;
    f.m = 0xffffffffu / d;
    return f;
}

GPU_FN uint32_t gpu_fdiv(uint32_t n, gpu_fdiv_t f)
{
    uint32_t q = GPU_UMULHI(n, f.m);
    uint32_t r = n - q * f.d;
    if (r >= f.d) {
        q++;
        r -= f.d;
    }
    if (r >= f.d)
        q++;
    return q;
}

/* Cut units [l->u0, l->u1), bytes in all, for warps warps: sets pshift,
 * per, part_bytes and npieces (u0 < u1). */
GPU_FN void gpu_launch_cut(gpu_launch_t *l, uint64_t bytes, uint64_t warps)
{
    const uint64_t n = l->u1 - l->u0, unit = bytes / n;
    l->pshift = 0;
    l->per = 1;
    l->part_bytes = ~0ull;
    if (unit >= 2 * GPU_PIECE_MIN) {
        uint32_t s = 0;
        while ((unit >> (s + 1)) >= GPU_PIECE_BYTES)
            s++;
        while ((n << s) < warps && (unit >> (s + 1)) >= GPU_PIECE_MIN)
            s++;
        if (s) {
            const uint64_t pb = (unit + (1ull << s) - 1) >> s;
            l->pshift = s;
            l->part_bytes =
                (pb + GPU_PART_ALIGN - 1) / GPU_PART_ALIGN * GPU_PART_ALIGN;
        }
    } else if (unit) {
        uint64_t per = GPU_PIECE_BYTES / unit, spread = n / warps;
        per = per < spread ? per : spread;
        l->per = per > 1 ? (uint32_t)per : 1;
    }
    l->npieces = l->per > 1 ? (n + l->per - 1) / l->per : n << l->pshift;
}

/* Units of piece t: per of them from u0 + t * per (the last piece fewer),
 * else one. */
GPU_FN uint32_t gpu_piece_units(const gpu_launch_t *l, uint64_t t)
{
    if (l->per == 1)
        return 1;
    const uint64_t left = l->u1 - (l->u0 + t * l->per);
    return left < l->per ? (uint32_t)left : l->per;
}

/* The slice of unit u, searching forward from *hint (a slice at or
 * before u's: a warp's pieces only move forward); updates *hint. */
GPU_FN uint32_t gpu_slice_at(const gpu_plan_t *p, uint32_t *hint, uint64_t u)
{
    uint32_t i = *hint;
    while (i + 1 < p->nslices && p->slices[i + 1].unit_begin <= u)
        i++;
    *hint = i;
    return i;
}

/* The first slice at or before unit u by bisection (a launch's start). */
GPU_FN uint32_t gpu_slice_find(const gpu_plan_t *p, uint64_t u)
{
    uint32_t lo = 0, hi = p->nslices; /* slices[lo].unit_begin <= u */
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (p->slices[mid].unit_begin <= u)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Unit r of a slice (r < 2^32) as (layer within the slice, segment). */
GPU_FN void gpu_unit_split(const gpu_plan_t *p, uint32_t r, uint32_t *layer,
                           uint32_t *seg)
{
    const uint32_t q = gpu_fdiv(r, p->segs_div);
    *layer = q;
    *seg = r - q * p->nsegs;
}

/* Where unit u of slice s starts in a packed buffer (plan order). */
GPU_FN uint64_t gpu_packed_off(const gpu_plan_t *p, const gpu_slice_t *s,
                               uint64_t u)
{
    uint32_t layer, seg;
    gpu_unit_split(p, (uint32_t)(u - s->unit_begin), &layer, &seg);
    const uint64_t per_tok = (uint64_t)s->nheads * p->kv_factor * p->row_bytes;
    return s->packed_begin +
           ((uint64_t)layer * p->seg_tok[p->nsegs] + p->seg_tok[seg]) * per_tok;
}

/* A unit resolved: its first source and destination bytes, up to three
 * strided dimensions around a contiguous run (n[0] varies fastest), and
 * its elements: 16-byte vectors when every address and stride allows,
 * else bytes. */
typedef struct gpu_unit {
    uint64_t src, dst;
    uint64_t ss[3], ds[3];
    uint32_t n[3];
    uint32_t nelem;
    uint32_t er;       /* elements a run */
    uint32_t q32, r32; /* 32 elements = q32 runs + r32 elements */
    uint32_t eshift;   /* log2 of the element's bytes: 4 or 0 */
} gpu_unit_t;

/* Dimensions contiguous on both sides merge into the run, as on the host
 * (plan.c copy_strided), so matching layouts copy whole runs (32 KiB
 * for 16 tokens x 8 heads x 128 bf16) with no index arithmetic between
 * their vectors. A K to V step that equals the run (two regions that
 * lie back to back in the device's address space) merges too. A merged
 * dimension is left as n 1; the ones left are then moved to the front,
 * in their order. Every index is a constant, so that the kernel keeps
 * the arrays in registers. */
GPU_FN void gpu_unit_merge(uint64_t n[3], uint64_t ss[3], uint64_t ds[3],
                           uint64_t *run)
{
    GPU_UNROLL
    for (int pass = 0; pass < 3; pass++)
        GPU_UNROLL
    for (int i = 0; i < 3; i++)
        if (n[i] != 1 && ss[i] == *run && ds[i] == *run) {
            *run *= n[i];
            n[i] = 1;
        }
    GPU_UNROLL
    for (int i = 0; i < 3; i++)
        if (n[i] == 1)
            ss[i] = ds[i] = 0;
    GPU_UNROLL
    for (int pass = 0; pass < 2; pass++)
        GPU_UNROLL
    for (int i = 0; i < 2; i++)
        if (n[i] == 1 && n[i + 1] != 1) {
            n[i] = n[i + 1];
            ss[i] = ss[i + 1];
            ds[i] = ds[i + 1];
            n[i + 1] = 1;
            ss[i + 1] = ds[i + 1] = 0;
        }
}

/* Resolve unit u of the launch (slice *hint onwards, see gpu_slice_at);
 * poff0 is gpu_packed_off() of l->u0 when one side is packed. */
GPU_FN void gpu_unit_get(const gpu_plan_t *p, const gpu_launch_t *l,
                         uint32_t *hint, uint64_t poff0, uint64_t u,
                         gpu_unit_t *x)
{
    const gpu_slice_t *s = &p->slices[gpu_slice_at(p, hint, u)];
    uint32_t lrel, segi;
    gpu_unit_split(p, (uint32_t)(u - s->unit_begin), &lrel, &segi);
    const uint32_t layer = s->layer0 + lrel;
    const gpu_seg_t g = p->segs[segi];
    const uint32_t K = p->kv_factor;
    uint64_t n[3], ss[3], ds[3], run = p->row_bytes;
    /* a packed side is not bound: its tables are empty, never read.
     * Addresses are integers here: the K to V step of two regions may be
     * "negative" */
    ss[2] = ds[2] = 0;
    x->src = x->dst = 0;
    if (l->packed_mode != GPU_PACKED_SCATTER) {
        const uint64_t *sp =
            s->src.part + (uint64_t)(layer - s->src_layer_base) * K;
        x->src = sp[0] +
                 (uint64_t)s->src.blocks[g.src_blk] * s->src.block_stride +
                 (uint64_t)g.src_tok * s->src.token_stride +
                 (uint64_t)(s->head0 - s->src_head_base) * s->src.head_stride;
        if (K > 1)
            ss[2] = sp[1] - sp[0];
    }
    if (l->packed_mode != GPU_PACKED_GATHER) {
        const uint64_t *dp =
            p->dst.part + (uint64_t)(layer - s->dst_layer_base) * K;
        x->dst = dp[0] +
                 (uint64_t)p->dst.blocks[g.dst_blk] * p->dst.block_stride +
                 (uint64_t)g.dst_tok * p->dst.token_stride +
                 (uint64_t)(s->head0 - s->dst_head_base) * p->dst.head_stride;
        if (K > 1)
            ds[2] = dp[1] - dp[0];
    }
    n[0] = s->nheads;
    ss[0] = s->src.head_stride;
    ds[0] = p->dst.head_stride;
    n[1] = g.n;
    ss[1] = s->src.token_stride;
    ds[1] = p->dst.token_stride;
    n[2] = K;
    if (l->packed_mode != GPU_PACKED_NONE) { /* one side is the slot */
        const uint64_t at =
            (uint64_t)(uintptr_t)l->packed + (gpu_packed_off(p, s, u) - poff0);
        const uint64_t st0 = p->row_bytes,
                       st1 = (uint64_t)s->nheads * p->row_bytes,
                       st2 = (uint64_t)g.n * s->nheads * p->row_bytes;
        if (l->packed_mode == GPU_PACKED_GATHER) {
            x->dst = at;
            ds[0] = st0;
            ds[1] = st1;
            ds[2] = st2;
        } else {
            x->src = at;
            ss[0] = st0;
            ss[1] = st1;
            ss[2] = st2;
        }
    }
    gpu_unit_merge(n, ss, ds, &run);
    uint64_t align = x->src | x->dst | run;
    GPU_UNROLL
    for (int i = 0; i < 3; i++) {
        align |= ss[i] | ds[i];
        x->n[i] = (uint32_t)n[i];
        x->ss[i] = ss[i];
        x->ds[i] = ds[i];
    }
    x->eshift = (align & 15) ? 0 : 4;
    x->er = (uint32_t)run >> x->eshift;
    x->q32 = 32 / x->er;
    x->r32 = 32 - x->q32 * x->er;
    x->nelem = (uint32_t)(n[0] * n[1] * n[2]) * x->er;
}

/* An item: a unit resolved, and the element range [lo, hi) of it that
 * one piece copies. */
typedef struct gpu_item {
    gpu_unit_t x;
    uint32_t lo, hi;
} gpu_item_t;

/* Piece t's unit j: the unit resolved in it->x, and the element range
 * [it->lo, it->hi) of it: the whole unit, or part t % parts of it (the
 * last part takes what the others leave). Empty when the unit is smaller
 * than the part's start. */
GPU_FN void gpu_item_get(const gpu_plan_t *p, const gpu_launch_t *l,
                         uint32_t *hint, uint64_t poff0, uint64_t t, uint32_t j,
                         gpu_item_t *it)
{
    gpu_unit_t *x = &it->x;
    uint64_t u, b0 = 0, b1 = ~0ull;
    if (l->per > 1) {
        u = l->u0 + t * l->per + j;
    } else {
        const uint64_t mask = (1ull << l->pshift) - 1, k = t & mask;
        u = l->u0 + (t >> l->pshift);
        b0 = k * l->part_bytes;
        if (k != mask)
            b1 = b0 + l->part_bytes;
    }
    gpu_unit_get(p, l, hint, poff0, u, x);
    const uint64_t ub = (uint64_t)x->nelem << x->eshift;
    b1 = b1 < ub ? b1 : ub;
    b0 = b0 < b1 ? b0 : b1;
    it->lo = (uint32_t)(b0 >> x->eshift);
    it->hi = (uint32_t)(b1 >> x->eshift);
}

/* A lane's place in a unit: element col of run (a, b, c), at byte
 * offsets so and dof from the unit's first source and destination
 * bytes. */
typedef struct gpu_cur {
    uint64_t so, dof;
    uint32_t col, a, b, c;
} gpu_cur_t;

GPU_FN void gpu_cur_offsets(const gpu_unit_t *x, gpu_cur_t *k)
{
    const uint64_t col = (uint64_t)k->col << x->eshift;
    k->so = k->a * x->ss[0] + k->b * x->ss[1] + k->c * x->ss[2] + col;
    k->dof = k->a * x->ds[0] + k->b * x->ds[1] + k->c * x->ds[2] + col;
}

/* Place k at element e of x (e may lie past the end: arithmetic only). */
GPU_FN void gpu_cur_init(const gpu_unit_t *x, uint32_t e, gpu_cur_t *k)
{
    uint32_t run = e / x->er;
    k->col = e - run * x->er;
    k->a = run % x->n[0];
    run /= x->n[0];
    k->b = run % x->n[1];
    k->c = run / x->n[1];
    gpu_cur_offsets(x, k);
}

/* Move k 32 elements on (a warp's step): the column moves, and the run
 * only when a run ends; a division only when a dimension wraps. */
GPU_FN void gpu_cur_step(const gpu_unit_t *x, gpu_cur_t *k)
{
    uint32_t adv = x->q32;
    k->col += x->r32;
    if (k->col >= x->er) {
        k->col -= x->er;
        adv++;
    }
    if (!adv) {
        k->so += 32u << x->eshift;
        k->dof += 32u << x->eshift;
        return;
    }
    k->a += adv;
    if (k->a >= x->n[0]) {
        uint32_t q = k->a / x->n[0];
        k->a -= q * x->n[0];
        k->b += q;
        if (k->b >= x->n[1]) {
            q = k->b / x->n[1];
            k->b -= q * x->n[1];
            k->c += q;
        }
    }
    gpu_cur_offsets(x, k);
}

#endif /* KVX_GPU_WALK_H */
