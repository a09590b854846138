/*
 * daemon — the state every module of kvxferd shares: the loop, the live
 * configuration, the daemon's identity, counters. Owned by main.c; lives
 * from start to exit. Touched by the loop thread only.
 */
#ifndef KVX_DAEMON_H
#define KVX_DAEMON_H

#include <stdint.h>
#include <uv.h>

#include "conf.h"
#include "kvxfer.h"

typedef struct kvxd_stats {
    uint64_t bytes_moved;
    uint64_t transfers_done;
    uint64_t batches_sealed;
    uint64_t batches_resent;     /* root: to ranks of other daemons, after
                                    a poll said they never arrived */
    uint64_t errors_by_code[32]; /* index -code */
} kvxd_stats_t;

typedef struct kvxd {
    uv_loop_t *loop;
    kvx_conf_t conf;
    const char *config_path;  /* NULL: built-in defaults */
    char address[192];        /* this daemon's address, see kvxfer.h */
    uint64_t start_ms;
    int draining;
    kvxd_stats_t stats;
} kvxd_t;

extern kvxd_t kvxd;

/* Monotonic milliseconds. */
uint64_t kvxd_now_ms(void);
/* Count an error code in the status counters. */
void kvxd_count_error(int code);

#endif /* KVX_DAEMON_H */
