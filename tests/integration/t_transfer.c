/*
 * t_transfer.c — transfers through one daemon, every destination byte
 * checked against the reference pattern: context and generation ranks as
 * processes, TP and PP splits, the layout presets and block sizes,
 * skipped tokens, pools inside one memfd between guard bands, many
 * requests at once, role "both", a fetch right after a pool registration,
 * the generation side's own request ids, replicated heads, attention DP,
 * random configuration pairs through kvxfer-bench, and copy.pace.
 */

/* 1. */
TEST(publish_fetch_verified)
{
    daemon_t *d = daemon_start(NULL);
    side_t c = {
        .inst = "pf-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g = {
        .inst = "pf-gen", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    xfer_case(d, &M_SMALL, &c, &g, 8, 45, 0);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* ---- pools inside a larger memfd, between guard bands ---------------- */

/* The host side of the GPU-pool offset bug (issue 14): pools that start
 * inside a larger allocation, two pools in one, every byte outside the
 * destination pool checked unchanged after the transfer. */
TEST_T(host_pools_inside_one_memfd_guard_bands, 60)
{
    daemon_t *d = daemon_start(NULL);
    uint64_t seed = 14;
    char tag[48];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++)
            for (int k = 0; k < 2; k++) {
                snprintf(tag, sizeof(tag), "gb%d%d%d", a, b, k);
                gb_case(d, d, tag, gb_presets[a], gb_presets[b], &seed);
            }
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* kvx_pool_register_host refuses a range past the memfd and a memfd that
 * could shrink, naming the problem. */
TEST(host_pool_register_refusals)
{
    daemon_t *d = daemon_start(NULL);
    rank_t r;
    side_t s = {.inst = "hr",
                .role = KVX_ROLE_CONTEXT,
                .tp = 1,
                .pp = 1,
                .preset = "vllm-nhd",
                .tpb = 4};
    rank_hello_only(d, &M_SMALL, &s, 0, &r);
    rank_join(&r);
    rank_layout(&r, 8, &r.lay);
    uint64_t size = kvx_layout_span(&r.lay);
    int fd = memfd_create("kvx-ref", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, (off_t)(size + 100)) == 0);
    CHECK_FAILS(kvx_pool_register_host(r.c, &r.lay, fd, 0, size, &r.pool, T_MS),
                r.c, KVX_ERR_INVALID, "F_SEAL_SHRINK");
    CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    CHECK_FAILS(
        kvx_pool_register_host(r.c, &r.lay, fd, 101, size, &r.pool, T_MS), r.c,
        KVX_ERR_INVALID, "runs past the 65636 bytes of allocations[0]");
    CHECK_FAILS(kvx_pool_register_host(r.c, &r.lay, fd, UINT64_MAX - 4, size,
                                       &r.pool, T_MS),
                r.c, KVX_ERR_INVALID,
                "runs past the 65636 bytes of allocations[0]");
    CHECK_KVX(kvx_pool_register_host(r.c, &r.lay, fd, 100, size, &r.pool, T_MS),
              r.c);
    close(fd);
    rank_close(&r);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* 2. */
TEST(two_by_two)
{
    daemon_t *d = daemon_start(NULL);
    side_t c = {
        .inst = "tt-ctx", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g = {
        .inst = "tt-gen", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &c, &g, 6, 37, 0);
    daemon_stop_ok(d);
}

/* 3. heads concatenated, split; layers from two PP ranks */
TEST(tp_split)
{
    daemon_t *d = daemon_start(NULL);
    side_t c2 = {
        .inst = "ts-ctx2", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g1 = {
        .inst = "ts-gen1", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &c2, &g1, 4, 29, 0);
    side_t c1 = {
        .inst = "ts-ctx1", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g2 = {
        .inst = "ts-gen2", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &c1, &g2, 4, 29, 0);
    /* tp 4 -> tp 2 over 4 heads: each destination from two sources */
    side_t c4 = {
        .inst = "ts-ctx4", .tp = 4, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g2b = {
        .inst = "ts-gen2b", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &c4, &g2b, 3, 29, 0);
    daemon_stop_ok(d);
}

TEST(pp_split)
{
    daemon_t *d = daemon_start(NULL);
    /* 5 layers: an uneven even-split (3 + 2) */
    model_t m5 = M_SMALL;
    m5.layers = 5;
    side_t c = {
        .inst = "pp-ctx", .tp = 1, .pp = 2, .preset = "vllm-nhd", .tpb = 8};
    side_t g = {
        .inst = "pp-gen", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &m5, &c, &g, 4, 29, 0);
    /* explicit layers_per_pp {3, 1} -> pp 1, and pp 1 -> pp 2 x tp 2 */
    static const uint32_t lpp[2] = {3, 1};
    side_t ce = {.inst = "pp-ctxe",
                 .tp = 1,
                 .pp = 2,
                 .preset = "vllm-nhd",
                 .tpb = 8,
                 .layers_per_pp = lpp};
    side_t ge = {
        .inst = "pp-gene", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &ce, &ge, 3, 21, 0);
    side_t c1 = {
        .inst = "pp-ctx1", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g22 = {
        .inst = "pp-gen22", .tp = 2, .pp = 2, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &c1, &g22, 3, 21, 0);
    daemon_stop_ok(d);
}

/* 4. */
TEST(layouts)
{
    daemon_t *d = daemon_start(NULL);
    side_t c = {
        .inst = "ly-ctx", .tp = 1, .pp = 1, .preset = "trtllm", .tpb = 8};
    side_t g = {
        .inst = "ly-gen", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &c, &g, 4, 30, 0);
    side_t c2 = {
        .inst = "ly-ctx2", .tp = 2, .pp = 1, .preset = "vllm-hnd", .tpb = 8};
    side_t g2 = {
        .inst = "ly-gen2", .tp = 1, .pp = 1, .preset = "flashinfer", .tpb = 8};
    xfer_case(d, &M_SMALL, &c2, &g2, 4, 30, 0);
    daemon_stop_ok(d);
}

/* Different tokens_per_block on the two sides, and the sglang / mla
 * presets (token pages; one latent head with kv_factor 1). */
TEST(layouts_tpb_sglang_mla)
{
    daemon_t *d = daemon_start(NULL);
    side_t c = {
        .inst = "lt-ctx", .tp = 1, .pp = 1, .preset = "trtllm", .tpb = 16};
    side_t g = {
        .inst = "lt-gen", .tp = 1, .pp = 1, .preset = "vllm-hnd", .tpb = 4};
    xfer_case(d, &M_SMALL, &c, &g, 3, 45, 0);
    side_t cs = {
        .inst = "lt-ctxs", .tp = 1, .pp = 1, .preset = "sglang", .tpb = 1};
    side_t gs = {
        .inst = "lt-gens", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    xfer_case(d, &M_SMALL, &cs, &gs, 3, 40, 0);
    model_t mla = {.layers = 3,
                   .heads = 1,
                   .head_dim = 64,
                   .kv = 1,
                   .dtype = KVX_DTYPE_BF16};
    side_t cm = {
        .inst = "lt-ctxm", .tp = 2, .pp = 1, .preset = "mla", .tpb = 8};
    side_t gm = {
        .inst = "lt-genm", .tp = 1, .pp = 1, .preset = "mla", .tpb = 16};
    xfer_case(d, &mla, &cm, &gm, 3, 40, 0);
    side_t cm1 = {
        .inst = "lt-ctxm1", .tp = 1, .pp = 1, .preset = "mla", .tpb = 8};
    side_t gm2 = {
        .inst = "lt-genm2", .tp = 2, .pp = 1, .preset = "mla", .tpb = 8};
    xfer_case(d, &mla, &cm1, &gm2, 3, 40, 0);
    daemon_stop_ok(d);
}

/* 5. */
TEST(skip_tokens)
{
    daemon_t *d = daemon_start(NULL);
    side_t c = {
        .inst = "sk-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g = {
        .inst = "sk-gen", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case(d, &M_SMALL, &c, &g, 4, 40, 13); /* block 1, token 5 */
    side_t c2 = {
        .inst = "sk-ctx2", .tp = 2, .pp = 1, .preset = "trtllm", .tpb = 16};
    side_t g2 = {
        .inst = "sk-gen2", .tp = 1, .pp = 1, .preset = "flashinfer", .tpb = 4};
    xfer_case(d, &M_SMALL, &c2, &g2, 4, 40, 18);
    daemon_stop_ok(d);
}

/* ---- single-process pairs --------------------------------------------- */

/* 6. */
TEST(many_concurrent)
{
    enum { N = 240, TOK = 10, TPB = 4, NB = 3 };
    daemon_t *d = daemon_start(NULL);
    model_t m = {.layers = 2,
                 .heads = 2,
                 .head_dim = 16,
                 .kv = 2,
                 .dtype = KVX_DTYPE_BF16};
    side_t cs = {.inst = "mc-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = TPB};
    side_t gs = {.inst = "mc-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 1,
                 .pp = 1,
                 .preset = "flashinfer",
                 .tpb = TPB};
    rank_t c, g;
    rank_open(d, &m, &cs, 0, N * NB, &c);
    rank_open(d, &m, &gs, 0, N * NB, &g);
    memset(g.base, 0xa5, g.size);
    static uint32_t cb[N][NB], gb[N][NB];
    static kvx_context_params_t p[N];
    for (uint32_t q = 0; q < N; q++) {
        for (uint32_t i = 0; i < NB; i++) {
            cb[q][i] = i * N + q;
            gb[q][i] = (NB - 1 - i) * N + q;
        }
        fill_req(&c, 1000 + q, cb[q], TOK);
        CHECK_KVX(
            kvx_publish(c.c, 1000 + q, c.pool, cb[q], NB, TOK, &p[q], T_MS),
            c.c);
    }
    /* every request in flight at once, then poll */
    for (uint32_t q = 0; q < N; q++)
        CHECK_KVX(kvx_fetch(g.c, 1000 + q, p[q].data, p[q].len, g.pool, gb[q],
                            NB, 0, T_MS),
                  g.c);
    static ev_t ge[N + 16], ce[N + 16];
    int ng = collect(g.c, ge, N + 16, N, 15000);
    int nc = collect(c.c, ce, N + 16, N, 15000);
    CHECK_EQ(ng, N);
    CHECK_EQ(nc, N);
    /* nothing more arrives: exactly once */
    kvx_batch_t *b;
    CHECK_KVX(kvx_poll(g.c, 1, 100, &b), g.c);
    CHECK_EQ(b->num_events, 0);
    kvx_batch_free(b);
    static expect_t e[N];
    for (uint32_t q = 0; q < N; q++) {
        expect_event(ge, ng, 1000 + q, KVX_EVENT_COMPLETE, 0);
        expect_event(ce, nc, 1000 + q, KVX_EVENT_COMPLETE, 0);
        e[q] = (expect_t){1000 + q, gb[q], TOK, 0};
        kvx_context_params_free(&p[q]);
    }
    CHECK_EQ(check_pool(&g, e, N, 0xa5), 0);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* ---- more: roles, registration, request ids, replicas ----------------- */

/* An instance with role "both" moves KV to itself and cancels a request
 * id it both offers and fetches. */
TEST(role_both)
{
    daemon_t *d = daemon_start(NULL);
    side_t bs = {.inst = "rb",
                 .role = KVX_ROLE_BOTH,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t r0, r1;
    rank_hello_only(d, &M_SMALL, &bs, 0, &r0);
    rank_hello_only(d, &M_SMALL, &bs, 1, &r1);
    rank_join(&r0);
    rank_join(&r1);
    rank_pool(&r0, 16);
    rank_pool(&r1, 16);
    memset(r0.base, 0xa5, r0.size);
    memset(r1.base, 0xa5, r1.size);
    uint32_t src[3] = {0, 1, 2}, dst[3] = {9, 8, 7};
    fill_req(&r0, 1, src, 10);
    fill_req(&r1, 1, src, 10);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(r0.c, 1, r0.pool, src, 3, 10, &p, T_MS), r0.c);
    kvx_context_params_t q;
    CHECK_KVX(kvx_publish(r1.c, 1, r1.pool, src, 3, 10, &q, T_MS), r1.c);
    kvx_context_params_free(&q);
    CHECK_KVX(kvx_fetch(r0.c, 1, p.data, p.len, r0.pool, dst, 3, 0, T_MS),
              r0.c);
    CHECK_KVX(kvx_fetch(r1.c, 1, p.data, p.len, r1.pool, dst, 3, 0, T_MS),
              r1.c);
    /* two events for id 1 (the fetch and the offer), on both ranks */
    for (int k = 0; k < 2; k++) {
        ev_t e[8];
        int n = collect(k ? r1.c : r0.c, e, 8, 2, 3000);
        if (n != 2)
            print_events("rb", e, n < 8 ? n : 8);
        CHECK_EQ(n, 2);
        CHECK(e[0].req == 1 && e[1].req == 1);
        CHECK(e[0].kind == KVX_EVENT_COMPLETE &&
              e[1].kind == KVX_EVENT_COMPLETE);
    }
    expect_t ex[2] = {{1, src, 10, 0}, {1, dst, 10, 0}};
    CHECK_EQ(check_pool(&r0, ex, 2, 0xa5), 0);
    CHECK_EQ(check_pool(&r1, ex, 2, 0xa5), 0);
    kvx_context_params_free(&p);

    /* id 2: offered by rank 0 only, fetched by rank 0 only (its part is
     * done, the request waits for rank 1); cancel it */
    uint32_t src2[2] = {3, 4}, dst2[2] = {10, 11};
    CHECK_KVX(kvx_publish(r0.c, 2, r0.pool, src2, 2, 8, &p, T_MS), r0.c);
    CHECK_KVX(kvx_fetch(r0.c, 2, p.data, p.len, r0.pool, dst2, 2, 0, T_MS),
              r0.c);
    sleep_ms(20);
    CHECK_KVX(kvx_cancel(r0.c, 2, T_MS), r0.c);
    ev_t e[8];
    int n = collect(r0.c, e, 8, 2, 3000);
    if (n != 2)
        print_events("rb", e, n < 8 ? n : 8);
    CHECK_EQ(n, 2);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(e[i].req, 2);
        CHECK(e[i].kind != KVX_EVENT_COMPLETE);
        CHECK_EQ(e[i].code, KVX_ERR_CANCELLED);
    }
    CHECK_FAILS(kvx_cancel(r0.c, 2, T_MS), r0.c, KVX_ERR_NOT_FOUND, "2");
    kvx_context_params_free(&p);
    rank_close(&r0);
    rank_close(&r1);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A transfer asked for right after a (large) pool registration. */
TEST(fetch_right_after_register)
{
    daemon_t *d = daemon_start(SLOW_CFG "deadlines:\n"
                                        "  fetch_timeout_ms: 5000\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "fr-ctx", "fr-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t bl[2] = {3, 5};
    fill_req(&c, 61, bl, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 61, c.pool, bl, 2, 7, &p, T_MS), c.c);
    /* a 256 MiB pool (e.g. the next layer group) just before the fetch */
    kvx_layout_t l;
    rank_layout(&g, 32768, &l);
    void *base;
    uint32_t big;
    CHECK_KVX(kvx_pool_create_host(g.c, &l, 256u << 20, &base, &big, T_MS),
              g.c);
    CHECK_KVX(kvx_fetch(g.c, 61, p.data, p.len, g.pool, bl, 2, 0, T_MS), g.c);
    wait_event(g.c, 61, KVX_EVENT_COMPLETE, 0, 2000);
    expect_t e = {61, bl, 7, 0};
    CHECK_EQ(check_pool(&g, &e, 1, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* The generation side names the request its own way. */
TEST(gen_own_request_ids)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "id-ctx", "id-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[2] = {6, 2}, gb[2] = {1, 7};
    fill_req(&c, 0xfffffffffffffff0ull, cb, 5);
    kvx_context_params_t p;
    CHECK_KVX(
        kvx_publish(c.c, 0xfffffffffffffff0ull, c.pool, cb, 2, 5, &p, T_MS),
        c.c);
    CHECK_KVX(kvx_fetch(g.c, 7, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 7, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 0xfffffffffffffff0ull, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t e = {0xfffffffffffffff0ull, gb, 5, 0};
    CHECK_EQ(check_pool(&g, &e, 1, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* Replicated heads (MLA, tp 2 over one latent head): the consumer needs
 * one replica, so the transfer completes before the other context rank
 * publishes. That rank's publish must still get the same params and must
 * not leave an offer behind. */
TEST(replicated_late_publish)
{
    daemon_t *d = daemon_start("deadlines:\n  offer_lease_ms: 300\n");
    model_t mla = {.layers = 2,
                   .heads = 1,
                   .head_dim = 32,
                   .kv = 1,
                   .dtype = KVX_DTYPE_BF16};
    side_t cs = {.inst = "rl-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 2,
                 .pp = 1,
                 .preset = "mla",
                 .tpb = 4};
    side_t gs = {.inst = "rl-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 1,
                 .pp = 1,
                 .preset = "mla",
                 .tpb = 4};
    rank_t c0, c1, g;
    rank_hello_only(d, &mla, &cs, 0, &c0);
    rank_hello_only(d, &mla, &cs, 1, &c1);
    rank_join(&c0);
    rank_join(&c1);
    rank_pool(&c0, 8);
    rank_pool(&c1, 8);
    rank_open(d, &mla, &gs, 0, 8, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t bl[2] = {2, 5};
    fill_req(&c0, 8, bl, 7);
    fill_req(&c1, 8, bl, 7);
    kvx_context_params_t p0, p1;
    CHECK_KVX(kvx_publish(c0.c, 8, c0.pool, bl, 2, 7, &p0, T_MS), c0.c);
    CHECK_KVX(kvx_fetch(g.c, 8, p0.data, p0.len, g.pool, bl, 2, 0, T_MS), g.c);
    wait_event(g.c, 8, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t e = {8, bl, 7, 0};
    CHECK_EQ(check_pool(&g, &e, 1, 0xa5), 0);
    /* rank 1 publishes late */
    CHECK_KVX(kvx_publish(c1.c, 8, c1.pool, bl, 2, 7, &p1, T_MS), c1.c);
    CHECK_EQ(p1.len, p0.len);
    if (memcmp(p1.data, p0.data, p0.len))
        fprintf(stderr, "rank 1 got other params than rank 0 (a new offer)\n");
    CHECK(memcmp(p1.data, p0.data, p0.len) == 0);
    /* one COMPLETE for the request, and nothing left to expire */
    wait_event(c0.c, 8, KVX_EVENT_COMPLETE, 0, 3000);
    sleep_ms(500);
    char *json;
    CHECK_KVX(kvx_requests_json(c0.c, &json, T_MS), c0.c);
    if (strcmp(json, "[]"))
        fprintf(stderr, "left in flight: %s\n", json);
    CHECK(strcmp(json, "[]") == 0);
    free(json);
    ev_t ev[4];
    int n = collect(c0.c, ev, 4, 1, 200);
    if (n)
        print_events("unexpected", ev, n < 4 ? n : 4);
    CHECK_EQ(n, 0);
    kvx_context_params_free(&p0);
    kvx_context_params_free(&p1);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* ---- property test: random configuration pairs through a real daemon ---
 * kvxfer-bench runs real context and generation rank processes against a
 * daemon and checks every destination row against the reference pattern,
 * a function of (request, layer, kv, token, head) in global coordinates:
 * the expected bytes follow from the two configurations alone, never from
 * the daemon's plan. Seeded, so a failure reproduces; the command line is
 * printed. */

static uint32_t prng(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*s >> 33);
}

static uint32_t pick_tp(uint64_t *s, uint32_t heads)
{
    /* a TP the heads split over, or replicate across (tp > heads) */
    static const uint32_t tps[] = {1, 2, 4, 8};
    for (;;) {
        uint32_t tp = tps[prng(s) % 4];
        if (heads >= tp ? heads % tp == 0 : tp % heads == 0)
            return tp;
    }
}

TEST_T(property_random_config_pairs, 240)
{
    static const char *const presets[] = {"trtllm", "vllm-nhd", "vllm-hnd",
                                          "flashinfer", "sglang"};
    uint64_t seed = 20261130;
    const char *env = getenv("KVX_PROPERTY_SEED");
    if (env)
        seed = strtoull(env, NULL, 10);
    /* every preset pair once (25), then MLA and random pairs */
    int cases = 48;
    for (int i = 0; i < cases; i++) {
        int mla = i >= 25 && prng(&seed) % 3 == 0;
        uint32_t heads = mla ? 1 : 1 + prng(&seed) % 16;
        uint32_t layers = 1 + prng(&seed) % 8;
        uint32_t ctp = pick_tp(&seed, heads), gtp = pick_tp(&seed, heads);
        uint32_t cpp = 1 + prng(&seed) % 4, gpp = 1 + prng(&seed) % 4;
        if (cpp > layers)
            cpp = layers;
        if (gpp > layers)
            gpp = layers;
        if (ctp * cpp + gtp * gpp > 12) { /* keep the process count sane */
            cpp = gpp = 1;
        }
        const char *cl = mla      ? "mla"
                         : i < 25 ? presets[i / 5]
                                  : presets[prng(&seed) % 5];
        const char *gl = mla      ? "mla"
                         : i < 25 ? presets[i % 5]
                                  : presets[prng(&seed) % 5];
        uint32_t ctpb = !strcmp(cl, "sglang") ? 1 : 1 + prng(&seed) % 64;
        uint32_t gtpb = !strcmp(gl, "sglang") ? 1 : 1 + prng(&seed) % 64;
        uint32_t blocks = 1 + prng(&seed) % (ctpb == 1 ? 40 : 4);
        uint32_t tokens = blocks * ctpb;
        uint32_t skip = prng(&seed) % 3 ? 0 : prng(&seed) % tokens;
        uint32_t hdim = mla ? 72 : (prng(&seed) % 2 ? 16 : 24);
        char cmd[1024];
        snprintf(cmd, sizeof(cmd),
                 /* the bench's rank processes exit without freeing:
                  * leak reports there are noise under make asan */
                 "ASAN_OPTIONS=detect_leaks=0 "
                 "%s/kvxfer-bench --spawn-daemon --json --requests 3 "
                 "--window 2 --blocks %u --layers %u --heads %u "
                 "--head-dim %u --ctx-tp %u --ctx-pp %u --gen-tp %u "
                 "--gen-pp %u --ctx-layout %s --gen-layout %s "
                 "--ctx-tokens-per-block %u --gen-tokens-per-block %u "
                 "--skip-tokens %u %s 2>&1",
                 build_dir(), blocks, layers, heads, hdim, ctp, cpp, gtp, gpp,
                 cl, gl, ctpb, gtpb, skip, mla ? "--mla" : "");
        FILE *f = popen(cmd, "r");
        CHECK(f);
        char out[4096] = "";
        size_t n = fread(out, 1, sizeof(out) - 1, f);
        out[n] = 0;
        int st = pclose(f);
        if (st != 0 || !strstr(out, "\"verified\":true")) {
            fprintf(stderr, "case %d failed:\n%s\n-> %s\n", i, cmd, out);
            CHECK(0);
        }
    }
}

/* Attention DP on the generation side: gen tp 2 in 2 groups of one rank;
 * each request goes to one group, whose rank receives all heads, and
 * completes when that group alone has it. */
TEST(attention_dp)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs = {.inst = "dp-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 2,
                 .pp = 1,
                 .preset = "trtllm",
                 .tpb = 4};
    side_t gs = {.inst = "dp-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4,
                 .dp = 2};
    rank_t c[2], g[2];
    for (uint32_t i = 0; i < 2; i++)
        rank_open(d, &M_SMALL, &cs, i, 8, &c[i]);
    for (uint32_t i = 0; i < 2; i++) {
        rank_open(d, &M_SMALL, &gs, i, 8, &g[i]);
        CHECK_EQ(g[i].nheads, M_SMALL.heads); /* a group holds all heads */
        memset(g[i].base, 0x5a, g[i].size);
    }
    static const uint32_t b1[2] = {0, 1}, b2[2] = {2, 3}, gb[2] = {4, 6};
    kvx_context_params_t p1, p2;
    for (int i = 0; i < 2; i++) {
        fill_req(&c[i], 1, b1, 8);
        fill_req(&c[i], 2, b2, 8);
        CHECK_KVX(kvx_publish(c[i].c, 1, c[i].pool, b1, 2, 8, &p1, T_MS),
                  c[i].c);
        CHECK_KVX(kvx_publish(c[i].c, 2, c[i].pool, b2, 2, 8, &p2, T_MS),
                  c[i].c);
        if (i == 0) {
            kvx_context_params_free(&p1);
            kvx_context_params_free(&p2);
        }
    }
    /* a rank outside the named group is refused, naming both groups */
    CHECK_FAILS(
        kvx_fetch_dp(g[1].c, 12, p1.data, p1.len, g[1].pool, gb, 2, 0, 0, T_MS),
        g[1].c, KVX_ERR_INVALID, "group 1, not 0");
    CHECK_FAILS(
        kvx_fetch_dp(g[0].c, 12, p1.data, p1.len, g[0].pool, gb, 2, 0, 2, T_MS),
        g[0].c, KVX_ERR_INVALID, "2 attention-DP groups");
    CHECK_KVX(
        kvx_fetch_dp(g[0].c, 10, p1.data, p1.len, g[0].pool, gb, 2, 0, 0, T_MS),
        g[0].c);
    CHECK_KVX(
        kvx_fetch_dp(g[1].c, 11, p2.data, p2.len, g[1].pool, gb, 2, 0, 1, T_MS),
        g[1].c);
    ev_t ev[8];
    int n = collect(g[0].c, ev, 8, 2, 5000);
    print_events("gen rank 0", ev, n);
    CHECK_EQ(n, 2);
    CHECK(expect_event(ev, n, 10, KVX_EVENT_COMPLETE, 0));
    CHECK(expect_event(ev, n, 11, KVX_EVENT_COMPLETE, 0));
    expect_t e1 = {1, gb, 8, 0}, e2 = {2, gb, 8, 0};
    CHECK_EQ(check_pool(&g[0], &e1, 1, 0x5a), 0);
    CHECK_EQ(check_pool(&g[1], &e2, 1, 0x5a), 0);
    kvx_context_params_free(&p1);
    kvx_context_params_free(&p2);
    for (int i = 0; i < 2; i++) {
        rank_close(&g[i]);
        rank_close(&c[i]);
    }
    daemon_stop_ok(d);
}

/* Run kvxfer-bench of this build with args (stderr with stdout); its
 * output in out (cap bytes), its exit status returned. */
static int bench_run(const char *args, char *out, size_t cap)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "ASAN_OPTIONS=detect_leaks=0 %s/kvxfer-bench %s 2>&1", build_dir(),
             args);
    FILE *f = popen(cmd, "r");
    CHECK(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    int st = pclose(f);
    if (st)
        fprintf(stderr, "%s\n%s\n", cmd, out);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* The [p50, p99] of hop in kvxfer-bench --json --trace's output. */
static void trace_hop(const char *out, const char *hop, double *p50,
                      double *p99)
{
    char k[128];
    snprintf(k, sizeof(k), "\"%s\":[", hop);
    const char *at = strstr(out, k);
    if (!at)
        fprintf(stderr, "no %s in %s\n", k, out);
    CHECK(at);
    char *e;
    *p50 = strtod(at + strlen(k), &e);
    *p99 = strtod(e + 1, NULL);
}

/* kvxfer-bench with pools smaller than its requests (blocks reused):
 * each slot written once, every request sampled, every slot checked
 * whole after the pass ("verify":"sampled"); --trace reads the spawned
 * daemon's log.trace_file and reports the hops of every timed request. */
TEST_T(bench_reused_pools_sampled_and_traced, 120)
{
    char out[8192];
    CHECK_EQ(bench_run("--spawn-daemon --json --trace --requests 40 "
                       "--window 4 --blocks 8 --layers 2 --heads 2 "
                       "--head-dim 64 --pool-mib 1",
                       out, sizeof(out)),
             0);
    CHECK_STR_CONTAINS(out, "\"verified\":true");
    CHECK_STR_CONTAINS(out, "\"verify\":\"sampled\"");
    CHECK_STR_CONTAINS(out, "\"trace_requests\":40");
    CHECK_STR_CONTAINS(out, "\"fetch call -> event (total)\":[");
    CHECK_STR_CONTAINS(out, "\"submitted -> last copy done (thread)\":[");
    /* each request's part in the daemon lies inside its whole: so do
     * their p50s and p99s */
    double d50, d99, t50, t99;
    trace_hop(out, "made -> event queued (the daemon's part)", &d50, &d99);
    trace_hop(out, "fetch call -> event (total)", &t50, &t99);
    CHECK(d50 > 0 && d50 <= d99);
    CHECK(d50 <= t50 && d99 <= t99);
}

/* --trace with --passes: every pass fetches the same requests, and each
 * request's hops come from one pass, the last, whose times the rank
 * kept. The hops were the first pass's daemon times against the last
 * pass's client times: a hop over the client's clock then spanned whole
 * passes, longer than the request itself. */
TEST_T(bench_traced_over_passes, 120)
{
    char out[8192];
    CHECK_EQ(bench_run("--spawn-daemon --json --trace --passes 3 "
                       "--requests 8 --window 4 --blocks 8 --layers 2 "
                       "--heads 2 --head-dim 64 --pool-mib 1",
                       out, sizeof(out)),
             0);
    CHECK_STR_CONTAINS(out, "\"trace_requests\":8,");
    double t50, t99, c50, c99, d50, d99, e50, e99;
    trace_hop(out, "fetch call -> event (total)", &t50, &t99);
    trace_hop(out, "fetch call -> fetch made (daemon)", &c50, &c99);
    trace_hop(out, "made -> event queued (the daemon's part)", &d50, &d99);
    trace_hop(out, "event queued -> client has it", &e50, &e99);
    CHECK(c99 <= t99 && d99 <= t99 && e99 <= t99);
    CHECK(d50 > 0);
}

/* kvxfer-bench --layerwise, small: every way it measures runs and the
 * request's bytes are checked; --poll-spin polls without waiting,
 * --trace adds the daemon's part of the exposed time, which cannot
 * exceed the whole of it (one monotonic clock); a waiting rank with a
 * spin (KVXFER_SPIN_US) is woken early (polls_woken_early). */
TEST_T(bench_layerwise_spin_and_traced, 120)
{
    char out[8192];
    CHECK_EQ(bench_run("--spawn-daemon --json --layerwise 1 --requests 3 "
                       "--blocks 8 --layers 4 --heads 2 --head-dim 64 "
                       "--poll-spin --trace",
                       out, sizeof(out)),
             0);
    CHECK_STR_CONTAINS(out, "\"verified\":true");
    CHECK_STR_CONTAINS(out, "\"poll\":\"spin\"");
    const char *a = strstr(out, "\"exposed_us\":");
    const char *b = strstr(out, "\"exposed_daemon_us\":");
    CHECK(a && b);
    double whole = strtod(a + strlen("\"exposed_us\":"), NULL);
    double daemon = strtod(b + strlen("\"exposed_daemon_us\":"), NULL);
    CHECK(daemon > 0 && daemon <= whole);
    CHECK_STR_CONTAINS(out, "\"polls_woken_early\":0,"); /* it never waits */
    /* a waiting generation rank with a spin is answered early once each
     * fetch's last copies go out to a copy thread (inline_bytes 0) */
    char cfg[64], args[512];
    snprintf(cfg, sizeof(cfg), "/tmp/kvx-it-bench-%d.yaml", (int)getpid());
    FILE *f = fopen(cfg, "w");
    CHECK(f);
    fputs("copy:\n  inline_bytes: 0\n", f);
    fclose(f);
    snprintf(args, sizeof(args),
             "--spawn-daemon --json --layerwise 1 --requests 2 --blocks 8 "
             "--layers 4 --heads 2 --head-dim 64 --daemon-config %s",
             cfg);
    setenv("KVXFER_SPIN_US", "200", 1);
    int rc = bench_run(args, out, sizeof(out));
    unsetenv("KVXFER_SPIN_US");
    unlink(cfg);
    CHECK_EQ(rc, 0);
    CHECK_STR_CONTAINS(out, "\"verified\":true");
    CHECK_STR_CONTAINS(out, "\"poll\":\"wait\"");
    const char *e = strstr(out, "\"polls_woken_early\":");
    CHECK(e && strtoull(e + strlen("\"polls_woken_early\":"), NULL, 10) > 0);
    /* --poll-spin alone is refused, saying with what it goes */
    CHECK_EQ(bench_run("--poll-spin", out, sizeof(out)), 2);
    CHECK_STR_CONTAINS(out, "--poll-spin goes with --layerwise");
}

/* kvxfer-bench --batch: the ranks publish and fetch through
 * kvx_publish_many / kvx_fetch_many, blocks reused, every byte checked;
 * with the keyed names too; refused beside --by-key. */
TEST_T(bench_batch_many_a_call, 120)
{
    char out[8192];
    CHECK_EQ(bench_run("--spawn-daemon --json --batch --requests 300 "
                       "--window 64 --blocks 1 --layers 1 --heads 1 "
                       "--head-dim 64 --pool-mib 1 --verify-each",
                       out, sizeof(out)),
             0);
    CHECK_STR_CONTAINS(out, "\"verified\":true");
    CHECK_STR_CONTAINS(out, "\"requests\":300");
    CHECK_EQ(bench_run("--spawn-daemon --json --batch --keyed --requests 64 "
                       "--window 16 --blocks 2 --layers 2 --heads 2 "
                       "--head-dim 64",
                       out, sizeof(out)),
             0);
    CHECK_STR_CONTAINS(out, "\"verified\":true");
    CHECK_EQ(bench_run("--batch --by-key", out, sizeof(out)), 2);
    CHECK_STR_CONTAINS(out, "--batch goes without --reserve, --by-key");
}

/* ---- copy.pace ------------------------------------------------------- */

/* The holds the status counts: "paced: N jobs held X ms, H now". */
static uint64_t paced_of(daemon_t *d, unsigned *now)
{
    char *st = status_json(d);
    const char *p = strstr(st, "paced: ");
    CHECK(p != NULL);
    uint64_t n = strtoull(p + strlen("paced: "), NULL, 10);
    const char *h = strstr(p, " ms, ");
    CHECK(h != NULL);
    *now = (unsigned)strtoul(h + strlen(" ms, "), NULL, 10);
    free(st);
    return n;
}

/* Request id, M_BIG's 64 MiB in blocks bl: published by c, fetched by g. */
static void big_request(rank_t *c, rank_t *g, uint64_t id, const uint32_t *bl)
{
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c->c, id, c->pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c->c);
    CHECK_KVX(
        kvx_fetch(g->c, id, p.data, p.len, g->pool, bl, BIG_BLOCKS, 0, T_MS),
        g->c);
    kvx_context_params_free(&p);
}

/* 200 ms after a request started at a slow pace: chunks are held. */
static void held_soon(daemon_t *d)
{
    unsigned held;
    sleep_ms(200);
    CHECK(paced_of(d, &held) > 0 && held > 0);
}

static void pace_reload(daemon_t *d, const char *copy_keys)
{
    char cfg[512];
    snprintf(cfg, sizeof(cfg), "socket:\n  path: %s\ncopy:\n%s", d->sock,
             copy_keys);
    write_file(d->cfg, cfg);
    int before = log_count(d, "reloaded");
    kill(d->pid, SIGHUP);
    CHECK(log_wait_more(d, "reloaded", before, 3000));
}

/* copy.pace: a 64 MiB request's chunks wait for the pace and every byte
 * arrives, the status counting the holds; at 128 bytes a millisecond
 * each next chunk waits 8 s (the request, minutes), but a cancel drops
 * its held chunks at once, and a reload to no pace lets a third one's
 * go: it completes in seconds. */
TEST_T(copy_pace_holds_cancel_and_reload, 60)
{
    daemon_t *d = daemon_start("copy:\n  chunk_bytes: 1MiB\n  pace: 2MiB\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "pc-ctx", "pc-gen", BIG_BLOCKS, &c, &g, &cs, &gs);
    for (uint64_t i = 0; i < c.size; i++)
        c.base[i] = (uint8_t)(i * 131 + i / 4096);
    uint32_t *bl = big_blocks();
    unsigned held;
    CHECK_EQ(paced_of(d, &held), 0);
    for (uint64_t id = 31; id <= 33; id++) {
        memset(g.base, 0xa5, g.size);
        big_request(&c, &g, id, bl);
        if (id == 32) { /* slow: cancelled while its chunks are held */
            held_soon(d);
            CHECK_KVX(kvx_cancel(g.c, id, T_MS), g.c);
            wait_event(g.c, id, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
            wait_event(c.c, id, KVX_EVENT_ERROR, KVX_ERR_CANCELLED, 3000);
            CHECK(memchr(g.base, 0xa5, g.size) != NULL); /* not all came */
            pace_reload(d, "  chunk_bytes: 1MiB\n  pace: 128\n");
            continue;
        }
        if (id == 33) { /* as slow, until the pace is lifted */
            held_soon(d);
            CHECK(memchr(g.base, 0xa5, g.size) != NULL);
            pace_reload(d, "  chunk_bytes: 1MiB\n");
        }
        wait_event(g.c, id, KVX_EVENT_COMPLETE, 0, 3000);
        wait_event(c.c, id, KVX_EVENT_COMPLETE, 0, 3000);
        CHECK(!memcmp(g.base, c.base, g.size));
        if (id == 31) {
            CHECK(paced_of(d, &held) > 0);
            CHECK_EQ(held, 0);
            pace_reload(d, "  chunk_bytes: 1MiB\n  pace: 128\n");
        }
    }
    CHECK(paced_of(d, &held) > 0);
    CHECK_EQ(held, 0);
    free(bl);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A reload to a faster pace applies to what the lane owes: at 128 bytes
 * a millisecond a started 1 MiB chunk holds the next for 8 s, which at
 * 64 MiB a millisecond is microseconds, so the request completes in
 * seconds. A pace turned off owes nothing: set again later, the lane
 * starts idle, not 8 s behind a chunk started before it was off. */
TEST_T(copy_pace_reload_faster_applies_to_held, 60)
{
    daemon_t *d = daemon_start("copy:\n  chunk_bytes: 1MiB\n  pace: 128\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "pf-ctx", "pf-gen", BIG_BLOCKS, &c, &g, &cs, &gs);
    for (uint64_t i = 0; i < c.size; i++)
        c.base[i] = (uint8_t)(i * 71 + i / 8192);
    uint32_t *bl = big_blocks();
    unsigned held;
    for (uint64_t id = 41; id <= 43; id++) {
        memset(g.base, 0xa5, g.size);
        big_request(&c, &g, id, bl);
        if (id == 41) { /* held 8 s a chunk, until the pace is raised */
            held_soon(d);
            pace_reload(d, "  chunk_bytes: 1MiB\n  pace: 64MiB\n");
        } else if (id == 42) { /* one chunk charged at 128, then off */
            held_soon(d);
            pace_reload(d, "  chunk_bytes: 1MiB\n");
        }
        wait_event(g.c, id, KVX_EVENT_COMPLETE, 0, 3000);
        wait_event(c.c, id, KVX_EVENT_COMPLETE, 0, 3000);
        CHECK(!memcmp(g.base, c.base, g.size));
        if (id == 41) /* 42 starts 8 s behind a chunk at this pace */
            pace_reload(d, "  chunk_bytes: 1MiB\n  pace: 128\n");
        if (id == 42) /* 43: a fast pace, after the lane was off */
            pace_reload(d, "  chunk_bytes: 1MiB\n  pace: 64MiB\n");
    }
    CHECK(paced_of(d, &held) > 0);
    CHECK_EQ(held, 0);
    free(bl);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* SIGTERM while a request's chunks are held at a slow pace: they are
 * dropped unrun, the request ends SHUTDOWN on both sides, and the
 * daemon drains (every copy fenced) and exits 0, without ASan's word. */
TEST_T(copy_pace_sigterm_drops_held, 60)
{
    daemon_t *d = daemon_start("copy:\n  chunk_bytes: 1MiB\n  pace: 128\n"
                               "deadlines:\n  drain_timeout_ms: 20000\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "ps-ctx", "ps-gen", BIG_BLOCKS, &c, &g, &cs, &gs);
    uint32_t *bl = big_blocks();
    big_request(&c, &g, 51, bl);
    held_soon(d);
    kill(d->pid, SIGTERM);
    wait_event(g.c, 51, KVX_EVENT_ERROR, KVX_ERR_SHUTDOWN, 5000);
    int st = daemon_wait(d, 10000);
    CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(log_contains(d, "drained in"));
    CHECK(!log_contains(d, "not fenced"));
    free(bl);
    rank_close(&c);
    rank_close(&g);
}

/* The context side goes while the fetch's chunks are held at a slow
 * pace: its rank cancels one offer, then disconnects during a second;
 * each fetch ends at once (its held chunks dropped unrun, no wait for
 * the pace), and the daemon stays healthy. */
TEST_T(copy_pace_context_side_ends_held, 60)
{
    daemon_t *d = daemon_start("copy:\n  chunk_bytes: 1MiB\n  pace: 128\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "pe-ctx", "pe-gen", BIG_BLOCKS, &c, &g, &cs, &gs);
    uint32_t *bl = big_blocks();
    unsigned held;
    for (uint64_t id = 61; id <= 62; id++) {
        big_request(&c, &g, id, bl);
        held_soon(d);
        if (id == 61) {
            CHECK_KVX(kvx_cancel(c.c, id, T_MS), c.c);
        } else {
            rank_close(&c);
        }
        wait_event(g.c, id, KVX_EVENT_ERROR,
                   id == 61 ? KVX_ERR_CANCELLED : KVX_ERR_PEER_GONE, 3000);
        (void)paced_of(d, &held);
        CHECK_EQ(held, 0);
    }
    free(bl);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}
