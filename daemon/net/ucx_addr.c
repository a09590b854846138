/*
 * ucx_addr — a worker address another daemon told: its walk
 * (ucx_addr_check()), what of it this worker can take (ucx_addr_fit()),
 * and the endpoint made to that (ucx_connect_addr()); see ucx_addr.h.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <ucs/algorithm/crc.h>

#include "core/log.h"
#include "ucx_addr.h"

/* ---- a worker address another daemon told ------------------------------
 *
 * ucp_ep_create() unpacks a worker address with no length and asserts on
 * what it does not expect (a version other than 1 or 2: "addr version
 * 15", SIGABRT); a length inside the address sends it past the end.
 * ucp_worker_address_query() reads the header only. So the address is
 * walked here first, field by field as the loaded UCX's
 * ucp_address_unpack() reads it (src/ucp/wireup/address.c; non-unified
 * mode, which peer.c sets, and the flags ucp_ep_create() unpacks with),
 * each length checked against what is left, and it must end exactly
 * where UCX would stop.
 *
 * UCX 1.12 to 1.22 read the same fields, with three differences, chosen
 * here by the version the loaded UCX reports (ucp_get_version(), once:
 * a_fmt_t): from 1.16 a version-2 header keeps UCX's release (its minor
 * version, modulo 16) in the high 4 bits of byte 0, and a version-1
 * address ends with an empty device whose MD byte says the release (UCX
 * reads both, and reads the fields around them as before); a version-1
 * device's MD index is the low 5 bits of its byte before 1.19 (0x20 and
 * 0x40 were flags) and the low 7 bits from 1.19, less those two bits
 * again for an address whose release is 18 or earlier (or not said:
 * ucp_address_adjust_unpacked_md_index()); and a namespace id
 * (ucs_sys_ns_t, inside transport addresses: ucx_addr_fit()) is 8 bytes
 * before 1.22 and 4 from 1.22. A UCX older than 1.12 is refused (a why
 * on every address); one newer than 1.22 is read as 1.22 (logged once),
 * and ucx_addr_fit() still refuses every address while this worker's own
 * does not walk.
 * Past UCX's own checks: indices UCX shifts into 64-bit maps (MD, device)
 * stay under 64, a worker address carries no endpoint addresses, and a
 * transport's overhead, bandwidth and latency are finite and its overhead
 * not negative (UCX asserts on a negative score made of them; found by
 * tests/fuzz/fuzz_peer_auth.c).
 *
 * A walk that ends right is not enough: what a transport reads inside its
 * own device and interface addresses depends on this worker (ucx_addr_fit()
 * below). */

#define A_V1 0
#define A_V2 1
#define A_FLAG_DEBUG 0x01u
#define A_FLAG_UUID 0x02u
#define A_FLAG_CLIENT 0x04u
#define A_FLAG_AM_ONLY 0x08u
#define A_LAST 0x80u
#define A_HAS_EP 0x40u
#define A_PATHS 0x40u
#define A_SYSDEV 0x20u
#define A_MD_EMPTY 0x80u
#define A_NULL 0xffu
#define A_MAX_RES 128     /* UCP_MAX_RESOURCES */
#define A_MAX_BITS 64     /* UCP_MD_INDEX_BITS, and the device maps' */
#define A_MD_LEGACY 0x60u /* UCP_ADDRESS_FLAG_MD_INDEX_LEGACY_BITS */
#define A_KNOWN_MIN 12    /* the UCX minor versions read here */
#define A_KNOWN_MAX 22

/* How the loaded UCX reads what differs between versions (above) */
typedef struct a_fmt {
    unsigned major, minor; /* the loaded UCX's */
    unsigned v1_md;        /* a version-1 device's MD index bits */
    int legacy_md;         /* 1.19 on: A_MD_LEGACY cleared from a v1
                              address's MD indices where its release <= 18 */
    size_t ns_len;         /* sizeof(ucs_sys_ns_t) */
} a_fmt_t;

/* Where the walk found each device and transport (byte offsets), for
 * ucx_addr_fit(): the one that keeps some transports and not others. */
typedef struct a_dev {
    size_t at, end; /* its MD byte(s) up to the end of its device address */
    size_t len_at;  /* its device-length byte (flags: LAST) */
    unsigned md;    /* its MD index (as read, before a legacy adjustment) */
    int empty;      /* no transports (UCP_ADDRESS_FLAG_MD_EMPTY_DEV) */
} a_dev_t;

typedef struct a_tl {
    size_t at, end; /* name checksum up to the end of its interface address */
    size_t len_at;  /* its interface-length byte (flags: LAST) */
    unsigned dev;
    uint16_t csum; /* the transport's name checksum (ucs_crc16_string) */
    size_t dev_at, dev_len, if_at, if_len;
} a_tl_t;

typedef struct a_map {
    size_t head; /* the header, id(s) and name: before the first device */
    unsigned ndev, ntl;
    a_dev_t dev[A_MAX_BITS];
    a_tl_t tl[A_MAX_RES];
} a_map_t;

typedef struct walk {
    const uint8_t *a;
    size_t len, at;
    kvx_why_t *why;
    a_map_t *m;
    const a_fmt_t *f;
} walk_t;

static a_fmt_t fmt_loaded;

/* The format of UCX major.minor */
static a_fmt_t fmt_for(unsigned major, unsigned minor)
{
    a_fmt_t f = {.major = major,
                 .minor = minor,
                 .v1_md = minor >= 19 ? 0x7f : 0x1f,
                 .legacy_md = minor >= 19,
                 .ns_len = minor >= 22 ? 4 : 8};
    return f;
}

static void fmt_once(void)
{
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    fmt_loaded = fmt_for(major, minor);
    if (major == 1 && minor > A_KNOWN_MAX)
        log_warn("peers: UCX %u.%u is newer than the worker address formats "
                 "this daemon knows (UCX 1.%d to 1.%d): peers' addresses "
                 "are read as UCX 1.%d's",
                 major, minor, A_KNOWN_MIN, A_KNOWN_MAX, A_KNOWN_MAX);
}

/* The loaded UCX's format; once, whichever thread walks first */
static const a_fmt_t *fmt(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, fmt_once);
    return &fmt_loaded;
}

/* ucp_address_unpack_release_version(): the release a 4-bit packed one
 * is, the nearest to the loaded UCX's minor version */
static unsigned release_of(unsigned packed, unsigned minor)
{
    int delta = (int)(minor % 16) - (int)packed;
    int base = (int)(minor / 16) + (delta >= 8) - (delta <= -8);
    return packed + (unsigned)(base > 0 ? base : 0) * 16;
}

static int w_bad(walk_t *w, const char *what)
{
    why_set(w->why, "%s at byte %zu of %zu", what, w->at, w->len);
    return -1;
}

/* n bytes at the cursor: 0 and *p, or -1 (past the end) */
static int w_take(walk_t *w, size_t n, const uint8_t **p, const char *what)
{
    if (w->len - w->at < n) {
        char m[96];
        snprintf(m, sizeof(m), "%s runs past the end", what);
        return w_bad(w, m);
    }
    if (p)
        *p = w->a + w->at;
    w->at += n;
    return 0;
}

/* ucp_address_unpack_byte_extended(): the bits of mask in one byte, or
 * (v2, all of them set) the next byte */
static int w_value(walk_t *w, int ver, unsigned mask, unsigned *v,
                   const char *what)
{
    const uint8_t *p;
    if (w_take(w, 1, &p, what))
        return -1;
    *v = *p & mask;
    if (ver == A_V2 && *v == mask) {
        if (w_take(w, 1, &p, what))
            return -1;
        *v = *p;
    }
    return 0;
}

/* A float of the v1 attributes: finite, and (min0) not negative or
 * (nonzero) not 0. UCX scores transports by 1e-3 / (latency + both
 * overheads + ...) and asserts the score is not negative (select.c:294):
 * a negative overhead, or a NaN, gets there. */
static int w_float(walk_t *w, const uint8_t *p, int min0, int nonzero,
                   const char *what)
{
    float f;
    memcpy(&f, p, sizeof(f));
    if (!isfinite(f) || (min0 && f < 0.0f) || (nonzero && f == 0.0f))
        return w_bad(w, what);
    return 0;
}

/* One interface (transport) of a device, into t; *last when it is the
 * device's last. */
static int w_iface(walk_t *w, int ver, a_tl_t *t, int *last)
{
    const uint8_t *p;
    unsigned ilen;
    t->at = w->at;
    if (w_take(w, 2, &p, "a transport's name checksum"))
        return -1;
    t->csum = (uint16_t)(p[0] | p[1] << 8); /* UCX packs it little-endian */
    if (ver == A_V1) { /* overhead, bandwidth, lat_ovh: float; prio|caps */
        size_t at = w->at;
        if (w_take(w, 16, &p, "a transport's attributes"))
            return -1;
        w->at = at;
        if (w_float(w, p, 1, 0,
                    "a transport's overhead is negative or "
                    "not finite") ||
            w_float(w, p + 4, 0, 1,
                    "a transport's bandwidth is 0 or not "
                    "finite") ||
            w_float(w, p + 8, 0, 0, "a transport's latency is not finite"))
            return -1;
        w->at += 16;
    } else { /* overhead, bandwidth, latency: 8-bit floats; prio, ... */
        if (w_take(w, 8, &p, "a transport's attributes"))
            return -1;
        for (int i = 0; i < 3; i++)
            if ((p[i] & 0x0f) == 0x0f) { /* the exponent of NaN, inf */
                w->at -= 8;
                return w_bad(w, "a transport's performance is not finite");
            }
    }
    if (w->at >= w->len)
        return w_bad(w, "a transport's address length runs past the end");
    uint8_t b = w->a[w->at];
    if (b & A_HAS_EP)
        return w_bad(w, "an endpoint address, which no worker's address "
                        "carries,");
    *last = !!(b & A_LAST);
    t->len_at = w->at;
    if (w_value(w, ver, 0x3f, &ilen, "a transport's address length"))
        return -1;
    t->if_at = w->at;
    t->if_len = ilen;
    if (w_take(w, ilen, NULL, "a transport's address"))
        return -1;
    t->end = w->at;
    return 0;
}

/* The header: version, flags, ids and name; 0 with w->at past them and
 * *ver, or -1. */
static int w_header(walk_t *w, int *ver, uint64_t *id)
{
    const uint8_t *a = w->a, *p;
    unsigned flags;
    *ver = a[0] & 0x0f;
    if (*ver == A_V1) {
        flags = a[0] >> 4;
        w->at = 1;
    } else if (*ver == A_V2) { /* high 4 bits: the release (1.16 on) */
        flags = a[1];
        w->at = 2;
    } else {
        why_set(w->why,
                "header byte 0x%02x: address version %d (UCX knows 0 and "
                "1)",
                a[0], *ver);
        return -1;
    }
    if (flags &
        ~(A_FLAG_DEBUG | A_FLAG_UUID | A_FLAG_CLIENT | A_FLAG_AM_ONLY)) {
        why_set(w->why, "header flags 0x%02x (UCX knows 0x0f)", flags);
        return -1;
    }
    *id = 0;
    if (*ver == A_V1 || (flags & A_FLAG_UUID)) {
        if (w_take(w, 8, &p, "the worker's id"))
            return -1;
        memcpy(id, p, 8);
    }
    if ((flags & A_FLAG_CLIENT) && w_take(w, 8, NULL, "the client id"))
        return -1;
    if (flags & A_FLAG_DEBUG) {
        if (w_take(w, 1, &p, "the worker's name") ||
            w_take(w, *p, NULL, "the worker's name"))
            return -1;
    }
    return 0;
}

/* One device and its transports, into w->m; *last when it is the last. */
static int w_device(walk_t *w, int ver, int *last)
{
    const uint8_t *a = w->a, *p;
    a_map_t *m = w->m;
    unsigned md, dlen;
    if (w->at >= w->len)
        return w_bad(w, "a device runs past the end");
    if (m->ndev >= A_MAX_BITS)
        return w_bad(w, "over 64 devices");
    a_dev_t *d = &m->dev[m->ndev];
    d->at = w->at;
    int empty = !!(a[w->at] & A_MD_EMPTY);
    if (w_value(w, ver, ver == A_V1 ? w->f->v1_md : 0x7f, &md,
                "a device's memory domain"))
        return -1;
    d->md = md; /* checked at the end (w_md()): a legacy address's */
    d->empty = empty;
    if (w->at >= w->len)
        return w_bad(w, "a device address length runs past the end");
    uint8_t df = a[w->at] & 0xe0;
    *last = !!(df & A_LAST);
    d->len_at = w->at;
    if (w_value(w, ver, 0x1f, &dlen, "a device address length"))
        return -1;
    if (df & A_PATHS) {
        if (w_take(w, 1, &p, "a device's path count"))
            return -1;
        if (!*p)
            return w_bad(w, "a device with 0 paths");
    }
    if ((df & A_SYSDEV) && w_take(w, 1, NULL, "a device's system id"))
        return -1;
    size_t dev_at = w->at;
    if (w_take(w, dlen, NULL, "a device address"))
        return -1;
    d->end = w->at;
    for (int last_tl = empty; !last_tl;) {
        if (m->ntl >= A_MAX_RES)
            return w_bad(w, "over 128 transports");
        a_tl_t *t = &m->tl[m->ntl];
        if (w_iface(w, ver, t, &last_tl))
            return -1;
        t->dev = m->ndev;
        t->dev_at = dev_at;
        t->dev_len = dlen;
        m->ntl++;
    }
    m->ndev++;
    return 0;
}

/* The MD indices of the devices with transports (UCX reads no other's)
 * as UCX takes them, each under 64: 0, or -1 naming the first that is not.
 * From 1.19 a version-1 address's indices lose A_MD_LEGACY where the
 * address's release, said by a last device that is empty, is 18 or
 * earlier, or is not said. */
static int w_md(walk_t *w, int ver)
{
    const a_map_t *m = w->m;
    const a_dev_t *last = &m->dev[m->ndev - 1];
    unsigned clear = 0;
    if (ver == A_V1 && w->f->legacy_md &&
        (!last->empty || release_of(last->md & 0x0f, w->f->minor) <= 18))
        clear = A_MD_LEGACY;
    for (unsigned i = 0; i < m->ndev; i++)
        if (!m->dev[i].empty && (m->dev[i].md & ~clear) >= A_MAX_BITS) {
            w->at = m->dev[i].at;
            return w_bad(w, "a memory domain index over 63");
        }
    return 0;
}

/* The walk of a..a+len into *m as UCX of format f reads it: 0 and where
 * the last device ended (m->head..), or -1 with why. */
static int addr_walk(const uint8_t *a, size_t len, uint64_t *uuid, a_map_t *m,
                     size_t *end, const a_fmt_t *f, kvx_why_t *why)
{
    walk_t w = {a, len, 0, why, m, f};
    int ver;
    uint64_t id;
    if (f->major != 1 || f->minor < A_KNOWN_MIN) {
        why_set(why,
                "UCX %u.%u, whose worker addresses this daemon cannot read "
                "(UCX 1.%d or later)",
                f->major, f->minor, A_KNOWN_MIN);
        return -1;
    }
    if (len < 2 || len > UCX_ADDR_MAX) {
        why_set(why, "%zu bytes (a worker address has 2 to %u)", len,
                UCX_ADDR_MAX);
        return -1;
    }
    m->ndev = m->ntl = 0;
    if (w_header(&w, &ver, &id))
        return -1;
    m->head = w.at;
    if (w.at < len && a[w.at] == A_NULL)
        return w_bad(&w, "no transports");
    for (int last_dev = 0; !last_dev;)
        if (w_device(&w, ver, &last_dev))
            return -1;
    if (w_md(&w, ver))
        return -1;
    if (uuid)
        *uuid = id;
    *end = w.at;
    return 0;
}

int ucx_addr_check(const uint8_t *a, size_t len, uint64_t *uuid, kvx_why_t *why)
{
    static __thread a_map_t m; /* 10 KiB: off the lanes' stacks */
    size_t end;
    uint64_t id;
    if (addr_walk(a, len, &id, &m, &end, fmt(), why))
        return -1;
    if (end != len) {
        why_set(why, "bytes after the last device at byte %zu of %zu", end,
                len);
        return -1;
    }
    if (uuid)
        *uuid = id;
    return 0;
}

/* ---- what this worker can take of it -------------------------------------
 *
 * UCX matches each transport of the address to this worker's by the
 * checksum of its name, and hands the ones that match, device and
 * interface addresses as pointers with no length, to that transport
 * (ucp_wireup_is_reachable(), then uct_ep_create()), which reads them as
 * its own. A real 186-byte address with one length byte changed (byte 29,
 * the first transport's interface length 0x88, to 0x1c) still walks
 * right: the first transport's address grows over the next device's
 * header, and TCP's entry lands on a device with no address. UCX passes
 * TCP a NULL device address and uct_tcp_iface_is_reachable() reads its
 * address family from it: SIGSEGV (tests/integration/t_attack.c,
 * attack_worker_address_one_byte; tests/unit/test_ucx.c).
 *
 * So a transport this worker has is kept only where its device and
 * interface addresses are the lengths of one of this worker's own of that
 * transport (its own address, ucp_worker_get_address(), says them), and
 * where the transport's own flags inside them make it read no more than
 * that: TCP (a loopback flag: the host id, and a namespace when the id
 * says one; else an IPv4 or IPv6 address by the family; its port), CMA
 * (a process-namespace flag: the namespace after the process id) and
 * POSIX shared memory (the same, in the segment id) are read as UCX 1.12
 * to 1.22 read them, a namespace being ucs_sys_ns_t's size in the loaded
 * UCX (a_fmt_t: 8 bytes, 4 from 1.22). TCP is kept by those rules alone
 * (its device addresses differ by interface: loopback, IPv4, IPv6).
 * Transports this worker does not have are kept as they are: UCX compares
 * the checksum first and passes them by; so are devices without
 * transports (from 1.16 the last one says the sender's release, by which
 * UCX 1.22 picks protocols and reads version-1 MD indices). What is left
 * over goes to UCX as a new address, the same bytes less what was left
 * out; none of this worker's transports left is "unreachable". */

#define TCP_LOOPBACK 0x01u       /* UCT_TCP_DEVICE_ADDR_FLAG_LOOPBACK */
#define LOCAL_NS_FLAG_BYTE 0x80u /* UCT_IFACE_LOCAL_ADDR_FLAG_NS, bit 63 */
#define CMA_PID_NS_BYTE 0x80u    /* UCT_CMA_IFACE_ADDR_FLAG_PID_NS, bit 31 */
#define POSIX_PID_NS_BYTE 0x10u  /* UCT_POSIX_SEG_FLAG_PID_NS, bit 60 */

/* TCP's device address: flags, family, then the host id (and namespace,
 * ns_len bytes) on loopback or the IP address; its interface address, the
 * port. */
static int tcp_fits(const uint8_t *dev, size_t dlen, size_t ilen, size_t ns_len,
                    kvx_why_t *why)
{
    size_t want;
    if (ilen != 2 || dlen < 2) {
        why_set(why,
                "a TCP transport with a %zu-byte device and %zu-byte port "
                "address (2 and 2 at least)",
                dlen, ilen);
        return 0;
    }
    if (dev[0] & TCP_LOOPBACK)
        want = dlen >= 10 && (dev[9] & LOCAL_NS_FLAG_BYTE) ? 10 + ns_len : 10;
    else if (dev[1] == AF_INET)
        want = 6;
    else if (dev[1] == AF_INET6)
        want = 18;
    else {
        why_set(why, "a TCP transport of address family %u", dev[1]);
        return 0;
    }
    if (dlen != want || (dev[0] & ~TCP_LOOPBACK)) {
        why_set(why,
                "a TCP device address of %zu bytes with flags 0x%02x and "
                "family %u (%zu bytes)",
                dlen, dev[0], dev[1], want);
        return 0;
    }
    return 1;
}

/* The checksums of the transports read here by name, and of those UCX
 * 1.13 has (for messages) */
static struct {
    uint16_t tcp, cma, posix;
} csum_of;

static const char *const tl_names[] = {
    "self",      "tcp",      "sysv",     "posix",     "cma",      "knem",
    "xpmem",     "rc_verbs", "rc_mlx5",  "dc_mlx5",   "ud_verbs", "ud_mlx5",
    "cuda_copy", "cuda_ipc", "gdr_copy", "rocm_copy", "rocm_ipc", "rocm_gdr"};
static uint16_t tl_csums[sizeof(tl_names) / sizeof(tl_names[0])];

static void csums_once(void)
{
    csum_of.tcp = ucs_crc16_string("tcp");
    csum_of.cma = ucs_crc16_string("cma");
    csum_of.posix = ucs_crc16_string("posix");
    for (size_t i = 0; i < sizeof(tl_names) / sizeof(tl_names[0]); i++)
        tl_csums[i] = ucs_crc16_string(tl_names[i]);
}

/* once, whichever thread (the loop's, a lane's) connects first */
static void csums_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, csums_once);
}

/* "transport tcp", or "transport 0x1234" for a name not known here */
static const char *tl_name(uint16_t csum, char *buf, size_t len)
{
    for (size_t i = 0; i < sizeof(tl_names) / sizeof(tl_names[0]); i++)
        if (tl_csums[i] == csum) {
            snprintf(buf, len, "transport %s", tl_names[i]);
            return buf;
        }
    snprintf(buf, len, "transport 0x%04x", csum);
    return buf;
}

/* Whether remote transport t (of address a) can go to this worker's
 * (own: the walk of its own address) in a UCX whose namespace ids are
 * ns_len bytes: 1, or 0 with why (left out). CMA's address with a
 * namespace is a process id (4 bytes) and the namespace, aligned to it
 * (ucs_cma_iface_ext_device_addr_t); POSIX's, the segment id (8 bytes)
 * and the namespace. */
static int tl_fits(const a_map_t *own, const uint8_t *a, const a_tl_t *t,
                   size_t ns_len, int *ours, kvx_why_t *why)
{
    const uint8_t *dev = a + t->dev_at, *ifa = a + t->if_at;
    int same = 0, lens = 0;
    for (unsigned i = 0; i < own->ntl; i++) {
        const a_tl_t *l = &own->tl[i];
        if (l->csum != t->csum)
            continue;
        same = 1;
        lens |= l->dev_len == t->dev_len && l->if_len == t->if_len;
    }
    *ours = same;
    if (!same)
        return 1; /* not this worker's: UCX passes it by */
    if (t->csum == csum_of.tcp)
        return tcp_fits(dev, t->dev_len, t->if_len, ns_len, why);
    if (!lens) {
        char nm[48];
        why_set(why,
                "%s with a %zu-byte device and %zu-byte interface address, "
                "unlike this worker's",
                tl_name(t->csum, nm, sizeof(nm)), t->dev_len, t->if_len);
        return 0;
    }
    int cma = t->csum == csum_of.cma;
    size_t ext = cma ? 2 * ns_len : 8 + ns_len;
    if ((cma && t->if_len >= 4 && (ifa[3] & CMA_PID_NS_BYTE) &&
         t->if_len < ext) ||
        (t->csum == csum_of.posix && t->if_len >= 8 &&
         (ifa[7] & POSIX_PID_NS_BYTE) && t->if_len < ext)) {
        why_set(why,
                "a %s interface address of %zu bytes that says a process "
                "namespace (%zu bytes)",
                cma ? "CMA" : "POSIX", t->if_len, ext);
        return 0;
    }
    return 1;
}

int ucx_addr_fit(ucp_worker_h w, const uint8_t *a, size_t len, uint8_t *out,
                 size_t *out_len, kvx_why_t *why)
{
    static __thread a_map_t in, own; /* 10 KiB each: off the lanes' stacks */
    size_t end, n = 0;
    ucp_address_t *oa;
    size_t olen;
    char first[160] = "";
    int kept = 0;
    const a_fmt_t *f = fmt();
    if (addr_walk(a, len, NULL, &in, &end, f, why))
        return -1;
    if (end != len) {
        why_set(why, "bytes after the last device at byte %zu of %zu", end,
                len);
        return -1;
    }
    csums_init();
    ucs_status_t st = ucp_worker_get_address(w, &oa, &olen);
    if (st != UCS_OK) {
        why_set(why, "this worker's own address: %s", ucs_status_string(st));
        return -1;
    }
    char d[128];
    int own_ok = !addr_walk((const uint8_t *)oa, olen, NULL, &own, &end, f,
                            KVX_WHY(d)) &&
                 end == olen;
    if (!own_ok) {
        ucp_worker_release_address(w, oa);
        why_set(why, "this worker's own address: %s", d);
        return -1;
    }
    memcpy(out, a, in.head);
    n = in.head;
    size_t last_dev = SIZE_MAX;
    for (unsigned di = 0; di < in.ndev; di++) {
        size_t dev_out = SIZE_MAX, last_tl = SIZE_MAX;
        const a_dev_t *dv = &in.dev[di];
        if (dv->empty) { /* as it is (the last one: the release) */
            memcpy(out + n, a + dv->at, dv->end - dv->at);
            last_dev = n + (dv->len_at - dv->at);
            out[last_dev] &= (uint8_t)~A_LAST;
            n += dv->end - dv->at;
            continue;
        }
        for (unsigned ti = 0; ti < in.ntl; ti++) {
            const a_tl_t *t = &in.tl[ti];
            int ours;
            if (t->dev != di)
                continue;
            if (!tl_fits(&own, a, t, f->ns_len, &ours, KVX_WHY(d))) {
                if (!first[0])
                    snprintf(first, sizeof(first), "%s", d);
                continue;
            }
            kept += ours;
            if (dev_out == SIZE_MAX) { /* the device, once */
                dev_out = n;
                memcpy(out + n, a + dv->at, dv->end - dv->at);
                out[n + (dv->len_at - dv->at)] &= (uint8_t)~A_LAST;
                n += dv->end - dv->at;
                last_dev = dev_out + (dv->len_at - dv->at);
            }
            last_tl = n + (t->len_at - t->at);
            memcpy(out + n, a + t->at, t->end - t->at);
            out[last_tl] &= (uint8_t)~A_LAST;
            n += t->end - t->at;
        }
        if (last_tl != SIZE_MAX)
            out[last_tl] |= A_LAST;
    }
    ucp_worker_release_address(w, oa);
    if (!kept) {
        why_set(why, "none of this worker's transports%s%s",
                first[0] ? ": " : "", first);
        return 0;
    }
    out[last_dev] |= A_LAST;
    *out_len = n;
    if (first[0])
        why_set(why, "left out %s", first);
    else
        why_set(why, "%s", "");
    return kept;
}

/* The endpoint, made to what ucx_addr_fit() keeps of addr[0..len), which
 * walks it (again: the handshake checked it) within len. */
ucs_status_t ucx_connect_addr(ucp_worker_h w, const uint8_t *addr, size_t len,
                              ucp_err_handler_cb_t err, void *arg, ucp_ep_h *ep)
{
    char why[256] = "";
    *ep = NULL;
    if (!len || len > UCX_ADDR_MAX)
        return UCS_ERR_INVALID_ADDR;
    uint8_t *use = malloc(len);
    size_t use_len;
    if (!use)
        return UCS_ERR_NO_MEMORY;
    int kept = ucx_addr_fit(w, addr, len, use, &use_len, KVX_WHY(why));
    if (kept <= 0) {
        log_warn("peers: a peer's UCX worker address: %s", why);
        free(use);
        return kept < 0 ? UCS_ERR_INVALID_ADDR : UCS_ERR_UNREACHABLE;
    }
    if (why[0])
        log_debug("peers: a peer's UCX worker address: %s", why);
    ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLER |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                         .address = (const ucp_address_t *)use,
                         .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                         .err_handler = {.cb = err, .arg = arg}};
    ucs_status_t st = ucp_ep_create(w, &p, ep);
    free(use); /* UCX keeps none of it (ucp_ep_create() frees its unpack) */
    if (st != UCS_OK)
        *ep = NULL;
    return st;
}
