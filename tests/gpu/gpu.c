/*
 * GPU tests (make test-gpu): a real kvxferd, engine ranks as processes
 * with GPU pools. Byte checks use the reference pattern (bench_pattern.h)
 * computed from the configurations alone. Without a GPU every test prints
 * why it skips and passes nothing.
 *
 * Transfers of every layout pair, across GPUs and within one, both IPC
 * kinds and host<->GPU are driven through kvxfer-bench, which verifies
 * every byte and exits non-zero otherwise; cancel in flight and a client
 * killed mid-read are written out here.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvxfer.h"
#include "tests/test.h"
#include "tools/bench_gpu.h"

static const char *build_dir(void)
{
    const char *b = getenv("KVX_BUILD");
    return b ? b : "build";
}

/* The GPU count (probed in a child by bgpu_device_count(): CUDA must stay
 * uninitialized in the test processes that fork ranks), once. */
static int gpus(void)
{
    static int cached = -1;
    if (cached < 0)
        cached = bgpu_device_count();
    return cached;
}

/* The generation side's GPU: GPU 1 where there are two, so that copies
 * cross GPUs (NVLink or PCIe peer access); GPU 0 on a one-GPU machine,
 * where the same code paths run within one device. */
static int gen_dev(void)
{
    return gpus() >= 2 ? 1 : 0;
}

#define NEED_GPUS(k)                                                           \
    do {                                                                       \
        int n_ = gpus();                                                       \
        if (n_ < (k)) {                                                        \
            printf("skip: %s needs %d GPU(s), found %d\n", __func__, (k), n_); \
            exit(0);                                                           \
        }                                                                      \
    } while (0)

/* Run kvxfer-bench with args; pass when it verified every byte. Its
 * JSON line into out (len bytes), when out is not NULL. */
static void bench_out(const char *args, char *out, size_t len)
{
    char cmd[1024], buf[8192] = "";
    snprintf(cmd, sizeof(cmd),
             "%s/kvxfer-bench --spawn-daemon --gpu %s%s --json 2>&1",
             build_dir(), args,
             gen_dev() == 0 && !strstr(args, "--gen-device") ? " --gen-device 0"
                                                             : "");
    FILE *f = popen(cmd, "r");
    CHECK(f);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = 0;
    int st = pclose(f);
    if (st != 0 || !strstr(buf, "\"verified\":true")) {
        fprintf(stderr, "%s\n-> %s\n", cmd, buf);
        CHECK(0);
    }
    if (out)
        snprintf(out, len, "%s", buf);
}

static void bench(const char *args)
{
    bench_out(args, NULL, 0);
}

static const char *presets[] = {"trtllm", "vllm-nhd", "vllm-hnd", "flashinfer"};

/* kvxfer-bench for every preset pair, with extra(a, b)'s arguments. */
static void every_preset_pair(const char *(*extra)(int a, int b))
{
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) {
            char args[512];
            snprintf(args, sizeof(args),
                     "--ctx-layout %s --gen-layout %s --requests 4 "
                     "--blocks 8 --layers 4 --heads 4 --head-dim 64 "
                     "--tokens-per-block 16 %s",
                     presets[a], presets[b], extra ? extra(a, b) : "");
            bench(args);
        }
}

TEST_T(every_preset_pair_across_gpus, 300)
{
    NEED_GPUS(1);
    every_preset_pair(NULL);
}

TEST_T(within_one_gpu, 120)
{
    NEED_GPUS(1);
    bench("--gen-device 0 --ctx-layout trtllm --gen-layout vllm-nhd "
          "--requests 4 --blocks 16 --layers 4");
}

TEST_T(tp_split_and_concat, 120)
{
    NEED_GPUS(1);
    bench("--ctx-ranks 4 --gen-ranks 2 --ctx-layout trtllm --gen-layout "
          "vllm-nhd --requests 4 --blocks 8 --layers 4");
    bench("--ctx-ranks 1 --gen-ranks 2 --requests 4 --blocks 8 --layers 4");
}

TEST_T(vmm_fd_pools, 120)
{
    NEED_GPUS(1);
    bench("--vmm --requests 4 --blocks 16 --layers 4");
}

TEST_T(legacy_ipc_pools_odd_sizes, 120)
{
    NEED_GPUS(1);
    /* head_dim 7 x fp8: rows not 16-byte aligned, the byte path */
    bench("--requests 4 --blocks 8 --layers 3 --heads 2 --head-dim 7 "
          "--dtype fp8 --tokens-per-block 5");
}

/* Pools of regions on the GPU: a cudaMalloc per layer (vLLM), a K and a
 * V allocation per layer (SGLang), each imported once and addressed at
 * its own offset; every byte verified by the bench. Across two daemons
 * too (host-staged). */
TEST_T(gpu_pools_of_regions, 300)
{
    NEED_GPUS(1);
    bench("--regions 4 --layers 4 --ctx-layout vllm-nhd --gen-layout "
          "flashinfer --requests 4 --blocks 8");
    bench("--regions 8 --layers 4 --ctx-layout vllm-hnd --gen-layout "
          "vllm-nhd --requests 4 --blocks 8");
    bench("--regions 4 --layers 4 --ctx-ranks 2 --gen-ranks 1 --requests 4 "
          "--blocks 8");
    bench("--regions 4 --layers 4 --daemons 2 --requests 4 --blocks 8");
}

TEST_T(host_to_gpu_and_back, 120)
{
    NEED_GPUS(1);
    bench("--ctx-host --gen-device 0 --requests 4 --blocks 8 --layers 4");
    bench("--gen-host --ctx-device 0 --requests 4 --blocks 8 --layers 4");
}

/* ---- the copy engines' path (gpu.copy_path) ------------------------- */

/* A daemon config of one gpu: section's text, in a temp file (path out). */
static void gpu_config(const char *text, char *path, size_t len)
{
    snprintf(path, len, "/tmp/kvx-gpu-test-%d.yaml", (int)getpid());
    FILE *f = fopen(path, "w");
    CHECK(f);
    fprintf(f, "gpu:\n%s", text);
    fclose(f);
}

/* The launches the copy engines took, from the bench's "gpu_status" (the
 * daemon's status "gpu": "... (copy engines: N launches, ..."). */
static long long dma_launches(const char *out)
{
    const char *t = strstr(out, "copy engines: ");
    CHECK(t);
    return atoll(t + 14);
}

/* gpu.copy_path dma: every byte verified on every path a GPU pool takes
 * (every preset pair, TP change, odd rows in fp8, regions, host <-> GPU,
 * VMM pools, shuffled blocks, small launches, two daemons' host slots),
 * and the copy engines did move them */
TEST_T(copy_engines_path, 600)
{
    NEED_GPUS(1);
    char cfg[128], args[768], out[8192];
    gpu_config("  copy_path: dma\n  stream_priority: low\n", cfg, sizeof(cfg));
    static const char *cases[] = {
        "--ctx-ranks 4 --gen-ranks 2 --ctx-layout trtllm --gen-layout "
        "vllm-nhd --requests 4 --blocks 8 --layers 4",
        "--requests 4 --blocks 8 --layers 3 --heads 2 --head-dim 7 "
        "--dtype fp8 --tokens-per-block 5",
        "--regions 8 --layers 4 --ctx-layout vllm-hnd --gen-layout "
        "vllm-nhd --requests 4 --blocks 8",
        "--ctx-host --gen-device 0 --requests 4 --blocks 8 --layers 4",
        "--gen-host --ctx-device 0 --requests 4 --blocks 8 --layers 4",
        "--vmm --shuffle --requests 8 --blocks 64 --layers 4",
        "--daemons 2 --ctx-layout trtllm --gen-layout vllm-nhd --requests 4 "
        "--blocks 8 --layers 4",
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(args, sizeof(args), "%s --daemon-config %s", cases[i], cfg);
        bench_out(args, out, sizeof(out));
        if (!strstr(cases[i], "--daemons 2")) /* B is the gen daemon */
            CHECK(dma_launches(out) > 0);
    }
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) {
            snprintf(args, sizeof(args),
                     "--ctx-layout %s --gen-layout %s --requests 4 "
                     "--blocks 8 --layers 4 --heads 4 --head-dim 64 "
                     "--tokens-per-block 16 --daemon-config %s",
                     presets[a], presets[b], cfg);
            bench_out(args, out, sizeof(out));
            CHECK(dma_launches(out) > 0);
        }
    /* launches of 64 KiB: a request in many pieces */
    gpu_config("  copy_path: dma\n  chunk_bytes: 64KiB\n", cfg, sizeof(cfg));
    snprintf(args, sizeof(args),
             "--shuffle --requests 4 --blocks 32 --layers 4 --daemon-config %s",
             cfg);
    bench_out(args, out, sizeof(out));
    CHECK(dma_launches(out) >= 4 * 8);
    /* auto: 32 KiB runs (16 tokens x 8 heads x 128 x bf16, the same
     * layout) go to the copy engines, rows of a layout change to the
     * kernel */
    gpu_config("  copy_path: auto\n  dma_min_run: 32KiB\n", cfg, sizeof(cfg));
    snprintf(args, sizeof(args),
             "--layout vllm-nhd --heads 8 --head-dim 128 --dtype bf16 "
             "--tokens-per-block 16 --requests 4 --blocks 8 --layers 4 "
             "--daemon-config %s",
             cfg);
    bench_out(args, out, sizeof(out));
    CHECK(dma_launches(out) > 0);
    snprintf(args, sizeof(args),
             "--ctx-layout trtllm --gen-layout vllm-nhd --heads 8 "
             "--head-dim 128 --dtype bf16 --tokens-per-block 16 --requests 4 "
             "--blocks 8 --layers 4 --daemon-config %s",
             cfg);
    bench_out(args, out, sizeof(out));
    CHECK_EQ(dma_launches(out), 0);
    unlink(cfg);
}

/* ---- two daemons, GPU pools, host-staged ------------------------------ */

/* Context daemon and generation daemon on one host, talking UCX over
 * loopback: each GPU pool is gathered by a kernel into a pinned slot,
 * sent, and scattered by a kernel (issue #4's host-staged path). */
/* Four preset pairs between two daemons, with extra arguments. */
static void two_daemon_pairs(const char *extra)
{
    for (int a = 0; a < 4; a += 3)
        for (int b = 1; b < 4; b += 2) {
            char args[512];
            snprintf(args, sizeof(args),
                     "--daemons 2 --ctx-layout %s --gen-layout %s "
                     "--requests 4 --blocks 8 --layers 4 --heads 4 "
                     "--head-dim 64 --tokens-per-block 16 %s",
                     presets[a], presets[b], extra);
            bench(args);
        }
}

TEST_T(two_daemons_gpu_pools_host_staged, 300)
{
    NEED_GPUS(1);
    two_daemon_pairs("");
    /* TP split across daemons, odd rows (the byte path), one GPU */
    bench("--daemons 2 --ctx-ranks 4 --gen-ranks 2 --ctx-layout trtllm "
          "--gen-layout vllm-nhd --requests 4 --blocks 8 --layers 4");
    bench("--daemons 2 --requests 4 --blocks 8 --layers 3 --heads 2 "
          "--head-dim 7 --dtype fp8 --tokens-per-block 5");
    bench("--daemons 2 --gen-device 0 --requests 4 --blocks 8 --layers 4");
    /* slots in pieces, one in flight: the kernels gather and scatter
     * whole slots, the pieces land in place */
    bench("--daemons 2 --slot-bytes 1048576 --peer-config "
          "'message_bytes: 128KiB' --peer-config 'send_window: 1' "
          "--ctx-layout trtllm --gen-layout vllm-hnd --requests 4 --blocks 8 "
          "--layers 4");
    /* mixed: a host pool on one side */
    bench("--daemons 2 --ctx-host --requests 4 --blocks 8 --layers 4");
    bench("--daemons 2 --gen-host --ctx-device 0 --requests 4 --blocks 8 "
          "--layers 4");
}

/* ---- two daemons, GPU slots -------------------------------------------- */

/* The bytes through GPU slots a bench run's JSON reports (B received,
 * A sent), or -1 each where it does not say. */
static void gpu_slot_bytes(const char *out, double *rx, double *tx)
{
    const char *g = strstr(out, "\"gpu_slot_bytes\":{\"received\":");
    *rx = *tx = -1;
    if (!g)
        return;
    *rx = strtod(g + strlen("\"gpu_slot_bytes\":{\"received\":"), NULL);
    const char *s = strstr(g, "\"sent\":");
    if (s)
        *tx = strtod(s + 7, NULL);
}

/* With a UCX that moves CUDA memory (the libucx-cu13 wheel's, or a
 * site's with CUDA), a GPU pool's slots are in its device's memory: the
 * bytes never cross host memory (cuda_ipc between the two daemons of
 * this host). Every preset pair, TP split and concat, odd rows, slots in
 * pieces, and a host pool on one side (whose side keeps host slots),
 * every byte verified; the daemons' status says which slots carried
 * them. Skips, saying why, where the daemons' UCX has no CUDA. */
TEST_T(two_daemons_gpu_slots, 600)
{
    NEED_GPUS(1);
    char out[8192];
    double rx, tx;
    bench_out("--daemons 2 --requests 4 --blocks 8 --layers 4", out,
              sizeof(out));
    gpu_slot_bytes(out, &rx, &tx);
    CHECK(rx >= 0 && tx >= 0); /* the bench reports them */
    if (rx == 0 && tx == 0) {
        fprintf(stderr, "two_daemons_gpu_slots: skipped: the daemons' UCX "
                        "does not move CUDA memory (host slots; build with "
                        "the libucx-cu13 wheel's UCX: make UCX=wheel)\n");
        return;
    }
    CHECK(rx > 0 && tx > 0);
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) {
            char args[512];
            snprintf(args, sizeof(args),
                     "--daemons 2 --ctx-layout %s --gen-layout %s "
                     "--requests 4 --blocks 8 --layers 4 --heads 4 "
                     "--head-dim 64 --tokens-per-block 16",
                     presets[a], presets[b]);
            bench_out(args, out, sizeof(out));
            gpu_slot_bytes(out, &rx, &tx);
            CHECK(rx > 0 && tx > 0);
        }
    static const char *const more[] = {
        "--daemons 2 --ctx-ranks 4 --gen-ranks 2 --ctx-layout trtllm "
        "--gen-layout vllm-nhd --requests 4 --blocks 8 --layers 4",
        "--daemons 2 --ctx-ranks 1 --gen-ranks 2 --requests 4 --blocks 8 "
        "--layers 4",
        "--daemons 2 --requests 4 --blocks 8 --layers 3 --heads 2 "
        "--head-dim 7 --dtype fp8 --tokens-per-block 5",
        "--daemons 2 --slot-bytes 1048576 --peer-config "
        "'message_bytes: 128KiB' --peer-config 'send_window: 1' "
        "--ctx-layout trtllm --gen-layout vllm-hnd --requests 4 --blocks 8 "
        "--layers 4",
        "--daemons 2 --regions 4 --layers 4 --requests 4 --blocks 8",
    };
    for (size_t i = 0; i < sizeof(more) / sizeof(more[0]); i++) {
        bench_out(more[i], out, sizeof(out));
        gpu_slot_bytes(out, &rx, &tx);
        CHECK(rx > 0 && tx > 0);
    }
    /* a host pool on the context side: its daemon sends from host
     * slots, the generation daemon receives into GPU slots */
    bench_out("--daemons 2 --ctx-host --requests 4 --blocks 8 --layers 4", out,
              sizeof(out));
    gpu_slot_bytes(out, &rx, &tx);
    CHECK(rx > 0 && tx == 0);
    /* gpu.staging_bytes 0: host slots again, the same bytes */
    char cfg[] = "/tmp/kvx-gpu-cfg-XXXXXX", args[256];
    int fd = mkstemp(cfg);
    CHECK(fd >= 0);
    static const char text[] = "gpu:\n  staging_bytes: 0\n";
    CHECK(write(fd, text, sizeof(text) - 1) == (ssize_t)sizeof(text) - 1);
    close(fd);
    snprintf(args, sizeof(args),
             "--daemons 2 --requests 4 --blocks 8 --layers 4 "
             "--daemon-config %s",
             cfg);
    bench_out(args, out, sizeof(out));
    unlink(cfg);
    gpu_slot_bytes(out, &rx, &tx);
    CHECK(rx == 0 && tx == 0);
}

/* ---- cancel in flight and a killed client ----------------------------- */

struct daemon {
    pid_t pid;
    char dir[64], sock[128];
};

static void daemon_start_cfg(struct daemon *d, const char *cfgtext);

static void daemon_start(struct daemon *d)
{
    /* small GPU chunks and one CTA: many slow launches, so a cancel or a
     * kill lands mid-transfer (2 GiB at full speed takes ~6 ms) */
    daemon_start_cfg(d, "gpu:\n  chunk_bytes: 1MiB\n  max_ctas: 1\n");
}

static void daemon_start_cfg(struct daemon *d, const char *cfgtext)
{
    static int n; /* two daemons of one test: a directory each */
    snprintf(d->dir, sizeof(d->dir), "/tmp/kvx-gpu-%d-%d", (int)getpid(), n++);
    mkdir(d->dir, 0700);
    snprintf(d->sock, sizeof(d->sock), "%s/s.sock", d->dir);
    char cfg[128], log[128], exe[256];
    snprintf(cfg, sizeof(cfg), "%s/c.yaml", d->dir);
    snprintf(log, sizeof(log), "%s/d.log", d->dir);
    FILE *f = fopen(cfg, "w");
    CHECK(f);
    fprintf(f, "%s", cfgtext);
    fclose(f);
    snprintf(exe, sizeof(exe), "%s/kvxferd", build_dir());
    d->pid = fork();
    if (d->pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        execl(exe, exe, "--socket", d->sock, "--config", cfg, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 300; i++) {
        kvx_client_t *c;
        if (kvx_connect_observer(d->sock, 100, &c) == 0) {
            kvx_close(c);
            return;
        }
        usleep(10000);
    }
    CHECK(!"daemon did not start");
}

static void daemon_stop(struct daemon *d)
{
    kill(d->pid, SIGTERM);
    int st;
    waitpid(d->pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

#define LAYERS 8
#define HEADS 8
#define HDIM 128
#define TPB 16
#define BLOCKS 4096 /* 4096 x 8 layers x 2 x 8 heads x 16 x 128 x 2 = 2 GiB */

struct shared {
    volatile int ready;
    uint8_t params[1024];
    volatile uint32_t params_len;
    volatile int stage;
};

/* A rank 0 of a TP 1 instance, connected and joined. */
static kvx_client_t *joined_client(struct daemon *d, const char *inst,
                                   kvx_role_t role, uint32_t layers,
                                   uint32_t heads)
{
    kvx_hello_t h = {.instance_id = inst,
                     .role = role,
                     .rank = 0,
                     .parallel = {.tp = 1,
                                  .pp = 1,
                                  .cp = 1,
                                  .total_layers = layers,
                                  .total_kv_heads = heads}};
    kvx_client_t *c;
    CHECK_EQ(kvx_connect(d->sock, &h, 5000, &c), 0);
    char addr[192];
    CHECK_EQ(kvx_daemon_address(c, addr, sizeof(addr)), 0);
    const char *a[1] = {addr};
    CHECK_EQ(kvx_join(c, a, 1, 5000), 0);
    return c;
}

static kvx_client_t *rank(struct daemon *d, const char *inst, kvx_role_t role,
                          int dev, kvx_layout_t *l, void **ptr, uint32_t *pool)
{
    kvx_client_t *c = joined_client(d, inst, role, LAYERS, HEADS);
    CHECK_EQ(kvx_layout_preset("vllm-nhd", LAYERS, 2, HEADS, HDIM,
                               KVX_DTYPE_BF16, TPB, BLOCKS, l),
             0);
    uint64_t size = kvx_layout_span(l);
    char err[256];
    CHECK_EQ(bgpu_alloc(dev, size, 0, 0, ptr, err, sizeof(err)), 0);
    CHECK_EQ(bgpu_memset(dev, *ptr, 0, size), 0);
    CHECK_EQ(kvx_pool_register_gpu(c, l, *ptr, size, pool, 5000), 0);
    return c;
}

static uint32_t *all_blocks(void)
{
    uint32_t *b = malloc(BLOCKS * sizeof(uint32_t));
    for (uint32_t i = 0; i < BLOCKS; i++)
        b[i] = i;
    return b;
}

/* Context process: fill, publish one 2 GiB request, wait for stage. */
static void ctx_proc(struct daemon *d, struct shared *sh, int dev,
                     int wait_done)
{
    kvx_layout_t l;
    void *p;
    uint32_t pool;
    kvx_client_t *c = rank(d, "gpu-ctx", KVX_ROLE_CONTEXT, dev, &l, &p, &pool);
    CHECK_EQ(bgpu_fill(&(bgpu_rows_t){.dev = dev,
                                      .layout = &l,
                                      .regions = &p,
                                      .request = 7,
                                      .nblocks = BLOCKS}),
             0);
    uint32_t *b = all_blocks();
    kvx_context_params_t prm;
    CHECK_EQ(kvx_publish(c, 7, pool, b, BLOCKS, BLOCKS * TPB, &prm, 5000), 0);
    memcpy(sh->params, prm.data, prm.len);
    sh->params_len = (uint32_t)prm.len;
    __sync_synchronize();
    sh->ready = 1;
    if (wait_done) {
        kvx_batch_t *bt;
        CHECK_EQ(kvx_poll(c, 1, 20000, &bt), 0);
        kvx_batch_free(bt);
    } else {
        pause(); /* killed by the test */
    }
    exit(0);
}

/* ---- two daemons: a cancel, and the context daemon killed ------------- */

/* A daemon with peers on (loopback, the secret file), its slots cut into
 * small pieces sent one at a time and its kernels on one CTA: the 2 GiB
 * transfer lasts long enough to be cut. */
static void peer_daemon(struct daemon *d, const char *secret)
{
    char cfg[512];
    snprintf(cfg, sizeof(cfg),
             "peer:\n  listen: 127.0.0.1:0\n  secret_file: %s\n"
             "  slot_bytes: 1MiB\n  message_bytes: 64KiB\n"
             "  send_window: 1\n  keepalive_timeout_ms: 2000\n"
             "gpu:\n  max_ctas: 1\n",
             secret);
    daemon_start_cfg(d, cfg);
}

/* The daemon's status JSON (the caller frees it), or NULL. */
static char *status_of(const char *sock)
{
    kvx_client_t *o;
    char *js = NULL;
    if (kvx_connect_observer(sock, 2000, &o) == 0) {
        if (kvx_status_json(o, &js, 2000))
            js = NULL;
        kvx_close(o);
    }
    return js;
}

/* The number after key in the daemon's status, or 0. */
static unsigned long long status_num(const char *sock, const char *key)
{
    char *js = status_of(sock);
    const char *q = js ? strstr(js, key) : NULL;
    unsigned long long v = q ? strtoull(q + strlen(key), NULL, 10) : 0;
    free(js);
    return v;
}

/* Whether the daemon's status holds s. */
static int status_has(const char *sock, const char *s)
{
    char *js = status_of(sock);
    int has = js && strstr(js, s);
    free(js);
    return has;
}

/* Between two daemons (GPU slots where their UCX moves CUDA memory,
 * else host slots; it prints which), a GPU pool's fetch is cut while
 * its bytes arrive: cancelled at the generation daemon (the event says
 * CANCELLED), then, in a second run, the context daemon killed (ERROR
 * PEER_GONE). Either way no byte lands in the pool after the event. */
TEST_T(two_daemons_gpu_cancel_and_peer_death, 300)
{
    NEED_GPUS(1);
    char secret[] = "/tmp/kvx-gpu-secret-XXXXXX";
    int fd = mkstemp(secret); /* mode 0600 */
    CHECK(fd >= 0);
    uint8_t key[32];
    for (int i = 0; i < 32; i++)
        key[i] = (uint8_t)(i * 37 + getpid());
    CHECK(write(fd, key, sizeof(key)) == (ssize_t)sizeof(key));
    close(fd);
    for (int death = 0; death < 2; death++) {
        struct daemon a, b;
        peer_daemon(&a, secret);
        peer_daemon(&b, secret);
        struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        pid_t ctx = fork();
        if (ctx == 0)
            ctx_proc(&a, sh, 0, 0);
        while (!sh->ready)
            usleep(1000);
        pid_t gen = fork();
        if (gen == 0) {
            kvx_layout_t l;
            void *p;
            uint32_t pool;
            kvx_client_t *c = rank(&b, "gpu-gen", KVX_ROLE_GENERATION,
                                   gen_dev(), &l, &p, &pool);
            uint32_t *bl = all_blocks();
            CHECK_EQ(kvx_fetch(c, 9, sh->params, sh->params_len, pool, bl,
                               BLOCKS, 0, 10000),
                     0);
            /* under way: bytes arrive at B */
            unsigned long long got = 0;
            for (int i = 0; i < 5000 && got < (4u << 20); i++) {
                got = status_num(b.sock, "\"bytes_received\":");
                usleep(1000);
            }
            CHECK(got >= (4u << 20));
            printf("%s: %s slots\n", death ? "peer death" : "cancel",
                   status_has(b.sock, "\"staging\":\"gpu\"") ? "GPU" : "host");
            if (!death) {
                CHECK_EQ(kvx_cancel(c, 9, 10000), 0);
            } else {
                sh->stage = 1; /* the parent kills daemon A */
            }
            kvx_batch_t *bt;
            CHECK_EQ(kvx_poll(c, 1, 20000, &bt), 0);
            CHECK_EQ(bt->num_events, 1);
            if (!death) {
                CHECK_EQ(bt->events[0].kind, KVX_EVENT_CANCELLED);
            } else {
                CHECK_EQ(bt->events[0].kind, KVX_EVENT_ERROR);
                CHECK_EQ(bt->events[0].code, KVX_ERR_PEER_GONE);
            }
            kvx_batch_free(bt);
            /* the daemon promised: no write lands after the event */
            uint64_t n = kvx_layout_span(&l);
            uint8_t *s1 = malloc(n), *s2 = malloc(n);
            CHECK(s1 && s2);
            CHECK_EQ(bgpu_copy_to_host(gen_dev(), s1, p, n), 0);
            usleep(300000);
            CHECK_EQ(bgpu_copy_to_host(gen_dev(), s2, p, n), 0);
            CHECK(memcmp(s1, s2, n) == 0);
            int64_t bad = bgpu_check(&(bgpu_rows_t){.dev = gen_dev(),
                                                    .layout = &l,
                                                    .regions = &p,
                                                    .request = 7,
                                                    .nblocks = BLOCKS,
                                                    .tok_to = UINT32_MAX});
            printf("%s: %lld of %llu rows not written\n",
                   death ? "peer death" : "cancel", (long long)bad,
                   (unsigned long long)BLOCKS * LAYERS * 2 * TPB * HEADS);
            CHECK(bad > 0); /* it was cut: not all of it arrived */
            exit(0);
        }
        if (death) {
            while (!sh->stage)
                usleep(100);
            kill(a.pid, SIGKILL);
            waitpid(a.pid, NULL, 0);
        }
        int st;
        waitpid(gen, &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        kill(ctx, SIGKILL);
        waitpid(ctx, &st, 0);
        daemon_stop(&b);
        if (!death)
            daemon_stop(&a);
        munmap(sh, sizeof(*sh));
    }
    unlink(secret);
}

TEST_T(cancel_in_flight_no_write_after, 120)
{
    NEED_GPUS(1);
    struct daemon d;
    daemon_start(&d);
    struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pid_t ctx = fork();
    if (ctx == 0)
        ctx_proc(&d, sh, 0, 1);
    while (!sh->ready)
        usleep(1000);
    kvx_layout_t l;
    void *p;
    uint32_t pool;
    pid_t gen = fork();
    if (gen == 0) {
        kvx_client_t *c =
            rank(&d, "gpu-gen", KVX_ROLE_GENERATION, gen_dev(), &l, &p, &pool);
        uint32_t *b = all_blocks();
        CHECK_EQ(kvx_fetch(c, 9, sh->params, sh->params_len, pool, b, BLOCKS, 0,
                           5000),
                 0);
        usleep(2000); /* let some chunks land */
        CHECK_EQ(kvx_cancel(c, 9, 10000), 0);
        /* the daemon promised: no write lands after this point */
        uint64_t n = kvx_layout_span(&l);
        uint8_t *s1 = malloc(n), *s2 = malloc(n);
        CHECK(s1 && s2);
        CHECK_EQ(bgpu_copy_to_host(gen_dev(), s1, p, n), 0);
        usleep(300000);
        CHECK_EQ(bgpu_copy_to_host(gen_dev(), s2, p, n), 0);
        CHECK(memcmp(s1, s2, n) == 0);
        /* it was in flight: some but not all of it arrived */
        int64_t bad = bgpu_check(&(bgpu_rows_t){.dev = gen_dev(),
                                                .layout = &l,
                                                .regions = &p,
                                                .request = 7,
                                                .nblocks = BLOCKS,
                                                .tok_to = UINT32_MAX});
        printf("cancel: %lld of %llu rows not written\n", (long long)bad,
               (unsigned long long)BLOCKS * LAYERS * 2 * TPB * HEADS);
        kvx_batch_t *bt;
        CHECK_EQ(kvx_poll(c, 1, 5000, &bt), 0);
        CHECK_EQ(bt->num_events, 1);
        CHECK_EQ(bt->events[0].kind, KVX_EVENT_CANCELLED);
        kvx_batch_free(bt);
        exit(0);
    }
    int st;
    waitpid(gen, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    waitpid(ctx, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    daemon_stop(&d);
}

TEST_T(client_killed_while_pool_read, 120)
{
    NEED_GPUS(1);
    struct daemon d;
    /* the smallest chunks, one at a time, each waited for by a sleeping
     * completion thread: with one CTA the kernel moves the 2 GiB in
     * tens of ms, which a killed process's CUDA teardown (before its
     * socket closes) can outlast (with 32 launches queued ahead, or one
     * at a time with the completion thread spinning, the request
     * completed first in 1 run of 3); 32768 launches, each a wake-up of
     * the completion thread and the loop, keep the copy running well
     * past the kill */
    daemon_start_cfg(&d, "gpu:\n  chunk_bytes: 64KiB\n  max_ctas: 1\n"
                         "  spin_us: 0\n"
                         "copy:\n  max_inflight_chunks: 1\n");
    struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pid_t ctx = fork();
    if (ctx == 0)
        ctx_proc(&d, sh, 0, 0);
    while (!sh->ready)
        usleep(1000);
    pid_t gen = fork();
    if (gen == 0) {
        kvx_layout_t l;
        void *p;
        uint32_t pool;
        kvx_client_t *c =
            rank(&d, "gpu-gen", KVX_ROLE_GENERATION, gen_dev(), &l, &p, &pool);
        uint32_t *b = all_blocks();
        CHECK_EQ(kvx_fetch(c, 9, sh->params, sh->params_len, pool, b, BLOCKS, 0,
                           5000),
                 0);
        sh->stage = 1; /* the reads are running: kill the context side */
        kvx_batch_t *bt;
        CHECK_EQ(kvx_poll(c, 1, 10000, &bt), 0);
        CHECK_EQ(bt->num_events, 1);
        CHECK_EQ(bt->events[0].kind, KVX_EVENT_ERROR);
        CHECK_EQ(bt->events[0].code, KVX_ERR_PEER_GONE);
        kvx_batch_free(bt);
        exit(0);
    }
    while (!sh->stage)
        usleep(100);
    usleep(1000);
    kill(ctx, SIGKILL);
    int st;
    waitpid(ctx, &st, 0);
    waitpid(gen, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    /* healthy: no pool left mapped, a new transfer works */
    kvx_client_t *o;
    CHECK_EQ(kvx_connect_observer(d.sock, 2000, &o), 0);
    char *js;
    for (int i = 0; i < 100; i++) {
        CHECK_EQ(kvx_status_json(o, &js, 2000), 0);
        int empty = strstr(js, "\"pools\":[]") != NULL;
        free(js);
        if (empty)
            break;
        usleep(20000);
    }
    CHECK_EQ(kvx_status_json(o, &js, 2000), 0);
    CHECK_STR_CONTAINS(js, "\"pools\":[]");
    free(js);
    kvx_close(o);
    daemon_stop(&d);
    bench("--requests 2 --blocks 8 --layers 4");
}

/* The property test of the integration suite, on GPU pools: random
 * configuration pairs (TP, PP, heads, tokens per block, presets, skip,
 * MLA), context pools on GPU 0 and generation pools on GPU 1 (GPU 0 on a
 * one-GPU machine), every row
 * checked against the reference pattern by a kernel. */
static uint32_t prng(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*s >> 33);
}

static uint32_t pick_tp(uint64_t *s, uint32_t heads)
{
    static const uint32_t tps[] = {1, 2, 4};
    for (;;) {
        uint32_t tp = tps[prng(s) % 3];
        if (heads >= tp ? heads % tp == 0 : tp % heads == 0)
            return tp;
    }
}

TEST_T(property_random_config_pairs_gpu, 400)
{
    NEED_GPUS(1);
    static const char *const pr[] = {"trtllm", "vllm-nhd", "vllm-hnd",
                                     "flashinfer", "sglang"};
    uint64_t seed = 4242;
    for (int i = 0; i < 16; i++) {
        int mla = prng(&seed) % 6 == 0;
        uint32_t heads = mla ? 1 : 1 + prng(&seed) % 8;
        uint32_t layers = 1 + prng(&seed) % 6;
        uint32_t ctp = pick_tp(&seed, heads), gtp = pick_tp(&seed, heads);
        uint32_t cpp = 1 + prng(&seed) % 2, gpp = 1 + prng(&seed) % 2;
        if (cpp > layers)
            cpp = layers;
        if (gpp > layers)
            gpp = layers;
        const char *cl = mla ? "mla" : pr[prng(&seed) % 5];
        const char *gl = mla ? "mla" : pr[prng(&seed) % 5];
        uint32_t ctpb = !strcmp(cl, "sglang") ? 1 : 1 + prng(&seed) % 32;
        uint32_t gtpb = !strcmp(gl, "sglang") ? 1 : 1 + prng(&seed) % 32;
        uint32_t blocks = 1 + prng(&seed) % (ctpb == 1 ? 40 : 4);
        uint32_t skip = prng(&seed) % 3 ? 0 : prng(&seed) % (blocks * ctpb);
        char args[512];
        snprintf(args, sizeof(args),
                 "--requests 3 --window 2 --blocks %u --layers %u --heads %u "
                 "--head-dim %u --ctx-tp %u --ctx-pp %u --gen-tp %u "
                 "--gen-pp %u --ctx-layout %s --gen-layout %s "
                 "--ctx-tokens-per-block %u --gen-tokens-per-block %u "
                 "--skip-tokens %u %s",
                 blocks, layers, heads, mla ? 72 : 64, ctp, cpp, gtp, gpp, cl,
                 gl, ctpb, gtpb, skip, mla ? "--mla" : "");
        bench(args);
    }
}

/* ---- pools inside larger allocations (issue 14) ----------------------- */

/* The offset bug's own shape, in one process as an engine has it: pools
 * at random offsets inside larger allocations, sometimes two pools in
 * one allocation back to back, legacy IPC, VMM and VMM made of several
 * physical allocations (expandable segments); the memory before and
 * after each pool holds a sentinel that must be unchanged after the
 * transfer, and the destination is checked row by row. */
#define OB_GUARD 65536
#define OB_SENT 0xa5
#define OB_CHUNK (2u << 20)

static uint32_t ob_rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*s >> 33);
}

/* An offset inside an allocation: 0 now and then, else 16-byte aligned
 * (a tensor slice), sometimes past a VMM chunk boundary. */
static uint64_t ob_offset(uint64_t *s)
{
    uint32_t k = ob_rnd(s) % 4;
    if (k == 0)
        return 0;
    uint64_t o = (uint64_t)(ob_rnd(s) % 65536) * 16;
    return k == 3 ? o + OB_CHUNK - 4096 : o;
}

/* The next event of c: COMPLETE for req, or the test fails. */
static void ob_complete(kvx_client_t *c, uint64_t req, const char *who)
{
    for (int i = 0; i < 100; i++) {
        kvx_batch_t *b;
        CHECK_EQ(kvx_poll(c, 1, 200, &b), 0);
        if (b->num_events) {
            if (b->events[0].request_id != req ||
                b->events[0].kind != KVX_EVENT_COMPLETE)
                fprintf(stderr, "%s: event %d (%s) for %llu\n", who,
                        b->events[0].kind, b->events[0].message,
                        (unsigned long long)b->events[0].request_id);
            CHECK_EQ(b->events[0].request_id, req);
            CHECK_EQ(b->events[0].kind, KVX_EVENT_COMPLETE);
            kvx_batch_free(b);
            return;
        }
        kvx_batch_free(b);
    }
    CHECK(!"no event within 20 s");
}

/* kinds: 0 legacy IPC, 1 VMM, 2 VMM of 2 MiB physical allocations */
static const char *const ob_kinds[] = {"ipc", "vmm", "vmm-chunks"};

static void ob_case(struct daemon *d, const char *cp, const char *gp, int kind,
                    int shared, uint64_t *seed, uint64_t req)
{
    int cdev = 0, gdev = shared ? 0 : gen_dev();
    char ci[64], gi[64], err[256];
    snprintf(ci, sizeof(ci), "ob-ctx-%llu", (unsigned long long)req);
    snprintf(gi, sizeof(gi), "ob-gen-%llu", (unsigned long long)req);
    kvx_client_t *c = joined_client(d, ci, KVX_ROLE_CONTEXT, 3, 4);
    kvx_client_t *gc = joined_client(d, gi, KVX_ROLE_GENERATION, 3, 4);
    uint32_t nb = 48; /* > 2 MiB a pool: they cross chunk boundaries */
    kvx_layout_t cl, gl;
    CHECK_EQ(kvx_layout_preset(cp, 3, 2, 4, 64, KVX_DTYPE_BF16, 16, nb, &cl),
             0);
    CHECK_EQ(kvx_layout_preset(gp, 3, 2, 4, 64, KVX_DTYPE_BF16, 16, nb, &gl),
             0);
    uint64_t cs = kvx_layout_span(&cl), gs = kvx_layout_span(&gl);
    int vmm = kind > 0;
    uint64_t chunk = kind == 2 ? OB_CHUNK : 0;
    /* one allocation holding both (either first), or one each */
    uint8_t *calloc_, *galloc, *cb, *gb;
    uint64_t clen, glen;
    if (shared) {
        int ctx_first = ob_rnd(seed) % 2;
        uint64_t o1 = ob_offset(seed);
        uint64_t o2 = o1 + (ctx_first ? cs : gs) +
                      (ob_rnd(seed) % 2 ? 0 : (ob_rnd(seed) % 1024) * 16);
        clen = glen = o2 + (ctx_first ? gs : cs) + OB_GUARD;
        void *a;
        CHECK_EQ(bgpu_alloc(cdev, clen, vmm, chunk, &a, err, sizeof(err)), 0);
        calloc_ = galloc = a;
        cb = calloc_ + (ctx_first ? o1 : o2);
        gb = galloc + (ctx_first ? o2 : o1);
    } else {
        uint64_t oc = ob_offset(seed), og = ob_offset(seed);
        clen = oc + cs + OB_GUARD;
        glen = og + gs + OB_GUARD;
        void *a, *b;
        CHECK_EQ(bgpu_alloc(cdev, clen, vmm, chunk, &a, err, sizeof(err)), 0);
        CHECK_EQ(bgpu_alloc(gdev, glen, vmm, chunk, &b, err, sizeof(err)), 0);
        calloc_ = a;
        galloc = b;
        cb = calloc_ + oc;
        gb = galloc + og;
    }
    CHECK_EQ(bgpu_memset(cdev, calloc_, OB_SENT, clen), 0);
    if (!shared)
        CHECK_EQ(bgpu_memset(gdev, galloc, OB_SENT, glen), 0);
    CHECK_EQ(bgpu_fill(&(bgpu_rows_t){.dev = cdev,
                                      .layout = &cl,
                                      .regions = (void *const *)&cb,
                                      .request = req,
                                      .nblocks = nb}),
             0);
    uint32_t cpool, gpool;
    CHECK_EQ(kvx_pool_register_gpu(c, &cl, cb, cs, &cpool, 5000), 0);
    CHECK_EQ(kvx_pool_register_gpu(gc, &gl, gb, gs, &gpool, 5000), 0);
    uint8_t *snap_c = malloc(clen), *snap_g = malloc(glen);
    uint8_t *now_c = malloc(clen), *now_g = malloc(glen);
    CHECK(snap_c && snap_g && now_c && now_g);
    CHECK_EQ(bgpu_copy_to_host(cdev, snap_c, calloc_, clen), 0);
    CHECK_EQ(bgpu_copy_to_host(gdev, snap_g, galloc, glen), 0);

    uint32_t ntok = nb * 16 - ob_rnd(seed) % 16, bl[48];
    for (uint32_t i = 0; i < nb; i++)
        bl[i] = i;
    kvx_context_params_t prm;
    CHECK_EQ(kvx_publish(c, req, cpool, bl, nb, ntok, &prm, 5000), 0);
    CHECK_EQ(kvx_fetch(gc, req, prm.data, prm.len, gpool, bl, nb, 0, 5000), 0);
    kvx_context_params_free(&prm);
    ob_complete(gc, req, "generation");
    ob_complete(c, req, "context");

    int64_t bad = bgpu_check(&(bgpu_rows_t){.dev = gdev,
                                            .layout = &gl,
                                            .regions = (void *const *)&gb,
                                            .request = req,
                                            .nblocks = nb,
                                            .tok_to = ntok});
    CHECK_EQ(bgpu_copy_to_host(cdev, now_c, calloc_, clen), 0);
    CHECK_EQ(bgpu_copy_to_host(gdev, now_g, galloc, glen), 0);
    /* outside the destination pool, nothing moved: guards and source */
    uint64_t og = (uint64_t)(gb - galloc), changed = 0, first = UINT64_MAX;
    for (uint64_t i = 0; i < glen; i++)
        if ((i < og || i >= og + gs) && now_g[i] != snap_g[i]) {
            changed++;
            if (first == UINT64_MAX)
                first = i;
        }
    if (!shared)
        for (uint64_t i = 0; i < clen; i++)
            changed += now_c[i] != snap_c[i];
    if (bad || changed) {
        fprintf(stderr,
                "%s %s -> %s, %s: context pool at %llu, generation pool at "
                "%llu of %llu: %lld rows wrong, %llu bytes outside the "
                "destination changed (first at %lld)\n",
                ob_kinds[kind], cp, gp, shared ? "one allocation" : "two",
                (unsigned long long)(cb - calloc_), (unsigned long long)og,
                (unsigned long long)glen, (long long)bad,
                (unsigned long long)changed,
                first == UINT64_MAX ? -1LL : (long long)first);
        CHECK(!"wrong bytes, or bytes outside the destination pool");
    }
    free(snap_c);
    free(snap_g);
    free(now_c);
    free(now_g);
    kvx_close(c);
    kvx_close(gc);
}

TEST_T(pools_inside_allocations_guard_bands, 600)
{
    NEED_GPUS(1);
    struct daemon d;
    daemon_start_cfg(&d, "");
    uint64_t seed = 1414, req = 1;
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++)
            for (int kind = 0; kind < 3; kind++)
                for (int shared = 0; shared < 2; shared++)
                    ob_case(&d, presets[a], presets[b], kind, shared, &seed,
                            req++);
    printf("%llu cases: 4 x 4 presets x {ipc, vmm, vmm chunks} x {one "
           "allocation, two}, %d GPU(s)\n",
           (unsigned long long)(req - 1), gpus() >= 2 ? 2 : 1);
    daemon_stop(&d);
}

/* The same through kvxfer-bench (every byte of every request checked,
 * guard bands around every rank's pool): TP splits, host pools, and two
 * daemons, where GPU pools are gathered into and scattered from staging
 * slots by kernels. */
static const char *offset_args(int a, int b)
{
    static char buf[64];
    snprintf(buf, sizeof(buf), "--pool-offset %d%s", 4096 * (a + 1) + 512 * b,
             (a + b) % 2 ? " --vmm" : "");
    return buf;
}

TEST_T(pools_at_offsets_every_path, 600)
{
    NEED_GPUS(1);
    every_preset_pair(offset_args);
    bench("--pool-offset 8192 --vmm-chunk 2097152 --requests 4 --blocks 64 "
          "--layers 4");
    bench("--pool-offset 4096 --ctx-ranks 4 --gen-ranks 2 --ctx-layout "
          "trtllm --gen-layout vllm-nhd --requests 4 --blocks 8 --layers 4");
    bench("--pool-offset 12288 --ctx-host --requests 4 --blocks 8 --layers 4");
    bench("--pool-offset 12290 --gen-host --ctx-device 0 --requests 4 "
          "--blocks 8 --layers 4");
    two_daemon_pairs("--pool-offset 8192");
    bench("--daemons 2 --pool-offset 4096 --vmm-chunk 2097152 --requests 4 "
          "--blocks 64 --layers 4");
    bench("--daemons 2 --pool-offset 4096 --ctx-host --requests 4 --blocks 8 "
          "--layers 4");
}

/* ---- layer-wise offers with the engine's CUDA events ------------------ */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A prefill that makes each layer ready with an IPC event and never
 * synchronises: the bytes of a layer-wise request and of a whole one
 * verified (kvxfer-bench --layerwise, GPU pools). */
TEST_T(layerwise_gpu_events, 120)
{
    NEED_GPUS(1);
    bench("--layerwise 0.2 --requests 2 --blocks 64 --layers 8");
}

/* The engine dies while the daemon watches its event (a layer whose
 * kernel still runs, so the layers are not ready): the fetch ends
 * PEER_GONE, the daemon stays healthy (a new transfer works) and drains
 * at SIGTERM. */
TEST_T(layerwise_engine_dies_while_daemon_waits, 120)
{
    NEED_GPUS(1);
    struct daemon d;
    daemon_start_cfg(&d, "");
    struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pid_t ctx = fork();
    if (ctx == 0) {
        kvx_layout_t l;
        void *p, *stream, *ev;
        uint8_t h[64];
        uint32_t pool;
        kvx_client_t *c =
            rank(&d, "gpu-ctx", KVX_ROLE_CONTEXT, 0, &l, &p, &pool);
        CHECK_EQ(bgpu_fill(&(bgpu_rows_t){.dev = 0,
                                          .layout = &l,
                                          .regions = &p,
                                          .request = 7,
                                          .nblocks = BLOCKS}),
                 0);
        uint32_t *b = all_blocks();
        kvx_context_params_t prm;
        CHECK_EQ(kvx_publish_layerwise(c, "dies", 4, pool, b, BLOCKS,
                                       BLOCKS * TPB, NULL, 0, &prm, 5000),
                 0);
        memcpy(sh->params, prm.data, prm.len);
        sh->params_len = (uint32_t)prm.len;
        __sync_synchronize();
        sh->ready = 1;
        while (sh->stage < 1) /* the fetch waits */
            usleep(1000);
        CHECK_EQ(bgpu_stream(0, &stream), 0);
        CHECK_EQ(bgpu_ipc_events(0, 1, &ev, h), 0);
        /* layer 0 "computes" for 20 s: the daemon watches its event */
        CHECK_EQ(bgpu_spin(0, stream, 20000000000ull), 0);
        CHECK_EQ(bgpu_record(ev, stream), 0);
        CHECK_EQ(kvx_layers_ready(c, "dies", 4, 0, LAYERS, h, 5000), 0);
        sh->stage = 2;
        pause(); /* killed by the test */
        exit(0);
    }
    while (!sh->ready)
        usleep(1000);
    pid_t gen = fork();
    if (gen == 0) {
        kvx_layout_t l;
        void *p;
        uint32_t pool;
        kvx_client_t *c =
            rank(&d, "gpu-gen", KVX_ROLE_GENERATION, gen_dev(), &l, &p, &pool);
        uint32_t *b = all_blocks();
        CHECK_EQ(kvx_fetch_key(c, "dies-g", 6, sh->params, sh->params_len, pool,
                               b, BLOCKS, 0, 0, 5000),
                 0);
        sh->stage = 1;
        kvx_batch_t *bt;
        CHECK_EQ(kvx_poll(c, 1, 15000, &bt), 0);
        CHECK_EQ(bt->num_events, 1);
        CHECK_EQ(bt->events[0].kind, KVX_EVENT_ERROR);
        CHECK_EQ(bt->events[0].code, KVX_ERR_PEER_GONE);
        kvx_batch_free(bt);
        exit(0);
    }
    while (sh->stage < 2)
        usleep(1000);
    usleep(200000); /* the daemon has launched behind the event */
    int64_t t0 = now_ms();
    kill(ctx, SIGKILL);
    int st;
    waitpid(ctx, &st, 0);
    waitpid(gen, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    printf("engine killed: the fetch ended after %lld ms\n",
           (long long)(now_ms() - t0));
    daemon_stop(&d);
    bench("--requests 2 --blocks 8 --layers 4");
}

/* ---- a pace on the GPU's copies (gpu.pace) ----------------------------- */

/* The jobs a pace held, from the bench's "gpu_status" ("... paced: N jobs
 * held X ms, H now"), or -1 where it does not say. */
static long long paced_jobs(const char *out)
{
    const char *t = strstr(out, "paced: ");
    return t ? atoll(t + 7) : -1;
}

/* The chunks a daemon's pace holds now (its status "gpu": "... paced:
 * N jobs held X ms, H now"), or -1. */
static long held_now(const char *sock)
{
    char *js = status_of(sock);
    const char *t = js ? strstr(js, "paced: ") : NULL;
    unsigned long long n;
    double ms;
    long h = -1;
    if (t &&
        sscanf(t, "paced: %llu jobs held %lf ms, %ld now", &n, &ms, &h) != 3)
        h = -1;
    free(js);
    return h;
}

/* gpu.pace on a GPU: every byte verified through the kernel, the copy
 * engines and two daemons' slots while the pace holds chunks back (it
 * says how many it held); then a 2 GiB fetch at 256 KiB a millisecond
 * (8 s of pace) is cancelled: the event comes at once, no byte lands
 * after it, and a SIGTERM during the next such fetch ends the daemon at
 * once with exit 0. */
TEST_T(pace_holds_bytes_cancel_and_stop, 300)
{
    NEED_GPUS(1);
    char cfg[128], args[768], out[8192];
    static const char *paths[] = {"kernel", "dma"};
    for (int i = 0; i < 3; i++) {
        char text[160];
        snprintf(text, sizeof(text),
                 "  copy_path: %s\n  chunk_bytes: 256KiB\n  pace: 1MiB\n",
                 paths[i % 2]);
        gpu_config(text, cfg, sizeof(cfg));
        /* 4 x 128 MiB at 1 MiB a millisecond: half a second of pace */
        snprintf(args, sizeof(args),
                 "%s--layout vllm-nhd --heads 8 --head-dim 128 --dtype bf16 "
                 "--tokens-per-block 16 --requests 4 --blocks 256 --layers 8 "
                 "--daemon-config %s",
                 i == 2 ? "--daemons 2 " : "", cfg);
        bench_out(args, out, sizeof(out));
        printf("pace, %s%s: %lld jobs held\n", i == 2 ? "two daemons, " : "",
               paths[i % 2], paced_jobs(out));
        CHECK(paced_jobs(out) > 0);
    }
    unlink(cfg);

    for (int stop = 0; stop < 2; stop++) {
        struct daemon d;
        daemon_start_cfg(&d, "gpu:\n  chunk_bytes: 1MiB\n  pace: 256KiB\n");
        struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        pid_t ctx = fork();
        if (ctx == 0)
            ctx_proc(&d, sh, 0, 0);
        while (!sh->ready)
            usleep(1000);
        pid_t gen = fork();
        if (gen == 0) {
            kvx_layout_t l;
            void *p;
            uint32_t pool;
            kvx_client_t *c = rank(&d, "gpu-gen", KVX_ROLE_GENERATION,
                                   gen_dev(), &l, &p, &pool);
            uint32_t *b = all_blocks();
            CHECK_EQ(kvx_fetch(c, 9, sh->params, sh->params_len, pool, b,
                               BLOCKS, 0, 5000),
                     0);
            usleep(300000);              /* ~75 MiB of the pace's 2 GiB */
            CHECK(held_now(d.sock) > 0); /* the pace holds chunks */
            int64_t t0 = now_ms();
            if (!stop) {
                CHECK_EQ(kvx_cancel(c, 9, 10000), 0);
                kvx_batch_t *bt;
                CHECK_EQ(kvx_poll(c, 1, 5000, &bt), 0);
                CHECK_EQ(bt->num_events, 1);
                CHECK_EQ(bt->events[0].kind, KVX_EVENT_CANCELLED);
                kvx_batch_free(bt);
                int64_t ms = now_ms() - t0;
                printf("pace: cancelled after %lld ms\n", (long long)ms);
                CHECK(ms < 2000); /* not the pace's 7 s left */
                uint64_t n = kvx_layout_span(&l);
                uint8_t *s1 = malloc(n), *s2 = malloc(n);
                CHECK(s1 && s2);
                CHECK_EQ(bgpu_copy_to_host(gen_dev(), s1, p, n), 0);
                usleep(300000);
                CHECK_EQ(bgpu_copy_to_host(gen_dev(), s2, p, n), 0);
                CHECK(memcmp(s1, s2, n) == 0);
                int64_t bad = bgpu_check(&(bgpu_rows_t){.dev = gen_dev(),
                                                        .layout = &l,
                                                        .regions = &p,
                                                        .request = 7,
                                                        .nblocks = BLOCKS,
                                                        .tok_to = UINT32_MAX});
                printf("pace: %lld of %llu rows not written\n", (long long)bad,
                       (unsigned long long)BLOCKS * LAYERS * 2 * TPB * HEADS);
                CHECK(bad > 0);
            } else {
                sh->stage = 1; /* the parent stops the daemon */
                pause();
            }
            exit(0);
        }
        if (stop) {
            while (!sh->stage)
                usleep(1000);
            int64_t t0 = now_ms();
            daemon_stop(&d); /* exit 0 */
            int64_t ms = now_ms() - t0;
            printf("pace: SIGTERM ended the daemon after %lld ms\n",
                   (long long)ms);
            CHECK(ms < 3000);
            kill(gen, SIGKILL);
        }
        int st;
        waitpid(gen, &st, 0);
        if (!stop)
            CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        kill(ctx, SIGKILL);
        waitpid(ctx, &st, 0);
        if (!stop)
            daemon_stop(&d);
        munmap(sh, sizeof(*sh));
    }
}

/* The pace an engine sets (GpuPace, kvx_gpu_pace): a generation rank
 * with a GPU pool sets 256 KiB a millisecond, held 1 s, then fetches
 * 2 GiB (8 s at that pace) on the same device as the source: the status
 * names the device's pace and who set it, and the pace holds chunks;
 * the rank stops calling, the pace lapses, and the rest lands at full
 * speed (the fetch ends within 5 s of the check, where 7 s of pace were
 * left); every byte is checked. */
TEST_T(engine_pace_holds_then_lapses, 120)
{
    NEED_GPUS(1);
    struct daemon d;
    daemon_start_cfg(&d, "gpu:\n  chunk_bytes: 1MiB\n");
    struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pid_t ctx = fork();
    if (ctx == 0)
        ctx_proc(&d, sh, gen_dev(), 0);
    while (!sh->ready)
        usleep(1000);
    pid_t gen = fork();
    if (gen == 0) {
        kvx_layout_t l;
        void *p;
        uint32_t pool;
        kvx_client_t *c =
            rank(&d, "gpu-gen", KVX_ROLE_GENERATION, gen_dev(), &l, &p, &pool);
        CHECK_EQ(kvx_gpu_pace(c, 256 << 10, 1000, 5000), 0);
        char want[64];
        snprintf(want, sizeof(want), "device %d 262144 B/ms (1 engine)",
                 gen_dev());
        char *js = status_of(d.sock);
        CHECK(js && strstr(js, want));
        free(js);
        uint32_t *b = all_blocks();
        CHECK_EQ(kvx_fetch(c, 9, sh->params, sh->params_len, pool, b, BLOCKS, 0,
                           5000),
                 0);
        usleep(300000);
        long held = held_now(d.sock);
        printf("engine pace: %ld chunks held\n", held);
        CHECK(held > 0);
        int64_t t0 = now_ms();
        kvx_batch_t *bt;
        CHECK_EQ(kvx_poll(c, 1, 30000, &bt), 0);
        CHECK_EQ(bt->num_events, 1);
        CHECK_EQ(bt->events[0].kind, KVX_EVENT_COMPLETE);
        kvx_batch_free(bt);
        int64_t ms = now_ms() - t0;
        printf("engine pace: the fetch ended %lld ms after the check\n",
               (long long)ms);
        CHECK(ms < 5000);
        js = status_of(d.sock); /* lapsed: no pace is named */
        CHECK(js && !strstr(js, "gpu pace"));
        free(js);
        CHECK_EQ(bgpu_check(&(bgpu_rows_t){.dev = gen_dev(),
                                           .layout = &l,
                                           .regions = &p,
                                           .request = 7,
                                           .nblocks = BLOCKS,
                                           .tok_to = BLOCKS * TPB}),
                 0);
        exit(0);
    }
    int st;
    waitpid(gen, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    kill(ctx, SIGKILL);
    waitpid(ctx, &st, 0);
    daemon_stop(&d);
    munmap(sh, sizeof(*sh));
}

/* gpu.copy_path auto over PCIe (a host pool on one side, either way):
 * single blocks' 32 KiB runs, shuffled, reach gpu.dma_min_run_host
 * (32 KiB), so the copy engines take them, where within the GPU they go
 * to the kernel (the test above); with dma_min_run_host above them, the
 * kernel again. Every byte verified. */
TEST_T(auto_path_over_pcie_takes_blocks, 180)
{
    NEED_GPUS(1);
    char cfg[128], args[512], out[8192];
    static const char *const side[] = {"--ctx-host", "--gen-host"};
    for (int k = 0; k < 4; k++) {
        gpu_config(k < 2 ? "  copy_path: auto\n"
                         : "  copy_path: auto\n  dma_min_run_host: 64KiB\n",
                   cfg, sizeof(cfg));
        snprintf(args, sizeof(args),
                 "--layout vllm-nhd --heads 8 --head-dim 128 --dtype bf16 "
                 "--tokens-per-block 16 --layers 8 --requests 2 --blocks "
                 "256 --pool-mib 256 --shuffle %s --daemon-config %s",
                 side[k % 2], cfg);
        bench_out(args, out, sizeof(out));
        printf("auto, %s, dma_min_run_host %s: %lld launches on the copy "
               "engines\n",
               side[k % 2], k < 2 ? "32KiB" : "64KiB", dma_launches(out));
        if (k < 2)
            CHECK(dma_launches(out) > 0);
        else
            CHECK_EQ(dma_launches(out), 0);
    }
    unlink(cfg);
}

/* gpu.copy_path auto with the default gpu.dma_min_run (4 MiB): a
 * request's 1,024 blocks in order on both sides join into one run a
 * layer's K or V (32 MiB) and go to the copy engines; shuffled, each
 * block's 32 KiB stays a run of its own and goes to the kernel. Bytes
 * verified both ways. */
TEST_T(auto_path_takes_joined_runs, 120)
{
    NEED_GPUS(1);
    char cfg[128], args[512], out[8192];
    gpu_config("  copy_path: auto\n", cfg, sizeof(cfg));
    for (int shuffled = 0; shuffled < 2; shuffled++) {
        snprintf(args, sizeof(args),
                 "--layout vllm-nhd --heads 8 --head-dim 128 --dtype bf16 "
                 "--tokens-per-block 16 --layers 8 --requests 2 --blocks "
                 "1024 --pool-mib 2048 %s--daemon-config %s",
                 shuffled ? "--shuffle " : "", cfg);
        bench_out(args, out, sizeof(out));
        printf("auto, %s: %lld launches on the copy engines\n",
               shuffled ? "shuffled" : "in order", dma_launches(out));
        /* the status says whether device 0's context is an MPS client
         * (kvxfer_gpu_mps) */
        const char *mps = strstr(out, "in use: 0 (");
        CHECK(mps);
        printf("device 0: %.16s\n", mps + 10);
        CHECK(!strncmp(mps + 11, "MPS)", 4) ||
              !strncmp(mps + 11, "no MPS)", 7) ||
              !strncmp(mps + 11, "MPS unknown)", 12));
        if (shuffled)
            CHECK_EQ(dma_launches(out), 0);
        else
            CHECK(dma_launches(out) > 0);
    }
    unlink(cfg);
}
