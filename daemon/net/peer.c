/*
 * peer — UCX on the loop, connections, authentication, keep-alive; see
 * peer.h.
 *
 * Reading order:
 *   peer_init()      context, worker, event fd on the loop, the
 *                    handshake listener (hs.c), the secret, this
 *                    daemon's address
 *   pump()           the one place the worker is progressed, one call at
 *                    a time: on an idle handle while there is more,
 *                    before the loop sleeps (uv_prepare), and when its
 *                    fd wakes it
 *   peer_connect()   outgoing connection: a handshake socket, HELLO
 *   on_hs_accept     incoming connection: a handshake socket
 *   auth_*           HELLO -> CHALLENGE -> RESPONSE -> AUTH_RESULT on
 *                    the handshake socket, never on UCX; the secret
 *                    never goes on the wire, only HMACs of both nonces
 *                    under it, and each side proves it knows it. Only
 *                    then do the daemons tell each other their UCX
 *                    workers' addresses (PeerUcx, with the lanes')
 *   conn_ready()     an endpoint to the other's worker, whose first
 *                    message (BIND) ties it to the connection: the
 *                    client's first, the server's once that arrived
 *   am_ctrl/am_data  messages in: from a bound endpoint, to the layers
 *                    above
 *   lanes_*          slot data over the lanes (lane.c, peer.lanes):
 *                    data_start() sends over the other side's lanes,
 *                    on_lane_event() runs what the lanes report
 *   conn_fail()      the one way a connection ends
 */
#include <arpa/inet.h>
#include <assert.h>
#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>
#include <uv.h>

#include "core/daemon.h"
#include "core/fault.h"
#include "hs.h"
#include "lane.h"
#include "core/log.h"
#include "peer.h"
#include "ucx.h"

/* 2: the MACs bind both daemons' addresses; 3: polls say what arrived
 * (resume), batches and announcements carry sessions and the instance's
 * epoch; 4: lanes (PeerLanes, PeerData.lane_key); 5: the handshake on a
 * socket of our own, UCX worker addresses after it (PeerUcx, BIND); 7:
 * the HELLO proves the secret (its MAC, server, time) */
#define PEER_VERSION 7
#define LANE_MAC_LEN 16
#define NONCE_LEN 32
#define MAC_LEN 32
#define SECRET_MAX 4096
#define AM_CTRL 1
#define AM_DATA 2
#define MAX_LOST_KEPT 64
/* incoming handshakes open whose HELLO has not proved the secret: in
 * all, and from one IP (hs_make_room()); and those whose HELLO has,
 * beyond which another is not protected (hello_check()) */
#define HS_PENDING_MAX 256
#define HS_PER_SOURCE 8
#define HS_PROVEN_MAX 1024
/* a HELLO's clock against ours, and the nonces of HELLOs kept against
 * replays (hello_check()) */
#define HELLO_SKEW_S 60
#define SEEN_MAX 4096
/* a dial whose handshake the other side cut is tried again, after
 * HS_RETRY_MS doubled each time up to HS_RETRY_MAX_MS, within
 * peer.connect_timeout_ms */
#define HS_RETRY_MS 10
#define HS_RETRY_MAX_MS 500

/* AUTH: the handshake socket; BIND: authenticated (the server), waiting
 * for the client's endpoint to bind; READY: its endpoint made, bound. */
enum conn_state { CONN_AUTH, CONN_BIND, CONN_READY, CONN_LOST };
static const char *const state_names[] = {"connecting", "connecting",
                                          "connected", "lost"};

typedef struct qmsg {
    uint8_t *buf;
    size_t len;
    struct qmsg *next;
} qmsg_t;

struct peer_conn {
    uint64_t id; /* never reused (peer_conn_id) */
    hs_t *hs;    /* the handshake socket, until authenticated */
    ucp_ep_h ep; /* ours, to its worker: what we send on */
    ucp_ep_h rx_ep;    /* UCX's reply endpoint of what it sends, once bound */
    uint8_t *ucx_addr; /* its worker's address (PeerUcx.worker) */
    size_t ucx_addr_len;
    int outgoing;
    enum conn_state state;
    char address[192];          /* the peer's; for incoming: after HELLO */
    uint8_t nonce_c[NONCE_LEN], nonce_s[NONCE_LEN];
    char server_addr[192];      /* outgoing: the address that answered */
    int server_ok;              /* outgoing: its CHALLENGE MAC checked */
    int sec_prev;               /* the handshake proved the previous
                                   secret (a rotation's window) */
    int hello_ok;               /* incoming: its HELLO proved the secret,
                                   fresh: never closed for another */
    /* incoming: the IP it comes from (on_hs_accept()'s per-source cap) */
    int src_family;
    uint8_t src[16];
    /* outgoing: the other side cut the handshake; dialled again at
     * retry_ms (0: not waiting), tries so far, and the last cut */
    uint64_t retry_ms;
    unsigned tries;
    char last_cut[160];
    uint64_t created_ms, last_seen_ms, last_ping_ms;
    uint64_t bytes_sent, bytes_received, errors;
    uint32_t outstanding;       /* UCX requests not yet back */
    int closed;                 /* ucp_ep_close started (or no ep) */
    int close_done;
    /* lost, and remote.c not told yet (peer_flush_lost()) */
    int lost_pending, lost_code;
    unsigned lost_next; /* the loss callback to call next */
    char lost_msg[300];
    qmsg_t *q_head, *q_tail;    /* sends waiting for authentication */
    /* slot sends: peer.send_window in flight, the rest wait here in
     * order (each counted in outstanding) */
    struct ureq *dq_head, *dq_tail;
    uint32_t data_inflight;
    /* of those, sent on the connection's own endpoint (not a lane), and
     * since when none has come back: the same keep-alive as the lanes',
     * which bounds how long a piece sent from a pool holds its fence */
    uint32_t conn_data_inflight;
    uint64_t conn_data_moved_ms;
    /* lanes: the keys of its DATA to us (rx) and ours to it (tx),
     * derived at authentication; our id of the connection (told in
     * PeerUcx) and its; its lanes' worker addresses; our endpoints to its lanes
     * (out) and the ones its data comes in on (in), by lane, 0 for none;
     * whether a send over our lane i has worked yet (until then a failing
     * lane turns lanes off for the connection: lanes_off) */
    uint8_t rx_key[MAC_LEN], tx_key[MAC_LEN];
    uint64_t lane_conn, peer_conn;
    uint8_t *lane_addr[LANES_MAX];
    size_t lane_addr_len[LANES_MAX];
    unsigned peer_lanes, lane_next;
    int lanes_off;
    uint64_t out_lep[LANES_MAX], in_lep[LANES_MAX];
    uint64_t lane_since[LANES_MAX];
    uint8_t lane_ok[LANES_MAX];
    /* sends on our lane i not back yet, and since when it has had them
     * with none coming back (the lanes' keep-alive: peer_tick()) */
    uint32_t lane_inflight[LANES_MAX];
    uint64_t lane_moved_ms[LANES_MAX];
    /* the same for its data coming in over our lanes: receives started
     * and not back, and since when none has come back */
    uint32_t lane_rx_inflight;
    uint64_t lane_rx_moved_ms;
    char transports[128];
    struct peer_conn *next;
};

/* A UCX request of ours: what to do when it comes back. */
typedef struct ureq {
    peer_conn_t *c;
    uint8_t *buf;               /* freed when done (packed control msg) */
    void (*done)(void *arg, int status);
    void *arg;
    /* a receive: the message and where it goes */
    int recv_kind;              /* 0 send, 1 ctrl recv, 2 data recv */
    Kvxfer__PeerMsg *hdr;
    size_t len;
    /* a slot send: its data, and its place in the connection's queue */
    int is_data;
    int on_lane;                /* sent or received by a lane: not in
                                   P.inflight (the loop's worker) */
    int keyed;                  /* its header has lane_conn, lane_mac */
    unsigned lane;              /* on_lane: which */
    /* keyed: its DATA header unpacked, and the MAC, made when the lane
     * is known (the MAC names it) and packed into buf again */
    Kvxfer__PeerData pd;
    uint8_t mac[LANE_MAC_LEN];
    size_t hdr_len;
    const void *data;
    const peer_iov_t *iov; /* niov > 0: the data is there, not data */
    size_t niov;
    struct ureq *next;
} ureq_t;

static struct {
    int on;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_address_t *addr; /* the worker's, told after the handshake */
    size_t addr_len;
    uint8_t *dead_addr; /* FAULT_LANES: a worker that is gone */
    size_t dead_len;
    uv_poll_t poll;
    uv_prepare_t prepare;
    uv_idle_t idle;             /* keeps the loop turning: pump() */
    int idle_on;
    int busy_poll;              /* peer.busy_poll, resolved */
    int stopping;               /* peer_cleanup(): the loop has stopped */
    uint32_t inflight;          /* our UCX requests, every connection */
    int poll_on;
    uint8_t secret[SECRET_MAX];
    size_t secret_len;
    /* the secret before the last reload, accepted in handshakes until
     * prev_until (peer.secret_previous_ms after it) */
    uint8_t prev[SECRET_MAX];
    size_t prev_len;
    uint64_t prev_until;
    peer_conn_t *conns;
    int ucx_cuda;
    char transports[256];       /* every transport a connection used */
    char listen[64];
    struct sockaddr_storage bound; /* the handshake listener's IP:PORT */
    char version[32];
    int rdma; /* UCX may use an RDMA device: peer_rdma() */
    /* the nonces of the HELLOs taken within HELLO_SKEW_S, the oldest
     * overwritten first; seen_floor: the latest time of one overwritten
     * (a HELLO of that time or before can no longer be told from a
     * replay: it goes on, unprotected) */
    struct {
        uint8_t nonce[NONCE_LEN];
        uint64_t time;
    } seen[SEEN_MAX];
    unsigned seen_next, seen_n;
    uint64_t seen_floor;
} P;

static void conn_fail(peer_conn_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void conn_try_free(peer_conn_t *c);

/* ---- UCX on the loop --------------------------------------------------- */

/* One worker progress call at a time. Under load
 * ucp_worker_progress() always finds work, and one call can take a
 * millisecond (a TCP send of megabytes on loopback); draining it until it
 * returned 0 kept the loop in UCX while finished gathers and scatters
 * (copy.c's async), pulls and client requests waited, so slots cycled
 * slower and the wire idled. Between calls the loop handles the rest; an
 * idle handle keeps it turning while there is more. */
static void pump_idle(uv_idle_t *h);

static void idle_set(int on)
{
    if (on == P.idle_on)
        return;
    P.idle_on = on;
    if (on)
        uv_idle_start(&P.idle, pump_idle);
    else
        uv_idle_stop(&P.idle);
}

/* The one place the worker is progressed: one call at a time. Then, unless
 * there is more to do now (more progress, or busy polling while our
 * requests are in flight), the worker is armed and the loop may sleep on
 * its event fd. */
static void pump(void)
{
    if (!P.worker)
        return;
    if (ucp_worker_progress(P.worker)) {
        idle_set(1); /* more to do: come back next turn, after the rest */
        return;
    }
    if (P.busy_poll && P.inflight) {
        /* while transfers are in flight the loop does not sleep between
         * turns, as a busy UCX application would (an event-fd wake-up
         * per fragment costs bandwidth); idle, it sleeps: no spinning */
        idle_set(1);
        return;
    }
    idle_set(ucp_worker_arm(P.worker) == UCS_ERR_BUSY);
}

static void pump_idle(uv_idle_t *h)
{
    (void)h;
    pump();
}

static void inflight_add(int n)
{
    P.inflight += n; /* pump() reads it */
}

static void on_poll(uv_poll_t *h, int status, int events)
{
    (void)h;
    (void)status;
    (void)events;
    pump();
}

/* Runs before the loop blocks: what the loop did this turn (sends,
 * receives) is progressed, and the worker armed unless pump() keeps the
 * loop turning, so no event is missed. (While the idle handle is on this
 * is a turn's second call.) */
static void on_prepare(uv_prepare_t *h)
{
    (void)h;
    pump();
}

/* ---- small helpers ----------------------------------------------------- */

static uint64_t now_ms(void) { return kvxd_now_ms(); }

/* The handshake's MACs: HMAC-SHA256(secret, label | nonce_c | nonce_s |
 * server address | "\n" | client address). Binding both daemons'
 * addresses means a MAC made for one pair of daemons proves nothing for
 * another: a man in the middle cannot relay one daemon's handshake into
 * another connection. */
static void hmac_with(int prev, const char *label, const uint8_t *nc,
                      const uint8_t *ns, const char *server, const char *client,
                      uint8_t out[MAC_LEN])
{
    uint8_t msg[32 + 2 * NONCE_LEN + 2 * 192 + 1]; /* labels < 32 */
    size_t l = strlen(label), ls = strnlen(server, 191),
           lc = strnlen(client, 191), n = 0;
    memcpy(msg, label, l);
    n += l;
    memcpy(msg + n, nc, NONCE_LEN);
    n += NONCE_LEN;
    memcpy(msg + n, ns, NONCE_LEN);
    n += NONCE_LEN;
    memcpy(msg + n, server, ls);
    n += ls;
    msg[n++] = '\n';
    memcpy(msg + n, client, lc);
    n += lc;
    unsigned len = MAC_LEN;
    HMAC(EVP_sha256(), prev ? P.prev : P.secret,
         (int)(prev ? P.prev_len : P.secret_len), msg, n, out, &len);
}

/* The current secret's MAC. */
static void hmac(const char *label, const uint8_t *nc, const uint8_t *ns,
                 const char *server, const char *client, uint8_t out[MAC_LEN])
{
    hmac_with(0, label, nc, ns, server, client, out);
}

/* The HELLO's MAC: HMAC-SHA256(secret, "kvx-h" | nonce_c | server |
 * "\n" | client | "\n" | time as 8 bytes big-endian), server the
 * IP:PORT the client dialled. It binds the listener it was made for and
 * when, so that it proves nothing to another daemon or, past
 * HELLO_SKEW_S, later; the server takes each nonce once. */
static void hello_mac(int prev, const uint8_t *nc, const char *server,
                      const char *client, uint64_t time_s, uint8_t out[MAC_LEN])
{
    uint8_t msg[8 + NONCE_LEN + 2 * 192 + 2 + 8];
    size_t ls = strnlen(server, 191), lc = strnlen(client, 191), n = 5;
    memcpy(msg, "kvx-h", 5);
    memcpy(msg + n, nc, NONCE_LEN);
    n += NONCE_LEN;
    memcpy(msg + n, server, ls);
    n += ls;
    msg[n++] = '\n';
    memcpy(msg + n, client, lc);
    n += lc;
    msg[n++] = '\n';
    uint64_t be = htobe64(time_s);
    memcpy(msg + n, &be, 8);
    n += 8;
    unsigned len = MAC_LEN;
    HMAC(EVP_sha256(), prev ? P.prev : P.secret,
         (int)(prev ? P.prev_len : P.secret_len), msg, n, out, &len);
}

/* Is the previous secret accepted now (a rotation's window)? */
static int prev_open(void)
{
    return P.prev_len && now_ms() < P.prev_until;
}

/* "kvx://IP:PORT/id": the IP:PORT part of a and b are the same (the id
 * changes when a daemon restarts; where it listens does not). */
static int same_listener(const char *a, const char *b)
{
    const char *ea = strrchr(a, '/'), *eb = strrchr(b, '/');
    if (!ea || !eb || ea - a != eb - b)
        return 0;
    return !strncmp(a, b, (size_t)(ea - a));
}

/* a as IPv6 (an IPv4 address as its IPv4-mapped one) */
static struct sockaddr_in6 as_v6(const struct sockaddr_storage *a)
{
    struct sockaddr_in6 o = {.sin6_family = AF_INET6};
    if (a->ss_family == AF_INET6)
        return *(const struct sockaddr_in6 *)a;
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)a;
    o.sin6_port = v4->sin_port;
    o.sin6_addr.s6_addr[10] = o.sin6_addr.s6_addr[11] = 0xff;
    memcpy(&o.sin6_addr.s6_addr[12], &v4->sin_addr, 4);
    return o;
}

/* Do a and b name one IP:PORT, however spelt? */
static int same_sockaddr(const struct sockaddr_storage *a,
                         const struct sockaddr_storage *b)
{
    struct sockaddr_in6 x = as_v6(a), y = as_v6(b);
    return x.sin6_port == y.sin6_port &&
           !memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr));
}

static int ct_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

/* "kvx://IP:PORT/id" -> sockaddr. 0, or KVX_ERR_INVALID with why. */
static int parse_address(const char *a, struct sockaddr_storage *ss,
                         socklen_t *sl, char *why, size_t why_len)
{
    char host[128], port[16];
    const char *p = !strncmp(a, "kvx://", 6) ? a + 6 : NULL;
    const char *slash = p ? strchr(p, '/') : NULL;
    const char *colon = NULL;
    for (const char *q = p; q && q < slash; q++)
        if (*q == ':')
            colon = q;
    if (!p || !slash || !colon || colon - p >= (long)sizeof(host) ||
        slash - colon - 1 >= (long)sizeof(port) || slash == colon + 1) {
        snprintf(why, why_len,
                 "daemon '%s' has no peer listener (its peer.listen is "
                 "empty, or the address is not kvx://IP:PORT/ID)",
                 a);
        return KVX_ERR_INVALID;
    }
    memcpy(host, p, colon - p);
    host[colon - p] = 0;
    memcpy(port, colon + 1, slash - colon - 1);
    port[slash - colon - 1] = 0;
    if (host[0] == '[') { /* [v6]:port */
        memmove(host, host + 1, strlen(host));
        char *e = strchr(host, ']');
        if (e)
            *e = 0;
    }
    struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV,
                             .ai_socktype = SOCK_STREAM},
                    *res;
    int e = getaddrinfo(host, port, &hints, &res);
    if (e) {
        snprintf(why, why_len, "daemon address '%s': %s", a, gai_strerror(e));
        return KVX_ERR_INVALID;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sl = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static int read_secret(char *why, size_t why_len)
{
    uint8_t buf[SECRET_MAX + 1];
    const char *f = kvxd.conf.peer_secret_file;
    int fd = open(f, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) {
        snprintf(why, why_len, "peer.secret_file: %s: %s", f,
                 strerror(errno));
        if (fd >= 0)
            close(fd);
        return KVX_ERR_IO;
    }
    ssize_t n = -1;
    if (st.st_mode & 077)
        snprintf(why, why_len,
                 "peer.secret_file: %s gives group or others access (mode "
                 "%03o); chmod 600 it",
                 f, (unsigned)(st.st_mode & 0777));
    else if ((n = read(fd, buf, sizeof(buf))) < 16 || n > SECRET_MAX)
        snprintf(why, why_len,
                 "peer.secret_file: %s holds %s%zd bytes; the secret needs "
                 "16 to %d (head -c 32 /dev/urandom > FILE)",
                 f, n > SECRET_MAX ? "over " : "", n > SECRET_MAX ? SECRET_MAX : n,
                 SECRET_MAX);
    close(fd);
    if ((st.st_mode & 077) || n < 16 || n > SECRET_MAX) {
        memset(buf, 0, sizeof(buf));
        /* n < 0: read() itself failed; else the file is unfit */
        return n < 0 && !(st.st_mode & 077) ? KVX_ERR_IO : KVX_ERR_INVALID;
    }
    memcpy(P.secret, buf, (size_t)n);
    memset(buf, 0, sizeof(buf));
    P.secret_len = (size_t)n;
    return 0;
}

int peer_reload_secret(void)
{
    if (!P.on)
        return 0;
    uint8_t old[SECRET_MAX];
    size_t old_len = P.secret_len;
    memcpy(old, P.secret, sizeof(old));
    char why[300];
    if (read_secret(why, sizeof(why))) {
        memcpy(P.secret, old, sizeof(old)); /* the running one stays */
        P.secret_len = old_len;
        memset(old, 0, sizeof(old));
        log_error("peer: reload: %s; keeping the running secret", why);
        return KVX_ERR_INVALID;
    }
    if (old_len == P.secret_len && !memcmp(old, P.secret, old_len)) {
        memset(old, 0, sizeof(old));
        return 0;
    }
    memcpy(P.prev, old, sizeof(old));
    P.prev_len = old_len;
    P.prev_until = now_ms() + kvxd.conf.peer_secret_previous_ms;
    memset(old, 0, sizeof(old));
    log_notice("peer: reload: a new secret from %s; handshakes accept the "
               "previous one too for %u ms (peer.secret_previous_ms)",
               kvxd.conf.peer_secret_file, kvxd.conf.peer_secret_previous_ms);
    return 1;
}

/* The transports an endpoint uses, from ucp_ep_print_info ("tl/dev"). */
static void ep_transports(ucp_ep_h ep, char *out, size_t n)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    out[0] = 0;
    if (!m)
        return;
    ucp_ep_print_info(ep, m);
    fclose(m);
    for (char *l = strtok(buf, "\n"); l; l = strtok(NULL, "\n")) {
        char *lane = strstr(l, "lane[");
        char *colon = lane ? strstr(lane, ": ") : NULL;
        if (!colon)
            continue;
        char tl[64];
        /* "lane[0]:  8:tcp/lo.0 md[4] ..." */
        char *s = colon + 2;
        while (*s == ' ')
            s++;
        char *c2 = strchr(s, ':');
        if (c2 && c2 - s < 4)
            s = c2 + 1;
        if (sscanf(s, "%63[^ ]", tl) != 1 || !strchr(tl, '/'))
            continue; /* "cm": the connection manager, not a transport */
        if (!strstr(P.transports, tl) &&
            strlen(P.transports) + strlen(tl) + 2 < sizeof(P.transports)) {
            if (P.transports[0])
                strcat(P.transports, ",");
            strcat(P.transports, tl);
        }
        if (!strstr(out, tl) && strlen(out) + strlen(tl) + 2 < n) {
            if (out[0])
                strcat(out, ",");
            strcat(out, tl);
        }
    }
    free(buf);
}

/* ---- the cluster's networks (peer.allowed) ----------------------------- */

#define NETS_MAX 32

static struct {
    int family;
    uint8_t addr[16];
    unsigned bits;
} nets[NETS_MAX];
static unsigned nnets;
static char nets_text[256];

static int net_add(int family, const void *addr, unsigned bits)
{
    if (nnets == NETS_MAX)
        return KVX_ERR_INVALID;
    nets[nnets].family = family;
    memcpy(nets[nnets].addr, addr, family == AF_INET ? 4 : 16);
    nets[nnets].bits = bits;
    nnets++;
    return 0;
}

/* peer.allowed (checked by the config), or the network of the interface
 * that holds peer.listen's IP. 0, or KVX_ERR_INVALID with why. */
static int nets_init(const struct sockaddr_storage *listen, char *why,
                     size_t why_len)
{
    nnets = 0;
    if (kvxd.conf.peer_allowed[0]) {
        char buf[sizeof(kvxd.conf.peer_allowed)], *save = NULL;
        snprintf(buf, sizeof(buf), "%s", kvxd.conf.peer_allowed);
        for (char *t = strtok_r(buf, ",", &save); t;
             t = strtok_r(NULL, ",", &save)) {
            uint8_t a[16];
            int fam;
            unsigned bits;
            if (conf_net_parse(t, &fam, a, &bits))
                continue; /* the config checked it */
            if (net_add(fam, a, bits)) {
                snprintf(why, why_len, "peer.allowed: more than %d networks",
                         NETS_MAX);
                return KVX_ERR_INVALID;
            }
        }
        snprintf(nets_text, sizeof(nets_text), "%s", kvxd.conf.peer_allowed);
        return 0;
    }
    struct ifaddrs *all, *i;
    if (getifaddrs(&all)) {
        snprintf(why, why_len, "getifaddrs: %s", strerror(errno));
        return KVX_ERR_IO;
    }
    for (i = all; i; i = i->ifa_next) {
        const struct sockaddr *a = i->ifa_addr, *m = i->ifa_netmask;
        if (!a || !m || a->sa_family != listen->ss_family)
            continue;
        const uint8_t *ab, *mb, *lb;
        size_t n = a->sa_family == AF_INET ? 4 : 16;
        if (a->sa_family == AF_INET) {
            ab = (const uint8_t *)&((const struct sockaddr_in *)a)->sin_addr;
            mb = (const uint8_t *)&((const struct sockaddr_in *)m)->sin_addr;
            lb = (const uint8_t *)&((const struct sockaddr_in *)listen)
                     ->sin_addr;
        } else if (a->sa_family == AF_INET6) {
            ab = (const uint8_t *)&((const struct sockaddr_in6 *)a)->sin6_addr;
            mb = (const uint8_t *)&((const struct sockaddr_in6 *)m)->sin6_addr;
            lb = (const uint8_t *)&((const struct sockaddr_in6 *)listen)
                     ->sin6_addr;
        } else {
            continue;
        }
        if (memcmp(ab, lb, n))
            continue;
        unsigned bits = 0;
        for (size_t k = 0; k < n; k++)
            bits += (unsigned)__builtin_popcount(mb[k]);
        net_add(a->sa_family, ab, bits);
        char ip[INET6_ADDRSTRLEN];
        inet_ntop(a->sa_family, ab, ip, sizeof(ip));
        snprintf(nets_text, sizeof(nets_text), "%s/%u (%s's network)", ip, bits,
                 i->ifa_name);
        break;
    }
    freeifaddrs(all);
    if (!nnets) {
        snprintf(why, why_len,
                 "peer.allowed is empty and no interface "
                 "holds peer.listen's IP (%s): name the "
                 "cluster's networks in peer.allowed",
                 kvxd.conf.peer_listen);
        return KVX_ERR_INVALID;
    }
    return 0;
}

static int net_allows(const struct sockaddr_storage *ss)
{
    const uint8_t *b =
        ss->ss_family == AF_INET
            ? (const uint8_t *)&((const struct sockaddr_in *)ss)->sin_addr
            : (const uint8_t *)&((const struct sockaddr_in6 *)ss)->sin6_addr;
    for (unsigned i = 0; i < nnets; i++) {
        if (nets[i].family != ss->ss_family)
            continue;
        unsigned bits = nets[i].bits, k = 0;
        for (; bits >= 8; bits -= 8, k++)
            if (b[k] != nets[i].addr[k])
                break;
        if (bits >= 8)
            continue;
        uint8_t mask = (uint8_t)(0xff00u >> bits);
        if (!bits || ((b[k] ^ nets[i].addr[k]) & mask) == 0)
            return 1;
    }
    return 0;
}

/* ---- connections ------------------------------------------------------- */

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    peer_conn_t *c = arg;
    conn_fail(c, KVX_ERR_PEER_GONE, "endpoint to %s failed: %s",
              c->address[0] ? c->address : "(unauthenticated peer)",
              ucs_status_string(status));
}

static peer_conn_t *conn_new(int outgoing, const char *address)
{
    static uint64_t next_id;
    peer_conn_t *c = calloc(1, sizeof(*c));
    if (c)
        c->id = ++next_id;
    if (!c)
        return NULL;
    c->outgoing = outgoing;
    c->state = CONN_AUTH;
    snprintf(c->address, sizeof(c->address), "%s", address ? address : "");
    c->created_ms = c->last_seen_ms = c->last_ping_ms = now_ms();
    do
        if (getrandom(&c->lane_conn, sizeof(c->lane_conn), 0) !=
            sizeof(c->lane_conn)) {
            free(c);
            return NULL;
        }
    while (!c->lane_conn);
    c->next = P.conns;
    P.conns = c;
    return c;
}

static void conn_free(peer_conn_t *c)
{
    assert(!c->hs && !c->outstanding);
    free(c->ucx_addr);
    for (unsigned i = 0; i < LANES_MAX; i++)
        free(c->lane_addr[i]);
    free(c);
}

static void conn_unlink(peer_conn_t *c)
{
    for (peer_conn_t **pp = &P.conns; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            return;
        }
}

static void ureq_done(ureq_t *u, int status)
{
    peer_conn_t *c = u->c;
    if (u->done)
        u->done(u->arg, status);
    free(u->buf);
    int lane = u->on_lane;
    free(u);
    c->outstanding--;
    if (!lane)
        inflight_add(-1);
    conn_try_free(c);
}

static void data_start(peer_conn_t *c);

static void send_done(ureq_t *u, ucs_status_t status)
{
    if (status != UCS_OK && u->c->state != CONN_LOST)
        conn_fail(u->c, KVX_ERR_PEER_GONE, "send to %s failed: %s",
                  u->c->address, ucs_status_string(status));
    if (u->is_data) {
        assert(u->c->data_inflight > 0 && u->c->conn_data_inflight > 0);
        u->c->data_inflight--;
        u->c->conn_data_inflight--;
        u->c->conn_data_moved_ms = now_ms();
        data_start(u->c); /* before ureq_done, which may free c */
    }
    ureq_done(u, status == UCS_OK ? 0 : KVX_ERR_PEER_GONE);
}

static void send_cb(void *request, ucs_status_t status, void *user_data)
{
    send_done(user_data, status);
    ucp_request_free(request);
}

/* A send UCX finished at once (see am_send), from the loop's next turn:
 * never inside the caller's data_start(). */
static void send_done_later(void *arg)
{
    send_done(arg, UCS_OK);
}

/* Start one AM send of ours. */
static int am_send(peer_conn_t *c, unsigned id, const void *hdr,
                   size_t hdr_len, const void *buf, size_t len, ureq_t *u)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS |
                        UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .cb.send = send_cb,
        .user_data = u,
        /* control messages eager, whatever their size: a large one sent
         * by rendezvous is handled when its data has come, after smaller
         * ones sent later, and the protocol relies on their order */
        .flags = UCP_AM_SEND_FLAG_REPLY |
                 (id == AM_CTRL ? UCP_AM_SEND_FLAG_EAGER : 0)};
    if (u->niov) {
        /* a slot piece sent from its places in a host pool. UCX 1.13's
         * ucp_am_send_nbx ignores the datatype when NO_IMM_CMPL is set
         * too (it sent the iov array itself, count bytes of it): not
         * set; rendezvous, so that it never completes at once */
        prm.op_attr_mask &= ~(uint32_t)UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        prm.op_attr_mask |=
            UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        prm.datatype = ucp_dt_make_iov();
        prm.memory_type = UCS_MEMORY_TYPE_HOST;
        prm.flags |= UCP_AM_SEND_FLAG_RNDV;
        buf = u->iov;
        len = u->niov;
    }
    /* u may be freed inside the call (NO_IMM_CMPL: UCX calls back
     * before returning a send done at once) */
    size_t bytes = hdr_len + (u->niov ? u->len : len);
    u->c = c;
    c->outstanding++;
    inflight_add(1);
    ucs_status_ptr_t r = ucp_am_send_nbx(c->ep, id, hdr, hdr_len, buf, len,
                                         &prm);
    if (UCS_PTR_IS_ERR(r)) {
        c->outstanding--;
        inflight_add(-1);
        return KVX_ERR_PEER_GONE;
    }
    if (!r && kvxd_defer(send_done_later, u)) { /* done at once */
        c->outstanding--;
        inflight_add(-1);
        return KVX_ERR_NOMEM;
    }
    c->bytes_sent += bytes;
    return 0;
}

static int send_packed(peer_conn_t *c, uint8_t *buf, size_t len)
{
    ureq_t *u = calloc(1, sizeof(*u));
    if (!u) {
        free(buf);
        /* a message lost: what the other side waits for never comes, so
         * the connection goes (its transfers end, the next use
         * reconnects) */
        conn_fail(c, KVX_ERR_NOMEM, "out of memory sending to %s",
                  c->address);
        return KVX_ERR_NOMEM;
    }
    u->buf = buf;
    if (am_send(c, AM_CTRL, NULL, 0, buf, len, u)) {
        free(buf);
        free(u);
        conn_fail(c, KVX_ERR_PEER_GONE, "cannot send to %s", c->address);
        return KVX_ERR_PEER_GONE;
    }
    return 0;
}

static uint8_t *pack(const Kvxfer__PeerMsg *m, size_t *len)
{
    *len = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *b = malloc(*len ? *len : 1);
    if (b)
        kvxfer__peer_msg__pack(m, b);
    return b;
}

/* Send now, whatever the state (the handshake itself). */
static int send_now(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    size_t len;
    uint8_t *b = pack(m, &len);
    if (!b) { /* as in send_packed() */
        conn_fail(c, KVX_ERR_NOMEM, "out of memory sending to %s",
                  c->address);
        return KVX_ERR_NOMEM;
    }
    return send_packed(c, b, len);
}

int peer_send(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    if (!c || c->state == CONN_LOST)
        return KVX_ERR_PEER_GONE;
    if (c->state == CONN_READY)
        return send_now(c, m);
    qmsg_t *q = calloc(1, sizeof(*q));
    if (!q || !(q->buf = pack(m, &q->len))) {
        free(q);
        return KVX_ERR_NOMEM;
    }
    if (c->q_tail)
        c->q_tail->next = q;
    else
        c->q_head = q;
    c->q_tail = q;
    return 0;
}

/* The lane for c's next slot send, its endpoint made on first use; -1:
 * none (no lanes here or there), or 0..n-1. Sends take the lanes both
 * sides have in turn. */
static int lane_pick(peer_conn_t *c)
{
    unsigned n = lanes_count();
    if (c->peer_lanes < n)
        n = c->peer_lanes;
    if (!n || c->lanes_off)
        return -1;
    unsigned i = c->lane_next++ % n;
    if (!c->out_lep[i]) {
        lane_connect(i, c->lane_addr[i], c->lane_addr_len[i], &c->out_lep[i]);
        c->lane_since[i] = now_ms();
    }
    return (int)i;
}

/* The MAC of a DATA header sent over a lane: HMAC-SHA256 (first
 * LANE_MAC_LEN bytes), under the direction's key, of the connection id,
 * every field that places the piece, its length and the lane it goes
 * over (so a header seen on one lane proves nothing on another). */
static void lane_mac(const uint8_t key[MAC_LEN], const Kvxfer__PeerData *d,
                     uint64_t len, unsigned lane, uint8_t out[LANE_MAC_LEN])
{
    uint64_t v[10] = {htole64(d->lane_conn),   htole64(d->stream),
                      htole64(d->slot),        htole64(d->unit_begin),
                      htole64(d->unit_end),    htole64(d->bytes),
                      htole64(d->offset),      htole64(d->piece_bytes),
                      htole64(len),            htole64(lane)};
    uint8_t full[MAC_LEN];
    unsigned n = MAC_LEN;
    HMAC(EVP_sha256(), key, MAC_LEN, (const uint8_t *)v, sizeof(v), full,
         &n);
    memcpy(out, full, LANE_MAC_LEN);
}

/* Lanes stop for c: lane `lane` failed before any data went over it
 * (most likely a firewall that lets only peer.listen through). Its slot
 * data goes over the connection itself from now on; the sends on that
 * lane come back failed (its endpoint failed, and closes) and are sent
 * again there (on_lane_event()); sends on other lanes finish where they
 * are. */
static void lanes_off(peer_conn_t *c, unsigned lane, const char *why)
{
    if (!c->lanes_off)
        log_warn("peer %s: lane %u %s before any data went over it; slot "
                 "data to it goes over the connection itself (are UCX's "
                 "ports open between the daemons?)",
                 c->address, lane, why);
    c->lanes_off = 1;
    if (c->out_lep[lane]) {
        lane_close(lane, c->out_lep[lane]);
        c->out_lep[lane] = 0;
    }
}

/* u's header, packed into its buffer (sized for it by
 * peer_send_data(): lane_mac is always LANE_MAC_LEN bytes, or absent) */
static void data_pack(ureq_t *u)
{
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_DATA;
    m.data = &u->pd;
    kvxfer__peer_msg__pack(&m, u->buf);
}

/* Start queued slot sends while the window has room: over a lane, or
 * the connection's own endpoint. A send UCX refuses fails the
 * connection, which ends the queue. */
static void data_start(peer_conn_t *c)
{
    while (c->state == CONN_READY && c->dq_head &&
           c->data_inflight < kvxd.conf.send_window) {
        ureq_t *u = c->dq_head;
        c->dq_head = u->next;
        if (!c->dq_head)
            c->dq_tail = NULL;
        u->next = NULL;
        c->data_inflight++;
        int lane = u->keyed ? lane_pick(c) : -1;
        if (lane >= 0) {
            /* c->outstanding still counts it, until LEV_SENT */
            u->on_lane = 1;
            u->lane = (unsigned)lane;
            /* the MAC names the lane: made now that it is known */
            lane_mac(c->tx_key, &u->pd, u->len, u->lane, u->mac);
            data_pack(u);
            if (!c->lane_inflight[lane]++)
                c->lane_moved_ms[lane] = now_ms();
            lane_send((unsigned)lane, c->out_lep[lane], u->buf, u->hdr_len,
                      u->data, u->len, (const ucp_dt_iov_t *)u->iov, u->niov,
                      u);
            c->bytes_sent += u->hdr_len + u->len;
            continue;
        }
        u->on_lane = 0;
        data_pack(u);
        c->outstanding--; /* am_send counts it again */
        /* counted first: UCX may call back inside am_send */
        if (!c->conn_data_inflight++)
            c->conn_data_moved_ms = now_ms();
        if (am_send(c, AM_DATA, u->buf, u->hdr_len, u->data, u->len, u)) {
            assert(c->data_inflight > 0);
            c->data_inflight--;
            c->conn_data_inflight--;
            c->outstanding++;
            u->next = c->dq_head; /* conn_fail gives it back with the rest */
            c->dq_head = u;
            if (!c->dq_tail)
                c->dq_tail = u;
            conn_fail(c, KVX_ERR_PEER_GONE, "cannot send to %s",
                      c->address);
            return;
        }
    }
}

int peer_rdma(void)
{
    return P.rdma;
}

int peer_send_queued(const peer_conn_t *c, const void *arg)
{
    for (const ureq_t *u = c->dq_head; u; u = u->next)
        if (u->arg == arg)
            return 1;
    return 0;
}

int peer_send_data(peer_conn_t *c, const Kvxfer__PeerMsg *hdr, const void *buf,
                   size_t len, const peer_iov_t *iov, size_t niov,
                   void (*done)(void *arg, int status), void *arg)
{
    if (!c || c->state != CONN_READY)
        return KVX_ERR_PEER_GONE;
    if (hdr->m_case != KVXFER__PEER_MSG__M_DATA)
        return KVX_ERR_INVALID;
    ureq_t *u = calloc(1, sizeof(*u));
    if (!u)
        return KVX_ERR_NOMEM;
    /* what the other side's lanes check (ignored on the connection): the
     * MAC is made, and the header packed, once the way is known
     * (data_start()) */
    u->pd = *hdr->data;
    if (c->peer_lanes) {
        u->pd.lane_conn = c->peer_conn;
        u->pd.lane_mac.len = LANE_MAC_LEN;
        u->pd.lane_mac.data = u->mac;
    }
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_DATA;
    m.data = &u->pd;
    size_t hl = kvxfer__peer_msg__get_packed_size(&m);
    uint8_t *hb = malloc(hl ? hl : 1);
    if (!hb) {
        free(u);
        return KVX_ERR_NOMEM;
    }
    /* kept until completion: a rendezvous sends the header late */
    u->c = c;
    u->buf = hb;
    u->hdr_len = hl;
    u->data = buf;
    u->len = len;
    u->iov = niov ? iov : NULL;
    u->niov = niov;
    u->is_data = 1;
    u->keyed = c->peer_lanes != 0;
    u->done = done;
    u->arg = arg;
    c->outstanding++; /* waiting: keeps c until it is given back */
    if (c->dq_tail)
        c->dq_tail->next = u;
    else
        c->dq_head = u;
    c->dq_tail = u;
    data_start(c);
    return 0;
}

static void close_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    peer_conn_t *c = user_data;
    ucp_request_free(request);
    c->close_done = 1;
    conn_try_free(c);
}

static void conn_close_ep(peer_conn_t *c)
{
    if (c->closed)
        return;
    c->closed = 1;
    /* its endpoints on the lanes too: sends and receives on them come
     * back failed (LEV_SENT, LEV_RECEIVED; counted in outstanding). A
     * lane holds no pointer to c, only its requests' */
    for (unsigned i = 0; i < LANES_MAX; i++) {
        if (c->out_lep[i])
            lane_close(i, c->out_lep[i]);
        if (c->in_lep[i])
            lane_close(i, c->in_lep[i]);
    }
    if (!c->ep) {
        c->close_done = 1;
        return;
    }
    if (!ucx_close(c->ep, close_cb, c))
        c->close_done = 1;
}

/* Free a lost connection once UCX has given back everything of it. Lost
 * connections beyond MAX_LOST_KEPT are dropped from the status list. */
static void conn_try_free(peer_conn_t *c)
{
    if (c->state != CONN_LOST || c->outstanding || !c->close_done)
        return;
    unsigned lost = 0;
    for (peer_conn_t *x = P.conns; x; x = x->next)
        lost += x->state == CONN_LOST;
    int replaced = 0;
    for (peer_conn_t *x = P.conns; x; x = x->next)
        if (x != c && x->state != CONN_LOST &&
            x->outgoing == c->outgoing && !strcmp(x->address, c->address))
            replaced = 1;
    if (replaced || lost > MAX_LOST_KEPT || !c->address[0] || c->ep == NULL) {
        conn_unlink(c);
        conn_free(c);
    }
}

/* What the layers above registered (peer.h). */
#define MSG_KINDS 32
#define LOST_CBS 4
static struct {
    peer_msg_cb msg[MSG_KINDS];
    peer_lost_cb lost[LOST_CBS];
    unsigned nlost;
    peer_data_ops_t data;
} H;

/* Tell the loss callbacks of every loss conn_fail() deferred (a loss it handles
 * may fail more connections: until none is left). One remote.c cannot
 * take yet (out of memory) stays pending: the tick (peer_tick()) tries
 * again, and closes nothing pending. */
static void peer_flush_lost(void)
{
    for (int again = 1; again;) {
        again = 0;
        for (peer_conn_t *c = P.conns; c; c = c->next)
            if (c->lost_pending) {
                c->lost_pending = 0;
                char m[512]; /* worded once, for every callback */
                snprintf(m, sizeof(m), "daemon %s: %s", c->address,
                         c->lost_msg);
                for (; c->lost_next < H.nlost; c->lost_next++)
                    if (H.lost[c->lost_next](c, c->lost_code, m)) {
                        c->lost_pending = 1;
                        return;
                    }
                again = 1;
                break; /* the list may have changed */
            }
    }
}

static void flush_lost(void *arg)
{
    (void)arg;
    peer_flush_lost();
}

/* c's queued slot sends, never started, back to their owners. */
static void dq_give_back(peer_conn_t *c)
{
    while (c->dq_head) {
        ureq_t *u = c->dq_head;
        c->dq_head = u->next;
        if (u->done)
            u->done(u->arg, KVX_ERR_PEER_GONE);
        free(u->buf);
        free(u);
        c->outstanding--;
    }
    c->dq_tail = NULL;
}

static void dq_give_back_later(void *arg)
{
    dq_give_back(arg);
    conn_try_free(arg);
}

static void conn_fail(peer_conn_t *c, int code, const char *fmt, ...)
{
    if (c->state == CONN_LOST)
        return;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    int was_ready = c->state == CONN_READY;
    c->state = CONN_LOST;
    c->errors++;
    if (c->hs) { /* what was sent (a refusal) still goes out */
        hs_close(c->hs);
        c->hs = NULL;
    }
    if (was_ready || c->outgoing)
        log_warn("peer %s: %s", c->address[0] ? c->address : "(incoming)",
                 msg);
    while (c->q_head) {
        qmsg_t *q = c->q_head;
        c->q_head = q->next;
        free(q->buf);
        free(q);
    }
    c->q_tail = NULL;
    /* queued slot sends never started: their owners get them back from
     * the loop's next turn, never inside this call, whose caller (a send)
     * may still use what a give-back ends (a piece sent from a pool
     * releases its offer's fence); c stays meanwhile (each still counts
     * in outstanding). The loop stopped (peer_cleanup()), or out of
     * memory: now. */
    if (c->dq_head &&
        (P.stopping || !P.poll_on || kvxd_defer(dq_give_back_later, c)))
        dq_give_back(c);
    /* an incoming connection that never authenticated carries nothing,
     * and the address it claimed is unproven: it ends no transfer.
     * remote.c hears of the loss from the loop's next turn, never from
     * inside this call: its caller (a send, a connect) still uses the
     * streams and requests that the loss ends and frees */
    if (was_ready || c->outgoing) {
        c->lost_pending = 1;
        c->lost_code = code;
        snprintf(c->lost_msg, sizeof(c->lost_msg), "%s", msg);
        if (P.poll_on) /* else (no memory) the tick flushes it */
            kvxd_defer(flush_lost, NULL);
    }
    /* the endpoint is closed from the tick, never from inside a UCX
     * callback (UCX may still be failing it there) */
}

/* The directions' keys, as the handshake's MACs are made (S the listening
 * daemon's address, D the connecting one's): both daemons derive them,
 * neither sends them. They prove BIND and every DATA over a lane. */
static void keys_derive(peer_conn_t *c)
{
    const char *sa = c->outgoing ? c->server_addr : kvxd.address;
    const char *da = c->outgoing ? kvxd.address : c->address;
    hmac_with(c->sec_prev, "kvx-lane-s", c->nonce_c, c->nonce_s, sa, da,
              c->outgoing ? c->tx_key : c->rx_key);
    hmac_with(c->sec_prev, "kvx-lane-c", c->nonce_c, c->nonce_s, sa, da,
              c->outgoing ? c->rx_key : c->tx_key);
}

static void bind_mac(const uint8_t key[MAC_LEN], uint64_t conn,
                     uint8_t out[MAC_LEN])
{
    uint8_t msg[8 + 8] = "kvx-bind";
    uint64_t le = htole64(conn);
    memcpy(msg + 8, &le, 8);
    unsigned n = MAC_LEN;
    HMAC(EVP_sha256(), key, MAC_LEN, msg, sizeof(msg), out, &n);
}

/* What we tell the other daemon once it has proved the secret. */
static void ucx_info_fill(Kvxfer__PeerUcx *u, ProtobufCBinaryData *lanes)
{
    int dead = lanes_count() && fault_hit(FAULT_LANES);
    u->worker.data = (uint8_t *)P.addr;
    u->worker.len = P.addr_len;
    for (unsigned i = 0; i < lanes_count(); i++) {
        /* the fault: lanes nobody answers on (a firewall) */
        lanes[i].data =
            dead ? P.dead_addr : (uint8_t *)lane_address(i, &lanes[i].len);
        if (dead)
            lanes[i].len = P.dead_len;
    }
    u->n_lanes = lanes_count();
    u->lanes = lanes;
}

/* Whether one of the worker addresses the other daemon told (what, "its
 * worker's" or "lane N's") can go to UCX: ucx_addr_check(). (Its own
 * address is fine: a daemon may dial itself, and UCX connects a worker
 * to itself.) 0, or KVX_ERR_PROTOCOL with why. */
static int ucx_addr_ok(const ProtobufCBinaryData *b, const char *what,
                       char *why, size_t why_len)
{
    char d[128];
    if (ucx_addr_check(b->data, b->len, NULL, d, sizeof(d))) {
        snprintf(why, why_len, "%s UCX address: %s", what, d);
        return KVX_ERR_PROTOCOL;
    }
    return 0;
}

/* What the other daemon told: kept for conn_ready() and the lanes, once
 * every address in it passed ucx_addr_ok() (nothing a peer sends reaches
 * UCX unchecked). 0, or KVX_ERR_PROTOCOL or KVX_ERR_NOMEM with why. */
static int ucx_info_take(peer_conn_t *c, const Kvxfer__PeerUcx *u, char *why,
                         size_t why_len)
{
    if (!u || !u->worker.len || !u->conn || u->n_lanes > LANES_MAX) {
        snprintf(why, why_len,
                 !u               ? "no UCX addresses"
                 : !u->worker.len ? "no UCX worker address"
                 : !u->conn       ? "connection id 0"
                                  : "more lanes than %d",
                 LANES_MAX);
        return KVX_ERR_PROTOCOL;
    }
    int rc = ucx_addr_ok(&u->worker, "its worker's", why, why_len);
    for (size_t i = 0; !rc && i < u->n_lanes; i++) {
        char what[32];
        snprintf(what, sizeof(what), "its lane %zu's", i);
        rc = ucx_addr_ok(&u->lanes[i], what, why, why_len);
    }
    if (rc)
        return rc;
    snprintf(why, why_len, "out of memory for its UCX addresses");
    if (!(c->ucx_addr = malloc(u->worker.len)))
        return KVX_ERR_NOMEM;
    memcpy(c->ucx_addr, u->worker.data, u->worker.len);
    c->ucx_addr_len = u->worker.len;
    for (size_t i = 0; i < u->n_lanes; i++) {
        if (!(c->lane_addr[i] = malloc(u->lanes[i].len)))
            return KVX_ERR_NOMEM;
        memcpy(c->lane_addr[i], u->lanes[i].data, u->lanes[i].len);
        c->lane_addr_len[i] = u->lanes[i].len;
    }
    c->peer_lanes = (unsigned)u->n_lanes;
    c->peer_conn = u->conn;
    return 0;
}

/* Authenticated: our endpoint to its worker, BIND first on it, then what
 * waited. The client comes here on AUTH_RESULT, the server once the
 * client's BIND has come (so that nothing of ours reaches the client
 * before it knows the handshake is over). */
static void conn_ready(peer_conn_t *c)
{
    assert(c->state == CONN_AUTH || c->state == CONN_BIND);
    ucs_status_t st =
        ucx_connect_addr(P.worker, c->ucx_addr, ep_err_cb, c, &c->ep);
    if (st != UCS_OK) {
        conn_fail(c, KVX_ERR_PEER_GONE, "cannot make an endpoint to %s: %s",
                  c->address, ucs_status_string(st));
        return;
    }
    c->state = CONN_READY;
    c->last_seen_ms = now_ms();
    ep_transports(c->ep, c->transports, sizeof(c->transports));
    log_info("peer %s: authenticated (%s, %s)", c->address,
             c->outgoing ? "outgoing" : "incoming",
             c->transports[0] ? c->transports : "transports unknown");
    uint8_t mac[MAC_LEN];
    bind_mac(c->tx_key, c->peer_conn, mac);
    Kvxfer__PeerBind bd = KVXFER__PEER_BIND__INIT;
    bd.conn = c->peer_conn;
    bd.mac.data = mac;
    bd.mac.len = MAC_LEN;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_BIND;
    m.bind = &bd;
    if (send_now(c, &m))
        return;
    while (c->q_head && c->state == CONN_READY) {
        qmsg_t *q = c->q_head;
        c->q_head = q->next;
        if (!c->q_head)
            c->q_tail = NULL;
        uint8_t *b = q->buf;
        size_t len = q->len;
        free(q);
        send_packed(c, b, len);
    }
}

/* A BIND from an endpoint no connection has: ties it to the one it
 * names, if its MAC proves the daemon at the other end of that
 * connection sent it. Anything else from such an endpoint is dropped. */
static void bind_msg(ucp_ep_h from, const uint8_t *buf, size_t len)
{
    Kvxfer__PeerMsg *m =
        len <= 256 ? kvxfer__peer_msg__unpack(NULL, len, buf) : NULL;
    peer_conn_t *c = NULL;
    if (m && m->m_case == KVXFER__PEER_MSG__M_BIND &&
        m->bind->mac.len == MAC_LEN) {
        for (c = P.conns; c; c = c->next)
            if (c->lane_conn == m->bind->conn && !c->rx_ep &&
                (c->state == CONN_BIND || c->state == CONN_READY))
                break;
        uint8_t mac[MAC_LEN];
        if (c) {
            bind_mac(c->rx_key, c->lane_conn, mac);
            if (!ct_equal(mac, m->bind->mac.data, MAC_LEN))
                c = NULL;
        }
    }
    if (m)
        kvxfer__peer_msg__free_unpacked(m, NULL);
    if (!c) {
        static uint64_t last;
        uint64_t now = now_ms();
        if (now >= last + 1000) { /* at most once a second */
            last = now;
            log_warn("peers: a %zu-byte message from a UCX endpoint that no "
                     "authenticated connection bound; dropped",
                     len);
        }
        return;
    }
    c->rx_ep = from;
    c->last_seen_ms = now_ms();
    if (c->state == CONN_BIND)
        conn_ready(c);
}

/* A handshake message out, on the socket. */
static void hs_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    size_t len;
    uint8_t *b = pack(m, &len);
    int rc = b && c->hs ? hs_send(c->hs, b, len) : KVX_ERR_NOMEM;
    free(b);
    if (rc)
        conn_fail(c, rc, "cannot send the handshake to %s",
                  c->address[0] ? c->address : "(incoming)");
}

static void hs_frame(void *arg, const uint8_t *buf, size_t len);
static void auth_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m);
static void hs_ended(void *arg, const char *why);
static const hs_cbs_t hs_cbs = {hs_frame, hs_ended};

/* c's handshake from its start: a fresh nonce, a socket to ss (its
 * address's), HELLO. 0, or an error with why (c failed). */
static int conn_dial(peer_conn_t *c, const struct sockaddr_storage *ss,
                     char *why, size_t why_len)
{
    memset(c->nonce_s, 0, NONCE_LEN);
    c->server_addr[0] = 0;
    c->server_ok = 0;
    c->retry_ms = 0;
    if (getrandom(c->nonce_c, NONCE_LEN, 0) != NONCE_LEN) {
        conn_fail(c, KVX_ERR_IO, "getrandom failed");
        snprintf(why, why_len, "getrandom failed");
        return KVX_ERR_IO;
    }
    if (!(c->hs = hs_dial(ss, &hs_cbs, c))) {
        conn_fail(c, KVX_ERR_PEER_GONE, "cannot connect");
        snprintf(why, why_len, "cannot connect to daemon %s", c->address);
        return KVX_ERR_PEER_GONE;
    }
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerHello h = KVXFER__PEER_HELLO__INIT;
    h.version = PEER_VERSION;
    h.address = kvxd.address;
    h.nonce.data = c->nonce_c;
    h.nonce.len = NONCE_LEN;
    /* proved at once: the server tells it from a stranger's (its caps)
     * before it answers; under the previous secret too in our window,
     * for a server that has not rotated yet */
    char server[160];
    const char *lp = c->address + 6, *slash = strchr(lp, '/');
    snprintf(server, sizeof(server), "%.*s", (int)(slash - lp), lp);
    uint8_t mac[MAC_LEN], mac_p[MAC_LEN];
    h.server = server;
    h.time = (uint64_t)time(NULL);
    hello_mac(0, c->nonce_c, server, kvxd.address, h.time, mac);
    h.mac.data = mac;
    h.mac.len = MAC_LEN;
    if (prev_open()) {
        hello_mac(1, c->nonce_c, server, kvxd.address, h.time, mac_p);
        h.mac_previous.data = mac_p;
        h.mac_previous.len = MAC_LEN;
    }
    m.m_case = KVXFER__PEER_MSG__M_HELLO;
    m.hello = &h;
    hs_msg(c, &m);
    if (c->state == CONN_LOST) {
        snprintf(why, why_len, "cannot send to daemon %s", c->address);
        return KVX_ERR_PEER_GONE;
    }
    return 0;
}

/* A dial whose handshake was cut, again (peer_tick()). */
static void conn_redial(peer_conn_t *c)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    char why[256];
    if (parse_address(c->address, &ss, &sl, why, sizeof(why))) {
        conn_fail(c, KVX_ERR_INVALID, "%s", why);
        return;
    }
    log_debug("peer %s: connecting again (try %u; %s)", c->address,
              c->tries + 1, c->last_cut);
    conn_dial(c, &ss, why, sizeof(why));
}

peer_conn_t *peer_connect(const char *address, char *why, size_t why_len)
{
    if (!P.on) {
        snprintf(why, why_len,
                 "daemon '%s' is another daemon, and transfers between "
                 "daemons are off here (peer.listen is empty)",
                 address);
        return NULL;
    }
    for (peer_conn_t *c = P.conns; c; c = c->next)
        if (c->outgoing && c->state != CONN_LOST &&
            !strcmp(c->address, address))
            return c;
    struct sockaddr_storage ss;
    socklen_t sl;
    if (peer_address_check(address, why, why_len) ||
        parse_address(address, &ss, &sl, why, why_len))
        return NULL;
    peer_conn_t *c = conn_new(1, address);
    if (!c) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    if (conn_dial(c, &ss, why, why_len))
        return NULL;
    log_debug("peer %s: connecting", address);
    return c;
}

uint64_t peer_conn_id(const peer_conn_t *c)
{
    return c->id;
}

peer_conn_t *peer_conn_find(uint64_t id)
{
    for (peer_conn_t *c = P.conns; c; c = c->next)
        if (c->id == id)
            return c;
    return NULL;
}

const char *peer_conn_address(const peer_conn_t *c) { return c->address; }

/* Without a peer listener an address is kvx://HOST/ID, and the first
 * half of ID names the daemon by its socket path (make_address()): the
 * same host and half with another second half is an earlier run. */
static int earlier_local(const char *address)
{
    const char *id = strrchr(address, '/'), *ours = strrchr(kvxd.address, '/');
    size_t half = ours ? strlen(ours + 1) / 2 : 0;
    return id && ours && half && id - address == ours - kvxd.address &&
           !strncmp(address, kvxd.address, (size_t)(ours - kvxd.address)) &&
           strlen(id + 1) == 2 * half && !strncmp(id + 1, ours + 1, half) &&
           strcmp(id, ours);
}

int peer_address_alias(const char *address, char *why, size_t why_len)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    char w[8];
    if (!strcmp(address, kvxd.address))
        return 0;
    const char *id = strrchr(address, '/'), *ours = strrchr(kvxd.address, '/');
    if (!P.on) {
        if (!earlier_local(address))
            return 0;
        snprintf(why, why_len,
                 "daemon '%s' was issued by an earlier run of this daemon "
                 "(its id was %s, this run is %s)",
                 address, id + 1, ours + 1);
        return KVX_ERR_PEER_GONE;
    }
    if (parse_address(address, &ss, &sl, w, sizeof(w)) ||
        !same_sockaddr(&ss, &P.bound))
        return 0;
    /* our listener, spelt otherwise or under another id: never a peer
     * (it would dial itself); by the id, an earlier run's */
    int earlier = !id || strcmp(id, ours);
    if (earlier)
        snprintf(why, why_len,
                 "daemon '%s' is this daemon's listener under another id, "
                 "not dialled: issued by an earlier run of this daemon (its "
                 "id was %s, this run is %s)",
                 address, id ? id + 1 : "", ours + 1);
    else
        snprintf(why, why_len,
                 "daemon '%s' is this daemon, spelt otherwise (its address "
                 "is '%s')",
                 address, kvxd.address);
    return earlier ? KVX_ERR_PEER_GONE : KVX_ERR_INVALID;
}

int peer_address_check(const char *address, char *why, size_t why_len)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    int rc;
    if (!strcmp(address, kvxd.address))
        return 0;
    if ((rc = peer_address_alias(address, why, why_len)))
        return rc;
    if (parse_address(address, &ss, &sl, why, why_len))
        return KVX_ERR_INVALID;
    if (P.on && !net_allows(&ss)) {
        snprintf(why, why_len,
                 "daemon '%s' is outside the cluster's "
                 "networks (peer.allowed: %s): not dialled",
                 address, nets_text);
        return KVX_ERR_INVALID;
    }
    return 0;
}

void peer_token(const char *instance, uint32_t owner_uid, const char *addr0,
                uint64_t request, uint8_t out[16])
{
    uint8_t buf[512], mac[MAC_LEN];
    int n = snprintf((char *)buf, sizeof(buf), "kvx-token\n%s\n%u\n%s\n%llu",
                     instance, owner_uid, addr0, (unsigned long long)request);
    unsigned ml = MAC_LEN;
    HMAC(EVP_sha256(), P.secret, (int)P.secret_len, buf,
         (size_t)(n < (int)sizeof(buf) ? n : (int)sizeof(buf) - 1), mac, &ml);
    memcpy(out, mac, 16);
}
int peer_conn_alive(const peer_conn_t *c) { return c->state != CONN_LOST; }

int peer_conn_lanes(const peer_conn_t *c)
{
    return c->state == CONN_READY && c->peer_lanes && lanes_count() &&
           !c->lanes_off;
}

/* The IP of ss, as a connection keeps it. */
static void src_of(const struct sockaddr_storage *ss, int *family,
                   uint8_t ip[16])
{
    *family = ss->ss_family;
    memset(ip, 0, 16);
    if (ss->ss_family == AF_INET6)
        memcpy(ip, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
    else
        memcpy(ip, &((const struct sockaddr_in *)ss)->sin_addr, 4);
}

/* An incoming handshake open whose HELLO has not proved the secret
 * (none yet, a partial one, or one not fresh): the handshake caps close
 * the oldest of these for a new socket. */
static int hs_unproven(const peer_conn_t *c)
{
    return !c->outgoing && c->state == CONN_AUTH && c->hs && !c->hello_ok;
}

/* Unproven handshakes are capped, HS_PER_SOURCE from one IP and
 * HS_PENDING_MAX in all: past a cap the oldest (from ip's, at its cap)
 * is closed, after what it has sent is read (a daemon's HELLO that came
 * unread proves itself there, and its socket stays). One whose HELLO
 * proved the secret is never closed for another. name: the new
 * socket's, for the log. */
static void hs_make_room(int fam, const uint8_t ip[16], const char *name)
{
    for (;;) {
        unsigned all = 0, mine = 0;
        peer_conn_t *old = NULL, *old_mine = NULL;
        for (peer_conn_t *c = P.conns; c; c = c->next) {
            if (!hs_unproven(c))
                continue;
            int same = c->src_family == fam && !memcmp(c->src, ip, 16);
            all++;
            mine += same;
            if (!old || c->id < old->id)
                old = c;
            if (same && (!old_mine || c->id < old_mine->id))
                old_mine = c;
        }
        int at_source = mine > HS_PER_SOURCE;
        peer_conn_t *v = at_source              ? old_mine
                         : all > HS_PENDING_MAX ? old
                                                : NULL;
        if (!v)
            return;
        hs_read_now(v->hs);
        if (!hs_unproven(v))
            continue; /* it proved itself, or ended */
        static uint64_t last;
        uint64_t now = now_ms();
        if (now >= last + 1000) { /* at most once a second */
            last = now;
            if (at_source)
                log_warn("peers: %u handshakes open from %s's IP that have "
                         "not proved the cluster secret (at most %d from one "
                         "IP); the oldest is closed",
                         mine, name, HS_PER_SOURCE);
            else
                log_warn("peers: %u handshakes open that have not proved the "
                         "cluster secret (at most %d); the oldest is closed",
                         all, HS_PENDING_MAX);
        }
        conn_fail(v, KVX_ERR_LIMIT, "too many handshakes open");
    }
}

/* A new handshake socket. A daemon sends its HELLO as it connects, so
 * most often it is here already: read at once, a HELLO that proves the
 * secret keeps the socket from the caps before any stranger's can
 * take its room (hs_make_room()). A stranger holding sockets open, from
 * one IP or many, whatever it sends, keeps out only its own; a daemon
 * whose socket was closed before its HELLO came dials again
 * (hs_ended()), and each handshake ends by peer.connect_timeout_ms. */
static void on_hs_accept(hs_t *h)
{
    struct sockaddr_storage from;
    if (hs_peer_addr(h, &from) || !net_allows(&from)) {
        static uint64_t last;
        uint64_t now = now_ms();
        if (now >= last + 1000) { /* at most once a second */
            last = now;
            log_warn("peers: %s is outside the cluster's networks "
                     "(peer.allowed: %s); closed",
                     hs_peer_name(h), nets_text);
        }
        hs_close(h);
        return;
    }
    peer_conn_t *c = conn_new(0, NULL);
    if (!c) {
        hs_close(h);
        return;
    }
    char name[64];
    snprintf(name, sizeof(name), "%s", hs_peer_name(h));
    src_of(&from, &c->src_family, c->src);
    c->hs = h;
    hs_attach(h, &hs_cbs, c);
    if (c->hs)
        hs_read_now(c->hs);
    hs_make_room(c->src_family, c->src, name);
}

static void hs_frame(void *arg, const uint8_t *buf, size_t len)
{
    peer_conn_t *c = arg;
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, len, buf);
    if (!m) {
        conn_fail(c, KVX_ERR_PROTOCOL, "malformed handshake message from %s",
                  c->hs ? hs_peer_name(c->hs) : "?");
        return;
    }
    c->last_seen_ms = now_ms();
    auth_msg(c, m);
    kvxfer__peer_msg__free_unpacked(m, NULL);
}

/* The handshake socket ended. A dial that connected and was cut by the
 * other side before authentication is dialled again, while
 * peer.connect_timeout_ms lasts (a daemon closes the newest handshake
 * when every open one has said hello, and, unanswered, those from
 * outside its peer.allowed; it may be restarting); the layers above see
 * nothing of it. Anything else ends the connection, saying what
 * happened. */
static void hs_ended(void *arg, const char *why)
{
    peer_conn_t *c = arg;
    uint64_t now = now_ms();
    if (c->outgoing && c->state == CONN_AUTH && c->hs && hs_connected(c->hs) &&
        !P.stopping &&
        now < c->created_ms + kvxd.conf.peer_connect_timeout_ms) {
        uint64_t wait = HS_RETRY_MS << (c->tries < 6 ? c->tries : 6);
        hs_close(c->hs);
        c->hs = NULL;
        c->tries++;
        c->retry_ms = now + (wait < HS_RETRY_MAX_MS ? wait : HS_RETRY_MAX_MS);
        snprintf(c->last_cut, sizeof(c->last_cut), "%s%s", why,
                 c->nonce_s[0] ? " after its challenge"
                               : " before its challenge");
        return;
    }
    conn_fail(c, KVX_ERR_PEER_GONE, "handshake: %s", why);
}

/* ---- authentication ---------------------------------------------------- */

static void auth_refuse(peer_conn_t *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void hello_refuse(peer_conn_t *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Refuse c's handshake: AUTH_RESULT saying why, then the socket closes.
 * quiet: a HELLO that proved nothing, which anyone may send, as often
 * as it likes: logged at most once a second, with how many since. */
static void refuse_v(peer_conn_t *c, int quiet, const char *fmt, va_list ap)
{
    char msg[256];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    static uint64_t last;
    static unsigned more;
    uint64_t now = now_ms();
    if (!quiet || now >= last + 1000) {
        char also[64] = "";
        if (quiet && more)
            snprintf(also, sizeof(also), " (and %u more hellos since)", more);
        if (quiet) {
            last = now;
            more = 0;
        }
        log_warn("peer %s (from %s): authentication failed: %s%s",
                 c->address[0] ? c->address : "(unknown)",
                 c->hs ? hs_peer_name(c->hs) : "?", msg, also);
    } else {
        more++;
    }
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerAuthResult r = KVXFER__PEER_AUTH_RESULT__INIT;
    r.code = KVX_ERR_AUTH;
    char m2[512];
    snprintf(m2, sizeof(m2), "daemon %s refused authentication: %s",
             kvxd.address, msg);
    r.message = m2;
    m.m_case = KVXFER__PEER_MSG__M_AUTH_RESULT;
    m.auth_result = &r;
    hs_msg(c, &m);
    /* the socket closes once the refusal is out */
    conn_fail(c, KVX_ERR_AUTH, "%s", msg);
}

static void auth_refuse(peer_conn_t *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    refuse_v(c, 0, fmt, ap);
    va_end(ap);
}

static void hello_refuse(peer_conn_t *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    refuse_v(c, 1, fmt, ap);
    va_end(ap);
}

/* Was this nonce in a HELLO taken before (within HELLO_SKEW_S, or
 * since seen_floor)? */
static int seen_has(const uint8_t nc[NONCE_LEN])
{
    for (unsigned i = 0; i < P.seen_n; i++)
        if (!memcmp(P.seen[i].nonce, nc, NONCE_LEN))
            return 1;
    return 0;
}

static void seen_add(const uint8_t nc[NONCE_LEN], uint64_t time_s)
{
    unsigned i = P.seen_next;
    if (P.seen_n == SEEN_MAX && P.seen[i].time > P.seen_floor)
        P.seen_floor = P.seen[i].time;
    memcpy(P.seen[i].nonce, nc, NONCE_LEN);
    P.seen[i].time = time_s;
    P.seen_next = (i + 1) % SEEN_MAX;
    if (P.seen_n < SEEN_MAX)
        P.seen_n++;
}

/* c's HELLO h (version and nonce checked): its MAC under either of our
 * secrets (the previous one in a rotation's window) against either of
 * its MACs, made for our listener, not seen before. 0 to go on, with
 * c->hello_ok if it is fresh too (its time within HELLO_SKEW_S of ours
 * and after seen_floor, and fewer than HS_PROVEN_MAX proved open): then
 * the caps never close it. Else refused (-1). */
static int hello_check(peer_conn_t *c, const Kvxfer__PeerHello *h)
{
    const char *server = h->server ? h->server : "";
    size_t sl = strlen(server);
    uint8_t mac[MAC_LEN];
    int proved = 0;
    for (int k = 0; k < 2 && !proved; k++) {
        if (k && !prev_open())
            break;
        hello_mac(k, h->nonce.data, server, c->address, h->time, mac);
        proved =
            (h->mac.len == MAC_LEN && ct_equal(mac, h->mac.data, MAC_LEN)) ||
            (h->mac_previous.len == MAC_LEN &&
             ct_equal(mac, h->mac_previous.data, MAC_LEN));
    }
    if (!proved) {
        hello_refuse(c, "wrong cluster secret (%s)",
                     h->mac.len ? "its hello's MAC" : "its hello has no MAC");
        return -1;
    }
    char a[200], w[8];
    struct sockaddr_storage ss;
    socklen_t al;
    snprintf(a, sizeof(a), "kvx://%.160s/x", server);
    if (sl > 159 || strchr(server, '/') ||
        parse_address(a, &ss, &al, w, sizeof(w)) ||
        !same_sockaddr(&ss, &P.bound)) {
        hello_refuse(c,
                     "this daemon does not listen there (hello made for "
                     "%.160s)",
                     server);
        return -1;
    }
    if (seen_has(h->nonce.data)) {
        hello_refuse(c, "a hello replayed (its nonce came before)");
        return -1;
    }
    uint64_t now = (uint64_t)time(NULL);
    uint64_t skew = h->time > now ? h->time - now : now - h->time;
    if (skew > HELLO_SKEW_S) {
        static uint64_t last;
        if (now_ms() >= last + 1000) { /* at most once a second */
            last = now_ms();
            log_warn("peer %s: its clock is %llu s %s this daemon's (at most "
                     "%d s apart): its handshake goes on, but the handshake "
                     "caps may close it for another; synchronise the clocks",
                     c->address, (unsigned long long)skew,
                     h->time > now ? "ahead of" : "behind", HELLO_SKEW_S);
        }
        return 0;
    }
    seen_add(h->nonce.data, h->time);
    unsigned proven = 0;
    for (peer_conn_t *o = P.conns; o; o = o->next)
        proven += !o->outgoing && o->state == CONN_AUTH && o->hello_ok;
    c->hello_ok = h->time > P.seen_floor && proven < HS_PROVEN_MAX;
    return 0;
}

/* The daemon a connection reaches: the address it answered as (a
 * dial), or the one it proved (a connection it made to us). */
static const char *conn_peer(const peer_conn_t *c)
{
    return c->outgoing && c->server_addr[0] ? c->server_addr : c->address;
}

/* c has just proved that the daemon listening at its peer's IP:PORT is
 * now the one named addr: every other connection with that listener
 * under another id is with an earlier run of it, which restarted (a
 * process ends, its boot id with it). Their transfers end now, PEER_GONE
 * naming the restart, not at the keep-alive: its endpoints may never
 * report the old process gone (the kill's resets lost, an RDMA
 * transport). */
static void peer_restarted(const peer_conn_t *c, const char *addr)
{
    for (peer_conn_t *o = P.conns; o; o = o->next) {
        const char *was = conn_peer(o);
        if (o == c || o->state == CONN_LOST || !same_listener(was, addr) ||
            !strcmp(was, addr))
            continue;
        conn_fail(o, KVX_ERR_PEER_GONE,
                  "daemon %s restarted: it answers as %s now (its boot id "
                  "changed); what its earlier run held is gone",
                  was, addr);
    }
}

static void auth_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    Kvxfer__PeerMsg out = KVXFER__PEER_MSG__INIT;
    uint8_t mac[MAC_LEN];
    switch (m->m_case) {
    case KVXFER__PEER_MSG__M_HELLO: { /* we are the server */
        const Kvxfer__PeerHello *h = m->hello;
        if (c->outgoing || c->nonce_s[0] || c->address[0])
            break;
        snprintf(c->address, sizeof(c->address), "%s",
                 h->address ? h->address : "");
        if (h->version != PEER_VERSION) {
            hello_refuse(c, "peer protocol version %u, this daemon speaks %u",
                         h->version, PEER_VERSION);
            return;
        }
        if (h->nonce.len != NONCE_LEN || !c->address[0]) {
            hello_refuse(c, "malformed hello");
            return;
        }
        if (hello_check(c, h))
            return;

        memcpy(c->nonce_c, h->nonce.data, NONCE_LEN);
        if (getrandom(c->nonce_s, NONCE_LEN, 0) != NONCE_LEN) {
            conn_fail(c, KVX_ERR_IO, "getrandom failed");
            return;
        }
        c->nonce_s[0] |= 1; /* marks "challenge sent" */
        Kvxfer__PeerChallenge ch = KVXFER__PEER_CHALLENGE__INIT;
        hmac("kvx-s", c->nonce_c, c->nonce_s, kvxd.address, c->address, mac);
        ch.address = kvxd.address;
        ch.nonce.data = c->nonce_s;
        ch.nonce.len = NONCE_LEN;
        ch.mac.data = mac;
        ch.mac.len = MAC_LEN;
        /* a rotation's window: the previous secret's MAC too, for a
         * client that has not rotated yet */
        uint8_t mac_p[MAC_LEN];
        if (prev_open()) {
            hmac_with(1, "kvx-s", c->nonce_c, c->nonce_s, kvxd.address,
                      c->address, mac_p);
            ch.mac_previous.data = mac_p;
            ch.mac_previous.len = MAC_LEN;
        }
        out.m_case = KVXFER__PEER_MSG__M_CHALLENGE;
        out.challenge = &ch;
        hs_msg(c, &out);
        return;
    }
    case KVXFER__PEER_MSG__M_CHALLENGE: { /* we are the client */
        const Kvxfer__PeerChallenge *ch = m->challenge;
        if (!c->outgoing || ch->nonce.len != NONCE_LEN ||
            ch->mac.len != MAC_LEN)
            break;
        memcpy(c->nonce_s, ch->nonce.data, NONCE_LEN);
        /* the server MACs its own address: it must listen where we
         * dialled (its id may be new: a restart) */
        const char *sa = ch->address ? ch->address : "";
        snprintf(c->server_addr, sizeof(c->server_addr), "%s", sa);
        int elsewhere = !same_listener(sa, c->address);
        if (!strcmp(sa, kvxd.address) && strcmp(c->address, kvxd.address)) {
            /* we reached ourselves through another address (a NAT, a
             * forwarded port): never a peer, whatever it names. Our own
             * address is dialled on purpose: a fetch of a spread
             * instance moves its local slices over the same streams. */
            conn_fail(c, KVX_ERR_PEER_GONE,
                      "%s is this daemon (%s) under another address: a "
                      "daemon never dials itself",
                      c->address, kvxd.address);
            return;
        }
        /* either of our secrets (the previous one in a rotation's
         * window) against either of its MACs (its previous one, in its
         * window): the secret both know MACs the rest */
        int proved = 0;
        for (int k = 0; k < 2 && !proved; k++) {
            if (k && !prev_open())
                break;
            hmac_with(k, "kvx-s", c->nonce_c, c->nonce_s, sa, kvxd.address,
                      mac);
            if (ct_equal(mac, ch->mac.data, MAC_LEN) ||
                (ch->mac_previous.len == MAC_LEN &&
                 ct_equal(mac, ch->mac_previous.data, MAC_LEN))) {
                proved = 1;
                c->sec_prev = k;
            }
        }
        int bad = elsewhere || !proved;
        if (!bad && strcmp(sa, c->address)) {
            /* we dialled an earlier run's address (params or a key it
             * issued), and the new run proved itself there: that run is
             * gone, and so is what it issued. No answer: the new run
             * never makes an endpoint for this connection */
            const char *was = strrchr(c->address, '/'), *now = strrchr(sa, '/');
            peer_restarted(c, sa);
            conn_fail(c, KVX_ERR_PEER_GONE,
                      "restarted: params and keys issued by an earlier run "
                      "of that daemon (its id was %s, this run is %s) are "
                      "refused",
                      was + 1, now + 1);
            return;
        }
        /* answer either way, so the peer learns (and logs) it too; but a
         * valid MAC only to a server that proved itself, or it could be
         * relayed */
        Kvxfer__PeerResponse r = KVXFER__PEER_RESPONSE__INIT;
        Kvxfer__PeerUcx u = KVXFER__PEER_UCX__INIT;
        ProtobufCBinaryData lanes[LANES_MAX];
        uint8_t mac_c[MAC_LEN] = {0};
        if (!bad) { /* and our UCX addresses only to one that proved */
            hmac_with(c->sec_prev, "kvx-c", c->nonce_c, c->nonce_s, sa,
                      kvxd.address, mac_c);
            ucx_info_fill(&u, lanes);
            u.conn = c->lane_conn;
            r.ucx = &u;
        }
        r.mac.data = mac_c;
        r.mac.len = MAC_LEN;
        out.m_case = KVXFER__PEER_MSG__M_RESPONSE;
        out.response = &r;
        hs_msg(c, &out);
        if (c->state == CONN_LOST)
            return;
        if (elsewhere) {
            conn_fail(c, KVX_ERR_AUTH,
                      "authentication failed: %s answered as '%.191s', "
                      "which does not listen there",
                      c->address, sa);
            return;
        }
        if (bad) {
            conn_fail(c, KVX_ERR_AUTH,
                      "authentication failed: daemon %s does not know the "
                      "cluster secret",
                      c->address);
            return;
        }
        c->server_ok = 1;
        keys_derive(c);
        peer_restarted(c, sa);
        return;
    }
    case KVXFER__PEER_MSG__M_RESPONSE: { /* server: check the client */
        if (c->outgoing || !c->nonce_s[0] || m->response->mac.len != MAC_LEN)
            break;
        hmac("kvx-c", c->nonce_c, c->nonce_s, kvxd.address, c->address,
             mac);
        int ok = ct_equal(mac, m->response->mac.data, MAC_LEN);
        if (!ok && prev_open()) { /* a client that has not rotated yet */
            hmac_with(1, "kvx-c", c->nonce_c, c->nonce_s, kvxd.address,
                      c->address, mac);
            ok = c->sec_prev = ct_equal(mac, m->response->mac.data, MAC_LEN);
        }
        if (!ok) {
            auth_refuse(c, "wrong cluster secret");
            return;
        }
        peer_restarted(c, c->address); /* it proved its address now */
        char why[200];
        if (ucx_info_take(c, m->response->ucx, why, sizeof(why))) {
            auth_refuse(c, "%s", why);
            return;
        }
        Kvxfer__PeerAuthResult r = KVXFER__PEER_AUTH_RESULT__INIT;
        Kvxfer__PeerUcx u = KVXFER__PEER_UCX__INIT;
        ProtobufCBinaryData lanes[LANES_MAX];
        ucx_info_fill(&u, lanes);
        u.conn = c->lane_conn;
        r.message = "";
        r.ucx = &u;
        out.m_case = KVXFER__PEER_MSG__M_AUTH_RESULT;
        out.auth_result = &r;
        hs_msg(c, &out);
        if (c->state == CONN_LOST) /* the send may have failed it */
            return;
        /* the socket's work is done (it closes once the answer is out);
         * the client's BIND comes over UCX next */
        keys_derive(c);
        hs_close(c->hs);
        c->hs = NULL;
        c->state = CONN_BIND;
        return;
    }
    case KVXFER__PEER_MSG__M_AUTH_RESULT: /* client: the verdict */
        if (!c->outgoing)
            break;
        if (m->auth_result->code == 0 && !c->server_ok) {
            /* accepted by a server that never proved the secret */
            conn_fail(c, KVX_ERR_AUTH,
                      "authentication failed: %s accepted us without "
                      "proving the cluster secret",
                      c->address);
        } else if (m->auth_result->code == 0) {
            char why[200];
            int rc = ucx_info_take(c, m->auth_result->ucx, why, sizeof(why));
            if (rc) {
                conn_fail(c, rc, "refused: %s", why);
                return;
            }
            hs_close(c->hs);
            c->hs = NULL;
            conn_ready(c);
        } else {
            conn_fail(c, KVX_ERR_AUTH, "authentication failed: %s",
                      m->auth_result->message ? m->auth_result->message
                                              : "refused");
        }
        return;
    default:
        break;
    }
    conn_fail(c, KVX_ERR_PROTOCOL, "unexpected message %d during "
                                   "authentication",
              (int)m->m_case);
}

/* ---- messages in ------------------------------------------------------- */

static peer_conn_t *conn_of(const ucp_am_recv_param_t *p)
{
    if (!(p->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        return NULL;
    for (peer_conn_t *c = P.conns; c; c = c->next)
        if (c->rx_ep == p->reply_ep && !c->closed)
            return c;
    return NULL;
}

static void dispatch(peer_conn_t *c, const uint8_t *buf, size_t len)
{
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, len, buf);
    if (!m) {
        conn_fail(c, KVX_ERR_PROTOCOL, "malformed message from %s",
                  c->address);
        return;
    }
    c->last_seen_ms = now_ms();
    if (c->state == CONN_READY) {
        if (m->m_case == KVXFER__PEER_MSG__M_PING) {
            Kvxfer__PeerMsg r = KVXFER__PEER_MSG__INIT;
            r.m_case = KVXFER__PEER_MSG__M_PONG;
            r.pong = m->ping;
            send_now(c, &r);
        } else if (m->m_case != KVXFER__PEER_MSG__M_PONG &&
                   (unsigned)m->m_case < MSG_KINDS && H.msg[m->m_case]) {
            H.msg[m->m_case](c, m);
        }
    }
    kvxfer__peer_msg__free_unpacked(m, NULL);
}

static void recv_cb(void *request, ucs_status_t status, size_t length,
                    void *user_data)
{
    (void)length;
    ureq_t *u = user_data;
    peer_conn_t *c = u->c;
    int ok = status == UCS_OK && c->state != CONN_LOST;
    if (u->recv_kind == 1) {
        if (ok)
            dispatch(c, u->buf, u->len);
    } else {
        if (ok)
            c->last_seen_ms = now_ms();
        H.data.arrived(c, u->hdr->data, ok ? 0 : KVX_ERR_PEER_GONE);
        kvxfer__peer_msg__free_unpacked(u->hdr, NULL);
    }
    ureq_done(u, 0);
    ucp_request_free(request);
}

/* peer_iov_t is UCX's own iov entry, under a name the layers above
 * read without UCX's headers */
_Static_assert(sizeof(peer_iov_t) == sizeof(ucp_dt_iov_t) &&
                   offsetof(peer_iov_t, buf) ==
                       offsetof(ucp_dt_iov_t, buffer) &&
                   offsetof(peer_iov_t, len) == offsetof(ucp_dt_iov_t, length),
               "peer_iov_t is ucp_dt_iov_t");

/* Receive rendezvous data into dst; recv_cb finishes. */
static int recv_into(peer_conn_t *c, void *desc, void *dst, size_t len,
                     ureq_t *u)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                               .cb.recv_am = recv_cb,
                               .user_data = u};
    u->c = c;
    c->outstanding++;
    inflight_add(1);
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(P.worker, desc, dst, len, &prm);
    if (UCS_PTR_IS_ERR(r)) {
        c->outstanding--;
        inflight_add(-1);
        return KVX_ERR_IO;
    }
    return 0;
}

static ucs_status_t am_ctrl(void *arg, const void *header, size_t hlen,
                            void *data, size_t len,
                            const ucp_am_recv_param_t *param)
{
    (void)arg;
    (void)header;
    (void)hlen;
    peer_conn_t *c = conn_of(param);
    if (!c && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) &&
        !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        bind_msg(param->reply_ep, data, len); /* the first from it */
        return UCS_OK;
    }
    if (!c || c->state != CONN_READY)
        return UCS_OK;
    c->bytes_received += len;
    if (len > kvxd.conf.max_frame_bytes) {
        conn_fail(c, KVX_ERR_PROTOCOL, "%zu-byte message from %s exceeds "
                                       "limits.max_frame_bytes",
                  len, c->address);
        return UCS_OK;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        dispatch(c, data, len);
        return UCS_OK;
    }
    ureq_t *u = calloc(1, sizeof(*u));
    if (!u || !(u->buf = malloc(len ? len : 1))) {
        free(u);
        conn_fail(c, KVX_ERR_NOMEM, "out of memory receiving from %s",
                  c->address);
        return UCS_OK;
    }
    u->recv_kind = 1;
    u->len = len;
    if (recv_into(c, data, u->buf, len, u)) {
        free(u->buf);
        free(u);
        conn_fail(c, KVX_ERR_PEER_GONE, "receive from %s failed", c->address);
    }
    return UCS_OK;
}

static ucs_status_t am_data(void *arg, const void *header, size_t hlen,
                            void *data, size_t len,
                            const ucp_am_recv_param_t *param)
{
    (void)arg;
    peer_conn_t *c = conn_of(param);
    if (!c || c->state != CONN_READY)
        return UCS_OK;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) &&
        fault_hit(FAULT_CONN_HOLD))
        return UCS_INPROGRESS; /* kept, never answered: a stalled send */
    c->bytes_received += hlen + len;
    c->last_seen_ms = now_ms();
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, hlen, header);
    if (!m || m->m_case != KVXFER__PEER_MSG__M_DATA) {
        if (m)
            kvxfer__peer_msg__free_unpacked(m, NULL);
        conn_fail(c, KVX_ERR_PROTOCOL, "malformed data header from %s",
                  c->address);
        return UCS_OK;
    }
    /* into the slot: a piece received straight into a pool would be
     * unpacked here, on the loop, and only lanes have a stall check */
    void *dst = H.data.target(c, m->data, len, NULL, NULL);
    if (!dst) { /* the stream is gone: drop */
        kvxfer__peer_msg__free_unpacked(m, NULL);
        return UCS_OK;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(dst, data, len);
        H.data.arrived(c, m->data, 0);
        kvxfer__peer_msg__free_unpacked(m, NULL);
        return UCS_OK;
    }
    ureq_t *u = calloc(1, sizeof(*u));
    if (!u) {
        H.data.arrived(c, m->data, KVX_ERR_NOMEM);
        kvxfer__peer_msg__free_unpacked(m, NULL);
        return UCS_OK;
    }
    u->recv_kind = 2;
    u->hdr = m;
    if (recv_into(c, data, dst, len, u)) {
        H.data.arrived(c, m->data, KVX_ERR_PEER_GONE);
        kvxfer__peer_msg__free_unpacked(m, NULL);
        free(u);
        conn_fail(c, KVX_ERR_PEER_GONE, "receive from %s failed", c->address);
    }
    return UCS_OK;
}

/* ---- what the lanes report (on the loop) ------------------------------- */

static peer_conn_t *conn_of_lep(unsigned lane, uint64_t lep, int *in)
{
    for (peer_conn_t *c = P.conns; c; c = c->next) {
        if (c->out_lep[lane] == lep) {
            *in = 0;
            return c;
        }
        if (c->in_lep[lane] == lep) {
            *in = 1;
            return c;
        }
    }
    return NULL;
}

/* Slot data that came over a lane: lane_conn names the connection, and
 * lane_mac proves that the daemon at its other end sent it (only the two
 * of them have the key); then as am_data(). */
static void lane_arrived(const lane_ev_t *e)
{
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, e->hlen, e->hdr);
    peer_conn_t *c = NULL;
    const char *bad = "no connection's MAC";
    if (m && m->m_case == KVXFER__PEER_MSG__M_DATA &&
        m->data->lane_mac.len == LANE_MAC_LEN && m->data->lane_conn) {
        for (c = P.conns; c; c = c->next)
            if (c->state == CONN_READY && c->lane_conn == m->data->lane_conn)
                break;
        uint8_t mac[LANE_MAC_LEN];
        if (c) {
            lane_mac(c->rx_key, m->data, e->len, e->lane, mac);
            if (!ct_equal(mac, m->data->lane_mac.data, LANE_MAC_LEN))
                c = NULL;
        }
        /* one endpoint a lane for a connection: a second one is not the
         * daemon's (it never makes one) */
        if (c && c->in_lep[e->lane] && c->in_lep[e->lane] != e->lep) {
            bad = "a second endpoint of a connection's";
            c = NULL;
        }
    }
    if (c && !e->desc) {
        bad = "eager data, not rendezvous,";
        c = NULL;
    }
    if (!c) {
        /* not (or no longer) a connection's: dropped, endpoint closed */
        log_warn("lane %u: data with %s; dropped, and its endpoint closed",
                 e->lane, bad);
        if (m)
            kvxfer__peer_msg__free_unpacked(m, NULL);
        if (e->desc)
            lane_drop(e->lane, e->desc);
        lane_close(e->lane, e->lep);
        return;
    }
    if (!c->in_lep[e->lane]) {
        c->in_lep[e->lane] = e->lep;
        lane_bind(e->lane, e->lep);
    }
    c->bytes_received += e->hlen + e->len;
    c->last_seen_ms = now_ms();
    const peer_iov_t *iov = NULL;
    size_t niov = 0;
    void *dst = H.data.target(c, m->data, e->len, &iov, &niov);
    if (!dst) {
        if (e->desc)
            lane_drop(e->lane, e->desc);
        kvxfer__peer_msg__free_unpacked(m, NULL);
        return;
    }
    ureq_t *u = calloc(1, sizeof(*u));
    if (!u) {
        lane_drop(e->lane, e->desc);
        H.data.arrived(c, m->data, KVX_ERR_NOMEM);
        kvxfer__peer_msg__free_unpacked(m, NULL);
        conn_fail(c, KVX_ERR_NOMEM, "out of memory receiving from %s",
                  c->address);
        return;
    }
    u->c = c;
    u->recv_kind = 2;
    u->hdr = m;
    u->on_lane = 1;
    c->outstanding++;
    if (!c->lane_rx_inflight++)
        c->lane_rx_moved_ms = now_ms();
    lane_recv(e->lane, e->desc, dst, e->len, (const ucp_dt_iov_t *)iov, niov,
              u);
}

static void on_lane_event(const lane_ev_t *e)
{
    ureq_t *u = e->cookie;
    peer_conn_t *c;
    int in;
    switch (e->kind) {
    case LEV_SENT:
        c = u->c;
        assert(c->data_inflight > 0);
        c->data_inflight--;
        c->lane_inflight[u->lane]--;
        c->lane_moved_ms[u->lane] = now_ms();
        if (!e->status)
            c->lane_ok[u->lane] = 1;
        else if (c->state == CONN_READY && !c->lane_ok[u->lane])
            lanes_off(c, u->lane, e->msg); /* never worked: a firewall? */
        if (e->status && c->state == CONN_READY && c->lanes_off) {
            /* lanes are off for c: sent again over the connection */
            u->on_lane = 0;
            c->bytes_sent -= u->hdr_len + u->len; /* counted again */
            u->next = c->dq_head;
            c->dq_head = u;
            if (!c->dq_tail)
                c->dq_tail = u;
            data_start(c);
            break;
        } else if (e->status && c->state != CONN_LOST) {
            conn_fail(c, KVX_ERR_PEER_GONE, "lane %u: send to %s failed: %s",
                      e->lane, c->address, e->msg);
        }
        data_start(c); /* before ureq_done, which may free c */
        ureq_done(u, e->status ? KVX_ERR_PEER_GONE : 0);
        break;
    case LEV_RECEIVED:
        c = u->c;
        assert(c->lane_rx_inflight > 0);
        c->lane_rx_inflight--;
        c->lane_rx_moved_ms = now_ms();
        if (!e->status && c->state != CONN_LOST)
            c->last_seen_ms = now_ms();
        H.data.arrived(c, u->hdr->data,
                       !e->status && c->state != CONN_LOST ? 0
                                                           : KVX_ERR_PEER_GONE);
        kvxfer__peer_msg__free_unpacked(u->hdr, NULL);
        ureq_done(u, 0);
        break;
    case LEV_ARRIVED:
        lane_arrived(e);
        break;
    case LEV_EP_ERROR:
        c = conn_of_lep(e->lane, e->lep, &in);
        if (c && c->state == CONN_READY && !in && !c->lane_ok[e->lane])
            lanes_off(c, e->lane, e->msg); /* never worked: a firewall? */
        else if (c && in)
            /* the other daemon's endpoint into our lane: it closed it
             * (its lanes off), or the link broke. Its receives here
             * fail on their own, and a broken link loses the connection
             * by its keep-alive; the connection goes on */
            c->in_lep[e->lane] = 0;
        else if (c && c->state != CONN_LOST)
            conn_fail(c, KVX_ERR_PEER_GONE, "lane %u %s %s failed: %s",
                      e->lane, in ? "from" : "to", c->address, e->msg);
        break;
    case LEV_CLOSED: /* nothing waits for it */
        break;
    }
}

/* ---- life -------------------------------------------------------------- */

static int set_handler(unsigned id, ucp_am_recv_callback_t cb)
{
    ucp_am_handler_param_t h = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                      UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = id,
        .cb = cb,
        .flags = UCP_AM_FLAG_WHOLE_MSG};
    return ucp_worker_set_am_recv_handler(P.worker, &h) == UCS_OK ? 0
                                                                  : KVX_ERR_IO;
}

/* Wait (at most LISTEN_IF_WAIT_MS) until the interface that holds the
 * peer.listen IP is running (IFF_UP and IFF_RUNNING).
 *
 * Why: UCX (1.13) looks at the network interfaces once, in ucp_init, and
 * leaves out the ones that are not running. A link that was just set up
 * (a veth pair: the second end gets IFF_RUNNING from the kernel's link
 * watch up to a second after "ip link set up") is then missing from the
 * worker for good: it only has tcp on lo, and every connection to
 * another host fails with "Destination is unreachable". A daemon started
 * with its network (containers, namespaces, boot) hits that window, so
 * peer_init gives the interface a moment before bringing UCX up.
 * Loopback and wildcard listen addresses, and an IP no interface holds
 * (ucp_listener_create says so), do not wait. */
#define LISTEN_IF_WAIT_MS 3000

static int listen_if_state(const struct sockaddr_storage *ss, char *name,
                           size_t name_len)
{
    struct ifaddrs *all;
    int r = -1; /* -1: not found, wildcard or loopback; 0: down; 1: up */
    if (getifaddrs(&all))
        return -1;
    for (struct ifaddrs *i = all; i; i = i->ifa_next) {
        const struct sockaddr *a = i->ifa_addr;
        if (!a || a->sa_family != ss->ss_family)
            continue;
        int same;
        if (a->sa_family == AF_INET)
            same = !memcmp(&((const struct sockaddr_in *)a)->sin_addr,
                           &((const struct sockaddr_in *)ss)->sin_addr,
                           sizeof(struct in_addr));
        else if (a->sa_family == AF_INET6)
            same = !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                           &((const struct sockaddr_in6 *)ss)->sin6_addr,
                           sizeof(struct in6_addr));
        else
            continue;
        if (!same)
            continue;
        snprintf(name, name_len, "%s", i->ifa_name);
        if (!(i->ifa_flags & IFF_LOOPBACK))
            r = (i->ifa_flags & IFF_UP) && (i->ifa_flags & IFF_RUNNING);
        break;
    }
    freeifaddrs(all);
    return r;
}

static void listen_if_wait(void)
{
    char addr[sizeof(kvxd.conf.peer_listen) + 16], why[256], name[IFNAMSIZ];
    struct sockaddr_storage ss;
    socklen_t sl;
    snprintf(addr, sizeof(addr), "kvx://%s/x", kvxd.conf.peer_listen);
    if (parse_address(addr, &ss, &sl, why, sizeof(why)))
        return; /* peer_init reports it */
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int up = listen_if_state(&ss, name, sizeof(name));
        if (up)
            return;
        clock_gettime(CLOCK_MONOTONIC, &t);
        long ms = (t.tv_sec - t0.tv_sec) * 1000L +
                  (t.tv_nsec - t0.tv_nsec) / 1000000L;
        if (ms >= LISTEN_IF_WAIT_MS) {
            log_warn("peers: interface %s of peer.listen %s is not running; "
                     "UCX will not use it until the daemon restarts",
                     name, kvxd.conf.peer_listen);
            return;
        }
        struct timespec d = {.tv_sec = 0, .tv_nsec = 10 * 1000000L};
        nanosleep(&d, NULL);
    }
}

/* Whether a UCX device list (UCX_NET_DEVICES's form: "dev" or
 * "dev:port", comma-separated; empty or "all": every device) names an
 * RDMA device of root (/sys/class/infiniband). */
static int list_has_rdma(const char *list, const char *root)
{
    DIR *d = opendir(root);
    if (!d)
        return 0;
    int any = !list[0], found = 0; /* or an entry "all", below */
    for (const char *p = list; !any && *p;) {
        size_t l = strcspn(p, ",");
        any = l == 3 && !strncmp(p, "all", 3);
        p += l + (p[l] == ',');
    }
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        size_t n = strlen(e->d_name);
        for (const char *p = list; !found && (any || *p);) {
            size_t l = strcspn(p, ",");
            found = any || ((l == n || (l > n && p[n] == ':')) &&
                            !strncmp(p, e->d_name, n));
            p += l + (p[l] == ',');
        }
    }
    closedir(d);
    return found;
}

/* The devices UCX may use (UCX_NET_DEVICES): peer.net_devices, or the
 * interface that holds peer.listen's IP and every RDMA device. Without
 * it UCX's TCP transport listens on every interface (the loop's worker's
 * and each lane's port), whatever peer.listen says. And the ports it
 * listens on (peer.ucx_ports). 0, or KVX_ERR_INVALID with why. */
static int ucx_devices(ucp_config_t *cfg, char *why, size_t why_len)
{
    char list[512] = "", name[IFNAMSIZ] = "";
    if (getenv("UCX_NET_DEVICES")) {
        log_info("peers: UCX devices from the environment: "
                 "UCX_NET_DEVICES=%s",
                 getenv("UCX_NET_DEVICES"));
    } else if (kvxd.conf.peer_net_devices[0]) {
        snprintf(list, sizeof(list), "%s", kvxd.conf.peer_net_devices);
    } else {
        char addr[sizeof(kvxd.conf.peer_listen) + 16];
        struct sockaddr_storage ss;
        socklen_t sl;
        snprintf(addr, sizeof(addr), "kvx://%s/x", kvxd.conf.peer_listen);
        if (!parse_address(addr, &ss, &sl, why, why_len))
            listen_if_state(&ss, name, sizeof(name));
        if (name[0])
            snprintf(list, sizeof(list), "%s", name);
        /* RDMA devices carry no TCP listener: all of them, by port */
        DIR *d = opendir("/sys/class/infiniband");
        struct dirent *e;
        while (name[0] && d && (e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            char pdir[300];
            snprintf(pdir, sizeof(pdir), "/sys/class/infiniband/%s/ports",
                     e->d_name);
            DIR *pd = opendir(pdir);
            struct dirent *pe;
            while (pd && (pe = readdir(pd))) {
                size_t l = strlen(list);
                if (pe->d_name[0] != '.' &&
                    l + strlen(e->d_name) + strlen(pe->d_name) + 3 <
                        sizeof(list)) {
                    list[l++] = ',';
                    l += (size_t)sprintf(list + l, "%s", e->d_name);
                    list[l++] = ':';
                    strcpy(list + l, pe->d_name);
                }
            }
            if (pd)
                closedir(pd);
        }
        if (d)
            closedir(d);
        if (!name[0])
            log_warn("peers: no interface holds peer.listen's IP %s; UCX "
                     "may use every device",
                     kvxd.conf.peer_listen);
    }
    ucs_status_t st;
    if (list[0] && strcmp(list, "all") &&
        (st = ucp_config_modify(cfg, "NET_DEVICES", list)) != UCS_OK) {
        snprintf(why, why_len, "peer.net_devices '%s': %s", list,
                 ucs_status_string(st));
        return KVX_ERR_INVALID;
    }
    if (list[0])
        log_info("peers: UCX devices %s", list);
    const char *env = getenv("UCX_NET_DEVICES");
    P.rdma = list_has_rdma(env ? env : list, "/sys/class/infiniband");
    /* TCP segments: endpoints made from worker addresses in peer
     * error-handling mode get no RMA lanes over TCP in UCX 1.13 (those
     * made through its connection manager did), so rendezvous data goes
     * as active-message fragments; 8 KiB send and 64 KiB receive
     * segments cost a fifth of the bandwidth of 4 MiB slots on the GPU
     * host, 128 KiB and 512 KiB get it back (docs/benchmarks.md). The
     * environment's values win. */
    if (!getenv("UCX_TCP_TX_SEG_SIZE"))
        setenv("UCX_TCP_TX_SEG_SIZE", "128k", 1);
    if (!getenv("UCX_TCP_RX_SEG_SIZE"))
        setenv("UCX_TCP_RX_SEG_SIZE", "512k", 1);
    /* a transport's setting: UCX reads it from the environment when the
     * workers open their interfaces (ucp_config_modify keeps it from
     * them in 1.13) */
    if (kvxd.conf.peer_ucx_ports[0] && !getenv("UCX_TCP_PORT_RANGE") &&
        setenv("UCX_TCP_PORT_RANGE", kvxd.conf.peer_ucx_ports, 1)) {
        snprintf(why, why_len, "peer.ucx_ports '%s': %s",
                 kvxd.conf.peer_ucx_ports, strerror(errno));
        return KVX_ERR_IO;
    }
    return 0;
}

/* FAULT_LANES: the address of a worker made and destroyed at once, so
 * that an endpoint to it gets no answer (a firewall that refuses). */
static int dead_address(char *why, size_t why_len)
{
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucp_worker_h w;
    ucp_address_t *a;
    size_t len;
    if (ucp_worker_create(P.ctx, &wp, &w) != UCS_OK) {
        snprintf(why, why_len, "fault lanes: ucp_worker_create failed");
        return KVX_ERR_IO;
    }
    int rc = 0;
    if (ucp_worker_get_address(w, &a, &len) != UCS_OK ||
        !(P.dead_addr = malloc(len))) {
        snprintf(why, why_len, "fault lanes: no worker address");
        rc = KVX_ERR_IO;
    } else {
        memcpy(P.dead_addr, a, len);
        P.dead_len = len;
        ucp_worker_release_address(w, a);
    }
    ucp_worker_destroy(w);
    return rc;
}

int peer_init(char *why, size_t why_len)
{
    if (!kvxd.conf.peer_listen[0])
        return 0;
    int rc = read_secret(why, why_len);
    if (rc)
        return rc;
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    snprintf(P.version, sizeof(P.version), "%u.%u.%u", maj, min, rel);
    listen_if_wait(); /* before ucp_init looks at the interfaces */
    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        snprintf(why, why_len, "UCX configuration: %s",
                 ucs_status_string(st));
        return KVX_ERR_IO;
    }
    if ((rc = ucx_devices(cfg, why, why_len))) {
        ucp_config_release(cfg);
        return rc;
    }
    /* a unified-mode address leaves out the lengths ucx_addr_check()
     * walks a peer's address by: off, whatever the environment says */
    if (getenv("UCX_UNIFIED_MODE"))
        log_notice("peers: UCX_UNIFIED_MODE is ignored (peers' addresses "
                   "are checked, which needs UCX's non-unified format)");
    if ((st = ucp_config_modify(cfg, "UNIFIED_MODE", "n")) != UCS_OK) {
        snprintf(why, why_len, "UCX configuration: UNIFIED_MODE: %s",
                 ucs_status_string(st));
        ucp_config_release(cfg);
        return KVX_ERR_IO;
    }
    /* lanes: workers of this context on other threads */
    ucp_params_t prm = {.field_mask = UCP_PARAM_FIELD_FEATURES |
                                      UCP_PARAM_FIELD_NAME |
                                      UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                        .mt_workers_shared = kvxd.conf.lanes > 0,
                        .name = "kvxferd"};
    st = ucp_init(&prm, cfg, &P.ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        snprintf(why, why_len, "ucp_init: %s", ucs_status_string(st));
        return KVX_ERR_IO;
    }
    ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    if (ucp_context_query(P.ctx, &ca) == UCS_OK)
        P.ucx_cuda = !!(ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((st = ucp_worker_create(P.ctx, &wp, &P.worker)) != UCS_OK) {
        snprintf(why, why_len, "ucp_worker_create: %s",
                 ucs_status_string(st));
        rc = KVX_ERR_IO;
        goto err_ctx;
    }
    int efd;
    if ((st = ucp_worker_get_efd(P.worker, &efd)) != UCS_OK) {
        snprintf(why, why_len, "ucp_worker_get_efd: %s",
                 ucs_status_string(st));
        rc = KVX_ERR_IO;
        goto err_worker;
    }
    if ((rc = set_handler(AM_CTRL, am_ctrl)) ||
        (rc = set_handler(AM_DATA, am_data))) {
        snprintf(why, why_len, "cannot set the UCX message handlers");
        goto err_worker;
    }

    if ((st = ucp_worker_get_address(P.worker, &P.addr, &P.addr_len)) !=
        UCS_OK) {
        P.addr = NULL;
        snprintf(why, why_len, "ucp_worker_get_address: %s",
                 ucs_status_string(st));
        rc = KVX_ERR_IO;
        goto err_worker;
    }
    if (fault_armed(FAULT_LANES) && (rc = dead_address(why, why_len)))
        goto err_worker;

    /* the handshake listener, on the configured IP:PORT: a socket of our
     * own, so that nothing reaches UCX before authentication */
    char addr[sizeof(kvxd.conf.peer_listen) + 16];
    snprintf(addr, sizeof(addr), "kvx://%s/x", kvxd.conf.peer_listen);
    struct sockaddr_storage ss;
    socklen_t sl;
    if ((rc = parse_address(addr, &ss, &sl, why, why_len))) {
        snprintf(why, why_len, "peer.listen: '%s' is not IP:PORT",
                 kvxd.conf.peer_listen);
        goto err_worker;
    }
    if ((rc = nets_init(&ss, why, why_len)))
        goto err_worker;
    struct sockaddr_storage bound;
    char lwhy[160];
    if ((rc = hs_listen(&ss, on_hs_accept, &bound, lwhy, sizeof(lwhy)))) {
        snprintf(why, why_len, "peer.listen: cannot listen on %s: %s",
                 kvxd.conf.peer_listen, lwhy);
        goto err_worker;
    }
    P.bound = bound;
    char ip[INET6_ADDRSTRLEN];
    unsigned port = bound.ss_family == AF_INET6
                        ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                        : ntohs(((struct sockaddr_in *)&bound)->sin_port);
    if (bound.ss_family == AF_INET6) {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&bound)->sin6_addr, ip,
                  sizeof(ip));
        snprintf(P.listen, sizeof(P.listen), "[%s]:%u", ip, port);
    } else {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&bound)->sin_addr, ip,
                  sizeof(ip));
        snprintf(P.listen, sizeof(P.listen), "%s:%u", ip, port);
    }
    /* the address: the listener, and the random incarnation id */
    const char *id = strrchr(kvxd.address, '/');
    char tail[32];
    snprintf(tail, sizeof(tail), "%s", id ? id : "/0");
    snprintf(kvxd.address, sizeof(kvxd.address), "kvx://%s%s", P.listen,
             tail);

    uv_poll_init(kvxd.loop, &P.poll, efd);
    uv_poll_start(&P.poll, UV_READABLE, on_poll);
    uv_prepare_init(kvxd.loop, &P.prepare);
    uv_prepare_start(&P.prepare, on_prepare);
    uv_idle_init(kvxd.loop, &P.idle);
    P.busy_poll =
        kvxd.conf.busy_poll == 2 ? kvxd_cpus() >= 4 : (int)kvxd.conf.busy_poll;
    if ((rc = lanes_start(P.ctx, kvxd.loop, kvxd.conf.lanes, P.busy_poll,
                          kvxd.conf.peer_connect_timeout_ms, on_lane_event, why,
                          why_len))) {
        uv_close((uv_handle_t *)&P.poll, NULL);
        uv_close((uv_handle_t *)&P.prepare, NULL);
        uv_close((uv_handle_t *)&P.idle, NULL);
        goto err_listener;
    }
    P.poll_on = 1;
    P.on = 1;
    if (!ucx_tcp_guard_bound())
        log_warn("peers: the guard against UCX TCP's freed-endpoint bug is "
                 "not in effect (ucs_event_set_wait is bound elsewhere): a "
                 "link back after a peer was lost may crash the daemon");
    if (ucx_wireup_guard() < 0)
        log_warn("peers: the guard against UCX %s's abort on a peer lost "
                 "while connecting is not in effect (another build of "
                 "ucp_request_send_state_ff, or bound elsewhere): a peer "
                 "that exits then may crash the daemon; UCX 1.14 fixes it",
                 P.version);
    log_notice("peers: UCX %s listening on %s (CUDA memory %s by UCX), "
               "%u lanes", P.version, P.listen,
               P.ucx_cuda ? "supported" : "not supported", lanes_count());
    return 0;

err_listener:
    hs_stop();
err_worker:
    free(P.dead_addr);
    P.dead_addr = NULL;
    if (P.addr)
        ucp_worker_release_address(P.worker, P.addr);
    P.addr = NULL;
    ucp_worker_destroy(P.worker);
    P.worker = NULL;
err_ctx:
    ucp_cleanup(P.ctx);
    P.ctx = NULL;
    return rc;
}

int peer_enabled(void) { return P.on; }

/* The data's keep-alive: a lane of c that carried data and has had
 * sends out with none back for peer.keepalive_timeout_ms, or c's data
 * coming in over our lanes with no receive back as long, or slot data
 * sent on c's own endpoint with none back as long: lost, like a peer
 * silent on the connection (a lane's TCP may stall where the
 * connection's does not, and a PONG gets through where a rendezvous
 * does not). It bounds how long a fence waits for UCX. 1 with why, or
 * 0. */
static int data_stalled(const peer_conn_t *c, uint64_t now, char *why,
                        size_t len)
{
    uint64_t t = kvxd.conf.keepalive_timeout_ms;
    for (unsigned i = 0; i < LANES_MAX; i++)
        if (c->lane_ok[i] && c->lane_inflight[i] &&
            now >= c->lane_moved_ms[i] + t) {
            snprintf(why, len, "lane %u to %s: nothing sent for %llu ms", i,
                     c->address,
                     (unsigned long long)(now - c->lane_moved_ms[i]));
            return 1;
        }
    if (c->lane_rx_inflight && now >= c->lane_rx_moved_ms + t) {
        snprintf(why, len, "lane data from %s: nothing arrived for %llu ms",
                 c->address, (unsigned long long)(now - c->lane_rx_moved_ms));
        return 1;
    }
    if (c->conn_data_inflight && now >= c->conn_data_moved_ms + t) {
        snprintf(why, len, "slot data to %s: nothing sent for %llu ms",
                 c->address, (unsigned long long)(now - c->conn_data_moved_ms));
        return 1;
    }
    return 0;
}

void peer_tick(uint64_t now)
{
    if (!P.on)
        return;
    if (P.prev_len && now >= P.prev_until) {
        memset(P.prev, 0, sizeof(P.prev));
        P.prev_len = 0;
        log_notice("peer: the previous secret's window is over "
                   "(peer.secret_previous_ms): handshakes take only the "
                   "current one");
    }
    peer_flush_lost();
    for (peer_conn_t *c = P.conns, *n; c; c = n) {
        n = c->next;
        if (c->state == CONN_LOST) {
            if (c->lost_pending)
                continue; /* remote.c hears of it first */
            /* close outside UCX callbacks */
            if (!c->closed) {
                conn_close_ep(c);
                conn_try_free(c);
            }
            continue;
        }
        if ((c->state == CONN_AUTH || c->state == CONN_BIND) &&
            now >= c->created_ms + kvxd.conf.peer_connect_timeout_ms) {
            if (c->tries)
                conn_fail(c, KVX_ERR_PEER_GONE,
                          "connect and authentication took over %u ms "
                          "(peer.connect_timeout_ms): dialled %u times, "
                          "the last handshake: %s",
                          kvxd.conf.peer_connect_timeout_ms, c->tries,
                          c->last_cut);
            else
                conn_fail(c, KVX_ERR_PEER_GONE,
                          "connect and authentication took over %u ms "
                          "(peer.connect_timeout_ms)",
                          kvxd.conf.peer_connect_timeout_ms);
            continue;
        }
        if (c->state == CONN_AUTH && c->retry_ms && now >= c->retry_ms) {
            conn_redial(c);
            continue;
        }
        if (c->state != CONN_READY)
            continue;
        if (now >= c->last_seen_ms + kvxd.conf.keepalive_timeout_ms) {
            conn_fail(c, KVX_ERR_PEER_GONE,
                      "no word from %s for %llu ms "
                      "(peer.keepalive_timeout_ms %u)",
                      c->address,
                      (unsigned long long)(now - c->last_seen_ms),
                      kvxd.conf.keepalive_timeout_ms);
            continue;
        }
        /* a lane endpoint that has not sent anything in the connect
         * time (its connection hangs: a firewall that drops) */
        for (unsigned i = 0; i < LANES_MAX; i++)
            if (c->out_lep[i] && !c->lane_ok[i] &&
                now >= c->lane_since[i] + kvxd.conf.peer_connect_timeout_ms)
                lanes_off(c, i, "gave no answer within "
                                "peer.connect_timeout_ms");
        char stall[300];
        if (data_stalled(c, now, stall, sizeof(stall))) {
            conn_fail(c, KVX_ERR_PEER_GONE, "%s (peer.keepalive_timeout_ms "
                                            "%u)",
                      stall, kvxd.conf.keepalive_timeout_ms);
            continue;
        }
        if (now >= c->last_ping_ms + kvxd.conf.keepalive_interval_ms) {
            c->last_ping_ms = now;
            Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
            m.m_case = KVXFER__PEER_MSG__M_PING;
            m.ping = now;
            send_now(c, &m);
        }
    }
}

void *peer_mem_map(void *addr, size_t len)
{
    if (!P.on)
        return NULL;
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                             UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = addr,
                               .length = len};
    ucp_mem_h h;
    return ucp_mem_map(P.ctx, &mp, &h) == UCS_OK ? h : NULL;
}

void peer_mem_unmap(void *memh)
{
    if (memh)
        ucp_mem_unmap(P.ctx, memh);
}

void peer_cleanup(void)
{
    if (!P.on)
        return;
    P.stopping = 1;
    for (peer_conn_t *c = P.conns; c; c = c->next) {
        if (c->state != CONN_LOST)
            conn_fail(c, KVX_ERR_SHUTDOWN, "daemon exiting");
        dq_give_back(c); /* a give-back queued for the loop's next turn */
    }
    peer_flush_lost(); /* the loop has stopped: now */
    for (peer_conn_t *c = P.conns; c; c = c->next)
        conn_close_ep(c);
    /* let the force-closes and cancelled requests come back (the
     * lanes' too: their events run here, the loop has stopped) */
    for (int i = 0; i < 1000 && P.conns; i++) {
        while (ucp_worker_progress(P.worker))
            ;
        lanes_drain();
        for (peer_conn_t *c = P.conns, *n; c; c = n) {
            n = c->next;
            if (!c->outstanding && c->close_done) {
                conn_unlink(c);
                conn_free(c);
            }
        }
        if (P.conns)
            usleep(1000);
    }
    lanes_stop(); /* before the slots (remote_cleanup) and the context */
}

void peer_shutdown(void)
{
    if (!P.on)
        return;
    if (P.poll_on) {
        uv_poll_stop(&P.poll);
        uv_prepare_stop(&P.prepare);
        uv_idle_stop(&P.idle);
        P.idle_on = 0;
        uv_close((uv_handle_t *)&P.poll, NULL);
        uv_close((uv_handle_t *)&P.prepare, NULL);
        uv_close((uv_handle_t *)&P.idle, NULL);
    }
    hs_stop();
    free(P.dead_addr);
    P.dead_addr = NULL;
    if (P.addr)
        ucp_worker_release_address(P.worker, P.addr);
    P.addr = NULL;
    ucp_worker_destroy(P.worker);
    ucp_cleanup(P.ctx);
    P.worker = NULL;
    P.on = 0;
}

/* ---- status ------------------------------------------------------------ */

size_t peer_infos(Kvxfer__PeerInfo ***out)
{
    size_t n = 0, k = 0;
    *out = NULL;
    for (peer_conn_t *c = P.conns; c; c = c->next)
        n += c->address[0] != 0;
    if (!n)
        return 0;
    Kvxfer__PeerInfo **v = calloc(n, sizeof(*v));
    if (!v)
        return 0;
    uint64_t now = now_ms();
    for (peer_conn_t *c = P.conns; c && k < n; c = c->next) {
        if (!c->address[0])
            continue;
        Kvxfer__PeerInfo *p = malloc(sizeof(*p));
        if (!p)
            break;
        kvxfer__peer_info__init(p);
        p->address = strdup(c->address);
        p->state = (char *)state_names[c->state];
        p->direction = c->outgoing ? "out" : "in";
        p->bytes_sent = c->bytes_sent;
        p->bytes_received = c->bytes_received;
        p->errors = c->errors;
        p->last_seen_ms = now - c->last_seen_ms;
        p->streams = H.data.streams ? H.data.streams(c) : 0;
        p->lanes = c->lanes_off ? 0
                   : c->peer_lanes < lanes_count() ? c->peer_lanes
                                                   : lanes_count();
        v[k++] = p;
    }
    *out = v;
    return k;
}

void peer_free_infos(Kvxfer__PeerInfo **v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (v[i]) {
            free(v[i]->address);
            free(v[i]);
        }
    free(v);
}

void peer_ucx_info(Kvxfer__UcxInfo *info)
{
    info->listen = P.on ? kvxd.address : "";
    info->transports = P.transports;
    info->staging = P.on ? "host" : "";
    info->version = P.version;
    info->slot_bytes = P.on ? kvxd.conf.slot_bytes : 0;
    info->send_window = P.on ? kvxd.conf.send_window : 0;
    info->lanes = lanes_count();
    info->n_lane_ports = 0; /* lanes listen on no port of their own */
}

void peer_on_msg(int m_case, peer_msg_cb cb)
{
    assert(m_case > 0 && m_case < MSG_KINDS && !H.msg[m_case]);
    H.msg[m_case] = cb;
}

void peer_on_lost(peer_lost_cb cb)
{
    assert(H.nlost < LOST_CBS);
    H.lost[H.nlost++] = cb;
}

void peer_set_data_ops(const peer_data_ops_t *ops)
{
    H.data = *ops;
}
