/*
 * t_peer_spread.c — one instance spread over both daemons (rank 0 on the
 * root daemon, rank 1 on the member): the batches both ranks see, a
 * spread context instance publishing late, ranks that leave, return,
 * join late or are replaced, a link that flaps, error fences, replicated
 * heads, and the batches between root and member lost, late, large, or
 * answered after their client left.
 */

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

/* A context instance spread over both daemons (rank 0 on A, rank 1 on
 * B), the generation rank on A fetching as soon as rank 0 has published:
 * the slice from rank 1 is asked for again until B's rank publishes, and
 * both daemons give the same params (the token is derived from the
 * cluster secret). A request rank 1 never publishes waits for it until
 * the fetch timeout: TIMED_OUT. */
TEST_T(peer_spread_context_late_publish, 60)
{
    p_setup();
    daemon_t *a =
        p_daemon(0, P_SECRET, NULL, "deadlines:\n  fetch_timeout_ms: 2000\n");
    daemon_t *b = p_daemon(1, P_SECRET, NULL, NULL);
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
    CHECK_KVX(kvx_fetch(g.c, 77, p0.data, p0.len, g.pool, gb, 3, 0, T_MS), g.c);
    sleep_ms(300); /* B has no offer yet: its slice is asked for again */
    CHECK_KVX(kvx_publish(c1.c, 77, c1.pool, cb, 3, ntok, &p1, T_MS), c1.c);
    CHECK_EQ(p0.len, p1.len);
    CHECK(!memcmp(p0.data, p1.data, p0.len));
    wait_event(g.c, 77, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 77, gb, ntok, 0), 0);
    /* the context instance's batches come from A for both ranks */
    wait_event(c0.c, 77, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c1.c, 77, KVX_EVENT_COMPLETE, 0, 5000);

    /* rank 1 never publishes request 78: asked again until the fetch
     * timeout (2 s here), which ends it */
    fill_req(&c0, 78, cb, ntok);
    kvx_context_params_t p2;
    CHECK_KVX(kvx_publish(c0.c, 78, c0.pool, cb, 3, ntok, &p2, T_MS), c0.c);
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_fetch(g.c, 78, p2.data, p2.len, g.pool, gb, 3, 0, T_MS), g.c);
    ev_t e = wait_event(g.c, 78, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 6000);
    CHECK(now_ms() - t0 >= 1900);
    fprintf(stderr, "request 78: %s\n", e.msg);
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
    int rc; /* lj: rank 1's poll, and what it read */
    uint32_t nevents;
    char msg[256];
    int64_t poll_ms; /* rl: how long rank 1's poll took */
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
    CHECK_KVX(kvx_fetch(g0.c, 5, p.data, p.len, g0.pool, gb, 2, 0, T_MS), g0.c);
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
    CHECK_KVX(kvx_fetch(s0.c, 1, p.data, p.len, s0.pool, gb, 2, 0, T_MS), s0.c);
    CHECK_KVX(kvx_fetch(s1.c, 1, p.data, p.len, s1.pool, gb, 2, 0, T_MS), s1.c);
    wait_event(s0.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(s1.c, 1, KVX_EVENT_COMPLETE, 0, 5000);
    kvx_context_params_free(&p);
    /* request 9 waits for rank 1, which has not fetched it, when the link
     * goes: the loss ends it */
    fill_req(&c, 9, cb, 7);
    CHECK_KVX(kvx_publish(c.c, 9, c.pool, cb, 2, 7, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(s0.c, 9, p.data, p.len, s0.pool, gb, 2, 0, T_MS), s0.c);
    kvx_context_params_free(&p);
    /* the cut: longer than the keep-alive timeout */
    char why[300];
    if (p_net.netns)
        CHECK(!p_sh(why, sizeof(why), "ip -n %s link set %s down", p_net.ns[0],
                    p_net.veth[0]));
    else
        CHECK(kill(b->pid, SIGSTOP) == 0);
    sleep_ms(P_KA_TIMEOUT_MS + 800);
    /* rank 0 reads request 9's end while the link is down (A runs; in
     * loopback, B is the one frozen): that batch is sealed without rank
     * 1, which reads it once back */
    ev_t e9 = wait_event(s0.c, 9, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 5000);
    fprintf(stderr, "request 9 on rank 0: %s\n", e9.msg);
    if (p_net.netns)
        CHECK(!p_sh(why, sizeof(why), "ip -n %s link set %s up", p_net.ns[0],
                    p_net.veth[0]));
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
    CHECK_KVX(kvx_fetch(s0.c, 2, p.data, p.len, s0.pool, gb, 2, 0, T_MS), s0.c);
    CHECK_KVX(kvx_fetch(s1.c, 2, p.data, p.len, s1.pool, gb, 2, 0, T_MS), s1.c);
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
    fprintf(stderr, "rank 0 got: %s; A's requests then: %.300s\n", e.msg, json);
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
    daemon_t *a =
        p_daemon(0, P_SECRET, NULL, "deadlines:\n  fetch_timeout_ms: 1500\n");
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
    CHECK_KVX(kvx_fetch(g0.c, 7, p.data, p.len, g0.pool, gb, 2, 0, T_MS), g0.c);
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
    CHECK_KVX(kvx_fetch(h0.c, 8, p.data, p.len, h0.pool, gb, 2, 0, T_MS), h0.c);
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
    CHECK_KVX(kvx_fetch(k0.c, 9, p.data, p.len, k0.pool, gb, 2, 0, T_MS), k0.c);
    e = wait_event(k0.c, 9, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT, 5000);
    fprintf(stderr, "request 9 after %lld ms: %s\n", (long long)(now_ms() - t9),
            e.msg);
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
    snprintf(want, sizeof(want),
             "context     2     1     1     -      0     "
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
    fprintf(stderr,
            "rank 0 read batch %llu (%u events), rank 1 batch %llu "
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
    fprintf(stderr,
            "rank 0 read batch %llu; C2 first reads batch %llu (%u "
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
    fprintf(stderr,
            "rank 0: %u events in %u batches; rank 1: %u in %u; the "
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
    while ((seq[0] == UINT64_MAX || seq[1] == UINT64_MAX) && now_ms() < end) {
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
                    fprintf(stderr,
                            "the new rank 1 read batch %llu of "
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

/* One request of the 2+2 case: how the calls of the four ranks (two
 * context ranks c[], two generation ranks g[], rank 0 of each on daemon
 * A, rank 1 on B) and a scheduler's reserve interleave. */
enum { KX_FETCH_FIRST, KX_PUBLISH_FIRST, KX_RESERVED, KX_INTERLEAVED, KX_N };

static void kx_publish(rank_t *c, const char *key, uint64_t req,
                       kvx_context_params_t *p)
{
    static const uint32_t cb[2] = {0, 1};
    fill_req(c, req, cb, 7);
    CHECK_KVX(kvx_publish_key(c->c, key, strlen(key), c->pool, cb, 2, 7, NULL,
                              0, p, T_MS),
              c->c);
}

static void kx_fetch(rank_t *g, const char *key, const char *ctx_addr)
{
    static const uint32_t gb[2] = {3, 2};
    CHECK_KVX(kvx_fetch_by_key(g->c, key, strlen(key), "kx-ctx", ctx_addr, key,
                               strlen(key), g->pool, gb, 2, 0, 0, T_MS),
              g->c);
}

static void kx_one(rank_t c[2], rank_t g[2], kvx_client_t *sched, int how,
                   uint64_t req)
{
    static const uint32_t gb[2] = {3, 2};
    char key[32];
    snprintf(key, sizeof(key), "kx-%llu", (unsigned long long)req);
    kvx_context_params_t p[2], rp;
    for (int i = 0; i < 2; i++)
        memset(g[i].base, 0xa5, g[i].size);
    switch (how) {
    case KX_FETCH_FIRST:
        kx_fetch(&g[0], key, c[0].addr);
        kx_fetch(&g[1], key, c[0].addr);
        kx_publish(&c[1], key, req, &p[1]);
        kx_publish(&c[0], key, req, &p[0]);
        break;
    case KX_PUBLISH_FIRST:
        kx_publish(&c[0], key, req, &p[0]);
        kx_publish(&c[1], key, req, &p[1]);
        kx_fetch(&g[1], key, c[0].addr);
        kx_fetch(&g[0], key, c[0].addr);
        break;
    case KX_RESERVED:
        CHECK_KVX(kvx_reserve(sched, "kx-ctx", key, strlen(key), 7, &rp, T_MS),
                  sched);
        kx_fetch(&g[0], key, c[0].addr);
        kx_fetch(&g[1], key, c[0].addr);
        kx_publish(&c[0], key, req, &p[0]);
        kx_publish(&c[1], key, req, &p[1]);
        /* the ranks' publishes give the reserved params back */
        for (int i = 0; i < 2; i++)
            CHECK(p[i].len == rp.len && !memcmp(p[i].data, rp.data, rp.len));
        kvx_context_params_free(&rp);
        break;
    default:
        kx_fetch(&g[1], key, c[0].addr);
        kx_publish(&c[0], key, req, &p[0]);
        kx_fetch(&g[0], key, c[0].addr);
        kx_publish(&c[1], key, req, &p[1]);
        break;
    }
    for (int i = 0; i < 2; i++) {
        ev_t e = wait_key(g[i].c, key, strlen(key), 8000);
        if (e.kind != KVX_EVENT_COMPLETE)
            fprintf(stderr,
                    "request %s (case %d): generation rank %d: %s %s: "
                    "%s\n",
                    key, how, i, kind_name(e.kind), kvx_status_name(e.code),
                    e.msg);
        CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
        e = wait_key(c[i].c, key, strlen(key), 8000);
        if (e.kind != KVX_EVENT_COMPLETE)
            fprintf(stderr,
                    "request %s (case %d): context rank %d: %s %s: "
                    "%s\n",
                    key, how, i, kind_name(e.kind), kvx_status_name(e.code),
                    e.msg);
        CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
        CHECK_EQ(p_check_req(&g[i], req, gb, 7, 0), 0);
        kvx_context_params_free(&p[i]);
    }
}

/* Fetch by key in the 2+2 placement: a context instance and a generation
 * instance each spread over daemons A and B. One generation request is
 * one consumer, whichever daemons it spans: every request completes on
 * every rank with the bytes, however the fetches, publishes and a
 * scheduler's reserve interleave (before: EXISTS on both generation
 * ranks, "taken by another fetch", in 2 runs of 10; with a reserve, the
 * context side ended EXISTS and the publishes gave new params). */
TEST_T(peer_spread_fetch_by_key_2x2, 120)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    side_t cs, gs;
    p_side2(&cs, "kx-ctx", KVX_ROLE_CONTEXT);
    p_side2(&gs, "kx-gen", KVX_ROLE_GENERATION);
    rank_t c[2], g[2];
    p_spread_open(a, b, &cs, 8, &c[0], &c[1]);
    p_spread_open(a, b, &gs, 8, &g[0], &g[1]);
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(a->sock, T_MS, &sched), 0);
    const char *n = getenv("KVX_KX_RUNS");
    int runs = n ? atoi(n) : 24;
    for (int i = 0; i < runs; i++)
        kx_one(c, g, sched, i % KX_N, 1000 + (uint64_t)i);
    kvx_close(sched);
    for (int i = 0; i < 2; i++) {
        rank_close(&g[i]);
        rank_close(&c[i]);
    }
    p_stop_both(a, b);
}

/* A released key is remembered, as a cancelled one is: with the context
 * instance spread over A and B, a fetch by key after the release ends
 * NOT_FOUND at once, on every generation rank, and holds no block
 * (before: TIMED_OUT after the whole fetch timeout). */
TEST_T(peer_spread_fetch_by_key_after_release, 60)
{
    p_setup();
    const char *dl = "deadlines:\n  fetch_timeout_ms: 20000\n";
    daemon_t *a = p_daemon(0, P_SECRET, NULL, dl);
    daemon_t *b = p_daemon(1, P_SECRET, NULL, dl);
    side_t cs, gs;
    p_side2(&cs, "kx-ctx", KVX_ROLE_CONTEXT);
    p_side2(&gs, "kx-gen", KVX_ROLE_GENERATION);
    rank_t c[2], g[2];
    p_spread_open(a, b, &cs, 8, &c[0], &c[1]);
    p_spread_open(a, b, &gs, 8, &g[0], &g[1]);
    kvx_client_t *router;
    CHECK_EQ(kvx_connect_observer(a->sock, T_MS, &router), 0);
    for (int i = 0; i < 2; i++)
        memset(g[i].base, 0xa5, g[i].size);
    kvx_context_params_t p[2];
    kx_publish(&c[0], "rel", 77, &p[0]);
    kx_publish(&c[1], "rel", 77, &p[1]);
    CHECK_KVX(kvx_release_by_key(router, "kx-ctx", c[0].addr, "rel", 3, T_MS),
              router);
    for (int i = 0; i < 2; i++) {
        ev_t e = wait_key(c[i].c, "rel", 3, 5000);
        CHECK_EQ(e.kind, KVX_EVENT_COMPLETE);
        CHECK_STR_CONTAINS(e.msg, "released");
        kvx_context_params_free(&p[i]);
    }
    int64_t t0 = now_ms();
    kx_fetch(&g[0], "rel", c[0].addr);
    kx_fetch(&g[1], "rel", c[0].addr);
    for (int i = 0; i < 2; i++) {
        ev_t e = wait_key(g[i].c, "rel", 3, 25000);
        fprintf(stderr, "rank %d after %lld ms: %s %s: %s\n", i,
                (long long)(now_ms() - t0), kind_name(e.kind),
                kvx_status_name(e.code), e.msg);
        CHECK_EQ(e.kind, KVX_EVENT_ERROR);
        CHECK_EQ(e.code, KVX_ERR_NOT_FOUND);
        CHECK_STR_CONTAINS(e.msg, "released");
    }
    CHECK(now_ms() - t0 < 5000); /* not the fetch timeout */
    for (int i = 0; i < 2; i++)
        CHECK_EQ(check_pool(&g[i], NULL, 0, 0xa5), 0);
    kvx_close(router);
    for (int i = 0; i < 2; i++) {
        rank_close(&g[i]);
        rank_close(&c[i]);
    }
    p_stop_both(a, b);
}

/* Renewed across a spread context instance whose daemons' default
 * leases differ: rank 0 on A publishes with a lease of 3 s, rank 1 on B
 * with none, so B's offer holds B's default, 600 ms. A scheduler on A
 * renews with A's params every second for 3.5 s: B renews its offer by
 * the params' lease, not its own shorter one, and a fetch after reads
 * both ranks' bytes. */
TEST_T(peer_spread_renew_by_the_params_lease, 60)
{
    p_setup();
    daemon_t *a = p_daemon(0, P_SECRET, NULL, NULL);
    daemon_t *b =
        p_daemon(1, P_SECRET, NULL, "deadlines:\n  offer_lease_ms: 600\n");
    static side_t cs;
    p_side2(&cs, "sr-ctx", KVX_ROLE_CONTEXT);
    static side_t gs;
    p_side(&gs, "sr-gen", KVX_ROLE_GENERATION, "trtllm", 4);
    rank_t c0, c1, g;
    p_spread_open(a, b, &cs, 8, &c0, &c1);
    rank_open(a, &M_SMALL, &gs, 0, 8, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[3] = {5, 1, 3}, gb[3] = {2, 7, 0};
    const uint32_t ntok = 10;
    fill_req(&c0, 7, cb, ntok);
    fill_req(&c1, 7, cb, ntok);
    kvx_context_params_t p0, p1;
    CHECK_KVX(ls_publish(&c0, 7, cb, 3, ntok, 3000, &p0), c0.c);
    CHECK_KVX(ls_publish(&c1, 7, cb, 3, ntok, 0, &p1), c1.c);
    uint32_t lease = 0;
    CHECK_EQ(kvx_params_lease(p1.data, p1.len, &lease), KVX_OK);
    CHECK_EQ(lease, 600); /* B's own */
    kvx_client_t *sched;
    CHECK_EQ(kvx_connect_observer(a->sock, T_MS, &sched), 0);
    kvx_outcome_t o[1];
    int64_t until = now_ms() + 3500;
    while (now_ms() < until) {
        CHECK_KVX(ls_renew(sched, &p0, 1, o), sched);
        sleep_ms(1000);
    }
    CHECK_KVX(kvx_fetch(g.c, 7, p0.data, p0.len, g.pool, gb, 3, 0, T_MS), g.c);
    wait_event(g.c, 7, KVX_EVENT_COMPLETE, 0, 5000);
    CHECK_EQ(p_check_req(&g, 7, gb, ntok, 0), 0);
    wait_event(c0.c, 7, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c1.c, 7, KVX_EVENT_COMPLETE, 0, 5000);
    kvx_close(sched);
    kvx_context_params_free(&p0);
    kvx_context_params_free(&p1);
    rank_close(&g);
    rank_close(&c0);
    rank_close(&c1);
    p_stop_both(a, b);
}
