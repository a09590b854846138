/*
 * xfer — offers, fetches, the chunk scheduler and deadlines; see xfer.h.
 *
 * Reading order:
 *   xfer_publish()   context rank offers its blocks (offer_t, one per
 *                    request, one part per rank and block table: most
 *                    requests have one table, a hybrid model's more)
 *   xfer_fetch()     generation rank asks for them (genreq_t, one part per
 *                    rank and table, each with its plan)
 *   part_try_start() a part whose source ranks have all published is bound
 *                    to their memory (uploaded to a GPU when a pool is
 *                    GPU memory) and queued
 *   schedule()       round-robin over queued parts, one chunk of units per
 *                    turn, at most max_inflight_chunks in the copy engine
 *   on_chunk_done()  back on the loop; the last chunk of the last part
 *                    completes the genreq, which completes the offer
 *   genreq_end() / offer_end()  the one way a request ends: mark, fence
 *                    (wait for in-flight chunks), then finalize: event,
 *                    references dropped, cancel replies sent. An offer
 *                    with a consumer is finalized by the consumer's
 *                    finalize; offer_consume() keeps a completed offer
 *                    for late ranks of replicated heads
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

#include "copy/copy.h"
#include "core/daemon.h"
#include "common/list.h"
#include "core/log.h"
#include "net/peer.h"
#include "core/rrq.h"
#include "xfer.h"
#include "xfer_remote.h"

#define PARAMS_VERSION 2 /* 2: named by keys */
#define PARAMS_MAX 65536

#define WHY(code, ...)                                                      \
    do {                                                                    \
        snprintf(why, why_len, __VA_ARGS__);                                \
        return (code);                                                      \
    } while (0)

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
static const char *ksb(const uint8_t *b, size_t len)
{
    static char buf[4][REQKEY_STR_MAX];
    static unsigned n;
    return reqkey_str(b, len, buf[n++ & 3]);
}
#define ks(k) ksb((k)->b, (k)->len)

/* A request waiting for its deadline: lists kept in deadline order, so
 * the tick only looks at the heads. */
typedef struct dl_node {
    list_t node; /* on its list while the deadline holds */
    uint64_t deadline_ms;
} dl_node_t;

/* A cancel waiting for the fence. One cancel may wait on two requests
 * (an instance with role both that offers and fetches the same id): the
 * reply goes out when the last of them is finalized. */
typedef struct cancel_wait {
    uint64_t sid, req_id;
    unsigned pending;
} cancel_wait_t;

typedef struct waiter {
    cancel_wait_t *cw;
    list_t node; /* on its request's waiters, newest first */
} waiter_t;

typedef struct genreq genreq_t;

/* The hops of a fetch that log.trace_file records (trace_write()): made
 * (the first rank's fetch), first part queued, first copy submitted, the
 * last copy finished (on its thread), the last copy back on the loop,
 * the terminal event queued for the batches. */
enum { TR_FETCH, TR_QUEUED, TR_SUBMIT, TR_COPIED, TR_LANDED, TR_EVENT, TR_N };

static inline uint64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

#define TRACE_HOP(g, h)                                                        \
    do {                                                                       \
        if (kvxd.trace && !(g)->tr[h])                                         \
            (g)->tr[h] = mono_ns();                                            \
    } while (0)

typedef struct offer_part {
    int published;
    pool_t *pool; /* referenced while published, until consumed */
    uint32_t *blocks;
    uint32_t nblocks;
    /* What of the rank's KV is there: everything after a plain publish;
     * after a layer-wise one (Publish.layerwise) what LayersReady named:
     * per layer, the tokens [0, tok_ready[l]) (a chunked prefill makes
     * them ready chunk by chunk, AppendBlocks adding the blocks; blocks
     * holds room for every block of num_tokens, nappended of them
     * given), once the engine's event given with them (GPU pools) is
     * reached: watches holds those still watched (lw_watch_t). ready:
     * the leading layers whose every token is there. */
    int layerwise;
    uint32_t nlayers, ready, nappended;
    uint32_t *tok_ready;
    list_t watches;
    int awaited;  /* held in busy (busy_hold): published, not yet gone */
    uint64_t mem; /* its tables' bytes charged (MEM_REQUESTS) */
} offer_part_t;

/* Layers of a rank's part that are ready once an engine's event is. */
typedef struct lw_watch {
    offer_t *offer;
    uint32_t group, rank, first, count, tokens;
    gpu_watch_t *w;
    list_t node; /* on its part's watches */
} lw_watch_t;

struct offer {
    dl_node_t lease; /* on the lease list while unfetched */
    instance_t *inst;
    uint64_t request_id; /* its key's id: the instance's map key */
    reqkey_t key;
    uint8_t token[TOKEN_LEN];
    uint32_t num_tokens;
    plan_side_t side; /* instance config + layout summary */
    char preset[16];
    uint8_t *params; /* packed ContextParams, same for every rank */
    size_t params_len;
    /* groups: the request's block tables (Publish.groups), the first the
     * plain one (side, num_tokens); per group its side, tokens and first
     * block; parts: one per (group, rank), OPART() */
    uint32_t ngroups;
    plan_side_t gside[XFER_MAX_GROUPS];
    uint32_t gtokens[XFER_MAX_GROUPS], gfirst[XFER_MAX_GROUPS];
    offer_part_t *parts; /* nranks * ngroups */
    uint32_t npublished;
    uint64_t created_ms;
    genreq_t *consumer;
    int ending, end_kind, end_code;
    int reserved; /* made by the scheduler (xfer_reserve) */
    int consumed; /* complete before every rank published: kept,
                     without memory, to answer late publishes */
    char end_msg[256];
    list_t waiters;     /* waiter_t: cancels answered at the end */
    int consume_fenced; /* complete, consumed once gathers are 0 */
    uint8_t *aux;       /* the first non-empty aux published (MEM_AUX) */
    uint32_t aux_len;
    int taken;          /* streams from peer daemons read it */
    uint32_t gathers;   /* gathers in flight: the fence */
    /* peer daemons reading this offer: remote.c's (struct roffer), never
     * read by xfer, freed through xfer_remote_ops_t.offer_free */
    struct roffer *remote;
    uint64_t mem; /* the offer's own bytes charged (MEM_REQUESTS) */
};

struct genpart {
    genreq_t *req;
    uint32_t rank, group;
    int fetched, started, done;
    int settled;  /* done, or its last job out: counted in nsettled */
    pool_t *pool; /* referenced while fetched */
    uint32_t *blocks;
    uint32_t nblocks;
    plan_t *plan;
    uint64_t next_unit, units_done, units_per_chunk;
    /* a layer-wise source: the work goes cell by cell (cnext, sfirst,
     * tok_end: see cell_ready()), and the part waits off the queue
     * (parked) while nothing ready is left to copy */
    uint32_t *cnext, *sfirst, *tok_end, maxl;
    int parked;
    /* per layer of this rank's pool: units landed, units it gets (what
     * FetchProgress reports) */
    uint32_t *ldone, *lneed;
    uint32_t inflight;
    int late;         /* fetched once the request was ending: joins its end */
    gpu_part_t *gpu;  /* plan uploaded to a GPU, when it runs there */
    rrq_entry_t turn; /* on the scheduler's queue (runq) */
    /* pulled from peer daemons: remote.c's (struct rpart), never read by
     * xfer, freed through xfer_remote_ops_t.part_free */
    struct rpart *remote;
};

struct genreq {
    dl_node_t timeout; /* on the fetch-timeout list */
    instance_t *inst;
    uint64_t request_id; /* its key's id: the instance's map key */
    reqkey_t key;
    offer_t *offer; /* NULL once detached */
    uint32_t skip_tokens;
    uint32_t dp_rank; /* attention-DP group receiving */
    uint32_t need;    /* local ranks of that group */
    uint32_t ngroups; /* block tables (the offer's groups) */
    uint32_t gskip[XFER_MAX_GROUPS]; /* each group's skip_tokens */
    genpart_t *parts;                /* nranks * ngroups: GPART() */
    uint32_t nfetched, ndone;
    uint32_t nsettled; /* parts settled (part_settle()) */
    int soon;          /* every part settled: Poll.early answered */
    uint32_t inflight;
    uint64_t created_ms;
    uint64_t bytes_total, bytes_done;
    int ending, end_kind, end_code;
    char end_msg[256];
    list_t waiters;       /* waiter_t: cancels answered at the end */
    int remote;           /* sources reached through peer daemons */
    plan_side_t src_side; /* remote: the offer's side, from the params */
    char src_instance[INSTANCE_ID_MAX + 1];
    uint64_t src_request; /* the offer's key's id */
    uint64_t src_id;      /* xfer_source_id() of the offer */
    reqkey_t src_key;
    uint8_t token[TOKEN_LEN];
    char **src_addresses; /* remote: daemon of each context rank */
    uint32_t src_nranks;
    uint8_t *aux; /* remote: the first non-empty aux a source daemon sent
                     (MEM_AUX); a local offer's is read at the end */
    uint32_t aux_len;
    uint64_t tr[TR_N]; /* log.trace_file: each hop's monotonic ns */
    uint64_t mem;      /* its state's and parts' tables' bytes charged
                          (MEM_REQUESTS; fetch_bytes()) */
};

#define DL_NODE(n) LIST_OWNER(n, dl_node_t, node)

/* The part of rank r in group k of an offer or a fetch; a rank's first
 * group's part (k 0) stands for the rank (published, fetched). */
#define OPART(o, k, r) (&(o)->parts[(size_t)(k) * (o)->inst->nranks + (r)])
#define GPART(g, k, r) (&(g)->parts[(size_t)(k) * (g)->inst->nranks + (r)])
#define OPARTS(o) ((size_t)(o)->ngroups * (o)->inst->nranks)
#define GPARTS(g) ((size_t)(g)->ngroups * (g)->inst->nranks)

/* A request that ended while it may still be asked for, kept until the
 * fetch timeout (gone_add()): a cancelled or released offer, so that a
 * fetch coming after the cancel or release (here, by key, or its OPEN
 * from a peer) hears CANCELLED or NOT_FOUND at once and does not wait
 * for an offer that will not come; and a fetch that ended before every local
 * rank of it fetched, so that a later rank's fetch joins that end instead of
 * making a second request and a second event. */
typedef struct gone {
    dl_node_t dl;   /* on gones, in deadline order */
    list_t by_uid;  /* on its uid's gone_uid_t, oldest first */
    uint32_t uid;   /* the instance's owner: charged to its share */
    size_t charged; /* bytes charged (kvxd_mem_*_uid) */
    int offer;
    int released; /* offer: released, not cancelled */
    char inst[INSTANCE_ID_MAX + 1];
    uint64_t request_id;
    reqkey_t key;
    uint64_t src; /* fetch: what it fetched (xfer_source_id()); a fetch
                     of the key from another offer is a new request */
    uint32_t nranks, need, seen;
    uint8_t ranks[]; /* fetch: which ranks fetched */
} gone_t;

/* Kept at once per uid, within its memory share; past either, that
 * uid's oldest goes first, so that one tenant's churn never drops what
 * is kept for another. */
#define GONE_MAX 65536

typedef struct gone_uid {
    list_t list; /* its gone_t, oldest first */
    uint32_t n;
} gone_uid_t;

/* Insert in deadline order, searching from the tail: deadlines are
 * mostly increasing, so this is O(1) unless a reload shortened one. */
static void dl_insert(list_t *l, dl_node_t *n, uint64_t deadline)
{
    assert(!list_linked(&n->node)); /* one deadline at a time */
    n->deadline_ms = deadline;
    list_t *after = l->prev;
    while (after != l && DL_NODE(after)->deadline_ms > deadline)
        after = after->prev;
    list_push(after->next, &n->node); /* just before after's successor */
}

/* Off its list (a no-op when it is on none). */
static void dl_remove(dl_node_t *n)
{
    list_remove(&n->node);
}

/* The records in deadline order, and indexed by gone_index() (fetches
 * look one up at every call: no walk of the list) */
static list_t gones = {&gones, &gones};
static map_t gone_map;
static map_t gone_uids; /* uid -> gone_uid_t */

/* Which record (instance, key, side) as one number; two that collide
 * (2^-64) share a slot and the newer replaces the older. */
static uint64_t gone_index(int offer, const char *inst, const uint8_t *key,
                           size_t key_len)
{
    return xfer_source_id(inst, key, key_len) ^ (uint64_t)(offer != 0);
}

static void gone_free(gone_t *x)
{
    uint64_t k = gone_index(x->offer, x->inst, x->key.b, x->key.len);
    if (map_get(&gone_map, k) == x)
        map_del(&gone_map, k);
    dl_remove(&x->dl);
    list_remove(&x->by_uid);
    gone_uid_t *u = map_get(&gone_uids, x->uid);
    if (u && !--u->n) {
        map_del(&gone_uids, x->uid);
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
    gone_uid_t *u = map_get(&gone_uids, uid);
    if (!u) {
        if (!(u = calloc(1, sizeof(*u))) || map_put(&gone_uids, uid, u)) {
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
        map_del(&gone_uids, uid);
        free(u);
        return NULL;
    }
    return u;
}

static gone_t *gone_find(int offer, const char *inst, uint64_t request_id,
                         const uint8_t *key, size_t key_len)
{
    gone_t *x = map_get(&gone_map, gone_index(offer, inst, key, key_len));
    if (x && x->offer == offer && x->request_id == request_id &&
        x->key.len == key_len && !memcmp(x->key.b, key, key_len) &&
        !strcmp(x->inst, inst))
        return x;
    return NULL;
}

/* Out of memory: not kept, and a late fetch finds nothing (NOT_FOUND or
 * a request of its own), as before this record existed. */
static gone_t *gone_add(int offer, const instance_t *inst, uint64_t request_id,
                        const reqkey_t *key, uint64_t src)
{
    uint32_t nr = offer ? 0 : inst->nranks;
    uint64_t k = gone_index(offer, inst->id, key->b, key->len);
    gone_t *old = map_get(&gone_map, k);
    if (old) /* the same request ended again (or a collision): newest */
        gone_free(old);
    size_t bytes = sizeof(gone_t) + nr;
    gone_uid_t *u = gone_room(inst->owner_uid, bytes); /* charged */
    gone_t *x = u ? calloc(1, bytes) : NULL;
    if (!x || map_put(&gone_map, k, x)) {
        free(x);
        if (u) { /* charged, but nothing kept */
            kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid, bytes);
            if (!u->n) {
                map_del(&gone_uids, inst->owner_uid);
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
    dl_insert(&gones, &x->dl, kvxd_now_ms() + kvxd.conf.fetch_timeout_ms);
    return x;
}

int xfer_offer_gone(const char *inst, uint64_t request_id, const uint8_t *key,
                    size_t key_len)
{
    const gone_t *x = gone_find(1, inst, request_id, key, key_len);
    return !x ? 0 : x->released ? KVX_ERR_NOT_FOUND : KVX_ERR_CANCELLED;
}

/* Round-robin queue of parts with units left to hand out. */
static rrq_t runq;
/* registered by the layers above (xfer_remote.h, xfer.h) */
static xfer_remote_ops_t R;
static xfer_spread_event_cb spread_event;
static uint32_t nrequests;
static uint32_t chunks_inflight; /* ours only: pool populate jobs share the
                                    copy engine but not this limit */
/* in deadline order (dl_node_t): offers nobody fetches yet, and genreqs
 * not yet ending */
static list_t leases = {&leases, &leases};
static list_t timeouts = {&timeouts, &timeouts};

static void schedule(void);
static void part_settle(genpart_t *p, int last_out);
static void genreq_end(genreq_t *g, int kind, int code, const char *msg);
static void offer_end(offer_t *o, int kind, int code, const char *msg);
static void offer_drop(offer_t *o);

/* ---- small helpers ---------------------------------------------------- */

static int ct_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

void xfer_set_remote_ops(const xfer_remote_ops_t *ops)
{
    R = *ops;
}

void xfer_set_spread_event(xfer_spread_event_cb cb)
{
    spread_event = cb;
}

static xfer_offer_made_cb offer_made;

void xfer_set_offer_made(xfer_offer_made_cb cb)
{
    offer_made = cb;
}

static void side_from_layout(plan_side_t *s, const instance_t *inst,
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
static void group_side(plan_side_t *s, const instance_t *inst,
                       const kvx_layout_t *l)
{
    side_from_layout(s, inst, l);
    uint32_t tp = s->attention_dp > 1 ? s->tp / s->attention_dp : s->tp;
    s->total_layers = l->num_layers * s->pp;
    s->num_layers_per_pp = 0;
    s->total_heads = l->num_heads * tp;
}

/* The pool's layout must hold exactly this rank's share of the model
 * (of side: a group's, or the instance's). */
static int check_side_layout(const plan_side_t *side, uint32_t rank,
                             const kvx_layout_t *l, const char *what, char *why,
                             size_t why_len)
{
    plan_side_t s;
    uint32_t r, f;
    plan_dp_view(side, rank, &s, &r); /* attention DP: per group */
    uint32_t tp = (r / s.cp) % s.tp, pp = r / (s.tp * s.cp);
    uint32_t nl = plan_pp_layers(&s, pp, &f), nh = plan_tp_heads(&s, tp, &f);
    if (l->num_layers != nl)
        WHY(KVX_ERR_LAYOUT,
            "%s.pool_id: layout has %u layers, rank %u holds %u", what,
            l->num_layers, rank, nl);
    if (l->num_heads != nh)
        WHY(KVX_ERR_LAYOUT,
            "%s.pool_id: layout has %u heads, rank %u holds %u", what,
            l->num_heads, rank, nh);
    uint32_t fh;
    plan_tp_heads(&s, tp, &fh);
    if (l->first_head && l->first_head - 1 != fh)
        WHY(KVX_ERR_LAYOUT,
            "%s.pool_id: the pool holds heads from %u, but TP rank %u of %u "
            "holds heads [%u, %u) of %u (kvxfer.h: which KV heads a TP "
            "rank holds)",
            what, l->first_head - 1, tp, s.tp, fh, fh + nh, s.total_heads);
    return 0;
}

static int check_rank_layout(const instance_t *inst, uint32_t rank,
                             const kvx_layout_t *l, const char *what, char *why,
                             size_t why_len)
{
    return check_side_layout(&inst->side, rank, l, what, why, why_len);
}

/* Local ranks of inst in attention-DP group dp (all local ranks without
 * DP): the ranks a fetch must hear from before its request completes. */
static uint32_t group_ranks(const instance_t *inst, uint32_t dp)
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
static void waiters_reply(list_t *ws)
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
static int waiter_add(list_t *ws, cancel_wait_t *cw)
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
static void push_event_aux(instance_t *inst, uint64_t request_id,
                           const reqkey_t *key, int kind, int code,
                           const char *msg, int offer, uint32_t ranks,
                           uint32_t expect, const uint8_t *aux,
                           uint32_t aux_len)
{
    if (code)
        kvxd_count_error(code);
    if (instance_spread(inst) && spread_event) {
        spread_event(inst, request_id, key, offer, kind, code, msg, ranks,
                     expect, aux, aux_len);
        return;
    }
    if (batch_push(&inst->batches, request_id, key, kind, code, msg, aux,
                   aux_len, kvxd_now_ms()))
        log_error("instance %s: out of memory queueing the event of request "
                  "%s",
                  inst->id, ks(key));
}

static void push_event(instance_t *inst, uint64_t request_id,
                       const reqkey_t *key, int kind, int code, const char *msg,
                       int offer, uint32_t ranks, uint32_t expect)
{
    push_event_aux(inst, request_id, key, kind, code, msg, offer, ranks, expect,
                   NULL, 0);
}

/* An aux payload's copy, charged to the memory budget (MEM_AUX): 0, or
 * KVX_ERR_LIMIT / KVX_ERR_NOMEM with why (nothing kept). */
static int aux_keep(uint32_t uid, const uint8_t *aux, uint32_t len,
                    uint8_t **out, const char *what, char *why, size_t why_len)
{
    if (kvxd_mem_charge_uid(MEM_AUX, uid, len)) {
        char w[200];
        kvxd_mem_why(uid, len, w, sizeof(w));
        WHY(KVX_ERR_LIMIT, "%s: an aux of %u bytes %s", what, len, w);
    }
    if (!(*out = malloc(len))) {
        kvxd_mem_release_uid(MEM_AUX, uid, len);
        WHY(KVX_ERR_NOMEM, "%s: out of memory", what);
    }
    memcpy(*out, aux, len);
    return 0;
}

static void aux_drop(uint32_t uid, uint8_t **aux, uint32_t *len)
{
    if (*aux)
        kvxd_mem_release_uid(MEM_AUX, uid, *len);
    free(*aux);
    *aux = NULL;
    *len = 0;
}

/* Capability tokens: kernel randomness, fetched 4 KiB at a time so a busy
 * daemon does not make one syscall per offer. */
static int random_token(uint8_t out[TOKEN_LEN])
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

/* ---- context params --------------------------------------------------- */

void xfer_side_to_msg(const plan_side_t *s, Kvxfer__ParallelConfig *pc,
                      Kvxfer__Layout *lay)
{
    pc->tp = s->tp;
    pc->pp = s->pp;
    pc->cp = s->cp;
    pc->total_layers = s->total_layers;
    pc->total_kv_heads = s->total_heads;
    pc->n_layers_per_pp = s->num_layers_per_pp;
    pc->layers_per_pp = (uint32_t *)s->layers_per_pp;
    lay->kv_factor = s->kv_factor;
    lay->head_dim = s->head_dim;
    lay->elem_size = s->elem_size;
    lay->dtype = s->dtype;
    lay->tokens_per_block = s->tokens_per_block;
}

int xfer_side_from_msg(const Kvxfer__ParallelConfig *pc,
                       const Kvxfer__Layout *l, plan_side_t *s, char *why,
                       size_t why_len)
{
    memset(s, 0, sizeof(*s));
    if (!pc || !l)
        WHY(KVX_ERR_INVALID, "parallel config or layout missing");
    if (pc->n_layers_per_pp > 64)
        WHY(KVX_ERR_INVALID, "layers_per_pp has %zu entries (at most 64)",
            pc->n_layers_per_pp);
    s->tp = pc->tp;
    s->pp = pc->pp;
    s->cp = pc->cp;
    s->total_layers = pc->total_layers;
    s->total_heads = pc->total_kv_heads;
    s->num_layers_per_pp = (uint32_t)pc->n_layers_per_pp;
    for (size_t i = 0; i < pc->n_layers_per_pp; i++)
        s->layers_per_pp[i] = pc->layers_per_pp[i];
    s->kv_factor = l->kv_factor;
    s->head_dim = l->head_dim;
    s->elem_size = l->elem_size;
    s->dtype = l->dtype;
    s->tokens_per_block = l->tokens_per_block;
    int rc = plan_side_check(s, why, why_len);
    return rc ? rc : plan_side_layout_check(s, why, why_len);
}

static int params_build(offer_t *o, const kvx_layout_t *l)
{
    (void)l; /* o->side already holds the layout summary */
    instance_t *inst = o->inst;
    Kvxfer__ContextParams cp = KVXFER__CONTEXT_PARAMS__INIT;
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    Kvxfer__Layout lay = KVXFER__LAYOUT__INIT;
    cp.version = PARAMS_VERSION;
    cp.instance_id = inst->id;
    cp.key.data = o->key.b;
    cp.key.len = o->key.len;
    cp.token.data = o->token;
    cp.token.len = TOKEN_LEN;
    xfer_side_to_msg(&o->side, &pc, &lay);
    lay.preset = o->preset;
    cp.parallel = &pc;
    cp.layout = &lay;
    cp.n_rank_addresses = inst->nranks;
    cp.rank_addresses = inst->addresses;
    cp.num_tokens = o->num_tokens;
    /* the other groups: their layout summaries and sizes */
    Kvxfer__ParamsGroup pg[XFER_MAX_GROUPS], *pgp[XFER_MAX_GROUPS];
    Kvxfer__ParallelConfig gpc[XFER_MAX_GROUPS];
    Kvxfer__Layout glay[XFER_MAX_GROUPS];
    for (uint32_t k = 1; k < o->ngroups; k++) {
        kvxfer__params_group__init(&pg[k]);
        kvxfer__parallel_config__init(&gpc[k]);
        kvxfer__layout__init(&glay[k]);
        xfer_side_to_msg(&o->gside[k], &gpc[k], &glay[k]);
        glay[k].preset = "";
        pg[k].layout = &glay[k];
        pg[k].total_layers = o->gside[k].total_layers;
        pg[k].total_kv_heads = o->gside[k].total_heads;
        pg[k].num_tokens = o->gtokens[k];
        pg[k].first_block = o->gfirst[k];
        pgp[k - 1] = &pg[k];
    }
    cp.n_groups = o->ngroups - 1;
    cp.groups = pgp;
    o->params_len = kvxfer__context_params__get_packed_size(&cp);
    if (!(o->params = malloc(o->params_len)))
        return KVX_ERR_NOMEM;
    kvxfer__context_params__pack(&cp, o->params);
    return 0;
}

int xfer_params_decode(const uint8_t *buf, size_t len,
                       Kvxfer__ContextParams **out, char *why, size_t why_len)
{
    if (len == 0 || len > PARAMS_MAX)
        WHY(KVX_ERR_INVALID,
            "fetch.context_params: %zu bytes (expected 1..%u)", len,
            PARAMS_MAX);
    Kvxfer__ContextParams *p = kvxfer__context_params__unpack(NULL, len, buf);
    if (!p)
        WHY(KVX_ERR_INVALID,
            "fetch.context_params: not a ContextParams message");
    const char *bad = NULL;
    if (p->version != PARAMS_VERSION)
        bad = "version";
    else if (!p->instance_id[0] || strlen(p->instance_id) > INSTANCE_ID_MAX)
        bad = "instance_id";
    else if (p->key.len == 0 || p->key.len > KVX_MAX_KEY)
        bad = "key";
    else if (p->token.len != TOKEN_LEN)
        bad = "token";
    else if (!p->parallel || !p->layout)
        bad = "parallel or layout missing";
    else if (p->n_rank_addresses < 1 || p->n_rank_addresses > KVX_MAX_RANKS)
        bad = "rank_addresses";
    else if (p->num_tokens == 0)
        bad = "num_tokens";
    else if (p->n_groups >= XFER_MAX_GROUPS)
        bad = "groups";
    for (size_t k = 0; !bad && k < p->n_groups; k++)
        if (!p->groups[k]->layout || !p->groups[k]->num_tokens)
            bad = "groups";
    if (bad) {
        kvxfer__context_params__free_unpacked(p, NULL);
        WHY(KVX_ERR_INVALID, "fetch.context_params: invalid %s", bad);
    }
    /* params of an earlier run of this daemon name memory it no longer
     * knows: refused by that cause, before anything looks them up */
    for (size_t i = 0; i < p->n_rank_addresses; i++) {
        char w[400];
        if (peer_address_alias(p->rank_addresses[i], w, sizeof(w)) ==
            KVX_ERR_PEER_GONE) {
            kvxfer__context_params__free_unpacked(p, NULL);
            WHY(KVX_ERR_PEER_GONE,
                "fetch.context_params: rank_addresses[%zu]: %s", i, w);
        }
    }
    *out = p;
    return 0;
}

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

static void busy_hold(int delta)
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
static void part_layers_free(offer_part_t *sp)
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
static int req_charge(const instance_t *inst, uint64_t bytes, const char *what,
                      char *why, size_t why_len)
{
    if (!kvxd_mem_charge_uid(MEM_REQUESTS, inst->owner_uid, bytes))
        return 0;
    char w[200];
    kvxd_mem_why(inst->owner_uid, bytes, w, sizeof(w));
    WHY(KVX_ERR_LIMIT, "%s: its %llu bytes %s", what, (unsigned long long)bytes,
        w);
}

static void part_uncharge(const offer_t *o, offer_part_t *sp)
{
    kvxd_mem_release_uid(MEM_REQUESTS, o->inst->owner_uid, sp->mem);
    sp->mem = 0;
}

static void offer_free(offer_t *o)
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
        assert(R.offer_free);
        R.offer_free(o->remote);
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
} offer_spec_t;

static int offer_create(instance_t *inst, const reqkey_t *key,
                        const offer_spec_t *sp, offer_t **out, char *why,
                        size_t why_len)
{
    const char *op = sp->op;
    const kvx_layout_t *l = sp->l;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    uint32_t num_tokens = sp->num_tokens, ngroups = sp->ngroups;
    if (nrequests >= kvxd.conf.max_requests)
        WHY(KVX_ERR_LIMIT, "%s: %u requests in flight (limits.max_requests)",
            op, nrequests);
    offer_t *o = calloc(1, sizeof(*o));
    if (!o)
        WHY(KVX_ERR_NOMEM, "%s: out of memory", op);
    list_init(&o->lease.node);
    list_init(&o->waiters);
    o->inst = inst;
    o->request_id = request_id;
    o->key = *key;
    o->num_tokens = num_tokens;
    side_from_layout(&o->side, inst, l);
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
    /* an instance spread over daemons: every daemon of it must give the
     * same params, so the token is derived from the cluster secret */
    if (inst->nlocal < inst->nranks && peer_enabled())
        peer_token(inst->id, inst->owner_uid, inst->addresses[0], request_id,
                   o->token);
    else if (random_token(o->token)) {
        free(o);
        WHY(KVX_ERR_IO, "%s: getrandom failed", op);
    }
    if (!(o->parts = calloc(OPARTS(o), sizeof(*o->parts))) ||
        params_build(o, l)) {
        free(o->parts);
        free(o->params);
        free(o);
        WHY(KVX_ERR_NOMEM, "%s: out of memory", op);
    }
    /* what a reservation or an offer holds, charged to its uid */
    uint64_t mem = sizeof(*o) + OPARTS(o) * sizeof(*o->parts) + o->params_len;
    char what[32];
    snprintf(what, sizeof(what), "%s: the request", op);
    int rc = req_charge(inst, mem, what, why, why_len);
    if (rc || map_put(&inst->offers, request_id, o)) {
        if (!rc)
            kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid, mem);
        free(o->parts);
        free(o->params);
        free(o);
        if (rc)
            return rc;
        WHY(KVX_ERR_NOMEM, "%s: out of memory", op);
    }
    o->mem = mem;
    nrequests++;
    dl_insert(&leases, &o->lease, o->created_ms + kvxd.conf.offer_lease_ms);
    *out = o;
    if (offer_made)
        offer_made(inst, key);
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
    const char *t = R.offer_taker ? R.offer_taker(o) : NULL;
    xfer_consumer_name(who, name, sizeof(name));
    return !t || strcmp(t, name);
}

int xfer_params_for(instance_t *inst, const reqkey_t *key,
                    const xfer_consumer_t *who, uint8_t **params, size_t *len,
                    char *why, size_t why_len)
{
    uint64_t id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, id);
    const gone_t *x = gone_find(1, inst->id, id, key->b, key->len);
    if (o && !reqkey_eq(&o->key, key))
        o = NULL; /* another key's, whose id collides */
    if ((!o || o->ending || o->consumed || o->consume_fenced) && x &&
        x->released)
        WHY(KVX_ERR_NOT_FOUND,
            "request %s of instance %s was released (kvx_release)", ks(key),
            inst->id);
    if (!o && x)
        WHY(KVX_ERR_CANCELLED,
            "request %s of instance %s: cancelled by the context side", ks(key),
            inst->id);
    if (!o)
        WHY(XFER_NOT_YET, "no offer of request %s of instance %s", ks(key),
            inst->id);
    if (o->ending || o->consumed || o->consume_fenced)
        WHY(XFER_NOT_YET, "the offer of request %s of instance %s has ended",
            ks(key), inst->id);
    if (taken_by_other(o, who))
        WHY(KVX_ERR_EXISTS,
            "the offer of request %s of instance %s is taken by another "
            "fetch",
            ks(key), inst->id);
    if (!(*params = malloc(o->params_len)))
        WHY(KVX_ERR_NOMEM, "out of memory");
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
                          uint32_t dp_rank, int kind, int code, const char *msg,
                          const uint8_t *seen, uint64_t src)
{
    uint32_t groups = inst->side.attention_dp > 1 ? inst->side.attention_dp : 1;
    uint64_t id = xfer_key_id(key->b, key->len);
    uint32_t need = group_ranks(inst, dp_rank), n = 0;
    push_event(inst, id, key, kind, code, msg, 0, need, inst->nranks / groups);
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
    dl_insert(&timeouts, &g->timeout, until_ms);
}

static void part_try_start(genpart_t *p);
static int part_has_ready(const genpart_t *p);

static int groups_check(const instance_t *inst, uint32_t rank, const offer_t *o,
                        const xfer_group_t *gs, uint32_t n, const char *op,
                        char *why, size_t why_len);

int xfer_reserve(instance_t *inst, const reqkey_t *key, uint32_t num_tokens,
                 const kvx_layout_t *l, const xfer_group_t *groups,
                 uint32_t ngroups, uint8_t **params, size_t *params_len,
                 char *why, size_t why_len)
{
    int rc;
    if (num_tokens == 0)
        WHY(KVX_ERR_INVALID, "reserve.num_tokens: 0");
    if ((rc = groups_check(inst, 0, NULL, groups, ngroups, "reserve", why,
                           why_len)))
        return rc;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    if (o)
        WHY(KVX_ERR_EXISTS,
            "reserve.key: request %s of instance %s is %s already", ks(key),
            inst->id,
            !reqkey_eq(&o->key, key) ? "taken by a key of the same id"
            : o->npublished          ? "published"
                                     : "reserved");
    offer_spec_t sp = {.op = "reserve",
                       .num_tokens = num_tokens,
                       .l = l,
                       .groups = groups,
                       .ngroups = ngroups};
    if ((rc = offer_create(inst, key, &sp, &o, why, why_len)))
        return rc;
    o->reserved = 1;
    if (!(*params = malloc(o->params_len))) {
        offer_end(o, KVX_EVENT_ERROR, KVX_ERR_NOMEM, "reserve: out of memory");
        WHY(KVX_ERR_NOMEM, "reserve: out of memory");
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
                        char *why, size_t why_len)
{
    if (need > kvxd.conf.max_blocks_per_request)
        WHY(KVX_ERR_LIMIT,
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
                        char *why, size_t why_len)
{
    int rc, reserve = !strcmp(op, "reserve");
    const char *other = o && o->reserved && !o->npublished
                            ? "the reservation made"
                            : "another rank published";
    if (n >= XFER_MAX_GROUPS)
        WHY(KVX_ERR_LIMIT, "%s.groups: %u, at most %u", op, n,
            XFER_MAX_GROUPS - 1);
    if (o && o->ngroups != 1 + n)
        WHY(KVX_ERR_MISMATCH, "%s.groups: %u other block tables, but %s %u", op,
            n, other, o->ngroups - 1);
    for (uint32_t k = 0; k < n; k++) {
        const xfer_group_t *x = &gs[k];
        const kvx_layout_t *l = &x->pool->layout;
        char what[48];
        snprintf(what, sizeof(what), "%s.groups[%u]", op, k);
        if (x->num_tokens == 0)
            WHY(KVX_ERR_INVALID, "%s.num_tokens: 0", what);
        uint64_t need = ceil_div(x->num_tokens, l->tokens_per_block);
        if ((rc = blocks_bound(what, x->num_tokens, need, why, why_len)))
            return rc;
        if (x->first_block >= need)
            WHY(KVX_ERR_INVALID,
                "%s.first_block: %u, but its %u tokens lie in %llu blocks",
                what, x->first_block, x->num_tokens, (unsigned long long)need);
        if (!reserve && x->nblocks < need - x->first_block)
            WHY(KVX_ERR_INVALID,
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
        if ((rc = plan_side_check(&gs1, why, why_len)) ||
            (!reserve &&
             (rc = check_side_layout(&gs1, rank, l, what, why, why_len))))
            return rc;
        if (o && (o->gtokens[k + 1] != x->num_tokens ||
                  o->gfirst[k + 1] != x->first_block))
            WHY(KVX_ERR_MISMATCH,
                "%s: num_tokens %u, first_block %u differ from %u, %u that "
                "%s",
                what, x->num_tokens, x->first_block, o->gtokens[k + 1],
                o->gfirst[k + 1], other);
        if (o &&
            (l->tokens_per_block != gs1.tokens_per_block ||
             l->head_dim != gs1.head_dim || l->dtype != gs1.dtype ||
             l->kv_factor != gs1.kv_factor || l->elem_size != gs1.elem_size))
            WHY(KVX_ERR_MISMATCH,
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

int xfer_publish(instance_t *inst, uint32_t rank, const reqkey_t *key,
                 pool_t *pool, const uint32_t *blocks, uint32_t nblocks,
                 uint32_t num_tokens, const xfer_group_t *groups,
                 uint32_t ngroups, const uint8_t *aux, uint32_t aux_len,
                 int layerwise, uint8_t **params, size_t *params_len, char *why,
                 size_t why_len)
{
    int rc;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    const kvx_layout_t *l = &pool->layout;
    if ((rc = check_rank_layout(inst, rank, l, "publish", why, why_len)))
        return rc;
    if (num_tokens == 0)
        WHY(KVX_ERR_INVALID, "publish.num_tokens: 0");
    uint64_t need = ceil_div(num_tokens, l->tokens_per_block);
    if (nblocks < need && !layerwise)
        WHY(KVX_ERR_INVALID,
            "publish.blocks: %u blocks of %u tokens cannot hold num_tokens "
            "%u (need %llu)",
            nblocks, l->tokens_per_block, num_tokens,
            (unsigned long long)need);
    /* a layer-wise table has room for every block of num_tokens */
    if ((rc = blocks_bound("publish", num_tokens, need, why, why_len)))
        return rc;

    offer_t *o = map_get(&inst->offers, request_id);
    if (o && !reqkey_eq(&o->key, key))
        WHY(KVX_ERR_EXISTS,
            "publish.key: %s has the id of request %s in flight (a "
            "64-bit collision; use another key)",
            ks(key), ks(&o->key));
    if ((rc = groups_check(inst, rank, o, groups, ngroups, "publish", why,
                           why_len)))
        return rc;
    int created = !o;
    if (!o) {
        offer_spec_t sp = {.op = "publish",
                           .num_tokens = num_tokens,
                           .l = l,
                           .groups = groups,
                           .ngroups = ngroups};
        if ((rc = offer_create(inst, key, &sp, &o, why, why_len)))
            return rc;
    } else {
        if (o->ending)
            WHY(KVX_ERR_STATE, "publish: request %s is ending (%s)", ks(key),
                o->end_msg);
        if (o->parts[rank].published)
            WHY(KVX_ERR_EXISTS,
                "publish: request %s already published by rank %u", ks(key),
                rank);
        if (o->num_tokens != num_tokens)
            WHY(KVX_ERR_MISMATCH,
                "publish.num_tokens: %u differs from %u published by another "
                "rank",
                num_tokens, o->num_tokens);
        if (l->tokens_per_block != o->side.tokens_per_block ||
            l->head_dim != o->side.head_dim ||
            l->dtype != o->side.dtype || l->kv_factor != o->side.kv_factor ||
            l->elem_size != o->side.elem_size ||
            strcmp(l->preset, o->preset))
            WHY(KVX_ERR_MISMATCH,
                "publish.pool_id: layout (preset, tokens_per_block, head_dim, "
                "dtype, elem_size or kv_factor) differs from another rank's");
    }
    /* the first non-empty aux is the request's; another rank's must be
     * the same bytes (or none) */
    if (aux_len && o->aux_len &&
        (aux_len != o->aux_len || memcmp(aux, o->aux, aux_len)))
        WHY(KVX_ERR_MISMATCH,
            "publish.aux: %u bytes differ from the %u bytes of aux another "
            "rank published for request %s",
            aux_len, o->aux_len, ks(key));
    if (aux_len && !o->aux_len &&
        (rc = aux_keep(inst->owner_uid, aux, aux_len, &o->aux, "publish.aux",
                       why, why_len))) {
        if (created) { /* nothing kept: the offer goes as it came */
            nrequests--;
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
            WHY(KVX_ERR_NOMEM, "publish: out of memory");
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
    if ((rc = req_charge(inst, tmem, "publish.blocks: the block tables", why,
                         why_len))) {
        if (created) { /* nothing kept: the offer goes as it came */
            nrequests--;
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
        WHY(KVX_ERR_NOMEM, "publish: out of memory");
    /* room for every block (a chunked prefill appends the rest; those
     * not given yet are never read: no token of theirs is ready) */
    if (!(part->blocks = calloc(need, sizeof(uint32_t)))) {
        part_layers_free(part);
        WHY(KVX_ERR_NOMEM, "publish: out of memory");
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
                nrequests--;
                offer_drop(o);
            }
            WHY(KVX_ERR_NOMEM, "publish: out of memory");
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
        WHY(KVX_ERR_NOMEM, "publish: out of memory");
    memcpy(*params, o->params, o->params_len);
    *params_len = o->params_len;
    if (R.offer_published)
        R.offer_published(o);
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
    schedule();
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
            rrq_push(&runq, &p->turn);
        }
    }
    schedule();
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
    consumer_wake(o);
    /* peer daemons read a rank's part layer by layer, each once whole */
    if (more && (o = map_get(&inst->offers, id)) && R.offer_published)
        R.offer_published(o);
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

int xfer_layers_ready(instance_t *inst, uint32_t rank, const reqkey_t *key,
                      uint32_t group, uint32_t first, uint32_t count,
                      uint32_t tokens, const uint8_t *ev, size_t ev_len,
                      uint64_t owner, char *why, size_t why_len)
{
    int rc;
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    if (!o || !reqkey_eq(&o->key, key)) {
        const gone_t *x = gone_find(1, inst->id, request_id, key->b, key->len);
        if (x)
            WHY(x->released ? KVX_ERR_NOT_FOUND : KVX_ERR_CANCELLED,
                "layers_ready: request %s was %s", ks(key),
                x->released ? "released" : "cancelled");
        WHY(KVX_ERR_NOT_FOUND,
            "layers_ready: no offer of request %s in instance %s (never "
            "published, or ended: its event says how)",
            ks(key), inst->id);
    }
    if (o->ending)
        WHY(KVX_ERR_STATE, "layers_ready: request %s is ending (%s)", ks(key),
            o->end_msg);
    if (group >= o->ngroups)
        WHY(KVX_ERR_INVALID,
            "layers_ready.group: %u, but request %s has %u block table%s",
            group, ks(key), o->ngroups, o->ngroups == 1 ? "" : "s");
    offer_part_t *sp = OPART(o, group, rank);
    if (!OPART(o, 0, rank)->published)
        WHY(KVX_ERR_STATE, "layers_ready: rank %u has not published request %s",
            rank, ks(key));
    if (o->consumed)
        return 0; /* its consumer needed other ranks only, and is done */
    if (!sp->layerwise)
        WHY(KVX_ERR_STATE,
            "layers_ready: request %s was published whole (publish with "
            "layerwise to offer layers before their KV exists)",
            ks(key));
    if (count == 0 || first >= sp->nlayers || count > sp->nlayers - first)
        WHY(KVX_ERR_INVALID,
            "layers_ready: layers [%u, %llu) are not inside this rank's %u "
            "layers",
            first, (unsigned long long)first + count, sp->nlayers);
    uint32_t ntok = o->gtokens[group];
    if (tokens == 0)
        tokens = ntok;
    if (tokens > ntok)
        WHY(KVX_ERR_INVALID,
            "layers_ready.tokens: %u, more than the request's %u", tokens,
            ntok);
    uint32_t tpb = o->gside[group].tokens_per_block;
    if (ceil_div(tokens, tpb) > sp->nappended)
        WHY(KVX_ERR_INVALID,
            "layers_ready.tokens: %u tokens lie in %llu blocks; %u appended "
            "(append_blocks first)",
            tokens, (unsigned long long)ceil_div(tokens, tpb), sp->nappended);
    if (!ev_len) {
        layers_mark(o, group, rank, first, count, tokens);
        return 0;
    }
    if (ev_len != 64)
        WHY(KVX_ERR_INVALID,
            "layers_ready.cuda_event: %zu bytes (a cudaIpcEventHandle_t "
            "has 64)",
            ev_len);
    if (!sp->pool->gpu)
        WHY(KVX_ERR_INVALID,
            "layers_ready.cuda_event: pool %u is host memory (host pools "
            "say layers_ready once the KV is written, without an event)",
            sp->pool->id);
    gpu_event_t *e;
    if ((rc = gpu_event_import(ev, sp->pool->device, owner, &e, why, why_len)))
        return rc;
    lw_watch_t *x = calloc(1, sizeof(*x));
    if (x && !(x->w = gpu_event_watch(e, layers_reached, x))) {
        free(x);
        x = NULL;
    }
    gpu_event_unref(e); /* the watch holds its own reference */
    if (!x)
        WHY(KVX_ERR_NOMEM, "layers_ready: out of memory");
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
                       uint32_t nblocks, char *why, size_t why_len)
{
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    if (!o || !reqkey_eq(&o->key, key)) {
        const gone_t *x = gone_find(1, inst->id, request_id, key->b, key->len);
        if (x)
            WHY(x->released ? KVX_ERR_NOT_FOUND : KVX_ERR_CANCELLED,
                "append_blocks: request %s was %s", ks(key),
                x->released ? "released" : "cancelled");
        WHY(KVX_ERR_NOT_FOUND,
            "append_blocks: no offer of request %s in instance %s (never "
            "published, or ended: its event says how)",
            ks(key), inst->id);
    }
    if (o->ending)
        WHY(KVX_ERR_STATE, "append_blocks: request %s is ending (%s)", ks(key),
            o->end_msg);
    offer_part_t *sp = &o->parts[rank];
    if (!sp->published)
        WHY(KVX_ERR_STATE,
            "append_blocks: rank %u has not published request %s", rank,
            ks(key));
    if (o->consumed)
        return 0;
    if (!sp->layerwise)
        WHY(KVX_ERR_STATE,
            "append_blocks: request %s was published whole (publish with "
            "layerwise to add blocks as chunks finish)",
            ks(key));
    if (pool != sp->pool)
        WHY(KVX_ERR_INVALID,
            "append_blocks.pool_id: pool %u, but request %s was published "
            "from pool %u",
            pool->id, ks(key), sp->pool->id);
    if (nblocks > sp->nblocks - sp->nappended)
        WHY(KVX_ERR_INVALID,
            "append_blocks.blocks: %u more, but request %s holds %u blocks "
            "(num_tokens %u) and %u are given",
            nblocks, ks(key), sp->nblocks, o->num_tokens, sp->nappended);
    /* written past the blocks given (never read until nappended covers
     * them), then checked as one table: O(n log n), not given x new */
    uint32_t first = sp->nappended;
    memcpy(sp->blocks + first, blocks, nblocks * sizeof(uint32_t));
    size_t dup;
    if (xfer_blocks_repeat(sp->blocks, first + nblocks, &dup))
        WHY(KVX_ERR_NOMEM, "append_blocks: out of memory");
    if (dup < first + nblocks)
        WHY(KVX_ERR_INVALID,
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
                        char *why, size_t why_len)
{
    uint64_t request_id = xfer_key_id(key->b, key->len);
    genreq_t *g = map_get(&inst->fetches, request_id);
    if (!g || !reqkey_eq(&g->key, key))
        WHY(KVX_ERR_NOT_FOUND,
            "fetch_progress: no fetch of request %s in instance %s (never "
            "fetched, or ended: its event says how)",
            ks(key), inst->id);
    if (!GPART(g, 0, rank)->fetched)
        WHY(KVX_ERR_STATE, "fetch_progress: rank %u has not fetched request %s",
            rank, ks(key));
    if (group >= g->ngroups)
        WHY(KVX_ERR_INVALID,
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

/* ---- fetch ------------------------------------------------------------ */

static void genreq_free(genreq_t *g)
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
            assert(R.part_free);
            R.part_free(p->remote);
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
static int part_has_ready(const genpart_t *p)
{
    const plan_t *pl = p->plan;
    for (uint32_t i = 0; i < pl->nslices; i++)
        for (uint32_t a = p->sfirst[i]; a < pl->slices[i].nlayers; a++)
            if (p->cnext[i * p->maxl + a] < cell_ready(p, i, a))
                return 1;
    return 0;
}

/* Has a streaming part units not handed out yet (ready or not)? */
static int part_has_left(const genpart_t *p)
{
    for (uint32_t i = 0; i < p->plan->nslices; i++)
        if (p->sfirst[i] < p->plan->slices[i].nlayers)
            return 1;
    return 0;
}

/* The next job of a streaming part: the ready segments of the cell of
 * the lowest layer that has some (the decode needs layer 0 first), up to
 * units_per_chunk. 0 when nothing is ready. */
static int part_next_job(genpart_t *p, uint64_t *u0, uint64_t *u1)
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
static void part_landed(genpart_t *p, uint64_t u0, uint64_t u1)
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
static void part_try_start(genpart_t *p)
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
    int rc = plan_check_bounds(plan, why, sizeof(why));
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
        rc = pool_pin(p->pool, why, sizeof(why));
        for (uint32_t i = 0; i < plan->nslices && !rc; i++)
            rc = pool_pin(OPART(o, p->group, plan->slices[i].src_rank)->pool,
                          why, sizeof(why));
        /* the kernel runs on `device`: every region as that device sees
         * it */
        if (!rc)
            rc = pool_device_view(p->pool, device, &plan->dst.regions, why,
                                  sizeof(why));
        for (uint32_t i = 0; i < plan->nslices && !rc; i++)
            rc = pool_device_view(
                OPART(o, p->group, plan->slices[i].src_rank)->pool, device,
                &plan->src[i].regions, why, sizeof(why));
        if (!rc)
            rc = gpu_part_create(plan, device, &p->gpu, why, sizeof(why));
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
    uint64_t chunk = p->gpu ? kvxd.conf.gpu_chunk_bytes
                            : kvxd.conf.copy_chunk_bytes;
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
    rrq_push(&runq, &p->turn);
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
    busy_hold(1);
    TRACE_HOP(g, TR_FETCH);
    dl_insert(&timeouts, &g->timeout,
              g->created_ms + kvxd.conf.fetch_timeout_ms);
    for (size_t r = 0; r < GPARTS(g); r++) {
        g->parts[r].req = g;
        g->parts[r].rank = (uint32_t)(r % inst->nranks);
        g->parts[r].group = (uint32_t)(r / inst->nranks);
    }
    nrequests++;
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
                            char *why, size_t why_len)
{
    char w[200];
    int rc = xfer_side_from_msg(cp->parallel, cp->layout, s, w, sizeof(w));
    if (rc)
        WHY(rc, "fetch.context_params: %s", w);
    if (plan_side_ranks(s) != cp->n_rank_addresses)
        WHY(KVX_ERR_INVALID,
            "fetch.context_params: %zu rank addresses for %u ranks",
            cp->n_rank_addresses, plan_side_ranks(s));
    return rc;
}

static int group_plan(const plan_side_t *src, uint32_t src_tokens,
                      uint32_t src_first, const instance_t *inst, uint32_t rank,
                      uint32_t k, const xfer_group_t *x, plan_t **out,
                      uint32_t **bt_out, char *why, size_t why_len);

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
                                  plan_side_t *s, char *why, size_t why_len)
{
    const Kvxfer__ParamsGroup *pg = cp->groups[k - 1];
    char w[200];
    Kvxfer__ParallelConfig pc = *cp->parallel;
    pc.total_layers = pg->total_layers;
    pc.total_kv_heads = pg->total_kv_heads;
    pc.n_layers_per_pp = 0; /* a group's layers split evenly */
    int rc = xfer_side_from_msg(&pc, pg->layout, s, w, sizeof(w));
    if (rc)
        WHY(rc, "fetch.context_params: groups[%u]: %s", k - 1, w);
    return 0;
}

static int fetch_remote(instance_t *inst, uint32_t rank, uint64_t request_id,
                        const reqkey_t *key, const Kvxfer__ContextParams *cp,
                        pool_t *pool, const uint32_t *blocks, uint32_t nblocks,
                        uint32_t skip, uint32_t dp_rank, const xfer_group_t *gs,
                        uint32_t ngs, char *why, size_t why_len)
{
    int rc;
    uint64_t src_id = xfer_key_id(cp->key.data, cp->key.len);
    if (!peer_enabled()) {
        for (size_t i = 0; i < cp->n_rank_addresses; i++)
            if (strcmp(cp->rank_addresses[i], kvxd.address))
                WHY(KVX_ERR_UNSUPPORTED,
                    "fetch.context_params: context rank %zu is served by "
                    "daemon '%s', and transfers between daemons are off "
                    "here (peer.listen is empty)",
                    i, cp->rank_addresses[i]);
        WHY(KVX_ERR_UNSUPPORTED,
            "fetch: instance %s spans daemons, and transfers between "
            "daemons are off here (peer.listen is empty)",
            inst->id);
    }
    for (size_t i = 0; i < cp->n_rank_addresses; i++)
        if ((rc = peer_address_check(cp->rank_addresses[i], why, why_len)))
            return rc;
    plan_side_t src, dst, full;
    uint32_t eff_rank;
    if ((rc = side_from_params(cp, &src, why, why_len)))
        return rc;
    side_from_layout(&full, inst, &pool->layout);
    plan_dp_view(&full, rank, &dst, &eff_rank);
    if ((rc = plan_compat(&src, &dst, why, why_len)))
        return rc;

    genreq_t *g = map_get(&inst->fetches, request_id);
    if (g && !reqkey_eq(&g->key, key))
        WHY(KVX_ERR_EXISTS,
            "fetch.key: %s has the id of request %s in flight (a 64-bit "
            "collision; use another key)",
            ks(key), ks(&g->key));
    if (g) {
        if (g->ending)
            WHY(KVX_ERR_STATE, "fetch: request %s is ending (%s)", ks(key),
                g->end_msg);
        if (!g->remote || strcmp(g->src_instance, cp->instance_id) ||
            g->src_request != src_id ||
            memcmp(g->token, cp->token.data, TOKEN_LEN))
            WHY(KVX_ERR_MISMATCH,
                "fetch.context_params: request %s is being fetched from "
                "another offer by another rank",
                ks(key));
        if (g->parts[rank].fetched)
            WHY(KVX_ERR_EXISTS,
                "fetch: request %s already fetched by "
                "rank %u",
                ks(key), rank);
        if (g->dp_rank != dp_rank)
            WHY(KVX_ERR_MISMATCH,
                "fetch.dp_rank: %u differs from %u given by another rank",
                dp_rank, g->dp_rank);
        if (g->ngroups != 1 + ngs)
            WHY(KVX_ERR_MISMATCH,
                "fetch.groups: %u other block tables, but another rank's "
                "fetch of request %s gave %u",
                ngs, ks(key), g->ngroups - 1);
        if (g->skip_tokens != skip)
            WHY(KVX_ERR_MISMATCH,
                "fetch.skip_tokens: %u differs from %u given by another "
                "rank",
                skip, g->skip_tokens);
        for (uint32_t k = 0; k < ngs; k++)
            if (g->gskip[k + 1] != gs[k].skip_tokens)
                WHY(KVX_ERR_MISMATCH,
                    "fetch.groups[%u].skip_tokens: %u differs from %u given "
                    "by another rank",
                    k, gs[k].skip_tokens, g->gskip[k + 1]);
    } else if (nrequests >= kvxd.conf.max_requests) {
        WHY(KVX_ERR_LIMIT, "fetch: %u requests in flight (limits."
                           "max_requests)",
            nrequests);
    }
    /* before planning: forged params could ask for billions of tokens
     * (the plan's segments); the blocks given bound what can land */
    if ((uint64_t)nblocks * dst.tokens_per_block < cp->num_tokens)
        WHY(KVX_ERR_INVALID,
            "fetch.blocks: %u blocks of %u tokens cannot hold the offer's "
            "%u tokens",
            nblocks, dst.tokens_per_block, cp->num_tokens);
    plan_t *plan;
    if ((rc = plan_build(&src, &dst, eff_rank, cp->num_tokens, skip, &plan,
                         why, why_len)))
        return rc;
    if ((rc = plan_own(plan, inst->owner_uid, why, why_len))) {
        plan_free(plan);
        return rc;
    }
    if (nblocks < plan->dst_blocks_needed) {
        plan_free(plan);
        WHY(KVX_ERR_INVALID,
            "fetch.blocks: %u blocks of %u tokens cannot hold the offer's "
            "%u tokens (need %u)",
            nblocks, dst.tokens_per_block, cp->num_tokens,
            plan->dst_blocks_needed);
    }
    uint32_t *bt = malloc(plan->dst_blocks_needed * sizeof(uint32_t) + 1);
    if (!bt) {
        plan_free(plan);
        WHY(KVX_ERR_NOMEM, "fetch: out of memory");
    }
    memcpy(bt, blocks, plan->dst_blocks_needed * sizeof(uint32_t));
    /* the other tables' plans, from the params' sides */
    plan_t *gplan[XFER_MAX_GROUPS] = {NULL};
    uint32_t *gbt[XFER_MAX_GROUPS] = {NULL};
    for (uint32_t k = 0; k < ngs && !rc; k++) {
        plan_side_t gsrc;
        const Kvxfer__ParamsGroup *pg = cp->groups[k];
        if (!(rc = side_from_params_group(cp, k + 1, &gsrc, why, why_len)))
            rc = group_plan(&gsrc, pg->num_tokens, pg->first_block, inst, rank,
                            k + 1, &gs[k], &gplan[k], &gbt[k], why, why_len);
    }
    /* the tables (and a new request's state), charged to its uid */
    uint64_t mem = rc ? 0 : fetch_bytes(inst, g, plan, pool, gplan, gs, ngs);
    if (!rc)
        rc = req_charge(inst, mem, "fetch: the request", why, why_len);
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
            WHY(KVX_ERR_NOMEM, "fetch: out of memory");
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
              ksb(cp->key.data, cp->key.len), plan->nslices,
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
        if ((rc = R.part_start ? R.part_start(p, cp, w, sizeof(w))
                               : KVX_ERR_UNSUPPORTED) &&
            (g = map_get(&inst->fetches, request_id)))
            genreq_end(g, KVX_EVENT_ERROR, rc, w); /* reported as an event */
    }
    return 0;
}

static int fetch_one(instance_t *inst, uint32_t rank, uint64_t request_id,
                     const reqkey_t *key, const uint8_t *pbuf, size_t plen,
                     pool_t *pool, const uint32_t *blocks, uint32_t nblocks,
                     uint32_t skip, uint32_t dp_rank, const xfer_group_t *gs,
                     uint32_t ngs, int *as_event, char *why, size_t why_len);

/* A rank's fetch of a request that ended already (another rank's fetch
 * failed, it was cancelled, it timed out): its event is in the batches,
 * so this fetch joins that end, with no second event. 1 when it did. */
static int fetch_join_end(instance_t *inst, uint32_t rank, uint64_t id,
                          const reqkey_t *key, uint64_t src, int *rc, char *why,
                          size_t why_len)
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
        snprintf(why, why_len, "fetch: request %s already fetched by rank %u",
                 ks(key), rank);
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
                     uint64_t src, int *rc, char *why, size_t why_len)
{
    return rank < inst->nranks &&
           fetch_join_end(inst, rank, xfer_key_id(key->b, key->len), key, src,
                          rc, why, why_len);
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
    if (xfer_params_decode(pbuf, plen, &cp, w, sizeof(w)))
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
int xfer_fetch(instance_t *inst, uint32_t rank, const reqkey_t *key,
               const uint8_t *pbuf, size_t plen, pool_t *pool,
               const uint32_t *blocks, uint32_t nblocks, uint32_t skip,
               uint32_t dp_rank, const xfer_group_t *gs, uint32_t ngs,
               char *why, size_t why_len)
{
    uint64_t request_id = xfer_key_id(key->b, key->len);
    int rc, as_event = 0;
    uint64_t src = gone_find(0, inst->id, request_id, key->b, key->len)
                       ? params_source(pbuf, plen)
                       : 0; /* decoded again only for a request that ended */
    if (rank < inst->nranks &&
        fetch_join_end(inst, rank, request_id, key, src, &rc, why, why_len))
        return rc;
    rc = fetch_one(inst, rank, request_id, key, pbuf, plen, pool, blocks,
                   nblocks, skip, dp_rank, gs, ngs, &as_event, why, why_len);
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
        xfer_fetch_end_early(inst, key, dp_rank, KVX_EVENT_ERROR, rc, why, seen,
                             params_source(pbuf, plen));
        free(seen);
        return 0;
    }
    if (g && !g->ending && (as_event || g->nfetched > 0) &&
        rank < inst->nranks && !g->parts[rank].fetched) {
        char m[600];
        if (as_event)
            snprintf(m, sizeof(m), "%s", why);
        else
            snprintf(m, sizeof(m), "rank %u's fetch was refused: %s", rank,
                     why);
        g->parts[rank].late = 1;
        genreq_end(g, KVX_EVENT_ERROR, rc, m);
    }
    return as_event ? 0 : rc;
}

static int fetch_one(instance_t *inst, uint32_t rank, uint64_t request_id,
                     const reqkey_t *key, const uint8_t *pbuf, size_t plen,
                     pool_t *pool, const uint32_t *blocks, uint32_t nblocks,
                     uint32_t skip, uint32_t dp_rank, const xfer_group_t *gs,
                     uint32_t ngs, int *as_event, char *why, size_t why_len)
{
    int rc;
    Kvxfer__ContextParams *cp;
    /* attention DP: only the named group receives; the plan sees the
     * group as a plain instance of tp/attention_dp ranks */
    plan_side_t dst;
    uint32_t eff_rank;
    uint32_t group = plan_dp_view(&inst->side, rank, &dst, &eff_rank);
    uint32_t ngroups = inst->side.attention_dp > 1 ? inst->side.attention_dp
                                                   : 1;
    if (dp_rank >= ngroups)
        WHY(KVX_ERR_INVALID,
            "fetch.dp_rank: %u, but instance %s has %u attention-DP "
            "group%s",
            dp_rank, inst->id, ngroups, ngroups == 1 ? "" : "s");
    if (group != dp_rank)
        WHY(KVX_ERR_INVALID,
            "fetch.dp_rank: rank %u is in attention-DP group %u, not %u",
            rank, group, dp_rank);
    if ((rc = check_rank_layout(inst, rank, &pool->layout, "fetch", why,
                                why_len)))
        return rc;
    if ((rc = xfer_params_decode(pbuf, plen, &cp, why, why_len)))
        return rc;
    /* Everything the plan needs comes from the offer, found by id and
     * proven by the token; the rest of the params is only a locator. */
    offer_t *o = NULL;
    instance_t *ci = NULL;
    int remote = inst->nlocal < inst->nranks;
    for (size_t i = 0; i < cp->n_rank_addresses; i++)
        remote |= strcmp(cp->rank_addresses[i], kvxd.address) != 0;
    if (ngs >= XFER_MAX_GROUPS) {
        snprintf(why, why_len, "fetch.groups: %u, at most %u", ngs,
                 XFER_MAX_GROUPS - 1);
        rc = KVX_ERR_LIMIT;
        goto out;
    }
    if (cp->n_groups != ngs) {
        snprintf(why, why_len,
                 "fetch.groups: %u other block tables, but the offer of "
                 "request %s has %zu",
                 ngs, ksb(cp->key.data, cp->key.len), cp->n_groups);
        rc = KVX_ERR_MISMATCH;
        goto out;
    }
    if (remote) {
        rc = fetch_remote(inst, rank, request_id, key, cp, pool, blocks,
                          nblocks, skip, dp_rank, gs, ngs, why, why_len);
        goto out;
    }
    /* from here to the plan, the checks of the offer: as at a peer
     * daemon, their failure is an ERROR event (xfer_fetch()), with the
     * code and the message (after "context side: ") a peer sends */
    *as_event = 1;
    uint64_t src_id = xfer_key_id(cp->key.data, cp->key.len);
    if (!(ci = instance_find(cp->instance_id))) {
        snprintf(why, why_len,
                 "context side: no offer for request %s of instance '%s' on "
                 "daemon %s (no such instance there)",
                 ksb(cp->key.data, cp->key.len), cp->instance_id, kvxd.address);
        rc = KVX_ERR_NOT_FOUND;
        goto out;
    }
    const gone_t *gx;
    if ((!(o = map_get(&ci->offers, src_id)) || o->ending || o->consumed) &&
        (gx = gone_find(1, ci->id, src_id, cp->key.data, cp->key.len))) {
        snprintf(why, why_len, "context side: %s",
                 gx->released ? "released (kvx_release)"
                              : "cancelled by the context side");
        rc = gx->released ? KVX_ERR_NOT_FOUND : KVX_ERR_CANCELLED;
        goto out;
    }
    if (o && (o->key.len != cp->key.len ||
              memcmp(o->key.b, cp->key.data, cp->key.len)))
        o = NULL; /* another key's, whose id collides */
    if (!o || o->ending || o->consumed) {
        snprintf(why, why_len,
                 "context side: no offer for request %s of instance '%s' on "
                 "daemon %s (%s)",
                 ksb(cp->key.data, cp->key.len), cp->instance_id, kvxd.address,
                 !o            ? "expired, cancelled or completed"
                 : o->consumed ? "consumed"
                               : "ending");
        rc = KVX_ERR_NOT_FOUND;
        goto out;
    }
    if (!ct_equal(cp->token.data, o->token, TOKEN_LEN)) {
        snprintf(why, why_len,
                 "context side: capability token does not match the offer "
                 "of request %s",
                 ksb(cp->key.data, cp->key.len));
        log_warn("fetch %s/%s: forged or stale capability token for offer "
                 "%s/%s",
                 inst->id, ks(key), ci->id, ksb(cp->key.data, cp->key.len));
        rc = KVX_ERR_AUTH;
        goto out;
    }
    if (o->ngroups != 1 + ngs) { /* the params said so, but may lie */
        snprintf(why, why_len,
                 "fetch.groups: %u other block tables, but the offer of "
                 "request %s has %u",
                 ngs, ksb(cp->key.data, cp->key.len), o->ngroups - 1);
        rc = KVX_ERR_MISMATCH;
        goto out;
    }

    *as_event = 0;
    genreq_t *g = map_get(&inst->fetches, request_id);
    if (g && !reqkey_eq(&g->key, key)) {
        snprintf(why, why_len,
                 "fetch.key: %s has the id of request %s in flight (a 64-bit "
                 "collision; use another key)",
                 ks(key), ks(&g->key));
        rc = KVX_ERR_EXISTS;
        goto out;
    }
    if (g) {
        if (g->ending) {
            snprintf(why, why_len, "fetch: request %s is ending (%s)", ks(key),
                     g->end_msg);
            rc = KVX_ERR_STATE;
            goto out;
        }
        if (g->offer != o) {
            snprintf(why, why_len,
                     "fetch.context_params: request %s is being fetched "
                     "from another offer by another rank",
                     ks(key));
            rc = KVX_ERR_MISMATCH;
            goto out;
        }
        if (g->parts[rank].fetched) {
            snprintf(why, why_len,
                     "fetch: request %s already fetched by rank %u", ks(key),
                     rank);
            rc = KVX_ERR_EXISTS;
            goto out;
        }
        if (g->dp_rank != dp_rank) {
            snprintf(why, why_len,
                     "fetch.dp_rank: %u differs from %u given by another rank",
                     dp_rank, g->dp_rank);
            rc = KVX_ERR_MISMATCH;
            goto out;
        }
        if (g->skip_tokens != skip) {
            snprintf(why, why_len,
                     "fetch.skip_tokens: %u differs from %u given by another "
                     "rank",
                     skip, g->skip_tokens);
            rc = KVX_ERR_MISMATCH;
            goto out;
        }
        for (uint32_t k = 0; k < ngs; k++)
            if (g->gskip[k + 1] != gs[k].skip_tokens) {
                snprintf(why, why_len,
                         "fetch.groups[%u].skip_tokens: %u differs from %u "
                         "given by another rank",
                         k, gs[k].skip_tokens, g->gskip[k + 1]);
                rc = KVX_ERR_MISMATCH;
                goto out;
            }
    } else if (R.offer_taker && R.offer_taker(o)) {
        snprintf(why, why_len,
                 "context side: the offer of request %s is already taken by "
                 "%s",
                 ksb(cp->key.data, cp->key.len), R.offer_taker(o));
        rc = KVX_ERR_EXISTS;
        *as_event = 1;
        goto out;
    } else if (o->consumer) {
        snprintf(why, why_len,
                 "context side: the offer of request %s is already taken by "
                 "request %s of instance '%s'",
                 ksb(cp->key.data, cp->key.len), ks(&o->consumer->key),
                 o->consumer->inst->id);
        rc = KVX_ERR_EXISTS;
        *as_event = 1;
        goto out;
    } else if (nrequests >= kvxd.conf.max_requests) {
        snprintf(why, why_len,
                 "fetch: %u requests in flight (limits.max_requests)",
                 nrequests);
        rc = KVX_ERR_LIMIT;
        goto out;
    }

    plan_t *plan;
    {
        plan_side_t full;
        side_from_layout(&full, inst, &pool->layout);
        plan_dp_view(&full, rank, &dst, &eff_rank);
    }
    if ((rc = plan_build(&o->side, &dst, eff_rank, o->num_tokens, skip,
                         &plan, why, why_len)))
        goto out;
    if ((rc = plan_own(plan, inst->owner_uid, why, why_len)))
        goto err_free_plan;
    if (nblocks < plan->dst_blocks_needed) {
        snprintf(why, why_len,
                 "fetch.blocks: %u blocks of %u tokens cannot hold the "
                 "offer's %u tokens (need %u)",
                 nblocks, dst.tokens_per_block, o->num_tokens,
                 plan->dst_blocks_needed);
        rc = KVX_ERR_INVALID;
        goto err_free_plan;
    }
    uint32_t *bt = malloc(plan->dst_blocks_needed * sizeof(uint32_t));
    if (!bt) {
        snprintf(why, why_len, "fetch: out of memory");
        rc = KVX_ERR_NOMEM;
        goto err_free_plan;
    }
    memcpy(bt, blocks, plan->dst_blocks_needed * sizeof(uint32_t));
    /* the other groups' plans, each from the offer's group to this
     * rank's pool of that group */
    plan_t *gplan[XFER_MAX_GROUPS] = {NULL};
    uint32_t *gbt[XFER_MAX_GROUPS] = {NULL};
    for (uint32_t k = 0; k < ngs; k++)
        if ((rc = group_plan(&o->gside[k + 1], o->gtokens[k + 1],
                             o->gfirst[k + 1], inst, rank, k + 1, &gs[k],
                             &gplan[k], &gbt[k], why, why_len)))
            goto err_free_groups;
    /* the tables (and a new request's state), charged to its uid */
    uint64_t mem = fetch_bytes(inst, g, plan, pool, gplan, gs, ngs);
    if ((rc = req_charge(inst, mem, "fetch: the request", why, why_len)))
        goto err_free_groups;
    if (!g) {
        if (!(g = genreq_new(inst, request_id, key, skip, dp_rank, gs, ngs))) {
            kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid, mem);
            snprintf(why, why_len, "fetch: out of memory");
            rc = KVX_ERR_NOMEM;
            goto err_free_groups;
        }
        g->offer = o;
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
    schedule();
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
static int group_plan(const plan_side_t *src, uint32_t src_tokens,
                      uint32_t src_first, const instance_t *inst, uint32_t rank,
                      uint32_t k, const xfer_group_t *x, plan_t **out,
                      uint32_t **bt_out, char *why, size_t why_len)
{
    int rc;
    char what[48];
    snprintf(what, sizeof(what), "fetch.groups[%u]", k - 1);
    const kvx_layout_t *l = &x->pool->layout;
    plan_side_t full, dst;
    uint32_t eff_rank;
    group_side(&full, inst, l);
    if ((rc = plan_side_check(&full, why, why_len)) ||
        (rc = check_side_layout(&full, rank, l, what, why, why_len)))
        return rc;
    plan_dp_view(&full, rank, &dst, &eff_rank);
    uint64_t skip_min = (uint64_t)src_first * src->tokens_per_block;
    if (x->skip_tokens < skip_min)
        WHY(KVX_ERR_INVALID,
            "%s.skip_tokens: %u, but the offer's group keeps no tokens "
            "below %llu (its first_block %u)",
            what, x->skip_tokens, (unsigned long long)skip_min, src_first);
    if (x->skip_tokens < (uint64_t)x->first_block * l->tokens_per_block)
        WHY(KVX_ERR_INVALID,
            "%s.skip_tokens: %u, but its blocks start at block %u (token "
            "%llu)",
            what, x->skip_tokens, x->first_block,
            (unsigned long long)x->first_block * l->tokens_per_block);
    if (x->skip_tokens > src_tokens)
        WHY(KVX_ERR_INVALID, "%s.skip_tokens: %u, more than its %u tokens",
            what, x->skip_tokens, src_tokens);
    /* before planning: params could ask for billions of tokens; the
     * blocks given bound what can land */
    if (((uint64_t)x->first_block + x->nblocks) * l->tokens_per_block <
        src_tokens)
        WHY(KVX_ERR_INVALID,
            "%s.blocks: %u blocks of %u tokens from block %u cannot hold "
            "the group's %u tokens",
            what, x->nblocks, l->tokens_per_block, x->first_block, src_tokens);
    plan_t *plan;
    if ((rc = plan_build(src, &dst, eff_rank, src_tokens, x->skip_tokens, &plan,
                         why, why_len)))
        return rc;
    if ((rc = plan_own(plan, inst->owner_uid, why, why_len))) {
        plan_free(plan);
        return rc;
    }
    uint32_t need = plan->dst_blocks_needed;
    if ((uint64_t)x->first_block + x->nblocks < need) {
        plan_free(plan);
        WHY(KVX_ERR_INVALID,
            "%s.blocks: %u blocks of %u tokens from block %u cannot hold "
            "the group's %u tokens (need %u)",
            what, x->nblocks, l->tokens_per_block, x->first_block, src_tokens,
            need);
    }
    uint32_t *bt = malloc((need ? need : 1) * sizeof(uint32_t));
    if (!bt) {
        plan_free(plan);
        WHY(KVX_ERR_NOMEM, "fetch: out of memory");
    }
    for (uint32_t i = 0; i < need; i++)
        bt[i] = i < x->first_block ? UINT32_MAX : x->blocks[i - x->first_block];
    *out = plan;
    *bt_out = bt;
    return 0;
}

/* ---- scheduler -------------------------------------------------------- */

/* One line of log.trace_file for a fetch that ends: "fetch INSTANCE KEY
 * KIND BYTES" and the hops' monotonic ns (0: not reached). */
static void trace_write(genreq_t *g)
{
    fprintf(kvxd.trace, "fetch %s %s %d %llu %llu %llu %llu %llu %llu %llu\n",
            g->inst->id, ks(&g->key), g->end_kind,
            (unsigned long long)g->bytes_done,
            (unsigned long long)g->tr[TR_FETCH],
            (unsigned long long)g->tr[TR_QUEUED],
            (unsigned long long)g->tr[TR_SUBMIT],
            (unsigned long long)g->tr[TR_COPIED],
            (unsigned long long)g->tr[TR_LANDED],
            (unsigned long long)g->tr[TR_EVENT]);
}

/* A copy of part p came back (a chunk here, a scattered slot in
 * remote.c): count it, and end the request on error, on its fence, or
 * when every part is done. */
void xfer_part_progress(genpart_t *p, uint64_t units, uint64_t bytes,
                        int status)
{
    genreq_t *g = p->req;
    assert(p->inflight > 0);
    p->inflight--;
    assert(g->inflight > 0 /* the fence */);
    g->inflight--;
    p->units_done += units;
    g->bytes_done += bytes;
    if (!status)
        kvxd.stats.bytes_moved += bytes;
    /* each branch calls genreq_end at most once: it may free g */
    if (status && !g->ending) {
        char m[96];
        snprintf(m, sizeof(m), "copy failed on %s: %s",
                 p->gpu ? "the GPU" : "a worker", kvx_status_str(status));
        genreq_end(g, KVX_EVENT_ERROR, status, m);
    } else if (g->ending) {
        if (g->inflight == 0) /* the fence is complete: finalize */
            genreq_end(g, g->end_kind, g->end_code, g->end_msg);
    } else if (p->units_done == p->plan->nunits) {
        p->done = 1;
        part_settle(p, 0);
        if (++g->ndone == g->need * g->ngroups)
            genreq_end(g, KVX_EVENT_COMPLETE, 0, "");
    }
}

static void on_chunk_done(copy_job_t *job)
{
    genpart_t *p = job->owner;
    uint64_t units = job->unit_end - job->unit_begin, bytes = job->bytes;
    int status = job->status;
    assert(chunks_inflight > 0);
    chunks_inflight--;
    if (!status)
        part_landed(p, job->unit_begin, job->unit_end);
    if (kvxd.trace) {
        genreq_t *g = p->req;
        if (job->t_done > g->tr[TR_COPIED])
            g->tr[TR_COPIED] = job->t_done;
        g->tr[TR_LANDED] = mono_ns();
    }
    free(job);
    xfer_part_progress(p, units, bytes, status);
    schedule();
}

/* Part p of g is done, or has its last job out to a copy thread or a
 * GPU (last_out): once every part is, g's terminal event is at most one
 * copy away, and the instance's polls that asked Poll.early are answered
 * now, so that a caller asleep in its poll wakes while that copy runs (a
 * thread's wake-up costs tens of microseconds) and looks for the event
 * without sleeping. Not for an instance spread over daemons (its batches
 * are agreed on rank 0's daemon), nor when the last part settles by
 * ending or by a job run on the loop (the event goes out this turn), nor
 * for parts pulled from peer daemons (they settle by ending). */
static void part_settle(genpart_t *p, int last_out)
{
    genreq_t *g = p->req;
    if (p->settled)
        return;
    p->settled = 1;
    if (++g->nsettled < g->need * g->ngroups || g->soon || g->ending ||
        !last_out)
        return;
    g->soon = 1;
    if (!instance_spread(g->inst))
        kvxd.stats.polls_woken_early += batch_wake_early(&g->inst->batches);
}

static void schedule(void)
{
    uint32_t max = kvxd.conf.max_inflight_chunks
                       ? kvxd.conf.max_inflight_chunks
                       : 2 * copy_threads();
    /* handed to the copy engine together, so that the workers start
     * once every job of this turn is queued */
    copy_job_t *batch[64];
    size_t nbatch = 0;
    while (runq.head && chunks_inflight < max) {
        genpart_t *p = RRQ_OWNER(rrq_pop(&runq), genpart_t, turn);
        copy_job_t *job = calloc(1, sizeof(*job));
        if (!job) {
            log_error("xfer: out of memory for a copy job");
            genreq_end(p->req, KVX_EVENT_ERROR, KVX_ERR_NOMEM,
                       "daemon out of memory");
            continue;
        }
        uint64_t begin = p->next_unit, end;
        int more;
        if (p->cnext) { /* layer-wise: only what its sources have ready */
            if (!part_next_job(p, &begin, &end)) {
                free(job);
                p->parked = 1; /* layers_ready() puts it back */
                continue;
            }
            more = part_has_left(p);
        } else {
            end = begin + p->units_per_chunk;
            if (end > p->plan->nunits)
                end = p->plan->nunits;
            p->next_unit = end;
            more = end < p->plan->nunits;
        }
        job->plan = p->plan;
        job->gpu = p->gpu;
        job->unit_begin = begin;
        job->unit_end = end;
        job->bytes = plan_units_bytes(p->plan, begin, end);
        job->done = on_chunk_done;
        job->owner = p;
        TRACE_HOP(p->req, TR_SUBMIT);
        p->inflight++;
        p->req->inflight++;
        chunks_inflight++;
        if (more) { /* back of the line: fairness */
            if (!p->cnext || part_has_ready(p))
                rrq_push(&runq, &p->turn);
            else
                p->parked = 1;
        }
        batch[nbatch++] = job;
        /* a job run on the loop ends this turn: its event needs no
         * early answer */
        if (!more)
            part_settle(p, !copy_job_inline(job));
        if (nbatch == sizeof(batch) / sizeof(batch[0])) {
            copy_submit_many(batch, nbatch);
            nbatch = 0;
        }
    }
    copy_submit_many(batch, nbatch);
}

/* ---- the end of a request --------------------------------------------- */

/* Forget a consumed offer (all ranks published, lease over, cancel). */
static void offer_drop(offer_t *o)
{
    dl_remove(&o->lease);
    map_del(&o->inst->offers, o->request_id);
    offer_free(o);
}

/* The consumer took everything it needed while some ranks have not
 * published yet (replicated heads): complete now, release the memory,
 * keep the params for the late ranks until they publish or the lease
 * ends. */
static void offer_consume(offer_t *o, const char *msg)
{
    instance_t *inst = o->inst;
    push_event(inst, o->request_id, &o->key, KVX_EVENT_COMPLETE, 0, msg, 1,
               inst->nlocal, inst->nranks);
    for (size_t r = 0; r < OPARTS(o); r++) {
        if (o->parts[r].pool)
            pool_unref(o->parts[r].pool);
        o->parts[r].pool = NULL;
        free(o->parts[r].blocks);
        o->parts[r].blocks = NULL;
        part_layers_free(&o->parts[r]);
        part_uncharge(o, &o->parts[r]);
    }
    o->consumed = 1;
    nrequests--;
    if (!list_linked(&o->lease.node))
        dl_insert(&leases, &o->lease,
                  kvxd_now_ms() + kvxd.conf.offer_lease_ms);
    list_t w;
    list_init(&w);
    list_move_all(&o->waiters, &w);
    waiters_reply(&w);
}

static void offer_try_finalize(offer_t *o)
{
    if (!o->ending || o->consumer || o->gathers)
        return; /* the consumer's fence, or our gathers', comes first */
    instance_t *inst = o->inst;
    push_event(inst, o->request_id, &o->key, o->end_kind, o->end_code,
               o->end_msg, 1, inst->nlocal, inst->nranks);
    if (o->end_kind == KVX_EVENT_CANCELLED)
        gone_add(1, inst, o->request_id, &o->key, 0);
    map_del(&inst->offers, o->request_id);
    nrequests--;
    log_debug("offer %s/%s ended: %s", inst->id, ks(&o->key),
              o->end_kind == KVX_EVENT_COMPLETE ? "complete" : o->end_msg);
    list_t w;
    list_init(&w);
    list_move_all(&o->waiters, &w);
    offer_free(o);
    waiters_reply(&w);
}

static void offer_end(offer_t *o, int kind, int code, const char *msg)
{
    if (o->ending)
        return;
    o->ending = 1;
    dl_remove(&o->lease);
    o->end_kind = kind;
    o->end_code = code;
    snprintf(o->end_msg, sizeof(o->end_msg), "%s", msg);
    if (R.offer_stop)
        R.offer_stop(o, code ? code : KVX_ERR_STATE, msg);
    if (o->consumer) {
        /* the consumer reads this offer's memory: its fence comes first,
         * and its finalize (now or after its last chunk) finalizes o */
        char m[300];
        snprintf(m, sizeof(m), "context side: %s", msg);
        genreq_end(o->consumer, KVX_EVENT_ERROR,
                   code ? code : KVX_ERR_STATE, m);
        return;
    }
    offer_try_finalize(o);
}

static void genreq_end(genreq_t *g, int kind, int code, const char *msg)
{
    if (!g->ending) {
        g->ending = 1;
        dl_remove(&g->timeout);
        g->end_kind = kind;
        g->end_code = code;
        snprintf(g->end_msg, sizeof(g->end_msg), "%s", msg);
        /* held while its parts stop: stopping one can end g again from
         * inside (remote's scheduler, freed slots), which must not
         * finalize it under this loop */
        g->inflight++;
        for (size_t r = 0; r < GPARTS(g); r++) {
            rrq_remove(&runq, &g->parts[r].turn);
            if (R.part_stop)
                R.part_stop(&g->parts[r], code ? code : KVX_ERR_STATE, msg);
        }
        assert(g->inflight > 0 /* the fence */);
        g->inflight--;
    }
    if (g->inflight)
        return; /* fence: on_chunk_done comes back here */

    instance_t *inst = g->inst;
    offer_t *o = g->offer;
    /* COMPLETE carries the aux the offer has now (a local one: what its
     * ranks published so far) or a source daemon sent */
    int done = g->end_kind == KVX_EVENT_COMPLETE;
    const offer_t *ao = o && o->aux_len ? o : NULL;
    if (kvxd.trace)
        g->tr[TR_EVENT] = mono_ns(); /* the event goes out from here */
    push_event_aux(inst, g->request_id, &g->key, g->end_kind, g->end_code,
                   g->end_msg, 0, g->need,
                   inst->nranks / (inst->side.attention_dp > 1
                                       ? inst->side.attention_dp
                                       : 1),
                   !done ? NULL
                   : ao  ? ao->aux
                         : g->aux,
                   !done ? 0
                   : ao  ? ao->aux_len
                         : g->aux_len);
    if (g->end_kind == KVX_EVENT_COMPLETE)
        kvxd.stats.transfers_done++;
    if (kvxd.trace)
        trace_write(g);
    uint32_t seen = 0;
    for (uint32_t r = 0; r < inst->nranks; r++)
        seen += g->parts[r].fetched || g->parts[r].late;
    gone_t *x = g->end_kind != KVX_EVENT_COMPLETE && seen < g->need
                    ? gone_add(0, inst, g->request_id, &g->key, g->src_id)
                    : NULL;
    for (uint32_t r = 0; x && r < inst->nranks; r++)
        x->ranks[r] = g->parts[r].fetched || g->parts[r].late;
    if (x) {
        x->need = g->need;
        x->seen = seen;
    }
    map_del(&inst->fetches, g->request_id);
    nrequests--;
    log_debug("fetch %s/%s ended: %s", inst->id, ks(&g->key),
              g->end_kind == KVX_EVENT_COMPLETE ? "complete" : g->end_msg);
    list_t w;
    list_init(&w);
    list_move_all(&g->waiters, &w);
    g->offer = NULL;
    int kind_done = g->end_kind, code_done = g->end_code;
    char m[300];
    snprintf(m, sizeof(m), "generation side: %s", g->end_msg);
    genreq_free(g);
    if (o) {
        o->consumer = NULL;
        if (o->ending) /* the offer ended first and waited for this fence */
            offer_try_finalize(o);
        else if (kind_done == KVX_EVENT_COMPLETE &&
                 o->npublished < o->inst->nlocal)
            offer_consume(o, "");
        else if (kind_done == KVX_EVENT_COMPLETE)
            offer_end(o, KVX_EVENT_COMPLETE, 0, "");
        else
            offer_end(o, KVX_EVENT_ERROR,
                      code_done == 0 ? KVX_ERR_STATE : code_done, m);
    }
    waiters_reply(&w);
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
                    char *why, size_t why_len)
{
    if (group >= o->ngroups)
        WHY(KVX_ERR_MISMATCH, "request %s has %u block tables, not %u",
            ks(&o->key), o->ngroups, group + 1);
    uint64_t below =
        (uint64_t)o->gfirst[group] * o->gside[group].tokens_per_block;
    if (skip_tokens < below)
        WHY(KVX_ERR_INVALID,
            "block table %u of request %s keeps no tokens below %llu, and "
            "skip_tokens is %u",
            group, ks(&o->key), (unsigned long long)below, skip_tokens);
    return plan_build(&o->gside[group], dst, dst_rank, o->gtokens[group],
                      skip_tokens, out, why, why_len);
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
    dl_insert(&leases, &o->lease,
              kvxd_now_ms() + kvxd.conf.offer_lease_ms +
                  kvxd.conf.fetch_timeout_ms);
}

int xfer_release(const char *instance_id, const reqkey_t *key,
                 const uint8_t *token, size_t token_len, char *why,
                 size_t why_len)
{
    instance_t *inst = instance_find(instance_id);
    offer_t *o =
        inst ? map_get(&inst->offers, xfer_key_id(key->b, key->len)) : NULL;
    if (o && !reqkey_eq(&o->key, key))
        o = NULL; /* another key's, whose id collides */
    if (!o)
        WHY(KVX_ERR_NOT_FOUND,
            "release: no offer of request %s of instance %s on daemon %s",
            ks(key), instance_id, kvxd.address);
    if (token_len != TOKEN_LEN || !ct_equal(token, o->token, TOKEN_LEN))
        WHY(KVX_ERR_AUTH,
            "release: the params' token is not that of request %s of "
            "instance %s",
            ks(&o->key), instance_id);
    if (o->consumed || o->consume_fenced)
        WHY(KVX_ERR_STATE,
            "release: request %s of instance %s is already complete",
            ks(&o->key), instance_id);
    if (o->ending)
        WHY(KVX_ERR_STATE, "release: request %s of instance %s is ending",
            ks(&o->key), instance_id);
    if (o->consumer || o->taken)
        WHY(KVX_ERR_STATE,
            "release: request %s of instance %s is being fetched; cancel "
            "that fetch instead",
            ks(&o->key), instance_id);
    log_debug("offer %s/%s released", instance_id, ks(&o->key));
    gone_t *x = gone_add(1, inst, o->request_id, &o->key, 0);
    if (x) /* a fetch by key after this hears so at once */
        x->released = 1;
    if (o->npublished < inst->nlocal)
        offer_consume(o, "released"); /* late ranks get the params' end */
    else
        offer_end(o, KVX_EVENT_COMPLETE, 0, "released");
    return 0;
}

void xfer_offer_remote_done(offer_t *o, int complete, int code,
                            const char *msg)
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
            side_from_layout(&full, g->inst, &q->pool->layout);
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

int xfer_part_upload(genpart_t *p, int device, char *why, size_t why_len)
{
    assert(!p->gpu); /* once; freed with p (genreq_free()) */
    int rc =
        pool_device_view(p->pool, device, &p->plan->dst.regions, why, why_len);
    return rc ? rc : gpu_part_create(p->plan, device, &p->gpu, why, why_len);
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

int xfer_part_set_aux(genpart_t *p, const uint8_t *aux, uint32_t len, char *why,
                      size_t why_len)
{
    genreq_t *g = p->req;
    if (!len || g->aux_len)
        return 0; /* the first non-empty one is the request's */
    int rc = aux_keep(g->inst->owner_uid, aux, len, &g->aux,
                      "aux from a source daemon", why, why_len);
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

/* ---- cancel, cleanup, deadlines --------------------------------------- */

int xfer_cancel(instance_t *inst, const reqkey_t *key, uint64_t sid,
                uint64_t req_id, char *why, size_t why_len)
{
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    genreq_t *g = map_get(&inst->fetches, request_id);
    if (o && !reqkey_eq(&o->key, key))
        o = NULL; /* another key's (its id collides): not this one */
    if (g && !reqkey_eq(&g->key, key))
        g = NULL;
    if (!o && !g)
        WHY(KVX_ERR_NOT_FOUND,
            "cancel.key: no request %s in flight in instance %s", ks(key),
            inst->id);
    offer_t *oc = o && o->consumed ? o : NULL;
    if (oc) { /* already complete; a late rank's tombstone: drop it */
        offer_drop(oc);
        o = NULL;
        if (!g)
            return 0;
    }
    /* Register before ending: an end with nothing in flight finalizes at
     * once and answers the waiters there. */
    cancel_wait_t *cw = calloc(1, sizeof(*cw));
    if (!cw)
        WHY(KVX_ERR_NOMEM, "cancel: out of memory");
    cw->sid = sid;
    cw->req_id = req_id;
    cw->pending = 1; /* held by this function until both ends are called */
    if (o && waiter_add(&o->waiters, cw)) {
        free(cw);
        WHY(KVX_ERR_NOMEM, "cancel: out of memory");
    }
    if (g && (!o || g->offer != o) && waiter_add(&g->waiters, cw)) {
        /* o's waiter (if any) holds cw; nothing has ended yet, so the
         * request stays as it was and the cancel fails cleanly */
        if (o) { /* its waiter, added first in o->waiters */
            waiter_t *w = LIST_OWNER(list_first(&o->waiters), waiter_t, node);
            assert(w->cw == cw);
            list_remove(&w->node);
            free(w);
        }
        free(cw);
        WHY(KVX_ERR_NOMEM, "cancel: out of memory");
    }
    uint64_t oid = o ? o->request_id : 0;
    if (g)
        genreq_end(g, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED,
                   "cancelled by the generation side");
    /* ending g may have ended and freed o: look it up again */
    if (o && (o = map_get(&inst->offers, oid)) && !o->consumed)
        offer_end(o, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED,
                  "cancelled by the context side");
    if (--cw->pending == 0) {
        free(cw);
        return 0; /* everything finalized already: reply now */
    }
    return 1;
}

/* Visit the offers, then the fetches, of inst. Ending one request can end
 * and free another (its consumer, its offer), so the walk goes by request
 * id and looks each one up again before touching it. */
typedef void (*offer_fn)(offer_t *o, void *arg);
typedef void (*genreq_fn)(genreq_t *g, void *arg);

static void each_request(instance_t *inst, offer_fn on_offer,
                         genreq_fn on_fetch, void *arg)
{
    uint32_t n = inst->offers.n > inst->fetches.n ? inst->offers.n
                                                   : inst->fetches.n;
    uint64_t *ids = calloc(n ? n : 1, sizeof(*ids));
    if (!ids) {
        log_error("xfer: out of memory ending the requests of instance %s",
                  inst->id);
        return;
    }
    uint32_t k = map_keys(&inst->offers, ids, n);
    for (uint32_t i = 0; i < k; i++) {
        offer_t *o = map_get(&inst->offers, ids[i]);
        if (o)
            on_offer(o, arg);
    }
    k = map_keys(&inst->fetches, ids, n);
    for (uint32_t i = 0; i < k; i++) {
        genreq_t *g = map_get(&inst->fetches, ids[i]);
        if (g)
            on_fetch(g, arg);
    }
    free(ids);
}

struct end_why {
    int code;
    const char *msg;
    const pool_t *pool; /* NULL: every request; else those using it */
};

static int offer_uses(const offer_t *o, const pool_t *p)
{
    for (size_t r = 0; r < OPARTS(o); r++)
        if (o->parts[r].pool == p)
            return 1;
    return 0;
}

static int genreq_uses(const genreq_t *g, const pool_t *p)
{
    for (size_t r = 0; r < GPARTS(g); r++)
        if (g->parts[r].pool == p)
            return 1;
    return 0;
}

static void end_offer_cb(offer_t *o, void *arg)
{
    const struct end_why *w = arg;
    if (w->pool && !offer_uses(o, w->pool))
        return;
    if (o->consumed)
        offer_drop(o);
    else
        offer_end(o, KVX_EVENT_ERROR, w->code, w->msg);
}

static void end_genreq_cb(genreq_t *g, void *arg)
{
    const struct end_why *w = arg;
    if (!w->pool || genreq_uses(g, w->pool))
        genreq_end(g, KVX_EVENT_ERROR, w->code, w->msg);
}

int xfer_request_runs(instance_t *inst, uint64_t request_id, int code,
                      const char *msg)
{
    if (msg) {
        int c = code ? code : KVX_ERR_STATE;
        genreq_t *g = map_get(&inst->fetches, request_id);
        if (g && !g->ending)
            genreq_end(g, KVX_EVENT_ERROR, c, msg); /* may free g and o */
        offer_t *o = map_get(&inst->offers, request_id);
        if (o && !o->consumed && !o->ending)
            offer_end(o, KVX_EVENT_ERROR, c, msg);
    }
    return map_get(&inst->fetches, request_id) ||
           xfer_offer_runs(inst, request_id);
}

int xfer_offer_runs(instance_t *inst, uint64_t request_id)
{
    offer_t *o = map_get(&inst->offers, request_id);
    return o && !o->consumed;
}

void xfer_end_instance(instance_t *inst, int code, const char *msg)
{
    struct end_why w = {code, msg, NULL};
    each_request(inst, end_offer_cb, end_genreq_cb, &w);
}

void xfer_end_all(int code, const char *msg)
{
    for (instance_t *i = instance_first(), *n; i; i = n) {
        n = instance_next(i);
        xfer_end_instance(i, code, msg);
    }
}

void xfer_end_pool_users(const pool_t *pool, int code, const char *msg)
{
    struct end_why w = {code, msg, pool};
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        each_request(i, end_offer_cb, end_genreq_cb, &w);
}

/* References other than the registration and a populate job are
 * requests'. */
uint32_t xfer_pool_users(const pool_t *pool)
{
    return pool->users - 1 - (pool->populating ? 1 : 0);
}

void xfer_tick(uint64_t now)
{
    /* the lease bounds an offer nobody fetches; once fetched, the fetch
     * timeout bounds it */
    list_t *n;
    while ((n = list_first(&leases)) && DL_NODE(n)->deadline_ms <= now) {
        offer_t *o = LIST_OWNER(n, offer_t, lease.node);
        if (o->consumed) { /* late ranks never came: forget it quietly */
            offer_drop(o);
            continue;
        }
        char m[192];
        uint32_t done = 0,
                 expect = R.offer_streams ? R.offer_streams(o, &done) : 0;
        if (expect) /* taken through a peer: the backstop */
            snprintf(m, sizeof(m),
                     "taken by a peer daemon that did not finish within "
                     "offer_lease_ms + fetch_timeout_ms (%u ms; %u of %u "
                     "streams done)",
                     kvxd.conf.offer_lease_ms + kvxd.conf.fetch_timeout_ms,
                     done, expect);
        else
            snprintf(m, sizeof(m),
                     "offer lease of %u ms expired (%u of %u ranks "
                     "published)",
                     kvxd.conf.offer_lease_ms, o->npublished,
                     o->inst->nlocal);
        offer_end(o, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, m);
    }
    while ((n = list_first(&timeouts)) && DL_NODE(n)->deadline_ms <= now) {
        genreq_t *g = LIST_OWNER(n, genreq_t, timeout.node);
        char m[160];
        snprintf(m, sizeof(m),
                 "fetch timeout of %u ms expired (%u of %u ranks fetched, "
                 "%u done)",
                 kvxd.conf.fetch_timeout_ms, g->nfetched, g->need,
                 g->ndone);
        genreq_end(g, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, m);
    }
    while ((n = list_first(&gones)) && DL_NODE(n)->deadline_ms <= now)
        gone_free(LIST_OWNER(n, gone_t, dl.node));
}

uint32_t xfer_count(void) { return nrequests; }

/* ---- status ----------------------------------------------------------- */

static const char *offer_state(const offer_t *o)
{
    if (o->consumed)
        return "consumed";
    if (o->ending)
        return "ending";
    uint32_t done;
    if (o->consumer || (R.offer_streams && R.offer_streams(o, &done) > done))
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
    static const char *const names[] = {"publishing", "offered",
                                        "transferring", "waiting-source",
                                        "fetching", "ending", "consumed"};
    uint64_t counts[7] = {0};
    for (instance_t *i = instance_first(); i; i = instance_next(i)) {
        uint32_t cnt = i->offers.n + i->fetches.n;
        void **all = calloc(cnt ? cnt : 1, sizeof(void *));
        if (!all)
            continue;
        uint32_t no = map_values(&i->offers, all, cnt);
        uint32_t ng = map_values(&i->fetches, all + no, cnt - no);
        for (uint32_t k = 0; k < no + ng; k++) {
            const char *s = k < no ? offer_state(all[k])
                                   : genreq_state(all[k]);
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

