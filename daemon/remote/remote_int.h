/*
 * remote_int — what the files of remote share, and no one else reads:
 * the slots, the streams of both sides, and the state they live in.
 *
 *   remote.c   registration, the message switch, a lost connection, the
 *              tick (reading order: remote.c's head)
 *   pull.c     the generation side (D): streams pulled from sources
 *   source.c   the context side (S): streams served from offers
 *   slots.c    the staging slots, their pieces and copies, and the
 *              control messages both sides send
 *
 * remote.c calls pull.c and source.c, and both call slots.c: never the
 * other way.
 */
#ifndef KVX_REMOTE_INT_H
#define KVX_REMOTE_INT_H

#include <stdint.h>
#include <time.h>

#include "common/list.h"
#include "copy/copy.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "core/fault.h"
#include "core/log.h"
#include "core/map.h"
#include "core/rrq.h"
#include "kvxfer.pb-c.h"
#include "net/peer.h"
#include "remote.h"
#include "xfer/serve.h"
#include "xfer/xfer_remote.h"

/* Status: where the slots' time went (Kvxfer__SlotTimes, summed). */
typedef struct slot_times {
    uint64_t slots, bytes, wait_ns, wire_ns, copy_ns;
    uint64_t direct; /* pieces not scattered (received) or not gathered
                      * (sent): UCX had their places (peer.direct) */
    uint64_t lag_ns; /* of copy: a piece's copy finished until the loop
                      * took it up (busy with UCX, clients, ...) */
    uint64_t ahead;  /* sent: slots a PULL found gathered ahead */
} slot_times_t;

enum slot_state { SLOT_FREE, SLOT_PULLED, SLOT_RECEIVING, SLOT_BUSY };

#define MAX_PIECES 64 /* UCX messages per slot, at most */
#define SLOT_JOBS 64  /* copy jobs per slot, at most */

/* A slot travels as pieces (plan_cut_pieces(): whole units, at most
 * remote_message_bytes() each), each one UCX message. Both daemons cut a
 * slot the same way, so each piece is gathered, sent and scattered on its
 * own: the wire carries piece k while piece k+1 is gathered, and piece k
 * is scattered while k+1 is on the wire. */
typedef plan_piece_t piece_t;

typedef struct slot {
    uint8_t *mem;
    uint32_t idx;          /* named so on the wire (PULL, DATA): slot_at() */
    struct slots *set;     /* its set: host memory, or a GPU's */
    struct slot_times *st; /* its direction's times (st_rx, st_tx) */
    enum slot_state state;
    void *owner; /* rstream (receive) or sstream (send) */
    uint64_t u0, u1, bytes;
    genpart_t *part;   /* receive: whose destination */
    uint32_t dst_slot; /* send: the receiver's slot */
    piece_t pc[MAX_PIECES];
    uint64_t piece_bytes; /* the cut: at most this much a piece */
    uint32_t npieces;
    uint64_t got;        /* receive: a bit per piece landing/in */
    uint32_t landing;    /* receive: pieces UCX is writing */
    uint32_t arrived;    /* receive: pieces in */
    uint32_t copied;     /* receive: pieces scattered */
    uint32_t pending;    /* pieces being gathered or scattered */
    uint32_t sends_left; /* send: pieces UCX has not given back */
    int pulled;          /* send: a PULL named it (dst_slot set) */
    int ahead;           /* send: gathered ahead, in its stream's
                            ahead[], held for the PULL to come */
    uint64_t ready;      /* send: a bit per piece gathered ahead */
    uint64_t gather_ns;  /* send: an unpulled slot's gather time */
    int status;          /* the first failure (copy or receive) */
    int ending;          /* its stream ended: its copies a pace holds go
                            back unrun (copy_job_t.abort) */
    /* for status: wait from t_wait, copy or wire from t_stage */
    uint64_t t_wait, t_stage;
    /* a piece is copied by one GPU kernel, or by up to jpp jobs of about
     * copy.chunk_bytes on the copy threads (jobs[k * jpp ...]); piece_done
     * runs on the loop once all of piece k is back */
    uint32_t jpp;
    uint8_t piece_jobs[MAX_PIECES];
    /* pieces UCX writes straight into the destination blocks (receive)
     * or reads straight from the source blocks (send) (peer.direct),
     * each with its places, freed when UCX gives the piece back */
    uint64_t direct;
    peer_iov_t *iov[MAX_PIECES];
    /* send: what a piece sent from its places is called back with */
    struct piece_ref {
        struct slot *x;
        uint32_t k;
    } ref[MAX_PIECES];
    copy_job_t jobs[SLOT_JOBS];
    void (*piece_done)(struct slot *x, uint32_t k);
    list_t free_node; /* on its slots' free list while free */
} slot_t;

/* The slots of one direction: one set in host memory (pinned for CUDA
 * once a GPU pool uses it), and, where the loaded UCX moves CUDA memory
 * (peer_cuda()), a set in each pool device's memory (gpu.staging_bytes),
 * made on that device's first use and kept until the daemon stops: a
 * GPU pool's pieces are gathered and scattered by its kernels there and
 * never cross host memory where UCX's transport does not (cuda_ipc
 * within a node, GPUDirect RDMA with an IB-capable UCX). */
#define SLOT_DEVS 16
#define SLOT_GPU_BASE 0x10000u /* device d's slot i: (d + 1) * it + i */
typedef struct slots {
    uint8_t *mem;
    size_t len;
    void *memh;
    slot_t *v;
    uint32_t n;
    uint32_t base; /* v[0]'s idx */
    int device;    /* -1: host memory */
    list_t free;   /* the last one put back first */
    uint32_t nfree;
    int pinned; /* registered with CUDA (GPU pools) */
    slot_times_t *st;
    uint64_t bytes; /* moved through this set (a GPU set's, for status) */
    /* the host set: the GPU sets by device, and which were tried */
    struct slots *gpu[SLOT_DEVS];
    uint8_t gpu_tried[SLOT_DEVS];
} slots_t;

/* D: one slice of a part, pulled from its source daemon. */
typedef struct rstream {
    uint64_t id, source; /* ours; the source daemon's */
    genpart_t *part;
    uint64_t conn; /* peer_conn_id(): looked up to send */
    uint32_t slice;
    uint64_t u_begin, u_end, next_unit;
    int opened, ended, refused;
    uint64_t retry_ms; /* not published there yet: ask again */
    int layerwise;     /* OPENED.layerwise: pull a layer of the slice */
    uint64_t retry_until_ms;
    uint32_t retries; /* asked again so far: the next wait */
    uint64_t units_done;
    uint32_t held;    /* slots PULLED or RECEIVING for it */
    rrq_entry_t turn; /* waiting for a receive slot */
    /* why it ended, for an END sent only once its OPENED comes: the
     * source hears the request's own code, as when it was open */
    int end_code;
    char end_msg[160];
} rstream_t;

/* D: what this module keeps of a part pulled from peer daemons
 * (genpart_t's remote): its receiving streams, one per slice, made by
 * remote_part_start(), freed with the part (remote_part_free(), through
 * xfer). xfer never reads it. */
typedef struct rpart {
    uint32_t nstreams, nslices; /* made so far, of one per slice */
    rstream_t *streams[];
} rpart_t;

/* S: a stream some generation daemon reads from one of our offers. */
#define AHEAD_MAX 8 /* peer.gather_ahead's bound */

typedef struct pull {
    uint32_t slot;
    uint64_t u0, u1;
    uint64_t t_arrived;
    struct sstream *s;
    list_t node; /* on pulls, in the order they came */
} pull_t;
#define PULL(n) LIST_OWNER(n, pull_t, node)

typedef struct sstream {
    uint64_t id, dst_id;
    uint32_t rails; /* a GPU source's: peer_gpu_rails() of its GPU; 0 */
    uint64_t conn;  /* peer_conn_id(): looked up to send */
    offer_t *offer; /* NULL once the stream ended */
    offer_t *fence; /* whose fence our gathers hold: set for
                       life (the offer outlives our gathers) */
    plan_t *plan;
    kvx_layout_t dst_layout; /* the row shape of the packed units */
    uint32_t slice, src_rank;
    uint32_t group; /* the offer's block table it reads */
    uint64_t u_begin, u_end;
    int ended;
    uint32_t gathers, sends;
    gpu_part_t *gpu; /* a GPU source: the gather is a kernel */
    /* gather-ahead (peer.gather_ahead): send slots gathered for the PULLs
     * to come, cut as the generation daemon cuts them (pull_bytes, its
     * peer.slot_bytes; 0: unknown, none) from ahead_at on */
    uint64_t pull_bytes, ahead_at;
    slot_t *ahead[AHEAD_MAX];
    uint32_t nahead;
    int ahead_off;   /* a PULL asked for something else */
    uint32_t queued; /* its PULLs waiting for a send slot */
    int aux_sent;    /* the offer's aux went with an OPENED */
    int layerwise;   /* its source's layers come one by one (OPENED) */
    list_t node;     /* on its offer's streams until it ends */
} sstream_t;

/* S: what this module keeps of an offer peer daemons read (offer_t's
 * remote): made at the first OPEN, freed with the offer
 * (remote_offer_free(), through xfer). xfer reads only its first
 * member (xfer/serve.c). */
typedef struct roffer {
    xfer_served_t sv; /* first: who serves it (xfer/serve.h) */
    list_t streams;   /* sstream_t reading it now, newest first */
} roffer_t;

/* A generation daemon never has more PULLs of one stream out than its
 * receive slots (peer.slots, at most 1024): more is a broken peer. */
#define PULLS_QUEUED_MAX 1024

/* Offers serve_pulls() could not bind a source for: ended from the
 * tick, never inside serve_pulls(), whose callers (a gather or send
 * coming back, a stream's end, a publish) still hold the offer. */
typedef struct offer_fail {
    char instance[INSTANCE_ID_MAX + 1];
    uint64_t request_id;
    int code;
    list_t node;
} offer_fail_t;
extern list_t ofails;

/* An offer-done that came before the offer (its ranks had not published
 * yet): applied at the publish, or dropped after offer_lease_ms. */
typedef struct done_note {
    char instance[INSTANCE_ID_MAX + 1];
    uint64_t request_id;
    uint64_t until_ms;
    list_t node;
} done_note_t;
extern list_t done_notes;
#define DONE_NOTE(n) LIST_OWNER(n, done_note_t, node)
extern uint32_t ndone_notes;
#define DONE_NOTES_MAX 4096

/* "not yet published": asked again after 20 ms, doubling to 320 ms,
 * until the fetch's own deadline (a reservation's ranks publish when
 * they do) */
#define OPEN_RETRY_FIRST_MS 20
#define OPEN_RETRY_MAX_MS 320

extern slots_t rslots, sslots;
/* peer.direct, resolved: receive long-run pieces into host pools. On
 * the 2-CPU VM that moved 13-24 % more (a copy fewer where copies are
 * what is short); on the 16-CPU H200 host 25-40 % less (the unpack runs
 * on the lanes' 2 threads, the scatter on 16 copy threads). */
extern int direct_on;
extern map_t rstreams, sstreams;
extern uint64_t next_id;
extern rrq_t pullq;
extern uint32_t retrying; /* rstreams waiting to OPEN again */
extern list_t pulls;      /* waiting for a send slot */

extern slot_times_t st_rx, st_tx;

/* An offer no peer opened reads as roffer_none. */
extern const roffer_t roffer_none;
static inline const roffer_t *RO(const offer_t *o)
{
    const roffer_t *ro = (const roffer_t *)xfer_offer_remote(o);
    return ro ? ro : &roffer_none;
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* slots.c */
uint64_t stream_cut_end(const plan_t *pl, uint64_t slice_begin, uint64_t u0,
                        uint64_t end, int layerwise);
void remote_slot_times(Kvxfer__SlotTimes *received, Kvxfer__SlotTimes *sent);
int slots_init(slots_t *s, const char *what, slot_times_t *st, kvx_why_t *why);
int slots_device(slots_t *s, int device, kvx_why_t *why);
void slots_cleanup(slots_t *s);
slots_t *slots_for(slots_t *s, int device);
slot_t *slot_at(slots_t *s, uint32_t idx);
slot_t *slot_next(slots_t *s, slot_t *prev);
slot_t *slot_get(slots_t *s);
void slot_put(slots_t *s, slot_t *x);
void slot_cut(slot_t *x, const plan_t *plan, uint64_t pb);
void piece_copy(slot_t *x, uint32_t k, const plan_t *plan, gpu_part_t *gpu,
                int gather);
int piece_at(const slot_t *x, uint64_t off);
void slots_owner_ended(slots_t *s, const void *owner);
void send_end_ex(peer_conn_t *c, uint64_t stream, int code, const char *msg,
                 int final);
void send_end(peer_conn_t *c, uint64_t stream, int code, const char *msg);
peer_conn_t *conn_live(uint64_t id);
int send_on(uint64_t id, const Kvxfer__PeerMsg *m);
uint32_t piece_places(slot_t *x, uint32_t k, const plan_t *plan, int gather);
int direct_in(slot_t *x, uint32_t k);

/* pull.c */
int send_open(rstream_t *r);
void on_opened(peer_conn_t *c, const Kvxfer__PeerOpened *o);
void on_end_to_d(peer_conn_t *c, const Kvxfer__PeerStreamEnd *e);

/* source.c */
void sstream_end(sstream_t *s);
int offer_waits_for(const offer_t *o, const char *addr);
void on_open(peer_conn_t *c, const Kvxfer__PeerOpen *m);
void serve_pulls(void);
void on_pull(peer_conn_t *c, const Kvxfer__PeerPull *m);
void on_offer_done(peer_conn_t *c, const Kvxfer__PeerOfferDone *d);
void done_notes_tick(uint64_t now);
void on_end(peer_conn_t *c, const Kvxfer__PeerStreamEnd *e);

#endif /* KVX_REMOTE_INT_H */
