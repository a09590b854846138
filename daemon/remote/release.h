/*
 * release — a published request released by the generation side without
 * a transfer (Release): its offer ends, COMPLETE "released", on every
 * daemon of its context ranks, and their blocks are free at once instead
 * of after the lease.
 *
 * Here the offer's own daemon ends it through xfer_release(); the other
 * daemons of its context ranks are asked with PeerRelease and answer with
 * PeerReleased, and the client gets one reply when every daemon has
 * answered (or is lost, or has not answered within peer.connect_timeout_ms
 * + peer.keepalive_timeout_ms). Sits above xfer and net like remote: it
 * registers its messages and loss callback with net.
 *
 * Renew (2.6) travels the same way: the offer's lease is renewed on
 * every daemon of its context ranks (PeerRenew, PeerRenewed).
 *
 * Owns the releases and renewals waiting for other daemons' answers.
 */
#ifndef KVX_RELEASE_H
#define KVX_RELEASE_H

#include <stddef.h>
#include <stdint.h>

#include "common/why.h"

void release_init(void);
void release_cleanup(void);
void release_tick(uint64_t now_ms);

/* Release the request of params (packed ContextParams) for client
 * request req_id of session sid. 0 with *later set: answered later
 * (kvxd_reply, once the other daemons answered); 0: done, answer now;
 * else the error to answer now, with why. */
int release_start(const uint8_t *params, size_t len, uint64_t sid,
                  uint64_t req_id, int *later, kvx_why_t *why);
/* Renew the lease of the offer of params the same way (Renew:
 * xfer_renew() here, PeerRenew to the other daemons of its ranks; a
 * daemon before 2.6 fails its part with KVX_ERR_UNSUPPORTED). */
int renew_start(const uint8_t *params, size_t len, uint64_t sid,
                uint64_t req_id, int *later, kvx_why_t *why);

#endif
