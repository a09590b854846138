/* pace — a byte rate for one lane of copies (the host's copy workers, or
 * one GPU), as gpu.pace and copy.pace set it: when the next copy may
 * start. Pure arithmetic on the caller's clock; copy.c holds the jobs. */
#ifndef KVX_PACE_H
#define KVX_PACE_H

#include <stdint.h>

/* Up to this much of a lane's time may be spent at once after it was
 * idle: a burst of one millisecond of bytes starts together. */
#define PACE_BURST_NS 1000000ull

typedef struct pace {
    uint64_t per_ms; /* bytes a millisecond; 0: no pace */
    uint64_t t_ns;   /* the lane's clock: when its started bytes are paid */
} pace_t;

/* The pace of a lane that several paces bound (gpu.pace, the engines'
 * GpuPace): the lowest of a and b that is set (0: neither is). */
static inline uint64_t pace_lowest(uint64_t a, uint64_t b)
{
    return !a ? b : !b ? a : a < b ? a : b;
}

/* Nanoseconds from now until a copy may start on p (0: now). */
static inline uint64_t pace_wait(const pace_t *p, uint64_t now)
{
    return p->per_ms && p->t_ns > now ? p->t_ns - now : 0;
}

/* A copy of bytes starts on p at now: its time is paid from the lane's
 * clock, which never lags now by more than a burst (an idle lane does
 * not save up). */
static inline void pace_charge(pace_t *p, uint64_t now, uint64_t bytes)
{
    if (!p->per_ms)
        return;
    uint64_t base = now > PACE_BURST_NS ? now - PACE_BURST_NS : 0;
    if (p->t_ns > base)
        base = p->t_ns;
    /* bytes / (per_ms / 1e6 ns), in two parts so that no product
     * overflows (per_ms is at most 1 TiB, the keys' bound) */
    p->t_ns = base + bytes / p->per_ms * 1000000u +
              bytes % p->per_ms * 1000000u / p->per_ms;
}

/* The lane's pace becomes per_ms at now. The bytes it owes (started and
 * not yet paid at the old pace) are owed at the new one, so that a
 * faster pace lets the next copy go sooner, not after the old pace's
 * wait; off, it owes nothing, and a pace set again later starts idle. */
static inline void pace_set(pace_t *p, uint64_t now, uint64_t per_ms)
{
    if (per_ms == p->per_ms)
        return;
    if (!per_ms) {
        p->t_ns = 0;
    } else if (p->per_ms && p->t_ns > now) {
        /* (t_ns - now) * old can pass 2^64 (at the keys' bounds, 2^100):
         * in double, capped at 2^62 ns (146 years) */
        double owed =
            (double)(p->t_ns - now) * (double)p->per_ms / (double)per_ms;
        p->t_ns = now + (owed < 0x1p62 ? (uint64_t)owed : 1ull << 62);
    }
    p->per_ms = per_ms;
}

#endif /* KVX_PACE_H */
