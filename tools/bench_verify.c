/*
 * bench_verify — the reference bytes in the ranks' pools: written into a
 * context rank's blocks before its publish, checked in a generation
 * rank's blocks after its fetch, computed from (request, layer, kv,
 * token, head) alone (bench_pattern.h), never through the daemon's plan;
 * and the guard bands around pools placed at an offset. Host pools here,
 * GPU pools through bench_gpu.cu.
 */
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_pattern.h"
#ifdef KVX_CUDA
#include "bench_gpu.h"
#endif

/* The bytes of one (request, layer, kv, token, head) row of head_dim
 * elements, in global coordinates (bench_pattern.h). */
static inline void row_fill(uint8_t *dst, uint32_t rowbytes, uint64_t r,
                            uint32_t l, uint32_t kv, uint32_t t, uint32_t h)
{
    uint64_t seed = pat_seed(r, l, kv, t, h);
    uint32_t i = 0;
    for (; i + 8 <= rowbytes; i += 8) {
        uint64_t w = pat_word(seed, i);
        memcpy(dst + i, &w, 8);
    }
    for (; i < rowbytes; i++)
        dst[i] = pat_byte(seed, i);
}

static inline int row_check(const uint8_t *src, uint32_t rowbytes, uint64_t r,
                            uint32_t l, uint32_t kv, uint32_t t, uint32_t h)
{
    uint8_t small[4096], *want = small;
    if (rowbytes > sizeof(small) && !(want = malloc(rowbytes)))
        die("out of memory checking a row of %u bytes", rowbytes);
    row_fill(want, rowbytes, r, l, kv, t, h); /* the whole row */
    int ok = memcmp(src, want, rowbytes) == 0;
    if (want != small)
        free(want);
    return ok;
}

uint8_t *slot_of(uint64_t r)
{
    uint64_t idx = r >= WARM_BASE ? o.requests + (r - WARM_BASE) : r;
    return slots + idx * PARAMS_SLOT;
}

uint32_t req_block(const rank_view_t *v, uint64_t r, uint32_t i)
{
    if (r >= WARM_BASE)
        r -= WARM_BASE;
    uint32_t b = (uint32_t)((r % reqs_in_pool) * v->bpr + i);
    return v->perm ? v->perm[b] : b;
}

/* --shuffle: a permutation of the pool's n blocks, one per side (seed), the
 * same in every rank of the side. An engine's block tables look like this
 * once blocks have been freed and reused: no two neighbours of a request
 * are neighbours in the pool, and the two sides' ids differ. */
uint32_t *shuffled_blocks(uint32_t n, uint64_t seed)
{
    uint32_t *p = malloc((size_t)n * sizeof(uint32_t));
    if (!p)
        die("--shuffle: %u block ids: out of memory", n);
    for (uint32_t i = 0; i < n; i++)
        p[i] = i;
    uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (uint32_t i = n - 1; i > 0; i--) {
        x ^= x << 13; /* xorshift64: repeatable, no libc state */
        x ^= x >> 7;
        x ^= x << 17;
        uint32_t j = (uint32_t)(x % ((uint64_t)i + 1));
        uint32_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    return p;
}

/* Where element (layer, kv, block, token, head) of v's pool lies. */
static inline uint8_t *view_at(const rank_view_t *v, uint32_t layer,
                               uint32_t kv, uint32_t block, uint32_t t,
                               uint32_t h)
{
    const kvx_layout_t *l = &v->layout;
    return v->rbase[kvx_layout_region(l, layer, kv)] +
           kvx_layout_offset(l, layer, kv, block, t, h);
}

#ifdef KVX_CUDA
/* --shuffle: request r's pool blocks, v->bpr of them; NULL without it
 * (they are then req_block(v, r, 0) on). */
static const uint32_t *req_ids(const rank_view_t *v, uint64_t r)
{
    if (!v->perm)
        return NULL;
    if (r >= WARM_BASE)
        r -= WARM_BASE;
    return v->perm + (r % reqs_in_pool) * v->bpr;
}

/* Request r's rows in v's GPU pool, all its tokens. */
static bgpu_rows_t gpu_rows(const rank_view_t *v, uint64_t r)
{
    const uint32_t *ids = req_ids(v, r);
    return (bgpu_rows_t){.dev = v->device,
                         .layout = &v->layout,
                         .regions = (void *const *)v->rbase,
                         .request = r,
                         .ids = ids,
                         .block0 = ids ? 0 : req_block(v, r, 0),
                         .nblocks = v->bpr,
                         .head0 = v->head0,
                         .layer0 = v->layer0,
                         .tok_to = UINT32_MAX};
}
#endif

void fill_request(const rank_view_t *v, uint64_t r)
{
#ifdef KVX_CUDA
    if (v->device >= 0) {
        bgpu_rows_t rows = gpu_rows(v, r);
        if (bgpu_fill(&rows))
            die("GPU pattern fill failed");
        return;
    }
#endif
    const kvx_layout_t *l = &v->layout;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    for (uint32_t b = 0; b < v->bpr; b++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t t = 0; t < l->tokens_per_block; t++) {
                    uint32_t gt = b * l->tokens_per_block + t;
                    if (gt >= num_tokens)
                        break;
                    for (uint32_t h = 0; h < l->num_heads; h++)
                        row_fill(
                            view_at(v, layer, kv, req_block(v, r, b), t, h),
                            rowbytes, r, v->layer0 + layer, kv, gt,
                            v->head0 + h);
                }
}

/* Host pools too small for every request (blocks reused): the rank
 * processes would spend the two cores of a small machine writing and
 * checking every request's bytes while the daemon copies, and the bench
 * would time them. Instead each slot of the pool gets its pattern once,
 * before the timed pass (request r carries the pattern of the request of
 * its slot, pat_of()); each request is checked on one row of every
 * (block, layer, K/V) run, which is then poisoned so that the slot's
 * next request must write it again; and after the pass every byte of
 * every slot is checked. --verify-each checks (and writes) every byte of
 * every request, inside the timed pass, as before. */
int sampled(void)
{
    return !o.no_verify && !o.verify_each && !o.gpu &&
           reqs_in_pool < o.requests / o.pairs;
}

/* The request whose pattern request r moves (sampled()): the first
 * request of the pass (from first) in r's slot; r itself otherwise. */
uint64_t pat_of(uint64_t r, uint64_t first)
{
    if (!sampled() || r >= WARM_BASE)
        return r;
    return r - ((r - first) / reqs_in_pool) * reqs_in_pool;
}

/* Mismatched sampled rows of request r (sampled()): one row of every
 * (block, layer, kv) run, the same rows for every request of a slot;
 * poison: zero them after the check. */
uint64_t sample_check(const rank_view_t *v, uint64_t r, uint64_t pat,
                      int poison)
{
    const kvx_layout_t *l = &v->layout;
    uint32_t rowbytes = l->head_dim * l->elem_size, bad = 0;
    for (uint32_t b = 0; b < v->bpr; b++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++) {
                uint32_t t = (b + layer) % l->tokens_per_block;
                uint32_t gt = b * l->tokens_per_block + t;
                if (gt < o.skip || gt >= num_tokens)
                    continue;
                uint32_t h = (b + layer + kv) % l->num_heads;
                uint8_t *at = view_at(v, layer, kv, req_block(v, r, b), t, h);
                bad += !row_check(at, rowbytes, pat, v->layer0 + layer, kv, gt,
                                  v->head0 + h);
                if (poison)
                    memset(at, 0, rowbytes);
            }
    return bad;
}

/* Mismatched rows of request r among tokens [skip, num_tokens). */
uint64_t check_request(const rank_view_t *v, uint64_t r)
{
#ifdef KVX_CUDA
    if (v->device >= 0) {
        bgpu_rows_t rows = gpu_rows(v, r);
        rows.tok_from = o.skip;
        rows.tok_to = num_tokens;
        int64_t bad = bgpu_check(&rows);
        if (bad < 0)
            die("GPU pattern check failed");
        return (uint64_t)bad;
    }
#endif
    const kvx_layout_t *l = &v->layout;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    uint64_t bad = 0;
    for (uint32_t b = 0; b < v->bpr; b++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t t = 0; t < l->tokens_per_block; t++) {
                    uint32_t gt = b * l->tokens_per_block + t;
                    if (gt < o.skip)
                        continue;
                    if (gt >= num_tokens)
                        break;
                    for (uint32_t h = 0; h < l->num_heads; h++)
                        bad += !row_check(
                            view_at(v, layer, kv, req_block(v, r, b), t, h),
                            rowbytes, r, v->layer0 + layer, kv, gt,
                            v->head0 + h);
                }
    return bad;
}

/* Guard-band bytes around a rank's pool that are no longer GUARD_BYTE
 * (--pool-offset): any is a write outside the pool. */
uint64_t guard_changed(const rank_view_t *v)
{
    if (!o.guard)
        return 0;
    uint64_t size = kvx_layout_span(&v->layout), off = o.pool_offset;
    uint8_t *img = v->alloc;
    uint8_t *tmp = NULL;
#ifdef KVX_CUDA
    if (v->device >= 0) {
        tmp = malloc(v->alloc_len);
        if (!tmp || bgpu_copy_to_host(v->device, tmp, v->alloc, off) ||
            bgpu_copy_to_host(v->device, tmp + off + size,
                              v->alloc + off + size, GUARD_TAIL))
            die("GPU %d: guard-band copy failed", v->device);
        img = tmp;
    }
#endif
    uint64_t bad = 0;
    for (uint64_t i = 0; i < v->alloc_len; i++)
        if ((i < off || i >= off + size) && img[i] != GUARD_BYTE)
            bad++;
    free(tmp);
    return bad;
}

/* Zero a rank's pool (between passes, outside the timing). */
void pool_clear(const rank_view_t *v)
{
    for (uint32_t i = 0; i < v->nregions; i++) {
#ifdef KVX_CUDA
        if (v->device >= 0) {
            if (bgpu_memset(v->device, v->rbase[i], 0, v->rsize[i]))
                die("GPU %d: memset failed", v->device);
            continue;
        }
#endif
        memset(v->rbase[i], 0, v->rsize[i]);
    }
}
