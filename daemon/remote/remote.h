/*
 * remote — transfers between daemons (see remote.c's reading order): the
 * generation daemon pulls each slice of a part from the daemon serving
 * its source rank through staging slots; the context daemon serves those
 * pulls from its offers.
 *
 * Sits above xfer and net: it registers its message handlers, loss
 * callback and data path with net (peer_on_msg, peer_on_lost,
 * peer_set_data_ops) and its part of a request's life with xfer
 * (xfer_set_remote_ops), so neither calls it by name.
 *
 * Owns the slots, the streams and their copy jobs.
 */
#ifndef KVX_REMOTE_H
#define KVX_REMOTE_H

#include <stddef.h>
#include <stdint.h>

#include "common/why.h"
#include "kvxfer.pb-c.h"
#include "net/peer.h"
#include "xfer/xfer_remote.h"

/* Register with net and xfer; with peers on, allocate and register the
 * staging slots. 0, or KVX_ERR_NOMEM with why. */
int remote_init(kvx_why_t *why);
void remote_cleanup(void);
void remote_tick(uint64_t now_ms);

/* peer.slots, with 0 resolved: as many slots as fit in 32 MiB, at
 * least 2. */
uint32_t remote_slots(void);
/* The largest piece a slot is sent in: peer.message_bytes, or more when a
 * slot would take over 64 pieces. */
uint64_t remote_message_bytes(void);
/* For status: the staging part of info (slots, message bytes, where the
 * slots' time went). The slot times are static, valid until the next
 * call. */
void remote_ucx_info(Kvxfer__UcxInfo *info);

/* What remote registers (declared for the fuzzer, which drives them
 * without net). */
void remote_on_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m);
void *remote_data_target(peer_conn_t *c, const Kvxfer__PeerData *d, size_t len,
                         const peer_iov_t **iov, size_t *niov);
void remote_on_data(peer_conn_t *c, const Kvxfer__PeerData *d, int status);
int remote_on_conn_lost(peer_conn_t *c, int code, const char *msg);
uint32_t remote_conn_streams(const peer_conn_t *c);
int remote_part_start(genpart_t *p, const Kvxfer__ContextParams *cp,
                      kvx_why_t *why);
void remote_part_stop(genpart_t *p, int code, const char *msg);
void remote_part_free(struct rpart *rp);
void remote_offer_stop(offer_t *o, int code, const char *msg);
void remote_offer_published(offer_t *o);
void remote_offer_free(struct roffer *ro);

#endif /* KVX_REMOTE_H */
