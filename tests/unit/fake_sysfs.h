/*
 * fake_sysfs — a sysfs tree in a temporary directory, for the unit tests
 * of topo and the rails (test_topo.c, test_rails.c). build_tree() makes
 * it and leaves its path in root:
 *
 * Two NUMA nodes. Node 0, host bridge pci0000:00: a switch (root port
 * 00:01.0, upstream 01:00.0) with GPU0 (03:00.0) and two HCAs, mlx5_0
 * (04:00.0, its netdev ens4) and mlx5_1 (05:00.0), on its downstream
 * ports; and eth2 (06:00.0) on another root port. Node 1, host bridge
 * pci0000:80: a switch with GPU1 (83:00.0) and mlx5_2 (84:00.0); and
 * host bridge pci0000:c0 with mlx5_3 (c1:00.0, no numa_node of its own:
 * its root port says 1; port 1 up, port 2 down). Besides: rxe0, an RDMA
 * device with no PCI device (soft RoCE); veth0, virtual; lo; loop0,
 * whose device link is a loop; eth9, down.
 */
#ifndef KVX_FAKE_SYSFS_H
#define KVX_FAKE_SYSFS_H

#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/test.h"

static char root[PATH_MAX];

static void mkdirs(const char *rel)
{
    char p[PATH_MAX + 256];
    snprintf(p, sizeof(p), "%s/%s", root, rel);
    for (char *s = p + strlen(root) + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            CHECK(!mkdir(p, 0755) || errno == EEXIST);
            *s = '/';
        }
    CHECK(!mkdir(p, 0755) || errno == EEXIST);
}

static void put(const char *rel, const char *text)
{
    char p[PATH_MAX + 256];
    snprintf(p, sizeof(p), "%s/%s", root, rel);
    FILE *f = fopen(p, "w");
    CHECK(f != NULL);
    fprintf(f, "%s\n", text);
    fclose(f);
}

/* rel -> target (relative to the link's directory, as sysfs has them) */
static void link_to(const char *target, const char *rel)
{
    char p[PATH_MAX + 256];
    snprintf(p, sizeof(p), "%s/%s", root, rel);
    CHECK(!symlink(target, p));
}

#define N0 "devices/pci0000:00/0000:00:01.0/0000:01:00.0"
#define N1 "devices/pci0000:80/0000:80:01.0/0000:81:00.0"
#define GPU0 N0 "/0000:02:00.0/0000:03:00.0"
#define HCA0 N0 "/0000:02:01.0/0000:04:00.0"
#define HCA1 N0 "/0000:02:02.0/0000:05:00.0"
#define ETH2 "devices/pci0000:00/0000:00:02.0/0000:06:00.0"
#define GPU1 N1 "/0000:82:00.0/0000:83:00.0"
#define HCA2 N1 "/0000:82:01.0/0000:84:00.0"
#define HCA3 "devices/pci0000:c0/0000:c0:01.0/0000:c1:00.0"

static void pci_dev(const char *dir, const char *vendor, const char *cls,
                    const char *numa)
{
    char p[PATH_MAX], bdf[16];
    mkdirs(dir);
    snprintf(bdf, sizeof(bdf), "%s", strrchr(dir, '/') + 1);
    snprintf(p, sizeof(p), "%s/vendor", dir);
    put(p, vendor);
    snprintf(p, sizeof(p), "%s/class", dir);
    put(p, cls);
    if (numa) {
        snprintf(p, sizeof(p), "%s/numa_node", dir);
        put(p, numa);
    }
    char target[PATH_MAX];
    snprintf(target, sizeof(target), "../../../%s", dir);
    snprintf(p, sizeof(p), "bus/pci/devices/%s", bdf);
    link_to(target, p);
}

static void hca(const char *name, const char *dir, const char *states[2])
{
    char p[PATH_MAX], t[PATH_MAX];
    for (int port = 1; port <= 2 && states[port - 1]; port++) {
        snprintf(p, sizeof(p), "class/infiniband/%s/ports/%d", name, port);
        mkdirs(p);
        snprintf(p, sizeof(p), "class/infiniband/%s/ports/%d/state", name,
                 port);
        put(p, states[port - 1]);
    }
    if (dir) {
        snprintf(t, sizeof(t), "../../../%s", dir);
        snprintf(p, sizeof(p), "class/infiniband/%s/device", name);
        link_to(t, p);
    }
}

static void netdev(const char *name, const char *pcidir, const char *state)
{
    char p[PATH_MAX], t[PATH_MAX];
    if (pcidir) {
        /* under its PCI device, as sysfs has it */
        snprintf(p, sizeof(p), "%s/net/%s", pcidir, name);
        mkdirs(p);
        snprintf(t, sizeof(t), "../../%s/net/%s", pcidir, name);
        snprintf(p, sizeof(p), "class/net/%s", name);
        link_to(t, p);
        snprintf(p, sizeof(p), "%s/net/%s/device", pcidir, name);
        link_to("../../", p);
        snprintf(p, sizeof(p), "%s/net/%s/operstate", pcidir, name);
    } else {
        snprintf(p, sizeof(p), "devices/virtual/net/%s", name);
        mkdirs(p);
        snprintf(t, sizeof(t), "../../devices/virtual/net/%s", name);
        snprintf(p, sizeof(p), "class/net/%s", name);
        link_to(t, p);
        snprintf(p, sizeof(p), "devices/virtual/net/%s/operstate", name);
    }
    put(p, state);
}

static int rm_one(const char *path, const struct stat *st, int flag,
                  struct FTW *f)
{
    (void)st;
    (void)flag;
    (void)f;
    return remove(path);
}

/* The trees this process made, removed at its exit. */
static char made[8][PATH_MAX];
static unsigned nmade;

static void trees_remove(void)
{
    for (unsigned i = 0; i < nmade; i++)
        nftw(made[i], rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* root: a new temporary directory, removed at exit */
static void new_root(void)
{
    snprintf(root, sizeof(root), "/tmp/kvx_topo_XXXXXX");
    CHECK(mkdtemp(root));
    if (!nmade)
        atexit(trees_remove);
    if (nmade < sizeof(made) / sizeof(made[0]))
        snprintf(made[nmade++], sizeof(made[0]), "%s", root);
}

static void build_tree(void)
{
    new_root();
    mkdirs("bus/pci/devices");
    mkdirs("class/net");
    mkdirs("class/infiniband");
    static const char *up1[2] = {"4: ACTIVE", NULL};
    static const char *up_down[2] = {"4: ACTIVE", "1: DOWN"};
    /* the bridges say their node; mlx5_3's own numa_node is missing */
    mkdirs(N0);
    put("devices/pci0000:00/0000:00:01.0/numa_node", "0");
    mkdirs(N1);
    put("devices/pci0000:80/0000:80:01.0/numa_node", "1");
    mkdirs("devices/pci0000:c0/0000:c0:01.0");
    put("devices/pci0000:c0/0000:c0:01.0/numa_node", "1");
    pci_dev(GPU0, "0x10de", "0x030200", "0");
    pci_dev(GPU1, "0x10de", "0x030000", "1");
    pci_dev(HCA0, "0x15b3", "0x020700", "0");
    pci_dev(HCA1, "0x15b3", "0x020700", "0");
    pci_dev(HCA2, "0x15b3", "0x020700", "1");
    pci_dev(HCA3, "0x15b3", "0x020700", NULL);
    pci_dev(ETH2, "0x8086", "0x020000", "-1");
    /* an NVIDIA device that is no GPU (an NVSwitch bridge, class 0x0680) */
    pci_dev("devices/pci0000:00/0000:00:05.0", "0x10de", "0x068000", "0");
    hca("mlx5_0", HCA0, up1);
    hca("mlx5_1", HCA1, up1);
    hca("mlx5_2", HCA2, up1);
    hca("mlx5_3", HCA3, up_down);
    hca("rxe0", NULL, up1);
    netdev("ens4", HCA0, "up"); /* mlx5_0's own */
    netdev("eth2", ETH2, "up");
    netdev("eth9", ETH2, "down");
    netdev("veth0", NULL, "up");
    netdev("lo", NULL, "unknown");
    mkdirs("class/net/loop0");
    put("class/net/loop0/operstate", "up");
    link_to("../loop0/device", "class/net/loop0/device");
}

#endif
