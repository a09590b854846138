/*
 * t_agree.c — the batches the generation ranks of one instance agree on
 * in one daemon: waves of fetches polled in lockstep (every rank sees the
 * same batches, in the same order, sealed by at_least or the timeout),
 * and the error batch when one rank disconnects mid-request. Batches
 * across two daemons are in t_peer_spread.c.
 */

/* ---- 7. lockstep batches ---------------------------------------------- */

#define LS_N 24
#define LS_MAXB 64
#define LS_MAXE 32

typedef struct ls_batch {
    uint64_t seq;
    uint32_t n, at_least;
    uint64_t req[LS_MAXE];
    int kind[LS_MAXE];
} ls_batch_t;

typedef struct ls_shared {
    _Atomic int connected;
    pslot_t slots[LS_N];
    uint32_t nb[2];
    ls_batch_t b[2][LS_MAXB];
} ls_shared_t;

/* (wave of fetches, at_least, timeout_ms) per poll; at_least 1000 means
 * "more than will ever be pending": the timeout seals the batch. */
static const struct {
    uint32_t wave, at_least, timeout_ms;
} ls_plan[] = {
    {3, 1, 500}, {0, 1000, 80}, {5, 4, 500},  {1, 1000, 60},  {0, 0, 0},
    {7, 2, 500}, {0, 1000, 50}, {8, 8, 1000}, {0, 1000, 100},
};

typedef struct ls_arg {
    daemon_t *d;
    ls_shared_t *sh;
    uint32_t rank;
} ls_arg_t;

static void ls_rank_main(void *arg)
{
    ls_arg_t *a = arg;
    ls_shared_t *sh = a->sh;
    side_t gs = {.inst = "ls-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t g;
    rank_open(a->d, &M_LS, &gs, a->rank, LS_N * 2, &g);
    memset(g.base, 0xa5, g.size);
    barrier(&sh->connected, 3);
    uint32_t next = 0, seen = 0, nb = 0;
    uint32_t blocks[2];
    for (uint32_t step = 0; seen < LS_N || step < 12; step++) {
        CHECK(step < 60);
        uint32_t wave, at_least, tmo;
        size_t np = sizeof(ls_plan) / sizeof(ls_plan[0]);
        if (step < np) {
            wave = ls_plan[step].wave;
            at_least = ls_plan[step].at_least;
            tmo = ls_plan[step].timeout_ms;
        } else {
            wave = LS_N; /* the rest */
            at_least = step % 2 ? 1000 : 3;
            tmo = step % 2 ? 40 : 400;
        }
        for (uint32_t i = 0; i < wave && next < LS_N; i++, next++) {
            pslot_t *s = &sh->slots[next];
            blocks[0] = 2 * next + 1;
            blocks[1] = 2 * next;
            CHECK_KVX(kvx_fetch(g.c, 500 + next, s->data, s->len, g.pool,
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
                fprintf(stderr, "rank %u: request %llu %s: %s\n", a->rank,
                        (unsigned long long)b->events[i].request_id,
                        kind_name(b->events[i].kind), b->events[i].message);
        }
        seen += b->num_events;
        kvx_batch_free(b);
    }
    sh->nb[a->rank] = nb;
    CHECK_EQ(seen, LS_N);
    static expect_t e[LS_N];
    static uint32_t bt[LS_N][2];
    for (uint32_t q = 0; q < LS_N; q++) {
        bt[q][0] = 2 * q + 1;
        bt[q][1] = 2 * q;
        e[q] = (expect_t){500 + q, bt[q], 7, 0};
    }
    CHECK_EQ(check_pool(&g, e, LS_N, 0xa5), 0);
    rank_close(&g);
}

TEST(lockstep_batches)
{
    daemon_t *d = daemon_start(NULL);
    ls_shared_t *sh = shm_alloc(sizeof(*sh));
    ls_arg_t args[2] = {{d, sh, 0}, {d, sh, 1}};
    pid_t pids[2];
    for (int i = 0; i < 2; i++)
        pids[i] = spawn(ls_rank_main, &args[i]);
    side_t cs = {.inst = "ls-ctx",
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 8};
    rank_t c;
    rank_open(d, &M_LS, &cs, 0, LS_N, &c);
    for (uint32_t q = 0; q < LS_N; q++) {
        uint32_t blk = LS_N - 1 - q;
        fill_req(&c, 500 + q, &blk, 7);
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(c.c, 500 + q, c.pool, &blk, 1, 7, &p, T_MS), c.c);
        slot_put(&sh->slots[q], &p);
        kvx_context_params_free(&p);
    }
    barrier(&sh->connected, 3);
    CHECK(wait_children(pids, 2, 25000));
    ev_t ce[LS_N + 4];
    CHECK_EQ(collect(c.c, ce, LS_N + 4, LS_N, 5000), LS_N);
    rank_close(&c);

    /* batch k is the same on both ranks: seq, request ids, order, kinds */
    CHECK_EQ(sh->nb[0], sh->nb[1]);
    int timeout_sealed = 0, empty = 0;
    for (uint32_t k = 0; k < sh->nb[0]; k++) {
        ls_batch_t *x = &sh->b[0][k], *y = &sh->b[1][k];
        if (x->seq != k || y->seq != k || x->n != y->n)
            fprintf(stderr,
                    "batch %u: rank 0 seq %llu (%u events), rank 1 "
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
        empty += x->n == 0;
    }
    CHECK(timeout_sealed >= 3);
    CHECK(empty >= 2);
    daemon_stop_ok(d);
}

/* ---- 12. a rank of a two-rank instance disconnects ---------------------- */

typedef struct dc_sh {
    _Atomic int connected, fetched, rank1_gone;
    pslot_t slot;
    int got_kind, got_code;
    char msg[200];
} dc_sh_t;

typedef struct dc_arg {
    daemon_t *d;
    dc_sh_t *sh;
    uint32_t rank;
} dc_arg_t;

static void dc_gen_main(void *arg)
{
    dc_arg_t *a = arg;
    dc_sh_t *sh = a->sh;
    side_t gs = {.inst = "dc-gen",
                 .role = KVX_ROLE_GENERATION,
                 .tp = 2,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 4};
    rank_t g;
    rank_open(a->d, &M_SMALL, &gs, a->rank, 8, &g);
    barrier(&sh->connected, 2);
    slot_wait(&sh->slot);
    uint32_t bl[2] = {6, 1};
    CHECK_KVX(
        kvx_fetch(g.c, 21, sh->slot.data, sh->slot.len, g.pool, bl, 2, 0, T_MS),
        g.c);
    barrier(&sh->fetched, 2);
    if (a->rank == 1) {
        rank_close(&g); /* disconnect mid-request */
        atomic_store(&sh->rank1_gone, 1);
        return;
    }
    wait_count(&sh->rank1_gone, 1);
    ev_t e[8];
    int n = collect(g.c, e, 8, 1, 3000);
    CHECK(n >= 1);
    expect_event(e, n, 21, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE);
    CHECK_STR_CONTAINS(e[0].msg, "disconnected");
    rank_close(&g);
}

TEST(disconnect_error_batch)
{
    daemon_t *d = daemon_start(NULL);
    dc_sh_t *sh = shm_alloc(sizeof(*sh));
    dc_arg_t args[2] = {{d, sh, 0}, {d, sh, 1}};
    pid_t pids[2];
    for (int i = 0; i < 2; i++)
        pids[i] = spawn(dc_gen_main, &args[i]);
    /* context tp 2 with rank 1 silent: generation rank 0's heads come from
     * context rank 0 and arrive, rank 1's wait */
    side_t cs;
    rank_t c0, c1;
    ctx2_open(d, &M_SMALL, "dc-ctx", 8, &cs, &c0, &c1);
    uint32_t bl[2] = {0, 1};
    fill_req(&c0, 21, bl, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c0.c, 21, c0.pool, bl, 2, 8, &p, T_MS), c0.c);
    slot_put(&sh->slot, &p);
    CHECK(wait_children(pids, 2, 10000));
    ev_t e = wait_event(c0.c, 21, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, 3000);
    (void)e;
    kvx_context_params_free(&p);
    rank_close(&c0);
    rank_close(&c1);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* kvx_poll's timeout, by the rule of every call: 0 seals now with what
 * is pending (no wait for events), negative waits for at_least events
 * however long it takes: the empty batches the daemon seals at its own
 * bound (deadlines.poll_timeout_max_ms, 200 ms here) are read past, and
 * the batch with the event comes back; positive waits at most that. */
TEST(poll_timeout_rule)
{
    daemon_t *d = daemon_start("deadlines:\n  poll_timeout_max_ms: 200\n"
                               "  offer_lease_ms: 700\n");
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, "pr-ctx", "pr-gen", 8, &c, &g, &cs, &gs);
    kvx_batch_t *b;
    /* 0: at once, empty */
    int64_t t0 = now_ms();
    CHECK_KVX(kvx_poll(c.c, 1, 0, &b), c.c);
    CHECK(now_ms() - t0 < 150);
    CHECK_EQ(b->num_events, 0);
    uint64_t seq0 = b->seq;
    kvx_batch_free(b);
    /* 0 with an event pending: sealed now, holding it */
    uint32_t cb[1] = {0};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 1, 4, &p, T_MS), c.c);
    kvx_context_params_free(&p);
    CHECK_KVX(kvx_cancel(c.c, 1, T_MS), c.c);
    t0 = now_ms();
    CHECK_KVX(kvx_poll(c.c, 5, 0, &b), c.c);
    CHECK(now_ms() - t0 < 150);
    CHECK_EQ(b->num_events, 1);
    CHECK_EQ(b->events[0].kind, KVX_EVENT_CANCELLED);
    CHECK_EQ(b->seq, seq0 + 1);
    kvx_batch_free(b);
    /* positive: at most that long, then empty */
    t0 = now_ms();
    CHECK_KVX(kvx_poll(c.c, 1, 100, &b), c.c);
    CHECK(now_ms() - t0 >= 90);
    CHECK_EQ(b->num_events, 0);
    kvx_batch_free(b);
    /* negative: past the daemon's 200 ms bound (empty batches read
     * past), until the offer's lease (700 ms) ends it */
    CHECK_KVX(kvx_poll(c.c, 1, 0, &b), c.c); /* the cursor, read now */
    uint64_t seq1 = b->seq;
    kvx_batch_free(b);
    CHECK_KVX(kvx_publish(c.c, 2, c.pool, cb, 1, 4, &p, T_MS), c.c);
    kvx_context_params_free(&p);
    t0 = now_ms();
    CHECK_KVX(kvx_poll(c.c, 1, -1, &b), c.c);
    int64_t took = now_ms() - t0;
    CHECK(took >= 600);
    CHECK_EQ(b->num_events, 1);
    CHECK_EQ(b->events[0].request_id, 2);
    CHECK_EQ(b->events[0].kind, KVX_EVENT_TIMED_OUT);
    CHECK(b->seq >= seq1 + 3); /* two or more empty batches went by */
    kvx_batch_free(b);
    rank_close(&c);
    rank_close(&g);
    daemon_healthy(d);
    daemon_stop_ok(d);
}
