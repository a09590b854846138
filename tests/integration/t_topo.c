/*
 * t_topo.c — rails (peer.topology): a daemon given a fake sysfs tree
 * (peer.sysfs_root) with two GPUs and two RDMA ports, each pair under a
 * PCIe switch of its own NUMA node, shows the rails and each GPU's in
 * status and kvxferctl; peer.gpu_rails overrides the distance; a rail
 * that is not there stops the daemon naming the key; a root that cannot
 * be read leaves one rail.
 */

/* The tree, built by a shell script (paths as sysfs has them: links
 * relative to where they are). */
static const char topo_script[] =
    "set -e\n"
    "R=$1\n"
    "mkdir -p $R/bus/pci/devices $R/class/infiniband $R/class/net\n"
    "dev() { # DIR VENDOR CLASS NUMA\n"
    "  mkdir -p $R/$1; echo $2 > $R/$1/vendor; echo $3 > $R/$1/class\n"
    "  echo $4 > $R/$1/numa_node\n"
    "  ln -s ../../../$1 $R/bus/pci/devices/$(basename $1)\n"
    "}\n"
    "hca() { # NAME DIR\n"
    "  mkdir -p $R/class/infiniband/$1/ports/1\n"
    "  echo '4: ACTIVE' > $R/class/infiniband/$1/ports/1/state\n"
    "  ln -s ../../../$2 $R/class/infiniband/$1/device\n"
    "}\n"
    "S0=devices/pci0000:00/0000:00:01.0/0000:01:00.0\n"
    "S1=devices/pci0000:80/0000:80:01.0/0000:81:00.0\n"
    "dev $S0/0000:02:00.0/0000:03:00.0 0x10de 0x030200 0\n"
    "dev $S0/0000:02:01.0/0000:04:00.0 0x15b3 0x020700 0\n"
    "dev $S1/0000:82:00.0/0000:83:00.0 0x10de 0x030200 1\n"
    "dev $S1/0000:82:01.0/0000:84:00.0 0x15b3 0x020700 1\n"
    "hca mlx5_0 $S0/0000:02:01.0/0000:04:00.0\n"
    "hca mlx5_1 $S1/0000:82:01.0/0000:84:00.0\n";

/* The fake tree under p_net.dir/sys; its path in root. */
static void topo_tree(char *root, size_t len)
{
    char script[160], cmd[512];
    snprintf(root, len, "%s/sys", p_net.dir);
    snprintf(script, sizeof(script), "%s/mksys.sh", p_net.dir);
    write_file(script, topo_script);
    snprintf(cmd, sizeof(cmd), "sh %s %s", script, root);
    CHECK(system(cmd) == 0);
}

static const char topo_rails_json[] =
    "\"topology\":\"auto\",\"rails\":["
    "{\"nic\":\"mlx5_0:1\",\"pci\":\"0000:04:00.0\",\"numa\":0,"
    "\"lanes\":0},"
    "{\"nic\":\"mlx5_1:1\",\"pci\":\"0000:84:00.0\",\"numa\":1,"
    "\"lanes\":0}]";

TEST_T(topo_rails_in_status, 60)
{
    p_setup();
    char root[160], peer[400];
    topo_tree(root, sizeof(root));
    snprintf(peer, sizeof(peer), "  sysfs_root: %s\n  lanes: 0\n", root);
    daemon_t *a = p_daemon(0, P_SECRET, peer, NULL);
    char *json = status_json(a);
    char *ucx = p_json_section(json, "\"ucx\":");
    CHECK(ucx != NULL);
    fprintf(stderr, "ucx: %s\n", ucx);
    CHECK_STR_CONTAINS(ucx, topo_rails_json);
    /* each GPU: the port under its own switch */
    CHECK_STR_CONTAINS(ucx, "\"gpu_rails\":["
                            "{\"gpu\":\"0000:03:00.0\",\"rails\":"
                            "[\"mlx5_0:1\"],\"distance\":\"switch\"},"
                            "{\"gpu\":\"0000:83:00.0\",\"rails\":"
                            "[\"mlx5_1:1\"],\"distance\":\"switch\"}]");
    free(ucx);
    free(json);
    char args[256], out[4096];
    snprintf(args, sizeof(args), "--socket %s status", a->sock);
    CHECK_EQ(ctl_run(args, out, sizeof(out)), 0);
    fprintf(stderr, "%s", out);
    CHECK_STR_CONTAINS(out, "rails          auto: mlx5_0:1 (pci 0000:04:00.0, "
                            "numa 0, 0 lanes), mlx5_1:1 (pci 0000:84:00.0, "
                            "numa 1, 0 lanes)\n");
    CHECK_STR_CONTAINS(out, "  gpu 0000:03:00.0 -> mlx5_0:1 (switch)\n");
    CHECK_STR_CONTAINS(out, "  gpu 0000:83:00.0 -> mlx5_1:1 (switch)\n");
    CHECK(log_contains(a, "peers: rails mlx5_0:1 (0000:04:00.0, numa 0), "
                          "mlx5_1:1 (0000:84:00.0, numa 1)"));
    daemon_healthy(a);
    daemon_stop_ok(a);
}

/* peer.gpu_rails wins over the distance; peer.rails chooses the rails */
TEST_T(topo_rails_by_hand, 60)
{
    p_setup();
    char root[160], peer[512];
    topo_tree(root, sizeof(root));
    snprintf(peer, sizeof(peer),
             "  sysfs_root: %s\n  lanes: 0\n"
             "  rails: \"mlx5_1:1,mlx5_0\"\n"
             "  gpu_rails: \"0000:03:00.0=mlx5_1:1+mlx5_0:1\"\n",
             root);
    daemon_t *a = p_daemon(0, P_SECRET, peer, NULL);
    char *json = status_json(a);
    char *ucx = p_json_section(json, "\"ucx\":");
    CHECK(ucx != NULL);
    fprintf(stderr, "ucx: %s\n", ucx);
    CHECK_STR_CONTAINS(ucx, "\"topology\":\"auto (peer.rails)\",\"rails\":["
                            "{\"nic\":\"mlx5_1:1\"");
    CHECK_STR_CONTAINS(ucx, "{\"gpu\":\"0000:03:00.0\",\"rails\":"
                            "[\"mlx5_1:1\",\"mlx5_0:1\"],\"distance\":"
                            "\"peer.gpu_rails\"}");
    CHECK_STR_CONTAINS(ucx, "{\"gpu\":\"0000:83:00.0\",\"rails\":"
                            "[\"mlx5_1:1\"],\"distance\":\"switch\"}");
    free(ucx);
    free(json);
    daemon_healthy(a);
    daemon_stop_ok(a);
}

/* A rail that is not there stops the daemon, naming the key; a root
 * that cannot be read leaves one rail, said once. */
TEST_T(topo_rails_refused, 60)
{
    p_setup();
    char root[160], cfg[256], sec[160], text[1024], cmd[512], out[4096];
    topo_tree(root, sizeof(root));
    snprintf(sec, sizeof(sec), "%s/secret", p_net.dir);
    write_file(sec, P_SECRET);
    CHECK(chmod(sec, 0600) == 0);
    snprintf(cfg, sizeof(cfg), "%s/k.yaml", p_net.dir);
    static const struct {
        const char *peer, *want;
    } cases[] = {
        {"  rails: \"mlx5_0:1,mlx5_9:1\"\n",
         "peer.rails: 'mlx5_9:1' is not a NIC that is up here (found in "},
        {"  gpu_rails: \"0000:03:00.0=eth7\"\n",
         "peer.gpu_rails: 'eth7' of 0000:03:00.0 is not one of the rails"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(text, sizeof(text),
                 "socket:\n  path: %s/s.sock\npeer:\n  listen: "
                 "\"127.0.0.1:0\"\n  secret_file: %s\n  sysfs_root: %s\n%s",
                 p_net.dir, sec, root, cases[i].peer);
        write_file(cfg, text);
        snprintf(cmd, sizeof(cmd), "timeout 10 %s/kvxferd --config %s 2>&1",
                 build_dir(), cfg);
        int st = cmd_run(cmd, out, sizeof(out));
        fprintf(stderr, "%s", out);
        CHECK_EQ(st, 1);
        CHECK_STR_CONTAINS(out, cases[i].want);
    }
    char peer[256];
    snprintf(peer, sizeof(peer), "  sysfs_root: %s/none\n  lanes: 0\n",
             p_net.dir);
    daemon_t *a = p_daemon(0, P_SECRET, peer, NULL);
    char *json = status_json(a);
    CHECK_STR_CONTAINS(json, "\"topology\":\"one rail: sysfs cannot be "
                             "read\",\"rails\":[{\"nic\":");
    CHECK_STR_CONTAINS(json, "\"gpu_rails\":[]");
    free(json);
    CHECK(log_contains(a, "peer.topology: cannot read"));
    daemon_healthy(a);
    daemon_stop_ok(a);
}

/* ---- lanes grouped by rail --------------------------------------------- */

/* A fake tree whose two NICs are real interfaces of the daemon's
 * namespace (each with a PCI place of its own), into root. */
static void topo_tree_nics(int side, const char *nic0, const char *nic1,
                           char *root, size_t len)
{
    char script[160], cmd[512];
    snprintf(root, len, "%s/sys-%c", p_net.dir, "AB"[side]);
    snprintf(script, sizeof(script), "%s/mknics.sh", p_net.dir);
    write_file(script, "set -e\n"
                       "R=$1\n"
                       "mkdir -p $R/bus/pci/devices $R/class/net\n"
                       "nic() { # NAME PCIDIR\n"
                       "  mkdir -p $R/$2/net/$1\n"
                       "  echo up > $R/$2/net/$1/operstate\n"
                       "  ln -s ../../ $R/$2/net/$1/device\n"
                       "  ln -s ../../$2/net/$1 $R/class/net/$1\n"
                       "}\n"
                       "nic $2 devices/pci0000:00/0000:00:01.0/0000:01:00.0\n"
                       "nic $3 devices/pci0000:00/0000:00:02.0/0000:02:00.0\n");
    snprintf(cmd, sizeof(cmd), "sh %s %s %s %s", script, root, nic0, nic1);
    CHECK(system(cmd) == 0);
}

/* Bytes the interface nic of namespace ns received and sent. */
static long long topo_if_bytes(const char *ns, const char *nic)
{
    char cmd[256], out[64];
    long long rx = -1, tx = -1;
    snprintf(cmd, sizeof(cmd),
             "ip netns exec %s cat /sys/class/net/%s/statistics/rx_bytes "
             "/sys/class/net/%s/statistics/tx_bytes | tr '\\n' ' '",
             ns, nic, nic);
    CHECK_EQ(cmd_run(cmd, out, sizeof(out)), 0);
    CHECK_EQ(sscanf(out, "%lld %lld", &rx, &tx), 2);
    return rx + tx;
}

/* Two rails a daemon, each a veth pair between the two namespaces:
 * lanes on each rail's UCX context alone, slot data spread over both
 * (host pools: any rail), every byte verified, and the second pair,
 * which nothing but its rail's lanes can use, carried megabytes. */
TEST_T(topo_rails_carry_data, 180)
{
    p_setup();
    if (!p_net.netns) {
        fprintf(stderr, "skipped: needs network namespaces\n");
        return;
    }
    int pid = (int)getpid(), x = 64 + pid % 128;
    char rail2[2][16];
    snprintf(rail2[0], sizeof(rail2[0]), "kvxc%d", pid);
    snprintf(rail2[1], sizeof(rail2[1]), "kvxd%d", pid);
    CHECK(p_sh(NULL, 0,
               "ip link add %s netns %s type veth peer name %s netns %s",
               rail2[0], p_net.ns[0], rail2[1], p_net.ns[1]) == 0);
    for (int i = 0; i < 2; i++)
        CHECK(p_sh(NULL, 0,
                   "ip -n %s addr add 10.%d.1.%d/24 dev %s && "
                   "ip -n %s link set %s up",
                   p_net.ns[i], x, i + 1, rail2[i], p_net.ns[i],
                   rail2[i]) == 0);
    daemon_t *d[2];
    for (int i = 0; i < 2; i++) {
        char root[160], peer[512];
        topo_tree_nics(i, p_net.veth[i], rail2[i], root, sizeof(root));
        snprintf(peer, sizeof(peer),
                 "  sysfs_root: %s\n  lanes: 2\n  rails: \"%s,%s\"\n", root,
                 p_net.veth[i], rail2[i]);
        d[i] = p_daemon(i, P_SECRET, peer, NULL);
    }
    long long before = topo_if_bytes(p_net.ns[0], rail2[0]);
    char *json = status_json(d[0]);
    char want[256];
    snprintf(want, sizeof(want),
             "\"topology\":\"auto (peer.rails)\",\"rails\":[{\"nic\":\"%s\","
             "\"pci\":\"0000:01:00.0\",\"numa\":-1,\"lanes\":2},{\"nic\":"
             "\"%s\",\"pci\":\"0000:02:00.0\",\"numa\":-1,\"lanes\":2}]",
             p_net.veth[0], rail2[0]);
    CHECK_STR_CONTAINS(json, want);
    CHECK_STR_CONTAINS(json, "\"lanes\":4,\"lane_ports\"");
    free(json);
    p_both_ways(d[0], d[1], "rails", 6, 4);
    for (int i = 0; i < 2; i++) {
        char *pj = p_peers(d[i]);
        fprintf(stderr, "%c's peers: %s\n", "AB"[i], pj);
        CHECK_EQ(json_num(pj, "lanes"), 4);
        CHECK_EQ(json_num(pj, "errors"), 0);
        /* the lanes' endpoints are on both rails */
        char tl[2][48];
        snprintf(tl[0], sizeof(tl[0]), "tcp/%s.0", p_net.veth[i]);
        snprintf(tl[1], sizeof(tl[1]), "tcp/%s.0", rail2[i]);
        CHECK_STR_CONTAINS(pj, tl[0]);
        CHECK_STR_CONTAINS(pj, tl[1]);
        free(pj);
    }
    long long moved = topo_if_bytes(p_net.ns[0], rail2[0]) - before;
    fprintf(stderr, "%s moved %lld bytes\n", rail2[0], moved);
    CHECK(moved > 1000000);
    CHECK(!log_contains(d[0], "no UCX transport"));
    p_stop_both(d[0], d[1]);
}
