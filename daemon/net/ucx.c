/*
 * ucx — shared UCX endpoint calls; see ucx.h. Also guards against two
 * UCX bugs (the end of this file): UCX TCP freeing an endpoint between
 * its receive and send progress, and UCX 1.12/1.13 aborting on a peer
 * lost while it wires up an endpoint. The check of a worker address
 * another daemon told, and the endpoint made to it, are in ucx_addr.c.
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucs/sys/event_set.h>

#include "core/log.h"
#include "kvxfer.h"
#include "ucx.h"

int ucx_close(ucp_ep_h ep, ucp_send_nbx_callback_t done, void *arg)
{
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
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
