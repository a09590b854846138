/*
 * t_faults.c — the same fault has the same outcome whatever the
 * topology: each scenario runs with both instances on one daemon and
 * with the context instance on daemon A, the generation instance on B,
 * and must give the same reply code, event kind, event code and message
 * on both (protocol.md, "Fetch": checks that need the offer arrive as an
 * ERROR event; "Cancel"; "Disconnects").
 */

/* What a scenario saw. */
typedef struct fo {
    int rc;         /* the fetch's reply */
    char rmsg[200]; /* its kvx_last_error() */
    int nev;        /* events for the request on the observing side */
    ev_t ev;        /* the first of them */
} fo_t;

/* Events for req on c within ms (others dropped): how many, the first
 * in *first. */
static int fo_events(kvx_client_t *c, uint64_t req, int ms, ev_t *first)
{
    ev_t e[16];
    int n = collect(c, e, 16, 16, ms), k = 0;
    for (int i = 0; i < n && i < 16; i++)
        if (e[i].req == req && k++ == 0)
            *first = e[i];
    return k;
}

static void fo_print(const char *what, const char *topo, const fo_t *o)
{
    fprintf(stderr, "%s, %s: fetch %s \"%s\"; %d event(s): %s %s \"%s\"\n",
            what, topo, kvx_status_name(o->rc), o->rc ? o->rmsg : "", o->nev,
            o->nev ? kind_name(o->ev.kind) : "-",
            o->nev ? kvx_status_name(o->ev.code) : "-",
            o->nev ? o->ev.msg : "");
}

/* One outcome, as every topology must give it. */
static void fo_expect(const fo_t *o, int kind, int code, const char *msg)
{
    CHECK_EQ(o->rc, 0); /* accepted: the outcome is the event */
    CHECK_EQ(o->nev, 1);
    CHECK_EQ(o->ev.kind, kind);
    CHECK_EQ(o->ev.code, code);
    CHECK_STR_CONTAINS(o->ev.msg, msg);
}

/* Params p with one bit of the token flipped (malloc'd, *len set). */
static uint8_t *fo_forge(const kvx_context_params_t *p, size_t *len)
{
    Kvxfer__ContextParams *cp =
        kvxfer__context_params__unpack(NULL, p->len, p->data);
    CHECK(cp != NULL && cp->token.len == 16);
    cp->token.data[3] ^= 0x10;
    *len = kvxfer__context_params__get_packed_size(cp);
    uint8_t *f = malloc(*len);
    CHECK(f != NULL);
    kvxfer__context_params__pack(cp, f);
    kvxfer__context_params__free_unpacked(cp, NULL);
    return f;
}

/* Instance names of one scenario: base, then "-1" (one daemon) or "-2". */
typedef struct fo_names {
    char ctx[64], gen[64];
} fo_names_t;

static void fo_name(fo_names_t *n, const char *base, int two)
{
    snprintf(n->ctx, sizeof(n->ctx), "%s-ctx-%d", base, two + 1);
    snprintf(n->gen, sizeof(n->gen), "%s-gen-%d", base, two + 1);
}

/* A forged token, fetched by rank 0 of a tp-2 generation instance, then
 * by rank 1 once the event is out: one ERROR AUTH for the request on
 * both ranks, nothing written; the offer stays, and the genuine params
 * then move the bytes. */
static void fo_bad_token(daemon_t *a, daemon_t *b, fo_t *out)
{
    fo_names_t nm;
    fo_name(&nm, "ba", a != b);
    side_t cs, gs;
    rank_t c, g0, g1;
    p_side(&cs, nm.ctx, KVX_ROLE_CONTEXT, "vllm-nhd", 4);
    p_side2(&gs, nm.gen, KVX_ROLE_GENERATION);
    rank_open(a, &M_SMALL, &cs, 0, 8, &c);
    rank_open(b, &M_SMALL, &gs, 0, 8, &g0);
    rank_open(b, &M_SMALL, &gs, 1, 8, &g1);
    memset(g0.base, 0xa5, g0.size);
    memset(g1.base, 0xa5, g1.size);
    uint32_t cb[2] = {3, 1}, gb[2] = {6, 2};
    fill_req(&c, 1, cb, 8);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 1, c.pool, cb, 2, 8, &p, T_MS), c.c);
    size_t flen;
    uint8_t *forged = fo_forge(&p, &flen);
    memset(out, 0, sizeof(*out));
    out->rc = kvx_fetch(g0.c, 11, forged, flen, g0.pool, gb, 2, 0, T_MS);
    snprintf(out->rmsg, sizeof(out->rmsg), "%s", kvx_last_error(g0.c));
    out->nev = fo_events(g0.c, 11, 1500, &out->ev);
    ev_t e1;
    CHECK_EQ(fo_events(g1.c, 11, 1500, &e1), out->nev); /* the same batch */
    /* rank 1's fetch of the failed request: no second event */
    int rc1 = kvx_fetch(g1.c, 11, forged, flen, g1.pool, gb, 2, 0, T_MS);
    fprintf(stderr, "rank 1's fetch after the event: %s \"%s\"\n",
            kvx_status_name(rc1), rc1 ? kvx_last_error(g1.c) : "");
    out->nev += fo_events(g0.c, 11, 600, &e1);
    fo_events(g1.c, 11, 300, &e1);
    free(forged);
    CHECK_EQ(check_pool(&g0, NULL, 0, 0xa5), 0);
    CHECK_EQ(check_pool(&g1, NULL, 0, 0xa5), 0);
    /* the offer is untouched: the genuine params complete */
    CHECK_KVX(kvx_fetch(g0.c, 12, p.data, p.len, g0.pool, gb, 2, 0, T_MS),
              g0.c);
    CHECK_KVX(kvx_fetch(g1.c, 12, p.data, p.len, g1.pool, gb, 2, 0, T_MS),
              g1.c);
    wait_event(g0.c, 12, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(g1.c, 12, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 1, KVX_EVENT_COMPLETE, 0, 5000); /* its only event */
    CHECK_EQ(p_check_req(&g0, 1, gb, 8, 0), 0);
    CHECK_EQ(p_check_req(&g1, 1, gb, 8, 0), 0);
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g0);
    rank_close(&g1);
}

TEST_T(fault_bad_token_same_everywhere, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    fo_t one, two;
    fo_bad_token(a, a, &one);
    fo_bad_token(a, b, &two);
    p_stop_both(a, b);
    fo_print("bad token", "one daemon", &one);
    fo_print("bad token", "two daemons", &two);
    fo_expect(&one, KVX_EVENT_ERROR, KVX_ERR_AUTH,
              "context side: capability token does not match the offer of "
              "request 1");
    fo_expect(&two, KVX_EVENT_ERROR, KVX_ERR_AUTH,
              "context side: capability token does not match the offer of "
              "request 1");
}

/* The params of an offer that completed, fetched again under another
 * key: ERROR NOT_FOUND naming the request; the new blocks untouched. */
static void fo_no_offer(daemon_t *a, daemon_t *b, fo_t *out)
{
    fo_names_t nm;
    fo_name(&nm, "no", a != b);
    side_t cs, gs;
    rank_t c, g;
    p_pair(a, b, &cs, &gs, nm.ctx, nm.gen, &c, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[2] = {0, 4}, gb[2] = {1, 5}, gb2[2] = {2, 3};
    fill_req(&c, 2, cb, 6);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c.c, 2, c.pool, cb, 2, 6, &p, T_MS), c.c);
    CHECK_KVX(kvx_fetch(g.c, 21, p.data, p.len, g.pool, gb, 2, 0, T_MS), g.c);
    wait_event(g.c, 21, KVX_EVENT_COMPLETE, 0, 5000);
    wait_event(c.c, 2, KVX_EVENT_COMPLETE, 0, 5000);
    memset(out, 0, sizeof(*out));
    out->rc = kvx_fetch(g.c, 22, p.data, p.len, g.pool, gb2, 2, 0, T_MS);
    snprintf(out->rmsg, sizeof(out->rmsg), "%s", kvx_last_error(g.c));
    out->nev = fo_events(g.c, 22, 1500, &out->ev);
    expect_t ex = {2, gb, 6, 0};
    CHECK_EQ(check_pool(&g, &ex, 1, 0xa5), 0); /* gb2 untouched */
    ev_t e;
    CHECK_EQ(fo_events(c.c, 2, 300, &e), 0); /* the context side: nothing */
    kvx_context_params_free(&p);
    rank_close(&c);
    rank_close(&g);
}

TEST_T(fault_no_offer_same_everywhere, 90)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    fo_t one, two;
    fo_no_offer(a, a, &one);
    fo_no_offer(a, b, &two);
    p_stop_both(a, b);
    fo_print("no offer", "one daemon", &one);
    fo_print("no offer", "two daemons", &two);
    fo_expect(&one, KVX_EVENT_ERROR, KVX_ERR_NOT_FOUND,
              "context side: no offer for request 2 of instance 'no-ctx-");
    fo_expect(&two, KVX_EVENT_ERROR, KVX_ERR_NOT_FOUND,
              "context side: no offer for request 2 of instance 'no-ctx-");
}

/* The context side cancels its offer: (late) before the fetch comes, or
 * (!late) while a fetch waits for the context rank 1 that has not
 * published. The generation side: ERROR CANCELLED, "context side:
 * cancelled by the context side"; the context side: one CANCELLED. */
static void fo_ctx_cancel(daemon_t *a, daemon_t *b, int late, fo_t *out)
{
    fo_names_t nm;
    fo_name(&nm, late ? "cl" : "cw", a != b);
    side_t cs, gs;
    rank_t c0, c1, g;
    ctx2_open(a, &M_SMALL, nm.ctx, 8, &cs, &c0, &c1);
    p_side(&gs, nm.gen, KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_open(b, &M_SMALL, &gs, 0, 8, &g);
    memset(g.base, 0xa5, g.size);
    uint32_t cb[2] = {2, 3}, gb[2] = {4, 6};
    fill_req(&c0, 3, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c0.c, 3, c0.pool, cb, 2, 7, &p, T_MS), c0.c);
    memset(out, 0, sizeof(*out));
    if (late)
        CHECK_KVX(kvx_cancel(c0.c, 3, T_MS), c0.c);
    out->rc = kvx_fetch(g.c, 31, p.data, p.len, g.pool, gb, 2, 0, T_MS);
    snprintf(out->rmsg, sizeof(out->rmsg), "%s", kvx_last_error(g.c));
    if (!late) {
        sleep_ms(300); /* the fetch waits for rank 1's part */
        CHECK_KVX(kvx_cancel(c0.c, 3, T_MS), c0.c);
    }
    out->nev = fo_events(g.c, 31, 1500, &out->ev);
    ev_t e;
    CHECK_EQ(fo_events(c0.c, 3, 500, &e), 1);
    CHECK_EQ(e.kind, KVX_EVENT_CANCELLED);
    CHECK_EQ(e.code, KVX_ERR_CANCELLED);
    /* (while the fetch waits, the slices of rank 0 may have landed
     * between daemons: the blocks hold no KV until COMPLETE) */
    if (late)
        CHECK_EQ(check_pool(&g, NULL, 0, 0xa5), 0);
    kvx_context_params_free(&p);
    rank_close(&c0);
    rank_close(&c1);
    rank_close(&g);
}

TEST_T(fault_context_cancel_same_everywhere, 120)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    fo_t one, two, one_l, two_l;
    fo_ctx_cancel(a, a, 0, &one);
    fo_ctx_cancel(a, b, 0, &two);
    fo_ctx_cancel(a, a, 1, &one_l);
    fo_ctx_cancel(a, b, 1, &two_l);
    p_stop_both(a, b);
    fo_print("context cancel, fetch waiting", "one daemon", &one);
    fo_print("context cancel, fetch waiting", "two daemons", &two);
    fo_print("context cancel, then fetch", "one daemon", &one_l);
    fo_print("context cancel, then fetch", "two daemons", &two_l);
    const fo_t *all[4] = {&one, &two, &one_l, &two_l};
    for (int i = 0; i < 4; i++)
        fo_expect(all[i], KVX_EVENT_ERROR, KVX_ERR_CANCELLED,
                  "context side: cancelled by the context side");
}

/* The generation rank's client goes (at once after its fetch, or once
 * the fetch waits for context rank 1): the context side gets one ERROR
 * PEER_GONE naming the generation side's pool owner. */
static void fo_gen_gone(daemon_t *a, daemon_t *b, int wait, fo_t *out)
{
    fo_names_t nm;
    fo_name(&nm, wait ? "gw" : "gi", a != b);
    side_t cs, gs;
    rank_t c0, c1, g;
    ctx2_open(a, &M_SMALL, nm.ctx, 8, &cs, &c0, &c1);
    p_side(&gs, nm.gen, KVX_ROLE_GENERATION, "vllm-nhd", 4);
    rank_open(b, &M_SMALL, &gs, 0, 8, &g);
    uint32_t cb[2] = {2, 3}, gb[2] = {4, 6};
    fill_req(&c0, 4, cb, 7);
    kvx_context_params_t p;
    CHECK_KVX(kvx_publish(c0.c, 4, c0.pool, cb, 2, 7, &p, T_MS), c0.c);
    memset(out, 0, sizeof(*out));
    out->rc = kvx_fetch(g.c, 41, p.data, p.len, g.pool, gb, 2, 0, T_MS);
    if (wait)
        sleep_ms(300);
    rank_close(&g);
    out->nev = fo_events(c0.c, 4, 2500, &out->ev);
    kvx_context_params_free(&p);
    rank_close(&c0);
    rank_close(&c1);
}

TEST_T(fault_generation_gone_same_everywhere, 120)
{
    daemon_t *a, *b;
    p_two_daemons(&a, &b);
    fo_t one, two, one_w, two_w;
    fo_gen_gone(a, a, 0, &one);
    fo_gen_gone(a, b, 0, &two);
    fo_gen_gone(a, a, 1, &one_w);
    fo_gen_gone(a, b, 1, &two_w);
    p_stop_both(a, b);
    fo_print("generation rank gone at once", "one daemon", &one);
    fo_print("generation rank gone at once", "two daemons", &two);
    fo_print("generation rank gone while waiting", "one daemon", &one_w);
    fo_print("generation rank gone while waiting", "two daemons", &two_w);
    const fo_t *all[4] = {&one, &two, &one_w, &two_w};
    for (int i = 0; i < 4; i++)
        fo_expect(all[i], KVX_EVENT_ERROR, KVX_ERR_PEER_GONE,
                  "generation side: pool owner (pid ");
}
