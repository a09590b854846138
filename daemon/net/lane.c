/*
 * lane — UCX workers on their own threads for slot data; see lane.h.
 *
 * Reading order:
 *   lanes_start()    per lane: worker, its address, eventfds, the thread
 *   lane_main()      the thread: commands in, progress, sleep on the
 *                    worker's fd and the command eventfd when idle
 *   run_cmd()        connect, send, receive, drop, close, stop
 *   on_data()        a message in: the header copied, the rendezvous
 *                    descriptor kept, an LEV_ARRIVED to the loop
 *   emit()/on_async  events to the loop, run there in order
 *
 * Threads: everything UCX of a lane runs on its thread, except its
 * creation and destruction (before the thread starts and after it has
 * been joined). The loop and a lane share only the two queues, each
 * under its mutex; a cookie or buffer crosses with its command or event.
 */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "core/daemon.h"
#include "core/fault.h"
#include "core/log.h"
#include "lane.h"
#include "ucx.h"

#define AM_LANE_DATA 2 /* the same id as peer.c's AM_DATA */
#define STOP_WAIT_MS 2000

enum lcmd_op {
    LC_CONNECT,
    LC_SEND,
    LC_RECV,
    LC_DROP,
    LC_CLOSE,
    LC_ABORT,
    LC_STOP
};

typedef struct lcmd {
    enum lcmd_op op;
    uint64_t lep;
    uint8_t *addr; /* LC_CONNECT: the worker address, ours to free */
    size_t addr_len;
    const uint8_t *hdr;
    size_t hlen;
    const void *data;
    void *dst, *desc;
    size_t len;
    /* LC_RECV into places, not dst; LC_SEND from places, not data */
    const ucp_dt_iov_t *iov;
    size_t niov;
    void *cookie;
    void *from;     /* LC_RECV: the UCX endpoint the data came on */
    uint64_t group; /* LC_RECV, LC_ABORT */
    list_t node;    /* on its lane's cmds */
} lcmd_t;

struct lane;

/* An endpoint of a lane, made by lane_connect() to another daemon's
 * lane. The endpoints UCX makes for workers that send to us are UCX's:
 * never looked at, never closed here (lane.h). */
typedef struct lep {
    uint64_t id;
    ucp_ep_h ep;
    struct lane *ln;
    int failed;      /* its error reported; to be closed */
    int closing;     /* ucp_ep_close_nbx started */
    int want_closed; /* the loop asked: LEV_CLOSED once closed */
    int told;        /* its LEV_INFO sent */
    list_t node;     /* on its lane's eps */
} lep_t;

/* An endpoint UCX made for a worker that sends to us, while receives
 * of ours on it are in flight. It is UCX's: UCX destroys it on its own
 * when its peer fails, but only after failing every request on it
 * (ucp_ep_set_failed() purges them, and each comes back to us, before
 * the endpoint goes). So while n > 0 it is there, and closing it is how
 * the loop ends receives that would otherwise wait on a link that is
 * down (lane_abort()); with none in flight it is never touched. */
typedef struct rx {
    ucp_ep_h ep;
    struct lane *ln;
    uint64_t group; /* whose: the loop's (lane_recv()) */
    uint32_t n;     /* receives in flight on it */
    int closing;    /* force-closed: freed once n is 0 and the close done */
    int close_done;
    list_t node; /* on its lane's rxs */
} rx_t;

typedef struct lane {
    unsigned idx;
    pthread_t th;
    int started;
    ucp_worker_h w;
    ucp_address_t *addr; /* the worker's, told to peers */
    size_t addr_len;
    int efd, cfd, epfd;
    pthread_mutex_t mu; /* the command queue */
    list_t cmds;        /* lcmd_t.node, in the order posted */
    /* the lane thread's own */
    list_t eps; /* lep_t.node, the newest first */
    list_t rxs; /* rx_t.node */
    uint32_t outstanding;
    int stopping;
    lcmd_t stop_cmd; /* posted by lanes_stop(), never freed */
} lane_t;

/* A UCX request of a lane: what to hand back. */
typedef struct lreq {
    lane_t *ln;
    void *cookie;
    uint64_t lep; /* a send: the endpoint it went on */
    rx_t *rx;     /* a receive: the endpoint it is on */
} lreq_t;

static struct {
    unsigned n;
    lane_t v[LANES_MAX];
    int spin;
    uv_async_t async;
    int async_on;
    pthread_mutex_t mu; /* the event queue */
    list_t evq;         /* lane_ev_t.node, in the order queued */
    void (*ev)(const lane_ev_t *e);
    _Atomic uint64_t next_lep;
} L = {.evq = {&L.evq, &L.evq}};

#define CMD(n) LIST_OWNER(n, lcmd_t, node)
#define LEP(n) LIST_OWNER(n, lep_t, node)
#define EV(n) LIST_OWNER(n, lane_ev_t, node)
#define RX(n) LIST_OWNER(n, rx_t, node)

/* ---- events to the loop ----------------------------------------------- */

static void ev_push(lane_ev_t *e)
{
    pthread_mutex_lock(&L.mu);
    assert(!list_linked(&e->node));
    list_push(&L.evq, &e->node);
    pthread_mutex_unlock(&L.mu);
    uv_async_send(&L.async);
}

/* Every event queued so far, in order, moved to evs. */
static void ev_take(list_t *evs)
{
    list_init(evs);
    pthread_mutex_lock(&L.mu);
    list_move_all(&L.evq, evs);
    pthread_mutex_unlock(&L.mu);
}

static void emit(lane_t *ln, enum lane_ev_kind kind, uint64_t lep,
                 ucs_status_t st, void *cookie)
{
    lane_ev_t *e = calloc(1, sizeof(*e));
    if (!e) {
        /* a lost event would hang what waits for it: the one thing a
         * lane cannot do without; the daemon stops instead */
        log_error("lane %u: out of memory for an event", ln->idx);
        abort();
    }
    e->kind = kind;
    e->lane = ln->idx;
    e->lep = lep;
    e->status = st == UCS_OK ? 0 : KVX_ERR_IO;
    e->msg = ucs_status_string(st);
    e->cookie = cookie;
    list_init(&e->node);
    ev_push(e);
}

static uint64_t mono_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

static void ev_free(lane_ev_t *e)
{
    free(e->hdr);
    free(e->info);
    free(e);
}

void lanes_drain(void)
{
    for (;;) {
        list_t evs, *n;
        ev_take(&evs);
        if (list_empty(&evs))
            return;
        while ((n = list_pop(&evs))) {
            if (L.ev)
                L.ev(EV(n));
            ev_free(EV(n));
        }
    }
}

static void on_async(uv_async_t *a)
{
    (void)a;
    lanes_drain();
}

/* ---- the lane thread ---------------------------------------------------- */

static lep_t *lep_find(lane_t *ln, uint64_t id)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &ln->eps)
    {
        if (LEP(n)->id == id)
            return LEP(n);
    }
    return NULL;
}

static void lep_gone(lep_t *p)
{
    lane_t *ln = p->ln;
    if (p->want_closed)
        emit(ln, LEV_CLOSED, p->id, UCS_OK, NULL);
    assert(list_linked(&p->node));
    list_remove(&p->node);
    free(p);
}

static void close_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    lep_t *p = user_data;
    ucp_request_free(request);
    p->ln->outstanding--;
    lep_gone(p);
}

/* Another endpoint of the lane on p's UCX endpoint, or NULL. Two of
 * ours could share one if ucp_ep_create() handed back an endpoint it
 * already gave (UCX 1.13 matches a new endpoint to one it made for that
 * worker's wire-up, by the pair's connection number): it is closed once,
 * by the last that holds it. */
static lep_t *lep_sharing(const lep_t *p)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &p->ln->eps)
    {
        if (LEP(n) != p && LEP(n)->ep == p->ep)
            return LEP(n);
    }
    return NULL;
}

static void lep_close(lep_t *p)
{
    if (p->closing)
        return;
    p->closing = 1;
    /* the UCX endpoint is closed once, by the last that holds it: a
     * second ucp_ep_close_nbx() would destroy it again (freed memory,
     * or by then another connection's endpoint) */
    if (!p->ep || lep_sharing(p)) {
        lep_gone(p);
        return;
    }
    if (ucx_close(p->ep, close_cb, p))
        p->ln->outstanding++;
    else
        lep_gone(p);
}

static void lep_fail(lep_t *p, ucs_status_t status)
{
    if (p->failed)
        return;
    p->failed = 1; /* closed from lane_main, outside UCX's callback */
    emit(p->ln, LEV_EP_ERROR, p->id, status, NULL);
}

/* UCX's error handler of a lane's endpoints: its argument is the lane,
 * not an endpoint of ours, since two of ours may share one UCX endpoint
 * (lep_sharing()); each that holds it fails. */
static void ep_err(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    lane_t *ln = arg;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &ln->eps)
    {
        if (LEP(n)->ep == ep)
            lep_fail(LEP(n), status);
    }
}

static lep_t *lep_new(lane_t *ln, uint64_t id)
{
    lep_t *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->id = id;
    p->ln = ln;
    list_unshift(&ln->eps, &p->node);
    return p;
}

/* ---- endpoints UCX made, while we receive on them ---------------------- */

static rx_t *rx_get(lane_t *ln, ucp_ep_h ep, uint64_t group)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &ln->rxs)
    {
        if (RX(n)->ep == ep && !RX(n)->closing)
            return RX(n);
    }
    rx_t *x = calloc(1, sizeof(*x));
    if (!x)
        return NULL;
    x->ep = ep;
    x->ln = ln;
    x->group = group;
    list_push(&ln->rxs, &x->node);
    return x;
}

static void rx_put(rx_t *x)
{
    if (x->n || (x->closing && !x->close_done))
        return;
    list_remove(&x->node);
    free(x);
}

static void rx_close_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    rx_t *x = user_data;
    ucp_request_free(request);
    x->ln->outstanding--;
    x->close_done = 1;
    rx_put(x);
}

/* Force-closes x's endpoint, which fails its receives (their callbacks
 * come from the close, or from the progress after it). */
static void rx_close(rx_t *x)
{
    if (x->closing)
        return;
    x->closing = 1;
    if (ucx_close(x->ep, rx_close_cb, x))
        x->ln->outstanding++;
    else
        x->close_done = 1;
    rx_put(x);
}

/* The first send of p is done, so UCX has wired p up: what it says of
 * p's lanes goes to the loop (status: the transports that carry a
 * connection's bytes). Not told when memory is short. */
static void lep_tell(lep_t *p)
{
    char *buf = NULL;
    size_t len = 0;
    p->told = 1;
    FILE *m = open_memstream(&buf, &len);
    if (!m)
        return;
    ucp_ep_print_info(p->ep, m);
    fclose(m);
    lane_ev_t *e = calloc(1, sizeof(*e));
    if (!e || !buf) {
        free(e);
        free(buf);
        return;
    }
    e->kind = LEV_INFO;
    e->lane = p->ln->idx;
    e->lep = p->id;
    e->msg = "";
    e->info = buf;
    list_init(&e->node);
    ev_push(e);
}

static void send_cb(void *request, ucs_status_t status, void *user_data)
{
    lreq_t *q = user_data;
    q->ln->outstanding--;
    lep_t *p = status == UCS_OK ? lep_find(q->ln, q->lep) : NULL;
    if (p && !p->told && !p->failed && !p->closing)
        lep_tell(p);
    emit(q->ln, LEV_SENT, 0, status, q->cookie);
    free(q);
    ucp_request_free(request);
}

static void recv_cb(void *request, ucs_status_t status, size_t length,
                    void *user_data)
{
    (void)length;
    lreq_t *q = user_data;
    q->ln->outstanding--;
    emit(q->ln, LEV_RECEIVED, 0, status, q->cookie);
    if (q->rx) {
        q->rx->n--;
        rx_put(q->rx);
    }
    free(q);
    ucp_request_free(request);
}

/* DATA in. Which connection it is of, and whether it is, the loop
 * decides from its header alone (lane_conn and lane_mac). The endpoint
 * it came on is UCX's, made for that worker's wire-up: handed through
 * the loop to lane_recv() (rx_t), never closed otherwise, since UCX may
 * destroy it on its own (a peer lost) and closing it then was a use
 * after free. */
static ucs_status_t on_data(void *arg, const void *header, size_t hlen,
                            void *data, size_t len,
                            const ucp_am_recv_param_t *param)
{
    lane_t *ln = arg;
    if (ln->stopping)
        return UCS_OK; /* dropped (a rendezvous: released) */
    int rndv = !!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV);
    if (rndv && fault_hit(FAULT_LANE_HOLD))
        return UCS_INPROGRESS; /* kept, never answered: a stalled lane */
    /* lanes send by rendezvous only: eager data is never copied, the
     * loop sees its header alone (and refuses it) */
    lane_ev_t *e = calloc(1, sizeof(*e));
    uint8_t *h = malloc(hlen ? hlen : 1);
    if (!e || !h) {
        free(e);
        free(h);
        log_error("lane %u: out of memory for a message; dropped", ln->idx);
        return UCS_OK; /* a rendezvous: released; its sender's pull fails
                          by its timeout */
    }
    memcpy(h, header, hlen);
    e->kind = LEV_ARRIVED;
    e->lane = ln->idx;
    e->msg = "";
    e->hdr = h;
    e->hlen = hlen;
    e->desc = rndv ? data : NULL;
    e->len = len;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
        e->from = param->reply_ep;
    list_init(&e->node);
    ev_push(e);
    return rndv ? UCS_INPROGRESS : UCS_OK;
}

/* A send or receive UCX may have started (r): counted until its
 * callback, or its failure handed back now as the event kind. */
static void lreq_started(lane_t *ln, lreq_t *q, ucs_status_ptr_t r,
                         enum lane_ev_kind kind)
{
    if (UCS_PTR_IS_ERR(r) || !r) { /* failed, or done at once */
        emit(ln, kind, 0, UCS_PTR_STATUS(r), q->cookie);
        free(q);
    } else {
        ln->outstanding++;
    }
}

static lreq_t *lreq_new(lane_t *ln, void *cookie)
{
    lreq_t *q = calloc(1, sizeof(*q));
    if (q) {
        q->ln = ln;
        q->cookie = cookie;
    }
    return q;
}

static void run_cmd(lane_t *ln, lcmd_t *c)
{
    ucs_status_ptr_t r;
    lep_t *p;
    switch (c->op) {
    case LC_CONNECT: {
        p = lep_new(ln, c->lep);
        if (!p) {
            emit(ln, LEV_EP_ERROR, c->lep, UCS_ERR_NO_MEMORY, NULL);
            break;
        }
        ucs_status_t st =
            ucx_connect_addr(ln->w, c->addr, c->addr_len, ep_err, ln, &p->ep);
        if (st != UCS_OK)
            lep_fail(p, st);
        break;
    }
    case LC_SEND: {
        p = lep_find(ln, c->lep);
        lreq_t *q = lreq_new(ln, c->cookie);
        if (q)
            q->lep = c->lep;
        if (!p || p->failed || p->closing || !q) {
            ucs_status_t st = q ? UCS_ERR_CONNECTION_RESET : UCS_ERR_NO_MEMORY;
            free(q);
            emit(ln, LEV_SENT, 0, st, c->cookie);
            break;
        }
        /* rendezvous whatever the size: the receiving lane takes it
         * straight into its place, never a copy on the loop */
        ucp_request_param_t prm = {
            .op_attr_mask =
                UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            .cb.send = send_cb,
            .user_data = q,
            /* the receiver knows the connection by the header
             * (on_data()), and ends its receives by the endpoint */
            .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_RNDV};
        const void *src = c->data;
        size_t n = c->len;
        if (c->niov) {
            /* from its places: no gather before. UCX 1.13's
             * ucp_am_send_nbx ignores the datatype when NO_IMM_CMPL is
             * set too (it sent the iov array itself): not set; a
             * rendezvous never completes at once (lreq_started) */
            prm.op_attr_mask &= ~(uint32_t)UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
            prm.op_attr_mask |=
                UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            prm.datatype = ucp_dt_make_iov();
            prm.memory_type = UCS_MEMORY_TYPE_HOST; /* host pools only */
            src = c->iov;
            n = c->niov;
        }
        r = ucp_am_send_nbx(p->ep, AM_LANE_DATA, c->hdr, c->hlen, src, n, &prm);
        lreq_started(ln, q, r, LEV_SENT);
        break;
    }
    case LC_RECV: {
        lreq_t *q = lreq_new(ln, c->cookie);
        if (!q) {
            ucp_am_data_release(ln->w, c->desc);
            emit(ln, LEV_RECEIVED, 0, UCS_ERR_NO_MEMORY, c->cookie);
            break;
        }
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                   UCP_OP_ATTR_FIELD_USER_DATA |
                                                   UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                                   .cb.recv_am = recv_cb,
                                   .user_data = q};
        void *dst = c->dst;
        size_t n = c->len;
        if (c->niov) { /* straight into its places: no copy after */
            prm.op_attr_mask |=
                UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            prm.datatype = ucp_dt_make_iov();
            prm.memory_type = UCS_MEMORY_TYPE_HOST; /* host pools only */
            dst = (void *)c->iov;
            n = c->niov;
        }
        r = ucp_am_recv_data_nbx(ln->w, c->desc, dst, n, &prm);
        if (!UCS_PTR_IS_ERR(r) && r && c->from &&
            (q->rx = rx_get(ln, c->from, c->group)))
            q->rx->n++; /* (out of memory: not abortable, still ends by
                           UCX's own failure of the endpoint) */
        lreq_started(ln, q, r, LEV_RECEIVED);
        break;
    }
    case LC_DROP:
        ucp_am_data_release(ln->w, c->desc);
        break;
    case LC_CLOSE:
        p = lep_find(ln, c->lep);
        if (!p) {
            emit(ln, LEV_CLOSED, c->lep, UCS_OK, NULL);
            break;
        }
        p->want_closed = 1;
        lep_close(p);
        break;
    case LC_ABORT: {
        list_t *n, *t;
        LIST_FOREACH_SAFE(n, t, &ln->rxs)
        {
            if (RX(n)->group == c->group)
                rx_close(RX(n));
        }
        break;
    }
    case LC_STOP: {
        ln->stopping = 1;
        list_t *n, *t;
        LIST_FOREACH_SAFE(n, t, &ln->eps)
        {
            lep_close(LEP(n));
        }
        LIST_FOREACH_SAFE(n, t, &ln->rxs)
        {
            rx_close(RX(n));
        }
        break;
    }
    }
    if (c != &ln->stop_cmd) {
        free(c->addr);
        free(c);
    }
}

static int run_cmds(lane_t *ln)
{
    list_t cmds, *c;
    list_init(&cmds);
    pthread_mutex_lock(&ln->mu);
    list_move_all(&ln->cmds, &cmds);
    pthread_mutex_unlock(&ln->mu);
    int n = 0;
    while ((c = list_pop(&cmds))) {
        run_cmd(ln, CMD(c));
        n++;
    }
    return n;
}

static void *lane_main(void *arg)
{
    lane_t *ln = arg;
    char name[16];
    snprintf(name, sizeof(name), "kvx-lane-%u", ln->idx);
    pthread_setname_np(pthread_self(), name);
    uint64_t stop_at = 0;
    for (;;) {
        int busy = run_cmds(ln);
        while (ucp_worker_progress(ln->w))
            busy = 1;
        /* endpoints whose error came in a callback: closed here */
        list_t *n, *t;
        LIST_FOREACH_SAFE(n, t, &ln->eps)
        {
            if (LEP(n)->failed && !LEP(n)->closing)
                lep_close(LEP(n));
        }
        if (ln->stopping) {
            if (!stop_at)
                stop_at = mono_ms() + STOP_WAIT_MS;
            if ((list_empty(&ln->eps) && list_empty(&ln->rxs) &&
                 !ln->outstanding) ||
                mono_ms() > stop_at)
                break;
            continue;
        }
        if (busy || (L.spin && ln->outstanding))
            continue;
        if (ucp_worker_arm(ln->w) == UCS_ERR_BUSY)
            continue;
        struct epoll_event ev[2];
        int r = epoll_wait(ln->epfd, ev, 2, 1000);
        for (int i = 0; i < r; i++)
            if (ev[i].data.fd == ln->cfd) {
                uint64_t v;
                ssize_t rd = read(ln->cfd, &v, sizeof(v));
                (void)rd;
            }
    }
    return NULL;
}

/* ---- commands (the loop) ------------------------------------------------ */

static void post(unsigned lane, lcmd_t *c)
{
    lane_t *ln = &L.v[lane];
    pthread_mutex_lock(&ln->mu);
    assert(!list_linked(&c->node)); /* posted once */
    list_push(&ln->cmds, &c->node);
    pthread_mutex_unlock(&ln->mu);
    uint64_t one = 1;
    ssize_t w = write(ln->cfd, &one, sizeof(one));
    (void)w; /* an eventfd at its maximum is already readable */
}

static lcmd_t *cmd(enum lcmd_op op)
{
    lcmd_t *c = calloc(1, sizeof(*c));
    if (!c) { /* as in emit() */
        log_error("lanes: out of memory for a command");
        abort();
    }
    c->op = op;
    list_init(&c->node);
    return c;
}

void lane_connect(unsigned lane, const uint8_t *addr, size_t len, uint64_t *lep)
{
    lcmd_t *c = cmd(LC_CONNECT);
    if (!(c->addr = malloc(len ? len : 1))) { /* as in cmd() */
        log_error("lanes: out of memory for a command");
        abort();
    }
    memcpy(c->addr, addr, len);
    c->addr_len = len;
    c->lep = *lep = atomic_fetch_add(&L.next_lep, 1);
    post(lane, c);
}

void lane_send(unsigned lane, uint64_t lep, const lane_msg_t *m)
{
    lcmd_t *c = cmd(LC_SEND);
    c->lep = lep;
    c->hdr = m->hdr;
    c->hlen = m->hlen;
    c->data = m->data;
    c->len = m->len;
    c->iov = m->iov;
    c->niov = m->niov;
    c->cookie = m->cookie;
    post(lane, c);
}

void lane_recv(unsigned lane, const lane_ev_t *arrived, uint64_t group,
               void *dst, const ucp_dt_iov_t *iov, size_t niov, void *cookie)
{
    lcmd_t *c = cmd(LC_RECV);
    c->desc = arrived->desc;
    c->from = arrived->from;
    c->group = group;
    size_t len = arrived->len;
    c->dst = dst;
    c->len = len;
    c->iov = iov;
    c->niov = niov;
    c->cookie = cookie;
    post(lane, c);
}

void lane_drop(unsigned lane, void *desc)
{
    lcmd_t *c = cmd(LC_DROP);
    c->desc = desc;
    post(lane, c);
}

void lane_abort(unsigned lane, uint64_t group)
{
    lcmd_t *c = cmd(LC_ABORT);
    c->group = group;
    post(lane, c);
}

void lane_close(unsigned lane, uint64_t lep)
{
    lcmd_t *c = cmd(LC_CLOSE);
    c->lep = lep;
    post(lane, c);
}

/* ---- life ---------------------------------------------------------------- */

unsigned lanes_count(void)
{
    return L.n;
}

const uint8_t *lane_address(unsigned lane, size_t *len)
{
    assert(lane < L.n);
    *len = L.v[lane].addr_len;
    return (const uint8_t *)L.v[lane].addr;
}

static void lane_destroy(lane_t *ln)
{
    if (ln->addr)
        ucp_worker_release_address(ln->w, ln->addr);
    if (ln->w)
        ucp_worker_destroy(ln->w); /* may call back on what is left */
    list_t *n;
    while ((n = list_pop(&ln->eps))) /* not closed in time */
        free(LEP(n));
    while ((n = list_pop(&ln->rxs)))
        free(RX(n));
    if (ln->epfd >= 0)
        close(ln->epfd);
    if (ln->cfd >= 0)
        close(ln->cfd);
    while ((n = list_pop(&ln->cmds)))
        if (CMD(n) != &ln->stop_cmd) {
            free(CMD(n)->addr);
            free(CMD(n));
        }
    pthread_mutex_destroy(&ln->mu);
    memset(ln, 0, sizeof(*ln));
}

static int lane_init(lane_t *ln, unsigned idx, ucp_context_h ctx,
                     kvx_why_t *why)
{
    ln->idx = idx;
    ln->epfd = ln->cfd = -1;
    list_init(&ln->cmds);
    list_init(&ln->eps);
    list_init(&ln->rxs);
    list_init(&ln->stop_cmd.node);
    pthread_mutex_init(&ln->mu, NULL);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucs_status_t st = ucp_worker_create(ctx, &wp, &ln->w);
    if (st != UCS_OK) {
        ln->w = NULL;
        why_set(why, "lane %u: ucp_worker_create: %s", idx,
                ucs_status_string(st));
        return KVX_ERR_IO;
    }
    ucp_am_handler_param_t h = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                              UCP_AM_HANDLER_PARAM_FIELD_CB |
                                              UCP_AM_HANDLER_PARAM_FIELD_ARG |
                                              UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
                                .id = AM_LANE_DATA,
                                .cb = on_data,
                                .arg = ln,
                                .flags = UCP_AM_FLAG_WHOLE_MSG};
    if ((st = ucp_worker_set_am_recv_handler(ln->w, &h)) != UCS_OK ||
        (st = ucp_worker_get_efd(ln->w, &ln->efd)) != UCS_OK) {
        why_set(why, "lane %u: %s", idx, ucs_status_string(st));
        return KVX_ERR_IO;
    }
    if ((st = ucp_worker_get_address(ln->w, &ln->addr, &ln->addr_len)) !=
        UCS_OK) {
        ln->addr = NULL;
        why_set(why, "lane %u: ucp_worker_get_address: %s", idx,
                ucs_status_string(st));
        return KVX_ERR_IO;
    }
    ln->cfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ln->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event e1 = {.events = EPOLLIN, .data.fd = ln->efd},
                       e2 = {.events = EPOLLIN, .data.fd = ln->cfd};
    if (ln->cfd < 0 || ln->epfd < 0 ||
        epoll_ctl(ln->epfd, EPOLL_CTL_ADD, ln->efd, &e1) ||
        epoll_ctl(ln->epfd, EPOLL_CTL_ADD, ln->cfd, &e2)) {
        why_set(why, "lane %u: eventfd/epoll: %s", idx, strerror(errno));
        return KVX_ERR_IO;
    }
    return 0;
}

int lanes_start(const lanes_conf_t *cf, kvx_why_t *why)
{
    unsigned n = cf->n;
    if (!n)
        return 0;
    if (n > LANES_MAX)
        n = LANES_MAX;
    pthread_mutex_init(&L.mu, NULL);
    atomic_store(&L.next_lep, 1);
    L.ev = cf->ev;
    L.spin = cf->spin;
    if (uv_async_init(cf->loop, &L.async, on_async)) {
        why_set(why, "lanes: uv_async_init failed");
        return KVX_ERR_IO;
    }
    L.async_on = 1;
    int rc;
    for (L.n = 0; L.n < n; L.n++) {
        lane_t *ln = &L.v[L.n];
        ucp_context_h ctx = cf->ctxs && cf->ctxs[L.n] ? cf->ctxs[L.n] : cf->ctx;
        if ((rc = lane_init(ln, L.n, ctx, why))) {
            lane_destroy(ln);
            goto err;
        }
        if (pthread_create(&ln->th, NULL, lane_main, ln)) {
            why_set(why, "lane %u: cannot start its thread", L.n);
            lane_destroy(ln);
            rc = KVX_ERR_IO;
            goto err;
        }
        ln->started = 1;
    }
    return 0;
err:
    lanes_stop();
    return rc;
}

void lanes_stop(void)
{
    /* rendezvous the loop never answered: released by their lanes while
     * their endpoints are still there (commands run in order) */
    list_t evs, *n;
    ev_take(&evs);
    while ((n = list_pop(&evs))) {
        lane_ev_t *pending = EV(n);
        if (pending->kind == LEV_ARRIVED && pending->desc &&
            pending->lane < L.n)
            lane_drop(pending->lane, pending->desc);
        ev_free(pending);
    }
    for (unsigned i = 0; i < L.n; i++) {
        L.v[i].stop_cmd.op = LC_STOP;
        post(i, &L.v[i].stop_cmd);
    }
    for (unsigned i = 0; i < L.n; i++)
        if (L.v[i].started)
            pthread_join(L.v[i].th, NULL);
    /* the threads are gone: their workers are this thread's now. What
     * still comes is dropped; a rendezvous the loop never answered is
     * released while its worker lives */
    L.ev = NULL;
    ev_take(&evs);
    while ((n = list_pop(&evs))) {
        lane_ev_t *e = EV(n);
        if (e->kind == LEV_ARRIVED && e->desc && e->lane < L.n)
            ucp_am_data_release(L.v[e->lane].w, e->desc);
        ev_free(e);
    }
    for (unsigned i = 0; i < L.n; i++)
        lane_destroy(&L.v[i]);
    L.n = 0;
    lanes_drain();
    if (L.async_on) {
        uv_close((uv_handle_t *)&L.async, NULL);
        L.async_on = 0;
    }
}
