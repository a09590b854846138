/*
 * test_remote — transfers between daemons with the net layer stubbed
 * (stub_net.c, loopback): this daemon both fetches a request "from the
 * daemon at OTHER" and serves that fetch from its own offer, every
 * message and slot piece played back one at a time. A whole transfer
 * moves the right bytes and ends COMPLETE on both sides; then the
 * connection is lost after each message of the transfer in turn (every
 * state a slot and a stream can be in), and each time the fetch ends
 * (PEER_GONE, or COMPLETE when it was already done), the offer ends too
 * (or, when the OPEN never reached it, holds nothing and ends at its
 * lease), every slot is free again and no copy job is left.
 *
 * unit-exclude: daemon/net/peer.c daemon/net/peer_auth.c
 * unit-exclude: daemon/net/peer_addr.c daemon/net/peer_handshake.c
 * unit-exclude: daemon/net/peer_init.c daemon/net/peer_status.c
 */
#include "../../daemon/remote/remote.c"
#include "../../daemon/remote/source.c"

#include <sys/mman.h>

#include "tests/test.h"
#include "xfer/xfer.h"

#include "stub_net.c"

/* The key of request n (its digits), as the uint64_t API makes it. */
static const reqkey_t *K(uint64_t n)
{
    static reqkey_t k[8];
    static unsigned i;
    reqkey_t *r = &k[i++ & 7];
    reqkey_from_u64(r, n);
    return r;
}

#define ME "kvx://10.0.0.1:7000/00000000000000aa"
#define OTHER "kvx://10.0.0.2:7000/00000000000000bb"

static instance_t *ctx, *gen;
static pool_t *cpool, *gpool;
static kvx_layout_t lay;
static const uint32_t cblocks[4] = {3, 1, 2, 0}, gblocks[4] = {0, 2, 1, 3};
#define NTOK 13

/* The generation side's pool is made of regions, a K and a V one per
 * layer (sglang-style), in one memfd in reverse order with gaps: the
 * packed scatter must resolve (region, offset) for every part. */
static kvx_layout_t glay;
static kvx_layout_part_t gparts[4];

static pool_t *host_pool(uint64_t sid)
{
    uint64_t size = kvx_layout_span(&lay);
    int fd = memfd_create("test", MFD_ALLOW_SEALING);
    CHECK(fd >= 0 && !ftruncate(fd, (off_t)size) &&
          !fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK));
    pool_t *p;
    char why[256];
    CHECK_EQ(pool_register_host(sid, fd, 0, size, &lay, &p, KVX_WHY(why)), 0);
    return p;
}

static pool_t *regions_pool(uint64_t sid)
{
    glay = lay;
    CHECK_EQ(kvx_layout_split(&glay, 2, gparts, 4), 0);
    uint32_t n = kvx_layout_num_regions(&glay);
    CHECK_EQ(n, 4);
    pool_region_req_t r[4];
    uint64_t at = 0;
    for (uint32_t i = n; i-- > 0;) {
        r[i] = (pool_region_req_t){0, at, kvx_layout_region_span(&glay, i)};
        at += r[i].size + 100;
    }
    int fd = memfd_create("test", MFD_ALLOW_SEALING);
    CHECK(fd >= 0 && !ftruncate(fd, (off_t)at) &&
          !fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK));
    pool_alloc_req_t a = {.fd = fd};
    pool_t *p;
    char why[256];
    CHECK_EQ(
        pool_register(&(pool_reg_t){sid, &a, 1, r, n, &glay}, &p, KVX_WHY(why)),
        0);
    CHECK_EQ(p->nregions, 4);
    CHECK(p->layout.parts != gparts); /* the pool's own copy */
    return p;
}

/* Run the loop until no copy job is out. */
static void settle(void)
{
    for (int i = 0; i < 100000; i++) {
        uv_run(kvxd.loop, UV_RUN_NOWAIT);
        if (!copy_inflight())
            return;
        usleep(10);
    }
    CHECK(!"a copy job never came back");
}

/* Pump one message and let the copies it starts finish. */
static int step(void)
{
    int n = net_pump();
    settle();
    return n;
}

static void setup(void)
{
    conf_defaults(&kvxd.conf);
    kvx__log_level = 4;                 /* warnings and worse */
    kvxd.conf.slot_bytes = 64 << 10;    /* a request takes several slots */
    kvxd.conf.message_bytes = 16 << 10; /* and a slot several pieces */
    kvxd.conf.slots = 4;
    kvxd.conf.direct = 1; /* whatever the CPUs: pieces into the pool */
    kvxd.loop = uv_default_loop();
    snprintf(kvxd.address, sizeof(kvxd.address), "%s", ME);
    net_loopback = 1;
    char why[256];
    CHECK_EQ(kvxd_defer_init(kvxd.loop), 0);
    CHECK_EQ(copy_init(kvxd.loop, 2, 0, 0, 0), 0);
    CHECK_EQ(remote_init(KVX_WHY(why)), 0);
    plan_side_t side = {
        .tp = 1, .pp = 1, .cp = 1, .total_layers = 2, .total_heads = 2};
    char *a0 = kvxd.address;
    CHECK_EQ(instance_attach(
                 &(instance_hello_t){"ctx", 0, KVX_ROLE_CONTEXT, 0, &side, 1},
                 &ctx, KVX_WHY(why)),
             0);
    CHECK_EQ(instance_join(ctx, 0, &a0, 1, KVX_WHY(why)), 0);
    CHECK_EQ(instance_attach(&(instance_hello_t){"gen", 0, KVX_ROLE_GENERATION,
                                                 0, &side, 2},
                             &gen, KVX_WHY(why)),
             0);
    CHECK_EQ(instance_join(gen, 0, &a0, 1, KVX_WHY(why)), 0);
    CHECK_EQ(kvx_layout_preset("vllm-nhd", 2, 2, 2, 1024, KVX_DTYPE_BF16, 4, 16,
                               &lay),
             0);
    cpool = host_pool(1);
    gpool = regions_pool(2);
    settle(); /* the pools' populate jobs */
    /* the source: a pattern in the context pool */
    for (uint64_t i = 0; i < kvx_layout_span(&lay); i++)
        cpool->view[0].base[i] = (uint8_t)(i * 7 + 1);
    for (uint32_t r = 0; r < gpool->nregions; r++)
        memset(gpool->view[r].base, 0, gpool->view[r].size);
}

/* Publish request 1 of ctx and fetch it into gen "from OTHER" (the
 * params name OTHER as the daemon of context rank 0). */
static void start_transfer(void)
{
    char why[256];
    uint8_t *params;
    size_t plen;
    CHECK_EQ(xfer_publish(&(xfer_publish_req_t){ctx, 0, K(1), cpool, cblocks, 4,
                                                NTOK, NULL, 0, NULL, 0, 0, 0},
                          &params, &plen, KVX_WHY(why)),
             0);
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, plen, params);
    char *orig = cp->rank_addresses[0];
    cp->rank_addresses[0] = OTHER;
    size_t n = kvxfer__context_params__get_packed_size(cp);
    uint8_t *p = malloc(n);
    kvxfer__context_params__pack(cp, p);
    cp->rank_addresses[0] = orig;
    kvxfer__context_params__free_unpacked(cp, NULL);
    free(params);
    CHECK_EQ(xfer_fetch(&(xfer_fetch_req_t){gen, 0, K(1), p, n, gpool, gblocks,
                                            4, 0, 0, NULL, 0},
                        KVX_WHY(why)),
             0);
    free(p);
    settle();
}

/* The one terminal event queued for request 1 in inst (kind, code). */
static const batch_event_t *ended(instance_t *inst)
{
    for (uint32_t i = 0; i < inst->batches.npending; i++)
        if (reqkey_eq(&inst->batches.pending[i].key, K(1)))
            return &inst->batches.pending[i];
    return NULL;
}

/* Every byte of the fetched tokens, where each side's table puts them. */
static void check_bytes(void)
{
    uint32_t row = lay.head_dim * lay.elem_size;
    for (uint32_t t = 0; t < NTOK; t++)
        for (uint32_t l = 0; l < lay.num_layers; l++)
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < lay.num_heads; h++) {
                    uint32_t tpb = lay.tokens_per_block;
                    uint64_t so = kvx_layout_offset(
                        &lay, l, kv, cblocks[t / tpb], t % tpb, h);
                    uint64_t go = kvx_layout_offset(
                        &glay, l, kv, gblocks[t / tpb], t % tpb, h);
                    const uint8_t *g =
                        gpool->view[kvx_layout_region(&glay, l, kv)].base;
                    CHECK(!memcmp(cpool->view[0].base + so, g + go, row));
                }
}

static void check_quiet(void)
{
    CHECK_EQ(copy_inflight(), 0);
    CHECK_EQ(rslots.nfree, remote_slots());
    CHECK_EQ(sslots.nfree, remote_slots());
    CHECK_EQ(rstreams.n, 0);
    CHECK_EQ(sstreams.n, 0);
}

TEST(whole_transfer_through_the_loopback)
{
    setup();
    start_transfer();
    const Kvxfer__PeerMsg *open = net_sent(KVXFER__PEER_MSG__M_OPEN, 0);
    CHECK(open);
    CHECK_STR_CONTAINS(open->open->instance_id, "ctx");
    CHECK_EQ(open->open->request_id, xfer_key_id((const uint8_t *)"1", 1));
    CHECK_EQ(open->open->key.len, 1);
    int msgs = 0;
    while (step())
        msgs++;
    CHECK(net_sent(KVXFER__PEER_MSG__M_PULL, 2)); /* several slots */
    CHECK(net_sent(KVXFER__PEER_MSG__M_DATA, 4)); /* of several pieces */
    const batch_event_t *g = ended(gen), *c = ended(ctx);
    CHECK(g && c);
    CHECK_EQ(g->kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(c->kind, KVX_EVENT_COMPLETE);
    check_bytes();
    check_quiet();
    /* the regions pool's runs are long: every piece went straight in;
     * the context pool's too: every piece was sent from its places */
    CHECK(st_rx.direct > 0);
    CHECK_EQ(st_tx.direct, st_rx.direct);
    CHECK_EQ(net_sent_iov, (int)st_tx.direct);
    CHECK_EQ(net_sent_iov, net_sent_data); /* every piece */
    printf("a transfer takes %d messages here, %llu pieces sent from and "
           "received into the pools\n",
           msgs, (unsigned long long)st_rx.direct);
}

/* A generation daemon that says END{0} while pieces sent from the
 * context pool are still queued to go (not handed to UCX: they cannot
 * have arrived) is wrong: the offer ends with ERROR, PROTOCOL, not
 * COMPLETE, once those sends are back. Before, only pieces being copied
 * counted, and this offer completed. */
TEST(early_end_while_sends_from_places_queued)
{
    setup();
    start_transfer();
    /* play the transfer until a piece from places waits on the wire
     * with no copy left (settle() after each step) */
    sstream_t *s = NULL;
    int queued = 0;
    for (int i = 0; i < 1000 && !queued && step(); i++) {
        for (const wire_t *w = wire_head; w && !queued; w = w->next)
            queued = w->done == on_sent_direct;
    }
    CHECK(queued);
    CHECK_EQ(sstreams.n, 1);
    for (uint32_t i = 0; i < sstreams.nb && !s; i++)
        if (sstreams.b[i])
            s = sstreams.b[i]->val;
    CHECK(s != NULL);
    peer_conn_t *c = peer_conn_find(s->conn);
    CHECK(c != NULL);
    for (uint32_t i = 0; i < remote_slots(); i++) /* no piece in a copy */
        CHECK(sslots.v[i].owner != s || sslots.v[i].state == SLOT_FREE ||
              sslots.v[i].pending <=
                  (uint32_t)__builtin_popcountll(sslots.v[i].direct));
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerStreamEnd e = KVXFER__PEER_STREAM_END__INIT;
    e.stream = s->id;
    e.code = 0;
    m.m_case = KVXFER__PEER_MSG__M_END;
    m.end = &e;
    net_deliver(peer_conn_address(c), &m);
    while (step())
        ;
    const batch_event_t *o = ended(ctx);
    CHECK(o != NULL);
    CHECK_EQ(o->kind, KVX_EVENT_ERROR);
    CHECK_EQ(o->code, KVX_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(o->message, "before all of it was sent");
    CHECK_EQ(sslots.nfree, remote_slots());
}

/* The fence of pieces sent from the context pool: the generation side
 * has every byte and ENDs the stream while UCX has not yet given the
 * sends back (held here). The END is not early (no piece is being
 * copied), the generation request completes, and the offer does not
 * end before the sends are back: then it completes, and every slot and
 * place goes. */
TEST(offer_held_until_ucx_gives_the_sends_back)
{
    setup();
    net_hold_iov_done = 1;
    start_transfer();
    while (step())
        ;
    const batch_event_t *g = ended(gen);
    CHECK(g != NULL);
    CHECK_EQ(g->kind, KVX_EVENT_COMPLETE);
    check_bytes();
    CHECK(net_nheld > 0);
    CHECK(ended(ctx) == NULL); /* UCX may still read the context pool */
    CHECK(sslots.nfree < remote_slots());
    net_release_held();
    while (step())
        ;
    const batch_event_t *c = ended(ctx);
    CHECK(c != NULL);
    CHECK_EQ(c->kind, KVX_EVENT_COMPLETE);
    check_quiet();
}

/* No lanes to the receiver: pieces are gathered into the send slot (a
 * send from places goes only where the lanes' stall check bounds the
 * fence), and still received into the pool; the same bytes. */
TEST(whole_transfer_gathered_without_lanes)
{
    setup();
    net_lanes = 0;
    start_transfer();
    while (step())
        ;
    const batch_event_t *g = ended(gen), *c = ended(ctx);
    CHECK(g && c);
    CHECK_EQ(g->kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(c->kind, KVX_EVENT_COMPLETE);
    check_bytes();
    check_quiet();
    CHECK_EQ(st_tx.direct, 0);
    CHECK_EQ(net_sent_iov, 0);
    CHECK(st_rx.direct > 0);
}

/* peer.direct 0: every piece lands in the slot and is scattered, to the
 * same bytes. */
TEST(whole_transfer_scattered_from_slots)
{
    setup();
    direct_on = 0; /* peer.direct 0, as remote_init() resolves it */
    start_transfer();
    while (step())
        ;
    const batch_event_t *g = ended(gen), *c = ended(ctx);
    CHECK(g && c);
    CHECK_EQ(g->kind, KVX_EVENT_COMPLETE);
    check_bytes();
    check_quiet();
    CHECK_EQ(st_rx.direct, 0);
    CHECK_EQ(st_tx.direct, 0);
    CHECK_EQ(net_sent_iov, 0);
    CHECK(st_rx.slots > 0);
}

/* Lose the link after k messages, for every k the transfer has. */
TEST_T(loss_in_every_state_ends_both_sides_and_frees_every_slot, 120)
{
    /* how many messages a whole transfer takes, in a child */
    int total = 0;
    int fds[2];
    CHECK(!pipe(fds));
    pid_t pid = fork();
    if (pid == 0) {
        setup();
        start_transfer();
        int n = 0;
        while (step())
            n++;
        (void)!write(fds[1], &n, sizeof(n));
        _exit(0);
    }
    CHECK(read(fds[0], &total, sizeof(total)) == sizeof(total));
    waitpid(pid, NULL, 0);
    CHECK(total > 12);
    for (int k = 0; k <= total; k++) {
        pid = fork();
        if (pid == 0) {
            setup();
            start_transfer();
            for (int i = 0; i < k; i++)
                step();
            net_lose(OTHER, "link down");
            settle();
            while (step()) /* what is left: dropped, nothing crashes */
                ;
            const batch_event_t *g = ended(gen), *c = ended(ctx);
            offer_t *o = xfer_offer_find(ctx, xfer_key_id(K(1)->b, K(1)->len));
            /* (settle() waited for every copy: no gather holds it) */
            if (!c && o && list_empty(&RO(o)->streams) &&
                !xfer_offer_taken_here(o)) {
                /* the OPEN never reached the context side: its offer
                 * waits for another consumer until its lease ends */
                xfer_tick(kvxd_now_ms() + kvxd.conf.offer_lease_ms + 1);
                settle();
                c = ended(ctx);
                CHECK(c && c->kind == KVX_EVENT_TIMED_OUT);
            }
            if (!g || !c) {
                fprintf(stderr,
                        "after %d of %d messages: fetch %s, offer "
                        "%s\n",
                        k, total, g ? "ended" : "still running",
                        c ? "ended" : "still running");
                _exit(1);
            }
            CHECK(g->kind == KVX_EVENT_COMPLETE ||
                  (g->kind == KVX_EVENT_ERROR && g->code == KVX_ERR_PEER_GONE));
            if (g->kind == KVX_EVENT_COMPLETE)
                check_bytes();
            check_quiet();
            _exit(0);
        }
        int st;
        waitpid(pid, &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "loss after %d of %d messages failed\n", k, total);
            CHECK(0);
        }
    }
    printf("the link lost after each of %d messages\n", total);
}

/* Slots in a GPU's memory are named on the wire (PULL's slot, DATA's) as
 * (device + 1) * 65536 + i, beside the host slots 0..n-1: a name finds
 * its slot, a name of no slot (a device without a set, an index past a
 * set, the gaps between) finds none, and every slot is walked once,
 * host first. The GPU set here is made by hand in host memory (no GPU
 * on this machine): only the naming and the walk are under test. */
TEST(gpu_slot_names_find_their_slots_and_nothing_else)
{
    setup();
    slots_t *h = &rslots;
    uint32_t n = h->n;
    CHECK(n >= 2);
    slots_t g = {.device = 1, .base = 2 * SLOT_GPU_BASE, .n = 3};
    slot_t v[3];
    memset(v, 0, sizeof(v));
    list_init(&g.free);
    for (uint32_t i = 0; i < 3; i++) {
        v[i].idx = g.base + i;
        v[i].set = &g;
        list_push(&g.free, &v[i].free_node);
    }
    g.v = v;
    g.nfree = 3;
    h->gpu[1] = &g;
    CHECK(slot_at(h, 0) == &h->v[0]);
    CHECK(slot_at(h, n - 1) == &h->v[n - 1]);
    CHECK(slot_at(h, n) == NULL);
    CHECK(slot_at(h, 2 * SLOT_GPU_BASE) == &v[0]);
    CHECK(slot_at(h, 2 * SLOT_GPU_BASE + 2) == &v[2]);
    CHECK(slot_at(h, 2 * SLOT_GPU_BASE + 3) == NULL);
    CHECK(slot_at(h, SLOT_GPU_BASE) == NULL);     /* device 0: none */
    CHECK(slot_at(h, 3 * SLOT_GPU_BASE) == NULL); /* device 2: none */
    CHECK(slot_at(h, UINT32_MAX) == NULL);
    CHECK(slots_for(h, 1) == &g);
    CHECK(slots_for(h, 0) == h);
    CHECK(slots_for(h, -1) == h);
    CHECK(slots_for(h, SLOT_DEVS) == h);
    uint32_t seen = 0;
    for (slot_t *x = slot_next(h, NULL); x; x = slot_next(h, x)) {
        CHECK(x == (seen < n ? &h->v[seen] : &v[seen - n]));
        seen++;
    }
    CHECK_EQ(seen, n + 3);
    /* a GPU slot goes back to its own set, whatever the caller names */
    slot_t *x = slot_get(&g);
    CHECK(x && x->set == &g);
    CHECK_EQ(g.nfree, 2u);
    slot_put(h, x);
    CHECK_EQ(g.nfree, 3u);
    CHECK_EQ(h->nfree, n);
    h->gpu[1] = NULL;
}
