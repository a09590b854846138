/*
 * peer_rails — the rails: the NICs the lanes are grouped by (each lane's
 * UCX uses its rail's NIC alone), chosen at start from peer.topology,
 * peer.rails and what topo reads from sysfs; and, for a GPU's PCI bus
 * id, the rails its slot data goes over (the nearest to it, or
 * peer.gpu_rails). With peer.topology off, UCX_NET_DEVICES set, or one
 * NIC, there is one rail: every lane on the devices of
 * peer.net_devices, as before rails.
 *
 * Owns: the rails, the topology read once at start, the map of the GPUs
 * found there. Loop thread only.
 */
#ifndef KVX_PEER_RAILS_H
#define KVX_PEER_RAILS_H

#include <stdint.h>
#include <ucp/api/ucp.h>

#include "common/why.h"
#include "kvxfer.pb-c.h"

#define RAILS_MAX 16 /* one lane each at least: lane.h's LANES_MAX */

/* Choose the rails. 0, or KVX_ERR_INVALID with why naming the key when
 * peer.rails or peer.gpu_rails names a NIC that is not here (or not a
 * rail). What cannot be read (sysfs) leaves one rail, with a warning. */
int rails_init(kvx_why_t *why);
/* How many rails (1 at least, after rails_init()). */
unsigned rails_count(void);
/* Rail r's NIC as UCX_NET_DEVICES names it; "" for the one rail that is
 * no single NIC (its lanes use the loop's UCX context). */
const char *rails_nic(unsigned r);
/* The rails (bit r: rail r) of the GPU whose PCI bus id is busid (as
 * CUDA writes it); every rail for NULL (host memory) or a GPU that is not
 * known. */
uint32_t rails_of_gpu(const char *busid);
/* The lanes to start for per_rail lanes a rail (peer.lanes): one rail,
 * per_rail; more, per_rail each, at most RAILS_MAX in all. Lane i is on
 * rail i % rails_count(), so that the first lanes of two daemons with
 * fewer lanes than the other still cover every rail, and lane i of one
 * daemon (which sends to lane i of the other) is on the same rail of
 * both when their rails are alike. */
unsigned rails_lanes_total(unsigned per_rail);
/* The lanes among the first n (bit i: lane i) whose rail is in rails;
 * 0 if none. */
uint32_t rails_lanes(uint32_t rails, unsigned n);
/* The lane (of the first n, n > 0) for the next send of data that
 * should go over rails (0: any), round-robin by *next: one of those
 * rails' lanes, or any lane when none of the first n is on them. */
unsigned rails_lane_next(uint32_t rails, unsigned n, unsigned *next);
/* The UCX contexts of the rails' lanes: ctx[i] for lane i of n, a
 * context of prm and cfg's settings whose devices are lane i's rail's
 * NIC alone; NULL where the lane uses the loop's context (one rail, or
 * UCX cannot use that NIC: said once, at warning). 0, or KVX_ERR_IO
 * with why. cfg is the caller's; its NET_DEVICES is changed. */
int rails_open(ucp_config_t *cfg, const ucp_params_t *prm, unsigned n,
               ucp_context_h ctx[], kvx_why_t *why);
/* The contexts rails_open() made, gone (after the lanes' workers). */
void rails_close(void);
/* n lanes started (lane i on rail i % rails_count()): for status. */
void rails_started(unsigned n);
/* Status: topology, rails, gpu_rails (static storage, valid until the
 * next rails_init()). */
void rails_ucx_info(Kvxfer__UcxInfo *info);

#endif
