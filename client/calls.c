/*
 * calls — libkvxfer's requests besides the verbs of verbs.c: append
 * blocks, reserve, poll, cancel and release; see kvxfer.h. Each builds its
 * message and goes through kvx__call() (conn.c); a request that ends with an
 * event is tracked (reconnect.c) so that it ends even if the daemon goes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "common/frame.h"
#include "common/list.h"
#include "common/reqkey.h"
#include "internal.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"

int kvx_params_info(const void *params, size_t len, kvx_params_info_t *info)
{
    if (!info)
        return KVX_ERR_INVALID;
    memset(info, 0, sizeof(*info));
    Kvxfer__ContextParams *cp =
        params && len ? kvxfer__context_params__unpack(NULL, len, params)
                      : NULL;
    const char *bad =
        !cp                ? "not a ContextParams message"
        : cp->version != 2 ? "params version is not 2"
        : !cp->key.len || cp->key.len > KVX_MAX_KEY ? "key missing or too long"
        : !cp->parallel || !cp->layout ? "no parallel config or layout"
        : strlen(cp->instance_id) >= sizeof(info->instance_id)
            ? "instance id too long"
        : !cp->n_rank_addresses ? "no rank addresses"
                                : NULL;
    if (bad) {
        snprintf(kvx__connect_err, sizeof(kvx__connect_err),
                 "kvx_params_info: %zu bytes of params: %s", len, bad);
        if (cp)
            kvxfer__context_params__free_unpacked(cp, NULL);
        return KVX_ERR_INVALID;
    }
    snprintf(info->instance_id, sizeof(info->instance_id), "%s",
             cp->instance_id);
    memcpy(info->key, cp->key.data, cp->key.len);
    info->key_len = (uint32_t)cp->key.len;
    info->request_id = reqkey_to_u64(cp->key.data, cp->key.len);
    info->num_tokens = cp->num_tokens;
    info->tokens_per_block = cp->layout->tokens_per_block;
    uint32_t cpn = cp->parallel->cp ? cp->parallel->cp : 1;
    info->context_ranks = cp->parallel->tp * cp->parallel->pp * cpn;
    info->num_layers = cp->parallel->total_layers;
    info->num_kv_heads = cp->parallel->total_kv_heads;
    snprintf(info->rank0_address, sizeof(info->rank0_address), "%s",
             cp->rank_addresses[0]);
    kvxfer__context_params__free_unpacked(cp, NULL);
    return KVX_OK;
}

int kvx_params_lease(const void *params, size_t len, uint32_t *lease_ms)
{
    if (!lease_ms)
        return KVX_ERR_INVALID;
    Kvxfer__ContextParams *cp =
        params && len ? kvxfer__context_params__unpack(NULL, len, params)
                      : NULL;
    if (!cp || cp->version != 2) {
        snprintf(kvx__connect_err, sizeof(kvx__connect_err),
                 "kvx_params_lease: %zu bytes of params: %s", len,
                 cp ? "params version is not 2"
                    : "not a ContextParams message");
        if (cp)
            kvxfer__context_params__free_unpacked(cp, NULL);
        return KVX_ERR_INVALID;
    }
    *lease_ms = cp->lease_ms;
    kvxfer__context_params__free_unpacked(cp, NULL);
    return KVX_OK;
}

void kvx_context_params_free(kvx_context_params_t *p)
{
    if (!p)
        return;
    free(p->data);
    p->data = NULL;
    p->len = 0;
}

int kvx__params_take(kvx_client_t *c, const char *what, const Kvxfer__Reply *r,
                     kvx_context_params_t *params)
{
    if (r->body_case != KVXFER__REPLY__BODY_PUBLISH)
        return kvx__fail(c, KVX_ERR_PROTOCOL, "%s: reply without params", what);
    size_t len = r->publish->context_params.len;
    if (!(params->data = malloc(len ? len : 1)))
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    memcpy(params->data, r->publish->context_params.data, len);
    params->len = len;
    return 0;
}

static int params_call(kvx_client_t *c, Kvxfer__Request *rq, const char *what,
                       kvx_context_params_t *params, int timeout_ms)
{
    Kvxfer__Reply *r;
    int rc = kvx__call(c, rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    rc = kvx__params_take(c, what, r, params);
    kvxfer__reply__free_unpacked(r, NULL);
    return rc;
}

int kvx__key_arg(kvx_client_t *c, const char *fn, const void *key,
                 size_t key_len)
{
    if (!key || key_len == 0 || key_len > KVX_MAX_KEY)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: key of %zu bytes%s (a key is 1 to %u bytes)", fn,
                         key ? key_len : 0, key ? "" : " (NULL)", KVX_MAX_KEY);
    return 0;
}

int kvx__groups_msg(kvx_client_t *c, const char *fn, const kvx_group_t *groups,
                    uint32_t ngroups, int use, Kvxfer__GroupBlocks *m,
                    Kvxfer__GroupBlocks **mp)
{
    if (ngroups && !groups)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: groups is NULL with ngroups %u", fn, ngroups);
    if (ngroups >= KVX_MAX_GROUPS)
        return kvx__fail(c, KVX_ERR_LIMIT, "%s: %u groups, at most %u", fn,
                         ngroups, KVX_MAX_GROUPS - 1);
    /* a reservation comes from an observer, which has no Hello reply to
     * tell the daemon's version: kvx_reserve_groups checks the params */
    if (ngroups && use != KVX__GROUPS_RESERVE && c->daemon_minor < 2)
        return kvx__fail(c, KVX_ERR_VERSION,
                         "%s: the daemon speaks protocol 2.%u; several block "
                         "tables need 2.2",
                         fn, c->daemon_minor);
    for (uint32_t k = 0; k < ngroups; k++) {
        if (use == KVX__GROUPS_RESERVE &&
            (groups[k].blocks || groups[k].num_blocks || groups[k].skip_tokens))
            return kvx__fail(c, KVX_ERR_INVALID,
                             "%s: groups[%u] names blocks or skip_tokens; a "
                             "reservation names none (the ranks' publishes "
                             "give the blocks)",
                             fn, k);
        if (!groups[k].blocks && groups[k].num_blocks)
            return kvx__fail(c, KVX_ERR_INVALID,
                             "%s: groups[%u].blocks is NULL with num_blocks %u",
                             fn, k, groups[k].num_blocks);
        kvxfer__group_blocks__init(&m[k]);
        m[k].pool_id = kvx__pool_daemon(c, groups[k].pool_id);
        m[k].n_blocks = groups[k].num_blocks;
        m[k].blocks = (uint32_t *)groups[k].blocks;
        m[k].first_block = groups[k].first_block;
        if (use == KVX__GROUPS_FETCH)
            m[k].skip_tokens = groups[k].skip_tokens;
        else
            m[k].num_tokens = groups[k].num_tokens;
        mp[k] = &m[k];
    }
    return 0;
}

int kvx__tracked_call(kvx_client_t *c, Kvxfer__Request *rq, const void *key,
                      size_t key_len, kvx_context_params_t *params,
                      int timeout_ms)
{
    kvx__key_t *k = kvx__key_new(c, key, key_len);
    if (!k)
        return KVX_ERR_NOMEM;
    int rc = params ? params_call(c, rq, "publish", params, timeout_ms)
                    : kvx__call(c, rq, -1, timeout_ms, NULL);
    if (rc)
        free(k);
    else
        kvx__track(c, k);
    return rc;
}

int kvx_append_blocks(kvx_client_t *c, const void *key, size_t key_len,
                      uint32_t pool_id, const uint32_t *blocks,
                      uint32_t nblocks, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = kvx__key_arg(c, "kvx_append_blocks", key, key_len);
    if (rc)
        return rc;
    if (!blocks && nblocks)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    Kvxfer__AppendBlocks m = KVXFER__APPEND_BLOCKS__INIT;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.pool_id = kvx__pool_daemon(c, pool_id);
    m.n_blocks = nblocks;
    m.blocks = (uint32_t *)blocks;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_APPEND_BLOCKS;
    rq.append_blocks = &m;
    return kvx__call(c, &rq, -1, timeout_ms, NULL);
}

/* After an early answer (Poll.early) the poll is spun for this long
 * before it sleeps: the event is one copy away (a layer: up to a few
 * hundred microseconds; a whole request's last chunk: milliseconds). */
#define KVX_EARLY_SPIN_US 20000

int kvx_poll(kvx_client_t *c, uint32_t at_least, int timeout_ms,
             kvx_batch_t **out)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    /* the ends of the requests a lost daemon took with it come first */
    int rc = kvx__gone_batch(c, out);
    if (rc)
        return rc < 0 ? rc : 0;
    Kvxfer__Poll m = KVXFER__POLL__INIT;
    m.at_least = at_least;
    /* negative: no deadline of ours; the daemon cuts it to its own
     * (deadlines.poll_timeout_max_ms), and an empty batch sealed there
     * is read past below */
    m.timeout_ms = timeout_ms < 0 ? UINT32_MAX : (uint32_t)timeout_ms;
    /* a client that spins, waiting for one event, asks to be woken
     * early (2.4): once a fetch of its instance has its last copies out,
     * the daemon answers without a batch, and the poll is sent again and
     * spun for, so the event is not held up by this thread's wake-up */
    m.early = c->spin_us && at_least == 1 && timeout_ms != 0;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_POLL;
    rq.poll = &m;
    Kvxfer__Reply *r;
    uint32_t spin = c->spin_us;
    int64_t t0 = kvx__now_ms();
    for (;;) {
        /* the daemon answers at the poll timeout; allow for a busy loop
         * (it cuts timeouts to its maximum, an hour at most) */
        int t = timeout_ms < 3600000 ? timeout_ms : 3600000;
        if ((rc = kvx__call_spin(c, &rq, NULL, 0, t < 0 ? -1 : t + 10000, spin,
                                 &r))) {
            /* lost during this poll: its requests' ends now */
            if (rc == KVX_ERR_CLOSED && c->rv.ngone) {
                char why[sizeof(c->err)];
                memcpy(why, c->err, sizeof(why));
                int g = kvx__gone_batch(c, out);
                if (g > 0) {
                    memcpy(c->err, why, sizeof(why));
                    return 0;
                }
                return g < 0 ? g : rc;
            }
            return rc;
        }
        if (r->body_case == KVXFER__REPLY__BODY_POLL && r->poll->early &&
            !r->poll->n_events) {
            kvxfer__reply__free_unpacked(r, NULL);
            m.early = 0; /* once a poll: the event is a copy away */
            if (timeout_ms >= 0) {
                int64_t left = timeout_ms - (kvx__now_ms() - t0);
                m.timeout_ms = left > 0 ? (uint32_t)left : 0;
            }
            spin = KVX_EARLY_SPIN_US;
            continue;
        }
        if (timeout_ms >= 0 || at_least == 0 ||
            r->body_case != KVXFER__REPLY__BODY_POLL || r->poll->n_events)
            break;
        kvxfer__reply__free_unpacked(r, NULL);
    }
    if (r->body_case != KVXFER__REPLY__BODY_POLL) {
        kvxfer__reply__free_unpacked(r, NULL);
        return kvx__fail(c, KVX_ERR_PROTOCOL, "poll: reply without a batch");
    }
    size_t n = r->poll->n_events;
    kvx__ev_t *ev = malloc((n + 1) * sizeof(*ev));
    if (!ev) {
        kvxfer__reply__free_unpacked(r, NULL);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        const Kvxfer__Event *e = r->poll->events[i];
        ev[i] = (kvx__ev_t){.kind = e->kind,
                            .code = e->code,
                            .message = e->message,
                            .key = e->key.data,
                            .key_len = e->key.len,
                            .aux = e->aux.data,
                            .aux_len = e->aux.len};
    }
    /* once after a reconnection: the engine hears it, last in the new
     * daemon's first batch */
    char told[256];
    int nt = kvx__told(c, &ev[n], told, sizeof(told));
    rc = kvx__batch_make(c, kvx__batch_seq(c, r->poll->batch), ev, n + nt, out);
    if (!rc) /* each event ends its request: no longer in flight */
        for (size_t i = 0; i < n; i++)
            kvx__untrack(c, ev[i].key, ev[i].key_len);
    free(ev);
    kvxfer__reply__free_unpacked(r, NULL);
    return rc;
}

int kvx__batch_make(kvx_client_t *c, uint64_t seq, const kvx__ev_t *ev,
                    size_t n, kvx_batch_t **out)
{
    /* one allocation: batch, events, then each event's message, key and
     * aux bytes */
    size_t strbytes = 0;
    for (size_t i = 0; i < n; i++)
        strbytes += strlen(ev[i].message) + 1 + ev[i].key_len + ev[i].aux_len;
    kvx_batch_t *b = malloc(sizeof(*b) + n * sizeof(kvx_event_t) + strbytes);
    if (!b)
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    b->seq = seq;
    b->num_events = (uint32_t)n;
    b->events = (kvx_event_t *)(b + 1);
    char *s = (char *)(b->events + n);
    for (size_t i = 0; i < n; i++) {
        const kvx__ev_t *e = &ev[i];
        b->events[i].request_id = reqkey_to_u64(e->key, e->key_len);
        b->events[i].kind = (kvx_event_kind_t)e->kind;
        b->events[i].code = e->code;
        b->events[i].message = s;
        size_t l = strlen(e->message) + 1;
        memcpy(s, e->message, l);
        s += l;
        b->events[i].key = (const uint8_t *)s;
        b->events[i].key_len = (uint32_t)e->key_len;
        if (e->key_len)
            memcpy(s, e->key, e->key_len);
        s += e->key_len;
        b->events[i].aux = e->aux_len ? (const uint8_t *)s : NULL;
        b->events[i].aux_len = (uint32_t)e->aux_len;
        if (e->aux_len)
            memcpy(s, e->aux, e->aux_len);
        s += e->aux_len;
    }
    *out = b;
    return 0;
}

void kvx_batch_free(kvx_batch_t *b)
{
    free(b);
}

int kvx_cancel(kvx_client_t *c, uint64_t request_id, int timeout_ms)
{
    reqkey_t k;
    reqkey_from_u64(&k, request_id);
    return kvx_cancel_key(c, k.b, k.len, timeout_ms);
}

int kvx_cancel_key(kvx_client_t *c, const void *key, size_t key_len,
                   int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = kvx__key_arg(c, "kvx_cancel_key", key, key_len);
    if (rc)
        return rc;
    Kvxfer__Cancel m = KVXFER__CANCEL__INIT;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_CANCEL;
    rq.cancel = &m;
    return kvx__call(c, &rq, -1, timeout_ms, NULL);
}

int kvx__pace_send(kvx_client_t *c, uint64_t per_ms, uint32_t hold_ms,
                   int timeout_ms)
{
    Kvxfer__GpuPace m = KVXFER__GPU_PACE__INIT;
    m.bytes_per_ms = per_ms;
    m.hold_ms = hold_ms;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_GPU_PACE;
    rq.gpu_pace = &m;
    return kvx__call(c, &rq, -1, timeout_ms, NULL);
}

int kvx_gpu_pace(kvx_client_t *c, uint64_t bytes_per_ms, uint32_t hold_ms,
                 int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    c->err[0] = 0;
    c->answered = 0;
    /* an observer's daemon is not known: it answers STATE (no Hello) */
    if (c->rv.has_hello && c->daemon_minor < 8)
        return kvx__fail(c, KVX_ERR_VERSION,
                         "kvx_gpu_pace: the daemon speaks protocol 2.%u; a "
                         "GPU pace needs 2.8",
                         c->daemon_minor);
    int rc = kvx__pace_send(c, bytes_per_ms, hold_ms, timeout_ms);
    if (!rc) { /* what a reconnection sets again */
        c->rv.pace_per_ms = bytes_per_ms;
        c->rv.pace_hold_ms = hold_ms;
        c->rv.pace_at_ms = kvx__now_ms();
    }
    return rc;
}

int kvx_release(kvx_client_t *c, const void *params, size_t params_len,
                int timeout_ms)
{
    if (!c || (!params && params_len))
        return KVX_ERR_INVALID;
    Kvxfer__Release m = KVXFER__RELEASE__INIT;
    m.context_params.data = (uint8_t *)params;
    m.context_params.len = params_len;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_RELEASE;
    rq.release = &m;
    return kvx__call(c, &rq, -1, timeout_ms, NULL);
}

int kvx_release_by_key(kvx_client_t *c, const char *ctx_instance,
                       const char *ctx_address, const void *ctx_key,
                       size_t ctx_key_len, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc =
        kvx__key_arg(c, "kvx_release_by_key: context", ctx_key, ctx_key_len);
    if (rc)
        return rc;
    if (!ctx_instance || !ctx_instance[0] || !ctx_address || !ctx_address[0])
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: context_instance or context_address is NULL or "
                         "empty",
                         __func__);
    Kvxfer__Release m = KVXFER__RELEASE__INIT;
    m.context_instance = (char *)ctx_instance;
    m.context_address = (char *)ctx_address;
    m.context_key.data = (uint8_t *)ctx_key;
    m.context_key.len = ctx_key_len;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_RELEASE;
    rq.release = &m;
    return kvx__call(c, &rq, -1, timeout_ms, NULL);
}
