/*
 * http — the metrics endpoint: /metrics (Prometheus text) and /health
 * over HTTP at metrics.listen, served by libmicrohttpd on a thread of its
 * own. The loop publishes a snapshot (the text, the drain, the lag) every
 * metrics.publish_ms; the HTTP thread serves the latest and never reads
 * daemon state, and neither side holds the lock for more than a pointer
 * swap. Owns the MHD daemon, the timer and the snapshots.
 */
#ifndef KVX_HTTP_H
#define KVX_HTTP_H

#include "common/why.h"

/* Start the endpoint when metrics.listen is set (else nothing): 0, or
 * KVX_ERR_INVALID / KVX_ERR_IO with why (the address cannot be bound). */
int http_init(kvx_why_t *why);
/* Publish a snapshot now (the drain: /health answers 503 at once). */
void http_publish(void);
/* Stop the thread; the timer is closed with the loop's handles. */
void http_cleanup(void);

#endif
