/*
 * peer_tests.c — cross-daemon transfers (issue #4): two kvxferd, A and B,
 * each in its own network namespace, joined by a veth pair
 * (10.X.0.1/24 in A, 10.X.0.2/24 in B), talking UCX over it. Included by
 * integration.c, whose harness it uses: daemons, ranks, the reference
 * pattern, events.
 *
 * Client processes stay in our namespace: the daemons' unix sockets are on
 * the shared filesystem. The namespaces, the veth and the secrets dir are
 * named after the test process's pid and removed by h_cleanup (on failure
 * and on the alarm too); ones left by a test that was killed outright are
 * removed by the next peer test.
 *
 * Without network namespaces (not root, no iproute2) both daemons run in
 * our namespace on 127.0.0.1 and one line says so; KVX_PEER_LOOPBACK=1
 * forces that. The link-down test then freezes daemon A (SIGSTOP: it falls
 * silent like a cut link) instead of cutting a link it does not have.
 */
#include <dirent.h>

#define P_SECRET "kvxfer-integration-cluster-secret-0001"
#define P_SECRET_OTHER "another-cluster-secret-not-the-same"
#define P_KA_TIMEOUT_MS 1000 /* peer.keepalive_timeout_ms of every daemon */
#define P_BOUND_MS (P_KA_TIMEOUT_MS + 1500) /* a lost peer's requests end */

typedef struct peer_net {
    int netns;        /* 1: namespaces A and B; 0: loopback */
    char ns[2][32];   /* kvxA-PID, kvxB-PID */
    char veth[2][16]; /* kvxaPID in A, kvxbPID in B */
    char ip[2][20];   /* what each daemon listens on */
    char dir[64];     /* secrets */
} peer_net_t;

static peer_net_t p_net;

/* Run a shell command quietly; its exit status (-1: could not run). Its
 * output's first line goes to why, when given. */
static int p_sh(char *why, size_t whylen, const char *fmt, ...)
{
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    char full[600];
    snprintf(full, sizeof(full), "(%s) 2>&1", cmd);
    fflush(stdout);
    fflush(stderr);
    FILE *f = popen(full, "r");
    if (!f) {
        if (why)
            snprintf(why, whylen, "popen: %s", strerror(errno));
        return -1;
    }
    char line[256] = "";
    char first[256] = "";
    while (fgets(line, sizeof(line), f))
        if (!first[0])
            memcpy(first, line, sizeof(first));
    int st = pclose(f);
    int rc = st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    if (why && rc) {
        first[strcspn(first, "\n")] = 0;
        if (first[0])
            snprintf(why, whylen, "%.150s: %.140s", cmd, first);
        else
            snprintf(why, whylen, "%.150s: exit %d", cmd, rc);
    }
    return rc;
}

/* What a peer test leaves on the machine: the namespaces (the veth pair
 * goes with them) and the secrets. Called by h_cleanup after the daemons
 * are dead. */
static void p_teardown(void)
{
    if (getpid() != h_owner)
        return;
    if (p_net.netns)
        for (int i = 0; i < 2; i++)
            p_sh(NULL, 0, "ip netns del %s", p_net.ns[i]);
    p_net.netns = 0;
    if (p_net.dir[0])
        p_sh(NULL, 0, "rm -rf '%s'", p_net.dir);
    p_net.dir[0] = 0;
}

/* Namespaces and dirs of peer tests whose process is gone (killed before
 * its cleanup ran). */
static void p_remove_stale(void)
{
    DIR *d = opendir("/var/run/netns");
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            char side;
            int pid;
            if (sscanf(e->d_name, "kvx%c-%d", &side, &pid) == 2 &&
                (side == 'A' || side == 'B') && pid > 0 && kill(pid, 0) < 0 &&
                errno == ESRCH)
                p_sh(NULL, 0, "ip netns del %s", e->d_name);
        }
        closedir(d);
    }
    d = opendir("/tmp");
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            int pid;
            if (sscanf(e->d_name, "kvx-peer-%d", &pid) == 1 && pid > 0 &&
                kill(pid, 0) < 0 && errno == ESRCH)
                p_sh(NULL, 0, "rm -rf '/tmp/%s'", e->d_name);
        }
        closedir(d);
    }
}

/* The two namespaces and the veth between them; 0, or -1 with why. */
static int p_netns_up(char *why, size_t whylen)
{
    int pid = (int)getpid();
    int x = 64 + pid % 128; /* 10.X.0.0/24; any X works inside the pair */
    snprintf(p_net.ns[0], sizeof(p_net.ns[0]), "kvxA-%d", pid);
    snprintf(p_net.ns[1], sizeof(p_net.ns[1]), "kvxB-%d", pid);
    snprintf(p_net.veth[0], sizeof(p_net.veth[0]), "kvxa%d", pid);
    snprintf(p_net.veth[1], sizeof(p_net.veth[1]), "kvxb%d", pid);
    snprintf(p_net.ip[0], sizeof(p_net.ip[0]), "10.%d.0.1", x);
    snprintf(p_net.ip[1], sizeof(p_net.ip[1]), "10.%d.0.2", x);
    if (p_sh(why, whylen, "ip netns add %s", p_net.ns[0]))
        return -1;
    p_net.netns = 1; /* from here on p_teardown removes what exists */
    if (p_sh(why, whylen, "ip netns add %s", p_net.ns[1]) ||
        p_sh(why, whylen,
             "ip link add %s netns %s type veth peer name %s netns %s",
             p_net.veth[0], p_net.ns[0], p_net.veth[1], p_net.ns[1]))
        return -1;
    for (int i = 0; i < 2; i++)
        if (p_sh(why, whylen, "ip -n %s addr add %s/24 dev %s", p_net.ns[i],
                 p_net.ip[i], p_net.veth[i]) ||
            p_sh(why, whylen, "ip -n %s link set lo up", p_net.ns[i]) ||
            p_sh(why, whylen, "ip -n %s link set %s up", p_net.ns[i],
                 p_net.veth[i]))
            return -1;
    return 0;
}

/* Set up the network for this test: namespaces, or loopback. */
static void p_setup(void)
{
    h_init();
    CHECK(h_cleanup_hook == NULL);
    p_remove_stale();
    memset(&p_net, 0, sizeof(p_net));
    h_cleanup_hook = p_teardown;
    snprintf(p_net.dir, sizeof(p_net.dir), "/tmp/kvx-peer-%d", (int)getpid());
    p_sh(NULL, 0, "rm -rf '%s'", p_net.dir);
    CHECK(mkdir(p_net.dir, 0700) == 0);
    char why[300] = "";
    const char *lo = getenv("KVX_PEER_LOOPBACK");
    int up = -1;
    if (lo && *lo && strcmp(lo, "0"))
        snprintf(why, sizeof(why), "KVX_PEER_LOOPBACK is set");
    else
        up = p_netns_up(why, sizeof(why));
    if (up) {
        p_teardown(); /* whatever half of it exists */
        snprintf(p_net.dir, sizeof(p_net.dir), "/tmp/kvx-peer-%d",
                 (int)getpid());
        CHECK(mkdir(p_net.dir, 0700) == 0);
        p_net.netns = 0;
        snprintf(p_net.ip[0], sizeof(p_net.ip[0]), "127.0.0.1");
        snprintf(p_net.ip[1], sizeof(p_net.ip[1]), "127.0.0.1");
        fprintf(stderr,
                "peer tests: network namespaces unavailable (%s); using "
                "loopback\n",
                why);
    }
}

/* Start daemon A (side 0) or B (side 1) in its namespace, with the
 * cluster secret given and the test's keep-alive. peer_extra: more lines
 * of the peer section; extra: whole sections. */
/* peer.keepalive_timeout_ms of the daemons p_daemon() starts (a test that
 * needs a longer one sets it first; each test runs in a process of its
 * own) */
static int p_ka_timeout_ms = P_KA_TIMEOUT_MS;

static daemon_t *p_daemon(int side, const char *secret, const char *peer_extra,
                          const char *extra)
{
    CHECK(p_net.dir[0]); /* p_setup first */
    char path[128];
    snprintf(path, sizeof(path), "%s/secret-%c", p_net.dir, "AB"[side]);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0);
    CHECK(fchmod(fd, 0600) == 0); /* whatever the umask */
    CHECK(write(fd, secret, strlen(secret)) == (ssize_t)strlen(secret));
    CHECK(close(fd) == 0);
    char cfg[2048];
    snprintf(cfg, sizeof(cfg),
             "peer:\n"
             "  listen: \"%s:0\"\n"
             "  secret_file: %s\n"
             "  keepalive_interval_ms: 200\n"
             "  keepalive_timeout_ms: %d\n"
             "%s%s",
             p_net.ip[side], path, p_ka_timeout_ms,
             peer_extra ? peer_extra : "", extra ? extra : "");
    h_netns = p_net.netns ? p_net.ns[side] : NULL;
    daemon_t *d = daemon_start(cfg);
    h_netns = NULL;
    return d;
}

/* The address a rank got from daemon side: kvx://IP:PORT/<16 hex>, PORT
 * the bound one. *ipport gets "IP:PORT". */
static void p_check_addr(const rank_t *r, int side, char *ipport, size_t len)
{
    char want[64];
    snprintf(want, sizeof(want), "kvx://%s:", p_net.ip[side]);
    if (strncmp(r->addr, want, strlen(want))) {
        fprintf(stderr, "daemon %c address \"%s\", expected \"%s...\"\n",
                side ? 'B' : 'A', r->addr, want);
        CHECK(!"address names the peer.listen IP");
    }
    const char *port = r->addr + strlen(want);
    char *end;
    long p = strtol(port, &end, 10);
    CHECK(end > port && p > 0 && p < 65536 && *end == '/');
    CHECK_EQ(strlen(end + 1), 16);
    CHECK_EQ(strspn(end + 1, "0123456789abcdef"), 16);
    if (ipport) {
        size_t n = (size_t)(end - (r->addr + 6));
        CHECK(n < len);
        memcpy(ipport, r->addr + 6, n);
        ipport[n] = 0;
    }
}

static void p_side(side_t *s, const char *inst, kvx_role_t role,
                   const char *preset, uint32_t tpb)
{
    *s = (side_t){.inst = inst,
                  .role = role,
                  .tp = 1,
                  .pp = 1,
                  .preset = preset,
                  .tpb = tpb};
}

/* A side of tp 2 (vllm-nhd, 4 tokens a block): rank 0 on daemon A and
 * rank 1 on daemon B make a spread instance. */
static void p_side2(side_t *s, const char *inst, kvx_role_t role)
{
    p_side(s, inst, role, "vllm-nhd", 4);
    s->tp = 2;
}

/* Rank 0 of the p_side2() instance s on daemon a and rank 1 on daemon b
 * say Hello; addrs gets their addresses in rank order, for kvx_join(). */
static void p_spread_hello(daemon_t *a, daemon_t *b, const side_t *s,
                           rank_t *r0, rank_t *r1, const char *addrs[2])
{
    rank_hello_only(a, &M_SMALL, s, 0, r0);
    rank_hello_only(b, &M_SMALL, s, 1, r1);
    addrs[0] = r0->addr;
    addrs[1] = r1->addr;
}

/* p_spread_hello(), then both ranks join and get pools of nblocks. */
static void p_spread_open(daemon_t *a, daemon_t *b, const side_t *s,
                          uint32_t nblocks, rank_t *r0, rank_t *r1)
{
    const char *addrs[2];
    p_spread_hello(a, b, s, r0, r1, addrs);
    CHECK_KVX(kvx_join(r0->c, addrs, 2, T_MS), r0->c);
    CHECK_KVX(kvx_join(r1->c, addrs, 2, T_MS), r1->c);
    rank_pool(r0, nblocks);
    rank_pool(r1, nblocks);
}

/* Rank r (of a context instance) publishes request q on blocks 2 and 3
 * and cancels it: one CANCELLED event for the instance's batches, no
 * bytes moved. */
static void p_cancelled(rank_t *r, uint64_t q)
{
    static const uint32_t cb[2] = {2, 3};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(r->c, q, r->pool, cb, 2, 7, &p, T_MS), r->c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_cancel(r->c, q, T_MS), r->c);
}

/* Daemons A and B with the cluster secret; peer: more lines of their
 * peer sections (NULL: the default settings). */
static void p_two_daemons_with(const char *peer, daemon_t **a,
                               daemon_t **b)
{
    p_setup();
    *a = p_daemon(0, P_SECRET, peer, NULL);
    *b = p_daemon(1, P_SECRET, peer, NULL);
}

static void p_two_daemons(daemon_t **a, daemon_t **b)
{
    p_two_daemons_with(NULL, a, b);
}

/* Both daemons are healthy, then stop cleanly. */
static void p_stop_both(daemon_t *a, daemon_t *b)
{
    daemon_healthy(a);
    daemon_healthy(b);
    daemon_stop_ok(a);
    daemon_stop_ok(b);
}

/* A context rank on daemon a and a generation rank on daemon b, each an
 * instance of its own (vllm-nhd, 4 tokens a block, pools of 8 blocks);
 * the sides outlive the ranks, so the caller holds them. */
static void p_pair(daemon_t *a, daemon_t *b, side_t *cs, side_t *gs,
                   const char *ctx, const char *gen, rank_t *c, rank_t *g)
{
    p_side(cs, ctx, KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    p_side(gs, gen, KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_open(a, &M_SMALL, cs, 0, 8, c);
    rank_open(b, &M_SMALL, gs, 0, 8, g);
}

/* Differing bytes of one request's tokens [skip, ntok) in a rank's pool
 * (the rest of the pool is not looked at). */
static uint64_t p_check_req(const rank_t *r, uint64_t req,
                            const uint32_t *blocks, uint32_t ntok,
                            uint32_t skip)
{
    const kvx_layout_t *l = &r->lay;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    uint8_t row[4096];
    CHECK(rowbytes <= sizeof(row));
    uint64_t bad = 0;
    for (uint32_t t = skip; t < ntok; t++)
        for (uint32_t ly = 0; ly < l->num_layers; ly++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t h = 0; h < l->num_heads; h++) {
                    row_fill(row, rowbytes, req, r->layer0 + ly, kv, t,
                             r->head0 + h);
                    const uint8_t *p =
                        r->base +
                        kvx_layout_offset(l, ly, kv,
                                          blocks[t / l->tokens_per_block],
                                          t % l->tokens_per_block, h);
                    if (memcmp(row, p, rowbytes))
                        for (uint32_t i = 0; i < rowbytes; i++)
                            bad += row[i] != p[i];
                }
    if (bad)
        fprintf(stderr, "%s rank %u request %llu: %llu bytes differ\n",
                r->s->inst, r->rank, (unsigned long long)req,
                (unsigned long long)bad);
    return bad;
}

/* One request c -> g, both COMPLETE, the bytes checked. */
static void p_one(rank_t *c, rank_t *g, uint64_t req, const uint32_t *cb,
                  const uint32_t *gb, uint32_t nb, uint32_t ntok,
                  int timeout_ms)
{
    fill_req(c, req, cb, ntok);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c->c, req, c->pool, cb, nb, ntok, &p, T_MS), c->c);
    CHECK_KVX(kvx_fetch(g->c, req, p.data, p.len, g->pool, gb, nb, 0, T_MS),
              g->c);
    wait_event(g->c, req, KVX_EVENT_COMPLETE, 0, timeout_ms);
    wait_event(c->c, req, KVX_EVENT_COMPLETE, 0, timeout_ms);
    CHECK_EQ(p_check_req(g, req, gb, ntok, 0), 0);
    kvx_context_params_free(&p);
}

/* The JSON value starting at the first '[' or '{' after key ("\"peers\":"),
 * up to its matching bracket; malloc'd, or NULL when key is absent. */
static char *p_json_section(const char *json, const char *key)
{
    const char *p = strstr(json, key);
    if (!p)
        return NULL;
    p += strlen(key);
    CHECK(*p == '[' || *p == '{');
    int depth = 0, in_str = 0;
    const char *q = p;
    for (; *q; q++) {
        if (in_str) {
            if (*q == '\\' && q[1])
                q++;
            else if (*q == '"')
                in_str = 0;
            continue;
        }
        if (*q == '"')
            in_str = 1;
        else if (*q == '[' || *q == '{')
            depth++;
        else if ((*q == ']' || *q == '}') && --depth == 0)
            break;
    }
    CHECK(*q);
    return strndup(p, (size_t)(q - p + 1));
}

/* Slots A sent whose PULL found them gathered ahead (status). */
static long long p_ahead(daemon_t *a)
{
    char *js = status_json(a);
    char *tx = p_json_section(js, "\"sent\":");
    CHECK(tx != NULL);
    long long n = json_num(tx, "ahead");
    free(tx);
    free(js);
    return n;
}

/* Every slot of d, both directions, comes back free (within 2 s of the
 * last transfer's end): none is leaked. */
static void p_slots_all_free(daemon_t *d)
{
    int64_t end = now_ms() + 2000;
    for (;;) {
        char *js = status_json(d);
        char *ux = p_json_section(js, "\"ucx\":");
        CHECK(ux != NULL);
        long long n = json_num(ux, "slots");
        char *rx = p_json_section(ux, "\"received\":");
        char *tx = p_json_section(ux, "\"sent\":");
        CHECK(rx && tx);
        long long fr = json_num(rx, "free_slots");
        long long ft = json_num(tx, "free_slots");
        free(rx);
        free(tx);
        free(ux);
        free(js);
        if (fr == n && ft == n)
            return;
        if (now_ms() > end) {
            fprintf(stderr, "slots free: %lld of %lld receive, %lld of %lld "
                            "send\n",
                    fr, n, ft, n);
            CHECK(!"every slot comes back");
        }
        sleep_ms(10);
    }
}


/* The status JSON's "peers" array; the test fails without one. */
static char *p_peers(daemon_t *d)
{
    char *json = status_json(d);
    char *peers = p_json_section(json, "\"peers\":");
    if (!peers)
        fprintf(stderr, "no \"peers\" in the status: %s\n", json);
    CHECK(peers != NULL);
    free(json);
    return peers;
}

/* ==== the tests ========================================================== */

/* Context on A, generation on B, and back: every rank its own process,
 * the whole generation pool compared; also a context instance of tp 2
 * whose two sources are both remote. */
TEST_T(peer_transfer_both_directions, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    /* the addresses are the peer.listen IPs with the bound ports */
    rank_t r;
    side_t s;
    p_side(&s, "pb-addr", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    rank_hello_only(a, &M_SMALL, &s, 0, &r);
    p_check_addr(&r, 0, NULL, 0);
    rank_close(&r);
    rank_hello_only(b, &M_SMALL, &s, 0, &r);
    p_check_addr(&r, 1, NULL, 0);
    rank_close(&r);
    side_t c = {
        .inst = "pb-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g = {
        .inst = "pb-gen", .tp = 1, .pp = 1, .preset = "flashinfer", .tpb = 8};
    xfer_case2(a, b, &M_SMALL, &c, &g, 8, 45, 0);
    side_t c2 = {
        .inst = "pb-ctx2", .tp = 2, .pp = 1, .preset = "trtllm", .tpb = 8};
    side_t g2 = {
        .inst = "pb-gen2", .tp = 1, .pp = 1, .preset = "vllm-hnd", .tpb = 4};
    xfer_case2(b, a, &M_SMALL, &c2, &g2, 6, 37, 0);
    /* and with skip_tokens, generation tp 2 */
    side_t c3 = {
        .inst = "pb-ctx3", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    side_t g3 = {
        .inst = "pb-gen3", .tp = 2, .pp = 1, .preset = "vllm-nhd", .tpb = 8};
    xfer_case2(a, b, &M_SMALL, &c3, &g3, 4, 40, 13);
    p_stop_both(a, b);
}

/* Pools inside one memfd between guard bands, across two daemons: the
 * context daemon gathers from an offset pool into its slots, the
 * generation daemon scatters into one; nothing outside moves. */
TEST_T(peer_host_pools_guard_bands, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    uint64_t seed = 41;
    char tag[48];
    for (int k = 0; k < 8; k++) {
        snprintf(tag, sizeof(tag), "pgb%d", k);
        gb_case(k % 2 ? b : a, k % 2 ? a : b, tag, gb_presets[k % 4],
                gb_presets[(k / 2) % 4], &seed);
    }
    p_stop_both(a, b);
}

/* 8 KiB a token: a 300-token request is about 2.4 MB */
static const model_t M_8K = {.layers = 4,
                             .heads = 4,
                             .head_dim = 128,
                             .kv = 2,
                             .dtype = KVX_DTYPE_BF16};

/* Verified transfers of M_8K both ways: a to b, vllm-nhd tp 1 to trtllm
 * tp 2 (n1 requests of up to 300 tokens); b to a, flashinfer tp 2 to
 * vllm-hnd tp 1 (n2 of up to 257, skip 5). Instances named tag-... */
static void p_both_ways(daemon_t *a, daemon_t *b, const char *tag,
                        uint32_t n1, uint32_t n2)
{
    char in[4][32];
    static const char *const what[4] = {"ctx", "gen", "ctx2", "gen2"};
    for (int i = 0; i < 4; i++)
        snprintf(in[i], sizeof(in[i]), "%s-%s", tag, what[i]);
    side_t c = {.inst = in[0], .tp = 1, .pp = 1, .preset = "vllm-nhd",
                .tpb = 16};
    side_t g = {.inst = in[1], .tp = 2, .pp = 1, .preset = "trtllm",
                .tpb = 8};
    xfer_case2(a, b, &M_8K, &c, &g, n1, 300, 0);
    side_t c2 = {.inst = in[2], .tp = 2, .pp = 1, .preset = "flashinfer",
                 .tpb = 8};
    side_t g2 = {.inst = in[3], .tp = 1, .pp = 1, .preset = "vllm-hnd",
                 .tpb = 16};
    xfer_case2(b, a, &M_8K, &c2, &g2, n2, 257, 5);
}

/* What from sent, to received, slot for slot and byte for byte, with no
 * peer error on from. */
static void p_sent_is_received(daemon_t *from, daemon_t *to)
{
    char *jf = status_json(from), *jt = status_json(to);
    char *tx = p_json_section(jf, "\"sent\":");
    char *rx = p_json_section(jt, "\"received\":");
    CHECK(tx && rx);
    if (tx && rx) {
        CHECK(json_num(tx, "slots") > 0);
        CHECK_EQ(json_num(tx, "slots"), json_num(rx, "slots"));
        CHECK_EQ(json_num(tx, "bytes"), json_num(rx, "bytes"));
    }
    char *peers = p_json_section(jf, "\"peers\":");
    CHECK(peers != NULL);
    CHECK_EQ(json_num(peers, "errors"), 0);
    free(peers);
    free(tx);
    free(rx);
    free(jf);
    free(jt);
}

/* A slot larger than peer.message_bytes goes as pieces cut on unit
 * boundaries (here 8 of 64 KiB, two 32 KiB units each), one in flight at
 * a time, each scattered as it lands: every byte lands, both ways, with
 * the presets' different row shapes; then units of 128 KiB, larger than
 * a piece, go one a piece. Status reports the settings and every slot. */
TEST_T(peer_slot_in_pieces, 90)
{
    static const char *const extra = "  slot_bytes: 512KiB\n"
                                      "  message_bytes: 72KiB\n"
                                      "  send_window: 1\n";
    daemon_t *a, *b;
    p_two_daemons_with(extra, &a, &b);
    p_both_ways(a, b, "pp", 4, 3); /* about five slots a request */
    /* 32 heads over tp 2: a unit is 16 tokens x 16 heads x 256 B x 2 */
    static const model_t big = {.layers = 2,
                                .heads = 32,
                                .head_dim = 128,
                                .kv = 2,
                                .dtype = KVX_DTYPE_BF16};
    side_t c3 = {
        .inst = "pp-ctx3", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g3 = {
        .inst = "pp-gen3", .tp = 2, .pp = 1, .preset = "trtllm", .tpb = 16};
    xfer_case2(a, b, &big, &c3, &g3, 3, 100, 0);
    for (int i = 0; i < 2; i++) {
        char *json = status_json(i ? b : a);
        char *ucx = p_json_section(json, "\"ucx\":");
        CHECK(ucx != NULL);
        CHECK_EQ(json_num(ucx, "slot_bytes"), 512 * 1024);
        /* peer.slots 0: as many as fit in 32 MiB */
        CHECK_EQ(json_num(ucx, "slots"), 64);
        CHECK_EQ(json_num(ucx, "message_bytes"), 72 * 1024);
        CHECK_EQ(json_num(ucx, "send_window"), 1);
        free(ucx);
        free(json);
    }
    /* every slot sent was received whole, each way */
    p_sent_is_received(a, b);
    p_sent_is_received(b, a);
    p_slots_all_free(a);
    p_slots_all_free(b);
    p_stop_both(a, b);
}

/* A fetch on B for an offer A's engine already cancelled: A serves every
 * rank of that instance, so its NOT_FOUND is final and the request ends
 * at once (not after the retry window for ranks that have not published
 * yet); an offer that completed likewise. */
TEST_T(peer_open_for_ended_offer, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pe-ctx", "pe-gen", &c, &g);
    uint32_t cb[2] = {4, 5}, gb[2] = {1, 2};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 61, c.pool, cb, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_cancel(c.c, 61, T_MS), c.c);
    wait_event(c.c, 61, KVX_EVENT_CANCELLED, KVX_ERR_CANCELLED, 2000);
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch(g.c, 61, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t e = wait_event(g.c, 61, KVX_EVENT_ERROR, KVX_ERR_NOT_FOUND, 5000);
    int64_t took = now_ms() - t0;
    fprintf(stderr, "NOT_FOUND after %lld ms: %s\n", (long long)took, e.msg);
    CHECK_STR_CONTAINS(e.msg, "expired, cancelled or completed");
    CHECK(strstr(e.msg, "not yet published") == NULL);
    /* the retry window is 2 s; a final answer is one round trip */
    CHECK(took < 1500);
    kvx_context_params_free(&p);

    /* completed, then fetched again with the same params: final too */
    uint32_t gb2[2] = {3, 6};
    p_one(&c, &g, 62, cb, gb, 2, 8, 5000);
    CHECK_KVX(kvx_publish(c.c, 63, c.pool, cb, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 63, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 63, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 63, KVX_EVENT_COMPLETE, 0, 5000);
    t0 = now_ms();
    CHECK_KVX(kvx_fetch(g.c, 64, p.data, p.len, g.pool, gb2, 2, 0, T_MS), g.c);
    e = wait_event(g.c, 64, KVX_EVENT_ERROR, KVX_ERR_NOT_FOUND, 5000);
    took = now_ms() - t0;
    fprintf(stderr, "again: NOT_FOUND after %lld ms: %s\n", (long long)took,
            e.msg);
    CHECK(took < 1500);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* 64 requests in flight at once, half A -> B and half B -> A. */
TEST_T(peer_many_concurrent, 60)
{
    enum { N = 64, H = N / 2, TOK = 10, TPB = 4, NB = 3 };
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    model_t m = {.layers = 2,
                 .heads = 2,
                 .head_dim = 16,
                 .kv = 2,
                 .dtype = KVX_DTYPE_BF16};
    side_t cas, gbs, cbs, gas;
    p_side(&cas, "pm-ctx-a", KVX_ROLE_CONTEXT, "vllm-nhd", TPB);
    p_side(&gbs, "pm-gen-b", KVX_ROLE_GENERATION, "flashinfer", TPB);
    p_side(&cbs, "pm-ctx-b", KVX_ROLE_CONTEXT, "trtllm", TPB);
    p_side(&gas, "pm-gen-a", KVX_ROLE_GENERATION, "vllm-nhd", TPB);
    rank_t ca, gb, cb, ga;
    rank_open(a, &m, &cas, 0, H * NB, &ca);
    rank_open(b, &m, &gbs, 0, H * NB, &gb);
    rank_open(b, &m, &cbs, 0, H * NB, &cb);
    rank_open(a, &m, &gas, 0, H * NB, &ga);
    memset(gb.base, 0xa5, gb.size);
    memset(ga.base, 0xa5, ga.size);
    static uint32_t cbl[N][NB], gbl[N][NB];
    static kvx_context_params_t p[N];
    /* request q < H: ca -> gb; q >= H: cb -> ga */
    for (uint32_t q = 0; q < N; q++) {
        uint32_t k = q % H;
        for (uint32_t i = 0; i < NB; i++) {
            cbl[q][i] = i * H + k;
            gbl[q][i] = (NB - 1 - i) * H + (H - 1 - k);
        }
        rank_t *c = q < H ? &ca : &cb;
        fill_req(c, 3000 + q, cbl[q], TOK);
        CHECK_KVX(
            kvx_publish(c->c, 3000 + q, c->pool, cbl[q], NB, TOK, &p[q], T_MS),
            c->c);
    }
    /* interleaved: both directions in flight together */
    for (uint32_t k = 0; k < H; k++)
        for (uint32_t half = 0; half < 2; half++) {
            uint32_t q = half * H + k;
            rank_t *g = half ? &ga : &gb;
            CHECK_KVX(kvx_fetch(g->c, 3000 + q, p[q].data, p[q].len, g->pool,
                                gbl[q], NB, 0, T_MS),
                      g->c);
        }
    static ev_t e[4][H + 16];
    rank_t *who[4] = {&gb, &ga, &ca, &cb};
    for (int i = 0; i < 4; i++) {
        int n = collect(who[i]->c, e[i], H + 16, H, 15000);
        if (n != H) {
            fprintf(stderr, "%s: %d of %d events\n", who[i]->s->inst, n, H);
            print_events(who[i]->s->inst, e[i], n < H + 16 ? n : H + 16);
        }
        CHECK_EQ(n, H);
    }
    /* nothing more arrives: exactly once */
    for (int i = 0; i < 4; i++) {
        kvx_batch_t *bt;
        CHECK_KVX(kvx_poll(who[i]->c, 1, 100, &bt), who[i]->c);
        CHECK_EQ(bt->num_events, 0);
        kvx_batch_free(bt);
    }
    static expect_t ea[H], eb[H];
    for (uint32_t q = 0; q < N; q++) {
        int half = q >= H;
        expect_event(e[half ? 1 : 0], H, 3000 + q, KVX_EVENT_COMPLETE, 0);
        expect_event(e[half ? 3 : 2], H, 3000 + q, KVX_EVENT_COMPLETE, 0);
        (half ? ea : eb)[q % H] = (expect_t){3000 + q, gbl[q], TOK, 0};
        kvx_context_params_free(&p[q]);
    }
    CHECK_EQ(check_pool(&gb, eb, H, 0xa5), 0);
    CHECK_EQ(check_pool(&ga, ea, H, 0xa5), 0);
    rank_close(&ca);
    rank_close(&gb);
    rank_close(&cb);
    rank_close(&ga);
    p_stop_both(a, b);
}

/* A forged capability token travels to the context daemon and is refused
 * there: the fetch is accepted, then ends ERROR AUTH; nothing is written;
 * the offer stays and the genuine params then complete. */
TEST_T(peer_wrong_token, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pt-ctx", "pt-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    /* connected first, so the bound below is the token check's */
    uint32_t wc[1] = {0}, wg[1] = {7};
    p_one(&c, &g, 30, wc, wg, 1, 3, 5000);
    expect_t ex[2] = {{30, wg, 3, 0}};
    uint32_t cb[2] = {3, 1}, gb[2] = {6, 2};
    fill_req(&c, 31, cb, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 31, c.pool, cb, 2, 8, &p, T_MS), c.c);

    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p.len, p.data);
    CHECK(cp != NULL);
    CHECK_EQ(cp->token.len, 16);
    cp->token.data[5] ^= 0x40;
    size_t flen = kvxfer__context_params__get_packed_size(cp);
    uint8_t *forged = malloc(flen);
    CHECK(forged != NULL);
    kvxfer__context_params__pack(cp, forged);
    kvxfer__context_params__free_unpacked(cp, NULL);
    CHECK_KVX(kvx_fetch(g.c, 31, forged, flen, g.pool, gb, 2, 0, T_MS), g.c);
    free(forged);
    ev_t e = wait_event(g.c, 31, KVX_EVENT_ERROR, KVX_ERR_AUTH, 1000);
    fprintf(stderr, "forged token: \"%s\"\n", e.msg);
    sleep_ms(100);
    CHECK_EQ(check_pool(&g, ex, 1, 0xa5), 0);
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK_STR_CONTAINS(json, "\"request_id\":31,\"side\":\"context\","
                             "\"state\":\"offered\"");
    free(json);

    /* the genuine params: complete, and only now bytes arrive */
    CHECK_KVX(kvx_fetch(g.c, 31, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 31, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 31, KVX_EVENT_COMPLETE, 0, 5000);
    ex[1] = (expect_t){31, gb, 8, 0};
    CHECK_EQ(check_pool(&g, ex, 2, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}

/* B holds another cluster secret: its fetch from A ends ERROR AUTH naming
 * authentication, the refusing daemon logs it, the offer is untouched and
 * both daemons carry on. */
TEST_T(peer_wrong_secret, 60)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    daemon_t *b = p_daemon(1, P_SECRET_OTHER, NULL, NULL);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "ps-ctx", "ps-gen", &c, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t bl[2] = {0, 1};
    fill_req(&c, 41, bl, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 41, c.pool, bl, 2, 8, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 41, p.data, p.len, g.pool, bl, 2, 0, T_MS), g.c);
    /* connect + authentication are bounded by peer.connect_timeout_ms */
    ev_t e = wait_event(g.c, 41, KVX_EVENT_ERROR, KVX_ERR_AUTH, 7000);
    CHECK_STR_CONTAINS(e.msg, "authentication");
    int64_t end = now_ms() + 2000;
    while (!log_contains(a, "authentication failed") &&
           !log_contains(b, "authentication failed") && now_ms() < end)
        sleep_ms(20);
    if (!log_contains(a, "authentication failed") &&
        !log_contains(b, "authentication failed")) {
        dump_tail(a->log, 20);
        dump_tail(b->log, 20);
        CHECK(!"a daemon logs \"authentication failed\"");
    }
    CHECK_EQ(check_pool(&g, NULL, 0, 0xa5), 0);
    /* an unauthenticated peer touched nothing: the offer is still there */
    char *json;
    CHECK_KVX(kvx_requests_json(c.c, &json, T_MS), c.c);
    CHECK_STR_CONTAINS(json, "\"request_id\":41,\"side\":\"context\","
                             "\"state\":\"offered\"");
    free(json);
    daemon_healthy(a);
    daemon_healthy(b);
    /* both still serve local transfers */
    fresh_pair_ok(a, "ps-ctx2", "ps-gen2");
    fresh_pair_ok(b, "ps-ctx3", "ps-gen3");
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(a);
    daemon_stop_ok(b);
}

/* ---- a peer lost mid-transfer ------------------------------------------- */

/* 256 MiB over 64 requests of 4 MiB (M_BIG: 1 KiB a token); small staging
 * so that it moves in many pieces. */
#define PL_REQ 64u
#define PL_TOK 4096u
#define PL_TPB 16u
#define PL_NB (PL_TOK / PL_TPB)
/* slots go as 4 pieces, one at a time: losing the peer also finds
 * pieces waiting in the send window and slots half received */
#define PL_PEER                                                               \
    "  slot_bytes: 1MiB\n  slots: 2\n  message_bytes: 256KiB\n"              \
    "  send_window: 1\n"
/* A with 8 slots and gather-ahead, B pulling into 2: A holds slots
 * gathered for PULLs to come when the transfer ends under it */
#define PL_AHEAD                                                              \
    "  slot_bytes: 1MiB\n  slots: 8\n  message_bytes: 256KiB\n"              \
    "  send_window: 1\n  gather_ahead: 3\n"

typedef struct pl {
    daemon_t *a, *b;
    rank_t c, g; /* context on A, generation on B */
    uint32_t cb[PL_REQ][PL_NB], gb[PL_REQ][PL_NB];
    kvx_context_params_t p[PL_REQ];
    ev_t ge[PL_REQ + 16], ce[PL_REQ + 16];
} pl_t;

/* Throttle the veth (when tc can) so the transfer takes seconds; the
 * queue stays short, so keep-alives are not starved behind data. */
static void pl_throttle(void)
{
    if (!p_net.netns)
        return;
    char why[300];
    for (int i = 0; i < 2; i++)
        if (p_sh(why, sizeof(why),
                 "ip netns exec %s tc qdisc replace dev %s root tbf rate "
                 "800mbit burst 256kb latency 20ms",
                 p_net.ns[i], p_net.veth[i])) {
            fprintf(stderr, "no throttle, full speed (%s)\n", why);
            return;
        }
}

/* Daemons (peer_a, peer_b: their peer sections), ranks, a warm-up
 * request (the peers are connected and keep-alives run), then every
 * request published and fetched; returns once bytes are arriving. */
static pl_t *pl_start_with(const char *peer_a, const char *peer_b)
{
    p_setup();
    pl_t *x = calloc(1, sizeof(*x));
    CHECK(x != NULL);
    x->a = p_daemon(0, P_SECRET, peer_a, NULL);
    x->b = p_daemon(1, P_SECRET, peer_b, NULL);
    pl_throttle();
    static side_t cs, gs; /* the ranks keep pointers to them */
    p_side(&cs, "pl-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", PL_TPB);
    p_side(&gs, "pl-gen", KVX_ROLE_GENERATION, "flashinfer", PL_TPB);
    rank_open(x->a, &M_BIG, &cs, 0, PL_REQ * PL_NB + 4, &x->c);
    rank_open(x->b, &M_BIG, &gs, 0, PL_REQ * PL_NB + 4, &x->g);
    uint32_t wc[2] = {PL_REQ * PL_NB, PL_REQ * PL_NB + 1};
    uint32_t wg[2] = {PL_REQ * PL_NB + 3, PL_REQ * PL_NB + 2};
    p_one(&x->c, &x->g, 1, wc, wg, 2, 2 * PL_TPB - 3, 5000);

    memset(x->g.base, 0xa5, x->g.size);
    for (uint32_t q = 0; q < PL_REQ; q++) {
        for (uint32_t i = 0; i < PL_NB; i++) {
            x->cb[q][i] = q * PL_NB + i;
            x->gb[q][i] = i * PL_REQ + (PL_REQ - 1 - q);
        }
        fill_req(&x->c, 100 + q, x->cb[q], PL_TOK);
    }
    for (uint32_t q = 0; q < PL_REQ; q++)
        CHECK_KVX(kvx_publish(x->c.c, 100 + q, x->c.pool, x->cb[q], PL_NB,
                              PL_TOK, &x->p[q], T_MS),
                  x->c.c);
    for (uint32_t q = 0; q < PL_REQ; q++)
        CHECK_KVX(kvx_fetch(x->g.c, 100 + q, x->p[q].data, x->p[q].len,
                            x->g.pool, x->gb[q], PL_NB, 0, T_MS),
                  x->g.c);
    /* under way: the first row of some request has landed */
    const kvx_layout_t *l = &x->g.lay;
    uint8_t sentinel[128];
    memset(sentinel, 0xa5, sizeof(sentinel));
    int64_t end = now_ms() + 5000;
    for (;;) {
        for (uint32_t q = 0; q < PL_REQ; q++)
            if (memcmp(x->g.base +
                           kvx_layout_offset(l, 0, 0, x->gb[q][0], 0, 0),
                       sentinel, sizeof(sentinel)))
                return x;
        if (now_ms() > end) {
            fprintf(stderr, "no byte arrived within 5 s of the fetches\n");
            CHECK(!"the transfer is under way");
        }
        sleep_ms(1);
    }
}

/* Collect the side's PL_REQ events until deadline; every request once,
 * COMPLETE or ERROR PEER_GONE. Returns the number of errors; done[q] is
 * set for the complete ones. */
static int pl_collect(kvx_client_t *c, ev_t *ev, int64_t deadline,
                      const char *who, int *done)
{
    int64_t left = deadline - now_ms();
    int n = collect(c, ev, PL_REQ + 16, PL_REQ, left > 300 ? (int)left : 300);
    if (n != (int)PL_REQ) {
        fprintf(stderr,
                "%s: %d of %u requests ended within %d ms of losing the "
                "peer\n",
                who, n, PL_REQ, P_BOUND_MS);
        print_events(who, ev, n < (int)PL_REQ + 16 ? n : (int)PL_REQ + 16);
        CHECK_EQ(n, PL_REQ);
    }
    int errors = 0;
    for (uint32_t q = 0; q < PL_REQ; q++) {
        int count = 0;
        const ev_t *e = NULL;
        for (int i = 0; i < n; i++)
            if (ev[i].req == 100 + q) {
                e = &ev[i];
                count++;
            }
        if (count != 1 ||
            !(e->kind == KVX_EVENT_COMPLETE ||
              (e->kind == KVX_EVENT_ERROR && e->code == KVX_ERR_PEER_GONE))) {
            fprintf(stderr,
                    "%s: request %u: expected one COMPLETE or ERROR "
                    "PEER_GONE, got %d event(s)\n",
                    who, 100 + q, count);
            print_events(who, ev, n);
            CHECK(!"COMPLETE or ERROR PEER_GONE");
        }
        done[q] = e->kind == KVX_EVENT_COMPLETE;
        errors += !done[q];
    }
    fprintf(stderr, "%s: %u requests: %d PEER_GONE, %u complete\n", who, PL_REQ,
            errors, PL_REQ - errors);
    return errors;
}

/* The generation side's outcome: the complete requests hold their bytes;
 * some request was cut (else the transfer ended before the peer was
 * lost, and nothing was tested). */
static void pl_gen_outcome(pl_t *x, int64_t t_lost, int *gdone)
{
    int errors =
        pl_collect(x->g.c, x->ge, t_lost + P_BOUND_MS, "generation", gdone);
    if (errors == 0)
        fprintf(stderr, "every request completed before the peer was lost: "
                        "make the transfer bigger\n");
    CHECK(errors > 0);
    for (uint32_t q = 0; q < PL_REQ; q++)
        if (gdone[q])
            CHECK_EQ(p_check_req(&x->g, 100 + q, x->gb[q], PL_TOK, 0), 0);
}

static void pl_free(pl_t *x)
{
    for (uint32_t q = 0; q < PL_REQ; q++)
        kvx_context_params_free(&x->p[q]);
    free(x);
}

/* Both ranks leave, both daemons are healthy and stop cleanly. */
static pl_t *pl_start(void) { return pl_start_with(PL_PEER, PL_PEER); }

static void pl_finish(pl_t *x)
{
    rank_close(&x->c);
    rank_close(&x->g);
    p_stop_both(x->a, x->b);
    pl_free(x);
}

/* The link between the daemons goes down mid-transfer: both sides end
 * every affected request ERROR PEER_GONE within the keep-alive timeout
 * (+ a tick); with the link back, a new transfer completes. */
TEST_T(peer_link_down_mid_transfer, 90)
{
    pl_t *x = pl_start();
    int64_t t_lost = now_ms();
    if (p_net.netns) {
        char why[300];
        if (p_sh(why, sizeof(why), "ip -n %s link set %s down", p_net.ns[0],
                 p_net.veth[0])) {
            fprintf(stderr, "%s\n", why);
            CHECK(!"link down");
        }
        t_lost = now_ms(); /* down by now */
    } else {
        fprintf(stderr, "peer_link_down_mid_transfer: loopback, no link to "
                        "cut: daemon A is frozen (SIGSTOP) instead\n");
        CHECK(kill(x->a->pid, SIGSTOP) == 0);
    }
    static int gdone[PL_REQ], cdone[PL_REQ];
    pl_gen_outcome(x, t_lost, gdone);
    int64_t t_back = now_ms();
    if (!p_net.netns) {
        CHECK(kill(x->a->pid, SIGCONT) == 0);
        t_lost = t_back; /* A learns it from now on */
    }
    int errors =
        pl_collect(x->c.c, x->ce, t_lost + P_BOUND_MS, "context", cdone);
    CHECK(errors > 0);
    /* delivered on the context side means delivered on the generation
     * side (the reverse may differ: the last acknowledgement may be lost) */
    for (uint32_t q = 0; q < PL_REQ; q++)
        if (cdone[q] && !gdone[q]) {
            fprintf(stderr, "request %u: context COMPLETE, generation not\n",
                    100 + q);
            CHECK(!"context complete implies generation complete");
        }

    if (p_net.netns) {
        char why[300];
        if (p_sh(why, sizeof(why), "ip -n %s link set %s up", p_net.ns[0],
                 p_net.veth[0])) {
            fprintf(stderr, "%s\n", why);
            CHECK(!"link up");
        }
    }
    /* the next use reconnects (within peer.connect_timeout_ms) */
    uint32_t nc[3] = {PL_REQ * PL_NB + 2, PL_REQ * PL_NB, PL_REQ * PL_NB + 1};
    uint32_t ng[3] = {0, PL_NB, 2 * PL_NB};
    p_one(&x->c, &x->g, 7000, nc, ng, 3, 3 * PL_TPB - 5, 8000);
    char *peers = p_peers(x->b);
    CHECK_STR_CONTAINS(peers, "\"state\":\"connected\"");
    free(peers);
    pl_finish(x);
}

/* Daemon A is SIGKILLed mid-transfer: B ends its requests ERROR PEER_GONE
 * within the keep-alive bound and stays healthy. */
TEST_T(peer_killed_mid_transfer, 90)
{
    pl_t *x = pl_start();
    int64_t t_lost = now_ms();
    CHECK(kill(x->a->pid, SIGKILL) == 0);
    int st = daemon_wait(x->a, 2000);
    CHECK(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    static int gdone[PL_REQ];
    pl_gen_outcome(x, t_lost, gdone);
    daemon_healthy(x->b);
    /* B lists A as lost (or has already dropped it) */
    char *peers = p_peers(x->b);
    CHECK(strstr(peers, "\"state\":\"connected\"") == NULL);
    free(peers);
    /* B's pool of the dead transfer can go, and local transfers work */
    CHECK_KVX(kvx_pool_deregister(x->g.c, x->g.pool, T_MS), x->g.c);
    fresh_pair_ok(x->b, "pk-ctx2", "pk-gen2");
    rank_close(&x->c);
    rank_close(&x->g);
    daemon_healthy(x->b);
    daemon_stop_ok(x->b);
    pl_free(x);
}

/* Daemon A (context) drained by SIGTERM mid-transfer: it tells B, whose
 * requests each end once (COMPLETE with their bytes, or ERROR SHUTDOWN /
 * PEER_GONE) within the keep-alive bound; A exits 0; B stays healthy. */
static void pl_drain_a(pl_t *x)
{
    int64_t t0 = now_ms();
    CHECK(kill(x->a->pid, SIGTERM) == 0);
    int n = collect(x->g.c, x->ge, PL_REQ + 16, PL_REQ, P_BOUND_MS);
    CHECK(now_ms() - t0 <= P_BOUND_MS + 500);
    CHECK_EQ(n, PL_REQ);
    int errors = 0;
    for (uint32_t q = 0; q < PL_REQ; q++) {
        int count = 0;
        const ev_t *e = NULL;
        for (int i = 0; i < n; i++)
            if (x->ge[i].req == 100 + q) {
                count++;
                e = &x->ge[i];
            }
        CHECK_EQ(count, 1);
        if (e->kind == KVX_EVENT_COMPLETE) {
            CHECK_EQ(p_check_req(&x->g, 100 + q, x->gb[q], PL_TOK, 0), 0);
        } else {
            CHECK_EQ(e->kind, KVX_EVENT_ERROR);
            CHECK(e->code == KVX_ERR_SHUTDOWN || e->code == KVX_ERR_PEER_GONE);
            errors++;
        }
    }
    CHECK(errors > 0);
    int st = daemon_wait(x->a, 10000);
    CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    daemon_healthy(x->b);
    rank_close(&x->c);
    rank_close(&x->g);
    daemon_stop_ok(x->b);
    pl_free(x);
}

TEST_T(peer_drained_mid_transfer, 90) { pl_drain_a(pl_start()); }

/* ---- an instance spread over the two daemons ---------------------------- */

#define SP_N 16

typedef struct sp_shared {
    _Atomic int hello, connected, done1, fetched900, rank1_ready, b_killed;
    char addr[2][192];
    pslot_t slots[SP_N];
    pslot_t slot900;
    uint32_t nb[2];
    ls_batch_t b[2][LS_MAXB];
} sp_shared_t;

typedef struct sp_arg {
    daemon_t *d;
    sp_shared_t *sh;
    uint32_t rank;
} sp_arg_t;

/* Generation rank 0 on A, rank 1 on B, both joined with [A, B]: the same
 * fetches and polls on both (ls_plan), batches recorded for the parent.
 * Then request 900, fetched by rank 0 only, and B killed. */
static void sp_rank_main(void *arg)
{
    sp_arg_t *a = arg;
    sp_shared_t *sh = a->sh;
    static side_t gs;
    p_side2(&gs, "sp-gen", KVX_ROLE_GENERATION);
    rank_t g;
    rank_hello_only(a->d, &M_LS, &gs, a->rank, &g);
    p_check_addr(&g, (int)a->rank, NULL, 0);
    snprintf(sh->addr[a->rank], sizeof(sh->addr[a->rank]), "%s", g.addr);
    barrier(&sh->hello, 2);
    const char *addrs[2] = {sh->addr[0], sh->addr[1]};
    CHECK_KVX(kvx_join(g.c, addrs, 2, T_MS), g.c);
    rank_pool(&g, SP_N * 2 + 2);
    memset(g.base, 0xa5, g.size);
    barrier(&sh->connected, 3);
    uint32_t next = 0, seen = 0, nb = 0;
    uint32_t blocks[2];
    size_t np = sizeof(ls_plan) / sizeof(ls_plan[0]);
    for (uint32_t step = 0; seen < SP_N || step < np; step++) {
        CHECK(step < 60);
        uint32_t wave = SP_N, at_least = step % 2 ? 1000 : 3,
                 tmo = step % 2 ? 40 : 400;
        if (step < np) {
            wave = ls_plan[step].wave;
            at_least = ls_plan[step].at_least;
            tmo = ls_plan[step].timeout_ms;
        }
        for (uint32_t i = 0; i < wave && next < SP_N; i++, next++) {
            pslot_t *s = &sh->slots[next];
            blocks[0] = 2 * next + 1;
            blocks[1] = 2 * next;
            CHECK_KVX(kvx_fetch(g.c, 600 + next, s->data, s->len, g.pool,
                                blocks, 2, 0, T_MS),
                      g.c);
        }
        kvx_batch_t *b;
        CHECK_KVX(kvx_poll(g.c, at_least, tmo, &b), g.c);
        CHECK(nb < LS_MAXB);
        ls_batch_t *r = &sh->b[a->rank][nb++];
        r->seq = b->seq;
        r->n = b->num_events;
        r->at_least = at_least;
        CHECK(b->num_events <= LS_MAXE);
        for (uint32_t i = 0; i < b->num_events; i++) {
            r->req[i] = b->events[i].request_id;
            r->kind[i] = b->events[i].kind;
            if (b->events[i].kind != KVX_EVENT_COMPLETE)
                fprintf(stderr, "rank %u: request %llu %s %s: %s\n", a->rank,
                        (unsigned long long)b->events[i].request_id,
                        kind_name(b->events[i].kind),
                        kvx_status_name(b->events[i].code),
                        b->events[i].message);
        }
        seen += b->num_events;
        kvx_batch_free(b);
    }
    sh->nb[a->rank] = nb;
    CHECK_EQ(seen, SP_N);
    static expect_t e[SP_N];
    static uint32_t bt[SP_N][2];
    for (uint32_t q = 0; q < SP_N; q++) {
        bt[q][0] = 2 * q + 1;
        bt[q][1] = 2 * q;
        e[q] = (expect_t){600 + q, bt[q], 7, 0};
    }
    CHECK_EQ(check_pool(&g, e, SP_N, 0xa5), 0);
    barrier(&sh->done1, 3);

    /* request 900: rank 0 fetches, rank 1 never will, B dies */
    if (a->rank == 1) {
        atomic_store(&sh->rank1_ready, 1);
        wait_count(&sh->b_killed, 1);
        rank_close(&g);
        return;
    }
    slot_wait(&sh->slot900);
    uint32_t b900[2] = {2 * SP_N, 2 * SP_N + 1};
    CHECK_KVX(kvx_fetch(g.c, 900, sh->slot900.data, sh->slot900.len, g.pool,
                        b900, 2, 0, T_MS),
              g.c);
    atomic_store(&sh->fetched900, 1);
    wait_count(&sh->b_killed, 1);
    ev_t ev =
        wait_event(g.c, 900, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, P_BOUND_MS);
    fprintf(stderr, "rank 0 after B died: request 900 %s \"%s\"\n",
            kvx_status_name(ev.code), ev.msg);
    rank_close(&g);
}

/* wait_count for the test process: when a rank failed it exits through
 * exit(), so h_cleanup shows the logs and removes the namespaces. */
static void p_wait_count(_Atomic int *ctr, int n)
{
    int64_t end = now_ms() + 15000;
    while (atomic_load(ctr) < n) {
        if (failed_flag()) {
            fprintf(stderr, "a rank process failed\n");
            exit(1);
        }
        if (now_ms() > end) {
            fprintf(stderr, "p_wait_count: %d of %d after 15 s\n",
                    atomic_load(ctr), n);
            exit(1);
        }
        sleep_ms(1);
    }
}

TEST_T(peer_spread_instance_batches, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    sp_shared_t *sh = shm_alloc(sizeof(*sh));
    sp_arg_t args[2] = {{a, sh, 0}, {b, sh, 1}};
    pid_t pids[2];
    for (int i = 0; i < 2; i++)
        pids[i] = spawn(sp_rank_main, &args[i]);
    side_t cs;
    p_side(&cs, "sp-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 8);
    rank_t c;
    rank_open(a, &M_LS, &cs, 0, SP_N + 1, &c);
    for (uint32_t q = 0; q < SP_N; q++) {
        uint32_t blk = SP_N - 1 - q;
        fill_req(&c, 600 + q, &blk, 7);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, 600 + q, c.pool, &blk, 1, 7, &p, T_MS), c.c);
        slot_put(&sh->slots[q], &p);
        kvx_context_params_free(&p);
    }
    atomic_fetch_add(&sh->connected, 1);
    p_wait_count(&sh->connected, 3);
    atomic_fetch_add(&sh->done1, 1);
    p_wait_count(&sh->done1, 3);
    ev_t ce[SP_N + 4];
    int n = collect(c.c, ce, SP_N + 4, SP_N, 5000);
    CHECK_EQ(n, SP_N);
    for (uint32_t q = 0; q < SP_N; q++)
        expect_event(ce, n, 600 + q, KVX_EVENT_COMPLETE, 0);

    /* batch k is the same on both ranks: seq, request ids, order, kinds */
    CHECK_EQ(sh->nb[0], sh->nb[1]);
    int timeout_sealed = 0;
    for (uint32_t k = 0; k < sh->nb[0]; k++) {
        ls_batch_t *x = &sh->b[0][k], *y = &sh->b[1][k];
        if (x->seq != k || y->seq != k || x->n != y->n)
            fprintf(stderr,
                    "batch %u: rank 0 (A) seq %llu (%u events), rank 1 (B) "
                    "seq %llu (%u events)\n",
                    k, (unsigned long long)x->seq, x->n,
                    (unsigned long long)y->seq, y->n);
        CHECK_EQ(x->seq, k);
        CHECK_EQ(y->seq, k);
        CHECK_EQ(x->n, y->n);
        for (uint32_t i = 0; i < x->n; i++) {
            CHECK_EQ(x->req[i], y->req[i]);
            CHECK_EQ(x->kind[i], y->kind[i]);
            CHECK_EQ(x->kind[i], KVX_EVENT_COMPLETE);
        }
        timeout_sealed += x->n < x->at_least;
    }
    CHECK(timeout_sealed >= 2);

    /* B dies while request 900 waits for its rank: rank 0 gets the error */
    uint32_t blk = SP_N;
    fill_req(&c, 900, &blk, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 900, c.pool, &blk, 1, 7, &p, T_MS), c.c);
    slot_put(&sh->slot900, &p);
    kvx_context_params_free(&p);
    p_wait_count(&sh->fetched900, 1);
    p_wait_count(&sh->rank1_ready, 1);
    CHECK(kill(b->pid, SIGKILL) == 0);
    int st = daemon_wait(b, 2000);
    CHECK(st != -1 && WIFSIGNALED(st));
    atomic_store(&sh->b_killed, 1);
    CHECK(wait_children(pids, 2, P_BOUND_MS + 3000));
    ev_t e[4];
    n = collect(c.c, e, 4, 1, P_BOUND_MS);
    CHECK_EQ(n, 1);
    CHECK_EQ(e[0].req, 900);
    if (e[0].kind != KVX_EVENT_ERROR)
        print_events("context", e, n);
    CHECK_EQ(e[0].kind, KVX_EVENT_ERROR);
    rank_close(&c);
    daemon_healthy(a);
    daemon_stop_ok(a);
}

/* Wait (up to 5 s) until A has sent a slot gathered ahead. */
static void pl_wait_ahead(pl_t *x)
{
    int64_t end = now_ms() + 5000;
    while (!p_ahead(x->a)) {
        if (now_ms() > end) {
            fprintf(stderr, "no slot gathered ahead within 5 s\n");
            CHECK(!"gather-ahead in use");
        }
        sleep_ms(5);
    }
}

/* Cancel mid-transfer from both sides: the generation side cancels the
 * first half, the context side the second half. Once every cancel has
 * returned, no byte lands in the generation pool (checked 300 ms later),
 * and every request ends on both sides. */
static void pl_cancel_half_each(pl_t *x)
{
    int cancelled = 0;
    for (uint32_t q = 0; q < PL_REQ; q++) {
        kvx_client_t *c = q < PL_REQ / 2 ? x->g.c : x->c.c;
        int rc = kvx_cancel(c, 100 + q, T_MS);
        /* NOT_FOUND: it completed (or ended) before the cancel came */
        if (rc && rc != KVX_ERR_NOT_FOUND) {
            fprintf(stderr, "cancel %u: %s: %s\n", 100 + q,
                    kvx_status_name(rc), kvx_last_error(c));
            CHECK(!"cancel returns");
        }
        cancelled += rc == 0;
    }
    CHECK(cancelled > 0);
    uint8_t *snap = malloc(x->g.size);
    CHECK(snap != NULL);
    memcpy(snap, x->g.base, x->g.size);
    sleep_ms(300);
    CHECK(memcmp(snap, x->g.base, x->g.size) == 0);
    free(snap);
    /* every request ends once on each side; a completed one is intact */
    for (int side = 0; side < 2; side++) {
        rank_t *r = side ? &x->c : &x->g;
        ev_t *ev = side ? x->ce : x->ge;
        int n = collect(r->c, ev, PL_REQ + 16, PL_REQ, 5000);
        CHECK_EQ(n, PL_REQ);
        for (uint32_t q = 0; q < PL_REQ; q++) {
            int count = 0;
            const ev_t *e = NULL;
            for (int k = 0; k < n; k++)
                if (ev[k].req == 100 + q) {
                    count++;
                    e = &ev[k];
                }
            CHECK_EQ(count, 1);
            if (e->kind == KVX_EVENT_COMPLETE) {
                if (!side)
                    CHECK_EQ(p_check_req(&x->g, 100 + q, x->gb[q], PL_TOK, 0),
                             0);
            } else {
                CHECK(e->kind == KVX_EVENT_CANCELLED ||
                      e->kind == KVX_EVENT_ERROR);
            }
        }
    }
    /* nothing is left in flight on either daemon */
    for (int side = 0; side < 2; side++) {
        char *json;
        kvx_client_t *c = side ? x->c.c : x->g.c;
        CHECK_KVX(kvx_requests_json(c, &json, T_MS), c);
        if (strstr(json, "\"state\":\""))
            fprintf(stderr, "still listed: %s\n", json);
        CHECK(strstr(json, "\"state\":\"") == NULL);
        free(json);
    }
}

TEST_T(peer_cancel_mid_transfer, 90)
{
    pl_t *x = pl_start();
    pl_cancel_half_each(x);
    p_slots_all_free(x->a);
    p_slots_all_free(x->b);
    pl_finish(x);
}

/* peer.gather_ahead: A gathers the units of B's next PULLs into free
 * send slots. Verified transfers both ways, with several streams a
 * request and layouts that differ; every slot A sent (ahead or not) is
 * one B received, byte for byte. */
TEST_T(peer_gather_ahead, 90)
{
    static const char *const extra = "  slot_bytes: 64KiB\n"
                                      "  slots: 8\n"
                                      "  gather_ahead: 3\n";
    daemon_t *a, *b;
    p_two_daemons_with(extra, &a, &b);
    p_both_ways(a, b, "ga", 6, 4); /* about 38 slots a request */
    long long na = p_ahead(a), nb = p_ahead(b);
    fprintf(stderr, "slots sent gathered ahead: A %lld, B %lld\n", na, nb);
    CHECK(na > 0);
    CHECK(nb > 0);
    p_sent_is_received(a, b);
    p_sent_is_received(b, a);
    p_slots_all_free(a);
    p_slots_all_free(b);
    p_stop_both(a, b);
}

/* Cancels from both sides while A holds slots gathered ahead: the same
 * outcome as without (no byte lands after the cancels, every request
 * ends once), and A's slots all come back: a second round of transfers
 * completes, which needs them. */
TEST_T(peer_gather_ahead_cancel_mid_transfer, 90)
{
    pl_t *x = pl_start_with(PL_AHEAD, PL_PEER);
    pl_wait_ahead(x);
    pl_cancel_half_each(x);
    uint32_t wc[2] = {PL_REQ * PL_NB, PL_REQ * PL_NB + 1};
    uint32_t wg[2] = {PL_REQ * PL_NB + 3, PL_REQ * PL_NB + 2};
    for (uint64_t req = 300; req < 340; req++)
        p_one(&x->c, &x->g, req, wc, wg, 2, 2 * PL_TPB - 3, 5000);
    p_slots_all_free(x->a);
    p_slots_all_free(x->b);
    pl_finish(x);
}

/* A drained mid-transfer while it holds slots gathered ahead: B's
 * requests each end once, and A fences every gather and exits 0. */
TEST_T(peer_gather_ahead_drained_mid_transfer, 90)
{
    pl_t *x = pl_start_with(PL_AHEAD, PL_PEER);
    pl_wait_ahead(x);
    pl_drain_a(x);
}

/* A context instance spread over both daemons (rank 0 on A, rank 1 on
 * B), the generation rank on A fetching as soon as rank 0 has published:
 * the slice from rank 1 is asked for again until B's rank publishes, and
 * both daemons give the same params (the token is derived from the
 * cluster secret). A request rank 1 never publishes fails NOT_FOUND. */
TEST_T(peer_spread_context_late_publish, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs;
    p_side2(&cs, "sc-ctx", KVX_ROLE_CONTEXT);
    static side_t gs;
    p_side(&gs, "sc-gen", KVX_ROLE_GENERATION, "trtllm", 4);
    rank_t c0, c1, g;
    p_spread_open(a, b, &cs, 8, &c0, &c1);
    rank_open(a, &M_SMALL, &gs, 0, 8, &g);
    memset(g.base, 0xa5, g.size);

    uint32_t cb[3] = {5, 1, 3}, gb[3] = {2, 7, 0};
    const uint32_t ntok = 10;
    fill_req(&c0, 77, cb, ntok);
    fill_req(&c1, 77, cb, ntok);
    kvx_context_params_t p0, p1;
    CHECK_KVX(kvx_publish(c0.c, 77, c0.pool, cb, 3, ntok, &p0, T_MS), c0.c);
    CHECK_KVX(kvx_fetch(g.c, 77, p0.data, p0.len, g.pool, gb, 3, 0, T_MS),
              g.c);
    sleep_ms(300); /* B has no offer yet: its slice is asked for again */
    CHECK_KVX(kvx_publish(c1.c, 77, c1.pool, cb, 3, ntok, &p1, T_MS), c1.c);
    CHECK_EQ(p0.len, p1.len);
    CHECK(!memcmp(p0.data, p1.data, p0.len));
    wait_event(g.c, 77, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 77, gb, ntok, 0), 0);
    /* the context instance's batches come from A for both ranks */
    wait_event(c0.c, 77, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c1.c, 77, KVX_EVENT_COMPLETE, 0, 5000);

    /* rank 1 never publishes request 78: NOT_FOUND after the retries */
    fill_req(&c0, 78, cb, ntok);
    kvx_context_params_t p2;
    CHECK_KVX(kvx_publish(c0.c, 78, c0.pool, cb, 3, ntok, &p2, T_MS), c0.c);
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch(g.c, 78, p2.data, p2.len, g.pool, gb, 3, 0, T_MS),
              g.c);
    ev_t e = wait_event(g.c, 78, KVX_EVENT_ERROR, KVX_ERR_NOT_FOUND, 6000);
    CHECK(now_ms() - t0 >= 1500);
    CHECK_STR_CONTAINS(e.msg, "no offer");
    kvx_context_params_free(&p0);
    kvx_context_params_free(&p1);
    kvx_context_params_free(&p2);
    rank_close(&g);
    rank_close(&c0);
    rank_close(&c1);
    p_stop_both(a, b);
}

/* A rank of a spread instance on the member daemon leaves with a poll
 * still waiting at the root (killed), then comes back: the root drops
 * the old poll and ends the instance's requests (as one daemon does when
 * a rank leaves), and the new client's polls are answered. */
typedef struct rr_arg {
    daemon_t *d;
    const side_t *s;
    char addr0[192], addr1[192];
    _Atomic int joined;
    int rc;                /* lj: rank 1's poll, and what it read */
    uint32_t nevents;
    char msg[256];
    int64_t poll_ms;       /* rl: how long rank 1's poll took */
} rr_arg_t;

/* Rank 1 of the spread instance gs on daemon b, in a child running fn
 * (its rank 0, on A, has address addr0): returns once rank 1 joined. */
static pid_t rank1_spawn(void (*fn)(void *), rr_arg_t **out, daemon_t *b,
                         const side_t *gs, const char *addr0)
{
    rr_arg_t *ra = shm_alloc(sizeof(*ra));
    ra->d = b;
    ra->s = gs;
    snprintf(ra->addr0, sizeof(ra->addr0), "%s", addr0);
    pid_t kid = spawn(fn, ra);
    int64_t end = now_ms() + 10000;
    while (!atomic_load(&ra->joined) && now_ms() < end)
        sleep_ms(5);
    CHECK(atomic_load(&ra->joined));
    *out = ra;
    return kid;
}

/* In rank 1's child: say hello on a->d, join with rank 0 at a->addr0,
 * and tell the parent (a->joined). */
static void rank1_join(rr_arg_t *a, rank_t *g)
{
    rank_hello_only(a->d, &M_SMALL, a->s, 1, g);
    snprintf(a->addr1, sizeof(a->addr1), "%s", g->addr);
    const char *addrs[2] = {a->addr0, g->addr};
    CHECK_KVX(kvx_join(g->c, addrs, 2, T_MS), g->c);
    atomic_store(&a->joined, 1);
}

static void rr_rank1_main(void *arg)
{
    rr_arg_t *a = arg;
    rank_t g;
    rank1_join(a, &g);
    kvx_batch_t *b;
    kvx_poll(g.c, 1000, 20000, &b); /* killed while it waits */
    _exit(1);
}

TEST_T(peer_spread_member_rank_returns, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t gs;
    p_side2(&gs, "rr-gen", KVX_ROLE_GENERATION);
    static side_t cs;
    p_side(&cs, "rr-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    rank_t c, g0;
    rank_open(a, &M_SMALL, &cs, 0, 8, &c);
    rank_hello_only(a, &M_SMALL, &gs, 0, &g0);
    rr_arg_t *ra;
    pid_t kid = rank1_spawn(rr_rank1_main, &ra, b, &gs, g0.addr);
    const char *addrs[2] = {g0.addr, ra->addr1};
    CHECK_KVX(kvx_join(g0.c, addrs, 2, T_MS), g0.c);
    rank_pool(&g0, 8);

    /* request 5: rank 0 fetches, rank 1 (gone soon) never does */
    uint32_t cb[2] = {0, 1}, gb[2] = {3, 4};
    fill_req(&c, 5, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 5, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g0.c, 5, p.data, p.len, g0.pool, gb, 2, 0, T_MS),
              g0.c);
    sleep_ms(200);
    CHECK(kill(kid, SIGKILL) == 0);
    int st;
    CHECK(waitpid(kid, &st, 0) == kid);
    /* rank 0 hears that its instance lost a rank */
    ev_t e = wait_event(g0.c, 5, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    CHECK_STR_CONTAINS(e.msg, "disconnected");
    /* rank 1 comes back: its polls are answered (not BUSY) */
    rank_t g1;
    rank_hello_only(b, &M_SMALL, &gs, 1, &g1);
    CHECK_KVX(kvx_join(g1.c, addrs, 2, T_MS), g1.c);
    for (int i = 0; i < 2; i++) {
        kvx_batch_t *bt;
        CHECK_KVX(kvx_poll(g1.c, 1000, 200, &bt), g1.c);
        kvx_batch_free(bt);
    }
    kvx_context_params_free(&p);
    rank_close(&g1);
    rank_close(&g0);
    rank_close(&c);
    p_stop_both(a, b);
}

/* Every rank on the root daemon leaves while a rank on the member daemon
 * has a poll waiting there: the instance ends at the root, and that poll
 * fails at once with PEER_GONE, not at the engine's socket timeout. */
static void rl_rank1_main(void *arg)
{
    rr_arg_t *a = arg;
    rank_t g;
    rank1_join(a, &g);
    kvx_batch_t *b = NULL;
    int64_t t0 = now_ms();
    a->rc = kvx_poll(g.c, 1, 8000, &b);
    a->poll_ms = now_ms() - t0;
    if (a->rc == KVX_OK)
        kvx_batch_free(b);
    else
        snprintf(a->msg, sizeof(a->msg), "%s", kvx_last_error(g.c));
    _exit(0);
}

TEST_T(peer_spread_root_ranks_leave, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t gs;
    p_side2(&gs, "rl-gen", KVX_ROLE_GENERATION);
    /* rank 1's child starts before rank 0 connects, or it would hold
     * rank 0's socket open; A's address comes from another instance */
    static side_t xs;
    p_side(&xs, "rl-x", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    rank_t x;
    rank_hello_only(a, &M_SMALL, &xs, 0, &x);
    rr_arg_t *ra;
    pid_t kid = rank1_spawn(rl_rank1_main, &ra, b, &gs, x.addr);
    rank_t g0;
    rank_hello_only(a, &M_SMALL, &gs, 0, &g0);
    const char *addrs[2] = {g0.addr, ra->addr1};
    CHECK_KVX(kvx_join(g0.c, addrs, 2, T_MS), g0.c);
    sleep_ms(300); /* rank 1's poll now waits in A's batches */
    rank_close(&g0);
    int st;
    CHECK(waitpid(kid, &st, 0) == kid);
    fprintf(stderr, "rank 1's poll after %lld ms: %s (%s)\n",
            (long long)ra->poll_ms, kvx_status_name(ra->rc), ra->msg);
    CHECK_EQ(ra->rc, KVX_ERR_PEER_GONE);
    CHECK_STR_CONTAINS(ra->msg, "ended at its root daemon");
    CHECK(ra->poll_ms < 4000); /* not its 8 s timeout */
    rank_close(&x);
    daemon_healthy(a);
    daemon_healthy(b);
    p_stop_both(a, b);
}

/* A copy job that fails between daemons (KVXFERD_FAULT makes a host job
 * fail as a GPU kernel error would): a failed gather on the context
 * daemon, then a failed scatter on the generation daemon. Each time both
 * sides end the request with ERROR at once (the offer too, not at its
 * backstop lease), the next request moves verified bytes, and every slot
 * comes back free. A bad KVXFERD_FAULT stops the daemon at start. */
static void pf_round(const char *fault_a, const char *fault_b,
                     const char *tag)
{
    setenv("KVXFERD_FAULT", fault_a, 1);
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    setenv("KVXFERD_FAULT", fault_b, 1);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    unsetenv("KVXFERD_FAULT");
    static side_t cs, gs;
    char ctx[32], gen[32];
    snprintf(ctx, sizeof(ctx), "pf-ctx-%s", tag);
    snprintf(gen, sizeof(gen), "pf-gen-%s", tag);
    rank_t c, g;
    p_pair(a, b, &cs, &gs, ctx, gen, &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {5, 6};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t eg = wait_event(g.c, 1, KVX_EVENT_ERROR, KVX_ERR_IO, 5000);
    ev_t ec = wait_event(c.c, 1, KVX_EVENT_ERROR, KVX_ERR_IO, 5000);
    fprintf(stderr, "%s: generation: %s; context: %s\n", tag, eg.msg, ec.msg);
    CHECK_STR_CONTAINS(eg.msg, "input/output");
    kvx_context_params_free(&p);
    p_one(&c, &g, 2, cb, gb, 2, 7, 5000);
    p_slots_all_free(a);
    p_slots_all_free(b);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

TEST_T(peer_copy_faults, 90)
{
    p_setup();
    pf_round("gather:1", "", "gather");
    pf_round("", "scatter:1", "scatter");
    char cmd[512], out[1024] = "";
    snprintf(cmd, sizeof(cmd),
             "KVXFERD_FAULT=bogus:1 timeout 10 %s/kvxferd --socket "
             "/tmp/kvx-pf-%d.sock 2>&1; echo \"exit $?\"",
             build_dir(), (int)getpid());
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    size_t n = fread(out, 1, sizeof(out) - 1, f);
    out[n] = 0;
    pclose(f);
    CHECK_STR_CONTAINS(out, "KVXFERD_FAULT: 'bogus:1' is not SITE:N");
    CHECK_STR_CONTAINS(out, "exit 2");
}

/* Params an engine forged, fetched between daemons: a layout with 0
 * tokens a block (it divided by zero in the planner and killed the
 * daemon) and billions of tokens (it planned them before looking at the
 * blocks). Each is refused at once naming the field; the daemon stays
 * healthy and the genuine params still complete. */
static void pp_forge(const kvx_context_params_t *p, uint32_t tpb,
                     uint32_t ntok, uint8_t *out, size_t *len)
{
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p->len, p->data);
    CHECK(cp != NULL && cp->layout);
    if (tpb != UINT32_MAX)
        cp->layout->tokens_per_block = tpb;
    if (ntok)
        cp->num_tokens = ntok;
    *len = kvxfer__context_params__get_packed_size(cp);
    CHECK(*len <= 4096);
    kvxfer__context_params__pack(cp, out);
    kvxfer__context_params__free_unpacked(cp, NULL);
}

TEST_T(peer_forged_params, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "fp-ctx", "fp-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    uint8_t f[4096];
    size_t fl;
    pp_forge(&p, 0, 0, f, &fl);
    CHECK_FAILS(kvx_fetch(g.c, 1, f, fl, g.pool, gb, 2, 0, T_MS), g.c,
                KVX_ERR_INVALID, "layout.tokens_per_block: 0 out of range");
    pp_forge(&p, 1, 3500000000u, f, &fl);
    int64_t t0 = now_ms();
    CHECK_FAILS(kvx_fetch(g.c, 1, f, fl, g.pool, gb, 2, 0, T_MS), g.c,
                KVX_ERR_INVALID, "fetch.blocks: 2 blocks of 4 tokens");
    CHECK(now_ms() - t0 < 1000);
    daemon_healthy(b);
    /* the genuine params still work */
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A daemon without the secret (build/tests/fake_peer) tries the
 * handshake's shortcuts; none gets in and nothing is harmed:
 *  1. skip: B dials it (params naming it as the context rank) and it
 *     answers HELLO with AUTH_RESULT{0}, no CHALLENGE: B refuses it, the
 *     fetch ends ERROR AUTH, and no OPEN (with the token) reaches it;
 *  2. relay: B dials it and it relays B's handshake to A: B sees that
 *     the answer comes from A's address, not the one it dialled, and
 *     gives no MAC; A does not accept the relay;
 *  3. claim: it connects to A claiming to be B and fails its handshake:
 *     A ends nothing of B's (a spread instance's request still needs and
 *     gets B's rank). */
static FILE *p_fake(int side, const char *args, char *addr, size_t alen)
{
    char cmd[600];
    if (p_net.netns)
        snprintf(cmd, sizeof(cmd), "ip netns exec %s %s/tests/fake_peer %s",
                 p_net.ns[side], build_dir(), args);
    else
        snprintf(cmd, sizeof(cmd), "%s/tests/fake_peer %s", build_dir(),
                 args);
    fflush(stdout);
    fflush(stderr);
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    if (addr) {
        CHECK(fgets(addr, (int)alen, f) != NULL);
        addr[strcspn(addr, "\n")] = 0;
        CHECK(!strncmp(addr, "kvx://", 6));
    }
    return f;
}

/* The rest of the fake's output, once it exits. */
static void p_fake_rest(FILE *f, char *out, size_t cap)
{
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    pclose(f);
}

/* params p with context rank 0's daemon replaced by addr */
static void p_params_at(const kvx_context_params_t *p, const char *addr,
                        uint8_t *out, size_t *len)
{
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p->len, p->data);
    CHECK(cp != NULL && cp->n_rank_addresses == 1);
    char *old = cp->rank_addresses[0];
    cp->rank_addresses[0] = (char *)addr;
    *len = kvxfer__context_params__get_packed_size(cp);
    CHECK(*len <= 4096);
    kvxfer__context_params__pack(cp, out);
    cp->rank_addresses[0] = old;
    kvxfer__context_params__free_unpacked(cp, NULL);
}

TEST_T(peer_handshake_shortcuts, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "hs-ctx", "hs-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    uint8_t f[4096];
    size_t fl;
    char faddr[192], out[4096], args[400];

    /* 1: a server that skips its CHALLENGE */
    snprintf(args, sizeof(args), "skip %s 3", p_net.ip[0]);
    FILE *fk = p_fake(0, args, faddr, sizeof(faddr));
    p_params_at(&p, faddr, f, &fl);
    CHECK_KVX(kvx_fetch(g.c, 11, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t e = wait_event(g.c, 11, KVX_EVENT_ERROR, KVX_ERR_AUTH, 5000);
    fprintf(stderr, "skip: %s\n", e.msg);
    CHECK_STR_CONTAINS(e.msg, "without proving the cluster secret");
    p_fake_rest(fk, out, sizeof(out));
    CHECK(strstr(out, "got 7\n") == NULL); /* no OPEN, no token */
    CHECK_STR_CONTAINS(out, "done");

    /* 2: a relay from B to A */
    char a_ipport[64];
    const char *h = strstr(c.addr, "://");
    CHECK(h != NULL);
    snprintf(a_ipport, sizeof(a_ipport), "%.*s",
             (int)(strrchr(c.addr, '/') - (h + 3)), h + 3);
    snprintf(args, sizeof(args), "relay %s %s 3", p_net.ip[0], a_ipport);
    fk = p_fake(0, args, faddr, sizeof(faddr));
    p_params_at(&p, faddr, f, &fl);
    CHECK_KVX(kvx_fetch(g.c, 12, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
    e = wait_event(g.c, 12, KVX_EVENT_ERROR, KVX_ERR_AUTH, 5000);
    fprintf(stderr, "relay: %s\n", e.msg);
    CHECK_STR_CONTAINS(e.msg, "does not listen there");
    p_fake_rest(fk, out, sizeof(out));
    fprintf(stderr, "relay's output: %s", out);
    CHECK(strstr(out, "auth_result 0\n") == NULL);

    /* the genuine params still complete */
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_context_params_free(&p);

    /* 3: a claim to be B, at A, that fails its handshake; a spread
     * generation instance (rank 0 on A, rank 1 on B) then still moves a
     * request that needs both ranks */
    static side_t ss;
    p_side2(&ss, "hs-spread", KVX_ROLE_GENERATION);
    rank_t s0, s1;
    p_spread_open(a, b, &ss, 8, &s0, &s1);
    snprintf(args, sizeof(args), "claim %s %s 1", a_ipport, s1.addr);
    fk = p_fake(1, args, NULL, 0);
    p_fake_rest(fk, out, sizeof(out));
    CHECK_STR_CONTAINS(out, "done");
    sleep_ms(300);
    fill_req(&c, 2, cb, 7);
    CHECK_KVX(kvx_publish(c.c, 2, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(s0.c, 2, p.data, p.len, s0.pool, gb, 2, 0, T_MS),
              s0.c);
    CHECK_KVX(kvx_fetch(s1.c, 2, p.data, p.len, s1.pool, gb, 2, 0, T_MS),
              s1.c);
    wait_event(s0.c, 2, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(s1.c, 2, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&s0, 2, gb, 7, 0), 0);
    CHECK_EQ(p_check_req(&s1, 2, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&s1);
    rank_close(&s0);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A spread generation instance (rank 0 on A, the root; rank 1 on B)
 * whose link is cut for longer than the keep-alive bound, then restored:
 * the root keeps rank 1 away (its place in the batches kept) and B
 * announces it again when the link is back. Rank 1 then reads the batch
 * with the end of the request the loss ended (it missed it before), and
 * a request that needs both ranks completes (it ended PEER_GONE at once,
 * for good, before). */
TEST_T(peer_spread_link_flap, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, ss;
    p_side(&cs, "lf-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    p_side2(&ss, "lf-gen", KVX_ROLE_GENERATION);
    rank_t c, s0, s1;
    rank_open(a, &M_SMALL, &cs, 0, 8, &c);
    p_spread_open(a, b, &ss, 8, &s0, &s1);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    /* one request first: the daemons are connected */
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(s0.c, 1, p.data, p.len, s0.pool, gb, 2, 0, T_MS),
              s0.c);
    CHECK_KVX(kvx_fetch(s1.c, 1, p.data, p.len, s1.pool, gb, 2, 0, T_MS),
              s1.c);
    wait_event(s0.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(s1.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    kvx_context_params_free(&p);
    /* request 9 waits for rank 1, which has not fetched it, when the link
     * goes: the loss ends it */
    fill_req(&c, 9, cb, 7);
    CHECK_KVX(kvx_publish(c.c, 9, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(s0.c, 9, p.data, p.len, s0.pool, gb, 2, 0, T_MS),
              s0.c);
    kvx_context_params_free(&p);
    /* the cut: longer than the keep-alive timeout */
    char why[300];
    if (p_net.netns)
        CHECK(!p_sh(why, sizeof(why), "ip -n %s link set %s down",
                    p_net.ns[0], p_net.veth[0]));
    else
        CHECK(kill(b->pid, SIGSTOP) == 0);
    sleep_ms(P_KA_TIMEOUT_MS + 800);
    /* rank 0 reads request 9's end while the link is down (A runs; in
     * loopback, B is the one frozen): that batch is sealed without rank
     * 1, which reads it once back */
    ev_t e9 = wait_event(s0.c, 9, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    fprintf(stderr, "request 9 on rank 0: %s\n", e9.msg);
    if (p_net.netns)
        CHECK(!p_sh(why, sizeof(why), "ip -n %s link set %s up",
                    p_net.ns[0], p_net.veth[0]));
    else
        CHECK(kill(b->pid, SIGCONT) == 0);
    sleep_ms(P_KA_TIMEOUT_MS + 800); /* both sides saw the loss; back */
    int64_t end = now_ms() + 8000;
    int rc, found = 0;
    do {
        kvx_batch_t *bt = NULL;
        rc = kvx_poll(s1.c, 0, 200, &bt);
        if (rc == KVX_OK) {
            for (uint32_t i = 0; i < bt->num_events; i++)
                if (bt->events[i].request_id == 9) {
                    CHECK_EQ(bt->events[i].kind, KVX_EVENT_ERROR);
                    CHECK_EQ(bt->events[i].code, KVX_ERR_PEER_GONE);
                    found = 1;
                }
            kvx_batch_free(bt);
        } else {
            sleep_ms(100);
        }
    } while (!found && now_ms() < end);
    CHECK(found);
    /* drain both ranks, then a request that needs both ranks completes,
     * verified */
    kvx_batch_t *bt = NULL;
    while (kvx_poll(s0.c, 0, 100, &bt) == KVX_OK && bt->num_events)
        kvx_batch_free(bt);
    kvx_batch_free(bt);
    bt = NULL;
    while (kvx_poll(s1.c, 0, 100, &bt) == KVX_OK && bt->num_events)
        kvx_batch_free(bt);
    kvx_batch_free(bt);
    fill_req(&c, 2, cb, 7);
    CHECK_KVX(kvx_publish(c.c, 2, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(s0.c, 2, p.data, p.len, s0.pool, gb, 2, 0, T_MS),
              s0.c);
    CHECK_KVX(kvx_fetch(s1.c, 2, p.data, p.len, s1.pool, gb, 2, 0, T_MS),
              s1.c);
    ev_t e0 = wait_event(s0.c, 2, KVX_EVENT_COMPLETE, 0, 8000);
    (void)e0;
    wait_event(s1.c, 2, KVX_EVENT_COMPLETE, 0, 8000);
    CHECK_EQ(p_check_req(&s0, 2, gb, 7, 0), 0);
    CHECK_EQ(p_check_req(&s1, 2, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&s1);
    rank_close(&s0);
    rank_close(&c);
    p_stop_both(a, b);
}

/* The fence of a merged batch: a spread generation instance (rank 0 on
 * A, the root; rank 1 on B) fetches a request whose part on B fails at
 * its first scatter (KVXFERD_FAULT) while A's part is still pulling (64
 * KiB slots, 2 of them). The root emits the error at once; before rank 0
 * reads it, A ends its own part and waits for its fence: when rank 0 has
 * the event, A no longer runs the request (before, A went on writing
 * rank 0's blocks after rank 0 was told they were free). */
TEST_T(peer_spread_error_fences_other_daemon, 60)
{
    p_setup();
    const char *peer = "  slot_bytes: 64KiB\n  slots: 2\n";
    daemon_t *a = p_daemon(0, P_SECRET, peer, NULL);
    setenv("KVXFERD_FAULT", "scatter:1", 1);
    daemon_t *b = p_daemon(1, P_SECRET, peer, NULL);
    unsetenv("KVXFERD_FAULT");
    static side_t cs, ss;
    p_side(&cs, "fb-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    p_side2(&ss, "fb-gen", KVX_ROLE_GENERATION);
    enum { NB = 2048 };
    rank_t c, s0, s1;
    rank_open(a, &M_SMALL, &cs, 0, NB, &c);
    p_spread_open(a, b, &ss, NB, &s0, &s1);
    static uint32_t bl[NB];
    for (uint32_t i = 0; i < NB; i++)
        bl[i] = i;
    uint32_t ntok = NB * 4;
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 5, c.pool, bl, NB, ntok, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(s0.c, 5, p.data, p.len, s0.pool, bl, NB, 0, T_MS),
              s0.c);
    CHECK_KVX(kvx_fetch(s1.c, 5, p.data, p.len, s1.pool, bl, NB, 0, T_MS),
              s1.c);
    ev_t e = wait_event(s0.c, 5, KVX_EVENT_ERROR, KVX_ERR_IO, 10000);
    char *json;
    CHECK_KVX(kvx_requests_json(s0.c, &json, T_MS), s0.c);
    fprintf(stderr, "rank 0 got: %s; A's requests then: %.300s\n", e.msg,
            json);
    CHECK(strstr(json, "fb-gen") == NULL); /* A's part is fenced, gone */
    free(json);
    wait_event(s1.c, 5, KVX_EVENT_ERROR, KVX_ERR_IO, 10000);
    kvx_context_params_free(&p);
    rank_close(&s1);
    rank_close(&s0);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A spread context instance with replicated heads (one KV head over tp
 * 2: rank 0 on A, rank 1 on B) and a generation instance of tp 1 on B,
 * which reads the head from rank 0's replica only: rank 1's offer on B
 * is never opened. The request completes for both context ranks (not
 * TIMED_OUT when B's offer lease runs out). */
static const model_t M_1H = {
    .layers = 4, .heads = 1, .head_dim = 32, .kv = 2, .dtype = KVX_DTYPE_BF16};

TEST_T(peer_spread_replicated_unread_rank, 60)
{
    p_setup();
    const char *dl = "deadlines:\n  offer_lease_ms: 1500\n";
    daemon_t *a = p_daemon(0, P_SECRET, NULL, dl);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, dl);
    static side_t cs, gs;
    p_side2(&cs, "ru-ctx", KVX_ROLE_CONTEXT);
    p_side(&gs, "ru-gen", KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_t c0, c1, g;
    rank_hello_only(a, &M_1H, &cs, 0, &c0);
    rank_hello_only(b, &M_1H, &cs, 1, &c1);
    const char *addrs[2] = {c0.addr, c1.addr};
    CHECK_KVX(kvx_join(c0.c, addrs, 2, T_MS), c0.c);
    CHECK_KVX(kvx_join(c1.c, addrs, 2, T_MS), c1.c);
    rank_pool(&c0, 8);
    rank_pool(&c1, 8);
    rank_open(b, &M_1H, &gs, 0, 8, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {4, 5};
    fill_req(&c0, 3, cb, 7);
    fill_req(&c1, 3, cb, 7);
    kvx_context_params_t p, p1;
    CHECK_KVX(kvx_publish(c0.c, 3, c0.pool, cb, 2, 7, &p, T_MS), c0.c);
    CHECK_KVX(kvx_publish(c1.c, 3, c1.pool, cb, 2, 7, &p1, T_MS), c1.c);
    CHECK_KVX(kvx_fetch(g.c, 3, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 3, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 3, gb, 7, 0), 0);
    /* both context ranks: COMPLETE, in the same batch, before and after
     * B's offer lease would have run out */
    ev_t e0 = wait_event(c0.c, 3, KVX_EVENT_COMPLETE, 0, 5000);
    ev_t e1 = wait_event(c1.c, 3, KVX_EVENT_COMPLETE, 0, 5000);
    (void)e0;
    (void)e1;
    sleep_ms(2000);
    kvx_batch_t *bt = NULL;
    CHECK_KVX(kvx_poll(c0.c, 0, 100, &bt), c0.c);
    CHECK_EQ(bt->num_events, 0); /* no second event for request 3 */
    kvx_batch_free(bt);
    kvx_context_params_free(&p);
    kvx_context_params_free(&p1);
    rank_close(&g);
    rank_close(&c1);
    rank_close(&c0);
    p_stop_both(a, b);
}

/* The root daemon's rank 0 joins after the member's rank 1 did. Rank 1's
 * poll, forwarded before the root joined, is asked again and answered
 * (an empty batch at its deadline), not refused. A rank 1 that left
 * before the root joined is known to have left: the root's request
 * that needs it ends PEER_GONE instead of waiting for it forever. */
static void lj_rank1_main(void *arg)
{
    rr_arg_t *a = arg;
    rank_t g;
    rank1_join(a, &g);
    kvx_batch_t *b = NULL;
    a->rc = kvx_poll(g.c, 1, 1500, &b); /* before the root has joined */
    if (a->rc == KVX_OK) {
        a->nevents = b->num_events;
        kvx_batch_free(b);
    } else {
        snprintf(a->msg, sizeof(a->msg), "%s", kvx_last_error(g.c));
    }
    _exit(0); /* leaves */
}

TEST_T(peer_spread_root_joins_late, 60)
{
    p_setup();
    /* A's fetch deadline bounds a merged request too (part 3) */
    daemon_t *a = p_daemon(0, P_SECRET, NULL,
                           "deadlines:\n  fetch_timeout_ms: 1500\n");
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    static side_t gs;
    p_side2(&gs, "lj-gen", KVX_ROLE_GENERATION);
    static side_t cs;
    p_side(&cs, "lj-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    rank_t c, g0;
    rank_open(a, &M_SMALL, &cs, 0, 8, &c);
    rank_hello_only(a, &M_SMALL, &gs, 0, &g0);
    rr_arg_t *la;
    pid_t kid = rank1_spawn(lj_rank1_main, &la, b, &gs, g0.addr);
    sleep_ms(300); /* rank 1's poll reaches the root, which has not joined */
    const char *addrs[2] = {g0.addr, la->addr1};
    CHECK_KVX(kvx_join(g0.c, addrs, 2, T_MS), g0.c);
    int st;
    CHECK(waitpid(kid, &st, 0) == kid);
    if (la->rc != KVX_OK)
        fprintf(stderr, "rank 1's poll: %s (%s)\n", kvx_status_name(la->rc),
                la->msg);
    CHECK_EQ(la->rc, KVX_OK); /* asked again once the root joined */
    CHECK_EQ(la->nevents, 0);
    rank_pool(&g0, 8);

    /* rank 1 has left: a request that needs it ends PEER_GONE */
    uint32_t cb[2] = {0, 1}, gb[2] = {3, 4};
    fill_req(&c, 7, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 7, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g0.c, 7, p.data, p.len, g0.pool, gb, 2, 0, T_MS),
              g0.c);
    ev_t e = wait_event(g0.c, 7, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    fprintf(stderr, "request 7: %s\n", e.msg);
    kvx_context_params_free(&p);

    /* the same before the root joined at all: a second instance whose
     * rank 1 joins and leaves first */
    static side_t gs2;
    p_side2(&gs2, "lj-gen2", KVX_ROLE_GENERATION);
    rank_t h0, h1;
    const char *addrs2[2];
    p_spread_hello(a, b, &gs2, &h0, &h1, addrs2);
    CHECK_KVX(kvx_join(h1.c, addrs2, 2, T_MS), h1.c);
    rank_close(&h1); /* left before the root joined */
    sleep_ms(300);
    CHECK_KVX(kvx_join(h0.c, addrs2, 2, T_MS), h0.c);
    rank_pool(&h0, 8);
    sleep_ms(300); /* the announcement comes again and is taken */
    CHECK_KVX(kvx_publish(c.c, 8, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(h0.c, 8, p.data, p.len, h0.pool, gb, 2, 0, T_MS),
              h0.c);
    e = wait_event(h0.c, 8, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    fprintf(stderr, "request 8: %s\n", e.msg);
    kvx_context_params_free(&p);

    /* 3: rank 1 stays but never fetches: rank 0's part is done, the
     * merged request ends TIMED_OUT at A's fetch deadline (not never) */
    static side_t gs3;
    p_side2(&gs3, "lj-gen3", KVX_ROLE_GENERATION);
    rank_t k0, k1;
    const char *addrs3[2];
    p_spread_hello(a, b, &gs3, &k0, &k1, addrs3);
    CHECK_KVX(kvx_join(k1.c, addrs3, 2, T_MS), k1.c);
    CHECK_KVX(kvx_join(k0.c, addrs3, 2, T_MS), k0.c);
    rank_pool(&k0, 8);
    CHECK_KVX(kvx_publish(c.c, 9, c.pool, cb, 2, 7, &p, T_MS), c.c);
    int64_t t9 = now_ms();
    CHECK_KVX(kvx_fetch(k0.c, 9, p.data, p.len, k0.pool, gb, 2, 0, T_MS),
              k0.c);
    e = wait_event(k0.c, 9, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 5000);
    fprintf(stderr, "request 9 after %lld ms: %s\n",
            (long long)(now_ms() - t9), e.msg);
    CHECK_STR_CONTAINS(e.msg, "never reported");
    kvx_context_params_free(&p);
    rank_close(&k1);
    rank_close(&k0);
    rank_close(&h0);
    rank_close(&g0);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A member's event that reaches the root before the root joined the
 * instance: rank 1 of a spread context instance publishes and cancels on
 * B while rank 0 on A has only said hello; once rank 0 joins, both ranks
 * read the CANCELLED event in the same batch. */
TEST_T(peer_spread_event_before_root_joined, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs;
    p_side2(&cs, "eb-ctx", KVX_ROLE_CONTEXT);
    rank_t c0, c1;
    const char *addrs[2];
    p_spread_hello(a, b, &cs, &c0, &c1, addrs);
    CHECK_KVX(kvx_join(c1.c, addrs, 2, T_MS), c1.c);
    rank_pool(&c1, 8);
    uint32_t cb[2] = {2, 3};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c1.c, 21, c1.pool, cb, 2, 7, &p, T_MS), c1.c);
    CHECK_KVX(kvx_cancel(c1.c, 21, T_MS), c1.c);
    kvx_context_params_free(&p);
    sleep_ms(300); /* the event is at A, which has not joined */
    CHECK_KVX(kvx_join(c0.c, addrs, 2, T_MS), c0.c);
    kvx_batch_t *b0, *b1;
    CHECK_KVX(kvx_poll(c0.c, 1, 3000, &b0), c0.c);
    CHECK_KVX(kvx_poll(c1.c, 1, 3000, &b1), c1.c);
    CHECK_EQ(b0->num_events, 1);
    CHECK_EQ(b1->num_events, 1);
    CHECK_EQ(b0->seq, b1->seq);
    CHECK_EQ(b0->events[0].request_id, 21);
    CHECK_EQ(b0->events[0].kind, KVX_EVENT_CANCELLED);
    CHECK_EQ(b1->events[0].request_id, 21);
    CHECK_EQ(b1->events[0].kind, KVX_EVENT_CANCELLED);
    kvx_batch_free(b0);
    kvx_batch_free(b1);
    rank_close(&c1);
    rank_close(&c0);
    p_stop_both(a, b);
}

/* A batch lost on its way to a member daemon (KVXFERD_FAULT=batch:1 on
 * the root A: the first batch A sends to B counts as sent and never
 * arrives, as in a link that dies with it in flight). Rank 1's poll
 * fails (the root did not answer it); its next poll reads that very
 * batch, event and all, because B's polls tell A which batch rank 1 reads
 * next. The ranks then read on in lockstep. Before, the next poll read
 * the batch after it: the event was lost for rank 1. */
TEST_T(peer_spread_lost_batch_read_again, 60)
{
    p_setup();
    setenv("KVXFERD_FAULT", "batch:1", 1);
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    unsetenv("KVXFERD_FAULT");
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    static side_t cs;
    p_side2(&cs, "lb-ctx", KVX_ROLE_CONTEXT);
    rank_t c0, c1;
    p_spread_open(a, b, &cs, 8, &c0, &c1);
    p_cancelled(&c1, 21);
    kvx_batch_t *b0, *b1;
    CHECK_KVX(kvx_poll(c0.c, 1, 3000, &b0), c0.c);
    CHECK_EQ(b0->num_events, 1);
    CHECK_EQ(b0->events[0].request_id, 21);
    CHECK_EQ(b0->events[0].kind, KVX_EVENT_CANCELLED);
    int64_t t0 = now_ms();
    int rc = kvx_poll(c1.c, 1, 300, &b1);
    fprintf(stderr, "rank 1's first poll: %s after %lld ms: %s\n",
            kvx_status_name(rc), (long long)(now_ms() - t0),
            kvx_last_error(c1.c));
    CHECK_EQ(rc, KVX_ERR_PEER_GONE);
    CHECK_KVX(kvx_poll(c1.c, 1, 3000, &b1), c1.c);
    CHECK_EQ(b1->seq, b0->seq);
    CHECK_EQ(b1->num_events, 1);
    CHECK_EQ(b1->events[0].request_id, 21);
    CHECK_EQ(b1->events[0].kind, KVX_EVENT_CANCELLED);
    kvx_batch_free(b0);
    kvx_batch_free(b1);
    /* on in lockstep: the next batch (empty, sealed at a deadline) */
    CHECK_KVX(kvx_poll(c0.c, 0, 200, &b0), c0.c);
    CHECK_KVX(kvx_poll(c1.c, 0, 200, &b1), c1.c);
    CHECK_EQ(b0->seq, b1->seq);
    CHECK_EQ(b0->num_events, 0);
    CHECK_EQ(b1->num_events, 0);
    kvx_batch_free(b0);
    kvx_batch_free(b1);
    CHECK(log_contains(a, "never arrived"));
    kvx_client_t *o;
    char *js;
    CHECK_EQ(kvx_connect_observer(a->sock, 2000, &o), 0);
    CHECK_EQ(kvx_status_json(o, &js, 2000), 0);
    CHECK_STR_CONTAINS(js, "\"batches_resent\":1,");
    /* the instance as each daemon sees it: A seals (batches 0 and 1),
     * B forwards */
    char want[400];
    snprintf(want, sizeof(want),
             "{\"id\":\"lb-ctx\",\"role\":\"context\",\"ranks\":2,"
             "\"local_ranks\":1,\"connected\":1,\"joined\":true,"
             "\"spread\":true,\"root\":\"%s\",\"next_batch\":2,",
             c0.addr);
    CHECK_STR_CONTAINS(js, want);
    free(js);
    kvx_close(o);
    CHECK_EQ(kvx_connect_observer(b->sock, 2000, &o), 0);
    CHECK_EQ(kvx_status_json(o, &js, 2000), 0);
    snprintf(want, sizeof(want),
             "\"spread\":true,\"root\":\"%s\",\"next_batch\":0,"
             "\"batches_kept\":0,\"ranks_away\":0,",
             c0.addr);
    CHECK_STR_CONTAINS(js, want);
    free(js);
    kvx_close(o);
    char args[200], out[16384];
    snprintf(args, sizeof(args), "--socket %s status", b->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    CHECK_STR_CONTAINS(out, "\ninstances (1):\n  INSTANCE ");
    snprintf(want, sizeof(want), "context     2     1     1     -      0     "
                                 "0     0     %s\n",
             c0.addr);
    CHECK_STR_CONTAINS(out, want);
    rank_close(&c1);
    rank_close(&c0);
    p_stop_both(a, b);
}

/* Daemons A and B with a 6 s keep-alive timeout (so that A can be frozen
 * for 3 s without either losing the other), a spread context instance
 * `inst` with rank 0 on A and rank 1 on B, and request req published and
 * cancelled by rank 1: its event waits at A, not yet in a batch; then A
 * is frozen (SIGSTOP; the caller sends SIGCONT). */
static void p_frozen_root(const char *inst, uint64_t req, side_t *cs,
                          daemon_t **a, daemon_t **b, rank_t *c0, rank_t *c1)
{
    p_setup();
    p_ka_timeout_ms = 6000;
    *a = p_daemon(0, P_SECRET, NULL, NULL);
    *b = p_daemon(1, P_SECRET, NULL, NULL);
    p_side2(cs, inst, KVX_ROLE_CONTEXT);
    p_spread_open(*a, *b, cs, 8, c0, c1);
    p_cancelled(c1, req);
    sleep_ms(300); /* the event is at A, pending */
    CHECK(kill((*a)->pid, SIGSTOP) == 0);
}

/* A member's poll that the root answers too late: the root A is frozen
 * (SIGSTOP, 3 s, within a 6 s keep-alive timeout) while rank 1's poll
 * (200 ms) waits there, so B fails it 2 s after its deadline (PEER_GONE).
 * The batch A seals for it once it runs again comes to B after that: B
 * keeps it, and rank 1's next poll reads it, the same batch rank 0 reads
 * (with the event of request 31 in it); then on in lockstep. */
TEST_T(peer_spread_late_batch_kept, 60)
{
    daemon_t *a, *b;
    static side_t cs;
    rank_t c0, c1;
    p_frozen_root("lk-ctx", 31, &cs, &a, &b, &c0, &c1);
    kvx_batch_t *b0, *b1;
    int64_t t0 = now_ms();
    int rc = kvx_poll(c1.c, 1, 200, &b1);
    fprintf(stderr, "rank 1's poll: %s after %lld ms: %s\n",
            kvx_status_name(rc), (long long)(now_ms() - t0),
            kvx_last_error(c1.c));
    CHECK_EQ(rc, KVX_ERR_PEER_GONE);
    CHECK_STR_CONTAINS(kvx_last_error(c1.c), "did not answer");
    sleep_ms(3000 - (now_ms() - t0) > 0 ? 3000 - (now_ms() - t0) : 0);
    CHECK(kill(a->pid, SIGCONT) == 0);
    sleep_ms(500); /* A answers the old poll; B keeps the batch */
    CHECK_KVX(kvx_poll(c1.c, 1, 3000, &b1), c1.c);
    CHECK_KVX(kvx_poll(c0.c, 1, 3000, &b0), c0.c);
    fprintf(stderr, "rank 0 read batch %llu (%u events), rank 1 batch %llu "
                    "(%u events)\n",
            (unsigned long long)b0->seq, b0->num_events,
            (unsigned long long)b1->seq, b1->num_events);
    CHECK_EQ(b1->seq, b0->seq);
    CHECK_EQ(b1->num_events, 1);
    CHECK_EQ(b0->num_events, 1);
    CHECK_EQ(b1->events[0].request_id, 31);
    CHECK_EQ(b0->events[0].request_id, 31);
    kvx_batch_free(b0);
    kvx_batch_free(b1);
    CHECK_KVX(kvx_poll(c0.c, 0, 200, &b0), c0.c);
    CHECK_KVX(kvx_poll(c1.c, 0, 200, &b1), c1.c);
    CHECK_EQ(b0->seq, b1->seq);
    kvx_batch_free(b0);
    kvx_batch_free(b1);
    rank_close(&c1);
    rank_close(&c0);
    p_stop_both(a, b);
}

/* An answer for a client that has left is not given to its successor:
 * rank 1's client C1 polls while the root A is frozen (3 s, within a 6 s
 * keep-alive timeout), its poll fails at B's backstop, C1 leaves and C2
 * joins as rank 1. A, running again, answers C1's poll with the batch
 * holding request 32's event (PeerBatch.session: C1's) before it hears
 * of C1 leaving; B drops it. C2 reads from its join on, no event of
 * request 32 (before: B kept the batch for rank 1 and C2 read it). */
TEST_T(peer_spread_answer_for_left_client, 60)
{
    daemon_t *a, *b;
    static side_t cs;
    rank_t c0, c1, n1;
    p_frozen_root("lc-ctx", 32, &cs, &a, &b, &c0, &c1);
    int64_t t0 = now_ms();
    kvx_batch_t *b0, *b1;
    CHECK_EQ(kvx_poll(c1.c, 1, 200, &b1), KVX_ERR_PEER_GONE);
    rank_close(&c1);
    sleep_ms(200);
    rank_hello_only(b, &M_SMALL, &cs, 1, &n1);
    const char *addrs[2] = {c0.addr, n1.addr};
    CHECK_KVX(kvx_join(n1.c, addrs, 2, T_MS), n1.c);
    rank_pool(&n1, 8);
    sleep_ms(3000 - (now_ms() - t0) > 0 ? 3000 - (now_ms() - t0) : 0);
    CHECK(kill(a->pid, SIGCONT) == 0);
    /* rank 0 reads request 32's end */
    CHECK_KVX(kvx_poll(c0.c, 1, 3000, &b0), c0.c);
    CHECK_EQ(b0->num_events, 1);
    CHECK_EQ(b0->events[0].request_id, 32);
    /* C2 reads no batch of C1's: from its join on, in lockstep */
    int64_t end = now_ms() + 5000;
    int rc;
    while ((rc = kvx_poll(n1.c, 0, 200, &b1)) != KVX_OK && now_ms() < end)
        sleep_ms(50);
    CHECK_KVX(rc, n1.c);
    fprintf(stderr, "rank 0 read batch %llu; C2 first reads batch %llu (%u "
                    "events)\n",
            (unsigned long long)b0->seq, (unsigned long long)b1->seq,
            b1->num_events);
    for (uint32_t k = 0; k < b1->num_events; k++)
        CHECK(b1->events[k].request_id != 32);
    CHECK(b1->seq > b0->seq);
    kvx_batch_free(b0);
    kvx_batch_free(b1);
    rank_close(&n1);
    rank_close(&c0);
    p_stop_both(a, b);
}

/* A batch of 300 events crosses to the member in one control message
 * (about 20 KiB, past UCX's rendezvous threshold on tcp, so it goes by
 * the forced eager path): both ranks read the same batches, every event
 * once, in the same order. This shows large control messages arrive
 * whole; it does not show the reordering that rendezvous allowed (a
 * later small message handled first), which depends on timing. */
TEST_T(peer_spread_large_batch, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs;
    p_side2(&cs, "lg-ctx", KVX_ROLE_CONTEXT);
    rank_t c0, c1;
    p_spread_open(a, b, &cs, 8, &c0, &c1);
    enum { N = 300 };
    for (uint64_t q = 1000; q < 1000 + N; q++)
        p_cancelled(&c1, q);
    static uint64_t got[2][N];
    uint32_t n[2] = {0, 0}, nb[2] = {0, 0}, big = 0;
    kvx_client_t *cl[2] = {c0.c, c1.c};
    for (int i = 0; i < 2; i++) {
        int64_t end = now_ms() + 8000;
        while (n[i] < N && now_ms() < end) {
            kvx_batch_t *bt = NULL;
            CHECK_KVX(kvx_poll(cl[i], N, 1000, &bt), cl[i]);
            for (uint32_t k = 0; k < bt->num_events && n[i] < N; k++) {
                CHECK_EQ(bt->events[k].kind, KVX_EVENT_CANCELLED);
                got[i][n[i]++] = bt->events[k].request_id;
            }
            if (bt->num_events > big)
                big = bt->num_events;
            nb[i]++;
            kvx_batch_free(bt);
        }
    }
    fprintf(stderr, "rank 0: %u events in %u batches; rank 1: %u in %u; the "
                    "largest batch %u events\n",
            n[0], nb[0], n[1], nb[1], big);
    CHECK_EQ(n[0], N);
    CHECK_EQ(n[1], N);
    CHECK_EQ(nb[0], nb[1]);
    CHECK(memcmp(got[0], got[1], sizeof(got[0])) == 0);
    CHECK(big >= 100); /* a large control message did cross */
    rank_close(&c1);
    rank_close(&c0);
    p_stop_both(a, b);
}

/* Poll c until a batch holds request req's event (up to 8 s): its seq,
 * or UINT64_MAX. */
static uint64_t p_seq_of(kvx_client_t *c, uint64_t req)
{
    int64_t end = now_ms() + 8000;
    while (now_ms() < end) {
        kvx_batch_t *bt = NULL;
        if (kvx_poll(c, 0, 200, &bt) != KVX_OK) {
            sleep_ms(50);
            continue;
        }
        uint64_t seq = UINT64_MAX;
        for (uint32_t k = 0; k < bt->num_events; k++)
            if (bt->events[k].request_id == req)
                seq = bt->seq;
        kvx_batch_free(bt);
        if (seq != UINT64_MAX)
            return seq;
    }
    return UINT64_MAX;
}

/* The root's instance made anew: rank 0 (root A) leaves, so the instance
 * ends at A, and comes back, while rank 1 stays on B. A numbers batches
 * from 0 again; B sees the new epoch in A's batches and forgets what it
 * counted of the old instance, so both ranks read a new request's end in
 * the same batch (before: B took the new batches for ones it had, and
 * rank 1 skipped them). */
TEST_T(peer_spread_root_instance_recreated, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs;
    p_side2(&cs, "rc-ctx", KVX_ROLE_CONTEXT);
    rank_t c0, c1;
    p_spread_open(a, b, &cs, 8, &c0, &c1);
    /* a few batches with events for both ranks */
    for (uint64_t q = 10; q < 14; q++) {
        p_cancelled(&c1, q);
        uint64_t s0 = p_seq_of(c0.c, q), s1 = p_seq_of(c1.c, q);
        CHECK(s0 != UINT64_MAX);
        CHECK_EQ(s0, s1);
    }
    /* rank 0 leaves: the instance ends at A (and is freed); it comes back
     * as a new one */
    rank_close(&c0);
    sleep_ms(500);
    rank_t n0;
    rank_hello_only(a, &M_SMALL, &cs, 0, &n0);
    const char *addrs[2] = {n0.addr, c1.addr};
    CHECK_KVX(kvx_join(n0.c, addrs, 2, T_MS), n0.c);
    rank_pool(&n0, 8);
    /* rank 1's polls failed meanwhile (its root instance ended): drain */
    kvx_batch_t *bt = NULL;
    while (kvx_poll(c1.c, 0, 100, &bt) == KVX_OK && bt->num_events) {
        kvx_batch_free(bt);
        bt = NULL;
    }
    kvx_batch_free(bt);
    p_cancelled(&n0, 20);
    uint64_t s0 = p_seq_of(n0.c, 20), s1 = p_seq_of(c1.c, 20);
    fprintf(stderr, "request 20 in batch %llu (rank 0) and %llu (rank 1)\n",
            (unsigned long long)s0, (unsigned long long)s1);
    CHECK(s0 != UINT64_MAX);
    CHECK_EQ(s0, s1);
    /* the new instance's first batches, not dozens of empty ones sealed
     * for polls of rank 1 that took each new batch for an old one (61 in
     * a run without the epoch) */
    CHECK(s0 < 8);
    CHECK(log_contains(b, "new incarnation"));
    rank_close(&c1);
    rank_close(&n0);
    p_stop_both(a, b);
}

/* Rank 1 of a spread instance (member daemon B) is replaced while the
 * link to the root A is down: the loss ends its request 5, which rank 0
 * reads meanwhile; its client leaves, and a new client joins as rank 1
 * before B can tell A (the announcement of the leave is replaced by that
 * of the join). Back, A sees a new session: the old rank leaves and the
 * new one reads from the next batch, in lockstep with rank 0, never a
 * batch of the old one's (before: A took it for the old rank back, and it
 * read the batch with request 5's end). Network namespaces only: on
 * loopback the cut freezes a daemon, which then cannot seal or take a
 * new client. */
TEST_T(peer_spread_rank_replaced_while_away, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    if (!p_net.netns) {
        printf("skip: peer_spread_rank_replaced_while_away needs network "
               "namespaces (the link cut)\n");
        p_stop_both(a, b);
        return;
    }
    static side_t cs;
    p_side2(&cs, "rp-ctx", KVX_ROLE_CONTEXT);
    rank_t c0, c1, n1;
    p_spread_open(a, b, &cs, 8, &c0, &c1);
    uint32_t cb[2] = {2, 3};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c0.c, 5, c0.pool, cb, 2, 7, &p, T_MS), c0.c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_publish(c1.c, 5, c1.pool, cb, 2, 7, &p, T_MS), c1.c);
    kvx_context_params_free(&p);
    /* A knows rank 1's client: its poll went through A */
    kvx_batch_t *bt = NULL;
    CHECK_KVX(kvx_poll(c1.c, 0, 100, &bt), c1.c);
    kvx_batch_free(bt);
    char why[300];
    CHECK(!p_sh(why, sizeof(why), "ip -n %s link set %s down", p_net.ns[1],
                p_net.veth[1]));
    sleep_ms(P_KA_TIMEOUT_MS + 800); /* each has lost the other */
    ev_t e5 = wait_event(c0.c, 5, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    fprintf(stderr, "request 5 on rank 0: %s\n", e5.msg);
    rank_close(&c1);
    sleep_ms(200);
    rank_hello_only(b, &M_SMALL, &cs, 1, &n1);
    const char *addrs[2] = {c0.addr, n1.addr};
    CHECK_KVX(kvx_join(n1.c, addrs, 2, T_MS), n1.c);
    rank_pool(&n1, 8);
    CHECK(!p_sh(why, sizeof(why), "ip -n %s link set %s up", p_net.ns[1],
                p_net.veth[1]));
    /* until A counts rank 1 again, its polls are asked to come again */
    int64_t end = now_ms() + 8000;
    int rc;
    while ((rc = kvx_poll(n1.c, 0, 100, &bt)) != KVX_OK && now_ms() < end)
        sleep_ms(50);
    CHECK_KVX(rc, n1.c);
    for (uint32_t k = 0; k < bt->num_events; k++)
        CHECK(bt->events[k].request_id != 5);
    fprintf(stderr, "the new rank 1 reads batch %llu first (%u events)\n",
            (unsigned long long)bt->seq, bt->num_events);
    kvx_batch_free(bt);
    /* both ranks read the CANCELLED of a new request 6 in the same
     * batch; the new rank 1 reads no event of request 5 */
    p_cancelled(&c0, 6);
    uint64_t seq[2] = {UINT64_MAX, UINT64_MAX};
    kvx_client_t *cl[2] = {c0.c, n1.c};
    end = now_ms() + 8000;
    while ((seq[0] == UINT64_MAX || seq[1] == UINT64_MAX) &&
           now_ms() < end) {
        for (int i = 0; i < 2; i++) {
            bt = NULL;
            if (seq[i] != UINT64_MAX)
                continue;
            if (kvx_poll(cl[i], 0, 200, &bt) != KVX_OK) {
                sleep_ms(50);
                continue;
            }
            for (uint32_t k = 0; k < bt->num_events; k++) {
                if (i == 1 && bt->events[k].request_id == 5)
                    fprintf(stderr, "the new rank 1 read batch %llu of "
                                    "the old one\n",
                            (unsigned long long)bt->seq);
                CHECK(i == 0 || bt->events[k].request_id != 5);
                if (bt->events[k].request_id == 6) {
                    CHECK_EQ(bt->events[k].kind, KVX_EVENT_CANCELLED);
                    seq[i] = bt->seq;
                }
            }
            kvx_batch_free(bt);
        }
    }
    fprintf(stderr, "request 6 in batch %llu (rank 0) and %llu (rank 1)\n",
            (unsigned long long)seq[0], (unsigned long long)seq[1]);
    CHECK(seq[0] != UINT64_MAX);
    CHECK_EQ(seq[0], seq[1]);
    CHECK(log_contains(a, "is a new client"));
    rank_close(&n1);
    rank_close(&c0);
    p_stop_both(a, b);
}

/* A daemon that knows the secret but misbehaves (fake_peer replay): B
 * dials it (params naming it as the context rank) and opens its stream
 * there; it replays that OPEN to A twice. A accepts the stream once and
 * refuses the second (each stream the consumer needs, once: a second
 * stream of the same slice could outlive the offer's consumption). */
TEST_T(peer_open_twice, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "ot-ctx", "ot-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    char a_ipport[64], faddr[192], args[600], out[4096];
    const char *h = strstr(c.addr, "://");
    CHECK(h != NULL);
    snprintf(a_ipport, sizeof(a_ipport), "%.*s",
             (int)(strrchr(c.addr, '/') - (h + 3)), h + 3);
    snprintf(args, sizeof(args), "replay %s/secret-A %s %s 3", p_net.dir,
             p_net.ip[0], a_ipport);
    FILE *fk = p_fake(0, args, faddr, sizeof(faddr));
    uint8_t f[4096];
    size_t fl;
    p_params_at(&p, faddr, f, &fl);
    CHECK_KVX(kvx_fetch(g.c, 1, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
    p_fake_rest(fk, out, sizeof(out));
    fprintf(stderr, "the replaying daemon got:\n%s", out);
    CHECK_STR_CONTAINS(out, "auth_result 0\nopened\n");
    CHECK_STR_CONTAINS(out, "has all its 1 streams");
    CHECK(strstr(strstr(out, "opened\n") + 7, "opened\n") == NULL);
    /* both ends are cancelled (or ended already, when the fake left);
     * the daemons stay healthy */
    int rc = kvx_cancel(g.c, 1, T_MS);
    CHECK(rc == KVX_OK || rc == KVX_ERR_NOT_FOUND);
    rc = kvx_cancel(c.c, 1, T_MS);
    CHECK(rc == KVX_OK || rc == KVX_ERR_NOT_FOUND);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

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
        {"  listen: \"127.0.0.1:65534\"\n  secret_file: /x\n",
         "lanes (peer.lanes) would listen on ports 65535 to 65536"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char text[512];
        snprintf(text, sizeof(text), "peer:\n%s", cases[i].peer);
        write_file(cfg, text);
        snprintf(cmd, sizeof(cmd), "%s/kvxferd --check-config --config %s "
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
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

/* ---- status ---------------------------------------------------------------
 */

/* After a transfer A -> B, both list the other as a connected peer with
 * the bytes moved, and the UCX section says where it listens and that it
 * stages in host memory. */
/* CPU seconds process pid has used (user + system), from /proc. */
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
    free(out);

    rank_close(&c);
    rank_close(&g);
    daemon_stop_ok(a);
    daemon_stop_ok(b);
}

/* Port i of daemon d's lanes, from its status (0: none). */
static unsigned p_lane_port(daemon_t *d, int i)
{
    char *json = status_json(d);
    const char *l = strstr(json, "\"lane_ports\":[");
    CHECK(l != NULL);
    l += strlen("\"lane_ports\":[");
    unsigned port = 0;
    for (int k = 0; k <= i && *l && *l != ']'; k++) {
        char *end;
        port = (unsigned)strtoul(l, &end, 10);
        l = *end == ',' ? end + 1 : end;
        if (k < i && *end != ',')
            port = 0;
    }
    free(json);
    return port;
}

/* Lanes (peer.lanes, 2 by default): slot data goes over UCX workers on
 * threads of their own, each with a listener of its own; the status says
 * how many each connection uses. A lane takes data only with a key that
 * an authenticated peer was told: a sender without one (fake_peer lane)
 * has its data dropped, small (eager) or large (rendezvous), and its
 * endpoint closed, and the daemons go on moving verified bytes. */
TEST_T(peer_lanes, 120)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    char *json = status_json(a);
    char *ucx = p_json_section(json, "\"ucx\":");
    CHECK(ucx != NULL);
    CHECK_EQ(json_num(ucx, "lanes"), 2);
    free(ucx);
    free(json);
    unsigned port0 = p_lane_port(a, 0), port1 = p_lane_port(a, 1);
    CHECK(port0 > 0 && port1 > 0 && port0 != port1);
    p_both_ways(a, b, "pl", 6, 4);
    for (int i = 0; i < 2; i++) {
        char *pj = p_peers(i ? b : a);
        fprintf(stderr, "%c's peers: %s\n", "AB"[i], pj);
        CHECK_EQ(json_num(pj, "lanes"), 2);
        CHECK_EQ(json_num(pj, "errors"), 0);
        free(pj);
    }

    static const char *const sizes[2] = {"4096", "2097152"};
    for (int i = 0; i < 2; i++) {
        char args[200], out[1024];
        snprintf(args, sizeof(args), "lane %s:%u %s 5", p_net.ip[0],
                 i ? port1 : port0, sizes[i]);
        FILE *f = p_fake(1, args, NULL, 0);
        p_fake_rest(f, out, sizeof(out));
        fprintf(stderr, "fake lane sender (%s bytes): %s", sizes[i], out);
        CHECK_STR_CONTAINS(out, "closed");
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
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    side_t c = {.inst = "plr-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd",
                .tpb = 16};
    side_t g = {.inst = "plr-gen", .tp = 2, .pp = 1, .preset = "trtllm",
                .tpb = 8};
    xfer_case2(b, a, &M_8K, &c, &g, 4, 300, 0);
    CHECK(log_wait(b, "before any data went over it; slot data to it goes "
                      "over the connection itself", 2000));
    side_t c2 = {.inst = "plr-ctx2", .tp = 1, .pp = 1, .preset = "vllm-hnd",
                 .tpb = 16};
    side_t g2 = {.inst = "plr-gen2", .tp = 1, .pp = 1, .preset = "vllm-nhd",
                 .tpb = 16};
    xfer_case2(b, a, &M_8K, &c2, &g2, 3, 257, 5);
    char *pb = p_peers(b);
    fprintf(stderr, "B's peers: %s\n", pb);
    CHECK_EQ(json_num(pb, "lanes"), 0);
    CHECK_EQ(json_num(pb, "errors"), 0);
    CHECK_STR_CONTAINS(pb, "\"state\":\"connected\"");
    free(pb);
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
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    setenv("KVXFERD_FAULT", "lane_hold:3", 1);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    unsetenv("KVXFERD_FAULT");
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "pls-ctx", "pls-gen", &c, &g);
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
            fprintf(stderr, "request %llu: %s (%lld ms)\n",
                    (unsigned long long)q, e.msg, (long long)(now_ms() - t0));
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
    /* a new connection carries the next one */
    uint32_t cb2[2] = {4, 5}, gb2[2] = {6, 7};
    p_one(&c, &g, 50, cb2, gb2, 2, 7, 8000);
    rank_close(&c);
    rank_close(&g);
    p_stop_both(a, b);
}
