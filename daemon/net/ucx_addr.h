/*
 * ucx_addr — a UCX worker address another daemon told (after
 * authentication): whether UCX can unpack it without reading past it or
 * asserting, what of it this worker's transports can read, and the
 * endpoint made to that. Part of ucx (ucx.h includes this); on the thread
 * of the worker named.
 */
#ifndef KVX_UCX_ADDR_H
#define KVX_UCX_ADDR_H

#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

#include "common/why.h"

/* An endpoint to the worker whose address is addr (len bytes): made to
 * what ucx_addr_fit() keeps of it; when it keeps none of w's transports,
 * UCS_ERR_UNREACHABLE, and when addr fails its walk,
 * UCS_ERR_INVALID_ADDR (logged, with why). */
ucs_status_t ucx_connect_addr(ucp_worker_h w, const uint8_t *addr, size_t len,
                              ucp_err_handler_cb_t err, void *arg,
                              ucp_ep_h *ep);
/* The most bytes of a worker address taken from another daemon. */
#define UCX_ADDR_MAX (16u * 1024)
/* Whether a..a+len is a worker address the loaded UCX's ucp_ep_create()
 * can unpack without reading past it or asserting (the formats of UCX
 * 1.12 to 1.22, as the loaded one reads them; non-unified mode): 0 and
 * *uuid (the worker's id; 0 if not told, when not NULL), or -1 with why
 * (what is wrong, and at which byte; a UCX older than 1.12 refuses all). */
int ucx_addr_check(const uint8_t *a, size_t len, uint64_t *uuid,
                   kvx_why_t *why);
/* What of the worker address a..a+len worker w can hand to ucp_ep_create()
 * without UCX or a transport reading outside it (ucx_addr.c says how): the
 * address less the transports that fail, into out (len bytes of room), its
 * length in *out_len, and how many of w's own transports it keeps (why
 * names the first one left out, or is ""); 0 (none of w's kept) or -1 (a
 * fails ucx_addr_check(), or w's own address cannot be read) with why. On
 * w's thread. */
int ucx_addr_fit(ucp_worker_h w, const uint8_t *a, size_t len, uint8_t *out,
                 size_t *out_len, kvx_why_t *why);

#endif
