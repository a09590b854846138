/* metrics — Prometheus text, loop lag, health; see metrics.h.
 *
 * Names are in base units (seconds, bytes), counters end in _total and
 * nothing else does, and every label takes a bounded set of values: the
 * path, side, outcome, error code (kvx_status_t's names), state, memory
 * kind, and the peer daemon's address (one per daemon of the cluster).
 * Never a request key, an instance id or a client pid. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "copy/copy.h"
#include "copy/gpu.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "metrics.h"
#include "net/peer.h"
#include "pacing.h"
#include "remote/remote.h"
#include "xfer/instance.h"
#include "xfer/xfer.h"

static unsigned (*sessions)(void);

void metrics_set_sessions(unsigned (*count)(void))
{
    sessions = count;
}

/* ---- loop lag ------------------------------------------------------- */

/* The tick comes every deadlines.deadline_tick_ms; how much later than
 * that it came is the loop's lag. The window keeps the largest lag of
 * the current second and of the one before. */
static struct {
    uint64_t last_ns, win_start_ns, win_max, prev_max;
    kvxd_hist_t hist;
} lag;

void metrics_tick(void)
{
    uint64_t now = uv_hrtime(),
             period = kvxd.conf.deadline_tick_ms * 1000000ull;
    if (lag.last_ns && now > lag.last_ns + period) {
        uint64_t l = now - lag.last_ns - period;
        hist_add(&lag.hist, kvxd_secs_bounds, KVXD_SECS_N, (double)l / 1e9);
        if (l > lag.win_max)
            lag.win_max = l;
    } else if (lag.last_ns) {
        hist_add(&lag.hist, kvxd_secs_bounds, KVXD_SECS_N, 0);
    }
    lag.last_ns = now;
    if (now - lag.win_start_ns >= 1000000000ull) {
        lag.prev_max = lag.win_max;
        lag.win_max = 0;
        lag.win_start_ns = now;
    }
}

uint64_t metrics_lag_ns(void)
{
    uint64_t l = lag.win_max > lag.prev_max ? lag.win_max : lag.prev_max;
    /* a tick that has not come yet is late too (a loop stuck in a
     * callback is seen by the HTTP thread, http.c) */
    uint64_t now = uv_hrtime(),
             period = kvxd.conf.deadline_tick_ms * 1000000ull;
    if (lag.last_ns && now > lag.last_ns + period &&
        now - lag.last_ns - period > l)
        l = now - lag.last_ns - period;
    return l;
}

int metrics_healthy(char *why, size_t len)
{
    uint64_t l = metrics_lag_ns(),
             max = kvxd.conf.metrics_health_max_lag_ms * 1000000ull;
    if (kvxd.draining) {
        snprintf(why, len, "draining");
        return 0;
    }
    if (l > max) {
        snprintf(why, len,
                 "loop lag %.1f ms passes metrics.health_max_lag_ms (%u)",
                 (double)l / 1e6, kvxd.conf.metrics_health_max_lag_ms);
        return 0;
    }
    snprintf(why, len, "ok");
    return 1;
}

/* ---- text ------------------------------------------------------------- */

static void family(FILE *f, const char *name, const char *type,
                   const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value: \, " and newlines escaped as the format asks. */
static void label(FILE *f, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\' || *v == '"')
            fputc('\\', f);
        if (*v == '\n')
            fputs("\\n", f);
        else
            fputc(*v, f);
    }
}

static void hist(FILE *f, const char *name, const kvxd_hist_t *h,
                 const double *bounds, size_t n)
{
    uint64_t cum = 0;
    for (size_t i = 0; i < n; i++) {
        cum += h->b[i];
        fprintf(f, "%s_bucket{le=\"%.12g\"} %llu\n", name, bounds[i],
                (unsigned long long)cum);
    }
    cum += h->b[n];
    fprintf(f, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.17g\n%s_count %llu\n",
            name, (unsigned long long)cum, name, h->sum, name,
            (unsigned long long)h->count);
}

static const char *const path_names[KVXD_PATHS] = {"same_gpu", "gpu_to_gpu",
                                                   "host", "peer"};
static const char *const side_names[KVXD_SIDES] = {"offer", "fetch"};
static const char *const end_names[KVXD_ENDS] = {"", "complete", "error",
                                                 "cancelled", "timed_out"};

static void text_transfers(FILE *f, const Kvxfer__UcxInfo *ucx)
{
    const kvxd_stats_t *s = &kvxd.stats;
    family(f, "kvxfer_bytes_total", "counter",
           "Bytes moved: in, landed in this daemon's pools by fetches "
           "(by where they came from); out, sent to peer daemons.");
    for (int p = 0; p < KVXD_PATHS; p++)
        fprintf(f, "kvxfer_bytes_total{direction=\"in\",path=\"%s\"} %llu\n",
                path_names[p], (unsigned long long)s->bytes_in[p]);
    fprintf(f, "kvxfer_bytes_total{direction=\"out\",path=\"peer\"} %llu\n",
            (unsigned long long)(ucx->sent ? ucx->sent->bytes : 0));
    family(f, "kvxfer_transfers_total", "counter",
           "Fetches that completed, by where their bytes came from.");
    for (int p = 0; p < KVXD_PATHS; p++)
        fprintf(f, "kvxfer_transfers_total{path=\"%s\"} %llu\n", path_names[p],
                (unsigned long long)s->fetches_done[p]);
    family(f, "kvxfer_requests_total", "counter",
           "Requests ended, by side (offer: context, fetch: generation) "
           "and outcome.");
    for (int d = 0; d < KVXD_SIDES; d++)
        for (int k = 1; k < KVXD_ENDS; k++)
            fprintf(f,
                    "kvxfer_requests_total{side=\"%s\",outcome=\"%s\"} %llu\n",
                    side_names[d], end_names[k],
                    (unsigned long long)s->ended[d][k]);
    family(f, "kvxfer_request_errors_total", "counter",
           "Requests ended with an error, by side and error code.");
    for (int d = 0; d < KVXD_SIDES; d++)
        for (int c = 1; c < 32; c++)
            if (s->end_codes[d][c])
                fprintf(f,
                        "kvxfer_request_errors_total{side=\"%s\",code=\"%s\"} "
                        "%llu\n",
                        side_names[d], kvx_status_name(-c),
                        (unsigned long long)s->end_codes[d][c]);
    family(f, "kvxfer_reply_errors_total", "counter",
           "Errors by code: error replies to clients' calls, requests "
           "that ended in error, refused connections.");
    for (int c = 1; c < 32; c++)
        if (s->errors_by_code[c])
            fprintf(f, "kvxfer_reply_errors_total{code=\"%s\"} %llu\n",
                    kvx_status_name(-c),
                    (unsigned long long)s->errors_by_code[c]);
    family(f, "kvxfer_transfer_duration_seconds", "histogram",
           "A completed fetch: from its first rank's call to its end.");
    hist(f, "kvxfer_transfer_duration_seconds", &s->fetch_seconds,
         kvxd_secs_bounds, KVXD_SECS_N);
    family(f, "kvxfer_transfer_size_bytes", "histogram",
           "A completed fetch's bytes.");
    hist(f, "kvxfer_transfer_size_bytes", &s->fetch_bytes, kvxd_bytes_bounds,
         KVXD_BYTES_N);
    family(f, "kvxfer_layerwise_exposed_seconds", "histogram",
           "A layer-wise offer fetched on this daemon: from its last "
           "layer ready to the fetch's end (the transfer time the "
           "prefill did not hide).");
    hist(f, "kvxfer_layerwise_exposed_seconds", &s->exposed_seconds,
         kvxd_secs_bounds, KVXD_SECS_N);
    family(f, "kvxfer_batches_sealed_total", "counter",
           "Batches of terminal events sealed.");
    uint64_t sealed = s->batches_sealed;
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        sealed += i->batches.sealed_total;
    fprintf(f, "kvxfer_batches_sealed_total %llu\n",
            (unsigned long long)sealed);
}

static void text_state(FILE *f)
{
    Kvxfer__Count **st = NULL;
    size_t n = xfer_states(&st);
    family(f, "kvxfer_requests_in_flight", "gauge",
           "Requests in flight, by state.");
    for (size_t i = 0; i < n; i++) {
        fprintf(f, "kvxfer_requests_in_flight{state=\"%s\"} %llu\n",
                st[i]->name, (unsigned long long)st[i]->value);
    }
    xfer_free_counts(st, n);
    family(f, "kvxfer_sessions", "gauge", "Client connections open.");
    fprintf(f, "kvxfer_sessions %u\n", sessions ? sessions() : 0);
    uint32_t ni = 0;
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        ni++;
    family(f, "kvxfer_instances", "gauge", "Instances this daemon serves.");
    fprintf(f, "kvxfer_instances %u\n", ni);
    family(f, "kvxfer_pools", "gauge", "Memory pools registered.");
    fprintf(f, "kvxfer_pools %u\n", pool_count());
    family(f, "kvxfer_memory_budget_bytes", "gauge",
           "The memory budget (limits.memory_bytes).");
    fprintf(f, "kvxfer_memory_budget_bytes %llu\n",
            (unsigned long long)kvxd.conf.memory_bytes);
    family(f, "kvxfer_memory_used_bytes", "gauge",
           "What is charged to the memory budget now, by kind.");
    for (int k = 0; k < MEM_KINDS; k++)
        fprintf(f, "kvxfer_memory_used_bytes{kind=\"%s\"} %llu\n",
                kvxd_mem_name((kvxd_mem_t)k),
                (unsigned long long)kvxd_mem_used((kvxd_mem_t)k));
}

static void text_engines(FILE *f, const Kvxfer__UcxInfo *ucx)
{
    family(f, "kvxfer_copy_busy_seconds_total", "counter",
           "Time copy jobs ran: engine threads (copy threads and the "
           "loop's inline copies) or gpu (launch to completion).");
    fprintf(f, "kvxfer_copy_busy_seconds_total{engine=\"threads\"} %.9f\n",
            (double)copy_busy_ns(0) / 1e9);
    fprintf(f, "kvxfer_copy_busy_seconds_total{engine=\"gpu\"} %.9f\n",
            (double)copy_busy_ns(1) / 1e9);
    uint64_t pj, pns;
    unsigned held;
    copy_pace_stats(&pj, &pns, &held);
    family(f, "kvxfer_copy_paced_jobs_total", "counter",
           "Copy jobs held by a pace (gpu.pace, copy.pace or an engine's "
           "GpuPace) before they started.");
    fprintf(f, "kvxfer_copy_paced_jobs_total %llu\n", (unsigned long long)pj);
    family(f, "kvxfer_copy_paced_seconds_total", "counter",
           "Time copy jobs were held by a pace, summed.");
    fprintf(f, "kvxfer_copy_paced_seconds_total %.9f\n", (double)pns / 1e9);
    /* Prometheus's base unit: bytes a second (gpu.pace counts a ms) */
    family(f, "kvxfer_gpu_pace_bytes_per_second", "gauge",
           "Bytes a second each GPU's copies may start at: the lowest of "
           "gpu.pace and the engines' GpuPace, times 1000 (0: no pace), for "
           "each device with a GPU pool.");
    uint64_t used = pacing_devices_used(), engines;
    for (int dv = 0; dv < COPY_PACE_DEVICES; dv++)
        if (used >> dv & 1)
            fprintf(f, "kvxfer_gpu_pace_bytes_per_second{device=\"%d\"} %.0f\n",
                    dv, (double)copy_gpu_pace(dv, &engines) * 1000.0);
    gpu_counts_t gc;
    gpu_counts(&gc);
    family(f, "kvxfer_gpu_launches_total", "counter",
           "GPU copy launches, by path: kernel (the copy kernel, on the "
           "SMs) or dma (the GPU's DMA copy engines; gpu.copy_path dma, or "
           "auto's choice).");
    fprintf(f, "kvxfer_gpu_launches_total{path=\"kernel\"} %llu\n",
            (unsigned long long)(gc.launches - gc.launches_dma));
    fprintf(f, "kvxfer_gpu_launches_total{path=\"dma\"} %llu\n",
            (unsigned long long)gc.launches_dma);
    family(f, "kvxfer_gpu_dma_copies_total", "counter",
           "Copies the dma path's launches were cut into (one a joined "
           "run).");
    fprintf(f, "kvxfer_gpu_dma_copies_total %llu\n",
            (unsigned long long)gc.dma_copies);
    family(f, "kvxfer_gpu_mps", "gauge",
           "1 when the daemon's context on the device is an MPS client "
           "(its copies run beside the engines' kernels), 0 when it is not "
           "(they take turns), for each device with a GPU pool whose "
           "driver says.");
    for (int dv = 0; dv < COPY_PACE_DEVICES; dv++)
        if (gpu_mps(dv) >= 0)
            fprintf(f, "kvxfer_gpu_mps{device=\"%d\"} %d\n", dv, gpu_mps(dv));
    family(f, "kvxfer_gpu_pace_sessions", "gauge",
           "Sessions (engine ranks) whose GpuPace is recorded and has not "
           "lapsed (it binds no device that users share).");
    fprintf(f, "kvxfer_gpu_pace_sessions %u\n", pacing_sessions());
    family(f, "kvxfer_copy_jobs_in_flight", "gauge",
           "Copy jobs handed to threads or GPUs, not back yet.");
    fprintf(f, "kvxfer_copy_jobs_in_flight %u\n", copy_inflight());
    family(f, "kvxfer_staging_slots", "gauge",
           "Staging slots between daemons, by direction and use.");
    const Kvxfer__SlotTimes *d[2] = {ucx->received, ucx->sent};
    static const char *const dn[2] = {"receive", "send"};
    for (int i = 0; i < 2; i++) {
        uint64_t all = ucx->slots + (d[i] ? d[i]->gpu_slots : 0),
                 free_n = d[i] ? d[i]->free_slots : 0;
        fprintf(f, "kvxfer_staging_slots{direction=\"%s\",use=\"used\"} %llu\n",
                dn[i], (unsigned long long)(all > free_n ? all - free_n : 0));
        fprintf(f, "kvxfer_staging_slots{direction=\"%s\",use=\"free\"} %llu\n",
                dn[i], (unsigned long long)free_n);
    }
    family(f, "kvxfer_loop_lag_seconds", "histogram",
           "How late the loop's tick came (deadlines.deadline_tick_ms).");
    hist(f, "kvxfer_loop_lag_seconds", &lag.hist, kvxd_secs_bounds,
         KVXD_SECS_N);
    family(f, "kvxfer_loop_lag_max_seconds", "gauge",
           "The largest loop lag of the last one to two seconds.");
    fprintf(f, "kvxfer_loop_lag_max_seconds %.9f\n",
            (double)metrics_lag_ns() / 1e9);
}

static void text_peers(FILE *f)
{
    Kvxfer__PeerInfo **p = NULL;
    size_t n = peer_infos(&p);
    uint32_t up = 0;
    for (size_t i = 0; i < n; i++)
        up += !strcmp(p[i]->state, "connected");
    family(f, "kvxfer_peers_up", "gauge", "Peer daemons connected.");
    fprintf(f, "kvxfer_peers_up %u\n", up);
    family(f, "kvxfer_peers", "gauge", "Peer daemons known.");
    fprintf(f, "kvxfer_peers %zu\n", n);
    family(f, "kvxfer_peer_bytes_total", "counter",
           "Bytes exchanged with each peer daemon, by its address and "
           "the connection's (out: this daemon dialled; in: it did).");
    for (size_t i = 0; i < n; i++) {
        static const char *const dir[2] = {"sent", "received"};
        uint64_t v[2] = {p[i]->bytes_sent, p[i]->bytes_received};
        for (int k = 0; k < 2; k++) {
            fputs("kvxfer_peer_bytes_total{peer=\"", f);
            label(f, p[i]->address);
            fputs("\",conn=\"", f);
            label(f, p[i]->direction);
            fprintf(f, "\",direction=\"%s\"} %llu\n", dir[k],
                    (unsigned long long)v[k]);
        }
    }
    peer_free_infos(p, n);
}

char *metrics_text(size_t *len)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f)
        return NULL;
    family(f, "kvxfer_build_info", "gauge", "The daemon's version.");
    fputs("kvxfer_build_info{version=\"" KVX_VERSION_STRING "\"} 1\n", f);
    family(f, "kvxfer_uptime_seconds", "gauge", "Since the daemon started.");
    fprintf(f, "kvxfer_uptime_seconds %.3f\n",
            (double)(kvxd_now_ms() - kvxd.start_ms) / 1e3);
    family(f, "kvxfer_draining", "gauge", "1 while the daemon drains.");
    fprintf(f, "kvxfer_draining %d\n", kvxd.draining != 0);
    static Kvxfer__UcxInfo ucx;
    kvxfer__ucx_info__init(&ucx);
    remote_ucx_info(&ucx);
    text_transfers(f, &ucx);
    text_state(f);
    text_engines(f, &ucx);
    text_peers(f);
    if (fclose(f)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}
