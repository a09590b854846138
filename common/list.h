/*
 * list — one intrusive doubly linked list for every list in kvxfer, in
 * the manner of libuv's src/queue.h: a list_t head is a sentinel node,
 * an entry is a list_t inside its owner's struct, LIST_OWNER() gets the
 * owner back. Insert, remove and emptiness are O(1); the list owns
 * nothing. An entry not on a list points at itself (list_init), so
 * list_linked() tells whether it is queued. list_push() and list_pop()
 * make a FIFO; list_unshift() and list_pop() a stack.
 */
#ifndef KVX_LIST_H
#define KVX_LIST_H

#include <stddef.h>

typedef struct list {
    struct list *prev, *next;
} list_t;

#define LIST_OWNER(ptr, type, field)                                           \
    ((type *)((char *)(ptr)-offsetof(type, field)))

/* Every node of head, in order; n may be removed inside the loop. */
#define LIST_FOREACH_SAFE(n, tmp, head)                                        \
    for ((n) = (head)->next, (tmp) = (n)->next; (n) != (head);                 \
         (n) = (tmp), (tmp) = (n)->next)

static inline void list_init(list_t *l)
{
    l->prev = l->next = l;
}
static inline int list_empty(const list_t *head)
{
    return head->next == head;
}
static inline int list_linked(const list_t *n)
{
    return n->next != n;
}
static inline list_t *list_first(const list_t *head)
{
    return head->next == head ? NULL : head->next;
}

/* n at the tail of head. */
static inline void list_push(list_t *head, list_t *n)
{
    n->prev = head->prev;
    n->next = head;
    head->prev->next = n;
    head->prev = n;
}

/* n at the head of head: a stack (with list_pop), or newest first. */
static inline void list_unshift(list_t *head, list_t *n)
{
    n->next = head->next;
    n->prev = head;
    head->next->prev = n;
    head->next = n;
}

/* n off whatever list holds it (a no-op for an unlinked entry). */
static inline void list_remove(list_t *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    list_init(n);
}

/* The first node of head, taken off (unlinked); NULL when empty. */
static inline list_t *list_pop(list_t *head)
{
    list_t *n = list_first(head);
    if (n)
        list_remove(n);
    return n;
}

/* Every node of from at the tail of to; from ends empty. */
static inline void list_move_all(list_t *from, list_t *to)
{
    if (list_empty(from))
        return;
    from->next->prev = to->prev;
    to->prev->next = from->next;
    from->prev->next = to;
    to->prev = from->prev;
    list_init(from);
}

#endif /* KVX_LIST_H */
