/*
 * keyed — fetch by key: a generation rank names the context instance, the
 * daemon of its rank 0 and the context key, with no params in hand (as
 * SGLang's decode does with a bootstrap room). This module finds the
 * offer's params and hands the fetch to xfer as if the rank had sent
 * them.
 *
 * Generation side: the first rank's fetch makes a waiting fetch (its
 * ranks' blocks, pools referenced) and asks for the params: of the local
 * instance when rank 0 is served here, else of rank 0's daemon with
 * PeerResolve. Every rank's fetch that comes later joins it; once the
 * params are known each goes to xfer_fetch(). A fetch never resolved
 * ends by deadlines.fetch_timeout_ms, TIMED_OUT, naming the key; a refused
 * one (PERM, an offer taken by another fetch) at once, with that code; a
 * cancel of its key ends it CANCELLED.
 *
 * Context side: a resolve (a peer's PeerResolve, or a local waiting fetch)
 * is answered with the params once the offer exists (published or
 * reserved: xfer's offer-made callback, deferred to the loop), or with
 * NOT_FOUND when the asker's wait runs out. The instance's join says who
 * may fetch by key (instance_allows()).
 *
 * Owns the waiting fetches and the held resolves; sits above xfer and
 * net like release.c.
 */
#ifndef KVX_KEYED_H
#define KVX_KEYED_H

#include <stddef.h>
#include <stdint.h>

#include "common/reqkey.h"
#include "common/why.h"
#include "copy/pool.h"
#include "xfer/instance.h"
#include "xfer/xfer.h"

void keyed_init(void);
void keyed_cleanup(void);
void keyed_tick(uint64_t now_ms);

/* The context request a fetch or release by key names: its instance,
 * the daemon serving its rank 0, and its key. */
typedef struct keyed_source {
    const char *instance;
    const char *address;
    const reqkey_t *key;
} keyed_source_t;

/* Rank rq->rank of rq->inst fetches rq->key from src into rq's blocks of
 * its pool, and the offer's other groups into rq's groups (rq->params:
 * none; found here). 0: accepted (the rest comes as events), or the code
 * with why (nothing kept). */
int keyed_fetch(const xfer_fetch_req_t *rq, const keyed_source_t *src,
                kvx_why_t *why);

/* A Release by key: client request req_id of session sid (of uid; admin:
 * any uid's instance), for the context request src; consumer: the
 * session's generation instance, or NULL. */
typedef struct keyed_release_req {
    uint64_t sid, req_id;
    uint32_t uid;
    int admin;
    const char *consumer;
    keyed_source_t src;
} keyed_release_req_t;
/* Release by key (Release with no params), as rq says: the params are found
 * as for a fetch by key, without waiting, and handed to release_start().
 * Rank 0 on another daemon: only a generation rank's session may ask
 * (consumer: its instance, which the context instance must let fetch by
 * key); NULL: PERM. uids mean nothing across nodes.
 * 0 with *later set: answered later (kvxd_reply); else the code to
 * answer now, with why (0: done). */
int keyed_release(const keyed_release_req_t *rq, int *later, kvx_why_t *why);
/* A cancel of key in inst: 1 when a waiting fetch of it ended
 * (CANCELLED), else 0. */
int keyed_cancel(instance_t *inst, const reqkey_t *key);
/* inst's requests end (a rank left): its waiting fetches end too. */
void keyed_end_instance(const instance_t *inst, int code, const char *msg);
/* Waiting fetches that hold pool. */
uint32_t keyed_pool_users(const pool_t *pool);
/* pool is going: the waiting fetches that hold it end (ERROR code). */
void keyed_end_pool_users(const pool_t *pool, int code, const char *msg);

#endif
