/*
 * gpu_dma — the copy engines' path (gpu.copy_path dma, and auto's
 * choice): a launch's units as the contiguous runs gpu_desc_runs() finds,
 * joined, issued as batches of device copies (cudaMemcpyBatchAsync) on
 * the device's copy stream instead of a kernel. Owns the batch being
 * built and its counters; loop thread only. gpu.c calls it for a launch
 * whose part has a host copy of its descriptor.
 */
#ifndef KVX_GPU_DMA_H
#define KVX_GPU_DMA_H

#include <stdint.h>

#include "gpu_desc.h"

/* Launch l of the plan hplan (laid out in host memory, bytes long) on
 * stream (a cudaStream_t) for gpu.copy_path dma; for auto, only when its
 * runs, joined, are gpu.dma_min_run long or longer on average
 * (gpu.dma_min_run_host when host says it reads or writes host memory;
 * gpu_desc_runs_auto(): chosen in the walk that lays out the copies).
 * A cudaError_t, or -1 when it goes to the kernel (nothing issued). */
int gpu_dma_launch(const gpu_plan_t *hplan, const gpu_launch_t *l, void *stream,
                   uint64_t bytes, int host);

/* Launches issued on the copy engines, the copies and batches they were
 * cut into, since start. */
typedef struct gpu_dma_counts {
    uint64_t launches, copies, batches;
} gpu_dma_counts_t;
void gpu_dma_counts(gpu_dma_counts_t *c);

#endif /* KVX_GPU_DMA_H */
