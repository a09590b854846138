/*
 * pull — the generation side of remote ("D", remote.c's reading order):
 * one rstream per slice of a part, OPENed at its source daemon, pulled
 * into free receive slots round-robin, each piece scattered into the
 * pool as it lands.
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote_int.h"

map_t rstreams;
rrq_t pullq;
uint32_t retrying; /* rstreams waiting to OPEN again */

static void pull_schedule(void);

/* ---- D: the generation side -------------------------------------------- */

static void rq_push(rstream_t *r)
{
    rrq_push(&pullq, &r->turn);
}
static void rq_drop(rstream_t *r)
{
    rrq_remove(&pullq, &r->turn);
}

int send_open(rstream_t *r)
{
    const plan_t *plan = xfer_part_plan(r->part);
    xfer_part_desc_t d;
    xfer_part_describe(r->part, &d);
    const instance_t *inst = d.inst;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerOpen o = KVXFER__PEER_OPEN__INIT;
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    Kvxfer__Layout lay = KVXFER__LAYOUT__INIT;
    o.stream = r->id;
    o.instance_id = (char *)d.src_instance;
    o.request_id = d.src_request;
    o.key.data = (uint8_t *)d.src_key->b;
    o.key.len = d.src_key->len;
    o.consumer_key.data = (uint8_t *)d.key->b;
    o.consumer_key.len = d.key->len;
    o.token.data = (uint8_t *)d.token;
    o.token.len = TOKEN_LEN;
    xfer_side_to_msg(&d.dst, &pc, &lay);
    lay.preset = (char *)xfer_part_pool(r->part)->layout.preset;
    o.dst_parallel = &pc;
    o.dst_layout = &lay;
    o.dst_rank = d.dst_rank;
    o.skip_tokens = d.skip_tokens;
    o.slice = r->slice;
    o.nunits = plan->nunits;
    o.bytes = plan->bytes;
    o.pull_bytes = kvxd.conf.slot_bytes; /* pull_schedule()'s cut */
    uint32_t nd = plan_side_ranks(&d.dst);
    /* the daemon of each rank of the receiving group, in the plan's rank
     * order: the source waits for their streams, and knows whom to miss */
    char **addrs = calloc(nd ? nd : 1, sizeof(char *));
    if (!addrs)
        return KVX_ERR_NOMEM;
    for (uint32_t q = 0; q < inst->nranks; q++) {
        plan_side_t e;
        uint32_t er;
        if (plan_dp_view(&inst->side, q, &e, &er) == d.dp_rank && er < nd)
            addrs[er] = inst->addresses[q];
    }
    for (uint32_t q = 0; q < nd; q++)
        if (!addrs[q])
            addrs[q] = "";
    o.n_dst_addresses = nd;
    o.dst_addresses = addrs;
    o.consumer_instance = (char *)inst->id;
    o.consumer_request = d.request_id;
    /* several block tables: which one, and every table's side */
    Kvxfer__PeerOpenGroup og[XFER_MAX_GROUPS], *ogp[XFER_MAX_GROUPS];
    Kvxfer__ParallelConfig gpc[XFER_MAX_GROUPS];
    Kvxfer__Layout glay[XFER_MAX_GROUPS];
    o.group = d.group;
    for (uint32_t k = 0; d.ngroups > 1 && k < d.ngroups; k++) {
        kvxfer__peer_open_group__init(&og[k]);
        kvxfer__parallel_config__init(&gpc[k]);
        kvxfer__layout__init(&glay[k]);
        xfer_side_to_msg(&d.gdst[k], &gpc[k], &glay[k]);
        glay[k].preset = "";
        og[k].parallel = &gpc[k];
        og[k].layout = &glay[k];
        og[k].skip_tokens = d.gskip[k];
        ogp[k] = &og[k];
    }
    if (d.ngroups > 1) {
        o.n_groups = d.ngroups;
        o.groups = ogp;
    }
    m.m_case = KVXFER__PEER_MSG__M_OPEN;
    m.open = &o;
    int rc = send_on(r->conn, &m);
    free(addrs);
    return rc;
}

int remote_part_start(genpart_t *p, const Kvxfer__ContextParams *cp,
                      kvx_why_t *why)
{
    plan_t *plan = xfer_part_plan(p);
    const pool_t *pool = xfer_part_pool(p);
    if (!peer_enabled()) {
        why_set(why,
                "fetch.context_params: the context ranks are served by "
                "daemon '%s', and transfers between daemons are off here "
                "(peer.listen is empty)",
                cp->rank_addresses[0]);
        return KVX_ERR_UNSUPPORTED;
    }
    if (!pool->gpu) { /* GPU pools: checked below, once unbound */
        int rc = plan_check_bounds(plan, why);
        if (rc)
            return rc;
    }
    if (pool->gpu) {
        /* a GPU destination: the scatter is a kernel reading the slot */
        int rc, dev = pool->device;
        static const kvx_layout_t none; /* sources: packed in the slot */
        for (uint32_t i = 0; i < plan->nslices; i++)
            plan->src[i] = (plan_mem_t){.layout = &none};
        if ((rc = plan_check_bounds(plan, why)) ||
            (rc = slots_device(&rslots, dev, why)) ||
            (rc = xfer_part_upload(p, dev, why)))
            return rc;
    }
    rpart_t *rp = calloc(1, sizeof(*rp) + plan->nslices * sizeof(rstream_t *));
    if (!rp) {
        why_set(why, "fetch: out of memory");
        return KVX_ERR_NOMEM;
    }
    rp->nslices = plan->nslices;
    xfer_part_set_remote(p, rp); /* freed with p, whatever happens below */
    for (uint32_t i = 0; i < plan->nslices; i++) {
        const char *addr = cp->rank_addresses[plan->slices[i].src_rank];
        peer_conn_t *c = peer_connect(addr, why);
        if (!c)
            return KVX_ERR_PEER_GONE;
        rstream_t *r = calloc(1, sizeof(*r));
        if (!r || map_put(&rstreams, next_id, r)) {
            free(r);
            why_set(why, "fetch: out of memory");
            return KVX_ERR_NOMEM;
        }
        r->id = next_id++;
        r->part = p;
        r->conn = peer_conn_id(c);
        r->slice = i;
        r->u_begin = r->next_unit = plan->slices[i].unit_begin;
        r->u_end = i + 1 < plan->nslices ? plan->slices[i + 1].unit_begin
                                         : plan->nunits;
        assert(rp->nstreams < rp->nslices);
        rp->streams[rp->nstreams++] = r;
        if (send_open(r)) {
            r->refused = 1; /* no OPEN out: no OPENED to wait for */
            why_set(why, "fetch: cannot reach daemon %s", addr);
            return KVX_ERR_PEER_GONE;
        }
    }
    return 0;
}

/* End r on the wire and release what waits on it; the slots it holds go
 * back now (PULLED: a late DATA is dropped) or when the pieces landing in
 * them or being scattered from them are back (RECEIVING). */
static void rstream_stop(rstream_t *r, int code, const char *msg)
{
    if (r->ended)
        return;
    r->ended = 1;
    slots_owner_ended(&rslots, r);
    r->end_code = code;
    snprintf(r->end_msg, sizeof(r->end_msg), "%s", msg);
    rq_drop(r);
    peer_conn_t *c = r->opened ? conn_live(r->conn) : NULL;
    if (c)
        send_end(c, r->source, code, msg);
    for (slot_t *x = slot_next(&rslots, NULL); x; x = slot_next(&rslots, x)) {
        /* pulled, or some pieces in and none landing: nothing more will
         * be written into it (landing pieces free it when back) */
        if (x->owner == r &&
            (x->state == SLOT_PULLED ||
             (x->state == SLOT_RECEIVING && !x->landing && !x->pending)))
            slot_put(&rslots, x);
    }
}

void remote_part_stop(genpart_t *p, int code, const char *msg)
{
    const rpart_t *rp = xfer_part_remote(p);
    for (uint32_t i = 0; rp && i < rp->nstreams; i++)
        rstream_stop(rp->streams[i], code, msg);
    pull_schedule();
}

void remote_part_free(rpart_t *rp)
{
    assert(rp->nstreams <= rp->nslices);
    for (uint32_t i = 0; i < rp->nstreams; i++) {
        rstream_t *r = rp->streams[i];
        assert(r->part); /* only a stream of a freed part is an orphan */
        rstream_stop(r, KVX_ERR_STATE, "request ended");
        for (slot_t *x = slot_next(&rslots, NULL); x; x = slot_next(&rslots, x))
            if (x->owner == r) /* a receive still landing */
                x->owner = NULL;
        if (r->retry_ms) { /* refused, waiting to ask again: no OPEN out */
            r->retry_ms = 0;
            retrying--;
            r->refused = 1;
        }
        if (!r->opened && !r->refused && conn_live(r->conn)) {
            /* its OPENED is on the way: kept as an orphan, so the source
             * hears END when it comes (on_opened) */
            r->part = NULL;
            continue;
        }
        map_del(&rstreams, r->id);
        free(r);
    }
    free(rp);
}

/* The slots r receives into: its pool's device's, or the host's. */
static slots_t *rstream_slots(const rstream_t *r)
{
    const pool_t *p = xfer_part_pool(r->part);
    return slots_for(&rslots, p->gpu ? p->device : -1);
}

static void pull_schedule(void)
{
    uint64_t slot_bytes = kvxd.conf.slot_bytes;
    /* in turn: the first waits for a slot of its own set */
    while (pullq.head &&
           rstream_slots(RRQ_OWNER(pullq.head, rstream_t, turn))->nfree) {
        rstream_t *r = RRQ_OWNER(rrq_pop(&pullq), rstream_t, turn);
        if (r->ended || r->next_unit >= r->u_end)
            continue;
        const plan_t *plan = xfer_part_plan(r->part);
        uint64_t u0 = r->next_unit, bytes;
        uint64_t end =
            stream_cut_end(plan, r->u_begin, u0, r->u_end, r->layerwise);
        uint64_t u1 = plan_units_fit(plan, u0, end, slot_bytes, &bytes);
        if (u1 == u0) {
            char m[160];
            snprintf(m, sizeof(m),
                     "a plan unit of %llu bytes exceeds peer.slot_bytes "
                     "(%llu)",
                     (unsigned long long)plan_units_bytes(plan, u0, u0 + 1),
                     (unsigned long long)slot_bytes);
            xfer_part_fail(r->part, KVX_ERR_LIMIT, m);
            continue;
        }
        slot_t *x = slot_get(rstream_slots(r));
        x->state = SLOT_PULLED;
        x->owner = r;
        x->u0 = u0;
        x->u1 = u1;
        x->bytes = bytes;
        x->t_wait = now_ns();
        Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
        Kvxfer__PeerPull pl = KVXFER__PEER_PULL__INIT;
        pl.stream = r->source;
        pl.slot = x->idx;
        pl.unit_begin = u0;
        pl.unit_end = u1;
        m.m_case = KVXFER__PEER_MSG__M_PULL;
        m.pull = &pl;
        r->next_unit = u1;
        r->held++;
        if (send_on(r->conn, &m)) {
            slot_put(&rslots, x);
            assert(r->held > 0);
            r->held--;
            /* a lost connection ends the request from the loop's next
             * turn; a live one could not take the message (memory) */
            if (conn_live(r->conn))
                xfer_part_fail(r->part, KVX_ERR_NOMEM,
                               "out of memory sending a pull");
            continue;
        }
        if (r->next_unit < r->u_end)
            rq_push(r);
    }
}

/* D: the offer's aux came with an OPENED of r: kept for its request's
 * COMPLETE. 0, or 1 when the request failed instead (r may be gone). */
static int opened_aux(peer_conn_t *c, rstream_t *r, const Kvxfer__PeerOpened *o)
{
    char why[256];
    int rc = 0;
    if (o->aux.len > kvxd.conf.aux_bytes) {
        snprintf(why, sizeof(why),
                 "an aux payload of %zu bytes from daemon %s is more than "
                 "limits.aux_bytes (%u) here",
                 o->aux.len, peer_conn_address(c), kvxd.conf.aux_bytes);
        log_warn("%s", why);
        rc = KVX_ERR_LIMIT;
    } else if (o->aux.len) {
        rc = xfer_part_set_aux(r->part, o->aux.data, (uint32_t)o->aux.len,
                               KVX_WHY(why));
    }
    if (rc)
        xfer_part_fail(r->part, rc, why);
    return rc != 0;
}

void on_opened(peer_conn_t *c, const Kvxfer__PeerOpened *o)
{
    rstream_t *r = map_get(&rstreams, o->stream);
    if (!r || r->conn != peer_conn_id(c))
        return;
    if (r->opened) { /* again, with the aux of a publish after the OPEN */
        if (r->source == o->source && r->part && !r->ended)
            opened_aux(c, r, o);
        return;
    }
    r->opened = 1;
    r->source = o->source;
    r->layerwise = o->layerwise;
    if (!r->part) { /* an orphan: its request is gone; say why */
        send_end(c, r->source, r->end_code ? r->end_code : KVX_ERR_STATE,
                 r->end_code ? r->end_msg : "request ended");
        map_del(&rstreams, r->id);
        free(r);
        return;
    }
    if (r->ended) { /* ended while opening: tell it why */
        int code = r->end_code ? r->end_code : xfer_part_end_code(r->part);
        send_end(c, r->source, code ? code : KVX_ERR_STATE,
                 r->end_code ? r->end_msg : "request ended");
        return;
    }
    if (opened_aux(c, r, o))
        return;
    rq_push(r);
    pull_schedule();
}

void *remote_data_target(peer_conn_t *c, const Kvxfer__PeerData *d, size_t len,
                         const peer_iov_t **iov, size_t *niov)
{
    rstream_t *r = map_get(&rstreams, d->stream);
    slot_t *x;
    if (!r || r->conn != peer_conn_id(c) || r->ended ||
        !(x = slot_at(&rslots, d->slot)))
        return NULL;
    /* piece_bytes 0: the whole slot in one message (a sender that does
     * not cut slots) */
    uint64_t pb = d->piece_bytes ? d->piece_bytes : d->bytes;
    const char *bad = NULL;
    int k = -1;
    if (x->owner != r || x->u0 != d->unit_begin || x->u1 != d->unit_end ||
        d->bytes != x->bytes ||
        (x->state != SLOT_PULLED && x->state != SLOT_RECEIVING))
        bad = "does not match its pull";
    else if (!pb || (x->state == SLOT_RECEIVING && pb != x->piece_bytes))
        bad = "is not a piece of its slot";
    if (!bad && x->state == SLOT_PULLED)
        slot_cut(x, xfer_part_plan(r->part), pb);
    if (!bad && ((k = piece_at(x, d->offset)) < 0 || len != x->pc[k].len))
        bad = "is not a piece of its slot";
    else if (!bad && (x->got & (1ull << k)))
        bad = "repeats a piece";
    if (bad) {
        if (x->owner == r && x->state == SLOT_PULLED)
            x->npieces = 0; /* the cut waits for a good first piece */
        log_warn("peer %s: data for stream %llu %s; dropped",
                 peer_conn_address(c), (unsigned long long)d->stream, bad);
        return NULL;
    }
    if (x->state == SLOT_PULLED) {
        x->t_stage = now_ns();
        st_rx.wait_ns += x->t_stage - x->t_wait;
        x->state = SLOT_RECEIVING;
    }
    x->got |= 1ull << k;
    x->landing++;
    /* only where the caller can take places (a lane: the unpack runs on
     * its thread, and its stall check bounds the fence), and a host pool */
    uint32_t n = iov && niov && direct_on && !xfer_part_pool(r->part)->gpu
                     ? piece_places(x, (uint32_t)k, xfer_part_plan(r->part), 0)
                     : 0;
    if (n) {
        /* the fence: the request does not end while UCX writes its
         * blocks (released through scatter_done(), or below) */
        x->part = r->part;
        xfer_part_fence_hold(r->part);
        x->direct |= 1ull << k;
        *iov = x->iov[k];
        *niov = n;
    }
    return x->mem + x->pc[k].off;
}

/* Receive slot x goes back once nothing lands in it and nothing reads it.
 * Returns whether it did. */
static int rslot_release(slot_t *x)
{
    if (x->landing || x->pending)
        return 0;
    rstream_t *r = x->owner;
    if (r) {
        assert(r->held > 0);
        r->held--;
    }
    slot_put(&rslots, x);
    return 1;
}

/* Piece k of receive slot x is scattered into the pool. */
static void scatter_done(slot_t *x, uint32_t k)
{
    rstream_t *r = x->owner;
    genpart_t *part = x->part;
    uint64_t units = x->pc[k].u1 - x->pc[k].u0, bytes = x->pc[k].len;
    int status = x->status;
    assert(x->pending > 0);
    x->pending--;
    x->copied++;
    int whole = x->copied == x->npieces;
    if (whole) {
        st_rx.copy_ns += now_ns() - x->t_stage;
        st_rx.slots++;
        st_rx.bytes += x->bytes;
        x->set->bytes += x->bytes;
    }
    if (r)
        r->units_done += units;
    if (!status) /* in the pool: FetchProgress counts its layers */
        xfer_part_landed(part, x->pc[k].u0, x->pc[k].u1);
    if (whole || status || !r || r->ended) {
        /* the stream is complete: the source may let go (before the
         * progress below, which may free the request and r) */
        if (rslot_release(x) && whole && r && !status && !r->ended &&
            r->units_done == r->u_end - r->u_begin)
            rstream_stop(r, 0, "");
    }
    xfer_part_progress(part, units, bytes, status);
    pull_schedule();
}

void remote_on_data(peer_conn_t *c, const Kvxfer__PeerData *d, int status)
{
    (void)c;
    slot_t *x = slot_at(&rslots, d->slot);
    if (!x)
        return;
    int k = piece_at(x, d->offset);
    if (x->state != SLOT_RECEIVING || !x->landing || k < 0)
        return;
    x->landing--;
    rstream_t *r = x->owner;
    int direct = direct_in(x, (uint32_t)k);
    if (status || x->status || !r || r->ended) {
        int first = status && !x->status;
        if (first)
            x->status = status;
        genpart_t *p = r && !r->ended && first ? r->part : NULL;
        genpart_t *held = direct ? x->part : NULL;
        rslot_release(x);
        if (p)
            xfer_part_fail(p, status,
                           "receiving from the context daemon failed");
        if (held) /* its fence, held since remote_data_target() */
            xfer_part_progress(held, 0, 0, status);
        pull_schedule();
        return;
    }
    if (++x->arrived == x->npieces) {
        uint64_t t = now_ns();
        st_rx.wire_ns += t - x->t_stage;
        x->t_stage = t;
    }
    genpart_t *p = r->part;
    x->part = p;
    if (direct) { /* in its place already: counted as scattered */
        st_rx.direct++;
        x->pending++;
        scatter_done(x, (uint32_t)k);
        return;
    }
    /* the fence: xfer does not finalize the request before the scatter
     * of every piece is back */
    xfer_part_fence_hold(p);
    x->piece_done = scatter_done;
    /* a GPU pool: a kernel reads the piece; else the copy threads */
    piece_copy(x, (uint32_t)k, xfer_part_plan(p), xfer_part_gpu(p), 0);
}

void on_end_to_d(peer_conn_t *c, const Kvxfer__PeerStreamEnd *e)
{
    rstream_t *r = map_get(&rstreams, e->stream);
    if (!r || r->conn != peer_conn_id(c))
        return;
    if (!r->part) { /* an orphan refused: nothing left of it */
        map_del(&rstreams, r->id);
        free(r);
        return;
    }
    if (r->ended)
        return;
    uint64_t now = kvxd_now_ms();
    if (!r->opened)
        r->refused = 1;
    if (e->code == KVX_ERR_NOT_FOUND && !r->opened && !e->final) {
        /* a context rank on that daemon may not have published yet (an
         * instance spread over daemons, a reservation): ask again, until
         * the fetch's deadline */
        if (!r->retry_until_ms)
            r->retry_until_ms = now + kvxd.conf.fetch_timeout_ms;
        if (now < r->retry_until_ms) {
            r->refused = 0;
            if (!r->retry_ms)
                retrying++;
            uint64_t wait = (uint64_t)OPEN_RETRY_FIRST_MS
                            << (r->retries < 4 ? r->retries : 4);
            r->retries++;
            r->retry_ms =
                now + (wait < OPEN_RETRY_MAX_MS ? wait : OPEN_RETRY_MAX_MS);
            return;
        }
    }
    char m[300];
    snprintf(m, sizeof(m), "context side: %s", e->message ? e->message : "");
    xfer_part_fail(r->part, e->code ? e->code : KVX_ERR_STATE, m);
}
