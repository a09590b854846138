/*
 * t_upgrade.c — two daemons across a restart, an upgrade or a secret
 * rotation of one of them: the peer's restart is noticed by the boot id
 * of its handshake, params of its earlier run are refused by that cause,
 * and the cluster secret rotates by reload without a restart.
 */

/* Write secret into daemon side's secret file (mode 0600), as p_daemon()
 * does. */
static void up_secret(int side, const char *secret)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/secret-%c", p_net.dir, "AB"[side]);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, secret, strlen(secret)) == (ssize_t)strlen(secret));
    CHECK(close(fd) == 0);
}

/* SIGHUP d and wait for what its log then says (the n-th time). */
static void up_hup(daemon_t *d, const char *what, int n)
{
    CHECK(kill(d->pid, SIGHUP) == 0);
    int64_t end = now_ms() + 5000;
    for (;;) {
        char *t = read_file(d->log);
        int k = 0;
        for (const char *p = t; (p = strstr(p, what)); p++)
            k++;
        free(t);
        if (k >= n)
            return;
        CHECK(now_ms() < end);
        sleep_ms(10);
    }
}

/* One request from c to g that fails: the generation side's event is
 * ERROR AUTH, and nothing lands. */
static void up_refused(rank_t *c, rank_t *g, uint64_t req)
{
    uint32_t bl[2] = {2, 3};
    memset(g->base, 0xa5, g->size);
    fill_req(c, req, bl, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c->c, req, c->pool, bl, 2, 8, &p, T_MS), c->c);
    CHECK_KVX(kvx_fetch(g->c, req, p.data, p.len, g->pool, bl, 2, 0, T_MS),
              g->c);
    ev_t e = wait_event(g->c, req, KVX_EVENT_ERROR, KVX_ERR_AUTH, 8000);
    CHECK_STR_CONTAINS(e.msg, "authentication");
    CHECK_EQ(check_pool(g, NULL, 0, 0xa5), 0);
    CHECK_KVX(kvx_cancel(c->c, req, T_MS), c->c);
    wait_event(c->c, req, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 3000);
    kvx_context_params_free(&p);
}

#define UP_S1 "kvxfer-rotation-secret-number-one-0001"
#define UP_S2 "kvxfer-rotation-secret-number-two-0002"
/* the window: long enough for the transfers in it */
#define UP_WINDOW "  secret_previous_ms: 6000\n"

/* A rotates its secret (file, SIGHUP) while B runs on the old one: in
 * the window both ways work (A dialled by B, A dialling B), over new
 * handshakes; B rotates; once the windows are over, a daemon on the old
 * secret is refused, one on the new one is not. No restart of A. */
TEST_T(upgrade_secret_rotation, 90)
{
    p_setup();
    daemon_t *a = p_daemon(0, UP_S1, UP_WINDOW, NULL);
    daemon_t *b = p_daemon(1, UP_S1, UP_WINDOW, NULL);
    side_t cs, gs, cs2, gs2;
    rank_t c, g, c2, g2;
    /* A serves rs-ctx to B's rs-gen; B serves rs-ctx2 to A's rs-gen2 */
    p_pair(a, b, &cs, &gs, "rs-ctx", "rs-gen", &c, &g);
    p_pair(b, a, &cs2, &gs2, "rs-ctx2", "rs-gen2", &c2, &g2);
    /* no transfer yet: the first handshakes come after the rotation */
    up_secret(0, UP_S2);
    up_hup(a, "peer: reload: a new secret", 1);
    uint32_t cb[2] = {0, 1}, gb[2] = {4, 5};
    p_one(&c, &g, 1, cb, gb, 2, 7, 8000);   /* B dials A */
    p_one(&c2, &g2, 2, cb, gb, 2, 7, 8000); /* A dials B */
    CHECK(!log_contains(a, "authentication failed"));
    CHECK(!log_contains(b, "authentication failed"));
    up_secret(1, UP_S2);
    up_hup(b, "peer: reload: a new secret", 1);
    p_one(&c, &g, 3, cb, gb, 2, 7, 8000);
    /* the windows end: each daemon says so */
    CHECK(log_wait(a, "previous secret's window is over", 15000));
    CHECK(log_wait(b, "previous secret's window is over", 15000));
    /* a B on the old secret (a new process: new handshakes) is refused;
     * on the new one it works */
    rank_close(&g);
    rank_close(&c2);
    CHECK(kill(b->pid, SIGKILL) == 0);
    CHECK(daemon_wait(b, 5000) != -1);
    up_secret(1, UP_S1);
    h_netns = p_net.netns ? p_net.ns[1] : NULL;
    daemon_restart(b);
    h_netns = NULL;
    rank_open(b, &M_SMALL, &gs, 0, 8, &g);
    up_refused(&c, &g, 4);
    CHECK(log_wait(a, "wrong cluster secret", 5000));
    rank_close(&g);
    CHECK(kill(b->pid, SIGKILL) == 0);
    CHECK(daemon_wait(b, 5000) != -1);
    up_secret(1, UP_S2);
    h_netns = p_net.netns ? p_net.ns[1] : NULL;
    daemon_restart(b);
    h_netns = NULL;
    rank_open(b, &M_SMALL, &gs, 0, 8, &g);
    p_one(&c, &g, 5, cb, gb, 2, 7, 8000);
    rank_close(&c);
    rank_close(&g);
    rank_close(&g2);
    p_stop_both(a, b);
}

/* ---- a peer daemon restarted ------------------------------------------ */

/* d's peer.listen from port 0 to the port it got (rank r's address), so
 * that a restart listens where its earlier run did, as a configured
 * daemon does. */
static void up_fix_port(daemon_t *d, const rank_t *r)
{
    const char *colon = strrchr(r->addr, ':'), *slash = strrchr(r->addr, '/');
    CHECK(colon && slash && slash > colon);
    char port[16];
    snprintf(port, sizeof(port), "%.*s", (int)(slash - colon - 1), colon + 1);
    char *cfg = read_file(d->cfg);
    char *at = strstr(cfg, ":0\"\n");
    CHECK(at != NULL);
    char out[4096];
    snprintf(out, sizeof(out), "%.*s:%s%s", (int)(at - cfg), cfg, port, at + 2);
    write_file(d->cfg, out);
    free(cfg);
}

/* Restart daemon side (killed, reaped) in its namespace. */
static void up_restart(daemon_t *d, int side)
{
    h_netns = p_net.netns ? p_net.ns[side] : NULL;
    daemon_restart(d);
    h_netns = NULL;
}

/* Daemon A (context) killed mid-transfer and started again on the same
 * IP:PORT under a new boot id, with a keep-alive of a minute: its
 * context rank gets its requests back PEER_GONE from the library,
 * reconnects, and publishes again; B's generation rank fetches that from
 * A's new run. B's requests with the earlier run each end once,
 * PEER_GONE (whoever noticed first: UCX's endpoint error here, where
 * the kill's resets reach B; else the handshake with the new run, which
 * names the restart); the new request moves, every byte checked; and B,
 * given params of A's earlier run, dials that address, finds the new run
 * there and refuses them naming the earlier run, instead of asking the
 * new run for an offer it never had. */
TEST_T(upgrade_peer_restart_noticed, 120)
{
    p_ka_timeout_ms = 60000;
    pl_gen_preset = "vllm-nhd";
    pl_t *x = pl_start();
    up_fix_port(x->a, &x->c);
    char old_a[192];
    snprintf(old_a, sizeof(old_a), "%s", x->c.addr);
    CHECK(kill(x->a->pid, SIGKILL) == 0);
    CHECK(daemon_wait(x->a, 5000) != -1);
    int64_t t_kill = now_ms();
    /* the context rank's requests end in the library */
    kvx_batch_t *b = NULL;
    CHECK_KVX(kvx_poll(x->c.c, 1, 5000, &b), x->c.c);
    CHECK_EQ(b->num_events, PL_REQ);
    kvx_batch_free(b);
    up_restart(x->a, 0);
    poll_until_back(x->c.c, 1);
    char new_a[192];
    CHECK_KVX(kvx_daemon_address(x->c.c, new_a, sizeof(new_a)), x->c.c);
    CHECK(strcmp(old_a, new_a) != 0);
    /* a new offer on A's new run, fetched by B: B dials the new run */
    /* the warm-up's blocks on B: no old request writes them */
    uint32_t cb[2] = {0, 1}, gb[2] = {PL_REQ * PL_NB + 2, PL_REQ * PL_NB + 3};
    fill_req(&x->c, 900, cb, 2 * PL_TPB);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(x->c.c, 900, x->c.pool, cb, 2, 2 * PL_TPB, &p, T_MS),
              x->c.c);
    /* B's old requests: each ends once, PEER_GONE naming the restart, well
     * before the keep-alive (60 s); the new one completes */
    int n = 0, gone = 0, done900 = 0;
    int64_t end = now_ms() + 20000;
    int fetched = 0;
    while ((n < (int)PL_REQ || !done900) && now_ms() < end) {
        if (!fetched) {
            /* once B's rank may fetch again (its old fetches of those
             * blocks end first, or it would write them twice) */
            fetched = 1;
            CHECK_KVX(kvx_fetch(x->g.c, 900, p.data, p.len, x->g.pool, gb, 2, 0,
                                T_MS),
                      x->g.c);
        }
        ev_t e[PL_REQ + 16];
        int k = collect(x->g.c, e, PL_REQ + 16, 1, 500);
        for (int i = 0; i < k && i < (int)PL_REQ + 16; i++) {
            if (e[i].req == 900) {
                CHECK_EQ(e[i].kind, KVX_EVENT_COMPLETE);
                done900 = 1;
                continue;
            }
            CHECK(n < (int)PL_REQ);
            n++;
            if (e[i].kind == KVX_EVENT_ERROR) {
                CHECK_EQ(e[i].code, KVX_ERR_PEER_GONE);
                if (!gone)
                    fprintf(stderr, "request %llu: \"%s\"\n",
                            (unsigned long long)e[i].req, e[i].msg);
                gone++;
            } else {
                CHECK_EQ(e[i].kind, KVX_EVENT_COMPLETE);
            }
        }
    }
    fprintf(stderr,
            "B: %d of %u old requests ended (%d PEER_GONE) %lld ms after "
            "A's kill; the new one %s\n",
            n, PL_REQ, gone, (long long)(now_ms() - t_kill),
            done900 ? "completed" : "did not complete");
    CHECK_EQ(n, PL_REQ);
    CHECK(gone > 0);
    CHECK(done900);
    CHECK_EQ(p_check_req(&x->g, 900, gb, 2 * PL_TPB, 0), 0);
    kvx_context_params_free(&p);
    /* params of A's earlier run, given to B: refused by that cause */
    memset(x->g.base, 0xa5, x->g.size);
    CHECK_KVX(kvx_fetch(x->g.c, 901, x->p[0].data, x->p[0].len, x->g.pool,
                        x->gb[0], PL_NB, 0, T_MS),
              x->g.c);
    ev_t e = wait_event(x->g.c, 901, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 8000);
    CHECK_STR_CONTAINS(e.msg, "issued by an earlier run of that daemon");
    CHECK_STR_CONTAINS(e.msg, strrchr(old_a, '/') + 1);
    CHECK_EQ(check_pool(&x->g, NULL, 0, 0xa5), 0); /* nothing landed */
    pl_finish(x);
}
