/*
 * ucx — shared UCX endpoint calls; see ucx.h.
 */
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
