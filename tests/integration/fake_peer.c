/*
 * fake_peer — a daemon that misbehaves, for the peer tests. It speaks
 * the daemons' protocol (version 7): the handshake on a TCP socket (each
 * frame a 4-byte big-endian length and one packed PeerMsg), then UCX
 * (active message 1: one packed PeerMsg; 2: slot data) to the worker
 * addresses told in PeerUcx, the first message on an endpoint a BIND.
 *
 *   fake_peer skip IP SECONDS
 *       listens on IP (a free port), prints its address, and answers a
 *       daemon's HELLO with AUTH_RESULT{0} (and a worker address) without
 *       any CHALLENGE; prints "got N" for every later message (N: the
 *       PeerMsg case; 7 is OPEN), on the socket or over UCX.
 *   fake_peer relay IP TARGET_IP:PORT SECONDS
 *       listens the same way; a daemon that dials it has its HELLO sent
 *       on to TARGET, TARGET's CHALLENGE sent back, and the dialling
 *       daemon's RESPONSE sent on to TARGET: a man in the middle. Prints
 *       "auth_result N" with the code TARGET answers (0: the relay got
 *       in).
 *   fake_peer claim TARGET_IP:PORT CLAIMED_ADDRESS SECONDS
 *       connects to TARGET, says HELLO as CLAIMED_ADDRESS, then sends a
 *       PING instead of a RESPONSE (which fails the handshake there).
 *   fake_peer replay SECRET_FILE IP TARGET_IP:PORT SECONDS
 *       a daemon that knows the secret but misbehaves: listens on IP,
 *       authenticates the daemon that dials it, takes its first OPEN,
 *       then authenticates to TARGET and sends it that OPEN twice;
 *       prints "opened" for each OPENED and "end CODE MESSAGE" for each
 *       END that TARGET answers.
 *   fake_peer lane SECRET_FILE TARGET_IP:PORT BYTES SECONDS
 *       authenticates to TARGET (so it learns its lanes' addresses), then
 *       sends lane 0 slot data of BYTES with a connection id and MAC no
 *       connection has; prints "sent" when UCX is done with it and
 *       "closed" when the daemon closes the endpoint.
 *   fake_peer badaddr SECRET_FILE IP KIND SECONDS
 *       a daemon that knows the secret but tells a broken UCX address:
 *       listens on IP, authenticates the daemon that dials it and
 *       answers with KIND as its address: "ff" (64 bytes of 0xff as the
 *       worker's), "random" (64 random bytes), "lane" (a good worker
 *       address, 64 bytes of 0xff as lane 0's), "set:OFF:HEX" (its real
 *       worker address, byte OFF set to HEX), "cut:N" (its real worker
 *       address less its last N bytes), "long" (its real worker address
 *       and one byte more). Prints "answered".
 *   fake_peer badaddr-to SECRET_FILE TARGET_IP:PORT KIND SECONDS
 *       the same, dialling TARGET: KIND in its RESPONSE; prints
 *       "auth_result CODE MESSAGE" with TARGET's answer.
 *   fake_peer flood TARGET_IP:PORT N SECONDS
 *       holds N connections to TARGET open, saying nothing, and opens a
 *       new one for each that TARGET closes, as fast as it can; prints
 *       "flood N" once they are open, then a dot every 100 ms (it ends
 *       when its reader closes the pipe), and "reopened M" at the end.
 *   fake_peer hello-flood SECRET_FILE TARGET_IP:PORT N SECONDS
 *       a stranger that captured one daemon's HELLO to TARGET (made here
 *       under the secret, as that daemon would): sends it again on N
 *       sockets, each opened again with the same bytes when TARGET ends
 *       it; a CHALLENGE is held unanswered. Prints "flood N", and at the
 *       end "challenges C refused R closed K": the CHALLENGEs, the
 *       AUTH_RESULT refusals and the closes without a word it met.
 *   fake_peer garbage TARGET_IP:PORT SECONDS
 *       what a stranger sends to a port: 17 zero bytes (UCX 1.13's
 *       connection manager asserts on them), a frame header claiming
 *       2 GiB, 64 KiB of random bytes, a HELLO followed by garbage, and
 *       100 connections held open and silent for SECONDS; prints "sent N"
 *       with the connections made.
 *
 * Exits after SECONDS; prints "done".
 */
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include "kvxfer.pb-c.h"

#define AM_CTRL 1
#define AM_DATA 2
#define VERSION 7 /* peer.c PEER_VERSION */

static ucp_context_h ctx;
static ucp_worker_h worker;
static ucp_address_t *my_ucx;
static size_t my_ucx_len;
static char my_addr[128];
static const char *mode;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what)
{
    fprintf(stderr, "fake_peer: %s\n", what);
    exit(2);
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

/* ---- the handshake socket -------------------------------------------- */

static void sockaddr_of(const char *ipport, struct sockaddr_in *sa)
{
    char ip[64];
    const char *colon = strrchr(ipport, ':');
    if (!colon || (size_t)(colon - ipport) >= sizeof(ip))
        die("bad IP:PORT");
    memcpy(ip, ipport, (size_t)(colon - ipport));
    ip[colon - ipport] = 0;
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)atoi(colon + 1));
    if (inet_pton(AF_INET, ip, &sa->sin_addr) != 1)
        die("bad IP");
}

static int tcp_dial(const char *ipport)
{
    struct sockaddr_in sa;
    sockaddr_of(ipport, &sa);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)))
        die("connect");
    return fd;
}

static int lfd = -1;

static void tcp_listen(const char *ip)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1)
        die("bad IP");
    socklen_t sl = sizeof(sa);
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) ||
        listen(lfd, 4) || getsockname(lfd, (struct sockaddr *)&sa, &sl))
        die("listen");
    snprintf(my_addr, sizeof(my_addr), "kvx://%s:%d/00000000000000ff", ip,
             ntohs(sa.sin_port));
    say("%s\n", my_addr);
}

static void progress_for(double s);

/* A frame from fd within s seconds, or NULL (closed, timeout). */
static Kvxfer__PeerMsg *frame_recv(int fd, double s)
{
    uint8_t hdr[4], *buf;
    size_t have = 0;
    double end = now_s() + s;
    while (have < 4) {
        struct pollfd p = {fd, POLLIN, 0};
        progress_for(0);
        if (now_s() > end)
            return NULL;
        if (poll(&p, 1, 10) <= 0)
            continue;
        ssize_t n = read(fd, hdr + have, 4 - have);
        if (n <= 0)
            return NULL;
        have += (size_t)n;
    }
    uint32_t len = ntohl(*(uint32_t *)hdr);
    if (len > 65536 || !(buf = malloc(len ? len : 1)))
        return NULL;
    for (have = 0; have < len;) {
        ssize_t n = read(fd, buf + have, len - have);
        if (n <= 0) {
            free(buf);
            return NULL;
        }
        have += (size_t)n;
    }
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, len, buf);
    free(buf);
    return m;
}

static void frame_send(int fd, const Kvxfer__PeerMsg *m)
{
    size_t n = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *b = malloc(4 + n);
    uint32_t be = htonl((uint32_t)n);
    memcpy(b, &be, 4);
    kvxfer__peer_msg__pack(m, b + 4);
    if (write(fd, b, 4 + n) != (ssize_t)(4 + n))
        die("write");
    free(b);
}

/* ---- the secret and its MACs ------------------------------------------ */

static uint8_t secret[4096];
static size_t secret_len;

static void read_secret(const char *f)
{
    FILE *s = fopen(f, "r");
    if (!s)
        die("secret file");
    secret_len = fread(secret, 1, sizeof(secret), s);
    fclose(s);
}

/* peer.c's hmac(): label | nc | ns | server | "\n" | client */
static void mac(const char *label, const uint8_t *nc, const uint8_t *ns,
                const char *server, const char *client, uint8_t out[32])
{
    uint8_t msg[16 + 64 + 2 * 192 + 1];
    size_t n = 0, l = strlen(label), ls = strnlen(server, 191),
           lc = strnlen(client, 191);
    memcpy(msg, label, l);
    n += l;
    memcpy(msg + n, nc, 32);
    n += 32;
    memcpy(msg + n, ns, 32);
    n += 32;
    memcpy(msg + n, server, ls);
    n += ls;
    msg[n++] = '\n';
    memcpy(msg + n, client, lc);
    n += lc;
    unsigned len = 32;
    HMAC(EVP_sha256(), secret, (int)secret_len, msg, n, out, &len);
}

/* A HELLO from my_addr for the daemon at server (IP:PORT), with nonce
 * nc: with peer.c hello_mac()'s MAC when a secret was read. mac: its
 * room. */
static void hello_fill(Kvxfer__PeerHello *h, const uint8_t nc[32],
                       const char *server, uint8_t mac[32])
{
    h->version = VERSION;
    h->address = my_addr;
    h->nonce.data = (uint8_t *)nc;
    h->nonce.len = 32;
    h->server = (char *)server;
    h->time = (uint64_t)time(NULL);
    if (!secret_len)
        return;
    uint8_t msg[5 + 32 + 2 * 192 + 2 + 8];
    size_t n = 5, ls = strnlen(server, 191), lc = strlen(my_addr);
    memcpy(msg, "kvx-h", 5);
    memcpy(msg + n, nc, 32);
    n += 32;
    memcpy(msg + n, server, ls);
    n += ls;
    msg[n++] = '\n';
    memcpy(msg + n, my_addr, lc);
    n += lc;
    msg[n++] = '\n';
    uint64_t be = htobe64(h->time);
    memcpy(msg + n, &be, 8);
    n += 8;
    unsigned len = 32;
    HMAC(EVP_sha256(), secret, (int)secret_len, msg, n, mac, &len);
    h->mac.data = mac;
    h->mac.len = 32;
}

static void bind_mac(const uint8_t key[32], uint64_t conn, uint8_t out[32])
{
    uint8_t msg[16] = "kvx-bind";
    uint64_t le = htole64(conn);
    memcpy(msg + 8, &le, 8);
    unsigned n = 32;
    HMAC(EVP_sha256(), key, 32, msg, sizeof(msg), out, &n);
}

/* ---- UCX ---------------------------------------------------------------- */

static int ep_failed;

static void err_cb(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)arg;
    (void)ep;
    (void)st;
    ep_failed = 1;
}

static ucp_ep_h ep_to(const ProtobufCBinaryData *addr)
{
    ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLER,
                         .address = (const ucp_address_t *)addr->data,
                         .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                         .err_handler = {err_cb, NULL}};
    ucp_ep_h ep;
    if (ucp_ep_create(worker, &p, &ep) != UCS_OK)
        die("ucp_ep_create");
    return ep;
}

static int sent_state;

static void send_cb(void *req, ucs_status_t st, void *user)
{
    (void)user;
    sent_state = st == UCS_OK ? 1 : -1;
    ucp_request_free(req);
}

static void am(ucp_ep_h ep, unsigned id, const void *hdr, size_t hlen,
               const void *buf, size_t len)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = send_cb,
        .flags = UCP_AM_SEND_FLAG_REPLY |
                 (id == AM_DATA ? UCP_AM_SEND_FLAG_RNDV : 0)};
    sent_state = 0;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, hdr, hlen, buf, len, &prm);
    if (UCS_PTR_IS_ERR(r))
        sent_state = -1;
    else if (!r)
        sent_state = 1;
}

static void am_msg(ucp_ep_h ep, const Kvxfer__PeerMsg *m)
{
    size_t n = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *b = malloc(n ? n : 1);
    kvxfer__peer_msg__pack(m, b);
    am(ep, AM_CTRL, NULL, 0, b, n);
    double end = now_s() + 2;
    while (!sent_state && now_s() < end)
        ucp_worker_progress(worker);
    free(b);
}

static void send_bind(ucp_ep_h ep, const uint8_t key[32], uint64_t conn)
{
    uint8_t t[32];
    bind_mac(key, conn, t);
    Kvxfer__PeerBind b = KVXFER__PEER_BIND__INIT;
    b.conn = conn;
    b.mac.data = t;
    b.mac.len = 32;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_BIND;
    m.bind = &b;
    am_msg(ep, &m);
}

/* What came over UCX: kept for the main flow, which never sends from
 * inside a UCX callback. */
static uint8_t *open_buf; /* replay: the first OPEN */
static size_t open_len;

static ucs_status_t on_ctrl(void *arg, const void *hdr, size_t hlen,
                            void *data, size_t len,
                            const ucp_am_recv_param_t *prm)
{
    (void)arg;
    (void)hdr;
    (void)hlen;
    if (prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)
        return UCS_OK; /* control messages are small */
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, len, data);
    if (!m)
        return UCS_OK;
    if (!strcmp(mode, "skip")) {
        say("got %d\n", (int)m->m_case);
    } else if (!strcmp(mode, "replay")) {
        if (m->m_case == KVXFER__PEER_MSG__M_OPEN && !open_buf) {
            open_buf = malloc(len);
            memcpy(open_buf, data, len);
            open_len = len;
        } else if (m->m_case == KVXFER__PEER_MSG__M_OPENED) {
            say("opened\n");
        } else if (m->m_case == KVXFER__PEER_MSG__M_END) {
            say("end %d %s\n", m->end->code,
                m->end->message ? m->end->message : "");
        }
    }
    kvxfer__peer_msg__free_unpacked(m, NULL);
    return UCS_OK;
}

static void progress_for(double s)
{
    double end = now_s() + s;
    do
        ucp_worker_progress(worker);
    while (now_s() < end);
}

/* ---- handshakes ---------------------------------------------------------- */

/* One side of an authenticated connection, as peer.c keeps it. */
typedef struct conn {
    int fd;
    uint8_t nc[32], ns[32], tx[32], rx[32];
    char other[192];
    uint64_t my_conn, its_conn;
    Kvxfer__PeerUcx *its; /* from the handshake (freed with its message) */
    Kvxfer__PeerMsg *keep;
    ucp_ep_h ep;
} conn_t;

/* badaddr: the broken address told instead ("ff", "random", "lane") */
static const char *bad_kind;
static uint8_t bad_bytes[64];
static ProtobufCBinaryData bad_lane;

static void fill_ucx(Kvxfer__PeerUcx *u, uint64_t conn)
{
    u->worker.data = (uint8_t *)my_ucx;
    u->worker.len = my_ucx_len;
    u->conn = conn;
    if (!bad_kind)
        return;
    unsigned off, val;
    if (sscanf(bad_kind, "set:%u:%x", &off, &val) == 2) {
        /* our real worker address with byte OFF (mod its length) set
         * to VAL: a well-formed address but for one byte */
        static uint8_t *set;
        if (!set && !(set = malloc(my_ucx_len)))
            die("malloc");
        memcpy(set, my_ucx, my_ucx_len);
        set[off % my_ucx_len] = (uint8_t)val;
        u->worker.data = set;
        return;
    }
    if (sscanf(bad_kind, "cut:%u", &off) == 1) { /* cut short */
        u->worker.len = off < my_ucx_len ? my_ucx_len - off : 0;
        return;
    }
    if (!strcmp(bad_kind, "long")) { /* one byte past its end */
        static uint8_t *longer;
        if (!longer && !(longer = malloc(my_ucx_len + 1)))
            die("malloc");
        memcpy(longer, my_ucx, my_ucx_len);
        longer[my_ucx_len] = 0;
        u->worker.data = longer;
        u->worker.len = my_ucx_len + 1;
        return;
    }
    if (!strcmp(bad_kind, "random")) {
        if (getrandom(bad_bytes, sizeof(bad_bytes), 0) != sizeof(bad_bytes))
            die("getrandom");
    } else {
        memset(bad_bytes, 0xff, sizeof(bad_bytes));
    }
    if (!strcmp(bad_kind, "lane")) {
        bad_lane.data = bad_bytes;
        bad_lane.len = sizeof(bad_bytes);
        u->lanes = &bad_lane;
        u->n_lanes = 1;
    } else {
        u->worker.data = bad_bytes;
        u->worker.len = sizeof(bad_bytes);
    }
}

/* Client: HELLO, check nothing, RESPONSE with our worker. Returns the
 * AUTH_RESULT code (-1: none came). */
static int auth_to(conn_t *c, const char *ipport)
{
    c->fd = tcp_dial(ipport);
    if (getrandom(c->nc, 32, 0) != 32)
        die("getrandom");
    Kvxfer__PeerMsg out = KVXFER__PEER_MSG__INIT, *m;
    Kvxfer__PeerHello h = KVXFER__PEER_HELLO__INIT;
    uint8_t hm[32];
    hello_fill(&h, c->nc, ipport, hm);
    out.m_case = KVXFER__PEER_MSG__M_HELLO;
    out.hello = &h;
    frame_send(c->fd, &out);
    if (!(m = frame_recv(c->fd, 3)) ||
        m->m_case != KVXFER__PEER_MSG__M_CHALLENGE)
        die("no challenge");
    memcpy(c->ns, m->challenge->nonce.data, 32);
    snprintf(c->other, sizeof(c->other), "%s", m->challenge->address);
    kvxfer__peer_msg__free_unpacked(m, NULL);
    uint8_t t[32];
    mac("kvx-c", c->nc, c->ns, c->other, my_addr, t);
    Kvxfer__PeerResponse r = KVXFER__PEER_RESPONSE__INIT;
    Kvxfer__PeerUcx u = KVXFER__PEER_UCX__INIT;
    c->my_conn = 0x77;
    fill_ucx(&u, c->my_conn);
    r.mac.data = t;
    r.mac.len = 32;
    r.ucx = &u;
    out.m_case = KVXFER__PEER_MSG__M_RESPONSE;
    out.response = &r;
    frame_send(c->fd, &out);
    if (!(m = frame_recv(c->fd, 3)) ||
        m->m_case != KVXFER__PEER_MSG__M_AUTH_RESULT)
        return -1;
    int code = m->auth_result->code;
    c->keep = m;
    c->its = m->auth_result->ucx;
    if (c->its)
        c->its_conn = c->its->conn;
    /* the client's keys (peer.c keys_derive) */
    mac("kvx-lane-s", c->nc, c->ns, c->other, my_addr, c->tx);
    mac("kvx-lane-c", c->nc, c->ns, c->other, my_addr, c->rx);
    return code;
}

/* Server: the daemon that dials us, authenticated properly. */
static void auth_from(conn_t *c)
{
    Kvxfer__PeerMsg out = KVXFER__PEER_MSG__INIT, *m;
    if (!(m = frame_recv(c->fd, 5)) || m->m_case != KVXFER__PEER_MSG__M_HELLO)
        die("no hello");
    memcpy(c->nc, m->hello->nonce.data, 32);
    snprintf(c->other, sizeof(c->other), "%s", m->hello->address);
    kvxfer__peer_msg__free_unpacked(m, NULL);
    if (getrandom(c->ns, 32, 0) != 32)
        die("getrandom");
    uint8_t t[32];
    mac("kvx-s", c->nc, c->ns, my_addr, c->other, t);
    Kvxfer__PeerChallenge ch = KVXFER__PEER_CHALLENGE__INIT;
    ch.address = my_addr;
    ch.nonce.data = c->ns;
    ch.nonce.len = 32;
    ch.mac.data = t;
    ch.mac.len = 32;
    out.m_case = KVXFER__PEER_MSG__M_CHALLENGE;
    out.challenge = &ch;
    frame_send(c->fd, &out);
    if (!(m = frame_recv(c->fd, 5)) ||
        m->m_case != KVXFER__PEER_MSG__M_RESPONSE || !m->response->ucx)
        die("no response");
    c->keep = m;
    c->its = m->response->ucx;
    c->its_conn = c->its->conn;
    Kvxfer__PeerAuthResult r = KVXFER__PEER_AUTH_RESULT__INIT;
    Kvxfer__PeerUcx u = KVXFER__PEER_UCX__INIT;
    c->my_conn = 0x55;
    fill_ucx(&u, c->my_conn);
    r.message = "";
    r.ucx = &u;
    out.m_case = KVXFER__PEER_MSG__M_AUTH_RESULT;
    out.auth_result = &r;
    frame_send(c->fd, &out);
    mac("kvx-lane-s", c->nc, c->ns, my_addr, c->other, c->rx);
    mac("kvx-lane-c", c->nc, c->ns, my_addr, c->other, c->tx);
}

static int tcp_accept(void)
{
    struct pollfd p = {lfd, POLLIN, 0};
    if (poll(&p, 1, 5000) <= 0)
        die("nobody dialled");
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0)
        die("accept");
    return fd;
}

/* ---- modes --------------------------------------------------------------- */

static void run_skip(double seconds)
{
    int fd = tcp_accept();
    Kvxfer__PeerMsg *m = frame_recv(fd, 5), out = KVXFER__PEER_MSG__INIT;
    if (!m || m->m_case != KVXFER__PEER_MSG__M_HELLO)
        die("no hello");
    kvxfer__peer_msg__free_unpacked(m, NULL);
    Kvxfer__PeerAuthResult r = KVXFER__PEER_AUTH_RESULT__INIT;
    Kvxfer__PeerUcx u = KVXFER__PEER_UCX__INIT;
    fill_ucx(&u, 0x33);
    r.message = "";
    r.ucx = &u;
    out.m_case = KVXFER__PEER_MSG__M_AUTH_RESULT;
    out.auth_result = &r;
    frame_send(fd, &out);
    double end = now_s() + seconds;
    while (now_s() < end)
        if ((m = frame_recv(fd, end - now_s()))) {
            say("got %d\n", (int)m->m_case);
            kvxfer__peer_msg__free_unpacked(m, NULL);
        } else {
            progress_for(0.01);
        }
}

static void run_relay(const char *target, double seconds)
{
    int from = tcp_accept(), to = tcp_dial(target);
    double end = now_s() + seconds;
    Kvxfer__PeerMsg *m;
    /* HELLO on, CHALLENGE back, RESPONSE on, the verdict printed */
    if ((m = frame_recv(from, 3))) {
        frame_send(to, m);
        kvxfer__peer_msg__free_unpacked(m, NULL);
    }
    if ((m = frame_recv(to, 3))) {
        frame_send(from, m);
        kvxfer__peer_msg__free_unpacked(m, NULL);
    }
    if ((m = frame_recv(from, 3))) {
        frame_send(to, m);
        kvxfer__peer_msg__free_unpacked(m, NULL);
    }
    if ((m = frame_recv(to, 3))) {
        if (m->m_case == KVXFER__PEER_MSG__M_AUTH_RESULT)
            say("auth_result %d\n", m->auth_result->code);
        kvxfer__peer_msg__free_unpacked(m, NULL);
    }
    while (now_s() < end)
        progress_for(0.01);
}

static void run_claim(const char *target, const char *claimed, double seconds)
{
    int fd = tcp_dial(target);
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerHello hm = KVXFER__PEER_HELLO__INIT;
    uint8_t nonce[32] = {1, 2, 3};
    hm.version = VERSION;
    hm.address = (char *)claimed;
    hm.nonce.data = nonce;
    hm.nonce.len = sizeof(nonce);
    m.m_case = KVXFER__PEER_MSG__M_HELLO;
    m.hello = &hm;
    frame_send(fd, &m);
    Kvxfer__PeerMsg *ch = frame_recv(fd, 2);
    if (ch)
        kvxfer__peer_msg__free_unpacked(ch, NULL);
    Kvxfer__PeerMsg pm = KVXFER__PEER_MSG__INIT;
    pm.m_case = KVXFER__PEER_MSG__M_PING;
    pm.ping = 1;
    frame_send(fd, &pm);
    progress_for(seconds);
}

static void run_replay(const char *target, double seconds)
{
    double end = now_s() + seconds;
    conn_t in = {.fd = tcp_accept()}, out = {0};
    auth_from(&in);
    /* its BIND and OPEN come over UCX; we answer nothing */
    while (!open_buf && now_s() < end)
        progress_for(0.01);
    if (!open_buf)
        die("no OPEN came");
    int code = auth_to(&out, target);
    say("auth_result %d\n", code);
    if (code == 0 && out.its) {
        out.ep = ep_to(&out.its->worker);
        send_bind(out.ep, out.tx, out.its_conn);
        am(out.ep, AM_CTRL, NULL, 0, open_buf, open_len);
        progress_for(0.05);
        am(out.ep, AM_CTRL, NULL, 0, open_buf, open_len);
    }
    while (now_s() < end)
        progress_for(0.01);
}

static void run_lane(const char *target, size_t bytes, double seconds)
{
    snprintf(my_addr, sizeof(my_addr), "kvx://127.0.0.1:1/00000000000000ee");
    conn_t c = {0};
    int code = auth_to(&c, target);
    if (code || !c.its || !c.its->n_lanes)
        die("no lanes told");
    ucp_ep_h ep = ep_to(&c.its->lanes[0]);
    uint8_t key[16], *data = malloc(bytes ? bytes : 1);
    memset(key, 0xab, sizeof(key));
    memset(data, 0x5a, bytes);
    Kvxfer__PeerData d = KVXFER__PEER_DATA__INIT;
    d.stream = 1;
    d.unit_end = 1;
    d.bytes = bytes;
    d.piece_bytes = bytes;
    d.lane_conn = 0x1234567890abcdefull; /* no connection's */
    d.lane_mac.data = key;
    d.lane_mac.len = sizeof(key);
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_DATA;
    m.data = &d;
    size_t hl = kvxfer__peer_msg__get_packed_size(&m);
    uint8_t *h = malloc(hl);
    kvxfer__peer_msg__pack(&m, h);
    am(ep, AM_DATA, h, hl, data, bytes);
    double end = now_s() + seconds, next = 0;
    int said = 0, failed = 0;
    while (now_s() < end && !ep_failed && !failed) {
        ucp_worker_progress(worker);
        if (sent_state && !said) {
            say(sent_state > 0 ? "sent\n" : "send failed\n");
            said = 1;
            next = now_s() + 0.2;
        }
        /* again, until the daemon's closing of its end shows here */
        if (said && sent_state && now_s() >= next) {
            failed = sent_state < 0;
            am(ep, AM_DATA, h, hl, data, bytes);
            next = now_s() + 0.2;
        }
    }
    if (ep_failed || failed)
        say("closed\n");
    free(h);
    free(data);
}

static void run_badaddr(double seconds)
{
    conn_t in = {.fd = tcp_accept()};
    auth_from(&in);
    say("answered\n");
    progress_for(seconds);
}

static void run_badaddr_to(const char *target, double seconds)
{
    conn_t c = {0};
    int code = auth_to(&c, target);
    say("auth_result %d %s\n", code,
        c.keep && c.keep->auth_result->message ? c.keep->auth_result->message
                                               : "");
    progress_for(seconds);
}

/* A socket connecting to sa, not waiting for it (a full backlog at the
 * other end must not hold the flood up). */
static int flood_dial(const struct sockaddr_in *sa)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0)
        die("socket");
    if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) &&
        errno != EINPROGRESS)
        die("connect");
    return fd;
}

static void run_flood(const char *target, int n, double seconds)
{
    struct sockaddr_in sa;
    sockaddr_of(target, &sa);
    struct pollfd *p = calloc((size_t)n, sizeof(*p));
    if (!p)
        die("calloc");
    long reopened = 0;
    for (int i = 0; i < n; i++) {
        p[i].fd = flood_dial(&sa);
        p[i].events = POLLIN;
    }
    say("flood %d\n", n);
    /* a dot every 100 ms: once the reader has closed the pipe, the
     * write fails and the flood ends */
    double end = now_s() + seconds, dot = 0;
    while (now_s() < end) {
        if (now_s() >= dot) {
            if (write(1, ".", 1) != 1)
                break; /* the reader is gone (SIGPIPE may be ignored) */
            dot = now_s() + 0.1;
        }
        if (poll(p, (nfds_t)n, 10) <= 0)
            continue;
        for (int i = 0; i < n; i++) {
            if (!p[i].revents)
                continue;
            /* closed by TARGET, refused, reset: again */
            close(p[i].fd);
            p[i].fd = flood_dial(&sa);
            reopened++;
        }
    }
    if (now_s() >= end)
        say("reopened %ld\n", reopened);
}

/* A daemon's HELLO to sa, captured and replayed (hello, n bytes) on a
 * new socket; -1 if it cannot connect. */
static int replay_dial(const struct sockaddr_in *sa, const uint8_t *hello,
                       size_t n)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket");
    if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) ||
        write(fd, hello, n) != (ssize_t)n) {
        close(fd);
        return -1;
    }
    return fd;
}

static void run_hello_flood(const char *target, int n, double seconds)
{
    struct sockaddr_in sa;
    sockaddr_of(target, &sa);
    snprintf(my_addr, sizeof(my_addr), "kvx://127.0.0.1:1/00000000000000ee");
    /* one HELLO, as a daemon that knows the secret makes it for TARGET:
     * what a stranger on the path may capture, and send again */
    uint8_t nc[32], hm[32], hello[512];
    if (getrandom(nc, sizeof(nc), 0) != sizeof(nc))
        die("getrandom");
    Kvxfer__PeerHello h = KVXFER__PEER_HELLO__INIT;
    hello_fill(&h, nc, target, hm);
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_HELLO;
    m.hello = &h;
    size_t len = kvxfer__peer_msg__get_packed_size(&m);
    uint32_t be = htonl((uint32_t)len);
    memcpy(hello, &be, 4);
    kvxfer__peer_msg__pack(&m, hello + 4);
    len += 4;
    struct pollfd p[64];
    if (n > 64)
        die("at most 64");
    for (int i = 0; i < n; i++)
        p[i] = (struct pollfd){replay_dial(&sa, hello, len), POLLIN, 0};
    say("flood %d\n", n);
    long challenges = 0, refused = 0, closed = 0;
    double end = now_s() + seconds;
    while (now_s() < end) {
        if (poll(p, (nfds_t)n, 10) < 0)
            continue;
        for (int i = 0; i < n; i++) {
            if (p[i].fd >= 0 && !p[i].revents)
                continue;
            Kvxfer__PeerMsg *r = p[i].fd >= 0 ? frame_recv(p[i].fd, 0.5) : NULL;
            if (r && r->m_case == KVXFER__PEER_MSG__M_CHALLENGE) {
                challenges++; /* held, never answered */
                kvxfer__peer_msg__free_unpacked(r, NULL);
                continue;
            }
            if (r && r->m_case == KVXFER__PEER_MSG__M_AUTH_RESULT)
                refused++;
            else if (p[i].fd >= 0)
                closed++;
            if (r)
                kvxfer__peer_msg__free_unpacked(r, NULL);
            if (p[i].fd >= 0)
                close(p[i].fd);
            p[i].fd = replay_dial(&sa, hello, len);
        }
    }
    say("challenges %ld refused %ld closed %ld\n", challenges, refused, closed);
}

static void run_garbage(const char *target, double seconds)
{
    struct sockaddr_in sa;
    sockaddr_of(target, &sa);
    static uint8_t junk[65536];
    if (getrandom(junk, sizeof(junk), 0) != (ssize_t)sizeof(junk))
        die("getrandom");
    uint8_t zeros[17] = {0}, huge[8] = {0x80, 0, 0, 0, 1, 2, 3, 4};
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerHello h = KVXFER__PEER_HELLO__INIT;
    uint8_t nonce[32] = {9};
    h.version = VERSION;
    h.address = "kvx://10.0.0.9:1/00000000000000aa";
    h.nonce.data = nonce;
    h.nonce.len = 32;
    m.m_case = KVXFER__PEER_MSG__M_HELLO;
    m.hello = &h;
    const struct {
        const void *b;
        size_t n;
    } shots[] = {{zeros, sizeof(zeros)},
                 {huge, sizeof(huge)},
                 {junk, sizeof(junk)},
                 {junk, 1}};
    int made = 0;
    for (size_t i = 0; i < sizeof(shots) / sizeof(shots[0]); i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
            if (fd >= 0)
                close(fd);
            continue;
        }
        made++;
        ssize_t w = send(fd, shots[i].b, shots[i].n, MSG_NOSIGNAL);
        (void)w;
        close(fd);
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && !connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
        made++;
        frame_send(fd, &m);
        ssize_t w = send(fd, junk, 4096, MSG_NOSIGNAL);
        (void)w;
        close(fd);
    }
    int idle[100], nidle = 0;
    for (int i = 0; i < 100; i++) {
        int f = socket(AF_INET, SOCK_STREAM, 0);
        if (f >= 0 && !connect(f, (struct sockaddr *)&sa, sizeof(sa)))
            idle[nidle++] = f;
        else if (f >= 0)
            close(f);
    }
    made += nidle;
    say("sent %d\n", made);
    double end = now_s() + seconds;
    while (now_s() < end)
        usleep(10000);
    for (int i = 0; i < nidle; i++)
        close(idle[i]);
}

int main(int argc, char **argv)
{
    if (argc < 4)
        die("usage: fake_peer skip|relay|claim|replay|lane ...");
    mode = argv[1];
    ucp_params_t up = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                       .features = UCP_FEATURE_AM};
    if (ucp_init(&up, NULL, &ctx) != UCS_OK)
        die("ucp_init");
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(ctx, &wp, &worker) != UCS_OK ||
        ucp_worker_get_address(worker, &my_ucx, &my_ucx_len) != UCS_OK)
        die("ucp_worker_create");
    ucp_am_handler_param_t h = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                      UCP_AM_HANDLER_PARAM_FIELD_CB,
        .id = AM_CTRL,
        .cb = on_ctrl};
    if (ucp_worker_set_am_recv_handler(worker, &h) != UCS_OK)
        die("set_am_recv_handler");
    if (!strcmp(mode, "skip")) {
        tcp_listen(argv[2]);
        run_skip(atof(argv[3]));
    } else if (!strcmp(mode, "relay") && argc >= 5) {
        tcp_listen(argv[2]);
        run_relay(argv[3], atof(argv[4]));
    } else if (!strcmp(mode, "claim") && argc >= 5) {
        run_claim(argv[2], argv[3], atof(argv[4]));
    } else if (!strcmp(mode, "replay") && argc >= 6) {
        read_secret(argv[2]);
        tcp_listen(argv[3]);
        run_replay(argv[4], atof(argv[5]));
    } else if (!strcmp(mode, "badaddr") && argc >= 6) {
        read_secret(argv[2]);
        bad_kind = argv[4];
        tcp_listen(argv[3]);
        run_badaddr(atof(argv[5]));
    } else if (!strcmp(mode, "badaddr-to") && argc >= 6) {
        read_secret(argv[2]);
        bad_kind = argv[4];
        snprintf(my_addr, sizeof(my_addr),
                 "kvx://127.0.0.1:1/00000000000000dd");
        run_badaddr_to(argv[3], atof(argv[5]));
    } else if (!strcmp(mode, "hello-flood") && argc >= 6) {
        read_secret(argv[2]);
        run_hello_flood(argv[3], atoi(argv[4]), atof(argv[5]));
    } else if (!strcmp(mode, "flood") && argc >= 5) {
        run_flood(argv[2], atoi(argv[3]), atof(argv[4]));
    } else if (!strcmp(mode, "garbage")) {
        run_garbage(argv[2], atof(argv[3]));
    } else if (!strcmp(mode, "lane") && argc >= 6) {
        read_secret(argv[2]);
        run_lane(argv[3], (size_t)atol(argv[4]), atof(argv[5]));
    } else {
        die("unknown mode");
    }
    say("done\n");
    return 0; /* the process exit closes everything */
}
