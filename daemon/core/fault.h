/*
 * fault — failures injected on purpose, for tests: the environment
 * variable KVXFERD_FAULT="SITE:N[,SITE:N...]" makes the Nth event at SITE
 * fail (that one only). Sites: gather (a copy job gathering into a send
 * slot for a peer daemon) and scatter (one scattering out of a receive
 * slot); a host job fails as a GPU kernel error would, with KVX_ERR_IO.
 * batch: a sealed batch the root daemon sends to a rank of another
 * daemon is lost on its way (it counts as sent, and never arrives).
 * lanes: in the Nth handshake this daemon tells its lanes' addresses,
 * they are those of a worker that is gone, where nothing answers (a
 * firewall that refuses the lanes).
 * lane_hold: the Nth DATA that comes to one of this daemon's lanes is
 * kept there and never answered (a lane whose TCP stalls).
 * conn_hold: the same for the Nth DATA sent by rendezvous on a
 * connection's own endpoint (no lanes), while its messages still flow.
 * own_addr: at start, this daemon's own worker address is checked one
 * byte short (as if the loaded UCX's format were one it cannot read).
 * loop_stall: the Nth MetricsRequest holds the loop for 3 s before it is
 * answered (a callback stuck: /health must say 503 while it lasts).
 * start_hold: at start, once its socket listens, the daemon waits N s
 * (signals do not cut it short) before it brings up the rest (a slow or
 * stuck UCX or CUDA start), the window in which a SIGTERM must still
 * drain it, and a second one end it.
 * down_hold: once the loop has stopped, the daemon waits N s (signals do
 * not cut it short) before it takes down the rest (a stuck UCX or CUDA
 * take-down), which a SIGTERM or TAKEDOWN_WAIT_S must still end.
 * Read once at start; the daemon warns in its log when any is set.
 */
#ifndef KVX_FAULT_H
#define KVX_FAULT_H

#include <stddef.h>

#include "common/why.h"

typedef enum {
    FAULT_GATHER,
    FAULT_SCATTER,
    FAULT_BATCH,
    FAULT_LANES,
    FAULT_LANE_HOLD,
    FAULT_CONN_HOLD,
    FAULT_OWN_ADDR,
    FAULT_LOOP_STALL,
    FAULT_START_HOLD,
    FAULT_DOWN_HOLD,
    FAULT_NSITES
} fault_site_t;

/* Parse $KVXFERD_FAULT. 0, or KVX_ERR_INVALID with why (a bad value names
 * itself). */
int fault_init(kvx_why_t *why);
/* Does this event at site fail? Thread-safe; 0 when nothing is set. */
int fault_hit(fault_site_t site);
/* Is a fault set at site at all? */
int fault_armed(fault_site_t site);
/* Its N (0: not set). */
unsigned long fault_value(fault_site_t site);

#endif /* KVX_FAULT_H */
