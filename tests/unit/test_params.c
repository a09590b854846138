/*
 * test_params — xfer_params_decode, the decoder of the context params a
 * router hands from the context side to the generation side: size caps,
 * undecodable bytes, each invalid field, the accepted shape, and a few
 * thousand random and mutated inputs.
 */
#include "../../daemon/xfer/xfer.c"

#include "tests/test.h"

#include <stdint.h>

/* The key of request n (its digits), as the uint64_t API makes it. */
static const reqkey_t *K(uint64_t n)
{
    static reqkey_t k[8];
    static unsigned i;
    reqkey_t *r = &k[i++ & 7];
    reqkey_from_u64(r, n);
    return r;
}

/* ---- helpers ---- */

static uint64_t rng_state = 0xbe5466cf34e90c6cull;

static uint32_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static uint8_t token16[16] = {1, 2,  3,  4,  5,  6,  7,  8,
                              9, 10, 11, 12, 13, 14, 15, 16};
static char *addr_list[KVX_MAX_RANKS + 1];
static uint32_t lpp[2] = {3, 5};

/* Parts of a valid ContextParams, to break one at a time. */
typedef struct parts {
    Kvxfer__ContextParams cp;
    Kvxfer__ParallelConfig pc;
    Kvxfer__Layout lay;
} parts_t;

static void parts_init(parts_t *p)
{
    static char a0[] = "unix:/run/kvxfer/kvxferd.sock#host-a";
    static char a1[] = "unix:/run/kvxfer/kvxferd.sock#host-b";
    Kvxfer__ContextParams cp = KVXFER__CONTEXT_PARAMS__INIT;
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    Kvxfer__Layout lay = KVXFER__LAYOUT__INIT;
    p->cp = cp;
    p->pc = pc;
    p->lay = lay;
    for (int i = 0; i <= (int)KVX_MAX_RANKS; i++)
        addr_list[i] = i % 2 ? a1 : a0;
    p->cp.version = PARAMS_VERSION;
    p->cp.instance_id = "ctx-0";
    p->cp.key.data = (uint8_t *)"cmpl-1122334455667788-0";
    p->cp.key.len = 23;
    p->cp.token.data = token16;
    p->cp.token.len = 16;
    p->pc.tp = 2;
    p->pc.pp = 2;
    p->pc.cp = 1;
    p->pc.total_layers = 8;
    p->pc.total_kv_heads = 8;
    p->pc.n_layers_per_pp = 2;
    p->pc.layers_per_pp = lpp;
    p->cp.parallel = &p->pc;
    p->lay.preset = "vllm-nhd";
    p->lay.kv_factor = 2;
    p->lay.head_dim = 128;
    p->lay.elem_size = 2;
    p->lay.dtype = KVX_DTYPE_BF16;
    p->lay.tokens_per_block = 16;
    p->cp.layout = &p->lay;
    p->cp.n_rank_addresses = 4;
    p->cp.rank_addresses = addr_list;
    p->cp.num_tokens = 1000;
}

/* Pack; the caller frees. */
static uint8_t *pack(const parts_t *p, size_t *len)
{
    *len = kvxfer__context_params__get_packed_size(&p->cp);
    uint8_t *b = malloc(*len ? *len : 1);
    CHECK(b != NULL);
    CHECK_EQ(kvxfer__context_params__pack(&p->cp, b), *len);
    return b;
}

static int decode(const uint8_t *b, size_t len, Kvxfer__ContextParams **out,
                  char *why)
{
    why[0] = 0;
    return xfer_params_decode(b, len, out, &(kvx_why_t){why, 256});
}

static void expect_refused(const uint8_t *b, size_t len, const char *needle)
{
    Kvxfer__ContextParams *out = (Kvxfer__ContextParams *)0x1;
    char why[256];
    int rc = decode(b, len, &out, why);
    if (rc != KVX_ERR_INVALID || !strstr(why, needle))
        fprintf(stderr, "rc %d why '%s' (wanted '%s')\n", rc, why, needle);
    CHECK_EQ(rc, KVX_ERR_INVALID);
    CHECK(out == (Kvxfer__ContextParams *)0x1); /* untouched */
    CHECK_STR_CONTAINS(why, "fetch.context_params");
    CHECK_STR_CONTAINS(why, needle);
}

static void expect_parts_refused(const parts_t *p, const char *needle)
{
    size_t len;
    uint8_t *b = pack(p, &len);
    expect_refused(b, len, needle);
    free(b);
}

/* ---- the accepted shape ---- */

TEST(valid_params_decode)
{
    parts_t p;
    parts_init(&p);
    size_t len;
    uint8_t *b = pack(&p, &len);
    Kvxfer__ContextParams *out = NULL;
    char why[256];
    CHECK_EQ(decode(b, len, &out, why), 0);
    CHECK(out != NULL);
    CHECK_EQ(out->version, PARAMS_VERSION);
    CHECK(!strcmp(out->instance_id, "ctx-0"));
    CHECK_EQ(out->key.len, 23);
    CHECK(!memcmp(out->key.data, "cmpl-1122334455667788-0", 23));
    CHECK_EQ(out->token.len, 16);
    CHECK(!memcmp(out->token.data, token16, 16));
    CHECK(out->parallel && out->layout);
    CHECK_EQ(out->parallel->tp, 2);
    CHECK_EQ(out->parallel->n_layers_per_pp, 2);
    CHECK_EQ(out->parallel->layers_per_pp[1], 5);
    CHECK(!strcmp(out->layout->preset, "vllm-nhd"));
    CHECK_EQ(out->layout->head_dim, 128);
    CHECK_EQ(out->n_rank_addresses, 4);
    CHECK(!strcmp(out->rank_addresses[3], addr_list[3]));
    CHECK_EQ(out->num_tokens, 1000);
    kvxfer__context_params__free_unpacked(out, NULL);
    free(b);
}

TEST(limits_are_inclusive)
{
    parts_t p;
    parts_init(&p);
    char id[INSTANCE_ID_MAX + 2];
    memset(id, 'i', sizeof(id));
    id[INSTANCE_ID_MAX] = 0; /* 128 bytes: the longest id */
    p.cp.instance_id = id;
    p.cp.n_rank_addresses = KVX_MAX_RANKS; /* the most ranks */
    p.cp.num_tokens = UINT32_MAX;
    size_t len;
    uint8_t *b = pack(&p, &len);
    Kvxfer__ContextParams *out = NULL;
    char why[256];
    CHECK_EQ(decode(b, len, &out, why), 0);
    CHECK_EQ(out->n_rank_addresses, KVX_MAX_RANKS);
    CHECK_EQ(strlen(out->instance_id), INSTANCE_ID_MAX);
    kvxfer__context_params__free_unpacked(out, NULL);
    free(b);
    p.cp.n_rank_addresses = 1; /* the fewest */
    b = pack(&p, &len);
    CHECK_EQ(decode(b, len, &out, why), 0);
    kvxfer__context_params__free_unpacked(out, NULL);
    free(b);
}

TEST(size_cap_is_exact)
{
    /* grow one rank address until the packed size is exactly the cap,
     * then one byte over */
    parts_t p;
    parts_init(&p);
    p.cp.n_rank_addresses = 1;
    char *big = malloc(PARAMS_MAX + 16);
    CHECK(big);
    char *one[1] = {big};
    p.cp.rank_addresses = one;
    size_t n = 1000, len = 0;
    for (int i = 0; i < 2; i++) {
        memset(big, 'a', n);
        big[n] = 0;
        len = kvxfer__context_params__get_packed_size(&p.cp);
        n += PARAMS_MAX - len; /* the length prefix is stable here */
    }
    memset(big, 'a', n);
    big[n] = 0;
    uint8_t *b = pack(&p, &len);
    CHECK_EQ(len, PARAMS_MAX);
    Kvxfer__ContextParams *out = NULL;
    char why[256];
    CHECK_EQ(decode(b, len, &out, why), 0);
    kvxfer__context_params__free_unpacked(out, NULL);
    free(b);
    big[n] = 'a';
    big[n + 1] = 0;
    b = pack(&p, &len);
    CHECK_EQ(len, PARAMS_MAX + 1);
    expect_refused(b, len, "65537 bytes (expected 1..65536)");
    free(b);
    free(big);
}

/* ---- refusals ---- */

TEST(empty_is_refused)
{
    uint8_t b[1] = {0};
    expect_refused(b, 0, "0 bytes");
    expect_refused(NULL, 0, "0 bytes");
}

TEST(oversized_is_refused_unread)
{
    /* the cap is checked before a byte is read: a short buffer with a
     * huge length must not be touched (ASan would see it) */
    uint8_t *b = malloc(16);
    CHECK(b);
    memset(b, 0, 16);
    expect_refused(b, (size_t)PARAMS_MAX + 1, "bytes (expected 1..65536)");
    expect_refused(b, SIZE_MAX, "bytes");
    free(b);
}

TEST(garbage_is_refused)
{
    static const uint8_t g1[] = {0xff, 0xff, 0xff, 0xff};
    expect_refused(g1, sizeof(g1), "not a ContextParams message");
    /* a length-delimited field running past the end */
    static const uint8_t g2[] = {0x12, 0x7f, 'a', 'b'};
    expect_refused(g2, sizeof(g2), "not a ContextParams message");
    /* a varint that never ends */
    static const uint8_t g3[] = {0x08, 0x80, 0x80, 0x80, 0x80, 0x80,
                                 0x80, 0x80, 0x80, 0x80, 0x80, 0x80};
    expect_refused(g3, sizeof(g3), "not a ContextParams message");
    /* a string field that is not UTF-8 */
    static const uint8_t g4[] = {0x08, 0x01, 0x12, 0x02, 0xc3, 0x28};
    expect_refused(g4, sizeof(g4), "fetch.context_params");
    /* a valid message of another type decodes as unknown fields, and is
     * then refused for its missing fields */
    static const uint8_t g5[] = {0x08, 0x07};
    expect_refused(g5, sizeof(g5), "invalid version");
    /* text */
    const char *t = "{\"version\": 1, \"token\": \"...\"}";
    Kvxfer__ContextParams *out = (Kvxfer__ContextParams *)0x1;
    char why[256];
    CHECK_EQ(decode((const uint8_t *)t, strlen(t), &out, why), KVX_ERR_INVALID);
    CHECK(out == (Kvxfer__ContextParams *)0x1);
}

TEST(wrong_version_is_refused)
{
    parts_t p;
    parts_init(&p);
    p.cp.version = 1; /* 1.x: named by uint64 ids */
    expect_parts_refused(&p, "invalid version");
    p.cp.version = 0;
    expect_parts_refused(&p, "invalid version");
}

TEST(instance_id_is_checked)
{
    parts_t p;
    parts_init(&p);
    p.cp.instance_id = "";
    expect_parts_refused(&p, "invalid instance_id");
    char id[INSTANCE_ID_MAX + 2];
    memset(id, 'x', sizeof(id));
    id[INSTANCE_ID_MAX + 1] = 0; /* 129 bytes */
    p.cp.instance_id = id;
    expect_parts_refused(&p, "invalid instance_id");
}

TEST(token_is_checked)
{
    parts_t p;
    parts_init(&p);
    p.cp.token.len = 0;
    p.cp.token.data = NULL;
    expect_parts_refused(&p, "invalid token");
    p.cp.token.data = token16;
    p.cp.token.len = 15;
    expect_parts_refused(&p, "invalid token");
    uint8_t t17[17] = {0};
    p.cp.token.data = t17;
    p.cp.token.len = 17;
    expect_parts_refused(&p, "invalid token");
}

TEST(parallel_and_layout_must_be_present)
{
    parts_t p;
    parts_init(&p);
    p.cp.parallel = NULL;
    expect_parts_refused(&p, "parallel or layout missing");
    parts_init(&p);
    p.cp.layout = NULL;
    expect_parts_refused(&p, "parallel or layout missing");
}

TEST(rank_addresses_are_checked)
{
    parts_t p;
    parts_init(&p);
    p.cp.n_rank_addresses = 0;
    expect_parts_refused(&p, "invalid rank_addresses");
    p.cp.n_rank_addresses = KVX_MAX_RANKS + 1;
    expect_parts_refused(&p, "invalid rank_addresses");
}

TEST(zero_tokens_is_refused)
{
    parts_t p;
    parts_init(&p);
    p.cp.num_tokens = 0;
    expect_parts_refused(&p, "invalid num_tokens");
}

TEST(small_why_buffer)
{
    /* a one-byte message buffer still gets a terminated (empty) string */
    uint8_t g[2] = {0xff, 0xff};
    char why[4] = {'x', 'x', 'x', 'x'};
    Kvxfer__ContextParams *out = NULL;
    CHECK_EQ(xfer_params_decode(g, sizeof(g), &out, &(kvx_why_t){why, 1}),
             KVX_ERR_INVALID);
    CHECK_EQ(why[0], 0);
    CHECK_EQ(why[1], 'x');
}

/* ---- a few thousand random and mutated inputs ---- */

static void mutate(uint8_t *b, size_t *len, size_t max)
{
    int k = 1 + (int)(rnd() % 6);
    for (int i = 0; i < k; i++) {
        switch (rnd() % 6) {
        case 0:
            if (*len)
                b[rnd() % *len] ^= (uint8_t)(1u << (rnd() % 8));
            break;
        case 1:
            if (*len)
                b[rnd() % *len] = (uint8_t)rnd();
            break;
        case 2:
            *len = rnd() % (*len + 1);
            break;
        case 3:
            if (*len)
                b[rnd() % *len] =
                    (uint8_t[]){0x00, 0x01, 0x7f, 0x80, 0xff, 0x10}[rnd() % 6];
            break;
        case 4: /* duplicate a slice onto the end (repeated fields) */
            if (*len) {
                size_t a = rnd() % *len, n = 1 + rnd() % (*len - a);
                if (*len + n <= max) {
                    memmove(b + *len, b + a, n);
                    *len += n;
                }
            }
            break;
        default:
            while (*len < max && rnd() % 4)
                b[(*len)++] = (uint8_t)rnd();
            break;
        }
    }
}

TEST_T(random_and_mutated_inputs, 120)
{
    parts_t p;
    parts_init(&p);
    size_t vlen;
    uint8_t *valid = pack(&p, &vlen);
    uint32_t ok = 0, refused = 0;
    for (int iter = 0; iter < 6000; iter++) {
        uint8_t buf[2048];
        size_t len;
        if (iter % 5 == 0) {
            len = rnd() % 300;
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rnd();
        } else {
            CHECK(vlen <= sizeof(buf));
            memcpy(buf, valid, vlen);
            len = vlen;
            if (iter % 5 != 1)
                mutate(buf, &len, sizeof(buf));
        }
        Kvxfer__ContextParams *out = NULL;
        char why[256];
        int rc = decode(buf, len, &out, why);
        if (rc == 0) {
            /* whatever is accepted has every property fetch relies on */
            ok++;
            CHECK(out != NULL);
            CHECK_EQ(out->version, PARAMS_VERSION);
            CHECK(out->instance_id[0] != 0);
            CHECK(strlen(out->instance_id) <= INSTANCE_ID_MAX);
            CHECK_EQ(out->token.len, TOKEN_LEN);
            CHECK(out->parallel != NULL && out->layout != NULL);
            CHECK(out->n_rank_addresses >= 1 &&
                  out->n_rank_addresses <= KVX_MAX_RANKS);
            for (size_t i = 0; i < out->n_rank_addresses; i++)
                CHECK(out->rank_addresses[i] != NULL);
            CHECK(out->num_tokens > 0);
            kvxfer__context_params__free_unpacked(out, NULL);
        } else {
            refused++;
            CHECK_EQ(rc, KVX_ERR_INVALID);
            CHECK(out == NULL);
            CHECK_STR_CONTAINS(why, "fetch.context_params");
        }
    }
    free(valid);
    CHECK(ok > 500);
    CHECK(refused > 500);
}

/* ---- the params' producer: publish must refuse what it cannot hold ---- */

static instance_t *ctx_instance(void)
{
    conf_defaults(&kvxd.conf);
    kvxd.conf.copy_busy_poll = 0; /* no loop here to poll on */
    plan_side_t s;
    memset(&s, 0, sizeof(s));
    s.tp = s.pp = s.cp = 1;
    s.total_layers = 2;
    s.total_heads = 2;
    instance_t *inst = NULL;
    char why[256];
    CHECK_EQ(instance_attach(
                 &(instance_hello_t){"ctx", 0, KVX_ROLE_CONTEXT, 0, &s, 1},
                 &inst, KVX_WHY(why)),
             0);
    CHECK(inst != NULL);
    snprintf(kvxd.address, sizeof(kvxd.address), "unix:/tmp/kvx-test#1");
    char *addrs[1] = {kvxd.address};
    CHECK_EQ(instance_join(inst, 0, addrs, 1, KVX_WHY(why)), 0);
    CHECK_EQ(instance_ready(inst, KVX_WHY(why)), 0);
    return inst;
}

static pool_t *host_pool(uint32_t tpb, uint32_t nblocks)
{
    pool_t *p = calloc(1, sizeof(*p));
    CHECK(p);
    CHECK_EQ(kvx_layout_preset("vllm-nhd", 2, 2, 2, 4, KVX_DTYPE_FP16, tpb,
                               nblocks, &p->layout),
             0);
    p->size = kvx_layout_span(&p->layout);
    p->nregions = 1;
    p->view = calloc(1, sizeof(*p->view));
    CHECK(p->view);
    p->view[0] = (plan_region_t){calloc(1, p->size), p->size};
    CHECK(p->view[0].base);
    p->id = 1;
    p->users = 1;
    return p;
}

TEST(publish_checks_the_block_count)
{
    instance_t *inst = ctx_instance();
    pool_t *pool = host_pool(16, 8);
    uint32_t blocks[3] = {5, 0, 7};
    uint8_t *params = NULL;
    size_t plen = 0;
    char why[256] = "";
    /* 33 tokens of 16 per block need 3 blocks */
    CHECK_EQ(xfer_publish(&(xfer_publish_req_t){inst, 0, K(7), pool, blocks, 2,
                                                33, NULL, 0, NULL, 0, 0, 0},
                          &params, &plen, KVX_WHY(why)),
             KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "need 3");
    CHECK_EQ(xfer_publish(&(xfer_publish_req_t){inst, 0, K(7), pool, blocks, 3,
                                                33, NULL, 0, NULL, 0, 0, 0},
                          &params, &plen, KVX_WHY(why)),
             0);
    /* the params it returns decode */
    Kvxfer__ContextParams *cp = NULL;
    CHECK_EQ(xfer_params_decode(params, plen, &cp, KVX_WHY(why)), 0);
    CHECK_EQ(cp->num_tokens, 33);
    CHECK_EQ(reqkey_to_u64(cp->key.data, cp->key.len), 7);
    CHECK(!strcmp(cp->instance_id, "ctx"));
    kvxfer__context_params__free_unpacked(cp, NULL);
    free(params);
}

TEST(publish_refuses_a_token_count_whose_block_count_wraps)
{
    /* ceil(num_tokens / tokens_per_block) computed in 32 bits wraps to 0
     * for num_tokens > 2^32 - tokens_per_block: one block would then be
     * taken to hold 4 billion tokens, and the fetch's plan would be built
     * for them */
    instance_t *inst = ctx_instance();
    pool_t *pool = host_pool(16, 8);
    uint32_t blocks[1] = {0};
    uint8_t *params = NULL;
    size_t plen = 0;
    char why[256] = "";
    int rc =
        xfer_publish(&(xfer_publish_req_t){inst, 0, K(9), pool, blocks, 1,
                                           UINT32_MAX, NULL, 0, NULL, 0, 0, 0},
                     &params, &plen, KVX_WHY(why));
    if (rc == 0)
        free(params);
    CHECK_EQ(rc, KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "publish.blocks");
    free(pool->view[0].base); /* refused: nothing references the pool */
    free(pool->view);
    free(pool);
}

/* ---- the aux payload: the first non-empty one is the request's ---- */

/* Context instance "ctx2" of tp 2 (one head a rank), both ranks here. */
static instance_t *ctx2_instance(void)
{
    conf_defaults(&kvxd.conf);
    kvxd.conf.copy_busy_poll = 0; /* no loop here to poll on */
    plan_side_t s;
    memset(&s, 0, sizeof(s));
    s.tp = 2;
    s.pp = s.cp = 1;
    s.total_layers = 2;
    s.total_heads = 2;
    instance_t *inst = NULL;
    char why[256];
    for (uint32_t r = 0; r < 2; r++)
        CHECK_EQ(
            instance_attach(
                &(instance_hello_t){"ctx2", 0, KVX_ROLE_CONTEXT, r, &s, 1 + r},
                &inst, KVX_WHY(why)),
            0);
    snprintf(kvxd.address, sizeof(kvxd.address), "unix:/tmp/kvx-test#1");
    char *addrs[2] = {kvxd.address, kvxd.address};
    CHECK_EQ(instance_join(inst, 0, addrs, 2, KVX_WHY(why)), 0);
    CHECK_EQ(instance_ready(inst, KVX_WHY(why)), 0);
    return inst;
}

static pool_t *host_pool_1head(void)
{
    pool_t *p = calloc(1, sizeof(*p));
    CHECK(p);
    CHECK_EQ(kvx_layout_preset("vllm-nhd", 2, 2, 1, 4, KVX_DTYPE_FP16, 16, 8,
                               &p->layout),
             0);
    p->size = kvx_layout_span(&p->layout);
    p->nregions = 1;
    p->view = calloc(1, sizeof(*p->view));
    CHECK(p->view);
    p->view[0] = (plan_region_t){calloc(1, p->size), p->size};
    CHECK(p->view[0].base);
    p->id = 1;
    p->users = 1;
    return p;
}

TEST(publish_keeps_the_first_aux_and_refuses_another)
{
    instance_t *inst = ctx2_instance();
    pool_t *pool = host_pool_1head();
    uint32_t blocks[2] = {0, 1};
    uint8_t *params = NULL;
    size_t plen = 0;
    char why[256] = "";
    /* rank 0 without aux, rank 1 with: the offer takes rank 1's */
    CHECK_EQ(xfer_publish(&(xfer_publish_req_t){inst, 0, K(3), pool, blocks, 2,
                                                20, NULL, 0, NULL, 0, 0, 0},
                          &params, &plen, KVX_WHY(why)),
             0);
    free(params);
    offer_t *o = map_get(&inst->offers, xfer_key_id(K(3)->b, K(3)->len));
    CHECK(o && o->aux_len == 0 && o->aux == NULL);
    CHECK_EQ(kvxd_mem_used(MEM_AUX), 0);
    CHECK_EQ(xfer_publish(
                 &(xfer_publish_req_t){inst, 1, K(3), pool, blocks, 2, 20, NULL,
                                       0, (const uint8_t *)"tok", 3, 0, 0},
                 &params, &plen, KVX_WHY(why)),
             0);
    free(params);
    CHECK_EQ(o->aux_len, 3);
    CHECK(!memcmp(o->aux, "tok", 3));
    CHECK_EQ(kvxd_mem_used(MEM_AUX), 3); /* charged to the budget */

    /* another key: rank 0's aux first; rank 1's differs: refused, and
     * nothing of rank 1 is kept (it may publish again) */
    uint64_t req0 = kvxd_mem_used(MEM_REQUESTS);
    CHECK_EQ(xfer_publish(
                 &(xfer_publish_req_t){inst, 0, K(4), pool, blocks, 2, 20, NULL,
                                       0, (const uint8_t *)"abc", 3, 0, 0},
                 &params, &plen, KVX_WHY(why)),
             0);
    free(params);
    /* what a new offer and one rank's tables are charged (MEM_REQUESTS) */
    uint64_t one = kvxd_mem_used(MEM_REQUESTS) - req0;
    CHECK(one > 0);
    CHECK_EQ(xfer_publish(
                 &(xfer_publish_req_t){inst, 1, K(4), pool, blocks, 2, 20, NULL,
                                       0, (const uint8_t *)"abd", 3, 0, 0},
                 &params, &plen, KVX_WHY(why)),
             KVX_ERR_MISMATCH);
    CHECK_STR_CONTAINS(why, "publish.aux");
    CHECK_EQ(xfer_publish(
                 &(xfer_publish_req_t){inst, 1, K(4), pool, blocks, 2, 20, NULL,
                                       0, (const uint8_t *)"abcd", 4, 0, 0},
                 &params, &plen, KVX_WHY(why)),
             KVX_ERR_MISMATCH);
    o = map_get(&inst->offers, xfer_key_id(K(4)->b, K(4)->len));
    CHECK(o && !o->parts[1].published && o->npublished == 1);
    CHECK(o->aux_len == 3 && !memcmp(o->aux, "abc", 3));
    /* the same bytes: fine */
    CHECK_EQ(xfer_publish(
                 &(xfer_publish_req_t){inst, 1, K(4), pool, blocks, 2, 20, NULL,
                                       0, (const uint8_t *)"abc", 3, 0, 0},
                 &params, &plen, KVX_WHY(why)),
             0);
    free(params);
    CHECK_EQ(kvxd_mem_used(MEM_AUX), 6);

    /* a new offer whose aux passes the memory budget (the offer itself
     * fits; the uid's share is the whole budget): refused with LIMIT,
     * and no offer is left behind */
    kvxd.conf.memory_bytes = kvxd_mem_used(MEM_KINDS) + one + 10;
    kvxd.conf.uid_memory_bytes = kvxd.conf.memory_bytes;
    uint64_t held = kvxd_mem_used(MEM_REQUESTS);
    static const uint8_t big[64] = {1}; /* more than the offer leaves */
    CHECK_EQ(
        xfer_publish(&(xfer_publish_req_t){inst, 0, K(5), pool, blocks, 2, 20,
                                           NULL, 0, big, sizeof(big), 0, 0},
                     &params, &plen, KVX_WHY(why)),
        KVX_ERR_LIMIT);
    CHECK_STR_CONTAINS(why, "publish.aux");
    CHECK_STR_CONTAINS(why, "limits.memory_bytes");
    CHECK(!map_get(&inst->offers, xfer_key_id(K(5)->b, K(5)->len)));
    CHECK_EQ(kvxd_mem_used(MEM_REQUESTS), held);
    CHECK_EQ(kvxd_mem_used(MEM_AUX), 6);

    /* ending the offers gives their aux back */
    xfer_end_instance(inst, KVX_ERR_CANCELLED, "test");
    CHECK_EQ(kvxd_mem_used(MEM_AUX), 0);
    free(pool->view[0].base); /* ended: nothing references the pool */
    free(pool->view);
    free(pool);
}
