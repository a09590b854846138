/*
 * internal.h — libkvxfer calls for kvxfer's own tools (kvxferctl), not
 * part of the public API: they expose the protocol's generated types.
 */
#ifndef KVX_INTERNAL_H
#define KVX_INTERNAL_H

#include "kvxfer.h"
#include "kvxfer.pb-c.h"

/* The raw Status / ListRequests replies; free with
 * kvxfer__reply__free_unpacked(reply, NULL). */
int kvx__status_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms);
int kvx__requests_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms);
/* The finished requests' records (ListRequests.done): the newest max
 * (0: the daemon's page), oldest first, in reply->requests->done. */
int kvx__done_get(kvx_client_t *c, uint32_t max, Kvxfer__Reply **out,
                  int timeout_ms);
/* Cancel request key of instance_id as an admin (Cancel.instance_id,
 * no Hello): 0 once the daemon will never touch its blocks again. */
int kvx__cancel_admin(kvx_client_t *c, const char *instance_id,
                      const uint8_t *key, size_t key_len, int timeout_ms);
/* Drain the daemon (admins only): requests in flight may finish for
 * deadline_ms; with wait, the call returns once the drain is over (the
 * daemon then exits). msg gets the daemon's account of it. */
int kvx__drain(kvx_client_t *c, uint32_t deadline_ms, int wait, char *msg,
               size_t msg_len, int timeout_ms);
/* The daemon's metrics text and health (MetricsReply); free as above. */
int kvx__metrics_get(kvx_client_t *c, Kvxfer__Reply **out, int timeout_ms);

#endif
