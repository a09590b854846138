/*
 * batch — completion agreement for one instance: terminal events are
 * collected in arrival order and sealed into numbered batches; batch k has
 * the same contents for every rank of the instance.
 *
 * Rules (docs/protocol.md):
 *  - each rank reads batches in order; its poll asks for its next batch k;
 *  - if k is sealed, the poll is answered at once;
 *  - otherwise the poll waits; batch k is sealed when the pending events
 *    reach the at_least of any rank waiting for k, or when any such wait
 *    reaches its deadline (then possibly empty);
 *  - a sealed batch is kept until every connected rank has read it, but
 *    at most kept_max of them (0: no bound): past that the oldest is
 *    dropped, and a rank that had not read it gets KVX_ERR_LIMIT at its
 *    next poll (then reads on from the oldest kept), so a rank that never
 *    polls cannot make an instance hold batches without end.
 * Owns the events and batches; delivers through the callback given at
 * init and never touches sessions itself.
 */
#ifndef KVX_BATCH_H
#define KVX_BATCH_H

#include <stdint.h>

#include "common/list.h"
#include "common/reqkey.h"

typedef struct batch_event {
    uint64_t request_id; /* its key's id */
    reqkey_t key;
    int kind;        /* KVX_EVENT_* */
    int code;        /* kvx_status_t */
    char *message;
    uint8_t *aux; /* COMPLETE of a fetch: its aux payload (NULL: none) */
    uint32_t aux_len;
} batch_event_t;

typedef struct batch {
    uint64_t seq;
    int early; /* not a batch: batch_wake_early()'s answer (no events) */
    uint32_t nevents;
    batch_event_t *events;
    list_t node; /* on batch_state_t.sealed */
} batch_t;

struct batch_waiter {
    int active;
    uint64_t req_id;
    uint32_t at_least;
    uint64_t deadline_ms;
    int early; /* Poll.early: batch_wake_early() may answer it */
};

/* Called for every waiting poll a sealed batch answers: 0, or an error
 * when it could not go out (the rank then reads the batch again at its
 * next poll). */
typedef int (*batch_deliver_cb)(void *arg, uint32_t rank, uint64_t req_id,
                                const batch_t *b);

typedef struct batch_state {
    uint32_t nranks;
    uint8_t *present;          /* rank connected */
    uint8_t *away;             /* present, but its daemon is unreachable:
                                  it keeps its place and its batches */
    uint64_t *cursor;          /* next seq each rank reads */
    uint64_t *joined_at;       /* the seq each rank read first */
    uint64_t *resume;          /* a rank of another daemon: 1 + the seq
                                  its daemon says it reads next (what it
                                  surely has); 0: not said, the cursor
                                  counts (batch_rank_resume()) */
    struct batch_waiter *wait;
    batch_event_t *pending;
    uint32_t npending, cap_pending;
    list_t sealed; /* batch_t.node, by seq: not yet read by all */
    uint32_t nsealed;                /* on sealed */
    uint32_t kept_max;               /* limits.batches_kept; 0: no bound */
    uint64_t missed_from, missed_to; /* the last KVX_ERR_LIMIT poll's */
    uint64_t next_seq;
    /* every rank has been here at once. Till then every batch is kept
     * (limits.batches_kept aside) and a rank that joins reads from the
     * first one, as those here did: ranks that come one by one (to a
     * daemon that restarted, or at start) read batch k alike */
    int assembled;
    uint64_t sealed_total;
    batch_deliver_cb deliver;
    void *arg;
} batch_state_t;

int batch_init(batch_state_t *bs, uint32_t nranks, batch_deliver_cb cb,
               void *arg);
void batch_cleanup(batch_state_t *bs);

/* A rank connects (reads from the next batch on) or leaves (its waiting
 * poll is dropped and it no longer holds batches). */
void batch_rank_join(batch_state_t *bs, uint32_t rank);
void batch_rank_leave(batch_state_t *bs, uint32_t rank);
/* A rank of another daemon that cannot be reached (a lost link): its
 * waiting poll is dropped, but it keeps reading from where it was, so it
 * misses no batch when back (batch_rank_back()); leave it to forget. */
void batch_rank_away(batch_state_t *bs, uint32_t rank);
void batch_rank_back(batch_state_t *bs, uint32_t rank);
/* A rank of another daemon says, on its poll, which batch it reads next
 * (resume: 1 + its seq; 0: nothing has arrived there since it joined). Batches sent to
 * it that never arrived (lost in a link that died with them in flight)
 * are read again. From its cursor on, batches are kept for it until a
 * later poll says it has them. Call with no poll of the rank waiting.
 * Returns how many batches it reads again. */
uint64_t batch_rank_resume(batch_state_t *bs, uint32_t rank, uint64_t resume);
/* Present and not away. */
int batch_rank_here(const batch_state_t *bs, uint32_t rank);

/* What a terminal event says, as it is pushed: its kind (KVX_EVENT_*),
 * code, message, and aux_len bytes of aux (NULL, 0: none). */
typedef struct batch_end {
    int kind;
    int code;
    const char *msg;
    const uint8_t *aux;
    uint32_t aux_len;
} batch_end_t;

/* Queue a terminal event (message and aux_len bytes of aux copied). */
int batch_push(batch_state_t *bs, uint64_t request_id, const reqkey_t *key,
               const batch_end_t *end, uint64_t now_ms);

/* Rank asks for its next batch. Delivers now or waits; returns
 * KVX_ERR_BUSY if this rank already has a poll waiting. */
/* Poll: 0 (answered, or waiting), KVX_ERR_BUSY (this rank has a poll
 * waiting), or KVX_ERR_LIMIT (batches this rank had not read were
 * dropped: bs->missed_from..bs->missed_to, inclusive; its cursor moves
 * past them, and the next poll reads on). */
int batch_poll(batch_state_t *bs, uint32_t rank, uint64_t req_id,
               uint32_t at_least, uint64_t deadline_ms, uint64_t now_ms);

/* Rank's waiting poll (if any) asked Poll.early. */
void batch_waiter_early(batch_state_t *bs, uint32_t rank);

/* A terminal event is near (a request's last copies are out): answer
 * each waiting poll that asked Poll.early with an empty batch_t whose
 * early is set and whose seq is the rank's next, sealing nothing and
 * moving no cursor; the rank polls again. A poll whose answer could not
 * go out keeps waiting for its batch. Returns how many were answered. */
uint32_t batch_wake_early(batch_state_t *bs);

/* Take rank's waiting poll away unanswered: 1 and its request id in
 * *req_id, or 0 when none waits (the instance ends before any batch
 * could answer it). */
int batch_take_waiter(batch_state_t *bs, uint32_t rank, uint64_t *req_id);

/* Seal what deadlines call for. */
void batch_tick(batch_state_t *bs, uint64_t now_ms);
/* Seal now for every waiting rank (drain). */
void batch_flush(batch_state_t *bs);
/* Earliest waiting deadline, or UINT64_MAX. */
uint64_t batch_next_deadline(const batch_state_t *bs);
/* Sealed batches kept: not yet read by every rank. */
uint32_t batch_kept(const batch_state_t *bs);

#endif /* KVX_BATCH_H */
