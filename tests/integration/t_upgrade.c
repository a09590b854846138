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
