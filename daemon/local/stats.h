/*
 * stats — builds the Status reply from every module's counters. Owns only
 * the strings it allocates for one reply (freed by stats_free).
 */
#ifndef KVX_STATS_H
#define KVX_STATS_H

#include "kvxfer.pb-c.h"

/* Everything but the sessions (session.c adds its own). */
void stats_fill(Kvxfer__StatusReply *st);
void stats_free(Kvxfer__StatusReply *st);

#endif
