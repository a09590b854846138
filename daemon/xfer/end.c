/*
 * end — the end of a request: an offer consumed, ended or finalized, a
 * genreq ended after its fence (the terminal event), cancel, the end of
 * every request of an instance or a pool, and the deadlines.
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
#include "core/records.h"
#include "core/rrq.h"
#include "net/peer.h"
#include "xfer.h"
#include "xfer_int.h"
#include "xfer_remote.h"

/* ---- the end of a request --------------------------------------------- */

/* A request's end in the log, with the fields it is about (log.h): at
 * info when it failed or timed out (what an operator looks for by
 * INSTANCE= and KEY=), at debug when it completed or was cancelled (the
 * engine asked for that). */
static void end_log(const char *what, const instance_t *inst,
                    const reqkey_t *key, int kind, int code, const char *msg)
{
    int prio = kind == KVX_EVENT_COMPLETE || kind == KVX_EVENT_CANCELLED
                   ? LOG_DEBUG
                   : LOG_INFO;
    char kb[REQKEY_STR_MAX];
    log_f(prio,
          &(log_fields_t){.instance = inst->id,
                          .key = reqkey_str(key->b, key->len, kb),
                          .code = code},
          "%s %s/%s ended: %s", what, inst->id, kb,
          kind == KVX_EVENT_COMPLETE ? "complete" : msg);
}

/* The record of a fetch that ends (core/records.h): the generation
 * side, where its bytes landed. Its local offer learns what it served. */
static void genreq_record(const genreq_t *g)
{
    reqrec_t r = {0};
    snprintf(r.instance, sizeof(r.instance), "%s", g->inst->id);
    r.side = "generation";
    snprintf(r.context, sizeof(r.context), "%s", g->src_instance);
    snprintf(r.generation, sizeof(r.generation), "%s", g->inst->id);
    memcpy(r.key, g->key.b, g->key.len);
    r.key_len = g->key.len;
    r.path = g->remote ? "peer" : "host";
    for (size_t i = 0; !g->remote && i < GPARTS(g); i++)
        if (g->parts[i].pool && g->parts[i].pool->gpu)
            r.path = "gpu";
    r.bytes = g->bytes_done;
    r.start_us = g->start_us;
    r.end_us = wall_us();
    r.outcome = g->end_kind;
    r.code = g->end_code;
    r.uid = g->inst->owner_uid;
    records_add(&r);
    if (g->offer) {
        g->offer->served += g->bytes_done;
        g->offer->path = r.path;
        snprintf(g->offer->consumer_id, sizeof(g->offer->consumer_id), "%s",
                 g->inst->id);
    }
}

/* The record of an offer that ends (its event goes out): the context
 * side, what its consumers read. */
static void offer_record(const offer_t *o, int kind, int code)
{
    reqrec_t r = {0};
    snprintf(r.instance, sizeof(r.instance), "%s", o->inst->id);
    r.side = "context";
    snprintf(r.context, sizeof(r.context), "%s", o->inst->id);
    snprintf(r.generation, sizeof(r.generation), "%s", o->consumer_id);
    memcpy(r.key, o->key.b, o->key.len);
    r.key_len = o->key.len;
    r.path = o->path;
    r.bytes = o->served;
    r.start_us = o->start_us;
    r.end_us = wall_us();
    r.outcome = kind;
    r.code = code;
    r.uid = o->inst->owner_uid;
    records_add(&r);
}

/* Forget a consumed offer (all ranks published, lease over, cancel). */
void offer_drop(offer_t *o)
{
    if (o->consumed) /* complete, kept for late ranks until now */
        done_add(o->inst, &o->key);
    dl_remove(&o->lease);
    map_del(&o->inst->offers, o->request_id);
    offer_free(o);
}

/* The consumer took everything it needed while some ranks have not
 * published yet (replicated heads): complete now, release the memory,
 * keep the params for the late ranks until they publish or the lease
 * ends. */
void offer_consume(offer_t *o, const char *msg)
{
    instance_t *inst = o->inst;
    xfer_push_event(inst, o->request_id, &o->key,
                    &(batch_end_t){KVX_EVENT_COMPLETE, 0, msg, NULL, 0}, 1,
                    inst->nlocal, inst->nranks);
    offer_record(o, KVX_EVENT_COMPLETE, 0);
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
    xfer_nrequests--;
    if (!list_linked(&o->lease.node))
        dl_insert(&xfer_leases, &o->lease, kvxd_now_ms() + o->lease_ms);
    list_t w;
    list_init(&w);
    list_move_all(&o->waiters, &w);
    waiters_reply(&w);
}

void xfer_count_end(int side, int kind, int code)
{
    if (kind > 0 && kind < KVXD_ENDS)
        kvxd.stats.ended[side][kind]++;
    if (kind == KVX_EVENT_ERROR && code < 0 && -code < 32)
        kvxd.stats.end_codes[side][-code]++;
}

/* A fetch's end in the metrics: its outcome, and a COMPLETE one's
 * duration, size, path and (a local layer-wise offer's) exposed time. */
static void count_fetch_end(const genreq_t *g)
{
    xfer_count_end(KVXD_SIDE_FETCH, g->end_kind, g->end_code);
    if (g->end_kind != KVX_EVENT_COMPLETE)
        return;
    uint64_t now = mono_ns();
    hist_add(&kvxd.stats.fetch_seconds, kvxd_secs_bounds, KVXD_SECS_N,
             (double)(now - g->t0_ns) / 1e9);
    hist_add(&kvxd.stats.fetch_bytes, kvxd_bytes_bounds, KVXD_BYTES_N,
             (double)g->bytes_done);
    int path = g->remote ? KVXD_PATH_PEER + 1 : 0;
    for (size_t r = 0; !path && r < GPARTS(g); r++)
        path = g->parts[r].path; /* a part that moved bytes knows it */
    kvxd.stats.fetches_done[path ? path - 1 : KVXD_PATH_HOST]++;
    const offer_t *o = g->offer;
    if (o && o->lw_all_ns && now >= o->lw_all_ns)
        hist_add(&kvxd.stats.exposed_seconds, kvxd_secs_bounds, KVXD_SECS_N,
                 (double)(now - o->lw_all_ns) / 1e9);
}

void offer_try_finalize(offer_t *o)
{
    if (!o->ending || o->consumer || o->gathers)
        return; /* the consumer's fence, or our gathers', comes first */
    instance_t *inst = o->inst;
    xfer_count_end(KVXD_SIDE_OFFER, o->end_kind, o->end_code);
    xfer_push_event(
        inst, o->request_id, &o->key,
        &(batch_end_t){o->end_kind, o->end_code, o->end_msg, NULL, 0}, 1,
        inst->nlocal, inst->nranks);
    offer_record(o, o->end_kind, o->end_code);
    if (o->end_kind == KVX_EVENT_CANCELLED)
        gone_add(1, inst, o->request_id, &o->key, 0);
    else if (o->end_kind == KVX_EVENT_COMPLETE)
        done_add(inst, &o->key);
    else /* an error: an earlier offer of the key's completion is past */
        done_forget(inst, &o->key);
    map_del(&inst->offers, o->request_id);
    xfer_nrequests--;
    end_log("offer", inst, &o->key, o->end_kind, o->end_code, o->end_msg);
    list_t w;
    list_init(&w);
    list_move_all(&o->waiters, &w);
    offer_free(o);
    waiters_reply(&w);
}

void offer_end(offer_t *o, int kind, int code, const char *msg)
{
    if (o->ending)
        return;
    o->ending = 1;
    dl_remove(&o->lease);
    o->end_kind = kind;
    o->end_code = code;
    snprintf(o->end_msg, sizeof(o->end_msg), "%s", msg);
    if (xfer_rops.offer_stop)
        xfer_rops.offer_stop(o, code ? code : KVX_ERR_STATE, msg);
    if (o->consumer) {
        /* the consumer reads this offer's memory: its fence comes first,
         * and its finalize (now or after its last chunk) finalizes o */
        char m[300];
        snprintf(m, sizeof(m), "context side: %s", msg);
        genreq_end(o->consumer, KVX_EVENT_ERROR, code ? code : KVX_ERR_STATE,
                   m);
        return;
    }
    offer_try_finalize(o);
}

void genreq_end(genreq_t *g, int kind, int code, const char *msg)
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
            rrq_remove(&xfer_runq, &g->parts[r].turn);
            if (xfer_rops.part_stop)
                xfer_rops.part_stop(&g->parts[r], code ? code : KVX_ERR_STATE,
                                    msg);
        }
        assert(g->inflight > 0 /* the fence */);
        g->inflight--;
        copy_drop_aborted(); /* its chunks a pace holds: unrun */
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
    batch_end_t e = {g->end_kind, g->end_code, g->end_msg,
                     !done ? NULL
                     : ao  ? ao->aux
                           : g->aux,
                     !done ? 0
                     : ao  ? ao->aux_len
                           : g->aux_len};
    xfer_push_event(inst, g->request_id, &g->key, &e, 0, g->need,
                    inst->nranks / (inst->side.attention_dp > 1
                                        ? inst->side.attention_dp
                                        : 1));
    if (g->end_kind == KVX_EVENT_COMPLETE)
        kvxd.stats.transfers_done++;
    count_fetch_end(g);
    if (kvxd.trace)
        xfer_trace_write(g);
    genreq_record(g);
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
    xfer_nrequests--;
    end_log("fetch", inst, &g->key, g->end_kind, g->end_code, g->end_msg);
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

/* ---- cancel, cleanup, deadlines --------------------------------------- */

int xfer_cancel(instance_t *inst, const reqkey_t *key, uint64_t sid,
                uint64_t req_id, kvx_why_t *why)
{
    uint64_t request_id = xfer_key_id(key->b, key->len);
    offer_t *o = map_get(&inst->offers, request_id);
    genreq_t *g = map_get(&inst->fetches, request_id);
    if (o && !reqkey_eq(&o->key, key))
        o = NULL; /* another key's (its id collides): not this one */
    if (g && !reqkey_eq(&g->key, key))
        g = NULL;
    if (!o && !g)
        return why_fail(why, KVX_ERR_NOT_FOUND,
                        "cancel.key: no request %s in flight in instance %s",
                        ks(key), inst->id);
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
        return why_fail(why, KVX_ERR_NOMEM, "cancel: out of memory");
    cw->sid = sid;
    cw->req_id = req_id;
    cw->pending = 1; /* held by this function until both ends are called */
    if (o && waiter_add(&o->waiters, cw)) {
        free(cw);
        return why_fail(why, KVX_ERR_NOMEM, "cancel: out of memory");
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
        return why_fail(why, KVX_ERR_NOMEM, "cancel: out of memory");
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
    uint32_t n =
        inst->offers.n > inst->fetches.n ? inst->offers.n : inst->fetches.n;
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
    while ((n = list_first(&xfer_leases)) && DL_NODE(n)->deadline_ms <= now) {
        offer_t *o = LIST_OWNER(n, offer_t, lease.node);
        if (o->consumed) { /* late ranks never came: forget it quietly */
            offer_drop(o);
            continue;
        }
        char m[192];
        uint32_t done = 0, expect = xfer_rops.offer_streams
                                        ? xfer_rops.offer_streams(o, &done)
                                        : 0;
        if (expect) /* taken through a peer: the backstop */
            snprintf(m, sizeof(m),
                     "taken by a peer daemon that did not finish within "
                     "its lease + fetch_timeout_ms (%u ms; %u of %u "
                     "streams done)",
                     o->lease_ms + kvxd.conf.fetch_timeout_ms, done, expect);
        else
            snprintf(m, sizeof(m),
                     "offer lease of %u ms expired (%u of %u ranks "
                     "published)",
                     o->lease_ms, o->npublished, o->inst->nlocal);
        offer_end(o, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, m);
    }
    while ((n = list_first(&xfer_timeouts)) && DL_NODE(n)->deadline_ms <= now) {
        genreq_t *g = LIST_OWNER(n, genreq_t, timeout.node);
        char m[160];
        snprintf(m, sizeof(m),
                 "fetch timeout of %u ms expired (%u of %u ranks fetched, "
                 "%u done)",
                 kvxd.conf.fetch_timeout_ms, g->nfetched, g->need, g->ndone);
        genreq_end(g, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, m);
    }
    while ((n = list_first(&xfer_gones)) && DL_NODE(n)->deadline_ms <= now)
        gone_free(LIST_OWNER(n, gone_t, dl.node));
}

uint32_t xfer_count(void)
{
    return xfer_nrequests;
}
