/*
 * bench_opts — kvxfer-bench's options as one table: each long option's
 * name, argument, where it lands, its bounds and its help. getopt_long's
 * table, the parser and --help are made from it; the checks of options
 * against each other follow.
 */
#include <errno.h>
#include <getopt.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#ifdef KVX_CUDA
#include "bench_gpu.h"
#endif

struct opts o = {
    .ctx_ranks = 1,
    .gen_ranks = 1,
    .requests = 64,
    .blocks = 256,
    .window = 16,
    .layout = "vllm-nhd",
    .layers = 32,
    .heads = 8,
    .head_dim = 128,
    .tpb = 16,
    .dtype = KVX_DTYPE_BF16,
    .pool_cap_mib = 2048,
    .ctx_device = 0,
    .gen_device = 1,
    .pairs = 1,
    .ctx_pp = 1,
    .gen_pp = 1,
    .daemons = 1,
    .slot_bytes = 4u << 20,
    .baseline_runs = 1,
    .passes = 1,
};

cpu_set_t cpuset[2];

typedef struct bench_opt bench_opt_t;

/* What an option does with its argument. */
typedef enum opt_kind {
    OPT_FLAG, /* *(int *)at = 1 */
    OPT_STR,  /* *(const char **)at = the argument */
    OPT_U32,  /* *(uint32_t *)at = an integer in [min, max] */
    OPT_U64,  /* *(uint64_t *)at = an integer in [min, max] */
    OPT_INT,  /* *(int *)at = an integer in [min, max] */
    OPT_FN,   /* fn(opt, the argument) */
    OPT_HELP, /* --help */
} opt_kind_t;

struct bench_opt {
    const char *name;
    const char *arg; /* the argument's name in --help; NULL: none */
    opt_kind_t kind;
    void *at;
    uint32_t min, max;
    int *also;         /* set to 1 too (--reserve sets --keyed) */
    const char *label; /* the name in a bound error, if not name */
    void (*fn)(const bench_opt_t *opt, const char *v);
    /* --help: the left column (default "--name ARG"), and the text, a
     * line per '\n'; neither: the option is told of with another */
    const char *usage, *help;
};

static uint32_t arg_u32(const char *name, const char *v, uint32_t min,
                        uint32_t max)
{
    char *end;
    errno = 0;
    unsigned long x = strtoul(v, &end, 10);
    if (errno || *end || !*v || x < min || x > max) {
        fprintf(stderr,
                "kvxfer-bench: --%s: '%s' is not an integer in "
                "%u..%u\n",
                name, v, min, max);
        exit(2);
    }
    return (uint32_t)x;
}

static void cpus_parse(const char *name, const char *v, cpu_set_t *set)
{
    long ncpu = sysconf(_SC_NPROCESSORS_CONF);
    CPU_ZERO(set);
    const char *p = v;
    while (*p) {
        char *end;
        errno = 0;
        long a = strtol(p, &end, 10), b = a;
        if (end == p || errno)
            goto bad;
        if (*end == '-') {
            p = end + 1;
            b = strtol(p, &end, 10);
            if (end == p || errno)
                goto bad;
        }
        if (a < 0 || b < a || b >= ncpu || b >= CPU_SETSIZE) {
            fprintf(stderr,
                    "kvxfer-bench: --%s '%s': CPUs %ld-%ld are not "
                    "in 0..%ld\n",
                    name, v, a, b, ncpu - 1);
            exit(2);
        }
        for (long c = a; c <= b; c++)
            CPU_SET((int)c, set);
        p = end;
        if (*p == ',')
            p++;
        else if (*p)
            goto bad;
    }
    if (CPU_COUNT(set))
        return;
bad:
    fprintf(stderr,
            "kvxfer-bench: --%s '%s': expected a CPU list such as "
            "0-7,16\n",
            name, v);
    exit(2);
}

/* --cpus-a, --cpus-b */
static void opt_cpus(const bench_opt_t *opt, const char *v)
{
    int k = (const char **)opt->at == &o.cpus[1];
    o.cpus[k] = v;
    cpus_parse(opt->name, v, &cpuset[k]);
}

static void opt_layerwise(const bench_opt_t *opt, const char *v)
{
    (void)opt;
    char *end;
    o.layerwise_ms = strtod(v, &end);
    if (*end || !(o.layerwise_ms >= 0) || o.layerwise_ms > 60000) {
        fprintf(stderr,
                "kvxfer-bench: --layerwise '%s': "
                "milliseconds a layer, 0 to 60000\n",
                v);
        exit(2);
    }
    o.layerwise = 1;
}

static void opt_peer_config(const bench_opt_t *opt, const char *v)
{
    (void)opt;
    if (o.npeer_config == MAX_PEER_CONFIG || strchr(v, '\n') ||
        !strchr(v, ':')) {
        fprintf(stderr,
                "kvxfer-bench: --peer-config '%s': one "
                "'KEY: VALUE' line, at most 16 of them\n",
                v);
        exit(2);
    }
    o.peer_config[o.npeer_config++] = v;
}

static void opt_dtype(const bench_opt_t *opt, const char *v)
{
    (void)opt;
    if (kvx_dtype_parse(v, &o.dtype)) {
        fprintf(stderr, "kvxfer-bench: --dtype: unknown '%s'\n", v);
        exit(2);
    }
}

#define FLAG(n, field, h)                                                      \
    {                                                                          \
        .name = n, .kind = OPT_FLAG, .at = &o.field, .help = h                 \
    }
#define STR(n, a, field, h)                                                    \
    {                                                                          \
        .name = n, .arg = a, .kind = OPT_STR, .at = &o.field, .help = h        \
    }
#define U32(n, a, field, lo, hi, h)                                            \
    {                                                                          \
        .name = n, .arg = a, .kind = OPT_U32, .at = &o.field, .min = lo,       \
        .max = hi, .help = h                                                   \
    }
#define FN(n, a, f, h)                                                         \
    {                                                                          \
        .name = n, .arg = a, .kind = OPT_FN, .fn = f, .help = h                \
    }

/* In the order of --help. */
static const bench_opt_t table[] = {
    STR("socket", "PATH", socket, NULL),
    FLAG("spawn-daemon", spawn, NULL),
    {.name = "ctx-tp",
     .arg = "N",
     .kind = OPT_U32,
     .at = &o.ctx_ranks,
     .min = 1,
     .max = 64,
     .label = "ctx-ranks",
     .usage = "--ctx-tp N, --gen-tp M",
     .help = "TP of each side (also --ctx-ranks,\n--gen-ranks), default 1"},
    {.name = "gen-tp",
     .arg = "M",
     .kind = OPT_U32,
     .at = &o.gen_ranks,
     .min = 1,
     .max = 64,
     .label = "gen-ranks"},
    U32("ctx-ranks", "N", ctx_ranks, 1, 64, NULL),
    U32("gen-ranks", "M", gen_ranks, 1, 64, NULL),
    {.name = "ctx-pp",
     .arg = "N",
     .kind = OPT_U32,
     .at = &o.ctx_pp,
     .min = 1,
     .max = 64,
     .usage = "--ctx-pp N, --gen-pp M",
     .help = "PP of each side (layers split evenly)"},
    U32("gen-pp", "M", gen_pp, 1, 64, NULL),
    {.name = "ctx-tokens-per-block",
     .arg = "T",
     .kind = OPT_U32,
     .at = &o.ctx_tpb,
     .min = 1,
     .max = 65536,
     .usage = "--ctx-tokens-per-block T, --gen-tokens-per-block T",
     .help = ""},
    U32("gen-tokens-per-block", "T", gen_tpb, 1, 65536, NULL),
    U32("skip-tokens", "S", skip, 0, UINT32_MAX - 1,
        "prefix reuse: fetch moves tokens >= S"),
    FLAG("mla", mla, "MLA: K only, one latent head, mla layout"),
    U32("requests", "R", requests, 1, 10000000, "requests, default 64"),
    U32("blocks", "B", blocks, 1, 10000000,
        "context blocks per request, default 256"),
    U32("window", "W", window, 1, 65536,
        "requests outstanding per gen rank, default 16"),
    STR("layout", "PRESET", layout,
        "trtllm, vllm-nhd, vllm-hnd, flashinfer, sglang, mla"),
    {.name = "layers",
     .arg = "L",
     .kind = OPT_U32,
     .at = &o.layers,
     .min = 1,
     .max = KVX_MAX_LAYERS,
     .usage = "--layers L --heads H --head-dim D --tokens-per-block T",
     .help = ""},
    U32("heads", "H", heads, 1, 4096, NULL),
    U32("head-dim", "D", head_dim, 1, 2048, NULL),
    U32("tokens-per-block", "T", tpb, 1, 65536, NULL),
    FN("dtype", "fp32|fp16|bf16|fp8|int8", opt_dtype, ""),
    {.name = "pool-mib",
     .arg = "N",
     .kind = OPT_U64,
     .at = &o.pool_cap_mib,
     .min = 1,
     .max = 1 << 20,
     .help = "cap per rank pool (blocks are reused), default 2048"},
    FLAG("no-verify", no_verify, "skip the byte check"),
    FLAG("trace", trace,
         "with --spawn-daemon: each timed request's\n"
         "hops (the daemon's log.trace_file and\n"
         "the generation rank 0's clock), p50/p99;\n"
         "with --layerwise, the daemon's part of\n"
         "the exposed time (to its event queued)"),
    FLAG("verify-each", verify_each,
         "host pools smaller than the requests:\n"
         "write and check every byte of every\n"
         "request inside the timed pass (default:\n"
         "each slot written once, a row of every\n"
         "block-layer run checked per request,\n"
         "every byte of every slot after the pass)"),
    FLAG("no-warmup", no_warmup, "time the first pass over the pools too"),
    U32("passes", "N", passes, 1, MAX_PASSES,
        "timed passes (1 to 16): the medians are reported;\n"
        "with --daemons 2, each pass has its own ucx_perftest run\n"
        "right after it (instead of --baseline-runs), and the\n"
        "ratio is the median of the passes' ratios"),
    STR("pass-times", "FILE", pass_times,
        "append each timed pass's first fetch and last\n"
        "completion (CLOCK_MONOTONIC ns) to FILE, a line\n"
        "a pass: for a load running beside the bench\n"
        "(scripts/gpu-engine-load.py)"),
    STR("daemon-config", "FILE", daemon_config,
        "config for --spawn-daemon; with --daemons 2 it is\n"
        "appended to each generated config (so it must not\n"
        "repeat peer:, nor gpu: with --ctas)"),
    U32("daemons", "1|2", daemons, 1, 2,
        "2: with --spawn-daemon, context ranks on daemon A,\n"
        "generation ranks on daemon B (peer.listen 127.0.0.1:0,\n"
        "a fresh secret); baseline ucx_perftest ucp_am_bw\n"
        "(package ucx-utils), with --gpu the slowest of it,\n"
        "D2H and H2D"),
    /* the bounds of the daemon's peer.slot_bytes */
    {.name = "slot-bytes",
     .arg = "N",
     .kind = OPT_U64,
     .at = &o.slot_bytes,
     .min = 64u << 10,
     .max = 1u << 30,
     .help = "peer.slot_bytes of both daemons and the ucx_perftest\n"
             "message size, in bytes (default 4194304)"},
    {.name = "cpus-a",
     .arg = "LIST",
     .kind = OPT_FN,
     .at = &o.cpus[0],
     .fn = opt_cpus,
     .usage = "--cpus-a LIST, --cpus-b LIST ",
     .help = "run daemon A and the ucx_perftest client\n"
             "(senders) on LIST, daemon B and the server on the\n"
             "other (e.g. 0-7 and 8-15)"},
    {.name = "cpus-b",
     .arg = "LIST",
     .kind = OPT_FN,
     .at = &o.cpus[1],
     .fn = opt_cpus},
    U32("baseline-runs", "N", baseline_runs, 1, 9,
        "ucx_perftest N times (1 to 9), the median is the\n"
        "baseline (default 1)"),
    {.name = "peer-config",
     .arg = "'KEY: VALUE'",
     .kind = OPT_FN,
     .fn = opt_peer_config,
     .usage = "--peer-config 'KEY: VALUE' ",
     .help = "a line of both daemons' peer section, e.g.\n"
             "'slots: 16' (repeatable, up to 16)"},
    STR("ucx-tls", "LIST", ucx_tls,
        "UCX_TLS of both daemons and ucx_perftest (default:\n"
        "UCX_TLS as it is in this environment)"),
    {.name = "ctx-layout",
     .arg = "P",
     .kind = OPT_STR,
     .at = &o.ctx_layout,
     .usage = "--ctx-layout P, --gen-layout P  ",
     .help = "a preset per side (default --layout)"},
    STR("gen-layout", "P", gen_layout, NULL),
    FLAG("gpu", gpu, "pools in GPU memory (CUDA build)"),
    {.name = "ctx-device",
     .arg = "N",
     .kind = OPT_INT,
     .at = &o.ctx_device,
     .min = 0,
     .max = 63,
     .usage = "--ctx-device N, --gen-device N  ",
     .help = "GPUs (default 0 and 1; 0 and 0 with one GPU)"},
    {.name = "gen-device",
     .arg = "N",
     .kind = OPT_INT,
     .at = &o.gen_device,
     .min = 0,
     .max = 63,
     .also = &o.gen_device_set},
    FLAG("vmm", vmm, "cuMemCreate (VMM fd) pools, not cudaMalloc"),
    {.name = "vmm-chunk",
     .arg = "BYTES",
     .kind = OPT_U64,
     .at = &o.vmm_chunk,
     .min = 1,
     .max = 1u << 31,
     .also = &o.vmm,
     .help = "--vmm pools made of physical allocations of BYTES,\n"
             "mapped back to back (PyTorch expandable segments)"},
    {.name = "pool-offset",
     .arg = "BYTES",
     .kind = OPT_U64,
     .at = &o.pool_offset,
     .min = 0,
     .max = 1u << 30,
     .also = &o.guard,
     .help = "every pool starts BYTES into a larger allocation;\n"
             "guard bands around it are checked unchanged"},
    FLAG("keyed", keyed,
         "requests named by string keys (\"cmpl-R-0\",\n"
         "\"decode-R\"): kvx_publish_key, kvx_fetch_key"),
    {.name = "reserve",
     .kind = OPT_FLAG,
     .at = &o.reserve,
     .also = &o.keyed,
     .help = "--keyed, and context rank 0's scheduler\n"
             "reserves each request (kvx_reserve) before\n"
             "the publish; the generation side fetches\n"
             "with the reserved params at once"},
    {.name = "by-key",
     .kind = OPT_FLAG,
     .at = &o.by_key,
     .also = &o.keyed,
     .help = "--keyed, and the generation side fetches\n"
             "by key (kvx_fetch_by_key), no params"},
    U32("regions", "N", regions, 1, MAX_REGIONS_BENCH,
        "each rank's pool as N regions, each its own allocation:\n"
        "a region per layer (N = the rank's layers) or a K\n"
        "and a V region per layer (twice that), host or --gpu"),
    U32("ctas", "N", ctas, 1, 1024, "gpu.max_ctas of the spawned daemon"),
    FLAG("shuffle", shuffle,
         "each side's block ids a random permutation of its\n"
         "pool (its own per side), as an engine's block tables\n"
         "look after reuse (a request's blocks seldom adjacent)"),
    {.name = "ctx-host",
     .kind = OPT_FLAG,
     .at = &o.ctx_host,
     .usage = "--ctx-host, --gen-host",
     .help = "with --gpu: that side in host memory"},
    FLAG("gen-host", gen_host, NULL),
    U32("pairs", "P", pairs, 1, 64,
        "P independent context/generation instance pairs\n"
        "sharing the requests (daemon-wide throughput)"),
    FN("layerwise", "MS", opt_layerwise,
       "one context and one generation rank, one\n"
       "request at a time: a prefill makes a\n"
       "layer ready every MS ms (a spinning\n"
       "kernel and an IPC event per layer with\n"
       "--gpu); reports the exposed transfer\n"
       "time (last layer ready to COMPLETE)\n"
       "layer-wise and published whole, one\n"
       "layer's transfer time, and streamed vs\n"
       "whole bandwidth"),
    FLAG("batch", batch,
         "each rank hands the daemon every request\n"
         "it may start in one call\n"
         "(kvx_publish_many, kvx_fetch_many: one\n"
         "round trip for up to 256), as an engine\n"
         "does a step's batch"),
    FLAG("poll-spin", poll_spin,
         "with --layerwise: the generation rank\n"
         "polls without waiting, over and over, as\n"
         "an engine's step loop does, instead of one\n"
         "poll that blocks (then the exposed time\n"
         "holds its thread's wake-up)"),
    FLAG("json", json, "one JSON object on stdout"),
    {.name = "help", .kind = OPT_HELP},
};

#define NOPTS (sizeof(table) / sizeof(table[0]))
/* getopt_long returns table[i]'s as OPT_VAL0 + i: past any character it
 * returns itself ('?') */
#define OPT_VAL0 256

/* The left column of --help is this wide; the text's lines after the
 * first start under its first. */
#define USAGE_COL 22

static void usage(FILE *f)
{
    fprintf(f, "usage: kvxfer-bench [--socket PATH | --spawn-daemon] "
               "[options]\n");
    for (size_t i = 0; i < NOPTS; i++) {
        const bench_opt_t *t = &table[i];
        if (!t->help)
            continue;
        char left[96];
        if (t->usage)
            snprintf(left, sizeof(left), "%s", t->usage);
        else
            snprintf(left, sizeof(left), "--%s%s%s", t->name, t->arg ? " " : "",
                     t->arg ? t->arg : "");
        if (!*t->help) {
            fprintf(f, "  %s\n", left);
            continue;
        }
        fprintf(f, "  %-*s ", USAGE_COL, left);
        for (const char *h = t->help; *h;) {
            size_t n = strcspn(h, "\n");
            fprintf(f, "%.*s\n", (int)n, h);
            h += n;
            if (*h == '\n' && *++h)
                fprintf(f, "%*s", USAGE_COL + 3, "");
        }
    }
}

static void opt_set(const bench_opt_t *t, const char *v)
{
    const char *label = t->label ? t->label : t->name;
    switch (t->kind) {
    case OPT_FLAG:
        *(int *)t->at = 1;
        break;
    case OPT_STR:
        *(const char **)t->at = v;
        break;
    case OPT_U32:
        *(uint32_t *)t->at = arg_u32(label, v, t->min, t->max);
        break;
    case OPT_U64:
        *(uint64_t *)t->at = arg_u32(label, v, t->min, t->max);
        break;
    case OPT_INT:
        *(int *)t->at = (int)arg_u32(label, v, t->min, t->max);
        break;
    case OPT_FN:
        t->fn(t, v);
        break;
    case OPT_HELP:
        usage(stdout);
        exit(0);
    }
    if (t->also)
        *t->also = 1;
}

void opts_parse(int argc, char **argv)
{
    struct option lo[NOPTS + 1];
    for (size_t i = 0; i < NOPTS; i++)
        lo[i] = (struct option){table[i].name,
                                table[i].arg ? required_argument : no_argument,
                                NULL, OPT_VAL0 + (int)i};
    lo[NOPTS] = (struct option){NULL, 0, NULL, 0};
    int opt;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (opt < OPT_VAL0 || opt >= OPT_VAL0 + (int)NOPTS) {
            usage(stderr);
            exit(2);
        }
        opt_set(&table[opt - OPT_VAL0], optarg);
    }
}

/* The options that go only with others. */
static int opts_check_pairs(void)
{
    if (o.regions && o.guard) {
        fprintf(stderr, "kvxfer-bench: --regions and --pool-offset: one "
                        "or the other\n");
        return 2;
    }
    if (o.ctas && !o.spawn) {
        fprintf(stderr, "kvxfer-bench: --ctas needs --spawn-daemon (it is "
                        "the daemon's gpu.max_ctas)\n");
        return 2;
    }
    if (o.batch && (o.reserve || o.by_key || o.layerwise)) {
        fprintf(stderr, "kvxfer-bench: --batch goes without --reserve, "
                        "--by-key and --layerwise\n");
        return 2;
    }
    if (o.poll_spin && !o.layerwise) {
        fprintf(stderr, "kvxfer-bench: --poll-spin goes with --layerwise\n");
        return 2;
    }
    if (o.trace && (!o.spawn || o.daemons != 1)) {
        fprintf(stderr, "kvxfer-bench: --trace needs --spawn-daemon with one "
                        "daemon (it reads that daemon's log.trace_file)\n");
        return 2;
    }
    return 0;
}

/* The options of two daemons. */
static int opts_check_daemons(void)
{
    if (o.daemons == 2 && !o.spawn) {
        fprintf(stderr, "kvxfer-bench: --daemons 2 needs --spawn-daemon\n");
        return 2;
    }
    if (o.passes > 1 && o.baseline_runs != 1) {
        fprintf(stderr, "kvxfer-bench: --baseline-runs and --passes: with "
                        "passes, each pass has its own ucx_perftest run\n");
        return 2;
    }
    if (o.daemons == 1 &&
        (o.ucx_tls || o.slot_bytes != 4u << 20 || o.npeer_config ||
         o.baseline_runs != 1 || o.cpus[0] || o.cpus[1])) {
        fprintf(stderr, "kvxfer-bench: --slot-bytes, --peer-config, "
                        "--baseline-runs, --cpus-a/b and "
                        "--ucx-tls are for "
                        "--daemons 2 (one daemon moves no bytes over "
                        "UCX)\n");
        return 2;
    }
    return 0;
}

int opts_check(void)
{
    if (!o.spawn && !o.socket)
        o.socket = KVX_DEFAULT_SOCKET;
    if (!o.ctx_layout)
        o.ctx_layout = o.layout;
    if (!o.gen_layout)
        o.gen_layout = o.layout;
#ifndef KVX_CUDA
    if (o.gpu) {
        fprintf(stderr, "kvxfer-bench: --gpu: this build has no CUDA\n");
        return 2;
    }
#endif
    int rc = opts_check_pairs();
    if (rc)
        return rc;
#ifdef KVX_CUDA
    if (o.gpu && !o.gen_device_set && !o.gen_host && bgpu_device_count() == 1) {
        /* one GPU: both sides on it */
        o.gen_device = 0;
        fprintf(stderr, "kvxfer-bench: one GPU: the generation side uses "
                        "GPU 0 too (--gen-device)\n");
    }
#endif
    return opts_check_daemons();
}
