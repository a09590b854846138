/* bench_gpu — GPU helpers for kvxfer-bench and the GPU tests; see
 * bench_gpu.cu. Present only in builds with CUDA. */
#ifndef KVX_BENCH_GPU_H
#define KVX_BENCH_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "kvxfer.h"

#ifdef __cplusplus
extern "C" {
#endif
/* The number of GPUs (0: none, or no driver), counted in a child process:
 * CUDA stays uninitialized in the caller, which may fork ranks after. */
int bgpu_device_count(void);
/* vmm: cuMemCreate memory exportable as a POSIX fd (chunk > 0: physical
 * allocations of chunk bytes, rounded to the granularity, mapped back to
 * back, as PyTorch's expandable segments do); else cudaMalloc. */
int bgpu_alloc(int dev, uint64_t size, int vmm, uint64_t chunk, void **ptr,
               char *err, size_t len);
int bgpu_memset(int dev, void *p, int v, uint64_t n);
int bgpu_copy_to_host(int dev, void *dst, const void *src, uint64_t n);
/* The reference rows of request `request` in a pool with layout `layout`
 * on device dev, its regions starting at regions[0,
 * kvx_layout_num_regions(layout)): in the pool blocks ids[0, nblocks), in
 * any order (kvxfer-bench --shuffle), or without ids in blocks [block0,
 * block0 + nblocks). head0 and layer0 are the pool's first global head
 * and layer. */
typedef struct bgpu_rows {
    int dev;
    const kvx_layout_t *layout;
    void *const *regions;
    uint64_t request;
    const uint32_t *ids; /* NULL: blocks from block0 on */
    uint32_t block0, nblocks;
    uint32_t head0, layer0;
    uint32_t tok_from, tok_to; /* bgpu_check: tokens [tok_from, tok_to) */
} bgpu_rows_t;
/* Write the rows of every token (tok_from and tok_to are not read). */
int bgpu_fill(const bgpu_rows_t *rows);
/* The mismatched rows among tokens [tok_from, tok_to), or -1. */
int64_t bgpu_check(const bgpu_rows_t *rows);
/* cudaMemcpyPeer of bytes (one contiguous copy, repeated past 8 GiB). */
double bgpu_peer_gbps(int src, int dst, uint64_t bytes);
/* Copies of bytes between pinned host memory and a device (buffers of at
 * most 1 GiB, repeated): device to host on d2h_dev into *d2h, host to
 * device on h2d_dev into *h2d, in GB/s; a device of -1 is not measured
 * (its figure is 0). Returns 0, or -1 when an allocation or copy fails. */
int bgpu_host_gbps(int d2h_dev, int h2d_dev, uint64_t bytes, double *d2h,
                   double *h2d);
/* kvxfer-bench --layerwise on a GPU: a stream on dev, interprocess
 * events (their cudaIpcEventHandle_t in handles[i], 64 bytes each), a
 * kernel that spins ns nanoseconds on the stream (one layer of a
 * "prefill"), an event recorded on it, and waiting for one. */
int bgpu_stream(int dev, void **stream);
int bgpu_ipc_events(int dev, uint32_t n, void **events, uint8_t *handles);
int bgpu_spin(int dev, void *stream, uint64_t ns);
int bgpu_record(void *event, void *stream);
int bgpu_event_wait(void *event);
#ifdef __cplusplus
}
#endif

#endif
