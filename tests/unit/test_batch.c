/*
 * test_batch — the sealing rules of daemon/xfer/batch.h: at_least, deadlines,
 * batch k identical on every rank, immediate answers for sealed batches,
 * trimming once every present rank has read, join/leave, BUSY, flush;
 * then a random schedule checked against those rules after every step.
 */
#include "../../daemon/xfer/batch.c"

#include "tests/test.h"

#include <stdint.h>

#include "common/reqkey.h"
#include "kvxfer.h"

/* The key of request n (its digits), as the uint64_t API makes it. */
static const reqkey_t *K(uint64_t n)
{
    static reqkey_t k[8];
    static unsigned i;
    reqkey_t *r = &k[i++ & 7];
    reqkey_from_u64(r, n);
    return r;
}

/* ---- a deliver callback that records everything ---- */

typedef struct rec_event {
    uint64_t request_id;
    int kind, code;
    char msg[32];
    uint8_t aux[8];
    uint32_t aux_len;
} rec_event_t;

typedef struct rec {
    uint32_t rank;
    uint64_t req_id, seq;
    int early;
    uint32_t nevents;
    rec_event_t ev[64];
} rec_t;

#define MAXREC 20000
static rec_t recs[MAXREC];
static int nrec;

static int fail_delivery; /* the next deliveries fail (not sent) */

static int on_deliver(void *arg, uint32_t rank, uint64_t req_id,
                      const batch_t *b)
{
    CHECK(arg == (void *)recs);
    if (fail_delivery) {
        fail_delivery--;
        return -1;
    }
    CHECK(nrec < MAXREC);
    rec_t *r = &recs[nrec++];
    r->rank = rank;
    r->req_id = req_id;
    r->seq = b->seq;
    r->early = b->early;
    r->nevents = b->nevents;
    CHECK(b->nevents <= 64);
    for (uint32_t i = 0; i < b->nevents; i++) {
        r->ev[i].request_id = b->events[i].request_id;
        r->ev[i].kind = b->events[i].kind;
        r->ev[i].code = b->events[i].code;
        CHECK(b->events[i].message != NULL);
        snprintf(r->ev[i].msg, sizeof(r->ev[i].msg), "%s",
                 b->events[i].message);
        CHECK(b->events[i].aux_len <= sizeof(r->ev[i].aux));
        CHECK((b->events[i].aux == NULL) == (b->events[i].aux_len == 0));
        r->ev[i].aux_len = b->events[i].aux_len;
        if (b->events[i].aux_len)
            memcpy(r->ev[i].aux, b->events[i].aux, b->events[i].aux_len);
    }
    return 0;
}

static int same_events(const rec_t *a, const rec_t *b)
{
    if (a->nevents != b->nevents)
        return 0;
    for (uint32_t i = 0; i < a->nevents; i++)
        if (a->ev[i].request_id != b->ev[i].request_id ||
            a->ev[i].kind != b->ev[i].kind ||
            a->ev[i].code != b->ev[i].code ||
            strcmp(a->ev[i].msg, b->ev[i].msg))
            return 0;
    return 1;
}

static void init(batch_state_t *bs, uint32_t nranks)
{
    nrec = 0;
    CHECK_EQ(batch_init(bs, nranks, on_deliver, recs), 0);
    for (uint32_t r = 0; r < nranks; r++)
        batch_rank_join(bs, r);
}

static void push(batch_state_t *bs, uint64_t id, uint64_t now)
{
    char m[32];
    snprintf(m, sizeof(m), "ev%llu", (unsigned long long)id);
    CHECK_EQ(batch_push(bs, id, K(id),
                        &(batch_end_t){KVX_EVENT_COMPLETE + (int)(id % 4),
                                       -(int)(id % 5), m, NULL, 0},
                        now),
             0);
}

static uint32_t nbatches_held(const batch_state_t *bs)
{
    uint32_t n = 0;
    list_t *x, *t;
    LIST_FOREACH_SAFE(x, t, &bs->sealed)
    {
        n++;
    }
    CHECK_EQ(batch_kept(bs), n);
    return n;
}

/* The oldest batch held, or NULL. */
static const batch_t *first_held(const batch_state_t *bs)
{
    list_t *n = list_first(&bs->sealed);
    return n ? BATCH(n) : NULL;
}

/* No batch held, the list's both ends saying so. */
static int none_held(const batch_state_t *bs)
{
    return list_empty(&bs->sealed) && bs->sealed.prev == &bs->sealed;
}

/* ---- the rules, one at a time ---- */

TEST(seals_when_pending_reaches_at_least)
{
    batch_state_t bs;
    init(&bs, 2);
    CHECK_EQ(batch_poll(&bs, 0, 100, 3, 1000, 0), 0);
    CHECK_EQ(nrec, 0);
    push(&bs, 1, 1);
    push(&bs, 2, 2);
    CHECK_EQ(nrec, 0);
    CHECK_EQ(bs.npending, 2);
    push(&bs, 3, 3);
    CHECK_EQ(nrec, 1);
    CHECK_EQ(recs[0].rank, 0);
    CHECK_EQ(recs[0].req_id, 100);
    CHECK_EQ(recs[0].seq, 0);
    CHECK_EQ(recs[0].nevents, 3);
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(recs[0].ev[i].request_id, i + 1);
        CHECK_EQ(recs[0].ev[i].kind, KVX_EVENT_COMPLETE + (i + 1) % 4);
        CHECK_EQ(recs[0].ev[i].code, -((i + 1) % 5));
    }
    CHECK(!strcmp(recs[0].ev[2].msg, "ev3"));
    CHECK_EQ(bs.npending, 0);
    CHECK_EQ(bs.next_seq, 1);
    CHECK_EQ(bs.sealed_total, 1);
    /* the next events wait for the next batch */
    push(&bs, 4, 4);
    CHECK_EQ(nrec, 1);
    CHECK_EQ(bs.npending, 1);
    batch_cleanup(&bs);
}

TEST(pending_already_enough_seals_at_poll)
{
    batch_state_t bs;
    init(&bs, 1);
    push(&bs, 1, 0);
    push(&bs, 2, 0);
    CHECK_EQ(nrec, 0); /* nobody asked: nothing sealed */
    CHECK_EQ(bs.next_seq, 0);
    CHECK_EQ(batch_poll(&bs, 0, 7, 2, 1000, 0), 0);
    CHECK_EQ(nrec, 1);
    CHECK_EQ(recs[0].nevents, 2);
    /* at_least 0 answers at once, with an empty batch */
    CHECK_EQ(batch_poll(&bs, 0, 8, 0, 1000, 0), 0);
    CHECK_EQ(nrec, 2);
    CHECK_EQ(recs[1].seq, 1);
    CHECK_EQ(recs[1].nevents, 0);
    batch_cleanup(&bs);
}

/* Poll.early: a waiting rank that asked for it is answered, without a
 * batch, when batch_wake_early() says an event is near; its cursor stays,
 * a rank that did not ask keeps waiting, and the next poll reads batch 0
 * as before. */
TEST(early_wake_answers_without_a_batch)
{
    batch_state_t bs;
    init(&bs, 2);
    CHECK_EQ(batch_wake_early(&bs), 0); /* nobody waits */
    CHECK_EQ(batch_poll(&bs, 0, 20, 1, 1000, 0), 0);
    CHECK_EQ(batch_poll(&bs, 1, 21, 1, 1000, 0), 0);
    batch_waiter_early(&bs, 0);
    CHECK_EQ(batch_wake_early(&bs), 1);
    CHECK_EQ(nrec, 1);
    CHECK_EQ(recs[0].rank, 0);
    CHECK_EQ(recs[0].req_id, 20);
    CHECK_EQ(recs[0].early, 1);
    CHECK_EQ(recs[0].nevents, 0);
    CHECK_EQ(recs[0].seq, 0);
    CHECK_EQ(bs.cursor[0], 0);
    CHECK_EQ(bs.next_seq, 0);           /* nothing sealed */
    CHECK_EQ(batch_wake_early(&bs), 0); /* answered once */
    /* rank 0 polls again (no early); the event seals batch 0 for both */
    CHECK_EQ(batch_poll(&bs, 0, 22, 1, 1000, 0), 0);
    push(&bs, 5, 0);
    CHECK_EQ(nrec, 3);
    for (int i = 1; i < 3; i++) {
        CHECK_EQ(recs[i].early, 0);
        CHECK_EQ(recs[i].seq, 0);
        CHECK_EQ(recs[i].nevents, 1);
    }
    batch_waiter_early(&bs, 1); /* not waiting: nothing */
    CHECK_EQ(batch_wake_early(&bs), 0);
    /* an early answer that cannot go out: the poll waits on, and the
     * next event reaches it in its batch */
    CHECK_EQ(batch_poll(&bs, 0, 23, 1, 1000, 0), 0);
    batch_waiter_early(&bs, 0);
    fail_delivery = 1;
    CHECK_EQ(batch_wake_early(&bs), 0);
    CHECK_EQ(nrec, 3);
    CHECK_EQ(batch_wake_early(&bs), 0); /* not asked again */
    push(&bs, 6, 0);
    CHECK_EQ(nrec, 4);
    CHECK_EQ(recs[3].req_id, 23);
    CHECK_EQ(recs[3].early, 0);
    CHECK_EQ(recs[3].seq, 1);
    CHECK_EQ(recs[3].nevents, 1);
    batch_cleanup(&bs);
}

TEST(any_waiting_rank_at_least_seals_for_all)
{
    batch_state_t bs;
    init(&bs, 3);
    CHECK_EQ(batch_poll(&bs, 0, 10, 5, 1000, 0), 0);
    CHECK_EQ(batch_poll(&bs, 1, 11, 2, 1000, 0), 0);
    CHECK_EQ(batch_poll(&bs, 2, 12, 9, 1000, 0), 0);
    push(&bs, 1, 1);
    CHECK_EQ(nrec, 0);
    push(&bs, 2, 1);
    /* rank 1's at_least 2 seals batch 0 for every waiting rank */
    CHECK_EQ(nrec, 3);
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(recs[i].seq, 0);
        CHECK_EQ(recs[i].nevents, 2);
        CHECK_EQ(recs[i].req_id, 10 + recs[i].rank);
    }
    CHECK(recs[0].rank != recs[1].rank && recs[1].rank != recs[2].rank &&
          recs[0].rank != recs[2].rank);
    CHECK(none_held(&bs)); /* read by all three: freed */
    batch_cleanup(&bs);
}

TEST(deadline_seals_possibly_empty)
{
    batch_state_t bs;
    init(&bs, 2);
    CHECK_EQ(batch_next_deadline(&bs), UINT64_MAX);
    CHECK_EQ(batch_poll(&bs, 0, 1, 5, 100, 0), 0);
    CHECK_EQ(batch_next_deadline(&bs), 100);
    CHECK_EQ(batch_poll(&bs, 1, 2, 5, 60, 0), 0);
    CHECK_EQ(batch_next_deadline(&bs), 60);
    push(&bs, 1, 10);
    batch_tick(&bs, 59);
    CHECK_EQ(nrec, 0);
    batch_tick(&bs, 60); /* rank 1's deadline seals for rank 0 too */
    CHECK_EQ(nrec, 2);
    CHECK_EQ(recs[0].nevents, 1);
    CHECK_EQ(recs[1].nevents, 1);
    CHECK_EQ(batch_next_deadline(&bs), UINT64_MAX);

    /* empty: nothing pending at the deadline */
    CHECK_EQ(batch_poll(&bs, 0, 3, 1, 200, 100), 0);
    batch_tick(&bs, 150);
    CHECK_EQ(nrec, 2);
    batch_tick(&bs, 200);
    CHECK_EQ(nrec, 3);
    CHECK_EQ(recs[2].rank, 0);
    CHECK_EQ(recs[2].seq, 1);
    CHECK_EQ(recs[2].nevents, 0);
    /* rank 1 reads the same empty batch later */
    CHECK_EQ(batch_poll(&bs, 1, 4, 7, 1000, 300), 0);
    CHECK_EQ(nrec, 4);
    CHECK_EQ(recs[3].seq, 1);
    CHECK_EQ(recs[3].nevents, 0);

    /* a poll whose deadline has already passed seals at once */
    CHECK_EQ(batch_poll(&bs, 0, 5, 10, 50, 400), 0);
    CHECK_EQ(nrec, 5);
    CHECK_EQ(recs[4].seq, 2);
    /* and a push after a deadline seals too */
    CHECK_EQ(batch_poll(&bs, 1, 6, 10, 0, 0), 0); /* batch 2 sealed: now */
    CHECK_EQ(nrec, 6);
    CHECK_EQ(batch_poll(&bs, 1, 7, 10, 500, 450), 0);
    CHECK_EQ(nrec, 6);
    push(&bs, 9, 501);
    CHECK_EQ(nrec, 7);
    CHECK_EQ(recs[6].seq, 3);
    CHECK_EQ(recs[6].nevents, 1);
    batch_cleanup(&bs);
}

TEST(late_rank_gets_the_sealed_batch_at_once)
{
    batch_state_t bs;
    init(&bs, 3);
    for (int k = 0; k < 4; k++) {
        CHECK_EQ(batch_poll(&bs, 0, 100 + k, 2, 1000, 0), 0);
        push(&bs, 2 * k + 1, 0);
        push(&bs, 2 * k + 2, 0);
    }
    CHECK_EQ(nrec, 4);
    CHECK_EQ(nbatches_held(&bs), 4);
    /* rank 2 now reads batches 0..3 without waiting, identical contents */
    for (int k = 0; k < 4; k++) {
        int before = nrec;
        CHECK_EQ(batch_poll(&bs, 2, 200 + k, 99, 1000, 0), 0);
        CHECK_EQ(nrec, before + 1);
        const rec_t *a = &recs[k], *b = &recs[nrec - 1];
        CHECK_EQ(b->rank, 2);
        CHECK_EQ(b->req_id, 200 + k);
        CHECK_EQ(b->seq, a->seq);
        CHECK_EQ(b->nevents, a->nevents);
        CHECK(same_events(a, b));
        CHECK(!bs.wait[2].active);
    }
    /* rank 1 has read nothing yet: everything is still held */
    CHECK_EQ(nbatches_held(&bs), 4);
    for (int k = 0; k < 4; k++) {
        CHECK_EQ(batch_poll(&bs, 1, 300 + k, 99, 1000, 0), 0);
        /* each read by the last reader frees exactly that batch */
        CHECK_EQ(nbatches_held(&bs), 3 - k);
        if (k < 3)
            CHECK_EQ(first_held(&bs)->seq, (uint64_t)k + 1);
    }
    CHECK(none_held(&bs));
    /* and the list works again after being emptied */
    CHECK_EQ(batch_poll(&bs, 0, 1, 0, 1000, 0), 0);
    CHECK_EQ(nbatches_held(&bs), 1);
    CHECK_EQ(first_held(&bs)->seq, 4);
    CHECK(bs.sealed.next == bs.sealed.prev); /* the only one */
    batch_cleanup(&bs);
}

TEST(leave_drops_waiter_and_unblocks_trimming)
{
    batch_state_t bs;
    init(&bs, 3);
    /* rank 2 never reads: batches pile up */
    for (int k = 0; k < 5; k++) {
        CHECK_EQ(batch_poll(&bs, 0, k, 0, 1000, 0), 0);
        CHECK_EQ(batch_poll(&bs, 1, k, 0, 1000, 0), 0);
    }
    CHECK_EQ(nbatches_held(&bs), 5);
    batch_rank_leave(&bs, 2);
    CHECK_EQ(nbatches_held(&bs), 0);
    CHECK(none_held(&bs));

    /* a waiting rank that leaves is not answered */
    CHECK_EQ(batch_poll(&bs, 1, 50, 1, 1000, 0), 0);
    CHECK(bs.wait[1].active);
    batch_rank_leave(&bs, 1);
    CHECK(!bs.wait[1].active);
    CHECK_EQ(batch_next_deadline(&bs), UINT64_MAX);
    int before = nrec;
    push(&bs, 1, 0);
    batch_tick(&bs, 5000);
    CHECK_EQ(nrec, before); /* nobody is waiting: nothing sealed */
    CHECK_EQ(bs.next_seq, 5);
    CHECK_EQ(batch_poll(&bs, 0, 51, 1, 1000, 0), 0);
    CHECK_EQ(nrec, before + 1);
    CHECK_EQ(recs[nrec - 1].rank, 0);
    CHECK_EQ(recs[nrec - 1].nevents, 1);
    /* with every other rank gone, a batch is freed as rank 0 reads it */
    CHECK_EQ(nbatches_held(&bs), 0);
    batch_cleanup(&bs);
}

TEST(join_starts_at_next_seq)
{
    batch_state_t bs;
    CHECK_EQ(batch_init(&bs, 3, on_deliver, recs), 0);
    nrec = 0;
    batch_rank_join(&bs, 0);
    batch_rank_join(&bs, 1);
    for (int k = 0; k < 3; k++)
        CHECK_EQ(batch_poll(&bs, 0, k, 0, 1000, 0), 0);
    CHECK_EQ(bs.next_seq, 3);
    CHECK_EQ(nbatches_held(&bs), 3); /* rank 1 has not read them */
    /* the instance was never all here (rank 2 comes last, as ranks do to
     * a daemon that restarted): rank 2 reads from the first batch, as
     * ranks 0 and 1 did, so batch k is the same on every rank */
    CHECK(!bs.assembled);
    batch_rank_join(&bs, 2);
    CHECK(bs.assembled);
    CHECK_EQ(bs.cursor[2], 0);
    for (int k = 0; k < 3; k++)
        CHECK_EQ(batch_poll(&bs, 2, 10 + k, 0, 1000, 0), 0);
    CHECK_EQ(nrec, 6);
    CHECK_EQ(recs[5].rank, 2);
    CHECK_EQ(recs[5].seq, 2);
    CHECK_EQ(bs.next_seq, 3); /* read, not sealed again */
    /* rank 2's next poll waits for batch 3 */
    CHECK_EQ(batch_poll(&bs, 2, 77, 1, 1000, 0), 0);
    CHECK(bs.wait[2].active);
    push(&bs, 42, 0);
    CHECK_EQ(nrec, 7);
    CHECK_EQ(recs[6].rank, 2);
    CHECK_EQ(recs[6].seq, 3);
    CHECK_EQ(recs[6].ev[0].request_id, 42);
    /* the batches rank 1 has not read are still held for it */
    CHECK_EQ(nbatches_held(&bs), 4);
    for (int k = 0; k < 4; k++)
        CHECK_EQ(batch_poll(&bs, 1, k, 0, 1000, 0), 0);
    CHECK_EQ(recs[nrec - 1].seq, 3);
    /* rank 0 has not read batch 3 yet */
    CHECK_EQ(nbatches_held(&bs), 1);
    /* once all were here, a rejoin after a leave starts at next_seq */
    batch_rank_leave(&bs, 0);
    CHECK_EQ(nbatches_held(&bs), 0);
    batch_rank_join(&bs, 0);
    CHECK_EQ(bs.cursor[0], bs.next_seq);
    batch_cleanup(&bs);
}

/* A rank of another daemon away (its link lost) keeps its place: the
 * batches sealed meanwhile wait for it, and back it reads them in order;
 * a delivery that could not go out is read again at the next poll. */
TEST(away_rank_reads_what_it_missed)
{
    batch_state_t bs;
    CHECK_EQ(batch_init(&bs, 2, on_deliver, recs), 0);
    nrec = 0;
    batch_rank_join(&bs, 0);
    batch_rank_join(&bs, 1);
    CHECK_EQ(batch_poll(&bs, 1, 1, 1, 1000, 0), 0); /* waits */
    batch_rank_away(&bs, 1);
    CHECK(!bs.wait[1].active); /* its poll went with the link */
    CHECK(!batch_rank_here(&bs, 1));
    push(&bs, 7, 0);
    CHECK_EQ(batch_poll(&bs, 0, 2, 0, 1000, 0), 0); /* batch 0 */
    push(&bs, 8, 0);
    CHECK_EQ(batch_poll(&bs, 0, 3, 0, 1000, 0), 0); /* batch 1 */
    CHECK_EQ(nbatches_held(&bs), 2); /* kept for rank 1 */
    batch_rank_back(&bs, 1);
    CHECK(batch_rank_here(&bs, 1));
    /* the first delivery does not go out: the rank reads it again */
    fail_delivery = 1;
    CHECK_EQ(batch_poll(&bs, 1, 4, 0, 1000, 0), 0);
    CHECK_EQ(bs.cursor[1], 0);
    uint32_t n0 = nrec;
    CHECK_EQ(batch_poll(&bs, 1, 5, 0, 1000, 0), 0);
    CHECK_EQ(batch_poll(&bs, 1, 6, 0, 1000, 0), 0);
    CHECK_EQ(nrec, n0 + 2);
    CHECK_EQ(recs[n0].seq, 0);
    CHECK_EQ(recs[n0].ev[0].request_id, 7);
    CHECK_EQ(recs[n0 + 1].seq, 1);
    CHECK_EQ(recs[n0 + 1].ev[0].request_id, 8);
    CHECK_EQ(nbatches_held(&bs), 0);
    batch_cleanup(&bs);
}

/* A rank of another daemon: batches sent to it are kept until its next
 * poll says they arrived; one lost on the way (the link died with it in
 * flight) is read again, in order, and then let go. */
TEST(remote_rank_resume_reads_lost_batch_again)
{
    batch_state_t bs;
    CHECK_EQ(batch_init(&bs, 2, on_deliver, recs), 0);
    nrec = 0;
    batch_rank_join(&bs, 0);
    batch_rank_join(&bs, 1);
    /* its first poll: its daemon knows nothing yet (resume 0) */
    CHECK_EQ(batch_rank_resume(&bs, 1, 0), 0);
    CHECK_EQ(batch_poll(&bs, 1, 1, 1, 1000, 0), 0);
    push(&bs, 7, 0);                                   /* batch 0 */
    CHECK_EQ(nrec, 1);
    CHECK_EQ(recs[0].rank, 1);
    CHECK_EQ(recs[0].seq, 0);
    CHECK_EQ(batch_poll(&bs, 0, 2, 0, 1000, 0), 0);    /* rank 0 reads 0 */
    CHECK_EQ(nbatches_held(&bs), 1); /* kept: rank 1 has not said */
    /* rank 1's next poll says batch 0 arrived: it goes */
    CHECK_EQ(batch_rank_resume(&bs, 1, 1 + 1), 0);
    CHECK_EQ(nbatches_held(&bs), 0);
    CHECK_EQ(batch_poll(&bs, 1, 3, 1, 1000, 0), 0);
    push(&bs, 8, 0);                                   /* batch 1 */
    CHECK_EQ(recs[nrec - 1].seq, 1);
    CHECK_EQ(batch_poll(&bs, 0, 4, 0, 1000, 0), 0);    /* rank 0 reads 1 */
    push(&bs, 9, 0);
    CHECK_EQ(batch_poll(&bs, 0, 5, 0, 1000, 0), 0);    /* rank 0 reads 2 */
    CHECK_EQ(nbatches_held(&bs), 2); /* 1 and 2, for rank 1 */
    /* batch 1 was lost on the way: rank 1 still reads 1 next */
    CHECK_EQ(batch_rank_resume(&bs, 1, 1 + 1), 1);
    CHECK_EQ(bs.cursor[1], 1);
    uint32_t n0 = nrec;
    CHECK_EQ(batch_poll(&bs, 1, 6, 0, 1000, 0), 0);
    CHECK_EQ(nrec, n0 + 1);
    CHECK_EQ(recs[n0].seq, 1);
    CHECK_EQ(recs[n0].ev[0].request_id, 8);
    CHECK_EQ(batch_rank_resume(&bs, 1, 2 + 1), 0);
    CHECK_EQ(batch_poll(&bs, 1, 7, 0, 1000, 0), 0);
    CHECK_EQ(recs[n0 + 1].seq, 2);
    CHECK_EQ(recs[n0 + 1].ev[0].request_id, 9);
    CHECK_EQ(nbatches_held(&bs), 1); /* 2: until rank 1 says it has it */
    /* a claim of batches never sent is not believed */
    CHECK_EQ(batch_rank_resume(&bs, 1, 9 + 1), 0);
    CHECK_EQ(bs.cursor[1], 3);
    CHECK_EQ(nbatches_held(&bs), 1);
    /* leaving lets go of what was kept for it */
    batch_rank_leave(&bs, 1);
    CHECK_EQ(nbatches_held(&bs), 0);
    batch_cleanup(&bs);
}

/* A remote rank that joins again reads from its join on: a poll that
 * claims it reads a batch from before (a member still counting the
 * rank's old client) is not believed, though that batch is still kept
 * for a rank that has not read it. */
TEST(remote_rank_resume_not_before_join)
{
    batch_state_t bs;
    CHECK_EQ(batch_init(&bs, 3, on_deliver, recs), 0);
    nrec = 0;
    for (uint32_t r = 0; r < 3; r++)
        batch_rank_join(&bs, r);
    batch_rank_leave(&bs, 1);
    push(&bs, 10, 0);
    CHECK_EQ(batch_poll(&bs, 0, 1, 0, 1000, 0), 0);    /* batch 0 */
    CHECK_EQ(nbatches_held(&bs), 1);                   /* for rank 2 */
    batch_rank_join(&bs, 1);                           /* from batch 1 */
    CHECK_EQ(bs.joined_at[1], 1);
    CHECK_EQ(batch_rank_resume(&bs, 1, 0), 0);
    CHECK_EQ(batch_poll(&bs, 1, 2, 0, 1000, 0), 0);    /* batch 1, empty */
    CHECK_EQ(recs[nrec - 1].seq, 1);
    CHECK_EQ(batch_rank_resume(&bs, 1, 0 + 1), 0);     /* batch 0: no */
    CHECK_EQ(bs.cursor[1], 2);
    CHECK_EQ(batch_rank_resume(&bs, 1, 1 + 1), 1);     /* batch 1: again */
    CHECK_EQ(bs.cursor[1], 1);
    batch_cleanup(&bs);
}

TEST(second_poll_while_waiting_is_busy)
{
    batch_state_t bs;
    init(&bs, 2);
    CHECK_EQ(batch_poll(&bs, 0, 1, 2, 1000, 0), 0);
    CHECK_EQ(batch_poll(&bs, 0, 2, 0, 1000, 0), KVX_ERR_BUSY);
    CHECK_EQ(batch_poll(&bs, 0, 3, 1, 0, 2000), KVX_ERR_BUSY);
    /* the refused polls changed nothing: the first still waits as asked */
    CHECK_EQ(nrec, 0);
    CHECK(bs.wait[0].active);
    CHECK_EQ(bs.wait[0].req_id, 1);
    CHECK_EQ(bs.wait[0].at_least, 2);
    CHECK_EQ(bs.wait[0].deadline_ms, 1000);
    /* other ranks are not affected */
    CHECK_EQ(batch_poll(&bs, 1, 9, 5, 1000, 0), 0);
    push(&bs, 1, 0);
    push(&bs, 2, 0);
    CHECK_EQ(nrec, 2);
    CHECK(recs[0].req_id == 1 || recs[1].req_id == 1);
    /* after the answer a new poll is accepted */
    CHECK_EQ(batch_poll(&bs, 0, 4, 1, 1000, 0), 0);
    batch_cleanup(&bs);
}

TEST(flush_seals_for_waiters)
{
    batch_state_t bs;
    init(&bs, 3);
    /* nobody waiting: flush seals nothing */
    push(&bs, 1, 0);
    batch_flush(&bs);
    CHECK_EQ(bs.next_seq, 0);
    CHECK_EQ(nrec, 0);
    CHECK_EQ(batch_poll(&bs, 0, 5, 100, UINT64_MAX, 0), 0);
    CHECK_EQ(batch_poll(&bs, 2, 6, 100, UINT64_MAX, 0), 0);
    batch_flush(&bs);
    CHECK_EQ(nrec, 2);
    CHECK_EQ(recs[0].nevents, 1);
    CHECK_EQ(recs[1].nevents, 1);
    CHECK_EQ(bs.next_seq, 1);
    /* an empty flush still answers a waiter */
    CHECK_EQ(batch_poll(&bs, 0, 7, 100, UINT64_MAX, 0), 0);
    batch_flush(&bs);
    CHECK_EQ(nrec, 3);
    CHECK_EQ(recs[2].nevents, 0);
    CHECK_EQ(recs[2].seq, 1);
    batch_cleanup(&bs);
}

TEST(messages_and_aux_are_copied)
{
    batch_state_t bs;
    init(&bs, 1);
    char m[16] = "original";
    uint8_t aux[4] = {1, 2, 0, 4};
    CHECK_EQ(batch_push(&bs, 1, K(1),
                        &(batch_end_t){KVX_EVENT_ERROR, KVX_ERR_IO, m, NULL, 0},
                        0),
             0);
    strcpy(m, "changed");
    CHECK_EQ(batch_push(
                 &bs, 2, K(2),
                 &(batch_end_t){KVX_EVENT_COMPLETE, 0, NULL, aux, sizeof(aux)},
                 0),
             0);
    aux[0] = 9;
    /* a length without bytes, or bytes without a length: none */
    CHECK_EQ(batch_push(&bs, 3, K(3),
                        &(batch_end_t){KVX_EVENT_COMPLETE, 0, "", aux, 0}, 0),
             0);
    CHECK_EQ(batch_poll(&bs, 0, 1, 3, 10, 0), 0);
    CHECK_EQ(nrec, 1);
    CHECK(!strcmp(recs[0].ev[0].msg, "original"));
    CHECK(!strcmp(recs[0].ev[1].msg, "")); /* NULL becomes "" */
    CHECK_EQ(recs[0].ev[0].aux_len, 0);
    CHECK_EQ(recs[0].ev[1].aux_len, 4);
    CHECK(!memcmp(recs[0].ev[1].aux, "\x01\x02\x00\x04", 4)); /* copied */
    CHECK_EQ(recs[0].ev[2].aux_len, 0);
    CHECK_EQ(recs[0].ev[0].code, KVX_ERR_IO);
    CHECK_EQ(recs[0].ev[0].kind, KVX_EVENT_ERROR);
    batch_cleanup(&bs);
}

TEST(many_events_in_one_batch)
{
    /* the pending array grows past its first capacity */
    batch_state_t bs;
    init(&bs, 2);
    for (int i = 0; i < 60; i++)
        push(&bs, (uint64_t)i, 0);
    CHECK_EQ(batch_poll(&bs, 1, 1, 60, 10, 0), 0);
    CHECK_EQ(nrec, 1);
    CHECK_EQ(recs[0].nevents, 60);
    for (int i = 0; i < 60; i++)
        CHECK_EQ(recs[0].ev[i].request_id, (uint64_t)i);
    batch_cleanup(&bs); /* rank 0 never read it: cleanup frees it */
}

/* ---- a random schedule, every rule checked after every step ---- */

static uint64_t rng_state = 0x13198a2e03707344ull;

static uint32_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

#define NR 4
#define MAXSEQ 4096

/* First recorded contents of every sealed batch. */
static int seen[MAXSEQ];
static rec_t canon[MAXSEQ];

static void check_invariants(const batch_state_t *bs, uint64_t now,
                             int force_done)
{
    /* held batches are exactly [min cursor of present ranks, next_seq);
     * until every rank has been here at once, every batch */
    uint64_t low = bs->assembled ? bs->next_seq : 0;
    for (uint32_t r = 0; bs->assembled && r < bs->nranks; r++)
        if (bs->present[r] && bs->cursor[r] < low)
            low = bs->cursor[r];
    uint64_t want = low;
    const list_t *n = &bs->sealed;
    while (n->next != &bs->sealed) { /* by seq, and linked both ways */
        CHECK(n->next->prev == n);
        n = n->next;
        CHECK_EQ(BATCH(n)->seq, want);
        want++;
    }
    CHECK(bs->sealed.prev == n);
    CHECK_EQ(want, bs->next_seq);
    /* nobody is left waiting whose wait is already satisfied */
    for (uint32_t r = 0; r < bs->nranks; r++) {
        const struct batch_waiter *w = &bs->wait[r];
        if (!w->active)
            continue;
        CHECK(bs->present[r]);
        CHECK_EQ(bs->cursor[r], bs->next_seq); /* waits only for unsealed */
        CHECK(bs->npending < w->at_least);
        CHECK(now < w->deadline_ms);
        CHECK(!force_done);
    }
}

TEST_T(random_schedule_keeps_the_rules, 120)
{
    for (int round = 0; round < 30; round++) {
        batch_state_t bs;
        nrec = 0;
        memset(seen, 0, sizeof(seen));
        CHECK_EQ(batch_init(&bs, NR, on_deliver, recs), 0);
        uint64_t now = 1000, next_id = 1, next_req = 1;
        uint64_t expect_seq[NR]; /* the seq each rank reads next */
        uint64_t pushed_checked = 0; /* events matched so far, in order */
        int present[NR] = {0};
        for (uint32_t r = 0; r < NR; r++)
            if (r == 0 || rnd() % 2) {
                batch_rank_join(&bs, r);
                present[r] = 1;
                expect_seq[r] = bs.cursor[r];
            }
        for (int step = 0; step < 1500; step++) {
            int before = nrec, force = 0;
            uint64_t seq_before = bs.next_seq;
            uint32_t npend_before = bs.npending;
            uint32_t r = rnd() % NR;
            uint32_t op = rnd() % 100;
            uint64_t poll_req = 0;
            if (op < 40) {
                push(&bs, next_id++, now);
            } else if (op < 75) {
                if (!present[r])
                    continue;
                uint32_t at_least = rnd() % 5;
                uint64_t dl = now + rnd() % 30;
                int busy = bs.wait[r].active;
                poll_req = next_req++;
                int rc = batch_poll(&bs, r, poll_req, at_least, dl, now);
                CHECK_EQ(rc, busy ? KVX_ERR_BUSY : 0);
                if (busy)
                    CHECK_EQ(nrec, before);
                else if (expect_seq[r] < seq_before) {
                    /* its batch was sealed: answered now, to it alone */
                    CHECK_EQ(nrec, before + 1);
                    CHECK_EQ(recs[before].rank, r);
                    CHECK_EQ(recs[before].req_id, poll_req);
                    CHECK_EQ(bs.next_seq, seq_before);
                }
            } else if (op < 90) {
                now += rnd() % 12;
                batch_tick(&bs, now);
            } else if (op < 94) {
                if (present[r] && r != 0) {
                    batch_rank_leave(&bs, r);
                    present[r] = 0;
                }
            } else if (op < 98) {
                if (!present[r]) {
                    batch_rank_join(&bs, r);
                    present[r] = 1;
                    expect_seq[r] = bs.cursor[r];
                }
            } else {
                batch_flush(&bs);
                force = 1;
            }
            /* at most one batch sealed per step */
            CHECK(bs.next_seq - seq_before <= 1);
            if (bs.next_seq != seq_before) {
                /* a new batch takes everything pending */
                CHECK_EQ(bs.npending, 0);
                CHECK(nrec > before);
                CHECK_EQ(recs[before].nevents, npend_before + (op < 40));
            }
            for (int i = before; i < nrec; i++) {
                const rec_t *x = &recs[i];
                CHECK(present[x->rank]);
                CHECK_EQ(x->seq, expect_seq[x->rank]); /* in order */
                expect_seq[x->rank]++;
                CHECK(x->seq < MAXSEQ);
                if (!seen[x->seq]) {
                    /* first delivery of a batch: its events continue
                     * the pushed sequence with no gap or repeat */
                    seen[x->seq] = 1;
                    canon[x->seq] = *x;
                    for (uint32_t e = 0; e < x->nevents; e++)
                        CHECK_EQ(x->ev[e].request_id, ++pushed_checked);
                } else {
                    /* every rank sees the same batch k */
                    const rec_t *c = &canon[x->seq];
                    CHECK(same_events(x, c));
                }
            }
            check_invariants(&bs, now, force);
            /* the sealed batches plus pending are every pushed event */
            CHECK_EQ(pushed_checked + bs.npending, next_id - 1);
            if (nrec > MAXREC - 100)
                break;
        }
        /* the schedule really sealed and delivered */
        CHECK(bs.next_seq > 50);
        CHECK(pushed_checked > 200);
        batch_cleanup(&bs);
    }
}

/* A rank that never polls (one that fetched nothing, say) cannot make
 * the instance keep batches without end: past kept_max the oldest is
 * dropped; its next poll says LIMIT with what it missed, and the poll
 * after reads on from the oldest kept. */
TEST(batches_kept_bounded)
{
    batch_state_t bs;
    init(&bs, 2);
    bs.kept_max = 4;
    for (uint64_t k = 0; k < 7; k++) { /* rank 0 reads batches 0..6 */
        CHECK_EQ(batch_poll(&bs, 0, 10 + k, 1, 1000, 0), 0);
        push(&bs, k + 1, 1);
    }
    CHECK_EQ(nrec, 7);
    CHECK_EQ(batch_kept(&bs), 4); /* 3..6, for rank 1 */
    CHECK_EQ(first_held(&bs)->seq, 3);
    CHECK_EQ(batch_poll(&bs, 1, 99, 1, 1000, 0), KVX_ERR_LIMIT);
    CHECK_EQ(bs.missed_from, 0);
    CHECK_EQ(bs.missed_to, 2);
    CHECK_EQ(bs.cursor[1], 3);
    CHECK_EQ(batch_poll(&bs, 1, 100, 1, 1000, 0), 0); /* batch 3 */
    CHECK_EQ(nrec, 8);
    CHECK_EQ(recs[7].rank, 1);
    CHECK_EQ(recs[7].seq, 3);
    batch_cleanup(&bs);
}
