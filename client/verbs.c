/*
 * verbs — libkvxfer's verbs of 3.0: kvx_publish and kvx_fetch (one
 * request or a batch of them), kvx_ready, kvx_progress and kvx_reserve,
 * each described
 * by an args struct whose field_mask says which members are set
 * (kvxfer.h). The 2.x variants
 * (compat.c) fill an args struct and come here, so every form goes
 * through one check of its arguments and one way to the daemon.
 *
 * A batch is one write of every item's request (conn.c's call_many) and
 * its replies; each reply carries its own status and message, which
 * become the item's outcome.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "common/reqkey.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"

/* The field_mask bits this library knows. */
#define PUBLISH_KNOWN (KVX_PUBLISH_FIELD_LEASE * 2 - 1)
#define FETCH_KNOWN (KVX_FETCH_FIELD_ITEMS * 2 - 1)
#define PUBLISH_FLAGS_KNOWN KVX_PUBLISH_LAYERWISE

/* Bit b's name, for messages: field_names[verb][b]. */
static const char *const publish_fields[] = {
    "KEY",   "BLOCKS",  "NUM_TOKENS", "PARAMS", "AUX",   "GROUPS",
    "FLAGS", "OUTCOME", "TIMEOUT",    "ITEMS",  "LEASE",
};
static const char *const fetch_fields[] = {
    "KEY",     "BLOCKS", "PARAMS",  "CONTEXT", "SKIP_TOKENS",
    "DP_RANK", "GROUPS", "OUTCOME", "TIMEOUT", "ITEMS",
};

/* How a verb's args are checked: its name in messages, its bits. */
typedef struct {
    const char *prefix; /* "KVX_PUBLISH_FIELD_" */
    const char *const *names;
    uint64_t known;
} verb_t;

static const verb_t PUBLISH = {"KVX_PUBLISH_FIELD_", publish_fields,
                               PUBLISH_KNOWN};
static const verb_t FETCH = {"KVX_FETCH_FIELD_", fetch_fields, FETCH_KNOWN};
static const char *const ready_fields[] = {
    "KEY", "LAYERS", "TOKENS", "GROUP", "CUDA_EVENT", "TIMEOUT",
};
static const char *const progress_fields[] = {
    "KEY", "GROUP", "LAYERS", "ENDED", "TIMEOUT",
};
static const verb_t READY = {"KVX_READY_FIELD_", ready_fields,
                             KVX_READY_FIELD_TIMEOUT * 2 - 1};
static const verb_t PROGRESS = {"KVX_PROGRESS_FIELD_", progress_fields,
                                KVX_PROGRESS_FIELD_TIMEOUT * 2 - 1};
static const char *const reserve_fields[] = {
    "KEY",    "INSTANCE", "NUM_TOKENS", "PARAMS",  "POOL",
    "GROUPS", "TIMEOUT",  "LEASE",      "OUTCOME", "ITEMS",
};
static const verb_t RESERVE = {"KVX_RESERVE_FIELD_", reserve_fields,
                               KVX_RESERVE_FIELD_ITEMS * 2 - 1};
static const char *const renew_fields[] = {
    "PARAMS",
    "OUTCOMES",
    "TIMEOUT",
};
static const verb_t RENEW = {"KVX_RENEW_FIELD_", renew_fields,
                             KVX_RENEW_FIELD_TIMEOUT * 2 - 1};

static int bit_index(uint64_t bit)
{
    return __builtin_ctzll(bit);
}

/* field_mask has no bit this library does not know: 0, or
 * KVX_ERR_INVALID naming the lowest such bit. */
static int mask_known(kvx_client_t *c, const char *what, const verb_t *v,
                      uint64_t mask)
{
    uint64_t bad = mask & ~v->known;
    if (!bad)
        return 0;
    return kvx__fail(c, KVX_ERR_INVALID,
                     "%s: field_mask bit 0x%llx is unknown to libkvxfer %s "
                     "(it knows bits 0x%llx: %s%s to %s%s)",
                     what, (unsigned long long)(bad & -bad), KVX_VERSION_STRING,
                     (unsigned long long)v->known, v->prefix, v->names[0],
                     v->prefix, v->names[bit_index(v->known + 1) - 1]);
}

/* A required bit is set: 0, or KVX_ERR_INVALID naming it. */
static int mask_has(kvx_client_t *c, const char *what, const verb_t *v,
                    uint64_t mask, uint64_t bit)
{
    if (mask & bit)
        return 0;
    return kvx__fail(c, KVX_ERR_INVALID,
                     "%s: field_mask lacks %s%s (a required field)", what,
                     v->prefix, v->names[bit_index(bit)]);
}

/* An item of a batch sets neither ITEMS nor TIMEOUT (the batch's). */
static int item_mask(kvx_client_t *c, const char *what, const verb_t *v,
                     uint64_t mask, uint64_t items, uint64_t timeout)
{
    uint64_t bad = mask & (items | timeout);
    if (!bad)
        return 0;
    return kvx__fail(c, KVX_ERR_INVALID,
                     "%s: field_mask has %s%s, which only the batch's args "
                     "set",
                     what, v->prefix, v->names[bit_index(bad & -bad)]);
}

/* A batch's args set items, timeout_ms and outcome only. */
static int batch_mask(kvx_client_t *c, const char *fn, const verb_t *v,
                      uint64_t mask, uint64_t allowed)
{
    uint64_t bad = mask & ~allowed;
    if (!bad)
        return 0;
    return kvx__fail(c, KVX_ERR_INVALID,
                     "%s: field_mask has %s%s beside %sITEMS: a batch's "
                     "args set only items, timeout_ms and outcome (each item "
                     "its own fields)",
                     fn, v->prefix, v->names[bit_index(bad & -bad)], v->prefix);
}

static void outcome_set(kvx_outcome_t *o, int rc, int answered, const char *msg)
{
    o->code = rc;
    o->answered = answered;
    snprintf(o->message, sizeof(o->message), "%s", rc ? msg : "");
}

/* ---- building the messages -------------------------------------------- */

typedef struct {
    Kvxfer__Publish m;
    Kvxfer__GroupBlocks gm[KVX_MAX_GROUPS], *gmp[KVX_MAX_GROUPS];
} publish_msg_t;

/* Check a's fields (what names them in messages) and build its message
 * into pm; the pointers of a are borrowed. */
static int publish_msg(kvx_client_t *c, const char *what,
                       const kvx_publish_args_t *a, publish_msg_t *pm)
{
    uint64_t f = a->field_mask;
    int rc = mask_known(c, what, &PUBLISH, f);
    if (!rc)
        rc = mask_has(c, what, &PUBLISH, f, KVX_PUBLISH_FIELD_KEY);
    if (!rc)
        rc = kvx__key_arg(c, what, a->key, a->key_len);
    if (!rc)
        rc = mask_has(c, what, &PUBLISH, f, KVX_PUBLISH_FIELD_BLOCKS);
    if (!rc)
        rc = mask_has(c, what, &PUBLISH, f, KVX_PUBLISH_FIELD_NUM_TOKENS);
    if (!rc)
        rc = mask_has(c, what, &PUBLISH, f, KVX_PUBLISH_FIELD_PARAMS);
    if (rc)
        return rc;
    const void *aux = f & KVX_PUBLISH_FIELD_AUX ? a->aux : NULL;
    size_t aux_len = f & KVX_PUBLISH_FIELD_AUX ? a->aux_len : 0;
    uint32_t flags = f & KVX_PUBLISH_FIELD_FLAGS ? a->flags : 0;
    const kvx_group_t *groups = f & KVX_PUBLISH_FIELD_GROUPS ? a->groups : NULL;
    uint32_t ngroups = f & KVX_PUBLISH_FIELD_GROUPS ? a->num_groups : 0;
    if ((!a->blocks && a->num_blocks) || !a->params)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0 (%s)", what,
                         a->params ? "blocks" : "params");
    if (!aux && aux_len)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: aux is NULL with aux_len %zu",
                         what, aux_len);
    if (flags & ~PUBLISH_FLAGS_KNOWN)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: flags bit 0x%x is unknown to libkvxfer %s (it "
                         "knows KVX_PUBLISH_LAYERWISE)",
                         what,
                         (flags & ~PUBLISH_FLAGS_KNOWN) &
                             -(flags & ~PUBLISH_FLAGS_KNOWN),
                         KVX_VERSION_STRING);
    /* a 2.0 daemon would ignore the flag and read the blocks at once */
    if ((flags & KVX_PUBLISH_LAYERWISE) && c->daemon_minor < 1)
        return kvx__fail(c, KVX_ERR_VERSION,
                         "%s: the daemon speaks protocol 2.%u; layer-wise "
                         "offers need 2.1",
                         what, c->daemon_minor);
    uint32_t lease = f & KVX_PUBLISH_FIELD_LEASE ? a->lease_ms : 0;
    /* an older daemon would ignore it and hold the offer its own lease */
    if (lease && c->daemon_minor < 6)
        return kvx__fail(c, KVX_ERR_VERSION,
                         "%s: the daemon speaks protocol 2.%u; lease_ms needs "
                         "2.6",
                         what, c->daemon_minor);
    if ((rc = kvx__groups_msg(c, what, groups, ngroups, KVX__GROUPS_PUBLISH,
                              pm->gm, pm->gmp)))
        return rc;
    Kvxfer__Publish *m = &pm->m;
    kvxfer__publish__init(m);
    m->n_groups = ngroups;
    m->groups = pm->gmp;
    m->key.data = (uint8_t *)a->key;
    m->key.len = a->key_len;
    m->pool_id = kvx__pool_daemon(c, a->pool_id);
    m->n_blocks = a->num_blocks;
    m->blocks = (uint32_t *)a->blocks;
    m->num_tokens = a->num_tokens;
    m->aux.data = (uint8_t *)aux;
    m->aux.len = aux_len;
    m->layerwise = (flags & KVX_PUBLISH_LAYERWISE) != 0;
    m->lease_ms = lease;
    return 0;
}

typedef struct {
    Kvxfer__Fetch f;
    Kvxfer__FetchByKey k;
    Kvxfer__GroupBlocks gm[KVX_MAX_GROUPS], *gmp[KVX_MAX_GROUPS];
} fetch_msg_t;

/* Check a's fields and build its request (a Fetch, or a FetchByKey with
 * CONTEXT) into fm and rq. */
static int fetch_msg(kvx_client_t *c, const char *what,
                     const kvx_fetch_args_t *a, fetch_msg_t *fm,
                     Kvxfer__Request *rq)
{
    uint64_t f = a->field_mask;
    int rc = mask_known(c, what, &FETCH, f);
    if (!rc)
        rc = mask_has(c, what, &FETCH, f, KVX_FETCH_FIELD_KEY);
    if (!rc)
        rc = kvx__key_arg(c, what, a->key, a->key_len);
    if (!rc)
        rc = mask_has(c, what, &FETCH, f, KVX_FETCH_FIELD_BLOCKS);
    if (rc)
        return rc;
    int by_key = (f & KVX_FETCH_FIELD_CONTEXT) != 0;
    if (by_key == !!(f & KVX_FETCH_FIELD_PARAMS))
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: field_mask has %s of KVX_FETCH_FIELD_PARAMS and "
                         "KVX_FETCH_FIELD_CONTEXT (exactly one says which "
                         "offer)",
                         what, by_key ? "both" : "neither");
    if (by_key) {
        char ctx[80];
        snprintf(ctx, sizeof(ctx), "%s: context", what);
        if ((rc = kvx__key_arg(c, ctx, a->context_key, a->context_key_len)))
            return rc;
    }
    uint32_t skip = f & KVX_FETCH_FIELD_SKIP_TOKENS ? a->skip_tokens : 0;
    uint32_t dp = f & KVX_FETCH_FIELD_DP_RANK ? a->dp_rank : 0;
    const kvx_group_t *groups = f & KVX_FETCH_FIELD_GROUPS ? a->groups : NULL;
    uint32_t ngroups = f & KVX_FETCH_FIELD_GROUPS ? a->num_groups : 0;
    if ((!a->blocks && a->num_blocks) ||
        (by_key ? !a->context_instance || !a->context_address
                : !a->params && a->params_len))
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0 (%s)", what,
                         !a->blocks && a->num_blocks ? "blocks"
                         : by_key ? "context_instance or context_address"
                                  : "params");
    if ((rc = kvx__groups_msg(c, what, groups, ngroups, KVX__GROUPS_FETCH,
                              fm->gm, fm->gmp)))
        return rc;
    kvxfer__request__init(rq);
    if (by_key) {
        Kvxfer__FetchByKey *m = &fm->k;
        kvxfer__fetch_by_key__init(m);
        m->n_groups = ngroups;
        m->groups = fm->gmp;
        m->key.data = (uint8_t *)a->key;
        m->key.len = a->key_len;
        m->context_instance = (char *)a->context_instance;
        m->context_address = (char *)a->context_address;
        m->context_key.data = (uint8_t *)a->context_key;
        m->context_key.len = a->context_key_len;
        m->pool_id = kvx__pool_daemon(c, a->pool_id);
        m->n_blocks = a->num_blocks;
        m->blocks = (uint32_t *)a->blocks;
        m->skip_tokens = skip;
        m->dp_rank = dp;
        rq->body_case = KVXFER__REQUEST__BODY_FETCH_BY_KEY;
        rq->fetch_by_key = m;
        return 0;
    }
    Kvxfer__Fetch *m = &fm->f;
    kvxfer__fetch__init(m);
    m->n_groups = ngroups;
    m->groups = fm->gmp;
    m->key.data = (uint8_t *)a->key;
    m->key.len = a->key_len;
    m->context_params.data = (uint8_t *)a->params;
    m->context_params.len = a->params_len;
    m->pool_id = kvx__pool_daemon(c, a->pool_id);
    m->n_blocks = a->num_blocks;
    m->blocks = (uint32_t *)a->blocks;
    m->skip_tokens = skip;
    m->dp_rank = dp;
    rq->body_case = KVXFER__REQUEST__BODY_FETCH;
    rq->fetch = m;
    return 0;
}

/* ---- one request ------------------------------------------------------- */

static int publish_one(kvx_client_t *c, const char *fn,
                       const kvx_publish_args_t *a, int timeout_ms)
{
    publish_msg_t pm;
    int rc = publish_msg(c, fn, a, &pm);
    if (rc)
        return rc;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_PUBLISH;
    rq.publish = &pm.m;
    return kvx__tracked_call(c, &rq, a->key, a->key_len, a->params, timeout_ms);
}

static int fetch_one(kvx_client_t *c, const char *fn, const kvx_fetch_args_t *a,
                     int timeout_ms)
{
    fetch_msg_t fm;
    Kvxfer__Request rq;
    int rc = fetch_msg(c, fn, a, &fm, &rq);
    if (rc)
        return rc;
    return kvx__tracked_call(c, &rq, a->key, a->key_len, NULL, timeout_ms);
}

/* ---- batches ----------------------------------------------------------- */

/* What a batch of either verb needs: its requests, the keys to track
 * (made before it is sent: those the daemon takes are tracked, the rest
 * freed) and the replies. */
typedef struct {
    size_t n;
    Kvxfer__Request *rq;
    kvx__key_t **keys;
    Kvxfer__Reply **rp;
} batch_t;

static int batch_alloc(kvx_client_t *c, batch_t *b, size_t n)
{
    memset(b, 0, sizeof(*b));
    b->n = n;
    if (!(b->rq = calloc(n, sizeof(*b->rq))) ||
        !(b->keys = calloc(n, sizeof(*b->keys))))
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    return 0;
}

static void batch_free(batch_t *b)
{
    for (size_t i = 0; b->keys && i < b->n; i++)
        free(b->keys[i]);
    free(b->keys);
    kvx__replies_free(b->rp, b->n);
    free(b->rq);
}

/* Item i's reply: its status, and its message in its outcome; the first
 * failing item's message, naming it, becomes the call's error. */
static int item_status(kvx_client_t *c, const char *fn, size_t i,
                       const void *key, size_t key_len, const Kvxfer__Reply *r,
                       int *first_rc)
{
    int rc = r->status ? kvx__reply_code(r->status) : 0;
    if (rc && !*first_rc) {
        char k[REQKEY_STR_MAX];
        *first_rc = rc;
        snprintf(c->err, sizeof(c->err), "%s: item %zu (key %s): %s", fn, i,
                 reqkey_str(key, key_len, k), r->message);
    }
    return rc;
}

/* Send the batch's requests (built) and read its replies. */
static int batch_call(kvx_client_t *c, batch_t *b, const void *const *key,
                      const size_t *key_len, int timeout_ms)
{
    for (size_t i = 0; i < b->n; i++)
        if (!(b->keys[i] = kvx__key_new(c, key[i], key_len[i])))
            return KVX_ERR_NOMEM;
    return kvx__call_many(c, b->rq, b->n, timeout_ms, &b->rp);
}

/* The call's items, checked: 0, or KVX_ERR_INVALID (nothing sent). */
static int batch_items(kvx_client_t *c, const char *fn, const void *items,
                       size_t n)
{
    if ((!items && n) || n > KVX_MANY_MAX)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: %zu items%s (at most %u)", fn,
                         n, items ? "" : " at NULL", KVX_MANY_MAX);
    return 0;
}

/* Every item's outcome says rc (the exchange failed, or an item was
 * invalid and nothing was sent); bad: the invalid one's, or n. */
static void outcomes_all(kvx_client_t *c, kvx_outcome_t *const *o, size_t n,
                         size_t bad, int rc)
{
    for (size_t i = 0; i < n; i++)
        if (o[i])
            outcome_set(o[i], rc, 0,
                        i == bad || bad == n ? c->err
                                             : "not sent: another item of the "
                                               "batch was invalid");
}

static kvx_outcome_t *publish_outcome(const kvx_publish_args_t *a)
{
    return a->field_mask & KVX_PUBLISH_FIELD_OUTCOME ? a->outcome : NULL;
}

static kvx_outcome_t *fetch_outcome(const kvx_fetch_args_t *a)
{
    return a->field_mask & KVX_FETCH_FIELD_OUTCOME ? a->outcome : NULL;
}

static int publish_batch(kvx_client_t *c, const char *fn,
                         const kvx_publish_args_t *a, int timeout_ms,
                         int *replied)
{
    const uint64_t ok = KVX_PUBLISH_FIELD_ITEMS | KVX_PUBLISH_FIELD_TIMEOUT |
                        KVX_PUBLISH_FIELD_OUTCOME;
    int rc = batch_mask(c, fn, &PUBLISH, a->field_mask, ok);
    if (!rc)
        rc = batch_items(c, fn, a->items, a->num_items);
    if (rc || !a->num_items)
        return rc;
    size_t n = a->num_items;
    const kvx_publish_args_t *it = a->items;
    publish_msg_t *pm = calloc(n, sizeof(*pm));
    kvx_outcome_t **o = calloc(n, sizeof(*o));
    const void **keys = calloc(n, sizeof(*keys));
    size_t *lens = calloc(n, sizeof(*lens));
    batch_t b;
    int first = 0;
    if ((rc = batch_alloc(c, &b, n)) || !pm || !o || !keys || !lens) {
        rc = rc ? rc : kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        o[i] = publish_outcome(&it[i]);
        if (it[i].params && it[i].field_mask & KVX_PUBLISH_FIELD_PARAMS)
            *it[i].params = (kvx_context_params_t){NULL, 0};
    }
    for (size_t i = 0; i < n; i++) {
        char what[64];
        snprintf(what, sizeof(what), "%s: item %zu", fn, i);
        if ((rc = item_mask(c, what, &PUBLISH, it[i].field_mask,
                            KVX_PUBLISH_FIELD_ITEMS,
                            KVX_PUBLISH_FIELD_TIMEOUT)) ||
            (rc = publish_msg(c, what, &it[i], &pm[i]))) {
            outcomes_all(c, o, n, i, rc);
            goto out;
        }
        kvxfer__request__init(&b.rq[i]);
        b.rq[i].body_case = KVXFER__REQUEST__BODY_PUBLISH;
        b.rq[i].publish = &pm[i].m;
        keys[i] = it[i].key;
        lens[i] = it[i].key_len;
    }
    if ((rc = batch_call(c, &b, keys, lens, timeout_ms))) {
        outcomes_all(c, o, n, n, rc);
        goto out;
    }
    *replied = 1;
    for (size_t i = 0; i < n; i++) {
        const Kvxfer__Reply *r = b.rp[i];
        int st = item_status(c, fn, i, it[i].key, it[i].key_len, r, &first);
        const char *msg = r->message;
        char keep[sizeof(c->err)];
        if (!st) {
            kvx__track(c, b.keys[i]); /* taken: its event will come */
            b.keys[i] = NULL;
            char what[64];
            snprintf(what, sizeof(what), "%s: item %zu", fn, i);
            memcpy(keep, c->err, sizeof(keep));
            st = kvx__params_take(c, what, r, it[i].params);
            if (st) {
                msg = c->err; /* the library's own failure */
                if (!first)
                    first = st;
                else
                    memcpy(c->err, keep, sizeof(keep));
            }
        }
        if (o[i])
            outcome_set(o[i], st, 1, msg);
    }
    rc = first;
out:
    batch_free(&b);
    free(pm);
    free(o);
    free(keys);
    free(lens);
    return rc;
}

static int fetch_batch(kvx_client_t *c, const char *fn,
                       const kvx_fetch_args_t *a, int timeout_ms, int *replied)
{
    const uint64_t ok = KVX_FETCH_FIELD_ITEMS | KVX_FETCH_FIELD_TIMEOUT |
                        KVX_FETCH_FIELD_OUTCOME;
    int rc = batch_mask(c, fn, &FETCH, a->field_mask, ok);
    if (!rc)
        rc = batch_items(c, fn, a->items, a->num_items);
    if (rc || !a->num_items)
        return rc;
    size_t n = a->num_items;
    const kvx_fetch_args_t *it = a->items;
    fetch_msg_t *fm = calloc(n, sizeof(*fm));
    kvx_outcome_t **o = calloc(n, sizeof(*o));
    const void **keys = calloc(n, sizeof(*keys));
    size_t *lens = calloc(n, sizeof(*lens));
    batch_t b;
    int first = 0;
    if ((rc = batch_alloc(c, &b, n)) || !fm || !o || !keys || !lens) {
        rc = rc ? rc : kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        o[i] = fetch_outcome(&it[i]);
    for (size_t i = 0; i < n; i++) {
        char what[64];
        snprintf(what, sizeof(what), "%s: item %zu", fn, i);
        if ((rc = item_mask(c, what, &FETCH, it[i].field_mask,
                            KVX_FETCH_FIELD_ITEMS, KVX_FETCH_FIELD_TIMEOUT)) ||
            (rc = fetch_msg(c, what, &it[i], &fm[i], &b.rq[i]))) {
            outcomes_all(c, o, n, i, rc);
            goto out;
        }
        keys[i] = it[i].key;
        lens[i] = it[i].key_len;
    }
    if ((rc = batch_call(c, &b, keys, lens, timeout_ms))) {
        outcomes_all(c, o, n, n, rc);
        goto out;
    }
    *replied = 1;
    for (size_t i = 0; i < n; i++) {
        const Kvxfer__Reply *r = b.rp[i];
        int st = item_status(c, fn, i, it[i].key, it[i].key_len, r, &first);
        if (!st) { /* taken: its event will come */
            kvx__track(c, b.keys[i]);
            b.keys[i] = NULL;
        }
        if (o[i])
            outcome_set(o[i], st, 1, r->message);
    }
    rc = first;
out:
    batch_free(&b);
    free(fm);
    free(o);
    free(keys);
    free(lens);
    return rc;
}

/* ---- the calls --------------------------------------------------------- */

int kvx__publish(kvx_client_t *c, const char *fn, const kvx_publish_args_t *a,
                 int *replied)
{
    int none;
    replied = replied ? replied : &none;
    *replied = 0;
    if (!c)
        return KVX_ERR_INVALID;
    c->err[0] = 0;
    c->answered = 0;
    if (!a)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: args is NULL", fn);
    uint64_t f = a->field_mask;
    int t =
        f & KVX_PUBLISH_FIELD_TIMEOUT ? a->timeout_ms : KVX_TIMEOUT_DEFAULT_MS;
    int rc = mask_known(c, fn, &PUBLISH, f);
    if (!rc)
        rc = f & KVX_PUBLISH_FIELD_ITEMS ? publish_batch(c, fn, a, t, replied)
                                         : publish_one(c, fn, a, t);
    if (publish_outcome(a))
        outcome_set(a->outcome, rc, c->answered, c->err);
    return rc;
}

int kvx__fetch(kvx_client_t *c, const char *fn, const kvx_fetch_args_t *a,
               int *replied)
{
    int none;
    replied = replied ? replied : &none;
    *replied = 0;
    if (!c)
        return KVX_ERR_INVALID;
    c->err[0] = 0;
    c->answered = 0;
    if (!a)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: args is NULL", fn);
    uint64_t f = a->field_mask;
    int t =
        f & KVX_FETCH_FIELD_TIMEOUT ? a->timeout_ms : KVX_TIMEOUT_DEFAULT_MS;
    int rc = mask_known(c, fn, &FETCH, f);
    if (!rc)
        rc = f & KVX_FETCH_FIELD_ITEMS ? fetch_batch(c, fn, a, t, replied)
                                       : fetch_one(c, fn, a, t);
    if (fetch_outcome(a))
        outcome_set(a->outcome, rc, c->answered, c->err);
    return rc;
}

int kvx_publish(kvx_client_t *c, const kvx_publish_args_t *a)
{
    return kvx__publish(c, "kvx_publish", a, NULL);
}

int kvx_fetch(kvx_client_t *c, const kvx_fetch_args_t *a)
{
    return kvx__fetch(c, "kvx_fetch", a, NULL);
}

const char *kvx_version(void)
{
    return KVX_VERSION_STRING;
}

/* ---- kvx_ready, kvx_progress ------------------------------------------ */

int kvx__ready(kvx_client_t *c, const char *fn, const kvx_ready_args_t *a)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!a)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: args is NULL", fn);
    uint64_t f = a->field_mask;
    int rc = mask_known(c, fn, &READY, f);
    if (!rc)
        rc = mask_has(c, fn, &READY, f, KVX_READY_FIELD_KEY);
    if (!rc)
        rc = kvx__key_arg(c, fn, a->key, a->key_len);
    if (!rc)
        rc = mask_has(c, fn, &READY, f, KVX_READY_FIELD_LAYERS);
    if (rc)
        return rc;
    uint32_t group = f & KVX_READY_FIELD_GROUP ? a->group : 0;
    const void *ev = f & KVX_READY_FIELD_CUDA_EVENT ? a->cuda_event : NULL;
    if (a->count == 0)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: count 0", fn);
    if (group && c->daemon_minor < 2)
        return kvx__fail(c, KVX_ERR_VERSION,
                         "%s: the daemon speaks protocol 2.%u; block tables "
                         "need 2.2",
                         fn, c->daemon_minor);
    Kvxfer__LayersReady m = KVXFER__LAYERS_READY__INIT;
    m.group = group;
    m.key.data = (uint8_t *)a->key;
    m.key.len = a->key_len;
    m.first = a->first;
    m.count = a->count;
    m.tokens = f & KVX_READY_FIELD_TOKENS ? a->tokens : 0;
    if (ev) {
        m.cuda_event.data = (uint8_t *)ev;
        m.cuda_event.len = 64;
    }
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_LAYERS_READY;
    rq.layers_ready = &m;
    return kvx__call(c, &rq, -1,
                     f & KVX_READY_FIELD_TIMEOUT ? a->timeout_ms
                                                 : KVX_TIMEOUT_DEFAULT_MS,
                     NULL);
}

int kvx__progress(kvx_client_t *c, const char *fn, const kvx_progress_args_t *a)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!a)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: args is NULL", fn);
    uint64_t f = a->field_mask;
    int rc = mask_known(c, fn, &PROGRESS, f);
    if (!rc)
        rc = mask_has(c, fn, &PROGRESS, f, KVX_PROGRESS_FIELD_KEY);
    if (!rc)
        rc = kvx__key_arg(c, fn, a->key, a->key_len);
    if (!rc)
        rc = mask_has(c, fn, &PROGRESS, f, KVX_PROGRESS_FIELD_LAYERS);
    if (rc)
        return rc;
    if (!a->layers_done || !a->num_layers)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: layers_done or num_layers is NULL", fn);
    uint32_t group = f & KVX_PROGRESS_FIELD_GROUP ? a->group : 0;
    int *ended = f & KVX_PROGRESS_FIELD_ENDED ? a->ended : NULL;
    /* an older daemon would ignore the group and answer for table 0 */
    if (group && c->daemon_minor < 3)
        return kvx__fail(c, KVX_ERR_VERSION,
                         "%s: the daemon speaks protocol 2.%u; a block table's "
                         "progress needs 2.3",
                         fn, c->daemon_minor);
    Kvxfer__FetchProgress m = KVXFER__FETCH_PROGRESS__INIT;
    m.key.data = (uint8_t *)a->key;
    m.key.len = a->key_len;
    m.group = group;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_FETCH_PROGRESS;
    rq.fetch_progress = &m;
    Kvxfer__Reply *r = NULL;
    int t =
        f & KVX_PROGRESS_FIELD_TIMEOUT ? a->timeout_ms : KVX_TIMEOUT_DEFAULT_MS;
    if ((rc = kvx__call(c, &rq, -1, t, &r)))
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_FETCH_PROGRESS) {
        kvxfer__reply__free_unpacked(r, NULL);
        c->broken = 1;
        return kvx__fail(c, KVX_ERR_PROTOCOL,
                         "%s: the daemon's reply has no progress", fn);
    }
    *a->layers_done = r->fetch_progress->layers_done;
    *a->num_layers = r->fetch_progress->num_layers;
    if (ended)
        *ended = r->fetch_progress->ended;
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

int kvx_ready(kvx_client_t *c, const kvx_ready_args_t *a)
{
    return kvx__ready(c, "kvx_ready", a);
}

int kvx_progress(kvx_client_t *c, const kvx_progress_args_t *a)
{
    return kvx__progress(c, "kvx_progress", a);
}

/* ---- kvx_reserve ------------------------------------------------------- */

typedef struct {
    Kvxfer__Reserve m;
    Kvxfer__GroupBlocks gm[KVX_MAX_GROUPS], *gmp[KVX_MAX_GROUPS];
} reserve_msg_t;

/* Check a's fields (what names them in messages) and build its message
 * into rm; the pointers of a are borrowed. */
static int reserve_msg(kvx_client_t *c, const char *what,
                       const kvx_reserve_args_t *a, reserve_msg_t *rm)
{
    uint64_t f = a->field_mask;
    int rc = mask_known(c, what, &RESERVE, f);
    if (!rc)
        rc = mask_has(c, what, &RESERVE, f, KVX_RESERVE_FIELD_KEY);
    if (!rc)
        rc = kvx__key_arg(c, what, a->key, a->key_len);
    if (!rc)
        rc = mask_has(c, what, &RESERVE, f, KVX_RESERVE_FIELD_INSTANCE);
    if (!rc)
        rc = mask_has(c, what, &RESERVE, f, KVX_RESERVE_FIELD_NUM_TOKENS);
    if (!rc)
        rc = mask_has(c, what, &RESERVE, f, KVX_RESERVE_FIELD_PARAMS);
    if (rc)
        return rc;
    if (!a->instance_id || !a->params)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: %s is NULL", what,
                         a->instance_id ? "params" : "instance_id");
    uint32_t pool_id = f & KVX_RESERVE_FIELD_POOL ? a->pool_id : 0;
    const kvx_group_t *groups = f & KVX_RESERVE_FIELD_GROUPS ? a->groups : NULL;
    uint32_t ngroups = f & KVX_RESERVE_FIELD_GROUPS ? a->num_groups : 0;
    /* an observer has no Hello reply, so no daemon version: the
     * params returned say whether the daemon took the groups */
    if ((rc = kvx__groups_msg(c, what, groups, ngroups, KVX__GROUPS_RESERVE,
                              rm->gm, rm->gmp)))
        return rc;
    Kvxfer__Reserve *m = &rm->m;
    kvxfer__reserve__init(m);
    m->instance_id = (char *)a->instance_id;
    m->key.data = (uint8_t *)a->key;
    m->key.len = a->key_len;
    m->num_tokens = a->num_tokens;
    m->pool_id = pool_id ? kvx__pool_daemon(c, pool_id) : 0;
    m->n_groups = ngroups;
    m->groups = ngroups ? rm->gmp : NULL;
    m->lease_ms = f & KVX_RESERVE_FIELD_LEASE ? a->lease_ms : 0;
    return 0;
}

/* The params a reservation got carry what it asked (an older daemon
 * ignores the groups, and the lease): 0, or KVX_ERR_VERSION with the
 * params freed. */
static int reserve_params_check(kvx_client_t *c, const char *what,
                                const kvx_reserve_args_t *a)
{
    uint32_t ngroups =
        a->field_mask & KVX_RESERVE_FIELD_GROUPS ? a->num_groups : 0;
    uint32_t lease = a->field_mask & KVX_RESERVE_FIELD_LEASE ? a->lease_ms : 0;
    if (!ngroups && !lease)
        return 0;
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, a->params->len, a->params->data);
    size_t got = cp ? cp->n_groups : 0;
    uint32_t got_lease = cp ? cp->lease_ms : 0;
    if (cp)
        kvxfer__context_params__free_unpacked(cp, NULL);
    if (got != ngroups) {
        kvx_context_params_free(a->params);
        return kvx__fail(
            c, KVX_ERR_VERSION,
            "%s: the daemon's params carry %zu of the %u groups: it "
            "speaks a protocol before 2.4 (its reservation ends at "
            "its lease)",
            what, got, ngroups);
    }
    if (lease && !got_lease) {
        kvx_context_params_free(a->params);
        return kvx__fail(c, KVX_ERR_VERSION,
                         "%s: the daemon's params carry no lease: it speaks "
                         "a protocol before 2.6 (lease_ms needs 2.6; its "
                         "reservation ends at its own lease)",
                         what);
    }
    return 0;
}

static int reserve_one(kvx_client_t *c, const char *fn,
                       const kvx_reserve_args_t *a, int timeout_ms)
{
    reserve_msg_t rm;
    int rc = reserve_msg(c, fn, a, &rm);
    if (rc)
        return rc;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_RESERVE;
    rq.reserve = &rm.m;
    Kvxfer__Reply *r;
    if ((rc = kvx__call(c, &rq, -1, timeout_ms, &r)))
        return rc;
    rc = kvx__params_take(c, "reserve", r, a->params);
    kvxfer__reply__free_unpacked(r, NULL);
    return rc ? rc : reserve_params_check(c, fn, a);
}

static kvx_outcome_t *reserve_outcome(const kvx_reserve_args_t *a)
{
    return a->field_mask & KVX_RESERVE_FIELD_OUTCOME ? a->outcome : NULL;
}

/* A scheduler's step of reservations in one round trip: as
 * publish_batch(), with no key tracked (a reservation is the ranks'
 * request, not this client's). */
static int reserve_batch(kvx_client_t *c, const char *fn,
                         const kvx_reserve_args_t *a, int timeout_ms)
{
    const uint64_t ok = KVX_RESERVE_FIELD_ITEMS | KVX_RESERVE_FIELD_TIMEOUT |
                        KVX_RESERVE_FIELD_OUTCOME;
    int rc = batch_mask(c, fn, &RESERVE, a->field_mask, ok);
    if (!rc)
        rc = batch_items(c, fn, a->items, a->num_items);
    if (rc || !a->num_items)
        return rc;
    size_t n = a->num_items;
    const kvx_reserve_args_t *it = a->items;
    reserve_msg_t *rm = calloc(n, sizeof(*rm));
    kvx_outcome_t **o = calloc(n, sizeof(*o));
    Kvxfer__Request *rq = calloc(n, sizeof(*rq));
    Kvxfer__Reply **rp = NULL;
    int first = 0;
    if (!rm || !o || !rq) {
        rc = kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        o[i] = reserve_outcome(&it[i]);
        if (it[i].params && it[i].field_mask & KVX_RESERVE_FIELD_PARAMS)
            *it[i].params = (kvx_context_params_t){NULL, 0};
    }
    for (size_t i = 0; i < n; i++) {
        char what[64];
        snprintf(what, sizeof(what), "%s: item %zu", fn, i);
        if ((rc = item_mask(c, what, &RESERVE, it[i].field_mask,
                            KVX_RESERVE_FIELD_ITEMS,
                            KVX_RESERVE_FIELD_TIMEOUT)) ||
            (rc = reserve_msg(c, what, &it[i], &rm[i]))) {
            outcomes_all(c, o, n, i, rc);
            goto out;
        }
        kvxfer__request__init(&rq[i]);
        rq[i].body_case = KVXFER__REQUEST__BODY_RESERVE;
        rq[i].reserve = &rm[i].m;
    }
    if ((rc = kvx__call_many(c, rq, n, timeout_ms, &rp))) {
        outcomes_all(c, o, n, n, rc);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const Kvxfer__Reply *r = rp[i];
        int st = item_status(c, fn, i, it[i].key, it[i].key_len, r, &first);
        const char *msg = r->message;
        char keep[sizeof(c->err)];
        if (!st) {
            char what[64];
            snprintf(what, sizeof(what), "%s: item %zu", fn, i);
            memcpy(keep, c->err, sizeof(keep));
            st = kvx__params_take(c, what, r, it[i].params);
            if (!st)
                st = reserve_params_check(c, what, &it[i]);
            if (st) {
                msg = c->err; /* the library's own failure */
                if (!first)
                    first = st;
                else
                    memcpy(c->err, keep, sizeof(keep));
            }
        }
        if (o[i])
            outcome_set(o[i], st, 1, msg);
    }
    rc = first;
out:
    kvx__replies_free(rp, n);
    free(rm);
    free(o);
    free(rq);
    return rc;
}

int kvx__reserve(kvx_client_t *c, const char *fn, const kvx_reserve_args_t *a)
{
    if (!c)
        return KVX_ERR_INVALID;
    c->err[0] = 0;
    c->answered = 0;
    if (!a)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: args is NULL", fn);
    uint64_t f = a->field_mask;
    int t =
        f & KVX_RESERVE_FIELD_TIMEOUT ? a->timeout_ms : KVX_TIMEOUT_DEFAULT_MS;
    int rc = mask_known(c, fn, &RESERVE, f);
    if (!rc)
        rc = f & KVX_RESERVE_FIELD_ITEMS ? reserve_batch(c, fn, a, t)
                                         : reserve_one(c, fn, a, t);
    if (reserve_outcome(a))
        outcome_set(a->outcome, rc, c->answered, c->err);
    return rc;
}

int kvx_reserve(kvx_client_t *c, const kvx_reserve_args_t *a)
{
    return kvx__reserve(c, "kvx_reserve", a);
}

/* ---- kvx_renew --------------------------------------------------------- */

int kvx_renew(kvx_client_t *c, const kvx_renew_args_t *a)
{
    const char *fn = "kvx_renew";
    if (!c)
        return KVX_ERR_INVALID;
    c->err[0] = 0;
    c->answered = 0;
    if (!a)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: args is NULL", fn);
    uint64_t f = a->field_mask;
    int rc = mask_known(c, fn, &RENEW, f);
    if (!rc)
        rc = mask_has(c, fn, &RENEW, f, KVX_RENEW_FIELD_PARAMS);
    if (rc)
        return rc;
    size_t n = a->num_params;
    kvx_outcome_t *o = f & KVX_RENEW_FIELD_OUTCOMES ? a->outcomes : NULL;
    int t =
        f & KVX_RENEW_FIELD_TIMEOUT ? a->timeout_ms : KVX_TIMEOUT_DEFAULT_MS;
    if (!a->params || !n || n > KVX_MANY_MAX)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: %zu params%s (1 to %u)", fn,
                         n, a->params ? "" : " at NULL", KVX_MANY_MAX);
    for (size_t i = 0; i < n; i++)
        if (!a->params[i].data || !a->params[i].len)
            return kvx__fail(c, KVX_ERR_INVALID,
                             "%s: params[%zu] is empty (NULL or 0 bytes)", fn,
                             i);
    /* a client that said Hello knows its daemon; an observer's older
     * daemon refuses the unknown request (KVX_ERR_PROTOCOL) */
    if (c->rv.has_hello && c->daemon_minor < 6)
        return kvx__fail(c, KVX_ERR_VERSION,
                         "%s: the daemon speaks protocol 2.%u; renewing a "
                         "lease needs 2.6",
                         fn, c->daemon_minor);
    Kvxfer__Renew *m = calloc(n, sizeof(*m));
    Kvxfer__Request *rq = calloc(n, sizeof(*rq));
    Kvxfer__Reply **rp = NULL;
    int first = 0;
    if (!m || !rq) {
        rc = kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        kvxfer__renew__init(&m[i]);
        m[i].context_params.data = a->params[i].data;
        m[i].context_params.len = a->params[i].len;
        kvxfer__request__init(&rq[i]);
        rq[i].body_case = KVXFER__REQUEST__BODY_RENEW;
        rq[i].renew = &m[i];
    }
    if ((rc = kvx__call_many(c, rq, n, t, &rp))) {
        for (size_t i = 0; o && i < n; i++)
            outcome_set(&o[i], rc, 0, c->err);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const Kvxfer__Reply *r = rp[i];
        int st = r->status ? kvx__reply_code(r->status) : 0;
        if (st && !first) {
            kvx_params_info_t info;
            char k[REQKEY_STR_MAX] = "?";
            if (!kvx_params_info(a->params[i].data, a->params[i].len, &info))
                reqkey_str(info.key, info.key_len, k);
            first = st;
            snprintf(c->err, sizeof(c->err), "%s: item %zu (key %s): %s", fn, i,
                     k, r->message);
        }
        if (o)
            outcome_set(&o[i], st, 1, r->message);
    }
    rc = first;
out:
    kvx__replies_free(rp, n);
    free(m);
    free(rq);
    return rc;
}
