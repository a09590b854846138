/*
 * fuzz_request — one Request message as the daemon's protocol edge sees
 * it: protobuf decode, re-encode, and the validators of daemon/local/session.c
 * and session_pool.c (included to reach their statics): layout_from_msg +
 * the pool check for RegisterPool, check_blocks for Publish and Fetch (against a pool whose
 * block count comes from the request id), xfer_params_decode for Fetch.
 * Whatever a validator accepts must really hold.
 *
 */
#include "../../daemon/local/session.c"
#undef FAIL /* session_pool.c has its own */
#include "../../daemon/local/session_pool.c"

#include <stdio.h>

#include "pb_quirk.h"

#define MUST(c)                                                             \
    do {                                                                    \
        if (!(c)) {                                                         \
            fprintf(stderr, "fuzz_request: %s:%d: %s\n", __FILE__,          \
                    __LINE__, #c);                                          \
            abort();                                                        \
        }                                                                   \
    } while (0)

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    conf_defaults(&kvxd.conf);
    return 0;
}

static void refused(int rc, const char *why, size_t why_len)
{
    MUST(rc < 0 && rc >= KVX_ERR_LAST);
    MUST(memchr(why, 0, why_len) != NULL);
    MUST(why[0] != 0);
}


static void on_layout(const Kvxfer__RegisterPool *m)
{
    kvx_layout_t l;
    char why[512];
    int rc = layout_from_msg(m->layout, &l, KVX_WHY(why));
    if (rc) {
        refused(rc, why, sizeof(why));
        return;
    }
    static uint64_t size[KVX_MAX_REGIONS];
    uint32_t n = m->n_regions <= KVX_MAX_REGIONS ? (uint32_t)m->n_regions
                                                 : KVX_MAX_REGIONS + 1;
    for (uint32_t i = 0; i < n && i < KVX_MAX_REGIONS; i++)
        size[i] = m->regions[i]->size;
    rc = kvx__layout_check(&l, size, n, KVX_WHY(why));
    if (rc) {
        MUST(rc == KVX_ERR_LAYOUT);
        refused(rc, why, sizeof(why));
        layout_msg_free(&l);
        return;
    }
    /* accepted: each region's span fits it, and every part's corners
     * are inside its region */
    for (uint32_t r = 0; r < n; r++) {
        uint64_t span = kvx_layout_region_span(&l, r);
        MUST(span > 0 && span <= size[r]);
    }
    uint64_t run = (uint64_t)l.head_dim * l.elem_size;
    for (uint32_t a = 0; a < l.num_layers; a++)
        for (uint32_t k = 0; k < l.kv_factor; k++) {
            uint32_t r = kvx_layout_region(&l, a, k);
            MUST(r < n);
            uint64_t lo = kvx_layout_offset(&l, a, k, 0, 0, 0);
            uint64_t hi =
                kvx_layout_offset(&l, a, k, l.num_blocks - 1,
                                  l.tokens_per_block - 1, l.num_heads - 1);
            MUST(lo + run <= size[r] && hi + run <= size[r]);
        }
    layout_msg_free(&l);
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void on_blocks(uint64_t id, const uint32_t *b, size_t n)
{
    pool_t p;
    memset(&p, 0, sizeof(p));
    p.id = 1;
    p.layout.num_blocks = (uint32_t)id;
    char why[512];
    int rc = check_blocks(&p, b, n, "fuzz", KVX_WHY(why));
    if (rc) {
        refused(rc, why, sizeof(why));
        return;
    }
    /* accepted: non-empty, in range, distinct */
    MUST(n >= 1 && n <= kvxd.conf.max_blocks_per_request);
    uint32_t *s = malloc(n * sizeof(*s));
    MUST(s != NULL);
    memcpy(s, b, n * sizeof(*s));
    qsort(s, n, sizeof(*s), cmp_u32);
    for (size_t i = 0; i < n; i++) {
        MUST(s[i] < p.layout.num_blocks);
        MUST(i == 0 || s[i] != s[i - 1]);
    }
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Kvxfer__Request *rq = kvxfer__request__unpack(NULL, size, data);
    if (!rq)
        return 0;
    /* re-encoding is stable */
    size_t n1 = kvxfer__request__get_packed_size(rq);
    uint8_t *b1 = malloc(n1 ? n1 : 1);
    MUST(b1 != NULL);
    MUST(kvxfer__request__pack(rq, b1) == n1);
    Kvxfer__Request *again = kvxfer__request__unpack(NULL, n1, b1);
    MUST(again != NULL || has_field0(&rq->base));
    if (again) {
        MUST(again->id == rq->id && again->body_case == rq->body_case);
        MUST(kvxfer__request__get_packed_size(again) == n1);
        kvxfer__request__free_unpacked(again, NULL);
    }
    free(b1);

    switch (rq->body_case) {
    case KVXFER__REQUEST__BODY_REGISTER_POOL:
        on_layout(rq->register_pool);
        break;
    case KVXFER__REQUEST__BODY_PUBLISH:
        on_blocks(rq->id, rq->publish->blocks, rq->publish->n_blocks);
        break;
    case KVXFER__REQUEST__BODY_FETCH: {
        const Kvxfer__Fetch *f = rq->fetch;
        on_blocks(rq->id, f->blocks, f->n_blocks);
        Kvxfer__ContextParams *cp = NULL;
        char why[512];
        int rc = xfer_params_decode(f->context_params.data,
                                    f->context_params.len, &cp, KVX_WHY(why));
        if (rc)
            refused(rc, why, sizeof(why));
        else
            kvxfer__context_params__free_unpacked(cp, NULL);
        break;
    }
    default:
        break;
    }
    kvxfer__request__free_unpacked(rq, NULL);
    return 0;
}
