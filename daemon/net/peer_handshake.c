/*
 * peer_handshake — how a connection is made and authenticated (peer.h,
 * peer_int.h): HELLO -> CHALLENGE -> RESPONSE -> AUTH_RESULT on the
 * handshake socket (hs.c), never on UCX; the secret never goes on the
 * wire, only HMACs of both nonces under it (peer_auth.c), and each side
 * proves it knows it. Only then do the daemons tell each other their UCX
 * workers' addresses (PeerUcx, with the lanes'), and conn_ready() makes
 * an endpoint to the other's worker, whose first message (BIND) ties it
 * to the connection: the client's first, the server's once that
 * arrived. Here too: the dial (peer_connect(), redials of a cut
 * handshake) and the accept (on_hs_accept(), with the caps on
 * handshakes that have not proved the secret).
 */

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include "core/fault.h"
#include "core/log.h"
#include "peer_int.h"
#include "ucx.h"

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    peer_conn_t *c = arg;
    conn_fail(c, KVX_ERR_PEER_GONE, "endpoint to %s failed: %s",
              c->address[0] ? c->address : "(unauthenticated peer)",
              ucs_status_string(status));
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
                       kvx_why_t *why)
{
    char d[128];
    if (ucx_addr_check(b->data, b->len, NULL, KVX_WHY(d))) {
        why_set(why, "%s UCX address: %s", what, d);
        return KVX_ERR_PROTOCOL;
    }
    return 0;
}

/* What the other daemon told: kept for conn_ready() and the lanes, once
 * every address in it passed ucx_addr_ok() (nothing a peer sends reaches
 * UCX unchecked). 0, or KVX_ERR_PROTOCOL or KVX_ERR_NOMEM with why. */
static int ucx_info_take(peer_conn_t *c, const Kvxfer__PeerUcx *u,
                         kvx_why_t *why)
{
    if (!u || !u->worker.len || !u->conn || u->n_lanes > LANES_MAX) {
        why_set(why,
                !u               ? "no UCX addresses"
                : !u->worker.len ? "no UCX worker address"
                : !u->conn       ? "connection id 0"
                                 : "more lanes than %d",
                LANES_MAX);
        return KVX_ERR_PROTOCOL;
    }
    int rc = ucx_addr_ok(&u->worker, "its worker's", why);
    for (size_t i = 0; !rc && i < u->n_lanes; i++) {
        char what[32];
        snprintf(what, sizeof(what), "its lane %zu's", i);
        rc = ucx_addr_ok(&u->lanes[i], what, why);
    }
    if (rc)
        return rc;
    why_set(why, "out of memory for its UCX addresses");
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
    ucs_status_t st = ucx_connect_addr(P.worker, c->ucx_addr, c->ucx_addr_len,
                                       ep_err_cb, c, &c->ep);
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
    list_t *n;
    while (c->state == CONN_READY && (n = list_pop(&c->q))) {
        qmsg_t *q = QMSG(n);
        uint8_t *b = q->buf;
        size_t len = q->len;
        free(q);
        send_packed(c, b, len);
    }
}

/* A BIND from an endpoint no connection has: ties it to the one it
 * names, if its MAC proves the daemon at the other end of that
 * connection sent it. Anything else from such an endpoint is dropped. */
void bind_msg(ucp_ep_h from, const uint8_t *buf, size_t len)
{
    Kvxfer__PeerMsg *m =
        len <= 256 ? kvxfer__peer_msg__unpack(NULL, len, buf) : NULL;
    peer_conn_t *c = NULL;
    if (m && m->m_case == KVXFER__PEER_MSG__M_BIND &&
        m->bind->mac.len == MAC_LEN) {
        for (c = conn_next(NULL); c; c = conn_next(c))
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
                     kvx_why_t *why)
{
    memset(c->nonce_s, 0, NONCE_LEN);
    c->server_addr[0] = 0;
    c->server_ok = 0;
    c->retry_ms = 0;
    if (getrandom(c->nonce_c, NONCE_LEN, 0) != NONCE_LEN) {
        conn_fail(c, KVX_ERR_IO, "getrandom failed");
        why_set(why, "getrandom failed");
        return KVX_ERR_IO;
    }
    if (!(c->hs = hs_dial(ss, &hs_cbs, c))) {
        conn_fail(c, KVX_ERR_PEER_GONE, "cannot connect");
        why_set(why, "cannot connect to daemon %s", c->address);
        return KVX_ERR_PEER_GONE;
    }
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerHello h = KVXFER__PEER_HELLO__INIT;
    h.version = PEER_VERSION;
    h.minor = KVX_PROTOCOL_MINOR;
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
        why_set(why, "cannot send to daemon %s", c->address);
        return KVX_ERR_PEER_GONE;
    }
    return 0;
}

/* A dial whose handshake was cut, again (peer_tick()). */
void conn_redial(peer_conn_t *c)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    char why[256];
    if (parse_address(c->address, &ss, &sl, KVX_WHY(why))) {
        conn_fail(c, KVX_ERR_INVALID, "%s", why);
        return;
    }
    log_debug("peer %s: connecting again (try %u; %s)", c->address,
              c->tries + 1, c->last_cut);
    conn_dial(c, &ss, KVX_WHY(why));
}

peer_conn_t *peer_connect(const char *address, kvx_why_t *why)
{
    if (!P.on) {
        why_set(why,
                "daemon '%s' is another daemon, and transfers between "
                "daemons are off here (peer.listen is empty)",
                address);
        return NULL;
    }
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        if (c->outgoing && c->state != CONN_LOST &&
            !strcmp(c->address, address))
            return c;
    struct sockaddr_storage ss;
    socklen_t sl;
    if (peer_address_check(address, why) ||
        parse_address(address, &ss, &sl, why))
        return NULL;
    peer_conn_t *c = conn_new(1, address);
    if (!c) {
        why_set(why, "out of memory");
        return NULL;
    }
    if (conn_dial(c, &ss, why))
        return NULL;
    log_debug("peer %s: connecting", address);
    return c;
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
        for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c)) {
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
void on_hs_accept(hs_t *h)
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

void hello_refuse(peer_conn_t *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    refuse_v(c, 1, fmt, ap);
    va_end(ap);
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
    for (peer_conn_t *o = conn_next(NULL); o; o = conn_next(o)) {
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
        c->minor = h->minor;
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
        ch.minor = KVX_PROTOCOL_MINOR;
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
        c->minor = ch->minor;
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
        hmac("kvx-c", c->nonce_c, c->nonce_s, kvxd.address, c->address, mac);
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
        if (ucx_info_take(c, m->response->ucx, KVX_WHY(why))) {
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
            int rc = ucx_info_take(c, m->auth_result->ucx, KVX_WHY(why));
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
    conn_fail(c, KVX_ERR_PROTOCOL,
              "unexpected message %d during "
              "authentication",
              (int)m->m_case);
}
