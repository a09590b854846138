/*
 * fixtures.c — setups that tests of several files share (included after
 * harness.c): the models, a context and a generation rank in this
 * process, a context instance of tp 2 with a silent rank, slow copies of
 * a 64 MiB request, the multi-rank transfer case (xfer_case2: context
 * ranks on one daemon, generation ranks on another or the same), one
 * request between pools inside one memfd with guard bands, and running
 * commands (kvxferctl, kvxfer-bench).
 *
 * The peer tests use them too: the transfer and guard-band cases between
 * two daemons, M_LS, M_BIG, fresh_pair_ok(), cmd_run() and ctl_run().
 */

/* ---- models ----------------------------------------------------------- */

static const model_t M_SMALL = {
    .layers = 4, .heads = 4, .head_dim = 32, .kv = 2, .dtype = KVX_DTYPE_BF16};

static const model_t M_LS = {
    .layers = 2, .heads = 2, .head_dim = 16, .kv = 2, .dtype = KVX_DTYPE_BF16};

/* Slow copies: one worker, 4 KiB chunks, one at a time, so a 64 MiB
 * request stays in flight long enough to be cancelled or killed. */
#define SLOW_CFG                                                               \
    "copy:\n  worker_threads: 1\n  chunk_bytes: 4KiB\n"                        \
    "  max_inflight_chunks: 1\n"
static const model_t M_BIG = {
    .layers = 2, .heads = 2, .head_dim = 64, .kv = 2, .dtype = KVX_DTYPE_BF16};
#define BIG_TOK 65536u /* x 1 KiB per token = 64 MiB */
#define BIG_BLOCKS (BIG_TOK / 4)

static uint32_t *big_blocks(void)
{
    uint32_t *b = malloc(BIG_BLOCKS * sizeof(uint32_t));
    CHECK(b != NULL);
    for (uint32_t i = 0; i < BIG_BLOCKS; i++)
        b[i] = i;
    return b;
}

/* ---- ranks in this process -------------------------------------------- */

/* A context rank and a generation rank in this process. */
static void pair_open(daemon_t *d, const model_t *m, const char *ci,
                      const char *gi, uint32_t nblocks, rank_t *c, rank_t *g,
                      side_t *cs, side_t *gs)
{
    *cs = (side_t){.inst = ci,
                   .role = KVX_ROLE_CONTEXT,
                   .tp = 1,
                   .pp = 1,
                   .preset = "vllm-nhd",
                   .tpb = 4};
    *gs = (side_t){.inst = gi,
                   .role = KVX_ROLE_GENERATION,
                   .tp = 1,
                   .pp = 1,
                   .preset = "vllm-nhd",
                   .tpb = 4};
    rank_open(d, m, cs, 0, nblocks, c);
    rank_open(d, m, gs, 0, nblocks, g);
}

/* Context instance of tp 2 whose rank 1 stays silent. */
static void ctx2_open(daemon_t *d, const model_t *m, const char *inst,
                      uint32_t nblocks, side_t *cs, rank_t *c0, rank_t *c1)
{
    *cs = (side_t){.inst = inst,
                   .role = KVX_ROLE_CONTEXT,
                   .tp = 2,
                   .pp = 1,
                   .preset = "vllm-nhd",
                   .tpb = 4};
    rank_hello_only(d, m, cs, 0, c0);
    rank_hello_only(d, m, cs, 1, c1);
    rank_join(c0);
    rank_join(c1);
    rank_pool(c0, nblocks);
    rank_pool(c1, nblocks);
}

/* A fetch that a check of the offer refuses (no offer, its token, taken
 * already): accepted, then one ERROR event with code, its message
 * holding text, on one daemon as across two (protocol.md, "Fetch"). */
static ev_t fetch_fails_later(const rank_t *g, uint64_t req, const uint8_t *p,
                              size_t len, const uint32_t *blocks, uint32_t n,
                              int code, const char *text)
{
    CHECK_KVX(kvx_fetch(g->c, req, p, len, g->pool, blocks, n, 0, T_MS), g->c);
    ev_t e = wait_event(g->c, req, KVX_EVENT_ERROR, code, 3000);
    CHECK_STR_CONTAINS(e.msg, text);
    return e;
}

/* After the damage: a fresh pair moves bytes fine. */
static void fresh_pair_ok(daemon_t *d, const char *ci, const char *gi)
{
    rank_t c, g;
    side_t cs, gs;
    pair_open(d, &M_SMALL, ci, gi, 8, &c, &g, &cs, &gs);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[3] = {7, 2, 5}, gb[3] = {0, 6, 3};
    fill_req(&c, 99, cb, 11);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 99, c.pool, cb, 3, 11, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 99, p.data, p.len, g.pool, gb, 3, 0, T_MS), g.c);
    wait_event(g.c, 99, KVX_EVENT_COMPLETE, 0, 3000);
    wait_event(c.c, 99, KVX_EVENT_COMPLETE, 0, 3000);
    expect_t e = {99, gb, 11, 0};
    CHECK_EQ(check_pool(&g, &e, 1, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
}

/* ---- one transfer case: context ranks -> generation ranks ------------- */

#define XMAX_REQ 64
#define XMAX_RANKS 8

typedef struct xcase {
    const model_t *m;
    side_t ctx, gen;
    uint32_t nreq, maxtok, skip;
    /* derived */
    uint64_t ids[XMAX_REQ];
    uint32_t ntok[XMAX_REQ];
    uint32_t cmaxb, gmaxb;
    uint32_t cbl[XMAX_REQ][512], gbl[XMAX_REQ][512];
    daemon_t *d, *gd; /* context ranks' daemon, generation ranks' */
    _Atomic int *connected;
    _Atomic int *finished; /* ranks done: none leaves before all are (a
                              leaving rank ends its instance's requests) */
    pslot_t *slots;        /* nreq x nctx */
} xcase_t;

typedef struct rank_arg {
    xcase_t *x;
    uint32_t rank;
} rank_arg_t;

static uint32_t ceil_div(uint32_t a, uint32_t b)
{
    return (a + b - 1) / b;
}

static uint32_t x_nranks(const side_t *s)
{
    return s->tp * s->pp;
}

static void x_ctx_main(void *arg)
{
    rank_arg_t *a = arg;
    xcase_t *x = a->x;
    uint32_t nctx = x_nranks(&x->ctx);
    rank_t r;
    rank_open(x->d, x->m, &x->ctx, a->rank, x->nreq * x->cmaxb, &r);
    memset(r.base, 0x3c, r.size);
    for (uint32_t q = 0; q < x->nreq; q++)
        fill_req(&r, x->ids[q], x->cbl[q], x->ntok[q]);
    barrier(x->connected, (int)(nctx + x_nranks(&x->gen)));
    for (uint32_t q = 0; q < x->nreq; q++) {
        kvx_context_params_t p;
        CHECK_KVX(kvx_publish(r.c, x->ids[q], r.pool, x->cbl[q],
                              ceil_div(x->ntok[q], x->ctx.tpb), x->ntok[q], &p,
                              T_MS),
                  r.c);
        slot_put(&x->slots[q * nctx + a->rank], &p);
        kvx_context_params_free(&p);
    }
    ev_t ev[XMAX_REQ * 2];
    int n = collect(r.c, ev, XMAX_REQ * 2, (int)x->nreq, 15000);
    if (n != (int)x->nreq) {
        fprintf(stderr, "%s rank %u: %d of %u events\n", x->ctx.inst, a->rank,
                n, x->nreq);
        print_events("ctx", ev, n);
    }
    CHECK_EQ(n, x->nreq);
    for (uint32_t q = 0; q < x->nreq; q++)
        expect_event(ev, n, x->ids[q], KVX_EVENT_COMPLETE, 0);
    barrier(x->finished, (int)(x_nranks(&x->ctx) + x_nranks(&x->gen)));
    rank_close(&r);
}

static void x_gen_main(void *arg)
{
    rank_arg_t *a = arg;
    xcase_t *x = a->x;
    uint32_t nctx = x_nranks(&x->ctx);
    rank_t r;
    rank_open(x->gd, x->m, &x->gen, a->rank, x->nreq * x->gmaxb, &r);
    memset(r.base, 0xa5, r.size);
    barrier(x->connected, (int)(nctx + x_nranks(&x->gen)));
    for (uint32_t q = 0; q < x->nreq; q++) {
        pslot_t *s = &x->slots[q * nctx];
        slot_wait(s);
        CHECK_KVX(kvx_fetch(r.c, x->ids[q], s->data, s->len, r.pool, x->gbl[q],
                            ceil_div(x->ntok[q], x->gen.tpb), x->skip, T_MS),
                  r.c);
    }
    ev_t ev[XMAX_REQ * 2];
    int n = collect(r.c, ev, XMAX_REQ * 2, (int)x->nreq, 15000);
    if (n != (int)x->nreq) {
        fprintf(stderr, "%s rank %u: %d of %u events\n", x->gen.inst, a->rank,
                n, x->nreq);
        print_events("gen", ev, n);
    }
    CHECK_EQ(n, x->nreq);
    for (uint32_t q = 0; q < x->nreq; q++)
        expect_event(ev, n, x->ids[q], KVX_EVENT_COMPLETE, 0);
    expect_t e[XMAX_REQ];
    for (uint32_t q = 0; q < x->nreq; q++)
        e[q] = (expect_t){x->ids[q], x->gbl[q], x->ntok[q], x->skip};
    CHECK_EQ(check_pool(&r, e, (int)x->nreq, 0xa5), 0);
    barrier(x->finished, (int)(x_nranks(&x->ctx) + x_nranks(&x->gen)));
    rank_close(&r);
}

/* Run one case, context ranks on daemon d and generation ranks on gd:
 * every rank its own process; the context ranks publish every request,
 * generation ranks fetch and verify their whole pool. Also checks that
 * every context rank got identical params. */
static void xfer_case2(daemon_t *d, daemon_t *gd, const model_t *m,
                       const side_t *ctx, const side_t *gen, uint32_t nreq,
                       uint32_t maxtok, uint32_t skip)
{
    xcase_t *x = calloc(1, sizeof(*x));
    CHECK(x != NULL);
    CHECK(nreq <= XMAX_REQ);
    x->m = m;
    x->ctx = *ctx;
    x->gen = *gen;
    x->ctx.role = KVX_ROLE_CONTEXT;
    x->gen.role = KVX_ROLE_GENERATION;
    x->nreq = nreq;
    x->maxtok = maxtok;
    x->skip = skip;
    x->d = d;
    x->gd = gd;
    x->cmaxb = ceil_div(maxtok, ctx->tpb);
    x->gmaxb = ceil_div(maxtok, gen->tpb);
    CHECK(x->cmaxb <= 512 && x->gmaxb <= 512);
    static uint64_t salt;
    for (uint32_t q = 0; q < nreq; q++) {
        x->ids[q] = 0x5eed00000000ull + (++salt) * 7919;
        x->ntok[q] = maxtok - (q * 7) % 11;
        if (q == nreq - 1 && skip == 0 && nreq > 2)
            x->ntok[q] = 1; /* a one-token request */
        CHECK(x->ntok[q] > skip);
        /* scattered, distinct within and across requests, and different
         * on the two sides */
        for (uint32_t i = 0; i < x->cmaxb; i++)
            x->cbl[q][i] = i * nreq + q;
        for (uint32_t i = 0; i < x->gmaxb; i++)
            x->gbl[q][i] = (x->gmaxb - 1 - i) * nreq + (nreq - 1 - q);
    }
    uint32_t nctx = x_nranks(ctx), ngen = x_nranks(gen);
    CHECK(nctx + ngen <= XMAX_RANKS);
    x->connected = shm_alloc(sizeof(*x->connected));
    x->finished = shm_alloc(sizeof(*x->finished));
    x->slots = shm_alloc(sizeof(pslot_t) * nreq * nctx);
    rank_arg_t args[XMAX_RANKS];
    pid_t pids[XMAX_RANKS];
    uint32_t k = 0;
    for (uint32_t i = 0; i < nctx; i++, k++) {
        args[k] = (rank_arg_t){x, i};
        pids[k] = spawn(x_ctx_main, &args[k]);
    }
    for (uint32_t i = 0; i < ngen; i++, k++) {
        args[k] = (rank_arg_t){x, i};
        pids[k] = spawn(x_gen_main, &args[k]);
    }
    int ok = wait_children(pids, (int)k, 25000);
    if (!ok)
        fprintf(stderr,
                "case %s tp%u pp%u %s/%u -> %s tp%u pp%u %s/%u "
                "skip %u failed\n",
                ctx->inst, ctx->tp, ctx->pp, ctx->preset, ctx->tpb, gen->inst,
                gen->tp, gen->pp, gen->preset, gen->tpb, skip);
    CHECK(ok);
    /* the params are the same bytes on every context rank */
    for (uint32_t q = 0; q < nreq; q++)
        for (uint32_t i = 1; i < nctx; i++) {
            pslot_t *a = &x->slots[q * nctx], *b = &x->slots[q * nctx + i];
            CHECK_EQ(a->len, b->len);
            CHECK(memcmp(a->data, b->data, a->len) == 0);
        }
    munmap((void *)x->connected, sizeof(*x->connected));
    munmap(x->slots, sizeof(pslot_t) * nreq * nctx);
    free(x);
}

static void xfer_case(daemon_t *d, const model_t *m, const side_t *ctx,
                      const side_t *gen, uint32_t nreq, uint32_t maxtok,
                      uint32_t skip)
{
    xfer_case2(d, d, m, ctx, gen, nreq, maxtok, skip);
}

/* ---- one request between pools inside one memfd, guard bands ---------- */

#define GB_GUARD 8192
#define GB_SENT 0x5c

static uint32_t gb_rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*s >> 33);
}

/* One request from a context pool to a generation pool, both inside one
 * sealed memfd at offsets chosen by seed: unaligned, sometimes at 0,
 * sometimes back to back, in either order. cd serves the context rank,
 * gd the generation rank. */
static void gb_case(daemon_t *cd, daemon_t *gd, const char *tag, const char *cp,
                    const char *gp, uint64_t *seed)
{
    static const uint32_t tpbs[] = {2, 4, 8};
    char ci[64], gi[64];
    snprintf(ci, sizeof(ci), "%s-ctx", tag);
    snprintf(gi, sizeof(gi), "%s-gen", tag);
    side_t cs = {.inst = ci,
                 .role = KVX_ROLE_CONTEXT,
                 .tp = 1,
                 .pp = 1,
                 .preset = cp,
                 .tpb = tpbs[gb_rnd(seed) % 3]};
    side_t gs = {.inst = gi,
                 .role = KVX_ROLE_GENERATION,
                 .tp = 1,
                 .pp = 1,
                 .preset = gp,
                 .tpb = tpbs[gb_rnd(seed) % 3]};
    rank_t c, g;
    rank_hello_only(cd, &M_SMALL, &cs, 0, &c);
    rank_join(&c);
    rank_hello_only(gd, &M_SMALL, &gs, 0, &g);
    rank_join(&g);
    rank_layout(&c, 8, &c.lay);
    rank_layout(&g, 8, &g.lay);
    c.size = kvx_layout_span(&c.lay);
    g.size = kvx_layout_span(&g.lay);
    /* first pool at 0 or after a guard, the second right after it or
     * after a gap; either side first */
    int ctx_first = gb_rnd(seed) % 2;
    rank_t *first = ctx_first ? &c : &g, *second = ctx_first ? &g : &c;
    uint64_t o1 = gb_rnd(seed) % 4 ? GB_GUARD + gb_rnd(seed) % 4096 : 0;
    uint64_t o2 =
        o1 + first->size + (gb_rnd(seed) % 2 ? 0 : 1 + gb_rnd(seed) % 300);
    uint64_t total = o2 + second->size + GB_GUARD;
    int fd = memfd_create("kvx-guard", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, (off_t)total) == 0);
    CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    uint8_t *mem = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(mem != MAP_FAILED);
    memset(mem, GB_SENT, total);
    first->base = mem + o1;
    second->base = mem + o2;
    CHECK_KVX(kvx_pool_register_host(first->c, &first->lay, fd, o1, first->size,
                                     &first->pool, T_MS),
              first->c);
    CHECK_KVX(kvx_pool_register_host(second->c, &second->lay, fd, o2,
                                     second->size, &second->pool, T_MS),
              second->c);

    /* scattered blocks, different on the two sides */
    uint32_t ntok = 16 - gb_rnd(seed) % 5, cb[8], gb[8];
    uint32_t cn = ceil_div(ntok, cs.tpb), gn = ceil_div(ntok, gs.tpb);
    for (uint32_t i = 0; i < 8; i++) {
        cb[i] = (i * 5 + 3) % 8;
        gb[i] = 7 - i;
    }
    uint64_t req = 0x6b00 + gb_rnd(seed);
    fill_req(&c, req, cb, ntok);
    uint8_t *before = malloc(total);
    CHECK(before);
    memcpy(before, mem, total);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, req, c.pool, cb, cn, ntok, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, req, p.data, p.len, g.pool, gb, gn, 0, T_MS), g.c);
    wait_event(g.c, req, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, req, KVX_EVENT_COMPLETE, 0, 5000);
    kvx_context_params_free(&p);
    expect_t e = {req, gb, ntok, 0};
    uint64_t og = (uint64_t)(g.base - mem);
    if (check_pool(&g, &e, 1, GB_SENT) || memcmp(mem, before, og) ||
        memcmp(mem + og + g.size, before + og + g.size, total - og - g.size)) {
        for (uint64_t i = 0; i < total; i++)
            if ((i < og || i >= og + g.size) && mem[i] != before[i]) {
                fprintf(stderr,
                        "%s: byte %llu outside the destination "
                        "pool [%llu, +%llu) changed\n",
                        tag, (unsigned long long)i, (unsigned long long)og,
                        (unsigned long long)g.size);
                break;
            }
        fprintf(stderr, "%s: %s at %llu, %s at %llu, %llu bytes in all\n", tag,
                cp, (unsigned long long)(c.base - mem), gp,
                (unsigned long long)og, (unsigned long long)total);
        CHECK(!"wrong bytes, or bytes outside the destination pool written");
    }
    free(before);
    rank_close(&c);
    rank_close(&g);
    munmap(mem, total);
    close(fd);
}

static const char *const gb_presets[] = {"vllm-nhd", "vllm-hnd", "trtllm",
                                         "flashinfer"};

/* ---- commands --------------------------------------------------------- */

/* Run a shell command: its output (up to cap - 1 bytes) in out, its exit
 * status returned (-1: killed by a signal). */
static int cmd_run(const char *cmd, char *out, size_t cap)
{
    fflush(stdout);
    fflush(stderr);
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    size_t n = 0, k;
    while (n < cap - 1 && (k = fread(out + n, 1, cap - 1 - n, f)) > 0)
        n += k;
    out[n] = 0;
    char rest[4096]; /* past cap: read to the end, or pclose() could wait
                        on a command blocked writing */
    while (fread(rest, 1, sizeof(rest), f) > 0)
        ;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* kvxferctl ARGS, stderr included. */
static int ctl_run(const char *args, char *out, size_t cap)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s/kvxferctl %s 2>&1", build_dir(), args);
    return cmd_run(cmd, out, cap);
}

/* A daemon draining with one offer in flight (request 71 of instance
 * ci, published and not fetched): kvxferctl drain --deadline 3 runs in
 * the background (pclose() the handle) and the drain has begun. */
static FILE *drain_with_offer(daemon_t *d, const char *ci, const char *gi,
                              rank_t *c, rank_t *g)
{
    side_t cs, gs;
    pair_open(d, &M_SMALL, ci, gi, 16, c, g, &cs, &gs);
    uint32_t bl[2] = {0, 1};
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c->c, 71, c->pool, bl, 2, 8, &p, T_MS), c->c);
    kvx_context_params_free(&p);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "%s/kvxferctl --socket %s drain --deadline 3 >/dev/null 2>&1",
             build_dir(), d->sock);
    FILE *ctl = popen(cmd, "r");
    CHECK(ctl != NULL);
    CHECK(log_wait(d, "draining: 1 requests in flight", 5000));
    return ctl;
}

/* ---- two uids in one process ------------------------------------------ */

/* The next connections are made as uid (0: root again): the daemon takes
 * a client's uid from SO_PEERCRED, the effective uid at connect(). */
static void as_uid(uid_t uid)
{
    if (uid == 0) {
        CHECK(seteuid(0) == 0 && setegid(0) == 0);
        return;
    }
    CHECK(setegid(uid) == 0 && seteuid(uid) == 0);
}

static void need_root(const char *test)
{
    if (getuid() != 0) {
        fprintf(stderr, "%s: needs root to act as two other uids\n", test);
        CHECK(!"run the integration tests as root");
    }
}

/* rank_open() as uid: its pool of nblocks is filled with the sentinel
 * 0xa5 */
static void rank_open_as(daemon_t *d, uid_t uid, const model_t *m,
                         const side_t *s, uint32_t nblocks, rank_t *r)
{
    as_uid(uid);
    rank_hello_only(d, m, s, 0, r);
    as_uid(0);
    rank_join(r);
    rank_pool(r, nblocks);
    memset(r->base, 0xa5, r->size);
}

static kvx_client_t *router_as(daemon_t *d, uid_t uid)
{
    kvx_client_t *c = NULL;
    as_uid(uid);
    int rc = kvx_connect_observer(d->sock, T_MS, &c);
    as_uid(0);
    CHECK_EQ(rc, 0);
    return c;
}
