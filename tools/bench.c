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
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_pattern.h"
#ifdef KVX_CUDA
#include "bench_gpu.h"
#endif
#include "kvxfer.h"

#define PARAMS_SLOT 2048

#define TIMEOUT_MS 30000
/* Warm-up requests use ids from here; their params use slots after the
 * timed requests' slots. */
#define WARM_BASE (1ull << 40)

static struct opts {
    const char *socket;
    int spawn;
    uint32_t ctx_ranks, gen_ranks, requests, blocks, window;
    const char *layout;
    uint32_t layers, heads, head_dim, tpb;
    kvx_dtype_t dtype;
    int json;
    uint64_t pool_cap_mib;
    int no_verify, no_warmup, verify_each, trace;
    const char *daemon_config;
    const char *ctx_layout, *gen_layout;
    int gpu, vmm, ctx_device, gen_device, ctx_host, gen_host;
    int gen_device_set;            /* --gen-device given */
    uint32_t pairs;       /* independent (context, generation) instance pairs */
    uint32_t ctx_pp, gen_pp, ctx_tpb, gen_tpb, skip;
    int mla;
    uint32_t ctas;
    uint32_t daemons;     /* 2: context ranks on daemon A, generation on B */
    const char *gen_socket; /* the generation ranks' daemon */
    uint64_t slot_bytes;  /* peer.slot_bytes of both daemons */
    const char *peer_config[16]; /* --peer-config lines, peer section */
    uint32_t baseline_runs;        /* ucx_perftest runs, the median taken */
    uint32_t passes;               /* timed passes over the requests */
    const char *cpus[2];           /* --cpus-a, --cpus-b: CPU lists */
    uint32_t npeer_config;
    const char *ucx_tls;
    int guard;            /* --pool-offset given */
    uint64_t pool_offset; /* pools start this far into their
                             allocation, guard bands around */
    uint64_t vmm_chunk;   /* --vmm-chunk: VMM pools of several
                             physical allocations */
    uint32_t regions;     /* --regions: each rank's pool as this many
                             regions, each its own allocation (0: one) */
    int keyed;            /* --keyed: string keys, "cmpl-R-0" and "decode-R" */
    int reserve; /* --reserve: a scheduler reserves each request first */
    int by_key;  /* --by-key: generation fetches by key, no params */
    double layerwise_ms; /* --layerwise MS: a layer ready every MS ms */
    int layerwise;
    int poll_spin; /* --poll-spin: the generation rank polls, never waits */
    int batch;     /* --batch: publishes and fetches many to a call */
    int shuffle; /* --shuffle: each side's block ids a permutation */
} o = {
    .ctx_ranks = 1, .gen_ranks = 1, .requests = 64, .blocks = 256,
    .window = 16, .layout = "vllm-nhd", .layers = 32, .heads = 8,
    .head_dim = 128, .tpb = 16, .dtype = KVX_DTYPE_BF16,
    .pool_cap_mib = 2048, .ctx_device = 0, .gen_device = 1, .pairs = 1,
    .ctx_pp = 1, .gen_pp = 1, .daemons = 1, .slot_bytes = 4u << 20,
    .baseline_runs = 1, .passes = 1,
};

#define MAX_PASSES 16

/* Shared between the parent and the rank processes. */
struct shared {
    _Atomic uint32_t ready;          /* ranks connected and registered */
    _Atomic uint32_t go;
    _Atomic uint32_t ready2, go2;     /* between warm-up and timed pass */
    _Atomic uint32_t ready3, go3;     /* before any rank disconnects */
    /* after each timed pass (--passes): the parent takes its time and,
     * with --daemons 2, runs ucx_perftest once while the daemons idle */
    _Atomic uint32_t pass_ready[MAX_PASSES], pass_go[MAX_PASSES];
    /* passes after the first: between the warm-up and the timed run */
    _Atomic uint32_t warm_ready[MAX_PASSES], warm_go[MAX_PASSES];
    _Atomic uint32_t failed;
    char address[192];               /* daemon of the context ranks */
    char gen_address[192];           /* daemon of the generation ranks */
    _Atomic uint64_t first_fetch_ns, last_done_ns;
    _Atomic uint64_t mismatches, verified_bytes, errors, sampled_reqs;
    _Atomic uint64_t guard_changed; /* guard-band bytes found changed */
    char error_text[512];
    /* then: params slots, then latencies of gen rank 0 */
};

/* Derived from the options: tokens per request, KV factor, and each side's
 * blocks per request. */
static uint32_t num_tokens, kvf;

static struct shared *sh;
static uint8_t *slots;        /* requests x PARAMS_SLOT: u32 ready, u32 len, data */
static uint64_t *lat_ns;      /* requests */
static uint64_t *call_ns, *ev_ns; /* --trace: each timed request's fetch
                                     call and event, monotonic ns */
static uint32_t reqs_in_pool; /* requests that fit the pool at once */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void die(const char *fmt, ...)
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

#define CHECK_KVX(call, c)                                                  \
    do {                                                                    \
        int rc_ = (call);                                                   \
        if (rc_)                                                            \
            die("%s: %s: %s", #call, kvx_status_str(rc_),                   \
                kvx_last_error(c));                                         \
    } while (0)

/* ---- reference pattern ------------------------------------------------ */

/* The bytes of one (request, layer, kv, token, head) row of head_dim
 * elements, in global coordinates (bench_pattern.h). */
static inline void row_fill(uint8_t *dst, uint32_t rowbytes, uint64_t r,
                            uint32_t l, uint32_t kv, uint32_t t, uint32_t h)
{
    uint64_t seed = pat_seed(r, l, kv, t, h);
    uint32_t i = 0;
    for (; i + 8 <= rowbytes; i += 8) {
        uint64_t w = pat_word(seed, i);
        memcpy(dst + i, &w, 8);
    }
    for (; i < rowbytes; i++)
        dst[i] = pat_byte(seed, i);
}

static inline int row_check(const uint8_t *src, uint32_t rowbytes, uint64_t r,
                            uint32_t l, uint32_t kv, uint32_t t, uint32_t h)
{
    uint8_t small[4096], *want = small;
    if (rowbytes > sizeof(small) && !(want = malloc(rowbytes)))
        die("out of memory checking a row of %u bytes", rowbytes);
    row_fill(want, rowbytes, r, l, kv, t, h); /* the whole row */
    int ok = memcmp(src, want, rowbytes) == 0;
    if (want != small)
        free(want);
    return ok;
}

/* Visit every row of request r held by one rank's blocks. */
#define MAX_REGIONS_BENCH (2 * KVX_MAX_LAYERS)

typedef struct rank_view {
    uint8_t *base;        /* host pool mapping, or the GPU pool */
    kvx_layout_t layout;
    /* the pool's regions: one (base), or --regions allocations */
    uint32_t nregions;
    uint8_t *rbase[MAX_REGIONS_BENCH];
    uint64_t rsize[MAX_REGIONS_BENCH];
    kvx_layout_part_t parts[2 * KVX_MAX_LAYERS];
    uint32_t head0;       /* first global head of the rank */
    uint32_t layer0;      /* first global layer of the rank (PP) */
    uint32_t bpr;         /* blocks per request on this side */
    int device;           /* >= 0: GPU pool on this device */
    uint8_t *alloc;       /* --pool-offset: the allocation around base */
    uint64_t alloc_len;
    uint32_t pool; /* --layerwise: the pool's id */
    uint32_t *perm; /* --shuffle: pool block of each request slot block */
} rank_view_t;

/* --pool-offset: every pool starts o.pool_offset bytes into an
 * allocation that runs GUARD_TAIL bytes past it; both bands hold
 * GUARD_BYTE and are checked unchanged when the rank ends. */
#define GUARD_TAIL 65536
#define GUARD_BYTE 0xa5

static uint32_t my_pair; /* which instance pair this rank process is in */

static uint8_t *slot_of(uint64_t r)
{
    uint64_t idx = r >= WARM_BASE ? o.requests + (r - WARM_BASE) : r;
    return slots + idx * PARAMS_SLOT;
}

static uint32_t req_block(const rank_view_t *v, uint64_t r, uint32_t i)
{
    if (r >= WARM_BASE)
        r -= WARM_BASE;
    uint32_t b = (uint32_t)((r % reqs_in_pool) * v->bpr + i);
    return v->perm ? v->perm[b] : b;
}

/* --shuffle: a permutation of the pool's n blocks, one per side (seed), the
 * same in every rank of the side. An engine's block tables look like this
 * once blocks have been freed and reused: no two neighbours of a request
 * are neighbours in the pool, and the two sides' ids differ. */
static uint32_t *shuffled_blocks(uint32_t n, uint64_t seed)
{
    uint32_t *p = malloc((size_t)n * sizeof(uint32_t));
    if (!p)
        die("--shuffle: %u block ids: out of memory", n);
    for (uint32_t i = 0; i < n; i++)
        p[i] = i;
    uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (uint32_t i = n - 1; i > 0; i--) {
        x ^= x << 13; /* xorshift64: repeatable, no libc state */
        x ^= x >> 7;
        x ^= x << 17;
        uint32_t j = (uint32_t)(x % ((uint64_t)i + 1));
        uint32_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    return p;
}

/* Where element (layer, kv, block, token, head) of v's pool lies. */
static inline uint8_t *view_at(const rank_view_t *v, uint32_t layer,
                               uint32_t kv, uint32_t block, uint32_t t,
                               uint32_t h)
{
    const kvx_layout_t *l = &v->layout;
    return v->rbase[kvx_layout_region(l, layer, kv)] +
           kvx_layout_offset(l, layer, kv, block, t, h);
}

#ifdef KVX_CUDA
/* --shuffle: request r's pool blocks, v->bpr of them; NULL without it
 * (they are then req_block(v, r, 0) on). */
static const uint32_t *req_ids(const rank_view_t *v, uint64_t r)
{
    if (!v->perm)
        return NULL;
    if (r >= WARM_BASE)
        r -= WARM_BASE;
    return v->perm + (r % reqs_in_pool) * v->bpr;
}

/* Request r's rows in v's GPU pool, all its tokens. */
static bgpu_rows_t gpu_rows(const rank_view_t *v, uint64_t r)
{
    const uint32_t *ids = req_ids(v, r);
    return (bgpu_rows_t){.dev = v->device,
                         .layout = &v->layout,
                         .regions = (void *const *)v->rbase,
                         .request = r,
                         .ids = ids,
                         .block0 = ids ? 0 : req_block(v, r, 0),
                         .nblocks = v->bpr,
                         .head0 = v->head0,
                         .layer0 = v->layer0,
                         .tok_to = UINT32_MAX};
}
#endif

static void fill_request(const rank_view_t *v, uint64_t r)
{
#ifdef KVX_CUDA
    if (v->device >= 0) {
        bgpu_rows_t rows = gpu_rows(v, r);
        if (bgpu_fill(&rows))
            die("GPU pattern fill failed");
        return;
    }
#endif
    const kvx_layout_t *l = &v->layout;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    for (uint32_t b = 0; b < v->bpr; b++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t t = 0; t < l->tokens_per_block; t++) {
                    uint32_t gt = b * l->tokens_per_block + t;
                    if (gt >= num_tokens)
                        break;
                    for (uint32_t h = 0; h < l->num_heads; h++)
                        row_fill(
                            view_at(v, layer, kv, req_block(v, r, b), t, h),
                            rowbytes, r, v->layer0 + layer, kv, gt,
                            v->head0 + h);
                }
}

/* Host pools too small for every request (blocks reused): the rank
 * processes would spend the two cores of a small machine writing and
 * checking every request's bytes while the daemon copies, and the bench
 * would time them. Instead each slot of the pool gets its pattern once,
 * before the timed pass (request r carries the pattern of the request of
 * its slot, pat_of()); each request is checked on one row of every
 * (block, layer, K/V) run, which is then poisoned so that the slot's
 * next request must write it again; and after the pass every byte of
 * every slot is checked. --verify-each checks (and writes) every byte of
 * every request, inside the timed pass, as before. */
static int sampled(void)
{
    return !o.no_verify && !o.verify_each && !o.gpu &&
           reqs_in_pool < o.requests / o.pairs;
}

/* The request whose pattern request r moves (sampled()): the first
 * request of the pass (from first) in r's slot; r itself otherwise. */
static uint64_t pat_of(uint64_t r, uint64_t first)
{
    if (!sampled() || r >= WARM_BASE)
        return r;
    return r - ((r - first) / reqs_in_pool) * reqs_in_pool;
}

/* Mismatched sampled rows of request r (sampled()): one row of every
 * (block, layer, kv) run, the same rows for every request of a slot;
 * poison: zero them after the check. */
static uint64_t sample_check(const rank_view_t *v, uint64_t r, uint64_t pat,
                             int poison)
{
    const kvx_layout_t *l = &v->layout;
    uint32_t rowbytes = l->head_dim * l->elem_size, bad = 0;
    for (uint32_t b = 0; b < v->bpr; b++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++) {
                uint32_t t = (b + layer) % l->tokens_per_block;
                uint32_t gt = b * l->tokens_per_block + t;
                if (gt < o.skip || gt >= num_tokens)
                    continue;
                uint32_t h = (b + layer + kv) % l->num_heads;
                uint8_t *at = view_at(v, layer, kv, req_block(v, r, b), t, h);
                bad += !row_check(at, rowbytes, pat, v->layer0 + layer, kv, gt,
                                  v->head0 + h);
                if (poison)
                    memset(at, 0, rowbytes);
            }
    return bad;
}

/* Mismatched rows of request r among tokens [skip, num_tokens). */
static uint64_t check_request(const rank_view_t *v, uint64_t r)
{
#ifdef KVX_CUDA
    if (v->device >= 0) {
        bgpu_rows_t rows = gpu_rows(v, r);
        rows.tok_from = o.skip;
        rows.tok_to = num_tokens;
        int64_t bad = bgpu_check(&rows);
        if (bad < 0)
            die("GPU pattern check failed");
        return (uint64_t)bad;
    }
#endif
    const kvx_layout_t *l = &v->layout;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    uint64_t bad = 0;
    for (uint32_t b = 0; b < v->bpr; b++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t t = 0; t < l->tokens_per_block; t++) {
                    uint32_t gt = b * l->tokens_per_block + t;
                    if (gt < o.skip)
                        continue;
                    if (gt >= num_tokens)
                        break;
                    for (uint32_t h = 0; h < l->num_heads; h++)
                        bad += !row_check(
                            view_at(v, layer, kv, req_block(v, r, b), t, h),
                            rowbytes, r, v->layer0 + layer, kv, gt,
                            v->head0 + h);
                }
    return bad;
}

/* Guard-band bytes around a rank's pool that are no longer GUARD_BYTE
 * (--pool-offset): any is a write outside the pool. */
static uint64_t guard_changed(const rank_view_t *v)
{
    if (!o.guard)
        return 0;
    uint64_t size = kvx_layout_span(&v->layout), off = o.pool_offset;
    uint8_t *img = v->alloc;
    uint8_t *tmp = NULL;
#ifdef KVX_CUDA
    if (v->device >= 0) {
        tmp = malloc(v->alloc_len);
        if (!tmp || bgpu_copy_to_host(v->device, tmp, v->alloc, off) ||
            bgpu_copy_to_host(v->device, tmp + off + size,
                              v->alloc + off + size, GUARD_TAIL))
            die("GPU %d: guard-band copy failed", v->device);
        img = tmp;
    }
#endif
    uint64_t bad = 0;
    for (uint64_t i = 0; i < v->alloc_len; i++)
        if ((i < off || i >= off + size) && img[i] != GUARD_BYTE)
            bad++;
    free(tmp);
    return bad;
}

/* ---- ranks ------------------------------------------------------------ */

/* --regions: register the rank's pool as o.regions regions, each its own
 * allocation as an engine's per-layer tensors are: a region per layer
 * (o.regions = the rank's layers) or a K and a V region per layer (twice
 * that), memfds mapped one by one, or GPU allocations one by one. */
static kvx_client_t *rank_open_regions(kvx_client_t *c, rank_view_t *v,
                                       uint32_t layers, int on_gpu, int ctx,
                                       uint32_t *pool_id)
{
    uint32_t per = o.regions == layers ? 1 : 2;
    if (o.regions != layers && (o.regions != 2 * layers || kvf != 2))
        die("--regions %u: a rank holds %u layers; give %u (a region per "
            "layer)%s",
            o.regions, layers, layers,
            kvf == 2 ? " or twice that (a K and a V region per layer)" : "");
    if (kvx_layout_split(&v->layout, per, v->parts, 2 * KVX_MAX_LAYERS))
        die("--regions: the layout cannot be split");
    v->nregions = o.regions;
    kvx_host_region_t *hr = calloc(o.regions, sizeof(*hr));
    kvx_gpu_region_t *gr = calloc(o.regions, sizeof(*gr));
    if (!hr || !gr)
        die("out of memory");
    for (uint32_t i = 0; i < o.regions; i++) {
        uint64_t n = v->rsize[i] = kvx_layout_region_span(&v->layout, i);
        if (on_gpu) {
#ifdef KVX_CUDA
            char err[256];
            void *p;
            v->device = ctx ? o.ctx_device : o.gen_device;
            if (bgpu_alloc(v->device, n, o.vmm, o.vmm_chunk, &p, err,
                           sizeof(err)))
                die("GPU %d: %s", v->device, err);
            if (bgpu_memset(v->device, p, 0, n))
                die("GPU %d: memset failed", v->device);
            v->rbase[i] = p;
            gr[i] = (kvx_gpu_region_t){p, n};
#endif
            continue;
        }
        int fd = memfd_create("kvxfer-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, (off_t)n) < 0 ||
            fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
            die("memfd of %llu bytes: %s", (unsigned long long)n,
                strerror(errno));
        v->rbase[i] = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (v->rbase[i] == MAP_FAILED)
            die("mmap of %llu bytes: %s", (unsigned long long)n,
                strerror(errno));
        memset(v->rbase[i], 0, n); /* fault the pages in before timing */
        hr[i] = (kvx_host_region_t){fd, 0, n};
    }
    v->base = v->rbase[0];
    if (on_gpu)
        CHECK_KVX(kvx_pool_register_gpu_regions(c, &v->layout, gr, o.regions,
                                                pool_id, TIMEOUT_MS),
                  c);
    else
        CHECK_KVX(kvx_pool_register_host_regions(c, &v->layout, hr, o.regions,
                                                 pool_id, TIMEOUT_MS),
                  c);
    for (uint32_t i = 0; !on_gpu && i < o.regions; i++)
        close(hr[i].fd);
    free(hr);
    free(gr);
    return c;
}

/* Connect rank `rank` (pp_rank * tp + tp_rank) of one side, join, and
 * register its pool: its share of layers (PP) and heads (TP; replicated
 * when tp > heads) in the side's layout. */
static kvx_client_t *rank_open(const char *inst, kvx_role_t role,
                               uint32_t rank, rank_view_t *v, uint32_t *pool_id)
{
    int ctx = role == KVX_ROLE_CONTEXT;
    uint32_t tp = ctx ? o.ctx_ranks : o.gen_ranks;
    uint32_t pp = ctx ? o.ctx_pp : o.gen_pp;
    uint32_t tpb = ctx ? o.ctx_tpb : o.gen_tpb;
    uint32_t nranks = tp * pp;
    kvx_hello_t h = {.instance_id = inst, .role = role, .rank = rank,
                     .parallel = {.tp = tp, .pp = pp, .cp = 1,
                                  .total_layers = o.layers,
                                  .total_kv_heads = o.heads}};
    kvx_client_t *c;
    const char *sock = ctx ? o.socket : o.gen_socket;
    int rc = kvx_connect(sock, &h, TIMEOUT_MS, &c);
    if (rc)
        die("connect %s rank %u to %s: %s", inst, rank, sock,
            kvx_status_str(rc));
    char addr[192];
    CHECK_KVX(kvx_daemon_address(c, addr, sizeof(addr)), c);
    if (rank == 0 && my_pair == 0)
        snprintf(ctx ? sh->address : sh->gen_address, sizeof(sh->address),
                 "%s", addr);
    /* engines allgather the addresses; here all ranks of an instance are
     * on one daemon (with --daemons 2, each side on its own) */
    const char **addrs = calloc(nranks, sizeof(char *));
    for (uint32_t i = 0; i < nranks; i++)
        addrs[i] = addr;
    CHECK_KVX(kvx_join(c, addrs, nranks, TIMEOUT_MS), c);
    free(addrs);
    uint32_t tpr = rank % tp, ppr = rank / tp;
    uint32_t heads = o.heads >= tp ? o.heads / tp : 1;
    v->head0 = o.heads >= tp ? tpr * heads : tpr / (tp / o.heads);
    uint32_t base = o.layers / pp, rem = o.layers % pp;
    uint32_t layers = base + (ppr < rem);
    v->layer0 = ppr * base + (ppr < rem ? ppr : rem);
    v->bpr = (num_tokens + tpb - 1) / tpb;
    uint32_t nblocks = reqs_in_pool * v->bpr;
    v->perm = o.shuffle ? shuffled_blocks(nblocks, ctx ? 1 : 2) : NULL;
    const char *preset = ctx ? o.ctx_layout : o.gen_layout;
    if (kvx_layout_preset(preset, layers, kvf, heads, o.head_dim, o.dtype,
                          tpb, nblocks, &v->layout))
        die("layout preset '%s' rejects these dimensions", preset);
    uint64_t size = kvx_layout_span(&v->layout);
    void *ptr;
    v->device = -1;
    int on_gpu = o.gpu && !(ctx ? o.ctx_host : o.gen_host);
    v->nregions = 1;
    if (o.regions)
        return rank_open_regions(c, v, layers, on_gpu, ctx, pool_id);
    uint64_t off = o.pool_offset, tail = o.guard ? GUARD_TAIL : 0;
    v->alloc = NULL;
    v->alloc_len = off + size + tail;
    if (on_gpu) {
#ifdef KVX_CUDA
        char err[256];
        v->device = ctx ? o.ctx_device : o.gen_device;
        void *alloc;
        if (bgpu_alloc(v->device, v->alloc_len, o.vmm, o.vmm_chunk, &alloc, err,
                       sizeof(err)))
            die("GPU %d: %s", v->device, err);
        ptr = (uint8_t *)alloc + off;
        if ((o.guard && (bgpu_memset(v->device, alloc, GUARD_BYTE, off) ||
                         bgpu_memset(v->device, (uint8_t *)ptr + size,
                                     GUARD_BYTE, tail))) ||
            bgpu_memset(v->device, ptr, 0, size))
            die("GPU %d: memset failed", v->device);
        CHECK_KVX(kvx_pool_register_gpu(c, &v->layout, ptr, size, pool_id,
                                        TIMEOUT_MS),
                  c);
        v->base = ptr;
        v->rbase[0] = v->base;
        v->rsize[0] = size;
        v->alloc = alloc;
        return c;
#endif
    }
    if (o.guard) { /* a pool inside a larger memfd of the bench's own */
        int fd = memfd_create("kvxfer-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, (off_t)v->alloc_len) < 0 ||
            fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
            die("memfd of %llu bytes: %s", (unsigned long long)v->alloc_len,
                strerror(errno));
        v->alloc =
            mmap(NULL, v->alloc_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (v->alloc == MAP_FAILED)
            die("mmap of %llu bytes: %s", (unsigned long long)v->alloc_len,
                strerror(errno));
        memset(v->alloc, GUARD_BYTE, v->alloc_len);
        v->base = v->alloc + off;
        v->rbase[0] = v->base;
        v->rsize[0] = size;
        memset(v->base, 0, size);
        CHECK_KVX(kvx_pool_register_host(c, &v->layout, fd, off, size, pool_id,
                                         TIMEOUT_MS),
                  c);
        close(fd);
        return c;
    }
    CHECK_KVX(kvx_pool_create_host(c, &v->layout, size, &ptr, pool_id,
                                   TIMEOUT_MS),
              c);
    v->base = ptr;
    v->rbase[0] = v->base;
    v->rsize[0] = size;
    memset(v->base, 0, size); /* fault the pages in before timing */
    return c;
}

static void barrier(_Atomic uint32_t *ready, _Atomic uint32_t *go)
{
    atomic_fetch_add(ready, 1);
    while (!atomic_load(go) && !atomic_load(&sh->failed))
        usleep(100);
    if (atomic_load(&sh->failed)) /* another rank failed: stop too */
        exit(1);
}

/* Context rank: publish requests [first, first + count), keeping at most
 * reqs_in_pool offers open, until all are consumed. */
/* Request r's key on each side: its digits (the uint64_t calls), or
 * with --keyed/--by-key/--reserve vLLM-like strings. */
static size_t ctx_key(uint64_t r, char *k, size_t n)
{
    return (size_t)snprintf(k, n, "cmpl-%llu-0", (unsigned long long)r);
}

static size_t gen_key(uint64_t r, char *k, size_t n)
{
    return (size_t)snprintf(k, n, "decode-%llu", (unsigned long long)r);
}

/* The key a side names request r by: with --keyed its own (ctx_key,
 * gen_key), else r's digits, as kvx_publish and kvx_fetch make it. */
static size_t req_key(int ctx_side, uint64_t r, char *k, size_t n)
{
    if (o.keyed)
        return ctx_side ? ctx_key(r, k, n) : gen_key(r, k, n);
    return (size_t)snprintf(k, n, "%llu", (unsigned long long)r);
}

/* Slot of request r: its params, for the generation ranks (rank 0). */
static void params_to_slot(uint64_t r, const kvx_context_params_t *p)
{
    if (p->len > PARAMS_SLOT - 8)
        die("context params of %zu bytes", p->len);
    uint8_t *s = slot_of(r);
    memcpy(s + 8, p->data, p->len);
    ((uint32_t *)s)[1] = (uint32_t)p->len;
    atomic_store_explicit((_Atomic uint32_t *)s, 1, memory_order_release);
}

/* --batch: publish the requests from r0 on that may go now (their blocks
 * free: fin[k - reqs_in_pool]), up to left and KVX_MANY_MAX, in one
 * kvx_publish_many; returns how many. */
static uint64_t ctx_publish_many(kvx_client_t *c, rank_view_t *v, uint32_t rank,
                                 uint32_t pool, uint64_t r0, uint64_t left,
                                 const uint8_t *fin, uint64_t first, int fill)
{
    static kvx_publish_item_t it[KVX_MANY_MAX];
    static char keys[KVX_MANY_MAX][24];
    static uint32_t *bt;
    if (!bt && !(bt = malloc((size_t)KVX_MANY_MAX * v->bpr * 4)))
        die("out of memory");
    size_t n = 0;
    while (n < KVX_MANY_MAX && n < left) {
        uint64_t r = r0 + n, k = r - first;
        if (k >= reqs_in_pool && !fin[k - reqs_in_pool])
            break;
        if (fill)
            fill_request(v, r);
        uint32_t *b = bt + n * v->bpr;
        for (uint32_t i = 0; i < v->bpr; i++)
            b[i] = req_block(v, r, i);
        memset(&it[n], 0, sizeof(it[n]));
        it[n].key_len = req_key(1, r, keys[n], sizeof(keys[n]));
        it[n].key = keys[n];
        it[n].pool_id = pool;
        it[n].blocks = b;
        it[n].num_blocks = v->bpr;
        it[n].num_tokens = num_tokens;
        n++;
    }
    CHECK_KVX(kvx_publish_many(c, it, n, TIMEOUT_MS), c);
    for (size_t i = 0; i < n; i++) {
        if (rank == 0)
            params_to_slot(r0 + i, &it[i].params);
        kvx_context_params_free(&it[i].params);
    }
    return n;
}

/* The request an event names: the digits after its key's first '-'. */
static uint64_t event_req(const kvx_event_t *e)
{
    if (!o.keyed)
        return e->request_id;
    uint64_t r = 0;
    uint32_t i = 0;
    while (i < e->key_len && e->key[i] != '-')
        i++;
    for (i++; i < e->key_len && e->key[i] >= '0' && e->key[i] <= '9'; i++)
        r = r * 10 + (uint64_t)(e->key[i] - '0');
    return r;
}

static kvx_client_t *sched; /* --reserve: context rank 0's scheduler */

static void ctx_run(kvx_client_t *c, rank_view_t *v, uint32_t rank,
                    uint32_t pool, uint64_t first, uint64_t count, int fill)
{
    uint32_t *bt = malloc(v->bpr * sizeof(uint32_t));
    uint8_t *fin = calloc(count, 1); /* request's offer complete */
    uint64_t published = 0, done = 0;
    /* every request is published, even one already complete: with
     * replicated heads a consumer may take an offer before this rank
     * publishes its part, which then only closes the offer */
    while (done < count || published < count) {
        /* blocks are reused every reqs_in_pool requests: publish k only
         * once k - reqs_in_pool is complete (they complete in any order) */
        if (published < count &&
            (published < reqs_in_pool || fin[published - reqs_in_pool])) {
            if (o.batch) {
                published +=
                    ctx_publish_many(c, v, rank, pool, first + published,
                                     count - published, fin, first, fill);
                continue;
            }
            uint64_t r = first + published;
            if (fill)
                fill_request(v, r);
            for (uint32_t i = 0; i < v->bpr; i++)
                bt[i] = req_block(v, r, i);
            kvx_context_params_t p, rp = {0};
            char k[64];
            size_t kl = ctx_key(r, k, sizeof(k));
            if (o.reserve && rank == 0) {
                /* the scheduler's params, before the publish: the
                 * generation side may fetch with them at once */
                char inst[32];
                snprintf(inst, sizeof(inst), "bench-ctx-%u", my_pair);
                CHECK_KVX(kvx_reserve(sched, inst, k, kl, num_tokens, &rp,
                                      TIMEOUT_MS),
                          sched);
                params_to_slot(r, &rp);
            }
            if (o.keyed)
                CHECK_KVX(kvx_publish_key(c, k, kl, pool, bt, v->bpr,
                                          num_tokens, NULL, 0, &p, TIMEOUT_MS),
                          c);
            else
                CHECK_KVX(kvx_publish(c, r, pool, bt, v->bpr, num_tokens, &p,
                                      TIMEOUT_MS),
                          c);
            if (rp.data) { /* the same bytes as the reservation's */
                if (rp.len != p.len || memcmp(rp.data, p.data, p.len))
                    die("request %llu: the publish's params differ from the "
                        "reservation's",
                        (unsigned long long)r);
                kvx_context_params_free(&rp);
            } else if (rank == 0) {
                params_to_slot(r, &p);
            }
            kvx_context_params_free(&p);
            published++;
            continue;
        }
        kvx_batch_t *b;
        CHECK_KVX(kvx_poll(c, 1, 1000, &b), c);
        for (uint32_t i = 0; i < b->num_events; i++) {
            if (b->events[i].kind != KVX_EVENT_COMPLETE)
                die("context request %llu: %s",
                    (unsigned long long)b->events[i].request_id,
                    b->events[i].message);
            fin[event_req(&b->events[i]) - first] = 1;
            done++;
        }
        kvx_batch_free(b);
    }
    free(fin);
    free(bt);
}

static void ctx_main(uint32_t rank)
{
    rank_view_t v;
    uint32_t pool;
    char name[32];
    snprintf(name, sizeof(name), "bench-ctx-%u", my_pair);
    kvx_client_t *c = rank_open(name, KVX_ROLE_CONTEXT, rank, &v, &pool);
    if (o.reserve && rank == 0 &&
        kvx_connect_observer(o.socket, TIMEOUT_MS, &sched))
        die("--reserve: the scheduler cannot connect: %s",
            kvx_last_error(NULL));
    uint64_t per = o.requests / o.pairs, first = my_pair * per;
    int reuse = reqs_in_pool < per;
    barrier(&sh->ready, &sh->go);
    if (!o.no_warmup)
        ctx_run(c, &v, rank, pool, WARM_BASE + my_pair * reqs_in_pool,
                reqs_in_pool, 0);
    if ((!reuse || sampled()) && !o.no_verify)
        for (uint64_t r = first; r < first + (reuse ? reqs_in_pool : per); r++)
            fill_request(&v, r);
    barrier(&sh->ready2, &sh->go2);
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        if (ps && !o.no_warmup) /* the links idled through the baseline */
            ctx_run(c, &v, rank, pool, WARM_BASE + my_pair * reqs_in_pool,
                    reqs_in_pool, 0);
        if (ps) /* every pair's warm-up is over before any timed fetch */
            barrier(&sh->warm_ready[ps], &sh->warm_go[ps]);
        ctx_run(c, &v, rank, pool, first, per,
                reuse && !o.no_verify && !sampled());
        barrier(&sh->pass_ready[ps], &sh->pass_go[ps]);
    }
    atomic_fetch_add(&sh->guard_changed, guard_changed(&v));
    /* a rank that leaves ends its instance's requests: with replicated
     * heads other ranks may still be publishing theirs */
    barrier(&sh->ready3, &sh->go3);
    kvx_close(c);
    exit(0);
}

/* --batch: fetch the requests from next on whose params are there and
 * whose blocks are free, within the window, up to KVX_MANY_MAX, in one
 * kvx_fetch_many (request next is ready); returns how many. */
static uint64_t gen_fetch_many(kvx_client_t *c, rank_view_t *v, uint32_t pool,
                               uint64_t first, uint64_t next, uint64_t count,
                               uint64_t done, uint32_t window,
                               const uint8_t *fin, uint64_t *t0, int timed)
{
    static kvx_fetch_item_t it[KVX_MANY_MAX];
    static char keys[KVX_MANY_MAX][24];
    static uint32_t *bt;
    if (!bt && !(bt = malloc((size_t)KVX_MANY_MAX * v->bpr * 4)))
        die("out of memory");
    size_t n = 0;
    uint64_t now = now_ns();
    while (n < KVX_MANY_MAX && next + n < count && next + n - done < window &&
           (next + n < reqs_in_pool || fin[next + n - reqs_in_pool])) {
        uint64_t r = first + next + n;
        uint8_t *s = slot_of(r);
        if (!atomic_load_explicit((_Atomic uint32_t *)s, memory_order_acquire))
            break;
        uint32_t *b = bt + n * v->bpr;
        for (uint32_t i = 0; i < v->bpr; i++)
            b[i] = req_block(v, r, i);
        memset(&it[n], 0, sizeof(it[n]));
        it[n].key_len = req_key(0, r, keys[n], sizeof(keys[n]));
        it[n].key = keys[n];
        it[n].params = s + 8;
        it[n].params_len = ((uint32_t *)s)[1];
        it[n].pool_id = pool;
        it[n].blocks = b;
        it[n].num_blocks = v->bpr;
        it[n].skip_tokens = o.skip;
        t0[next + n] = now;
        n++;
    }
    uint64_t zero = 0;
    if (timed && n)
        atomic_compare_exchange_strong(&sh->first_fetch_ns, &zero, now);
    CHECK_KVX(kvx_fetch_many(c, it, n, TIMEOUT_MS), c);
    return n;
}

/* Generation rank: fetch requests [first, first + count) with up to
 * window outstanding; record latency (rank 0) and verify. */
static uint64_t gen_run(kvx_client_t *c, rank_view_t *v, uint32_t rank,
                        uint32_t pool, uint64_t first, uint64_t count,
                        int timed, uint64_t *checked)
{
    int check = timed && !o.no_verify && reqs_in_pool < count;
    int sample = check && sampled();
    uint64_t *t0 = calloc(count, sizeof(uint64_t));
    uint32_t *bt = malloc(v->bpr * sizeof(uint32_t));
    uint64_t next = 0, done = 0, bad = 0;
    uint8_t *fin = calloc(count, 1);
    uint32_t window = o.window < reqs_in_pool ? o.window : reqs_in_pool;
    while (done < count) {
        if (next < count && next - done < window &&
            (next < reqs_in_pool || fin[next - reqs_in_pool])) {
            uint64_t r = first + next;
            uint8_t *s = slot_of(r);
            if (!atomic_load_explicit((_Atomic uint32_t *)s,
                                      memory_order_acquire)) {
                if (next == done) { /* nothing to poll for: wait a bit */
                    if (atomic_load(&sh->failed))
                        exit(1); /* its context rank failed */
                    struct timespec ts = {0, 2000};
                    nanosleep(&ts, NULL);
                    continue;
                }
                goto poll;
            }
            if (o.batch) {
                next += gen_fetch_many(c, v, pool, first, next, count, done,
                                       window, fin, t0, timed);
                continue;
            }
            for (uint32_t i = 0; i < v->bpr; i++)
                bt[i] = req_block(v, r, i);
            t0[next] = now_ns();
            uint64_t zero = 0;
            if (timed)
                atomic_compare_exchange_strong(&sh->first_fetch_ns, &zero,
                                               t0[next]);
            char gk[64], ck[64], ci[32];
            size_t gkl = gen_key(r, gk, sizeof(gk));
            if (o.by_key) {
                size_t ckl = ctx_key(r, ck, sizeof(ck));
                snprintf(ci, sizeof(ci), "bench-ctx-%u", my_pair);
                CHECK_KVX(kvx_fetch_by_key(c, gk, gkl, ci, sh->address, ck, ckl,
                                           pool, bt, v->bpr, o.skip, 0,
                                           TIMEOUT_MS),
                          c);
            } else if (o.keyed)
                CHECK_KVX(kvx_fetch_key(c, gk, gkl, s + 8, ((uint32_t *)s)[1],
                                        pool, bt, v->bpr, o.skip, 0,
                                        TIMEOUT_MS),
                          c);
            else
                CHECK_KVX(kvx_fetch(c, r, s + 8, ((uint32_t *)s)[1], pool, bt,
                                    v->bpr, o.skip, TIMEOUT_MS),
                          c);
            next++;
            continue;
        }
    poll:;
        kvx_batch_t *b;
        CHECK_KVX(kvx_poll(c, 1, 1000, &b), c);
        uint64_t t = now_ns();
        for (uint32_t i = 0; i < b->num_events; i++) {
            const kvx_event_t *e = &b->events[i];
            if (e->kind != KVX_EVENT_COMPLETE)
                die("generation request %llu: %s (%s)",
                    (unsigned long long)e->request_id, e->message,
                    kvx_status_name(e->code));
            uint64_t er = event_req(e), k = er - first;
            if (timed && rank == 0) {
                lat_ns[first + k] = t - t0[k];
                call_ns[first + k] = t0[k];
                ev_ns[first + k] = t;
            }
            if (sample) { /* the slot's last request stays whole */
                bad += sample_check(v, er, pat_of(er, first),
                                    k + reqs_in_pool < count);
                atomic_fetch_add(&sh->sampled_reqs, 1);
            } else if (check) {
                bad += check_request(v, er);
                (*checked)++;
            }
            fin[k] = 1;
            done++;
        }
        kvx_batch_free(b);
    }
    if (timed) {
        uint64_t end = now_ns(), prev = atomic_load(&sh->last_done_ns);
        while (end > prev &&
               !atomic_compare_exchange_weak(&sh->last_done_ns, &prev, end))
            ;
    }
    free(fin);
    free(t0);
    free(bt);
    return bad;
}

/* Zero a rank's pool (between passes, outside the timing). */
static void pool_clear(const rank_view_t *v)
{
    for (uint32_t i = 0; i < v->nregions; i++) {
#ifdef KVX_CUDA
        if (v->device >= 0) {
            if (bgpu_memset(v->device, v->rbase[i], 0, v->rsize[i]))
                die("GPU %d: memset failed", v->device);
            continue;
        }
#endif
        memset(v->rbase[i], 0, v->rsize[i]);
    }
}

static void gen_main(uint32_t rank)
{
    rank_view_t v;
    uint32_t pool;
    char name[32];
    snprintf(name, sizeof(name), "bench-gen-%u", my_pair);
    kvx_client_t *c = rank_open(name, KVX_ROLE_GENERATION, rank, &v, &pool);
    uint64_t per = o.requests / o.pairs, first = my_pair * per;
    uint64_t checked = 0, bad;
    barrier(&sh->ready, &sh->go);
    if (!o.no_warmup)
        gen_run(c, &v, rank, pool, WARM_BASE + my_pair * reqs_in_pool,
                reqs_in_pool, 0, &checked);
    barrier(&sh->ready2, &sh->go2);
    bad = 0;
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        if (ps && !o.no_warmup) /* the links idled through the baseline:
                                    TCP starts slow again */
            gen_run(c, &v, rank, pool, WARM_BASE + my_pair * reqs_in_pool,
                    reqs_in_pool, 0, &checked);
        if (ps) { /* each pass writes every byte again, checked again */
            pool_clear(&v);
            barrier(&sh->warm_ready[ps], &sh->warm_go[ps]);
        }
        bad += gen_run(c, &v, rank, pool, first, per, 1, &checked);
        if (reqs_in_pool >= per && !o.no_verify)
            for (uint64_t r = first; r < first + per; r++, checked++)
                bad += check_request(&v, r);
        else if (sampled()) /* every byte of every slot, after the pass */
            for (uint64_t r = first; r < first + reqs_in_pool; r++)
                bad += check_request(&v, r);
        barrier(&sh->pass_ready[ps], &sh->pass_go[ps]);
    }
    uint64_t per_req = (uint64_t)(num_tokens - o.skip) *
                       v.layout.num_layers * kvf * v.layout.num_heads *
                       o.head_dim * kvx_dtype_size(o.dtype);
    atomic_fetch_add(&sh->mismatches, bad);
    atomic_fetch_add(&sh->verified_bytes, checked * per_req);
    atomic_fetch_add(&sh->guard_changed, guard_changed(&v));
    barrier(&sh->ready3, &sh->go3);
    kvx_close(c);
    exit(0);
}

/* ---- parent: daemon, baseline, report --------------------------------- */

/* The kvxferd next to this binary, or $KVXFERD. */
static void daemon_binary(char *daemon, size_t len)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0)
        die("readlink /proc/self/exe: %s", strerror(errno));
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    *slash = 0;
    const char *env = getenv("KVXFERD");
    if (env)
        snprintf(daemon, len, "%s", env);
    else
        snprintf(daemon, len, "%s/kvxferd", exe);
}

static void print_log(const char *path, long tail);

/* Wait until the daemon accepts connections on sock; with a log, show it
 * when the daemon dies first. */
static void daemon_await(pid_t pid, const char *daemon, const char *sock,
                         const char *log, int tries)
{
    for (int i = 0; i < tries; i++) { /* 10 ms each */
        kvx_client_t *c;
        if (kvx_connect_observer(sock, 100, &c) == 0) {
            kvx_close(c);
            return;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            if (log)
                print_log(log, 4096);
            die("daemon %s exited during start%s", daemon,
                log ? " (its log is above)" : "");
        }
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    if (log)
        print_log(log, 4096);
    die("daemon %s did not start listening on %s", daemon, sock);
}

/* --trace: the spawned daemon's log.trace_file. */
static const char *trace_path(void)
{
    static char p[128];
    if (!p[0])
        snprintf(p, sizeof(p), "/tmp/kvxfer-bench-%d.trace",
                 o.spawn ? (int)getpid() : 0);
    return p;
}

static int cmp_u64(const void *a, const void *b);

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

/* The next "fetch" line of the trace file: its key and its hops' ns
 * (made, queued, submitted, copied, landed, event queued); 0 at the
 * end. Other lines are skipped. */
static int trace_next(FILE *f, char key[300], unsigned long long t[6])
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
    uint32_t n = 0;
    char key[300];
    unsigned long long t[6];
    while (trace_next(f, key, t)) {
        const char *dg = strrchr(key, '-'); /* keyed: "decode-R" */
        dg = dg ? dg + 1 : key;
        char *end;
        unsigned long long r = strtoull(dg, &end, 10);
        if (*end || r >= o.requests || !call_ns[r] || n >= o.requests)
            continue; /* the warm-up's, or not rank 0's */
        uint64_t h[NHOPS] = {
            t[0] - call_ns[r], t[1] - t[0],           t[2] - t[1],
            t[3] - t[2],       t[4] - t[3],           t[5] - t[4],
            ev_ns[r] - t[5],   ev_ns[r] - call_ns[r], t[5] - t[0]};
        for (int i = 0; i < NHOPS; i++)
            d[i][n] = (int64_t)h[i] < 0 ? 0 : h[i];
        n++;
    }
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

static pid_t spawn_daemon(char *sock, size_t len)
{
    char daemon[PATH_MAX + 16];
    daemon_binary(daemon, sizeof(daemon));
    snprintf(sock, len, "/tmp/kvxfer-bench-%d.sock", (int)getpid());
    (void)trace_path(); /* named here, the same in the child */
    pid_t pid = fork();
    if (pid == 0) {
        if (!getenv("KVX_BENCH_DAEMON_LOG")) {
            int fd = open("/dev/null", O_WRONLY);
            if (fd >= 0)
                dup2(fd, 2);
        }
        char cfg[128];
        if ((o.ctas && !o.daemon_config) || o.trace) {
            snprintf(cfg, sizeof(cfg), "/tmp/kvxfer-bench-%d.yaml",
                     (int)getppid());
            FILE *f = fopen(cfg, "w");
            if (f) {
                if (o.ctas && !o.daemon_config)
                    fprintf(f, "gpu:\n  max_ctas: %u\n", o.ctas);
                if (o.trace)
                    fprintf(f, "log:\n  trace_file: \"%s\"\n", trace_path());
                if (o.daemon_config) { /* its own lines after ours */
                    FILE *in = fopen(o.daemon_config, "r");
                    char line[1024];
                    while (in && fgets(line, sizeof(line), in))
                        fputs(line, f);
                    if (in)
                        fclose(in);
                }
                fclose(f);
                o.daemon_config = cfg;
            }
        }
        if (o.daemon_config)
            execl(daemon, daemon, "--socket", sock, "--config",
                  o.daemon_config, (char *)NULL);
        else
            execl(daemon, daemon, "--socket", sock, (char *)NULL);
        fprintf(stderr, "kvxfer-bench: exec %s: %s\n", daemon,
                strerror(errno));
        _exit(127);
    }
    daemon_await(pid, daemon, sock, NULL, 500); /* up to 5 s */
    if ((o.ctas && !o.daemon_config) || o.trace) { /* read at start */
        char cfg[128];
        snprintf(cfg, sizeof(cfg), "/tmp/kvxfer-bench-%d.yaml", (int)getpid());
        unlink(cfg);
    }
    return pid;
}

/* --cpus-a/--cpus-b: daemon A and the ucx_perftest client (the senders)
 * run on cpuset[0], daemon B and the server (the receivers) on
 * cpuset[1], so the baseline and the daemons get the same CPUs. */
static cpu_set_t cpuset[2];

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
            fprintf(stderr, "kvxfer-bench: --%s '%s': CPUs %ld-%ld are not "
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
    fprintf(stderr, "kvxfer-bench: --%s '%s': expected a CPU list such as "
                    "0-7,16\n",
            name, v);
    exit(2);
}

/* In a child before exec: run on side k's CPUs, if given. */
static void cpus_apply(int k)
{
    if (o.cpus[k] && sched_setaffinity(0, sizeof(cpuset[k]), &cpuset[k]))
        fprintf(stderr, "kvxfer-bench: sched_setaffinity(%s): %s\n",
                o.cpus[k], strerror(errno));
}

/* ---- two daemons: temp dir, peer secret, configs, ucx_perftest -------- *
 * Everything lives in one mkdtemp directory under /tmp (mode 0700), which
 * the parent removes at exit, on a signal too; children of the parent
 * (ranks) inherit the handlers but leave the cleanup to it. */

enum { F_SECRET, F_CFG_A, F_CFG_B, F_SOCK_A, F_SOCK_B, F_LOG_A, F_LOG_B,
       F_PERFTEST, F_NUM };
static const char *const peer_file_names[F_NUM] = {
    "secret", "a.yaml", "b.yaml", "a.sock", "b.sock", "a.log", "b.log",
    "perftest.log"};
static char peer_dir[64];              /* "" until created */
static char peer_files[F_NUM][96];     /* built once: unlink in a handler */
static pid_t parent_pid;
/* daemons A and B, then the ucx_perftest server and client */
static volatile pid_t owned[4];

/* Async-signal-safe: kill, waitpid, unlink and rmdir only. */
static void peer_cleanup(void)
{
    if (getpid() != parent_pid)
        return;
    if (sh) /* ranks waiting at a barrier leave (a lock-free store) */
        atomic_fetch_add(&sh->failed, 1);
    for (int i = 0; i < 4; i++) {
        pid_t p = owned[i];
        if (p > 0) {
            owned[i] = 0;
            kill(p, SIGKILL);
            waitpid(p, NULL, 0);
        }
    }
    if (!peer_dir[0])
        return;
    for (int i = 0; i < F_NUM; i++)
        unlink(peer_files[i]);
    rmdir(peer_dir);
    peer_dir[0] = 0;
}

static void peer_on_signal(int sig)
{
    peer_cleanup();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* The last `tail` bytes of a log file, to stderr. */
static void print_log(const char *path, long tail)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char buf[4096];
    if (tail > (long)sizeof(buf))
        tail = sizeof(buf);
    fseek(f, 0, SEEK_END);
    long end = ftell(f);
    fseek(f, end > tail ? end - tail : 0, SEEK_SET);
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    if (n) {
        fprintf(stderr, "---- %s%s\n", path, end > tail ? " (end)" : "");
        fwrite(buf, 1, n, stderr);
        if (buf[n - 1] != '\n')
            fputc('\n', stderr);
    }
}

/* Write one daemon's config: the peer section the bench needs, gpu.max_ctas
 * with --ctas, then --daemon-config appended as is. */
static void peer_write_config(const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f)
        die("create %s: %s", path, strerror(errno));
    fprintf(f,
            "# written by kvxfer-bench --daemons 2; removed when it exits\n"
            "peer:\n  listen: \"127.0.0.1:0\"\n  secret_file: \"%s\"\n"
            "  slot_bytes: %llu\n",
            peer_files[F_SECRET], (unsigned long long)o.slot_bytes);
    for (uint32_t i = 0; i < o.npeer_config; i++)
        fprintf(f, "  %s\n", o.peer_config[i]);
    if (o.ctas)
        fprintf(f, "gpu:\n  max_ctas: %u\n", o.ctas);
    if (o.daemon_config) {
        FILE *in = fopen(o.daemon_config, "r");
        if (!in)
            die("--daemon-config %s: %s", o.daemon_config, strerror(errno));
        char buf[4096];
        size_t n;
        int last = '\n';
        fprintf(f, "# from %s\n", o.daemon_config);
        while ((n = fread(buf, 1, sizeof(buf), in)) > 0) {
            fwrite(buf, 1, n, f);
            last = buf[n - 1];
        }
        fclose(in);
        if (last != '\n')
            fputc('\n', f);
    }
    if (fclose(f))
        die("write %s: %s", path, strerror(errno));
}

static void peer_setup(void)
{
    parent_pid = getpid();
    snprintf(peer_dir, sizeof(peer_dir), "/tmp/kvxfer-bench-XXXXXX");
    if (!mkdtemp(peer_dir)) {
        int e = errno;
        peer_dir[0] = 0;
        die("mkdtemp /tmp/kvxfer-bench-XXXXXX: %s", strerror(e));
    }
    for (int i = 0; i < F_NUM; i++)
        snprintf(peer_files[i], sizeof(peer_files[i]), "%s/%s", peer_dir,
                 peer_file_names[i]);
    atexit(peer_cleanup);
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction old;
        /* a signal ignored by whoever started us (nohup, &) stays so */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
            signal(sigs[i], peer_on_signal);
    }

    /* the cluster secret: 32 random bytes, readable by the owner only (the
     * daemon refuses a secret others can read) */
    uint8_t secret[32];
    if (getrandom(secret, sizeof(secret), 0) != (ssize_t)sizeof(secret))
        die("getrandom: %s", strerror(errno));
    int fd = open(peer_files[F_SECRET], O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        die("create %s: %s", peer_files[F_SECRET], strerror(errno));
    if (write(fd, secret, sizeof(secret)) != (ssize_t)sizeof(secret) ||
        close(fd))
        die("write %s: %s", peer_files[F_SECRET], strerror(errno));
    peer_write_config(peer_files[F_CFG_A]);
    peer_write_config(peer_files[F_CFG_B]);
}

/* Start daemon k (0: A, 1: B) on its socket and config; its stderr goes to
 * its log in the temp dir ($KVX_BENCH_DAEMON_LOG: to ours). */
static pid_t peer_spawn(int k)
{
    char daemon[PATH_MAX + 16];
    daemon_binary(daemon, sizeof(daemon));
    const char *sock = peer_files[F_SOCK_A + k];
    const char *cfg = peer_files[F_CFG_A + k];
    const char *log = peer_files[F_LOG_A + k];
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        if (!getenv("KVX_BENCH_DAEMON_LOG")) {
            int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (fd >= 0)
                dup2(fd, 2);
        }
        cpus_apply(k);
        execl(daemon, daemon, "--socket", sock, "--config", cfg,
              (char *)NULL);
        fprintf(stderr, "kvxfer-bench: exec %s: %s\n", daemon,
                strerror(errno));
        _exit(127);
    }
    owned[k] = pid;
    /* UCX initialization makes the start slower: up to 10 s */
    daemon_await(pid, daemon, sock,
                 getenv("KVX_BENCH_DAEMON_LOG") ? NULL : log, 1000);
    return pid;
}

/* ucx_perftest on $PATH, or $KVX_UCX_PERFTEST; NULL when there is none. */
static const char *perftest_binary(void)
{
    static char buf[PATH_MAX];
    const char *env = getenv("KVX_UCX_PERFTEST");
    if (env)
        return access(env, X_OK) == 0 ? env : NULL;
    const char *path = getenv("PATH");
    if (!path || !*path)
        path = "/usr/bin:/bin";
    while (*path) {
        size_t n = strcspn(path, ":");
        if (n && n < sizeof(buf) - 16) {
            snprintf(buf, sizeof(buf), "%.*s/ucx_perftest", (int)n, path);
            if (access(buf, X_OK) == 0)
                return buf;
        }
        path += n + (path[n] == ':');
    }
    return NULL;
}

/* A TCP port nobody listens on now (the server binds it a moment later;
 * a lost race is retried with another). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t alen = sizeof(a);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) ||
        getsockname(fd, (struct sockaddr *)&a, &alen))
        die("find a free TCP port: %s", strerror(errno));
    close(fd);
    return ntohs(a.sin_port);
}

/* waitpid with a deadline; SIGKILL past it. Returns the status, or -1. */
static int wait_until(pid_t pid, uint64_t deadline_ns)
{
    int st;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return st;
        if (r < 0)
            return -1;
        if (now_ns() > deadline_ns) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            return -1;
        }
        usleep(2000);
    }
}

/* One ucx_perftest run, a server and a client process on 127.0.0.1 with
 * this environment (UCX_TLS included); returns the client's overall
 * bandwidth as printed: MB/s meaning 2^20 bytes per second. */
static double perftest_once(const char *bin, const char *test,
                            uint64_t size, uint64_t iters)
{
    char s[24], n[24], w[24], p[8];
    snprintf(s, sizeof(s), "%llu", (unsigned long long)size);
    snprintf(n, sizeof(n), "%llu", (unsigned long long)iters);
    /* warm-up: a tenth of the iterations (ucx_perftest's default is
     * 10000, and it caps that the same way) */
    snprintf(w, sizeof(w), "%llu",
             (unsigned long long)(iters / 10 ? (iters / 10 < 100 ? iters / 10
                                                                 : 100)
                                             : 1));
    const char *log = peer_files[F_PERFTEST];
    for (int attempt = 0; attempt < 3; attempt++) {
        snprintf(p, sizeof(p), "%d", free_port());
        pid_t srv = fork();
        if (srv < 0)
            die("fork: %s", strerror(errno));
        if (srv == 0) {
            int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (fd >= 0) {
                dup2(fd, 1);
                dup2(fd, 2);
            }
            cpus_apply(1); /* the server receives, as daemon B */
            /* -f: final figures only; -v: as CSV */
            execl(bin, bin, "-t", test, "-s", s, "-n", n, "-w", w, "-p", p,
                  "-f", "-v", (char *)NULL);
            _exit(127);
        }
        owned[2] = srv;
        uint64_t deadline = now_ns() + 120ull * 1000000000ull;
        /* the client fails at once (connection refused) until the server
         * listens: try again while the server waits */
        for (int tries = 0; tries < 200; tries++) {
            int st;
            if (waitpid(srv, &st, WNOHANG) == srv) {
                owned[2] = 0;
                break; /* port taken, most likely: another port */
            }
            int pfd[2];
            if (pipe(pfd))
                die("pipe: %s", strerror(errno));
            pid_t cli = fork();
            if (cli < 0)
                die("fork: %s", strerror(errno));
            if (cli == 0) {
                dup2(pfd[1], 1);
                int fd = open("/dev/null", O_WRONLY);
                if (fd >= 0)
                    dup2(fd, 2);
                close(pfd[0]);
                cpus_apply(0); /* the client sends, as daemon A */
                execl(bin, bin, "127.0.0.1", "-t", test, "-s", s, "-n", n,
                      "-w", w, "-p", p, "-f", "-v", (char *)NULL);
                _exit(127);
            }
            owned[3] = cli;
            close(pfd[1]);
            char out[4096];
            size_t len = 0;
            for (;;) {
                struct pollfd pf = {.fd = pfd[0], .events = POLLIN};
                int64_t left = (int64_t)(deadline - now_ns()) / 1000000;
                if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
                    break;
                ssize_t r = read(pfd[0], out + len, sizeof(out) - 1 - len);
                if (r <= 0)
                    break;
                len += (size_t)r;
                if (len == sizeof(out) - 1)
                    break;
            }
            out[len] = 0;
            close(pfd[0]);
            st = wait_until(cli, deadline);
            owned[3] = 0;
            if (st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
                /* "iterations,50.0_percentile_lat,avg_lat,overall_lat,
                 *  avg_bw,overall_bw,avg_mr,overall_mr" then the values */
                char *line = strstr(out, "iterations,");
                line = line ? strchr(line, '\n') : NULL;
                double bw = 0;
                if (line) {
                    char *f = line + 1;
                    for (int i = 0; i < 5 && f; i++)
                        if ((f = strchr(f, ',')))
                            f++;
                    if (f)
                        bw = strtod(f, NULL);
                }
                wait_until(srv, now_ns() + 10ull * 1000000000ull);
                owned[2] = 0;
                if (!(bw > 0))
                    die("ucx_perftest -t %s: no bandwidth in its output: "
                        "%.300s", test, out);
                return bw;
            }
            if (now_ns() > deadline)
                break;
            usleep(50000);
        }
        if (owned[2]) {
            kill(srv, SIGKILL);
            waitpid(srv, NULL, 0);
            owned[2] = 0;
        }
        if (now_ns() > deadline)
            break;
    }
    print_log(log, 2048);
    die("ucx_perftest -t %s -s %s -n %s failed (the server's output is "
        "above)", test, s, n);
    return 0;
}

/* ucx_perftest `test` with messages of size bytes, in GB/s (1e9 bytes/s):
 * a 100-iteration run first (also a warm-up); unless probe_only, then one
 * moving about `total` bytes, at least 100 iterations and about 2 s at
 * most, which is the figure returned. */
static double perftest_gbps(const char *bin, const char *test, uint64_t size,
                            uint64_t total, int probe_only)
{
    uint64_t want = (total + size - 1) / size;
    double mibps = perftest_once(bin, test, size, 100);
    if (!probe_only && want > 100) {
        double per_iter = (double)size / (mibps * 1048576.0);
        uint64_t cap = (uint64_t)(2.0 / per_iter);
        uint64_t iters = want < cap ? want : cap;
        if (iters > 100)
            mibps = perftest_once(bin, test, size, iters);
    }
    /* ucx_perftest's "MB/s" is 2^20 bytes per second */
    return mibps * 1048576.0 / 1e9;
}

/* Reap the ranks that exited (without waiting for the others); one that
 * failed, or died of a signal, marks the run failed. Then a moment's
 * sleep: the caller polls. */
static void kids_watch(const pid_t *kids, int *st, int *done, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (!done[i] && waitpid(kids[i], &st[i], WNOHANG) == kids[i]) {
            done[i] = 1;
            if (!WIFEXITED(st[i]) || WEXITSTATUS(st[i]))
                atomic_fetch_add(&sh->failed, 1);
        }
    usleep(1000);
}

/* The median of n values (sorts a copy; n <= 9). */
static double median(const double *v, uint32_t n)
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

/* --daemons 2: where the slots' time went, from the daemons' status
 * ("ucx.received" of B, "ucx.sent" of A): slots, then per slot the
 * average wait, wire, copy and the copy's loop lag in microseconds, then
 * the slots gathered ahead (a count). */
static double slot_rx[7], slot_tx[7];

static void slot_times_of(const char *json, const char *key, double out[7])
{
    const char *p = json ? strstr(json, key) : NULL;
    memset(out, 0, 7 * sizeof(double));
    if (!p)
        return;
    static const char *const f[7] = {
        "\"slots\":",       "\"wait_ns\":", "\"wire_ns\":", "\"copy_ns\":",
        "\"loop_lag_ns\":", "\"ahead\":",   "\"direct\":"};
    /* this direction's object only: "direct" may be absent from it */
    const char *end = strchr(p, '}');
    double v[7];
    for (int i = 0; i < 7; i++) {
        const char *q = strstr(p, f[i]);
        v[i] = q && (!end || q < end) ? strtod(q + strlen(f[i]), NULL) : 0;
    }
    out[0] = v[0];
    for (int i = 1; i < 5; i++)
        out[i] = v[0] > 0 ? v[i] / v[0] / 1e3 : 0;
    out[5] = v[5];
    out[6] = v[6];
}

/* --daemons 2: what the daemons' status says: the slot times (globals
 * slot_rx, slot_tx) and, unless UCX_TLS is set, the transports their
 * connection used ("ucx.transports", "tl/dev"), put in UCX_TLS for the
 * baseline. Returns the size of the pieces they send slots in
 * ("ucx.message_bytes"), or 0. Sets lanes_used: the lanes daemon A's
 * slot data goes over (its first connection's "lanes"). */
static uint32_t lanes_used;

static uint64_t peers_read(void)
{
    static char used_tls[128];
    uint64_t message_bytes = 0;
    int want_tls = !getenv("UCX_TLS");
    kvx_client_t *c;
    char *json = NULL;
    if (kvx_connect_observer(o.gen_socket, 2000, &c) == 0) {
        kvx_status_json(c, &json, 2000);
        kvx_close(c);
    }
    const char *t = json && want_tls ? strstr(json, "\"transports\":\"") : NULL;
    if (t) {
        t += 14;
        size_t n = 0;
        while (*t && *t != '"') {
            char tl[32];
            size_t k = 0;
            while (*t && *t != '/' && *t != '"' && k + 1 < sizeof(tl))
                tl[k++] = *t++;
            tl[k] = 0;
            while (*t && *t != ',' && *t != '"')
                t++;
            if (*t == ',')
                t++;
            if (k && !strstr(used_tls, tl) && n + k + 2 < sizeof(used_tls))
                n += snprintf(used_tls + n, sizeof(used_tls) - n, "%s%s",
                              n ? "," : "", tl);
        }
    }
    /* the daemons send a slot as pieces of ucx.message_bytes */
    const char *mb = json ? strstr(json, "\"message_bytes\":") : NULL;
    if (mb)
        message_bytes = strtoull(mb + 16, NULL, 10);
    slot_times_of(json, "\"received\":{", slot_rx);
    free(json);
    json = NULL;
    if (kvx_connect_observer(o.socket, 2000, &c) == 0) {
        kvx_status_json(c, &json, 2000);
        kvx_close(c);
    }
    slot_times_of(json, "\"sent\":{", slot_tx);
    const char *ln = json ? strstr(json, "\"lanes\":") : NULL;
    if (ln)
        lanes_used = (uint32_t)strtoul(ln + 8, NULL, 10);
    free(json);
    if (want_tls && used_tls[0])
        setenv("UCX_TLS", used_tls, 1);
    return message_bytes;
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

static double memcpy_baseline(uint64_t total)
{
    uint64_t len = total < (1ull << 30) ? total : (1ull << 30);
    uint8_t *a = malloc(len), *b = malloc(len);
    if (!a || !b)
        die("baseline: out of memory for 2 x %llu bytes",
            (unsigned long long)len);
    memset(a, 1, len);
    memset(b, 2, len);
    uint64_t t0 = now_ns(), done = 0;
    while (done < total) {
        uint64_t n = total - done < len ? total - done : len;
        memcpy(b, a, n);
        done += n;
    }
    uint64_t dt = now_ns() - t0;
    volatile uint8_t sink = b[len / 2];
    (void)sink;
    free(a);
    free(b);
    return (double)total / (double)dt;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* ---- --layerwise ------------------------------------------------------- */

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

/* One context rank and one generation rank of this process, one request
 * at a time, four ways: ready (published whole with its KV there: one
 * layer's transfer is its time over the layers), layer-wise (a layer
 * ready every MS ms: exposed = COMPLETE - the last layer ready), whole
 * (the same prefill, then published: its exposed time), and streamed at
 * once (layer-wise with every layer ready back to back: its bandwidth
 * against ready's). */
static int layerwise_main(void)
{
    rank_view_t cv, gv;
    memset(&cv, 0, sizeof(cv));
    memset(&gv, 0, sizeof(gv));
    kvx_client_t *c = rank_open("lw-ctx", KVX_ROLE_CONTEXT, 0, &cv, &cv.pool);
    kvx_client_t *g =
        rank_open("lw-gen", KVX_ROLE_GENERATION, 0, &gv, &gv.pool);
    kvx_client_t *s;
    CHECK_KVX(kvx_connect_observer(o.socket, TIMEOUT_MS, &s), NULL);
    uint32_t L = cv.layout.num_layers, n = o.requests;
    uint64_t per_layer_ns = (uint64_t)(o.layerwise_ms * 1e6);
    uint64_t bytes = (uint64_t)num_tokens * L * kvf * o.heads * o.head_dim *
                     kvx_dtype_size(o.dtype);
    uint32_t *cb = malloc(cv.bpr * sizeof(uint32_t));
    for (uint32_t i = 0; i < cv.bpr; i++)
        cb[i] = req_block(&cv, 0, i);
    void *stream = NULL, **evs = NULL;
    uint8_t *handles = NULL;
#ifdef KVX_CUDA
    if (cv.device >= 0) {
        evs = calloc(L, sizeof(void *));
        handles = malloc(64 * (size_t)L);
        if (bgpu_stream(cv.device, &stream) ||
            bgpu_ipc_events(cv.device, L, evs, handles))
            die("--layerwise: CUDA stream or IPC events failed");
    }
#endif
    uint64_t *ready = calloc(n, 8), *lw = calloc(n, 8), *whole = calloc(n, 8),
             *fast = calloc(n, 8), *lw_last = calloc(n, 8);
    fill_request(&cv, 0);
    for (uint32_t r = 0; r < n; r++) {
        char ck[32], gk[32];
        kvx_context_params_t p;
        lw_wait_t w;
        /* 1. ready: the KV is there, published whole */
        snprintf(ck, sizeof(ck), "rd-%u", r);
        snprintf(gk, sizeof(gk), "rdg-%u", r);
        CHECK_KVX(kvx_publish_key(c, ck, strlen(ck), cv.pool, cb, cv.bpr,
                                  num_tokens, NULL, 0, &p, TIMEOUT_MS),
                  c);
        pool_clear(&gv);
        uint64_t t0 = now_ns();
        lw_fetch(g, &gv, gk, &p, &w);
        lw_join(&w, "ready");
        ready[r] = w.done_ns - t0;
        if (r == 0 && !o.no_verify && check_request(&gv, 0))
            die("--layerwise: the ready request's bytes differ");
        kvx_context_params_free(&p);

        /* 2. layer-wise: a layer every MS ms */
        snprintf(ck, sizeof(ck), "lw-%u", r);
        snprintf(gk, sizeof(gk), "lwg-%u", r);
        pool_clear(&gv);
        CHECK_KVX(kvx_publish_layerwise(c, ck, strlen(ck), cv.pool, cb, cv.bpr,
                                        num_tokens, NULL, 0, &p, TIMEOUT_MS),
                  c);
        lw_fetch(g, &gv, gk, &p, &w);
        uint64_t start = now_ns(), last = 0;
        for (uint32_t l = 0; l < L; l++) {
            if (stream) {
#ifdef KVX_CUDA
                if (bgpu_spin(cv.device, stream, per_layer_ns) ||
                    bgpu_record(evs[l], stream))
                    die("--layerwise: spin kernel failed");
                CHECK_KVX(kvx_layers_ready(c, ck, strlen(ck), l, 1,
                                           handles + 64 * (size_t)l,
                                           TIMEOUT_MS),
                          c);
#endif
            } else {
                spin_until(start + (l + 1) * per_layer_ns);
                last = now_ns();
                CHECK_KVX(
                    kvx_layers_ready(c, ck, strlen(ck), l, 1, NULL, TIMEOUT_MS),
                    c);
            }
        }
#ifdef KVX_CUDA
        if (stream) {
            if (bgpu_event_wait(evs[L - 1]))
                die("--layerwise: event wait failed");
            last = now_ns();
        }
#endif
        lw_join(&w, "layer-wise");
        lw[r] = w.done_ns > last ? w.done_ns - last : 0;
        lw_last[r] = last;
        if (r == 0 && !o.no_verify && check_request(&gv, 0))
            die("--layerwise: the layer-wise request's bytes differ");
        kvx_context_params_free(&p);

        /* 3. whole: the same prefill, then a publish (the fetch waits on
         * the scheduler's reservation, as it would in an engine) */
        snprintf(ck, sizeof(ck), "wh-%u", r);
        snprintf(gk, sizeof(gk), "whg-%u", r);
        pool_clear(&gv);
        CHECK_KVX(kvx_reserve(s, "lw-ctx", ck, strlen(ck), num_tokens, &p,
                              TIMEOUT_MS),
                  s);
        lw_fetch(g, &gv, gk, &p, &w);
        kvx_context_params_free(&p);
        start = now_ns();
        if (stream) {
#ifdef KVX_CUDA
            for (uint32_t l = 0; l < L; l++)
                if (bgpu_spin(cv.device, stream, per_layer_ns) ||
                    bgpu_record(evs[l], stream))
                    die("--layerwise: spin kernel failed");
            if (bgpu_event_wait(evs[L - 1]))
                die("--layerwise: event wait failed");
#endif
        } else {
            spin_until(start + L * per_layer_ns);
        }
        last = now_ns();
        CHECK_KVX(kvx_publish_key(c, ck, strlen(ck), cv.pool, cb, cv.bpr,
                                  num_tokens, NULL, 0, &p, TIMEOUT_MS),
                  c);
        lw_join(&w, "whole");
        whole[r] = w.done_ns - last;
        kvx_context_params_free(&p);

        /* 4. streamed, every layer ready at once */
        snprintf(ck, sizeof(ck), "st-%u", r);
        snprintf(gk, sizeof(gk), "stg-%u", r);
        CHECK_KVX(kvx_publish_layerwise(c, ck, strlen(ck), cv.pool, cb, cv.bpr,
                                        num_tokens, NULL, 0, &p, TIMEOUT_MS),
                  c);
        t0 = now_ns();
        lw_fetch(g, &gv, gk, &p, &w);
        for (uint32_t l = 0; l < L; l++)
            CHECK_KVX(
                kvx_layers_ready(c, ck, strlen(ck), l, 1, NULL, TIMEOUT_MS), c);
        lw_join(&w, "streamed");
        fast[r] = w.done_ns - t0;
        kvx_context_params_free(&p);
        /* each context event, so the batches do not pile up */
        for (int k = 0; k < 4;) {
            kvx_batch_t *b;
            CHECK_KVX(kvx_poll(c, 1, TIMEOUT_MS, &b), c);
            k += (int)b->num_events;
            kvx_batch_free(b);
        }
    }
    double ready_us = med_us(ready, n), layer_us = ready_us / L;
    double lw_us = med_us(lw, n), whole_us = med_us(whole, n);
    double fast_us = med_us(fast, n);
    /* --trace: the daemon's part, the last layer ready -> the terminal
     * event queued (one monotonic clock): what is left is the
     * generation rank learning of it */
    double daemon_us = o.trace ? lw_daemon_us(lw_last, n) : -1;
    double gbps_ready = bytes / (ready_us * 1e3),
           gbps_fast = bytes / (fast_us * 1e3);
    /* how often the generation rank's waiting poll was answered early
     * (Poll.early: it spins, and a fetch's last copies went out) */
    unsigned long long early = 0;
    char *sj = NULL;
    if (kvx_status_json(s, &sj, TIMEOUT_MS) == 0) {
        const char *e = strstr(sj, "\"polls_woken_early\":");
        if (e)
            early = strtoull(e + 20, NULL, 10);
    }
    free(sj);
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
               stream ? "true" : "false", lw_us, layer_us, whole_us,
               lw_us / layer_us, ready_us, gbps_fast, gbps_ready,
               gbps_fast / gbps_ready, o.poll_spin ? "spin" : "wait", early,
               o.no_verify ? "false" : "true");
        if (daemon_us >= 0)
            printf(",\"exposed_daemon_us\":%.1f,"
                   "\"exposed_daemon_per_layer\":%.3f",
                   daemon_us, daemon_us / layer_us);
        printf("}\n");
    } else {
        printf("layer-wise: %u layers, a layer ready every %g ms, %.1f MiB "
               "a request (%s pools), median of %u, %s\n",
               L, o.layerwise_ms, bytes / 1048576.0, stream ? "GPU" : "host", n,
               o.poll_spin ? "the generation rank polling without waiting"
                           : "the generation rank waiting in its poll");
        printf("  exposed after the last layer, layer-wise %10.1f us  = "
               "%.2f x one layer's transfer\n",
               lw_us, lw_us / layer_us);
        if (daemon_us >= 0)
            printf("    of which in the daemon (to its event)  %10.1f us  = "
                   "%.2f x\n",
                   daemon_us, daemon_us / layer_us);
        printf("  exposed after the last layer, whole      %10.1f us\n",
               whole_us);
        printf("  polls answered early (the rank spins)    %10llu\n", early);
        printf("  one layer's transfer (ready request / %u) %9.1f us\n", L,
               layer_us);
        printf("  streamed, all layers ready at once  %6.2f GB/s vs whole "
               "%.2f GB/s (%.3f)\n",
               gbps_fast, gbps_ready, gbps_fast / gbps_ready);
    }
    kvx_close(s);
    kvx_close(g);
    kvx_close(c);
    return 0;
}

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: kvxfer-bench [--socket PATH | --spawn-daemon] [options]\n"
        "  --ctx-tp N, --gen-tp M TP of each side (also --ctx-ranks,\n"
        "                         --gen-ranks), default 1\n"
        "  --ctx-pp N, --gen-pp M PP of each side (layers split evenly)\n"
        "  --ctx-tokens-per-block T, --gen-tokens-per-block T\n"
        "  --skip-tokens S        prefix reuse: fetch moves tokens >= S\n"
        "  --mla                  MLA: K only, one latent head, mla layout\n"
        "  --requests R           requests, default 64\n"
        "  --blocks B             context blocks per request, default 256\n"
        "  --window W             requests outstanding per gen rank, "
        "default 16\n"
        "  --layout PRESET        trtllm, vllm-nhd, vllm-hnd, flashinfer, "
        "sglang, mla\n"
        "  --layers L --heads H --head-dim D --tokens-per-block T\n"
        "  --dtype fp32|fp16|bf16|fp8|int8\n"
        "  --pool-mib N           cap per rank pool (blocks are reused), "
        "default 2048\n"
        "  --no-verify            skip the byte check\n"
        "  --trace                with --spawn-daemon: each timed request's\n"
        "                         hops (the daemon's log.trace_file and\n"
        "                         the generation rank 0's clock), p50/p99;\n"
        "                         with --layerwise, the daemon's part of\n"
        "                         the exposed time (to its event queued)\n"
        "  --verify-each          host pools smaller than the requests:\n"
        "                         write and check every byte of every\n"
        "                         request inside the timed pass (default:\n"
        "                         each slot written once, a row of every\n"
        "                         block-layer run checked per request,\n"
        "                         every byte of every slot after the pass)\n"
        "  --no-warmup            time the first pass over the pools too\n"
        "  --passes N             timed passes (1 to 16): the medians are "
        "reported;\n"
        "                         with --daemons 2, each pass has its own "
        "ucx_perftest run\n"
        "                         right after it (instead of "
        "--baseline-runs), and the\n"
        "                         ratio is the median of the passes' "
        "ratios\n"
        "  --daemon-config FILE   config for --spawn-daemon; with --daemons 2 "
        "it is\n"
        "                         appended to each generated config (so it "
        "must not\n"
        "                         repeat peer:, nor gpu: with --ctas)\n"
        "  --daemons 1|2          2: with --spawn-daemon, context ranks on "
        "daemon A,\n"
        "                         generation ranks on daemon B (peer.listen "
        "127.0.0.1:0,\n"
        "                         a fresh secret); baseline ucx_perftest "
        "ucp_am_bw\n"
        "                         (package ucx-utils), with --gpu the "
        "slowest of it,\n"
        "                         D2H and H2D\n"
        "  --slot-bytes N         peer.slot_bytes of both daemons and the "
        "ucx_perftest\n"
        "                         message size, in bytes (default 4194304)\n"
        "  --cpus-a LIST, --cpus-b LIST  run daemon A and the "
        "ucx_perftest client\n"
        "                         (senders) on LIST, daemon B and the "
        "server on the\n"
        "                         other (e.g. 0-7 and 8-15)\n"
        "  --baseline-runs N      ucx_perftest N times (1 to 9), the "
        "median is the\n"
        "                         baseline (default 1)\n"
        "  --peer-config 'KEY: VALUE'  a line of both daemons' peer "
        "section, e.g.\n"
        "                         'slots: 16' (repeatable, up to 16)\n"
        "  --ucx-tls LIST         UCX_TLS of both daemons and ucx_perftest "
        "(default:\n"
        "                         UCX_TLS as it is in this environment)\n"
        "  --ctx-layout P, --gen-layout P   a preset per side (default "
        "--layout)\n"
        "  --gpu                  pools in GPU memory (CUDA build)\n"
        "  --ctx-device N, --gen-device N   GPUs (default 0 and 1; 0 and 0 "
        "with one GPU)\n"
        "  --vmm                  cuMemCreate (VMM fd) pools, not cudaMalloc\n"
        "  --vmm-chunk BYTES      --vmm pools made of physical allocations "
        "of BYTES,\n"
        "                         mapped back to back (PyTorch expandable "
        "segments)\n"
        "  --pool-offset BYTES    every pool starts BYTES into a larger "
        "allocation;\n"
        "                         guard bands around it are checked "
        "unchanged\n"
        "  --keyed                requests named by string keys "
        "(\"cmpl-R-0\",\n"
        "                         \"decode-R\"): kvx_publish_key, "
        "kvx_fetch_key\n"
        "  --reserve              --keyed, and context rank 0's scheduler\n"
        "                         reserves each request (kvx_reserve) before\n"
        "                         the publish; the generation side fetches\n"
        "                         with the reserved params at once\n"
        "  --by-key               --keyed, and the generation side fetches\n"
        "                         by key (kvx_fetch_by_key), no params\n"
        "  --regions N            each rank's pool as N regions, each its "
        "own allocation:\n"
        "                         a region per layer (N = the rank's "
        "layers) or a K\n"
        "                         and a V region per layer (twice that), "
        "host or --gpu\n"
        "  --ctas N               gpu.max_ctas of the spawned daemon\n"
        "  --shuffle              each side's block ids a random "
        "permutation of its\n"
        "                         pool (its own per side), as an engine's "
        "block tables\n"
        "                         look after reuse (a request's blocks "
        "seldom adjacent)\n"
        "  --ctx-host, --gen-host with --gpu: that side in host memory\n"
        "  --pairs P              P independent context/generation "
        "instance pairs\n"
        "                         sharing the requests (daemon-wide "
        "throughput)\n"
        "  --layerwise MS         one context and one generation rank, one\n"
        "                         request at a time: a prefill makes a\n"
        "                         layer ready every MS ms (a spinning\n"
        "                         kernel and an IPC event per layer with\n"
        "                         --gpu); reports the exposed transfer\n"
        "                         time (last layer ready to COMPLETE)\n"
        "                         layer-wise and published whole, one\n"
        "                         layer's transfer time, and streamed vs\n"
        "                         whole bandwidth\n"
        "  --batch                each rank hands the daemon every request\n"
        "                         it may start in one call\n"
        "                         (kvx_publish_many, kvx_fetch_many: one\n"
        "                         round trip for up to 256), as an engine\n"
        "                         does a step's batch\n"
        "  --poll-spin            with --layerwise: the generation rank\n"
        "                         polls without waiting, over and over, as\n"
        "                         an engine's step loop does, instead of one\n"
        "                         poll that blocks (then the exposed time\n"
        "                         holds its thread's wake-up)\n"
        "  --json                 one JSON object on stdout\n");
}

static uint32_t arg_u32(const char *name, const char *v, uint32_t min,
                        uint32_t max)
{
    char *end;
    errno = 0;
    unsigned long x = strtoul(v, &end, 10);
    if (errno || *end || !*v || x < min || x > max) {
        fprintf(stderr, "kvxfer-bench: --%s: '%s' is not an integer in "
                        "%u..%u\n",
                name, v, min, max);
        exit(2);
    }
    return (uint32_t)x;
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        {"socket", required_argument, NULL, 's'},
        {"spawn-daemon", no_argument, NULL, 'S'},
        {"ctx-ranks", required_argument, NULL, 'N'},
        {"gen-ranks", required_argument, NULL, 'M'},
        {"requests", required_argument, NULL, 'R'},
        {"blocks", required_argument, NULL, 'B'},
        {"window", required_argument, NULL, 'W'},
        {"layout", required_argument, NULL, 'l'},
        {"layers", required_argument, NULL, 'L'},
        {"heads", required_argument, NULL, 'H'},
        {"head-dim", required_argument, NULL, 'D'},
        {"tokens-per-block", required_argument, NULL, 'T'},
        {"dtype", required_argument, NULL, 'd'},
        {"pool-mib", required_argument, NULL, 'P'},
        {"no-verify", no_argument, NULL, 'n'},
        {"verify-each", no_argument, NULL, 'E'},
        {"trace", no_argument, NULL, 1100},
        {"no-warmup", no_argument, NULL, 'w'},
        {"daemon-config", required_argument, NULL, 'C'},
        {"ctx-layout", required_argument, NULL, 'x'},
        {"gen-layout", required_argument, NULL, 'y'},
        {"gpu", no_argument, NULL, 'g'},
        {"vmm", no_argument, NULL, 'v'},
        {"ctx-device", required_argument, NULL, 'a'},
        {"gen-device", required_argument, NULL, 'b'},
        {"ctas", required_argument, NULL, 'c'},
        {"ctx-host", no_argument, NULL, 'X'},
        {"pairs", required_argument, NULL, 'p'},
        {"ctx-tp", required_argument, NULL, 'N'},
        {"gen-tp", required_argument, NULL, 'M'},
        {"ctx-pp", required_argument, NULL, 1001},
        {"gen-pp", required_argument, NULL, 1002},
        {"ctx-tokens-per-block", required_argument, NULL, 1003},
        {"gen-tokens-per-block", required_argument, NULL, 1004},
        {"skip-tokens", required_argument, NULL, 1005},
        {"mla", no_argument, NULL, 1006},
        {"gen-host", no_argument, NULL, 'Y'},
        {"daemons", required_argument, NULL, 1007},
        {"slot-bytes", required_argument, NULL, 1008},
        {"ucx-tls", required_argument, NULL, 1009},
        {"peer-config", required_argument, NULL, 1010},
        {"baseline-runs", required_argument, NULL, 1011},
        {"passes", required_argument, NULL, 1014},
        {"cpus-a", required_argument, NULL, 1012},
        {"cpus-b", required_argument, NULL, 1013},
        {"pool-offset", required_argument, NULL, 1015},
        {"vmm-chunk", required_argument, NULL, 1016},
        {"regions", required_argument, NULL, 1017},
        {"keyed", no_argument, NULL, 1018},
        {"reserve", no_argument, NULL, 1019},
        {"by-key", no_argument, NULL, 1020},
        {"layerwise", required_argument, NULL, 1021},
        {"poll-spin", no_argument, NULL, 1029},
        {"batch", no_argument, NULL, 1030},
        {"shuffle", no_argument, NULL, 1022},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    int opt;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 's': o.socket = optarg; break;
        case 'S': o.spawn = 1; break;
        case 'N': o.ctx_ranks = arg_u32("ctx-ranks", optarg, 1, 64); break;
        case 'M': o.gen_ranks = arg_u32("gen-ranks", optarg, 1, 64); break;
        case 'R': o.requests = arg_u32("requests", optarg, 1, 10000000); break;
        case 'B': o.blocks = arg_u32("blocks", optarg, 1, 10000000); break;
        case 'W': o.window = arg_u32("window", optarg, 1, 65536); break;
        case 'l': o.layout = optarg; break;
        case 'L': o.layers = arg_u32("layers", optarg, 1, KVX_MAX_LAYERS); break;
        case 'H': o.heads = arg_u32("heads", optarg, 1, 4096); break;
        case 'D': o.head_dim = arg_u32("head-dim", optarg, 1, 2048); break;
        case 'T': o.tpb = arg_u32("tokens-per-block", optarg, 1, 65536); break;
        case 'P': o.pool_cap_mib = arg_u32("pool-mib", optarg, 1, 1 << 20); break;
        case 'n': o.no_verify = 1; break;
        case 'E':
            o.verify_each = 1;
            break;
        case 1100:
            o.trace = 1;
            break;
        case 'w': o.no_warmup = 1; break;
        case 'C': o.daemon_config = optarg; break;
        case 'x': o.ctx_layout = optarg; break;
        case 'y': o.gen_layout = optarg; break;
        case 'g': o.gpu = 1; break;
        case 'v': o.vmm = 1; break;
        case 'a': o.ctx_device = (int)arg_u32("ctx-device", optarg, 0, 63); break;
        case 'b':
            o.gen_device = (int)arg_u32("gen-device", optarg, 0, 63);
            o.gen_device_set = 1;
            break;
        case 'c': o.ctas = arg_u32("ctas", optarg, 1, 1024); break;
        case 'X': o.ctx_host = 1; break;
        case 'p': o.pairs = arg_u32("pairs", optarg, 1, 64); break;
        case 1001: o.ctx_pp = arg_u32("ctx-pp", optarg, 1, 64); break;
        case 1002: o.gen_pp = arg_u32("gen-pp", optarg, 1, 64); break;
        case 1003: o.ctx_tpb = arg_u32("ctx-tokens-per-block", optarg, 1, 65536); break;
        case 1004: o.gen_tpb = arg_u32("gen-tokens-per-block", optarg, 1, 65536); break;
        case 1005: o.skip = arg_u32("skip-tokens", optarg, 0, UINT32_MAX - 1); break;
        case 1006: o.mla = 1; break;
        case 1007: o.daemons = arg_u32("daemons", optarg, 1, 2); break;
        /* the bounds of the daemon's peer.slot_bytes */
        case 1012:
        case 1013:
            o.cpus[opt - 1012] = optarg;
            cpus_parse(opt == 1012 ? "cpus-a" : "cpus-b", optarg,
                       &cpuset[opt - 1012]);
            break;
        case 1011: o.baseline_runs = arg_u32("baseline-runs", optarg, 1, 9); break;
        case 1014: o.passes = arg_u32("passes", optarg, 1, MAX_PASSES); break;
        case 1015:
            o.pool_offset = arg_u32("pool-offset", optarg, 0, 1u << 30);
            o.guard = 1;
            break;
        case 1016:
            o.vmm_chunk = arg_u32("vmm-chunk", optarg, 1, 1u << 31);
            o.vmm = 1;
            break;
        case 1017:
            o.regions = arg_u32("regions", optarg, 1, MAX_REGIONS_BENCH);
            break;
        case 1018:
            o.keyed = 1;
            break;
        case 1019:
            o.reserve = o.keyed = 1;
            break;
        case 1020:
            o.by_key = o.keyed = 1;
            break;
        case 1022:
            o.shuffle = 1;
            break;
        case 1029:
            o.poll_spin = 1;
            break;
        case 1030:
            o.batch = 1;
            break;
        case 1021: {
            char *end;
            o.layerwise_ms = strtod(optarg, &end);
            if (*end || !(o.layerwise_ms >= 0) || o.layerwise_ms > 60000) {
                fprintf(stderr,
                        "kvxfer-bench: --layerwise '%s': "
                        "milliseconds a layer, 0 to 60000\n",
                        optarg);
                return 2;
            }
            o.layerwise = 1;
            break;
        }
        case 1010:
            if (o.npeer_config == 16 || strchr(optarg, '\n') ||
                !strchr(optarg, ':')) {
                fprintf(stderr, "kvxfer-bench: --peer-config '%s': one "
                                "'KEY: VALUE' line, at most 16 of them\n",
                        optarg);
                return 2;
            }
            o.peer_config[o.npeer_config++] = optarg;
            break;
        case 1008: o.slot_bytes = arg_u32("slot-bytes", optarg, 64u << 10, 1u << 30); break;
        case 1009: o.ucx_tls = optarg; break;
        case 'Y': o.gen_host = 1; break;
        case 'j': o.json = 1; break;
        case 'd':
            if (kvx_dtype_parse(optarg, &o.dtype)) {
                fprintf(stderr, "kvxfer-bench: --dtype: unknown '%s'\n",
                        optarg);
                return 2;
            }
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
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
#ifdef KVX_CUDA
    if (o.gpu && !o.gen_device_set && !o.gen_host && bgpu_device_count() == 1) {
        /* one GPU: both sides on it */
        o.gen_device = 0;
        fprintf(stderr, "kvxfer-bench: one GPU: the generation side uses "
                        "GPU 0 too (--gen-device)\n");
    }
#endif
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
    const char *perftest = NULL;
    if (o.daemons == 2) {
        perftest = perftest_binary();
        if (!perftest) {
            fprintf(stderr, "kvxfer-bench: --daemons 2: ucx_perftest not "
                            "found (install the ucx-utils package, or set "
                            "KVX_UCX_PERFTEST); it is the baseline\n");
            return 2;
        }
        /* inherited by both daemons and ucx_perftest */
        if (o.ucx_tls && setenv("UCX_TLS", o.ucx_tls, 1)) {
            fprintf(stderr, "kvxfer-bench: setenv UCX_TLS: %s\n",
                    strerror(errno));
            return 2;
        }
    }
    if (o.requests % o.pairs) {
        fprintf(stderr, "kvxfer-bench: --requests %u must divide over "
                        "--pairs %u\n", o.requests, o.pairs);
        return 2;
    }
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
        fprintf(stderr, "kvxfer-bench: --skip-tokens %u leaves nothing of "
                        "%u tokens\n", o.skip, num_tokens);
        return 2;
    }
    const char *presets[2] = {o.ctx_layout, o.gen_layout};
    uint32_t tpbs[2] = {o.ctx_tpb, o.gen_tpb};
    for (int k = 0; k < 2; k++) {
        kvx_layout_t probe;
        if (kvx_layout_preset(presets[k], 1, kvf, 1, o.head_dim, o.dtype,
                              tpbs[k], 1, &probe)) {
            fprintf(stderr, "kvxfer-bench: %s layout '%s' does not take "
                            "this shape (mla: --mla; sglang: 1 token per "
                            "block)\n", k ? "generation" : "context",
                    presets[k]);
            return 2;
        }
    }
    uint32_t tps[2] = {o.ctx_ranks, o.gen_ranks};
    uint32_t pps[2] = {o.ctx_pp, o.gen_pp};
    for (int k = 0; k < 2; k++) {
        if (o.heads >= tps[k] ? o.heads % tps[k] : tps[k] % o.heads) {
            fprintf(stderr, "kvxfer-bench: --heads %u do not split over tp "
                            "%u\n", o.heads, tps[k]);
            return 2;
        }
        if (pps[k] > o.layers) {
            fprintf(stderr, "kvxfer-bench: pp %u exceeds --layers %u\n",
                    pps[k], o.layers);
            return 2;
        }
    }

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
        fprintf(stderr, "kvxfer-bench: one request (%llu bytes per rank) "
                        "exceeds --pool-mib %llu\n",
                (unsigned long long)req_rank_bytes,
                (unsigned long long)o.pool_cap_mib);
        return 2;
    }
    uint32_t per_pair_reqs = o.requests / o.pairs;
    reqs_in_pool = fit < per_pair_reqs ? (uint32_t)fit : per_pair_reqs;
    /* every generation rank receives its heads of every layer */
    uint64_t gen_heads = o.heads >= o.gen_ranks ? o.heads / o.gen_ranks : 1;
    uint64_t total = (uint64_t)o.requests * (num_tokens - o.skip) *
                     o.layers * kvf * gen_heads * o.gen_ranks * row;

    size_t shlen =
        sizeof(struct shared) +
        ((size_t)o.requests + (size_t)o.pairs * reqs_in_pool) * PARAMS_SLOT +
        3 * (size_t)o.requests * sizeof(uint64_t);
    void *m = mmap(NULL, shlen, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        die("mmap %zu shared bytes: %s", shlen, strerror(errno));
    sh = m;
    slots = (uint8_t *)(sh + 1);
    lat_ns = (uint64_t *)(slots +
                          ((size_t)o.requests +
                           (size_t)o.pairs * reqs_in_pool) *
                              PARAMS_SLOT);
    call_ns = lat_ns + o.requests;
    ev_ns = call_ns + o.requests;

    char sock[128];
    pid_t dpid = -1, gen_dpid = -1;
    if (o.spawn && o.daemons == 2) {
        peer_setup();
        dpid = peer_spawn(0);
        gen_dpid = peer_spawn(1);
        o.socket = peer_files[F_SOCK_A];
        o.gen_socket = peer_files[F_SOCK_B];
    } else if (o.spawn) {
        dpid = spawn_daemon(sock, sizeof(sock));
        o.socket = sock;
    }
    if (!o.gen_socket)
        o.gen_socket = o.socket;

    if (o.layerwise) {
        if (o.daemons != 1 || o.ctx_ranks * o.ctx_pp != 1 ||
            o.gen_ranks * o.gen_pp != 1 || o.pairs != 1 || o.skip)
            die("--layerwise: one daemon, one context and one generation "
                "rank (no --daemons 2, tp, pp, --pairs or --skip-tokens)");
        int rc = layerwise_main();
        if (dpid > 0) {
            kill(dpid, SIGTERM);
            waitpid(dpid, NULL, 0);
        }
        return rc;
    }

    /* CUDA must not be initialized before fork: the GPU baseline runs
     * after the ranks are done; ucx_perftest too, with the daemons gone */
    double base = o.gpu || o.daemons == 2 ? 0 : memcpy_baseline(total);

    uint32_t nctx = o.ctx_ranks * o.ctx_pp, ngen = o.gen_ranks * o.gen_pp;
    uint32_t per_pair = nctx + ngen;
    uint32_t nproc = per_pair * o.pairs;
    pid_t *kids = calloc(nproc, sizeof(pid_t));
    int *kst = calloc(nproc, sizeof(int)), *kdone = calloc(nproc, sizeof(int));
    if (!kids || !kst || !kdone)
        die("out of memory");
    for (uint32_t i = 0; i < nproc; i++) {
        pid_t p = fork();
        if (p < 0) { /* the ranks already started stop at their barrier */
            atomic_fetch_add(&sh->failed, 1);
            for (uint32_t j = 0; j < i; j++)
                waitpid(kids[j], NULL, 0);
            die("fork: %s", strerror(errno));
        }
        if (p == 0) {
            my_pair = i / per_pair;
            uint32_t k = i % per_pair;
            if (k < nctx)
                ctx_main(k);
            else
                gen_main(k - nctx);
        }
        kids[i] = p;
    }
    /* a rank that dies (a signal, or exit before its barrier) fails the
     * run, so the others stop instead of waiting for it */
    while (atomic_load(&sh->ready) < nproc && !atomic_load(&sh->failed))
        kids_watch(kids, kst, kdone, nproc);
    atomic_store(&sh->go, 1);
    while (atomic_load(&sh->ready2) < nproc && !atomic_load(&sh->failed))
        kids_watch(kids, kst, kdone, nproc);
    atomic_store(&sh->go2, 1);
    /* each timed pass: its time; with --daemons 2 and several passes, one
     * ucx_perftest run right after it, while the daemons idle, so that
     * each pass has a baseline measured beside it (a busy host drifts) */
    double pass_secs[MAX_PASSES] = {0}, pass_ucx[MAX_PASSES] = {0},
           pass_msg[MAX_PASSES] = {0};
    uint64_t message_bytes = 0; /* status "ucx.message_bytes" */
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        while (ps && atomic_load(&sh->warm_ready[ps]) < nproc &&
               !atomic_load(&sh->failed))
            kids_watch(kids, kst, kdone, nproc);
        if (ps)
            atomic_store(&sh->warm_go[ps], 1);
        while (atomic_load(&sh->pass_ready[ps]) < nproc &&
               !atomic_load(&sh->failed))
            kids_watch(kids, kst, kdone, nproc);
        if (atomic_load(&sh->failed))
            break;
        pass_secs[ps] =
            (double)(sh->last_done_ns - sh->first_fetch_ns) / 1e9;
        atomic_store(&sh->first_fetch_ns, 0);
        atomic_store(&sh->last_done_ns, 0);
        if (o.daemons == 2 && o.passes > 1) {
            if (ps == 0)
                message_bytes = peers_read(); /* UCX_TLS for the runs */
            pass_ucx[ps] = perftest_gbps(perftest, "ucp_am_bw",
                                         o.slot_bytes, total, 0);
            if (message_bytes && message_bytes < o.slot_bytes)
                pass_msg[ps] = perftest_gbps(perftest, "ucp_am_bw",
                                             message_bytes, total, 0);
        }
        /* the params slots are published again (warm-up ones too) */
        for (uint64_t r = 0; r < o.requests; r++)
            atomic_store((_Atomic uint32_t *)slot_of(r), 0);
        for (uint64_t r = 0; r < (uint64_t)o.pairs * reqs_in_pool; r++)
            atomic_store((_Atomic uint32_t *)slot_of(WARM_BASE + r), 0);
        atomic_store(&sh->pass_go[ps], 1);
    }
    while (atomic_load(&sh->ready3) < nproc && !atomic_load(&sh->failed))
        kids_watch(kids, kst, kdone, nproc);
    atomic_store(&sh->go3, 1);
    /* every rank exits; after a failure, one still there after 10 s (in
     * a call that never returns) is killed */
    uint64_t kill_at = 0;
    for (uint32_t left = nproc; left;) {
        kids_watch(kids, kst, kdone, nproc);
        left = 0;
        for (uint32_t i = 0; i < nproc; i++)
            left += !kdone[i];
        if (atomic_load(&sh->failed) && !kill_at)
            kill_at = now_ns() + 10000000000ull;
        for (uint32_t i = 0; kill_at && now_ns() > kill_at && i < nproc; i++)
            if (!kdone[i])
                kill(kids[i], SIGKILL);
    }
    int failed = atomic_load(&sh->failed) != 0;
    for (uint32_t i = 0; i < nproc; i++)
        failed |= !WIFEXITED(kst[i]) || WEXITSTATUS(kst[i]);
    free(kst);
    free(kdone);
    if (o.daemons == 2 && !failed)
        message_bytes = peers_read();
    if (dpid > 0) {
        kill(dpid, SIGTERM);
        waitpid(dpid, NULL, 0);
        owned[0] = 0;
    }
    if (gen_dpid > 0) {
        kill(gen_dpid, SIGTERM);
        waitpid(gen_dpid, NULL, 0);
        owned[1] = 0;
    }
    if (failed) {
        if (o.daemons == 2 && !getenv("KVX_BENCH_DAEMON_LOG")) {
            print_log(peer_files[F_LOG_A], 2048);
            print_log(peer_files[F_LOG_B], 2048);
        }
        fprintf(stderr, "kvxfer-bench: failed: %s\n",
                sh->error_text[0] ? sh->error_text : "a rank crashed");
        return 1;
    }

    /* --daemons 2: ucx_perftest between two processes of this host, on
     * host memory, moving about the same bytes in messages of a slot */
    double ucx_gbps = 0, ucx_put_gbps = 0, ucx_msg_gbps = 0, d2h = 0, h2d = 0;
    double gpu_cap = INFINITY; /* host-staged: the slower GPU copy */
    double runs[2][MAX_PASSES] = {{0}};
    uint32_t nruns = o.baseline_runs;
    if (o.daemons == 2 && o.passes > 1) {
        /* the runs beside the passes */
        nruns = o.passes;
        memcpy(runs[0], pass_ucx, sizeof(pass_ucx));
        memcpy(runs[1], pass_msg, sizeof(pass_msg));
        ucx_gbps = median(runs[0], nruns);
        ucx_msg_gbps = pass_msg[0] > 0 ? median(runs[1], nruns) : 0;
        ucx_put_gbps = perftest_gbps(perftest, "ucp_put_bw", o.slot_bytes,
                                     total, 1);
        base = ucx_gbps > ucx_msg_gbps ? ucx_gbps : ucx_msg_gbps;
    } else if (o.daemons == 2) {
        /* --baseline-runs N: the median of N runs (the figure moves from
         * run to run on a busy host); slots that went as smaller
         * messages: UCX with those too, and the baseline is the better
         * of the two medians */
        int pieces = message_bytes && message_bytes < o.slot_bytes;
        for (uint32_t i = 0; i < o.baseline_runs; i++) {
            runs[0][i] = perftest_gbps(perftest, "ucp_am_bw", o.slot_bytes,
                                       total, 0);
            if (pieces)
                runs[1][i] = perftest_gbps(perftest, "ucp_am_bw",
                                           message_bytes, total, 0);
        }
        ucx_gbps = median(runs[0], o.baseline_runs);
        ucx_msg_gbps = pieces ? median(runs[1], o.baseline_runs) : 0;
        /* put: an extra figure, the 100-iteration run only */
        ucx_put_gbps = perftest_gbps(perftest, "ucp_put_bw", o.slot_bytes,
                                     total, 1);
        base = ucx_gbps > ucx_msg_gbps ? ucx_gbps : ucx_msg_gbps;
    }
#ifdef KVX_CUDA
    int ctx_gpu = o.gpu && !o.ctx_host, gen_gpu = o.gpu && !o.gen_host;
    if (o.gpu && o.daemons == 2) {
        /* host-staged: D2H on the context GPU, UCX between the daemons,
         * H2D on the generation GPU; the slowest stage bounds it */
        if ((ctx_gpu || gen_gpu) &&
            bgpu_host_gbps(ctx_gpu ? o.ctx_device : -1,
                           gen_gpu ? o.gen_device : -1, total, &d2h, &h2d))
            die("GPU host copy baseline failed");
        if (ctx_gpu && d2h < base)
            base = d2h;
        if (gen_gpu && h2d < base)
            base = h2d;
        if (ctx_gpu)
            gpu_cap = d2h;
        if (gen_gpu && h2d < gpu_cap)
            gpu_cap = h2d;
    } else if (o.gpu && ctx_gpu && gen_gpu) {
        base = bgpu_peer_gbps(o.ctx_device, o.gen_device, total);
    } else if (o.gpu && (ctx_gpu || gen_gpu)) {
        /* one side on the host: its copy crosses PCIe, one way */
        if (bgpu_host_gbps(ctx_gpu ? o.ctx_device : -1,
                           gen_gpu ? o.gen_device : -1, total, &d2h, &h2d))
            die("GPU host copy baseline failed");
        base = ctx_gpu ? d2h : h2d;
    } else if (o.gpu) {
        base = memcpy_baseline(total); /* both pools on the host */
    }
#endif
    const char *base_name =
        o.daemons == 1 ? NULL
        : (!o.gpu || (o.ctx_host && o.gen_host))
            ? (ucx_msg_gbps > 0 ? "ucx_perftest ucp_am_bw, the better of "
                                  "slot-sized and piece-sized messages"
                                : "ucx_perftest ucp_am_bw")
        : o.ctx_host   ? "min(H2D,ucx_perftest)"
        : o.gen_host   ? "min(D2H,ucx_perftest)"
                       : "min(D2H,H2D,ucx_perftest)";
    const char *tls = getenv("UCX_TLS");
    /* one pass: its GB/s over the baseline; several: the medians of the
     * passes' GB/s, of their baselines, and of their ratios (each pass
     * over the baseline measured right after it) */
    double pass_gbps[MAX_PASSES] = {0}, pass_ratio[MAX_PASSES] = {0};
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        double b = base;
        if (o.daemons == 2 && o.passes > 1) {
            b = pass_ucx[ps] > pass_msg[ps] ? pass_ucx[ps] : pass_msg[ps];
            if (gpu_cap < b)
                b = gpu_cap;
        }
        pass_gbps[ps] = (double)total / pass_secs[ps] / 1e9;
        pass_ratio[ps] = b > 0 ? pass_gbps[ps] / b : 0;
    }
    double secs = median(pass_secs, o.passes);
    double gbps = median(pass_gbps, o.passes);
    double ratio = o.passes > 1 ? median(pass_ratio, o.passes) : gbps / base;
    qsort(lat_ns, o.requests, sizeof(uint64_t), cmp_u64);
    double p50 = lat_ns[o.requests / 2] / 1e3;
    double p99 = lat_ns[(o.requests * 99) / 100 < o.requests
                            ? (o.requests * 99) / 100
                            : o.requests - 1] / 1e3;
    int verified =
        !o.no_verify && sh->mismatches == 0 && sh->guard_changed == 0 &&
        (sampled()
             ? sh->sampled_reqs == (uint64_t)o.requests * o.gen_ranks * o.passes
             : sh->verified_bytes == total * o.passes);
    if (!(base > 0)) /* a ratio against nothing is no figure (nor JSON) */
        die("the baseline measured %.3f GB/s; no ratio can be given", base);
    if (o.json) {
        printf(
            "{\"gbps\":%.3f,\"baseline_gbps\":%.3f,\"ratio\":%.3f,"
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
            gbps, base, ratio, verified ? "true" : "false",
            o.no_verify ? "none"
            : sampled() ? "sampled"
                        : "every byte",
            o.requests / secs, p50, p99, (unsigned long long)total, o.requests,
            o.blocks, o.ctx_layout, o.gen_layout, o.gpu ? "true" : "false",
            o.ctas, o.ctx_ranks, o.gen_ranks, o.window, o.pairs, o.ctx_pp,
            o.gen_pp, o.ctx_tpb, o.gen_tpb, o.skip, o.mla ? "true" : "false",
            (unsigned long long)sh->mismatches, secs,
            (unsigned long long)o.pool_offset, (unsigned long long)o.vmm_chunk,
            (unsigned long long)sh->guard_changed, o.regions,
            o.keyed ? "true" : "false", o.reserve ? "true" : "false",
            o.by_key ? "true" : "false", o.shuffle ? "true" : "false");
        printf(",\"passes\":%u,\"pass_gbps\":[", o.passes);
        for (uint32_t ps = 0; ps < o.passes; ps++)
            printf("%s%.3f", ps ? "," : "", pass_gbps[ps]);
        printf("],\"pass_ratios\":[");
        for (uint32_t ps = 0; ps < o.passes; ps++)
            printf("%s%.3f", ps ? "," : "", pass_ratio[ps]);
        printf("]");
        if (o.daemons == 2) {
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
                   (unsigned long long)message_bytes, lanes_used, ucx_gbps,
                   ucx_msg_gbps, ucx_put_gbps);
            for (uint32_t i = 0; i < nruns; i++)
                printf("%s%.3f", i ? "," : "", runs[0][i]);
            printf("],\"ucx_perftest_message_runs\":[");
            for (uint32_t i = 0; ucx_msg_gbps > 0 && i < nruns; i++)
                printf("%s%.3f", i ? "," : "", runs[1][i]);
            printf("]");
            if (o.gpu)
                printf(",\"d2h_gbps\":%.3f,\"h2d_gbps\":%.3f", d2h, h2d);
            /* warm-up included */
            printf(",\"slot_us\":{\"received\":{\"slots\":%.0f,\"wait\":%.1f,"
                   "\"wire\":%.1f,\"scatter\":%.1f,\"scatter_lag\":%.1f,"
                   "\"direct_pieces\":%.0f},"
                   "\"sent\":{\"slots\":%.0f,\"wait\":%.1f,\"gather\":%.1f,"
                   "\"gather_lag\":%.1f,\"wire\":%.1f,\"ahead\":%.0f,"
                   "\"direct_pieces\":%.0f}}",
                   slot_rx[0], slot_rx[1], slot_rx[2], slot_rx[3], slot_rx[4],
                   slot_rx[6], slot_tx[0], slot_tx[1], slot_tx[3], slot_tx[4],
                   slot_tx[2], slot_tx[5], slot_tx[6]);
            printf(",\"baseline\":");
            json_str(base_name);
            printf(",\"ctx_daemon\":");
            json_str(sh->address);
            printf(",\"gen_daemon\":");
            json_str(sh->gen_address);
        }
        if (o.trace)
            trace_report(stdout, 1);
        printf("}\n");
    } else {
        printf("kvxfer-bench: context tp %u pp %u (%s, %u tokens/block) -> "
               "generation tp %u pp %u (%s, %u tokens/block)%s\n"
               "  %u requests x %u tokens (skip %u), %u layers x %u KV heads "
               "x %u dim, %s%s, window %u\n",
               o.ctx_ranks, o.ctx_pp, o.ctx_layout, o.ctx_tpb, o.gen_ranks,
               o.gen_pp, o.gen_layout, o.gen_tpb,
               o.gpu ? ", GPU pools" : "", o.requests, num_tokens, o.skip,
               o.layers, o.heads, o.head_dim, kvx_dtype_name(o.dtype),
               o.mla ? ", MLA" : "", o.window);
        printf("  %-22s %12.3f GB/s  (%.1f MiB in %.4f s)\n", "kvxferd",
               gbps, total / 1048576.0, secs);
        if (o.daemons == 2) {
            printf("  daemons: context on %s, generation on %s\n"
                   "  slot %llu bytes, UCX_TLS %s, %u lanes (ucx_perftest: "
                   "one connection, one thread a side)\n",
                   sh->address, sh->gen_address,
                   (unsigned long long)o.slot_bytes, tls ? tls : "(default)",
                   lanes_used);
            printf("  %-22s %12.3f GB/s%s\n", "ucx_perftest am_bw",
                   ucx_gbps, nruns > 1 ? "  (median)" : "");
            if (ucx_msg_gbps > 0)
                printf("  %-22s %12.3f GB/s  (messages of %llu bytes, the "
                       "daemons' pieces)\n",
                       "ucx_perftest am_bw", ucx_msg_gbps,
                       (unsigned long long)message_bytes);
            printf("  %-22s %12.3f GB/s  (100 messages)\n",
                   "ucx_perftest put_bw", ucx_put_gbps);
            printf("  slots received by B  %.0f, per slot: wait %.0f us, "
                   "wire %.0f us, scatter %.0f us (loop lag %.0f); %.0f "
                   "pieces received straight into the blocks\n"
                   "  slots sent by A      %.0f, per slot: wait %.0f us, "
                   "gather %.0f us (loop lag %.0f), wire %.0f us; %.0f "
                   "gathered ahead\n",
                   slot_rx[0], slot_rx[1], slot_rx[2], slot_rx[3], slot_rx[4],
                   slot_rx[6], slot_tx[0], slot_tx[1], slot_tx[3], slot_tx[4],
                   slot_tx[2], slot_tx[5]);
            if (o.gpu && !o.ctx_host)
                printf("  %-22s %12.3f GB/s  (GPU %d to pinned host)\n",
                       "D2H", d2h, o.ctx_device);
            if (o.gpu && !o.gen_host)
                printf("  %-22s %12.3f GB/s  (pinned host to GPU %d)\n",
                       "H2D", h2d, o.gen_device);
            printf("  %-22s %12.3f GB/s  (%s, same run)\n", "baseline",
                   base, base_name);
        } else
            printf("  %-22s %12.3f GB/s  (same bytes, same run)\n",
                   !o.gpu || (o.ctx_host && o.gen_host) ? "memcpy baseline"
                   : o.ctx_host                        ? "H2D baseline"
                   : o.gen_host                        ? "D2H baseline"
                   : o.ctx_device == o.gen_device      ? "cudaMemcpy baseline"
                                               : "cudaMemcpyPeer baseline",
                   base);
        printf("  %-22s %12.3f%s\n", "ratio", ratio,
               o.passes > 1 ? "  (median of the passes' ratios)" : "");
        if (o.passes > 1) {
            printf("  %-22s", "passes GB/s");
            for (uint32_t ps = 0; ps < o.passes; ps++)
                printf(" %.3f", pass_gbps[ps]);
            printf("\n  %-22s", "passes ratio");
            for (uint32_t ps = 0; ps < o.passes; ps++)
                printf(" %.3f", pass_ratio[ps]);
            printf("\n");
        }
        printf("  %-22s %12.0f\n", "requests/s", o.requests / secs);
        printf("  %-22s %12.1f us\n", "latency p50", p50);
        printf("  %-22s %12.1f us\n", "latency p99", p99);
        printf("  %-22s %12s  (%llu mismatched rows%s)\n", "verified",
               o.no_verify ? "skipped"
               : verified  ? "yes"
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
    return o.no_verify || verified ? 0 : 1;
}
