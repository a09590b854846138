/*
 * peer — connections and what goes over them; see peer.h, and
 * peer_int.h for the other files of peer.
 *
 * Reading order:
 *   conn_new()       a connection (peer_handshake.c makes them: dials,
 *                    accepts, and authenticates them)
 *   peer_send()      control messages: queued until authenticated, then
 *                    eager on the connection's endpoint
 *   peer_send_data() slot data: peer.send_window sends in flight per
 *                    connection, the rest queued in order (data_start()),
 *                    over the other side's lanes (lane.c, peer.lanes) or
 *                    the connection itself
 *   am_ctrl/am_data  messages in: from a bound endpoint, to the layers
 *                    above
 *   on_lane_event()  what the lanes report
 *   peer_tick()      connect deadlines, redials, keep-alive, stalls
 *   conn_fail()      the one way a connection ends
 */

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <ucp/api/ucp.h>
#include <unistd.h>
#include <uv.h>

#include "core/daemon.h"
#include "core/fault.h"
#include "core/log.h"
#include "peer_int.h"
#include "peer_rails.h"
#include "ucx.h"

struct peer_globals P = {.conns = {&P.conns, &P.conns}};
struct peer_handlers H;

static void conn_try_free(peer_conn_t *c);

/* ---- connections ------------------------------------------------------- */

peer_conn_t *conn_new(int outgoing, const char *address)
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
    list_init(&c->q);
    list_init(&c->dq);
    list_unshift(&P.conns, &c->node);
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
    list_remove(&c->node);
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
static int am_send(peer_conn_t *c, unsigned id, const void *hdr, size_t hdr_len,
                   const void *buf, size_t len, ureq_t *u)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS |
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
    ucs_status_ptr_t r =
        ucp_am_send_nbx(c->ep, id, hdr, hdr_len, buf, len, &prm);
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

int send_packed(peer_conn_t *c, uint8_t *buf, size_t len)
{
    ureq_t *u = calloc(1, sizeof(*u));
    if (!u) {
        free(buf);
        /* a message lost: what the other side waits for never comes, so
         * the connection goes (its transfers end, the next use
         * reconnects) */
        conn_fail(c, KVX_ERR_NOMEM, "out of memory sending to %s", c->address);
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

/* Send now, whatever the state (the handshake itself). */
int send_now(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    size_t len;
    uint8_t *b = pack(m, &len);
    if (!b) { /* as in send_packed() */
        conn_fail(c, KVX_ERR_NOMEM, "out of memory sending to %s", c->address);
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
    list_push(&c->q, &q->node);
    return 0;
}

/* The lane for c's next slot send, its endpoint made on first use; -1:
 * none (no lanes here or there), or 0..n-1. Sends take the lanes both
 * sides have in turn: those of rails (0: any) where there are some. */
static int lane_pick(peer_conn_t *c, uint32_t rails)
{
    unsigned n = lanes_count();
    if (c->peer_lanes < n)
        n = c->peer_lanes;
    if (!n || c->lanes_off)
        return -1;
    unsigned i = rails_lane_next(rails, n, &c->lane_next);
    if (!c->out_lep[i]) {
        lane_connect(i, c->lane_addr[i], c->lane_addr_len[i], &c->out_lep[i]);
        c->lane_since[i] = now_ms();
    }
    return (int)i;
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
    while (c->state == CONN_READY && !list_empty(&c->dq) &&
           c->data_inflight < kvxd.conf.send_window) {
        ureq_t *u = UREQ(list_pop(&c->dq));
        c->data_inflight++;
        int lane = u->keyed ? lane_pick(c, u->rails) : -1;
        if (lane >= 0) {
            /* c->outstanding still counts it, until LEV_SENT */
            u->on_lane = 1;
            u->lane = (unsigned)lane;
            /* the MAC names the lane: made now that it is known */
            lane_mac(c->tx_key, &u->pd, u->len, u->lane, u->mac);
            data_pack(u);
            if (!c->lane_inflight[lane]++)
                c->lane_moved_ms[lane] = now_ms();
            lane_send((unsigned)lane, c->out_lep[lane],
                      &(lane_msg_t){.hdr = u->buf,
                                    .hlen = u->hdr_len,
                                    .data = u->data,
                                    .len = u->len,
                                    .iov = (const ucp_dt_iov_t *)u->iov,
                                    .niov = u->niov,
                                    .cookie = u});
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
            /* conn_fail gives it back with the rest */
            list_unshift(&c->dq, &u->node);
            conn_fail(c, KVX_ERR_PEER_GONE, "cannot send to %s", c->address);
            return;
        }
    }
}

int peer_send_queued(const peer_conn_t *c, const void *arg)
{
    for (const list_t *n = c->dq.next; n != &c->dq; n = n->next)
        if (UREQ(n)->arg == arg)
            return 1;
    return 0;
}

int peer_send_data(peer_conn_t *c, const peer_piece_t *p)
{
    if (!c || c->state != CONN_READY)
        return KVX_ERR_PEER_GONE;
    if (p->hdr->m_case != KVXFER__PEER_MSG__M_DATA)
        return KVX_ERR_INVALID;
    ureq_t *u = calloc(1, sizeof(*u));
    if (!u)
        return KVX_ERR_NOMEM;
    /* what the other side's lanes check (ignored on the connection): the
     * MAC is made, and the header packed, once the way is known
     * (data_start()) */
    u->pd = *p->hdr->data;
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
    u->data = p->buf;
    u->len = p->len;
    u->iov = p->niov ? p->iov : NULL;
    u->niov = p->niov;
    u->is_data = 1;
    u->keyed = c->peer_lanes != 0;
    u->done = p->done;
    u->arg = p->arg;
    u->rails = p->rails;
    c->outstanding++; /* waiting: keeps c until it is given back */
    list_push(&c->dq, &u->node);
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
    /* its endpoints on the lanes too: sends on them come back failed
     * (LEV_SENT), and so do receives of its data still in flight
     * (LEV_RECEIVED; both counted in outstanding). A lane holds no
     * pointer to c, only its requests' */
    for (unsigned i = 0; i < lanes_count(); i++) {
        if (c->out_lep[i])
            lane_close(i, c->out_lep[i]);
        lane_abort(i, c->lane_conn);
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
    for (peer_conn_t *x = conn_next(NULL); x; x = conn_next(x))
        lost += x->state == CONN_LOST;
    int replaced = 0;
    for (peer_conn_t *x = conn_next(NULL); x; x = conn_next(x))
        if (x != c && x->state != CONN_LOST && x->outgoing == c->outgoing &&
            !strcmp(x->address, c->address))
            replaced = 1;
    if (replaced || lost > MAX_LOST_KEPT || !c->address[0] || c->ep == NULL) {
        conn_unlink(c);
        conn_free(c);
    }
}

/* Tell the loss callbacks of every loss conn_fail() deferred (a loss it handles
 * may fail more connections: until none is left). One remote.c cannot
 * take yet (out of memory) stays pending: the tick (peer_tick()) tries
 * again, and closes nothing pending. */
static void peer_flush_lost(void)
{
    for (int again = 1; again;) {
        again = 0;
        for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
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
    list_t *n;
    while ((n = list_pop(&c->dq))) {
        ureq_t *u = UREQ(n);
        if (u->done)
            u->done(u->arg, KVX_ERR_PEER_GONE);
        free(u->buf);
        free(u);
        c->outstanding--;
    }
}

static void dq_give_back_later(void *arg)
{
    dq_give_back(arg);
    conn_try_free(arg);
}

void conn_fail(peer_conn_t *c, int code, const char *fmt, ...)
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
        log_f(LOG_WARNING, &(log_fields_t){.peer = c->address, .code = code},
              "peer %s: %s", c->address[0] ? c->address : "(incoming)", msg);
    list_t *n;
    while ((n = list_pop(&c->q))) {
        qmsg_t *q = QMSG(n);
        free(q->buf);
        free(q);
    }
    /* queued slot sends never started: their owners get them back from
     * the loop's next turn, never inside this call, whose caller (a send)
     * may still use what a give-back ends (a piece sent from a pool
     * releases its offer's fence); c stays meanwhile (each still counts
     * in outstanding). The loop stopped (peer_cleanup()), or out of
     * memory: now. */
    if (!list_empty(&c->dq) &&
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

uint64_t peer_conn_id(const peer_conn_t *c)
{
    return c->id;
}

int peer_conn_minor(const peer_conn_t *c)
{
    return c->state == CONN_READY ? (int)c->minor : -1;
}

peer_conn_t *peer_conn_find(uint64_t id)
{
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        if (c->id == id)
            return c;
    return NULL;
}

const char *peer_conn_address(const peer_conn_t *c)
{
    return c->address;
}

int peer_conn_alive(const peer_conn_t *c)
{
    return c->state != CONN_LOST;
}

int peer_conn_lanes(const peer_conn_t *c)
{
    return c->state == CONN_READY && c->peer_lanes && lanes_count() &&
           !c->lanes_off;
}

/* ---- messages in ------------------------------------------------------- */

static peer_conn_t *conn_of(const ucp_am_recv_param_t *p)
{
    if (!(p->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        return NULL;
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        if (c->rx_ep == p->reply_ep && !c->closed)
            return c;
    return NULL;
}

static void dispatch(peer_conn_t *c, const uint8_t *buf, size_t len)
{
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, len, buf);
    if (!m) {
        conn_fail(c, KVX_ERR_PROTOCOL, "malformed message from %s", c->address);
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

ucs_status_t am_ctrl(void *arg, const void *header, size_t hlen, void *data,
                     size_t len, const ucp_am_recv_param_t *param)
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
        conn_fail(c, KVX_ERR_PROTOCOL,
                  "%zu-byte message from %s exceeds "
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

ucs_status_t am_data(void *arg, const void *header, size_t hlen, void *data,
                     size_t len, const ucp_am_recv_param_t *param)
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

static peer_conn_t *conn_of_lep(unsigned lane, uint64_t lep)
{
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        if (c->out_lep[lane] == lep)
            return c;
    return NULL;
}

/* Lane data refused: said once, then at most once a second with how
 * many more (anyone who can reach a lane's port can send to it). */
static void lane_refused(unsigned lane, const char *bad)
{
    static uint64_t said_ms;
    static unsigned long long more;
    uint64_t now = now_ms();
    if (said_ms && now < said_ms + 1000) {
        more++;
        return;
    }
    if (more)
        log_warn("lane %u: data with %s; dropped (and %llu more refused "
                 "since the last warning)",
                 lane, bad, more);
    else
        log_warn("lane %u: data with %s; dropped", lane, bad);
    said_ms = now;
    more = 0;
}

/* Slot data that came over a lane: lane_conn names the connection, and
 * lane_mac proves that the daemon at its other end sent it (only the two
 * of them have the key; the endpoint it came over is UCX's, and says
 * nothing: lane.h); then as am_data(). */
static void lane_arrived(const lane_ev_t *e)
{
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, e->hlen, e->hdr);
    peer_conn_t *c = NULL;
    const char *bad = "no connection's MAC";
    if (m && m->m_case == KVXFER__PEER_MSG__M_DATA &&
        m->data->lane_mac.len == LANE_MAC_LEN && m->data->lane_conn) {
        for (c = conn_next(NULL); c; c = conn_next(c))
            if (c->state == CONN_READY && c->lane_conn == m->data->lane_conn)
                break;
        uint8_t mac[LANE_MAC_LEN];
        if (c) {
            lane_mac(c->rx_key, m->data, e->len, e->lane, mac);
            if (!ct_equal(mac, m->data->lane_mac.data, LANE_MAC_LEN))
                c = NULL;
        }
    }
    if (c && !e->desc) {
        bad = "eager data, not rendezvous,";
        c = NULL;
    }
    if (!c) {
        /* not (or no longer) a connection's: dropped */
        lane_refused(e->lane, bad);
        if (m)
            kvxfer__peer_msg__free_unpacked(m, NULL);
        if (e->desc)
            lane_drop(e->lane, e->desc);
        return;
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
    lane_recv(e->lane, e, c->lane_conn, dst, (const ucp_dt_iov_t *)iov, niov,
              u);
}

void on_lane_event(const lane_ev_t *e)
{
    ureq_t *u = e->cookie;
    peer_conn_t *c;
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
            list_unshift(&c->dq, &u->node);
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
        c = conn_of_lep(e->lane, e->lep);
        if (c && c->state == CONN_READY && !c->lane_ok[e->lane])
            lanes_off(c, e->lane, e->msg); /* never worked: a firewall? */
        else if (c && c->state != CONN_LOST)
            conn_fail(c, KVX_ERR_PEER_GONE, "lane %u to %s failed: %s", e->lane,
                      c->address, e->msg);
        break;
    case LEV_CLOSED: /* nothing waits for it */
        break;
    case LEV_INFO:
        /* the transports of c's data over this lane, once wired up */
        if ((c = conn_of_lep(e->lane, e->lep)) && c->state != CONN_LOST) {
            char tl[sizeof(c->transports)] = "";
            info_transports(e->info, tl, sizeof(tl));
            log_info("peer %s: lane %u carries its data over %s", c->address,
                     e->lane, tl[0] ? tl : "transports unknown");
            char *save = NULL;
            for (char *t = strtok_r(tl, ",", &save); t;
                 t = strtok_r(NULL, ",", &save))
                transports_add(c->transports, sizeof(c->transports), t);
        }
        break;
    }
}

/* ---- keep-alive --------------------------------------------------------- */

/* The data's keep-alive: a lane of c that carried data and has had
 * sends out with none back for peer.keepalive_timeout_ms, or c's data
 * coming in over our lanes with no receive back as long, or slot data
 * sent on c's own endpoint with none back as long: lost, like a peer
 * silent on the connection (a lane's TCP may stall where the
 * connection's does not, and a PONG gets through where a rendezvous
 * does not). It bounds how long a fence waits for UCX. 1 with why, or
 * 0. */
static int data_stalled(const peer_conn_t *c, uint64_t now, kvx_why_t *why)
{
    uint64_t t = kvxd.conf.keepalive_timeout_ms;
    for (unsigned i = 0; i < LANES_MAX; i++)
        if (c->lane_ok[i] && c->lane_inflight[i] &&
            now >= c->lane_moved_ms[i] + t) {
            why_set(why, "lane %u to %s: nothing sent for %llu ms", i,
                    c->address,
                    (unsigned long long)(now - c->lane_moved_ms[i]));
            return 1;
        }
    if (c->lane_rx_inflight && now >= c->lane_rx_moved_ms + t) {
        why_set(why, "lane data from %s: nothing arrived for %llu ms",
                c->address, (unsigned long long)(now - c->lane_rx_moved_ms));
        return 1;
    }
    if (c->conn_data_inflight && now >= c->conn_data_moved_ms + t) {
        why_set(why, "slot data to %s: nothing sent for %llu ms", c->address,
                (unsigned long long)(now - c->conn_data_moved_ms));
        return 1;
    }
    return 0;
}

void peer_tick(uint64_t now)
{
    if (!P.on)
        return;
    auth_tick(now);
    peer_flush_lost();
    for (peer_conn_t *c = conn_next(NULL), *n; c; c = n) {
        n = conn_next(c);
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
                      c->address, (unsigned long long)(now - c->last_seen_ms),
                      kvxd.conf.keepalive_timeout_ms);
            continue;
        }
        /* a lane endpoint that has not sent anything in the connect
         * time (its connection hangs: a firewall that drops) */
        for (unsigned i = 0; i < LANES_MAX; i++)
            if (c->out_lep[i] && !c->lane_ok[i] &&
                now >= c->lane_since[i] + kvxd.conf.peer_connect_timeout_ms)
                lanes_off(c, i,
                          "gave no answer within "
                          "peer.connect_timeout_ms");
        char stall[300];
        if (data_stalled(c, now, KVX_WHY(stall))) {
            conn_fail(c, KVX_ERR_PEER_GONE,
                      "%s (peer.keepalive_timeout_ms "
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

void peer_cleanup(void)
{
    if (!P.on)
        return;
    P.stopping = 1;
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c)) {
        if (c->state != CONN_LOST)
            conn_fail(c, KVX_ERR_SHUTDOWN, "daemon exiting");
        dq_give_back(c); /* a give-back queued for the loop's next turn */
    }
    peer_flush_lost(); /* the loop has stopped: now */
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        conn_close_ep(c);
    /* let the force-closes and cancelled requests come back (the
     * lanes' too: their events run here, the loop has stopped) */
    for (int i = 0; i < 1000 && !list_empty(&P.conns); i++) {
        while (ucp_worker_progress(P.worker))
            ;
        lanes_drain();
        for (peer_conn_t *c = conn_next(NULL), *n; c; c = n) {
            n = conn_next(c);
            if (!c->outstanding && c->close_done) {
                conn_unlink(c);
                conn_free(c);
            }
        }
        if (!list_empty(&P.conns))
            usleep(1000);
    }
    lanes_stop(); /* before the slots (remote_cleanup) and the context */
}

/* ---- what the layers above register ------------------------------------ */

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
