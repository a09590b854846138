/*
 * rrq — an intrusive round-robin queue: the schedulers' lists of work
 * waiting for a turn (xfer.c: parts waiting for the copy engine; remote.c:
 * streams waiting for a slot). Push at the tail, pop at the head, remove
 * from anywhere in O(1); an entry knows whether it is queued. The queue
 * owns nothing: entries live in their owner's struct (rrq_entry_t), and
 * RRQ_OWNER() gets the owner back.
 *
 * Built on list.h. Queues and entries start zeroed (static, calloc), with
 * no init call: a queue sets up its list at its first push, and an entry
 * is queued exactly when its node is not zeroed (taken out, it is zeroed
 * again, so a copy of an entry not queued is not queued either).
 */
#ifndef KVX_RRQ_H
#define KVX_RRQ_H

#include <assert.h>

#include "common/list.h"

typedef struct rrq_entry {
    list_t node; /* on rrq_t.list; zeroed: not queued */
} rrq_entry_t;

typedef struct rrq {
    list_t list;       /* rrq_entry_t.node, oldest first */
    rrq_entry_t *head; /* the first entry, NULL when empty (callers test
                          it: while (q.head) ...) */
} rrq_t;

#define RRQ_OWNER(e, type, member) LIST_OWNER(e, type, member)

static inline int rrq_queued(const rrq_entry_t *e)
{
    return e->node.next != NULL;
}

/* Queue e at the tail (no-op when queued). */
static inline void rrq_push(rrq_t *q, rrq_entry_t *e)
{
    if (rrq_queued(e))
        return;
    if (!q->list.next)
        list_init(&q->list);
    list_push(&q->list, &e->node);
    if (!q->head)
        q->head = e;
    assert(q->head == LIST_OWNER(list_first(&q->list), rrq_entry_t, node));
}

/* Take e out (no-op when not queued). */
static inline void rrq_remove(rrq_t *q, rrq_entry_t *e)
{
    if (!rrq_queued(e))
        return;
    assert(q->head); /* e is on q */
    list_remove(&e->node);
    e->node = (list_t){NULL, NULL};
    list_t *first = list_first(&q->list);
    q->head = first ? LIST_OWNER(first, rrq_entry_t, node) : NULL;
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
