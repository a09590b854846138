/*
 * ucx_closes — preloaded (LD_PRELOAD) into the daemons of the peer tests
 * that ask for it: a ucp_ep_close_nbx() on an endpoint the process has
 * closed already, with no ucp_ep_create() handing it back in between, is
 * reported on stderr (the daemon's log) and not passed on. A second
 * close destroys a UCX endpoint twice, which UCX does not notice once the
 * memory is reused. Only for tests that close their endpoints once, at
 * the end (an endpoint UCX makes for a peer's connection, never seen by
 * ucp_ep_create(), may reuse a closed one's memory).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucp/api/ucp.h>

#define CLOSED_MAX 4096

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static ucp_ep_h closed[CLOSED_MAX];
static int nclosed;

static void *real(const char *name)
{
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) {
        fprintf(stderr, "ucx_closes: %s not found\n", name);
        abort();
    }
    return f;
}

ucs_status_t ucp_ep_create(ucp_worker_h w, const ucp_ep_params_t *p,
                           ucp_ep_h *ep)
{
    static ucs_status_t (*f)(ucp_worker_h, const ucp_ep_params_t *, ucp_ep_h *);
    if (!f)
        f = real("ucp_ep_create");
    ucs_status_t st = f(w, p, ep);
    if (st == UCS_OK) {
        pthread_mutex_lock(&mu);
        for (int i = 0; i < nclosed; i++)
            if (closed[i] == *ep)
                closed[i] = closed[--nclosed];
        pthread_mutex_unlock(&mu);
    }
    return st;
}

ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *p)
{
    static ucs_status_ptr_t (*f)(ucp_ep_h, const ucp_request_param_t *);
    if (!f)
        f = real("ucp_ep_close_nbx");
    int twice = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nclosed && !twice; i++)
        twice = closed[i] == ep;
    if (!twice && nclosed < CLOSED_MAX)
        closed[nclosed++] = ep;
    pthread_mutex_unlock(&mu);
    if (twice) {
        fprintf(stderr, "ucx_closes: endpoint %p closed twice\n", (void *)ep);
        return UCS_STATUS_PTR(UCS_ERR_NOT_CONNECTED);
    }
    return f(ep, p);
}
