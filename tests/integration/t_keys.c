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
        kvx_publish_key(c.c, "a", 1, c.pool, cb, 2, 8, "x", 1, &p, T_MS), c.c,
        KVX_ERR_UNSUPPORTED, "aux");
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
