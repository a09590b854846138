/*
 * remote — transfers between daemons: the generation daemon pulls each
 * slice of a part from the daemon serving its source rank, through
 * staging slots, pipelined.
 *
 * Reading order (generation daemon, "D"):
 *   remote_part_start()  one rstream per slice; OPEN to the source daemon
 *                        with the capability token and what the plan needs
 *   on_opened()          the source accepted: the stream joins the pull
 *                        queue
 *   pull_schedule()      round-robin over streams: a free receive slot gets
 *                        the next units that fit in it, asked for by PULL
 *   remote_data_target / remote_on_data
 *                        DATA lands in the slot, piece by piece
 *                        (rendezvous straight into its place); each piece
 *                        in is scattered into the pool at once
 *                        (piece_copy: copy threads, or a kernel for a GPU
 *                        pool) while the next ones are on the wire;
 *                        scatter_done() counts its units in xfer, and the
 *                        last one frees the slot. peer.direct: a piece
 *                        whose destination runs are long (piece_places)
 *                        is received by UCX into the host pool itself,
 *                        an iov of those runs, and counted as scattered
 *                        when it is in
 *   on_end_to_d()        the source refused or ended the stream; "not
 *                        yet published" is asked again until the
 *                        fetch's deadline
 * (context daemon, "S"):
 *   on_open()            finds the offer, checks the token, builds the
 *                        same plan, and counts the streams it will serve
 *   on_pull()/serve_pulls()
 *                        a free send slot is cut into pieces of
 *                        remote_message_bytes() on unit boundaries
 *                        (slot_cut, the same cut the receiver checks);
 *                        each piece is gathered (piece_copy: copy threads,
 *                        or a kernel writing the pinned slot) and sent the
 *                        moment it is (gather_done; peer.c keeps
 *                        peer.send_window messages in flight); the last
 *                        one back frees the slot (on_sent, sslot_release).
 *                        peer.direct: a piece whose source runs are long
 *                        is not gathered but sent by UCX from an iov of
 *                        them (slot_gather, piece_places), and counts as
 *                        gathered when UCX gives it back (on_sent_direct)
 *   ahead_fill()/ahead_take()
 *                        peer.gather_ahead: free send slots gather the
 *                        units of a stream's next PULLs (cut as the
 *                        receiver cuts, OPEN's pull_bytes); a PULL for
 *                        them sends at once
 *   on_end()             the generation side is done with the stream; the
 *                        last one completes the offer
 * Either side: a lost connection ends every stream on it.
 *
 * Owns the slots (registered with UCX once), the streams, their copy
 * jobs and the iovs of pieces received into pools. The fences: a
 * request's scatters and direct receives (D) and an offer's gathers (S)
 * are counted in the request, which xfer does not finalize before they
 * are back. A direct receive holds its request's fence from the moment
 * its places are handed to UCX (remote_data_target) until UCX gives it
 * back, done or failed (remote_on_data); a direct send counts as a
 * gather until UCX gives it back (on_sent_direct). Every other receive
 * and send touches only slots, daemon memory.
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "copy/copy.h"
#include "core/daemon.h"
#include "core/fault.h"
#include "common/list.h"
#include "core/log.h"
#include "core/map.h"
#include "net/peer.h"
#include "copy/pool.h"
#include "remote.h"
#include "core/rrq.h"
#include "xfer/xfer_remote.h"

enum slot_state { SLOT_FREE, SLOT_PULLED, SLOT_RECEIVING, SLOT_BUSY };

#define MAX_PIECES 64            /* UCX messages per slot, at most */
#define SLOT_JOBS 64             /* copy jobs per slot, at most */

/* A slot travels as pieces (plan_cut_pieces(): whole units, at most
 * remote_message_bytes() each), each one UCX message. Both daemons cut a
 * slot the same way, so each piece is gathered, sent and scattered on its
 * own: the wire carries piece k while piece k+1 is gathered, and piece k
 * is scattered while k+1 is on the wire. */
typedef plan_piece_t piece_t;

typedef struct slot {
    uint8_t *mem;
    uint32_t idx;
    struct slot_times *st;       /* its direction's times (st_rx, st_tx) */
    enum slot_state state;
    void *owner;                 /* rstream (receive) or sstream (send) */
    uint64_t u0, u1, bytes;
    genpart_t *part;             /* receive: whose destination */
    uint32_t dst_slot;           /* send: the receiver's slot */
    piece_t pc[MAX_PIECES];
    uint64_t piece_bytes;        /* the cut: at most this much a piece */
    uint32_t npieces;
    uint64_t got;                /* receive: a bit per piece landing/in */
    uint32_t landing;            /* receive: pieces UCX is writing */
    uint32_t arrived;            /* receive: pieces in */
    uint32_t copied;             /* receive: pieces scattered */
    uint32_t pending;            /* pieces being gathered or scattered */
    uint32_t sends_left;         /* send: pieces UCX has not given back */
    int pulled;                  /* send: a PULL named it (dst_slot set) */
    int ahead;                   /* send: gathered ahead, in its stream's
                                    ahead[], held for the PULL to come */
    uint64_t ready;              /* send: a bit per piece gathered ahead */
    uint64_t gather_ns;          /* send: an unpulled slot's gather time */
    int status;                  /* the first failure (copy or receive) */
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

typedef struct slots {
    uint8_t *mem;
    size_t len;
    void *memh;
    slot_t *v;
    list_t free; /* the last one put back first */
    uint32_t nfree;
    int pinned;                  /* registered with CUDA (GPU pools) */
} slots_t;

/* D: one slice of a part, pulled from its source daemon. */
typedef struct rstream {
    uint64_t id, source;         /* ours; the source daemon's */
    genpart_t *part;
    uint64_t conn; /* peer_conn_id(): looked up to send */
    uint32_t slice;
    uint64_t u_begin, u_end, next_unit;
    int opened, ended, refused;
    uint64_t retry_ms;           /* not published there yet: ask again */
    uint64_t retry_until_ms;
    uint32_t retries; /* asked again so far: the next wait */
    uint64_t units_done;
    uint32_t held;               /* slots PULLED or RECEIVING for it */
    rrq_entry_t turn;            /* waiting for a receive slot */
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
#define AHEAD_MAX 8              /* peer.gather_ahead's bound */

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
    uint64_t conn;               /* peer_conn_id(): looked up to send */
    offer_t *offer;              /* NULL once the stream ended */
    offer_t *fence;              /* whose fence our gathers hold: set for
                                    life (the offer outlives our gathers) */
    plan_t *plan;
    kvx_layout_t dst_layout;     /* the row shape of the packed units */
    uint32_t slice, src_rank;
    uint32_t group; /* the offer's block table it reads */
    uint64_t u_begin, u_end;
    int ended;
    uint32_t gathers, sends;
    gpu_part_t *gpu;             /* a GPU source: the gather is a kernel */
    /* gather-ahead (peer.gather_ahead): send slots gathered for the PULLs
     * to come, cut as the generation daemon cuts them (pull_bytes, its
     * peer.slot_bytes; 0: unknown, none) from ahead_at on */
    uint64_t pull_bytes, ahead_at;
    slot_t *ahead[AHEAD_MAX];
    uint32_t nahead;
    int ahead_off;               /* a PULL asked for something else */
    uint32_t queued;             /* its PULLs waiting for a send slot */
    int aux_sent;                /* the offer's aux went with an OPENED */
    list_t node;                 /* on its offer's streams until it ends */
} sstream_t;

/* S: what this module keeps of an offer peer daemons read (offer_t's
 * remote): made at the first OPEN, freed with the offer
 * (remote_offer_free(), through xfer). xfer never reads it. */
typedef struct roffer {
    list_t streams;          /* sstream_t reading it now, newest first */
    uint32_t streams_expect; /* streams that will come in all */
    uint32_t streams_opened; /* accepted: at most streams_expect */
    uint32_t streams_done;   /* completed */
    char rconsumer[256];     /* who: "request N of instance 'x'" */
    uint8_t *rread;          /* context ranks the consumer reads */
    char **consumer_addrs;   /* daemons whose streams it waits for */
    uint32_t nconsumer_addrs;
} roffer_t;

/* An offer no peer opened reads as this. */
static const roffer_t roffer_none = {
    .streams = {(list_t *)&roffer_none.streams,
                (list_t *)&roffer_none.streams}};

static const roffer_t *RO(const offer_t *o)
{
    const roffer_t *ro = xfer_offer_remote(o);
    return ro ? ro : &roffer_none;
}

static roffer_t *roffer_new(void)
{
    roffer_t *ro = calloc(1, sizeof(*ro));
    if (ro)
        list_init(&ro->streams);
    return ro;
}

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
static list_t ofails = {&ofails, &ofails};

/* An offer-done that came before the offer (its ranks had not published
 * yet): applied at the publish, or dropped after offer_lease_ms. */
typedef struct done_note {
    char instance[INSTANCE_ID_MAX + 1];
    uint64_t request_id;
    uint64_t until_ms;
    list_t node;
} done_note_t;
static list_t done_notes = {&done_notes, &done_notes};
#define DONE_NOTE(n) LIST_OWNER(n, done_note_t, node)
static uint32_t ndone_notes;
#define DONE_NOTES_MAX 4096
static int done_notes_apply(offer_t *o);
static void done_notes_tick(uint64_t now);
static void offer_done_notify(offer_t *o);

/* "not yet published": asked again after 20 ms, doubling to 320 ms,
 * until the fetch's own deadline (a reservation's ranks publish when
 * they do) */
#define OPEN_RETRY_FIRST_MS 20
#define OPEN_RETRY_MAX_MS 320

static slots_t rslots, sslots;
/* peer.direct, resolved: receive long-run pieces into host pools. On
 * the 2-CPU VM that moved 13-24 % more (a copy fewer where copies are
 * what is short); on the 16-CPU H200 host 25-40 % less (the unpack runs
 * on the lanes' 2 threads, the scatter on 16 copy threads). */
static int direct_on;
static map_t rstreams, sstreams;
static uint64_t next_id = 1;
static rrq_t pullq;
static uint32_t retrying;          /* rstreams waiting to OPEN again */
static list_t pulls = {&pulls, &pulls}; /* waiting for a send slot */

static void pull_schedule(void);
static void serve_pulls(void);

/* Status: where the slots' time went (Kvxfer__SlotTimes, summed). */
typedef struct slot_times {
    uint64_t slots, bytes, wait_ns, wire_ns, copy_ns;
    uint64_t direct; /* pieces not scattered (received) or not gathered
                      * (sent): UCX had their places (peer.direct) */
    uint64_t lag_ns; /* of copy: a piece's copy finished until the loop
                      * took it up (busy with UCX, clients, ...) */
    uint64_t ahead;  /* sent: slots a PULL found gathered ahead */
} slot_times_t;
static slot_times_t st_rx, st_tx;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void remote_slot_times(Kvxfer__SlotTimes *received, Kvxfer__SlotTimes *sent)
{
    const slot_times_t *from[2] = {&st_rx, &st_tx};
    Kvxfer__SlotTimes *to[2] = {received, sent};
    for (int i = 0; i < 2; i++) {
        to[i]->slots = from[i]->slots;
        to[i]->bytes = from[i]->bytes;
        to[i]->wait_ns = from[i]->wait_ns;
        to[i]->wire_ns = from[i]->wire_ns;
        to[i]->copy_ns = from[i]->copy_ns;
        to[i]->loop_lag_ns = from[i]->lag_ns;
        to[i]->ahead = from[i]->ahead;
        to[i]->direct = from[i]->direct;
    }
    received->free_slots = rslots.nfree;
    sent->free_slots = sslots.nfree;
}

/* ---- slots ------------------------------------------------------------- */

static int slots_init(slots_t *s, const char *what, slot_times_t *st,
                      char *why, size_t why_len)
{
    uint32_t n = remote_slots();
    list_init(&s->free);
    s->len = (size_t)n * kvxd.conf.slot_bytes;
    if (kvxd_mem_charge(MEM_STAGING, s->len)) {
        snprintf(why, why_len,
                 "peer.slots: %u %s slots of %llu bytes pass the daemon's "
                 "memory budget (limits.memory_bytes %llu, %llu in use)",
                 n, what, (unsigned long long)kvxd.conf.slot_bytes,
                 (unsigned long long)kvxd.conf.memory_bytes,
                 (unsigned long long)kvxd_mem_used(MEM_KINDS));
        s->len = 0;
        return KVX_ERR_LIMIT;
    }
    s->mem = mmap(NULL, s->len, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (s->mem == MAP_FAILED) {
        s->mem = NULL;
        snprintf(why, why_len, "peer.slots: cannot map %zu bytes of %s "
                               "slots",
                 s->len, what);
        return KVX_ERR_NOMEM;
    }
    s->v = calloc(n, sizeof(*s->v));
    if (!s->v) {
        snprintf(why, why_len, "out of memory");
        return KVX_ERR_NOMEM;
    }
    for (uint32_t i = 0; i < n; i++) {
        s->v[i].mem = s->mem + (size_t)i * kvxd.conf.slot_bytes;
        s->v[i].idx = i;
        s->v[i].st = st;
        for (uint32_t k = 0; k < MAX_PIECES; k++)
            s->v[i].ref[k] = (struct piece_ref){&s->v[i], k};
        list_push(&s->free, &s->v[i].free_node);
    }
    s->nfree = n;
    /* registered once, so rendezvous never registers per message */
    s->memh = peer_mem_map(s->mem, s->len);
    return 0;
}

/* GPU pools: kernels read and write the slots (pinned, mapped). */
static int slots_pin(slots_t *s, int device, char *why, size_t why_len)
{
    if (s->pinned)
        return 0;
    if (gpu_host_register(s->mem, s->len, device)) {
        snprintf(why, why_len, "cannot pin the %zu-byte staging slots for "
                               "the GPU",
                 s->len);
        return KVX_ERR_IO;
    }
    s->pinned = 1;
    return 0;
}

static void slots_cleanup(slots_t *s)
{
    /* places of pieces UCX never gave back (a shutdown drops the lanes'
     * events) */
    for (uint32_t i = 0; s->v && i < remote_slots(); i++)
        for (uint32_t k = 0; k < MAX_PIECES; k++)
            free(s->v[i].iov[k]);
    if (s->pinned)
        gpu_host_unregister(s->mem);
    peer_mem_unmap(s->memh);
    if (s->mem)
        munmap(s->mem, s->len);
    kvxd_mem_release(MEM_STAGING, s->len); /* charged by slots_init() */
    free(s->v);
    memset(s, 0, sizeof(*s));
}

static slot_t *slot_get(slots_t *s)
{
    if (!s->nfree)
        return NULL;
    assert(!list_empty(&s->free)); /* nfree counts it */
    slot_t *x = LIST_OWNER(list_first(&s->free), slot_t, free_node);
    assert(x->state == SLOT_FREE);
    list_remove(&x->free_node);
    s->nfree--;
    x->state = SLOT_BUSY;
    return x;
}

static void slot_put(slots_t *s, slot_t *x)
{
    assert(x->state != SLOT_FREE); /* one owner, one put */
    x->state = SLOT_FREE;
    x->owner = NULL;
    x->part = NULL;
    x->piece_bytes = x->got = 0;
    x->npieces = x->landing = x->arrived = x->copied = x->pending = 0;
    x->sends_left = 0;
    x->pulled = x->ahead = 0;
    x->ready = x->gather_ns = 0;
    x->status = 0;
    assert(!x->direct); /* every piece's places went when UCX was done */
    list_push(s->free.next, &x->free_node); /* first */
    assert(s->nfree < remote_slots());
    s->nfree++;
}

/* Cut x (u0, u1, bytes set) into pieces of at most pb. */
static void slot_cut(slot_t *x, const plan_t *plan, uint64_t pb)
{
    x->piece_bytes = pb;
    x->npieces = plan_cut_pieces(plan, x->u0, x->u1, pb, x->pc, MAX_PIECES);
    x->jpp = SLOT_JOBS / x->npieces;
}

static void piece_run(copy_job_t *job)
{
    plan_exec_packed(job->plan, job->unit_begin, job->unit_end, job->packed,
                     job->packed_gather);
    if (fault_hit(job->packed_gather ? FAULT_GATHER : FAULT_SCATTER))
        job->status = KVX_ERR_IO; /* as a failed GPU kernel reports */
}

static void job_done(copy_job_t *job)
{
    slot_t *x = job->owner;
    uint32_t k = (uint32_t)(job - x->jobs) / x->jpp;
    if (job->status && !x->status)
        x->status = job->status;
    if (--x->piece_jobs[k])
        return;
    x->st->lag_ns += now_ns() - job->t_done;
    x->piece_done(x, k);
}

/* Gather piece k of x into the slot, or scatter it from there: a kernel
 * on gpu, else up to x->jpp jobs on the copy threads; x->piece_done(x, k)
 * runs on the loop when all of it is back (x->status: the first error). */
static void piece_copy(slot_t *x, uint32_t k, const plan_t *plan,
                       gpu_part_t *gpu, int gather)
{
    const piece_t *pc = &x->pc[k];
    copy_job_t *jobs = &x->jobs[k * x->jpp];
    uint64_t chunk = gpu ? UINT64_MAX : kvxd.conf.copy_chunk_bytes;
    uint64_t off = pc->off;
    uint32_t n = 0;
    x->pending++;
    for (uint64_t u = pc->u0; u < pc->u1;) {
        /* about chunk bytes a job; the last allowed job takes the rest */
        copy_job_t *j = &jobs[n++];
        uint64_t b = 0, e = u;
        while (e < pc->u1 && (b < chunk || n == x->jpp))
            b += plan_units_bytes(plan, e, e + 1), e++;
        memset(j, 0, sizeof(*j));
        j->run = gpu ? NULL : piece_run; /* a GPU job is one kernel */
        j->gpu = gpu;
        j->plan = plan;
        j->unit_begin = u;
        j->unit_end = e;
        j->bytes = b;
        j->packed = x->mem + off;
        j->packed_gather = gather;
        j->done = job_done;
        j->owner = x;
        off += b;
        u = e;
    }
    x->piece_jobs[k] = (uint8_t)n;
    for (uint32_t i = 0; i < n; i++)
        copy_submit(&jobs[i]);
}

/* The piece of x at byte offset off, or -1. */
static int piece_at(const slot_t *x, uint64_t off)
{
    uint32_t lo = 0, hi = x->npieces;
    while (lo < hi) {
        uint32_t m = (lo + hi) / 2;
        if (x->pc[m].off == off)
            return (int)m;
        if (x->pc[m].off < off)
            lo = m + 1;
        else
            hi = m;
    }
    return -1;
}

void remote_offer_free(roffer_t *ro)
{
    assert(list_empty(&ro->streams)); /* the offer ended them */
    for (uint32_t i = 0; i < ro->nconsumer_addrs; i++)
        free(ro->consumer_addrs[i]);
    free(ro->consumer_addrs);
    free(ro->rread);
    free(ro);
}

static const char *offer_taker(const offer_t *o)
{
    return RO(o)->rconsumer[0] ? RO(o)->rconsumer : NULL;
}

static uint32_t offer_streams(const offer_t *o, uint32_t *done)
{
    *done = RO(o)->streams_done;
    return RO(o)->streams_expect;
}

int remote_init(char *why, size_t why_len)
{
    /* what xfer and net call, whether peers are on or not */
    static const xfer_remote_ops_t ops = {.part_start = remote_part_start,
                                          .part_stop = remote_part_stop,
                                          .part_free = remote_part_free,
                                          .offer_stop = remote_offer_stop,
                                          .offer_published =
                                              remote_offer_published,
                                          .offer_free = remote_offer_free,
                                          .offer_taker = offer_taker,
                                          .offer_streams = offer_streams};
    xfer_set_remote_ops(&ops);
    static const int kinds[] = {
        KVXFER__PEER_MSG__M_OPEN, KVXFER__PEER_MSG__M_OPENED,
        KVXFER__PEER_MSG__M_PULL, KVXFER__PEER_MSG__M_OFFER_DONE,
        KVXFER__PEER_MSG__M_END};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        peer_on_msg(kinds[i], remote_on_msg);
    peer_on_lost(remote_on_conn_lost);
    static const peer_data_ops_t data = {.target = remote_data_target,
                                         .arrived = remote_on_data,
                                         .streams = remote_conn_streams};
    peer_set_data_ops(&data);
    /* auto: where copies, not threads, are short, and not where UCX may
     * use RDMA (an iov gives up its zero-copy rendezvous there) */
    direct_on = kvxd.conf.direct == 1 ||
                (kvxd.conf.direct == 2 && kvxd_cpus() < 4 && !peer_rdma());
    if (!peer_enabled())
        return 0;
    if (kvxd.conf.direct == 2)
        log_info("peers: sending from and receiving into host pools "
                 "(peer.direct auto): %s (%d CPUs, %s)",
                 direct_on ? "on" : "off", kvxd_cpus(),
                 peer_rdma() ? "an RDMA device" : "no RDMA device");
    int rc;
    if ((rc = slots_init(&rslots, "receive", &st_rx, why, why_len)) ||
        (rc = slots_init(&sslots, "send", &st_tx, why, why_len)))
        return rc;
    log_info("peers: %u + %u host staging slots of %llu bytes, registered "
             "with UCX (pinned for CUDA on first GPU use)",
             remote_slots(), remote_slots(),
             (unsigned long long)kvxd.conf.slot_bytes);
    return 0;
}

void remote_cleanup(void)
{
    while (!list_empty(&done_notes)) {
        done_note_t *n = DONE_NOTE(done_notes.next);
        list_remove(&n->node);
        free(n);
    }
    ndone_notes = 0;
    while (!list_empty(&ofails)) {
        offer_fail_t *f = LIST_OWNER(ofails.next, offer_fail_t, node);
        list_remove(&f->node);
        free(f);
    }
    slots_cleanup(&rslots);
    slots_cleanup(&sslots);
    map_free(&rstreams);
    map_free(&sstreams);
}

static void send_end_ex(peer_conn_t *c, uint64_t stream, int code,
                        const char *msg, int final)
{
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerStreamEnd e = KVXFER__PEER_STREAM_END__INIT;
    e.stream = stream;
    e.code = code;
    e.message = (char *)msg;
    e.final = final;
    m.m_case = KVXFER__PEER_MSG__M_END;
    m.end = &e;
    peer_send(c, &m);
}

static void send_end(peer_conn_t *c, uint64_t stream, int code,
                     const char *msg)
{
    send_end_ex(c, stream, code, msg, 0);
}

/* The connection a stream runs on (its peer_conn_id()), or NULL when it
 * is lost or gone: then the loss path ends the stream (remote_on_conn_lost
 * runs, or has run), and nothing is sent. */
static peer_conn_t *conn_live(uint64_t id)
{
    peer_conn_t *c = peer_conn_find(id);
    return c && peer_conn_alive(c) ? c : NULL;
}

/* A control message on the connection named id: as peer_send(), and
 * KVX_ERR_PEER_GONE when it is lost or gone. */
static int send_on(uint64_t id, const Kvxfer__PeerMsg *m)
{
    peer_conn_t *c = conn_live(id);
    return c ? peer_send(c, m) : KVX_ERR_PEER_GONE;
}

/* ---- D: the generation side -------------------------------------------- */

static void rq_push(rstream_t *r) { rrq_push(&pullq, &r->turn); }
static void rq_drop(rstream_t *r) { rrq_remove(&pullq, &r->turn); }

static int send_open(rstream_t *r)
{
    const plan_t *plan = xfer_part_plan(r->part);
    xfer_part_desc_t d;
    xfer_part_describe(r->part, &d);
    const instance_t *inst = d.inst;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerOpen o = KVXFER__PEER_OPEN__INIT;
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    Kvxfer__Layout lay = KVXFER__LAYOUT__INIT;
    o.stream = r->id;
    o.instance_id = (char *)d.src_instance;
    o.request_id = d.src_request;
    o.key.data = (uint8_t *)d.src_key->b;
    o.key.len = d.src_key->len;
    o.consumer_key.data = (uint8_t *)d.key->b;
    o.consumer_key.len = d.key->len;
    o.token.data = (uint8_t *)d.token;
    o.token.len = TOKEN_LEN;
    xfer_side_to_msg(&d.dst, &pc, &lay);
    lay.preset = (char *)xfer_part_pool(r->part)->layout.preset;
    o.dst_parallel = &pc;
    o.dst_layout = &lay;
    o.dst_rank = d.dst_rank;
    o.skip_tokens = d.skip_tokens;
    o.slice = r->slice;
    o.nunits = plan->nunits;
    o.bytes = plan->bytes;
    o.pull_bytes = kvxd.conf.slot_bytes; /* pull_schedule()'s cut */
    uint32_t nd = plan_side_ranks(&d.dst);
    /* the daemon of each rank of the receiving group, in the plan's rank
     * order: the source waits for their streams, and knows whom to miss */
    char **addrs = calloc(nd ? nd : 1, sizeof(char *));
    if (!addrs)
        return KVX_ERR_NOMEM;
    for (uint32_t q = 0; q < inst->nranks; q++) {
        plan_side_t e;
        uint32_t er;
        if (plan_dp_view(&inst->side, q, &e, &er) == d.dp_rank && er < nd)
            addrs[er] = inst->addresses[q];
    }
    for (uint32_t q = 0; q < nd; q++)
        if (!addrs[q])
            addrs[q] = "";
    o.n_dst_addresses = nd;
    o.dst_addresses = addrs;
    o.consumer_instance = (char *)inst->id;
    o.consumer_request = d.request_id;
    /* several block tables: which one, and every table's side */
    Kvxfer__PeerOpenGroup og[XFER_MAX_GROUPS], *ogp[XFER_MAX_GROUPS];
    Kvxfer__ParallelConfig gpc[XFER_MAX_GROUPS];
    Kvxfer__Layout glay[XFER_MAX_GROUPS];
    o.group = d.group;
    for (uint32_t k = 0; d.ngroups > 1 && k < d.ngroups; k++) {
        kvxfer__peer_open_group__init(&og[k]);
        kvxfer__parallel_config__init(&gpc[k]);
        kvxfer__layout__init(&glay[k]);
        xfer_side_to_msg(&d.gdst[k], &gpc[k], &glay[k]);
        glay[k].preset = "";
        og[k].parallel = &gpc[k];
        og[k].layout = &glay[k];
        og[k].skip_tokens = d.gskip[k];
        ogp[k] = &og[k];
    }
    if (d.ngroups > 1) {
        o.n_groups = d.ngroups;
        o.groups = ogp;
    }
    m.m_case = KVXFER__PEER_MSG__M_OPEN;
    m.open = &o;
    int rc = send_on(r->conn, &m);
    free(addrs);
    return rc;
}

int remote_part_start(genpart_t *p, const Kvxfer__ContextParams *cp,
                      char *why, size_t why_len)
{
    plan_t *plan = xfer_part_plan(p);
    const pool_t *pool = xfer_part_pool(p);
    if (!peer_enabled()) {
        snprintf(why, why_len,
                 "fetch.context_params: the context ranks are served by "
                 "daemon '%s', and transfers between daemons are off here "
                 "(peer.listen is empty)",
                 cp->rank_addresses[0]);
        return KVX_ERR_UNSUPPORTED;
    }
    if (!pool->gpu) { /* GPU pools: checked below, once unbound */
        int rc = plan_check_bounds(plan, &(kvx_why_t){why, why_len});
        if (rc)
            return rc;
    }
    if (pool->gpu) {
        /* a GPU destination: the scatter is a kernel reading the slot */
        int rc, dev = pool->device;
        static const kvx_layout_t none; /* sources: packed in the slot */
        for (uint32_t i = 0; i < plan->nslices; i++)
            plan->src[i] = (plan_mem_t){.layout = &none};
        if ((rc = plan_check_bounds(plan, &(kvx_why_t){why, why_len})) ||
            (rc = slots_pin(&rslots, dev, why, why_len)) ||
            (rc = xfer_part_upload(p, dev, &(kvx_why_t){why, why_len})))
            return rc;
    }
    rpart_t *rp = calloc(1, sizeof(*rp) + plan->nslices * sizeof(rstream_t *));
    if (!rp) {
        snprintf(why, why_len, "fetch: out of memory");
        return KVX_ERR_NOMEM;
    }
    rp->nslices = plan->nslices;
    xfer_part_set_remote(p, rp); /* freed with p, whatever happens below */
    for (uint32_t i = 0; i < plan->nslices; i++) {
        const char *addr = cp->rank_addresses[plan->slices[i].src_rank];
        peer_conn_t *c = peer_connect(addr, &(kvx_why_t){why, why_len});
        if (!c)
            return KVX_ERR_PEER_GONE;
        rstream_t *r = calloc(1, sizeof(*r));
        if (!r || map_put(&rstreams, next_id, r)) {
            free(r);
            snprintf(why, why_len, "fetch: out of memory");
            return KVX_ERR_NOMEM;
        }
        r->id = next_id++;
        r->part = p;
        r->conn = peer_conn_id(c);
        r->slice = i;
        r->u_begin = r->next_unit = plan->slices[i].unit_begin;
        r->u_end = i + 1 < plan->nslices ? plan->slices[i + 1].unit_begin
                                         : plan->nunits;
        assert(rp->nstreams < rp->nslices);
        rp->streams[rp->nstreams++] = r;
        if (send_open(r)) {
            r->refused = 1; /* no OPEN out: no OPENED to wait for */
            snprintf(why, why_len, "fetch: cannot reach daemon %s", addr);
            return KVX_ERR_PEER_GONE;
        }
    }
    return 0;
}

/* End r on the wire and release what waits on it; the slots it holds go
 * back now (PULLED: a late DATA is dropped) or when the pieces landing in
 * them or being scattered from them are back (RECEIVING). */
static void rstream_stop(rstream_t *r, int code, const char *msg)
{
    if (r->ended)
        return;
    r->ended = 1;
    r->end_code = code;
    snprintf(r->end_msg, sizeof(r->end_msg), "%s", msg);
    rq_drop(r);
    peer_conn_t *c = r->opened ? conn_live(r->conn) : NULL;
    if (c)
        send_end(c, r->source, code, msg);
    for (uint32_t i = 0; i < remote_slots() && rslots.v; i++) {
        slot_t *x = &rslots.v[i];
        /* pulled, or some pieces in and none landing: nothing more will
         * be written into it (landing pieces free it when back) */
        if (x->owner == r &&
            (x->state == SLOT_PULLED || (x->state == SLOT_RECEIVING &&
                                         !x->landing && !x->pending)))
            slot_put(&rslots, x);
    }
}

void remote_part_stop(genpart_t *p, int code, const char *msg)
{
    const rpart_t *rp = xfer_part_remote(p);
    for (uint32_t i = 0; rp && i < rp->nstreams; i++)
        rstream_stop(rp->streams[i], code, msg);
    pull_schedule();
}

void remote_part_free(rpart_t *rp)
{
    assert(rp->nstreams <= rp->nslices);
    for (uint32_t i = 0; i < rp->nstreams; i++) {
        rstream_t *r = rp->streams[i];
        assert(r->part); /* only a stream of a freed part is an orphan */
        rstream_stop(r, KVX_ERR_STATE, "request ended");
        for (uint32_t k = 0; k < remote_slots() && rslots.v; k++)
            if (rslots.v[k].owner == r) /* a receive still landing */
                rslots.v[k].owner = NULL;
        if (r->retry_ms) { /* refused, waiting to ask again: no OPEN out */
            r->retry_ms = 0;
            retrying--;
            r->refused = 1;
        }
        if (!r->opened && !r->refused && conn_live(r->conn)) {
            /* its OPENED is on the way: kept as an orphan, so the source
             * hears END when it comes (on_opened) */
            r->part = NULL;
            continue;
        }
        map_del(&rstreams, r->id);
        free(r);
    }
    free(rp);
}

static void pull_schedule(void)
{
    uint64_t slot_bytes = kvxd.conf.slot_bytes;
    while (pullq.head && rslots.nfree) {
        rstream_t *r = RRQ_OWNER(rrq_pop(&pullq), rstream_t, turn);
        if (r->ended || r->next_unit >= r->u_end)
            continue;
        const plan_t *plan = xfer_part_plan(r->part);
        uint64_t u0 = r->next_unit, bytes;
        uint64_t u1 = plan_units_fit(plan, u0, r->u_end, slot_bytes, &bytes);
        if (u1 == u0) {
            char m[160];
            snprintf(m, sizeof(m),
                     "a plan unit of %llu bytes exceeds peer.slot_bytes "
                     "(%llu)",
                     (unsigned long long)plan_units_bytes(plan, u0, u0 + 1),
                     (unsigned long long)slot_bytes);
            xfer_part_fail(r->part, KVX_ERR_LIMIT, m);
            continue;
        }
        slot_t *x = slot_get(&rslots);
        x->state = SLOT_PULLED;
        x->owner = r;
        x->u0 = u0;
        x->u1 = u1;
        x->bytes = bytes;
        x->t_wait = now_ns();
        Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
        Kvxfer__PeerPull pl = KVXFER__PEER_PULL__INIT;
        pl.stream = r->source;
        pl.slot = x->idx;
        pl.unit_begin = u0;
        pl.unit_end = u1;
        m.m_case = KVXFER__PEER_MSG__M_PULL;
        m.pull = &pl;
        r->next_unit = u1;
        r->held++;
        if (send_on(r->conn, &m)) {
            slot_put(&rslots, x);
            assert(r->held > 0);
            r->held--;
            /* a lost connection ends the request from the loop's next
             * turn; a live one could not take the message (memory) */
            if (conn_live(r->conn))
                xfer_part_fail(r->part, KVX_ERR_NOMEM,
                               "out of memory sending a pull");
            continue;
        }
        if (r->next_unit < r->u_end)
            rq_push(r);
    }
}

/* D: the offer's aux came with an OPENED of r: kept for its request's
 * COMPLETE. 0, or 1 when the request failed instead (r may be gone). */
static int opened_aux(peer_conn_t *c, rstream_t *r, const Kvxfer__PeerOpened *o)
{
    char why[256];
    int rc = 0;
    if (o->aux.len > kvxd.conf.aux_bytes) {
        snprintf(why, sizeof(why),
                 "an aux payload of %zu bytes from daemon %s is more than "
                 "limits.aux_bytes (%u) here",
                 o->aux.len, peer_conn_address(c), kvxd.conf.aux_bytes);
        log_warn("%s", why);
        rc = KVX_ERR_LIMIT;
    } else if (o->aux.len) {
        rc = xfer_part_set_aux(r->part, o->aux.data, (uint32_t)o->aux.len,
                               KVX_WHY(why));
    }
    if (rc)
        xfer_part_fail(r->part, rc, why);
    return rc != 0;
}

static void on_opened(peer_conn_t *c, const Kvxfer__PeerOpened *o)
{
    rstream_t *r = map_get(&rstreams, o->stream);
    if (!r || r->conn != peer_conn_id(c))
        return;
    if (r->opened) { /* again, with the aux of a publish after the OPEN */
        if (r->source == o->source && r->part && !r->ended)
            opened_aux(c, r, o);
        return;
    }
    r->opened = 1;
    r->source = o->source;
    if (!r->part) { /* an orphan: its request is gone; say why */
        send_end(c, r->source, r->end_code ? r->end_code : KVX_ERR_STATE,
                 r->end_code ? r->end_msg : "request ended");
        map_del(&rstreams, r->id);
        free(r);
        return;
    }
    if (r->ended) { /* ended while opening: tell it why */
        int code = r->end_code ? r->end_code : xfer_part_end_code(r->part);
        send_end(c, r->source, code ? code : KVX_ERR_STATE,
                 r->end_code ? r->end_msg : "request ended");
        return;
    }
    if (opened_aux(c, r, o))
        return;
    rq_push(r);
    pull_schedule();
}

uint32_t remote_slots(void)
{
    uint32_t n = kvxd.conf.slots;
    if (!n) { /* auto: 32 MiB of slots in flight each way, at least 2 */
        uint64_t fit = (32ull << 20) / kvxd.conf.slot_bytes;
        n = fit < 2 ? 2 : (uint32_t)fit;
    }
    return n;
}

uint64_t remote_message_bytes(void)
{
    uint64_t m = kvxd.conf.message_bytes, slot = kvxd.conf.slot_bytes;
    if (m > slot)
        m = slot;
    if ((slot + m - 1) / m > MAX_PIECES)
        m = (slot + MAX_PIECES - 1) / MAX_PIECES;
    return m;
}

/* The places of a piece in the destination blocks, as
 * plan_runs_packed() gives them. */
typedef struct places {
    peer_iov_t *v;
    uint32_t n, cap;
} places_t;

static int place_add(void *arg, uint8_t *a, uint64_t len, uint32_t region)
{
    (void)region;
    places_t *w = arg;
    if (w->n == w->cap)
        return 1; /* runs too short: the slot and a scatter instead */
    w->v[w->n++] = (peer_iov_t){a, len};
    return 0;
}

/* The places of piece k of x in a host pool, in the order the piece
 * packs them: plan's destination runs (gather 0: received straight into
 * them) or its source runs (gather 1: sent straight from them). Their
 * count, or 0: runs shorter than DIRECT_MIN_RUN on average, or no
 * memory (the slot and a copy instead). They go in x->iov[k]. */
#define DIRECT_MIN_RUN 2048u
static uint32_t piece_places(slot_t *x, uint32_t k, const plan_t *plan,
                             int gather)
{
    places_t w = {.cap = (uint32_t)(x->pc[k].len / DIRECT_MIN_RUN + 1)};
    if (!(w.v = malloc(w.cap * sizeof(*w.v))))
        return 0;
    if (plan_runs_packed(plan, x->pc[k].u0, x->pc[k].u1, gather, place_add,
                         &w) ||
        !w.n) {
        free(w.v);
        return 0;
    }
    x->iov[k] = w.v;
    return w.n;
}

void *remote_data_target(peer_conn_t *c, const Kvxfer__PeerData *d, size_t len,
                         const peer_iov_t **iov, size_t *niov)
{
    rstream_t *r = map_get(&rstreams, d->stream);
    if (!r || r->conn != peer_conn_id(c) || r->ended ||
        d->slot >= remote_slots())
        return NULL;
    slot_t *x = &rslots.v[d->slot];
    /* piece_bytes 0: the whole slot in one message (a sender that does
     * not cut slots) */
    uint64_t pb = d->piece_bytes ? d->piece_bytes : d->bytes;
    const char *bad = NULL;
    int k = -1;
    if (x->owner != r || x->u0 != d->unit_begin || x->u1 != d->unit_end ||
        d->bytes != x->bytes ||
        (x->state != SLOT_PULLED && x->state != SLOT_RECEIVING))
        bad = "does not match its pull";
    else if (!pb || (x->state == SLOT_RECEIVING && pb != x->piece_bytes))
        bad = "is not a piece of its slot";
    if (!bad && x->state == SLOT_PULLED)
        slot_cut(x, xfer_part_plan(r->part), pb);
    if (!bad && ((k = piece_at(x, d->offset)) < 0 || len != x->pc[k].len))
        bad = "is not a piece of its slot";
    else if (!bad && (x->got & (1ull << k)))
        bad = "repeats a piece";
    if (bad) {
        if (x->owner == r && x->state == SLOT_PULLED)
            x->npieces = 0; /* the cut waits for a good first piece */
        log_warn("peer %s: data for stream %llu %s; dropped",
                 peer_conn_address(c), (unsigned long long)d->stream, bad);
        return NULL;
    }
    if (x->state == SLOT_PULLED) {
        x->t_stage = now_ns();
        st_rx.wait_ns += x->t_stage - x->t_wait;
        x->state = SLOT_RECEIVING;
    }
    x->got |= 1ull << k;
    x->landing++;
    /* only where the caller can take places (a lane: the unpack runs on
     * its thread, and its stall check bounds the fence), and a host pool */
    uint32_t n = iov && niov && direct_on && !xfer_part_pool(r->part)->gpu
                     ? piece_places(x, (uint32_t)k, xfer_part_plan(r->part), 0)
                     : 0;
    if (n) {
        /* the fence: the request does not end while UCX writes its
         * blocks (released through scatter_done(), or below) */
        x->part = r->part;
        xfer_part_fence_hold(r->part);
        x->direct |= 1ull << k;
        *iov = x->iov[k];
        *niov = n;
    }
    return x->mem + x->pc[k].off;
}

/* Piece k, received straight into the blocks or sent straight from them,
 * is back from UCX (done or failed): its places go. 1 if it was such a
 * piece. */
static int direct_in(slot_t *x, uint32_t k)
{
    if (!(x->direct & (1ull << k)))
        return 0;
    x->direct &= ~(1ull << k);
    free(x->iov[k]);
    x->iov[k] = NULL;
    return 1;
}

/* Receive slot x goes back once nothing lands in it and nothing reads it.
 * Returns whether it did. */
static int rslot_release(slot_t *x)
{
    if (x->landing || x->pending)
        return 0;
    rstream_t *r = x->owner;
    if (r) {
        assert(r->held > 0);
        r->held--;
    }
    slot_put(&rslots, x);
    return 1;
}

/* Piece k of receive slot x is scattered into the pool. */
static void scatter_done(slot_t *x, uint32_t k)
{
    rstream_t *r = x->owner;
    genpart_t *part = x->part;
    uint64_t units = x->pc[k].u1 - x->pc[k].u0, bytes = x->pc[k].len;
    int status = x->status;
    assert(x->pending > 0);
    x->pending--;
    x->copied++;
    int whole = x->copied == x->npieces;
    if (whole) {
        st_rx.copy_ns += now_ns() - x->t_stage;
        st_rx.slots++;
        st_rx.bytes += x->bytes;
    }
    if (r)
        r->units_done += units;
    if (whole || status || !r || r->ended) {
        /* the stream is complete: the source may let go (before the
         * progress below, which may free the request and r) */
        if (rslot_release(x) && whole && r && !status && !r->ended &&
            r->units_done == r->u_end - r->u_begin)
            rstream_stop(r, 0, "");
    }
    xfer_part_progress(part, units, bytes, status);
    pull_schedule();
}

void remote_on_data(peer_conn_t *c, const Kvxfer__PeerData *d, int status)
{
    (void)c;
    if (d->slot >= remote_slots())
        return;
    slot_t *x = &rslots.v[d->slot];
    int k = piece_at(x, d->offset);
    if (x->state != SLOT_RECEIVING || !x->landing || k < 0)
        return;
    x->landing--;
    rstream_t *r = x->owner;
    int direct = direct_in(x, (uint32_t)k);
    if (status || x->status || !r || r->ended) {
        int first = status && !x->status;
        if (first)
            x->status = status;
        genpart_t *p = r && !r->ended && first ? r->part : NULL;
        genpart_t *held = direct ? x->part : NULL;
        rslot_release(x);
        if (p)
            xfer_part_fail(p, status,
                           "receiving from the context daemon failed");
        if (held) /* its fence, held since remote_data_target() */
            xfer_part_progress(held, 0, 0, status);
        pull_schedule();
        return;
    }
    if (++x->arrived == x->npieces) {
        uint64_t t = now_ns();
        st_rx.wire_ns += t - x->t_stage;
        x->t_stage = t;
    }
    genpart_t *p = r->part;
    x->part = p;
    if (direct) { /* in its place already: counted as scattered */
        st_rx.direct++;
        x->pending++;
        scatter_done(x, (uint32_t)k);
        return;
    }
    /* the fence: xfer does not finalize the request before the scatter
     * of every piece is back */
    xfer_part_fence_hold(p);
    x->piece_done = scatter_done;
    /* a GPU pool: a kernel reads the piece; else the copy threads */
    piece_copy(x, (uint32_t)k, xfer_part_plan(p), xfer_part_gpu(p), 0);
}

/* ---- S: the context side ----------------------------------------------- */

/* s's slots gathered ahead are no longer held for a PULL: idle ones go
 * back now, one still gathering when its gather is back (the caller
 * frees s, or sslot_release() does, once nothing counts in it). */
static void ahead_release(sstream_t *s)
{
    for (uint32_t i = 0; i < s->nahead; i++) {
        slot_t *x = s->ahead[i];
        x->ahead = 0;
        if (!x->pending) {
            assert(s->sends > 0);
            s->sends--;
            slot_put(&sslots, x);
        }
    }
    s->nahead = 0;
}

static void sstream_free(sstream_t *s)
{
    map_del(&sstreams, s->id);
    gpu_part_free(s->gpu);
    plan_free(s->plan);
    free(s);
}

/* Detach s from its offer (ended); freed once its copies are back. */
static void sstream_end(sstream_t *s)
{
    if (s->ended)
        return;
    s->ended = 1;
    /* a stream not ended is on its offer's list */
    assert(s->offer && list_linked(&s->node));
    list_remove(&s->node);
    s->offer = NULL;
    /* pulls of s still queued go */
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &pulls)
    {
        pull_t *q = PULL(n);
        if (q->s != s)
            continue;
        list_remove(n);
        assert(s->queued > 0);
        s->queued--;
        free(q);
    }
    assert(s->queued == 0);
    ahead_release(s);
    if (!s->gathers && !s->sends)
        sstream_free(s);
}

static void open_refuse(peer_conn_t *c, uint64_t dst_id, int code,
                        const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void open_refuse(peer_conn_t *c, uint64_t dst_id, int code,
                        const char *fmt, ...)
{
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    send_end(c, dst_id, code, msg);
}

/* Does a token from a peer equal ours? In constant time. */
static int token_equal(const ProtobufCBinaryData *t, const uint8_t *ours)
{
    if (t->len != TOKEN_LEN)
        return 0;
    uint8_t d = 0; /* every byte, whatever differs first */
    for (size_t i = 0; i < TOKEN_LEN; i++)
        d |= t->data[i] ^ ours[i];
    return !d;
}

/* Streams that will read o: the slices, over every rank of the receiving
 * group and every block table of the request (gdst, gskip: each table's
 * receiving side and skip, ng of them), whose source rank is served here;
 * the daemons they come from (losing one of them ends o); and which
 * context ranks the consumer reads at all (roffer_t.rread, for
 * offer_done_notify()). */
static uint32_t streams_expected(offer_t *o, const plan_side_t *gdst,
                                 const uint32_t *gskip, uint32_t ng,
                                 const Kvxfer__PeerOpen *m)
{
    uint32_t n = 0, ranks = plan_side_ranks(&gdst[0]);
    const instance_t *inst = xfer_offer_instance(o);
    roffer_t *ro = xfer_offer_remote(o); /* made by on_open() */
    if (m->n_dst_addresses == ranks)
        ro->consumer_addrs = calloc(ranks, sizeof(char *));
    free(ro->rread);
    ro->rread = calloc(inst->nranks, 1);
    for (uint32_t t = 0; t < ranks * ng; t++) {
        uint32_t r = t % ranks, tb = t / ranks; /* rank, table */
        plan_t *p;
        char why[64];
        if (xfer_offer_plan(o, tb, &gdst[tb], r, gskip[tb], &p, KVX_WHY(why)))
            continue;
        uint32_t k = 0;
        for (uint32_t i = 0; i < p->nslices; i++) {
            k += inst->local[p->slices[i].src_rank];
            if (ro->rread)
                ro->rread[p->slices[i].src_rank] = 1;
        }
        plan_free(p);
        n += k;
        if (!k || !ro->consumer_addrs)
            continue;
        int seen = 0;
        for (uint32_t j = 0; j < ro->nconsumer_addrs && !seen; j++)
            seen = !strcmp(ro->consumer_addrs[j], m->dst_addresses[r]);
        if (!seen && (ro->consumer_addrs[ro->nconsumer_addrs] =
                          strdup(m->dst_addresses[r])))
            ro->nconsumer_addrs++;
    }
    return n;
}

/* S: did o wait for streams from the daemon at addr? */
static int offer_waits_for(const offer_t *o, const char *addr)
{
    const roffer_t *ro = RO(o);
    if (xfer_offer_ending(o) || !ro->streams_expect ||
        ro->streams_done >= ro->streams_expect)
        return 0;
    for (uint32_t j = 0; j < ro->nconsumer_addrs; j++)
        if (!strcmp(ro->consumer_addrs[j], addr))
            return 1;
    return 0;
}

/* S: OPENED for stream s, with the offer's aux when it has one; sent
 * again, with it, when a publish brings it later (before that publish's
 * data is gathered: remote_offer_published()). */
static void opened_send(peer_conn_t *c, sstream_t *s, const offer_t *o)
{
    uint32_t alen;
    const uint8_t *aux = xfer_offer_aux(o, &alen);
    Kvxfer__PeerMsg r = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerOpened op = KVXFER__PEER_OPENED__INIT;
    op.stream = s->dst_id;
    op.source = s->id;
    op.aux.data = (uint8_t *)aux;
    op.aux.len = alen;
    s->aux_sent = alen > 0;
    r.m_case = KVXFER__PEER_MSG__M_OPENED;
    r.opened = &op;
    peer_send(c, &r);
}

static void on_open(peer_conn_t *c, const Kvxfer__PeerOpen *m)
{
    if (!m->key.len || m->key.len > KVX_MAX_KEY ||
        m->consumer_key.len > KVX_MAX_KEY) {
        open_refuse(c, m->stream, KVX_ERR_INVALID,
                    "open: a key of %zu bytes (1 to %u)", m->key.len,
                    KVX_MAX_KEY);
        return;
    }
    char ks[REQKEY_STR_MAX];
    reqkey_str(m->key.data, m->key.len, ks);
    instance_t *inst = m->instance_id ? instance_find(m->instance_id) : NULL;
    offer_t *o = inst ? xfer_offer_find(inst, m->request_id) : NULL;
    const reqkey_t *ok = o ? xfer_offer_key(o) : NULL;
    if (ok && (ok->len != m->key.len || memcmp(ok->b, m->key.data, ok->len)))
        o = NULL; /* another key's, whose id collides: not this one */
    int gone =
        (!o || xfer_offer_ending(o) || xfer_offer_consumed(o)) && m->instance_id
            ? xfer_offer_gone(m->instance_id, m->request_id, m->key.data,
                              m->key.len)
            : 0;
    if (gone) { /* as a fetch that came before the cancel hears it */
        send_end_ex(c, m->stream, gone,
                    gone == KVX_ERR_CANCELLED ? "cancelled by the context side"
                                              : "released (kvx_release)",
                    1);
        return;
    }
    if ((!o || xfer_offer_ending(o)) && kvxd.draining) {
        /* the drain ended it (or ends it): say so, not "no offer" */
        send_end_ex(c, m->stream, KVX_ERR_SHUTDOWN,
                    "the context daemon is shutting down (drain): its offers "
                    "end",
                    1);
        return;
    }
    if (!o || xfer_offer_ending(o) || xfer_offer_consumed(o)) {
        /* every rank of the instance is ours: its offers are all here,
         * so this one ended (or never was) and asking again cannot help;
         * else a rank may not have published yet: the peer asks again */
        int final = inst && inst->joined && inst->addresses;
        for (uint32_t i = 0; final && i < inst->nranks; i++)
            final = inst->addresses[i] &&
                    !strcmp(inst->addresses[i], kvxd.address);
        char msg[800];
        snprintf(msg, sizeof(msg),
                 "no offer for request %s of instance '%s' on daemon %s "
                 "(%s)",
                 ks, m->instance_id ? m->instance_id : "", kvxd.address,
                 o       ? (xfer_offer_consumed(o) ? "consumed" : "ending")
                 : final ? "expired, cancelled or completed"
                         : "not yet published, expired, cancelled or "
                           "completed");
        send_end_ex(c, m->stream, KVX_ERR_NOT_FOUND, msg, final || o);
        return;
    }
    if (!token_equal(&m->token, xfer_offer_token(o))) {
        log_warn("peer %s: forged or stale capability token for offer "
                 "%s/%s",
                 peer_conn_address(c), inst->id, ks);
        open_refuse(c, m->stream, KVX_ERR_AUTH,
                    "capability token does not match the offer of request "
                    "%s",
                    ks);
        return;
    }
    if (xfer_offer_taken_here(o)) {
        open_refuse(c, m->stream, KVX_ERR_EXISTS,
                    "the offer of request %s is already taken on daemon %s", ks,
                    kvxd.address);
        return;
    }
    plan_side_t dst;
    char why[256];
    plan_t *plan;
    /* the request's block tables: the fetch gives a side for each */
    uint32_t ng = m->n_groups ? (uint32_t)m->n_groups : 1;
    plan_side_t gdst[XFER_MAX_GROUPS];
    uint32_t gskip[XFER_MAX_GROUPS];
    int rc =
        xfer_side_from_msg(m->dst_parallel, m->dst_layout, &dst, KVX_WHY(why));
    if (!rc && (ng != xfer_offer_ngroups(o) || m->group >= ng)) {
        snprintf(why, sizeof(why),
                 "open: the fetch reads block table %u of %u, the offer of "
                 "request %.64s has %u",
                 m->group, ng, ks, xfer_offer_ngroups(o));
        rc = KVX_ERR_MISMATCH;
    }
    for (uint32_t k = 0; !rc && k < ng; k++) {
        if (m->n_groups && (!m->groups[k]->parallel || !m->groups[k]->layout)) {
            snprintf(why, sizeof(why), "open: groups[%u] has no side", k);
            rc = KVX_ERR_INVALID;
        } else if (m->n_groups) {
            rc =
                xfer_side_from_msg(m->groups[k]->parallel, m->groups[k]->layout,
                                   &gdst[k], KVX_WHY(why));
            gskip[k] = m->groups[k]->skip_tokens;
        } else {
            gdst[0] = dst;
            gskip[0] = m->skip_tokens;
        }
    }
    /* the stream's own table must be the one the tables' list names, and
     * every table received by as many ranks: the count of streams below
     * is made from the list */
    for (uint32_t k = 0; !rc && k < ng; k++)
        if (plan_side_ranks(&gdst[k]) != plan_side_ranks(&dst) ||
            (k == m->group && (gskip[k] != m->skip_tokens ||
                               !plan_side_equal(&gdst[k], &dst)))) {
            snprintf(why, sizeof(why),
                     "open: block table %u's side in groups differs from "
                     "the stream's",
                     k);
            rc = KVX_ERR_MISMATCH;
        }
    if (!rc)
        rc =
            plan_compat(xfer_offer_group_side(o, m->group), &dst, KVX_WHY(why));
    if (!rc && m->dst_rank >= plan_side_ranks(&dst)) {
        snprintf(why, sizeof(why), "open: destination rank %u of %u",
                 m->dst_rank, plan_side_ranks(&dst));
        rc = KVX_ERR_INVALID;
    }
    if (!rc)
        rc = xfer_offer_plan(o, m->group, &dst, m->dst_rank, m->skip_tokens,
                             &plan, KVX_WHY(why));
    if (rc) {
        open_refuse(c, m->stream, rc, "%s", why);
        return;
    }
    if (plan->nunits != m->nunits || plan->bytes != m->bytes ||
        m->slice >= plan->nslices ||
        !inst->local[plan->slices[m->slice].src_rank]) {
        plan_free(plan);
        open_refuse(c, m->stream, KVX_ERR_MISMATCH,
                    "the plan on daemon %s differs (%llu units, %llu bytes) "
                    "or slice %u is not served there",
                    kvxd.address, (unsigned long long)m->nunits,
                    (unsigned long long)m->bytes, m->slice);
        return;
    }
    /* one consumer per offer: the generation request (instance and
     * id, the same from every daemon of a spread instance) */
    char who[256];
    xfer_consumer_t cw = {.inst =
                              m->consumer_instance ? m->consumer_instance : "",
                          .key = m->consumer_key.data,
                          .key_len = m->consumer_key.len};
    xfer_consumer_name(&cw, who, sizeof(who));
    roffer_t *ro = xfer_offer_remote(o);
    if (!ro) { /* the first OPEN: freed with o (remote_offer_free()) */
        if (!(ro = roffer_new())) {
            plan_free(plan);
            open_refuse(c, m->stream, KVX_ERR_NOMEM, "out of memory");
            return;
        }
        xfer_offer_set_remote(o, ro);
    }
    if (ro->rconsumer[0] && strcmp(ro->rconsumer, who)) {
        plan_free(plan);
        open_refuse(c, m->stream, KVX_ERR_EXISTS,
                    "the offer of request %s is already taken by %s", ks,
                    ro->rconsumer);
        return;
    }
    if (ro->streams_expect && ro->streams_opened >= ro->streams_expect) {
        plan_free(plan);
        open_refuse(c, m->stream, KVX_ERR_EXISTS,
                    "the offer of request %llu has all its %u streams",
                    (unsigned long long)m->request_id, ro->streams_expect);
        return;
    }
    if (!ro->streams_expect) {
        /* the streams of every table of every receiving rank; this one is
         * among them (its side and skip are its table's, checked above) */
        uint32_t n = streams_expected(o, gdst, gskip, ng, m);
        if (!n) {
            plan_free(plan);
            open_refuse(c, m->stream, KVX_ERR_MISMATCH,
                        "open: no stream of request %s is served by daemon "
                        "%s",
                        ks, kvxd.address);
            return;
        }
        ro->streams_expect = n;
        snprintf(ro->rconsumer, sizeof(ro->rconsumer), "%s", who);
        xfer_offer_taken(o);
    }
    sstream_t *s = calloc(1, sizeof(*s));
    if (!s || map_put(&sstreams, next_id, s)) {
        free(s);
        plan_free(plan);
        open_refuse(c, m->stream, KVX_ERR_NOMEM, "out of memory");
        return;
    }
    list_init(&s->node);
    s->id = next_id++;
    s->dst_id = m->stream;
    s->conn = peer_conn_id(c);
    s->offer = o;
    s->fence = o;
    s->plan = plan;
    s->slice = m->slice;
    s->group = m->group;
    s->src_rank = plan->slices[s->slice].src_rank;
    s->u_begin = plan->slices[s->slice].unit_begin;
    s->u_end = s->slice + 1 < plan->nslices
                   ? plan->slices[s->slice + 1].unit_begin
                   : plan->nunits;
    /* a PULL larger than our slots is refused anyway: no gather-ahead */
    s->pull_bytes = m->pull_bytes <= kvxd.conf.slot_bytes ? m->pull_bytes
                                                          : 0;
    s->ahead_at = s->u_begin;
    /* the row shape of the packed units; only these fields are read */
    memset(&s->dst_layout, 0, sizeof(s->dst_layout));
    s->dst_layout.kv_factor = dst.kv_factor;
    s->dst_layout.head_dim = dst.head_dim;
    s->dst_layout.elem_size = dst.elem_size;
    plan->dst.layout = &s->dst_layout;
    ro->streams_opened++;
    assert(ro->streams_opened <= ro->streams_expect);
    list_push(ro->streams.next, &s->node); /* first: newest first */
    opened_send(c, s, o);
}


/* Send slot x goes back once every piece is gathered and every piece
 * sent is back from UCX; gathered ahead, once its PULL has come and it
 * is sent, or once the stream has ended. */
static void sslot_release(slot_t *x)
{
    sstream_t *s = x->owner;
    if (x->pending || x->sends_left || (x->ahead && !s->ended))
        return;
    if (!x->status && x->pulled) {
        st_tx.wire_ns += now_ns() - x->t_stage;
        st_tx.slots++;
        st_tx.bytes += x->bytes;
    }
    assert(s->sends > 0);
    s->sends--;
    slot_put(&sslots, x);
    if (s->ended && !s->gathers && !s->sends)
        sstream_free(s);
    serve_pulls();
}

static void on_sent(void *arg, int status)
{
    (void)status; /* a failed send fails the connection, which ends s */
    slot_t *x = arg;
    x->sends_left--;
    sslot_release(x);
}

static void piece_gathered(slot_t *x);

/* A piece sent from its places in the pool is back from UCX (status: a
 * failed send fails the connection, which ends s): only now is it
 * gathered, and the offer's fence may let go of its memory. */
static void on_sent_direct(void *arg, int status)
{
    (void)status;
    struct piece_ref *ref = arg;
    slot_t *x = ref->x;
    direct_in(x, ref->k);
    x->sends_left--;
    piece_gathered(x); /* x->pending counted it: x stays till here */
}

/* Send piece k of x to the receiver's slot: from the slot, or, niov > 0,
 * from its places x->iov[k] in the pool (peer.direct; x->pending counts
 * the piece until UCX gives it back). */
static void piece_send(slot_t *x, uint32_t k, uint32_t niov)
{
    sstream_t *s = x->owner;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerData d = KVXFER__PEER_DATA__INIT;
    d.stream = s->dst_id;
    d.slot = x->dst_slot;
    d.unit_begin = x->u0;
    d.unit_end = x->u1;
    d.bytes = x->bytes;
    d.piece_bytes = x->piece_bytes;
    d.offset = x->pc[k].off;
    m.m_case = KVXFER__PEER_MSG__M_DATA;
    m.data = &d;
    /* counted before: a failure may call back at once; the caller keeps x
     * (x->pending still counts this piece, or sends_left another) */
    x->sends_left++;
    peer_conn_t *c = conn_live(s->conn);
    if (niov) {
        int rc = c ? peer_send_data(
                         c, &(peer_piece_t){&m, NULL, x->pc[k].len, x->iov[k],
                                            niov, on_sent_direct, &x->ref[k]})
                   : KVX_ERR_PEER_GONE;
        if (!rc)
            return;
        /* never called back: not sent. With the connection still up (no
         * memory) the stream ends with the error, as a failed gather */
        if (c && peer_conn_alive(c) && !x->status)
            x->status = rc;
        on_sent_direct(&x->ref[k], rc);
        return;
    }
    if (!c ||
        peer_send_data(c, &(peer_piece_t){&m, x->mem + d.offset, x->pc[k].len,
                                          NULL, 0, on_sent, x}))
        x->sends_left--; /* the connection is gone: never called back */
}

static void ahead_drop(sstream_t *s, slot_t *x);

/* Piece k of send slot x is gathered: it goes now, while the next ones
 * are still being gathered (peer.c keeps peer.send_window messages in
 * flight and queues the rest in order); gathered ahead, it waits for its
 * PULL (ahead_take()). */
static void gather_done(slot_t *x, uint32_t k)
{
    sstream_t *s = x->owner;
    if (!x->status && !s->ended) {
        if (x->pulled)
            piece_send(x, k, 0);
        else
            x->ready |= 1ull << k;
    }
    piece_gathered(x);
}

/* One piece of send slot x less to gather (or to send from its places):
 * after the last, the offer's memory is no longer read. */
static void piece_gathered(slot_t *x)
{
    sstream_t *s = x->owner;
    assert(x->pending > 0);
    if (--x->pending)
        return;
    /* every piece is gathered: the offer's memory is no longer read */
    offer_t *o = s->fence;
    assert(s->gathers > 0);
    s->gathers--;
    xfer_offer_fence_release(o);
    uint64_t t = now_ns();
    if (x->pulled)
        st_tx.copy_ns += t - x->t_stage;
    else
        x->gather_ns = t - x->t_stage; /* counted if its PULL comes */
    x->t_stage = t;
    if (x->status && !s->ended) {
        if (x->ahead)
            ahead_drop(s, x); /* not put back by sstream_end(): below */
        char e[128];
        snprintf(e, sizeof(e), "gather failed: %s", kvx_status_str(x->status));
        peer_conn_t *c = peer_conn_find(s->conn); /* lost: still named */
        if (c && peer_conn_alive(c))
            send_end(c, s->dst_id, x->status, e);
        sstream_end(s); /* s stays: x still counts in s->sends */
        if (!xfer_offer_ending(o)) {
            /* the offer ends with the error (not at its backstop lease):
             * the generation side's END back finds the stream ended */
            char m[128];
            snprintf(m, sizeof(m), "gathering for peer daemon %s failed",
                     c ? peer_conn_address(c) : "(gone)");
            xfer_offer_end(o, KVX_EVENT_ERROR, x->status, m); /* may free o */
            sslot_release(x);
            return;
        }
    }
    if (xfer_offer_fence_done(o))
        xfer_offer_fenced(o); /* may free o: not used below */
    sslot_release(x);
}

/* Bind s's plan to the published source (it stays until the offer ends,
 * which waits for our gathers); a GPU source gets its plan uploaded, once.
 * Slices of other ranks stay unbound: s gathers only its own. */
static int sstream_bind(sstream_t *s, offer_t *o)
{
    static const kvx_layout_t none;
    plan_t *pl = s->plan;
    plan_mem_t mem;
    pool_t *src = xfer_offer_source(o, s->group, s->src_rank, &mem);
    assert(src); /* serve_pulls() waits for its publish */
    if (s->gpu || (pl->src[s->slice].regions && !src->gpu))
        return 0;
    for (uint32_t i = 0; i < pl->nslices; i++)
        pl->src[i] = i == s->slice ? mem : (plan_mem_t){.layout = &none};
    char why[256];
    int rc;
    if ((rc = plan_check_bounds(pl, KVX_WHY(why)))) {
        pl->src[s->slice] = (plan_mem_t){.layout = &none};
        log_warn("peer stream %llu: %s", (unsigned long long)s->id, why);
        return rc;
    }
    if (!src->gpu)
        return 0;
    int dev = src->device;
    pl->dst = (plan_mem_t){.layout = &s->dst_layout};
    if ((rc = slots_pin(&sslots, dev, why, sizeof(why))) ||
        (rc = pool_device_view(src, dev, &pl->src[s->slice].regions,
                               KVX_WHY(why))) ||
        (rc = gpu_part_create(pl, dev, &s->gpu, KVX_WHY(why))))
        log_warn("peer stream %llu: %s", (unsigned long long)s->id, why);
    return rc;
}

/* ---- S: gather-ahead (peer.gather_ahead) ------------------------------- */

/* Take x off s's slots gathered ahead. */
static void ahead_drop(sstream_t *s, slot_t *x)
{
    x->ahead = 0;
    for (uint32_t i = 0; i < s->nahead; i++)
        if (s->ahead[i] == x) {
            s->ahead[i] = s->ahead[--s->nahead];
            return;
        }
}

/* Start the gather of x's pieces (x: owner, units and bytes set). A
 * pulled slot of a host pool sends pieces whose runs are long straight
 * from the pool (peer.direct, over lanes only, whose stall check bounds
 * how long the fence waits for UCX): "gathered" when UCX is done. */
static void slot_gather(sstream_t *s, slot_t *x)
{
    s->gathers++;
    s->sends++;
    xfer_offer_fence_hold(s->offer);
    x->t_stage = now_ns();
    slot_cut(x, s->plan, remote_message_bytes());
    x->piece_done = gather_done;
    peer_conn_t *c = conn_live(s->conn);
    int direct = direct_on && !s->gpu && x->pulled && c && peer_conn_lanes(c);
    x->pending++; /* x stays while sends fail at once */
    for (uint32_t k = 0; k < x->npieces; k++) {
        uint32_t n = direct ? piece_places(x, k, s->plan, 1) : 0;
        if (!n) {
            piece_copy(x, k, s->plan, s->gpu, 1);
            continue;
        }
        x->pending++;
        x->direct |= 1ull << k;
        st_tx.direct++;
        piece_send(x, k, n);
    }
    piece_gathered(x);
}

/* While no PULL waits for a slot and more than one is free, gather the
 * units s's next PULLs will ask for: from ahead_at, as many as fit in
 * the receiver's slot (pull_schedule()'s cut), up to peer.gather_ahead
 * slots. s is bound (a PULL of it was served). */
static void ahead_fill(sstream_t *s)
{
    offer_t *o = s->offer;
    while (s->nahead < kvxd.conf.gather_ahead && s->pull_bytes &&
           !s->ahead_off && !s->ended && o && !xfer_offer_ending(o) &&
           list_empty(&pulls) && sslots.nfree > 1 && s->ahead_at < s->u_end) {
        uint64_t u0 = s->ahead_at, bytes;
        uint64_t u1 = plan_units_fit(s->plan, u0, s->u_end, s->pull_bytes,
                                     &bytes);
        if (u1 == u0)
            return; /* a unit larger than its slot: the PULL fails it */
        slot_t *x = slot_get(&sslots);
        x->owner = s;
        x->u0 = u0;
        x->u1 = u1;
        x->bytes = bytes;
        x->ahead = 1;
        s->ahead[s->nahead++] = x;
        s->ahead_at = u1;
        slot_gather(s, x);
    }
}

/* A PULL of s for [u0, u1) into the receiver's slot: if those units are
 * gathered ahead (or being gathered), they go now and 1 is returned. A
 * PULL for anything else turns gather-ahead off for s (its slots go). */
static int ahead_take(sstream_t *s, uint32_t slot, uint64_t u0, uint64_t u1)
{
    if (u1 > s->ahead_at)
        s->ahead_at = u1;
    for (uint32_t i = 0; i < s->nahead; i++) {
        slot_t *x = s->ahead[i];
        if (x->u0 != u0 || x->u1 != u1)
            continue;
        ahead_drop(s, x);
        st_tx.ahead++;
        x->pulled = 1;
        x->dst_slot = slot;
        if (!x->pending) { /* all gathered: the wire starts now */
            st_tx.copy_ns += x->gather_ns;
            x->t_stage = now_ns();
        }
        x->pending++; /* a send failing at once must not release x */
        for (uint32_t k = 0; k < x->npieces; k++)
            if (x->ready & (1ull << k))
                piece_send(x, k, 0);
        x->ready = 0;
        assert(x->pending > 0);
        x->pending--;
        sslot_release(x); /* when every send failed at once */
        return 1;
    }
    if (s->nahead) {
        /* the receiver cuts differently (another slot size): stop */
        s->ahead_off = 1;
        ahead_release(s);
    }
    return 0;
}

/* Start queued pulls whose source is published, while send slots last;
 * then let the streams served gather ahead. A slot that goes back while
 * it runs (a send failing at once) calls it again: that call is made
 * after this one, not inside it, which walks the pulls. */
static void serve_pulls_once(void);
static void serve_pulls(void)
{
    static int serving, again;
    if (serving) {
        again = 1;
        return;
    }
    serving = 1;
    do {
        again = 0;
        serve_pulls_once();
    } while (again);
    serving = 0;
}

static void serve_pulls_once(void)
{
    sstream_t *served[16];
    uint32_t nserved = 0;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &pulls)
    {
        if (!sslots.nfree)
            break;
        pull_t *q = PULL(n);
        sstream_t *s = q->s;
        offer_t *o = s->offer;
        if (o && !xfer_offer_source(o, s->group, s->src_rank, NULL) &&
            !xfer_offer_ending(o))
            continue; /* its rank has not published yet */
        assert(s->queued > 0);
        s->queued--;
        list_remove(n);
        if (!o || xfer_offer_ending(o)) {
            free(q);
            continue;
        }
        slot_t *x = slot_get(&sslots);
        x->owner = s;
        x->u0 = q->u0;
        x->u1 = q->u1;
        x->bytes = plan_units_bytes(s->plan, q->u0, q->u1);
        int rc = sstream_bind(s, o);
        if (rc) {
            slot_put(&sslots, x);
            free(q);
            peer_conn_t *sc = conn_live(s->conn);
            uint64_t dst = s->dst_id;
            sstream_end(s); /* may free s */
            if (sc)
                send_end(sc, dst, rc,
                         "the context daemon cannot bind its "
                         "source (its log says why)");
            offer_fail_t *f = calloc(1, sizeof(*f));
            if (f) { /* ended from remote_tick() */
                snprintf(f->instance, sizeof(f->instance), "%s",
                         xfer_offer_instance(o)->id);
                f->request_id = xfer_offer_request(o);
                f->code = rc;
                list_push(&ofails, &f->node);
            } else { /* out of memory: now, and nothing more this turn */
                xfer_offer_end(o, KVX_EVENT_ERROR, rc,
                               "binding the source for a peer failed");
            }
            return; /* lists changed: the next pull or tick goes on */
        }
        x->dst_slot = q->slot;
        x->pulled = 1;
        /* each piece is gathered on its own (a GPU pool: a kernel writes
         * it; else the copy threads) and sent as soon as it is */
        slot_gather(s, x);
        st_tx.wait_ns += x->t_stage - q->t_arrived;
        free(q);
        if (kvxd.conf.gather_ahead && nserved < 16 &&
            (!nserved || served[nserved - 1] != s))
            served[nserved++] = s;
    }
    for (uint32_t i = 0; i < nserved; i++)
        ahead_fill(served[i]);
}

static void on_pull(peer_conn_t *c, const Kvxfer__PeerPull *m)
{
    sstream_t *s = map_get(&sstreams, m->stream);
    if (!s || s->conn != peer_conn_id(c) || s->ended)
        return; /* ended: the END crossed this pull */
    if (m->unit_begin < s->u_begin || m->unit_end > s->u_end ||
        m->unit_begin >= m->unit_end ||
        plan_units_bytes(s->plan, m->unit_begin, m->unit_end) >
            kvxd.conf.slot_bytes) {
        offer_t *o = s->offer;
        uint64_t dst = s->dst_id;
        sstream_end(s);
        send_end(c, dst, KVX_ERR_INVALID,
                 "pull outside the stream or larger than peer.slot_bytes "
                 "of the context daemon");
        if (o)
            xfer_offer_end(o, KVX_EVENT_ERROR, KVX_ERR_PROTOCOL,
                           "a generation daemon sent a bad pull");
        return;
    }
    if (ahead_take(s, m->slot, m->unit_begin, m->unit_end)) {
        ahead_fill(s);
        return;
    }
    if (s->queued >= PULLS_QUEUED_MAX) {
        offer_t *o = s->offer;
        uint64_t dst = s->dst_id;
        sstream_end(s);
        send_end(c, dst, KVX_ERR_LIMIT, "more pulls waiting than any "
                                        "daemon has slots");
        if (o)
            xfer_offer_end(o, KVX_EVENT_ERROR, KVX_ERR_PROTOCOL,
                           "a generation daemon sent too many pulls");
        return;
    }
    pull_t *q = calloc(1, sizeof(*q));
    if (!q)
        return;
    s->queued++;
    q->slot = m->slot;
    q->u0 = m->unit_begin;
    q->u1 = m->unit_end;
    q->t_arrived = now_ns();
    q->s = s;
    list_push(&pulls, &q->node);
    serve_pulls();
}

void remote_offer_published(offer_t *o)
{
    uint32_t alen;
    xfer_offer_aux(o, &alen);
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &RO(o)->streams)
    {
        sstream_t *s = LIST_OWNER(n, sstream_t, node);
        peer_conn_t *c = alen && !s->aux_sent ? conn_live(s->conn) : NULL;
        if (c) /* the aux came after the OPEN */
            opened_send(c, s, o);
    }
    if (!list_empty(&done_notes) && done_notes_apply(o))
        return; /* o may have ended: not used below */
    if (!list_empty(&RO(o)->streams))
        serve_pulls();
}

void remote_offer_stop(offer_t *o, int code, const char *msg)
{
    while (!list_empty(&RO(o)->streams)) {
        sstream_t *s = LIST_OWNER(list_first(&RO(o)->streams), sstream_t, node);
        peer_conn_t *c = conn_live(s->conn);
        uint64_t dst = s->dst_id;
        /* its gathers still hold the offer's fence */
        sstream_end(s); /* may free s */
        if (c)
            send_end(c, dst, code, msg);
    }
}

/* ---- S: context daemons whose ranks the consumer does not read -------- */


/* o is read to the end by its consumer: tell each daemon of the context
 * instance none of whose ranks the consumer reads (replicated heads read
 * from other replicas) that its part is complete too, or its offer would
 * wait for a stream that never comes and end TIMED_OUT. */
static void offer_done_notify(offer_t *o)
{
    instance_t *inst = xfer_offer_instance(o);
    const uint8_t *read = RO(o)->rread; /* from the first OPEN's plans */
    if (inst->nlocal == inst->nranks || !peer_enabled() || !read)
        return;
    for (uint32_t r = 0; r < inst->nranks; r++) {
        const char *addr = inst->addresses[r];
        int any = 0, first = 1;
        for (uint32_t q = 0; q < inst->nranks; q++)
            if (!strcmp(inst->addresses[q], addr)) {
                any |= read[q];
                if (q < r)
                    first = 0; /* that daemon is told once */
            }
        if (any || !first || inst->local[r])
            continue;
        char why[256];
        peer_conn_t *c = peer_connect(addr, KVX_WHY(why));
        if (!c)
            continue;
        Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
        Kvxfer__PeerOfferDone d = KVXFER__PEER_OFFER_DONE__INIT;
        d.instance_id = inst->id;
        d.request_id = xfer_offer_request(o);
        d.token.data = (uint8_t *)xfer_offer_token(o);
        d.token.len = TOKEN_LEN;
        m.m_case = KVXFER__PEER_MSG__M_OFFER_DONE;
        m.offer_done = &d;
        peer_send(c, &m);
    }
}

/* The part of offer o on this daemon is complete: none of its ranks is
 * read. Only an offer no stream took. */
static void offer_done_apply(offer_t *o)
{
    if (RO(o)->streams_expect)
        return;
    xfer_offer_remote_done(o, 1, 0, ""); /* a no-op if it is ending */
}

static void on_offer_done(peer_conn_t *c, const Kvxfer__PeerOfferDone *d)
{
    instance_t *inst = d->instance_id ? instance_find(d->instance_id) : NULL;
    if (!inst || !inst->joined)
        return;
    /* from a daemon of the instance, with the offer's token */
    int member = 0;
    for (uint32_t r = 0; r < inst->nranks; r++)
        member |= !strcmp(inst->addresses[r], peer_conn_address(c));
    if (!member)
        return;
    uint8_t tok[TOKEN_LEN];
    peer_token(inst->id, inst->owner_uid, inst->addresses[0], d->request_id,
               tok);
    if (!token_equal(&d->token, tok))
        return;
    offer_t *o = xfer_offer_find(inst, d->request_id);
    if (o) {
        offer_done_apply(o);
        return;
    }
    if (ndone_notes >= DONE_NOTES_MAX)
        return;
    for (list_t *x = done_notes.next; x != &done_notes; x = x->next)
        if (DONE_NOTE(x)->request_id == d->request_id &&
            !strcmp(DONE_NOTE(x)->instance, inst->id))
            return; /* every daemon read tells us: one note */
    done_note_t *n = calloc(1, sizeof(*n));
    if (!n)
        return;
    snprintf(n->instance, sizeof(n->instance), "%s", inst->id);
    n->request_id = d->request_id;
    n->until_ms = kvxd_now_ms() + kvxd.conf.offer_lease_ms;
    list_push(&done_notes, &n->node);
    ndone_notes++;
}

/* A publish: an offer-done that came first applies now (1). */
static int done_notes_apply(offer_t *o)
{
    list_t *x, *t;
    LIST_FOREACH_SAFE(x, t, &done_notes)
    {
        done_note_t *n = DONE_NOTE(x);
        if (n->request_id == xfer_offer_request(o) &&
            !strcmp(n->instance, xfer_offer_instance(o)->id)) {
            list_remove(x);
            free(n);
            ndone_notes--;
            offer_done_apply(o);
            return 1;
        }
    }
    return 0;
}

static void done_notes_tick(uint64_t now)
{
    list_t *x, *t;
    LIST_FOREACH_SAFE(x, t, &done_notes)
    {
        if (now < DONE_NOTE(x)->until_ms)
            continue;
        list_remove(x);
        free(DONE_NOTE(x));
        ndone_notes--;
    }
}

/* ---- either side ------------------------------------------------------- */

/* Whether a piece of s cannot have reached the receiver yet: still being
 * copied into a send slot, or sent from its places but still queued in
 * peer.c (its send window full). Pieces sent from their places count as
 * gathered only once UCX gives them back, and that may come after the
 * receiver's END (the rendezvous is done on its side first): those UCX
 * has do not count here. */
static int stream_unsent(const sstream_t *s, const peer_conn_t *c)
{
    if (!s->gathers)
        return 0;
    for (uint32_t i = 0; i < remote_slots(); i++) {
        const slot_t *x = &sslots.v[i];
        if (x->owner != s || x->state == SLOT_FREE)
            continue;
        if (x->pending > (uint32_t)__builtin_popcountll(x->direct))
            return 1;
        for (uint32_t k = 0; k < x->npieces; k++)
            if ((x->direct >> k & 1) && peer_send_queued(c, &x->ref[k]))
                return 1;
    }
    return 0;
}

static void on_end(peer_conn_t *c, const Kvxfer__PeerStreamEnd *e)
{
    /* to S: the generation side is done with stream e->stream */
    sstream_t *s = map_get(&sstreams, e->stream);
    if (s && s->conn == peer_conn_id(c) && !s->ended) {
        offer_t *o = s->offer;
        /* every unit is gathered before it is sent, so a receiver that
         * has them all finds no copy of the stream left: one that says
         * done earlier is wrong, and the offer ends with an error (its
         * fence still waits for those gathers, and for UCX's sends from
         * the pool) */
        int early = e->code == 0 && stream_unsent(s, c);
        sstream_end(s);
        if (!o) {
            serve_pulls(); /* its slots gathered ahead are free */
            return;
        }
        if (early) {
            char m[300];
            snprintf(m, sizeof(m),
                     "peer daemon %s ended stream %llu as "
                     "done before all of it was sent",
                     peer_conn_address(c), (unsigned long long)e->stream);
            log_warn("%s", m);
            xfer_offer_remote_done(o, 0, KVX_ERR_PROTOCOL, m);
        } else if (e->code == 0) {
            roffer_t *ro = xfer_offer_remote(o); /* a stream of o: made */
            assert(ro->streams_done < ro->streams_opened);
            if (++ro->streams_done == ro->streams_expect) {
                offer_done_notify(o);
                xfer_offer_remote_done(o, 1, 0, "");
            }
        } else {
            char m[300];
            snprintf(m, sizeof(m), "generation side: %s",
                     e->message ? e->message : "");
            xfer_offer_remote_done(o, 0, e->code, m);
        }
        serve_pulls(); /* its slots gathered ahead are free */
        return;
    }
}

static void on_end_to_d(peer_conn_t *c, const Kvxfer__PeerStreamEnd *e)
{
    rstream_t *r = map_get(&rstreams, e->stream);
    if (!r || r->conn != peer_conn_id(c))
        return;
    if (!r->part) { /* an orphan refused: nothing left of it */
        map_del(&rstreams, r->id);
        free(r);
        return;
    }
    if (r->ended)
        return;
    uint64_t now = kvxd_now_ms();
    if (!r->opened)
        r->refused = 1;
    if (e->code == KVX_ERR_NOT_FOUND && !r->opened && !e->final) {
        /* a context rank on that daemon may not have published yet (an
         * instance spread over daemons, a reservation): ask again, until
         * the fetch's deadline */
        if (!r->retry_until_ms)
            r->retry_until_ms = now + kvxd.conf.fetch_timeout_ms;
        if (now < r->retry_until_ms) {
            r->refused = 0;
            if (!r->retry_ms)
                retrying++;
            uint64_t wait = (uint64_t)OPEN_RETRY_FIRST_MS
                            << (r->retries < 4 ? r->retries : 4);
            r->retries++;
            r->retry_ms =
                now + (wait < OPEN_RETRY_MAX_MS ? wait : OPEN_RETRY_MAX_MS);
            return;
        }
    }
    char m[300];
    snprintf(m, sizeof(m), "context side: %s", e->message ? e->message : "");
    xfer_part_fail(r->part, e->code ? e->code : KVX_ERR_STATE, m);
}

void remote_on_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    switch (m->m_case) {
    case KVXFER__PEER_MSG__M_OPEN:
        on_open(c, m->open);
        break;
    case KVXFER__PEER_MSG__M_OPENED:
        on_opened(c, m->opened);
        break;
    case KVXFER__PEER_MSG__M_PULL:
        on_pull(c, m->pull);
        break;
    case KVXFER__PEER_MSG__M_OFFER_DONE:
        on_offer_done(c, m->offer_done);
        break;
    case KVXFER__PEER_MSG__M_END:
        /* the direction tells which side it is for: streams a daemon
         * opened are rstreams; END from their source names our id */
        if (m->end->stream && map_get(&rstreams, m->end->stream) &&
            ((rstream_t *)map_get(&rstreams, m->end->stream))->conn ==
                peer_conn_id(c))
            on_end_to_d(c, m->end);
        else
            on_end(c, m->end);
        break;
    default: /* kinds agree.c registered go there */
        break;
    }
}

/* A request, by its stable names: ending one request can free others'
 * streams, so the streams are read first and the requests ended after. */
typedef struct req_ref {
    instance_t *inst; /* instances are freed only by instance_tick() */
    uint64_t id;
} req_ref_t;

int remote_on_conn_lost(peer_conn_t *c, int code, const char *msg)
{
    uint32_t n = rstreams.n + sstreams.n, k = 0;
    void **v = calloc(n ? n : 1, sizeof(*v));
    req_ref_t *fetches = calloc(n ? n : 1, sizeof(*fetches));
    req_ref_t *offers = calloc(n ? n : 1, sizeof(*offers));
    uint32_t nf = 0, no = 0;
    if (!v || !fetches || !offers) { /* nothing done: asked again */
        log_error("remote: out of memory ending the transfers with %s",
                  peer_conn_address(c));
        free(v);
        free(fetches);
        free(offers);
        return KVX_ERR_NOMEM;
    }
    /* D: nothing more goes to c; orphans on it go now */
    k = map_values(&rstreams, v, rstreams.n);
    for (uint32_t i = 0; i < k; i++) {
        rstream_t *r = v[i];
        if (r->conn != peer_conn_id(c))
            continue;
        r->opened = 0;
        r->refused = 1;
        if (!r->part) {
            map_del(&rstreams, r->id);
            free(r);
        } else if (!r->ended) {
            xfer_part_desc_t d;
            xfer_part_describe(r->part, &d);
            fetches[nf++] = (req_ref_t){d.inst, d.request_id};
        }
    }
    /* S: the streams on c end here (no END can reach it) */
    k = map_values(&sstreams, v, sstreams.n);
    for (uint32_t i = 0; i < k; i++) {
        sstream_t *s = v[i];
        if (s->conn != peer_conn_id(c) || s->ended || !s->offer)
            continue;
        offers[no++] = (req_ref_t){xfer_offer_instance(s->offer),
                                   xfer_offer_request(s->offer)};
        sstream_end(s); /* may free s */
    }
    for (uint32_t i = 0; i < nf; i++)
        xfer_fetch_fail(fetches[i].inst, fetches[i].id,
                        code == KVX_ERR_AUTH ? KVX_ERR_AUTH : KVX_ERR_PEER_GONE,
                        msg);
    for (uint32_t i = 0; i < no; i++) {
        offer_t *o = xfer_offer_find(offers[i].inst, offers[i].id);
        if (o)
            xfer_offer_remote_done(o, 0, KVX_ERR_PEER_GONE, msg);
    }
    free(v);
    free(fetches);
    free(offers);
    /* S: offers still waiting for streams from that daemon */
    for (instance_t *i = instance_first(); i; i = instance_next(i)) {
        uint32_t nids = i->offers.n;
        uint64_t *ids = calloc(nids ? nids : 1, sizeof(*ids));
        nids = ids ? map_keys(&i->offers, ids, nids) : 0;
        for (uint32_t j = 0; j < nids; j++) {
            offer_t *o = xfer_offer_find(i, ids[j]);
            if (o && offer_waits_for(o, peer_conn_address(c)))
                xfer_offer_remote_done(o, 0, KVX_ERR_PEER_GONE, msg);
        }
        free(ids);
    }
    return 0;
}

void remote_tick(uint64_t now)
{
    if (!peer_enabled())
        return;
    done_notes_tick(now);
    while (!list_empty(&ofails)) { /* sources serve_pulls() could not bind */
        offer_fail_t *f = LIST_OWNER(ofails.next, offer_fail_t, node);
        list_remove(&f->node);
        instance_t *inst = instance_find(f->instance);
        offer_t *o = inst ? xfer_offer_find(inst, f->request_id) : NULL;
        if (o)
            xfer_offer_end(o, KVX_EVENT_ERROR, f->code,
                           "binding the source for a peer failed");
        free(f);
    }
    if (!list_empty(&pulls) && sslots.nfree)
        serve_pulls(); /* slots put back where no PULL was served */
    uint32_t n = rstreams.n;
    if (!n || !retrying)
        return;
    /* by id: ending one request (out of memory below) frees its other
     * streams, which may come later in this list */
    void **v = calloc(n, sizeof(*v));
    uint64_t *ids = calloc(n, sizeof(*ids));
    if (!v || !ids) {
        free(v);
        free(ids);
        return;
    }
    n = map_values(&rstreams, v, n);
    for (uint32_t i = 0; i < n; i++)
        ids[i] = ((rstream_t *)v[i])->id;
    free(v);
    for (uint32_t i = 0; i < n; i++) {
        rstream_t *r = map_get(&rstreams, ids[i]);
        if (r && r->retry_ms && now >= r->retry_ms) {
            r->retry_ms = 0;
            retrying--;
            if (r->ended || !r->part || send_open(r)) {
                r->refused = 1; /* no OPEN out: no OPENED to wait for */
                if (!r->ended && r->part && conn_live(r->conn))
                    xfer_part_fail(r->part, KVX_ERR_NOMEM,
                                   "out of memory sending an OPEN");
            }
        }
    }
    free(ids);
}

uint32_t remote_conn_streams(const peer_conn_t *c)
{
    uint32_t n = 0, k;
    void **v = calloc(rstreams.n + sstreams.n + 1, sizeof(*v));
    if (!v)
        return 0;
    k = map_values(&rstreams, v, rstreams.n);
    for (uint32_t i = 0; i < k; i++)
        n += ((rstream_t *)v[i])->conn == peer_conn_id(c) &&
             !((rstream_t *)v[i])->ended;
    k = map_values(&sstreams, v, sstreams.n);
    for (uint32_t i = 0; i < k; i++)
        n += ((sstream_t *)v[i])->conn == peer_conn_id(c) &&
             !((sstream_t *)v[i])->ended;
    free(v);
    return n;
}

void remote_ucx_info(Kvxfer__UcxInfo *info)
{
    int on = peer_enabled();
    info->slots = on ? remote_slots() : 0;
    info->message_bytes = on ? remote_message_bytes() : 0;
    static Kvxfer__SlotTimes rx, tx;
    kvxfer__slot_times__init(&rx);
    kvxfer__slot_times__init(&tx);
    if (on)
        remote_slot_times(&rx, &tx);
    info->received = &rx;
    info->sent = &tx;
}
