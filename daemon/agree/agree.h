/*
 * agree — completion batches of instances spread over daemons, sealed at
 * the daemon of rank 0; see agree.c. Sits above xfer and net: they call
 * it only through what agree_init() registers.
 */
#ifndef KVX_AGREE_H
#define KVX_AGREE_H

#include <stddef.h>
#include <stdint.h>

#include "xfer/instance.h"
#include "xfer/xfer.h"

/* Register with the layers below: instance hooks (batch delivery, an
 * instance's end), xfer's spread events, net's batch messages and
 * losses. Before any instance exists. */
int agree_init(void);
/* Member of a spread instance: batches kept for its ranks whose poll
 * failed before the root's answer came (status). */
uint32_t agree_kept(const instance_t *inst);
/* inst joined: the root counts every remote rank as present. */
void agree_joined(instance_t *inst);
/* A local rank of inst joined (again) or left: the root hears of it. */
void agree_rank(instance_t *inst, uint32_t rank, int joined);
/* Root: inst ends here (no rank of it is left on this daemon): the
 * polls other daemons' ranks have waiting in its batches fail now. */
void agree_instance_ends(instance_t *inst);
/* inst is freed. */
void agree_forget(instance_t *inst);
/* A terminal event of a request covering ev->ranks of the ev->expect
 * ranks it needs: merged at the root, forwarded there from a member.
 * ev->aux: a fetch's COMPLETE, its aux payload; the merged event carries
 * the first non-empty one. */
void agree_event(instance_t *inst, const xfer_event_t *ev);
/* Member: a local rank polls; the root answers. */
int agree_poll(instance_t *inst, uint32_t rank, uint64_t req_id,
               uint32_t at_least, uint32_t timeout_ms, kvx_why_t *why);
/* Root: a sealed batch for a rank served by another daemon; 0, or an
 * error when it could not be sent. */
int agree_deliver(instance_t *inst, uint32_t rank, uint64_t req_id,
                  const struct batch *b);
/* A poll reply r for a local rank of a spread instance (sid its session):
 * if its batch ends requests that still run here (an error merged from
 * another daemon goes out first), they are ended and the reply held until
 * they are fenced (agree_tick() sends it): 1. Else 0: send it now. */
struct Kvxfer__Reply;
int agree_fence_batch(instance_t *inst, uint64_t sid,
                      const struct Kvxfer__Reply *r);
/* Member: announcements and polls the root could not take yet, again;
 * a forwarded poll the root never answered fails POLL_LATE_MS after its
 * deadline. */
void agree_tick(uint64_t now_ms);
/* At exit. */
void agree_cleanup(void);

#endif /* KVX_AGREE_H */
