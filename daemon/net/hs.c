/*
 * hs — the handshake socket between daemons; see hs.h.
 *
 * Reading order:
 *   hs_listen()/on_accept   the listener: each socket to peer.c
 *   hs_dial()/on_connect    an outgoing socket
 *   on_read()/got()         bytes in, frames out
 *   hs_read_now()           the same, at once, from what the kernel has
 *   hs_send()               a frame out
 *   hs_close()/h_free       the one way a socket ends
 */
#include <arpa/inet.h>
#include <assert.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "core/daemon.h"
#include "hs.h"

#define LINGER_MS 1000

struct hs {
    uv_tcp_t tcp;
    uv_connect_t conn;
    uv_timer_t linger;
    const hs_cbs_t *cbs;
    void *arg;
    uint8_t *buf; /* the frame being read: its length, then its bytes */
    size_t have, cap;
    unsigned writes; /* uv_writes not back */
    int closing, handles;
    int connected; /* a dial that connected, or an accepted socket */
    char name[64];
};

typedef struct hs_write {
    uv_write_t w;
    hs_t *h;
    uint8_t data[];
} hs_write_t;

static struct {
    uv_tcp_t lis;
    int on;
    void (*accept)(hs_t *h);
} S;

static void h_handle_closed(uv_handle_t *u)
{
    hs_t *h = u->data;
    if (--h->handles == 0) {
        free(h->buf);
        free(h);
    }
}

/* Both handles closed (cancelling writes still out), then freed. */
static void h_free(hs_t *h)
{
    if (uv_is_closing((uv_handle_t *)&h->tcp))
        return;
    uv_close((uv_handle_t *)&h->tcp, h_handle_closed);
    uv_close((uv_handle_t *)&h->linger, h_handle_closed);
}

static void ended(hs_t *h, const char *fmt, const char *detail)
{
    if (h->closing)
        return;
    char why[224];
    snprintf(why, sizeof(why), fmt, detail);
    uv_read_stop((uv_stream_t *)&h->tcp);
    h->cbs->ended(h->arg, why);
}

static hs_t *h_new(void)
{
    hs_t *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    uv_tcp_init(kvxd.loop, &h->tcp);
    uv_timer_init(kvxd.loop, &h->linger);
    h->tcp.data = h->linger.data = h->conn.data = h;
    h->handles = 2;
    snprintf(h->name, sizeof(h->name), "(unknown)");
    return h;
}

/* h->name: IP:PORT of ss */
static void name_of(hs_t *h, const struct sockaddr_storage *ss0)
{
    const struct sockaddr_storage ss = *ss0;
    char ip[INET6_ADDRSTRLEN] = "?";
    if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
        inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof(ip));
        snprintf(h->name, sizeof(h->name), "[%s]:%u", ip, ntohs(a->sin6_port));
    } else {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
        inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
        snprintf(h->name, sizeof(h->name), "%s:%u", ip, ntohs(a->sin_port));
    }
}

static void set_name(hs_t *h)
{
    struct sockaddr_storage ss;
    int len = sizeof(ss);
    if (!uv_tcp_getpeername(&h->tcp, (struct sockaddr *)&ss, &len))
        name_of(h, &ss);
}

const char *hs_peer_name(const hs_t *h)
{
    return h->name;
}

int hs_connected(const hs_t *h)
{
    return h->connected;
}

int hs_peer_addr(const hs_t *h, struct sockaddr_storage *ss)
{
    int len = sizeof(*ss);
    return uv_tcp_getpeername(&h->tcp, (struct sockaddr *)ss, &len) ? KVX_ERR_IO
                                                                    : 0;
}

/* ---- reading ----------------------------------------------------------- */

static void on_alloc(uv_handle_t *u, size_t hint, uv_buf_t *b)
{
    (void)hint;
    hs_t *h = u->data;
    /* read no further than the frame's end: the next one waits in the
     * kernel, so a sender cannot make us buffer more than one frame */
    size_t want = h->have < 4 ? 4 : 4 + (size_t)ntohl(*(uint32_t *)h->buf);
    if (h->cap < want) {
        uint8_t *n = realloc(h->buf, want);
        if (!n) {
            b->base = NULL;
            b->len = 0;
            return;
        }
        h->buf = n;
        h->cap = want;
    }
    b->base = (char *)h->buf + h->have;
    b->len = want - h->have;
}

/* n bytes arrived at h->buf + h->have (on_alloc()'s buffer): a frame out
 * once whole. 0 to go on reading, -1 once the socket has ended. */
static int got(hs_t *h, ssize_t n)
{
    if (n == UV_ENOBUFS) {
        ended(h, "out of memory reading from %s", h->name);
        return -1;
    }
    if (n < 0) {
        ended(h,
              n == UV_EOF ? "%s closed the connection"
                          : "reading from %s failed",
              h->name);
        return -1;
    }
    h->have += (size_t)n;
    if (h->have < 4)
        return 0;
    uint32_t len = ntohl(*(uint32_t *)h->buf);
    if (len > HS_FRAME_MAX) {
        char d[160];
        snprintf(d, sizeof(d),
                 "%s sent a %u-byte frame (the handshake "
                 "takes at most %u)",
                 h->name, len, HS_FRAME_MAX);
        ended(h, "%s", d);
        return -1;
    }
    if (h->have < 4 + (size_t)len)
        return 0;
    h->have = 0;
    h->cbs->frame(h->arg, h->buf + 4, len);
    return h->closing ? -1 : 0;
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
    (void)b;
    got(s->data, n);
}

void hs_read_now(hs_t *h)
{
    uv_os_fd_t fd;
    if (h->closing || !h->connected ||
        uv_fileno((const uv_handle_t *)&h->tcp, &fd))
        return;
    for (;;) {
        uv_buf_t b;
        on_alloc((uv_handle_t *)&h->tcp, 0, &b);
        if (!b.base) {
            got(h, UV_ENOBUFS);
            return;
        }
        ssize_t n = recv(fd, b.base, b.len, MSG_DONTWAIT);
        if (n < 0 &&
            (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return; /* nothing more now: the loop reads the rest */
        if (got(h, n > 0 ? n : n == 0 ? UV_EOF : UV_EIO) || n <= 0)
            return;
    }
}

/* ---- listening and dialling ------------------------------------------- */

static const hs_cbs_t refuse_cbs; /* until hs_attach(): never called */

static void on_accept(uv_stream_t *lis, int status)
{
    (void)lis;
    if (status < 0)
        return;
    hs_t *h = h_new();
    if (!h) {
        /* accept and close: a connection left in the backlog would wake
         * the loop again at once */
        uv_tcp_t t;
        uv_tcp_init(kvxd.loop, &t);
        if (!uv_accept((uv_stream_t *)&S.lis, (uv_stream_t *)&t))
            uv_close((uv_handle_t *)&t, NULL);
        return;
    }
    h->cbs = &refuse_cbs;
    if (uv_accept((uv_stream_t *)&S.lis, (uv_stream_t *)&h->tcp)) {
        h_free(h);
        return;
    }
    uv_tcp_nodelay(&h->tcp, 1);
    set_name(h);
    h->connected = 1;
    S.accept(h);
}

int hs_listen(const struct sockaddr_storage *ss, void (*accept)(hs_t *h),
              struct sockaddr_storage *bound, kvx_why_t *why)
{
    assert(!S.on);
    S.accept = accept;
    uv_tcp_init(kvxd.loop, &S.lis);
    int e = uv_tcp_bind(&S.lis, (const struct sockaddr *)ss, 0);
#ifdef TCP_DEFER_ACCEPT
    /* a connection reaches accept() once it has sent something (or
     * after about a second): a daemon's HELLO, sent as it connects, is
     * there when it is accepted, and peer.c reads it then, before a
     * stranger's socket can take its room */
    uv_os_fd_t fd;
    int secs = 1;
    if (!e && !uv_fileno((const uv_handle_t *)&S.lis, &fd))
        (void)setsockopt(fd, IPPROTO_TCP, TCP_DEFER_ACCEPT, &secs,
                         sizeof(secs));
#endif
    if (!e)
        e = uv_listen((uv_stream_t *)&S.lis, 128, on_accept);
    int len = sizeof(*bound);
    if (!e)
        e = uv_tcp_getsockname(&S.lis, (struct sockaddr *)bound, &len);
    if (e) {
        why_set(why, "%s", uv_strerror(e));
        uv_close((uv_handle_t *)&S.lis, NULL);
        return KVX_ERR_IO;
    }
    S.on = 1;
    return 0;
}

void hs_stop(void)
{
    if (!S.on)
        return;
    S.on = 0;
    uv_close((uv_handle_t *)&S.lis, NULL);
}

void hs_attach(hs_t *h, const hs_cbs_t *cbs, void *arg)
{
    h->cbs = cbs;
    h->arg = arg;
    if (uv_read_start((uv_stream_t *)&h->tcp, on_alloc, on_read))
        ended(h, "cannot read from %s", h->name);
}

static void on_connect(uv_connect_t *c, int status)
{
    hs_t *h = c->data;
    if (h->closing)
        return;
    if (status < 0) { /* what happened, and who said so */
        char d[160];
        snprintf(d, sizeof(d),
                 status == UV_ECONNREFUSED ? "%s by %s" : "%s dialling %s",
                 uv_strerror(status), h->name);
        h->cbs->ended(h->arg, d);
        return;
    }
    uv_tcp_nodelay(&h->tcp, 1);
    set_name(h);
    h->connected = 1;
    if (uv_read_start((uv_stream_t *)&h->tcp, on_alloc, on_read))
        ended(h, "cannot read from %s", h->name);
}

hs_t *hs_dial(const struct sockaddr_storage *ss, const hs_cbs_t *cbs, void *arg)
{
    hs_t *h = h_new();
    if (!h)
        return NULL;
    h->cbs = cbs;
    h->arg = arg;
    name_of(h, ss);
    int e = uv_tcp_connect(&h->conn, &h->tcp, (const struct sockaddr *)ss,
                           on_connect);
    if (e) {
        /* reported like a failed connect, from the loop's next turn */
        h_free(h);
        return NULL;
    }
    return h;
}

/* ---- writing and closing ---------------------------------------------- */

static void on_write(uv_write_t *w, int status)
{
    (void)status;
    hs_write_t *x = (hs_write_t *)w;
    hs_t *h = x->h;
    free(x);
    assert(h->writes > 0);
    if (--h->writes == 0 && h->closing)
        h_free(h);
}

int hs_send(hs_t *h, const uint8_t *buf, size_t len)
{
    if (len > HS_FRAME_MAX)
        return KVX_ERR_INVALID;
    hs_write_t *x = malloc(sizeof(*x) + 4 + len);
    if (!x)
        return KVX_ERR_NOMEM;
    x->h = h;
    uint32_t be = htonl((uint32_t)len);
    memcpy(x->data, &be, 4);
    memcpy(x->data + 4, buf, len);
    uv_buf_t b = uv_buf_init((char *)x->data, (unsigned)(4 + len));
    /* a write on a socket still connecting is queued by libuv */
    if (uv_write(&x->w, (uv_stream_t *)&h->tcp, &b, 1, on_write)) {
        free(x);
        return KVX_ERR_IO;
    }
    h->writes++;
    return 0;
}

static void on_linger(uv_timer_t *t)
{
    h_free(t->data);
}

void hs_close(hs_t *h)
{
    if (h->closing)
        return;
    h->closing = 1;
    uv_read_stop((uv_stream_t *)&h->tcp);
    if (!h->writes) {
        h_free(h);
        return;
    }
    /* let what was sent (a refusal) go out, but not wait on a reader
     * that never reads */
    uv_timer_start(&h->linger, on_linger, LINGER_MS, 0);
}
