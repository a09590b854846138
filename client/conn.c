/*
 * conn — libkvxfer's connection to the daemon: the socket, its frames and
 * the fds that go with them, call() and its batched form, connect, Hello,
 * Join and close; see kvxfer.h. Never logs, never aborts, never raises
 * SIGPIPE.
 *
 * One request is outstanding at a time: call() sends a Request and reads
 * frames until the Reply with the same id arrives or the timeout passes.
 * A timed-out call leaves the connection unusable (a late reply would be
 * taken for the next call's), so the client is closed for further use.
 * A connection the daemon closed is reconnect.c's: it ends the requests
 * in flight and connects again at the next calls.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client.h"
#include "common/frame.h"
#include "common/list.h"
#include "common/reqkey.h"
#include "internal.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"

#define REPLY_MAX (1u << 30)
/* the most limits.max_frame_bytes can be: a larger request could never
 * be taken (and past 4 GiB its length would not fit the frame header) */
#define REQUEST_MAX (1u << 30)

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t kvx__now_ms(void)
{
    return now_us() / 1000;
}

/* The message of the last connect that failed on this thread, for
 * kvx_last_error(NULL): the client it happened on is gone. */
__thread char kvx__connect_err[512];

/* "ENOENT (No such file or directory)": the errno's name with its text,
 * so a message says exactly what the kernel said. */
const char *kvx__errno_str(int e)
{
    static __thread char buf[128];
    const char *name = strerrorname_np(e);
    snprintf(buf, sizeof(buf), "%s (%s)", name ? name : "E?", strerror(e));
    return buf;
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
            int64_t left = deadline - kvx__now_ms();
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
        return kvx__fail(c, KVX_ERR_LIMIT,
                         "%d fds for a frame of %zu bytes: too many", nfds,
                         len);
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
                    return kvx__fail(c, rc, "send: %s",
                                     rc == KVX_ERR_TIMEOUT
                                         ? "timed out"
                                         : kvx__errno_str(errno));
                continue;
            }
            if (errno == EPIPE || errno == ECONNRESET)
                c->eof = 1;
            return kvx__fail(c, c->eof ? KVX_ERR_CLOSED : KVX_ERR_IO,
                             "send: %s", kvx__errno_str(errno));
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
            return kvx__fail(c, KVX_ERR_PROTOCOL,
                             "reply of %u bytes is too large", len);
        if (rc == 1) {
            if (!(*out = kvxfer__reply__unpack(NULL, len, msg)))
                return kvx__fail(c, KVX_ERR_PROTOCOL, "undecodable reply");
            return 0;
        }
        /* the reply is rarely there yet: look for it for the spin, else
         * sleep until it comes; then read */
        if (!(spin_us && spin_readable(c->fd, spin_us, deadline)) &&
            (rc = wait_fd(c->fd, POLLIN, deadline)))
            return kvx__fail(c, rc, "no reply from the daemon: %s",
                             rc == KVX_ERR_TIMEOUT ? "timed out"
                                                   : "poll failed");
        size_t room;
        uint8_t *buf = frame_reader_space(&c->rd, 65536, &room);
        if (!buf)
            return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
        ssize_t n = recv(c->fd, buf, room, MSG_DONTWAIT);
        if (n > 0) {
            frame_reader_commit(&c->rd, (size_t)n);
            continue;
        }
        if (n == 0) {
            c->eof = 1;
            return kvx__fail(c, KVX_ERR_CLOSED,
                             "the daemon closed the connection");
        }
        if (errno == EINTR)
            continue;
        if (errno == ECONNRESET)
            c->eof = 1;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return kvx__fail(c, c->eof ? KVX_ERR_CLOSED : KVX_ERR_IO,
                             "recv: %s", kvx__errno_str(errno));
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
    if (recv_reply(c, 0, kvx__now_ms(), 0, &r) == 0 && r->id == 0 &&
        r->status < 0 && r->status >= KVX_ERR_LAST) {
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
        return kvx__fail(c, KVX_ERR_INVALID,
                         "timeout_ms 0: a call waits for the daemon's reply; "
                         "give it time (a negative value waits without limit)");
    if (c->rv.gone && !c->rv.reviving) {
        int rc = kvx__revive(c, deadline);
        if (rc)
            return rc;
        if (deadline >= 0 && kvx__now_ms() >= deadline)
            return kvx__fail(
                c, KVX_ERR_TIMEOUT,
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
            return kvx__fail(c, KVX_ERR_LIMIT,
                             "request of %zu bytes: larger than the %u bytes a "
                             "frame may hold",
                             m, REQUEST_MAX);
        total += m + FRAME_HDR;
    }
    uint8_t *at = *buf = malloc(total ? total : 1);
    if (!at)
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
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
int kvx__reply_code(int32_t status)
{
    return status > 0 || status < KVX_ERR_LAST ? KVX_ERR_PROTOCOL : status;
}

/* Send rq (its id is set here) with nfds fds and wait for its reply.
 * Returns the daemon's status; *out (if not NULL) receives the reply on
 * success. */
/* One request and its reply, the reply looked for spin_us before the
 * thread sleeps. */
int kvx__call_spin(kvx_client_t *c, Kvxfer__Request *rq, const int *fds,
                   int nfds, int timeout_ms, uint32_t spin_us,
                   Kvxfer__Reply **out)
{
    int64_t deadline = timeout_ms < 0 ? -1 : kvx__now_ms() + timeout_ms;
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
    c->answered = 1;
    if (r->status) {
        rc = kvx__reply_code(r->status);
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

/* kvx__call_spin() with the client's spin. */
int kvx__call_fds(kvx_client_t *c, Kvxfer__Request *rq, const int *fds,
                  int nfds, int timeout_ms, Kvxfer__Reply **out)
{
    return kvx__call_spin(c, rq, fds, nfds, timeout_ms, c->spin_us, out);
}

/* kvx__call_fds() with one fd (fd_to_pass >= 0) or none. */
int kvx__call(kvx_client_t *c, Kvxfer__Request *rq, int fd_to_pass,
              int timeout_ms, Kvxfer__Reply **out)
{
    return kvx__call_fds(c, rq, &fd_to_pass, fd_to_pass >= 0, timeout_ms, out);
}

void kvx__replies_free(Kvxfer__Reply **rp, size_t n)
{
    for (size_t i = 0; rp && i < n; i++)
        if (rp[i])
            kvxfer__reply__free_unpacked(rp[i], NULL);
    free(rp);
}

/* rq[0, n) in one write, then their n replies, in whatever order they
 * come: (*out)[i] answers rq[i] (its status may be a refusal; free them
 * with kvx__replies_free()). 0 when the exchange worked; else no reply is
 * kept and, once anything was sent, the connection is broken. */
int kvx__call_many(kvx_client_t *c, Kvxfer__Request *rq, size_t n,
                   int timeout_ms, Kvxfer__Reply ***out)
{
    int64_t deadline = timeout_ms < 0 ? -1 : kvx__now_ms() + timeout_ms;
    int rc = call_ready(c, timeout_ms, deadline);
    if (rc)
        return rc;
    Kvxfer__Reply **rp = calloc(n ? n : 1, sizeof(*rp));
    uint8_t *buf = NULL;
    size_t len;
    if (!rp)
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
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
            rc = r->status ? kvx__reply_code(r->status) : KVX_ERR_PROTOCOL;
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
        kvx__replies_free(rp, n);
        return conn_failed(c, rc);
    }
    c->answered = 1;
    *out = rp;
    return 0;
}

static int open_socket(kvx_client_t *c, const char *path, int timeout_ms)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (!path)
        path = KVX_DEFAULT_SOCKET;
    if (strlen(path) >= sizeof(sa.sun_path))
        return kvx__fail(c, KVX_ERR_INVALID,
                         "socket path longer than %zu bytes",
                         sizeof(sa.sun_path) - 1);
    strcpy(sa.sun_path, path);
    if (path != c->path)
        snprintf(c->path, sizeof(c->path), "%s", path);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (c->fd < 0)
        return kvx__fail(c, KVX_ERR_IO, "socket: %s", kvx__errno_str(errno));
    /* A Unix socket connects at once or not at all: EAGAIN means the
     * daemon's listen backlog is full (its loop is busy or stopped), and
     * the socket is left unconnected. Ask again until the deadline. */
    int64_t deadline = timeout_ms < 0 ? -1 : kvx__now_ms() + timeout_ms;
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
            return kvx__fail(
                c, e == EACCES || e == EPERM ? KVX_ERR_PERM : KVX_ERR_IO,
                "connect %s: %s%s", path, kvx__errno_str(e), hint);
        }
        if (deadline >= 0 && kvx__now_ms() >= deadline)
            return kvx__fail(
                c, KVX_ERR_TIMEOUT,
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
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
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
    m.version_major = h->version_major ? h->version_major : KVX_PROTOCOL_MAJOR;
    m.version_minor = h->version_major ? h->version_minor : KVX_PROTOCOL_MINOR;
    m.instance_id = (char *)h->instance_id;
    m.role = (Kvxfer__Role)h->role;
    m.rank = h->rank;
    m.parallel = &pc;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_HELLO;
    rq.hello = &m;
    Kvxfer__Reply *r;
    int rc = kvx__call(c, &rq, -1, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_HELLO) {
        kvxfer__reply__free_unpacked(r, NULL);
        return kvx__fail(c, KVX_ERR_PROTOCOL,
                         "hello: reply without HelloReply");
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
    int64_t t0 = kvx__now_ms();
    int rc = kvx_connect_observer(socket_path, timeout_ms, &c);
    if (rc)
        return rc;
    /* one deadline for both halves */
    int64_t left = timeout_ms - (kvx__now_ms() - t0);
    if ((rc = kvx_hello(c, h,
                        timeout_ms < 0 ? timeout_ms
                        : left < 1     ? 1
                                       : (int)left))) {
        snprintf(kvx__connect_err, sizeof(kvx__connect_err), "%s", c->err);
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
        snprintf(kvx__connect_err, sizeof(kvx__connect_err), "%s", c->err);
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
    kvx__host_pools_free(c);
    frame_reader_cleanup(&c->rd);
    kvx__rv_cleanup(c);
    free(c);
}

int kvx_set_spin_us(kvx_client_t *c, uint32_t spin_us)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (spin_us > KVX_SPIN_US_MAX)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "kvx_set_spin_us: %u us, at most %u (a longer wait "
                         "sleeps on the socket)",
                         spin_us, KVX_SPIN_US_MAX);
    c->spin_us = spin_us;
    return 0;
}

const char *kvx_last_error(const kvx_client_t *c)
{
    return c ? c->err : kvx__connect_err;
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
        return kvx__fail(c, KVX_ERR_INVALID, "%s: consumers is NULL", __func__);
    for (uint32_t i = 0; i < ncons; i++)
        if (!consumers[i] || !consumers[i][0])
            return kvx__fail(c, KVX_ERR_INVALID,
                             "%s: consumers[%u] is NULL or empty", __func__, i);
    if (!addr)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    for (uint32_t i = 0; i < n; i++)
        if (!addr[i])
            return kvx__fail(c, KVX_ERR_INVALID,
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
    return kvx__call(c, &rq, -1, timeout_ms, NULL);
}
