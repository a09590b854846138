/*
 * gpu_desc — the plan as the GPU copy kernel reads it: flat structs with
 * device pointers, shared by the C host code (gpu.c) and the kernel
 * (gpu_kernel.cu). Built from a plan_t by gpu.c, uploaded once per part.
 */
#ifndef KVX_GPU_DESC_H
#define KVX_GPU_DESC_H

#include <stddef.h>
#include <stdint.h>

#define GPU_MAX_LAYERS 1024

/* Division by a divisor fixed before the launch (gpu_walk.h). */
typedef struct gpu_fdiv {
    uint32_t d, m;
} gpu_fdiv_t;

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
    gpu_fdiv_t segs_div; /* by nsegs: a unit's layer and segment */
    const gpu_slice_t *slices;
    const gpu_seg_t *segs;
    const uint64_t *seg_tok;       /* tokens before each segment; [nsegs]:
                                      all (packed offsets) */
    gpu_side_t dst;
} gpu_plan_t;

/* Packed: between daemons one side is a staging slot holding the units
 * one after another, each [kv][token][head][row] (plan_exec_packed). */
enum { GPU_PACKED_NONE = 0, GPU_PACKED_GATHER = 1, GPU_PACKED_SCATTER = 2 };

/* One launch: units [u0, u1), cut into npieces pieces on the host
 * (gpu_launch_cut): parts of a unit (1 << pshift of them, part_bytes
 * each but the last) or per whole units a piece. */
typedef struct gpu_launch {
    uint64_t u0, u1;
    uint64_t npieces;
    uint64_t part_bytes;
    uint8_t *packed; /* the slot as the GPU sees it, at u0 */
    uint32_t pshift, per;
    int32_t packed_mode; /* GPU_PACKED_* */
} gpu_launch_t;

#ifdef __cplusplus
extern "C" {
#endif
struct plan;
struct kvx_why;
/* Bytes gpu_desc_pack() needs for plan p, at most. */
size_t gpu_desc_size(const struct plan *p);
/* Where gpu_desc_pack() lays a plan out: buf, of cap bytes
 * (gpu_desc_size()), with its pointers as if buf lay at base (the device
 * copy's address; buf itself for a walk in host memory). */
typedef struct gpu_desc_buf {
    uint8_t *buf;
    size_t cap;
    uint64_t base;
} gpu_desc_buf_t;
/* Lay bound plan p out in b: *out is the plan to pass to the kernel,
 * off_sblk[i] where slice i's source block table lies, *len the bytes
 * to copy. 0, or KVX_ERR_NOMEM, or KVX_ERR_UNSUPPORTED for units or
 * slices past the kernel's 32-bit indices; why says which. */
int gpu_desc_pack(const struct plan *p, const gpu_desc_buf_t *b,
                  gpu_plan_t *out, size_t *off_sblk, size_t *len,
                  struct kvx_why *why);
/* Launch the copy of l's units (u0, u1, packed and packed_mode set; the
 * cut is made here) of the device-resident plan d, bytes in all, on
 * stream with at most ctas blocks. Launches on one device must be
 * serialized (one stream). Returns a cudaError_t. */
int gpu_kernel_launch(const gpu_plan_t *d, gpu_launch_t *l, uint64_t bytes,
                      unsigned ctas, void *stream);
/* The copy engines' path (gpu.copy_path dma): the contiguous runs of
 * units [l->u0, l->u1) of plan g as laid out for the host
 * (gpu_desc_pack() with base = buf; l->packed and packed_mode set as for
 * a launch), each as emit(arg, dst, src, len) with the addresses the
 * kernel would use, runs adjacent on both sides joined (in no set
 * order: a run joins any open one it continues). A nonzero
 * return of emit stops the walk and is returned. */
typedef int (*gpu_run_fn)(void *arg, uint64_t dst, uint64_t src, uint64_t len);
int gpu_desc_runs(const gpu_plan_t *g, const gpu_launch_t *l, gpu_run_fn emit,
                  void *arg);
/* The contiguous run of l's first unit in bytes, before any joining (the
 * copy path's choice, gpu.copy_path auto). */
uint64_t gpu_desc_unit_run(const gpu_plan_t *g, const gpu_launch_t *l);
/* The runs of launch l as gpu_desc_runs() emits them, if there are at
 * most max of them: 0 when every run was emitted; GPU_RUNS_MANY when a
 * run past the max came (the walk stops there, the runs before it were
 * emitted); else emit's nonzero return. emit NULL only counts. One walk
 * for gpu.copy_path auto's choice and its copies. */
#define GPU_RUNS_MANY (-1)
int gpu_desc_runs_upto(const gpu_plan_t *g, const gpu_launch_t *l, uint64_t max,
                       gpu_run_fn emit, void *arg);
/* gpu.copy_path auto for launch l (bytes long): its runs to emit when
 * they are min_run long or longer on average. In one walk when at most
 * cap runs would pass (bytes / min_run <= cap: emit must keep cap runs
 * without issuing any, since the walk may yet find them too many); else
 * counted first, then walked again. 0: every run emitted (the copy
 * engines'); GPU_RUNS_MANY: too many (the kernel's; the runs emitted
 * before it, at most cap, are to be dropped); else emit's nonzero
 * return. */
int gpu_desc_runs_auto(const gpu_plan_t *g, const gpu_launch_t *l,
                       uint64_t bytes, uint64_t min_run, uint64_t cap,
                       gpu_run_fn emit, void *arg);
/* gpu.copy_path auto: 1 when the runs of launch l (bytes long), joined
 * as gpu_desc_runs() joins them, are min_run long or longer on average
 * (a request's blocks in order, in vLLM's layout: a layer's K of every
 * block in one run), else 0. Stops walking as soon as the runs are too
 * many: a table of scattered blocks costs about bytes / min_run units. */
int gpu_desc_runs_long(const gpu_plan_t *g, const gpu_launch_t *l,
                       uint64_t bytes, uint64_t min_run);
#ifdef __cplusplus
}
#endif

#endif /* KVX_GPU_DESC_H */
