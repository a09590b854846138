/*
 * stats — builds the Status reply from every module's counters. Owns only
 * the strings it allocates for one reply (freed by stats_free).
 */
#ifndef KVX_STATS_H
#define KVX_STATS_H

#include "kvxfer.pb-c.h"

/* Everything but the sessions (session.c adds its own). */
/* only_uid: the pools and instances of that uid's sessions alone (-1:
 * all); the daemon's counters are everyone's. At most cap pools and cap
 * instances are listed; pools_total and instances_total count them all. */
void stats_fill(Kvxfer__StatusReply *st, int64_t only_uid, uint32_t cap);
void stats_free(Kvxfer__StatusReply *st);

#endif
