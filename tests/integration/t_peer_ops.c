/*
 * t_peer_ops.c — two daemons as an operator sees them: bad peer
 * configuration refused, the loop idle once transfers are done
 * (peer.busy_poll), kvxfer-bench across two daemons it spawns, and what
 * status says of peers.
 */

/* Bad peer configuration is refused with a message naming the problem:
 * by --check-config, and by a daemon at start (the secret file). */
TEST(peer_config_errors)
{
    h_init();
    char dir[64], cfg[128], sec[128], cmd[512];
    snprintf(dir, sizeof(dir), "/tmp/kvx-pcfg-%d", (int)getpid());
    snprintf(cfg, sizeof(cfg), "%s/k.yaml", dir);
    snprintf(sec, sizeof(sec), "%s/secret", dir);
    snprintf(cmd, sizeof(cmd), "rm -rf %s; mkdir -p %s", dir, dir);
    CHECK(system(cmd) == 0);
    static const struct {
        const char *peer, *want;
    } cases[] = {
        {"  listen: \"127.0.0.1:0\"\n", "needs peer.secret_file"},
        {"  listen: \"0.0.0.0:7000\"\n  secret_file: /x\n", "not 0.0.0.0"},
        {"  listen: \"127.0.0.1\"\n  secret_file: /x\n", "is not IP:PORT"},
        {"  listen: \"127.0.0.1:70000\"\n  secret_file: /x\n",
         "port must be 0..65535"},
        {"  keepalive_interval_ms: 5000\n  keepalive_timeout_ms: 1000\n",
         "is not below peer.keepalive_timeout_ms"},
        {"  slots: 1\n", "peer.slots"},
        {"  ucx_ports: \"9000-8000\"\n", "is not LO-HI"},
        {"  ucx_ports: \"1-70000\"\n", "is not LO-HI"},
        {"  allowed: \"10.0.0.0/33\"\n", "'10.0.0.0/33' is not an IP"},
        {"  allowed: \"10.0.0.0/8,example.com\"\n",
         "'example.com' is not an IP"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char text[512];
        snprintf(text, sizeof(text), "peer:\n%s", cases[i].peer);
        write_file(cfg, text);
        snprintf(cmd, sizeof(cmd),
                 "%s/kvxferd --check-config --config %s "
                 "2>&1",
                 build_dir(), cfg);
        FILE *f = popen(cmd, "r");
        CHECK(f != NULL);
        char out[2048] = "";
        size_t n = fread(out, 1, sizeof(out) - 1, f);
        out[n] = 0;
        CHECK(pclose(f) != 0);
        CHECK_STR_CONTAINS(out, cases[i].want);
    }
    /* the secret: readable by others, or too short, stops the daemon */
    static const struct {
        const char *content;
        int mode;
        const char *want;
    } secrets[] = {
        {"0123456789abcdef0123", 0644, "gives group or others access"},
        {"short", 0600, "the secret needs 16 to 4096"},
        {NULL, 0600, "holds over 4096 bytes"}, /* 5000 bytes */
    };
    for (size_t i = 0; i < sizeof(secrets) / sizeof(secrets[0]); i++) {
        if (secrets[i].content) {
            write_file(sec, secrets[i].content);
        } else {
            char big[5001];
            memset(big, 'k', 5000);
            big[5000] = 0;
            write_file(sec, big);
        }
        CHECK(chmod(sec, secrets[i].mode) == 0);
        char text[512];
        snprintf(text, sizeof(text),
                 "socket:\n  path: %s/s.sock\npeer:\n  listen: "
                 "\"127.0.0.1:0\"\n  secret_file: %s\n",
                 dir, sec);
        write_file(cfg, text);
        snprintf(cmd, sizeof(cmd), "timeout 10 %s/kvxferd --config %s 2>&1",
                 build_dir(), cfg);
        FILE *f = popen(cmd, "r");
        CHECK(f != NULL);
        char out[4096] = "";
        size_t n = fread(out, 1, sizeof(out) - 1, f);
        out[n] = 0;
        int st = pclose(f);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
        CHECK_STR_CONTAINS(out, secrets[i].want);
    }
    /* a UCX whose worker addresses it cannot read: refused at start,
     * once, not peer by peer (KVXFERD_FAULT own_addr: its own address
     * checked a byte short) */
    write_file(sec, "0123456789abcdef0123");
    CHECK(chmod(sec, 0600) == 0);
    snprintf(cmd, sizeof(cmd),
             "KVXFERD_FAULT=own_addr:1 timeout 10 %s/kvxferd --config %s 2>&1",
             build_dir(), cfg);
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    char out[4096] = "";
    size_t n = fread(out, 1, sizeof(out) - 1, f);
    out[n] = 0;
    int st = pclose(f);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    CHECK_STR_CONTAINS(out, "cannot read its own worker address");
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

/* peer.secret_file as a bare name is a credential: the file of that name
 * in $CREDENTIALS_DIRECTORY (systemd's LoadCredential=). Read from there,
 * the daemon starts; without the variable, or with a short credential,
 * it stops naming what is wrong; a relative path is refused by
 * --check-config. */
TEST(peer_secret_credential)
{
    h_init();
    char dir[64], cred[128], cfg[128], cmd[512], out[4096];
    snprintf(dir, sizeof(dir), "/tmp/kvx-cred-%d", (int)getpid());
    snprintf(cred, sizeof(cred), "%s/cluster", dir);
    snprintf(cfg, sizeof(cfg), "%s/k.yaml", dir);
    snprintf(cmd, sizeof(cmd), "rm -rf %s; mkdir -p %s", dir, dir);
    CHECK(system(cmd) == 0);
    write_file(cred, "0123456789abcdef0123");
    CHECK(chmod(cred, 0400) == 0); /* as systemd leaves it */

    /* started with the credential: it listens for peers */
    CHECK(setenv("CREDENTIALS_DIRECTORY", dir, 1) == 0);
    daemon_t *d = daemon_start2(
        NULL, "peer:\n  listen: \"127.0.0.1:0\"\n  secret_file: cluster\n");
    CHECK(unsetenv("CREDENTIALS_DIRECTORY") == 0);
    char *json = status_json(d);
    CHECK_STR_CONTAINS(json, "127.0.0.1:");
    free(json);
    daemon_stop_ok(d);

    /* start: no $CREDENTIALS_DIRECTORY, then a credential too short */
    static const struct {
        const char *env, *content, *want;
    } cases[] = {
        {"", NULL,
         "peer.secret_file: \"cluster\" names a credential, and "
         "$CREDENTIALS_DIRECTORY is not set"},
        {"CREDENTIALS_DIRECTORY=%s ", "short", "/cluster holds 5 bytes"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char env[128], text[512];
        if (cases[i].content) {
            CHECK(chmod(cred, 0600) == 0);
            write_file(cred, cases[i].content);
            CHECK(chmod(cred, 0400) == 0);
        }
        snprintf(env, sizeof(env), cases[i].env, dir);
        snprintf(text, sizeof(text),
                 "socket:\n  path: %s/s.sock\npeer:\n  listen: "
                 "\"127.0.0.1:0\"\n  secret_file: cluster\n",
                 dir);
        write_file(cfg, text);
        snprintf(cmd, sizeof(cmd),
                 "env -u CREDENTIALS_DIRECTORY %stimeout 10 %s/kvxferd "
                 "--config %s 2>&1",
                 env, build_dir(), cfg);
        FILE *f = popen(cmd, "r");
        CHECK(f != NULL);
        size_t n = fread(out, 1, sizeof(out) - 1, f);
        out[n] = 0;
        int st = pclose(f);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
        CHECK_STR_CONTAINS(out, cases[i].want);
    }

    /* a relative path is not a credential's name */
    write_file(cfg, "peer:\n  listen: \"127.0.0.1:0\"\n  secret_file: "
                    "etc/secret\n");
    snprintf(cmd, sizeof(cmd), "%s/kvxferd --check-config --config %s 2>&1",
             build_dir(), cfg);
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    size_t n = fread(out, 1, sizeof(out) - 1, f);
    out[n] = 0;
    CHECK(pclose(f) != 0);
    CHECK_STR_CONTAINS(out, "'etc/secret' is neither an absolute path nor "
                            "a credential name");
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

/* ---- status and CPU --------------------------------------------------- */

/* With peer.busy_poll 1 the loop polls UCX every turn while transfers
 * are in flight; once they are done both daemons sleep again: over two
 * idle seconds (keep-alives every 200 ms included) each uses a small
 * fraction of a CPU, where a spinning loop would use two seconds. */
TEST_T(peer_idle_does_not_spin, 60)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, "  busy_poll: 1\n", NULL);
    daemon_t *b = p_daemon(1, P_SECRET, "  busy_poll: 1\n", NULL);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pidle-ctx", "pidle-gen", &c, &g);
    uint32_t cb[4] = {0, 1, 2, 3}, gb[4] = {4, 5, 6, 7};
    for (uint64_t req = 1; req <= 4; req++)
        p_one(&c, &g, req, cb, gb, 4, 16, 5000);
    usleep(300 * 1000); /* the last completions and releases */
    double a0 = cpu_seconds(a->pid), b0 = cpu_seconds(b->pid);
    usleep(2000 * 1000);
    double da = cpu_seconds(a->pid) - a0, db = cpu_seconds(b->pid) - b0;
    fprintf(stderr, "idle 2 s: daemon A used %.2f s of CPU, B %.2f s\n", da,
            db);
    CHECK(da < 0.3);
    CHECK(db < 0.3);
    /* and the loop still wakes for UCX: one more transfer */
    p_one(&c, &g, 5, cb, gb, 4, 16, 5000);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* kvxfer-bench across two daemons it spawns (on loopback), in passes:
 * every pass verified, each with its own ucx_perftest run beside it; the
 * reported ratio is the median of the passes' ratios. */
TEST_T(bench_two_daemons_passes, 90)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd),
             "ASAN_OPTIONS=detect_leaks=0 %s/kvxfer-bench --spawn-daemon "
             "--daemons 2 --passes 3 --requests 4 --blocks 8 --window 2 "
             "--layers 4 --json 2>&1",
             build_dir());
    char out[8192];
    int st = cmd_run(cmd, out, sizeof(out));
    if (st != 0 || !strstr(out, "\"verified\":true"))
        fprintf(stderr, "%s\n-> %s\n", cmd, out);
    CHECK(st == 0);
    CHECK_STR_CONTAINS(out, "\"verified\":true");
    CHECK_STR_CONTAINS(out, "\"passes\":3");
    /* three passes, three ratios, three ucx_perftest runs */
    const char *keys[] = {"\"pass_gbps\":[", "\"pass_ratios\":[",
                          "\"ucx_perftest_runs\":["};
    double ratios[3] = {0};
    for (int k = 0; k < 3; k++) {
        const char *p = strstr(out, keys[k]);
        CHECK(p);
        p += strlen(keys[k]);
        for (int i = 0; i < 3; i++) {
            char *e;
            double v = strtod(p, &e);
            CHECK(e != p && v > 0);
            if (k == 1)
                ratios[i] = v;
            p = e + (i < 2 ? 1 : 0);
            CHECK(i < 2 ? e[0] == ',' : e[0] == ']');
        }
    }
    /* the ratio given is their median */
    double lo = ratios[0] < ratios[1] ? ratios[0] : ratios[1];
    double hi = ratios[0] < ratios[1] ? ratios[1] : ratios[0];
    double med = ratios[2] < lo ? lo : ratios[2] > hi ? hi : ratios[2];
    const char *r = strstr(out, "\"ratio\":");
    CHECK(r);
    double ratio = strtod(r + 8, NULL);
    fprintf(stderr, "passes' ratios %.3f %.3f %.3f, ratio %.3f\n", ratios[0],
            ratios[1], ratios[2], ratio);
    CHECK(ratio - med < 0.0015 && med - ratio < 0.0015);
}

/* After a transfer A -> B, both list the other as a connected peer with
 * the bytes moved, and the UCX section says where it listens and that it
 * stages in host memory. */
TEST_T(peer_status, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pst-ctx", "pst-gen", &c, &g);
    char ipport[2][64];
    p_check_addr(&c, 0, ipport[0], sizeof(ipport[0]));
    p_check_addr(&g, 1, ipport[1], sizeof(ipport[1]));

    char *json = status_json(a);
    char *ucx = p_json_section(json, "\"ucx\":");
    if (!ucx)
        fprintf(stderr, "no \"ucx\" in the status: %s\n", json);
    CHECK(ucx != NULL);
    char want[128];
    snprintf(want, sizeof(want), "\"listen\":\"kvx://%s", ipport[0]);
    CHECK_STR_CONTAINS(ucx, want);
    CHECK_STR_CONTAINS(ucx, "\"transports\":\"\""); /* none used yet */
    CHECK_STR_CONTAINS(ucx, "\"staging\":\"host\"");
    free(ucx);
    free(json);

    uint32_t cb[3] = {2, 0, 1}, gb[3] = {5, 7, 4};
    p_one(&c, &g, 51, cb, gb, 3, 10, 5000);
    long long payload = 10ll * M_SMALL.layers * M_SMALL.kv * M_SMALL.heads *
                        M_SMALL.head_dim * 2;

    /* where the slots' time went: B received, A sent, every byte */
    for (int i = 0; i < 2; i++) {
        char *js = status_json(i ? a : b);
        char *ux = p_json_section(js, "\"ucx\":");
        CHECK(ux != NULL);
        char *t = p_json_section(ux, i ? "\"sent\":" : "\"received\":");
        CHECK(t != NULL);
        fprintf(stderr, "%s slot times: %s\n", i ? "A sent" : "B received", t);
        CHECK(json_num(t, "slots") >= 1);
        CHECK_EQ(json_num(t, "bytes"), payload);
        CHECK(json_num(t, "wire_ns") > 0);
        CHECK(json_num(t, "copy_ns") > 0);
        /* one piece a slot here: its loop lag lies within its copy */
        CHECK(json_num(t, "loop_lag_ns") > 0);
        CHECK(json_num(t, "loop_lag_ns") < json_num(t, "copy_ns"));
        free(t);
        /* and nothing the other way */
        t = p_json_section(ux, i ? "\"received\":" : "\"sent\":");
        CHECK(t != NULL);
        CHECK_EQ(json_num(t, "slots"), 0);
        free(t);
        free(ux);
        free(js);
    }

    char *pb = p_peers(b); /* B dialled A's advertised address */
    fprintf(stderr, "B's peers: %s\n", pb);
    CHECK_STR_CONTAINS(pb, ipport[0]);
    CHECK_STR_CONTAINS(pb, "\"state\":\"connected\"");
    CHECK(json_num(pb, "bytes_received") >= payload);
    CHECK(json_num(pb, "bytes_sent") > 0);
    CHECK_EQ(json_num(pb, "errors"), 0);
    free(pb);
    char *pa = p_peers(a);
    fprintf(stderr, "A's peers: %s\n", pa);
    CHECK_STR_CONTAINS(pa, "\"state\":\"connected\"");
    CHECK(json_num(pa, "bytes_sent") >= payload);
    CHECK(json_num(pa, "bytes_received") > 0);
    CHECK_EQ(json_num(pa, "errors"), 0);
    free(pa);

    /* kvxferctl prints the same sections */
    char cmd[400], *out;
    snprintf(cmd, sizeof(cmd), "%s/kvxferctl --socket %s status --json",
             build_dir(), b->sock);
    fflush(stdout);
    fflush(stderr);
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    size_t len = 0, cap = 1 << 16;
    out = malloc(cap);
    CHECK(out != NULL);
    size_t k;
    while ((k = fread(out + len, 1, cap - 1 - len, f)) > 0)
        len += k;
    out[len] = 0;
    CHECK_EQ(pclose(f), 0);
    CHECK_STR_CONTAINS(out, "\"peers\":[");
    CHECK_STR_CONTAINS(out, "\"state\":\"connected\"");
    CHECK_STR_CONTAINS(out, "\"staging\":\"host\"");
    /* the transports the connection used, as "tl/device" */
    char *ux = p_json_section(out, "\"ucx\":");
    CHECK(ux != NULL);
    CHECK(strstr(ux, "\"transports\":\"\"") == NULL);
    CHECK(strchr(strstr(ux, "\"transports\":\"") + 14, '/') != NULL);
    free(ux);
    free(out);
    /* and in text: B's received slots, A sent none */
    snprintf(cmd, sizeof(cmd), "%s/kvxferctl --socket %s status", build_dir(),
             b->sock);
    f = popen(cmd, "r");
    CHECK(f != NULL);
    out = calloc(1, cap);
    CHECK(out != NULL);
    len = 0;
    while ((k = fread(out + len, 1, cap - 1 - len, f)) > 0)
        len += k;
    CHECK_EQ(pclose(f), 0);
    CHECK_STR_CONTAINS(out, "\nslots received 1 (0.0 MiB), per slot: wait ");
    CHECK(strstr(out, "\nslots sent") == NULL);
    CHECK_STR_CONTAINS(out, "  1 of 1 peer daemons connected");
    free(out);
    /* kvxferctl peers: B's one peer, A, connected, with B's bytes */
    char args[300], pout[4096];
    snprintf(args, sizeof(args), "--socket %s peers", b->sock);
    CHECK_EQ(ctl_run(args, pout, sizeof(pout)), 0);
    fprintf(stderr, "kvxferctl peers:\n%s", pout);
    CHECK_STR_CONTAINS(pout, "PEER ");
    char *line = strstr(pout, ipport[0]);
    CHECK(line != NULL);
    char st[32], dir[8];
    unsigned long long sent, recvd, errs;
    CHECK_EQ(sscanf(strchr(line, ' '), " %31s %7s %llu %llu %llu", st, dir,
                    &sent, &recvd, &errs),
             5);
    CHECK(!strcmp(st, "connected"));
    CHECK(!strcmp(dir, "out"));
    CHECK((long long)recvd >= payload);
    CHECK_EQ(errs, 0);
    /* B's record of the fetch: pulled from a peer, exactly its bytes */
    char rec[4096];
    snprintf(args, sizeof(args), "--socket %s requests --done --json", b->sock);
    CHECK_EQ(ctl_run(args, rec, sizeof(rec)), 0);
    fprintf(stderr, "B's records: %s", rec);
    CHECK_STR_CONTAINS(rec, "\"key\":\"51\",\"side\":\"generation\"");
    CHECK_STR_CONTAINS(rec, "\"path\":\"peer\",");
    CHECK_EQ(json_num(rec, "bytes"), payload);
    CHECK_STR_CONTAINS(rec, "\"outcome\":\"complete\",\"code\":\"OK\"");
    /* and A's of the offer: read by a peer daemon, every byte */
    snprintf(args, sizeof(args), "--socket %s requests --done --json", a->sock);
    CHECK_EQ(ctl_run(args, rec, sizeof(rec)), 0);
    fprintf(stderr, "A's records: %s", rec);
    CHECK_STR_CONTAINS(rec, "\"key\":\"51\",\"side\":\"context\"");
    CHECK_STR_CONTAINS(rec, "\"generation_instance\":\"\",\"path\":\"peer\",");
    CHECK_EQ(json_num(rec, "bytes"), payload);
    CHECK_STR_CONTAINS(rec, "\"outcome\":\"complete\",\"code\":\"OK\"");

    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(a);
    daemon_stop_ok(b);
}
