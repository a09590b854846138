/*
 * remote — transfers between daemons: the generation daemon pulls each
 * slice of a part from the daemon serving its source rank, through
 * staging slots, pipelined.
 *
 * Reading order (generation daemon, "D"):
 *   remote_part_start()  one rstream per slice; OPEN to the source daemon
 *                        with the capability token and what the plan needs
 *   on_opened()          the source accepted: the stream joins the pull
 *                        queue
 *   pull_schedule()      round-robin over streams: a free receive slot gets
 *                        the next units that fit in it, asked for by PULL
 *   remote_data_target / remote_on_data
 *                        DATA lands in the slot, piece by piece
 *                        (rendezvous straight into its place); each piece
 *                        in is scattered into the pool at once
 *                        (piece_copy: copy threads, or a kernel for a GPU
 *                        pool) while the next ones are on the wire;
 *                        scatter_done() counts its units in xfer, and the
 *                        last one frees the slot. peer.direct: a piece
 *                        whose destination runs are long (piece_places)
 *                        is received by UCX into the host pool itself,
 *                        an iov of those runs, and counted as scattered
 *                        when it is in
 *   on_end_to_d()        the source refused or ended the stream; "not
 *                        yet published" is asked again until the
 *                        fetch's deadline
 * (context daemon, "S"):
 *   on_open()            asks xfer for its verdict (xfer_offer_serve():
 *                        the offer, the token, the same plan, the streams
 *                        it will serve) and makes the stream it allows
 *   on_pull()/serve_pulls()
 *                        a free send slot is cut into pieces of
 *                        remote_message_bytes() on unit boundaries
 *                        (slot_cut, the same cut the receiver checks);
 *                        each piece is gathered (piece_copy: copy threads,
 *                        or a kernel writing the pinned slot) and sent the
 *                        moment it is (gather_done; peer.c keeps
 *                        peer.send_window messages in flight); the last
 *                        one back frees the slot (on_sent, sslot_release).
 *                        peer.direct: a piece whose source runs are long
 *                        is not gathered but sent by UCX from an iov of
 *                        them (slot_gather, piece_places), and counts as
 *                        gathered when UCX gives it back (on_sent_direct)
 *   ahead_fill()/ahead_take()
 *                        peer.gather_ahead: free send slots gather the
 *                        units of a stream's next PULLs (cut as the
 *                        receiver cuts, OPEN's pull_bytes); a PULL for
 *                        them sends at once
 *   on_end()             the generation side is done with the stream; the
 *                        last one completes the offer
 * Either side: a lost connection ends every stream on it.
 *
 * Owns the slots (registered with UCX once), the streams, their copy
 * jobs and the iovs of pieces received into pools. The fences: a
 * request's scatters and direct receives (D) and an offer's gathers (S)
 * are counted in the request, which xfer does not finalize before they
 * are back. A direct receive holds its request's fence from the moment
 * its places are handed to UCX (remote_data_target) until UCX gives it
 * back, done or failed (remote_on_data); a direct send counts as a
 * gather until UCX gives it back (on_sent_direct). Every other receive
 * and send touches only slots, daemon memory.
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote.h"
#include "remote_int.h"

void remote_offer_free(roffer_t *ro)
{
    assert(list_empty(&ro->streams)); /* the offer ended them */
    for (uint32_t i = 0; i < ro->sv.nconsumer_addrs; i++)
        free(ro->sv.consumer_addrs[i]);
    free(ro->sv.consumer_addrs);
    free(ro->sv.rread);
    free(ro);
}
static const char *offer_taker(const offer_t *o)
{
    return RO(o)->sv.rconsumer[0] ? RO(o)->sv.rconsumer : NULL;
}
static uint32_t offer_streams(const offer_t *o, uint32_t *done)
{
    *done = RO(o)->sv.streams_done;
    return RO(o)->sv.streams_expect;
}
int remote_init(kvx_why_t *why)
{
    /* what xfer and net call, whether peers are on or not */
    static const xfer_remote_ops_t ops = {.part_start = remote_part_start,
                                          .part_stop = remote_part_stop,
                                          .part_free = remote_part_free,
                                          .offer_stop = remote_offer_stop,
                                          .offer_published =
                                              remote_offer_published,
                                          .offer_free = remote_offer_free,
                                          .offer_taker = offer_taker,
                                          .offer_streams = offer_streams};
    xfer_set_remote_ops(&ops);
    static const int kinds[] = {
        KVXFER__PEER_MSG__M_OPEN, KVXFER__PEER_MSG__M_OPENED,
        KVXFER__PEER_MSG__M_PULL, KVXFER__PEER_MSG__M_OFFER_DONE,
        KVXFER__PEER_MSG__M_END};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        peer_on_msg(kinds[i], remote_on_msg);
    peer_on_lost(remote_on_conn_lost);
    static const peer_data_ops_t data = {.target = remote_data_target,
                                         .arrived = remote_on_data,
                                         .streams = remote_conn_streams};
    peer_set_data_ops(&data);
    /* auto: where copies, not threads, are short, and not where UCX may
     * use RDMA (an iov gives up its zero-copy rendezvous there) */
    direct_on = kvxd.conf.direct == 1 ||
                (kvxd.conf.direct == 2 && kvxd_cpus() < 4 && !peer_rdma());
    if (!peer_enabled())
        return 0;
    if (kvxd.conf.direct == 2)
        log_info("peers: sending from and receiving into host pools "
                 "(peer.direct auto): %s (%d CPUs, %s)",
                 direct_on ? "on" : "off", kvxd_cpus(),
                 peer_rdma() ? "an RDMA device" : "no RDMA device");
    int rc;
    if ((rc = slots_init(&rslots, "receive", &st_rx, why)) ||
        (rc = slots_init(&sslots, "send", &st_tx, why)))
        return rc;
    log_info("peers: %u + %u host staging slots of %llu bytes, registered "
             "with UCX (pinned for CUDA on first GPU use)",
             remote_slots(), remote_slots(),
             (unsigned long long)kvxd.conf.slot_bytes);
    return 0;
}
void remote_cleanup(void)
{
    while (!list_empty(&done_notes)) {
        done_note_t *n = DONE_NOTE(done_notes.next);
        list_remove(&n->node);
        free(n);
    }
    ndone_notes = 0;
    while (!list_empty(&ofails)) {
        offer_fail_t *f = LIST_OWNER(ofails.next, offer_fail_t, node);
        list_remove(&f->node);
        free(f);
    }
    slots_cleanup(&rslots);
    slots_cleanup(&sslots);
    map_free(&rstreams);
    map_free(&sstreams);
}

void remote_on_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    switch (m->m_case) {
    case KVXFER__PEER_MSG__M_OPEN:
        on_open(c, m->open);
        break;
    case KVXFER__PEER_MSG__M_OPENED:
        on_opened(c, m->opened);
        break;
    case KVXFER__PEER_MSG__M_PULL:
        on_pull(c, m->pull);
        break;
    case KVXFER__PEER_MSG__M_OFFER_DONE:
        on_offer_done(c, m->offer_done);
        break;
    case KVXFER__PEER_MSG__M_END:
        /* the direction tells which side it is for: streams a daemon
         * opened are rstreams; END from their source names our id */
        if (m->end->stream && map_get(&rstreams, m->end->stream) &&
            ((rstream_t *)map_get(&rstreams, m->end->stream))->conn ==
                peer_conn_id(c))
            on_end_to_d(c, m->end);
        else
            on_end(c, m->end);
        break;
    default: /* kinds agree.c registered go there */
        break;
    }
}

/* A request, by its stable names: ending one request can free others'
 * streams, so the streams are read first and the requests ended after. */
typedef struct req_ref {
    instance_t *inst; /* instances are freed only by instance_tick() */
    uint64_t id;
} req_ref_t;

int remote_on_conn_lost(peer_conn_t *c, int code, const char *msg)
{
    uint32_t n = rstreams.n + sstreams.n, k = 0;
    void **v = calloc(n ? n : 1, sizeof(*v));
    req_ref_t *fetches = calloc(n ? n : 1, sizeof(*fetches));
    req_ref_t *offers = calloc(n ? n : 1, sizeof(*offers));
    uint32_t nf = 0, no = 0;
    if (!v || !fetches || !offers) { /* nothing done: asked again */
        log_error("remote: out of memory ending the transfers with %s",
                  peer_conn_address(c));
        free(v);
        free(fetches);
        free(offers);
        return KVX_ERR_NOMEM;
    }
    /* D: nothing more goes to c; orphans on it go now */
    k = map_values(&rstreams, v, rstreams.n);
    for (uint32_t i = 0; i < k; i++) {
        rstream_t *r = v[i];
        if (r->conn != peer_conn_id(c))
            continue;
        r->opened = 0;
        r->refused = 1;
        if (!r->part) {
            map_del(&rstreams, r->id);
            free(r);
        } else if (!r->ended) {
            xfer_part_desc_t d;
            xfer_part_describe(r->part, &d);
            fetches[nf++] = (req_ref_t){d.inst, d.request_id};
        }
    }
    /* S: the streams on c end here (no END can reach it) */
    k = map_values(&sstreams, v, sstreams.n);
    for (uint32_t i = 0; i < k; i++) {
        sstream_t *s = v[i];
        if (s->conn != peer_conn_id(c) || s->ended || !s->offer)
            continue;
        offers[no++] = (req_ref_t){xfer_offer_instance(s->offer),
                                   xfer_offer_request(s->offer)};
        sstream_end(s); /* may free s */
    }
    for (uint32_t i = 0; i < nf; i++)
        xfer_fetch_fail(fetches[i].inst, fetches[i].id,
                        code == KVX_ERR_AUTH ? KVX_ERR_AUTH : KVX_ERR_PEER_GONE,
                        msg);
    for (uint32_t i = 0; i < no; i++) {
        offer_t *o = xfer_offer_find(offers[i].inst, offers[i].id);
        if (o)
            xfer_offer_remote_done(o, 0, KVX_ERR_PEER_GONE, msg);
    }
    free(v);
    free(fetches);
    free(offers);
    /* S: offers still waiting for streams from that daemon */
    for (instance_t *i = instance_first(); i; i = instance_next(i)) {
        uint32_t nids = i->offers.n;
        uint64_t *ids = calloc(nids ? nids : 1, sizeof(*ids));
        nids = ids ? map_keys(&i->offers, ids, nids) : 0;
        for (uint32_t j = 0; j < nids; j++) {
            offer_t *o = xfer_offer_find(i, ids[j]);
            if (o && offer_waits_for(o, peer_conn_address(c)))
                xfer_offer_remote_done(o, 0, KVX_ERR_PEER_GONE, msg);
        }
        free(ids);
    }
    return 0;
}

void remote_tick(uint64_t now)
{
    if (!peer_enabled())
        return;
    done_notes_tick(now);
    while (!list_empty(&ofails)) { /* sources serve_pulls() could not bind */
        offer_fail_t *f = LIST_OWNER(ofails.next, offer_fail_t, node);
        list_remove(&f->node);
        instance_t *inst = instance_find(f->instance);
        offer_t *o = inst ? xfer_offer_find(inst, f->request_id) : NULL;
        if (o)
            xfer_offer_end(o, KVX_EVENT_ERROR, f->code,
                           "binding the source for a peer failed");
        free(f);
    }
    if (!list_empty(&pulls))
        serve_pulls(); /* slots put back where no PULL was served */
    uint32_t n = rstreams.n;
    if (!n || !retrying)
        return;
    /* by id: ending one request (out of memory below) frees its other
     * streams, which may come later in this list */
    void **v = calloc(n, sizeof(*v));
    uint64_t *ids = calloc(n, sizeof(*ids));
    if (!v || !ids) {
        free(v);
        free(ids);
        return;
    }
    n = map_values(&rstreams, v, n);
    for (uint32_t i = 0; i < n; i++)
        ids[i] = ((rstream_t *)v[i])->id;
    free(v);
    for (uint32_t i = 0; i < n; i++) {
        rstream_t *r = map_get(&rstreams, ids[i]);
        if (r && r->retry_ms && now >= r->retry_ms) {
            r->retry_ms = 0;
            retrying--;
            if (r->ended || !r->part || send_open(r)) {
                r->refused = 1; /* no OPEN out: no OPENED to wait for */
                if (!r->ended && r->part && conn_live(r->conn))
                    xfer_part_fail(r->part, KVX_ERR_NOMEM,
                                   "out of memory sending an OPEN");
            }
        }
    }
    free(ids);
}

uint32_t remote_conn_streams(const peer_conn_t *c)
{
    uint32_t n = 0, k;
    void **v = calloc(rstreams.n + sstreams.n + 1, sizeof(*v));
    if (!v)
        return 0;
    k = map_values(&rstreams, v, rstreams.n);
    for (uint32_t i = 0; i < k; i++)
        n += ((rstream_t *)v[i])->conn == peer_conn_id(c) &&
             !((rstream_t *)v[i])->ended;
    k = map_values(&sstreams, v, sstreams.n);
    for (uint32_t i = 0; i < k; i++)
        n += ((sstream_t *)v[i])->conn == peer_conn_id(c) &&
             !((sstream_t *)v[i])->ended;
    free(v);
    return n;
}

void remote_ucx_info(Kvxfer__UcxInfo *info)
{
    int on = peer_enabled();
    info->slots = on ? remote_slots() : 0;
    info->message_bytes = on ? remote_message_bytes() : 0;
    static Kvxfer__SlotTimes rx, tx;
    kvxfer__slot_times__init(&rx);
    kvxfer__slot_times__init(&tx);
    if (on)
        remote_slot_times(&rx, &tx);
    info->received = &rx;
    info->sent = &tx;
    /* "gpu" once a GPU pool's slots are in its device's memory (either
     * direction): the pieces of host pools still go through host slots */
    if (on && (rx.gpu_slots || tx.gpu_slots))
        info->staging = "gpu";
}
