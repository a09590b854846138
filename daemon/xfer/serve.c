/*
 * serve — the verdict on a peer daemon's OPEN (serve.h): is there such
 * an offer, may this consumer read it, does its plan agree with the
 * one the generation daemon made, and is this stream one of those the
 * offer serves. Everything it decides on is the offer's; remote only
 * carries the answer.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/daemon.h"
#include "core/log.h"
#include "serve.h"

/* Refuse with code: the message as a refusal always was (300 bytes). */
static void refuse(xfer_serve_t *v, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void refuse(xfer_serve_t *v, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v->msg, 300, fmt, ap);
    va_end(ap);
    v->code = code;
    v->final = 0;
}

int xfer_token_equal(const ProtobufCBinaryData *t, const uint8_t *ours)
{
    if (t->len != TOKEN_LEN)
        return 0;
    uint8_t d = 0; /* every byte, whatever differs first */
    for (size_t i = 0; i < TOKEN_LEN; i++)
        d |= t->data[i] ^ ours[i];
    return !d;
}

/* Streams that will read o: the slices, over every rank of the receiving
 * group and every block table of the request (gdst, gskip: each table's
 * receiving side and skip, ng of them), whose source rank is served here;
 * the daemons they come from (losing one of them ends o); and which
 * context ranks the consumer reads at all (sv->rread). */
static uint32_t streams_expected(offer_t *o, xfer_served_t *sv,
                                 const plan_side_t *gdst, const uint32_t *gskip,
                                 uint32_t ng, const Kvxfer__PeerOpen *m)
{
    uint32_t n = 0, ranks = plan_side_ranks(&gdst[0]);
    const instance_t *inst = xfer_offer_instance(o);
    if (m->n_dst_addresses == ranks)
        sv->consumer_addrs = calloc(ranks, sizeof(char *));
    free(sv->rread);
    sv->rread = calloc(inst->nranks, 1);
    for (uint32_t t = 0; t < ranks * ng; t++) {
        uint32_t r = t % ranks, tb = t / ranks; /* rank, table */
        plan_t *p;
        char why[64];
        if (xfer_offer_plan(o, tb, &gdst[tb], r, gskip[tb], &p, KVX_WHY(why)))
            continue;
        uint32_t k = 0;
        for (uint32_t i = 0; i < p->nslices; i++) {
            k += inst->local[p->slices[i].src_rank];
            if (sv->rread)
                sv->rread[p->slices[i].src_rank] = 1;
        }
        plan_free(p);
        n += k;
        if (!k || !sv->consumer_addrs)
            continue;
        int seen = 0;
        for (uint32_t j = 0; j < sv->nconsumer_addrs && !seen; j++)
            seen = !strcmp(sv->consumer_addrs[j], m->dst_addresses[r]);
        if (!seen && (sv->consumer_addrs[sv->nconsumer_addrs] =
                          strdup(m->dst_addresses[r])))
            sv->nconsumer_addrs++;
    }
    return n;
}

/* Is there an offer to serve? 0 with v->offer, or the refusal in v. */
static int find_offer(const Kvxfer__PeerOpen *m, const char *ks,
                      xfer_serve_t *v)
{
    instance_t *inst = m->instance_id ? instance_find(m->instance_id) : NULL;
    offer_t *o = inst ? xfer_offer_find(inst, m->request_id) : NULL;
    const reqkey_t *ok = o ? xfer_offer_key(o) : NULL;
    if (ok && (ok->len != m->key.len || memcmp(ok->b, m->key.data, ok->len)))
        o = NULL; /* another key's, whose id collides: not this one */
    int ended = !o || xfer_offer_ending(o) || xfer_offer_consumed(o);
    int gone = ended && m->instance_id
                   ? xfer_offer_gone(m->instance_id, m->request_id, m->key.data,
                                     m->key.len)
                   : 0;
    if (gone) { /* as a fetch that came before the cancel hears it */
        snprintf(v->msg, sizeof(v->msg), "%s",
                 gone == KVX_ERR_CANCELLED ? "cancelled by the context side"
                                           : "released (kvx_release)");
        v->code = gone;
        v->final = 1;
        return gone;
    }
    if ((!o || xfer_offer_ending(o)) && kvxd.draining) {
        /* the drain ended it (or ends it): say so, not "no offer" */
        snprintf(v->msg, sizeof(v->msg), "%s",
                 "the context daemon is shutting down (drain): its offers "
                 "end");
        v->code = KVX_ERR_SHUTDOWN;
        v->final = 1;
        return v->code;
    }
    if (ended) {
        /* every rank of the instance is ours: its offers are all here,
         * so this one ended (or never was) and asking again cannot help;
         * else a rank may not have published yet: the peer asks again */
        int final = inst && inst->joined && inst->addresses;
        for (uint32_t i = 0; final && i < inst->nranks; i++)
            final =
                inst->addresses[i] && !strcmp(inst->addresses[i], kvxd.address);
        snprintf(v->msg, sizeof(v->msg),
                 "no offer for request %s of instance '%s' on daemon %s "
                 "(%s)",
                 ks, m->instance_id ? m->instance_id : "", kvxd.address,
                 o       ? (xfer_offer_consumed(o) ? "consumed" : "ending")
                 : final ? "expired, cancelled or completed"
                         : "not yet published, expired, cancelled or "
                           "completed");
        v->code = KVX_ERR_NOT_FOUND;
        v->final = final || o;
        return v->code;
    }
    v->offer = o;
    return 0;
}

/* The stream's plan, made as the generation daemon made it from the
 * sides the OPEN names: 0 with v->plan and v->dst (gdst, gskip: each
 * block table's side and skip), or the refusal in v. */
static int open_plan(const Kvxfer__PeerOpen *m, const char *ks,
                     plan_side_t *gdst, uint32_t *gskip, xfer_serve_t *v)
{
    offer_t *o = v->offer;
    plan_side_t dst;
    char why[256];
    /* the request's block tables: the fetch gives a side for each */
    uint32_t ng = m->n_groups ? (uint32_t)m->n_groups : 1;
    int rc =
        xfer_side_from_msg(m->dst_parallel, m->dst_layout, &dst, KVX_WHY(why));
    if (!rc && (ng != xfer_offer_ngroups(o) || m->group >= ng)) {
        snprintf(why, sizeof(why),
                 "open: the fetch reads block table %u of %u, the offer of "
                 "request %.64s has %u",
                 m->group, ng, ks, xfer_offer_ngroups(o));
        rc = KVX_ERR_MISMATCH;
    }
    for (uint32_t k = 0; !rc && k < ng; k++) {
        if (m->n_groups && (!m->groups[k]->parallel || !m->groups[k]->layout)) {
            snprintf(why, sizeof(why), "open: groups[%u] has no side", k);
            rc = KVX_ERR_INVALID;
        } else if (m->n_groups) {
            rc =
                xfer_side_from_msg(m->groups[k]->parallel, m->groups[k]->layout,
                                   &gdst[k], KVX_WHY(why));
            gskip[k] = m->groups[k]->skip_tokens;
        } else {
            gdst[0] = dst;
            gskip[0] = m->skip_tokens;
        }
    }
    /* the stream's own table must be the one the tables' list names, and
     * every table received by as many ranks: the count of streams below
     * is made from the list */
    for (uint32_t k = 0; !rc && k < ng; k++)
        if (plan_side_ranks(&gdst[k]) != plan_side_ranks(&dst) ||
            (k == m->group && (gskip[k] != m->skip_tokens ||
                               !plan_side_equal(&gdst[k], &dst)))) {
            snprintf(why, sizeof(why),
                     "open: block table %u's side in groups differs from "
                     "the stream's",
                     k);
            rc = KVX_ERR_MISMATCH;
        }
    if (!rc)
        rc =
            plan_compat(xfer_offer_group_side(o, m->group), &dst, KVX_WHY(why));
    if (!rc && m->dst_rank >= plan_side_ranks(&dst)) {
        snprintf(why, sizeof(why), "open: destination rank %u of %u",
                 m->dst_rank, plan_side_ranks(&dst));
        rc = KVX_ERR_INVALID;
    }
    plan_t *plan = NULL;
    if (!rc)
        rc = xfer_offer_plan(o, m->group, &dst, m->dst_rank, m->skip_tokens,
                             &plan, KVX_WHY(why));
    if (rc) {
        refuse(v, rc, "%s", why);
        return rc;
    }
    const instance_t *inst = xfer_offer_instance(o);
    if (plan->nunits != m->nunits || plan->bytes != m->bytes ||
        m->slice >= plan->nslices ||
        !inst->local[plan->slices[m->slice].src_rank]) {
        plan_free(plan);
        refuse(v, KVX_ERR_MISMATCH,
               "the plan on daemon %s differs (%llu units, %llu bytes) "
               "or slice %u is not served there",
               kvxd.address, (unsigned long long)m->nunits,
               (unsigned long long)m->bytes, m->slice);
        return v->code;
    }
    v->plan = plan;
    v->dst = dst;
    return 0;
}

/* Is the stream one the offer serves to this consumer? The first OPEN
 * makes req->spare the offer's record, counts the streams that will
 * come and takes the offer for the consumer. 0, or the refusal in v. */
static int open_consumer(const xfer_serve_req_t *req, const char *ks,
                         const plan_side_t *gdst, const uint32_t *gskip,
                         xfer_serve_t *v)
{
    const Kvxfer__PeerOpen *m = req->open;
    offer_t *o = v->offer;
    /* one consumer per offer: the generation request (instance and
     * id, the same from every daemon of a spread instance) */
    char who[256];
    xfer_consumer_t cw = {.inst =
                              m->consumer_instance ? m->consumer_instance : "",
                          .key = m->consumer_key.data,
                          .key_len = m->consumer_key.len};
    xfer_consumer_name(&cw, who, sizeof(who));
    /* what remote keeps of o begins with its xfer_served_t */
    xfer_served_t *sv = (xfer_served_t *)xfer_offer_remote(o);
    if (!sv) { /* the first OPEN: freed with o (remote_offer_free()) */
        if (!req->spare) {
            refuse(v, KVX_ERR_NOMEM, "out of memory");
            return v->code;
        }
        sv = req->spare;
        xfer_offer_set_remote(o, (struct roffer *)sv);
        v->spare_used = 1;
    }
    if (sv->rconsumer[0] && strcmp(sv->rconsumer, who)) {
        refuse(v, KVX_ERR_EXISTS,
               "the offer of request %s is already taken by %s", ks,
               sv->rconsumer);
        return v->code;
    }
    if (sv->streams_expect && sv->streams_opened >= sv->streams_expect) {
        refuse(v, KVX_ERR_EXISTS,
               "the offer of request %llu has all its %u streams",
               (unsigned long long)m->request_id, sv->streams_expect);
        return v->code;
    }
    if (!sv->streams_expect) {
        /* the streams of every table of every receiving rank; this one is
         * among them (its side and skip are its table's, checked above) */
        uint32_t ng = m->n_groups ? (uint32_t)m->n_groups : 1;
        uint32_t n = streams_expected(o, sv, gdst, gskip, ng, m);
        if (!n) {
            refuse(v, KVX_ERR_MISMATCH,
                   "open: no stream of request %s is served by daemon "
                   "%s",
                   ks, kvxd.address);
            return v->code;
        }
        sv->streams_expect = n;
        snprintf(sv->rconsumer, sizeof(sv->rconsumer), "%s", who);
        xfer_offer_taken(o);
    }
    v->served = sv;
    return 0;
}

void xfer_offer_serve(const xfer_serve_req_t *req, xfer_serve_t *v)
{
    const Kvxfer__PeerOpen *m = req->open;
    memset(v, 0, sizeof(*v));
    if (!m->key.len || m->key.len > KVX_MAX_KEY ||
        m->consumer_key.len > KVX_MAX_KEY) {
        refuse(v, KVX_ERR_INVALID, "open: a key of %zu bytes (1 to %u)",
               m->key.len, KVX_MAX_KEY);
        return;
    }
    char ks[REQKEY_STR_MAX];
    reqkey_str(m->key.data, m->key.len, ks);
    if (find_offer(m, ks, v))
        return;
    offer_t *o = v->offer;
    if (!xfer_token_equal(&m->token, xfer_offer_token(o))) {
        log_warn("peer %s: forged or stale capability token for offer "
                 "%s/%s",
                 req->peer, xfer_offer_instance(o)->id, ks);
        refuse(v, KVX_ERR_AUTH,
               "capability token does not match the offer of request %s", ks);
        return;
    }
    if (xfer_offer_taken_here(o)) {
        refuse(v, KVX_ERR_EXISTS,
               "the offer of request %s is already taken on daemon %s", ks,
               kvxd.address);
        return;
    }
    plan_side_t gdst[XFER_MAX_GROUPS];
    uint32_t gskip[XFER_MAX_GROUPS];
    if (open_plan(m, ks, gdst, gskip, v))
        return;
    if (open_consumer(req, ks, gdst, gskip, v)) {
        plan_free(v->plan);
        v->plan = NULL;
        return;
    }
    const plan_t *plan = v->plan;
    v->src_rank = plan->slices[m->slice].src_rank;
    v->u_begin = plan->slices[m->slice].unit_begin;
    v->u_end = m->slice + 1 < plan->nslices
                   ? plan->slices[m->slice + 1].unit_begin
                   : plan->nunits;
    uint32_t nl, ready = xfer_offer_ready(o, m->group, v->src_rank, &nl);
    v->layerwise = ready < nl;
    v->aux = xfer_offer_aux(o, &v->aux_len);
}
