/*
 * bench — what the files of kvxfer-bench share: the options, the memory
 * the parent shares with its rank processes, a rank's view of its pool,
 * and each file's entry points.
 *
 *   bench.c           main: the options, the daemons, then one mode
 *   bench_opts.c      the table of long options, --help, their checks
 *   bench_verify.c    the reference bytes written and checked in pools
 *   bench_rank.c      the rank processes and the parent that drives them
 *   bench_daemon.c    kvxferd spawned (one, or two talking over UCX)
 *   bench_baseline.c  memcpy, ucx_perftest and GPU copy baselines
 *   bench_layerwise.c --layerwise
 *   bench_report.c    the figures, as text or one JSON object
 *
 * Everything runs in one process until the ranks fork; a rank process
 * only reads the options and writes through `sh`.
 */
#ifndef KVX_BENCH_H
#define KVX_BENCH_H

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <time.h>

#include "kvxfer.h"

#define PARAMS_SLOT 2048

#define TIMEOUT_MS 30000
/* Warm-up requests use ids from here; their params use slots after the
 * timed requests' slots. */
#define WARM_BASE (1ull << 40)

#define MAX_PASSES 16
#define MAX_PEER_CONFIG 16

struct opts {
    const char *socket;
    int spawn;
    uint32_t ctx_ranks, gen_ranks, requests, blocks, window;
    const char *layout;
    uint32_t layers, heads, head_dim, tpb;
    kvx_dtype_t dtype;
    int json;
    uint64_t pool_cap_mib;
    int no_verify, no_warmup, verify_each, trace;
    const char *daemon_config;
    const char *pass_times; /* --pass-times FILE */
    const char *ctx_layout, *gen_layout;
    int gpu, vmm, ctx_device, gen_device, ctx_host, gen_host;
    int gen_device_set; /* --gen-device given */
    uint32_t pairs;     /* independent (context, generation) instance pairs */
    uint32_t ctx_pp, gen_pp, ctx_tpb, gen_tpb, skip;
    int mla;
    uint32_t ctas;
    uint32_t daemons;       /* 2: context ranks on daemon A, generation on B */
    const char *gen_socket; /* the generation ranks' daemon */
    uint64_t slot_bytes;    /* peer.slot_bytes of both daemons */
    const char *peer_config[MAX_PEER_CONFIG]; /* --peer-config lines */
    uint32_t baseline_runs; /* ucx_perftest runs, the median taken */
    uint32_t passes;        /* timed passes over the requests */
    const char *cpus[2];    /* --cpus-a, --cpus-b: CPU lists */
    uint32_t npeer_config;
    const char *ucx_tls;
    int guard;            /* --pool-offset given */
    uint64_t pool_offset; /* pools start this far into their
                             allocation, guard bands around */
    uint64_t vmm_chunk;   /* --vmm-chunk: VMM pools of several
                             physical allocations */
    uint32_t regions;     /* --regions: each rank's pool as this many
                             regions, each its own allocation (0: one) */
    int keyed;            /* --keyed: string keys, "cmpl-R-0" and "decode-R" */
    int reserve; /* --reserve: a scheduler reserves each request first */
    int by_key;  /* --by-key: generation fetches by key, no params */
    double layerwise_ms; /* --layerwise MS: a layer ready every MS ms */
    int layerwise;
    int poll_spin; /* --poll-spin: the generation rank polls, never waits */
    int batch;     /* --batch: publishes and fetches many to a call */
    int shuffle;   /* --shuffle: each side's block ids a permutation */
};

/* The options, as parsed (bench_opts.c); the ranks only read them. */
extern struct opts o;

/* Shared between the parent and the rank processes. */
struct shared {
    _Atomic uint32_t ready; /* ranks connected and registered */
    _Atomic uint32_t go;
    _Atomic uint32_t ready2, go2; /* between warm-up and timed pass */
    _Atomic uint32_t ready3, go3; /* before any rank disconnects */
    /* after each timed pass (--passes): the parent takes its time and,
     * with --daemons 2, runs ucx_perftest once while the daemons idle */
    _Atomic uint32_t pass_ready[MAX_PASSES], pass_go[MAX_PASSES];
    /* passes after the first: between the warm-up and the timed run */
    _Atomic uint32_t warm_ready[MAX_PASSES], warm_go[MAX_PASSES];
    _Atomic uint32_t failed;
    char address[192];     /* daemon of the context ranks */
    char gen_address[192]; /* daemon of the generation ranks */
    _Atomic uint64_t first_fetch_ns, last_done_ns;
    _Atomic uint64_t mismatches, verified_bytes, errors, sampled_reqs;
    _Atomic uint64_t guard_changed; /* guard-band bytes found changed */
    char error_text[512];
    /* then: params slots, then latencies of gen rank 0 */
};

/* Derived from the options (bench.c): tokens per request, KV factor,
 * requests that fit a pool at once. */
extern uint32_t num_tokens, kvf, reqs_in_pool;

extern struct shared *sh;
extern uint8_t *slots;   /* requests x PARAMS_SLOT: u32 ready, u32 len, data */
extern uint64_t *lat_ns; /* requests */
extern uint64_t *call_ns, *ev_ns; /* --trace: each timed request's fetch
                                     call and event, monotonic ns */

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Print "kvxfer-bench: ..." and exit 1; the first failure is kept in
 * sh->error_text for the parent. */
void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#define CHECK_KVX(call, c)                                                     \
    do {                                                                       \
        int rc_ = (call);                                                      \
        if (rc_)                                                               \
            die("%s: %s: %s", #call, kvx_status_str(rc_), kvx_last_error(c));  \
    } while (0)

/* ---- bench_opts.c --------------------------------------------------- */

/* Parse argv into o; exits 0 after --help, 2 on a bad option. */
void opts_parse(int argc, char **argv);
/* The options' checks against each other; 0, or 2 after saying why. */
int opts_check(void);

/* --cpus-a/--cpus-b: daemon A and the ucx_perftest client (the senders)
 * run on cpuset[0], daemon B and the server (the receivers) on
 * cpuset[1], so the baseline and the daemons get the same CPUs. */
extern cpu_set_t cpuset[2];

/* ---- bench_verify.c ------------------------------------------------- */

#define MAX_REGIONS_BENCH (2 * KVX_MAX_LAYERS)

/* One rank's pool, as the rank sees it. */
typedef struct rank_view {
    uint8_t *base; /* host pool mapping, or the GPU pool */
    kvx_layout_t layout;
    /* the pool's regions: one (base), or --regions allocations */
    uint32_t nregions;
    uint8_t *rbase[MAX_REGIONS_BENCH];
    uint64_t rsize[MAX_REGIONS_BENCH];
    kvx_layout_part_t parts[2 * KVX_MAX_LAYERS];
    uint32_t head0;  /* first global head of the rank */
    uint32_t layer0; /* first global layer of the rank (PP) */
    uint32_t bpr;    /* blocks per request on this side */
    int device;      /* >= 0: GPU pool on this device */
    uint8_t *alloc;  /* --pool-offset: the allocation around base */
    uint64_t alloc_len;
    uint32_t pool;  /* the pool's id */
    uint32_t *perm; /* --shuffle: pool block of each request slot block */
} rank_view_t;

/* --pool-offset: every pool starts o.pool_offset bytes into an
 * allocation that runs GUARD_TAIL bytes past it; both bands hold
 * GUARD_BYTE and are checked unchanged when the rank ends. */
#define GUARD_TAIL 65536
#define GUARD_BYTE 0xa5

uint8_t *slot_of(uint64_t r);
uint32_t req_block(const rank_view_t *v, uint64_t r, uint32_t i);
uint32_t *shuffled_blocks(uint32_t n, uint64_t seed);
void fill_request(const rank_view_t *v, uint64_t r);
int sampled(void);
uint64_t pat_of(uint64_t r, uint64_t first);
uint64_t sample_check(const rank_view_t *v, uint64_t r, uint64_t pat,
                      int poison);
uint64_t check_request(const rank_view_t *v, uint64_t r);
uint64_t guard_changed(const rank_view_t *v);
void pool_clear(const rank_view_t *v);

/* ---- bench_rank.c --------------------------------------------------- */

kvx_client_t *rank_open(const char *inst, kvx_role_t role, uint32_t rank,
                        rank_view_t *v);

/* What the parent saw of the timed passes. */
typedef struct ranks_result {
    double pass_secs[MAX_PASSES];
    /* --daemons 2 with --passes: the ucx_perftest run after each pass,
     * slot-sized and piece-sized messages */
    double pass_ucx[MAX_PASSES], pass_msg[MAX_PASSES];
    uint64_t message_bytes; /* status "ucx.message_bytes" */
    int failed;
} ranks_result_t;

/* Fork the ranks and drive them through warm-up, the passes and exit. */
void ranks_run(const char *perftest, uint64_t total, ranks_result_t *res);

/* ---- bench_daemon.c ------------------------------------------------- */

/* --daemons 2: what the daemons' status says after the run. */
typedef struct peers_stats {
    /* per direction (B received, A sent): slots, then per slot the
     * average wait, wire, copy and the copy's loop lag in microseconds,
     * then the slots gathered ahead and the pieces sent direct, and the
     * bytes through slots in GPU memory ("gpu_bytes") */
    double rx[8], tx[8];
    char transports[128]; /* daemon B's "ucx.transports", as told */
    uint32_t lanes;       /* the lanes daemon A's slot data goes over */
    char gpu[512];        /* --gpu: the generation daemon's status "gpu" */
} peers_stats_t;

extern peers_stats_t peers;

/* The spawned daemons; -1: none. */
typedef struct daemons {
    pid_t ctx, gen;
} daemons_t;

/* Spawn the daemons the options ask for and set o.socket, o.gen_socket. */
void daemons_start(daemons_t *d);
/* SIGTERM each daemon and wait for it. */
void daemons_stop(daemons_t *d);
/* After a failed run of two daemons: their logs, to stderr. */
void daemons_print_logs(void);
/* The size of the pieces the daemons send slots in, or 0; fills peers and
 * (unless set) UCX_TLS with the transports they used. */
uint64_t peers_read(void);
/* --gpu: the generation daemon's status "gpu" (its copy path and how many
 * launches the copy engines took) into peers.gpu. */
void gpu_status_read(void);
/* --trace: the spawned daemon's log.trace_file. */
const char *trace_path(void);
/* In a child before exec: run on side k's CPUs, if given. */
void cpus_apply(int k);
/* The last `tail` bytes of a log file, to stderr. */
void print_log(const char *path, long tail);
/* The ucx_perftest runs' log, in the two daemons' temp dir. */
const char *perftest_log(void);
/* What the parent kills at exit: daemons A and B, then the ucx_perftest
 * server and client (0: none). */
extern volatile pid_t owned[4];

/* ---- bench_baseline.c ----------------------------------------------- */

/* The baselines a run is compared with. */
typedef struct baseline {
    double gbps; /* what the ratio divides by */
    double ucx_gbps, ucx_put_gbps, ucx_msg_gbps, d2h, h2d;
    double gpu_cap; /* host-staged: the slower GPU copy */
    double runs[2][MAX_PASSES];
    uint32_t nruns;
    const char *name; /* with --daemons 2 */
} baseline_t;

const char *perftest_binary(void);
double perftest_gbps(const char *bin, const char *test, uint64_t size,
                     uint64_t total, int probe_only);
double memcpy_baseline(uint64_t total);
/* After the ranks: every baseline of this run into b (b->gbps holds the
 * memcpy figure measured before the ranks, if any). */
void baseline_measure(const char *perftest, uint64_t total,
                      const ranks_result_t *res, baseline_t *b);

/* ---- bench_layerwise.c ---------------------------------------------- */

int layerwise_main(void);

/* ---- bench_report.c ------------------------------------------------- */

int cmp_u64(const void *a, const void *b);
double median(const double *v, uint32_t n);
/* The next "fetch" line of the trace file: its key and its hops' ns
 * (made, queued, submitted, copied, landed, event queued); 0 at the
 * end. */
int trace_next(FILE *f, char key[300], unsigned long long t[6]);
/* The figures of the run; returns the exit code (1: not verified). */
int report(uint64_t total, const ranks_result_t *res, const baseline_t *b);

#endif
