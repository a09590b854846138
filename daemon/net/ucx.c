/*
 * ucx — shared UCX endpoint calls; see ucx.h. Also guards against two
 * UCX bugs (the end of this file): UCX TCP freeing an endpoint between
 * its receive and send progress, and UCX 1.12/1.13 aborting on a peer
 * lost while it wires up an endpoint.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <ucs/sys/event_set.h>

#include "kvxfer.h"
#include "log.h"
#include "ucx.h"

ucs_status_t ucx_connect_addr(ucp_worker_h w, const uint8_t *addr,
                              ucp_err_handler_cb_t err, void *arg, ucp_ep_h *ep)
{
    ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLER |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                         .address = (const ucp_address_t *)addr,
                         .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                         .err_handler = {.cb = err, .arg = arg}};
    ucs_status_t st = ucp_ep_create(w, &p, ep);
    if (st != UCS_OK)
        *ep = NULL;
    return st;
}

/* ---- a worker address another daemon told ------------------------------
 *
 * ucp_ep_create() unpacks a worker address with no length and asserts on
 * what it does not expect (a version other than 1 or 2: "addr version
 * 15", SIGABRT); a length inside the address sends it past the end.
 * ucp_worker_address_query() reads the header only. So the address is
 * walked here first, field by field as UCX 1.13's ucp_address_unpack()
 * reads it (src/ucp/wireup/address.c; non-unified mode, which peer.c
 * sets, and the flags ucp_ep_create() unpacks with), each length checked
 * against what is left, and it must end exactly where UCX would stop.
 * Past UCX's own checks: indices UCX shifts into 64-bit maps (MD, device)
 * stay under 64, a worker address carries no endpoint addresses, and a
 * transport's overhead, bandwidth and latency are finite and its overhead
 * not negative (UCX asserts on a negative score made of them; found by
 * tests/fuzz/fuzz_peer_auth.c). What a transport reads inside its own
 * device and interface addresses is not checked here. */

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
#define A_MAX_RES 128 /* UCP_MAX_RESOURCES */
#define A_MAX_BITS 64 /* UCP_MD_INDEX_BITS, and the device maps' */

typedef struct walk {
    const uint8_t *a;
    size_t len, at;
    char *why;
    size_t why_len;
} walk_t;

static int w_bad(walk_t *w, const char *what)
{
    snprintf(w->why, w->why_len, "%s at byte %zu of %zu", what, w->at, w->len);
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

/* One interface (transport) of a device; *last when it is the device's
 * last. */
static int w_iface(walk_t *w, int ver, int *last)
{
    const uint8_t *p;
    unsigned ilen;
    if (w_take(w, 2, NULL, "a transport's name checksum"))
        return -1;
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
    if (w_value(w, ver, 0x3f, &ilen, "a transport's address length") ||
        w_take(w, ilen, NULL, "a transport's address"))
        return -1;
    return 0;
}

int ucx_addr_check(const uint8_t *a, size_t len, uint64_t *uuid, char *why,
                   size_t why_len)
{
    walk_t w = {a, len, 0, why, why_len};
    const uint8_t *p;
    if (len < 2 || len > UCX_ADDR_MAX) {
        snprintf(why, why_len, "%zu bytes (a worker address has 2 to %u)", len,
                 UCX_ADDR_MAX);
        return -1;
    }
    int ver = a[0] & 0x0f;
    unsigned flags;
    if (ver == A_V1) {
        flags = a[0] >> 4;
        w.at = 1;
    } else if (ver == A_V2 && !(a[0] >> 4)) {
        flags = a[1];
        w.at = 2;
    } else {
        snprintf(why, why_len,
                 "header byte 0x%02x: address version %d (UCX knows 0 and "
                 "1)",
                 a[0], ver);
        return -1;
    }
    if (flags &
        ~(A_FLAG_DEBUG | A_FLAG_UUID | A_FLAG_CLIENT | A_FLAG_AM_ONLY)) {
        snprintf(why, why_len, "header flags 0x%02x (UCX knows 0x0f)", flags);
        return -1;
    }
    uint64_t id = 0;
    if (ver == A_V1 || (flags & A_FLAG_UUID)) {
        if (w_take(&w, 8, &p, "the worker's id"))
            return -1;
        memcpy(&id, p, 8);
    }
    if ((flags & A_FLAG_CLIENT) && w_take(&w, 8, NULL, "the client id"))
        return -1;
    if (flags & A_FLAG_DEBUG) {
        if (w_take(&w, 1, &p, "the worker's name") ||
            w_take(&w, *p, NULL, "the worker's name"))
            return -1;
    }
    if (w.at < len && a[w.at] == A_NULL)
        return w_bad(&w, "no transports");
    unsigned devs = 0, ifaces = 0;
    for (int last_dev = 0; !last_dev;) {
        unsigned md, dlen;
        if (w.at >= len)
            return w_bad(&w, "a device runs past the end");
        int empty = !!(a[w.at] & A_MD_EMPTY);
        if (w_value(&w, ver, ver == A_V1 ? 0x1f : 0x7f, &md,
                    "a device's memory domain"))
            return -1;
        if (md >= A_MAX_BITS)
            return w_bad(&w, "a memory domain index over 63");
        if (++devs > A_MAX_BITS)
            return w_bad(&w, "over 64 devices");
        if (w.at >= len)
            return w_bad(&w, "a device address length runs past the end");
        uint8_t df = a[w.at] & 0xe0;
        last_dev = !!(df & A_LAST);
        if (w_value(&w, ver, 0x1f, &dlen, "a device address length"))
            return -1;
        if (df & A_PATHS) {
            if (w_take(&w, 1, &p, "a device's path count"))
                return -1;
            if (!*p)
                return w_bad(&w, "a device with 0 paths");
        }
        if ((df & A_SYSDEV) && w_take(&w, 1, NULL, "a device's system id"))
            return -1;
        if (w_take(&w, dlen, NULL, "a device address"))
            return -1;
        for (int last_tl = empty; !last_tl;) {
            if (++ifaces > A_MAX_RES)
                return w_bad(&w, "over 128 transports");
            if (w_iface(&w, ver, &last_tl))
                return -1;
        }
    }
    if (w.at != len)
        return w_bad(&w, "bytes after the last device");
    if (uuid)
        *uuid = id;
    return 0;
}

int ucx_close(ucp_ep_h ep, ucp_send_nbx_callback_t done, void *arg)
{
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = done,
        .user_data = arg,
        .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    return r != NULL && !UCS_PTR_IS_ERR(r);
}

/* ---- UCX's TCP transport and an endpoint freed under its feet ----------
 *
 * uct_tcp_iface_handle_events() (UCX 1.13.1; upstream unchanged as of
 * 2026) runs an endpoint's receive progress, then its send progress, for
 * one epoll event that holds both. A connection-finish packet that
 * arrives for an endpoint left only receiving destroys that endpoint
 * inside the receive progress; the send progress then reads the freed
 * endpoint and calls through what is left of it: SIGSEGV in libuct. An
 * endpoint lingers that way once closed while its socket, shared by both
 * directions, still had bytes queued (its own finish packet waits behind
 * them): a link down longer than peer.keepalive_timeout_ms, with data in
 * flight, that comes back after both daemons gave each other up is the
 * case (peer_link_down_mid_transfer, about 1% of runs on a loaded 2-CPU
 * machine before this; scripts/stress-peer-lost.sh).
 *
 * So ucs_event_set_wait() is interposed (the daemon's own definition is
 * the one libuct binds to): for a handler in libuct, whose descriptors
 * are all level-triggered, an event with both read and write is handed on
 * as read alone. The write readiness comes back at the next wait, by when
 * a destroyed endpoint's descriptor has left the set. Every other caller
 * (UCS's async thread, whose descriptors may be edge-triggered, where a
 * dropped edge would be lost) passes through unchanged. */
typedef ucs_status_t (*wait_fn)(ucs_sys_event_set_t *, unsigned *, int,
                                ucs_event_set_handler_t, void *);

typedef struct read_first {
    ucs_event_set_handler_t handler;
    void *arg;
} read_first_t;

static void read_first(void *data, ucs_event_set_types_t events, void *arg)
{
    read_first_t *r = arg;
    if ((events & UCS_EVENT_SET_EVREAD) && (events & UCS_EVENT_SET_EVWRITE))
        events &= ~(ucs_event_set_types_t)UCS_EVENT_SET_EVWRITE;
    r->handler(data, events, r->arg);
}

/* 1 when handler is libuct's (the TCP transport's); the answers for the
 * two handlers UCX passes are kept, dladdr() asked once for each */
static int in_libuct(ucs_event_set_handler_t handler)
{
    static _Atomic(ucs_event_set_handler_t) yes, no;
    if (handler == atomic_load(&yes))
        return 1;
    if (handler == atomic_load(&no))
        return 0;
    Dl_info info;
    int uct = dladdr((void *)handler, &info) && info.dli_fname &&
              strstr(info.dli_fname, "libuct.") != NULL;
    atomic_store(uct ? &yes : &no, handler);
    return uct;
}

ucs_status_t ucs_event_set_wait(ucs_sys_event_set_t *set, unsigned *num_events,
                                int timeout_ms, ucs_event_set_handler_t handler,
                                void *arg)
{
    static _Atomic(wait_fn) real;
    wait_fn f = atomic_load(&real);
    if (!f) {
        f = (wait_fn)dlsym(RTLD_NEXT, "ucs_event_set_wait");
        if (!f)
            return UCS_ERR_UNSUPPORTED; /* no libucs: nothing calls this */
        atomic_store(&real, f);
    }
    if (!in_libuct(handler))
        return f(set, num_events, timeout_ms, handler, arg);
    read_first_t r = {handler, arg};
    return f(set, num_events, timeout_ms, read_first, &r);
}

int ucx_tcp_guard_bound(void)
{
    return dlsym(RTLD_DEFAULT, "ucs_event_set_wait") ==
           (void *)ucs_event_set_wait;
}

/* ---- UCX 1.12/1.13 and a peer lost while an endpoint wires up ----------
 *
 * A daemon that connects to us makes an endpoint to our worker; its
 * wire-up REQUEST makes UCX make one here, which answers with a REPLY on
 * a TCP connection of its own back to that daemon's worker. Until that
 * connection is accepted, the REPLY waits in the TCP endpoint's pending
 * queue. If the other daemon exits (drained, killed) just then, UCX's
 * reconnect is refused ("connect(...) failed: Connection refused"), the
 * endpoint fails, and its pending queue is purged through
 * ucp_request_send_state_ff(), which in UCX 1.12 and 1.13 asserts that a
 * wire-up message found there is an ACK, EP_CHECK or EP_REMOVED:
 * "Assertion ... failed: req ... got REP message", SIGABRT. The
 * generation daemon stopped or killed right after its first fetch
 * (peer_gen_lost_while_connecting) took the context daemon down in about
 * 3 runs in 8. UCX 1.14.0 removed the assertion (openucx/ucx commit
 * 9ccaf31bb6, "UCP/CORE: Remove assertion for checking WIREUP_MSGs when
 * purging", PR #8175); the code after it, the same in 1.13 and later,
 * frees the message and its request, which is all a purge of one needs.
 *
 * So ucp_request_send_state_ff() is interposed (libucp calls it through
 * its PLT; the daemon's definition is the one bound): a wire-up message
 * of a type the assertion refuses is relabelled ACK before UCX's own
 * function runs, which then takes the branch 1.14 takes. The request is
 * UCX's internal ucp_request_t; the two offsets (send.uct.func,
 * send.wireup.type) are the 1.13.1 build's, and are trusted only where
 * the installed libucp's own function reads those two fields for this
 * test (its machine code, looked at once: wireup_layout_ok()), on UCX
 * 1.12 or 1.13, and only for a request whose pending function is UCX's
 * own ucp_wireup_msg_progress. Anything else passes through untouched,
 * and the daemon warns at start that the guard is off. */
#define REQ_UCT_FUNC 0xe0    /* ucp_request_t.send.uct.func */
#define REQ_WIREUP_TYPE 0xa8 /* ucp_request_t.send.wireup.type (uint8_t) */
#define FF_SCAN 0x200        /* bytes of UCX's function looked at */
enum { WIREUP_PRE_REQUEST, WIREUP_REQUEST, WIREUP_REPLY, WIREUP_ACK };

/* Whether f, UCX's ucp_request_send_state_ff(), compares the pending
 * function at REQ_UCT_FUNC and tests the wire-up type at REQ_WIREUP_TYPE
 * as the 1.13.1 build does: "mov 0xe0(%rbx),%rax", and "movzbl
 * 0xa8(%rbx),%eax; lea -0x3(%rax),%edx; cmp $0x2,%dl" (type - ACK > 2:
 * the assertion). */
static int wireup_layout_ok(const uint8_t *f)
{
    static const uint8_t func_at[] = {0x48, 0x8b, 0x83, REQ_UCT_FUNC, 0, 0, 0};
    static const uint8_t type_at[] = {
        0x0f, 0xb6, 0x83, REQ_WIREUP_TYPE, 0, 0, 0, 0x8d, 0x50, 0xfd,
        0x80, 0xfa, 0x02};
    int fa = 0, ta = 0;
    for (size_t i = 0; i + sizeof(type_at) <= FF_SCAN; i++) {
        fa |= !memcmp(f + i, func_at, sizeof(func_at));
        ta |= !memcmp(f + i, type_at, sizeof(type_at));
    }
    return fa && ta;
}

typedef void (*ff_fn)(void *req, ucs_status_t status);

static struct {
    _Atomic(ff_fn) real;
    _Atomic(void *) progress; /* ucp_wireup_msg_progress */
    atomic_int on;            /* GUARD_*: wireup_guard_state() */
    atomic_ullong relabelled;
    atomic_ullong logged_ms;
} W;

/* Resolved once: GUARD_ON when this UCX has the assertion and the
 * layout the guard knows; GUARD_UNNEEDED for a UCX without the assertion;
 * GUARD_UNKNOWN for one with it and another layout. */
enum { GUARD_UNRESOLVED, GUARD_ON, GUARD_UNNEEDED, GUARD_UNKNOWN };

static int wireup_guard_state(void)
{
    int on = atomic_load(&W.on);
    if (on != GUARD_UNRESOLVED)
        return on;
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    void *prog = dlsym(RTLD_DEFAULT, "ucp_wireup_msg_progress");
    const uint8_t *ff = dlsym(RTLD_NEXT, "ucp_request_send_state_ff");
    atomic_store(&W.progress, prog);
    if (maj != 1 || (min != 12 && min != 13))
        on = GUARD_UNNEEDED;
    else if (prog && ff && wireup_layout_ok(ff))
        on = GUARD_ON;
    else
        on = GUARD_UNKNOWN;
    atomic_store(&W.on, on);
    return on;
}

/* 1 when req is a wire-up message the 1.12/1.13 assertion refuses, now
 * labelled ACK; 0 when it is left as it was. */
static int wireup_relabel(void *req)
{
    if (wireup_guard_state() != GUARD_ON)
        return 0;
    void *func;
    memcpy(&func, (uint8_t *)req + REQ_UCT_FUNC, sizeof(func));
    if (func != atomic_load(&W.progress))
        return 0;
    uint8_t *type = (uint8_t *)req + REQ_WIREUP_TYPE;
    if (*type > WIREUP_REPLY)
        return 0;
    *type = WIREUP_ACK;
    return 1;
}

/* Counted, and logged at most once a second (a peer that keeps
 * connecting and dying could otherwise fill the log). On whichever thread
 * runs that worker's progress: the loop's or a lane's. */
static void wireup_relabelled(void)
{
    unsigned long long n = atomic_fetch_add(&W.relabelled, 1) + 1;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    unsigned long long ms = (unsigned long long)t.tv_sec * 1000 +
                            (unsigned long long)t.tv_nsec / 1000000 + 1;
    unsigned long long last = atomic_load(&W.logged_ms);
    if ((!last || ms >= last + 1000) &&
        atomic_compare_exchange_strong(&W.logged_ms, &last, ms))
        log_warn("peers: a peer was lost while UCX wired up an endpoint "
                 "with it; UCX's unsent wire-up message is freed (UCX "
                 "before 1.14 would abort here; %llu so far)",
                 n);
}

void ucp_request_send_state_ff(void *req, ucs_status_t status)
{
    ff_fn f = atomic_load(&W.real);
    if (!f) {
        f = (ff_fn)dlsym(RTLD_NEXT, "ucp_request_send_state_ff");
        if (!f)
            return; /* no libucp: nothing calls this */
        atomic_store(&W.real, f);
    }
    if (wireup_relabel(req))
        wireup_relabelled();
    f(req, status);
}

int ucx_wireup_guard(void)
{
    int st = wireup_guard_state();
    if (st == GUARD_UNNEEDED)
        return 0;
    return st == GUARD_ON && dlsym(RTLD_DEFAULT, "ucp_request_send_state_ff") ==
                                 (void *)ucp_request_send_state_ff
               ? 1
               : -1;
}

unsigned long long ucx_wireup_relabelled(void)
{
    return atomic_load(&W.relabelled);
}
