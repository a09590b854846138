/*
 * stub_net — the net layer (daemon/net/peer.c) replaced for unit tests of
 * the layers above it: no UCX, no loop. Connections are made on demand
 * per address; every control message sent is packed (it must pack) and
 * kept, decoded, in sent[]; what agree.c and remote.c register is kept,
 * and net_deliver() / net_lose() play a message or a loss to them as
 * peer.c would. With net_loopback set, what the daemon sends is queued
 * instead and net_pump() plays it back to the daemon itself, one message
 * at a time, as if the daemon at the other end were this one (it serves
 * its own offer): control messages to their handlers, slot data into the
 * place the data path names, with the sender's completion first. A test
 * names the file in its "unit-exclude:" line.
 */
#include "net/peer.h"

struct peer_conn {
    uint64_t id;
    char address[192];
    int alive;
};

#define NET_CONNS 16
#define NET_SENT 256
static struct peer_conn net_conns[NET_CONNS];
static int net_nconns;
static Kvxfer__PeerMsg *sent[NET_SENT]; /* decoded copies, in order */
static int nsent;
static const char *net_down; /* peer_connect() refuses this */
static int net_loopback;

/* loopback: what was sent and is not yet played back */
typedef struct wire {
    peer_conn_t *c;
    Kvxfer__PeerMsg *m; /* decoded copy */
    uint8_t *data;      /* DATA: a copy of the piece */
    size_t len;
    void (*done)(void *arg, int status);
    void *arg;
    struct wire *next;
} wire_t;
static wire_t *wire_head, **wire_tail = &wire_head;
static int wire_n;

static struct {
    peer_msg_cb msg[32];
    peer_lost_cb lost[4];
    unsigned nlost;
    peer_data_ops_t data;
} reg;

int peer_init(kvx_why_t *why)
{
    (void)why;
    return 0;
}
int peer_enabled(void)
{
    return 1;
}
void peer_tick(uint64_t now_ms)
{
    (void)now_ms;
}
void peer_cleanup(void) {}
void peer_shutdown(void) {}

peer_conn_t *peer_connect(const char *address, kvx_why_t *why)
{
    if (net_down && !strcmp(address, net_down)) {
        why_set(why, "daemon %s unreachable (stub)", address);
        return NULL;
    }
    for (int i = 0; i < net_nconns; i++)
        if (net_conns[i].alive && !strcmp(net_conns[i].address, address))
            return &net_conns[i];
    if (net_nconns == NET_CONNS)
        return NULL;
    peer_conn_t *c = &net_conns[net_nconns++];
    c->id = (uint64_t)net_nconns;
    c->alive = 1;
    snprintf(c->address, sizeof(c->address), "%s", address);
    return c;
}

const char *peer_conn_address(const peer_conn_t *c)
{
    return c->address;
}
uint64_t peer_conn_id(const peer_conn_t *c)
{
    return c->id;
}
int peer_conn_minor(const peer_conn_t *c)
{
    (void)c;
    return KVX_PROTOCOL_MINOR; /* the stub's peers are of this release */
}
peer_conn_t *peer_conn_find(uint64_t id)
{
    for (int i = 0; i < net_nconns; i++)
        if (net_conns[i].id == id)
            return &net_conns[i];
    return NULL;
}
int peer_conn_alive(const peer_conn_t *c)
{
    return c->alive;
}
static int net_rdma; /* peer_rdma() */
int peer_rdma(void)
{
    return net_rdma;
}
/* loopback: a piece on the wire (not played back yet) counts as queued
 * in peer.c, not yet handed to UCX */
int peer_send_queued(const peer_conn_t *c, const void *arg)
{
    for (const wire_t *w = wire_head; w; w = w->next)
        if (w->c == c && w->done && w->arg == arg)
            return 1;
    return 0;
}
/* whether slot data goes "over lanes": pieces may be sent from places */
static int net_lanes = 1;
int peer_conn_lanes(const peer_conn_t *c)
{
    return c->alive && net_lanes;
}
/* pieces sent so far, and of them from places */
static int net_sent_data, net_sent_iov;
/* net_hold_iov_done: a piece sent from places is delivered, but its
 * sender hears that UCX is done with the places only at
 * net_release_held() (as when the receiver's side of a rendezvous ends
 * before the sender's) */
static int net_hold_iov_done;
static struct {
    void (*done)(void *, int);
    void *arg;
} net_held[256];
static int net_nheld;
__attribute__((unused)) static void net_release_held(void)
{
    for (int i = 0; i < net_nheld; i++)
        net_held[i].done(net_held[i].arg, 0);
    net_nheld = 0;
}

int peer_address_check(const char *address, kvx_why_t *why)
{
    (void)address;
    (void)why;
    return 0;
}

int peer_address_alias(const char *address, kvx_why_t *why)
{
    (void)address;
    (void)why;
    return 0;
}

void peer_token(const char *instance, uint32_t owner_uid, const char *addr0,
                uint64_t request, uint8_t out[16])
{
    (void)owner_uid;
    (void)addr0;
    memset(out, 0, 16);
    memcpy(out, &request, sizeof(request));
    out[15] = (uint8_t)strlen(instance);
}

static void wire_push(peer_conn_t *c, const Kvxfer__PeerMsg *m, const void *buf,
                      size_t len, void (*done)(void *, int), void *arg);

int peer_send(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    if (!c->alive)
        return KVX_ERR_PEER_GONE;
    if (net_loopback && m->m_case != KVXFER__PEER_MSG__M_DATA)
        wire_push(c, m, NULL, 0, NULL, NULL);
    size_t n = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    kvxfer__peer_msg__pack(m, buf);
    Kvxfer__PeerMsg *copy = kvxfer__peer_msg__unpack(NULL, n, buf);
    free(buf);
    if (!copy)
        abort(); /* what the daemon sends must decode */
    if (nsent < NET_SENT)
        sent[nsent++] = copy;
    else
        kvxfer__peer_msg__free_unpacked(copy, NULL);
    return 0;
}

static void wire_push(peer_conn_t *c, const Kvxfer__PeerMsg *m, const void *buf,
                      size_t len, void (*done)(void *, int), void *arg)
{
    wire_t *w = calloc(1, sizeof(*w));
    size_t n = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *tmp = malloc(n ? n : 1);
    kvxfer__peer_msg__pack(m, tmp);
    w->m = kvxfer__peer_msg__unpack(NULL, n, tmp);
    free(tmp);
    w->c = c;
    if (len) {
        w->data = malloc(len);
        memcpy(w->data, buf, len);
    }
    w->len = len;
    w->done = done;
    w->arg = arg;
    *wire_tail = w;
    wire_tail = &w->next;
    wire_n++;
}

/* Play the oldest queued send back to the daemon. 0 when none was left. */
__attribute__((unused)) static int net_pump(void)
{
    wire_t *w = wire_head;
    if (!w)
        return 0;
    if (!(wire_head = w->next))
        wire_tail = &wire_head;
    wire_n--;
    if (w->done) /* the sender may reuse its buffer */
        w->done(w->arg, 0);
    if (w->m->m_case == KVXFER__PEER_MSG__M_DATA) {
        const peer_iov_t *iov = NULL;
        size_t niov = 0;
        void *dst = reg.data.target(w->c, w->m->data, w->len, &iov, &niov);
        const uint8_t *from = w->data;
        for (size_t i = 0; dst && i < niov; i++) { /* into the pool */
            memcpy(iov[i].buf, from, iov[i].len);
            from += iov[i].len;
        }
        if (dst && !niov)
            memcpy(dst, w->data, w->len);
        reg.data.arrived(w->c, w->m->data, 0);
    } else if ((unsigned)w->m->m_case < 32 && reg.msg[w->m->m_case]) {
        reg.msg[w->m->m_case](w->c, w->m);
    }
    kvxfer__peer_msg__free_unpacked(w->m, NULL);
    free(w->data);
    free(w);
    return 1;
}

int peer_send_data(peer_conn_t *c, const peer_piece_t *p)
{
    const Kvxfer__PeerMsg *hdr = p->hdr;
    const void *buf = p->buf;
    size_t len = p->len, niov = p->niov;
    const peer_iov_t *iov = p->iov;
    void (*done)(void *arg, int status) = p->done;
    void *arg = p->arg;
    int rc = peer_send(c, hdr);
    if (rc)
        return rc;
    uint8_t *tmp = NULL;
    if (niov) { /* read from its places now, as UCX would while sending */
        size_t at = 0;
        if (!(tmp = malloc(len ? len : 1)))
            abort();
        for (size_t i = 0; i < niov; i++) {
            if (at + iov[i].len > len)
                abort(); /* places beyond the piece: the caller is wrong */
            memcpy(tmp + at, iov[i].buf, iov[i].len);
            at += iov[i].len;
        }
        if (at != len)
            abort(); /* places short of the piece */
        buf = tmp;
        net_sent_iov++;
        if (net_hold_iov_done) {
            if (net_nheld == (int)(sizeof(net_held) / sizeof(net_held[0])))
                abort(); /* the test holds too many */
            net_held[net_nheld].done = done;
            net_held[net_nheld++].arg = arg;
            done = NULL;
        }
    }
    net_sent_data++;
    if (net_loopback)
        wire_push(c, hdr, buf, len, done, arg);
    else if (done)
        done(arg, 0);
    free(tmp);
    return 0;
}

void *peer_mem_map(void *addr, size_t len, int cuda)
{
    (void)addr;
    (void)len;
    (void)cuda;
    return (void *)1;
}
int peer_cuda(void)
{
    return 0;
}
void peer_mem_unmap(void *memh)
{
    (void)memh;
}
size_t peer_infos(Kvxfer__PeerInfo ***out)
{
    *out = NULL;
    return 0;
}
void peer_free_infos(Kvxfer__PeerInfo **v, size_t n)
{
    (void)v;
    (void)n;
}
void peer_ucx_info(Kvxfer__UcxInfo *info)
{
    (void)info;
}

void peer_on_msg(int m_case, peer_msg_cb cb)
{
    reg.msg[m_case] = cb;
}
void peer_on_lost(peer_lost_cb cb)
{
    reg.lost[reg.nlost++] = cb;
}
void peer_set_data_ops(const peer_data_ops_t *ops)
{
    reg.data = *ops;
}

/* A message from the daemon at address, to its registered handler. */
__attribute__((unused)) static void net_deliver(const char *address,
                                                const Kvxfer__PeerMsg *m)
{
    char why[64];
    peer_conn_t *c = peer_connect(address, KVX_WHY(why));
    if (c && (unsigned)m->m_case < 32 && reg.msg[m->m_case])
        reg.msg[m->m_case](c, m);
}

/* The connection to address (made now if there was none) is lost: its
 * queued sends fail first (as peer.c fails them), then every loss
 * callback runs, in order. */
__attribute__((unused)) static void net_lose(const char *address,
                                             const char *msg)
{
    char why[64];
    peer_conn_t *c = peer_connect(address, KVX_WHY(why));
    if (!c)
        return;
    c->alive = 0;
    for (wire_t **pp = &wire_head; *pp;) {
        wire_t *w = *pp;
        if (w->c != c) {
            pp = &w->next;
            continue;
        }
        *pp = w->next;
        wire_n--;
        if (w->done)
            w->done(w->arg, KVX_ERR_PEER_GONE);
        kvxfer__peer_msg__free_unpacked(w->m, NULL);
        free(w->data);
        free(w);
    }
    wire_tail = &wire_head;
    while (*wire_tail)
        wire_tail = &(*wire_tail)->next;
    char m[512]; /* worded as peer.c words it */
    snprintf(m, sizeof(m), "daemon %s: %s", c->address, msg);
    for (unsigned k = 0; k < reg.nlost; k++)
        reg.lost[k](c, KVX_ERR_PEER_GONE, m);
}

/* The n-th message sent of kind m_case (0: the first), or NULL. */
__attribute__((unused)) static const Kvxfer__PeerMsg *net_sent(int m_case,
                                                               int nth)
{
    for (int i = 0; i < nsent; i++)
        if ((int)sent[i]->m_case == m_case && nth-- == 0)
            return sent[i];
    return NULL;
}
