/*
 * reqrec — the record of one finished request (kvxferd's records ring
 * and records.file; kvxferctl requests --done), and its one JSON form,
 * shared by the daemon's file and kvxferctl --json so that both read
 * alike. Plain data: no allocation, no I/O.
 */
#ifndef KVX_REQREC_H
#define KVX_REQREC_H

#include <stddef.h>
#include <stdint.h>

#include "kvxfer.h"

#define REQREC_INSTANCE_MAX 128

typedef struct reqrec {
    char instance[REQREC_INSTANCE_MAX + 1]; /* the recording side's */
    const char *side; /* "generation" (a fetch) or "context" (an offer) */
    char context[REQREC_INSTANCE_MAX + 1];    /* the context instance */
    char generation[REQREC_INSTANCE_MAX + 1]; /* the generation instance;
                                                 "" when peer daemons read
                                                 the offer, or none did */
    uint8_t key[KVX_MAX_KEY];                 /* the recording side's key */
    uint32_t key_len;
    const char *path;          /* "host", "gpu" (GPU pools, one daemon), "peer";
                                  NULL: nothing moved (an offer nobody took) */
    uint64_t bytes;            /* landed in the destination blocks (a fetch), or
                                  read from the offer's (an offer) */
    uint64_t start_us, end_us; /* wall clock, microseconds since the epoch:
                                  the fetch arrived (the offer was made),
                                  its event went out */
    int outcome;               /* a kvx_event_kind_t */
    int code;                  /* 0 or a kvx_status_t */
    uint32_t uid;              /* the instance's owner (who may see it) */
} reqrec_t;

/* "complete", "error", "cancelled", "timed_out" */
const char *reqrec_outcome(int kind);
/* Bytes per second over [start, end] (0 for an empty span). */
uint64_t reqrec_bandwidth(const reqrec_t *r);
/* One JSON object, no newline, into buf (snprintf's contract: the
 * length it needs is returned; REQREC_JSON_MAX always suffices). */
#define REQREC_JSON_MAX 2048
int reqrec_json(const reqrec_t *r, char *buf, size_t len);

#endif /* KVX_REQREC_H */
