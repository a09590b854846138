/*
 * xfer_remote — the calls between xfer and remote.c: what remote
 * reads of offers and fetch parts and the operations it asks of them
 * (daemon/xfer), and the hooks remote registers (xfer_remote_ops_t). The
 * request types are opaque here: their fields are daemon/xfer's alone
 * (xfer_int.h).
 * Nothing else includes this.
 *
 * remote.c moves the parts whose source is another daemon (or whose
 * instance spans daemons); xfer.c owns the requests' life either way:
 * creation, the fence, the terminal event.
 */
#ifndef KVX_XFER_REMOTE_H
#define KVX_XFER_REMOTE_H

#include <stdint.h>

#include "copy/gpu.h"
#include "copy/plan.h"
#include "copy/pool.h"
#include "instance.h"
#include "xfer.h"

#define TOKEN_LEN 16

/* The requests, whose fields are daemon/xfer's alone: remote.c names them
 * and goes through the calls below. */
typedef struct offer offer_t;     /* an offer (context side) */
typedef struct genpart genpart_t; /* one rank's part of a fetch */
/* What remote keeps of each (opaque here; see xfer_remote_ops_t). */
struct roffer;
struct rpart;

/* ---- xfer.c, for remote.c ---------------------------------------------- */

/* A side (parallel config and layout summary) to and from the wire; the
 * message points into s. from_msg validates (plan_side_check). */
void xfer_side_to_msg(const plan_side_t *s, Kvxfer__ParallelConfig *pc,
                      Kvxfer__Layout *lay);
int xfer_side_from_msg(const Kvxfer__ParallelConfig *pc,
                       const Kvxfer__Layout *l, plan_side_t *s, kvx_why_t *why);

/* -- offers peer daemons read (the context daemon, "S") --
 * Read through these; changed only by the calls below them. */

/* The offer of request_id in inst, or NULL. */
offer_t *xfer_offer_find(instance_t *inst, uint64_t request_id);
instance_t *xfer_offer_instance(const offer_t *o);
uint64_t xfer_offer_request(const offer_t *o);
const reqkey_t *xfer_offer_key(const offer_t *o);
/* Its capability token: TOKEN_LEN bytes. */
const uint8_t *xfer_offer_token(const offer_t *o);
/* Its side: the context instance's config and layout summary. */
const plan_side_t *xfer_offer_side(const offer_t *o);
/* Its block tables (Publish.groups: 1 for a plain request), and the side
 * of table group (the first is xfer_offer_side()). */
uint32_t xfer_offer_ngroups(const offer_t *o);
const plan_side_t *xfer_offer_group_side(const offer_t *o, uint32_t group);
/* Its aux payload (*len bytes; NULL, 0: none yet): the first non-empty
 * one a rank published. */
const uint8_t *xfer_offer_aux(const offer_t *o, uint32_t *len);
/* Its packed ContextParams (*len bytes), as publish returned them. */
const uint8_t *xfer_offer_params(const offer_t *o, size_t *len);
/* A peer daemon pulled bytes of o (its record: path peer). */
void xfer_offer_served(offer_t *o, uint64_t bytes);
/* Ending (its fence may still be pending); consumed (complete before
 * every local rank published: kept without memory for the late ones);
 * taken by a consumer on this daemon. */
int xfer_offer_ending(const offer_t *o);
int xfer_offer_consumed(const offer_t *o);
int xfer_offer_taken_here(const offer_t *o);
/* Was request_id (key) of instance inst an offer cancelled or released
 * lately (kept for deadlines.fetch_timeout_ms)? KVX_ERR_CANCELLED or
 * KVX_ERR_NOT_FOUND (released), else 0: a fetch that comes after the
 * cancel or release then ends so at once, as one that came before. */
int xfer_offer_gone(const char *inst, uint64_t request_id, const uint8_t *key,
                    size_t key_len);
/* The plan of rank dst_rank of a consumer whose side is dst reading
 * table group of o, skipping skip_tokens (plan_build()). */
int xfer_offer_plan(const offer_t *o, uint32_t group, const plan_side_t *dst,
                    uint32_t dst_rank, uint32_t skip_tokens, plan_t **out,
                    kvx_why_t *why);
/* The pool rank published table group of o into, with its blocks as a
 * plan's memory in *mem (when mem is not NULL); NULL before that rank's
 * publish. Read only under the offer's fence. */
pool_t *xfer_offer_source(const offer_t *o, uint32_t group, uint32_t rank,
                          plan_mem_t *mem);
/* Of rank's part of table group of o: the leading layers whose every
 * token is there (all of them once published whole; a layer-wise part's
 * come one by one), of *nlayers, the part's layers; 0 of 0 before that
 * rank's publish. A peer daemon reads a layer once it is ready. */
uint32_t xfer_offer_ready(const offer_t *o, uint32_t group, uint32_t rank,
                          uint32_t *nlayers);
/* What remote keeps of o (NULL until set), set once; xfer frees it with
 * o through xfer_remote_ops_t.offer_free. */
struct roffer *xfer_offer_remote(const offer_t *o);
void xfer_offer_set_remote(offer_t *o, struct roffer *ro);

/* The one way an offer ends (fence first; see xfer.c); a no-op for a
 * consumed one. */
void xfer_offer_end(offer_t *o, int kind, int code, const char *msg);
/* Streams from a peer took o (it leaves the lease list). */
void xfer_offer_taken(offer_t *o);
/* Every remote consumer of o is done (complete or not). */
void xfer_offer_remote_done(offer_t *o, int complete, int code,
                            const char *msg);

/* The offer's fence, counted here alone. Its memory is read by gathers
 * for peer daemons: each holds the fence (only while the offer runs)
 * until it is back. Once xfer_offer_fence_done() (ending or consumed, no
 * gather out), the releaser calls xfer_offer_fenced(), which may free
 * the offer. */
void xfer_offer_fence_hold(offer_t *o);
void xfer_offer_fence_release(offer_t *o);
int xfer_offer_fence_done(const offer_t *o);
void xfer_offer_fenced(offer_t *o);

/* -- parts pulled from peer daemons (the generation daemon, "D") -- */

/* A part whose sources are on other daemons, as it is named to them: its
 * request, the offer it reads (from the context params), and the side
 * that receives. Pointers valid while the part lives. */
typedef struct xfer_part_desc {
    instance_t *inst;         /* the generation instance */
    uint64_t request_id;      /* its request: its key's id */
    const reqkey_t *key;      /* and key */
    uint32_t dp_rank;         /* the attention-DP group receiving */
    uint32_t skip_tokens;     /* the prefix the fetch does not move */
    plan_side_t dst;          /* that group's side (pool's layout) */
    uint32_t dst_rank;        /* the part's rank in dst */
    /* the block table the part fills (Publish.groups), of ngroups; each
     * table's side and skip (gdst[group], gskip[group] are dst and
     * skip_tokens above) */
    uint32_t group, ngroups;
    plan_side_t gdst[XFER_MAX_GROUPS];
    uint32_t gskip[XFER_MAX_GROUPS];
    const char *src_instance; /* the context instance */
    uint64_t src_request;     /* its request: its key's id */
    const reqkey_t *src_key;  /* and key */
    const uint8_t *token;     /* the offer's capability: TOKEN_LEN bytes */
} xfer_part_desc_t;
void xfer_part_describe(const genpart_t *p, xfer_part_desc_t *d);
/* The part's destination pool, and its plan, built with the sources
 * unbound (they are packed in the staging slots); remote may bind them
 * as the slots need. */
pool_t *xfer_part_pool(const genpart_t *p);
plan_t *xfer_part_plan(const genpart_t *p);
/* The plan uploaded to the pool's GPU by xfer_part_upload(), or NULL. */
gpu_part_t *xfer_part_gpu(const genpart_t *p);
/* Upload the plan to device, with the pool as that device sees it, once
 * (a GPU pool: the scatter is a kernel). 0, or an error with why. */
int xfer_part_upload(genpart_t *p, int device, kvx_why_t *why);
/* What remote keeps of p (NULL until set), set once; xfer frees it with
 * p through xfer_remote_ops_t.part_free. */
struct rpart *xfer_part_remote(const genpart_t *p);
void xfer_part_set_remote(genpart_t *p, struct rpart *rp);
/* The code p's request ends with (0 while it runs, or complete). */
int xfer_part_end_code(const genpart_t *p);
/* A source daemon sent the offer's aux (len bytes, at most
 * limits.aux_bytes: the caller checked): p's request keeps the first
 * non-empty one for its COMPLETE event. 0, or KVX_ERR_LIMIT (the memory
 * budget) / KVX_ERR_NOMEM with why. */
int xfer_part_set_aux(genpart_t *p, const uint8_t *aux, uint32_t len,
                      kvx_why_t *why);

/* End p's request with an ERROR event (fence first; see xfer.c). */
void xfer_part_fail(genpart_t *p, int code, const char *msg);
/* The same by name: the fetch request_id of inst, if it runs and is not
 * ending already. */
void xfer_fetch_fail(instance_t *inst, uint64_t request_id, int code,
                     const char *msg);

/* The part's fence: its memory is written by scatters of pieces from
 * peer daemons; each holds the part's and its request's fence (only
 * while the request runs) until xfer_part_progress() reports it. */
void xfer_part_fence_hold(genpart_t *p);
/* Units [u0, u1) of part p are in its pool (a piece scattered or
 * received in place): FetchProgress counts them per layer. */
void xfer_part_landed(genpart_t *p, uint64_t u0, uint64_t u1);
/* Units of part p came back from a copy (status 0 or an error). */
void xfer_part_progress(genpart_t *p, uint64_t units, uint64_t bytes,
                        int status);

/* ---- registered by remote.c ------------------------------------------- */

/* What the layer above does for transfers between daemons (remote.c),
 * registered once at its init: xfer calls it through these alone. Each
 * may be NULL (no remote layer): then no part is remote. */
typedef struct xfer_remote_ops {
    /* start a part whose sources are on other daemons (or reached
     * through them): one stream per slice. 0, or an error with why */
    int (*part_start)(genpart_t *p, const Kvxfer__ContextParams *cp,
                      kvx_why_t *why);
    /* the request of p is ending: tell the sources, release what waits */
    void (*part_stop)(genpart_t *p, int code, const char *msg);
    /* a part is freed: what remote keeps for it (not NULL) goes */
    void (*part_free)(struct rpart *rp);
    /* offer o is ending: tell every stream reading it */
    void (*offer_stop)(offer_t *o, int code, const char *msg);
    /* a rank published to o, or made more of its layers ready: serve
     * the pulls that waited for them */
    void (*offer_published)(offer_t *o);
    /* an offer is freed: what remote keeps for it (not NULL) goes */
    void (*offer_free)(struct roffer *ro);
    /* who took o through a peer daemon ("request N of instance 'x'"),
     * or NULL */
    const char *(*offer_taker)(const offer_t *o);
    /* streams of peer daemons o waits for in all (0: none) and done */
    uint32_t (*offer_streams)(const offer_t *o, uint32_t *done);
} xfer_remote_ops_t;
void xfer_set_remote_ops(const xfer_remote_ops_t *ops);

#endif /* KVX_XFER_REMOTE_H */
