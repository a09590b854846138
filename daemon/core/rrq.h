/*
 * rrq — an intrusive round-robin queue: the schedulers' lists of work
 * waiting for a turn (xfer.c: parts waiting for the copy engine; remote.c:
 * streams waiting for a slot). Push at the tail, pop at the head, remove
 * from anywhere in O(1); an entry knows whether it is queued. The queue
 * owns nothing: entries live in their owner's struct (rrq_entry_t), and
 * RRQ_OWNER() gets the owner back.
 */
#ifndef KVX_RRQ_H
#define KVX_RRQ_H

#include <stddef.h>

typedef struct rrq_entry {
    struct rrq_entry *prev, *next;
    int queued;
} rrq_entry_t;

typedef struct rrq {
    rrq_entry_t *head, *tail;
} rrq_t;

#define RRQ_OWNER(e, type, member)                                          \
    ((type *)((char *)(e) - offsetof(type, member)))

/* Queue e at the tail (no-op when queued). */
static inline void rrq_push(rrq_t *q, rrq_entry_t *e)
{
    if (e->queued)
        return;
    e->queued = 1;
    e->next = NULL;
    e->prev = q->tail;
    if (q->tail)
        q->tail->next = e;
    else
        q->head = e;
    q->tail = e;
}

/* Take e out (no-op when not queued). */
static inline void rrq_remove(rrq_t *q, rrq_entry_t *e)
{
    if (!e->queued)
        return;
    if (e->prev)
        e->prev->next = e->next;
    else
        q->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        q->tail = e->prev;
    e->prev = e->next = NULL;
    e->queued = 0;
}

/* The head, taken out; NULL when empty. */
static inline rrq_entry_t *rrq_pop(rrq_t *q)
{
    rrq_entry_t *e = q->head;
    if (e)
        rrq_remove(q, e);
    return e;
}

#endif /* KVX_RRQ_H */
