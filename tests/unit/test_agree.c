/*
 * test_agree — completion agreement for an instance spread over two
 * daemons, driven deterministically with the net layer stubbed
 * (stub_net.c): the root merges the reports of a request and queues one
 * event, an error at once; a member forwards its reports and polls to the
 * root; the root answers a member's poll with the batch it seals, under
 * its epoch; a lost member's ranks go away and the merges waiting for it
 * fail; a lost root fails the member's waiting poll.
 *
 * unit-exclude: daemon/net/peer.c daemon/net/peer_auth.c
 * unit-exclude: daemon/net/peer_addr.c daemon/net/peer_handshake.c
 * unit-exclude: daemon/net/peer_init.c daemon/net/peer_status.c
 */
#include "../../daemon/agree/agree.c"

#include "tests/test.h"

#include "stub_net.c"

/* The key of request n (its digits), as the uint64_t API makes it. */
static const reqkey_t *K(uint64_t n)
{
    static reqkey_t k[8];
    static unsigned i;
    reqkey_t *r = &k[i++ & 7];
    reqkey_from_u64(r, n);
    return r;
}
#define KID(n) xfer_key_id(K(n)->b, K(n)->len)

#define ME "kvx://10.0.0.1:7000/00000000000000aa"
#define OTHER "kvx://10.0.0.2:7000/00000000000000bb"

/* what the sink got: replies to sessions */
static struct reply {
    uint64_t sid, req;
    int status;
    char msg[300];
} replies[32];
static int nreplies;

static void sink_reply(uint64_t sid, uint64_t req, int status,
                       const char *message)
{
    if (nreplies < 32)
        replies[nreplies++] = (struct reply){sid, req, status, ""};
    snprintf(replies[nreplies - 1].msg, sizeof(replies[0].msg), "%s", message);
}

static void sink_reply_msg(uint64_t sid, Kvxfer__Reply *r)
{
    sink_reply(sid, r->id, r->status, r->message ? r->message : "");
}

/* Instance id of tp 2: rank 0 on the root, rank 1 on the member; this
 * daemon is the root (root = 1) or the member. Its local rank's session
 * is 100 + rank. */
static instance_t *spread_instance(const char *id, int root)
{
    static int once;
    if (!once++) {
        conf_defaults(&kvxd.conf);
        kvx__log_level = 4; /* warnings and worse */
        snprintf(kvxd.address, sizeof(kvxd.address), "%s", ME);
        static const kvxd_reply_sink_t sink = {sink_reply, sink_reply_msg};
        kvxd_set_reply_sink(&sink);
        CHECK_EQ(agree_init(), 0);
    }
    plan_side_t side = {
        .tp = 2, .pp = 1, .cp = 1, .total_layers = 2, .total_heads = 2};
    uint32_t rank = root ? 0 : 1;
    instance_t *inst;
    char why[256];
    CHECK_EQ(instance_attach(&(instance_hello_t){id, 0, KVX_ROLE_CONTEXT, rank,
                                                 &side, 100 + rank},
                             &inst, KVX_WHY(why)),
             0);
    char *addrs[2] = {root ? ME : OTHER, root ? OTHER : ME};
    CHECK_EQ(instance_join(inst, rank, addrs, 2, KVX_WHY(why)), 0);
    agree_joined(inst);
    CHECK(instance_spread(inst));
    return inst;
}

static void event_from(const char *addr, const char *inst, uint64_t req,
                       int offer, int kind, int code, const char *msg)
{
    Kvxfer__PeerEvent e = KVXFER__PEER_EVENT__INIT;
    e.instance_id = (char *)inst;
    e.request_id = req;
    e.key.data = (uint8_t *)K(req)->b;
    e.key.len = K(req)->len;
    e.offer = offer;
    e.kind = kind;
    e.code = code;
    e.message = (char *)msg;
    e.ranks = 1;
    e.expect = 2;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_EVENT;
    m.event = &e;
    net_deliver(addr, &m);
}

TEST(root_merges_reports_into_one_event)
{
    instance_t *inst = spread_instance("m1", 1);
    batch_state_t *bs = &inst->batches;
    /* the root's own rank's report: half of what the request needs */
    agree_event(inst, &(xfer_event_t){.request_id = KID(7),
                                      .key = K(7),
                                      .offer = 1,
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    CHECK_EQ(bs->npending, 0);
    event_from(OTHER, "m1", 7, 1, KVX_EVENT_COMPLETE, 0, "");
    CHECK_EQ(bs->npending, 1);
    CHECK_EQ(reqkey_to_u64(bs->pending[0].key.b, bs->pending[0].key.len), 7);
    CHECK_EQ(bs->pending[0].kind, KVX_EVENT_COMPLETE);
    /* the merge is over: the same report again starts a new one and
     * queues nothing by itself */
    event_from(OTHER, "m1", 7, 1, KVX_EVENT_COMPLETE, 0, "");
    CHECK_EQ(bs->npending, 1);
    /* offers and fetches of one id merge apart */
    agree_event(inst, &(xfer_event_t){.request_id = KID(8),
                                      .key = K(8),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    agree_event(inst, &(xfer_event_t){.request_id = KID(8),
                                      .key = K(8),
                                      .offer = 1,
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    CHECK_EQ(bs->npending, 1);
}

TEST(root_queues_the_first_error_at_once)
{
    instance_t *inst = spread_instance("e1", 1);
    batch_state_t *bs = &inst->batches;
    event_from(OTHER, "e1", 9, 0, KVX_EVENT_ERROR, KVX_ERR_IO, "copy failed");
    CHECK_EQ(bs->npending, 1);
    CHECK_EQ(bs->pending[0].kind, KVX_EVENT_ERROR);
    CHECK_EQ(bs->pending[0].code, KVX_ERR_IO);
    CHECK_STR_CONTAINS(bs->pending[0].message, "copy failed");
    /* the root's own COMPLETE for it adds nothing */
    agree_event(inst, &(xfer_event_t){.request_id = KID(9),
                                      .key = K(9),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    CHECK_EQ(bs->npending, 1);
}

TEST(member_forwards_its_reports_to_the_root)
{
    instance_t *inst = spread_instance("f1", 0);
    agree_event(inst, &(xfer_event_t){.request_id = KID(21),
                                      .key = K(21),
                                      .kind = KVX_EVENT_CANCELLED,
                                      .code = KVX_ERR_CANCELLED,
                                      .msg = "cancelled",
                                      .ranks = 1,
                                      .expect = 2});
    CHECK_EQ(inst->batches.npending, 0); /* the root seals, not we */
    const Kvxfer__PeerMsg *m = net_sent(KVXFER__PEER_MSG__M_EVENT, 0);
    CHECK(m);
    CHECK_STR_CONTAINS(m->event->instance_id, "f1");
    CHECK_EQ(m->event->request_id, KID(21));
    CHECK_EQ(m->event->kind, KVX_EVENT_CANCELLED);
    CHECK_EQ(m->event->ranks, 1);
    CHECK_EQ(m->event->expect, 2);
}

TEST(root_answers_a_member_poll_with_its_sealed_batch)
{
    instance_t *inst = spread_instance("b1", 1);
    Kvxfer__PeerPoll p = KVXFER__PEER_POLL__INIT;
    p.instance_id = "b1";
    p.rank = 1;
    p.req_id = 55;
    p.at_least = 1;
    p.timeout_ms = 5000;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_POLL;
    m.poll = &p;
    net_deliver(OTHER, &m);
    CHECK(!net_sent(KVXFER__PEER_MSG__M_BATCH, 0)); /* nothing to seal */
    agree_event(inst, &(xfer_event_t){.request_id = KID(5),
                                      .key = K(5),
                                      .kind = KVX_EVENT_ERROR,
                                      .code = KVX_ERR_TIMED_OUT,
                                      .msg = "late",
                                      .ranks = 1,
                                      .expect = 2});
    const Kvxfer__PeerMsg *b = net_sent(KVXFER__PEER_MSG__M_BATCH, 0);
    CHECK(b);
    CHECK_EQ(b->batch->rank, 1);
    CHECK_EQ(b->batch->req_id, 55);
    CHECK_EQ(b->batch->epoch, inst->epoch); /* this incarnation's */
    CHECK_EQ(b->batch->batch, 0);
    CHECK_EQ(b->batch->n_events, 1);
    CHECK_EQ(reqkey_to_u64(b->batch->events[0]->key.data,
                           b->batch->events[0]->key.len),
             5);
    CHECK_EQ(b->batch->events[0]->code, KVX_ERR_TIMED_OUT);
}

TEST(lost_member_ranks_go_away_and_its_merges_fail)
{
    instance_t *inst = spread_instance("l1", 1);
    batch_state_t *bs = &inst->batches;
    agree_event(inst, &(xfer_event_t){.request_id = KID(11),
                                      .key = K(11),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    CHECK_EQ(bs->npending, 0); /* waits for the member's report */
    net_lose(OTHER, "link down");
    CHECK(bs->away[1]);
    CHECK_EQ(bs->npending, 1);
    CHECK_EQ(reqkey_to_u64(bs->pending[0].key.b, bs->pending[0].key.len), 11);
    CHECK_EQ(bs->pending[0].kind, KVX_EVENT_ERROR);
    CHECK_EQ(bs->pending[0].code, KVX_ERR_PEER_GONE);
    CHECK_STR_CONTAINS(bs->pending[0].message,
                       "member daemon " OTHER ": link down");
    /* a new request that needs every rank ends at once: one is gone */
    agree_event(inst, &(xfer_event_t){.request_id = KID(12),
                                      .key = K(12),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    CHECK_EQ(bs->npending, 2);
    CHECK_EQ(bs->pending[1].code, KVX_ERR_PEER_GONE);
}

TEST(lost_root_fails_the_members_waiting_poll)
{
    instance_t *inst = spread_instance("p1", 0);
    char why[256];
    CHECK_EQ(agree_poll(inst, 1, 42, 1, 5000, KVX_WHY(why)), 0);
    const Kvxfer__PeerMsg *m = net_sent(KVXFER__PEER_MSG__M_POLL, 0);
    CHECK(m);
    CHECK_EQ(m->poll->req_id, 42);
    CHECK_EQ(m->poll->rank, 1);
    /* a second poll of the same rank while one waits */
    CHECK_EQ(agree_poll(inst, 1, 43, 1, 5000, KVX_WHY(why)), KVX_ERR_BUSY);
    CHECK_EQ(nreplies, 0);
    net_lose(OTHER, "root went away");
    CHECK_EQ(nreplies, 1);
    CHECK_EQ(replies[0].sid, 101);
    CHECK_EQ(replies[0].req, 42);
    CHECK_EQ(replies[0].status, KVX_ERR_PEER_GONE);
    CHECK_STR_CONTAINS(replies[0].msg, "root daemon of instance p1 lost");
    CHECK_STR_CONTAINS(replies[0].msg, "daemon " OTHER ": root went away");
}

TEST(member_poll_refused_when_the_root_is_unreachable)
{
    net_down = OTHER;
    instance_t *inst = spread_instance("u1", 0);
    char why[256];
    CHECK_EQ(agree_poll(inst, 1, 7, 1, 5000, KVX_WHY(why)), KVX_ERR_PEER_GONE);
    CHECK_STR_CONTAINS(why, "root daemon " OTHER " of instance u1 is "
                            "unreachable");
}

/* A member's report of request req with aux (len bytes). */
static void event_aux_from(const char *addr, const char *inst, uint64_t req,
                           const void *aux, size_t len)
{
    Kvxfer__PeerEvent e = KVXFER__PEER_EVENT__INIT;
    e.instance_id = (char *)inst;
    e.request_id = req;
    e.key.data = (uint8_t *)K(req)->b;
    e.key.len = K(req)->len;
    e.kind = KVXFER__EVENT_KIND__EVENT_COMPLETE;
    e.message = "";
    e.ranks = 1;
    e.expect = 2;
    e.aux.data = (uint8_t *)aux;
    e.aux.len = len;
    Kvxfer__PeerMsg m = KVXFER__PEER_MSG__INIT;
    m.m_case = KVXFER__PEER_MSG__M_EVENT;
    m.event = &e;
    net_deliver(addr, &m);
}

TEST(root_merges_the_first_aux_into_the_complete)
{
    instance_t *inst = spread_instance("a1", 1);
    batch_state_t *bs = &inst->batches;
    /* the root's own report has none, the member's has one */
    agree_event(inst, &(xfer_event_t){.request_id = KID(7),
                                      .key = K(7),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    event_aux_from(OTHER, "a1", 7, "first", 5);
    CHECK_EQ(bs->npending, 1);
    CHECK_EQ(bs->pending[0].kind, KVX_EVENT_COMPLETE);
    CHECK_EQ(bs->pending[0].aux_len, 5);
    CHECK(!memcmp(bs->pending[0].aux, "first", 5));
    /* the other way round: the first non-empty one wins */
    agree_event(inst, &(xfer_event_t){.request_id = KID(8),
                                      .key = K(8),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2,
                                      .aux = (const uint8_t *)"mine",
                                      .aux_len = 4});
    event_aux_from(OTHER, "a1", 8, "theirs", 6);
    CHECK_EQ(bs->npending, 2);
    CHECK_EQ(bs->pending[1].aux_len, 4);
    CHECK(!memcmp(bs->pending[1].aux, "mine", 4));
    /* an offer's event never carries one */
    agree_event(inst, &(xfer_event_t){.request_id = KID(9),
                                      .key = K(9),
                                      .offer = 1,
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 2,
                                      .expect = 2,
                                      .aux = (const uint8_t *)"x",
                                      .aux_len = 1});
    CHECK_EQ(bs->npending, 3);
    CHECK_EQ(bs->pending[2].aux_len, 0);
    CHECK(bs->pending[2].aux == NULL);
}

TEST(root_fails_a_report_whose_aux_is_over_its_limit)
{
    instance_t *inst = spread_instance("a2", 1);
    batch_state_t *bs = &inst->batches;
    kvxd.conf.aux_bytes = 8;
    agree_event(inst, &(xfer_event_t){.request_id = KID(7),
                                      .key = K(7),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    event_aux_from(OTHER, "a2", 7, "123456789", 9);
    CHECK_EQ(bs->npending, 1);
    CHECK_EQ(bs->pending[0].kind, KVX_EVENT_ERROR);
    CHECK_EQ(bs->pending[0].code, KVX_ERR_LIMIT);
    CHECK_EQ(bs->pending[0].aux_len, 0);
    CHECK_STR_CONTAINS(bs->pending[0].message, "limits.aux_bytes");
}

TEST(member_forwards_the_aux_of_its_complete)
{
    instance_t *inst = spread_instance("a3", 0);
    agree_event(inst, &(xfer_event_t){.request_id = KID(21),
                                      .key = K(21),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2,
                                      .aux = (const uint8_t *)"aux!",
                                      .aux_len = 4});
    const Kvxfer__PeerMsg *m = net_sent(KVXFER__PEER_MSG__M_EVENT, 0);
    CHECK(m);
    CHECK_EQ(m->event->aux.len, 4);
    CHECK(!memcmp(m->event->aux.data, "aux!", 4));
}

/* fn() in a child: 1 when it aborts (a failed assert), 0 when it returns */
static int aborts(void (*fn)(void))
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "w", stderr)) /* the assert's line */
            _exit(2);
        fn();
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
}

static void emit_after_error(void)
{
    instance_t *inst = spread_instance("x1", 1);
    agree_event(inst, &(xfer_event_t){.request_id = KID(31),
                                      .key = K(31),
                                      .kind = KVX_EVENT_ERROR,
                                      .code = KVX_ERR_IO,
                                      .msg = "copy failed",
                                      .ranks = 1,
                                      .expect = 2});
    spread_t *s = spread_of(inst, 0);
    merge_t *m = map_get(&s->merges[0], KID(31));
    CHECK(m && m->emitted && m->failed);
    /* a second event for the request, after its error went out: failed
     * back to ok */
    m->seen = m->expect;
    merge_emit(inst, m, KVX_EVENT_COMPLETE, 0, "");
}

static void report_over_the_ranks(void)
{
    instance_t *inst = spread_instance("x2", 1);
    agree_event(inst, &(xfer_event_t){.request_id = KID(32),
                                      .key = K(32),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 3}); /* of 2 ranks */
}

static void root_forwards_a_poll(void)
{
    instance_t *inst = spread_instance("x3", 1);
    char why[256];
    agree_poll(inst, 0, 1, 1, 1000, KVX_WHY(why));
}

static void merge_within_the_rules(void)
{
    instance_t *inst = spread_instance("x4", 1);
    agree_event(inst, &(xfer_event_t){.request_id = KID(33),
                                      .key = K(33),
                                      .kind = KVX_EVENT_COMPLETE,
                                      .msg = "",
                                      .ranks = 1,
                                      .expect = 2});
    event_from(OTHER, "x4", 33, 0, KVX_EVENT_COMPLETE, 0, "");
    CHECK_EQ(inst->batches.npending, 1);
}

/* The merge and seal rules are asserted, in the build the tests run: a
 * broken one aborts the daemon rather than going on (agree.c's top) */
TEST(agree_asserts_its_merge_rules)
{
    CHECK(!aborts(merge_within_the_rules));
    CHECK(aborts(emit_after_error));
    CHECK(aborts(report_over_the_ranks));
    CHECK(aborts(root_forwards_a_poll));
}
