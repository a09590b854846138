/*
 * t_groups.c — requests with several block tables (kvx_publish_groups,
 * kvx_fetch_groups): a sliding-window KV group and a state slot move
 * with the KV from TP 2 to TP 1, every byte of every pool checked;
 * refusals name the group; a cancel before the sources are there writes
 * nothing in any group.
 */

/* The other groups of the hybrid model: two sliding-window layers of
 * their own shape, and two layers of per-request state (tokens_per_block
 * 1, one K/V-less "head" per TP unit of the state). */
static const model_t M_SWA = {
    .layers = 2, .heads = 4, .head_dim = 16, .kv = 2, .dtype = KVX_DTYPE_BF16};
static const model_t M_STATE = {
    .layers = 2, .heads = 4, .head_dim = 64, .kv = 1, .dtype = KVX_DTYPE_FP32};

/* A pool of another group for rank r, on r's connection: *out is r with
 * the group's model and side (sd: r's side with the group's
 * tokens_per_block). */
static void group_pool(const rank_t *r, const model_t *m, side_t *sd,
                       uint32_t tpb, uint32_t nblocks, rank_t *out)
{
    *sd = *r->s;
    sd->tpb = tpb;
    *out = *r;
    out->m = m;
    out->s = sd;
    rank_share(out);
    rank_pool(out, nblocks);
}

typedef struct hybrid {
    side_t cs, gs, csd[2][2], gsd[2];
    rank_t c[2], g;      /* the KV */
    rank_t cw[2], gw;    /* the sliding-window group */
    rank_t cst[2], gst;  /* the state slots */
} hybrid_t;

/* Context TP 2 and generation TP 1, each rank with its three pools. */
static void hybrid_open(daemon_t *d, hybrid_t *h, const char *ci,
                        const char *gi)
{
    ctx2_open(d, &M_SMALL, ci, 8, &h->cs, &h->c[0], &h->c[1]);
    h->gs = (side_t){.inst = gi,
                     .role = KVX_ROLE_GENERATION,
                     .tp = 1,
                     .pp = 1,
                     .preset = "vllm-nhd",
                     .tpb = 4};
    rank_open(d, &M_SMALL, &h->gs, 0, 8, &h->g);
    for (int r = 0; r < 2; r++) {
        group_pool(&h->c[r], &M_SWA, &h->csd[r][0], 4, 8, &h->cw[r]);
        group_pool(&h->c[r], &M_STATE, &h->csd[r][1], 1, 4, &h->cst[r]);
    }
    group_pool(&h->g, &M_SWA, &h->gsd[0], 4, 8, &h->gw);
    group_pool(&h->g, &M_STATE, &h->gsd[1], 1, 4, &h->gst);
    memset(h->g.base, 0xa5, h->g.size);
    memset(h->gw.base, 0xa5, h->gw.size);
    memset(h->gst.base, 0xa5, h->gst.size);
}

static void hybrid_close(hybrid_t *h)
{
    rank_close(&h->c[0]);
    rank_close(&h->c[1]);
    rank_close(&h->g);
}

#define HY_TOK 11u /* 3 blocks of 4 */

/* Context rank r's tables: the KV (3 blocks), the window's last two
 * blocks (first_block 1: tokens [4, 11)), its state slot. */
static const uint32_t hy_cb[2][3] = {{5, 0, 7}, {1, 6, 2}};
static const uint32_t hy_cw[2][3] = {{4, 3, 6}, {7, 0, 5}}; /* [0] unused */
static const uint32_t hy_cs[2] = {3, 1};
static const uint32_t hy_gb[3] = {2, 6, 4}, hy_gw[3] = {0, 5, 1}, hy_gs = 2;

/* Context rank r's other tables: the window's last two blocks and its
 * state slot. */
static void hy_ctx_groups(const hybrid_t *h, int r, kvx_group_t gs[2])
{
    gs[0] = (kvx_group_t){.pool_id = h->cw[r].pool,
                          .blocks = hy_cw[r] + 1,
                          .num_blocks = 2,
                          .num_tokens = HY_TOK,
                          .first_block = 1};
    gs[1] = (kvx_group_t){.pool_id = h->cst[r].pool,
                          .blocks = &hy_cs[r],
                          .num_blocks = 1,
                          .num_tokens = 1};
}

/* The generation rank's other tables: the window from block 1, skipping
 * wskip tokens, and its state slot. */
static void hy_gen_groups(const hybrid_t *h, uint32_t wskip, kvx_group_t gs[2])
{
    gs[0] = (kvx_group_t){.pool_id = h->gw.pool,
                          .blocks = hy_gw + 1,
                          .num_blocks = 2,
                          .first_block = 1,
                          .skip_tokens = wskip};
    gs[1] = (kvx_group_t){
        .pool_id = h->gst.pool, .blocks = &hy_gs, .num_blocks = 1};
}

/* Rank r publishes req's KV, window and state (the patterns written
 * first: the window's tokens [0, 4) too, in a block it does not offer). */
static int hybrid_publish(hybrid_t *h, int r, uint64_t req,
                          kvx_context_params_t *p)
{
    fill_req(&h->c[r], req, hy_cb[r], HY_TOK);
    fill_req(&h->cw[r], req + 1, hy_cw[r], HY_TOK);
    fill_req(&h->cst[r], req + 2, &hy_cs[r], 1);
    kvx_group_t gs[2];
    hy_ctx_groups(h, r, gs);
    char k[24];
    snprintf(k, sizeof(k), "%llu", (unsigned long long)req);
    return kvx_publish_groups(h->c[r].c, k, strlen(k), h->c[r].pool, hy_cb[r],
                              3, HY_TOK, gs, 2, NULL, 0, 0, p, T_MS);
}

static int hybrid_fetch(hybrid_t *h, uint64_t req,
                        const kvx_context_params_t *p, uint32_t wskip)
{
    kvx_group_t gs[2];
    hy_gen_groups(h, wskip, gs);
    char k[24];
    snprintf(k, sizeof(k), "%llu", (unsigned long long)req);
    return kvx_fetch_groups(h->g.c, k, strlen(k), p->data, p->len, h->g.pool,
                            hy_gb, 3, 0, 0, gs, 2, T_MS);
}

/* Request req's three tables landed in the generation rank's pools (the
 * KV, the window's tokens [4, 11), the state slot), and nothing else of
 * them was written. */
static void hybrid_landed(hybrid_t *h, uint64_t req)
{
    expect_t kv = {req, hy_gb, HY_TOK, 0};
    expect_t win = {req + 1, hy_gw, HY_TOK, 4};
    expect_t st = {req + 2, &hy_gs, 1, 0};
    CHECK_EQ(check_pool(&h->g, &kv, 1, 0xa5), 0);
    CHECK_EQ(check_pool(&h->gw, &win, 1, 0xa5), 0);
    CHECK_EQ(check_pool(&h->gst, &st, 1, 0xa5), 0);
}

/* The KV, the window's tokens [4, 11) and the state slot land from both
 * context ranks (TP 2 -> 1: heads concatenated in every group), and
 * nothing else of the three pools is written; one COMPLETE each side. */
TEST(groups_move_window_and_state_with_kv)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "hy-ctx", "hy-gen");
    kvx_context_params_t p, p1;
    CHECK_KVX(hybrid_publish(&h, 0, 300, &p), h.c[0].c);
    CHECK_KVX(hybrid_publish(&h, 1, 300, &p1), h.c[1].c);
    CHECK_EQ(p.len, p1.len);
    CHECK(memcmp(p.data, p1.data, p.len) == 0);
    CHECK_KVX(hybrid_fetch(&h, 300, &p, 4), h.g.c);
    wait_event(h.g.c, 300, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(h.c[0].c, 300, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(h.c[1].c, 300, KVX_EVENT_COMPLETE, 0, 3000);
    hybrid_landed(&h, 300);
    kvx_context_params_free(&p);
    kvx_context_params_free(&p1);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* Refusals name the group and change nothing: a fetch without the
 * offer's groups, a window fetch that reads below the offer's window,
 * another rank's groups that differ, a state pool of the wrong share;
 * then the right fetch completes. */
TEST(groups_refusals_name_the_group)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "hy-ctx", "hy-gen");
    kvx_context_params_t p, p1;
    CHECK_KVX(hybrid_publish(&h, 0, 310, &p), h.c[0].c);

    /* rank 1 with one group less */
    kvx_group_t one = {.pool_id = h.cw[1].pool,
                       .blocks = hy_cw[1] + 1,
                       .num_blocks = 2,
                       .num_tokens = HY_TOK,
                       .first_block = 1};
    CHECK_EQ(kvx_publish_groups(h.c[1].c, "310", 3, h.c[1].pool, hy_cb[1], 3,
                                HY_TOK, &one, 1, NULL, 0, 0, &p1, T_MS),
             KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(kvx_last_error(h.c[1].c), "publish.groups");
    /* a window that starts after its tokens */
    kvx_group_t bad[2] = {one,
                          {.pool_id = h.cst[1].pool,
                           .blocks = &hy_cs[1],
                           .num_blocks = 1,
                           .num_tokens = 1}};
    bad[0].first_block = 3;
    CHECK_EQ(kvx_publish_groups(h.c[1].c, "310", 3, h.c[1].pool, hy_cb[1], 3,
                                HY_TOK, bad, 2, NULL, 0, 0, &p1, T_MS),
             KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(h.c[1].c), "groups[0].first_block");
    /* a group's block outside its pool */
    uint32_t far[2] = {1, 99};
    bad[0] = one;
    bad[0].blocks = far;
    CHECK_EQ(kvx_publish_groups(h.c[1].c, "310", 3, h.c[1].pool, hy_cb[1], 3,
                                HY_TOK, bad, 2, NULL, 0, 0, &p1, T_MS),
             KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(h.c[1].c), "groups[0].blocks[1]");
    /* the state slot with another token count than rank 0's */
    bad[0] = one;
    bad[1].num_tokens = 2;
    uint32_t two_slots[2] = {1, 2};
    bad[1].blocks = two_slots;
    bad[1].num_blocks = 2;
    CHECK_EQ(kvx_publish_groups(h.c[1].c, "310", 3, h.c[1].pool, hy_cb[1], 3,
                                HY_TOK, bad, 2, NULL, 0, 0, &p1, T_MS),
             KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(kvx_last_error(h.c[1].c), "publish.groups[1]");
    CHECK_KVX(hybrid_publish(&h, 1, 310, &p1), h.c[1].c);

    /* the fetch without groups, or with the window read below 4 */
    CHECK_EQ(kvx_fetch_key(h.g.c, "310", 3, p.data, p.len, h.g.pool, hy_gb, 3,
                           0, 0, T_MS),
             KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(kvx_last_error(h.g.c), "but the offer of request 310 has 2");
    CHECK_EQ(kvx_fetch_groups(h.g.c, "310", 3, p.data, p.len, h.g.pool, hy_gb,
                              3, 0, 0, NULL, 0, T_MS),
             KVX_ERR_MISMATCH);
    CHECK_EQ(hybrid_fetch(&h, 310, &p, 0), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(h.g.c), "groups[0].skip_tokens");
    /* a state pool holding half the heads: not this rank's share */
    rank_t half;
    side_t hsd;
    static const model_t M_HALF = {.layers = 2,
                                   .heads = 2,
                                   .head_dim = 64,
                                   .kv = 1,
                                   .dtype = KVX_DTYPE_FP32};
    group_pool(&h.g, &M_HALF, &hsd, 1, 4, &half);
    kvx_group_t gs[2] = {{.pool_id = h.gw.pool,
                          .blocks = hy_gw + 1,
                          .num_blocks = 2,
                          .first_block = 1,
                          .skip_tokens = 4},
                         {.pool_id = half.pool, .blocks = &hy_gs,
                          .num_blocks = 1}};
    CHECK_EQ(kvx_fetch_groups(h.g.c, "310", 3, p.data, p.len, h.g.pool, hy_gb,
                              3, 0, 0, gs, 2, T_MS),
             KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(kvx_last_error(h.g.c), "heads");
    /* more groups than a request may have */
    kvx_group_t many[KVX_MAX_GROUPS];
    for (int i = 0; i < KVX_MAX_GROUPS; i++)
        many[i] = gs[1];
    CHECK_EQ(kvx_fetch_groups(h.g.c, "310", 3, p.data, p.len, h.g.pool, hy_gb,
                              3, 0, 0, many, KVX_MAX_GROUPS, T_MS),
             KVX_ERR_LIMIT);
    /* nothing was written; the right fetch still completes */
    expect_t none = {0, hy_gb, 0, 0};
    CHECK_EQ(check_pool(&h.g, &none, 0, 0xa5), 0);
    CHECK_EQ(check_pool(&h.gst, &none, 0, 0xa5), 0);
    CHECK_KVX(hybrid_fetch(&h, 310, &p, 4), h.g.c);
    wait_event(h.g.c, 310, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t st = {312, &hy_gs, 1, 0};
    CHECK_EQ(check_pool(&h.gst, &st, 1, 0xa5), 0);
    kvx_context_params_free(&p);
    kvx_context_params_free(&p1);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* The shape rules of the other tables (protocol.md, "Several block
 * tables"), with the messages that document them: a table's layers split
 * evenly over PP, with the same count on every rank (no per-stage counts,
 * no remainder); its heads are its ranks' own, not replicated, so the
 * totals of both sides must agree; skip_tokens leaves some of its
 * tokens. */
TEST(groups_shape_rules_as_documented)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "hy-ctx", "hy-gen");
    kvx_context_params_t p, p1;
    CHECK_KVX(hybrid_publish(&h, 0, 320, &p), h.c[0].c);
    /* context rank 1's state pool holds 1 layer, rank 0's 2 */
    static const model_t M_ONE = {.layers = 1,
                                  .heads = 4,
                                  .head_dim = 64,
                                  .kv = 1,
                                  .dtype = KVX_DTYPE_FP32};
    rank_t one;
    side_t osd;
    group_pool(&h.c[1], &M_ONE, &osd, 1, 4, &one);
    kvx_group_t gs[2];
    hy_ctx_groups(&h, 1, gs);
    gs[1].pool_id = one.pool;
    CHECK_EQ(kvx_publish_groups(h.c[1].c, "320", 3, h.c[1].pool, hy_cb[1], 3,
                                HY_TOK, gs, 2, NULL, 0, 0, &p1, T_MS),
             KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(kvx_last_error(h.c[1].c),
                       "publish.groups[1].pool_id: layout has 1 layers, "
                       "rank 1 holds 2");
    CHECK_KVX(hybrid_publish(&h, 1, 320, &p1), h.c[1].c);

    /* the generation state pool of 1 layer: 1 in all against 2 */
    rank_t gone;
    side_t gsd;
    group_pool(&h.g, &M_ONE, &gsd, 1, 4, &gone);
    kvx_group_t gg[2];
    hy_gen_groups(&h, 4, gg);
    gg[1].pool_id = gone.pool;
    CHECK_EQ(kvx_fetch_groups(h.g.c, "320", 3, p.data, p.len, h.g.pool, hy_gb,
                              3, 0, 0, gg, 2, T_MS),
             KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(kvx_last_error(h.g.c),
                       "total_layers: context 2, generation 1");
    /* half the units on the one generation rank: 2 in all against 2 x 2 */
    static const model_t M_HALF = {.layers = 2,
                                   .heads = 2,
                                   .head_dim = 64,
                                   .kv = 1,
                                   .dtype = KVX_DTYPE_FP32};
    rank_t half;
    side_t hsd;
    group_pool(&h.g, &M_HALF, &hsd, 1, 4, &half);
    hy_gen_groups(&h, 4, gg);
    gg[1].pool_id = half.pool;
    CHECK_EQ(kvx_fetch_groups(h.g.c, "320", 3, p.data, p.len, h.g.pool, hy_gb,
                              3, 0, 0, gg, 2, T_MS),
             KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(kvx_last_error(h.g.c),
                       "total_kv_heads: context 4, generation 2");
    /* the window skipped whole, and past its end */
    CHECK_EQ(hybrid_fetch(&h, 320, &p, HY_TOK), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(h.g.c),
                       "skip_tokens: 11 leaves nothing of 11 tokens");
    CHECK_EQ(hybrid_fetch(&h, 320, &p, HY_TOK + 1), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(h.g.c),
                       "fetch.groups[0].skip_tokens: 12, more than its 11 "
                       "tokens");
    /* refused, nothing written: the right fetch completes */
    CHECK_KVX(hybrid_fetch(&h, 320, &p, 4), h.g.c);
    wait_event(h.g.c, 320, KVX_EVENT_COMPLETE, 0, 3000);
    hybrid_landed(&h, 320);
    kvx_context_params_free(&p);
    kvx_context_params_free(&p1);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* A fetch waiting for context rank 1 is cancelled: one CANCELLED, and no
 * byte of any group is written, even once rank 1 publishes. */
TEST(groups_cancel_before_sources_writes_nothing)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "hy-ctx", "hy-gen");
    kvx_context_params_t p, p1;
    CHECK_KVX(hybrid_publish(&h, 0, 320, &p), h.c[0].c);
    CHECK_KVX(hybrid_fetch(&h, 320, &p, 4), h.g.c);
    CHECK_KVX(kvx_cancel(h.g.c, 320, T_MS), h.g.c);
    wait_event(h.g.c, 320, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
    int rc = hybrid_publish(&h, 1, 320, &p1);
    if (!rc)
        kvx_context_params_free(&p1);
    sleep_ms(100);
    expect_t none = {0, hy_gb, 0, 0};
    CHECK_EQ(check_pool(&h.g, &none, 0, 0xa5), 0);
    CHECK_EQ(check_pool(&h.gw, &none, 0, 0xa5), 0);
    CHECK_EQ(check_pool(&h.gst, &none, 0, 0xa5), 0);
    ev_t e[4];
    CHECK_EQ(collect(h.g.c, e, 4, 1, 200), 0); /* no second event */
    kvx_context_params_free(&p);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* Fetch by key with groups, before the context ranks publish: the
 * waiting fetch holds its groups' pools and tables, and every group
 * lands once both ranks publish; a pool of a waiting group is held. */
TEST(groups_fetch_by_key_waits_then_moves_every_group)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "hy-ctx", "hy-gen");
    kvx_group_t gs[2];
    hy_gen_groups(&h, 4, gs);
    CHECK_KVX(kvx_fetch_by_key_groups(h.g.c, "330", 3, "hy-ctx", h.c[0].addr,
                                      "330", 3, h.g.pool, hy_gb, 3, 0, 0, gs,
                                      2, T_MS),
              h.g.c);
    /* the state pool is held by the waiting fetch */
    CHECK_EQ(kvx_pool_deregister(h.g.c, h.gst.pool, T_MS), KVX_ERR_BUSY);
    kvx_context_params_t p, p1;
    CHECK_KVX(hybrid_publish(&h, 0, 330, &p), h.c[0].c);
    CHECK_KVX(hybrid_publish(&h, 1, 330, &p1), h.c[1].c);
    wait_event(h.g.c, 330, KVX_EVENT_COMPLETE, 0, 3000);
    hybrid_landed(&h, 330);
    kvx_context_params_free(&p);
    kvx_context_params_free(&p1);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* A layer-wise offer with groups: each table's layers are made ready on
 * their own (kvx_group_tokens_ready), and each table moves only once its
 * layers are ready: the KV first, then the state, then the window, with
 * the tables not yet ready left untouched; a table the request does not
 * have is refused. */
TEST(groups_layerwise_each_table_when_ready)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "hy-ctx", "hy-gen");
    const uint64_t req = 360;
    kvx_context_params_t p[2];
    for (int r = 0; r < 2; r++) {
        memset(h.c[r].base, 0x11, h.c[r].size); /* no KV yet */
        memset(h.cw[r].base, 0x11, h.cw[r].size);
        memset(h.cst[r].base, 0x11, h.cst[r].size);
        kvx_group_t gs[2];
        hy_ctx_groups(&h, r, gs);
        CHECK_KVX(kvx_publish_groups(h.c[r].c, "360", 3, h.c[r].pool, hy_cb[r],
                                     3, HY_TOK, gs, 2, NULL, 0, 1, &p[r], T_MS),
                  h.c[r].c);
    }
    CHECK_KVX(hybrid_fetch(&h, req, &p[0], 4), h.g.c);
    CHECK_FAILS(
        kvx_group_tokens_ready(h.c[0].c, "360", 3, 3, 0, 1, 0, NULL, T_MS),
        h.c[0].c, KVX_ERR_INVALID, "layers_ready.group: 3");
    expect_t none = {0, hy_gb, 0, 0};
    expect_t kv = {req, hy_gb, HY_TOK, 0};
    expect_t win = {req + 1, hy_gw, HY_TOK, 4};
    expect_t st = {req + 2, &hy_gs, 1, 0};
    /* the KV's layers on both ranks */
    for (int r = 0; r < 2; r++) {
        fill_req(&h.c[r], req, hy_cb[r], HY_TOK);
        CHECK_KVX(
            kvx_layers_ready(h.c[r].c, "360", 3, 0, h.c[r].nlayers, NULL, T_MS),
            h.c[r].c);
    }
    int64_t end = now_ms() + 3000;
    while (check_pool(&h.g, &kv, 1, 0xa5) && now_ms() < end)
        sleep_ms(5);
    CHECK_EQ(check_pool(&h.g, &kv, 1, 0xa5), 0);
    sleep_ms(50);
    CHECK_EQ(check_pool(&h.gw, &none, 0, 0xa5), 0);
    CHECK_EQ(check_pool(&h.gst, &none, 0, 0xa5), 0);
    /* each table's progress: the KV all landed, the others none */
    uint32_t done, nl;
    int ended;
    CHECK_KVX(
        kvx_group_fetch_progress(h.g.c, "360", 3, 0, &done, &nl, &ended, T_MS),
        h.g.c);
    CHECK_EQ(done, nl);
    CHECK_EQ(nl, h.g.nlayers);
    CHECK_EQ(ended, 0);
    for (uint32_t t = 1; t <= 2; t++) { /* each in its own pool's layers */
        CHECK_KVX(kvx_group_fetch_progress(h.g.c, "360", 3, t, &done, &nl,
                                           &ended, T_MS),
                  h.g.c);
        CHECK_EQ(done, 0);
        CHECK_EQ(nl, t == 1 ? h.gw.nlayers : h.gst.nlayers);
    }
    CHECK_FAILS(
        kvx_group_fetch_progress(h.g.c, "360", 3, 3, &done, &nl, &ended, T_MS),
        h.g.c, KVX_ERR_INVALID,
        "fetch_progress.group: 3, but request 360 has 3 block tables");
    /* the state slot (table 2), layer by layer */
    for (int r = 0; r < 2; r++) {
        fill_req(&h.cst[r], req + 2, &hy_cs[r], 1);
        for (uint32_t ly = 0; ly < h.cst[r].nlayers; ly++)
            CHECK_KVX(kvx_group_tokens_ready(h.c[r].c, "360", 3, 2, ly, 1, 0,
                                             NULL, T_MS),
                      h.c[r].c);
    }
    end = now_ms() + 3000;
    while (check_pool(&h.gst, &st, 1, 0xa5) && now_ms() < end)
        sleep_ms(5);
    CHECK_EQ(check_pool(&h.gst, &st, 1, 0xa5), 0);
    CHECK_EQ(check_pool(&h.gw, &none, 0, 0xa5), 0);
    CHECK_KVX(
        kvx_group_fetch_progress(h.g.c, "360", 3, 2, &done, &nl, &ended, T_MS),
        h.g.c);
    CHECK_EQ(done, nl); /* the state's every layer */
    CHECK_EQ(nl, h.gst.nlayers);
    CHECK_KVX(
        kvx_group_fetch_progress(h.g.c, "360", 3, 1, &done, &nl, &ended, T_MS),
        h.g.c);
    CHECK_EQ(done, 0); /* the window's none */
    ev_t e[4];
    CHECK_EQ(collect(h.g.c, e, 4, 1, 100), 0); /* the window is missing */
    /* the window (table 1) */
    for (int r = 0; r < 2; r++) {
        fill_req(&h.cw[r], req + 1, hy_cw[r], HY_TOK);
        CHECK_KVX(kvx_group_tokens_ready(h.c[r].c, "360", 3, 1, 0,
                                         h.cw[r].nlayers, 0, NULL, T_MS),
                  h.c[r].c);
    }
    wait_event(h.g.c, req, KVX_EVENT_COMPLETE, 0, 3000);
    CHECK_EQ(check_pool(&h.g, &kv, 1, 0xa5), 0);
    CHECK_EQ(check_pool(&h.gw, &win, 1, 0xa5), 0);
    CHECK_EQ(check_pool(&h.gst, &st, 1, 0xa5), 0);
    kvx_context_params_free(&p[0]);
    kvx_context_params_free(&p[1]);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* Params that lie about the tables (groups removed, the token kept): the
 * offer decides, so the fetch ends with one MISMATCH event and writes
 * nothing; publishing a table that would need more blocks than
 * limits.max_blocks_per_request allows is refused before any memory is
 * taken for it. */
TEST(groups_forged_params_and_huge_tables_refused)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "hy-ctx", "hy-gen");
    kvx_context_params_t p, p1;
    CHECK_KVX(hybrid_publish(&h, 0, 370, &p), h.c[0].c);
    CHECK_KVX(hybrid_publish(&h, 1, 370, &p1), h.c[1].c);
    kvx_context_params_free(&p1);
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p.len, p.data);
    CHECK(cp != NULL);
    cp->n_groups = 0;
    uint8_t forged[4096];
    size_t n = kvxfer__context_params__get_packed_size(cp);
    CHECK(n <= sizeof(forged));
    kvxfer__context_params__pack(cp, forged);
    cp->n_groups = 2; /* freed as unpacked */
    kvxfer__context_params__free_unpacked(cp, NULL);
    CHECK_KVX(kvx_fetch_key(h.g.c, "370", 3, forged, n, h.g.pool, hy_gb, 3, 0,
                            0, T_MS),
              h.g.c);
    ev_t e = wait_event(h.g.c, 370, KVX_EVENT_ERROR, KVX_ERR_MISMATCH, 3000);
    CHECK_STR_CONTAINS(e.msg, "other block tables");
    expect_t none = {0, hy_gb, 0, 0};
    CHECK_EQ(check_pool(&h.g, &none, 0, 0xa5), 0);
    /* a window of four billion one-token blocks */
    kvx_group_t huge[2] = {{.pool_id = h.cst[0].pool,
                            .blocks = &hy_cs[0],
                            .num_blocks = 1,
                            .num_tokens = 4000000000u,
                            .first_block = 3999999999u},
                           {.pool_id = h.cst[0].pool,
                            .blocks = &hy_cs[0],
                            .num_blocks = 1,
                            .num_tokens = 1}};
    CHECK_EQ(kvx_publish_groups(h.c[0].c, "371", 3, h.c[0].pool, hy_cb[0], 3,
                                HY_TOK, huge, 2, NULL, 0, 0, &p1, T_MS),
             KVX_ERR_LIMIT); /* p1 is not filled on an error */
    CHECK_STR_CONTAINS(kvx_last_error(h.c[0].c),
                       "limits.max_blocks_per_request");
    kvx_context_params_free(&p);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* The scheduler reserves a hybrid request with its other tables
 * (kvx_reserve_groups): the ranks' publishes with the same groups get
 * the reservation's params, and every group lands. Refusals name what
 * is wrong: no plain pool named among pools of several layouts, a pool
 * of no rank, blocks in a reservation, a publish whose groups differ
 * from the reservation's. */
TEST(groups_reserved_by_the_scheduler)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "rg-ctx", "rg-gen");
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_group_t rg[2] = {
        {.pool_id = h.cw[1].pool, .num_tokens = HY_TOK, .first_block = 1},
        {.pool_id = h.cst[0].pool, .num_tokens = 1}};
    kvx_context_params_t rp, pp, p0, p1;
    CHECK_FAILS(kvx_reserve(sched, "rg-ctx", "500", 3, HY_TOK, &pp, T_MS),
                sched, KVX_ERR_STATE, "name the plain table's pool");
    CHECK_FAILS(kvx_reserve_groups(sched, "rg-ctx", "500", 3, HY_TOK, 9999, rg,
                                   2, &pp, T_MS),
                sched, KVX_ERR_NOT_FOUND,
                "reserve.pool_id: 9999 is no pool of a rank of instance "
                "rg-ctx");
    kvx_group_t bad = rg[0];
    bad.pool_id = h.gw.pool; /* the generation instance's */
    CHECK_FAILS(kvx_reserve_groups(sched, "rg-ctx", "500", 3, HY_TOK,
                                   h.c[0].pool, &bad, 1, &pp, T_MS),
                sched, KVX_ERR_NOT_FOUND, "reserve.groups[0].pool_id");
    bad = rg[0];
    bad.num_blocks = 1;
    bad.blocks = hy_cw[0];
    CHECK_FAILS(kvx_reserve_groups(sched, "rg-ctx", "500", 3, HY_TOK,
                                   h.c[0].pool, &bad, 1, &pp, T_MS),
                sched, KVX_ERR_INVALID, "a reservation names none");
    bad = rg[0];
    bad.first_block = 3; /* past the window's 3 blocks */
    CHECK_FAILS(kvx_reserve_groups(sched, "rg-ctx", "500", 3, HY_TOK,
                                   h.c[0].pool, &bad, 1, &pp, T_MS),
                sched, KVX_ERR_INVALID, "reserve.groups[0].first_block: 3");

    CHECK_KVX(kvx_reserve_groups(sched, "rg-ctx", "500", 3, HY_TOK, h.c[1].pool,
                                 rg, 2, &rp, T_MS),
              sched);
    CHECK_KVX(hybrid_publish(&h, 0, 500, &p0), h.c[0].c);
    CHECK_KVX(hybrid_publish(&h, 1, 500, &p1), h.c[1].c);
    CHECK_EQ(rp.len, p0.len);
    CHECK(!memcmp(rp.data, p0.data, rp.len));
    CHECK(p1.len == p0.len && !memcmp(p1.data, p0.data, p0.len));
    CHECK_KVX(hybrid_fetch(&h, 500, &rp, 4), h.g.c);
    wait_event(h.g.c, 500, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(h.c[0].c, 500, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(h.c[1].c, 500, KVX_EVENT_COMPLETE, 0, 3000);
    hybrid_landed(&h, 500);

    /* reserved with the window from block 0: the publish's window from
     * block 1 differs, and one table fewer is refused too */
    rg[0].first_block = 0;
    kvx_context_params_t rp2;
    CHECK_KVX(kvx_reserve_groups(sched, "rg-ctx", "510", 3, HY_TOK, h.c[0].pool,
                                 rg, 2, &rp2, T_MS),
              sched);
    CHECK_FAILS(hybrid_publish(&h, 0, 510, &pp), h.c[0].c, KVX_ERR_MISMATCH,
                "that the reservation made");
    CHECK_FAILS(kvx_publish_groups(h.c[0].c, "510", 3, h.c[0].pool, hy_cb[0], 3,
                                   HY_TOK, NULL, 0, NULL, 0, 0, &pp, T_MS),
                h.c[0].c, KVX_ERR_MISMATCH,
                "0 other block tables, but the reservation made 2");
    kvx_context_params_free(&rp2);
    kvx_context_params_free(&rp);
    kvx_context_params_free(&p0);
    kvx_context_params_free(&p1);
    kvx_close(sched);
    hybrid_close(&h);
    daemon_healthy(d);
}
