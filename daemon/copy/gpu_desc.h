/*
 * gpu_desc — the plan as the GPU copy kernel reads it: flat structs with
 * device pointers, shared by the C host code (gpu.c) and the kernel
 * (gpu_kernel.cu). Built from a plan_t by gpu.c, uploaded once per part.
 */
#ifndef KVX_GPU_DESC_H
#define KVX_GPU_DESC_H

#include <stdint.h>

#define GPU_MAX_LAYERS 1024

typedef struct gpu_side {
    const uint32_t *blocks;        /* device copy of the block table */
    /* device copy: the address of each (layer, kv) part as the kernel's
     * device sees it (its region's start + the part's offset), at
     * [layer * kv_factor + kv] */
    const uint64_t *part;
    uint64_t block_stride, token_stride, head_stride;
} gpu_side_t;

typedef struct gpu_slice {
    uint32_t layer0, nlayers, head0, nheads;
    uint32_t src_layer_base, src_head_base, dst_layer_base, dst_head_base;
    uint64_t unit_begin;
    uint64_t packed_begin;         /* byte offset of its first unit, packed */
    gpu_side_t src;
} gpu_slice_t;

typedef struct gpu_seg {
    uint32_t src_blk, src_tok, dst_blk, dst_tok, n;
} gpu_seg_t;

typedef struct gpu_plan {
    uint32_t nslices, nsegs;
    uint32_t row_bytes;            /* head_dim * elem_size */
    uint32_t kv_factor;
    const gpu_slice_t *slices;
    const gpu_seg_t *segs;
    const uint64_t *seg_tok;       /* tokens before each segment; [nsegs]:
                                      all (packed offsets) */
    gpu_side_t dst;
} gpu_plan_t;

/* Packed: between daemons one side is a staging slot holding the units
 * one after another, each [kv][token][head][row] (plan_exec_packed). */
enum { GPU_PACKED_NONE = 0, GPU_PACKED_GATHER = 1, GPU_PACKED_SCATTER = 2 };

#ifdef __cplusplus
extern "C" {
#endif
/* Launch the copy of units [u0, u1) of the device-resident plan d, bytes
 * in all, on stream with at most ctas blocks. Launches on one device must
 * be serialized (one stream). Returns a cudaError_t. */
int gpu_kernel_launch(const gpu_plan_t *d, uint64_t u0, uint64_t u1,
                      uint64_t bytes, unsigned ctas, void *stream,
                      uint8_t *packed, int packed_mode);
#ifdef __cplusplus
}
#endif

#endif /* KVX_GPU_DESC_H */
