/*
 * test_session — the protocol edge's own validators: check_blocks
 * (block tables), static in daemon/local/session.c, and layout_from_msg
 * (Layout message -> kvx_layout_t), static in session_pool.c. Both short
 * tables (pairwise check) and long ones (bitmap) are covered, and a
 * random comparison against a reference checker.
 */
#include "../../daemon/local/session.c"
#undef FAIL /* session_pool.c has its own */
#include "../../daemon/local/session_pool.c"

#include "tests/test.h"

#include <stdint.h>

/* ---- helpers ---- */

static uint64_t rng_state = 0x082efa98ec4e6c89ull;

static uint32_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static void setup(void)
{
    conf_defaults(&kvxd.conf);
}

static pool_t fake_pool(uint32_t id, uint32_t nblocks)
{
    pool_t p;
    memset(&p, 0, sizeof(p));
    p.id = id;
    p.layout.num_blocks = nblocks;
    return p;
}

static int blocks(const pool_t *p, const uint32_t *b, size_t n, char *why)
{
    why[0] = 0;
    return check_blocks(p, b, n, "publish", &(kvx_why_t){why, 256});
}

static void expect_blocks(const pool_t *p, const uint32_t *b, size_t n,
                          int code, const char *needle)
{
    char why[256];
    int rc = blocks(p, b, n, why);
    if (rc != code || (needle && !strstr(why, needle)))
        fprintf(stderr, "rc %d why '%s' (wanted %d '%s')\n", rc, why, code,
                needle ? needle : "");
    CHECK_EQ(rc, code);
    if (needle)
        CHECK_STR_CONTAINS(why, needle);
}

/* ---- check_blocks ---- */

TEST(blocks_empty)
{
    setup();
    pool_t p = fake_pool(3, 10);
    uint32_t b[1] = {0};
    expect_blocks(&p, b, 0, KVX_ERR_INVALID, "publish.blocks: empty");
    char why[256];
    CHECK_EQ(check_blocks(&p, NULL, 0, "fetch", KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "fetch.blocks: empty");
}

TEST(blocks_valid)
{
    setup();
    pool_t p = fake_pool(3, 100);
    uint32_t b[100];
    for (uint32_t i = 0; i < 100; i++)
        b[i] = 99 - i;
    for (size_t n = 1; n <= 100; n++)
        expect_blocks(&p, b, n, 0, NULL);
    uint32_t last[1] = {99};
    expect_blocks(&p, last, 1, 0, NULL);
}

TEST(blocks_out_of_range)
{
    setup();
    pool_t p = fake_pool(7, 10);
    uint32_t b[3] = {1, 9, 10};
    expect_blocks(&p, b, 3, KVX_ERR_INVALID,
                  "publish.blocks[2]: block 10 outside pool 7's 10 blocks");
    uint32_t c[2] = {UINT32_MAX, 0};
    expect_blocks(&p, c, 2, KVX_ERR_INVALID, "publish.blocks[0]: block "
                                             "4294967295 outside");
    /* long table (bitmap path) */
    p = fake_pool(7, 1000);
    uint32_t d[200];
    for (uint32_t i = 0; i < 200; i++)
        d[i] = i * 3;
    d[150] = 1000;
    expect_blocks(&p, d, 200, KVX_ERR_INVALID,
                  "publish.blocks[150]: block 1000 outside pool 7's 1000");
}

TEST(blocks_duplicate)
{
    setup();
    pool_t p = fake_pool(1, 50);
    uint32_t b[6] = {4, 8, 15, 16, 23, 8};
    expect_blocks(&p, b, 6, KVX_ERR_INVALID,
                  "publish.blocks[5]: block 8 listed twice");
    uint32_t c[2] = {0, 0};
    expect_blocks(&p, c, 2, KVX_ERR_INVALID, "blocks[1]: block 0 listed twice");
    /* long table: the duplicate is reported at its second position */
    p = fake_pool(1, 5000);
    uint32_t d[300];
    for (uint32_t i = 0; i < 300; i++)
        d[i] = 4999 - 7 * i;
    d[271] = d[33];
    char want[64];
    snprintf(want, sizeof(want), "blocks[271]: block %u listed twice", d[33]);
    expect_blocks(&p, d, 300, KVX_ERR_INVALID, want);
}

TEST(blocks_over_max_per_request)
{
    setup();
    kvxd.conf.max_blocks_per_request = 4;
    pool_t p = fake_pool(1, 50);
    uint32_t b[5] = {0, 1, 2, 3, 4};
    expect_blocks(&p, b, 4, 0, NULL);
    expect_blocks(&p, b, 5, KVX_ERR_LIMIT, "max_blocks_per_request 4");
    expect_blocks(&p, b, 5, KVX_ERR_LIMIT, "publish.blocks: 5 blocks");
    kvxd.conf.max_blocks_per_request = 64;
    uint32_t many[65];
    for (uint32_t i = 0; i < 65; i++)
        many[i] = i;
    expect_blocks(&p, many, 65, KVX_ERR_LIMIT, "65 blocks");
}

TEST(blocks_in_a_pool_of_uint32_max_blocks)
{
    /* The largest pools: block ids near UINT32_MAX are legal, and a
     * repeat among them is still caught. Long tables (over 32 entries)
     * take the bitmap path, whose size must not wrap. */
    setup();
    pool_t p = fake_pool(9, UINT32_MAX);
    uint32_t b[40];
    for (uint32_t i = 0; i < 40; i++)
        b[i] = UINT32_MAX - 1 - i * 977;
    expect_blocks(&p, b, 40, 0, NULL);
    b[39] = b[0];
    expect_blocks(&p, b, 40, KVX_ERR_INVALID, "blocks[39]");
    b[39] = UINT32_MAX;
    expect_blocks(&p, b, 40, KVX_ERR_INVALID, "outside");
}

/* The reference: first index that is out of range or repeats an earlier
 * entry, or -1. */
static long ref_first_bad(const uint32_t *b, size_t n, uint32_t nb, int *dup)
{
    for (size_t i = 0; i < n; i++) {
        if (b[i] >= nb) {
            *dup = 0;
            return (long)i;
        }
        for (size_t k = 0; k < i; k++)
            if (b[k] == b[i]) {
                *dup = 1;
                return (long)i;
            }
    }
    return -1;
}

TEST(blocks_random_against_reference)
{
    setup();
    uint32_t nbad = 0, ngood = 0;
    for (int iter = 0; iter < 20000; iter++) {
        uint32_t nb = 1 + rnd() % 300;
        size_t n = 1 + rnd() % 90;
        uint32_t b[90];
        for (size_t i = 0; i < n; i++)
            b[i] = rnd() % 4 ? (uint32_t)i * 3 % nb : rnd() % (nb + 3);
        if (rnd() % 2) /* a mostly distinct table */
            for (size_t i = 0; i < n; i++)
                b[i] = (uint32_t)(i * 7 + iter) % (nb + (rnd() % 50 == 0));
        pool_t p = fake_pool(5, nb);
        char why[256];
        int rc = blocks(&p, b, n, why);
        int dup = 0;
        long bad = ref_first_bad(b, n, nb, &dup);
        if (bad < 0) {
            CHECK_EQ(rc, 0);
            ngood++;
            continue;
        }
        nbad++;
        CHECK_EQ(rc, KVX_ERR_INVALID);
        char want[96];
        snprintf(want, sizeof(want), "publish.blocks[%ld]: block %u %s", bad,
                 b[bad], dup ? "listed twice" : "outside");
        CHECK_STR_CONTAINS(why, want);
    }
    CHECK(ngood > 1000 && nbad > 1000);
}

/* ---- layout_from_msg ---- */

static uint32_t pregion[2 * KVX_MAX_LAYERS + 2];
static uint64_t poffset[2 * KVX_MAX_LAYERS + 2];

/* A Layout message of the given layout (parts in the static arrays). */
static Kvxfer__Layout msg_of(const kvx_layout_t *l)
{
    Kvxfer__Layout m = KVXFER__LAYOUT__INIT;
    m.preset = (char *)l->preset;
    m.num_layers = l->num_layers;
    m.kv_factor = l->kv_factor;
    m.num_heads = l->num_heads;
    m.head_dim = l->head_dim;
    m.elem_size = l->elem_size;
    m.dtype = l->dtype;
    m.tokens_per_block = l->tokens_per_block;
    m.num_blocks = l->num_blocks;
    for (uint32_t i = 0; l->parts && i < l->num_parts; i++) {
        pregion[i] = l->parts[i].region;
        poffset[i] = l->parts[i].offset;
    }
    m.n_part_region = m.n_part_offset = l->parts ? l->num_parts : 0;
    m.part_region = pregion;
    m.part_offset = poffset;
    m.layer_stride = l->layer_stride;
    m.kv_stride = l->kv_stride;
    m.block_stride = l->block_stride;
    m.token_stride = l->token_stride;
    m.head_stride = l->head_stride;
    return m;
}

static void expect_layout_error(const Kvxfer__Layout *m, int code,
                                const char *needle)
{
    kvx_layout_t l;
    char why[256] = "";
    int rc = layout_from_msg(m, &l, KVX_WHY(why));
    layout_msg_free(&l);
    if (rc != code)
        fprintf(stderr, "rc %d why '%s'\n", rc, why);
    CHECK_EQ(rc, code);
    CHECK_STR_CONTAINS(why, needle);
}

TEST(layout_round_trips_every_preset)
{
    static const char *const presets[] = {"trtllm",     "vllm-nhd",
                                          "vllm-hnd",   "flashinfer",
                                          "sglang",     "mla"};
    for (int i = 0; i < 6; i++) {
        int sg = i == 4, mla = i == 5;
        kvx_layout_t want, got;
        CHECK_EQ(kvx_layout_preset(presets[i], 7, mla ? 1 : 2, mla ? 1 : 4,
                                   64, KVX_DTYPE_BF16, sg ? 1 : 16, 33, &want),
                 0);
        Kvxfer__Layout m = msg_of(&want);
        memset(&got, 0x5a, sizeof(got));
        char why[256];
        CHECK_EQ(layout_from_msg(&m, &got, KVX_WHY(why)), 0);
        /* every field, and zeros past the preset name and the layers */
        CHECK(!memcmp(&got, &want, sizeof(got)));
        uint64_t size = kvx_layout_span(&want);
        CHECK_EQ(kvx__layout_check(&got, &size, 1, KVX_WHY(why)), 0);
        /* and split per layer and kv: the parts travel */
        kvx_layout_part_t parts[14];
        CHECK_EQ(kvx_layout_split(&want, mla ? 1 : 2, parts, 14), 0);
        m = msg_of(&want);
        CHECK_EQ(layout_from_msg(&m, &got, KVX_WHY(why)), 0);
        CHECK_EQ(got.num_parts, want.num_parts);
        CHECK(!memcmp(got.parts, parts, want.num_parts * sizeof(*parts)));
        CHECK_EQ(got.layer_stride, want.layer_stride);
        layout_msg_free(&got);
    }
}

TEST(layout_missing)
{
    expect_layout_error(NULL, KVX_ERR_INVALID, "register_pool.layout: missing");
}

TEST(layout_part_count_mismatch)
{
    kvx_layout_t l;
    CHECK_EQ(kvx_layout_preset("vllm-nhd", 3, 2, 4, 8, KVX_DTYPE_FP16, 16, 8,
                               &l),
             0);
    kvx_layout_part_t parts[6];
    CHECK_EQ(kvx_layout_split(&l, 1, parts, 6), 0);
    Kvxfer__Layout m = msg_of(&l);
    m.n_part_offset = 5;
    expect_layout_error(&m, KVX_ERR_LAYOUT,
                        "layout.part_region: 6 entries, but "
                        "layout.part_offset has 5");
    m.n_part_region = 5;
    expect_layout_error(&m, KVX_ERR_LAYOUT,
                        "layout.part_region: 5 parts for num_layers 3 x "
                        "kv_factor 2");
    m.n_part_region = m.n_part_offset = 0;
    m.num_layers = 0;
    m.part_region = NULL; /* as protobuf-c decodes an empty list */
    m.part_offset = NULL;
    /* zero layers decode (without touching the absent lists); the layout
     * check refuses them */
    kvx_layout_t out;
    char why[256];
    uint64_t size = 1ull << 30;
    CHECK_EQ(layout_from_msg(&m, &out, KVX_WHY(why)), 0);
    CHECK(out.parts == NULL);
    CHECK_EQ(kvx__layout_check(&out, &size, 1, KVX_WHY(why)), KVX_ERR_LAYOUT);
    CHECK_STR_CONTAINS(why, "num_layers");
    /* more parts than layers can have, even if they agree */
    m = msg_of(&l);
    m.num_layers = KVX_MAX_LAYERS + 1;
    m.n_part_region = m.n_part_offset = 2 * (KVX_MAX_LAYERS + 1);
    expect_layout_error(&m, KVX_ERR_LAYOUT, "(at most 2048)");
    m.num_layers = KVX_MAX_LAYERS;
    m.n_part_region = m.n_part_offset = 2 * KVX_MAX_LAYERS;
    pregion[2 * KVX_MAX_LAYERS - 1] = 4095;
    poffset[2 * KVX_MAX_LAYERS - 1] = 77;
    CHECK_EQ(layout_from_msg(&m, &out, KVX_WHY(why)), 0);
    CHECK_EQ(out.num_parts, 2 * KVX_MAX_LAYERS);
    CHECK_EQ(out.parts[2 * KVX_MAX_LAYERS - 1].region, 4095);
    CHECK_EQ(out.parts[2 * KVX_MAX_LAYERS - 1].offset, 77);
    layout_msg_free(&out);
}

TEST(layout_preset_too_long)
{
    kvx_layout_t l;
    CHECK_EQ(kvx_layout_preset("trtllm", 2, 2, 4, 8, KVX_DTYPE_FP16, 16, 8,
                               &l),
             0);
    Kvxfer__Layout m = msg_of(&l);
    m.preset = "0123456789abcdef"; /* 16 bytes */
    expect_layout_error(&m, KVX_ERR_INVALID,
                        "layout.preset: longer than 15 bytes");
    m.preset = "0123456789abcde"; /* 15: fits with its NUL */
    kvx_layout_t out;
    char why[256];
    CHECK_EQ(layout_from_msg(&m, &out, KVX_WHY(why)), 0);
    CHECK(!strcmp(out.preset, "0123456789abcde"));
    m.preset = "";
    CHECK_EQ(layout_from_msg(&m, &out, KVX_WHY(why)), 0);
    CHECK_EQ(out.preset[0], 0);
}

TEST(layout_unknown_dtype)
{
    kvx_layout_t l;
    CHECK_EQ(kvx_layout_preset("trtllm", 2, 2, 4, 8, KVX_DTYPE_INT8, 16, 8,
                               &l),
             0);
    Kvxfer__Layout m = msg_of(&l);
    char why[256];
    kvx_layout_t out;
    CHECK_EQ(layout_from_msg(&m, &out, KVX_WHY(why)), 0);
    m.dtype = KVX_DTYPE_INT8 + 1;
    expect_layout_error(&m, KVX_ERR_LAYOUT, "layout.dtype: unknown value 6");
    m.dtype = UINT32_MAX;
    expect_layout_error(&m, KVX_ERR_LAYOUT, "layout.dtype: unknown value");
    m.dtype = 0; /* unspecified is allowed */
    CHECK_EQ(layout_from_msg(&m, &out, KVX_WHY(why)), 0);
    CHECK_EQ(out.dtype, KVX_DTYPE_UNSPECIFIED);
}

TEST(layout_decoded_from_the_wire)
{
    /* through protobuf: pack a RegisterPool, unpack, convert */
    kvx_layout_t l;
    CHECK_EQ(kvx_layout_preset("flashinfer", 5, 2, 2, 16, KVX_DTYPE_FP32, 8,
                               12, &l),
             0);
    Kvxfer__Layout m = msg_of(&l);
    Kvxfer__RegisterPool rp = KVXFER__REGISTER_POOL__INIT;
    rp.layout = &m;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_REGISTER_POOL;
    rq.register_pool = &rp;
    uint8_t buf[4096];
    size_t n = kvxfer__request__get_packed_size(&rq);
    CHECK(n <= sizeof(buf));
    kvxfer__request__pack(&rq, buf);
    Kvxfer__Request *got = kvxfer__request__unpack(NULL, n, buf);
    CHECK(got != NULL);
    kvx_layout_t out;
    char why[256];
    CHECK_EQ(layout_from_msg(got->register_pool->layout, &out, KVX_WHY(why)),
             0);
    CHECK(!memcmp(&out, &l, sizeof(l)));
    kvxfer__request__free_unpacked(got, NULL);
}
