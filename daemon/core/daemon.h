/*
 * daemon — the state every module of kvxferd shares: the loop, the live
 * configuration, the daemon's identity, counters. Owned by main.c; lives
 * from start to exit. Touched by the loop thread only.
 */
#ifndef KVX_DAEMON_H
#define KVX_DAEMON_H

#include <stdint.h>
#include <stdio.h>
#include <uv.h>

#include "conf.h"
#include "hist.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"

/* The metrics' labels (local/metrics.c prints them): where the bytes a
 * fetch lands come from - a source pool on the destination's GPU, on
 * another GPU of this daemon, host memory on either side, or a peer
 * daemon; and which side of a request ended. */
typedef enum {
    KVXD_PATH_SAME_GPU,
    KVXD_PATH_GPU_GPU,
    KVXD_PATH_HOST,
    KVXD_PATH_PEER,
    KVXD_PATHS
} kvxd_path_t;
enum { KVXD_SIDE_OFFER, KVXD_SIDE_FETCH, KVXD_SIDES };
/* End kinds, by KVX_EVENT_COMPLETE (1) .. KVX_EVENT_TIMED_OUT (4). */
#define KVXD_ENDS 5

/* The histograms' bounds: seconds (durations, loop lag), bytes
 * (request sizes). */
#define KVXD_SECS_N 16
#define KVXD_BYTES_N 13
extern const double kvxd_secs_bounds[KVXD_SECS_N];
extern const double kvxd_bytes_bounds[KVXD_BYTES_N];

typedef struct kvxd_stats {
    uint64_t bytes_moved;
    uint64_t transfers_done;
    uint64_t batches_sealed;
    uint64_t batches_resent;     /* root: to ranks of other daemons, after
                                    a poll said they never arrived */
    uint64_t polls_woken_early;  /* Poll.early answered (xfer) */
    uint64_t errors_by_code[32]; /* index -code */
    /* metrics (xfer counts them as requests end) */
    uint64_t bytes_in[KVXD_PATHS];         /* landed here; sum: bytes_moved */
    uint64_t fetches_done[KVXD_PATHS];     /* fetches COMPLETE, by path */
    uint64_t ended[KVXD_SIDES][KVXD_ENDS]; /* requests ended, by kind */
    uint64_t end_codes[KVXD_SIDES][32];    /* ERROR ends, by -code */
    kvxd_hist_t fetch_seconds;   /* a COMPLETE fetch: made until its end */
    kvxd_hist_t fetch_bytes;     /* its bytes */
    kvxd_hist_t exposed_seconds; /* layer-wise offers' last layer ready
                                    until their fetch's end (local) */
} kvxd_stats_t;

typedef struct kvxd {
    uv_loop_t *loop;
    kvx_conf_t conf;
    const char *config_path; /* NULL: built-in defaults */
    char address[192];       /* this daemon's address, see kvxfer.h */
    uint64_t start_ms;
    int draining;
    kvxd_stats_t stats;
    FILE *trace; /* log.trace_file, line-buffered; NULL: off */
} kvxd_t;

extern kvxd_t kvxd;

/* Start the drain, as SIGTERM does, who naming its cause in the log and
 * in the requests' SHUTDOWN message: requests in flight may finish for
 * grace_ms, then end. Once it is over, session_drained() is told what it
 * did before the daemon exits. A second call does nothing (1 returned: a
 * drain was under way). main.c, which owns the drain, sets the function
 * at start (none: KVX_ERR_UNSUPPORTED). */
typedef int (*kvxd_drain_fn)(const char *who, uint32_t grace_ms);
void kvxd_set_drain(kvxd_drain_fn fn);
int kvxd_drain(const char *who, uint32_t grace_ms);

/* Monotonic milliseconds. */
uint64_t kvxd_now_ms(void);
/* The CPUs the daemon may run on (its affinity mask: taskset, a cgroup's
 * cpuset; else the online CPUs), counted once. The settings whose 2 means
 * "by the CPUs" (copy.pin_threads, copy.busy_poll, peer.busy_poll,
 * peer.direct) all read this. */
int kvxd_cpus(void);
/* Count an error code in the status counters. */
void kvxd_count_error(int code);

/* Replies to clients, by session id. The local layer registers the sink
 * at its init; the layers below reply through it and never call a
 * session (a reply to a session that is gone is dropped there). */
typedef struct kvxd_reply_sink {
    void (*reply)(uint64_t sid, uint64_t req_id, int status,
                  const char *message);
    void (*reply_msg)(uint64_t sid, Kvxfer__Reply *reply);
} kvxd_reply_sink_t;
void kvxd_set_reply_sink(const kvxd_reply_sink_t *sink);
void kvxd_reply(uint64_t sid, uint64_t req_id, int status, const char *message);
void kvxd_reply_msg(uint64_t sid, Kvxfer__Reply *reply);

/* Deferred work, the one way: fn(arg) runs on the loop after the current
 * callback returns, before the loop waits again (one uv_check_t, with a
 * uv_idle_t so the loop does not block while work is queued), in the
 * order queued. The rule it serves: never end or free another module's
 * object inside a callback of that module; queue it. 0, or
 * KVX_ERR_NOMEM (nothing queued). */
int kvxd_defer(void (*fn)(void *arg), void *arg);
/* Start the queue on loop; at exit, after every other cleanup, stop it
 * (what is still queued is dropped: its objects are gone). */
int kvxd_defer_init(uv_loop_t *loop);
void kvxd_defer_cleanup(void);

/* The daemon's one memory budget (limits.memory_bytes): what it holds
 * for others - frames being read, replies queued, requests and their
 * block lists, transfer plans, staging, aux payloads, the holes of host
 * pools it may fault in - is charged here before it is allocated, and
 * released when freed. A charge that would pass the budget is refused:
 * the work that wanted it fails with KVX_ERR_LIMIT, never the daemon
 * with an OOM. What a client makes the daemon hold is charged to its
 * uid too, within that uid's share (limits.uid_memory_bytes), so one
 * tenant cannot take the whole budget. */
typedef enum {
    MEM_FRAMES,   /* client frames being read */
    MEM_REPLIES,  /* replies queued to clients */
    MEM_PLANS,    /* transfer plans and their uploads */
    MEM_STAGING,  /* staging slots between daemons (at start) */
    MEM_AUX,      /* aux payloads kept with offers and fetches */
    MEM_REQUESTS, /* offers, reservations, fetches: state, block lists */
    MEM_HOST,     /* host pools' pages not resident at registration */
    MEM_KINDS
} kvxd_mem_t;
/* No uid: the daemon's own (staging), charged to the total only. */
#define KVXD_UID_NONE UINT32_MAX
/* 0, or KVX_ERR_LIMIT (nothing charged). */
int kvxd_mem_charge(kvxd_mem_t kind, uint64_t bytes);
/* Charged whatever the budget: for what must go (a small error reply). */
void kvxd_mem_force(kvxd_mem_t kind, uint64_t bytes);
void kvxd_mem_release(kvxd_mem_t kind, uint64_t bytes);
/* The same, charged to uid's share as well (KVXD_UID_NONE: none). */
int kvxd_mem_charge_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes);
void kvxd_mem_force_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes);
void kvxd_mem_release_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes);
/* Bytes already charged to the total with no uid (a plan, charged as it
 * is built) become uid's too, within its share: 0, or KVX_ERR_LIMIT
 * (nothing changed). kvxd_mem_release_uid() then gives back both. */
int kvxd_mem_claim_uid(kvxd_mem_t kind, uint32_t uid, uint64_t bytes);
/* Why a charge of bytes to uid is refused, naming the key it would pass
 * and what is in use: "would pass uid U's share of the daemon's memory
 * budget (limits.uid_memory_bytes N, M in use by it)" when it would pass
 * the uid's share and that share is smaller than the budget, else "would
 * pass the daemon's memory budget (limits.memory_bytes N, M in use)". */
void kvxd_mem_why(uint32_t uid, uint64_t bytes, char *buf, size_t len);
uint64_t kvxd_mem_used(kvxd_mem_t kind); /* MEM_KINDS: all of it */
uint64_t kvxd_mem_used_uid(uint32_t uid);
const char *kvxd_mem_name(kvxd_mem_t kind);
/* limits.uid_memory_bytes, 0 (half the budget) resolved. */
uint64_t kvxd_uid_memory_cap(void);
/* limits.uid_sessions, 0 (half of limits.max_sessions) resolved. */
uint32_t kvxd_uid_sessions_cap(void);

#endif /* KVX_DAEMON_H */
