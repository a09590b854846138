/*
 * compat — the 2.x variants of publish, fetch, the ready marks,
 * progress and reserve, kept for 3.x as thin wrappers: each fills a 3.0 args
 * struct and goes through verbs.c, naming itself in messages as it always did.
 * The 2.x kvx_publish, kvx_fetch and kvx_reserve, whose names 3.0 took,
 * are abi2.c's.
 */
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "common/reqkey.h"
#include "kvxfer.h"

#define PUB_BASE                                                               \
    (KVX_PUBLISH_FIELD_KEY | KVX_PUBLISH_FIELD_BLOCKS |                        \
     KVX_PUBLISH_FIELD_NUM_TOKENS | KVX_PUBLISH_FIELD_PARAMS |                 \
     KVX_PUBLISH_FIELD_TIMEOUT)
#define FETCH_BASE                                                             \
    (KVX_FETCH_FIELD_KEY | KVX_FETCH_FIELD_BLOCKS |                            \
     KVX_FETCH_FIELD_SKIP_TOKENS | KVX_FETCH_FIELD_DP_RANK |                   \
     KVX_FETCH_FIELD_TIMEOUT)

int kvx_publish_key(kvx_client_t *c, const void *key, size_t key_len,
                    uint32_t pool_id, const uint32_t *blocks, uint32_t nblocks,
                    uint32_t num_tokens, const void *aux, size_t aux_len,
                    kvx_context_params_t *params, int timeout_ms)
{
    kvx_publish_args_t a = {.field_mask = PUB_BASE | KVX_PUBLISH_FIELD_AUX,
                            .key = key,
                            .key_len = key_len,
                            .pool_id = pool_id,
                            .blocks = blocks,
                            .num_blocks = nblocks,
                            .num_tokens = num_tokens,
                            .params = params,
                            .aux = aux,
                            .aux_len = aux_len,
                            .timeout_ms = timeout_ms};
    return kvx__publish(c, "kvx_publish_key", &a, NULL);
}

int kvx_publish_groups(kvx_client_t *c, const void *key, size_t key_len,
                       uint32_t pool_id, const uint32_t *blocks,
                       uint32_t nblocks, uint32_t num_tokens,
                       const kvx_group_t *groups, uint32_t ngroups,
                       const void *aux, size_t aux_len, int layerwise,
                       kvx_context_params_t *params, int timeout_ms)
{
    kvx_publish_args_t a = {.field_mask = PUB_BASE | KVX_PUBLISH_FIELD_AUX |
                                          KVX_PUBLISH_FIELD_GROUPS |
                                          KVX_PUBLISH_FIELD_FLAGS,
                            .key = key,
                            .key_len = key_len,
                            .pool_id = pool_id,
                            .blocks = blocks,
                            .num_blocks = nblocks,
                            .num_tokens = num_tokens,
                            .params = params,
                            .aux = aux,
                            .aux_len = aux_len,
                            .groups = groups,
                            .num_groups = ngroups,
                            .flags = layerwise ? KVX_PUBLISH_LAYERWISE : 0,
                            .timeout_ms = timeout_ms};
    return kvx__publish(c, "kvx_publish_groups", &a, NULL);
}

int kvx_publish_layerwise(kvx_client_t *c, const void *key, size_t key_len,
                          uint32_t pool_id, const uint32_t *blocks,
                          uint32_t nblocks, uint32_t num_tokens,
                          const void *aux, size_t aux_len,
                          kvx_context_params_t *params, int timeout_ms)
{
    kvx_publish_args_t a = {.field_mask = PUB_BASE | KVX_PUBLISH_FIELD_AUX |
                                          KVX_PUBLISH_FIELD_FLAGS,
                            .key = key,
                            .key_len = key_len,
                            .pool_id = pool_id,
                            .blocks = blocks,
                            .num_blocks = nblocks,
                            .num_tokens = num_tokens,
                            .params = params,
                            .aux = aux,
                            .aux_len = aux_len,
                            .flags = KVX_PUBLISH_LAYERWISE,
                            .timeout_ms = timeout_ms};
    return kvx__publish(c, "kvx_publish_layerwise", &a, NULL);
}

int kvx_fetch_groups(kvx_client_t *c, const void *key, size_t key_len,
                     const uint8_t *params, size_t params_len, uint32_t pool_id,
                     const uint32_t *blocks, uint32_t nblocks,
                     uint32_t skip_tokens, uint32_t dp_rank,
                     const kvx_group_t *groups, uint32_t ngroups,
                     int timeout_ms)
{
    kvx_fetch_args_t a = {.field_mask = FETCH_BASE | KVX_FETCH_FIELD_PARAMS |
                                        KVX_FETCH_FIELD_GROUPS,
                          .key = key,
                          .key_len = key_len,
                          .pool_id = pool_id,
                          .blocks = blocks,
                          .num_blocks = nblocks,
                          .params = params,
                          .params_len = params_len,
                          .skip_tokens = skip_tokens,
                          .dp_rank = dp_rank,
                          .groups = groups,
                          .num_groups = ngroups,
                          .timeout_ms = timeout_ms};
    return kvx__fetch(c, ngroups ? "kvx_fetch_groups" : "kvx_fetch_key", &a,
                      NULL);
}

int kvx_fetch_key(kvx_client_t *c, const void *key, size_t key_len,
                  const uint8_t *params, size_t params_len, uint32_t pool_id,
                  const uint32_t *blocks, uint32_t nblocks,
                  uint32_t skip_tokens, uint32_t dp_rank, int timeout_ms)
{
    return kvx_fetch_groups(c, key, key_len, params, params_len, pool_id,
                            blocks, nblocks, skip_tokens, dp_rank, NULL, 0,
                            timeout_ms);
}

int kvx_fetch_dp(kvx_client_t *c, uint64_t request_id, const uint8_t *params,
                 size_t params_len, uint32_t pool_id, const uint32_t *blocks,
                 uint32_t nblocks, uint32_t skip_tokens, uint32_t dp_rank,
                 int timeout_ms)
{
    reqkey_t k;
    reqkey_from_u64(&k, request_id);
    return kvx_fetch_key(c, k.b, k.len, params, params_len, pool_id, blocks,
                         nblocks, skip_tokens, dp_rank, timeout_ms);
}

int kvx_fetch_by_key_groups(kvx_client_t *c, const void *key, size_t key_len,
                            const char *ctx_instance, const char *ctx_address,
                            const void *ctx_key, size_t ctx_key_len,
                            uint32_t pool_id, const uint32_t *blocks,
                            uint32_t nblocks, uint32_t skip_tokens,
                            uint32_t dp_rank, const kvx_group_t *groups,
                            uint32_t ngroups, int timeout_ms)
{
    kvx_fetch_args_t a = {.field_mask = FETCH_BASE | KVX_FETCH_FIELD_CONTEXT |
                                        KVX_FETCH_FIELD_GROUPS,
                          .key = key,
                          .key_len = key_len,
                          .pool_id = pool_id,
                          .blocks = blocks,
                          .num_blocks = nblocks,
                          .context_instance = ctx_instance,
                          .context_address = ctx_address,
                          .context_key = ctx_key,
                          .context_key_len = ctx_key_len,
                          .skip_tokens = skip_tokens,
                          .dp_rank = dp_rank,
                          .groups = groups,
                          .num_groups = ngroups,
                          .timeout_ms = timeout_ms};
    return kvx__fetch(
        c, ngroups ? "kvx_fetch_by_key_groups" : "kvx_fetch_by_key", &a, NULL);
}

int kvx_fetch_by_key(kvx_client_t *c, const void *key, size_t key_len,
                     const char *ctx_instance, const char *ctx_address,
                     const void *ctx_key, size_t ctx_key_len, uint32_t pool_id,
                     const uint32_t *blocks, uint32_t nblocks,
                     uint32_t skip_tokens, uint32_t dp_rank, int timeout_ms)
{
    return kvx_fetch_by_key_groups(
        c, key, key_len, ctx_instance, ctx_address, ctx_key, ctx_key_len,
        pool_id, blocks, nblocks, skip_tokens, dp_rank, NULL, 0, timeout_ms);
}

/* A 2.x batch goes as a 3.0 batch of items of the same fields, each
 * with an outcome whose code becomes the item's status; the statuses
 * stay 0 unless the replies came back (2.x: which items the daemon took
 * is unknown). */
int kvx_publish_many(kvx_client_t *c, kvx_publish_item_t *items, size_t n,
                     int timeout_ms)
{
    static const char fn[] = "kvx_publish_many";
    if (!c)
        return KVX_ERR_INVALID;
    if ((!items && n) || n > KVX_MANY_MAX)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: %zu items%s (at most %u)", fn,
                         n, items ? "" : " at NULL", KVX_MANY_MAX);
    kvx_publish_args_t *a = calloc(n ? n : 1, sizeof(*a));
    kvx_outcome_t *o = calloc(n ? n : 1, sizeof(*o));
    if (!a || !o) {
        free(a);
        free(o);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        kvx_publish_item_t *it = &items[i];
        it->status = 0;
        a[i] = (kvx_publish_args_t){
            .field_mask = (PUB_BASE & ~KVX_PUBLISH_FIELD_TIMEOUT) |
                          KVX_PUBLISH_FIELD_OUTCOME,
            .key = it->key,
            .key_len = it->key_len,
            .pool_id = it->pool_id,
            .blocks = it->blocks,
            .num_blocks = it->num_blocks,
            .num_tokens = it->num_tokens,
            .params = &it->params,
            .outcome = &o[i]};
    }
    kvx_publish_args_t b = {.field_mask = KVX_PUBLISH_FIELD_ITEMS |
                                          KVX_PUBLISH_FIELD_TIMEOUT,
                            .items = a,
                            .num_items = n,
                            .timeout_ms = timeout_ms};
    int replied;
    int rc = kvx__publish(c, fn, &b, &replied);
    for (size_t i = 0; replied && i < n; i++)
        items[i].status = o[i].code;
    free(a);
    free(o);
    return rc;
}

int kvx_fetch_many(kvx_client_t *c, kvx_fetch_item_t *items, size_t n,
                   int timeout_ms)
{
    static const char fn[] = "kvx_fetch_many";
    if (!c)
        return KVX_ERR_INVALID;
    if ((!items && n) || n > KVX_MANY_MAX)
        return kvx__fail(c, KVX_ERR_INVALID, "%s: %zu items%s (at most %u)", fn,
                         n, items ? "" : " at NULL", KVX_MANY_MAX);
    kvx_fetch_args_t *a = calloc(n ? n : 1, sizeof(*a));
    kvx_outcome_t *o = calloc(n ? n : 1, sizeof(*o));
    if (!a || !o) {
        free(a);
        free(o);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        kvx_fetch_item_t *it = &items[i];
        it->status = 0;
        a[i] = (kvx_fetch_args_t){
            .field_mask = (FETCH_BASE & ~KVX_FETCH_FIELD_TIMEOUT) |
                          KVX_FETCH_FIELD_PARAMS | KVX_FETCH_FIELD_OUTCOME,
            .key = it->key,
            .key_len = it->key_len,
            .pool_id = it->pool_id,
            .blocks = it->blocks,
            .num_blocks = it->num_blocks,
            .params = it->params,
            .params_len = it->params_len,
            .skip_tokens = it->skip_tokens,
            .dp_rank = it->dp_rank,
            .outcome = &o[i]};
    }
    kvx_fetch_args_t b = {.field_mask =
                              KVX_FETCH_FIELD_ITEMS | KVX_FETCH_FIELD_TIMEOUT,
                          .items = a,
                          .num_items = n,
                          .timeout_ms = timeout_ms};
    int replied;
    int rc = kvx__fetch(c, fn, &b, &replied);
    for (size_t i = 0; replied && i < n; i++)
        items[i].status = o[i].code;
    free(a);
    free(o);
    return rc;
}

/* The 2.x ready marks and progress: kvx_ready and kvx_progress with the
 * members they name. */
#define READY_BASE                                                             \
    (KVX_READY_FIELD_KEY | KVX_READY_FIELD_LAYERS | KVX_READY_FIELD_TOKENS |   \
     KVX_READY_FIELD_GROUP | KVX_READY_FIELD_CUDA_EVENT |                      \
     KVX_READY_FIELD_TIMEOUT)

int kvx_layers_ready(kvx_client_t *c, const void *key, size_t key_len,
                     uint32_t first, uint32_t count, const void *cuda_event,
                     int timeout_ms)
{
    kvx_ready_args_t a = {.field_mask = READY_BASE,
                          .key = key,
                          .key_len = key_len,
                          .first = first,
                          .count = count,
                          .cuda_event = cuda_event,
                          .timeout_ms = timeout_ms};
    return kvx__ready(c, "kvx_layers_ready", &a);
}

int kvx_tokens_ready(kvx_client_t *c, const void *key, size_t key_len,
                     uint32_t first, uint32_t count, uint32_t tokens,
                     const void *cuda_event, int timeout_ms)
{
    kvx_ready_args_t a = {.field_mask = READY_BASE,
                          .key = key,
                          .key_len = key_len,
                          .first = first,
                          .count = count,
                          .tokens = tokens,
                          .cuda_event = cuda_event,
                          .timeout_ms = timeout_ms};
    return kvx__ready(c, "kvx_tokens_ready", &a);
}

int kvx_group_tokens_ready(kvx_client_t *c, const void *key, size_t key_len,
                           uint32_t group, uint32_t first, uint32_t count,
                           uint32_t tokens, const void *cuda_event,
                           int timeout_ms)
{
    kvx_ready_args_t a = {.field_mask = READY_BASE,
                          .key = key,
                          .key_len = key_len,
                          .first = first,
                          .count = count,
                          .tokens = tokens,
                          .group = group,
                          .cuda_event = cuda_event,
                          .timeout_ms = timeout_ms};
    return kvx__ready(c, "kvx_group_tokens_ready", &a);
}

int kvx_group_fetch_progress(kvx_client_t *c, const void *key, size_t key_len,
                             uint32_t group, uint32_t *layers_done,
                             uint32_t *num_layers, int *ended, int timeout_ms)
{
    kvx_progress_args_t a = {
        .field_mask = KVX_PROGRESS_FIELD_KEY | KVX_PROGRESS_FIELD_GROUP |
                      KVX_PROGRESS_FIELD_LAYERS | KVX_PROGRESS_FIELD_ENDED |
                      KVX_PROGRESS_FIELD_TIMEOUT,
        .key = key,
        .key_len = key_len,
        .group = group,
        .layers_done = layers_done,
        .num_layers = num_layers,
        .ended = ended,
        .timeout_ms = timeout_ms};
    return kvx__progress(
        c, group ? "kvx_group_fetch_progress" : "kvx_fetch_progress", &a);
}

int kvx_fetch_progress(kvx_client_t *c, const void *key, size_t key_len,
                       uint32_t *layers_done, uint32_t *num_layers, int *ended,
                       int timeout_ms)
{
    return kvx_group_fetch_progress(c, key, key_len, 0, layers_done, num_layers,
                                    ended, timeout_ms);
}

int kvx_reserve_groups(kvx_client_t *c, const char *instance_id,
                       const void *key, size_t key_len, uint32_t num_tokens,
                       uint32_t pool_id, const kvx_group_t *groups,
                       uint32_t ngroups, kvx_context_params_t *params,
                       int timeout_ms)
{
    kvx_reserve_args_t a = {
        .field_mask = KVX_RESERVE_FIELD_KEY | KVX_RESERVE_FIELD_INSTANCE |
                      KVX_RESERVE_FIELD_NUM_TOKENS | KVX_RESERVE_FIELD_PARAMS |
                      KVX_RESERVE_FIELD_POOL | KVX_RESERVE_FIELD_GROUPS |
                      KVX_RESERVE_FIELD_TIMEOUT,
        .key = key,
        .key_len = key_len,
        .instance_id = instance_id,
        .num_tokens = num_tokens,
        .params = params,
        .pool_id = pool_id,
        .groups = groups,
        .num_groups = ngroups,
        .timeout_ms = timeout_ms};
    return kvx__reserve(
        c, pool_id || ngroups ? "kvx_reserve_groups" : "kvx_reserve", &a);
}
