/*
 * t_peer_transfer.c — transfers between two daemons, every byte checked:
 * both directions, pools between guard bands, slots larger than a
 * message sent in pieces, an offer that ended first, many requests at
 * once, copy jobs that fail, lanes (mixed counts, unreachable, stalled);
 * and forged input that must get nowhere: a wrong token, another cluster
 * secret, forged params, a fake peer's handshake shortcuts and a replayed
 * OPEN.
 */

/* Context on A, generation on B, and back: every rank its own process,
 * the whole generation pool compared; also a context instance of tp 2
 * whose two sources are both remote. */
TEST_T(peer_transfer_both_directions, 90)
{
    daemon_t *a, *b;
    p_closes_once = 1; /* lanes connected both ways share endpoints */
    p_two_daemons(&a, &b);
    /* the addresses are the peer.listen IPs with the bound ports */
    rank_t r;
    side_t s;
    p_side(&s, "pb-addr", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    rank_hello_only(a, &M_SMALL, &s, 0, &r);
    p_check_addr(&r, 0, NULL, 0);
    rank_close(&r);
    rank_hello_only(b, &M_SMALL, &s, 0, &r);
    p_check_addr(&r, 1, NULL, 0);
    rank_close(&r);
    side_t c = {
        .inst = "pb-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g = {
        .inst = "pb-gen", .tp = 1, .pp = 1, .preset = "flashinfer", .tpb = 8};
    xfer_case2(a, b, &M_SMALL, &c, &g, 8, 45, 0);
    side_t c2 = {
        .inst = "pb-ctx2", .tp = 2, .pp = 1, .preset = "trtllm", .tpb = 8};
    side_t g2 = {
        .inst = "pb-gen2", .tp = 1, .pp = 1, .preset = "vllm-hnd", .tpb = 4};
    xfer_case2(b, a, &M_SMALL, &c2, &g2, 6, 37, 0);
    /* and with skip_tokens, generation tp 2 */
    side_t c3 = {
        .inst = "pb-ctx3", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g3 = {
        .inst = "pb-gen3", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case2(a, b, &M_SMALL, &c3, &g3, 4, 40, 13);
    p_stop_both(a, b);
}

/* Pools of regions across two daemons: the context daemon gathers from
 * a region per layer, the generation daemon scatters into a K and a V
 * region per layer (and back), every byte checked. */
TEST_T(peer_transfer_regions, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t c = {.inst = "pr-ctx",
                .tp = 1,
                .pp = 1,
                .preset = "vllm-nhd",
                .tpb = 8,
                .split = 1};
    side_t g = {.inst = "pr-gen",
                .tp = 2,
                .pp = 1,
                .preset = "flashinfer",
                .tpb = 4,
                .split = 2};
    xfer_case2(a, b, &M_SMALL, &c, &g, 6, 45, 0);
    side_t c2 = {.inst = "pr-ctx2",
                 .tp = 1,
                 .pp = 1,
                 .preset = "sglang",
                 .tpb = 1,
                 .split = 2};
    side_t g2 = {
        .inst = "pr-gen2", .tp = 1, .pp = 1, .preset = "trtllm", .tpb = 16};
    xfer_case2(b, a, &M_SMALL, &c2, &g2, 4, 37, 7);
    p_stop_both(a, b);
}

/* Pools inside one memfd between guard bands, across two daemons: the
 * context daemon gathers from an offset pool into its slots, the
 * generation daemon scatters into one; nothing outside moves. */
TEST_T(peer_host_pools_guard_bands, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    uint64_t seed = 41;
    char tag[48];
    for (int k = 0; k < 8; k++) {
        snprintf(tag, sizeof(tag), "pgb%d", k);
        gb_case(k % 2 ? b : a, k % 2 ? a : b, tag, gb_presets[k % 4],
                gb_presets[(k / 2) % 4], &seed);
    }
    p_stop_both(a, b);
}

/* A slot larger than peer.message_bytes goes as pieces cut on unit
 * boundaries (here 8 of 64 KiB, two 32 KiB units each), one in flight at
 * a time, each scattered as it lands: every byte lands, both ways, with
 * the presets' different row shapes; then units of 128 KiB, larger than
 * a piece, go one a piece. Status reports the settings and every slot. */
TEST_T(peer_slot_in_pieces, 90)
{
    static const char *const extra = "  slot_bytes: 512KiB\n"
                                     "  message_bytes: 72KiB\n"
                                     "  send_window: 1\n";
    daemon_t *a, *b;
    p_two_daemons_with(extra, &a, &b);
    p_both_ways(a, b, "pp", 4, 3); /* about five slots a request */
    /* 32 heads over tp 2: a unit is 16 tokens x 16 heads x 256 B x 2 */
    static const model_t big = {.layers = 2,
                                .heads = 32,
                                .head_dim = 128,
                                .kv = 2,
                                .dtype = KVX_DTYPE_BF16};
    side_t c3 = {
        .inst = "pp-ctx3", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g3 = {
        .inst = "pp-gen3", .tp = 2, .pp = 1, .preset = "trtllm", .tpb = 16};
    xfer_case2(a, b, &big, &c3, &g3, 3, 100, 0);
    for (int i = 0; i < 2; i++) {
        char *json = status_json(i ? b : a);
        char *ucx = p_json_section(json, "\"ucx\":");
        CHECK(ucx != NULL);
        CHECK_EQ(json_num(ucx, "slot_bytes"), 512 * 1024);
        /* peer.slots 0: as many as fit in 32 MiB */
        CHECK_EQ(json_num(ucx, "slots"), 64);
        CHECK_EQ(json_num(ucx, "message_bytes"), 72 * 1024);
        CHECK_EQ(json_num(ucx, "send_window"), 1);
        free(ucx);
        free(json);
    }
    /* every slot sent was received whole, each way */
    p_sent_is_received(a, b);
    p_sent_is_received(b, a);
    p_slots_all_free(a);
    p_slots_all_free(b);
    p_stop_both(a, b);
}

/* peer.direct 1: a piece whose destination runs average 2 KiB or more
 * is received by UCX straight into the generation pool (an iov of its
 * runs), with no scatter after, and one whose source runs do is sent
 * straight from the context pool, with no gather before; one of shorter
 * runs (trtllm: a row a run) goes through the slot; a daemon with
 * peer.direct 0 always gathers and scatters. (The default, 2, is 1 with
 * fewer than 4 CPUs.) Every byte checked each way, every slot back. */
TEST_T(peer_direct_receive, 90)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, "  direct: 1\n", NULL);
    daemon_t *b = p_daemon(1, P_SECRET, "  direct: 0\n", NULL);
    /* vllm-nhd, 16 tokens of 4 heads x 256 B: 16 KiB runs */
    side_t c = {
        .inst = "pd-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g = {
        .inst = "pd-gen", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    xfer_case2(a, b, &M_8K, &c, &g, 4, 300, 0); /* B: off */
    CHECK_EQ(p_direct(b), 0);
    long long sent = p_direct_sent(a); /* A: on */
    fprintf(stderr, "pieces A sent straight from its blocks: %lld\n", sent);
    CHECK(sent > 0);
    side_t c2 = c, g2 = g;
    c2.inst = "pd-ctx2";
    g2.inst = "pd-gen2";
    xfer_case2(b, a, &M_8K, &c2, &g2, 4, 300, 3); /* A: on */
    long long n = p_direct(a);
    fprintf(stderr, "pieces A received straight into its blocks: %lld\n", n);
    CHECK(n > 0);
    /* trtllm rows (256 B a run): through the slot */
    side_t g3 = {
        .inst = "pd-gen3", .tp = 1, .pp = 1, .preset = "trtllm", .tpb = 16};
    c2.inst = "pd-ctx3";
    xfer_case2(b, a, &M_8K, &c2, &g3, 3, 300, 0);
    CHECK_EQ(p_direct(a), n);
    CHECK_EQ(p_direct_sent(b), 0); /* B: off */
    /* trtllm rows on A's side as the source: gathered */
    side_t c4 = {
        .inst = "pd-ctx4", .tp = 1, .pp = 1, .preset = "trtllm", .tpb = 16};
    g2.inst = "pd-gen4";
    xfer_case2(a, b, &M_8K, &c4, &g2, 3, 300, 0);
    CHECK_EQ(p_direct_sent(a), sent);
    p_sent_is_received(a, b);
    p_sent_is_received(b, a);
    p_slots_all_free(a);
    p_slots_all_free(b);
    p_stop_both(a, b);
}

/* A fetch on B for an offer A's engine already cancelled: A remembers the
 * cancel, so the request ends at once with CANCELLED, as on one daemon
 * (not NOT_FOUND, nor after the retry window for ranks that have not
 * published yet); an offer that completed: A serves every rank of that
 * instance, so its NOT_FOUND is final and the request ends at once. */
TEST_T(peer_open_for_ended_offer, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pe-ctx", "pe-gen", &c, &g);
    uint32_t cb[2] = {4, 5}, gb[2] = {1, 2};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 61, c.pool, cb, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_cancel(c.c, 61, T_MS), c.c);
    wait_event(c.c, 61, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 2000);
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch(g.c, 61, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t e = wait_event(g.c, 61, KVX_EVENT_ERROR, KVX_ERR_CANCELLED, 5000);
    int64_t took = now_ms() - t0;
    fprintf(stderr, "CANCELLED after %lld ms: %s\n", (long long)took, e.msg);
    CHECK_STR_CONTAINS(e.msg, "context side: cancelled by the context side");
    /* the retry window is the fetch timeout; a final answer is one round
     * trip */
    CHECK(took < 1500);
    kvx_context_params_free(&p);

    /* completed, then fetched again with the same params: final too */
    uint32_t gb2[2] = {3, 6};
    p_one(&c, &g, 62, cb, gb, 2, 8, 5000);
    CHECK_KVX(kvx_publish(c.c, 63, c.pool, cb, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 63, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 63, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 63, KVX_EVENT_COMPLETE, 0, 5000);
    t0 = now_ms();
    CHECK_KVX(kvx_fetch(g.c, 64, p.data, p.len, g.pool, gb2, 2, 0, T_MS), g.c);
    e = wait_event(g.c, 64, KVX_EVENT_ERROR, KVX_ERR_NOT_FOUND, 5000);
    took = now_ms() - t0;
    fprintf(stderr, "again: NOT_FOUND after %lld ms: %s\n", (long long)took,
            e.msg);
    CHECK_STR_CONTAINS(e.msg, "expired, cancelled or completed");
    CHECK(strstr(e.msg, "not yet published") == NULL);
    CHECK(took < 1500);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* 64 requests in flight at once, half A -> B and half B -> A. */
TEST_T(peer_many_concurrent, 60)
{
    enum { N = 64, H = N / 2, TOK = 10, TPB = 4, NB = 3 };
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    model_t m = {.layers = 2,
                 .heads = 2,
                 .head_dim = 16,
                 .kv = 2,
                 .dtype = KVX_DTYPE_BF16};
    side_t cas, gbs, cbs, gas;
    p_side(&cas, "pm-ctx-a", KVX_ROLE_CONTEXT, "vllm-nhd", TPB);
    p_side(&gbs, "pm-gen-b", KVX_ROLE_GENERATION, "flashinfer", TPB);
    p_side(&cbs, "pm-ctx-b", KVX_ROLE_CONTEXT, "trtllm", TPB);
    p_side(&gas, "pm-gen-a", KVX_ROLE_GENERATION, "vllm-nhd", TPB);
    rank_t ca, gb, cb, ga;
    rank_open(a, &m, &cas, 0, H * NB, &ca);
    rank_open(b, &m, &gbs, 0, H * NB, &gb);
    rank_open(b, &m, &cbs, 0, H * NB, &cb);
    rank_open(a, &m, &gas, 0, H * NB, &ga);
    memset(gb.base, 0xa5, gb.size);
    memset(ga.base, 0xa5, ga.size);
    static uint32_t cbl[N][NB], gbl[N][NB];
    static kvx_context_params_t p[N];
    /* request q < H: ca -> gb; q >= H: cb -> ga */
    for (uint32_t q = 0; q < N; q++) {
        uint32_t k = q % H;
        for (uint32_t i = 0; i < NB; i++) {
            cbl[q][i] = i * H + k;
            gbl[q][i] = (NB - 1 - i) * H + (H - 1 - k);
        }
        rank_t *c = q < H ? &ca : &cb;
        fill_req(c, 3000 + q, cbl[q], TOK);
        CHECK_KVX(
            kvx_publish(c->c, 3000 + q, c->pool, cbl[q], NB, TOK, &p[q], T_MS),
            c->c);
    }
    /* interleaved: both directions in flight together */
    for (uint32_t k = 0; k < H; k++)
        for (uint32_t half = 0; half < 2; half++) {
            uint32_t q = half * H + k;
            rank_t *g = half ? &ga : &gb;
            CHECK_KVX(kvx_fetch(g->c, 3000 + q, p[q].data, p[q].len, g->pool,
                                gbl[q], NB, 0, T_MS),
                      g->c);
        }
    static ev_t e[4][H + 16];
    rank_t *who[4] = {&gb, &ga, &ca, &cb};
    for (int i = 0; i < 4; i++) {
        int n = collect(who[i]->c, e[i], H + 16, H, 15000);
        if (n != H) {
            fprintf(stderr, "%s: %d of %d events\n", who[i]->s->inst, n, H);
            print_events(who[i]->s->inst, e[i], n < H + 16 ? n : H + 16);
        }
        CHECK_EQ(n, H);
    }
    /* nothing more arrives: exactly once */
    for (int i = 0; i < 4; i++) {
        kvx_batch_t *bt;
        CHECK_KVX(kvx_poll(who[i]->c, 1, 100, &bt), who[i]->c);
        CHECK_EQ(bt->num_events, 0);
        kvx_batch_free(bt);
    }
    static expect_t ea[H], eb[H];
    for (uint32_t q = 0; q < N; q++) {
        int half = q >= H;
        expect_event(e[half ? 1 : 0], H, 3000 + q, KVX_EVENT_COMPLETE, 0);
        expect_event(e[half ? 3 : 2], H, 3000 + q, KVX_EVENT_COMPLETE, 0);
        (half ? ea : eb)[q % H] = (expect_t){3000 + q, gbl[q], TOK, 0};
        kvx_context_params_free(&p[q]);
    }
    CHECK_EQ(check_pool(&gb, eb, H, 0xa5), 0);
    CHECK_EQ(check_pool(&ga, ea, H, 0xa5), 0);
    rank_close(&ca);
    rank_close(&gb);
    rank_close(&cb);
    rank_close(&ga);
    p_stop_both(a, b);
}

/* A forged capability token travels to the context daemon and is refused
 * there: the fetch is accepted, then ends ERROR AUTH; nothing is written;
 * the offer stays and the genuine params then complete. */
TEST_T(peer_wrong_token, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pt-ctx", "pt-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    /* connected first, so the bound below is the token check's */
    uint32_t wc[1] = {0}, wg[1] = {7};
    p_one(&c, &g, 30, wc, wg, 1, 3, 5000);
    expect_t ex[2] = {{30, wg, 3, 0}};
    uint32_t cb[2] = {3, 1}, gb[2] = {6, 2};
    fill_req(&c, 31, cb, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 31, c.pool, cb, 2, 8, &p, T_MS), c.c);

    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p.len, p.data);
    CHECK(cp != NULL);
    CHECK_EQ(cp->token.len, 16);
    cp->token.data[5] ^= 0x40;
    size_t flen = kvxfer__context_params__get_packed_size(cp);
    uint8_t *forged = malloc(flen);
    CHECK(forged != NULL);
    kvxfer__context_params__pack(cp, forged);
    kvxfer__context_params__free_unpacked(cp, NULL);
    CHECK_KVX(kvx_fetch(g.c, 31, forged, flen, g.pool, gb, 2, 0, T_MS), g.c);
    free(forged);
    ev_t e = wait_event(g.c, 31, KVX_EVENT_ERROR, KVX_ERR_AUTH, 1000);
    fprintf(stderr, "forged token: \"%s\"\n", e.msg);
    sleep_ms(100);
    CHECK_EQ(check_pool(&g, ex, 1, 0xa5), 0);
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK_STR_CONTAINS(json, "\"request_id\":31,\"side\":\"context\","
                             "\"state\":\"offered\"");
    free(json);

    /* the genuine params: complete, and only now bytes arrive */
    CHECK_KVX(kvx_fetch(g.c, 31, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 31, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 31, KVX_EVENT_COMPLETE, 0, 5000);
    ex[1] = (expect_t){31, gb, 8, 0};
    CHECK_EQ(check_pool(&g, ex, 2, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* B holds another cluster secret: its fetch from A ends ERROR AUTH naming
 * authentication, the refusing daemon logs it, the offer is untouched and
 * both daemons carry on. */
TEST_T(peer_wrong_secret, 60)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    daemon_t *b = p_daemon(1, P_SECRET_OTHER, NULL, NULL);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "ps-ctx", "ps-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t bl[2] = {0, 1};
    fill_req(&c, 41, bl, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 41, c.pool, bl, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 41, p.data, p.len, g.pool, bl, 2, 0, T_MS), g.c);
    /* connect + authentication are bounded by peer.connect_timeout_ms */
    ev_t e = wait_event(g.c, 41, KVX_EVENT_ERROR, KVX_ERR_AUTH, 7000);
    CHECK_STR_CONTAINS(e.msg, "authentication");
    int64_t end = now_ms() + 2000;
    while (!log_contains(a, "authentication failed") &&
           !log_contains(b, "authentication failed") && now_ms() < end)
        sleep_ms(20);
    if (!log_contains(a, "authentication failed") &&
        !log_contains(b, "authentication failed")) {
        dump_tail(a->log, 20);
        dump_tail(b->log, 20);
        CHECK(!"a daemon logs \"authentication failed\"");
    }
    CHECK_EQ(check_pool(&g, NULL, 0, 0xa5), 0);
    /* an unauthenticated peer touched nothing: the offer is still there */
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK_STR_CONTAINS(json, "\"request_id\":41,\"side\":\"context\","
                             "\"state\":\"offered\"");
    free(json);
    daemon_healthy(a);
    daemon_healthy(b);
    /* both still serve local transfers */
    fresh_pair_ok(a, "ps-ctx2", "ps-gen2");
    fresh_pair_ok(b, "ps-ctx3", "ps-gen3");
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(a);
    daemon_stop_ok(b);
}

/* A copy job that fails between daemons (KVXFERD_FAULT makes a host job
 * fail as a GPU kernel error would): a failed gather on the context
 * daemon, then a failed scatter on the generation daemon. Each time both
 * sides end the request with ERROR at once (the offer too, not at its
 * backstop lease), the next request moves verified bytes, and every slot
 * comes back free. A bad KVXFERD_FAULT stops the daemon at start. */
static void pf_round(const char *fault_a, const char *fault_b, const char *tag)
{
    setenv("KVXFERD_FAULT", fault_a, 1);
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    setenv("KVXFERD_FAULT", fault_b, 1);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    unsetenv("KVXFERD_FAULT");
    static side_t cs, gs;
    char ctx[32], gen[32];
    snprintf(ctx, sizeof(ctx), "pf-ctx-%s", tag);
    snprintf(gen, sizeof(gen), "pf-gen-%s", tag);
    rank_t c, g;
    p_pair(a, b, &cs, &gs, ctx, gen, &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {5, 6};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t eg = wait_event(g.c, 1, KVX_EVENT_ERROR, KVX_ERR_IO, 5000);
    ev_t ec = wait_event(c.c, 1, KVX_EVENT_ERROR, KVX_ERR_IO, 5000);
    fprintf(stderr, "%s: generation: %s; context: %s\n", tag, eg.msg, ec.msg);
    CHECK_STR_CONTAINS(eg.msg, "input/output");
    kvx_context_params_free(&p);
    p_one(&c, &g, 2, cb, gb, 2, 7, 5000);
    p_slots_all_free(a);
    p_slots_all_free(b);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

TEST_T(peer_copy_faults, 90)
{
    p_setup();
    pf_round("gather:1", "", "gather");
    pf_round("", "scatter:1", "scatter");
    char cmd[512], out[1024] = "";
    snprintf(cmd, sizeof(cmd),
             "KVXFERD_FAULT=bogus:1 timeout 10 %s/kvxferd --socket "
             "/tmp/kvx-pf-%d.sock 2>&1; echo \"exit $?\"",
             build_dir(), (int)getpid());
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    size_t n = fread(out, 1, sizeof(out) - 1, f);
    out[n] = 0;
    pclose(f);
    CHECK_STR_CONTAINS(out, "KVXFERD_FAULT: 'bogus:1' is not SITE:N");
    CHECK_STR_CONTAINS(out, "exit 2");
}

/* Params an engine forged, fetched between daemons: a layout with 0
 * tokens a block (it divided by zero in the planner and killed the
 * daemon) and billions of tokens (it planned them before looking at the
 * blocks). Each is refused at once naming the field; the daemon stays
 * healthy and the genuine params still complete. */
static void pp_forge(const kvx_context_params_t *p, uint32_t tpb, uint32_t ntok,
                     uint8_t *out, size_t *len)
{
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p->len, p->data);
    CHECK(cp != NULL && cp->layout);
    if (tpb != UINT32_MAX)
        cp->layout->tokens_per_block = tpb;
    if (ntok)
        cp->num_tokens = ntok;
    *len = kvxfer__context_params__get_packed_size(cp);
    CHECK(*len <= 4096);
    kvxfer__context_params__pack(cp, out);
    kvxfer__context_params__free_unpacked(cp, NULL);
}

TEST_T(peer_forged_params, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "fp-ctx", "fp-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    uint8_t f[4096];
    size_t fl;
    pp_forge(&p, 0, 0, f, &fl);
    CHECK_FAILS(kvx_fetch(g.c, 1, f, fl, g.pool, gb, 2, 0, T_MS), g.c,
                KVX_ERR_INVALID, "layout.tokens_per_block: 0 out of range");
    pp_forge(&p, 1, 3500000000u, f, &fl);
    int64_t t0 = now_ms();
    CHECK_FAILS(kvx_fetch(g.c, 1, f, fl, g.pool, gb, 2, 0, T_MS), g.c,
                KVX_ERR_INVALID, "fetch.blocks: 2 blocks of 4 tokens");
    CHECK(now_ms() - t0 < 1000);
    daemon_healthy(b);
    /* the genuine params still work */
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A daemon without the secret (build/tests/fake_peer) tries the
 * handshake's shortcuts; none gets in and nothing is harmed:
 *  1. skip: B dials it (params naming it as the context rank) and it
 *     answers HELLO with AUTH_RESULT{0}, no CHALLENGE: B refuses it, the
 *     fetch ends ERROR AUTH, and no OPEN (with the token) reaches it;
 *  2. relay: B dials it and it relays B's handshake to A: B sees that
 *     the answer comes from A's address, not the one it dialled, and
 *     gives no MAC; A does not accept the relay;
 *  3. claim: it connects to A claiming to be B and fails its handshake:
 *     A ends nothing of B's (a spread instance's request still needs and
 *     gets B's rank). */
static FILE *p_fake(int side, const char *args, char *addr, size_t alen)
{
    char cmd[600];
    if (p_net.netns)
        snprintf(cmd, sizeof(cmd), "ip netns exec %s %s/tests/fake_peer %s",
                 p_net.ns[side], build_dir(), args);
    else
        snprintf(cmd, sizeof(cmd), "%s/tests/fake_peer %s", build_dir(), args);
    fflush(stdout);
    fflush(stderr);
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    if (addr) {
        CHECK(fgets(addr, (int)alen, f) != NULL);
        addr[strcspn(addr, "\n")] = 0;
        CHECK(!strncmp(addr, "kvx://", 6));
    }
    return f;
}

/* The rest of the fake's output, once it exits. */
static void p_fake_rest(FILE *f, char *out, size_t cap)
{
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    pclose(f);
}

/* params p with context rank 0's daemon replaced by addr */
static void p_params_at(const kvx_context_params_t *p, const char *addr,
                        uint8_t *out, size_t *len)
{
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p->len, p->data);
    CHECK(cp != NULL && cp->n_rank_addresses == 1);
    char *old = cp->rank_addresses[0];
    cp->rank_addresses[0] = (char *)addr;
    *len = kvxfer__context_params__get_packed_size(cp);
    CHECK(*len <= 4096);
    kvxfer__context_params__pack(cp, out);
    cp->rank_addresses[0] = old;
    kvxfer__context_params__free_unpacked(cp, NULL);
}

TEST_T(peer_handshake_shortcuts, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "hs-ctx", "hs-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    uint8_t f[4096];
    size_t fl;
    char faddr[192], out[4096], args[400];

    /* 1: a server that skips its CHALLENGE */
    snprintf(args, sizeof(args), "skip %s 3", p_net.ip[0]);
    FILE *fk = p_fake(0, args, faddr, sizeof(faddr));
    p_params_at(&p, faddr, f, &fl);
    CHECK_KVX(kvx_fetch(g.c, 11, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t e = wait_event(g.c, 11, KVX_EVENT_ERROR, KVX_ERR_AUTH, 5000);
    fprintf(stderr, "skip: %s\n", e.msg);
    CHECK_STR_CONTAINS(e.msg, "without proving the cluster secret");
    p_fake_rest(fk, out, sizeof(out));
    CHECK(strstr(out, "got 7\n") == NULL); /* no OPEN, no token */
    CHECK_STR_CONTAINS(out, "done");

    /* 2: a relay from B to A */
    char a_ipport[64];
    const char *h = strstr(c.addr, "://");
    CHECK(h != NULL);
    snprintf(a_ipport, sizeof(a_ipport), "%.*s",
             (int)(strrchr(c.addr, '/') - (h + 3)), h + 3);
    snprintf(args, sizeof(args), "relay %s %s 3", p_net.ip[0], a_ipport);
    fk = p_fake(0, args, faddr, sizeof(faddr));
    p_params_at(&p, faddr, f, &fl);
    CHECK_KVX(kvx_fetch(g.c, 12, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
    e = wait_event(g.c, 12, KVX_EVENT_ERROR, KVX_ERR_AUTH, 5000);
    fprintf(stderr, "relay: %s\n", e.msg);
    CHECK_STR_CONTAINS(e.msg, "does not listen there");
    p_fake_rest(fk, out, sizeof(out));
    fprintf(stderr, "relay's output: %s", out);
    CHECK(strstr(out, "auth_result 0\n") == NULL);

    /* the genuine params still complete */
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_context_params_free(&p);

    /* 3: a claim to be B, at A, that fails its handshake; a spread
     * generation instance (rank 0 on A, rank 1 on B) then still moves a
     * request that needs both ranks */
    static side_t ss;
    p_side2(&ss, "hs-spread", KVX_ROLE_GENERATION);
    rank_t s0, s1;
    p_spread_open(a, b, &ss, 8, &s0, &s1);
    snprintf(args, sizeof(args), "claim %s %s 1", a_ipport, s1.addr);
    fk = p_fake(1, args, NULL, 0);
    p_fake_rest(fk, out, sizeof(out));
    CHECK_STR_CONTAINS(out, "done");
    sleep_ms(300);
    fill_req(&c, 2, cb, 7);
    CHECK_KVX(kvx_publish(c.c, 2, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(s0.c, 2, p.data, p.len, s0.pool, gb, 2, 0, T_MS), s0.c);
    CHECK_KVX(kvx_fetch(s1.c, 2, p.data, p.len, s1.pool, gb, 2, 0, T_MS), s1.c);
    wait_event(s0.c, 2, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(s1.c, 2, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&s0, 2, gb, 7, 0), 0);
    CHECK_EQ(p_check_req(&s1, 2, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&s1);
    rank_close(&s0);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A daemon that knows the secret but misbehaves (fake_peer replay): B
 * dials it (params naming it as the context rank) and opens its stream
 * there; it replays that OPEN to A twice. A accepts the stream once and
 * refuses the second (each stream the consumer needs, once: a second
 * stream of the same slice could outlive the offer's consumption). */
TEST_T(peer_open_twice, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "ot-ctx", "ot-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    char a_ipport[64], faddr[192], args[600], out[4096];
    const char *h = strstr(c.addr, "://");
    CHECK(h != NULL);
    snprintf(a_ipport, sizeof(a_ipport), "%.*s",
             (int)(strrchr(c.addr, '/') - (h + 3)), h + 3);
    snprintf(args, sizeof(args), "replay %s/secret-A %s %s 3", p_net.dir,
             p_net.ip[0], a_ipport);
    FILE *fk = p_fake(0, args, faddr, sizeof(faddr));
    uint8_t f[4096];
    size_t fl;
    p_params_at(&p, faddr, f, &fl);
    CHECK_KVX(kvx_fetch(g.c, 1, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
    p_fake_rest(fk, out, sizeof(out));
    fprintf(stderr, "the replaying daemon got:\n%s", out);
    CHECK_STR_CONTAINS(out, "auth_result 0\nopened\n");
    CHECK_STR_CONTAINS(out, "has all its 1 streams");
    CHECK(strstr(strstr(out, "opened\n") + 7, "opened\n") == NULL);
    /* both ends are cancelled (or ended already, when the fake left);
     * the daemons stay healthy */
    int rc = kvx_cancel(g.c, 1, T_MS);
    CHECK(rc == KVX_OK || rc == KVX_ERR_NOT_FOUND);
    rc = kvx_cancel(c.c, 1, T_MS);
    CHECK(rc == KVX_OK || rc == KVX_ERR_NOT_FOUND);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A renewal reaching a daemon before 2.6 (fake_peer replay: it knows
 * the secret and says no minor in its CHALLENGE, as a 2.5 daemon; it
 * never answers a renew): B's renewal fails UNSUPPORTED, naming it, as
 * soon as the handshake tells B so, not at the answer's deadline; the
 * renewal of an offer on A in the same call succeeds, and that offer then
 * moves, every byte. */
TEST_T(peer_renew_old_daemon, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "ro-ctx", "ro-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p[2];
    CHECK_KVX(ls_publish(&c, 1, cb, 2, 7, 0, &p[0]), c.c);
    char a_ipport[64], faddr[192], args[600], out[4096];
    const char *h = strstr(c.addr, "://");
    CHECK(h != NULL);
    snprintf(a_ipport, sizeof(a_ipport), "%.*s",
             (int)(strrchr(c.addr, '/') - (h + 3)), h + 3);
    snprintf(args, sizeof(args), "replay %s/secret-A %s %s 3", p_net.dir,
             p_net.ip[0], a_ipport);
    FILE *fk = p_fake(0, args, faddr, sizeof(faddr));
    uint8_t f[4096];
    size_t fl;
    p_params_at(&p[0], faddr, f, &fl);
    p[1] = (kvx_context_params_t){f, fl};
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(b->sock, T_MS, &sched), 0);
    kvx_outcome_t o[2];
    CHECK_FAILS(ls_renew(sched, p, 2, o), sched, KVX_ERR_UNSUPPORTED,
                "which does not renew leases");
    CHECK_EQ(o[0].code, 0);
    CHECK_EQ(o[1].code, KVX_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(o[1].message, faddr);
    p_fake_rest(fk, out, sizeof(out));
    CHECK_KVX(kvx_fetch(g.c, 1, p[0].data, p[0].len, g.pool, gb, 2, 0, T_MS),
              g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_close(sched);
    kvx_context_params_free(&p[0]);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* Released across daemons: the context rank on A, the release sent to B
 * by a router process there (an observer connection): B asks A
 * (PeerRelease) and answers once A did; A's rank gets COMPLETE
 * "released", and its pool is free at once. A second release is refused
 * with A's answer, by name. */
TEST_T(peer_release, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "prl-ctx", "prl-gen", &c, &g);
    uint32_t cb[2] = {0, 1};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    kvx_client_t *router;
    CHECK_EQ(kvx_connect_observer(b->sock, T_MS, &router), 0);
    CHECK_KVX(kvx_release(router, p.data, p.len, T_MS), router);
    ev_t e = wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 3000);
    CHECK_STR_CONTAINS(e.msg, "released");
    CHECK_FAILS(kvx_release(router, p.data, p.len, T_MS), router,
                KVX_ERR_NOT_FOUND, "no offer of request 1");
    CHECK_KVX(kvx_pool_deregister(c.c, c.pool, T_MS), c.c);
    c.pool = 0;
    kvx_close(router);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* Renewed across daemons (2.6): the context rank on A publishes under
 * a lease of 500 ms; a scheduler process on B renews it every 150 ms
 * for 2 s (B asks A, PeerRenew) while a second offer, not renewed, ends
 * TIMED_OUT at its lease; the generation rank on B then fetches the
 * first, every byte as A's rank wrote it. Renewing it again after its
 * transfer, and renewing the expired one, answer NOT_FOUND with A's
 * message. */
TEST_T(peer_renew, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "prn-ctx", "prn-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[2] = {0, 1}, cb2[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p[2];
    CHECK_KVX(ls_publish(&c, 1, cb, 2, 7, 500, &p[0]), c.c);
    CHECK_KVX(ls_publish(&c, 2, cb2, 2, 7, 500, &p[1]), c.c);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(b->sock, T_MS, &sched), 0);
    kvx_outcome_t o[2];
    int64_t until = now_ms() + 2000;
    while (now_ms() < until) {
        CHECK_KVX(ls_renew(sched, &p[0], 1, o), sched);
        sleep_ms(150);
    }
    ev_t e = wait_event(c.c, 2, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 3000);
    CHECK_STR_CONTAINS(e.msg, "offer lease of 500 ms expired");
    uint32_t gb[2] = {4, 5};
    CHECK_KVX(kvx_fetch(g.c, 1, p[0].data, p[0].len, g.pool, gb, 2, 0, T_MS),
              g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    expect_t ex = {1, gb, 7, 0};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    CHECK_FAILS(ls_renew(sched, p, 2, o), sched, KVX_ERR_NOT_FOUND,
                "kvx_renew: item 0 (key 1): renew: no offer of request");
    CHECK_EQ(o[0].code, KVX_ERR_NOT_FOUND);
    CHECK_EQ(o[1].code, KVX_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(o[1].message, "on daemon kvx://");
    kvx_close(sched);
    kvx_context_params_free(&p[0]);
    kvx_context_params_free(&p[1]);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* Keys across two daemons: string keys, different on each side, the
 * bytes verified; each side's event names its own key; the context
 * daemon's refusal names the context key (a key that is not the offer's,
 * with the offer's own token: NOT_FOUND, nothing written). */
TEST_T(peer_keyed_transfer, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pk-ctx", "pk-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    const char *ck = "bootstrap-room-8812", *gk = "sglang:8812";
    uint32_t cb[2] = {4, 5}, gb[2] = {2, 7};
    fill_req(&c, 8812, cb, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_key(c.c, ck, strlen(ck), c.pool, cb, 2, 8, NULL, 0,
                              &p, T_MS),
              c.c);
    /* the params with another context key: the offer's token, no offer */
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p.len, p.data);
    CHECK(cp != NULL);
    uint8_t other[] = "bootstrap-room-8813";
    ProtobufCBinaryData own = cp->key; /* the unpacked message's */
    cp->key.data = other;
    cp->key.len = strlen((char *)other);
    uint8_t forged[4096];
    size_t fl = kvxfer__context_params__get_packed_size(cp);
    CHECK(fl <= sizeof(forged));
    kvxfer__context_params__pack(cp, forged);
    cp->key = own; /* freed with it */
    kvxfer__context_params__free_unpacked(cp, NULL);
    CHECK_KVX(
        kvx_fetch_key(g.c, "x1", 2, forged, fl, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    ev_t e = wait_key(g.c, "x1", 2, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    CHECK_EQ(e.code, KVX_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(e.msg, "bootstrap-room-8813");
    CHECK_EQ(p_check_req(&g, 8812, gb, 8, 0) > 0, 1); /* nothing landed */
    /* the real params */
    CHECK_KVX(kvx_fetch_key(g.c, gk, strlen(gk), p.data, p.len, g.pool, gb, 2,
                            0, 0, T_MS),
              g.c);
    e = wait_key(g.c, gk, strlen(gk), 8000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    e = wait_key(c.c, ck, strlen(ck), 8000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(p_check_req(&g, 8812, gb, 8, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* Fetch by key across two daemons: the generation rank on B names A's
 * context instance, A's address and the key before the publish; B asks A
 * (PeerResolve), A answers once the offer is made, and the bytes land. A
 * context instance that names other consumers refuses B's (PERM); a key
 * already consumed is not found again (TIMED_OUT on B's fetch timeout);
 * neither writes a byte. */
TEST_T(peer_fetch_by_key, 60)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    daemon_t *b =
        p_daemon(1, P_SECRET, NULL, "deadlines:\n  fetch_timeout_ms: 1500\n");
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pf-ctx", "pf-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[2] = {6, 3}, gb[2] = {0, 5};
    CHECK_KVX(kvx_fetch_by_key(g.c, "dec-1", 5, "pf-ctx", c.addr, "room-9", 6,
                               g.pool, gb, 2, 0, 0, T_MS),
              g.c);
    ev_t e[4];
    CHECK_EQ(collect(g.c, e, 4, 1, 300), 0); /* it waits on A */
    fill_req(&c, 909, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(
        kvx_publish_key(c.c, "room-9", 6, c.pool, cb, 2, 7, NULL, 0, &p, T_MS),
        c.c);
    kvx_context_params_free(&p);
    CHECK_EQ(wait_key(g.c, "dec-1", 5, 8000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "room-9", 6, 8000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(p_check_req(&g, 909, gb, 7, 0), 0);

    /* replayed: consumed, not found again; nothing written */
    uint8_t *before = malloc(g.size);
    CHECK(before != NULL);
    memcpy(before, g.base, g.size);
    uint32_t gb2[2] = {1, 2};
    CHECK_KVX(kvx_fetch_by_key(g.c, "dec-2", 5, "pf-ctx", c.addr, "room-9", 6,
                               g.pool, gb2, 2, 0, 0, T_MS),
              g.c);
    ev_t ge = wait_key(g.c, "dec-2", 5, 8000);
    CHECK_EQ(ge.kind, KVX_EVENT_TIMED_OUT);
    CHECK_STR_CONTAINS(ge.msg, "room-9");

    /* a context instance whose join names other consumers */
    side_t cs2 = cs;
    cs2.inst = "pf-ctx2";
    rank_t c2;
    rank_hello_only(a, &M_SMALL, &cs2, 0, &c2);
    const char *addrs[1] = {c2.addr};
    const char *cons[2] = {"somebody-else", "pf-gen-not"};
    CHECK_KVX(kvx_join_consumers(c2.c, addrs, 1, cons, 2, T_MS), c2.c);
    rank_pool(&c2, 8);
    CHECK_KVX(kvx_publish_key(c2.c, "room-x", 6, c2.pool, cb, 2, 7, NULL, 0, &p,
                              T_MS),
              c2.c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_fetch_by_key(g.c, "dec-3", 5, "pf-ctx2", c2.addr, "room-x", 6,
                               g.pool, gb2, 2, 0, 0, T_MS),
              g.c);
    ge = wait_key(g.c, "dec-3", 5, 8000);
    CHECK_EQ(ge.kind, KVX_EVENT_ERROR);
    CHECK_EQ(ge.code, KVX_ERR_PERM);
    CHECK_STR_CONTAINS(ge.msg, "does not let instance pf-gen");
    CHECK(!memcmp(before, g.base, g.size));
    free(before);
    rank_close(&c2);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* The aux payload across daemons (PeerOpened.aux): published before the
 * fetch, 64 KiB of it (daemon A's limit, exactly) reach the generation
 * rank on daemon B with its COMPLETE; published after the fetch opened
 * its stream (a reserved offer), it is sent after the OPENED and still
 * arrives; daemon B's own limits.aux_bytes bounds what it takes from a
 * peer: more fails the request with LIMIT, naming the key. */
TEST_T(peer_aux_across_daemons, 60)
{
    daemon_t *a, *b;
    p_setup();
    a = p_daemon(0, P_SECRET, NULL, NULL);
    b = p_daemon(1, P_SECRET, NULL, "limits:\n  aux_bytes: 32KiB\n");
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pa-ctx", "pa-gen", &c, &g);
    uint32_t cb[2] = {4, 5}, gb[2] = {1, 2};
    size_t n = 32 * 1024;
    uint8_t *aux = malloc(64 * 1024);
    CHECK(aux != NULL);
    for (size_t i = 0; i < 64 * 1024; i++)
        aux[i] = (uint8_t)(mix64(i) >> 11);
    kvx_context_params_t p;

    /* published first: the aux comes with the OPENED */
    fill_req(&c, 71, cb, 8);
    CHECK_KVX(kvx_publish_key(c.c, "a1", 2, c.pool, cb, 2, 8, aux, n, &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "a1", 2, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    ev_t e = wait_key(g.c, "a1", 2, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(e.aux_len, n);
    CHECK_EQ(e.aux_sum, aux_sum(aux, n));
    CHECK_EQ(p_check_req(&g, 71, gb, 8, 0), 0);
    e = wait_key(c.c, "a1", 2, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(e.aux_len, 0);
    kvx_context_params_free(&p);

    /* reserved, fetched, then published with the aux */
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(a->sock, T_MS, &sched), 0);
    CHECK_KVX(kvx_reserve(sched, "pa-ctx", "a2", 2, 8, &p, T_MS), sched);
    kvx_close(sched);
    CHECK_KVX(
        kvx_fetch_key(g.c, "a2", 2, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    ev_t none[4];
    CHECK_EQ(collect(g.c, none, 4, 1, 300), 0); /* opened, waiting */
    kvx_context_params_t pp;
    fill_req(&c, 72, cb, 8);
    CHECK_KVX(kvx_publish_key(c.c, "a2", 2, c.pool, cb, 2, 8, "late aux", 8,
                              &pp, T_MS),
              c.c);
    kvx_context_params_free(&pp);
    e = wait_key(g.c, "a2", 2, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(e.aux_len, 8);
    CHECK(!memcmp(e.aux, "late aux", 8));
    CHECK_EQ(p_check_req(&g, 72, gb, 8, 0), 0);
    wait_key(c.c, "a2", 2, 8000);
    kvx_context_params_free(&p);

    /* more than B takes: the fetch fails, nothing kept */
    CHECK_KVX(kvx_publish_key(c.c, "a3", 2, c.pool, cb, 2, 8, aux, 64 * 1024,
                              &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "a3", 2, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    e = wait_key(g.c, "a3", 2, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    CHECK_EQ(e.code, KVX_ERR_LIMIT);
    CHECK_EQ(e.aux_len, 0);
    CHECK_STR_CONTAINS(e.msg, "limits.aux_bytes");
    e = wait_key(c.c, "a3", 2, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    kvx_context_params_free(&p);
    char *json = status_json(b);
    CHECK_STR_CONTAINS(json, "\"aux\":0,");
    free(json);
    free(aux);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* Release by key from another daemon: a router on B is refused (PERM:
 * no instance to be let in); B's generation rank releases A's offer by
 * key (PeerResolve, then PeerRelease); A's rank gets COMPLETE
 * "released"; again: NOT_FOUND naming the key; a context instance whose
 * join names other consumers refuses it (PERM). */
TEST_T(peer_release_by_key, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pr-ctx", "pr-gen", &c, &g);
    uint32_t cb[2] = {1, 2};
    kvx_context_params_t p;
    CHECK_KVX(
        kvx_publish_key(c.c, "room-7", 6, c.pool, cb, 2, 7, NULL, 0, &p, T_MS),
        c.c);
    kvx_context_params_free(&p);
    kvx_client_t *router;
    CHECK_EQ(kvx_connect_observer(b->sock, T_MS, &router), 0);
    /* a router on another daemon is no instance: refused, use params */
    CHECK_FAILS(kvx_release_by_key(router, "pr-ctx", c.addr, "room-7", 6, T_MS),
                router, KVX_ERR_PERM, "only a generation rank");
    /* the generation rank on B may: its instance may fetch by key */
    CHECK_KVX(kvx_release_by_key(g.c, "pr-ctx", c.addr, "room-7", 6, T_MS),
              g.c);
    ev_t e = wait_key(c.c, "room-7", 6, 5000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    CHECK_STR_CONTAINS(e.msg, "released");
    CHECK_FAILS(kvx_release_by_key(g.c, "pr-ctx", c.addr, "room-7", 6, T_MS),
                g.c, KVX_ERR_NOT_FOUND, "room-7");
    /* an instance whose join names other consumers */
    side_t cs2 = cs;
    cs2.inst = "pr-ctx2";
    rank_t c2;
    rank_hello_only(a, &M_SMALL, &cs2, 0, &c2);
    const char *addrs[1] = {c2.addr};
    const char *cons[1] = {"somebody-else"};
    CHECK_KVX(kvx_join_consumers(c2.c, addrs, 1, cons, 1, T_MS), c2.c);
    rank_pool(&c2, 8);
    CHECK_KVX(kvx_publish_key(c2.c, "room-8", 6, c2.pool, cb, 2, 7, NULL, 0, &p,
                              T_MS),
              c2.c);
    kvx_context_params_free(&p);
    CHECK_FAILS(kvx_release_by_key(g.c, "pr-ctx2", c2.addr, "room-8", 6, T_MS),
                g.c, KVX_ERR_PERM, "does not let");
    kvx_close(router);
    rank_close(&c2);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* A layer-wise offer fetched from another daemon: its layers move as
 * they are ready (and only those), then every byte; a context rank that
 * leaves between layers ends the fetch on the other daemon with none of
 * the layers it never made ready written. */
TEST_T(peer_layerwise, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pl-ctx", "pl-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    memset(c.base, 0x11, c.size);
    uint32_t cb[2] = {3, 6}, gb[2] = {1, 4};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_layerwise(c.c, "pl", 2, c.pool, cb, 2, 8, NULL, 0, &p,
                                    T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "plg", 3, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    fill_layers(&c, 8813, cb, 8, 0, 2);
    CHECK_KVX(kvx_layers_ready(c.c, "pl", 2, 0, 2, NULL, T_MS), c.c);
    CHECK_EQ(tokens_arrive(&g, 8813, gb, 0, 8, 0, 2), 0);
    CHECK_EQ(layers_hold(&g, 8813, gb, 8, 2, 4, 0, 0xa5), 0);
    fill_layers(&c, 8813, cb, 8, 2, 4);
    CHECK_KVX(kvx_layers_ready(c.c, "pl", 2, 2, 2, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "plg", 3, 8000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "pl", 2, 8000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(p_check_req(&g, 8813, gb, 8, 0), 0);
    kvx_context_params_free(&p);

    memset(g.base, 0xa5, g.size);
    CHECK_KVX(kvx_publish_layerwise(c.c, "pl2", 3, c.pool, cb, 2, 8, NULL, 0,
                                    &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "pl2g", 4, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    CHECK_KVX(kvx_layers_ready(c.c, "pl2", 3, 0, 1, NULL, T_MS), c.c);
    sleep_ms(100);
    rank_close(&c);
    ev_t e = wait_key(g.c, "pl2g", 4, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    CHECK_EQ(layers_hold(&g, 8813, gb, 8, 1, 4, 0, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&g);
    p_stop_both(a, b);
}

/* Between daemons, kvx_fetch_progress counts the layers that have landed,
 * as through one daemon: each layer made ready moves, and the fetch's
 * progress rises to it, layer by layer, before the fetch completes. */
TEST_T(peer_layerwise_progress, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pp-ctx", "pp-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    memset(c.base, 0x11, c.size);
    uint32_t cb[2] = {3, 6}, gb[2] = {1, 4}, nl = c.lay.num_layers;
    CHECK(nl >= 3);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_layerwise(c.c, "pp", 2, c.pool, cb, 2, 8, NULL, 0, &p,
                                    T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch_key(g.c, "ppg", 3, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    uint32_t done = 9, total = 0;
    int ended = 1;
    CHECK_KVX(kvx_fetch_progress(g.c, "ppg", 3, &done, &total, &ended, T_MS),
              g.c);
    CHECK_EQ(done, 0);
    CHECK_EQ(total, nl);
    CHECK_EQ(ended, 0);
    for (uint32_t l = 0; l + 1 < nl; l++) {
        fill_layers(&c, 8827, cb, 8, l, l + 1);
        CHECK_KVX(kvx_layers_ready(c.c, "pp", 2, l, 1, NULL, T_MS), c.c);
        /* the layer lands and counts; the next, not ready, does not */
        CHECK_EQ(progress_reaches(&g, "ppg", l + 1), l + 1);
        CHECK_EQ(layers_hold(&g, 8827, gb, 8, 0, l + 1, 1, 0), 0);
        CHECK_EQ(layers_hold(&g, 8827, gb, 8, l + 1, nl, 0, 0xa5), 0);
        CHECK_KVX(
            kvx_fetch_progress(g.c, "ppg", 3, &done, &total, &ended, T_MS),
            g.c);
        CHECK_EQ(done, l + 1);
        CHECK_EQ(ended, 0);
    }
    fill_layers(&c, 8827, cb, 8, nl - 1, nl);
    CHECK_KVX(kvx_layers_ready(c.c, "pp", 2, nl - 1, 1, NULL, T_MS), c.c);
    CHECK_EQ(wait_key(g.c, "ppg", 3, 8000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "pp", 2, 8000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(p_check_req(&g, 8827, gb, 8, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* A request with several block tables between daemons: context TP 2 on
 * daemon A, generation TP 1 on daemon B; the KV, a window group from
 * block 1 and a state slot all land (every byte of B's three pools
 * checked), fetched with params and then by key. */
TEST_T(peer_groups_window_and_state, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    hybrid_t h;
    memset(&h, 0, sizeof(h));
    ctx2_open(a, &M_SMALL, "pg-ctx", 8, &h.cs, &h.c[0], &h.c[1]);
    p_side(&h.gs, "pg-gen", KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_open(b, &M_SMALL, &h.gs, 0, 8, &h.g);
    for (int r = 0; r < 2; r++) {
        group_pool(&h.c[r], &M_SWA, &h.csd[r][0], 4, 8, &h.cw[r]);
        group_pool(&h.c[r], &M_STATE, &h.csd[r][1], 1, 4, &h.cst[r]);
    }
    group_pool(&h.g, &M_SWA, &h.gsd[0], 4, 8, &h.gw);
    group_pool(&h.g, &M_STATE, &h.gsd[1], 1, 4, &h.gst);
    for (int round = 0; round < 2; round++) {
        uint64_t req = 340 + 10 * (uint64_t)round;
        memset(h.g.base, 0xa5, h.g.size);
        memset(h.gw.base, 0xa5, h.gw.size);
        memset(h.gst.base, 0xa5, h.gst.size);
        kvx_context_params_t p, p1;
        CHECK_KVX(hybrid_publish(&h, 0, req, &p), h.c[0].c);
        CHECK_KVX(hybrid_publish(&h, 1, req, &p1), h.c[1].c);
        char k[24];
        snprintf(k, sizeof(k), "%llu", (unsigned long long)req);
        if (round == 0) {
            CHECK_KVX(hybrid_fetch(&h, req, &p, 4), h.g.c);
        } else {
            kvx_group_t gs[2];
            hy_gen_groups(&h, 4, gs);
            CHECK_KVX(kvx_fetch_by_key_groups(
                          h.g.c, k, strlen(k), "pg-ctx", h.c[0].addr, k,
                          strlen(k), h.g.pool, hy_gb, 3, 0, 0, gs, 2, T_MS),
                      h.g.c);
        }
        wait_event(h.g.c, req, KVX_EVENT_COMPLETE, 0, 8000);
        wait_event(h.c[0].c, req, KVX_EVENT_COMPLETE, 0, 8000);
        wait_event(h.c[1].c, req, KVX_EVENT_COMPLETE, 0, 8000);
        expect_t kv = {req, hy_gb, HY_TOK, 0};
        expect_t win = {req + 1, hy_gw, HY_TOK, 4};
        expect_t st = {req + 2, &hy_gs, 1, 0};
        CHECK_EQ(check_pool(&h.g, &kv, 1, 0xa5), 0);
        CHECK_EQ(check_pool(&h.gw, &win, 1, 0xa5), 0);
        CHECK_EQ(check_pool(&h.gst, &st, 1, 0xa5), 0);
        kvx_context_params_free(&p);
        kvx_context_params_free(&p1);
    }
    hybrid_close(&h);
    p_stop_both(a, b);
}

/* The paced chunks a status counts: "paced: N jobs held X ms, H now". */
static uint64_t p_paced(daemon_t *d, unsigned *now)
{
    char *st = status_json(d);
    const char *p = strstr(st, "paced: ");
    uint64_t n = p ? strtoull(p + strlen("paced: "), NULL, 10) : 0;
    const char *h = p ? strstr(p, " ms, ") : NULL;
    *now = h ? (unsigned)strtoul(h + strlen(" ms, "), NULL, 10) : 0;
    free(st);
    return n;
}

/* copy.pace on one daemon (paced 0: A, the context side; 1: B, the
 * generation side) paces its host copies into or out of the staging
 * slots too: at 256 bytes a millisecond a 4 MiB request takes hours. A
 * cancel from the generation side while they are held ends the request
 * on both sides at once (the held copies go back unrun), and so does
 * SIGTERM: the paced daemon drains with every copy fenced, exits 0. */
static void p_pace_case(int paced)
{
    static const char *const peer = "  slot_bytes: 1MiB\n  slots: 2\n"
                                    "  message_bytes: 256KiB\n  direct: 0\n";
    static const char *const slow = "copy:\n  pace: 256\n"
                                    "deadlines:\n  drain_timeout_ms: 20000\n";
    p_setup();
    daemon_t *d[2];
    d[0] = p_daemon(0, P_SECRET, peer, paced == 0 ? slow : NULL);
    d[1] = p_daemon(1, P_SECRET, peer, paced == 1 ? slow : NULL);
    static side_t cs, gs;
    rank_t c, g;
    p_side(&cs, "pq-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 16);
    p_side(&gs, "pq-gen", KVX_ROLE_GENERATION, "flashinfer", 16);
    rank_open(d[0], &M_BIG, &cs, 0, 256, &c);
    rank_open(d[1], &M_BIG, &gs, 0, 256, &g);
    rank_t *mine = paced ? &g : &c;
    uint32_t bl[256];
    for (uint32_t i = 0; i < 256; i++)
        bl[i] = i;
    unsigned held;
    for (uint64_t req = 7; req <= 8; req++) {
        fill_req(&c, req, bl, 4096);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, req, c.pool, bl, 256, 4096, &p, T_MS), c.c);
        CHECK_KVX(kvx_fetch(g.c, req, p.data, p.len, g.pool, bl, 256, 0, T_MS),
                  g.c);
        kvx_context_params_free(&p);
        int64_t end = now_ms() + 5000;
        while (p_paced(d[paced], &held) == 0 || held == 0) {
            CHECK(now_ms() < end);
            sleep_ms(20);
        }
        if (req == 7) {
            CHECK_KVX(kvx_cancel(g.c, req, T_MS), g.c);
            wait_event(g.c, req, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
            wait_event(c.c, req, KVX_EVENT_ERROR, KVX_ERR_CANCELLED, 3000);
            (void)p_paced(d[paced], &held);
            CHECK_EQ(held, 0);
            continue;
        }
        kill(d[paced]->pid, SIGTERM);
        wait_event(mine->c, req, KVX_EVENT_ERROR, KVX_ERR_SHUTDOWN, 3000);
        int st = daemon_wait(d[paced], 10000);
        CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK(log_contains(d[paced], "drained in"));
        CHECK(!log_contains(d[paced], "not fenced"));
    }
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d[!paced]);
    daemon_stop_ok(d[!paced]);
}

TEST_T(peer_copy_pace_holds_gathers, 90)
{
    p_pace_case(0);
}

TEST_T(peer_copy_pace_holds_scatters, 90)
{
    p_pace_case(1);
}
