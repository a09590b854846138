/*
 * params — the context params of an offer: built once when the
 * offer is made (params_build()), decoded and checked when a fetch or a
 * release brings them back (xfer_params_decode()).
 * The requests' types and what the files of xfer share: xfer_int.h.
 */
#include <assert.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <openssl/sha.h>

#include "common/list.h"
#include "copy/copy.h"
#include "core/daemon.h"
#include "core/log.h"
#include "core/rrq.h"
#include "net/peer.h"
#include "xfer.h"
#include "xfer_int.h"
#include "xfer_remote.h"

/* ---- context params --------------------------------------------------- */

void xfer_side_to_msg(const plan_side_t *s, Kvxfer__ParallelConfig *pc,
                      Kvxfer__Layout *lay)
{
    pc->tp = s->tp;
    pc->pp = s->pp;
    pc->cp = s->cp;
    pc->total_layers = s->total_layers;
    pc->total_kv_heads = s->total_heads;
    pc->n_layers_per_pp = s->num_layers_per_pp;
    pc->layers_per_pp = (uint32_t *)s->layers_per_pp;
    lay->kv_factor = s->kv_factor;
    lay->head_dim = s->head_dim;
    lay->elem_size = s->elem_size;
    lay->dtype = s->dtype;
    lay->tokens_per_block = s->tokens_per_block;
}

int xfer_side_from_msg(const Kvxfer__ParallelConfig *pc,
                       const Kvxfer__Layout *l, plan_side_t *s, kvx_why_t *why)
{
    memset(s, 0, sizeof(*s));
    if (!pc || !l)
        return why_fail(why, KVX_ERR_INVALID,
                        "parallel config or layout missing");
    if (pc->n_layers_per_pp > 64)
        return why_fail(why, KVX_ERR_INVALID,
                        "layers_per_pp has %zu entries (at most 64)",
                        pc->n_layers_per_pp);
    s->tp = pc->tp;
    s->pp = pc->pp;
    s->cp = pc->cp;
    s->total_layers = pc->total_layers;
    s->total_heads = pc->total_kv_heads;
    s->num_layers_per_pp = (uint32_t)pc->n_layers_per_pp;
    for (size_t i = 0; i < pc->n_layers_per_pp; i++)
        s->layers_per_pp[i] = pc->layers_per_pp[i];
    s->kv_factor = l->kv_factor;
    s->head_dim = l->head_dim;
    s->elem_size = l->elem_size;
    s->dtype = l->dtype;
    s->tokens_per_block = l->tokens_per_block;
    int rc = plan_side_check(s, why);
    return rc ? rc : plan_side_layout_check(s, why);
}

int params_build(offer_t *o, const kvx_layout_t *l)
{
    (void)l; /* o->side already holds the layout summary */
    instance_t *inst = o->inst;
    Kvxfer__ContextParams cp = KVXFER__CONTEXT_PARAMS__INIT;
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    Kvxfer__Layout lay = KVXFER__LAYOUT__INIT;
    cp.version = PARAMS_VERSION;
    cp.instance_id = inst->id;
    cp.key.data = o->key.b;
    cp.key.len = o->key.len;
    cp.token.data = o->token;
    cp.token.len = TOKEN_LEN;
    xfer_side_to_msg(&o->side, &pc, &lay);
    lay.preset = o->preset;
    cp.parallel = &pc;
    cp.layout = &lay;
    cp.n_rank_addresses = inst->nranks;
    cp.rank_addresses = inst->addresses;
    cp.num_tokens = o->num_tokens;
    cp.lease_ms = o->lease_ms;
    /* the other groups: their layout summaries and sizes */
    Kvxfer__ParamsGroup pg[XFER_MAX_GROUPS], *pgp[XFER_MAX_GROUPS];
    Kvxfer__ParallelConfig gpc[XFER_MAX_GROUPS];
    Kvxfer__Layout glay[XFER_MAX_GROUPS];
    for (uint32_t k = 1; k < o->ngroups; k++) {
        kvxfer__params_group__init(&pg[k]);
        kvxfer__parallel_config__init(&gpc[k]);
        kvxfer__layout__init(&glay[k]);
        xfer_side_to_msg(&o->gside[k], &gpc[k], &glay[k]);
        glay[k].preset = "";
        pg[k].layout = &glay[k];
        pg[k].total_layers = o->gside[k].total_layers;
        pg[k].total_kv_heads = o->gside[k].total_heads;
        pg[k].num_tokens = o->gtokens[k];
        pg[k].first_block = o->gfirst[k];
        pgp[k - 1] = &pg[k];
    }
    cp.n_groups = o->ngroups - 1;
    cp.groups = pgp;
    o->params_len = kvxfer__context_params__get_packed_size(&cp);
    if (!(o->params = malloc(o->params_len)))
        return KVX_ERR_NOMEM;
    kvxfer__context_params__pack(&cp, o->params);
    return 0;
}

int xfer_params_decode(const uint8_t *buf, size_t len,
                       Kvxfer__ContextParams **out, kvx_why_t *why)
{
    if (len == 0 || len > PARAMS_MAX)
        return why_fail(why, KVX_ERR_INVALID,
                        "fetch.context_params: %zu bytes (expected 1..%u)", len,
                        PARAMS_MAX);
    Kvxfer__ContextParams *p = kvxfer__context_params__unpack(NULL, len, buf);
    if (!p)
        return why_fail(why, KVX_ERR_INVALID,
                        "fetch.context_params: not a ContextParams message");
    const char *bad = NULL;
    if (p->version != PARAMS_VERSION)
        bad = "version";
    else if (!p->instance_id[0] || strlen(p->instance_id) > INSTANCE_ID_MAX)
        bad = "instance_id";
    else if (p->key.len == 0 || p->key.len > KVX_MAX_KEY)
        bad = "key";
    else if (p->token.len != TOKEN_LEN)
        bad = "token";
    else if (!p->parallel || !p->layout)
        bad = "parallel or layout missing";
    else if (p->n_rank_addresses < 1 || p->n_rank_addresses > KVX_MAX_RANKS)
        bad = "rank_addresses";
    else if (p->num_tokens == 0)
        bad = "num_tokens";
    else if (p->n_groups >= XFER_MAX_GROUPS)
        bad = "groups";
    for (size_t k = 0; !bad && k < p->n_groups; k++)
        if (!p->groups[k]->layout || !p->groups[k]->num_tokens)
            bad = "groups";
    if (bad) {
        kvxfer__context_params__free_unpacked(p, NULL);
        return why_fail(why, KVX_ERR_INVALID,
                        "fetch.context_params: invalid %s", bad);
    }
    /* params of an earlier run of this daemon name memory it no longer
     * knows: refused by that cause, before anything looks them up */
    for (size_t i = 0; i < p->n_rank_addresses; i++) {
        char w[400];
        if (peer_address_alias(p->rank_addresses[i], KVX_WHY(w)) ==
            KVX_ERR_PEER_GONE) {
            kvxfer__context_params__free_unpacked(p, NULL);
            return why_fail(why, KVX_ERR_PEER_GONE,
                            "fetch.context_params: rank_addresses[%zu]: %s", i,
                            w);
        }
    }
    *out = p;
    return 0;
}
