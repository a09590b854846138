/*
 * t_api3.c — the 3.0 calls, kvx_publish and kvx_fetch with their args
 * structs (reached here as kvx_publish3 / kvx_fetch3: this binary is
 * built with KVX_API_2X, so its kvx_publish is the 2.x one): every form
 * through field_mask, batches of mixed forms whose items each get their
 * own code and message (with block tables too), the args refused by
 * name, kvx_version; kvx_ready and kvx_progress by their args, and
 * refused by name. The 2.x calls, now wrappers, are what every other
 * file of this binary uses.
 */

/* A publish's args: key, blocks, tokens, params, timeout. */
static kvx_publish_args_t pub_args(const char *key, uint32_t pool,
                                   const uint32_t *blocks, uint32_t nblocks,
                                   uint32_t ntok, kvx_context_params_t *p)
{
    return (kvx_publish_args_t){
        .field_mask = KVX_PUBLISH_FIELD_KEY | KVX_PUBLISH_FIELD_BLOCKS |
                      KVX_PUBLISH_FIELD_NUM_TOKENS | KVX_PUBLISH_FIELD_PARAMS |
                      KVX_PUBLISH_FIELD_TIMEOUT,
        .key = key,
        .key_len = strlen(key),
        .pool_id = pool,
        .blocks = blocks,
        .num_blocks = nblocks,
        .num_tokens = ntok,
        .params = p,
        .timeout_ms = T_MS};
}

/* A fetch's args with params: key, blocks, params, timeout. */
static kvx_fetch_args_t fetch_args(const char *key, uint32_t pool,
                                   const uint32_t *blocks, uint32_t nblocks,
                                   const kvx_context_params_t *p)
{
    return (kvx_fetch_args_t){
        .field_mask = KVX_FETCH_FIELD_KEY | KVX_FETCH_FIELD_BLOCKS |
                      KVX_FETCH_FIELD_PARAMS | KVX_FETCH_FIELD_TIMEOUT,
        .key = key,
        .key_len = strlen(key),
        .pool_id = pool,
        .blocks = blocks,
        .num_blocks = nblocks,
        .params = p ? p->data : NULL,
        .params_len = p ? p->len : 0,
        .timeout_ms = T_MS};
}

/* Each form of one request through the args: with aux and an outcome,
 * with the default timeout, layer-wise by a flag, fetched with a
 * skip_tokens, and fetched by key (CONTEXT) before it is published. The
 * bytes land, the aux rides on the COMPLETE, and an outcome of a call
 * that worked says 0 and "". */
TEST(api3_every_form_one_by_one)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "a3-ctx", "a3-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    CHECK(!strcmp(kvx_version(), KVX_VERSION_STRING));
    CHECK(!strcmp(kvx_version(), "3.2.0"));

    /* aux and outcomes; the fetch without TIMEOUT (the default) */
    uint32_t cb[2] = {0, 1}, gb[2] = {7, 6};
    kvx_context_params_t p;
    kvx_outcome_t po = {.code = 99, .message = "stale"}, fo = po;
    fill_req(&c, 701, cb, 7);
    kvx_publish_args_t pa = pub_args("a3-aux", c.pool, cb, 2, 7, &p);
    pa.field_mask |= KVX_PUBLISH_FIELD_AUX | KVX_PUBLISH_FIELD_OUTCOME;
    pa.aux = "tok-42";
    pa.aux_len = 6;
    pa.outcome = &po;
    CHECK_KVX(kvx_publish3(c.c, &pa), c.c);
    CHECK_EQ(po.code, 0);
    CHECK(!strcmp(po.message, ""));
    kvx_fetch_args_t fa = fetch_args("g-aux", g.pool, gb, 2, &p);
    fa.field_mask &= ~KVX_FETCH_FIELD_TIMEOUT;
    fa.field_mask |= KVX_FETCH_FIELD_OUTCOME;
    fa.outcome = &fo;
    CHECK_KVX(kvx_fetch3(g.c, &fa), g.c);
    CHECK_EQ(fo.code, 0);
    ev_t ge = wait_key(g.c, "g-aux", 5, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.aux_len, 6);
    CHECK(!memcmp(ge.aux, "tok-42", 6));
    CHECK_EQ(wait_key(c.c, "a3-aux", 6, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = 701, .blocks = gb, .ntok = 7};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p);

    /* layer-wise by a flag: nothing moves until the layers are ready;
     * fetched with skip_tokens 0 said */
    uint32_t gb2[2] = {2, 3};
    pa = pub_args("a3-lw", c.pool, cb, 2, 8, &p);
    pa.field_mask |= KVX_PUBLISH_FIELD_FLAGS;
    pa.flags = KVX_PUBLISH_LAYERWISE;
    CHECK_KVX(kvx_publish3(c.c, &pa), c.c);
    fa = fetch_args("g-lw", g.pool, gb2, 2, &p);
    fa.field_mask |= KVX_FETCH_FIELD_SKIP_TOKENS | KVX_FETCH_FIELD_DP_RANK;
    CHECK_KVX(kvx_fetch3(g.c, &fa), g.c);
    ev_t e[4];
    CHECK_EQ(collect(g.c, e, 4, 1, 200), 0); /* waits for the layers */
    fill_req(&c, 702, cb, 8);
    CHECK_KVX(kvx_layers_ready(c.c, "a3-lw", 5, 0, c.nlayers, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "g-lw", 4, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "a3-lw", 5, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex2[2] = {{.req = 701, .blocks = gb, .ntok = 7},
                       {.req = 702, .blocks = gb2, .ntok = 8}};
    CHECK_EQ(check_pool(&g, ex2, 2, 0xa5), 0);
    kvx_context_params_free(&p);

    /* fetch by key, before the publish: it waits, then lands */
    uint32_t gb3[2] = {4, 5};
    fa = fetch_args("g-bk", g.pool, gb3, 2, NULL);
    fa.field_mask &= ~KVX_FETCH_FIELD_PARAMS;
    fa.field_mask |= KVX_FETCH_FIELD_CONTEXT;
    fa.context_instance = "a3-ctx";
    fa.context_address = c.addr;
    fa.context_key = "a3-room";
    fa.context_key_len = 7;
    CHECK_KVX(kvx_fetch3(g.c, &fa), g.c);
    CHECK_EQ(collect(g.c, e, 4, 1, 200), 0);
    fill_req(&c, 703, cb, 5);
    pa = pub_args("a3-room", c.pool, cb, 2, 5, &p);
    pa.field_mask &= ~KVX_PUBLISH_FIELD_TIMEOUT; /* the default */
    CHECK_KVX(kvx_publish3(c.c, &pa), c.c);
    CHECK_EQ(wait_key(g.c, "g-bk", 4, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "a3-room", 7, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex3[3] = {{.req = 701, .blocks = gb, .ntok = 7},
                       {.req = 702, .blocks = gb2, .ntok = 8},
                       {.req = 703, .blocks = gb3, .ntok = 5}};
    CHECK_EQ(check_pool(&g, ex3, 3, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Args the library refuses before sending anything, each named: a
 * field_mask bit it does not know, a required field missing, both or
 * neither of PARAMS and CONTEXT, a flags bit it does not know, NULL
 * args, a batch's args with an item's fields, an item with the batch's.
 * The outcome says the same; the connection stays usable. */
TEST(api3_args_refused_by_name)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "a3r-ctx", "a3r-gen", 8, &c, &g, &cs, &gs);
    uint32_t b[2] = {0, 1};
    kvx_context_params_t p = {0};
    kvx_outcome_t o = {0};

    kvx_publish_args_t pa = pub_args("r-1", c.pool, b, 2, 7, &p);
    pa.field_mask |= (1ull << 40) | KVX_PUBLISH_FIELD_OUTCOME;
    pa.outcome = &o;
    CHECK_FAILS(kvx_publish3(c.c, &pa), c.c, KVX_ERR_INVALID,
                "kvx_publish: field_mask bit 0x10000000000 is unknown to "
                "libkvxfer 3.2.0");
    CHECK_EQ(o.code, KVX_ERR_INVALID);
    CHECK_EQ(o.answered, 0); /* refused here, never sent */
    CHECK_STR_CONTAINS(o.message, "bit 0x10000000000 is unknown");
    pa = pub_args("r-1", c.pool, b, 2, 7, &p);
    pa.field_mask &= ~KVX_PUBLISH_FIELD_NUM_TOKENS;
    CHECK_FAILS(kvx_publish3(c.c, &pa), c.c, KVX_ERR_INVALID,
                "kvx_publish: field_mask lacks KVX_PUBLISH_FIELD_NUM_TOKENS");
    pa = pub_args("r-1", c.pool, b, 2, 7, &p);
    pa.field_mask &= ~KVX_PUBLISH_FIELD_KEY;
    CHECK_FAILS(kvx_publish3(c.c, &pa), c.c, KVX_ERR_INVALID,
                "lacks KVX_PUBLISH_FIELD_KEY");
    pa = pub_args("r-1", c.pool, b, 2, 7, &p);
    pa.field_mask |= KVX_PUBLISH_FIELD_FLAGS;
    pa.flags = KVX_PUBLISH_LAYERWISE | 4u;
    CHECK_FAILS(kvx_publish3(c.c, &pa), c.c, KVX_ERR_INVALID,
                "kvx_publish: flags bit 0x4 is unknown");
    CHECK_FAILS(kvx_publish3(c.c, NULL), c.c, KVX_ERR_INVALID,
                "kvx_publish: args is NULL");
    pa = pub_args("", c.pool, b, 2, 7, &p);
    CHECK_FAILS(kvx_publish3(c.c, &pa), c.c, KVX_ERR_INVALID,
                "kvx_publish: key of 0 bytes");

    kvx_fetch_args_t fa = fetch_args("r-g", g.pool, b, 2, NULL);
    fa.field_mask |= KVX_FETCH_FIELD_CONTEXT;
    CHECK_FAILS(kvx_fetch3(g.c, &fa), g.c, KVX_ERR_INVALID,
                "kvx_fetch: field_mask has both of KVX_FETCH_FIELD_PARAMS "
                "and KVX_FETCH_FIELD_CONTEXT");
    fa.field_mask &= ~(KVX_FETCH_FIELD_CONTEXT | KVX_FETCH_FIELD_PARAMS);
    CHECK_FAILS(kvx_fetch3(g.c, &fa), g.c, KVX_ERR_INVALID, "has neither");
    fa = fetch_args("r-g", g.pool, b, 2, NULL);
    fa.field_mask |= 1ull << 10;
    CHECK_FAILS(kvx_fetch3(g.c, &fa), g.c, KVX_ERR_INVALID,
                "kvx_fetch: field_mask bit 0x400 is unknown");
    fa = fetch_args("r-g", g.pool, b, 2, NULL);
    fa.field_mask &= ~KVX_FETCH_FIELD_BLOCKS;
    CHECK_FAILS(kvx_fetch3(g.c, &fa), g.c, KVX_ERR_INVALID,
                "lacks KVX_FETCH_FIELD_BLOCKS");

    /* batches: the batch's args carry items only; an item not the
     * batch's fields; more than KVX_MANY_MAX */
    kvx_fetch_args_t items[2] = {fetch_args("r-a", g.pool, b, 2, NULL),
                                 fetch_args("r-b", g.pool, b, 2, NULL)};
    kvx_outcome_t io[2] = {{0}, {0}};
    items[0].field_mask |= KVX_FETCH_FIELD_OUTCOME;
    items[0].outcome = &io[0];
    items[1].field_mask |= KVX_FETCH_FIELD_OUTCOME;
    items[1].outcome = &io[1];
    kvx_fetch_args_t batch = {.field_mask =
                                  KVX_FETCH_FIELD_ITEMS | KVX_FETCH_FIELD_KEY,
                              .items = items,
                              .num_items = 2};
    CHECK_FAILS(kvx_fetch3(g.c, &batch), g.c, KVX_ERR_INVALID,
                "kvx_fetch: field_mask has KVX_FETCH_FIELD_KEY beside "
                "KVX_FETCH_FIELD_ITEMS");
    batch.field_mask = KVX_FETCH_FIELD_ITEMS;
    /* items[1] has TIMEOUT (fetch_args sets it): the batch's */
    items[0].field_mask &= ~KVX_FETCH_FIELD_TIMEOUT;
    CHECK_FAILS(kvx_fetch3(g.c, &batch), g.c, KVX_ERR_INVALID,
                "kvx_fetch: item 1: field_mask has KVX_FETCH_FIELD_TIMEOUT, "
                "which only the batch's args set");
    CHECK_EQ(io[1].code, KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(io[1].message, "item 1: field_mask has");
    CHECK_EQ(io[0].code, KVX_ERR_INVALID);
    CHECK_EQ(io[0].answered + io[1].answered, 0);
    CHECK_STR_CONTAINS(io[0].message, "not sent: another item");
    batch.num_items = KVX_MANY_MAX + 1;
    CHECK_FAILS(kvx_fetch3(g.c, &batch), g.c, KVX_ERR_INVALID,
                "257 items (at most 256)");
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK(!strstr(json, "r-1")); /* nothing was sent */
    free(json);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* One batch of every form: publishes plain, with aux, layer-wise and
 * two into pools that do not exist; the two refused get each its own
 * code and the daemon's message naming its own pool (before 3.0 only
 * the first failure's message was kept), the others their params. Then
 * one batch of fetches with params, by key, of the layer-wise offer,
 * with bad params and of a key fetched already: again each item its own
 * outcome, and the three taken land. */
TEST(api3_batch_of_every_form_own_errors)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "a3b-ctx", "a3b-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[3][2] = {{0, 1}, {2, 3}, {4, 5}};
    kvx_context_params_t p[5];
    kvx_outcome_t po[5];
    memset(po, 0x5a, sizeof(po)); /* stale: every outcome is written */
    kvx_publish_args_t pi[5] = {pub_args("b-plain", c.pool, cb[0], 2, 7, &p[0]),
                                pub_args("b-aux", c.pool, cb[1], 2, 6, &p[1]),
                                pub_args("b-lw", c.pool, cb[2], 2, 5, &p[2]),
                                pub_args("b-bad1", 999, cb[0], 2, 7, &p[3]),
                                pub_args("b-bad2", 998, cb[0], 2, 7, &p[4])};
    for (int i = 0; i < 5; i++) {
        pi[i].field_mask &= ~KVX_PUBLISH_FIELD_TIMEOUT;
        pi[i].field_mask |= KVX_PUBLISH_FIELD_OUTCOME;
        pi[i].outcome = &po[i];
    }
    pi[1].field_mask |= KVX_PUBLISH_FIELD_AUX;
    pi[1].aux = "first-token";
    pi[1].aux_len = 11;
    pi[2].field_mask |= KVX_PUBLISH_FIELD_FLAGS;
    pi[2].flags = KVX_PUBLISH_LAYERWISE;
    fill_req(&c, 801, cb[0], 7);
    fill_req(&c, 802, cb[1], 6);
    kvx_publish_args_t pb = {.field_mask = KVX_PUBLISH_FIELD_ITEMS |
                                           KVX_PUBLISH_FIELD_TIMEOUT,
                             .items = pi,
                             .num_items = 5,
                             .timeout_ms = T_MS};
    int rc = kvx_publish3(c.c, &pb);
    CHECK(rc < 0);
    CHECK_EQ(po[3].code, rc); /* the call returns the first failure's */
    CHECK_STR_CONTAINS(kvx_last_error(c.c), "kvx_publish: item 3 (key b-bad1)");
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(po[i].code, 0);
        CHECK(!strcmp(po[i].message, ""));
        CHECK(p[i].len > 0);
    }
    CHECK(po[4].code < 0);
    CHECK_STR_CONTAINS(po[3].message, "999");
    CHECK(!strstr(po[3].message, "998"));
    CHECK_STR_CONTAINS(po[4].message, "998"); /* its own, not item 3's */
    CHECK(!strstr(po[4].message, "999"));
    CHECK(p[3].data == NULL && p[4].data == NULL);
    for (int i = 0; i < 5; i++)
        CHECK_EQ(po[i].answered, 1);
    /* a single call the daemon refuses: its outcome, answered */
    kvx_outcome_t so;
    kvx_publish_args_t sa = pub_args("b-bad3", 997, cb[0], 2, 7, &p[3]);
    sa.field_mask |= KVX_PUBLISH_FIELD_OUTCOME;
    sa.outcome = &so;
    CHECK_EQ(kvx_publish3(c.c, &sa), po[3].code);
    CHECK_EQ(so.code, po[3].code);
    CHECK_EQ(so.answered, 1);
    CHECK_STR_CONTAINS(so.message, "997");
    CHECK(!strcmp(so.message, kvx_last_error(c.c)));

    uint32_t gb[3][2] = {{7, 6}, {5, 4}, {3, 2}};
    kvx_context_params_t junk = {(uint8_t *)"junk", 4};
    kvx_fetch_args_t fi[5] = {fetch_args("gb-plain", g.pool, gb[0], 2, &p[0]),
                              fetch_args("gb-aux", g.pool, gb[1], 2, NULL),
                              fetch_args("gb-lw", g.pool, gb[2], 2, &p[2]),
                              fetch_args("gb-junk", g.pool, gb[0], 2, &junk),
                              fetch_args("gb-plain", g.pool, gb[0], 2, &p[0])};
    kvx_outcome_t fo[5];
    memset(fo, 0x5a, sizeof(fo));
    for (int i = 0; i < 5; i++) {
        fi[i].field_mask &= ~KVX_FETCH_FIELD_TIMEOUT;
        fi[i].field_mask |= KVX_FETCH_FIELD_OUTCOME;
        fi[i].outcome = &fo[i];
    }
    fi[1].field_mask &= ~KVX_FETCH_FIELD_PARAMS;
    fi[1].field_mask |= KVX_FETCH_FIELD_CONTEXT;
    fi[1].context_instance = "a3b-ctx";
    fi[1].context_address = c.addr;
    fi[1].context_key = "b-aux";
    fi[1].context_key_len = 5;
    kvx_fetch_args_t fb = {
        .field_mask = KVX_FETCH_FIELD_ITEMS, .items = fi, .num_items = 5};
    rc = kvx_fetch3(g.c, &fb);
    CHECK_EQ(rc, fo[3].code);
    CHECK_EQ(fo[3].code, KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(fo[3].message, "params");
    CHECK_EQ(fo[4].code, KVX_ERR_EXISTS);
    CHECK(strcmp(fo[3].message, fo[4].message) != 0);
    CHECK_STR_CONTAINS(kvx_last_error(g.c), "kvx_fetch: item 3 (key gb-junk)");
    for (int i = 0; i < 5; i++)
        CHECK_EQ(fo[i].answered, 1);
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(fo[i].code, 0);
        CHECK(!strcmp(fo[i].message, ""));
    }
    fill_req(&c, 803, cb[2], 5);
    CHECK_KVX(kvx_layers_ready(c.c, "b-lw", 4, 0, c.nlayers, NULL, T_MS), c.c);
    ev_t e[8]; /* one batch may carry them all: collected together */
    CHECK_EQ(collect(g.c, e, 8, 3, 3000), 3);
    const char *gk[3] = {"gb-plain", "gb-aux", "gb-lw"};
    for (int i = 0; i < 3; i++) {
        int k = 0;
        while (k < 3 && (e[k].key_len != strlen(gk[i]) ||
                         memcmp(e[k].key, gk[i], e[k].key_len)))
            k++;
        CHECK(k < 3);
        CHECK_EQ(e[k].kind, KVX_EVENT_COMPLETE);
        CHECK_EQ(e[k].aux_len, i == 1 ? 11 : 0);
        CHECK(i != 1 || !memcmp(e[k].aux, "first-token", 11));
    }
    expect_t ex[3] = {{.req = 801, .blocks = gb[0], .ntok = 7},
                      {.req = 802, .blocks = gb[1], .ntok = 6},
                      {.req = 803, .blocks = gb[2], .ntok = 5}};
    CHECK_EQ(check_pool(&g, ex, 3, 0xa5), 0);
    for (int i = 0; i < 3; i++)
        kvx_context_params_free(&p[i]);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Block tables through the 3.0 batches: each context rank publishes a
 * hybrid request (KV, window, state slot; t_groups.c's model) as an item
 * of a batch with FIELD_GROUPS, and the generation rank fetches it as an
 * item of a batch beside one that fails; the three tables land and the
 * failing item has its own message. */
TEST(api3_batch_with_block_tables)
{
    daemon_t *d = daemon_start(NULL);
    hybrid_t h;
    hybrid_open(d, &h, "a3g-ctx", "a3g-gen");
    kvx_context_params_t p[2];
    for (int r = 0; r < 2; r++) {
        fill_req(&h.c[r], 310, hy_cb[r], HY_TOK);
        fill_req(&h.cw[r], 311, hy_cw[r], HY_TOK);
        fill_req(&h.cst[r], 312, &hy_cs[r], 1);
        kvx_group_t gs[2];
        hy_ctx_groups(&h, r, gs);
        kvx_outcome_t o;
        kvx_publish_args_t it =
            pub_args("310", h.c[r].pool, hy_cb[r], 3, HY_TOK, &p[r]);
        it.field_mask &= ~KVX_PUBLISH_FIELD_TIMEOUT;
        it.field_mask |= KVX_PUBLISH_FIELD_GROUPS | KVX_PUBLISH_FIELD_OUTCOME;
        it.groups = gs;
        it.num_groups = 2;
        it.outcome = &o;
        kvx_publish_args_t b = {.field_mask = KVX_PUBLISH_FIELD_ITEMS,
                                .items = &it,
                                .num_items = 1};
        CHECK_KVX(kvx_publish3(h.c[r].c, &b), h.c[r].c);
        CHECK_EQ(o.code, 0);
    }
    CHECK_EQ(p[0].len, p[1].len);
    CHECK(!memcmp(p[0].data, p[1].data, p[0].len));
    kvx_group_t gg[2];
    hy_gen_groups(&h, 4, gg);
    kvx_outcome_t fo[2];
    kvx_fetch_args_t fi[2] = {fetch_args("310", h.g.pool, hy_gb, 3, &p[0]),
                              fetch_args("g-none", h.g.pool, hy_gb, 3, &p[0])};
    for (int i = 0; i < 2; i++) {
        fi[i].field_mask &= ~KVX_FETCH_FIELD_TIMEOUT;
        fi[i].field_mask |= KVX_FETCH_FIELD_OUTCOME;
        fi[i].outcome = &fo[i];
    }
    fi[0].field_mask |= KVX_FETCH_FIELD_GROUPS;
    fi[0].groups = gg;
    fi[0].num_groups = 2;
    /* item 1: the same offer without its groups: MISMATCH, its own */
    kvx_fetch_args_t b = {
        .field_mask = KVX_FETCH_FIELD_ITEMS, .items = fi, .num_items = 2};
    CHECK_EQ(kvx_fetch3(h.g.c, &b), KVX_ERR_MISMATCH);
    CHECK_EQ(fo[0].code, 0);
    CHECK_EQ(fo[1].code, KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(fo[1].message, "fetch.groups: 0 other block tables");
    wait_event(h.g.c, 310, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(h.c[0].c, 310, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(h.c[1].c, 310, KVX_EVENT_COMPLETE, 0, 3000);
    hybrid_landed(&h, 310);
    kvx_context_params_free(&p[0]);
    kvx_context_params_free(&p[1]);
    hybrid_close(&h);
    daemon_healthy(d);
}

/* kvx_progress until *done >= n (or 3 s). */
static void progress3_reaches(const rank_t *g, kvx_progress_args_t *a,
                              uint32_t n)
{
    int64_t end = now_ms() + 3000;
    do {
        CHECK_KVX(kvx_progress(g->c, a), g->c);
        if (*a->layers_done >= n)
            return;
        sleep_ms(5);
    } while (now_ms() < end);
}

/* kvx_ready and kvx_progress through their args: a layer-wise offer
 * whose layers are said ready with the defaults (no event, every token,
 * the plain table), then by tokens with every field set, then by the
 * 2.x kvx_tokens_ready (a wrapper now); only ready rows move, progress
 * counts the landed layers and says ended, and a mark after the
 * transfer answers 0. */
TEST(api3_ready_and_progress)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "a3l-ctx", "a3l-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    memset(c.base, 0x11, c.size); /* no layer's KV yet */
    uint32_t cb[3] = {5, 0, 7}, gb[3] = {2, 6, 4};
    const uint32_t ntok = 10, req = 171;
    kvx_context_params_t p;
    kvx_publish_args_t pa = pub_args("a3l", c.pool, cb, 3, ntok, &p);
    pa.field_mask |= KVX_PUBLISH_FIELD_FLAGS;
    pa.flags = KVX_PUBLISH_LAYERWISE;
    CHECK_KVX(kvx_publish3(c.c, &pa), c.c);
    kvx_fetch_args_t fa = fetch_args("a3l-g", g.pool, gb, 3, &p);
    CHECK_KVX(kvx_fetch3(g.c, &fa), g.c);

    uint32_t done = 9, total = 0;
    int ended = 1;
    kvx_progress_args_t pr = {.field_mask = KVX_PROGRESS_FIELD_KEY |
                                            KVX_PROGRESS_FIELD_LAYERS |
                                            KVX_PROGRESS_FIELD_ENDED,
                              .key = "a3l-g",
                              .key_len = 5,
                              .layers_done = &done,
                              .num_layers = &total,
                              .ended = &ended};
    CHECK_KVX(kvx_progress(g.c, &pr), g.c);
    CHECK_EQ(done, 0);
    CHECK_EQ(total, 4);
    CHECK_EQ(ended, 0);

    /* layer 0, the defaults: it lands, the others stay */
    fill_layers(&c, req, cb, ntok, 0, 1);
    kvx_ready_args_t ra = {.field_mask =
                               KVX_READY_FIELD_KEY | KVX_READY_FIELD_LAYERS,
                           .key = "a3l",
                           .key_len = 3,
                           .first = 0,
                           .count = 1,
                           .tokens = 99, /* not in the mask: unread */
                           .group = 5};
    CHECK_KVX(kvx_ready(c.c, &ra), c.c);
    CHECK_EQ(tokens_arrive(&g, req, gb, 0, ntok, 0, 1), 0);
    progress3_reaches(&g, &pr, 1);
    CHECK_EQ(done, 1);
    CHECK_EQ(layers_hold(&g, req, gb, ntok, 1, 4, 0, 0xa5), 0);

    /* layers 1 to 3, tokens [0, 4) only, every field set */
    fill_tokens(&c, req, cb, 0, 4, 1, 4);
    ra = (kvx_ready_args_t){
        .field_mask = KVX_READY_FIELD_KEY | KVX_READY_FIELD_LAYERS |
                      KVX_READY_FIELD_TOKENS | KVX_READY_FIELD_GROUP |
                      KVX_READY_FIELD_CUDA_EVENT | KVX_READY_FIELD_TIMEOUT,
        .key = "a3l",
        .key_len = 3,
        .first = 1,
        .count = 3,
        .tokens = 4,
        .group = 0,
        .cuda_event = NULL,
        .timeout_ms = T_MS};
    CHECK_KVX(kvx_ready(c.c, &ra), c.c);
    CHECK_EQ(tokens_arrive(&g, req, gb, 0, 4, 1, 4), 0);
    CHECK_EQ(tokens_hold(&g, req, gb, 4, ntok, 1, 4, 0, 0xa5), 0);
    pr.field_mask |= KVX_PROGRESS_FIELD_GROUP | KVX_PROGRESS_FIELD_TIMEOUT;
    pr.group = 0;
    pr.timeout_ms = T_MS;
    CHECK_KVX(kvx_progress(g.c, &pr), g.c);
    CHECK_EQ(done, 1); /* layers 1 to 3 are not whole */

    /* the rest by the 2.x call, a wrapper of kvx_ready */
    fill_tokens(&c, req, cb, 4, ntok, 1, 4);
    CHECK_KVX(kvx_tokens_ready(c.c, "a3l", 3, 1, 3, 0, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "a3l-g", 5, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "a3l", 3, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = req, .blocks = gb, .ntok = ntok};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    /* ended and polled: no fetch to ask about; a late mark is 0 */
    CHECK_FAILS(kvx_progress(g.c, &pr), g.c, KVX_ERR_NOT_FOUND,
                "no fetch of request a3l-g");
    CHECK_KVX(kvx_ready(c.c, &ra), c.c);
    CHECK_KVX(kvx_layers_ready(c.c, "a3l", 3, 0, 1, NULL, T_MS), c.c);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* What kvx_ready and kvx_progress refuse, each by name, nothing sent:
 * NULL args, a field_mask bit unknown, a required field missing, count
 * 0, NULL out-pointers; a table the fetch does not have is the daemon's
 * refusal, reached through GROUP. The 2.x wrappers keep their names in
 * messages. */
TEST(api3_ready_progress_refused_by_name)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "a3m-ctx", "a3m-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    kvx_context_params_t p;
    kvx_publish_args_t pa = pub_args("a3m", c.pool, cb, 2, 8, &p);
    pa.field_mask |= KVX_PUBLISH_FIELD_FLAGS;
    pa.flags = KVX_PUBLISH_LAYERWISE;
    CHECK_KVX(kvx_publish3(c.c, &pa), c.c);
    kvx_fetch_args_t fa = fetch_args("a3m-g", g.pool, gb, 2, &p);
    CHECK_KVX(kvx_fetch3(g.c, &fa), g.c);

    CHECK_FAILS(kvx_ready(c.c, NULL), c.c, KVX_ERR_INVALID,
                "kvx_ready: args is NULL");
    kvx_ready_args_t ra = {.field_mask = KVX_READY_FIELD_KEY |
                                         KVX_READY_FIELD_LAYERS | (1ull << 6),
                           .key = "a3m",
                           .key_len = 3,
                           .count = 1};
    CHECK_FAILS(kvx_ready(c.c, &ra), c.c, KVX_ERR_INVALID,
                "kvx_ready: field_mask bit 0x40 is unknown to libkvxfer "
                "3.2.0 (it knows bits 0x3f: KVX_READY_FIELD_KEY to "
                "KVX_READY_FIELD_TIMEOUT)");
    ra.field_mask = KVX_READY_FIELD_KEY;
    CHECK_FAILS(kvx_ready(c.c, &ra), c.c, KVX_ERR_INVALID,
                "kvx_ready: field_mask lacks KVX_READY_FIELD_LAYERS");
    ra.field_mask = KVX_READY_FIELD_LAYERS;
    CHECK_FAILS(kvx_ready(c.c, &ra), c.c, KVX_ERR_INVALID,
                "kvx_ready: field_mask lacks KVX_READY_FIELD_KEY");
    ra.field_mask = KVX_READY_FIELD_KEY | KVX_READY_FIELD_LAYERS;
    ra.count = 0;
    CHECK_FAILS(kvx_ready(c.c, &ra), c.c, KVX_ERR_INVALID,
                "kvx_ready: count 0");
    CHECK_FAILS(kvx_layers_ready(c.c, "a3m", 3, 0, 0, NULL, T_MS), c.c,
                KVX_ERR_INVALID, "kvx_layers_ready: count 0");
    ra.count = 1;
    ra.key_len = 0;
    CHECK_FAILS(kvx_ready(c.c, &ra), c.c, KVX_ERR_INVALID,
                "kvx_ready: key of 0 bytes");

    uint32_t done, total;
    CHECK_FAILS(kvx_progress(g.c, NULL), g.c, KVX_ERR_INVALID,
                "kvx_progress: args is NULL");
    kvx_progress_args_t pr = {.field_mask = KVX_PROGRESS_FIELD_KEY |
                                            KVX_PROGRESS_FIELD_LAYERS |
                                            (1ull << 33),
                              .key = "a3m-g",
                              .key_len = 5,
                              .layers_done = &done,
                              .num_layers = &total};
    CHECK_FAILS(kvx_progress(g.c, &pr), g.c, KVX_ERR_INVALID,
                "kvx_progress: field_mask bit 0x200000000 is unknown to "
                "libkvxfer 3.2.0 (it knows bits 0x1f: KVX_PROGRESS_FIELD_KEY "
                "to KVX_PROGRESS_FIELD_TIMEOUT)");
    pr.field_mask = KVX_PROGRESS_FIELD_KEY;
    CHECK_FAILS(kvx_progress(g.c, &pr), g.c, KVX_ERR_INVALID,
                "kvx_progress: field_mask lacks KVX_PROGRESS_FIELD_LAYERS");
    pr.field_mask = KVX_PROGRESS_FIELD_KEY | KVX_PROGRESS_FIELD_LAYERS;
    pr.num_layers = NULL;
    CHECK_FAILS(kvx_progress(g.c, &pr), g.c, KVX_ERR_INVALID,
                "kvx_progress: layers_done or num_layers is NULL");
    pr.num_layers = &total;
    pr.field_mask |= KVX_PROGRESS_FIELD_GROUP;
    pr.group = 1;
    CHECK_FAILS(kvx_progress(g.c, &pr), g.c, KVX_ERR_INVALID,
                "fetch_progress.group: 1, but request a3m-g has 1 block "
                "table");
    pr.group = 0;
    CHECK_KVX(kvx_progress(g.c, &pr), g.c);
    CHECK_EQ(done, 0);
    CHECK_EQ(total, 4);
    CHECK_FAILS(kvx_fetch_progress(g.c, "a3m-g", 5, NULL, &total, NULL, T_MS),
                g.c, KVX_ERR_INVALID, "kvx_fetch_progress: layers_done");

    /* nothing refused above reached the daemon: the offer still waits */
    CHECK_KVX(kvx_layers_ready(c.c, "a3m", 3, 0, 4, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "a3m-g", 5, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "a3m", 3, 3000).kind, KVX_EVENT_COMPLETE);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* kvx_reserve through its args (kvx_reserve3 here): the scheduler's
 * params come at once, the rank's kvx_publish returns the same bytes,
 * and a fetch made before the publish lands them. The 2.x kvx_reserve
 * (kvx_reserve@KVXFER_2.0) and kvx_reserve_groups still reserve, with
 * their names in messages; the args are refused by name. */
TEST(api3_reserve)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "a3s-ctx", "a3s-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_context_params_t rp, pp, xp = {0};
    kvx_reserve_args_t ra = {
        .field_mask = KVX_RESERVE_FIELD_KEY | KVX_RESERVE_FIELD_INSTANCE |
                      KVX_RESERVE_FIELD_NUM_TOKENS | KVX_RESERVE_FIELD_PARAMS,
        .key = "a3s",
        .key_len = 3,
        .instance_id = "a3s-ctx",
        .num_tokens = 7,
        .params = &rp,
        .pool_id = 77, /* not in the mask: unread */
        .num_groups = 3};
    CHECK_KVX(kvx_reserve3(sched, &ra), sched);
    kvx_params_info_t info;
    CHECK_EQ(kvx_params_info(rp.data, rp.len, &info), KVX_OK);
    CHECK_EQ(info.num_tokens, 7);
    CHECK(!strcmp(info.instance_id, "a3s-ctx"));

    /* refused by name, nothing sent */
    CHECK_FAILS(kvx_reserve3(sched, NULL), sched, KVX_ERR_INVALID,
                "kvx_reserve: args is NULL");
    kvx_reserve_args_t bad = ra;
    bad.key = "a3s-x";
    bad.key_len = 5;
    bad.params = &xp;
    bad.field_mask |= 1ull << 10;
    CHECK_FAILS(kvx_reserve3(sched, &bad), sched, KVX_ERR_INVALID,
                "kvx_reserve: field_mask bit 0x400 is unknown to libkvxfer "
                "3.2.0 (it knows bits 0x3ff: KVX_RESERVE_FIELD_KEY to "
                "KVX_RESERVE_FIELD_ITEMS)");
    bad.field_mask = ra.field_mask & ~KVX_RESERVE_FIELD_INSTANCE;
    CHECK_FAILS(kvx_reserve3(sched, &bad), sched, KVX_ERR_INVALID,
                "kvx_reserve: field_mask lacks KVX_RESERVE_FIELD_INSTANCE");
    bad.field_mask = ra.field_mask & ~KVX_RESERVE_FIELD_PARAMS;
    CHECK_FAILS(kvx_reserve3(sched, &bad), sched, KVX_ERR_INVALID,
                "kvx_reserve: field_mask lacks KVX_RESERVE_FIELD_PARAMS");
    bad.field_mask = ra.field_mask;
    bad.instance_id = NULL;
    CHECK_FAILS(kvx_reserve3(sched, &bad), sched, KVX_ERR_INVALID,
                "kvx_reserve: instance_id is NULL");
    bad.instance_id = "a3s-ctx";
    bad.field_mask |= KVX_RESERVE_FIELD_GROUPS;
    bad.groups = NULL;
    bad.num_groups = 1;
    CHECK_FAILS(kvx_reserve3(sched, &bad), sched, KVX_ERR_INVALID,
                "kvx_reserve: groups is NULL with ngroups 1");
    /* the daemon's refusals, through every optional field */
    bad = ra;
    bad.field_mask |= KVX_RESERVE_FIELD_POOL | KVX_RESERVE_FIELD_GROUPS |
                      KVX_RESERVE_FIELD_TIMEOUT;
    bad.pool_id = 0;
    bad.groups = NULL;
    bad.num_groups = 0;
    bad.timeout_ms = T_MS;
    bad.params = &xp;
    CHECK_FAILS(kvx_reserve3(sched, &bad), sched, KVX_ERR_EXISTS,
                "a3s of instance a3s-ctx is reserved");
    /* the 2.x calls, wrappers now */
    CHECK_FAILS(kvx_reserve(sched, "a3s-ctx", "z", 1, 0, &xp, T_MS), sched,
                KVX_ERR_INVALID, "reserve.num_tokens: 0");
    CHECK_FAILS(kvx_reserve(sched, "a3s-ctx", "", 0, 7, &xp, T_MS), sched,
                KVX_ERR_INVALID, "kvx_reserve: key of 0 bytes");
    CHECK_FAILS(
        kvx_reserve_groups(sched, "a3s-ctx", "z", 1, 7, 0, NULL, 2, &xp, T_MS),
        sched, KVX_ERR_INVALID,
        "kvx_reserve_groups: groups is NULL with ngroups 2");
    kvx_context_params_t p2;
    CHECK_KVX(kvx_reserve(sched, "a3s-ctx", "a3s-2", 5, 4, &p2, T_MS), sched);
    CHECK_EQ(kvx_params_info(p2.data, p2.len, &info), KVX_OK);
    CHECK_EQ(info.num_tokens, 4);
    kvx_context_params_free(&p2);
    kvx_close(sched);

    /* the fetch first; the publish returns the reserved params */
    uint32_t cb[2] = {6, 2}, gb[2] = {3, 4};
    kvx_fetch_args_t fa = fetch_args("a3s-g", g.pool, gb, 2, &rp);
    CHECK_KVX(kvx_fetch3(g.c, &fa), g.c);
    ev_t e[4];
    CHECK_EQ(collect(g.c, e, 4, 1, 200), 0); /* nothing yet */
    fill_req(&c, 4343, cb, 7);
    kvx_publish_args_t pa = pub_args("a3s", c.pool, cb, 2, 7, &pp);
    CHECK_KVX(kvx_publish3(c.c, &pa), c.c);
    CHECK_EQ(pp.len, rp.len);
    CHECK(!memcmp(pp.data, rp.data, rp.len));
    CHECK_EQ(wait_key(g.c, "a3s-g", 5, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "a3s", 3, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = 4343, .blocks = gb, .ntok = 7};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&rp);
    kvx_context_params_free(&pp);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}
