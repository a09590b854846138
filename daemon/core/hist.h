/*
 * hist — a fixed-bucket histogram for the daemon's metrics: counts per
 * upper bound, their sum and count, as Prometheus histograms are. Its
 * bounds are a static table the caller names at every call (one table
 * per family, local/metrics.c prints them). Loop thread only, as every
 * counter of kvxd_stats_t.
 */
#ifndef KVX_HIST_H
#define KVX_HIST_H

#include <stddef.h>
#include <stdint.h>

/* Buckets at most; the last counts what passes every bound (+Inf). */
#define HIST_MAX 24

typedef struct kvxd_hist {
    uint64_t b[HIST_MAX + 1]; /* b[i]: bound i-1 < v <= bound i */
    uint64_t count;
    double sum;
} kvxd_hist_t;

/* Count v in h, whose bounds are bounds[0, n) (ascending, n < HIST_MAX). */
static inline void hist_add(kvxd_hist_t *h, const double *bounds, size_t n,
                            double v)
{
    size_t i = 0;
    while (i < n && v > bounds[i])
        i++;
    h->b[i]++;
    h->count++;
    h->sum += v;
}

#endif /* KVX_HIST_H */
