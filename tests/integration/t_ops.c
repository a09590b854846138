/*
 * t_ops.c — the daemon as an operator sees it: the status JSON and its
 * request list, configuration errors and reload, peer credentials and
 * socket.group, the socket file taken over only from a dead daemon,
 * kvxferctl plan, the copy workers' CPUs, and the UCX kvxferd --version
 * names.
 */

#include <dlfcn.h>

/* ---- 15. status --------------------------------------------------------- */

TEST(status_and_requests)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "st-ctx", "st-gen", 8, &c, &g, &cs, &gs);
    char *json = status_json(d);
    char want[128];
    snprintf(want, sizeof(want), "\"pid\":%d,", (int)getpid());
    CHECK_STR_CONTAINS(json, want);
    CHECK_STR_CONTAINS(json, "\"instance\":\"st-ctx\",\"rank\":0,"
                             "\"role\":\"context\",\"pools\":1");
    CHECK_STR_CONTAINS(json, "\"instance\":\"st-gen\",\"rank\":0,"
                             "\"role\":\"generation\",\"pools\":1");
    CHECK_EQ(json_pool_count(json), 2);
    CHECK_EQ(json_num(json, "bytes_moved"), 0);
    CHECK_EQ(json_num(json, "transfers_done"), 0);
    free(json);

    /* one transfer: bytes_moved is exactly its bytes */
    uint32_t bl[3] = {2, 0, 1};
    fill_req(&c, 40, bl, 10);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 40, c.pool, bl, 3, 10, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 40, p.data, p.len, g.pool, bl, 3, 0, T_MS), g.c);
    wait_event(g.c, 40, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 40, KVX_EVENT_COMPLETE, 0, 3000);
    kvx_context_params_free(&p);
    json = status_json(d);
    CHECK_EQ(json_num(json, "bytes_moved"), 10ull * M_SMALL.layers *
                                                M_SMALL.kv * M_SMALL.heads *
                                                M_SMALL.head_dim * 2);
    CHECK_EQ(json_num(json, "transfers_done"), 1);
    free(json);

    /* an error is counted by name */
    CHECK_FAILS(kvx_cancel(c.c, 12345, T_MS), c.c, KVX_ERR_NOT_FOUND, "12345");
    json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"errors_by_code\":{");
    CHECK(json_num(json, "NOT_FOUND") >= 1);
    free(json);

    /* an unfetched offer is listed with its state and age */
    CHECK_KVX(kvx_publish(c.c, 41, c.pool, bl, 3, 10, &p, T_MS), c.c);
    sleep_ms(120);
    CHECK_KVX(kvx_requests_json(g.c, &json, T_MS), g.c);
    CHECK_STR_CONTAINS(
        json, "\"instance\":\"st-ctx\",\"key\":\"41\",\"request_id\":41,"
              "\"side\":\"context\",\"state\":\"offered\"");
    long long age = json_num(json, "age_ms");
    CHECK(age >= 100 && age < 5000);
    free(json);
    json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"offered\":1");
    free(json);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* ---- records of finished requests ---------------------------------------- */

/* One transfer of tokens tokens in blocks bl[n] between the pair; waits
 * for both sides' COMPLETE. */
static void rec_transfer(rank_t *c, rank_t *g, uint64_t req, const uint32_t *bl,
                         uint32_t n, uint32_t tokens)
{
    kvx_context_params_t p;
    fill_req(c, req, bl, tokens);
    CHECK_KVX(kvx_publish(c->c, req, c->pool, bl, n, tokens, &p, T_MS), c->c);
    CHECK_KVX(kvx_fetch(g->c, req, p.data, p.len, g->pool, bl, n, 0, T_MS),
              g->c);
    wait_event(g->c, req, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c->c, req, KVX_EVENT_COMPLETE, 0, 3000);
    kvx_context_params_free(&p);
}

static uint64_t rec_bytes(uint32_t tokens)
{
    return (uint64_t)tokens * M_SMALL.layers * M_SMALL.kv * M_SMALL.heads *
           M_SMALL.head_dim * 2;
}

/* Every line of path is one JSON object (python3's json module says so):
 * how many lines, or -1. */
static int rec_json_lines(const char *path)
{
    char cmd[512], out[256];
    snprintf(cmd, sizeof(cmd),
             "python3 -c 'import json,sys; n=0\n"
             "for l in open(sys.argv[1]):\n"
             "    o=json.loads(l); assert isinstance(o, dict); n+=1\n"
             "print(n)' %s 2>&1",
             path);
    if (cmd_run(cmd, out, sizeof(out)) != 0) {
        fprintf(stderr, "%s: %s\n", path, out);
        return -1;
    }
    return atoi(out);
}

/* The record in text of KEY's SIDE (generation or context) (NULL:
 * none), copied. */
static char *rec_line(const char *text, const char *key, const char *side)
{
    char want[96];
    snprintf(want, sizeof(want), "\"key\":\"%s\",\"side\":\"%s\",", key, side);
    const char *p = strstr(text, want);
    if (!p)
        return NULL;
    while (p > text && p[0] != '{')
        p--;
    size_t n = strcspn(p, "\n");
    const char *e = strstr(p, "}");
    if (e && (size_t)(e - p) < n)
        n = (size_t)(e - p) + 1;
    return strndup(p, n);
}

/* Each finished request is one record, in the ring (records.ring, the
 * newest kept) that kvxferctl requests --done lists, and one JSON line
 * of records.file: instance, key, side, both sides' instances, path,
 * exactly the bytes that landed (a fetch) or were read (its offer),
 * start and end, bandwidth, outcome and code. An offer nobody fetched
 * is recorded with its outcome and no bytes. */
TEST(records_one_per_request)
{
    daemon_t *d = daemon_start("records:\n  ring: 3\n");
    char cfg[512], file[200];
    snprintf(file, sizeof(file), "%s/records.jsonl", d->dir);
    snprintf(cfg, sizeof(cfg),
             "socket:\n  path: %s\nrecords:\n  ring: 3\n  file: %s\n", d->sock,
             file);
    write_file(d->cfg, cfg);
    kill(d->pid, SIGHUP); /* records.file is reloadable */
    CHECK(log_wait(d, "reloaded", 3000));
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "rc-ctx", "rc-gen", 16, &c, &g, &cs, &gs);
    uint32_t bl[5] = {4, 0, 9, 2, 7};
    for (uint32_t i = 1; i <= 5; i++)
        rec_transfer(&c, &g, 70 + i, bl, i, i * 4 - 1); /* 4 a block */

    char *text = read_file(file);
    fprintf(stderr, "%s", text);
    CHECK_EQ(rec_json_lines(file), 10);
    for (uint32_t i = 1; i <= 5; i++) {
        char key[16];
        snprintf(key, sizeof(key), "%u", 70 + i);
        for (int side = 0; side < 2; side++) {
            char *l = rec_line(text, key, side ? "context" : "generation");
            CHECK(l != NULL);
            CHECK_STR_CONTAINS(l, side ? "\"instance\":\"rc-ctx\","
                                       : "\"instance\":\"rc-gen\",");
            CHECK_STR_CONTAINS(l, "\"context_instance\":\"rc-ctx\","
                                  "\"generation_instance\":\"rc-gen\","
                                  "\"path\":\"host\",");
            CHECK_STR_CONTAINS(l, "\"outcome\":\"complete\",\"code\":\"OK\"");
            CHECK_EQ(json_num(l, "bytes"), (long long)rec_bytes(i * 4 - 1));
            long long us = json_num(l, "duration_us");
            CHECK(us >= 0);
            if (us > 0)
                CHECK_EQ(json_num(l, "bandwidth_bytes_per_s"),
                         (long long)(rec_bytes(i * 4 - 1) * 1e6 / (double)us));
            free(l);
        }
    }
    free(text);

    /* the ring keeps the newest 3, oldest first: each transfer left its
     * fetch's record, then its offer's */
    char args[300], out[8192];
    snprintf(args, sizeof(args), "--socket %s requests --done --json", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_EQ(count_str(out, "\"instance\":"), 3);
    CHECK(strstr(out, "\"key\":\"73\"") == NULL);
    const char *c74 = strstr(out, "\"key\":\"74\",\"side\":\"context\"");
    const char *g75 = strstr(out, "\"key\":\"75\",\"side\":\"generation\"");
    const char *c75 = strstr(out, "\"key\":\"75\",\"side\":\"context\"");
    CHECK(c74 && g75 && c75 && c74 < g75 && g75 < c75);
    char *l = rec_line(out, "75", "generation");
    CHECK(l != NULL);
    CHECK_EQ(json_num(l, "bytes"), (long long)rec_bytes(19));
    free(l);
    snprintf(args, sizeof(args), "--socket %s requests --done", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    fprintf(stderr, "%s", out);
    CHECK_STR_CONTAINS(out, "3 finished requests shown, 3 kept, 10 since "
                            "start\n");
    char want[200];
    snprintf(want, sizeof(want),
             "rc-gen               75                   generation rc-ctx"
             "               host  %12llu ",
             (unsigned long long)rec_bytes(19));
    CHECK_STR_CONTAINS(out, want);
    snprintf(want, sizeof(want),
             "rc-ctx               75                   context    rc-gen"
             "               host  %12llu ",
             (unsigned long long)rec_bytes(19));
    CHECK_STR_CONTAINS(out, want);

    /* an offer nobody fetches: its lease ends it; no bytes, no path */
    snprintf(cfg, sizeof(cfg),
             "socket:\n  path: %s\nrecords:\n  ring: 3\n  file: %s\n"
             "deadlines:\n  offer_lease_ms: 100\n",
             d->sock, file);
    write_file(d->cfg, cfg);
    /* the first SIGHUP above wrote the same line */
    int reloads = log_count(d, "keys changed");
    kill(d->pid, SIGHUP);
    CHECK(log_wait_more(d, "keys changed", reloads, 3000));
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 90, c.pool, bl, 1, 3, &p, T_MS), c.c);
    wait_event(c.c, 90, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 3000);
    kvx_context_params_free(&p);
    text = read_file(file);
    l = rec_line(text, "90", "context");
    CHECK(l != NULL);
    CHECK_STR_CONTAINS(l, "\"generation_instance\":\"\",\"path\":\"-\","
                          "\"bytes\":0,");
    CHECK_STR_CONTAINS(l, "\"outcome\":\"timed_out\",\"code\":\"TIMED_OUT\"");
    free(l);
    free(text);

    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* records.file is rotated past records.max_bytes (FILE.1 the newest,
 * records.keep kept, the oldest removed), and reopened on SIGHUP: after
 * logrotate moved it, the next record goes to a new FILE. */
TEST(records_rotate_and_reopen)
{
    daemon_t *d = daemon_start(NULL);
    char cfg[512], file[200], path[220];
    snprintf(file, sizeof(file), "%s/rec.jsonl", d->dir);
    /* a record is about 400 bytes: every one rotates the file */
    snprintf(cfg, sizeof(cfg),
             "socket:\n  path: %s\nrecords:\n  file: %s\n  max_bytes: 1\n"
             "  keep: 2\n",
             d->sock, file);
    write_file(d->cfg, cfg);
    kill(d->pid, SIGHUP);
    CHECK(log_wait(d, "reloaded", 3000));
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "rr-ctx", "rr-gen", 8, &c, &g, &cs, &gs);
    uint32_t bl[1] = {3};
    for (uint32_t i = 1; i <= 4; i++)
        rec_transfer(&c, &g, i, bl, 1, 3);
    char *t = read_file(file);
    CHECK_EQ((long long)strlen(t), 0); /* reopened empty after the last */
    free(t);
    /* each transfer: its fetch's record, then its offer's */
    snprintf(path, sizeof(path), "%s.1", file);
    t = read_file(path);
    CHECK_EQ(count_str(t, "\n"), 1);
    CHECK_STR_CONTAINS(t, "\"key\":\"4\",\"side\":\"context\",");
    free(t);
    snprintf(path, sizeof(path), "%s.2", file);
    t = read_file(path);
    CHECK_EQ(count_str(t, "\n"), 1);
    CHECK_STR_CONTAINS(t, "\"key\":\"4\",\"side\":\"generation\",");
    free(t);
    snprintf(path, sizeof(path), "%s.3", file);
    CHECK(access(path, F_OK) != 0); /* keep: 2 */

    /* logrotate's way: move it, SIGHUP; never rotated by the daemon */
    snprintf(cfg, sizeof(cfg),
             "socket:\n  path: %s\nrecords:\n  file: %s\n  max_bytes: 0\n",
             d->sock, file);
    write_file(d->cfg, cfg);
    kill(d->pid, SIGHUP);
    CHECK(log_wait(d, "keys changed", 3000));
    rec_transfer(&c, &g, 5, bl, 1, 3);
    snprintf(path, sizeof(path), "%s.moved", file);
    CHECK(rename(file, path) == 0);
    rec_transfer(&c, &g, 6, bl, 1, 3); /* still into the moved file */
    kill(d->pid, SIGHUP);
    sleep_ms(300);
    rec_transfer(&c, &g, 7, bl, 1, 3);
    t = read_file(path);
    CHECK_EQ(count_str(t, "\n"), 4);
    CHECK_EQ(count_str(t, "\"key\":\"5\","), 2);
    CHECK_EQ(count_str(t, "\"key\":\"6\","), 2);
    free(t);
    t = read_file(file);
    CHECK_EQ(count_str(t, "\n"), 2);
    CHECK_EQ(count_str(t, "\"key\":\"7\","), 2);
    free(t);
    CHECK_EQ(rec_json_lines(file), 2);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(d);
}

/* ---- logs --------------------------------------------------------------- */

/* Every line of d's log parses as a JSON object with time, level,
 * priority and message (python3's json module), and the python lines in
 * check hold over them (ls: the objects; d: the datetime module). */
static void log_json_check(daemon_t *d, const char *check)
{
    char cmd[2048], out[2048];
    snprintf(cmd, sizeof(cmd),
             "python3 -c 'import json,sys,datetime as d\n"
             "ls=[json.loads(l) for l in open(sys.argv[1])]\n"
             "assert ls and all(set(o)>={\"time\",\"level\",\"priority\","
             "\"message\"} for o in ls), ls\n"
             "%s"
             "print(len(ls), \"lines\")' %s 2>&1",
             check, d->log);
    int rc = cmd_run(cmd, out, sizeof(out));
    fprintf(stderr, "%s", out);
    CHECK_EQ(rc, 0);
}

/* log.format json: every line the daemon writes is one JSON object
 * (python3's json module parses each), with time, level and message; a
 * request that times out is an info line carrying its instance, key and
 * code, a rank's hello its instance. A reload back to text is in force at
 * once. */
TEST(log_json_lines_carry_fields)
{
    daemon_t *d = daemon_start("log:\n  format: json\n"
                               "deadlines:\n  offer_lease_ms: 200\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "lj-ctx", "lj-gen", 8, &c, &g, &cs, &gs);
    uint32_t bl[2] = {1, 3};
    rec_transfer(&c, &g, 5, bl, 2, 6);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 9, c.pool, bl, 2, 6, &p, T_MS), c.c);
    wait_event(c.c, 9, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 3000);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    log_json_check(d, "t=[o for o in ls if o.get(\"code\")==\"TIMED_OUT\"]\n"
                      "assert t and t[0][\"instance\"]==\"lj-ctx\" and "
                      "t[0][\"key\"]==\"9\" and t[0][\"level\"]==\"info\", "
                      "t\n"
                      "assert \"offer lease of 200 ms expired\" in "
                      "t[0][\"message\"]\n"
                      "h=[o for o in ls if o.get(\"instance\")==\"lj-gen\"]\n"
                      "assert h and \"is rank 0 of instance lj-gen\" in "
                      "h[0][\"message\"], h\n");
    /* back to text by reload */
    char cfg[256];
    snprintf(cfg, sizeof(cfg), "socket:\n  path: %s\nlog:\n  format: text\n",
             d->sock);
    write_file(d->cfg, cfg);
    kill(d->pid, SIGHUP);
    CHECK(log_wait(d, "<5>kvxferd: SIGHUP: reloaded", 3000));
    daemon_stop_ok(d);
}

/* On a terminal the daemon names levels ("error: ..."), in a file or a
 * pipe it keeps journald's "<3>" prefix; a bad log.format is refused. */
TEST(log_level_names_on_a_terminal)
{
    char cfg[128], cmd[512], out[4096];
    snprintf(cfg, sizeof(cfg), "/tmp/kvx-it-%d-tty.yaml", (int)getpid());
    write_file(cfg, "limits:\n  max_sessions: many\n");
    snprintf(cmd, sizeof(cmd),
             "script -qec '%s/kvxferd --config %s' /dev/null 2>&1", build_dir(),
             cfg);
    CHECK_EQ(cmd_run(cmd, out, sizeof(out)), 1);
    fprintf(stderr, "%s", out);
    CHECK_STR_CONTAINS(out, " error: ");
    CHECK_STR_CONTAINS(out, "limits.max_sessions");
    CHECK(strstr(out, "<3>") == NULL);
    snprintf(cmd, sizeof(cmd), "%s/kvxferd --config %s 2>&1 | cat", build_dir(),
             cfg);
    cmd_run(cmd, out, sizeof(out));
    CHECK_STR_CONTAINS(out, "<3>kvxferd: ");
    write_file(cfg, "log:\n  format: loud\n");
    snprintf(cmd, sizeof(cmd), "%s/kvxferd --config %s --check-config 2>&1",
             build_dir(), cfg);
    CHECK_EQ(cmd_run(cmd, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "tty.yaml:2:11: log.format: loud (expected "
                            "auto, text, json or journal)");
    unlink(cfg);
}

/* ---- 16. configuration -------------------------------------------------- */

/* Run kvxferd with args; returns the exit status, output in *out. */
static int run_kvxferd(const char *a1, const char *a2, const char *a3,
                       char **out)
{
    char exe[256], tmp[64];
    snprintf(exe, sizeof(exe), "%s/kvxferd", build_dir());
    snprintf(tmp, sizeof(tmp), "/tmp/kvx-it-out-%d", (int)getpid());
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        execl(exe, exe, a1, a2, a3, (char *)NULL);
        _exit(127);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    *out = read_file(tmp);
    unlink(tmp);
    return st;
}

TEST(config_errors)
{
    char bad[64], *out;
    snprintf(bad, sizeof(bad), "/tmp/kvx-it-%d-bad.yaml", (int)getpid());
    write_file(bad, "socket:\n"
                    "  path: /tmp/x.sock\n"
                    "deadlines:\n"
                    "  offer_lease_ms: soon\n"
                    "limits:\n"
                    "  max_sesions: 3\n");
    int st = run_kvxferd("--check-config", "--config", bad, &out);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) != 0);
    char want[128];
    snprintf(want, sizeof(want), "%s:4:19: deadlines.offer_lease_ms: ", bad);
    CHECK_STR_CONTAINS(out, want);
    CHECK_STR_CONTAINS(out, "soon");
    snprintf(want, sizeof(want), "%s:6:3: limits.max_sesions: unknown key",
             bad);
    CHECK_STR_CONTAINS(out, want);
    free(out);
    unlink(bad);

    /* a value of many signs: a problem named, not a crash (it recursed
     * once a sign and overflowed the stack, on SIGHUP too) */
    {
        size_t n = 200000;
        char *v = malloc(n + 64);
        CHECK(v != NULL);
        strcpy(v, "limits:\n  max_sessions: \"");
        size_t l = strlen(v);
        memset(v + l, '-', n);
        strcpy(v + l + n, "1\"\n");
        write_file(bad, v);
        free(v);
        st = run_kvxferd("--check-config", "--config", bad, &out);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
        CHECK_STR_CONTAINS(out, "limits.max_sessions");
        free(out);
        unlink(bad);
    }

    st = run_kvxferd("--check-config", "--config", "config/kvxferd.yaml", &out);
    if (!WIFEXITED(st) || WEXITSTATUS(st))
        fprintf(stderr, "%s", out);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    free(out);
}

TEST(config_reload)
{
    daemon_t *d = daemon_start("log:\n  level: info\n");
    char cfg[512];
    snprintf(cfg, sizeof(cfg),
             "socket:\n  path: %s\nlog:\n  level: debug\n"
             "limits:\n  max_sessions: 77\n"
             "deadlines:\n  offer_lease_ms: 200\n",
             d->sock);
    write_file(d->cfg, cfg);
    CHECK(!log_contains(d, "reloaded"));
    kill(d->pid, SIGHUP);
    CHECK(log_wait(d, "reloaded", 3000));
    CHECK(log_contains(d, d->cfg));
    CHECK(log_contains(d, "limits.max_sessions"));
    CHECK(log_contains(d, "restart"));
    /* the new level is in force: debug lines appear */
    CHECK(!log_contains(d, "connected, pid"));
    daemon_healthy(d);
    CHECK(log_wait(d, "connected, pid", 2000));
    /* a reloaded deadline is in force for new offers */
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "rl-ctx", "rl-gen", 8, &c, &g, &cs, &gs);
    uint32_t bl[1] = {1};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 3, c.pool, bl, 1, 2, &p, T_MS), c.c);
    wait_event(c.c, 3, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 1500);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    char *json = status_json(d);
    CHECK_STR_CONTAINS(json, "\"deadlines.offer_lease_ms\":\"200\"");
    free(json);
    /* a broken file keeps the running configuration */
    write_file(d->cfg, "log:\n  level: loud\n");
    kill(d->pid, SIGHUP);
    CHECK(log_wait(d, "keeping the running configuration", 3000));
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* ---- 17. peer credentials ------------------------------------------------ */

static int pc_expect_ok;
static gid_t pc_group = (gid_t)-1; /* a supplementary group to hold */

static void pc_child(void *arg)
{
    daemon_t *d = arg;
    gid_t groups[1] = {pc_group};
    if (setgroups(pc_group == (gid_t)-1 ? 0 : 1, groups) || setgid(65534) ||
        setuid(65534)) {
        perror("setuid");
        _exit(2);
    }
    side_t s = {.inst = "pc",
                .role = KVX_ROLE_CONTEXT,
                .tp = 1,
                .pp = 1,
                .preset = "vllm-nhd",
                .tpb = 4};
    rank_t r;
    memset(&r, 0, sizeof(r));
    r.m = &M_SMALL;
    r.s = &s;
    kvx_hello_t h = rank_hello(&r);
    kvx_client_t *c = NULL;
    int rc = kvx_connect_observer(d->sock, T_MS, &c);
    if (rc == 0) {
        rc = kvx_hello(c, &h, T_MS);
        if (rc == KVX_ERR_PERM)
            CHECK_STR_CONTAINS(kvx_last_error(c), "uid 65534");
    }
    if (pc_expect_ok) {
        if (rc)
            fprintf(stderr, "uid 65534 (allowed) refused: %s: %s\n",
                    kvx_status_name(rc), c ? kvx_last_error(c) : "");
        kvx_close(c);
        _exit(rc ? 1 : 0);
    }
    kvx_close(c);
    if (rc == 0) {
        fprintf(stderr, "uid 65534 was let in\n");
        _exit(1);
    }
    /* refused: told why (PERM), or at least the connection closed */
    if (rc != KVX_ERR_PERM && rc != KVX_ERR_CLOSED && rc != KVX_ERR_IO) {
        fprintf(stderr, "refused with %s, expected PERM, CLOSED or IO\n",
                kvx_status_name(rc));
        _exit(1);
    }
}

TEST(peer_cred)
{
    if (geteuid() != 0) {
        printf("peer_cred: skipped: needs root to connect as another uid\n");
        return;
    }
    daemon_t *d = daemon_start2("  mode: 0666\n", NULL);
    pid_t pid = spawn(pc_child, d);
    CHECK(wait_children(&pid, 1, 10000));
    CHECK(log_wait(d, "refused", 2000));
    CHECK(log_contains(d, "uid 65534"));
    char *json = status_json(d);
    CHECK(json_num(json, "PERM") >= 1);
    free(json);
    daemon_healthy(d);
    daemon_stop_ok(d);
    /* listed in auth.allowed_uids: let in */
    d = daemon_start2("  mode: 0666\n", "auth:\n  allowed_uids: [65534]\n");
    pc_expect_ok = 1;
    pid = spawn(pc_child, d);
    CHECK(wait_children(&pid, 1, 10000));
    CHECK(!log_contains(d, "refused"));
    daemon_stop_ok(d);
    /* by group */
    d = daemon_start2("  mode: 0666\n", "auth:\n  allowed_gids: [65534]\n");
    pid = spawn(pc_child, d);
    CHECK(wait_children(&pid, 1, 10000));
    CHECK(!log_contains(d, "refused"));
    daemon_stop_ok(d);
    /* by a supplementary group */
    d = daemon_start2("  mode: 0666\n", "auth:\n  allowed_gids: [4321]\n");
    pc_group = 4321;
    pid = spawn(pc_child, d);
    CHECK(wait_children(&pid, 1, 10000));
    CHECK(!log_contains(d, "refused"));
    daemon_stop_ok(d);
}

/* socket.group by name and by number (a gid with no name included): the
 * socket file gets that group. */
TEST(socket_group)
{
    if (geteuid() != 0) {
        printf("socket_group: skipped: needs root to give the socket "
               "another group\n");
        return;
    }
    struct stat st;
    daemon_t *d = daemon_start2("  group: \"4321\"\n", NULL);
    CHECK(stat(d->sock, &st) == 0);
    CHECK_EQ(st.st_gid, 4321);
    daemon_healthy(d);
    daemon_stop_ok(d);
    d = daemon_start2("  group: root\n", NULL);
    CHECK(stat(d->sock, &st) == 0);
    CHECK_EQ(st.st_gid, 0);
    daemon_stop_ok(d);
}

/* Send sig to d: it exits 1, within max_ms and not before min_ms, and
 * its log has line. */
static void signal_exits_1(daemon_t *d, int sig, int min_ms, int max_ms,
                           const char *line)
{
    int64_t t0 = now_ms();
    kill(d->pid, sig);
    int st = daemon_wait(d, max_ms);
    int64_t took = now_ms() - t0;
    CHECK(st != -1 && WIFEXITED(st));
    CHECK_EQ(WEXITSTATUS(st), 1);
    CHECK(took >= min_ms);
    if (!log_contains(d, line))
        fprintf(stderr, "no \"%s\" in %s\n", line, d->log);
    CHECK(log_contains(d, line));
}

/* A SIGTERM that comes once the socket listens, while the rest of the
 * daemon still starts (KVXFERD_FAULT=start_hold:1 holds it there 1 s),
 * drains it: exit 0, where it used to die of the signal (status 15). */
TEST(sigterm_while_starting)
{
    daemon_t *d = daemon_start_fault("start_hold:1", NULL);
    if (log_contains(d, "ready")) /* the machine took over 1 s */
        printf("sigterm_while_starting: the daemon was already ready\n");
    daemon_stop_ok(d);
    CHECK(log_contains(d, "SIGTERM: draining"));
    CHECK(log_contains(d, "exiting (drained)"));
}

/* A start that is stuck (start_hold:60, which signals do not cut short,
 * as a hung UCX or CUDA call) still stops: the first SIGTERM is kept,
 * and a second ends the daemon at once with exit 1, not drained. */
TEST(second_sigterm_ends_a_stuck_start)
{
    daemon_t *d = daemon_start_fault("start_hold:60", NULL);
    kill(d->pid, SIGTERM);
    CHECK(log_wait(d,
                   "SIGTERM or SIGINT while starting: draining once "
                   "started",
                   5000));
    CHECK_EQ(daemon_wait(d, 300), -1); /* kept: the start goes on */
    signal_exits_1(d, SIGTERM, 0, 5000,
                   "a second SIGTERM or SIGINT while starting: exiting now, "
                   "not drained");
}

/* One SIGINT into a stuck start: 10 s later the daemon gives up waiting
 * for the start and exits 1 (it does not hang until systemd's SIGKILL). */
TEST_T(sigint_ends_a_stuck_start_later, 40)
{
    daemon_t *d = daemon_start_fault("start_hold:60", NULL);
    signal_exits_1(d, SIGINT, 9000, 20000,
                   "the start did not finish within 10 s of SIGTERM or "
                   "SIGINT: exiting now, not drained");
}

/* A SIGHUP while starting does not kill the daemon (its default action):
 * it is kept, and the loop reloads once the start is done. */
TEST(sighup_while_starting_reloads_after)
{
    daemon_t *d = daemon_start_fault("start_hold:1", NULL);
    kill(d->pid, SIGHUP);
    CHECK(log_wait(d, "ready", 10000));
    CHECK(log_wait(d, "SIGHUP:", 5000));
    CHECK_EQ(daemon_wait(d, 100), -1);
    daemon_stop_ok(d);
}

/* A SIGHUP and a SIGTERM both while starting: one drain, exit 0, and no
 * reload after it (its READY=1 would follow STOPPING=1). */
TEST(sighup_and_sigterm_while_starting_drain_once)
{
    daemon_t *d = daemon_start_fault("start_hold:1", NULL);
    kill(d->pid, SIGHUP);
    kill(d->pid, SIGTERM);
    int st = daemon_wait(d, 10000);
    CHECK(st != -1 && WIFEXITED(st));
    CHECK_EQ(WEXITSTATUS(st), 0);
    CHECK(log_contains(d, "SIGTERM: draining"));
    CHECK(log_contains(d, "exiting (drained)"));
    CHECK(!log_contains(d, "SIGHUP:"));
}

/* Under log.format json, the lines a signal handler writes while the
 * daemon starts are JSON objects like every other line (they were plain
 * text), their time in UTC within a minute of the test's clock. */
TEST(json_lines_while_starting)
{
    daemon_t *d = daemon_start_fault("start_hold:60", "log:\n  format: json\n");
    kill(d->pid, SIGTERM);
    CHECK(log_wait(d, "draining once started", 5000));
    kill(d->pid, SIGTERM);
    int st = daemon_wait(d, 5000);
    CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 1);
    log_json_check(
        d, "s=[o for o in ls if \"while starting\" in o[\"message\"]]\n"
           "assert [o[\"level\"] for o in s]==[\"notice\",\"error\"], s\n"
           "assert \"exiting now, not drained\" in s[1][\"message\"]\n"
           "for o in s:\n"
           " t=d.datetime.strptime(o[\"time\"],\"%Y-%m-%dT%H:%M:%S.%fZ\")\n"
           " t=t.replace(tzinfo=d.timezone.utc)\n"
           " assert abs((d.datetime.now(d.timezone.utc)-t).total_seconds())"
           "<60,o\n");
}

/* A take-down stuck after the drain (down_hold:60, as a hung UCX or CUDA
 * call once the loop has stopped) still stops: a SIGTERM then ends the
 * daemon at once with exit 1, naming the step. It used to go unheard
 * until systemd's SIGKILL. */
TEST(sigterm_ends_a_stuck_takedown)
{
    daemon_t *d = daemon_start_fault("down_hold:60", NULL);
    CHECK(log_wait(d, "ready", 10000));
    kill(d->pid, SIGTERM);
    CHECK(log_wait(d, "drain: ", 10000));
    CHECK_EQ(daemon_wait(d, 500), -1); /* held */
    kill(d->pid, SIGHUP);              /* ignored, not its default */
    CHECK_EQ(daemon_wait(d, 300), -1);
    signal_exits_1(d, SIGTERM, 0, 5000,
                   "a SIGTERM or SIGINT while taking down: exiting now (in "
                   "a held take-down");
    CHECK(!log_contains(d, "exiting (drained)"));
}

/* With no second signal, a stuck take-down ends by itself 20 s after it
 * began, exit 1. */
TEST_T(stuck_takedown_ends_later, 50)
{
    daemon_t *d = daemon_start_fault("down_hold:60", NULL);
    CHECK(log_wait(d, "ready", 10000));
    /* the signal drains it; the take-down, held, ends 20 s later */
    signal_exits_1(d, SIGINT, 18000, 30000,
                   "the take-down did not finish within 20 s: exiting now "
                   "(in a held take-down");
    CHECK(log_contains(d, "drain: "));
}

/* SIGTERMs that keep coming through the end of the drain and the start
 * of the take-down never kill the daemon by their default action: the
 * take-down's handlers take them from the loop's watchers with no gap
 * (stopping a watcher used to set SIGTERM to SIG_DFL first). Exit 0 or
 * 1, whichever step the flood met. */
TEST_T(sigterm_flood_into_the_takedown, 60)
{
    for (int i = 0; i < 40; i++) {
        daemon_t *d = daemon_start(NULL);
        CHECK(log_wait(d, "ready", 10000));
        int64_t end = now_ms() + 20000;
        while (daemon_wait(d, 0) == -1 && now_ms() < end)
            kill(d->pid, i % 2 ? SIGINT : SIGTERM);
        int st = daemon_wait(d, 0);
        if (st != -1 && WIFSIGNALED(st))
            fprintf(stderr, "run %d: killed by signal %d\n", i, WTERMSIG(st));
        CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) <= 1);
        daemon_forget(d);
    }
}

/* SIGHUPs that keep coming once a drain began (a reload racing a stop)
 * never kill the daemon by their default action: not in the take-down,
 * which ignores them, and not after it, where UCX's library has set
 * SIGHUP back to its default on its way out. It exits 0 (drained), and
 * reloads nothing while it drains. */
TEST_T(sighup_flood_into_the_exit, 60)
{
    for (int i = 0; i < 20; i++) {
        daemon_t *d = daemon_start(NULL);
        CHECK(log_wait(d, "ready", 10000));
        kill(d->pid, SIGTERM);
        int64_t end = now_ms() + 20000;
        while (daemon_wait(d, 0) == -1 && now_ms() < end)
            kill(d->pid, SIGHUP);
        int st = daemon_wait(d, 0);
        if (st != -1 && WIFSIGNALED(st))
            fprintf(stderr, "run %d: killed by signal %d\n", i, WTERMSIG(st));
        CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
        /* nor does one reload it once it drains (READY=1 after
         * STOPPING=1) */
        char *t = read_file(d->log), *dr = strstr(t, "SIGTERM: draining");
        CHECK(dr != NULL);
        if (strstr(dr, "SIGHUP: reloaded") || strstr(dr, "SIGHUP: no"))
            fprintf(stderr, "run %d: reloaded while draining:\n%s\n", i, dr);
        CHECK(!strstr(dr, "SIGHUP: reloaded") && !strstr(dr, "SIGHUP: no"));
        free(t);
        daemon_forget(d);
    }
}

/* A SIGHUP while the daemon drains (kvxferctl drain, an offer still in
 * flight) reloads nothing: a reload would tell systemd READY=1 after
 * STOPPING=1, and change the keys of a daemon on its way out. */
TEST_T(sighup_while_draining_reloads_nothing, 30)
{
    daemon_t *d = daemon_start("");
    rank_t c, g;
    FILE *ctl = drain_with_offer(d, "hd-ctx", "hd-gen", &c, &g);
    kill(d->pid, SIGHUP);
    CHECK(log_wait(d, "SIGHUP: ignored while draining", 5000));
    CHECK(!log_contains(d, "SIGHUP: reloaded"));
    pclose(ctl);
    int st = daemon_wait(d, 10000);
    CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    rank_close(&c);
    rank_close(&g);
}

/* ---- the socket file -------------------------------------------------- */

/* Run kvxferd --config cfg; kill it after timeout_ms. Returns the wait
 * status, or -1 if it was still running. */
static int run_daemon_cfg(const char *cfg, const char *log, int timeout_ms)
{
    char exe[256];
    snprintf(exe, sizeof(exe), "%s/kvxferd", build_dir());
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        signal(SIGALRM, SIG_DFL);
        execl(exe, exe, "--config", cfg, (char *)NULL);
        _exit(127);
    }
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return st;
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            return -1;
        }
        sleep_ms(5);
    }
}

/* A live daemon's socket is not taken over; a dead one's is. */
TEST(socket_takeover)
{
    daemon_t *d = daemon_start(NULL);
    char log2[160];
    snprintf(log2, sizeof(log2), "%s/second.log", d->dir);
    int st = run_daemon_cfg(d->cfg, log2, 3000);
    CHECK(st != -1);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) != 0);
    char *t = read_file(log2);
    CHECK_STR_CONTAINS(t, "another daemon is listening");
    free(t);
    daemon_healthy(d); /* the first one still serves */
    kill(d->pid, SIGKILL);
    daemon_wait(d, 3000);
    CHECK(access(d->sock, F_OK) == 0); /* left behind */
    /* a new daemon on the stale socket file */
    snprintf(log2, sizeof(log2), "%s/third.log", d->dir);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open(log2, O_WRONLY | O_CREAT | O_APPEND, 0644);
        dup2(fd, 2);
        char exe[256];
        snprintf(exe, sizeof(exe), "%s/kvxferd", build_dir());
        signal(SIGALRM, SIG_DFL);
        execl(exe, exe, "--config", d->cfg, (char *)NULL);
        _exit(127);
    }
    int64_t end = now_ms() + 5000;
    kvx_client_t *c = NULL;
    while (kvx_connect_observer(d->sock, 200, &c) != 0) {
        CHECK(now_ms() < end);
        CHECK(waitpid(pid, NULL, WNOHANG) == 0);
        sleep_ms(10);
    }
    char *json;
    CHECK_KVX(kvx_status_json(c, &json, T_MS), c);
    free(json);
    kvx_close(c);
    kill(pid, SIGTERM);
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(access(d->sock, F_OK) != 0);
}

/* ---- kvxferctl -------------------------------------------------------- */

/* kvxferctl plan: the daemon's planner without a daemon, from options and
 * from a YAML file; bad files and refused pairs exit 1 naming why. */

TEST(ctl_plan)
{
    char out[8192], args[512], file[128];
    CHECK_EQ(ctl_run("plan --ctx-tp 4 --gen-tp 2 --heads 8 --layers 32", out,
                     sizeof(out)),
             0);
    CHECK_STR_CONTAINS(out, "generation rank 1: 2 slices, 4 token segments, "
                            "4194304 bytes");
    CHECK_STR_CONTAINS(out, "<- context rank 3   layers [0, 32)  heads [6, 8)");
    CHECK_STR_CONTAINS(out, "total 8388608 bytes");
    /* refused as the daemon refuses it */
    CHECK_EQ(ctl_run("plan --ctx-dtype fp8 --gen-dtype bf16", out, sizeof(out)),
             1);
    CHECK_STR_CONTAINS(out, "refused: dtype: context fp8, generation bf16 "
                            "(MISMATCH)");
    /* from a file: PP with uneven layers, attention DP, a skipped prefix */
    snprintf(file, sizeof(file), "/tmp/kvx-it-%d-pair.yaml", (int)getpid());
    write_file(file, "model:\n  layers: 32\n  kv_heads: 8\n  head_dim: 128\n"
                     "  dtype: bf16\ncontext:\n  tp: 2\n  pp: 2\n"
                     "  layers_per_pp: [20, 12]\n  tokens_per_block: 32\n"
                     "generation:\n  tp: 4\n  attention_dp: 2\n"
                     "  tokens_per_block: 16\nrequest:\n  tokens: 1000\n"
                     "  skip_tokens: 200\n");
    snprintf(args, sizeof(args), "plan --from %s", file);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "request:    tokens [200, 1000)");
    CHECK_STR_CONTAINS(out,
                       "<- context rank 2   layers [20, 32)  heads [0, 4)");
    CHECK_STR_CONTAINS(out, "total 104857600 bytes");
    /* an unknown key, and a side's key under model: file:line:column */
    write_file(file, "model:\n  layers: 32\ncontext:\n  tp: 2\n  heads: 8\n");
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "pair.yaml:5:3: heads: unknown key");
    write_file(file, "model:\n  layers: 32\n  tp: 4\n");
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "pair.yaml:3:3: tp: not a model key");
    /* a complex key at the top: an error, not a crash */
    write_file(file, "? {tp: 1}\n: 1\n");
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 1);
    CHECK_STR_CONTAINS(out, "expected section: key: value");
    /* a model key sets both sides, whatever a side said before */
    write_file(file, "generation:\n  head_dim: 64\nmodel:\n"
                     "  head_dim: 128\n");
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "total 8388608 bytes");
    unlink(file);
}

/* Every command kvxferctl --help lists answers COMMAND --help with its
 * usage and exit 0, as do kvxferctl --help and --version (before, a
 * command's --help was an unknown option: exit 2). The list is read from
 * kvxferctl itself, so a command added later is covered too. */
TEST(ctl_help_every_command)
{
    char out[8192], one[4096], args[128];
    CHECK_EQ(ctl_run("--version", out, sizeof(out)), 0);
    char want[128];
    snprintf(want, sizeof(want), "kvxferctl %s (protocol %d.%d)\n",
             KVX_VERSION_STRING, KVX_PROTOCOL_MAJOR, KVX_PROTOCOL_MINOR);
    CHECK_STR_CONTAINS(out, want);
    CHECK_EQ(ctl_run("--help", out, sizeof(out)), 0);
    const char *p = strstr(out, "\ncommands:\n");
    CHECK(p != NULL);
    p += strlen("\ncommands:\n");
    int n = 0;
    char name[32];
    while (sscanf(p, "  %31s", name) == 1 && p[0] == ' ' && p[2] != '-') {
        snprintf(args, sizeof(args), "%s --help", name);
        CHECK_EQ(ctl_run(args, one, sizeof(one)), 0);
        snprintf(want, sizeof(want), "usage: kvxferctl [--socket PATH] %s ",
                 name);
        CHECK_STR_CONTAINS(one, want);
        snprintf(args, sizeof(args), "%s -h", name);
        CHECK_EQ(ctl_run(args, one, sizeof(one)), 0);
        n++;
        p = strchr(p, '\n') + 1;
    }
    fprintf(stderr, "%d commands answered --help\n", n);
    CHECK(n >= 6); /* status requests peers drain cancel plan */
    /* plan says its defaults */
    CHECK_EQ(ctl_run("plan --help", out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "--heads H                   total KV heads "
                            "(default 8)");
    CHECK_STR_CONTAINS(out, "(default bf16)");
    /* an unknown option still exits 2 and names it */
    CHECK_EQ(ctl_run("status --bogus", out, sizeof(out)), 2);
    CHECK_STR_CONTAINS(out, "status: unknown option '--bogus'");
}

/* kvxferctl status is a summary (no configuration dump); status --config
 * prints the configuration in effect, one key=value a line. */
TEST(ctl_status_summary_and_config)
{
    daemon_t *d = daemon_start("limits:\n  max_sessions: 77\n");
    char out[16384], args[256];
    snprintf(args, sizeof(args), "--socket %s status", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "requests by state:");
    CHECK(strstr(out, "limits.max_sessions=") == NULL);
    CHECK(strstr(out, "\nconfig:") == NULL);
    snprintf(args, sizeof(args), "--socket %s status --config", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "\nlimits.max_sessions=77\n");
    CHECK(strstr(out, "requests by state:") == NULL);
    snprintf(args, sizeof(args), "--socket %s status --config --json", d->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 2);
    daemon_stop_ok(d);
}

/* kB of daemon d's /proc status field (e.g. "RssShmem:"). */
static long proc_kb(daemon_t *d, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)d->pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    long kb = -1;
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, field, strlen(field)))
            kb = atol(line + strlen(field));
    fclose(f);
    return kb;
}

/* Sparse pools: a client declares two 256 MiB host pools and touches a
 * few blocks. The daemon maps in only the pages the memfd holds and the
 * ones a transfer writes, never the holes: a page the daemon faults in
 * first is charged to its memory cgroup (before, it faulted in the whole
 * span, +512 MiB charged to the daemon here). */
TEST_T(sparse_pools_not_faulted_in, 60)
{
    daemon_t *d = daemon_start(NULL);
    rank_t c, g;
    side_t cs, gs;
    long before = proc_kb(d, "RssShmem:");
    pair_open(d, &M_BIG, "sp-ctx", "sp-gen", 65536, &c, &g, &cs, &gs);
    CHECK(c.size >= 256u << 20);
    uint32_t cb[2] = {5, 60000}, gb[2] = {17, 40000};
    fill_req(&c, 1, cb, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    sleep_ms(300); /* the pools' populate jobs are done */
    long after = proc_kb(d, "RssShmem:");
    fprintf(stderr,
            "daemon RssShmem: %ld kB before, %ld kB after, pools "
            "of %llu MiB each\n",
            before, after, (unsigned long long)(c.size >> 20));
    CHECK(after - before < 16 * 1024);
    expect_t e = {1, gb, 8, 0};
    CHECK_EQ(check_pool(&g, &e, 1, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop(d);
}

/* The Cpus_allowed_list of the thread whose /proc status file is path
 * ("0-3,8"), into out; 0 if the file has none. Its Name too, if asked. */
static int status_cpus(const char *path, char out[64], char name[32])
{
    char *t = read_file(path);
    const char *c = strstr(t, "Cpus_allowed_list:\t");
    const char *nm = strstr(t, "Name:\t");
    if (c)
        snprintf(out, 64, "%.*s", (int)strcspn(c + 19, "\n"), c + 19);
    if (name)
        snprintf(name, 32, "%.*s", nm ? (int)strcspn(nm + 6, "\n") : 0,
                 nm ? nm + 6 : "");
    free(t);
    return c != NULL;
}

/* The Cpus_allowed_list of each of pid's copy workers (kvx-copy-N),
 * by N; returns how many were found. */
static int copy_worker_cpus_now(pid_t pid, char out[][64], int max)
{
    char path[128];
    snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
    DIR *dir = opendir(path);
    CHECK(dir != NULL);
    int found = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        char p[400], cpus[64], name[32];
        unsigned n;
        snprintf(p, sizeof(p), "%s/%s/status", path, e->d_name);
        if (e->d_name[0] != '.' && status_cpus(p, cpus, name) &&
            sscanf(name, "kvx-copy-%u", &n) == 1 && (int)n < max) {
            memcpy(out[n], cpus, sizeof(cpus));
            found++;
        }
    }
    closedir(dir);
    return found;
}

/* The same once all max workers have named themselves (each does so as
 * it starts, which may come after the socket answers: up to 5 s). */
static int copy_worker_cpus(pid_t pid, char out[][64], int max)
{
    int found = 0;
    for (int64_t end = now_ms() + 5000;
         (found = copy_worker_cpus_now(pid, out, max)) < max && now_ms() < end;)
        sleep_ms(10);
    return found;
}

/* copy.pin_threads 1: each worker on a CPU of its own, in turn over the
 * CPUs the daemon may use; 0: left to the scheduler; 2 (the default):
 * as 1 with fewer than 4 of them, else as 0. */
TEST(copy_workers_pinned_one_cpu_each)
{
    cpu_set_t allowed;
    CHECK_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
    int ncpu = CPU_COUNT(&allowed);
    char mine[64];
    CHECK(status_cpus("/proc/self/status", mine, NULL));
    daemon_t *d =
        daemon_start("copy:\n  worker_threads: 3\n  pin_threads: 1\n");
    char cpus[3][64];
    CHECK_EQ(copy_worker_cpus(d->pid, cpus, 3), 3);
    if (ncpu < 2) {
        for (int k = 0; k < 3; k++) /* nothing to spread over */
            CHECK(strcmp(cpus[k], mine) == 0);
    } else {
        for (int k = 0; k < 3; k++) {
            int cpu = -1;
            char end = 0;
            CHECK_EQ(sscanf(cpus[k], "%d%c", &cpu, &end), 1); /* one CPU */
            CHECK(CPU_ISSET(cpu, &allowed));
        }
        CHECK(strcmp(cpus[0], cpus[1]) != 0); /* two CPUs: two workers */
        if (ncpu == 2) /* in turn: the third shares the first's */
            CHECK(strcmp(cpus[2], cpus[0]) == 0);
        else
            CHECK(strcmp(cpus[2], cpus[0]) && strcmp(cpus[2], cpus[1]));
    }
    daemon_stop_ok(d);

    d = daemon_start("copy:\n  worker_threads: 2\n  pin_threads: 0\n");
    CHECK_EQ(copy_worker_cpus(d->pid, cpus, 2), 2);
    CHECK(strcmp(cpus[0], mine) == 0);
    CHECK(strcmp(cpus[1], mine) == 0);
    daemon_stop_ok(d);

    d = daemon_start("copy:\n  worker_threads: 2\n"); /* the default, 2 */
    CHECK_EQ(copy_worker_cpus(d->pid, cpus, 2), 2);
    if (ncpu >= 2 && ncpu < 4)
        CHECK(strcmp(cpus[0], cpus[1]) != 0 && strcmp(cpus[0], mine) != 0);
    else
        CHECK(strcmp(cpus[0], mine) == 0 && strcmp(cpus[1], mine) == 0);
    daemon_stop_ok(d);
}

/* ---- kvxferd --version ------------------------------------------------ */

/* The version the UCX library in file reports, asked in a child (UCX's
 * constructors and memory hooks stay out of this process); "" when it
 * cannot be opened. */
static void ucx_version_of(const char *file, char *out, size_t cap)
{
    int fds[2];
    CHECK_EQ(pipe(fds), 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
        void (*get)(unsigned *, unsigned *, unsigned *) =
            h ? (void (*)(unsigned *, unsigned *, unsigned *))dlsym(
                    h, "ucp_get_version")
              : NULL;
        if (get) {
            unsigned a, b, c;
            get(&a, &b, &c);
            dprintf(fds[1], "%u.%u.%u", a, b, c);
        }
        _exit(0);
    }
    close(fds[1]);
    ssize_t n = 0, k;
    while (n < (ssize_t)cap - 1 && (k = read(fds[0], out + n, cap - 1 - n)) > 0)
        n += k;
    out[n > 0 ? n : 0] = 0;
    close(fds[0]);
    waitpid(pid, NULL, 0);
}

/* kvxferd --version names the UCX it was built against and the one the
 * loader found, with its file: that file reports that version, and a
 * running daemon has that file mapped. */
TEST(version_names_ucx)
{
    char out[2048], cmd[512];
    snprintf(cmd, sizeof(cmd), "%s/kvxferd --version 2>&1", build_dir());
    CHECK_EQ(cmd_run(cmd, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "kvxferd ");
    const char *u = strstr(out, "UCX: built against ");
    CHECK(u != NULL);
    char built[32], loaded[32], file[512];
    CHECK_EQ(sscanf(u, "UCX: built against %31[^,], loaded %31s (%511[^)])",
                    built, loaded, file),
             3);
    unsigned a, b;
    CHECK_EQ(sscanf(built, "%u.%u", &a, &b), 2);
    char seen[32];
    ucx_version_of(file, seen, sizeof(seen));
    CHECK_STR_CONTAINS(seen, loaded);
    CHECK_EQ(strlen(seen), strlen(loaded));

    char real[512], maps[64], line[1024];
    CHECK(realpath(file, real) != NULL);
    daemon_t *d = daemon_start(NULL);
    snprintf(maps, sizeof(maps), "/proc/%d/maps", (int)d->pid);
    FILE *f = fopen(maps, "r");
    CHECK(f != NULL);
    int mapped = 0;
    while (!mapped && fgets(line, sizeof(line), f))
        mapped = strstr(line, real) != NULL;
    fclose(f);
    CHECK(mapped);
    daemon_stop_ok(d);
}
