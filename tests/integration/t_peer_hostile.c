#include <arpa/inet.h>

/*
 * t_peer_hostile — what a stranger on the network sends to the ports a
 * daemon opens: the node stays up, answers status, and its tenants'
 * transfers complete verified.
 */

/* The TCP ports daemon d listens on, from its network namespace's
 * /proc/PID/net/tcp and its fds; ips[i] gets each one's IPv4 address. */
static int p_listen_ports(daemon_t *d, unsigned *ports, uint32_t *ips,
                          int max)
{
    char path[64], line[512];
    /* the inodes of d's sockets */
    unsigned long inodes[512];
    int ni = 0;
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)d->pid);
    DIR *dir = opendir(path);
    CHECK(dir != NULL);
    struct dirent *e;
    while ((e = readdir(dir)) && ni < 512) {
        char fp[600], tgt[64];
        snprintf(fp, sizeof(fp), "%s/%s", path, e->d_name);
        ssize_t n = readlink(fp, tgt, sizeof(tgt) - 1);
        if (n > 0) {
            tgt[n] = 0;
            if (sscanf(tgt, "socket:[%lu]", &inodes[ni]) == 1)
                ni++;
        }
    }
    closedir(dir);
    snprintf(path, sizeof(path), "/proc/%d/net/tcp", (int)d->pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    int n = 0;
    while (fgets(line, sizeof(line), f) && n < max) {
        unsigned ip, port, st;
        unsigned long inode;
        if (sscanf(line, " %*d: %x:%x %*x:%*x %x %*x:%*x %*x:%*x %*x %*u "
                         "%*u %lu",
                   &ip, &port, &st, &inode) != 4 ||
            st != 0x0A)
            continue;
        for (int i = 0; i < ni; i++)
            if (inodes[i] == inode) {
                ports[n] = port;
                ips[n++] = ip; /* as the kernel prints it: host order of
                                  the network bytes */
            }
    }
    fclose(f);
    return n;
}

/* status answered, and how long it took (ms) */
static double p_status_ms(daemon_t *d)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    char *js = status_json(d);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double t = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
    CHECK(js != NULL && strstr(js, "\"sessions\"") != NULL);
    free(js);
    return t;
}

/* Garbage to every TCP port daemon A listens on: its peer.listen socket
 * (the handshake) and the ports UCX's TCP transport opened for its
 * workers (the loop's and each lane's). Before the handshake moved off
 * UCX, 17 zero bytes to peer.listen aborted the daemon in UCX 1.13's
 * connection manager (tcp_sockcm_ep.c:825). Now A stays up, answers
 * status within 100 ms after each port's battery, and moves verified
 * bytes both ways with B; every listening socket is bound to peer.listen's
 * IP (peer.net_devices: UCX listens on no other interface). */
TEST_T(peer_hostile_ports, 150)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    p_both_ways(a, b, "hp0", 2, 2);
    unsigned ports[32];
    uint32_t ips[32];
    int n = p_listen_ports(a, ports, ips, 32);
    fprintf(stderr, "A listens on %d TCP ports\n", n);
    CHECK(n >= 2); /* the handshake's, and UCX's */
    struct in_addr want;
    CHECK(inet_pton(AF_INET, p_net.ip[0], &want) == 1);
    for (int i = 0; i < n; i++) {
        char ipport[64], args[128], out[256];
        struct in_addr got = {.s_addr = ips[i]};
        snprintf(ipport, sizeof(ipport), "%s:%u", inet_ntoa(got), ports[i]);
        fprintf(stderr, "port %s\n", ipport);
        CHECK(got.s_addr == want.s_addr);
        snprintf(args, sizeof(args), "garbage %s 0.5", ipport);
        FILE *f = p_fake(0, args, NULL, 0);
        p_fake_rest(f, out, sizeof(out));
        fprintf(stderr, "  %s", out);
        CHECK_STR_CONTAINS(out, "sent");
        CHECK(kill(a->pid, 0) == 0);
        double ms = p_status_ms(a);
        fprintf(stderr, "  status in %.1f ms\n", ms);
        CHECK(ms < 100);
    }
    p_both_ways(a, b, "hp1", 3, 3);
    char *pa = p_peers(a);
    CHECK_STR_CONTAINS(pa, "\"state\":\"connected\"");
    free(pa);
    p_stop_both(a, b);
}

/* Params are the engines' (a forged or stale one names any address): a
 * daemon dials only daemons in the cluster's networks (peer.allowed;
 * here the default, the network of peer.listen's interface). A fetch
 * whose params name a daemon elsewhere is refused at once, INVALID and
 * named, and nothing is dialled (no probe of another host's ports by
 * connect timing); a handshake from outside is closed unanswered. */
TEST_T(peer_params_outside_cluster, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "oc-ctx", "oc-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    uint8_t f[4096];
    size_t fl;
    p_params_at(&p, "kvx://192.0.2.77:22/00000000000000aa", f, &fl);
    CHECK_EQ(kvx_fetch(g.c, 5, f, fl, g.pool, gb, 2, 0, T_MS),
             KVX_ERR_INVALID);
    fprintf(stderr, "refused: %s\n", kvx_last_error(g.c));
    CHECK_STR_CONTAINS(kvx_last_error(g.c), "outside the cluster's networks");
    CHECK_STR_CONTAINS(kvx_last_error(g.c), "192.0.2.77");
    char *pb = p_peers(b);
    CHECK(strstr(pb, "192.0.2.77") == NULL); /* never dialled */
    free(pb);
    /* the genuine params still complete */
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* peer.allowed names the cluster: B, outside A's list, cannot even start
 * a handshake with A (closed unanswered, A says why in its log), and A
 * refuses to dial B; inside it, they move verified bytes. */
TEST_T(peer_allowed_list, 90)
{
    p_setup();
    char extra[160];
    snprintf(extra, sizeof(extra), "  allowed: \"%s/32\"\n", p_net.ip[0]);
    daemon_t *a = p_daemon(0, P_SECRET, extra, NULL);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
    if (!strcmp(p_net.ip[0], p_net.ip[1])) {
        /* loopback: both daemons share the IP; nothing to tell apart */
        fprintf(stderr, "skipped: the daemons share one IP\n");
        p_stop_both(a, b);
        return;
    }
    static side_t cs, gs;
    rank_t c, g;
    /* context on B, generation on A: A would dial B */
    p_pair(b, a, &cs, &gs, "al-ctx", "al-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_EQ(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS),
             KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(kvx_last_error(g.c), "outside the cluster's networks");
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    /* context on A, generation on B: B dials A, which closes it */
    rank_t c2, g2;
    static side_t cs2, gs2;
    p_pair(a, b, &cs2, &gs2, "al-ctx2", "al-gen2", &c2, &g2);
    fill_req(&c2, 2, cb, 7);
    CHECK_KVX(kvx_publish(c2.c, 2, c2.pool, cb, 2, 7, &p, T_MS), c2.c);
    CHECK_KVX(kvx_fetch(g2.c, 2, p.data, p.len, g2.pool, gb, 2, 0, T_MS),
              g2.c);
    ev_t e = wait_event(g2.c, 2, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 8000);
    fprintf(stderr, "B's fetch: %s\n", e.msg);
    CHECK(log_wait(a, "is outside the cluster's networks", 2000));
    kvx_cancel(c2.c, 2, T_MS);
    kvx_context_params_free(&p);
    rank_close(&g2);
    rank_close(&c2);
    p_stop_both(a, b);
}

/* "IP:PORT" of the daemon rank r said Hello to. */
static void p_ipport_of(const rank_t *r, char *out, size_t len)
{
    const char *h = strstr(r->addr, "://");
    CHECK(h != NULL);
    snprintf(out, len, "%.*s", (int)(strrchr(r->addr, '/') - (h + 3)), h + 3);
}

/* A daemon that knows the secret but tells a broken UCX worker address
 * (fake_peer badaddr): 64 bytes of 0xff (UCX 1.13's ucp_ep_create()
 * asserted "addr version 15" on them, SIGABRT), 64 random bytes (the
 * same crash, or a read past the end, about half the time), a good
 * worker address with a broken lane address, and its real worker address
 * (the loaded UCX's: 1.13's, or 1.22's with its release device) cut
 * short by a byte, one byte longer, or of an address version UCX does
 * not know (byte 0 set to 2). The daemon that dials it
 * (B) and the daemon it dials (A) refuse the address, say why in their
 * log, stay up, and move verified bytes between them after. */
TEST_T(peer_bad_worker_address, 150)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "ba-ctx", "ba-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    static const char *const kinds[] = {"ff",     "random", "random",
                                        "random", "random", "lane",
                                        "cut:1",  "long",   "set:0:02"};
    char faddr[192], out[4096], args[600], a_ipport[64];
    uint8_t f[4096];
    size_t fl;
    for (unsigned i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        /* B dials it, as the context rank of a fetch */
        snprintf(args, sizeof(args), "badaddr %s/secret-A %s %s 1", p_net.dir,
                 p_net.ip[0], kinds[i]);
        FILE *fk = p_fake(0, args, faddr, sizeof(faddr));
        p_params_at(&p, faddr, f, &fl);
        CHECK_KVX(kvx_fetch(g.c, 10 + i, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
        ev_t e =
            wait_event(g.c, 10 + i, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 8000);
        fprintf(stderr, "%s: %s\n", kinds[i], e.msg);
        CHECK_STR_CONTAINS(e.msg, "UCX address");
        p_fake_rest(fk, out, sizeof(out));
        CHECK_STR_CONTAINS(out, "answered");
        CHECK(kill(b->pid, 0) == 0);
        p_status_ms(b);
    }
    CHECK(log_wait(b,
                   "refused: its worker's UCX address: header byte 0xff: "
                   "address version 15",
                   2000));
    CHECK(log_wait(b, "refused: its lane 0's UCX address", 2000));
    CHECK(log_wait(
        b, "refused: its worker's UCX address: bytes after the last device",
        2000));
    CHECK(log_wait(b, "runs past the end", 2000));
    CHECK(log_wait(b, "header byte 0x02: address version 2", 2000));
    /* it dials A, its RESPONSE telling the broken addresses */
    p_ipport_of(&c, a_ipport, sizeof(a_ipport));
    for (unsigned i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        snprintf(args, sizeof(args), "badaddr-to %s/secret-A %s %s 0.2",
                 p_net.dir, a_ipport, kinds[i]);
        FILE *fk = p_fake(1, args, NULL, 0);
        p_fake_rest(fk, out, sizeof(out));
        fprintf(stderr, "A answered %s: %s", kinds[i], out);
        CHECK_STR_CONTAINS(out, "auth_result -");
        CHECK_STR_CONTAINS(out, "UCX address");
        CHECK(kill(a->pid, 0) == 0);
        p_status_ms(a);
    }
    CHECK(log_wait(a,
                   "authentication failed: its worker's UCX address: "
                   "header byte 0xff",
                   2000));
    /* the genuine params still complete */
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* Two daemons whose UCX packs version-2 worker addresses
 * (UCX_ADDRESS_VERSION=v2, which a UCX build or site may set): UCX 1.16
 * and later keep their release in the high 4 bits of the header's first
 * byte (1.22: 0x61), which ucx_addr_check() once refused as an unknown
 * address version, so no two such daemons reached each other. They
 * authenticate and move verified bytes. (Before: on UCX 1.22 the fetch
 * ended PEER_GONE, "its worker's UCX address: header byte 0x61: address
 * version 1".) */
TEST_T(peer_address_version_2, 90)
{
    daemon_t *a, *b;
    setenv("UCX_ADDRESS_VERSION", "v2", 1);
    p_two_daemons(&a, &b);
    unsetenv("UCX_ADDRESS_VERSION");
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "v2-ctx", "v2-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 8000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    fprintf(stderr, "fetch over version-2 addresses: complete, verified\n");
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}

/* A flood of connections to A's peer.listen from the generation side's
 * IP (fake_peer flood in B's namespace: 100 held open, each one A
 * closes opened again at once), while a fresh daemon B there dials A for
 * each of 32 fetches. From one IP A keeps at most 8 handshakes open that
 * have not proved the secret, closing the oldest: B's, whose HELLO
 * proves the secret and is read as A accepts it, is never the one
 * closed, and a dial that is cut anyway (its HELLO not there yet) is
 * dialled again within peer.connect_timeout_ms. Every fetch completes,
 * verified. Before: A closed the oldest of 64 open handshakes, B's among
 * them, and the fetch ended PEER_GONE; then (a HELLO read only by the
 * loop) 1 or 2 of 32 sometimes. */
#define P_FLOOD_FETCHES 32 /* each by a daemon B of its own */
TEST_T(peer_handshake_flood, 300)
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
    p_side(&cs, "hf-ctx", KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    p_side(&gs, "hf-gen", KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_open(a, &M_SMALL, &cs, 0, 8, &c);
    char a_ipport[64], cmd[600], out[512];
    p_ipport_of(&c, a_ipport, sizeof(a_ipport));
    FILE *fk[2];
    for (int i = 0; i < 2; i++) { /* two of them: twice the churn */
        snprintf(cmd, sizeof(cmd),
                 "ip netns exec %s %s/tests/fake_peer flood %s 50 200",
                 p_net.ns[1], build_dir(), a_ipport);
        fflush(NULL);
        fk[i] = popen(cmd, "r");
        CHECK(fk[i] != NULL);
        CHECK(fgets(out, sizeof(out), fk[i]) != NULL);
        CHECK_STR_CONTAINS(out, "flood 50");
    }
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    int failed = 0;
    for (uint64_t q = 1; q <= P_FLOOD_FETCHES; q++) {
        daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
        rank_open(b, &M_SMALL, &gs, 0, 8, &g);
        fill_req(&c, q, cb, 7);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, q, c.pool, cb, 2, 7, &p, T_MS), c.c);
        CHECK_KVX(kvx_fetch(g.c, q, p.data, p.len, g.pool, gb, 2, 0, T_MS),
                  g.c);
        kvx_context_params_free(&p);
        ev_t e[4];
        CHECK(collect(g.c, e, 4, 1, 15000) == 1);
        CHECK_EQ(e[0].req, q);
        if (e[0].kind == KVX_EVENT_COMPLETE) {
            wait_event(c.c, q, KVX_EVENT_COMPLETE, 0, 5000);
            CHECK_EQ(p_check_req(&g, q, gb, 7, 0), 0);
        } else {
            fprintf(stderr, "fetch %llu: %s\n", (unsigned long long)q,
                    e[0].msg);
            failed++;
            /* the offer, if it has not ended yet */
            ev_t ce[4];
            if (kvx_cancel(c.c, q, T_MS) == KVX_OK)
                collect(c.c, ce, 4, 1, 5000);
        }
        rank_close(&g);
        daemon_healthy(b);
        daemon_stop_ok(b);
    }
    fprintf(stderr, "%d of %d fetches failed under the flood\n", failed,
            P_FLOOD_FETCHES);
    CHECK_EQ(failed, 0);
    CHECK(log_contains(a, "handshakes open from"));
    for (int i = 0; i < 2; i++)
        pclose(fk[i]); /* its next dot ends the flood */
    rank_close(&c);
    daemon_healthy(a);
    daemon_stop_ok(a);
}

/* A dial to a closed port inside the cluster's networks says what
 * happened, "connection refused by IP:PORT", and no guess (before: "...
 * before its challenge (is this daemon outside its peer.allowed?)"). */
TEST_T(peer_closed_port_message, 60)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    static side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, "cp-ctx", "cp-gen", &c, &g);
    uint32_t cb[2] = {0, 1}, gb[2] = {2, 3};
    fill_req(&c, 1, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 7, &p, T_MS), c.c);
    char addr[96], want[96];
    snprintf(addr, sizeof(addr), "kvx://%s:1/00000000000000aa", p_net.ip[0]);
    snprintf(want, sizeof(want), "connection refused by %s:1", p_net.ip[0]);
    uint8_t f[4096];
    size_t fl;
    p_params_at(&p, addr, f, &fl);
    CHECK_KVX(kvx_fetch(g.c, 5, f, fl, g.pool, gb, 2, 0, T_MS), g.c);
    ev_t e = wait_event(g.c, 5, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 8000);
    fprintf(stderr, "closed port: %s\n", e.msg);
    CHECK_STR_CONTAINS(e.msg, want);
    CHECK(strstr(e.msg, "peer.allowed") == NULL);
    CHECK(log_wait(b, want, 2000));
    /* the genuine params still complete */
    CHECK_KVX(kvx_fetch(g.c, 1, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 1, gb, 7, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&g);
    rank_close(&c);
    p_stop_both(a, b);
}
