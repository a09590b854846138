/*
 * fetch — the generation side: a rank's fetch becomes a genreq with one
 * part per rank and block table, each with its plan; the checks of the
 * offer it reads; layer-wise sources, copied cell by cell as their
 * layers become ready; fetches through peer daemons (remote.c).
 * The requests' types and what the files of xfer share: xfer_int.h.
 */
#include <assert.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <openssl/sha.h>

#include "common/list.h"
#include "copy/copy.h"
#include "core/daemon.h"
#include "core/log.h"
#include "core/rrq.h"
#include "net/peer.h"
#include "xfer.h"
#include "xfer_int.h"
#include "xfer_remote.h"

/* ---- fetch ------------------------------------------------------------ */

void genreq_free(genreq_t *g)
{
    assert(!list_linked(&g->timeout.node) && list_empty(&g->waiters));
    busy_hold(-1);
    for (size_t r = 0; r < GPARTS(g); r++) {
        genpart_t *p = &g->parts[r];
        if (p->pool)
            pool_unref(p->pool);
        free(p->blocks);
        gpu_part_free(p->gpu);
        free(p->cnext);
        free(p->sfirst);
        free(p->tok_end);
        free(p->ldone);
        free(p->lneed);
        if (p->remote) { /* only remote sets it */
            assert(xfer_rops.part_free);
            xfer_rops.part_free(p->remote);
            p->remote = NULL;
        }
        plan_free(p->plan);
    }
    if (g->src_addresses)
        for (uint32_t i = 0; i < g->src_nranks; i++)
            free(g->src_addresses[i]);
    free(g->src_addresses);
    aux_drop(g->inst->owner_uid, &g->aux, &g->aux_len);
    kvxd_mem_release_uid(MEM_REQUESTS, g->inst->owner_uid, g->mem);
    free(g->parts);
    free(g);
}

/* ---- layer-wise sources ------------------------------------------------ */

/* A streaming part's work is cut in cells: (slice i, layer a of the
 * slice), nsegs units each, in token order; cell (i, a) is units
 * slices[i].unit_begin + a * nsegs + [0, nsegs). cnext[i * maxl + a] is
 * its next segment, sfirst[i] the slice's first cell not handed out.
 * The segments of a cell that may be copied are those whose tokens its
 * source rank has ready for that layer (tok_end: each segment's end). */
static uint32_t cell_ready(const genpart_t *p, uint32_t i, uint32_t a)
{
    const plan_t *pl = p->plan;
    const plan_slice_t *s = &pl->slices[i];
    const offer_part_t *sp = OPART(p->req->offer, p->group, s->src_rank);
    uint32_t t = sp->tok_ready
                     ? sp->tok_ready[s->layer0 + a - s->src_layer_base]
                     : UINT32_MAX;
    uint32_t lo = 0, hi = pl->nsegs; /* segments with tok_end <= t */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (p->tok_end[mid] <= t)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Has a streaming part segments it may copy now? */
int part_has_ready(const genpart_t *p)
{
    const plan_t *pl = p->plan;
    for (uint32_t i = 0; i < pl->nslices; i++)
        for (uint32_t a = p->sfirst[i]; a < pl->slices[i].nlayers; a++)
            if (p->cnext[i * p->maxl + a] < cell_ready(p, i, a))
                return 1;
    return 0;
}

/* Has a streaming part units not handed out yet (ready or not)? */
int part_has_left(const genpart_t *p)
{
    for (uint32_t i = 0; i < p->plan->nslices; i++)
        if (p->sfirst[i] < p->plan->slices[i].nlayers)
            return 1;
    return 0;
}

/* The next job of a streaming part: the ready segments of the cell of
 * the lowest layer that has some (the decode needs layer 0 first), up to
 * units_per_chunk. 0 when nothing is ready. */
int part_next_job(genpart_t *p, uint64_t *u0, uint64_t *u1)
{
    const plan_t *pl = p->plan;
    uint32_t bi = UINT32_MAX, ba = 0, bready = 0;
    uint64_t blayer = UINT64_MAX;
    for (uint32_t i = 0; i < pl->nslices; i++) {
        const plan_slice_t *s = &pl->slices[i];
        for (uint32_t a = p->sfirst[i]; a < s->nlayers; a++) {
            if (s->layer0 + a >= blayer)
                break;
            uint32_t r = cell_ready(p, i, a);
            if (p->cnext[i * p->maxl + a] < r) {
                bi = i;
                ba = a;
                bready = r;
                blayer = s->layer0 + a;
                break;
            }
        }
    }
    if (bi == UINT32_MAX)
        return 0;
    uint32_t *next = &p->cnext[bi * p->maxl + ba];
    uint64_t base = pl->slices[bi].unit_begin + (uint64_t)ba * pl->nsegs;
    uint32_t end = *next + p->units_per_chunk < bready
                       ? (uint32_t)(*next + p->units_per_chunk)
                       : bready;
    *u0 = base + *next;
    *u1 = base + end;
    *next = end;
    /* the slice's first cell not handed out */
    while (p->sfirst[bi] < pl->slices[bi].nlayers &&
           p->cnext[bi * p->maxl + p->sfirst[bi]] == pl->nsegs)
        p->sfirst[bi]++;
    return 1;
}

/* Units [u0, u1) of p's plan have landed: count them per layer of the
 * destination. */
void part_landed(genpart_t *p, uint64_t u0, uint64_t u1)
{
    const plan_t *pl = p->plan;
    if (!p->ldone || !pl->nsegs)
        return;
    for (uint32_t i = 0; i < pl->nslices && u0 < u1; i++) {
        const plan_slice_t *s = &pl->slices[i];
        uint64_t se = s->unit_begin + (uint64_t)s->nlayers * pl->nsegs;
        if (u0 >= se)
            continue;
        uint64_t a = u0 > s->unit_begin ? u0 : s->unit_begin;
        uint64_t b = u1 < se ? u1 : se;
        while (a < b) {
            uint64_t la = (a - s->unit_begin) / pl->nsegs;
            uint64_t lend = s->unit_begin + (la + 1) * pl->nsegs;
            uint64_t e = b < lend ? b : lend;
            p->ldone[s->layer0 + la - s->dst_layer_base] += (uint32_t)(e - a);
            a = e;
        }
        u0 = b;
    }
}

/* Units [u0, u1) of remote part p have landed (remote.c: a piece
 * scattered, or received in place): counted per layer of the destination
 * as a local part's chunks are (part_try_start() makes the counts of a
 * local part; a remote part's are made here, at its first piece). */
void xfer_part_landed(genpart_t *p, uint64_t u0, uint64_t u1)
{
    const plan_t *plan = p->plan;
    if (!p->ldone) {
        uint32_t nl = p->pool->layout.num_layers;
        p->ldone = calloc(nl, sizeof(uint32_t));
        p->lneed = calloc(nl, sizeof(uint32_t));
        if (!p->ldone || !p->lneed) { /* progress counts at the end only */
            free(p->ldone);
            free(p->lneed);
            p->ldone = p->lneed = NULL;
            return;
        }
        for (uint32_t i = 0; i < plan->nslices; i++) {
            const plan_slice_t *s = &plan->slices[i];
            for (uint32_t a = 0; a < s->nlayers; a++)
                p->lneed[s->layer0 + a - s->dst_layer_base] += plan->nsegs;
        }
    }
    part_landed(p, u0, u1);
}

/* Bind a fetched part to its sources once they have all published. */
void part_try_start(genpart_t *p)
{
    genreq_t *g = p->req;
    if (!p->fetched || p->started || g->ending || !g->offer)
        return;
    offer_t *o = g->offer;
    plan_t *plan = p->plan;
    for (uint32_t i = 0; i < plan->nslices; i++)
        if (!OPART(o, p->group, plan->slices[i].src_rank)->pool)
            return; /* wait for that rank's publish */
    for (uint32_t i = 0; i < plan->nslices; i++) {
        offer_part_t *sp = OPART(o, p->group, plan->slices[i].src_rank);
        plan->src[i] = pool_mem(sp->pool, sp->blocks, sp->nblocks);
    }
    p->started = 1;
    char why[256];
    int rc = plan_check_bounds(plan, KVX_WHY(why));
    if (rc) {
        log_error("fetch of request %s: %s", ks(&g->key), why);
        genreq_end(g, KVX_EVENT_ERROR, rc, why);
        return;
    }
    /* A GPU pool on either side: the plan runs on the GPU, host pools in
     * it are pinned so the kernel can reach them. */
    /* Launch where the source is when it is a GPU: the kernel then reads
     * local HBM and writes the peer over NVLink (posted writes), which
     * keeps far more bytes in flight than remote reads. A host source is
     * read by the destination GPU. */
    int device = -1;
    for (uint32_t i = 0; i < plan->nslices && device < 0; i++) {
        pool_t *sp = OPART(o, p->group, plan->slices[i].src_rank)->pool;
        if (sp->gpu)
            device = sp->device;
    }
    if (device < 0 && p->pool->gpu)
        device = p->pool->device;
    if (device >= 0 && plan->nunits) {
        rc = pool_pin(p->pool, KVX_WHY(why));
        for (uint32_t i = 0; i < plan->nslices && !rc; i++)
            rc = pool_pin(OPART(o, p->group, plan->slices[i].src_rank)->pool,
                          KVX_WHY(why));
        /* the kernel runs on `device`: every region as that device sees
         * it */
        if (!rc)
            rc = pool_device_view(p->pool, device, &plan->dst.regions,
                                  KVX_WHY(why));
        for (uint32_t i = 0; i < plan->nslices && !rc; i++)
            rc = pool_device_view(
                OPART(o, p->group, plan->slices[i].src_rank)->pool, device,
                &plan->src[i].regions, KVX_WHY(why));
        if (!rc)
            rc = gpu_part_create(plan, device, &p->gpu, KVX_WHY(why));
        if (rc) {
            genreq_end(g, KVX_EVENT_ERROR, rc, why);
            return;
        }
    }
    if (plan->nunits == 0) {
        p->done = 1;
        part_settle(p, 0);
        if (++g->ndone == g->need * g->ngroups)
            genreq_end(g, KVX_EVENT_COMPLETE, 0, "");
        return;
    }
    uint64_t unit = plan->bytes / plan->nunits;
    uint64_t chunk =
        p->gpu ? kvxd.conf.gpu_chunk_bytes : kvxd.conf.copy_chunk_bytes;
    p->units_per_chunk = unit ? chunk / unit : 1;
    if (!p->units_per_chunk)
        p->units_per_chunk = 1;
    /* per layer of the destination: what it gets (FetchProgress) */
    uint32_t nl = p->pool->layout.num_layers;
    p->ldone = calloc(nl, sizeof(uint32_t));
    p->lneed = calloc(nl, sizeof(uint32_t));
    int streaming = 0;
    for (uint32_t i = 0; i < plan->nslices; i++) {
        const plan_slice_t *s = &plan->slices[i];
        streaming |= OPART(o, p->group, s->src_rank)->layerwise;
        for (uint32_t a = 0; p->lneed && a < s->nlayers; a++)
            p->lneed[s->layer0 + a - s->dst_layer_base] += plan->nsegs;
    }
    if (streaming) {
        /* cell by cell, as the source ranks say their layers' tokens
         * are ready */
        uint32_t maxl = 1;
        for (uint32_t i = 0; i < plan->nslices; i++)
            if (plan->slices[i].nlayers > maxl)
                maxl = plan->slices[i].nlayers;
        p->maxl = maxl;
        p->cnext = calloc((size_t)plan->nslices * maxl, sizeof(uint32_t));
        p->sfirst = calloc(plan->nslices, sizeof(uint32_t));
        p->tok_end = malloc((plan->nsegs ? plan->nsegs : 1) * sizeof(uint32_t));
        if (!p->cnext || !p->sfirst || !p->tok_end || !p->ldone || !p->lneed) {
            genreq_end(g, KVX_EVENT_ERROR, KVX_ERR_NOMEM,
                       "daemon out of memory");
            return;
        }
        uint32_t t = g->gskip[p->group];
        for (uint32_t k = 0; k < plan->nsegs; k++)
            p->tok_end[k] = t += plan->segs[k].n;
        /* what is left after the prefill's last layer is that layer's
         * copy: on the copy threads, cut it in two jobs per thread, so
         * that all of them share it and a thread that lost its CPU for
         * a while holds back only a small piece (a GPU launch has its
         * CTAs) */
        uint64_t per = plan->nsegs / (copy_threads() ? 2 * copy_threads() : 1);
        if (!p->gpu && p->units_per_chunk > (per ? per : 1))
            p->units_per_chunk = per ? per : 1;
        if (!part_has_ready(p)) {
            p->parked = 1;
            return;
        }
    }
    TRACE_HOP(g, TR_QUEUED);
    rrq_push(&xfer_runq, &p->turn);
}

/* Words one table's part holds: the block table, the per-layer
 * counters and, for a layer-wise source, the cell cursors (an upper
 * bound: part_try_start() knows which it needs). */
static uint64_t part_words(const plan_t *plan, const pool_t *pool)
{
    uint64_t nl = pool->layout.num_layers;
    return plan->dst_blocks_needed + 2 * nl +
           (uint64_t)plan->nslices * (nl + 1) + plan->nsegs;
}

/* What one rank's fetch makes the daemon hold besides its plans (which
 * plan_own() gives its uid): its tables' parts, and the request's own
 * state when it is new (g NULL). Charged to inst's uid (MEM_REQUESTS)
 * before the request takes them, released with it (genreq_free()). */
static uint64_t fetch_bytes(const instance_t *inst, const genreq_t *g,
                            const plan_t *plan, const pool_t *pool,
                            plan_t *const *gplans, const xfer_group_t *gs,
                            uint32_t ngs)
{
    uint64_t words = part_words(plan, pool);
    for (uint32_t k = 0; k < ngs; k++)
        words += part_words(gplans[k], gs[k].pool);
    uint64_t state = g ? 0
                       : sizeof(genreq_t) + (uint64_t)inst->nranks * (1 + ngs) *
                                                sizeof(genpart_t);
    return words * sizeof(uint32_t) + state;
}

/* A new fetch of request_id by inst, in its map and on the timeout list;
 * NULL when out of memory (nothing left behind). */
static genreq_t *genreq_new(instance_t *inst, uint64_t request_id,
                            const reqkey_t *key, uint32_t skip,
                            uint32_t dp_rank, const xfer_group_t *groups,
                            uint32_t ngroups)
{
    genreq_t *g = calloc(1, sizeof(*g));
    if (g)
        g->parts =
            calloc((size_t)inst->nranks * (1 + ngroups), sizeof(*g->parts));
    if (!g || !g->parts || map_put(&inst->fetches, request_id, g)) {
        if (g)
            free(g->parts);
        free(g);
        return NULL;
    }
    list_init(&g->timeout.node);
    list_init(&g->waiters);
    g->inst = inst;
    g->request_id = request_id;
    g->key = *key;
    g->skip_tokens = skip;
    g->dp_rank = dp_rank;
    g->need = group_ranks(inst, dp_rank);
    g->ngroups = 1 + ngroups;
    g->gskip[0] = skip;
    for (uint32_t k = 0; k < ngroups; k++)
        g->gskip[k + 1] = groups[k].skip_tokens;
    g->created_ms = kvxd_now_ms();
    g->start_us = wall_us();
    g->t0_ns = mono_ns();
    busy_hold(1);
    TRACE_HOP(g, TR_FETCH);
    dl_insert(&xfer_timeouts, &g->timeout,
              g->created_ms + kvxd.conf.fetch_timeout_ms);
    for (size_t r = 0; r < GPARTS(g); r++) {
        g->parts[r].req = g;
        g->parts[r].rank = (uint32_t)(r % inst->nranks);
        g->parts[r].group = (uint32_t)(r / inst->nranks);
    }
    xfer_nrequests++;
    return g;
}

/* Rank's part of g takes the pool (a reference), its block table bt and
 * its plan, bound to the pool as the destination. */
static genpart_t *part_fetched(genreq_t *g, uint32_t k, uint32_t rank,
                               pool_t *pool, uint32_t *bt, plan_t *plan)
{
    genpart_t *p = GPART(g, k, rank);
    p->fetched = 1;
    p->pool = pool;
    pool_ref(pool);
    p->blocks = bt;
    p->nblocks = plan->dst_blocks_needed;
    p->plan = plan;
    plan->dst = pool_mem(pool, bt, p->nblocks);
    g->nfetched += k == 0; /* ranks */
    g->bytes_total += plan->bytes;
    return p;
}

/* A fetch whose sources are reached through peer daemons (remote.c):
 * the plan comes from the params, the token is proven to the daemon
 * serving each source rank, and each slice is pulled from it. */
static int side_from_params(const Kvxfer__ContextParams *cp, plan_side_t *s,
                            kvx_why_t *why)
{
    char w[200];
    int rc = xfer_side_from_msg(cp->parallel, cp->layout, s, KVX_WHY(w));
    if (rc)
        return why_fail(why, rc, "fetch.context_params: %s", w);
    if (plan_side_ranks(s) != cp->n_rank_addresses)
        return why_fail(why, KVX_ERR_INVALID,
                        "fetch.context_params: %zu rank addresses for %u ranks",
                        cp->n_rank_addresses, plan_side_ranks(s));
    return rc;
}

/* Table k (k > 0) of an offer, as a fetch reads it: its side, its
 * tokens and its first block. */
typedef struct group_src {
    const plan_side_t *side;
    uint32_t tokens;
    uint32_t first;
    uint32_t k;
} group_src_t;

static int group_plan(const group_src_t *gsrc, const instance_t *inst,
                      uint32_t rank, const xfer_group_t *x, plan_t **out,
                      uint32_t **bt_out, kvx_why_t *why);

/* The other tables' plans and destination tables of a fetch that did
 * not take them (group_plan() made them). */
static void group_plans_free(plan_t **plans, uint32_t **bts, uint32_t n)
{
    for (uint32_t k = 0; k < n; k++) {
        free(bts[k]);
        plan_free(plans[k]);
    }
}

/* The side of the offer's table k (k > 0) from the params: the
 * instance's parallelism with that table's layout summary and sizes. */
static int side_from_params_group(const Kvxfer__ContextParams *cp, uint32_t k,
                                  plan_side_t *s, kvx_why_t *why)
{
    const Kvxfer__ParamsGroup *pg = cp->groups[k - 1];
    char w[200];
    Kvxfer__ParallelConfig pc = *cp->parallel;
    pc.total_layers = pg->total_layers;
    pc.total_kv_heads = pg->total_kv_heads;
    pc.n_layers_per_pp = 0; /* a group's layers split evenly */
    int rc = xfer_side_from_msg(&pc, pg->layout, s, KVX_WHY(w));
    if (rc)
        return why_fail(why, rc, "fetch.context_params: groups[%u]: %s", k - 1,
                        w);
    return 0;
}

static int fetch_remote(const xfer_fetch_req_t *rq, uint64_t request_id,
                        const Kvxfer__ContextParams *cp, kvx_why_t *why)
{
    instance_t *inst = rq->inst;
    uint32_t rank = rq->rank, nblocks = rq->nblocks, skip = rq->skip_tokens;
    uint32_t dp_rank = rq->dp_rank, ngs = rq->ngroups;
    const reqkey_t *key = rq->key;
    pool_t *pool = rq->pool;
    const uint32_t *blocks = rq->blocks;
    const xfer_group_t *gs = rq->groups;
    int rc;
    uint64_t src_id = xfer_key_id(cp->key.data, cp->key.len);
    if (!peer_enabled()) {
        for (size_t i = 0; i < cp->n_rank_addresses; i++)
            if (strcmp(cp->rank_addresses[i], kvxd.address))
                return why_fail(
                    why, KVX_ERR_UNSUPPORTED,
                    "fetch.context_params: context rank %zu is served by "
                    "daemon '%s', and transfers between daemons are off "
                    "here (peer.listen is empty)",
                    i, cp->rank_addresses[i]);
        return why_fail(
            why, KVX_ERR_UNSUPPORTED,
            "fetch: instance %s spans daemons, and transfers between "
            "daemons are off here (peer.listen is empty)",
            inst->id);
    }
    for (size_t i = 0; i < cp->n_rank_addresses; i++)
        if ((rc = peer_address_check(cp->rank_addresses[i], why)))
            return rc;
    plan_side_t src, dst, full;
    uint32_t eff_rank;
    if ((rc = side_from_params(cp, &src, why)))
        return rc;
    xfer_side_from_layout(&full, inst, &pool->layout);
    plan_dp_view(&full, rank, &dst, &eff_rank);
    if ((rc = plan_compat(&src, &dst, why)))
        return rc;

    genreq_t *g = map_get(&inst->fetches, request_id);
    if (g && !reqkey_eq(&g->key, key))
        return why_fail(
            why, KVX_ERR_EXISTS,
            "fetch.key: %s has the id of request %s in flight (a 64-bit "
            "collision; use another key)",
            ks(key), ks(&g->key));
    if (g) {
        if (g->ending)
            return why_fail(why, KVX_ERR_STATE,
                            "fetch: request %s is ending (%s)", ks(key),
                            g->end_msg);
        if (!g->remote || strcmp(g->src_instance, cp->instance_id) ||
            g->src_request != src_id ||
            memcmp(g->token, cp->token.data, TOKEN_LEN))
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "fetch.context_params: request %s is being fetched from "
                "another offer by another rank",
                ks(key));
        if (g->parts[rank].fetched)
            return why_fail(why, KVX_ERR_EXISTS,
                            "fetch: request %s already fetched by "
                            "rank %u",
                            ks(key), rank);
        if (g->dp_rank != dp_rank)
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "fetch.dp_rank: %u differs from %u given by another rank",
                dp_rank, g->dp_rank);
        if (g->ngroups != 1 + ngs)
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "fetch.groups: %u other block tables, but another rank's "
                "fetch of request %s gave %u",
                ngs, ks(key), g->ngroups - 1);
        if (g->skip_tokens != skip)
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "fetch.skip_tokens: %u differs from %u given by another "
                "rank",
                skip, g->skip_tokens);
        for (uint32_t k = 0; k < ngs; k++)
            if (g->gskip[k + 1] != gs[k].skip_tokens)
                return why_fail(
                    why, KVX_ERR_MISMATCH,
                    "fetch.groups[%u].skip_tokens: %u differs from %u given "
                    "by another rank",
                    k, gs[k].skip_tokens, g->gskip[k + 1]);
    } else if (xfer_nrequests >= kvxd.conf.max_requests) {
        return why_fail(why, KVX_ERR_LIMIT,
                        "fetch: %u requests in flight (limits."
                        "max_requests)",
                        xfer_nrequests);
    }
    /* before planning: forged params could ask for billions of tokens
     * (the plan's segments); the blocks given bound what can land */
    if ((uint64_t)nblocks * dst.tokens_per_block < cp->num_tokens)
        return why_fail(
            why, KVX_ERR_INVALID,
            "fetch.blocks: %u blocks of %u tokens cannot hold the offer's "
            "%u tokens",
            nblocks, dst.tokens_per_block, cp->num_tokens);
    plan_t *plan;
    if ((rc = plan_build(&src, &dst, eff_rank, cp->num_tokens, skip, &plan,
                         why)))
        return rc;
    if ((rc = plan_own(plan, inst->owner_uid, why))) {
        plan_free(plan);
        return rc;
    }
    if (nblocks < plan->dst_blocks_needed) {
        plan_free(plan);
        return why_fail(
            why, KVX_ERR_INVALID,
            "fetch.blocks: %u blocks of %u tokens cannot hold the offer's "
            "%u tokens (need %u)",
            nblocks, dst.tokens_per_block, cp->num_tokens,
            plan->dst_blocks_needed);
    }
    uint32_t *bt = malloc(plan->dst_blocks_needed * sizeof(uint32_t) + 1);
    if (!bt) {
        plan_free(plan);
        return why_fail(why, KVX_ERR_NOMEM, "fetch: out of memory");
    }
    memcpy(bt, blocks, plan->dst_blocks_needed * sizeof(uint32_t));
    /* the other tables' plans, from the params' sides */
    plan_t *gplan[XFER_MAX_GROUPS] = {NULL};
    uint32_t *gbt[XFER_MAX_GROUPS] = {NULL};
    for (uint32_t k = 0; k < ngs && !rc; k++) {
        plan_side_t gsrc;
        const Kvxfer__ParamsGroup *pg = cp->groups[k];
        if (!(rc = side_from_params_group(cp, k + 1, &gsrc, why)))
            rc = group_plan(
                &(group_src_t){&gsrc, pg->num_tokens, pg->first_block, k + 1},
                inst, rank, &gs[k], &gplan[k], &gbt[k], why);
    }
    /* the tables (and a new request's state), charged to its uid */
    uint64_t mem = rc ? 0 : fetch_bytes(inst, g, plan, pool, gplan, gs, ngs);
    if (!rc)
        rc = xfer_req_charge(inst, mem, "fetch: the request", why);
    if (rc) {
        group_plans_free(gplan, gbt, ngs);
        free(bt);
        plan_free(plan);
        return rc;
    }
    if (!g) {
        char **addrs = calloc(cp->n_rank_addresses, sizeof(char *));
        int bad = !addrs;
        for (size_t i = 0; !bad && i < cp->n_rank_addresses; i++)
            bad = !(addrs[i] = strdup(cp->rank_addresses[i]));
        if (bad ||
            !(g = genreq_new(inst, request_id, key, skip, dp_rank, gs, ngs))) {
            for (size_t i = 0; addrs && i < cp->n_rank_addresses; i++)
                free(addrs[i]);
            free(addrs);
            free(bt);
            plan_free(plan);
            group_plans_free(gplan, gbt, ngs);
            kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid, mem);
            return why_fail(why, KVX_ERR_NOMEM, "fetch: out of memory");
        }
        g->remote = 1;
        g->src_side = src;
        g->src_addresses = addrs;
        g->src_nranks = (uint32_t)cp->n_rank_addresses;
        snprintf(g->src_instance, sizeof(g->src_instance), "%s",
                 cp->instance_id);
        g->src_request = src_id;
        g->src_id = xfer_source_id(cp->instance_id, cp->key.data, cp->key.len);
        g->src_key.len = (uint32_t)cp->key.len;
        memcpy(g->src_key.b, cp->key.data, cp->key.len);
        memcpy(g->token, cp->token.data, TOKEN_LEN);
    }
    g->mem += mem;
    part_fetched(g, 0, rank, pool, bt, plan);
    for (uint32_t k = 0; k < ngs; k++)
        part_fetched(g, k + 1, rank, gs[k].pool, gbt[k], gplan[k]);
    log_debug("fetch %s/%s rank %u from %s/%s through peers: %u "
              "slices, %llu bytes, %u tables",
              inst->id, ks(key), rank, cp->instance_id,
              xfer_ksb(cp->key.data, cp->key.len), plan->nslices,
              (unsigned long long)plan->bytes, 1 + ngs);
    /* every table's part starts; g is looked up again before each:
     * starting one may have ended it already */
    for (uint32_t k = 0; k <= ngs; k++) {
        if (!(g = map_get(&inst->fetches, request_id)) || g->ending)
            break;
        genpart_t *p = GPART(g, k, rank);
        p->started = 1; /* its sources are bound on the peers */
        if (p->plan->nunits == 0) {
            p->done = 1;
            part_settle(p, 0);
            if (++g->ndone == g->need * g->ngroups)
                genreq_end(g, KVX_EVENT_COMPLETE, 0, "");
            continue;
        }
        char w[256] = "fetch: this kvxferd moves no data between daemons";
        if ((rc = xfer_rops.part_start ? xfer_rops.part_start(p, cp, KVX_WHY(w))
                                       : KVX_ERR_UNSUPPORTED) &&
            (g = map_get(&inst->fetches, request_id)))
            genreq_end(g, KVX_EVENT_ERROR, rc, w); /* reported as an event */
    }
    return 0;
}

static int fetch_one(const xfer_fetch_req_t *rq, uint64_t request_id,
                     int *as_event, kvx_why_t *why);

/* A rank's fetch of a request that ended already (another rank's fetch
 * failed, it was cancelled, it timed out): its event is in the batches,
 * so this fetch joins that end, with no second event. 1 when it did. */
static int fetch_join_end(instance_t *inst, uint32_t rank, uint64_t id,
                          const reqkey_t *key, uint64_t src, int *rc,
                          kvx_why_t *why)
{
    genreq_t *g = map_get(&inst->fetches, id);
    gone_t *x = g ? NULL : gone_find(0, inst->id, id, key->b, key->len);
    if (x && x->src != src) { /* the key again, for another offer: new */
        gone_free(x);
        x = NULL;
    }
    int *seen =
        g && reqkey_eq(&g->key, key) && g->ending && !g->parts[rank].fetched
            ? &g->parts[rank].late
            : NULL;
    uint8_t one = 0, *xs = x ? &x->ranks[rank] : &one;
    if (!seen && !x)
        return 0;
    if (seen ? *seen : *xs) {
        why_set(why, "fetch: request %s already fetched by rank %u", ks(key),
                rank);
        *rc = KVX_ERR_EXISTS;
        return 1;
    }
    *rc = 0;
    if (seen)
        *seen = 1;
    else if ((*xs = 1), ++x->seen >= x->need)
        gone_free(x);
    return 1;
}

int xfer_fetch_ended(instance_t *inst, uint32_t rank, const reqkey_t *key,
                     uint64_t src, int *rc, kvx_why_t *why)
{
    return rank < inst->nranks &&
           fetch_join_end(inst, rank, xfer_key_id(key->b, key->len), key, src,
                          rc, why);
}

uint64_t xfer_source_id(const char *inst, const uint8_t *key, size_t len)
{
    uint8_t buf[INSTANCE_ID_MAX + 1 + KVX_MAX_KEY];
    size_t il = strnlen(inst, INSTANCE_ID_MAX);
    if (len > KVX_MAX_KEY)
        len = KVX_MAX_KEY;
    memcpy(buf, inst, il);
    buf[il] = 0;
    memcpy(buf + il + 1, key, len);
    return xfer_key_id(buf, il + 1 + len);
}

/* The source of params (0 when they do not decode: the fetch fails). */
static uint64_t params_source(const uint8_t *pbuf, size_t plen)
{
    Kvxfer__ContextParams *cp;
    char w[256];
    if (xfer_params_decode(pbuf, plen, &cp, KVX_WHY(w)))
        return 0;
    uint64_t s = xfer_source_id(cp->instance_id, cp->key.data, cp->key.len);
    kvxfer__context_params__free_unpacked(cp, NULL);
    return s;
}

/* A rank's fetch of a request that other ranks fetched already is
 * refused: the request cannot complete without it, so it ends for every
 * rank now (ERROR, the refusal's code) instead of at the fetch timeout.
 * A rank fetching twice (EXISTS) leaves it as it is. A check that needs
 * the offer (it exists, the token, nobody took it) fails as an ERROR
 * event, as it does at a peer daemon (remote.c, on_open()): on one daemon
 * as across two, the fetch returns 0 and the event says why. */
int xfer_fetch(const xfer_fetch_req_t *rq, kvx_why_t *why)
{
    instance_t *inst = rq->inst;
    uint32_t rank = rq->rank;
    const reqkey_t *key = rq->key;
    const uint8_t *pbuf = rq->params;
    size_t plen = rq->params_len;
    char buf[512]; /* the message is the event's when the caller wants none */
    kvx_why_t own = {buf, sizeof(buf)};
    if (!why || !why->size)
        why = &own;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    int rc, as_event = 0;
    uint64_t src = gone_find(0, inst->id, request_id, key->b, key->len)
                       ? params_source(pbuf, plen)
                       : 0; /* decoded again only for a request that ended */
    if (rank < inst->nranks &&
        fetch_join_end(inst, rank, request_id, key, src, &rc, why))
        return rc;
    rc = fetch_one(rq, request_id, &as_event, why);
    genreq_t *g =
        rc && rc != KVX_ERR_EXISTS ? map_get(&inst->fetches, request_id) : NULL;
    if (g && !reqkey_eq(&g->key, key))
        g = NULL; /* another key's, whose id collides */
    if (as_event && !g) {
        /* no request yet: this one's only event; the other ranks'
         * fetches join it (gone_t) */
        uint8_t *seen = calloc(inst->nranks, 1);
        if (seen && rank < inst->nranks)
            seen[rank] = 1;
        xfer_fetch_end_early(
            inst, key, rq->dp_rank,
            &(batch_end_t){KVX_EVENT_ERROR, rc, why->msg, NULL, 0}, seen,
            params_source(pbuf, plen));
        free(seen);
        return 0;
    }
    if (g && !g->ending && (as_event || g->nfetched > 0) &&
        rank < inst->nranks && !g->parts[rank].fetched) {
        char m[600];
        if (as_event)
            snprintf(m, sizeof(m), "%s", why->msg);
        else
            snprintf(m, sizeof(m), "rank %u's fetch was refused: %s", rank,
                     why->msg);
        g->parts[rank].late = 1;
        genreq_end(g, KVX_EVENT_ERROR, rc, m);
    }
    return as_event ? 0 : rc;
}

static int fetch_one(const xfer_fetch_req_t *rq, uint64_t request_id,
                     int *as_event, kvx_why_t *why)
{
    instance_t *inst = rq->inst;
    uint32_t rank = rq->rank, nblocks = rq->nblocks, skip = rq->skip_tokens;
    uint32_t dp_rank = rq->dp_rank, ngs = rq->ngroups;
    const reqkey_t *key = rq->key;
    const uint8_t *pbuf = rq->params;
    size_t plen = rq->params_len;
    pool_t *pool = rq->pool;
    const uint32_t *blocks = rq->blocks;
    const xfer_group_t *gs = rq->groups;
    int rc;
    Kvxfer__ContextParams *cp;
    /* attention DP: only the named group receives; the plan sees the
     * group as a plain instance of tp/attention_dp ranks */
    plan_side_t dst;
    uint32_t eff_rank;
    uint32_t group = plan_dp_view(&inst->side, rank, &dst, &eff_rank);
    uint32_t ngroups =
        inst->side.attention_dp > 1 ? inst->side.attention_dp : 1;
    if (dp_rank >= ngroups)
        return why_fail(
            why, KVX_ERR_INVALID,
            "fetch.dp_rank: %u, but instance %s has %u attention-DP "
            "group%s",
            dp_rank, inst->id, ngroups, ngroups == 1 ? "" : "s");
    if (group != dp_rank)
        return why_fail(
            why, KVX_ERR_INVALID,
            "fetch.dp_rank: rank %u is in attention-DP group %u, not %u", rank,
            group, dp_rank);
    if ((rc = check_rank_layout(inst, rank, &pool->layout, "fetch", why)))
        return rc;
    if ((rc = xfer_params_decode(pbuf, plen, &cp, why)))
        return rc;
    /* Everything the plan needs comes from the offer, found by id and
     * proven by the token; the rest of the params is only a locator. */
    offer_t *o = NULL;
    instance_t *ci = NULL;
    int remote = inst->nlocal < inst->nranks;
    for (size_t i = 0; i < cp->n_rank_addresses; i++)
        remote |= strcmp(cp->rank_addresses[i], kvxd.address) != 0;
    if (ngs >= XFER_MAX_GROUPS) {
        why_set(why, "fetch.groups: %u, at most %u", ngs, XFER_MAX_GROUPS - 1);
        rc = KVX_ERR_LIMIT;
        goto out;
    }
    if (cp->n_groups != ngs) {
        why_set(why,
                "fetch.groups: %u other block tables, but the offer of "
                "request %s has %zu",
                ngs, xfer_ksb(cp->key.data, cp->key.len), cp->n_groups);
        rc = KVX_ERR_MISMATCH;
        goto out;
    }
    if (remote) {
        rc = fetch_remote(rq, request_id, cp, why);
        goto out;
    }
    /* from here to the plan, the checks of the offer: as at a peer
     * daemon, their failure is an ERROR event (xfer_fetch()), with the
     * code and the message (after "context side: ") a peer sends */
    *as_event = 1;
    uint64_t src_id = xfer_key_id(cp->key.data, cp->key.len);
    if (!(ci = instance_find(cp->instance_id))) {
        why_set(why,
                "context side: no offer for request %s of instance '%s' on "
                "daemon %s (no such instance there)",
                xfer_ksb(cp->key.data, cp->key.len), cp->instance_id,
                kvxd.address);
        rc = KVX_ERR_NOT_FOUND;
        goto out;
    }
    const gone_t *gx;
    if ((!(o = map_get(&ci->offers, src_id)) || o->ending || o->consumed) &&
        (gx = gone_find(1, ci->id, src_id, cp->key.data, cp->key.len))) {
        why_set(why, "context side: %s",
                gx->released ? "released (kvx_release)"
                             : "cancelled by the context side");
        rc = gx->released ? KVX_ERR_NOT_FOUND : KVX_ERR_CANCELLED;
        goto out;
    }
    if (o && (o->key.len != cp->key.len ||
              memcmp(o->key.b, cp->key.data, cp->key.len)))
        o = NULL; /* another key's, whose id collides */
    if (!o || o->ending || o->consumed) {
        why_set(why,
                "context side: no offer for request %s of instance '%s' on "
                "daemon %s (%s)",
                xfer_ksb(cp->key.data, cp->key.len), cp->instance_id,
                kvxd.address,
                !o            ? "expired, cancelled or completed"
                : o->consumed ? "consumed"
                              : "ending");
        rc = KVX_ERR_NOT_FOUND;
        goto out;
    }
    if (!xfer_ct_equal(cp->token.data, o->token, TOKEN_LEN)) {
        why_set(why,
                "context side: capability token does not match the offer "
                "of request %s",
                xfer_ksb(cp->key.data, cp->key.len));
        log_warn("fetch %s/%s: forged or stale capability token for offer "
                 "%s/%s",
                 inst->id, ks(key), ci->id,
                 xfer_ksb(cp->key.data, cp->key.len));
        rc = KVX_ERR_AUTH;
        goto out;
    }
    if (o->ngroups != 1 + ngs) { /* the params said so, but may lie */
        why_set(why,
                "fetch.groups: %u other block tables, but the offer of "
                "request %s has %u",
                ngs, xfer_ksb(cp->key.data, cp->key.len), o->ngroups - 1);
        rc = KVX_ERR_MISMATCH;
        goto out;
    }

    *as_event = 0;
    genreq_t *g = map_get(&inst->fetches, request_id);
    if (g && !reqkey_eq(&g->key, key)) {
        why_set(why,
                "fetch.key: %s has the id of request %s in flight (a 64-bit "
                "collision; use another key)",
                ks(key), ks(&g->key));
        rc = KVX_ERR_EXISTS;
        goto out;
    }
    if (g) {
        if (g->ending) {
            why_set(why, "fetch: request %s is ending (%s)", ks(key),
                    g->end_msg);
            rc = KVX_ERR_STATE;
            goto out;
        }
        if (g->offer != o) {
            why_set(why,
                    "fetch.context_params: request %s is being fetched "
                    "from another offer by another rank",
                    ks(key));
            rc = KVX_ERR_MISMATCH;
            goto out;
        }
        if (g->parts[rank].fetched) {
            why_set(why, "fetch: request %s already fetched by rank %u",
                    ks(key), rank);
            rc = KVX_ERR_EXISTS;
            goto out;
        }
        if (g->dp_rank != dp_rank) {
            why_set(why,
                    "fetch.dp_rank: %u differs from %u given by another rank",
                    dp_rank, g->dp_rank);
            rc = KVX_ERR_MISMATCH;
            goto out;
        }
        if (g->skip_tokens != skip) {
            why_set(why,
                    "fetch.skip_tokens: %u differs from %u given by another "
                    "rank",
                    skip, g->skip_tokens);
            rc = KVX_ERR_MISMATCH;
            goto out;
        }
        for (uint32_t k = 0; k < ngs; k++)
            if (g->gskip[k + 1] != gs[k].skip_tokens) {
                why_set(why,
                        "fetch.groups[%u].skip_tokens: %u differs from %u "
                        "given by another rank",
                        k, gs[k].skip_tokens, g->gskip[k + 1]);
                rc = KVX_ERR_MISMATCH;
                goto out;
            }
    } else if (xfer_rops.offer_taker && xfer_rops.offer_taker(o)) {
        why_set(why,
                "context side: the offer of request %s is already taken by "
                "%s",
                xfer_ksb(cp->key.data, cp->key.len), xfer_rops.offer_taker(o));
        rc = KVX_ERR_EXISTS;
        *as_event = 1;
        goto out;
    } else if (o->consumer) {
        why_set(why,
                "context side: the offer of request %s is already taken by "
                "request %s of instance '%s'",
                xfer_ksb(cp->key.data, cp->key.len), ks(&o->consumer->key),
                o->consumer->inst->id);
        rc = KVX_ERR_EXISTS;
        *as_event = 1;
        goto out;
    } else if (xfer_nrequests >= kvxd.conf.max_requests) {
        why_set(why, "fetch: %u requests in flight (limits.max_requests)",
                xfer_nrequests);
        rc = KVX_ERR_LIMIT;
        goto out;
    }

    plan_t *plan;
    {
        plan_side_t full;
        xfer_side_from_layout(&full, inst, &pool->layout);
        plan_dp_view(&full, rank, &dst, &eff_rank);
    }
    if ((rc = plan_build(&o->side, &dst, eff_rank, o->num_tokens, skip, &plan,
                         why)))
        goto out;
    if ((rc = plan_own(plan, inst->owner_uid, why)))
        goto err_free_plan;
    if (nblocks < plan->dst_blocks_needed) {
        why_set(why,
                "fetch.blocks: %u blocks of %u tokens cannot hold the "
                "offer's %u tokens (need %u)",
                nblocks, dst.tokens_per_block, o->num_tokens,
                plan->dst_blocks_needed);
        rc = KVX_ERR_INVALID;
        goto err_free_plan;
    }
    uint32_t *bt = malloc(plan->dst_blocks_needed * sizeof(uint32_t));
    if (!bt) {
        why_set(why, "fetch: out of memory");
        rc = KVX_ERR_NOMEM;
        goto err_free_plan;
    }
    memcpy(bt, blocks, plan->dst_blocks_needed * sizeof(uint32_t));
    /* the other groups' plans, each from the offer's group to this
     * rank's pool of that group */
    plan_t *gplan[XFER_MAX_GROUPS] = {NULL};
    uint32_t *gbt[XFER_MAX_GROUPS] = {NULL};
    for (uint32_t k = 0; k < ngs; k++)
        if ((rc = group_plan(&(group_src_t){&o->gside[k + 1], o->gtokens[k + 1],
                                            o->gfirst[k + 1], k + 1},
                             inst, rank, &gs[k], &gplan[k], &gbt[k], why)))
            goto err_free_groups;
    /* the tables (and a new request's state), charged to its uid */
    uint64_t mem = fetch_bytes(inst, g, plan, pool, gplan, gs, ngs);
    if ((rc = xfer_req_charge(inst, mem, "fetch: the request", why)))
        goto err_free_groups;
    if (!g) {
        if (!(g = genreq_new(inst, request_id, key, skip, dp_rank, gs, ngs))) {
            kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid, mem);
            why_set(why, "fetch: out of memory");
            rc = KVX_ERR_NOMEM;
            goto err_free_groups;
        }
        g->offer = o;
        snprintf(g->src_instance, sizeof(g->src_instance), "%s", ci->id);
        g->src_id = xfer_source_id(ci->id, o->key.b, o->key.len);
        o->consumer = g;
        dl_remove(&o->lease); /* the fetch timeout bounds it now */
    }
    g->mem += mem;
    part_fetched(g, 0, rank, pool, bt, plan);
    for (uint32_t k = 0; k < ngs; k++)
        part_fetched(g, k + 1, rank, gs[k].pool, gbt[k], gplan[k]);
    log_debug("fetch %s/%s rank %u from %s/%s: %u slices, %llu bytes, %u "
              "groups",
              inst->id, ks(key), rank, ci->id, ks(&o->key), plan->nslices,
              (unsigned long long)plan->bytes, 1 + ngs);
    /* starting a part may end the request (and free it): look it up
     * again before each */
    for (uint32_t k = 0; k <= ngs; k++) {
        if (!(g = map_get(&inst->fetches, request_id)) || g->ending)
            break;
        part_try_start(GPART(g, k, rank));
    }
    xfer_schedule();
    rc = 0;
    goto out;

err_free_groups:
    group_plans_free(gplan, gbt, ngs);
    free(bt);
err_free_plan:
    plan_free(plan);
out:
    kvxfer__context_params__free_unpacked(cp, NULL);
    return rc;
}

/* The plan and destination table of rank's part of group k (k > 0) of a
 * fetch into x, from the offer's table k (side src, src_tokens tokens
 * from block src_first): x's blocks hold its block x->first_block on
 * (the table's entries before it are never written: UINT32_MAX). */
static int group_plan(const group_src_t *gsrc, const instance_t *inst,
                      uint32_t rank, const xfer_group_t *x, plan_t **out,
                      uint32_t **bt_out, kvx_why_t *why)
{
    const plan_side_t *src = gsrc->side;
    uint32_t src_tokens = gsrc->tokens, src_first = gsrc->first, k = gsrc->k;
    int rc;
    char what[48];
    snprintf(what, sizeof(what), "fetch.groups[%u]", k - 1);
    const kvx_layout_t *l = &x->pool->layout;
    plan_side_t full, dst;
    uint32_t eff_rank;
    group_side(&full, inst, l);
    if ((rc = plan_side_check(&full, why)) ||
        (rc = check_side_layout(&full, rank, l, what, why)))
        return rc;
    plan_dp_view(&full, rank, &dst, &eff_rank);
    uint64_t skip_min = (uint64_t)src_first * src->tokens_per_block;
    if (x->skip_tokens < skip_min)
        return why_fail(
            why, KVX_ERR_INVALID,
            "%s.skip_tokens: %u, but the offer's group keeps no tokens "
            "below %llu (its first_block %u)",
            what, x->skip_tokens, (unsigned long long)skip_min, src_first);
    if (x->skip_tokens < (uint64_t)x->first_block * l->tokens_per_block)
        return why_fail(
            why, KVX_ERR_INVALID,
            "%s.skip_tokens: %u, but its blocks start at block %u (token "
            "%llu)",
            what, x->skip_tokens, x->first_block,
            (unsigned long long)x->first_block * l->tokens_per_block);
    if (x->skip_tokens > src_tokens)
        return why_fail(why, KVX_ERR_INVALID,
                        "%s.skip_tokens: %u, more than its %u tokens", what,
                        x->skip_tokens, src_tokens);
    /* before planning: params could ask for billions of tokens; the
     * blocks given bound what can land */
    if (((uint64_t)x->first_block + x->nblocks) * l->tokens_per_block <
        src_tokens)
        return why_fail(
            why, KVX_ERR_INVALID,
            "%s.blocks: %u blocks of %u tokens from block %u cannot hold "
            "the group's %u tokens",
            what, x->nblocks, l->tokens_per_block, x->first_block, src_tokens);
    plan_t *plan;
    if ((rc = plan_build(src, &dst, eff_rank, src_tokens, x->skip_tokens, &plan,
                         why)))
        return rc;
    if ((rc = plan_own(plan, inst->owner_uid, why))) {
        plan_free(plan);
        return rc;
    }
    uint32_t need = plan->dst_blocks_needed;
    if ((uint64_t)x->first_block + x->nblocks < need) {
        plan_free(plan);
        return why_fail(
            why, KVX_ERR_INVALID,
            "%s.blocks: %u blocks of %u tokens from block %u cannot hold "
            "the group's %u tokens (need %u)",
            what, x->nblocks, l->tokens_per_block, x->first_block, src_tokens,
            need);
    }
    uint32_t *bt = malloc((need ? need : 1) * sizeof(uint32_t));
    if (!bt) {
        plan_free(plan);
        return why_fail(why, KVX_ERR_NOMEM, "fetch: out of memory");
    }
    for (uint32_t i = 0; i < need; i++)
        bt[i] = i < x->first_block ? UINT32_MAX : x->blocks[i - x->first_block];
    *out = plan;
    *bt_out = bt;
    return 0;
}
