/*
 * abi2 — the 2.x kvx_publish, kvx_fetch and kvx_reserve, whose names
 * 3.0 took.
 *
 * kvx_publish and kvx_fetch took a uint64_t request_id, kvx_reserve
 * positional parameters. A program built against 2.x binds
 * kvx_publish@KVXFER_2.0, kvx_fetch@KVXFER_2.0 and kvx_reserve@KVXFER_2.0
 * (the version their node gave them), which .symver below points at
 * these; a program built now binds kvx_publish@@KVXFER_3.0, the default
 * (client/libkvxfer.map). They keep their 2.x parameter lists (8, 9 and 7
 * parameters): an ABI, not a choice.
 *
 * A file of their own: an object with a versioned symbol links only into
 * a shared object whose version script has the node (libkvxfer.so's), so
 * a shared object that takes other calls from libkvxfer.a (the tests'
 * torch shim) must not pull this one in.
 */
#include "client.h"
#include "common/reqkey.h"
#include "kvxfer.h"

/* 2.x kvx_publish: kvx_publish_key with the key of request_id's digits,
 * no aux (kvx_publish@KVXFER_2.0). */
__attribute__((visibility("default"))) int
kvx__publish_2(kvx_client_t *c, uint64_t request_id, uint32_t pool_id,
               const uint32_t *blocks, uint32_t nblocks, uint32_t num_tokens,
               kvx_context_params_t *params, int timeout_ms);
__asm__(".symver kvx__publish_2, kvx_publish@KVXFER_2.0");

int kvx__publish_2(kvx_client_t *c, uint64_t request_id, uint32_t pool_id,
                   const uint32_t *blocks, uint32_t nblocks,
                   uint32_t num_tokens, kvx_context_params_t *params,
                   int timeout_ms)
{
    reqkey_t k;
    reqkey_from_u64(&k, request_id);
    kvx_publish_args_t a = {
        .field_mask = KVX_PUBLISH_FIELD_KEY | KVX_PUBLISH_FIELD_BLOCKS |
                      KVX_PUBLISH_FIELD_NUM_TOKENS | KVX_PUBLISH_FIELD_PARAMS |
                      KVX_PUBLISH_FIELD_TIMEOUT,
        .key = k.b,
        .key_len = k.len,
        .pool_id = pool_id,
        .blocks = blocks,
        .num_blocks = nblocks,
        .num_tokens = num_tokens,
        .params = params,
        .timeout_ms = timeout_ms};
    return kvx__publish(c, "kvx_publish_key", &a, NULL);
}

/* 2.x kvx_fetch: kvx_fetch_key with the key of request_id's digits,
 * dp_rank 0 (kvx_fetch@KVXFER_2.0). */
__attribute__((visibility("default"))) int
kvx__fetch_2(kvx_client_t *c, uint64_t request_id, const uint8_t *params,
             size_t params_len, uint32_t pool_id, const uint32_t *blocks,
             uint32_t nblocks, uint32_t skip_tokens, int timeout_ms);
__asm__(".symver kvx__fetch_2, kvx_fetch@KVXFER_2.0");

int kvx__fetch_2(kvx_client_t *c, uint64_t request_id, const uint8_t *params,
                 size_t params_len, uint32_t pool_id, const uint32_t *blocks,
                 uint32_t nblocks, uint32_t skip_tokens, int timeout_ms)
{
    reqkey_t k;
    reqkey_from_u64(&k, request_id);
    kvx_fetch_args_t a = {
        .field_mask = KVX_FETCH_FIELD_KEY | KVX_FETCH_FIELD_BLOCKS |
                      KVX_FETCH_FIELD_PARAMS | KVX_FETCH_FIELD_SKIP_TOKENS |
                      KVX_FETCH_FIELD_TIMEOUT,
        .key = k.b,
        .key_len = k.len,
        .pool_id = pool_id,
        .blocks = blocks,
        .num_blocks = nblocks,
        .params = params,
        .params_len = params_len,
        .skip_tokens = skip_tokens,
        .timeout_ms = timeout_ms};
    return kvx__fetch(c, "kvx_fetch_key", &a, NULL);
}

/* 2.x kvx_reserve: kvx_reserve_groups without groups
 * (kvx_reserve@KVXFER_2.0). */
__attribute__((visibility("default"))) int
kvx__reserve_2(kvx_client_t *c, const char *instance_id, const void *key,
               size_t key_len, uint32_t num_tokens,
               kvx_context_params_t *params, int timeout_ms);
__asm__(".symver kvx__reserve_2, kvx_reserve@KVXFER_2.0");

int kvx__reserve_2(kvx_client_t *c, const char *instance_id, const void *key,
                   size_t key_len, uint32_t num_tokens,
                   kvx_context_params_t *params, int timeout_ms)
{
    kvx_reserve_args_t a = {
        .field_mask = KVX_RESERVE_FIELD_KEY | KVX_RESERVE_FIELD_INSTANCE |
                      KVX_RESERVE_FIELD_NUM_TOKENS | KVX_RESERVE_FIELD_PARAMS |
                      KVX_RESERVE_FIELD_TIMEOUT,
        .key = key,
        .key_len = key_len,
        .instance_id = instance_id,
        .num_tokens = num_tokens,
        .params = params,
        .timeout_ms = timeout_ms};
    return kvx__reserve(c, "kvx_reserve", &a);
}
