/*
 * t_lease.c — per-offer leases (2.6): a lease shorter than the daemon's
 * ends the offer at its own time, a renewed offer outlives its lease
 * (kvx_renew), renewals of ended or foreign offers fail item by item,
 * a step of reservations in one round trip (kvx_reserve with ITEMS),
 * and the bounds. Across two daemons: t_peer_transfer.c's peer_renew.
 */

/* Publish request req (key: its digits) of rank c, blocks cb, ntok
 * tokens, under lease_ms (0: not set, the daemon's). */
static int ls_publish(rank_t *c, uint64_t req, const uint32_t *cb, uint32_t nb,
                      uint32_t ntok, uint32_t lease_ms, kvx_context_params_t *p)
{
    char key[24];
    snprintf(key, sizeof(key), "%llu", (unsigned long long)req);
    kvx_publish_args_t a = {
        .field_mask = KVX_PUBLISH_FIELD_KEY | KVX_PUBLISH_FIELD_BLOCKS |
                      KVX_PUBLISH_FIELD_NUM_TOKENS | KVX_PUBLISH_FIELD_PARAMS |
                      (lease_ms ? KVX_PUBLISH_FIELD_LEASE : 0),
        .key = key,
        .key_len = strlen(key),
        .pool_id = c->pool,
        .blocks = cb,
        .num_blocks = nb,
        .num_tokens = ntok,
        .params = p,
        .lease_ms = lease_ms};
    return kvx_publish3(c->c, &a);
}

/* Renew the n offers of ps from client r; outcomes into o. */
static int ls_renew(kvx_client_t *r, const kvx_context_params_t *ps, size_t n,
                    kvx_outcome_t *o)
{
    kvx_renew_args_t a = {.field_mask = KVX_RENEW_FIELD_PARAMS |
                                        KVX_RENEW_FIELD_OUTCOMES |
                                        KVX_RENEW_FIELD_TIMEOUT,
                          .params = ps,
                          .num_params = n,
                          .outcomes = o,
                          .timeout_ms = T_MS};
    return kvx_renew(r, &a);
}

/* An offer published with a lease of 300 ms ends TIMED_OUT at its own
 * lease, naming it, though the daemon's is 30 s; the params carry the
 * lease (kvx_params_lease). An offer published beside it without one
 * gets the daemon's, says so in its params, and is still there to be
 * fetched, every byte. */
TEST(lease_own_time)
{
    daemon_t *d = daemon_start("deadlines:\n  offer_lease_ms: 30000\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "ls-ctx", "ls-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t b1[2] = {0, 1}, b2[2] = {2, 3};
    fill_req(&c, 2, b2, 7);
    kvx_context_params_t p1, p2;
    CHECK_KVX(ls_publish(&c, 1, b1, 2, 7, 300, &p1), c.c);
    CHECK_KVX(ls_publish(&c, 2, b2, 2, 7, 0, &p2), c.c);
    uint32_t lease = 0;
    CHECK_EQ(kvx_params_lease(p1.data, p1.len, &lease), KVX_OK);
    CHECK_EQ(lease, 300);
    CHECK_EQ(kvx_params_lease(p2.data, p2.len, &lease), KVX_OK);
    CHECK_EQ(lease, 30000);
    CHECK_EQ(kvx_params_lease("junk", 4, &lease), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(NULL), "kvx_params_lease");
    ev_t e = wait_event(c.c, 1, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 5000);
    CHECK_STR_CONTAINS(e.msg, "offer lease of 300 ms expired");
    /* the other is held still */
    uint32_t gb[2] = {4, 5};
    CHECK_KVX(kvx_fetch(g.c, 2, p2.data, p2.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 2, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 2, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t ex = {2, gb, 7, 0};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p1);
    kvx_context_params_free(&p2);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* Two offers under a lease of 400 ms, one renewed by a scheduler process
 * (an observer connection) every 100 ms for 1.6 s, four of its leases:
 * the other ends TIMED_OUT at its lease, the renewed one is fetched
 * after, every byte as the prefill wrote it. A renewal of an offer
 * being fetched answers 0. */
TEST(lease_renewed)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lr-ctx", "lr-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t b1[2] = {0, 1}, b2[2] = {2, 3};
    fill_req(&c, 1, b1, 7);
    kvx_context_params_t p1, p2;
    CHECK_KVX(ls_publish(&c, 1, b1, 2, 7, 400, &p1), c.c);
    CHECK_KVX(ls_publish(&c, 2, b2, 2, 7, 400, &p2), c.c);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_outcome_t o[1];
    int64_t until = now_ms() + 1600;
    while (now_ms() < until) {
        CHECK_KVX(ls_renew(sched, &p1, 1, o), sched);
        CHECK_EQ(o[0].code, 0);
        CHECK_EQ(o[0].answered, 1);
        sleep_ms(100);
    }
    ev_t e = wait_event(c.c, 2, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 3000);
    CHECK_STR_CONTAINS(e.msg, "offer lease of 400 ms expired");
    uint32_t gb[2] = {5, 6};
    CHECK_KVX(kvx_fetch(g.c, 1, p1.data, p1.len, g.pool, gb, 2, 0, T_MS), g.c);
    int rc = ls_renew(sched, &p1, 1, o); /* fetched, or complete already */
    CHECK(rc == 0 || rc == KVX_ERR_NOT_FOUND);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t ex = {1, gb, 7, 0};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_close(sched);
    kvx_context_params_free(&p1);
    kvx_context_params_free(&p2);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* One renewal of four offers, each failing or not on its own: a live
 * one (0), a released one and an expired one (NOT_FOUND, saying it
 * ended), params whose token is forged (AUTH); the call returns the
 * first failure, naming its item. The live offer is fetched after, every
 * byte. Refused before anything is sent: no params, over KVX_MANY_MAX,
 * empty params, an unknown field_mask bit. */
TEST(lease_renew_items)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lt-ctx", "lt-gen", 16, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t b1[2] = {0, 1}, b2[2] = {2, 3}, b3[2] = {4, 5}, b4[2] = {6, 7};
    fill_req(&c, 1, b1, 7);
    kvx_context_params_t p[4];
    CHECK_KVX(ls_publish(&c, 1, b1, 2, 7, 0, &p[0]), c.c);
    CHECK_KVX(ls_publish(&c, 2, b2, 2, 7, 0, &p[1]), c.c);
    CHECK_KVX(ls_publish(&c, 3, b3, 2, 7, 100, &p[2]), c.c);
    CHECK_KVX(ls_publish(&c, 4, b4, 2, 7, 0, &p[3]), c.c);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    CHECK_KVX(kvx_release(sched, p[1].data, p[1].len, T_MS), sched);
    ev_t ev[4];
    CHECK_EQ(collect(c.c, ev, 4, 2, 5000), 2);
    CHECK_STR_CONTAINS(expect_event(ev, 2, 2, KVX_EVENT_COMPLETE, 0)->msg,
                       "released");
    expect_event(ev, 2, 3, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT);
    /* item 3: the token forged */
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p[3].len, p[3].data);
    CHECK(cp != NULL && cp->token.len > 0);
    cp->token.data[0] ^= 1;
    kvxfer__context_params__pack(cp, p[3].data); /* same size */
    kvxfer__context_params__free_unpacked(cp, NULL);
    kvx_outcome_t o[4];
    CHECK_FAILS(ls_renew(sched, p, 4, o), sched, KVX_ERR_NOT_FOUND,
                "kvx_renew: item 1 (key 2): renew: no offer of request");
    CHECK_EQ(o[0].code, 0);
    CHECK_EQ(o[1].code, KVX_ERR_NOT_FOUND);
    CHECK_EQ(o[2].code, KVX_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(o[2].message, "(ended, or never made)");
    CHECK_EQ(o[3].code, KVX_ERR_AUTH);
    CHECK_STR_CONTAINS(o[3].message, "token is not that of request 4");
    for (int i = 0; i < 4; i++)
        CHECK_EQ(o[i].answered, 1);
    /* refused here, nothing sent */
    CHECK_FAILS(ls_renew(sched, NULL, 1, o), sched, KVX_ERR_INVALID,
                "kvx_renew: 1 params at NULL (1 to 256)");
    CHECK_FAILS(ls_renew(sched, p, 0, o), sched, KVX_ERR_INVALID,
                "kvx_renew: 0 params (1 to 256)");
    CHECK_FAILS(ls_renew(sched, p, KVX_MANY_MAX + 1, o), sched, KVX_ERR_INVALID,
                "kvx_renew: 257 params (1 to 256)");
    kvx_context_params_t empty[1] = {{NULL, 0}};
    CHECK_FAILS(ls_renew(sched, empty, 1, o), sched, KVX_ERR_INVALID,
                "kvx_renew: params[0] is empty");
    kvx_renew_args_t bad = {.field_mask = KVX_RENEW_FIELD_PARAMS | (1ull << 3),
                            .params = p,
                            .num_params = 1};
    CHECK_FAILS(kvx_renew(sched, &bad), sched, KVX_ERR_INVALID,
                "kvx_renew: field_mask bit 0x8 is unknown to libkvxfer");
    bad.field_mask = 0;
    CHECK_FAILS(kvx_renew(sched, &bad), sched, KVX_ERR_INVALID,
                "kvx_renew: field_mask lacks KVX_RENEW_FIELD_PARAMS");
    /* garbage params: the daemon's refusal */
    kvx_context_params_t junk[1] = {{(uint8_t *)"junk", 4}};
    CHECK_FAILS(ls_renew(sched, junk, 1, o), sched, KVX_ERR_INVALID,
                "context_params");
    /* the live one moves, every byte */
    uint32_t gb[2] = {8, 9};
    CHECK_KVX(kvx_fetch(g.c, 1, p[0].data, p[0].len, g.pool, gb, 2, 0, T_MS),
              g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t ex = {1, gb, 7, 0};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    CHECK_KVX(kvx_cancel(c.c, 4, T_MS), c.c);
    kvx_close(sched);
    for (int i = 0; i < 4; i++)
        kvx_context_params_free(&p[i]);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* 256 reservations in one call (a scheduler's step), item 100 with
 * num_tokens 0: it alone fails, by name, in its outcome; every other
 * item has its params, and its lease when it asked one. The rank's
 * publish of item 7 returns the same params, and a fetch moves its
 * bytes. */
TEST(lease_reserve_many)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lm-ctx", "lm-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    enum { N = KVX_MANY_MAX };
    static kvx_reserve_args_t it[N];
    static kvx_context_params_t ps[N];
    static kvx_outcome_t o[N];
    static char keys[N][16];
    for (int i = 0; i < N; i++) {
        snprintf(keys[i], sizeof(keys[i]), "%d", 1000 + i);
        it[i] = (kvx_reserve_args_t){
            .field_mask = KVX_RESERVE_FIELD_KEY | KVX_RESERVE_FIELD_INSTANCE |
                          KVX_RESERVE_FIELD_NUM_TOKENS |
                          KVX_RESERVE_FIELD_PARAMS | KVX_RESERVE_FIELD_OUTCOME |
                          (i % 2 ? KVX_RESERVE_FIELD_LEASE : 0),
            .key = keys[i],
            .key_len = strlen(keys[i]),
            .instance_id = "lm-ctx",
            .num_tokens = i == 100 ? 0 : 7,
            .params = &ps[i],
            .outcome = &o[i],
            .lease_ms = 20000};
    }
    kvx_reserve_args_t all = {.field_mask = KVX_RESERVE_FIELD_ITEMS |
                                            KVX_RESERVE_FIELD_TIMEOUT,
                              .items = it,
                              .num_items = N,
                              .timeout_ms = T_MS};
    CHECK_FAILS(kvx_reserve3(sched, &all), sched, KVX_ERR_INVALID,
                "kvx_reserve: item 100 (key 1100): reserve.num_tokens: 0");
    for (int i = 0; i < N; i++) {
        CHECK_EQ(o[i].answered, 1);
        if (i == 100) {
            CHECK_EQ(o[i].code, KVX_ERR_INVALID);
            CHECK_STR_CONTAINS(o[i].message, "reserve.num_tokens: 0");
            CHECK(ps[i].data == NULL);
            continue;
        }
        CHECK_EQ(o[i].code, 0);
        uint32_t lease = 0;
        CHECK_EQ(kvx_params_lease(ps[i].data, ps[i].len, &lease), KVX_OK);
        CHECK_EQ(lease, i % 2 ? 20000 : 30000);
    }
    /* the rank publishes item 7 (key "1007"): the same params */
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1007, cb, 7);
    kvx_context_params_t pp;
    CHECK_KVX(ls_publish(&c, 1007, cb, 2, 7, 0, &pp), c.c);
    CHECK_EQ(pp.len, ps[7].len);
    CHECK(!memcmp(pp.data, ps[7].data, pp.len));
    CHECK_FAILS(ls_publish(&c, 1009, cb, 2, 7, 500, &pp), c.c, KVX_ERR_MISMATCH,
                "publish.lease_ms: 500 differs from the offer's lease of "
                "20000 ms (the reservation's)");
    CHECK_KVX(
        kvx_fetch(g.c, 1007, ps[7].data, ps[7].len, g.pool, gb, 2, 0, T_MS),
        g.c);
    wait_event(g.c, 1007, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 1007, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t ex = {1007, gb, 7, 0};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    /* a batch's args set only items, timeout and outcome */
    all.field_mask |= KVX_RESERVE_FIELD_LEASE;
    CHECK_FAILS(kvx_reserve3(sched, &all), sched, KVX_ERR_INVALID,
                "kvx_reserve: field_mask has KVX_RESERVE_FIELD_LEASE beside "
                "KVX_RESERVE_FIELD_ITEMS");
    all.field_mask = KVX_RESERVE_FIELD_ITEMS;
    all.num_items = N + 1;
    CHECK_FAILS(kvx_reserve3(sched, &all), sched, KVX_ERR_INVALID,
                "kvx_reserve: 257 items (at most 256)");
    kvx_context_params_free(&pp);
    for (int i = 0; i < N; i++)
        kvx_context_params_free(&ps[i]);
    kvx_close(sched);
    rank_close(&g);
    rank_close(&c);
    /* the reservations nobody published end at their leases, or here */
    daemon_stop_ok(d);
}

/* The bounds: a lease over deadlines.offer_lease_max_ms is refused by
 * publish and reserve, naming the field and the key; one at the bound is
 * taken. */
TEST(lease_bounds)
{
    daemon_t *d = daemon_start("deadlines:\n  offer_lease_max_ms: 5000\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lb-ctx", "lb-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[2] = {0, 1};
    kvx_context_params_t p;
    CHECK_FAILS(ls_publish(&c, 1, cb, 2, 7, 5001, &p), c.c, KVX_ERR_INVALID,
                "publish.lease_ms: 5001 ms is over the daemon's "
                "deadlines.offer_lease_max_ms (5000 ms)");
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_reserve_args_t ra = {
        .field_mask = KVX_RESERVE_FIELD_KEY | KVX_RESERVE_FIELD_INSTANCE |
                      KVX_RESERVE_FIELD_NUM_TOKENS | KVX_RESERVE_FIELD_PARAMS |
                      KVX_RESERVE_FIELD_LEASE,
        .key = "r",
        .key_len = 1,
        .instance_id = "lb-ctx",
        .num_tokens = 7,
        .params = &p,
        .lease_ms = 90000};
    CHECK_FAILS(kvx_reserve3(sched, &ra), sched, KVX_ERR_INVALID,
                "reserve.lease_ms: 90000 ms is over the daemon's "
                "deadlines.offer_lease_max_ms (5000 ms)");
    ra.lease_ms = 5000;
    CHECK_KVX(kvx_reserve3(sched, &ra), sched);
    uint32_t lease = 0;
    CHECK_EQ(kvx_params_lease(p.data, p.len, &lease), KVX_OK);
    CHECK_EQ(lease, 5000);
    kvx_context_params_free(&p);
    CHECK_KVX(ls_publish(&c, 1, cb, 2, 7, 5000, &p), c.c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_cancel(c.c, 1, T_MS), c.c);
    kvx_close(sched);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}
