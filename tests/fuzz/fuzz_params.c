/*
 * fuzz_params — xfer_params_decode, the decoder of context params (bytes
 * a router carries from the context side to the generation side, so
 * untrusted). Whatever it accepts must have every property xfer_fetch
 * relies on, and must still be accepted after a re-encode.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pb_quirk.h"
#include "xfer/instance.h"
#include "xfer/xfer.h"

#define MUST(c)                                                             \
    do {                                                                    \
        if (!(c)) {                                                         \
            fprintf(stderr, "fuzz_params: %s:%d: %s\n", __FILE__, __LINE__, \
                    #c);                                                    \
            abort();                                                        \
        }                                                                   \
    } while (0)

static void accepted(const Kvxfer__ContextParams *p)
{
    MUST(p != NULL);
    MUST(p->version == 1);
    MUST(p->instance_id && p->instance_id[0]);
    MUST(strlen(p->instance_id) <= INSTANCE_ID_MAX);
    MUST(p->token.len == 16 && p->token.data);
    MUST(p->parallel && p->layout);
    MUST(p->n_rank_addresses >= 1 && p->n_rank_addresses <= KVX_MAX_RANKS);
    for (size_t i = 0; i < p->n_rank_addresses; i++)
        MUST(p->rank_addresses[i] != NULL);
    MUST(p->num_tokens > 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Kvxfer__ContextParams *p = NULL;
    char why[256];
    memset(why, 0x55, sizeof(why));
    int rc = xfer_params_decode(data, size, &p, KVX_WHY(why));
    if (rc) {
        MUST(rc == KVX_ERR_INVALID);
        MUST(p == NULL);
        MUST(memchr(why, 0, sizeof(why)) != NULL);
        MUST(strncmp(why, "fetch.context_params", 20) == 0);
        return 0;
    }
    accepted(p);
    size_t n = kvxfer__context_params__get_packed_size(p);
    uint8_t *b = malloc(n ? n : 1);
    MUST(b != NULL);
    MUST(kvxfer__context_params__pack(p, b) == n);
    if (n >= 1 && n <= 65536) {
        Kvxfer__ContextParams *q = NULL;
        int rc2 = xfer_params_decode(b, n, &q, KVX_WHY(why));
        if (rc2) {
            MUST(has_field0(&p->base));
            goto out;
        }
        accepted(q);
        MUST(q->key.len == p->key.len &&
             !memcmp(q->key.data, p->key.data, q->key.len));
        MUST(q->num_tokens == p->num_tokens);
        MUST(!memcmp(q->token.data, p->token.data, 16));
        MUST(!strcmp(q->instance_id, p->instance_id));
        kvxfer__context_params__free_unpacked(q, NULL);
    }
out:
    free(b);
    kvxfer__context_params__free_unpacked(p, NULL);
    return 0;
}
