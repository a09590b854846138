/*
 * bench_report — the figures of a run: GB/s over the baseline measured in
 * the same run, requests per second, latency percentiles, whether every
 * byte checked out, and with --daemons 2 or --trace where the time went;
 * as text, or with --json one object on stdout.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"

int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The median of n values (sorts a copy; n <= 9). */
double median(const double *v, uint32_t n)
{
    double c[MAX_PASSES];
    memcpy(c, v, n * sizeof(double));
    for (uint32_t i = 1; i < n; i++)
        for (uint32_t j = i; j > 0 && c[j - 1] > c[j]; j--) {
            double t = c[j];
            c[j] = c[j - 1];
            c[j - 1] = t;
        }
    return n % 2 ? c[n / 2] : (c[n / 2 - 1] + c[n / 2]) / 2;
}

/* --trace: the hops of the timed requests, from the daemon's trace
 * lines and the generation rank's own clock (one monotonic clock), as
 * p50 and p99 per hop; in JSON as "trace_us". */
#define NHOPS 9
static const char *const hop_name[NHOPS] = {
    "fetch call -> fetch made (daemon)",
    "made -> first part queued",
    "queued -> first copy submitted",
    "submitted -> last copy done (thread)",
    "done -> back on the daemon's loop",
    "loop -> terminal event queued",
    "event queued -> client has it",
    "fetch call -> event (total)",
    "made -> event queued (the daemon's part)"};

/* Other lines are skipped. */
int trace_next(FILE *f, char key[300], unsigned long long t[6])
{
    char line[512], inst[160];
    while (fgets(line, sizeof(line), f)) {
        int kind;
        unsigned long long bytes;
        if (sscanf(line,
                   "fetch %159s %299s %d %llu %llu %llu %llu %llu %llu "
                   "%llu",
                   inst, key, &kind, &bytes, &t[0], &t[1], &t[2], &t[3], &t[4],
                   &t[5]) == 10)
            return 1;
    }
    return 0;
}

static void trace_report(FILE *out, int json)
{
    FILE *f = fopen(trace_path(), "r");
    if (!f)
        die("--trace: %s: %s", trace_path(), strerror(errno));
    uint64_t *d[NHOPS];
    for (int i = 0; i < NHOPS; i++)
        if (!(d[i] = calloc(o.requests, sizeof(uint64_t))))
            die("out of memory");
    uint8_t *have = calloc(o.requests, 1);
    if (!have)
        die("out of memory");
    char key[300];
    unsigned long long t[6];
    /* with --passes, every pass fetches the same requests again: each
     * one's last line (d[i][r], overwritten) is the pass whose times
     * call_ns and ev_ns hold */
    while (trace_next(f, key, t)) {
        const char *dg = strrchr(key, '-'); /* keyed: "decode-R" */
        dg = dg ? dg + 1 : key;
        char *end;
        unsigned long long r = strtoull(dg, &end, 10);
        if (*end || r >= o.requests || !call_ns[r])
            continue; /* the warm-up's, or not rank 0's */
        uint64_t h[NHOPS] = {
            t[0] - call_ns[r], t[1] - t[0],           t[2] - t[1],
            t[3] - t[2],       t[4] - t[3],           t[5] - t[4],
            ev_ns[r] - t[5],   ev_ns[r] - call_ns[r], t[5] - t[0]};
        for (int i = 0; i < NHOPS; i++)
            d[i][r] = (int64_t)h[i] < 0 ? 0 : h[i];
        have[r] = 1;
    }
    uint32_t n = 0; /* the requests seen, to the front (n <= r) */
    for (uint32_t r = 0; r < o.requests; r++) {
        if (!have[r])
            continue;
        for (int i = 0; i < NHOPS; i++)
            d[i][n] = d[i][r];
        n++;
    }
    free(have);
    fclose(f);
    unlink(trace_path());
    if (!n)
        die("--trace: no trace line matched a timed request");
    if (json)
        fprintf(out, ",\"trace_requests\":%u,\"trace_us\":{", n);
    else
        fprintf(out, "  trace of %u requests (p50 / p99 us per hop):\n", n);
    for (int i = 0; i < NHOPS; i++) {
        qsort(d[i], n, sizeof(uint64_t), cmp_u64);
        double p50 = d[i][n / 2] / 1e3, p99 = d[i][n * 99 / 100] / 1e3;
        if (json)
            fprintf(out, "%s\"%s\":[%.1f,%.1f]", i ? "," : "", hop_name[i], p50,
                    p99);
        else
            fprintf(out, "    %-38s %9.1f %9.1f\n", hop_name[i], p50, p99);
        free(d[i]);
    }
    if (json)
        fprintf(out, "}");
}

/* A JSON string: the value between quotes, escaped. */
static void json_str(const char *v)
{
    putchar('"');
    for (; *v; v++) {
        unsigned char ch = (unsigned char)*v;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

/* The figures a report prints. */
typedef struct figures {
    /* one pass: its GB/s over the baseline; several: the medians of the
     * passes' GB/s, of their baselines, and of their ratios (each pass
     * over the baseline measured right after it) */
    double pass_gbps[MAX_PASSES], pass_ratio[MAX_PASSES];
    double secs, gbps, ratio;
    double p50, p99; /* latency, us */
    int verified;
    uint64_t total, message_bytes;
    const baseline_t *b;
} figures_t;

static void figures_of(uint64_t total, const ranks_result_t *res,
                       const baseline_t *b, figures_t *f)
{
    memset(f, 0, sizeof(*f));
    f->total = total;
    f->message_bytes = res->message_bytes;
    f->b = b;
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        double base = b->gbps;
        if (o.daemons == 2 && o.passes > 1) {
            base = res->pass_ucx[ps] > res->pass_msg[ps] ? res->pass_ucx[ps]
                                                         : res->pass_msg[ps];
            if (b->gpu_cap < base)
                base = b->gpu_cap;
        }
        f->pass_gbps[ps] = (double)total / res->pass_secs[ps] / 1e9;
        f->pass_ratio[ps] = base > 0 ? f->pass_gbps[ps] / base : 0;
    }
    f->secs = median(res->pass_secs, o.passes);
    f->gbps = median(f->pass_gbps, o.passes);
    f->ratio =
        o.passes > 1 ? median(f->pass_ratio, o.passes) : f->gbps / b->gbps;
    qsort(lat_ns, o.requests, sizeof(uint64_t), cmp_u64);
    f->p50 = lat_ns[o.requests / 2] / 1e3;
    f->p99 =
        lat_ns[(o.requests * 99) / 100 < o.requests ? (o.requests * 99) / 100
                                                    : o.requests - 1] /
        1e3;
    f->verified =
        !o.no_verify && sh->mismatches == 0 && sh->guard_changed == 0 &&
        (sampled()
             ? sh->sampled_reqs == (uint64_t)o.requests * o.gen_ranks * o.passes
             : sh->verified_bytes == total * o.passes);
}

static void json_passes(const figures_t *f)
{
    printf(",\"passes\":%u,\"pass_gbps\":[", o.passes);
    for (uint32_t ps = 0; ps < o.passes; ps++)
        printf("%s%.3f", ps ? "," : "", f->pass_gbps[ps]);
    printf("],\"pass_ratios\":[");
    for (uint32_t ps = 0; ps < o.passes; ps++)
        printf("%s%.3f", ps ? "," : "", f->pass_ratio[ps]);
    printf("]");
}

/* --daemons 2 in JSON: the daemons, UCX and where the slots' time went. */
static void json_peers(const figures_t *f)
{
    const baseline_t *b = f->b;
    const char *tls = getenv("UCX_TLS");
    const double *rx = peers.rx, *tx = peers.tx;
    printf(",\"daemons\":2,\"slot_bytes\":%llu,\"peer_config\":[",
           (unsigned long long)o.slot_bytes);
    for (uint32_t i = 0; i < o.npeer_config; i++) {
        if (i)
            putchar(',');
        json_str(o.peer_config[i]);
    }
    printf("],\"cpus_a\":");
    json_str(o.cpus[0] ? o.cpus[0] : "");
    printf(",\"cpus_b\":");
    json_str(o.cpus[1] ? o.cpus[1] : "");
    printf(",\"ucx_tls\":");
    json_str(tls ? tls : "default");
    printf(",\"message_bytes\":%llu,\"lanes\":%u,"
           "\"ucx_perftest_gbps\":%.3f,"
           "\"ucx_perftest_message_gbps\":%.3f,"
           "\"ucx_perftest_put_gbps\":%.3f,\"ucx_perftest_runs\":[",
           (unsigned long long)f->message_bytes, peers.lanes, b->ucx_gbps,
           b->ucx_msg_gbps, b->ucx_put_gbps);
    for (uint32_t i = 0; i < b->nruns; i++)
        printf("%s%.3f", i ? "," : "", b->runs[0][i]);
    printf("],\"ucx_perftest_message_runs\":[");
    for (uint32_t i = 0; b->ucx_msg_gbps > 0 && i < b->nruns; i++)
        printf("%s%.3f", i ? "," : "", b->runs[1][i]);
    printf("]");
    if (o.gpu)
        printf(",\"d2h_gbps\":%.3f,\"h2d_gbps\":%.3f", b->d2h, b->h2d);
    /* which memory the slots were in, and what carried the bytes */
    printf(",\"gpu_slot_bytes\":{\"received\":%.0f,\"sent\":%.0f}"
           ",\"transports\":",
           rx[7], tx[7]);
    json_str(peers.transports);
    /* warm-up included */
    printf(",\"slot_us\":{\"received\":{\"slots\":%.0f,\"wait\":%.1f,"
           "\"wire\":%.1f,\"scatter\":%.1f,\"scatter_lag\":%.1f,"
           "\"direct_pieces\":%.0f},"
           "\"sent\":{\"slots\":%.0f,\"wait\":%.1f,\"gather\":%.1f,"
           "\"gather_lag\":%.1f,\"wire\":%.1f,\"ahead\":%.0f,"
           "\"direct_pieces\":%.0f}}",
           rx[0], rx[1], rx[2], rx[3], rx[4], rx[6], tx[0], tx[1], tx[3], tx[4],
           tx[2], tx[5], tx[6]);
    printf(",\"baseline\":");
    json_str(b->name);
    printf(",\"ctx_daemon\":");
    json_str(sh->address);
    printf(",\"gen_daemon\":");
    json_str(sh->gen_address);
}

static void report_json(const figures_t *f)
{
    printf("{\"gbps\":%.3f,\"baseline_gbps\":%.3f,\"ratio\":%.3f,"
           "\"verified\":%s,\"verify\":\"%s\",\"requests_per_s\":%.0f,"
           "\"p50_us\":%.1f,"
           "\"p99_us\":%.1f,\"bytes\":%llu,\"requests\":%u,\"blocks\":%u,"
           "\"ctx_layout\":\"%s\",\"gen_layout\":\"%s\",\"gpu\":%s,"
           "\"ctas\":%u,\"ctx_ranks\":%u,\"gen_ranks\":%u,"
           "\"window\":%u,\"pairs\":%u,\"ctx_pp\":%u,\"gen_pp\":%u,"
           "\"ctx_tpb\":%u,\"gen_tpb\":%u,\"skip_tokens\":%u,"
           "\"mla\":%s,\"mismatched_rows\":%llu,\"seconds\":%.4f,"
           "\"pool_offset\":%llu,\"vmm_chunk\":%llu,"
           "\"guard_bytes_changed\":%llu,\"regions\":%u,"
           "\"keyed\":%s,\"reserve\":%s,\"by_key\":%s,\"shuffle\":%s",
           f->gbps, f->b->gbps, f->ratio, f->verified ? "true" : "false",
           o.no_verify ? "none"
           : sampled() ? "sampled"
                       : "every byte",
           o.requests / f->secs, f->p50, f->p99, (unsigned long long)f->total,
           o.requests, o.blocks, o.ctx_layout, o.gen_layout,
           o.gpu ? "true" : "false", o.ctas, o.ctx_ranks, o.gen_ranks, o.window,
           o.pairs, o.ctx_pp, o.gen_pp, o.ctx_tpb, o.gen_tpb, o.skip,
           o.mla ? "true" : "false", (unsigned long long)sh->mismatches,
           f->secs, (unsigned long long)o.pool_offset,
           (unsigned long long)o.vmm_chunk,
           (unsigned long long)sh->guard_changed, o.regions,
           o.keyed ? "true" : "false", o.reserve ? "true" : "false",
           o.by_key ? "true" : "false", o.shuffle ? "true" : "false");
    json_passes(f);
    if (peers.gpu[0]) {
        printf(",\"gpu_status\":");
        json_str(peers.gpu);
    }
    if (o.daemons == 2)
        json_peers(f);
    if (o.trace)
        trace_report(stdout, 1);
    printf("}\n");
}

/* --daemons 2 as text: the daemons, UCX's figures and the slots. */
static void text_peers(const figures_t *f)
{
    const baseline_t *b = f->b;
    const char *tls = getenv("UCX_TLS");
    const double *rx = peers.rx, *tx = peers.tx;
    printf("  daemons: context on %s, generation on %s\n"
           "  slot %llu bytes, UCX_TLS %s, %u lanes (ucx_perftest: "
           "one connection, one thread a side)\n",
           sh->address, sh->gen_address, (unsigned long long)o.slot_bytes,
           tls ? tls : "(default)", peers.lanes);
    printf("  %-22s %12.3f GB/s%s\n", "ucx_perftest am_bw", b->ucx_gbps,
           b->nruns > 1 ? "  (median)" : "");
    if (b->ucx_msg_gbps > 0)
        printf("  %-22s %12.3f GB/s  (messages of %llu bytes, the "
               "daemons' pieces)\n",
               "ucx_perftest am_bw", b->ucx_msg_gbps,
               (unsigned long long)f->message_bytes);
    printf("  %-22s %12.3f GB/s  (100 messages)\n", "ucx_perftest put_bw",
           b->ucx_put_gbps);
    printf("  slots received by B  %.0f, per slot: wait %.0f us, "
           "wire %.0f us, scatter %.0f us (loop lag %.0f); %.0f "
           "pieces received straight into the blocks\n"
           "  slots sent by A      %.0f, per slot: wait %.0f us, "
           "gather %.0f us (loop lag %.0f), wire %.0f us; %.0f "
           "gathered ahead\n",
           rx[0], rx[1], rx[2], rx[3], rx[4], rx[6], tx[0], tx[1], tx[3], tx[4],
           tx[2], tx[5]);
    if (o.gpu && !o.ctx_host)
        printf("  %-22s %12.3f GB/s  (GPU %d to pinned host)\n", "D2H", b->d2h,
               o.ctx_device);
    if (o.gpu && !o.gen_host)
        printf("  %-22s %12.3f GB/s  (pinned host to GPU %d)\n", "H2D", b->h2d,
               o.gen_device);
    printf("  %-22s %12.3f GB/s  (%s, same run)\n", "baseline", b->gbps,
           b->name);
}

/* The lines after the baseline: ratio, passes, rates, verification and
 * what the options changed. */
static void text_tail(const figures_t *f)
{
    printf("  %-22s %12.3f%s\n", "ratio", f->ratio,
           o.passes > 1 ? "  (median of the passes' ratios)" : "");
    if (o.passes > 1) {
        printf("  %-22s", "passes GB/s");
        for (uint32_t ps = 0; ps < o.passes; ps++)
            printf(" %.3f", f->pass_gbps[ps]);
        printf("\n  %-22s", "passes ratio");
        for (uint32_t ps = 0; ps < o.passes; ps++)
            printf(" %.3f", f->pass_ratio[ps]);
        printf("\n");
    }
    printf("  %-22s %12.0f\n", "requests/s", o.requests / f->secs);
    printf("  %-22s %12.1f us\n", "latency p50", f->p50);
    printf("  %-22s %12.1f us\n", "latency p99", f->p99);
    printf("  %-22s %12s  (%llu mismatched rows%s)\n", "verified",
           o.no_verify   ? "skipped"
           : f->verified ? "yes"
                         : "NO",
           (unsigned long long)sh->mismatches,
           sampled() ? "; pools reused: a row of every block-layer run "
                       "per request, every byte of every slot after"
                     : "");
    if (o.keyed)
        printf("  %-22s %12s  (\"cmpl-R-0\" / \"decode-R\"%s%s)\n", "keys",
               "strings", o.reserve ? ", reserved first" : "",
               o.by_key ? ", fetched by key" : "");
    if (o.regions)
        printf("  %-22s %12u  (each rank's pool, each region its own "
               "allocation)\n",
               "regions", o.regions);
    if (o.guard)
        printf("  %-22s %12llu  (pools at offset %llu, guard bands "
               "around)\n",
               "guard bytes changed", (unsigned long long)sh->guard_changed,
               (unsigned long long)o.pool_offset);
    if (o.trace)
        trace_report(stdout, 0);
}

static void report_text(const figures_t *f)
{
    printf("kvxfer-bench: context tp %u pp %u (%s, %u tokens/block) -> "
           "generation tp %u pp %u (%s, %u tokens/block)%s\n"
           "  %u requests x %u tokens (skip %u), %u layers x %u KV heads "
           "x %u dim, %s%s, window %u\n",
           o.ctx_ranks, o.ctx_pp, o.ctx_layout, o.ctx_tpb, o.gen_ranks,
           o.gen_pp, o.gen_layout, o.gen_tpb, o.gpu ? ", GPU pools" : "",
           o.requests, num_tokens, o.skip, o.layers, o.heads, o.head_dim,
           kvx_dtype_name(o.dtype), o.mla ? ", MLA" : "", o.window);
    printf("  %-22s %12.3f GB/s  (%.1f MiB in %.4f s)\n", "kvxferd", f->gbps,
           f->total / 1048576.0, f->secs);
    if (o.daemons == 2)
        text_peers(f);
    else
        printf("  %-22s %12.3f GB/s  (same bytes, same run)\n",
               !o.gpu || (o.ctx_host && o.gen_host) ? "memcpy baseline"
               : o.ctx_host                         ? "H2D baseline"
               : o.gen_host                         ? "D2H baseline"
               : o.ctx_device == o.gen_device       ? "cudaMemcpy baseline"
                                                    : "cudaMemcpyPeer baseline",
               f->b->gbps);
    text_tail(f);
}

int report(uint64_t total, const ranks_result_t *res, const baseline_t *b)
{
    figures_t f;
    figures_of(total, res, b, &f);
    if (!(b->gbps > 0)) /* a ratio against nothing is no figure (nor JSON) */
        die("the baseline measured %.3f GB/s; no ratio can be given", b->gbps);
    if (o.json)
        report_json(&f);
    else
        report_text(&f);
    return o.no_verify || f.verified ? 0 : 1;
}
