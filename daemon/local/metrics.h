/*
 * metrics — the daemon's counters as Prometheus text (the HTTP /metrics
 * endpoint, http.c, and `kvxferctl metrics` over the socket), the loop's
 * lag, and the daemon's health. Owns the lag measurement and nothing
 * else: every figure is read from the module that counts it. Loop thread
 * only; the HTTP thread sees only what http.c publishes from here.
 */
#ifndef KVX_METRICS_H
#define KVX_METRICS_H

#include <stddef.h>
#include <stdint.h>

/* What counts the client connections (session_count(): session calls
 * this module, so it is registered, not called by name). */
void metrics_set_sessions(unsigned (*count)(void));
/* The loop's tick (main.c): measures how late it came. */
void metrics_tick(void);
/* The largest loop lag of the last second or so, in ns. */
uint64_t metrics_lag_ns(void);
/* Every metric family as Prometheus text (version 0.0.4): malloc'd,
 * NUL-terminated, *len bytes; NULL when out of memory. */
char *metrics_text(size_t *len);
/* 1 when healthy (the loop turns, no drain, lag within
 * metrics.health_max_lag_ms); else 0 and why says which. */
int metrics_healthy(char *why, size_t len);

#endif
