/*
 * kvxfer-bench — drive a real kvxferd with synthetic engine ranks.
 *
 * N context ranks and M generation ranks run as separate processes, each
 * with its own connection and host pool, exactly as engines would. Context
 * ranks fill their blocks with a reference pattern and publish; the parent
 * plays the router (context params travel through shared memory);
 * generation ranks fetch with up to --window requests outstanding and poll
 * for completions. Every destination byte is checked against the pattern,
 * computed from (request, layer, kv, token, head) alone, never through the
 * daemon's plan. The baseline is memcpy of the same number of bytes in the
 * same run; the ratio is reported beside it.
 *
 * With --daemons 2 the context ranks use one spawned daemon and the
 * generation ranks another, so every byte crosses between daemons over
 * UCX. The baseline is then ucx_perftest ucp_am_bw between two processes
 * of this host with the daemons' slot size and UCX_TLS (the daemons move
 * slots as UCX active messages), and with GPU pools the slowest of that,
 * device-to-host and host-to-device copies (the host-staged path).
 *
 * This file is the table of contents: options, the shape of the run, the
 * shared memory, the daemons, then --layerwise or the ranks, the
 * baselines and the report (bench.h names the files of each).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "bench.h"

uint32_t num_tokens, kvf, reqs_in_pool;
struct shared *sh;
uint8_t *slots;
uint64_t *lat_ns;
uint64_t *call_ns, *ev_ns;

void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (sh) {
        if (atomic_fetch_add(&sh->failed, 1) == 0)
            snprintf(sh->error_text, sizeof(sh->error_text), "%s", buf);
    }
    fprintf(stderr, "kvxfer-bench: %s\n", buf);
    exit(1);
}

/* --mla, the tokens per block of each side, --skip-tokens, and whether
 * each side's layout preset, heads and layers take this shape. */
static int shape_check(void)
{
    /* MLA: one latent "head", K only, the mla layout on both sides */
    kvf = 2;
    if (o.mla) {
        kvf = 1;
        o.heads = 1;
        if (o.ctx_layout == o.layout)
            o.ctx_layout = "mla";
        if (o.gen_layout == o.layout)
            o.gen_layout = "mla";
    }
    if (!o.ctx_tpb)
        o.ctx_tpb = o.tpb;
    if (!o.gen_tpb)
        o.gen_tpb = o.tpb;
    num_tokens = o.blocks * o.ctx_tpb; /* --blocks counts context blocks */
    if (o.skip >= num_tokens) {
        fprintf(stderr,
                "kvxfer-bench: --skip-tokens %u leaves nothing of "
                "%u tokens\n",
                o.skip, num_tokens);
        return 2;
    }
    const char *presets[2] = {o.ctx_layout, o.gen_layout};
    uint32_t tpbs[2] = {o.ctx_tpb, o.gen_tpb};
    for (int k = 0; k < 2; k++) {
        kvx_layout_t probe;
        if (kvx_layout_preset(presets[k], 1, kvf, 1, o.head_dim, o.dtype,
                              tpbs[k], 1, &probe)) {
            fprintf(stderr,
                    "kvxfer-bench: %s layout '%s' does not take "
                    "this shape (mla: --mla; sglang: 1 token per "
                    "block)\n",
                    k ? "generation" : "context", presets[k]);
            return 2;
        }
    }
    uint32_t tps[2] = {o.ctx_ranks, o.gen_ranks};
    uint32_t pps[2] = {o.ctx_pp, o.gen_pp};
    for (int k = 0; k < 2; k++) {
        if (o.heads >= tps[k] ? o.heads % tps[k] : tps[k] % o.heads) {
            fprintf(stderr,
                    "kvxfer-bench: --heads %u do not split over tp "
                    "%u\n",
                    o.heads, tps[k]);
            return 2;
        }
        if (pps[k] > o.layers) {
            fprintf(stderr, "kvxfer-bench: pp %u exceeds --layers %u\n", pps[k],
                    o.layers);
            return 2;
        }
    }
    return 0;
}

/* The requests that fit a rank pool at once (reqs_in_pool), and in
 * *total the bytes the generation ranks receive. */
static int shape_bytes(uint64_t *total)
{
    uint32_t tps[2] = {o.ctx_ranks, o.gen_ranks};
    uint32_t pps[2] = {o.ctx_pp, o.gen_pp};
    uint32_t tpbs[2] = {o.ctx_tpb, o.gen_tpb};
    /* bytes: the largest rank pool per request, and the whole transfer */
    uint64_t row = (uint64_t)o.head_dim * kvx_dtype_size(o.dtype);
    uint64_t req_rank_bytes = 0;
    for (int k = 0; k < 2; k++) {
        uint64_t heads = o.heads >= tps[k] ? o.heads / tps[k] : 1;
        uint64_t layers = (o.layers + pps[k] - 1) / pps[k];
        uint64_t bpr = (num_tokens + tpbs[k] - 1) / tpbs[k];
        uint64_t b = bpr * tpbs[k] * layers * kvf * heads * row;
        if (b > req_rank_bytes)
            req_rank_bytes = b;
    }
    uint64_t fit = (o.pool_cap_mib << 20) / req_rank_bytes;
    if (fit == 0) {
        fprintf(stderr,
                "kvxfer-bench: one request (%llu bytes per rank) "
                "exceeds --pool-mib %llu\n",
                (unsigned long long)req_rank_bytes,
                (unsigned long long)o.pool_cap_mib);
        return 2;
    }
    uint32_t per_pair_reqs = o.requests / o.pairs;
    reqs_in_pool = fit < per_pair_reqs ? (uint32_t)fit : per_pair_reqs;
    /* every generation rank receives its heads of every layer */
    uint64_t gen_heads = o.heads >= o.gen_ranks ? o.heads / o.gen_ranks : 1;
    *total = (uint64_t)o.requests * (num_tokens - o.skip) * o.layers * kvf *
             gen_heads * o.gen_ranks * row;
    return 0;
}

/* The memory the ranks share with the parent: struct shared, the params
 * slots (timed requests, then each pair's warm-up ones), then the
 * latencies and --trace's times of the timed requests. */
static void shared_map(void)
{
    size_t nslots = (size_t)o.requests + (size_t)o.pairs * reqs_in_pool;
    size_t shlen = sizeof(struct shared) + nslots * PARAMS_SLOT +
                   3 * (size_t)o.requests * sizeof(uint64_t);
    void *m = mmap(NULL, shlen, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        die("mmap %zu shared bytes: %s", shlen, strerror(errno));
    sh = m;
    slots = (uint8_t *)(sh + 1);
    lat_ns = (uint64_t *)(slots + nslots * PARAMS_SLOT);
    call_ns = lat_ns + o.requests;
    ev_ns = call_ns + o.requests;
}

/* --daemons 2: ucx_perftest, the baseline, and UCX_TLS for it and the
 * daemons; NULL with one daemon. Exits 2 without it. */
static const char *perftest_find(void)
{
    if (o.daemons != 2)
        return NULL;
    const char *perftest = perftest_binary();
    if (!perftest) {
        fprintf(stderr, "kvxfer-bench: --daemons 2: ucx_perftest not "
                        "found (install the ucx-utils package, or set "
                        "KVX_UCX_PERFTEST); it is the baseline\n");
        exit(2);
    }
    /* inherited by both daemons and ucx_perftest */
    if (o.ucx_tls && setenv("UCX_TLS", o.ucx_tls, 1)) {
        fprintf(stderr, "kvxfer-bench: setenv UCX_TLS: %s\n", strerror(errno));
        exit(2);
    }
    return perftest;
}

static int run_layerwise(daemons_t *d)
{
    if (o.daemons != 1 || o.ctx_ranks * o.ctx_pp != 1 ||
        o.gen_ranks * o.gen_pp != 1 || o.pairs != 1 || o.skip)
        die("--layerwise: one daemon, one context and one generation "
            "rank (no --daemons 2, tp, pp, --pairs or --skip-tokens)");
    int rc = layerwise_main();
    daemons_stop(d);
    return rc;
}

static int run_ranks(daemons_t *d, const char *perftest, uint64_t total)
{
    baseline_t b = {0};
    /* CUDA must not be initialized before fork: the GPU baseline runs
     * after the ranks are done; ucx_perftest too, with the daemons gone */
    b.gbps = o.gpu || o.daemons == 2 ? 0 : memcpy_baseline(total);
    ranks_result_t res = {0};
    ranks_run(perftest, total, &res);
    if (o.daemons == 2 && !res.failed)
        res.message_bytes = peers_read();
    if (!res.failed) /* the copy engines' counts, a pace's holds */
        gpu_status_read();
    daemons_stop(d);
    if (res.failed) {
        daemons_print_logs();
        fprintf(stderr, "kvxfer-bench: failed: %s\n",
                sh->error_text[0] ? sh->error_text : "a rank crashed");
        return 1;
    }
    baseline_measure(perftest, total, &res, &b);
    return report(total, &res, &b);
}

int main(int argc, char **argv)
{
    opts_parse(argc, argv);
    int rc = opts_check();
    if (rc)
        return rc;
    const char *perftest = perftest_find();
    if (o.requests % o.pairs) {
        fprintf(stderr,
                "kvxfer-bench: --requests %u must divide over "
                "--pairs %u\n",
                o.requests, o.pairs);
        return 2;
    }
    uint64_t total;
    if ((rc = shape_check()) || (rc = shape_bytes(&total)))
        return rc;
    shared_map();
    daemons_t d;
    daemons_start(&d);
    if (o.layerwise)
        return run_layerwise(&d);
    return run_ranks(&d, perftest, total);
}
