/* daemon — the shared state and its small helpers; see daemon.h. */
#include <assert.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "common/list.h"
#include "daemon.h"
#include "map.h"

kvxd_t kvxd;

int kvxd_cpus(void)
{
    static int n;
    if (!n) {
        cpu_set_t allowed;
        n = sched_getaffinity(0, sizeof(allowed), &allowed) == 0
                ? CPU_COUNT(&allowed)
                : (int)sysconf(_SC_NPROCESSORS_ONLN);
        if (n < 1)
            n = 1;
    }
    return n;
}

uint64_t kvxd_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* 100 us to 30 s; 4 KiB to 16 GiB */
const double kvxd_secs_bounds[KVXD_SECS_N] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    30};
const double kvxd_bytes_bounds[KVXD_BYTES_N] = {
    4096.0,       16384.0,      65536.0,      262144.0,    1048576.0,
    4194304.0,    16777216.0,   67108864.0,   268435456.0, 1073741824.0,
    4294967296.0, 8589934592.0, 17179869184.0};

void kvxd_count_error(int code)
{
    if (code < 0 && -code < 32)
        kvxd.stats.errors_by_code[-code]++;
}

/* ---- the memory budget ------------------------------------------------ */

static uint64_t mem_used[MEM_KINDS], mem_all;
static const char *const mem_names[MEM_KINDS] = {
    "frames", "replies", "plans", "staging", "aux", "requests", "host"};
/* bytes charged per uid, in a map (uid -> uint64_t *), an entry freed
 * when it falls to 0: as many as uids hold something */
static map_t mem_uids;

uint64_t kvxd_uid_memory_cap(void)
{
    const kvx_conf_t *c = &kvxd.conf;
    uint64_t cap =
        c->uid_memory_bytes ? c->uid_memory_bytes : c->memory_bytes / 2;
    return cap < c->memory_bytes ? cap : c->memory_bytes;
}

uint32_t kvxd_uid_sessions_cap(void)
{
    const kvx_conf_t *c = &kvxd.conf;
    uint32_t cap =
        c->uid_sessions ? c->uid_sessions : (c->max_sessions + 1) / 2;
    return cap < c->max_sessions ? cap : c->max_sessions;
}

static uint64_t *uid_slot(uint32_t uid, int make)
{
    uint64_t *u = map_get(&mem_uids, uid);
    if (!u && make && (u = calloc(1, sizeof(*u))) &&
        map_put(&mem_uids, uid, u)) {
        free(u);
        u = NULL;
    }
    return u;
}

uint64_t kvxd_mem_used_uid(uint32_t uid)
{
    uint64_t *u = uid_slot(uid, 0);
    return u ? *u : 0;
}

/* Would a charge of bytes to uid pass its share? Not for no uid. */
static int uid_over(uint32_t uid, uint64_t bytes)
{
    if (uid == KVXD_UID_NONE)
        return 0;
    uint64_t ucap = kvxd_uid_memory_cap(), used = kvxd_mem_used_uid(uid);
    return bytes > ucap || used > ucap - bytes;
}

/* Would a charge of bytes pass the whole budget? */
static int all_over(uint64_t bytes)
{
    uint64_t cap = kvxd.conf.memory_bytes;
    return bytes > cap || mem_all > cap - bytes;
}

/* Would a charge of bytes to uid pass the budget or uid's share? 0: no
 * configuration loaded (unit tests, fuzzers): no budget. */
static int mem_over(uint32_t uid, uint64_t bytes)
{
    if (!kvxd.conf.memory_bytes)
        return 0;
    return all_over(bytes) || uid_over(uid, bytes);
}

static void mem_add(kvxd_mem_t kind, uint32_t uid, uint64_t bytes)
{
    assert(kind < MEM_KINDS);
    mem_used[kind] += bytes;
    mem_all += bytes;
    uint64_t *u = uid == KVXD_UID_NONE || !bytes ? NULL : uid_slot(uid, 1);
    if (u)
        *u += bytes;
    /* no memory for the entry: charged to the total only, and the release
     * finds none to take from */
}

int kvxd_mem_charge_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes)
{
    if (mem_over(uid, bytes))
        return KVX_ERR_LIMIT;
    mem_add(kind, uid, bytes);
    return 0;
}

void kvxd_mem_force_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes)
{
    mem_add(kind, uid, bytes);
}

void kvxd_mem_release_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes)
{
    assert(kind < MEM_KINDS && mem_used[kind] >= bytes);
    mem_used[kind] -= bytes;
    mem_all -= bytes;
    uint64_t *u = uid == KVXD_UID_NONE || !bytes ? NULL : uid_slot(uid, 0);
    if (u) {
        *u = *u > bytes ? *u - bytes : 0;
        if (!*u) {
            map_del(&mem_uids, uid);
            free(u);
        }
    }
}

int kvxd_mem_claim_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes)
{
    assert(kind < MEM_KINDS && mem_used[kind] >= bytes);
    (void)kind; /* counted in it already */
    if (uid == KVXD_UID_NONE || !bytes)
        return 0;
    if (kvxd.conf.memory_bytes && uid_over(uid, bytes))
        return KVX_ERR_LIMIT;
    uint64_t *u = uid_slot(uid, 1);
    if (u) /* else charged to the total only (see mem_add()) */
        *u += bytes;
    return 0;
}

int kvxd_mem_charge(kvxd_mem_t kind, uint64_t bytes)
{
    return kvxd_mem_charge_uid(kind, KVXD_UID_NONE, bytes);
}

void kvxd_mem_force(kvxd_mem_t kind, uint64_t bytes)
{
    mem_add(kind, KVXD_UID_NONE, bytes);
}

void kvxd_mem_release(kvxd_mem_t kind, uint64_t bytes)
{
    kvxd_mem_release_uid(kind, KVXD_UID_NONE, bytes);
}

void kvxd_mem_why(uint32_t uid, uint64_t bytes, char *buf, size_t len)
{
    /* the uid's share when it binds: a tenant over a share smaller than
     * the budget is told so, whatever the others hold (and a claim,
     * kvxd_mem_claim_uid(), passes only it); else the budget */
    if (uid_over(uid, bytes) &&
        (kvxd_uid_memory_cap() < kvxd.conf.memory_bytes || !all_over(bytes)))
        snprintf(buf, len,
                 "would pass uid %u's share of the daemon's memory budget "
                 "(limits.uid_memory_bytes %llu, %llu in use by it)",
                 (unsigned)uid, (unsigned long long)kvxd_uid_memory_cap(),
                 (unsigned long long)kvxd_mem_used_uid(uid));
    else
        snprintf(buf, len,
                 "would pass the daemon's memory budget (limits.memory_bytes "
                 "%llu, %llu in use)",
                 (unsigned long long)kvxd.conf.memory_bytes,
                 (unsigned long long)mem_all);
}

uint64_t kvxd_mem_used(kvxd_mem_t kind)
{
    return kind < MEM_KINDS ? mem_used[kind] : mem_all;
}

const char *kvxd_mem_name(kvxd_mem_t kind)
{
    return kind < MEM_KINDS ? mem_names[kind] : "all";
}

/* ---- replies ---------------------------------------------------------- */

static kvxd_reply_sink_t sink;

static kvxd_drain_fn drain_fn;

void kvxd_set_drain(kvxd_drain_fn fn)
{
    drain_fn = fn;
}

int kvxd_drain(const char *who, uint32_t grace_ms)
{
    return drain_fn ? drain_fn(who, grace_ms) : KVX_ERR_UNSUPPORTED;
}

void kvxd_set_reply_sink(const kvxd_reply_sink_t *s)
{
    sink = *s;
}

void kvxd_reply(uint64_t sid, uint64_t req_id, int status, const char *message)
{
    if (sink.reply)
        sink.reply(sid, req_id, status, message);
}

void kvxd_reply_msg(uint64_t sid, Kvxfer__Reply *reply)
{
    if (sink.reply_msg)
        sink.reply_msg(sid, reply);
}

/* ---- deferred work ---------------------------------------------------- */

typedef struct deferred {
    list_t node;
    void (*fn)(void *arg);
    void *arg;
} deferred_t;

static struct {
    uv_check_t check;
    uv_idle_t idle; /* active while work waits: the loop must not block */
    list_t queue;
    int started;
} D;

/* Run what is queued now; what those queue runs at the next turn. */
static void defer_run(uv_check_t *h)
{
    (void)h;
    list_t now, *n, *tmp;
    list_init(&now);
    list_move_all(&D.queue, &now);
    LIST_FOREACH_SAFE(n, tmp, &now)
    {
        deferred_t *d = LIST_OWNER(n, deferred_t, node);
        list_remove(n);
        d->fn(d->arg);
        free(d);
    }
    if (list_empty(&D.queue))
        uv_idle_stop(&D.idle);
}

static void on_idle(uv_idle_t *h)
{
    (void)h;
}

int kvxd_defer(void (*fn)(void *arg), void *arg)
{
    deferred_t *d = malloc(sizeof(*d));
    if (!d)
        return KVX_ERR_NOMEM;
    d->fn = fn;
    d->arg = arg;
    if (!D.queue.next) /* queued before kvxd_defer_init */
        list_init(&D.queue);
    list_push(&D.queue, &d->node);
    if (D.started)
        uv_idle_start(&D.idle, on_idle);
    return 0;
}

int kvxd_defer_init(uv_loop_t *loop)
{
    if (!D.queue.next)
        list_init(&D.queue);
    if (uv_check_init(loop, &D.check) || uv_idle_init(loop, &D.idle) ||
        uv_check_start(&D.check, defer_run))
        return KVX_ERR_IO;
    /* neither handle keeps the loop alive by itself */
    uv_unref((uv_handle_t *)&D.check);
    uv_unref((uv_handle_t *)&D.idle);
    D.started = 1;
    if (!list_empty(&D.queue)) /* queued before: run at the first turn */
        uv_idle_start(&D.idle, on_idle);
    return 0;
}

void kvxd_defer_cleanup(void)
{
    if (!D.started)
        return;
    /* at exit, after every module's cleanup: what is still queued would
     * act on objects that are gone, so it is dropped, not run */
    list_t *n, *tmp;
    LIST_FOREACH_SAFE(n, tmp, &D.queue)
    {
        list_remove(n);
        free(LIST_OWNER(n, deferred_t, node));
    }
    uv_check_stop(&D.check);
    uv_idle_stop(&D.idle);
    uv_close((uv_handle_t *)&D.check, NULL);
    uv_close((uv_handle_t *)&D.idle, NULL);
    D.started = 0;
}
