/*
 * serve — may a peer daemon's OPEN read one of our offers? One call,
 * xfer_offer_serve(), takes the OPEN as it came and answers with a
 * verdict: serve it (with everything remote needs to make the stream:
 * the offer, the stream's plan, the receiving side, the aux) or refuse
 * it (the code, the message, and whether asking again can help). The
 * facts it decides on are the offer's; remote (remote.c) only carries
 * the verdict to the wire, so a peer OPEN walks remote -> xfer -> remote.
 */
#ifndef KVX_SERVE_H
#define KVX_SERVE_H

#include <stdint.h>

#include "common/why.h"
#include "xfer_remote.h"

/* Who serves an offer to peer daemons: what remote keeps of it (its
 * struct roffer, xfer_offer_remote()) begins with this, which
 * xfer_offer_serve() reads and fills; the rest is remote's. */
typedef struct xfer_served {
    uint32_t streams_expect; /* streams that will come in all */
    uint32_t streams_opened; /* accepted: at most streams_expect (remote
                                counts them) */
    uint32_t streams_done;   /* completed (remote counts them) */
    char rconsumer[256];     /* who: "request N of instance 'x'" */
    uint8_t *rread;          /* context ranks the consumer reads */
    char **consumer_addrs;   /* daemons whose streams it waits for */
    uint32_t nconsumer_addrs;
} xfer_served_t;

typedef struct xfer_serve_req {
    const Kvxfer__PeerOpen *open; /* the OPEN as it came */
    const char *peer;             /* the asking daemon, for the log */
    /* remote's fresh record (a struct roffer, beginning with this; NULL:
     * none, out of memory): made the offer's at its first OPEN served
     * this far (xfer_offer_set_remote()); then spare_used is set and
     * remote keeps it, else remote frees it */
    xfer_served_t *spare;
} xfer_serve_req_t;

typedef struct xfer_serve {
    /* 0: serve; else refuse with code and msg; final: asking again
     * cannot help (END.final) */
    int code, final;
    char msg[800];
    int spare_used; /* the offer keeps req->spare (even when refused) */
    /* to serve: */
    offer_t *offer;
    xfer_served_t *served;   /* the offer's record (the first OPEN counted
                                the streams and took the offer) */
    plan_t *plan;            /* the stream's plan: now the caller's */
    plan_side_t dst;         /* the receiving side */
    uint32_t src_rank;       /* the rank whose slice the stream reads */
    uint64_t u_begin, u_end; /* its units */
    int layerwise;           /* its source is a layer-wise part not yet whole */
    /* the offer's aux (aux_len bytes; NULL, 0: none yet), for OPENED */
    const uint8_t *aux;
    uint32_t aux_len;
} xfer_serve_t;

/* The verdict on OPEN req->open (*v, always filled); a forged token is
 * logged here. */
void xfer_offer_serve(const xfer_serve_req_t *req, xfer_serve_t *v);

/* Does a token from a peer equal an offer's (TOKEN_LEN bytes)? In
 * constant time. */
int xfer_token_equal(const ProtobufCBinaryData *t, const uint8_t *ours);

#endif /* KVX_SERVE_H */
