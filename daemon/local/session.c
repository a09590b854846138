/*
 * session — one client connection and the protocol edge; see session.h.
 * This file is the edge: one handler per request, and the replies;
 * session_pool.c holds the handlers of RegisterPool and DeregisterPool;
 * session_conn.c moves the bytes and keeps the sessions.
 *
 * Reading order: on_io() (session_conn.c) reads bytes and fds ->
 * session_handle_frame() decodes a Request -> one handler per message
 * (here, or session_pool.c's for pools) validates every field and calls
 * the module that acts -> reply() packs the Reply into the output buffer
 * -> session_flush() (session_conn.c) writes what the socket takes, the
 * rest when it is writable.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agree/agree.h"
#include "common/frame.h"
#include "common/layout.h"
#include "copy/copy.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "core/fault.h"
#include "core/log.h"
#include "core/map.h"
#include "core/records.h"
#include "metrics.h"
#include "pacing.h"
#include "remote/keyed.h"
#include "remote/release.h"
#include "session_int.h"
#include "stats.h"
#include "xfer/instance.h"
#include "xfer/xfer.h"

/* ---- output ----------------------------------------------------------- */

static void reply(session_t *s, uint64_t req_id, int status,
                  const char *message);

/* Replies go out once per loop iteration and session, not once each: a
 * client that sends many requests in one write (a window of fetches, a
 * rank's poll and publish) gets their replies in one send, one wake-up.
 * Sessions with replies queued wait on flushq until the check phase of
 * the iteration that queued them (or the idle phase of the next, for
 * replies queued after it: the idle handle also keeps the loop from
 * blocking first). */
static list_t flushq = {&flushq, &flushq};
static uv_check_t flush_check;
static uv_idle_t flush_idle;

static void flush_all(void)
{
    list_t *n;
    uv_idle_stop(&flush_idle);
    while ((n = list_pop(&flushq)))
        session_flush(LIST_OWNER(n, session_t, flush_node));
}

static void on_flush_check(uv_check_t *h)
{
    (void)h;
    if (!list_empty(&flushq))
        flush_all();
}

static void on_flush_idle(uv_idle_t *h)
{
    (void)h;
    flush_all();
}

static void flush_later(session_t *s)
{
    if (list_linked(&s->flush_node))
        return;
    list_push(&flushq, &s->flush_node);
    uv_idle_start(&flush_idle, on_flush_idle);
}

static void reply_packed(session_t *s, const Kvxfer__Reply *r)
{
    if (s->closing || s->close_why)
        return;
    size_t n = kvxfer__reply__get_packed_size(r);
    if (s->out_len - s->out_off + n + FRAME_HDR > OUT_MAX) {
        log_warn("session %llu (pid %d uid %u): client not reading its "
                 "replies: %zu bytes queued; dropping it",
                 (unsigned long long)s->id, (int)s->pid, (unsigned)s->uid,
                 queued(s));
        session_close_later(s, "client not reading its replies");
        return;
    }
    if (s->out_cap - s->out_len < n + FRAME_HDR) {
        if (s->out_off) {
            memmove(s->out, s->out + s->out_off, s->out_len - s->out_off);
            s->out_len -= s->out_off;
            s->out_off = 0;
        }
        size_t ncap = s->out_cap ? s->out_cap : 4096;
        while (ncap - s->out_len < n + FRAME_HDR)
            ncap *= 2;
        if (ncap > s->mem_out &&
            kvxd_mem_charge_uid(MEM_REPLIES, s->uid, ncap - s->mem_out)) {
            if (r->status == 0 && n > 4096) {
                /* this reply is refused, not the session */
                char m[256], w[200];
                kvxd_mem_why(s->uid, ncap - s->mem_out, w, sizeof(w));
                snprintf(m, sizeof(m), "a %zu-byte reply %s", n, w);
                reply(s, r->id, KVX_ERR_LIMIT, m);
                return;
            }
            /* a small reply always goes: the budget's headroom */
            kvxd_mem_force_uid(MEM_REPLIES, s->uid, ncap - s->mem_out);
        }
        if (ncap > s->mem_out)
            s->mem_out = ncap;
        uint8_t *nb = realloc(s->out, ncap);
        if (!nb) {
            session_close_later(s, "out of memory for replies");
            return;
        }
        s->out = nb;
        s->out_cap = ncap;
    }
    if (s->out_len == s->out_off)
        s->last_tx_ms = kvxd_now_ms(); /* the stall clock starts now */
    frame_put_len(s->out + s->out_len, (uint32_t)n);
    kvxfer__reply__pack(r, s->out + s->out_len + FRAME_HDR);
    s->out_len += n + FRAME_HDR;
    s->out_total += n + FRAME_HDR;
    if (s->awaiting)
        s->awaiting--;
    flush_later(s);
}

static void reply(session_t *s, uint64_t req_id, int status,
                  const char *message)
{
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = req_id;
    r.status = status;
    r.message = (char *)(message ? message : "");
    if (status)
        kvxd_count_error(status);
    reply_packed(s, &r);
}

void session_reply(uint64_t sid, uint64_t req_id, int status,
                   const char *message)
{
    session_t *s = map_get(&sessions, sid);
    if (s)
        reply(s, req_id, status, message);
}

void session_reply_msg(uint64_t sid, Kvxfer__Reply *r)
{
    session_t *s = map_get(&sessions, sid);
    if (s)
        reply_packed(s, r);
}

/* ---- validation helpers ----------------------------------------------- */

/* Block ids inside the pool and not repeated. */
static int check_blocks(const pool_t *p, const uint32_t *b, size_t n,
                        const char *what, kvx_why_t *why)
{
    if (n == 0)
        return why_fail(why, KVX_ERR_INVALID, "%s.blocks: empty", what);
    if (n > kvxd.conf.max_blocks_per_request)
        return why_fail(
            why, KVX_ERR_LIMIT,
            "%s.blocks: %zu blocks exceed limits.max_blocks_per_request "
            "%u",
            what, n, kvxd.conf.max_blocks_per_request);
    /* the first bad entry in table order: out of range, or a repeat of
     * an earlier one; memory bounded by the table, not by the pool */
    uint32_t nb = p->layout.num_blocks;
    size_t bad = n, dup = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (b[i] >= nb)
            bad = i;
    if (xfer_blocks_repeat(b, n, &dup))
        return why_fail(why, KVX_ERR_NOMEM, "%s: out of memory", what);
    if (bad < n && bad <= dup)
        return why_fail(why, KVX_ERR_INVALID,
                        "%s.blocks[%zu]: block %u outside pool %u's %u blocks",
                        what, bad, b[bad], p->id, nb);
    if (dup < n)
        return why_fail(why, KVX_ERR_INVALID,
                        "%s.blocks[%zu]: block %u listed twice", what, dup,
                        b[dup]);
    return 0;
}

/* The other block tables of a Publish or Fetch (what: its name), each
 * in a pool of this session with its blocks checked, into out
 * (XFER_MAX_GROUPS - 1 entries). */
static int groups_from_msg(session_t *s, Kvxfer__GroupBlocks *const *m,
                           size_t n, const char *what, xfer_group_t *out,
                           kvx_why_t *why)
{
    if (n >= XFER_MAX_GROUPS)
        return why_fail(why, KVX_ERR_LIMIT, "%s.groups: %zu, at most %u", what,
                        n, XFER_MAX_GROUPS - 1);
    for (size_t k = 0; k < n; k++) {
        char w[48];
        snprintf(w, sizeof(w), "%s.groups[%zu]", what, k);
        pool_t *p = session_own_pool(s, m[k]->pool_id);
        if (!p)
            return why_fail(why, KVX_ERR_NOT_FOUND,
                            "%s.pool_id: no pool %u registered by this session",
                            w, m[k]->pool_id);
        int rc = check_blocks(p, m[k]->blocks, m[k]->n_blocks, w, why);
        if (rc)
            return rc;
        out[k] = (xfer_group_t){p,
                                m[k]->blocks,
                                (uint32_t)m[k]->n_blocks,
                                m[k]->num_tokens,
                                m[k]->first_block,
                                m[k]->skip_tokens};
    }
    return 0;
}

/* Pool of this session, by id. */
pool_t *session_own_pool(session_t *s, uint32_t id)
{
    pool_t *p = map_get(&s->pools, id);
    return p && !p->released ? p : NULL;
}

/* ---- handlers: one per message, validate then act --------------------- */

#define FAIL(code, ...)                                                        \
    do {                                                                       \
        snprintf(why, sizeof(why), __VA_ARGS__);                               \
        reply(s, rq->id, (code), why);                                         \
        return;                                                                \
    } while (0)

/* The GPU devices of s's pools, as pacing.h counts them. */
uint64_t session_gpu_devices(const session_t *s)
{
    pool_t *ps[64];
    uint64_t mask = 0;
    uint32_t n = s->pools.n;
    pool_t **all = n > 64 ? calloc(n, sizeof(*all)) : ps;
    if (!all)
        return 0;
    n = map_values(&s->pools, (void **)all, n);
    for (uint32_t i = 0; i < n; i++)
        if (all[i]->gpu)
            mask |= pacing_device_bit(all[i]->device);
    if (all != ps)
        free(all);
    return mask;
}

static void on_hello(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Hello *h = rq->hello;
    if (s->hello)
        FAIL(KVX_ERR_STATE, "hello: already said");
    if (h->version_major != KVX_PROTOCOL_MAJOR)
        FAIL(KVX_ERR_VERSION,
             "hello.version_major: client speaks protocol %u.%u, daemon "
             "speaks %u.%u",
             h->version_major, h->version_minor, KVX_PROTOCOL_MAJOR,
             KVX_PROTOCOL_MINOR);
    size_t idlen = strlen(h->instance_id);
    if (idlen == 0 || idlen > INSTANCE_ID_MAX)
        FAIL(KVX_ERR_INVALID, "hello.instance_id: %zu bytes (expected 1..%u)",
             idlen, INSTANCE_ID_MAX);
    /* it goes into logs, status and other daemons' messages: printable
     * ASCII only (a newline could forge log lines) */
    for (size_t i = 0; i < idlen; i++)
        if ((unsigned char)h->instance_id[i] < 0x21 ||
            (unsigned char)h->instance_id[i] > 0x7e)
            FAIL(KVX_ERR_INVALID,
                 "hello.instance_id: byte %zu is 0x%02x (expected printable "
                 "ASCII, no spaces)",
                 i, (unsigned char)h->instance_id[i]);
    if (h->role < KVXFER__ROLE__ROLE_CONTEXT ||
        h->role > KVXFER__ROLE__ROLE_BOTH)
        FAIL(KVX_ERR_INVALID,
             "hello.role: %d (expected context, generation "
             "or both)",
             h->role);
    if (!h->parallel)
        FAIL(KVX_ERR_INVALID, "hello.parallel: missing");
    const Kvxfer__ParallelConfig *pc = h->parallel;
    plan_side_t side;
    memset(&side, 0, sizeof(side));
    side.tp = pc->tp;
    side.pp = pc->pp;
    side.cp = pc->cp ? pc->cp : 1;
    side.total_layers = pc->total_layers;
    side.total_heads = pc->total_kv_heads;
    side.attention_dp = pc->attention_dp > 1 ? pc->attention_dp : 0;
    if (pc->attention_dp > 1 && h->role != KVXFER__ROLE__ROLE_GENERATION)
        FAIL(KVX_ERR_UNSUPPORTED,
             "hello.parallel.attention_dp: %u: attention DP is supported on "
             "the generation side only",
             pc->attention_dp);
    if (pc->n_layers_per_pp > 64)
        FAIL(KVX_ERR_INVALID,
             "hello.parallel.layers_per_pp: %zu entries "
             "(at most 64)",
             pc->n_layers_per_pp);
    side.num_layers_per_pp = (uint32_t)pc->n_layers_per_pp;
    for (size_t i = 0; i < pc->n_layers_per_pp; i++)
        side.layers_per_pp[i] = pc->layers_per_pp[i];
    /* a slot of limits.max_sessions, within the uid's share */
    uid_slots_t *us = session_slots(s->uid, 0);
    uint32_t ucap = kvxd_uid_sessions_cap();
    assert(us && us->pre);
    if (nranked >= kvxd.conf.max_sessions)
        FAIL(KVX_ERR_LIMIT,
             "hello: the daemon has %u sessions that said Hello open, its "
             "limits.max_sessions",
             nranked);
    if (us->ranks >= ucap)
        FAIL(KVX_ERR_LIMIT,
             "hello: uid %u has %u sessions that said Hello open, its share "
             "of the daemon's (limits.uid_sessions %u)",
             (unsigned)s->uid, us->ranks, ucap);
    instance_hello_t ih = {.id = h->instance_id,
                           .uid = (uint32_t)s->uid,
                           .role = (kvx_role_t)h->role,
                           .rank = h->rank,
                           .side = &side,
                           .sid = s->id};
    int rc = instance_attach(&ih, &s->inst, KVX_WHY(why));
    if (rc) {
        reply(s, rq->id, rc, why);
        return;
    }
    us->pre--;
    npre--;
    us->ranks++;
    nranked++;
    s->ranked = 1;
    s->hello = 1;
    s->rank = h->rank;
    s->role = (kvx_role_t)h->role;
    log_f(LOG_INFO, &(log_fields_t){.instance = s->inst->id},
          "session %llu: pid %d uid %u is rank %u of instance %s",
          (unsigned long long)s->id, (int)s->pid, (unsigned)s->uid, s->rank,
          s->inst->id);
    Kvxfer__HelloReply hr = KVXFER__HELLO_REPLY__INIT;
    hr.version_major = KVX_PROTOCOL_MAJOR;
    hr.version_minor = KVX_PROTOCOL_MINOR;
    hr.session_id = s->id;
    hr.daemon_address = kvxd.address;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_HELLO;
    r.hello = &hr;
    reply_packed(s, &r);
}

static void on_join(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    int first = !s->inst->joined;
    int rc = instance_consumers(s->inst, rq->join->consumers,
                                rq->join->n_consumers, KVX_WHY(why));
    if (!rc)
        rc = instance_join(s->inst, s->rank, rq->join->rank_addresses,
                           rq->join->n_rank_addresses, KVX_WHY(why));
    if (!rc && first)
        agree_joined(s->inst); /* the root counts every remote rank */
    if (!rc)
        agree_rank(s->inst, s->rank, 1); /* spread: the root counts it */
    reply(s, rq->id, rc, rc ? why : "");
}

static int ready_for(session_t *s, kvx_role_t need, const char *what,
                     kvx_why_t *why)
{
    if (!(s->role & need))
        return why_fail(why, KVX_ERR_STATE, "%s: instance %s has role %s", what,
                        s->inst->id,
                        s->role == KVX_ROLE_CONTEXT ? "context" : "generation");
    return instance_ready(s->inst, why);
}

/* A PublishReply with params (malloc'd: freed here). */
static void reply_params(session_t *s, uint64_t id, uint8_t *params,
                         size_t plen)
{
    Kvxfer__PublishReply pr = KVXFER__PUBLISH_REPLY__INIT;
    pr.context_params.data = params;
    pr.context_params.len = plen;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_PUBLISH;
    r.publish = &pr;
    reply_packed(s, &r);
    free(params);
}

static void on_publish(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Publish *m = rq->publish;
    int rc;
    reqkey_t key;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "publish.key",
                         KVX_WHY(why))))
        goto fail;
    if ((rc = ready_for(s, KVX_ROLE_CONTEXT, "publish", KVX_WHY(why))))
        goto fail;
    if (m->aux.len > kvxd.conf.aux_bytes)
        FAIL(KVX_ERR_LIMIT,
             "publish.aux: %zu bytes, more than limits.aux_bytes (%u)",
             m->aux.len, kvxd.conf.aux_bytes);
    pool_t *p = session_own_pool(s, m->pool_id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "publish.pool_id: no pool %u registered by this session",
             m->pool_id);
    if ((rc = check_blocks(p, m->blocks, m->n_blocks, "publish", KVX_WHY(why))))
        goto fail;
    xfer_group_t gs[XFER_MAX_GROUPS];
    if ((rc = groups_from_msg(s, m->groups, m->n_groups, "publish", gs,
                              KVX_WHY(why))))
        goto fail;
    uint8_t *params;
    size_t plen;
    xfer_publish_req_t pr = {.inst = s->inst,
                             .rank = s->rank,
                             .key = &key,
                             .pool = p,
                             .blocks = m->blocks,
                             .nblocks = (uint32_t)m->n_blocks,
                             .num_tokens = m->num_tokens,
                             .groups = gs,
                             .ngroups = (uint32_t)m->n_groups,
                             .aux = m->aux.data,
                             .aux_len = (uint32_t)m->aux.len,
                             .layerwise = m->layerwise,
                             .lease_ms = m->lease_ms};
    if ((rc = xfer_publish(&pr, &params, &plen, KVX_WHY(why))))
        goto fail;
    reply_params(s, rq->id, params, plen);
    return;
fail:
    reply(s, rq->id, rc, why);
}

static void on_layers_ready(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__LayersReady *m = rq->layers_ready;
    reqkey_t key;
    int rc = reqkey_set(&key, m->key.data, m->key.len, "layers_ready.key",
                        KVX_WHY(why));
    if (!rc)
        rc = ready_for(s, KVX_ROLE_CONTEXT, "layers_ready", KVX_WHY(why));
    if (!rc)
        rc = xfer_layers_ready(&(xfer_ready_req_t){.inst = s->inst,
                                                   .rank = s->rank,
                                                   .key = &key,
                                                   .group = m->group,
                                                   .first = m->first,
                                                   .count = m->count,
                                                   .tokens = m->tokens,
                                                   .ev = m->cuda_event.data,
                                                   .ev_len = m->cuda_event.len,
                                                   .owner = s->id},
                               KVX_WHY(why));
    reply(s, rq->id, rc, rc ? why : "");
}

static void on_append_blocks(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__AppendBlocks *m = rq->append_blocks;
    reqkey_t key;
    int rc = reqkey_set(&key, m->key.data, m->key.len, "append_blocks.key",
                        KVX_WHY(why));
    if (!rc)
        rc = ready_for(s, KVX_ROLE_CONTEXT, "append_blocks", KVX_WHY(why));
    pool_t *p = rc ? NULL : session_own_pool(s, m->pool_id);
    if (!rc && !p) {
        rc = KVX_ERR_NOT_FOUND;
        snprintf(why, sizeof(why),
                 "append_blocks.pool_id: no pool %u registered by this "
                 "session",
                 m->pool_id);
    }
    if (!rc)
        rc = check_blocks(p, m->blocks, m->n_blocks, "append_blocks",
                          KVX_WHY(why));
    if (!rc)
        rc = xfer_append_blocks(s->inst, s->rank, &key, p, m->blocks,
                                (uint32_t)m->n_blocks, KVX_WHY(why));
    reply(s, rq->id, rc, rc ? why : "");
}

static void on_fetch_progress(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    reqkey_t key;
    uint32_t done = 0, n = 0;
    int rc = reqkey_set(&key, rq->fetch_progress->key.data,
                        rq->fetch_progress->key.len, "fetch_progress.key",
                        KVX_WHY(why));
    if (!rc)
        rc = ready_for(s, KVX_ROLE_GENERATION, "fetch_progress", KVX_WHY(why));
    if (!rc)
        rc = xfer_fetch_progress(s->inst, s->rank, &key,
                                 rq->fetch_progress->group, &done, &n,
                                 KVX_WHY(why));
    if (rc < 0) {
        reply(s, rq->id, rc, why);
        return;
    }
    Kvxfer__FetchProgressReply fp = KVXFER__FETCH_PROGRESS_REPLY__INIT;
    fp.layers_done = done;
    fp.num_layers = n;
    fp.ended = rc == 1;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_FETCH_PROGRESS;
    r.fetch_progress = &fp;
    reply_packed(s, &r);
}

static void on_fetch(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Fetch *m = rq->fetch;
    int rc;
    reqkey_t key;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "fetch.key",
                         KVX_WHY(why))))
        goto fail;
    if ((rc = ready_for(s, KVX_ROLE_GENERATION, "fetch", KVX_WHY(why))))
        goto fail;
    pool_t *p = session_own_pool(s, m->pool_id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "fetch.pool_id: no pool %u registered by this session",
             m->pool_id);
    if ((rc = check_blocks(p, m->blocks, m->n_blocks, "fetch", KVX_WHY(why))))
        goto fail;
    xfer_group_t gs[XFER_MAX_GROUPS];
    if ((rc = groups_from_msg(s, m->groups, m->n_groups, "fetch", gs,
                              KVX_WHY(why))))
        goto fail;
    xfer_fetch_req_t fr = {.inst = s->inst,
                           .rank = s->rank,
                           .key = &key,
                           .params = m->context_params.data,
                           .params_len = m->context_params.len,
                           .pool = p,
                           .blocks = m->blocks,
                           .nblocks = (uint32_t)m->n_blocks,
                           .skip_tokens = m->skip_tokens,
                           .dp_rank = m->dp_rank,
                           .groups = gs,
                           .ngroups = (uint32_t)m->n_groups};
    rc = xfer_fetch(&fr, KVX_WHY(why));
fail:
    reply(s, rq->id, rc, rc ? why : "");
}

static void on_poll(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    uint64_t now = kvxd_now_ms();
    uint32_t t = rq->poll->timeout_ms;
    if (t > kvxd.conf.poll_timeout_max_ms) /* cut, see configuration.md */
        t = kvxd.conf.poll_timeout_max_ms;
    if (instance_spread(s->inst) && !s->inst->local[0]) {
        /* batches of an instance spread over daemons come from the
         * daemon of rank 0 */
        int rc = agree_poll(s->inst, s->rank, rq->id, rq->poll->at_least, t,
                            KVX_WHY(why));
        if (rc)
            reply(s, rq->id, rc, why);
        return;
    }
    batch_state_t *bs = &s->inst->batches;
    int rc = batch_poll(bs, s->rank, rq->id, rq->poll->at_least, now + t, now);
    /* answered early only when a fetch's last copies go out after this
     * (not at once for one already out: a small request's event comes
     * sooner than the extra round trip) */
    if (!rc && rq->poll->early && !instance_spread(s->inst))
        batch_waiter_early(bs, s->rank);
    if (rc == KVX_ERR_LIMIT)
        FAIL(KVX_ERR_LIMIT,
             "poll: batches %llu to %llu of instance %s were dropped before "
             "rank %u read them (limits.batches_kept %u: every rank must "
             "poll, also one that fetched nothing); the next poll reads on",
             (unsigned long long)bs->missed_from,
             (unsigned long long)bs->missed_to, s->inst->id, s->rank,
             bs->kept_max);
    if (rc)
        FAIL(KVX_ERR_BUSY, "poll: this rank already has a poll waiting");
}

static void on_cancel(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    reqkey_t key;
    int rc = reqkey_set(&key, rq->cancel->key.data, rq->cancel->key.len,
                        "cancel.key", KVX_WHY(why));
    if (!rc && keyed_cancel(s->inst, &key))
        rc = 0; /* a fetch by key that was still waiting: ended */
    else if (!rc)
        rc = xfer_cancel(s->inst, &key, s->id, rq->id, KVX_WHY(why));
    if (rc <= 0)
        reply(s, rq->id, rc, rc ? why : "");
    /* rc 1: answered once the request's copies are fenced */
}

/* Cancel{key, instance_id}: an admin (kvxferctl cancel) ends a request
 * of any instance, without Hello, as the instance's own cancel does. */
static void on_admin_cancel(session_t *s, const Kvxfer__Request *rq)
{
    const Kvxfer__Cancel *m = rq->cancel;
    char why[512];
    reqkey_t key;
    if (!s->admin) {
        log_warn("session %llu: cancel of a request of instance %.128s "
                 "refused: uid %u is not an admin",
                 (unsigned long long)s->id, m->instance_id, (unsigned)s->uid);
        reply(s, rq->id, KVX_ERR_PERM,
              "cancel.instance_id: only root, the daemon's uid and members "
              "of auth.admin_gids may cancel another instance's request");
        return;
    }
    instance_t *inst = instance_find(m->instance_id);
    if (!inst) {
        snprintf(why, sizeof(why),
                 "cancel.instance_id: no instance %.128s on this daemon",
                 m->instance_id);
        reply(s, rq->id, KVX_ERR_NOT_FOUND, why);
        return;
    }
    int rc =
        reqkey_set(&key, m->key.data, m->key.len, "cancel.key", KVX_WHY(why));
    if (!rc) {
        char ks[REQKEY_STR_MAX];
        log_f(LOG_NOTICE,
              &(log_fields_t){.instance = inst->id,
                              .key = reqkey_str(key.b, key.len, ks)},
              "session %llu: uid %u cancels request %s of instance %s",
              (unsigned long long)s->id, (unsigned)s->uid, ks, inst->id);
    }
    if (!rc && keyed_cancel(inst, &key))
        rc = 0; /* a fetch by key that was still waiting: ended */
    else if (!rc)
        rc = xfer_cancel(inst, &key, s->id, rq->id, KVX_WHY(why));
    if (rc <= 0)
        reply(s, rq->id, rc, rc ? why : "");
    /* rc 1: answered once the request's copies are fenced */
}

static void on_status(session_t *s, const Kvxfer__Request *rq)
{
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    Kvxfer__StatusReply st = KVXFER__STATUS_REPLY__INIT;
    int64_t only = s->admin ? -1 : (int64_t)s->uid;
    /* one reply's cap: the first list_page_entries of each list */
    uint32_t cap = kvxd.conf.list_page_entries;
    stats_fill(&st, only, cap);
    st.n_sessions = session_infos(&st.sessions, only, cap, &st.sessions_total);
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_STATUS_REPLY;
    r.status_reply = &st;
    reply_packed(s, &r);
    session_infos_free(st.sessions, st.n_sessions);
    stats_free(&st);
}

static void on_metrics(session_t *s, const Kvxfer__Request *rq)
{
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    Kvxfer__MetricsReply m = KVXFER__METRICS_REPLY__INIT;
    char health[128];
    size_t len;
    if (fault_hit(FAULT_LOOP_STALL))
        sleep(3); /* tests: a stuck callback */
    char *text = metrics_text(&len);
    if (!text) {
        reply(s, rq->id, KVX_ERR_NOMEM, "metrics: out of memory");
        return;
    }
    m.text = text;
    m.healthy = metrics_healthy(health, sizeof(health));
    m.health = health;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_METRICS;
    r.metrics = &m;
    reply_packed(s, &r);
    free(text);
}

/* ListRequests.done: the newest max records this session may see. */
static void list_done(session_t *s, uint64_t id, uint32_t max)
{
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    Kvxfer__RequestsReply rr = KVXFER__REQUESTS_REPLY__INIT;
    reqrec_t *v = calloc(max, sizeof(*v));
    Kvxfer__DoneRecord *d = calloc(max, sizeof(*d));
    Kvxfer__DoneRecord **dp = calloc(max, sizeof(*dp));
    if (!v || !d || !dp) {
        free(v);
        free(d);
        free(dp);
        reply(s, id, KVX_ERR_NOMEM, "list_requests: out of memory");
        return;
    }
    uint32_t n = records_list(v, max, s->admin ? -1 : (int64_t)s->uid,
                              &rr.done_kept, &rr.done_recorded);
    for (uint32_t i = 0; i < n; i++) {
        kvxfer__done_record__init(&d[i]);
        d[i].instance_id = v[i].instance;
        d[i].key.data = v[i].key;
        d[i].key.len = v[i].key_len;
        d[i].context_instance = v[i].context;
        d[i].generation_instance = v[i].generation;
        d[i].side = (char *)v[i].side;
        d[i].path = (char *)(v[i].path ? v[i].path : "");
        d[i].bytes = v[i].bytes;
        d[i].start_us = v[i].start_us;
        d[i].end_us = v[i].end_us;
        d[i].outcome = (uint32_t)v[i].outcome;
        d[i].code = v[i].code;
        dp[i] = &d[i];
    }
    rr.done = dp;
    rr.n_done = n;
    r.id = id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_REQUESTS;
    r.requests = &rr;
    reply_packed(s, &r);
    free(dp);
    free(d);
    free(v);
}

static void on_list_requests(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__ListRequests *m = rq->list_requests;
    uint32_t max = kvxd.conf.list_page_entries;
    if (m->max_entries && m->max_entries < max)
        max = m->max_entries;
    if (m->done) {
        list_done(s, rq->id, max);
        return;
    }
    int side = 0;
    if (m->after_instance[0]) {
        if (!strcmp(m->after_side, "generation"))
            side = 1;
        else if (strcmp(m->after_side, "context"))
            FAIL(KVX_ERR_INVALID,
                 "list_requests.after_side: '%.32s' (expected context or "
                 "generation)",
                 m->after_side);
    }
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    Kvxfer__RequestsReply rr = KVXFER__REQUESTS_REPLY__INIT;
    int more = 0;
    rr.n_requests = xfer_infos_page(
        m->after_instance, side,
        m->after_key.len ? xfer_key_id(m->after_key.data, m->after_key.len) : 0,
        max, s->admin ? -1 : (int64_t)s->uid, &rr.requests, &more);
    rr.more = more;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_REQUESTS;
    r.requests = &rr;
    reply_packed(s, &r);
    xfer_free_infos(rr.requests, rr.n_requests);
}

static void on_fetch_by_key(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__FetchByKey *m = rq->fetch_by_key;
    int rc;
    reqkey_t key, ckey;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "fetch_by_key.key",
                         KVX_WHY(why))) ||
        (rc = reqkey_set(&ckey, m->context_key.data, m->context_key.len,
                         "fetch_by_key.context_key", KVX_WHY(why))))
        goto fail;
    if ((rc = ready_for(s, KVX_ROLE_GENERATION, "fetch_by_key", KVX_WHY(why))))
        goto fail;
    pool_t *p = session_own_pool(s, m->pool_id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "fetch_by_key.pool_id: no pool %u registered by this session",
             m->pool_id);
    if ((rc = check_blocks(p, m->blocks, m->n_blocks, "fetch_by_key",
                           KVX_WHY(why))))
        goto fail;
    /* the checks xfer_fetch makes before the params: refused now, as a
     * fetch with params is */
    uint32_t groups =
        s->inst->side.attention_dp > 1 ? s->inst->side.attention_dp : 1;
    if (m->dp_rank >= groups)
        FAIL(KVX_ERR_INVALID,
             "fetch_by_key.dp_rank: %u, but instance %s has %u attention-DP "
             "group%s",
             m->dp_rank, s->inst->id, groups, groups == 1 ? "" : "s");
    xfer_group_t gs[XFER_MAX_GROUPS];
    if ((rc = groups_from_msg(s, m->groups, m->n_groups, "fetch_by_key", gs,
                              KVX_WHY(why))))
        goto fail;
    xfer_fetch_req_t q = {.inst = s->inst,
                          .rank = s->rank,
                          .key = &key,
                          .pool = p,
                          .blocks = m->blocks,
                          .nblocks = (uint32_t)m->n_blocks,
                          .skip_tokens = m->skip_tokens,
                          .dp_rank = m->dp_rank,
                          .groups = gs,
                          .ngroups = (uint32_t)m->n_groups};
    keyed_source_t src = {m->context_instance ? m->context_instance : "",
                          m->context_address ? m->context_address : "", &ckey};
    rc = keyed_fetch(&q, &src, KVX_WHY(why));
fail:
    reply(s, rq->id, rc, rc ? why : "");
}

/* A pool of a local rank of inst: its layout speaks for the instance's
 * (every rank's must agree with the offer's at publish). */
static int same_summary(const kvx_layout_t *a, const kvx_layout_t *b)
{
    return !strcmp(a->preset, b->preset) &&
           a->tokens_per_block == b->tokens_per_block &&
           a->head_dim == b->head_dim && a->dtype == b->dtype &&
           a->elem_size == b->elem_size && a->kv_factor == b->kv_factor;
}

/* NULL with *mixed set when the local ranks' pools differ in what the
 * params carry: reserve cannot tell which the ranks will publish. */
static const pool_t *instance_pool(const instance_t *inst, int *mixed)
{
    const pool_t *first = NULL;
    *mixed = 0;
    for (uint32_t r = 0; r < inst->nranks; r++) {
        session_t *rs =
            inst->rank_sid[r] ? map_get(&sessions, inst->rank_sid[r]) : NULL;
        uint32_t n = rs ? rs->pools.n : 0;
        pool_t **ps = n ? calloc(n, sizeof(*ps)) : NULL;
        n = ps ? map_values(&rs->pools, (void **)ps, n) : 0;
        for (uint32_t i = 0; i < n; i++) {
            if (!first)
                first = ps[i];
            else if (!same_summary(&first->layout, &ps[i]->layout))
                *mixed = 1;
        }
        free(ps);
    }
    return *mixed ? NULL : first;
}

/* Pool id as one of inst's local ranks registered it, or NULL. */
static pool_t *instance_pool_by_id(const instance_t *inst, uint32_t id)
{
    for (uint32_t r = 0; id && r < inst->nranks; r++) {
        session_t *rs =
            inst->rank_sid[r] ? map_get(&sessions, inst->rank_sid[r]) : NULL;
        pool_t *p = rs ? map_get(&rs->pools, id) : NULL;
        if (p)
            return p;
    }
    return NULL;
}

/* Reserve: the instance's scheduler, no Hello needed, under the uid
 * that owns the instance (or an admin). */
static void on_reserve(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Reserve *m = rq->reserve;
    int rc;
    reqkey_t key;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "reserve.key",
                         KVX_WHY(why))))
        goto fail;
    instance_t *inst = m->instance_id ? instance_find(m->instance_id) : NULL;
    if (!inst || (!s->admin && inst->owner_uid != s->uid))
        FAIL(KVX_ERR_NOT_FOUND,
             "reserve.instance_id: no instance '%.128s' of uid %u on this "
             "daemon",
             m->instance_id ? m->instance_id : "", s->uid);
    if (!(inst->role & KVX_ROLE_CONTEXT))
        FAIL(KVX_ERR_STATE, "reserve: instance %s has role generation",
             inst->id);
    if ((rc = instance_ready(inst, KVX_WHY(why))))
        goto fail;
    if (!inst->local[0])
        FAIL(KVX_ERR_STATE,
             "reserve: rank 0 of instance %s is served by daemon %s: "
             "reserve there",
             inst->id, inst->addresses[0]);
    int mixed = 0;
    const pool_t *p = m->pool_id ? instance_pool_by_id(inst, m->pool_id)
                                 : instance_pool(inst, &mixed);
    if (m->pool_id && !p)
        FAIL(KVX_ERR_NOT_FOUND,
             "reserve.pool_id: %u is no pool of a rank of instance %s on "
             "this daemon",
             m->pool_id, inst->id);
    if (mixed)
        FAIL(KVX_ERR_STATE,
             "reserve: the ranks of instance %s registered pools of "
             "different layouts (preset, tokens_per_block, head_dim, dtype): "
             "name the plain table's pool (reserve.pool_id)",
             inst->id);
    if (!p)
        FAIL(KVX_ERR_STATE,
             "reserve: no rank of instance %s has registered a pool here "
             "yet (its layout goes into the params)",
             inst->id);
    xfer_group_t gs[XFER_MAX_GROUPS];
    if (m->n_groups >= XFER_MAX_GROUPS)
        FAIL(KVX_ERR_LIMIT, "reserve.groups: %zu, at most %u", m->n_groups,
             XFER_MAX_GROUPS - 1);
    for (size_t k = 0; k < m->n_groups; k++) {
        const Kvxfer__GroupBlocks *x = m->groups[k];
        pool_t *gp = instance_pool_by_id(inst, x->pool_id);
        if (!gp)
            FAIL(KVX_ERR_NOT_FOUND,
                 "reserve.groups[%zu].pool_id: %u is no pool of a rank of "
                 "instance %s on this daemon",
                 k, x->pool_id, inst->id);
        if (x->n_blocks || x->skip_tokens)
            FAIL(KVX_ERR_INVALID,
                 "reserve.groups[%zu]: a reservation names no blocks and "
                 "skips no tokens (the ranks' publishes give the blocks)",
                 k);
        gs[k] = (xfer_group_t){.pool = gp,
                               .num_tokens = x->num_tokens,
                               .first_block = x->first_block};
    }
    uint8_t *params;
    size_t plen;
    xfer_reserve_req_t rr = {.inst = inst,
                             .key = &key,
                             .num_tokens = m->num_tokens,
                             .layout = &p->layout,
                             .groups = gs,
                             .ngroups = (uint32_t)m->n_groups,
                             .lease_ms = m->lease_ms};
    if ((rc = xfer_reserve(&rr, &params, &plen, KVX_WHY(why))))
        goto fail;
    reply_params(s, rq->id, params, plen);
    return;
fail:
    reply(s, rq->id, rc, why);
}

/* Release: no Hello needed (a router or scheduler process); the params'
 * token is the right to it. */
static void on_release(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    int later = 0, rc;
    const Kvxfer__Release *m = rq->release;
    if (m->context_key.len || (m->context_instance && m->context_instance[0])) {
        reqkey_t key;
        rc = reqkey_set(&key, m->context_key.data, m->context_key.len,
                        "release.context_key", KVX_WHY(why));
        if (!rc && m->context_params.len) {
            snprintf(why, sizeof(why), "release: params or a key, not both");
            rc = KVX_ERR_INVALID;
        }
        keyed_release_req_t kr = {
            .sid = s->id,
            .req_id = rq->id,
            .uid = s->uid,
            .admin = s->admin,
            .consumer =
                s->inst && (s->role & KVX_ROLE_GENERATION) ? s->inst->id : NULL,
            .src = {m->context_instance ? m->context_instance : "",
                    m->context_address ? m->context_address : "", &key}};
        if (!rc)
            rc = keyed_release(&kr, &later, KVX_WHY(why));
    } else
        rc = release_start(m->context_params.data, m->context_params.len, s->id,
                           rq->id, &later, KVX_WHY(why));
    if (!later)
        reply(s, rq->id, rc, rc ? why : "");
}

/* Renew (2.6): no Hello needed, as Release; the params' token is the
 * right to it. */
static void on_renew(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    int later = 0;
    const Kvxfer__Renew *m = rq->renew;
    int rc = renew_start(m->context_params.data, m->context_params.len, s->id,
                         rq->id, &later, KVX_WHY(why));
    if (!later)
        reply(s, rq->id, rc, rc ? why : "");
}

/* GpuPace{bytes_per_ms, hold_ms} (2.8): this rank's pace for the GPUs
 * of its pools, now and later (pacing.h). */
static void on_gpu_pace(session_t *s, const Kvxfer__Request *rq)
{
    char why[256];
    const Kvxfer__GpuPace *m = rq->gpu_pace;
    if (m->bytes_per_ms > PACING_MAX_PER_MS)
        FAIL(KVX_ERR_INVALID,
             "gpu_pace.bytes_per_ms: %llu is over 1 TiB (%llu), the most "
             "gpu.pace takes",
             (unsigned long long)m->bytes_per_ms,
             (unsigned long long)PACING_MAX_PER_MS);
    if (m->hold_ms > PACING_MAX_HOLD_MS)
        FAIL(KVX_ERR_INVALID, "gpu_pace.hold_ms: %u is over %u", m->hold_ms,
             PACING_MAX_HOLD_MS);
    uint64_t devices = session_gpu_devices(s);
    if (pacing_set(s->id, m->bytes_per_ms, m->hold_ms, devices))
        FAIL(KVX_ERR_NOMEM, "gpu_pace: out of memory");
    uint64_t shared = m->bytes_per_ms ? devices & pacing_shared() : 0;
    if (shared) {
        /* recorded, and it binds once the device is this user's alone */
        snprintf(why, sizeof(why),
                 "gpu_pace: not applied on %d of its devices: other users' "
                 "GPU pools are on them (an engine's pace binds only a "
                 "device of one user)",
                 __builtin_popcountll(shared));
        reply(s, rq->id, 0, why);
        return;
    }
    reply(s, rq->id, 0, "");
}

/* Drain requests waiting for the drain to end (Drain.wait): answered by
 * session_drained(), before the daemon exits. */
#define DRAIN_WAITERS 16
static struct {
    uint64_t sid, req;
} drain_waiters[DRAIN_WAITERS];
static unsigned ndrain_waiters;

/* Drain{deadline_ms, wait}: the upgrade step, as SIGTERM, for admins. */
static void on_drain(session_t *s, const Kvxfer__Request *rq)
{
    const Kvxfer__Drain *m = rq->drain;
    if (!s->admin) {
        log_warn("session %llu: drain refused: uid %u is not an admin",
                 (unsigned long long)s->id, (unsigned)s->uid);
        reply(s, rq->id, KVX_ERR_PERM,
              "drain: only root, the daemon's uid and members of "
              "auth.admin_gids may drain the daemon");
        return;
    }
    if (m->wait && ndrain_waiters == DRAIN_WAITERS) {
        reply(s, rq->id, KVX_ERR_LIMIT,
              "drain: 16 drain requests already wait for the end");
        return;
    }
    char who[48];
    snprintf(who, sizeof(who), "drain by uid %u", (unsigned)s->uid);
    /* waiting before the drain starts: with nothing in flight it is over
     * inside kvxd_drain() */
    if (m->wait) {
        drain_waiters[ndrain_waiters].sid = s->id;
        drain_waiters[ndrain_waiters++].req = rq->id;
    }
    int already = kvxd_drain(who, m->deadline_ms);
    if (already < 0) {
        ndrain_waiters -= m->wait ? 1 : 0;
        reply(s, rq->id, already, "drain: not available in this process");
        return;
    }
    if (m->wait)
        return;
    char msg[160];
    snprintf(msg, sizeof(msg),
             already ? "draining already; kvxferd exits 0 once it is over"
                     : "draining: requests in flight may finish for %u ms, "
                       "then end SHUTDOWN; kvxferd exits 0 once it is over",
             m->deadline_ms);
    reply(s, rq->id, 0, msg);
}

void session_drained(const char *what)
{
    for (unsigned i = 0; i < ndrain_waiters; i++)
        session_reply(drain_waiters[i].sid, drain_waiters[i].req, 0, what);
    ndrain_waiters = 0;
}

void session_handle_frame(session_t *s, const uint8_t *buf, uint32_t len)
{
    Kvxfer__Request *rq = kvxfer__request__unpack(NULL, len, buf);
    if (!rq) {
        reply(s, 0, KVX_ERR_PROTOCOL, "frame: not a Request message; closing");
        session_close(s, "undecodable frame");
        return;
    }
    s->spoke = 1;
    char why[512];
    /* every request gets one reply, which counts it down */
    if (++s->awaiting > requests_cap(s)) {
        snprintf(why, sizeof(why),
                 "request: %u requests of this session await their replies "
                 "(limits.session_requests %u%s)",
                 s->awaiting - 1, requests_cap(s),
                 s->hello ? "" : "; before Hello at most 8");
        reply(s, rq->id, KVX_ERR_LIMIT, why);
        goto out;
    }
    if (kvxd.draining && rq->body_case != KVXFER__REQUEST__BODY_STATUS &&
        rq->body_case != KVXFER__REQUEST__BODY_METRICS &&
        rq->body_case != KVXFER__REQUEST__BODY_POLL &&
        rq->body_case != KVXFER__REQUEST__BODY_LIST_REQUESTS &&
        rq->body_case != KVXFER__REQUEST__BODY_DRAIN &&
        /* the fetches a drain lets finish copy on the engines' GPUs */
        rq->body_case != KVXFER__REQUEST__BODY_GPU_PACE) {
        reply(s, rq->id, KVX_ERR_SHUTDOWN, "daemon is shutting down");
        goto out;
    }
    switch (rq->body_case) {
    case KVXFER__REQUEST__BODY_HELLO:
        on_hello(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_STATUS:
        on_status(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_METRICS:
        on_metrics(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_LIST_REQUESTS:
        on_list_requests(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_RELEASE:
        on_release(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_RESERVE:
        on_reserve(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_RENEW:
        on_renew(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_DRAIN:
        on_drain(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_CANCEL:
        if (rq->cancel->instance_id[0]) {
            on_admin_cancel(s, rq);
            goto out;
        }
        break; /* the session's own instance: after Hello */
    case KVXFER__REQUEST__BODY__NOT_SET:
        reply(s, rq->id, KVX_ERR_PROTOCOL, "request: empty body");
        goto out;
    default:
        break;
    }
    if (!s->hello) {
        snprintf(why, sizeof(why), "request: say hello first");
        reply(s, rq->id, KVX_ERR_STATE, why);
        goto out;
    }
    switch (rq->body_case) {
    case KVXFER__REQUEST__BODY_JOIN:
        on_join(s, rq);
        break;
    case KVXFER__REQUEST__BODY_REGISTER_POOL:
        session_on_register_pool(s, rq);
        break;
    case KVXFER__REQUEST__BODY_DEREGISTER_POOL:
        session_on_deregister_pool(s, rq);
        break;
    case KVXFER__REQUEST__BODY_PUBLISH:
        on_publish(s, rq);
        break;
    case KVXFER__REQUEST__BODY_FETCH:
        on_fetch(s, rq);
        break;
    case KVXFER__REQUEST__BODY_FETCH_BY_KEY:
        on_fetch_by_key(s, rq);
        break;
    case KVXFER__REQUEST__BODY_POLL:
        on_poll(s, rq);
        break;
    case KVXFER__REQUEST__BODY_LAYERS_READY:
        on_layers_ready(s, rq);
        break;
    case KVXFER__REQUEST__BODY_FETCH_PROGRESS:
        on_fetch_progress(s, rq);
        break;
    case KVXFER__REQUEST__BODY_APPEND_BLOCKS:
        on_append_blocks(s, rq);
        break;
    case KVXFER__REQUEST__BODY_CANCEL:
        on_cancel(s, rq);
        break;
    case KVXFER__REQUEST__BODY_GPU_PACE:
        on_gpu_pace(s, rq);
        break;
    default:
        reply(s, rq->id, KVX_ERR_PROTOCOL, "request: unknown body");
        break;
    }
out:
    kvxfer__request__free_unpacked(rq, NULL);
}

int session_init(void)
{
    static const kvxd_reply_sink_t sink = {session_reply, session_reply_msg};
    kvxd_set_reply_sink(&sink);
    if (uv_check_init(kvxd.loop, &flush_check) ||
        uv_idle_init(kvxd.loop, &flush_idle) ||
        uv_check_start(&flush_check, on_flush_check)) {
        log_error("session: cannot start the reply flush handles");
        return KVX_ERR_IO;
    }
    uv_unref((uv_handle_t *)&flush_check); /* keep nothing alive */
    uv_unref((uv_handle_t *)&flush_idle);
    return 0;
}
