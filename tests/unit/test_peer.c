/*
 * test_peer — what peer_init.c decides from the machine before any
 * connection: whether UCX may use an RDMA device (peer_rdma(), which
 * turns peer.direct's auto setting off), from a UCX device list and a
 * fake /sys/class/infiniband.
 */
#include "../../daemon/net/peer_init.c"

#include "tests/test.h"

#include <stdlib.h>
#include <sys/stat.h>

static char root[64];

/* A fake /sys/class/infiniband holding the devices named (NULL-ended). */
static void fake_root(const char *const *devs)
{
    snprintf(root, sizeof(root), "/tmp/kvx-test-ib-XXXXXX");
    CHECK(mkdtemp(root) != NULL);
    for (int i = 0; devs[i]; i++) {
        char d[128];
        snprintf(d, sizeof(d), "%s/%s", root, devs[i]);
        CHECK(mkdir(d, 0755) == 0);
    }
}

static void fake_root_gone(void)
{
    char cmd[96];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    CHECK(system(cmd) == 0);
}

TEST(rdma_devices_named_in_the_list)
{
    static const char *const devs[] = {"mlx5_0", "mlx5_1", NULL};
    fake_root(devs);
    CHECK(list_has_rdma("", root));    /* every device */
    CHECK(list_has_rdma("all", root)); /* the same */
    CHECK(!list_has_rdma("eth0", root));
    CHECK(list_has_rdma("mlx5_0:1", root));
    CHECK(list_has_rdma("mlx5_1", root));
    CHECK(list_has_rdma("eth0,mlx5_1:1", root));
    CHECK(list_has_rdma("eth0,lo,mlx5_0:2", root));
    CHECK(!list_has_rdma("mlx5", root));      /* a prefix is not a device */
    CHECK(!list_has_rdma("mlx5_0x:1", root)); /* nor a longer name */
    CHECK(!list_has_rdma("eth0,", root));
    CHECK(list_has_rdma("eth0,all", root)); /* UCX: "all" anywhere */
    CHECK(!list_has_rdma("eth0,allx", root));
    fake_root_gone();
}

TEST(no_rdma_device_here)
{
    static const char *const none[] = {NULL};
    fake_root(none);
    CHECK(!list_has_rdma("", root));
    CHECK(!list_has_rdma("all", root));
    CHECK(!list_has_rdma("mlx5_0:1", root));
    fake_root_gone();
    /* no such directory (no RDMA driver loaded) */
    CHECK(!list_has_rdma("", "/nonexistent/infiniband"));
    CHECK(!list_has_rdma("mlx5_0:1", "/nonexistent/infiniband"));
}
