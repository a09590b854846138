/*
 * t_restart.c — engines outlive their daemon (kvxfer.h, 2.5): kvxferd
 * killed with SIGKILL mid-transfer under ranks of this process; each
 * request in flight ends with one PEER_GONE event the library makes, the
 * same batch on every rank of an instance; calls during the outage fail
 * at once with CLOSED saying why; no byte lands after the event, even
 * once a new daemon runs on the same socket path; then the library
 * reconnects, says it once (a RECONNECTED event), and the next transfer,
 * with the pool ids the engine already had, is verified byte for byte.
 */

/* kill -9, and the process reaped: nothing of it writes any more. */
static void daemon_kill9(daemon_t *d)
{
    CHECK(!d->reaped);
    kill(d->pid, SIGKILL);
    CHECK(daemon_wait(d, 10000) != -1);
}

/* Wait until the slow copies wrote part of r's pool (a sample of its
 * bytes differs from fill): a transfer under way. */
static void wait_landing(const rank_t *r, uint8_t fill)
{
    int64_t end = now_ms() + 10000;
    for (;;) {
        int changed = 0;
        for (uint64_t i = 0; i < r->size; i += 4096)
            changed += r->base[i] != fill;
        if (changed >= 16)
            return;
        CHECK(now_ms() < end);
        sleep_ms(2);
    }
}

/* The one batch the library owes after the loss: n events, all ERROR
 * PEER_GONE "kvxferd went away", keys in the order given. */
static void expect_gone_batch(kvx_client_t *c, const char *const *keys, int n)
{
    kvx_batch_t *b = NULL;
    CHECK_KVX(kvx_poll(c, 1, 5000, &b), c);
    if ((int)b->num_events != n)
        fprintf(stderr, "gone batch: %u events, expected %d\n", b->num_events,
                n);
    CHECK_EQ(b->num_events, n);
    for (int i = 0; i < n; i++) {
        const kvx_event_t *e = &b->events[i];
        CHECK_EQ(e->kind, KVX_EVENT_ERROR);
        CHECK_EQ(e->code, KVX_ERR_PEER_GONE);
        CHECK_STR_CONTAINS(e->message, "kvxferd went away");
        CHECK_EQ(e->key_len, strlen(keys[i]));
        CHECK(!memcmp(e->key, keys[i], e->key_len));
    }
    kvx_batch_free(b);
}

static kvx_client_state_t state_of(const kvx_client_t *c)
{
    kvx_client_state_t s = {.size = sizeof(s)};
    CHECK_EQ(kvx_client_state(c, &s), 0);
    return s;
}

/* Poll until the library is connected again (its attempts go inside
 * calls, after a backoff): the first batch it returns then ends with
 * the RECONNECTED event, once. Returns that batch's seq. */
static uint64_t poll_until_back(kvx_client_t *c, uint32_t incarnation)
{
    int64_t end = now_ms() + 10000;
    for (;;) {
        kvx_batch_t *b = NULL;
        int rc = kvx_poll(c, 0, 0, &b);
        if (rc == 0) {
            CHECK(b->num_events >= 1);
            const kvx_event_t *e = &b->events[b->num_events - 1];
            CHECK_EQ(e->kind, KVX_EVENT_RECONNECTED);
            CHECK_EQ(e->key_len, 0);
            CHECK_STR_CONTAINS(e->message, "kvxferd is back");
            uint64_t seq = b->seq;
            kvx_batch_free(b);
            kvx_client_state_t s = state_of(c);
            CHECK_EQ(s.status, KVX_CLIENT_CONNECTED);
            CHECK_EQ(s.incarnation, incarnation);
            return seq;
        }
        CHECK_EQ(rc, KVX_ERR_CLOSED);
        CHECK_STR_CONTAINS(kvx_last_error(c), "kvxferd went away");
        CHECK(now_ms() < end);
        sleep_ms(10);
    }
}

/* The whole pool against before with req's tokens [0, ntok) written at
 * blocks: every other byte as it was. */
static uint64_t check_pool_over(const rank_t *r, const uint8_t *before,
                                uint64_t req, const uint32_t *blocks,
                                uint32_t ntok)
{
    const kvx_layout_t *l = &r->lay;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    uint8_t *img = malloc(r->size);
    CHECK(img != NULL);
    memcpy(img, before, r->size);
    for (uint32_t t = 0; t < ntok; t++)
        for (uint32_t ly = 0; ly < l->num_layers; ly++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t h = 0; h < l->num_heads; h++)
                    row_fill(
                        rank_at(r, img, ly, kv, blocks[t / l->tokens_per_block],
                                t % l->tokens_per_block, h),
                        rowbytes, req, r->layer0 + ly, kv, t, r->head0 + h);
    uint64_t bad = 0;
    for (uint64_t i = 0; i < r->size; i++)
        if (img[i] != r->base[i] && bad++ < 3)
            fprintf(stderr, "%s pool byte %llu: 0x%02x, expected 0x%02x\n",
                    r->s->inst, (unsigned long long)i, r->base[i], img[i]);
    free(img);
    return bad;
}

/* One small request from c to g, verified byte for byte over g's whole
 * pool (before: what it held). */
static void transfer_over(rank_t *c, rank_t *g, const uint8_t *before,
                          uint64_t req, const uint32_t *cb, const uint32_t *gb,
                          uint32_t nb, uint32_t ntok)
{
    fill_req(c, req, cb, ntok);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c->c, req, c->pool, cb, nb, ntok, &p, T_MS), c->c);
    CHECK_KVX(kvx_fetch(g->c, req, p.data, p.len, g->pool, gb, nb, 0, T_MS),
              g->c);
    wait_event(g->c, req, KVX_EVENT_COMPLETE, 0, 10000);
    wait_event(c->c, req, KVX_EVENT_COMPLETE, 0, 10000);
    CHECK_EQ(check_pool_over(g, before, req, gb, ntok), 0);
    kvx_context_params_free(&p);
}

TEST_T(restart_mid_transfer, 60)
{
    daemon_t *d = daemon_start(SLOW_CFG);
    rank_t c, g;
    side_t cs, gs;
    /* the big request's blocks, and 8 more for the one after the restart */
    pair_open(d, &M_BIG, "rs-ctx", "rs-gen", BIG_BLOCKS + 8, &c, &g, &cs, &gs);
    uint32_t cpool = c.pool, gpool = g.pool;
    char addr0[192];
    snprintf(addr0, sizeof(addr0), "%s", c.addr);
    memset(c.base, 0x11, c.size);
    memset(g.base, 0xa5, g.size);
    uint32_t *bl = big_blocks();
    fill_req(&c, 21, bl, BIG_TOK);
    kvx_context_params_t p, p5, p22;
    uint32_t small[2] = {BIG_BLOCKS, BIG_BLOCKS + 1};
    /* in flight on the context rank: 5 and 22 (offers nobody fetched),
     * 21 (being fetched); on the generation rank: 21 */
    CHECK_KVX(kvx_publish(c.c, 22, c.pool, small, 2, 8, &p22, T_MS), c.c);
    CHECK_KVX(kvx_publish(c.c, 21, c.pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c.c);
    CHECK_KVX(kvx_publish(c.c, 5, c.pool, small, 2, 8, &p5, T_MS), c.c);
    CHECK_KVX(
        kvx_fetch(g.c, 21, p.data, p.len, g.pool, bl, BIG_BLOCKS, 0, T_MS),
        g.c);
    CHECK_EQ(state_of(c.c).in_flight, 3);
    CHECK_EQ(state_of(g.c).in_flight, 1);
    wait_landing(&g, 0xa5); /* killed with the copies running */
    daemon_kill9(d);

    /* one event each, in one batch, ordered by key */
    const char *ck[3] = {"5", "21", "22"}, *gk[1] = {"21"};
    expect_gone_batch(g.c, gk, 1);
    expect_gone_batch(c.c, ck, 3);
    /* what the destination holds at its event: nothing may change it */
    uint8_t *at_event = malloc(g.size);
    CHECK(at_event != NULL);
    memcpy(at_event, g.base, g.size);

    /* the outage: calls fail at once, saying so; the state says it */
    kvx_client_state_t s = state_of(c.c);
    CHECK_EQ(s.status, KVX_CLIENT_RECONNECTING);
    CHECK_EQ(s.in_flight, 0);
    CHECK_STR_CONTAINS(s.message, "kvxferd went away");
    kvx_context_params_t px;
    CHECK_FAILS(kvx_publish(c.c, 30, c.pool, small, 2, 8, &px, T_MS), c.c,
                KVX_ERR_CLOSED, "kvxferd went away");
    CHECK_STR_CONTAINS(kvx_last_error(c.c), "reconnecting");
    kvx_batch_t *b;
    CHECK_FAILS(kvx_poll(g.c, 1, 1000, &b), g.c, KVX_ERR_CLOSED,
                "kvxferd went away");
    CHECK_STR_CONTAINS(kvx_last_error(g.c), "reconnecting");
    /* the attempt that finds nobody says why, and so does the state */
    sleep_ms(60);
    CHECK_FAILS(kvx_poll(g.c, 1, 1000, &b), g.c, KVX_ERR_CLOSED,
                "failed: connect");
    CHECK(state_of(g.c).attempts >= 1);

    daemon_restart(d);
    /* the generation rank first: its pool gets the new daemon's first id,
     * which the engine's other pool id was */
    uint64_t gseq = poll_until_back(g.c, 1);
    uint64_t cseq = poll_until_back(c.c, 1);
    CHECK(gseq >= 1 && cseq >= 1); /* after the gone batch's number */
    char addr1[192];
    CHECK_KVX(kvx_daemon_address(c.c, addr1, sizeof(addr1)), c.c);
    CHECK(strcmp(addr0, addr1) != 0); /* a new daemon, a new address */

    /* the killed fetch's blocks are as they were at its event */
    sleep_ms(200);
    CHECK(!memcmp(at_event, g.base, g.size));
    /* the same pool ids move the next request, every byte checked */
    CHECK_EQ(c.pool, cpool);
    CHECK_EQ(g.pool, gpool);
    uint32_t cb[3] = {BIG_BLOCKS + 7, BIG_BLOCKS + 2, BIG_BLOCKS + 5};
    uint32_t gb[3] = {BIG_BLOCKS + 3, BIG_BLOCKS + 6, BIG_BLOCKS};
    transfer_over(&c, &g, at_event, 23, cb, gb, 3, 11);
    CHECK_EQ(state_of(c.c).in_flight, 0);

    free(at_event);
    free(bl);
    kvx_context_params_free(&p);
    kvx_context_params_free(&p5);
    kvx_context_params_free(&p22);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* A context instance of two ranks (pools of regions, whose memfd the
 * engine closed after registering) on one daemon: both get the same
 * batch, both join the new daemon under its new address, and the
 * instance moves KV again. */
TEST_T(restart_two_ranks_same_batches, 60)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs = {.inst = "rs2-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4,
                 .split = 1};
    side_t gs = {.inst = "rs2-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c0, c1, g;
    rank_hello_only(d, &M_SMALL, &cs, 0, &c0);
    rank_hello_only(d, &M_SMALL, &cs, 1, &c1);
    rank_join(&c0);
    rank_join(&c1);
    rank_pool(&c0, 16);
    rank_pool(&c1, 16);
    rank_open(d, &M_SMALL, &gs, 0, 16, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t b1[2] = {1, 2}, b2[2] = {3, 4};
    kvx_context_params_t p[4];
    const char *keys[2] = {"req-b", "req-a"};
    for (int k = 0; k < 2; k++) {
        rank_t *r = k ? &c1 : &c0;
        CHECK_KVX(kvx_publish_key(r->c, keys[0], 5, r->pool, b1, 2, 8, NULL, 0,
                                  &p[k * 2], T_MS),
                  r->c);
        CHECK_KVX(kvx_publish_key(r->c, keys[1], 5, r->pool, b2, 2, 8, NULL, 0,
                                  &p[k * 2 + 1], T_MS),
                  r->c);
    }
    daemon_kill9(d);
    const char *sorted[2] = {"req-a", "req-b"};
    expect_gone_batch(c0.c, sorted, 2);
    expect_gone_batch(c1.c, sorted, 2);
    kvx_batch_t *b;
    /* the generation rank had nothing in flight: no batch, just CLOSED */
    CHECK_FAILS(kvx_poll(g.c, 0, 0, &b), g.c, KVX_ERR_CLOSED,
                "kvxferd went away");

    daemon_restart(d);
    uint64_t s0 = poll_until_back(c0.c, 1), s1 = poll_until_back(c1.c, 1);
    CHECK_EQ(s0, s1); /* the same batch numbers on both ranks */
    poll_until_back(g.c, 1);
    uint8_t *before = malloc(g.size);
    CHECK(before != NULL);
    memcpy(before, g.base, g.size);
    /* both context ranks publish, the generation rank takes both heads */
    uint32_t cb[2] = {9, 5}, gb[2] = {7, 0};
    fill_req(&c0, 31, cb, 7);
    fill_req(&c1, 31, cb, 7);
    kvx_context_params_t q0, q1;
    CHECK_KVX(kvx_publish(c0.c, 31, c0.pool, cb, 2, 7, &q0, T_MS), c0.c);
    CHECK_KVX(kvx_publish(c1.c, 31, c1.pool, cb, 2, 7, &q1, T_MS), c1.c);
    CHECK_EQ(q0.len, q1.len);
    CHECK(!memcmp(q0.data, q1.data, q0.len));
    CHECK_KVX(kvx_fetch(g.c, 31, q0.data, q0.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 31, KVX_EVENT_COMPLETE, 0, 10000);
    ev_t e0 = wait_event(c0.c, 31, KVX_EVENT_COMPLETE, 0, 10000);
    ev_t e1 = wait_event(c1.c, 31, KVX_EVENT_COMPLETE, 0, 10000);
    CHECK_EQ(e0.kind, e1.kind);
    CHECK_EQ(check_pool_over(&g, before, 31, gb, 7), 0);

    free(before);
    for (int i = 0; i < 4; i++)
        kvx_context_params_free(&p[i]);
    kvx_context_params_free(&q0);
    kvx_context_params_free(&q1);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* Reconnection off: the requests still end, once; then the client is
 * closed for good, and says so, even with a daemon back. */
TEST(restart_reconnect_off)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "ro-ctx", "ro-gen", 8, &c, &g, &cs, &gs);
    kvx_reconnect_t o = {.size = sizeof(o), .enabled = 0};
    CHECK_KVX(kvx_set_reconnect(c.c, &o), c.c);
    kvx_reconnect_t bad = {.size = sizeof(bad),
                           .enabled = 1,
                           .backoff_min_ms = 500,
                           .backoff_max_ms = 100};
    CHECK_FAILS(kvx_set_reconnect(g.c, &bad), g.c, KVX_ERR_INVALID,
                "backoff_min_ms 500 is more than backoff_max_ms 100");
    uint32_t bl[2] = {1, 2};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 7, c.pool, bl, 2, 8, &p, T_MS), c.c);
    daemon_kill9(d);
    const char *k[1] = {"7"};
    expect_gone_batch(c.c, k, 1);
    kvx_client_state_t s = state_of(c.c);
    CHECK_EQ(s.status, KVX_CLIENT_CLOSED);
    CHECK_STR_CONTAINS(s.message, "reconnection is off");
    daemon_restart(d);
    kvx_batch_t *b;
    CHECK_FAILS(kvx_poll(c.c, 0, 0, &b), c.c, KVX_ERR_CLOSED,
                "reconnection is off: the client is closed");
    CHECK_EQ(state_of(c.c).status, KVX_CLIENT_CLOSED);
    /* the other client, reconnection on, is back */
    poll_until_back(g.c, 1);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* Params, and the address, of the daemon's run before a restart, given
 * to the new run: every path that takes them (fetch and release with
 * the params, fetch and release by key at the old address) refuses them
 * naming the cause, both ids, and never looks up the new run's offers
 * by them (the new run has one of the same instance and key). Without a
 * peer listener, where the address is kvx://HOST/ID. */
TEST_T(restart_old_params_refused, 60)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "op-ctx", "op-gen", 8, &c, &g, &cs, &gs);
    char old[192], now[192];
    CHECK_KVX(kvx_daemon_address(c.c, old, sizeof(old)), c.c);
    uint32_t bl[2] = {1, 2};
    kvx_context_params_t p;
    CHECK_KVX(
        kvx_publish_key(c.c, "room", 4, c.pool, bl, 2, 8, NULL, 0, &p, T_MS),
        c.c);
    daemon_kill9(d);
    const char *k[1] = {"room"};
    expect_gone_batch(c.c, k, 1);
    daemon_restart(d);
    poll_until_back(c.c, 1);
    poll_until_back(g.c, 1);
    CHECK_KVX(kvx_daemon_address(c.c, now, sizeof(now)), c.c);
    CHECK(strcmp(old, now) != 0);
    /* the new run offers the same key of the same instance */
    memset(g.base, 0xa5, g.size);
    uint8_t *before = malloc(g.size);
    CHECK(before != NULL);
    memcpy(before, g.base, g.size);
    kvx_context_params_t q;
    CHECK_KVX(
        kvx_publish_key(c.c, "room", 4, c.pool, bl, 2, 8, NULL, 0, &q, T_MS),
        c.c);
    char want[256];
    snprintf(want, sizeof(want),
             "issued by an earlier run of this daemon (its id was %s, this "
             "run is %s)",
             strrchr(old, '/') + 1, strrchr(now, '/') + 1);
    uint32_t gb[2] = {3, 4};
    CHECK_FAILS(
        kvx_fetch_key(g.c, "f1", 2, p.data, p.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c, KVX_ERR_PEER_GONE, want);
    CHECK_STR_CONTAINS(kvx_last_error(g.c), "fetch.context_params");
    CHECK_FAILS(kvx_release(g.c, p.data, p.len, T_MS), g.c, KVX_ERR_PEER_GONE,
                want);
    CHECK_FAILS(kvx_fetch_by_key(g.c, "f2", 2, "op-ctx", old, "room", 4, g.pool,
                                 gb, 2, 0, 0, T_MS),
                g.c, KVX_ERR_PEER_GONE, want);
    CHECK_FAILS(kvx_release_by_key(g.c, "op-ctx", old, "room", 4, T_MS), g.c,
                KVX_ERR_PEER_GONE, want);
    /* nothing was taken: no byte landed, the new offer stands, moves */
    sleep_ms(100);
    CHECK(!memcmp(before, g.base, g.size));
    CHECK_KVX(
        kvx_fetch_key(g.c, "f3", 2, q.data, q.len, g.pool, gb, 2, 0, 0, T_MS),
        g.c);
    CHECK_EQ(wait_key(g.c, "f3", 2, 5000).kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(wait_key(c.c, "room", 4, 5000).kind, KVX_EVENT_COMPLETE);
    CHECK(memcmp(before, g.base, g.size) != 0);
    free(before);
    kvx_context_params_free(&p);
    kvx_context_params_free(&q);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* ---- socket activation ------------------------------------------------ */

/* A process that connects while no daemon runs (its connect queues in
 * the activated socket's backlog) and whose Hello the next daemon
 * answers: exits 0 once it read the status. */
static pid_t connect_waiting(daemon_t *d)
{
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        kvx_client_t *c;
        int rc = kvx_connect_observer(d->sock, 10000, &c);
        if (rc) {
            fprintf(stderr, "connect while no daemon runs: %s: %s\n",
                    kvx_status_name(rc), kvx_last_error(c));
            _exit(1);
        }
        char *json = NULL;
        rc = kvx_status_json(c, &json, T_MS);
        free(json);
        kvx_close(c);
        _exit(rc ? 1 : 0);
    }
    return pid;
}

/* The daemon started by socket activation (fd 3 passed with LISTEN_FDS=1
 * and LISTEN_PID, as systemd's kvxferd.socket does): it serves on that
 * socket; at exit (a drain, and kill -9) the socket file stays; a client
 * that connects while no daemon runs waits instead of failing, and is
 * answered by the next daemon on the same fd; the engines' ranks
 * reconnect there and move KV, every byte checked. */
TEST_T(restart_socket_activation, 60)
{
    h_activate = 1;
    daemon_t *d = daemon_start(NULL);
    h_activate = 0;
    CHECK(log_contains(d, "socket activation: fd 3"));
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "sa-ctx", "sa-gen", 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint8_t *before = malloc(g.size);
    CHECK(before != NULL);
    uint32_t cb[2] = {1, 2}, gb[2] = {3, 4};
    for (int round = 0; round < 2; round++) {
        memcpy(before, g.base, g.size);
        transfer_over(&c, &g, before, 40 + round, cb, gb, 2, 6);
        /* a drain, then kill -9: the socket file is the unit's */
        if (round == 0)
            daemon_stop_ok(d);
        else
            daemon_kill9(d);
        struct stat st;
        CHECK(stat(d->sock, &st) == 0 && S_ISSOCK(st.st_mode));
        pid_t waiting = connect_waiting(d);
        sleep_ms(200); /* it connected, and waits for an answer */
        CHECK(waitpid(waiting, NULL, WNOHANG) == 0);
        daemon_restart(d);
        int wst;
        CHECK(waitpid(waiting, &wst, 0) == waiting);
        CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
        poll_until_back(c.c, (uint32_t)round + 1);
        poll_until_back(g.c, (uint32_t)round + 1);
    }
    memcpy(before, g.base, g.size);
    transfer_over(&c, &g, before, 42, cb, gb, 2, 6);
    free(before);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
    close(d->lfd);
}

/* A socket passed as fd 3 that is not a listening AF_UNIX stream socket
 * is refused, naming what it is; LISTEN_PID of another process is not
 * this daemon's (it binds socket.path itself). */
TEST(restart_socket_activation_refused)
{
    char dir[96], sock[128], log[128];
    snprintf(dir, sizeof(dir), "/tmp/kvx-sa-%d", (int)getpid());
    snprintf(sock, sizeof(sock), "%s/s.sock", dir);
    snprintf(log, sizeof(log), "%s/log", dir);
    CHECK(mkdir(dir, 0755) == 0 || errno == EEXIST);
    int udp = socket(AF_INET, SOCK_DGRAM, 0), unbound;
    unbound = socket(AF_UNIX, SOCK_STREAM, 0);
    int nul = open("/dev/null", O_RDONLY);
    CHECK(udp >= 0 && unbound >= 0 && nul >= 0);
    const struct {
        int fd;
        const char *fds, *why;
    } cases[] = {
        {udp, "1", "not an AF_UNIX socket"},
        {unbound, "1", "not listening"},
        {nul, "1", "Socket operation on non-socket"},
        {unbound, "2", "LISTEN_FDS=2; kvxferd takes exactly one socket"},
    };
    char exe[256];
    snprintf(exe, sizeof(exe), "%s/kvxferd", build_dir());
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        unlink(log);
        fflush(stderr);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            int lf = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            dup2(lf, 2);
            dup2(cases[i].fd, 3);
            char pb[24];
            snprintf(pb, sizeof(pb), "%d", (int)getpid());
            setenv("LISTEN_FDS", cases[i].fds, 1);
            setenv("LISTEN_PID", pb, 1);
            execl(exe, exe, "--socket", sock, (char *)NULL);
            _exit(127);
        }
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        char *text = read_file(log);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 1 ||
            !strstr(text, cases[i].why))
            fprintf(stderr, "case %zu: status %d, log:\n%s\n", i, st, text);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
        CHECK_STR_CONTAINS(text, cases[i].why);
        free(text);
    }
    close(udp);
    close(unbound);
    close(nul);
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    (void)!system(cmd);
}

/* ---- drain: the upgrade step ------------------------------------------ */

/* kvxferctl drain: a uid that is not an admin is refused (PERM, nothing
 * drains); with --deadline, a fetch in flight finishes (COMPLETE, every
 * byte) while new requests are refused SHUTDOWN, and the daemon exits 0
 * once nothing is left; kvxferctl says what the drain did. A new daemon
 * (the upgrade) takes the ranks back. Then an offer nobody fetches ends
 * SHUTDOWN at a short deadline, the daemon exits 0, and the next one
 * moves KV, every byte checked. */
TEST_T(restart_drain_upgrade, 90)
{
    daemon_t *d = daemon_start2("  mode: 0666\n",
                                SLOW_CFG "auth:\n  allowed_uids: [64021]\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "dr-ctx", "dr-gen", BIG_BLOCKS + 8, &c, &g, &cs, &gs);
    char out[2048], args[512];
    snprintf(args, sizeof(args), "--socket %s drain", d->sock);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "setpriv --reuid=64021 --regid=64021 --clear-groups "
             "%s/kvxferctl %s 2>&1",
             build_dir(), args);
    CHECK_EQ(cmd_run(cmd, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "permission denied");
    CHECK_STR_CONTAINS(out, "only root, the daemon's uid and members of "
                            "auth.admin_gids may drain");
    daemon_healthy(d);

    memset(g.base, 0xa5, g.size);
    uint8_t *before = malloc(g.size);
    CHECK(before != NULL);
    memcpy(before, g.base, g.size);
    uint32_t *bl = big_blocks();
    fill_req(&c, 51, bl, BIG_TOK);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 51, c.pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch(g.c, 51, p.data, p.len, g.pool, bl, BIG_BLOCKS, 0, T_MS),
        g.c);
    wait_landing(&g, 0xa5); /* under way when the drain starts */
    snprintf(args, sizeof(args), "--socket %s drain --deadline 60", d->sock);
    fflush(stderr);
    FILE *ctl = NULL;
    snprintf(cmd, sizeof(cmd), "%s/kvxferctl %s 2>&1", build_dir(), args);
    ctl = popen(cmd, "r");
    CHECK(ctl != NULL);
    CHECK(log_wait(d, "drain by uid 0: draining: 2 requests in flight", 5000));
    /* new requests are refused while it drains */
    uint32_t small[2] = {BIG_BLOCKS, BIG_BLOCKS + 1};
    kvx_context_params_t px;
    CHECK_FAILS(kvx_publish(c.c, 52, c.pool, small, 2, 8, &px, T_MS), c.c,
                KVX_ERR_SHUTDOWN, "shutting down");
    wait_event(g.c, 51, KVX_EVENT_COMPLETE, 0, 30000);
    wait_event(c.c, 51, KVX_EVENT_COMPLETE, 0, 30000);
    CHECK_EQ(check_pool_over(&g, before, 51, bl, BIG_TOK), 0);
    size_t n = fread(out, 1, sizeof(out) - 1, ctl);
    out[n] = 0;
    int st = pclose(ctl);
    fprintf(stderr, "%s", out);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK_STR_CONTAINS(out, "drained in ");
    CHECK_STR_CONTAINS(out, "2 requests were in flight, 2 finished, 0 ended "
                            "SHUTDOWN; kvxferd exits 0");
    st = daemon_wait(d, 10000);
    CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);

    /* the upgrade: a new daemon; the ranks come back */
    daemon_restart(d);
    poll_until_back(c.c, 1);
    poll_until_back(g.c, 1);
    CHECK_KVX(kvx_publish(c.c, 53, c.pool, small, 2, 8, &px, T_MS), c.c);
    snprintf(args, sizeof(args), "--socket %s drain --deadline 0.2", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    fprintf(stderr, "%s", out);
    CHECK_STR_CONTAINS(out, "1 requests were in flight, 0 finished, 1 ended "
                            "SHUTDOWN");
    ev_t e = wait_event(c.c, 53, KVX_EVENT_ERROR, KVX_ERR_SHUTDOWN, 5000);
    CHECK_STR_CONTAINS(e.msg, "daemon shutting down (drain by uid 0)");
    st = daemon_wait(d, 10000);
    CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    daemon_restart(d);
    poll_until_back(c.c, 2);
    poll_until_back(g.c, 2);
    memcpy(before, g.base, g.size);
    uint32_t cb[2] = {BIG_BLOCKS + 3, BIG_BLOCKS + 4},
             gb[2] = {BIG_BLOCKS + 5, BIG_BLOCKS + 6};
    transfer_over(&c, &g, before, 54, cb, gb, 2, 7);
    kvx_context_params_free(&p);
    kvx_context_params_free(&px);
    free(bl);
    free(before);
    rank_close(&c);
    rank_close(&g);
    /* with nothing in flight the drain is over at once: still answered */
    snprintf(args, sizeof(args), "--socket %s drain", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "0 requests were in flight");
    st = daemon_wait(d, 10000);
    CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* kvxferctl cancel KEY: a uid that is not an admin is refused (PERM, the
 * offer still offered); an admin's cancel ends an unfetched offer
 * CANCELLED at its context rank, and a fetch under way CANCELLED at its
 * generation rank, the reply coming once its copies are fenced; the
 * fetch's record says cancelled, with the bytes that had landed. An
 * unknown key or instance is NOT_FOUND, named. */
TEST_T(ctl_cancel_admin, 60)
{
    daemon_t *d = daemon_start2("  mode: 0666\n",
                                SLOW_CFG "auth:\n  allowed_uids: [64021]\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_BIG, "cn-ctx", "cn-gen", BIG_BLOCKS + 8, &c, &g, &cs, &gs);
    uint32_t small[2] = {BIG_BLOCKS, BIG_BLOCKS + 1};
    kvx_context_params_t px;
    CHECK_KVX(kvx_publish(c.c, 61, c.pool, small, 2, 8, &px, T_MS), c.c);
    char out[4096], args[512], cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "setpriv --reuid=64021 --regid=64021 --clear-groups "
             "%s/kvxferctl --socket %s cancel 61 --instance cn-ctx 2>&1",
             build_dir(), d->sock);
    CHECK_EQ(cmd_run(cmd, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "permission denied");
    CHECK_STR_CONTAINS(out, "only root, the daemon's uid and members of "
                            "auth.admin_gids may cancel");
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK_STR_CONTAINS(json, "\"key\":\"61\",\"request_id\":61,"
                             "\"side\":\"context\",\"state\":\"offered\"");
    free(json);
    /* an admin (root): the one instance that has 61 is found */
    snprintf(args, sizeof(args), "--socket %s cancel 61", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "cancelled request 61 of instance cn-ctx");
    wait_event(c.c, 61, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK(strstr(json, "\"key\":\"61\"") == NULL);
    free(json);
    CHECK(log_contains(d, "uid 0 cancels request 61 of instance cn-ctx"));
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "no request 61 in flight");
    snprintf(args, sizeof(args), "--socket %s cancel 61 --instance nope",
             d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "cancel.instance_id: no instance nope");

    /* a fetch under way, cancelled on the generation side */
    memset(g.base, 0xa5, g.size);
    uint32_t *bl = big_blocks();
    fill_req(&c, 62, bl, BIG_TOK);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 62, c.pool, bl, BIG_BLOCKS, BIG_TOK, &p, T_MS),
              c.c);
    CHECK_KVX(
        kvx_fetch(g.c, 62, p.data, p.len, g.pool, bl, BIG_BLOCKS, 0, T_MS),
        g.c);
    wait_landing(&g, 0xa5);
    snprintf(args, sizeof(args), "--socket %s cancel 62 --instance cn-gen",
             d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    wait_event(g.c, 62, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 5000);
    snprintf(args, sizeof(args), "--socket %s requests --done --json", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    fprintf(stderr, "%s", out);
    char *l = rec_line(out, "62", "generation");
    CHECK(l != NULL);
    CHECK_STR_CONTAINS(l, "\"instance\":\"cn-gen\",");
    CHECK_STR_CONTAINS(l, "\"outcome\":\"cancelled\",\"code\":\"CANCELLED\"");
    long long landed = json_num(l, "bytes");
    CHECK(landed > 0 && landed < (long long)BIG_TOK * 1024);
    free(l);
    /* its offer: read as much, ended ERROR CANCELLED by the other side */
    l = rec_line(out, "62", "context");
    CHECK(l != NULL);
    CHECK_STR_CONTAINS(l, "\"outcome\":\"error\",\"code\":\"CANCELLED\"");
    CHECK_EQ(json_num(l, "bytes"), landed);
    free(l);
    /* another uid sees none of these records */
    snprintf(cmd, sizeof(cmd),
             "setpriv --reuid=64021 --regid=64021 --clear-groups "
             "%s/kvxferctl --socket %s requests --done --json 2>&1",
             build_dir(), d->sock);
    char other[256];
    CHECK_EQ(cmd_run(cmd, other, sizeof(other)), 0);
    CHECK(!strcmp(other, "[]\n"));
    /* and 61, cancelled before anyone fetched it */
    l = rec_line(out, "61", "context");
    CHECK(l != NULL);
    CHECK_STR_CONTAINS(l, "\"bytes\":0,");
    CHECK_STR_CONTAINS(l, "\"outcome\":\"cancelled\",\"code\":\"CANCELLED\"");
    free(l);
    kvx_context_params_free(&p);
    kvx_context_params_free(&px);
    free(bl);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* ---- ranks that come back one by one ------------------------------------ */

/* The next batch of c holding an event for req: its seq, and that event
 * (kind, code, key) in *e. */
static uint64_t batch_with(kvx_client_t *c, uint64_t req, kvx_event_t *e)
{
    int64_t end = now_ms() + 10000;
    for (;;) {
        kvx_batch_t *b = NULL;
        CHECK_KVX(kvx_poll(c, 1, 2000, &b), c);
        for (uint32_t i = 0; i < b->num_events; i++)
            if (b->events[i].request_id == req) {
                *e = b->events[i];
                uint64_t seq = b->seq;
                kvx_batch_free(b);
                return seq;
            }
        kvx_batch_free(b);
        CHECK(now_ms() < end);
    }
}

/* A tp-2 context instance whose ranks reconnect at different times after
 * a restart: rank 0 is back, joined again and polling while rank 1 is
 * still away (the instance is not complete: publishes wait), then rank 1
 * comes back; the instance works: both ranks publish the same params, a
 * generation rank fetches both heads, every byte checked, and the two
 * ranks poll the same batch sequence in lockstep: the same seq with the
 * same event, twice. */
TEST_T(restart_ranks_back_one_by_one, 60)
{
    daemon_t *d = daemon_start(NULL);
    side_t cs = {.inst = "r1-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    side_t gs = {.inst = "r1-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t c0, c1, g;
    rank_hello_only(d, &M_SMALL, &cs, 0, &c0);
    rank_hello_only(d, &M_SMALL, &cs, 1, &c1);
    rank_join(&c0);
    rank_join(&c1);
    rank_pool(&c0, 16);
    rank_pool(&c1, 16);
    rank_open(d, &M_SMALL, &gs, 0, 16, &g);
    /* a transfer before, so that the batch sequence has moved */
    uint32_t cb[2] = {9, 5}, gb[2] = {7, 0};
    kvx_context_params_t q0, q1;
    for (int round = 0; round < 2; round++) {
        uint64_t req = 60 + (uint64_t)round;
        uint8_t *before = malloc(g.size);
        CHECK(before != NULL);
        memcpy(before, g.base, g.size);
        fill_req(&c0, req, cb, 7);
        fill_req(&c1, req, cb, 7);
        CHECK_KVX(kvx_publish(c0.c, req, c0.pool, cb, 2, 7, &q0, T_MS), c0.c);
        CHECK_KVX(kvx_publish(c1.c, req, c1.pool, cb, 2, 7, &q1, T_MS), c1.c);
        CHECK_EQ(q0.len, q1.len);
        CHECK(!memcmp(q0.data, q1.data, q0.len));
        CHECK_KVX(kvx_fetch(g.c, req, q0.data, q0.len, g.pool, gb, 2, 0, T_MS),
                  g.c);
        wait_event(g.c, req, KVX_EVENT_COMPLETE, 0, 10000);
        kvx_event_t e0, e1;
        uint64_t s0 = batch_with(c0.c, req, &e0);
        uint64_t s1 = batch_with(c1.c, req, &e1);
        CHECK_EQ(s0, s1); /* lockstep: the same batch on both ranks */
        CHECK_EQ(e0.kind, KVX_EVENT_COMPLETE);
        CHECK_EQ(e1.kind, KVX_EVENT_COMPLETE);
        CHECK_EQ(check_pool_over(&g, before, req, gb, 7), 0);
        free(before);
        kvx_context_params_free(&q0);
        kvx_context_params_free(&q1);
        if (round == 1)
            break;
        daemon_kill9(d);
        kvx_batch_t *b;
        CHECK_FAILS(kvx_poll(c1.c, 0, 0, &b), c1.c, KVX_ERR_CLOSED,
                    "kvxferd went away");
        daemon_restart(d);
        /* rank 0 first; rank 1 stays away a while */
        poll_until_back(c0.c, 1);
        poll_until_back(g.c, 1);
        kvx_context_params_t px;
        CHECK_FAILS(kvx_publish(c0.c, 70, c0.pool, cb, 2, 7, &px, T_MS), c0.c,
                    KVX_ERR_STATE, "");
        fprintf(stderr, "publish with rank 1 away: %s\n", kvx_last_error(c0.c));
        for (int i = 0; i < 5; i++) { /* rank 0 polls meanwhile */
            kvx_batch_t *nb = NULL;
            int rc = kvx_poll(c0.c, 0, 50, &nb);
            CHECK(rc == 0 || rc == KVX_ERR_TIMEOUT);
            if (!rc) {
                CHECK_EQ(nb->num_events, 0);
                kvx_batch_free(nb);
            }
        }
        poll_until_back(c1.c, 1);
    }
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
    daemon_stop_ok(d);
}
