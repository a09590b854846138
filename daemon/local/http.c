/* http — /metrics and /health on a thread of their own; see http.h. */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "core/daemon.h"
#include "core/log.h"
#include "http.h"
#include "metrics.h"

/* What the HTTP thread may read: made on the loop, never changed after,
 * freed by whoever drops its last reference. */
typedef struct snap {
    int refs;
    char *text;
    size_t len;
    uint64_t at_ns; /* uv_hrtime() when published */
    int healthy;
    char why[128];
    uint32_t stale_ms; /* publish_ms + health_max_lag_ms */
} snap_t;

static struct {
    struct MHD_Daemon *mhd;
    uv_timer_t timer;
    int timer_on;
    pthread_mutex_t mu;
    snap_t *cur; /* under mu */
} h = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void snap_drop(snap_t *s)
{
    pthread_mutex_lock(&h.mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&h.mu);
    if (last) {
        free(s->text);
        free(s);
    }
}

void http_publish(void)
{
    if (!h.mhd)
        return;
    snap_t *s = calloc(1, sizeof(*s));
    if (!s)
        return; /* the previous one stays (it goes stale: 503) */
    if (!(s->text = metrics_text(&s->len))) {
        free(s);
        return;
    }
    s->refs = 1; /* h.cur's */
    s->healthy = metrics_healthy(s->why, sizeof(s->why));
    s->at_ns = uv_hrtime();
    s->stale_ms =
        kvxd.conf.metrics_publish_ms + kvxd.conf.metrics_health_max_lag_ms;
    pthread_mutex_lock(&h.mu);
    snap_t *old = h.cur;
    h.cur = s;
    pthread_mutex_unlock(&h.mu);
    if (old)
        snap_drop(old);
}

static void on_timer(uv_timer_t *t)
{
    http_publish();
    /* metrics.publish_ms is reloadable */
    uv_timer_set_repeat(t, kvxd.conf.metrics_publish_ms);
}

/* ---- the HTTP thread ---------------------------------------------------- */

static enum MHD_Result answer(struct MHD_Connection *conn, unsigned code,
                              const char *type, const char *body, size_t len)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result rc = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn,
                                  const char *url, const char *method,
                                  const char *version, const char *upload,
                                  size_t *upload_len, void **con_cls)
{
    (void)cls, (void)version, (void)upload, (void)con_cls;
    static const char plain[] = "text/plain; charset=utf-8";
    if (strcmp(method, "GET") && strcmp(method, "HEAD"))
        return answer(conn, MHD_HTTP_METHOD_NOT_ALLOWED, plain,
                      "only GET and HEAD\n", 18);
    if (*upload_len)
        return answer(conn, MHD_HTTP_BAD_REQUEST, plain, "no body\n", 8);
    int metrics = !strcmp(url, "/metrics"), health = !strcmp(url, "/health");
    if (!metrics && !health)
        return answer(conn, MHD_HTTP_NOT_FOUND, plain,
                      "not found: /metrics and /health are\n", 36);
    pthread_mutex_lock(&h.mu);
    snap_t *s = h.cur;
    if (s)
        s->refs++;
    pthread_mutex_unlock(&h.mu);
    enum MHD_Result rc;
    if (!s) {
        rc = answer(conn, MHD_HTTP_SERVICE_UNAVAILABLE, plain,
                    "no snapshot yet\n", 16);
    } else if (metrics) {
        rc =
            answer(conn, MHD_HTTP_OK,
                   "text/plain; version=0.0.4; charset=utf-8", s->text, s->len);
    } else {
        char body[192];
        uint64_t age_ms = (uv_hrtime() - s->at_ns) / 1000000;
        int ok = s->healthy && age_ms <= s->stale_ms;
        if (s->healthy && !ok)
            snprintf(body, sizeof(body),
                     "the loop has published nothing for %llu ms "
                     "(metrics.publish_ms + metrics.health_max_lag_ms: %u)\n",
                     (unsigned long long)age_ms, s->stale_ms);
        else
            snprintf(body, sizeof(body), "%s\n", s->why);
        rc = answer(conn, ok ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE,
                    plain, body, strlen(body));
    }
    if (s)
        snap_drop(s);
    return rc;
}

/* ---- start, stop -------------------------------------------------------- */

static int parse_addr(const char *l, struct sockaddr_storage *sa,
                      kvx_why_t *why)
{
    const char *colon = strrchr(l, ':');
    char ip[64];
    size_t n = (size_t)(colon - l);
    if (l[0] == '[' && n > 2 && l[n - 1] == ']')
        snprintf(ip, sizeof(ip), "%.*s", (int)(n - 2), l + 1);
    else
        snprintf(ip, sizeof(ip), "%.*s", (int)n, l);
    uint16_t port = (uint16_t)strtoul(colon + 1, NULL, 10);
    memset(sa, 0, sizeof(*sa));
    struct sockaddr_in *v4 = (struct sockaddr_in *)sa;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)sa;
    if (inet_pton(AF_INET, ip, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(port);
    } else if (inet_pton(AF_INET6, ip, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(port);
    } else {
        return why_fail(why, KVX_ERR_INVALID,
                        "metrics.listen: '%s' is not IP:PORT", l);
    }
    return 0;
}

int http_init(kvx_why_t *why)
{
    const char *l = kvxd.conf.metrics_listen;
    if (!l[0])
        return 0;
    struct sockaddr_storage sa;
    int rc = parse_addr(l, &sa, why);
    if (rc)
        return rc;
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD;
    if (sa.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    h.mhd = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, NULL, MHD_OPTION_SOCK_ADDR,
        (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT, (unsigned)16,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (!h.mhd)
        return why_fail(why, KVX_ERR_IO,
                        "metrics.listen: cannot serve HTTP on %s (in use, "
                        "or not an address of this host)",
                        l);
    const union MHD_DaemonInfo *info =
        MHD_get_daemon_info(h.mhd, MHD_DAEMON_INFO_BIND_PORT);
    http_publish(); /* a first snapshot before the first scrape */
    uv_timer_init(kvxd.loop, &h.timer);
    uv_timer_start(&h.timer, on_timer, kvxd.conf.metrics_publish_ms,
                   kvxd.conf.metrics_publish_ms);
    uv_unref((uv_handle_t *)&h.timer); /* no reason to keep the loop up */
    h.timer_on = 1;
    log_notice("metrics: serving /metrics and /health on %s (port %u)", l,
               info ? (unsigned)info->port : 0u);
    return 0;
}

void http_cleanup(void)
{
    if (h.timer_on) {
        uv_timer_stop(&h.timer);
        h.timer_on = 0;
    }
    if (h.mhd) {
        MHD_stop_daemon(h.mhd); /* joins the thread: no reader is left */
        h.mhd = NULL;
    }
    if (h.cur) {
        snap_drop(h.cur);
        h.cur = NULL;
    }
}
