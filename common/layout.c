/* layout — presets, offsets and validation; see layout.h and docs/design.md. */
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
    uint64_t hd = (uint64_t)D * E;
    if (!strcmp(preset, "trtllm")) {
        /* one pool, [block][layer][kv][head][token][dim] */
        l.token_stride = hd;
        l.head_stride = T * hd;
        l.kv_stride = H * l.head_stride;
        l.layer_stride = K * l.kv_stride;
        l.block_stride = L * l.layer_stride;
    } else if (!strcmp(preset, "vllm-nhd")) {
        /* per layer [kv][block][token][head][dim] */
        l.head_stride = hd;
        l.token_stride = H * hd;
        l.block_stride = T * l.token_stride;
        l.kv_stride = B * l.block_stride;
        l.layer_stride = K * l.kv_stride;
    } else if (!strcmp(preset, "vllm-hnd")) {
        /* per layer [kv][block][head][token][dim] */
        l.token_stride = hd;
        l.head_stride = T * hd;
        l.block_stride = H * l.head_stride;
        l.kv_stride = B * l.block_stride;
        l.layer_stride = K * l.kv_stride;
    } else if (!strcmp(preset, "flashinfer")) {
        /* per layer [block][kv][token][head][dim] */
        l.head_stride = hd;
        l.token_stride = H * hd;
        l.kv_stride = T * l.token_stride;
        l.block_stride = K * l.kv_stride;
        l.layer_stride = B * l.block_stride;
    } else if (!strcmp(preset, "sglang")) {
        /* per layer a K buffer then a V buffer, [token][head][dim] */
        if (T != 1)
            return KVX_ERR_INVALID;
        l.head_stride = hd;
        l.token_stride = H * hd;
        l.block_stride = H * hd;
        l.kv_stride = B * l.block_stride;
        l.layer_stride = K * l.kv_stride;
    } else if (!strcmp(preset, "mla")) {
        /* per layer [block][token][latent] */
        if (K != 1 || H != 1)
            return KVX_ERR_INVALID;
        l.head_stride = hd;
        l.token_stride = hd;
        l.block_stride = T * hd;
        l.kv_stride = B * l.block_stride;
        l.layer_stride = l.kv_stride;
    } else {
        return KVX_ERR_INVALID;
    }
    *out = l;
    return 0;
}

uint64_t kvx_layout_offset(const kvx_layout_t *l, uint32_t layer, uint32_t kv,
                           uint32_t block, uint32_t token, uint32_t head)
{
    uint32_t r;
    return kvx__layout_part(l, layer, kv, &r) +
           (uint64_t)block * l->block_stride +
           (uint64_t)token * l->token_stride + (uint64_t)head * l->head_stride;
}

uint32_t kvx_layout_region(const kvx_layout_t *l, uint32_t layer, uint32_t kv)
{
    uint32_t r;
    kvx__layout_part(l, layer, kv, &r);
    return r;
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

uint64_t kvx__layout_part_span(const kvx_layout_t *l)
{
    uint64_t s = (uint64_t)l->head_dim * l->elem_size, t;
    const struct dim d[] = {{l->num_blocks, l->block_stride},
                            {l->tokens_per_block, l->token_stride},
                            {l->num_heads, l->head_stride}};
    if (!s)
        return 0;
    for (int i = 0; i < 3; i++) {
        if (!d[i].count)
            return 0;
        if (__builtin_mul_overflow(d[i].count - 1, d[i].stride, &t) ||
            __builtin_add_overflow(s, t, &s))
            return 0;
    }
    return s;
}

/* Parts the layout has (num_layers * kv_factor), bounded for loops over
 * an unchecked layout. */
static uint64_t nparts(const kvx_layout_t *l)
{
    uint64_t n = (uint64_t)l->num_layers * l->kv_factor;
    if (l->parts && n > l->num_parts)
        n = l->num_parts;
    return n;
}

uint32_t kvx_layout_num_regions(const kvx_layout_t *l)
{
    if (!l->parts)
        return 1;
    uint32_t n = 0;
    for (uint64_t i = 0; i < nparts(l); i++)
        if (l->parts[i].region >= n)
            n = l->parts[i].region + 1;
    return n;
}

uint64_t kvx_layout_region_span(const kvx_layout_t *l, uint32_t region)
{
    uint64_t ps = kvx__layout_part_span(l), end = 0, e;
    if (!ps || !l->kv_factor)
        return 0;
    for (uint64_t i = 0; i < nparts(l); i++) {
        uint32_t r;
        uint64_t o = kvx__layout_part(l, (uint32_t)(i / l->kv_factor),
                                      (uint32_t)(i % l->kv_factor), &r);
        if (r != region)
            continue;
        if (!l->parts) { /* o's products may have overflowed */
            uint64_t a, b;
            if (__builtin_mul_overflow((uint64_t)(i / l->kv_factor),
                                       l->layer_stride, &a) ||
                __builtin_mul_overflow((uint64_t)(i % l->kv_factor),
                                       l->kv_stride, &b) ||
                __builtin_add_overflow(a, b, &o))
                return 0;
        }
        if (__builtin_add_overflow(o, ps, &e))
            return 0;
        if (e > end)
            end = e;
    }
    return end;
}

uint64_t kvx_layout_span(const kvx_layout_t *l)
{
    if (kvx_layout_num_regions(l) != 1)
        return 0;
    return kvx_layout_region_span(l, 0);
}

int kvx_layout_split(kvx_layout_t *l, uint32_t per, kvx_layout_part_t *parts,
                     uint32_t num_parts)
{
    if (!l || !parts || (per != 1 && per != 2) ||
        (per == 2 && l->kv_factor != 2) || l->kv_factor < 1 ||
        l->kv_factor > 2 || l->num_layers < 1 ||
        l->num_layers > KVX_MAX_LAYERS ||
        num_parts < l->num_layers * l->kv_factor ||
        (l->parts && l->num_parts < l->num_layers * l->kv_factor))
        return KVX_ERR_INVALID;
    uint32_t K = l->kv_factor;
    for (uint32_t i = 0; i < l->num_layers * K; i++)
        if (kvx_layout_region(l, i / K, i % K) != 0)
            return KVX_ERR_INVALID; /* split already */
    for (uint32_t a = 0; a < l->num_layers; a++) {
        uint32_t r;
        uint64_t o[2] = {0, 0}, lo = UINT64_MAX;
        for (uint32_t k = 0; k < K; k++) { /* read both: parts may be
                                              l->parts */
            o[k] = kvx__layout_part(l, a, k, &r);
            lo = o[k] < lo ? o[k] : lo;
        }
        for (uint32_t k = 0; k < K; k++)
            parts[a * K + k] = per == 1 ? (kvx_layout_part_t){a, 0, o[k] - lo}
                                        : (kvx_layout_part_t){a * 2 + k, 0, 0};
    }
    l->parts = parts;
    l->num_parts = l->num_layers * K;
    return 0;
}

/* Can no two rows of the grid d[0, n) (a row: elem contiguous bytes)
 * alias? With the dimensions sorted by stride, each stride
 * must clear everything the smaller ones span. 0, or the offending
 * stride and extent. */
static int grid_disjoint(struct dim *d, int n, uint64_t elem,
                         uint64_t *bad_stride, uint64_t *bad_extent)
{
    qsort(d, (size_t)n, sizeof(d[0]), dim_cmp);
    uint64_t extent = elem; /* bytes one row covers */
    for (int i = 0; i < n; i++) {
        if (d[i].count <= 1)
            continue;
        if (d[i].stride < extent) {
            *bad_stride = d[i].stride;
            *bad_extent = extent;
            return -1;
        }
        /* no overflow: the spans were checked against the regions */
        extent += (d[i].count - 1) * d[i].stride;
    }
    return 0;
}

/* A part's place, for the per-region checks. */
struct place {
    uint32_t region, index; /* index = layer * kv_factor + kv */
    uint64_t offset;
};

static int place_cmp(const void *a, const void *b)
{
    const struct place *x = a, *y = b;
    if (x->region != y->region)
        return x->region < y->region ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Are the parts pl[0, n) of one region (sorted by offset) a grid of
 * two dimensions: each layer's V at the same distance after its K (kv),
 * the layers' K evenly spaced (layer)? vLLM 0.33 keeps a token's K and V
 * side by side in every (block, head, token) cell, so the parts
 * interleave and only as such a grid can they be shown disjoint. */
static int two_level(const struct place *pl, uint32_t n, struct dim *kv,
                     struct dim *layer)
{
    uint32_t layers = 0;
    uint64_t prev = 0, kstep = 0, lstep = 0;
    if (n < 2 || n % 2)
        return 0;
    for (uint32_t q = 0; q < n; q++) {
        if (pl[q].index % 2)
            continue; /* a V: found from its K */
        uint32_t v = 0;
        while (v < n && pl[v].index != pl[q].index + 1)
            v++;
        if (v == n || pl[v].offset <= pl[q].offset)
            return 0;
        uint64_t d = pl[v].offset - pl[q].offset;
        if (layers == 0)
            kstep = d;
        else if (d != kstep)
            return 0;
        if (layers == 1)
            lstep = pl[q].offset - prev;
        else if (layers > 1 && pl[q].offset - prev != lstep)
            return 0;
        prev = pl[q].offset;
        layers++;
    }
    if (layers * 2 != n)
        return 0;
    *kv = (struct dim){2, kstep};
    *layer = (struct dim){layers, lstep};
    return 1;
}

int kvx__layout_check(const kvx_layout_t *l, const uint64_t *region_size,
                      uint32_t nregions, kvx_why_t *why)
{
    int rc = 0;
    struct place *pl;
    if (l->num_layers < 1 || l->num_layers > KVX_MAX_LAYERS)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.num_layers: %u out of range (expected 1..%u)",
                        l->num_layers, KVX_MAX_LAYERS);
    if (l->kv_factor < 1 || l->kv_factor > 2)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.kv_factor: %u out of range (expected 1 or 2)",
                        l->kv_factor);
    if (l->num_heads < 1 || l->num_heads > 4096)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.num_heads: %u out of range (expected 1..4096)",
                        l->num_heads);
    if (l->head_dim < 1 || l->head_dim > 65536)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.head_dim: %u out of range (expected 1..65536)",
                        l->head_dim);
    if (l->elem_size != 1 && l->elem_size != 2 && l->elem_size != 4 &&
        l->elem_size != 8)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.elem_size: %u invalid (expected 1, 2, 4 or 8)",
                        l->elem_size);
    if (l->dtype != KVX_DTYPE_UNSPECIFIED &&
        kvx_dtype_size(l->dtype) != l->elem_size)
        return why_fail(
            why, KVX_ERR_LAYOUT,
            "layout.elem_size: %u does not match dtype %s (%u bytes)",
            l->elem_size, kvx_dtype_name(l->dtype), kvx_dtype_size(l->dtype));
    if ((unsigned)l->dtype > KVX_DTYPE_INT8)
        return why_fail(why, KVX_ERR_LAYOUT, "layout.dtype: unknown value %u",
                        (unsigned)l->dtype);
    if (l->tokens_per_block < 1 || l->tokens_per_block > 65536)
        return why_fail(
            why, KVX_ERR_LAYOUT,
            "layout.tokens_per_block: %u out of range (expected 1..65536)",
            l->tokens_per_block);
    if (l->num_blocks < 1)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.num_blocks: 0 (expected at least 1)");
    if (nregions < 1 || nregions > KVX_MAX_REGIONS)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "register_pool.regions: %u regions (expected 1..%u)",
                        nregions, KVX_MAX_REGIONS);
    uint32_t K = l->kv_factor, P = l->num_layers * K;
    if (l->parts && l->num_parts != P)
        return why_fail(
            why, KVX_ERR_LAYOUT,
            "layout.parts: %u entries for num_layers %u x kv_factor %u "
            "(expected %u)",
            l->num_parts, l->num_layers, K, P);
    if (!l->parts && nregions != 1)
        return why_fail(
            why, KVX_ERR_LAYOUT,
            "layout.parts: none (the layout is one region), but the pool "
            "has %u regions",
            nregions);

    uint64_t ps = kvx__layout_part_span(l);
    if (!ps)
        return why_fail(why, KVX_ERR_LAYOUT, "layout: size overflows 64 bits");
    static const char *const dname[] = {"block_stride", "token_stride",
                                        "head_stride", "kv_stride",
                                        "layer_stride"};
    const struct dim inner[5] = {
        {l->num_blocks, l->block_stride},
        {l->tokens_per_block, l->token_stride},
        {l->num_heads, l->head_stride},
        {l->parts ? 1 : K, l->kv_stride},
        {l->parts ? 1 : l->num_layers, l->layer_stride}};
    for (int i = 0; i < 5; i++)
        if (inner[i].count > 1 && inner[i].stride == 0)
            return why_fail(why, KVX_ERR_LAYOUT,
                            "layout.%s: 0 with %llu elements along it",
                            dname[i], (unsigned long long)inner[i].count);

    /* every part inside its region */
    pl = malloc(P * sizeof(*pl));
    if (!pl)
        return why_fail(why, KVX_ERR_LAYOUT, "layout: out of memory");
    for (uint32_t i = 0; i < P; i++) {
        uint32_t a = i / K, k = i % K, r;
        uint64_t o, e;
        if (l->parts) {
            o = l->parts[i].offset;
            r = l->parts[i].region;
            if (r >= nregions) {
                rc = why_fail(
                    why, KVX_ERR_LAYOUT,
                    "layout.parts[%u]: layer %u kv %u in region %u, but the "
                    "pool has %u regions",
                    i, a, k, r, nregions);
                goto out;
            }
        } else {
            uint64_t x, y;
            r = 0;
            if (__builtin_mul_overflow((uint64_t)a, l->layer_stride, &x) ||
                __builtin_mul_overflow((uint64_t)k, l->kv_stride, &y) ||
                __builtin_add_overflow(x, y, &o)) {
                rc = why_fail(
                    why, KVX_ERR_LAYOUT,
                    "layout: layer %u kv %u: its offset overflows 64 bits", a,
                    k);
                goto out;
            }
        }
        if (__builtin_add_overflow(o, ps, &e)) {
            if (l->parts)
                rc = why_fail(why, KVX_ERR_LAYOUT,
                              "layout.parts[%u]: layer %u kv %u: offset %llu "
                              "overflows",
                              i, a, k, (unsigned long long)o);
            else
                rc = why_fail(why, KVX_ERR_LAYOUT,
                              "layout: layer %u kv %u: offset %llu overflows",
                              a, k, (unsigned long long)o);
            goto out;
        }
        if (e > region_size[r]) {
            rc = why_fail(
                why, KVX_ERR_LAYOUT,
                "layout: layer %u kv %u ends at byte %llu of region %u, past "
                "its %llu bytes",
                a, k, (unsigned long long)e, r,
                (unsigned long long)region_size[r]);
            goto out;
        }
        pl[i] = (struct place){r, i, o};
    }

    /* No two elements may alias. Inside one part: the block, token and
     * head grid. Across parts of one region: when their offsets are
     * evenly spaced they are one more dimension (the block-major trtllm
     * preset interleaves layers and kv inside blocks); otherwise their
     * byte ranges must be disjoint. */
    uint64_t bs, be;
    qsort(pl, P, sizeof(*pl), place_cmp);
    for (uint32_t i = 0, expect = 0; i < P; i++) {
        if (pl[i].region != expect) {
            if (pl[i].region > expect) {
                rc = why_fail(why, KVX_ERR_LAYOUT,
                              "register_pool.regions[%u]: holds no part of the "
                              "layout",
                              expect);
                goto out;
            }
            continue;
        }
        /* the group of region `expect`: [i, j) */
        uint32_t j = i + 1;
        while (j < P && pl[j].region == expect)
            j++;
        uint64_t step = j - i > 1 ? pl[i + 1].offset - pl[i].offset : 0;
        int even = l->parts && step > 0; /* no parts: inner[3], [4] */
        for (uint32_t q = i + 2; even && q < j; q++)
            even = pl[q].offset - pl[q - 1].offset == step;
        struct dim d[6] = {inner[0], inner[1], inner[2],
                           inner[3], inner[4], {even ? j - i : 1, step}};
        int grid = l->parts && !even && K == 2 &&
                   two_level(pl + i, j - i, &d[3], &d[4]);
        if (grid_disjoint(d, 6, (uint64_t)l->head_dim * l->elem_size, &bs,
                          &be)) {
            rc = why_fail(
                why, KVX_ERR_LAYOUT,
                "layout: strides make elements overlap in region %u (a "
                "stride of %llu is inside the %llu bytes the smaller "
                "dimensions span)",
                expect, (unsigned long long)bs, (unsigned long long)be);
            goto out;
        }
        for (uint32_t q = i + 1; l->parts && !even && !grid && q < j; q++)
            if (pl[q].offset < pl[q - 1].offset + ps) {
                rc = why_fail(
                    why, KVX_ERR_LAYOUT,
                    "layout.parts: layer %u kv %u overlaps layer %u kv %u in "
                    "region %u at byte %llu",
                    pl[q].index / K, pl[q].index % K, pl[q - 1].index / K,
                    pl[q - 1].index % K, expect,
                    (unsigned long long)pl[q].offset);
                goto out;
            }
        expect++;
        i = j - 1;
    }
    if (pl[P - 1].region + 1 < nregions) {
        rc = why_fail(why, KVX_ERR_LAYOUT,
                      "register_pool.regions[%u]: holds no part of the layout",
                      pl[P - 1].region + 1);
        goto out;
    }
out:
    free(pl);
    return rc;
}
