/*
 * ucx — the UCX calls peer.c (the loop's worker) and lane.c (the lanes'
 * workers) make alike: endpoints in peer error-handling mode (to an
 * address, or from a connection request), their forced close, and a
 * listener with the port it bound. Owns nothing: each caller owns what
 * it creates, and calls these on the thread of that worker.
 */
#ifndef KVX_UCX_H
#define KVX_UCX_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

/* An endpoint to ss (client-server, through ss's listener). */
ucs_status_t ucx_connect(ucp_worker_h w, const struct sockaddr_storage *ss,
                         ucp_err_handler_cb_t err, void *arg, ucp_ep_h *ep);
/* An endpoint from a listener's connection request. */
ucs_status_t ucx_accept(ucp_worker_h w, ucp_conn_request_h req,
                        ucp_err_handler_cb_t err, void *arg, ucp_ep_h *ep);
/* Force-closes ep: 1 when the close goes on and done(arg) comes later
 * (from the worker's progress), 0 when it is over now. */
int ucx_close(ucp_ep_h ep, ucp_send_nbx_callback_t done, void *arg);
/* A listener of w on ss, its bound port in *port. 0, or KVX_ERR_IO with
 * the UCX error in why. */
int ucx_listen(ucp_worker_h w, const struct sockaddr_storage *ss,
               ucp_listener_conn_callback_t cb, void *arg,
               ucp_listener_h *lis, struct sockaddr_storage *bound,
               char *why, size_t why_len);
/* The port of a bound address. */
uint16_t ucx_port(const struct sockaddr_storage *ss);

#endif
