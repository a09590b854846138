/*
 * ucx — the UCX calls peer.c (the loop's worker) and lane.c (the lanes'
 * workers) make alike: endpoints in peer error-handling mode to a worker
 * address (told by the other daemon after authentication; nothing here
 * listens for UCX connection requests; ucx_addr.h), and their forced
 * close. Owns nothing: each caller owns what it creates, and calls these
 * on the thread of that worker.
 */
#ifndef KVX_UCX_H
#define KVX_UCX_H

#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

#include "common/why.h"
#include "ucx_addr.h"

/* Force-closes ep: 1 when the close goes on and done(arg) comes later
 * (from the worker's progress), 0 when it is over now. */
int ucx_close(ucp_ep_h ep, ucp_send_nbx_callback_t done, void *arg);
/* 1 when libuct binds to the daemon's ucs_event_set_wait() (ucx.c: the
 * guard against UCX TCP's freed-endpoint bug); 0 when something else
 * (a preloaded library, a static link) came first and the guard is off */
int ucx_tcp_guard_bound(void);
/* The guard against UCX 1.12/1.13 aborting on a peer lost while an
 * endpoint wires up (ucx.c): 1 in effect (libucp binds to the daemon's
 * ucp_request_send_state_ff() and has the layout it knows), 0 not needed
 * (a UCX without the assertion), -1 needed but off (another build's
 * layout, or a preloaded library or a static link came first) */
int ucx_wireup_guard(void);
/* Wire-up messages the guard has let UCX free (peers lost while an
 * endpoint with them wired up) */
unsigned long long ucx_wireup_relabelled(void);

#endif
