/*
 * xfer — the life of every request: offers (context side), fetches
 * (generation side), their plans, the chunk scheduler that feeds the copy
 * engine, deadlines, cancel, and the terminal events.
 *
 * Owns offers and genreqs (indexed in their instance's maps), their block
 * tables, plans and copy jobs, and one pool reference per part. The rule
 * it enforces: a request's terminal event is queued, and a cancel is
 * answered, only after its last copy job has come back (the fence), so
 * the daemon never touches those blocks afterwards.
 */
#ifndef KVX_XFER_H
#define KVX_XFER_H

#include <stddef.h>
#include <stdint.h>

#include "common/reqkey.h"
#include "common/why.h"
#include "copy/pool.h"
#include "instance.h"
#include "kvxfer.pb-c.h"

/* The id of a request key: the first 8 bytes of its SHA-256, big-endian;
 * every daemon derives the same, and messages between daemons name
 * requests by it. */
uint64_t xfer_key_id(const uint8_t *b, size_t len);

/* One more block table of a request (hybrid models: Publish.groups,
 * Fetch.groups): a KV group in a pool of its own layout (sliding-window
 * layers), or a state slot (a pool of one-token blocks, num_tokens 1,
 * the slot as its one block). blocks[i] holds the group's block
 * first_block + i (the caller checked them against the pool). Its layers
 * and heads are the pool's, split over TP and PP as the KV's are. */
typedef struct xfer_group {
    pool_t *pool;
    const uint32_t *blocks;
    uint32_t nblocks;
    uint32_t num_tokens; /* publish */
    uint32_t first_block;
    uint32_t skip_tokens; /* fetch */
} xfer_group_t;

/* Groups of a request in all (the first is the plain block table). */
#define XFER_MAX_GROUPS 8

/* ---- requests as session builds them (one struct per call) ---------- */

/* A rank's Publish: offer blocks of pool for request key from rank, with
 * aux_len bytes of aux (0: none; the caller checked limits.aux_bytes),
 * and the ngroups other block tables of groups (every rank gives the
 * same); layerwise: no layer is ready yet (xfer_layers_ready()). */
typedef struct xfer_publish_req {
    instance_t *inst;
    uint32_t rank;
    const reqkey_t *key;
    pool_t *pool;
    const uint32_t *blocks;
    uint32_t nblocks;
    uint32_t num_tokens;
    const xfer_group_t *groups;
    uint32_t ngroups;
    const uint8_t *aux;
    uint32_t aux_len;
    int layerwise;
    uint32_t lease_ms; /* the offer's lease; 0: deadlines.offer_lease_ms */
} xfer_publish_req_t;

/* A rank's Fetch: fill blocks of pool for request key at rank from the
 * offer params (params_len bytes), skipping skip_tokens, for
 * attention-DP group dp_rank, and the destination of each of the
 * ngroups other tables of groups (in the offer's order). */
typedef struct xfer_fetch_req {
    instance_t *inst;
    uint32_t rank;
    const reqkey_t *key;
    const uint8_t *params;
    size_t params_len;
    pool_t *pool;
    const uint32_t *blocks;
    uint32_t nblocks;
    uint32_t skip_tokens;
    uint32_t dp_rank;
    const xfer_group_t *groups;
    uint32_t ngroups;
} xfer_fetch_req_t;

/* A Reserve: the instance's scheduler reserves the offer of key for
 * num_tokens, with layout (a local rank's pool's) and ngroups other
 * tables of groups (each's pool gives its layout; no blocks). */
typedef struct xfer_reserve_req {
    instance_t *inst;
    const reqkey_t *key;
    uint32_t num_tokens;
    const kvx_layout_t *layout;
    const xfer_group_t *groups;
    uint32_t ngroups;
    uint32_t lease_ms; /* as xfer_publish_req_t's */
} xfer_reserve_req_t;

/* A LayersReady (or a TokensReady: first 0, count all): layers [first,
 * first + count) of rank's part of table group of key's offer hold the
 * KV of tokens [0, tokens) (0: all of them), once the engine's event ev
 * (ev_len bytes; NULL: none) is reached; owner: the session that sent
 * it. */
typedef struct xfer_ready_req {
    instance_t *inst;
    uint32_t rank;
    const reqkey_t *key;
    uint32_t group;
    uint32_t first;
    uint32_t count;
    uint32_t tokens;
    const uint8_t *ev;
    size_t ev_len;
    uint64_t owner;
} xfer_ready_req_t;

/* Offer blocks of pool for request key from rank, with aux_len bytes of
 * aux (0: none; the caller checked limits.aux_bytes): the request keeps
 * the first non-empty aux, and refuses another rank's that differs
 * (KVX_ERR_MISMATCH); and the ngroups other block tables of groups (every
 * rank gives the same). On success *params is a malloc'd copy of the
 * packed ContextParams (the caller frees it). */
int xfer_publish(const xfer_publish_req_t *rq, uint8_t **params,
                 size_t *params_len, kvx_why_t *why);

/* Layer-wise offers (publish with layerwise: no layer ready yet): layers
 * [first, first + count) of rank's part of block table group (0: the
 * plain one; Publish.groups: the others) of key's offer hold the KV of
 * tokens [0, tokens) (0: all of them); owner: the session that sent ev
 * (its imports are kept for it, gpu_event_import);
 * with ev (a 64-byte cudaIpcEventHandle_t, GPU pools only) once the
 * event's record is reached (gpu_event_watch). Copies of ready layers
 * start at once. 0 without a change for an offer that completed
 * (consumed or released too): a mark after the end is no error; this and
 * xfer_append_blocks() answer NOT_FOUND only for a key never published
 * (or ended with an error, or forgotten), CANCELLED for a cancelled one. */
int xfer_layers_ready(const xfer_ready_req_t *rq, kvx_why_t *why);

/* The first entry of b[0, n) that repeats an earlier one in *at (n:
 * none); 0, or KVX_ERR_NOMEM. O(n) where the ids span at most 64 n,
 * else O(n log n); memory at most 8 n bytes either way. */
int xfer_blocks_repeat(const uint32_t *b, size_t n, size_t *at);

/* A chunked prefill: the next blocks of rank's part of key's layer-wise
 * offer (published from pool), after those given before; the tokens in
 * them become ready with xfer_layers_ready(tokens). */
int xfer_append_blocks(instance_t *inst, uint32_t rank, const reqkey_t *key,
                       const pool_t *pool, const uint32_t *blocks,
                       uint32_t nblocks, kvx_why_t *why);

/* The leading layers of rank's pool of block table group (0: the plain
 * one) that rank's fetch of key has landed (*done of *nlayers): 0, or 1
 * when the fetch is ending (its event is coming); NOT_FOUND / STATE /
 * INVALID (no such table) with why. */
int xfer_fetch_progress(instance_t *inst, uint32_t rank, const reqkey_t *key,
                        uint32_t group, uint32_t *done, uint32_t *nlayers,
                        kvx_why_t *why);

/* The instance's scheduler reserves the offer of key for num_tokens,
 * with layout l (a local rank's pool's: the params' layout summary) and
 * ngroups other tables (each's pool gives its layout summary; no
 * blocks); the ranks publish later, with the same groups.
 * *params as xfer_publish's. KVX_ERR_EXISTS when the key has an offer
 * already. */
int xfer_reserve(const xfer_reserve_req_t *rq, uint8_t **params,
                 size_t *params_len, kvx_why_t *why);

/* An offer was made (published first, or reserved): cb(inst, key) is
 * called from inside the call that made it, so it must only take note
 * (kvxd_defer) and act later. */
typedef void (*xfer_offer_made_cb)(instance_t *inst, const reqkey_t *key);
void xfer_set_offer_made(xfer_offer_made_cb cb);
/* The generation request that reads (or asks to read) an offer: one
 * consumer per offer, the same from every daemon it spans. */
typedef struct xfer_consumer {
    const char *inst;
    const uint8_t *key;
    size_t key_len;
} xfer_consumer_t;
/* who's name in messages and between daemons: "request K of instance
 * 'I'" (buf of at least 256 bytes; truncated past n). */
void xfer_consumer_name(const xfer_consumer_t *who, char *buf, size_t n);
/* xfer_params_for(): no offer of the key now; one may still come. */
#define XFER_NOT_YET 1
/* A copy of the params of the offer of key (malloc'd) for consumer who
 * (NULL: a release, which no consumer may have taken): 0; XFER_NOT_YET
 * (no such offer, or it ended: one may come); NOT_FOUND (released: none
 * will), CANCELLED, EXISTS (another consumer took it), with why. */
int xfer_params_for(instance_t *inst, const reqkey_t *key,
                    const xfer_consumer_t *who, uint8_t **params, size_t *len,
                    kvx_why_t *why);
/* Does a fetch of key run in inst? */
int xfer_fetch_runs(instance_t *inst, const reqkey_t *key);
/* A fetch of key that never became a request (fetch by key: no offer
 * found, refused) ends: its terminal event for the local ranks of
 * attention-DP group dp_rank. seen (nranks flags, or NULL): the ranks
 * that fetched it; the others' fetches join this end until the fetch
 * timeout (xfer_fetch_ended()), with no second event. */
void xfer_fetch_end_early(instance_t *inst, const reqkey_t *key,
                          uint32_t dp_rank, const batch_end_t *end,
                          const uint8_t *seen, uint64_t src);
/* What a fetch reads, as a number: context instance and key. */
uint64_t xfer_source_id(const char *inst, const uint8_t *key, size_t len);
/* Rank's fetch of key (of source src) joins a request that ended
 * already: 1 with *rc
 * (0, or EXISTS when this rank fetched it before) and why; 0 when there
 * is no such end. */
int xfer_fetch_ended(instance_t *inst, uint32_t rank, const reqkey_t *key,
                     uint64_t src, int *rc, kvx_why_t *why);
/* The fetch of key ends by until_ms at the latest (a fetch by key's
 * deadline runs from its first rank's call, not from its resolve). */
void xfer_fetch_deadline(instance_t *inst, const reqkey_t *key,
                         uint64_t until_ms);

/* Fill blocks of pool for request key at rank from the offer params
 * name, and the destination of each of its other groups (ngroups, in the
 * offer's order). */
int xfer_fetch(const xfer_fetch_req_t *rq, kvx_why_t *why);

/* Cancel request key of inst. Returns 0 when done (reply now), 1 when the
 * reply to (sid, req_id) is sent after the fence, or an error. */
int xfer_cancel(instance_t *inst, const reqkey_t *key, uint64_t sid,
                uint64_t req_id, kvx_why_t *why);

/* Release the offer of (instance_id, request_id: a key's id) on this
 * daemon, proved
 * by the params' token: it ends COMPLETE ("released") at once and frees
 * its blocks. 0, or KVX_ERR_NOT_FOUND (no such offer here: also one
 * released or complete already, a second release), KVX_ERR_AUTH
 * (another token), KVX_ERR_STATE (being fetched, or ending), with why. */
int xfer_release(const char *instance_id, const reqkey_t *key,
                 const uint8_t *token, size_t token_len, kvx_why_t *why);

/* Renew the lease of the offer of (instance_id, key) on this daemon,
 * proved by the params' token: its deadline becomes now + its lease, or
 * + lease_ms (the params', at most deadlines.offer_lease_max_ms) when
 * longer: the offers of a spread instance's other daemons, made by
 * publishes that named no lease, hold those daemons' defaults. 0 (also
 * for an offer being fetched: the fetch's timeout bounds it), or
 * KVX_ERR_NOT_FOUND (no such offer here, or it has ended), KVX_ERR_AUTH
 * (another token), with why. */
int xfer_renew(const char *instance_id, const reqkey_t *key,
               const uint8_t *token, size_t token_len, uint32_t lease_ms,
               kvx_why_t *why);

/* The lease a publish or reservation (op) asked, resolved: 0 is the
 * daemon's deadlines.offer_lease_ms; over deadlines.offer_lease_max_ms is
 * KVX_ERR_INVALID naming op.lease_ms. */
int xfer_lease_resolve(const char *op, uint32_t lease_ms, uint32_t *out,
                       kvx_why_t *why);

/* A request ended for ranks of an instance spread over daemons: its
 * root merges the reports (the agreement layer registers this; without
 * it every instance is treated as local). */
typedef struct xfer_event {
    uint64_t request_id; /* its key's id */
    const reqkey_t *key;
    int offer;      /* an offer's event (1) or a fetch's (0) */
    int kind, code; /* KVX_EVENT_*, kvx_status_t */
    const char *msg;
    uint32_t ranks;     /* the ranks of the instance it covers here */
    uint32_t expect;    /* all the ranks it needs */
    const uint8_t *aux; /* a fetch's COMPLETE: its aux payload, aux_len */
    uint32_t aux_len;   /* bytes (NULL/0: none) */
} xfer_event_t;
typedef void (*xfer_spread_event_cb)(instance_t *inst, const xfer_event_t *ev);
void xfer_set_spread_event(xfer_spread_event_cb cb);

/* End every request of inst with ERROR code. */
void xfer_end_instance(instance_t *inst, int code, const char *msg);

/* A terminal event of request_id, merged from another daemon, is about to
 * reach a rank here: end what of it still runs here (ERROR code; no-op if
 * it is ending already). 1 while some of it runs (its fence pending),
 * else 0. With msg NULL it only answers. */
int xfer_request_runs(instance_t *inst, uint64_t request_id, int code,
                      const char *msg);
/* Does the offer of request_id run here: made, and not yet complete
 * (ending ones still run)? */
int xfer_offer_runs(instance_t *inst, uint64_t request_id);
/* End every request (drain). */
void xfer_end_all(int code, const char *msg);
/* Pools of a session are going: end the requests that use them. */
void xfer_end_pool_users(const pool_t *pool, int code, const char *msg);
/* Does any request hold pool? */
uint32_t xfer_pool_users(const pool_t *pool);

/* Deadlines (lease, fetch timeout). */
void xfer_tick(uint64_t now_ms);
/* At start, before the first request: xfer's fixed tables are written
 * once, so that no page of them faults in on a request's end. */
void xfer_init(void);
/* Requests not yet finalized. */
uint32_t xfer_count(void);

/* For status/list: counts by state, and per-request infos. */
size_t xfer_states(Kvxfer__Count ***out);
/* One ListRequests page (xfer_list.c): at most max requests after the
 * cursor (after_inst NULL or "": from the first), in (instance id, side,
 * request id) order, side 0 context, 1 generation, of the instances
 * only_uid owns (-1: every instance); *more set when requests follow.
 * Returns how many are in *out (NULL on no memory). */
size_t xfer_infos_page(const char *after_inst, int after_side,
                       uint64_t after_id, uint32_t max, int64_t only_uid,
                       Kvxfer__RequestInfo ***out, int *more);
/* For the pages (xfer_list.c): the id of an offer (side 0) or fetch
 * (side 1) of an instance's maps, and its RequestInfo (malloc'd, freed
 * by xfer_free_infos; NULL on no memory). */
uint64_t xfer_request_id(const void *req, int side);
Kvxfer__RequestInfo *xfer_request_info(const instance_t *i, const void *req,
                                       int side, uint64_t now);
void xfer_free_counts(Kvxfer__Count **c, size_t n);
void xfer_free_infos(Kvxfer__RequestInfo **c, size_t n);

/* Decode and validate context params (exposed for fuzzing). */
int xfer_params_decode(const uint8_t *buf, size_t len,
                       Kvxfer__ContextParams **out, kvx_why_t *why);

#endif /* KVX_XFER_H */
