/* batch — sealed batches and lockstep polls; see batch.h. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "batch.h"
#include "kvxfer.h"

#define BATCH(n) LIST_OWNER(n, batch_t, node)

int batch_init(batch_state_t *bs, uint32_t nranks, batch_deliver_cb cb,
               void *arg)
{
    memset(bs, 0, sizeof(*bs));
    list_init(&bs->sealed);
    bs->nranks = nranks;
    bs->present = calloc(nranks, 1);
    bs->away = calloc(nranks, 1);
    bs->cursor = calloc(nranks, sizeof(*bs->cursor));
    bs->resume = calloc(nranks, sizeof(*bs->resume));
    bs->joined_at = calloc(nranks, sizeof(*bs->joined_at));
    bs->wait = calloc(nranks, sizeof(*bs->wait));
    bs->deliver = cb;
    bs->arg = arg;
    if (!bs->present || !bs->away || !bs->cursor || !bs->resume ||
        !bs->joined_at || !bs->wait) {
        batch_cleanup(bs);
        return KVX_ERR_NOMEM;
    }
    return 0;
}

static void events_free(batch_event_t *ev, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        free(ev[i].message);
        free(ev[i].aux);
    }
    free(ev);
}

void batch_cleanup(batch_state_t *bs)
{
    list_t *n;
    /* (a state zeroed, by an earlier cleanup, holds none) */
    while (bs->sealed.next && (n = list_pop(&bs->sealed))) {
        bs->nsealed--;
        events_free(BATCH(n)->events, BATCH(n)->nevents);
        free(BATCH(n));
    }
    events_free(bs->pending, bs->npending);
    free(bs->present);
    free(bs->away);
    free(bs->cursor);
    free(bs->resume);
    free(bs->joined_at);
    free(bs->wait);
    memset(bs, 0, sizeof(*bs));
}

static const batch_t *find(const batch_state_t *bs, uint64_t seq)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &bs->sealed)
    {
        if (BATCH(n)->seq == seq)
            return BATCH(n);
    }
    return NULL;
}

/* Drop batches every connected rank has read (a rank of another daemon
 * that says what it has: has). */
static void trim(batch_state_t *bs)
{
    uint64_t low = bs->assembled ? bs->next_seq : 0;
    for (uint32_t r = 0; bs->assembled && r < bs->nranks; r++) {
        uint64_t c = bs->resume[r] ? bs->resume[r] - 1 : bs->cursor[r];
        if (bs->present[r] && c < low)
            low = c;
    }
    list_t *n;
    while (
        (n = list_first(&bs->sealed)) &&
        (BATCH(n)->seq < low || (bs->kept_max && bs->nsealed > bs->kept_max))) {
        list_remove(n);
        assert(bs->nsealed > 0);
        bs->nsealed--;
        events_free(BATCH(n)->events, BATCH(n)->nevents);
        free(BATCH(n));
    }
}

static void deliver(batch_state_t *bs, uint32_t rank, uint64_t req_id,
                    const batch_t *b)
{
    bs->cursor[rank] = b->seq + 1;
    if (bs->deliver(bs->arg, rank, req_id, b))
        bs->cursor[rank] = b->seq; /* not out: read it again */
}

static int seal(batch_state_t *bs)
{
    batch_t *b = calloc(1, sizeof(*b));
    if (!b)
        return KVX_ERR_NOMEM;
    /* batches are numbered 0, 1, 2, ... with no gap: every rank reads
     * batch k as the same batch */
    assert(list_empty(&bs->sealed) ||
           BATCH(bs->sealed.prev)->seq + 1 == bs->next_seq);
    b->seq = bs->next_seq++;
    b->events = bs->pending;
    b->nevents = bs->npending;
    bs->pending = NULL;
    bs->npending = bs->cap_pending = 0;
    list_push(&bs->sealed, &b->node);
    bs->nsealed++;
    bs->sealed_total++;
    for (uint32_t r = 0; r < bs->nranks; r++) {
        struct batch_waiter *w = &bs->wait[r];
        if (w->active && bs->cursor[r] == b->seq) {
            w->active = 0;
            deliver(bs, r, w->req_id, b);
        }
    }
    trim(bs);
    return 0;
}

/* Seal the next batch if a rank waiting for it asks for it now. */
static void maybe_seal(batch_state_t *bs, uint64_t now_ms, int force)
{
    for (uint32_t r = 0; r < bs->nranks; r++) {
        struct batch_waiter *w = &bs->wait[r];
        if (!w->active || bs->cursor[r] != bs->next_seq)
            continue;
        if (force || bs->npending >= w->at_least || now_ms >= w->deadline_ms) {
            seal(bs);
            return;
        }
    }
}

void batch_rank_join(batch_state_t *bs, uint32_t rank)
{
    bs->present[rank] = 1;
    bs->away[rank] = 0;
    assert(bs->cursor[rank] <= bs->next_seq); /* no rank reads ahead */
    /* not yet assembled: from the first batch (trim() kept them) */
    list_t *first = list_first(&bs->sealed);
    uint64_t from = bs->assembled || !first ? bs->next_seq : BATCH(first)->seq;
    bs->cursor[rank] = from;
    bs->joined_at[rank] = from;
    bs->resume[rank] = 0;
    bs->wait[rank].active = 0;
    uint32_t here = 0;
    for (uint32_t r = 0; r < bs->nranks; r++)
        here += bs->present[r];
    if (here == bs->nranks && !bs->assembled) {
        bs->assembled = 1;
        trim(bs);
    }
}

void batch_rank_leave(batch_state_t *bs, uint32_t rank)
{
    bs->present[rank] = 0;
    bs->away[rank] = 0;
    bs->resume[rank] = 0;
    bs->wait[rank].active = 0;
    trim(bs);
}

void batch_rank_away(batch_state_t *bs, uint32_t rank)
{
    if (!bs->present[rank])
        return;
    bs->away[rank] = 1;
    bs->wait[rank].active = 0;
}

void batch_rank_back(batch_state_t *bs, uint32_t rank)
{
    bs->away[rank] = 0;
}

uint64_t batch_rank_resume(batch_state_t *bs, uint32_t rank, uint64_t resume)
{
    if (!bs->present[rank] || bs->wait[rank].active)
        return 0;
    if (!resume) /* nothing has arrived yet: it reads what it was first
                    sent (kept since its first poll) */
        resume = bs->resume[rank];
    uint64_t next = resume - 1, again = 0;
    if (resume && (next > bs->cursor[rank] || next < bs->joined_at[rank]))
        return 0; /* says it has batches never sent to it, or reads from
                     before it joined: not believed */
    if (resume && next < bs->cursor[rank] && find(bs, next)) {
        /* kept since (it said so before): read again, from there */
        again = bs->cursor[rank] - next;
        bs->cursor[rank] = next;
    }
    /* kept for it from here on, until its next poll says it has them
     * (batches it lost before it first said anything are gone) */
    bs->resume[rank] = bs->cursor[rank] + 1;
    trim(bs);
    return again;
}

int batch_rank_here(const batch_state_t *bs, uint32_t rank)
{
    return bs->present[rank] && !bs->away[rank];
}

int batch_push(batch_state_t *bs, uint64_t request_id, const reqkey_t *key,
               const batch_end_t *end, uint64_t now_ms)
{
    const char *message = end->msg;
    const uint8_t *aux = end->aux;
    uint32_t aux_len = end->aux_len;
    if (bs->npending == bs->cap_pending) {
        uint32_t ncap = bs->cap_pending ? bs->cap_pending * 2 : 16;
        batch_event_t *n = realloc(bs->pending, ncap * sizeof(*n));
        if (!n)
            return KVX_ERR_NOMEM;
        bs->pending = n;
        bs->cap_pending = ncap;
    }
    batch_event_t *e = &bs->pending[bs->npending];
    e->message = strdup(message ? message : "");
    if (!e->message)
        return KVX_ERR_NOMEM;
    e->aux = NULL;
    e->aux_len = 0;
    if (aux && aux_len) {
        if (!(e->aux = malloc(aux_len))) {
            free(e->message);
            return KVX_ERR_NOMEM;
        }
        memcpy(e->aux, aux, aux_len);
        e->aux_len = aux_len;
    }
    e->request_id = request_id;
    e->key = *key;
    e->kind = end->kind;
    e->code = end->code;
    bs->npending++;
    maybe_seal(bs, now_ms, 0);
    return 0;
}

int batch_poll(batch_state_t *bs, uint32_t rank, uint64_t req_id,
               uint32_t at_least, uint64_t deadline_ms, uint64_t now_ms)
{
    if (bs->wait[rank].active)
        return KVX_ERR_BUSY;
    /* batches it had not read were dropped (limits.batches_kept): it
     * hears so, and reads on from the oldest kept */
    list_t *first = list_first(&bs->sealed);
    uint64_t oldest = first ? BATCH(first)->seq : bs->next_seq;
    if (bs->cursor[rank] < oldest) {
        bs->missed_from = bs->cursor[rank];
        bs->missed_to = oldest - 1;
        bs->cursor[rank] = oldest;
        if (bs->resume[rank])
            bs->resume[rank] = oldest + 1;
        return KVX_ERR_LIMIT;
    }
    const batch_t *b = find(bs, bs->cursor[rank]);
    if (b) {
        deliver(bs, rank, req_id, b);
        trim(bs);
        return 0;
    }
    bs->wait[rank] = (struct batch_waiter){1, req_id, at_least, deadline_ms, 0};
    maybe_seal(bs, now_ms, 0);
    return 0;
}

void batch_waiter_early(batch_state_t *bs, uint32_t rank)
{
    if (rank < bs->nranks && bs->wait[rank].active)
        bs->wait[rank].early = 1;
}

uint32_t batch_wake_early(batch_state_t *bs)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < bs->nranks; r++) {
        struct batch_waiter *w = &bs->wait[r];
        if (!w->active || !w->early)
            continue;
        batch_t b = {.seq = bs->cursor[r], .early = 1};
        w->active = 0;
        if (bs->deliver(bs->arg, r, w->req_id, &b)) {
            w->active = 1; /* not out: the poll waits on for the batch */
            w->early = 0;
            continue;
        }
        n++;
    }
    return n;
}

int batch_take_waiter(batch_state_t *bs, uint32_t rank, uint64_t *req_id)
{
    if (rank >= bs->nranks || !bs->wait[rank].active)
        return 0;
    bs->wait[rank].active = 0;
    *req_id = bs->wait[rank].req_id;
    return 1;
}

void batch_tick(batch_state_t *bs, uint64_t now_ms)
{
    maybe_seal(bs, now_ms, 0);
}

void batch_flush(batch_state_t *bs) { maybe_seal(bs, 0, 1); }

uint64_t batch_next_deadline(const batch_state_t *bs)
{
    uint64_t d = UINT64_MAX;
    for (uint32_t r = 0; r < bs->nranks; r++)
        if (bs->wait[r].active && bs->wait[r].deadline_ms < d)
            d = bs->wait[r].deadline_ms;
    return d;
}

uint32_t batch_kept(const batch_state_t *bs)
{
    uint32_t n = 0;
    list_t *x, *t;
    LIST_FOREACH_SAFE(x, t, &bs->sealed)
    {
        n++;
    }
    return n;
}
