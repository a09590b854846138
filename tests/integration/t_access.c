/*
 * t_access.c — who may reach a request's KV: docs/protocol.md's access
 * table, cell by cell, and the attacks that once got around it (an alias
 * of the daemon's own address, a squatted consumer name).
 *
 * Two uids without forking: the daemon takes a client's uid from
 * SO_PEERCRED, which is the effective uid at connect(), so this (root)
 * process connects as uid A or B with as_uid() and is root again after.
 */

#define AX_UID_A 64021
#define AX_UID_B 64022
#define AX_AUTH "auth:\n  allowed_uids: [64021, 64022]\n"

/* rank_open() of 8 blocks as uid */
static void ax_rank(daemon_t *d, uid_t uid, const side_t *s, rank_t *r)
{
    rank_open_as(d, uid, &M_SMALL, s, 8, r);
}

static side_t ax_side(const char *inst, kvx_role_t role)
{
    return (side_t){.inst = inst,
                    .role = role,
                    .tp = 1,
                    .pp = 1,
                    .preset = "vllm-nhd",
                    .tpb = 4};
}

/* c publishes key (request req's pattern on blocks 0, 1; 5 tokens) */
static void ax_publish(rank_t *c, const char *key, uint64_t req,
                       kvx_context_params_t *p)
{
    static const uint32_t cb[2] = {0, 1};
    fill_req(c, req, cb, 5);
    CHECK_KVX(kvx_publish_key(c->c, key, strlen(key), c->pool, cb, 2, 5, NULL,
                              0, p, T_MS),
              c->c);
}

static const uint32_t AX_GB[2] = {3, 2};

/* g's pool holds request req on AX_GB and the sentinel elsewhere */
static void ax_landed(const rank_t *g, uint64_t req)
{
    expect_t ex = {.req = req, .blocks = AX_GB, .ntok = 5};
    CHECK_EQ(check_pool(g, &ex, 1, 0xa5), 0);
}

static void ax_untouched(const rank_t *g)
{
    CHECK_EQ(check_pool(g, NULL, 0, 0xa5), 0);
}

static int ax_fetch_key(rank_t *g, const char *key, const char *ctx,
                        const char *addr, const char *ckey)
{
    return kvx_fetch_by_key(g->c, key, strlen(key), ctx, addr, ckey,
                            strlen(ckey), g->pool, AX_GB, 2, 0, 0, T_MS);
}

static int ax_release_key(kvx_client_t *c, const char *ctx, const char *addr,
                          const char *ckey)
{
    return kvx_release_by_key(c, ctx, addr, ckey, strlen(ckey), T_MS);
}

/* The offer of key on c's instance still stands: uid A's generation
 * rank g fetches it by key and gets the bytes. */
static void ax_still_offered(rank_t *c, rank_t *g, const char *key,
                             uint64_t req)
{
    char gk[64];
    snprintf(gk, sizeof(gk), "after-%s", key);
    memset(g->base, 0xa5, g->size);
    CHECK_KVX(ax_fetch_key(g, gk, c->s->inst, c->addr, key), g->c);
    CHECK_EQ(wait_key(g->c, gk, strlen(gk), 5000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c->c, key, strlen(key), 5000).kind, KVX_EVENT_COMPLETE);
    ax_landed(g, req);
}

/* One daemon, uid A's context instance ax-ctx: each call from a rank of
 * uid A, from a rank and a router of uid B, and from a router (no Hello)
 * of uid A. What is allowed works; what is refused is refused with the
 * code the table gives and moves no byte. */
TEST_T(access_rules_one_daemon, 60)
{
    need_root("access_rules_one_daemon");
    daemon_t *d = daemon_start2("  mode: 0666\n", AX_AUTH);
    side_t cs = ax_side("ax-ctx", KVX_ROLE_CONTEXT),
           gs = ax_side("ax-gen", KVX_ROLE_GENERATION),
           bs = ax_side("ax-bgen", KVX_ROLE_GENERATION);
    rank_t c, g, bg;
    ax_rank(d, AX_UID_A, &cs, &c);
    ax_rank(d, AX_UID_A, &gs, &g);
    ax_rank(d, AX_UID_B, &bs, &bg);
    kvx_client_t *ra = router_as(d, AX_UID_A), *rb = router_as(d, AX_UID_B);
    kvx_context_params_t p;
    int rc;

    /* fetch with the params: the params are the right, whoever holds
     * them; a process without Hello has no pool to fetch into */
    ax_publish(&c, "f-a", 1, &p);
    CHECK_KVX(kvx_fetch_key(g.c, "f-a", 3, p.data, p.len, g.pool, AX_GB, 2, 0,
                            0, T_MS),
              g.c);
    CHECK_EQ(wait_key(g.c, "f-a", 3, 5000).kind, KVX_EVENT_COMPLETE);
    ax_landed(&g, 1);
    kvx_context_params_free(&p);
    ax_publish(&c, "f-b", 2, &p);
    CHECK_KVX(kvx_fetch_key(bg.c, "f-b", 3, p.data, p.len, bg.pool, AX_GB, 2, 0,
                            0, T_MS),
              bg.c);
    CHECK_EQ(wait_key(bg.c, "f-b", 3, 5000).kind, KVX_EVENT_COMPLETE);
    ax_landed(&bg, 2);
    rc = kvx_fetch_key(ra, "f-r", 3, p.data, p.len, 1, AX_GB, 2, 0, 0, T_MS);
    CHECK_EQ(rc, KVX_ERR_STATE);
    CHECK_STR_CONTAINS(kvx_last_error(ra), "say hello first");
    kvx_context_params_free(&p);
    memset(g.base, 0xa5, g.size);
    memset(bg.base, 0xa5, bg.size);

    /* fetch by key: by default the owner's uid only */
    ax_publish(&c, "k-a", 3, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_fetch_key(&g, "k-a", "ax-ctx", c.addr, "k-a"), g.c);
    CHECK_EQ(wait_key(g.c, "k-a", 3, 5000).kind, KVX_EVENT_COMPLETE);
    ax_landed(&g, 3);
    ax_publish(&c, "k-b", 4, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_fetch_key(&bg, "k-b", "ax-ctx", c.addr, "k-b"), bg.c);
    ev_t e = wait_key(bg.c, "k-b", 3, 5000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    CHECK_EQ(e.code, KVX_ERR_PERM);
    CHECK_STR_CONTAINS(e.msg, "instance ax-bgen of uid 64022");
    ax_untouched(&bg);
    rc = kvx_fetch_by_key(ra, "k-r", 3, "ax-ctx", c.addr, "k-b", 3, 1, AX_GB, 2,
                          0, 0, T_MS);
    CHECK_EQ(rc, KVX_ERR_STATE);
    ax_still_offered(&c, &g, "k-b", 4);

    /* release with the params: whoever holds them, Hello or not */
    const char *rel[3] = {"r-a", "r-b", "r-r"};
    kvx_client_t *relc[3] = {g.c, rb, ra};
    for (int i = 0; i < 3; i++) {
        ax_publish(&c, rel[i], 5, &p);
        CHECK_KVX(kvx_release(relc[i], p.data, p.len, T_MS), relc[i]);
        e = wait_key(c.c, rel[i], 3, 5000);
        CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
        CHECK_STR_CONTAINS(e.msg, "released");
        kvx_context_params_free(&p);
    }

    /* release by key: the owner's uid (rank or router); never uid B */
    ax_publish(&c, "rk-a", 6, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_release_key(ra, "ax-ctx", c.addr, "rk-a"), ra);
    CHECK_EQ(wait_key(c.c, "rk-a", 4, 5000).kind, KVX_EVENT_COMPLETE);
    ax_publish(&c, "rk-g", 6, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_release_key(g.c, "ax-ctx", c.addr, "rk-g"), g.c);
    CHECK_EQ(wait_key(c.c, "rk-g", 4, 5000).kind, KVX_EVENT_COMPLETE);
    ax_publish(&c, "rk-b", 7, &p);
    kvx_context_params_free(&p);
    CHECK_EQ(ax_release_key(rb, "ax-ctx", c.addr, "rk-b"), KVX_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(kvx_last_error(rb), "no instance 'ax-ctx' of uid 64022");
    CHECK_EQ(ax_release_key(bg.c, "ax-ctx", c.addr, "rk-b"), KVX_ERR_NOT_FOUND);
    ax_still_offered(&c, &g, "rk-b", 7);

    /* cancel: a rank cancels its own instance's requests only */
    ax_publish(&c, "c-a", 8, &p);
    kvx_context_params_free(&p);
    ax_publish(&c, "c-b", 9, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_cancel_key(c.c, "c-a", 3, T_MS), c.c);
    CHECK_EQ(wait_key(c.c, "c-a", 3, 5000).kind, KVX_EVENT_CANCELLED);
    (void)kvx_cancel_key(bg.c, "c-b", 3, T_MS); /* its own key, not A's */
    CHECK_EQ(kvx_cancel_key(ra, "c-b", 3, T_MS), KVX_ERR_STATE);
    ax_still_offered(&c, &g, "c-b", 9);

    /* reserve: a router of the owner's uid; uid B finds no instance */
    CHECK_KVX(kvx_reserve(ra, "ax-ctx", "v-a", 3, 5, &p, T_MS), ra);
    kvx_context_params_free(&p);
    CHECK_EQ(kvx_reserve(rb, "ax-ctx", "v-b", 3, 5, &p, T_MS),
             KVX_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(kvx_last_error(rb), "no instance 'ax-ctx' of uid 64022");

    /* status and the request list: uid B sees nothing of uid A's */
    char *js = NULL, *rq = NULL;
    CHECK_KVX(kvx_status_json(ra, &js, T_MS), ra);
    CHECK_STR_CONTAINS(js, "ax-ctx");
    free(js);
    CHECK_KVX(kvx_status_json(rb, &js, T_MS), rb);
    CHECK(strstr(js, "ax-ctx") == NULL && strstr(js, "\"uid\":64021") == NULL);
    free(js);
    CHECK_KVX(kvx_requests_json(ra, &rq, T_MS), ra);
    CHECK_STR_CONTAINS(rq, "v-a");
    free(rq);
    CHECK_KVX(kvx_requests_json(rb, &rq, T_MS), rb);
    CHECK(strstr(rq, "v-a") == NULL);
    free(rq);

    kvx_close(ra);
    kvx_close(rb);
    rank_close(&bg);
    rank_close(&g);
    rank_close(&c);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Finding: uid B said Hello as gen-a, the name uid A's context instance
 * let in (kvx_join_consumers), and fetched A's KV by key. A consumers
 * entry names a uid too: "gen-a" is gen-a of the owner's uid, "UID:gen-a"
 * that of uid UID; a name alone never lets another uid in. */
TEST_T(access_consumer_name_squatted, 60)
{
    need_root("access_consumer_name_squatted");
    daemon_t *d = daemon_start2("  mode: 0666\n", AX_AUTH);
    side_t cs = ax_side("sq-ctx", KVX_ROLE_CONTEXT),
           cs2 = ax_side("sq-ctx2", KVX_ROLE_CONTEXT),
           bs = ax_side("gen-a", KVX_ROLE_GENERATION);
    rank_t c, c2, bg;
    ax_rank(d, AX_UID_B, &bs, &bg); /* B takes the name first */
    as_uid(AX_UID_A);
    rank_hello_only(d, &M_SMALL, &cs, 0, &c);
    rank_hello_only(d, &M_SMALL, &cs2, 0, &c2);
    as_uid(0);
    const char *addrs[1] = {c.addr};
    const char *cons[1] = {"gen-a"};
    CHECK_KVX(kvx_join_consumers(c.c, addrs, 1, cons, 1, T_MS), c.c);
    const char *cons2[2] = {"gen-z", "64022:gen-a"};
    CHECK_KVX(kvx_join_consumers(c2.c, addrs, 1, cons2, 2, T_MS), c2.c);
    rank_pool(&c, 8);
    rank_pool(&c2, 8);
    kvx_context_params_t p;
    ax_publish(&c, "room", 11, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_fetch_key(&bg, "steal", "sq-ctx", c.addr, "room"), bg.c);
    ev_t e = wait_key(bg.c, "steal", 5, 5000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    CHECK_EQ(e.code, KVX_ERR_PERM);
    CHECK_STR_CONTAINS(e.msg, "does not let instance gen-a of uid 64022");
    ax_untouched(&bg);
    /* nor may it release it by key */
    CHECK_EQ(ax_release_key(bg.c, "sq-ctx", c.addr, "room"), KVX_ERR_NOT_FOUND);

    /* named with its uid, B's gen-a is let in */
    ax_publish(&c2, "room2", 12, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_fetch_key(&bg, "given", "sq-ctx2", c.addr, "room2"), bg.c);
    CHECK_EQ(wait_key(bg.c, "given", 5, 5000).kind, KVX_EVENT_COMPLETE);
    ax_landed(&bg, 12);

    /* malformed entries are refused, naming the entry */
    side_t cs3 = ax_side("sq-ctx3", KVX_ROLE_CONTEXT);
    rank_t c3;
    rank_hello_only(d, &M_SMALL, &cs3, 0, &c3);
    const char *bad[3] = {"1:", "4294967296:gen-a", "x\ny"};
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(kvx_join_consumers(c3.c, addrs, 1, &bad[i], 1, T_MS),
                 KVX_ERR_INVALID);
        CHECK_STR_CONTAINS(kvx_last_error(c3.c), "is not INSTANCE or "
                                                 "UID:INSTANCE");
    }
    rank_close(&c3);
    rank_close(&c2);
    rank_close(&c);
    rank_close(&bg);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Finding: uid B fetched (and released) uid A's request by key naming
 * the context instance at this daemon's own IP:PORT under another id;
 * the daemon dialled itself, and the resolve came back as a remote one.
 * Now an address that names this daemon's listener (by IP and port,
 * however spelt) under another id is an earlier run's (PEER_GONE, at
 * once, nothing dialled), spelt otherwise with our id it is refused
 * (INVALID), and a handshake that reaches this daemon itself fails as
 * one. The offer stands; nothing lands in B's pool. */
TEST_T(access_alias_of_own_address, 60)
{
    need_root("access_alias_of_own_address");
    char dir[96], sec[128], peer[512];
    snprintf(dir, sizeof(dir), "/tmp/kvx-alias-%d", (int)getpid());
    snprintf(sec, sizeof(sec), "%s/secret", dir);
    CHECK(mkdir(dir, 0700) == 0 || errno == EEXIST);
    write_file(sec, P_SECRET);
    CHECK(chmod(sec, 0600) == 0);
    snprintf(peer, sizeof(peer),
             AX_AUTH "peer:\n  listen: \"127.0.0.1:0\"\n  secret_file: %s\n",
             sec);
    daemon_t *d = daemon_start2("  mode: 0666\n", peer);
    side_t cs = ax_side("al-ctx", KVX_ROLE_CONTEXT),
           gs = ax_side("al-gen", KVX_ROLE_GENERATION),
           bs = ax_side("al-bgen", KVX_ROLE_GENERATION);
    rank_t c, g, bg;
    ax_rank(d, AX_UID_A, &cs, &c);
    ax_rank(d, AX_UID_A, &gs, &g);
    ax_rank(d, AX_UID_B, &bs, &bg);
    kvx_client_t *rb = router_as(d, AX_UID_B);
    /* kvx://127.0.0.1:PORT/ID: the port, and the id */
    const char *port = strrchr(c.addr, ':'), *id = strrchr(c.addr, '/');
    CHECK(port && id && id > port);
    int plen = (int)(id - port);
    char alias[4][192];
    snprintf(alias[0], 192, "kvx://127.0.0.1%.*s/0000000000000000", plen, port);
    snprintf(alias[1], 192, "kvx://127.1%.*s/0000000000000000", plen, port);
    snprintf(alias[2], 192, "kvx://[::ffff:127.0.0.1]%.*s%s", plen, port, id);
    snprintf(alias[3], 192, "kvx://127.0.0.1%.*s/", plen, port);
    const int want[4] = {KVX_ERR_PEER_GONE, KVX_ERR_PEER_GONE, KVX_ERR_INVALID,
                         KVX_ERR_PEER_GONE};
    kvx_context_params_t p;
    ax_publish(&c, "room", 21, &p);
    kvx_context_params_free(&p);
    for (int i = 0; i < 4; i++) {
        char gk[32];
        snprintf(gk, sizeof(gk), "steal-%d", i);
        int rc = ax_fetch_key(&bg, gk, "al-ctx", alias[i], "room");
        fprintf(stderr, "fetch by %s: %s: %s\n", alias[i], kvx_status_name(rc),
                kvx_last_error(bg.c));
        CHECK_EQ(rc, want[i]);
        CHECK_STR_CONTAINS(kvx_last_error(bg.c),
                           want[i] == KVX_ERR_INVALID
                               ? "is this daemon, spelt otherwise"
                               : "this daemon's listener under another id");
        CHECK_EQ(ax_release_key(bg.c, "al-ctx", alias[i], "room"), want[i]);
        CHECK_EQ(ax_release_key(rb, "al-ctx", alias[i], "room"), want[i]);
    }
    ax_untouched(&bg);
    ax_still_offered(&c, &g, "room", 21);
    /* nor may a join make an alias of this daemon another rank's */
    side_t ts = ax_side("al-two", KVX_ROLE_CONTEXT);
    ts.tp = 2;
    rank_t t;
    rank_hello_only(d, &M_SMALL, &ts, 0, &t);
    for (int i = 0; i < 4; i++) {
        const char *addrs[2] = {t.addr, alias[i]};
        CHECK_EQ(kvx_join(t.c, addrs, 2, T_MS), KVX_ERR_INVALID);
        CHECK_STR_CONTAINS(kvx_last_error(t.c), "join.rank_addresses[1]: "
                                                "daemon '");
    }
    rank_close(&t);
    CHECK(!log_contains(d, "authenticated")); /* it never dialled itself */
    kvx_close(rb);
    rank_close(&bg);
    rank_close(&g);
    rank_close(&c);
    daemon_healthy(d);
    daemon_stop_ok(d);
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    (void)!system(cmd);
}

/* The table's "another daemon" row: uid A's context instance on daemon
 * A, and on daemon B a generation rank of uid A, one of uid B and routers
 * (no Hello) of both. By default only instances of the owner's uid may
 * fetch or release by key, on any daemon: daemon B says which uid owns
 * the asking instance (PeerResolve.consumer_uid). */
TEST_T(access_rules_other_daemon, 90)
{
    need_root("access_rules_other_daemon");
    p_setup();
    p_socket_extra = "  mode: 0666\n";
    daemon_t *a = p_daemon(0, P_SECRET, NULL, AX_AUTH);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, AX_AUTH);
    p_socket_extra = NULL;
    side_t cs = ax_side("ox-ctx", KVX_ROLE_CONTEXT),
           gs = ax_side("ox-gen", KVX_ROLE_GENERATION),
           bs = ax_side("ox-bgen", KVX_ROLE_GENERATION);
    rank_t c, g, bg;
    ax_rank(a, AX_UID_A, &cs, &c);
    ax_rank(b, AX_UID_A, &gs, &g);
    ax_rank(b, AX_UID_B, &bs, &bg);
    kvx_client_t *ra = router_as(b, AX_UID_A), *rb = router_as(b, AX_UID_B);
    kvx_context_params_t p;
    ev_t e;

    /* fetch with the params, from uid B too */
    ax_publish(&c, "f-b", 31, &p);
    CHECK_KVX(kvx_fetch_key(bg.c, "f-b", 3, p.data, p.len, bg.pool, AX_GB, 2, 0,
                            0, T_MS),
              bg.c);
    CHECK_EQ(wait_key(bg.c, "f-b", 3, 8000).kind, KVX_EVENT_COMPLETE);
    ax_landed(&bg, 31);
    memset(bg.base, 0xa5, bg.size);
    kvx_context_params_free(&p);

    /* fetch by key: uid A's instance yes, uid B's no */
    ax_publish(&c, "k-a", 32, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_fetch_key(&g, "k-a", "ox-ctx", c.addr, "k-a"), g.c);
    CHECK_EQ(wait_key(g.c, "k-a", 3, 8000).kind, KVX_EVENT_COMPLETE);
    ax_landed(&g, 32);
    ax_publish(&c, "k-b", 33, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_fetch_key(&bg, "k-b", "ox-ctx", c.addr, "k-b"), bg.c);
    e = wait_key(bg.c, "k-b", 3, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_ERROR);
    CHECK_EQ(e.code, KVX_ERR_PERM);
    CHECK_STR_CONTAINS(e.msg, "instance ox-bgen of uid 64022");
    ax_untouched(&bg);

    /* release with the params: a router of uid B on daemon B */
    ax_publish(&c, "r-b", 34, &p);
    CHECK_KVX(kvx_release(rb, p.data, p.len, T_MS), rb);
    CHECK_EQ(wait_key(c.c, "r-b", 3, 8000).kind, KVX_EVENT_COMPLETE);
    kvx_context_params_free(&p);

    /* release by key: a generation rank of the owner's uid only */
    ax_publish(&c, "rk", 35, &p);
    kvx_context_params_free(&p);
    CHECK_EQ(ax_release_key(ra, "ox-ctx", c.addr, "rk"), KVX_ERR_PERM);
    CHECK_STR_CONTAINS(kvx_last_error(ra), "only a generation rank");
    CHECK_EQ(ax_release_key(bg.c, "ox-ctx", c.addr, "rk"), KVX_ERR_PERM);
    CHECK_STR_CONTAINS(kvx_last_error(bg.c), "of uid 64022");
    /* cancel: names the caller's own requests, never daemon A's */
    (void)kvx_cancel_key(g.c, "rk", 2, T_MS);
    /* reserve: only at the daemon of the instance's rank 0 */
    CHECK_EQ(kvx_reserve(ra, "ox-ctx", "v", 1, 5, &p, T_MS), KVX_ERR_NOT_FOUND);
    /* status on B shows nothing of daemon A's instance */
    char *js = NULL;
    CHECK_KVX(kvx_status_json(ra, &js, T_MS), ra);
    CHECK(strstr(js, "ox-ctx") == NULL);
    free(js);
    ax_still_offered(&c, &g, "rk", 35);
    ax_publish(&c, "rk2", 36, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_release_key(g.c, "ox-ctx", c.addr, "rk2"), g.c);
    e = wait_key(c.c, "rk2", 3, 8000);
    CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
    CHECK_STR_CONTAINS(e.msg, "released");

    kvx_close(ra);
    kvx_close(rb);
    rank_close(&bg);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A daemon that runs as a user of its own (kvxfer under
 * systemd/kvxferd.service) lets in the members of its group, by their
 * gid or a supplementary group, with no auth key set; others are refused
 * (the socket is mode 0666 here, so only the allow-list decides). */
#define AX_DAEMON_UID 64030
#define AX_DAEMON_GID 64031
TEST_T(access_daemon_group, 60)
{
    need_root("access_daemon_group");
    h_init();
    char dir[64], sock[128], cfg[128], log[128], text[512];
    snprintf(dir, sizeof(dir), "/tmp/kvx-grp-%d", (int)getpid());
    snprintf(sock, sizeof(sock), "%s/s.sock", dir);
    snprintf(cfg, sizeof(cfg), "%s/k.yaml", dir);
    snprintf(log, sizeof(log), "%s/kvxferd.log", dir);
    snprintf(text, sizeof(text), "rm -rf %s; mkdir -p %s", dir, dir);
    CHECK(system(text) == 0);
    CHECK(chmod(dir, 0777) == 0);
    snprintf(text, sizeof(text), "socket:\n  path: %s\n  mode: 0666\n", sock);
    write_file(cfg, text);

    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        char exe[256];
        snprintf(exe, sizeof(exe), "%s/kvxferd", build_dir());
        if (setgroups(0, NULL) || setgid(AX_DAEMON_GID) ||
            setuid(AX_DAEMON_UID))
            _exit(126);
        execl(exe, exe, "--config", cfg, (char *)NULL);
        _exit(127);
    }
    kvx_client_t *c = NULL;
    for (int i = 0; i < 500 && kvx_connect_observer(sock, 200, &c); i++)
        sleep_ms(10);
    CHECK(c != NULL); /* root is always let in */
    kvx_close(c);

    /* uid A, primary group the daemon's: in */
    char *js = NULL;
    CHECK(setegid(AX_DAEMON_GID) == 0 && seteuid(AX_UID_A) == 0);
    int rc = kvx_connect_observer(sock, T_MS, &c);
    as_uid(0);
    CHECK_EQ(rc, 0);
    CHECK_KVX(kvx_status_json(c, &js, T_MS), c);
    free(js);
    kvx_close(c);

    /* uid B, the daemon's group only among its supplementary groups: in */
    gid_t sup = AX_DAEMON_GID;
    CHECK(setgroups(1, &sup) == 0);
    as_uid(AX_UID_B);
    rc = kvx_connect_observer(sock, T_MS, &c);
    as_uid(0);
    CHECK_EQ(rc, 0);
    /* (the daemon reads the groups at accept: they stay until answered) */
    CHECK_KVX(kvx_status_json(c, &js, T_MS), c);
    CHECK(setgroups(0, NULL) == 0);
    free(js);
    kvx_close(c);

    /* uid B in no group of the daemon's: refused */
    as_uid(AX_UID_B);
    rc = kvx_connect_observer(sock, T_MS, &c);
    if (!rc) {
        rc = kvx_status_json(c, &js, T_MS);
        CHECK_EQ(rc, KVX_ERR_PERM);
        CHECK_STR_CONTAINS(kvx_last_error(c), "uid 64022 is not in");
        kvx_close(c);
    }
    as_uid(0);
    CHECK(rc != 0);

    CHECK(kill(pid, SIGTERM) == 0);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    snprintf(text, sizeof(text), "rm -rf %s", dir);
    CHECK(system(text) == 0);
}
