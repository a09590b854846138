/*
 * fuzz_peer_auth — what another daemon sends to peer.c itself, from a
 * peer that holds the cluster secret: the handshake (HELLO, CHALLENGE,
 * RESPONSE, AUTH_RESULT and the UCX worker and lane addresses in them),
 * then BIND and control messages over UCX, in both roles (the daemon
 * dialling, and dialled). peer.c is the real one, with a real UCX context
 * and worker (peer_init()); the handshake sockets (hs.c) and the lanes
 * (lane.c) are replaced by the stubs below, so frames go straight to
 * peer.c's callbacks and what it sends is captured.
 *
 * A record is [kind][arg][len][len bytes]. Kinds: a socket accepted
 * (from inside or outside peer.allowed; with a HELLO already sent, read
 * at once), a dial, a raw frame on a
 * socket, the next step of an honest handshake on a socket (right MACs
 * under the secret, the fuzzer's bytes as addresses, address names and
 * nonces; or a real worker address with one byte changed), the socket
 * closed by the far side (a dial then dialled again, from the tick), a
 * BIND over UCX (right MAC, or raw bytes),
 * a control message from a bound endpoint, and time passing
 * (peer_tick()).
 *
 * What must hold: no crash, leak or assertion in peer.c or UCX; every
 * frame peer.c sends decodes; every worker address that reaches
 * ucp_ep_create() or a lane passed ucx_addr_check() (the check is
 * interposed in front of the real ucp_ep_create(), which then unpacks
 * it for real: ucx_connect_addr()'s copy, what ucx_addr_fit() kept).
 *
 * fuzz-exclude: daemon/net/hs.c daemon/net/lane.c
 */
#include "../../daemon/net/peer.c"
#include "../../daemon/net/peer_auth.c"

#include <dlfcn.h>

/* What UCX allocates for itself (its context and worker, made once) is
 * UCX's to free: only peer.c's own allocations count as leaks here. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void)
{
    return "leak:ucs_malloc\nleak:ucs_calloc\nleak:ucs_realloc\n"
           "leak:ucs_strdup\nleak:ucs_posix_memalign\n";
}

/* ---- ucp_ep_create(), interposed: only checked addresses pass --------- */

typedef ucs_status_t (*ep_create_fn)(ucp_worker_h, const ucp_ep_params_t *,
                                     ucp_ep_h *);

static void must_be_checked(const uint8_t *a, size_t len)
{
    char why[200];
    if (ucx_addr_check(a, len, NULL, KVX_WHY(why))) {
        fprintf(stderr, "an unchecked worker address reached UCX: %s\n", why);
        abort();
    }
}

ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params,
                           ucp_ep_h *ep_p)
{
    static ep_create_fn real;
    if (!real && !(real = (ep_create_fn)dlsym(RTLD_NEXT, "ucp_ep_create")))
        abort();
    if (params->field_mask & UCP_EP_PARAM_FIELD_REMOTE_ADDRESS) {
        /* ucx_connect_addr() hands UCX its own copy of what peer.c
         * took (ucx_addr_fit()'s, of its own length): one that is a
         * whole worker address for some length, the shortest read
         * first (a walk stops at the end of a well-formed one) */
        const uint8_t *a = (const uint8_t *)params->address;
        char why[200];
        size_t len = 2;
        while (len <= UCX_ADDR_MAX &&
               ucx_addr_check(a, len, NULL, KVX_WHY(why)))
            len++;
        must_be_checked(a, len);
    }
    return real(worker, params, ep_p);
}

/* ---- hs.c, stubbed: sockets that are records ----------------------------- */

#define SOCKS 16

struct hs {
    const hs_cbs_t *cbs;
    void *arg;
    int open, outgoing, inside;
    int connected;   /* a dial: a record of kind 4 may say it never was */
    size_t received; /* bytes the fuzzer's side sent on it */
    uint64_t conn_id;
    char name[32];
    /* what the daemon sent, and what the fuzzer's side chose */
    uint8_t nc[NONCE_LEN], ns[NONCE_LEN];
    int got_hello, got_challenge, got_response, got_result;
    int sent_hello, sent_challenge, sent_response, sent_result;
    uint64_t its_conn; /* the daemon's lane_conn, from its PeerUcx */
    char my_addr[192], its_addr[192];
    /* a HELLO that came with the connect, unread until hs_read_now() */
    uint8_t pend[512];
    size_t pend_len;
};

static hs_t socks[SOCKS];
static unsigned nsocks;
static void (*accept_cb)(hs_t *h);

int hs_listen(const struct sockaddr_storage *ss, void (*accept)(hs_t *h),
              struct sockaddr_storage *bound, kvx_why_t *why)
{
    (void)why;
    *bound = *ss;
    accept_cb = accept;
    return 0;
}
void hs_stop(void) {}

static hs_t *sock_new(int outgoing)
{
    hs_t *h = &socks[nsocks++ % SOCKS];
    memset(h, 0, sizeof(*h));
    h->open = 1;
    h->outgoing = outgoing;
    return h;
}

hs_t *hs_dial(const struct sockaddr_storage *ss, const hs_cbs_t *cbs, void *arg)
{
    (void)ss;
    hs_t *h = sock_new(1);
    h->connected = 1;
    h->cbs = cbs;
    h->arg = arg;
    h->conn_id = peer_conn_id(arg);
    snprintf(h->name, sizeof(h->name), "dialled");
    return h;
}

void hs_attach(hs_t *h, const hs_cbs_t *cbs, void *arg)
{
    h->cbs = cbs;
    h->arg = arg;
    h->conn_id = peer_conn_id(arg);
}

const char *hs_peer_name(const hs_t *h)
{
    return h->name;
}
int hs_connected(const hs_t *h)
{
    return h->connected;
}
void hs_read_now(hs_t *h)
{
    if (h->open && h->cbs && h->pend_len) {
        size_t n = h->pend_len;
        h->pend_len = 0;
        h->received += n + 4;
        h->cbs->frame(h->arg, h->pend, n);
    }
}

int hs_peer_addr(const hs_t *h, struct sockaddr_storage *ss)
{
    struct sockaddr_in *a = (struct sockaddr_in *)ss;
    memset(ss, 0, sizeof(*ss));
    a->sin_family = AF_INET;
    a->sin_port = htons(40000);
    a->sin_addr.s_addr = htonl(h->inside ? 0x0a000002 : 0xc0000202);
    return 0;
}

/* A frame the daemon sends: it must decode; the handshake's facts are
 * kept for the fuzzer's side. */
int hs_send(hs_t *h, const uint8_t *buf, size_t len)
{
    if (len > HS_FRAME_MAX)
        return KVX_ERR_INVALID;
    Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, len, buf);
    if (!m)
        abort(); /* the daemon sent what does not decode */
    switch (m->m_case) {
    case KVXFER__PEER_MSG__M_HELLO:
        if (m->hello->nonce.len == NONCE_LEN)
            memcpy(h->nc, m->hello->nonce.data, NONCE_LEN);
        h->got_hello = 1;
        break;
    case KVXFER__PEER_MSG__M_CHALLENGE:
        if (m->challenge->nonce.len == NONCE_LEN)
            memcpy(h->ns, m->challenge->nonce.data, NONCE_LEN);
        h->got_challenge = 1;
        break;
    case KVXFER__PEER_MSG__M_RESPONSE:
        if (m->response->ucx)
            h->its_conn = m->response->ucx->conn;
        h->got_response = 1;
        break;
    case KVXFER__PEER_MSG__M_AUTH_RESULT:
        if (m->auth_result->ucx)
            h->its_conn = m->auth_result->ucx->conn;
        h->got_result = 1;
        break;
    default:
        break;
    }
    kvxfer__peer_msg__free_unpacked(m, NULL);
    return 0;
}

void hs_close(hs_t *h)
{
    h->open = 0;
}

/* ---- lane.c, stubbed ---------------------------------------------------- */

int lanes_start(const lanes_conf_t *cf, kvx_why_t *why)
{
    (void)cf;
    (void)why;
    return 0;
}
unsigned lanes_count(void)
{
    return 2;
}
const uint8_t *lane_address(unsigned lane, size_t *len)
{
    (void)lane;
    *len = P.addr_len;
    return (const uint8_t *)P.addr;
}
void lanes_drain(void) {}
void lanes_stop(void) {}

static uint64_t next_lep = 1;

void lane_connect(unsigned lane, const uint8_t *addr, size_t len, uint64_t *lep)
{
    (void)lane;
    must_be_checked(addr, len);
    *lep = next_lep++;
}
void lane_send(unsigned lane, uint64_t lep, const lane_msg_t *m)
{
    (void)lane;
    (void)lep;
    (void)m;
    abort(); /* no slot data is sent here */
}
void lane_recv(unsigned lane, const lane_ev_t *arrived, uint64_t group,
               void *dst, const ucp_dt_iov_t *iov, size_t niov, void *cookie)
{
    (void)lane;
    (void)arrived;
    (void)group;
    (void)dst;
    (void)iov;
    (void)niov;
    (void)cookie;
    abort();
}
void lane_drop(unsigned lane, void *desc)
{
    (void)lane;
    (void)desc;
}
void lane_abort(unsigned lane, uint64_t group)
{
    (void)lane;
    (void)group;
}
void lane_close(unsigned lane, uint64_t lep)
{
    (void)lane;
    (void)lep;
}

/* ---- the layers above: nothing, or counted ------------------------------- */

static unsigned msgs_up;

static void on_any(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    (void)c;
    (void)m;
    msgs_up++;
}
static int on_lost(peer_conn_t *c, int code, const char *msg)
{
    (void)c;
    (void)code;
    (void)msg;
    return 0;
}
static void *no_target(peer_conn_t *c, const Kvxfer__PeerData *d, size_t len,
                       const peer_iov_t **iov, size_t *niov)
{
    (void)c;
    (void)d;
    (void)len;
    (void)iov;
    (void)niov;
    return NULL;
}
static void no_arrived(peer_conn_t *c, const Kvxfer__PeerData *d, int status)
{
    (void)c;
    (void)d;
    (void)status;
}

/* ---- the fuzzer's side --------------------------------------------------- */

/* a real worker address (another worker of the same context), which the
 * fuzzer's side tells as its own or changes one byte of */
static uint8_t *real_addr;
static size_t real_len;
/* its worker: progressed only between inputs (reset()), when it closes
 * the connections the daemon's endpoints made to it and then closed
 * (else each stays in CLOSE-WAIT, and a long run ends on "Too many open
 * files" after a few minutes) */
static ucp_worker_h real_w;

static void run_loop(void)
{
    for (int i = 0; i < 4; i++) {
        uv_run(kvxd.loop, UV_RUN_NOWAIT);
        ucp_worker_progress(P.worker);
    }
}

/* The UCX addresses of the fuzzer's side, in u (lanes: n of them): the
 * record's bytes, or (arg & 1) the real address with the byte at
 * b[0] << 8 | b[2] set to b[1] (arg & 128: and so on, for each 3 bytes
 * of b). */
static void ucx_of(Kvxfer__PeerUcx *u, ProtobufCBinaryData *lanes, uint8_t *buf,
                   const uint8_t *b, size_t n, uint8_t arg)
{
    if (arg & 1) {
        memcpy(buf, real_addr, real_len);
        /* each 3 bytes one change (arg & 128: all of them, else the
         * first) */
        for (size_t i = 0; i + 3 <= n && (i == 0 || (arg & 128)); i += 3)
            buf[((size_t)b[i] << 8 | b[i + 2]) % real_len] = b[i + 1];
        u->worker.data = buf;
        u->worker.len = real_len;
    } else {
        u->worker.data = (uint8_t *)b;
        u->worker.len = n;
    }
    u->conn = arg & 2 ? 0 : 0x4242;
    u->n_lanes = (arg >> 2) & 3; /* 0..3: LANES_MAX is 4 */
    for (size_t i = 0; i < u->n_lanes; i++)
        lanes[i] =
            (arg & 16) ? u->worker : (ProtobufCBinaryData){real_len, real_addr};
    u->lanes = lanes;
}

static void frame_to(hs_t *h, const Kvxfer__PeerMsg *m)
{
    size_t n = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *b = malloc(n ? n : 1);
    if (!b)
        abort();
    kvxfer__peer_msg__pack(m, b);
    h->received += n + 4;
    h->cbs->frame(h->arg, b, n);
    free(b);
}

/* The fuzzer's HELLO on h, packed into h->pend: its nonce the record's
 * bytes, its address those after (arg & 1); a wrong version (arg & 2),
 * MAC (32), server (64), or a time an hour old (128). */
static void hello_pack(hs_t *h, uint8_t arg, const uint8_t *b, size_t n)
{
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerHello hl = KVXFER__PEER_HELLO__INIT;
    uint8_t mac[MAC_LEN];
    for (size_t i = 0; i < NONCE_LEN; i++)
        h->nc[i] = i < n ? b[i] : (uint8_t)i;
    if ((arg & 1) && n > NONCE_LEN)
        snprintf(h->my_addr, sizeof(h->my_addr), "%.*s", (int)(n - NONCE_LEN),
                 b + NONCE_LEN);
    else
        snprintf(h->my_addr, sizeof(h->my_addr),
                 "kvx://10.0.0.2:7000/00000000000000b%u", arg >> 4);
    hl.version = arg & 2 ? arg : PEER_VERSION;
    hl.address = h->my_addr;
    hl.nonce.data = h->nc;
    hl.nonce.len = NONCE_LEN;
    hl.server = arg & 64 ? "10.0.0.9:7000" : "10.0.0.1:7000";
    hl.time = (uint64_t)time(NULL) - (arg & 128 ? 3600 : 0);
    hello_mac(0, h->nc, hl.server, h->my_addr, hl.time, mac);
    if (arg & 32)
        mac[0] ^= 1;
    hl.mac.data = mac;
    hl.mac.len = MAC_LEN;
    m.m_case = KVXFER__PEER_MSG__M_HELLO;
    m.hello = &hl;
    h->pend_len = kvxfer__peer_msg__get_packed_size(&m);
    if (h->pend_len > sizeof(h->pend))
        abort();
    kvxfer__peer_msg__pack(&m, h->pend);
}

/* The next step of the fuzzer's side of an honest handshake on h. */
static void honest_step(hs_t *h, uint8_t arg, const uint8_t *b, size_t n)
{
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    uint8_t mac[MAC_LEN], buf[UCX_ADDR_MAX];
    ProtobufCBinaryData lanes[LANES_MAX];
    Kvxfer__PeerUcx u = KVXFER__PEER_UCX__INIT;
    if (!h->outgoing && !h->sent_hello) { /* we dial the daemon */
        h->sent_hello = 1;
        hello_pack(h, arg, b, n);
        hs_read_now(h);
    } else if (!h->outgoing && h->got_challenge && !h->sent_response) {
        Kvxfer__PeerResponse r = KVXFER__PEER_RESPONSE__INIT;
        hmac("kvx-c", h->nc, h->ns, kvxd.address, h->my_addr, mac);
        if (arg & 32)
            mac[0] ^= 1;
        ucx_of(&u, lanes, buf, b, n, arg);
        r.mac.data = mac;
        r.mac.len = MAC_LEN;
        r.ucx = arg & 64 ? NULL : &u;
        m.m_case = KVXFER__PEER_MSG__M_RESPONSE;
        m.response = &r;
        h->sent_response = 1;
        frame_to(h, &m);
    } else if (h->outgoing && h->got_hello && !h->sent_challenge) {
        peer_conn_t *c = peer_conn_find(h->conn_id);
        if (!c)
            return;
        Kvxfer__PeerChallenge ch = KVXFER__PEER_CHALLENGE__INIT;
        for (size_t i = 0; i < NONCE_LEN; i++)
            h->ns[i] = i < n ? b[i] : (uint8_t)i;
        snprintf(h->its_addr, sizeof(h->its_addr), "%s", c->address);
        if ((arg & 1) && n > NONCE_LEN)
            snprintf(h->its_addr, sizeof(h->its_addr), "%.*s",
                     (int)(n - NONCE_LEN), b + NONCE_LEN);
        hmac("kvx-s", h->nc, h->ns, h->its_addr, kvxd.address, mac);
        if (arg & 32)
            mac[0] ^= 1;
        ch.address = h->its_addr;
        ch.nonce.data = h->ns;
        ch.nonce.len = NONCE_LEN;
        ch.mac.data = mac;
        ch.mac.len = MAC_LEN;
        m.m_case = KVXFER__PEER_MSG__M_CHALLENGE;
        m.challenge = &ch;
        h->sent_challenge = 1;
        frame_to(h, &m);
    } else if (h->outgoing && h->got_response && !h->sent_result) {
        Kvxfer__PeerAuthResult r = KVXFER__PEER_AUTH_RESULT__INIT;
        ucx_of(&u, lanes, buf, b, n, arg);
        r.code = arg & 32 ? KVX_ERR_AUTH : 0;
        r.message = "";
        r.ucx = arg & 64 ? NULL : &u;
        m.m_case = KVXFER__PEER_MSG__M_AUTH_RESULT;
        m.auth_result = &r;
        h->sent_result = 1;
        frame_to(h, &m);
    }
}

/* A control message over UCX from the fuzzer's endpoint of connection id
 * (its reply endpoint: a handle only compared, never used). */
static void am_from(uint64_t id, const uint8_t *b, size_t n)
{
    ucp_am_recv_param_t prm = {.recv_attr = UCP_AM_RECV_ATTR_FIELD_REPLY_EP,
                               .reply_ep =
                                   (ucp_ep_h)(uintptr_t)(0x1000 + 16 * id)};
    void *copy = malloc(n ? n : 1);
    if (!copy)
        abort();
    memcpy(copy, b, n);
    am_ctrl(NULL, NULL, 0, copy, n, &prm);
    free(copy);
}

/* The BIND the daemon's connection c takes from the fuzzer's side: its
 * lane_conn, under the key the other side derives. */
static void bind_to(peer_conn_t *c, uint8_t arg, const uint8_t *b, size_t n)
{
    if (arg & 1) {
        am_from(c->id, b, n);
        return;
    }
    uint8_t mac[MAC_LEN];
    bind_mac(c->rx_key, c->lane_conn, mac);
    if (arg & 2)
        mac[n ? b[0] % MAC_LEN : 0] ^= 1;
    Kvxfer__PeerBind bd = KVXFER__PEER_BIND__INIT;
    bd.conn = arg & 4 ? c->lane_conn + 1 : c->lane_conn;
    bd.mac.data = mac;
    bd.mac.len = MAC_LEN;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_BIND;
    m.bind = &bd;
    uint8_t buf[128];
    size_t len = kvxfer__peer_msg__get_packed_size(&m);
    kvxfer__peer_msg__pack(&m, buf);
    am_from(c->id, buf, len);
}

static peer_conn_t *nth_conn(uint8_t arg)
{
    unsigned n = 0;
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        n++;
    if (!n)
        return NULL;
    peer_conn_t *c = conn_next(NULL);
    for (unsigned i = arg % n; i; i--)
        c = conn_next(c);
    return c;
}

/* Every connection lost and given back to UCX, so that each input starts
 * from none. The time peer_tick() is told: the clock, and what the input
 * let pass. */
static uint64_t passed_ms;
#define clock_ms (kvxd_now_ms() + passed_ms)

static void reset(void)
{
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        if (c->state != CONN_LOST)
            conn_fail(c, KVX_ERR_SHUTDOWN, "input over");
    for (int i = 0; i < 100 && !list_empty(&P.conns); i++) {
        run_loop();
        peer_tick(clock_ms);
        for (peer_conn_t *c = conn_next(NULL), *nx; c; c = nx) {
            nx = conn_next(c);
            if (c->state == CONN_LOST && !c->lost_pending && c->closed &&
                !c->outstanding && c->close_done) {
                conn_unlink(c);
                conn_free(c);
            }
        }
    }
    for (int i = 0; i < 16 && ucp_worker_progress(real_w); i++)
        ;
    memset(socks, 0, sizeof(socks));
    nsocks = 0;
    passed_ms = 0;
    /* the HELLOs' nonces are the records' bytes: a new input starts with
     * none seen */
    A.seen_n = A.seen_next = 0;
    A.seen_floor = 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    conf_defaults(&kvxd.conf);
    kvxd.conf.log_level = 0;
    /* FUZZ_LOG=7: peer.c's log, to see what a crash input does */
    kvx__log_level = getenv("FUZZ_LOG") ? atoi(getenv("FUZZ_LOG")) : 0;
    kvxd.loop = uv_default_loop();
    if (kvxd_defer_init(kvxd.loop))
        abort();
    snprintf(kvxd.address, sizeof(kvxd.address),
             "kvx://10.0.0.1:7000/00000000000000aa");
    char dir[] = "/tmp/fuzz-peer-auth-XXXXXX";
    if (!mkdtemp(dir))
        abort();
    snprintf(kvxd.conf.peer_secret_file, sizeof(kvxd.conf.peer_secret_file),
             "%s/secret", dir);
    FILE *f = fopen(kvxd.conf.peer_secret_file, "w");
    if (!f || fputs("fuzz-peer-auth-cluster-secret-0001", f) < 0 || fclose(f))
        abort();
    chmod(kvxd.conf.peer_secret_file, 0600);
    snprintf(kvxd.conf.peer_listen, sizeof(kvxd.conf.peer_listen),
             "10.0.0.1:7000");
    snprintf(kvxd.conf.peer_allowed, sizeof(kvxd.conf.peer_allowed),
             "10.0.0.0/24");
    kvxd.conf.lanes = 0;
    /* UCX's TCP transport on loopback only: ucp_ep_create() meets the
     * fuzzer's interface addresses, the machine's interfaces nothing */
    setenv("UCX_NET_DEVICES", "lo", 0);
    char why[256];
    if (peer_init(KVX_WHY(why))) {
        fprintf(stderr, "peer_init: %s\n", why);
        abort();
    }
    unlink(kvxd.conf.peer_secret_file);
    rmdir(dir);
    /* the address the fuzzer's side tells: another worker's, kept (never
     * progressed: a connection to it is made, and nothing answers) */
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucp_worker_h w;
    ucp_address_t *a;
    if (ucp_worker_create(P.ctx, &wp, &w) != UCS_OK ||
        ucp_worker_get_address(w, &a, &real_len) != UCS_OK ||
        !(real_addr = malloc(real_len)))
        abort();
    memcpy(real_addr, a, real_len);
    ucp_worker_release_address(w, a);
    real_w = w;
    for (int k = 1; k < MSG_KINDS; k++)
        if (k != KVXFER__PEER_MSG__M_PING && k != KVXFER__PEER_MSG__M_PONG)
            peer_on_msg(k, on_any);
    peer_on_lost(on_lost);
    peer_data_ops_t ops = {.target = no_target, .arrived = no_arrived};
    peer_set_data_ops(&ops);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    while (size >= 3) {
        uint8_t kind = data[0], arg = data[1];
        size_t len = data[2] | (size_t)(kind & 0xf0) << 4;
        data += 3;
        size -= 3;
        if (len > size)
            len = size;
        const uint8_t *b = data;
        data += len;
        size -= len;
        hs_t *h =
            nsocks ? &socks[arg % (nsocks < SOCKS ? nsocks : SOCKS)] : NULL;
        peer_conn_t *c;
        switch (kind & 0x0f) {
        case 0: { /* a socket accepted */
            hs_t *n = sock_new(0);
            n->inside = !(arg & 1);
            snprintf(n->name, sizeof(n->name), "10.0.0.2:%u", 40000 + arg);
            if (arg & 2) { /* its HELLO already in the kernel */
                n->sent_hello = 1;
                hello_pack(n, (uint8_t)((arg & 0xe0) | (arg >> 2 & 3)), b, len);
            }
            accept_cb(n);
            break;
        }
        case 1: { /* a dial */
            char addr[64], why[256];
            snprintf(addr, sizeof(addr), "kvx://10.0.0.%u:7000/%016x",
                     (unsigned)(arg & 3) + 2, (unsigned)arg);
            peer_connect(addr, KVX_WHY(why));
            break;
        }
        case 2: /* raw bytes as a frame */
            if (h && h->open && h->cbs && peer_conn_find(h->conn_id)) {
                h->received += len + 4;
                h->cbs->frame(h->arg, b, len);
            }
            break;
        case 3: /* the honest handshake's next step */
            if (h && h->open && h->cbs && peer_conn_find(h->conn_id))
                honest_step(h, arg, b, len);
            break;
        case 4: /* the far side closed the socket */
            if (h && h->open && h->cbs && peer_conn_find(h->conn_id)) {
                h->open = 0;
                h->connected = !(arg & 1); /* else: a connect that failed */
                h->cbs->ended(h->arg, "fuzz closed the connection");
            }
            break;
        case 5: /* a BIND over UCX */
            if ((c = nth_conn(arg)))
                bind_to(c, arg >> 4, b, len);
            break;
        case 6: /* a control message from a bound endpoint */
            if ((c = nth_conn(arg)))
                am_from(c->id, b, len);
            break;
        case 7: /* time passes */
            passed_ms += (uint64_t)arg * 50;
            peer_tick(clock_ms);
            break;
        default:
            break;
        }
        run_loop();
    }
    reset();
    return 0;
}
