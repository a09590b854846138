/*
 * fake_peer — a daemon that does not know the cluster secret, for the
 * peer tests: it speaks the daemons' UCX control channel (active message
 * 1, one packed PeerMsg each) and tries the handshake's shortcuts.
 *
 *   fake_peer skip IP SECONDS
 *       listens on IP (a free port), prints its address, and answers a
 *       daemon's HELLO with AUTH_RESULT{0} without any CHALLENGE; prints
 *       "got N" for every later message (N: the PeerMsg case; 7 is OPEN).
 *   fake_peer relay IP TARGET_IP:PORT SECONDS
 *       listens the same way; a daemon that dials it has its HELLO sent
 *       on to TARGET, TARGET's CHALLENGE sent back, and the dialling
 *       daemon's RESPONSE sent on to TARGET: a man in the middle. Prints
 *       "auth_result N" with the code TARGET answers (0: the relay got
 *       in).
 *   fake_peer claim TARGET_IP:PORT CLAIMED_ADDRESS SECONDS
 *       connects to TARGET, says HELLO as CLAIMED_ADDRESS, then sends a
 *       PING instead of a RESPONSE (which fails the connection there).
 *   fake_peer replay SECRET_FILE IP TARGET_IP:PORT SECONDS
 *       a daemon that knows the secret but misbehaves: listens on IP,
 *       authenticates the daemon that dials it, takes its first OPEN,
 *       then authenticates to TARGET and sends it that OPEN twice;
 *       prints "opened" for each OPENED and "end CODE MESSAGE" for each
 *       END that TARGET answers.
 *   fake_peer lane TARGET_IP:PORT BYTES SECONDS
 *       connects to a daemon's lane (no handshake: lanes have none) and
 *       sends it slot data of BYTES with a connection id and MAC no
 *       connection has;
 *       prints "sent" when UCX is done with it and "closed" when the
 *       daemon closes the endpoint.
 *
 * Exits after SECONDS; prints "done".
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <ucp/api/ucp.h>

#include "kvxfer.pb-c.h"

#define AM_CTRL 1

static ucp_context_h ctx;
static ucp_worker_h worker;
static ucp_listener_h listener;
static ucp_ep_h from_ep;   /* the daemon that dialled us */
static ucp_ep_h to_ep;     /* the daemon we dialled */
static const char *mode, *target;
static char my_addr[128];

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

static int ep_failed;

static void err_cb(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)arg;
    (void)ep;
    (void)st;
    ep_failed = 1;
}

static int lane_sent;

static void lane_send_cb(void *req, ucs_status_t st, void *user)
{
    (void)user;
    lane_sent = st == UCS_OK ? 1 : -1;
    ucp_request_free(req);
}

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

static ucp_ep_h dial(const char *ipport)
{
    struct sockaddr_in sa;
    sockaddr_of(ipport, &sa);
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {(struct sockaddr *)&sa, sizeof(sa)},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {err_cb, NULL}};
    ucp_ep_h ep;
    if (ucp_ep_create(worker, &p, &ep) != UCS_OK)
        die("ucp_ep_create");
    return ep;
}

/* Sends wait here: they go from the main loop, never from inside a UCX
 * callback (which must not progress the worker). */
typedef struct out {
    int to_target; /* 0: the daemon that dialled us; 1: the one we dialled */
    ucp_ep_h ep;   /* or this one, when set */
    uint8_t *buf;
    size_t len;
} out_t;
static out_t outq[64];
static int nout, need_dial;

static void queue_raw(int to_target, const void *buf, size_t len)
{
    if (nout == 64)
        return;
    outq[nout].ep = NULL;
    outq[nout].to_target = to_target;
    outq[nout].buf = malloc(len ? len : 1);
    memcpy(outq[nout].buf, buf, len);
    outq[nout].len = len;
    nout++;
}

static void queue_msg(int to_target, const Kvxfer__PeerMsg *m)
{
    size_t n = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *b = malloc(n ? n : 1);
    kvxfer__peer_msg__pack(m, b);
    queue_raw(to_target, b, n);
    free(b);
}

static void send_now(ucp_ep_h ep, const void *buf, size_t len)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_AM_SEND_FLAG_REPLY};
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, AM_CTRL, NULL, 0, buf, len, &prm);
    if (UCS_PTR_IS_ERR(r))
        return;
    double end = now_s() + 2;
    while (r && ucp_request_check_status(r) == UCS_INPROGRESS &&
           now_s() < end)
        ucp_worker_progress(worker);
    if (r)
        ucp_request_free(r);
}

/* Main loop only: dial if asked, then send what waits for an endpoint. */
static void flush(void)
{
    if (need_dial && !to_ep)
        to_ep = dial(target);
    int kept = 0;
    for (int i = 0; i < nout; i++) {
        ucp_ep_h ep = outq[i].ep         ? outq[i].ep
                      : outq[i].to_target ? to_ep
                                          : from_ep;
        if (!ep) {
            outq[kept++] = outq[i];
            continue;
        }
        send_now(ep, outq[i].buf, outq[i].len);
        free(outq[i].buf);
    }
    nout = kept;
}

/* replay mode: the secret, both handshakes' nonces, the OPEN taken */
static uint8_t secret[4096];
static size_t secret_len;
static uint8_t nc_in[32], ns_in[32], nc_out[32];
static char from_addr[192];
static uint8_t *open_buf;
static size_t open_len;

/* The daemons' handshake MAC (daemon/net/peer.c, protocol 2). */
static void mac(const char *label, const uint8_t *nc, const uint8_t *ns,
                const char *server, const char *client, uint8_t out[32])
{
    uint8_t msg[8 + 64 + 2 * 192 + 1];
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

static void replay_msg(const Kvxfer__PeerMsg *m, const void *data, size_t len,
                       ucp_ep_h reply)
{
    Kvxfer__PeerMsg out = KVXFER__PEER_MSG__INIT;
    uint8_t tag[32];
    switch (m->m_case) {
    case KVXFER__PEER_MSG__M_HELLO: { /* the daemon that dials us */
        Kvxfer__PeerChallenge ch = KVXFER__PEER_CHALLENGE__INIT;
        memcpy(nc_in, m->hello->nonce.data,
               m->hello->nonce.len == 32 ? 32 : 0);
        snprintf(from_addr, sizeof(from_addr), "%s",
                 m->hello->address ? m->hello->address : "");
        if (getrandom(ns_in, 32, 0) != 32)
            die("getrandom");
        mac("kvx-s", nc_in, ns_in, my_addr, from_addr, tag);
        ch.address = my_addr;
        ch.nonce.data = ns_in;
        ch.nonce.len = 32;
        ch.mac.data = tag;
        ch.mac.len = 32;
        out.m_case = KVXFER__PEER_MSG__M_CHALLENGE;
        out.challenge = &ch;
        queue_msg(0, &out);
        break;
    }
    case KVXFER__PEER_MSG__M_RESPONSE: { /* ... proves the secret */
        Kvxfer__PeerAuthResult r = KVXFER__PEER_AUTH_RESULT__INIT;
        r.message = "";
        out.m_case = KVXFER__PEER_MSG__M_AUTH_RESULT;
        out.auth_result = &r;
        queue_msg(0, &out);
        break;
    }
    case KVXFER__PEER_MSG__M_OPEN: /* its stream: played to the target */
        if (!open_buf) {
            open_buf = malloc(len);
            memcpy(open_buf, data, len);
            open_len = len;
            need_dial = 1;
            Kvxfer__PeerHello h = KVXFER__PEER_HELLO__INIT;
            if (getrandom(nc_out, 32, 0) != 32)
                die("getrandom");
            h.version = 4; /* peer.c PEER_VERSION */
            h.address = my_addr;
            h.nonce.data = nc_out;
            h.nonce.len = 32;
            out.m_case = KVXFER__PEER_MSG__M_HELLO;
            out.hello = &h;
            queue_msg(1, &out);
        }
        break;
    case KVXFER__PEER_MSG__M_CHALLENGE: { /* the target's */
        Kvxfer__PeerResponse r = KVXFER__PEER_RESPONSE__INIT;
        mac("kvx-c", nc_out, m->challenge->nonce.data,
            m->challenge->address ? m->challenge->address : "", my_addr,
            tag);
        r.mac.data = tag;
        r.mac.len = 32;
        out.m_case = KVXFER__PEER_MSG__M_RESPONSE;
        out.response = &r;
        queue_msg(1, &out);
        break;
    }
    case KVXFER__PEER_MSG__M_AUTH_RESULT: /* the target let us in */
        printf("auth_result %d\n", m->auth_result->code);
        if (m->auth_result->code == 0) {
            queue_raw(1, open_buf, open_len);
            queue_raw(1, open_buf, open_len);
        }
        break;
    case KVXFER__PEER_MSG__M_OPENED:
        printf("opened\n");
        break;
    case KVXFER__PEER_MSG__M_END:
        printf("end %d %s\n", m->end->code,
               m->end->message ? m->end->message : "");
        break;
    case KVXFER__PEER_MSG__M_PING: /* keep both daemons' keep-alive */
        out.m_case = KVXFER__PEER_MSG__M_PONG;
        out.pong = m->ping;
        queue_msg(0, &out);
        if (nout)
            outq[nout - 1].ep = reply;
        break;
    default:
        break;
    }
    fflush(stdout);
}

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
    int kind = (int)m->m_case;
    if (!strcmp(mode, "replay")) {
        replay_msg(m, data, len,
                   (prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
                       ? prm->reply_ep
                       : NULL);
    } else if (!strcmp(mode, "skip")) {
        if (kind == KVXFER__PEER_MSG__M_HELLO) {
            Kvxfer__PeerMsg out = KVXFER__PEER_MSG__INIT;
            Kvxfer__PeerAuthResult r = KVXFER__PEER_AUTH_RESULT__INIT;
            r.message = "";
            out.m_case = KVXFER__PEER_MSG__M_AUTH_RESULT;
            out.auth_result = &r;
            queue_msg(0, &out);
        } else {
            printf("got %d\n", kind);
            fflush(stdout);
        }
    } else if (!strcmp(mode, "relay")) {
        switch (kind) {
        case KVXFER__PEER_MSG__M_HELLO: /* from the daemon that dialled */
            need_dial = 1;
            queue_raw(1, data, len);
            break;
        case KVXFER__PEER_MSG__M_CHALLENGE: /* from the target */
            queue_raw(0, data, len);
            break;
        case KVXFER__PEER_MSG__M_RESPONSE: /* from the daemon that dialled */
            queue_raw(1, data, len);
            break;
        case KVXFER__PEER_MSG__M_AUTH_RESULT: /* the target's verdict */
            printf("auth_result %d\n", m->auth_result->code);
            fflush(stdout);
            break;
        default:
            break;
        }
    }
    kvxfer__peer_msg__free_unpacked(m, NULL);
    return UCS_OK;
}

static void on_conn(ucp_conn_request_h req, void *arg)
{
    (void)arg;
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .conn_request = req,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {err_cb, NULL}};
    if (ucp_ep_create(worker, &p, &from_ep) != UCS_OK)
        die("ucp_ep_create (incoming)");
}

static void listen_on(const char *ip)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1)
        die("bad IP");
    ucp_listener_params_t lp = {
        .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                      UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        .sockaddr = {(struct sockaddr *)&sa, sizeof(sa)},
        .conn_handler = {on_conn, NULL}};
    if (ucp_listener_create(worker, &lp, &listener) != UCS_OK)
        die("ucp_listener_create");
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (ucp_listener_query(listener, &la) != UCS_OK)
        die("ucp_listener_query");
    int port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    snprintf(my_addr, sizeof(my_addr), "kvx://%s:%d/00000000000000ff", ip,
             port);
    printf("%s\n", my_addr);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc < 4)
        die("usage: fake_peer skip IP S | relay IP TARGET S | claim TARGET "
            "ADDRESS S");
    mode = argv[1];
    ucp_params_t up = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                       .features = UCP_FEATURE_AM};
    if (ucp_init(&up, NULL, &ctx) != UCS_OK)
        die("ucp_init");
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(ctx, &wp, &worker) != UCS_OK)
        die("ucp_worker_create");
    ucp_am_handler_param_t h = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                      UCP_AM_HANDLER_PARAM_FIELD_CB,
        .id = AM_CTRL,
        .cb = on_ctrl};
    if (ucp_worker_set_am_recv_handler(worker, &h) != UCS_OK)
        die("set_am_recv_handler");
    double seconds;
    if (!strcmp(mode, "skip")) {
        listen_on(argv[2]);
        seconds = atof(argv[3]);
    } else if (!strcmp(mode, "relay") && argc >= 5) {
        listen_on(argv[2]);
        target = argv[3];
        seconds = atof(argv[4]);
    } else if (!strcmp(mode, "replay") && argc >= 6) {
        FILE *f = fopen(argv[2], "r");
        if (!f)
            die("secret file");
        secret_len = fread(secret, 1, sizeof(secret), f);
        fclose(f);
        listen_on(argv[3]);
        target = argv[4];
        seconds = atof(argv[5]);
    } else if (!strcmp(mode, "claim") && argc >= 5) {
        to_ep = dial(argv[2]);
        Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
        Kvxfer__PeerHello hm = KVXFER__PEER_HELLO__INIT;
        uint8_t nonce[32] = {1, 2, 3};
        hm.version = 4; /* peer.c PEER_VERSION */
        hm.address = argv[3];
        hm.nonce.data = nonce;
        hm.nonce.len = sizeof(nonce);
        m.m_case = KVXFER__PEER_MSG__M_HELLO;
        m.hello = &hm;
        queue_msg(1, &m);
        flush();
        double t = now_s() + 0.3;
        while (now_s() < t)
            ucp_worker_progress(worker);
        Kvxfer__PeerMsg pm = KVXFER__PEER_MSG__INIT;
        pm.m_case = KVXFER__PEER_MSG__M_PING;
        pm.ping = 1;
        queue_msg(1, &pm);
        flush();
        seconds = atof(argv[4]);
    } else if (!strcmp(mode, "lane") && argc >= 5) {
        to_ep = dial(argv[2]);
        size_t bytes = (size_t)atol(argv[3]);
        uint8_t key[16], *data = malloc(bytes ? bytes : 1);
        memset(key, 0xab, sizeof(key));
        memset(data, 0x5a, bytes);
        Kvxfer__PeerData d = KVXFER__PEER_DATA__INIT;
        d.stream = 1;
        d.slot = 0;
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
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                            UCP_OP_ATTR_FIELD_FLAGS,
            .cb.send = lane_send_cb,
            .flags = UCP_AM_SEND_FLAG_REPLY};
        ucs_status_ptr_t r = ucp_am_send_nbx(to_ep, 2, h, hl, data, bytes,
                                             &prm);
        if (UCS_PTR_IS_ERR(r))
            lane_sent = -1;
        else if (r == NULL)
            lane_sent = 1;
        seconds = atof(argv[4]);
        double end = now_s() + seconds;
        int said_sent = 0;
        while (now_s() < end && !ep_failed) {
            ucp_worker_progress(worker);
            if (lane_sent && !said_sent) {
                printf(lane_sent > 0 ? "sent\n" : "send failed\n");
                fflush(stdout);
                said_sent = 1;
            }
        }
        if (ep_failed)
            printf("closed\n");
        printf("done\n");
        fflush(stdout);
        free(h); /* the exit closes the rest */
        free(data);
        return 0;
    } else {
        die("unknown mode");
    }
    double end = now_s() + seconds;
    while (now_s() < end) {
        ucp_worker_progress(worker);
        flush();
    }
    printf("done\n");
    fflush(stdout);
    return 0; /* the process exit closes everything */
}
