/*
 * map — a small open-hashing map from u64 keys to pointers, for pools,
 * sessions and requests. Owns only its table, never the values.
 */
#ifndef KVX_MAP_H
#define KVX_MAP_H

#include <stdint.h>
#include <stdlib.h>

#include "kvxfer.h"

typedef struct map_entry {
    uint64_t key;
    void *val;
    struct map_entry *next;
} map_entry_t;

typedef struct map {
    map_entry_t **b;
    uint32_t nb, n;
} map_t;

static inline uint32_t map_hash(uint64_t k, uint32_t nb)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (uint32_t)(k & (nb - 1));
}

static inline void *map_get(const map_t *m, uint64_t key)
{
    if (!m->nb)
        return NULL;
    for (map_entry_t *e = m->b[map_hash(key, m->nb)]; e; e = e->next)
        if (e->key == key)
            return e->val;
    return NULL;
}

/* Returns 0, or KVX_ERR_NOMEM. The key must not be present. */
static inline int map_put(map_t *m, uint64_t key, void *val)
{
    if (m->n + 1 > m->nb) {
        uint32_t nnb = m->nb ? m->nb * 2 : 16;
        map_entry_t **nbk = calloc(nnb, sizeof(*nbk));
        if (!nbk)
            return KVX_ERR_NOMEM;
        for (uint32_t i = 0; i < m->nb; i++)
            for (map_entry_t *e = m->b[i], *nx; e; e = nx) {
                nx = e->next;
                uint32_t h = map_hash(e->key, nnb);
                e->next = nbk[h];
                nbk[h] = e;
            }
        free(m->b);
        m->b = nbk;
        m->nb = nnb;
    }
    map_entry_t *e = malloc(sizeof(*e));
    if (!e)
        return KVX_ERR_NOMEM;
    uint32_t h = map_hash(key, m->nb);
    e->key = key;
    e->val = val;
    e->next = m->b[h];
    m->b[h] = e;
    m->n++;
    return 0;
}

static inline void *map_del(map_t *m, uint64_t key)
{
    if (!m->nb)
        return NULL;
    for (map_entry_t **p = &m->b[map_hash(key, m->nb)]; *p; p = &(*p)->next)
        if ((*p)->key == key) {
            map_entry_t *e = *p;
            void *v = e->val;
            *p = e->next;
            free(e);
            m->n--;
            return v;
        }
    return NULL;
}

/* Collect up to max values into out; returns how many. Lets callers
 * iterate while they delete. */
static inline uint32_t map_values(const map_t *m, void **out, uint32_t max)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < m->nb; i++)
        for (map_entry_t *e = m->b[i]; e && k < max; e = e->next)
            out[k++] = e->val;
    return k;
}

/* Collect up to max keys into out; returns how many. */
static inline uint32_t map_keys(const map_t *m, uint64_t *out, uint32_t max)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < m->nb; i++)
        for (map_entry_t *e = m->b[i]; e && k < max; e = e->next)
            out[k++] = e->key;
    return k;
}

static inline void map_free(map_t *m)
{
    for (uint32_t i = 0; i < m->nb; i++)
        for (map_entry_t *e = m->b[i], *nx; e; e = nx) {
            nx = e->next;
            free(e);
        }
    free(m->b);
    m->b = NULL;
    m->nb = m->n = 0;
}

#endif /* KVX_MAP_H */
