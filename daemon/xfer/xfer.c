/*
 * xfer — what the files of xfer share (request keys, the records of
 * requests that ended, small helpers), what remote.c calls
 * (xfer_remote.h), and status; see xfer.h. The requests' types: xfer_int.h.
 *
 * Reading order, file by file:
 *   offer.c   xfer_publish(): a context rank offers its blocks (offer_t, one
 *             per request, one part per rank and block table: most
 *             requests have one table, a hybrid model's more); params.c
 *             packs the params it returns
 *   fetch.c   xfer_fetch(): a generation rank asks for them (genreq_t, one
 *             part per rank and table, each with its plan);
 *             part_try_start(): a part whose source ranks have all
 *             published is bound to their memory (uploaded to a GPU when
 *             a pool is GPU memory) and queued
 *   sched.c   xfer_schedule(): round-robin over queued parts, one chunk of
 *             units per turn, at most max_inflight_chunks in the copy
 *             engine; on_chunk_done(): back on the loop; the last chunk of
 *             the last part completes the genreq, which completes the offer
 *   end.c     genreq_end() / offer_end(): the one way a request ends: mark,
 *             fence (wait for in-flight chunks), then finalize: event,
 *             references dropped, cancel replies sent. An offer with a
 *             consumer is finalized by the consumer's finalize;
 *             offer_consume() keeps a completed offer for late ranks of
 *             replicated heads. Cancel, cleanup and deadlines.
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

/* ---- the requests (opaque outside this file: xfer_remote.h) ----------- */

uint64_t xfer_key_id(const uint8_t *b, size_t len)
{
    uint8_t d[SHA256_DIGEST_LENGTH];
    SHA256(b, len, d);
    uint64_t id = 0;
    for (int i = 0; i < 8; i++)
        id = id << 8 | d[i];
    return id;
}

/* A key for messages; up to four in one call's arguments. */
const char *xfer_ksb(const uint8_t *b, size_t len)
{
    static char buf[4][REQKEY_STR_MAX];
    static unsigned n;
    return reqkey_str(b, len, buf[n++ & 3]);
}

/* Insert in deadline order, searching from the tail: deadlines are
 * mostly increasing, so this is O(1) unless a reload shortened one. */
void dl_insert(list_t *l, dl_node_t *n, uint64_t deadline)
{
    assert(!list_linked(&n->node)); /* one deadline at a time */
    n->deadline_ms = deadline;
    list_t *after = l->prev;
    while (after != l && DL_NODE(after)->deadline_ms > deadline)
        after = after->prev;
    list_push(after->next, &n->node); /* just before after's successor */
}

/* Off its list (a no-op when it is on none). */
void dl_remove(dl_node_t *n)
{
    list_remove(&n->node);
}

/* The records in deadline order, and indexed by gone_index() (fetches
 * look one up at every call: no walk of the list) */
list_t xfer_gones = {&xfer_gones, &xfer_gones};
map_t xfer_gone_map;
map_t xfer_gone_uids; /* uid -> gone_uid_t */

/* Which record (instance, key, side) as one number; two that collide
 * (2^-64) share a slot and the newer replaces the older. */
static uint64_t gone_index(int offer, const char *inst, const uint8_t *key,
                           size_t key_len)
{
    return xfer_source_id(inst, key, key_len) ^ (uint64_t)(offer != 0);
}

void gone_free(gone_t *x)
{
    uint64_t k = gone_index(x->offer, x->inst, x->key.b, x->key.len);
    if (map_get(&xfer_gone_map, k) == x)
        map_del(&xfer_gone_map, k);
    dl_remove(&x->dl);
    list_remove(&x->by_uid);
    gone_uid_t *u = map_get(&xfer_gone_uids, x->uid);
    if (u && !--u->n) {
        map_del(&xfer_gone_uids, x->uid);
        free(u);
    }
    kvxd_mem_release_uid(MEM_REQUESTS, x->uid, x->charged);
    free(x);
}

/* Make room for one more record of uid (of bytes): its oldest go while
 * it holds GONE_MAX or its share would not take the bytes. The uid's
 * list, or NULL (out of memory, or nothing left to give up). */
static gone_uid_t *gone_room(uint32_t uid, size_t bytes)
{
    gone_uid_t *u = map_get(&xfer_gone_uids, uid);
    if (!u) {
        if (!(u = calloc(1, sizeof(*u))) || map_put(&xfer_gone_uids, uid, u)) {
            free(u);
            return NULL;
        }
        list_init(&u->list);
    }
    while (u->n && (u->n >= GONE_MAX ||
                    kvxd_mem_charge_uid(MEM_REQUESTS, uid, bytes))) {
        int last = u->n == 1;
        gone_free(LIST_OWNER(list_first(&u->list), gone_t, by_uid));
        if (last)
            return NULL; /* u went with it */
    }
    if (!u->n && kvxd_mem_charge_uid(MEM_REQUESTS, uid, bytes)) {
        map_del(&xfer_gone_uids, uid);
        free(u);
        return NULL;
    }
    return u;
}

gone_t *gone_find(int offer, const char *inst, uint64_t request_id,
                  const uint8_t *key, size_t key_len)
{
    gone_t *x = map_get(&xfer_gone_map, gone_index(offer, inst, key, key_len));
    if (x && x->offer == offer && x->request_id == request_id &&
        x->key.len == key_len && !memcmp(x->key.b, key, key_len) &&
        !strcmp(x->inst, inst))
        return x;
    return NULL;
}

/* Out of memory: not kept, and a late fetch finds nothing (NOT_FOUND or
 * a request of its own), as before this record existed. */
gone_t *gone_add(int offer, const instance_t *inst, uint64_t request_id,
                 const reqkey_t *key, uint64_t src)
{
    uint32_t nr = offer ? 0 : inst->nranks;
    uint64_t k = gone_index(offer, inst->id, key->b, key->len);
    gone_t *old = map_get(&xfer_gone_map, k);
    if (old) /* the same request ended again (or a collision): newest */
        gone_free(old);
    size_t bytes = sizeof(gone_t) + nr;
    gone_uid_t *u = gone_room(inst->owner_uid, bytes); /* charged */
    gone_t *x = u ? calloc(1, bytes) : NULL;
    if (!x || map_put(&xfer_gone_map, k, x)) {
        free(x);
        if (u) { /* charged, but nothing kept */
            kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid, bytes);
            if (!u->n) {
                map_del(&xfer_gone_uids, inst->owner_uid);
                free(u);
            }
        }
        return NULL;
    }
    x->uid = inst->owner_uid;
    x->charged = bytes;
    list_push(&u->list, &x->by_uid);
    u->n++;
    list_init(&x->dl.node);
    x->offer = offer;
    snprintf(x->inst, sizeof(x->inst), "%s", inst->id);
    x->request_id = request_id;
    x->key = *key;
    x->src = src;
    x->nranks = nr;
    dl_insert(&xfer_gones, &x->dl, kvxd_now_ms() + kvxd.conf.fetch_timeout_ms);
    return x;
}

int xfer_offer_gone(const char *inst, uint64_t request_id, const uint8_t *key,
                    size_t key_len)
{
    const gone_t *x = gone_find(1, inst, request_id, key, key_len);
    return !x ? 0 : x->released ? KVX_ERR_NOT_FOUND : KVX_ERR_CANCELLED;
}

/* Offers that completed, by xfer_source_id() of (instance, key): a set
 * of DONE_SETS sets of DONE_WAYS, each record kept until the fetch
 * timeout or until its set needs room for a newer one (the oldest goes).
 * Fixed memory (DONE_SETS * DONE_WAYS * 16 bytes), nothing charged to a
 * uid: forgetting one only makes a late mark NOT_FOUND, as before. */
#define DONE_SETS 4096
#define DONE_WAYS 4

static struct done_rec {
    uint64_t id; /* 0: empty */
    uint64_t until_ms;
} done_recs[DONE_SETS][DONE_WAYS];

/* The table is 256 KiB of zero pages until written: its first write to
 * each page, a fault, would land on a request's end, between its
 * terminal event and the batch that carries it (60-100 us each on the
 * 2-vCPU VM, measured by kvxfer-bench --layerwise --trace). */
void xfer_init(void)
{
    memset(done_recs, 0, sizeof(done_recs));
}

static uint64_t done_id(const instance_t *inst, const reqkey_t *key)
{
    uint64_t id = xfer_source_id(inst->id, key->b, key->len);
    return id ? id : 1;
}

void done_add(const instance_t *inst, const reqkey_t *key)
{
    uint64_t id = done_id(inst, key), now = kvxd_now_ms();
    struct done_rec *set = done_recs[id % DONE_SETS], *r = &set[0];
    for (int i = 0; i < DONE_WAYS; i++) {
        if (set[i].id == id || set[i].until_ms <= now) {
            r = &set[i];
            break;
        }
        if (set[i].until_ms < r->until_ms)
            r = &set[i];
    }
    r->id = id;
    r->until_ms = now + kvxd.conf.fetch_timeout_ms;
}

static struct done_rec *done_rec_of(const instance_t *inst, const reqkey_t *key)
{
    uint64_t id = done_id(inst, key), now = kvxd_now_ms();
    struct done_rec *set = done_recs[id % DONE_SETS];
    for (int i = 0; i < DONE_WAYS; i++)
        if (set[i].id == id && set[i].until_ms > now)
            return &set[i];
    return NULL;
}

int done_find(const instance_t *inst, const reqkey_t *key)
{
    return done_rec_of(inst, key) != NULL;
}

void done_forget(const instance_t *inst, const reqkey_t *key)
{
    struct done_rec *r = done_rec_of(inst, key);
    if (r)
        *r = (struct done_rec){0, 0};
}

/* Round-robin queue of parts with units left to hand out. */
rrq_t xfer_runq;
/* registered by the layers above (xfer_remote.h, xfer.h) */
xfer_remote_ops_t xfer_rops;
xfer_spread_event_cb xfer_spread_event;
uint32_t xfer_nrequests;
uint32_t xfer_chunks_inflight; /* ours only: pool populate jobs share the
                                    copy engine but not this limit */
/* in deadline order (dl_node_t): offers nobody fetches yet, and genreqs
 * not yet ending */
list_t xfer_leases = {&xfer_leases, &xfer_leases};
list_t xfer_timeouts = {&xfer_timeouts, &xfer_timeouts};

/* ---- small helpers ---------------------------------------------------- */

int xfer_ct_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

void xfer_set_remote_ops(const xfer_remote_ops_t *ops)
{
    xfer_rops = *ops;
}

void xfer_set_spread_event(xfer_spread_event_cb cb)
{
    xfer_spread_event = cb;
}

xfer_offer_made_cb xfer_offer_made;

void xfer_set_offer_made(xfer_offer_made_cb cb)
{
    xfer_offer_made = cb;
}

void xfer_side_from_layout(plan_side_t *s, const instance_t *inst,
                           const kvx_layout_t *l)
{
    *s = inst->side;
    s->kv_factor = l->kv_factor;
    s->head_dim = l->head_dim;
    s->elem_size = l->elem_size;
    s->dtype = l->dtype;
    s->tokens_per_block = l->tokens_per_block;
}

/* The side of another group of a request (xfer_group_t), from a rank's
 * pool: the instance's parallelism, the pool's layers and heads over
 * every PP and TP rank (split evenly), its layout summary. */
void group_side(plan_side_t *s, const instance_t *inst, const kvx_layout_t *l)
{
    xfer_side_from_layout(s, inst, l);
    uint32_t tp = s->attention_dp > 1 ? s->tp / s->attention_dp : s->tp;
    s->total_layers = l->num_layers * s->pp;
    s->num_layers_per_pp = 0;
    s->total_heads = l->num_heads * tp;
}

/* The pool's layout must hold exactly this rank's share of the model
 * (of side: a group's, or the instance's). */
int check_side_layout(const plan_side_t *side, uint32_t rank,
                      const kvx_layout_t *l, const char *what, kvx_why_t *why)
{
    plan_side_t s;
    uint32_t r, f;
    plan_dp_view(side, rank, &s, &r); /* attention DP: per group */
    uint32_t tp = (r / s.cp) % s.tp, pp = r / (s.tp * s.cp);
    uint32_t nl = plan_pp_layers(&s, pp, &f), nh = plan_tp_heads(&s, tp, &f);
    if (l->num_layers != nl)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "%s.pool_id: layout has %u layers, rank %u holds %u",
                        what, l->num_layers, rank, nl);
    if (l->num_heads != nh)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "%s.pool_id: layout has %u heads, rank %u holds %u",
                        what, l->num_heads, rank, nh);
    uint32_t fh;
    plan_tp_heads(&s, tp, &fh);
    if (l->first_head && l->first_head - 1 != fh)
        return why_fail(
            why, KVX_ERR_LAYOUT,
            "%s.pool_id: the pool holds heads from %u, but TP rank %u of %u "
            "holds heads [%u, %u) of %u (kvxfer.h: which KV heads a TP "
            "rank holds)",
            what, l->first_head - 1, tp, s.tp, fh, fh + nh, s.total_heads);
    return 0;
}

int check_rank_layout(const instance_t *inst, uint32_t rank,
                      const kvx_layout_t *l, const char *what, kvx_why_t *why)
{
    return check_side_layout(&inst->side, rank, l, what, why);
}

/* Local ranks of inst in attention-DP group dp (all local ranks without
 * DP): the ranks a fetch must hear from before its request completes. */
uint32_t group_ranks(const instance_t *inst, uint32_t dp)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < inst->nranks; r++) {
        plan_side_t e;
        uint32_t er;
        n += inst->local[r] && plan_dp_view(&inst->side, r, &e, &er) == dp;
    }
    return n;
}

/* Answer every waiter of ws (taken off the request first: the request
 * may be freed), in order; ws ends empty. */
void waiters_reply(list_t *ws)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, ws)
    {
        waiter_t *w = LIST_OWNER(n, waiter_t, node);
        list_remove(n);
        assert(w->cw->pending > 0);
        if (--w->cw->pending == 0) {
            kvxd_reply(w->cw->sid, w->cw->req_id, 0, "");
            free(w->cw);
        }
        free(w);
    }
}

/* cw waits for the request whose waiters ws are: first in ws, so the
 * newest cancel is answered first. */
int waiter_add(list_t *ws, cancel_wait_t *cw)
{
    waiter_t *w = malloc(sizeof(*w));
    if (!w)
        return KVX_ERR_NOMEM;
    w->cw = cw;
    list_push(ws->next, &w->node); /* before the first */
    cw->pending++;
    return 0;
}

/* ranks: the ranks of inst this request covers here; expect: all it
 * needs (they differ for an instance spread over daemons, whose root
 * merges the reports: agree.c). aux: a fetch's COMPLETE only. */
void xfer_push_event(instance_t *inst, uint64_t request_id, const reqkey_t *key,
                     const batch_end_t *e, int offer, uint32_t ranks,
                     uint32_t expect)
{
    if (e->code)
        kvxd_count_error(e->code);
    if (instance_spread(inst) && xfer_spread_event) {
        const xfer_event_t ev = {.request_id = request_id,
                                 .key = key,
                                 .offer = offer,
                                 .kind = e->kind,
                                 .code = e->code,
                                 .msg = e->msg,
                                 .ranks = ranks,
                                 .expect = expect,
                                 .aux = e->aux,
                                 .aux_len = e->aux_len};
        xfer_spread_event(inst, &ev);
        return;
    }
    if (batch_push(&inst->batches, request_id, key, e, kvxd_now_ms()))
        log_error("instance %s: out of memory queueing the event of request "
                  "%s",
                  inst->id, ks(key));
}

/* An aux payload's copy, charged to the memory budget (MEM_AUX): 0, or
 * KVX_ERR_LIMIT / KVX_ERR_NOMEM with why (nothing kept). */
int aux_keep(uint32_t uid, const uint8_t *aux, uint32_t len, uint8_t **out,
             const char *what, kvx_why_t *why)
{
    if (kvxd_mem_charge_uid(MEM_AUX, uid, len)) {
        char w[200];
        kvxd_mem_why(uid, len, w, sizeof(w));
        return why_fail(why, KVX_ERR_LIMIT, "%s: an aux of %u bytes %s", what,
                        len, w);
    }
    if (!(*out = malloc(len))) {
        kvxd_mem_release_uid(MEM_AUX, uid, len);
        return why_fail(why, KVX_ERR_NOMEM, "%s: out of memory", what);
    }
    memcpy(*out, aux, len);
    return 0;
}

void aux_drop(uint32_t uid, uint8_t **aux, uint32_t *len)
{
    if (*aux)
        kvxd_mem_release_uid(MEM_AUX, uid, *len);
    free(*aux);
    *aux = NULL;
    *len = 0;
}

/* Capability tokens: kernel randomness, fetched 4 KiB at a time so a busy
 * daemon does not make one syscall per offer. */
int xfer_random_token(uint8_t out[TOKEN_LEN])
{
    static uint8_t pool[4096];
    static size_t left;
    if (left < TOKEN_LEN) {
        if (getrandom(pool, sizeof(pool), 0) != (ssize_t)sizeof(pool))
            return KVX_ERR_IO;
        left = sizeof(pool);
    }
    left -= TOKEN_LEN;
    memcpy(out, pool + left, TOKEN_LEN);
    memset(pool + left, 0, TOKEN_LEN); /* used once */
    return 0;
}

/* ---- what remote.c calls (xfer_remote.h) ------------------------------ */

offer_t *xfer_offer_find(instance_t *inst, uint64_t request_id)
{
    return map_get(&inst->offers, request_id);
}

instance_t *xfer_offer_instance(const offer_t *o)
{
    return o->inst;
}

uint64_t xfer_offer_request(const offer_t *o)
{
    return o->request_id;
}

const reqkey_t *xfer_offer_key(const offer_t *o)
{
    return &o->key;
}

const uint8_t *xfer_offer_token(const offer_t *o)
{
    return o->token;
}

const plan_side_t *xfer_offer_side(const offer_t *o)
{
    return &o->side;
}

const uint8_t *xfer_offer_aux(const offer_t *o, uint32_t *len)
{
    *len = o->aux_len;
    return o->aux;
}

const uint8_t *xfer_offer_params(const offer_t *o, size_t *len)
{
    *len = o->params_len;
    return o->params;
}

void xfer_offer_served(offer_t *o, uint64_t bytes)
{
    o->served += bytes;
    o->path = "peer";
}

int xfer_offer_ending(const offer_t *o)
{
    return o->ending;
}

int xfer_offer_consumed(const offer_t *o)
{
    return o->consumed;
}

int xfer_offer_taken_here(const offer_t *o)
{
    return o->consumer != NULL;
}

int xfer_offer_plan(const offer_t *o, uint32_t group, const plan_side_t *dst,
                    uint32_t dst_rank, uint32_t skip_tokens, plan_t **out,
                    kvx_why_t *why)
{
    if (group >= o->ngroups)
        return why_fail(why, KVX_ERR_MISMATCH,
                        "request %s has %u block tables, not %u", ks(&o->key),
                        o->ngroups, group + 1);
    uint64_t below =
        (uint64_t)o->gfirst[group] * o->gside[group].tokens_per_block;
    if (skip_tokens < below)
        return why_fail(
            why, KVX_ERR_INVALID,
            "block table %u of request %s keeps no tokens below %llu, and "
            "skip_tokens is %u",
            group, ks(&o->key), (unsigned long long)below, skip_tokens);
    return plan_build(&o->gside[group], dst, dst_rank, o->gtokens[group],
                      skip_tokens, out, why);
}

uint32_t xfer_offer_ngroups(const offer_t *o)
{
    return o->ngroups;
}

const plan_side_t *xfer_offer_group_side(const offer_t *o, uint32_t group)
{
    assert(group < o->ngroups);
    return &o->gside[group];
}

pool_t *xfer_offer_source(const offer_t *o, uint32_t group, uint32_t rank,
                          plan_mem_t *mem)
{
    assert(rank < o->inst->nranks && group < o->ngroups);
    const offer_part_t *sp = OPART(o, group, rank);
    if (!sp->pool)
        return NULL;
    if (mem)
        *mem = pool_mem(sp->pool, sp->blocks, sp->nblocks);
    return sp->pool;
}

uint32_t xfer_offer_ready(const offer_t *o, uint32_t group, uint32_t rank,
                          uint32_t *nlayers)
{
    assert(rank < o->inst->nranks && group < o->ngroups);
    const offer_part_t *sp = OPART(o, group, rank);
    *nlayers = sp->pool ? sp->nlayers : 0;
    return sp->pool ? sp->ready : 0;
}

struct roffer *xfer_offer_remote(const offer_t *o)
{
    return o->remote;
}

void xfer_offer_set_remote(offer_t *o, struct roffer *ro)
{
    assert(ro && !o->remote); /* once; freed with o (offer_free()) */
    o->remote = ro;
}

void xfer_offer_end(offer_t *o, int kind, int code, const char *msg)
{
    if (o->consumed)
        return; /* complete already: a tombstone for late ranks */
    offer_end(o, kind, code, msg);
}

void xfer_offer_fence_hold(offer_t *o)
{
    /* a gather reads the offer's memory: only while it runs, so never
     * after consuming it dropped that memory */
    assert(!o->ending && !o->consumed && !o->consume_fenced);
    o->gathers++;
}

void xfer_offer_fence_release(offer_t *o)
{
    assert(o->gathers > 0); /* the fence */
    o->gathers--;
}

int xfer_offer_fence_done(const offer_t *o)
{
    return (o->ending || o->consume_fenced) && !o->gathers;
}

void xfer_offer_fenced(offer_t *o)
{
    assert(!o->gathers); /* the fence is over */
    if (o->consume_fenced && !o->ending) {
        o->consume_fenced = 0;
        if (o->npublished < o->inst->nlocal)
            offer_consume(o, ""); /* its last gather is back */
        else /* the last rank published meanwhile: nothing to keep */
            offer_end(o, KVX_EVENT_COMPLETE, 0, "");
        return;
    }
    offer_try_finalize(o);
}

/* Remote streams took o: the generation side's fetch timeout, its END or
 * the loss of its daemon bounds it now, not the lease. */
void xfer_offer_taken(offer_t *o)
{
    assert(!o->ending && !o->consumed && !o->consumer);
    /* a backstop only: a daemon that never opens its streams (alive, but
     * its ranks never fetch) must not hold the offer forever */
    o->taken = 1;
    dl_remove(&o->lease);
    dl_insert(&xfer_leases, &o->lease,
              kvxd_now_ms() + o->lease_ms + kvxd.conf.fetch_timeout_ms);
}

int xfer_lease_resolve(const char *op, uint32_t lease_ms, uint32_t *out,
                       kvx_why_t *why)
{
    if (lease_ms > kvxd.conf.offer_lease_max_ms)
        return why_fail(why, KVX_ERR_INVALID,
                        "%s.lease_ms: %u ms is over the daemon's "
                        "deadlines.offer_lease_max_ms (%u ms)",
                        op, lease_ms, kvxd.conf.offer_lease_max_ms);
    *out = lease_ms ? lease_ms : kvxd.conf.offer_lease_ms;
    return 0;
}

int xfer_renew(const char *instance_id, const reqkey_t *key,
               const uint8_t *token, size_t token_len, uint32_t lease_ms,
               kvx_why_t *why)
{
    instance_t *inst = instance_find(instance_id);
    offer_t *o =
        inst ? map_get(&inst->offers, xfer_key_id(key->b, key->len)) : NULL;
    if (o && !reqkey_eq(&o->key, key))
        o = NULL; /* another key's, whose id collides */
    if (!o)
        return why_fail(why, KVX_ERR_NOT_FOUND,
                        "renew: no offer of request %s of instance %s on "
                        "daemon %s (ended, or never made)",
                        ks(key), instance_id, kvxd.address);
    if (token_len != TOKEN_LEN || !xfer_ct_equal(token, o->token, TOKEN_LEN))
        return why_fail(why, KVX_ERR_AUTH,
                        "renew: the params' token is not that of request %s "
                        "of instance %s",
                        ks(&o->key), instance_id);
    if (o->ending || o->consumed || o->consume_fenced)
        return why_fail(why, KVX_ERR_NOT_FOUND,
                        "renew: the offer of request %s of instance %s on "
                        "daemon %s has ended%s%s",
                        ks(&o->key), instance_id, kvxd.address,
                        o->ending ? ": " : "", o->ending ? o->end_msg : "");
    /* fetched here or taken by a peer: the fetch bounds it now */
    if (o->consumer || o->taken || !list_linked(&o->lease.node))
        return 0;
    if (lease_ms > kvxd.conf.offer_lease_max_ms)
        lease_ms = kvxd.conf.offer_lease_max_ms;
    if (lease_ms < o->lease_ms)
        lease_ms = o->lease_ms;
    dl_remove(&o->lease);
    dl_insert(&xfer_leases, &o->lease, kvxd_now_ms() + lease_ms);
    return 0;
}

int xfer_release(const char *instance_id, const reqkey_t *key,
                 const uint8_t *token, size_t token_len, kvx_why_t *why)
{
    instance_t *inst = instance_find(instance_id);
    offer_t *o =
        inst ? map_get(&inst->offers, xfer_key_id(key->b, key->len)) : NULL;
    if (o && !reqkey_eq(&o->key, key))
        o = NULL; /* another key's, whose id collides */
    /* released or complete already (a second release): NOT_FOUND, as
     * once the daemon forgot it; the message says which while it knows */
    const gone_t *x =
        inst ? gone_find(1, inst->id, xfer_key_id(key->b, key->len), key->b,
                         key->len)
             : NULL;
    const char *was = x && x->released ? "was released (kvx_release)"
                      : inst && done_find(inst, key) ? "is complete"
                                                     : NULL;
    if (!o && was)
        return why_fail(why, KVX_ERR_NOT_FOUND,
                        "release: no offer of request %s on daemon %s: "
                        "request %s of instance %s %s already",
                        ks(key), kvxd.address, ks(key), instance_id, was);
    if (!o)
        return why_fail(
            why, KVX_ERR_NOT_FOUND,
            "release: no offer of request %s of instance %s on daemon %s",
            ks(key), instance_id, kvxd.address);
    if (token_len != TOKEN_LEN || !xfer_ct_equal(token, o->token, TOKEN_LEN))
        return why_fail(
            why, KVX_ERR_AUTH,
            "release: the params' token is not that of request %s of "
            "instance %s",
            ks(&o->key), instance_id);
    if (o->consumed || o->consume_fenced)
        return why_fail(why, KVX_ERR_NOT_FOUND,
                        "release: no offer of request %s on daemon %s to "
                        "release: request %s of instance %s %s already",
                        ks(&o->key), kvxd.address, ks(&o->key), instance_id,
                        x && x->released ? "was released (kvx_release)"
                                         : "is complete");
    if (o->ending)
        return why_fail(why, KVX_ERR_STATE,
                        "release: request %s of instance %s is ending",
                        ks(&o->key), instance_id);
    if (o->consumer || o->taken)
        return why_fail(
            why, KVX_ERR_STATE,
            "release: request %s of instance %s is being fetched; cancel "
            "that fetch instead",
            ks(&o->key), instance_id);
    log_debug("offer %s/%s released", instance_id, ks(&o->key));
    gone_t *r = gone_add(1, inst, o->request_id, &o->key, 0);
    if (r) /* a fetch by key after this hears so at once */
        r->released = 1;
    if (o->npublished < inst->nlocal)
        offer_consume(o, "released"); /* late ranks get the params' end */
    else
        offer_end(o, KVX_EVENT_COMPLETE, 0, "released");
    return 0;
}

void xfer_offer_remote_done(offer_t *o, int complete, int code, const char *msg)
{
    if (o->ending || o->consumed || o->consume_fenced)
        return;
    if (!complete)
        offer_end(o, KVX_EVENT_ERROR, code ? code : KVX_ERR_STATE, msg);
    else if (o->npublished < o->inst->nlocal && o->gathers)
        o->consume_fenced = 1; /* consumed by the last gather's return */
    else if (o->npublished < o->inst->nlocal)
        offer_consume(o, "");
    else
        offer_end(o, KVX_EVENT_COMPLETE, 0, "");
}

void xfer_part_describe(const genpart_t *p, xfer_part_desc_t *d)
{
    const genreq_t *g = p->req;
    assert(g->remote && p->fetched);
    d->inst = g->inst;
    d->request_id = g->request_id;
    d->dp_rank = g->dp_rank;
    d->group = p->group;
    d->ngroups = g->ngroups;
    /* every table of this rank: the source counts the streams of all */
    for (uint32_t k = 0; k < g->ngroups; k++) {
        const genpart_t *q = GPART(g, k, p->rank);
        plan_side_t full;
        uint32_t er;
        assert(q->fetched);
        if (k == 0)
            xfer_side_from_layout(&full, g->inst, &q->pool->layout);
        else
            group_side(&full, g->inst, &q->pool->layout);
        plan_dp_view(&full, p->rank, &d->gdst[k], &er);
        d->gskip[k] = g->gskip[k];
    }
    d->dst = d->gdst[p->group];
    d->skip_tokens = g->gskip[p->group];
    {
        plan_side_t e;
        plan_dp_view(&g->inst->side, p->rank, &e, &d->dst_rank);
    }
    d->src_instance = g->src_instance;
    d->src_request = g->src_request;
    d->src_key = &g->src_key;
    d->key = &g->key;
    d->token = g->token;
}

pool_t *xfer_part_pool(const genpart_t *p)
{
    return p->pool;
}

plan_t *xfer_part_plan(const genpart_t *p)
{
    return p->plan;
}

gpu_part_t *xfer_part_gpu(const genpart_t *p)
{
    return p->gpu;
}

int xfer_part_upload(genpart_t *p, int device, kvx_why_t *why)
{
    assert(!p->gpu); /* once; freed with p (genreq_free()) */
    int rc = pool_device_view(p->pool, device, &p->plan->dst.regions, why);
    return rc ? rc : gpu_part_create(p->plan, device, &p->gpu, why);
}

struct rpart *xfer_part_remote(const genpart_t *p)
{
    return p->remote;
}

void xfer_part_set_remote(genpart_t *p, struct rpart *rp)
{
    assert(rp && !p->remote); /* once; freed with p (genreq_free()) */
    p->remote = rp;
}

int xfer_part_end_code(const genpart_t *p)
{
    return p->req->end_code;
}

int xfer_part_set_aux(genpart_t *p, const uint8_t *aux, uint32_t len,
                      kvx_why_t *why)
{
    genreq_t *g = p->req;
    if (!len || g->aux_len)
        return 0; /* the first non-empty one is the request's */
    int rc = aux_keep(g->inst->owner_uid, aux, len, &g->aux,
                      "aux from a source daemon", why);
    if (!rc)
        g->aux_len = len;
    return rc;
}

void xfer_part_fail(genpart_t *p, int code, const char *msg)
{
    genreq_end(p->req, KVX_EVENT_ERROR, code, msg);
}

void xfer_part_fence_hold(genpart_t *p)
{
    /* a scatter writes the part's blocks: only while its request runs */
    assert(p->started && !p->done && !p->req->ending);
    p->inflight++;
    p->req->inflight++;
}

void xfer_fetch_fail(instance_t *inst, uint64_t request_id, int code,
                     const char *msg)
{
    genreq_t *g = map_get(&inst->fetches, request_id);
    if (g && !g->ending)
        genreq_end(g, KVX_EVENT_ERROR, code, msg);
}

/* ---- status ----------------------------------------------------------- */

static const char *offer_state(const offer_t *o)
{
    if (o->consumed)
        return "consumed";
    if (o->ending)
        return "ending";
    uint32_t done;
    if (o->consumer ||
        (xfer_rops.offer_streams && xfer_rops.offer_streams(o, &done) > done))
        return "transferring";
    if (o->reserved && !o->npublished)
        return "reserved";
    return o->npublished < o->inst->nlocal ? "publishing" : "offered";
}

static const char *genreq_state(const genreq_t *g)
{
    if (g->ending)
        return "ending";
    for (size_t r = 0; r < GPARTS(g); r++)
        if (g->parts[r].fetched && !g->parts[r].started)
            return "waiting-source";
    return g->nfetched < g->need ? "fetching" : "transferring";
}

static Kvxfer__Count *count_new(const char *name, uint64_t v)
{
    Kvxfer__Count *c = malloc(sizeof(*c));
    if (!c)
        return NULL;
    kvxfer__count__init(c);
    c->name = strdup(name);
    c->value = v;
    return c;
}

void xfer_free_counts(Kvxfer__Count **c, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (c[i]) {
            free(c[i]->name);
            free(c[i]);
        }
    free(c);
}

size_t xfer_states(Kvxfer__Count ***out)
{
    static const char *const names[] = {
        "publishing", "offered", "transferring", "waiting-source",
        "fetching",   "ending",  "consumed"};
    uint64_t counts[7] = {0};
    for (instance_t *i = instance_first(); i; i = instance_next(i)) {
        uint32_t cnt = i->offers.n + i->fetches.n;
        void **all = calloc(cnt ? cnt : 1, sizeof(void *));
        if (!all)
            continue;
        uint32_t no = map_values(&i->offers, all, cnt);
        uint32_t ng = map_values(&i->fetches, all + no, cnt - no);
        for (uint32_t k = 0; k < no + ng; k++) {
            const char *s = k < no ? offer_state(all[k]) : genreq_state(all[k]);
            for (int j = 0; j < 7; j++)
                if (!strcmp(s, names[j]))
                    counts[j]++;
        }
        free(all);
    }
    Kvxfer__Count **c = calloc(7, sizeof(*c));
    if (!c)
        return 0;
    for (int j = 0; j < 7; j++)
        c[j] = count_new(names[j], counts[j]);
    *out = c;
    return 7;
}

void xfer_free_infos(Kvxfer__RequestInfo **c, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (c[i]) {
            free(c[i]->instance_id);
            free(c[i]->detail);
            free(c[i]);
        }
    free(c);
}

uint64_t xfer_request_id(const void *req, int side)
{
    return side ? ((const genreq_t *)req)->request_id
                : ((const offer_t *)req)->request_id;
}

Kvxfer__RequestInfo *xfer_request_info(const instance_t *i, const void *req,
                                       int side, uint64_t now)
{
    Kvxfer__RequestInfo *r = malloc(sizeof(*r));
    if (!r)
        return NULL;
    kvxfer__request_info__init(r);
    char detail[160];
    if (!side) {
        const offer_t *o = req;
        r->key.data = (uint8_t *)o->key.b; /* packed before o can go */
        r->key.len = o->key.len;
        r->side = "context";
        r->state = (char *)offer_state(o);
        r->age_ms = now - o->created_ms;
        snprintf(detail, sizeof(detail),
                 "%u/%u ranks published, %u tokens, lease left %lld ms",
                 o->npublished, i->nlocal, o->num_tokens,
                 list_linked(&o->lease.node)
                     ? (long long)o->lease.deadline_ms - (long long)now
                     : 0);
    } else {
        const genreq_t *g = req;
        r->key.data = (uint8_t *)g->key.b;
        r->key.len = g->key.len;
        r->side = "generation";
        r->state = (char *)genreq_state(g);
        r->age_ms = now - g->created_ms;
        r->bytes_done = g->bytes_done;
        r->bytes_total = g->bytes_total;
        snprintf(detail, sizeof(detail),
                 "%u/%u ranks fetched, %u done, %u chunks in flight, "
                 "timeout in %lld ms",
                 g->nfetched, g->need, g->ndone, g->inflight,
                 (long long)g->timeout.deadline_ms - (long long)now);
    }
    r->instance_id = strdup(i->id);
    r->detail = strdup(detail);
    if (!r->instance_id || !r->detail) {
        free(r->instance_id);
        free(r->detail);
        free(r);
        return NULL;
    }
    return r;
}
