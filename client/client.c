/*
 * client — libkvxfer: blocking calls over the daemon's Unix socket; see
 * kvxfer.h. Never logs, never aborts, never raises SIGPIPE.
 *
 * One request is outstanding at a time: call() sends a Request and reads
 * frames until the Reply with the same id arrives or the timeout passes.
 * A timed-out call leaves the connection unusable (a late reply would be
 * taken for the next call's), so the client is closed for further use.
 * A connection the daemon closed is reconnect.c's: it ends the requests
 * in flight and connects again at the next calls.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client.h"
#include "common/frame.h"
#include "internal.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"
#include "common/list.h"
#include "common/reqkey.h"

#define REPLY_MAX (1u << 30)
/* the most limits.max_frame_bytes can be: a larger request could never
 * be taken (and past 4 GiB its length would not fit the frame header) */
#define REQUEST_MAX (1u << 30)

struct host_pool {
    uint32_t id;
    void *base;
    uint64_t size;
    list_t node; /* on kvx_client.pools */
};

#define HOST_POOL(n) LIST_OWNER(n, struct host_pool, node)

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t now_ms(void)
{
    return now_us() / 1000;
}

int64_t kvx__now_ms(void)
{
    return now_ms();
}

static int fail(kvx_client_t *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The message of the last connect that failed on this thread, for
 * kvx_last_error(NULL): the client it happened on is gone. */
static __thread char connect_err[512];

/* "ENOENT (No such file or directory)": the errno's name with its text,
 * so a message says exactly what the kernel said. */
static const char *errno_str(int e)
{
    static __thread char buf[128];
    const char *name = strerrorname_np(e);
    snprintf(buf, sizeof(buf), "%s (%s)", name ? name : "E?", strerror(e));
    return buf;
}

static int fail(kvx_client_t *c, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof(c->err), fmt, ap);
    va_end(ap);
    return rc;
}

int kvx__fail(kvx_client_t *c, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof(c->err), fmt, ap);
    va_end(ap);
    return rc;
}

/* Wait until fd is ready for events or the deadline (-1 = none) passes. */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int t = -1;
        if (deadline >= 0) { /* past it: one last look, without waiting */
            int64_t left = deadline - now_ms();
            t = left <= 0 ? 0 : left > 1000000 ? 1000000 : (int)left;
        }
        struct pollfd p = {fd, events, 0};
        int n = poll(&p, 1, t);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return KVX_ERR_IO;
        if (n == 0 && t == 0)
            return KVX_ERR_TIMEOUT;
    }
}

/* Look for fd readable for up to spin_us without sleeping: 1 if it is.
 * A thread woken from poll() after a sleep pays tens of microseconds (an
 * interrupt, the scheduler, on a VM the hypervisor) where a reply is
 * often there a few microseconds after it was asked for. */
static int spin_readable(int fd, uint32_t spin_us, int64_t deadline)
{
    int64_t t0 = now_us();
    int64_t end = t0 + spin_us;
    if (deadline >= 0 && deadline * 1000 < end) /* not past the call's */
        end = deadline * 1000;
    for (;;) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 0) > 0)
            return 1;
        if (now_us() >= end)
            return 0;
        /* a socket's wake-up may put the daemon's thread on this CPU:
         * let it run rather than spin against it until a time slice
         * ends (the daemon's polling loop yields likewise; 2-CPU VM,
         * one-block requests alone: p99 137-160 us unyielding, 54-84
         * yielding) */
        sched_yield();
    }
}

/* fds travel in batches, each with the first byte of its own piece of
 * the frame: the daemon's receive buffer holds a batch, and a stream
 * socket never merges two sends' fds into one receive. */
#define FDS_PER_SEND FRAME_FDS_PER_SEND

static int send_all(kvx_client_t *c, const uint8_t *buf, size_t len,
                    const int *fds, int nfds, int64_t deadline)
{
    size_t off = 0;
    int nb = (nfds + FDS_PER_SEND - 1) / FDS_PER_SEND, next = 0;
    if ((size_t)nb > len) /* an empty piece would drop its fds */
        return fail(c, KVX_ERR_LIMIT,
                    "%d fds for a frame of %zu bytes: too many", nfds, len);
    while (off < len) {
        /* piece b is [b * len / nb, (b + 1) * len / nb); its fds go with
         * its first byte (len >= nb: a frame holds more bytes than
         * batches) */
        size_t end = len;
        int with = 0;
        if (next < nb) {
            size_t start = (size_t)next * len / (size_t)nb;
            if (off == start) {
                with = nfds - next * FDS_PER_SEND;
                if (with > FDS_PER_SEND)
                    with = FDS_PER_SEND;
            }
            end = with ? (size_t)(next + 1) * len / (size_t)nb : start;
        }
        struct iovec iov = {(void *)(buf + off), end - off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        union {
            char b[CMSG_SPACE(FDS_PER_SEND * sizeof(int))];
            struct cmsghdr align;
        } cm;
        if (with) {
            mh.msg_control = cm.b;
            mh.msg_controllen = CMSG_SPACE(with * sizeof(int));
            struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
            h->cmsg_level = SOL_SOCKET;
            h->cmsg_type = SCM_RIGHTS;
            h->cmsg_len = CMSG_LEN(with * sizeof(int));
            memcpy(CMSG_DATA(h), fds + next * FDS_PER_SEND, with * sizeof(int));
        }
        ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = wait_fd(c->fd, POLLOUT, deadline);
                if (rc)
                    return fail(c, rc, "send: %s",
                                rc == KVX_ERR_TIMEOUT ? "timed out"
                                                      : errno_str(errno));
                continue;
            }
            if (errno == EPIPE || errno == ECONNRESET)
                c->eof = 1;
            return fail(c, c->eof ? KVX_ERR_CLOSED : KVX_ERR_IO, "send: %s",
                        errno_str(errno));
        }
        if (with) /* sent with the first byte, whatever else went */
            next++;
        off += (size_t)n;
    }
    return 0;
}

/* The next reply frame, whichever request it answers; the socket is
 * looked at without sleeping for spin_us first (kvx_set_spin_us). */
static int recv_any(kvx_client_t *c, int64_t deadline, uint32_t spin_us,
                    Kvxfer__Reply **out)
{
    for (;;) {
        const uint8_t *msg;
        uint32_t len;
        int rc = frame_reader_next(&c->rd, REPLY_MAX, &msg, &len);
        if (rc < 0)
            return fail(c, KVX_ERR_PROTOCOL, "reply of %u bytes is too large",
                        len);
        if (rc == 1) {
            if (!(*out = kvxfer__reply__unpack(NULL, len, msg)))
                return fail(c, KVX_ERR_PROTOCOL, "undecodable reply");
            return 0;
        }
        /* the reply is rarely there yet: look for it for the spin, else
         * sleep until it comes; then read */
        if (!(spin_us && spin_readable(c->fd, spin_us, deadline)) &&
            (rc = wait_fd(c->fd, POLLIN, deadline)))
            return fail(c, rc, "no reply from the daemon: %s",
                        rc == KVX_ERR_TIMEOUT ? "timed out" : "poll failed");
        size_t room;
        uint8_t *buf = frame_reader_space(&c->rd, 65536, &room);
        if (!buf)
            return fail(c, KVX_ERR_NOMEM, "out of memory");
        ssize_t n = recv(c->fd, buf, room, MSG_DONTWAIT);
        if (n > 0) {
            frame_reader_commit(&c->rd, (size_t)n);
            continue;
        }
        if (n == 0) {
            c->eof = 1;
            return fail(c, KVX_ERR_CLOSED, "the daemon closed the connection");
        }
        if (errno == EINTR)
            continue;
        if (errno == ECONNRESET)
            c->eof = 1;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return fail(c, c->eof ? KVX_ERR_CLOSED : KVX_ERR_IO, "recv: %s",
                        errno_str(errno));
    }
}

/* Read frames until the reply to id; *out is unpacked (caller frees). */
static int recv_reply(kvx_client_t *c, uint64_t id, int64_t deadline,
                      uint32_t spin_us, Kvxfer__Reply **out)
{
    for (;;) {
        Kvxfer__Reply *r;
        int rc = recv_any(c, deadline, spin_us, &r);
        if (rc)
            return rc;
        if (r->id == id || r->id == 0) {
            /* id 0: the daemon could not tell which request */
            *out = r;
            return 0;
        }
        kvxfer__reply__free_unpacked(r, NULL); /* stale: skip */
    }
}

/* A send failed (the daemon closed): if it said why first (a refused
 * connection: one Reply with id 0, limits.max_sessions or the uid
 * lists), that is the error, not the broken pipe. */
static int refusal_after(kvx_client_t *c, int rc)
{
    char save[sizeof(c->err)];
    memcpy(save, c->err, sizeof(save));
    Kvxfer__Reply *r = NULL;
    if (recv_reply(c, 0, now_ms(), 0, &r) == 0 && r->id == 0 && r->status < 0 &&
        r->status >= KVX_ERR_LAST) {
        rc = r->status;
        snprintf(c->err, sizeof(c->err), "%s", r->message);
        /* closed on purpose, and said why: a refusal, not a daemon that
         * went away (nothing to reconnect to) */
        c->eof = 0;
    } else {
        memcpy(c->err, save, sizeof(save));
    }
    if (r)
        kvxfer__reply__free_unpacked(r, NULL);
    return rc;
}

/* Before a call: 0, or why none can be made (nothing is sent, and the
 * connection stays usable unless it was broken already). A connection
 * the daemon closed is made again here first (deadline: the call's). */
static int call_ready(kvx_client_t *c, int timeout_ms, int64_t deadline)
{
    c->err[0] = 0;
    if (c->broken)
        return kvx__closed(c);
    if (timeout_ms == 0)
        return fail(c, KVX_ERR_INVALID,
                    "timeout_ms 0: a call waits for the daemon's reply; "
                    "give it time (a negative value waits without limit)");
    if (c->rv.gone && !c->rv.reviving) {
        int rc = kvx__revive(c, deadline);
        if (rc)
            return rc;
        if (deadline >= 0 && now_ms() >= deadline)
            return fail(c, KVX_ERR_TIMEOUT,
                        "connected to kvxferd again, but the call's timeout "
                        "passed doing it; nothing was sent");
    }
    return 0;
}

/* A call failed mid-way: the daemon closed the connection (reconnect.c
 * takes it from here: the call returns KVX_ERR_CLOSED), or the connection
 * is unusable. Inside a reconnection attempt the attempt decides. */
static int conn_failed(kvx_client_t *c, int rc)
{
    if (c->rv.reviving)
        return rc;
    if (c->eof) {
        kvx__lost(c);
        return KVX_ERR_CLOSED;
    }
    c->broken = 1;
    return rc;
}

/* The frames of rq[0, n) in one buffer (*buf, *len; caller frees), their
 * ids set here, consecutive from c->next_id + 1. */
static int pack_frames(kvx_client_t *c, Kvxfer__Request *rq, size_t n,
                       uint8_t **buf, size_t *len)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        rq[i].id = ++c->next_id; /* before the size: the id is a varint */
        size_t m = kvxfer__request__get_packed_size(&rq[i]);
        if (m > REQUEST_MAX)
            return fail(c, KVX_ERR_LIMIT,
                        "request of %zu bytes: larger than the %u bytes a "
                        "frame may hold",
                        m, REQUEST_MAX);
        total += m + FRAME_HDR;
    }
    uint8_t *at = *buf = malloc(total ? total : 1);
    if (!at)
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        size_t m = kvxfer__request__pack(&rq[i], at + FRAME_HDR);
        frame_put_len(at, (uint32_t)m);
        at += m + FRAME_HDR;
    }
    *len = total;
    return 0;
}

/* A reply's status as the library returns it: a code it does not know
 * (or a positive one) is the daemon breaking the protocol. */
static int reply_code(int32_t status)
{
    return status > 0 || status < KVX_ERR_LAST ? KVX_ERR_PROTOCOL : status;
}

/* Send rq (its id is set here) with nfds fds and wait for its reply.
 * Returns the daemon's status; *out (if not NULL) receives the reply on
 * success. */
/* One request and its reply, the reply looked for spin_us before the
 * thread sleeps. */
static int call_spin(kvx_client_t *c, Kvxfer__Request *rq, const int *fds,
                     int nfds, int timeout_ms, uint32_t spin_us,
                     Kvxfer__Reply **out)
{
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    int rc = call_ready(c, timeout_ms, deadline);
    if (rc)
        return rc;
    uint8_t *buf;
    size_t len;
    if ((rc = pack_frames(c, rq, 1, &buf, &len)))
        return rc;
    rc = send_all(c, buf, len, fds, nfds, deadline);
    free(buf);
    if (rc == KVX_ERR_CLOSED || rc == KVX_ERR_IO)
        rc = refusal_after(c, rc);
    Kvxfer__Reply *r = NULL;
    if (!rc)
        rc = recv_reply(c, rq->id, deadline, spin_us, &r);
    if (rc)
        return conn_failed(c, rc);
    if (r->status) {
        rc = reply_code(r->status);
        snprintf(c->err, sizeof(c->err), "%s", r->message);
        kvxfer__reply__free_unpacked(r, NULL);
        if (rc == KVX_ERR_PROTOCOL && !c->rv.reviving)
            c->broken = 1; /* the daemon closes after protocol errors */
        return rc;
    }
    if (out)
        *out = r;
    else
        kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

/* call_spin() with the client's spin. */
static int call_fds(kvx_client_t *c, Kvxfer__Request *rq, const int *fds,
                    int nfds, int timeout_ms, Kvxfer__Reply **out)
{
    return call_spin(c, rq, fds, nfds, timeout_ms, c->spin_us, out);
}

/* call_fds() with one fd (fd_to_pass >= 0) or none. */
static int call(kvx_client_t *c, Kvxfer__Request *rq, int fd_to_pass,
                int timeout_ms, Kvxfer__Reply **out)
{
    return call_fds(c, rq, &fd_to_pass, fd_to_pass >= 0, timeout_ms, out);
}

static void replies_free(Kvxfer__Reply **rp, size_t n)
{
    for (size_t i = 0; rp && i < n; i++)
        if (rp[i])
            kvxfer__reply__free_unpacked(rp[i], NULL);
    free(rp);
}

/* rq[0, n) in one write, then their n replies, in whatever order they
 * come: (*out)[i] answers rq[i] (its status may be a refusal; free them
 * with replies_free()). 0 when the exchange worked; else no reply is
 * kept and, once anything was sent, the connection is broken. */
static int call_many(kvx_client_t *c, Kvxfer__Request *rq, size_t n,
                     int timeout_ms, Kvxfer__Reply ***out)
{
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    int rc = call_ready(c, timeout_ms, deadline);
    if (rc)
        return rc;
    Kvxfer__Reply **rp = calloc(n ? n : 1, sizeof(*rp));
    uint8_t *buf = NULL;
    size_t len;
    if (!rp)
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    if ((rc = pack_frames(c, rq, n, &buf, &len))) {
        free(rp);
        return rc;
    }
    uint64_t base = rq[0].id;
    rc = send_all(c, buf, len, NULL, 0, deadline);
    free(buf);
    if (rc == KVX_ERR_CLOSED || rc == KVX_ERR_IO)
        rc = refusal_after(c, rc);
    for (size_t got = 0; !rc && got < n;) {
        Kvxfer__Reply *r;
        if ((rc = recv_any(c, deadline, c->spin_us, &r)))
            break;
        if (r->id == 0) { /* the daemon could not tell which: it closes */
            rc = r->status ? reply_code(r->status) : KVX_ERR_PROTOCOL;
            snprintf(c->err, sizeof(c->err), "%s", r->message);
            kvxfer__reply__free_unpacked(r, NULL);
            break;
        }
        if (r->id < base || r->id - base >= n || rp[r->id - base]) {
            kvxfer__reply__free_unpacked(r, NULL); /* stale: skip */
            continue;
        }
        rp[r->id - base] = r;
        got++;
    }
    if (rc) {
        replies_free(rp, n);
        return conn_failed(c, rc);
    }
    *out = rp;
    return 0;
}

/* Item i's reply: its status; the first failing item's message, naming
 * it, becomes the call's error. */
static int item_status(kvx_client_t *c, const char *fn, size_t i,
                       const void *key, size_t key_len, const Kvxfer__Reply *r,
                       int *first_rc)
{
    int rc = r->status ? reply_code(r->status) : 0;
    if (rc && !*first_rc) {
        char k[REQKEY_STR_MAX];
        *first_rc = rc;
        snprintf(c->err, sizeof(c->err), "%s: item %zu (key %s): %s", fn, i,
                 reqkey_str(key, key_len, k), r->message);
    }
    return rc;
}

static int key_arg(kvx_client_t *c, const char *fn, const void *key,
                   size_t key_len);

/* An item's arguments, before anything is sent: 0, or KVX_ERR_INVALID
 * naming the item. */
static int item_arg(kvx_client_t *c, const char *fn, size_t i, const void *key,
                    size_t key_len, const uint32_t *blocks, uint32_t nblocks,
                    const void *params, size_t params_len)
{
    char what[48];
    snprintf(what, sizeof(what), "%s: item %zu", fn, i);
    int rc = key_arg(c, what, key, key_len);
    if (!rc && !blocks && nblocks)
        rc = fail(c, KVX_ERR_INVALID, "%s: blocks is NULL with %u blocks", what,
                  nblocks);
    if (!rc && !params && params_len)
        rc = fail(c, KVX_ERR_INVALID, "%s: params is NULL with %zu bytes", what,
                  params_len);
    return rc;
}

static int open_socket(kvx_client_t *c, const char *path, int timeout_ms)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (!path)
        path = KVX_DEFAULT_SOCKET;
    if (strlen(path) >= sizeof(sa.sun_path))
        return fail(c, KVX_ERR_INVALID, "socket path longer than %zu bytes",
                    sizeof(sa.sun_path) - 1);
    strcpy(sa.sun_path, path);
    if (path != c->path)
        snprintf(c->path, sizeof(c->path), "%s", path);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (c->fd < 0)
        return fail(c, KVX_ERR_IO, "socket: %s", errno_str(errno));
    /* A Unix socket connects at once or not at all: EAGAIN means the
     * daemon's listen backlog is full (its loop is busy or stopped), and
     * the socket is left unconnected. Ask again until the deadline. */
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    while (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN) {
            int e = errno;
            const char *hint =
                e == ENOENT         ? ": no such socket; is kvxferd running, "
                                      "and is this its socket.path?"
                : e == ECONNREFUSED ? ": nothing listens there (kvxferd "
                                      "stopped and left its socket file)"
                : e == EACCES || e == EPERM
                    ? ": this user may not write to the socket (its "
                      "socket.mode and socket.group) or search its "
                      "directory"
                    : "";
            return fail(c,
                        e == EACCES || e == EPERM ? KVX_ERR_PERM : KVX_ERR_IO,
                        "connect %s: %s%s", path, errno_str(e), hint);
        }
        if (deadline >= 0 && now_ms() >= deadline)
            return fail(c, KVX_ERR_TIMEOUT,
                        "connect %s: timed out (the daemon accepts no more "
                        "connections: its backlog is full)",
                        path);
        usleep(2000);
    }
    return 0;
}

int kvx__open(kvx_client_t *c, int timeout_ms)
{
    return open_socket(c, c->path, timeout_ms);
}

void kvx__shut(kvx_client_t *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    frame_reader_cleanup(&c->rd);
    frame_reader_init(&c->rd);
}

/* After an early answer (Poll.early) the poll is spun for this long
 * before it sleeps: the event is one copy away (a layer: up to a few
 * hundred microseconds; a whole request's last chunk: milliseconds). */
#define KVX_EARLY_SPIN_US 20000

/* KVXFER_SPIN_US, else 50 us. The spin yields its CPU at each look
 * (spin_readable()), so on a machine of few CPUs the daemon's thread
 * that answers, placed on the same CPU, is not held up by it. */
static uint32_t spin_default(void)
{
    const char *e = getenv("KVXFER_SPIN_US");
    if (e && *e) {
        char *end;
        unsigned long v = strtoul(e, &end, 10);
        if (!*end && v <= KVX_SPIN_US_MAX)
            return (uint32_t)v;
    }
    return 50;
}

static kvx_client_t *client_new(void)
{
    kvx_client_t *c = calloc(1, sizeof(*c));
    if (c) {
        c->fd = -1;
        c->spin_us = spin_default();
        list_init(&c->pools);
        frame_reader_init(&c->rd);
        kvx__rv_init(c);
    }
    return c;
}

int kvx_hello(kvx_client_t *c, const kvx_hello_t *h, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!h || !h->instance_id)
        return fail(c, KVX_ERR_INVALID,
                    "%s: a required argument is NULL or 0",
                    __func__);
    int rc = kvx__hello_send(c, h, timeout_ms);
    /* a daemon that restarts hears it again (reconnect.c) */
    return rc ? rc : kvx__hello_keep(c, h);
}

int kvx__hello_send(kvx_client_t *c, const kvx_hello_t *h, int timeout_ms)
{
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    pc.tp = h->parallel.tp;
    pc.pp = h->parallel.pp;
    pc.cp = h->parallel.cp;
    pc.total_layers = h->parallel.total_layers;
    pc.total_kv_heads = h->parallel.total_kv_heads;
    /* NULL means an even split, whatever the count says */
    pc.n_layers_per_pp =
        h->parallel.layers_per_pp ? h->parallel.num_layers_per_pp : 0;
    pc.layers_per_pp = (uint32_t *)h->parallel.layers_per_pp;
    pc.attention_dp = h->parallel.attention_dp;
    Kvxfer__Hello m = KVXFER__HELLO__INIT;
    m.version_major = h->version_major ? h->version_major : KVX_VERSION_MAJOR;
    m.version_minor = h->version_major ? h->version_minor : KVX_VERSION_MINOR;
    m.instance_id = (char *)h->instance_id;
    m.role = (Kvxfer__Role)h->role;
    m.rank = h->rank;
    m.parallel = &pc;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_HELLO;
    rq.hello = &m;
    Kvxfer__Reply *r;
    int rc = call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_HELLO) {
        kvxfer__reply__free_unpacked(r, NULL);
        return fail(c, KVX_ERR_PROTOCOL, "hello: reply without HelloReply");
    }
    snprintf(c->address, sizeof(c->address), "%s", r->hello->daemon_address);
    c->daemon_minor = r->hello->version_minor;
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

int kvx_connect(const char *socket_path, const kvx_hello_t *h, int timeout_ms,
                kvx_client_t **out)
{
    if (!h || !out || !h->instance_id)
        return KVX_ERR_INVALID;
    kvx_client_t *c;
    int64_t t0 = now_ms();
    int rc = kvx_connect_observer(socket_path, timeout_ms, &c);
    if (rc)
        return rc;
    /* one deadline for both halves */
    int64_t left = timeout_ms - (now_ms() - t0);
    if ((rc = kvx_hello(c, h,
                        timeout_ms < 0 ? timeout_ms
                        : left < 1     ? 1
                                       : (int)left))) {
        snprintf(connect_err, sizeof(connect_err), "%s", c->err);
        kvx_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

int kvx_connect_observer(const char *socket_path, int timeout_ms,
                         kvx_client_t **out)
{
    if (!out)
        return KVX_ERR_INVALID;
    kvx_client_t *c = client_new();
    if (!c)
        return KVX_ERR_NOMEM;
    int rc = open_socket(c, socket_path, timeout_ms);
    if (rc) {
        snprintf(connect_err, sizeof(connect_err), "%s", c->err);
        kvx_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

void kvx_close(kvx_client_t *c)
{
    if (!c)
        return;
    if (c->fd >= 0)
        close(c->fd);
    list_t *n;
    while ((n = list_pop(&c->pools))) {
        munmap(HOST_POOL(n)->base, HOST_POOL(n)->size);
        free(HOST_POOL(n));
    }
    frame_reader_cleanup(&c->rd);
    kvx__rv_cleanup(c);
    free(c);
}

int kvx_set_spin_us(kvx_client_t *c, uint32_t spin_us)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (spin_us > KVX_SPIN_US_MAX)
        return fail(c, KVX_ERR_INVALID,
                    "kvx_set_spin_us: %u us, at most %u (a longer wait "
                    "sleeps on the socket)",
                    spin_us, KVX_SPIN_US_MAX);
    c->spin_us = spin_us;
    return 0;
}

const char *kvx_last_error(const kvx_client_t *c)
{
    return c ? c->err : connect_err;
}

int kvx_daemon_address(const kvx_client_t *c, char *buf, size_t len)
{
    if (!c || !buf || !c->address[0])
        return KVX_ERR_INVALID;
    if (strlen(c->address) >= len)
        return KVX_ERR_LIMIT;
    strcpy(buf, c->address);
    return 0;
}

int kvx_join(kvx_client_t *c, const char *const *addr, uint32_t n,
             int timeout_ms)
{
    return kvx_join_consumers(c, addr, n, NULL, 0, timeout_ms);
}

int kvx_join_consumers(kvx_client_t *c, const char *const *addr, uint32_t n,
                       const char *const *consumers, uint32_t ncons,
                       int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (ncons && !consumers)
        return fail(c, KVX_ERR_INVALID, "%s: consumers is NULL", __func__);
    for (uint32_t i = 0; i < ncons; i++)
        if (!consumers[i] || !consumers[i][0])
            return fail(c, KVX_ERR_INVALID,
                        "%s: consumers[%u] is NULL or empty", __func__, i);
    if (!addr)
        return fail(c, KVX_ERR_INVALID,
                    "%s: a required argument is NULL or 0",
                    __func__);
    for (uint32_t i = 0; i < n; i++)
        if (!addr[i])
            return fail(c, KVX_ERR_INVALID,
                        "%s: rank_addresses[%u] is NULL", __func__, i);
    int rc = kvx__join_send(c, (char **)addr, n, (char **)consumers, ncons,
                            timeout_ms);
    return rc ? rc : kvx__join_keep(c, addr, n, consumers, ncons);
}

int kvx__join_send(kvx_client_t *c, char **addr, uint32_t n, char **consumers,
                   uint32_t ncons, int timeout_ms)
{
    Kvxfer__Join m = KVXFER__JOIN__INIT;
    m.n_rank_addresses = n;
    m.rank_addresses = addr;
    m.n_consumers = ncons;
    m.consumers = consumers;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_JOIN;
    rq.join = &m;
    return call(c, &rq, -1, timeout_ms, NULL);
}

/* The Layout message of l; its part lists (malloc'd) are freed with
 * layout_msg_free(). 0, or KVX_ERR_NOMEM / KVX_ERR_INVALID. */
static int layout_to_msg(kvx_client_t *c, const kvx_layout_t *l,
                         Kvxfer__Layout *lay)
{
    kvxfer__layout__init(lay);
    lay->preset = (char *)l->preset;
    lay->num_layers = l->num_layers;
    lay->kv_factor = l->kv_factor;
    lay->num_heads = l->num_heads;
    lay->head_dim = l->head_dim;
    lay->elem_size = l->elem_size;
    lay->dtype = l->dtype;
    lay->tokens_per_block = l->tokens_per_block;
    lay->num_blocks = l->num_blocks;
    lay->layer_stride = l->layer_stride;
    lay->kv_stride = l->kv_stride;
    lay->block_stride = l->block_stride;
    lay->token_stride = l->token_stride;
    lay->head_stride = l->head_stride;
    lay->first_head = l->first_head;
    if (!l->parts)
        return 0;
    /* what the daemon checks too; here so that the copy is bounded */
    if (l->num_parts == 0 || l->num_parts > 2 * KVX_MAX_LAYERS)
        return fail(c, KVX_ERR_LAYOUT,
                    "layout.num_parts: %u (expected num_layers x kv_factor, "
                    "at most %u)",
                    l->num_parts, 2 * KVX_MAX_LAYERS);
    lay->part_region = malloc(l->num_parts * sizeof(uint32_t));
    lay->part_offset = malloc(l->num_parts * sizeof(uint64_t));
    if (!lay->part_region || !lay->part_offset) {
        free(lay->part_region);
        free(lay->part_offset);
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    for (uint32_t i = 0; i < l->num_parts; i++) {
        lay->part_region[i] = l->parts[i].region;
        lay->part_offset[i] = l->parts[i].offset;
    }
    lay->n_part_region = lay->n_part_offset = l->num_parts;
    return 0;
}

static void layout_msg_free(Kvxfer__Layout *lay)
{
    free(lay->part_region);
    free(lay->part_offset);
}

/* Send RegisterPool m with nfds fds and take the pool id: the engine's,
 * which outlives a daemon restart (reconnect.c keeps what registers the
 * pool again and maps the id). */
static int register_pool(kvx_client_t *c, Kvxfer__RegisterPool *m,
                         const int *fds, int nfds, int timeout_ms,
                         uint32_t *pool_id)
{
    uint32_t id;
    int rc = kvx__register_send(c, m, fds, nfds, timeout_ms, &id);
    if (rc)
        return rc;
    if ((rc = kvx__pool_keep(c, m, fds, nfds, id, pool_id))) {
        /* a pool that could not be registered again is not registered */
        char why[sizeof(c->err)];
        memcpy(why, c->err, sizeof(why));
        Kvxfer__DeregisterPool d = KVXFER__DEREGISTER_POOL__INIT;
        d.pool_id = id;
        Kvxfer__Request rq = KVXFER__REQUEST__INIT;
        rq.body_case = KVXFER__REQUEST__BODY_DEREGISTER_POOL;
        rq.deregister_pool = &d;
        call(c, &rq, -1, timeout_ms, NULL);
        memcpy(c->err, why, sizeof(why));
    }
    return rc;
}

int kvx__register_send(kvx_client_t *c, Kvxfer__RegisterPool *m, const int *fds,
                       int nfds, int timeout_ms, uint32_t *pool_id)
{
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_REGISTER_POOL;
    rq.register_pool = m;
    Kvxfer__Reply *r;
    int rc = call_fds(c, &rq, fds, nfds, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_REGISTER_POOL) {
        kvxfer__reply__free_unpacked(r, NULL);
        return fail(c, KVX_ERR_PROTOCOL,
                    "register_pool: reply without a "
                    "pool id");
    }
    *pool_id = r->register_pool->pool_id;
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

/* A RegisterPool being built: its allocations and regions (messages and
 * the arrays of pointers protobuf-c wants), the fds to send. */
struct pool_msg {
    Kvxfer__RegisterPool m;
    Kvxfer__Layout lay;
    Kvxfer__Allocation *allocs, **allocs_p;
    Kvxfer__Region *regions, **regions_p;
    int *fds;
    int nfds;
    /* GPU: per allocation, the VMM chunk sizes (malloc'd) */
    uint64_t **chunks;
    uint8_t (*uuid)[16];
    uint8_t (*ipc)[64];
};

static int pool_msg_init(kvx_client_t *c, struct pool_msg *pm,
                         const kvx_layout_t *l, uint32_t nallocs,
                         uint32_t nregions, int gpu)
{
    memset(pm, 0, sizeof(*pm));
    kvxfer__register_pool__init(&pm->m);
    int rc = layout_to_msg(c, l, &pm->lay);
    if (rc)
        return rc;
    pm->m.layout = &pm->lay;
    pm->allocs = calloc(nallocs, sizeof(*pm->allocs));
    pm->allocs_p = calloc(nallocs, sizeof(*pm->allocs_p));
    pm->regions = calloc(nregions, sizeof(*pm->regions));
    pm->regions_p = calloc(nregions, sizeof(*pm->regions_p));
    pm->fds = gpu ? NULL : calloc(nallocs, sizeof(*pm->fds));
    pm->chunks = gpu ? calloc(nallocs, sizeof(*pm->chunks)) : NULL;
    pm->uuid = gpu ? calloc(nallocs, sizeof(*pm->uuid)) : NULL;
    pm->ipc = gpu ? calloc(nallocs, sizeof(*pm->ipc)) : NULL;
    if (!pm->allocs || !pm->allocs_p || !pm->regions || !pm->regions_p ||
        (gpu ? !pm->chunks || !pm->uuid || !pm->ipc : !pm->fds))
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    for (uint32_t i = 0; i < nallocs; i++) {
        kvxfer__allocation__init(&pm->allocs[i]);
        pm->allocs_p[i] = &pm->allocs[i];
    }
    for (uint32_t i = 0; i < nregions; i++) {
        kvxfer__region__init(&pm->regions[i]);
        pm->regions_p[i] = &pm->regions[i];
    }
    pm->m.allocations = pm->allocs_p;
    pm->m.regions = pm->regions_p;
    pm->m.n_regions = nregions;
    return 0;
}

/* gpu: the fds are the library's own (exported), closed here. */
static void pool_msg_free(struct pool_msg *pm, int gpu)
{
    layout_msg_free(&pm->lay);
    if (gpu)
        for (int i = 0; i < pm->nfds; i++)
            close(pm->fds[i]);
    for (size_t i = 0; pm->chunks && i < pm->m.n_allocations; i++)
        free(pm->chunks[i]);
    free(pm->allocs);
    free(pm->allocs_p);
    free(pm->regions);
    free(pm->regions_p);
    free(pm->fds);
    free(pm->chunks);
    free(pm->uuid);
    free(pm->ipc);
}

int kvx_pool_register_host_regions(kvx_client_t *c, const kvx_layout_t *l,
                                   const kvx_host_region_t *r, uint32_t n,
                                   uint32_t *pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !r || !pool_id || !n)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    __func__);
    if (n > KVX_MAX_REGIONS)
        return fail(c, KVX_ERR_LIMIT,
                    "%s: %u regions (at most %u, KVX_MAX_REGIONS)", __func__, n,
                    KVX_MAX_REGIONS);
    struct pool_msg pm;
    uint64_t(*ino)[2] = calloc(n, sizeof(*ino));
    int rc = ino ? pool_msg_init(c, &pm, l, n, n, 0)
                 : fail(c, KVX_ERR_NOMEM, "out of memory");
    /* one allocation per memfd, however many regions lie in it (and
     * however many fds name it): the daemon refuses a file listed twice */
    uint32_t na = 0;
    for (uint32_t i = 0; !rc && i < n; i++) {
        struct stat st;
        if (r[i].fd < 0 || fstat(r[i].fd, &st) < 0) {
            rc = fail(c, KVX_ERR_INVALID, "regions[%u].fd: %d: %s", i, r[i].fd,
                      r[i].fd < 0 ? "negative" : errno_str(errno));
            break;
        }
        uint32_t a = 0;
        while (a < na && !(ino[a][0] == (uint64_t)st.st_dev &&
                           ino[a][1] == (uint64_t)st.st_ino))
            a++;
        if (a == na) {
            ino[na][0] = (uint64_t)st.st_dev;
            ino[na][1] = (uint64_t)st.st_ino;
            pm.allocs[na].kind = KVXFER__POOL_KIND__POOL_HOST_MEMFD;
            pm.fds[na++] = r[i].fd;
        }
        pm.regions[i].allocation = a;
        pm.regions[i].offset = r[i].offset;
        pm.regions[i].size = r[i].size;
    }
    if (!rc) {
        pm.m.n_allocations = na;
        rc = register_pool(c, &pm.m, pm.fds, (int)na, timeout_ms, pool_id);
    }
    if (ino)
        pool_msg_free(&pm, 0);
    free(ino);
    return rc;
}

int kvx_pool_register_host(kvx_client_t *c, const kvx_layout_t *l, int fd,
                           uint64_t offset, uint64_t size, uint32_t *pool_id,
                           int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || fd < 0 || !pool_id || !size)
        return fail(c, KVX_ERR_INVALID,
                    "%s: a required argument is NULL, negative or 0", __func__);
    kvx_host_region_t r = {fd, offset, size};
    return kvx_pool_register_host_regions(c, l, &r, 1, pool_id, timeout_ms);
}

int kvx_pool_create_host(kvx_client_t *c, const kvx_layout_t *l,
                         uint64_t size, void **base, uint32_t *pool_id,
                         int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !base || !pool_id || !size)
        return fail(c, KVX_ERR_INVALID,
                    "%s: a required argument is NULL or 0",
                    __func__);
    struct host_pool *hp = calloc(1, sizeof(*hp));
    if (!hp)
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    int rc;
    int fd = memfd_create("kvxfer-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        rc = fail(c, KVX_ERR_IO, "memfd_create: %s", errno_str(errno));
        goto err_free;
    }
    if (ftruncate(fd, (off_t)size) < 0) {
        rc = fail(c, KVX_ERR_NOMEM, "ftruncate %llu: %s",
                  (unsigned long long)size, errno_str(errno));
        goto err_close_fd;
    }
    /* its pages allocated here, charged to this process: the daemon
     * charges a pool's holes to its budget (its copies would fault them
     * in, charged to the daemon) */
    if (fallocate(fd, 0, 0, (off_t)size) < 0) {
        rc = fail(c, KVX_ERR_NOMEM, "fallocate %llu: %s",
                  (unsigned long long)size, errno_str(errno));
        goto err_close_fd;
    }
    /* sealed size: the daemon refuses a pool that could shrink under it */
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) <
        0) {
        rc = fail(c, KVX_ERR_IO, "F_ADD_SEALS: %s", errno_str(errno));
        goto err_close_fd;
    }
    hp->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (hp->base == MAP_FAILED) {
        rc = fail(c, KVX_ERR_NOMEM, "mmap %llu: %s", (unsigned long long)size,
                  errno_str(errno));
        goto err_close_fd;
    }
    hp->size = size;
    kvx_host_region_t r = {fd, 0, size};
    if ((rc = kvx_pool_register_host_regions(c, l, &r, 1, &hp->id, timeout_ms)))
        goto err_unmap;
    close(fd);
    list_unshift(&c->pools, &hp->node);
    *base = hp->base;
    *pool_id = hp->id;
    return 0;

err_unmap:
    munmap(hp->base, size);
err_close_fd:
    close(fd);
err_free:
    free(hp);
    return rc;
}

int kvx_pool_deregister(kvx_client_t *c, uint32_t pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    Kvxfer__DeregisterPool m = KVXFER__DEREGISTER_POOL__INIT;
    m.pool_id = kvx__pool_daemon(c, pool_id);
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_DEREGISTER_POOL;
    rq.deregister_pool = &m;
    int rc = call(c, &rq, -1, timeout_ms, NULL);
    /* with the daemon gone no daemon holds it: forgotten, done */
    if (rc && !(rc == KVX_ERR_CLOSED && c->rv.gone))
        return rc;
    kvx__pool_forget(c, pool_id);
    c->err[0] = 0;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &c->pools)
    {
        struct host_pool *hp = HOST_POOL(n);
        if (hp->id == pool_id) {
            list_remove(&hp->node);
            munmap(hp->base, hp->size);
            free(hp);
            break;
        }
    }
    return 0;
}

/* ---- GPU pools ----------------------------------------------------------
 * The library finds the allocation a device pointer lives in and shares it
 * with the daemon, through the CUDA driver the engine already loaded. It
 * opens libcuda.so.1 with dlopen, so host-only users never need CUDA. The
 * few driver types are declared here (ABI-stable since CUDA 11). */

typedef int cu_result;
typedef unsigned long long cu_ptr;
typedef unsigned long long cu_handle;
typedef struct {
    uint8_t b[16];
} cu_uuid;
typedef struct {
    uint8_t b[64];
} cu_ipc_handle;
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1

static struct {
    int loaded;
    cu_result (*ptr_attr)(void *, int, cu_ptr);
    cu_result (*dev_get)(int *, int);
    cu_result (*dev_uuid)(cu_uuid *, int);
    cu_result (*addr_range)(cu_ptr *, size_t *, cu_ptr);
    cu_result (*retain)(cu_handle *, void *);
    cu_result (*export_fd)(void *, cu_handle, int, unsigned long long);
    cu_result (*release)(cu_handle);
    cu_result (*ipc_get)(cu_ipc_handle *, cu_ptr);
} cu;

/* Once per process, whatever thread asks first (clients of several
 * threads may register GPU pools at once). */
static void cu_load_once(void);
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static int cu_load(void)
{
    pthread_once(&cu_once, cu_load_once);
    return cu.loaded > 0 ? 0 : -1;
}

static void cu_load_once(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        cu.loaded = -1;
        return;
    }
    cu.ptr_attr = (cu_result(*)(void *, int, cu_ptr))dlsym(h, "cuPointerGetAttribute");
    cu.dev_get = (cu_result(*)(int *, int))dlsym(h, "cuDeviceGet");
    cu.dev_uuid = (cu_result(*)(cu_uuid *, int))dlsym(h, "cuDeviceGetUuid_v2");
    if (!cu.dev_uuid)
        cu.dev_uuid = (cu_result(*)(cu_uuid *, int))dlsym(h, "cuDeviceGetUuid");
    cu.addr_range = (cu_result(*)(cu_ptr *, size_t *, cu_ptr))dlsym(h, "cuMemGetAddressRange_v2");
    cu.retain = (cu_result(*)(cu_handle *, void *))dlsym(h, "cuMemRetainAllocationHandle");
    cu.export_fd = (cu_result(*)(void *, cu_handle, int, unsigned long long))dlsym(h, "cuMemExportToShareableHandle");
    cu.release = (cu_result(*)(cu_handle))dlsym(h, "cuMemRelease");
    cu.ipc_get = (cu_result(*)(cu_ipc_handle *, cu_ptr))dlsym(h, "cuIpcGetMemHandle");
    cu.loaded = cu.ptr_attr && cu.dev_get && cu.dev_uuid && cu.addr_range &&
                cu.ipc_get ? 1 : -1;
}

/* Export the VMM allocations that cover [base, base + need): the one at
 * base (asize bytes) and those mapped right after it, as PyTorch's
 * expandable segments map theirs. *fds and *sizes (malloc'd, *n each)
 * in address order; on failure nothing is left open. */
static int vmm_export(kvx_client_t *c, cu_ptr base, size_t asize, uint64_t need,
                      int **fds, uint64_t **sizes, int *n)
{
    int *f = NULL, k = 0, cap = 0, rc = 0;
    uint64_t *sz = NULL, covered = 0;
    cu_ptr at = base;
    size_t len = asize;
    while (covered < need) {
        if (k == (int)KVX_MAX_POOL_CHUNKS) {
            rc = fail(c, KVX_ERR_LIMIT,
                      "GPU pool: spans more than %u VMM allocations",
                      KVX_MAX_POOL_CHUNKS);
            goto err_close;
        }
        if (k) { /* the next allocation must be mapped right here */
            cu_ptr b = 0;
            cu_result r = cu.addr_range(&b, &len, at);
            if (r || b != at) {
                rc = fail(c, KVX_ERR_INVALID,
                          "GPU pool: needs %llu bytes mapped from %p, but "
                          "the mapping ends at %p, %llu bytes in (nothing "
                          "mapped there)",
                          (unsigned long long)need, (void *)(uintptr_t)base,
                          (void *)(uintptr_t)at, (unsigned long long)covered);
                goto err_close;
            }
        }
        if (k == cap) {
            cap = cap ? cap * 2 : 4;
            int *nf = realloc(f, (size_t)cap * sizeof(*f));
            if (nf)
                f = nf;
            uint64_t *ns = nf ? realloc(sz, (size_t)cap * sizeof(*sz)) : NULL;
            if (ns)
                sz = ns;
            if (!nf || !ns) {
                rc = fail(c, KVX_ERR_NOMEM, "out of memory");
                goto err_close;
            }
        }
        cu_handle h;
        cu_result r = cu.retain(&h, (void *)(uintptr_t)at);
        if (r) {
            rc = fail(c, KVX_ERR_INVALID,
                      "GPU pool: the memory at %p, %llu bytes in, is not VMM "
                      "memory like the rest (CUresult %d)",
                      (void *)(uintptr_t)at, (unsigned long long)covered, r);
            goto err_close;
        }
        int fd = -1;
        r = cu.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        cu.release(h);
        if (r || fd < 0) {
            struct rlimit rl = {0};
            getrlimit(RLIMIT_NOFILE, &rl);
            rc = fail(c, KVX_ERR_UNSUPPORTED,
                      "GPU pool: exporting VMM allocation %d as a POSIX fd "
                      "failed (CUresult %d): it must be created with "
                      "requestedHandleTypes POSIX_FILE_DESCRIPTOR, and this "
                      "process needs one open fd per allocation (%d so far, "
                      "ulimit -n %llu)",
                      k, r, k, (unsigned long long)rl.rlim_cur);
            goto err_close;
        }
        fcntl(fd, F_SETFD, FD_CLOEXEC); /* not into a child another thread
                                           execs */
        f[k] = fd;
        sz[k] = len;
        k++;
        covered += len;
        at += len;
    }
    *fds = f;
    *sizes = sz;
    *n = k;
    return 0;

err_close:
    for (int i = 0; i < k; i++)
        close(f[i]);
    free(f);
    free(sz);
    return rc;
}

int kvx_pool_register_gpu_regions(kvx_client_t *c, const kvx_layout_t *l,
                                  const kvx_gpu_region_t *r, uint32_t n,
                                  uint32_t *pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !r || !pool_id || !n)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    __func__);
    if (n > KVX_MAX_REGIONS)
        return fail(c, KVX_ERR_LIMIT,
                    "%s: %u regions (at most %u, KVX_MAX_REGIONS)", __func__, n,
                    KVX_MAX_REGIONS);
    for (uint32_t i = 0; i < n; i++)
        if (!r[i].dev_ptr || !r[i].size)
            return fail(c, KVX_ERR_INVALID,
                        "regions[%u]: dev_ptr NULL or size 0", i);
    if (cu_load())
        return fail(c, KVX_ERR_UNSUPPORTED,
                    "GPU pool: cannot load libcuda.so.1 (no CUDA driver)");
    struct pool_msg pm;
    /* per allocation: its base, size and the end of the furthest region
     * in it (what must be exported of VMM memory) */
    struct {
        cu_ptr base;
        size_t asize;
        uint64_t need;
    } *al = calloc(n, sizeof(*al));
    int rc = al ? pool_msg_init(c, &pm, l, n, n, 1)
                : fail(c, KVX_ERR_NOMEM, "out of memory");
    uint32_t na = 0;
    for (uint32_t i = 0; !rc && i < n; i++) {
        cu_ptr p = (cu_ptr)(uintptr_t)r[i].dev_ptr, base = 0;
        size_t asize = 0;
        int ordinal = -1, dev;
        cu_uuid uuid;
        cu_result e;
        if ((e = cu.ptr_attr(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                             p)) ||
            (e = cu.dev_get(&dev, ordinal)) || (e = cu.dev_uuid(&uuid, dev))) {
            rc = fail(c, KVX_ERR_INVALID,
                      "GPU pool: regions[%u]: %p is not device memory of this "
                      "process (CUresult %d)",
                      i, r[i].dev_ptr, e);
            break;
        }
        if ((e = cu.addr_range(&base, &asize, p))) {
            rc = fail(c, KVX_ERR_INVALID,
                      "GPU pool: regions[%u]: cuMemGetAddressRange failed "
                      "(CUresult %d)",
                      i, e);
            break;
        }
        if (p < base || p - base > asize) {
            rc = fail(c, KVX_ERR_INVALID,
                      "GPU pool: regions[%u]: %p lies outside the allocation "
                      "the driver names for it",
                      i, r[i].dev_ptr);
            break;
        }
        if (i && memcmp(uuid.b, pm.uuid[0], 16)) {
            rc = fail(c, KVX_ERR_UNSUPPORTED,
                      "GPU pool: regions[%u] is on another GPU than "
                      "regions[0] (a pool lies on one device)",
                      i);
            break;
        }
        /* one allocation however many regions lie in it: shared once */
        uint32_t a = 0;
        while (a < na && al[a].base != base)
            a++;
        if (a == na) {
            al[na].base = base;
            al[na].asize = asize;
            memcpy(pm.uuid[na], uuid.b, 16);
            na++;
        }
        uint64_t end = p - base + r[i].size;
        if (end > al[a].need)
            al[a].need = end;
        pm.regions[i].allocation = a;
        pm.regions[i].offset = p - base;
        pm.regions[i].size = r[i].size;
    }
    for (uint32_t a = 0; !rc && a < na; a++) {
        Kvxfer__Allocation *m = &pm.allocs[a];
        m->gpu_uuid.data = pm.uuid[a];
        m->gpu_uuid.len = 16;
        m->alloc_id = al[a].base;
        cu_handle h;
        /* VMM memory (cuMemCreate: PyTorch expandable segments, newer
         * TensorRT-LLM pools) has an allocation handle; cudaMalloc
         * memory does not and goes by the legacy IPC handle */
        if (cu.retain && cu.export_fd && cu.release &&
            cu.retain(&h, (void *)(uintptr_t)al[a].base) == 0) {
            cu.release(h);
            int *f = NULL, k = 0;
            uint64_t *sizes = NULL;
            if ((rc = vmm_export(c, al[a].base, al[a].asize, al[a].need, &f,
                                 &sizes, &k)))
                break;
            int *nf = realloc(pm.fds, (size_t)(pm.nfds + k) * sizeof(int));
            if (!nf) {
                for (int i = 0; i < k; i++)
                    close(f[i]);
                free(f);
                free(sizes);
                rc = fail(c, KVX_ERR_NOMEM, "out of memory");
                break;
            }
            pm.fds = nf;
            memcpy(pm.fds + pm.nfds, f, (size_t)k * sizeof(int));
            pm.nfds += k;
            free(f);
            pm.chunks[a] = sizes;
            m->kind = KVXFER__POOL_KIND__POOL_GPU_VMM_FD;
            for (int i = 0; i < k; i++)
                m->alloc_size += sizes[i];
            if (k > 1) { /* one allocation: the field stays empty */
                m->n_chunk_sizes = (size_t)k;
                m->chunk_sizes = sizes;
            }
        } else {
            if (al[a].need > al[a].asize) {
                rc = fail(c, KVX_ERR_INVALID,
                          "GPU pool: a region ends %llu bytes into an "
                          "allocation of %zu bytes (cudaMalloc memory: a "
                          "region lies inside one allocation)",
                          (unsigned long long)al[a].need, al[a].asize);
                break;
            }
            cu_result e;
            if ((e = cu.ipc_get((cu_ipc_handle *)pm.ipc[a], al[a].base))) {
                rc =
                    fail(c, KVX_ERR_UNSUPPORTED,
                         "GPU pool: cuIpcGetMemHandle failed (CUresult %d)", e);
                break;
            }
            m->kind = KVXFER__POOL_KIND__POOL_GPU_IPC;
            m->alloc_size = al[a].asize;
            m->ipc_handle.data = pm.ipc[a];
            m->ipc_handle.len = 64;
        }
    }
    if (!rc) {
        pm.m.n_allocations = na;
        rc = register_pool(c, &pm.m, pm.fds, pm.nfds, timeout_ms, pool_id);
    }
    if (al) {
        pm.m.n_allocations = na;
        pool_msg_free(&pm, 1);
    }
    free(al);
    return rc;
}

int kvx_pool_register_gpu(kvx_client_t *c, const kvx_layout_t *l, void *dev_ptr,
                          uint64_t size, uint32_t *pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !dev_ptr || !size || !pool_id)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    __func__);
    kvx_gpu_region_t r = {dev_ptr, size};
    return kvx_pool_register_gpu_regions(c, l, &r, 1, pool_id, timeout_ms);
}

int kvx_params_info(const void *params, size_t len, kvx_params_info_t *info)
{
    if (!info)
        return KVX_ERR_INVALID;
    memset(info, 0, sizeof(*info));
    Kvxfer__ContextParams *cp =
        params && len ? kvxfer__context_params__unpack(NULL, len, params)
                      : NULL;
    const char *bad =
        !cp                ? "not a ContextParams message"
        : cp->version != 2 ? "params version is not 2"
        : !cp->key.len || cp->key.len > KVX_MAX_KEY ? "key missing or too long"
        : !cp->parallel || !cp->layout ? "no parallel config or layout"
        : strlen(cp->instance_id) >= sizeof(info->instance_id)
            ? "instance id too long"
        : !cp->n_rank_addresses ? "no rank addresses"
                                : NULL;
    if (bad) {
        snprintf(connect_err, sizeof(connect_err),
                 "kvx_params_info: %zu bytes of params: %s", len, bad);
        if (cp)
            kvxfer__context_params__free_unpacked(cp, NULL);
        return KVX_ERR_INVALID;
    }
    snprintf(info->instance_id, sizeof(info->instance_id), "%s",
             cp->instance_id);
    memcpy(info->key, cp->key.data, cp->key.len);
    info->key_len = (uint32_t)cp->key.len;
    info->request_id = reqkey_to_u64(cp->key.data, cp->key.len);
    info->num_tokens = cp->num_tokens;
    info->tokens_per_block = cp->layout->tokens_per_block;
    uint32_t cpn = cp->parallel->cp ? cp->parallel->cp : 1;
    info->context_ranks = cp->parallel->tp * cp->parallel->pp * cpn;
    info->num_layers = cp->parallel->total_layers;
    info->num_kv_heads = cp->parallel->total_kv_heads;
    snprintf(info->rank0_address, sizeof(info->rank0_address), "%s",
             cp->rank_addresses[0]);
    kvxfer__context_params__free_unpacked(cp, NULL);
    return KVX_OK;
}

void kvx_context_params_free(kvx_context_params_t *p)
{
    if (!p)
        return;
    free(p->data);
    p->data = NULL;
    p->len = 0;
}

/* A request answered with context params (Publish, Reserve): *params
 * gets a copy. */
/* The params a publish or reserve reply carries, copied into *params:
 * 0, or KVX_ERR_PROTOCOL / KVX_ERR_NOMEM with the message set. */
static int params_take(kvx_client_t *c, const char *what,
                       const Kvxfer__Reply *r, kvx_context_params_t *params)
{
    if (r->body_case != KVXFER__REPLY__BODY_PUBLISH)
        return fail(c, KVX_ERR_PROTOCOL, "%s: reply without params", what);
    size_t len = r->publish->context_params.len;
    if (!(params->data = malloc(len ? len : 1)))
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    memcpy(params->data, r->publish->context_params.data, len);
    params->len = len;
    return 0;
}

static int params_call(kvx_client_t *c, Kvxfer__Request *rq, const char *what,
                       kvx_context_params_t *params, int timeout_ms)
{
    Kvxfer__Reply *r;
    int rc = call(c, rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    rc = params_take(c, what, r, params);
    kvxfer__reply__free_unpacked(r, NULL);
    return rc;
}

/* A key argument: 0, or KVX_ERR_INVALID with the message set. */
static int key_arg(kvx_client_t *c, const char *fn, const void *key,
                   size_t key_len)
{
    if (!key || key_len == 0 || key_len > KVX_MAX_KEY)
        return fail(c, KVX_ERR_INVALID,
                    "%s: key of %zu bytes%s (a key is 1 to %u bytes)", fn,
                    key ? key_len : 0, key ? "" : " (NULL)", KVX_MAX_KEY);
    return 0;
}

int kvx_publish(kvx_client_t *c, uint64_t request_id, uint32_t pool_id,
                const uint32_t *blocks, uint32_t nblocks, uint32_t num_tokens,
                kvx_context_params_t *params, int timeout_ms)
{
    reqkey_t k;
    reqkey_from_u64(&k, request_id);
    return kvx_publish_key(c, k.b, k.len, pool_id, blocks, nblocks, num_tokens,
                           NULL, 0, params, timeout_ms);
}

/* What groups_msg() builds the GroupBlocks for. */
enum { GROUPS_PUBLISH, GROUPS_FETCH, GROUPS_RESERVE };

/* groups as GroupBlocks messages into m and mp (KVX_MAX_GROUPS - 1
 * each): a publish's with num_tokens, a fetch's with skip_tokens, a
 * reservation's with num_tokens and no blocks. 0, or an error of fn (c's
 * last error says which). */
static int groups_msg(kvx_client_t *c, const char *fn,
                      const kvx_group_t *groups, uint32_t ngroups, int use,
                      Kvxfer__GroupBlocks *m, Kvxfer__GroupBlocks **mp)
{
    if (ngroups && !groups)
        return fail(c, KVX_ERR_INVALID, "%s: groups is NULL with ngroups %u",
                    fn, ngroups);
    if (ngroups >= KVX_MAX_GROUPS)
        return fail(c, KVX_ERR_LIMIT, "%s: %u groups, at most %u", fn, ngroups,
                    KVX_MAX_GROUPS - 1);
    /* a reservation comes from an observer, which has no Hello reply to
     * tell the daemon's version: kvx_reserve_groups checks the params */
    if (ngroups && use != GROUPS_RESERVE && c->daemon_minor < 2)
        return fail(c, KVX_ERR_VERSION,
                    "%s: the daemon speaks protocol 2.%u; several block "
                    "tables need 2.2",
                    fn, c->daemon_minor);
    for (uint32_t k = 0; k < ngroups; k++) {
        if (use == GROUPS_RESERVE &&
            (groups[k].blocks || groups[k].num_blocks || groups[k].skip_tokens))
            return fail(c, KVX_ERR_INVALID,
                        "%s: groups[%u] names blocks or skip_tokens; a "
                        "reservation names none (the ranks' publishes "
                        "give the blocks)",
                        fn, k);
        if (!groups[k].blocks && groups[k].num_blocks)
            return fail(c, KVX_ERR_INVALID,
                        "%s: groups[%u].blocks is NULL with num_blocks %u", fn,
                        k, groups[k].num_blocks);
        kvxfer__group_blocks__init(&m[k]);
        m[k].pool_id = kvx__pool_daemon(c, groups[k].pool_id);
        m[k].n_blocks = groups[k].num_blocks;
        m[k].blocks = (uint32_t *)groups[k].blocks;
        m[k].first_block = groups[k].first_block;
        if (use == GROUPS_FETCH)
            m[k].skip_tokens = groups[k].skip_tokens;
        else
            m[k].num_tokens = groups[k].num_tokens;
        mp[k] = &m[k];
    }
    return 0;
}

/* Call rq, a request that ends with an event for key: tracked once the
 * daemon took it, so that it ends even if the daemon goes (reconnect.c).
 * params: where a publish's go (NULL: a fetch). */
static int tracked_call(kvx_client_t *c, Kvxfer__Request *rq, const void *key,
                        size_t key_len, kvx_context_params_t *params,
                        int timeout_ms)
{
    kvx__key_t *k = kvx__key_new(c, key, key_len);
    if (!k)
        return KVX_ERR_NOMEM;
    int rc = params ? params_call(c, rq, "publish", params, timeout_ms)
                    : call(c, rq, -1, timeout_ms, NULL);
    if (rc)
        free(k);
    else
        kvx__track(c, k);
    return rc;
}

/* kvx_publish_key, kvx_publish_layerwise and kvx_publish_groups (fn
 * names the call). */
static int publish(kvx_client_t *c, const char *fn, const void *key,
                   size_t key_len, uint32_t pool_id, const uint32_t *blocks,
                   uint32_t nblocks, uint32_t num_tokens,
                   const kvx_group_t *groups, uint32_t ngroups, const void *aux,
                   size_t aux_len, int layerwise, kvx_context_params_t *params,
                   int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, fn, key, key_len);
    if (rc)
        return rc;
    if ((!blocks && nblocks) || !params)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    fn);
    if (!aux && aux_len)
        return fail(c, KVX_ERR_INVALID, "%s: aux is NULL with aux_len %zu", fn,
                    aux_len);
    /* a 2.0 daemon would ignore the flag and read the blocks at once */
    if (layerwise && c->daemon_minor < 1)
        return fail(c, KVX_ERR_VERSION,
                    "%s: the daemon speaks protocol 2.%u; layer-wise offers "
                    "need 2.1",
                    fn, c->daemon_minor);
    Kvxfer__Publish m = KVXFER__PUBLISH__INIT;
    Kvxfer__GroupBlocks gm[KVX_MAX_GROUPS], *gmp[KVX_MAX_GROUPS];
    if ((rc = groups_msg(c, fn, groups, ngroups, GROUPS_PUBLISH, gm, gmp)))
        return rc;
    m.n_groups = ngroups;
    m.groups = gmp;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.pool_id = kvx__pool_daemon(c, pool_id);
    m.n_blocks = nblocks;
    m.blocks = (uint32_t *)blocks;
    m.num_tokens = num_tokens;
    m.aux.data = (uint8_t *)aux;
    m.aux.len = aux_len;
    m.layerwise = layerwise;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_PUBLISH;
    rq.publish = &m;
    return tracked_call(c, &rq, key, key_len, params, timeout_ms);
}

int kvx_publish_key(kvx_client_t *c, const void *key, size_t key_len,
                    uint32_t pool_id, const uint32_t *blocks, uint32_t nblocks,
                    uint32_t num_tokens, const void *aux, size_t aux_len,
                    kvx_context_params_t *params, int timeout_ms)
{
    return publish(c, "kvx_publish_key", key, key_len, pool_id, blocks, nblocks,
                   num_tokens, NULL, 0, aux, aux_len, 0, params, timeout_ms);
}

int kvx_publish_groups(kvx_client_t *c, const void *key, size_t key_len,
                       uint32_t pool_id, const uint32_t *blocks,
                       uint32_t nblocks, uint32_t num_tokens,
                       const kvx_group_t *groups, uint32_t ngroups,
                       const void *aux, size_t aux_len, int layerwise,
                       kvx_context_params_t *params, int timeout_ms)
{
    return publish(c, "kvx_publish_groups", key, key_len, pool_id, blocks,
                   nblocks, num_tokens, groups, ngroups, aux, aux_len,
                   layerwise != 0, params, timeout_ms);
}

int kvx_publish_layerwise(kvx_client_t *c, const void *key, size_t key_len,
                          uint32_t pool_id, const uint32_t *blocks,
                          uint32_t nblocks, uint32_t num_tokens,
                          const void *aux, size_t aux_len,
                          kvx_context_params_t *params, int timeout_ms)
{
    return publish(c, "kvx_publish_layerwise", key, key_len, pool_id, blocks,
                   nblocks, num_tokens, NULL, 0, aux, aux_len, 1, params,
                   timeout_ms);
}

int kvx_append_blocks(kvx_client_t *c, const void *key, size_t key_len,
                      uint32_t pool_id, const uint32_t *blocks,
                      uint32_t nblocks, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, "kvx_append_blocks", key, key_len);
    if (rc)
        return rc;
    if (!blocks && nblocks)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    __func__);
    Kvxfer__AppendBlocks m = KVXFER__APPEND_BLOCKS__INIT;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.pool_id = kvx__pool_daemon(c, pool_id);
    m.n_blocks = nblocks;
    m.blocks = (uint32_t *)blocks;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_APPEND_BLOCKS;
    rq.append_blocks = &m;
    return call(c, &rq, -1, timeout_ms, NULL);
}

/* kvx_layers_ready and kvx_tokens_ready (fn names the call). */
static int ready(kvx_client_t *c, const char *fn, const void *key,
                 size_t key_len, uint32_t group, uint32_t first, uint32_t count,
                 uint32_t tokens, const void *cuda_event, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, fn, key, key_len);
    if (rc)
        return rc;
    if (count == 0)
        return fail(c, KVX_ERR_INVALID, "%s: count 0", fn);
    if (group && c->daemon_minor < 2)
        return fail(c, KVX_ERR_VERSION,
                    "%s: the daemon speaks protocol 2.%u; block tables "
                    "need 2.2",
                    fn, c->daemon_minor);
    Kvxfer__LayersReady m = KVXFER__LAYERS_READY__INIT;
    m.group = group;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.first = first;
    m.count = count;
    m.tokens = tokens;
    if (cuda_event) {
        m.cuda_event.data = (uint8_t *)cuda_event;
        m.cuda_event.len = 64;
    }
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_LAYERS_READY;
    rq.layers_ready = &m;
    return call(c, &rq, -1, timeout_ms, NULL);
}

int kvx_layers_ready(kvx_client_t *c, const void *key, size_t key_len,
                     uint32_t first, uint32_t count, const void *cuda_event,
                     int timeout_ms)
{
    return ready(c, "kvx_layers_ready", key, key_len, 0, first, count, 0,
                 cuda_event, timeout_ms);
}

int kvx_tokens_ready(kvx_client_t *c, const void *key, size_t key_len,
                     uint32_t first, uint32_t count, uint32_t tokens,
                     const void *cuda_event, int timeout_ms)
{
    return ready(c, "kvx_tokens_ready", key, key_len, 0, first, count, tokens,
                 cuda_event, timeout_ms);
}

int kvx_group_tokens_ready(kvx_client_t *c, const void *key, size_t key_len,
                           uint32_t group, uint32_t first, uint32_t count,
                           uint32_t tokens, const void *cuda_event,
                           int timeout_ms)
{
    return ready(c, "kvx_group_tokens_ready", key, key_len, group, first, count,
                 tokens, cuda_event, timeout_ms);
}

static int fetch_progress(kvx_client_t *c, const char *fn, const void *key,
                          size_t key_len, uint32_t group, uint32_t *layers_done,
                          uint32_t *num_layers, int *ended, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, fn, key, key_len);
    if (rc)
        return rc;
    if (!layers_done || !num_layers)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    fn);
    /* an older daemon would ignore the group and answer for table 0 */
    if (group && c->daemon_minor < 3)
        return fail(c, KVX_ERR_VERSION,
                    "%s: the daemon speaks protocol 2.%u; a block table's "
                    "progress needs 2.3",
                    fn, c->daemon_minor);
    Kvxfer__FetchProgress m = KVXFER__FETCH_PROGRESS__INIT;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.group = group;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_FETCH_PROGRESS;
    rq.fetch_progress = &m;
    Kvxfer__Reply *r = NULL;
    if ((rc = call(c, &rq, -1, timeout_ms, &r)))
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_FETCH_PROGRESS) {
        kvxfer__reply__free_unpacked(r, NULL);
        c->broken = 1;
        return fail(c, KVX_ERR_PROTOCOL,
                    "fetch_progress: the daemon's reply has no progress");
    }
    *layers_done = r->fetch_progress->layers_done;
    *num_layers = r->fetch_progress->num_layers;
    if (ended)
        *ended = r->fetch_progress->ended;
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

int kvx_fetch_progress(kvx_client_t *c, const void *key, size_t key_len,
                       uint32_t *layers_done, uint32_t *num_layers, int *ended,
                       int timeout_ms)
{
    return fetch_progress(c, "kvx_fetch_progress", key, key_len, 0, layers_done,
                          num_layers, ended, timeout_ms);
}

int kvx_group_fetch_progress(kvx_client_t *c, const void *key, size_t key_len,
                             uint32_t group, uint32_t *layers_done,
                             uint32_t *num_layers, int *ended, int timeout_ms)
{
    return fetch_progress(c, "kvx_group_fetch_progress", key, key_len, group,
                          layers_done, num_layers, ended, timeout_ms);
}

int kvx_reserve(kvx_client_t *c, const char *instance_id, const void *key,
                size_t key_len, uint32_t num_tokens,
                kvx_context_params_t *params, int timeout_ms)
{
    return kvx_reserve_groups(c, instance_id, key, key_len, num_tokens, 0, NULL,
                              0, params, timeout_ms);
}

int kvx_reserve_groups(kvx_client_t *c, const char *instance_id,
                       const void *key, size_t key_len, uint32_t num_tokens,
                       uint32_t pool_id, const kvx_group_t *groups,
                       uint32_t ngroups, kvx_context_params_t *params,
                       int timeout_ms)
{
    const char *fn = pool_id || ngroups ? "kvx_reserve_groups" : "kvx_reserve";
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, fn, key, key_len);
    if (rc)
        return rc;
    if (!instance_id || !params)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    fn);
    /* an observer has no Hello reply, so no daemon version: the
     * params returned say whether the daemon took the groups */
    Kvxfer__GroupBlocks gm[KVX_MAX_GROUPS], *gmp[KVX_MAX_GROUPS];
    if ((rc = groups_msg(c, fn, groups, ngroups, GROUPS_RESERVE, gm, gmp)))
        return rc;
    Kvxfer__Reserve m = KVXFER__RESERVE__INIT;
    m.instance_id = (char *)instance_id;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.num_tokens = num_tokens;
    m.pool_id = pool_id ? kvx__pool_daemon(c, pool_id) : 0;
    m.n_groups = ngroups;
    m.groups = ngroups ? gmp : NULL;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_RESERVE;
    rq.reserve = &m;
    if ((rc = params_call(c, &rq, "reserve", params, timeout_ms)))
        return rc;
    if (!ngroups)
        return 0;
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, params->len, params->data);
    size_t got = cp ? cp->n_groups : 0;
    if (cp)
        kvxfer__context_params__free_unpacked(cp, NULL);
    if (got != ngroups) {
        kvx_context_params_free(params);
        return fail(c, KVX_ERR_VERSION,
                    "%s: the daemon's params carry %zu of the %u groups: it "
                    "speaks a protocol before 2.4 (its reservation ends at "
                    "its lease)",
                    fn, got, ngroups);
    }
    return 0;
}

int kvx_fetch_by_key(kvx_client_t *c, const void *key, size_t key_len,
                     const char *ctx_instance, const char *ctx_address,
                     const void *ctx_key, size_t ctx_key_len, uint32_t pool_id,
                     const uint32_t *blocks, uint32_t nblocks,
                     uint32_t skip_tokens, uint32_t dp_rank, int timeout_ms)
{
    return kvx_fetch_by_key_groups(
        c, key, key_len, ctx_instance, ctx_address, ctx_key, ctx_key_len,
        pool_id, blocks, nblocks, skip_tokens, dp_rank, NULL, 0, timeout_ms);
}

int kvx_fetch_by_key_groups(kvx_client_t *c, const void *key, size_t key_len,
                            const char *ctx_instance, const char *ctx_address,
                            const void *ctx_key, size_t ctx_key_len,
                            uint32_t pool_id, const uint32_t *blocks,
                            uint32_t nblocks, uint32_t skip_tokens,
                            uint32_t dp_rank, const kvx_group_t *groups,
                            uint32_t ngroups, int timeout_ms)
{
    const char *fn = ngroups ? "kvx_fetch_by_key_groups" : "kvx_fetch_by_key";
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, fn, key, key_len);
    if (!rc)
        rc = key_arg(c,
                     ngroups ? "kvx_fetch_by_key_groups: context"
                             : "kvx_fetch_by_key: context",
                     ctx_key, ctx_key_len);
    if (rc)
        return rc;
    if (!ctx_instance || !ctx_address || (!blocks && nblocks))
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    fn);
    Kvxfer__FetchByKey m = KVXFER__FETCH_BY_KEY__INIT;
    Kvxfer__GroupBlocks gm[KVX_MAX_GROUPS], *gmp[KVX_MAX_GROUPS];
    if ((rc = groups_msg(c, fn, groups, ngroups, GROUPS_FETCH, gm, gmp)))
        return rc;
    m.n_groups = ngroups;
    m.groups = gmp;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.context_instance = (char *)ctx_instance;
    m.context_address = (char *)ctx_address;
    m.context_key.data = (uint8_t *)ctx_key;
    m.context_key.len = ctx_key_len;
    m.pool_id = kvx__pool_daemon(c, pool_id);
    m.n_blocks = nblocks;
    m.blocks = (uint32_t *)blocks;
    m.skip_tokens = skip_tokens;
    m.dp_rank = dp_rank;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_FETCH_BY_KEY;
    rq.fetch_by_key = &m;
    return tracked_call(c, &rq, key, key_len, NULL, timeout_ms);
}

int kvx_fetch(kvx_client_t *c, uint64_t request_id, const uint8_t *params,
              size_t params_len, uint32_t pool_id, const uint32_t *blocks,
              uint32_t nblocks, uint32_t skip_tokens, int timeout_ms)
{
    return kvx_fetch_dp(c, request_id, params, params_len, pool_id, blocks,
                        nblocks, skip_tokens, 0, timeout_ms);
}

int kvx_fetch_dp(kvx_client_t *c, uint64_t request_id, const uint8_t *params,
                 size_t params_len, uint32_t pool_id, const uint32_t *blocks,
                 uint32_t nblocks, uint32_t skip_tokens, uint32_t dp_rank,
                 int timeout_ms)
{
    reqkey_t k;
    reqkey_from_u64(&k, request_id);
    return kvx_fetch_key(c, k.b, k.len, params, params_len, pool_id, blocks,
                         nblocks, skip_tokens, dp_rank, timeout_ms);
}

int kvx_fetch_key(kvx_client_t *c, const void *key, size_t key_len,
                  const uint8_t *params, size_t params_len, uint32_t pool_id,
                  const uint32_t *blocks, uint32_t nblocks,
                  uint32_t skip_tokens, uint32_t dp_rank, int timeout_ms)
{
    return kvx_fetch_groups(c, key, key_len, params, params_len, pool_id,
                            blocks, nblocks, skip_tokens, dp_rank, NULL, 0,
                            timeout_ms);
}

int kvx_fetch_groups(kvx_client_t *c, const void *key, size_t key_len,
                     const uint8_t *params, size_t params_len, uint32_t pool_id,
                     const uint32_t *blocks, uint32_t nblocks,
                     uint32_t skip_tokens, uint32_t dp_rank,
                     const kvx_group_t *groups, uint32_t ngroups,
                     int timeout_ms)
{
    const char *fn = ngroups ? "kvx_fetch_groups" : "kvx_fetch_key";
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, fn, key, key_len);
    if (rc)
        return rc;
    if ((!blocks && nblocks) || (!params && params_len))
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    fn);
    Kvxfer__Fetch m = KVXFER__FETCH__INIT;
    Kvxfer__GroupBlocks gm[KVX_MAX_GROUPS], *gmp[KVX_MAX_GROUPS];
    if ((rc = groups_msg(c, fn, groups, ngroups, GROUPS_FETCH, gm, gmp)))
        return rc;
    m.n_groups = ngroups;
    m.groups = gmp;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    m.context_params.data = (uint8_t *)params;
    m.context_params.len = params_len;
    m.pool_id = kvx__pool_daemon(c, pool_id);
    m.n_blocks = nblocks;
    m.blocks = (uint32_t *)blocks;
    m.skip_tokens = skip_tokens;
    m.dp_rank = dp_rank;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_FETCH;
    rq.fetch = &m;
    return tracked_call(c, &rq, key, key_len, NULL, timeout_ms);
}

/* Tracked keys of the items of a kvx_*_many call, made before it is sent
 * (those the daemon takes are tracked, the rest freed). */
static void many_keys_free(kvx__key_t **k, size_t n)
{
    for (size_t i = 0; k && i < n; i++)
        free(k[i]);
    free(k);
}

int kvx_publish_many(kvx_client_t *c, kvx_publish_item_t *items, size_t n,
                     int timeout_ms)
{
    static const char fn[] = "kvx_publish_many";
    if (!c)
        return KVX_ERR_INVALID;
    if ((!items && n) || n > KVX_MANY_MAX)
        return fail(c, KVX_ERR_INVALID, "%s: %zu items%s (at most %u)", fn, n,
                    items ? "" : " at NULL", KVX_MANY_MAX);
    for (size_t i = 0; i < n; i++) {
        kvx_publish_item_t *it = &items[i];
        it->status = 0;
        it->params.data = NULL;
        it->params.len = 0;
        int rc = item_arg(c, fn, i, it->key, it->key_len, it->blocks,
                          it->num_blocks, NULL, 0);
        if (rc)
            return rc;
    }
    if (!n)
        return 0;
    Kvxfer__Publish *m = calloc(n, sizeof(*m));
    Kvxfer__Request *rq = calloc(n, sizeof(*rq));
    Kvxfer__Reply **rp = NULL;
    kvx__key_t **keys = NULL;
    int rc = 0, first = 0;
    if (!m || !rq || !(keys = calloc(n, sizeof(*keys)))) {
        rc = fail(c, KVX_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if (!(keys[i] = kvx__key_new(c, items[i].key, items[i].key_len))) {
            rc = KVX_ERR_NOMEM;
            goto out;
        }
    for (size_t i = 0; i < n; i++) {
        kvxfer__publish__init(&m[i]);
        m[i].key.data = (uint8_t *)items[i].key;
        m[i].key.len = items[i].key_len;
        m[i].pool_id = kvx__pool_daemon(c, items[i].pool_id);
        m[i].n_blocks = items[i].num_blocks;
        m[i].blocks = (uint32_t *)items[i].blocks;
        m[i].num_tokens = items[i].num_tokens;
        kvxfer__request__init(&rq[i]);
        rq[i].body_case = KVXFER__REQUEST__BODY_PUBLISH;
        rq[i].publish = &m[i];
    }
    if ((rc = call_many(c, rq, n, timeout_ms, &rp)))
        goto out;
    for (size_t i = 0; i < n; i++) {
        kvx_publish_item_t *it = &items[i];
        it->status = item_status(c, fn, i, it->key, it->key_len, rp[i], &first);
        if (it->status)
            continue;
        kvx__track(c, keys[i]); /* taken: its event will come */
        keys[i] = NULL;
        char what[48];
        snprintf(what, sizeof(what), "%s: item %zu", fn, i);
        if (first) { /* the first failure's message stays the error */
            char keep[sizeof(c->err)];
            memcpy(keep, c->err, sizeof(keep));
            it->status = params_take(c, what, rp[i], &it->params);
            memcpy(c->err, keep, sizeof(keep));
        } else {
            first = it->status = params_take(c, what, rp[i], &it->params);
        }
    }
    rc = first;
out:
    many_keys_free(keys, n);
    replies_free(rp, n);
    free(m);
    free(rq);
    return rc;
}

int kvx_fetch_many(kvx_client_t *c, kvx_fetch_item_t *items, size_t n,
                   int timeout_ms)
{
    static const char fn[] = "kvx_fetch_many";
    if (!c)
        return KVX_ERR_INVALID;
    if ((!items && n) || n > KVX_MANY_MAX)
        return fail(c, KVX_ERR_INVALID, "%s: %zu items%s (at most %u)", fn, n,
                    items ? "" : " at NULL", KVX_MANY_MAX);
    for (size_t i = 0; i < n; i++) {
        kvx_fetch_item_t *it = &items[i];
        it->status = 0;
        int rc = item_arg(c, fn, i, it->key, it->key_len, it->blocks,
                          it->num_blocks, it->params, it->params_len);
        if (rc)
            return rc;
    }
    if (!n)
        return 0;
    Kvxfer__Fetch *m = calloc(n, sizeof(*m));
    Kvxfer__Request *rq = calloc(n, sizeof(*rq));
    Kvxfer__Reply **rp = NULL;
    kvx__key_t **keys = NULL;
    int rc = 0, first = 0;
    if (!m || !rq || !(keys = calloc(n, sizeof(*keys)))) {
        rc = fail(c, KVX_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if (!(keys[i] = kvx__key_new(c, items[i].key, items[i].key_len))) {
            rc = KVX_ERR_NOMEM;
            goto out;
        }
    for (size_t i = 0; i < n; i++) {
        kvxfer__fetch__init(&m[i]);
        m[i].key.data = (uint8_t *)items[i].key;
        m[i].key.len = items[i].key_len;
        m[i].context_params.data = (uint8_t *)items[i].params;
        m[i].context_params.len = items[i].params_len;
        m[i].pool_id = kvx__pool_daemon(c, items[i].pool_id);
        m[i].n_blocks = items[i].num_blocks;
        m[i].blocks = (uint32_t *)items[i].blocks;
        m[i].skip_tokens = items[i].skip_tokens;
        m[i].dp_rank = items[i].dp_rank;
        kvxfer__request__init(&rq[i]);
        rq[i].body_case = KVXFER__REQUEST__BODY_FETCH;
        rq[i].fetch = &m[i];
    }
    if ((rc = call_many(c, rq, n, timeout_ms, &rp)))
        goto out;
    for (size_t i = 0; i < n; i++) {
        items[i].status = item_status(c, fn, i, items[i].key, items[i].key_len,
                                      rp[i], &first);
        if (!items[i].status) { /* taken: its event will come */
            kvx__track(c, keys[i]);
            keys[i] = NULL;
        }
    }
    rc = first;
out:
    many_keys_free(keys, n);
    replies_free(rp, n);
    free(m);
    free(rq);
    return rc;
}

int kvx_poll(kvx_client_t *c, uint32_t at_least, int timeout_ms,
             kvx_batch_t **out)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out)
        return fail(c, KVX_ERR_INVALID,
                    "%s: a required argument is NULL or 0",
                    __func__);
    /* the ends of the requests a lost daemon took with it come first */
    int rc = kvx__gone_batch(c, out);
    if (rc)
        return rc < 0 ? rc : 0;
    Kvxfer__Poll m = KVXFER__POLL__INIT;
    m.at_least = at_least;
    /* negative: no deadline of ours; the daemon cuts it to its own
     * (deadlines.poll_timeout_max_ms), and an empty batch sealed there
     * is read past below */
    m.timeout_ms = timeout_ms < 0 ? UINT32_MAX : (uint32_t)timeout_ms;
    /* a client that spins, waiting for one event, asks to be woken
     * early (2.4): once a fetch of its instance has its last copies out,
     * the daemon answers without a batch, and the poll is sent again and
     * spun for, so the event is not held up by this thread's wake-up */
    m.early = c->spin_us && at_least == 1 && timeout_ms != 0;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_POLL;
    rq.poll = &m;
    Kvxfer__Reply *r;
    uint32_t spin = c->spin_us;
    int64_t t0 = now_ms();
    for (;;) {
        /* the daemon answers at the poll timeout; allow for a busy loop
         * (it cuts timeouts to its maximum, an hour at most) */
        int t = timeout_ms < 3600000 ? timeout_ms : 3600000;
        if ((rc = call_spin(c, &rq, NULL, 0, t < 0 ? -1 : t + 10000, spin,
                            &r))) {
            /* lost during this poll: its requests' ends now */
            if (rc == KVX_ERR_CLOSED && c->rv.ngone) {
                char why[sizeof(c->err)];
                memcpy(why, c->err, sizeof(why));
                int g = kvx__gone_batch(c, out);
                if (g > 0) {
                    memcpy(c->err, why, sizeof(why));
                    return 0;
                }
                return g < 0 ? g : rc;
            }
            return rc;
        }
        if (r->body_case == KVXFER__REPLY__BODY_POLL && r->poll->early &&
            !r->poll->n_events) {
            kvxfer__reply__free_unpacked(r, NULL);
            m.early = 0; /* once a poll: the event is a copy away */
            if (timeout_ms >= 0) {
                int64_t left = timeout_ms - (now_ms() - t0);
                m.timeout_ms = left > 0 ? (uint32_t)left : 0;
            }
            spin = KVX_EARLY_SPIN_US;
            continue;
        }
        if (timeout_ms >= 0 || at_least == 0 ||
            r->body_case != KVXFER__REPLY__BODY_POLL || r->poll->n_events)
            break;
        kvxfer__reply__free_unpacked(r, NULL);
    }
    if (r->body_case != KVXFER__REPLY__BODY_POLL) {
        kvxfer__reply__free_unpacked(r, NULL);
        return fail(c, KVX_ERR_PROTOCOL, "poll: reply without a batch");
    }
    size_t n = r->poll->n_events;
    kvx__ev_t *ev = malloc((n + 1) * sizeof(*ev));
    if (!ev) {
        kvxfer__reply__free_unpacked(r, NULL);
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        const Kvxfer__Event *e = r->poll->events[i];
        ev[i] = (kvx__ev_t){.kind = e->kind,
                            .code = e->code,
                            .message = e->message,
                            .key = e->key.data,
                            .key_len = e->key.len,
                            .aux = e->aux.data,
                            .aux_len = e->aux.len};
    }
    /* once after a reconnection: the engine hears it, last in the new
     * daemon's first batch */
    char told[256];
    int nt = kvx__told(c, &ev[n], told, sizeof(told));
    rc = kvx__batch_make(c, kvx__batch_seq(c, r->poll->batch), ev, n + nt, out);
    if (!rc) /* each event ends its request: no longer in flight */
        for (size_t i = 0; i < n; i++)
            kvx__untrack(c, ev[i].key, ev[i].key_len);
    free(ev);
    kvxfer__reply__free_unpacked(r, NULL);
    return rc;
}

int kvx__batch_make(kvx_client_t *c, uint64_t seq, const kvx__ev_t *ev,
                    size_t n, kvx_batch_t **out)
{
    /* one allocation: batch, events, then each event's message, key and
     * aux bytes */
    size_t strbytes = 0;
    for (size_t i = 0; i < n; i++)
        strbytes += strlen(ev[i].message) + 1 + ev[i].key_len + ev[i].aux_len;
    kvx_batch_t *b = malloc(sizeof(*b) + n * sizeof(kvx_event_t) + strbytes);
    if (!b)
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    b->seq = seq;
    b->num_events = (uint32_t)n;
    b->events = (kvx_event_t *)(b + 1);
    char *s = (char *)(b->events + n);
    for (size_t i = 0; i < n; i++) {
        const kvx__ev_t *e = &ev[i];
        b->events[i].request_id = reqkey_to_u64(e->key, e->key_len);
        b->events[i].kind = (kvx_event_kind_t)e->kind;
        b->events[i].code = e->code;
        b->events[i].message = s;
        size_t l = strlen(e->message) + 1;
        memcpy(s, e->message, l);
        s += l;
        b->events[i].key = (const uint8_t *)s;
        b->events[i].key_len = (uint32_t)e->key_len;
        if (e->key_len)
            memcpy(s, e->key, e->key_len);
        s += e->key_len;
        b->events[i].aux = e->aux_len ? (const uint8_t *)s : NULL;
        b->events[i].aux_len = (uint32_t)e->aux_len;
        if (e->aux_len)
            memcpy(s, e->aux, e->aux_len);
        s += e->aux_len;
    }
    *out = b;
    return 0;
}

void kvx_batch_free(kvx_batch_t *b) { free(b); }

int kvx_cancel(kvx_client_t *c, uint64_t request_id, int timeout_ms)
{
    reqkey_t k;
    reqkey_from_u64(&k, request_id);
    return kvx_cancel_key(c, k.b, k.len, timeout_ms);
}

int kvx_cancel_key(kvx_client_t *c, const void *key, size_t key_len,
                   int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, "kvx_cancel_key", key, key_len);
    if (rc)
        return rc;
    Kvxfer__Cancel m = KVXFER__CANCEL__INIT;
    m.key.data = (uint8_t *)key;
    m.key.len = key_len;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_CANCEL;
    rq.cancel = &m;
    return call(c, &rq, -1, timeout_ms, NULL);
}

int kvx_release(kvx_client_t *c, const void *params, size_t params_len,
                int timeout_ms)
{
    if (!c || (!params && params_len))
        return KVX_ERR_INVALID;
    Kvxfer__Release m = KVXFER__RELEASE__INIT;
    m.context_params.data = (uint8_t *)params;
    m.context_params.len = params_len;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_RELEASE;
    rq.release = &m;
    return call(c, &rq, -1, timeout_ms, NULL);
}

int kvx_release_by_key(kvx_client_t *c, const char *ctx_instance,
                       const char *ctx_address, const void *ctx_key,
                       size_t ctx_key_len, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    int rc = key_arg(c, "kvx_release_by_key: context", ctx_key, ctx_key_len);
    if (rc)
        return rc;
    if (!ctx_instance || !ctx_instance[0] || !ctx_address || !ctx_address[0])
        return fail(c, KVX_ERR_INVALID,
                    "%s: context_instance or context_address is NULL or "
                    "empty",
                    __func__);
    Kvxfer__Release m = KVXFER__RELEASE__INIT;
    m.context_instance = (char *)ctx_instance;
    m.context_address = (char *)ctx_address;
    m.context_key.data = (uint8_t *)ctx_key;
    m.context_key.len = ctx_key_len;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_RELEASE;
    rq.release = &m;
    return call(c, &rq, -1, timeout_ms, NULL);
}

/* ---- status as JSON --------------------------------------------------- */

struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
};

static void sb_printf(struct sbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void sb_printf(struct sbuf *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? room : 0, fmt,
                          ap);
        va_end(ap);
        if (n < 0)
            return;
        if (b->p && (size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t ncap = b->cap ? b->cap * 2 : 1024;
        while (ncap < b->len + (size_t)n + 1)
            ncap *= 2;
        char *np = realloc(b->p, ncap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
}

/* The length of the valid UTF-8 sequence at s (shortest form, no
 * surrogates, at most U+10FFFF), or 0. */
static int utf8_len(const unsigned char *s)
{
    if (s[0] < 0x80)
        return 1;
    int n = s[0] >= 0xc2 && s[0] <= 0xdf   ? 2
            : s[0] >= 0xe0 && s[0] <= 0xef ? 3
            : s[0] >= 0xf0 && s[0] <= 0xf4 ? 4
                                           : 0;
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    if ((n == 3 && s[0] == 0xe0 && s[1] < 0xa0) ||  /* overlong */
        (n == 3 && s[0] == 0xed && s[1] >= 0xa0) || /* surrogate */
        (n == 4 && s[0] == 0xf0 && s[1] < 0x90) ||  /* overlong */
        (n == 4 && s[0] == 0xf4 && s[1] >= 0x90))   /* > U+10FFFF */
        return 0;
    return n;
}

/* A JSON string: quotes, backslashes and control characters escaped, and
 * bytes that are not UTF-8 (a name the daemon took as bytes) as U+FFFD,
 * so that the document always parses. */
static void sb_str(struct sbuf *b, const char *s)
{
    sb_printf(b, "\"");
    const unsigned char *u = (const unsigned char *)s;
    while (*u) {
        int n = utf8_len(u);
        if (*u == '"' || *u == '\\')
            sb_printf(b, "\\%c", *u);
        else if (*u < 0x20)
            sb_printf(b, "\\u%04x", *u);
        else if (n)
            sb_printf(b, "%.*s", n, (const char *)u);
        else
            sb_printf(b, "\\ufffd");
        u += n ? n : 1;
    }
    sb_printf(b, "\"");
}

static const char *role_name(int role)
{
    switch (role) {
    case 1: return "context";
    case 2: return "generation";
    case 3: return "both";
    default: return "none";
    }
}

static void counts_json(struct sbuf *b, Kvxfer__Count **c, size_t n)
{
    sb_printf(b, "{");
    for (size_t i = 0; i < n; i++) {
        sb_printf(b, "%s", i ? "," : "");
        sb_str(b, c[i]->name);
        sb_printf(b, ":%llu", (unsigned long long)c[i]->value);
    }
    sb_printf(b, "}");
}

static void status_json(struct sbuf *b, const Kvxfer__StatusReply *s)
{
    sb_printf(b, "{\"version\":");
    sb_str(b, s->version);
    sb_printf(b, ",\"build\":");
    sb_str(b, s->build);
    sb_printf(b, ",\"uptime_ms\":%llu,\"daemon_address\":",
              (unsigned long long)s->uptime_ms);
    sb_str(b, s->daemon_address);
    sb_printf(b, ",\"worker_threads\":%u,\"gpu\":", s->worker_threads);
    sb_str(b, s->gpu);
    sb_printf(b, ",\"config\":{");
    for (size_t i = 0; i < s->n_config; i++) {
        const char *kv = s->config[i]->name, *eq = strchr(kv, '=');
        if (!eq)
            continue;
        char key[128];
        snprintf(key, sizeof(key), "%.*s", (int)(eq - kv), kv);
        sb_printf(b, "%s", i ? "," : "");
        sb_str(b, key);
        sb_printf(b, ":");
        sb_str(b, eq + 1);
    }
    sb_printf(b,
              "},\"sessions_total\":%u,\"pools_total\":%u,"
              "\"instances_total\":%u",
              s->sessions_total, s->pools_total, s->instances_total);
    sb_printf(b, ",\"sessions\":[");
    for (size_t i = 0; i < s->n_sessions; i++) {
        const Kvxfer__SessionInfo *x = s->sessions[i];
        sb_printf(b, "%s{\"session_id\":%llu,\"pid\":%d,\"uid\":%u,"
                     "\"instance\":",
                  i ? "," : "", (unsigned long long)x->session_id, x->pid,
                  x->uid);
        sb_str(b, x->instance_id);
        sb_printf(b, ",\"rank\":%u,\"role\":\"%s\",\"pools\":%u}", x->rank,
                  role_name(x->role), x->pools);
    }
    sb_printf(b, "],\"instances\":[");
    for (size_t i = 0; i < s->n_instances; i++) {
        const Kvxfer__InstanceInfo *x = s->instances[i];
        sb_printf(b, "%s{\"id\":", i ? "," : "");
        sb_str(b, x->id);
        sb_printf(b, ",\"role\":\"%s\",\"ranks\":%u,\"local_ranks\":%u,"
                     "\"connected\":%u,\"joined\":%s,\"spread\":%s,"
                     "\"root\":",
                  role_name(x->role), x->ranks, x->local_ranks, x->connected,
                  x->joined ? "true" : "false", x->spread ? "true" : "false");
        sb_str(b, x->root);
        sb_printf(b, ",\"next_batch\":%llu,\"batches_kept\":%u,"
                     "\"ranks_away\":%u,\"requests\":%u,"
                     "\"epoch\":\"%016llx\"}",
                  (unsigned long long)x->next_batch, x->batches_kept,
                  x->ranks_away, x->requests, (unsigned long long)x->epoch);
    }
    sb_printf(b, "],\"pools\":[");
    for (size_t i = 0; i < s->n_pools; i++) {
        const Kvxfer__PoolInfo *x = s->pools[i];
        sb_printf(b, "%s{\"pool_id\":%u,\"session_id\":%llu,\"kind\":",
                  i ? "," : "", x->pool_id,
                  (unsigned long long)x->session_id);
        sb_str(b, x->kind);
        sb_printf(b, ",\"size\":%llu,\"preset\":",
                  (unsigned long long)x->size);
        sb_str(b, x->preset);
        sb_printf(b, ",\"num_blocks\":%u,\"users\":%u,\"regions\":%u}",
                  x->num_blocks, x->users, x->regions);
    }
    sb_printf(b, "],\"requests_by_state\":");
    counts_json(b, s->requests_by_state, s->n_requests_by_state);
    sb_printf(b, ",\"bytes_moved\":%llu,\"transfers_done\":%llu,"
                 "\"errors_by_code\":",
              (unsigned long long)s->bytes_moved,
              (unsigned long long)s->transfers_done);
    counts_json(b, s->errors_by_code, s->n_errors_by_code);
    sb_printf(b, ",\"memory\":");
    counts_json(b, s->memory, s->n_memory);
    sb_printf(b,
              ",\"batches_sealed\":%llu,\"batches_resent\":%llu,"
              "\"polls_woken_early\":%llu,\"peers\":[",
              (unsigned long long)s->batches_sealed,
              (unsigned long long)s->batches_resent,
              (unsigned long long)s->polls_woken_early);
    for (size_t i = 0; i < s->n_peers; i++) {
        const Kvxfer__PeerInfo *x = s->peers[i];
        sb_printf(b, "%s{\"address\":", i ? "," : "");
        sb_str(b, x->address);
        sb_printf(b, ",\"state\":");
        sb_str(b, x->state);
        sb_printf(b, ",\"direction\":");
        sb_str(b, x->direction);
        sb_printf(b, ",\"bytes_sent\":%llu,\"bytes_received\":%llu,"
                     "\"errors\":%llu,\"streams\":%u,\"last_seen_ms\":%llu,"
                     "\"lanes\":%u}",
                  (unsigned long long)x->bytes_sent,
                  (unsigned long long)x->bytes_received,
                  (unsigned long long)x->errors, x->streams,
                  (unsigned long long)x->last_seen_ms, x->lanes);
    }
    sb_printf(b, "]");
    if (s->ucx) {
        sb_printf(b, ",\"ucx\":{\"listen\":");
        sb_str(b, s->ucx->listen);
        sb_printf(b, ",\"transports\":");
        sb_str(b, s->ucx->transports);
        sb_printf(b, ",\"staging\":");
        sb_str(b, s->ucx->staging);
        sb_printf(b, ",\"version\":");
        sb_str(b, s->ucx->version);
        sb_printf(b,
                  ",\"slots\":%u,\"slot_bytes\":%llu,\"message_bytes\":%llu,"
                  "\"send_window\":%u,\"lanes\":%u,\"lane_ports\":[",
                  s->ucx->slots, (unsigned long long)s->ucx->slot_bytes,
                  (unsigned long long)s->ucx->message_bytes,
                  s->ucx->send_window, s->ucx->lanes);
        for (size_t i = 0; i < s->ucx->n_lane_ports; i++)
            sb_printf(b, "%s%u", i ? "," : "", s->ucx->lane_ports[i]);
        sb_printf(b, "]");
        const Kvxfer__SlotTimes *t[2] = {s->ucx->received, s->ucx->sent};
        for (int i = 0; i < 2; i++) {
            static const Kvxfer__SlotTimes none = KVXFER__SLOT_TIMES__INIT;
            const Kvxfer__SlotTimes *x = t[i] ? t[i] : &none;
            sb_printf(
                b,
                ",\"%s\":{\"slots\":%llu,\"bytes\":%llu,"
                "\"wait_ns\":%llu,\"wire_ns\":%llu,\"copy_ns\":%llu,"
                "\"loop_lag_ns\":%llu,\"ahead\":%llu,"
                "\"direct\":%llu,\"free_slots\":%u}",
                i ? "sent" : "received", (unsigned long long)x->slots,
                (unsigned long long)x->bytes, (unsigned long long)x->wait_ns,
                (unsigned long long)x->wire_ns, (unsigned long long)x->copy_ns,
                (unsigned long long)x->loop_lag_ns,
                (unsigned long long)x->ahead, (unsigned long long)x->direct,
                x->free_slots);
        }
        sb_printf(b, "}");
    }
    sb_printf(b, "}");
}

int kvx__status_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out)
        return fail(c, KVX_ERR_INVALID,
                    "%s: a required argument is NULL or 0",
                    __func__);
    Kvxfer__StatusRequest m = KVXFER__STATUS_REQUEST__INIT;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_STATUS;
    rq.status = &m;
    Kvxfer__Reply *r;
    int rc = call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_STATUS_REPLY) {
        kvxfer__reply__free_unpacked(r, NULL);
        return fail(c, KVX_ERR_PROTOCOL, "status: reply without status");
    }
    *out = r;
    return 0;
}

int kvx__drain(kvx_client_t *c, uint32_t deadline_ms, int wait, char *msg,
               size_t msg_len, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    Kvxfer__Drain m = KVXFER__DRAIN__INIT;
    m.deadline_ms = deadline_ms;
    m.wait = wait != 0;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_DRAIN;
    rq.drain = &m;
    Kvxfer__Reply *r;
    int rc = call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (msg && msg_len)
        snprintf(msg, msg_len, "%s", r->message ? r->message : "");
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

/* One page of ListRequests after the cursor (the last entry of the page
 * before, or NULL: the first page). */
static int requests_page(kvx_client_t *c, const Kvxfer__RequestInfo *after,
                         int64_t deadline, Kvxfer__Reply **out)
{
    Kvxfer__ListRequests m = KVXFER__LIST_REQUESTS__INIT;
    if (after) {
        m.after_instance = after->instance_id;
        m.after_side = after->side;
        m.after_key = after->key;
    }
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_LIST_REQUESTS;
    rq.list_requests = &m;
    int64_t left = deadline < 0 ? -1 : deadline - now_ms();
    Kvxfer__Reply *r;
    int rc = call(c, &rq, -1, deadline < 0 ? -1 : left < 1 ? 1 : (int)left, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_REQUESTS) {
        kvxfer__reply__free_unpacked(r, NULL);
        c->broken = 1;
        return fail(c, KVX_ERR_PROTOCOL, "requests: unexpected reply");
    }
    *out = r;
    return 0;
}

/* Every page, gathered into the first reply (the daemon lists at most
 * limits.list_page_entries a reply). Unpacked messages come from malloc
 * (no allocator is given), so entries move between replies. */
int kvx__requests_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!out)
        return fail(c, KVX_ERR_INVALID, "%s: a required argument is NULL or 0",
                    __func__);
    if (timeout_ms == 0)
        return fail(c, KVX_ERR_INVALID,
                    "timeout_ms 0: a call waits for the daemon's reply; "
                    "give it time (a negative value waits without limit)");
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    Kvxfer__Reply *all;
    int rc = requests_page(c, NULL, deadline, &all);
    if (rc)
        return rc;
    Kvxfer__RequestsReply *a = all->requests;
    while (a->more && a->n_requests) {
        Kvxfer__Reply *r;
        rc = requests_page(c, a->requests[a->n_requests - 1], deadline, &r);
        if (rc) {
            kvxfer__reply__free_unpacked(all, NULL);
            return rc;
        }
        Kvxfer__RequestsReply *p = r->requests;
        Kvxfer__RequestInfo **v =
            p->n_requests
                ? realloc(a->requests,
                          (a->n_requests + p->n_requests) * sizeof(*v))
                : a->requests;
        if (!v) {
            kvxfer__reply__free_unpacked(r, NULL);
            kvxfer__reply__free_unpacked(all, NULL);
            return fail(c, KVX_ERR_NOMEM, "out of memory");
        }
        memcpy(v + a->n_requests, p->requests, p->n_requests * sizeof(*v));
        a->requests = v;
        a->n_requests += p->n_requests;
        a->more = p->more;
        p->n_requests = 0; /* moved */
        kvxfer__reply__free_unpacked(r, NULL);
    }
    a->more = 0;
    *out = all;
    return 0;
}

int kvx_status_json(kvx_client_t *c, char **json, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!json)
        return fail(c, KVX_ERR_INVALID, "%s: json is NULL", __func__);
    Kvxfer__Reply *r;
    int rc = kvx__status_get(c, &r, timeout_ms);
    if (rc)
        return rc;
    struct sbuf b = {0};
    status_json(&b, r->status_reply);
    kvxfer__reply__free_unpacked(r, NULL);
    if (b.oom || !b.p) {
        free(b.p);
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    *json = b.p;
    return 0;
}

int kvx_requests_json(kvx_client_t *c, char **json, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!json)
        return fail(c, KVX_ERR_INVALID, "%s: json is NULL", __func__);
    Kvxfer__Reply *r;
    int rc = kvx__requests_get(c, &r, timeout_ms);
    if (rc)
        return rc;
    struct sbuf b = {0};
    sb_printf(&b, "[");
    for (size_t i = 0; i < r->requests->n_requests; i++) {
        const Kvxfer__RequestInfo *x = r->requests->requests[i];
        sb_printf(&b, "%s{\"instance\":", i ? "," : "");
        sb_str(&b, x->instance_id);
        char kj[REQKEY_STR_MAX + KVX_MAX_KEY];
        sb_printf(&b, ",\"key\":%s,\"request_id\":%llu,\"side\":",
                  reqkey_json(x->key.data, x->key.len, kj),
                  (unsigned long long)reqkey_to_u64(x->key.data, x->key.len));
        sb_str(&b, x->side);
        sb_printf(&b, ",\"state\":");
        sb_str(&b, x->state);
        sb_printf(&b, ",\"age_ms\":%llu,\"bytes_done\":%llu,"
                      "\"bytes_total\":%llu,\"detail\":",
                  (unsigned long long)x->age_ms,
                  (unsigned long long)x->bytes_done,
                  (unsigned long long)x->bytes_total);
        sb_str(&b, x->detail);
        sb_printf(&b, "}");
    }
    sb_printf(&b, "]");
    kvxfer__reply__free_unpacked(r, NULL);
    if (b.oom || !b.p) {
        free(b.p);
        return fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    *json = b.p;
    return 0;
}
