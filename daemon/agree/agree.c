/*
 * agree — completion batches of an instance whose ranks sit on several
 * daemons. The daemon of rank 0 (the root) seals every batch: the other
 * daemons (members) forward their terminal events and their ranks' polls
 * to it, and it sends each sealed batch back to the member of the rank
 * that asked. So batch k is the one batch.c sealed, identical on every
 * rank, wherever the rank is.
 *
 * Events: each daemon's request covers its local ranks; the root merges
 * the reports of one request until they cover every rank the request
 * needs, then queues one event (the first error goes out at once).
 * A lost member: its ranks leave the root's batches, the instance's
 * requests end with KVX_ERR_PEER_GONE, and the merged requests still
 * waiting for it end so too. A lost root, or a root whose own ranks all
 * left (the instance ends there): the members' waiting polls fail. A
 * forwarded poll never answered fails a little after its deadline, so
 * no engine's poll waits past its timeout whatever the root does.
 *
 * The root may join its instance after a member's ranks did: a member's
 * rank joining or leaving is sent again until the root acknowledges it
 * (announcements, kept apart from the instance, which may be freed
 * first), a poll the root cannot take yet is asked again until its
 * deadline, and a member's event that comes before the root joined is
 * kept until it does (early_t).
 *
 * Rules, asserted where they matter:
 *  - only the root merges and queues events into the instance's batches
 *    (batch.c seals them); a member forwards its reports, never queues;
 *  - a report covers at most the ranks its request needs, and a request
 *    needs at most the instance's ranks; a merge entry whose reports all
 *    came is gone, so a kept one has seen fewer than it expects;
 *  - a request's merged event goes out once: the first error at once, a
 *    COMPLETE only when every rank reported and none failed; after the
 *    error, late reports (even COMPLETE ones) add nothing, so a request
 *    never goes from failed back to ok;
 *  - a batch sent to another daemon's rank is one the root sealed;
 *  - a member forwards polls of its own ranks only, one at a time, and
 *    keeps at most LATE_MAX batches a rank.
 *
 * Owns the merge entries, the members' forwarded polls, the
 * announcements and the early events.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agree.h"
#include "common/list.h"
#include "core/daemon.h"
#include "core/fault.h"
#include "core/log.h"
#include "net/peer.h"
#include "xfer/xfer.h"

typedef struct merge {
    uint64_t request_id;
    reqkey_t key;
    int offer;
    uint32_t seen, expect;
    int emitted;           /* its event is queued: later reports are kept
                              out until every one came, or the deadline */
    int failed;            /* a report, or the event, was not COMPLETE */
    uint64_t deadline_ms;  /* the missing reports never came: TIMED_OUT */
    uint8_t *aux;          /* a fetch's COMPLETE: the first non-empty aux
                              a report carried */
    uint32_t aux_len;
} merge_t;

static void merge_free(merge_t *m)
{
    free(m->aux);
    free(m);
}

/* A member's forwarded poll of one rank. */
typedef struct fpoll {
    uint64_t req;          /* 0 = none */
    uint32_t at_least;
    uint64_t deadline_ms;
    uint64_t retry_ms;     /* the root could not take it yet: ask again */
    uint64_t conn;         /* the connection (peer_conn_id) it went out
                              on: only its loss fails it; 0: none */
} fpoll_t;

/* Member: a batch the root sent for a rank whose poll here had already
 * failed (the root counts it read): kept for the rank's next poll, so no
 * batch is lost. At most LATE_MAX a rank, in order. */
typedef struct late {
    uint8_t *pb;           /* packed Kvxfer__PeerBatch */
    size_t len;
    list_t node; /* on its rank's spread_t.late, oldest first */
} late_t;
#define LATE_MAX 8

/* Per spread instance, on any daemon of it. */
typedef struct spread {
    instance_t *inst;
    map_t merges[2];       /* root: request_id -> merge; [1] offers */
    fpoll_t *poll;         /* member: per rank */
    list_t *late;          /* member: per rank, late_t */
    uint64_t *has;         /* member: per rank, 1 + the batch it reads
                              next as far as this daemon has them (given
                              or kept); 0: not known. Its polls say it
                              (PeerPoll.resume) */
    uint64_t *away_ms;     /* root: since when a rank is away */
    uint64_t *sess;        /* root: the member's session of each rank
                              (PeerRanks.session); 0: not said */
    uint64_t *via;         /* root: the connection (peer_conn_id) each
                              remote rank's latest join came over; 0:
                              none yet */
    uint64_t epoch;        /* member: the root's incarnation of the
                              instance, as its batches say */
    list_t node;           /* on spreads */
} spread_t;

static list_t spreads = {&spreads, &spreads};

/* Member: a rank's joined or left, until the root acknowledges it. */
typedef struct announce {
    char instance[INSTANCE_ID_MAX + 1];
    char root[192];
    uint32_t rank;
    int joined;
    uint64_t session;      /* joined: the rank's session here */
    uint64_t next_ms, until_ms;
    list_t node; /* on announces */
} announce_t;

#define ANNOUNCE_EVERY_MS 100
#define ANNOUNCE_FOR_MS 60000
#define POLL_RETRY_MS 20
/* a forwarded poll not answered this long after its deadline fails */
#define POLL_LATE_MS 2000

static list_t announces = {&announces, &announces};

/* Root: a member's event that came before this daemon joined the
 * instance (its rank 0 may not even have said hello): merged when it
 * joins, or dropped after EARLY_FOR_MS. */
typedef struct early {
    char instance[INSTANCE_ID_MAX + 1];
    char from[192];
    uint64_t request_id;
    reqkey_t key;
    int offer, kind, code;
    char *msg;
    uint8_t *aux;
    uint32_t aux_len;
    uint32_t ranks, expect;
    uint64_t until_ms;
    list_t node; /* on earlies, in arrival order */
} early_t;

#define EARLY_MAX 4096
/* the longest event message a member's report carries on (ours are
 * under 300 bytes) */
#define EVENT_MSG_MAX 512
#define EARLY_FOR_MS 60000

static list_t earlies = {&earlies, &earlies};
static uint32_t nearly;

/* A poll reply for a local rank held back: the merged batch ends requests
 * that still run on this daemon (another daemon's error went out first),
 * and the rank may reuse their blocks once it reads it. Sent from the
 * tick once they are fenced. */
typedef struct held {
    char instance[INSTANCE_ID_MAX + 1];
    uint64_t sid;
    uint8_t *reply;        /* packed Kvxfer__Reply */
    size_t len;
    uint64_t since_ms;
    list_t node; /* on helds */
} held_t;

static list_t helds = {&helds, &helds};

#define SPREAD(n) LIST_OWNER(n, spread_t, node)
#define ANNOUNCE(n) LIST_OWNER(n, announce_t, node)
#define EARLY(n) LIST_OWNER(n, early_t, node)
#define HELD(n) LIST_OWNER(n, held_t, node)

static void merge_report(instance_t *inst, const xfer_event_t *ev);
static int event_ok(const instance_t *inst, const char *from, int kind,
                    int code, uint32_t ranks, uint32_t expect);

static int is_root(const instance_t *inst) { return inst->local[0]; }

static spread_t *spread_of(instance_t *inst, int create);

uint32_t agree_kept(const instance_t *inst)
{
    uint32_t n = 0;
    spread_t *s = spread_of((instance_t *)inst, 0);
    for (uint32_t r = 0; s && r < inst->nranks; r++)
        for (list_t *l = s->late[r].next; l != &s->late[r]; l = l->next)
            n++;
    return n;
}

static spread_t *spread_of(instance_t *inst, int create)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &spreads)
    if (SPREAD(n)->inst == inst)
        return SPREAD(n);
    if (!create)
        return NULL;
    spread_t *s = calloc(1, sizeof(*s));
    if (!s || !(s->poll = calloc(inst->nranks, sizeof(fpoll_t))) ||
        !(s->late = calloc(inst->nranks, sizeof(list_t))) ||
        !(s->has = calloc(inst->nranks, sizeof(uint64_t))) ||
        !(s->away_ms = calloc(inst->nranks, sizeof(uint64_t))) ||
        !(s->sess = calloc(inst->nranks, sizeof(uint64_t))) ||
        !(s->via = calloc(inst->nranks, sizeof(*s->via)))) {
        if (s) {
            free(s->poll);
            free(s->late);
            free(s->has);
            free(s->away_ms);
            free(s->sess);
            free(s->via);
        }
        free(s);
        return NULL;
    }
    for (uint32_t r = 0; r < inst->nranks; r++)
        list_init(&s->late[r]);
    s->inst = inst;
    list_push(&spreads, &s->node);
    return s;
}

/* Member: keep batch pb for rank's next poll, after those kept (at most
 * LATE_MAX). 0, KVX_ERR_LIMIT when LATE_MAX are kept already, or
 * KVX_ERR_NOMEM. */
static int late_push(spread_t *s, uint32_t rank, const Kvxfer__PeerBatch *pb)
{
    uint32_t n = 0;
    for (list_t *x = s->late[rank].next; x != &s->late[rank]; x = x->next)
        n++;
    assert(n <= LATE_MAX);
    late_t *l = NULL;
    size_t len = kvxfer__peer_batch__get_packed_size(pb);
    if (n >= LATE_MAX)
        return KVX_ERR_LIMIT;
    if (!(l = calloc(1, sizeof(*l))) || !(l->pb = malloc(len ? len : 1))) {
        free(l);
        return KVX_ERR_NOMEM;
    }
    kvxfer__peer_batch__pack(pb, l->pb);
    l->len = len;
    list_push(&s->late[rank], &l->node);
    return 0;
}

/* Member: late_push(), or a warning: batch pb is not kept (out of
 * memory, or LATE_MAX kept already: its engine has not polled through
 * many failed polls); the caller does not count it arrived, so the rank's
 * next poll says so and the root sends it again. */
static int late_keep(spread_t *s, const instance_t *inst,
                     const Kvxfer__PeerBatch *pb)
{
    int rc = late_push(s, pb->rank, pb);
    if (rc)
        log_warn("instance %s: batch %llu for rank %u not kept here (%d "
                 "already wait for the rank's next poll, or out of memory): "
                 "the root sends it again then",
                 inst->id, (unsigned long long)pb->batch, pb->rank, LATE_MAX);
    return rc;
}

/* Member: the oldest batch kept for rank (free it with
 * kvxfer__peer_batch__free_unpacked()), or NULL. */
static Kvxfer__PeerBatch *late_pop(spread_t *s, uint32_t rank)
{
    list_t *first = list_first(&s->late[rank]);
    if (!first)
        return NULL;
    late_t *l = LIST_OWNER(first, late_t, node);
    list_remove(first);
    Kvxfer__PeerBatch *pb = kvxfer__peer_batch__unpack(NULL, l->len, l->pb);
    free(l->pb);
    free(l);
    return pb;
}

static void late_clear(spread_t *s, uint32_t rank)
{
    Kvxfer__PeerBatch *pb;
    while (!list_empty(&s->late[rank]))
        if ((pb = late_pop(s, rank)))
            kvxfer__peer_batch__free_unpacked(pb, NULL);
}

void agree_forget(instance_t *inst)
{
    spread_t *s = spread_of(inst, 0);
    if (!s)
        return;
    list_remove(&s->node);
    for (int k = 0; k < 2; k++) {
        uint32_t n = s->merges[k].n;
        void **v = calloc(n ? n : 1, sizeof(*v));
        if (v) {
            n = map_values(&s->merges[k], v, n);
            for (uint32_t i = 0; i < n; i++)
                merge_free(v[i]);
            free(v);
        }
        map_free(&s->merges[k]);
    }
    for (uint32_t r = 0; r < inst->nranks; r++)
        late_clear(s, r);
    free(s->late);
    free(s->has);
    free(s->away_ms);
    free(s->sess);
    free(s->via);
    free(s->poll);
    free(s);
}

void agree_joined(instance_t *inst)
{
    int root = instance_spread(inst) && is_root(inst);
    /* every rank reads from batch 0: the remote ones are present from
     * the start, so none misses a batch sealed before its first poll */
    for (uint32_t r = 0; root && r < inst->nranks; r++)
        if (!inst->local[r])
            batch_rank_join(&inst->batches, r);
    /* members' events that came before: merged now, in arrival order */
    list_t mine, *n, *t;
    list_init(&mine);
    LIST_FOREACH_SAFE(n, t, &earlies)
    if (!strcmp(EARLY(n)->instance, inst->id)) {
        list_remove(n);
        list_push(&mine, n);
        assert(nearly > 0); /* nearly counts earlies */
        nearly--;
    }
    LIST_FOREACH_SAFE(n, t, &mine)
    {
        early_t *x = EARLY(n);
        const xfer_event_t ev = {.request_id = x->request_id,
                                 .key = &x->key,
                                 .offer = x->offer,
                                 .kind = x->kind,
                                 .code = x->code,
                                 .msg = x->msg,
                                 .ranks = x->ranks,
                                 .expect = x->expect,
                                 .aux = x->aux,
                                 .aux_len = x->aux_len};
        if (root && event_ok(inst, x->from, x->kind, x->code, x->ranks,
                             x->expect))
            merge_report(inst, &ev);
        free(x->msg);
        free(x->aux);
        free(x);
    }
}

/* Root: ev (its offer, ranks and expect aside) into the instance's
 * batches, which seal it for every rank alike. */
static void queue_event_aux(instance_t *inst, const xfer_event_t *ev)
{
    /* a member's batches hold no event: the root's seal every batch */
    assert(is_root(inst));
    char ks[REQKEY_STR_MAX];
    const batch_end_t end = {ev->kind, ev->code, ev->msg, ev->aux, ev->aux_len};
    if (batch_push(&inst->batches, ev->request_id, ev->key, &end,
                   kvxd_now_ms()))
        log_error("instance %s: out of memory queueing the event of request "
                  "%s",
                  inst->id, reqkey_str(ev->key->b, ev->key->len, ks));
}

/* Root: the one event of merge entry m goes out (its request's id and
 * key; aux only with a COMPLETE). */
static void merge_emit(instance_t *inst, merge_t *m, int kind, int code,
                       const char *msg)
{
    /* one event per request, and a COMPLETE only once every rank it
     * needs reported and none failed: failed never turns back to ok */
    assert(!m->emitted);
    assert(kind != KVX_EVENT_COMPLETE || (m->seen >= m->expect && !m->failed));
    m->emitted = 1;
    m->failed |= kind != KVX_EVENT_COMPLETE;
    const int aux = kind == KVX_EVENT_COMPLETE;
    const xfer_event_t ev = {.request_id = m->request_id,
                             .key = &m->key,
                             .kind = kind,
                             .code = code,
                             .msg = msg,
                             .aux = aux ? m->aux : NULL,
                             .aux_len = aux ? m->aux_len : 0};
    queue_event_aux(inst, &ev);
}

/* Root: the requests still waiting for reports end with PEER_GONE (a
 * rank they need is gone, so its report never comes). One that still
 * runs here is left alone: the instance's requests end next
 * (xfer_end_instance()), and its own report, after its fence, says so.
 * The others keep their entry, emitted, until their deadline, so a late
 * report adds no second event. */
static void merges_fail(instance_t *inst, const char *msg)
{
    assert(is_root(inst)); /* members keep no merges */
    spread_t *s = spread_of(inst, 0);
    if (!s)
        return;
    for (int k = 0; k < 2; k++) {
        uint32_t n = s->merges[k].n;
        void **v = calloc(n ? n : 1, sizeof(*v));
        n = v ? map_values(&s->merges[k], v, n) : 0;
        for (uint32_t i = 0; i < n; i++) {
            merge_t *e = v[i];
            assert(e->offer == k && e->seen < e->expect);
            if (e->emitted || (k && xfer_offer_runs(inst, e->request_id)) ||
                (!k && map_get(&inst->fetches, e->request_id)))
                continue; /* it still runs here: its own report says */
            kvxd_count_error(KVX_ERR_PEER_GONE);
            merge_emit(inst, e, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, msg);
        }
        free(v);
    }
}

/* Member: send m to the daemon of rank 0 (connecting on first use).
 * 0, or an error when it cannot be reached. */
static int to_root_on(const instance_t *inst, const Kvxfer__PeerMsg *m,
                      uint64_t *on)
{
    char why[256];
    peer_conn_t *c = peer_connect(inst->addresses[0], KVX_WHY(why));
    if (on)
        *on = c ? peer_conn_id(c) : 0;
    return c ? peer_send(c, m) : KVX_ERR_PEER_GONE;
}

static int to_root(const instance_t *inst, const Kvxfer__PeerMsg *m)
{
    return to_root_on(inst, m, NULL);
}

/* A PeerRanks on connection c: a member's announcement to the root, or
 * the root's acknowledgement of one (ack), on the connection it came
 * by. 0 or an error. */
static int ranks_send(peer_conn_t *c, const char *instance, uint32_t rank,
                      int joined, uint64_t session, int ack)
{
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerRanks r = KVXFER__PEER_RANKS__INIT;
    r.instance_id = (char *)instance;
    r.rank = rank;
    r.joined = joined;
    r.session = session;
    r.ack = ack;
    m.m_case = KVXFER__PEER_MSG__M_RANKS;
    m.ranks = &r;
    return c ? peer_send(c, &m) : KVX_ERR_PEER_GONE;
}

/* Member: an announcement to the root at addr (connecting on first use). */
static int announce_send(const announce_t *a)
{
    char why[256];
    return ranks_send(peer_connect(a->root, KVX_WHY(why)), a->instance, a->rank,
                      a->joined, a->session, 0);
}

/* Member: tell the root that a local rank joined (again) or left, as a
 * rank of one daemon tells its batches (a rank gone ends the instance's
 * requests; back, it reads from the next batch). */
static void announce_queue(instance_t *inst, uint32_t rank, int joined,
                           int send_now);

void agree_rank(instance_t *inst, uint32_t rank, int joined)
{
    announce_queue(inst, rank, joined, 1);
}

/* Member: rank joined or left; the announcement goes now (send_now) or
 * from the tick, and again until the root acknowledges it. */
static void announce_queue(instance_t *inst, uint32_t rank, int joined,
                           int send_now)
{
    if (!instance_spread(inst))
        return;
    if (is_root(inst)) { /* a root rank gone: its reports never come */
        if (!joined) {
            char msg[300];
            snprintf(msg, sizeof(msg), "rank %u of instance %s "
                                       "disconnected",
                     rank, inst->id);
            merges_fail(inst, msg);
        }
        return;
    }
    spread_t *s = spread_of(inst, 0);
    if (s && !joined) {
        s->poll[rank].req = 0; /* its poll went with its client */
        late_clear(s, rank);   /* and what was kept for it */
        s->has[rank] = 0;
    }
    announce_t *a = NULL;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &announces)
    if (ANNOUNCE(n)->rank == rank && !strcmp(ANNOUNCE(n)->instance, inst->id)) {
        a = ANNOUNCE(n); /* the newer state replaces the older */
        break;
    }
    if (!a && (a = calloc(1, sizeof(*a))))
        list_push(&announces, &a->node);
    uint64_t now = kvxd_now_ms();
    announce_t once; /* out of memory: told once, not again */
    if (!a)
        a = &once;
    {
        snprintf(a->instance, sizeof(a->instance), "%s", inst->id);
        snprintf(a->root, sizeof(a->root), "%s", inst->addresses[0]);
        a->rank = rank;
        a->joined = joined;
        a->session = joined ? inst->rank_sid[rank] : 0;
        a->next_ms = now + (send_now ? ANNOUNCE_EVERY_MS : 0);
        a->until_ms = now + ANNOUNCE_FOR_MS;
    }
    if (send_now && announce_send(a))
        log_warn("instance %s: rank %u %s, and the root daemon %s cannot "
                 "be told yet",
                 inst->id, rank, joined ? "joined" : "left",
                 inst->addresses[0]);
}

/* Member: the root took an announcement into account. */
static void on_ranks_ack(peer_conn_t *c, const Kvxfer__PeerRanks *r)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &announces)
    {
        announce_t *a = ANNOUNCE(n);
        if (a->rank == r->rank && a->joined == r->joined &&
            a->session == r->session && r->instance_id &&
            !strcmp(a->instance, r->instance_id) &&
            !strcmp(a->root, peer_conn_address(c))) {
            list_remove(n);
            free(a);
            return;
        }
    }
}

/* Root: a member's rank joined or left. Acknowledged once this daemon is
 * the joined root of the instance (before, the member asks again). */
static void on_ranks(peer_conn_t *c, const Kvxfer__PeerRanks *r)
{
    if (r->ack) {
        on_ranks_ack(c, r);
        return;
    }
    instance_t *inst = r->instance_id ? instance_find(r->instance_id) : NULL;
    if (!inst || !inst->joined)
        return; /* not yet: no ack, it comes again */
    /* on the same link */
    ranks_send(c, inst->id, r->rank, r->joined, r->session, 1);
    if (!instance_spread(inst) || !is_root(inst) || r->rank >= inst->nranks ||
        inst->local[r->rank] ||
        strcmp(inst->addresses[r->rank], peer_conn_address(c)))
        return;
    spread_t *s = spread_of(inst, 1);
    uint64_t *sess = s ? &s->sess[r->rank] : NULL;
    int present = inst->batches.present[r->rank];
    /* joined again with another session: its old client left while the
     * link was down (the announcement of that replaced by this one), so
     * the old rank leaves first: its requests end, and the new one reads
     * no batch of the old one's */
    int replaced = r->joined && present && sess && *sess && r->session &&
                   *sess != r->session;
    if (replaced || (!r->joined && present)) {
        batch_rank_leave(&inst->batches, r->rank);
        char msg[300];
        snprintf(msg, sizeof(msg), "rank %u of instance %s (daemon %s) "
                                   "disconnected",
                 r->rank, inst->id, inst->addresses[r->rank]);
        if (replaced)
            log_info("instance %s: rank %u at daemon %s is a new client: "
                     "the old one left while unreachable",
                     inst->id, r->rank, inst->addresses[r->rank]);
        merges_fail(inst, msg);
        xfer_end_instance(inst, KVX_ERR_PEER_GONE, msg);
        present = 0;
    }
    if (r->joined && present && inst->batches.away[r->rank]) {
        /* back after a lost link: it reads on from where it was */
        batch_rank_back(&inst->batches, r->rank);
    } else if (r->joined && !present) {
        batch_rank_join(&inst->batches, r->rank);
    }
    /* the root counts a rank its daemon says joined, and no other */
    assert(r->joined ? batch_rank_here(&inst->batches, r->rank)
                     : !inst->batches.present[r->rank]);
    if (r->joined && sess && r->session)
        *sess = r->session; /* (the join puts remote ranks in unsaid) */
    if (r->joined && s)
        s->via[r->rank] = peer_conn_id(c);
}

/* ---- events ------------------------------------------------------------ */

/* Root: one daemon's report of a request. A fetch's COMPLETE reports
 * may carry its aux: the merged COMPLETE carries the first non-empty one
 * (every daemon's comes from the same offer, or from offers of the same
 * request on the context daemons). */
static void merge_report(instance_t *inst, const xfer_event_t *ev)
{
    /* only the root merges; a report covers at most what its request
     * needs, and that at most the instance (event_ok() holds a member's
     * to this, xfer its own daemon's) */
    assert(is_root(inst));
    assert(ev->expect > 0 && ev->expect <= inst->nranks);
    assert(ev->ranks <= ev->expect);
    uint64_t request_id = ev->request_id;
    int offer = ev->offer ? 1 : 0, kind = ev->kind;
    uint32_t aux_len = ev->aux_len;
    if (offer || kind != KVX_EVENT_COMPLETE)
        aux_len = 0; /* only a fetch's COMPLETE carries one */
    spread_t *s = spread_of(inst, 1);
    map_t *mm = s ? &s->merges[offer] : NULL;
    merge_t *m = mm ? map_get(mm, request_id) : NULL;
    /* an entry whose every report came is gone */
    assert(!m || (m->seen < m->expect && m->offer == offer));
    int created = 0;
    if (mm && !m && (m = calloc(1, sizeof(*m)))) {
        m->request_id = request_id;
        m->key = *ev->key;
        m->offer = offer;
        m->expect = ev->expect;
        m->deadline_ms = kvxd_now_ms() + (offer ? kvxd.conf.offer_lease_ms
                                                : kvxd.conf.fetch_timeout_ms);
        created = 1;
        if (map_put(mm, request_id, m)) {
            merge_free(m);
            m = NULL;
        }
    }
    if (!m) { /* out of memory: at least the event goes out */
        xfer_event_t one = *ev;
        one.aux_len = aux_len;
        queue_event_aux(inst, &one);
        return;
    }
    if (aux_len && !m->aux_len && (m->aux = malloc(aux_len))) {
        memcpy(m->aux, ev->aux, aux_len);
        m->aux_len = aux_len;
    }
    /* it needs every rank, and one of another daemon is gone: its report
     * never comes (a rank gone ends the instance's requests) */
    for (uint32_t r = 0; created && kind == KVX_EVENT_COMPLETE &&
                         ev->expect == inst->nranks && r < inst->nranks;
         r++)
        if (!inst->local[r] && !batch_rank_here(&inst->batches, r)) {
            char gone[300];
            snprintf(gone, sizeof(gone),
                     "rank %u of instance %s (daemon %s) is not connected",
                     r, inst->id, inst->addresses[r]);
            kvxd_count_error(KVX_ERR_PEER_GONE);
            merge_emit(inst, m, KVX_EVENT_ERROR, KVX_ERR_PEER_GONE, gone);
            break;
        }
    m->seen += ev->ranks;
    m->failed |= kind != KVX_EVENT_COMPLETE;
    if (!m->emitted && (kind != KVX_EVENT_COMPLETE || m->seen >= m->expect))
        merge_emit(inst, m, kind, ev->code, ev->msg);
    if (m->seen >= m->expect) { /* every report came */
        map_del(mm, request_id);
        merge_free(m);
    }
}

void agree_event(instance_t *inst, const xfer_event_t *ev)
{
    if (is_root(inst)) {
        merge_report(inst, ev);
        return;
    }
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerEvent e = KVXFER__PEER_EVENT__INIT;
    e.instance_id = inst->id;
    e.request_id = ev->request_id;
    e.key.data = (uint8_t *)ev->key->b;
    e.key.len = ev->key->len;
    e.kind = ev->kind;
    e.code = ev->code;
    e.message = (char *)ev->msg;
    e.ranks = ev->ranks;
    e.offer = ev->offer;
    e.expect = ev->expect;
    e.aux.data = (uint8_t *)ev->aux;
    e.aux.len = ev->aux ? ev->aux_len : 0;
    m.m_case = KVXFER__PEER_MSG__M_EVENT;
    m.event = &e;
    if (to_root(inst, &m))
        log_warn(
            "instance %s: the event of request %s cannot reach the "
            "root daemon %s",
            inst->id,
            reqkey_str(ev->key->b, ev->key->len, (char[REQKEY_STR_MAX]){0}),
            inst->addresses[0]);
}

/* ---- the fence of a merged batch ---------------------------------------- */

/* The requests a merged batch ends (not COMPLETE: every daemon reported
 * those after its fence) that still run on this daemon; with end set,
 * they are ended first (ERROR, the event's code). Never called from
 * inside a delivery: ending a request reports it, which can seal and
 * deliver a batch again. */
static uint32_t batch_runs(instance_t *inst, const Kvxfer__PollReply *pr,
                           int end)
{
    uint32_t n = 0;
    for (size_t i = 0; i < pr->n_events; i++) {
        const Kvxfer__Event *e = pr->events[i];
        if ((int)e->kind == KVX_EVENT_COMPLETE)
            continue;
        char m[400];
        snprintf(m, sizeof(m), "ended on another daemon of instance %s: %s",
                 inst->id, e->message ? e->message : "");
        n += xfer_request_runs(inst, xfer_key_id(e->key.data, e->key.len),
                               e->code, end ? m : NULL);
        if (!(inst = instance_find(inst->id)))
            return 0; /* gone with its last request */
    }
    return n;
}

int agree_fence_batch(instance_t *inst, uint64_t sid, const Kvxfer__Reply *r)
{
    if (!instance_spread(inst) || !r->poll || !r->poll->n_events ||
        !batch_runs(inst, r->poll, 0))
        return 0;
    /* held: the tick ends those requests and sends it once they are
     * fenced */
    held_t *h = calloc(1, sizeof(*h));
    size_t len = kvxfer__reply__get_packed_size(r);
    if (!h || !(h->reply = malloc(len ? len : 1))) {
        free(h);
        return 0; /* out of memory: send it as it is */
    }
    kvxfer__reply__pack(r, h->reply);
    h->len = len;
    snprintf(h->instance, sizeof(h->instance), "%s", inst->id);
    h->sid = sid;
    h->since_ms = kvxd_now_ms();
    list_push(&helds, &h->node);
    return 1;
}

static void helds_tick(uint64_t now)
{
    /* over the list taken as it is: ending a request may deliver (and
     * hold) again, onto the new list */
    list_t list, keep, *n, *t;
    list_init(&list);
    list_init(&keep);
    list_move_all(&helds, &list);
    LIST_FOREACH_SAFE(n, t, &list)
    {
        held_t *h = HELD(n);
        list_remove(n);
        Kvxfer__Reply *r = kvxfer__reply__unpack(NULL, h->len, h->reply);
        instance_t *inst = instance_find(h->instance);
        if (r && inst && r->poll && batch_runs(inst, r->poll, 1)) {
            kvxfer__reply__free_unpacked(r, NULL);
            list_push(&keep, n); /* their fences are not done yet */
            continue;
        }
        if (r) {
            log_debug("instance %s: a batch held %llu ms for its fence",
                      h->instance, (unsigned long long)(now - h->since_ms));
            kvxd_reply_msg(h->sid, r);
            kvxfer__reply__free_unpacked(r, NULL);
        }
        free(h->reply);
        free(h);
    }
    list_move_all(&keep, &helds);
}

/* ---- polls ------------------------------------------------------------- */

/* Member: forward a poll of a local rank to the root. 0 or an error. */
static int poll_send(instance_t *inst, uint32_t rank, uint64_t req_id,
                     uint32_t at_least, uint32_t timeout_ms, uint64_t *on)
{
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerPoll p = KVXFER__PEER_POLL__INIT;
    p.instance_id = inst->id;
    p.rank = rank;
    p.req_id = req_id;
    p.at_least = at_least;
    p.timeout_ms = timeout_ms;
    spread_t *s = spread_of(inst, 0);
    p.resume = s ? s->has[rank] : 0;
    p.session = inst->rank_sid[rank];
    m.m_case = KVXFER__PEER_MSG__M_POLL;
    m.poll = &p;
    return to_root_on(inst, &m, on);
}

/* Member: a poll reply built from batch pb for request req_id of rank
 * (through the fence of a merged batch). */
static void batch_reply(instance_t *inst, uint32_t rank, uint64_t req_id,
                        const Kvxfer__PeerBatch *pb)
{
    uint64_t sid = inst->rank_sid[rank];
    Kvxfer__PollReply pr = KVXFER__POLL_REPLY__INIT;
    pr.batch = pb->batch;
    pr.n_events = pb->n_events;
    pr.events = pb->events;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = req_id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_POLL;
    r.poll = &pr;
    if (!agree_fence_batch(inst, sid, &r))
        kvxd_reply_msg(sid, &r);
}

int agree_poll(instance_t *inst, uint32_t rank, uint64_t req_id,
               uint32_t at_least, uint32_t timeout_ms, kvx_why_t *why)
{
    /* a member forwards its own ranks' polls (the root's are its own) */
    assert(!is_root(inst) && rank < inst->nranks && inst->local[rank]);
    spread_t *s = spread_of(inst, 1);
    if (!s)
        return why_fail(why, KVX_ERR_NOMEM, "poll: out of memory");
    if (s->poll[rank].req)
        return why_fail(why, KVX_ERR_BUSY,
                        "poll: this rank already has a poll waiting");
    Kvxfer__PeerBatch *pb = late_pop(s, rank); /* sent after a poll failed */
    if (pb) {
        batch_reply(inst, rank, req_id, pb);
        kvxfer__peer_batch__free_unpacked(pb, NULL);
        return 0;
    }
    uint64_t on = 0;
    if (poll_send(inst, rank, req_id, at_least, timeout_ms, &on))
        return why_fail(why, KVX_ERR_PEER_GONE,
                        "poll: the root daemon %s of instance %s is "
                        "unreachable",
                        inst->addresses[0], inst->id);
    s->poll[rank] = (fpoll_t){.req = req_id,
                              .at_least = at_least,
                              .deadline_ms = kvxd_now_ms() + timeout_ms,
                              .conn = on};
    return 0;
}

/* Root: a sealed batch for a rank of another daemon. */
int agree_deliver(instance_t *inst, uint32_t rank, uint64_t req_id,
                  const batch_t *b)
{
    /* a batch the root sealed (no early answer: a rank of another daemon
     * never asks Poll.early), for a rank of another daemon */
    assert(is_root(inst) && rank < inst->nranks && !inst->local[rank]);
    assert(!b->early && b->seq < inst->batches.next_seq);
    char why[256];
    peer_conn_t *c = peer_connect(inst->addresses[rank], KVX_WHY(why));
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerBatch pb = KVXFER__PEER_BATCH__INIT;
    Kvxfer__Event *ev, **evp;
    if (!c || instance_batch_events(b, &ev, &evp)) {
        log_warn("instance %s: batch %llu for rank %u cannot reach daemon %s",
                 inst->id, (unsigned long long)b->seq, rank,
                 inst->addresses[rank]);
        return KVX_ERR_PEER_GONE;
    }
    spread_t *s = spread_of(inst, 0);
    pb.instance_id = inst->id;
    pb.rank = rank;
    pb.req_id = req_id;
    pb.epoch = inst->epoch;
    pb.session = s ? s->sess[rank] : 0;
    pb.batch = b->seq;
    pb.n_events = b->nevents;
    pb.events = evp;
    pb.message = "";
    m.m_case = KVXFER__PEER_MSG__M_BATCH;
    m.batch = &pb;
    /* fault "batch": lost on its way, as in a link that dies with it */
    int rc = fault_hit(FAULT_BATCH) ? 0 : peer_send(c, &m);
    free(ev);
    free(evp);
    return rc; /* not sent: the rank reads it again (when it is back) */
}

/* Member: the root answered a forwarded poll. */
static void on_batch(peer_conn_t *c, const Kvxfer__PeerBatch *pb)
{
    instance_t *inst = pb->instance_id ? instance_find(pb->instance_id)
                                       : NULL;
    spread_t *s = inst ? spread_of(inst, 0) : NULL;
    if (!s || pb->rank >= inst->nranks || !inst->local[pb->rank] ||
        strcmp(peer_conn_address(c), inst->addresses[0]))
        return;
    uint32_t rank = pb->rank;
    fpoll_t *fp = &s->poll[rank];
    if (!pb->code && pb->epoch && pb->epoch != s->epoch) {
        if (s->epoch) {
            /* the root's instance was made anew (its ranks there left and
             * came back): its batches are numbered from 0 again, and what
             * this daemon kept or counted of the old one is moot */
            log_info("instance %s: the root daemon %s has a new "
                     "incarnation of it: batches numbered anew",
                     inst->id, inst->addresses[0]);
            for (uint32_t r = 0; r < inst->nranks; r++) {
                late_clear(s, r);
                s->has[r] = 0;
            }
        }
        s->epoch = pb->epoch;
    }
    if (pb->session && pb->session != inst->rank_sid[rank])
        return; /* for a client of the rank that has since left (its own
                   polls are answered on their own) */
    /* a batch this daemon has already (sent again by the root, which a
     * poll of ours told it had not come while it was on its way) */
    int dup = !pb->code && s->has[rank] && pb->batch + 1 < s->has[rank];
    if (fp->req != pb->req_id) {
        /* its poll failed here first (the backstop, a lost connection),
         * but the root counts this batch read: the rank's next poll gets
         * it. An error answer changed nothing there: dropped. */
        if (!pb->code && !dup && inst->rank_sid[rank] &&
            !late_keep(s, inst, pb))
            s->has[rank] = pb->batch + 2;
        return;
    }
    if (pb->code && pb->retry && kvxd_now_ms() < fp->deadline_ms) {
        fp->retry_ms = kvxd_now_ms() + POLL_RETRY_MS; /* agree_tick */
        return;
    }
    if (pb->code) {
        fp->req = 0;
        fp->retry_ms = 0;
        kvxd_reply(inst->rank_sid[rank], pb->req_id, pb->code, pb->message);
        return;
    }
    if (dup && list_empty(&s->late[rank])) {
        /* the rank has read it: this poll asks for the next one */
        uint64_t now = kvxd_now_ms();
        uint32_t left = fp->deadline_ms > now
                            ? (uint32_t)(fp->deadline_ms - now) : 1;
        if (poll_send(inst, rank, fp->req, fp->at_least, left, &fp->conn)) {
            uint64_t req = fp->req;
            fp->req = 0;
            kvxd_reply(inst->rank_sid[rank], req, KVX_ERR_PEER_GONE,
                       "poll: the root daemon is unreachable");
        }
        return;
    }
    fp->req = 0;
    fp->retry_ms = 0;
    if (!list_empty(&s->late[rank])) {
        /* batches kept from before come first: this one waits behind
         * them, and the oldest answers this poll (in order) */
        if (!dup && !late_keep(s, inst, pb))
            s->has[rank] = pb->batch + 2;
        Kvxfer__PeerBatch *old = late_pop(s, rank);
        if (old) {
            batch_reply(inst, rank, pb->req_id, old);
            kvxfer__peer_batch__free_unpacked(old, NULL);
        }
        return;
    }
    s->has[rank] = pb->batch + 2;
    batch_reply(inst, rank, pb->req_id, pb);
}

/* Root: the answer to a member's poll that no batch answers. */
typedef struct poll_fail {
    const char *instance;
    uint32_t rank;
    uint64_t req_id;
    uint64_t session; /* the poll's: a client of the rank that left since
                         is not answered for the next */
    int code;         /* and msg, for its engine */
    const char *msg;
    int retry; /* or "ask again" */
} poll_fail_t;

static void poll_fail_send(peer_conn_t *c, const poll_fail_t *f)
{
    assert(f->code < 0); /* a failed poll's answer is an error */
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    Kvxfer__PeerBatch pb = KVXFER__PEER_BATCH__INIT;
    pb.instance_id = (char *)f->instance;
    pb.rank = f->rank;
    pb.req_id = f->req_id;
    pb.session = f->session;
    pb.code = f->code;
    pb.message = (char *)f->msg;
    pb.retry = f->retry;
    m.m_case = KVXFER__PEER_MSG__M_BATCH;
    m.batch = &pb;
    if (c)
        peer_send(c, &m);
}

void agree_instance_ends(instance_t *inst)
{
    if (!instance_spread(inst) || !is_root(inst))
        return;
    char msg[512];
    snprintf(msg, sizeof(msg), "poll: instance %s ended at its root daemon "
                               "%s: every rank of it there left",
             inst->id, kvxd.address);
    for (uint32_t r = 0; r < inst->nranks; r++) {
        uint64_t req;
        if (inst->local[r] || !batch_take_waiter(&inst->batches, r, &req))
            continue;
        char why[256];
        spread_t *s = spread_of(inst, 0);
        const poll_fail_t f = {.instance = inst->id,
                               .rank = r,
                               .req_id = req,
                               .session = s ? s->sess[r] : 0,
                               .code = KVX_ERR_PEER_GONE,
                               .msg = msg};
        poll_fail_send(peer_connect(inst->addresses[r], KVX_WHY(why)), &f);
    }
}

/* Root: a member's rank polls. */
static void on_poll(peer_conn_t *c, const Kvxfer__PeerPoll *p)
{
    instance_t *inst = p->instance_id ? instance_find(p->instance_id) : NULL;
    spread_t *s;
    const char *bad = NULL;
    int retry = 0;
    if (!inst || !inst->joined) {
        bad = "has not joined at its root daemon yet";
        retry = 1; /* its rank 0 may come: the member asks again */
    } else if (!inst->local[0]) {
        bad = "is not rooted at this daemon";
    }
    else if (p->rank >= inst->nranks || inst->local[p->rank] ||
             strcmp(inst->addresses[p->rank], peer_conn_address(c)))
        bad = "has no such rank at that daemon";
    else if (p->session && (s = spread_of(inst, 0)) && s->sess[p->rank] &&
             s->sess[p->rank] != p->session) {
        /* a new client of that rank, whose announcement (on_ranks():
         * the old one leaves) has not come yet: not the old one back */
        bad = "has a new client of that rank, not announced yet";
        retry = 1;
    } else if (inst->batches.present[p->rank] &&
             inst->batches.away[p->rank]) {
        /* its daemon reaches us again (its address, authenticated):
         * back, reading on from where it was */
        batch_rank_back(&inst->batches, p->rank);
        assert(batch_rank_here(&inst->batches, p->rank));
        if ((s = spread_of(inst, 1)))
            s->via[p->rank] = peer_conn_id(c); /* its word comes over
                                                  this one now */
    }
    if (!bad && !batch_rank_here(&inst->batches, p->rank)) {
        /* its daemon was lost (or its client left): not counted in the
         * batches until it is announced again; asked again until then */
        bad = "does not count that rank now (its daemon was lost, and "
              "has not announced it again yet)";
        retry = 1;
    }
    if (!bad && p->session && (s = spread_of(inst, 1)) &&
        !s->sess[p->rank])
        s->sess[p->rank] = p->session; /* its poll came before its word */
    if (!bad) {
        uint64_t again = batch_rank_resume(&inst->batches, p->rank,
                                           p->resume);
        kvxd.stats.batches_resent += again;
        if (again)
            log_warn("instance %s: %llu batch(es) sent to rank %u at daemon "
                     "%s never arrived (a link lost with them on their way): "
                     "sent again, in order",
                     inst->id, (unsigned long long)again, p->rank,
                     peer_conn_address(c));
    }
    uint64_t now = kvxd_now_ms();
    uint32_t t = p->timeout_ms > kvxd.conf.poll_timeout_max_ms
                     ? kvxd.conf.poll_timeout_max_ms
                     : p->timeout_ms;
    int prc = bad ? 0
                  : batch_poll(&inst->batches, p->rank, p->req_id, p->at_least,
                               now + t, now);
    char lost[200];
    if (prc == KVX_ERR_LIMIT) {
        snprintf(lost, sizeof(lost),
                 "dropped batches %llu to %llu before rank %u read them "
                 "(limits.batches_kept %u); the next poll reads on",
                 (unsigned long long)inst->batches.missed_from,
                 (unsigned long long)inst->batches.missed_to, p->rank,
                 inst->batches.kept_max);
        bad = lost;
    } else if (prc) {
        bad = "already has a poll of that rank waiting";
    }
    if (!bad)
        return;
    char msg[512];
    snprintf(msg, sizeof(msg), "poll: instance %s %s (root daemon %s)",
             p->instance_id ? p->instance_id : "", bad, kvxd.address);
    const poll_fail_t f = {.instance = p->instance_id,
                           .rank = p->rank,
                           .req_id = p->req_id,
                           .session = p->session,
                           .code = prc == KVX_ERR_LIMIT ? KVX_ERR_LIMIT
                                                        : KVX_ERR_STATE,
                           .msg = msg,
                           .retry = retry};
    poll_fail_send(c, &f);
}

/* What a member reports must make sense for this instance: from a daemon
 * of it, the ranks it covers and needs within the instance, a known
 * kind, a code that is an error exactly when the kind is not COMPLETE
 * (inst NULL: all but the instance's own bounds). */
static int event_ok(const instance_t *inst, const char *from, int kind,
                    int code, uint32_t ranks, uint32_t expect)
{
    int member = !inst, complete = kind == KVX_EVENT_COMPLETE;
    uint32_t there = 0; /* a daemon reports for its own ranks at most */
    for (uint32_t r = 0; inst && r < inst->nranks; r++)
        there += !strcmp(inst->addresses[r], from);
    member = member || there;
    if (!member || !expect || (inst && expect > inst->nranks) || !ranks ||
        (inst && ranks > there) ||
        ranks > expect || kind < KVX_EVENT_COMPLETE ||
        kind > KVX_EVENT_TIMED_OUT || (complete != (code == 0)) ||
        code < KVX_ERR_LAST || code > 0) {
        log_warn("peer %s: malformed event for instance %s dropped", from,
                 inst ? inst->id : "(not joined here yet)");
        return 0;
    }
    return 1;
}

/* Root, not joined yet: keep a member's event until it joins. */
static void early_hold(const char *from, const Kvxfer__PeerEvent *e)
{
    if (!e->instance_id || strlen(e->instance_id) > INSTANCE_ID_MAX ||
        !e->key.len || e->key.len > KVX_MAX_KEY ||
        !event_ok(NULL, from, (int)e->kind, e->code, e->ranks, e->expect))
        return;
    if (nearly >= EARLY_MAX) {
        log_warn("instance %s: %u events wait for the instance to join "
                 "here; an event from %s is dropped",
                 e->instance_id, nearly, from);
        return;
    }
    early_t *x = calloc(1, sizeof(*x));
    if (!x ||
        !(x->msg = strndup(e->message ? e->message : "", EVENT_MSG_MAX)) ||
        (e->aux.len && !(x->aux = malloc(e->aux.len)))) {
        if (x)
            free(x->msg);
        free(x);
        return;
    }
    if (e->aux.len)
        memcpy(x->aux, e->aux.data, e->aux.len);
    x->aux_len = (uint32_t)e->aux.len;
    snprintf(x->instance, sizeof(x->instance), "%s", e->instance_id);
    snprintf(x->from, sizeof(x->from), "%s", from);
    x->request_id = xfer_key_id(e->key.data, e->key.len);
    x->key.len = (uint32_t)e->key.len;
    memcpy(x->key.b, e->key.data, e->key.len);
    x->offer = e->offer;
    x->kind = (int)e->kind;
    x->code = e->code;
    x->ranks = e->ranks;
    x->expect = e->expect;
    x->until_ms = kvxd_now_ms() + EARLY_FOR_MS;
    list_push(&earlies, &x->node);
    nearly++;
    assert(nearly <= EARLY_MAX);
}

static void on_event(peer_conn_t *c, const Kvxfer__PeerEvent *e)
{
    if (e->aux.len > kvxd.conf.aux_bytes) {
        /* the member's limit is larger than ours: the request fails
         * rather than the ranks getting a COMPLETE without its aux */
        char msg[EVENT_MSG_MAX + 1];
        snprintf(msg, sizeof(msg),
                 "an aux payload of %zu bytes from daemon %s is more than "
                 "limits.aux_bytes (%u) here",
                 e->aux.len, peer_conn_address(c), kvxd.conf.aux_bytes);
        log_warn("instance %s: %s", e->instance_id ? e->instance_id : "", msg);
        Kvxfer__PeerEvent f = *e;
        f.aux.data = NULL;
        f.aux.len = 0;
        if ((int)f.kind == KVX_EVENT_COMPLETE) {
            f.kind = KVXFER__EVENT_KIND__EVENT_ERROR;
            f.code = KVX_ERR_LIMIT;
            f.message = msg;
        }
        on_event(c, &f);
        return;
    }
    instance_t *inst = e->instance_id ? instance_find(e->instance_id) : NULL;
    if (!inst || !inst->joined) {
        early_hold(peer_conn_address(c), e);
        return;
    }
    if (!inst->local[0] || !e->key.len || e->key.len > KVX_MAX_KEY ||
        !event_ok(inst, peer_conn_address(c), (int)e->kind, e->code, e->ranks,
                  e->expect))
        return;
    reqkey_t key = {.len = (uint32_t)e->key.len};
    memcpy(key.b, e->key.data, e->key.len);
    if (e->code)
        kvxd_count_error(e->code);
    char msg[EVENT_MSG_MAX + 1]; /* a peer's message, cut to a sane size */
    snprintf(msg, sizeof(msg), "%s", e->message ? e->message : "");
    const xfer_event_t ev = {.request_id = xfer_key_id(key.b, key.len),
                             .key = &key,
                             .offer = e->offer,
                             .kind = (int)e->kind,
                             .code = e->code,
                             .msg = msg,
                             .ranks = e->ranks,
                             .expect = e->expect,
                             .aux = e->aux.data,
                             .aux_len = (uint32_t)e->aux.len};
    merge_report(inst, &ev);
}

static void on_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    switch (m->m_case) {
    case KVXFER__PEER_MSG__M_EVENT:
        on_event(c, m->event);
        break;
    case KVXFER__PEER_MSG__M_POLL:
        on_poll(c, m->poll);
        break;
    case KVXFER__PEER_MSG__M_BATCH:
        on_batch(c, m->batch);
        break;
    case KVXFER__PEER_MSG__M_RANKS:
        on_ranks(c, m->ranks);
        break;
    default:
        break;
    }
}

/* ---- a lost daemon ----------------------------------------------------- */

static int on_conn_lost(peer_conn_t *c, int code, const char *msg)
{
    (void)code;
    const char *addr = peer_conn_address(c);
    for (instance_t *inst = instance_first(); inst;
         inst = instance_next(inst)) {
        if (!instance_spread(inst))
            continue;
        spread_t *s = spread_of(inst, 0);
        if (!is_root(inst)) {
            if (strcmp(inst->addresses[0], addr) || !s)
                continue;
            for (uint32_t r = 0; r < inst->nranks; r++) {
                /* a poll that went out on another connection (a newer
                 * one) is not this loss's */
                if (s->poll[r].req &&
                    (!s->poll[r].conn || s->poll[r].conn == peer_conn_id(c))) {
                    char m[600];
                    snprintf(m, sizeof(m), "poll: root daemon of instance "
                                           "%s lost: %s",
                             inst->id, msg);
                    kvxd_reply(inst->rank_sid[r], s->poll[r].req,
                               KVX_ERR_PEER_GONE, m);
                    s->poll[r] = (fpoll_t){0};
                }
                /* the root dropped our ranks from its batches: they are
                 * announced again until it takes them back (when the link
                 * returns), so their polls are answered again */
                if (inst->local[r] && inst->rank_sid[r])
                    announce_queue(inst, r, 1, 0); /* from the tick: no
                                                      reconnect in here */
            }
            continue;
        }
        /* its ranks are away: they keep their place in the batches, so
         * when the link is back (the member announces them again) they
         * read every batch sealed meanwhile; not back within
         * ANNOUNCE_FOR_MS, they leave (agree_tick()). A rank whose
         * latest join came over another connection is not this loss's:
         * its member lost the link first and joined it again over a new
         * connection before this daemon noticed that the old one was
         * gone (a flap), and the requests started since go on */
        int had = 0;
        if (!s)
            s = spread_of(inst, 1);
        for (uint32_t r = 0; s && r < inst->nranks; r++)
            if (!inst->local[r] && !strcmp(inst->addresses[r], addr) &&
                (!s->via[r] || s->via[r] == peer_conn_id(c)) &&
                batch_rank_here(&inst->batches, r)) {
                batch_rank_away(&inst->batches, r);
                s->away_ms[r] = kvxd_now_ms();
                had = 1;
            }
        if (!had)
            continue;
        char m[600];
        snprintf(m, sizeof(m), "member %s", msg);
        /* what waited for the lost member's reports ends now */
        merges_fail(inst, m);
        /* a rank gone ends the instance's requests, as on one daemon */
        xfer_end_instance(inst, KVX_ERR_PEER_GONE, m);
    }
    return 0;
}

/* ---- retries ----------------------------------------------------------- */

void agree_tick(uint64_t now)
{
    helds_tick(now);
    /* root: ranks away too long are gone: they free their batches */
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &spreads)
    for (uint32_t r = 0;
         is_root(SPREAD(n)->inst) && r < SPREAD(n)->inst->nranks; r++) {
        spread_t *s = SPREAD(n);
        if (s->inst->batches.away[r] && now >= s->away_ms[r] + ANNOUNCE_FOR_MS)
            batch_rank_leave(&s->inst->batches, r);
        /* only a rank of another daemon is away */
        assert(!s->inst->batches.away[r] || !s->inst->local[r]);
    }
    /* members' events whose instance never joined here */
    LIST_FOREACH_SAFE(n, t, &earlies)
    {
        early_t *x = EARLY(n);
        if (now < x->until_ms)
            continue;
        log_warn("instance %s never joined here: the event of request %s "
                 "from %s is dropped",
                 x->instance,
                 reqkey_str(x->key.b, x->key.len, (char[REQKEY_STR_MAX]){0}),
                 x->from);
        list_remove(n);
        assert(nearly > 0);
        nearly--;
        free(x->msg);
        free(x->aux);
        free(x);
    }
    /* announcements the root has not acknowledged: again */
    LIST_FOREACH_SAFE(n, t, &announces)
    {
        announce_t *a = ANNOUNCE(n);
        if (now >= a->until_ms) {
            log_warn("instance %s: the root daemon %s never acknowledged "
                     "that rank %u %s",
                     a->instance, a->root, a->rank,
                     a->joined ? "joined" : "left");
            list_remove(n);
            free(a);
            continue;
        }
        if (now >= a->next_ms) {
            a->next_ms = now + ANNOUNCE_EVERY_MS;
            announce_send(a);
        }
    }
    /* root: merged requests whose missing reports never came */
    LIST_FOREACH_SAFE(n, t, &spreads)
    {
        spread_t *s = SPREAD(n);
        instance_t *inst = s->inst;
        for (int k = 0; k < 2 && is_root(inst); k++) {
        uint32_t n = s->merges[k].n;
        uint64_t *keys = calloc(n ? n : 1, sizeof(*keys));
        n = keys ? map_keys(&s->merges[k], keys, n) : 0;
        for (uint32_t i = 0; i < n; i++) {
            merge_t *m = map_get(&s->merges[k], keys[i]);
            if (!m || now < m->deadline_ms)
                continue;
            assert(m->offer == k && m->seen < m->expect);
            if (!m->emitted) {
                char msg[300];
                snprintf(msg, sizeof(msg),
                         "%u of the %u ranks of instance %s never reported "
                         "(other daemons)",
                         m->expect - m->seen, m->expect, inst->id);
                kvxd_count_error(KVX_ERR_TIMED_OUT);
                /* kept a while more, emitted: a report still to come
                 * (a part ending at its own, later deadline) adds no
                 * second event */
                merge_emit(inst, m, KVX_EVENT_TIMED_OUT, KVX_ERR_TIMED_OUT,
                           msg);
                m->deadline_ms = now + kvxd.conf.offer_lease_ms +
                                 kvxd.conf.fetch_timeout_ms;
                continue;
            }
            map_del(&s->merges[k], keys[i]);
            merge_free(m);
        }
        free(keys);
        }
    }
    /* polls the root could not take yet: again, until their deadline */
    LIST_FOREACH_SAFE(n, t, &spreads)
    {
        spread_t *s = SPREAD(n);
        instance_t *inst = s->inst;
        if (is_root(inst))
            continue;
        for (uint32_t r = 0; r < inst->nranks; r++) {
            fpoll_t *fp = &s->poll[r];
            assert(!fp->req || inst->local[r]); /* its own ranks' only */
            if (fp->req && !fp->retry_ms &&
                now >= fp->deadline_ms + POLL_LATE_MS) {
                char m[300];
                snprintf(m, sizeof(m), "poll: the root daemon %s of "
                                       "instance %s did not answer it",
                         inst->addresses[0], inst->id);
                uint64_t req = fp->req;
                fp->req = 0;
                kvxd_count_error(KVX_ERR_PEER_GONE);
                kvxd_reply(inst->rank_sid[r], req, KVX_ERR_PEER_GONE, m);
                continue;
            }
            if (!fp->req || !fp->retry_ms || now < fp->retry_ms)
                continue;
            fp->retry_ms = 0;
            uint64_t req = fp->req;
            if (now >= fp->deadline_ms) {
                char m[300];
                snprintf(m, sizeof(m), "poll: instance %s has not joined at "
                                       "its root daemon %s",
                         inst->id, inst->addresses[0]);
                fp->req = 0;
                kvxd_reply(inst->rank_sid[r], req, KVX_ERR_STATE, m);
                continue;
            }
            if (poll_send(inst, r, req, fp->at_least,
                          (uint32_t)(fp->deadline_ms - now), &fp->conn)) {
                fp->req = 0;
                kvxd_reply(inst->rank_sid[r], req, KVX_ERR_PEER_GONE,
                           "poll: the root daemon is unreachable");
            }
        }
    }
}

void agree_cleanup(void)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &earlies)
    {
        list_remove(n);
        free(EARLY(n)->msg);
        free(EARLY(n));
    }
    nearly = 0;
    LIST_FOREACH_SAFE(n, t, &announces)
    {
        list_remove(n);
        free(ANNOUNCE(n));
    }
    LIST_FOREACH_SAFE(n, t, &helds)
    {
        list_remove(n);
        free(HELD(n)->reply);
        free(HELD(n));
    }
}

/* ---- registration ------------------------------------------------------ */

/* A sealed batch answers a waiting poll: to the rank's session here, or
 * to the daemon of a rank elsewhere (instance_hooks_t.deliver). */
static int deliver(instance_t *inst, uint32_t rank, uint64_t req_id,
                   const batch_t *b)
{
    if (inst->joined && !inst->local[rank]) /* a rank of another daemon */
        return agree_deliver(inst, rank, req_id, b);
    Kvxfer__PollReply pr = KVXFER__POLL_REPLY__INIT;
    Kvxfer__Event *ev, **evp;
    if (instance_batch_events(b, &ev, &evp)) {
        kvxd_reply(inst->rank_sid[rank], req_id, KVX_ERR_NOMEM,
                   "poll: out of memory building the batch");
        return 0;
    }
    pr.batch = b->seq;
    pr.n_events = b->nevents;
    pr.events = evp;
    pr.early = b->early != 0;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = req_id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_POLL;
    r.poll = &pr;
    if (!agree_fence_batch(inst, inst->rank_sid[rank], &r))
        kvxd_reply_msg(inst->rank_sid[rank], &r);
    free(ev);
    free(evp);
    return 0;
}

int agree_init(void)
{
    static const instance_hooks_t hooks = {.deliver = deliver,
                                           .ends = agree_instance_ends,
                                           .forget = agree_forget};
    instance_set_hooks(&hooks);
    xfer_set_spread_event(agree_event);
    static const int kinds[] = {
        KVXFER__PEER_MSG__M_EVENT, KVXFER__PEER_MSG__M_POLL,
        KVXFER__PEER_MSG__M_BATCH, KVXFER__PEER_MSG__M_RANKS};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        peer_on_msg(kinds[i], on_msg);
    peer_on_lost(on_conn_lost);
    return 0;
}
