/*
 * peer_int — what the files of peer (peer.h) share, private to net/: the
 * connection, a UCX request of ours, the UCP objects and the handlers the
 * layers above registered, and the calls one file makes into another.
 *
 *   peer.c            connections, sends and the send window, messages
 *                     in, what the lanes report, keep-alive, loss
 *   peer_handshake.c  the handshake's messages (HELLO .. AUTH_RESULT on
 *                     hs.c's socket, then BIND over UCX), dials, accepts
 *   peer_auth.c       the secret (loading, rotation), the MACs, the
 *                     HELLO's freshness and replay cache, the lanes' keys
 *   peer_addr.c       addresses (kvx://IP:PORT/ID), aliases of this
 *                     daemon, the cluster's networks (peer.allowed)
 *   peer_init.c       UCX brought up and down, and driven by the loop
 *   peer_status.c     what status reports of peers and UCX
 */
#ifndef KVX_PEER_INT_H
#define KVX_PEER_INT_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <uv.h>

#include "common/list.h"
#include "core/daemon.h"
#include "hs.h"
#include "lane.h"
#include "peer.h"

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

typedef struct qmsg {
    uint8_t *buf;
    size_t len;
    list_t node; /* on its connection's q */
} qmsg_t;

struct peer_conn {
    uint64_t id;       /* never reused (peer_conn_id) */
    hs_t *hs;          /* the handshake socket, until authenticated */
    ucp_ep_h ep;       /* ours, to its worker: what we send on */
    ucp_ep_h rx_ep;    /* UCX's reply endpoint of what it sends, once bound */
    uint8_t *ucx_addr; /* its worker's address (PeerUcx.worker) */
    size_t ucx_addr_len;
    int outgoing;
    uint32_t minor; /* its protocol minor (PeerHello/PeerChallenge.minor;
                       0: a daemon before 2.6) */
    enum conn_state state;
    char address[192]; /* the peer's; for incoming: after HELLO */
    uint8_t nonce_c[NONCE_LEN], nonce_s[NONCE_LEN];
    char server_addr[192]; /* outgoing: the address that answered */
    int server_ok;         /* outgoing: its CHALLENGE MAC checked */
    int sec_prev;          /* the handshake proved the previous
                              secret (a rotation's window) */
    int hello_ok;          /* incoming: its HELLO proved the secret,
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
    uint32_t outstanding; /* UCX requests not yet back */
    int closed;           /* ucp_ep_close started (or no ep) */
    int close_done;
    /* lost, and remote.c not told yet (peer_flush_lost()) */
    int lost_pending, lost_code;
    unsigned lost_next; /* the loss callback to call next */
    char lost_msg[300];
    list_t q; /* qmsg_t.node: sends waiting for authentication */
    /* slot sends: peer.send_window in flight, the rest wait here in
     * order (each counted in outstanding) */
    list_t dq; /* ureq_t.node */
    uint32_t data_inflight;
    /* of those, sent on the connection's own endpoint (not a lane), and
     * since when none has come back: the same keep-alive as the lanes',
     * which bounds how long a piece sent from a pool holds its fence */
    uint32_t conn_data_inflight;
    uint64_t conn_data_moved_ms;
    /* lanes: the keys of its DATA to us (rx) and ours to it (tx),
     * derived at authentication; our id of the connection (told in
     * PeerUcx) and its; its lanes' worker addresses; our endpoints to its lanes
     * (out_lep), by lane, 0 for none;
     * whether a send over our lane i has worked yet (until then a failing
     * lane turns lanes off for the connection: lanes_off) */
    uint8_t rx_key[MAC_LEN], tx_key[MAC_LEN];
    uint64_t lane_conn, peer_conn;
    uint8_t *lane_addr[LANES_MAX];
    size_t lane_addr_len[LANES_MAX];
    unsigned peer_lanes, lane_next;
    int lanes_off;
    uint64_t out_lep[LANES_MAX];
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
    list_t node; /* on P.conns */
};

/* A UCX request of ours: what to do when it comes back. */
typedef struct ureq {
    peer_conn_t *c;
    uint8_t *buf; /* freed when done (packed control msg) */
    void (*done)(void *arg, int status);
    void *arg;
    /* a receive: the message and where it goes */
    int recv_kind; /* 0 send, 1 ctrl recv, 2 data recv */
    Kvxfer__PeerMsg *hdr;
    size_t len;
    /* a slot send: its data, and its place in the connection's queue */
    int is_data;
    int on_lane;    /* sent or received by a lane: not in
                       P.inflight (the loop's worker) */
    int keyed;      /* its header has lane_conn, lane_mac */
    unsigned lane;  /* on_lane: which */
    uint32_t rails; /* the rails it should go over (0: any) */
    /* keyed: its DATA header unpacked, and the MAC, made when the lane
     * is known (the MAC names it) and packed into buf again */
    Kvxfer__PeerData pd;
    uint8_t mac[LANE_MAC_LEN];
    size_t hdr_len;
    const void *data;
    const peer_iov_t *iov; /* niov > 0: the data is there, not data */
    size_t niov;
    list_t node; /* queued: on its connection's dq */
} ureq_t;

struct peer_globals {
    int on;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_address_t *addr; /* the worker's, told after the handshake */
    size_t addr_len;
    uint8_t *dead_addr; /* FAULT_LANES: a worker that is gone */
    size_t dead_len;
    uv_poll_t poll;
    uv_prepare_t prepare;
    uv_idle_t idle; /* keeps the loop turning: pump() */
    int idle_on;
    int busy_poll;     /* peer.busy_poll, resolved */
    int stopping;      /* peer_cleanup(): the loop has stopped */
    uint32_t inflight; /* our UCX requests, every connection */
    int poll_on;
    list_t conns; /* peer_conn_t.node, the newest first */
    int ucx_cuda;
    char transports[256]; /* every transport a connection used */
    char listen[64];
    struct sockaddr_storage bound; /* the handshake listener's IP:PORT */
    char version[32];
    int rdma; /* UCX may use an RDMA device: peer_rdma() */
};
extern struct peer_globals P;

#define CONN(n) LIST_OWNER(n, peer_conn_t, node)
#define UREQ(n) LIST_OWNER(n, ureq_t, node)
#define QMSG(n) LIST_OWNER(n, qmsg_t, node)

/* The connection after c on P.conns (c NULL: the first), or NULL. */
static inline peer_conn_t *conn_next(const peer_conn_t *c)
{
    const list_t *n = c ? c->node.next : P.conns.next;
    return n == &P.conns ? NULL : CONN(n);
}

/* What the layers above registered (peer.h). */
#define MSG_KINDS 32
#define LOST_CBS 4
struct peer_handlers {
    peer_msg_cb msg[MSG_KINDS];
    peer_lost_cb lost[LOST_CBS];
    unsigned nlost;
    peer_data_ops_t data;
};
extern struct peer_handlers H;

static inline uint64_t now_ms(void)
{
    return kvxd_now_ms();
}

static inline void inflight_add(int n)
{
    P.inflight += n; /* pump() reads it */
}

static inline uint8_t *pack(const Kvxfer__PeerMsg *m, size_t *len)
{
    *len = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *b = malloc(*len ? *len : 1);
    if (b)
        kvxfer__peer_msg__pack(m, b);
    return b;
}

/* peer.c */
void conn_fail(peer_conn_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
peer_conn_t *conn_new(int outgoing, const char *address);
int send_packed(peer_conn_t *c, uint8_t *buf, size_t len);
int send_now(peer_conn_t *c, const Kvxfer__PeerMsg *m);
ucs_status_t am_ctrl(void *arg, const void *header, size_t hlen, void *data,
                     size_t len, const ucp_am_recv_param_t *param);
ucs_status_t am_data(void *arg, const void *header, size_t hlen, void *data,
                     size_t len, const ucp_am_recv_param_t *param);
void on_lane_event(const lane_ev_t *e);

/* peer_handshake.c */
void conn_redial(peer_conn_t *c);
void on_hs_accept(hs_t *h);
void bind_msg(ucp_ep_h from, const uint8_t *buf, size_t len);
void hello_refuse(peer_conn_t *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* peer_auth.c */
int read_secret(kvx_why_t *why);
void auth_tick(uint64_t now);
void hmac_with(int prev, const char *label, const uint8_t *nc,
               const uint8_t *ns, const char *server, const char *client,
               uint8_t out[MAC_LEN]);
void hmac(const char *label, const uint8_t *nc, const uint8_t *ns,
          const char *server, const char *client, uint8_t out[MAC_LEN]);
void hello_mac(int prev, const uint8_t *nc, const char *server,
               const char *client, uint64_t time_s, uint8_t out[MAC_LEN]);
int prev_open(void);
int ct_equal(const uint8_t *a, const uint8_t *b, size_t n);
int hello_check(peer_conn_t *c, const Kvxfer__PeerHello *h);
void keys_derive(peer_conn_t *c);
void bind_mac(const uint8_t key[MAC_LEN], uint64_t conn, uint8_t out[MAC_LEN]);
void lane_mac(const uint8_t key[MAC_LEN], const Kvxfer__PeerData *d,
              uint64_t len, unsigned lane, uint8_t out[LANE_MAC_LEN]);

/* peer_addr.c */
extern char nets_text[256];
int same_listener(const char *a, const char *b);
int same_sockaddr(const struct sockaddr_storage *a,
                  const struct sockaddr_storage *b);
int parse_address(const char *a, struct sockaddr_storage *ss, socklen_t *sl,
                  kvx_why_t *why);
int nets_init(const struct sockaddr_storage *listen, kvx_why_t *why);
int net_allows(const struct sockaddr_storage *ss);

/* peer_status.c */
void ep_transports(ucp_ep_h ep, char *out, size_t n);
void info_transports(char *info, char *out, size_t n);
void transports_add(char *list, size_t n, const char *tl);

#endif /* KVX_PEER_INT_H */
