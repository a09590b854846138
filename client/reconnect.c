/*
 * reconnect — a client that outlives its daemon (kvxfer.h, 2.5): the
 * requests it has in flight, so that a lost connection ends each with one
 * PEER_GONE event; what it said and registered, so that it can say it
 * again to the next daemon; and the attempts, made inside the calls that
 * find the daemon gone (the library has no thread).
 *
 * Owns: the keys in flight and lost, the pools' registration records
 * (their packed RegisterPool and dups of their fds), copies of the Hello
 * and the Join. Never logs; never sends anything but what the engine
 * already sent once.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client.h"

#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 1000
#define ATTEMPT_MS 2000
/* The wait after an attempt that found no daemon at all (no socket file,
 * nobody listening): such an attempt costs one connect(), so it goes
 * again soon, and a daemon that comes back is found within this. */
#define NOBODY_MS 5

/* What registered a pool, to register it again. */
typedef struct kvx__pool {
    list_t node;        /* on kvx__revive.pools */
    uint32_t id;        /* the engine's */
    uint32_t daemon_id; /* the current daemon's */
    uint8_t *msg;       /* the RegisterPool, packed */
    size_t msg_len;
    int *fds; /* dups, owned */
    int nfds;
} kvx__pool_t;

#define POOL(n) LIST_OWNER(n, kvx__pool_t, node)

void kvx__rv_init(kvx_client_t *c)
{
    kvx__revive_t *rv = &c->rv;
    memset(rv, 0, sizeof(*rv));
    const char *e = getenv("KVXFER_RECONNECT");
    rv->enabled = !(e && !strcmp(e, "0"));
    rv->backoff_min_ms = BACKOFF_MIN_MS;
    rv->backoff_max_ms = BACKOFF_MAX_MS;
    rv->attempt_timeout_ms = ATTEMPT_MS;
    list_init(&rv->pools);
}

static void keys_free(kvx__key_t *k)
{
    while (k) {
        kvx__key_t *n = k->next;
        free(k);
        k = n;
    }
}

static void strv_free(char **v, uint32_t n)
{
    for (uint32_t i = 0; v && i < n; i++)
        free(v[i]);
    free(v);
}

static void pool_free(kvx__pool_t *p)
{
    for (int i = 0; i < p->nfds; i++)
        close(p->fds[i]);
    free(p->fds);
    free(p->msg);
    free(p);
}

void kvx__rv_cleanup(kvx_client_t *c)
{
    kvx__revive_t *rv = &c->rv;
    for (uint32_t i = 0; i < rv->nbuckets; i++)
        keys_free(rv->keys[i]);
    free(rv->keys);
    keys_free(rv->gone_keys);
    free(rv->instance_id);
    free(rv->layers_per_pp);
    strv_free(rv->addrs, rv->naddrs);
    strv_free(rv->cons, rv->ncons);
    list_t *n;
    while ((n = list_pop(&rv->pools)))
        pool_free(POOL(n));
}

int kvx_set_reconnect(kvx_client_t *c, const kvx_reconnect_t *o)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!o || o->size < sizeof(kvx_reconnect_t))
        return kvx__fail(c, KVX_ERR_INVALID,
                         "kvx_set_reconnect: opts %s (expected size %zu, "
                         "sizeof(kvx_reconnect_t))",
                         o ? "too small" : "is NULL", sizeof(kvx_reconnect_t));
    uint32_t lo = o->backoff_min_ms ? o->backoff_min_ms : BACKOFF_MIN_MS;
    uint32_t hi = o->backoff_max_ms ? o->backoff_max_ms : BACKOFF_MAX_MS;
    if (lo > hi)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "kvx_set_reconnect: backoff_min_ms %u is more than "
                         "backoff_max_ms %u",
                         lo, hi);
    c->rv.enabled = o->enabled != 0;
    c->rv.backoff_min_ms = lo;
    c->rv.backoff_max_ms = hi;
    c->rv.attempt_timeout_ms =
        o->attempt_timeout_ms ? o->attempt_timeout_ms : ATTEMPT_MS;
    return 0;
}

/* ---- requests in flight ------------------------------------------------ */

static uint32_t key_hash(const uint8_t *b, size_t len)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < len; i++)
        h = (h ^ b[i]) * 16777619u;
    return h;
}

/* Twice the buckets once there are more keys than buckets; a table that
 * cannot grow stays as it is (longer chains, nothing lost). */
static void keys_grow(kvx__revive_t *rv)
{
    uint32_t nb = rv->nbuckets ? rv->nbuckets * 2 : 64;
    kvx__key_t **b = calloc(nb, sizeof(*b));
    if (!b)
        return;
    for (uint32_t i = 0; i < rv->nbuckets; i++)
        for (kvx__key_t *k = rv->keys[i], *n; k; k = n) {
            n = k->next;
            uint32_t h = key_hash(k->b, k->len) & (nb - 1);
            k->next = b[h];
            b[h] = k;
        }
    free(rv->keys);
    rv->keys = b;
    rv->nbuckets = nb;
}

kvx__key_t *kvx__key_new(kvx_client_t *c, const void *key, size_t len)
{
    if (!c->rv.nbuckets) /* kvx__track() needs a table */
        keys_grow(&c->rv);
    kvx__key_t *k = c->rv.nbuckets ? malloc(sizeof(*k)) : NULL;
    if (!k || len > KVX_MAX_KEY) {
        free(k);
        kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
        return NULL;
    }
    k->next = NULL;
    k->len = (uint32_t)len;
    memcpy(k->b, key, len);
    return k;
}

void kvx__track(kvx_client_t *c, kvx__key_t *k)
{
    kvx__revive_t *rv = &c->rv;
    if (rv->nkeys >= rv->nbuckets)
        keys_grow(rv); /* if it cannot, the chains grow longer */
    uint32_t h = key_hash(k->b, k->len) & (rv->nbuckets - 1);
    k->next = rv->keys[h];
    rv->keys[h] = k;
    rv->nkeys++;
}

void kvx__untrack(kvx_client_t *c, const uint8_t *key, size_t len)
{
    kvx__revive_t *rv = &c->rv;
    if (!rv->nkeys || !len)
        return;
    kvx__key_t **p = &rv->keys[key_hash(key, len) & (rv->nbuckets - 1)];
    for (; *p; p = &(*p)->next)
        if ((*p)->len == len && !memcmp((*p)->b, key, len)) {
            kvx__key_t *k = *p;
            *p = k->next;
            free(k);
            rv->nkeys--;
            return;
        }
}

/* ---- pools ------------------------------------------------------------- */

static kvx__pool_t *pool_find(const kvx_client_t *c, uint32_t id)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &c->rv.pools)
    if (POOL(n)->id == id)
        return POOL(n);
    return NULL;
}

int kvx__pool_keep(kvx_client_t *c, const Kvxfer__RegisterPool *m,
                   const int *fds, int nfds, uint32_t daemon_id, uint32_t *id)
{
    kvx__pool_t *p = calloc(1, sizeof(*p));
    if (!p)
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    p->msg_len = kvxfer__register_pool__get_packed_size(m);
    p->msg = malloc(p->msg_len ? p->msg_len : 1);
    p->fds = calloc(nfds ? (size_t)nfds : 1, sizeof(int));
    if (!p->msg || !p->fds) {
        pool_free(p);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    kvxfer__register_pool__pack(m, p->msg);
    for (; p->nfds < nfds; p->nfds++)
        if ((p->fds[p->nfds] = fcntl(fds[p->nfds], F_DUPFD_CLOEXEC, 0)) < 0) {
            int e = errno, fd = fds[p->nfds];
            pool_free(p);
            return kvx__fail(c, e == EMFILE ? KVX_ERR_LIMIT : KVX_ERR_IO,
                             "register_pool: keeping its fd %d to register "
                             "it again after a daemon restart: %s",
                             fd, strerror(e));
        }
    /* the daemon's id, unless the engine holds it already for another
     * pool (registered before a restart): then the next free one */
    uint32_t want = daemon_id;
    while (!want || pool_find(c, want))
        want++;
    p->id = want;
    p->daemon_id = daemon_id;
    list_push(&c->rv.pools, &p->node);
    *id = want;
    return 0;
}

uint32_t kvx__pool_daemon(const kvx_client_t *c, uint32_t id)
{
    const kvx__pool_t *p = pool_find(c, id);
    return p ? p->daemon_id : id;
}

void kvx__pool_forget(kvx_client_t *c, uint32_t id)
{
    kvx__pool_t *p = pool_find(c, id);
    if (p) {
        list_remove(&p->node);
        pool_free(p);
    }
}

/* ---- Hello and Join ------------------------------------------------------ */

int kvx__hello_keep(kvx_client_t *c, const kvx_hello_t *h)
{
    kvx__revive_t *rv = &c->rv;
    char *iid = strdup(h->instance_id);
    uint32_t n = h->parallel.layers_per_pp ? h->parallel.num_layers_per_pp : 0;
    uint32_t *lpp = n ? malloc(n * sizeof(*lpp)) : NULL;
    if (!iid || (n && !lpp)) {
        free(iid);
        free(lpp);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    if (n)
        memcpy(lpp, h->parallel.layers_per_pp, n * sizeof(*lpp));
    free(rv->instance_id);
    free(rv->layers_per_pp);
    rv->hello = *h;
    rv->hello.instance_id = rv->instance_id = iid;
    rv->hello.parallel.layers_per_pp = rv->layers_per_pp = lpp;
    rv->hello.parallel.num_layers_per_pp = n;
    rv->has_hello = 1;
    return 0;
}

static char **strv_dup(const char *const *v, uint32_t n, int *oom)
{
    if (!n)
        return NULL;
    char **d = calloc(n, sizeof(*d));
    for (uint32_t i = 0; d && i < n; i++)
        if (!(d[i] = strdup(v[i]))) {
            strv_free(d, i);
            d = NULL;
        }
    *oom |= !d;
    return d;
}

int kvx__join_keep(kvx_client_t *c, const char *const *addrs, uint32_t n,
                   const char *const *cons, uint32_t ncons)
{
    kvx__revive_t *rv = &c->rv;
    int oom = 0;
    char **a = strv_dup(addrs, n, &oom), **k = strv_dup(cons, ncons, &oom);
    if (oom) {
        strv_free(a, a ? n : 0);
        strv_free(k, k ? ncons : 0);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    strv_free(rv->addrs, rv->naddrs);
    strv_free(rv->cons, rv->ncons);
    rv->addrs = a;
    rv->naddrs = n;
    rv->cons = k;
    rv->ncons = ncons;
    rv->has_join = 1;
    return 0;
}

/* ---- the connection lost and made again ------------------------------- */

void kvx__lost(kvx_client_t *c)
{
    kvx__revive_t *rv = &c->rv;
    kvx__shut(c);
    if (rv->reviving || rv->gone || rv->off)
        return; /* an attempt's failure: the attempt says so */
    /* every request in flight is owed its end */
    for (uint32_t i = 0; i < rv->nbuckets; i++) {
        kvx__key_t *k = rv->keys[i];
        while (k) {
            kvx__key_t *n = k->next;
            k->next = rv->gone_keys;
            rv->gone_keys = k;
            rv->ngone++;
            k = n;
        }
        rv->keys[i] = NULL;
    }
    rv->nkeys = 0;
    snprintf(rv->cause, sizeof(rv->cause), "%.*s", (int)sizeof(rv->cause) - 1,
             c->err);
    rv->last[0] = 0;
    rv->attempts = 0;
    rv->rebase = 1;
    if (!rv->enabled) {
        rv->off = 1;
        c->broken = 1;
        kvx__closed(c);
        return;
    }
    rv->gone = 1;
    rv->backoff_ms = rv->backoff_min_ms;
    rv->next_try_ms = kvx__now_ms(); /* the next call tries at once */
    kvx__fail(c, KVX_ERR_CLOSED,
              "kvxferd went away: %s; reconnecting (the next call tries "
              "again)",
              rv->cause);
}

int kvx__closed(kvx_client_t *c)
{
    if (c->rv.off)
        return kvx__fail(c, KVX_ERR_CLOSED,
                         "kvxferd went away: %s; reconnection is off: the "
                         "client is closed",
                         c->rv.cause);
    return kvx__fail(c, KVX_ERR_CLOSED,
                     "connection unusable after an earlier failure");
}

/* The Join list for the new daemon: this rank's old address (and every
 * rank's that shared it) replaced by the new one. */
static int join_again(kvx_client_t *c, const char *old, int timeout_ms)
{
    kvx__revive_t *rv = &c->rv;
    char **a = calloc(rv->naddrs ? rv->naddrs : 1, sizeof(*a));
    if (!a)
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    for (uint32_t i = 0; i < rv->naddrs; i++)
        a[i] = old[0] && !strcmp(rv->addrs[i], old) ? c->address : rv->addrs[i];
    int rc = kvx__join_send(c, a, rv->naddrs, rv->cons, rv->ncons, timeout_ms);
    free(a);
    return rc;
}

/* After a whole attempt: the kept list names the new address, so that
 * the next restart replaces it in turn. */
static void join_moved(kvx_client_t *c, const char *old)
{
    kvx__revive_t *rv = &c->rv;
    for (uint32_t i = 0; old[0] && i < rv->naddrs; i++)
        if (!strcmp(rv->addrs[i], old)) {
            char *s = strdup(c->address);
            if (s) { /* else the next restart keeps this daemon's */
                free(rv->addrs[i]);
                rv->addrs[i] = s;
            }
        }
}

/* ms left before deadline, at most cap, at least 1 (-1 deadline: cap). */
static int left_ms(int64_t deadline, uint32_t cap)
{
    if (deadline < 0)
        return (int)cap;
    int64_t l = deadline - kvx__now_ms();
    return l < 1 ? 1 : l > cap ? (int)cap : (int)l;
}

/* The last GPU pace, for what is left of its hold: a daemon before 2.8
 * has none to set, and a lapsed one is not set again. */
static int pace_again(kvx_client_t *c, int timeout_ms)
{
    kvx__revive_t *rv = &c->rv;
    int64_t left = rv->pace_hold_ms
                       ? rv->pace_at_ms + rv->pace_hold_ms - kvx__now_ms()
                       : 0;
    if (!rv->pace_per_ms || c->daemon_minor < 8 ||
        (rv->pace_hold_ms && left <= 0))
        return 0;
    int rc = kvx__pace_send(c, rv->pace_per_ms, (uint32_t)left, timeout_ms);
    if (rc) {
        char why[sizeof(c->err)];
        memcpy(why, c->err, sizeof(why));
        kvx__fail(c, rc, "setting the GPU pace again: %s", why);
    }
    return rc;
}

/* One attempt: connect, Hello, Join, every pool, the GPU pace. *reached: a
 * daemon took the connection. */
static int attempt(kvx_client_t *c, int64_t deadline, int *reached)
{
    kvx__revive_t *rv = &c->rv;
    int64_t end = kvx__now_ms() + left_ms(deadline, rv->attempt_timeout_ms);
    char old[sizeof(c->address)];
    memcpy(old, c->address, sizeof(old));
    int rc = kvx__open(c, left_ms(end, rv->attempt_timeout_ms));
    *reached = !rc;
    if (!rc && rv->has_hello)
        rc = kvx__hello_send(c, &rv->hello,
                             left_ms(end, rv->attempt_timeout_ms));
    if (!rc && rv->has_join)
        rc = join_again(c, old, left_ms(end, rv->attempt_timeout_ms));
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &rv->pools)
    {
        if (rc)
            break;
        kvx__pool_t *p = POOL(n);
        Kvxfer__RegisterPool *m =
            kvxfer__register_pool__unpack(NULL, p->msg_len, p->msg);
        if (!m) {
            rc = kvx__fail(c, KVX_ERR_NOMEM,
                           "pool %u: its registration cannot be unpacked",
                           p->id);
            break;
        }
        uint32_t id;
        rc = kvx__register_send(c, m, p->fds, p->nfds,
                                left_ms(end, rv->attempt_timeout_ms), &id);
        kvxfer__register_pool__free_unpacked(m, NULL);
        if (rc) {
            char why[sizeof(c->err)];
            memcpy(why, c->err, sizeof(why));
            kvx__fail(c, rc, "registering pool %u again: %s", p->id, why);
        } else {
            p->daemon_id = id;
        }
    }
    if (!rc)
        rc = pace_again(c, left_ms(end, rv->attempt_timeout_ms));
    if (rc) {
        memcpy(c->address, old, sizeof(old));
        kvx__shut(c);
        c->eof = 0;
    } else if (rv->has_join) {
        join_moved(c, old);
    }
    return rc;
}

int kvx__revive(kvx_client_t *c, int64_t deadline)
{
    kvx__revive_t *rv = &c->rv;
    int64_t now = kvx__now_ms();
    if (now < rv->next_try_ms)
        return kvx__fail(c, KVX_ERR_CLOSED,
                         "kvxferd went away: %s; reconnecting: next attempt "
                         "in %lld ms%s%s",
                         rv->cause, (long long)(rv->next_try_ms - now),
                         rv->last[0] ? "; the last failed: " : "", rv->last);
    rv->reviving = 1;
    int reached = 0;
    int rc = attempt(c, deadline, &reached);
    rv->reviving = 0;
    now = kvx__now_ms();
    if (rc) {
        rv->attempts++;
        snprintf(rv->last, sizeof(rv->last), "%.*s", (int)sizeof(rv->last) - 1,
                 c->err);
        /* a daemon that refused backs off; none at all is looked for
         * again soon */
        if (!reached) {
            rv->next_try_ms =
                now + (rv->backoff_min_ms < NOBODY_MS ? rv->backoff_min_ms
                                                      : NOBODY_MS);
        } else {
            rv->next_try_ms = now + rv->backoff_ms;
            rv->backoff_ms = rv->backoff_ms * 2 > rv->backoff_max_ms
                                 ? rv->backoff_max_ms
                                 : rv->backoff_ms * 2;
        }
        return kvx__fail(c, KVX_ERR_CLOSED,
                         "kvxferd went away: %s; reconnecting: attempt %u "
                         "failed: %s; next in %u ms",
                         rv->cause, rv->attempts, rv->last,
                         (unsigned)(rv->next_try_ms - now));
    }
    rv->gone = 0;
    rv->attempts = 0;
    rv->incarnation++;
    rv->told = 1;
    c->err[0] = 0;
    return 0;
}

/* ---- events ------------------------------------------------------------ */

static int key_cmp(const void *a, const void *b)
{
    const kvx__key_t *x = *(kvx__key_t *const *)a, *y = *(kvx__key_t *const *)b;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return memcmp(x->b, y->b, x->len);
}

int kvx__gone_batch(kvx_client_t *c, kvx_batch_t **out)
{
    kvx__revive_t *rv = &c->rv;
    if (!rv->ngone)
        return 0;
    uint32_t n = rv->ngone;
    kvx__key_t **v = malloc(n * sizeof(*v));
    kvx__ev_t *ev = malloc(n * sizeof(*ev));
    if (!v || !ev) {
        free(v);
        free(ev);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    uint32_t i = 0;
    for (kvx__key_t *k = rv->gone_keys; k; k = k->next)
        v[i++] = k;
    qsort(v, n, sizeof(*v), key_cmp);
    char msg[sizeof(rv->cause) + 128];
    snprintf(msg, sizeof(msg),
             "kvxferd went away: the connection to %s was lost; the request "
             "ended with it",
             c->path);
    for (i = 0; i < n; i++)
        ev[i] = (kvx__ev_t){.kind = KVX_EVENT_ERROR,
                            .code = KVX_ERR_PEER_GONE,
                            .message = msg,
                            .key = v[i]->b,
                            .key_len = v[i]->len};
    int rc = kvx__batch_make(c, rv->next_seq, ev, n, out);
    free(v);
    free(ev);
    if (rc)
        return rc;
    rv->next_seq++;
    keys_free(rv->gone_keys);
    rv->gone_keys = NULL;
    rv->ngone = 0;
    return 1;
}

uint64_t kvx__batch_seq(kvx_client_t *c, uint64_t daemon_seq)
{
    kvx__revive_t *rv = &c->rv;
    if (rv->rebase && !rv->gone && !rv->off) {
        rv->seq_off = rv->next_seq - daemon_seq;
        rv->rebase = 0;
    }
    uint64_t seq = daemon_seq + rv->seq_off;
    rv->next_seq = seq + 1;
    return seq;
}

int kvx__told(kvx_client_t *c, kvx__ev_t *ev, char *buf, size_t len)
{
    if (!c->rv.told)
        return 0;
    c->rv.told = 0;
    snprintf(buf, len,
             "kvxferd is back: incarnation %u at %s; pools registered and "
             "instance joined again",
             c->rv.incarnation, c->address);
    *ev = (kvx__ev_t){.kind = KVX_EVENT_RECONNECTED, .message = buf};
    return 1;
}

/* ---- state -------------------------------------------------------------- */

/* The daemon hung up the connection: looked at, nothing read. */
static int hung_up(const kvx_client_t *c)
{
    struct pollfd p = {c->fd, POLLRDHUP, 0};
    return c->fd >= 0 && poll(&p, 1, 0) > 0 &&
           (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

int kvx_client_state(const kvx_client_t *c, kvx_client_state_t *out)
{
    if (!c || !out || out->size < sizeof(kvx_client_state_t))
        return KVX_ERR_INVALID;
    const kvx__revive_t *rv = &c->rv;
    kvx_client_state_t s = {.size = sizeof(s)};
    s.status = c->broken  ? KVX_CLIENT_CLOSED
               : rv->gone ? KVX_CLIENT_RECONNECTING
                          : KVX_CLIENT_CONNECTED;
    s.incarnation = rv->incarnation;
    s.attempts = rv->attempts;
    s.in_flight = rv->nkeys;
    if (rv->gone) {
        int64_t l = rv->next_try_ms - kvx__now_ms();
        s.next_attempt_ms = l > 0 ? (uint32_t)l : 0;
        snprintf(s.message, sizeof(s.message),
                 "kvxferd went away: %s; reconnecting%s%s", rv->cause,
                 rv->last[0] ? ": the last attempt failed: " : "", rv->last);
    } else if (rv->off) {
        snprintf(s.message, sizeof(s.message),
                 "kvxferd went away: %s; reconnection is off: the client is "
                 "closed",
                 rv->cause);
    } else if (c->broken) {
        snprintf(s.message, sizeof(s.message),
                 "connection unusable after an earlier failure");
    } else if (hung_up(c)) { /* what the next call will find */
        s.status = rv->enabled ? KVX_CLIENT_RECONNECTING : KVX_CLIENT_CLOSED;
        snprintf(s.message, sizeof(s.message),
                 "kvxferd went away: the daemon closed the connection (the "
                 "next call ends the requests in flight%s)",
                 rv->enabled ? " and reconnects" : "; reconnection is off");
    }
    *out = s;
    return 0;
}
