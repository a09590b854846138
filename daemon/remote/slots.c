/*
 * slots — the staging slots of remote (remote_int.h): registered with
 * UCX once, cut into pieces on unit boundaries, each piece gathered or
 * scattered by the copy threads or a kernel; and the control messages
 * both sides send on a stream's connection.
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "remote_int.h"

slots_t rslots, sslots;
/* peer.direct, resolved: receive long-run pieces into host pools. On
 * the 2-CPU VM that moved 13-24 % more (a copy fewer where copies are
 * what is short); on the 16-CPU H200 host 25-40 % less (the unpack runs
 * on the lanes' 2 threads, the scatter on 16 copy threads). */
int direct_on;
uint64_t next_id = 1; /* of streams, either side */
slot_times_t st_rx, st_tx;

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
    slots_t *sets[2] = {&rslots, &sslots};
    for (int i = 0; i < 2; i++) {
        to[i]->free_slots = sets[i]->nfree;
        for (int d = 0; d < SLOT_DEVS; d++) {
            const slots_t *g = sets[i]->gpu[d];
            if (g) {
                to[i]->free_slots += g->nfree;
                to[i]->gpu_slots += g->n;
                to[i]->gpu_bytes += g->bytes;
            }
        }
    }
}

/* ---- slots ------------------------------------------------------------- */

/* v: n slots over mem, their indices from base */
static int set_slots(slots_t *s, uint32_t n, kvx_why_t *why)
{
    s->v = calloc(n, sizeof(*s->v));
    if (!s->v)
        return why_fail(why, KVX_ERR_NOMEM, "out of memory");
    s->n = n;
    for (uint32_t i = 0; i < n; i++) {
        s->v[i].mem = s->mem + (size_t)i * kvxd.conf.slot_bytes;
        s->v[i].idx = s->base + i;
        s->v[i].set = s;
        s->v[i].st = s->st;
        for (uint32_t k = 0; k < MAX_PIECES; k++)
            s->v[i].ref[k] = (struct piece_ref){&s->v[i], k};
        list_push(&s->free, &s->v[i].free_node);
    }
    s->nfree = n;
    return 0;
}

int slots_init(slots_t *s, const char *what, slot_times_t *st, kvx_why_t *why)
{
    uint32_t n = remote_slots();
    memset(s, 0, sizeof(*s));
    list_init(&s->free);
    s->device = -1;
    s->st = st;
    s->len = (size_t)n * kvxd.conf.slot_bytes;
    if (kvxd_mem_charge(MEM_STAGING, s->len)) {
        why_set(why,
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
        why_set(why,
                "peer.slots: cannot map %zu bytes of %s "
                "slots",
                s->len, what);
        return KVX_ERR_NOMEM;
    }
    int rc = set_slots(s, n, why);
    if (rc)
        return rc;
    /* registered once, so rendezvous never registers per message: with
     * the loop's UCX context, which the lanes share on one rail; with
     * several rails (peer.rails) each rail's context registers the slots
     * on its first use, in its registration cache (not measured) */
    s->memh = peer_mem_map(s->mem, s->len, 0);
    return 0;
}

/* GPU pools: kernels read and write the slots (pinned, mapped). */
static int slots_pin(slots_t *s, int device, kvx_why_t *why)
{
    if (s->pinned)
        return 0;
    if (gpu_host_register(s->mem, s->len, device)) {
        why_set(why,
                "cannot pin the %zu-byte staging slots for "
                "the GPU",
                s->len);
        return KVX_ERR_IO;
    }
    s->pinned = 1;
    return 0;
}

static void set_free(slots_t *s)
{
    /* places of pieces UCX never gave back (a shutdown drops the lanes'
     * events) */
    for (uint32_t i = 0; s->v && i < s->n; i++)
        for (uint32_t k = 0; k < MAX_PIECES; k++)
            free(s->v[i].iov[k]);
    peer_mem_unmap(s->memh);
    free(s->v);
}

/* Device d's set in s (the host set): its slots in d's memory,
 * registered with UCX as CUDA memory. 0, or an error with why (then
 * the host set serves d). */
static int gpu_set(slots_t *s, int d, kvx_why_t *why)
{
    uint64_t sb = kvxd.conf.slot_bytes;
    /* gpu.staging_bytes is the device's, for both directions */
    uint64_t n = kvxd.conf.gpu_staging_bytes / 2 / sb;
    if (n > SLOT_GPU_BASE)
        n = SLOT_GPU_BASE;
    if (n < 2)
        return why_fail(why, KVX_ERR_LIMIT,
                        "gpu.staging_bytes %llu holds fewer than 2 slots "
                        "of peer.slot_bytes %llu each way",
                        (unsigned long long)kvxd.conf.gpu_staging_bytes,
                        (unsigned long long)sb);
    slots_t *g = calloc(1, sizeof(*g));
    if (!g)
        return why_fail(why, KVX_ERR_NOMEM, "out of memory");
    list_init(&g->free);
    g->device = d;
    g->st = s->st;
    g->base = (uint32_t)(d + 1) * SLOT_GPU_BASE;
    g->len = (size_t)n * sb;
    void *mem;
    int rc = gpu_mem_alloc(d, g->len, &mem, why);
    if (!rc) {
        g->mem = mem;
        rc = set_slots(g, (uint32_t)n, why);
    }
    if (!rc && !(g->memh = peer_mem_map(g->mem, g->len, 1)))
        rc = why_fail(why, KVX_ERR_IO,
                      "UCX cannot register %zu bytes of GPU %d's memory",
                      g->len, d);
    if (rc) {
        set_free(g);
        gpu_mem_free(g->mem);
        free(g);
        return rc;
    }
    s->gpu[d] = g;
    return 0;
}

int slots_device(slots_t *s, int device, kvx_why_t *why)
{
    /* the host set serves too: a slot taken before the device's set was
     * made, and every device the GPU sets cannot */
    int rc = slots_pin(s, device, why);
    if (rc || device < 0 || device >= SLOT_DEVS || s->gpu_tried[device])
        return rc;
    s->gpu_tried[device] = 1;
    char m[256];
    if (!peer_cuda())
        log_info("peers: GPU %d's slots are in host memory: this UCX does "
                 "not move CUDA memory",
                 device);
    else if (!kvxd.conf.gpu_staging_bytes)
        log_info("peers: GPU %d's slots are in host memory "
                 "(gpu.staging_bytes 0)",
                 device);
    else if (gpu_set(s, device, KVX_WHY(m)))
        log_warn("peers: GPU %d's slots stay in host memory: %s", device, m);
    else
        log_info("peers: %u %s slots of %llu bytes in GPU %d's memory, "
                 "registered with UCX",
                 s->gpu[device]->n, s == &rslots ? "receive" : "send",
                 (unsigned long long)kvxd.conf.slot_bytes, device);
    return 0;
}

slots_t *slots_for(slots_t *s, int device)
{
    return device >= 0 && device < SLOT_DEVS && s->gpu[device] ? s->gpu[device]
                                                               : s;
}

slot_t *slot_at(slots_t *s, uint32_t idx)
{
    if (idx >= SLOT_GPU_BASE) {
        uint32_t d = idx / SLOT_GPU_BASE - 1;
        if (d >= SLOT_DEVS || !(s = s->gpu[d]))
            return NULL;
    }
    idx -= s->base;
    return s->v && idx < s->n ? &s->v[idx] : NULL;
}

/* Every slot of s, host then GPUs: slot_next(s, NULL) first, NULL after
 * the last. */
slot_t *slot_next(slots_t *s, slot_t *prev)
{
    const slots_t *set = prev ? prev->set : s;
    uint32_t i = prev ? (uint32_t)(prev - set->v) + 1 : 0;
    for (;;) {
        if (set->v && i < set->n)
            return &set->v[i];
        int d = set == s ? 0 : set->device + 1;
        while (d < SLOT_DEVS && !s->gpu[d])
            d++;
        if (d >= SLOT_DEVS)
            return NULL;
        set = s->gpu[d];
        i = 0;
    }
}

void slots_cleanup(slots_t *s)
{
    for (int d = 0; d < SLOT_DEVS; d++)
        if (s->gpu[d]) {
            set_free(s->gpu[d]);
            gpu_mem_free(s->gpu[d]->mem);
            free(s->gpu[d]);
        }
    set_free(s);
    if (s->pinned)
        gpu_host_unregister(s->mem);
    if (s->mem)
        munmap(s->mem, s->len);
    kvxd_mem_release(MEM_STAGING, s->len); /* charged by slots_init() */
    memset(s, 0, sizeof(*s));
}

slot_t *slot_get(slots_t *s)
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

void slot_put(slots_t *s, slot_t *x)
{
    s = x->set; /* (the caller's direction; the set is the slot's) */
    assert(x->state != SLOT_FREE); /* one owner, one put */
    x->state = SLOT_FREE;
    x->owner = NULL;
    x->part = NULL;
    x->piece_bytes = x->got = 0;
    x->npieces = x->landing = x->arrived = x->copied = x->pending = 0;
    x->sends_left = 0;
    x->pulled = x->ahead = 0;
    x->ready = x->gather_ns = 0;
    x->status = x->ending = 0;
    assert(!x->direct); /* every piece's places went when UCX was done */
    list_push(s->free.next, &x->free_node); /* first */
    assert(s->nfree < s->n);
    s->nfree++;
}

/* Cut x (u0, u1, bytes set) into pieces of at most pb. */
void slot_cut(slot_t *x, const plan_t *plan, uint64_t pb)
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
void piece_copy(slot_t *x, uint32_t k, const plan_t *plan, gpu_part_t *gpu,
                int gather)
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
        j->packed_device = x->set->device >= 0;
        j->done = job_done;
        j->owner = x;
        j->abort = &x->ending; /* held by a pace: dropped at the end */
        off += b;
        u = e;
    }
    x->piece_jobs[k] = (uint8_t)n;
    for (uint32_t i = 0; i < n; i++)
        copy_submit(&jobs[i]);
}

/* owner's stream has ended: the copies of its slots that a pace holds
 * (gpu.pace, copy.pace) go back unrun, with KVX_ERR_CANCELLED, so that
 * the stream's end does not wait for the pace. */
void slots_owner_ended(slots_t *s, const void *owner)
{
    for (slot_t *x = slot_next(s, NULL); x; x = slot_next(s, x))
        if (x->owner == owner && x->state != SLOT_FREE)
            x->ending = 1;
    copy_drop_aborted();
}

/* The piece of x at byte offset off, or -1. */
int piece_at(const slot_t *x, uint64_t off)
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

void send_end_ex(peer_conn_t *c, uint64_t stream, int code, const char *msg,
                 int final)
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

void send_end(peer_conn_t *c, uint64_t stream, int code, const char *msg)
{
    send_end_ex(c, stream, code, msg, 0);
}

/* The connection a stream runs on (its peer_conn_id()), or NULL when it
 * is lost or gone: then the loss path ends the stream (remote_on_conn_lost
 * runs, or has run), and nothing is sent. */
peer_conn_t *conn_live(uint64_t id)
{
    peer_conn_t *c = peer_conn_find(id);
    return c && peer_conn_alive(c) ? c : NULL;
}

/* A control message on the connection named id: as peer_send(), and
 * KVX_ERR_PEER_GONE when it is lost or gone. */
int send_on(uint64_t id, const Kvxfer__PeerMsg *m)
{
    peer_conn_t *c = conn_live(id);
    return c ? peer_send(c, m) : KVX_ERR_PEER_GONE;
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
uint32_t piece_places(slot_t *x, uint32_t k, const plan_t *plan, int gather)
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
/* Piece k, received straight into the blocks or sent straight from them,
 * is back from UCX (done or failed): its places go. 1 if it was such a
 * piece. */
int direct_in(slot_t *x, uint32_t k)
{
    if (!(x->direct & (1ull << k)))
        return 0;
    x->direct &= ~(1ull << k);
    free(x->iov[k]);
    x->iov[k] = NULL;
    return 1;
}

/* The end of the units from u0 that one pull of a stream asks for (its
 * slice's units begin at slice_begin): at most end, and, while the
 * source's layers come one by one (OPENED.layerwise), the end of u0's
 * layer. The generation daemon cuts its pulls so (pull_schedule()), and
 * the context daemon its slots gathered ahead (ahead_fill()). */
uint64_t stream_cut_end(const plan_t *pl, uint64_t slice_begin, uint64_t u0,
                        uint64_t end, int layerwise)
{
    if (!layerwise || !pl->nsegs)
        return end;
    uint64_t lend = slice_begin +
                    ((u0 - slice_begin) / pl->nsegs + 1) * (uint64_t)pl->nsegs;
    return lend < end ? lend : end;
}
