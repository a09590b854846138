/*
 * test_topo — network devices and GPUs read from a fake sysfs tree built
 * here in a temporary directory, and the NICs chosen for each GPU.
 *
 * The tree is fake_sysfs.h's.
 */
#include "../../daemon/net/topo.c"

#include "tests/test.h"
#include "tests/unit/fake_sysfs.h"

static const char *names(const topo_t *t, uint32_t m, char *buf, size_t n)
{
    buf[0] = 0;
    for (unsigned i = 0; i < t->n_nic; i++)
        if (m & (1u << i))
            snprintf(buf + strlen(buf), n - strlen(buf), "%s%s",
                     buf[0] ? "," : "", t->nic[i].name);
    return buf;
}

static uint32_t mask_of(const topo_t *t, const char *list)
{
    char b[256], *save;
    uint32_t m = 0;
    snprintf(b, sizeof(b), "%s", list);
    for (char *s = strtok_r(b, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
        int i = topo_nic_index(t, s);
        CHECK(i >= 0);
        m |= 1u << i;
    }
    return m;
}

#define CHECK_NEAREST(t, gpu, among, want, want_dist)                          \
    do {                                                                       \
        char b_[256];                                                          \
        topo_dist_t d_;                                                        \
        uint32_t m_ = topo_nearest(t, gpu, among, &d_);                        \
        if (strcmp(names(t, m_, b_, sizeof(b_)), want)) {                      \
            fprintf(stderr, "nearest: got %s, want %s\n", b_, want);           \
            CHECK(!"nearest differs");                                         \
        }                                                                      \
        CHECK_EQ(d_, want_dist);                                               \
    } while (0)

TEST(discover_lists_nics_and_gpus)
{
    topo_t t;
    char why[128], b[512];
    build_tree();
    CHECK_EQ(topo_discover(root, &t, KVX_WHY(why)), 0);
    /* RDMA ports (ACTIVE) first, then the physical interfaces that are
     * up and no HCA's own: not ens4, veth0, lo, eth9; not mlx5_3:2 */
    CHECK_EQ(t.n_nic, 7);
    CHECK(!strcmp(names(&t, 0x7f, b, sizeof(b)),
                  "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,rxe0:1,eth2,loop0"));
    CHECK(t.nic[0].rdma && !t.nic[5].rdma);
    CHECK(!strcmp(t.nic[0].pci.bdf, "0000:04:00.0"));
    CHECK(!strcmp(t.nic[0].netdev, "ens4"));
    CHECK(!strcmp(t.nic[0].pci.root, "pci0000:00"));
    CHECK_EQ(t.nic[0].pci.depth, 3);
    CHECK(!strcmp(t.nic[0].pci.bridges[0], "0000:00:01.0"));
    CHECK(!strcmp(t.nic[0].pci.bridges[1], "0000:01:00.0"));
    CHECK(!strcmp(t.nic[0].pci.bridges[2], "0000:02:01.0"));
    CHECK_EQ(t.nic[0].pci.numa, 0);
    CHECK_EQ(t.nic[2].pci.numa, 1);
    /* mlx5_3 has no numa_node: its root port's */
    CHECK(!strcmp(t.nic[3].pci.bdf, "0000:c1:00.0"));
    CHECK_EQ(t.nic[3].pci.numa, 1);
    /* eth2 says -1 and so does nothing above it */
    CHECK(!strcmp(t.nic[5].pci.bdf, "0000:06:00.0"));
    CHECK_EQ(t.nic[5].pci.numa, -1);
    CHECK_EQ(t.nic[5].netdev[0], 0);
    /* rxe0 (no PCI device) and loop0 (a looping link): kept, unplaced */
    CHECK_EQ(t.nic[4].pci.bdf[0], 0);
    CHECK_EQ(t.nic[4].pci.numa, -1);
    CHECK_EQ(t.nic[6].pci.bdf[0], 0);
    /* GPUs: NVIDIA display/3D controllers only, by bus id */
    CHECK_EQ(t.n_gpu, 2);
    CHECK(!strcmp(t.gpu[0].bdf, "0000:03:00.0"));
    CHECK(!strcmp(t.gpu[1].bdf, "0000:83:00.0"));
    CHECK_EQ(t.gpu[1].numa, 1);
    CHECK(!strcmp(t.gpu[1].root, "pci0000:80"));
}

TEST(nearest_nics_per_gpu)
{
    topo_t t;
    char why[128];
    build_tree();
    CHECK_EQ(topo_discover(root, &t, KVX_WHY(why)), 0);
    uint32_t all = (1u << t.n_nic) - 1;
    const topo_pci_t *g0 = &t.gpu[0], *g1 = &t.gpu[1];
    /* GPU0: both HCAs of its switch, side by side (rails) */
    CHECK_NEAREST(&t, g0, all, "mlx5_0:1,mlx5_1:1", TOPO_SWITCH);
    /* GPU1: the one HCA of its switch */
    CHECK_NEAREST(&t, g1, all, "mlx5_2:1", TOPO_SWITCH);
    /* without them: eth2 shares GPU0's host bridge only */
    CHECK_NEAREST(&t, g0, mask_of(&t, "eth2,mlx5_2:1,mlx5_3:1"), "eth2",
                  TOPO_HOST_BRIDGE);
    /* GPU1 and mlx5_3: another host bridge, the same node (mlx5_3's
     * node from its root port) beats another node */
    CHECK_NEAREST(&t, g1, mask_of(&t, "mlx5_0:1,mlx5_3:1,eth2"), "mlx5_3:1",
                  TOPO_NUMA);
    /* across nodes, every one as far: all of them */
    CHECK_NEAREST(&t, g0, mask_of(&t, "mlx5_2:1,mlx5_3:1"), "mlx5_2:1,mlx5_3:1",
                  TOPO_OTHER);
    /* an unplaced NIC is farthest: only when there is nothing else */
    CHECK_NEAREST(&t, g0, mask_of(&t, "rxe0:1,mlx5_2:1"), "mlx5_2:1",
                  TOPO_OTHER);
    CHECK_NEAREST(&t, g0, mask_of(&t, "rxe0:1,loop0"), "rxe0:1,loop0",
                  TOPO_UNKNOWN);
    /* eth2's node is unknown: to GPU1 it is as far as another node */
    CHECK_NEAREST(&t, g1, mask_of(&t, "eth2,mlx5_0:1"), "mlx5_0:1,eth2",
                  TOPO_OTHER);
    /* a GPU that could not be placed: every NIC offered */
    topo_pci_t none = {.numa = -1};
    CHECK_NEAREST(&t, &none, mask_of(&t, "mlx5_0:1,eth2"), "mlx5_0:1,eth2",
                  TOPO_UNKNOWN);
    topo_dist_t d;
    CHECK_EQ(topo_nearest(&t, g0, 0, &d), 0);
    CHECK_EQ(d, TOPO_UNKNOWN);
}

TEST(pci_find_by_cuda_bus_id)
{
    topo_pci_t p;
    build_tree();
    /* as cudaDeviceGetPCIBusId writes it, and as nvidia-smi does */
    CHECK_EQ(topo_pci_find(root, "0000:83:00.0", &p), 0);
    CHECK(!strcmp(p.bdf, "0000:83:00.0"));
    CHECK_EQ(p.numa, 1);
    CHECK_EQ(topo_pci_find(root, "00000000:83:00.0", &p), 0);
    CHECK(!strcmp(p.bdf, "0000:83:00.0"));
    CHECK_EQ(topo_pci_find(root, "0000:C1:00.0", &p), 0);
    CHECK(!strcmp(p.bdf, "0000:c1:00.0"));
    CHECK_EQ(p.depth, 1);
    CHECK_EQ(topo_pci_find(root, "0000:99:00.0", &p), KVX_ERR_NOT_FOUND);
    CHECK_EQ(topo_pci_find(root, "83:00.0", &p), KVX_ERR_INVALID);
    CHECK_EQ(topo_pci_find(root, "0000:83:00.0x", &p), KVX_ERR_INVALID);
    CHECK_EQ(topo_pci_find(root, "", &p), KVX_ERR_INVALID);
    CHECK_EQ(topo_pci_find("/nonexistent/kvx", "0000:83:00.0", &p),
             KVX_ERR_NOT_FOUND);
}

TEST(nic_index_by_name)
{
    topo_t t;
    char why[128];
    build_tree();
    CHECK_EQ(topo_discover(root, &t, KVX_WHY(why)), 0);
    CHECK_EQ(topo_nic_index(&t, "mlx5_3:1"), 3);
    CHECK_EQ(topo_nic_index(&t, "mlx5_3"), 3);    /* its first port up */
    CHECK_EQ(topo_nic_index(&t, "mlx5_3:2"), -1); /* down */
    CHECK_EQ(topo_nic_index(&t, "eth2"), 5);
    CHECK_EQ(topo_nic_index(&t, "eth"), -1);
    CHECK_EQ(topo_nic_index(&t, "veth0"), -1);
    CHECK_EQ(topo_nic_index(&t, "ens4"), -1); /* mlx5_0's: named by it */
}

TEST(missing_root_and_empty_root)
{
    topo_t t;
    char why[128];
    CHECK_EQ(topo_discover("/nonexistent/kvx_sys", &t, KVX_WHY(why)),
             KVX_ERR_IO);
    CHECK_STR_CONTAINS(why, "cannot read '/nonexistent/kvx_sys'");
    CHECK_STR_CONTAINS(why, "No such file");
    /* a readable root with nothing in it: no devices, no error */
    new_root();
    memset(&t, 0x5a, sizeof(t));
    CHECK_EQ(topo_discover(root, &t, KVX_WHY(why)), 0);
    CHECK_EQ(t.n_nic, 0);
    CHECK_EQ(t.n_gpu, 0);
    /* a file is no root */
    put("f", "x");
    char f[PATH_MAX + 8];
    snprintf(f, sizeof(f), "%s/f", root);
    CHECK_EQ(topo_discover(f, &t, KVX_WHY(why)), KVX_ERR_IO);
}
