/*
 * t_layers.c — layer-wise offers (kvx_publish_layerwise, kvx_layers_ready,
 * kvx_fetch_progress): only ready layers move, lowest first; progress;
 * refusals; cancel, lease, fetch timeout and rank death between layers
 * end the request once, with no write after its event.
 */

/* Write the pattern of layers [l0, l1) of tokens [0, ntok) of req. */
static void fill_layers(const rank_t *r, uint64_t req, const uint32_t *blocks,
                        uint32_t ntok, uint32_t l0, uint32_t l1)
{
    const kvx_layout_t *l = &r->lay;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    for (uint32_t t = 0; t < ntok; t++)
        for (uint32_t ly = l0; ly < l1; ly++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t h = 0; h < l->num_heads; h++)
                    row_fill(rank_at(r, r->base, ly, kv,
                                     blocks[t / l->tokens_per_block],
                                     t % l->tokens_per_block, h),
                             rowbytes, req, r->layer0 + ly, kv, t,
                             r->head0 + h);
}

/* Rows of tokens [t0, t1) of layers [l0, l1) of the destination that
 * hold the pattern of req (want 1) or the sentinel byte (want 0): the
 * number that do not. */
static uint32_t tokens_hold(const rank_t *g, uint64_t req,
                            const uint32_t *blocks, uint32_t t0, uint32_t t1,
                            uint32_t l0, uint32_t l1, int want,
                            uint8_t sentinel)
{
    const kvx_layout_t *l = &g->lay;
    uint32_t rowbytes = l->head_dim * l->elem_size, bad = 0;
    uint8_t row[1024], sent[1024];
    memset(sent, sentinel, sizeof(sent));
    for (uint32_t t = t0; t < t1; t++)
        for (uint32_t ly = l0; ly < l1; ly++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t h = 0; h < l->num_heads; h++) {
                    const uint8_t *at = rank_at(g, g->base, ly, kv,
                                                blocks[t / l->tokens_per_block],
                                                t % l->tokens_per_block, h);
                    row_fill(row, rowbytes, req, g->layer0 + ly, kv, t,
                             g->head0 + h);
                    bad += memcmp(at, want ? row : sent, rowbytes) != 0;
                }
    return bad;
}

static uint32_t layers_hold(const rank_t *g, uint64_t req,
                            const uint32_t *blocks, uint32_t ntok, uint32_t l0,
                            uint32_t l1, int want, uint8_t sentinel)
{
    return tokens_hold(g, req, blocks, 0, ntok, l0, l1, want, sentinel);
}

/* Until tokens [t0, t1) of layers [l0, l1) hold req's pattern (3 s):
 * the rows that still do not. */
static uint32_t tokens_arrive(const rank_t *g, uint64_t req,
                              const uint32_t *blocks, uint32_t t0, uint32_t t1,
                              uint32_t l0, uint32_t l1)
{
    uint32_t bad;
    int64_t end = now_ms() + 3000;
    while ((bad = tokens_hold(g, req, blocks, t0, t1, l0, l1, 1, 0)) &&
           now_ms() < end)
        sleep_ms(5);
    return bad;
}

/* Write the pattern of tokens [t0, t1) of layers [l0, l1) of req. */
static void fill_tokens(const rank_t *r, uint64_t req, const uint32_t *blocks,
                        uint32_t t0, uint32_t t1, uint32_t l0, uint32_t l1)
{
    const kvx_layout_t *l = &r->lay;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    for (uint32_t t = t0; t < t1; t++)
        for (uint32_t ly = l0; ly < l1; ly++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t h = 0; h < l->num_heads; h++)
                    row_fill(rank_at(r, r->base, ly, kv,
                                     blocks[t / l->tokens_per_block],
                                     t % l->tokens_per_block, h),
                             rowbytes, req, r->layer0 + ly, kv, t,
                             r->head0 + h);
}

/* The generation rank's pool to the sentinel, a layer-wise publish of
 * ck (blocks cb) and the fetch of it as ck + "g" (blocks gb). */
static void lw_open(const rank_t *c, const rank_t *g, const char *ck,
                    const uint32_t *cb, const uint32_t *gb, uint32_t nb,
                    uint32_t ntok, kvx_context_params_t *p)
{
    char gk[64];
    snprintf(gk, sizeof(gk), "%sg", ck);
    memset(g->base, 0xa5, g->size);
    CHECK_KVX(kvx_publish_layerwise(c->c, ck, strlen(ck), c->pool, cb, nb, ntok,
                                    NULL, 0, p, T_MS),
              c->c);
    CHECK_KVX(kvx_fetch_key(g->c, gk, strlen(gk), p->data, p->len, g->pool, gb,
                            nb, 0, 0, T_MS),
              g->c);
}

/* kvx_fetch_progress until layers_done >= n (or 3 s): the last seen. */
static uint32_t progress_reaches(const rank_t *g, const char *key, uint32_t n)
{
    uint32_t done = 0, total = 0;
    int ended = 0;
    int64_t end = now_ms() + 3000;
    do {
        CHECK_KVX(kvx_fetch_progress(g->c, key, strlen(key), &done, &total,
                                     &ended, T_MS),
                  g->c);
        if (done >= n)
            break;
        sleep_ms(5);
    } while (now_ms() < end);
    return done;
}

/* Layers move as the context rank says they are ready, and only then:
 * each layer's source bytes are written just before its layers_ready, so
 * a copy made early would carry the old bytes. A layer ready out of
 * order moves at once; progress counts the leading layers. */
TEST(layerwise_moves_ready_layers_only)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lw-ctx", "lw-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    memset(c.base, 0x11, c.size); /* no layer's KV yet */
    const char *k = "lw-1", *gk = "lw-1g";
    uint32_t cb[3] = {5, 0, 7}, gb[3] = {2, 6, 4};
    const uint32_t ntok = 10, req = 71;
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_layerwise(c.c, k, strlen(k), c.pool, cb, 3, ntok,
                                    NULL, 0, &p, T_MS),
              c.c);
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK_STR_CONTAINS(json, "\"key\":\"lw-1\"");
    free(json);
    CHECK_KVX(kvx_fetch_key(g.c, gk, strlen(gk), p.data, p.len, g.pool, gb, 3,
                            0, 0, T_MS),
              g.c);
    uint32_t done = 9, total = 0;
    int ended = 1;
    CHECK_KVX(
        kvx_fetch_progress(g.c, gk, strlen(gk), &done, &total, &ended, T_MS),
        g.c);
    CHECK_EQ(done, 0);
    CHECK_EQ(total, 4);
    CHECK_EQ(ended, 0);
    ev_t e[4];
    CHECK_EQ(collect(g.c, e, 4, 1, 200), 0); /* waits for layers */
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 0, 4, 0, 0xa5), 0);

    fill_layers(&c, req, cb, ntok, 0, 1);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 0, 1, NULL, T_MS), c.c);
    CHECK_EQ(progress_reaches(&g, gk, 1), 1);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 0, 1, 1, 0xa5), 0);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 1, 4, 0, 0xa5), 0);

    /* layer 2 before layer 1: it moves, layer 1 and 3 do not, and the
     * progress counts the leading layers only */
    fill_layers(&c, req, cb, ntok, 2, 3);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 2, 1, NULL, T_MS), c.c);
    CHECK_EQ(tokens_arrive(&g, req, gb, 0, ntok, 2, 3), 0);
    CHECK_EQ(progress_reaches(&g, gk, 1), 1);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 1, 2, 0, 0xa5), 0);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 3, 4, 0, 0xa5), 0);
    fill_layers(&c, req, cb, ntok, 1, 2);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 1, 1, NULL, T_MS), c.c);
    CHECK_EQ(progress_reaches(&g, gk, 3), 3);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 3, 4, 0, 0xa5), 0);
    /* a layer said twice stays ready */
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 1, 2, NULL, T_MS), c.c);

    fill_layers(&c, req, cb, ntok, 3, 4);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 3, 1, NULL, T_MS), c.c);
    ev_t ge = wait_key(g.c, gk, strlen(gk), 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    ev_t ce = wait_key(c.c, k, strlen(k), 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = req, .blocks = gb, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    /* ended: nothing left to ask about */
    CHECK_FAILS(
        kvx_fetch_progress(g.c, gk, strlen(gk), &done, &total, NULL, T_MS), g.c,
        KVX_ERR_NOT_FOUND, "fetch_progress: no fetch of request");
    /* complete: a late mark is no error (nothing is left to mark) */
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 0, 1, NULL, T_MS), c.c);
    kvx_context_params_free(&p);

    /* all layers ready before the fetch comes: it moves at once */
    fill_layers(&c, req + 1, cb, ntok, 0, 4);
    CHECK_KVX(kvx_publish_layerwise(c.c, "lw-2", 4, c.pool, cb, 3, ntok, NULL,
                                    0, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_layers_ready(c.c, "lw-2", 4, 0, 4, NULL, T_MS), c.c);
    memset(g.base, 0xa5, g.size);
    CHECK_KVX(kvx_fetch_key(g.c, "lw-2g", 5, p.data, p.len, g.pool, gb, 3, 0, 0,
                            T_MS),
              g.c);
    CHECK_EQ(wait_key(g.c, "lw-2g", 5, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "lw-2", 4, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex2 = {.req = req + 1, .blocks = gb, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex2, 1, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Each context rank says its own layers: with the heads split over two
 * ranks (tp 2), a destination layer lands once both ranks have it. */
TEST(layerwise_two_context_ranks)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs, gs = {.inst = "lw2-gen",
                     .role = KVX_ROLE_GENERATION,
                     .tp = 1,
                     .pp = 1,
                     .preset = "flashinfer",
                     .tpb = 8};
    rank_t c0, c1, g;
    ctx2_open(d, &M_SMALL, "lw2-ctx", 8, &cs, &c0, &c1);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[3] = {1, 4, 2}, gb[2] = {5, 3};
    const uint32_t ntok = 12, req = 72;
    kvx_context_params_t p0, p1;
    CHECK_KVX(kvx_publish_layerwise(c0.c, "lw2", 3, c0.pool, cb, 3, ntok, NULL,
                                    0, &p0, T_MS),
              c0.c);
    CHECK_KVX(kvx_publish_layerwise(c1.c, "lw2", 3, c1.pool, cb, 3, ntok, NULL,
                                    0, &p1, T_MS),
              c1.c);
    CHECK_KVX(kvx_fetch_key(g.c, "lw2g", 4, p0.data, p0.len, g.pool, gb, 2, 0,
                            0, T_MS),
              g.c);
    fill_layers(&c0, req, cb, ntok, 0, 4);
    CHECK_KVX(kvx_layers_ready(c0.c, "lw2", 3, 0, 4, NULL, T_MS), c0.c);
    sleep_ms(150);
    CHECK_EQ(progress_reaches(&g, "lw2g", 0), 0); /* rank 1 has none */
    fill_layers(&c1, req, cb, ntok, 0, 2);
    CHECK_KVX(kvx_layers_ready(c1.c, "lw2", 3, 0, 2, NULL, T_MS), c1.c);
    CHECK_EQ(progress_reaches(&g, "lw2g", 2), 2);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 0, 2, 1, 0xa5), 0);
    fill_layers(&c1, req, cb, ntok, 2, 4);
    CHECK_KVX(kvx_layers_ready(c1.c, "lw2", 3, 2, 2, NULL, T_MS), c1.c);
    CHECK_EQ(wait_key(g.c, "lw2g", 4, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c0.c, "lw2", 3, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c1.c, "lw2", 3, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = req, .blocks = gb, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p0);
    kvx_context_params_free(&p1);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A ready mark for an offer whose transfer has finished is not an error:
 * layers_ready, tokens_ready and append_blocks answer 0 once the offer is
 * complete, as engines send them in normal use. With replicated heads
 * (MLA, tp 2 over one latent head) the consumer reads rank 0 alone: the
 * request completes before rank 1 publishes, and rank 1's marks come
 * after. A chunked prefill's last marks may come after the fetch too. A
 * key never published is still NOT_FOUND, for all three. */
TEST(layerwise_marks_after_the_transfer)
{
    daemon_t *d = daemon_start(NULL);
    model_t mla = {.layers = 2,
                   .heads = 1,
                   .head_dim = 32,
                   .kv = 1,
                   .dtype = KVX_DTYPE_BF16};
    side_t cs = {.inst = "lm-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 2,
                 .pp = 1,
                 .preset = "mla",
                 .tpb = 4};
    side_t gs = {.inst = "lm-gen",
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
    const uint32_t ntok = 7, req = 9;
    fill_req(&c0, req, bl, ntok);
    fill_req(&c1, req, bl, ntok);
    kvx_context_params_t p0, p1;
    CHECK_KVX(kvx_publish_layerwise(c0.c, "lm", 2, c0.pool, bl, 1, ntok, NULL,
                                    0, &p0, T_MS),
              c0.c);
    CHECK_KVX(kvx_fetch_key(g.c, "lmg", 3, p0.data, p0.len, g.pool, bl, 2, 0, 0,
                            T_MS),
              g.c);
    CHECK_KVX(kvx_append_blocks(c0.c, "lm", 2, c0.pool, bl + 1, 1, T_MS), c0.c);
    CHECK_KVX(kvx_tokens_ready(c0.c, "lm", 2, 0, 2, ntok, NULL, T_MS), c0.c);
    CHECK_EQ(wait_key(g.c, "lmg", 3, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = req, .blocks = bl, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    /* rank 0's marks after the end of its transfer */
    CHECK_EQ(wait_key(c0.c, "lm", 2, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_KVX(kvx_layers_ready(c0.c, "lm", 2, 0, 2, NULL, T_MS), c0.c);
    CHECK_KVX(kvx_tokens_ready(c0.c, "lm", 2, 0, 2, ntok, NULL, T_MS), c0.c);
    CHECK_KVX(kvx_append_blocks(c0.c, "lm", 2, c0.pool, bl + 1, 1, T_MS), c0.c);
    /* rank 1 publishes late (the params of the same offer), then marks */
    CHECK_KVX(kvx_publish_layerwise(c1.c, "lm", 2, c1.pool, bl, 1, ntok, NULL,
                                    0, &p1, T_MS),
              c1.c);
    CHECK(p1.len == p0.len && memcmp(p1.data, p0.data, p0.len) == 0);
    CHECK_KVX(kvx_append_blocks(c1.c, "lm", 2, c1.pool, bl + 1, 1, T_MS), c1.c);
    CHECK_KVX(kvx_tokens_ready(c1.c, "lm", 2, 0, 1, 4, NULL, T_MS), c1.c);
    CHECK_KVX(kvx_layers_ready(c1.c, "lm", 2, 0, 2, NULL, T_MS), c1.c);
    /* a key never published: NOT_FOUND, for all three */
    CHECK_FAILS(kvx_layers_ready(c1.c, "lx", 2, 0, 2, NULL, T_MS), c1.c,
                KVX_ERR_NOT_FOUND, "layers_ready: no offer of request lx");
    CHECK_FAILS(kvx_tokens_ready(c1.c, "lx", 2, 0, 2, 4, NULL, T_MS), c1.c,
                KVX_ERR_NOT_FOUND, "layers_ready: no offer of request lx");
    CHECK_FAILS(kvx_append_blocks(c1.c, "lx", 2, c1.pool, bl, 1, T_MS), c1.c,
                KVX_ERR_NOT_FOUND, "append_blocks: no offer of request lx");
    /* the request's one event, from its end, and no other */
    ev_t ev[4];
    CHECK_EQ(collect(c1.c, ev, 4, 2, 300), 1);
    CHECK_EQ(ev[0].kind, KVX_EVENT_COMPLETE);
    kvx_context_params_free(&p0);
    kvx_context_params_free(&p1);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A key whose offer completed, published again and ended by its lease:
 * a mark after that end is NOT_FOUND again (the later end is the one its
 * event told), not 0 from the earlier completion. */
TEST(layerwise_mark_after_a_later_end)
{
    daemon_t *d = daemon_start("deadlines:\n  offer_lease_ms: 300\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "le-ctx", "le-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[2] = {1, 2}, gb[2] = {3, 4};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_layerwise(c.c, "le", 2, c.pool, cb, 2, 7, NULL, 0, &p,
                                    T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "leg", 3, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    CHECK_KVX(kvx_layers_ready(c.c, "le", 2, 0, 4, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "leg", 3, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "le", 2, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_KVX(kvx_layers_ready(c.c, "le", 2, 0, 4, NULL, T_MS), c.c);
    kvx_context_params_free(&p);
    /* again, fetched by nobody: the lease ends it */
    CHECK_KVX(kvx_publish_layerwise(c.c, "le", 2, c.pool, cb, 2, 7, NULL, 0, &p,
                                    T_MS),
              c.c);
    CHECK_EQ(wait_key(c.c, "le", 2, 3000).kind, KVX_EVENT_TIMED_OUT);
    CHECK_FAILS(kvx_layers_ready(c.c, "le", 2, 0, 4, NULL, T_MS), c.c,
                KVX_ERR_NOT_FOUND, "layers_ready: no offer of request le");
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* What layers_ready and fetch_progress refuse, each naming the problem. */
TEST(layerwise_refusals)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lwr-ctx", "lwr-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[2] = {1, 2};
    kvx_context_params_t p, q;
    uint32_t done, total;
    CHECK_FAILS(kvx_layers_ready(c.c, "nope", 4, 0, 1, NULL, T_MS), c.c,
                KVX_ERR_NOT_FOUND, "layers_ready: no offer of request nope");
    CHECK_KVX(
        kvx_publish_key(c.c, "whole", 5, c.pool, cb, 2, 6, NULL, 0, &p, T_MS),
        c.c);
    CHECK_FAILS(kvx_layers_ready(c.c, "whole", 5, 0, 1, NULL, T_MS), c.c,
                KVX_ERR_STATE, "was published whole");
    CHECK_KVX(kvx_publish_layerwise(c.c, "lwr", 3, c.pool, cb, 2, 6, NULL, 0,
                                    &q, T_MS),
              c.c);
    CHECK_FAILS(kvx_layers_ready(c.c, "lwr", 3, 4, 1, NULL, T_MS), c.c,
                KVX_ERR_INVALID, "layers [4, 5) are not inside this rank's 4");
    CHECK_FAILS(kvx_layers_ready(c.c, "lwr", 3, 2, 3, NULL, T_MS), c.c,
                KVX_ERR_INVALID, "layers [2, 5) are not inside");
    CHECK_FAILS(kvx_layers_ready(c.c, "lwr", 3, 0, 0, NULL, T_MS), c.c,
                KVX_ERR_INVALID, "count 0");
    uint8_t ev[64] = {0};
    CHECK_FAILS(kvx_layers_ready(c.c, "lwr", 3, 0, 1, ev, T_MS), c.c,
                KVX_ERR_INVALID, "is host memory");
    CHECK_FAILS(kvx_layers_ready(g.c, "lwr", 3, 0, 1, NULL, T_MS), g.c,
                KVX_ERR_STATE, "role generation");
    CHECK_FAILS(kvx_fetch_progress(g.c, "x", 1, &done, &total, NULL, T_MS), g.c,
                KVX_ERR_NOT_FOUND, "fetch_progress: no fetch of request x");
    CHECK_FAILS(kvx_fetch_progress(c.c, "x", 1, &done, &total, NULL, T_MS), c.c,
                KVX_ERR_STATE, "role context");
    CHECK_FAILS(kvx_fetch_progress(g.c, "x", 1, NULL, &total, NULL, T_MS), g.c,
                KVX_ERR_INVALID, "NULL");
    /* a rank of the instance that did not publish the key */
    kvx_context_params_free(&p);
    kvx_context_params_free(&q);
    CHECK_KVX(kvx_cancel_key(c.c, "whole", 5, T_MS), c.c);
    CHECK_KVX(kvx_cancel_key(c.c, "lwr", 3, T_MS), c.c);
    CHECK_FAILS(kvx_layers_ready(c.c, "lwr", 3, 0, 1, NULL, T_MS), c.c,
                KVX_ERR_CANCELLED, "layers_ready: request lwr was cancelled");
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Faults between layers end the request once, with its one event on each
 * side, and nothing lands after it: the fetch cancelled, the context
 * rank cancelling, the context rank gone, the fetch's timeout, the
 * offer's lease. */
TEST(layerwise_faults_between_layers)
{
    daemon_t *d = daemon_start("deadlines:\n  offer_lease_ms: 400\n"
                               "  fetch_timeout_ms: 600\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lwf-ctx", "lwf-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[2] = {3, 1}, gb[2] = {0, 5};
    const uint32_t ntok = 7, req = 73;
    kvx_context_params_t p;

    /* 1. the generation side cancels after layer 0 */
    lw_open(&c, &g, "f1", cb, gb, 2, ntok, &p);
    fill_layers(&c, req, cb, ntok, 0, 4);
    CHECK_KVX(kvx_layers_ready(c.c, "f1", 2, 0, 1, NULL, T_MS), c.c);
    CHECK_EQ(progress_reaches(&g, "f1g", 1), 1);
    CHECK_KVX(kvx_cancel_key(g.c, "f1g", 3, T_MS), g.c);
    CHECK_EQ(wait_key(g.c, "f1g", 3, 3000).kind, KVX_EVENT_CANCELLED);
    ev_t ce = wait_key(c.c, "f1", 2, 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_ERROR);
    CHECK_EQ(ce.code, KVX_ERR_CANCELLED);
    kvx_layers_ready(c.c, "f1", 2, 1, 3, NULL, T_MS); /* too late */
    sleep_ms(100);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 0, 1, 1, 0xa5), 0);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 1, 4, 0, 0xa5), 0);
    kvx_context_params_free(&p);

    /* 2. the context rank cancels after layer 1 */
    lw_open(&c, &g, "f2", cb, gb, 2, ntok, &p);
    CHECK_KVX(kvx_layers_ready(c.c, "f2", 2, 0, 2, NULL, T_MS), c.c);
    CHECK_EQ(progress_reaches(&g, "f2g", 2), 2);
    CHECK_KVX(kvx_cancel_key(c.c, "f2", 2, T_MS), c.c);
    CHECK_EQ(wait_key(c.c, "f2", 2, 3000).kind, KVX_EVENT_CANCELLED);
    ev_t ge = wait_key(g.c, "f2g", 3, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_ERROR);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 2, 4, 0, 0xa5), 0);
    kvx_context_params_free(&p);

    /* 3. the fetch's timeout while it waits for layer 2 */
    lw_open(&c, &g, "f3", cb, gb, 2, ntok, &p);
    CHECK_KVX(kvx_layers_ready(c.c, "f3", 2, 0, 2, NULL, T_MS), c.c);
    ge = wait_key(g.c, "f3g", 3, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_TIMED_OUT);
    ce = wait_key(c.c, "f3", 2, 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_ERROR);
    CHECK_EQ(ce.code, KVX_ERR_TIMED_OUT);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 0, 2, 1, 0xa5), 0);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 2, 4, 0, 0xa5), 0);
    kvx_context_params_free(&p);

    /* 4. no fetch, no layers: the offer's lease */
    CHECK_KVX(kvx_publish_layerwise(c.c, "f4", 2, c.pool, cb, 2, ntok, NULL, 0,
                                    &p, T_MS),
              c.c);
    CHECK_EQ(wait_key(c.c, "f4", 2, 3000).kind, KVX_EVENT_TIMED_OUT);
    kvx_context_params_free(&p);

    /* 5. the context rank goes after layer 0 */
    lw_open(&c, &g, "f5", cb, gb, 2, ntok, &p);
    CHECK_KVX(kvx_layers_ready(c.c, "f5", 2, 0, 1, NULL, T_MS), c.c);
    CHECK_EQ(progress_reaches(&g, "f5g", 1), 1);
    rank_close(&c);
    ge = wait_key(g.c, "f5g", 3, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_ERROR);
    CHECK_EQ(ge.code, KVX_ERR_PEER_GONE);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 1, 4, 0, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A chunked prefill: the publish gives the first chunk's blocks, each
 * chunk's tokens become ready layer by layer, the next chunk's blocks
 * are appended; a fetch copies each layer's tokens as they are ready,
 * never ahead of them. */
TEST(layerwise_chunked_prefill)
{
    daemon_t *d = daemon_start("deadlines:\n  fetch_timeout_ms: 1500\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "ch-ctx", "ch-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    memset(c.base, 0x11, c.size);
    /* 16 tokens of 4 a block: chunks of 8 tokens (2 blocks) */
    uint32_t cb[4] = {6, 1, 4, 3}, gb[4] = {2, 7, 0, 5};
    const uint32_t ntok = 16, req = 74;
    kvx_context_params_t p;
    CHECK_FAILS(
        kvx_publish_key(c.c, "chx", 3, c.pool, cb, 2, ntok, NULL, 0, &p, T_MS),
        c.c, KVX_ERR_INVALID, "cannot hold num_tokens 16");
    CHECK_KVX(kvx_publish_layerwise(c.c, "ch", 2, c.pool, cb, 2, ntok, NULL, 0,
                                    &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "chg", 3, p.data, p.len, g.pool, gb, 4, 0, 0, T_MS),
        g.c);
    CHECK_FAILS(kvx_tokens_ready(c.c, "ch", 2, 0, 4, 9, NULL, T_MS), c.c,
                KVX_ERR_INVALID, "9 tokens lie in 3 blocks; 2 appended");
    CHECK_FAILS(kvx_tokens_ready(c.c, "ch", 2, 0, 4, 17, NULL, T_MS), c.c,
                KVX_ERR_INVALID, "17, more than the request's 16");
    /* chunk 1, layers 0 and 1 */
    fill_tokens(&c, req, cb, 0, 8, 0, 2);
    CHECK_KVX(kvx_tokens_ready(c.c, "ch", 2, 0, 2, 8, NULL, T_MS), c.c);
    CHECK_EQ(tokens_arrive(&g, req, gb, 0, 8, 0, 2), 0);
    CHECK_EQ(tokens_hold(&g, req, gb, 0, 8, 2, 4, 0, 0xa5), 0);
    CHECK_EQ(tokens_hold(&g, req, gb, 8, 16, 0, 4, 0, 0xa5), 0);
    /* chunk 1, layers 2 and 3 */
    fill_tokens(&c, req, cb, 0, 8, 2, 4);
    CHECK_KVX(kvx_tokens_ready(c.c, "ch", 2, 2, 2, 8, NULL, T_MS), c.c);
    CHECK_EQ(tokens_arrive(&g, req, gb, 0, 8, 2, 4), 0);
    uint32_t done, total;
    CHECK_KVX(kvx_fetch_progress(g.c, "chg", 3, &done, &total, NULL, T_MS),
              g.c);
    CHECK_EQ(done, 0); /* no layer is whole */
    /* chunk 2: its blocks, refused ones first */
    uint32_t dup[1] = {1}, more[3] = {4, 3, 5};
    CHECK_FAILS(kvx_append_blocks(c.c, "ch", 2, c.pool, dup, 1, T_MS), c.c,
                KVX_ERR_INVALID, "block 1 is already one of request ch's");
    CHECK_FAILS(kvx_append_blocks(c.c, "ch", 2, c.pool, more, 3, T_MS), c.c,
                KVX_ERR_INVALID, "3 more, but request ch holds 4 blocks");
    CHECK_KVX(kvx_append_blocks(c.c, "ch", 2, c.pool, cb + 2, 2, T_MS), c.c);
    fill_tokens(&c, req, cb, 8, 16, 0, 4);
    CHECK_KVX(kvx_tokens_ready(c.c, "ch", 2, 0, 4, 16, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "chg", 3, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "ch", 2, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = req, .blocks = gb, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p);

    /* a chunk that never comes: the fetch's deadline; nothing of it
     * lands */
    memset(g.base, 0xa5, g.size);
    CHECK_KVX(kvx_publish_layerwise(c.c, "ch2", 3, c.pool, cb, 2, ntok, NULL, 0,
                                    &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "ch2g", 4, p.data, p.len, g.pool, gb, 4, 0, 0, T_MS),
        g.c);
    CHECK_KVX(kvx_tokens_ready(c.c, "ch2", 3, 0, 4, 8, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "ch2g", 4, 5000).kind, KVX_EVENT_TIMED_OUT);
    CHECK_EQ(wait_key(c.c, "ch2", 3, 3000).kind, KVX_EVENT_ERROR);
    CHECK_EQ(tokens_hold(&g, req, gb, 8, 16, 0, 4, 0, 0xa5), 0);
    kvx_context_params_free(&p);
    /* whole offers take no blocks later */
    CHECK_KVX(kvx_publish_key(c.c, "whole", 5, c.pool, cb, 4, ntok, NULL, 0, &p,
                              T_MS),
              c.c);
    CHECK_FAILS(kvx_append_blocks(c.c, "whole", 5, c.pool, more, 1, T_MS), c.c,
                KVX_ERR_STATE, "was published whole");
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A generation rank asleep in its poll (kvx_poll, at_least 1) with a
 * spin set is woken early (Poll.early) when the last layer's copies go
 * out to a copy thread: its poll comes back with the COMPLETE event
 * itself, never an empty batch, and the daemon counts the early answer
 * (polls_woken_early); every byte lands. Without a spin the poll asks
 * for no early answer. */
typedef struct lw_poller {
    kvx_client_t *c;
    kvx_batch_t *b;
    int rc;
} lw_poller_t;

static void *lw_poll_main(void *arg)
{
    lw_poller_t *p = arg;
    p->rc = kvx_poll(p->c, 1, 5000, &p->b);
    return NULL;
}

TEST(layerwise_sleeping_poll_woken_early)
{
    /* the copies on a copy thread: a job run on the loop ends in the
     * same turn, and its event needs no early answer */
    daemon_t *d = daemon_start("copy:\n  inline_bytes: 0\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "le-ctx", "le-gen", 8, &c, &g, &cs, &gs);
    CHECK_KVX(kvx_set_spin_us(g.c, 100), g.c);
    memset(g.base, 0xa5, g.size);
    const char *k = "le-1", *gk = "le-1g";
    uint32_t cb[3] = {1, 3, 5}, gb[3] = {6, 2, 0};
    const uint32_t ntok = 11, req = 81;
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_layerwise(c.c, k, strlen(k), c.pool, cb, 3, ntok,
                                    NULL, 0, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_fetch_key(g.c, gk, strlen(gk), p.data, p.len, g.pool, gb, 3,
                            0, 0, T_MS),
              g.c);
    fill_layers(&c, req, cb, ntok, 0, 3);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 0, 3, NULL, T_MS), c.c);
    CHECK_EQ(progress_reaches(&g, gk, 3), 3);
    lw_poller_t pl = {.c = g.c};
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, lw_poll_main, &pl), 0);
    usleep(200 * 1000); /* its poll waits in the daemon, asleep */
    fill_layers(&c, req, cb, ntok, 3, 4);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 3, 1, NULL, T_MS), c.c);
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_KVX(pl.rc, g.c);
    CHECK_EQ(pl.b->num_events, 1);
    CHECK_EQ(pl.b->events[0].kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(pl.b->events[0].key_len, strlen(gk));
    CHECK(!memcmp(pl.b->events[0].key, gk, strlen(gk)));
    kvx_batch_free(pl.b);
    CHECK_EQ(wait_key(c.c, k, strlen(k), 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = req, .blocks = gb, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    char *json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"polls_woken_early\":1,");
    free(json);
    kvx_context_params_free(&p);
    /* without a spin the poll asks for nothing early: the count stays */
    CHECK_KVX(kvx_set_spin_us(g.c, 0), g.c);
    fill_layers(&c, req + 1, cb, ntok, 0, 4);
    CHECK_KVX(kvx_publish_layerwise(c.c, "le-2", 4, c.pool, cb, 3, ntok, NULL,
                                    0, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_fetch_key(g.c, "le-2g", 5, p.data, p.len, g.pool, gb, 3, 0, 0,
                            T_MS),
              g.c);
    pl = (lw_poller_t){.c = g.c};
    CHECK_EQ(pthread_create(&th, NULL, lw_poll_main, &pl), 0);
    usleep(100 * 1000);
    CHECK_KVX(kvx_layers_ready(c.c, "le-2", 4, 0, 4, NULL, T_MS), c.c);
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_KVX(pl.rc, g.c);
    CHECK_EQ(pl.b->num_events, 1);
    kvx_batch_free(pl.b);
    json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"polls_woken_early\":1,");
    free(json);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A fetch's last copies held by copy.pace are not "one copy away": the
 * sleeping poll of a spinning client is not answered early (Poll.early,
 * after which it would spin 20 ms while the copies wait); its event
 * comes once a reload lifts the pace, every byte in place. */
TEST(layerwise_paced_last_layer_wakes_no_poll_early)
{
    daemon_t *d = daemon_start("copy:\n  inline_bytes: 0\n  chunk_bytes: "
                               "4KiB\n  max_inflight_chunks: 64\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lp-ctx", "lp-gen", 8, &c, &g, &cs, &gs);
    CHECK_KVX(kvx_set_spin_us(g.c, 100), g.c);
    memset(g.base, 0xa5, g.size);
    const char *k = "lp-1", *gk = "lp-1g";
    uint32_t cb[3] = {1, 3, 5}, gb[3] = {6, 2, 0};
    const uint32_t ntok = 11, req = 91;
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_layerwise(c.c, k, strlen(k), c.pool, cb, 3, ntok,
                                    NULL, 0, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_fetch_key(g.c, gk, strlen(gk), p.data, p.len, g.pool, gb, 3,
                            0, 0, T_MS),
              g.c);
    fill_layers(&c, req, cb, ntok, 0, 2);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 0, 2, NULL, T_MS), c.c);
    CHECK_EQ(progress_reaches(&g, gk, 2), 2);
    /* 4 KiB chunks at a byte a millisecond: 4 s each; the first of
     * the last two layers starts, the others wait */
    pace_reload(d, "  inline_bytes: 0\n  chunk_bytes: 4KiB\n  "
                   "max_inflight_chunks: 64\n  pace: 1\n");
    lw_poller_t pl = {.c = g.c};
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, lw_poll_main, &pl), 0);
    usleep(200 * 1000); /* its poll waits in the daemon, asleep */
    fill_layers(&c, req, cb, ntok, 2, 4);
    CHECK_KVX(kvx_layers_ready(c.c, k, strlen(k), 2, 2, NULL, T_MS), c.c);
    usleep(300 * 1000);
    unsigned held;
    CHECK(paced_of(d, &held) > 0 && held > 0);
    char *json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"polls_woken_early\":0,");
    free(json);
    pace_reload(
        d,
        "  inline_bytes: 0\n  chunk_bytes: 4KiB\n  max_inflight_chunks: 64\n");
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_KVX(pl.rc, g.c);
    CHECK_EQ(pl.b->num_events, 1);
    CHECK_EQ(pl.b->events[0].kind, KVX_EVENT_COMPLETE);
    kvx_batch_free(pl.b);
    CHECK_EQ(wait_key(c.c, k, strlen(k), 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = req, .blocks = gb, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}
