/*
 * topo — which network devices a node has and which of them are
 * closest to a GPU, read from sysfs: the RDMA ports under
 * class/infiniband and the physical network interfaces under class/net,
 * each with its PCI address, NUMA node and the chain of PCIe bridges
 * above it; the NVIDIA GPUs under bus/pci/devices; and, for a GPU's PCI
 * bus id (as CUDA reports it), the devices that are nearest to it
 * (same PCIe switch, then same host bridge, then same NUMA node, then
 * any), all of them when several are as near, so that they can be used
 * side by side as rails.
 *
 * Pure: it reads the files under the root it is given ("/sys", or a
 * tree a test builds) and nothing else; it knows nothing of UCX, CUDA
 * or the daemon's state, and never logs. A device it cannot read whole
 * (a broken or looping link, a missing numa_node) is kept with what
 * could be read, or left out when not even its name could be; nothing
 * it finds stops the rest.
 */
#ifndef KVX_TOPO_H
#define KVX_TOPO_H

#include <stdint.h>

#include "common/why.h"

#define TOPO_MAX_NICS 32 /* a mask of them fits a uint32_t */
#define TOPO_MAX_GPUS 16
#define TOPO_MAX_DEPTH 12 /* PCIe bridges kept above a device */
#define TOPO_BDF_LEN 16   /* "0000:1b:00.0" and its NUL */

/* Where a PCI device sits. An empty bdf: not a PCI device, or its link
 * could not be followed (then everything else is unknown too). */
typedef struct topo_pci {
    char bdf[TOPO_BDF_LEN];  /* "0000:1b:00.0", lower case */
    char root[TOPO_BDF_LEN]; /* its host bridge, "pci0000:00" */
    /* the bridges from the host bridge down to the device, the device
     * itself left out: bridges[0] is its root port */
    char bridges[TOPO_MAX_DEPTH][TOPO_BDF_LEN];
    unsigned depth;
    int numa; /* the device's NUMA node (or its nearest bridge's); -1 */
} topo_pci_t;

typedef struct topo_nic {
    char name[64];   /* as UCX_NET_DEVICES names it: "mlx5_0:1", "eth1" */
    char netdev[32]; /* an RDMA port's network interface, or "" */
    int rdma;        /* an RDMA port (else a plain network interface) */
    topo_pci_t pci;
} topo_nic_t;

typedef struct topo {
    topo_nic_t nic[TOPO_MAX_NICS]; /* RDMA ports first, by name */
    unsigned n_nic;
    topo_pci_t gpu[TOPO_MAX_GPUS]; /* NVIDIA display/3D controllers */
    unsigned n_gpu;
} topo_t;

/* How near two PCI devices are, nearest first. */
typedef enum topo_dist {
    TOPO_SWITCH,      /* under a common PCIe bridge (switch, root port) */
    TOPO_HOST_BRIDGE, /* under the same host bridge (root complex) */
    TOPO_NUMA,        /* on the same NUMA node */
    TOPO_OTHER,       /* across NUMA nodes, or a node unknown */
    TOPO_UNKNOWN,     /* one of them is not a PCI device we could read */
} topo_dist_t;

/* Read what root (e.g. "/sys") shows into *t: every RDMA port that is
 * ACTIVE, and every network interface whose operstate is "up" and that
 * has a device (virtual ones and loopback have none) and is not an RDMA
 * device's own interface; and the GPUs. 0, or KVX_ERR_IO with why when
 * root cannot be read at all (a node without RDMA devices or GPUs is
 * not an error: it has none). */
int topo_discover(const char *root, topo_t *t, kvx_why_t *why);

/* The PCI device bdf (any case; a domain of 4 or 8 hex digits, as CUDA
 * and nvidia-smi write it) under root into *out. 0, or KVX_ERR_NOT_FOUND
 * (none there, or its link cannot be followed), KVX_ERR_INVALID (not a
 * bus id). */
int topo_pci_find(const char *root, const char *bdf, topo_pci_t *out);

/* A bus id in the form topo uses ("0000:1b:00.0"), into out
 * (TOPO_BDF_LEN bytes). 0, or KVX_ERR_INVALID. */
int topo_bdf_norm(const char *bdf, char out[TOPO_BDF_LEN]);

/* How near a and b are; *shared (may be NULL) gets how many bridges they
 * have in common (more: nearer, within TOPO_SWITCH). */
topo_dist_t topo_distance(const topo_pci_t *a, const topo_pci_t *b,
                          unsigned *shared);
const char *topo_dist_name(topo_dist_t d);

/* Of the NICs of t in the mask among (bit i: t->nic[i]), those nearest
 * to gpu: a mask, with every NIC as near as the nearest (rails), and in
 * *dist how near. An unreadable gpu (empty bdf) or an empty among gives
 * among itself, at TOPO_UNKNOWN. */
uint32_t topo_nearest(const topo_t *t, const topo_pci_t *gpu, uint32_t among,
                      topo_dist_t *dist);

/* The index of the NIC named name in t ("mlx5_0:1", "eth1"; an RDMA
 * device's name alone names its first port), or -1. */
int topo_nic_index(const topo_t *t, const char *name);

#endif
