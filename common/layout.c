/* layout — presets, offsets and validation; see layout.h and DESIGN.md. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"

static const struct {
    const char *name;
    kvx_dtype_t dtype;
    unsigned size;
} dtypes[] = {
    {"fp32", KVX_DTYPE_FP32, 4}, {"fp16", KVX_DTYPE_FP16, 2},
    {"bf16", KVX_DTYPE_BF16, 2}, {"fp8", KVX_DTYPE_FP8, 1},
    {"int8", KVX_DTYPE_INT8, 1},
};

int kvx_dtype_parse(const char *name, kvx_dtype_t *out)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (!strcmp(name, dtypes[i].name)) {
            *out = dtypes[i].dtype;
            return 0;
        }
    return KVX_ERR_INVALID;
}

const char *kvx_dtype_name(kvx_dtype_t dtype)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (dtypes[i].dtype == dtype)
            return dtypes[i].name;
    return "unspecified";
}

unsigned kvx_dtype_size(kvx_dtype_t dtype)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (dtypes[i].dtype == dtype)
            return dtypes[i].size;
    return 0;
}

int kvx_layout_preset(const char *preset, uint32_t L, uint32_t K, uint32_t H,
                      uint32_t D, kvx_dtype_t dtype, uint32_t T, uint32_t B,
                      kvx_layout_t *out)
{
    uint64_t E = kvx_dtype_size(dtype);
    if (!preset || !E || !L || L > KVX_MAX_LAYERS || !K || K > 2 || !H ||
        !D || !T || !B || strlen(preset) >= sizeof(out->preset))
        return KVX_ERR_INVALID;
    kvx_layout_t l;
    memset(&l, 0, sizeof(l));
    strcpy(l.preset, preset);
    l.num_layers = L;
    l.kv_factor = K;
    l.num_heads = H;
    l.head_dim = D;
    l.elem_size = (uint32_t)E;
    l.dtype = dtype;
    l.tokens_per_block = T;
    l.num_blocks = B;
    uint64_t layer_size;
    uint64_t hd = (uint64_t)D * E;
    if (!strcmp(preset, "trtllm")) {
        /* one pool, [block][layer][kv][head][token][dim] */
        l.token_stride = hd;
        l.head_stride = T * hd;
        l.kv_stride = H * l.head_stride;
        layer_size = K * l.kv_stride;
        l.block_stride = L * layer_size;
    } else if (!strcmp(preset, "vllm-nhd")) {
        /* per layer [kv][block][token][head][dim] */
        l.head_stride = hd;
        l.token_stride = H * hd;
        l.block_stride = T * l.token_stride;
        l.kv_stride = B * l.block_stride;
        layer_size = K * l.kv_stride;
    } else if (!strcmp(preset, "vllm-hnd")) {
        /* per layer [kv][block][head][token][dim] */
        l.token_stride = hd;
        l.head_stride = T * hd;
        l.block_stride = H * l.head_stride;
        l.kv_stride = B * l.block_stride;
        layer_size = K * l.kv_stride;
    } else if (!strcmp(preset, "flashinfer")) {
        /* per layer [block][kv][token][head][dim] */
        l.head_stride = hd;
        l.token_stride = H * hd;
        l.kv_stride = T * l.token_stride;
        l.block_stride = K * l.kv_stride;
        layer_size = B * l.block_stride;
    } else if (!strcmp(preset, "sglang")) {
        /* per layer a K buffer then a V buffer, [token][head][dim] */
        if (T != 1)
            return KVX_ERR_INVALID;
        l.head_stride = hd;
        l.token_stride = H * hd;
        l.block_stride = H * hd;
        l.kv_stride = B * l.block_stride;
        layer_size = K * l.kv_stride;
    } else if (!strcmp(preset, "mla")) {
        /* per layer [block][token][latent] */
        if (K != 1 || H != 1)
            return KVX_ERR_INVALID;
        l.head_stride = hd;
        l.token_stride = hd;
        l.block_stride = T * hd;
        l.kv_stride = B * l.block_stride;
        layer_size = l.kv_stride;
    } else {
        return KVX_ERR_INVALID;
    }
    for (uint32_t i = 0; i < L; i++)
            l.layer_offset[i] = i * layer_size;
    *out = l;
    return 0;
}

uint64_t kvx_layout_offset(const kvx_layout_t *l, uint32_t layer, uint32_t kv,
                           uint32_t block, uint32_t token, uint32_t head)
{
    return l->layer_offset[layer] + kv * l->kv_stride +
           (uint64_t)block * l->block_stride + token * l->token_stride +
           head * l->head_stride;
}

/* One dimension of the element grid, for the overlap check. */
struct dim {
    uint64_t count, stride;
};

static int dim_cmp(const void *a, const void *b)
{
    const struct dim *x = a, *y = b;
    return x->stride < y->stride ? -1 : x->stride > y->stride;
}

/* Bytes spanned by one layer's elements (from its layer_offset), or 0 on
 * overflow. */
static uint64_t layer_span(const kvx_layout_t *l)
{
    uint64_t s = (uint64_t)l->head_dim * l->elem_size, t;
    const struct dim d[] = {{l->kv_factor, l->kv_stride},
                            {l->num_blocks, l->block_stride},
                            {l->tokens_per_block, l->token_stride},
                            {l->num_heads, l->head_stride}};
    for (int i = 0; i < 4; i++) {
        if (__builtin_mul_overflow(d[i].count - 1, d[i].stride, &t) ||
            __builtin_add_overflow(s, t, &s))
            return 0;
    }
    return s;
}

uint64_t kvx_layout_span(const kvx_layout_t *l)
{
    uint64_t ls = layer_span(l), end = 0, e;
    if (!ls)
        return 0;
    for (uint32_t i = 0; i < l->num_layers && i < KVX_MAX_LAYERS; i++) {
        if (__builtin_add_overflow(l->layer_offset[i], ls, &e))
            return 0;
        if (e > end)
            end = e;
    }
    return end;
}

struct region {
    uint64_t start, end;
};

static int region_cmp(const void *a, const void *b)
{
    const struct region *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

#define WHY(...)                                                            \
    do {                                                                    \
        snprintf(why, why_len, __VA_ARGS__);                                \
        return KVX_ERR_LAYOUT;                                              \
    } while (0)

int kvx__layout_check(const kvx_layout_t *l, uint64_t pool_size, char *why,
                      size_t why_len)
{
    if (l->num_layers < 1 || l->num_layers > KVX_MAX_LAYERS)
        WHY("layout.num_layers: %u out of range (expected 1..%u)",
            l->num_layers, KVX_MAX_LAYERS);
    if (l->kv_factor < 1 || l->kv_factor > 2)
        WHY("layout.kv_factor: %u out of range (expected 1 or 2)",
            l->kv_factor);
    if (l->num_heads < 1 || l->num_heads > 4096)
        WHY("layout.num_heads: %u out of range (expected 1..4096)",
            l->num_heads);
    if (l->head_dim < 1 || l->head_dim > 65536)
        WHY("layout.head_dim: %u out of range (expected 1..65536)",
            l->head_dim);
    if (l->elem_size != 1 && l->elem_size != 2 && l->elem_size != 4 &&
        l->elem_size != 8)
        WHY("layout.elem_size: %u invalid (expected 1, 2, 4 or 8)",
            l->elem_size);
    if (l->dtype != KVX_DTYPE_UNSPECIFIED &&
        kvx_dtype_size(l->dtype) != l->elem_size)
        WHY("layout.elem_size: %u does not match dtype %s (%u bytes)",
            l->elem_size, kvx_dtype_name(l->dtype), kvx_dtype_size(l->dtype));
    if ((unsigned)l->dtype > KVX_DTYPE_INT8)
        WHY("layout.dtype: unknown value %u", (unsigned)l->dtype);
    if (l->tokens_per_block < 1 || l->tokens_per_block > 65536)
        WHY("layout.tokens_per_block: %u out of range (expected 1..65536)",
            l->tokens_per_block);
    if (l->num_blocks < 1)
        WHY("layout.num_blocks: 0 (expected at least 1)");

    uint64_t ls = layer_span(l);
    if (!ls)
        WHY("layout: size overflows 64 bits");
    for (uint32_t i = 0; i < l->num_layers; i++) {
        uint64_t e;
        if (__builtin_add_overflow(l->layer_offset[i], ls, &e))
            WHY("layout.layer_offset[%u]: %llu overflows", i,
                (unsigned long long)l->layer_offset[i]);
        if (e > pool_size)
            WHY("layout: layer %u ends at byte %llu, past the pool size "
                "%llu",
                i, (unsigned long long)e, (unsigned long long)pool_size);
    }

    /* No two elements may alias. With the dimensions sorted by stride,
     * each stride must clear everything the smaller ones span. Layers
     * are a dimension too when their offsets are evenly spaced (the
     * block-major trtllm preset interleaves them inside blocks);
     * otherwise their regions must be disjoint. */
    uint64_t lstride = l->num_layers > 1
                           ? l->layer_offset[1] - l->layer_offset[0]
                           : 0;
    int even = l->num_layers > 1 && l->layer_offset[1] > l->layer_offset[0];
    for (uint32_t i = 2; even && i < l->num_layers; i++)
        even = l->layer_offset[i] - l->layer_offset[i - 1] == lstride &&
               l->layer_offset[i] > l->layer_offset[i - 1];
    struct dim d[6] = {{l->head_dim, l->elem_size},
                       {l->num_heads, l->head_stride},
                       {l->tokens_per_block, l->token_stride},
                       {l->num_blocks, l->block_stride},
                       {l->kv_factor, l->kv_stride},
                       {even ? l->num_layers : 1, lstride}};
    static const char *const dname[] = {"elem_size", "head_stride",
                                        "token_stride", "block_stride",
                                        "kv_stride"};
    for (int i = 1; i < 5; i++)
        if (d[i].count > 1 && d[i].stride == 0)
            WHY("layout.%s: 0 with %llu elements along it", dname[i],
                (unsigned long long)d[i].count);
    qsort(d, 6, sizeof(d[0]), dim_cmp);
    uint64_t extent = l->elem_size; /* bytes one element covers */
    for (int i = 0; i < 6; i++) {
        if (d[i].count <= 1)
            continue;
        if (d[i].stride < extent)
            WHY("layout: strides make elements overlap (a stride of %llu "
                "is inside the %llu bytes the smaller dimensions span)",
                (unsigned long long)d[i].stride,
                (unsigned long long)extent);
        extent += (d[i].count - 1) * d[i].stride; /* no overflow: span ok */
    }
    if (even || l->num_layers == 1)
        return 0;

    struct region *r = malloc(l->num_layers * sizeof(*r));
    if (!r)
        WHY("layout: out of memory");
    for (uint32_t i = 0; i < l->num_layers; i++) {
        r[i].start = l->layer_offset[i];
        r[i].end = r[i].start + ls;
    }
    qsort(r, l->num_layers, sizeof(*r), region_cmp);
    for (uint32_t i = 1; i < l->num_layers; i++)
        if (r[i].start < r[i - 1].end) {
            unsigned long long at = r[i].start;
            free(r);
            WHY("layout.layer_offset: layers overlap at byte %llu", at);
        }
    free(r);
    return 0;
}
