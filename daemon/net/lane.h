/*
 * lane — UCX workers on their own threads that carry slot data (DATA
 * messages) between daemons, so that the wire's copies (on TCP, the
 * kernel's send and receive copies, which run in the thread that
 * progresses the worker) run on more cores than the loop's one.
 *
 * peer.c owns the connections, their authentication and every decision;
 * a lane only runs UCX for it. Each lane has a worker (its address told
 * to peers after authentication; nothing listens for UCX connection
 * requests) and the endpoints it made to other daemons' lanes. Data that
 * comes in is known by its header alone: the endpoints UCX makes for
 * workers that send to a lane stay UCX's (it may destroy them on its
 * own), never used or closed here. The loop talks to a lane
 * by commands (a queue and an eventfd), and a lane answers by events (a queue
 * and a uv_async), handled on the loop by the callback given to lanes_start().
 * Endpoints are named by ids; cookies are the loop's, a lane only hands them
 * back.
 *
 * Owns: the lanes' threads, workers, their addresses, the endpoints they
 * made, the UCX
 * data descriptors of messages that arrived until the loop answers
 * (lane_recv() or lane_drop()).
 */
#ifndef KVX_LANE_H
#define KVX_LANE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <uv.h>

#include "common/why.h"

#include "common/list.h"

#define LANES_MAX 16

enum lane_ev_kind {
    LEV_SENT,     /* a lane_send() is done: cookie, status */
    LEV_RECEIVED, /* a lane_recv() is done: cookie, status */
    LEV_ARRIVED,  /* a message came (lep 0: from whom, only its header
                     says): hdr, and desc for a rendezvous (answer with
                     lane_recv() or lane_drop()); NULL: it came eagerly,
                     which lanes never send, and its data is gone */
    LEV_EP_ERROR, /* endpoint lep failed (the lane closes it) */
    LEV_CLOSED,   /* a lane_close() is done */
    LEV_INFO,     /* endpoint lep's first send is done: info holds what
                     ucp_ep_print_info() says of it (its lanes, and the
                     transports each uses) */
};

typedef struct lane_ev {
    enum lane_ev_kind kind;
    unsigned lane;
    uint64_t lep;
    int status; /* 0, or KVX_ERR_IO with the UCX status string
                   in msg */
    const char *msg;
    void *cookie;
    uint8_t *hdr; /* LEV_ARRIVED: the header, ours to free */
    size_t hlen;
    void *desc; /* LEV_ARRIVED, rendezvous */
    size_t len;
    void *from;  /* LEV_ARRIVED: the lane's, for lane_recv() */
    char *info;  /* LEV_INFO, ours to free */
    list_t node; /* on the event queue */
} lane_ev_t;

/* What lanes_start() starts. */
typedef struct lanes_conf {
    ucp_context_h ctx; /* the lanes' workers are of it */
    /* or, where ctxs[i] is not NULL, lane i's worker is of ctxs[i] (its
     * rail's: peer_rails.h); NULL: every lane of ctx */
    ucp_context_h const *ctxs;
    uv_loop_t *loop;   /* where ev runs */
    unsigned n;        /* how many lanes (0: none; at most LANES_MAX) */
    int spin;          /* a lane polls instead of sleeping while it has requests
                          in flight */
    /* called on the loop for every event; the event is freed after */
    void (*ev)(const lane_ev_t *e);
} lanes_conf_t;

/* Starts cf->n lanes. 0, or KVX_ERR_IO with why. */
int lanes_start(const lanes_conf_t *cf, kvx_why_t *why);
unsigned lanes_count(void);
/* Lane lane's worker address (*len bytes), valid until lanes_stop(). */
const uint8_t *lane_address(unsigned lane, size_t *len);
/* Runs the events that have come (a stopped loop's shutdown). */
void lanes_drain(void);
/* Every endpoint force-closed, the threads joined, the workers gone.
 * Events still coming are dropped (their cookies with them). */
void lanes_stop(void);

/* Commands, run by the lane in the order given. Out of memory for one
 * stops the daemon (abort()): a lost command would hang what waits on
 * it. */
/* An endpoint to the worker at addr (copied). */
void lane_connect(unsigned lane, const uint8_t *addr, size_t len,
                  uint64_t *lep);
/* A message lane_send() sends: hdr[0..hlen) as the header, and
 * data[0..len), or, when niov > 0, the niov places of iov (ucp_dt_iov_t,
 * adding up to len); cookie comes back with LEV_SENT. */
typedef struct lane_msg {
    const uint8_t *hdr;
    size_t hlen;
    const void *data;
    size_t len;
    const ucp_dt_iov_t *iov;
    size_t niov;
    void *cookie;
} lane_msg_t;
/* Sent by rendezvous always (the receiver's lane gets it straight into
 * place). m is read before this returns; hdr, data and iov stay the
 * caller's until LEV_SENT. */
void lane_send(unsigned lane, uint64_t lep, const lane_msg_t *m);
/* Receive the rendezvous data of arrived (its len bytes) into dst, or,
 * when niov > 0, into the niov places of iov (ucp_dt_iov_t, adding up
 * to len; the caller's until LEV_RECEIVED). group names whose it is
 * for lane_abort(). */
void lane_recv(unsigned lane, const lane_ev_t *arrived, uint64_t group,
               void *dst, const ucp_dt_iov_t *iov, size_t niov, void *cookie);
/* Receives of group still in flight end now, failed (LEV_RECEIVED with
 * an error): the endpoints they came on are force-closed. Receives of
 * another group on the same endpoint end too (a sender's endpoint is
 * one connection's). */
void lane_abort(unsigned lane, uint64_t group);
void lane_drop(unsigned lane, void *desc);
void lane_close(unsigned lane, uint64_t lep);

#endif
