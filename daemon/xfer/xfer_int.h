/*
 * xfer_int — what the files of daemon/xfer share and nothing else sees:
 * the request types' fields, the lists and records they live on, and the
 * helpers each file calls in another. Included by the .c files of daemon/xfer
 * only.
 */
#ifndef KVX_XFER_INT_H
#define KVX_XFER_INT_H

#include <stdint.h>
#include <time.h>

#include "common/list.h"
#include "common/why.h"
#include "copy/gpu.h"
#include "copy/plan.h"
#include "core/daemon.h"
#include "core/rrq.h"
#include "instance.h"
#include "xfer.h"
#include "xfer_remote.h"

#define PARAMS_VERSION 2 /* 2: named by keys */
#define PARAMS_MAX 65536

/* ---- the requests --------------------------------------------------- */

/* A request waiting for its deadline: lists kept in deadline order, so
 * the tick only looks at the heads. */
typedef struct dl_node {
    list_t node; /* on its list while the deadline holds */
    uint64_t deadline_ms;
} dl_node_t;

/* A cancel waiting for the fence. One cancel may wait on two requests
 * (an instance with role both that offers and fetches the same id): the
 * reply goes out when the last of them is finalized. */
typedef struct cancel_wait {
    uint64_t sid, req_id;
    unsigned pending;
} cancel_wait_t;

typedef struct waiter {
    cancel_wait_t *cw;
    list_t node; /* on its request's waiters, newest first */
} waiter_t;

typedef struct genreq genreq_t;

/* The hops of a fetch that log.trace_file records (xfer_trace_write()): made
 * (the first rank's fetch), first part queued, first copy submitted, the
 * last copy finished (on its thread), the last copy back on the loop,
 * the terminal event queued for the batches. */
enum { TR_FETCH, TR_QUEUED, TR_SUBMIT, TR_COPIED, TR_LANDED, TR_EVENT, TR_N };

static inline uint64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Wall clock microseconds (the records' start and end). */
static inline uint64_t wall_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000000ull + (uint64_t)t.tv_nsec / 1000;
}

#define TRACE_HOP(g, h)                                                        \
    do {                                                                       \
        if (kvxd.trace && !(g)->tr[h])                                         \
            (g)->tr[h] = mono_ns();                                            \
    } while (0)

typedef struct offer_part {
    int published;
    pool_t *pool; /* referenced while published, until consumed */
    uint32_t *blocks;
    uint32_t nblocks;
    /* What of the rank's KV is there: everything after a plain publish;
     * after a layer-wise one (Publish.layerwise) what LayersReady named:
     * per layer, the tokens [0, tok_ready[l]) (a chunked prefill makes
     * them ready chunk by chunk, AppendBlocks adding the blocks; blocks
     * holds room for every block of num_tokens, nappended of them
     * given), once the engine's event given with them (GPU pools) is
     * reached: watches holds those still watched (lw_watch_t). ready:
     * the leading layers whose every token is there. */
    int layerwise;
    uint32_t nlayers, ready, nappended;
    uint32_t *tok_ready;
    list_t watches;
    int awaited;  /* held in busy (busy_hold): published, not yet gone */
    uint64_t mem; /* its tables' bytes charged (MEM_REQUESTS) */
} offer_part_t;

/* Layers of a rank's part that are ready once an engine's event is. */
typedef struct lw_watch {
    offer_t *offer;
    uint32_t group, rank, first, count, tokens;
    gpu_watch_t *w;
    list_t node; /* on its part's watches */
} lw_watch_t;

struct offer {
    dl_node_t lease; /* on the lease list while unfetched */
    instance_t *inst;
    uint64_t request_id; /* its key's id: the instance's map key */
    reqkey_t key;
    uint8_t token[TOKEN_LEN];
    uint32_t num_tokens;
    plan_side_t side; /* instance config + layout summary */
    char preset[16];
    uint8_t *params; /* packed ContextParams, same for every rank */
    size_t params_len;
    /* groups: the request's block tables (Publish.groups), the first the
     * plain one (side, num_tokens); per group its side, tokens and first
     * block; parts: one per (group, rank), OPART() */
    uint32_t ngroups;
    plan_side_t gside[XFER_MAX_GROUPS];
    uint32_t gtokens[XFER_MAX_GROUPS], gfirst[XFER_MAX_GROUPS];
    offer_part_t *parts; /* nranks * ngroups */
    uint32_t npublished;
    uint64_t created_ms;
    uint32_t lease_ms; /* its lease (Publish/Reserve.lease_ms, resolved) */
    genreq_t *consumer;
    int ending, end_kind, end_code;
    int reserved; /* made by the scheduler (xfer_reserve) */
    int consumed; /* complete before every rank published: kept,
                     without memory, to answer late publishes */
    char end_msg[256];
    list_t waiters;     /* waiter_t: cancels answered at the end */
    int consume_fenced; /* complete, consumed once gathers are 0 */
    uint8_t *aux;       /* the first non-empty aux published (MEM_AUX) */
    uint32_t aux_len;
    int taken;        /* streams from peer daemons read it */
    uint32_t gathers; /* gathers in flight: the fence */
    /* peer daemons reading this offer: remote.c's (struct roffer), never
     * read by xfer, freed through xfer_remote_ops_t.offer_free */
    struct roffer *remote;
    uint64_t mem; /* the offer's own bytes charged (MEM_REQUESTS) */
    /* its record (core/records.h): made at, bytes read by its consumer
     * here and by peer daemons' pulls, how, and by which instance */
    uint64_t start_us, served;
    const char *path;
    char consumer_id[INSTANCE_ID_MAX + 1];
    uint64_t lw_all_ns; /* layer-wise: when its last layer became ready
                           (monotonic ns; metrics' exposed time) */
};

struct genpart {
    genreq_t *req;
    uint32_t rank, group;
    int fetched, started, done;
    int settled;  /* done, or its last job out: counted in nsettled */
    pool_t *pool; /* referenced while fetched */
    uint32_t *blocks;
    uint32_t nblocks;
    plan_t *plan;
    uint64_t next_unit, units_done, units_per_chunk;
    /* a layer-wise source: the work goes cell by cell (cnext, sfirst,
     * tok_end: see cell_ready()), and the part waits off the queue
     * (parked) while nothing ready is left to copy */
    uint32_t *cnext, *sfirst, *tok_end, maxl;
    int parked;
    /* per layer of this rank's pool: units landed, units it gets (what
     * FetchProgress reports) */
    uint32_t *ldone, *lneed;
    uint32_t inflight;
    int late;         /* fetched once the request was ending: joins its end */
    int path;         /* metrics: kvxd_path_t + 1 (0: not known yet) */
    gpu_part_t *gpu;  /* plan uploaded to a GPU, when it runs there */
    rrq_entry_t turn; /* on the scheduler's queue (xfer_runq) */
    /* pulled from peer daemons: remote.c's (struct rpart), never read by
     * xfer, freed through xfer_remote_ops_t.part_free */
    struct rpart *remote;
};

struct genreq {
    dl_node_t timeout; /* on the fetch-timeout list */
    instance_t *inst;
    uint64_t request_id; /* its key's id: the instance's map key */
    reqkey_t key;
    offer_t *offer; /* NULL once detached */
    uint32_t skip_tokens;
    uint32_t dp_rank;                /* attention-DP group receiving */
    uint32_t need;                   /* local ranks of that group */
    uint32_t ngroups;                /* block tables (the offer's groups) */
    uint32_t gskip[XFER_MAX_GROUPS]; /* each group's skip_tokens */
    genpart_t *parts;                /* nranks * ngroups: GPART() */
    uint32_t nfetched, ndone;
    uint32_t nsettled; /* parts settled (part_settle()) */
    int soon;          /* every part settled: Poll.early answered */
    uint32_t inflight;
    uint64_t created_ms;
    uint64_t t0_ns; /* made (monotonic ns): the duration metrics' start */
    uint64_t bytes_total, bytes_done;
    int ending, end_kind, end_code;
    char end_msg[256];
    list_t waiters;       /* waiter_t: cancels answered at the end */
    int remote;           /* sources reached through peer daemons */
    plan_side_t src_side; /* remote: the offer's side, from the params */
    char src_instance[INSTANCE_ID_MAX + 1];
    uint64_t src_request; /* the offer's key's id */
    uint64_t src_id;      /* xfer_source_id() of the offer */
    reqkey_t src_key;
    uint8_t token[TOKEN_LEN];
    char **src_addresses; /* remote: daemon of each context rank */
    uint32_t src_nranks;
    uint8_t *aux; /* remote: the first non-empty aux a source daemon sent
                     (MEM_AUX); a local offer's is read at the end */
    uint32_t aux_len;
    uint64_t tr[TR_N]; /* log.trace_file: each hop's monotonic ns */
    uint64_t start_us; /* wall clock, its record's start (records.h) */
    uint64_t mem;      /* its state's and parts' tables' bytes charged
                          (MEM_REQUESTS; fetch_bytes()) */
};

#define DL_NODE(n) LIST_OWNER(n, dl_node_t, node)

/* The part of rank r in group k of an offer or a fetch; a rank's first
 * group's part (k 0) stands for the rank (published, fetched). */
#define OPART(o, k, r) (&(o)->parts[(size_t)(k) * (o)->inst->nranks + (r)])
#define GPART(g, k, r) (&(g)->parts[(size_t)(k) * (g)->inst->nranks + (r)])
#define OPARTS(o) ((size_t)(o)->ngroups * (o)->inst->nranks)
#define GPARTS(g) ((size_t)(g)->ngroups * (g)->inst->nranks)

/* A request that ended while it may still be asked for, kept until the
 * fetch timeout (gone_add()): a cancelled or released offer, so that a
 * fetch coming after the cancel or release (here, by key, or its OPEN
 * from a peer) hears CANCELLED or NOT_FOUND at once and does not wait
 * for an offer that will not come; and a fetch that ended before every local
 * rank of it fetched, so that a later rank's fetch joins that end instead of
 * making a second request and a second event. */
typedef struct gone {
    dl_node_t dl;   /* on xfer_gones, in deadline order */
    list_t by_uid;  /* on its uid's gone_uid_t, oldest first */
    uint32_t uid;   /* the instance's owner: charged to its share */
    size_t charged; /* bytes charged (kvxd_mem_*_uid) */
    int offer;
    int released; /* offer: released, not cancelled */
    char inst[INSTANCE_ID_MAX + 1];
    uint64_t request_id;
    reqkey_t key;
    uint64_t src; /* fetch: what it fetched (xfer_source_id()); a fetch
                     of the key from another offer is a new request */
    uint32_t nranks, need, seen;
    uint8_t ranks[]; /* fetch: which ranks fetched */
} gone_t;

/* Kept at once per uid, within its memory share; past either, that
 * uid's oldest goes first, so that one tenant's churn never drops what
 * is kept for another. */
#define GONE_MAX 65536

typedef struct gone_uid {
    list_t list; /* its gone_t, oldest first */
    uint32_t n;
} gone_uid_t;

/* A key for messages (xfer_ksb(): up to four in one call's arguments). */
#define ks(k) xfer_ksb((k)->b, (k)->len)

static inline uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return (a + b - 1) / b;
}

/* ---- state shared by the files (defined in xfer.c) ------------------ */

/* The records in deadline order, and indexed by gone_index() (fetches
 * look one up at every call: no walk of the list) */
extern list_t xfer_gones;
extern map_t xfer_gone_map;
extern map_t xfer_gone_uids; /* uid -> gone_uid_t */

/* Round-robin queue of parts with units left to hand out. */
extern rrq_t xfer_runq;
/* registered by the layers above (xfer_remote.h, xfer.h) */
extern xfer_remote_ops_t xfer_rops;
extern xfer_spread_event_cb xfer_spread_event;
extern uint32_t xfer_nrequests;
extern uint32_t xfer_chunks_inflight; /* ours only: pool populate jobs share the
                                    copy engine but not this limit */
/* in deadline order (dl_node_t): offers nobody fetches yet, and genreqs
 * not yet ending */
extern list_t xfer_leases;
extern list_t xfer_timeouts;

extern xfer_offer_made_cb xfer_offer_made;

/* ---- xfer.c: keys, records of ended requests, small helpers ----------- */

/* A key for messages; up to four in one call's arguments. */
const char *xfer_ksb(const uint8_t *b, size_t len);
/* Insert in deadline order, searching from the tail: deadlines are
 * mostly increasing, so this is O(1) unless a reload shortened one. */
void dl_insert(list_t *l, dl_node_t *n, uint64_t deadline);
/* Off its list (a no-op when it is on none). */
void dl_remove(dl_node_t *n);
void gone_free(gone_t *x);
gone_t *gone_find(int offer, const char *inst, uint64_t request_id,
                  const uint8_t *key, size_t key_len);
/* Out of memory: not kept, and a late fetch finds nothing (NOT_FOUND or
 * a request of its own), as before this record existed. */
gone_t *gone_add(int offer, const instance_t *inst, uint64_t request_id,
                 const reqkey_t *key, uint64_t src);
/* Offer key of inst completed (its transfer done, consumed, or
 * released): remembered for deadlines.fetch_timeout_ms, in bounded
 * memory (xfer.c), so that a ready mark or a release that comes after
 * tells it from a key never published. done_find(): 1 while it is. */
void done_add(const instance_t *inst, const reqkey_t *key);
int done_find(const instance_t *inst, const reqkey_t *key);
/* A later offer of the key ended otherwise: its marks are NOT_FOUND. */
void done_forget(const instance_t *inst, const reqkey_t *key);
int xfer_ct_equal(const uint8_t *a, const uint8_t *b, size_t n);
void xfer_side_from_layout(plan_side_t *s, const instance_t *inst,
                           const kvx_layout_t *l);
/* The side of another group of a request (xfer_group_t), from a rank's
 * pool: the instance's parallelism, the pool's layers and heads over
 * every PP and TP rank (split evenly), its layout summary. */
void group_side(plan_side_t *s, const instance_t *inst, const kvx_layout_t *l);
/* The pool's layout must hold exactly this rank's share of the model
 * (of side: a group's, or the instance's). */
int check_side_layout(const plan_side_t *side, uint32_t rank,
                      const kvx_layout_t *l, const char *what, kvx_why_t *why);
int check_rank_layout(const instance_t *inst, uint32_t rank,
                      const kvx_layout_t *l, const char *what, kvx_why_t *why);
/* Local ranks of inst in attention-DP group dp (all local ranks without
 * DP): the ranks a fetch must hear from before its request completes. */
uint32_t group_ranks(const instance_t *inst, uint32_t dp);
/* Answer every waiter of ws (taken off the request first: the request
 * may be freed), in order; ws ends empty. */
void waiters_reply(list_t *ws);
/* cw waits for the request whose waiters ws are: first in ws, so the
 * newest cancel is answered first. */
int waiter_add(list_t *ws, cancel_wait_t *cw);
/* ranks: the ranks of inst this request covers here; expect: all it
 * needs (they differ for an instance spread over daemons, whose root
 * merges the reports: agree.c). aux: a fetch's COMPLETE only. */
void xfer_push_event(instance_t *inst, uint64_t request_id, const reqkey_t *key,
                     const batch_end_t *e, int offer, uint32_t ranks,
                     uint32_t expect);
/* An aux payload's copy, charged to the memory budget (MEM_AUX): 0, or
 * KVX_ERR_LIMIT / KVX_ERR_NOMEM with why (nothing kept). */
int aux_keep(uint32_t uid, const uint8_t *aux, uint32_t len, uint8_t **out,
             const char *what, kvx_why_t *why);
void aux_drop(uint32_t uid, uint8_t **aux, uint32_t *len);
/* Capability tokens: kernel randomness, fetched 4 KiB at a time so a busy
 * daemon does not make one syscall per offer. */
int xfer_random_token(uint8_t out[TOKEN_LEN]);

/* ---- params.c --------------------------------------------------------- */

int params_build(offer_t *o, const kvx_layout_t *l);

/* ---- offer.c ---------------------------------------------------------- */

void busy_hold(int delta);
/* What a part keeps of its layers' readiness. */
void part_layers_free(offer_part_t *sp);
/* Bytes held for inst's uid (MEM_REQUESTS): 0, or KVX_ERR_LIMIT with
 * why naming the key (limits.memory_bytes, limits.uid_memory_bytes). */
int xfer_req_charge(const instance_t *inst, uint64_t bytes, const char *what,
                    kvx_why_t *why);
void part_uncharge(const offer_t *o, offer_part_t *sp);
void offer_free(offer_t *o);

/* ---- fetch.c ---------------------------------------------------------- */

void genreq_free(genreq_t *g);
/* Has a streaming part segments it may copy now? */
int part_has_ready(const genpart_t *p);
/* Has a streaming part units not handed out yet (ready or not)? */
int part_has_left(const genpart_t *p);
/* The next job of a streaming part: the ready segments of the cell of
 * the lowest layer that has some (the decode needs layer 0 first), up to
 * units_per_chunk. 0 when nothing is ready. */
int part_next_job(genpart_t *p, uint64_t *u0, uint64_t *u1);
/* Units [u0, u1) of p's plan have landed: count them per layer of the
 * destination. */
void part_landed(genpart_t *p, uint64_t u0, uint64_t u1);
/* Bind a fetched part to its sources once they have all published. */
void part_try_start(genpart_t *p);

/* ---- sched.c ---------------------------------------------------------- */

/* One line of log.trace_file for a fetch that ends: "fetch INSTANCE KEY
 * KIND BYTES" and the hops' monotonic ns (0: not reached). */
void xfer_trace_write(genreq_t *g);
/* Part p of g is done, or has its last job out to a copy thread or a
 * GPU (last_out): once every part is, g's terminal event is at most one
 * copy away, and the instance's polls that asked Poll.early are answered
 * now, so that a caller asleep in its poll wakes while that copy runs (a
 * thread's wake-up costs tens of microseconds) and looks for the event
 * without sleeping. Not for an instance spread over daemons (its batches
 * are agreed on rank 0's daemon), nor when the last part settles by
 * ending or by a job run on the loop (the event goes out this turn), nor
 * for parts pulled from peer daemons (they settle by ending). */
void part_settle(genpart_t *p, int last_out);
/* Where p's bytes come from, for the metrics (sched.c). */
kvxd_path_t xfer_part_path(genpart_t *p);
/* Count a request's end in the metrics: side KVXD_SIDE_*, its end kind
 * and code (end.c). */
void xfer_count_end(int side, int kind, int code);
void xfer_schedule(void);

/* ---- end.c ------------------------------------------------------------ */

/* Forget a consumed offer (all ranks published, lease over, cancel). */
void offer_drop(offer_t *o);
/* The consumer took everything it needed while some ranks have not
 * published yet (replicated heads): complete now, release the memory,
 * keep the params for the late ranks until they publish or the lease
 * ends. */
void offer_consume(offer_t *o, const char *msg);
void offer_try_finalize(offer_t *o);
void offer_end(offer_t *o, int kind, int code, const char *msg);
void genreq_end(genreq_t *g, int kind, int code, const char *msg);

#endif /* KVX_XFER_INT_H */
