/* gpu_desc — a plan as the GPU copy kernel reads it; see gpu_desc.h.
 * No CUDA here: gpu.c uploads what this builds, and the CPU tests run
 * the kernel's walk (gpu_walk.h) over it in host memory. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/layout.h"
#include "gpu_desc.h"
#include "gpu_walk.h"
#include "plan.h"

/* Bump allocator over one host buffer that is then copied to the device
 * in one go; offsets become pointers at base. */
struct pack {
    uint8_t *buf;
    size_t len, cap;
};

static size_t pack_add(struct pack *pk, const void *src, size_t n)
{
    size_t off = (pk->len + 15) & ~(size_t)15;
    if (off + n > pk->cap)
        return (size_t)-1;
    if (n) /* an unbound side (packed, between daemons) adds nothing */
        memcpy(pk->buf + off, src, n);
    pk->len = off + n;
    return off;
}

/* The part table of a bound side m (gpu_side_t.part): each (layer, kv)
 * part's address, its region's start (as the kernel's device sees it:
 * m's regions are that view) + its offset, K entries per layer. NULL
 * for an unbound side (*n 0), or on allocation failure. */
static uint64_t *part_table(const plan_mem_t *m, uint32_t K, size_t *n,
                            int *nomem)
{
    const kvx_layout_t *l = m->layout;
    *n = 0;
    if (!m->blocks || !m->regions)
        return NULL;
    uint64_t *t = malloc((size_t)l->num_layers * K * sizeof(*t) + 1);
    if (!t) {
        *nomem = 1;
        return NULL;
    }
    for (uint32_t a = 0; a < l->num_layers; a++)
        for (uint32_t k = 0; k < K; k++) {
            uint32_t r;
            uint64_t o = kvx__layout_part(l, a, k, &r);
            t[(size_t)a * K + k] = (uintptr_t)m->regions[r].base + o;
        }
    *n = (size_t)l->num_layers * K;
    return t;
}

size_t gpu_desc_size(const plan_t *p)
{
    const kvx_layout_t *dl = p->dst.layout;
    const uint32_t K = dl->kv_factor;
    size_t cap =
        64 + p->nslices * sizeof(gpu_slice_t) + 16 +
        p->nsegs * sizeof(gpu_seg_t) + 16 + (p->nsegs + 1) * sizeof(uint64_t) +
        16 + p->dst.num_blocks * 4 + 16 + (size_t)dl->num_layers * K * 8 + 16;
    for (uint32_t i = 0; i < p->nslices; i++)
        cap += p->src[i].num_blocks * 4 + 16 +
               (size_t)p->src[i].layout->num_layers * K * 8 + 16;
    return cap;
}

int gpu_desc_pack(const plan_t *p, const gpu_desc_buf_t *b, gpu_plan_t *out,
                  size_t *off_sblk, size_t *len, kvx_why_t *why)
{
    uint8_t *buf = b->buf;
    const size_t cap = b->cap;
    const uint64_t base = b->base;
    const kvx_layout_t *dl = p->dst.layout;
    const uint32_t K = dl->kv_factor;
    const uint64_t row = (uint64_t)dl->head_dim * dl->elem_size;
    /* the kernel's indices inside a unit and a slice are 32-bit */
    uint32_t maxn = 0, maxh = 0;
    for (uint32_t i = 0; i < p->nsegs; i++)
        maxn = p->segs[i].n > maxn ? p->segs[i].n : maxn;
    for (uint32_t i = 0; i < p->nslices; i++) {
        const plan_slice_t *s = &p->slices[i];
        maxh = s->nheads > maxh ? s->nheads : maxh;
        if ((uint64_t)s->nlayers * p->nsegs >> 32)
            return why_fail(why, KVX_ERR_UNSUPPORTED,
                            "fetch: %u layers x %u segments in one slice: more "
                            "units than the GPU kernel takes (2^32)",
                            s->nlayers, p->nsegs);
    }
    if ((uint64_t)K * maxn * maxh * row >= GPU_UNIT_MAX)
        return why_fail(why, KVX_ERR_UNSUPPORTED,
                        "fetch: units of %llu bytes: more than the GPU kernel "
                        "takes (%llu)",
                        (unsigned long long)((uint64_t)K * maxn * maxh * row),
                        (unsigned long long)GPU_UNIT_MAX - 1);
    int nomem = 0;
    struct pack pk = {buf, 0, cap};
    gpu_slice_t *sl = calloc(p->nslices ? p->nslices : 1, sizeof(*sl));
    uint64_t *seg_tok = malloc((p->nsegs + 1) * sizeof(uint64_t));
    size_t *off_spart = calloc(p->nslices ? p->nslices : 1, sizeof(size_t));
    if (!sl || !seg_tok || !off_spart)
        goto err_nomem;
    /* the slices array goes first, so its offset is 0 */
    size_t off_slices = pack_add(&pk, sl, p->nslices * sizeof(gpu_slice_t));
    size_t off_segs = pack_add(&pk, p->segs, p->nsegs * sizeof(gpu_seg_t));
    /* packed offsets (between daemons): tokens before each segment */
    seg_tok[0] = 0;
    for (uint32_t i = 0; i < p->nsegs; i++)
        seg_tok[i + 1] = seg_tok[i] + p->segs[i].n;
    size_t off_segtok =
        pack_add(&pk, seg_tok, (p->nsegs + 1) * sizeof(uint64_t));
    size_t off_dblk = pack_add(&pk, p->dst.blocks, p->dst.num_blocks * 4);
    size_t nt;
    uint64_t *tab = part_table(&p->dst, K, &nt, &nomem);
    size_t off_dpart = pack_add(&pk, tab, nt * 8);
    free(tab);
    for (uint32_t i = 0; i < p->nslices; i++) {
        off_sblk[i] = pack_add(&pk, p->src[i].blocks, p->src[i].num_blocks * 4);
        tab = part_table(&p->src[i], K, &nt, &nomem);
        off_spart[i] = pack_add(&pk, tab, nt * 8);
        free(tab);
    }
    if (nomem)
        goto err_nomem;
    uint64_t packed = 0;
    for (uint32_t i = 0; i < p->nslices; i++) {
        const plan_slice_t *s = &p->slices[i];
        const kvx_layout_t *l = p->src[i].layout;
        uint64_t begin = packed;
        packed +=
            (uint64_t)s->nlayers * seg_tok[p->nsegs] * s->nheads * K * row;
        sl[i] =
            (gpu_slice_t){s->layer0,
                          s->nlayers,
                          s->head0,
                          s->nheads,
                          s->src_layer_base,
                          s->src_head_base,
                          s->dst_layer_base,
                          s->dst_head_base,
                          s->unit_begin,
                          begin,
                          {(const uint32_t *)(uintptr_t)(base + off_sblk[i]),
                           (const uint64_t *)(uintptr_t)(base + off_spart[i]),
                           l->block_stride, l->token_stride, l->head_stride}};
    }
    memcpy(pk.buf + off_slices, sl, p->nslices * sizeof(gpu_slice_t));
    *out = (gpu_plan_t){p->nslices,
                        p->nsegs,
                        (uint32_t)row,
                        K,
                        gpu_fdiv_make(p->nsegs ? p->nsegs : 1),
                        (const gpu_slice_t *)(uintptr_t)(base + off_slices),
                        (const gpu_seg_t *)(uintptr_t)(base + off_segs),
                        (const uint64_t *)(uintptr_t)(base + off_segtok),
                        {(const uint32_t *)(uintptr_t)(base + off_dblk),
                         (const uint64_t *)(uintptr_t)(base + off_dpart),
                         dl->block_stride, dl->token_stride, dl->head_stride}};
    *len = pk.len;
    free(off_spart);
    free(seg_tok);
    free(sl);
    return 0;

err_nomem:
    free(off_spart);
    free(seg_tok);
    free(sl);
    return why_fail(why, KVX_ERR_NOMEM,
                    "fetch: out of memory for the GPU plan");
}

/* Runs being joined by gpu_desc_runs(): a run waits in the slot of the
 * address its source continues at, so that a later run that starts there
 * (on both sides) extends it, whatever came between. A layout that keeps
 * the blocks of one layer's K together (vLLM's, a request's blocks in
 * order) yields its runs block by block, layer and K or V inside each:
 * 2 x layers runs are open at once, each growing by a block. */
#define OPEN_RUNS 256 /* a power of 2; 2 x 128 layers */

typedef struct open_run {
    uint64_t src, dst, len; /* len 0: the slot is free */
} open_run_t;

static unsigned open_slot(uint64_t src)
{
    /* Fibonacci hashing of the address (runs start at least 2 bytes
     * apart: the low bits say little) */
    return (unsigned)((src >> 1) * 0x9E3779B97F4A7C15ull >> 56) &
           (OPEN_RUNS - 1);
}

/* Run [s, s + len) -> [d, ...) joins the open run it continues, or is
 * opened in the slot where it would continue, emitting the run there. */
static int open_add(open_run_t *o, uint64_t d, uint64_t s, uint64_t len,
                    gpu_run_fn emit, void *arg)
{
    open_run_t *at = &o[open_slot(s)];
    if (at->len && at->src + at->len == s && at->dst + at->len == d) {
        at->len += len;
        open_run_t *to = &o[open_slot(s + len)];
        if (to == at)
            return 0;
        int rc = to->len ? emit(arg, to->dst, to->src, to->len) : 0;
        *to = *at;
        at->len = 0;
        return rc;
    }
    open_run_t *to = &o[open_slot(s + len)];
    int rc = to->len ? emit(arg, to->dst, to->src, to->len) : 0;
    *to = (open_run_t){s, d, len};
    return rc;
}

/* Runs are found by the kernel's own resolution of a unit (gpu_unit_get:
 * dimensions contiguous on both sides are already merged into its run),
 * then runs that continue an earlier one on both sides are joined
 * (open_add): adjacent blocks, K then V of regions back to back. Every
 * byte of the units is emitted once; the order is not the units'. */
int gpu_desc_runs(const gpu_plan_t *g, const gpu_launch_t *l, gpu_run_fn emit,
                  void *arg)
{
    if (l->u1 <= l->u0)
        return 0;
    uint32_t hint = gpu_slice_find(g, l->u0);
    const uint64_t poff0 = l->packed_mode != GPU_PACKED_NONE
                               ? gpu_packed_off(g, &g->slices[hint], l->u0)
                               : 0;
    open_run_t open[OPEN_RUNS] = {{0}};
    int rc = 0;
    for (uint64_t u = l->u0; u < l->u1 && !rc; u++) {
        gpu_unit_t x;
        gpu_unit_get(g, l, &hint, poff0, u, &x);
        const uint64_t run = (uint64_t)x.er << x.eshift;
        for (uint32_t c = 0; c < x.n[2] && !rc; c++)
            for (uint32_t b = 0; b < x.n[1] && !rc; b++)
                for (uint32_t a = 0; a < x.n[0] && !rc; a++)
                    rc = open_add(
                        open, x.dst + a * x.ds[0] + b * x.ds[1] + c * x.ds[2],
                        x.src + a * x.ss[0] + b * x.ss[1] + c * x.ss[2], run,
                        emit, arg);
    }
    for (unsigned i = 0; i < OPEN_RUNS && !rc; i++)
        if (open[i].len)
            rc = emit(arg, open[i].dst, open[i].src, open[i].len);
    return rc;
}

uint64_t gpu_desc_unit_run(const gpu_plan_t *g, const gpu_launch_t *l)
{
    if (l->u1 <= l->u0)
        return 0;
    uint32_t hint = gpu_slice_find(g, l->u0);
    const uint64_t poff0 = l->packed_mode != GPU_PACKED_NONE
                               ? gpu_packed_off(g, &g->slices[hint], l->u0)
                               : 0;
    gpu_unit_t x;
    gpu_unit_get(g, l, &hint, poff0, l->u0, &x);
    return (uint64_t)x.er << x.eshift;
}

/* gpu_desc_runs_upto()'s count, before the caller's emit. */
typedef struct runs_upto {
    uint64_t n, max;
    gpu_run_fn emit;
    void *arg;
} runs_upto_t;

static int upto_run(void *arg, uint64_t dst, uint64_t src, uint64_t len)
{
    runs_upto_t *u = arg;
    if (++u->n > u->max)
        return GPU_RUNS_MANY;
    return u->emit ? u->emit(u->arg, dst, src, len) : 0;
}

int gpu_desc_runs_upto(const gpu_plan_t *g, const gpu_launch_t *l, uint64_t max,
                       gpu_run_fn emit, void *arg)
{
    runs_upto_t u = {0, max, emit, arg};
    return gpu_desc_runs(g, l, upto_run, &u);
}

int gpu_desc_runs_long(const gpu_plan_t *g, const gpu_launch_t *l,
                       uint64_t bytes, uint64_t min_run)
{
    if (gpu_desc_unit_run(g, l) >= min_run)
        return 1;
    return gpu_desc_runs_upto(g, l, min_run ? bytes / min_run : UINT64_MAX,
                              NULL, NULL) == 0;
}

int gpu_desc_runs_auto(const gpu_plan_t *g, const gpu_launch_t *l,
                       uint64_t bytes, uint64_t min_run, uint64_t cap,
                       gpu_run_fn emit, void *arg)
{
    const uint64_t max = min_run ? bytes / min_run : UINT64_MAX;
    if (gpu_desc_unit_run(g, l) < min_run && max <= cap) /* one walk */
        return gpu_desc_runs_upto(g, l, max, emit, arg);
    if (!gpu_desc_runs_long(g, l, bytes, min_run)) /* counted first */
        return GPU_RUNS_MANY;
    return gpu_desc_runs(g, l, emit, arg);
}
