/*
 * peer_rails — the rails and the GPUs' map to them; see peer_rails.h.
 *
 * Which NICs are rails: peer.rails when given (each must be up here);
 * else the RDMA ports that are active and that peer.net_devices allows
 * (two or more of them: several rails). A node with TCP only keeps one
 * rail on the interface of peer.listen, as before: making the lanes
 * listen on every interface that is up would open ports that
 * peer.net_devices (and its default) keeps closed.
 */
#include "peer_rails.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/daemon.h"
#include "core/log.h"
#include "kvxfer.h"
#include "peer.h"
#include "topo.h"

static struct {
    topo_t topo;
    unsigned n;                /* rails */
    int nic[RAILS_MAX];        /* topo.nic index of rail r; -1: none */
    unsigned lanes[RAILS_MAX]; /* for status */
    char topology[256];        /* for status: how they were chosen */
    struct {
        char bdf[TOPO_BDF_LEN];
        uint32_t rails;
        const char *how; /* topo_dist_name(), or "peer.gpu_rails" */
    } gpu[TOPO_MAX_GPUS];
    unsigned n_gpu;
    ucp_context_h ctx[RAILS_MAX]; /* rails_open()'s, per rail */
    /* status' copies */
    Kvxfer__RailInfo ri[RAILS_MAX], *rip[RAILS_MAX];
    Kvxfer__GpuRails gi[TOPO_MAX_GPUS], *gip[TOPO_MAX_GPUS];
    char *gnames[TOPO_MAX_GPUS][RAILS_MAX];
} R;

/* Whether the UCX device list (UCX_NET_DEVICES's form; "" or "all":
 * every device) allows nic ("mlx5_0:1": "mlx5_0:1" or "mlx5_0"). */
static int list_allows(const char *list, const char *nic)
{
    if (!list[0] || !strcmp(list, "all"))
        return 1;
    size_t dev = strcspn(nic, ":");
    for (const char *p = list; *p;) {
        size_t l = strcspn(p, ",");
        if ((l == strlen(nic) && !strncmp(p, nic, l)) ||
            (l == dev && !strncmp(p, nic, dev)))
            return 1;
        p += l + (p[l] == ',');
    }
    return 0;
}

/* The NIC of topo that holds peer.listen's IP (the one rail's, when
 * it names one), or -1. */
static int listen_nic(void)
{
    char ip[64];
    const char *l = kvxd.conf.peer_listen, *colon = strrchr(l, ':');
    uint8_t want[16];
    struct ifaddrs *all;
    int found = -1, v6 = l[0] == '[';
    if (!colon || colon - l - 2 * v6 >= (long)sizeof(ip))
        return -1;
    snprintf(ip, sizeof(ip), "%.*s", (int)(colon - l - 2 * v6), l + v6);
    if (inet_pton(v6 ? AF_INET6 : AF_INET, ip, want) != 1 || getifaddrs(&all))
        return -1;
    for (struct ifaddrs *i = all; i && found < 0; i = i->ifa_next) {
        const struct sockaddr *a = i->ifa_addr;
        if (!a || a->sa_family != (v6 ? AF_INET6 : AF_INET))
            continue;
        if (v6 ? !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, want, 16)
               : !memcmp(&((const struct sockaddr_in *)a)->sin_addr, want, 4))
            found = topo_nic_index(&R.topo, i->ifa_name);
    }
    freeifaddrs(all);
    return found;
}

static void one_rail(const char *why)
{
    R.n = 1;
    R.nic[0] = -1;
    snprintf(R.topology, sizeof(R.topology), "%s", why);
}

/* peer.rails: each name a NIC that is up here. */
static int rails_given(const char *list, kvx_why_t *why)
{
    char names[512] = "";
    for (const char *p = list; *p;) {
        size_t l = strcspn(p, ",");
        char name[64];
        snprintf(name, sizeof(name), "%.*s", (int)l, p);
        int i = topo_nic_index(&R.topo, name);
        if (i < 0) {
            for (unsigned k = 0; k < R.topo.n_nic; k++)
                snprintf(names + strlen(names), sizeof(names) - strlen(names),
                         "%s%s", k ? "," : "", R.topo.nic[k].name);
            return why_fail(why, KVX_ERR_INVALID,
                            "peer.rails: '%s' is not a NIC that is up here "
                            "(found in %s: %s)",
                            name, kvxd.conf.peer_sysfs_root,
                            names[0] ? names : "none");
        }
        if (R.n == RAILS_MAX)
            return why_fail(why, KVX_ERR_INVALID,
                            "peer.rails: more than %d rails", RAILS_MAX);
        R.nic[R.n++] = i;
        p += l + (p[l] == ',');
    }
    snprintf(R.topology, sizeof(R.topology), "auto (peer.rails)");
    return 0;
}

/* peer.gpu_rails' entry for bdf, into *mask: 1 if there is one, 0 if
 * not, or KVX_ERR_INVALID with why (a rail that is none). */
static int gpu_by_hand(const char *bdf, uint32_t *mask, kvx_why_t *why)
{
    for (const char *p = kvxd.conf.peer_gpu_rails; *p;) {
        size_t el = strcspn(p, ","), bl = strcspn(p, "=");
        char b[24], want[TOPO_BDF_LEN];
        snprintf(b, sizeof(b), "%.*s", (int)bl, p);
        if (!topo_bdf_norm(b, want) && !strcmp(want, bdf)) {
            *mask = 0;
            for (const char *r = p + bl + 1; r < p + el;) {
                size_t l = strcspn(r, "+,");
                unsigned k = 0;
                for (; k < R.n; k++)
                    if (R.nic[k] >= 0 &&
                        strlen(R.topo.nic[R.nic[k]].name) == l &&
                        !strncmp(R.topo.nic[R.nic[k]].name, r, l))
                        break;
                if (k == R.n)
                    return why_fail(why, KVX_ERR_INVALID,
                                    "peer.gpu_rails: '%.*s' of %s is not "
                                    "one of the rails",
                                    (int)l, r, b);
                *mask |= 1u << k;
                r += l + (r[l] == '+');
            }
            return 1;
        }
        p += el + (p[el] == ',');
    }
    return 0;
}

/* Each GPU found: its rails. */
static int map_gpus(kvx_why_t *why)
{
    uint32_t all = (1u << R.n) - 1, among = 0;
    for (unsigned r = 0; r < R.n; r++)
        if (R.nic[r] >= 0)
            among |= 1u << R.nic[r];
    R.n_gpu = 0;
    for (unsigned g = 0; g < R.topo.n_gpu; g++) {
        const topo_pci_t *pci = &R.topo.gpu[g];
        uint32_t mask;
        int rc = gpu_by_hand(pci->bdf, &mask, why);
        if (rc < 0)
            return rc;
        const char *how = "peer.gpu_rails";
        if (!rc) {
            topo_dist_t d;
            uint32_t nics = among ? topo_nearest(&R.topo, pci, among, &d) : 0;
            how = topo_dist_name(among ? d : TOPO_UNKNOWN);
            mask = nics ? 0 : all;
            for (unsigned r = 0; r < R.n; r++)
                if (R.nic[r] >= 0 && (nics & (1u << R.nic[r])))
                    mask |= 1u << r;
        }
        memcpy(R.gpu[R.n_gpu].bdf, pci->bdf, TOPO_BDF_LEN);
        R.gpu[R.n_gpu].rails = mask;
        R.gpu[R.n_gpu++].how = how;
    }
    /* an entry of peer.gpu_rails for a GPU that is not here is no
     * error (a config shared by nodes), but said */
    for (const char *p = kvxd.conf.peer_gpu_rails; *p;) {
        size_t el = strcspn(p, ","), bl = strcspn(p, "=");
        char b[24], bdf[TOPO_BDF_LEN];
        unsigned g = 0;
        snprintf(b, sizeof(b), "%.*s", (int)bl, p);
        if (!topo_bdf_norm(b, bdf))
            while (g < R.n_gpu && strcmp(R.gpu[g].bdf, bdf))
                g++;
        if (g == R.n_gpu)
            log_notice("peers: peer.gpu_rails: no GPU %s in %s; its entry "
                       "is not used",
                       b, kvxd.conf.peer_sysfs_root);
        p += el + (p[el] == ',');
    }
    return 0;
}

int rails_init(kvx_why_t *why)
{
    rails_close();
    memset(&R, 0, sizeof(R));
    char twhy[256];
    const char *env = getenv("UCX_NET_DEVICES");
    if (strcmp(kvxd.conf.peer_topology, "auto")) {
        one_rail("off");
        return 0;
    }
    if (env && !kvxd.conf.peer_rails[0]) {
        one_rail("one rail: UCX_NET_DEVICES is set");
        return 0;
    }
    if (topo_discover(kvxd.conf.peer_sysfs_root, &R.topo, KVX_WHY(twhy))) {
        if (kvxd.conf.peer_rails[0])
            return why_fail(why, KVX_ERR_INVALID, "peer.rails: %s", twhy);
        log_warn("peers: peer.topology: %s; one rail", twhy);
        one_rail("one rail: sysfs cannot be read");
        return 0;
    }
    int rc;
    if (kvxd.conf.peer_rails[0]) {
        if ((rc = rails_given(kvxd.conf.peer_rails, why)))
            return rc;
    } else {
        for (unsigned i = 0; i < R.topo.n_nic && R.n < RAILS_MAX; i++)
            if (R.topo.nic[i].rdma &&
                list_allows(kvxd.conf.peer_net_devices, R.topo.nic[i].name))
                R.nic[R.n++] = (int)i;
        if (R.n < 2) {
            /* one RDMA port or none: the main context's devices, as
             * before (they hold that port, if any) */
            int only = R.n ? R.nic[0] : listen_nic();
            one_rail(R.n ? "one rail: one RDMA port"
                         : "one rail: no RDMA port");
            R.nic[0] = only;
        } else {
            snprintf(R.topology, sizeof(R.topology), "auto");
        }
    }
    if ((rc = map_gpus(why)))
        return rc;
    if (R.n > 1) {
        char line[512] = "";
        for (unsigned r = 0; r < R.n; r++) {
            const topo_nic_t *x = &R.topo.nic[R.nic[r]];
            snprintf(line + strlen(line), sizeof(line) - strlen(line),
                     "%s%s (%s, numa %d)", r ? ", " : "", x->name,
                     x->pci.bdf[0] ? x->pci.bdf : "no PCI", x->pci.numa);
        }
        log_info("peers: rails %s", line);
    }
    return 0;
}

uint32_t peer_gpu_rails(const char *busid)
{
    return rails_count() > 1 ? rails_of_gpu(busid) : 0;
}

unsigned rails_count(void)
{
    return R.n ? R.n : 1;
}

const char *rails_nic(unsigned r)
{
    /* the one rail uses the main context, whatever NIC it names */
    return R.n > 1 && r < R.n ? R.topo.nic[R.nic[r]].name : "";
}

uint32_t rails_of_gpu(const char *busid)
{
    uint32_t all = (1u << rails_count()) - 1;
    char b[TOPO_BDF_LEN];
    if (!busid || topo_bdf_norm(busid, b))
        return all;
    for (unsigned g = 0; g < R.n_gpu; g++)
        if (!strcmp(R.gpu[g].bdf, b))
            return R.gpu[g].rails ? R.gpu[g].rails : all;
    return all;
}

unsigned rails_lanes_total(unsigned per_rail)
{
    unsigned n = rails_count();
    return per_rail * n < RAILS_MAX ? per_rail * n : RAILS_MAX;
}

uint32_t rails_lanes(uint32_t rails, unsigned n)
{
    uint32_t m = 0;
    for (unsigned i = 0; i < n && i < 32; i++)
        if (rails & (1u << (i % rails_count())))
            m |= 1u << i;
    return m;
}

unsigned rails_lane_next(uint32_t rails, unsigned n, unsigned *next)
{
    uint32_t m = rails ? rails_lanes(rails, n) : 0;
    unsigned i = (*next)++ % n;
    for (unsigned k = 0; m && !(m & (1u << i)) && k < n; k++)
        i = (*next)++ % n;
    return i;
}

/* Whether ctx has a transport on device nic (ucp_context_print_info's
 * resources: "... flags -- rc_verbs/mlx5_0:1", "tcp/eth1"). */
static int ctx_has(ucp_context_h ctx, const char *nic)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    int found = 0;
    if (!m)
        return 1; /* cannot tell: trust it */
    ucp_context_print_info(ctx, m);
    fclose(m);
    size_t nl = strlen(nic);
    for (char *p = buf; p && !found; p = strchr(p + 1, '/')) {
        if (*p != '/')
            continue;
        found = !strncmp(p + 1, nic, nl) &&
                (!p[nl + 1] || p[nl + 1] == '\n' || p[nl + 1] == ' ');
    }
    free(buf);
    return found;
}

int rails_open(ucp_config_t *cfg, const ucp_params_t *prm, unsigned n,
               ucp_context_h ctx[], kvx_why_t *why)
{
    for (unsigned i = 0; i < n; i++)
        ctx[i] = NULL;
    if (rails_count() < 2)
        return 0;
    for (unsigned r = 0; r < R.n && r < n; r++) {
        const char *nic = rails_nic(r);
        ucs_status_t st = ucp_config_modify(cfg, "NET_DEVICES", nic);
        if (st == UCS_OK)
            st = ucp_init(prm, cfg, &R.ctx[r]);
        if (st != UCS_OK) {
            R.ctx[r] = NULL;
            rails_close();
            return why_fail(why, KVX_ERR_IO, "rail %s: ucp_init: %s", nic,
                            ucs_status_string(st));
        }
        if (!ctx_has(R.ctx[r], nic)) {
            /* its lanes carry data as the loop's worker does, on every
             * device: slower, never lost */
            log_warn("peers: UCX has no transport on rail %s; its lanes "
                     "use the devices of the loop's worker",
                     nic);
            ucp_cleanup(R.ctx[r]);
            R.ctx[r] = NULL;
            snprintf(R.topology + strlen(R.topology),
                     sizeof(R.topology) - strlen(R.topology),
                     "; no UCX transport on %s", nic);
        }
    }
    for (unsigned i = 0; i < n; i++)
        ctx[i] = R.ctx[i % R.n];
    return 0;
}

void rails_close(void)
{
    for (unsigned r = 0; r < RAILS_MAX; r++)
        if (R.ctx[r]) {
            ucp_cleanup(R.ctx[r]);
            R.ctx[r] = NULL;
        }
}

void rails_started(unsigned n)
{
    for (unsigned r = 0; r < RAILS_MAX; r++)
        R.lanes[r] = 0;
    for (unsigned i = 0; i < n; i++)
        R.lanes[i % rails_count()]++;
}

void rails_ucx_info(Kvxfer__UcxInfo *info)
{
    if (!R.n) {
        info->topology = "";
        return;
    }
    info->topology = R.topology;
    for (unsigned r = 0; r < R.n; r++) {
        Kvxfer__RailInfo *x = &R.ri[r];
        kvxfer__rail_info__init(x);
        const topo_nic_t *n = R.nic[r] >= 0 ? &R.topo.nic[R.nic[r]] : NULL;
        x->nic = n ? (char *)n->name : kvxd.conf.peer_net_devices;
        x->pci = n ? (char *)n->pci.bdf : "";
        x->numa = n ? n->pci.numa : -1;
        x->lanes = R.lanes[r];
        R.rip[r] = x;
    }
    info->rails = R.rip;
    info->n_rails = R.n;
    for (unsigned g = 0; g < R.n_gpu; g++) {
        Kvxfer__GpuRails *x = &R.gi[g];
        kvxfer__gpu_rails__init(x);
        x->gpu = R.gpu[g].bdf;
        x->distance = (char *)R.gpu[g].how;
        x->rails = R.gnames[g];
        for (unsigned r = 0; r < R.n; r++)
            if (R.gpu[g].rails & (1u << r))
                R.gnames[g][x->n_rails++] = R.ri[r].nic;
        R.gip[g] = x;
    }
    info->gpu_rails = R.gip;
    info->n_gpu_rails = R.n_gpu;
}
