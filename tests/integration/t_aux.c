/*
 * t_aux.c — the aux payload (kvx_publish_key's aux, kvx_event_t.aux) on
 * one daemon: delivered with the generation side's COMPLETE, up to
 * limits.aux_bytes exactly; over it refused with LIMIT and nothing kept;
 * a second rank's different aux refused with MISMATCH; errors, cancels
 * and the context side's events carry none.
 */

/* n bytes of aux for request seed. */
static uint8_t *aux_make(size_t n, uint32_t seed)
{
    uint8_t *a = malloc(n ? n : 1);
    CHECK(a != NULL);
    for (size_t i = 0; i < n; i++)
        a[i] = (uint8_t)(mix64(seed * 1000003ull + i) >> 17);
    return a;
}

static const side_t AUX_GEN = {.inst = "ax-gen",
                               .role = KVX_ROLE_GENERATION,
                               .tp = 1,
                               .pp = 1,
                               .preset = "vllm-nhd",
                               .tpb = 4};

/* 64 KiB (the default limits.aux_bytes, exactly) reach the generation
 * rank's COMPLETE, byte for byte, beside the KV; the context rank's
 * COMPLETE has none. One byte more is refused with LIMIT naming the key,
 * and nothing is kept: the key publishes again afterwards. */
TEST(aux_delivered_up_to_the_limit)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "ax-ctx", "ax-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    size_t n = 64 * 1024;
    uint8_t *aux = aux_make(n + 1, 1);
    uint32_t cb[2] = {3, 5}, gb[2] = {6, 1};
    kvx_context_params_t p;

    CHECK_FAILS(kvx_publish_key(c.c, "big", 3, c.pool, cb, 2, 7, aux, n + 1,
                                &p, T_MS),
                c.c, KVX_ERR_LIMIT, "limits.aux_bytes");
    CHECK_FAILS(kvx_publish_key(c.c, "big", 3, c.pool, cb, 2, 7, NULL, 5, &p,
                                T_MS),
                c.c, KVX_ERR_INVALID, "aux is NULL");
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK(!strstr(json, "\"key\":\"big\"")); /* nothing kept */
    free(json);

    fill_req(&c, 501, cb, 7);
    CHECK_KVX(kvx_publish_key(c.c, "big", 3, c.pool, cb, 2, 7, aux, n, &p,
                              T_MS),
              c.c);
    json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"aux\":65536,");
    free(json);
    CHECK_KVX(kvx_fetch_key(g.c, "g-big", 5, p.data, p.len, g.pool, gb, 2, 0,
                            0, T_MS),
              g.c);
    ev_t ge = wait_key(g.c, "g-big", 5, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.aux_len, n);
    CHECK_EQ(ge.aux_sum, aux_sum(aux, n));
    CHECK(!memcmp(ge.aux, aux, sizeof(ge.aux)));
    ev_t ce = wait_key(c.c, "big", 3, 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ce.aux_len, 0);
    expect_t ex = {.req = 501, .blocks = gb, .ntok = 7};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p);
    json = status_json(d); /* given back with the requests */
    CHECK_STR_CONTAINS(json, "\"aux\":0,");
    free(json);

    /* a publish without aux: the COMPLETE has none */
    CHECK_KVX(kvx_publish_key(c.c, "none", 4, c.pool, cb, 2, 7, NULL, 0, &p,
                              T_MS),
              c.c);
    CHECK_KVX(kvx_fetch_key(g.c, "g-none", 6, p.data, p.len, g.pool, gb, 2, 0,
                            0, T_MS),
              g.c);
    ge = wait_key(g.c, "g-none", 6, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.aux_len, 0);
    wait_key(c.c, "none", 4, 3000);
    kvx_context_params_free(&p);
    free(aux);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* limits.aux_bytes is the daemon's: set lower, a publish over it is
 * refused, one at it goes through. */
TEST(aux_limit_is_configured)
{
    daemon_t *d = daemon_start("limits:\n  aux_bytes: 16\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "al-ctx", "al-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[1] = {0}, gb[1] = {1};
    kvx_context_params_t p;
    CHECK_FAILS(kvx_publish_key(c.c, "k", 1, c.pool, cb, 1, 4,
                                "0123456789abcdefg", 17, &p, T_MS),
                c.c, KVX_ERR_LIMIT,
                "publish.aux: 17 bytes, more than limits.aux_bytes (16)");
    CHECK_KVX(kvx_publish_key(c.c, "k", 1, c.pool, cb, 1, 4,
                              "0123456789abcdef", 16, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_fetch_key(g.c, "k", 1, p.data, p.len, g.pool, gb, 1, 0, 0,
                            T_MS),
              g.c);
    ev_t ge = wait_key(g.c, "k", 1, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.aux_len, 16);
    CHECK(!memcmp(ge.aux, "0123456789abcdef", 16));
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A context instance of tp 2: rank 0 publishes without aux, rank 1 with
 * one (the first non-empty is the request's); on another request rank
 * 1's aux differs from rank 0's: MISMATCH naming publish.aux, and rank 1
 * may publish again with the same bytes. Each COMPLETE carries its
 * request's aux. */
TEST(aux_second_rank_must_match)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs, gs = AUX_GEN;
    rank_t c0, c1, g;
    ctx2_open(d, &M_SMALL, "am-ctx", 8, &cs, &c0, &c1);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g);
    uint32_t bl[2] = {2, 3}, gb[2] = {4, 5};
    kvx_context_params_t p, p1;

    CHECK_KVX(kvx_publish_key(c0.c, "r1", 2, c0.pool, bl, 2, 6, NULL, 0, &p,
                              T_MS),
              c0.c);
    CHECK_KVX(kvx_publish_key(c1.c, "r1", 2, c1.pool, bl, 2, 6, "tok:42", 6,
                              &p1, T_MS),
              c1.c);
    kvx_context_params_free(&p1);
    CHECK_KVX(kvx_fetch_key(g.c, "r1", 2, p.data, p.len, g.pool, gb, 2, 0, 0,
                            T_MS),
              g.c);
    ev_t ge = wait_key(g.c, "r1", 2, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.aux_len, 6);
    CHECK(!memcmp(ge.aux, "tok:42", 6));
    ev_t ce = wait_key(c0.c, "r1", 2, 3000);
    CHECK_EQ(ce.aux_len, 0); /* the context side's events carry none */
    ce = wait_key(c1.c, "r1", 2, 3000);
    CHECK_EQ(ce.aux_len, 0);
    kvx_context_params_free(&p);

    CHECK_KVX(kvx_publish_key(c0.c, "r2", 2, c0.pool, bl, 2, 6, "abc", 3, &p,
                              T_MS),
              c0.c);
    CHECK_FAILS(kvx_publish_key(c1.c, "r2", 2, c1.pool, bl, 2, 6, "abd", 3,
                                &p1, T_MS),
                c1.c, KVX_ERR_MISMATCH, "publish.aux: 3 bytes differ");
    CHECK_KVX(kvx_publish_key(c1.c, "r2", 2, c1.pool, bl, 2, 6, "abc", 3, &p1,
                              T_MS),
              c1.c);
    kvx_context_params_free(&p1);
    CHECK_KVX(kvx_fetch_key(g.c, "r2", 2, p.data, p.len, g.pool, gb, 2, 0, 0,
                            T_MS),
              g.c);
    ge = wait_key(g.c, "r2", 2, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.aux_len, 3);
    CHECK(!memcmp(ge.aux, "abc", 3));
    wait_key(c0.c, "r2", 2, 3000);
    wait_key(c1.c, "r2", 2, 3000);
    kvx_context_params_free(&p);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Events that are not a generation COMPLETE carry no aux: a fetch whose
 * offer is cancelled ends ERROR, a fetch cancelled by its own rank ends
 * CANCELLED, the offers' ends too - all without it. */
TEST(aux_not_on_errors_or_cancels)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs, gs = AUX_GEN;
    rank_t c0, c1, g;
    ctx2_open(d, &M_SMALL, "an-ctx", 8, &cs, &c0, &c1);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g);
    uint32_t bl[2] = {1, 0}, gb[2] = {6, 7};
    kvx_context_params_t p;
    /* rank 1 never publishes: the fetch waits for it */
    CHECK_KVX(kvx_publish_key(c0.c, "e1", 2, c0.pool, bl, 2, 8, "aux", 3, &p,
                              T_MS),
              c0.c);
    CHECK_KVX(kvx_fetch_key(g.c, "e1", 2, p.data, p.len, g.pool, gb, 2, 0, 0,
                            T_MS),
              g.c);
    CHECK_KVX(kvx_cancel_key(c0.c, "e1", 2, T_MS), c0.c);
    ev_t ge = wait_key(g.c, "e1", 2, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_ERROR);
    CHECK_EQ(ge.aux_len, 0);
    ev_t ce = wait_key(c0.c, "e1", 2, 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_CANCELLED);
    CHECK_EQ(ce.aux_len, 0);
    kvx_context_params_free(&p);

    CHECK_KVX(kvx_publish_key(c0.c, "e2", 2, c0.pool, bl, 2, 8, "aux", 3, &p,
                              T_MS),
              c0.c);
    CHECK_KVX(kvx_fetch_key(g.c, "e2", 2, p.data, p.len, g.pool, gb, 2, 0, 0,
                            T_MS),
              g.c);
    CHECK_KVX(kvx_cancel_key(g.c, "e2", 2, T_MS), g.c);
    ge = wait_key(g.c, "e2", 2, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_CANCELLED);
    CHECK_EQ(ge.aux_len, 0);
    ce = wait_key(c0.c, "e2", 2, 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_ERROR);
    CHECK_EQ(ce.aux_len, 0);
    kvx_context_params_free(&p);
    char *json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"aux\":0,");
    free(json);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}
