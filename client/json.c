/*
 * json — libkvxfer's status and request lists as JSON (kvx_status_json,
 * kvx_requests_json) and the raw replies kvxferctl reads (internal.h):
 * Status, ListRequests (paged) and Drain.
 */
#include <stdarg.h>
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

/* ---- status as JSON --------------------------------------------------- */

struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
};

static void sb_printf(struct sbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void sb_printf(struct sbuf *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n =
            vsnprintf(b->p ? b->p + b->len : NULL, b->p ? room : 0, fmt, ap);
        va_end(ap);
        if (n < 0)
            return;
        if (b->p && (size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t ncap = b->cap ? b->cap * 2 : 1024;
        while (ncap < b->len + (size_t)n + 1)
            ncap *= 2;
        char *np = realloc(b->p, ncap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
}

/* The length of the valid UTF-8 sequence at s (shortest form, no
 * surrogates, at most U+10FFFF), or 0. */
static int utf8_len(const unsigned char *s)
{
    if (s[0] < 0x80)
        return 1;
    int n = s[0] >= 0xc2 && s[0] <= 0xdf   ? 2
            : s[0] >= 0xe0 && s[0] <= 0xef ? 3
            : s[0] >= 0xf0 && s[0] <= 0xf4 ? 4
                                           : 0;
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    if ((n == 3 && s[0] == 0xe0 && s[1] < 0xa0) ||  /* overlong */
        (n == 3 && s[0] == 0xed && s[1] >= 0xa0) || /* surrogate */
        (n == 4 && s[0] == 0xf0 && s[1] < 0x90) ||  /* overlong */
        (n == 4 && s[0] == 0xf4 && s[1] >= 0x90))   /* > U+10FFFF */
        return 0;
    return n;
}

/* A JSON string: quotes, backslashes and control characters escaped, and
 * bytes that are not UTF-8 (a name the daemon took as bytes) as U+FFFD,
 * so that the document always parses. */
static void sb_str(struct sbuf *b, const char *s)
{
    sb_printf(b, "\"");
    const unsigned char *u = (const unsigned char *)s;
    while (*u) {
        int n = utf8_len(u);
        if (*u == '"' || *u == '\\')
            sb_printf(b, "\\%c", *u);
        else if (*u < 0x20)
            sb_printf(b, "\\u%04x", *u);
        else if (n)
            sb_printf(b, "%.*s", n, (const char *)u);
        else
            sb_printf(b, "\\ufffd");
        u += n ? n : 1;
    }
    sb_printf(b, "\"");
}

static const char *role_name(int role)
{
    switch (role) {
    case 1:
        return "context";
    case 2:
        return "generation";
    case 3:
        return "both";
    default:
        return "none";
    }
}

static void counts_json(struct sbuf *b, Kvxfer__Count **c, size_t n)
{
    sb_printf(b, "{");
    for (size_t i = 0; i < n; i++) {
        sb_printf(b, "%s", i ? "," : "");
        sb_str(b, c[i]->name);
        sb_printf(b, ":%llu", (unsigned long long)c[i]->value);
    }
    sb_printf(b, "}");
}

/* ucx's rails: ,"topology":..,"rails":[..],"gpu_rails":[..] */
static void json_rails(struct sbuf *b, const Kvxfer__UcxInfo *u)
{
    sb_printf(b, ",\"topology\":");
    sb_str(b, u->topology);
    sb_printf(b, ",\"rails\":[");
    for (size_t i = 0; i < u->n_rails; i++) {
        const Kvxfer__RailInfo *r = u->rails[i];
        sb_printf(b, "%s{\"nic\":", i ? "," : "");
        sb_str(b, r->nic);
        sb_printf(b, ",\"pci\":");
        sb_str(b, r->pci);
        sb_printf(b, ",\"numa\":%d,\"lanes\":%u}", (int)r->numa, r->lanes);
    }
    sb_printf(b, "],\"gpu_rails\":[");
    for (size_t i = 0; i < u->n_gpu_rails; i++) {
        const Kvxfer__GpuRails *g = u->gpu_rails[i];
        sb_printf(b, "%s{\"gpu\":", i ? "," : "");
        sb_str(b, g->gpu);
        sb_printf(b, ",\"rails\":[");
        for (size_t k = 0; k < g->n_rails; k++) {
            sb_printf(b, "%s", k ? "," : "");
            sb_str(b, g->rails[k]);
        }
        sb_printf(b, "],\"distance\":");
        sb_str(b, g->distance);
        sb_printf(b, "}");
    }
    sb_printf(b, "]");
}

static void status_json(struct sbuf *b, const Kvxfer__StatusReply *s)
{
    sb_printf(b, "{\"version\":");
    sb_str(b, s->version);
    sb_printf(b, ",\"build\":");
    sb_str(b, s->build);
    sb_printf(b, ",\"uptime_ms\":%llu,\"daemon_address\":",
              (unsigned long long)s->uptime_ms);
    sb_str(b, s->daemon_address);
    sb_printf(b, ",\"worker_threads\":%u,\"gpu\":", s->worker_threads);
    sb_str(b, s->gpu);
    sb_printf(b, ",\"config\":{");
    for (size_t i = 0; i < s->n_config; i++) {
        const char *kv = s->config[i]->name, *eq = strchr(kv, '=');
        if (!eq)
            continue;
        char key[128];
        snprintf(key, sizeof(key), "%.*s", (int)(eq - kv), kv);
        sb_printf(b, "%s", i ? "," : "");
        sb_str(b, key);
        sb_printf(b, ":");
        sb_str(b, eq + 1);
    }
    sb_printf(b,
              "},\"sessions_total\":%u,\"pools_total\":%u,"
              "\"instances_total\":%u",
              s->sessions_total, s->pools_total, s->instances_total);
    sb_printf(b, ",\"sessions\":[");
    for (size_t i = 0; i < s->n_sessions; i++) {
        const Kvxfer__SessionInfo *x = s->sessions[i];
        sb_printf(b,
                  "%s{\"session_id\":%llu,\"pid\":%d,\"uid\":%u,"
                  "\"instance\":",
                  i ? "," : "", (unsigned long long)x->session_id, x->pid,
                  x->uid);
        sb_str(b, x->instance_id);
        sb_printf(b, ",\"rank\":%u,\"role\":\"%s\",\"pools\":%u}", x->rank,
                  role_name(x->role), x->pools);
    }
    sb_printf(b, "],\"instances\":[");
    for (size_t i = 0; i < s->n_instances; i++) {
        const Kvxfer__InstanceInfo *x = s->instances[i];
        sb_printf(b, "%s{\"id\":", i ? "," : "");
        sb_str(b, x->id);
        sb_printf(b,
                  ",\"role\":\"%s\",\"ranks\":%u,\"local_ranks\":%u,"
                  "\"connected\":%u,\"joined\":%s,\"spread\":%s,"
                  "\"root\":",
                  role_name(x->role), x->ranks, x->local_ranks, x->connected,
                  x->joined ? "true" : "false", x->spread ? "true" : "false");
        sb_str(b, x->root);
        sb_printf(b,
                  ",\"next_batch\":%llu,\"batches_kept\":%u,"
                  "\"ranks_away\":%u,\"requests\":%u,"
                  "\"epoch\":\"%016llx\"}",
                  (unsigned long long)x->next_batch, x->batches_kept,
                  x->ranks_away, x->requests, (unsigned long long)x->epoch);
    }
    sb_printf(b, "],\"pools\":[");
    for (size_t i = 0; i < s->n_pools; i++) {
        const Kvxfer__PoolInfo *x = s->pools[i];
        sb_printf(b, "%s{\"pool_id\":%u,\"session_id\":%llu,\"kind\":",
                  i ? "," : "", x->pool_id, (unsigned long long)x->session_id);
        sb_str(b, x->kind);
        sb_printf(b, ",\"size\":%llu,\"preset\":", (unsigned long long)x->size);
        sb_str(b, x->preset);
        sb_printf(b, ",\"num_blocks\":%u,\"users\":%u,\"regions\":%u}",
                  x->num_blocks, x->users, x->regions);
    }
    sb_printf(b, "],\"requests_by_state\":");
    counts_json(b, s->requests_by_state, s->n_requests_by_state);
    sb_printf(b,
              ",\"bytes_moved\":%llu,\"transfers_done\":%llu,"
              "\"errors_by_code\":",
              (unsigned long long)s->bytes_moved,
              (unsigned long long)s->transfers_done);
    counts_json(b, s->errors_by_code, s->n_errors_by_code);
    sb_printf(b, ",\"memory\":");
    counts_json(b, s->memory, s->n_memory);
    sb_printf(b,
              ",\"batches_sealed\":%llu,\"batches_resent\":%llu,"
              "\"polls_woken_early\":%llu,\"peers\":[",
              (unsigned long long)s->batches_sealed,
              (unsigned long long)s->batches_resent,
              (unsigned long long)s->polls_woken_early);
    for (size_t i = 0; i < s->n_peers; i++) {
        const Kvxfer__PeerInfo *x = s->peers[i];
        sb_printf(b, "%s{\"address\":", i ? "," : "");
        sb_str(b, x->address);
        sb_printf(b, ",\"state\":");
        sb_str(b, x->state);
        sb_printf(b, ",\"direction\":");
        sb_str(b, x->direction);
        sb_printf(b,
                  ",\"bytes_sent\":%llu,\"bytes_received\":%llu,"
                  "\"errors\":%llu,\"streams\":%u,\"last_seen_ms\":%llu,"
                  "\"lanes\":%u,\"transports\":",
                  (unsigned long long)x->bytes_sent,
                  (unsigned long long)x->bytes_received,
                  (unsigned long long)x->errors, x->streams,
                  (unsigned long long)x->last_seen_ms, x->lanes);
        sb_str(b, x->transports ? x->transports : "");
        sb_printf(b, "}");
    }
    sb_printf(b, "]");
    if (s->ucx) {
        sb_printf(b, ",\"ucx\":{\"listen\":");
        sb_str(b, s->ucx->listen);
        sb_printf(b, ",\"transports\":");
        sb_str(b, s->ucx->transports);
        sb_printf(b, ",\"staging\":");
        sb_str(b, s->ucx->staging);
        sb_printf(b, ",\"version\":");
        sb_str(b, s->ucx->version);
        sb_printf(b,
                  ",\"slots\":%u,\"slot_bytes\":%llu,\"message_bytes\":%llu,"
                  "\"send_window\":%u,\"lanes\":%u,\"lane_ports\":[",
                  s->ucx->slots, (unsigned long long)s->ucx->slot_bytes,
                  (unsigned long long)s->ucx->message_bytes,
                  s->ucx->send_window, s->ucx->lanes);
        for (size_t i = 0; i < s->ucx->n_lane_ports; i++)
            sb_printf(b, "%s%u", i ? "," : "", s->ucx->lane_ports[i]);
        sb_printf(b, "]");
        const Kvxfer__SlotTimes *t[2] = {s->ucx->received, s->ucx->sent};
        for (int i = 0; i < 2; i++) {
            static const Kvxfer__SlotTimes none = KVXFER__SLOT_TIMES__INIT;
            const Kvxfer__SlotTimes *x = t[i] ? t[i] : &none;
            sb_printf(
                b,
                ",\"%s\":{\"slots\":%llu,\"bytes\":%llu,"
                "\"wait_ns\":%llu,\"wire_ns\":%llu,\"copy_ns\":%llu,"
                "\"loop_lag_ns\":%llu,\"ahead\":%llu,"
                "\"direct\":%llu,\"free_slots\":%u,\"gpu_slots\":%u,"
                "\"gpu_bytes\":%llu}",
                i ? "sent" : "received", (unsigned long long)x->slots,
                (unsigned long long)x->bytes, (unsigned long long)x->wait_ns,
                (unsigned long long)x->wire_ns, (unsigned long long)x->copy_ns,
                (unsigned long long)x->loop_lag_ns,
                (unsigned long long)x->ahead, (unsigned long long)x->direct,
                x->free_slots, x->gpu_slots, (unsigned long long)x->gpu_bytes);
        }
        json_rails(b, s->ucx);
        sb_printf(b, "}");
    }
    sb_printf(b, "}");
}

int kvx__status_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    Kvxfer__StatusRequest m = KVXFER__STATUS_REQUEST__INIT;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_STATUS;
    rq.status = &m;
    Kvxfer__Reply *r;
    int rc = kvx__call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_STATUS_REPLY) {
        kvxfer__reply__free_unpacked(r, NULL);
        return kvx__fail(c, KVX_ERR_PROTOCOL, "status: reply without status");
    }
    *out = r;
    return 0;
}

int kvx__metrics_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    Kvxfer__MetricsRequest m = KVXFER__METRICS_REQUEST__INIT;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_METRICS;
    rq.metrics = &m;
    Kvxfer__Reply *r;
    int rc = kvx__call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_METRICS) {
        kvxfer__reply__free_unpacked(r, NULL);
        return kvx__fail(c, KVX_ERR_PROTOCOL,
                         "metrics: reply without metrics (a daemon older "
                         "than 2.7?)");
    }
    *out = r;
    return 0;
}

int kvx__drain(kvx_client_t *c, uint32_t deadline_ms, int wait, char *msg,
               size_t msg_len, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    Kvxfer__Drain m = KVXFER__DRAIN__INIT;
    m.deadline_ms = deadline_ms;
    m.wait = wait != 0;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_DRAIN;
    rq.drain = &m;
    Kvxfer__Reply *r;
    int rc = kvx__call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (msg && msg_len)
        snprintf(msg, msg_len, "%s", r->message ? r->message : "");
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

int kvx__cancel_admin(kvx_client_t *c, const char *instance_id,
                      const uint8_t *key, size_t key_len, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!instance_id || !instance_id[0] || !key || !key_len)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: instance and key are required", __func__);
    Kvxfer__Cancel m = KVXFER__CANCEL__INIT;
    m.instance_id = (char *)instance_id;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_CANCEL;
    rq.cancel = &m;
    Kvxfer__Reply *r;
    int rc = kvx__call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

/* One page of ListRequests after the cursor (the last entry of the page
 * before, or NULL: the first page). */
static int requests_page(kvx_client_t *c, const Kvxfer__RequestInfo *after,
                         int64_t deadline, Kvxfer__Reply **out)
{
    Kvxfer__ListRequests m = KVXFER__LIST_REQUESTS__INIT;
    if (after) {
        m.after_instance = after->instance_id;
        m.after_side = after->side;
        m.after_key = after->key;
    }
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_LIST_REQUESTS;
    rq.list_requests = &m;
    int64_t left = deadline < 0 ? -1 : deadline - kvx__now_ms();
    Kvxfer__Reply *r;
    int rc = kvx__call(c, &rq, -1,
                       deadline < 0 ? -1
                       : left < 1   ? 1
                                    : (int)left,
                       &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_REQUESTS) {
        kvxfer__reply__free_unpacked(r, NULL);
        c->broken = 1;
        return kvx__fail(c, KVX_ERR_PROTOCOL, "requests: unexpected reply");
    }
    *out = r;
    return 0;
}

int kvx__done_get(kvx_client_t *c, uint32_t max, Kvxfer__Reply **out,
                  int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out || !timeout_ms)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    Kvxfer__ListRequests m = KVXFER__LIST_REQUESTS__INIT;
    m.done = 1;
    m.max_entries = max;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_LIST_REQUESTS;
    rq.list_requests = &m;
    Kvxfer__Reply *r;
    int rc = kvx__call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_REQUESTS) {
        kvxfer__reply__free_unpacked(r, NULL);
        c->broken = 1;
        return kvx__fail(c, KVX_ERR_PROTOCOL, "requests: unexpected reply");
    }
    *out = r;
    return 0;
}

/* Every page, gathered into the first reply (the daemon lists at most
 * limits.list_page_entries a reply). Unpacked messages come from malloc
 * (no allocator is given), so entries move between replies. */
int kvx__requests_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    if (timeout_ms == 0)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "timeout_ms 0: a call waits for the daemon's reply; "
                         "give it time (a negative value waits without limit)");
    int64_t deadline = timeout_ms < 0 ? -1 : kvx__now_ms() + timeout_ms;
    Kvxfer__Reply *all;
    int rc = requests_page(c, NULL, deadline, &all);
    if (rc)
        return rc;
    Kvxfer__RequestsReply *a = all->requests;
    while (a->more && a->n_requests) {
        Kvxfer__Reply *r;
        rc = requests_page(c, a->requests[a->n_requests - 1], deadline, &r);
        if (rc) {
            kvxfer__reply__free_unpacked(all, NULL);
            return rc;
        }
        Kvxfer__RequestsReply *p = r->requests;
        Kvxfer__RequestInfo **v =
            p->n_requests
                ? realloc(a->requests,
                          (a->n_requests + p->n_requests) * sizeof(*v))
                : a->requests;
        if (!v) {
            kvxfer__reply__free_unpacked(r, NULL);
            kvxfer__reply__free_unpacked(all, NULL);
            return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
        }
        memcpy(v + a->n_requests, p->requests, p->n_requests * sizeof(*v));
        a->requests = v;
        a->n_requests += p->n_requests;
        a->more = p->more;
        p->n_requests = 0; /* moved */
        kvxfer__reply__free_unpacked(r, NULL);
    }
    a->more = 0;
    *out = all;
    return 0;
}

int kvx_status_json(kvx_client_t *c, char **json, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!json)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: json is NULL", __func__);
    Kvxfer__Reply *r;
    int rc = kvx__status_get(c, &r, timeout_ms);
    if (rc)
        return rc;
    struct sbuf b = {0};
    status_json(&b, r->status_reply);
    kvxfer__reply__free_unpacked(r, NULL);
    if (b.oom || !b.p) {
        free(b.p);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    *json = b.p;
    return 0;
}

int kvx_requests_json(kvx_client_t *c, char **json, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!json)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: json is NULL", __func__);
    Kvxfer__Reply *r;
    int rc = kvx__requests_get(c, &r, timeout_ms);
    if (rc)
        return rc;
    struct sbuf b = {0};
    sb_printf(&b, "[");
    for (size_t i = 0; i < r->requests->n_requests; i++) {
        const Kvxfer__RequestInfo *x = r->requests->requests[i];
        sb_printf(&b, "%s{\"instance\":", i ? "," : "");
        sb_str(&b, x->instance_id);
        char kj[REQKEY_STR_MAX + KVX_MAX_KEY];
        sb_printf(&b, ",\"key\":%s,\"request_id\":%llu,\"side\":",
                  reqkey_json(x->key.data, x->key.len, kj),
                  (unsigned long long)reqkey_to_u64(x->key.data, x->key.len));
        sb_str(&b, x->side);
        sb_printf(&b, ",\"state\":");
        sb_str(&b, x->state);
        sb_printf(&b,
                  ",\"age_ms\":%llu,\"bytes_done\":%llu,"
                  "\"bytes_total\":%llu,\"detail\":",
                  (unsigned long long)x->age_ms,
                  (unsigned long long)x->bytes_done,
                  (unsigned long long)x->bytes_total);
        sb_str(&b, x->detail);
        sb_printf(&b, "}");
    }
    sb_printf(&b, "]");
    kvxfer__reply__free_unpacked(r, NULL);
    if (b.oom || !b.p) {
        free(b.p);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    *json = b.p;
    return 0;
}
