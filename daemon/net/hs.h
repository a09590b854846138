/*
 * hs — the socket daemons meet on: a plain TCP listener on the loop and
 * one framed TCP connection per handshake, so that nothing a stranger
 * sends reaches UCX. peer.c runs the challenge-response over it and
 * exchanges the UCX worker addresses only once both daemons have proved
 * the cluster secret; then the socket closes and UCX carries the rest.
 *
 * A frame is a 4-byte big-endian length and that many bytes (one packed
 * PeerMsg). A frame over HS_FRAME_MAX, a read error or the other side
 * closing ends the socket with a reason; nothing is buffered beyond the
 * frame being read.
 *
 * Owns: the listener, every handshake socket and its buffers. A socket
 * calls its owner (peer.c's connection) back until hs_close(); after
 * that, never.
 */
#ifndef KVX_HS_H
#define KVX_HS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "common/why.h"

/* Largest handshake frame: a PeerMsg with UCX worker addresses (a few
 * hundred bytes each on TCP and shared memory; more with RDMA devices). */
#define HS_FRAME_MAX (64u * 1024)

typedef struct hs hs_t;

typedef struct hs_cbs {
    /* one frame (buf is the socket's until this returns) */
    void (*frame)(void *arg, const uint8_t *buf, size_t len);
    /* the socket is over: the other side closed it, an error, or an
     * oversized frame; why names it. The owner calls hs_close() */
    void (*ended)(void *arg, const char *why);
} hs_cbs_t;

/* Listen on ss (port 0: any free one); *bound gets the address. Each
 * accepted socket goes to accept(hs); the owner sets its callbacks with
 * hs_attach(), or refuses it with hs_close(). 0, or KVX_ERR_IO with why. */
int hs_listen(const struct sockaddr_storage *ss, void (*accept)(hs_t *h),
              struct sockaddr_storage *bound, kvx_why_t *why);
void hs_stop(void);

/* Connect to ss; frames can be sent at once (they go once connected). A
 * failure to connect comes as ended(). NULL: out of memory. */
hs_t *hs_dial(const struct sockaddr_storage *ss, const hs_cbs_t *cbs,
              void *arg);
void hs_attach(hs_t *h, const hs_cbs_t *cbs, void *arg);
/* 1 once connected (an accepted socket is): a socket that ends before
 * is a dial that failed. */
int hs_connected(const hs_t *h);
/* Read what the other side has sent and the kernel holds now, without
 * waiting, and run each whole frame through frame() (an attached socket;
 * the loop reads the rest as usual). The socket may end in it. */
void hs_read_now(hs_t *h);
/* The other side's IP:PORT (for logs: of a dial, the one dialled), and
 * its address. */
const char *hs_peer_name(const hs_t *h);
int hs_peer_addr(const hs_t *h, struct sockaddr_storage *ss);

/* Send one frame (copied). 0, or KVX_ERR_NOMEM / KVX_ERR_INVALID (over
 * HS_FRAME_MAX). */
int hs_send(hs_t *h, const uint8_t *buf, size_t len);
/* No more callbacks; the socket closes once what was sent has gone out
 * (at most a second later), then its memory is freed. */
void hs_close(hs_t *h);

#endif
