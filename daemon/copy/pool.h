/*
 * pool — memory that clients register: host pools are memfds mapped
 * shared into the daemon.
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

typedef struct pool {
    uint32_t id;
    uint64_t session_id;
    uint32_t uid;        /* its session's user (status shows it to them) */
    int gpu;             /* GPU pool (imported), else host memfd */
    int device;          /* daemon's CUDA ordinal, GPU pools */
    gpu_import_t *import;
    int pinned;          /* host pool registered with CUDA (mixed copies) */
    int pin_on_populate; /* >= 0: the populate job also pins, through this
                            device's context (set before the job) */
    int populating;      /* a populate job holds a reference */
    uint8_t *base;       /* the pool's own start, in the daemon's mapping
                            (GPU: its allocation's mapping + offset) */
    uint64_t offset;     /* where the pool starts in its allocation (GPU)
                            or memfd (host) */
    uint8_t *map;        /* host: the mapping, from the page that holds
                            base */
    uint64_t map_len;
    uint64_t size;
    kvx_layout_t layout;
    uint32_t users;      /* requests holding it */
    int released;        /* deregistered or owner gone */
} pool_t;

/* Map bytes [offset, offset + size) of a host memfd, described by layout.
 * Takes ownership of fd (closed on every path). */
int pool_register_host(uint64_t session_id, int fd, uint64_t offset,
                       uint64_t size, const kvx_layout_t *layout, pool_t **out,
                       char *why, size_t why_len);
/* Import a GPU allocation (gpu_import) and check the layout fits. */
int pool_register_gpu(uint64_t session_id, gpu_import_req_t *req,
                      const kvx_layout_t *layout, pool_t **out, char *why,
                      size_t why_len);
/* Make a host pool readable and writable by GPU kernels (pins it;
 * blocking, once per pool). GPU pools: no-op. */
int pool_pin(pool_t *p, char *why, size_t why_len);
/* The pool's own start (never its allocation's) as kernels on device see
 * it (pinned host pools: their own address). */
int pool_device_base(pool_t *p, int device, uint8_t **base, char *why,
                     size_t why_len);
/* The pool as a plan binds it, read or written through blocks[0, n):
 * its start in the daemon's mapping, its layout, size and id. */
plan_mem_t pool_mem(const pool_t *p, const uint32_t *blocks, uint32_t n);
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
