/*
 * offer — the context side: reserve, publish (the offer and its parts,
 * one per rank and block table), layer-wise readiness (layers_ready,
 * append_blocks, the engines' events), and the busy poll that keeps the
 * loop awake while work is in flight.
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

/* ---- publish ---------------------------------------------------------- */

/* copy.busy_poll: while work is in flight here (a published part not
 * yet consumed or ended, a fetch not yet ended), an idle handle keeps the
 * loop from sleeping, so that the engine's next call (a fetch, a layer
 * made ready), the watcher's hand-off and the copies coming back are read
 * at once instead of after a wake-up each (tens of microseconds on an
 * idle host); the engines' CUDA events are looked at each turn too
 * (gpu_events_poll()). A part holds from its publish until its memory goes
 * (part_layers_free), a fetch from genreq_new() until genreq_free().
 * The loop keeps polling BUSY_LINGER_NS after the last hold goes: the
 * engine's next call is usually a poll for the event just queued. */
#define BUSY_LINGER_NS 1000000ull

static struct {
    uv_idle_t idle;
    int inited, on, enabled; /* enabled: -1 until resolved */
    uint32_t held;
    uint64_t idle_since; /* ns the last hold went (read when held is 0) */
} busy = {.enabled = -1};

static void busy_turn(uv_idle_t *h)
{
    /* the engines' events of layer-wise offers, looked at each turn */
    gpu_events_poll();
    /* a thread that waits on this CPU (a copy worker, or an engine's
     * thread a socket's wake-up placed here) runs now, not when a time
     * slice ends: with it and the library's own yield (spin_readable()),
     * polling pays on 2 CPUs too (the VM's one-block p99 137-160 us
     * with both spinning unyielding, 54-84 yielding) */
    sched_yield();
    if (!busy.held && mono_ns() - busy.idle_since > BUSY_LINGER_NS) {
        uv_idle_stop(h);
        busy.on = 0;
    }
}

void busy_hold(int delta)
{
    busy.held += (uint32_t)delta;
    if (busy.enabled < 0)
        busy.enabled = kvxd.conf.copy_busy_poll == 2
                           ? kvxd_cpus() >= 4
                           : (int)kvxd.conf.copy_busy_poll;
    if (!busy.enabled)
        return;
    if (!busy.held) { /* busy_turn() stops it after the linger */
        busy.idle_since = mono_ns();
        return;
    }
    if (busy.on)
        return;
    if (!busy.inited) {
        if (uv_idle_init(kvxd.loop, &busy.idle))
            return; /* no busy polling: the loop sleeps, as before */
        uv_unref((uv_handle_t *)&busy.idle); /* keeps nothing alive */
        busy.inited = 1;
    }
    busy.on = 1;
    uv_idle_start(&busy.idle, busy_turn);
}

static void part_awaited(offer_part_t *sp, int awaited)
{
    if (sp->awaited == awaited)
        return;
    sp->awaited = awaited;
    busy_hold(awaited ? 1 : -1);
}

/* What a part keeps of its layers' readiness. */
void part_layers_free(offer_part_t *sp)
{
    part_awaited(sp, 0);
    while (sp->watches.next && !list_empty(&sp->watches)) {
        lw_watch_t *x = LIST_OWNER(list_pop(&sp->watches), lw_watch_t, node);
        gpu_event_unwatch(x->w);
        free(x);
    }
    free(sp->tok_ready);
    sp->tok_ready = NULL;
}

/* Bytes held for inst's uid (MEM_REQUESTS): 0, or KVX_ERR_LIMIT with
 * why naming the key (limits.memory_bytes, limits.uid_memory_bytes). */
int xfer_req_charge(const instance_t *inst, uint64_t bytes, const char *what,
                    kvx_why_t *why)
{
    if (!kvxd_mem_charge_uid(MEM_REQUESTS, inst->owner_uid, bytes))
        return 0;
    char w[200];
    kvxd_mem_why(inst->owner_uid, bytes, w, sizeof(w));
    return why_fail(why, KVX_ERR_LIMIT, "%s: its %llu bytes %s", what,
                    (unsigned long long)bytes, w);
}

void part_uncharge(const offer_t *o, offer_part_t *sp)
{
    kvxd_mem_release_uid(MEM_REQUESTS, o->inst->owner_uid, sp->mem);
    sp->mem = 0;
}

void offer_free(offer_t *o)
{
    assert(!list_linked(&o->lease.node) && list_empty(&o->waiters));
    for (size_t r = 0; o->parts && r < OPARTS(o); r++) {
        if (o->parts[r].pool)
            pool_unref(o->parts[r].pool);
        free(o->parts[r].blocks);
        part_layers_free(&o->parts[r]);
        part_uncharge(o, &o->parts[r]);
    }
    kvxd_mem_release_uid(MEM_REQUESTS, o->inst->owner_uid, o->mem);
    if (o->remote) { /* only remote sets it */
        assert(xfer_rops.offer_free);
        xfer_rops.offer_free(o->remote);
        o->remote = NULL;
    }
    aux_drop(o->inst->owner_uid, &o->aux, &o->aux_len);
    free(o->parts);
    free(o->params);
    free(o);
}

/* What a new offer is made of, and which call makes it: its errors
 * start with op ("publish", "reserve"). */
typedef struct offer_spec {
    const char *op;
    uint32_t num_tokens;
    const kvx_layout_t *l;
    const xfer_group_t *groups;
    uint32_t ngroups;
    uint32_t lease_ms; /* resolved (xfer_lease_resolve()) */
} offer_spec_t;

static int offer_create(instance_t *inst, const reqkey_t *key,
                        const offer_spec_t *sp, offer_t **out, kvx_why_t *why)
{
    const char *op = sp->op;
    const kvx_layout_t *l = sp->l;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    uint32_t num_tokens = sp->num_tokens, ngroups = sp->ngroups;
    if (xfer_nrequests >= kvxd.conf.max_requests)
        return why_fail(why, KVX_ERR_LIMIT,
                        "%s: %u requests in flight (limits.max_requests)", op,
                        xfer_nrequests);
    offer_t *o = calloc(1, sizeof(*o));
    if (!o)
        return why_fail(why, KVX_ERR_NOMEM, "%s: out of memory", op);
    list_init(&o->lease.node);
    list_init(&o->waiters);
    o->inst = inst;
    o->request_id = request_id;
    o->key = *key;
    o->num_tokens = num_tokens;
    xfer_side_from_layout(&o->side, inst, l);
    snprintf(o->preset, sizeof(o->preset), "%s", l->preset);
    o->ngroups = 1 + ngroups;
    o->gside[0] = o->side;
    o->gtokens[0] = num_tokens;
    for (uint32_t k = 0; k < ngroups; k++) {
        group_side(&o->gside[k + 1], inst, &sp->groups[k].pool->layout);
        o->gtokens[k + 1] = sp->groups[k].num_tokens;
        o->gfirst[k + 1] = sp->groups[k].first_block;
    }
    o->created_ms = kvxd_now_ms();
    o->start_us = wall_us();
    o->lease_ms = sp->lease_ms;
    /* an instance spread over daemons: every daemon of it must give the
     * same params, so the token is derived from the cluster secret */
    if (inst->nlocal < inst->nranks && peer_enabled())
        peer_token(inst->id, inst->owner_uid, inst->addresses[0], request_id,
                   o->token);
    else if (xfer_random_token(o->token)) {
        free(o);
        return why_fail(why, KVX_ERR_IO, "%s: getrandom failed", op);
    }
    if (!(o->parts = calloc(OPARTS(o), sizeof(*o->parts))) ||
        params_build(o, l)) {
        free(o->parts);
        free(o->params);
        free(o);
        return why_fail(why, KVX_ERR_NOMEM, "%s: out of memory", op);
    }
    /* what a reservation or an offer holds, charged to its uid */
    uint64_t mem = sizeof(*o) + OPARTS(o) * sizeof(*o->parts) + o->params_len;
    char what[32];
    snprintf(what, sizeof(what), "%s: the request", op);
    int rc = xfer_req_charge(inst, mem, what, why);
    if (rc || map_put(&inst->offers, request_id, o)) {
        if (!rc)
            kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid, mem);
        free(o->parts);
        free(o->params);
        free(o);
        if (rc)
            return rc;
        return why_fail(why, KVX_ERR_NOMEM, "%s: out of memory", op);
    }
    o->mem = mem;
    xfer_nrequests++;
    dl_insert(&xfer_leases, &o->lease, o->created_ms + o->lease_ms);
    *out = o;
    if (xfer_offer_made)
        xfer_offer_made(inst, key);
    return 0;
}

void xfer_consumer_name(const xfer_consumer_t *who, char *buf, size_t n)
{
    char k[REQKEY_STR_MAX];
    snprintf(buf, n, "request %s of instance '%s'",
             reqkey_str(who->key, who->key_len, k), who->inst);
}

/* Is o taken by a consumer other than who (NULL: any consumer)? */
static int taken_by_other(const offer_t *o, const xfer_consumer_t *who)
{
    if (!o->consumer && !o->taken)
        return 0;
    if (!who)
        return 1;
    if (o->consumer) /* a fetch on this daemon */
        return strcmp(o->consumer->inst->id, who->inst) ||
               o->consumer->key.len != who->key_len ||
               memcmp(o->consumer->key.b, who->key, who->key_len);
    char name[512];
    const char *t = xfer_rops.offer_taker ? xfer_rops.offer_taker(o) : NULL;
    xfer_consumer_name(who, name, sizeof(name));
    return !t || strcmp(t, name);
}

int xfer_params_for(instance_t *inst, const reqkey_t *key,
                    const xfer_consumer_t *who, uint8_t **params, size_t *len,
                    kvx_why_t *why)
{
    uint64_t id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, id);
    const gone_t *x = gone_find(1, inst->id, id, key->b, key->len);
    if (o && !reqkey_eq(&o->key, key))
        o = NULL; /* another key's, whose id collides */
    if ((!o || o->ending || o->consumed || o->consume_fenced) && x &&
        x->released)
        return why_fail(why, KVX_ERR_NOT_FOUND,
                        "request %s of instance %s was released (kvx_release)",
                        ks(key), inst->id);
    if (!o && x)
        return why_fail(
            why, KVX_ERR_CANCELLED,
            "request %s of instance %s: cancelled by the context side", ks(key),
            inst->id);
    if (!o)
        return why_fail(why, XFER_NOT_YET,
                        "no offer of request %s of instance %s", ks(key),
                        inst->id);
    if (o->ending || o->consumed || o->consume_fenced)
        return why_fail(why, XFER_NOT_YET,
                        "the offer of request %s of instance %s has ended",
                        ks(key), inst->id);
    if (taken_by_other(o, who))
        return why_fail(
            why, KVX_ERR_EXISTS,
            "the offer of request %s of instance %s is taken by another "
            "fetch",
            ks(key), inst->id);
    if (!(*params = malloc(o->params_len)))
        return why_fail(why, KVX_ERR_NOMEM, "out of memory");
    memcpy(*params, o->params, o->params_len);
    *len = o->params_len;
    return 0;
}

int xfer_fetch_runs(instance_t *inst, const reqkey_t *key)
{
    genreq_t *g = map_get(&inst->fetches, xfer_key_id(key->b, key->len));
    return g != NULL;
}

void xfer_fetch_end_early(instance_t *inst, const reqkey_t *key,
                          uint32_t dp_rank, const batch_end_t *end,
                          const uint8_t *seen, uint64_t src)
{
    uint32_t groups = inst->side.attention_dp > 1 ? inst->side.attention_dp : 1;
    uint64_t id = xfer_key_id(key->b, key->len);
    uint32_t need = group_ranks(inst, dp_rank), n = 0;
    xfer_push_event(inst, id, key, end, 0, need, inst->nranks / groups);
    for (uint32_t r = 0; seen && r < inst->nranks; r++)
        n += seen[r] != 0;
    /* the other ranks' fetches join this end (gone_t), no second event */
    gone_t *x = n < need ? gone_add(0, inst, id, key, src) : NULL;
    for (uint32_t r = 0; x && seen && r < inst->nranks; r++)
        x->ranks[r] = seen[r] != 0;
    if (x) {
        x->need = need;
        x->seen = n;
    }
}

void xfer_fetch_deadline(instance_t *inst, const reqkey_t *key,
                         uint64_t until_ms)
{
    genreq_t *g = map_get(&inst->fetches, xfer_key_id(key->b, key->len));
    if (!g || !reqkey_eq(&g->key, key) || g->ending ||
        !list_linked(&g->timeout.node) || g->timeout.deadline_ms <= until_ms)
        return;
    dl_remove(&g->timeout);
    dl_insert(&xfer_timeouts, &g->timeout, until_ms);
}

static int groups_check(const instance_t *inst, uint32_t rank, const offer_t *o,
                        const xfer_group_t *gs, uint32_t n, const char *op,
                        kvx_why_t *why);

int xfer_reserve(const xfer_reserve_req_t *rq, uint8_t **params,
                 size_t *params_len, kvx_why_t *why)
{
    instance_t *inst = rq->inst;
    const reqkey_t *key = rq->key;
    uint32_t num_tokens = rq->num_tokens, ngroups = rq->ngroups;
    const kvx_layout_t *l = rq->layout;
    const xfer_group_t *groups = rq->groups;
    int rc;
    uint32_t lease;
    if (num_tokens == 0)
        return why_fail(why, KVX_ERR_INVALID, "reserve.num_tokens: 0");
    if ((rc = xfer_lease_resolve("reserve", rq->lease_ms, &lease, why)))
        return rc;
    if ((rc = groups_check(inst, 0, NULL, groups, ngroups, "reserve", why)))
        return rc;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    if (o)
        return why_fail(why, KVX_ERR_EXISTS,
                        "reserve.key: request %s of instance %s is %s already",
                        ks(key), inst->id,
                        !reqkey_eq(&o->key, key)
                            ? "taken by a key of the same id"
                        : o->npublished ? "published"
                                        : "reserved");
    offer_spec_t sp = {.op = "reserve",
                       .num_tokens = num_tokens,
                       .l = l,
                       .groups = groups,
                       .ngroups = ngroups,
                       .lease_ms = lease};
    if ((rc = offer_create(inst, key, &sp, &o, why)))
        return rc;
    o->reserved = 1;
    if (!(*params = malloc(o->params_len))) {
        offer_end(o, KVX_EVENT_ERROR, KVX_ERR_NOMEM, "reserve: out of memory");
        return why_fail(why, KVX_ERR_NOMEM, "reserve: out of memory");
    }
    memcpy(*params, o->params, o->params_len);
    *params_len = o->params_len;
    log_debug("reserve %s/%s: %u tokens, %u more tables", inst->id, ks(key),
              num_tokens, ngroups);
    return 0;
}

/* A table of ntok tokens needs `need` blocks: within
 * limits.max_blocks_per_request, before anything is allocated for it?
 * what names the table ("publish", "publish.groups[0]"). */
static int blocks_bound(const char *what, uint32_t ntok, uint64_t need,
                        kvx_why_t *why)
{
    if (need > kvxd.conf.max_blocks_per_request)
        return why_fail(why, KVX_ERR_LIMIT,
                        "%s.num_tokens: %u tokens need %llu blocks, more than "
                        "limits.max_blocks_per_request %u",
                        what, ntok, (unsigned long long)need,
                        kvxd.conf.max_blocks_per_request);
    return 0;
}

/* The other groups of a rank's publish (op "publish") or of a
 * reservation (op "reserve": no blocks, no rank), each against itself
 * and, when the offer exists (o), against the groups another rank
 * published or the reservation made. */
static int groups_check(const instance_t *inst, uint32_t rank, const offer_t *o,
                        const xfer_group_t *gs, uint32_t n, const char *op,
                        kvx_why_t *why)
{
    int rc, reserve = !strcmp(op, "reserve");
    const char *other = o && o->reserved && !o->npublished
                            ? "the reservation made"
                            : "another rank published";
    if (n >= XFER_MAX_GROUPS)
        return why_fail(why, KVX_ERR_LIMIT, "%s.groups: %u, at most %u", op, n,
                        XFER_MAX_GROUPS - 1);
    if (o && o->ngroups != 1 + n)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "%s.groups: %u other block tables, but %s %u", op, n,
                        other, o->ngroups - 1);
    for (uint32_t k = 0; k < n; k++) {
        const xfer_group_t *x = &gs[k];
        const kvx_layout_t *l = &x->pool->layout;
        char what[48];
        snprintf(what, sizeof(what), "%s.groups[%u]", op, k);
        if (x->num_tokens == 0)
            return why_fail(why, KVX_ERR_INVALID, "%s.num_tokens: 0", what);
        uint64_t need = ceil_div(x->num_tokens, l->tokens_per_block);
        if ((rc = blocks_bound(what, x->num_tokens, need, why)))
            return rc;
        if (x->first_block >= need)
            return why_fail(
                why, KVX_ERR_INVALID,
                "%s.first_block: %u, but its %u tokens lie in %llu blocks",
                what, x->first_block, x->num_tokens, (unsigned long long)need);
        if (!reserve && x->nblocks < need - x->first_block)
            return why_fail(
                why, KVX_ERR_INVALID,
                "%s.blocks: %u blocks of %u tokens from block %u cannot hold "
                "num_tokens %u (need %llu)",
                what, x->nblocks, l->tokens_per_block, x->first_block,
                x->num_tokens, (unsigned long long)(need - x->first_block));
        plan_side_t gs1;
        if (o)
            gs1 = o->gside[k + 1];
        else
            group_side(&gs1, inst, l);
        /* a reservation has the layout summary alone: the rank's
         * share is checked at its publish */
        if ((rc = plan_side_check(&gs1, why)) ||
            (!reserve && (rc = check_side_layout(&gs1, rank, l, what, why))))
            return rc;
        if (o && (o->gtokens[k + 1] != x->num_tokens ||
                  o->gfirst[k + 1] != x->first_block))
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "%s: num_tokens %u, first_block %u differ from %u, %u that "
                "%s",
                what, x->num_tokens, x->first_block, o->gtokens[k + 1],
                o->gfirst[k + 1], other);
        if (o &&
            (l->tokens_per_block != gs1.tokens_per_block ||
             l->head_dim != gs1.head_dim || l->dtype != gs1.dtype ||
             l->kv_factor != gs1.kv_factor || l->elem_size != gs1.elem_size))
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "%s.pool_id: layout (tokens_per_block, head_dim, dtype, "
                "elem_size or kv_factor) differs from the one %s",
                what, other);
    }
    return 0;
}

/* Rank's part of group k (k > 0) of o takes x's blocks (a table of every
 * block of the group's tokens: those before first_block are never read,
 * UINT32_MAX) and a reference to its pool. */
static int group_part_publish(offer_t *o, uint32_t k, uint32_t rank,
                              const xfer_group_t *x, int layerwise)
{
    offer_part_t *part = OPART(o, k, rank);
    const kvx_layout_t *l = &x->pool->layout;
    uint32_t need = (uint32_t)ceil_div(x->num_tokens, l->tokens_per_block);
    if (!(part->blocks = malloc(need * sizeof(uint32_t))))
        return KVX_ERR_NOMEM;
    for (uint32_t i = 0; i < x->first_block; i++)
        part->blocks[i] = UINT32_MAX;
    memcpy(part->blocks + x->first_block, x->blocks,
           (need - x->first_block) * sizeof(uint32_t));
    part->nblocks = part->nappended = need;
    part->nlayers = l->num_layers;
    part->ready = layerwise ? 0 : l->num_layers;
    list_init(&part->watches);
    part->layerwise = layerwise;
    if (layerwise &&
        !(part->tok_ready = calloc(l->num_layers, sizeof(uint32_t)))) {
        free(part->blocks);
        part->blocks = NULL;
        return KVX_ERR_NOMEM;
    }
    part->pool = x->pool;
    part->published = 1;
    part_awaited(part, 1);
    pool_ref(x->pool);
    return 0;
}

int xfer_publish(const xfer_publish_req_t *rq, uint8_t **params,
                 size_t *params_len, kvx_why_t *why)
{
    instance_t *inst = rq->inst;
    uint32_t rank = rq->rank, nblocks = rq->nblocks;
    uint32_t num_tokens = rq->num_tokens, ngroups = rq->ngroups;
    const reqkey_t *key = rq->key;
    pool_t *pool = rq->pool;
    const uint32_t *blocks = rq->blocks;
    const xfer_group_t *groups = rq->groups;
    const uint8_t *aux = rq->aux;
    uint32_t aux_len = rq->aux_len;
    int layerwise = rq->layerwise;
    int rc;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    const kvx_layout_t *l = &pool->layout;
    if ((rc = check_rank_layout(inst, rank, l, "publish", why)))
        return rc;
    if (num_tokens == 0)
        return why_fail(why, KVX_ERR_INVALID, "publish.num_tokens: 0");
    uint32_t lease;
    if ((rc = xfer_lease_resolve("publish", rq->lease_ms, &lease, why)))
        return rc;
    uint64_t need = ceil_div(num_tokens, l->tokens_per_block);
    if (nblocks < need && !layerwise)
        return why_fail(
            why, KVX_ERR_INVALID,
            "publish.blocks: %u blocks of %u tokens cannot hold num_tokens "
            "%u (need %llu)",
            nblocks, l->tokens_per_block, num_tokens, (unsigned long long)need);
    /* a layer-wise table has room for every block of num_tokens */
    if ((rc = blocks_bound("publish", num_tokens, need, why)))
        return rc;

    offer_t *o = map_get(&inst->offers, request_id);
    if (o && !reqkey_eq(&o->key, key))
        return why_fail(why, KVX_ERR_EXISTS,
                        "publish.key: %s has the id of request %s in flight (a "
                        "64-bit collision; use another key)",
                        ks(key), ks(&o->key));
    if ((rc = groups_check(inst, rank, o, groups, ngroups, "publish", why)))
        return rc;
    int created = !o;
    if (!o) {
        offer_spec_t sp = {.op = "publish",
                           .num_tokens = num_tokens,
                           .l = l,
                           .groups = groups,
                           .ngroups = ngroups,
                           .lease_ms = lease};
        if ((rc = offer_create(inst, key, &sp, &o, why)))
            return rc;
    } else {
        if (o->ending)
            return why_fail(why, KVX_ERR_STATE,
                            "publish: request %s is ending (%s)", ks(key),
                            o->end_msg);
        if (o->parts[rank].published)
            return why_fail(why, KVX_ERR_EXISTS,
                            "publish: request %s already published by rank %u",
                            ks(key), rank);
        if (o->num_tokens != num_tokens)
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "publish.num_tokens: %u differs from %u published by another "
                "rank",
                num_tokens, o->num_tokens);
        if (rq->lease_ms && rq->lease_ms != o->lease_ms)
            return why_fail(why, KVX_ERR_MISMATCH,
                            "publish.lease_ms: %u differs from the offer's "
                            "lease of %u ms (%s)",
                            rq->lease_ms, o->lease_ms,
                            o->reserved && !o->npublished
                                ? "the reservation's"
                                : "another rank's publish");
        if (l->tokens_per_block != o->side.tokens_per_block ||
            l->head_dim != o->side.head_dim || l->dtype != o->side.dtype ||
            l->kv_factor != o->side.kv_factor ||
            l->elem_size != o->side.elem_size || strcmp(l->preset, o->preset))
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "publish.pool_id: layout (preset, tokens_per_block, head_dim, "
                "dtype, elem_size or kv_factor) differs from another rank's");
    }
    /* the first non-empty aux is the request's; another rank's must be
     * the same bytes (or none) */
    if (aux_len && o->aux_len &&
        (aux_len != o->aux_len || memcmp(aux, o->aux, aux_len)))
        return why_fail(
            why, KVX_ERR_MISMATCH,
            "publish.aux: %u bytes differ from the %u bytes of aux another "
            "rank published for request %s",
            aux_len, o->aux_len, ks(key));
    if (aux_len && !o->aux_len &&
        (rc = aux_keep(inst->owner_uid, aux, aux_len, &o->aux, "publish.aux",
                       why))) {
        if (created) { /* nothing kept: the offer goes as it came */
            xfer_nrequests--;
            offer_drop(o);
        }
        return rc;
    }
    if (aux_len && !o->aux_len)
        o->aux_len = aux_len;
    offer_part_t *part = &o->parts[rank];
    if (o->consumed) {
        /* the consumer needed other ranks only (replicated heads) and is
         * done: same params, nothing to hold, no second event */
        if (!(*params = malloc(o->params_len)))
            return why_fail(why, KVX_ERR_NOMEM, "publish: out of memory");
        memcpy(*params, o->params, o->params_len);
        *params_len = o->params_len;
        part->published = 1;
        if (++o->npublished == inst->nlocal)
            offer_drop(o);
        return 0;
    }
    /* the rank's tables (and layer-wise counters), charged first */
    uint64_t tmem = need * sizeof(uint32_t) +
                    (layerwise ? l->num_layers * sizeof(uint32_t) : 0);
    for (uint32_t k = 0; k < ngroups; k++)
        tmem +=
            ceil_div(groups[k].num_tokens,
                     groups[k].pool->layout.tokens_per_block) *
                sizeof(uint32_t) +
            (layerwise ? groups[k].pool->layout.num_layers * sizeof(uint32_t)
                       : 0);
    if ((rc = xfer_req_charge(inst, tmem, "publish.blocks: the block tables",
                              why))) {
        if (created) { /* nothing kept: the offer goes as it came */
            xfer_nrequests--;
            offer_drop(o);
        }
        return rc;
    }
    part->mem = tmem;
    part->nlayers = l->num_layers;
    part->ready = layerwise ? 0 : l->num_layers;
    list_init(&part->watches);
    if (layerwise &&
        !(part->tok_ready = calloc(l->num_layers, sizeof(uint32_t))))
        return why_fail(why, KVX_ERR_NOMEM, "publish: out of memory");
    /* room for every block (a chunked prefill appends the rest; those
     * not given yet are never read: no token of theirs is ready) */
    if (!(part->blocks = calloc(need, sizeof(uint32_t)))) {
        part_layers_free(part);
        return why_fail(why, KVX_ERR_NOMEM, "publish: out of memory");
    }
    for (uint32_t k = 0; k < ngroups; k++)
        if (group_part_publish(o, k + 1, rank, &groups[k], layerwise)) {
            for (uint32_t j = 1; j <= k + 1; j++) {
                offer_part_t *gp = OPART(o, j, rank);
                if (gp->pool)
                    pool_unref(gp->pool);
                free(gp->blocks);
                part_layers_free(gp);
                memset(gp, 0, sizeof(*gp));
            }
            free(part->blocks);
            part->blocks = NULL;
            part_layers_free(part);
            part_uncharge(o, part);
            if (created) {
                xfer_nrequests--;
                offer_drop(o);
            }
            return why_fail(why, KVX_ERR_NOMEM, "publish: out of memory");
        }
    part->nappended = (uint32_t)(nblocks < need ? nblocks : need);
    memcpy(part->blocks, blocks, part->nappended * sizeof(uint32_t));
    part->nblocks = (uint32_t)need;
    part->pool = pool;
    part->published = 1;
    part->layerwise = layerwise;
    part_awaited(part, 1);
    pool_ref(pool);
    o->npublished++;
    log_debug("publish %s/%s rank %u: %u blocks, %u tokens", inst->id, ks(key),
              rank, part->nblocks, num_tokens);

    /* copy the params out first: starting a waiting consumer may end the
     * request (and free the offer) before the reply is sent */
    if (!(*params = malloc(o->params_len)))
        return why_fail(why, KVX_ERR_NOMEM, "publish: out of memory");
    memcpy(*params, o->params, o->params_len);
    *params_len = o->params_len;
    if (xfer_rops.offer_published)
        xfer_rops.offer_published(o);
    /* a consumer may be waiting for this rank; look it up again after
     * each part, since a failing part ends (and frees) it */
    if ((o = map_get(&inst->offers, request_id)) && o->consumer) {
        instance_t *gi = o->consumer->inst;
        uint64_t gid = o->consumer->request_id;
        for (size_t r = 0; r < (size_t)gi->nranks * XFER_MAX_GROUPS; r++) {
            genreq_t *g = map_get(&gi->fetches, gid);
            if (!g || g->ending || r >= GPARTS(g))
                break;
            part_try_start(&g->parts[r]);
        }
    }
    xfer_schedule();
    return 0;
}

/* Parked parts of o's consumer that have ready units again go back on
 * the queue. */
static void consumer_wake(offer_t *o)
{
    genreq_t *g = o->consumer;
    if (!g || g->ending)
        return;
    for (size_t r = 0; r < GPARTS(g); r++) {
        genpart_t *p = &g->parts[r];
        if (p->parked && p->cnext && part_has_ready(p)) {
            p->parked = 0;
            rrq_push(&xfer_runq, &p->turn);
        }
    }
    xfer_schedule();
}

/* A ready mark (what: "layers_ready", for tokens_ready too, or
 * "append_blocks") for key, of which inst has no offer now: 0 when the
 * offer completed (its transfer done, consumed, or released: nothing is
 * left to mark), CANCELLED when it was cancelled, else NOT_FOUND (never
 * published, ended otherwise, or forgotten). */
static int mark_no_offer(const instance_t *inst, uint64_t request_id,
                         const reqkey_t *key, const char *what, kvx_why_t *why)
{
    const gone_t *x = gone_find(1, inst->id, request_id, key->b, key->len);
    if (x && !x->released)
        return why_fail(why, KVX_ERR_CANCELLED, "%s: request %s was cancelled",
                        what, ks(key));
    if (x || done_find(inst, key))
        return 0;
    return why_fail(why, KVX_ERR_NOT_FOUND,
                    "%s: no offer of request %s in instance %s (never "
                    "published, or ended: its event says how)",
                    what, ks(key), inst->id);
}

/* Layers [first, first + count) of rank's part of o hold the KV of
 * tokens [0, tokens). */
static void layers_mark(offer_t *o, uint32_t group, uint32_t rank,
                        uint32_t first, uint32_t count, uint32_t tokens)
{
    offer_part_t *sp = OPART(o, group, rank);
    uint32_t ready0 = sp->ready;
    for (uint32_t l = first; l < first + count; l++)
        if (sp->tok_ready[l] < tokens)
            sp->tok_ready[l] = tokens;
    while (sp->ready < sp->nlayers &&
           sp->tok_ready[sp->ready] >= o->gtokens[group])
        sp->ready++;
    log_debug("layers_ready %s/%s rank %u: [%u, %u) to token %u, %u whole",
              o->inst->id, ks(&o->key), rank, first, first + count, tokens,
              sp->ready);
    instance_t *inst = o->inst;
    uint64_t id = o->request_id;
    int more = sp->ready > ready0;
    if (more && sp->ready == sp->nlayers)
        o->lw_all_ns = mono_ns(); /* the last part's whole: the latest */
    consumer_wake(o);
    /* peer daemons read a rank's part layer by layer, each once whole */
    if (more && (o = map_get(&inst->offers, id)) && xfer_rops.offer_published)
        xfer_rops.offer_published(o);
}

/* The engine's event for some layers is reached (the watcher, on the
 * loop): they are ready; an event CUDA reports an error for ends the
 * offer, since those layers may never be written. */
static void layers_reached(void *arg, int status)
{
    lw_watch_t *x = arg;
    offer_t *o = x->offer;
    list_remove(&x->node);
    if (status) {
        char m[160];
        snprintf(m, sizeof(m),
                 "the engine's CUDA event for layers [%u, %u) of rank %u "
                 "failed",
                 x->first, x->first + x->count, x->rank);
        free(x);
        offer_end(o, KVX_EVENT_ERROR, KVX_ERR_IO, m);
        return;
    }
    uint32_t rank = x->rank, first = x->first, count = x->count;
    uint32_t tokens = x->tokens, group = x->group;
    free(x);
    if (!o->ending)
        layers_mark(o, group, rank, first, count, tokens);
}

int xfer_layers_ready(const xfer_ready_req_t *rq, kvx_why_t *why)
{
    instance_t *inst = rq->inst;
    uint32_t rank = rq->rank, group = rq->group, first = rq->first;
    uint32_t count = rq->count, tokens = rq->tokens;
    const reqkey_t *key = rq->key;
    const uint8_t *ev = rq->ev;
    size_t ev_len = rq->ev_len;
    uint64_t owner = rq->owner;
    int rc;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    if (!o || !reqkey_eq(&o->key, key))
        return mark_no_offer(inst, request_id, key, "layers_ready", why);
    if (o->ending && o->end_kind == KVX_EVENT_COMPLETE)
        return 0; /* complete: nothing is left to mark */
    if (o->ending)
        return why_fail(why, KVX_ERR_STATE,
                        "layers_ready: request %s is ending (%s)", ks(key),
                        o->end_msg);
    if (group >= o->ngroups)
        return why_fail(
            why, KVX_ERR_INVALID,
            "layers_ready.group: %u, but request %s has %u block table%s",
            group, ks(key), o->ngroups, o->ngroups == 1 ? "" : "s");
    offer_part_t *sp = OPART(o, group, rank);
    if (!OPART(o, 0, rank)->published)
        return why_fail(why, KVX_ERR_STATE,
                        "layers_ready: rank %u has not published request %s",
                        rank, ks(key));
    if (o->consumed)
        return 0; /* its consumer needed other ranks only, and is done */
    if (!sp->layerwise)
        return why_fail(
            why, KVX_ERR_STATE,
            "layers_ready: request %s was published whole (publish with "
            "layerwise to offer layers before their KV exists)",
            ks(key));
    if (count == 0 || first >= sp->nlayers || count > sp->nlayers - first)
        return why_fail(
            why, KVX_ERR_INVALID,
            "layers_ready: layers [%u, %llu) are not inside this rank's %u "
            "layers",
            first, (unsigned long long)first + count, sp->nlayers);
    uint32_t ntok = o->gtokens[group];
    if (tokens == 0)
        tokens = ntok;
    if (tokens > ntok)
        return why_fail(why, KVX_ERR_INVALID,
                        "layers_ready.tokens: %u, more than the request's %u",
                        tokens, ntok);
    uint32_t tpb = o->gside[group].tokens_per_block;
    if (ceil_div(tokens, tpb) > sp->nappended)
        return why_fail(
            why, KVX_ERR_INVALID,
            "layers_ready.tokens: %u tokens lie in %llu blocks; %u appended "
            "(append_blocks first)",
            tokens, (unsigned long long)ceil_div(tokens, tpb), sp->nappended);
    if (!ev_len) {
        layers_mark(o, group, rank, first, count, tokens);
        return 0;
    }
    if (ev_len != 64)
        return why_fail(
            why, KVX_ERR_INVALID,
            "layers_ready.cuda_event: %zu bytes (a cudaIpcEventHandle_t "
            "has 64)",
            ev_len);
    if (!sp->pool->gpu)
        return why_fail(
            why, KVX_ERR_INVALID,
            "layers_ready.cuda_event: pool %u is host memory (host pools "
            "say layers_ready once the KV is written, without an event)",
            sp->pool->id);
    gpu_event_t *e;
    if ((rc = gpu_event_import(ev, sp->pool->device, owner, &e, why)))
        return rc;
    lw_watch_t *x = calloc(1, sizeof(*x));
    if (x && !(x->w = gpu_event_watch(e, layers_reached, x))) {
        free(x);
        x = NULL;
    }
    gpu_event_unref(e); /* the watch holds its own reference */
    if (!x)
        return why_fail(why, KVX_ERR_NOMEM, "layers_ready: out of memory");
    *x = (lw_watch_t){o, group, rank, first, count, tokens, x->w, {NULL, NULL}};
    list_push(&sp->watches, &x->node);
    log_debug("layers_ready %s/%s rank %u: [%u, %u) once its event is "
              "reached",
              inst->id, ks(key), rank, first, first + count);
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int xfer_blocks_repeat(const uint32_t *b, size_t n, size_t *at)
{
    *at = n;
    if (n <= 32) {
        for (size_t i = 1; i < n && *at == n; i++)
            for (size_t k = 0; k < i; k++)
                if (b[k] == b[i]) {
                    *at = i;
                    break;
                }
        return 0;
    }
    /* tables are mostly a few runs of nearby ids: a bitmap over their
     * span, when it is no larger than the sort's array (8 bytes an
     * entry), finds the first repeat in one pass; the sort took a fifth
     * of the daemon's time for 1000-block requests */
    uint32_t lo = b[0], hi = b[0];
    for (size_t i = 1; i < n; i++) {
        lo = b[i] < lo ? b[i] : lo;
        hi = b[i] > hi ? b[i] : hi;
    }
    uint64_t span = (uint64_t)hi - lo + 1;
    if (span <= (uint64_t)n * 64) {
        uint64_t *bits = calloc((size_t)(span + 63) / 64, sizeof(*bits));
        if (!bits)
            return KVX_ERR_NOMEM;
        for (size_t i = 0; i < n; i++) {
            uint32_t k = b[i] - lo;
            uint64_t m = 1ull << (k & 63);
            if (bits[k >> 6] & m) {
                *at = i;
                break;
            }
            bits[k >> 6] |= m;
        }
        free(bits);
        return 0;
    }
    uint64_t *v = malloc(n * sizeof(*v)); /* block << 32 | index */
    if (!v)
        return KVX_ERR_NOMEM;
    for (size_t i = 0; i < n; i++)
        v[i] = (uint64_t)b[i] << 32 | i;
    qsort(v, n, sizeof(*v), cmp_u64);
    for (size_t i = 1; i < n; i++)
        if (v[i] >> 32 == v[i - 1] >> 32 && (uint32_t)v[i] < *at)
            *at = (uint32_t)v[i];
    free(v);
    return 0;
}

int xfer_append_blocks(instance_t *inst, uint32_t rank, const reqkey_t *key,
                       const pool_t *pool, const uint32_t *blocks,
                       uint32_t nblocks, kvx_why_t *why)
{
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    if (!o || !reqkey_eq(&o->key, key))
        return mark_no_offer(inst, request_id, key, "append_blocks", why);
    if (o->ending && o->end_kind == KVX_EVENT_COMPLETE)
        return 0; /* complete: nothing is left to mark */
    if (o->ending)
        return why_fail(why, KVX_ERR_STATE,
                        "append_blocks: request %s is ending (%s)", ks(key),
                        o->end_msg);
    offer_part_t *sp = &o->parts[rank];
    if (!sp->published)
        return why_fail(why, KVX_ERR_STATE,
                        "append_blocks: rank %u has not published request %s",
                        rank, ks(key));
    if (o->consumed)
        return 0;
    if (!sp->layerwise)
        return why_fail(
            why, KVX_ERR_STATE,
            "append_blocks: request %s was published whole (publish with "
            "layerwise to add blocks as chunks finish)",
            ks(key));
    if (pool != sp->pool)
        return why_fail(
            why, KVX_ERR_INVALID,
            "append_blocks.pool_id: pool %u, but request %s was published "
            "from pool %u",
            pool->id, ks(key), sp->pool->id);
    if (nblocks > sp->nblocks - sp->nappended)
        return why_fail(
            why, KVX_ERR_INVALID,
            "append_blocks.blocks: %u more, but request %s holds %u blocks "
            "(num_tokens %u) and %u are given",
            nblocks, ks(key), sp->nblocks, o->num_tokens, sp->nappended);
    /* written past the blocks given (never read until nappended covers
     * them), then checked as one table: O(n log n), not given x new */
    uint32_t first = sp->nappended;
    memcpy(sp->blocks + first, blocks, nblocks * sizeof(uint32_t));
    size_t dup;
    if (xfer_blocks_repeat(sp->blocks, first + nblocks, &dup))
        return why_fail(why, KVX_ERR_NOMEM, "append_blocks: out of memory");
    if (dup < first + nblocks)
        return why_fail(
            why, KVX_ERR_INVALID,
            "append_blocks.blocks[%zu]: block %u is already one of request "
            "%s's blocks",
            dup - first, sp->blocks[dup], ks(key));
    sp->nappended += nblocks;
    /* a consumer part running on a GPU has the table uploaded: its new
     * entries go there too (before any launch that reads them: those
     * wait for their tokens, which wait for these blocks) */
    genreq_t *g = o->consumer;
    for (uint32_t r = 0; g && !g->ending && r < g->inst->nranks; r++) {
        genpart_t *p = &g->parts[r];
        for (uint32_t i = 0; p->gpu && i < p->plan->nslices; i++) {
            if (p->plan->slices[i].src_rank != rank)
                continue;
            int rc = gpu_part_set_blocks(p->gpu, i, first, blocks, nblocks);
            if (rc) { /* the fetch ends (g may be freed): no more */
                genreq_end(g, KVX_EVENT_ERROR, rc,
                           "appending blocks to the GPU plan failed");
                return 0;
            }
        }
    }
    return 0;
}

int xfer_fetch_progress(instance_t *inst, uint32_t rank, const reqkey_t *key,
                        uint32_t group, uint32_t *done, uint32_t *nlayers,
                        kvx_why_t *why)
{
    uint64_t request_id = xfer_key_id(key->b, key->len);
    genreq_t *g = map_get(&inst->fetches, request_id);
    if (!g || !reqkey_eq(&g->key, key))
        return why_fail(
            why, KVX_ERR_NOT_FOUND,
            "fetch_progress: no fetch of request %s in instance %s (never "
            "fetched, or ended: its event says how)",
            ks(key), inst->id);
    if (!GPART(g, 0, rank)->fetched)
        return why_fail(why, KVX_ERR_STATE,
                        "fetch_progress: rank %u has not fetched request %s",
                        rank, ks(key));
    if (group >= g->ngroups)
        return why_fail(
            why, KVX_ERR_INVALID,
            "fetch_progress.group: %u, but request %s has %u block table%s",
            group, ks(key), g->ngroups, g->ngroups == 1 ? "" : "s");
    genpart_t *p = GPART(g, group, rank);
    *nlayers = p->pool->layout.num_layers;
    *done = 0;
    if (p->done) {
        *done = *nlayers;
    } else if (p->ldone && p->lneed) {
        while (*done < *nlayers && p->ldone[*done] >= p->lneed[*done])
            (*done)++;
    }
    return g->ending ? 1 : 0;
}
