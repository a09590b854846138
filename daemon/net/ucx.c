/*
 * ucx — shared UCX endpoint and listener calls; see ucx.h.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>

#include "kvxfer.h"
#include "ucx.h"

static socklen_t addr_len(const struct sockaddr_storage *ss)
{
    return ss->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                     : sizeof(struct sockaddr_in);
}

ucs_status_t ucx_connect(ucp_worker_h w, const struct sockaddr_storage *ss,
                         ucp_err_handler_cb_t err, void *arg, ucp_ep_h *ep)
{
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (const struct sockaddr *)ss,
                     .addrlen = addr_len(ss)},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = err, .arg = arg}};
    ucs_status_t st = ucp_ep_create(w, &p, ep);
    if (st != UCS_OK)
        *ep = NULL;
    return st;
}

ucs_status_t ucx_accept(ucp_worker_h w, ucp_conn_request_h req,
                        ucp_err_handler_cb_t err, void *arg, ucp_ep_h *ep)
{
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .conn_request = req,
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

uint16_t ucx_port(const struct sockaddr_storage *ss)
{
    return ss->ss_family == AF_INET6
               ? ntohs(((const struct sockaddr_in6 *)ss)->sin6_port)
               : ntohs(((const struct sockaddr_in *)ss)->sin_port);
}

int ucx_listen(ucp_worker_h w, const struct sockaddr_storage *ss,
               ucp_listener_conn_callback_t cb, void *arg,
               ucp_listener_h *lis, struct sockaddr_storage *bound,
               char *why, size_t why_len)
{
    ucp_listener_params_t p = {
        .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                      UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        .sockaddr = {.addr = (const struct sockaddr *)ss,
                     .addrlen = addr_len(ss)},
        .conn_handler = {.cb = cb, .arg = arg}};
    ucs_status_t st = ucp_listener_create(w, &p, lis);
    if (st != UCS_OK) {
        *lis = NULL;
        snprintf(why, why_len, "%s", ucs_status_string(st));
        return KVX_ERR_IO;
    }
    ucp_listener_attr_t a = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if ((st = ucp_listener_query(*lis, &a)) != UCS_OK) {
        snprintf(why, why_len, "ucp_listener_query: %s",
                 ucs_status_string(st));
        ucp_listener_destroy(*lis);
        *lis = NULL;
        return KVX_ERR_IO;
    }
    *bound = a.sockaddr;
    return 0;
}
