/*
 * pool — memory that clients register: a pool is a list of regions
 * (one allocation, or one per layer tensor, or per K and V tensor); host
 * regions are memfd ranges mapped shared into the daemon, GPU regions lie
 * in imported allocations (gpu.c), each imported once.
 *
 * Owns every mapping. A pool lives until it is released (deregister or
 * owner disconnect) AND no request uses it; the mapping is removed only
 * then, so a copy in flight never touches unmapped memory.
 */
#ifndef KVX_POOL_H
#define KVX_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "gpu.h"
#include "kvxfer.h"

/* The devices a pool keeps views for (gpu.c's MAX_DEV). */
#define POOL_MAX_DEV 64

/* One region of a pool: bytes [offset, offset + size) of one of its
 * allocations (a memfd, or a GPU allocation). */
typedef struct pool_region {
    uint32_t alloc;  /* index into the pool's allocations */
    uint64_t offset; /* where the region starts in its allocation */
    uint64_t size;
    uint8_t *map; /* host: its own mapping, from the page that holds
                     its start */
    uint64_t map_len;
} pool_region_t;

typedef struct pool {
    uint32_t id;
    uint64_t session_id;
    uint32_t uid;        /* its session's user (status shows it to them) */
    int gpu;             /* GPU pool (imported), else host memfds */
    int device;          /* daemon's CUDA ordinal, GPU pools */
    uint32_t nimports;
    gpu_import_t **imports; /* GPU: one per allocation, shared with other
                               pools in the same allocation */
    int pinned;          /* host pool registered with CUDA (mixed copies) */
    int pin_on_populate; /* >= 0: the populate job also pins, through this
                            device's context (set before the job) */
    int populating;      /* a populate job holds a reference */
    uint32_t nregions;
    pool_region_t *regions;
    /* each region's start and size in the daemon's mapping (GPU: its
     * allocation's mapping + offset, on the pool's device): what plans
     * bind; view_on[d] the same as kernels on device d see it (GPU
     * pools, made at first use) */
    plan_region_t *view;
    plan_region_t *view_on[POOL_MAX_DEV];
    uint64_t size;       /* of all regions */
    kvx_layout_t layout; /* its parts, if any, are the pool's copy */
    kvx_layout_part_t *parts;
    uint64_t holes;      /* host: bytes of its span its memfds lack */
    uint64_t mem_host;   /* bytes charged to uid for its holes (MEM_HOST),
                            released when it is unmapped */
    uint32_t users;      /* requests holding it */
    int released;        /* deregistered or owner gone */
} pool_t;

/* One allocation of a pool to register: a host memfd, or a GPU
 * allocation to import (gpu.offset 0, gpu.size its alloc_size). */
typedef struct pool_alloc_req {
    int gpu;
    int fd;               /* host: the memfd, taken (closed on every path) */
    gpu_import_req_t req; /* GPU: its fds are taken the same way */
} pool_alloc_req_t;

/* One region to register: bytes [offset, offset + size) of allocs[alloc]. */
typedef struct pool_region_req {
    uint32_t alloc;
    uint64_t offset, size;
} pool_region_req_t;

/* A pool to register for session session_id: regions[0, nregions) over
 * allocs[0, nallocs) (all host or all GPU; the caller checked the counts
 * and the indexes), described by layout (its parts are copied). */
typedef struct pool_reg {
    uint64_t session_id;
    pool_alloc_req_t *allocs; /* their fds are taken */
    uint32_t nallocs;
    const pool_region_req_t *regions;
    uint32_t nregions;
    const kvx_layout_t *layout;
} pool_reg_t;

/* Register the pool r describes. Checks every region against its
 * allocation, regions against each other (no overlap, none empty) and
 * the layout against the regions, then maps host memfds or imports GPU
 * allocations, each once. Takes every fd (closed on every path). 0, or
 * the code with why naming the region or part. */
int pool_register(const pool_reg_t *r, pool_t **out, kvx_why_t *why);
/* pool_register() of one region, bytes [offset, offset + size) of a
 * memfd: what kvx_pool_register_host() sends. Takes fd. */
int pool_register_host(uint64_t session_id, int fd, uint64_t offset,
                       uint64_t size, const kvx_layout_t *layout, pool_t **out,
                       kvx_why_t *why);
/* Close what is left of allocs' fds (an error before pool_register). */
void pool_alloc_req_close(pool_alloc_req_t *allocs, uint32_t nallocs);
/* Make a host pool readable and writable by GPU kernels (pins it;
 * blocking, once per pool). GPU pools: no-op. */
int pool_pin(pool_t *p, kvx_why_t *why);
/* The pool's regions (their own starts, never their allocations') as
 * kernels on device see them (pinned host pools: their own addresses):
 * *regions lives as long as the pool. */
int pool_device_view(pool_t *p, int device, const plan_region_t **regions,
                     kvx_why_t *why);
/* The pool as a plan binds it, read or written through blocks[0, n):
 * its regions in the daemon's mapping, its layout and id. */
plan_mem_t pool_mem(const pool_t *p, const uint32_t *blocks, uint32_t n);
/* Bytes of a host pool's used span (what copies can touch) that its
 * memfds did not hold at registration (holes of a sparse file): what the
 * daemon would fault in, charged to its own memory, if copies touched
 * them. An upper bound, from each file's allocated size. GPU pools: 0. */
uint64_t pool_holes(const pool_t *p);
/* Fault the mapping in on a copy worker (not on the loop). */
void pool_populate(pool_t *p);
/* A live (not released) pool, or NULL. */
pool_t *pool_find(uint32_t id);
void pool_ref(pool_t *p);
void pool_unref(pool_t *p);
/* Release: no new users; unmapped once the last user is gone. */
void pool_release(pool_t *p);
/* Every pool (live or waiting for users), for status. */
uint32_t pool_list(pool_t **out, uint32_t max);
uint32_t pool_count(void);
void pool_cleanup(void);

#endif /* KVX_POOL_H */
