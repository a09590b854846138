/* gpu_dma — the copy engines' path (gpu.copy_path dma and auto); see
 * gpu_dma.h. Built only with CUDA. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "core/daemon.h"
#include "core/log.h"
#include "gpu_desc.h"
#include "gpu_dma.h"

/* The batch being built, and what the copy engines took (loop thread). */
#define DMA_BATCH 4096
static struct {
    void *dst[DMA_BATCH];
    const void *src[DMA_BATCH];
    size_t len[DMA_BATCH];
    size_t n;
    cudaStream_t stream;
    uint64_t copies, batches, launches;
} dma;

static cudaError_t dma_flush(void)
{
    if (!dma.n)
        return cudaSuccess;
    cudaError_t e = cudaSuccess;
#if CUDART_VERSION >= 12080
    /* the copies may overlap the engine's kernels: copy engines, not SMs;
     * the batch reads the source as the stream orders it */
    struct cudaMemcpyAttributes a;
    memset(&a, 0, sizeof(a));
    a.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    a.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t idx = 0;
    static int unbatched; /* the driver has no batches: a copy a call */
    if (!unbatched) {
#if CUDART_VERSION >= 13000
        e = cudaMemcpyBatchAsync(dma.dst, dma.src, dma.len, dma.n, &a, &idx, 1,
                                 dma.stream);
#else
        size_t fail = 0;
        e = cudaMemcpyBatchAsync(dma.dst, (void **)dma.src, dma.len, dma.n, &a,
                                 &idx, 1, &fail, dma.stream);
#endif
        if (e == cudaErrorNotSupported ||
            e == cudaErrorCallRequiresNewerDriver) {
            log_warn("gpu: cudaMemcpyBatchAsync: %s; the copy engines' "
                     "path issues a cudaMemcpyAsync a run",
                     cudaGetErrorString(e));
            (void)cudaGetLastError();
            unbatched = 1;
        }
    }
    if (unbatched)
#endif
        for (size_t i = 0; i < dma.n; i++)
            if ((e = cudaMemcpyAsync(dma.dst[i], dma.src[i], dma.len[i],
                                     cudaMemcpyDefault, dma.stream)) !=
                cudaSuccess)
                break;
    dma.copies += dma.n;
    dma.batches++;
    dma.n = 0;
    return e;
}

static int dma_run(void *arg, uint64_t dst, uint64_t src, uint64_t len)
{
    (void)arg;
    if (dma.n == DMA_BATCH) {
        cudaError_t e = dma_flush();
        if (e != cudaSuccess)
            return (int)e;
    }
    dma.dst[dma.n] = (void *)(uintptr_t)dst;
    dma.src[dma.n] = (const void *)(uintptr_t)src;
    dma.len[dma.n] = (size_t)len;
    dma.n++;
    return 0;
}

int gpu_dma_launch(const gpu_plan_t *hplan, const gpu_launch_t *l, void *stream,
                   uint64_t bytes, int host)
{
    dma.stream = stream;
    dma.n = 0;
    uint64_t min_run =
        host ? kvxd.conf.gpu_dma_min_run_host : kvxd.conf.gpu_dma_min_run;
    int e = !strcmp(kvxd.conf.gpu_copy_path, "dma")
                ? gpu_desc_runs(hplan, l, dma_run, NULL)
                : gpu_desc_runs_auto(hplan, l, bytes, min_run, DMA_BATCH,
                                     dma_run, NULL);
    if (e == GPU_RUNS_MANY) {
        dma.n = 0;
        return -1;
    }
    if (e == cudaSuccess)
        e = dma_flush();
    dma.n = 0;
    if (e == cudaSuccess) /* counted as gpu_launch() counts launches */
        dma.launches++;
    return e;
}

void gpu_dma_counts(gpu_dma_counts_t *c)
{
    *c = (gpu_dma_counts_t){dma.launches, dma.copies, dma.batches};
}
