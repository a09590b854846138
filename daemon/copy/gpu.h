/*
 * gpu — CUDA inside kvxferd: lazy start, import of client GPU allocations
 * (legacy cudaIpcMemHandle, or a VMM POSIX fd from
 * cuMemExportToShareableHandle), pinning of host pools for mixed copies,
 * one stream per device, device-resident plans and the copy kernel launch,
 * whose completion goes to the callback its caller (the copy engine)
 * gave. Knows nothing of the layers above it.
 *
 * Owns CUDA contexts (primary, created only on devices that get a pool),
 * imports (one per client allocation, shared by the pools inside it),
 * streams, staging buffers, and the device memory of uploaded plans (freed
 * with gpu_part_free() by whoever holds the plan). Never blocks the loop
 * on the GPU: launches are asynchronous; an event recorded after each is
 * waited for by the device's completion thread, which only queues the job
 * back (the done callback of gpu_launch()).
 *
 * Built without CUDA (gpu_none.c), every entry point answers
 * KVX_ERR_UNSUPPORTED with a message that says so.
 */
#ifndef KVX_GPU_H
#define KVX_GPU_H

#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "plan.h"

typedef struct gpu_import gpu_import_t;
typedef struct gpu_part gpu_part_t;
typedef struct gpu_event gpu_event_t;

/* "cuda 13.0, kernels sm_80 sm_90 sm_100 + PTX" or "host-only". */
const char *gpu_build_info(void);

/* Before anything starts CUDA (UCX may): the environment gpu.sm_share
 * asks for (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). */
void gpu_env(void);

/* Describe the GPU side for status: devices in use, staging, path. */
void gpu_status(char *buf, size_t len);

/* What the GPUs took since start (loop thread): launches, those of them
 * on the copy engines (gpu.copy_path dma or auto), and the copies those
 * were cut into. */
typedef struct gpu_counts {
    uint64_t launches, launches_dma, dma_copies;
} gpu_counts_t;
void gpu_counts(gpu_counts_t *c);

/* Whether the daemon's context on device d is an MPS client, shared with
 * the engines' (their kernels and its copies then run side by side): 1,
 * 0 (not: they take turns on the GPU), or -1 (no pool there yet, a
 * driver that cannot say, or a host-only build). */
int gpu_mps(int device);

/* What a client sends to register a GPU pool. */
typedef struct gpu_import_req {
    int vmm;  /* 1: fds are VMM shareable handles */
    int *fds; /* VMM only: one per physical allocation,
                 in address order; gpu_import closes them
                 (and sets nfds to 0) on every path */
    uint32_t nfds;
    const uint64_t *chunk_sizes; /* nfds > 1: their sizes, summing to
                                    alloc_size */
    uint8_t ipc_handle[64];      /* legacy only */
    uint8_t uuid[16];            /* device, as the client's CUDA names it */
    uint64_t alloc_id;           /* client's allocation base address */
    uint64_t alloc_size;
    uint64_t offset; /* pool start inside the allocation */
    uint64_t size;   /* pool bytes */
    uint64_t owner;  /* session id: imports are per client */
} gpu_import_req_t;

/* Import (or find the cached import of) the allocation and return the
 * daemon's pointer to the pool and its device ordinal. VMM allocations
 * (several: mapped back to back in one reserved range, as the client had
 * them) are imported from req->fds. */
int gpu_import(gpu_import_req_t *req, gpu_import_t **out, uint8_t **ptr,
               int *device, kvx_why_t *why);
void gpu_import_unref(gpu_import_t *imp);
/* Close what is left of req's fds (an error path before gpu_import);
 * the one closer of a request's fds, in CUDA builds and host-only ones. */
static inline void gpu_import_req_close(gpu_import_req_t *req)
{
    for (uint32_t i = 0; i < req->nfds; i++)
        if (req->fds[i] >= 0)
            close(req->fds[i]);
    req->nfds = 0;
}
/* The pool's base as seen from kernels launched on device. */
int gpu_import_ptr(gpu_import_t *imp, int device, uint8_t **base,
                   kvx_why_t *why);

/* Device's PCI bus id ("0000:1b:00.0", as cudaDeviceGetPCIBusId
 * writes it, lower case) into buf (len >= 13): 0, or KVX_ERR_INVALID
 * (no such device, CUDA not started: no pool yet), KVX_ERR_UNSUPPORTED
 * (host-only build). For the NIC nearest to it (net's rails). */
int gpu_pci_id(int device, char *buf, size_t len);

/* A device with a context (a GPU pool lives there), or -1 when CUDA is
 * not in use. Loop thread. */
int gpu_started(void);
/* Pin a host pool so kernels can read and write it (mixed copies), through
 * device's context (-1: the loop picks one). Blocking. Pinning what is
 * already pinned succeeds. */
int gpu_host_register(void *base, uint64_t size, int device);
void gpu_host_unregister(void *base);
/* len bytes of device memory on device (its context started if it was
 * not), for staging slots: 0 and *p, or an error with why. Loop thread;
 * blocking. Freed with gpu_mem_free() before gpu_cleanup(). */
int gpu_mem_alloc(int device, size_t len, void **p, kvx_why_t *why);
void gpu_mem_free(void *p);

/* Upload plan p (bound: src/dst bases are device-visible) for execution
 * on device. */
int gpu_part_create(const plan_t *p, int device, gpu_part_t **out,
                    kvx_why_t *why);
void gpu_part_free(gpu_part_t *gp);
/* The device gp's launches run on. */
int gpu_part_device(const gpu_part_t *gp);
/* Entries [first, first + n) of slice's source block table in gp's
 * uploaded plan (a chunked prefill appended them): written on the
 * stream, so launches after this call see them. */
int gpu_part_set_blocks(gpu_part_t *gp, uint32_t slice, uint32_t first,
                        const uint32_t *blocks, uint32_t n);

/* One launch: units [unit_begin, unit_end) of a part, bytes in all;
 * between daemons one side is a staging slot holding the units packed
 * (gather: the slot is the destination), in device memory (device) or
 * pinned host memory. */
typedef struct gpu_work {
    uint64_t unit_begin, unit_end, bytes;
    uint8_t *packed;
    int gather;
    int device;
} gpu_work_t;
/* Called once the launch has run (status 0 or KVX_ERR_IO), on the
 * device's completion thread: it may only hand the result on. */
typedef void (*gpu_done_cb)(void *arg, int status);

/* Launch w on gp's device; done(arg, status) follows. Returns 0, or
 * KVX_ERR_IO: then nothing is in flight and done is not called. */
int gpu_launch(gpu_part_t *gp, const gpu_work_t *w, gpu_done_cb done,
               void *arg);

/* A client's CUDA event (a cudaIpcEventHandle_t of 64 bytes) opened on
 * device, whose context a pool there started: a layer-wise offer's
 * engine records it after the work that writes some layers. Imports of
 * one handle from one client (owner: its session) are shared (counted)
 * and kept open while the client is connected. */
int gpu_event_import(const uint8_t handle[64], int device, uint64_t owner,
                     gpu_event_t **out, kvx_why_t *why);
void gpu_event_unref(gpu_event_t *e);
/* Client session owner is gone: its imports are closed (those still
 * watched at their last unref) and never matched again. */
void gpu_events_forget(uint64_t owner);

/* Watch e until its last record is reached: then cb(arg, 0) on the loop
 * (cb(arg, KVX_ERR_IO) if CUDA reports an error for it). A thread polls
 * the watched events (cudaEventQuery every gpu.event_poll_us while
 * any is watched): nothing of the daemon's ever waits on a client's event on
 * the GPU, so an engine that dies with its event never reached leaves
 * no copy stuck behind it. NULL: out of memory. A watch ends with its
 * callback or with gpu_event_unwatch() (then cb is never called). */
typedef struct gpu_watch gpu_watch_t;
typedef void (*gpu_watch_cb)(void *arg, int status);
gpu_watch_t *gpu_event_watch(gpu_event_t *e, gpu_watch_cb cb, void *arg);
void gpu_event_unwatch(gpu_watch_t *w);
/* On the loop, when it polls instead of sleeping (copy.busy_poll): look
 * at the watched events now, and run the callbacks of those reached, so
 * that a layer made ready is copied without waiting for the watcher's
 * next look and its hand-off to the loop (tens of microseconds). The
 * watcher keeps looking too. Returns 1 if any callback ran. */
int gpu_events_poll(void);

/* At exit, before copy_cleanup(): every launched job's completion has
 * been handed to the copy engine and the completion threads are gone. */
void gpu_stop(void);
/* At exit, after the pools (which drop their imports) are gone. */
void gpu_cleanup(void);

#endif /* KVX_GPU_H */
