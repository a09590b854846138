/*
 * integration — the real kvxferd binary driven by real client processes
 * through libkvxfer (and by hand-built frames on raw sockets).
 *
 * Every test starts its own daemon: a temp dir /tmp/kvx-it-PID-N with a
 * config (socket.path inside it, plus the test's keys), the socket and the
 * daemon's log. The binary is $KVX_BUILD/kvxferd (tests/run.sh sets
 * KVX_BUILD; "build" when unset). When a test fails (or times out) the
 * tail of every daemon log it started is printed and the dir is kept.
 *
 * Engine ranks are forked processes with their own connection and host
 * pool; context params travel to generation ranks through shared memory.
 * Rank processes end with _exit(0); a failing CHECK in one raises a shared
 * flag so the others stop waiting.
 *
 * What is asserted can be wrong: destination bytes against a reference
 * pattern computed from (request, global layer, kv, global token, global
 * head, d) only, never through the daemon's plan (the whole destination
 * pool is compared, so stray writes show too); error codes and the
 * daemon's messages; event kinds and codes; batch contents across ranks;
 * the daemon's exit status, log, fds and mappings.
 *
 * One binary, one translation unit: test.h keeps its table of tests, and
 * main(), in each unit that includes it. So this file is only the table
 * of contents; it includes the rest, harness first, local tests before
 * the peer tests (which need root for their network namespaces, and fall
 * back to loopback without it):
 *
 *   harness.c          daemons, rank processes, the model and its pools,
 *                      the reference pattern, events, raw sockets
 *   fixtures.c         what tests of several files share: models, a pair
 *                      of ranks in this process, the multi-rank transfer
 *                      case, the guard-band case, running commands
 *   t_transfer.c       transfers through one daemon, every byte checked
 *   t_agree.c          batches the ranks of one instance agree on
 *   t_lifecycle.c      deadlines, cancels, clients killed or gone, drain,
 *                      what sessions leave behind
 *   t_release.c        requests released without a transfer
 *   t_protocol.c       bad frames and requests, refused input, limits
 *   t_regions.c        pools of regions: transfers, refused registrations
 *   t_ops.c            status, configuration, credentials, the socket
 *                      file, kvxferctl
 *   t_hostile.c        clients that attack: floods, readers that never
 *                      read, idle slot holders, a daemon out of fds
 *   t_keys.c           requests named by keys, reserve, fetch by key
 *   t_aux.c            the aux payload
 *   t_layers.c         layer-wise offers: layers ready, progress, faults
 *   t_groups.c         several block tables: a window and state slots
 *   t_api3.c           kvx_publish and kvx_fetch of 3.0: every form by
 *                      field_mask, batches whose items fail alone
 *   t_lease.c          per-offer leases, kvx_renew, reservations in one
 *                      round trip
 *   t_restart.c        the daemon killed under its engines: the requests
 *                      end once, the library reconnects, KV moves again
 *   t_pace.c           the GPU pace an engine sets: recorded, lowest,
 *                      lapsed, ended, set again after a restart
 *   peer_harness.c     two daemons in two network namespaces
 *   t_peer_transfer.c  transfers between daemons, forged input
 *   t_peer_lanes.c     lanes between daemons, stalled lanes
 *   t_peer_lost.c      a peer lost, drained or cancelled mid-transfer
 *   t_upgrade.c        a peer restarted, its earlier run's params, the
 *                      cluster secret rotated by reload
 *   t_peer_spread.c    an instance spread over both daemons
 *   t_peer_ops.c       peer configuration, status, idle CPU, the bench
 *   t_peer_hostile.c   garbage to every port a daemon opens
 *   t_access.c         who may reach a request's KV: the access table of
 *                      docs/protocol.md, cell by cell, and old attacks
 *   t_attack.c         the second round of attacks (issue 34 review),
 *                      each held now
 *   t_faults.c         the same fault, one daemon and two: the same outcome
 *   t_topo.c           rails (peer.topology) from a fake sysfs tree
 *
 * A test goes in the file of its area; a helper used by one file stays
 * in it, one used by several goes to fixtures.c (peer_harness.c for the
 * peer files).
 */

/* Each file uses what the files above it define, so the order matters
 * (clang-format would sort the names). */
/* clang-format off */
#include "harness.c"
#include "fixtures.c"

#include "t_transfer.c"
#include "t_agree.c"
#include "t_lifecycle.c"
#include "t_release.c"
#include "t_protocol.c"
#include "t_regions.c"
#include "t_ops.c"
#include "t_hostile.c"
#include "t_keys.c"
#include "t_aux.c"
#include "t_layers.c"
#include "t_groups.c"
#include "t_api3.c"
#include "t_lease.c"
#include "t_restart.c"
#include "t_pace.c"

/* cross-daemon (UCX) tests, two daemons in two network namespaces */
#include "peer_harness.c"
#include "t_peer_transfer.c"
#include "t_peer_lanes.c"
#include "t_peer_lost.c"
#include "t_upgrade.c"
#include "t_peer_spread.c"
#include "t_peer_ops.c"
#include "t_peer_hostile.c"
#include "t_access.c"
#include "t_attack.c"
#include "t_faults.c"
#include "t_topo.c"
/* clang-format on */
