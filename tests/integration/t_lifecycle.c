/*
 * t_lifecycle.c — how requests and sessions end: offer leases and fetch
 * timeouts; cancels before, during and after a transfer; a client killed
 * mid-transfer; a rank of an instance disconnecting; SIGTERM draining
 * what is in flight; sessions, pools and fds leaving nothing behind; the
 * library never raising SIGPIPE when its daemon dies.
 */

/* ---- deadlines -------------------------------------------------------- */

/* 8. */
TEST(lease_expiry)
{
    daemon_t *d = daemon_start("deadlines:\n  offer_lease_ms: 200\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "le-ctx", "le-gen", 8, &c, &g, &cs, &gs);
    uint32_t bl[2] = {0, 1};
    kvx_context_params_t p;
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_publish(c.c, 77, c.pool, bl, 2, 8, &p, T_MS), c.c);
    ev_t e = wait_event(c.c, 77, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 2000);
    int64_t dt = now_ms() - t0;
    CHECK(dt >= 150);
    CHECK(dt < 1000);
    CHECK_STR_CONTAINS(e.msg, "lease");
    fetch_fails_later(&g, 77, p.data, p.len, bl, 2, KVX_ERR_NOT_FOUND,
                      "context side: no offer for request 77");
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK(strcmp(json, "[]") == 0);
    free(json);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* 9. */
TEST(fetch_timeout)
{
    daemon_t *d = daemon_start("deadlines:\n  fetch_timeout_ms: 200\n");
    side_t cs, gs = {.inst = "ft-gen",
                     .role = KVX_ROLE_GENERATION,
                     .tp = 1,
                     .pp = 1,
                     .preset = "vllm-nhd",
                     .tpb = 4};
    rank_t c0, c1, g;
    ctx2_open(d, &M_SMALL, "ft-ctx", 8, &cs, &c0, &c1);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t bl[2] = {2, 3};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c0.c, 9, c0.pool, bl, 2, 6, &p, T_MS), c0.c);
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch(g.c, 9, p.data, p.len, g.pool, bl, 2, 0, T_MS), g.c);
    ev_t e = wait_event(g.c, 9, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 2000);
    int64_t dt = now_ms() - t0;
    CHECK(dt >= 150 && dt < 1000);
    CHECK_STR_CONTAINS(e.msg, "fetch timeout");
    e = wait_event(c0.c, 9, KVX_EVENT_ERROR, KVX_ERR_TIMED_OUT, 2000);
    CHECK_STR_CONTAINS(e.msg, "generation side");
    CHECK_EQ(check_pool(&g, NULL, 0, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* ---- 10. cancel --------------------------------------------------------- */

TEST(cancel_unfetched_offer)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "co-ctx", "co-gen", 8, &c, &g, &cs, &gs);
    uint32_t bl[2] = {4, 5};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 10, c.pool, bl, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_cancel(c.c, 10, T_MS), c.c);
    wait_event(c.c, 10, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 2000);
    /* gone: a fetch hears it was cancelled, a second cancel finds
     * nothing */
    fetch_fails_later(&g, 10, p.data, p.len, bl, 2, KVX_ERR_CANCELLED,
                      "context side: cancelled by the context side");
    CHECK_FAILS(kvx_cancel(c.c, 10, T_MS), c.c, KVX_ERR_NOT_FOUND,
                "cancel.key");
    /* the pool is free again: deregister works */
    CHECK_KVX(kvx_pool_deregister(c.c, c.pool, T_MS), c.c);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

TEST(cancel_waiting_fetch)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs, gs = {.inst = "cw-gen",
                     .role = KVX_ROLE_GENERATION,
                     .tp = 1,
                     .pp = 1,
                     .preset = "vllm-nhd",
                     .tpb = 4};
    rank_t c0, c1, g;
    ctx2_open(d, &M_SMALL, "cw-ctx", 8, &cs, &c0, &c1);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t bl[2] = {1, 0};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c0.c, 11, c0.pool, bl, 2, 8, &p, T_MS), c0.c);
    CHECK_KVX(kvx_fetch(g.c, 11, p.data, p.len, g.pool, bl, 2, 0, T_MS), g.c);
    char *json;
    CHECK_KVX(kvx_requests_json(g.c, &json, T_MS), g.c);
    CHECK_STR_CONTAINS(json, "\"state\":\"waiting-source\"");
    free(json);
    CHECK_KVX(kvx_cancel(c0.c, 11, T_MS), c0.c);
    ev_t e = wait_event(g.c, 11, KVX_EVENT_ERROR, KVX_ERR_CANCELLED, 2000);
    CHECK_STR_CONTAINS(e.msg, "cancel");
    wait_event(c0.c, 11, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 2000);
    /* the silent rank cannot publish it any more */
    kvx_context_params_t p1;
    int rc = kvx_publish(c1.c, 11, c1.pool, bl, 2, 8, &p1, T_MS);
    if (rc == 0) {
        /* a fresh offer for the same id is acceptable; it must not feed
         * the cancelled fetch */
        kvx_context_params_free(&p1);
        CHECK_KVX(kvx_cancel(c1.c, 11, T_MS), c1.c);
        wait_event(c0.c, 11, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 2000);
    }
    sleep_ms(50);
    CHECK_EQ(check_pool(&g, NULL, 0, 0xa5), 0);
    kvx_context_params_free(&p);

    /* the generation side cancels a fetch waiting for its source */
    CHECK_KVX(kvx_publish(c0.c, 15, c0.pool, bl, 2, 8, &p, T_MS), c0.c);
    CHECK_KVX(kvx_fetch(g.c, 15, p.data, p.len, g.pool, bl, 2, 0, T_MS), g.c);
    CHECK_KVX(kvx_cancel(g.c, 15, T_MS), g.c);
    wait_event(g.c, 15, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 2000);
    e = wait_event(c0.c, 15, KVX_EVENT_ERROR, KVX_ERR_CANCELLED, 2000);
    CHECK_STR_CONTAINS(e.msg, "generation side");
    CHECK_EQ(check_pool(&g, NULL, 0, 0xa5), 0);
    kvx_context_params_free(&p);

    /* the context side cancels an offer only rank 0 published */
    CHECK_KVX(kvx_publish(c0.c, 16, c0.pool, bl, 2, 8, &p, T_MS), c0.c);
    CHECK_KVX(kvx_requests_json(c0.c, &json, T_MS), c0.c);
    CHECK_STR_CONTAINS(json, "\"state\":\"publishing\"");
    free(json);
    CHECK_KVX(kvx_cancel(c0.c, 16, T_MS), c0.c);
    wait_event(c0.c, 16, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 2000);
    kvx_context_params_free(&p);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Cancel a 64 MiB transfer right after the fetch, from the generation
 * side (gen_cancels) or the context side; afterwards nothing writes. */
static void cancel_in_flight(int gen_cancels)
{
    daemon_t *d = daemon_start(SLOW_CFG);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "cf-ctx", "cf-gen", BIG_BLOCKS, &c, &g, &cs, &gs);
    CHECK_EQ(g.size, 64u << 20);
    memset(c.base, 0x11, c.size);
    memset(g.base, 0xa5, g.size);
    uint32_t *bl = big_blocks();
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 12, c.pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch(g.c, 12, p.data, p.len, g.pool, bl, BIG_BLOCKS, 0, T_MS),
        g.c);
    kvx_client_t *who = gen_cancels ? g.c : c.c;
    int rc = kvx_cancel(who, 12, T_MS);
    if (rc == KVX_ERR_NOT_FOUND)
        fprintf(stderr, "the 64 MiB transfer ended before the cancel: %s\n",
                kvx_last_error(who));
    CHECK_KVX(rc, who);
    uint8_t *snap = malloc(g.size);
    CHECK(snap != NULL);
    memcpy(snap, g.base, g.size);
    sleep_ms(200);
    if (memcmp(snap, g.base, g.size)) {
        uint64_t n = 0;
        for (uint64_t i = 0; i < g.size; i++)
            n += snap[i] != g.base[i];
        fprintf(stderr, "%llu bytes written after kvx_cancel returned\n",
                (unsigned long long)n);
        CHECK(!"no write after cancel");
    }
    /* it was in flight: not all of it arrived */
    CHECK(memchr(g.base, 0xa5, g.size) != NULL);
    free(snap);
    if (gen_cancels) {
        wait_event(g.c, 12, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
        wait_event(c.c, 12, KVX_EVENT_ERROR, KVX_ERR_CANCELLED, 3000);
    } else {
        wait_event(c.c, 12, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
        wait_event(g.c, 12, KVX_EVENT_ERROR, KVX_ERR_CANCELLED, 3000);
    }
    /* both pools are free again */
    CHECK_KVX(kvx_pool_deregister(g.c, g.pool, T_MS), g.c);
    CHECK_KVX(kvx_pool_deregister(c.c, c.pool, T_MS), c.c);
    free(bl);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

TEST(cancel_in_flight_by_gen)
{
    cancel_in_flight(1);
}
TEST(cancel_in_flight_by_ctx)
{
    cancel_in_flight(0);
}

TEST(cancel_unknown)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "cu-ctx", "cu-gen", 8, &c, &g, &cs, &gs);
    CHECK_FAILS(kvx_cancel(c.c, 424242, T_MS), c.c, KVX_ERR_NOT_FOUND,
                "424242");
    CHECK_FAILS(kvx_cancel(g.c, 424242, T_MS), g.c, KVX_ERR_NOT_FOUND,
                "cancel.key");
    /* a completed request is unknown too */
    uint32_t bl[1] = {3};
    fill_req(&c, 5, bl, 3);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 5, c.pool, bl, 1, 3, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 5, p.data, p.len, g.pool, bl, 1, 0, T_MS), g.c);
    wait_event(g.c, 5, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 5, KVX_EVENT_COMPLETE, 0, 3000);
    CHECK_FAILS(kvx_cancel(g.c, 5, T_MS), g.c, KVX_ERR_NOT_FOUND, "5");
    CHECK_FAILS(kvx_cancel(c.c, 5, T_MS), c.c, KVX_ERR_NOT_FOUND, "5");
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* ---- 11. a client killed mid-transfer ---------------------------------- */

typedef struct kill_sh {
    _Atomic int ready;
    pslot_t slot;
} kill_sh_t;

typedef struct kill_arg {
    daemon_t *d;
    kill_sh_t *sh;
} kill_arg_t;

static void kill_gen_main(void *arg)
{
    kill_arg_t *a = arg;
    side_t gs = {.inst = "kg-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t g;
    rank_open(a->d, &M_BIG, &gs, 0, BIG_BLOCKS, &g);
    uint32_t *bl = big_blocks();
    slot_wait(&a->sh->slot);
    CHECK_KVX(kvx_fetch(g.c, 13, a->sh->slot.data, a->sh->slot.len, g.pool, bl,
                        BIG_BLOCKS, 0, T_MS),
              g.c);
    atomic_store(&a->sh->ready, 1);
    for (;;)
        pause(); /* SIGKILLed here */
}

static void kill_ctx_main(void *arg)
{
    kill_arg_t *a = arg;
    side_t cs = {.inst = "kc-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c;
    rank_open(a->d, &M_BIG, &cs, 0, BIG_BLOCKS, &c);
    memset(c.base, 0x11, c.size);
    uint32_t *bl = big_blocks();
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 14, c.pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c.c);
    slot_put(&a->sh->slot, &p);
    for (;;)
        pause();
}

/* Wait until the status lists exactly n pools, none released. */
static void wait_pools(daemon_t *d, int n)
{
    int64_t end = now_ms() + 3000;
    for (;;) {
        char *json = status_json(d);
        int k = json_pool_count(json);
        int released = strstr(json, "released") != NULL;
        if (k == n && !released) {
            free(json);
            return;
        }
        if (now_ms() > end) {
            fprintf(stderr, "status lists %d pools (expected %d): %s\n", k, n,
                    json);
            free(json);
            CHECK(!"pool count back to expected");
        }
        free(json);
        sleep_ms(20);
    }
}

TEST(kill_gen_mid_transfer)
{
    daemon_t *d = daemon_start(SLOW_CFG);
    kill_sh_t *sh = shm_alloc(sizeof(*sh));
    kill_arg_t a = {d, sh};
    pid_t pid = spawn(kill_gen_main, &a);
    side_t cs = {.inst = "kg-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c;
    rank_open(d, &M_BIG, &cs, 0, BIG_BLOCKS, &c);
    memset(c.base, 0x11, c.size);
    uint32_t *bl = big_blocks();
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 13, c.pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c.c);
    slot_put(&sh->slot, &p);
    wait_count(&sh->ready, 1);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ev_t e = wait_event(c.c, 13, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    CHECK_STR_CONTAINS(e.msg, "disconnected");
    fresh_pair_ok(d, "kg-ctx2", "kg-gen2");
    wait_pools(d, 1); /* only this context rank's pool is left */
    daemon_healthy(d);
    free(bl);
    kvx_context_params_free(&p);
    rank_close(&c);
    wait_pools(d, 0);
    daemon_stop_ok(d);
}

TEST(kill_ctx_mid_transfer)
{
    daemon_t *d = daemon_start(SLOW_CFG);
    kill_sh_t *sh = shm_alloc(sizeof(*sh));
    kill_arg_t a = {d, sh};
    pid_t pid = spawn(kill_ctx_main, &a);
    side_t gs = {.inst = "kc-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t g;
    rank_open(d, &M_BIG, &gs, 0, BIG_BLOCKS, &g);
    uint32_t *bl = big_blocks();
    slot_wait(&sh->slot);
    CHECK_KVX(kvx_fetch(g.c, 14, sh->slot.data, sh->slot.len, g.pool, bl,
                        BIG_BLOCKS, 0, T_MS),
              g.c);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ev_t e = wait_event(g.c, 14, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    CHECK_STR_CONTAINS(e.msg, "context side");
    fresh_pair_ok(d, "kc-ctx2", "kc-gen2");
    wait_pools(d, 1);
    daemon_healthy(d);
    free(bl);
    rank_close(&g);
    wait_pools(d, 0);
    daemon_stop_ok(d);
}

/* ---- a rank of a two-rank context instance disconnects ---------------- */

/* A context rank of a two-rank instance disconnects: the other rank and
 * the consumer get errors. */
TEST(disconnect_ctx_rank)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs, gs = {.inst = "dx-gen",
                     .role = KVX_ROLE_GENERATION,
                     .tp = 1,
                     .pp = 1,
                     .preset = "vllm-nhd",
                     .tpb = 4};
    rank_t c0, c1, g;
    ctx2_open(d, &M_SMALL, "dx-ctx", 8, &cs, &c0, &c1);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g);
    uint32_t bl[2] = {0, 1}, bl2[2] = {2, 3};
    kvx_context_params_t p, p2;
    CHECK_KVX(kvx_publish(c0.c, 51, c0.pool, bl, 2, 8, &p, T_MS), c0.c);
    CHECK_KVX(kvx_publish(c0.c, 52, c0.pool, bl2, 2, 8, &p2, T_MS), c0.c);
    CHECK_KVX(kvx_fetch(g.c, 52, p2.data, p2.len, g.pool, bl, 2, 0, T_MS), g.c);
    rank_close(&c1);
    ev_t e[8];
    int n = collect(c0.c, e, 8, 2, 3000);
    CHECK_EQ(n, 2);
    expect_event(e, n, 51, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE);
    expect_event(e, n, 52, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE);
    ev_t ge = wait_event(g.c, 52, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 3000);
    CHECK_STR_CONTAINS(ge.msg, "context side");
    kvx_context_params_free(&p);
    /* the instance is incomplete now */
    CHECK_FAILS(kvx_publish(c0.c, 53, c0.pool, bl, 2, 8, &p, T_MS), c0.c,
                KVX_ERR_STATE, "has not said hello");
    kvx_context_params_free(&p2);
    rank_close(&c0);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* ---- 13. SIGTERM drains ------------------------------------------------- */

typedef struct dr_sh {
    _Atomic int ready, polling, gen_up, ctx_up;
    pslot_t a, b, c;
    int nev[2], codes[2][8], final_rc[2];
    uint64_t reqs[2][8];
    int64_t done_ms[2];
} dr_sh_t;

typedef struct dr_arg {
    daemon_t *d;
    dr_sh_t *sh;
    int who; /* 0: context rank 0 of dr-ctx, 1: generation rank */
} dr_arg_t;

/* Poll until want events or an error; record them. */
static void dr_poll(kvx_client_t *cl, dr_sh_t *sh, int who, int want)
{
    atomic_fetch_add(&sh->polling, 1);
    while (sh->nev[who] < want) {
        kvx_batch_t *b;
        int rc = kvx_poll(cl, 100, 20000, &b);
        if (rc) {
            sh->final_rc[who] = rc;
            break;
        }
        for (uint32_t i = 0; i < b->num_events && sh->nev[who] < 8; i++) {
            sh->reqs[who][sh->nev[who]] = b->events[i].request_id;
            sh->codes[who][sh->nev[who]++] = b->events[i].code;
        }
        kvx_batch_free(b);
    }
    sh->done_ms[who] = now_ms();
}

static void dr_main(void *arg)
{
    dr_arg_t *a = arg;
    dr_sh_t *sh = a->sh;
    if (a->who == 0) {
        side_t cs = {.inst = "dr-ctx",
                     .role = KVX_ROLE_CONTEXT,
                     .tp = 2,
                     .pp = 1,
                     .preset = "vllm-nhd",
                     .tpb = 4};
        rank_t c;
        /* dr-ctx is created after dr-gen: the drain then ends offer 32
         * before its waiting fetch (instances are walked newest first) */
        wait_count(&sh->gen_up, 1);
        rank_hello_only(a->d, &M_BIG, &cs, 0, &c);
        atomic_store(&sh->ctx_up, 1);
        rank_join(&c);
        rank_pool(&c, 16);
        barrier(&sh->ready, 3);
        uint32_t bl[2] = {0, 1}, bl2[2] = {2, 3};
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, 31, c.pool, bl, 2, 8, &p, T_MS), c.c);
        slot_put(&sh->a, &p);
        kvx_context_params_free(&p);
        CHECK_KVX(kvx_publish(c.c, 32, c.pool, bl2, 2, 8, &p, T_MS), c.c);
        slot_put(&sh->b, &p);
        kvx_context_params_free(&p);
        dr_poll(c.c, sh, 0, 2);
        rank_close(&c);
    } else {
        side_t gs = {.inst = "dr-gen",
                     .role = KVX_ROLE_GENERATION,
                     .tp = 1,
                     .pp = 1,
                     .preset = "vllm-nhd",
                     .tpb = 4};
        rank_t g;
        rank_hello_only(a->d, &M_BIG, &gs, 0, &g);
        atomic_store(&sh->gen_up, 1);
        rank_join(&g);
        rank_pool(&g, BIG_BLOCKS);
        barrier(&sh->ready, 3);
        uint32_t bl[2] = {0, 1};
        slot_wait(&sh->b);
        CHECK_KVX(
            kvx_fetch(g.c, 32, sh->b.data, sh->b.len, g.pool, bl, 2, 0, T_MS),
            g.c);
        uint32_t *big = big_blocks();
        slot_wait(&sh->c);
        CHECK_KVX(kvx_fetch(g.c, 33, sh->c.data, sh->c.len, g.pool, big,
                            BIG_BLOCKS, 0, T_MS),
                  g.c);
        free(big);
        dr_poll(g.c, sh, 1, 2);
        rank_close(&g);
    }
}

TEST(sigterm_drain)
{
    daemon_t *d = daemon_start(SLOW_CFG "deadlines:\n"
                                        "  drain_timeout_ms: 2000\n");
    dr_sh_t *sh = shm_alloc(sizeof(*sh));
    dr_arg_t args[2] = {{d, sh, 0}, {d, sh, 1}};
    pid_t pids[2];
    for (int i = 0; i < 2; i++)
        pids[i] = spawn(dr_main, &args[i]);
    /* dr-ctx rank 1 (silent, here) and a tp 1 context with a 64 MiB
     * request that is being copied when SIGTERM arrives */
    side_t cs1 = {.inst = "dr-ctx",
                  .role = KVX_ROLE_CONTEXT,
                  .tp = 2,
                  .pp = 1,
                  .preset = "vllm-nhd",
                  .tpb = 4};
    rank_t c1, cb;
    wait_count(&sh->ctx_up, 1);
    rank_open(d, &M_BIG, &cs1, 1, 16, &c1);
    side_t csb = {.inst = "dr-ctxb",
                  .role = KVX_ROLE_CONTEXT,
                  .tp = 1,
                  .pp = 1,
                  .preset = "vllm-nhd",
                  .tpb = 4};
    rank_open(d, &M_BIG, &csb, 0, BIG_BLOCKS, &cb);
    uint32_t *big = big_blocks();
    kvx_context_params_t p;
    barrier(&sh->ready, 3);
    CHECK_KVX(
        kvx_publish(cb.c, 33, cb.pool, big, BIG_BLOCKS, BIG_TOK, &p, T_MS),
        cb.c);
    slot_put(&sh->c, &p);
    kvx_context_params_free(&p);
    free(big);
    wait_count(&sh->polling, 2);
    sleep_ms(30);
    /* in flight now: offer 31 (unfetched), 32 (waiting for rank 1), 33
     * (copying) */
    char *json;
    CHECK_KVX(kvx_requests_json(cb.c, &json, T_MS), cb.c);
    int inflight = count_str(json, "\"request_id\":");
    if (inflight < 4)
        fprintf(stderr, "requests before SIGTERM: %s\n", json);
    free(json);
    CHECK(inflight >= 4); /* 31, 32 on both sides, 33 on at least one */
    int64_t t0 = now_ms();
    kill(d->pid, SIGTERM);
    int st = daemon_wait(d, 8000);
    CHECK(st != -1);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fprintf(stderr, "daemon exit status %d\n", st);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(wait_children(pids, 2, 5000));
    for (int w = 0; w < 2; w++) {
        CHECK(sh->done_ms[w] - t0 < 5000);
        for (int i = 0; i < sh->nev[w]; i++) {
            /* 31 and 32 cannot finish; 33, being copied, may finish
             * within deadlines.drain_timeout_ms */
            int ok = sh->codes[w][i] == KVX_ERR_SHUTDOWN ||
                     (sh->reqs[w][i] == 33 && sh->codes[w][i] == 0);
            if (!ok)
                fprintf(stderr, "%s: request %llu ended with %s\n",
                        w ? "gen" : "ctx", (unsigned long long)sh->reqs[w][i],
                        kvx_status_name(sh->codes[w][i]));
            CHECK(ok);
        }
        /* all events, or the connection closed cleanly */
        if (sh->nev[w] < 2)
            CHECK_EQ(sh->final_rc[w], KVX_ERR_CLOSED);
    }
    CHECK(sh->nev[0] >= 1); /* the waiting poll was answered */
    CHECK(sh->nev[1] >= 1);
    CHECK(access(d->sock, F_OK) != 0 && errno == ENOENT);
    CHECK(log_contains(d, "drain"));
    /* the clients left over see a closed connection, not a hang */
    kvx_batch_t *b;
    int rc = kvx_poll(c1.c, 1, 1000, &b);
    if (rc == 0)
        kvx_batch_free(b);
    CHECK(rc != 0);
    rank_close(&c1);
    rank_close(&cb);
}

/* ---- what sessions leave behind --------------------------------------- */

/* Sessions, pools and fds come and go without leaving anything in the
 * daemon: fds passed before hello are closed, pools are unmapped. */
TEST(resource_cleanup)
{
    daemon_t *d = daemon_start(NULL);
    daemon_healthy(d);
    sleep_ms(50);
    int fds0 = count_fds(d->pid);
    CHECK_EQ(count_pool_maps(d->pid), 0);
    for (int round = 0; round < 5; round++) {
        rank_t c, g;
        side_t cs, gs;
        pair_open(d, &M_SMALL, "rc-ctx", "rc-gen", 8, &c, &g, &cs, &gs);
        uint32_t bl[2] = {0, 1};
        fill_req(&c, 1, bl, 8);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, 1, c.pool, bl, 2, 8, &p, T_MS), c.c);
        if (round % 2)
            CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, bl, 2, 0, T_MS),
                      g.c);
        kvx_context_params_free(&p);
        if (round == 1) {
            wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 3000);
            CHECK_KVX(kvx_pool_deregister(g.c, g.pool, T_MS), g.c);
        }
        CHECK(count_pool_maps(d->pid) >= 1);
        rank_close(&c); /* with its offer in flight on even rounds */
        rank_close(&g);
    }
    /* fds sent with SCM_RIGHTS before hello */
    for (int i = 0; i < 10; i++) {
        int fd = raw_connect(d);
        int pass = memfd_create("kvx-it", MFD_CLOEXEC);
        CHECK(pass >= 0);
        uint8_t hdr[4] = {2, 0, 0, 0};
        struct iovec iov = {hdr, 4};
        union {
            char b[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } cm;
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = cm.b,
                            .msg_controllen = sizeof(cm.b)};
        struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
        h->cmsg_level = SOL_SOCKET;
        h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(h), &pass, sizeof(int));
        CHECK(sendmsg(fd, &mh, MSG_NOSIGNAL) == 4);
        close(pass);
        close(fd);
    }
    daemon_healthy(d);
    int64_t end = now_ms() + 3000;
    while ((count_fds(d->pid) != fds0 || count_pool_maps(d->pid) != 0) &&
           now_ms() < end)
        sleep_ms(20);
    CHECK_EQ(count_pool_maps(d->pid), 0);
    CHECK_EQ(count_fds(d->pid), fds0);
    char *json = status_json(d);
    CHECK_EQ(json_pool_count(json), 0);
    CHECK_STR_CONTAINS(json, "\"sessions\":[{"); /* just this one */
    CHECK_EQ(count_str(json, "\"session_id\":"), 1);
    free(json);
    daemon_stop_ok(d);
}

/* The library never raises SIGPIPE: a process with the default action
 * survives calls on a connection whose daemon died. */
static void sp_child(void *arg)
{
    daemon_t *d = arg;
    signal(SIGPIPE, SIG_DFL);
    rank_t c;
    side_t cs = {.inst = "sp",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_open(d, &M_SMALL, &cs, 0, 8, &c);
    kill(d->pid, SIGKILL);
    sleep_ms(100);
    uint32_t bl[2] = {0, 1};
    kvx_context_params_t p;
    for (int i = 0; i < 3; i++) {
        int rc = kvx_publish(c.c, 1, c.pool, bl, 2, 8, &p, T_MS);
        CHECK(rc == KVX_ERR_CLOSED || rc == KVX_ERR_IO);
    }
    kvx_batch_t *b;
    CHECK(kvx_poll(c.c, 1, 10, &b) != 0);
    rank_close(&c);
}

TEST(no_sigpipe)
{
    daemon_t *d = daemon_start(NULL);
    pid_t pid = spawn(sp_child, d);
    CHECK(wait_children(&pid, 1, 10000));
    CHECK(daemon_wait(d, 3000) != -1);
}
