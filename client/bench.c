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
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdarg.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
    int no_verify, no_warmup;
    const char *daemon_config;
    const char *ctx_layout, *gen_layout;
    int gpu, vmm, ctx_device, gen_device, ctx_host, gen_host;
    uint32_t pairs;       /* independent (context, generation) instance pairs */
    uint32_t ctx_pp, gen_pp, ctx_tpb, gen_tpb, skip;
    int mla;
    uint32_t ctas;
} o = {
    .ctx_ranks = 1, .gen_ranks = 1, .requests = 64, .blocks = 256,
    .window = 16, .layout = "vllm-nhd", .layers = 32, .heads = 8,
    .head_dim = 128, .tpb = 16, .dtype = KVX_DTYPE_BF16,
    .pool_cap_mib = 2048, .ctx_device = 0, .gen_device = 1, .pairs = 1,
    .ctx_pp = 1, .gen_pp = 1,
};

/* Shared between the parent and the rank processes. */
struct shared {
    _Atomic uint32_t ready;          /* ranks connected and registered */
    _Atomic uint32_t go;
    _Atomic uint32_t ready2, go2;     /* between warm-up and timed pass */
    _Atomic uint32_t ready3, go3;     /* before any rank disconnects */
    _Atomic uint32_t failed;
    char address[192];
    _Atomic uint64_t first_fetch_ns, last_done_ns;
    _Atomic uint64_t mismatches, verified_bytes, errors;
    char error_text[512];
    /* then: params slots, then latencies of gen rank 0 */
};

/* Derived from the options: tokens per request, KV factor, and each side's
 * blocks per request. */
static uint32_t num_tokens, kvf;

static struct shared *sh;
static uint8_t *slots;        /* requests x PARAMS_SLOT: u32 ready, u32 len, data */
static uint64_t *lat_ns;      /* requests */
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
    uint8_t want[4096];
    uint32_t n = rowbytes <= sizeof(want) ? rowbytes : sizeof(want);
    row_fill(want, n, r, l, kv, t, h);
    return memcmp(src, want, n) == 0;
}

/* Visit every row of request r held by one rank's blocks. */
typedef struct rank_view {
    uint8_t *base;        /* host pool mapping, or the GPU pool */
    kvx_layout_t layout;
    uint32_t head0;       /* first global head of the rank */
    uint32_t layer0;      /* first global layer of the rank (PP) */
    uint32_t bpr;         /* blocks per request on this side */
    int device;           /* >= 0: GPU pool on this device */
} rank_view_t;

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
    return (uint32_t)((r % reqs_in_pool) * v->bpr + i);
}

static void fill_request(const rank_view_t *v, uint64_t r)
{
#ifdef KVX_CUDA
    if (v->device >= 0) {
        if (bgpu_fill(v->device, &v->layout, v->base, r, req_block(v, r, 0),
                      v->bpr, v->head0, v->layer0))
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
                        row_fill(v->base + kvx_layout_offset(
                                               l, layer, kv,
                                               req_block(v, r, b), t, h),
                                 rowbytes, r, v->layer0 + layer, kv, gt,
                                 v->head0 + h);
                }
}

/* Mismatched rows of request r among tokens [skip, num_tokens). */
static uint64_t check_request(const rank_view_t *v, uint64_t r)
{
#ifdef KVX_CUDA
    if (v->device >= 0) {
        int64_t bad = bgpu_check(v->device, &v->layout, v->base, r,
                                 req_block(v, r, 0), v->bpr, v->head0,
                                 v->layer0, o.skip, num_tokens);
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
                            v->base + kvx_layout_offset(l, layer, kv,
                                                        req_block(v, r, b), t,
                                                        h),
                            rowbytes, r, v->layer0 + layer, kv, gt,
                            v->head0 + h);
                }
    return bad;
}

/* ---- ranks ------------------------------------------------------------ */

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
    int rc = kvx_connect(o.socket, &h, TIMEOUT_MS, &c);
    if (rc)
        die("connect %s rank %u to %s: %s", inst, rank, o.socket,
            kvx_status_str(rc));
    char addr[192];
    CHECK_KVX(kvxfer_daemon_address(c, addr, sizeof(addr)), c);
    /* engines allgather the addresses; here every rank is on one daemon */
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
    const char *preset = ctx ? o.ctx_layout : o.gen_layout;
    if (kvx_layout_preset(preset, layers, kvf, heads, o.head_dim, o.dtype,
                          tpb, nblocks, &v->layout))
        die("layout preset '%s' rejects these dimensions", preset);
    uint64_t size = kvx_layout_span(&v->layout);
    void *ptr;
    v->device = -1;
    int on_gpu = o.gpu && !(ctx ? o.ctx_host : o.gen_host);
    if (on_gpu) {
#ifdef KVX_CUDA
        char err[256];
        v->device = ctx ? o.ctx_device : o.gen_device;
        if (bgpu_alloc(v->device, size, o.vmm, &ptr, err, sizeof(err)))
            die("GPU %d: %s", v->device, err);
        if (bgpu_memset(v->device, ptr, 0, size))
            die("GPU %d: memset failed", v->device);
        CHECK_KVX(kvx_pool_register_gpu(c, &v->layout, ptr, size, pool_id,
                                        TIMEOUT_MS),
                  c);
        v->base = ptr;
        return c;
#endif
    }
    CHECK_KVX(kvx_pool_create_host(c, &v->layout, size, &ptr, pool_id,
                                   TIMEOUT_MS),
              c);
    v->base = ptr;
    memset(v->base, 0, size); /* fault the pages in before timing */
    return c;
}

static void barrier(_Atomic uint32_t *ready, _Atomic uint32_t *go)
{
    atomic_fetch_add(ready, 1);
    while (!atomic_load(go)) {
        if (atomic_load(&sh->failed))
            exit(1);
        usleep(100);
    }
}

/* Context rank: publish requests [first, first + count), keeping at most
 * reqs_in_pool offers open, until all are consumed. */
static void ctx_run(kvx_client_t *c, rank_view_t *v, uint32_t rank,
                    uint32_t pool, uint64_t first, uint64_t count, int fill)
{
    uint32_t *bt = malloc(v->bpr * sizeof(uint32_t));
    uint8_t *fin = calloc(count, 1); /* request's offer complete */
    uint64_t published = 0, done = 0;
    while (done < count) {
        /* blocks are reused every reqs_in_pool requests: publish k only
         * once k - reqs_in_pool is complete (they complete in any order) */
        if (published < count &&
            (published < reqs_in_pool || fin[published - reqs_in_pool])) {
            uint64_t r = first + published;
            if (fill)
                fill_request(v, r);
            for (uint32_t i = 0; i < v->bpr; i++)
                bt[i] = req_block(v, r, i);
            kvx_context_params_t p;
            CHECK_KVX(kvx_publish(c, r, pool, bt, v->bpr, num_tokens, &p,
                                  TIMEOUT_MS),
                      c);
            if (rank == 0) {
                if (p.len > PARAMS_SLOT - 8)
                    die("context params of %zu bytes", p.len);
                uint8_t *s = slot_of(r);
                memcpy(s + 8, p.data, p.len);
                ((uint32_t *)s)[1] = (uint32_t)p.len;
                atomic_store_explicit((_Atomic uint32_t *)s, 1,
                                      memory_order_release);
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
            fin[b->events[i].request_id - first] = 1;
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
    uint64_t per = o.requests / o.pairs, first = my_pair * per;
    int reuse = reqs_in_pool < per;
    barrier(&sh->ready, &sh->go);
    if (!o.no_warmup)
        ctx_run(c, &v, rank, pool, WARM_BASE + my_pair * reqs_in_pool,
                reqs_in_pool, 0);
    if (!reuse && !o.no_verify)
        for (uint64_t r = first; r < first + per; r++)
            fill_request(&v, r);
    barrier(&sh->ready2, &sh->go2);
    ctx_run(c, &v, rank, pool, first, per, reuse && !o.no_verify);
    /* a rank that leaves ends its instance's requests: with replicated
     * heads other ranks may still be publishing theirs */
    barrier(&sh->ready3, &sh->go3);
    kvx_close(c);
    exit(0);
}

/* Generation rank: fetch requests [first, first + count) with up to
 * window outstanding; record latency (rank 0) and verify. */
static uint64_t gen_run(kvx_client_t *c, rank_view_t *v, uint32_t rank,
                        uint32_t pool, uint64_t first, uint64_t count,
                        int timed, uint64_t *checked)
{
    int check = timed && !o.no_verify && reqs_in_pool < count;
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
                    struct timespec ts = {0, 2000};
                    nanosleep(&ts, NULL);
                    continue;
                }
                goto poll;
            }
            for (uint32_t i = 0; i < v->bpr; i++)
                bt[i] = req_block(v, r, i);
            t0[next] = now_ns();
            uint64_t zero = 0;
            if (timed)
                atomic_compare_exchange_strong(&sh->first_fetch_ns, &zero,
                                               t0[next]);
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
            uint64_t k = e->request_id - first;
            if (timed && rank == 0)
                lat_ns[first + k] = t - t0[k];
            if (check) {
                bad += check_request(v, e->request_id);
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
    bad = gen_run(c, &v, rank, pool, first, per, 1, &checked);
    if (reqs_in_pool >= per && !o.no_verify)
        for (uint64_t r = first; r < first + per; r++, checked++)
            bad += check_request(&v, r);
    uint64_t per_req = (uint64_t)(num_tokens - o.skip) *
                       v.layout.num_layers * kvf * v.layout.num_heads *
                       o.head_dim * kvx_dtype_size(o.dtype);
    atomic_fetch_add(&sh->mismatches, bad);
    atomic_fetch_add(&sh->verified_bytes, checked * per_req);
    barrier(&sh->ready3, &sh->go3);
    kvx_close(c);
    exit(0);
}

/* ---- parent: daemon, baseline, report --------------------------------- */

static pid_t spawn_daemon(char *sock, size_t len)
{
    char exe[PATH_MAX], daemon[PATH_MAX + 16];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0)
        die("readlink /proc/self/exe: %s", strerror(errno));
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    *slash = 0;
    const char *env = getenv("KVXFERD");
    snprintf(daemon, sizeof(daemon), "%s", env ? env : exe);
    if (!env)
        strcat(daemon, "/kvxferd");
    snprintf(sock, len, "/tmp/kvxfer-bench-%d.sock", (int)getpid());
    pid_t pid = fork();
    if (pid == 0) {
        if (!getenv("KVX_BENCH_DAEMON_LOG")) {
            int fd = open("/dev/null", O_WRONLY);
            if (fd >= 0)
                dup2(fd, 2);
        }
        char cfg[128];
        if (o.ctas && !o.daemon_config) {
            snprintf(cfg, sizeof(cfg), "/tmp/kvxfer-bench-%d.yaml",
                     (int)getppid());
            FILE *f = fopen(cfg, "w");
            if (f) {
                fprintf(f, "gpu:\n  max_ctas: %u\n", o.ctas);
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
    for (int i = 0; i < 500; i++) { /* up to 5 s */
        kvx_client_t *c;
        if (kvx_connect_observer(sock, 100, &c) == 0) {
            kvx_close(c);
            return pid;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            die("daemon %s exited during start", daemon);
        usleep(10000);
    }
    kill(pid, SIGKILL);
    die("daemon %s did not start listening on %s", daemon, sock);
    return -1;
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

static void usage(FILE *f)
{
    fprintf(f,
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
        "  --no-warmup            time the first pass over the pools too\n"
        "  --daemon-config FILE   config for --spawn-daemon\n"
        "  --ctx-layout P, --gen-layout P   a preset per side (default "
        "--layout)\n"
        "  --gpu                  pools in GPU memory (CUDA build)\n"
        "  --ctx-device N, --gen-device N   GPUs (default 0 and 1)\n"
        "  --vmm                  cuMemCreate (VMM fd) pools, not cudaMalloc\n"
        "  --ctas N               gpu.max_ctas of the spawned daemon\n"
        "  --ctx-host, --gen-host with --gpu: that side in host memory\n"
        "  --pairs P              P independent context/generation "
        "instance pairs\n"
        "                         sharing the requests (daemon-wide "
        "throughput)\n"
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
        case 'w': o.no_warmup = 1; break;
        case 'C': o.daemon_config = optarg; break;
        case 'x': o.ctx_layout = optarg; break;
        case 'y': o.gen_layout = optarg; break;
        case 'g': o.gpu = 1; break;
        case 'v': o.vmm = 1; break;
        case 'a': o.ctx_device = (int)arg_u32("ctx-device", optarg, 0, 63); break;
        case 'b': o.gen_device = (int)arg_u32("gen-device", optarg, 0, 63); break;
        case 'c': o.ctas = arg_u32("ctas", optarg, 1, 1024); break;
        case 'X': o.ctx_host = 1; break;
        case 'p': o.pairs = arg_u32("pairs", optarg, 1, 64); break;
        case 1001: o.ctx_pp = arg_u32("ctx-pp", optarg, 1, 64); break;
        case 1002: o.gen_pp = arg_u32("gen-pp", optarg, 1, 64); break;
        case 1003: o.ctx_tpb = arg_u32("ctx-tokens-per-block", optarg, 1, 65536); break;
        case 1004: o.gen_tpb = arg_u32("gen-tokens-per-block", optarg, 1, 65536); break;
        case 1005: o.skip = arg_u32("skip-tokens", optarg, 0, UINT32_MAX - 1); break;
        case 1006: o.mla = 1; break;
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
    if (o.ctas && !o.spawn) {
        fprintf(stderr, "kvxfer-bench: --ctas needs --spawn-daemon (it is "
                        "the daemon's gpu.max_ctas)\n");
        return 2;
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

    size_t shlen = sizeof(struct shared) +
                   ((size_t)o.requests + (size_t)o.pairs * reqs_in_pool) *
                       PARAMS_SLOT +
                   (size_t)o.requests * sizeof(uint64_t);
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

    char sock[128];
    pid_t dpid = -1;
    if (o.spawn) {
        dpid = spawn_daemon(sock, sizeof(sock));
        o.socket = sock;
    }

    /* CUDA must not be initialized before fork: the GPU baseline runs
     * after the ranks are done */
    double base = o.gpu ? 0 : memcpy_baseline(total);

    uint32_t nctx = o.ctx_ranks * o.ctx_pp, ngen = o.gen_ranks * o.gen_pp;
    uint32_t per_pair = nctx + ngen;
    uint32_t nproc = per_pair * o.pairs;
    pid_t *kids = calloc(nproc, sizeof(pid_t));
    for (uint32_t i = 0; i < nproc; i++) {
        pid_t p = fork();
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
    while (atomic_load(&sh->ready) < nproc && !atomic_load(&sh->failed))
        usleep(1000);
    atomic_store(&sh->go, 1);
    while (atomic_load(&sh->ready2) < nproc && !atomic_load(&sh->failed))
        usleep(1000);
    atomic_store(&sh->go2, 1);
    while (atomic_load(&sh->ready3) < nproc && !atomic_load(&sh->failed))
        usleep(1000);
    atomic_store(&sh->go3, 1);
    int failed = 0;
    for (uint32_t i = 0; i < nproc; i++) {
        int st;
        waitpid(kids[i], &st, 0);
        failed |= !WIFEXITED(st) || WEXITSTATUS(st);
        if (failed && !atomic_load(&sh->failed))
            atomic_fetch_add(&sh->failed, 1);
    }
    if (dpid > 0) {
        kill(dpid, SIGTERM);
        waitpid(dpid, NULL, 0);
    }
    if (failed) {
        fprintf(stderr, "kvxfer-bench: failed: %s\n",
                sh->error_text[0] ? sh->error_text : "a rank crashed");
        return 1;
    }

#ifdef KVX_CUDA
    if (o.gpu)
        base = bgpu_peer_gbps(o.ctx_device, o.gen_device, total);
#endif
    double secs = (double)(sh->last_done_ns - sh->first_fetch_ns) / 1e9;
    double gbps = (double)total / secs / 1e9;
    qsort(lat_ns, o.requests, sizeof(uint64_t), cmp_u64);
    double p50 = lat_ns[o.requests / 2] / 1e3;
    double p99 = lat_ns[(o.requests * 99) / 100 < o.requests
                            ? (o.requests * 99) / 100
                            : o.requests - 1] / 1e3;
    int verified = !o.no_verify && sh->mismatches == 0 &&
                   sh->verified_bytes == total;
    if (o.json) {
        printf("{\"gbps\":%.3f,\"baseline_gbps\":%.3f,\"ratio\":%.3f,"
               "\"verified\":%s,\"requests_per_s\":%.0f,\"p50_us\":%.1f,"
               "\"p99_us\":%.1f,\"bytes\":%llu,\"requests\":%u,\"blocks\":%u,"
               "\"ctx_layout\":\"%s\",\"gen_layout\":\"%s\",\"gpu\":%s,"
               "\"ctas\":%u,\"ctx_ranks\":%u,\"gen_ranks\":%u,"
               "\"window\":%u,\"pairs\":%u,\"ctx_pp\":%u,\"gen_pp\":%u,"
               "\"ctx_tpb\":%u,\"gen_tpb\":%u,\"skip_tokens\":%u,"
               "\"mla\":%s,\"mismatched_rows\":%llu,\"seconds\":%.4f}\n",
               gbps, base, gbps / base, verified ? "true" : "false",
               o.requests / secs, p50, p99, (unsigned long long)total,
               o.requests, o.blocks, o.ctx_layout, o.gen_layout,
               o.gpu ? "true" : "false", o.ctas, o.ctx_ranks, o.gen_ranks,
               o.window, o.pairs, o.ctx_pp, o.gen_pp, o.ctx_tpb, o.gen_tpb,
               o.skip, o.mla ? "true" : "false",
               (unsigned long long)sh->mismatches, secs);
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
        printf("  %-22s %12.3f GB/s  (same bytes, same run)\n",
               o.gpu ? (o.ctx_device == o.gen_device ? "cudaMemcpy baseline"
                                                     : "cudaMemcpyPeer baseline")
                     : "memcpy baseline",
               base);
        printf("  %-22s %12.3f\n", "ratio", gbps / base);
        printf("  %-22s %12.0f\n", "requests/s", o.requests / secs);
        printf("  %-22s %12.1f us\n", "latency p50", p50);
        printf("  %-22s %12.1f us\n", "latency p99", p99);
        printf("  %-22s %12s  (%llu mismatched rows)\n", "verified",
               o.no_verify ? "skipped" : verified ? "yes" : "NO",
               (unsigned long long)sh->mismatches);
    }
    return o.no_verify || verified ? 0 : 1;
}
