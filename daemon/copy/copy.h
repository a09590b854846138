/*
 * copy — the copy engine: one entry for every copy off the loop thread.
 * A job is a range of plan units; copy_submit() runs it on a worker
 * thread (memcpy, plan_exec) or, when the job carries a GPU part, hands it
 * to the GPU (gpu_launch). Either way the job comes back through
 * one async handle, and its done callback runs on
 * the loop.
 *
 * Owns the threads, the job queue and the async handle. Workers only read
 * the plan and the memory it is bound to and write the destination; they
 * never touch daemon state. The submitter owns each job and keeps the plan
 * and its memory alive until the job's done callback has run.
 */
#ifndef KVX_COPY_H
#define KVX_COPY_H

#include <stdint.h>
#include <uv.h>

#include "common/list.h"
#include "gpu.h"
#include "plan.h"

typedef struct copy_job copy_job_t;
typedef void (*copy_done_cb)(copy_job_t *job);

struct copy_job {
    /* either a plan range to copy, or run() for other blocking work
     * (e.g. populating a new pool's page tables) */
    void (*run)(copy_job_t *job);
    const plan_t *plan;
    gpu_part_t *gpu; /* set: the plan runs on this GPU, not on threads */
    uint64_t unit_begin, unit_end;
    /* between daemons: one side is a staging slot holding the units
     * packed (plan_exec_packed); gather: the slot is the destination. A
     * host one runs as run(), and is paced as a host copy (copy.pace) */
    uint8_t *packed;
    int packed_gather;
    int packed_device; /* the slot is device memory (GPU slots), else
                          pinned host memory */
    uint64_t bytes;
    int status;        /* 0, or why the job did not run */
    uint64_t t_start;  /* CLOCK_MONOTONIC ns it started (copy sets it) */
    uint64_t t_done;   /* CLOCK_MONOTONIC ns it finished */
    copy_done_cb done; /* runs on the loop thread */
    /* set: while the job is held by a pace and *abort is nonzero (its
     * request is ending), copy_drop_aborted() hands it back unrun, with
     * status KVX_ERR_CANCELLED; so does a submit that a pace would hold.
     * Like plan and owner, it is the submitter's memory, which the
     * submitter keeps until the job's done callback (its fence) */
    const int *abort;
    void *owner;
    list_t node; /* queue link, owned by copy */
};

/* Start n worker threads; finished jobs come back on loop. pin: each
 * bound to its own CPU of the process's affinity mask, in turn (1
 * always, 2 when that mask has fewer than 4 CPUs). An idle
 * worker spins up to spin_us before sleeping (0: never). A host plan job
 * whose whole plan moves at most inline_bytes runs on the loop thread at
 * submit (0: none does): handing it to a worker and back costs two
 * wake-ups, more than copying a few blocks, and a plan that small cannot
 * keep the loop from its clients for long; its done callback still
 * comes later, from the loop, as every job's does. */
int copy_init(uv_loop_t *loop, unsigned nthreads, int pin, unsigned spin_us,
              uint64_t inline_bytes);
/* Queue a job (loop thread only): a zeroed one, or one handed back to
 * its done callback (even from inside it), never one still queued. */
void copy_submit(copy_job_t *job);
/* The same for n jobs (the array is reused as scratch): the workers are
 * woken once all of them are queued. */
void copy_submit_many(copy_job_t **jobs, size_t n);
/* 1 when job, submitted now, would run on the loop thread (a small host
 * plan, copy.inline_bytes) and be done within this loop turn. */
int copy_job_inline(const copy_job_t *job);
/* 1 when job's lane has a pace (gpu.pace, copy.pace): submitted now, it
 * may wait for it. */
int copy_job_paced(const copy_job_t *job);
/* Jobs submitted and not yet done. */
unsigned copy_inflight(void);
/* Time jobs ran since start, summed (metrics): on the copy threads and
 * the loop (gpu 0), or from launch to completion on the GPUs (gpu 1: a
 * launch queued behind another counts its wait too). */
uint64_t copy_busy_ns(int gpu);
unsigned copy_threads(void);
/* Bytes a millisecond that copies may start at (gpu.pace, copy.pace): on
 * the host's workers, and on each GPU; 0: no pace. A job over its lane's
 * pace is held, in order, and started by a timer; held jobs count as in
 * flight. Loop thread; a new pace applies to held jobs too, and to what
 * a lane owes for the jobs it started (pace_set()). */
void copy_set_pace(uint64_t host_per_ms, uint64_t gpu_per_ms);
/* GPUs whose lanes are paced apart: devices 63 and up share the last. */
#define COPY_PACE_DEVICES 64
/* Device d's pace index, 0..COPY_PACE_DEVICES - 1 (its lane's). */
static inline int copy_pace_device(int d)
{
    return d < 0 ? 0 : d < COPY_PACE_DEVICES - 1 ? d : COPY_PACE_DEVICES - 1;
}
/* The engines' pace of GPU device (the lowest their GpuPace gives it; 0:
 * none): its lane goes at the lowest of this and gpu.pace, as
 * copy_set_pace() says. Loop thread. */
void copy_set_gpu_pace(int device, uint64_t per_ms);
/* Device's effective pace (bytes a millisecond, 0: none); *engines, the
 * engines' part of it (copy_set_gpu_pace()). */
uint64_t copy_gpu_pace(int device, uint64_t *engines);
/* Held jobs whose *abort is set go back unrun (their done callbacks
 * follow, from the loop), so that an ending request's fence does not
 * wait for the pace. Loop thread. */
void copy_drop_aborted(void);
/* Jobs held by a pace since start, their time held (ns), held now. */
void copy_pace_stats(uint64_t *jobs, uint64_t *ns, unsigned *held);
/* Stop the workers after the queue drains and close the async handle. */
void copy_cleanup(void);

#endif /* KVX_COPY_H */
