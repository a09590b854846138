/*
 * fuzz_peer — what another daemon sends, as remote.c and agree.c see it:
 * a run of PeerMsg records from the input goes to the handler remote.c
 * or agree.c registered for its kind (OPEN, PULL, END, OPENED, EVENT,
 * POLL, BATCH, RANKS), and DATA headers to
 * remote_data_target()/remote_on_data(), against a real context offer
 * (host pool, published) and a real generation fetch whose sources are
 * "on the peer". peer.c is replaced by the stubs below (no UCX): sends
 * are encoded (they must pack) and their completions run after the
 * record, as the loop would run them. A record's flag byte can put the
 * offer's real token, or a stream id the daemon handed out, into the
 * message, so the fuzzer gets past the token check and into the streams.
 * Some record kinds make the daemon talk to itself, mutated: 0x10 plays
 * its own last OPEN back to it (then it is the context daemon too), 0x11
 * answers its last PULL with DATA of the right size (or, flags & 64, as
 * pieces of the cut a sender would make, in either order), 0x12 answers its
 * OPEN with OPENED; with flags & 32 an OPEN carries pull_bytes, so the
 * daemon gathers ahead (peer.gather_ahead 2). Whatever arrives, the
 * daemon must not crash, leak or hang; the copy jobs it starts must come
 * back.
 *
 * fuzz-exclude: daemon/net/peer.c daemon/net/peer_auth.c
 * fuzz-exclude: daemon/net/peer_addr.c daemon/net/peer_handshake.c
 * fuzz-exclude: daemon/net/peer_init.c daemon/net/peer_status.c
 */
#include "../../daemon/remote/remote.c"

#include "agree/agree.h"
#include "xfer/xfer.h"

#include <sys/mman.h>

/* The key of request n (its digits), as the uint64_t API makes it. */
static const reqkey_t *K(uint64_t n)
{
    static reqkey_t k[8];
    static unsigned i;
    reqkey_t *r = &k[i++ & 7];
    reqkey_from_u64(r, n);
    return r;
}

/* ---- peer.c, stubbed ---------------------------------------------------- */

struct peer_conn {
    char address[192];
    int alive;
};
static struct peer_conn fake = {"kvx://10.0.0.2:7000/00000000000000bb", 1};

typedef struct pending {
    void (*done)(void *, int);
    void *arg;
} pending_t;
static pending_t sent[4096];
static size_t nsent;
static uint64_t last_open_stream, last_opened_source, last_pull_slot;
static uint8_t last_open[4096]; /* the daemon's own last OPEN, packed */
static size_t last_open_len;

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
    (void)address;
    (void)why;
    return &fake;
}
const char *peer_conn_address(const peer_conn_t *c)
{
    return c->address;
}
uint64_t peer_conn_id(const peer_conn_t *c)
{
    return c == &fake ? 1 : 2;
}
peer_conn_t *peer_conn_find(uint64_t id)
{
    return id == 1 ? &fake : NULL;
}
int peer_conn_alive(const peer_conn_t *c)
{
    return c->alive;
}
/* a peer of this release's protocol (renewals go to it) while alive */
int peer_conn_minor(const peer_conn_t *c)
{
    return c->alive ? KVX_PROTOCOL_MINOR : -1;
}
int peer_conn_lanes(const peer_conn_t *c)
{
    return c->alive;
}
int peer_address_check(const char *address, kvx_why_t *why)
{
    (void)why;
    return strncmp(address, "kvx://", 6) ? KVX_ERR_INVALID : 0;
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
    (void)instance;
    (void)addr0;
    memset(out, (int)request, 16);
}

static void must_pack(const Kvxfer__PeerMsg *m)
{
    size_t n = kvxfer__peer_msg__get_packed_size(m);
    uint8_t *b = malloc(n ? n : 1);
    if (!b)
        abort();
    kvxfer__peer_msg__pack(m, b);
    Kvxfer__PeerMsg *back = kvxfer__peer_msg__unpack(NULL, n, b);
    if (!back)
        abort();
    kvxfer__peer_msg__free_unpacked(back, NULL);
    free(b);
}

int peer_send(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    if (!c->alive)
        return KVX_ERR_PEER_GONE;
    must_pack(m);
    if (m->m_case == KVXFER__PEER_MSG__M_OPEN) {
        last_open_stream = m->open->stream;
        size_t n = kvxfer__peer_msg__get_packed_size(m);
        if (n <= sizeof(last_open)) {
            kvxfer__peer_msg__pack(m, last_open);
            last_open_len = n;
        }
    }
    if (m->m_case == KVXFER__PEER_MSG__M_OPENED)
        last_opened_source = m->opened->source;
    if (m->m_case == KVXFER__PEER_MSG__M_PULL)
        last_pull_slot = m->pull->slot;
    return 0;
}

int peer_send_data(peer_conn_t *c, const peer_piece_t *p)
{
    if (!c->alive || nsent == sizeof(sent) / sizeof(sent[0]))
        return KVX_ERR_PEER_GONE;
    must_pack(p->hdr);
    sent[nsent++] = (pending_t){p->done, p->arg};
    return 0;
}

/* the sends past peer.send_window still wait in peer.c's queue */
int peer_send_queued(const peer_conn_t *c, const void *arg)
{
    (void)c;
    for (size_t i = kvxd.conf.send_window; i < nsent; i++)
        if (sent[i].arg == arg)
            return 1;
    return 0;
}
int peer_rdma(void)
{
    return 0;
}

void *peer_mem_map(void *addr, size_t len, int cuda)
{
    (void)addr;
    (void)len;
    (void)cuda;
    return NULL;
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

/* What remote_init() and agree_init() register, dispatched as peer.c
 * would. */
static peer_msg_cb handlers[32];
void peer_on_msg(int m_case, peer_msg_cb cb)
{
    handlers[m_case] = cb;
}
void peer_on_lost(peer_lost_cb cb)
{
    (void)cb;
}
void peer_set_data_ops(const peer_data_ops_t *ops)
{
    (void)ops;
}

/* DATA of len bytes for d, as peer.c lands it: into its place in the
 * slot, or into the pool's places (peer.direct), which must add up to
 * len. NULL: dropped. */
static void *land(peer_conn_t *c, const Kvxfer__PeerData *d, size_t len,
                  int byte)
{
    const peer_iov_t *iov = NULL;
    size_t niov = 0, sum = 0;
    void *dst = remote_data_target(c, d, len, &iov, &niov);
    for (size_t i = 0; dst && i < niov; i++) {
        memset(iov[i].buf, byte, iov[i].len);
        sum += iov[i].len;
    }
    if (dst && niov && sum != len)
        abort(); /* places that do not hold the piece */
    if (dst && !niov)
        memset(dst, byte, len);
    return dst;
}

static void dispatch(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    if ((unsigned)m->m_case < 32 && handlers[m->m_case])
        handlers[m->m_case](c, m);
}

/* ---- the daemon state the messages meet --------------------------------- */

static instance_t *ctx, *gen;
static pool_t *cpool, *gpool;
static uint8_t token[TOKEN_LEN];

static pool_t *host_pool(uint64_t sid, const kvx_layout_t *l)
{
    uint64_t size = kvx_layout_span(l);
    int fd = memfd_create("fuzz", MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)size) ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK))
        abort();
    pool_t *p;
    char why[256];
    if (pool_register_host(sid, fd, 0, size, l, &p, KVX_WHY(why)))
        abort();
    return p;
}

/* Run the loop until every copy job is back (gathers, scatters). */
static void settle(void)
{
    for (int i = 0; i < 100000; i++) {
        while (nsent) { /* UCX would have completed these */
            pending_t s = sent[--nsent];
            s.done(s.arg, 0);
        }
        uv_run(kvxd.loop, UV_RUN_NOWAIT);
        if (!copy_inflight() && !nsent)
            return;
        usleep(10);
    }
    abort(); /* a job never came back */
}

static kvx_layout_t lay;

/* Offer 1 of "ctx" published, and fetch 1 of "gen" reading it "from the
 * peer", whenever the previous ones have ended. */
static void ensure_requests(void)
{
    char why[256];
    const uint64_t id1 = xfer_key_id(K(1)->b, K(1)->len); /* key "1" */
    if (!map_get(&ctx->offers, id1)) {
        uint32_t blocks[4] = {3, 1, 2, 0};
        uint8_t *params;
        size_t plen;
        if (xfer_publish(&(xfer_publish_req_t){ctx, 0, K(1), cpool, blocks, 4,
                                               13, NULL, 0, NULL, 0, 0},
                         &params, &plen, KVX_WHY(why)))
            abort();
        Kvxfer__ContextParams *cp =
            kvxfer__context_params__unpack(NULL, plen, params);
        memcpy(token, cp->token.data, TOKEN_LEN);
        kvxfer__context_params__free_unpacked(cp, NULL);
        free(params);
    }
    if (!map_get(&gen->fetches, id1)) {
        size_t plen;
        const uint8_t *params =
            xfer_offer_params(xfer_offer_find(ctx, id1), &plen);
        Kvxfer__ContextParams *cp =
            kvxfer__context_params__unpack(NULL, plen, params);
        char *addr = fake.address;
        char *orig = cp->rank_addresses[0];
        cp->rank_addresses[0] = addr;
        size_t n = kvxfer__context_params__get_packed_size(cp);
        uint8_t *p = malloc(n);
        kvxfer__context_params__pack(cp, p);
        cp->rank_addresses[0] = orig;
        kvxfer__context_params__free_unpacked(cp, NULL);
        uint32_t gblocks[4] = {0, 2, 1, 3};
        /* refused while the offer's old consumer is ending: next time */
        xfer_fetch(&(xfer_fetch_req_t){gen, 0, K(1), p, n, gpool, gblocks, 4, 0,
                                       0, NULL, 0},
                   KVX_WHY(why));
        free(p);
    }
}

/* Events nobody polls for: sealed and dropped, so they do not pile up. */
static void drain_batches(void)
{
    uint64_t now = kvxd_now_ms();
    batch_poll(&ctx->batches, 0, 1, 0, now, now);
    batch_poll(&gen->batches, 0, 1, 0, now, now);
    batch_tick(&ctx->batches, now);
    batch_tick(&gen->batches, now);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    conf_defaults(&kvxd.conf);
    kvxd.conf.slot_bytes = 64 * 1024;
    kvxd.conf.slots = 4;
    kvxd.conf.message_bytes = 16 * 1024; /* a slot goes as several pieces */
    kvxd.conf.gather_ahead = 2;          /* OPENs carry pull_bytes: ahead_take()
                                          * and ahead_fill() meet random PULLs */
    kvxd.conf.log_level = 0;
    kvxd.conf.direct = 1; /* pieces into the pool too, whatever the CPUs */
    kvx__log_level = 0;
    kvxd.loop = uv_default_loop();
    snprintf(kvxd.address, sizeof(kvxd.address),
             "kvx://10.0.0.1:7000/00000000000000aa");
    if (copy_init(kvxd.loop, 1, 0, 0, 0))
        abort();
    char why[256];
    if (remote_init(KVX_WHY(why)) || agree_init())
        abort();
    plan_side_t side = {
        .tp = 1, .pp = 1, .cp = 1, .total_layers = 2, .total_heads = 2};
    char *a0 = kvxd.address;
    if (instance_attach(
            &(instance_hello_t){"ctx", 0, KVX_ROLE_CONTEXT, 0, &side, 1}, &ctx,
            KVX_WHY(why)) ||
        instance_join(ctx, 0, &a0, 1, KVX_WHY(why)) ||
        instance_attach(
            &(instance_hello_t){"gen", 0, KVX_ROLE_GENERATION, 0, &side, 2},
            &gen, KVX_WHY(why)) ||
        instance_join(gen, 0, &a0, 1, KVX_WHY(why)))
        abort();
    kvx_layout_preset("vllm-nhd", 2, 2, 2, 64, KVX_DTYPE_BF16, 4, 16, &lay);
    cpool = host_pool(1, &lay);
    gpool = host_pool(2, &lay);
    settle(); /* the pools' populate jobs */
    ensure_requests();
    settle();
    return 0;
}

/* ---- the input: records of [kind][flags][len][PeerMsg bytes] ----------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ensure_requests();
    while (size >= 3) {
        uint8_t kind = data[0], flags = data[1];
        size_t len = data[2];
        data += 3;
        size -= 3;
        if (len > size)
            len = size;
        Kvxfer__PeerMsg *m = kvxfer__peer_msg__unpack(NULL, len, data);
        data += len;
        size -= len;
        if (kind == 0x10 && last_open_len) { /* our OPEN, to us */
            Kvxfer__PeerMsg *o =
                kvxfer__peer_msg__unpack(NULL, last_open_len, last_open);
            if (o && m && m->m_case == KVXFER__PEER_MSG__M_OPEN) {
                if (flags & 1)
                    o->open->dst_rank = m->open->dst_rank;
                if (flags & 2)
                    o->open->skip_tokens = m->open->skip_tokens;
                if (flags & 4)
                    o->open->slice = m->open->slice;
                if (flags & 8)
                    o->open->nunits = m->open->nunits;
            }
            if (o)
                dispatch(&fake, o);
            kvxfer__peer_msg__free_unpacked(o, NULL);
            if (m)
                kvxfer__peer_msg__free_unpacked(m, NULL);
            settle();
            continue;
        }
        if (kind == 0x12) { /* OPENED for our OPEN */
            Kvxfer__PeerMsg r = KVXFER__PEER_MSG__INIT;
            Kvxfer__PeerOpened op = KVXFER__PEER_OPENED__INIT;
            op.stream = last_open_stream;
            op.source = m && m->m_case == KVXFER__PEER_MSG__M_OPENED
                            ? m->opened->source
                            : last_opened_source;
            r.m_case = KVXFER__PEER_MSG__M_OPENED;
            r.opened = &op;
            dispatch(&fake, &r);
            if (m)
                kvxfer__peer_msg__free_unpacked(m, NULL);
            settle();
            continue;
        }
        if (kind == 0x11 && last_pull_slot < kvxd.conf.slots) {
            /* DATA for our last PULL, of the size it asked for */
            slot_t *x = &rslots.v[last_pull_slot];
            Kvxfer__PeerData d = KVXFER__PEER_DATA__INIT;
            d.stream = last_open_stream;
            d.slot = (uint32_t)last_pull_slot;
            d.unit_begin = x->u0;
            d.unit_end = x->u1;
            d.bytes = x->bytes;
            rstream_t *r = map_get(&rstreams, last_open_stream);
            if ((flags & 64) && r && r->part && x->u1 > x->u0) {
                /* as pieces, cut as a sender would (or not, flags & 32),
                 * in order or backwards; flags & 16 fails the second */
                piece_t pc[MAX_PIECES];
                d.piece_bytes = 1 + (uint64_t)flags * 613 % 40000;
                uint32_t np =
                    plan_cut_pieces(xfer_part_plan(r->part), x->u0, x->u1,
                                    d.piece_bytes, pc, MAX_PIECES);
                for (uint32_t i = 0; i < np; i++) {
                    uint32_t k = flags & 128 ? np - 1 - i : i;
                    d.offset = pc[k].off + (flags & 32 ? 1 : 0);
                    void *dst = land(&fake, &d, pc[k].len, flags);
                    if (dst) {
                        remote_on_data(&fake, &d,
                                       (flags & 16) && i == 1 ? KVX_ERR_IO : 0);
                    }
                }
            } else {
                size_t dlen = flags & 32 ? (size_t)flags : (size_t)x->bytes;
                void *dst = land(&fake, &d, dlen, flags);
                if (dst) {
                    remote_on_data(&fake, &d, flags & 16 ? KVX_ERR_IO : 0);
                }
            }
            if (m)
                kvxfer__peer_msg__free_unpacked(m, NULL);
            settle();
            continue;
        }
        if (!m)
            continue;
        /* steer: the real token, the ids the daemon handed out */
        if (m->m_case == KVXFER__PEER_MSG__M_OPEN && (flags & 1) &&
            m->open->token.len == TOKEN_LEN)
            memcpy(m->open->token.data, token, TOKEN_LEN);
        if (m->m_case == KVXFER__PEER_MSG__M_OPEN && (flags & 2)) {
            if (m->open->instance_id != protobuf_c_empty_string)
                free(m->open->instance_id); /* unpacked strings own memory */
            m->open->instance_id = strdup("ctx");
            m->open->request_id = xfer_key_id((const uint8_t *)"1", 1);
            if (m->open->key.len != 1 || m->open->key.data[0] != '1') {
                free(m->open->key.data); /* unpacked bytes own memory */
                m->open->key.data = (uint8_t *)strdup("1");
                m->open->key.len = 1;
            }
            if (flags & 32) /* a receiver that lets us gather ahead */
                m->open->pull_bytes = kvxd.conf.slot_bytes;
        }
        if (m->m_case == KVXFER__PEER_MSG__M_PULL && (flags & 4))
            m->pull->stream = last_opened_source;
        if (m->m_case == KVXFER__PEER_MSG__M_OPENED && (flags & 4))
            m->opened->stream = last_open_stream;
        if (m->m_case == KVXFER__PEER_MSG__M_END && (flags & 4))
            m->end->stream = flags & 8 ? last_open_stream : last_opened_source;
        if (m->m_case == KVXFER__PEER_MSG__M_DATA) {
            if (flags & 4)
                m->data->stream = last_open_stream;
            if (flags & 8)
                m->data->slot = (uint32_t)last_pull_slot;
            size_t dlen = kind & 1 ? (size_t)m->data->bytes : kind;
            void *dst = land(&fake, m->data, dlen, kind);
            if (dst) {
                remote_on_data(&fake, m->data, flags & 16 ? KVX_ERR_IO : 0);
            }
        } else {
            dispatch(&fake, m);
        }
        kvxfer__peer_msg__free_unpacked(m, NULL);
        if (kind == 0xff) { /* the connection is lost, then back */
            fake.alive = 0;
            remote_on_conn_lost(&fake, KVX_ERR_PEER_GONE, "fuzz");
            fake.alive = 1;
        }
        settle();
    }
    drain_batches();
    return 0;
}
