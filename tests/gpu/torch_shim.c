/*
 * torch_shim — one call that moves a pool between two PyTorch tensors
 * through a real kvxferd, for torch_pools.py (ctypes passes pointers and
 * integers only, so the library's structs stay on this side).
 *
 * A context client registers src, a generation client registers dst (both
 * in this process, as an engine's ranks would register theirs), every
 * block is published and fetched with the identity block table, and both
 * sides must see COMPLETE. The bytes are checked by the caller.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvxfer.h"

static int wait_complete(kvx_client_t *c, uint64_t req, char *err, size_t len,
                         const char *who)
{
    for (int i = 0; i < 100; i++) {
        kvx_batch_t *b;
        int rc = kvx_poll(c, 1, 200, &b);
        if (rc) {
            snprintf(err, len, "%s: poll: %s", who, kvx_last_error(c));
            return rc;
        }
        if (!b->num_events) {
            kvx_batch_free(b);
            continue;
        }
        kvx_event_t e = b->events[0];
        rc = e.request_id == req && e.kind == KVX_EVENT_COMPLETE ? 0 : -1;
        if (rc)
            snprintf(err, len, "%s: event %d for request %llu: %s", who,
                     (int)e.kind, (unsigned long long)e.request_id,
                     e.message ? e.message : "");
        kvx_batch_free(b);
        return rc;
    }
    snprintf(err, len, "%s: no event within 20 s", who);
    return -1;
}

static kvx_client_t *open_rank(const char *sock, const char *inst,
                               kvx_role_t role, uint32_t layers, uint32_t heads,
                               char *err, size_t len)
{
    kvx_hello_t h = {.instance_id = inst,
                     .role = role,
                     .rank = 0,
                     .parallel = {.tp = 1,
                                  .pp = 1,
                                  .cp = 1,
                                  .total_layers = layers,
                                  .total_kv_heads = heads}};
    kvx_client_t *c = NULL;
    char addr[192];
    if (kvx_connect(sock, &h, 5000, &c) ||
        kvx_daemon_address(c, addr, sizeof(addr))) {
        snprintf(err, len, "%s: connect: %s", inst,
                 c ? kvx_last_error(c) : "failed");
        kvx_close(c);
        return NULL;
    }
    const char *a[1] = {addr};
    if (kvx_join(c, a, 1, 5000)) {
        snprintf(err, len, "%s: join: %s", inst, kvx_last_error(c));
        kvx_close(c);
        return NULL;
    }
    return c;
}

/* The span of a preset's pool (0: the preset refuses the shape). */
uint64_t kvxt_span(const char *preset, uint32_t layers, uint32_t heads,
                   uint32_t head_dim, uint32_t tpb, uint32_t blocks)
{
    kvx_layout_t l;
    if (kvx_layout_preset(preset, layers, 2, heads, head_dim, KVX_DTYPE_BF16,
                          tpb, blocks, &l))
        return 0;
    return kvx_layout_span(&l);
}

int kvxt_transfer(const char *sock, const char *tag, const char *preset,
                  uint32_t layers, uint32_t heads, uint32_t head_dim,
                  uint32_t tpb, uint32_t blocks, void *src, void *dst,
                  uint64_t req, char *err, size_t len)
{
    kvx_layout_t l;
    if (kvx_layout_preset(preset, layers, 2, heads, head_dim, KVX_DTYPE_BF16,
                          tpb, blocks, &l)) {
        snprintf(err, len, "preset %s refuses the shape", preset);
        return -1;
    }
    uint64_t size = kvx_layout_span(&l);
    char ci[64], gi[64];
    snprintf(ci, sizeof(ci), "%s-ctx", tag);
    snprintf(gi, sizeof(gi), "%s-gen", tag);
    kvx_client_t *c =
        open_rank(sock, ci, KVX_ROLE_CONTEXT, layers, heads, err, len);
    kvx_client_t *g =
        c ? open_rank(sock, gi, KVX_ROLE_GENERATION, layers, heads, err, len)
          : NULL;
    int rc = -1;
    uint32_t cp, gp, bl[4096];
    kvx_context_params_t prm = {0};
    if (!g)
        goto out;
    if (blocks > 4096) {
        snprintf(err, len, "at most 4096 blocks");
        goto out;
    }
    for (uint32_t i = 0; i < blocks; i++)
        bl[i] = i;
    if ((rc = kvx_pool_register_gpu(c, &l, src, size, &cp, 5000))) {
        snprintf(err, len, "register src: %s", kvx_last_error(c));
        goto out;
    }
    if ((rc = kvx_pool_register_gpu(g, &l, dst, size, &gp, 5000))) {
        snprintf(err, len, "register dst: %s", kvx_last_error(g));
        goto out;
    }
    char key[24];
    int klen = snprintf(key, sizeof(key), "%llu", (unsigned long long)req);
    if ((rc = kvx_publish_key(c, key, (size_t)klen, cp, bl, blocks,
                              blocks * tpb, NULL, 0, &prm, 5000))) {
        snprintf(err, len, "publish: %s", kvx_last_error(c));
        goto out;
    }
    if ((rc = kvx_fetch_key(g, key, (size_t)klen, prm.data, prm.len, gp, bl,
                            blocks, 0, 0, 5000))) {
        snprintf(err, len, "fetch: %s", kvx_last_error(g));
        goto out;
    }
    if ((rc = wait_complete(g, req, err, len, "generation")) ||
        (rc = wait_complete(c, req, err, len, "context")))
        goto out;
    rc = 0;
out:
    kvx_context_params_free(&prm);
    kvx_close(c);
    kvx_close(g);
    return rc;
}
