/*
 * ucx — shared UCX endpoint calls; see ucx.h. Also a guard against a
 * UCX TCP bug (the end of this file).
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <string.h>
#include <ucs/sys/event_set.h>

#include "kvxfer.h"
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
