/*
 * test_plan — side checks, compatibility, slices for TP/PP changes and
 * replicated heads, token segments, and an end-to-end property: for many
 * random pairs of parallel configs and presets, plan_exec() moves every
 * element to where direct indexing says it belongs, and nothing else; so
 * does the GPU kernel's walk (gpu_desc.c's descriptor, gpu_walk.h's
 * indices) run on the CPU over host memory.
 */
#include "../../daemon/copy/plan.c"

#include "tests/test.h"

#include <stdint.h>

#include "common/layout.h"
#include "copy/gpu_desc.h"
#include "copy/gpu_walk.h"

/* ---- helpers ---- */

static uint64_t rng_state = 0xa4093822299f31d0ull;

static uint32_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static uint32_t rnd_in(uint32_t lo, uint32_t hi) /* inclusive */
{
    return lo + rnd() % (hi - lo + 1);
}

static plan_side_t side(uint32_t tp, uint32_t pp, uint32_t layers,
                        uint32_t heads, uint32_t tpb)
{
    plan_side_t s;
    memset(&s, 0, sizeof(s));
    s.tp = tp;
    s.pp = pp;
    s.cp = 1;
    s.total_layers = layers;
    s.total_heads = heads;
    s.kv_factor = 2;
    s.head_dim = 8;
    s.elem_size = 2;
    s.dtype = KVX_DTYPE_FP16;
    s.tokens_per_block = tpb;
    return s;
}

static void set_lpp(plan_side_t *s, const uint32_t *lpp, uint32_t n)
{
    s->num_layers_per_pp = n;
    for (uint32_t i = 0; i < n; i++)
        s->layers_per_pp[i] = lpp[i];
}

static plan_t *build(const plan_side_t *a, const plan_side_t *b, uint32_t rank,
                     uint32_t ntok, uint32_t skip)
{
    plan_t *p = NULL;
    char why[256] = "";
    int rc = plan_build(a, b, rank, ntok, skip, &p, KVX_WHY(why));
    if (rc)
        fprintf(stderr, "plan_build: %d %s\n", rc, why);
    CHECK_EQ(rc, 0);
    CHECK(p != NULL);
    CHECK_EQ(p->dst_rank, rank);
    return p;
}

static void expect_build_error(const plan_side_t *a, const plan_side_t *b,
                               uint32_t rank, uint32_t ntok, uint32_t skip,
                               int code, const char *needle)
{
    plan_t *p = (plan_t *)0x1;
    char why[256] = "";
    CHECK_EQ(plan_build(a, b, rank, ntok, skip, &p, KVX_WHY(why)), code);
    CHECK(p == (plan_t *)0x1); /* *out untouched on error */
    CHECK_STR_CONTAINS(why, needle);
}

static void expect_side_error(const plan_side_t *s, int code,
                              const char *needle)
{
    char why[256] = "";
    int rc = plan_side_check(s, KVX_WHY(why));
    if (rc != code)
        fprintf(stderr, "rc %d why '%s'\n", rc, why);
    CHECK_EQ(rc, code);
    CHECK_STR_CONTAINS(why, needle);
}

static const plan_slice_t *find_slice(const plan_t *p, uint32_t src_rank)
{
    for (uint32_t i = 0; i < p->nslices; i++)
        if (p->slices[i].src_rank == src_rank)
            return &p->slices[i];
    return NULL;
}

static void expect_slice(const plan_t *p, uint32_t src_rank, uint32_t l0,
                         uint32_t nl, uint32_t h0, uint32_t nh)
{
    const plan_slice_t *s = find_slice(p, src_rank);
    if (!s)
        fprintf(stderr, "no slice from source rank %u\n", src_rank);
    CHECK(s != NULL);
    CHECK_EQ(s->layer0, l0);
    CHECK_EQ(s->nlayers, nl);
    CHECK_EQ(s->head0, h0);
    CHECK_EQ(s->nheads, nh);
}

/* Segments cover [skip, ntok) exactly once, in order, each inside one
 * source and one destination block. */
static void check_segments(const plan_t *p, uint32_t ts, uint32_t td,
                           uint32_t ntok, uint32_t skip)
{
    uint64_t t = skip;
    CHECK(p->nsegs >= 1);
    for (uint32_t i = 0; i < p->nsegs; i++) {
        const plan_seg_t *g = &p->segs[i];
        CHECK(g->n >= 1);
        CHECK(g->src_tok < ts && g->dst_tok < td);
        CHECK_EQ((uint64_t)g->src_blk * ts + g->src_tok, t);
        CHECK_EQ((uint64_t)g->dst_blk * td + g->dst_tok, t);
        CHECK((uint64_t)g->src_tok + g->n <= ts);
        CHECK((uint64_t)g->dst_tok + g->n <= td);
        /* maximal: a segment ends at a block boundary or at the end */
        uint64_t end = t + g->n;
        CHECK(end == ntok || end % ts == 0 || end % td == 0);
        t = end;
    }
    CHECK_EQ(t, ntok);
    CHECK_EQ(p->src_blocks_needed, ((uint64_t)ntok + ts - 1) / ts);
    CHECK_EQ(p->dst_blocks_needed, ((uint64_t)ntok + td - 1) / td);
}

/* ---- plan_side_check ---- */

TEST(side_check_accepts_good_configs)
{
    char why[256];
    plan_side_t s = side(4, 2, 10, 8, 16);
    CHECK_EQ(plan_side_check(&s, KVX_WHY(why)), 0);
    s = side(8, 1, 10, 2, 16); /* replicated heads */
    CHECK_EQ(plan_side_check(&s, KVX_WHY(why)), 0);
    s = side(1, 3, 10, 1, 1);
    uint32_t lpp[3] = {2, 5, 3};
    set_lpp(&s, lpp, 3);
    CHECK_EQ(plan_side_check(&s, KVX_WHY(why)), 0);
    s = side(1, 10, 10, 1, 1); /* one layer per PP rank */
    CHECK_EQ(plan_side_check(&s, KVX_WHY(why)), 0);
}

TEST(side_check_refusals)
{
    plan_side_t s = side(4, 1, 10, 6, 16);
    expect_side_error(&s, KVX_ERR_INVALID, "6 heads do not split over tp 4");
    s = side(4, 1, 10, 3, 16); /* tp > heads but not a multiple */
    expect_side_error(&s, KVX_ERR_INVALID, "total_kv_heads");
    s = side(3, 1, 10, 2, 16);
    expect_side_error(&s, KVX_ERR_INVALID, "total_kv_heads");
    s = side(2, 1, 10, 0, 16);
    expect_side_error(&s, KVX_ERR_INVALID, "total_kv_heads: 0");
    s = side(0, 1, 10, 8, 16);
    expect_side_error(&s, KVX_ERR_INVALID, "at least 1");
    s = side(1, 0, 10, 8, 16);
    expect_side_error(&s, KVX_ERR_INVALID, "at least 1");
    s = side(2, 1, 10, 8, 16);
    s.cp = 2;
    expect_side_error(&s, KVX_ERR_UNSUPPORTED, "parallel.cp: 2");
    s.cp = 0;
    expect_side_error(&s, KVX_ERR_INVALID, "cp");
    s = side(64, 32, 100, 64, 16); /* 2048 ranks */
    expect_side_error(&s, KVX_ERR_INVALID, "exceeds");
    s = side(1, 1, 0, 8, 16);
    expect_side_error(&s, KVX_ERR_INVALID, "total_layers");
    s = side(1, 4, 3, 8, 16);
    expect_side_error(&s, KVX_ERR_INVALID, "parallel.pp: 4 exceeds");

    uint32_t lpp[3] = {2, 5, 4};
    s = side(1, 3, 10, 8, 16);
    set_lpp(&s, lpp, 3);
    expect_side_error(&s, KVX_ERR_INVALID, "sum 11 != total_layers 10");
    lpp[2] = 2;
    set_lpp(&s, lpp, 3);
    expect_side_error(&s, KVX_ERR_INVALID, "sum 9 != total_layers 10");
    set_lpp(&s, lpp, 2);
    expect_side_error(&s, KVX_ERR_INVALID, "2 entries for pp 3");
    uint32_t z[3] = {0, 5, 5};
    set_lpp(&s, z, 3);
    expect_side_error(&s, KVX_ERR_INVALID, "layers_per_pp[0]: 0");
}

TEST(pp_and_tp_ranges)
{
    plan_side_t s = side(1, 3, 10, 8, 16);
    uint32_t f, n;
    /* even split, remainder to the first ranks: 4, 3, 3 */
    n = plan_pp_layers(&s, 0, &f);
    CHECK(f == 0 && n == 4);
    n = plan_pp_layers(&s, 1, &f);
    CHECK(f == 4 && n == 3);
    n = plan_pp_layers(&s, 2, &f);
    CHECK(f == 7 && n == 3);
    uint32_t lpp[3] = {1, 7, 2};
    set_lpp(&s, lpp, 3);
    n = plan_pp_layers(&s, 1, &f);
    CHECK(f == 1 && n == 7);
    n = plan_pp_layers(&s, 2, &f);
    CHECK(f == 8 && n == 2);
    s = side(4, 1, 10, 8, 16);
    n = plan_tp_heads(&s, 3, &f);
    CHECK(f == 6 && n == 2);
    s = side(8, 1, 10, 2, 16);
    for (uint32_t t = 0; t < 8; t++) {
        n = plan_tp_heads(&s, t, &f);
        CHECK_EQ(n, 1);
        CHECK_EQ(f, t / 4);
    }
    CHECK_EQ(plan_side_ranks(&s), 8);
}

/* ---- plan_compat ---- */

TEST(compat_names_each_field)
{
    plan_side_t a = side(2, 1, 10, 8, 16), b = side(4, 2, 10, 8, 4);
    char why[256];
    CHECK_EQ(plan_compat(&a, &b, KVX_WHY(why)), 0);
    static const char *const names[] = {"dtype",        "elem_size",
                                        "head_dim",     "total_kv_heads",
                                        "total_layers", "kv_factor"};
    for (int i = 0; i < 6; i++) {
        plan_side_t c = b;
        switch (i) {
        case 0:
            c.dtype = KVX_DTYPE_BF16;
            break;
        case 1:
            c.elem_size = 4;
            break;
        case 2:
            c.head_dim = 16;
            break;
        case 3:
            c.total_heads = 4;
            break;
        case 4:
            c.total_layers = 12;
            break;
        default:
            c.kv_factor = 1;
            break;
        }
        why[0] = 0;
        CHECK_EQ(plan_compat(&a, &c, KVX_WHY(why)), KVX_ERR_MISMATCH);
        CHECK_STR_CONTAINS(why, names[i]);
        /* and plan_build refuses with the same message */
        expect_build_error(&a, &c, 0, 10, 0, KVX_ERR_MISMATCH, names[i]);
    }
    plan_side_t c = b;
    c.dtype = KVX_DTYPE_BF16;
    CHECK_EQ(plan_compat(&a, &c, KVX_WHY(why)), KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(why, "fp16");
    CHECK_STR_CONTAINS(why, "bf16");
}

TEST(build_refuses_bad_arguments)
{
    plan_side_t a = side(2, 1, 10, 8, 16), b = side(2, 2, 10, 8, 16);
    expect_build_error(&a, &b, 4, 10, 0, KVX_ERR_INVALID, "rank: 4");
    expect_build_error(&a, &b, 0, 0, 0, KVX_ERR_INVALID, "num_tokens: 0");
    expect_build_error(&a, &b, 0, 10, 10, KVX_ERR_INVALID, "skip_tokens");
    expect_build_error(&a, &b, 0, 10, 11, KVX_ERR_INVALID, "skip_tokens");
    plan_side_t bad = side(3, 1, 10, 8, 16);
    expect_build_error(&bad, &b, 0, 10, 0, KVX_ERR_INVALID, "tp 3");
    expect_build_error(&a, &bad, 0, 10, 0, KVX_ERR_INVALID, "tp 3");
    bad = side(2, 1, 10, 8, 16);
    bad.cp = 2;
    expect_build_error(&a, &bad, 0, 10, 0, KVX_ERR_UNSUPPORTED, "cp");
}

/* ---- slices ---- */

TEST(slices_tp_4_to_2)
{
    plan_side_t a = side(4, 1, 6, 8, 16), b = side(2, 1, 6, 8, 16);
    plan_t *p = build(&a, &b, 0, 20, 0);
    CHECK_EQ(p->nslices, 2);
    expect_slice(p, 0, 0, 6, 0, 2);
    expect_slice(p, 1, 0, 6, 2, 2);
    CHECK_EQ(p->slices[0].dst_head_base, 0);
    CHECK_EQ(p->slices[1].src_head_base, 2);
    plan_free(p);
    p = build(&a, &b, 1, 20, 0);
    CHECK_EQ(p->nslices, 2);
    expect_slice(p, 2, 0, 6, 4, 2);
    expect_slice(p, 3, 0, 6, 6, 2);
    CHECK_EQ(p->slices[0].dst_head_base, 4);
    CHECK_EQ(p->slices[1].src_head_base, 6);
    /* bytes: 6 layers * 4 heads * 20 tokens * K 2 * D 8 * 2 bytes */
    CHECK_EQ(p->bytes, 6ull * 4 * 20 * 2 * 8 * 2);
    plan_free(p);
}

TEST(slices_tp_2_to_4)
{
    plan_side_t a = side(2, 1, 6, 8, 16), b = side(4, 1, 6, 8, 16);
    for (uint32_t r = 0; r < 4; r++) {
        plan_t *p = build(&a, &b, r, 20, 0);
        CHECK_EQ(p->nslices, 1);
        expect_slice(p, r / 2, 0, 6, 2 * r, 2);
        CHECK_EQ(p->slices[0].src_head_base, 4 * (r / 2));
        CHECK_EQ(p->slices[0].dst_head_base, 2 * r);
        plan_free(p);
    }
}

TEST(slices_replicated_heads_spread_load)
{
    /* 8 source ranks, 2 heads: ranks 0-3 hold head 0, 4-7 head 1 */
    plan_side_t a = side(8, 1, 4, 2, 16);
    /* destination also tp 8: every rank needs one head; the four ranks
     * that need the same head read four different replicas */
    plan_side_t b = side(8, 1, 4, 2, 16);
    uint32_t used[8] = {0};
    for (uint32_t r = 0; r < 8; r++) {
        plan_t *p = build(&a, &b, r, 20, 0);
        CHECK_EQ(p->nslices, 1);
        uint32_t src = p->slices[0].src_rank;
        CHECK_EQ(p->slices[0].head0, r / 4);
        CHECK_EQ(p->slices[0].nheads, 1);
        CHECK_EQ(src / 4, r / 4); /* a replica of the right head */
        used[src]++;
        plan_free(p);
    }
    for (int i = 0; i < 8; i++)
        CHECK_EQ(used[i], 1);

    /* destination tp 4 (2 ranks per head): the pair picks two replicas */
    b = side(4, 1, 4, 2, 16);
    uint32_t s0 = 99, s1 = 99;
    for (uint32_t r = 0; r < 2; r++) {
        plan_t *p = build(&a, &b, r, 20, 0);
        CHECK_EQ(p->nslices, 1);
        CHECK_EQ(p->slices[0].head0, 0);
        CHECK(p->slices[0].src_rank < 4);
        if (r == 0)
            s0 = p->slices[0].src_rank;
        else
            s1 = p->slices[0].src_rank;
        plan_free(p);
    }
    CHECK(s0 != s1);

    /* destination tp 1 needs both heads: one slice per head group */
    b = side(1, 1, 4, 2, 16);
    plan_t *p = build(&a, &b, 0, 20, 0);
    CHECK_EQ(p->nslices, 2);
    CHECK(p->slices[0].src_rank < 4 && p->slices[1].src_rank >= 4);
    CHECK_EQ(p->slices[0].head0, 0);
    CHECK_EQ(p->slices[1].head0, 1);
    plan_free(p);
}

TEST(slices_pp_2_to_1)
{
    plan_side_t a = side(2, 2, 10, 4, 16), b = side(1, 1, 10, 4, 16);
    plan_t *p = build(&a, &b, 0, 20, 0);
    /* 2 PP ranks x 2 TP ranks */
    CHECK_EQ(p->nslices, 4);
    expect_slice(p, 0, 0, 5, 0, 2);
    expect_slice(p, 1, 0, 5, 2, 2);
    expect_slice(p, 2, 5, 5, 0, 2);
    expect_slice(p, 3, 5, 5, 2, 2);
    CHECK_EQ(find_slice(p, 2)->src_layer_base, 5);
    CHECK_EQ(find_slice(p, 2)->dst_layer_base, 0);
    plan_free(p);
}

TEST(slices_pp_1_to_3_uneven)
{
    plan_side_t a = side(1, 1, 10, 4, 16), b = side(1, 3, 10, 4, 16);
    uint32_t lpp[3] = {2, 5, 3};
    set_lpp(&b, lpp, 3);
    uint32_t first[3] = {0, 2, 7};
    for (uint32_t r = 0; r < 3; r++) {
        plan_t *p = build(&a, &b, r, 20, 0);
        CHECK_EQ(p->nslices, 1);
        expect_slice(p, 0, first[r], lpp[r], 0, 4);
        CHECK_EQ(p->slices[0].src_layer_base, 0);
        CHECK_EQ(p->slices[0].dst_layer_base, first[r]);
        plan_free(p);
    }
    /* uneven on both sides: 3,3,4 -> 5,5 */
    uint32_t la[3] = {3, 3, 4};
    a = side(1, 3, 10, 4, 16);
    set_lpp(&a, la, 3);
    b = side(1, 2, 10, 4, 16);
    plan_t *p = build(&a, &b, 0, 20, 0);
    CHECK_EQ(p->nslices, 2);
    expect_slice(p, 0, 0, 3, 0, 4);
    expect_slice(p, 1, 3, 2, 0, 4);
    plan_free(p);
    p = build(&a, &b, 1, 20, 0);
    CHECK_EQ(p->nslices, 2);
    expect_slice(p, 1, 5, 1, 0, 4);
    expect_slice(p, 2, 6, 4, 0, 4);
    CHECK_EQ(find_slice(p, 2)->src_layer_base, 6);
    CHECK_EQ(find_slice(p, 2)->dst_layer_base, 5);
    plan_free(p);
}

TEST(slices_tp_and_pp_together)
{
    /* src tp 2 pp 2, dst tp 4 pp 1: dst rank 3 needs heads 6-7 of every
     * layer, from source tp rank 1 of both PP stages */
    plan_side_t a = side(2, 2, 8, 8, 16), b = side(4, 1, 8, 8, 16);
    plan_t *p = build(&a, &b, 3, 20, 0);
    CHECK_EQ(p->nslices, 2);
    expect_slice(p, 1, 0, 4, 6, 2);
    expect_slice(p, 3, 4, 4, 6, 2);
    plan_free(p);
    /* dst tp 1 pp 2, rank 1 = PP stage 1: layers 4-7, all heads */
    b = side(1, 2, 8, 8, 16);
    p = build(&a, &b, 1, 20, 0);
    CHECK_EQ(p->nslices, 2);
    expect_slice(p, 2, 4, 4, 0, 4);
    expect_slice(p, 3, 4, 4, 4, 4);
    plan_free(p);
}

/* ---- segments ---- */

TEST(segments_cover_tokens_once)
{
    static const uint32_t cases[][4] = {
        /* ts, td, ntok, skip */
        {16, 4, 50, 0},   {4, 16, 50, 0}, {5, 7, 71, 0},  {7, 5, 71, 0},
        {16, 4, 50, 13},  {5, 7, 71, 34}, {5, 7, 71, 70}, {1, 64, 200, 3},
        {64, 1, 200, 63}, {3, 3, 10, 0},  {3, 3, 10, 4},  {16, 16, 16, 15},
        {16, 16, 17, 16}, {1, 1, 1, 0},   {7, 5, 35, 0},  {65536, 1, 9, 2},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        plan_side_t a = side(1, 1, 2, 2, cases[i][0]);
        plan_side_t b = side(1, 1, 2, 2, cases[i][1]);
        plan_t *p = build(&a, &b, 0, cases[i][2], cases[i][3]);
        check_segments(p, cases[i][0], cases[i][1], cases[i][2], cases[i][3]);
        plan_free(p);
    }
    /* 16 -> 4 from 0: every segment is one destination block */
    plan_side_t a = side(1, 1, 2, 2, 16), b = side(1, 1, 2, 2, 4);
    plan_t *p = build(&a, &b, 0, 50, 0);
    CHECK_EQ(p->nsegs, 13);
    CHECK_EQ(p->segs[12].n, 2);
    plan_free(p);
    /* 5 -> 7: cuts at 5, 7, 10, 14, 15, 20, 21 */
    a = side(1, 1, 2, 2, 5);
    b = side(1, 1, 2, 2, 7);
    p = build(&a, &b, 0, 21, 0);
    CHECK_EQ(p->nsegs, 7);
    static const uint32_t len[7] = {5, 2, 3, 4, 1, 5, 1};
    for (int i = 0; i < 7; i++)
        CHECK_EQ(p->segs[i].n, len[i]);
    plan_free(p);
}

TEST(segments_random)
{
    for (int i = 0; i < 3000; i++) {
        uint32_t ts = rnd_in(1, 70), td = rnd_in(1, 70);
        uint32_t n = rnd_in(1, 600), skip = rnd() % 3 ? rnd() % n : 0;
        plan_side_t a = side(1, 1, 2, 2, ts), b = side(1, 1, 2, 2, td);
        plan_t *p = build(&a, &b, 0, n, skip);
        check_segments(p, ts, td, n, skip);
        plan_free(p);
    }
}

TEST(segments_near_uint32_max_tokens)
{
    /* The block counts and the segment array must not wrap when
     * num_tokens + tokens_per_block - 1 exceeds 32 bits. */
    plan_side_t a = side(1, 1, 2, 2, 16), b = side(1, 1, 2, 2, 64);
    uint32_t n = UINT32_MAX, skip = UINT32_MAX - 100;
    plan_t *p = build(&a, &b, 0, n, skip);
    CHECK_EQ(p->src_blocks_needed, 268435456u); /* ceil(2^32-1 / 16) */
    CHECK_EQ(p->dst_blocks_needed, 67108864u);
    check_segments(p, 16, 64, n, skip);
    plan_free(p);
}

TEST(segment_count_does_not_wrap)
{
    /* one token per block on both sides and 2^31 + 5 tokens: the segment
     * array's size (source blocks + destination blocks + 1) exceeds 32
     * bits. Refusing for memory is fine; a short array is not. */
    plan_side_t a = side(1, 1, 2, 2, 1), b = side(1, 1, 2, 2, 1);
    uint32_t n = 0x80000005u, skip = n - 100;
    plan_t *p = NULL;
    char why[256] = "";
    int rc = plan_build(&a, &b, 0, n, skip, &p, KVX_WHY(why));
    if (rc) {
        CHECK_EQ(rc, KVX_ERR_NOMEM);
        return;
    }
    CHECK_EQ(p->nsegs, 100);
    check_segments(p, 1, 1, n, skip);
    plan_free(p);
}

/* ---- units and bytes ---- */

/* Give p the row shape of destination rank r of side b (vllm-nhd),
 * which plan_units_bytes() reads. */
static void bind_dst_layout(plan_t *p, const plan_side_t *b, uint32_t r,
                            kvx_layout_t *dl)
{
    uint32_t f;
    CHECK_EQ(kvx_layout_preset("vllm-nhd", plan_pp_layers(b, r / b->tp, &f),
                               b->kv_factor, plan_tp_heads(b, r % b->tp, &f),
                               b->head_dim, KVX_DTYPE_FP16, b->tokens_per_block,
                               64, dl),
             0);
    p->dst.layout = dl;
}

/* A random plan for one rank between two sides of 6 layers and 4 heads
 * (tp 1 to 4, pp 1 or 2, 1 to 20 tokens a block), 1 to 100 tokens, with
 * its destination row shape bound to dl. */
static plan_t *random_bound_plan(kvx_layout_t *dl)
{
    plan_side_t a = side(1u << rnd_in(0, 2), rnd_in(1, 2), 6, 4, rnd_in(1, 20));
    plan_side_t b = side(1u << rnd_in(0, 2), rnd_in(1, 2), 6, 4, rnd_in(1, 20));
    uint32_t n = rnd_in(1, 100);
    uint32_t r = rnd() % plan_side_ranks(&b);
    plan_t *p = build(&a, &b, r, n, 0);
    bind_dst_layout(p, &b, r, dl);
    return p;
}

/* plan_cut_pieces(): pieces tile [u0, u1) in order, on unit boundaries,
 * bytes adding up; each within pb unless a lone unit is larger or it is
 * the last one allowed; no two neighbours could have been one piece; the
 * same cut every time. */
TEST(cut_pieces_tile_units)
{
    for (int i = 0; i < 300; i++) {
        kvx_layout_t dl;
        plan_t *p = random_bound_plan(&dl);
        if (!p->nunits) {
            plan_free(p);
            continue;
        }
        uint64_t u0 = rnd() % p->nunits;
        uint64_t u1 = u0 + 1 + rnd() % (p->nunits - u0);
        uint64_t pb = 1 + rnd() % 2048;
        uint32_t max = rnd_in(1, 64);
        plan_piece_t pc[64], again[64];
        uint32_t np = plan_cut_pieces(p, u0, u1, pb, pc, max);
        CHECK(np >= 1 && np <= max);
        uint64_t u = u0, off = 0;
        for (uint32_t k = 0; k < np; k++) {
            CHECK_EQ(pc[k].u0, u);
            CHECK(pc[k].u1 > pc[k].u0);
            CHECK_EQ(pc[k].off, off);
            CHECK_EQ(pc[k].len, plan_units_bytes(p, pc[k].u0, pc[k].u1));
            if (k + 1 < max)
                CHECK(pc[k].len <= pb || pc[k].u1 == pc[k].u0 + 1);
            if (k + 1 < np) /* it stopped because the next unit did not fit */
                CHECK(pc[k].len + plan_units_bytes(p, pc[k].u1, pc[k].u1 + 1) >
                      pb);
            u = pc[k].u1;
            off += pc[k].len;
        }
        CHECK_EQ(u, u1);
        CHECK_EQ(off, plan_units_bytes(p, u0, u1));
        CHECK_EQ(plan_cut_pieces(p, u0, u1, pb, again, max), np);
        CHECK(memcmp(pc, again, np * sizeof(pc[0])) == 0);
        plan_free(p);
    }
}

/* plan_units_fit(): the longest run of whole units from u0 within max
 * bytes; walking a range with it (as PULLs do) tiles it, and the same
 * call gives the same run (a daemon gathering ahead predicts PULLs). */
TEST(units_fit_tiles_a_range)
{
    for (int i = 0; i < 300; i++) {
        kvx_layout_t dl;
        plan_t *p = random_bound_plan(&dl);
        uint64_t u_end = p->nunits, max = 1 + rnd() % 4096, u = 0;
        while (u < u_end) {
            uint64_t bytes, again;
            uint64_t u1 = plan_units_fit(p, u, u_end, max, &bytes);
            CHECK(u1 >= u && u1 <= u_end);
            CHECK_EQ(bytes, plan_units_bytes(p, u, u1));
            CHECK(bytes <= max);
            CHECK_EQ(plan_units_fit(p, u, u_end, max, &again), u1);
            CHECK_EQ(again, bytes);
            if (u1 < u_end) /* it stopped because the next did not fit */
                CHECK(bytes + plan_units_bytes(p, u1, u1 + 1) > max);
            if (u1 == u) { /* a unit larger than max: nothing fits */
                CHECK(plan_units_bytes(p, u, u + 1) > max);
                break;
            }
            u = u1;
        }
        uint64_t none;
        CHECK_EQ(plan_units_fit(p, u_end, u_end, max, &none), u_end);
        CHECK_EQ(none, 0);
        plan_free(p);
    }
}

TEST(units_bytes_sum_to_plan_bytes)
{
    for (int i = 0; i < 300; i++) {
        uint32_t heads = 1u << rnd_in(0, 3);
        plan_side_t a =
            side(1u << rnd_in(0, 3), rnd_in(1, 3), 6, heads, rnd_in(1, 20));
        plan_side_t b =
            side(1u << rnd_in(0, 3), rnd_in(1, 3), 6, heads, rnd_in(1, 20));
        a.kv_factor = b.kv_factor = rnd_in(1, 2);
        uint32_t n = rnd_in(1, 100), skip = rnd() % n;
        uint32_t r = rnd() % plan_side_ranks(&b);
        kvx_layout_t dl;
        uint32_t f;
        plan_t *p = build(&a, &b, r, n, skip);
        bind_dst_layout(p, &b, r, &dl);
        uint64_t units = 0;
        for (uint32_t s = 0; s < p->nslices; s++)
            units += (uint64_t)p->slices[s].nlayers * p->nsegs;
        CHECK_EQ(p->nunits, units);
        uint64_t all = plan_units_bytes(p, 0, p->nunits);
        CHECK_EQ(all, p->bytes);
        /* the destination's whole share, nothing more */
        uint32_t dnl = plan_pp_layers(&b, r / b.tp, &f);
        uint32_t dnh = plan_tp_heads(&b, r % b.tp, &f);
        CHECK_EQ(p->bytes, (uint64_t)dnl * dnh * (n - skip) * b.kv_factor *
                               b.head_dim * b.elem_size);
        /* any split point adds up */
        uint64_t cut = p->nunits ? rnd() % (p->nunits + 1) : 0;
        CHECK_EQ(plan_units_bytes(p, 0, cut) +
                     plan_units_bytes(p, cut, p->nunits),
                 p->bytes);
        /* units of slice i start where the previous slice's end */
        for (uint32_t s = 1; s < p->nslices; s++)
            CHECK_EQ(p->slices[s].unit_begin,
                     p->slices[s - 1].unit_begin +
                         (uint64_t)p->slices[s - 1].nlayers * p->nsegs);
        plan_free(p);
    }
}

/* ---- end to end: plan_exec against direct indexing ---- */

static const char *const presets[] = {"trtllm",     "vllm-nhd", "vllm-hnd",
                                      "flashinfer", "sglang",   "mla"};

/* The reference value of byte b of element (layer, kv, token, head, d). */
static uint8_t pattern(uint32_t layer, uint32_t kv, uint32_t tok, uint32_t head,
                       uint32_t d, uint32_t b)
{
    uint32_t h = layer * 0x9e3779b1u ^ kv * 0x85ebca77u ^ tok * 0xc2b2ae3du ^
                 head * 0x27d4eb2fu ^ d * 0x165667b1u;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    return (uint8_t)(h >> (8 * (b & 3))) ^ (uint8_t)(b >> 2);
}

/* A rank's pool: its regions lie in one arena [base, base + size), in a
 * shuffled order with gaps between them (a copy that leaves its region
 * lands in a gap or another region, and the byte comparison sees it). */
typedef struct rank_mem {
    uint8_t *alloc, *base;
    uint64_t size;
    kvx_layout_t layout;
    kvx_layout_part_t *parts; /* split layouts */
    plan_region_t *regions;
    uint32_t nregions;
    uint32_t *blocks;
    uint32_t nblocks;
    uint32_t l0, h0; /* global first layer and head */
} rank_mem_t;

/* Guard bands: GUARD bytes of sentinel before and after every pool, in
 * the same allocation, checked unchanged after every execution (a plan
 * that reaches outside its pool fails here, not in an engine). */
#define GUARD 4096
#define SENTINEL 0xa5

/* Split of the pools rank_mem_make() makes: -1 random, else 0 (one
 * region), 1 (per layer) or 2 (per K and V). */
static int force_split = -1;
/* 1: block tables in order (block i of a request is pool block i), as a
 * fresh engine's are; else random */
static int in_order;
/* Pools and regions at 16-byte boundaries (the GPU walk's vector path)
 * rather than anywhere. */
static int aligned;

/* Allocate the pool of rank r of side s (misaligned on purpose) between
 * guard bands, with a random block table of need blocks out of a few
 * more. */
static void rank_mem_make(rank_mem_t *m, const plan_side_t *s, uint32_t r,
                          const char *preset, uint32_t need)
{
    uint32_t t = (r / s->cp) % s->tp, p = r / (s->tp * s->cp);
    uint32_t nl = plan_pp_layers(s, p, &m->l0);
    uint32_t nh = plan_tp_heads(s, t, &m->h0);
    uint32_t nb = need + rnd_in(0, 3);
    CHECK_EQ(kvx_layout_preset(preset, nl, s->kv_factor, nh, s->head_dim,
                               (kvx_dtype_t)s->dtype, s->tokens_per_block, nb,
                               &m->layout),
             0);
    /* one region, one per layer, or one per K and V (sglang-style) */
    uint32_t split = force_split >= 0 ? (uint32_t)force_split : rnd() % 3;
    if (split == 2 && s->kv_factor < 2)
        split = 1;
    m->parts = malloc(nl * s->kv_factor * sizeof(*m->parts));
    CHECK(m->parts);
    if (split)
        CHECK_EQ(
            kvx_layout_split(&m->layout, split, m->parts, nl * s->kv_factor),
            0);
    m->nregions = kvx_layout_num_regions(&m->layout);
    m->regions = calloc(m->nregions, sizeof(*m->regions));
    uint32_t *order = malloc(m->nregions * sizeof(*order));
    uint64_t *sizes = malloc(m->nregions * sizeof(*sizes));
    CHECK(m->regions && order && sizes);
    for (uint32_t i = 0; i < m->nregions; i++) {
        order[i] = i;
        sizes[i] = kvx_layout_region_span(&m->layout, i);
    }
    for (uint32_t i = m->nregions - 1; i > 0; i--) {
        uint32_t j = rnd() % (i + 1), x = order[i];
        order[i] = order[j];
        order[j] = x;
    }
    char why[256];
    CHECK_EQ(kvx__layout_check(&m->layout, sizes, m->nregions, KVX_WHY(why)),
             0);
    /* placed in shuffled order, a gap (0..63 bytes: misaligned on
     * purpose, sometimes none) between neighbours */
    uint64_t at = 0;
    for (uint32_t i = 0; i < m->nregions; i++) {
        m->regions[order[i]].size = sizes[order[i]];
        m->regions[order[i]].base = (uint8_t *)(uintptr_t)at; /* offset */
        at += sizes[order[i]] + (i + 1 < m->nregions ? rnd() % 64 : 0);
        if (aligned)
            at = (at + 15) & ~(uint64_t)15;
    }
    m->size = at;
    uint32_t mis = aligned ? 0 : rnd() % 16;
    m->alloc = malloc(GUARD + m->size + 16 + GUARD);
    CHECK(m->alloc);
    memset(m->alloc, SENTINEL, GUARD + m->size + 16 + GUARD);
    m->base = m->alloc + GUARD + mis;
    for (uint32_t i = 0; i < m->nregions; i++)
        m->regions[i].base = m->base + (uintptr_t)m->regions[i].base;
    free(order);
    free(sizes);
    /* a random table: distinct pool blocks in random order */
    uint32_t *perm = malloc(nb * sizeof(uint32_t));
    CHECK(perm);
    for (uint32_t i = 0; i < nb; i++)
        perm[i] = i;
    for (uint32_t i = nb - 1; i > 0 && !in_order; i--) {
        uint32_t j = rnd() % (i + 1), x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    m->blocks = perm;
    m->nblocks = need;
}

/* Every byte of m's allocation outside [base, base + size) is still the
 * sentinel. */
static int guards_intact(const rank_mem_t *m)
{
    const uint8_t *end = m->alloc + GUARD + m->size + 16 + GUARD;
    for (const uint8_t *q = m->alloc; q < end; q++)
        if ((q < m->base || q >= m->base + m->size) && *q != SENTINEL) {
            fprintf(stderr, "guard byte %td from the pool's start is %#x\n",
                    q - m->base, *q);
            return 0;
        }
    return 1;
}

static void rank_mem_free(rank_mem_t *m)
{
    free(m->parts);
    free(m->regions);
    free(m->alloc);
    free(m->blocks);
}

/* Where element (local layer, kv, token, local head) of m lies. */
static uint8_t *elem(const rank_mem_t *m, uint32_t layer, uint32_t kv,
                     uint32_t tok, uint32_t head)
{
    const kvx_layout_t *l = &m->layout;
    uint32_t tpb = l->tokens_per_block;
    return m->regions[kvx_layout_region(l, layer, kv)].base +
           kvx_layout_offset(l, layer, kv, m->blocks[tok / tpb], tok % tpb,
                             head);
}

/* Write the pattern of every token < ntok of this rank's share. */
static void fill_source(rank_mem_t *m, uint32_t ntok)
{
    const kvx_layout_t *l = &m->layout;
    memset(m->base, 0x3c, m->size);
    for (uint32_t a = 0; a < l->num_layers; a++)
        for (uint32_t k = 0; k < l->kv_factor; k++)
            for (uint32_t t = 0; t < ntok; t++)
                for (uint32_t h = 0; h < l->num_heads; h++) {
                    uint8_t *e = elem(m, a, k, t, h);
                    for (uint32_t d = 0; d < l->head_dim; d++)
                        for (uint32_t b = 0; b < l->elem_size; b++)
                            e[d * l->elem_size + b] =
                                pattern(m->l0 + a, k, t, m->h0 + h, d, b);
                }
}

/* ---- the GPU kernel's walk on the CPU ---- */

/* Elements [lo, hi) of unit x, as gpu_kernel.cu's item_copy() moves them:
 * 32 lanes, batches of unroll elements a lane, a batch inside one run for
 * every lane by base and step, else by the cursor. */
static void walk_item(const gpu_unit_t *x, uint32_t lo, uint32_t hi,
                      uint32_t unroll)
{
    const uint32_t n = hi - lo, steps = (n + 31) / 32;
    const uint32_t es = 1u << x->eshift, step = 32 * es;
    gpu_cur_t c[32];
    uint32_t mine[32];
    uint8_t *src = (uint8_t *)(uintptr_t)x->src;
    uint8_t *dst = (uint8_t *)(uintptr_t)x->dst;
    if (!steps)
        return;
    CHECK(hi <= x->nelem);
    for (uint32_t lane = 0; lane < 32; lane++) {
        mine[lane] = n > lane ? (n - lane + 31) / 32 : 0;
        gpu_cur_init(x, lo + lane, &c[lane]);
    }
    for (uint32_t s0 = 0;; s0 += unroll) {
        int last = s0 + unroll >= steps, fast = 1;
        for (uint32_t lane = 0; lane < 32; lane++)
            fast &= c[lane].col + 32 * (unroll - 1) < x->er;
        for (uint32_t lane = 0; lane < 32; lane++) {
            gpu_cur_t *k = &c[lane];
            if (fast) {
                for (uint32_t i = 0; i < unroll; i++)
                    if (s0 + i < mine[lane])
                        memcpy(dst + k->dof + i * step, src + k->so + i * step,
                               es);
                k->col += 32 * (unroll - 1);
                k->so += (unroll - 1) * step;
                k->dof += (unroll - 1) * step;
                gpu_cur_step(x, k);
                continue;
            }
            for (uint32_t i = 0; i < unroll; i++)
                if (s0 + i < mine[lane]) {
                    memcpy(dst + k->dof, src + k->so, es);
                    gpu_cur_step(x, k);
                }
        }
        if (last)
            return;
    }
}

/* plan_runs_packed()'s runs copied in order to (gather) or from a
 * packed buffer: what UCX does with an iov of them. */
struct run_cursor {
    uint8_t *buf;
    uint64_t off;
    int gather;
};

static int run_copy(void *arg, uint8_t *a, uint64_t len, uint32_t region)
{
    (void)region;
    struct run_cursor *c = arg;
    CHECK(len > 0);
    if (c->gather)
        memcpy(c->buf + c->off, a, len);
    else
        memcpy(a, c->buf + c->off, len);
    c->off += len;
    return 0;
}

/* Bound plan p's GPU descriptor laid out in host memory (at its own
 * address), as gpu.c lays it out for the device: *g, and the buffer to
 * free(). */
static uint8_t *desc_on_host(const plan_t *p, gpu_plan_t *g)
{
    size_t cap = gpu_desc_size(p), len = 0;
    uint8_t *buf = malloc(cap);
    size_t *off = calloc(p->nslices ? p->nslices : 1, sizeof(size_t));
    CHECK(buf && off);
    char why[256];
    CHECK_EQ(gpu_desc_pack(p, &(gpu_desc_buf_t){buf, cap, (uintptr_t)buf}, g,
                           off, &len, KVX_WHY(why)),
             0);
    CHECK(len <= cap);
    free(off);
    return buf;
}

/* Units [u0, u1) of bound plan p as the kernel copies them with warps
 * warps: its descriptor (host pointers), the host's cut, each warp's
 * first piece its own and the rest from a counter, the warps' items in
 * a random interleaving. packed/mode as plan_exec_packed() (mode
 * GPU_PACKED_NONE: pool to pool). */
static void gpu_walk_exec(const plan_t *p, uint64_t u0, uint64_t u1,
                          uint8_t *packed, int mode, uint32_t warps,
                          uint32_t unroll)
{
    if (u0 >= u1)
        return;
    gpu_plan_t g;
    uint8_t *buf = desc_on_host(p, &g);
    gpu_launch_t l = {
        .u0 = u0, .u1 = u1, .packed = packed, .packed_mode = mode};
    gpu_launch_cut(&l, plan_units_bytes(p, u0, u1), warps);
    CHECK(l.npieces >= 1);
    CHECK(l.per == 1 || l.pshift == 0);
    uint32_t hint0 = gpu_slice_find(&g, u0);
    CHECK(g.slices[hint0].unit_begin <= u0);
    CHECK(hint0 + 1 == g.nslices || g.slices[hint0 + 1].unit_begin > u0);
    uint64_t poff0 =
        mode != GPU_PACKED_NONE ? gpu_packed_off(&g, &g.slices[hint0], u0) : 0;
    uint64_t *t = malloc(warps * sizeof(uint64_t)), ticket = 0;
    uint32_t *j = calloc(warps, sizeof(uint32_t));
    uint32_t *hint = malloc(warps * sizeof(uint32_t)), live = 0;
    CHECK(t && j && hint);
    for (uint32_t w = 0; w < warps; w++) {
        t[w] = w;
        hint[w] = hint0;
        live += w < l.npieces;
    }
    while (live) {
        uint32_t w = rnd() % warps;
        if (t[w] >= l.npieces)
            continue;
        gpu_item_t it;
        gpu_item_get(&g, &l, &hint[w], poff0, t[w], j[w], &it);
        walk_item(&it.x, it.lo, it.hi, unroll);
        if (j[w] + 1 < gpu_piece_units(&l, t[w])) {
            j[w]++;
        } else {
            t[w] = warps + ticket++;
            j[w] = 0;
            live -= t[w] >= l.npieces;
        }
    }
    free(t);
    free(j);
    free(hint);
    free(buf);
}

/* A run of the copy engines' path, done here by memcpy; the runs must
 * not overlap a run already copied (counted in bytes). */
static uint64_t runs_emitted; /* by gpu_desc_runs(), since reset */
/* gpu_runs_exec() also asks gpu_desc_runs_long(probe_min) of each range
 * when probe_min is set: ranges asked, ranges found long */
static uint64_t probe_min, probe_n, probe_long;

static int run_memcpy(void *arg, uint64_t dst, uint64_t src, uint64_t len)
{
    uint64_t *bytes = arg;
    CHECK(len > 0);
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, len);
    *bytes += len;
    runs_emitted++;
    return 0;
}

/* Units [u0, u1) of bound plan p as the copy engines' path copies them:
 * gpu_desc_runs() over the host-laid descriptor. */
static void gpu_runs_exec(const plan_t *p, uint64_t u0, uint64_t u1,
                          uint8_t *packed, int mode)
{
    if (u0 >= u1)
        return;
    gpu_plan_t g;
    uint8_t *buf = desc_on_host(p, &g);
    gpu_launch_t l = {
        .u0 = u0, .u1 = u1, .packed = packed, .packed_mode = mode};
    uint64_t bytes = 0;
    CHECK_EQ(gpu_desc_runs(&g, &l, run_memcpy, &bytes), 0);
    CHECK_EQ(bytes, plan_units_bytes(p, u0, u1));
    if (probe_min) {
        probe_n++;
        probe_long += (uint64_t)gpu_desc_runs_long(&g, &l, bytes, probe_min);
    }
    CHECK(gpu_desc_unit_run(&g, &l) > 0);
    free(buf);
}

typedef struct e2e {
    plan_side_t s, d;
    const char *sp, *dp;
    uint32_t ntok, skip;
} e2e_t;

static int preset_fits(const char *p, const plan_side_t *s)
{
    uint32_t f;
    if (!strcmp(p, "sglang"))
        return s->tokens_per_block == 1;
    if (!strcmp(p, "mla"))
        return s->kv_factor == 1 && plan_tp_heads(s, 0, &f) == 1;
    return 1;
}

static void random_side(plan_side_t *s, uint32_t heads, uint32_t layers,
                        const char *preset)
{
    uint32_t tps[8], n = 0;
    for (uint32_t t = 1; t <= 8; t++)
        if (heads % t == 0 || t % heads == 0)
            tps[n++] = t;
    s->tp = tps[rnd() % n];
    s->pp = rnd_in(1, layers < 4 ? layers : 4);
    s->cp = 1;
    s->total_layers = layers;
    s->total_heads = heads;
    s->num_layers_per_pp = 0;
    if (s->pp > 1 && rnd() % 2) {
        /* a random composition of layers into pp positive parts */
        uint32_t left = layers;
        for (uint32_t i = 0; i < s->pp; i++) {
            uint32_t rest = s->pp - i - 1;
            uint32_t v = rest ? rnd_in(1, left - rest) : left;
            s->layers_per_pp[i] = v;
            left -= v;
        }
        s->num_layers_per_pp = s->pp;
    }
    s->tokens_per_block = !strcmp(preset, "sglang") ? 1
                          : rnd() % 4 == 0          ? rnd_in(1, 3)
                                                    : rnd_in(1, 64);
}

/* One random config for this preset pair. */
static void e2e_pick(e2e_t *c, const char *sp, const char *dp)
{
    int mla = !strcmp(sp, "mla") || !strcmp(dp, "mla");
    for (int tries = 0; tries < 100000; tries++) {
        uint32_t heads = mla ? rnd_in(1, 4) : rnd_in(1, 16);
        uint32_t layers = rnd_in(1, 8);
        memset(&c->s, 0, sizeof(c->s));
        memset(&c->d, 0, sizeof(c->d));
        random_side(&c->s, heads, layers, sp);
        random_side(&c->d, heads, layers, dp);
        uint32_t kv = mla ? 1 : rnd_in(1, 2);
        uint32_t dt = rnd_in(KVX_DTYPE_FP32, KVX_DTYPE_INT8);
        /* a wide head now and then, so runs reach the streaming path */
        uint32_t hd = rnd() % 5 == 0 ? 64 * rnd_in(1, 2) : rnd_in(1, 6);
        plan_side_t *both[2] = {&c->s, &c->d};
        for (int i = 0; i < 2; i++) {
            both[i]->kv_factor = kv;
            both[i]->head_dim = hd;
            both[i]->dtype = dt;
            both[i]->elem_size = kvx_dtype_size((kvx_dtype_t)dt);
        }
        if (!preset_fits(sp, &c->s) || !preset_fits(dp, &c->d))
            continue;
        char why[256];
        CHECK_EQ(plan_side_check(&c->s, KVX_WHY(why)), 0);
        CHECK_EQ(plan_side_check(&c->d, KVX_WHY(why)), 0);
        c->sp = sp;
        c->dp = dp;
        c->ntok = hd >= 64 ? rnd_in(1, 40) : rnd_in(1, 130);
        c->skip = rnd() % 3 == 0 ? rnd() % c->ntok : 0;
        return;
    }
    CHECK(!"no config fits the preset pair");
}

static void e2e_run(const e2e_t *c)
{
    uint32_t ns = plan_side_ranks(&c->s), nd = plan_side_ranks(&c->d);
    uint32_t sneed =
        (c->ntok + c->s.tokens_per_block - 1) / c->s.tokens_per_block;
    uint32_t dneed =
        (c->ntok + c->d.tokens_per_block - 1) / c->d.tokens_per_block;
    rank_mem_t *src = calloc(ns, sizeof(*src));
    uint8_t **snap = calloc(ns, sizeof(*snap));
    CHECK(src && snap);
    for (uint32_t r = 0; r < ns; r++) {
        rank_mem_make(&src[r], &c->s, r, c->sp, sneed);
        fill_source(&src[r], c->ntok);
        snap[r] = malloc(src[r].size);
        CHECK(snap[r]);
        memcpy(snap[r], src[r].base, src[r].size);
    }
    for (uint32_t r = 0; r < nd; r++) {
        rank_mem_t dst;
        rank_mem_make(&dst, &c->d, r, c->dp, dneed);
        const kvx_layout_t *dl = &dst.layout;
        memset(dst.base, 0xee, dst.size);
        /* the expected pool, by direct indexing */
        uint8_t *want = malloc(dst.size);
        CHECK(want);
        memset(want, 0xee, dst.size);
        for (uint32_t a = 0; a < dl->num_layers; a++)
            for (uint32_t k = 0; k < dl->kv_factor; k++)
                for (uint32_t t = c->skip; t < c->ntok; t++)
                    for (uint32_t h = 0; h < dl->num_heads; h++) {
                        uint64_t o =
                            (uint64_t)(elem(&dst, a, k, t, h) - dst.base);
                        for (uint32_t x = 0; x < dl->head_dim; x++)
                            for (uint32_t b = 0; b < dl->elem_size; b++)
                                want[o + x * dl->elem_size + b] =
                                    pattern(dst.l0 + a, k, t, dst.h0 + h, x, b);
                    }

        plan_t *p = build(&c->s, &c->d, r, c->ntok, c->skip);
        CHECK(p->src_blocks_needed <= sneed);
        CHECK(p->dst_blocks_needed <= dneed);
        for (uint32_t i = 0; i < p->nslices; i++) {
            const plan_slice_t *s = &p->slices[i];
            CHECK(s->src_rank < ns);
            const rank_mem_t *m = &src[s->src_rank];
            CHECK_EQ(s->src_layer_base, m->l0);
            CHECK_EQ(s->src_head_base, m->h0);
            p->src[i] =
                (plan_mem_t){m->regions, m->nregions, &m->layout, m->blocks,
                             m->nblocks, s->src_rank, 1};
        }
        p->dst = (plan_mem_t){dst.regions,
                              dst.nregions,
                              &dst.layout,
                              dst.blocks,
                              dst.nblocks,
                              100 + r,
                              1};
        char bwhy[256];
        if (plan_check_bounds(p, KVX_WHY(bwhy))) {
            fprintf(stderr, "%s\n", bwhy);
            CHECK(!"a plan of valid pools fails its bounds check");
        }
        CHECK_EQ(plan_units_bytes(p, 0, p->nunits), p->bytes);
        /* execute in random unit ranges, in random order */
        uint64_t cuts[9];
        int nc = 0;
        cuts[nc++] = 0;
        for (int i = 0; i < 7 && p->nunits > 1; i++)
            cuts[nc++] = rnd() % p->nunits;
        cuts[nc++] = p->nunits;
        for (int i = 1; i < nc; i++) /* sort */
            for (int j = i; j > 0 && cuts[j] < cuts[j - 1]; j--) {
                uint64_t x = cuts[j];
                cuts[j] = cuts[j - 1];
                cuts[j - 1] = x;
            }
        int start = nc > 2 ? (int)(rnd() % (uint32_t)(nc - 1)) : 0;
        for (int i = 0; i < nc - 1; i++) {
            int k = (start + i) % (nc - 1);
            plan_exec(p, cuts[k], cuts[k + 1]);
        }
        if (memcmp(dst.base, want, dst.size)) {
            uint64_t o = 0;
            while (dst.base[o] == want[o])
                o++;
            fprintf(stderr,
                    "%s tp%u pp%u tpb%u -> %s tp%u pp%u tpb%u rank %u: "
                    "heads %u layers %u K%u D%u E%u tokens %u skip %u: "
                    "byte %llu of %llu is %#x, want %#x\n",
                    c->sp, c->s.tp, c->s.pp, c->s.tokens_per_block, c->dp,
                    c->d.tp, c->d.pp, c->d.tokens_per_block, r,
                    c->s.total_heads, c->s.total_layers, c->s.kv_factor,
                    c->s.head_dim, c->s.elem_size, c->ntok, c->skip,
                    (unsigned long long)o, (unsigned long long)dst.size,
                    dst.base[o], want[o]);
            CHECK(!"destination differs from direct indexing");
        }
        CHECK(guards_intact(&dst));
        /* the packed path between daemons: each range gathered into a
         * buffer as the context daemon does, scattered from it as the
         * generation daemon does, lands the same bytes */
        memset(dst.base, 0xee, dst.size);
        uint8_t *buf = malloc(p->bytes ? p->bytes : 1);
        CHECK(buf);
        for (int i = 0; i < nc - 1; i++) {
            int k = (start + i) % (nc - 1);
            uint64_t len = plan_units_bytes(p, cuts[k], cuts[k + 1]);
            memset(buf, 0x5a, len);
            plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 1);
            plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 0);
        }
        CHECK(!memcmp(dst.base, want, dst.size));
        CHECK(guards_intact(&dst));
        /* the same packed bytes as runs of pool memory (peer.direct: UCX
         * unpacks a piece into the destination's runs): gathered by
         * copies, scattered into the runs; then gathered from the
         * source's runs and scattered by copies */
        for (int way = 0; way < 2; way++) {
            memset(dst.base, 0xee, dst.size);
            for (int i = 0; i < nc - 1; i++) {
                int k = (start + i) % (nc - 1);
                uint64_t len = plan_units_bytes(p, cuts[k], cuts[k + 1]);
                memset(buf, 0x5a, len);
                struct run_cursor rc = {buf, 0, way ? 1 : 0};
                if (way)
                    CHECK(!plan_runs_packed(p, cuts[k], cuts[k + 1], 1,
                                            run_copy, &rc));
                else
                    plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 1);
                if (way) {
                    CHECK_EQ(rc.off, len);
                    plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 0);
                } else {
                    CHECK(!plan_runs_packed(p, cuts[k], cuts[k + 1], 0,
                                            run_copy, &rc));
                    CHECK_EQ(rc.off, len);
                }
            }
            CHECK(!memcmp(dst.base, want, dst.size));
            CHECK(guards_intact(&dst));
        }
        /* the GPU kernel's walk, with few warps and many (pieces cut
         * finer), short and long batches; and its packed layout is the
         * host's: gathered by one, scattered by the other */
        static const uint32_t nwarps[] = {1, 3, 16, 1024};
        memset(dst.base, 0xee, dst.size);
        for (int i = 0; i < nc - 1; i++) {
            int k = (start + i) % (nc - 1);
            gpu_walk_exec(p, cuts[k], cuts[k + 1], NULL, GPU_PACKED_NONE,
                          nwarps[rnd() % 4], rnd() % 2 ? 8 : 16);
        }
        if (memcmp(dst.base, want, dst.size)) {
            uint64_t o = 0;
            while (dst.base[o] == want[o])
                o++;
            fprintf(stderr,
                    "GPU walk: %s -> %s rank %u: heads %u layers %u K%u D%u "
                    "E%u tokens %u skip %u aligned %d: byte %llu of %llu "
                    "is %#x, want %#x\n",
                    c->sp, c->dp, r, c->s.total_heads, c->s.total_layers,
                    c->s.kv_factor, c->s.head_dim, c->s.elem_size, c->ntok,
                    c->skip, aligned, (unsigned long long)o,
                    (unsigned long long)dst.size, dst.base[o], want[o]);
            CHECK(!"GPU walk: destination differs from direct indexing");
        }
        CHECK(guards_intact(&dst));
        /* the copy engines' runs: pool to pool, and gathered or
         * scattered by them against the host's packed layout */
        memset(dst.base, 0xee, dst.size);
        for (int i = 0; i < nc - 1; i++) {
            int k = (start + i) % (nc - 1);
            gpu_runs_exec(p, cuts[k], cuts[k + 1], NULL, GPU_PACKED_NONE);
        }
        CHECK(!memcmp(dst.base, want, dst.size));
        CHECK(guards_intact(&dst));
        memset(dst.base, 0xee, dst.size);
        for (int i = 0; i < nc - 1; i++) {
            int k = (start + i) % (nc - 1);
            uint64_t len = plan_units_bytes(p, cuts[k], cuts[k + 1]);
            memset(buf, 0x5a, len);
            if (rnd() % 2) {
                gpu_runs_exec(p, cuts[k], cuts[k + 1], buf, GPU_PACKED_GATHER);
                plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 0);
            } else {
                plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 1);
                gpu_runs_exec(p, cuts[k], cuts[k + 1], buf, GPU_PACKED_SCATTER);
            }
        }
        CHECK(!memcmp(dst.base, want, dst.size));
        CHECK(guards_intact(&dst));
        memset(dst.base, 0xee, dst.size);
        for (int i = 0; i < nc - 1; i++) {
            int k = (start + i) % (nc - 1);
            uint64_t len = plan_units_bytes(p, cuts[k], cuts[k + 1]);
            int walk_gathers = rnd() % 2;
            memset(buf, 0x5a, len);
            if (walk_gathers)
                gpu_walk_exec(p, cuts[k], cuts[k + 1], buf, GPU_PACKED_GATHER,
                              nwarps[rnd() % 4], 8);
            else
                plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 1);
            if (walk_gathers && rnd() % 2)
                plan_exec_packed(p, cuts[k], cuts[k + 1], buf, 0);
            else
                gpu_walk_exec(p, cuts[k], cuts[k + 1], buf, GPU_PACKED_SCATTER,
                              nwarps[rnd() % 4], 8);
        }
        free(buf);
        CHECK(!memcmp(dst.base, want, dst.size));
        CHECK(guards_intact(&dst));
        plan_free(p);
        free(want);
        rank_mem_free(&dst);
    }
    for (uint32_t r = 0; r < ns; r++) {
        /* the source pools are only read */
        CHECK(!memcmp(snap[r], src[r].base, src[r].size));
        CHECK(guards_intact(&src[r]));
        free(snap[r]);
        rank_mem_free(&src[r]);
    }
    free(snap);
    free(src);
}

TEST_T(end_to_end_every_preset_pair, 300)
{
    uint32_t runs = 0;
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 6; j++)
            for (int k = 0; k < 40; k++) {
                e2e_t c;
                e2e_pick(&c, presets[i], presets[j]);
                aligned = k % 2;
                e2e_run(&c);
                runs++;
            }
    CHECK_EQ(runs, 6 * 6 * 40);
}

/* The benchmark's shape (16 tokens x 8 heads x 128 bf16: 32 KiB runs,
 * 64 KiB units cut in parts), small: matching layouts take the GPU
 * walk's long-run path, a conversion its short-run path. */
TEST_T(end_to_end_bench_shape, 120)
{
    static const char *const pairs[][2] = {{"vllm-nhd", "vllm-nhd"},
                                           {"trtllm", "trtllm"},
                                           {"trtllm", "vllm-nhd"},
                                           {"vllm-hnd", "flashinfer"}};
    for (int i = 0; i < 4; i++)
        for (int a = 0; a < 2; a++) {
            e2e_t c;
            c.s = side(1, 1, 4, 8, 16);
            c.d = side(a ? 2 : 1, 1, 4, 8, 16);
            c.s.head_dim = c.d.head_dim = 128;
            c.s.dtype = c.d.dtype = KVX_DTYPE_BF16;
            c.sp = pairs[i][0];
            c.dp = pairs[i][1];
            c.ntok = 16 * 12 - 3 * a;
            c.skip = 5 * a;
            aligned = 1;
            e2e_run(&c);
        }
    aligned = 0;
}

/* The copy engines' path joins a request's blocks when both tables have
 * them in order: vLLM's layout keeps a layer's K of every block together,
 * so each layer's K and V become one copy each per launch, not one per
 * block (the bench's shape, 12 blocks of 32 KiB runs, 4 layers; bytes
 * checked by e2e_run). */
TEST(copy_engine_runs_join_blocks_in_order)
{
    e2e_t c;
    c.s = c.d = side(1, 1, 4, 8, 16);
    c.s.head_dim = c.d.head_dim = 128;
    c.s.dtype = c.d.dtype = KVX_DTYPE_BF16;
    c.sp = c.dp = "vllm-nhd";
    c.ntok = 16 * 12;
    c.skip = 0;
    aligned = 1;
    in_order = 1;
    force_split = 0;
    runs_emitted = 0;
    e2e_run(&c);
    /* gpu_runs_exec() runs over 8 pieces (cut at random) 3 times, pool
     * to pool and through a packed buffer: 288 copies, one a block */
    CHECK(runs_emitted > 0);
    CHECK(runs_emitted <= 140); /* 118 here; 192 when runs join only the
                                   one before them */
    /* auto's choice: joined runs of 64 KiB (2 blocks) or more on average
     * in the ranges in order that are not cut too short (random cuts),
     * in none scattered */
    probe_min = 64 << 10;
    probe_n = probe_long = 0;
    e2e_run(&c);
    CHECK(probe_n > 0 && probe_long * 4 >= probe_n); /* 7 of 16 */
    in_order = 0;
    probe_n = probe_long = 0;
    e2e_run(&c);
    CHECK(probe_n > 0);
    CHECK_EQ(probe_long, 0);
    probe_min = 0;
    in_order = 0;
    force_split = -1;
    aligned = 0;
}

/* gpu_desc_runs_upto(): gpu.copy_path auto's choice and its copies in
 * one walk. With room for every run it emits what gpu_desc_runs() emits
 * and returns 0; one short, it emits max runs and says GPU_RUNS_MANY; an
 * emit's error comes back as it is. */
static uint64_t upto_bytes, upto_fail_at;
static int upto_emit(void *arg, uint64_t dst, uint64_t src, uint64_t len)
{
    (void)dst;
    (void)src;
    uint64_t *n = arg;
    upto_bytes += len;
    return ++*n == upto_fail_at ? 5 : 0;
}

/* A batch of auto_cap runs, issued (counted in auto_flushes) when full
 * and another run comes, as gpu.c's dma_run(). */
static uint64_t auto_cap, auto_n, auto_flushes;
static int auto_emit(void *arg, uint64_t dst, uint64_t src, uint64_t len)
{
    (void)arg;
    (void)dst;
    (void)src;
    if (auto_n == auto_cap) {
        auto_flushes++;
        auto_n = 0;
    }
    auto_n++;
    upto_bytes += len;
    return 0;
}

TEST(copy_engine_runs_upto_one_walk)
{
    for (int ord = 1; ord >= 0; ord--) {
        plan_side_t a = side(1, 1, 4, 8, 16);
        a.head_dim = 128;
        a.dtype = KVX_DTYPE_BF16;
        in_order = ord;
        aligned = 1;
        force_split = 0;
        rank_mem_t sm, dm;
        rank_mem_make(&sm, &a, 0, "vllm-nhd", 24);
        rank_mem_make(&dm, &a, 0, "vllm-nhd", 24);
        plan_t *p = build(&a, &a, 0, 24 * 16, 0);
        p->src[0] = (plan_mem_t){sm.regions, sm.nregions, &sm.layout, sm.blocks,
                                 sm.nblocks, 0,           1};
        p->dst = (plan_mem_t){dm.regions, dm.nregions, &dm.layout, dm.blocks,
                              dm.nblocks, 100,         1};
        gpu_plan_t g;
        uint8_t *buf = desc_on_host(p, &g);
        gpu_launch_t l = {.u0 = 0, .u1 = p->nunits};
        uint64_t all = 0;
        upto_fail_at = 0;
        upto_bytes = 0;
        CHECK_EQ(gpu_desc_runs(&g, &l, upto_emit, &all), 0);
        CHECK_EQ(upto_bytes, p->bytes);
        CHECK(all > 1);
        CHECK(ord ? all < 24 * 8 : all >= 24 * 8); /* joined in order */
        uint64_t n = 0;
        upto_bytes = 0;
        CHECK_EQ(gpu_desc_runs_upto(&g, &l, all, upto_emit, &n), 0);
        CHECK_EQ(n, all);
        CHECK_EQ(upto_bytes, p->bytes);
        n = 0;
        CHECK_EQ(gpu_desc_runs_upto(&g, &l, all - 1, upto_emit, &n),
                 GPU_RUNS_MANY);
        CHECK_EQ(n, all - 1);
        CHECK_EQ(gpu_desc_runs_upto(&g, &l, all - 1, NULL, NULL),
                 GPU_RUNS_MANY);
        CHECK_EQ(gpu_desc_runs_upto(&g, &l, all, NULL, NULL), 0);
        n = 0;
        upto_fail_at = 2;
        CHECK_EQ(gpu_desc_runs_upto(&g, &l, all, upto_emit, &n), 5);
        CHECK_EQ(n, 2);
        /* gpu_desc_runs_auto() chooses as gpu_desc_runs_long(), whatever
         * the batch holds; a choice of the kernel never comes after runs
         * were issued (a flush: the same units would be copied twice) */
        for (uint64_t k = 1; k <= 2 * all + 2; k++) {
            const uint64_t min_run = p->bytes / k;
            const uint64_t caps[] = {1, all / 2 + 1, all - 1, all, 4096};
            for (size_t ci = 0; ci < sizeof(caps) / sizeof(caps[0]); ci++) {
                auto_cap = caps[ci];
                auto_n = auto_flushes = 0;
                upto_bytes = 0;
                int e = gpu_desc_runs_auto(&g, &l, p->bytes, min_run, auto_cap,
                                           auto_emit, NULL);
                CHECK(e == 0 || e == GPU_RUNS_MANY);
                CHECK_EQ(e == 0, gpu_desc_runs_long(&g, &l, p->bytes, min_run));
                if (e == 0)
                    CHECK_EQ(upto_bytes, p->bytes);
                else
                    CHECK_EQ(auto_flushes, 0);
            }
        }
        /* auto's choice stays gpu_desc_runs_long()'s */
        CHECK_EQ(gpu_desc_runs_long(&g, &l, p->bytes, p->bytes / all), 1);
        CHECK_EQ(gpu_desc_runs_long(&g, &l, p->bytes, p->bytes / all + 1), 0);
        free(buf);
        plan_free(p);
        rank_mem_free(&sm);
        rank_mem_free(&dm);
    }
    in_order = 0;
    force_split = -1;
    aligned = 0;
}

/* gpu_fdiv() is exact for every n < 2^32; the launch cut covers the
 * units with pieces near GPU_PIECE_BYTES, finer for small launches. */
TEST(gpu_fdiv_and_cut)
{
    static const uint32_t ds[] = {
        1,    2,     3,     5,           7,           16,          31,
        1000, 65535, 65536, 0x7fffffffu, 0x80000001u, 0xfffffffeu, 0xffffffffu};
    for (size_t i = 0; i < sizeof(ds) / sizeof(ds[0]) + 2000; i++) {
        uint32_t d = i < sizeof(ds) / sizeof(ds[0]) ? ds[i] : 1 + rnd() % 5000;
        gpu_fdiv_t f = gpu_fdiv_make(d);
        for (int k = 0; k < 3000; k++) {
            uint32_t n = k < 8    ? (uint32_t)k
                         : k < 16 ? 0xffffffffu - (uint32_t)(k - 8)
                         : k < 24 ? d * (uint32_t)(k - 16) - 1
                         : k < 32 ? d * (uint32_t)(k - 24)
                                  : rnd() ^ (rnd() << 16);
            if (gpu_fdiv(n, f) != n / d) {
                fprintf(stderr, "%u / %u: %u\n", n, d, gpu_fdiv(n, f));
                CHECK(!"gpu_fdiv wrong");
            }
        }
    }
    /* the bench's launch: 4096 units of 64 KiB over 64 CTAs of 16 warps */
    gpu_launch_t l = {.u0 = 10, .u1 = 10 + 4096};
    gpu_launch_cut(&l, 4096ull << 16, 1024);
    CHECK_EQ(l.part_bytes, GPU_PIECE_BYTES);
    CHECK_EQ(l.npieces, 4096ull << 16 >> __builtin_ctz(GPU_PIECE_BYTES));
    /* one such unit: cut finer for the warps, not below GPU_PIECE_MIN */
    l = (gpu_launch_t){.u0 = 0, .u1 = 1};
    gpu_launch_cut(&l, 1 << 16, 1024);
    CHECK_EQ(l.part_bytes, GPU_PIECE_MIN);
    CHECK_EQ(l.npieces, 32);
    /* small units grouped, but spread over the warps first */
    l = (gpu_launch_t){.u0 = 0, .u1 = 100000};
    gpu_launch_cut(&l, 100000ull * 512, 1024);
    CHECK_EQ(l.per, GPU_PIECE_BYTES / 512);
    CHECK_EQ(l.npieces, (100000 + l.per - 1) / l.per);
    l = (gpu_launch_t){.u0 = 0, .u1 = 2000};
    gpu_launch_cut(&l, 2000ull * 512, 1024);
    CHECK_EQ(l.per, 1);
    CHECK_EQ(l.npieces, 2000);
    /* odd sizes: parts of a multiple of GPU_PART_ALIGN that cover it */
    for (int k = 0; k < 1000; k++) {
        uint64_t n = 1 + rnd() % 5000, unit = 1 + rnd() % (1u << 22);
        l = (gpu_launch_t){.u0 = 7, .u1 = 7 + n};
        gpu_launch_cut(&l, n * unit, 1 + rnd() % 4096);
        if (l.per > 1) {
            CHECK(unit * l.per <= GPU_PIECE_BYTES);
            CHECK_EQ(l.pshift, 0);
        } else if (l.pshift) {
            CHECK_EQ(l.part_bytes % GPU_PART_ALIGN, 0);
            CHECK(l.part_bytes << l.pshift >= unit);
            CHECK(l.part_bytes >= GPU_PIECE_MIN);
            CHECK(l.part_bytes <= 2 * GPU_PIECE_BYTES);
        }
        CHECK_EQ(l.npieces,
                 l.per > 1 ? (n + l.per - 1) / l.per : n << l.pshift);
    }
}

TEST_T(end_to_end_fixed_cases, 120)
{
    /* the shapes named in the design: TP 4->2, 2->4, 8 ranks with 2
     * heads, PP 2->1 and 1->3 uneven, 16->4 and 5->7 tokens per block,
     * skip mid-block */
    static const struct {
        uint32_t stp, spp, dtp, dpp, heads, layers, ts, td, n, skip;
        uint32_t dlpp[3];
    } cases[] = {
        {4, 1, 2, 1, 8, 4, 16, 16, 40, 0, {0}},
        {2, 1, 4, 1, 8, 4, 16, 16, 40, 0, {0}},
        {8, 1, 8, 1, 2, 4, 16, 16, 40, 0, {0}},
        {8, 1, 2, 1, 2, 4, 16, 4, 40, 0, {0}},
        {1, 1, 8, 1, 2, 4, 4, 16, 40, 0, {0}},
        {2, 2, 2, 1, 4, 10, 16, 16, 40, 0, {0}},
        {1, 1, 1, 3, 4, 10, 16, 16, 40, 0, {2, 5, 3}},
        {2, 1, 2, 1, 4, 3, 16, 4, 50, 0, {0}},
        {2, 1, 2, 1, 4, 3, 5, 7, 71, 0, {0}},
        {2, 1, 2, 1, 4, 3, 16, 4, 50, 13, {0}},
        {2, 1, 2, 1, 4, 3, 5, 7, 71, 33, {0}},
        {4, 2, 1, 3, 4, 9, 5, 7, 71, 69, {4, 4, 1}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        for (int p = 0; p < 4; p++)
            for (int q = 0; q < 4; q++) {
                e2e_t c;
                c.s = side(cases[i].stp, cases[i].spp, cases[i].layers,
                           cases[i].heads, cases[i].ts);
                c.d = side(cases[i].dtp, cases[i].dpp, cases[i].layers,
                           cases[i].heads, cases[i].td);
                if (cases[i].dlpp[0])
                    set_lpp(&c.d, cases[i].dlpp, cases[i].dpp);
                c.sp = presets[p];
                c.dp = presets[q];
                c.ntok = cases[i].n;
                c.skip = cases[i].skip;
                aligned = (p + q) % 2;
                e2e_run(&c);
            }
    aligned = 0;
}

/* plan_check_bounds() refuses, naming the pool, every way a bound side
 * could reach outside its pool: a pool smaller than its layout claims, a
 * block past the layout's blocks, a table entry past the table. */
TEST(bounds_check_refuses_outside_the_pool)
{
    plan_side_t a = side(1, 1, 2, 4, 16), b = side(1, 1, 2, 4, 16);
    plan_t *p = build(&a, &b, 0, 48, 0); /* whole blocks */
    rank_mem_t s, d;
    force_split = 2; /* the source in a K and a V region per layer */
    rank_mem_make(&s, &a, 0, "vllm-nhd", 3);
    force_split = 0;
    rank_mem_make(&d, &b, 0, "trtllm", 3);
    force_split = -1;
    p->src[0] = (plan_mem_t){s.regions, s.nregions, &s.layout, s.blocks,
                             s.nblocks, 7,          1};
    p->dst = (plan_mem_t){d.regions, d.nregions, &d.layout, d.blocks,
                          d.nblocks, 9,          1};
    char why[256];
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), 0);

    /* a pool one byte short of its last block */
    uint32_t last = 0;
    for (uint32_t i = 0; i < d.nblocks; i++)
        if (d.blocks[i] > last)
            last = d.blocks[i];
    d.regions[0].size = (uint64_t)(last + 1) * d.layout.block_stride - 1;
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "pool 9: the plan writes layer 1 kv 1 up to byte");
    CHECK_STR_CONTAINS(why, "of region 0, past its");
    d.regions[0].size = kvx_layout_span(&d.layout);

    /* a source region (layer 1's V) one byte short */
    s.regions[3].size--;
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "pool 7: the plan reads layer 1 kv 1 up to byte");
    CHECK_STR_CONTAINS(why, "of region 3, past its");
    s.regions[3].size++;
    /* a part naming a region the bound side does not have */
    p->src[0].nregions = 3;
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "pool 7: the plan reads layer 1 kv 1, in region 3 "
                            "of 3");
    p->src[0].nregions = 4;
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), 0);

    /* a block id past the layout's blocks */
    uint32_t keep = s.blocks[1];
    s.blocks[1] = s.layout.num_blocks;
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "pool 7: the plan reads tokens");
    s.blocks[1] = keep;

    /* a table shorter than the plan's segments */
    p->src[0].num_blocks = 1;
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "pool 7: the plan reads block table entry 1 of 1");
    p->src[0].num_blocks = s.nblocks;

    /* an unbound side (packed, between daemons) is not checked */
    p->dst = (plan_mem_t){.layout = &d.layout};
    CHECK_EQ(plan_check_bounds(p, KVX_WHY(why)), 0);
    plan_free(p);
    rank_mem_free(&s);
    rank_mem_free(&d);
}
