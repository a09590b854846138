/*
 * sched — the chunk scheduler: round-robin over the queued parts, one
 * chunk of units per turn, at most max_inflight_chunks in the copy
 * engine; copies coming back; a part settling once its last job is out.
 * The requests' types and what the files of xfer share: xfer_int.h.
 */
#include <assert.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <openssl/sha.h>

#include "common/list.h"
#include "copy/copy.h"
#include "core/daemon.h"
#include "core/log.h"
#include "core/rrq.h"
#include "net/peer.h"
#include "xfer.h"
#include "xfer_int.h"
#include "xfer_remote.h"

/* ---- scheduler -------------------------------------------------------- */

/* One line of log.trace_file for a fetch that ends: "fetch INSTANCE KEY
 * KIND BYTES" and the hops' monotonic ns (0: not reached). */
void xfer_trace_write(genreq_t *g)
{
    fprintf(kvxd.trace, "fetch %s %s %d %llu %llu %llu %llu %llu %llu %llu\n",
            g->inst->id, ks(&g->key), g->end_kind,
            (unsigned long long)g->bytes_done,
            (unsigned long long)g->tr[TR_FETCH],
            (unsigned long long)g->tr[TR_QUEUED],
            (unsigned long long)g->tr[TR_SUBMIT],
            (unsigned long long)g->tr[TR_COPIED],
            (unsigned long long)g->tr[TR_LANDED],
            (unsigned long long)g->tr[TR_EVENT]);
}

/* Where part p's bytes come from (metrics): a peer daemon, or the
 * offer's pools here against p's, read once (the offer may be gone by
 * the time the fence's last copies come back). */
kvxd_path_t xfer_part_path(genpart_t *p)
{
    if (p->path)
        return (kvxd_path_t)(p->path - 1);
    genreq_t *g = p->req;
    const pool_t *src = NULL;
    for (uint32_t r = 0; g->offer && !src && r < g->offer->inst->nranks; r++)
        src = OPART(g->offer, p->group, r)->pool;
    kvxd_path_t path = g->remote ? KVXD_PATH_PEER
                       : !src || !src->gpu || !p->pool || !p->pool->gpu
                           ? KVXD_PATH_HOST
                       : src->device == p->pool->device ? KVXD_PATH_SAME_GPU
                                                        : KVXD_PATH_GPU_GPU;
    p->path = (int)path + 1;
    return path;
}

/* A copy of part p came back (a chunk here, a scattered slot in
 * remote.c): count it, and end the request on error, on its fence, or
 * when every part is done. */
void xfer_part_progress(genpart_t *p, uint64_t units, uint64_t bytes,
                        int status)
{
    genreq_t *g = p->req;
    assert(p->inflight > 0);
    p->inflight--;
    assert(g->inflight > 0 /* the fence */);
    g->inflight--;
    p->units_done += units;
    g->bytes_done += bytes;
    if (!status) {
        kvxd.stats.bytes_moved += bytes;
        kvxd.stats.bytes_in[xfer_part_path(p)] += bytes;
    }
    /* each branch calls genreq_end at most once: it may free g */
    if (status && !g->ending) {
        char m[96];
        snprintf(m, sizeof(m), "copy failed on %s: %s",
                 p->gpu ? "the GPU" : "a worker", kvx_status_str(status));
        genreq_end(g, KVX_EVENT_ERROR, status, m);
    } else if (g->ending) {
        if (g->inflight == 0) /* the fence is complete: finalize */
            genreq_end(g, g->end_kind, g->end_code, g->end_msg);
    } else if (p->units_done == p->plan->nunits) {
        p->done = 1;
        part_settle(p, 0);
        if (++g->ndone == g->need * g->ngroups)
            genreq_end(g, KVX_EVENT_COMPLETE, 0, "");
    }
}

static void on_chunk_done(copy_job_t *job)
{
    genpart_t *p = job->owner;
    uint64_t units = job->unit_end - job->unit_begin, bytes = job->bytes;
    int status = job->status;
    assert(xfer_chunks_inflight > 0);
    xfer_chunks_inflight--;
    if (!status)
        part_landed(p, job->unit_begin, job->unit_end);
    if (kvxd.trace) {
        genreq_t *g = p->req;
        if (job->t_done > g->tr[TR_COPIED])
            g->tr[TR_COPIED] = job->t_done;
        g->tr[TR_LANDED] = mono_ns();
    }
    free(job);
    xfer_part_progress(p, units, bytes, status);
    xfer_schedule();
}

/* Part p of g is done, or has its last job out to a copy thread or a
 * GPU (last_out): once every part is, g's terminal event is at most one
 * copy away, and the instance's polls that asked Poll.early are answered
 * now, so that a caller asleep in its poll wakes while that copy runs (a
 * thread's wake-up costs tens of microseconds) and looks for the event
 * without sleeping. Not for an instance spread over daemons (its batches
 * are agreed on rank 0's daemon), nor when the last part settles by
 * ending or by a job run on the loop (the event goes out this turn), nor
 * for parts pulled from peer daemons (they settle by ending). */
void part_settle(genpart_t *p, int last_out)
{
    genreq_t *g = p->req;
    if (p->settled)
        return;
    p->settled = 1;
    if (++g->nsettled < g->need * g->ngroups || g->soon || g->ending ||
        !last_out)
        return;
    g->soon = 1;
    if (!instance_spread(g->inst))
        kvxd.stats.polls_woken_early += batch_wake_early(&g->inst->batches);
}

void xfer_schedule(void)
{
    uint32_t max = kvxd.conf.max_inflight_chunks ? kvxd.conf.max_inflight_chunks
                                                 : 2 * copy_threads();
    /* handed to the copy engine together, so that the workers start
     * once every job of this turn is queued */
    copy_job_t *batch[64];
    size_t nbatch = 0;
    while (xfer_runq.head && xfer_chunks_inflight < max) {
        genpart_t *p = RRQ_OWNER(rrq_pop(&xfer_runq), genpart_t, turn);
        copy_job_t *job = calloc(1, sizeof(*job));
        if (!job) {
            log_error("xfer: out of memory for a copy job");
            genreq_end(p->req, KVX_EVENT_ERROR, KVX_ERR_NOMEM,
                       "daemon out of memory");
            continue;
        }
        uint64_t begin = p->next_unit, end;
        int more;
        if (p->cnext) { /* layer-wise: only what its sources have ready */
            if (!part_next_job(p, &begin, &end)) {
                free(job);
                p->parked = 1; /* layers_ready() puts it back */
                continue;
            }
            more = part_has_left(p);
        } else {
            end = begin + p->units_per_chunk;
            if (end > p->plan->nunits)
                end = p->plan->nunits;
            p->next_unit = end;
            more = end < p->plan->nunits;
        }
        job->plan = p->plan;
        job->gpu = p->gpu;
        job->unit_begin = begin;
        job->unit_end = end;
        job->bytes = plan_units_bytes(p->plan, begin, end);
        job->done = on_chunk_done;
        job->owner = p;
        job->abort = &p->req->ending; /* a held chunk is dropped */
        TRACE_HOP(p->req, TR_SUBMIT);
        p->inflight++;
        p->req->inflight++;
        xfer_chunks_inflight++;
        if (more) { /* back of the line: fairness */
            if (!p->cnext || part_has_ready(p))
                rrq_push(&xfer_runq, &p->turn);
            else
                p->parked = 1;
        }
        batch[nbatch++] = job;
        /* a job run on the loop ends this turn: its event needs no
         * early answer; nor does one a pace may hold (it need not be
         * one copy away, and a woken caller would spin for it) */
        if (!more)
            part_settle(p, !copy_job_inline(job) && !copy_job_paced(job));
        if (nbatch == sizeof(batch) / sizeof(batch[0])) {
            copy_submit_many(batch, nbatch);
            nbatch = 0;
        }
    }
    copy_submit_many(batch, nbatch);
}
