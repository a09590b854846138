/*
 * peer_addr — daemons' addresses (peer.h, peer_int.h): kvx://IP:PORT/ID
 * parsed, this daemon's listener under another spelling or an earlier
 * run's id told apart, and the cluster's networks (peer.allowed) that
 * dials and accepts must be inside.
 */

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>

#include "peer_int.h"

/* "kvx://IP:PORT/id": the IP:PORT part of a and b are the same (the id
 * changes when a daemon restarts; where it listens does not). */
int same_listener(const char *a, const char *b)
{
    const char *ea = strrchr(a, '/'), *eb = strrchr(b, '/');
    if (!ea || !eb || ea - a != eb - b)
        return 0;
    return !strncmp(a, b, (size_t)(ea - a));
}

/* a as IPv6 (an IPv4 address as its IPv4-mapped one) */
static struct sockaddr_in6 as_v6(const struct sockaddr_storage *a)
{
    struct sockaddr_in6 o = {.sin6_family = AF_INET6};
    if (a->ss_family == AF_INET6)
        return *(const struct sockaddr_in6 *)a;
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)a;
    o.sin6_port = v4->sin_port;
    o.sin6_addr.s6_addr[10] = o.sin6_addr.s6_addr[11] = 0xff;
    memcpy(&o.sin6_addr.s6_addr[12], &v4->sin_addr, 4);
    return o;
}

/* Do a and b name one IP:PORT, however spelt? */
int same_sockaddr(const struct sockaddr_storage *a,
                  const struct sockaddr_storage *b)
{
    struct sockaddr_in6 x = as_v6(a), y = as_v6(b);
    return x.sin6_port == y.sin6_port &&
           !memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr));
}

/* "kvx://IP:PORT/id" -> sockaddr. 0, or KVX_ERR_INVALID with why. */
int parse_address(const char *a, struct sockaddr_storage *ss, socklen_t *sl,
                  kvx_why_t *why)
{
    char host[128], port[16];
    const char *p = !strncmp(a, "kvx://", 6) ? a + 6 : NULL;
    const char *slash = p ? strchr(p, '/') : NULL;
    const char *colon = NULL;
    for (const char *q = p; q && q < slash; q++)
        if (*q == ':')
            colon = q;
    if (!p || !slash || !colon || colon - p >= (long)sizeof(host) ||
        slash - colon - 1 >= (long)sizeof(port) || slash == colon + 1) {
        why_set(why,
                "daemon '%s' has no peer listener (its peer.listen is "
                "empty, or the address is not kvx://IP:PORT/ID)",
                a);
        return KVX_ERR_INVALID;
    }
    memcpy(host, p, colon - p);
    host[colon - p] = 0;
    memcpy(port, colon + 1, slash - colon - 1);
    port[slash - colon - 1] = 0;
    if (host[0] == '[') { /* [v6]:port */
        memmove(host, host + 1, strlen(host));
        char *e = strchr(host, ']');
        if (e)
            *e = 0;
    }
    struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV,
                             .ai_socktype = SOCK_STREAM},
                    *res;
    int e = getaddrinfo(host, port, &hints, &res);
    if (e) {
        why_set(why, "daemon address '%s': %s", a, gai_strerror(e));
        return KVX_ERR_INVALID;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sl = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

/* ---- the cluster's networks (peer.allowed) ----------------------------- */

#define NETS_MAX 32

static struct {
    int family;
    uint8_t addr[16];
    unsigned bits;
} nets[NETS_MAX];
static unsigned nnets;
char nets_text[256];

static int net_add(int family, const void *addr, unsigned bits)
{
    if (nnets == NETS_MAX)
        return KVX_ERR_INVALID;
    nets[nnets].family = family;
    memcpy(nets[nnets].addr, addr, family == AF_INET ? 4 : 16);
    nets[nnets].bits = bits;
    nnets++;
    return 0;
}

/* peer.allowed (checked by the config), or the network of the interface
 * that holds peer.listen's IP. 0, or KVX_ERR_INVALID with why. */
int nets_init(const struct sockaddr_storage *listen, kvx_why_t *why)
{
    nnets = 0;
    if (kvxd.conf.peer_allowed[0]) {
        char buf[sizeof(kvxd.conf.peer_allowed)], *save = NULL;
        snprintf(buf, sizeof(buf), "%s", kvxd.conf.peer_allowed);
        for (char *t = strtok_r(buf, ",", &save); t;
             t = strtok_r(NULL, ",", &save)) {
            uint8_t a[16];
            int fam;
            unsigned bits;
            if (conf_net_parse(t, &fam, a, &bits))
                continue; /* the config checked it */
            if (net_add(fam, a, bits)) {
                why_set(why, "peer.allowed: more than %d networks", NETS_MAX);
                return KVX_ERR_INVALID;
            }
        }
        snprintf(nets_text, sizeof(nets_text), "%s", kvxd.conf.peer_allowed);
        return 0;
    }
    struct ifaddrs *all, *i;
    if (getifaddrs(&all)) {
        why_set(why, "getifaddrs: %s", strerror(errno));
        return KVX_ERR_IO;
    }
    for (i = all; i; i = i->ifa_next) {
        const struct sockaddr *a = i->ifa_addr, *m = i->ifa_netmask;
        if (!a || !m || a->sa_family != listen->ss_family)
            continue;
        const uint8_t *ab, *mb, *lb;
        size_t n = a->sa_family == AF_INET ? 4 : 16;
        if (a->sa_family == AF_INET) {
            ab = (const uint8_t *)&((const struct sockaddr_in *)a)->sin_addr;
            mb = (const uint8_t *)&((const struct sockaddr_in *)m)->sin_addr;
            lb = (const uint8_t *)&((const struct sockaddr_in *)listen)
                     ->sin_addr;
        } else if (a->sa_family == AF_INET6) {
            ab = (const uint8_t *)&((const struct sockaddr_in6 *)a)->sin6_addr;
            mb = (const uint8_t *)&((const struct sockaddr_in6 *)m)->sin6_addr;
            lb = (const uint8_t *)&((const struct sockaddr_in6 *)listen)
                     ->sin6_addr;
        } else {
            continue;
        }
        if (memcmp(ab, lb, n))
            continue;
        unsigned bits = 0;
        for (size_t k = 0; k < n; k++)
            bits += (unsigned)__builtin_popcount(mb[k]);
        net_add(a->sa_family, ab, bits);
        char ip[INET6_ADDRSTRLEN];
        inet_ntop(a->sa_family, ab, ip, sizeof(ip));
        snprintf(nets_text, sizeof(nets_text), "%s/%u (%s's network)", ip, bits,
                 i->ifa_name);
        break;
    }
    freeifaddrs(all);
    if (!nnets) {
        why_set(why,
                "peer.allowed is empty and no interface "
                "holds peer.listen's IP (%s): name the "
                "cluster's networks in peer.allowed",
                kvxd.conf.peer_listen);
        return KVX_ERR_INVALID;
    }
    return 0;
}

int net_allows(const struct sockaddr_storage *ss)
{
    const uint8_t *b =
        ss->ss_family == AF_INET
            ? (const uint8_t *)&((const struct sockaddr_in *)ss)->sin_addr
            : (const uint8_t *)&((const struct sockaddr_in6 *)ss)->sin6_addr;
    for (unsigned i = 0; i < nnets; i++) {
        if (nets[i].family != ss->ss_family)
            continue;
        unsigned bits = nets[i].bits, k = 0;
        for (; bits >= 8; bits -= 8, k++)
            if (b[k] != nets[i].addr[k])
                break;
        if (bits >= 8)
            continue;
        uint8_t mask = (uint8_t)(0xff00u >> bits);
        if (!bits || ((b[k] ^ nets[i].addr[k]) & mask) == 0)
            return 1;
    }
    return 0;
}

/* Without a peer listener an address is kvx://HOST/ID, and the first
 * half of ID names the daemon by its socket path (make_address()): the
 * same host and half with another second half is an earlier run. */
static int earlier_local(const char *address)
{
    const char *id = strrchr(address, '/'), *ours = strrchr(kvxd.address, '/');
    size_t half = ours ? strlen(ours + 1) / 2 : 0;
    return id && ours && half && id - address == ours - kvxd.address &&
           !strncmp(address, kvxd.address, (size_t)(ours - kvxd.address)) &&
           strlen(id + 1) == 2 * half && !strncmp(id + 1, ours + 1, half) &&
           strcmp(id, ours);
}

int peer_address_alias(const char *address, kvx_why_t *why)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    char w[8];
    if (!strcmp(address, kvxd.address))
        return 0;
    const char *id = strrchr(address, '/'), *ours = strrchr(kvxd.address, '/');
    if (!P.on) {
        if (!earlier_local(address))
            return 0;
        why_set(why,
                "daemon '%s' was issued by an earlier run of this daemon "
                "(its id was %s, this run is %s)",
                address, id + 1, ours + 1);
        return KVX_ERR_PEER_GONE;
    }
    if (parse_address(address, &ss, &sl, KVX_WHY(w)) ||
        !same_sockaddr(&ss, &P.bound))
        return 0;
    /* our listener, spelt otherwise or under another id: never a peer
     * (it would dial itself); by the id, an earlier run's */
    int earlier = !id || strcmp(id, ours);
    if (earlier)
        why_set(why,
                "daemon '%s' is this daemon's listener under another id, "
                "not dialled: issued by an earlier run of this daemon (its "
                "id was %s, this run is %s)",
                address, id ? id + 1 : "", ours + 1);
    else
        why_set(why,
                "daemon '%s' is this daemon, spelt otherwise (its address "
                "is '%s')",
                address, kvxd.address);
    return earlier ? KVX_ERR_PEER_GONE : KVX_ERR_INVALID;
}

int peer_address_check(const char *address, kvx_why_t *why)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    int rc;
    if (!strcmp(address, kvxd.address))
        return 0;
    if ((rc = peer_address_alias(address, why)))
        return rc;
    if (parse_address(address, &ss, &sl, why))
        return KVX_ERR_INVALID;
    if (P.on && !net_allows(&ss)) {
        why_set(why,
                "daemon '%s' is outside the cluster's "
                "networks (peer.allowed: %s): not dialled",
                address, nets_text);
        return KVX_ERR_INVALID;
    }
    return 0;
}
