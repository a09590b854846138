/*
 * t_release.c — a published request released without a transfer
 * (kvx_release): by a rank or a process that is not one, on one daemon
 * and across two; the refusals; a release racing a fetch.
 */

/* A context rank and a generation rank on daemon d, one published
 * request (id 1, blocks 1 and 2, 7 tokens). */
static void rl_setup(daemon_t *d, const char *tag, rank_t *c, rank_t *g,
                     side_t *cs, side_t *gs, kvx_context_params_t *p)
{
    char ci[32], gi[32];
    snprintf(ci, sizeof(ci), "%s-ctx", tag);
    snprintf(gi, sizeof(gi), "%s-gen", tag);
    static char cbuf[4][32];
    static int k;
    snprintf(cbuf[k % 4], 32, "%s", ci);
    snprintf(cbuf[(k + 1) % 4], 32, "%s", gi);
    pair_open(d, &M_SMALL, cbuf[k % 4], cbuf[(k + 1) % 4], 8, c, g, cs, gs);
    k += 2;
    uint32_t cb[2] = {1, 2};
    fill_req(c, 1, cb, 7);
    CHECK_KVX(kvx_publish(c->c, 1, c->pool, cb, 2, 7, p, T_MS), c->c);
}

/* Released by a router process (an observer connection, no Hello): the
 * context rank gets COMPLETE "released" in its next batch, the offer is
 * gone (a fetch of it finds nothing), and its pool is free again at once
 * (deregistering it works). Releasing it again, or with a token that is
 * not the offer's, or with garbage, is refused by name. */
TEST(release_by_router)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    kvx_context_params_t p;
    rl_setup(d, "rl", &c, &g, &cs, &gs, &p);
    kvx_client_t *router;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &router), 0);
    /* a token that is not the offer's: refused, nothing ends */
    uint8_t forged[4096];
    CHECK(p.len <= sizeof(forged));
    memcpy(forged, p.data, p.len);
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p.len, p.data);
    CHECK(cp != NULL && cp->token.len > 0);
    cp->token.data[0] ^= 1;
    size_t fl = kvxfer__context_params__get_packed_size(cp);
    kvxfer__context_params__pack(cp, forged);
    kvxfer__context_params__free_unpacked(cp, NULL);
    CHECK_FAILS(kvx_release(router, forged, fl, T_MS), router, KVX_ERR_AUTH,
                "token is not that of request 1");
    CHECK_FAILS(kvx_release(router, "junk", 4, T_MS), router,
                KVX_ERR_INVALID, "context_params");
    /* the release */
    CHECK_KVX(kvx_release(router, p.data, p.len, T_MS), router);
    ev_t e = wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 3000);
    CHECK_STR_CONTAINS(e.msg, "released");
    /* gone: again, and a fetch of it */
    CHECK_FAILS(kvx_release(router, p.data, p.len, T_MS), router,
                KVX_ERR_NOT_FOUND, "no offer of request 1");
    uint32_t gb[2] = {3, 4};
    fetch_fails_later(&g, 1, p.data, p.len, gb, 2, KVX_ERR_NOT_FOUND,
                      "context side: released (kvx_release)");
    /* the context pool is no one's any more: it deregisters */
    CHECK_KVX(kvx_pool_deregister(c.c, c.pool, T_MS), c.c);
    c.pool = 0;
    kvx_close(router);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* A release racing a fetch: the fetch of 64 MiB (slow copies: 4 KiB
 * chunks, one at a time) came first, so the release is refused (STATE,
 * "being fetched") and the transfer completes, every byte where it
 * belongs; one terminal event each side. The other order (release
 * first, the fetch finds nothing) is in release_by_router. */
TEST(release_racing_a_fetch)
{
    daemon_t *d = daemon_start(SLOW_CFG);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "rr-ctx", "rr-gen", BIG_BLOCKS, &c, &g, &cs, &gs);
    memset(c.base, 0x11, c.size);
    memset(g.base, 0xa5, g.size);
    uint32_t *bl = big_blocks();
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, bl, BIG_BLOCKS, 0,
                        T_MS),
              g.c);
    CHECK_FAILS(kvx_release(g.c, p.data, p.len, T_MS), g.c, KVX_ERR_STATE,
                "being fetched");
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 60000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 60000);
    CHECK(memcmp(g.base, c.base, g.size) == 0); /* all of it arrived */
    free(bl);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* A second release answers NOT_FOUND, whatever state the first left the
 * offer in: gone (every rank had published), or kept for a rank that
 * publishes later (replicated heads: MLA, tp 2 over one latent head,
 * rank 1 not yet published); and so does a release of an offer whose
 * transfer completed. The message says which, while the daemon
 * remembers the key. */
TEST(release_twice)
{
    daemon_t *d = daemon_start(NULL);
    model_t mla = {.layers = 2,
                   .heads = 1,
                   .head_dim = 32,
                   .kv = 1,
                   .dtype = KVX_DTYPE_BF16};
    side_t cs = {.inst = "r2-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 2,
                 .pp = 1,
                 .preset = "mla",
                 .tpb = 4};
    side_t gs = {.inst = "r2-gen",
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
    kvx_client_t *router;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &router), 0);
    uint32_t bl[2] = {2, 5};
    kvx_context_params_t p, q;
    /* rank 1 has not published: the release keeps the offer for it */
    CHECK_KVX(kvx_publish(c0.c, 1, c0.pool, bl, 2, 7, &p, T_MS), c0.c);
    CHECK_KVX(kvx_release(router, p.data, p.len, T_MS), router);
    CHECK_STR_CONTAINS(wait_event(c0.c, 1, KVX_EVENT_COMPLETE, 0, 3000).msg,
                       "released");
    CHECK_FAILS(kvx_release(router, p.data, p.len, T_MS), router,
                KVX_ERR_NOT_FOUND, "request 1 of instance r2-ctx was released");
    /* rank 1 publishes late: the offer is gone, and still NOT_FOUND */
    CHECK_KVX(kvx_publish(c1.c, 1, c1.pool, bl, 2, 7, &q, T_MS), c1.c);
    kvx_context_params_free(&q);
    CHECK_FAILS(kvx_release(router, p.data, p.len, T_MS), router,
                KVX_ERR_NOT_FOUND, "request 1 of instance r2-ctx was released");
    kvx_context_params_free(&p);
    /* complete: fetched, then released */
    fill_req(&c0, 2, bl, 7);
    CHECK_KVX(kvx_publish(c0.c, 2, c0.pool, bl, 2, 7, &p, T_MS), c0.c);
    CHECK_KVX(kvx_publish(c1.c, 2, c1.pool, bl, 2, 7, &q, T_MS), c1.c);
    kvx_context_params_free(&q);
    CHECK_KVX(kvx_fetch(g.c, 2, p.data, p.len, g.pool, bl, 2, 0, T_MS), g.c);
    wait_event(g.c, 2, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c0.c, 2, KVX_EVENT_COMPLETE, 0, 3000);
    CHECK_FAILS(kvx_release(router, p.data, p.len, T_MS), router,
                KVX_ERR_NOT_FOUND, "request 2 of instance r2-ctx is complete");
    kvx_context_params_free(&p);
    kvx_close(router);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* kvx_params_info(): what a router or a generation rank needs from the
 * params, without the daemon; garbage refused, naming why. */
TEST(params_info)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    kvx_context_params_t p;
    rl_setup(d, "pi", &c, &g, &cs, &gs, &p);
    kvx_params_info_t info;
    CHECK_EQ(kvx_params_info(p.data, p.len, &info), KVX_OK);
    CHECK(!strcmp(info.instance_id, cs.inst));
    CHECK_EQ(info.request_id, 1);
    CHECK_EQ(info.num_tokens, 7);
    CHECK_EQ(info.tokens_per_block, 4);
    CHECK_EQ(info.context_ranks, 1);
    CHECK_EQ(info.num_layers, M_SMALL.layers);
    CHECK_EQ(info.num_kv_heads, M_SMALL.heads);
    CHECK(!strncmp(info.rank0_address, "kvx://", 6));
    CHECK_EQ(kvx_params_info("\xff\xff", 2, &info), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(NULL), "kvx_params_info: 2 bytes");
    CHECK_KVX(kvx_cancel(c.c, 1, T_MS), c.c);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* A fetch refused on one generation rank while the other rank's was
 * accepted: the request cannot complete, so it ends for both ranks at
 * once (ERROR with the refusal's code, naming the rank) instead of at
 * deadlines.fetch_timeout_ms (30 s); the offer is free for another
 * fetch. */
TEST(fetch_refused_on_one_rank_ends_all)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs = {.inst = "fr-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    side_t gs = {.inst = "fr-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c, g0, g1;
    rank_open(d, &M_SMALL, &cs, 0, 8, &c);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g0);
    rank_open(d, &M_SMALL, &gs, 1, 8, &g1);
    uint32_t cb[2] = {1, 2}, gb[2] = {3, 4};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g0.c, 1, p.data, p.len, g0.pool, gb, 2, 0, T_MS), g0.c);
    int64_t t0 = now_ms();
    /* one block cannot hold 7 tokens of 4 a block */
    CHECK_FAILS(kvx_fetch(g1.c, 1, p.data, p.len, g1.pool, gb, 1, 0, T_MS),
                g1.c, KVX_ERR_INVALID, "cannot hold");
    ev_t e = wait_event(g0.c, 1, KVX_EVENT_ERROR, KVX_ERR_INVALID, 3000);
    fprintf(stderr, "rank 0: %s (%lld ms)\n", e.msg,
            (long long)(now_ms() - t0));
    CHECK_STR_CONTAINS(e.msg, "rank 1's fetch was refused");
    wait_event(g1.c, 1, KVX_EVENT_ERROR, KVX_ERR_INVALID, 3000);
    CHECK(now_ms() - t0 < 3000);
    kvx_context_params_free(&p);
    rank_close(&g1);
    rank_close(&g0);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* A rank that never polls (limits.batches_kept 16): rank 0 of a tp-2
 * context instance publishes and cancels 20 requests, reading each
 * batch; rank 1 never polls. The daemon keeps 16 batches, and rank 1's
 * first poll says LIMIT, naming the batches it missed and the key; its
 * next poll reads on. */
TEST(batches_kept_for_a_silent_rank)
{
    daemon_t *d = daemon_start("limits:\n  batches_kept: 16\n");
    side_t cs;
    rank_t c0, c1;
    ctx2_open(d, &M_SMALL, "bk-ctx", 8, &cs, &c0, &c1);
    uint32_t cb[1] = {1};
    for (uint64_t k = 1; k <= 20; k++) {
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c0.c, k, c0.pool, cb, 1, 4, &p, T_MS), c0.c);
        kvx_context_params_free(&p);
        CHECK_KVX(kvx_cancel(c0.c, k, T_MS), c0.c);
        wait_event(c0.c, k, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
    }
    kvx_batch_t *b = NULL;
    int rc = kvx_poll(c1.c, 1, 100, &b);
    fprintf(stderr, "rank 1: %s: %s\n", kvx_status_name(rc),
            kvx_last_error(c1.c));
    CHECK_EQ(rc, KVX_ERR_LIMIT);
    CHECK_STR_CONTAINS(kvx_last_error(c1.c), "limits.batches_kept 16");
    CHECK_EQ(kvx_poll(c1.c, 1, 100, &b), KVX_OK);
    CHECK(b != NULL && b->num_events >= 1);
    kvx_batch_free(b);
    rank_close(&c1);
    rank_close(&c0);
    daemon_stop_ok(d);
}
