/*
 * ucx — the UCX calls peer.c (the loop's worker) and lane.c (the lanes'
 * workers) make alike: endpoints in peer error-handling mode to a worker
 * address (told by the other daemon after authentication; nothing here
 * listens for UCX connection requests), and their forced close. Owns
 * nothing: each caller owns what it creates, and calls these on the
 * thread of that worker.
 */
#ifndef KVX_UCX_H
#define KVX_UCX_H

#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

#include "common/why.h"

/* An endpoint to the worker whose address is addr, one that passed
 * ucx_addr_check(): made to what ucx_addr_fit() keeps of it; when it keeps
 * none of w's transports, UCS_ERR_UNREACHABLE (logged, with why). */
ucs_status_t ucx_connect_addr(ucp_worker_h w, const uint8_t *addr,
                              ucp_err_handler_cb_t err, void *arg,
                              ucp_ep_h *ep);
/* The most bytes of a worker address taken from another daemon. */
#define UCX_ADDR_MAX (16u * 1024)
/* Whether a..a+len is a worker address ucp_ep_create() can unpack
 * without reading past it or asserting (UCX 1.13's format, non-unified
 * mode): 0 and *uuid (the worker's id; 0 if not told, when not NULL),
 * or -1 with why (what is wrong, and at which byte). */
int ucx_addr_check(const uint8_t *a, size_t len, uint64_t *uuid,
                   kvx_why_t *why);
/* What of the worker address a..a+len worker w can hand to ucp_ep_create()
 * without UCX or a transport reading outside it (ucx.c says how): the
 * address less the transports that fail, into out (len bytes of room), its
 * length in *out_len, and how many of w's own transports it keeps (why
 * names the first one left out, or is ""); 0 (none of w's kept) or -1 (a
 * fails ucx_addr_check(), or w's own address cannot be read) with why. On
 * w's thread. */
int ucx_addr_fit(ucp_worker_h w, const uint8_t *a, size_t len, uint8_t *out,
                 size_t *out_len, kvx_why_t *why);
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
