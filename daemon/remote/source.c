/*
 * source — the context side of remote ("S", remote.c's reading order):
 * the streams peer daemons read from our offers, opened on xfer's
 * verdict (xfer_offer_serve()), their PULLs served from send slots
 * gathered (or gathered ahead), and the offer-done notes to daemons
 * whose ranks the consumer does not read.
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote_int.h"

map_t sstreams;
list_t pulls = {&pulls, &pulls};
list_t ofails = {&ofails, &ofails};
list_t done_notes = {&done_notes, &done_notes};
uint32_t ndone_notes;

const roffer_t roffer_none = {.streams = {(list_t *)&roffer_none.streams,
                                          (list_t *)&roffer_none.streams}};

static roffer_t *roffer_new(void)
{
    roffer_t *ro = calloc(1, sizeof(*ro));
    if (ro)
        list_init(&ro->streams);
    return ro;
}

static int done_notes_apply(offer_t *o);
static void offer_done_notify(offer_t *o);

/* ---- S: the context side ----------------------------------------------- */

/* s's slots gathered ahead are no longer held for a PULL: idle ones go
 * back now, one still gathering when its gather is back (the caller
 * frees s, or sslot_release() does, once nothing counts in it). */
static void ahead_release(sstream_t *s)
{
    for (uint32_t i = 0; i < s->nahead; i++) {
        slot_t *x = s->ahead[i];
        x->ahead = 0;
        if (!x->pending) {
            assert(s->sends > 0);
            s->sends--;
            slot_put(&sslots, x);
        }
    }
    s->nahead = 0;
}

static void sstream_free(sstream_t *s)
{
    map_del(&sstreams, s->id);
    gpu_part_free(s->gpu);
    plan_free(s->plan);
    free(s);
}

/* Detach s from its offer (ended); freed once its copies are back. */
void sstream_end(sstream_t *s)
{
    if (s->ended)
        return;
    s->ended = 1;
    slots_owner_ended(&sslots, s);
    /* a stream not ended is on its offer's list */
    assert(s->offer && list_linked(&s->node));
    list_remove(&s->node);
    s->offer = NULL;
    /* pulls of s still queued go */
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &pulls)
    {
        pull_t *q = PULL(n);
        if (q->s != s)
            continue;
        list_remove(n);
        assert(s->queued > 0);
        s->queued--;
        free(q);
    }
    assert(s->queued == 0);
    ahead_release(s);
    if (!s->gathers && !s->sends)
        sstream_free(s);
}

static void open_refuse(peer_conn_t *c, uint64_t dst_id, int code,
                        const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void open_refuse(peer_conn_t *c, uint64_t dst_id, int code,
                        const char *fmt, ...)
{
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    send_end(c, dst_id, code, msg);
}

/* S: did o wait for streams from the daemon at addr? */
int offer_waits_for(const offer_t *o, const char *addr)
{
    const roffer_t *ro = RO(o);
    if (xfer_offer_ending(o) || !ro->sv.streams_expect ||
        ro->sv.streams_done >= ro->sv.streams_expect)
        return 0;
    for (uint32_t j = 0; j < ro->sv.nconsumer_addrs; j++)
        if (!strcmp(ro->sv.consumer_addrs[j], addr))
            return 1;
    return 0;
}

/* S: OPENED for stream s, with the offer's aux when it has one; sent
 * again, with it, when a publish brings it later (before that publish's
 * data is gathered: remote_offer_published()). */
static void opened_send(peer_conn_t *c, sstream_t *s, const uint8_t *aux,
                        uint32_t alen)
{
    Kvxfer__PeerMsg r = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerOpened op = KVXFER__PEER_OPENED__INIT;
    op.stream = s->dst_id;
    op.source = s->id;
    op.aux.data = (uint8_t *)aux;
    op.aux.len = alen;
    op.layerwise = s->layerwise;
    s->aux_sent = alen > 0;
    r.m_case = KVXFER__PEER_MSG__M_OPENED;
    r.opened = &op;
    peer_send(c, &r);
}

/* S: a peer daemon OPENs a stream of one of our offers: xfer's verdict
 * (xfer_offer_serve()), carried to the wire, and on serve the stream. */
void on_open(peer_conn_t *c, const Kvxfer__PeerOpen *m)
{
    roffer_t *spare = roffer_new(); /* the offer's, if its first OPEN */
    xfer_serve_req_t req = {.open = m,
                            .peer = peer_conn_address(c),
                            .spare = spare ? &spare->sv : NULL};
    xfer_serve_t v;
    xfer_offer_serve(&req, &v);
    if (!v.spare_used)
        free(spare);
    if (v.code) {
        send_end_ex(c, m->stream, v.code, v.msg, v.final);
        return;
    }
    sstream_t *s = calloc(1, sizeof(*s));
    if (!s || map_put(&sstreams, next_id, s)) {
        free(s);
        plan_free(v.plan);
        open_refuse(c, m->stream, KVX_ERR_NOMEM, "out of memory");
        return;
    }
    plan_t *plan = v.plan;
    list_init(&s->node);
    s->id = next_id++;
    s->dst_id = m->stream;
    s->conn = peer_conn_id(c);
    s->offer = v.offer;
    s->fence = v.offer;
    s->plan = plan;
    s->slice = m->slice;
    s->group = m->group;
    s->src_rank = v.src_rank;
    s->u_begin = v.u_begin;
    s->u_end = v.u_end;
    s->layerwise = v.layerwise;
    /* a PULL larger than our slots is refused anyway: no gather-ahead */
    s->pull_bytes = m->pull_bytes <= kvxd.conf.slot_bytes ? m->pull_bytes : 0;
    s->ahead_at = s->u_begin;
    /* the row shape of the packed units; only these fields are read */
    memset(&s->dst_layout, 0, sizeof(s->dst_layout));
    s->dst_layout.kv_factor = v.dst.kv_factor;
    s->dst_layout.head_dim = v.dst.head_dim;
    s->dst_layout.elem_size = v.dst.elem_size;
    plan->dst.layout = &s->dst_layout;
    roffer_t *ro = (roffer_t *)v.served; /* its first member */
    ro->sv.streams_opened++;
    assert(ro->sv.streams_opened <= ro->sv.streams_expect);
    list_push(ro->streams.next, &s->node); /* first: newest first */
    opened_send(c, s, v.aux, v.aux_len);
}

/* Send slot x goes back once every piece is gathered and every piece
 * sent is back from UCX; gathered ahead, once its PULL has come and it
 * is sent, or once the stream has ended. */
static void sslot_release(slot_t *x)
{
    sstream_t *s = x->owner;
    if (x->pending || x->sends_left || (x->ahead && !s->ended))
        return;
    if (!x->status && x->pulled) {
        st_tx.wire_ns += now_ns() - x->t_stage;
        st_tx.slots++;
        st_tx.bytes += x->bytes;
        x->set->bytes += x->bytes;
    }
    assert(s->sends > 0);
    s->sends--;
    slot_put(&sslots, x);
    if (s->ended && !s->gathers && !s->sends)
        sstream_free(s);
    serve_pulls();
}

static void on_sent(void *arg, int status)
{
    (void)status; /* a failed send fails the connection, which ends s */
    slot_t *x = arg;
    x->sends_left--;
    sslot_release(x);
}

static void piece_gathered(slot_t *x);

/* A piece sent from its places in the pool is back from UCX (status: a
 * failed send fails the connection, which ends s): only now is it
 * gathered, and the offer's fence may let go of its memory. */
static void on_sent_direct(void *arg, int status)
{
    (void)status;
    struct piece_ref *ref = arg;
    slot_t *x = ref->x;
    direct_in(x, ref->k);
    x->sends_left--;
    piece_gathered(x); /* x->pending counted it: x stays till here */
}

/* Send piece k of x to the receiver's slot: from the slot, or, niov > 0,
 * from its places x->iov[k] in the pool (peer.direct; x->pending counts
 * the piece until UCX gives it back). */
static void piece_send(slot_t *x, uint32_t k, uint32_t niov)
{
    sstream_t *s = x->owner;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerData d = KVXFER__PEER_DATA__INIT;
    d.stream = s->dst_id;
    d.slot = x->dst_slot;
    d.unit_begin = x->u0;
    d.unit_end = x->u1;
    d.bytes = x->bytes;
    d.piece_bytes = x->piece_bytes;
    d.offset = x->pc[k].off;
    m.m_case = KVXFER__PEER_MSG__M_DATA;
    m.data = &d;
    /* counted before: a failure may call back at once; the caller keeps x
     * (x->pending still counts this piece, or sends_left another) */
    x->sends_left++;
    peer_conn_t *c = conn_live(s->conn);
    if (niov) {
        int rc =
            c ? peer_send_data(
                    c, &(peer_piece_t){&m, NULL, x->pc[k].len, x->iov[k], niov,
                                       on_sent_direct, &x->ref[k], s->rails})
              : KVX_ERR_PEER_GONE;
        if (!rc)
            return;
        /* never called back: not sent. With the connection still up (no
         * memory) the stream ends with the error, as a failed gather */
        if (c && peer_conn_alive(c) && !x->status)
            x->status = rc;
        on_sent_direct(&x->ref[k], rc);
        return;
    }
    if (!c ||
        peer_send_data(c, &(peer_piece_t){&m, x->mem + d.offset, x->pc[k].len,
                                          NULL, 0, on_sent, x, s->rails}))
        x->sends_left--; /* the connection is gone: never called back */
}

static void ahead_drop(sstream_t *s, slot_t *x);

/* Piece k of send slot x is gathered: it goes now, while the next ones
 * are still being gathered (peer.c keeps peer.send_window messages in
 * flight and queues the rest in order); gathered ahead, it waits for its
 * PULL (ahead_take()). */
static void gather_done(slot_t *x, uint32_t k)
{
    sstream_t *s = x->owner;
    if (!x->status && !s->ended) {
        if (x->pulled)
            piece_send(x, k, 0);
        else
            x->ready |= 1ull << k;
    }
    piece_gathered(x);
}

/* One piece of send slot x less to gather (or to send from its places):
 * after the last, the offer's memory is no longer read. */
static void piece_gathered(slot_t *x)
{
    sstream_t *s = x->owner;
    assert(x->pending > 0);
    if (--x->pending)
        return;
    /* every piece is gathered: the offer's memory is no longer read */
    offer_t *o = s->fence;
    assert(s->gathers > 0);
    s->gathers--;
    xfer_offer_fence_release(o);
    uint64_t t = now_ns();
    if (x->pulled)
        st_tx.copy_ns += t - x->t_stage;
    else
        x->gather_ns = t - x->t_stage; /* counted if its PULL comes */
    x->t_stage = t;
    if (x->status && !s->ended) {
        if (x->ahead)
            ahead_drop(s, x); /* not put back by sstream_end(): below */
        char e[128];
        snprintf(e, sizeof(e), "gather failed: %s", kvx_status_str(x->status));
        peer_conn_t *c = peer_conn_find(s->conn); /* lost: still named */
        if (c && peer_conn_alive(c))
            send_end(c, s->dst_id, x->status, e);
        sstream_end(s); /* s stays: x still counts in s->sends */
        if (!xfer_offer_ending(o)) {
            /* the offer ends with the error (not at its backstop lease):
             * the generation side's END back finds the stream ended */
            char m[128];
            snprintf(m, sizeof(m), "gathering for peer daemon %s failed",
                     c ? peer_conn_address(c) : "(gone)");
            xfer_offer_end(o, KVX_EVENT_ERROR, x->status, m); /* may free o */
            sslot_release(x);
            return;
        }
    }
    if (xfer_offer_fence_done(o))
        xfer_offer_fenced(o); /* may free o: not used below */
    sslot_release(x);
}

/* The slots s gathers into: its source pool's device's (once
 * slots_device() made them, at s's first bind), or the host's. */
static slots_t *sstream_slots(const sstream_t *s, offer_t *o)
{
    plan_mem_t mem;
    const pool_t *src =
        o ? xfer_offer_source(o, s->group, s->src_rank, &mem) : NULL;
    return slots_for(&sslots, src && src->gpu ? src->device : -1);
}

/* Bind s's plan to the published source (it stays until the offer ends,
 * which waits for our gathers); a GPU source gets its plan uploaded, once.
 * Slices of other ranks stay unbound: s gathers only its own. */
static int sstream_bind(sstream_t *s, offer_t *o)
{
    static const kvx_layout_t none;
    plan_t *pl = s->plan;
    plan_mem_t mem;
    pool_t *src = xfer_offer_source(o, s->group, s->src_rank, &mem);
    assert(src); /* serve_pulls() waits for its publish */
    if (s->gpu || (pl->src[s->slice].regions && !src->gpu))
        return 0;
    for (uint32_t i = 0; i < pl->nslices; i++)
        pl->src[i] = i == s->slice ? mem : (plan_mem_t){.layout = &none};
    char why[256];
    int rc;
    if ((rc = plan_check_bounds(pl, KVX_WHY(why)))) {
        pl->src[s->slice] = (plan_mem_t){.layout = &none};
        log_warn("peer stream %llu: %s", (unsigned long long)s->id, why);
        return rc;
    }
    if (!src->gpu)
        return 0;
    int dev = src->device;
    pl->dst = (plan_mem_t){.layout = &s->dst_layout};
    if ((rc = slots_device(&sslots, dev, KVX_WHY(why))) ||
        (rc = pool_device_view(src, dev, &pl->src[s->slice].regions,
                               KVX_WHY(why))) ||
        (rc = gpu_part_create(pl, dev, &s->gpu, KVX_WHY(why)))) {
        log_warn("peer stream %llu: %s", (unsigned long long)s->id, why);
        return rc;
    }
    /* its slots go over the NICs nearest to its GPU */
    char bus[16];
    s->rails = gpu_pci_id(dev, bus, sizeof(bus)) ? 0 : peer_gpu_rails(bus);
    return 0;
}

/* Are units [u0, u1) of s's slice there to gather: its rank published,
 * and every layer they touch ready (a layer-wise part's come one by
 * one; the units of a slice run layer by layer, nsegs a layer)? */
static int units_ready(const sstream_t *s, const offer_t *o, uint64_t u1)
{
    uint32_t nl, ready = xfer_offer_ready(o, s->group, s->src_rank, &nl);
    const plan_t *pl = s->plan;
    const plan_slice_t *sl = &pl->slices[s->slice];
    if (!nl || !pl->nsegs || u1 <= sl->unit_begin)
        return nl > 0;
    uint64_t last = sl->layer0 + (u1 - 1 - sl->unit_begin) / pl->nsegs;
    return last - sl->src_layer_base < ready;
}

/* ---- S: gather-ahead (peer.gather_ahead) ------------------------------- */

/* Take x off s's slots gathered ahead. */
static void ahead_drop(sstream_t *s, slot_t *x)
{
    x->ahead = 0;
    for (uint32_t i = 0; i < s->nahead; i++)
        if (s->ahead[i] == x) {
            s->ahead[i] = s->ahead[--s->nahead];
            return;
        }
}

/* Start the gather of x's pieces (x: owner, units and bytes set). A
 * pulled slot of a host pool sends pieces whose runs are long straight
 * from the pool (peer.direct, over lanes only, whose stall check bounds
 * how long the fence waits for UCX): "gathered" when UCX is done. */
static void slot_gather(sstream_t *s, slot_t *x)
{
    s->gathers++;
    s->sends++;
    xfer_offer_fence_hold(s->offer);
    x->t_stage = now_ns();
    /* a GPU slot goes whole: one kernel gathers a piece either way, and
     * small messages cost dear over cuda_ipc (one H100, 64 MiB slots: in
     * 4 MiB pieces 41-47 GB/s, whole 314-342 GB/s; docs/benchmarks.md);
     * the receiver cuts as the header says */
    slot_cut(x, s->plan,
             x->set->device >= 0 ? kvxd.conf.slot_bytes
                                 : remote_message_bytes());
    x->piece_done = gather_done;
    peer_conn_t *c = conn_live(s->conn);
    int direct = direct_on && !s->gpu && x->pulled && c && peer_conn_lanes(c);
    x->pending++; /* x stays while sends fail at once */
    for (uint32_t k = 0; k < x->npieces; k++) {
        uint32_t n = direct ? piece_places(x, k, s->plan, 1) : 0;
        if (!n) {
            piece_copy(x, k, s->plan, s->gpu, 1);
            continue;
        }
        x->pending++;
        x->direct |= 1ull << k;
        st_tx.direct++;
        piece_send(x, k, n);
    }
    piece_gathered(x);
}

/* While no PULL waits for a slot and more than one is free, gather the
 * units s's next PULLs will ask for: from ahead_at, as many as fit in
 * the receiver's slot (pull_schedule()'s cut), up to peer.gather_ahead
 * slots. s is bound (a PULL of it was served). */
static void ahead_fill(sstream_t *s)
{
    offer_t *o = s->offer;
    while (s->nahead < kvxd.conf.gather_ahead && s->pull_bytes &&
           !s->ahead_off && !s->ended && o && !xfer_offer_ending(o) &&
           list_empty(&pulls) && sstream_slots(s, o)->nfree > 1 &&
           s->ahead_at < s->u_end) {
        uint64_t u0 = s->ahead_at, bytes;
        uint64_t end =
            stream_cut_end(s->plan, s->u_begin, u0, s->u_end, s->layerwise);
        uint64_t u1 = plan_units_fit(s->plan, u0, end, s->pull_bytes, &bytes);
        if (u1 == u0)
            return; /* a unit larger than its slot: the PULL fails it */
        if (!units_ready(s, o, u1))
            return; /* its layers are not all there yet */
        slot_t *x = slot_get(sstream_slots(s, o));
        x->owner = s;
        x->u0 = u0;
        x->u1 = u1;
        x->bytes = bytes;
        x->ahead = 1;
        s->ahead[s->nahead++] = x;
        s->ahead_at = u1;
        slot_gather(s, x);
    }
}

/* A PULL of s for [u0, u1) into the receiver's slot: if those units are
 * gathered ahead (or being gathered), they go now and 1 is returned. A
 * PULL for anything else turns gather-ahead off for s (its slots go). */
static int ahead_take(sstream_t *s, uint32_t slot, uint64_t u0, uint64_t u1)
{
    if (u1 > s->ahead_at)
        s->ahead_at = u1;
    for (uint32_t i = 0; i < s->nahead; i++) {
        slot_t *x = s->ahead[i];
        if (x->u0 != u0 || x->u1 != u1)
            continue;
        ahead_drop(s, x);
        st_tx.ahead++;
        x->pulled = 1;
        if (s->offer)
            xfer_offer_served(s->offer, x->bytes);
        x->dst_slot = slot;
        if (!x->pending) { /* all gathered: the wire starts now */
            st_tx.copy_ns += x->gather_ns;
            x->t_stage = now_ns();
        }
        x->pending++; /* a send failing at once must not release x */
        for (uint32_t k = 0; k < x->npieces; k++)
            if (x->ready & (1ull << k))
                piece_send(x, k, 0);
        x->ready = 0;
        assert(x->pending > 0);
        x->pending--;
        sslot_release(x); /* when every send failed at once */
        return 1;
    }
    if (s->nahead) {
        /* the receiver cuts differently (another slot size): stop */
        s->ahead_off = 1;
        ahead_release(s);
    }
    return 0;
}

/* Start queued pulls whose source is published, while send slots last;
 * then let the streams served gather ahead. A slot that goes back while
 * it runs (a send failing at once) calls it again: that call is made
 * after this one, not inside it, which walks the pulls. */
static void serve_pulls_once(void);
void serve_pulls(void)
{
    static int serving, again;
    if (serving) {
        again = 1;
        return;
    }
    serving = 1;
    do {
        again = 0;
        serve_pulls_once();
    } while (again);
    serving = 0;
}

static void serve_pulls_once(void)
{
    sstream_t *served[16];
    uint32_t nserved = 0;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &pulls)
    {
        pull_t *q = PULL(n);
        sstream_t *s = q->s;
        offer_t *o = s->offer;
        /* in turn: the first waits for a slot of its own set */
        if (!sstream_slots(s, o && !xfer_offer_ending(o) ? o : NULL)->nfree)
            break;
        if (o && !xfer_offer_ending(o) && !units_ready(s, o, q->u1))
            continue; /* its rank has not published them yet */
        assert(s->queued > 0);
        s->queued--;
        list_remove(n);
        if (!o || xfer_offer_ending(o)) {
            free(q);
            continue;
        }
        slot_t *x = slot_get(sstream_slots(s, o));
        x->owner = s;
        x->u0 = q->u0;
        x->u1 = q->u1;
        x->bytes = plan_units_bytes(s->plan, q->u0, q->u1);
        int rc = sstream_bind(s, o);
        if (rc) {
            slot_put(&sslots, x);
            free(q);
            peer_conn_t *sc = conn_live(s->conn);
            uint64_t dst = s->dst_id;
            sstream_end(s); /* may free s */
            if (sc)
                send_end(sc, dst, rc,
                         "the context daemon cannot bind its "
                         "source (its log says why)");
            offer_fail_t *f = calloc(1, sizeof(*f));
            if (f) { /* ended from remote_tick() */
                snprintf(f->instance, sizeof(f->instance), "%s",
                         xfer_offer_instance(o)->id);
                f->request_id = xfer_offer_request(o);
                f->code = rc;
                list_push(&ofails, &f->node);
            } else { /* out of memory: now, and nothing more this turn */
                xfer_offer_end(o, KVX_EVENT_ERROR, rc,
                               "binding the source for a peer failed");
            }
            return; /* lists changed: the next pull or tick goes on */
        }
        x->dst_slot = q->slot;
        x->pulled = 1;
        xfer_offer_served(s->offer, x->bytes);
        /* each piece is gathered on its own (a GPU pool: a kernel writes
         * it; else the copy threads) and sent as soon as it is */
        slot_gather(s, x);
        st_tx.wait_ns += x->t_stage - q->t_arrived;
        free(q);
        if (kvxd.conf.gather_ahead && nserved < 16 &&
            (!nserved || served[nserved - 1] != s))
            served[nserved++] = s;
    }
    for (uint32_t i = 0; i < nserved; i++)
        ahead_fill(served[i]);
}

void on_pull(peer_conn_t *c, const Kvxfer__PeerPull *m)
{
    sstream_t *s = map_get(&sstreams, m->stream);
    if (!s || s->conn != peer_conn_id(c) || s->ended)
        return; /* ended: the END crossed this pull */
    if (m->unit_begin < s->u_begin || m->unit_end > s->u_end ||
        m->unit_begin >= m->unit_end ||
        plan_units_bytes(s->plan, m->unit_begin, m->unit_end) >
            kvxd.conf.slot_bytes) {
        offer_t *o = s->offer;
        uint64_t dst = s->dst_id;
        sstream_end(s);
        send_end(c, dst, KVX_ERR_INVALID,
                 "pull outside the stream or larger than peer.slot_bytes "
                 "of the context daemon");
        if (o)
            xfer_offer_end(o, KVX_EVENT_ERROR, KVX_ERR_PROTOCOL,
                           "a generation daemon sent a bad pull");
        return;
    }
    if (ahead_take(s, m->slot, m->unit_begin, m->unit_end)) {
        ahead_fill(s);
        return;
    }
    if (s->queued >= PULLS_QUEUED_MAX) {
        offer_t *o = s->offer;
        uint64_t dst = s->dst_id;
        sstream_end(s);
        send_end(c, dst, KVX_ERR_LIMIT,
                 "more pulls waiting than any "
                 "daemon has slots");
        if (o)
            xfer_offer_end(o, KVX_EVENT_ERROR, KVX_ERR_PROTOCOL,
                           "a generation daemon sent too many pulls");
        return;
    }
    pull_t *q = calloc(1, sizeof(*q));
    if (!q)
        return;
    s->queued++;
    q->slot = m->slot;
    q->u0 = m->unit_begin;
    q->u1 = m->unit_end;
    q->t_arrived = now_ns();
    q->s = s;
    list_push(&pulls, &q->node);
    serve_pulls();
}

void remote_offer_published(offer_t *o)
{
    uint32_t alen;
    const uint8_t *aux = xfer_offer_aux(o, &alen);
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &RO(o)->streams)
    {
        sstream_t *s = LIST_OWNER(n, sstream_t, node);
        peer_conn_t *c = alen && !s->aux_sent ? conn_live(s->conn) : NULL;
        if (c) /* the aux came after the OPEN */
            opened_send(c, s, aux, alen);
    }
    if (!list_empty(&done_notes) && done_notes_apply(o))
        return; /* o may have ended: not used below */
    if (!list_empty(&RO(o)->streams))
        serve_pulls();
}

void remote_offer_stop(offer_t *o, int code, const char *msg)
{
    while (!list_empty(&RO(o)->streams)) {
        sstream_t *s = LIST_OWNER(list_first(&RO(o)->streams), sstream_t, node);
        peer_conn_t *c = conn_live(s->conn);
        uint64_t dst = s->dst_id;
        /* its gathers still hold the offer's fence */
        sstream_end(s); /* may free s */
        if (c)
            send_end(c, dst, code, msg);
    }
}

/* ---- S: context daemons whose ranks the consumer does not read -------- */

/* o is read to the end by its consumer: tell each daemon of the context
 * instance none of whose ranks the consumer reads (replicated heads read
 * from other replicas) that its part is complete too, or its offer would
 * wait for a stream that never comes and end TIMED_OUT. */
static void offer_done_notify(offer_t *o)
{
    instance_t *inst = xfer_offer_instance(o);
    const uint8_t *read = RO(o)->sv.rread; /* from the first OPEN's plans */
    if (inst->nlocal == inst->nranks || !peer_enabled() || !read)
        return;
    for (uint32_t r = 0; r < inst->nranks; r++) {
        const char *addr = inst->addresses[r];
        int any = 0, first = 1;
        for (uint32_t q = 0; q < inst->nranks; q++)
            if (!strcmp(inst->addresses[q], addr)) {
                any |= read[q];
                if (q < r)
                    first = 0; /* that daemon is told once */
            }
        if (any || !first || inst->local[r])
            continue;
        char why[256];
        peer_conn_t *c = peer_connect(addr, KVX_WHY(why));
        if (!c)
            continue;
        Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
        Kvxfer__PeerOfferDone d = KVXFER__PEER_OFFER_DONE__INIT;
        d.instance_id = inst->id;
        d.request_id = xfer_offer_request(o);
        d.token.data = (uint8_t *)xfer_offer_token(o);
        d.token.len = TOKEN_LEN;
        m.m_case = KVXFER__PEER_MSG__M_OFFER_DONE;
        m.offer_done = &d;
        peer_send(c, &m);
    }
}

/* The part of offer o on this daemon is complete: none of its ranks is
 * read. Only an offer no stream took. */
static void offer_done_apply(offer_t *o)
{
    if (RO(o)->sv.streams_expect)
        return;
    xfer_offer_remote_done(o, 1, 0, ""); /* a no-op if it is ending */
}

void on_offer_done(peer_conn_t *c, const Kvxfer__PeerOfferDone *d)
{
    instance_t *inst = d->instance_id ? instance_find(d->instance_id) : NULL;
    if (!inst || !inst->joined)
        return;
    /* from a daemon of the instance, with the offer's token */
    int member = 0;
    for (uint32_t r = 0; r < inst->nranks; r++)
        member |= !strcmp(inst->addresses[r], peer_conn_address(c));
    if (!member)
        return;
    uint8_t tok[TOKEN_LEN];
    peer_token(inst->id, inst->owner_uid, inst->addresses[0], d->request_id,
               tok);
    if (!xfer_token_equal(&d->token, tok))
        return;
    offer_t *o = xfer_offer_find(inst, d->request_id);
    if (o) {
        offer_done_apply(o);
        return;
    }
    if (ndone_notes >= DONE_NOTES_MAX)
        return;
    for (list_t *x = done_notes.next; x != &done_notes; x = x->next)
        if (DONE_NOTE(x)->request_id == d->request_id &&
            !strcmp(DONE_NOTE(x)->instance, inst->id))
            return; /* every daemon read tells us: one note */
    done_note_t *n = calloc(1, sizeof(*n));
    if (!n)
        return;
    snprintf(n->instance, sizeof(n->instance), "%s", inst->id);
    n->request_id = d->request_id;
    n->until_ms = kvxd_now_ms() + kvxd.conf.offer_lease_ms;
    list_push(&done_notes, &n->node);
    ndone_notes++;
}

/* A publish: an offer-done that came first applies now (1). */
static int done_notes_apply(offer_t *o)
{
    list_t *x, *t;
    LIST_FOREACH_SAFE(x, t, &done_notes)
    {
        done_note_t *n = DONE_NOTE(x);
        if (n->request_id == xfer_offer_request(o) &&
            !strcmp(n->instance, xfer_offer_instance(o)->id)) {
            list_remove(x);
            free(n);
            ndone_notes--;
            offer_done_apply(o);
            return 1;
        }
    }
    return 0;
}

void done_notes_tick(uint64_t now)
{
    list_t *x, *t;
    LIST_FOREACH_SAFE(x, t, &done_notes)
    {
        if (now < DONE_NOTE(x)->until_ms)
            continue;
        list_remove(x);
        free(DONE_NOTE(x));
        ndone_notes--;
    }
}

/* ---- either side ------------------------------------------------------- */

/* Whether a piece of s cannot have reached the receiver yet: still being
 * copied into a send slot, or sent from its places but still queued in
 * peer.c (its send window full). Pieces sent from their places count as
 * gathered only once UCX gives them back, and that may come after the
 * receiver's END (the rendezvous is done on its side first): those UCX
 * has do not count here. */
static int stream_unsent(const sstream_t *s, const peer_conn_t *c)
{
    if (!s->gathers)
        return 0;
    for (slot_t *x = slot_next(&sslots, NULL); x; x = slot_next(&sslots, x)) {
        if (x->owner != s || x->state == SLOT_FREE)
            continue;
        if (x->pending > (uint32_t)__builtin_popcountll(x->direct))
            return 1;
        for (uint32_t k = 0; k < x->npieces; k++)
            if ((x->direct >> k & 1) && peer_send_queued(c, &x->ref[k]))
                return 1;
    }
    return 0;
}

void on_end(peer_conn_t *c, const Kvxfer__PeerStreamEnd *e)
{
    /* to S: the generation side is done with stream e->stream */
    sstream_t *s = map_get(&sstreams, e->stream);
    if (s && s->conn == peer_conn_id(c) && !s->ended) {
        offer_t *o = s->offer;
        /* every unit is gathered before it is sent, so a receiver that
         * has them all finds no copy of the stream left: one that says
         * done earlier is wrong, and the offer ends with an error (its
         * fence still waits for those gathers, and for UCX's sends from
         * the pool) */
        int early = e->code == 0 && stream_unsent(s, c);
        sstream_end(s);
        if (!o) {
            serve_pulls(); /* its slots gathered ahead are free */
            return;
        }
        if (early) {
            char m[300];
            snprintf(m, sizeof(m),
                     "peer daemon %s ended stream %llu as "
                     "done before all of it was sent",
                     peer_conn_address(c), (unsigned long long)e->stream);
            log_warn("%s", m);
            xfer_offer_remote_done(o, 0, KVX_ERR_PROTOCOL, m);
        } else if (e->code == 0) {
            roffer_t *ro = xfer_offer_remote(o); /* a stream of o: made */
            assert(ro->sv.streams_done < ro->sv.streams_opened);
            if (++ro->sv.streams_done == ro->sv.streams_expect) {
                offer_done_notify(o);
                xfer_offer_remote_done(o, 1, 0, "");
            }
        } else {
            char m[300];
            snprintf(m, sizeof(m), "generation side: %s",
                     e->message ? e->message : "");
            xfer_offer_remote_done(o, 0, e->code, m);
        }
        serve_pulls(); /* its slots gathered ahead are free */
        return;
    }
}
