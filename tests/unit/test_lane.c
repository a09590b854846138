/*
 * test_lane — what a lane does with a message that arrives while it
 * stops (daemon/net/lane.c, on_data()): its endpoints are closing or
 * gone, the other daemon is still sending. Before 2026-12-06 a message
 * on an endpoint the lane no longer (or never) knew read a NULL endpoint
 * there: a generation daemon drained mid-transfer died of SIGSEGV. And
 * what a running lane keeps of the endpoint UCX made for a sender: it
 * adopted it until 2026-12-06, then closed it after UCX had destroyed it
 * (a use after free); now only a receive in flight on it counts it.
 */
#include "../../daemon/net/lane.c"

#include "tests/test.h"

static lane_t *stopping_lane(void)
{
    static lane_t ln;
    memset(&ln, 0, sizeof(ln));
    list_init(&ln.eps);
    list_init(&ln.rxs);
    list_init(&ln.cmds);
    ln.stopping = 1;
    return &ln;
}

/* a rendezvous on an endpoint the lane does not know: dropped (UCX
 * releases it), nothing accepted */
TEST(stopping_lane_drops_data_from_an_unknown_endpoint)
{
    lane_t *ln = stopping_lane();
    ucp_am_recv_param_t prm = {.recv_attr = UCP_AM_RECV_ATTR_FIELD_REPLY_EP |
                                            UCP_AM_RECV_ATTR_FLAG_RNDV,
                               .reply_ep = (ucp_ep_h)(uintptr_t)0x1000};
    uint8_t hdr[16] = {0};
    CHECK_EQ(on_data(ln, hdr, sizeof(hdr), NULL, 4096, &prm), UCS_OK);
    CHECK(list_empty(&ln->eps));
    prm.recv_attr = UCP_AM_RECV_ATTR_FIELD_REPLY_EP; /* eager: the same */
    CHECK_EQ(on_data(ln, hdr, sizeof(hdr), hdr, 8, &prm), UCS_OK);
    CHECK(list_empty(&ln->eps));
}

/* a running lane: the message goes to the loop with the endpoint it
 * came on as an opaque token, and the lane adopts nothing */
TEST(running_lane_adopts_no_endpoint_of_a_sender)
{
    lane_t *ln = stopping_lane();
    ln->stopping = 0;
    uv_loop_t loop;
    CHECK_EQ(uv_loop_init(&loop), 0);
    CHECK_EQ(uv_async_init(&loop, &L.async, on_async), 0);
    pthread_mutex_init(&L.mu, NULL);
    list_init(&L.evq);
    ucp_am_recv_param_t prm = {.recv_attr = UCP_AM_RECV_ATTR_FIELD_REPLY_EP |
                                            UCP_AM_RECV_ATTR_FLAG_RNDV,
                               .reply_ep = (ucp_ep_h)(uintptr_t)0x3000};
    uint8_t hdr[16] = {1, 2, 3};
    void *desc = (void *)(uintptr_t)0x4000;
    CHECK_EQ(on_data(ln, hdr, sizeof(hdr), desc, 4096, &prm), UCS_INPROGRESS);
    CHECK(list_empty(&ln->eps));
    CHECK(list_empty(&ln->rxs));
    list_t evs;
    ev_take(&evs);
    list_t *n = list_pop(&evs);
    CHECK(n != NULL);
    lane_ev_t *e = EV(n);
    CHECK_EQ(e->kind, LEV_ARRIVED);
    CHECK_EQ(e->lep, 0u);
    CHECK(e->from == prm.reply_ep);
    CHECK(e->desc == desc);
    CHECK_EQ(e->len, 4096u);
    CHECK_EQ(e->hlen, sizeof(hdr));
    CHECK_EQ(e->hdr[2], 3);
    CHECK(list_pop(&evs) == NULL);
    ev_free(e);
    uv_close((uv_handle_t *)&L.async, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
}

/* receives on one sender's endpoint share one record, which goes with
 * the last of them: nothing of the endpoint is kept after */
TEST(a_senders_endpoint_is_kept_only_while_receives_are_on_it)
{
    lane_t *ln = stopping_lane();
    ucp_ep_h ep = (ucp_ep_h)(uintptr_t)0x5000;
    rx_t *a = rx_get(ln, ep, 42), *b = rx_get(ln, ep, 42);
    CHECK(a != NULL);
    CHECK(a == b);
    CHECK_EQ(a->group, 42u);
    a->n = 2;
    rx_t *c = rx_get(ln, (ucp_ep_h)(uintptr_t)0x6000, 43);
    CHECK(c != NULL && c != a);
    c->n = 1;
    a->n--;
    rx_put(a);
    CHECK(!list_empty(&ln->rxs));
    a->n--;
    rx_put(a); /* the last: gone */
    c->n--;
    rx_put(c);
    CHECK(list_empty(&ln->rxs));
}

/* one it knows, closing: dropped as before */
TEST(stopping_lane_drops_data_from_a_closing_endpoint)
{
    lane_t *ln = stopping_lane();
    lep_t *p = lep_new(ln, 7);
    CHECK(p != NULL);
    p->ep = (ucp_ep_h)(uintptr_t)0x2000;
    p->closing = 1;
    ucp_am_recv_param_t prm = {.recv_attr = UCP_AM_RECV_ATTR_FIELD_REPLY_EP |
                                            UCP_AM_RECV_ATTR_FLAG_RNDV,
                               .reply_ep = p->ep};
    uint8_t hdr[16] = {0};
    CHECK_EQ(on_data(ln, hdr, sizeof(hdr), NULL, 4096, &prm), UCS_OK);
    CHECK(list_empty(&ln->rxs));
    list_remove(&p->node);
    free(p);
}
