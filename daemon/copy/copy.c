/* copy — worker threads for host copies; see copy.h. */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "copy.h"
#include "core/log.h"
#include "pace.h"

/* Lanes a pace applies to: 0, the host's copy workers (and the loop's
 * inline copies); 1 + d, GPU d (the last shared by devices 63 and up). */
#define LANES (1 + COPY_PACE_DEVICES)

static void job_finished(copy_job_t *j);

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    list_t todo; /* copy_job_t.node: to run, oldest first */
    int ready;   /* todo is not empty (todo_changed()) */
    list_t done; /* finished, for the loop, in that order */
    pthread_t *threads;
    unsigned nthreads;
    unsigned inflight;   /* loop thread only */
    uint64_t busy_ns[2]; /* loop thread only: copy_busy_ns() */
    int stop;
    unsigned sleeping;     /* workers in pthread_cond_wait */
    int spinning;          /* a worker is spinning for the next job */
    long spin_ns;          /* copy.spin_us */
    uint64_t inline_bytes; /* copy.inline_bytes */
    list_t inline_done;    /* run on the loop, done callback pending */
    uv_check_t check;      /* hands inline_done back, this iteration */
    uv_idle_t idle;        /* and keeps the loop from blocking first */
    int inline_open;
    uv_async_t async;
    int async_open;
    pace_t pace[LANES];      /* loop thread only */
    uint64_t gpu_conf;       /* gpu.pace */
    uint64_t engines[LANES]; /* GPU lanes: the engines' pace (GpuPace) */
    list_t held[LANES];      /* paced jobs waiting to start, oldest first */
    unsigned nheld;
    uv_timer_t pace_timer; /* the next held job's start */
    int pace_open;
    uint64_t paced_jobs; /* held at least once, since start */
    uint64_t paced_ns;   /* their time held, summed */
} c = {.todo = {&c.todo, &c.todo},
       .done = {&c.done, &c.done},
       .inline_done = {&c.inline_done, &c.inline_done}};

/* A job is back on the loop: its time goes to the busy sums. */
static void job_count(const copy_job_t *j)
{
    if (j->t_start && j->t_done > j->t_start)
        c.busy_ns[j->gpu != NULL] += j->t_done - j->t_start;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* c.todo is written under c.mu, but the spinning worker looks for work
 * without the lock: it reads c.ready, stored atomically after every
 * change of c.todo, so that read is not a data race. */
static void todo_changed(void)
{
    __atomic_store_n(&c.ready, !list_empty(&c.todo), __ATOMIC_RELAXED);
}

static void *worker_main(void *arg)
{
    char name[16];
    snprintf(name, sizeof(name), "kvx-copy-%u", (unsigned)(uintptr_t)arg);
    pthread_setname_np(pthread_self(), name); /* top -H, ps -L */
    pthread_mutex_lock(&c.mu);
    for (;;) {
        if (list_empty(&c.todo) && !c.stop && !c.spinning && c.spin_ns) {
            /* One idle worker spins briefly before sleeping: a futex
             * wake-up costs tens of microseconds on virtual machines,
             * which dominates small requests. Bounded (copy.spin_us) and
             * one spinner at most, so the CPUs stay with the engines. */
            c.spinning = 1;
            pthread_mutex_unlock(&c.mu);
            struct timespec t0, t;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            for (int i = 1; !__atomic_load_n(&c.ready, __ATOMIC_RELAXED); i++) {
                cpu_relax();
                if (i % 64 == 0) {
                    clock_gettime(CLOCK_MONOTONIC, &t);
                    if ((t.tv_sec - t0.tv_sec) * 1000000000L + t.tv_nsec -
                            t0.tv_nsec >
                        c.spin_ns)
                        break;
                }
            }
            pthread_mutex_lock(&c.mu);
            c.spinning = 0;
        }
        while (list_empty(&c.todo) && !c.stop) {
            c.sleeping++;
            pthread_cond_wait(&c.cv, &c.mu);
            c.sleeping--;
        }
        if (list_empty(&c.todo))
            break;
        copy_job_t *j = LIST_OWNER(list_pop(&c.todo), copy_job_t, node);
        todo_changed();
        pthread_mutex_unlock(&c.mu);

        j->t_start = now_ns();
        if (j->run)
            j->run(j);
        else
            plan_exec(j->plan, j->unit_begin, j->unit_end);

        job_finished(j);
        pthread_mutex_lock(&c.mu);
    }
    pthread_mutex_unlock(&c.mu);
    return NULL;
}

/* A GPU launch is back (on a device's completion thread). */
static void gpu_done(void *arg, int status)
{
    copy_job_t *j = arg;
    if (status)
        j->status = status;
    job_finished(j);
}

/* Hand a finished job back to the loop; any thread (copy workers, GPU
 * completion threads). */
static void job_finished(copy_job_t *j)
{
    j->t_done = now_ns();
    pthread_mutex_lock(&c.mu);
    assert(!list_linked(&j->node)); /* off c.todo, or never on it */
    list_push(&c.done, &j->node);
    pthread_mutex_unlock(&c.mu);
    uv_async_send(&c.async);
}

static void on_async(uv_async_t *a)
{
    (void)a;
    list_t done, *n;
    list_init(&done);
    pthread_mutex_lock(&c.mu);
    list_move_all(&c.done, &done);
    pthread_mutex_unlock(&c.mu);
    /* in the order the jobs finished; each off the list before its done
     * callback, which may submit it again */
    while ((n = list_pop(&done))) {
        copy_job_t *j = LIST_OWNER(n, copy_job_t, node);
        assert(c.inflight > 0);
        c.inflight--;
        job_count(j);
        j->done(j);
    }
}

/* Jobs run on the loop go back to their owners in the check phase of
 * the same loop iteration (or at the next one's idle phase when they
 * were submitted from a check callback): no syscall, no other thread.
 * Those their done callbacks submit wait for the next iteration, so
 * clients' frames are read in between. */
static void on_idle(uv_idle_t *h);

static void inline_flush(void)
{
    list_t now, *n;
    list_init(&now);
    list_move_all(&c.inline_done, &now);
    if (list_empty(&c.inline_done))
        uv_idle_stop(&c.idle);
    while ((n = list_pop(&now))) {
        copy_job_t *j = LIST_OWNER(n, copy_job_t, node);
        assert(c.inflight > 0);
        c.inflight--;
        job_count(j);
        j->done(j);
    }
    if (!list_empty(&c.inline_done)) /* submitted by those: next turn */
        uv_idle_start(&c.idle, on_idle);
}

static void on_check(uv_check_t *h)
{
    (void)h;
    if (!list_empty(&c.inline_done))
        inline_flush();
}

static void on_idle(uv_idle_t *h)
{
    (void)h;
    inline_flush();
}

/* copy.pin_threads (1 always, 2 with fewer than 4 CPUs): worker k on
 * the k-th CPU the process may use (in turn). Woken together, unbound
 * workers can land on one CPU and stay there, cache-hot, while another
 * idles: a 16 MiB layer's copy on the 2-CPU VM took 1.0-2.4 ms unbound,
 * 1.0-1.2 bound. On the 16-CPU H200 host bound workers lost 8-15 % of
 * the bandwidth (they cannot leave a CPU another busy thread wants). */
static void pin_workers(int pin)
{
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed)) {
        log_warn("copy: sched_getaffinity: %s; workers not pinned",
                 strerror(errno));
        return;
    }
    int cpus[CPU_SETSIZE], n = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &allowed))
            cpus[n++] = cpu;
    if (n < 2 || (pin == 2 && n >= 4))
        return;
    for (unsigned t = 0; t < c.nthreads; t++) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[t % (unsigned)n], &one);
        int rc = pthread_setaffinity_np(c.threads[t], sizeof(one), &one);
        if (rc)
            log_warn("copy: worker %u on CPU %d: %s", t, cpus[t % (unsigned)n],
                     strerror(rc));
    }
    log_info("copy: %u workers pinned over %d CPUs", c.nthreads, n);
}

int copy_init(uv_loop_t *loop, unsigned nthreads, int pin, unsigned spin_us,
              uint64_t inline_bytes)
{
    int rc;
    if (uv_check_init(loop, &c.check) || uv_idle_init(loop, &c.idle) ||
        uv_check_start(&c.check, on_check)) {
        log_error("copy: cannot start the loop's check handle");
        return KVX_ERR_IO;
    }
    uv_unref((uv_handle_t *)&c.check); /* keep nothing alive */
    uv_unref((uv_handle_t *)&c.idle);
    c.inline_open = 1;
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    if ((rc = uv_async_init(loop, &c.async, on_async))) {
        log_error("copy: uv_async_init: %s", uv_strerror(rc));
        goto err_close_inline;
    }
    c.async_open = 1;
    c.spin_ns = (long)spin_us * 1000;
    c.inline_bytes = inline_bytes;
    c.threads = calloc(nthreads, sizeof(*c.threads));
    if (!c.threads) {
        log_error("copy: out of memory for %u threads", nthreads);
        goto err_close_async;
    }
    for (c.nthreads = 0; c.nthreads < nthreads; c.nthreads++) {
        if ((rc = pthread_create(&c.threads[c.nthreads], NULL, worker_main,
                                 (void *)(uintptr_t)c.nthreads))) {
            log_error("copy: pthread_create: %s", strerror(rc));
            goto err_stop_threads;
        }
    }
    for (int l = 0; l < LANES; l++)
        list_init(&c.held[l]);
    if ((rc = uv_timer_init(loop, &c.pace_timer))) {
        log_error("copy: uv_timer_init: %s", uv_strerror(rc));
        goto err_stop_threads;
    }
    uv_unref((uv_handle_t *)&c.pace_timer); /* held jobs keep the drain */
    c.pace_open = 1;
    if (pin)
        pin_workers(pin);
    return 0;

err_stop_threads:
    copy_cleanup();
    return KVX_ERR_IO;
err_close_async:
    uv_close((uv_handle_t *)&c.async, NULL);
    c.async_open = 0;
    rc = KVX_ERR_NOMEM;
err_close_inline:
    uv_check_stop(&c.check);
    uv_close((uv_handle_t *)&c.check, NULL);
    uv_close((uv_handle_t *)&c.idle, NULL);
    c.inline_open = 0;
    return rc == KVX_ERR_NOMEM ? rc : KVX_ERR_IO;
}

int copy_job_inline(const copy_job_t *j)
{
    /* a paced host lane may hold it past this turn */
    return !j->gpu && !j->run && j->plan->bytes <= c.inline_bytes &&
           !c.pace[0].per_ms;
}

/* Start j now: a GPU launch, or a small host plan on the loop; 1: it is
 * for the workers, to be queued. */
static int start(copy_job_t *j)
{
    j->t_start = now_ns();
    if (j->gpu) { /* the GPU executor; it completes through gpu_done() */
        gpu_work_t w = {.unit_begin = j->unit_begin,
                        .unit_end = j->unit_end,
                        .bytes = j->bytes,
                        .packed = j->packed,
                        .gather = j->packed_gather,
                        .device = j->packed_device};
        if ((j->status = gpu_launch(j->gpu, &w, gpu_done, j)))
            job_finished(j);
        return 0;
    }
    if (copy_job_inline(j)) {
        /* small: here, now; its done callback at this iteration's check */
        plan_exec(j->plan, j->unit_begin, j->unit_end);
        j->t_done = now_ns();
        list_push(&c.inline_done, &j->node);
        uv_idle_start(&c.idle, on_idle);
        return 0;
    }
    return 1;
}

/* The workers take jobs[0..n) once all of them are queued: a woken
 * worker can take the loop's CPU (wake-up preemption), and jobs not
 * queued yet would wait for the loop to get it back. */
static void queue(copy_job_t **jobs, size_t n)
{
    if (!n)
        return;
    pthread_mutex_lock(&c.mu);
    for (size_t i = 0; i < n; i++)
        list_push(&c.todo, &jobs[i]->node);
    todo_changed();
    unsigned sleeping = c.sleeping;
    pthread_mutex_unlock(&c.mu);
    if (n >= sleeping)
        pthread_cond_broadcast(&c.cv);
    else
        for (size_t i = 0; i < n; i++)
            pthread_cond_signal(&c.cv);
}

/* ---- pace (gpu.pace, copy.pace) --------------------------------------- */

/* The lane of GPU device d. */
static int gpu_lane(int d)
{
    return 1 + copy_pace_device(d);
}

/* The lane a job's bytes are paced on, or -1: not a copy of a plan. */
static int lane_of(const copy_job_t *j)
{
    if (j->run) /* a host copy into or out of a staging slot, or other */
        return j->packed ? 0 : -1;
    if (!j->gpu)
        return 0;
    return gpu_lane(gpu_part_device(j->gpu));
}

int copy_job_paced(const copy_job_t *j)
{
    int l = lane_of(j);
    return l >= 0 && c.pace[l].per_ms;
}

static void on_pace_timer(uv_timer_t *t);

/* Arm the timer for the earliest held job's start. */
static void pace_arm(uint64_t now)
{
    uint64_t wait = UINT64_MAX;
    for (int l = 0; l < LANES && c.nheld; l++)
        if (!list_empty(&c.held[l])) {
            uint64_t w = pace_wait(&c.pace[l], now);
            if (w < wait)
                wait = w;
        }
    if (wait == UINT64_MAX)
        return;
    /* libuv's timers count whole milliseconds: round up, at least one
     * turn of the loop */
    uv_timer_start(&c.pace_timer, on_pace_timer, (wait + 999999) / 1000000, 0);
}

/* Held jobs whose time has come start, in order, lane by lane. */
static void pace_release(void)
{
    copy_job_t *batch[64];
    size_t n = 0;
    uint64_t now = now_ns();
    for (int l = 0; l < LANES && c.nheld; l++) {
        while (!list_empty(&c.held[l]) && !pace_wait(&c.pace[l], now)) {
            copy_job_t *j = LIST_OWNER(list_pop(&c.held[l]), copy_job_t, node);
            c.nheld--;
            c.paced_ns += now - j->t_start;
            pace_charge(&c.pace[l], now, j->bytes);
            if (start(j))
                batch[n++] = j;
            if (n == sizeof(batch) / sizeof(batch[0])) {
                queue(batch, n);
                n = 0;
            }
        }
    }
    queue(batch, n);
    if (c.nheld)
        pace_arm(now);
}

static void on_pace_timer(uv_timer_t *t)
{
    (void)t;
    pace_release();
}

/* 1: j waits for its lane's pace (held, behind any held before it). */
static int pace_hold(copy_job_t *j)
{
    int l = lane_of(j);
    if (l < 0 || !c.pace[l].per_ms)
        return 0;
    uint64_t now = now_ns();
    if (list_empty(&c.held[l]) && !pace_wait(&c.pace[l], now)) {
        pace_charge(&c.pace[l], now, j->bytes);
        return 0;
    }
    if (j->abort && *j->abort) { /* its end has come: unrun at once */
        j->t_start = 0;
        j->status = KVX_ERR_CANCELLED;
        job_finished(j);
        return 1;
    }
    j->t_start = now; /* until it starts: when it was held */
    list_push(&c.held[l], &j->node);
    c.nheld++;
    c.paced_jobs++;
    pace_arm(now);
    return 1;
}

void copy_drop_aborted(void)
{
    for (int l = 0; l < LANES && c.nheld; l++) {
        list_t *n = c.held[l].next, *next;
        for (; n != &c.held[l]; n = next) {
            next = n->next;
            copy_job_t *j = LIST_OWNER(n, copy_job_t, node);
            if (!j->abort || !*j->abort)
                continue;
            list_remove(n);
            c.nheld--;
            c.paced_ns += now_ns() - j->t_start;
            j->t_start = 0; /* it never ran: no busy time */
            j->status = KVX_ERR_CANCELLED;
            job_finished(j);
        }
    }
}

void copy_set_pace(uint64_t host_per_ms, uint64_t gpu_per_ms)
{
    /* what a lane owes for copies started at the old pace is owed at
     * the new one: a faster pace lets its held jobs go sooner */
    uint64_t now = now_ns();
    pace_set(&c.pace[0], now, host_per_ms);
    c.gpu_conf = gpu_per_ms;
    for (int l = 1; l < LANES; l++) /* the engines' paces stay */
        pace_set(&c.pace[l], now, pace_lowest(gpu_per_ms, c.engines[l]));
    if (c.nheld)
        pace_release(); /* an unpaced lane lets its jobs go now */
}

void copy_set_gpu_pace(int device, uint64_t per_ms)
{
    int l = gpu_lane(device);
    c.engines[l] = per_ms;
    uint64_t want = pace_lowest(c.gpu_conf, per_ms);
    if (want == c.pace[l].per_ms)
        return;
    pace_set(&c.pace[l], now_ns(), want);
    if (!list_empty(&c.held[l]))
        pace_release(); /* a faster (or no) pace lets them go sooner */
}

uint64_t copy_gpu_pace(int device, uint64_t *engines)
{
    int l = gpu_lane(device);
    *engines = c.engines[l];
    return c.pace[l].per_ms;
}

void copy_pace_stats(uint64_t *jobs, uint64_t *ns, unsigned *held)
{
    *jobs = c.paced_jobs;
    *ns = c.paced_ns;
    *held = c.nheld;
}

/* j is counted in flight; 1: it is for the workers, to be queued. */
static int submit_now(copy_job_t *j)
{
    /* on no queue: zeroed, or popped before its done callback ran */
    assert(!j->node.next || !list_linked(&j->node));
    list_init(&j->node);
    c.inflight++;
    if (pace_hold(j))
        return 0;
    return start(j);
}

void copy_submit_many(copy_job_t **jobs, size_t n)
{
    size_t q = 0;
    for (size_t i = 0; i < n; i++)
        if (submit_now(jobs[i]))
            jobs[q++] = jobs[i];
    queue(jobs, q);
}

void copy_submit(copy_job_t *j)
{
    copy_submit_many(&j, 1);
}

unsigned copy_inflight(void)
{
    return c.inflight;
}
unsigned copy_threads(void)
{
    return c.nthreads;
}
uint64_t copy_busy_ns(int gpu)
{
    return c.busy_ns[gpu != 0];
}

void copy_cleanup(void)
{
    /* held by a pace: they never start, and go back as not run */
    for (int l = 0; l < LANES && c.nheld; l++) {
        list_t *n;
        while ((n = list_pop(&c.held[l]))) {
            copy_job_t *j = LIST_OWNER(n, copy_job_t, node);
            c.nheld--;
            j->status = KVX_ERR_SHUTDOWN;
            job_finished(j);
        }
    }
    if (c.pace_open) {
        uv_close((uv_handle_t *)&c.pace_timer, NULL);
        c.pace_open = 0;
    }
    pthread_mutex_lock(&c.mu);
    c.stop = 1;
    pthread_cond_broadcast(&c.cv);
    pthread_mutex_unlock(&c.mu);
    for (unsigned i = 0; i < c.nthreads; i++)
        pthread_join(c.threads[i], NULL);
    free(c.threads);
    c.threads = NULL;
    c.nthreads = 0;
    if (c.async_open) {
        on_async(&c.async); /* finish what the workers handed back */
        uv_close((uv_handle_t *)&c.async, NULL);
        c.async_open = 0;
    }
    if (c.inline_open) {
        inline_flush();
        uv_check_stop(&c.check);
        uv_close((uv_handle_t *)&c.check, NULL);
        uv_close((uv_handle_t *)&c.idle, NULL);
        c.inline_open = 0;
    }
}
