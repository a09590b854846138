/*
 * t_keys.c — requests named by keys (kvx_publish_key, kvx_fetch_key,
 * kvx_cancel_key): string and binary keys on one daemon and across two,
 * the keys in events, params, status; the refusals.
 */

/* Poll c until an event for key arrives (or timeout_ms): it is returned,
 * with any other events dropped. */
static ev_t wait_key(kvx_client_t *c, const void *key, size_t klen,
                     int timeout_ms)
{
    ev_t e[16];
    int64_t end = now_ms() + timeout_ms;
    while (now_ms() < end) {
        int n = collect(c, e, 16, 1, 300);
        for (int i = 0; i < n && i < 16; i++)
            if (e[i].key_len == klen && !memcmp(e[i].key, key, klen))
                return e[i];
    }
    fprintf(stderr, "no event for key '%.*s'\n", (int)klen, (const char *)key);
    CHECK(!"event for key");
    return e[0];
}

/* vLLM-style string keys, different on the two sides: the bytes land,
 * each side's event names its own key (request_id 0: not a number), the
 * params carry the context side's key, the request list shows it, and a
 * cancel by key ends it. */
TEST(keys_name_requests)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "ky-ctx", "ky-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    const char *ck = "cmpl-7f3a9c0e-0", *gk = "decode/cmpl-7f3a9c0e-0";
    uint32_t cb[2] = {3, 5}, gb[2] = {6, 1};
    fill_req(&c, 9001, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_key(c.c, ck, strlen(ck), c.pool, cb, 2, 7, NULL, 0,
                              &p, T_MS),
              c.c);
    kvx_params_info_t info;
    CHECK_EQ(kvx_params_info(p.data, p.len, &info), KVX_OK);
    CHECK_EQ(info.key_len, strlen(ck));
    CHECK(!memcmp(info.key, ck, info.key_len));
    CHECK_EQ(info.request_id, 0);
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK_STR_CONTAINS(json, "\"key\":\"cmpl-7f3a9c0e-0\",\"request_id\":0,"
                             "\"side\":\"context\"");
    free(json);
    CHECK_KVX(kvx_fetch_key(g.c, gk, strlen(gk), p.data, p.len, g.pool, gb, 2,
                            0, 0, T_MS),
              g.c);
    ev_t ge = wait_key(g.c, gk, strlen(gk), 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.req, 0);
    ev_t ce = wait_key(c.c, ck, strlen(ck), 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = 9001, .blocks = gb, .ntok = 7};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p);

    /* a cancel by key ends the offer: CANCELLED under its key */
    CHECK_KVX(kvx_publish_key(c.c, ck, strlen(ck), c.pool, cb, 2, 7, NULL, 0,
                              &p, T_MS),
              c.c);
    CHECK_KVX(kvx_cancel_key(c.c, ck, strlen(ck), T_MS), c.c);
    ce = wait_key(c.c, ck, strlen(ck), 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_CANCELLED);
    CHECK_FAILS(kvx_cancel_key(c.c, ck, strlen(ck), T_MS), c.c,
                KVX_ERR_NOT_FOUND, "cancel.key: no request cmpl-7f3a9c0e-0");
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Binary keys (zero bytes, the longest, 128 bytes) move like any other;
 * the uint64_t calls are the keys of their digits, so kvx_publish(42) and
 * kvx_fetch_key("42") meet. Refusals: an empty key, 129 bytes (by the
 * library and, sent raw, by the daemon), a key that is not the offer's. */
TEST(keys_binary_longest_and_refused)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "kb-ctx", "kb-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint8_t k128[KVX_MAX_KEY];
    for (unsigned i = 0; i < sizeof(k128); i++)
        k128[i] = (uint8_t)(i * 7); /* k128[0] is 0 */
    uint32_t cb[2] = {1, 2}, gb[2] = {4, 7};
    fill_req(&c, 77, cb, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish_key(c.c, k128, sizeof(k128), c.pool, cb, 2, 8, NULL,
                              0, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_fetch(g.c, 42, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t ge = wait_key(g.c, "42", 2, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(ge.req, 42); /* the uint64_t form of "42" */
    ev_t ce = wait_key(c.c, k128, sizeof(k128), 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = 77, .blocks = gb, .ntok = 8};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&p);

    /* refused by the library, nothing sent */
    uint8_t k129[KVX_MAX_KEY + 1] = {0};
    CHECK_FAILS(kvx_publish_key(c.c, k129, sizeof(k129), c.pool, cb, 2, 8, NULL,
                                0, &p, T_MS),
                c.c, KVX_ERR_INVALID, "key of 129 bytes");
    CHECK_FAILS(
        kvx_publish_key(c.c, "", 0, c.pool, cb, 2, 8, NULL, 0, &p, T_MS), c.c,
        KVX_ERR_INVALID, "key of 0 bytes");
    CHECK_FAILS(kvx_cancel_key(c.c, NULL, 3, T_MS), c.c, KVX_ERR_INVALID,
                "(NULL)");
    CHECK_FAILS(
        kvx_publish_key(c.c, "a", 1, c.pool, cb, 2, 8, NULL, 1, &p, T_MS), c.c,
        KVX_ERR_INVALID, "aux is NULL");
    /* refused by the daemon: a raw Publish with 129 bytes, and none */
    int fd = raw_connect(d);
    raw_hello(fd, "kb-raw");
    for (int k = 0; k < 2; k++) {
        Kvxfer__Publish pu = KVXFER__PUBLISH__INIT;
        pu.key.data = k129;
        pu.key.len = k ? 0 : sizeof(k129);
        pu.pool_id = 1;
        Kvxfer__Request rq = KVXFER__REQUEST__INIT;
        rq.id = 2 + k;
        rq.body_case = KVXFER__REQUEST__BODY_PUBLISH;
        rq.publish = &pu;
        raw_send_request(fd, &rq);
        Kvxfer__Reply *r = raw_reply(fd, T_MS);
        CHECK(r != NULL);
        CHECK_EQ(r->status, KVX_ERR_INVALID);
        CHECK_STR_CONTAINS(r->message, k ? "publish.key: 0 bytes"
                                         : "publish.key: 129 bytes");
        kvxfer__reply__free_unpacked(r, NULL);
    }
    close(fd);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* The scheduler reserves (an observer connection, no Hello): the params
 * come at once and are the bytes the rank's publish returns later; a
 * fetch made before the publish waits for it, then the bytes land. The
 * refusals name the field: the same key again, an unknown instance, a
 * zero token count; a reserved key that is published is no longer
 * reservable. The scheduler leaving changes nothing. */
TEST(reserve_then_publish)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "rs-ctx", "rs-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    const char *k = "cmpl-rs-1";
    kvx_context_params_t rp, pp;
    CHECK_KVX(kvx_reserve(sched, "rs-ctx", k, strlen(k), 7, &rp, T_MS), sched);
    kvx_params_info_t info;
    CHECK_EQ(kvx_params_info(rp.data, rp.len, &info), KVX_OK);
    CHECK_EQ(info.num_tokens, 7);
    CHECK(!strcmp(info.instance_id, "rs-ctx"));
    CHECK_FAILS(kvx_reserve(sched, "rs-ctx", k, strlen(k), 7, &pp, T_MS), sched,
                KVX_ERR_EXISTS, "cmpl-rs-1 of instance rs-ctx is reserved");
    CHECK_FAILS(kvx_reserve(sched, "nope", k, strlen(k), 7, &pp, T_MS), sched,
                KVX_ERR_NOT_FOUND, "reserve.instance_id: no instance 'nope'");
    CHECK_FAILS(kvx_reserve(sched, "rs-ctx", "z", 1, 0, &pp, T_MS), sched,
                KVX_ERR_INVALID, "reserve.num_tokens: 0");
    CHECK_FAILS(kvx_reserve(sched, "rs-gen", "z", 1, 7, &pp, T_MS), sched,
                KVX_ERR_STATE, "role generation");
    char *json;
    CHECK_KVX(kvx_requests_json(sched, &json, T_MS), sched);
    CHECK_STR_CONTAINS(json, "\"key\":\"cmpl-rs-1\"");
    CHECK_STR_CONTAINS(json, "\"state\":\"reserved\"");
    free(json);
    kvx_close(sched); /* the reservation stays */
    /* the fetch comes first and waits */
    uint32_t cb[2] = {6, 2}, gb[2] = {3, 4};
    CHECK_KVX(
        kvx_fetch_key(g.c, "g1", 2, rp.data, rp.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    ev_t e[4];
    CHECK_EQ(collect(g.c, e, 4, 1, 300), 0); /* nothing yet */
    fill_req(&c, 4242, cb, 7);
    CHECK_KVX(kvx_publish_key(c.c, k, strlen(k), c.pool, cb, 2, 7, NULL, 0, &pp,
                              T_MS),
              c.c);
    CHECK_EQ(pp.len, rp.len);
    CHECK(!memcmp(pp.data, rp.data, rp.len)); /* the same params */
    ev_t ge = wait_key(g.c, "g1", 2, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    ev_t ce = wait_key(c.c, k, strlen(k), 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = 4242, .blocks = gb, .ntok = 7};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    kvx_context_params_free(&rp);
    kvx_context_params_free(&pp);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A reservation no rank publishes ends TIMED_OUT at the lease, an event
 * for the context rank under its key; a fetch waiting on it ends too.
 * A reservation whose rank leaves ends with the instance's requests. And
 * before any rank registered a pool, reserve is refused (STATE). */
TEST(reserve_faults)
{
    daemon_t *d = daemon_start("deadlines:\n  offer_lease_ms: 300\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "rf-ctx", "rf-gen", 8, &c, &g, &cs, &gs);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_context_params_t rp;
    CHECK_KVX(kvx_reserve(sched, "rf-ctx", "lease", 5, 4, &rp, T_MS), sched);
    ev_t ce = wait_key(c.c, "lease", 5, 3000);
    CHECK_EQ(ce.kind, KVX_EVENT_TIMED_OUT);
    kvx_context_params_free(&rp);
    /* the rank leaves: the reservation and the fetch waiting on it end */
    CHECK_KVX(kvx_reserve(sched, "rf-ctx", "gone", 4, 4, &rp, T_MS), sched);
    uint32_t gb[1] = {0};
    CHECK_KVX(kvx_fetch_key(g.c, "g-gone", 6, rp.data, rp.len, g.pool, gb, 1, 0,
                            0, T_MS),
              g.c);
    rank_close(&c);
    ev_t ge = wait_key(g.c, "g-gone", 6, 3000);
    CHECK(ge.kind == KVX_EVENT_ERROR || ge.kind == KVX_EVENT_CANCELLED);
    fprintf(stderr, "fetch after the rank left: %s %s\n",
            kvx_status_name(ge.code), ge.msg);
    CHECK_FAILS(kvx_reserve(sched, "rf-ctx", "after", 5, 4, &rp, T_MS), sched,
                KVX_ERR_STATE, "local rank 0 has not said hello");
    kvx_context_params_free(&rp);
    /* no pool yet */
    rank_t c2;
    side_t s2 = cs;
    s2.inst = "rf-nopool";
    rank_hello_only(d, &M_SMALL, &s2, 0, &c2);
    rank_join(&c2);
    CHECK_FAILS(kvx_reserve(sched, "rf-nopool", "x", 1, 4, &rp, T_MS), sched,
                KVX_ERR_STATE, "has registered a pool");
    rank_close(&c2);
    kvx_close(sched);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Fetch by key on one daemon: the generation rank names the context
 * instance, its rank 0's daemon and the key, before anything is
 * published; the publish then moves the bytes. After a reservation the
 * same. A cancel ends a waiting one (CANCELLED, nothing written later);
 * a key never published ends TIMED_OUT naming it; an offer taken by
 * another fetch ends it EXISTS; bad arguments are refused at once. */
TEST(fetch_by_key_one_daemon)
{
    daemon_t *d = daemon_start("deadlines:\n  fetch_timeout_ms: 800\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "fk-ctx", "fk-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[2] = {1, 5}, gb[2] = {7, 0};
    /* before the publish */
    CHECK_KVX(kvx_fetch_by_key(g.c, "d-1", 3, "fk-ctx", c.addr, "room-1", 6,
                               g.pool, gb, 2, 0, 0, T_MS),
              g.c);
    ev_t e[4];
    CHECK_EQ(collect(g.c, e, 4, 1, 200), 0); /* it waits */
    fill_req(&c, 501, cb, 6);
    kvx_context_params_t p;
    CHECK_KVX(
        kvx_publish_key(c.c, "room-1", 6, c.pool, cb, 2, 6, NULL, 0, &p, T_MS),
        c.c);
    kvx_context_params_free(&p);
    ev_t ge = wait_key(g.c, "d-1", 3, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "room-1", 6, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = 501, .blocks = gb, .ntok = 6};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);

    /* after the publish: found at once */
    uint32_t gb2[2] = {2, 3};
    fill_req(&c, 502, cb, 8);
    CHECK_KVX(
        kvx_publish_key(c.c, "room-2", 6, c.pool, cb, 2, 8, NULL, 0, &p, T_MS),
        c.c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_fetch_by_key(g.c, "d-2", 3, "fk-ctx", c.addr, "room-2", 6,
                               g.pool, gb2, 2, 0, 0, T_MS),
              g.c);
    CHECK_EQ(wait_key(g.c, "d-2", 3, 3000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "room-2", 6, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex2[2] = {{.req = 501, .blocks = gb, .ntok = 6},
                       {.req = 502, .blocks = gb2, .ntok = 8}};
    CHECK_EQ(check_pool(&g, ex2, 2, 0xa5), 0);

    /* cancelled while it waits; the key is free again */
    CHECK_KVX(kvx_fetch_by_key(g.c, "d-3", 3, "fk-ctx", c.addr, "room-3", 6,
                               g.pool, gb, 2, 0, 0, T_MS),
              g.c);
    CHECK_KVX(kvx_cancel_key(g.c, "d-3", 3, T_MS), g.c);
    ge = wait_key(g.c, "d-3", 3, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_CANCELLED);
    CHECK_EQ(ge.code, KVX_ERR_CANCELLED);

    /* never published: TIMED_OUT by the fetch timeout, naming the key */
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch_by_key(g.c, "d-4", 3, "fk-ctx", c.addr, "room-404", 8,
                               g.pool, gb, 2, 0, 0, T_MS),
              g.c);
    ge = wait_key(g.c, "d-4", 3, 5000);
    CHECK_EQ(ge.kind, KVX_EVENT_TIMED_OUT);
    CHECK_EQ(ge.code, KVX_ERR_TIMED_OUT);
    CHECK_STR_CONTAINS(ge.msg, "room-404");
    CHECK(now_ms() - t0 >= 700);

    /* taken by a fetch with params: EXISTS */
    CHECK_KVX(
        kvx_publish_key(c.c, "room-5", 6, c.pool, cb, 2, 8, NULL, 0, &p, T_MS),
        c.c);
    CHECK_KVX(kvx_fetch_key(g.c, "d-5a", 4, p.data, p.len, g.pool, gb2, 2, 0, 0,
                            T_MS),
              g.c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_fetch_by_key(g.c, "d-5b", 4, "fk-ctx", c.addr, "room-5", 6,
                               g.pool, gb, 2, 0, 0, T_MS),
              g.c);
    ge = wait_key(g.c, "d-5b", 4, 3000);
    /* EXISTS while d-5a runs; once it completed (a slow, sanitized
     * build) the key is consumed: not found again, TIMED_OUT */
    CHECK((ge.kind == KVX_EVENT_ERROR && ge.code == KVX_ERR_EXISTS) ||
          (ge.kind == KVX_EVENT_TIMED_OUT && ge.code == KVX_ERR_TIMED_OUT));

    /* refused at once */
    CHECK_FAILS(kvx_fetch_by_key(g.c, "d-6", 3, "", c.addr, "room-6", 6, g.pool,
                                 gb, 2, 0, 0, T_MS),
                g.c, KVX_ERR_INVALID, "fetch_by_key.context_instance");
    CHECK_FAILS(kvx_fetch_by_key(g.c, "d-6", 3, "fk-ctx", c.addr, "", 0, g.pool,
                                 gb, 2, 0, 0, T_MS),
                g.c, KVX_ERR_INVALID, "context: key of 0 bytes");
    CHECK_FAILS(kvx_fetch_by_key(g.c, "d-6", 3, "fk-ctx", c.addr, "room-6", 6,
                                 g.pool, gb, 2, 0, 3, T_MS),
                g.c, KVX_ERR_INVALID, "fetch_by_key.dp_rank");
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A context instance that names its consumers at join: another
 * generation instance fetching by key ends PERM, nothing written; the
 * named one gets the bytes. A reservation is found by key too. */
TEST(fetch_by_key_consumers)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g, g2;
    side_t cs, gs, gs2;
    cs = (side_t){.inst = "fc-ctx",
                  .role = KVX_ROLE_CONTEXT,
                  .tp = 1,
                  .pp = 1,
                  .preset = "vllm-nhd",
                  .tpb = 4};
    gs = cs;
    gs.inst = "fc-gen";
    gs.role = KVX_ROLE_GENERATION;
    gs2 = gs;
    gs2.inst = "fc-other";
    rank_hello_only(d, &M_SMALL, &cs, 0, &c);
    const char *addrs[1] = {c.addr};
    const char *cons[1] = {"fc-gen"};
    CHECK_KVX(kvx_join_consumers(c.c, addrs, 1, cons, 1, T_MS), c.c);
    rank_pool(&c, 8);
    rank_open(d, &M_SMALL, &gs, 0, 8, &g);
    rank_open(d, &M_SMALL, &gs2, 0, 8, &g2);
    memset(g.base, 0xa5, g.size);
    memset(g2.base, 0xa5, g2.size);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_context_params_t p;
    CHECK_KVX(kvx_reserve(sched, "fc-ctx", "r1", 2, 5, &p, T_MS), sched);
    kvx_context_params_free(&p);
    uint32_t cb[2] = {0, 1}, gb[2] = {3, 2};
    CHECK_KVX(kvx_fetch_by_key(g2.c, "o-1", 3, "fc-ctx", c.addr, "r1", 2,
                               g2.pool, gb, 2, 0, 0, T_MS),
              g2.c);
    ev_t ge = wait_key(g2.c, "o-1", 3, 3000);
    CHECK_EQ(ge.kind, KVX_EVENT_ERROR);
    CHECK_EQ(ge.code, KVX_ERR_PERM);
    CHECK_STR_CONTAINS(ge.msg, "does not let instance fc-other");
    CHECK_KVX(kvx_fetch_by_key(g.c, "g-1", 3, "fc-ctx", c.addr, "r1", 2, g.pool,
                               gb, 2, 0, 0, T_MS),
              g.c);
    fill_req(&c, 71, cb, 5);
    CHECK_KVX(
        kvx_publish_key(c.c, "r1", 2, c.pool, cb, 2, 5, NULL, 0, &p, T_MS),
        c.c);
    kvx_context_params_free(&p);
    CHECK_EQ(wait_key(g.c, "g-1", 3, 3000).kind, KVX_EVENT_COMPLETE);
    expect_t ex = {.req = 71, .blocks = gb, .ntok = 5};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0);
    CHECK_EQ(check_pool(&g2, NULL, 0, 0xa5), 0); /* nothing written */
    kvx_close(sched);
    rank_close(&c);
    rank_close(&g);
    rank_close(&g2);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A pool may say which of the model's KV heads it holds: a TP rank whose
 * pool says another first head than the rule gives it is refused at
 * publish (LAYOUT, naming both), so a pool laid out under another
 * convention never moves the wrong heads; the right one, or none said,
 * is accepted. With tp 8 over 4 heads (replicated), rank 5 holds head 2. */
TEST(pool_says_its_heads)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs = {.inst = "fh-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c0, c1;
    rank_hello_only(d, &M_SMALL, &cs, 0, &c0);
    rank_hello_only(d, &M_SMALL, &cs, 1, &c1);
    rank_join(&c0);
    rank_join(&c1);
    rank_layout(&c0, 8, &c0.lay);
    rank_layout(&c1, 8, &c1.lay);
    c0.lay.first_head = 1;     /* heads [0, 2): right */
    c1.lay.first_head = 0 + 1; /* says [0, 2), but rank 1 holds [2, 4) */
    c0.size = c1.size = kvx_layout_span(&c0.lay);
    void *b0, *b1;
    CHECK_KVX(kvx_pool_create_host(c0.c, &c0.lay, c0.size, &b0, &c0.pool, T_MS),
              c0.c);
    CHECK_KVX(kvx_pool_create_host(c1.c, &c1.lay, c1.size, &b1, &c1.pool, T_MS),
              c1.c);
    uint32_t cb[1] = {0};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c0.c, 5, c0.pool, cb, 1, 4, &p, T_MS), c0.c);
    kvx_context_params_free(&p);
    CHECK_FAILS(kvx_publish(c1.c, 5, c1.pool, cb, 1, 4, &p, T_MS), c1.c,
                KVX_ERR_LAYOUT,
                "the pool holds heads from 0, but TP rank 1 of 2 holds "
                "heads [2, 4) of 4");
    /* the right first head, and none said, are accepted */
    c1.lay.first_head = 2 + 1;
    uint32_t p1b;
    CHECK_KVX(kvx_pool_create_host(c1.c, &c1.lay, c1.size, &b1, &p1b, T_MS),
              c1.c);
    CHECK_KVX(kvx_publish(c1.c, 5, p1b, cb, 1, 4, &p, T_MS), c1.c);
    kvx_context_params_free(&p);
    rank_close(&c0);
    rank_close(&c1);

    side_t r8 = cs;
    r8.inst = "fh-rep";
    r8.tp = 8;
    rank_t rr[8];
    for (uint32_t r = 0; r < 8; r++)
        rank_hello_only(d, &M_SMALL, &r8, r, &rr[r]);
    for (uint32_t r = 0; r < 8; r++)
        rank_join(&rr[r]);
    for (uint32_t r = 0; r < 8; r++) {
        rank_layout(&rr[r], 8, &rr[r].lay);
        rr[r].lay.first_head = r / 2 + 1; /* tp 8 over 4 heads */
        rr[r].size = kvx_layout_span(&rr[r].lay);
        CHECK_KVX(kvx_pool_create_host(rr[r].c, &rr[r].lay, rr[r].size, &b0,
                                       &rr[r].pool, T_MS),
                  rr[r].c);
    }
    rr[5].lay.first_head = 0 + 1; /* wrong for rank 5 */
    uint32_t bad;
    CHECK_KVX(
        kvx_pool_create_host(rr[5].c, &rr[5].lay, rr[5].size, &b0, &bad, T_MS),
        rr[5].c);
    CHECK_FAILS(kvx_publish(rr[5].c, 6, bad, cb, 1, 4, &p, T_MS), rr[5].c,
                KVX_ERR_LAYOUT, "TP rank 5 of 8 holds heads [2, 3) of 4");
    for (uint32_t r = 0; r < 8; r++) {
        CHECK_KVX(kvx_publish(rr[r].c, 6, rr[r].pool, cb, 1, 4, &p, T_MS),
                  rr[r].c);
        kvx_context_params_free(&p);
    }
    for (uint32_t r = 0; r < 8; r++)
        rank_close(&rr[r]);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Release by key (no params): a router of the instance's uid releases
 * the offer of a key; the context rank gets COMPLETE "released", the
 * blocks are free; again, or a key never published, is NOT_FOUND; one
 * being fetched is STATE; another instance name is NOT_FOUND. */
TEST(release_by_key_one_daemon)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "rk-ctx", "rk-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[2] = {1, 2};
    kvx_context_params_t p;
    CHECK_KVX(
        kvx_publish_key(c.c, "rk-1", 4, c.pool, cb, 2, 7, NULL, 0, &p, T_MS),
        c.c);
    kvx_context_params_free(&p);
    kvx_client_t *router;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &router), 0);
    CHECK_KVX(kvx_release_by_key(router, "rk-ctx", c.addr, "rk-1", 4, T_MS),
              router);
    ev_t e = wait_key(c.c, "rk-1", 4, 3000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    CHECK_STR_CONTAINS(e.msg, "released");
    CHECK_FAILS(kvx_release_by_key(router, "rk-ctx", c.addr, "rk-1", 4, T_MS),
                router, KVX_ERR_NOT_FOUND, "rk-1");
    CHECK_FAILS(kvx_release_by_key(router, "rk-nope", c.addr, "rk-1", 4, T_MS),
                router, KVX_ERR_NOT_FOUND, "no instance 'rk-nope'");
    CHECK_FAILS(kvx_release_by_key(router, "", c.addr, "rk-1", 4, T_MS), router,
                KVX_ERR_INVALID, "context_instance");
    /* being fetched: STATE, and the transfer completes */
    fill_req(&c, 12, cb, 7);
    CHECK_KVX(
        kvx_publish_key(c.c, "rk-2", 4, c.pool, cb, 2, 7, NULL, 0, &p, T_MS),
        c.c);
    uint32_t gb[2] = {5, 6};
    CHECK_KVX(
        kvx_fetch_key(g.c, "g-2", 3, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    int rc = kvx_release_by_key(router, "rk-ctx", c.addr, "rk-2", 4, T_MS);
    CHECK(rc == KVX_ERR_STATE || rc == KVX_ERR_NOT_FOUND); /* or done */
    CHECK_EQ(wait_key(g.c, "g-2", 3, 3000).kind, KVX_EVENT_COMPLETE);
    kvx_context_params_free(&p);
    kvx_close(router);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Protocol 2.0 named requests by keys: a 1.x client is refused at Hello,
 * naming both versions, and its connection still answers status. */
TEST(protocol_1_clients_are_refused)
{
    daemon_t *d = daemon_start(NULL);
    kvx_client_t *c;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &c), 0);
    kvx_hello_t h = {.instance_id = "v1",
                     .role = KVX_ROLE_CONTEXT,
                     .parallel = {.tp = 1,
                                  .pp = 1,
                                  .cp = 1,
                                  .total_layers = 4,
                                  .total_kv_heads = 4},
                     .version_major = 1,
                     .version_minor = 1};
    char want[64];
    snprintf(want, sizeof(want),
             "client speaks protocol 1.1, daemon speaks %d.%d",
             KVX_PROTOCOL_MAJOR, KVX_PROTOCOL_MINOR);
    CHECK_FAILS(kvx_hello(c, &h, T_MS), c, KVX_ERR_VERSION, want);
    char *json;
    CHECK_KVX(kvx_status_json(c, &json, T_MS), c);
    free(json);
    kvx_close(c);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* ---- regressions found by review: one event each, deadlines ---------- */

/* The two ranks of generation instance gs (tp 2) on d, joined, a pool of
 * 8 blocks each. */
static void gen2_open(daemon_t *d, const side_t *gs, rank_t *g0, rank_t *g1)
{
    rank_hello_only(d, &M_SMALL, gs, 0, g0);
    rank_hello_only(d, &M_SMALL, gs, 1, g1);
    rank_join(g0);
    rank_join(g1);
    rank_pool(g0, 8);
    rank_pool(g1, 8);
}

static int count_key(kvx_client_t *c, const char *key, int ms, ev_t *last)
{
    ev_t e[32];
    int n = collect(c, e, 32, 32, ms), k = 0;
    for (int i = 0; i < n && i < 32; i++)
        if (e[i].key_len == strlen(key) &&
            !memcmp(e[i].key, key, strlen(key))) {
            k++;
            fprintf(stderr, "  event %s: kind %s code %d \"%s\"\n", key,
                    kind_name(e[i].kind), e[i].code, e[i].msg);
            if (last)
                *last = e[i];
        }
    return k;
}

/* Generation tp 2: both ranks fetch by key, the context instance refuses
 * (PERM): each rank gets that one event, not one per rank's fetch. */
TEST(fetch_by_key_refused_once_per_rank)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs = {.inst = "rv-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    side_t gs = {.inst = "rv-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c, g0, g1;
    rank_hello_only(d, &M_SMALL, &cs, 0, &c);
    const char *addrs[1] = {c.addr};
    const char *cons[1] = {"someone-else"};
    CHECK_KVX(kvx_join_consumers(c.c, addrs, 1, cons, 1, T_MS), c.c);
    rank_pool(&c, 8);
    gen2_open(d, &gs, &g0, &g1);
    uint32_t gb[2] = {3, 2};
    CHECK_KVX(kvx_fetch_by_key(g0.c, "k1", 2, "rv-ctx", c.addr, "room", 4,
                               g0.pool, gb, 2, 0, 0, T_MS),
              g0.c);
    CHECK_KVX(kvx_fetch_by_key(g1.c, "k1", 2, "rv-ctx", c.addr, "room", 4,
                               g1.pool, gb, 2, 0, 0, T_MS),
              g1.c);
    int n0 = count_key(g0.c, "k1", 1500, NULL);
    int n1 = count_key(g1.c, "k1", 1500, NULL);
    fprintf(stderr, "PERM tp2: rank0 saw %d events, rank1 saw %d\n", n0, n1);
    CHECK_EQ(n0, 1);
    CHECK_EQ(n1, 1);
    rank_close(&c);
    rank_close(&g0);
    rank_close(&g1);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Generation tp 2 waiting by key; a reservation resolves; rank 1 gave
 * too few blocks: its refusal ends the request, one event for each. */
TEST(fetch_by_key_rank_refused_after_resolve)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs = {.inst = "rw-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    side_t gs = {.inst = "rw-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c, g0, g1;
    rank_open(d, &M_SMALL, &cs, 0, 8, &c);
    gen2_open(d, &gs, &g0, &g1);
    uint32_t gb[2] = {3, 2};
    CHECK_KVX(kvx_fetch_by_key(g0.c, "k2", 2, "rw-ctx", c.addr, "room2", 5,
                               g0.pool, gb, 2, 0, 0, T_MS),
              g0.c);
    CHECK_KVX(kvx_fetch_by_key(g1.c, "k2", 2, "rw-ctx", c.addr, "room2", 5,
                               g1.pool, gb, 1, 0, 0, T_MS),
              g1.c);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_context_params_t p;
    CHECK_KVX(kvx_reserve(sched, "rw-ctx", "room2", 5, 8, &p, T_MS), sched);
    kvx_context_params_free(&p);
    int n0 = count_key(g0.c, "k2", 1500, NULL);
    int n1 = count_key(g1.c, "k2", 1500, NULL);
    fprintf(stderr, "refused rank tp2: rank0 saw %d events, rank1 saw %d\n", n0,
            n1);
    CHECK_EQ(n0, 1);
    CHECK_EQ(n1, 1);
    kvx_close(sched);
    rank_close(&c);
    rank_close(&g0);
    rank_close(&g1);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A fetch by key that resolves late (a reservation at 900 ms of a 1000
 * ms fetch timeout, never published) ends by the timeout counted from
 * its call, not again from the resolve. */
TEST(fetch_by_key_deadline_from_the_first_call)
{
    daemon_t *d = daemon_start("deadlines:\n  fetch_timeout_ms: 1000\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "rt-ctx", "rt-gen", 8, &c, &g, &cs, &gs);
    uint32_t gb[2] = {7, 0};
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch_by_key(g.c, "t-1", 3, "rt-ctx", c.addr, "room-t", 6,
                               g.pool, gb, 2, 0, 0, T_MS),
              g.c);
    sleep_ms(900);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &sched), 0);
    kvx_context_params_t p;
    CHECK_KVX(kvx_reserve(sched, "rt-ctx", "room-t", 6, 8, &p, T_MS), sched);
    kvx_context_params_free(&p);
    ev_t e;
    int n = collect(g.c, &e, 1, 1, 5000);
    int64_t el = now_ms() - t0;
    fprintf(stderr, "  event: %s \"%s\"\n", kind_name(e.kind), e.msg);
    fprintf(
        stderr,
        "timeout twice: %d events, last after %lld ms (fetch_timeout 1000)\n",
        n, (long long)el);
    CHECK_EQ(n, 1);
    CHECK_EQ(e.kind, KVX_EVENT_TIMED_OUT);
    CHECK(el < 1600);
    kvx_close(sched);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Generation tp 2: rank 0 fetches with params of a released offer
 * (ERROR, rank 1 never fetched: the end is kept for rank 1); then both
 * fetch the same key from a new offer: a new request, which completes,
 * not rank 1's late join of the old end. */
TEST(fetch_ended_early_then_the_key_again)
{
    daemon_t *d = daemon_start("deadlines:\n  fetch_timeout_ms: 5000\n");
    side_t cs = {.inst = "rg-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    side_t gs = {.inst = "rg-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c, g0, g1;
    rank_open(d, &M_SMALL, &cs, 0, 8, &c);
    gen2_open(d, &gs, &g0, &g1);
    uint32_t cb[2] = {1, 5}, gb[2] = {3, 2};
    kvx_context_params_t p1, p2;
    CHECK_KVX(
        kvx_publish_key(c.c, "c1", 2, c.pool, cb, 2, 8, NULL, 0, &p1, T_MS),
        c.c);
    CHECK_KVX(kvx_release(c.c, p1.data, p1.len, T_MS), c.c);
    CHECK_KVX(kvx_fetch_key(g0.c, "g1", 2, p1.data, p1.len, g0.pool, gb, 2, 0,
                            0, T_MS),
              g0.c);
    int n0 = count_key(g0.c, "g1", 800, NULL);
    int n1 = count_key(g1.c, "g1", 800, NULL);
    fprintf(stderr, "first try: rank0 %d rank1 %d events\n", n0, n1);
    fill_req(&c, 77, cb, 8);
    CHECK_KVX(
        kvx_publish_key(c.c, "c2", 2, c.pool, cb, 2, 8, NULL, 0, &p2, T_MS),
        c.c);
    int rc0 = kvx_fetch_key(g0.c, "g1", 2, p2.data, p2.len, g0.pool, gb, 2, 0,
                            0, T_MS);
    fprintf(stderr, "retry rank0: %s %s\n", kvx_status_name(rc0),
            rc0 ? kvx_last_error(g0.c) : "");
    int rc1 = kvx_fetch_key(g1.c, "g1", 2, p2.data, p2.len, g1.pool, gb, 2, 0,
                            0, T_MS);
    fprintf(stderr, "retry rank1: %s\n", kvx_status_name(rc1));
    n0 = count_key(g0.c, "g1", 1500, NULL);
    n1 = count_key(g1.c, "g1", 1500, NULL);
    fprintf(stderr, "retry: rank0 %d rank1 %d events\n", n0, n1);
    CHECK_EQ(rc0, 0);
    CHECK_EQ(rc1, 0);
    CHECK_EQ(n0, 1);
    CHECK_EQ(n1, 1);
    kvx_context_params_free(&p1);
    kvx_context_params_free(&p2);
    rank_close(&c);
    rank_close(&g0);
    rank_close(&g1);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A fetch by key of an offer its context side cancelled hears CANCELLED
 * at once, as a fetch with the params does, not a wait until TIMED_OUT. */
TEST(fetch_by_key_of_a_cancelled_offer)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "fx-ctx", "fx-gen", 8, &c, &g, &cs, &gs);
    uint32_t cb[1] = {0}, gb[1] = {1};
    kvx_context_params_t p;
    CHECK_KVX(
        kvx_publish_key(c.c, "room-c", 6, c.pool, cb, 1, 4, NULL, 0, &p, T_MS),
        c.c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_cancel_key(c.c, "room-c", 6, T_MS), c.c);
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch_by_key(g.c, "g-c", 3, "fx-ctx", c.addr, "room-c", 6,
                               g.pool, gb, 1, 0, 0, T_MS),
              g.c);
    ev_t e = wait_key(g.c, "g-c", 3, 3000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    CHECK_EQ(e.code, KVX_ERR_CANCELLED);
    CHECK_STR_CONTAINS(e.msg, "cancelled by the context side");
    CHECK(now_ms() - t0 < 1000);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* kvx_publish_many and kvx_fetch_many: three requests published and
 * fetched in one round trip each, every byte checked; an item the
 * daemon refuses fails alone, named in the error, the others taken;
 * an invalid item sends nothing. */
TEST(many_in_one_round_trip)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "mn-ctx", "mn-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[3][2] = {{0, 1}, {2, 3}, {4, 5}};
    uint32_t gb[3][2] = {{7, 6}, {5, 4}, {3, 2}};
    char ck[3][16], gk[3][16];
    kvx_publish_item_t pi[3];
    kvx_fetch_item_t fi[3];
    memset(pi, 0, sizeof(pi));
    memset(fi, 0, sizeof(fi));
    for (int i = 0; i < 3; i++) {
        fill_req(&c, 9101 + i, cb[i], 7);
        snprintf(ck[i], sizeof(ck[i]), "m-%d", i);
        snprintf(gk[i], sizeof(gk[i]), "g-%d", i);
        pi[i] = (kvx_publish_item_t){.key = ck[i],
                                     .key_len = strlen(ck[i]),
                                     .pool_id = c.pool,
                                     .blocks = cb[i],
                                     .num_blocks = 2,
                                     .num_tokens = 7};
    }
    CHECK_KVX(kvx_publish_many(c.c, pi, 3, T_MS), c.c);
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(pi[i].status, 0);
        CHECK(pi[i].params.len > 0);
        kvx_params_info_t info;
        CHECK_EQ(kvx_params_info(pi[i].params.data, pi[i].params.len, &info),
                 KVX_OK);
        CHECK_EQ(info.key_len, strlen(ck[i])); /* each its own params */
        CHECK(!memcmp(info.key, ck[i], info.key_len));
        fi[i] = (kvx_fetch_item_t){.key = gk[i],
                                   .key_len = strlen(gk[i]),
                                   .params = pi[i].params.data,
                                   .params_len = pi[i].params.len,
                                   .pool_id = g.pool,
                                   .blocks = gb[i],
                                   .num_blocks = 2};
    }
    CHECK_KVX(kvx_fetch_many(g.c, fi, 3, T_MS), g.c);
    ev_t ev[8];
    int n = collect(g.c, ev, 8, 3, 3000);
    CHECK_EQ(n, 3);
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(fi[i].status, 0);
        int found = 0;
        for (int k = 0; k < n; k++)
            found |= ev[k].key_len == strlen(gk[i]) &&
                     !memcmp(ev[k].key, gk[i], ev[k].key_len) &&
                     ev[k].kind == KVX_EVENT_COMPLETE;
        CHECK(found);
    }
    expect_t ex[3] = {{.req = 9101, .blocks = gb[0], .ntok = 7},
                      {.req = 9102, .blocks = gb[1], .ntok = 7},
                      {.req = 9103, .blocks = gb[2], .ntok = 7}};
    CHECK_EQ(check_pool(&g, ex, 3, 0xa5), 0);
    for (int i = 0; i < 3; i++)
        kvx_context_params_free(&pi[i].params);

    /* the second of two names no pool: it alone fails, named */
    uint32_t b67[2] = {6, 7};
    kvx_publish_item_t two[2] = {{.key = "m-3",
                                  .key_len = 3,
                                  .pool_id = c.pool,
                                  .blocks = b67,
                                  .num_blocks = 2,
                                  .num_tokens = 7},
                                 {.key = "m-bad",
                                  .key_len = 5,
                                  .pool_id = 999,
                                  .blocks = b67,
                                  .num_blocks = 2,
                                  .num_tokens = 7}};
    int rc = kvx_publish_many(c.c, two, 2, T_MS);
    CHECK(rc != 0);
    CHECK_EQ(two[0].status, 0);
    CHECK_EQ(two[1].status, rc);
    CHECK(two[0].params.len > 0 && two[1].params.data == NULL);
    CHECK_STR_CONTAINS(kvx_last_error(c.c),
                       "kvx_publish_many: item 1 (key m-bad)");
    kvx_context_params_free(&two[0].params);
    CHECK_KVX(kvx_cancel_key(c.c, "m-3", 3, T_MS), c.c);

    /* invalid items: nothing is sent, the connection stays usable */
    fi[1].key = NULL;
    CHECK_FAILS(kvx_fetch_many(g.c, fi, 3, T_MS), g.c, KVX_ERR_INVALID,
                "kvx_fetch_many: item 1: key of 0 bytes (NULL)");
    CHECK_FAILS(kvx_fetch_many(g.c, fi, KVX_MANY_MAX + 1, T_MS), g.c,
                KVX_ERR_INVALID, "257 items (at most 256)");
    char *json;
    CHECK_KVX(kvx_status_json(g.c, &json, T_MS), g.c);
    free(json);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}
