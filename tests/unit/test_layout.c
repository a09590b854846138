/*
 * test_layout — presets against hand-written index formulas, span, the
 * pool check (size, ranges, strides, overlap, overflow), dtypes, and a
 * brute-force property: a layout the check accepts never aliases two
 * elements and never leaves the pool.
 */
#include "../../common/layout.c"

#include "tests/test.h"

#include <stdint.h>

/* ---- helpers ---- */

static uint64_t rng_state = 0x243f6a8885a308d3ull;

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

static const char *const presets[] = {"trtllm",     "vllm-nhd", "vllm-hnd",
                                      "flashinfer", "sglang",   "mla"};
#define NPRESETS 6

typedef struct shape {
    uint32_t L, K, H, D, T, B;
    kvx_dtype_t dt;
} shape_t;

/* Make a shape legal for the preset's own constraints. */
static void shape_fit(const char *preset, shape_t *s)
{
    if (!strcmp(preset, "sglang"))
        s->T = 1;
    if (!strcmp(preset, "mla")) {
        s->K = 1;
        s->H = 1;
    }
}

/*
 * The element index in the memory order the preset documents, outermost
 * first, written out per preset from docs/design.md without reusing any
 * stride from layout.c. Offset = index * head_dim * elem_size.
 */
static uint64_t ref_offset(const char *p, const shape_t *s, uint32_t layer,
                           uint32_t kv, uint32_t blk, uint32_t tok,
                           uint32_t head)
{
    uint64_t L = s->L, K = s->K, H = s->H, T = s->T, B = s->B;
    uint64_t hd = (uint64_t)s->D * kvx_dtype_size(s->dt), i;
    if (!strcmp(p, "trtllm")) /* [block][layer][kv][head][token][dim] */
        i = (((blk * L + layer) * K + kv) * H + head) * T + tok;
    else if (!strcmp(p, "vllm-nhd")) /* [layer][kv][block][token][head] */
        i = (((layer * K + kv) * B + blk) * T + tok) * H + head;
    else if (!strcmp(p, "vllm-hnd")) /* [layer][kv][block][head][token] */
        i = (((layer * K + kv) * B + blk) * H + head) * T + tok;
    else if (!strcmp(p, "flashinfer")) /* [layer][block][kv][token][head] */
        i = (((layer * B + blk) * K + kv) * T + tok) * H + head;
    else if (!strcmp(p, "sglang")) /* [layer][kv][token=block][head] */
        i = ((layer * K + kv) * B + blk) * H + head + 0 * tok;
    else if (!strcmp(p, "mla")) /* [layer][block][token][latent] */
        i = (layer * B + blk) * T + tok + 0 * (kv + head);
    else
        CHECK(!"unknown preset");
    return i * hd;
}

static uint64_t ref_span(const shape_t *s)
{
    return (uint64_t)s->L * s->K * s->H * s->T * s->B * s->D *
           kvx_dtype_size(s->dt);
}

static void make(const char *preset, const shape_t *s, kvx_layout_t *l)
{
    int rc = kvx_layout_preset(preset, s->L, s->K, s->H, s->D, s->dt, s->T,
                               s->B, l);
    if (rc)
        fprintf(stderr, "preset %s L%u K%u H%u D%u T%u B%u: %d\n", preset,
                s->L, s->K, s->H, s->D, s->T, s->B, rc);
    CHECK_EQ(rc, 0);
}

/* The check of a one-region pool of size bytes. */
static int check(const kvx_layout_t *l, uint64_t size, char *why)
{
    why[0] = 0;
    return kvx__layout_check(l, &size, 1, &(kvx_why_t){why, 256});
}

static kvx_layout_part_t PT[2 * KVX_MAX_LAYERS];

/* Give l explicit parts in region 0: layer a at offs[a], its V kv_stride
 * after its K (what a per-layer offset list said before regions). */
static void set_layer_offsets(kvx_layout_t *l, const uint64_t *offs)
{
    for (uint32_t a = 0; a < l->num_layers; a++)
        for (uint32_t k = 0; k < l->kv_factor; k++)
            PT[a * l->kv_factor + k] =
                (kvx_layout_part_t){0, 0, offs[a] + k * l->kv_stride};
    l->parts = PT;
    l->num_parts = l->num_layers * l->kv_factor;
}

/* A small valid layout to break one field at a time. */
static void base_layout(kvx_layout_t *l)
{
    shape_t s = {4, 2, 4, 8, 4, 6, KVX_DTYPE_FP16};
    make("vllm-nhd", &s, l);
}

static void expect_refused(const kvx_layout_t *l, uint64_t size,
                           const char *needle)
{
    char why[256];
    int rc = check(l, size, why);
    if (rc != KVX_ERR_LAYOUT || !strstr(why, needle))
        fprintf(stderr, "rc %d why '%s' (wanted '%s')\n", rc, why, needle);
    CHECK_EQ(rc, KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, needle);
}

/* ---- presets ---- */

static void check_preset_offsets(const char *preset, const shape_t *s)
{
    kvx_layout_t l;
    make(preset, s, &l);
    CHECK(!strcmp(l.preset, preset));
    CHECK_EQ(l.num_layers, s->L);
    CHECK_EQ(l.kv_factor, s->K);
    CHECK_EQ(l.num_heads, s->H);
    CHECK_EQ(l.head_dim, s->D);
    CHECK_EQ(l.elem_size, kvx_dtype_size(s->dt));
    CHECK_EQ(l.dtype, s->dt);
    CHECK_EQ(l.tokens_per_block, s->T);
    CHECK_EQ(l.num_blocks, s->B);
    uint64_t hd = (uint64_t)s->D * l.elem_size, last = 0;
    for (uint32_t a = 0; a < s->L; a++)
        for (uint32_t k = 0; k < s->K; k++)
            for (uint32_t b = 0; b < s->B; b++)
                for (uint32_t t = 0; t < s->T; t++)
                    for (uint32_t h = 0; h < s->H; h++) {
                        uint64_t got = kvx_layout_offset(&l, a, k, b, t, h);
                        uint64_t want = ref_offset(preset, s, a, k, b, t, h);
                        if (got != want) {
                            fprintf(stderr,
                                    "%s (%u,%u,%u,%u,%u): %llu != %llu\n",
                                    preset, a, k, b, t, h,
                                    (unsigned long long)got,
                                    (unsigned long long)want);
                            CHECK(!"offset differs from the formula");
                        }
                        if (got + hd > last)
                            last = got + hd;
                    }
    /* the presets are dense: the span is every element, end to end */
    CHECK_EQ(last, ref_span(s));
    CHECK_EQ(kvx_layout_span(&l), last);
    char why[256];
    CHECK_EQ(check(&l, last, why), 0);
    CHECK_EQ(check(&l, last + 4096, why), 0);
    /* one byte short: refused, naming the layer that ends past the pool */
    char want[128];
    snprintf(want, sizeof(want), "past its %llu bytes",
             (unsigned long long)(last - 1));
    expect_refused(&l, last - 1, want);
    expect_refused(&l, last - 1, "layout: layer ");
}

TEST(preset_offsets_match_formulas)
{
    static const shape_t shapes[] = {
        {1, 1, 1, 1, 1, 1, KVX_DTYPE_FP32},
        {3, 2, 4, 8, 16, 5, KVX_DTYPE_FP16},
        {2, 2, 3, 5, 7, 3, KVX_DTYPE_BF16},
        {5, 1, 2, 4, 3, 4, KVX_DTYPE_FP8},
        {1, 2, 1, 3, 2, 9, KVX_DTYPE_INT8},
        {4, 2, 8, 2, 1, 6, KVX_DTYPE_FP32},
    };
    for (int p = 0; p < NPRESETS; p++)
        for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
            shape_t s = shapes[i];
            shape_fit(presets[p], &s);
            check_preset_offsets(presets[p], &s);
        }
}

TEST(preset_offsets_random_shapes)
{
    static const kvx_dtype_t dts[] = {KVX_DTYPE_FP32, KVX_DTYPE_FP16,
                                      KVX_DTYPE_BF16, KVX_DTYPE_FP8,
                                      KVX_DTYPE_INT8};
    for (int iter = 0; iter < 300; iter++) {
        const char *p = presets[iter % NPRESETS];
        shape_t s = {rnd_in(1, 5), rnd_in(1, 2), rnd_in(1, 6),
                     rnd_in(1, 9), rnd_in(1, 9), rnd_in(1, 7),
                     dts[rnd() % 5]};
        shape_fit(p, &s);
        check_preset_offsets(p, &s);
    }
}

TEST(preset_offsets_past_4gib)
{
    /* a production-sized pool: offsets must be computed in 64 bits */
    shape_t s = {80, 2, 8, 128, 64, 65536, KVX_DTYPE_FP16};
    for (int p = 0; p < NPRESETS; p++) {
        shape_t t = s;
        shape_fit(presets[p], &t);
        kvx_layout_t l;
        make(presets[p], &t, &l);
        uint64_t span = ref_span(&t);
        CHECK(span > (1ull << 32));
        CHECK_EQ(kvx_layout_span(&l), span);
        uint32_t lt = t.T - 1, lh = t.H - 1, lk = t.K - 1;
        CHECK_EQ(kvx_layout_offset(&l, t.L - 1, lk, t.B - 1, lt, lh),
                 ref_offset(presets[p], &t, t.L - 1, lk, t.B - 1, lt, lh));
        CHECK_EQ(kvx_layout_offset(&l, t.L - 1, lk, t.B - 1, lt, lh) +
                     (uint64_t)t.D * 2,
                 span);
        CHECK_EQ(kvx_layout_offset(&l, 37, 0, 3001, 0, 0),
                 ref_offset(presets[p], &t, 37, 0, 3001, 0, 0));
        char why[256];
        CHECK_EQ(check(&l, span, why), 0);
        expect_refused(&l, span - 1, "past its");
    }
}

TEST(preset_shape_constraints)
{
    kvx_layout_t l;
    memset(&l, 0x77, sizeof(l));
    kvx_layout_t before = l;
    /* sglang pages are one token */
    CHECK_EQ(kvx_layout_preset("sglang", 2, 2, 4, 8, KVX_DTYPE_FP16, 2, 8, &l),
             KVX_ERR_INVALID);
    CHECK_EQ(kvx_layout_preset("sglang", 2, 2, 4, 8, KVX_DTYPE_FP16, 16, 8,
                               &l),
             KVX_ERR_INVALID);
    /* mla: one latent "head", K only */
    CHECK_EQ(kvx_layout_preset("mla", 2, 2, 1, 512, KVX_DTYPE_FP16, 16, 8, &l),
             KVX_ERR_INVALID);
    CHECK_EQ(kvx_layout_preset("mla", 2, 1, 2, 512, KVX_DTYPE_FP16, 16, 8, &l),
             KVX_ERR_INVALID);
    /* *out untouched on refusal */
    CHECK(!memcmp(&l, &before, sizeof(l)));
    CHECK_EQ(kvx_layout_preset("sglang", 2, 2, 4, 8, KVX_DTYPE_FP16, 1, 8, &l),
             0);
    CHECK_EQ(kvx_layout_preset("mla", 2, 1, 1, 576, KVX_DTYPE_BF16, 64, 8, &l),
             0);
}

TEST(preset_refuses_bad_arguments)
{
    kvx_layout_t l;
    const kvx_dtype_t f16 = KVX_DTYPE_FP16;
    CHECK_EQ(kvx_layout_preset("nope", 2, 2, 4, 8, f16, 4, 8, &l),
             KVX_ERR_INVALID);
    CHECK_EQ(kvx_layout_preset(NULL, 2, 2, 4, 8, f16, 4, 8, &l),
             KVX_ERR_INVALID);
    CHECK_EQ(kvx_layout_preset("trtllm-with-a-long-name", 2, 2, 4, 8, f16, 4,
                               8, &l),
             KVX_ERR_INVALID);
    for (int p = 0; p < NPRESETS; p++) {
        const char *n = presets[p];
        CHECK_EQ(kvx_layout_preset(n, 0, 1, 1, 8, f16, 1, 8, &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, KVX_MAX_LAYERS + 1, 1, 1, 8, f16, 1, 8,
                                   &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 0, 1, 8, f16, 1, 8, &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 3, 1, 8, f16, 1, 8, &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 1, 0, 8, f16, 1, 8, &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 1, 1, 0, f16, 1, 8, &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 1, 1, 8, KVX_DTYPE_UNSPECIFIED, 1, 8,
                                   &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 1, 1, 8, (kvx_dtype_t)42, 1, 8, &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 1, 1, 8, f16, 0, 8, &l),
                 KVX_ERR_INVALID);
        CHECK_EQ(kvx_layout_preset(n, 2, 1, 1, 8, f16, 1, 0, &l),
                 KVX_ERR_INVALID);
        /* the largest legal layer count works */
        CHECK_EQ(kvx_layout_preset(n, KVX_MAX_LAYERS, 1, 1, 8, f16, 1, 2, &l),
                 0);
        char why[256];
        CHECK_EQ(check(&l, kvx_layout_span(&l), why), 0);
    }
}

TEST(preset_too_big_for_64_bits_is_not_accepted)
{
    /*
     * Shapes whose size does not fit 64 bits (some wrap a stride inside
     * the preset): either the preset refuses, or what it returns reports
     * a span of 0 and fails the pool check; a wrapped stride must never
     * pass for a small legal layout.
     */
    static const struct {
        const char *p;
        uint32_t L, K, H, D, T, B;
    } big[] = {
        {"vllm-nhd", 4, 2, 4096, 65536, 65536, UINT32_MAX},
        {"vllm-hnd", 4, 2, 4096, 65536, 65536, UINT32_MAX},
        {"flashinfer", 4, 2, 4096, 65536, 65536, UINT32_MAX},
        {"trtllm", KVX_MAX_LAYERS, 2, 4096, 65536, 65536, UINT32_MAX},
        {"sglang", 4, 2, 4096, 65536, 1, UINT32_MAX},
        {"mla", 4, 1, 1, 65536, 65536, UINT32_MAX},
    };
    for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
        kvx_layout_t l;
        int rc = kvx_layout_preset(big[i].p, big[i].L, big[i].K, big[i].H,
                                   big[i].D, KVX_DTYPE_FP32, big[i].T,
                                   big[i].B, &l);
        if (rc) {
            CHECK_EQ(rc, KVX_ERR_INVALID);
            continue;
        }
        char why[256];
        CHECK_EQ(kvx_layout_span(&l), 0);
        CHECK_EQ(check(&l, UINT64_MAX, why), KVX_ERR_LAYOUT);
    }
}

/* ---- span ---- */

TEST(span_is_last_byte_plus_one)
{
    /* layers placed out of order and with gaps: the span is the end of
     * the last-placed layer, not num_layers * layer size */
    kvx_layout_t l;
    shape_t s = {3, 2, 2, 4, 4, 3, KVX_DTYPE_FP16};
    make("vllm-hnd", &s, &l);
    uint64_t ls = ref_span(&s) / 3;
    uint64_t offs[3] = {5 * ls + 100, 0, 2 * ls + 7};
    set_layer_offsets(&l, offs);
    CHECK_EQ(kvx_layout_span(&l), 6 * ls + 100);
    CHECK_EQ(kvx_layout_region_span(&l, 0), 6 * ls + 100);
    CHECK_EQ(kvx_layout_region_span(&l, 1), 0);
    CHECK_EQ(kvx_layout_num_regions(&l), 1);
    char why[256];
    CHECK_EQ(check(&l, 6 * ls + 100, why), 0);
    expect_refused(&l, 6 * ls + 99, "layer 0 kv 1 ends at byte");
    /* overflow: span reports 0 rather than a wrapped size */
    PT[4].offset = UINT64_MAX - 10;
    CHECK_EQ(kvx_layout_span(&l), 0);
}

/* ---- the pool check, one field at a time ---- */

TEST(check_dimension_ranges)
{
    kvx_layout_t l;
    base_layout(&l);
    uint64_t big = 1ull << 40;
    char why[256];
    CHECK_EQ(check(&l, big, why), 0);

    base_layout(&l);
    l.num_layers = 0;
    expect_refused(&l, big, "layout.num_layers: 0");
    l.num_layers = KVX_MAX_LAYERS + 1;
    expect_refused(&l, big, "layout.num_layers: 1025");

    base_layout(&l);
    l.kv_factor = 3;
    expect_refused(&l, big, "layout.kv_factor: 3");
    l.kv_factor = 0;
    expect_refused(&l, big, "layout.kv_factor: 0");

    base_layout(&l);
    l.num_heads = 0;
    expect_refused(&l, big, "layout.num_heads");
    l.num_heads = 4097;
    expect_refused(&l, big, "layout.num_heads");

    base_layout(&l);
    l.head_dim = 0;
    expect_refused(&l, big, "layout.head_dim");
    l.head_dim = 65537;
    expect_refused(&l, big, "layout.head_dim");

    base_layout(&l);
    l.tokens_per_block = 0;
    expect_refused(&l, big, "layout.tokens_per_block");
    l.tokens_per_block = 65537;
    expect_refused(&l, big, "layout.tokens_per_block");

    base_layout(&l);
    l.num_blocks = 0;
    expect_refused(&l, big, "layout.num_blocks");

    base_layout(&l);
    l.elem_size = 3;
    expect_refused(&l, big, "layout.elem_size: 3");
    l.elem_size = 0;
    expect_refused(&l, big, "layout.elem_size: 0");
}

TEST(check_elem_size_matches_dtype)
{
    kvx_layout_t l;
    base_layout(&l); /* fp16 */
    l.elem_size = 4;
    l.head_stride *= 2;
    l.token_stride *= 2;
    l.block_stride *= 2;
    l.kv_stride *= 2;
    l.layer_stride *= 2;
    expect_refused(&l, 1ull << 40, "does not match dtype fp16");
    l.dtype = KVX_DTYPE_FP32;
    char why[256];
    CHECK_EQ(check(&l, 1ull << 40, why), 0);
    /* unspecified dtype: any legal element size */
    l.dtype = KVX_DTYPE_UNSPECIFIED;
    CHECK_EQ(check(&l, 1ull << 40, why), 0);
    /* an unknown dtype value is refused, not taken for unspecified */
    l.dtype = (kvx_dtype_t)9;
    expect_refused(&l, 1ull << 40, "dtype");
}

TEST(check_zero_strides)
{
    static const struct {
        const char *name;
        size_t off;
    } f[] = {
        {"head_stride", offsetof(kvx_layout_t, head_stride)},
        {"token_stride", offsetof(kvx_layout_t, token_stride)},
        {"block_stride", offsetof(kvx_layout_t, block_stride)},
        {"kv_stride", offsetof(kvx_layout_t, kv_stride)},
        {"layer_stride", offsetof(kvx_layout_t, layer_stride)},
    };
    for (int i = 0; i < 5; i++) {
        kvx_layout_t l;
        base_layout(&l);
        *(uint64_t *)((char *)&l + f[i].off) = 0;
        char want[64];
        snprintf(want, sizeof(want), "layout.%s: 0", f[i].name);
        expect_refused(&l, 1ull << 40, want);
    }
    /* a zero stride along a dimension of one element is fine */
    kvx_layout_t l;
    shape_t s = {2, 1, 1, 8, 1, 4, KVX_DTYPE_FP16};
    make("vllm-nhd", &s, &l);
    l.kv_stride = 0;
    l.head_stride = 0;
    l.token_stride = 0;
    char why[256];
    CHECK_EQ(check(&l, kvx_layout_span(&l), why), 0);
}

TEST(check_overlapping_strides)
{
    kvx_layout_t l;
    char why[256];
    /* token stride inside a head's run */
    base_layout(&l);
    l.token_stride = l.head_stride;
    expect_refused(&l, 1ull << 40, "overlap");
    /* blocks one token apart */
    base_layout(&l);
    l.block_stride = l.token_stride;
    expect_refused(&l, 1ull << 40, "overlap");
    /* head stride smaller than head_dim * elem_size */
    base_layout(&l);
    l.head_stride = l.head_dim * l.elem_size - 1;
    expect_refused(&l, 1ull << 40, "overlap");
    /* K and V on top of each other */
    base_layout(&l);
    l.kv_stride = l.block_stride * 2;
    expect_refused(&l, 1ull << 40, "overlap");
    /* layers evenly spaced, but closer than a layer */
    base_layout(&l);
    l.layer_stride = l.kv_stride;
    expect_refused(&l, 1ull << 40, "overlap");
    /* layers unevenly spaced and overlapping */
    uint64_t offs[4];
    base_layout(&l);
    for (uint32_t i = 0; i < 4; i++)
        offs[i] = i * l.layer_stride;
    offs[2] = offs[1] + 2 * l.kv_stride + 2;
    offs[3] = offs[2] + l.layer_stride;
    set_layer_offsets(&l, offs);
    CHECK_EQ(check(&l, 1ull << 40, why), 0);
    offs[2] = offs[1] + 2;
    set_layer_offsets(&l, offs);
    expect_refused(&l, 1ull << 40, "layout.parts: layer 2 kv 0 overlaps");
    /* two layers at the same offset */
    offs[2] = offs[3] = 0;
    set_layer_offsets(&l, offs);
    expect_refused(&l, 1ull << 40, "overlap");
    /* vLLM 0.33: each (block, head, token) cell holds a token's K then
     * its V, so K and V parts interleave; disjoint as a layers x kv grid,
     * and refused when V starts inside K */
    base_layout(&l);
    l.head_stride = 2 * l.head_dim * l.elem_size;
    l.token_stride = l.num_heads * l.head_stride;
    l.block_stride = l.tokens_per_block * l.token_stride;
    uint64_t lsz = l.num_blocks * l.block_stride;
    kvx_layout_part_t grid[8];
    for (uint32_t i = 0; i < 8; i++)
        grid[i] = (kvx_layout_part_t){
            0, 0, i / 2 * lsz + i % 2 * l.head_dim * l.elem_size};
    l.parts = grid;
    l.num_parts = 8;
    CHECK_EQ(check(&l, 4 * lsz, why), 0);
    for (uint32_t i = 1; i < 8; i += 2)
        grid[i].offset -= 2;
    expect_refused(&l, 4 * lsz, "overlap");
    /* interleaved but disjoint (strides with gaps filled by another
     * dimension) is legal: heads spread apart with tokens in between */
    shape_t s = {1, 1, 2, 4, 2, 1, KVX_DTYPE_INT8};
    make("vllm-nhd", &s, &l); /* token 8, head 4 */
    l.head_stride = 8;
    l.token_stride = 4; /* [head][token][dim] */
    CHECK_EQ(check(&l, 16, why), 0);
    /* the same layout one byte short */
    expect_refused(&l, 15, "past its 15 bytes");
}

TEST(check_overflowing_strides)
{
    kvx_layout_t l;
    base_layout(&l);
    l.block_stride = UINT64_MAX - 3;
    expect_refused(&l, UINT64_MAX, "overflows");
    base_layout(&l);
    l.block_stride = UINT64_MAX / 2; /* (6-1) * this overflows */
    expect_refused(&l, UINT64_MAX, "overflows");
    base_layout(&l);
    l.kv_stride = 1ull << 63; /* 1 * 2^63 fits; with blocks it does not */
    l.block_stride = 1ull << 61;
    expect_refused(&l, UINT64_MAX, "overflows");
    base_layout(&l);
    uint64_t offs[4] = {0, l.layer_stride, 2 * l.layer_stride,
                        UINT64_MAX - 100};
    set_layer_offsets(&l, offs);
    expect_refused(&l, UINT64_MAX, "layout.parts[6]: layer 3 kv 0");
    base_layout(&l);
    l.layer_stride = UINT64_MAX / 2;
    expect_refused(&l, UINT64_MAX, "layout: layer 2 kv 0: offset");
    /* huge but representable: fits a huge pool, refused for a small one */
    base_layout(&l);
    shape_t s = {1, 1, 1, 1, 1, 2, KVX_DTYPE_INT8};
    make("vllm-nhd", &s, &l);
    l.block_stride = 1ull << 62;
    char why[256];
    CHECK_EQ(check(&l, (1ull << 62) + 1, why), 0);
    expect_refused(&l, 1ull << 62, "past its");
}

/* ---- brute force: accepted layouts never alias ---- */

TEST_T(accepted_layouts_never_alias, 120)
{
    /* one region (strides, or parts evenly or unevenly placed), or parts
     * spread over up to 3 regions: what the check accepts never aliases
     * in any region and never leaves one */
    static uint8_t mark[3][1 << 16];
    uint32_t accepted = 0, refused = 0, multi = 0;
    for (int iter = 0; iter < 60000; iter++) {
        kvx_layout_t l;
        memset(&l, 0, sizeof(l));
        l.num_layers = rnd_in(1, 3);
        l.kv_factor = rnd_in(1, 2);
        l.num_heads = rnd_in(1, 3);
        l.head_dim = rnd_in(1, 3);
        l.elem_size = 1u << rnd_in(0, 2);
        l.dtype = KVX_DTYPE_UNSPECIFIED;
        l.tokens_per_block = rnd_in(1, 3);
        l.num_blocks = rnd_in(1, 3);
        /* strides near multiples of the element run, so some layouts
         * are legal and some just miss */
        uint64_t run = (uint64_t)l.head_dim * l.elem_size;
        uint64_t *st[5] = {&l.head_stride, &l.token_stride, &l.block_stride,
                           &l.kv_stride, &l.layer_stride};
        for (int i = 0; i < 4; i++)
            *st[i] = rnd() % 3 == 0 ? rnd_in(0, 80)
                                    : run * rnd_in(0, 40) + rnd_in(0, 2);
        *st[4] = run * rnd_in(0, 120) + rnd_in(0, 1);
        /* strides, even, uneven, multi, a grid of layers x kv (vLLM
         * 0.33: K and V side by side in every cell) */
        uint32_t nreg = 1, form = rnd() % 5;
        uint32_t P = l.num_layers * l.kv_factor;
        if (form) {
            uint64_t step = run * rnd_in(0, 60) + rnd_in(0, 1);
            uint64_t kstep = run * rnd_in(0, 4) + rnd_in(0, 1);
            uint64_t base = rnd_in(0, 3);
            nreg = form == 3 ? rnd_in(1, 3) : 1;
            for (uint32_t i = 0; i < P; i++)
                PT[i] = (kvx_layout_part_t){
                    nreg > 1 ? rnd() % nreg : 0, 0,
                    form == 1   ? base + i * step
                    : form == 4 ? base + i / l.kv_factor * step +
                                      i % l.kv_factor * kstep
                                : rnd_in(0, 1500)};
            if (form == 1 && rnd() % 2) /* the same progression, shuffled */
                for (uint32_t i = P - 1; i > 0; i--) {
                    uint32_t k = rnd() % (i + 1);
                    uint64_t t = PT[i].offset;
                    PT[i].offset = PT[k].offset;
                    PT[k].offset = t;
                }
            l.parts = PT;
            l.num_parts = P;
        }
        uint64_t size[3];
        for (uint32_t r = 0; r < nreg; r++)
            size[r] = rnd_in(1, sizeof(mark[0]));
        char why[256];
        why[0] = 0;
        int rc = kvx__layout_check(&l, size, nreg, KVX_WHY(why));
        if (rc) {
            CHECK_EQ(rc, KVX_ERR_LAYOUT);
            CHECK(why[0] != 0);
            refused++;
            continue;
        }
        accepted++;
        multi += nreg > 1;
        uint64_t last[3] = {0, 0, 0};
        for (uint32_t r = 0; r < nreg; r++)
            memset(mark[r], 0, size[r]);
        for (uint32_t a = 0; a < l.num_layers; a++)
            for (uint32_t k = 0; k < l.kv_factor; k++)
                for (uint32_t b = 0; b < l.num_blocks; b++)
                    for (uint32_t t = 0; t < l.tokens_per_block; t++)
                        for (uint32_t h = 0; h < l.num_heads; h++) {
                            uint32_t r = kvx_layout_region(&l, a, k);
                            uint64_t o = kvx_layout_offset(&l, a, k, b, t, h);
                            CHECK(r < nreg);
                            CHECK(o + run <= size[r]);
                            for (uint64_t x = o; x < o + run; x++) {
                                if (mark[r][x]) {
                                    fprintf(stderr,
                                            "byte %llu of region %u twice "
                                            "(layer %u kv %u block %u "
                                            "token %u head %u)\n",
                                            (unsigned long long)x, r, a, k, b,
                                            t, h);
                                    CHECK(!"accepted layout aliases");
                                }
                                mark[r][x] = 1;
                            }
                            if (o + run > last[r])
                                last[r] = o + run;
                        }
        for (uint32_t r = 0; r < nreg; r++) {
            CHECK(last[r] > 0); /* every region holds a part */
            CHECK_EQ(kvx_layout_region_span(&l, r), last[r]);
        }
        CHECK_EQ(kvx_layout_num_regions(&l), nreg);
        CHECK_EQ(kvx_layout_span(&l), nreg == 1 ? last[0] : 0);
    }
    /* both outcomes are common, so the property was really exercised */
    CHECK(accepted > 2000);
    CHECK(refused > 2000);
    CHECK(multi > 200);
}

/* ---- regions ---- */

TEST(split_per_layer_and_per_kv)
{
    /* a one-region preset split into one region per layer (vLLM) or per
     * K and V (SGLang): every element keeps its place inside its layer
     * (or part), each region is exactly what it holds */
    for (int p = 0; p < NPRESETS; p++) {
        shape_t s = {3, 2, 2, 4, 2, 3, KVX_DTYPE_FP16};
        shape_fit(presets[p], &s);
        kvx_layout_t one, l;
        make(presets[p], &s, &one);
        for (uint32_t per = 1; per <= s.K; per++) {
            l = one;
            kvx_layout_part_t parts[6];
            CHECK_EQ(kvx_layout_split(&l, per, parts, 6), 0);
            CHECK(l.parts == parts);
            CHECK_EQ(l.num_parts, s.L * s.K);
            CHECK_EQ(kvx_layout_num_regions(&l), s.L * per);
            CHECK_EQ(kvx_layout_span(&l), 0); /* several regions */
            uint64_t size[6];
            for (uint32_t r = 0; r < s.L * per; r++)
                size[r] = kvx_layout_region_span(&l, r);
            char why[256];
            CHECK_EQ(kvx__layout_check(&l, size, s.L * per, KVX_WHY(why)), 0);
            for (uint32_t a = 0; a < s.L; a++)
                for (uint32_t k = 0; k < s.K; k++) {
                    uint32_t r = kvx_layout_region(&l, a, k);
                    CHECK_EQ(r, per == 1 ? a : a * 2 + k);
                    uint64_t base =
                        per == 1 ? kvx_layout_offset(&one, a, 0, 0, 0, 0)
                                 : kvx_layout_offset(&one, a, k, 0, 0, 0);
                    if (per == 1 && s.K == 2 &&
                        kvx_layout_offset(&one, a, 1, 0, 0, 0) < base)
                        base = kvx_layout_offset(&one, a, 1, 0, 0, 0);
                    CHECK_EQ(
                        kvx_layout_offset(&l, a, k, s.B - 1, s.T - 1, s.H - 1),
                        kvx_layout_offset(&one, a, k, s.B - 1, s.T - 1,
                                          s.H - 1) -
                            base);
                }
            /* one byte short in the last region: refused naming it */
            uint32_t last = s.L * per - 1;
            size[last]--;
            char want[64];
            snprintf(want, sizeof(want), "of region %u, past its", last);
            CHECK_EQ(kvx__layout_check(&l, size, s.L * per, KVX_WHY(why)),
                     KVX_ERR_LAYOUT);
            CHECK_STR_CONTAINS(why, want);
            /* split again: refused, parts untouched */
            kvx_layout_part_t again[6];
            CHECK_EQ(kvx_layout_split(&l, 1, again, 6), KVX_ERR_INVALID);
        }
        /* room too small, a bad count */
        l = one;
        kvx_layout_part_t few[1];
        CHECK_EQ(kvx_layout_split(&l, 1, few, 1),
                 s.L * s.K > 1 ? KVX_ERR_INVALID : 0);
        l = one;
        kvx_layout_part_t parts[6];
        CHECK_EQ(kvx_layout_split(&l, 3, parts, 6), KVX_ERR_INVALID);
        if (s.K == 1)
            CHECK_EQ(kvx_layout_split(&l, 2, parts, 6), KVX_ERR_INVALID);
    }
}

TEST(check_regions_refusals)
{
    kvx_layout_t l;
    base_layout(&l); /* 4 layers, 2 kv */
    kvx_layout_part_t parts[8];
    CHECK_EQ(kvx_layout_split(&l, 2, parts, 8), 0);
    uint64_t size[9];
    for (int r = 0; r < 9; r++)
        size[r] = kvx_layout_region_span(&l, r < 8 ? r : 0);
    char why[256];
    CHECK_EQ(kvx__layout_check(&l, size, 8, KVX_WHY(why)), 0);
    /* a region nothing lies in */
    CHECK_EQ(kvx__layout_check(&l, size, 9, KVX_WHY(why)), KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, "register_pool.regions[8]: holds no part");
    parts[2].region = 0; /* layer 1 kv 0 moved into region 0, region 2 empty */
    parts[2].offset = size[0];
    uint64_t big[8];
    memcpy(big, size, sizeof(big));
    big[0] *= 2;
    CHECK_EQ(kvx__layout_check(&l, big, 8, KVX_WHY(why)), KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, "register_pool.regions[2]: holds no part");
    /* a part in a region the pool does not have */
    parts[2] = (kvx_layout_part_t){8, 0, 0};
    CHECK_EQ(kvx__layout_check(&l, size, 8, KVX_WHY(why)), KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why,
                       "layout.parts[2]: layer 1 kv 0 in region 8, but the "
                       "pool has 8 regions");
    /* a part past its region, by one byte */
    parts[2] = (kvx_layout_part_t){2, 0, 1};
    CHECK_EQ(kvx__layout_check(&l, size, 8, KVX_WHY(why)), KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, "layer 1 kv 0 ends at byte");
    CHECK_STR_CONTAINS(why, "of region 2, past its");
    /* two parts on top of each other in one region */
    parts[2] = (kvx_layout_part_t){3, 0, 0};
    big[3] = 4 * size[3];
    CHECK_EQ(kvx__layout_check(&l, big, 8, KVX_WHY(why)), KVX_ERR_LAYOUT);
    /* (region 2 is empty now too: either refusal names a field) */
    CHECK(strstr(why, "overlap") || strstr(why, "regions[2]"));
    /* a count of parts that is not layers x kv */
    parts[2] = (kvx_layout_part_t){2, 0, 0};
    l.num_parts = 7;
    CHECK_EQ(kvx__layout_check(&l, size, 8, KVX_WHY(why)), KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, "layout.parts: 7 entries for num_layers 4 x "
                            "kv_factor 2");
    /* parts NULL is one region */
    base_layout(&l);
    CHECK_EQ(kvx__layout_check(&l, size, 2, KVX_WHY(why)), KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, "the pool has 2 regions");
    CHECK_EQ(kvx__layout_check(&l, size, KVX_MAX_REGIONS + 1, KVX_WHY(why)),
             KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, "register_pool.regions: 4097 regions");
}

/* ---- dtypes ---- */

TEST(dtype_round_trips)
{
    static const struct {
        const char *name;
        kvx_dtype_t dt;
        unsigned size;
    } want[] = {
        {"fp32", KVX_DTYPE_FP32, 4}, {"fp16", KVX_DTYPE_FP16, 2},
        {"bf16", KVX_DTYPE_BF16, 2}, {"fp8", KVX_DTYPE_FP8, 1},
        {"int8", KVX_DTYPE_INT8, 1},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        kvx_dtype_t d = KVX_DTYPE_UNSPECIFIED;
        CHECK_EQ(kvx_dtype_parse(want[i].name, &d), 0);
        CHECK_EQ(d, want[i].dt);
        CHECK(!strcmp(kvx_dtype_name(d), want[i].name));
        CHECK_EQ(kvx_dtype_size(d), want[i].size);
    }
    kvx_dtype_t d = KVX_DTYPE_FP8;
    CHECK_EQ(kvx_dtype_parse("fp64", &d), KVX_ERR_INVALID);
    CHECK_EQ(kvx_dtype_parse("", &d), KVX_ERR_INVALID);
    CHECK_EQ(kvx_dtype_parse("FP16", &d), KVX_ERR_INVALID);
    CHECK_EQ(kvx_dtype_parse("fp16 ", &d), KVX_ERR_INVALID);
    CHECK_EQ(d, KVX_DTYPE_FP8); /* untouched on refusal */
    CHECK(!strcmp(kvx_dtype_name(KVX_DTYPE_UNSPECIFIED), "unspecified"));
    CHECK(!strcmp(kvx_dtype_name((kvx_dtype_t)77), "unspecified"));
    CHECK_EQ(kvx_dtype_size(KVX_DTYPE_UNSPECIFIED), 0);
    CHECK_EQ(kvx_dtype_size((kvx_dtype_t)77), 0);
}
