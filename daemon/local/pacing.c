/* pacing — the GPU paces engines set; see pacing.h. */
#include <stdio.h>
#include <stdlib.h>

#include "copy/copy.h"
#include "copy/pace.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "core/log.h"
#include "kvxfer.h"
#include "pacing.h"

/* One session's pace: few (a node's engine ranks), so a list. */
typedef struct entry {
    struct entry *next;
    uint64_t sid;
    uint64_t per_ms;
    uint64_t until_ms; /* loop time it lapses at; 0: it does not */
    uint64_t devices;  /* its GPU pools' devices */
} entry_t;

static struct {
    uv_loop_t *loop;
    entry_t *list;
    uint32_t n;
    uv_timer_t timer; /* the earliest lapse */
    int open;
    uint64_t armed_ms;                   /* when the timer fires; 0: off */
    uint64_t shared; /* devices users share, as apply() last found them */
    uint64_t applied[COPY_PACE_DEVICES]; /* what copy was told */
} g;

static entry_t **find(uint64_t sid)
{
    entry_t **p = &g.list;
    while (*p && (*p)->sid != sid)
        p = &(*p)->next;
    return p;
}

static void drop(entry_t **p)
{
    entry_t *e = *p;
    *p = e->next;
    g.n--;
    free(e);
}

/* Devices whose live GPU pools are of more than one user: a walk of
 * every pool of the daemon, run only when a GPU pool comes or goes
 * (apply(1)); a pace or a lapse takes what the last walk found, so that
 * a GpuPace, sent each step, costs none. Without memory for it, what
 * the last one found. */
static uint64_t find_shared(void)
{
    uint32_t uid[COPY_PACE_DEVICES];
    uint64_t seen = 0, shared = 0;
    uint32_t np = pool_count();
    pool_t **pools = calloc(np ? np : 1, sizeof(*pools));
    if (!pools)
        return g.shared;
    np = pool_list(pools, np);
    for (uint32_t i = 0; i < np; i++) {
        const pool_t *p = pools[i];
        if (!p->gpu || p->released)
            continue;
        uint64_t bit = pacing_device_bit(p->device);
        int d = copy_pace_device(p->device);
        if (!(seen & bit)) {
            seen |= bit;
            uid[d] = p->uid;
        } else if (uid[d] != p->uid) {
            shared |= bit;
        }
    }
    free(pools);
    return shared;
}

/* Each device's lane gets the lowest pace of the sessions on it, unless
 * the GPU pools there are of more than one user: then no engine's pace
 * binds it (one tenant must not slow another's transfers), only
 * gpu.pace. walk: a GPU pool came or went, find who shares anew. */
static void apply(int walk)
{
    uint64_t low[COPY_PACE_DEVICES] = {0};
    uint64_t shared = walk ? (g.shared = find_shared()) : g.shared;
    for (entry_t *e = g.list; e; e = e->next)
        for (int d = 0; d < COPY_PACE_DEVICES; d++)
            if ((e->devices & ~shared) >> d & 1)
                low[d] = pace_lowest(low[d], e->per_ms);
    for (int d = 0; d < COPY_PACE_DEVICES; d++)
        if (low[d] != g.applied[d]) {
            copy_set_gpu_pace(d, low[d]);
            g.applied[d] = low[d];
        }
}

static void on_timer(uv_timer_t *t);

/* The timer fires at the earliest lapse. */
static void arm(void)
{
    uint64_t first = 0;
    for (entry_t *e = g.list; e; e = e->next)
        if (e->until_ms && (!first || e->until_ms < first))
            first = e->until_ms;
    if (first == g.armed_ms || !g.open)
        return;
    g.armed_ms = first;
    if (!first) {
        uv_timer_stop(&g.timer);
        return;
    }
    uint64_t now = uv_now(g.loop);
    uv_timer_start(&g.timer, on_timer, first > now ? first - now : 0, 0);
}

static void on_timer(uv_timer_t *t)
{
    (void)t;
    uint64_t now = uv_now(g.loop);
    int lapsed = 0;
    for (entry_t **p = &g.list; *p;) {
        if ((*p)->until_ms && (*p)->until_ms <= now) {
            log_debug("session %llu: its gpu pace of %llu B/ms lapsed",
                      (unsigned long long)(*p)->sid,
                      (unsigned long long)(*p)->per_ms);
            drop(p);
            lapsed = 1;
        } else {
            p = &(*p)->next;
        }
    }
    g.armed_ms = 0;
    if (lapsed)
        apply(0);
    arm();
}

int pacing_init(uv_loop_t *loop)
{
    g.loop = loop;
    int rc = uv_timer_init(loop, &g.timer);
    if (rc) {
        log_error("pacing: uv_timer_init: %s", uv_strerror(rc));
        return KVX_ERR_IO;
    }
    uv_unref((uv_handle_t *)&g.timer); /* keeps nothing alive */
    g.open = 1;
    return 0;
}

void pacing_cleanup(void)
{
    while (g.list)
        drop(&g.list);
    apply(0);
    if (g.open) {
        uv_close((uv_handle_t *)&g.timer, NULL);
        g.open = 0;
    }
}

int pacing_set(uint64_t sid, uint64_t per_ms, uint32_t hold_ms,
               uint64_t devices)
{
    entry_t **p = find(sid);
    if (!per_ms) { /* withdrawn */
        if (*p)
            drop(p);
    } else {
        if (!*p) {
            entry_t *e = calloc(1, sizeof(*e));
            if (!e)
                return KVX_ERR_NOMEM;
            e->sid = sid;
            e->next = g.list;
            g.list = e;
            g.n++;
            p = &g.list;
        }
        (*p)->per_ms = per_ms;
        (*p)->devices = devices;
        /* from now, not from the start of the loop's turn, which may
         * have done long work before this call; the loop's clock counts
         * whole milliseconds, rounded down, so one more: never early */
        if (hold_ms)
            uv_update_time(g.loop);
        (*p)->until_ms = hold_ms ? uv_now(g.loop) + hold_ms + 1 : 0;
    }
    apply(0);
    arm();
    return 0;
}

uint64_t pacing_shared(void)
{
    return g.shared;
}

void pacing_devices(uint64_t sid, uint64_t devices)
{
    entry_t **p = find(sid);
    if (*p)
        (*p)->devices = devices;
    apply(1); /* a pool came or went: which devices users share may too */
}

void pacing_end(uint64_t sid)
{
    entry_t **p = find(sid);
    if (*p) {
        drop(p);
        arm();
    }
    apply(1); /* its pools may leave a device to one user */
}

uint32_t pacing_sessions(void)
{
    return g.n;
}

uint64_t pacing_devices_used(void)
{
    uint64_t used = 0;
    for (entry_t *e = g.list; e; e = e->next)
        used |= e->devices;
    uint32_t np = pool_count();
    pool_t **pools = calloc(np ? np : 1, sizeof(*pools));
    if (!pools)
        return used;
    np = pool_list(pools, np);
    for (uint32_t i = 0; i < np; i++)
        if (pools[i]->gpu && !pools[i]->released)
            used |= pacing_device_bit(pools[i]->device);
    free(pools);
    return used;
}

/* Append to buf (len bytes, *at used) what fmt says. */
#define ADD(...)                                                               \
    do {                                                                       \
        if (at < len)                                                          \
            at += (size_t)snprintf(buf + at, len - at, __VA_ARGS__);           \
    } while (0)

void pacing_status(char *buf, size_t len)
{
    size_t at = 0;
    const char *sep = "gpu pace: ";
    if (len)
        buf[0] = 0;
    if (kvxd.conf.gpu_pace) {
        ADD("%sconfig %llu B/ms", sep, (unsigned long long)kvxd.conf.gpu_pace);
        sep = ", ";
    }
    if (g.n) {
        uint64_t low = 0;
        uint32_t nopool = 0;
        for (entry_t *e = g.list; e; e = e->next) {
            low = pace_lowest(low, e->per_ms);
            nopool += !e->devices;
        }
        ADD("%sengines %u (lowest %llu B/ms, %u without a GPU pool)", sep, g.n,
            (unsigned long long)low, nopool);
        sep = ", ";
    }
    uint64_t used = pacing_devices_used();
    for (int d = 0; d < COPY_PACE_DEVICES; d++) {
        uint64_t engines, eff;
        uint32_t on = 0;
        for (entry_t *e = g.list; e; e = e->next)
            on += e->devices >> d & 1;
        if (!(used >> d & 1))
            continue;
        eff = copy_gpu_pace(d, &engines);
        if (g.shared >> d & 1 && on) {
            ADD("%sdevice %d %s%.0llu%s (%u engine%s not applied: users share "
                "it)",
                sep, d, eff ? "" : "unpaced", (unsigned long long)eff,
                eff ? " B/ms" : "", on, on == 1 ? "'s" : "s'");
            sep = ", ";
            continue;
        }
        if (!eff)
            continue;
        if (engines == eff && on)
            ADD("%sdevice %d %llu B/ms (%u engine%s)", sep, d,
                (unsigned long long)eff, on, on == 1 ? "" : "s");
        else
            ADD("%sdevice %d %llu B/ms (config)", sep, d,
                (unsigned long long)eff);
        sep = ", ";
    }
}
