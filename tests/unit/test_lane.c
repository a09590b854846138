/*
 * test_lane — what a lane does with a message that arrives while it
 * stops (daemon/net/lane.c, on_data()): its endpoints are closing or
 * gone, the other daemon is still sending. Before 2026-12-06 a message
 * on an endpoint the lane no longer (or never) knew read a NULL endpoint
 * there: a generation daemon drained mid-transfer died of SIGSEGV.
 */
#include "../../daemon/net/lane.c"

#include "tests/test.h"

static lane_t *stopping_lane(void)
{
    static lane_t ln;
    memset(&ln, 0, sizeof(ln));
    list_init(&ln.eps);
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
    CHECK_EQ(p->nheld, 0u);
    list_remove(&p->node);
    free(p);
}
