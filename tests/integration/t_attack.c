/*
 * t_attack.c — a second attack on the access rules, the budget and the
 * handshake, after the first round of fixes: each test got through the
 * code it was written against (a cross-uid read by a replayed spread
 * token, a worker address that crashed UCX, handshake floods that kept
 * daemons out, uncharged consumers lists, another uid's churn dropping
 * the records of released keys) and now checks that it no longer does.
 * Reuses t_access.c's two uids (AX_UID_A, AX_UID_B) and helpers.
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

/* ---- the handshake cap, from a local user of the dialling host ------- */

/* One handshake socket of at_flood(): connected to ip:port, and then
 * (hello) a well-formed HELLO without the secret's MAC, which any
 * stranger can send, or (else) one byte of a frame header. Either way
 * the daemon has "received something": before the HELLO proved the
 * secret, the daemon answered such a HELLO with its CHALLENGE and never
 * closed either for another handshake. -1 on failure. */
static int at_hs_open(const char *src, const char *ip, int port, int hello)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port)},
                       so = {.sin_family = AF_INET};
    if (fd < 0 || inet_pton(AF_INET, ip, &sa.sin_addr) != 1 ||
        (src && (inet_pton(AF_INET, src, &so.sin_addr) != 1 ||
                 bind(fd, (struct sockaddr *)&so, sizeof(so)))) ||
        connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    uint8_t buf[256];
    size_t n = 1;
    buf[0] = 0;
    if (hello) {
        uint8_t nonce[32] = {1};
        Kvxfer__PeerHello h = KVXFER__PEER_HELLO__INIT;
        h.version = 7; /* peer.c PEER_VERSION */
        h.address = "kvx://10.0.0.9:9/0000000000000000";
        h.nonce.data = nonce;
        h.nonce.len = sizeof(nonce);
        Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
        m.m_case = KVXFER__PEER_MSG__M_HELLO;
        m.hello = &h;
        size_t pl = kvxfer__peer_msg__get_packed_size(&m);
        uint32_t be = htonl((uint32_t)pl);
        memcpy(buf, &be, 4);
        kvxfer__peer_msg__pack(&m, buf + 4);
        n = 4 + pl;
    }
    if (write(fd, buf, n) != (ssize_t)n) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A child in network namespace ns (NULL: this one) holding nsock
 * handshakes to ip:port open (at_hs_open()), each reopened at once when
 * the daemon closes it, for seconds; its pid. No secret, no privilege
 * beyond a socket: what any local user of the host may do. */
static pid_t at_flood(const char *ns, char srcs[][32], const char *ip, int port,
                      int nsock, int hello, int seconds)
{
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid)
        return pid;
    if (ns) {
        char path[128];
        snprintf(path, sizeof(path), "/var/run/netns/%s", ns);
        int nfd = open(path, O_RDONLY | O_CLOEXEC);
        if (nfd < 0 || setns(nfd, CLONE_NEWNET))
            _exit(2);
        close(nfd);
    }
    if (setresgid(65534, 65534, 65534) || setresuid(65534, 65534, 65534))
        _exit(3); /* from here on: nobody */
    struct pollfd p[64];
    CHECK(nsock <= 64);
    for (int i = 0; i < nsock; i++)
        p[i] = (struct pollfd){
            at_hs_open(srcs ? srcs[i / 8] : NULL, ip, port, hello), POLLIN, 0};
    int64_t end = now_ms() + seconds * 1000;
    while (now_ms() < end) {
        (void)poll(p, (nfds_t)nsock, 50);
        for (int i = 0; i < nsock; i++) {
            if (p[i].fd >= 0 && !(p[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            uint8_t b[512];
            if (p[i].fd >= 0 && read(p[i].fd, b, sizeof(b)) > 0)
                continue; /* its CHALLENGE: never answered */
            if (p[i].fd >= 0)
                close(p[i].fd);
            p[i].fd = at_hs_open(srcs ? srcs[i / 8] : NULL, ip, port, hello);
        }
    }
    _exit(0);
}

/* Attack: a local user on daemon B's host (B's IP; no secret) keeps 8
 * handshakes to daemon A open, each having sent a byte or a HELLO, each
 * opened again at once when A ends it. Before: none was "idle", none was
 * evicted, and A's cap of 8 handshakes from one IP was B's cap too:
 * every dial of daemon B to A was closed at accept, and B's fetches
 * failed (4 of 4). Now B's HELLO proves the secret, so A never closes
 * B's handshake for a stranger's: the stranger's HELLO is refused at
 * once (no MAC), its bytes are closed for newer sockets, and B's
 * fetches complete, verified. (hello 2: at_replay_case().) */
static void at_flood_case(int hello, int nsrc)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    if (!p_net.netns) {
        fprintf(stderr, "skipped: the flood needs B's namespace\n");
        daemon_stop_ok(a);
        return;
    }
    static side_t cs, gs;
    rank_t c, g;
    p_side(&cs, "af-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    p_side(&gs, "af-gen", KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_open(a, &M_SMALL, &cs, 0, 8, &c);
    char a_ipport[64];
    p_ipport_of(&c, a_ipport, sizeof(a_ipport));
    char *colon = strrchr(a_ipport, ':');
    *colon = 0;
    /* nsrc > 1: a host of the cluster's network with nsrc IPs (B's
     * namespace given 10.X.0.100...), 8 handshakes from each */
    static char srcs[8][32];
    for (int i = 0; i < nsrc && nsrc > 1; i++) {
        snprintf(srcs[i], sizeof(srcs[i]), "%.*s.%d",
                 (int)(strrchr(p_net.ip[1], '.') - p_net.ip[1]), p_net.ip[1],
                 100 + i);
        CHECK(p_sh(NULL, 0, "ip -n %s addr add %s/24 dev %s", p_net.ns[1],
                   srcs[i], p_net.veth[1]) == 0);
    }
    pid_t fl = -1;
    FILE *fk = NULL;
    char out[512];
    if (hello == 2) { /* one HELLO of a daemon's, captured, sent again */
        char args[300];
        snprintf(args, sizeof(args), "hello-flood %s/secret-A %s:%s 8 12",
                 p_net.dir, a_ipport, colon + 1);
        fk = p_fake(1, args, NULL, 0);
        CHECK(fgets(out, sizeof(out), fk) != NULL);
        CHECK_STR_CONTAINS(out, "flood 8");
    } else {
        fl = at_flood(p_net.ns[1], nsrc > 1 ? srcs : NULL, a_ipport,
                      atoi(colon + 1), 8 * nsrc, hello, 60);
    }
    usleep(300 * 1000);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    int failed = 0, n = 4;
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    rank_open(b, &M_SMALL, &gs, 0, 8, &g);
    for (uint64_t q = 1; q <= (uint64_t)n; q++) {
        fill_req(&c, q, cb, 7);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, q, c.pool, cb, 2, 7, &p, T_MS), c.c);
        CHECK_KVX(kvx_fetch(g.c, q, p.data, p.len, g.pool, gb, 2, 0, T_MS),
                  g.c);
        kvx_context_params_free(&p);
        ev_t e[4];
        CHECK(collect(g.c, e, 4, 1, 20000) == 1);
        if (e[0].kind == KVX_EVENT_COMPLETE) {
            wait_event(c.c, q, KVX_EVENT_COMPLETE, 0, 5000);
            CHECK_EQ(p_check_req(&g, q, gb, 7, 0), 0);
        } else {
            fprintf(stderr, "fetch %llu: %s %s: %s\n", (unsigned long long)q,
                    kind_name(e[0].kind), kvx_status_name(e[0].code), e[0].msg);
            failed++;
            ev_t ce[4];
            if (kvx_cancel(c.c, q, T_MS) == KVX_OK)
                collect(c.c, ce, 4, 1, 5000);
        }
    }
    long challenges = -1, refused = -1, closed = -1;
    if (fk) { /* it ends by itself, after a handshake timeout of A's */
        p_fake_rest(fk, out, sizeof(out));
        fprintf(stderr, "the replaying stranger: %s", out);
        char *r = strstr(out, "challenges ");
        CHECK(r && sscanf(r, "challenges %ld refused %ld closed %ld",
                          &challenges, &refused, &closed) == 3);
    } else {
        kill(fl, SIGKILL);
        waitpid(fl, NULL, 0);
    }
    fprintf(stderr, "%d of %d fetches failed under the %s flood\n", failed, n,
            hello == 2 ? "replayed-HELLO"
            : hello    ? "HELLO"
                       : "one-byte");
    /* what A did with the stranger's sockets */
    int no_mac = log_contains(a, "wrong cluster secret (its hello has no MAC)"),
        replay = log_contains(a, "a hello replayed");
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
    CHECK_EQ(failed, 0);
    if (hello == 1)
        CHECK(no_mac); /* refused at once, holding nothing */
    if (hello == 2) {
        /* the captured HELLO is answered once, by its first socket (as
         * the daemon that made it would have been); every copy after
         * it is refused */
        CHECK_EQ(challenges, 1);
        CHECK(refused > 0 && replay);
    }
}

TEST_T(attack_handshake_flood_hello_same_host, 200)
{
    at_flood_case(1, 1);
}
TEST_T(attack_handshake_flood_byte_same_host, 200)
{
    at_flood_case(0, 1);
}

/* The same from another host of the cluster's network with 8 IPs (64
 * handshakes, 8 from each: within the per-source cap). Before: the total
 * cap of 64 was full of handshakes that were never evicted, and daemon
 * B, from an IP that had none open, was closed at accept all the same
 * (2 to 4 of 4 fetches failed). */
TEST_T(attack_handshake_flood_hello_8_ips, 200)
{
    at_flood_case(1, 8);
}

/* Attack: a stranger on the path captures one HELLO that daemon B made
 * for A (it proves the secret) and sends it again from B's IP on 8
 * sockets, each opened again as A ends it: HELLOs that prove the secret
 * are never closed for another. A takes each HELLO's nonce once: the
 * first copy is answered (its CHALLENGE goes unanswered, and the socket
 * ends at peer.connect_timeout_ms), every later one is refused, and B's
 * fetches complete. Before (the HELLO proved nothing): all 8 were
 * answered and held, and B was closed at accept. */
TEST_T(attack_handshake_flood_replayed_hello, 200)
{
    at_flood_case(2, 1);
}

/* ---- what the daemon remembers of ended requests, across uids -------- */

/* Attack: a released key is remembered (gone_t) so that a late fetch
 * ends NOT_FOUND at once; the records are one table for every uid,
 * GONE_MAX (65536) at once, the oldest dropped first. Uid B publishes and
 * cancels 66000 keys of its own instance: uid A's record of its release
 * is dropped, and A's late fetch by key of the released request no
 * longer ends NOT_FOUND but waits for an offer that will not come
 * (holding its blocks until the fetch timeout). One tenant's churn must
 * not take what the daemon keeps for another. */
TEST_T(attack_gone_records_evicted_by_other_uid, 240)
{
    need_root("attack_gone_records_evicted_by_other_uid");
    daemon_t *d = daemon_start2("  mode: 0666\n", AX_AUTH);
    side_t cs = ax_side("ge-ctx", KVX_ROLE_CONTEXT),
           gs = ax_side("ge-gen", KVX_ROLE_GENERATION),
           bs = ax_side("ge-bctx", KVX_ROLE_CONTEXT);
    rank_t c, g, bc;
    ax_rank(d, AX_UID_A, &cs, &c);
    ax_rank(d, AX_UID_A, &gs, &g);
    ax_rank(d, AX_UID_B, &bs, &bc);
    kvx_client_t *ra = router_as(d, AX_UID_A);
    kvx_context_params_t p;

    /* control: released, then a late fetch: NOT_FOUND at once */
    ax_publish(&c, "v-1", 1, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_release_key(ra, "ge-ctx", c.addr, "v-1"), ra);
    CHECK_EQ(wait_key(c.c, "v-1", 3, 5000).kind, KVX_EVENT_COMPLETE);
    CHECK_KVX(ax_fetch_key(&g, "l-1", "ge-ctx", c.addr, "v-1"), g.c);
    ev_t e = wait_key(g.c, "l-1", 3, 3000);
    fprintf(stderr, "late fetch, before the churn: %s %s: %s\n",
            kind_name(e.kind), kvx_status_name(e.code), e.msg);
    CHECK_EQ(e.code, KVX_ERR_NOT_FOUND);

    /* the victim's second release */
    ax_publish(&c, "v-2", 2, &p);
    kvx_context_params_free(&p);
    CHECK_KVX(ax_release_key(ra, "ge-ctx", c.addr, "v-2"), ra);
    CHECK_EQ(wait_key(c.c, "v-2", 3, 5000).kind, KVX_EVENT_COMPLETE);

    /* uid B's churn: its own keys, published and cancelled */
    int64_t t0 = now_ms();
    static const uint32_t cb[1] = {0};
    kvx_context_params_t bp;
    for (int i = 0; i < 66000; i++) {
        char k[16];
        snprintf(k, sizeof(k), "b%d", i);
        CHECK_KVX(kvx_publish_key(bc.c, k, strlen(k), bc.pool, cb, 1, 1, NULL,
                                  0, &bp, T_MS),
                  bc.c);
        kvx_context_params_free(&bp);
        CHECK_KVX(kvx_cancel_key(bc.c, k, strlen(k), T_MS), bc.c);
        if (i % 256 == 255) {
            kvx_batch_t *b;
            for (int more = 1; more && kvx_poll(bc.c, 0, 0, &b) == 0;) {
                more = b->num_events > 0;
                kvx_batch_free(b);
            }
        }
    }
    fprintf(stderr, "uid B: 66000 publishes and cancels in %lld ms\n",
            (long long)(now_ms() - t0));

    CHECK_KVX(ax_fetch_key(&g, "l-2", "ge-ctx", c.addr, "v-2"), g.c);
    ev_t le[4];
    int got = collect(g.c, le, 4, 1, 3000);
    fprintf(stderr, "late fetch, after uid B's churn: %s\n",
            got ? le[0].msg : "no event within 3 s (it waits for an offer)");
    CHECK_EQ(got, 1);
    CHECK_EQ(le[0].code, KVX_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(le[0].msg, "was released");

    kvx_close(ra);
    rank_close(&bc);
    rank_close(&g);
    rank_close(&c);
    daemon_stop_ok(d);
}

/* ---- the memory budget --------------------------------------------- */

static long at_rss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    long kb = -1;
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, "VmRSS:", 6))
            kb = atol(line + 6);
    fclose(f);
    return kb;
}

/* Attack: a join's consumers list is kept with the instance, uncharged,
 * and has no cap but the frame (limits.max_frame_bytes, 16 MiB). With
 * limits.memory_bytes 64 MiB (uid B's share 32 MiB), uid B's 8 instances
 * each join with 100000 consumers of 128 bytes: the daemon holds about
 * 100 MB for uid B that no budget sees. Every join passes; nothing is
 * refused LIMIT. */
TEST_T(attack_join_consumers_uncharged, 120)
{
    need_root("attack_join_consumers_uncharged");
    daemon_t *d = daemon_start2("  mode: 0666\n",
                                AX_AUTH "limits:\n  memory_bytes: 64MiB\n");
    enum { N_INST = 8, N_CONS = 100000 };
    char **cons = calloc(N_CONS, sizeof(*cons));
    CHECK(cons != NULL);
    for (int i = 0; i < N_CONS; i++) {
        cons[i] = malloc(129);
        memset(cons[i], 'c', 128);
        snprintf(cons[i], 129, "%08d", i);
        cons[i][8] = 'c';
        cons[i][128] = 0;
    }
    long before = at_rss_kb(d->pid);
    static side_t s[N_INST];
    static char names[N_INST][32];
    rank_t r[N_INST];
    int refused = 0;
    for (int i = 0; i < N_INST; i++) {
        snprintf(names[i], sizeof(names[i]), "cj-%d", i);
        s[i] = ax_side(names[i], KVX_ROLE_CONTEXT);
        as_uid(AX_UID_B);
        rank_hello_only(d, &M_SMALL, &s[i], 0, &r[i]);
        as_uid(0);
        const char *addrs[1] = {r[i].addr};
        int rc = kvx_join_consumers(r[i].c, addrs, 1, (const char *const *)cons,
                                    N_CONS, 20000);
        if (rc) {
            fprintf(stderr, "join %d: %s: %s\n", i, kvx_status_name(rc),
                    kvx_last_error(r[i].c));
            refused++;
        }
    }
    long after = at_rss_kb(d->pid);
    fprintf(stderr,
            "daemon RSS %ld MB before, %ld MB after uid B's %d joins of %d "
            "consumers (%d refused); limits.memory_bytes 64 MiB\n",
            before / 1024, after / 1024, N_INST, N_CONS, refused);
    char *js = NULL;
    kvx_client_t *ra = router_as(d, 0);
    CHECK_KVX(kvx_status_json(ra, &js, T_MS), ra);
    char *m = strstr(js, "\"memory\"");
    fprintf(stderr, "status memory: %.300s\n", m ? m : "(none)");
    free(js);
    kvx_close(ra);
    CHECK(refused > 0 || (after - before) / 1024 < 64);
    CHECK_STR_CONTAINS(kvx_last_error(r[0].c), "at most 4096");
    for (int i = 0; i < N_INST; i++)
        rank_close(&r[i]);
    /* lists within the cap are charged to the owner's share: 4096
     * entries of 129 bytes (528 KiB) an instance, uid B's 32 MiB share
     * holds some 60 of them, then LIMIT naming the key */
    static rank_t held[100];
    int kept = 0;
    for (int i = 0; i < 100; i++) {
        static side_t cs;
        char nm[32];
        snprintf(nm, sizeof(nm), "cc-%d", i);
        cs = ax_side(nm, KVX_ROLE_CONTEXT);
        rank_t q;
        as_uid(AX_UID_B);
        rank_hello_only(d, &M_SMALL, &cs, 0, &q);
        as_uid(0);
        const char *addrs[1] = {q.addr};
        int rc = kvx_join_consumers(q.c, addrs, 1, (const char *const *)cons,
                                    4096, 20000);
        if (rc) {
            CHECK_EQ(rc, KVX_ERR_LIMIT);
            CHECK_STR_CONTAINS(kvx_last_error(q.c), "limits.uid_memory_bytes");
            rank_close(&q);
            break;
        }
        held[kept++] = q; /* held open: the instance keeps its list */
    }
    fprintf(stderr, "uid B kept %d lists of 4096 consumers\n", kept);
    CHECK(kept > 0 && kept < 100);
    for (int i = 0; i < kept; i++)
        rank_close(&held[i]);
    for (int i = 0; i < N_CONS; i++)
        free(cons[i]);
    free(cons);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* ---- a peer's worker address that passes ucx_addr_check() ---------- */

/* Attack (found by fuzz_peer_auth, crash input: a real worker address
 * with byte 29 of 186 changed from 0x88 to 0x1c): a peer holding the
 * secret that daemon B dials (as the context rank of a fetch) answers
 * with its real UCX worker address but one byte changed (fake_peer
 * badaddr ... set:OFF:HEX). Byte 29 is the first transport's (self's)
 * interface-address length: 0x10 or 0x1c make that address swallow the
 * next device's header and its 6-byte (IPv4) or 18-byte (loopback) TCP
 * device address (0x18: UCX 1.22's 14-byte loopback one, its namespace
 * id 4 bytes), whichever comes first in the peer's address, so TCP's
 * entry lands on self's device, which has no address. ucx_addr_check()
 * passes it (the walk still ends right), and UCX 1.13 handed TCP a NULL
 * device address: SIGSEGV in ucp_wireup_is_reachable(), from
 * conn_ready(). ucx_addr_fit() now leaves such transports out. Daemon B
 * stays up, and each fetch ends with what went wrong.
 * KVX_AT_VALS: the values (hex, comma separated); KVX_AT_OFFS:
 * first,last offset (a scan: tests/unit/test_ucx.c scans every byte in
 * one process per case). */
TEST_T(attack_worker_address_one_byte, 600)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "wb-ctx", "wb-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    const char *vals =
        getenv("KVX_AT_VALS") ? getenv("KVX_AT_VALS") : "10,18,1c";
    int o0 = 29, o1 = 29;
    if (getenv("KVX_AT_OFFS"))
        CHECK(sscanf(getenv("KVX_AT_OFFS"), "%d,%d", &o0, &o1) == 2);
    char faddr[192], out[4096], args[600];
    uint8_t f[4096];
    size_t fl;
    int tries = 0, dead = 0, ended = 0;
    for (int off = o0; off <= o1 && !dead; off++) {
        char vbuf[128];
        snprintf(vbuf, sizeof(vbuf), "%s", vals);
        for (char *v = strtok(vbuf, ","); v && !dead; v = strtok(NULL, ",")) {
            snprintf(args, sizeof(args), "badaddr %s/secret-A %s set:%d:%s 1",
                     p_net.dir, p_net.ip[0], off, v);
            FILE *fk = p_fake(0, args, faddr, sizeof(faddr));
            p_params_at(&p, faddr, f, &fl);
            uint64_t q = 100 + (uint64_t)tries++;
            CHECK_KVX(kvx_fetch(g.c, q, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
            ev_t e[4];
            int n = collect(g.c, e, 4, 1, 15000);
            p_fake_rest(fk, out, sizeof(out));
            fprintf(stderr, "byte %d = 0x%s: %s\n", off, v,
                    n ? e[0].msg : "(no event)");
            ended += n == 1 && e[0].kind == KVX_EVENT_ERROR;
            if (kill(b->pid, 0) || waitpid(b->pid, NULL, WNOHANG) == b->pid) {
                fprintf(stderr,
                        "daemon B died after the peer it dialled told its "
                        "worker address with byte %d set to 0x%s (try %d)\n",
                        off, v, tries);
                dead = 1;
            }
        }
    }
    if (!dead)
        fprintf(stderr, "daemon B stayed up through %d addresses\n", tries);
    CHECK(!dead);
    CHECK_EQ(ended, tries); /* each fetch ended, refused */
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}
