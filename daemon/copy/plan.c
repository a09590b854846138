/* plan — slices, segments and the host copy engine; see plan.h. */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/layout.h"
#include "plan.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

uint32_t plan_side_ranks(const plan_side_t *s) { return s->tp * s->pp * s->cp; }

uint32_t plan_pp_layers(const plan_side_t *s, uint32_t p, uint32_t *first)
{
    uint32_t f = 0;
    if (s->num_layers_per_pp) {
        for (uint32_t i = 0; i < p; i++)
            f += s->layers_per_pp[i];
        *first = f;
        return s->layers_per_pp[p];
    }
    uint32_t base = s->total_layers / s->pp, rem = s->total_layers % s->pp;
    *first = p * base + (p < rem ? p : rem);
    return base + (p < rem);
}

uint32_t plan_tp_heads(const plan_side_t *s, uint32_t t, uint32_t *first)
{
    if (s->tp <= s->total_heads) {
        uint32_t n = s->total_heads / s->tp;
        *first = t * n;
        return n;
    }
    *first = t / (s->tp / s->total_heads); /* replicated heads */
    return 1;
}

int plan_side_check(const plan_side_t *s, kvx_why_t *why)
{
    if (s->tp < 1 || s->pp < 1 || s->cp < 1)
        return why_fail(why, KVX_ERR_INVALID,
                        "parallel: tp, pp and cp must be at least 1");
    if ((uint64_t)s->tp * s->pp * s->cp > KVX_MAX_RANKS)
        return why_fail(
            why, KVX_ERR_INVALID, "parallel: tp*pp*cp = %llu exceeds %u ranks",
            (unsigned long long)s->tp * s->pp * s->cp, KVX_MAX_RANKS);
    if (s->cp != 1)
        return why_fail(why, KVX_ERR_UNSUPPORTED,
                        "parallel.cp: %u not supported (expected 1)", s->cp);
    if (s->total_layers < 1 || s->total_layers > KVX_MAX_LAYERS * 64)
        return why_fail(why, KVX_ERR_INVALID,
                        "parallel.total_layers: %u out of range",
                        s->total_layers);
    if (s->total_heads < 1)
        return why_fail(why, KVX_ERR_INVALID,
                        "parallel.total_kv_heads: 0 (expected >= 1)");
    if (s->attention_dp > 1 && s->tp % s->attention_dp)
        return why_fail(why, KVX_ERR_INVALID,
                        "parallel.attention_dp: %u does not divide tp %u",
                        s->attention_dp, s->tp);
    uint32_t htp = s->attention_dp > 1 ? s->tp / s->attention_dp : s->tp;
    if (htp <= s->total_heads ? s->total_heads % htp
                              : htp % s->total_heads)
        return why_fail(
            why, KVX_ERR_INVALID,
            "parallel.total_kv_heads: %u heads do not split over tp %u",
            s->total_heads, htp);
    if (s->num_layers_per_pp) {
        if (s->num_layers_per_pp != s->pp)
            return why_fail(why, KVX_ERR_INVALID,
                            "parallel.layers_per_pp: %u entries for pp %u",
                            s->num_layers_per_pp, s->pp);
        uint64_t sum = 0;
        for (uint32_t i = 0; i < s->pp; i++) {
            if (!s->layers_per_pp[i])
                return why_fail(why, KVX_ERR_INVALID,
                                "parallel.layers_per_pp[%u]: 0", i);
            sum += s->layers_per_pp[i];
        }
        if (sum != s->total_layers)
            return why_fail(
                why, KVX_ERR_INVALID,
                "parallel.layers_per_pp: sum %llu != total_layers %u",
                (unsigned long long)sum, s->total_layers);
    } else if (s->pp > s->total_layers) {
        return why_fail(why, KVX_ERR_INVALID,
                        "parallel.pp: %u exceeds total_layers %u", s->pp,
                        s->total_layers);
    }
    return 0;
}

int plan_side_layout_check(const plan_side_t *s, kvx_why_t *why)
{
    if (s->tokens_per_block < 1 || s->tokens_per_block > 65536)
        return why_fail(
            why, KVX_ERR_INVALID,
            "layout.tokens_per_block: %u out of range (expected 1..65536)",
            s->tokens_per_block);
    if (s->head_dim < 1 || s->head_dim > 65536)
        return why_fail(why, KVX_ERR_INVALID,
                        "layout.head_dim: %u out of range (expected 1..65536)",
                        s->head_dim);
    if (s->elem_size != 1 && s->elem_size != 2 && s->elem_size != 4 &&
        s->elem_size != 8)
        return why_fail(why, KVX_ERR_INVALID,
                        "layout.elem_size: %u invalid (expected 1, 2, 4 or 8)",
                        s->elem_size);
    if (s->kv_factor < 1 || s->kv_factor > 2)
        return why_fail(why, KVX_ERR_INVALID,
                        "layout.kv_factor: %u (expected 1 or 2)", s->kv_factor);
    return 0;
}

uint32_t plan_dp_view(const plan_side_t *s, uint32_t rank, plan_side_t *eff,
                      uint32_t *eff_rank)
{
    *eff = *s;
    uint32_t dp = s->attention_dp > 1 ? s->attention_dp : 1;
    uint32_t group_tp = s->tp / dp;
    uint32_t tp = (rank / s->cp) % s->tp, pp = rank / (s->tp * s->cp);
    eff->tp = group_tp;
    eff->attention_dp = 0;
    *eff_rank = pp * group_tp * s->cp + (tp % group_tp) * s->cp +
                rank % s->cp;
    return tp / group_tp;
}

int plan_side_equal(const plan_side_t *a, const plan_side_t *b)
{
    return a->tp == b->tp && a->pp == b->pp && a->cp == b->cp &&
           a->total_layers == b->total_layers &&
           a->total_heads == b->total_heads &&
           a->num_layers_per_pp == b->num_layers_per_pp &&
           !memcmp(a->layers_per_pp, b->layers_per_pp,
                   sizeof(a->layers_per_pp)) &&
           a->kv_factor == b->kv_factor && a->head_dim == b->head_dim &&
           a->elem_size == b->elem_size && a->dtype == b->dtype &&
           a->tokens_per_block == b->tokens_per_block &&
           a->attention_dp == b->attention_dp;
}

int plan_compat(const plan_side_t *a, const plan_side_t *b, kvx_why_t *why)
{
    if (a->dtype != b->dtype)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "dtype: context %s, generation %s",
                        kvx_dtype_name(a->dtype), kvx_dtype_name(b->dtype));
    if (a->elem_size != b->elem_size)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "elem_size: context %u, generation %u", a->elem_size,
                        b->elem_size);
    if (a->head_dim != b->head_dim)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "head_dim: context %u, generation %u", a->head_dim,
                        b->head_dim);
    if (a->total_heads != b->total_heads)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "total_kv_heads: context %u, generation %u",
                        a->total_heads, b->total_heads);
    if (a->total_layers != b->total_layers)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "total_layers: context %u, generation %u",
                        a->total_layers, b->total_layers);
    if (a->kv_factor != b->kv_factor)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "kv_factor: context %u, generation %u", a->kv_factor,
                        b->kv_factor);
    return 0;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

static plan_budget_t B; /* none: kvxferctl's plans */

void plan_set_budget(const plan_budget_t *b)
{
    B = *b;
}

int plan_own(plan_t *p, uint32_t owner, kvx_why_t *why)
{
    assert(p->owner == PLAN_OWNER_NONE);
    int rc = B.own && p->mem ? B.own(owner, p->mem, why) : 0;
    if (!rc)
        p->owner = owner;
    return rc;
}

int plan_build(const plan_side_t *src, const plan_side_t *dst,
               uint32_t dst_rank, uint32_t num_tokens, uint32_t skip,
               plan_t **out, kvx_why_t *why)
{
    int rc;
    if ((rc = plan_side_check(src, why)) || (rc = plan_side_check(dst, why)) ||
        (rc = plan_side_layout_check(src, why)) ||
        (rc = plan_side_layout_check(dst, why)) ||
        (rc = plan_compat(src, dst, why)))
        return rc;
    if (dst_rank >= plan_side_ranks(dst))
        return why_fail(why, KVX_ERR_INVALID, "rank: %u outside the %u ranks",
                        dst_rank, plan_side_ranks(dst));
    if (num_tokens == 0)
        return why_fail(why, KVX_ERR_INVALID, "num_tokens: 0");
    if (skip >= num_tokens)
        return why_fail(why, KVX_ERR_INVALID,
                        "skip_tokens: %u leaves nothing of %u tokens", skip,
                        num_tokens);

    uint32_t d_tp = (dst_rank / dst->cp) % dst->tp;
    uint32_t d_pp = dst_rank / (dst->tp * dst->cp);
    uint32_t dl0, dh0;
    uint32_t dnl = plan_pp_layers(dst, d_pp, &dl0);
    uint32_t dnh = plan_tp_heads(dst, d_tp, &dh0);

    /* Slices: every (source PP rank x source head group) overlapping the
     * destination's layer range x head range. */
    uint32_t max_slices =
        src->pp * (src->tp < src->total_heads ? src->tp : src->total_heads);
    /* segments cover [skip, num_tokens): each block boundary on either
     * side starts one, so at most both sides' block counts + 1 */
    uint64_t span = (uint64_t)num_tokens - skip;
    uint64_t nseg_max = ceil_div(span, src->tokens_per_block) +
                        ceil_div(span, dst->tokens_per_block) + 2;
    if (nseg_max > UINT32_MAX)
        return why_fail(why, KVX_ERR_INVALID, "plan: %llu segments",
                        (unsigned long long)nseg_max);
    /* what the plan holds, charged to the daemon's budget before it is
     * allocated */
    uint64_t mem = sizeof(plan_t) +
                   (uint64_t)(max_slices ? max_slices : 1) *
                       (sizeof(plan_slice_t) + sizeof(plan_mem_t)) +
                   nseg_max * sizeof(plan_seg_t);
    if (B.charge && (rc = B.charge(mem, why)))
        return rc;
    plan_t *p = calloc(1, sizeof(*p));
    if (!p) {
        if (B.release)
            B.release(PLAN_OWNER_NONE, mem);
        return why_fail(why, KVX_ERR_NOMEM, "plan: out of memory");
    }
    p->mem = mem;
    p->owner = PLAN_OWNER_NONE;
    p->dst_rank = dst_rank;
    p->slices = calloc(max_slices ? max_slices : 1, sizeof(*p->slices));
    p->segs = calloc(nseg_max, sizeof(*p->segs));
    if (!p->slices || !p->segs) {
        plan_free(p);
        return why_fail(why, KVX_ERR_NOMEM, "plan: out of memory");
    }

    for (uint32_t sp = 0; sp < src->pp; sp++) {
        uint32_t sl0, snl = plan_pp_layers(src, sp, &sl0);
        uint32_t l0 = sl0 > dl0 ? sl0 : dl0;
        uint32_t l1 = sl0 + snl < dl0 + dnl ? sl0 + snl : dl0 + dnl;
        if (l0 >= l1)
            continue;
        /* one source per distinct head group; with replicated heads
         * (tp > heads) pick the replica by destination rank to spread load */
        uint32_t reps = src->tp > src->total_heads
                            ? src->tp / src->total_heads
                            : 1;
        uint32_t groups = src->tp / reps;
        for (uint32_t g = 0; g < groups; g++) {
            uint32_t st = g * reps + dst_rank % reps;
            uint32_t sh0, snh = plan_tp_heads(src, st, &sh0);
            uint32_t h0 = sh0 > dh0 ? sh0 : dh0;
            uint32_t h1 = sh0 + snh < dh0 + dnh ? sh0 + snh : dh0 + dnh;
            if (h0 >= h1)
                continue;
            plan_slice_t *s = &p->slices[p->nslices++];
            s->src_rank = sp * src->tp * src->cp + st * src->cp;
            s->layer0 = l0;
            s->nlayers = l1 - l0;
            s->head0 = h0;
            s->nheads = h1 - h0;
            s->src_layer_base = sl0;
            s->src_head_base = sh0;
            s->dst_layer_base = dl0;
            s->dst_head_base = dh0;
        }
    }

    /* Segments: runs of tokens inside one source and one destination
     * block, so differing tokens_per_block and a mid-block skip work. */
    uint32_t ts = src->tokens_per_block, td = dst->tokens_per_block;
    for (uint64_t t = skip; t < num_tokens;) {
        plan_seg_t *g = &p->segs[p->nsegs++];
        g->src_blk = (uint32_t)(t / ts);
        g->src_tok = (uint32_t)(t % ts);
        g->dst_blk = (uint32_t)(t / td);
        g->dst_tok = (uint32_t)(t % td);
        uint32_t n = (uint32_t)(num_tokens - t);
        if (ts - g->src_tok < n)
            n = ts - g->src_tok;
        if (td - g->dst_tok < n)
            n = td - g->dst_tok;
        g->n = n;
        t += n;
    }
    p->src_blocks_needed = (uint32_t)ceil_div(num_tokens, ts);
    p->dst_blocks_needed = (uint32_t)ceil_div(num_tokens, td);

    uint64_t u = 0, bytes = 0;
    uint64_t tok_bytes = (uint64_t)src->kv_factor * src->head_dim *
                         src->elem_size;
    for (uint32_t i = 0; i < p->nslices; i++) {
        p->slices[i].unit_begin = u;
        u += (uint64_t)p->slices[i].nlayers * p->nsegs;
        bytes += (uint64_t)p->slices[i].nlayers * p->slices[i].nheads *
                 (num_tokens - skip) * tok_bytes;
    }
    p->nunits = u;
    p->bytes = bytes;
    p->src = calloc(p->nslices ? p->nslices : 1, sizeof(*p->src));
    if (!p->src) {
        plan_free(p);
        return why_fail(why, KVX_ERR_NOMEM, "plan: out of memory");
    }
    *out = p;
    return 0;
}

void plan_free(plan_t *p)
{
    if (!p)
        return;
    if (B.release && p->mem)
        B.release(p->owner, p->mem);
    free(p->slices);
    free(p->segs);
    free(p->src);
    free(p);
}

/* Check one bound side of slice si (src: its source, else the
 * destination) against its pool; see plan_check_bounds(). Indexes are
 * checked against the layout first, so the byte sum below cannot
 * overflow: the layout itself was checked to fit its pool. */
static int side_check(const plan_t *p, uint32_t si, const plan_mem_t *m,
                      int src, kvx_why_t *why)
{
    const plan_slice_t *s = &p->slices[si];
    const kvx_layout_t *l = m->layout, *dl = p->dst.layout;
    const char *verb = src ? "reads" : "writes";
    uint32_t lb = src ? s->src_layer_base : s->dst_layer_base;
    uint32_t hb = src ? s->src_head_base : s->dst_head_base;
    uint64_t row = (uint64_t)dl->head_dim * dl->elem_size;
    if (s->layer0 < lb || s->layer0 - lb > l->num_layers ||
        s->nlayers > l->num_layers - (s->layer0 - lb) || s->head0 < hb ||
        s->head0 - hb > l->num_heads ||
        s->nheads > l->num_heads - (s->head0 - hb) ||
        dl->kv_factor > l->kv_factor ||
        row > (uint64_t)l->head_dim * l->elem_size)
        return why_fail(
            why, KVX_ERR_INVALID,
            "pool %u: the plan %s layers [%u, +%u) heads [%u, +%u) of "
            "a layout with %u layers and %u heads (rows of %llu "
            "bytes)",
            m->pool, verb, s->layer0 - lb, s->nlayers, s->head0 - hb, s->nheads,
            l->num_layers, l->num_heads, (unsigned long long)row);
    /* the (layer, kv) part of the slice with the least room left in its
     * region after its offset: every segment is checked against it */
    uint64_t room = UINT64_MAX, roff = 0;
    uint32_t rl = 0, rk = 0, rr = 0;
    for (uint32_t k = 0; k < s->nlayers; k++)
        for (uint32_t kv = 0; kv < dl->kv_factor; kv++) {
            uint32_t layer = s->layer0 - lb + k, r;
            uint64_t o = kvx__layout_part(l, layer, kv, &r);
            if (r >= m->nregions)
                return why_fail(
                    why, KVX_ERR_INVALID,
                    "pool %u: the plan %s layer %u kv %u, in region %u "
                    "of %u",
                    m->pool, verb, layer, kv, r, m->nregions);
            uint64_t sz = m->regions[r].size, left = o <= sz ? sz - o : 0;
            if (left < room) {
                room = left;
                roff = o;
                rl = layer;
                rk = kv;
                rr = r;
            }
        }
    uint64_t fixed =
        (uint64_t)(s->head0 - hb + s->nheads - 1) * l->head_stride + row;
    for (uint32_t i = 0; i < p->nsegs; i++) {
        const plan_seg_t *g = &p->segs[i];
        uint32_t bi = src ? g->src_blk : g->dst_blk;
        uint32_t tok = src ? g->src_tok : g->dst_tok;
        if (bi >= m->num_blocks)
            return why_fail(why, KVX_ERR_INVALID,
                            "pool %u: the plan %s block table entry %u of %u",
                            m->pool, verb, bi, m->num_blocks);
        uint32_t b = m->blocks[bi];
        if (b >= l->num_blocks || g->n == 0 || tok > l->tokens_per_block ||
            g->n > l->tokens_per_block - tok)
            return why_fail(
                why, KVX_ERR_INVALID,
                "pool %u: the plan %s tokens [%u, +%u) of block %u; the "
                "pool has %u blocks of %u tokens",
                m->pool, verb, tok, g->n, b, l->num_blocks,
                l->tokens_per_block);
        uint64_t end = fixed + (uint64_t)b * l->block_stride +
                       (uint64_t)(tok + g->n - 1) * l->token_stride;
        if (end > room)
            return why_fail(
                why, KVX_ERR_INVALID,
                "pool %u: the plan %s layer %u kv %u up to byte %llu of "
                "region %u, past its %llu bytes",
                m->pool, verb, rl, rk, (unsigned long long)(roff + end), rr,
                (unsigned long long)m->regions[rr].size);
    }
    return 0;
}

int plan_check_bounds(const plan_t *p, kvx_why_t *why)
{
    int rc;
    for (uint32_t i = 0; i < p->nslices; i++) {
        if (p->src && p->src[i].blocks &&
            (rc = side_check(p, i, &p->src[i], 1, why)))
            return rc;
        if (p->dst.blocks && (rc = side_check(p, i, &p->dst, 0, why)))
            return rc;
    }
    return 0;
}

/* Slice holding unit u: slices are few, a linear scan is enough. */
static uint32_t slice_of(const plan_t *p, uint64_t u)
{
    uint32_t i = 0;
    while (i + 1 < p->nslices && p->slices[i + 1].unit_begin <= u)
        i++;
    return i;
}

uint64_t plan_units_bytes(const plan_t *p, uint64_t u0, uint64_t u1)
{
    /* slice by slice, the segment index stepped, not divided: a GPU job
     * is a whole layer (thousands of units), counted on the loop */
    const kvx_layout_t *dl = p->dst.layout;
    uint64_t bytes = 0;
    if (u0 >= u1 || !p->nsegs)
        return 0;
    for (uint32_t i = slice_of(p, u0); i < p->nslices && u0 < u1; i++) {
        const plan_slice_t *s = &p->slices[i];
        uint64_t end = i + 1 < p->nslices ? p->slices[i + 1].unit_begin : u1;
        if (end > u1)
            end = u1;
        uint32_t k = (uint32_t)((u0 - s->unit_begin) % p->nsegs);
        uint64_t tokens = 0;
        for (uint64_t u = u0; u < end; u++) {
            tokens += p->segs[k].n;
            if (++k == p->nsegs)
                k = 0;
        }
        bytes +=
            tokens * dl->kv_factor * s->nheads * dl->head_dim * dl->elem_size;
        u0 = end;
    }
    return bytes;
}

uint64_t plan_units_fit(const plan_t *p, uint64_t u0, uint64_t u_end,
                        uint64_t max, uint64_t *bytes)
{
    uint64_t u1 = u0, b = 0;
    while (u1 < u_end) {
        uint64_t nb = plan_units_bytes(p, u1, u1 + 1);
        if (b + nb > max)
            break;
        b += nb;
        u1++;
    }
    *bytes = b;
    return u1;
}

uint32_t plan_cut_pieces(const plan_t *p, uint64_t u0, uint64_t u1,
                         uint64_t pb, plan_piece_t *pc, uint32_t max)
{
    uint32_t n = 0;
    uint64_t off = 0;
    for (uint64_t u = u0; u < u1; n++) {
        uint64_t e = u + 1, b = plan_units_bytes(p, u, e);
        while (e < u1) {
            uint64_t nb = plan_units_bytes(p, e, e + 1);
            if (b + nb > pb && n + 1 < max)
                break;
            b += nb;
            e++;
        }
        pc[n] = (plan_piece_t){u, e, off, b};
        off += b;
        u = e;
    }
    return n;
}

/*
 * Copy one run with non-temporal stores. The destination is another
 * process's KV cache that this daemon never reads back, so streaming past
 * the cache avoids the read-for-ownership of every destination line and
 * keeps the engines' working sets in cache. This is what makes a chunked
 * copy match one large memcpy (glibc streams only above a size threshold
 * far larger than our runs). plan_exec() ends with a store fence.
 */
static void copy_run(uint8_t *dst, const uint8_t *src, uint64_t n)
{
#if defined(__x86_64__)
    if (n >= 256) {
        uint64_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        __m128i *d = (__m128i *)dst;
        const __m128i *s = (const __m128i *)src;
        uint64_t blocks = n / 64;
        for (uint64_t i = 0; i < blocks; i++, d += 4, s += 4) {
            __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1),
                    c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
            _mm_stream_si128(d, a);
            _mm_stream_si128(d + 1, b);
            _mm_stream_si128(d + 2, c);
            _mm_stream_si128(d + 3, e);
        }
        memcpy(d, s, n % 64);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* One dimension of a strided copy: count, source and destination
 * strides, and whether it may merge into the run (not when its steps
 * cross from one region to another: the two K and V tensors of a layer
 * are not one run even where they happen to be mapped back to back).
 * Strides are differences of addresses, so they may wrap: addresses are
 * computed as integers. */
struct xdim {
    uint64_t n, ss, ds;
    int keep;
};

static inline const uint8_t *at_c(const uint8_t *p, uint64_t off)
{
    return (const uint8_t *)((uintptr_t)p + off);
}

static inline uint8_t *at(uint8_t *p, uint64_t off)
{
    return (uint8_t *)((uintptr_t)p + off);
}

/* Copy a region of up to 3 dimensions around a contiguous run, merging
 * dimensions that are contiguous on both sides so matching layouts become
 * few large memcpy calls. */
static void copy_strided(uint8_t *dst, const uint8_t *src, uint64_t run,
                         struct xdim *d, int nd, int stream)
{
    for (int merged = 1; merged;) {
        merged = 0;
        for (int i = 0; i < nd; i++) {
            if (d[i].n == 1 ||
                (!d[i].keep && d[i].ss == run && d[i].ds == run)) {
                run *= d[i].n;
                d[i] = d[--nd];
                merged = 1;
                break;
            }
        }
    }
    while (nd < 3)
        d[nd++] = (struct xdim){1, 0, 0, 0};
    for (uint64_t a = 0; a < d[2].n; a++)
        for (uint64_t b = 0; b < d[1].n; b++) {
            const uint8_t *s = at_c(src, a * d[2].ss + b * d[1].ss);
            uint8_t *t = at(dst, a * d[2].ds + b * d[1].ds);
            /* short runs far apart (a TP rank's heads of each token): the
             * hardware prefetcher does not run ahead of them, so each run
             * would wait on memory alone; ask for the next step's runs
             * while these copy */
            if (run <= 4096 && b + 1 < d[1].n)
                for (uint64_t c = 0; c < d[0].n; c++) {
                    const uint8_t *n = at_c(
                        src, a * d[2].ss + (b + 1) * d[1].ss + c * d[0].ss);
                    for (uint64_t o = 0; o < run; o += 64)
                        __builtin_prefetch(n + o, 0, 0);
                }
            for (uint64_t c = 0; c < d[0].n; c++)
                if (stream)
                    copy_run(at(t, c * d[0].ds), at_c(s, c * d[0].ss), run);
                else
                    memcpy(at(t, c * d[0].ds), at_c(s, c * d[0].ss), run);
        }
}

/* Where element (layer, kv, block, token, head) of m lies, and in which
 * region (*region): the one place the host engine resolves an address. */
static inline uint8_t *mem_at(const plan_mem_t *m, uint32_t layer, uint32_t kv,
                              uint32_t block, uint32_t token, uint32_t head,
                              uint32_t *region)
{
    const kvx_layout_t *l = m->layout;
    uint64_t o = kvx__layout_part(l, layer, kv, region);
    return m->regions[*region].base + o + (uint64_t)block * l->block_stride +
           (uint64_t)token * l->token_stride + (uint64_t)head * l->head_stride;
}

/* One side's kv 0 and kv 1 (a K and a V part): where each starts, and
 * in which region. */
struct kv_pair {
    const uint8_t *at[2];
    uint32_t region[2];
};

/* The kv dimension between the addresses of kv 0 and kv 1 (maybe in two
 * regions) of each side. */
static struct xdim kv_dim(uint32_t K, struct kv_pair s, struct kv_pair d)
{
    if (K < 2)
        return (struct xdim){1, 0, 0, 0};
    return (struct xdim){2, (uintptr_t)s.at[1] - (uintptr_t)s.at[0],
                         (uintptr_t)d.at[1] - (uintptr_t)d.at[0],
                         s.region[0] != s.region[1] ||
                             d.region[0] != d.region[1]};
}

void plan_exec(const plan_t *p, uint64_t u0, uint64_t u1)
{
    const kvx_layout_t *dl = p->dst.layout;
    const uint32_t K = dl->kv_factor;
    for (uint64_t u = u0; u < u1; u++) {
        uint32_t si = slice_of(p, u);
        const plan_slice_t *s = &p->slices[si];
        const plan_mem_t *sm = &p->src[si];
        const kvx_layout_t *sl = sm->layout;
        uint64_t r = u - s->unit_begin;
        uint32_t layer = s->layer0 + (uint32_t)(r / p->nsegs);
        const plan_seg_t *g = &p->segs[r % p->nsegs];
        uint32_t sa = layer - s->src_layer_base, da = layer - s->dst_layer_base;
        uint32_t sb = sm->blocks[g->src_blk], db = p->dst.blocks[g->dst_blk];
        uint32_t sh = s->head0 - s->src_head_base,
                 dh = s->head0 - s->dst_head_base;
        uint32_t sr0, sr1 = 0, dr0, dr1 = 0;
        const uint8_t *src = mem_at(sm, sa, 0, sb, g->src_tok, sh, &sr0);
        uint8_t *dst = mem_at(&p->dst, da, 0, db, g->dst_tok, dh, &dr0);
        const uint8_t *src1 =
            K > 1 ? mem_at(sm, sa, 1, sb, g->src_tok, sh, &sr1) : src;
        uint8_t *dst1 =
            K > 1 ? mem_at(&p->dst, da, 1, db, g->dst_tok, dh, &dr1) : dst;
        struct xdim d[3] = {
            {s->nheads, sl->head_stride, dl->head_stride, 0},
            {g->n, sl->token_stride, dl->token_stride, 0},
            kv_dim(K, (struct kv_pair){{src, src1}, {sr0, sr1}},
                   (struct kv_pair){{dst, dst1}, {dr0, dr1}}),
        };
        copy_strided(dst, src, (uint64_t)dl->head_dim * dl->elem_size, d, 3,
                     1);
    }
#if defined(__x86_64__)
    _mm_sfence(); /* streamed stores visible before the job reports done */
#endif
}

/* Unit u on one side of a bound plan (src: its source, else its
 * destination): its slice and segment, that side's memory, and the
 * element its rows start at, as mem_at() takes it. */
typedef struct unit_at {
    const plan_slice_t *s;
    const plan_seg_t *g;
    const plan_mem_t *m;
    uint32_t layer, block, tok, head;
} unit_at_t;

static void unit_locate(const plan_t *p, uint64_t u, int src, unit_at_t *o)
{
    uint32_t si = slice_of(p, u);
    const plan_slice_t *s = &p->slices[si];
    uint64_t r = u - s->unit_begin;
    o->s = s;
    o->g = &p->segs[r % p->nsegs];
    o->m = src ? &p->src[si] : &p->dst;
    o->layer = s->layer0 + (uint32_t)(r / p->nsegs) -
               (src ? s->src_layer_base : s->dst_layer_base);
    o->block = o->m->blocks[src ? o->g->src_blk : o->g->dst_blk];
    o->tok = src ? o->g->src_tok : o->g->dst_tok;
    o->head = s->head0 - (src ? s->src_head_base : s->dst_head_base);
}

void plan_exec_packed(const plan_t *p, uint64_t u0, uint64_t u1,
                      uint8_t *buf, int gather)
{
    const kvx_layout_t *dl = p->dst.layout;
    const uint32_t K = dl->kv_factor;
    const uint64_t row = (uint64_t)dl->head_dim * dl->elem_size;
    for (uint64_t u = u0; u < u1; u++) {
        unit_at_t o;
        unit_locate(p, u, gather, &o);
        const plan_slice_t *s = o.s;
        const plan_seg_t *g = o.g;
        const kvx_layout_t *l = o.m->layout; /* the pool's side */
        const uint64_t hs = row, ts = s->nheads * row, ks = g->n * ts;
        uint32_t r0, r1 = 0;
        uint8_t *pool = mem_at(o.m, o.layer, 0, o.block, o.tok, o.head, &r0);
        uint8_t *pool1 =
            K > 1 ? mem_at(o.m, o.layer, 1, o.block, o.tok, o.head, &r1) : pool;
        if (gather) {
            struct xdim d[3] = {
                {s->nheads, l->head_stride, hs, 0},
                {g->n, l->token_stride, ts, 0},
                kv_dim(K, (struct kv_pair){{pool, pool1}, {r0, r1}},
                       (struct kv_pair){{buf, buf + ks}, {0, 0}})};
            /* into a slot UCX reads next: keep it in cache */
            copy_strided(buf, pool, row, d, 3, 0);
        } else {
            struct xdim d[3] = {
                {s->nheads, hs, l->head_stride, 0},
                {g->n, ts, l->token_stride, 0},
                kv_dim(K, (struct kv_pair){{buf, buf + ks}, {0, 0}},
                       (struct kv_pair){{pool, pool1}, {r0, r1}})};
            copy_strided(pool, buf, row, d, 3, 1);
        }
        buf += K * ks;
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

/* plan_runs_packed()'s run being built: merged until the next one is
 * not right after it in the same region. */
struct runs {
    uint8_t *at;
    uint64_t len;
    uint32_t region;
    plan_run_fn emit;
    void *arg;
};

static int run_add(struct runs *w, uint8_t *a, uint64_t len, uint32_t region)
{
    if (w->len && region == w->region &&
        (uintptr_t)w->at + w->len == (uintptr_t)a) {
        w->len += len;
        return 0;
    }
    int rc = w->len ? w->emit(w->arg, w->at, w->len, w->region) : 0;
    w->at = a;
    w->len = len;
    w->region = region;
    return rc;
}

int plan_runs_packed(const plan_t *p, uint64_t u0, uint64_t u1, int gather,
                     plan_run_fn emit, void *arg)
{
    const uint32_t K = p->dst.layout->kv_factor;
    const uint64_t row =
        (uint64_t)p->dst.layout->head_dim * p->dst.layout->elem_size;
    struct runs w = {.emit = emit, .arg = arg};
    int rc = 0;
    for (uint64_t u = u0; u < u1 && !rc; u++) {
        unit_at_t o;
        unit_locate(p, u, gather, &o);
        const kvx_layout_t *l = o.m->layout;
        /* [kv][token][head][row]: whole tokens or whole segments at once
         * where the layout keeps them contiguous */
        uint64_t run = row, nh = o.s->nheads, nt = o.g->n;
        if (l->head_stride == row) {
            run *= nh;
            nh = 1;
            if (l->token_stride == run) {
                run *= nt;
                nt = 1;
            }
        }
        for (uint32_t kv = 0; kv < K && !rc; kv++) {
            uint32_t reg;
            uint8_t *base =
                mem_at(o.m, o.layer, kv, o.block, o.tok, o.head, &reg);
            for (uint64_t t = 0; t < nt && !rc; t++)
                for (uint64_t x = 0; x < nh && !rc; x++)
                    rc = run_add(
                        &w, at(base, t * l->token_stride + x * l->head_stride),
                        run, reg);
        }
    }
    if (!rc && w.len)
        rc = emit(arg, w.at, w.len, w.region);
    return rc;
}
