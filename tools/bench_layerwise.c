/*
 * bench_layerwise — kvxfer-bench --layerwise: one context rank and one
 * generation rank of this process, one request at a time, four ways:
 * ready (published whole with its KV there: one layer's transfer is its
 * time over the layers), layer-wise (a layer ready every MS ms: exposed
 * = COMPLETE - the last layer ready), whole (the same prefill, then
 * published: its exposed time), and streamed at once (layer-wise with
 * every layer ready back to back: its bandwidth against ready's).
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#ifdef KVX_CUDA
#include "bench_gpu.h"
#endif

/* The generation rank's poll, on a thread of its own while the context
 * rank "prefills": the moment key's event arrived. */
typedef struct lw_wait {
    kvx_client_t *c;
    char key[32];
    uint64_t done_ns;
    int kind, code;
    pthread_t th;
} lw_wait_t;

static void *lw_poll(void *arg)
{
    lw_wait_t *w = arg;
    size_t kl = strlen(w->key);
    for (;;) {
        kvx_batch_t *b;
        if (kvx_poll(w->c, o.poll_spin ? 0 : 1, o.poll_spin ? 0 : 1000, &b))
            die("--layerwise: poll: %s", kvx_last_error(w->c));
        for (uint32_t i = 0; i < b->num_events; i++) {
            const kvx_event_t *e = &b->events[i];
            if (e->key_len == kl && !memcmp(e->key, w->key, kl)) {
                w->done_ns = now_ns();
                w->kind = e->kind;
                w->code = e->code;
                kvx_batch_free(b);
                return NULL;
            }
        }
        kvx_batch_free(b);
    }
}

/* Fetch gkey into gv's blocks with params p, and wait on a thread. */
static void lw_fetch(kvx_client_t *g, const rank_view_t *gv, const char *gkey,
                     const kvx_context_params_t *p, lw_wait_t *w)
{
    uint32_t *blocks = malloc(gv->bpr * sizeof(uint32_t));
    for (uint32_t i = 0; i < gv->bpr; i++)
        blocks[i] = req_block(gv, 0, i);
    CHECK_KVX(kvx_fetch_key(g, gkey, strlen(gkey), p->data, p->len, gv->pool,
                            blocks, gv->bpr, 0, 0, TIMEOUT_MS),
              g);
    free(blocks);
    memset(w, 0, sizeof(*w));
    w->c = g;
    snprintf(w->key, sizeof(w->key), "%s", gkey);
    if (pthread_create(&w->th, NULL, lw_poll, w))
        die("pthread_create failed");
}

static void lw_join(lw_wait_t *w, const char *what)
{
    pthread_join(w->th, NULL);
    if (w->kind != KVX_EVENT_COMPLETE)
        die("--layerwise %s: request %s ended %d (%s)", what, w->key, w->kind,
            kvx_status_str(w->code));
}

static void spin_until(uint64_t t)
{
    while (now_ns() < t)
        ;
}

static double med_us(uint64_t *v, uint32_t n)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    return n % 2 ? v[n / 2] / 1e3 : (v[n / 2 - 1] + v[n / 2]) / 2e3;
}

/* --layerwise --trace: the median of the daemon's part of each
 * layer-wise request, from the moment its last layer was ready (last[r])
 * to its terminal event queued (the trace line of fetch "lwg-R"). */
static double lw_daemon_us(const uint64_t *last, uint32_t n)
{
    FILE *f = fopen(trace_path(), "r");
    if (!f)
        die("--trace: %s: %s", trace_path(), strerror(errno));
    uint64_t *d = calloc(n ? n : 1, sizeof(uint64_t));
    uint32_t m = 0;
    char key[300];
    unsigned long long t[6];
    while (d && trace_next(f, key, t)) {
        unsigned r;
        char end;
        if (sscanf(key, "lwg-%u%c", &r, &end) != 1 || r >= n || !last[r] ||
            m >= n)
            continue;
        d[m++] = t[5] > last[r] ? t[5] - last[r] : 0;
    }
    fclose(f);
    unlink(trace_path());
    if (!m)
        die("--trace: no trace line of a layer-wise request");
    double v = med_us(d, m);
    free(d);
    return v;
}

/* The two ranks, the scheduler and what a request's four ways share. */
typedef struct lw {
    kvx_client_t *c, *g, *s; /* context, generation, scheduler */
    rank_view_t cv, gv;
    uint32_t L;            /* layers */
    uint64_t per_layer_ns; /* --layerwise MS */
    uint32_t *cb;          /* the context rank's blocks */
    void *stream, **evs;   /* --gpu: the "prefill" stream, an event a layer */
    uint8_t *handles;      /* the events' IPC handles, 64 bytes each */
} lw_t;

/* Each request's figures, ns: ready, layer-wise exposed, whole exposed,
 * streamed, and when its last layer was ready (--trace). */
typedef struct lw_times {
    uint64_t *ready, *lw, *whole, *fast, *last;
} lw_times_t;

static void lw_open(lw_t *x)
{
    memset(x, 0, sizeof(*x));
    x->c = rank_open("lw-ctx", KVX_ROLE_CONTEXT, 0, &x->cv);
    x->g = rank_open("lw-gen", KVX_ROLE_GENERATION, 0, &x->gv);
    CHECK_KVX(kvx_connect_observer(o.socket, TIMEOUT_MS, &x->s), NULL);
    x->L = x->cv.layout.num_layers;
    x->per_layer_ns = (uint64_t)(o.layerwise_ms * 1e6);
    x->cb = malloc(x->cv.bpr * sizeof(uint32_t));
    for (uint32_t i = 0; i < x->cv.bpr; i++)
        x->cb[i] = req_block(&x->cv, 0, i);
#ifdef KVX_CUDA
    if (x->cv.device >= 0) {
        x->evs = calloc(x->L, sizeof(void *));
        x->handles = malloc(64 * (size_t)x->L);
        if (bgpu_stream(x->cv.device, &x->stream) ||
            bgpu_ipc_events(x->cv.device, x->L, x->evs, x->handles))
            die("--layerwise: CUDA stream or IPC events failed");
    }
#endif
}

static void lw_publish(lw_t *x, const char *ck, kvx_context_params_t *p)
{
    CHECK_KVX(kvx_publish_key(x->c, ck, strlen(ck), x->cv.pool, x->cb,
                              x->cv.bpr, num_tokens, NULL, 0, p, TIMEOUT_MS),
              x->c);
}

static void lw_publish_layerwise(lw_t *x, const char *ck,
                                 kvx_context_params_t *p)
{
    CHECK_KVX(kvx_publish_layerwise(x->c, ck, strlen(ck), x->cv.pool, x->cb,
                                    x->cv.bpr, num_tokens, NULL, 0, p,
                                    TIMEOUT_MS),
              x->c);
}

/* 1. ready: the KV is there, published whole; returns its time. */
static uint64_t lw_ready(lw_t *x, uint32_t r)
{
    char ck[32], gk[32];
    kvx_context_params_t p;
    lw_wait_t w;
    snprintf(ck, sizeof(ck), "rd-%u", r);
    snprintf(gk, sizeof(gk), "rdg-%u", r);
    lw_publish(x, ck, &p);
    pool_clear(&x->gv);
    uint64_t t0 = now_ns();
    lw_fetch(x->g, &x->gv, gk, &p, &w);
    lw_join(&w, "ready");
    if (r == 0 && !o.no_verify && check_request(&x->gv, 0))
        die("--layerwise: the ready request's bytes differ");
    kvx_context_params_free(&p);
    return w.done_ns - t0;
}

/* A layer-wise prefill: layer l ready every per-layer time, on the GPU a
 * spinning kernel and an IPC event per layer; returns when the last
 * layer was ready. */
static uint64_t lw_prefill(lw_t *x, const char *ck)
{
    uint64_t start = now_ns(), last = 0;
    for (uint32_t l = 0; l < x->L; l++) {
        if (x->stream) {
#ifdef KVX_CUDA
            if (bgpu_spin(x->cv.device, x->stream, x->per_layer_ns) ||
                bgpu_record(x->evs[l], x->stream))
                die("--layerwise: spin kernel failed");
            CHECK_KVX(kvx_layers_ready(x->c, ck, strlen(ck), l, 1,
                                       x->handles + 64 * (size_t)l, TIMEOUT_MS),
                      x->c);
#endif
        } else {
            spin_until(start + (l + 1) * x->per_layer_ns);
            last = now_ns();
            CHECK_KVX(
                kvx_layers_ready(x->c, ck, strlen(ck), l, 1, NULL, TIMEOUT_MS),
                x->c);
        }
    }
#ifdef KVX_CUDA
    if (x->stream) {
        if (bgpu_event_wait(x->evs[x->L - 1]))
            die("--layerwise: event wait failed");
        last = now_ns();
    }
#endif
    return last;
}

/* 2. layer-wise: a layer every MS ms; returns the exposed time, and in
 * *last when the last layer was ready. */
static uint64_t lw_layerwise(lw_t *x, uint32_t r, uint64_t *last)
{
    char ck[32], gk[32];
    kvx_context_params_t p;
    lw_wait_t w;
    snprintf(ck, sizeof(ck), "lw-%u", r);
    snprintf(gk, sizeof(gk), "lwg-%u", r);
    pool_clear(&x->gv);
    lw_publish_layerwise(x, ck, &p);
    lw_fetch(x->g, &x->gv, gk, &p, &w);
    *last = lw_prefill(x, ck);
    lw_join(&w, "layer-wise");
    if (r == 0 && !o.no_verify && check_request(&x->gv, 0))
        die("--layerwise: the layer-wise request's bytes differ");
    kvx_context_params_free(&p);
    return w.done_ns > *last ? w.done_ns - *last : 0;
}

/* 3. whole: the same prefill, then a publish (the fetch waits on the
 * scheduler's reservation, as it would in an engine); returns the
 * exposed time. */
static uint64_t lw_whole(lw_t *x, uint32_t r)
{
    char ck[32], gk[32];
    kvx_context_params_t p;
    lw_wait_t w;
    snprintf(ck, sizeof(ck), "wh-%u", r);
    snprintf(gk, sizeof(gk), "whg-%u", r);
    pool_clear(&x->gv);
    CHECK_KVX(
        kvx_reserve(x->s, "lw-ctx", ck, strlen(ck), num_tokens, &p, TIMEOUT_MS),
        x->s);
    lw_fetch(x->g, &x->gv, gk, &p, &w);
    kvx_context_params_free(&p);
    uint64_t start = now_ns();
    if (x->stream) {
#ifdef KVX_CUDA
        for (uint32_t l = 0; l < x->L; l++)
            if (bgpu_spin(x->cv.device, x->stream, x->per_layer_ns) ||
                bgpu_record(x->evs[l], x->stream))
                die("--layerwise: spin kernel failed");
        if (bgpu_event_wait(x->evs[x->L - 1]))
            die("--layerwise: event wait failed");
#endif
    } else {
        spin_until(start + x->L * x->per_layer_ns);
    }
    uint64_t last = now_ns();
    lw_publish(x, ck, &p);
    lw_join(&w, "whole");
    kvx_context_params_free(&p);
    return w.done_ns - last;
}

/* 4. streamed, every layer ready at once; returns its time. */
static uint64_t lw_streamed(lw_t *x, uint32_t r)
{
    char ck[32], gk[32];
    kvx_context_params_t p;
    lw_wait_t w;
    snprintf(ck, sizeof(ck), "st-%u", r);
    snprintf(gk, sizeof(gk), "stg-%u", r);
    lw_publish_layerwise(x, ck, &p);
    uint64_t t0 = now_ns();
    lw_fetch(x->g, &x->gv, gk, &p, &w);
    for (uint32_t l = 0; l < x->L; l++)
        CHECK_KVX(
            kvx_layers_ready(x->c, ck, strlen(ck), l, 1, NULL, TIMEOUT_MS),
            x->c);
    lw_join(&w, "streamed");
    kvx_context_params_free(&p);
    return w.done_ns - t0;
}

/* How often the generation rank's waiting poll was answered early
 * (Poll.early: it spins, and a fetch's last copies went out). */
static unsigned long long lw_polls_early(kvx_client_t *s)
{
    unsigned long long early = 0;
    char *sj = NULL;
    if (kvx_status_json(s, &sj, TIMEOUT_MS) == 0) {
        const char *e = strstr(sj, "\"polls_woken_early\":");
        if (e)
            early = strtoull(e + 20, NULL, 10);
    }
    free(sj);
    return early;
}

/* The medians of the figures, as one JSON object or as text. */
static void lw_report(const lw_t *x, lw_times_t *t, unsigned long long early)
{
    uint32_t L = x->L, n = o.requests;
    uint64_t bytes = (uint64_t)num_tokens * L * kvf * o.heads * o.head_dim *
                     kvx_dtype_size(o.dtype);
    double ready_us = med_us(t->ready, n), layer_us = ready_us / L;
    double lw_us = med_us(t->lw, n), whole_us = med_us(t->whole, n);
    double fast_us = med_us(t->fast, n);
    /* --trace: the daemon's part, the last layer ready -> the terminal
     * event queued (one monotonic clock): what is left is the
     * generation rank learning of it */
    double daemon_us = o.trace ? lw_daemon_us(t->last, n) : -1;
    double gbps_ready = bytes / (ready_us * 1e3),
           gbps_fast = bytes / (fast_us * 1e3);
    if (o.json) {
        printf("{\"layerwise_ms\":%g,\"layers\":%u,\"requests\":%u,"
               "\"bytes_per_request\":%llu,\"gpu\":%s,"
               "\"exposed_us\":%.1f,\"layer_us\":%.1f,"
               "\"whole_exposed_us\":%.1f,\"exposed_per_layer\":%.3f,"
               "\"ready_us\":%.1f,\"stream_gbps\":%.3f,"
               "\"whole_gbps\":%.3f,\"stream_ratio\":%.3f,"
               "\"poll\":\"%s\",\"polls_woken_early\":%llu,"
               "\"verified\":%s",
               o.layerwise_ms, L, n, (unsigned long long)bytes,
               x->stream ? "true" : "false", lw_us, layer_us, whole_us,
               lw_us / layer_us, ready_us, gbps_fast, gbps_ready,
               gbps_fast / gbps_ready, o.poll_spin ? "spin" : "wait", early,
               o.no_verify ? "false" : "true");
        if (daemon_us >= 0)
            printf(",\"exposed_daemon_us\":%.1f,"
                   "\"exposed_daemon_per_layer\":%.3f",
                   daemon_us, daemon_us / layer_us);
        printf("}\n");
        return;
    }
    printf("layer-wise: %u layers, a layer ready every %g ms, %.1f MiB "
           "a request (%s pools), median of %u, %s\n",
           L, o.layerwise_ms, bytes / 1048576.0, x->stream ? "GPU" : "host", n,
           o.poll_spin ? "the generation rank polling without waiting"
                       : "the generation rank waiting in its poll");
    printf("  exposed after the last layer, layer-wise %10.1f us  = "
           "%.2f x one layer's transfer\n",
           lw_us, lw_us / layer_us);
    if (daemon_us >= 0)
        printf("    of which in the daemon (to its event)  %10.1f us  = "
               "%.2f x\n",
               daemon_us, daemon_us / layer_us);
    printf("  exposed after the last layer, whole      %10.1f us\n", whole_us);
    printf("  polls answered early (the rank spins)    %10llu\n", early);
    printf("  one layer's transfer (ready request / %u) %9.1f us\n", L,
           layer_us);
    printf("  streamed, all layers ready at once  %6.2f GB/s vs whole "
           "%.2f GB/s (%.3f)\n",
           gbps_fast, gbps_ready, gbps_fast / gbps_ready);
}

int layerwise_main(void)
{
    static lw_t x; /* two rank views: too large for the stack's comfort */
    lw_open(&x);
    uint32_t n = o.requests;
    lw_times_t t = {calloc(n, 8), calloc(n, 8), calloc(n, 8), calloc(n, 8),
                    calloc(n, 8)};
    fill_request(&x.cv, 0);
    for (uint32_t r = 0; r < n; r++) {
        t.ready[r] = lw_ready(&x, r);
        t.lw[r] = lw_layerwise(&x, r, &t.last[r]);
        t.whole[r] = lw_whole(&x, r);
        t.fast[r] = lw_streamed(&x, r);
        /* each context event, so the batches do not pile up */
        for (int k = 0; k < 4;) {
            kvx_batch_t *b;
            CHECK_KVX(kvx_poll(x.c, 1, TIMEOUT_MS, &b), x.c);
            k += (int)b->num_events;
            kvx_batch_free(b);
        }
    }
    lw_report(&x, &t, lw_polls_early(x.s));
    kvx_close(x.s);
    kvx_close(x.g);
    kvx_close(x.c);
    return 0;
}
