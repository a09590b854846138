/*
 * test_rails — which NICs become rails and which rails each GPU's data
 * goes over (daemon/net/peer_rails.c), on fake_sysfs.h's tree: the RDMA
 * ports peer.net_devices allows, one rail where there is one port or
 * none, UCX_NET_DEVICES or peer.topology off, peer.gpu_rails by hand,
 * the lanes of each rail, and what status shows.
 */
#include "../../daemon/net/peer_rails.c"

#include "tests/test.h"
#include "tests/unit/fake_sysfs.h"

/* The daemon's configuration over the fake tree; then rails_init(). */
static int rails_with(const char *net_devices, const char *gpu_rails, char *why,
                      size_t whylen)
{
    conf_defaults(&kvxd.conf);
    snprintf(kvxd.conf.peer_listen, sizeof(kvxd.conf.peer_listen),
             "127.0.0.1:0");
    snprintf(kvxd.conf.peer_sysfs_root, sizeof(kvxd.conf.peer_sysfs_root),
             "%.100s", root);
    snprintf(kvxd.conf.peer_net_devices, sizeof(kvxd.conf.peer_net_devices),
             "%s", net_devices);
    snprintf(kvxd.conf.peer_gpu_rails, sizeof(kvxd.conf.peer_gpu_rails), "%s",
             gpu_rails);
    return rails_init(&(kvx_why_t){why, whylen});
}

static void check_rails(const char *want)
{
    char got[256] = "";
    for (unsigned r = 0; r < rails_count(); r++)
        snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%s",
                 r ? "," : "", rails_nic(r));
    if (strcmp(got, want))
        fprintf(stderr, "rails: got \"%s\", want \"%s\"\n", got, want);
    CHECK(!strcmp(got, want));
}

TEST(rails_are_the_active_rdma_ports)
{
    char why[256];
    build_tree();
    unsetenv("UCX_NET_DEVICES");
    CHECK_EQ(rails_with("", "", why, sizeof(why)), 0);
    /* mlx5_3:2 is down; rxe0 has no PCI device but is a port */
    check_rails("mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,rxe0:1");
    CHECK(!strcmp(R.topology, "auto"));
    /* GPU0: the two ports of its switch; GPU1: the one of its; as CUDA
     * and nvidia-smi write bus ids */
    CHECK_EQ(rails_of_gpu("0000:03:00.0"), 0x3);
    CHECK_EQ(rails_of_gpu("00000000:83:00.0"), 0x4);
    CHECK_EQ(rails_of_gpu("0000:83:00.0"), 0x4);
    /* host memory, a GPU sysfs does not show, garbage: every rail */
    CHECK_EQ(rails_of_gpu(NULL), 0x1f);
    CHECK_EQ(rails_of_gpu("0000:99:00.0"), 0x1f);
    CHECK_EQ(rails_of_gpu("gpu0"), 0x1f);
    /* peer.lanes 2: two a rail, interleaved; 16 at most */
    CHECK_EQ(rails_lanes_total(2), 10);
    CHECK_EQ(rails_lanes_total(4), RAILS_MAX);
    CHECK_EQ(rails_lanes(0x4, 10), (1u << 2) | (1u << 7));
    CHECK_EQ(rails_lanes(0x3, 10), 0x63);
    /* a peer with 2 lanes: lanes 0 and 1 only, GPU1's rail has none */
    CHECK_EQ(rails_lanes(0x4, 2), 0);
    /* sends take GPU1's lanes in turn, host data every lane */
    unsigned next = 0;
    CHECK_EQ(rails_lane_next(0x4, 10, &next), 2);
    CHECK_EQ(rails_lane_next(0x4, 10, &next), 7);
    CHECK_EQ(rails_lane_next(0x4, 10, &next), 2);
    CHECK_EQ(next, 13);
    CHECK_EQ(rails_lane_next(0, 10, &next), 3);
    CHECK_EQ(rails_lane_next(0x1f, 10, &next), 4);
    /* with a peer of 2 lanes GPU1's rail has none: any lane */
    next = 0;
    CHECK_EQ(rails_lane_next(0x4, 2, &next), 0);
    CHECK_EQ(rails_lane_next(0x4, 2, &next), 1);
    CHECK_EQ(rails_lane_next(0x4, 2, &next), 0);
    rails_started(10);
    Kvxfer__UcxInfo u = KVXFER__UCX_INFO__INIT;
    rails_ucx_info(&u);
    CHECK(!strcmp(u.topology, "auto"));
    CHECK_EQ(u.n_rails, 5);
    CHECK(!strcmp(u.rails[2]->nic, "mlx5_2:1"));
    CHECK(!strcmp(u.rails[2]->pci, "0000:84:00.0"));
    CHECK_EQ(u.rails[2]->numa, 1);
    CHECK_EQ(u.rails[2]->lanes, 2);
    CHECK(!strcmp(u.rails[4]->pci, ""));
    CHECK_EQ(u.rails[4]->numa, -1);
    CHECK_EQ(u.n_gpu_rails, 2);
    CHECK(!strcmp(u.gpu_rails[0]->gpu, "0000:03:00.0"));
    CHECK_EQ(u.gpu_rails[0]->n_rails, 2);
    CHECK(!strcmp(u.gpu_rails[0]->rails[0], "mlx5_0:1"));
    CHECK(!strcmp(u.gpu_rails[0]->rails[1], "mlx5_1:1"));
    CHECK(!strcmp(u.gpu_rails[0]->distance, "switch"));
    CHECK_EQ(u.gpu_rails[1]->n_rails, 1);
    CHECK(!strcmp(u.gpu_rails[1]->rails[0], "mlx5_2:1"));
}

TEST(rails_only_where_net_devices_allow)
{
    char why[256];
    build_tree();
    unsetenv("UCX_NET_DEVICES");
    /* a device name allows its ports; eth2 is no RDMA port */
    CHECK_EQ(rails_with("mlx5_3,eth2,mlx5_0:1", "", why, sizeof(why)), 0);
    check_rails("mlx5_0:1,mlx5_3:1");
    CHECK_EQ(rails_of_gpu("0000:03:00.0"), 0x1); /* its switch */
    CHECK_EQ(rails_of_gpu("0000:83:00.0"), 0x2); /* its NUMA node */
    Kvxfer__UcxInfo u = KVXFER__UCX_INFO__INIT;
    rails_ucx_info(&u);
    CHECK(!strcmp(u.gpu_rails[1]->distance, "numa"));
}

/* One rail, as before rails: its lanes on the loop's context */
TEST(one_rail_where_there_is_no_choice)
{
    char why[256];
    build_tree();
    unsetenv("UCX_NET_DEVICES");
    CHECK_EQ(rails_with("mlx5_1:1,eth2", "", why, sizeof(why)), 0);
    CHECK_EQ(rails_count(), 1);
    check_rails("");
    CHECK(!strcmp(R.topology, "one rail: one RDMA port"));
    CHECK_EQ(rails_of_gpu("0000:83:00.0"), 1);
    CHECK_EQ(rails_lanes_total(2), 2);
    CHECK_EQ(rails_lanes(1, 2), 0x3);
    Kvxfer__UcxInfo u = KVXFER__UCX_INFO__INIT;
    rails_ucx_info(&u);
    CHECK_EQ(u.n_rails, 1);
    CHECK(!strcmp(u.rails[0]->nic, "mlx5_1:1")); /* what it holds */
    ucp_context_h ctx[2] = {(ucp_context_h)1, (ucp_context_h)1};
    CHECK_EQ(rails_open(NULL, NULL, 2, ctx, NULL), 0);
    CHECK(ctx[0] == NULL && ctx[1] == NULL);

    CHECK_EQ(rails_with("eth2", "", why, sizeof(why)), 0);
    CHECK(!strcmp(R.topology, "one rail: no RDMA port"));
    CHECK_EQ(rails_count(), 1);

    setenv("UCX_NET_DEVICES", "mlx5_0:1", 1);
    CHECK_EQ(rails_with("", "", why, sizeof(why)), 0);
    CHECK(!strcmp(R.topology, "one rail: UCX_NET_DEVICES is set"));
    CHECK_EQ(rails_count(), 1);
    unsetenv("UCX_NET_DEVICES");

    conf_defaults(&kvxd.conf);
    snprintf(kvxd.conf.peer_sysfs_root, sizeof(kvxd.conf.peer_sysfs_root),
             "%.100s", root);
    snprintf(kvxd.conf.peer_topology, sizeof(kvxd.conf.peer_topology), "off");
    CHECK_EQ(rails_init(KVX_WHY(why)), 0);
    CHECK(!strcmp(R.topology, "off"));
    CHECK_EQ(rails_count(), 1);
    CHECK_EQ(rails_of_gpu("0000:03:00.0"), 1);

    /* a root that cannot be read: one rail, no error */
    conf_defaults(&kvxd.conf);
    snprintf(kvxd.conf.peer_sysfs_root, sizeof(kvxd.conf.peer_sysfs_root),
             "/nonexistent/kvx_sys");
    CHECK_EQ(rails_init(KVX_WHY(why)), 0);
    CHECK(!strcmp(R.topology, "one rail: sysfs cannot be read"));
}

TEST(gpu_rails_by_hand)
{
    char why[256];
    build_tree();
    unsetenv("UCX_NET_DEVICES");
    CHECK_EQ(
        rails_with("", "00000000:83:00.0=mlx5_0:1+rxe0:1", why, sizeof(why)),
        0);
    CHECK_EQ(rails_of_gpu("0000:83:00.0"), 0x11);
    CHECK_EQ(rails_of_gpu("0000:03:00.0"), 0x3); /* by distance */
    Kvxfer__UcxInfo u = KVXFER__UCX_INFO__INIT;
    rails_ucx_info(&u);
    CHECK(!strcmp(u.gpu_rails[1]->distance, "peer.gpu_rails"));
    /* an entry for a GPU that is not here: said, not used */
    CHECK_EQ(rails_with("", "0000:99:00.0=mlx5_0:1,0000:03:00.0=rxe0:1", why,
                        sizeof(why)),
             0);
    CHECK_EQ(rails_of_gpu("0000:03:00.0"), 0x10);
    CHECK_EQ(rails_of_gpu("0000:99:00.0"), 0x1f);
    /* a rail that is none, named */
    CHECK_EQ(
        rails_with("mlx5_0,mlx5_1", "0000:03:00.0=mlx5_2:1", why, sizeof(why)),
        KVX_ERR_INVALID);
    CHECK(!strcmp(why, "peer.gpu_rails: 'mlx5_2:1' of 0000:03:00.0 is not "
                       "one of the rails"));
}

TEST(rails_given_by_name)
{
    char why[256];
    build_tree();
    unsetenv("UCX_NET_DEVICES");
    conf_defaults(&kvxd.conf);
    snprintf(kvxd.conf.peer_sysfs_root, sizeof(kvxd.conf.peer_sysfs_root),
             "%.100s", root);
    /* TCP rails too; a device name is its first port up */
    snprintf(kvxd.conf.peer_rails, sizeof(kvxd.conf.peer_rails), "eth2,mlx5_3");
    CHECK_EQ(rails_init(KVX_WHY(why)), 0);
    check_rails("eth2,mlx5_3:1");
    CHECK(!strcmp(R.topology, "auto (peer.rails)"));
    CHECK_EQ(rails_of_gpu("0000:03:00.0"), 0x1); /* host bridge */
    CHECK_EQ(rails_of_gpu("0000:83:00.0"), 0x2); /* NUMA node */
    /* UCX_NET_DEVICES does not undo what peer.rails says */
    setenv("UCX_NET_DEVICES", "eth0", 1);
    CHECK_EQ(rails_init(KVX_WHY(why)), 0);
    check_rails("eth2,mlx5_3:1");
    unsetenv("UCX_NET_DEVICES");
    snprintf(kvxd.conf.peer_rails, sizeof(kvxd.conf.peer_rails), "eth2,veth0");
    CHECK_EQ(rails_init(KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "peer.rails: 'veth0' is not a NIC that is up "
                            "here (found in ");
    CHECK_STR_CONTAINS(why, ": mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,rxe0:1,"
                            "eth2,loop0)");
    snprintf(kvxd.conf.peer_sysfs_root, sizeof(kvxd.conf.peer_sysfs_root),
             "/nonexistent/kvx_sys");
    CHECK_EQ(rails_init(KVX_WHY(why)), KVX_ERR_INVALID);
    CHECK_STR_CONTAINS(why, "peer.rails: cannot read '/nonexistent/kvx_sys'");
}
