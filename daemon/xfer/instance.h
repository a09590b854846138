/*
 * instance — model replicas known to this daemon: their parallel config,
 * which session serves each rank, the rank addresses from join, the
 * completion batches, and the requests (offers and fetches) they own.
 *
 * Owns instances. An instance is created by the first Hello that names
 * it and freed when its last rank leaves; a rank leaving ends every
 * request of the instance (the other ranks get an error batch).
 */
#ifndef KVX_INSTANCE_H
#define KVX_INSTANCE_H

#include <stdint.h>

#include "batch.h"
#include "common/list.h"
#include "common/why.h"
#include "copy/plan.h"
#include "core/map.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"

#define INSTANCE_ID_MAX 128
#define INSTANCE_CONSUMERS_MAX 4096 /* a join's consumers entries */

typedef struct instance {
    char id[INSTANCE_ID_MAX + 1];
    uint32_t owner_uid; /* its first rank's: no other uid joins it */
    kvx_role_t role;
    plan_side_t side;        /* parallel part; layout part per request */
    uint32_t nranks;
    uint64_t *rank_sid;      /* session id per rank, 0 = not connected */
    uint32_t nconnected;
    char **addresses;        /* from join, nranks entries */
    int joined;
    uint8_t *local;          /* rank served by this daemon */
    uint32_t nlocal;
    batch_state_t batches;
    uint64_t epoch;          /* random, nonzero: this incarnation of the
                                instance (PeerBatch.epoch) */
    map_t offers;            /* request_id -> offer (context side) */
    map_t fetches;           /* request_id -> genreq (generation side) */
    char *consumers;         /* join: the instances that may fetch by
                                key, one per line; NULL: the default */
    list_t node;             /* instance.c's; others walk instance_next() */
} instance_t;

/* What the agreement layer does for instances, registered at its init
 * (instance knows no layer above it). Any may be NULL. */
typedef struct instance_hooks {
    /* a sealed batch answers rank's waiting poll req_id */
    int (*deliver)(instance_t *inst, uint32_t rank, uint64_t req_id,
                   const batch_t *b);
    /* the last rank left and no request is left: inst is freed next */
    void (*ends)(instance_t *inst);
    /* inst is freed now (also at exit) */
    void (*forget)(instance_t *inst);
} instance_hooks_t;
void instance_set_hooks(const instance_hooks_t *h);

/* Is inst spread over daemons (joined, some ranks elsewhere, peers on)? */
int instance_spread(const instance_t *inst);

/* A Hello as instance_attach() takes it: session sid of uid says it is
 * rank `rank` (role) of instance id, whose parallel config is side's. */
typedef struct instance_hello {
    const char *id;
    uint32_t uid;
    kvx_role_t role;
    uint32_t rank;
    const plan_side_t *side;
    uint64_t sid;
} instance_hello_t;

/* Hello: attach session sid (of uid) as rank h->rank of instance
 * h->instance_id, creating it (owned by uid), or checking that uid owns
 * it (else KVX_ERR_PERM) and that the config matches. */
int instance_attach(const instance_hello_t *h, instance_t **out,
                    kvx_why_t *why);
/* The session of rank went away: the rank leaves the batches (1; 0 when
 * it was not attached); the
 * caller ends the instance's requests (xfer_end_instance). The instance
 * is freed by instance_tick() once no rank and no request is left. */
int instance_detach(instance_t *inst, uint32_t rank);
/* Join: every rank must send the same address list. The first sets
 * inst->joined. */
int instance_join(instance_t *inst, uint32_t rank, char *const *addresses,
                  size_t n, kvx_why_t *why);
/* Join's consumers (n of them; 0: the default): the first join sets
 * them, later joins must give the same (KVX_ERR_MISMATCH). An entry is
 * "INSTANCE" (that instance of the owner's uid) or "UID:INSTANCE". */
int instance_consumers(instance_t *inst, char *const *list, size_t n,
                       kvx_why_t *why);
/* May instance consumer, owned by consumer_uid (on this daemon or, as
 * its daemon says, on another), fetch or release inst's requests by key?
 * By default only instances of inst's owner uid may; a list names
 * (uid, instance) pairs, never a name alone. */
int instance_allows(const instance_t *inst, const char *consumer,
                    uint32_t consumer_uid);
/* 0 if publish/fetch may proceed (joined, every local rank connected). */
int instance_ready(const instance_t *inst, kvx_why_t *why);
instance_t *instance_find(const char *id);
/* Batch b as the protocol's events (pointing into b): *ev and *evp are
 * malloc'd, the caller frees both. 0 or KVX_ERR_NOMEM. */
int instance_batch_events(const batch_t *b, Kvxfer__Event **ev,
                          Kvxfer__Event ***evp);
/* The instances, newest first: instance_first(), then instance_next()
 * until NULL. */
instance_t *instance_first(void);
instance_t *instance_next(const instance_t *inst);
/* Deadlines of waiting polls; frees instances with no rank and no
 * request left (only here, so no caller holds a freed instance). */
void instance_tick(uint64_t now_ms);
/* Seal a batch for every waiting poll (drain). */
void instance_flush_all(void);
void instance_cleanup(void);

#endif /* KVX_INSTANCE_H */
