/*
 * release — releases and renewals across daemons; see release.h.
 *
 * Reading order:
 *   fan_start()       the params decoded, this daemon's offer released
 *                     (renewed), one PeerRelease (PeerRenew) to each
 *                     other daemon of the ranks
 *   on_release()      a daemon asked: xfer_release() (xfer_renew()),
 *                     PeerReleased (PeerRenewed) back
 *   on_released()     an answer; the reply once every daemon answered
 *   on_lost/tick      a daemon lost, silent past the deadline, or too old
 *                     to renew
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/list.h"
#include "core/daemon.h"
#include "core/log.h"
#include "net/peer.h"
#include "release.h"
#include "xfer/xfer.h"

#define TARGETS_MAX 64 /* daemons of one instance's ranks */

/* The offer a fan-out acts on, as the params (or a PeerRelease) name
 * it. */
typedef struct fan_req {
    const char *instance_id;
    const reqkey_t *key;
    const uint8_t *token;
    size_t token_len;
    uint32_t lease_ms; /* renew: the params' lease */
} fan_req_t;

static int do_release(const fan_req_t *q, kvx_why_t *why)
{
    return xfer_release(q->instance_id, q->key, q->token, q->token_len, why);
}

static int do_renew(const fan_req_t *q, kvx_why_t *why)
{
    return xfer_renew(q->instance_id, q->key, q->token, q->token_len,
                      q->lease_ms, why);
}

/* What a fan-out does: a release or a renewal. */
typedef struct fan_op {
    const char *name; /* "release", "renew": its messages start so */
    int ask, answer;  /* its PeerMsg cases */
    uint32_t minor;   /* the peer's protocol minor it needs */
    int (*local)(const fan_req_t *q, kvx_why_t *why);
} fan_op_t;

static const fan_op_t RELEASE = {"release", KVXFER__PEER_MSG__M_RELEASE,
                                 KVXFER__PEER_MSG__M_RELEASED, 0, do_release};
static const fan_op_t RENEW = {"renew", KVXFER__PEER_MSG__M_RENEW,
                               KVXFER__PEER_MSG__M_RENEWED, 6, do_renew};

typedef struct rel {
    list_t node;
    const fan_op_t *op;
    uint64_t id, sid, req_id, until_ms;
    unsigned ntargets, pending;
    uint64_t conn[TARGETS_MAX]; /* 0 once it answered */
    char addr[TARGETS_MAX][192];
    int code;      /* the first error, 0 */
    char msg[512]; /* its message */
} rel_t;

#define REL(n) LIST_OWNER(n, rel_t, node)

static list_t rels = {&rels, &rels};
static uint64_t next_id = 1;

static void rel_note(rel_t *r, int code, const char *msg)
{
    if (code && !r->code) {
        r->code = code;
        snprintf(r->msg, sizeof(r->msg), "%s", msg);
    }
}

static void rel_finish(rel_t *r)
{
    list_remove(&r->node);
    kvxd_reply(r->sid, r->req_id, r->code, r->code ? r->msg : "");
    free(r);
}

/* Target i is done (answered, lost or late). */
static void rel_target_done(rel_t *r, unsigned i, int code, const char *msg)
{
    assert(r->conn[i] && r->pending > 0);
    r->conn[i] = 0;
    rel_note(r, code, msg);
    if (--r->pending == 0)
        rel_finish(r);
}

/* Target i's daemon (connection c, ready or not) cannot answer op: 0, or
 * KVX_ERR_UNSUPPORTED with msg. */
static int fan_too_old(const rel_t *r, const peer_conn_t *c, unsigned i,
                       char *msg, size_t n)
{
    int minor = peer_conn_minor(c);
    if (minor < 0 || (uint32_t)minor >= r->op->minor)
        return 0;
    snprintf(msg, n,
             "%s: daemon %s speaks a protocol before 2.%u, which does not "
             "renew leases",
             r->op->name, r->addr[i], r->op->minor);
    return KVX_ERR_UNSUPPORTED;
}

static int fan_start(const fan_op_t *op, const uint8_t *params, size_t len,
                     uint64_t sid, uint64_t req_id, int *later, kvx_why_t *why)
{
    Kvxfer__ContextParams *cp;
    *later = 0;
    int rc = xfer_params_decode(params, len, &cp, why);
    if (rc)
        return rc;
    /* the daemons of the ranks, each once */
    const char *addrs[TARGETS_MAX];
    unsigned n = 0;
    int here = 0;
    for (size_t i = 0; i < cp->n_rank_addresses; i++) {
        const char *a = cp->rank_addresses[i];
        if (!strcmp(a, kvxd.address)) {
            here = 1;
            continue;
        }
        unsigned k = 0;
        while (k < n && strcmp(addrs[k], a))
            k++;
        if (k < n)
            continue;
        if (n == TARGETS_MAX) {
            why_set(why,
                    "%s: the params name over %d daemons; at most %d are "
                    "reached at once",
                    op->name, TARGETS_MAX, TARGETS_MAX);
            rc = KVX_ERR_LIMIT;
            goto out;
        }
        addrs[n++] = a;
    }
    if (n && !peer_enabled()) {
        why_set(why,
                "%s: context ranks are served by daemon %s, and "
                "transfers between daemons are off here (peer.listen is "
                "empty)",
                op->name, addrs[0]);
        rc = KVX_ERR_UNSUPPORTED;
        goto out;
    }
    /* every address is checked before anything is released */
    for (unsigned k = 0; k < n; k++)
        if ((rc = peer_address_check(addrs[k], why)))
            goto out;
    reqkey_t key = {.len = (uint32_t)cp->key.len};
    memcpy(key.b, cp->key.data, cp->key.len); /* checked by the decode */
    fan_req_t q = {cp->instance_id, &key, cp->token.data, cp->token.len,
                   cp->lease_ms};
    if (here && (rc = op->local(&q, why)))
        goto out;
    if (!n)
        goto out; /* rc 0: answered now */
    rel_t *r = calloc(1, sizeof(*r));
    if (!r) {
        why_set(why, "%s: out of memory", op->name);
        rc = KVX_ERR_NOMEM;
        goto out;
    }
    r->id = next_id++;
    r->op = op;
    r->sid = sid;
    r->req_id = req_id;
    r->until_ms = kvxd_now_ms() + kvxd.conf.peer_connect_timeout_ms +
                  kvxd.conf.keepalive_timeout_ms;
    list_push(&rels, &r->node);
    Kvxfer__PeerRelease pr = KVXFER__PEER_RELEASE__INIT;
    pr.instance_id = cp->instance_id;
    pr.request_id = xfer_key_id(cp->key.data, cp->key.len);
    pr.key = cp->key;
    pr.token = cp->token;
    pr.id = r->id;
    pr.lease_ms = cp->lease_ms;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = (Kvxfer__PeerMsg__MCase)op->ask;
    m.release = &pr; /* the one member of the oneof: renew too */
    for (unsigned k = 0; k < n; k++) {
        char w[256], e[512];
        snprintf(r->addr[k], sizeof(r->addr[k]), "%s", addrs[k]);
        peer_conn_t *c = peer_connect(addrs[k], KVX_WHY(w));
        int old = c ? fan_too_old(r, c, k, e, sizeof(e)) : 0;
        if (old) {
            rel_note(r, old, e);
            continue;
        }
        if (!c || peer_send(c, &m)) {
            snprintf(e, sizeof(e), "%s: daemon %s: %s", op->name, addrs[k],
                     c ? "cannot send" : w);
            rel_note(r, KVX_ERR_PEER_GONE, e);
            continue;
        }
        r->conn[k] = peer_conn_id(c);
        r->pending++;
    }
    r->ntargets = n;
    if (!r->pending) { /* nothing went out: answer now */
        rc = r->code;
        why_set(why, "%s", r->msg);
        list_remove(&r->node);
        free(r);
        goto out;
    }
    *later = 1;
    kvxfer__context_params__free_unpacked(cp, NULL);
    return 0;
out:
    kvxfer__context_params__free_unpacked(cp, NULL);
    return rc;
}

int release_start(const uint8_t *params, size_t len, uint64_t sid,
                  uint64_t req_id, int *later, kvx_why_t *why)
{
    return fan_start(&RELEASE, params, len, sid, req_id, later, why);
}

int renew_start(const uint8_t *params, size_t len, uint64_t sid,
                uint64_t req_id, int *later, kvx_why_t *why)
{
    return fan_start(&RENEW, params, len, sid, req_id, later, why);
}

/* A daemon asks op of an offer here; the answer goes back. */
static void on_ask(const fan_op_t *op, peer_conn_t *c,
                   const Kvxfer__PeerRelease *m)
{
    char why[512] = "", field[32];
    reqkey_t key;
    snprintf(field, sizeof(field), "%s.key", op->name);
    int rc = reqkey_set(&key, m->key.data, m->key.len, field, KVX_WHY(why));
    fan_req_t q = {m->instance_id ? m->instance_id : "", &key, m->token.data,
                   m->token.len, m->lease_ms};
    if (!rc)
        rc = op->local(&q, KVX_WHY(why));
    Kvxfer__PeerReleased a = KVXFER__PEER_RELEASED__INIT;
    a.id = m->id;
    a.code = rc;
    a.message = why;
    Kvxfer__PeerMsg out = KVXFER__PEER_MSG__INIT;
    out.m_case = (Kvxfer__PeerMsg__MCase)op->answer;
    out.released = &a; /* the one member of the oneof: renewed too */
    peer_send(c, &out);
}

static void on_release(peer_conn_t *c, const Kvxfer__PeerMsg *pm)
{
    on_ask(&RELEASE, c, pm->release);
}

static void on_renew(peer_conn_t *c, const Kvxfer__PeerMsg *pm)
{
    on_ask(&RENEW, c, pm->renew);
}

/* An answer: ids are shared by releases and renewals, so the op must
 * match too. */
static void on_answer(const fan_op_t *op, peer_conn_t *c,
                      const Kvxfer__PeerReleased *m)
{
    uint64_t id = peer_conn_id(c);
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &rels)
    {
        rel_t *r = REL(n);
        if (r->id != m->id || r->op != op)
            continue;
        for (unsigned i = 0; i < r->ntargets; i++)
            if (r->conn[i] == id) { /* only the daemon asked answers */
                rel_target_done(r, i, m->code, m->message ? m->message : "");
                return;
            }
        return;
    }
}

static void on_released(peer_conn_t *c, const Kvxfer__PeerMsg *pm)
{
    on_answer(&RELEASE, c, pm->released);
}

static void on_renewed(peer_conn_t *c, const Kvxfer__PeerMsg *pm)
{
    on_answer(&RENEW, c, pm->renewed);
}

static int on_lost(peer_conn_t *c, int code, const char *msg)
{
    (void)code;
    uint64_t id = peer_conn_id(c);
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &rels)
    {
        rel_t *r = REL(n);
        for (unsigned i = 0; i < r->ntargets; i++)
            if (r->conn[i] == id) {
                char e[600];
                snprintf(e, sizeof(e), "%s: %s", r->op->name, msg);
                rel_target_done(r, i, KVX_ERR_PEER_GONE, e);
                break; /* r may be gone */
            }
    }
    return 0;
}

void release_tick(uint64_t now)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &rels)
    {
        rel_t *r = REL(n);
        /* a daemon before 2.6, known once its handshake is over, never
         * answers a renewal: it fails now, not at the deadline */
        int gone = 0;
        for (unsigned i = 0; now < r->until_ms && i < r->ntargets; i++) {
            peer_conn_t *c = r->conn[i] ? peer_conn_find(r->conn[i]) : NULL;
            char e[512];
            int old = c ? fan_too_old(r, c, i, e, sizeof(e)) : 0;
            if (old) {
                gone = r->pending == 1;
                rel_target_done(r, i, old, e);
                if (gone)
                    break; /* r is freed */
            }
        }
        if (gone || now < r->until_ms)
            continue;
        for (unsigned i = 0; i < r->ntargets; i++)
            if (r->conn[i]) {
                char e[300];
                snprintf(e, sizeof(e), "%s: daemon %s did not answer in time",
                         r->op->name, r->addr[i]);
                rel_note(r, KVX_ERR_TIMED_OUT, e);
                r->conn[i] = 0;
                r->pending--;
            }
        rel_finish(r);
    }
}

void release_init(void)
{
    peer_on_msg(KVXFER__PEER_MSG__M_RELEASE, on_release);
    peer_on_msg(KVXFER__PEER_MSG__M_RELEASED, on_released);
    peer_on_msg(KVXFER__PEER_MSG__M_RENEW, on_renew);
    peer_on_msg(KVXFER__PEER_MSG__M_RENEWED, on_renewed);
    peer_on_lost(on_lost);
}

void release_cleanup(void)
{
    while (!list_empty(&rels)) {
        rel_t *r = REL(list_first(&rels));
        list_remove(&r->node);
        free(r);
    }
}
