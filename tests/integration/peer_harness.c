/*
 * peer_harness.c — cross-daemon transfers (issue #4): two kvxferd, A and
 * B, each in its own network namespace, joined by a veth pair
 * (10.X.0.1/24 in A, 10.X.0.2/24 in B), talking UCX over it. Included by
 * integration.c after harness.c and fixtures.c, whose daemons, ranks,
 * reference pattern and events it uses; the t_peer_*.c files use it.
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
static int p_closes_once;

static void p_teardown(void)
{
    if (getpid() != h_owner)
        return;
    p_closes_once = 0;
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

/* p_closes_once: the next daemons preload tests/libucx_closes.so, and
 * p_stop_both() checks that neither closed a UCX endpoint twice: for
 * tests whose endpoints close once, at the stop (see ucx_closes.c). */

/* More lines of the next p_daemon()s' socket sections (NULL: none). */
static const char *p_socket_extra;

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
    char preload[256];
    snprintf(preload, sizeof(preload), "%s/tests/libucx_closes.so",
             build_dir());
    h_preload = p_closes_once ? preload : NULL;
    daemon_t *d = daemon_start2(p_socket_extra, cfg);
    h_netns = NULL;
    h_preload = NULL;
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
static void p_two_daemons_with(const char *peer, daemon_t **a, daemon_t **b)
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
    /* every UCX endpoint closed once (with p_closes_once): a second
     * close of one destroys it twice */
    for (int i = 0; i < 2 && p_closes_once; i++)
        if (log_contains(i ? b : a, "closed twice")) {
            fprintf(stderr, "daemon %c closed a UCX endpoint twice\n", "AB"[i]);
            CHECK(!"each UCX endpoint closed once");
        }
    p_closes_once = 0;
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

/* A count of d's status for one direction's slots ("sent" or
 * "received"). */
static long long p_slot_count(daemon_t *d, const char *dir, const char *key)
{
    char sec[32];
    snprintf(sec, sizeof(sec), "\"%s\":", dir);
    char *js = status_json(d);
    char *x = p_json_section(js, sec);
    CHECK(x != NULL);
    long long n = json_num(x, key);
    free(x);
    free(js);
    return n;
}

/* Slots A sent whose PULL found them gathered ahead (status). */
static long long p_ahead(daemon_t *a)
{
    return p_slot_count(a, "sent", "ahead");
}

/* Pieces d received straight into the destination blocks (status:
 * peer.direct), not scattered from a slot. */
static long long p_direct(daemon_t *d)
{
    return p_slot_count(d, "received", "direct");
}

/* Pieces d sent straight from its pools (peer.direct), not gathered. */
static __attribute__((unused)) long long p_direct_sent(daemon_t *d)
{
    return p_slot_count(d, "sent", "direct");
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
            fprintf(stderr,
                    "slots free: %lld of %lld receive, %lld of %lld "
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

/* 8 KiB a token: a 300-token request is about 2.4 MB */
static const model_t M_8K = {
    .layers = 4, .heads = 4, .head_dim = 128, .kv = 2, .dtype = KVX_DTYPE_BF16};

/* Verified transfers of M_8K both ways: a to b, vllm-nhd tp 1 to trtllm
 * tp 2 (n1 requests of up to 300 tokens); b to a, flashinfer tp 2 to
 * vllm-hnd tp 1 (n2 of up to 257, skip 5). Instances named tag-... */
static void p_both_ways(daemon_t *a, daemon_t *b, const char *tag, uint32_t n1,
                        uint32_t n2)
{
    char in[4][32];
    static const char *const what[4] = {"ctx", "gen", "ctx2", "gen2"};
    for (int i = 0; i < 4; i++)
        snprintf(in[i], sizeof(in[i]), "%s-%s", tag, what[i]);
    side_t c = {
        .inst = in[0], .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g = {.inst = in[1], .tp = 2, .pp = 1, .preset = "trtllm", .tpb = 8};
    xfer_case2(a, b, &M_8K, &c, &g, n1, 300, 0);
    side_t c2 = {
        .inst = in[2], .tp = 2, .pp = 1, .preset = "flashinfer", .tpb = 8};
    side_t g2 = {
        .inst = in[3], .tp = 1, .pp = 1, .preset = "vllm-hnd", .tpb = 16};
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
