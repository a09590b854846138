/*
 * restart_bench — how long engines take to move KV again after kvxferd
 * restarts (scripts/restart_bench.sh runs it):
 *
 *   restart_bench KVXFERD RESTARTS
 *
 * A context and a generation rank in this process, host pools, one
 * request in flight; then, RESTARTS times: kill -9 of the daemon, a new
 * one on the same socket path, the ranks polling every millisecond as an
 * engine's step loop does (the library reconnects inside those calls),
 * and a transfer verified byte for byte. A thread notes when the new
 * daemon's socket first accepts a connection; the time printed per
 * restart is from then to the verified transfer, then p50 and p99.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvxfer.h"

static char sock[128], cfg[128], logf[128];
static const char *exe;

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void die(const char *what, kvx_client_t *c, int rc)
{
    fprintf(stderr, "restart_bench: %s: %s: %s\n", what, kvx_status_name(rc),
            c ? kvx_last_error(c) : kvx_last_error(NULL));
    exit(1);
}

static pid_t daemon_run(void)
{
    fflush(stdout);
    fflush(stderr);
    pid_t p = fork();
    if (p == 0) {
        if (!freopen(logf, "a", stdout) || !freopen(logf, "a", stderr))
            _exit(126);
        execl(exe, exe, "--config", cfg, (char *)NULL);
        _exit(127);
    }
    return p;
}

static _Atomic int64_t ready_at; /* when the socket first accepted */

static void *probe(void *arg)
{
    (void)arg;
    for (;;) {
        kvx_client_t *o;
        if (kvx_connect_observer(sock, 1000, &o) == 0) {
            atomic_store(&ready_at, now_us());
            kvx_close(o);
            return NULL;
        }
        usleep(200);
    }
}

typedef struct {
    kvx_client_t *c;
    uint8_t *base;
    uint32_t pool;
    kvx_layout_t lay;
} rank_t;

static void rank_open(const char *inst, kvx_role_t role, rank_t *r)
{
    kvx_hello_t h = {
        .instance_id = inst,
        .role = role,
        .parallel = {
            .tp = 1, .pp = 1, .cp = 1, .total_layers = 4, .total_kv_heads = 4}};
    int rc = kvx_connect(sock, &h, 5000, &r->c);
    if (rc)
        die("connect", NULL, rc);
    char addr[192];
    const char *a[1] = {addr};
    if ((rc = kvx_daemon_address(r->c, addr, sizeof(addr))) ||
        (rc = kvx_join(r->c, a, 1, 5000)))
        die("join", r->c, rc);
    kvx_layout_preset("vllm-nhd", 4, 2, 4, 32, KVX_DTYPE_BF16, 4, 64, &r->lay);
    void *base;
    if ((rc = kvx_pool_create_host(r->c, &r->lay, kvx_layout_span(&r->lay),
                                   &base, &r->pool, 5000)))
        die("pool", r->c, rc);
    r->base = base;
}

/* Poll until the client is back (its first batch then ends with the
 * RECONNECTED event); one look, as an engine's step. 1 once back. */
static int step(kvx_client_t *c)
{
    kvx_batch_t *b;
    int rc = kvx_poll(c, 0, 0, &b);
    if (rc == KVX_ERR_CLOSED) {
        if (getenv("RB_DEBUG") && atomic_load(&ready_at))
            fprintf(stderr, "%lld: %s\n",
                    (long long)(now_us() - atomic_load(&ready_at)),
                    kvx_last_error(c));
        return 0;
    }
    if (rc)
        die("poll", c, rc);
    int back = b->num_events &&
               b->events[b->num_events - 1].kind == KVX_EVENT_RECONNECTED;
    kvx_batch_free(b);
    return back;
}

static void wait_complete(kvx_client_t *c, const char *key)
{
    for (;;) {
        kvx_batch_t *b;
        int rc = kvx_poll(c, 1, 5000, &b);
        if (rc)
            die("poll for the event", c, rc);
        for (uint32_t i = 0; i < b->num_events; i++)
            if (b->events[i].key_len == strlen(key) &&
                !memcmp(b->events[i].key, key, b->events[i].key_len)) {
                if (b->events[i].kind != KVX_EVENT_COMPLETE) {
                    fprintf(stderr, "restart_bench: %s: %s\n", key,
                            b->events[i].message);
                    exit(1);
                }
                kvx_batch_free(b);
                return;
            }
        kvx_batch_free(b);
    }
}

/* One request of 3 blocks, every byte of each checked. */
static void transfer(rank_t *cx, rank_t *gn, const char *key, unsigned seed)
{
    uint32_t cb[3] = {(seed * 7) % 64, (seed * 7 + 1) % 64,
                      (seed * 7 + 2) % 64};
    uint32_t gb[3] = {(seed * 5 + 9) % 64, (seed * 5 + 10) % 64,
                      (seed * 5 + 11) % 64};
    uint64_t span = kvx_layout_span(&cx->lay);
    srand(seed);
    for (uint64_t i = 0; i < span; i++)
        cx->base[i] = (uint8_t)rand();
    kvx_context_params_t p;
    int rc = kvx_publish_key(cx->c, key, strlen(key), cx->pool, cb, 3, 12, NULL,
                             0, &p, 5000);
    if (rc)
        die("publish", cx->c, rc);
    if ((rc = kvx_fetch_key(gn->c, key, strlen(key), p.data, p.len, gn->pool,
                            gb, 3, 0, 0, 5000)))
        die("fetch", gn->c, rc);
    kvx_context_params_free(&p);
    wait_complete(gn->c, key);
    wait_complete(cx->c, key);
    const kvx_layout_t *l = &cx->lay;
    uint64_t per = l->token_stride * l->tokens_per_block;
    for (uint32_t k = 0; k < 3; k++)
        for (uint32_t ly = 0; ly < l->num_layers; ly++)
            for (uint32_t kv = 0; kv < 2; kv++)
                if (memcmp(gn->base + kvx_layout_offset(l, ly, kv, gb[k], 0, 0),
                           cx->base + kvx_layout_offset(l, ly, kv, cb[k], 0, 0),
                           per)) {
                    fprintf(stderr, "restart_bench: %s: bytes differ\n", key);
                    exit(1);
                }
}

static int cmp(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: restart_bench KVXFERD RESTARTS\n");
        return 2;
    }
    exe = argv[1];
    int n = atoi(argv[2]);
    char dir[] = "/tmp/kvx-restart-XXXXXX";
    if (!mkdtemp(dir) || n < 1 || n > 1000)
        return 2;
    snprintf(sock, sizeof(sock), "%s/kvxferd.sock", dir);
    snprintf(cfg, sizeof(cfg), "%s/kvxferd.yaml", dir);
    snprintf(logf, sizeof(logf), "%s/kvxferd.log", dir);
    FILE *f = fopen(cfg, "w");
    fprintf(f, "socket:\n  path: %s\n", sock);
    fclose(f);
    signal(SIGPIPE, SIG_IGN);
    pid_t d = daemon_run();
    pthread_t t;
    pthread_create(&t, NULL, probe, NULL);
    pthread_join(t, NULL);
    rank_t cx, gn;
    rank_open("rb-ctx", KVX_ROLE_CONTEXT, &cx);
    rank_open("rb-gen", KVX_ROLE_GENERATION, &gn);
    transfer(&cx, &gn, "warm", 1);
    int64_t *ms = calloc((size_t)n, sizeof(*ms));
    for (int i = 0; i < n; i++) {
        kvx_context_params_t p; /* in flight when the daemon dies */
        uint32_t b[1] = {63};
        if (kvx_publish_key(cx.c, "lost", 4, cx.pool, b, 1, 4, NULL, 0, &p,
                            5000))
            die("publish lost", cx.c, -1);
        kvx_context_params_free(&p);
        kill(d, SIGKILL);
        waitpid(d, NULL, 0);
        atomic_store(&ready_at, 0);
        d = daemon_run();
        pthread_create(&t, NULL, probe, NULL);
        /* the engines' step loop: a poll each millisecond on each rank */
        int cback = 0, gback = 0;
        int64_t first_back = 0;
        while (!(cback && gback)) {
            cback = cback || step(cx.c);
            gback = gback || step(gn.c);
            if ((cback || gback) && !first_back)
                first_back = now_us();
            usleep(1000);
        }
        char key[32];
        snprintf(key, sizeof(key), "after-%d", i);
        transfer(&cx, &gn, key, (unsigned)i + 2);
        int64_t done = now_us();
        pthread_join(t, NULL);
        /* a client back first proves the socket was ready then */
        int64_t ready = atomic_load(&ready_at);
        ms[i] = done - (ready < first_back ? ready : first_back);
        printf("restart %d: %.1f ms from socket ready to a verified "
               "transfer\n",
               i + 1, ms[i] / 1000.0);
    }
    qsort(ms, (size_t)n, sizeof(*ms), cmp);
    int p99 = (int)((n * 99 + 99) / 100) - 1;
    printf("C client, %d restarts: p50 %.1f ms, p99 %.1f ms, max %.1f ms\n", n,
           ms[(n - 1) / 2] / 1000.0, ms[p99] / 1000.0, ms[n - 1] / 1000.0);
    kvx_close(cx.c);
    kvx_close(gn.c);
    kill(d, SIGTERM);
    waitpid(d, NULL, 0);
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    return system(cmd) != 0;
}
