/*
 * session_conn — the connection of a session: bytes and fds in, replies
 * out, and its life (start, the slots it holds, the deadlines of the
 * tick, close). What a request says is session.c's (handle a frame,
 * validate, act); this file only moves bytes and keeps the table of
 * sessions.
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
#include "common/frame.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "core/log.h"
#include "core/map.h"
#include "pacing.h"
#include "remote/keyed.h"
#include "session_int.h"
#include "xfer/instance.h"
#include "xfer/xfer.h"

map_t sessions;
uint32_t fds_queued; /* over every session */
uint32_t nranked, npre;
static uint64_t next_sid = 1;

/* Per uid: its slots (uid_slots_t). */
static map_t uid_slots;

uid_slots_t *session_slots(uid_t uid, int make)
{
    uid_slots_t *u = map_get(&uid_slots, uid);
    if (!u && make && (u = calloc(1, sizeof(*u))) &&
        map_put(&uid_slots, uid, u)) {
        free(u);
        u = NULL;
    }
    return u;
}

void session_slots_put(uid_t uid)
{
    uid_slots_t *u = session_slots(uid, 0);
    if (u && !u->ranks && !u->pre) {
        map_del(&uid_slots, uid);
        free(u);
    }
}

/* fds all sessions together may queue: half the open-file limit, so a
 * client sending many cannot starve the daemon of fds. */
uint32_t session_fds_cap(void)
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
void session_fds_drop(session_t *s, uint32_t n, int close_them)
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

/* Sessions to close at a safe point. A write can fail deep inside the end
 * of a request (an event delivered to a gone client); closing there would
 * end other requests while the caller still walks them. So output errors
 * only mark the session, and close_marked() runs from the deferred-work
 * queue (kvxd_defer). */
static void close_marked(void *arg);
static int sweep_marked; /* a close could not be deferred: the tick */

static void on_io(uv_poll_t *h, int status, int events);
static void resume_later(session_t *s);

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
void session_flush(session_t *s)
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

/* ---- input ------------------------------------------------------------ */

/* The fds of a receive of nbytes: queued with their place in the stream
 * (the receive's last byte). A session queues at most MAX_FDS, the daemon
 * at most session_fds_cap() (a share of RLIMIT_NOFILE); more are closed, and
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
                fds_queued < session_fds_cap()) {
                s->fds[s->nfds] = fds[i];
                s->fd_at[s->nfds++] = s->rx_bytes + nbytes - 1;
                fds_queued++;
            } else {
                close(fds[i]); /* too many, before hello, or at EOF */
                if (nbytes && s->hello) {
                    s->fds_lost = 1;
                    s->fds_lost_at = s->rx_bytes + nbytes - 1;
                    s->fds_lost_why =
                        fds_queued >= session_fds_cap()
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
            s->in_paused = 1; /* session_flush() resumes it */
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
            session_reply(s->id, 0, KVX_ERR_PROTOCOL, why);
            session_close(s, "oversized frame");
            return 1;
        }
        s->frame_end += FRAME_HDR + (uint64_t)len;
        (*frames)++;
        session_handle_frame(s, msg, len);
        /* fds that came with this frame (or before it) and were not
         * taken: never another frame's */
        uint32_t k = 0;
        while (k < s->nfds && s->fd_at[k] < s->frame_end)
            k++;
        if (k && !s->closing)
            session_fds_drop(s, k, 1);
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
    session_reply(s->id, id, KVX_ERR_LIMIT, m);
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
    session_fds_drop(s, k, 1);
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
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
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
        session_flush(s);
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

void session_close_later(session_t *s, const char *why)
{
    if (s->closing || s->close_why)
        return;
    s->close_why = why;
    uv_poll_stop(&s->poll); /* nothing more in or out until closed */
    if (kvxd_defer(close_marked, (void *)(uintptr_t)s->id))
        sweep_marked = 1; /* no memory: the tick closes it */
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
            uid_slots_t *u = session_slots(v->uid, 0);
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
        session_reply(
            v->id, 0, KVX_ERR_LIMIT,
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
    uid_slots_t *us = session_slots(uid, 1);
    if (!us || map_put(&sessions, s->id, s)) {
        session_slots_put(uid);
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

void session_close(session_t *s, const char *why)
{
    if (s->closing)
        return;
    s->closing = 1;
    list_remove(&s->flush_node); /* what is queued is sent below */
    log_info("session %llu (pid %d%s%s): closed: %s", (unsigned long long)s->id,
             (int)s->pid, s->inst ? ", instance " : "",
             s->inst ? s->inst->id : "", why);
    map_del(&sessions, s->id);
    uid_slots_t *us = session_slots(s->uid, 0);
    if (s->ranked) {
        nranked--;
        if (us)
            us->ranks--;
    } else {
        npre--;
        if (us)
            us->pre--;
    }
    session_slots_put(s->uid);
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
    pacing_end(s->id);        /* its pace ends with it */
    gpu_events_forget(s->id); /* after its requests ended */
    if (s->inst && instance_detach(s->inst, s->rank)) {
        agree_rank(s->inst, s->rank, 0);
        char msg[256];
        snprintf(msg, sizeof(msg), "rank %u of instance %s disconnected",
                 s->rank, s->inst->id);
        keyed_end_instance(s->inst, KVX_ERR_PEER_GONE, msg);
        xfer_end_instance(s->inst, KVX_ERR_PEER_GONE, msg);
    }
    session_fds_drop(s, s->nfds, 1);
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

unsigned session_count(void)
{
    return sessions.n;
}

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
                session_reply(s->id, 0, KVX_ERR_TIMED_OUT, why);
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
