/*
 * t_pace.c — the GPU pace an engine sets (GpuPace, kvx_gpu_pace, 2.8):
 * what the CPU build shows of it, the status's "gpu" string and the
 * metrics: each rank's pace recorded (a rank with no GPU pool), the
 * lowest of the engines' beside gpu.pace (and a reload of it), its
 * lapse after hold_ms, its end with the rank's session or a withdrawal,
 * the bounds, a reconnection that sets it again (and not a lapsed one),
 * and KVX_ERR_VERSION from a daemon before 2.8. The pace of a GPU's
 * lane itself (held chunks) is tests/gpu/gpu.c's gpu_engine_pace.
 */

static const side_t PACE_SIDE = {.inst = "pace-gen",
                                 .role = KVX_ROLE_GENERATION,
                                 .tp = 2,
                                 .pp = 1,
                                 .preset = "vllm-nhd",
                                 .tpb = 4};

/* The pace part of the status's "gpu" string ("gpu pace: ..."), in
 * out; "" when the status has none. */
static void pace_status(daemon_t *d, char *out, size_t cap)
{
    char *st = status_json(d);
    const char *p = strstr(st, "gpu pace: ");
    size_t n = 0;
    if (p)
        while (p[n] && p[n] != '"' && n < cap - 1)
            n++;
    memcpy(out, p ? p : "", n);
    out[n] = 0;
    free(st);
}

/* Wait until the pace part of d's status contains want (NULL: until it
 * has no engines), within 10 s. */
static void pace_wait_for(daemon_t *d, const char *want)
{
    char st[1024];
    int64_t end = now_ms() + 10000;
    for (;;) {
        pace_status(d, st, sizeof(st));
        if (want ? strstr(st, want) != NULL : !strstr(st, "engines"))
            return;
        if (now_ms() > end)
            fprintf(stderr, "status: '%s', waiting for '%s'\n", st,
                    want ? want : "(no engines)");
        CHECK(now_ms() <= end);
        sleep_ms(20);
    }
}

/* The value of metric line name (e.g. "kvxfer_gpu_pace_sessions") in
 * d's metrics; -1 when it is not there. */
static long long pace_metric(daemon_t *d, const char *name)
{
    static char out[1 << 17];
    char args[256], pat[128];
    snprintf(args, sizeof(args), "--socket %s metrics", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    snprintf(pat, sizeof(pat), "\n%s ", name);
    const char *p = strstr(out, pat);
    return p ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

/* A rank's pace is recorded though it has no GPU pool yet (reply 0):
 * the status names it, the metric counts it; it lapses hold_ms after
 * the call, and calling again keeps it. */
TEST_T(gpu_pace_recorded_and_lapses, 30)
{
    daemon_t *d = daemon_start("");
    rank_t r;
    rank_hello_only(d, &M_SMALL, &PACE_SIDE, 0, &r);
    char st[1024];
    pace_status(d, st, sizeof(st));
    CHECK_EQ(st[0], 0); /* no pace: the status says nothing of it */
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_pace_sessions"), 0);
    char *js = status_json(d);
    CHECK(strstr(js, "paced:") == NULL);
    free(js);

    CHECK_KVX(kvx_gpu_pace(r.c, 512 << 20, 3000, T_MS), r.c);
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "gpu pace: engines 1 (lowest 536870912 B/ms, 1 "
                           "without a GPU pool)");
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_pace_sessions"), 1);
    /* called again, with a short hold: it lapses at that one's end */
    CHECK_KVX(kvx_gpu_pace(r.c, 1000, 300, T_MS), r.c);
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "engines 1 (lowest 1000 B/ms");
    pace_wait_for(d, NULL);
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_pace_sessions"), 0);
    /* and set again after its lapse */
    CHECK_KVX(kvx_gpu_pace(r.c, 2000, 0, T_MS), r.c);
    pace_wait_for(d, "engines 1 (lowest 2000 B/ms");
    kvx_close(r.c);
    daemon_stop_ok(d);
}

/* hold_ms 0 holds until withdrawn (bytes_per_ms 0) or the session ends. */
TEST_T(gpu_pace_withdrawn_and_ends_with_session, 30)
{
    daemon_t *d = daemon_start("");
    rank_t r;
    rank_hello_only(d, &M_SMALL, &PACE_SIDE, 0, &r);
    CHECK_KVX(kvx_gpu_pace(r.c, 4096, 0, T_MS), r.c);
    sleep_ms(400);
    char st[1024];
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "engines 1 (lowest 4096 B/ms");
    CHECK_KVX(kvx_gpu_pace(r.c, 0, 0, T_MS), r.c); /* withdrawn */
    pace_status(d, st, sizeof(st));
    CHECK_EQ(st[0], 0);
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_pace_sessions"), 0);
    CHECK_KVX(kvx_gpu_pace(r.c, 0, 0, T_MS), r.c); /* none: still 0 */
    CHECK_KVX(kvx_gpu_pace(r.c, 4096, 0, T_MS), r.c);
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_pace_sessions"), 1);
    kvx_close(r.c); /* the session ends: its pace with it */
    pace_wait_for(d, NULL);
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_pace_sessions"), 0);
    daemon_stop_ok(d);
}

/* Two ranks: the lowest of their paces, beside gpu.pace; a reload of
 * gpu.pace keeps the engines' paces. */
TEST_T(gpu_pace_lowest_with_config, 30)
{
    daemon_t *d = daemon_start("gpu:\n  pace: 1MiB\n");
    rank_t a, b;
    rank_hello_only(d, &M_SMALL, &PACE_SIDE, 0, &a);
    rank_hello_only(d, &M_SMALL, &PACE_SIDE, 1, &b);
    char st[1024];
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "gpu pace: config 1048576 B/ms");
    CHECK(strstr(st, "engines") == NULL);
    CHECK_KVX(kvx_gpu_pace(a.c, 8192, 0, T_MS), a.c);
    CHECK_KVX(kvx_gpu_pace(b.c, 1000, 0, T_MS), b.c);
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "gpu pace: config 1048576 B/ms, engines 2 "
                           "(lowest 1000 B/ms, 2 without a GPU pool)");
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_pace_sessions"), 2);
    CHECK_KVX(kvx_gpu_pace(b.c, 0, 0, T_MS), b.c);
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "engines 1 (lowest 8192 B/ms");

    char cfg[512];
    snprintf(cfg, sizeof(cfg), "socket:\n  path: %s\ngpu:\n  pace: 2048\n",
             d->sock);
    write_file(d->cfg, cfg);
    int before = log_count(d, "reloaded");
    kill(d->pid, SIGHUP);
    CHECK(log_wait_more(d, "reloaded", before, 3000));
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "gpu pace: config 2048 B/ms, engines 1 (lowest "
                           "8192 B/ms");
    kvx_close(a.c);
    kvx_close(b.c);
    daemon_stop_ok(d);
}

/* bytes_per_ms at most 1 TiB, hold_ms at most 60000: else INVALID naming
 * the field, and the pace unchanged; only a rank (after Hello) sets one. */
TEST_T(gpu_pace_bounds, 30)
{
    daemon_t *d = daemon_start("");
    rank_t r;
    rank_hello_only(d, &M_SMALL, &PACE_SIDE, 0, &r);
    CHECK_KVX(kvx_gpu_pace(r.c, 1000, 0, T_MS), r.c);
    CHECK_FAILS(kvx_gpu_pace(r.c, (1ull << 40) + 1, 0, T_MS), r.c,
                KVX_ERR_INVALID, "gpu_pace.bytes_per_ms");
    CHECK_FAILS(kvx_gpu_pace(r.c, 5000, 60001, T_MS), r.c, KVX_ERR_INVALID,
                "gpu_pace.hold_ms");
    char st[1024];
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "engines 1 (lowest 1000 B/ms");
    CHECK_KVX(kvx_gpu_pace(r.c, 1ull << 40, 60000, T_MS), r.c);
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "engines 1 (lowest 1099511627776 B/ms");

    kvx_client_t *o;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &o), 0);
    CHECK_FAILS(kvx_gpu_pace(o, 1000, 0, T_MS), o, KVX_ERR_STATE,
                "say hello first");
    kvx_close(o);
    kvx_close(r.c);
    daemon_stop_ok(d);
}

/* The daemon killed and started again: the library sets the last pace
 * again as it reconnects (hold 0: all of it); a pace that lapsed before
 * the restart is not set again. */
TEST_T(gpu_pace_reconnect_sets_again, 60)
{
    daemon_t *d = daemon_start("");
    rank_t a, b;
    rank_hello_only(d, &M_SMALL, &PACE_SIDE, 0, &a);
    rank_hello_only(d, &M_SMALL, &PACE_SIDE, 1, &b);
    CHECK_KVX(kvx_gpu_pace(a.c, 7000, 0, T_MS), a.c);
    CHECK_KVX(kvx_gpu_pace(b.c, 3000, 200, T_MS), b.c);
    pace_wait_for(d, "engines 1 (lowest 7000 B/ms"); /* b's lapsed */
    daemon_kill9(d);
    daemon_restart(d);
    /* the first call after the restart reconnects each: a poll, which
     * sets no pace of its own */
    int64_t end = now_ms() + 10000;
    rank_t *rs[2] = {&a, &b};
    for (int i = 0; i < 2; i++) {
        kvx_batch_t *bt = NULL;
        while (kvx_poll(rs[i]->c, 0, 0, &bt) == KVX_ERR_CLOSED) {
            CHECK(now_ms() < end);
            sleep_ms(10);
        }
        kvx_batch_free(bt);
        CHECK_EQ(state_of(rs[i]->c).status, KVX_CLIENT_CONNECTED);
    }
    char st[1024];
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "gpu pace: engines 1 (lowest 7000 B/ms");
    /* b's call after the reconnection sets its own */
    CHECK_KVX(kvx_gpu_pace(b.c, 3000, 0, T_MS), b.c);
    pace_status(d, st, sizeof(st));
    CHECK_STR_CONTAINS(st, "gpu pace: engines 2 (lowest 3000 B/ms");
    kvx_close(a.c);
    kvx_close(b.c);
    daemon_stop_ok(d);
}

/* While the daemon drains (Drain.deadline_ms), the fetches it lets
 * finish still copy on the engines' GPUs: a rank sets, renews and
 * withdraws its pace then as before (the status says it), where other
 * new requests are refused SHUTDOWN. */
TEST_T(gpu_pace_while_draining, 60)
{
    daemon_t *d = daemon_start("");
    rank_t c, g;
    FILE *ctl = drain_with_offer(d, "pd-ctx", "pd-gen", &c, &g);
    uint32_t bl[2] = {0, 1};
    kvx_context_params_t p;
    CHECK_FAILS(kvx_publish(c.c, 72, c.pool, bl, 2, 8, &p, T_MS), c.c,
                KVX_ERR_SHUTDOWN, "shutting down");
    CHECK_KVX(kvx_gpu_pace(g.c, 6000, 2000, T_MS), g.c);
    char *js; /* the daemon takes no new connection: asked on c's */
    CHECK_KVX(kvx_status_json(c.c, &js, T_MS), c.c);
    CHECK_STR_CONTAINS(js, "gpu pace: engines 1 (lowest 6000 B/ms");
    free(js);
    CHECK_KVX(kvx_gpu_pace(g.c, 0, 0, T_MS), g.c);
    CHECK_KVX(kvx_status_json(c.c, &js, T_MS), c.c);
    CHECK(strstr(js, "gpu pace") == NULL);
    free(js);
    pclose(ctl);
    int s = daemon_wait(d, 10000);
    CHECK(s != -1 && WIFEXITED(s) && WEXITSTATUS(s) == 0);
    rank_close(&c);
    rank_close(&g);
}

/* A stand-in daemon of protocol 2.7 at path: it answers the Hello of one
 * client, then reads and answers nothing until the client goes. */
static void old_daemon_main(void *arg)
{
    int lfd = *(int *)arg;
    int fd = accept(lfd, NULL, NULL);
    CHECK(fd >= 0);
    uint8_t h[4], buf[4096];
    CHECK(raw_read(fd, h, 4, 5000));
    uint32_t len = (uint32_t)h[0] | (uint32_t)h[1] << 8;
    CHECK(len < sizeof(buf) && raw_read(fd, buf, len, 5000));
    Kvxfer__Request *rq = kvxfer__request__unpack(NULL, len, buf);
    CHECK(rq != NULL && rq->body_case == KVXFER__REQUEST__BODY_HELLO);
    Kvxfer__HelloReply hr = KVXFER__HELLO_REPLY__INIT;
    hr.version_major = KVX_PROTOCOL_MAJOR;
    hr.version_minor = 7;
    hr.session_id = 1;
    hr.daemon_address = "kvx://old/0000000000000001";
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_HELLO;
    r.hello = &hr;
    size_t n = kvxfer__reply__get_packed_size(&r);
    CHECK(n < sizeof(buf));
    kvxfer__reply__pack(&r, buf);
    raw_send_len(fd, (uint32_t)n);
    raw_send(fd, buf, n);
    kvxfer__request__free_unpacked(rq, NULL);
    while (recv(fd, buf, sizeof(buf), 0) > 0) /* until the client goes */
        ;
    close(fd);
    _exit(0);
}

/* A daemon before 2.8 (said at Hello): KVX_ERR_VERSION, nothing sent. */
TEST_T(gpu_pace_old_daemon, 30)
{
    h_init();
    char path[108];
    snprintf(path, sizeof(path), "/tmp/kvx-it-old-%d.sock", (int)getpid());
    unlink(path);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(lfd >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, path, strlen(path) + 1);
    CHECK(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    CHECK(listen(lfd, 4) == 0);
    pid_t pid = spawn(old_daemon_main, &lfd);
    close(lfd);
    rank_t r;
    memset(&r, 0, sizeof(r));
    r.m = &M_SMALL;
    r.s = &PACE_SIDE;
    kvx_hello_t hh = rank_hello(&r);
    kvx_client_t *c;
    CHECK_EQ(kvx_connect(path, &hh, T_MS, &c), 0);
    CHECK_FAILS(kvx_gpu_pace(c, 1000, 0, T_MS), c, KVX_ERR_VERSION,
                "kvx_gpu_pace: the daemon speaks protocol 2.7; a GPU pace "
                "needs 2.8");
    kvx_close(c);
    CHECK(wait_children(&pid, 1, 5000));
    unlink(path);
}

/* The GPU's metrics in a daemon with no GPU pool: launches by path and
 * the copy engines' copies, all 0; no device, so no kvxfer_gpu_mps line
 * (a GPU test checks the status's MPS word on a GPU). */
TEST_T(gpu_metrics_without_a_gpu_pool, 30)
{
    daemon_t *d = daemon_start("");
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_launches_total{path=\"kernel\"}"), 0);
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_launches_total{path=\"dma\"}"), 0);
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_dma_copies_total"), 0);
    CHECK_EQ(pace_metric(d, "kvxfer_gpu_mps{device=\"0\"}"), -1);
    char args[256];
    static char out[1 << 17];
    snprintf(args, sizeof(args), "--socket %s metrics", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "# TYPE kvxfer_gpu_mps gauge");
    daemon_stop_ok(d);
}
