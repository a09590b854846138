/*
 * walk_bench — what gpu.copy_path auto costs the daemon's loop: the walk
 * of a launch's units that lays out the copy engines' runs (gpu_desc.c),
 * for the 8B shape of docs/benchmarks.md (32 layers, 8 KV heads of 128,
 * bf16, 16 tokens a block, vLLM's layout: 2 MiB a block), one launch of
 * 1,024 blocks (2 GiB, gpu.chunk_bytes' default), blocks in order and
 * shuffled. It prints, in one run, the choice and its copies as two
 * walks (the count, then the copies: the baseline) and as one (the runs
 * wait in the batch while they are counted), and their ratio. Nothing is
 * copied and no GPU is needed: the walk reads only the plan.
 *
 *     build/walk_bench [BLOCKS] [REPEATS]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "copy/gpu_desc.h"
#include "copy/plan.h"
#include "kvxfer.h"

#define MIN_RUN (4u << 20) /* gpu.dma_min_run's default */

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int fail(const char *what)
{
    fprintf(stderr, "walk_bench: %s\n", what);
    return 1;
}

/* A pool's memory as the plan sees it: its layout's regions at made-up
 * addresses (never read), a table of nb blocks, shuffled or in order. */
typedef struct pool {
    kvx_layout_t layout;
    plan_region_t *regions;
    uint32_t nregions, *blocks;
} pool_t;

static int pool_make(pool_t *p, uint32_t nb, int shuffle, uint64_t base)
{
    if (kvx_layout_preset("vllm-nhd", 32, 2, 8, 128, KVX_DTYPE_BF16, 16, nb,
                          &p->layout))
        return -1;
    p->nregions = kvx_layout_num_regions(&p->layout);
    p->regions = calloc(p->nregions, sizeof(*p->regions));
    p->blocks = malloc(nb * sizeof(*p->blocks));
    if (!p->regions || !p->blocks)
        return -1;
    for (uint32_t i = 0; i < p->nregions; i++) {
        p->regions[i].base = (uint8_t *)(uintptr_t)base;
        p->regions[i].size = kvx_layout_region_span(&p->layout, i);
        base += (p->regions[i].size + 4095) & ~(uint64_t)4095;
    }
    for (uint32_t i = 0; i < nb; i++)
        p->blocks[i] = i;
    srand(7);
    for (uint32_t i = nb - 1; i > 0 && shuffle; i--) {
        uint32_t j = (uint32_t)rand() % (i + 1), x = p->blocks[i];
        p->blocks[i] = p->blocks[j];
        p->blocks[j] = x;
    }
    return 0;
}

/* The daemon's batch, as gpu.c's dma_run() fills it. */
#define BATCH 4096
static struct {
    uint64_t dst[BATCH], src[BATCH], len[BATCH];
    size_t n, issued;
} batch;

static int run_add(void *arg, uint64_t dst, uint64_t src, uint64_t len)
{
    (void)arg;
    if (batch.n == BATCH) { /* issued, as dma_flush() would */
        batch.issued += batch.n;
        batch.n = 0;
    }
    batch.dst[batch.n] = dst;
    batch.src[batch.n] = src;
    batch.len[batch.n] = len;
    batch.n++;
    return 0;
}

/* auto as it was: count the runs (gpu_desc_runs_long()), then walk
 * again for the copies. Returns 1 for the copy engines. */
static int two_walks(const gpu_plan_t *g, const gpu_launch_t *l, uint64_t bytes)
{
    batch.n = batch.issued = 0;
    if (!gpu_desc_runs_long(g, l, bytes, MIN_RUN))
        return 0;
    return gpu_desc_runs(g, l, run_add, NULL) == 0;
}

/* auto now (gpu.c's dma_launch(): gpu_desc_runs_auto()): one walk while
 * the runs fit the batch unissued. */
static int one_walk(const gpu_plan_t *g, const gpu_launch_t *l, uint64_t bytes)
{
    batch.n = batch.issued = 0;
    int e = gpu_desc_runs_auto(g, l, bytes, MIN_RUN, BATCH, run_add, NULL);
    if (e == GPU_RUNS_MANY)
        batch.n = 0;
    return e == 0;
}

typedef int (*choose_fn)(const gpu_plan_t *, const gpu_launch_t *, uint64_t);

/* The median of reps timings of f, in ms. */
static double time_it(choose_fn f, const gpu_plan_t *g, const gpu_launch_t *l,
                      uint64_t bytes, int reps, int *dma)
{
    double *t = malloc(reps * sizeof(*t));
    if (!t)
        return -1;
    for (int i = 0; i < reps; i++) {
        double t0 = now_ms();
        *dma = f(g, l, bytes);
        t[i] = now_ms() - t0;
    }
    for (int i = 1; i < reps; i++) /* sort */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    double m = t[reps / 2];
    free(t);
    return m;
}

static void pool_free(pool_t *p)
{
    free(p->regions);
    free(p->blocks);
}

static int run_case(uint32_t nb, int shuffle, int reps)
{
    plan_side_t s;
    memset(&s, 0, sizeof(s));
    s.tp = s.pp = s.cp = 1;
    s.total_layers = 32;
    s.total_heads = 8;
    s.kv_factor = 2;
    s.head_dim = 128;
    s.elem_size = 2;
    s.dtype = KVX_DTYPE_BF16;
    s.tokens_per_block = 16;
    pool_t src = {0}, dst = {0};
    plan_t *p = NULL;
    uint8_t *buf = NULL;
    size_t *off = NULL;
    char why[256] = "out of memory, or the layout refused";
    int rc = 1;
    if (pool_make(&src, nb, shuffle, 1ull << 40) ||
        pool_make(&dst, nb, shuffle, 1ull << 42) ||
        plan_build(&s, &s, 0, nb * 16, 0, &p, KVX_WHY(why)))
        goto out;
    p->src[0] = (plan_mem_t){
        src.regions, src.nregions, &src.layout, src.blocks, nb, 0, 0};
    p->dst = (plan_mem_t){
        dst.regions, dst.nregions, &dst.layout, dst.blocks, nb, 1, 0};
    size_t cap = gpu_desc_size(p), len = 0;
    gpu_plan_t g;
    snprintf(why, sizeof(why), "out of memory");
    if (!(buf = malloc(cap)) || !(off = calloc(p->nslices, sizeof(*off))) ||
        gpu_desc_pack(p, &(gpu_desc_buf_t){buf, cap, (uintptr_t)buf}, &g, off,
                      &len, KVX_WHY(why)))
        goto out;
    gpu_launch_t l = {.u0 = 0, .u1 = p->nunits};
    int dma2 = 0, dma1 = 0;
    double two = time_it(two_walks, &g, &l, p->bytes, reps, &dma2);
    size_t runs2 = batch.issued + batch.n;
    double one = time_it(one_walk, &g, &l, p->bytes, reps, &dma1);
    size_t runs1 = batch.issued + batch.n;
    snprintf(why, sizeof(why),
             "one walk chose or laid out otherwise "
             "than two");
    if (dma1 != dma2 || runs1 != runs2 || two < 0 || one < 0)
        goto out;
    printf("%-9s %4u blocks, %llu MiB, %llu units: %s, %zu runs; "
           "two walks %.3f ms (baseline), one walk %.3f ms: x%.2f\n",
           shuffle ? "shuffled" : "in order", nb,
           (unsigned long long)(p->bytes >> 20), (unsigned long long)p->nunits,
           dma1 ? "copy engines" : "kernel", runs1, two, one,
           one > 0 ? two / one : 0);
    rc = 0;
out:
    if (rc)
        fail(why);
    free(off);
    free(buf);
    if (p)
        plan_free(p);
    pool_free(&src);
    pool_free(&dst);
    return rc;
}

int main(int argc, char **argv)
{
    uint32_t nb = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 1024;
    int reps = argc > 2 ? atoi(argv[2]) : 21;
    if (!nb || nb > 65536 || reps < 1)
        return fail("usage: walk_bench [BLOCKS 1..65536] [REPEATS >= 1]");
    printf("gpu.copy_path auto, gpu.dma_min_run %u MiB, the median of %d\n",
           MIN_RUN >> 20, reps);
    return run_case(nb, 0, reps) || run_case(nb, 1, reps);
}
