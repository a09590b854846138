/*
 * peer — this daemon's link to other daemons: one UCP context and worker
 * driven by the libuv loop (ucp_worker_get_efd + uv_poll + ucp_worker_arm,
 * so nothing spins while idle), a sockaddr listener, one connection per
 * UCX endpoint with challenge-response authentication on the cluster
 * secret, the keep-alive, and the dispatch of active messages to the
 * transfer layer (remote.c).
 *
 * Two active messages: CTRL carries one packed PeerMsg as its data; DATA
 * carries a packed PeerMsg (PeerData) as its header and a piece of a
 * staging slot as its data, received straight into its place in the
 * receiver's slot (rendezvous for large pieces). DATA sends go out at most
 * peer.send_window at a time per connection, the rest queued in order;
 * control messages never wait behind them.
 *
 * Owns the UCP objects, the connections and every UCX request it starts.
 * A connection that fails (endpoint error, keep-alive, authentication)
 * is reported once through remote_on_conn_lost() and stays listed as
 * "lost" for status; it is freed when its UCX requests are all back. The
 * next peer_connect() to that address makes a new one.
 */
#ifndef KVX_PEER_H
#define KVX_PEER_H

#include <stddef.h>
#include <stdint.h>

#include "kvxfer.pb-c.h"

typedef struct peer_conn peer_conn_t;

/* Bring up UCX and the listener of conf.peer.listen, read the secret,
 * and write this daemon's address (kvx://IP:PORT/id) into kvxd.address.
 * Does nothing when peer.listen is empty. 0 or -1 with why. */
int peer_init(char *why, size_t why_len);
int peer_enabled(void);
/* Keep-alive and connect deadlines. */
void peer_tick(uint64_t now_ms);
/* At exit: close every connection; then, once nothing registered with
 * UCX is left (remote_cleanup), UCX itself. */
void peer_cleanup(void);
void peer_shutdown(void);

/* The outgoing connection to the daemon at address, made on first use
 * and reused while it lives. NULL with why when the address names no
 * peer listener or peers are off. */
peer_conn_t *peer_connect(const char *address, char *why, size_t why_len);
const char *peer_conn_address(const peer_conn_t *c);
/* Is address this daemon, or one a connection can be made to? 0, or
 * KVX_ERR_INVALID with why. */
int peer_address_check(const char *address, char *why, size_t why_len);
/* The capability token of a request of an instance spread over daemons:
 * every daemon of it derives the same one from the cluster secret. */
void peer_token(const char *instance, const char *addr0, uint64_t request,
                uint8_t out[16]);
int peer_conn_alive(const peer_conn_t *c);

/* Send a control message; queued until the connection is authenticated.
 * 0, or an error (the connection is lost). */
int peer_send(peer_conn_t *c, const Kvxfer__PeerMsg *m);
/* Send a piece of a slot: hdr (a PeerData) as the header, buf[0..len) as
 * the data; queued while peer.send_window sends are in flight. 0: then
 * done(arg, status) runs on the loop once buf may be reused (status 0 or
 * a kvx_status_t), always, also when the connection fails (it may run
 * before this returns). hdr is a DATA message (else KVX_ERR_INVALID).
 * An error: not sent, done never runs. */
int peer_send_data(peer_conn_t *c, const Kvxfer__PeerMsg *hdr,
                   const void *buf, size_t len,
                   void (*done)(void *arg, int status), void *arg);

/* Register and unregister memory UCX moves often (staging slots). */
void *peer_mem_map(void *addr, size_t len);
void peer_mem_unmap(void *memh);

/* For status. */
size_t peer_infos(Kvxfer__PeerInfo ***out);
void peer_free_infos(Kvxfer__PeerInfo **v, size_t n);
void peer_ucx_info(Kvxfer__UcxInfo *info); /* strings are static */

/* ---- implemented by the transfer layer (remote.c) ---------------------- */

/* A control message from an authenticated peer (m is freed after). */
void remote_on_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m);
/* peer.slots, with 0 resolved: as many slots as fit in 32 MiB, at
 * least 2. */
uint32_t remote_slots(void);
/* The largest piece a slot is sent in: peer.message_bytes, or more when a
 * slot would take over 64 pieces. */
uint64_t remote_message_bytes(void);
/* Where the data of d goes (len bytes): its place in a slot, or NULL to
 * drop it. */
void *remote_data_target(peer_conn_t *c, const Kvxfer__PeerData *d,
                         size_t len);
/* The data of d is in its slot (status 0) or will never be (error). */
void remote_on_data(peer_conn_t *c, const Kvxfer__PeerData *d, int status);
/* Where the slots' time went since start, for status. */
void remote_slot_times(Kvxfer__SlotTimes *received, Kvxfer__SlotTimes *sent);
/* Streams (either way) on c, for status. */
uint32_t remote_conn_streams(const peer_conn_t *c);
/* c failed: every transfer on it ends with code. 0, or KVX_ERR_NOMEM when
 * nothing could be done yet: peer.c calls it again at the next tick (c
 * stays until then). */
int remote_on_conn_lost(peer_conn_t *c, int code, const char *msg);

#endif /* KVX_PEER_H */
