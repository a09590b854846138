/*
 * t_peer_lanes — lanes between two daemons: slot data over UCX workers
 * of their own, refused without a connection's MAC, mixed counts, lanes
 * a firewall refuses, stalled lanes and stalled connection data.
 * Included by integration.c after t_peer_transfer.c (its helpers).
 */

/* Lanes (peer.lanes, 2 by default): slot data goes over UCX workers on
 * threads of their own, whose addresses a daemon tells only in an
 * authenticated handshake; the status says how many each connection
 * uses. A lane takes data only with the key of a connection: a daemon
 * that authenticated but sends data naming no connection's key
 * (fake_peer lane) has it dropped, small or large, and the daemon's end
 * of its endpoint closed, and the daemons go on moving verified bytes. */
TEST_T(peer_lanes, 120)
{
    daemon_t *a, *b;
    /* the fake lane sender's 10 MiB of refused data may hold a loaded
     * 2-core machine's daemons past 1 s (ASan): this test is not about
     * keep-alives, so a loss there must not end the second exchange */
    p_ka_timeout_ms = 5000;
    p_two_daemons(&a, &b);
    char *json = status_json(a);
    char *ucx = p_json_section(json, "\"ucx\":");
    CHECK(ucx != NULL);
    CHECK_EQ(json_num(ucx, "lanes"), 2);
    free(ucx);
    free(json);
    char *st = status_json(a);
    /* lanes listen on no port of their own */
    CHECK_STR_CONTAINS(st, "\"lane_ports\":[]");
    const char *h = strstr(st, "\"listen\":\"kvx://");
    CHECK(h != NULL);
    h += strlen("\"listen\":\"kvx://");
    char a_ipport[64];
    snprintf(a_ipport, sizeof(a_ipport), "%.*s", (int)strcspn(h, "/"), h);
    free(st);
    p_both_ways(a, b, "pl", 6, 4);
    for (int i = 0; i < 2; i++) {
        char *pj = p_peers(i ? b : a);
        fprintf(stderr, "%c's peers: %s\n", "AB"[i], pj);
        CHECK_EQ(json_num(pj, "lanes"), 2);
        CHECK_EQ(json_num(pj, "errors"), 0);
        /* which transports carried each connection's bytes: its own
         * endpoint's and its lanes', once they sent */
        CHECK_STR_CONTAINS(pj, "\"transports\":\"tcp/");
        free(pj);
    }
    CHECK(log_wait(a, "lane 0 carries its data over tcp/", 2000));
    CHECK(log_wait(b, "lane 1 carries its data over tcp/", 2000));

    static const char *const sizes[2] = {"4096", "2097152"};
    for (int i = 0; i < 2; i++) {
        char args[400], out[1024];
        snprintf(args, sizeof(args), "lane %s/secret-A %s %s 5", p_net.dir,
                 a_ipport, sizes[i]);
        FILE *f = p_fake(1, args, NULL, 0);
        p_fake_rest(f, out, sizeof(out));
        fprintf(stderr, "fake lane sender (%s bytes): %s", sizes[i], out);
        /* the daemon force-closes its end; UCX 1.13 tells the sender
         * only with its keep-alive (20 s), so "closed" may not show */
        CHECK_STR_CONTAINS(out, "done");
    }
    CHECK(log_wait(a, "data with no connection's MAC; dropped", 2000));
    /* nothing of the real connection was touched */
    p_both_ways(a, b, "pl2", 3, 3);
    char *pa = p_peers(a);
    CHECK_EQ(json_num(pa, "errors"), 0);
    CHECK_STR_CONTAINS(pa, "\"state\":\"connected\"");
    free(pa);
    p_stop_both(a, b);
}

/* Daemons with different peer.lanes: a connection uses the lanes both
 * have (none when either has none: data over the connection itself),
 * and every byte arrives either way. */
TEST_T(peer_lanes_mixed, 150)
{
    static const struct {
        const char *a, *b;
        long long used;
    } cases[] = {
        {"  lanes: 0\n", NULL, 0},
        {"  lanes: 4\n", "  lanes: 1\n", 1},
    };
    p_setup();
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        daemon_t *a = p_daemon(0, P_SECRET, cases[i].a, NULL);
        daemon_t *b = p_daemon(1, P_SECRET, cases[i].b, NULL);
        char tag[16];
        snprintf(tag, sizeof(tag), "plm%zu", i);
        p_both_ways(a, b, tag, 4, 3);
        for (int k = 0; k < 2; k++) {
            char *pj = p_peers(k ? b : a);
            fprintf(stderr, "case %zu, %c's peers: %s\n", i, "AB"[k], pj);
            CHECK_EQ(json_num(pj, "lanes"), cases[i].used);
            CHECK_EQ(json_num(pj, "errors"), 0);
            free(pj);
        }
        p_stop_both(a, b);
    }
}

/* Lanes that cannot be reached (a firewall that lets only peer.listen
 * through; here daemon A tells B port 1 for its lanes, KVXFERD_FAULT
 * lanes:1): B's first lane send fails before any data went over it, B
 * says so and sends A's slot data over the connection itself, and every
 * byte arrives; the connection is not lost. */
TEST_T(peer_lanes_refused, 90)
{
    p_setup();
    setenv("KVXFERD_FAULT", "lanes:1", 1);
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    unsetenv("KVXFERD_FAULT");
    daemon_t *b = p_daemon(1, P_SECRET, "  direct: 1\n", NULL);
    /* first vllm-nhd (16 KiB runs) both sides: B sends its pieces from
     * its pool (peer.direct 1), over the lanes it thinks up */
    side_t c0 = {
        .inst = "plr-ctx0", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g0 = {
        .inst = "plr-gen0", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    xfer_case2(b, a, &M_8K, &c0, &g0, 2, 300, 0);
    CHECK(log_wait(b,
                   "before any data went over it; slot data to it goes "
                   "over the connection itself",
                   2000));
    side_t c = {
        .inst = "plr-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g = {
        .inst = "plr-gen", .tp = 2, .pp = 1, .preset = "trtllm", .tpb = 8};
    xfer_case2(b, a, &M_8K, &c, &g, 4, 300, 0);
    side_t c2 = {
        .inst = "plr-ctx2", .tp = 1, .pp = 1, .preset = "vllm-hnd", .tpb = 16};
    side_t g2 = {
        .inst = "plr-gen2", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    xfer_case2(b, a, &M_8K, &c2, &g2, 3, 257, 5);
    char *pb = p_peers(b);
    fprintf(stderr, "B's peers: %s\n", pb);
    CHECK_EQ(json_num(pb, "lanes"), 0);
    CHECK_EQ(json_num(pb, "errors"), 0);
    CHECK_STR_CONTAINS(pb, "\"state\":\"connected\"");
    free(pb);
    /* B sent its first pieces from its pool, as the lanes were thought
     * up; no lane ever carried data (lanes 0, the log line above), so
     * those sends went again over the connection, from the same places
     * (verified above, byte for byte) */
    long long sent = p_direct_sent(b);
    fprintf(stderr, "pieces B sent straight from its blocks: %lld\n", sent);
    CHECK(sent > 0);
    p_stop_both(a, b);
}

/* A lane stalls while the connection itself stays up (KVXFERD_FAULT
 * lane_hold:3 at B: B's lane keeps the third piece that comes to it and
 * never answers, as a lane whose TCP stalls would): A's lane send never
 * comes back, and after peer.keepalive_timeout_ms A loses the connection
 * (the lanes' keep-alive: `nothing sent for`), so the request ends ERROR
 * PEER_GONE on both sides within the keep-alive bound instead of waiting
 * for its fetch timeout; the next transfer completes over a new
 * connection. */
TEST_T(peer_lane_stalled, 90)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, "  direct: 1\n", NULL);
    setenv("KVXFERD_FAULT", "lane_hold:3", 1);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    unsetenv("KVXFERD_FAULT");
    side_t cs, gs;
    rank_t c, g;
    /* M_8K: runs of 3-4 KiB, so A sends each piece from its pool */
    p_side(&cs, "pls-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    p_side(&gs, "pls-gen", KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_open(a, &M_8K, &cs, 0, 8, &c);
    rank_open(b, &M_8K, &gs, 0, 8, &g);
    /* each request is one piece: the third request's is held */
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    int64_t t0 = now_ms();
    int ended_error = 0;
    for (uint64_t q = 1; q <= 4 && !ended_error; q++) {
        fill_req(&c, q, cb, 7);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, q, c.pool, cb, 2, 7, &p, T_MS), c.c);
        CHECK_KVX(kvx_fetch(g.c, q, p.data, p.len, g.pool, gb, 2, 0, T_MS),
                  g.c);
        kvx_context_params_free(&p);
        t0 = now_ms();
        ev_t e = {0};
        int n = 0;
        while (n == 0 && now_ms() - t0 < 10000)
            n = collect(g.c, &e, 1, 1, 10000);
        CHECK_EQ(n, 1);
        CHECK_EQ(e.req, q);
        ev_t ce = {0}; /* the context side's, whatever it is */
        for (n = 0; n == 0 && now_ms() - t0 < 10000;)
            n = collect(c.c, &ce, 1, 1, 10000);
        if (e.kind == KVX_EVENT_ERROR) {
            fprintf(stderr, "request %llu: %s (%lld ms); context side: %s\n",
                    (unsigned long long)q, e.msg, (long long)(now_ms() - t0),
                    n ? ce.msg : "(no event)");
            /* the offer ended: its fence let go of the piece UCX held */
            CHECK_EQ(n, 1);
            CHECK_EQ(ce.req, q);
            CHECK_EQ(e.code, KVX_ERR_PEER_GONE);
            CHECK(now_ms() - t0 <= P_BOUND_MS + 500);
            ended_error = 1;
        } else {
            CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
            CHECK_EQ(p_check_req(&g, q, gb, 7, 0), 0);
        }
    }
    CHECK(ended_error);
    CHECK(log_wait(a, "nothing sent for", 2000));
    /* A sent from its pool (peer.direct 1): the held piece's fence was
     * let go when the stalled lane failed (the context side's event came,
     * above) */
    long long sent = p_direct_sent(a);
    fprintf(stderr, "pieces A sent straight from its blocks: %lld\n", sent);
    CHECK(sent >= 3);
    /* a new connection carries the next one */
    uint32_t cb2[2] = {4, 5}, gb2[2] = {6, 7};
    p_one(&c, &g, 50, cb2, gb2, 2, 7, 8000);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* Slot data on the connection itself stalls (no lanes; KVXFERD_FAULT
 * conn_hold:2 at B: B keeps the second DATA that comes by rendezvous on
 * the connection and never answers, while PINGs still flow both ways):
 * A's data keep-alive (`slot data to ... nothing sent for`) loses the
 * connection, so the request ends PEER_GONE on both sides within the
 * keep-alive bound instead of at its fetch timeout (a piece sent from a
 * pool would hold its offer's fence that long); the next request
 * completes over a new connection. */
TEST_T(peer_conn_data_stalled, 90)
{
    p_setup();
    /* a piece from a slot goes by UCX's own choice of protocol, and only
     * one sent by rendezvous can be held: UCX 1.22 sends 2 MiB over TCP
     * eagerly, in fragments, where 1.13 chose rendezvous */
    setenv("UCX_RNDV_THRESH", "64k", 1);
    daemon_t *a = p_daemon(0, P_SECRET, "  lanes: 0\n", NULL);
    setenv("KVXFERD_FAULT", "conn_hold:2", 1);
    daemon_t *b = p_daemon(1, P_SECRET, "  lanes: 0\n", NULL);
    unsetenv("KVXFERD_FAULT");
    unsetenv("UCX_RNDV_THRESH");
    side_t cs, gs;
    rank_t c, g;
    p_side(&cs, "pcs-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 16);
    p_side(&gs, "pcs-gen", KVX_ROLE_GENERATION, "vllm-nhd", 16);
    rank_open(a, &M_8K, &cs, 0, 40, &c);
    rank_open(b, &M_8K, &gs, 0, 40, &g);
    /* 256 tokens of 8 KiB: one 2 MiB piece, sent by rendezvous */
    uint32_t cb[16], gb[16];
    for (uint32_t i = 0; i < 16; i++) {
        cb[i] = i;
        gb[i] = 20 + i;
    }
    int ended_error = 0;
    for (uint64_t q = 1; q <= 3 && !ended_error; q++) {
        fill_req(&c, q, cb, 256);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, q, c.pool, cb, 16, 256, &p, T_MS), c.c);
        CHECK_KVX(kvx_fetch(g.c, q, p.data, p.len, g.pool, gb, 16, 0, T_MS),
                  g.c);
        kvx_context_params_free(&p);
        int64_t t0 = now_ms();
        ev_t e = {0}, ce = {0};
        int n = 0;
        while (n == 0 && now_ms() - t0 < 10000)
            n = collect(g.c, &e, 1, 1, 10000);
        CHECK_EQ(n, 1);
        CHECK_EQ(e.req, q);
        for (n = 0; n == 0 && now_ms() - t0 < 10000;)
            n = collect(c.c, &ce, 1, 1, 10000);
        CHECK_EQ(n, 1);
        if (e.kind == KVX_EVENT_ERROR) {
            fprintf(stderr, "request %llu: %s (%lld ms); context side: %s\n",
                    (unsigned long long)q, e.msg, (long long)(now_ms() - t0),
                    ce.msg);
            CHECK_EQ(e.code, KVX_ERR_PEER_GONE);
            CHECK(now_ms() - t0 <= P_BOUND_MS + 500);
            ended_error = 1;
        } else {
            CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
            CHECK_EQ(p_check_req(&g, q, gb, 256, 0), 0);
        }
    }
    CHECK(ended_error);
    CHECK(log_wait(a, "slot data to", 2000));
    p_one(&c, &g, 50, cb, gb, 16, 256, 8000);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}
