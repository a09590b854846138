/*
 * peer_init — UCX brought up (peer_init(): the context, the loop's
 * worker and its event fd on the loop, the devices UCX may use, the
 * handshake listener, this daemon's address) and down, and the one
 * place the loop's worker is progressed (pump()).
 */

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <uv.h>

#include "core/daemon.h"
#include "core/fault.h"
#include "core/log.h"
#include "peer_int.h"
#include "peer_rails.h"
#include "ucx.h"

/* ---- UCX on the loop --------------------------------------------------- */

/* One worker progress call at a time. Under load
 * ucp_worker_progress() always finds work, and one call can take a
 * millisecond (a TCP send of megabytes on loopback); draining it until it
 * returned 0 kept the loop in UCX while finished gathers and scatters
 * (copy.c's async), pulls and client requests waited, so slots cycled
 * slower and the wire idled. Between calls the loop handles the rest; an
 * idle handle keeps it turning while there is more. */
static void pump_idle(uv_idle_t *h);

static void idle_set(int on)
{
    if (on == P.idle_on)
        return;
    P.idle_on = on;
    if (on)
        uv_idle_start(&P.idle, pump_idle);
    else
        uv_idle_stop(&P.idle);
}

/* The one place the worker is progressed: one call at a time. Then, unless
 * there is more to do now (more progress, or busy polling while our
 * requests are in flight), the worker is armed and the loop may sleep on
 * its event fd. */
static void pump(void)
{
    if (!P.worker)
        return;
    if (ucp_worker_progress(P.worker)) {
        idle_set(1); /* more to do: come back next turn, after the rest */
        return;
    }
    if (P.busy_poll && P.inflight) {
        /* while transfers are in flight the loop does not sleep between
         * turns, as a busy UCX application would (an event-fd wake-up
         * per fragment costs bandwidth); idle, it sleeps: no spinning */
        idle_set(1);
        return;
    }
    idle_set(ucp_worker_arm(P.worker) == UCS_ERR_BUSY);
}

static void pump_idle(uv_idle_t *h)
{
    (void)h;
    pump();
}

static void on_poll(uv_poll_t *h, int status, int events)
{
    (void)h;
    (void)status;
    (void)events;
    pump();
}

/* Runs before the loop blocks: what the loop did this turn (sends,
 * receives) is progressed, and the worker armed unless pump() keeps the
 * loop turning, so no event is missed. (While the idle handle is on this
 * is a turn's second call.) */
static void on_prepare(uv_prepare_t *h)
{
    (void)h;
    pump();
}

/* ---- life -------------------------------------------------------------- */

static int set_handler(unsigned id, ucp_am_recv_callback_t cb)
{
    ucp_am_handler_param_t h = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                              UCP_AM_HANDLER_PARAM_FIELD_CB |
                                              UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
                                .id = id,
                                .cb = cb,
                                .flags = UCP_AM_FLAG_WHOLE_MSG};
    return ucp_worker_set_am_recv_handler(P.worker, &h) == UCS_OK ? 0
                                                                  : KVX_ERR_IO;
}

/* Wait (at most LISTEN_IF_WAIT_MS) until the interface that holds the
 * peer.listen IP is running (IFF_UP and IFF_RUNNING).
 *
 * Why: UCX (1.13) looks at the network interfaces once, in ucp_init, and
 * leaves out the ones that are not running. A link that was just set up
 * (a veth pair: the second end gets IFF_RUNNING from the kernel's link
 * watch up to a second after "ip link set up") is then missing from the
 * worker for good: it only has tcp on lo, and every connection to
 * another host fails with "Destination is unreachable". A daemon started
 * with its network (containers, namespaces, boot) hits that window, so
 * peer_init gives the interface a moment before bringing UCX up.
 * Loopback and wildcard listen addresses, and an IP no interface holds
 * (ucp_listener_create says so), do not wait. */
#define LISTEN_IF_WAIT_MS 3000

static int listen_if_state(const struct sockaddr_storage *ss, char *name,
                           size_t name_len)
{
    struct ifaddrs *all;
    int r = -1; /* -1: not found, wildcard or loopback; 0: down; 1: up */
    if (getifaddrs(&all))
        return -1;
    for (struct ifaddrs *i = all; i; i = i->ifa_next) {
        const struct sockaddr *a = i->ifa_addr;
        if (!a || a->sa_family != ss->ss_family)
            continue;
        int same;
        if (a->sa_family == AF_INET)
            same = !memcmp(&((const struct sockaddr_in *)a)->sin_addr,
                           &((const struct sockaddr_in *)ss)->sin_addr,
                           sizeof(struct in_addr));
        else if (a->sa_family == AF_INET6)
            same = !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                           &((const struct sockaddr_in6 *)ss)->sin6_addr,
                           sizeof(struct in6_addr));
        else
            continue;
        if (!same)
            continue;
        snprintf(name, name_len, "%s", i->ifa_name);
        if (!(i->ifa_flags & IFF_LOOPBACK))
            r = (i->ifa_flags & IFF_UP) && (i->ifa_flags & IFF_RUNNING);
        break;
    }
    freeifaddrs(all);
    return r;
}

static void listen_if_wait(void)
{
    char addr[sizeof(kvxd.conf.peer_listen) + 16], why[256], name[IFNAMSIZ];
    struct sockaddr_storage ss;
    socklen_t sl;
    snprintf(addr, sizeof(addr), "kvx://%s/x", kvxd.conf.peer_listen);
    if (parse_address(addr, &ss, &sl, KVX_WHY(why)))
        return; /* peer_init reports it */
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int up = listen_if_state(&ss, name, sizeof(name));
        if (up)
            return;
        clock_gettime(CLOCK_MONOTONIC, &t);
        long ms = (t.tv_sec - t0.tv_sec) * 1000L +
                  (t.tv_nsec - t0.tv_nsec) / 1000000L;
        if (ms >= LISTEN_IF_WAIT_MS) {
            log_warn("peers: interface %s of peer.listen %s is not running; "
                     "UCX will not use it until the daemon restarts",
                     name, kvxd.conf.peer_listen);
            return;
        }
        struct timespec d = {.tv_sec = 0, .tv_nsec = 10 * 1000000L};
        nanosleep(&d, NULL);
    }
}

/* Whether a UCX device list (UCX_NET_DEVICES's form: "dev" or
 * "dev:port", comma-separated; empty or "all": every device) names an
 * RDMA device of root (/sys/class/infiniband). */
static int list_has_rdma(const char *list, const char *root)
{
    DIR *d = opendir(root);
    if (!d)
        return 0;
    int any = !list[0], found = 0; /* or an entry "all", below */
    for (const char *p = list; !any && *p;) {
        size_t l = strcspn(p, ",");
        any = l == 3 && !strncmp(p, "all", 3);
        p += l + (p[l] == ',');
    }
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        size_t n = strlen(e->d_name);
        for (const char *p = list; !found && (any || *p);) {
            size_t l = strcspn(p, ",");
            found = any || ((l == n || (l > n && p[n] == ':')) &&
                            !strncmp(p, e->d_name, n));
            p += l + (p[l] == ',');
        }
    }
    closedir(d);
    return found;
}

/* The devices UCX may use (UCX_NET_DEVICES): peer.net_devices, or the
 * interface that holds peer.listen's IP and every RDMA device. Without
 * it UCX's TCP transport listens on every interface (the loop's worker's
 * and each lane's port), whatever peer.listen says. And the ports it
 * listens on (peer.ucx_ports). 0, or KVX_ERR_INVALID with why. */
static int ucx_devices(ucp_config_t *cfg, kvx_why_t *why)
{
    char list[512] = "", name[IFNAMSIZ] = "";
    if (getenv("UCX_NET_DEVICES")) {
        log_info("peers: UCX devices from the environment: "
                 "UCX_NET_DEVICES=%s",
                 getenv("UCX_NET_DEVICES"));
    } else if (kvxd.conf.peer_net_devices[0]) {
        snprintf(list, sizeof(list), "%s", kvxd.conf.peer_net_devices);
    } else {
        char addr[sizeof(kvxd.conf.peer_listen) + 16];
        struct sockaddr_storage ss;
        socklen_t sl;
        snprintf(addr, sizeof(addr), "kvx://%s/x", kvxd.conf.peer_listen);
        if (!parse_address(addr, &ss, &sl, why))
            listen_if_state(&ss, name, sizeof(name));
        if (name[0])
            snprintf(list, sizeof(list), "%s", name);
        /* RDMA devices carry no TCP listener: all of them, by port */
        DIR *d = opendir("/sys/class/infiniband");
        struct dirent *e;
        while (name[0] && d && (e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            char pdir[300];
            snprintf(pdir, sizeof(pdir), "/sys/class/infiniband/%s/ports",
                     e->d_name);
            DIR *pd = opendir(pdir);
            struct dirent *pe;
            while (pd && (pe = readdir(pd))) {
                size_t l = strlen(list);
                if (pe->d_name[0] != '.' &&
                    l + strlen(e->d_name) + strlen(pe->d_name) + 3 <
                        sizeof(list)) {
                    list[l++] = ',';
                    l += (size_t)sprintf(list + l, "%s", e->d_name);
                    list[l++] = ':';
                    strcpy(list + l, pe->d_name);
                }
            }
            if (pd)
                closedir(pd);
        }
        if (d)
            closedir(d);
        if (!name[0])
            log_warn("peers: no interface holds peer.listen's IP %s; UCX "
                     "may use every device",
                     kvxd.conf.peer_listen);
    }
    ucs_status_t st;
    if (list[0] && strcmp(list, "all") &&
        (st = ucp_config_modify(cfg, "NET_DEVICES", list)) != UCS_OK) {
        why_set(why, "peer.net_devices '%s': %s", list, ucs_status_string(st));
        return KVX_ERR_INVALID;
    }
    if (list[0])
        log_info("peers: UCX devices %s", list);
    const char *env = getenv("UCX_NET_DEVICES");
    P.rdma = list_has_rdma(env ? env : list, "/sys/class/infiniband");
    /* TCP segments: endpoints made from worker addresses in peer
     * error-handling mode get no RMA lanes over TCP in UCX 1.13 (those
     * made through its connection manager did), so rendezvous data goes
     * as active-message fragments; 8 KiB send and 64 KiB receive
     * segments cost a fifth of the bandwidth of 4 MiB slots on the GPU
     * host, 128 KiB and 512 KiB get it back (docs/benchmarks.md). UCX
     * 1.22 needs them as much (the H100 host, host pools: 5.7-6.8 GB/s
     * with them, 2.1-2.2 with UCX's own), so every version gets them.
     * The environment's values win. */
    if (!getenv("UCX_TCP_TX_SEG_SIZE"))
        setenv("UCX_TCP_TX_SEG_SIZE", "128k", 1);
    if (!getenv("UCX_TCP_RX_SEG_SIZE"))
        setenv("UCX_TCP_RX_SEG_SIZE", "512k", 1);
    /* a transport's setting: UCX reads it from the environment when the
     * workers open their interfaces (ucp_config_modify keeps it from
     * them in 1.13) */
    if (kvxd.conf.peer_ucx_ports[0] && !getenv("UCX_TCP_PORT_RANGE") &&
        setenv("UCX_TCP_PORT_RANGE", kvxd.conf.peer_ucx_ports, 1)) {
        why_set(why, "peer.ucx_ports '%s': %s", kvxd.conf.peer_ucx_ports,
                strerror(errno));
        return KVX_ERR_IO;
    }
    return 0;
}

/* FAULT_LANES: the address of a worker made and destroyed at once, so
 * that an endpoint to it gets no answer (a firewall that refuses). */
static int dead_address(kvx_why_t *why)
{
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucp_worker_h w;
    ucp_address_t *a;
    size_t len;
    if (ucp_worker_create(P.ctx, &wp, &w) != UCS_OK) {
        why_set(why, "fault lanes: ucp_worker_create failed");
        return KVX_ERR_IO;
    }
    int rc = 0;
    if (ucp_worker_get_address(w, &a, &len) != UCS_OK ||
        !(P.dead_addr = malloc(len))) {
        why_set(why, "fault lanes: no worker address");
        rc = KVX_ERR_IO;
    } else {
        memcpy(P.dead_addr, a, len);
        P.dead_len = len;
        ucp_worker_release_address(w, a);
    }
    ucp_worker_destroy(w);
    return rc;
}

int peer_init(kvx_why_t *why)
{
    if (!kvxd.conf.peer_listen[0])
        return 0;
    int rc = read_secret(why);
    if (rc)
        return rc;
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    snprintf(P.version, sizeof(P.version), "%u.%u.%u", maj, min, rel);
    listen_if_wait(); /* before ucp_init looks at the interfaces */
    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        why_set(why, "UCX configuration: %s", ucs_status_string(st));
        return KVX_ERR_IO;
    }
    if ((rc = ucx_devices(cfg, why)) || (rc = rails_init(why))) {
        ucp_config_release(cfg);
        return rc;
    }
    /* a unified-mode address leaves out the lengths ucx_addr_check()
     * walks a peer's address by: off, whatever the environment says */
    if (getenv("UCX_UNIFIED_MODE"))
        log_notice("peers: UCX_UNIFIED_MODE is ignored (peers' addresses "
                   "are checked, which needs UCX's non-unified format)");
    if ((st = ucp_config_modify(cfg, "UNIFIED_MODE", "n")) != UCS_OK) {
        why_set(why, "UCX configuration: UNIFIED_MODE: %s",
                ucs_status_string(st));
        ucp_config_release(cfg);
        return KVX_ERR_IO;
    }
    /* lanes: workers of this context on other threads */
    ucp_params_t prm = {.field_mask = UCP_PARAM_FIELD_FEATURES |
                                      UCP_PARAM_FIELD_NAME |
                                      UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                        .mt_workers_shared = kvxd.conf.lanes > 0,
                        .name = "kvxferd"};
    st = ucp_init(&prm, cfg, &P.ctx);
    if (st != UCS_OK) {
        ucp_config_release(cfg);
        why_set(why, "ucp_init: %s", ucs_status_string(st));
        return KVX_ERR_IO;
    }
    /* the rails' contexts, each on its NIC alone (none with one rail) */
    unsigned nlanes = rails_lanes_total(kvxd.conf.lanes);
    ucp_context_h rail_ctx[LANES_MAX];
    rc = rails_open(cfg, &prm, nlanes, rail_ctx, why);
    ucp_config_release(cfg);
    if (rc)
        goto err_ctx;
    ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    if (ucp_context_query(P.ctx, &ca) == UCS_OK)
        P.ucx_cuda = !!(ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((st = ucp_worker_create(P.ctx, &wp, &P.worker)) != UCS_OK) {
        why_set(why, "ucp_worker_create: %s", ucs_status_string(st));
        rc = KVX_ERR_IO;
        goto err_ctx;
    }
    int efd;
    if ((st = ucp_worker_get_efd(P.worker, &efd)) != UCS_OK) {
        why_set(why, "ucp_worker_get_efd: %s", ucs_status_string(st));
        rc = KVX_ERR_IO;
        goto err_worker;
    }
    if ((rc = set_handler(AM_CTRL, am_ctrl)) ||
        (rc = set_handler(AM_DATA, am_data))) {
        why_set(why, "cannot set the UCX message handlers");
        goto err_worker;
    }

    if ((st = ucp_worker_get_address(P.worker, &P.addr, &P.addr_len)) !=
        UCS_OK) {
        P.addr = NULL;
        why_set(why, "ucp_worker_get_address: %s", ucs_status_string(st));
        rc = KVX_ERR_IO;
        goto err_worker;
    }
    /* a UCX whose addresses the walk does not read (before 1.12, or a
     * format it does not know) would refuse every peer, one by one:
     * refused here, once, at start */
    char aw[200];
    if (ucx_addr_check((const uint8_t *)P.addr,
                       P.addr_len - (fault_armed(FAULT_OWN_ADDR) ? 1 : 0), NULL,
                       KVX_WHY(aw))) {
        why_set(why,
                "UCX %s: this daemon cannot read its own worker address "
                "(%s); peers need a UCX whose address format it knows "
                "(1.12 to 1.22)",
                P.version, aw);
        rc = KVX_ERR_UNSUPPORTED;
        goto err_worker;
    }
    if (fault_armed(FAULT_LANES) && (rc = dead_address(why)))
        goto err_worker;

    /* the handshake listener, on the configured IP:PORT: a socket of our
     * own, so that nothing reaches UCX before authentication */
    char addr[sizeof(kvxd.conf.peer_listen) + 16];
    snprintf(addr, sizeof(addr), "kvx://%s/x", kvxd.conf.peer_listen);
    struct sockaddr_storage ss;
    socklen_t sl;
    if ((rc = parse_address(addr, &ss, &sl, why))) {
        why_set(why, "peer.listen: '%s' is not IP:PORT", kvxd.conf.peer_listen);
        goto err_worker;
    }
    if ((rc = nets_init(&ss, why)))
        goto err_worker;
    struct sockaddr_storage bound;
    char lwhy[160];
    if ((rc = hs_listen(&ss, on_hs_accept, &bound, KVX_WHY(lwhy)))) {
        why_set(why, "peer.listen: cannot listen on %s: %s",
                kvxd.conf.peer_listen, lwhy);
        goto err_worker;
    }
    P.bound = bound;
    char ip[INET6_ADDRSTRLEN];
    unsigned port = bound.ss_family == AF_INET6
                        ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                        : ntohs(((struct sockaddr_in *)&bound)->sin_port);
    if (bound.ss_family == AF_INET6) {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&bound)->sin6_addr, ip,
                  sizeof(ip));
        snprintf(P.listen, sizeof(P.listen), "[%s]:%u", ip, port);
    } else {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&bound)->sin_addr, ip,
                  sizeof(ip));
        snprintf(P.listen, sizeof(P.listen), "%s:%u", ip, port);
    }
    /* the address: the listener, and the random incarnation id */
    const char *id = strrchr(kvxd.address, '/');
    char tail[32];
    snprintf(tail, sizeof(tail), "%s", id ? id : "/0");
    snprintf(kvxd.address, sizeof(kvxd.address), "kvx://%s%s", P.listen, tail);

    uv_poll_init(kvxd.loop, &P.poll, efd);
    uv_poll_start(&P.poll, UV_READABLE, on_poll);
    uv_prepare_init(kvxd.loop, &P.prepare);
    uv_prepare_start(&P.prepare, on_prepare);
    uv_idle_init(kvxd.loop, &P.idle);
    P.busy_poll =
        kvxd.conf.busy_poll == 2 ? kvxd_cpus() >= 4 : (int)kvxd.conf.busy_poll;
    lanes_conf_t lc = {.ctx = P.ctx,
                       .loop = kvxd.loop,
                       .ctxs = rail_ctx,
                       .n = nlanes,
                       .spin = P.busy_poll,
                       .ev = on_lane_event};
    if ((rc = lanes_start(&lc, why))) {
        uv_close((uv_handle_t *)&P.poll, NULL);
        uv_close((uv_handle_t *)&P.prepare, NULL);
        uv_close((uv_handle_t *)&P.idle, NULL);
        goto err_listener;
    }
    rails_started(lanes_count());
    P.poll_on = 1;
    P.on = 1;
    if (!ucx_tcp_guard_bound())
        log_warn("peers: the guard against UCX TCP's freed-endpoint bug is "
                 "not in effect (ucs_event_set_wait is bound elsewhere): a "
                 "link back after a peer was lost may crash the daemon");
    if (ucx_wireup_guard() < 0)
        log_warn("peers: the guard against UCX %s's abort on a peer lost "
                 "while connecting is not in effect (another build of "
                 "ucp_request_send_state_ff, or bound elsewhere): a peer "
                 "that exits then may crash the daemon; UCX 1.14 fixes it",
                 P.version);
    log_notice("peers: UCX %s listening on %s (CUDA memory %s by UCX), "
               "%u lanes",
               P.version, P.listen, P.ucx_cuda ? "supported" : "not supported",
               lanes_count());
    return 0;

err_listener:
    hs_stop();
err_worker:
    free(P.dead_addr);
    P.dead_addr = NULL;
    if (P.addr)
        ucp_worker_release_address(P.worker, P.addr);
    P.addr = NULL;
    ucp_worker_destroy(P.worker);
    P.worker = NULL;
err_ctx:
    rails_close();
    ucp_cleanup(P.ctx);
    P.ctx = NULL;
    return rc;
}

int peer_enabled(void)
{
    return P.on;
}

int peer_rdma(void)
{
    return P.rdma;
}

int peer_cuda(void)
{
    return P.on && P.ucx_cuda;
}

void *peer_mem_map(void *addr, size_t len, int cuda)
{
    if (!P.on || (cuda && !P.ucx_cuda))
        return NULL;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                      UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        .address = addr,
        .length = len,
        .memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST};
    ucp_mem_h h;
    return ucp_mem_map(P.ctx, &mp, &h) == UCS_OK ? h : NULL;
}

void peer_mem_unmap(void *memh)
{
    if (memh)
        ucp_mem_unmap(P.ctx, memh);
}

void peer_shutdown(void)
{
    if (!P.on)
        return;
    if (P.poll_on) {
        uv_poll_stop(&P.poll);
        uv_prepare_stop(&P.prepare);
        uv_idle_stop(&P.idle);
        P.idle_on = 0;
        uv_close((uv_handle_t *)&P.poll, NULL);
        uv_close((uv_handle_t *)&P.prepare, NULL);
        uv_close((uv_handle_t *)&P.idle, NULL);
    }
    hs_stop();
    free(P.dead_addr);
    P.dead_addr = NULL;
    if (P.addr)
        ucp_worker_release_address(P.worker, P.addr);
    P.addr = NULL;
    ucp_worker_destroy(P.worker);
    rails_close(); /* after the lanes' workers (peer_stop()) */
    ucp_cleanup(P.ctx);
    P.worker = NULL;
    P.on = 0;
}
