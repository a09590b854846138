/*
 * peer_status — what status reports of the peers (one PeerInfo per
 * connection that knows its daemon's address) and of UCX (its version,
 * the transports connections used, the listener, the lanes).
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer_int.h"
#include "peer_rails.h"

static const char *const state_names[] = {"connecting", "connecting",
                                          "connected", "lost"};

/* tl added to the list (n bytes, "a,b"), unless it is there or there
 * is no room for it */
void transports_add(char *list, size_t n, const char *tl)
{
    if (strstr(list, tl) || strlen(list) + strlen(tl) + 2 >= n)
        return;
    if (list[0])
        strcat(list, ",");
    strcat(list, tl);
}

/* The transports ucp_ep_print_info() names in info ("tl/dev", each
 * once), added to out (n bytes) and to every transport any connection
 * used (status ucx.transports). info is cut up. */
void info_transports(char *info, char *out, size_t n)
{
    char *save = NULL;
    for (char *l = strtok_r(info, "\n", &save); l;
         l = strtok_r(NULL, "\n", &save)) {
        char *lane = strstr(l, "lane[");
        char *colon = lane ? strstr(lane, ": ") : NULL;
        if (!colon)
            continue;
        char tl[64];
        /* "lane[0]:  8:tcp/lo.0 md[4] ..." */
        char *s = colon + 2;
        while (*s == ' ')
            s++;
        char *c2 = strchr(s, ':');
        if (c2 && c2 - s < 4)
            s = c2 + 1;
        if (sscanf(s, "%63[^ ]", tl) != 1 || !strchr(tl, '/'))
            continue; /* "cm": the connection manager, not a transport */
        transports_add(P.transports, sizeof(P.transports), tl);
        transports_add(out, n, tl);
    }
}

/* The transports an endpoint uses, from ucp_ep_print_info ("tl/dev"). */
void ep_transports(ucp_ep_h ep, char *out, size_t n)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    out[0] = 0;
    if (!m)
        return;
    ucp_ep_print_info(ep, m);
    fclose(m);
    if (buf)
        info_transports(buf, out, n);
    free(buf);
}

/* ---- status ------------------------------------------------------------ */

size_t peer_infos(Kvxfer__PeerInfo ***out)
{
    size_t n = 0, k = 0;
    *out = NULL;
    for (peer_conn_t *c = conn_next(NULL); c; c = conn_next(c))
        n += c->address[0] != 0;
    if (!n)
        return 0;
    Kvxfer__PeerInfo **v = calloc(n, sizeof(*v));
    if (!v)
        return 0;
    uint64_t now = now_ms();
    for (peer_conn_t *c = conn_next(NULL); c && k < n; c = conn_next(c)) {
        if (!c->address[0])
            continue;
        Kvxfer__PeerInfo *p = malloc(sizeof(*p));
        if (!p)
            break;
        kvxfer__peer_info__init(p);
        p->address = strdup(c->address);
        p->state = (char *)state_names[c->state];
        p->direction = c->outgoing ? "out" : "in";
        p->bytes_sent = c->bytes_sent;
        p->bytes_received = c->bytes_received;
        p->errors = c->errors;
        p->last_seen_ms = now - c->last_seen_ms;
        p->streams = H.data.streams ? H.data.streams(c) : 0;
        p->lanes = c->lanes_off                    ? 0
                   : c->peer_lanes < lanes_count() ? c->peer_lanes
                                                   : lanes_count();
        p->transports = c->transports;
        v[k++] = p;
    }
    *out = v;
    return k;
}

void peer_free_infos(Kvxfer__PeerInfo **v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (v[i]) {
            free(v[i]->address);
            free(v[i]);
        }
    free(v);
}

void peer_ucx_info(Kvxfer__UcxInfo *info)
{
    info->listen = P.on ? kvxd.address : "";
    info->transports = P.transports;
    info->staging = P.on ? "host" : "";
    info->version = P.version;
    info->slot_bytes = P.on ? kvxd.conf.slot_bytes : 0;
    info->send_window = P.on ? kvxd.conf.send_window : 0;
    info->lanes = lanes_count();
    info->n_lane_ports = 0; /* lanes listen on no port of their own */
    rails_ucx_info(info);
}
