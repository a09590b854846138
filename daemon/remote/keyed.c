/*
 * keyed — fetch by key; see keyed.h.
 *
 * Reading order:
 *   keyed_fetch()   a rank's fetch: joins or makes the waiting fetch
 *                   (kf_t) and starts resolving it (kf_resolve_local(),
 *                   or a PeerResolve to rank 0's daemon)
 *   kf_resolved()   the params are known: each waiting rank goes to
 *                   xfer_fetch(), as if it had sent them
 *   on_resolve()    context side: answer now, or hold (res_t) until the
 *                   offer is made (offer_made() -> retry_made()) or the
 *                   asker's wait runs out (keyed_tick())
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/list.h"
#include "core/daemon.h"
#include "core/log.h"
#include "keyed.h"
#include "net/peer.h"
#include "release.h"
#include "xfer/xfer.h"

#define RES_MAX 65536         /* resolves held at once */
#define RES_WAIT_MAX 3600000u /* ms: the longest a resolve is held */

/* One rank's part of a waiting fetch. */
typedef struct kf_rank {
    int waiting, done;
    pool_t *pool; /* referenced while waiting */
    uint32_t *blocks;
    uint32_t nblocks;
    /* the other block tables (FetchByKey.groups): their pools referenced
     * and blocks copied while waiting, as the first one's */
    xfer_group_t g[XFER_MAX_GROUPS - 1];
    uint32_t ng;
} kf_rank_t;

/* Rank a's tables go: its pools' references and its copies of blocks. */
static void kf_rank_drop(kf_rank_t *a)
{
    if (a->pool)
        pool_unref(a->pool);
    a->pool = NULL;
    free(a->blocks);
    a->blocks = NULL;
    for (uint32_t k = 0; k < a->ng; k++) {
        pool_unref(a->g[k].pool);
        free((uint32_t *)a->g[k].blocks);
    }
    a->ng = 0;
}

/* Does rank a hold pool? */
static int kf_rank_uses(const kf_rank_t *a, const pool_t *pool)
{
    int n = a->pool == pool;
    for (uint32_t k = 0; k < a->ng; k++)
        n |= a->g[k].pool == pool;
    return n;
}

typedef struct kf {
    list_t node;
    char inst[INSTANCE_ID_MAX + 1];
    reqkey_t key;
    uint32_t dp_rank, skip;
    char ctx_inst[INSTANCE_ID_MAX + 1];
    char ctx_addr[192];
    reqkey_t ctx_key;
    uint32_t nranks, need, ndone;
    uint32_t handed; /* ranks xfer took: it sends the request's event */
    kf_rank_t *rank;
    uint8_t *params; /* once resolved */
    size_t plen;
    uint64_t until_ms;
    uint64_t res_id; /* the PeerResolve's id; 0: resolved here */
    uint64_t conn;   /* the connection asked */
} kf_t;

/* A resolve held on the context side until the offer is made. */
typedef struct res {
    list_t node;
    uint64_t conn, id;
    char inst[INSTANCE_ID_MAX + 1];
    reqkey_t key;
    char consumer[INSTANCE_ID_MAX + 1];
    uint32_t consumer_uid; /* as the asking daemon says */
    reqkey_t consumer_key; /* its request; empty: a release */
    uint64_t until_ms;
} res_t;

/* What a PeerResolve asks: the offer of (inst, key) at daemon addr, for
 * instance consumer of uid consumer_uid, held there up to wait_ms (0:
 * answer now). */
typedef struct ask {
    const char *addr, *inst;
    const reqkey_t *key;
    const char *consumer;
    const reqkey_t *consumer_key; /* NULL: a release */
    uint32_t consumer_uid, wait_ms;
} ask_t;

/* A release by key waiting for the params from rank 0's daemon. */
typedef struct krel {
    list_t node;
    uint64_t sid, req_id; /* the client's request, answered once */
    uint64_t res_id, conn;
    char ctx_addr[192];
    uint64_t until_ms;
} krel_t;

/* An offer made, to look for waiters of on the next loop turn. */
typedef struct made {
    list_t node;
    char inst[INSTANCE_ID_MAX + 1];
    reqkey_t key;
} made_t;

#define KF(n) LIST_OWNER(n, kf_t, node)
#define RES(n) LIST_OWNER(n, res_t, node)
#define MADE(n) LIST_OWNER(n, made_t, node)
#define KREL(n) LIST_OWNER(n, krel_t, node)

static list_t kfs = {&kfs, &kfs};
static list_t held = {&held, &held};
static list_t mades = {&mades, &mades};
static list_t krels = {&krels, &krels};
static uint32_t nheld;
static int retry_queued;
static uint64_t next_id = 1;

static const char *kstr(const reqkey_t *k, char *buf)
{
    return reqkey_str(k->b, k->len, buf);
}

/* ---- generation side: the waiting fetches ------------------------------ */

static void kf_free(kf_t *kf)
{
    list_remove(&kf->node);
    for (uint32_t r = 0; r < kf->nranks; r++)
        kf_rank_drop(&kf->rank[r]);
    free(kf->rank);
    free(kf->params);
    free(kf);
}

/* It ends before it became a request: its event (the ranks that have
 * not fetched yet join that end: xfer_fetch_ended()), then it is gone.
 * Once xfer took a rank, xfer sends the request's one event instead. */
static void kf_fail(kf_t *kf, int kind, int code, const char *msg)
{
    instance_t *inst = instance_find(kf->inst);
    uint8_t *seen = inst ? calloc(inst->nranks, 1) : NULL;
    for (uint32_t r = 0; seen && r < kf->nranks && r < inst->nranks; r++)
        seen[r] = kf->rank[r].waiting || kf->rank[r].done;
    if (inst && !kf->handed)
        xfer_fetch_end_early(
            inst, &kf->key, kf->dp_rank,
            &(batch_end_t){kind, code, msg, NULL, 0}, seen,
            xfer_source_id(kf->ctx_inst, kf->ctx_key.b, kf->ctx_key.len));
    free(seen);
    kf_free(kf);
}

static kf_t *kf_find(const char *inst, const reqkey_t *key)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &kfs)
    if (!strcmp(KF(n)->inst, inst) && reqkey_eq(&KF(n)->key, key))
        return KF(n);
    return NULL;
}

/* A rank's fetch (rq: its instance, rank, pool, blocks and groups), with
 * kf's key, params, skip and DP rank: 0, or xfer's refusal with why. */
static int kf_run(kf_t *kf, const xfer_fetch_req_t *rq, kvx_why_t *why)
{
    xfer_fetch_req_t q = *rq;
    q.key = &kf->key;
    q.params = kf->params;
    q.params_len = kf->plen;
    q.skip_tokens = kf->skip;
    q.dp_rank = kf->dp_rank;
    kf->rank[q.rank].done = 1;
    kf->ndone++;
    int rc = xfer_fetch(&q, why);
    if (!rc && !kf->handed++) /* the deadline runs from the first call */
        xfer_fetch_deadline(q.inst, &kf->key, kf->until_ms);
    return rc;
}

/* Every local rank of the group has fetched: nothing left to wait for. */
static int kf_complete(kf_t *kf)
{
    if (kf->ndone < kf->need)
        return 0;
    kf_free(kf);
    return 1;
}

/* The params are known (ours now): the waiting ranks fetch. */
static void kf_resolved(kf_t *kf, uint8_t *params, size_t plen)
{
    kf->params = params;
    kf->plen = plen;
    instance_t *inst = instance_find(kf->inst);
    if (!inst) {
        kf_free(kf);
        return;
    }
    for (uint32_t r = 0; r < kf->nranks; r++) {
        kf_rank_t *a = &kf->rank[r];
        if (!a->waiting)
            continue;
        a->waiting = 0;
        char why[512];
        xfer_fetch_req_t q = {.inst = inst,
                              .rank = r,
                              .pool = a->pool,
                              .blocks = a->blocks,
                              .nblocks = a->nblocks,
                              .groups = a->g,
                              .ngroups = a->ng};
        int rc = kf_run(kf, &q, KVX_WHY(why));
        kf_rank_drop(a); /* xfer holds its own while it runs */
        if (rc) {
            /* refused before any rank became a request: it ends here;
             * else xfer ended the request (one event) for every rank */
            char m[700];
            snprintf(m, sizeof(m), "fetch_by_key: rank %u: %s", r, why);
            kf_fail(kf, KVX_EVENT_ERROR, rc, m);
            return;
        }
    }
    kf_complete(kf);
}

/* Resolved here (rank 0 of the context instance is ours): 1 when kf is
 * done with (resolved or failed), 0 while it waits. */
static int kf_resolve_local(kf_t *kf)
{
    instance_t *ci = instance_find(kf->ctx_inst);
    instance_t *gi = instance_find(kf->inst);
    if (!gi) {
        kf_free(kf);
        return 1;
    }
    if (!ci)
        return 0; /* not here yet: it may start */
    char why[512], ks[REQKEY_STR_MAX];
    if (!instance_allows(ci, kf->inst, gi->owner_uid)) {
        snprintf(why, sizeof(why),
                 "fetch_by_key: instance %s does not let instance %s of uid "
                 "%u fetch its requests by key (kvx_join_consumers)",
                 ci->id, kf->inst, gi->owner_uid);
        kf_fail(kf, KVX_EVENT_ERROR, KVX_ERR_PERM, why);
        return 1;
    }
    uint8_t *p;
    size_t len;
    xfer_consumer_t who = {kf->inst, kf->key.b, kf->key.len};
    int rc = xfer_params_for(ci, &kf->ctx_key, &who, &p, &len, KVX_WHY(why));
    if (rc == XFER_NOT_YET)
        return 0;
    if (rc) {
        char m[700];
        snprintf(m, sizeof(m), "fetch_by_key: request %s: %s",
                 kstr(&kf->ctx_key, ks), why);
        kf_fail(kf, KVX_EVENT_ERROR, rc, m);
        return 1;
    }
    kf_resolved(kf, p, len);
    return 1;
}

/* The context instance a fetch or release by key names (what: the
 * request's name in messages): 0 with *here set when rank 0 is served by
 * this daemon, else a checked peer address; or the code with why. */
static int target_check(const char *what, const keyed_source_t *src, int *here,
                        kvx_why_t *why)
{
    const char *inst = src->instance, *addr = src->address;
    size_t il = strlen(inst), al = strlen(addr);
    if (!il || il > INSTANCE_ID_MAX) {
        why_set(why, "%s.context_instance: %zu bytes (1 to %u)", what, il,
                INSTANCE_ID_MAX);
        return KVX_ERR_INVALID;
    }
    if (!al || al >= sizeof(((kf_t *)0)->ctx_addr)) {
        why_set(why, "%s.context_address: %zu bytes (1 to %zu)", what, al,
                sizeof(((kf_t *)0)->ctx_addr) - 1);
        return KVX_ERR_INVALID;
    }
    if ((*here = !strcmp(addr, kvxd.address)))
        return 0;
    char w[400];
    if (peer_address_alias(addr, KVX_WHY(w)) == KVX_ERR_PEER_GONE) {
        why_set(why, "%s.context_address: %s", what, w);
        return KVX_ERR_PEER_GONE;
    }
    if (!peer_enabled()) {
        why_set(why,
                "%s.context_address: '%s' is another daemon, and transfers "
                "between daemons are off here (peer.listen is empty)",
                what, addr);
        return KVX_ERR_UNSUPPORTED;
    }
    return peer_address_check(addr, why);
}

/* Ask a->addr for the params a names; *id and *conn name the answer. */
static int ask_resolve(const ask_t *a, uint64_t *id, uint64_t *conn,
                       kvx_why_t *why)
{
    peer_conn_t *c = peer_connect(a->addr, why);
    if (!c)
        return KVX_ERR_PEER_GONE;
    Kvxfer__PeerResolve pr = KVXFER__PEER_RESOLVE__INIT;
    pr.id = *id = next_id++;
    pr.instance_id = (char *)a->inst;
    pr.key.data = (uint8_t *)a->key->b;
    pr.key.len = a->key->len;
    pr.consumer_instance = (char *)a->consumer;
    pr.consumer_uid = a->consumer_uid;
    if (a->consumer_key) {
        pr.consumer_key.data = (uint8_t *)a->consumer_key->b;
        pr.consumer_key.len = a->consumer_key->len;
    }
    pr.wait_ms = a->wait_ms;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_RESOLVE;
    m.resolve = &pr;
    if (peer_send(c, &m)) {
        why_set(why, "cannot send to daemon %s", a->addr);
        return KVX_ERR_PEER_GONE;
    }
    *conn = peer_conn_id(c);
    return 0;
}

int keyed_fetch(const xfer_fetch_req_t *rq, const keyed_source_t *src,
                kvx_why_t *why)
{
    instance_t *inst = rq->inst;
    uint32_t rank = rq->rank, nblocks = rq->nblocks, ngs = rq->ngroups;
    uint32_t skip = rq->skip_tokens, dp_rank = rq->dp_rank;
    const reqkey_t *key = rq->key, *ctx_key = src->key;
    const char *ctx_instance = src->instance, *ctx_address = src->address;
    const xfer_group_t *gs = rq->groups;
    char ks[REQKEY_STR_MAX];
    int here, rc, created = 1;
    if ((rc = target_check("fetch_by_key", src, &here, why)))
        return rc;
    kf_t *kf = kf_find(inst->id, key);
    if (!kf &&
        xfer_fetch_ended(inst, rank, key,
                         xfer_source_id(ctx_instance, ctx_key->b, ctx_key->len),
                         &rc, why))
        return rc; /* it ended already: this rank joins that end */
    if (!kf && xfer_fetch_runs(inst, key)) {
        why_set(why, "fetch_by_key.key: request %s is being fetched already",
                kstr(key, ks));
        return KVX_ERR_EXISTS;
    }
    if (kf) {
        if (strcmp(kf->ctx_inst, ctx_instance) ||
            strcmp(kf->ctx_addr, ctx_address) ||
            !reqkey_eq(&kf->ctx_key, ctx_key)) {
            why_set(why,
                    "fetch_by_key: request %s is fetched from another "
                    "context request by another rank",
                    kstr(key, ks));
            return KVX_ERR_MISMATCH;
        }
        if (kf->dp_rank != dp_rank || kf->skip != skip) {
            why_set(why,
                    "fetch_by_key: dp_rank %u, skip_tokens %u differ from "
                    "%u, %u given by another rank",
                    dp_rank, skip, kf->dp_rank, kf->skip);
            return KVX_ERR_MISMATCH;
        }
        if (rank >= kf->nranks || kf->rank[rank].waiting ||
            kf->rank[rank].done) {
            why_set(why, "fetch_by_key: request %s already fetched by rank %u",
                    kstr(key, ks), rank);
            return KVX_ERR_EXISTS;
        }
        if (kf->params) { /* resolved: straight to xfer */
            rc = kf_run(kf, rq, why);
            if (rc && kf->handed)
                kf_free(kf); /* xfer ended it for every rank */
            else if (rc) {   /* the first rank xfer saw refused: one event */
                char m[700];
                snprintf(m, sizeof(m), "fetch_by_key: rank %u: %s", rank,
                         why->msg);
                kf_fail(kf, KVX_EVENT_ERROR, rc, m);
                return 0; /* as across daemons: the event says why */
            } else
                kf_complete(kf);
            return rc;
        }
        created = 0;
    } else {
        if (!(kf = calloc(1, sizeof(*kf))) ||
            !(kf->rank = calloc(inst->nranks, sizeof(*kf->rank)))) {
            free(kf);
            why_set(why, "fetch_by_key: out of memory");
            return KVX_ERR_NOMEM;
        }
        snprintf(kf->inst, sizeof(kf->inst), "%s", inst->id);
        kf->key = *key;
        kf->dp_rank = dp_rank;
        kf->skip = skip;
        snprintf(kf->ctx_inst, sizeof(kf->ctx_inst), "%s", ctx_instance);
        snprintf(kf->ctx_addr, sizeof(kf->ctx_addr), "%s", ctx_address);
        kf->ctx_key = *ctx_key;
        kf->nranks = inst->nranks;
        /* the local ranks of the group: every one fetches */
        uint32_t groups =
            inst->side.attention_dp > 1 ? inst->side.attention_dp : 1;
        for (uint32_t r = 0; r < inst->nranks; r++) {
            plan_side_t e;
            uint32_t er;
            kf->need += inst->local[r] &&
                        (groups == 1 ||
                         plan_dp_view(&inst->side, r, &e, &er) == dp_rank);
        }
        kf->until_ms = kvxd_now_ms() + kvxd.conf.fetch_timeout_ms;
        list_push(&kfs, &kf->node);
    }
    kf_rank_t *a = &kf->rank[rank];
    int nomem = !(a->blocks = malloc(nblocks * sizeof(uint32_t) + 1));
    for (uint32_t k = 0; !nomem && k < ngs && k < XFER_MAX_GROUPS - 1; k++) {
        uint32_t *b = malloc(gs[k].nblocks * sizeof(uint32_t) + 1);
        if (!(nomem = !b)) {
            memcpy(b, gs[k].blocks, gs[k].nblocks * sizeof(uint32_t));
            a->g[k] = gs[k];
            a->g[k].blocks = b;
            pool_ref(gs[k].pool);
            a->ng++;
        }
    }
    if (nomem) {
        kf_rank_drop(a);
        if (created)
            kf_free(kf); /* made just now, nothing else waits */
        why_set(why, "fetch_by_key: out of memory");
        return KVX_ERR_NOMEM;
    }
    memcpy(a->blocks, rq->blocks, nblocks * sizeof(uint32_t));
    a->nblocks = nblocks;
    a->pool = rq->pool;
    pool_ref(rq->pool);
    a->waiting = 1;
    if (kf->res_id || kf->conn)
        return 0; /* asked already */
    if (here) {
        kf_resolve_local(kf);
        return 0;
    }
    char w[256];
    ask_t ask = {.addr = kf->ctx_addr,
                 .inst = kf->ctx_inst,
                 .key = &kf->ctx_key,
                 .consumer = kf->inst,
                 .consumer_key = &kf->key,
                 .consumer_uid = inst->owner_uid,
                 .wait_ms = kvxd.conf.fetch_timeout_ms};
    if ((rc = ask_resolve(&ask, &kf->res_id, &kf->conn, KVX_WHY(w)))) {
        char m[400];
        snprintf(m, sizeof(m), "fetch_by_key: daemon %s: %s", ctx_address, w);
        kf_fail(kf, KVX_EVENT_ERROR, rc, m);
    }
    return 0; /* accepted: the outcome is an event, as across daemons */
}

int keyed_cancel(instance_t *inst, const reqkey_t *key)
{
    kf_t *kf = kf_find(inst->id, key);
    if (!kf || kf->params)
        return 0; /* resolved: xfer has the request */
    kf_fail(kf, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED,
            "cancelled by the generation side");
    return 1;
}

void keyed_end_instance(const instance_t *inst, int code, const char *msg)
{
    list_t *n, *t;
restart:
    LIST_FOREACH_SAFE(n, t, &kfs)
    if (!strcmp(KF(n)->inst, inst->id)) {
        kf_fail(KF(n), KVX_EVENT_ERROR, code, msg);
        goto restart; /* an event may have ended others */
    }
}

uint32_t keyed_pool_users(const pool_t *pool)
{
    uint32_t n = 0;
    list_t *l, *t;
    LIST_FOREACH_SAFE(l, t, &kfs)
    for (uint32_t r = 0; r < KF(l)->nranks; r++)
        n += kf_rank_uses(&KF(l)->rank[r], pool);
    return n;
}

void keyed_end_pool_users(const pool_t *pool, int code, const char *msg)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &kfs)
    {
        kf_t *kf = KF(n);
        for (uint32_t r = 0; r < kf->nranks; r++)
            if (kf_rank_uses(&kf->rank[r], pool)) {
                kf_fail(kf, KVX_EVENT_ERROR, code, msg);
                break;
            }
    }
}

/* ---- release by key ------------------------------------------------------ */

/* The params are known (or the code why not): release, and answer. */
static void krel_finish(krel_t *r, int code, const char *msg,
                        const uint8_t *params, size_t plen)
{
    list_remove(&r->node);
    char why[600];
    int later = 0;
    if (!code)
        code = release_start(params, plen, r->sid, r->req_id, &later,
                             KVX_WHY(why));
    else
        snprintf(why, sizeof(why), "release: daemon %s: %s", r->ctx_addr, msg);
    if (!later)
        kvxd_reply(r->sid, r->req_id, code, code ? why : "");
    free(r);
}

int keyed_release(const keyed_release_req_t *rq, int *later, kvx_why_t *why)
{
    uint64_t sid = rq->sid, req_id = rq->req_id;
    uint32_t uid = rq->uid;
    const char *consumer = rq->consumer;
    const char *ctx_instance = rq->src.instance, *ctx_address = rq->src.address;
    const reqkey_t *ctx_key = rq->src.key;
    *later = 0;
    char ks[REQKEY_STR_MAX];
    int here, rc;
    if ((rc = target_check("release", &rq->src, &here, why)))
        return rc;
    if (here) {
        /* the owner's uid, or a generation rank the instance lets in */
        instance_t *ci = instance_find(ctx_instance);
        if (!ci || (!rq->admin && ci->owner_uid != uid &&
                    !(consumer && instance_allows(ci, consumer, uid)))) {
            why_set(why,
                    "release.context_instance: no instance '%s' of uid %u "
                    "on this daemon",
                    ctx_instance, uid);
            return KVX_ERR_NOT_FOUND;
        }
        uint8_t *p;
        size_t len;
        char w[512];
        rc = xfer_params_for(ci, ctx_key, NULL, &p, &len, KVX_WHY(w));
        if (rc == XFER_NOT_YET)
            rc = KVX_ERR_NOT_FOUND;
        if (rc) {
            why_set(why, "release: request %s: %s", kstr(ctx_key, ks), w);
            return rc == KVX_ERR_EXISTS ? KVX_ERR_STATE : rc;
        }
        rc = release_start(p, len, sid, req_id, later, why);
        free(p);
        return rc;
    }
    if (!consumer) {
        why_set(why,
                "release: rank 0 of instance %s is served by daemon %s; "
                "from another daemon only a generation rank may release "
                "by key (its instance let in by the context instance's "
                "join), else use the params",
                ctx_instance, ctx_address);
        return KVX_ERR_PERM;
    }
    krel_t *r = calloc(1, sizeof(*r));
    if (!r) {
        why_set(why, "release: out of memory");
        return KVX_ERR_NOMEM;
    }
    char w[256];
    ask_t ask = {.addr = ctx_address,
                 .inst = ctx_instance,
                 .key = ctx_key,
                 .consumer = consumer,
                 .consumer_uid = uid, /* the consumer's session is its */
                 .wait_ms = 0 /* now, or not found */};
    if ((rc = ask_resolve(&ask, &r->res_id, &r->conn, KVX_WHY(w)))) {
        free(r);
        why_set(why, "release: daemon %s: %s", ctx_address, w);
        return rc;
    }
    r->sid = sid;
    r->req_id = req_id;
    snprintf(r->ctx_addr, sizeof(r->ctx_addr), "%s", ctx_address);
    r->until_ms = kvxd_now_ms() + kvxd.conf.peer_connect_timeout_ms +
                  kvxd.conf.keepalive_timeout_ms;
    list_push(&krels, &r->node);
    *later = 1;
    return 0;
}

static void on_resolved(peer_conn_t *c, const Kvxfer__PeerMsg *pm)
{
    const Kvxfer__PeerResolved *m = pm->resolved;
    uint64_t id = peer_conn_id(c);
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &krels)
    {
        krel_t *r = KREL(n);
        if (r->res_id != m->id || r->conn != id)
            continue;
        int code = m->code < 0 && m->code >= KVX_ERR_LAST ? m->code
                   : m->code                              ? KVX_ERR_PROTOCOL
                   : !m->context_params.len               ? KVX_ERR_PROTOCOL
                                                          : 0;
        krel_finish(r, code == KVX_ERR_EXISTS ? KVX_ERR_STATE : code,
                    m->message ? m->message : "", m->context_params.data,
                    m->context_params.len);
        return;
    }
    LIST_FOREACH_SAFE(n, t, &kfs)
    {
        kf_t *kf = KF(n);
        if (kf->res_id != m->id || kf->conn != id || kf->params)
            continue;
        if (m->code || !m->context_params.len) {
            char e[700];
            snprintf(e, sizeof(e), "fetch_by_key: daemon %s: %s", kf->ctx_addr,
                     m->message ? m->message : "");
            kf_fail(kf,
                    m->code == KVX_ERR_TIMED_OUT ? KVX_EVENT_TIMED_OUT
                                                 : KVX_EVENT_ERROR,
                    m->code < 0 && m->code >= KVX_ERR_LAST ? m->code
                                                           : KVX_ERR_PROTOCOL,
                    e);
            return;
        }
        uint8_t *p = malloc(m->context_params.len);
        if (!p) {
            kf_fail(kf, KVX_EVENT_ERROR, KVX_ERR_NOMEM,
                    "fetch_by_key: out of memory");
            return;
        }
        memcpy(p, m->context_params.data, m->context_params.len);
        kf_resolved(kf, p, m->context_params.len);
        return;
    }
}

/* ---- context side: the resolves --------------------------------------- */

static void res_answer(uint64_t conn, uint64_t id, int code, const char *msg,
                       const uint8_t *params, size_t plen)
{
    peer_conn_t *c = peer_conn_find(conn);
    if (!c)
        return;
    Kvxfer__PeerResolved a = KVXFER__PEER_RESOLVED__INIT;
    a.id = id;
    a.code = code;
    a.message = (char *)msg;
    a.context_params.data = (uint8_t *)params;
    a.context_params.len = plen;
    Kvxfer__PeerMsg out = KVXFER__PEER_MSG__INIT;
    out.m_case = KVXFER__PEER_MSG__M_RESOLVED;
    out.resolved = &a;
    peer_send(c, &out);
}

/* Answer r if the offer is here: 1 (answered), 0 (keep holding). */
static int res_try(const res_t *r)
{
    instance_t *ci = instance_find(r->inst);
    if (!ci)
        return 0;
    char why[512];
    if (!instance_allows(ci, r->consumer, r->consumer_uid)) {
        snprintf(why, sizeof(why),
                 "instance %s does not let instance %s of uid %u fetch its "
                 "requests by key (kvx_join_consumers)",
                 ci->id, r->consumer, r->consumer_uid);
        res_answer(r->conn, r->id, KVX_ERR_PERM, why, NULL, 0);
        return 1;
    }
    uint8_t *p;
    size_t len;
    /* the generation request may have taken it already from another of
     * its daemons: the same consumer gets the params again */
    xfer_consumer_t who = {r->consumer, r->consumer_key.b, r->consumer_key.len};
    int rc = xfer_params_for(ci, &r->key, r->consumer_key.len ? &who : NULL, &p,
                             &len, KVX_WHY(why));
    if (rc == XFER_NOT_YET)
        return 0;
    res_answer(r->conn, r->id, rc, rc ? why : "", rc ? NULL : p, rc ? 0 : len);
    if (!rc)
        free(p);
    return 1;
}

static void on_resolve(peer_conn_t *c, const Kvxfer__PeerMsg *pm)
{
    const Kvxfer__PeerResolve *m = pm->resolve;
    uint64_t conn = peer_conn_id(c);
    res_t q = {.conn = conn, .id = m->id, .consumer_uid = m->consumer_uid};
    char why[256];
    if (!m->instance_id || !m->instance_id[0] ||
        strlen(m->instance_id) > INSTANCE_ID_MAX || !m->consumer_instance ||
        strlen(m->consumer_instance) > INSTANCE_ID_MAX ||
        reqkey_set(&q.key, m->key.data, m->key.len, "resolve.key",
                   KVX_WHY(why)) ||
        (m->consumer_key.len &&
         reqkey_set(&q.consumer_key, m->consumer_key.data, m->consumer_key.len,
                    "resolve.consumer_key", KVX_WHY(why)))) {
        res_answer(conn, m->id, KVX_ERR_INVALID,
                   "resolve: instance, consumer or key missing or too long",
                   NULL, 0);
        return;
    }
    snprintf(q.inst, sizeof(q.inst), "%s", m->instance_id);
    snprintf(q.consumer, sizeof(q.consumer), "%s", m->consumer_instance);
    if (res_try(&q))
        return;
    if (!m->wait_ms) { /* a release: now or not at all */
        char e[600], ks[REQKEY_STR_MAX];
        snprintf(e, sizeof(e),
                 "no offer of request %s of instance %s on daemon %s",
                 kstr(&q.key, ks), m->instance_id, kvxd.address);
        res_answer(conn, m->id, KVX_ERR_NOT_FOUND, e, NULL, 0);
        return;
    }
    res_t *r = nheld < RES_MAX ? calloc(1, sizeof(*r)) : NULL;
    if (!r) {
        res_answer(conn, m->id, KVX_ERR_LIMIT,
                   "resolve: too many fetches by key wait on this daemon", NULL,
                   0);
        return;
    }
    *r = q;
    r->until_ms =
        kvxd_now_ms() + (m->wait_ms < RES_WAIT_MAX ? m->wait_ms : RES_WAIT_MAX);
    list_push(&held, &r->node);
    nheld++;
}

static void res_free(res_t *r)
{
    list_remove(&r->node);
    nheld--;
    free(r);
}

/* Offers made since the last turn: their waiters are answered. */
static void retry_made(void *arg)
{
    (void)arg;
    retry_queued = 0;
    while (!list_empty(&mades)) {
        made_t *md = MADE(list_pop(&mades));
        list_t *n, *t;
        LIST_FOREACH_SAFE(n, t, &held)
        {
            res_t *r = RES(n);
            if (!strcmp(r->inst, md->inst) && reqkey_eq(&r->key, &md->key) &&
                res_try(r))
                res_free(r);
        }
        LIST_FOREACH_SAFE(n, t, &kfs)
        {
            kf_t *kf = KF(n);
            if (!kf->params && !kf->conn && !kf->res_id &&
                !strcmp(kf->ctx_inst, md->inst) &&
                reqkey_eq(&kf->ctx_key, &md->key)) {
                /* kf_resolve_local may free kf and others it ends: start
                 * over from the head after it acted */
                if (kf_resolve_local(kf))
                    t = kfs.next;
            }
        }
        free(md);
    }
}

static void offer_made(instance_t *inst, const reqkey_t *key)
{
    if (list_empty(&held) && list_empty(&kfs))
        return; /* nobody waits: the common case costs nothing */
    made_t *md = calloc(1, sizeof(*md));
    if (!md)
        return; /* the waiters' deadlines still end them */
    snprintf(md->inst, sizeof(md->inst), "%s", inst->id);
    md->key = *key;
    list_push(&mades, &md->node);
    if (!retry_queued && !kvxd_defer(retry_made, NULL))
        retry_queued = 1;
}

static int on_lost(peer_conn_t *c, int code, const char *msg)
{
    (void)code;
    uint64_t id = peer_conn_id(c);
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &held)
    if (RES(n)->conn == id)
        res_free(RES(n));
    LIST_FOREACH_SAFE(n, t, &krels)
    if (KREL(n)->conn == id)
        krel_finish(KREL(n), KVX_ERR_PEER_GONE, msg, NULL, 0);
restart:
    LIST_FOREACH_SAFE(n, t, &kfs)
    {
        kf_t *kf = KF(n);
        if (kf->conn == id && !kf->params) {
            char e[600];
            snprintf(e, sizeof(e), "fetch_by_key: %s", msg);
            kf_fail(kf, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, e);
            goto restart; /* an event may have ended others */
        }
    }
    return 0;
}

void keyed_tick(uint64_t now)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &krels)
    if (now >= KREL(n)->until_ms)
        krel_finish(KREL(n), KVX_ERR_TIMED_OUT, "did not answer in time", NULL,
                    0);
    LIST_FOREACH_SAFE(n, t, &held)
    {
        res_t *r = RES(n);
        if (now < r->until_ms)
            continue;
        char e[600], ks[REQKEY_STR_MAX];
        snprintf(e, sizeof(e),
                 "no offer of request %s of instance %s was published or "
                 "reserved on daemon %s in time",
                 kstr(&r->key, ks), r->inst, kvxd.address);
        res_answer(r->conn, r->id, KVX_ERR_TIMED_OUT, e, NULL, 0);
        res_free(r);
    }
restart:
    LIST_FOREACH_SAFE(n, t, &kfs)
    {
        kf_t *kf = KF(n);
        if (now < kf->until_ms)
            continue;
        if (kf->params) { /* resolved; xfer's fetch timeout has the rest */
            kf_free(kf);
            continue;
        }
        char e[700], ks[REQKEY_STR_MAX];
        snprintf(e, sizeof(e),
                 "fetch_by_key: no offer of request %s of instance %s "
                 "(daemon %s) was published or reserved within "
                 "deadlines.fetch_timeout_ms (%u ms)",
                 kstr(&kf->ctx_key, ks), kf->ctx_inst, kf->ctx_addr,
                 kvxd.conf.fetch_timeout_ms);
        kf_fail(kf, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, e);
        goto restart;
    }
}

void keyed_init(void)
{
    xfer_set_offer_made(offer_made);
    peer_on_msg(KVXFER__PEER_MSG__M_RESOLVE, on_resolve);
    peer_on_msg(KVXFER__PEER_MSG__M_RESOLVED, on_resolved);
    peer_on_lost(on_lost);
}

void keyed_cleanup(void)
{
    while (!list_empty(&kfs))
        kf_free(KF(kfs.next));
    while (!list_empty(&held))
        res_free(RES(held.next));
    while (!list_empty(&mades))
        free(MADE(list_pop(&mades)));
    while (!list_empty(&krels))
        free(KREL(list_pop(&krels)));
}
