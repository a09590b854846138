/*
 * agree — completion batches of an instance whose ranks sit on several
 * daemons: sealed at the daemon of rank 0 (the root), with the others
 * (members) forwarding their events and their ranks' polls.
 */
#include "xfer_int.h"

void remote_agree_msg(peer_conn_t *c, const Kvxfer__PeerMsg *m)
{
    (void)c;
    (void)m;
}

void remote_agree_conn_lost(peer_conn_t *c, const char *msg)
{
    (void)c;
    (void)msg;
}
