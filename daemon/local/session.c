/*
 * session — one client connection and the protocol edge; see session.h.
 *
 * Reading order: on_io() reads bytes and fds -> handle_frame() decodes a
 * Request -> one handler per message validates every field and calls the
 * module that acts -> reply() packs the Reply into the output buffer ->
 * flush() writes what the socket takes, the rest when it is writable.
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agree/agree.h"
#include "core/daemon.h"
#include "common/frame.h"
#include "xfer/instance.h"
#include "remote/keyed.h"
#include "common/layout.h"
#include "core/log.h"
#include "core/map.h"
#include "copy/pool.h"
#include "remote/release.h"
#include "session.h"
#include "stats.h"
#include "xfer/xfer.h"

/* fds received and not yet taken by a request: a GPU pool over many VMM
 * allocations brings one each; more are closed as they come */
#define MAX_FDS (KVX_MAX_POOL_CHUNKS + 8)
#define OUT_MAX (256u << 20) /* a client this far behind is dropped */
/* Fair use of the loop. One session gets at most this many frames, or
 * replies of this many bytes, handled in one turn of the loop; the rest
 * wait for the next turn, after every other session's. */
#define TURN_FRAMES 32
#define TURN_BYTES (256u << 10)
/* A session without Hello (an observer) gets these caps at most. */
#define HELLO_QUEUE_MAX (256u << 10)
#define HELLO_REQUESTS_MAX 8u
/* An input buffer no larger than this is kept while it holds part of a
 * frame; an empty one is given back (charged only while it holds bytes).
 * Over the budget a read still gets IN_MIN bytes (the headroom, as a
 * small reply's), enough to learn which request a frame is. */
#define IN_KEEP (128u << 10)
#define IN_MIN 4096u

struct session {
    uint64_t id;
    int fd;
    uv_poll_t poll;
    int poll_events;
    pid_t pid;
    uid_t uid;
    int admin; /* sees every user's sessions and requests (status) */
    gid_t gid;
    frame_reader_t rd;
    uint8_t *out;
    size_t out_len, out_off, out_cap;
    int *fds;        /* received with SCM_RIGHTS, not yet used */
    uint64_t *fd_at; /* each one's place in the byte stream: the
                        last byte of the receive it came with,
                        which lies in the frame it came with */
    uint32_t nfds, fds_cap;
    uint64_t rx_bytes;          /* received so far */
    uint64_t frame_end;         /* stream offset just past the frame being
                                   handled: its fds are those before it */
    int hello;                  /* Hello accepted */
    instance_t *inst;
    uint32_t rank;
    kvx_role_t role;
    map_t pools;                /* pool_id -> pool_t, registered here */
    int closing;
    const char *close_why;      /* set: close at the next safe point */
    uint64_t connected_ms;
    uint64_t last_rx_ms;  /* bytes last arrived (idle deadline) */
    int spoke;            /* a whole request has arrived: no longer under
                             the Hello deadline (an observer) */
    uint64_t last_tx_ms;  /* the client last took replies, or the
                             queue last started from empty */
    uint64_t out_total;   /* reply bytes queued since connect */
    /* bytes of rd's and out's buffers charged to the memory budget */
    uint64_t mem_in, mem_out;
    uint32_t awaiting;    /* requests read and not answered yet */
    uint64_t skip_left;   /* bytes of a frame over the memory budget
                             still to be read and dropped (it was
                             answered LIMIT) */
    int ranked;           /* said Hello: holds one of limits.max_sessions
                             (else one of limits.hello_sessions) */
    int in_paused;        /* over the queue budget: not reading */
    int resume_queued;    /* a deferred pump() is queued */
    int fds_lost;         /* fds of a receive were dropped: */
    uint64_t fds_lost_at; /* ... its last byte in the stream */
    const char *fds_lost_why;
    list_t flush_node; /* on flushq: replies queued, not yet sent */
};

static map_t sessions;
static uint32_t fds_queued; /* over every session */

/* Session slots: those that said Hello (limits.max_sessions, per uid
 * limits.uid_sessions) and those that have not (limits.hello_sessions),
 * counted in all and per uid (an entry while the uid holds any). */
typedef struct uid_slots {
    uint32_t ranks, pre;
} uid_slots_t;
static map_t uid_slots;
static uint32_t nranked, npre;

static uid_slots_t *slots_of(uid_t uid, int make)
{
    uid_slots_t *u = map_get(&uid_slots, uid);
    if (!u && make && (u = calloc(1, sizeof(*u))) &&
        map_put(&uid_slots, uid, u)) {
        free(u);
        u = NULL;
    }
    return u;
}

static void slots_put(uid_t uid)
{
    uid_slots_t *u = slots_of(uid, 0);
    if (u && !u->ranks && !u->pre) {
        map_del(&uid_slots, uid);
        free(u);
    }
}

/* fds all sessions together may queue: half the open-file limit, so a
 * client sending many cannot starve the daemon of fds. */
static uint32_t fds_cap_total(void)
{
    static uint32_t cap;
    if (!cap) {
        struct rlimit rl;
        cap = getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_cur == RLIM_INFINITY
                  ? 65536
                  : (uint32_t)(rl.rlim_cur / 2);
        if (cap < 64)
            cap = 64;
    }
    return cap;
}

/* Drop the first n queued fds of s (closing them unless taken). */
static void fds_drop(session_t *s, uint32_t n, int close_them)
{
    if (!n)
        return;
    for (uint32_t i = 0; close_them && i < n; i++)
        close(s->fds[i]);
    memmove(s->fds, s->fds + n, (s->nfds - n) * sizeof(int));
    memmove(s->fd_at, s->fd_at + n, (s->nfds - n) * sizeof(uint64_t));
    s->nfds -= n;
    fds_queued -= n;
}
static uint64_t next_sid = 1;

/* Sessions to close at a safe point. A write can fail deep inside the end
 * of a request (an event delivered to a gone client); closing there would
 * end other requests while the caller still walks them. So output errors
 * only mark the session, and close_marked() runs from the deferred-work
 * queue (kvxd_defer). */
static void close_marked(void *arg);
static int sweep_marked; /* a close could not be deferred: the tick */

static void session_close(session_t *s, const char *why);
static void session_close_later(session_t *s, const char *why);
static void flush(session_t *s);
static void on_io(uv_poll_t *h, int status, int events);
static void resume_later(session_t *s);

static size_t queued(const session_t *s)
{
    return s->out_len - s->out_off;
}

/* Reply bytes a session may have queued before its input is paused. */
static size_t queue_cap(const session_t *s)
{
    uint64_t c = kvxd.conf.session_queue_bytes;
    return (size_t)(!s->hello && c > HELLO_QUEUE_MAX ? HELLO_QUEUE_MAX : c);
}

static uint32_t requests_cap(const session_t *s)
{
    uint32_t c = kvxd.conf.session_requests;
    return !s->hello && c > HELLO_REQUESTS_MAX ? HELLO_REQUESTS_MAX : c;
}

/* ---- output ----------------------------------------------------------- */

static void want_events(session_t *s)
{
    /* paused: only writable; a hang-up shows as writable and fails the
     * send */
    int ev = (s->in_paused ? 0 : UV_READABLE | UV_DISCONNECT) |
             (s->out_len > s->out_off ? UV_WRITABLE : 0);
    if (s->closing || s->close_why || ev == s->poll_events)
        return;
    s->poll_events = ev;
    uv_poll_start(&s->poll, ev, on_io);
}

static void reply(session_t *s, uint64_t req_id, int status,
                  const char *message);

/* Replies go out once per loop iteration and session, not once each: a
 * client that sends many requests in one write (a window of fetches, a
 * rank's poll and publish) gets their replies in one send, one wake-up.
 * Sessions with replies queued wait on flushq until the check phase of
 * the iteration that queued them (or the idle phase of the next, for
 * replies queued after it: the idle handle also keeps the loop from
 * blocking first). */
static list_t flushq = {&flushq, &flushq};
static uv_check_t flush_check;
static uv_idle_t flush_idle;

static void flush_all(void)
{
    list_t *n;
    uv_idle_stop(&flush_idle);
    while ((n = list_pop(&flushq)))
        flush(LIST_OWNER(n, session_t, flush_node));
}

static void on_flush_check(uv_check_t *h)
{
    (void)h;
    if (!list_empty(&flushq))
        flush_all();
}

static void on_flush_idle(uv_idle_t *h)
{
    (void)h;
    flush_all();
}

static void flush_later(session_t *s)
{
    if (list_linked(&s->flush_node))
        return;
    list_push(&flushq, &s->flush_node);
    uv_idle_start(&flush_idle, on_flush_idle);
}

static void reply_packed(session_t *s, const Kvxfer__Reply *r)
{
    if (s->closing || s->close_why)
        return;
    size_t n = kvxfer__reply__get_packed_size(r);
    if (s->out_len - s->out_off + n + FRAME_HDR > OUT_MAX) {
        log_warn("session %llu (pid %d uid %u): client not reading its "
                 "replies: %zu bytes queued; dropping it",
                 (unsigned long long)s->id, (int)s->pid, (unsigned)s->uid,
                 queued(s));
        session_close_later(s, "client not reading its replies");
        return;
    }
    if (s->out_cap - s->out_len < n + FRAME_HDR) {
        if (s->out_off) {
            memmove(s->out, s->out + s->out_off, s->out_len - s->out_off);
            s->out_len -= s->out_off;
            s->out_off = 0;
        }
        size_t ncap = s->out_cap ? s->out_cap : 4096;
        while (ncap - s->out_len < n + FRAME_HDR)
            ncap *= 2;
        if (ncap > s->mem_out &&
            kvxd_mem_charge_uid(MEM_REPLIES, s->uid, ncap - s->mem_out)) {
            if (r->status == 0 && n > 4096) {
                /* this reply is refused, not the session */
                char m[256], w[200];
                kvxd_mem_why(s->uid, ncap - s->mem_out, w, sizeof(w));
                snprintf(m, sizeof(m), "a %zu-byte reply %s", n, w);
                reply(s, r->id, KVX_ERR_LIMIT, m);
                return;
            }
            /* a small reply always goes: the budget's headroom */
            kvxd_mem_force_uid(MEM_REPLIES, s->uid, ncap - s->mem_out);
        }
        if (ncap > s->mem_out)
            s->mem_out = ncap;
        uint8_t *nb = realloc(s->out, ncap);
        if (!nb) {
            session_close_later(s, "out of memory for replies");
            return;
        }
        s->out = nb;
        s->out_cap = ncap;
    }
    if (s->out_len == s->out_off)
        s->last_tx_ms = kvxd_now_ms(); /* the stall clock starts now */
    frame_put_len(s->out + s->out_len, (uint32_t)n);
    kvxfer__reply__pack(r, s->out + s->out_len + FRAME_HDR);
    s->out_len += n + FRAME_HDR;
    s->out_total += n + FRAME_HDR;
    if (s->awaiting)
        s->awaiting--;
    flush_later(s);
}

static void reply(session_t *s, uint64_t req_id, int status,
                  const char *message)
{
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = req_id;
    r.status = status;
    r.message = (char *)(message ? message : "");
    if (status)
        kvxd_count_error(status);
    reply_packed(s, &r);
}

void session_reply(uint64_t sid, uint64_t req_id, int status,
                   const char *message)
{
    session_t *s = map_get(&sessions, sid);
    if (s)
        reply(s, req_id, status, message);
}

void session_reply_msg(uint64_t sid, Kvxfer__Reply *r)
{
    session_t *s = map_get(&sessions, sid);
    if (s)
        reply_packed(s, r);
}

static void flush(session_t *s)
{
    if (s->close_why)
        return;
    while (s->out_off < s->out_len) {
        ssize_t n = send(s->fd, s->out + s->out_off, s->out_len - s->out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            log_debug("session %llu: send: %m", (unsigned long long)s->id);
            session_close_later(s, "send failed");
            return;
        }
        s->out_off += (size_t)n;
        s->last_tx_ms = kvxd_now_ms();
    }
    if (s->out_off == s->out_len) {
        /* all sent: the buffer goes back, and its charge */
        s->out_off = s->out_len = 0;
        free(s->out);
        s->out = NULL;
        s->out_cap = 0;
        kvxd_mem_release_uid(MEM_REPLIES, s->uid, s->mem_out);
        s->mem_out = 0;
    }
    if (s->in_paused && queued(s) <= queue_cap(s) / 2) {
        /* the client caught up: read its requests again (those already
         * buffered first, from the deferred queue, not from inside a
         * reply) */
        s->in_paused = 0;
        resume_later(s);
    }
    want_events(s);
}

/* ---- validation helpers ----------------------------------------------- */

/* Block ids inside the pool and not repeated. */
static int check_blocks(const pool_t *p, const uint32_t *b, size_t n,
                        const char *what, char *why, size_t why_len)
{
    if (n == 0) {
        snprintf(why, why_len, "%s.blocks: empty", what);
        return KVX_ERR_INVALID;
    }
    if (n > kvxd.conf.max_blocks_per_request) {
        snprintf(why, why_len,
                 "%s.blocks: %zu blocks exceed limits.max_blocks_per_request "
                 "%u",
                 what, n, kvxd.conf.max_blocks_per_request);
        return KVX_ERR_LIMIT;
    }
    /* the first bad entry in table order: out of range, or a repeat of
     * an earlier one; memory bounded by the table, not by the pool */
    uint32_t nb = p->layout.num_blocks;
    size_t bad = n, dup = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (b[i] >= nb)
            bad = i;
    if (xfer_blocks_repeat(b, n, &dup)) {
        snprintf(why, why_len, "%s: out of memory", what);
        return KVX_ERR_NOMEM;
    }
    if (bad < n && bad <= dup) {
        snprintf(why, why_len,
                 "%s.blocks[%zu]: block %u outside pool %u's %u blocks", what,
                 bad, b[bad], p->id, nb);
        return KVX_ERR_INVALID;
    }
    if (dup < n) {
        snprintf(why, why_len, "%s.blocks[%zu]: block %u listed twice", what,
                 dup, b[dup]);
        return KVX_ERR_INVALID;
    }
    return 0;
}

/* The other block tables of a Publish or Fetch (what: its name), each
 * in a pool of this session with its blocks checked, into out
 * (XFER_MAX_GROUPS - 1 entries). */
static pool_t *own_pool(session_t *s, uint32_t id);
static int groups_from_msg(session_t *s, Kvxfer__GroupBlocks *const *m,
                           size_t n, const char *what, xfer_group_t *out,
                           char *why, size_t why_len)
{
    if (n >= XFER_MAX_GROUPS) {
        snprintf(why, why_len, "%s.groups: %zu, at most %u", what, n,
                 XFER_MAX_GROUPS - 1);
        return KVX_ERR_LIMIT;
    }
    for (size_t k = 0; k < n; k++) {
        char w[48];
        snprintf(w, sizeof(w), "%s.groups[%zu]", what, k);
        pool_t *p = own_pool(s, m[k]->pool_id);
        if (!p) {
            snprintf(why, why_len,
                     "%s.pool_id: no pool %u registered by this session", w,
                     m[k]->pool_id);
            return KVX_ERR_NOT_FOUND;
        }
        int rc = check_blocks(p, m[k]->blocks, m[k]->n_blocks, w, why, why_len);
        if (rc)
            return rc;
        out[k] = (xfer_group_t){p,
                                m[k]->blocks,
                                (uint32_t)m[k]->n_blocks,
                                m[k]->num_tokens,
                                m[k]->first_block,
                                m[k]->skip_tokens};
    }
    return 0;
}

static int layout_from_msg(const Kvxfer__Layout *m, kvx_layout_t *l,
                           char *why, size_t why_len)
{
    memset(l, 0, sizeof(*l));
    if (!m) {
        snprintf(why, why_len, "register_pool.layout: missing");
        return KVX_ERR_INVALID;
    }
    if (strlen(m->preset) >= sizeof(l->preset)) {
        snprintf(why, why_len, "layout.preset: longer than %zu bytes",
                 sizeof(l->preset) - 1);
        return KVX_ERR_INVALID;
    }
    for (const char *p = m->preset; *p; p++)
        if (*p < 0x21 || *p > 0x7e) { /* status shows it: no odd bytes */
            snprintf(why, why_len, "layout.preset: byte 0x%02x at %zu is "
                                   "not printable ASCII",
                     (unsigned char)*p, (size_t)(p - m->preset));
            return KVX_ERR_INVALID;
        }
    if (m->n_part_region != m->n_part_offset) {
        snprintf(why, why_len,
                 "layout.part_region: %zu entries, but layout.part_offset "
                 "has %zu",
                 m->n_part_region, m->n_part_offset);
        return KVX_ERR_LAYOUT;
    }
    if (m->n_part_region &&
        m->n_part_region != (uint64_t)m->num_layers * m->kv_factor) {
        snprintf(why, why_len,
                 "layout.part_region: %zu parts for num_layers %u x "
                 "kv_factor %u",
                 m->n_part_region, m->num_layers, m->kv_factor);
        return KVX_ERR_LAYOUT;
    }
    if (m->n_part_region > 2 * KVX_MAX_LAYERS) {
        snprintf(why, why_len, "layout.part_region: %zu parts (at most %u)",
                 m->n_part_region, 2 * KVX_MAX_LAYERS);
        return KVX_ERR_LAYOUT;
    }
    if (m->dtype > KVX_DTYPE_INT8) {
        snprintf(why, why_len, "layout.dtype: unknown value %u", m->dtype);
        return KVX_ERR_LAYOUT;
    }
    strcpy(l->preset, m->preset);
    l->num_layers = m->num_layers;
    l->kv_factor = m->kv_factor;
    l->num_heads = m->num_heads;
    l->head_dim = m->head_dim;
    l->elem_size = m->elem_size;
    l->dtype = m->dtype;
    l->tokens_per_block = m->tokens_per_block;
    l->num_blocks = m->num_blocks;
    if (m->n_part_region) {
        /* the caller frees it (layout_msg_free) */
        kvx_layout_part_t *pt = malloc(m->n_part_region * sizeof(*pt));
        if (!pt) {
            snprintf(why, why_len, "layout.part_region: out of memory");
            return KVX_ERR_NOMEM;
        }
        for (size_t i = 0; i < m->n_part_region; i++)
            pt[i] =
                (kvx_layout_part_t){m->part_region[i], 0, m->part_offset[i]};
        l->parts = pt;
        l->num_parts = (uint32_t)m->n_part_region;
    }
    l->layer_stride = m->layer_stride;
    l->kv_stride = m->kv_stride;
    l->block_stride = m->block_stride;
    l->token_stride = m->token_stride;
    l->head_stride = m->head_stride;
    l->first_head = m->first_head;
    return 0;
}

/* Free what layout_from_msg() allocated. */
static void layout_msg_free(kvx_layout_t *l)
{
    free((void *)l->parts);
    l->parts = NULL;
}

/* Pool of this session, by id. */
static pool_t *own_pool(session_t *s, uint32_t id)
{
    pool_t *p = map_get(&s->pools, id);
    return p && !p->released ? p : NULL;
}

/* ---- handlers: one per message, validate then act --------------------- */

#define FAIL(code, ...)                                                     \
    do {                                                                    \
        snprintf(why, sizeof(why), __VA_ARGS__);                            \
        reply(s, rq->id, (code), why);                                      \
        return;                                                             \
    } while (0)

static void on_hello(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Hello *h = rq->hello;
    if (s->hello)
        FAIL(KVX_ERR_STATE, "hello: already said");
    if (h->version_major != KVX_PROTOCOL_MAJOR)
        FAIL(KVX_ERR_VERSION,
             "hello.version_major: client speaks protocol %u.%u, daemon "
             "speaks %u.%u",
             h->version_major, h->version_minor, KVX_PROTOCOL_MAJOR,
             KVX_PROTOCOL_MINOR);
    size_t idlen = strlen(h->instance_id);
    if (idlen == 0 || idlen > INSTANCE_ID_MAX)
        FAIL(KVX_ERR_INVALID, "hello.instance_id: %zu bytes (expected 1..%u)",
             idlen, INSTANCE_ID_MAX);
    /* it goes into logs, status and other daemons' messages: printable
     * ASCII only (a newline could forge log lines) */
    for (size_t i = 0; i < idlen; i++)
        if ((unsigned char)h->instance_id[i] < 0x21 ||
            (unsigned char)h->instance_id[i] > 0x7e)
            FAIL(KVX_ERR_INVALID,
                 "hello.instance_id: byte %zu is 0x%02x (expected printable "
                 "ASCII, no spaces)",
                 i, (unsigned char)h->instance_id[i]);
    if (h->role < KVXFER__ROLE__ROLE_CONTEXT ||
        h->role > KVXFER__ROLE__ROLE_BOTH)
        FAIL(KVX_ERR_INVALID, "hello.role: %d (expected context, generation "
                              "or both)",
             h->role);
    if (!h->parallel)
        FAIL(KVX_ERR_INVALID, "hello.parallel: missing");
    const Kvxfer__ParallelConfig *pc = h->parallel;
    plan_side_t side;
    memset(&side, 0, sizeof(side));
    side.tp = pc->tp;
    side.pp = pc->pp;
    side.cp = pc->cp ? pc->cp : 1;
    side.total_layers = pc->total_layers;
    side.total_heads = pc->total_kv_heads;
    side.attention_dp = pc->attention_dp > 1 ? pc->attention_dp : 0;
    if (pc->attention_dp > 1 && h->role != KVXFER__ROLE__ROLE_GENERATION)
        FAIL(KVX_ERR_UNSUPPORTED,
             "hello.parallel.attention_dp: %u: attention DP is supported on "
             "the generation side only",
             pc->attention_dp);
    if (pc->n_layers_per_pp > 64)
        FAIL(KVX_ERR_INVALID, "hello.parallel.layers_per_pp: %zu entries "
                              "(at most 64)",
             pc->n_layers_per_pp);
    side.num_layers_per_pp = (uint32_t)pc->n_layers_per_pp;
    for (size_t i = 0; i < pc->n_layers_per_pp; i++)
        side.layers_per_pp[i] = pc->layers_per_pp[i];
    /* a slot of limits.max_sessions, within the uid's share */
    uid_slots_t *us = slots_of(s->uid, 0);
    uint32_t ucap = kvxd_uid_sessions_cap();
    assert(us && us->pre);
    if (nranked >= kvxd.conf.max_sessions)
        FAIL(KVX_ERR_LIMIT,
             "hello: the daemon has %u sessions that said Hello open, its "
             "limits.max_sessions",
             nranked);
    if (us->ranks >= ucap)
        FAIL(KVX_ERR_LIMIT,
             "hello: uid %u has %u sessions that said Hello open, its share "
             "of the daemon's (limits.uid_sessions %u)",
             (unsigned)s->uid, us->ranks, ucap);
    int rc =
        instance_attach(h->instance_id, (uint32_t)s->uid, (kvx_role_t)h->role,
                        h->rank, &side, s->id, &s->inst, why, sizeof(why));
    if (rc) {
        reply(s, rq->id, rc, why);
        return;
    }
    us->pre--;
    npre--;
    us->ranks++;
    nranked++;
    s->ranked = 1;
    s->hello = 1;
    s->rank = h->rank;
    s->role = (kvx_role_t)h->role;
    log_info("session %llu: pid %d uid %u is rank %u of instance %s",
             (unsigned long long)s->id, (int)s->pid, (unsigned)s->uid,
             s->rank, s->inst->id);
    Kvxfer__HelloReply hr = KVXFER__HELLO_REPLY__INIT;
    hr.version_major = KVX_PROTOCOL_MAJOR;
    hr.version_minor = KVX_PROTOCOL_MINOR;
    hr.session_id = s->id;
    hr.daemon_address = kvxd.address;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_HELLO;
    r.hello = &hr;
    reply_packed(s, &r);
}

static void on_join(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    int first = !s->inst->joined;
    int rc = instance_consumers(s->inst, rq->join->consumers,
                                rq->join->n_consumers, why, sizeof(why));
    if (!rc)
        rc = instance_join(s->inst, s->rank, rq->join->rank_addresses,
                           rq->join->n_rank_addresses, why, sizeof(why));
    if (!rc && first)
        agree_joined(s->inst); /* the root counts every remote rank */
    if (!rc)
        agree_rank(s->inst, s->rank, 1); /* spread: the root counts it */
    reply(s, rq->id, rc, rc ? why : "");
}

/* fds allocation a of a RegisterPool comes with: a memfd, or one per
 * physical allocation of VMM memory, none with a legacy IPC handle. */
static size_t alloc_fds(const Kvxfer__Allocation *a)
{
    if (a->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD)
        return 1;
    if (a->kind == KVXFER__POOL_KIND__POOL_GPU_VMM_FD)
        return a->n_chunk_sizes ? a->n_chunk_sizes : 1;
    return 0;
}

/* The allocations and regions of a RegisterPool, and the fds they need
 * (need expected, got taken, queued: what was left). 0, or the code with
 * why naming the field. */
static int pool_msg_check(const Kvxfer__RegisterPool *m, size_t need,
                          uint32_t got, uint32_t queued, char *why,
                          size_t why_len)
{
#define BAD(code, ...)                                                         \
    do {                                                                       \
        snprintf(why, why_len, __VA_ARGS__);                                   \
        return (code);                                                         \
    } while (0)
    if (m->n_regions > KVX_MAX_REGIONS)
        BAD(KVX_ERR_LIMIT,
            "register_pool.regions: %zu regions (at most %u, "
            "KVX_MAX_REGIONS)",
            m->n_regions, KVX_MAX_REGIONS);
    if (m->n_allocations > m->n_regions || m->n_allocations == 0 ||
        m->n_regions == 0)
        BAD(m->n_allocations > KVX_MAX_REGIONS ? KVX_ERR_LIMIT
                                               : KVX_ERR_INVALID,
            "register_pool: %zu allocations for %zu regions (expected "
            "1..%u regions, each in one allocation, every allocation "
            "holding one)",
            m->n_allocations, m->n_regions, KVX_MAX_REGIONS);
    size_t fds = 0;
    for (size_t i = 0; i < m->n_allocations; i++) {
        const Kvxfer__Allocation *a = m->allocations[i];
        int vmm = a->kind == KVXFER__POOL_KIND__POOL_GPU_VMM_FD;
        uint64_t sum = 0;
        int bad = 0;
        if (a->kind > KVXFER__POOL_KIND__POOL_GPU_VMM_FD)
            BAD(KVX_ERR_INVALID,
                "register_pool.allocations[%zu].kind: unknown value %d", i,
                a->kind);
        if ((a->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD) !=
            (m->allocations[0]->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD))
            BAD(KVX_ERR_UNSUPPORTED,
                "register_pool.allocations[%zu].kind: GPU and host memory "
                "in one pool (unsupported: register them as two pools)",
                i);
        if (a->n_chunk_sizes > KVX_MAX_POOL_CHUNKS)
            BAD(KVX_ERR_LIMIT,
                "register_pool.allocations[%zu].chunk_sizes: %zu "
                "allocations (at most %u)",
                i, a->n_chunk_sizes, KVX_MAX_POOL_CHUNKS);
        for (size_t k = 0; k < a->n_chunk_sizes; k++)
            bad |= !a->chunk_sizes[k] ||
                   __builtin_add_overflow(sum, a->chunk_sizes[k], &sum);
        if (a->n_chunk_sizes && !vmm)
            BAD(KVX_ERR_INVALID,
                "register_pool.allocations[%zu].chunk_sizes: only VMM "
                "memory spans several physical allocations",
                i);
        if (a->n_chunk_sizes && (bad || sum != a->alloc_size))
            BAD(KVX_ERR_INVALID,
                "register_pool.allocations[%zu].chunk_sizes: a size of 0, "
                "or sizes that do not sum to alloc_size %llu",
                i, (unsigned long long)a->alloc_size);
        if (a->kind != KVXFER__POOL_KIND__POOL_HOST_MEMFD) {
            if (a->gpu_uuid.len != 16)
                BAD(KVX_ERR_INVALID,
                    "register_pool.allocations[%zu].gpu_uuid: %zu bytes "
                    "(expected 16)",
                    i, a->gpu_uuid.len);
            if (!vmm && a->ipc_handle.len != 64)
                BAD(KVX_ERR_INVALID,
                    "register_pool.allocations[%zu].ipc_handle: %zu bytes "
                    "(expected 64)",
                    i, a->ipc_handle.len);
            /* one import per allocation: listed twice, it would be
             * imported as two and its regions could overlap unseen */
            for (size_t k = 0; k < i; k++)
                if (m->allocations[k]->alloc_id == a->alloc_id &&
                    m->allocations[k]->gpu_uuid.len == 16 &&
                    !memcmp(m->allocations[k]->gpu_uuid.data, a->gpu_uuid.data,
                            16))
                    BAD(KVX_ERR_INVALID,
                        "register_pool.allocations[%zu]: the same "
                        "allocation as allocations[%zu] (list it once; its "
                        "regions name it)",
                        i, k);
        }
        fds += alloc_fds(a);
    }
    if (fds > KVX_MAX_POOL_CHUNKS)
        BAD(KVX_ERR_LIMIT,
            "register_pool.allocations: %zu fds in all (at most %u)", fds,
            KVX_MAX_POOL_CHUNKS);
    uint8_t *used = calloc(m->n_allocations, 1);
    if (!used)
        BAD(KVX_ERR_NOMEM, "register_pool: out of memory");
    for (size_t i = 0; i < m->n_regions; i++) {
        if (m->regions[i]->allocation >= m->n_allocations) {
            free(used);
            BAD(KVX_ERR_INVALID,
                "register_pool.regions[%zu].allocation: %u, but there are "
                "%zu allocations",
                i, m->regions[i]->allocation, m->n_allocations);
        }
        used[m->regions[i]->allocation] = 1;
    }
    for (size_t i = 0; i < m->n_allocations; i++)
        if (!used[i]) {
            free(used);
            BAD(KVX_ERR_INVALID,
                "register_pool.allocations[%zu]: no region lies in it", i);
        }
    free(used);
    if (got < need)
        BAD(KVX_ERR_INVALID,
            "register_pool: %zu fd(s) expected with the request, %u "
            "arrived (send them with SCM_RIGHTS)",
            need, queued);
    return 0;
#undef BAD
}

static void on_register_pool(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__RegisterPool *m = rq->register_pool;
    /* host memfd: one fd per allocation; VMM: one per physical one */
    size_t need = 0;
    for (size_t i = 0; i < m->n_allocations && need <= KVX_MAX_POOL_CHUNKS; i++)
        need += alloc_fds(m->allocations[i]);
    if (need > KVX_MAX_POOL_CHUNKS || m->n_allocations > KVX_MAX_REGIONS)
        need = 0; /* refused below; what came is closed after the frame */
    /* the fds travel with this frame: take them first so every path
     * below closes them */
    int *fds = NULL;
    uint32_t nfds = 0, mine = 0;
    int rc = 0;
    while (mine < s->nfds && s->fd_at[mine] < s->frame_end)
        mine++; /* came with this frame (earlier ones are closed) */
    if (need && mine == need) {
        fds = malloc(need * sizeof(int));
        if (!fds) {
            snprintf(why, sizeof(why), "register_pool: out of memory");
            rc = KVX_ERR_NOMEM;
        } else {
            nfds = (uint32_t)need;
            memcpy(fds, s->fds, need * sizeof(int));
            fds_drop(s, (uint32_t)need, 0);
        }
    }
    if (!rc && need && nfds < need && s->fds_lost &&
        s->fds_lost_at < s->frame_end) {
        /* the client sent them: the daemon could not take them */
        snprintf(why, sizeof(why),
                 "register_pool: the fd(s) sent with the request were "
                 "dropped on arrival: %s; the request itself is fine, try "
                 "again later",
                 s->fds_lost_why);
        rc = KVX_ERR_LIMIT;
    }
    if (!rc)
        rc = pool_msg_check(m, need, nfds, mine, why, sizeof(why));
    if (!rc && s->pools.n >= kvxd.conf.max_pools) {
        snprintf(why, sizeof(why),
                 "register_pool: %u pools (limits.max_pools)", s->pools.n);
        rc = KVX_ERR_LIMIT;
    }
    kvx_layout_t l;
    memset(&l, 0, sizeof(l));
    if (!rc)
        rc = layout_from_msg(m->layout, &l, why, sizeof(why));
    uint32_t na = (uint32_t)m->n_allocations, nr = (uint32_t)m->n_regions;
    pool_alloc_req_t *al = NULL;
    pool_region_req_t *rg = NULL;
    if (!rc) {
        al = calloc(na, sizeof(*al));
        rg = calloc(nr, sizeof(*rg));
        if (!al || !rg) {
            snprintf(why, sizeof(why), "register_pool: out of memory");
            rc = KVX_ERR_NOMEM;
        }
    }
    if (rc) {
        for (uint32_t i = 0; i < nfds; i++)
            close(fds[i]);
        free(fds);
        free(al);
        free(rg);
        layout_msg_free(&l);
        reply(s, rq->id, rc, why);
        return;
    }
    /* hand the fds on, in allocation order: pool_register() closes them */
    for (uint32_t i = 0, f = 0; i < na; i++) {
        const Kvxfer__Allocation *a = m->allocations[i];
        uint32_t k = (uint32_t)alloc_fds(a);
        if (a->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD) {
            al[i].fd = fds[f];
        } else {
            al[i].gpu = 1;
            al[i].req = (gpu_import_req_t){
                .vmm = a->kind == KVXFER__POOL_KIND__POOL_GPU_VMM_FD,
                .fds = fds + f,
                .nfds = k,
                .chunk_sizes = a->chunk_sizes,
                .alloc_id = a->alloc_id,
                .alloc_size = a->alloc_size,
                .owner = s->id};
            memcpy(al[i].req.uuid, a->gpu_uuid.data, 16);
            if (!al[i].req.vmm)
                memcpy(al[i].req.ipc_handle, a->ipc_handle.data,
                       sizeof(al[i].req.ipc_handle));
        }
        f += k;
    }
    for (uint32_t i = 0; i < nr; i++)
        rg[i] = (pool_region_req_t){m->regions[i]->allocation,
                                    m->regions[i]->offset, m->regions[i]->size};
    pool_t *p;
    rc = pool_register(s->id, al, na, rg, nr, &l, &p, why, sizeof(why));
    free(fds); /* closed by pool_register, on every path */
    free(al);
    free(rg);
    layout_msg_free(&l);
    if (rc) {
        reply(s, rq->id, rc, why);
        return;
    }
    p->uid = (uint32_t)s->uid;
    /* the pages its memfds do not hold yet would be faulted in by the
     * daemon's copies and charged to the daemon's memory (a sparse
     * memfd costs its client nothing): charged to the uid now */
    uint64_t holes = pool_holes(p);
    if (holes && kvxd_mem_charge_uid(MEM_HOST, s->uid, holes)) {
        char w[200];
        kvxd_mem_why(s->uid, holes, w, sizeof(w));
        pool_release(p);
        FAIL(KVX_ERR_LIMIT,
             "register_pool: %llu bytes of the pool are not in its memory "
             "yet (holes of a sparse memfd, or pages swapped out), which "
             "the daemon would fault in; they %s (write the memory before "
             "registering it)",
             (unsigned long long)holes, w);
    }
    p->mem_host = holes;
    if (map_put(&s->pools, p->id, p)) {
        pool_release(p);
        FAIL(KVX_ERR_NOMEM, "register_pool: out of memory");
    }
    pool_populate(p);
    log_info("session %llu: pool %u registered: %s %s, %u blocks, %llu "
             "bytes in %u regions",
             (unsigned long long)s->id, p->id, p->gpu ? "gpu" : "host",
             p->layout.preset, p->layout.num_blocks,
             (unsigned long long)p->size, p->nregions);
    Kvxfer__RegisterPoolReply pr = KVXFER__REGISTER_POOL_REPLY__INIT;
    pr.pool_id = p->id;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_REGISTER_POOL;
    r.register_pool = &pr;
    reply_packed(s, &r);
}

static void on_deregister_pool(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    uint32_t id = rq->deregister_pool->pool_id;
    pool_t *p = own_pool(s, id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "deregister_pool.pool_id: no pool %u registered by this session",
             id);
    uint32_t users = xfer_pool_users(p) + keyed_pool_users(p);
    if (users)
        FAIL(KVX_ERR_BUSY,
             "deregister_pool.pool_id: pool %u is used by %u requests; "
             "cancel them first",
             id, users);
    map_del(&s->pools, id);
    pool_release(p);
    reply(s, rq->id, 0, "");
}

static int ready_for(session_t *s, kvx_role_t need, const char *what,
                     char *why, size_t why_len)
{
    if (!(s->role & need)) {
        snprintf(why, why_len, "%s: instance %s has role %s", what,
                 s->inst->id,
                 s->role == KVX_ROLE_CONTEXT ? "context" : "generation");
        return KVX_ERR_STATE;
    }
    return instance_ready(s->inst, why, why_len);
}

/* A PublishReply with params (malloc'd: freed here). */
static void reply_params(session_t *s, uint64_t id, uint8_t *params,
                         size_t plen)
{
    Kvxfer__PublishReply pr = KVXFER__PUBLISH_REPLY__INIT;
    pr.context_params.data = params;
    pr.context_params.len = plen;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_PUBLISH;
    r.publish = &pr;
    reply_packed(s, &r);
    free(params);
}

static void on_publish(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Publish *m = rq->publish;
    int rc;
    reqkey_t key;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "publish.key", why,
                         sizeof(why))))
        goto fail;
    if ((rc = ready_for(s, KVX_ROLE_CONTEXT, "publish", why, sizeof(why))))
        goto fail;
    if (m->aux.len > kvxd.conf.aux_bytes)
        FAIL(KVX_ERR_LIMIT,
             "publish.aux: %zu bytes, more than limits.aux_bytes (%u)",
             m->aux.len, kvxd.conf.aux_bytes);
    pool_t *p = own_pool(s, m->pool_id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "publish.pool_id: no pool %u registered by this session",
             m->pool_id);
    if ((rc = check_blocks(p, m->blocks, m->n_blocks, "publish", why,
                           sizeof(why))))
        goto fail;
    xfer_group_t gs[XFER_MAX_GROUPS];
    if ((rc = groups_from_msg(s, m->groups, m->n_groups, "publish", gs, why,
                              sizeof(why))))
        goto fail;
    uint8_t *params;
    size_t plen;
    if ((rc = xfer_publish(s->inst, s->rank, &key, p, m->blocks,
                           (uint32_t)m->n_blocks, m->num_tokens, gs,
                           (uint32_t)m->n_groups, m->aux.data,
                           (uint32_t)m->aux.len, m->layerwise, &params, &plen,
                           why, sizeof(why))))
        goto fail;
    reply_params(s, rq->id, params, plen);
    return;
fail:
    reply(s, rq->id, rc, why);
}

static void on_layers_ready(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__LayersReady *m = rq->layers_ready;
    reqkey_t key;
    int rc = reqkey_set(&key, m->key.data, m->key.len, "layers_ready.key", why,
                        sizeof(why));
    if (!rc)
        rc = ready_for(s, KVX_ROLE_CONTEXT, "layers_ready", why, sizeof(why));
    if (!rc)
        rc = xfer_layers_ready(s->inst, s->rank, &key, m->group, m->first,
                               m->count, m->tokens, m->cuda_event.data,
                               m->cuda_event.len, s->id, why, sizeof(why));
    reply(s, rq->id, rc, rc ? why : "");
}

static void on_append_blocks(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__AppendBlocks *m = rq->append_blocks;
    reqkey_t key;
    int rc = reqkey_set(&key, m->key.data, m->key.len, "append_blocks.key", why,
                        sizeof(why));
    if (!rc)
        rc = ready_for(s, KVX_ROLE_CONTEXT, "append_blocks", why, sizeof(why));
    pool_t *p = rc ? NULL : own_pool(s, m->pool_id);
    if (!rc && !p) {
        rc = KVX_ERR_NOT_FOUND;
        snprintf(why, sizeof(why),
                 "append_blocks.pool_id: no pool %u registered by this "
                 "session",
                 m->pool_id);
    }
    if (!rc)
        rc = check_blocks(p, m->blocks, m->n_blocks, "append_blocks", why,
                          sizeof(why));
    if (!rc)
        rc = xfer_append_blocks(s->inst, s->rank, &key, p, m->blocks,
                                (uint32_t)m->n_blocks, why, sizeof(why));
    reply(s, rq->id, rc, rc ? why : "");
}

static void on_fetch_progress(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    reqkey_t key;
    uint32_t done = 0, n = 0;
    int rc = reqkey_set(&key, rq->fetch_progress->key.data,
                        rq->fetch_progress->key.len, "fetch_progress.key", why,
                        sizeof(why));
    if (!rc)
        rc = ready_for(s, KVX_ROLE_GENERATION, "fetch_progress", why,
                       sizeof(why));
    if (!rc)
        rc = xfer_fetch_progress(s->inst, s->rank, &key,
                                 rq->fetch_progress->group, &done, &n, why,
                                 sizeof(why));
    if (rc < 0) {
        reply(s, rq->id, rc, why);
        return;
    }
    Kvxfer__FetchProgressReply fp = KVXFER__FETCH_PROGRESS_REPLY__INIT;
    fp.layers_done = done;
    fp.num_layers = n;
    fp.ended = rc == 1;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_FETCH_PROGRESS;
    r.fetch_progress = &fp;
    reply_packed(s, &r);
}

static void on_fetch(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Fetch *m = rq->fetch;
    int rc;
    reqkey_t key;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "fetch.key", why,
                         sizeof(why))))
        goto fail;
    if ((rc = ready_for(s, KVX_ROLE_GENERATION, "fetch", why, sizeof(why))))
        goto fail;
    pool_t *p = own_pool(s, m->pool_id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "fetch.pool_id: no pool %u registered by this session",
             m->pool_id);
    if ((rc = check_blocks(p, m->blocks, m->n_blocks, "fetch", why,
                           sizeof(why))))
        goto fail;
    xfer_group_t gs[XFER_MAX_GROUPS];
    if ((rc = groups_from_msg(s, m->groups, m->n_groups, "fetch", gs, why,
                              sizeof(why))))
        goto fail;
    rc = xfer_fetch(s->inst, s->rank, &key, m->context_params.data,
                    m->context_params.len, p, m->blocks, (uint32_t)m->n_blocks,
                    m->skip_tokens, m->dp_rank, gs, (uint32_t)m->n_groups, why,
                    sizeof(why));
fail:
    reply(s, rq->id, rc, rc ? why : "");
}

static void on_poll(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    uint64_t now = kvxd_now_ms();
    uint32_t t = rq->poll->timeout_ms;
    if (t > kvxd.conf.poll_timeout_max_ms) /* cut, see configuration.md */
        t = kvxd.conf.poll_timeout_max_ms;
    if (instance_spread(s->inst) && !s->inst->local[0]) {
        /* batches of an instance spread over daemons come from the
         * daemon of rank 0 */
        int rc = agree_poll(s->inst, s->rank, rq->id, rq->poll->at_least, t,
                            why, sizeof(why));
        if (rc)
            reply(s, rq->id, rc, why);
        return;
    }
    batch_state_t *bs = &s->inst->batches;
    int rc = batch_poll(bs, s->rank, rq->id, rq->poll->at_least, now + t, now);
    /* answered early only when a fetch's last copies go out after this
     * (not at once for one already out: a small request's event comes
     * sooner than the extra round trip) */
    if (!rc && rq->poll->early && !instance_spread(s->inst))
        batch_waiter_early(bs, s->rank);
    if (rc == KVX_ERR_LIMIT)
        FAIL(KVX_ERR_LIMIT,
             "poll: batches %llu to %llu of instance %s were dropped before "
             "rank %u read them (limits.batches_kept %u: every rank must "
             "poll, also one that fetched nothing); the next poll reads on",
             (unsigned long long)bs->missed_from,
             (unsigned long long)bs->missed_to, s->inst->id, s->rank,
             bs->kept_max);
    if (rc)
        FAIL(KVX_ERR_BUSY, "poll: this rank already has a poll waiting");
}

static void on_cancel(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    reqkey_t key;
    int rc = reqkey_set(&key, rq->cancel->key.data, rq->cancel->key.len,
                        "cancel.key", why, sizeof(why));
    if (!rc && keyed_cancel(s->inst, &key))
        rc = 0; /* a fetch by key that was still waiting: ended */
    else if (!rc)
        rc = xfer_cancel(s->inst, &key, s->id, rq->id, why, sizeof(why));
    if (rc <= 0)
        reply(s, rq->id, rc, rc ? why : "");
    /* rc 1: answered once the request's copies are fenced */
}

static void on_status(session_t *s, const Kvxfer__Request *rq)
{
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    Kvxfer__StatusReply st = KVXFER__STATUS_REPLY__INIT;
    int64_t only = s->admin ? -1 : (int64_t)s->uid;
    /* one reply's cap: the first list_page_entries of each list */
    uint32_t cap = kvxd.conf.list_page_entries;
    stats_fill(&st, only, cap);
    st.n_sessions = session_infos(&st.sessions, only, cap, &st.sessions_total);
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_STATUS_REPLY;
    r.status_reply = &st;
    reply_packed(s, &r);
    session_infos_free(st.sessions, st.n_sessions);
    stats_free(&st);
}

static void on_list_requests(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__ListRequests *m = rq->list_requests;
    uint32_t max = kvxd.conf.list_page_entries;
    if (m->max_entries && m->max_entries < max)
        max = m->max_entries;
    int side = 0;
    if (m->after_instance[0]) {
        if (!strcmp(m->after_side, "generation"))
            side = 1;
        else if (strcmp(m->after_side, "context"))
            FAIL(KVX_ERR_INVALID,
                 "list_requests.after_side: '%.32s' (expected context or "
                 "generation)",
                 m->after_side);
    }
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    Kvxfer__RequestsReply rr = KVXFER__REQUESTS_REPLY__INIT;
    int more = 0;
    rr.n_requests = xfer_infos_page(
        m->after_instance, side,
        m->after_key.len ? xfer_key_id(m->after_key.data, m->after_key.len) : 0,
        max, s->admin ? -1 : (int64_t)s->uid, &rr.requests, &more);
    rr.more = more;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_REQUESTS;
    r.requests = &rr;
    reply_packed(s, &r);
    xfer_free_infos(rr.requests, rr.n_requests);
}

static void on_fetch_by_key(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__FetchByKey *m = rq->fetch_by_key;
    int rc;
    reqkey_t key, ckey;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "fetch_by_key.key", why,
                         sizeof(why))) ||
        (rc = reqkey_set(&ckey, m->context_key.data, m->context_key.len,
                         "fetch_by_key.context_key", why, sizeof(why))))
        goto fail;
    if ((rc = ready_for(s, KVX_ROLE_GENERATION, "fetch_by_key", why,
                        sizeof(why))))
        goto fail;
    pool_t *p = own_pool(s, m->pool_id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "fetch_by_key.pool_id: no pool %u registered by this session",
             m->pool_id);
    if ((rc = check_blocks(p, m->blocks, m->n_blocks, "fetch_by_key", why,
                           sizeof(why))))
        goto fail;
    /* the checks xfer_fetch makes before the params: refused now, as a
     * fetch with params is */
    uint32_t groups =
        s->inst->side.attention_dp > 1 ? s->inst->side.attention_dp : 1;
    if (m->dp_rank >= groups)
        FAIL(KVX_ERR_INVALID,
             "fetch_by_key.dp_rank: %u, but instance %s has %u attention-DP "
             "group%s",
             m->dp_rank, s->inst->id, groups, groups == 1 ? "" : "s");
    xfer_group_t gs[XFER_MAX_GROUPS];
    if ((rc = groups_from_msg(s, m->groups, m->n_groups, "fetch_by_key", gs,
                              why, sizeof(why))))
        goto fail;
    rc = keyed_fetch(s->inst, s->rank, &key,
                     m->context_instance ? m->context_instance : "",
                     m->context_address ? m->context_address : "", &ckey, p,
                     m->blocks, (uint32_t)m->n_blocks, m->skip_tokens,
                     m->dp_rank, gs, (uint32_t)m->n_groups, why, sizeof(why));
fail:
    reply(s, rq->id, rc, rc ? why : "");
}

/* A pool of a local rank of inst: its layout speaks for the instance's
 * (every rank's must agree with the offer's at publish). */
static int same_summary(const kvx_layout_t *a, const kvx_layout_t *b)
{
    return !strcmp(a->preset, b->preset) &&
           a->tokens_per_block == b->tokens_per_block &&
           a->head_dim == b->head_dim && a->dtype == b->dtype &&
           a->elem_size == b->elem_size && a->kv_factor == b->kv_factor;
}

/* NULL with *mixed set when the local ranks' pools differ in what the
 * params carry: reserve cannot tell which the ranks will publish. */
static const pool_t *instance_pool(const instance_t *inst, int *mixed)
{
    const pool_t *first = NULL;
    *mixed = 0;
    for (uint32_t r = 0; r < inst->nranks; r++) {
        session_t *rs =
            inst->rank_sid[r] ? map_get(&sessions, inst->rank_sid[r]) : NULL;
        uint32_t n = rs ? rs->pools.n : 0;
        pool_t **ps = n ? calloc(n, sizeof(*ps)) : NULL;
        n = ps ? map_values(&rs->pools, (void **)ps, n) : 0;
        for (uint32_t i = 0; i < n; i++) {
            if (!first)
                first = ps[i];
            else if (!same_summary(&first->layout, &ps[i]->layout))
                *mixed = 1;
        }
        free(ps);
    }
    return *mixed ? NULL : first;
}

/* Pool id as one of inst's local ranks registered it, or NULL. */
static pool_t *instance_pool_by_id(const instance_t *inst, uint32_t id)
{
    for (uint32_t r = 0; id && r < inst->nranks; r++) {
        session_t *rs =
            inst->rank_sid[r] ? map_get(&sessions, inst->rank_sid[r]) : NULL;
        pool_t *p = rs ? map_get(&rs->pools, id) : NULL;
        if (p)
            return p;
    }
    return NULL;
}

/* Reserve: the instance's scheduler, no Hello needed, under the uid
 * that owns the instance (or an admin). */
static void on_reserve(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__Reserve *m = rq->reserve;
    int rc;
    reqkey_t key;
    if ((rc = reqkey_set(&key, m->key.data, m->key.len, "reserve.key", why,
                         sizeof(why))))
        goto fail;
    instance_t *inst = m->instance_id ? instance_find(m->instance_id) : NULL;
    if (!inst || (!s->admin && inst->owner_uid != s->uid))
        FAIL(KVX_ERR_NOT_FOUND,
             "reserve.instance_id: no instance '%.128s' of uid %u on this "
             "daemon",
             m->instance_id ? m->instance_id : "", s->uid);
    if (!(inst->role & KVX_ROLE_CONTEXT))
        FAIL(KVX_ERR_STATE, "reserve: instance %s has role generation",
             inst->id);
    if ((rc = instance_ready(inst, why, sizeof(why))))
        goto fail;
    if (!inst->local[0])
        FAIL(KVX_ERR_STATE,
             "reserve: rank 0 of instance %s is served by daemon %s: "
             "reserve there",
             inst->id, inst->addresses[0]);
    int mixed = 0;
    const pool_t *p = m->pool_id ? instance_pool_by_id(inst, m->pool_id)
                                 : instance_pool(inst, &mixed);
    if (m->pool_id && !p)
        FAIL(KVX_ERR_NOT_FOUND,
             "reserve.pool_id: %u is no pool of a rank of instance %s on "
             "this daemon",
             m->pool_id, inst->id);
    if (mixed)
        FAIL(KVX_ERR_STATE,
             "reserve: the ranks of instance %s registered pools of "
             "different layouts (preset, tokens_per_block, head_dim, dtype): "
             "name the plain table's pool (reserve.pool_id)",
             inst->id);
    if (!p)
        FAIL(KVX_ERR_STATE,
             "reserve: no rank of instance %s has registered a pool here "
             "yet (its layout goes into the params)",
             inst->id);
    xfer_group_t gs[XFER_MAX_GROUPS];
    if (m->n_groups >= XFER_MAX_GROUPS)
        FAIL(KVX_ERR_LIMIT, "reserve.groups: %zu, at most %u", m->n_groups,
             XFER_MAX_GROUPS - 1);
    for (size_t k = 0; k < m->n_groups; k++) {
        const Kvxfer__GroupBlocks *x = m->groups[k];
        pool_t *gp = instance_pool_by_id(inst, x->pool_id);
        if (!gp)
            FAIL(KVX_ERR_NOT_FOUND,
                 "reserve.groups[%zu].pool_id: %u is no pool of a rank of "
                 "instance %s on this daemon",
                 k, x->pool_id, inst->id);
        if (x->n_blocks || x->skip_tokens)
            FAIL(KVX_ERR_INVALID,
                 "reserve.groups[%zu]: a reservation names no blocks and "
                 "skips no tokens (the ranks' publishes give the blocks)",
                 k);
        gs[k] = (xfer_group_t){.pool = gp,
                               .num_tokens = x->num_tokens,
                               .first_block = x->first_block};
    }
    uint8_t *params;
    size_t plen;
    if ((rc = xfer_reserve(inst, &key, m->num_tokens, &p->layout, gs,
                           (uint32_t)m->n_groups, &params, &plen, why,
                           sizeof(why))))
        goto fail;
    reply_params(s, rq->id, params, plen);
    return;
fail:
    reply(s, rq->id, rc, why);
}

/* Release: no Hello needed (a router or scheduler process); the params'
 * token is the right to it. */
static void on_release(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    int later = 0, rc;
    const Kvxfer__Release *m = rq->release;
    if (m->context_key.len || (m->context_instance && m->context_instance[0])) {
        reqkey_t key;
        rc = reqkey_set(&key, m->context_key.data, m->context_key.len,
                        "release.context_key", why, sizeof(why));
        if (!rc && m->context_params.len) {
            snprintf(why, sizeof(why), "release: params or a key, not both");
            rc = KVX_ERR_INVALID;
        }
        if (!rc)
            rc = keyed_release(
                s->id, rq->id, s->uid, s->admin,
                s->inst && (s->role & KVX_ROLE_GENERATION) ? s->inst->id : NULL,
                m->context_instance ? m->context_instance : "",
                m->context_address ? m->context_address : "", &key, &later, why,
                sizeof(why));
    } else
        rc = release_start(m->context_params.data, m->context_params.len, s->id,
                           rq->id, &later, why, sizeof(why));
    if (!later)
        reply(s, rq->id, rc, rc ? why : "");
}

/* Drain requests waiting for the drain to end (Drain.wait): answered by
 * session_drained(), before the daemon exits. */
#define DRAIN_WAITERS 16
static struct {
    uint64_t sid, req;
} drain_waiters[DRAIN_WAITERS];
static unsigned ndrain_waiters;

/* Drain{deadline_ms, wait}: the upgrade step, as SIGTERM, for admins. */
static void on_drain(session_t *s, const Kvxfer__Request *rq)
{
    const Kvxfer__Drain *m = rq->drain;
    if (!s->admin) {
        log_warn("session %llu: drain refused: uid %u is not an admin",
                 (unsigned long long)s->id, (unsigned)s->uid);
        reply(s, rq->id, KVX_ERR_PERM,
              "drain: only root, the daemon's uid and members of "
              "auth.admin_gids may drain the daemon");
        return;
    }
    if (m->wait && ndrain_waiters == DRAIN_WAITERS) {
        reply(s, rq->id, KVX_ERR_LIMIT,
              "drain: 16 drain requests already wait for the end");
        return;
    }
    char who[48];
    snprintf(who, sizeof(who), "drain by uid %u", (unsigned)s->uid);
    /* waiting before the drain starts: with nothing in flight it is over
     * inside kvxd_drain() */
    if (m->wait) {
        drain_waiters[ndrain_waiters].sid = s->id;
        drain_waiters[ndrain_waiters++].req = rq->id;
    }
    int already = kvxd_drain(who, m->deadline_ms);
    if (already < 0) {
        ndrain_waiters -= m->wait ? 1 : 0;
        reply(s, rq->id, already, "drain: not available in this process");
        return;
    }
    if (m->wait)
        return;
    char msg[160];
    snprintf(msg, sizeof(msg),
             already ? "draining already; kvxferd exits 0 once it is over"
                     : "draining: requests in flight may finish for %u ms, "
                       "then end SHUTDOWN; kvxferd exits 0 once it is over",
             m->deadline_ms);
    reply(s, rq->id, 0, msg);
}

void session_drained(const char *what)
{
    for (unsigned i = 0; i < ndrain_waiters; i++)
        session_reply(drain_waiters[i].sid, drain_waiters[i].req, 0, what);
    ndrain_waiters = 0;
}

static void handle_frame(session_t *s, const uint8_t *buf, uint32_t len)
{
    Kvxfer__Request *rq = kvxfer__request__unpack(NULL, len, buf);
    if (!rq) {
        reply(s, 0, KVX_ERR_PROTOCOL,
              "frame: not a Request message; closing");
        session_close(s, "undecodable frame");
        return;
    }
    s->spoke = 1;
    char why[512];
    /* every request gets one reply, which counts it down */
    if (++s->awaiting > requests_cap(s)) {
        snprintf(why, sizeof(why),
                 "request: %u requests of this session await their replies "
                 "(limits.session_requests %u%s)",
                 s->awaiting - 1, requests_cap(s),
                 s->hello ? "" : "; before Hello at most 8");
        reply(s, rq->id, KVX_ERR_LIMIT, why);
        goto out;
    }
    if (kvxd.draining && rq->body_case != KVXFER__REQUEST__BODY_STATUS &&
        rq->body_case != KVXFER__REQUEST__BODY_POLL &&
        rq->body_case != KVXFER__REQUEST__BODY_LIST_REQUESTS &&
        rq->body_case != KVXFER__REQUEST__BODY_DRAIN) {
        reply(s, rq->id, KVX_ERR_SHUTDOWN, "daemon is shutting down");
        goto out;
    }
    switch (rq->body_case) {
    case KVXFER__REQUEST__BODY_HELLO:
        on_hello(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_STATUS:
        on_status(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_LIST_REQUESTS:
        on_list_requests(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_RELEASE:
        on_release(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_RESERVE:
        on_reserve(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY_DRAIN:
        on_drain(s, rq);
        goto out;
    case KVXFER__REQUEST__BODY__NOT_SET:
        reply(s, rq->id, KVX_ERR_PROTOCOL, "request: empty body");
        goto out;
    default:
        break;
    }
    if (!s->hello) {
        snprintf(why, sizeof(why), "request: say hello first");
        reply(s, rq->id, KVX_ERR_STATE, why);
        goto out;
    }
    switch (rq->body_case) {
    case KVXFER__REQUEST__BODY_JOIN:
        on_join(s, rq);
        break;
    case KVXFER__REQUEST__BODY_REGISTER_POOL:
        on_register_pool(s, rq);
        break;
    case KVXFER__REQUEST__BODY_DEREGISTER_POOL:
        on_deregister_pool(s, rq);
        break;
    case KVXFER__REQUEST__BODY_PUBLISH:
        on_publish(s, rq);
        break;
    case KVXFER__REQUEST__BODY_FETCH:
        on_fetch(s, rq);
        break;
    case KVXFER__REQUEST__BODY_FETCH_BY_KEY:
        on_fetch_by_key(s, rq);
        break;
    case KVXFER__REQUEST__BODY_POLL:
        on_poll(s, rq);
        break;
    case KVXFER__REQUEST__BODY_LAYERS_READY:
        on_layers_ready(s, rq);
        break;
    case KVXFER__REQUEST__BODY_FETCH_PROGRESS:
        on_fetch_progress(s, rq);
        break;
    case KVXFER__REQUEST__BODY_APPEND_BLOCKS:
        on_append_blocks(s, rq);
        break;
    case KVXFER__REQUEST__BODY_CANCEL:
        on_cancel(s, rq);
        break;
    default:
        reply(s, rq->id, KVX_ERR_PROTOCOL, "request: unknown body");
        break;
    }
out:
    kvxfer__request__free_unpacked(rq, NULL);
}

/* ---- input ------------------------------------------------------------ */

/* The fds of a receive of nbytes: queued with their place in the stream
 * (the receive's last byte). A session queues at most MAX_FDS, the daemon
 * at most fds_cap_total() (a share of RLIMIT_NOFILE); more are closed, and
 * the RegisterPool they came with is refused for missing fds. */
static void take_fds(session_t *s, struct msghdr *mh, size_t nbytes)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int *fds = (int *)CMSG_DATA(c);
        for (size_t i = 0; i < n; i++) {
            if (s->nfds == s->fds_cap && s->hello && s->fds_cap < MAX_FDS) {
                uint32_t cap = s->fds_cap ? s->fds_cap * 2 : 8;
                if (cap > MAX_FDS)
                    cap = MAX_FDS;
                int *nf = realloc(s->fds, cap * sizeof(int));
                if (nf)
                    s->fds = nf;
                uint64_t *na =
                    nf ? realloc(s->fd_at, cap * sizeof(uint64_t)) : NULL;
                if (na) {
                    s->fd_at = na;
                    s->fds_cap = cap;
                }
            }
            if (nbytes && s->nfds < s->fds_cap && s->hello &&
                fds_queued < fds_cap_total()) {
                s->fds[s->nfds] = fds[i];
                s->fd_at[s->nfds++] = s->rx_bytes + nbytes - 1;
                fds_queued++;
            } else {
                close(fds[i]); /* too many, before hello, or at EOF */
                if (nbytes && s->hello) {
                    s->fds_lost = 1;
                    s->fds_lost_at = s->rx_bytes + nbytes - 1;
                    s->fds_lost_why =
                        fds_queued >= fds_cap_total()
                            ? "the daemon holds as many received fds as it "
                              "allows (half its RLIMIT_NOFILE)"
                            : "this session holds as many received fds as "
                              "it may, or the daemon is out of memory";
                }
            }
        }
    }
}

/* Handle the whole frames buffered, within the session's budgets: its
 * queued replies (over it: input paused until the client reads them) and
 * this turn's share of the loop (over it: the rest next turn). Returns 0
 * when more bytes are needed, 1 when it stopped (budget, or closing). */
static int handle_frames(session_t *s, uint64_t out0, unsigned *frames)
{
    const uint8_t *msg;
    uint32_t len;
    while (!s->closing && !s->close_why) {
        if (queued(s) > queue_cap(s)) {
            s->in_paused = 1; /* flush() resumes it */
            want_events(s);
            return 1;
        }
        if (*frames >= TURN_FRAMES || s->out_total - out0 >= TURN_BYTES) {
            resume_later(s);
            return 1;
        }
        uint32_t cap =
            s->hello ? kvxd.conf.max_frame_bytes : kvxd.conf.hello_frame_bytes;
        int rc = frame_reader_next(&s->rd, cap, &msg, &len);
        if (rc == 0)
            return 0;
        if (rc < 0) {
            char why[160];
            snprintf(why, sizeof(why),
                     "frame: length %u exceeds the %s cap of %u bytes; "
                     "closing",
                     len,
                     s->hello ? "limits.max_frame_bytes"
                              : "limits.hello_frame_bytes",
                     cap);
            reply(s, 0, KVX_ERR_PROTOCOL, why);
            session_close(s, "oversized frame");
            return 1;
        }
        s->frame_end += FRAME_HDR + (uint64_t)len;
        (*frames)++;
        handle_frame(s, msg, len);
        /* fds that came with this frame (or before it) and were not
         * taken: never another frame's */
        uint32_t k = 0;
        while (k < s->nfds && s->fd_at[k] < s->frame_end)
            k++;
        if (k && !s->closing)
            fds_drop(s, k, 1);
        if (s->fds_lost && s->fds_lost_at < s->frame_end)
            s->fds_lost = 0; /* told to the frame they came with */
    }
    return 1;
}

/* The id of the Request whose first bytes are b[0, n): its field 1, a
 * varint, which protobuf-c packs first. 0 when the bytes do not start
 * with it (an id of 0 is not sent either). */
static uint64_t request_id_peek(const uint8_t *b, size_t n)
{
    if (n < 2 || b[0] != 0x08) /* field 1, varint */
        return 0;
    uint64_t id = 0;
    for (size_t i = 1; i < n && i < 11; i++) {
        id |= (uint64_t)(b[i] & 0x7f) << (7 * (i - 1));
        if (!(b[i] & 0x80))
            return id;
    }
    return 0;
}

/* The buffer is full of the start of one frame, and growing it would
 * pass the memory budget (over_by: the growth refused). The request is
 * answered LIMIT naming the key, and the rest of its frame is read and
 * dropped as it comes; the session goes on. A frame that does not say
 * which request it is gets the reply with id 0 and the session ends
 * (the client could not match it). Returns -1 when closed, else 1. */
static int frame_over_budget(session_t *s, uint64_t over_by)
{
    const uint8_t *b = s->rd.buf + s->rd.off;
    size_t held = s->rd.len - s->rd.off;
    assert(held >= FRAME_HDR);
    uint32_t len = frame_get_len(b);
    uint64_t id = request_id_peek(b + FRAME_HDR, held - FRAME_HDR);
    char w[200], m[320];
    kvxd_mem_why(s->uid, over_by, w, sizeof(w));
    snprintf(m, sizeof(m), "request: its %u-byte frame %s; %s", len, w,
             id ? "refused (its bytes are read and dropped)" : "closing");
    log_warn("session %llu (pid %d uid %u): a %u-byte frame %s",
             (unsigned long long)s->id, (int)s->pid, (unsigned)s->uid, len, w);
    s->spoke = 1;
    s->awaiting++; /* the reply counts it down */
    reply(s, id, KVX_ERR_LIMIT, m);
    if (!id) {
        session_close(s, "memory budget");
        return -1;
    }
    s->skip_left = FRAME_HDR + (uint64_t)len - held;
    s->frame_end += FRAME_HDR + (uint64_t)len;
    s->rd.off = s->rd.len = 0;
    return 1;
}

/* Bytes of a refused frame that arrived: dropped from the buffer (which
 * held nothing else); once it is all read, the fds that came with it
 * are closed. */
static void skip_bytes(session_t *s)
{
    size_t n = s->rd.len - s->rd.off;
    size_t d = n < s->skip_left ? n : (size_t)s->skip_left;
    memmove(s->rd.buf + s->rd.off, s->rd.buf + s->rd.off + d, n - d);
    s->rd.len -= d;
    s->skip_left -= d;
    if (s->skip_left)
        return;
    uint32_t k = 0;
    while (k < s->nfds && s->fd_at[k] < s->frame_end)
        k++;
    fds_drop(s, k, 1);
    if (s->fds_lost && s->fds_lost_at < s->frame_end)
        s->fds_lost = 0;
}

/* Give back the input buffer's memory the session no longer needs:
 * all of it when it holds no bytes. */
static void in_shrink(session_t *s)
{
    if (s->closing || s->skip_left)
        return;
    size_t cap = frame_reader_shrink(&s->rd, IN_KEEP);
    if (cap < s->mem_in) {
        kvxd_mem_release_uid(MEM_FRAMES, s->uid, s->mem_in - cap);
        s->mem_in = cap;
    }
}

/* One receive. Returns -1 (closed), 0 (nothing there), 1 (the socket is
 * drained) or 2 (the buffer filled: maybe more). */
static int read_once(session_t *s)
{
    for (;;) {
        /* the input buffer's growth is charged before it is made; over
         * the budget, the room there is is read into (a session without
         * a buffer gets IN_MIN bytes, the headroom), and a frame that
         * needs more is refused */
        size_t want = 65536;
        size_t ncap = frame_reader_cap_for(&s->rd, want);
        if (ncap > s->mem_in &&
            kvxd_mem_charge_uid(MEM_FRAMES, s->uid, ncap - s->mem_in)) {
            size_t held = s->rd.len - s->rd.off;
            if (s->rd.cap > held) {
                want = s->rd.cap - held;
            } else if (!s->rd.cap) {
                want = IN_MIN;
                if (s->mem_in < IN_MIN) {
                    kvxd_mem_force_uid(MEM_FRAMES, s->uid, IN_MIN - s->mem_in);
                    s->mem_in = IN_MIN;
                }
            } else {
                return frame_over_budget(s, ncap - s->mem_in) < 0 ? -1 : 2;
            }
        } else if (ncap > s->mem_in) {
            s->mem_in = ncap;
        }
        size_t room;
        uint8_t *buf = frame_reader_space(&s->rd, want, &room);
        if (!buf) {
            session_close(s, "out of memory for input");
            return -1;
        }
        assert(s->rd.cap <= s->mem_in);
        union {
            char buf[CMSG_SPACE(FRAME_FDS_PER_SEND * sizeof(int))];
            struct cmsghdr align;
        } cm;
        struct iovec iov = {buf, room};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1,
                            .msg_control = cm.buf,
                            .msg_controllen = sizeof(cm.buf)};
        ssize_t n = recvmsg(s->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            session_close(s, "receive failed");
            return -1;
        }
        take_fds(s, &mh, (size_t)n);
        if ((mh.msg_flags & MSG_CTRUNC) && n > 0) {
            /* fds were dropped on the way: the daemon is out of fds
             * (RLIMIT_NOFILE, or the system's). The bytes are whole; the
             * RegisterPool they came with is refused with LIMIT. */
            struct rlimit rl;
            getrlimit(RLIMIT_NOFILE, &rl);
            log_error("session %llu (pid %d): fds sent with a frame were "
                      "dropped by the kernel: the daemon is out of file "
                      "descriptors (RLIMIT_NOFILE %llu, or the system's "
                      "limit)",
                      (unsigned long long)s->id, (int)s->pid,
                      (unsigned long long)rl.rlim_cur);
            kvxd_count_error(KVX_ERR_LIMIT);
            s->fds_lost = 1;
            s->fds_lost_at = s->rx_bytes + (uint64_t)n - 1;
            s->fds_lost_why = "the daemon is out of file descriptors "
                              "(EMFILE/ENFILE: its RLIMIT_NOFILE or the "
                              "system's limit)";
        }
        s->rx_bytes += (uint64_t)n;
        if (n == 0) {
            session_close(s, "client disconnected");
            return -1;
        }
        s->last_rx_ms = kvxd_now_ms();
        frame_reader_commit(&s->rd, (size_t)n);
        if (s->skip_left)
            skip_bytes(s);
        return (size_t)n < room ? 1 : 2;
    }
}

/* Read and handle what the session sent, within its budgets. */
static void pump_once(session_t *s)
{
    uint64_t out0 = s->out_total;
    unsigned frames = 0;
    for (int reads = 0;; reads++) {
        /* buffered frames first: nothing more is read while they wait */
        if (handle_frames(s, out0, &frames))
            return;
        if (reads == 4) /* level-triggered polling calls us again */
            return;
        int r = read_once(s);
        if (r <= 0)
            return;
        if (r == 1) {
            handle_frames(s, out0, &frames);
            return;
        }
    }
}

static void pump(session_t *s)
{
    pump_once(s);
    in_shrink(s);
}

static void resume_cb(void *arg)
{
    session_t *s = map_get(&sessions, (uint64_t)(uintptr_t)arg);
    if (!s)
        return;
    s->resume_queued = 0;
    if (!s->closing && !s->close_why && !s->in_paused)
        pump(s);
}

/* Handle the rest of a session's buffered frames at the next turn. */
static void resume_later(session_t *s)
{
    if (s->resume_queued || s->closing || s->close_why)
        return;
    if (kvxd_defer(resume_cb, (void *)(uintptr_t)s->id) == 0)
        s->resume_queued = 1;
    /* no memory: the next readable event or flush tries again */
}

static void on_io(uv_poll_t *h, int status, int events)
{
    session_t *s = h->data;
    if (status < 0) {
        session_close(s, uv_strerror(status));
        return;
    }
    if (events & UV_WRITABLE)
        flush(s);
    if (!s->closing && !s->close_why && !s->in_paused &&
        (events & (UV_READABLE | UV_DISCONNECT)))
        pump(s);
}

/* ---- life ------------------------------------------------------------- */

/* Close the sessions marked by session_close_later(): queued with
 * kvxd_defer(), and swept by session_tick() too (a defer that found no
 * memory). */
static void close_marked(void *arg)
{
    /* by id: the session may be gone by now */
    session_t *s = map_get(&sessions, (uint64_t)(uintptr_t)arg);
    if (s && s->close_why && !s->closing)
        session_close(s, s->close_why);
}

static void session_close_later(session_t *s, const char *why)
{
    if (s->closing || s->close_why)
        return;
    s->close_why = why;
    uv_poll_stop(&s->poll); /* nothing more in or out until closed */
    if (kvxd_defer(close_marked, (void *)(uintptr_t)s->id))
        sweep_marked = 1; /* no memory: the tick closes it */
}

int session_init(void)
{
    static const kvxd_reply_sink_t sink = {session_reply, session_reply_msg};
    kvxd_set_reply_sink(&sink);
    if (uv_check_init(kvxd.loop, &flush_check) ||
        uv_idle_init(kvxd.loop, &flush_idle) ||
        uv_check_start(&flush_check, on_flush_check)) {
        log_error("session: cannot start the reply flush handles");
        return KVX_ERR_IO;
    }
    uv_unref((uv_handle_t *)&flush_check); /* keep nothing alive */
    uv_unref((uv_handle_t *)&flush_idle);
    return 0;
}

static void on_closed(uv_handle_t *h);

void session_refuse(int fd, int code, const char *message)
{
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.status = code;
    r.message = (char *)message;
    uint8_t buf[512];
    size_t n = kvxfer__reply__get_packed_size(&r);
    kvxd_count_error(code);
    if (n + FRAME_HDR <= sizeof(buf)) {
        frame_put_len(buf, (uint32_t)n);
        kvxfer__reply__pack(&r, buf + FRAME_HDR);
        /* a fresh socket's buffer takes it whole */
        (void)!send(fd, buf, n + FRAME_HDR, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    close(fd);
}

/* Unread bytes waiting in s's socket: it is speaking. */
static int has_unread(const session_t *s)
{
    int n = 0;
    return ioctl(s->fd, FIONREAD, &n) == 0 && n > 0;
}

/* limits.hello_sessions are all taken: the connection without Hello
 * that gives its place to a new one, or NULL. First one that has said
 * nothing (no whole request), else one that is idle (nothing awaited,
 * queued or half read); of those, the uid holding most such slots, then
 * the longest silent or idle. One with bytes waiting is speaking: kept. */
static session_t *pre_victim(void)
{
    session_t *best = NULL;
    int best_cls = 0;
    uint32_t best_n = 0;
    for (uint32_t i = 0; i < sessions.nb; i++)
        for (map_entry_t *e = sessions.b[i]; e; e = e->next) {
            session_t *v = e->val;
            if (v->ranked || v->closing || v->close_why)
                continue;
            int cls = !v->spoke ? 2
                      : !v->awaiting && !queued(v) && v->rd.len == v->rd.off
                          ? 1
                          : 0;
            if (!cls || has_unread(v))
                continue;
            uid_slots_t *u = slots_of(v->uid, 0);
            uint32_t n = u ? u->pre : 0;
            uint64_t at = v->last_rx_ms;
            if (!best || cls > best_cls ||
                (cls == best_cls &&
                 (n > best_n || (n == best_n && at < best->last_rx_ms)))) {
                best = v;
                best_cls = cls;
                best_n = n;
            }
        }
    return best;
}

int session_start(int fd, pid_t pid, uid_t uid, gid_t gid, int admin)
{
    session_t *v = npre >= kvxd.conf.hello_sessions ? pre_victim() : NULL;
    if (v) {
        reply(v, 0, KVX_ERR_LIMIT,
              "connection closed: limits.hello_sessions connections without "
              "Hello are open, and this one gave its place to a new one "
              "(it had said nothing, or been idle, the longest); say Hello, "
              "or connect again");
        session_close(v, "gave its place to a new connection "
                         "(limits.hello_sessions)");
    }
    if (npre >= kvxd.conf.hello_sessions) {
        static uint64_t warned_ms, refused;
        uint64_t now = kvxd_now_ms();
        refused++;
        if (!warned_ms || now >= warned_ms + 10000) { /* a flood: 1 line */
            warned_ms = now;
            log_warn("session: refusing pid %d uid %u: %u connections "
                     "without Hello open, all busy "
                     "(limits.hello_sessions); %llu refused so far",
                     (int)pid, (unsigned)uid, npre,
                     (unsigned long long)refused);
        }
        char msg[200];
        snprintf(msg, sizeof(msg),
                 "connection refused: the daemon has %u connections without "
                 "Hello open, each busy, its limits.hello_sessions; closing",
                 npre);
        session_refuse(fd, KVX_ERR_LIMIT, msg);
        return KVX_ERR_LIMIT;
    }
    session_t *s = calloc(1, sizeof(*s));
    if (!s) {
        close(fd);
        return KVX_ERR_NOMEM;
    }
    s->id = next_sid++;
    s->fd = fd;
    list_init(&s->flush_node);
    s->pid = pid;
    s->uid = uid;
    s->admin = admin;
    s->gid = gid;
    s->connected_ms = s->last_rx_ms = s->last_tx_ms = kvxd_now_ms();
    frame_reader_init(&s->rd);
    int rc = uv_poll_init(kvxd.loop, &s->poll, fd);
    if (rc) {
        log_error("session: uv_poll_init: %s", uv_strerror(rc));
        goto err_free;
    }
    s->poll.data = s;
    uid_slots_t *us = slots_of(uid, 1);
    if (!us || map_put(&sessions, s->id, s)) {
        slots_put(uid);
        uv_close((uv_handle_t *)&s->poll, on_closed); /* closes fd, frees s */
        return KVX_ERR_NOMEM;
    }
    us->pre++;
    npre++;
    s->poll_events = UV_READABLE | UV_DISCONNECT;
    uv_poll_start(&s->poll, s->poll_events, on_io);
    log_debug("session %llu: connected, pid %d uid %u",
              (unsigned long long)s->id, (int)pid, (unsigned)uid);
    return 0;

err_free:
    free(s);
    close(fd);
    return KVX_ERR_IO;
}

static void on_closed(uv_handle_t *h)
{
    session_t *s = h->data;
    close(s->fd);
    free(s);
}

static void session_close(session_t *s, const char *why)
{
    if (s->closing)
        return;
    s->closing = 1;
    list_remove(&s->flush_node); /* what is queued is sent below */
    log_info("session %llu (pid %d%s%s): closed: %s",
             (unsigned long long)s->id, (int)s->pid,
             s->inst ? ", instance " : "", s->inst ? s->inst->id : "", why);
    map_del(&sessions, s->id);
    uid_slots_t *us = slots_of(s->uid, 0);
    if (s->ranked) {
        nranked--;
        if (us)
            us->ranks--;
    } else {
        npre--;
        if (us)
            us->pre--;
    }
    slots_put(s->uid);
    /* last try to deliver what is queued (e.g. a protocol error reply) */
    if (s->out_len > s->out_off)
        (void)!send(s->fd, s->out + s->out_off, s->out_len - s->out_off,
                    MSG_NOSIGNAL | MSG_DONTWAIT);
    uv_poll_stop(&s->poll);
    /* pools first: requests using them end with an error for their peers,
     * and each mapping goes once its last in-flight copy is back */
    uint32_t n = s->pools.n;
    pool_t **ps = calloc(n ? n : 1, sizeof(*ps));
    if (ps) {
        n = map_values(&s->pools, (void **)ps, n);
        char msg[160];
        snprintf(msg, sizeof(msg), "pool owner (pid %d) disconnected",
                 (int)s->pid);
        for (uint32_t i = 0; i < n; i++) {
            keyed_end_pool_users(ps[i], KVX_ERR_PEER_GONE, msg);
            xfer_end_pool_users(ps[i], KVX_ERR_PEER_GONE, msg);
            pool_release(ps[i]);
        }
        free(ps);
    }
    map_free(&s->pools);
    gpu_events_forget(s->id); /* after its requests ended */
    if (s->inst && instance_detach(s->inst, s->rank)) {
        agree_rank(s->inst, s->rank, 0);
        char msg[256];
        snprintf(msg, sizeof(msg), "rank %u of instance %s disconnected",
                 s->rank, s->inst->id);
        keyed_end_instance(s->inst, KVX_ERR_PEER_GONE, msg);
        xfer_end_instance(s->inst, KVX_ERR_PEER_GONE, msg);
    }
    fds_drop(s, s->nfds, 1);
    free(s->fds);
    free(s->fd_at);
    frame_reader_cleanup(&s->rd);
    kvxd_mem_release_uid(MEM_FRAMES, s->uid, s->mem_in);
    kvxd_mem_release_uid(MEM_REPLIES, s->uid, s->mem_out);
    s->mem_in = s->mem_out = 0;
    free(s->out);
    s->out = NULL;
    uv_close((uv_handle_t *)&s->poll, on_closed);
}

void session_close_all(const char *why)
{
    uint32_t n = sessions.n;
    session_t **all = calloc(n ? n : 1, sizeof(*all));
    if (!all)
        return;
    n = map_values(&sessions, (void **)all, n);
    for (uint32_t i = 0; i < n; i++)
        session_close(all[i], why);
    free(all);
    map_free(&sessions);
}

unsigned session_unflushed(void)
{
    unsigned k = 0;
    for (uint32_t i = 0; i < sessions.nb; i++)
        for (map_entry_t *e = sessions.b[i]; e; e = e->next) {
            session_t *s = e->val;
            k += s->out_len > s->out_off;
        }
    return k;
}

unsigned session_count(void) { return sessions.n; }

void session_tick(uint64_t now)
{
    /* a connection that never says Hello must not hold a session slot
     * forever (limits.max_sessions); status requests need no Hello and
     * are answered at once */
    for (uint32_t i = 0; i < sessions.nb; i++)
        for (map_entry_t *e = sessions.b[i]; e; e = e->next) {
            session_t *s = e->val;
            if (s->close_why || s->closing)
                continue;
            /* a connection that says nothing; one that asks without
             * Hello (an observer: a scheduler's reserves, status) is
             * served as long as it keeps asking */
            if (!s->hello && !s->spoke &&
                now - s->connected_ms >= kvxd.conf.hello_timeout_ms) {
                session_close_later(s, "no Hello or other request within "
                                       "deadlines.hello_timeout_ms");
                continue;
            }
            /* a client holding a slot and nothing else (limits.
             * max_sessions): told why, then closed */
            uint32_t idle = kvxd.conf.session_idle_ms;
            if ((s->hello || s->spoke) && idle && !s->pools.n && !s->awaiting &&
                !queued(s) && now - s->last_rx_ms >= idle) {
                char why[200];
                snprintf(why, sizeof(why),
                         "session: idle for %u ms with no pool and no "
                         "request (deadlines.session_idle_ms); closing",
                         idle);
                reply(s, 0, KVX_ERR_TIMED_OUT, why);
                session_close_later(s, "idle: no pool, no request, nothing "
                                       "sent within deadlines.session_idle_ms");
                continue;
            }
            /* over its queue budget and reading none of it: its memory
             * goes back */
            if (queued(s) > queue_cap(s) &&
                now - s->last_tx_ms >= kvxd.conf.reply_stall_ms) {
                log_warn("session %llu (pid %d uid %u%s%s): client not "
                         "reading its replies: %zu bytes queued, over "
                         "limits.session_queue_bytes (%zu), none read for "
                         "%llu ms (deadlines.reply_stall_ms); dropping it",
                         (unsigned long long)s->id, (int)s->pid,
                         (unsigned)s->uid, s->inst ? ", instance " : "",
                         s->inst ? s->inst->id : "", queued(s), queue_cap(s),
                         (unsigned long long)(now - s->last_tx_ms));
                kvxd_count_error(KVX_ERR_LIMIT);
                session_close_later(s, "client not reading its replies");
            }
        }
    if (sweep_marked) { /* what a defer without memory left marked */
        sweep_marked = 0;
        for (uint32_t i = 0; i < sessions.nb; i++)
            for (map_entry_t *e = sessions.b[i]; e; e = e->next)
                if (((session_t *)e->val)->close_why &&
                    kvxd_defer(close_marked, (void *)(uintptr_t)e->key))
                    sweep_marked = 1;
    }
}

size_t session_infos(Kvxfer__SessionInfo ***out, int64_t only_uid, uint32_t cap,
                     uint32_t *total)
{
    *total = 0;
    uint32_t n = sessions.n;
    session_t **all = calloc(n ? n : 1, sizeof(*all));
    Kvxfer__SessionInfo **v = calloc(n ? n : 1, sizeof(*v));
    if (!all || !v) {
        free(all);
        free(v);
        *out = NULL;
        return 0;
    }
    n = map_values(&sessions, (void **)all, n);
    size_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (only_uid >= 0 && all[i]->uid != (uid_t)only_uid)
            continue; /* another user's */
        if ((*total)++ >= cap)
            continue; /* counted, not listed */
        Kvxfer__SessionInfo *si = malloc(sizeof(*si));
        if (!si)
            break;
        kvxfer__session_info__init(si);
        si->session_id = all[i]->id;
        si->pid = all[i]->pid;
        si->uid = all[i]->uid;
        si->instance_id = all[i]->inst ? all[i]->inst->id : "";
        si->rank = all[i]->rank;
        si->role = (Kvxfer__Role)(all[i]->hello ? all[i]->role : 0);
        si->pools = all[i]->pools.n;
        v[k++] = si;
    }
    free(all);
    *out = v;
    return k;
}

void session_infos_free(Kvxfer__SessionInfo **infos, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(infos[i]);
    free(infos);
}
