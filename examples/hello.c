/* hello — the smallest complete kvxfer program, the README's C example.
 *
 * Two ranks in one process: rank 0 of the context instance "prefill-0"
 * publishes a request's KV (40 tokens in blocks 3, 4, 5 of its pool),
 * rank 0 of the generation instance "decode-0" fetches it into blocks 0,
 * 1, 2 of its own pool with the params the publish returned (what a
 * router hands over); both poll until the request is COMPLETE, then every
 * token's bytes are compared. Real engines run each rank in its own
 * process, often on other nodes: the calls are the same.
 *
 * Build against an installed kvxfer and run with a daemon on the default
 * socket (/run/kvxfer/kvxferd.sock) or the one named:
 *   cc -o hello examples/hello.c $(pkg-config --cflags --libs kvxfer)
 *   ./hello [SOCKET]
 * It prints what moved and exits 0, or names the failing call with the
 * library's message and exits 1. make check-docs builds and runs it
 * (scripts/test-hello.sh).
 */
#include <kvxfer.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LAYERS 32
#define HEADS 8
#define TOKENS 40 /* the request's: blocks of 16 tokens, the last 8 used */

/* Stop on a failed call, naming it, with the library's message. */
static void check(const kvx_client_t *c, int rc, const char *call)
{
    if (rc >= 0)
        return;
    fprintf(stderr, "hello: %s: %s: %s\n", call, kvx_status_name(rc),
            kvx_last_error(c));
    exit(1);
}

/* Poll until the event of key "req-42" arrives; 0 if it is COMPLETE. */
static int wait_complete(kvx_client_t *c, const char *side)
{
    for (;;) {
        kvx_batch_t *batch;
        check(c, kvx_poll(c, 1, 100, &batch), "kvx_poll");
        for (uint32_t i = 0; i < batch->num_events; i++) {
            const kvx_event_t *ev = &batch->events[i];
            if (ev->key_len != 6 || memcmp(ev->key, "req-42", 6) != 0)
                continue;
            int ok = ev->kind == KVX_EVENT_COMPLETE;
            if (!ok)
                fprintf(stderr, "hello: %s: req-42 ended %s: %s\n", side,
                        kvx_status_name(ev->code), ev->message);
            kvx_batch_free(batch);
            return ok ? 0 : -1;
        }
        kvx_batch_free(batch);
    }
}

int main(int argc, char **argv)
{
    const char *sock = argc > 1 ? argv[1] : NULL; /* NULL: the default */

    /* a context rank: connect, join its instance, make a pool, publish */
    kvx_hello_t h = {.instance_id = "prefill-0",
                     .role = KVX_ROLE_CONTEXT,
                     .rank = 0,
                     .parallel = {.tp = 1,
                                  .pp = 1,
                                  .cp = 1,
                                  .total_layers = 32,
                                  .total_kv_heads = 8}};
    kvx_client_t *c;
    check(NULL, kvx_connect(sock, &h, 5000, &c), "kvx_connect");
    char addr[192];
    check(c, kvx_daemon_address(c, addr, sizeof addr), "kvx_daemon_address");
    check(c, kvx_join(c, (const char *[]){addr}, 1, 5000), "kvx_join");

    kvx_layout_t l; /* 32 layers, K and V, 8 heads of 128, bf16, 8 blocks */
    int rc =
        kvx_layout_preset("vllm-nhd", 32, 2, 8, 128, KVX_DTYPE_BF16, 16, 8, &l);
    check(c, rc, "kvx_layout_preset");
    void *kv;
    uint32_t pool;
    check(c, kvx_pool_create_host(c, &l, kvx_layout_span(&l), &kv, &pool, 5000),
          "kvx_pool_create_host");
    for (uint64_t i = 0; i < kvx_layout_span(&l); i++) /* the prefill's KV */
        ((uint8_t *)kv)[i] = (uint8_t)(i * 2654435761u >> 13);

    uint32_t blocks[] = {3, 4, 5};
    kvx_context_params_t params; /* hand these to the router */
    kvx_publish_args_t pub = {
        .field_mask = KVX_PUBLISH_FIELD_KEY | KVX_PUBLISH_FIELD_BLOCKS |
                      KVX_PUBLISH_FIELD_NUM_TOKENS | KVX_PUBLISH_FIELD_PARAMS,
        .key = "req-42",
        .key_len = 6,
        .pool_id = pool,
        .blocks = blocks,
        .num_blocks = 3,
        .num_tokens = TOKENS,
        .params = &params};
    check(c, kvx_publish(c, &pub), "kvx_publish");

    /* a generation rank (another process, usually): fetch with the params */
    kvx_hello_t gh = {.instance_id = "decode-0",
                      .role = KVX_ROLE_GENERATION,
                      .rank = 0,
                      .parallel = h.parallel};
    kvx_client_t *g;
    check(NULL, kvx_connect(sock, &gh, 5000, &g), "kvx_connect");
    check(g, kvx_daemon_address(g, addr, sizeof addr), "kvx_daemon_address");
    check(g, kvx_join(g, (const char *[]){addr}, 1, 5000), "kvx_join");
    void *dkv;
    uint32_t dpool;
    check(g,
          kvx_pool_create_host(g, &l, kvx_layout_span(&l), &dkv, &dpool, 5000),
          "kvx_pool_create_host");
    uint32_t dblocks[] = {0, 1, 2};
    kvx_fetch_args_t fetch = {.field_mask = KVX_FETCH_FIELD_KEY |
                                            KVX_FETCH_FIELD_BLOCKS |
                                            KVX_FETCH_FIELD_PARAMS,
                              .key = "req-42",
                              .key_len = 6,
                              .pool_id = dpool,
                              .blocks = dblocks,
                              .num_blocks = 3,
                              .params = params.data,
                              .params_len = params.len};
    check(g, kvx_fetch(g, &fetch), "kvx_fetch");

    /* every rank polls: the fetch ends COMPLETE on the generation side,
     * the offer (all its blocks taken) on the context side */
    if (wait_complete(g, "decode-0") || wait_complete(c, "prefill-0"))
        return 1;

    /* token t of the request: block t / 16 of each side, row t % 16 */
    uint64_t row = (uint64_t)HEADS * 128 * 2, compared = 0;
    for (uint32_t layer = 0; layer < LAYERS; layer++)
        for (uint32_t k = 0; k < 2; k++)
            for (uint32_t t = 0; t < TOKENS; t++) {
                uint64_t so =
                    kvx_layout_offset(&l, layer, k, blocks[t / 16], t % 16, 0);
                uint64_t d =
                    kvx_layout_offset(&l, layer, k, dblocks[t / 16], t % 16, 0);
                if (memcmp((uint8_t *)kv + so, (uint8_t *)dkv + d, row)) {
                    fprintf(stderr,
                            "hello: layer %u kv %u token %u differs "
                            "after the transfer\n",
                            layer, k, t);
                    return 1;
                }
                compared += row;
            }
    printf("hello: req-42 moved from prefill-0 to decode-0 (%s): "
           "%llu bytes, every byte equal\n",
           kvx_version(), (unsigned long long)compared);
    kvx_context_params_free(&params);
    kvx_close(g);
    kvx_close(c);
    return 0;
}
