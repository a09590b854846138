/*
 * t_attack.c — attacks on the access rules of issue 34 that still get
 * through: each test here fails on the code it was written against and
 * shows what a hostile local user or peer reaches. Reuses t_access.c's
 * two uids (AX_UID_A, AX_UID_B) and helpers.
 */

/* Spread instance s (tp 2) of uid: rank 0 on daemon a, rank 1 on b,
 * joined, pools of 8 blocks filled with the sentinel. */
static void at_spread_as(daemon_t *a, daemon_t *b, uid_t uid, const side_t *s,
                         rank_t r[2])
{
    as_uid(uid);
    rank_hello_only(a, &M_SMALL, s, 0, &r[0]);
    rank_hello_only(b, &M_SMALL, s, 1, &r[1]);
    as_uid(0);
    const char *addrs[2] = {r[0].addr, r[1].addr};
    for (int i = 0; i < 2; i++) {
        CHECK_KVX(kvx_join(r[i].c, addrs, 2, T_MS), r[i].c);
        rank_pool(&r[i], 8);
        memset(r[i].base, 0xa5, r[i].size);
    }
}

/* Rank c publishes key with request req's pattern on blocks 0, 1
 * (7 tokens). */
static void at_publish(rank_t *c, const char *key, uint64_t req,
                       kvx_context_params_t *p)
{
    static const uint32_t cb[2] = {0, 1};
    fill_req(c, req, cb, 7);
    CHECK_KVX(kvx_publish_key(c->c, key, strlen(key), c->pool, cb, 2, 7, NULL,
                              0, p, T_MS),
              c->c);
}

/* Say Hello as instance s on d as uid, retrying while the name is still
 * held (an instance is gone only once its requests ended). */
static void at_hello_retry(daemon_t *d, uid_t uid, const side_t *s,
                           uint32_t rank, rank_t *r)
{
    for (int i = 0; i < 100; i++) {
        memset(r, 0, sizeof(*r));
        r->m = &M_SMALL;
        r->s = s;
        r->rank = rank;
        rank_share(r);
        kvx_hello_t h = rank_hello(r);
        as_uid(uid);
        int rc = kvx_connect(d->sock, &h, T_MS, &r->c);
        as_uid(0);
        if (!rc) {
            CHECK_KVX(kvx_daemon_address(r->c, r->addr, sizeof(r->addr)), r->c);
            return;
        }
        usleep(100 * 1000);
    }
    CHECK(!"hello accepted once the name is free");
}

/* Attack: the capability token of a spread instance's offer is
 * HMAC(secret, instance name, rank 0's address, key id) (peer_token()),
 * the same for whoever holds the name. Uid B holds the name "tv-ctx"
 * for a while (names are first come, first served, and free again once
 * an instance is gone), spread over daemons A and B, publishes the keys
 * it expects uid A to use, keeps the params and leaves. Uid A then runs
 * its instance "tv-ctx" (same name, rank 0 on daemon A again) and
 * publishes one of those keys: uid B's old params carry the very token
 * of uid A's offer, and a fetch with them takes uid A's KV. A request's
 * KV must be reachable only with params its owner handed out. */
TEST_T(attack_spread_token_replayed_across_uids, 90)
{
    need_root("attack_spread_token_replayed_across_uids");
    p_setup();
    p_socket_extra = "  mode: 0666\n";
    daemon_t *a = p_daemon(0, P_SECRET, NULL, AX_AUTH);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, AX_AUTH);
    p_socket_extra = NULL;
    side_t cs, gs;
    p_side2(&cs, "tv-ctx", KVX_ROLE_CONTEXT);
    p_side2(&gs, "tv-bgen", KVX_ROLE_GENERATION);

    /* uid B takes the name first and mints params for key "room-1" */
    rank_t bc[2];
    at_spread_as(a, b, AX_UID_B, &cs, bc);
    kvx_context_params_t stolen, bp1;
    at_publish(&bc[0], "room-1", 7, &stolen);
    at_publish(&bc[1], "room-1", 7, &bp1);
    kvx_context_params_free(&bp1);
    for (int i = 0; i < 2; i++)
        rank_close(&bc[i]);

    /* later, uid A runs its own "tv-ctx" and publishes "room-1" */
    rank_t c[2];
    at_hello_retry(a, AX_UID_A, &cs, 0, &c[0]);
    at_hello_retry(b, AX_UID_A, &cs, 1, &c[1]);
    const char *addrs[2] = {c[0].addr, c[1].addr};
    for (int i = 0; i < 2; i++) {
        CHECK_KVX(kvx_join(c[i].c, addrs, 2, T_MS), c[i].c);
        rank_pool(&c[i], 8);
    }
    kvx_context_params_t p[2];
    at_publish(&c[0], "room-1", 42, &p[0]);
    at_publish(&c[1], "room-1", 42, &p[1]);
    fprintf(stderr, "uid B's old params %s uid A's (%zu vs %zu bytes)\n",
            stolen.len == p[0].len && !memcmp(stolen.data, p[0].data, p[0].len)
                ? "EQUAL"
                : "differ from",
            stolen.len, p[0].len);

    /* uid B's generation instance fetches with its old params */
    rank_t g[2];
    at_spread_as(a, b, AX_UID_B, &gs, g);
    static const uint32_t gb[2] = {3, 2};
    int moved = 0;
    for (int i = 0; i < 2; i++) {
        int rc = kvx_fetch_key(g[i].c, "loot", 4, stolen.data, stolen.len,
                               g[i].pool, gb, 2, 0, 0, T_MS);
        fprintf(stderr, "uid B rank %d fetch with its old params: %s\n", i,
                kvx_status_name(rc));
    }
    for (int i = 0; i < 2; i++) {
        ev_t e = wait_key(g[i].c, "loot", 4, 8000);
        fprintf(stderr, "uid B rank %d: %s %s: %s\n", i, kind_name(e.kind),
                kvx_status_name(e.code), e.msg);
        if (e.kind == KVX_EVENT_COMPLETE && !p_check_req(&g[i], 42, gb, 7, 0))
            moved++;
    }
    fprintf(stderr, "uid A's KV landed in %d of uid B's ranks\n", moved);
    CHECK_EQ(moved, 0);
    for (int i = 0; i < 2; i++)
        CHECK_EQ(check_pool(&g[i], NULL, 0, 0xa5), 0);

    kvx_context_params_free(&stolen);
    for (int i = 0; i < 2; i++) {
        kvx_context_params_free(&p[i]);
        rank_close(&g[i]);
        rank_close(&c[i]);
    }
    p_stop_both(a, b);
}
