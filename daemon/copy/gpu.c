/* gpu — CUDA pools, plans and launches; see gpu.h. Built only with CUDA. */
#include <assert.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "common/layout.h"
#include "common/list.h"
#include "core/daemon.h"
#include "core/log.h"
#include "gpu.h"
#include "gpu_desc.h"
#include "gpu_dma.h"
#include "gpu_walk.h"

#define MAX_DEV 64
#define CU_OK(call) ((call) == cudaSuccess)

/* Driver entry points for VMM import, fetched through the runtime so the
 * daemon does not link libcuda (it starts without a driver). */
static struct {
    CUresult (*import)(CUmemGenericAllocationHandle *, void *,
                       CUmemAllocationHandleType);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                        unsigned long long);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                    unsigned long long);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *,
                           size_t);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*free_va)(CUdeviceptr, size_t);
    CUresult (*addr_range)(CUdeviceptr *, size_t *, CUdeviceptr);
} drv;

static struct {
    int state; /* 0 untried, 1 ok, -1 unavailable */
    char why[160];
    int ndev;
    cudaUUID_t uuid[MAX_DEV];
    char pci[MAX_DEV][16];         /* bus ids, "0000:1b:00.0" */
    int used[MAX_DEV];             /* context created: a pool lives here */
    int mps[MAX_DEV];              /* gpu_mps(), once used */
    cudaStream_t stream[MAX_DEV];  /* the copy kernels, in launch order */
    cudaStream_t ustream[MAX_DEV]; /* plan uploads: not between kernels */
    cudaEvent_t uploaded[MAX_DEV]; /* after the last upload on ustream */
    int unwaited[MAX_DEV];         /* the kernel stream has not waited for it */
    int inflight[MAX_DEV];         /* launches not yet seen done (atomic) */
    uint8_t peer[MAX_DEV][MAX_DEV];
    uint64_t launches, imports_legacy, imports_vmm;
} g;

/* Completion without blocking the stream: after each kernel an event is
 * recorded, and one thread per device waits for the events in order and
 * calls their done callbacks (the copy engine's). A stream callback would stall
 * the stream between kernels for its own latency. */
struct done_item {
    cudaEvent_t ev;
    gpu_done_cb done; /* a kernel's completion, with arg */
    void *arg;
    struct pin_buf *pin; /* or a plan upload's buffer, to reuse */
    list_t node;         /* on its waiter's queue or free list */
};

static struct waiter_thread {
    pthread_t th;
    int running, stop;
    int inited; /* mu, cv and the lists */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    list_t queue;      /* done_item.node, in stream order */
    list_t free_items; /* with their events, reused last freed first */
    int queued;        /* queue is not empty: read while spinning */
} wt[MAX_DEV];

static inline uint64_t wt_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static inline void wt_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Pinned host memory for plan uploads, so cudaMemcpyAsync is truly
 * asynchronous (from pageable memory it synchronizes the stream). Size
 * classes of 4 KiB << k; buffers are kept for reuse until exit. Shared
 * with CUDA's callback thread (releases), hence the mutex. */
#define PIN_CLASSES 16
struct pin_buf {
    void *p;
    int cls;
    list_t node; /* on pin.free[cls] while free */
};
static struct {
    pthread_mutex_t mu;
    list_t free[PIN_CLASSES]; /* the last put first; set up at first use */
} pin = {.mu = PTHREAD_MUTEX_INITIALIZER};
static struct pin_buf *pin_all[4096];
static int pin_nall;

static struct pin_buf *pin_get(size_t n)
{
    int k = 0;
    while (k < PIN_CLASSES - 1 && ((size_t)4096 << k) < n)
        k++;
    if (((size_t)4096 << k) < n)
        return NULL;
    pthread_mutex_lock(&pin.mu);
    if (!pin.free[k].next)
        list_init(&pin.free[k]);
    list_t *f = list_pop(&pin.free[k]);
    pthread_mutex_unlock(&pin.mu);
    if (f)
        return LIST_OWNER(f, struct pin_buf, node);
    if (pin_nall >= (int)(sizeof(pin_all) / sizeof(pin_all[0])))
        return NULL;
    struct pin_buf *b = calloc(1, sizeof(*b));
    if (!b)
        return NULL;
    list_init(&b->node);
    if (!CU_OK(
            cudaHostAlloc(&b->p, (size_t)4096 << k, cudaHostAllocPortable))) {
        (void)cudaGetLastError();
        free(b);
        return NULL;
    }
    b->cls = k;
    pthread_mutex_lock(&pin.mu);
    pin_all[pin_nall++] = b;
    pthread_mutex_unlock(&pin.mu);
    return b;
}

static void pin_put(struct pin_buf *b)
{
    pthread_mutex_lock(&pin.mu);
    assert(!list_linked(&b->node)); /* put once */
    list_unshift(&pin.free[b->cls], &b->node);
    pthread_mutex_unlock(&pin.mu);
}

/* After the work queued on stream s of device d so far: done(arg,
 * status) on the waiter thread, or pin back to the pool. An event and the
 * waiter thread, never a stream callback (it would stall the stream).
 * The thread takes the items in the order queued, whatever their stream. */
static cudaError_t waiter_enqueue(int d, cudaStream_t s, gpu_done_cb done,
                                  void *arg, struct pin_buf *pin)
{
    struct waiter_thread *w = &wt[d];
    assert(w->inited);
    pthread_mutex_lock(&w->mu);
    list_t *n = list_pop(&w->free_items);
    pthread_mutex_unlock(&w->mu);
    struct done_item *it = n ? LIST_OWNER(n, struct done_item, node) : NULL;
    if (!it && (it = calloc(1, sizeof(*it))) &&
        !CU_OK(cudaEventCreateWithFlags(&it->ev, cudaEventBlockingSync |
                                                     cudaEventDisableTiming))) {
        free(it);
        it = NULL;
    }
    if (!it)
        return cudaErrorMemoryAllocation;
    if (!n)
        list_init(&it->node);
    cudaError_t e = cudaEventRecord(it->ev, s);
    pthread_mutex_lock(&w->mu);
    if (e == cudaSuccess) {
        it->done = done;
        it->arg = arg;
        it->pin = pin;
        list_push(&w->queue, &it->node);
        __atomic_store_n(&w->queued, 1, __ATOMIC_RELEASE);
        pthread_cond_signal(&w->cv);
    } else {
        list_unshift(&w->free_items, &it->node);
    }
    pthread_mutex_unlock(&w->mu);
    return e;
}

static void *waiter_main(void *arg)
{
    int d = (int)(intptr_t)arg;
    struct waiter_thread *w = &wt[d];
    char name[16];
    snprintf(name, sizeof(name), "kvx-gpu-%d", d);
    pthread_setname_np(pthread_self(), name);
    cudaSetDevice(d);
    /* gpu.spin_us: a small copy is done within microseconds, and waking
     * this thread (a condition variable) and then blocking on the event
     * (an interrupt) each cost tens of them; so it spins that long for
     * the next item and for each event before it sleeps */
    uint64_t spin_ns = (uint64_t)kvxd.conf.gpu_spin_us * 1000;
    /* gpu.event_poll_us is at most 1000: one tv_nsec */
    long poll_ns = (long)kvxd.conf.gpu_event_poll_us * 1000;
    prctl(PR_SET_TIMERSLACK, 1000UL); /* its sleeps as asked */
    pthread_mutex_lock(&w->mu);
    for (;;) {
        if (list_empty(&w->queue) && !w->stop && spin_ns) {
            pthread_mutex_unlock(&w->mu);
            uint64_t t0 = wt_now_ns();
            for (int i = 1; !__atomic_load_n(&w->queued, __ATOMIC_ACQUIRE);
                 i++) {
                wt_relax();
                if (i % 64 == 0 && wt_now_ns() - t0 > spin_ns)
                    break;
            }
            pthread_mutex_lock(&w->mu);
        }
        while (list_empty(&w->queue) && !w->stop)
            pthread_cond_wait(&w->cv, &w->mu);
        if (list_empty(&w->queue))
            break;
        struct done_item *it =
            LIST_OWNER(list_pop(&w->queue), struct done_item, node);
        __atomic_store_n(&w->queued, !list_empty(&w->queue), __ATOMIC_RELAXED);
        pthread_mutex_unlock(&w->mu);
        cudaError_t e = cudaErrorNotReady;
        uint64_t t0 = spin_ns ? wt_now_ns() : 0;
        for (int i = 1; spin_ns && e == cudaErrorNotReady; i++) {
            if ((e = cudaEventQuery(it->ev)) != cudaErrorNotReady)
                break;
            wt_relax();
            if (i % 16 == 0 && wt_now_ns() - t0 > spin_ns)
                break;
        }
        /* a longer copy: look every gpu.event_poll_us for up to 2 ms
         * (a layer of a layer-wise request, a chunk of a large one),
         * then block: an interrupt's wake-up costs 50-100 us more */
        for (uint64_t t = 0; e == cudaErrorNotReady && t < 2000000;) {
            struct timespec ts = {0, poll_ns};
            nanosleep(&ts, NULL);
            t += (uint64_t)poll_ns;
            e = cudaEventQuery(it->ev);
        }
        if (e == cudaErrorNotReady)
            e = cudaEventSynchronize(it->ev);
        if (it->pin) { /* an upload has read its pinned buffer */
            pin_put(it->pin);
        } else {
            __atomic_sub_fetch(&g.inflight[d], 1, __ATOMIC_RELAXED);
            it->done(it->arg, e == cudaSuccess ? 0 : KVX_ERR_IO);
        }
        pthread_mutex_lock(&w->mu);
        list_unshift(&w->free_items, &it->node);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

struct gpu_import {
    uint64_t owner, alloc_id;
    uint8_t uuid[16];
    int device, vmm;
    uint8_t *base;             /* in the owning device's context */
    uint8_t *base_on[MAX_DEV]; /* legacy: opened again in each context that
                                  launches kernels on it (peer access) */
    cudaIpcMemHandle_t ipc;
    uint64_t alloc_size;
    /* VMM: the physical allocations, mapped back to back from base */
    CUmemGenericAllocationHandle *handles;
    uint64_t *chunk; /* their sizes */
    uint32_t nchunks;
    uint8_t access[MAX_DEV]; /* VMM: devices granted access to it */
    unsigned refs;
    list_t node; /* on imports */
};

/* gpu_import_t.node, the newest first */
static list_t imports = {&imports, &imports};

struct gpu_part {
    int device;
    struct pin_buf *pin; /* the descriptor's pinned copy (upload source) */
    void *dmem;          /* device copy of slices, segs, tables, offsets */
    gpu_plan_t plan;     /* with device pointers; passed by value */
    uint32_t nslices;
    size_t *off_sblk; /* each slice's source block table in dmem */
    /* gpu.copy_path dma or auto: the descriptor laid out again in host
     * memory (same offsets), walked for the copy engines' runs */
    uint8_t *hdesc;
    gpu_plan_t hplan;
    int host; /* it reads or writes host memory: its copies cross PCIe */
};

const char *gpu_build_info(void)
{
    return "cuda " KVX_CUDA_VERSION ", kernels sm_80 sm_90 sm_100 + PTX";
}

void gpu_env(void)
{
    const char *mps = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
    if (!kvxd.conf.gpu_sm_share)
        return;
    char v[16];
    snprintf(v, sizeof(v), "%u", kvxd.conf.gpu_sm_share);
    setenv(mps, v, 1);
    log_info("gpu: %s=%s (gpu.sm_share): the daemon's kernels use at most "
             "that share of each GPU's SMs where MPS runs; without MPS it "
             "changes nothing",
             mps, v);
}

static int start(void)
{
    if (g.state)
        return g.state > 0 ? 0 : KVX_ERR_UNSUPPORTED;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(g.why, sizeof(g.why), "no usable GPU: %s",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        log_warn("gpu: %s; host pools only", g.why);
        g.state = -1;
        return KVX_ERR_UNSUPPORTED;
    }
    g.ndev = n < MAX_DEV ? n : MAX_DEV;
    for (int d = 0; d < g.ndev; d++) {
        struct cudaDeviceProp p;
        if (CU_OK(cudaGetDeviceProperties(&p, d))) {
            g.uuid[d] = p.uuid;
            snprintf(g.pci[d], sizeof(g.pci[d]), "%04x:%02x:%02x.0",
                     (unsigned)p.pciDomainID & 0xffff,
                     (unsigned)p.pciBusID & 0xff,
                     (unsigned)p.pciDeviceID & 0x1f);
        }
    }
    struct {
        const char *name;
        void **fn;
    } syms[] = {{"cuMemImportFromShareableHandle", (void **)&drv.import},
                {"cuMemAddressReserve", (void **)&drv.reserve},
                {"cuMemMap", (void **)&drv.map},
                {"cuMemSetAccess", (void **)&drv.set_access},
                {"cuMemUnmap", (void **)&drv.unmap},
                {"cuMemRelease", (void **)&drv.release},
                {"cuMemAddressFree", (void **)&drv.free_va},
                {"cuMemGetAddressRange", (void **)&drv.addr_range}};
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        enum cudaDriverEntryPointQueryResult q;
        if (!CU_OK(cudaGetDriverEntryPointByVersion(
                syms[i].name, syms[i].fn, 12000, cudaEnableDefault, &q)) ||
            q != cudaDriverEntryPointSuccess)
            *syms[i].fn = NULL; /* VMM import then refused, legacy works */
    }
    g.state = 1;
    log_info("gpu: %d devices; %s", g.ndev, gpu_build_info());
    return 0;
}

int gpu_pci_id(int device, char *buf, size_t len)
{
    if (g.state <= 0 || device < 0 || device >= g.ndev || !g.pci[device][0] ||
        len <= strlen(g.pci[device]))
        return KVX_ERR_INVALID;
    memcpy(buf, g.pci[device], strlen(g.pci[device]) + 1);
    return 0;
}

/* cudaDevAttrMpsEnabled (CUDA 12.x headers name it; its value is used so
 * that an older toolkit builds): a driver that does not know it answers
 * an error, and then nobody knows (-1). */
#define DEV_ATTR_MPS_ENABLED 133

static int device_mps(int d)
{
    int v = 0;
    if (cudaDeviceGetAttribute(&v, (enum cudaDeviceAttr)DEV_ATTR_MPS_ENABLED,
                               d) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return v != 0;
}

/* Create the context and stream of device d on first use. */
static int use_device(int d, kvx_why_t *why)
{
    if (g.used[d])
        return 0;
    cudaError_t e;
    cudaMemPool_t mp;
    /* the plans' device memory (cudaMallocAsync, a few KiB a request)
     * stays in the pool between requests: by default the pool gives
     * unused memory back to the driver at each synchronization, and the
     * next request's allocation maps it again */
    uint64_t keep = 64ull << 20;
    /* gpu.stream_priority low: the device's lowest (the larger number;
     * asked once d is current, so that no other device gets a context) */
    int lo = 0, hi = 0;
    if (!CU_OK(e = cudaSetDevice(d))) {
        why_set(why, "gpu %d: %s", d, cudaGetErrorString(e));
        return KVX_ERR_IO;
    }
    if (strcmp(kvxd.conf.gpu_stream_priority, "low") ||
        !CU_OK(cudaDeviceGetStreamPriorityRange(&lo, &hi)))
        lo = 0;
    if (!CU_OK(e = cudaStreamCreateWithPriority(&g.stream[d],
                                                cudaStreamNonBlocking, lo))) {
        why_set(why, "gpu %d: %s", d, cudaGetErrorString(e));
        return KVX_ERR_IO;
    }
    if (!CU_OK(e = cudaStreamCreateWithFlags(&g.ustream[d],
                                             cudaStreamNonBlocking))) {
        why_set(why, "gpu %d: %s", d, cudaGetErrorString(e));
        cudaStreamDestroy(g.stream[d]);
        return KVX_ERR_IO;
    }
    if (!CU_OK(e = cudaEventCreateWithFlags(&g.uploaded[d],
                                            cudaEventDisableTiming))) {
        why_set(why, "gpu %d: %s", d, cudaGetErrorString(e));
        cudaStreamDestroy(g.stream[d]);
        cudaStreamDestroy(g.ustream[d]);
        return KVX_ERR_IO;
    }
    if (!CU_OK(cudaDeviceGetDefaultMemPool(&mp, d)) ||
        !CU_OK(cudaMemPoolSetAttribute(mp, cudaMemPoolAttrReleaseThreshold,
                                       &keep)))
        (void)cudaGetLastError(); /* only slower */
    /* let this device read and write every other device that can */
    for (int o = 0; o < g.ndev; o++) {
        int can = 0;
        if (o != d && CU_OK(cudaDeviceCanAccessPeer(&can, d, o)) && can) {
            cudaError_t pe = cudaDeviceEnablePeerAccess(o, 0);
            if (pe == cudaSuccess || pe == cudaErrorPeerAccessAlreadyEnabled)
                g.peer[d][o] = 1;
            (void)cudaGetLastError();
        }
    }
    if (!wt[d].inited) {
        pthread_mutex_init(&wt[d].mu, NULL);
        pthread_cond_init(&wt[d].cv, NULL);
        list_init(&wt[d].queue);
        list_init(&wt[d].free_items);
        wt[d].inited = 1;
    }
    if (pthread_create(&wt[d].th, NULL, waiter_main, (void *)(intptr_t)d)) {
        why_set(why, "gpu %d: cannot start its completion thread", d);
        /* undone, so the next use starts it all again */
        cudaStreamDestroy(g.stream[d]);
        cudaStreamDestroy(g.ustream[d]);
        cudaEventDestroy(g.uploaded[d]);
        (void)cudaGetLastError();
        return KVX_ERR_IO;
    }
    wt[d].running = 1;
    g.used[d] = 1;
    g.mps[d] = device_mps(d);
    log_info("gpu %d: context, stream and completion thread started (copy "
             "path %s, stream priority %s, %s)",
             d, kvxd.conf.gpu_copy_path, kvxd.conf.gpu_stream_priority,
             g.mps[d] > 0    ? "an MPS client"
             : g.mps[d] == 0 ? "no MPS"
                             : "MPS unknown");
    if (!g.mps[d])
        log_notice("gpu %d: not an MPS client: the daemon's copies and the "
                   "engines' kernels on this GPU take turns (an engine's "
                   "step measured x3.5 slower while the daemon copied); run "
                   "the daemon and the engines under MPS, see \"Sharing a "
                   "GPU with the engine\" in the operations guide",
                   d);
    return 0;
}

void gpu_counts(gpu_counts_t *c)
{
    gpu_dma_counts_t dc;
    gpu_dma_counts(&dc);
    *c = (gpu_counts_t){g.launches, dc.launches, dc.copies};
}

int gpu_mps(int device)
{
    if (g.state <= 0 || device < 0 || device >= g.ndev || !g.used[device])
        return -1;
    return g.mps[device];
}

void gpu_status(char *buf, size_t len)
{
    if (g.state <= 0) {
        snprintf(buf, len, "%s", g.state < 0 ? g.why : "idle (no GPU pool)");
        return;
    }
    gpu_dma_counts_t dc;
    gpu_dma_counts(&dc);
    size_t off = (size_t)snprintf(
        buf, len,
        "%d devices; staging %llu B/device; "
        "launches %llu; imports legacy %llu vmm %llu",
        g.ndev, (unsigned long long)kvxd.conf.gpu_staging_bytes,
        (unsigned long long)g.launches, (unsigned long long)g.imports_legacy,
        (unsigned long long)g.imports_vmm);
    if (off < len)
        off += (size_t)snprintf(
            buf + off, len - off,
            "; copy path %s (copy engines: %llu launches, %llu copies in "
            "%llu batches); in use:",
            kvxd.conf.gpu_copy_path, (unsigned long long)dc.launches,
            (unsigned long long)dc.copies, (unsigned long long)dc.batches);
    for (int d = 0; d < g.ndev && off < len; d++)
        if (g.used[d])
            off += (size_t)snprintf(buf + off, len - off, " %d (%s)", d,
                                    g.mps[d] > 0    ? "MPS"
                                    : g.mps[d] == 0 ? "no MPS"
                                                    : "MPS unknown");
}

static int device_of(const uint8_t uuid[16])
{
    for (int d = 0; d < g.ndev; d++)
        if (!memcmp(g.uuid[d].bytes, uuid, 16))
            return d;
    return -1;
}

/* Unmap and release the first n chunks of a VMM import, and its range. */
static void vmm_unmap(gpu_import_t *imp, uint32_t n, CUdeviceptr va)
{
    uint64_t off = 0;
    for (uint32_t k = 0; k < n; k++) {
        drv.unmap(va + off, imp->chunk[k]);
        drv.release(imp->handles[k]);
        off += imp->chunk[k];
    }
    drv.free_va(va, imp->alloc_size);
}

/* Import r's physical allocations and map them back to back in one
 * reserved range, so the pool reads as one; grant access to the devices
 * that may launch on it. Sets imp->base. */
static int vmm_import(gpu_import_req_t *r, gpu_import_t *imp, int d,
                      kvx_why_t *why)
{
    if (!drv.import || !drv.reserve || !drv.map || !drv.set_access) {
        why_set(why, "register_pool.kind: the driver lacks the VMM import "
                     "entry points");
        return KVX_ERR_UNSUPPORTED;
    }
    uint32_t n = r->nfds;
    if (!n || (n > 1 && !r->chunk_sizes)) { /* session.c sends neither */
        why_set(why, "register_pool: a VMM pool without its fds");
        return KVX_ERR_INVALID;
    }
    imp->handles = calloc(n, sizeof(*imp->handles));
    imp->chunk = calloc(n, sizeof(*imp->chunk));
    if (!imp->handles || !imp->chunk) {
        why_set(why, "register_pool: out of memory");
        return KVX_ERR_NOMEM;
    }
    CUresult cr;
    CUdeviceptr va = 0;
    if ((cr = drv.reserve(&va, r->alloc_size, 0, 0, 0))) {
        why_set(why,
                "register_pool.alloc_size: reserving %llu bytes of address "
                "space failed (CUresult %d)",
                (unsigned long long)r->alloc_size, (int)cr);
        return KVX_ERR_INVALID;
    }
    uint64_t off = 0;
    uint32_t k;
    for (k = 0; k < n; k++) {
        imp->chunk[k] = n == 1 ? r->alloc_size : r->chunk_sizes[k];
        if ((cr = drv.import(&imp->handles[k], (void *)(uintptr_t)r->fds[k],
                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))) {
            why_set(why,
                    "register_pool: cuMemImportFromShareableHandle of "
                    "allocation %u of %u failed (CUresult %d)",
                    k, n, (int)cr);
            goto err_unmap;
        }
        if ((cr = drv.map(va + off, imp->chunk[k], 0, imp->handles[k], 0))) {
            drv.release(imp->handles[k]);
            why_set(why,
                    "register_pool.%s: mapping %llu bytes of allocation "
                    "%u of %u failed (CUresult %d)",
                    n == 1 ? "alloc_size" : "chunk_sizes",
                    (unsigned long long)imp->chunk[k], k, n, (int)cr);
            goto err_unmap;
        }
        off += imp->chunk[k];
    }
    CUmemAccessDesc acc[MAX_DEV];
    size_t nacc = 0;
    for (int o = 0; o < g.ndev; o++)
        if (o == d || g.peer[d][o] || g.used[o]) {
            acc[nacc].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            acc[nacc].location.id = o;
            acc[nacc].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            nacc++;
        }
    if ((cr = drv.set_access(va, r->alloc_size, acc, nacc))) {
        /* peers may refuse; the owning device alone must work */
        acc[0].location.id = d;
        nacc = 1;
        cr = drv.set_access(va, r->alloc_size, acc, 1);
    }
    if (cr) {
        why_set(why, "register_pool: cuMemSetAccess failed (CUresult %d)",
                (int)cr);
        goto err_unmap;
    }
    for (size_t i = 0; i < nacc; i++)
        imp->access[acc[i].location.id] = 1;
    imp->nchunks = n;
    imp->base = (uint8_t *)(uintptr_t)va;
    gpu_import_req_close(r);
    return 0;

err_unmap:
    vmm_unmap(imp, k, va);
    return KVX_ERR_INVALID;
}

int gpu_import(gpu_import_req_t *r, gpu_import_t **out, uint8_t **ptr,
               int *device, kvx_why_t *why)
{
    int rc;
    if ((rc = start())) {
        why_set(why, "register_pool: GPU pool refused: %s", g.why);
        goto err_close_fd;
    }
    int d = device_of(r->uuid);
    if (d < 0) {
        why_set(why, "register_pool.gpu_uuid: the daemon sees no GPU with this "
                     "UUID (CUDA_VISIBLE_DEVICES of the daemon?)");
        rc = KVX_ERR_NOT_FOUND;
        goto err_close_fd;
    }
    if (r->offset > r->alloc_size || r->size > r->alloc_size - r->offset) {
        why_set(why,
                "register_pool.size: [%llu, +%llu) outside the allocation "
                "of %llu bytes",
                (unsigned long long)r->offset, (unsigned long long)r->size,
                (unsigned long long)r->alloc_size);
        rc = KVX_ERR_INVALID;
        goto err_close_fd;
    }
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &imports)
    {
        gpu_import_t *i = LIST_OWNER(n, gpu_import_t, node);
        if (i->owner == r->owner && i->alloc_id == r->alloc_id &&
            !memcmp(i->uuid, r->uuid, 16) &&
            /* a legacy handle names the allocation: one freed and made
             * again at the same address has another, and a new import */
            (i->vmm || r->vmm ||
             !memcmp(&i->ipc, r->ipc_handle, sizeof(i->ipc)))) {
            /* VMM: the same first allocation with other ones after it
             * (another pool of an expandable segment) is another range:
             * its own import, the physical memory mapped twice */
            if (r->vmm && i->vmm &&
                (r->alloc_size != i->alloc_size || r->nfds != i->nchunks))
                continue;
            /* the bounds above used the size the client gave: it must be
             * the one the allocation was imported with */
            if (r->alloc_size != i->alloc_size || r->vmm != i->vmm) {
                why_set(
                    why,
                    "register_pool.alloc_size: %llu bytes (%s), but "
                    "this allocation was imported as %llu bytes (%s)",
                    (unsigned long long)r->alloc_size, r->vmm ? "VMM" : "IPC",
                    (unsigned long long)i->alloc_size, i->vmm ? "VMM" : "IPC");
                rc = KVX_ERR_INVALID;
                goto err_close_fd;
            }
            gpu_import_req_close(r); /* already mapped: one import */
            i->refs++;
            *out = i;
            *ptr = i->base + r->offset;
            *device = i->device;
            return 0;
        }
    }
    if ((rc = use_device(d, why)))
        goto err_close_fd;
    gpu_import_t *imp = calloc(1, sizeof(*imp));
    if (!imp) {
        why_set(why, "register_pool: out of memory");
        rc = KVX_ERR_NOMEM;
        goto err_close_fd;
    }
    imp->owner = r->owner;
    imp->alloc_id = r->alloc_id;
    memcpy(imp->uuid, r->uuid, 16);
    imp->device = d;
    imp->alloc_size = r->alloc_size;
    imp->vmm = r->vmm;
    cudaSetDevice(d);
    if (!r->vmm) {
        cudaIpcMemHandle_t h;
        memcpy(&h, r->ipc_handle, sizeof(h));
        void *p = NULL;
        cudaError_t e =
            cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            why_set(why, "register_pool.ipc_handle: cudaIpcOpenMemHandle: %s",
                    cudaGetErrorString(e));
            rc = KVX_ERR_INVALID;
            goto err_free;
        }
        /* the handle maps the whole allocation: it must hold the size
         * the client gave, or the bounds above mean nothing */
        CUdeviceptr ab = 0;
        size_t asz = 0;
        if (drv.addr_range &&
            (drv.addr_range(&ab, &asz, (CUdeviceptr)(uintptr_t)p) ||
             asz < r->alloc_size)) {
            cudaIpcCloseMemHandle(p);
            why_set(why,
                    "register_pool.alloc_size: %llu bytes, but the "
                    "allocation behind ipc_handle holds %zu",
                    (unsigned long long)r->alloc_size, asz);
            rc = KVX_ERR_INVALID;
            goto err_free;
        }
        imp->base = p;
        imp->base_on[d] = p;
        imp->ipc = h;
        g.imports_legacy++;
    } else {
        if ((rc = vmm_import(r, imp, d, why)))
            goto err_free;
        g.imports_vmm++;
    }
    imp->refs = 1;
    list_unshift(&imports, &imp->node);
    *out = imp;
    *ptr = imp->base + r->offset;
    *device = d;
    log_info("gpu %d: imported %s allocation of %llu bytes (%u physical)", d,
             r->vmm ? "VMM" : "legacy IPC", (unsigned long long)r->alloc_size,
             imp->vmm ? imp->nchunks : 1);
    return 0;

err_free:
    free(imp->handles);
    free(imp->chunk);
    free(imp);
err_close_fd:
    gpu_import_req_close(r);
    return rc;
}

void gpu_import_unref(gpu_import_t *imp)
{
    if (!imp || --imp->refs)
        return;
    assert(list_linked(&imp->node));
    list_remove(&imp->node);
    cudaSetDevice(imp->device);
    if (imp->vmm) {
        vmm_unmap(imp, imp->nchunks, (CUdeviceptr)(uintptr_t)imp->base);
        free(imp->handles);
        free(imp->chunk);
    } else {
        for (int o = 0; o < g.ndev; o++)
            if (imp->base_on[o]) {
                cudaSetDevice(o);
                cudaIpcCloseMemHandle(imp->base_on[o]);
            }
    }
    log_info("gpu %d: unmapped allocation of %llu bytes", imp->device,
             (unsigned long long)imp->alloc_size);
    free(imp);
}

int gpu_import_ptr(gpu_import_t *imp, int device, uint8_t **base,
                   kvx_why_t *why)
{
    if (device == imp->device) {
        *base = imp->base;
        return 0;
    }
    if (imp->vmm) { /* one mapping; each device needs its access right */
        if (!imp->access[device]) {
            int rc = use_device(device, why);
            if (rc)
                return rc;
            CUmemAccessDesc acc = {
                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device},
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
            CUresult cr = drv.set_access((CUdeviceptr)(uintptr_t)imp->base,
                                         imp->alloc_size, &acc, 1);
            if (cr) {
                why_set(why,
                        "gpu %d cannot access a VMM pool of gpu %d "
                        "(cuMemSetAccess: CUresult %d)",
                        device, imp->device, (int)cr);
                return KVX_ERR_UNSUPPORTED;
            }
            imp->access[device] = 1;
        }
        *base = imp->base;
        return 0;
    }
    if (!imp->base_on[device]) {
        int rc = use_device(device, why);
        if (rc)
            return rc;
        /* a legacy IPC mapping is per context: open it again where the
         * kernel runs, which also enables peer access (lazily) */
        void *p = NULL;
        cudaSetDevice(device);
        cudaError_t e =
            cudaIpcOpenMemHandle(&p, imp->ipc, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            why_set(why,
                    "gpu %d: cannot map a pool of gpu %d for peer access: "
                    "%s",
                    device, imp->device, cudaGetErrorString(e));
            return KVX_ERR_UNSUPPORTED;
        }
        imp->base_on[device] = p;
    }
    *base = imp->base_on[device];
    return 0;
}

int gpu_started(void)
{
    /* a device with a context, or -1: pins go through it, so pinning
     * creates no context on a GPU without pools */
    if (g.state <= 0)
        return -1;
    for (int d = 0; d < g.ndev; d++)
        if (g.used[d])
            return d;
    return -1;
}

int gpu_host_register(void *base, uint64_t size, int device)
{
    /* called on the loop (device -1: pick one here), or on a worker with
     * the device the loop picked; the worker reads no daemon state */
    if (device < 0) {
        if (g.state <= 0 && start())
            return KVX_ERR_UNSUPPORTED;
        device = gpu_started();
    }
    if (device >= 0)
        cudaSetDevice(device);
    cudaError_t e = cudaHostRegister(
        base, size, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError(); /* pinned by the populate job already */
        return 0;
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return KVX_ERR_IO;
    }
    return 0;
}

void gpu_host_unregister(void *base)
{
    cudaHostUnregister(base);
    (void)cudaGetLastError();
}

int gpu_mem_alloc(int device, size_t len, void **p, kvx_why_t *why)
{
    int rc;
    *p = NULL;
    if (g.state <= 0 && start())
        return why_fail(why, KVX_ERR_UNSUPPORTED, "gpu: %s", g.why);
    if (device < 0 || device >= g.ndev)
        return why_fail(why, KVX_ERR_INVALID, "gpu %d: no such device", device);
    if ((rc = use_device(device, why)))
        return rc;
    cudaError_t e;
    if (!CU_OK(e = cudaSetDevice(device)) || !CU_OK(e = cudaMalloc(p, len))) {
        *p = NULL;
        (void)cudaGetLastError();
        return why_fail(why, KVX_ERR_NOMEM,
                        "gpu %d: cannot allocate %zu bytes: %s", device, len,
                        cudaGetErrorString(e));
    }
    return 0;
}

void gpu_mem_free(void *p)
{
    if (p)
        cudaFree(p);
    (void)cudaGetLastError();
}

/* Where a plan's upload goes. While kernels run on device d, on the
 * upload stream: on the kernel stream it would sit between two launches
 * (an upload there left the memory system idle 8-17 us between requests,
 * H200, docs/history/benchmarks.md), and the next launch makes the kernel
 * stream wait for it (uploaded(), gpu_launch()). On an idle device, on the
 * kernel stream, ahead of the launch: a small request's copy then waits
 * for no event between streams. Uploads and launches come from the loop
 * thread alone. */
static cudaStream_t upload_stream(int d)
{
    return __atomic_load_n(&g.inflight[d], __ATOMIC_RELAXED) ? g.ustream[d]
                                                             : g.stream[d];
}

/* After an upload queued on stream s of device d: the next launch on d
 * orders itself after it (gpu_launch()). One event serves every upload:
 * the upload stream runs them in order, so waiting for the last one
 * waits for all. */
static cudaError_t uploaded(int d, cudaStream_t s)
{
    if (s == g.stream[d]) /* the launches come after it */
        return cudaSuccess;
    cudaError_t e = cudaEventRecord(g.uploaded[d], s);
    if (e == cudaSuccess)
        g.unwaited[d] = 1;
    return e;
}

int gpu_part_create(const plan_t *p, int device, gpu_part_t **out,
                    kvx_why_t *why)
{
    int rc = KVX_ERR_NOMEM; /* or KVX_ERR_IO: a CUDA error */
    size_t cap = gpu_desc_size(p), len = 0;
    uint8_t *buf = malloc(cap);
    gpu_part_t *gp = calloc(1, sizeof(*gp));
    size_t *off_sblk = calloc(p->nslices ? p->nslices : 1, sizeof(size_t));
    if (!buf || !gp || !off_sblk) {
        why_set(why, "fetch: out of memory for the GPU plan");
        goto err_free;
    }
    gp->device = device;
    cudaError_t e;
    cudaSetDevice(device);
    cudaStream_t us = upload_stream(device);
    if (!CU_OK(e = cudaMallocAsync(&gp->dmem, cap, us))) {
        why_set(why, "fetch: GPU plan memory: %s", cudaGetErrorString(e));
        if (e != cudaErrorMemoryAllocation)
            rc = KVX_ERR_IO;
        goto err_free;
    }
    if ((rc = gpu_desc_pack(p, &(gpu_desc_buf_t){buf, cap, (uintptr_t)gp->dmem},
                            &gp->plan, off_sblk, &len, why)))
        goto err_free_dmem;
    gp->nslices = p->nslices;
    /* from pinned memory, so the upload does not synchronize the stream;
     * the kernels that read it come after it on their stream or wait for
     * it (upload_stream()), and the pinned buffer goes back once the
     * upload has run */
    gp->pin = pin_get(len ? len : 16);
    if (!gp->pin) {
        why_set(why,
                "fetch: no pinned memory for a %zu-byte GPU "
                "plan",
                len);
        rc = KVX_ERR_NOMEM;
        goto err_free_dmem;
    }
    memcpy(gp->pin->p, buf, len);
    if (!CU_OK(e = cudaMemcpyAsync(gp->dmem, gp->pin->p, len,
                                   cudaMemcpyHostToDevice, us)) ||
        !CU_OK(e = uploaded(device, us)) ||
        !CU_OK(e = waiter_enqueue(device, us, NULL, NULL, gp->pin))) {
        /* the upload may still read the buffer: leak it, do not reuse */
        why_set(why, "fetch: GPU plan upload: %s", cudaGetErrorString(e));
        rc = KVX_ERR_IO;
        goto err_free_dmem;
    }
    gp->off_sblk = off_sblk; /* gpu_part_set_blocks() writes there */
    if (strcmp(kvxd.conf.gpu_copy_path, "kernel")) {
        gp->host = p->dst.host; /* auto's rule over PCIe */
        for (uint32_t i = 0; i < p->nslices; i++)
            gp->host |= p->src[i].host;
        /* the same layout at the host buffer's own address: the walk of
         * the copy engines' runs reads it (gpu_desc_runs()) */
        size_t hlen = 0;
        if (gpu_desc_pack(p, &(gpu_desc_buf_t){buf, cap, (uintptr_t)buf},
                          &gp->hplan, off_sblk, &hlen, why) == 0)
            gp->hdesc = buf; /* else the kernel copies it */
        else
            free(buf);
    } else {
        free(buf);
    }
    *out = gp;
    return 0;

err_free_dmem:
    cudaFreeAsync(gp->dmem, us);
err_free:
    free(off_sblk);
    free(buf);
    free(gp);
    return rc;
}

int gpu_part_device(const gpu_part_t *gp)
{
    return gp->device;
}

int gpu_part_set_blocks(gpu_part_t *gp, uint32_t slice, uint32_t first,
                        const uint32_t *blocks, uint32_t n)
{
    if (!n)
        return 0;
    assert(slice < gp->nslices);
    struct pin_buf *b = pin_get((size_t)n * 4);
    if (!b)
        return KVX_ERR_NOMEM;
    memcpy(b->p, blocks, (size_t)n * 4);
    if (gp->hdesc)
        memcpy(gp->hdesc + gp->off_sblk[slice] + (size_t)first * 4, blocks,
               (size_t)n * 4);
    cudaSetDevice(gp->device);
    uint8_t *at = (uint8_t *)gp->dmem + gp->off_sblk[slice] + (size_t)first * 4;
    cudaStream_t us = upload_stream(gp->device);
    cudaError_t e =
        cudaMemcpyAsync(at, b->p, (size_t)n * 4, cudaMemcpyHostToDevice, us);
    if (e == cudaSuccess)
        e = uploaded(gp->device, us);
    if (e == cudaSuccess)
        e = waiter_enqueue(gp->device, us, NULL, NULL, b);
    if (e != cudaSuccess) { /* the copy may still read it: not reused */
        (void)cudaGetLastError();
        return KVX_ERR_IO;
    }
    return 0;
}

void gpu_part_free(gpu_part_t *gp)
{
    if (!gp)
        return;
    int d = gp->device;
    cudaSetDevice(d);
    /* on the upload stream: the kernels that read it are done, since the
     * waiter thread has seen each launch's completion before the request
     * (whose fence counts them) lets its parts go; nothing is recorded on
     * the kernel stream, which would come between two launches */
    cudaFreeAsync(gp->dmem, g.ustream[d]);
    free(gp->hdesc);
    free(gp->off_sblk);
    free(gp);
}

/* ---- clients' events (layer-wise offers) ------------------------------ */

struct gpu_event {
    uint8_t handle[64];
    int device;
    uint64_t owner; /* the client session that sent the handle; 0: gone */
    cudaEvent_t ev;
    uint32_t refs;
    uint64_t idle_since; /* refs 0: kept open, see gpu_event_unref() */
    list_t node;         /* on events, newest first */
};

static list_t events = {&events, &events}; /* loop thread only */
#define EVENT(n) LIST_OWNER(n, gpu_event_t, node)

/* An import nobody references stays open while its client is connected
 * (an engine records its few events again for every layer of every
 * request: opening the handle each time would cost a
 * cudaIpcOpenEventHandle on the loop per layer); past EVENTS_IDLE_MAX
 * idle ones the one idle longest is closed, and a client's are closed
 * when it goes (gpu_events_forget). */
#define EVENTS_IDLE_MAX 256
static uint32_t events_idle;
static uint64_t events_tick;

int gpu_event_import(const uint8_t handle[64], int device, uint64_t owner,
                     gpu_event_t **out, kvx_why_t *why)
{
    *out = NULL;
    if (g.state <= 0 || device < 0 || device >= g.ndev || !g.used[device]) {
        why_set(why, "layers_ready.cuda_event: device %d has no GPU pool here",
                device);
        return KVX_ERR_STATE;
    }
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &events)
    {
        gpu_event_t *e = EVENT(n);
        if (e->owner == owner && e->device == device &&
            !memcmp(e->handle, handle, 64)) {
            if (!e->refs++)
                events_idle--;
            *out = e;
            return 0;
        }
    }
    gpu_event_t *e = calloc(1, sizeof(*e));
    if (!e) {
        why_set(why, "layers_ready: out of memory");
        return KVX_ERR_NOMEM;
    }
    cudaIpcEventHandle_t h;
    memcpy(&h, handle, sizeof(h));
    cudaSetDevice(device);
    cudaError_t ce = cudaIpcOpenEventHandle(&e->ev, h);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        free(e);
        why_set(why,
                "layers_ready.cuda_event: cudaIpcOpenEventHandle: %s (make "
                "the event with cudaEventInterprocess | "
                "cudaEventDisableTiming on the pool's GPU and send "
                "cudaIpcGetEventHandle's 64 bytes)",
                cudaGetErrorString(ce));
        return KVX_ERR_INVALID;
    }
    memcpy(e->handle, handle, 64);
    e->device = device;
    e->owner = owner;
    e->refs = 1;
    list_unshift(&events, &e->node);
    *out = e;
    return 0;
}

static void event_close(gpu_event_t *e)
{
    list_remove(&e->node);
    cudaSetDevice(e->device);
    cudaEventDestroy(e->ev);
    free(e);
}

void gpu_event_unref(gpu_event_t *e)
{
    if (!e || --e->refs)
        return;
    if (!e->owner) { /* its client is gone */
        event_close(e);
        return;
    }
    e->idle_since = ++events_tick;
    if (++events_idle <= EVENTS_IDLE_MAX)
        return;
    gpu_event_t *old = NULL;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &events)
    {
        gpu_event_t *x = EVENT(n);
        if (!x->refs && (!old || x->idle_since < old->idle_since))
            old = x;
    }
    events_idle--;
    event_close(old);
}

void gpu_events_forget(uint64_t owner)
{
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &events)
    {
        gpu_event_t *e = EVENT(n);
        if (e->owner != owner)
            continue;
        e->owner = 0; /* never matched again; closed at its last unref */
        if (!e->refs) {
            events_idle--;
            event_close(e);
        }
    }
}

/* The watcher: one thread that polls every watched event (every
 * gpu.event_poll_us while any is watched). The loop adds
 * and removes watches and runs their callbacks; the thread only moves a
 * reached watch from pending to done and wakes the loop. */
struct gpu_watch {
    gpu_event_t *e;
    gpu_watch_cb cb;
    void *arg;
    int status, done, cancelled;
    list_t node; /* on ew.pending or ew.done */
};

static struct {
    int started, stop;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    list_t pending, done;
    int any; /* pending is not empty: read without ew.mu by the loop */
    uv_async_t async;
} ew = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

#define WATCH(n) LIST_OWNER(n, gpu_watch_t, node)

static void ew_on_async(uv_async_t *h)
{
    (void)h;
    list_t done;
    list_init(&done);
    pthread_mutex_lock(&ew.mu);
    list_move_all(&ew.done, &done);
    pthread_mutex_unlock(&ew.mu);
    while (!list_empty(&done)) {
        gpu_watch_t *w = WATCH(list_pop(&done));
        if (!w->cancelled)
            w->cb(w->arg, w->status);
        gpu_event_unref(w->e);
        free(w);
    }
}

/* Moves the reached watches of ew.pending to ew.done (ew.mu held),
 * oldest first, until `unreached` of them are found not reached (0: no
 * limit); 1 if any moved. */
static int ew_scan(unsigned unreached)
{
    int moved = 0;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &ew.pending)
    {
        gpu_watch_t *w = WATCH(n);
        cudaSetDevice(w->e->device);
        cudaError_t q = cudaEventQuery(w->e->ev);
        if (q == cudaErrorNotReady) {
            if (unreached && !--unreached)
                break;
            continue;
        }
        if (q != cudaSuccess)
            (void)cudaGetLastError();
        w->status = q == cudaSuccess ? 0 : KVX_ERR_IO;
        w->done = 1;
        list_remove(&w->node);
        list_push(&ew.done, &w->node);
        moved = 1;
    }
    __atomic_store_n(&ew.any, !list_empty(&ew.pending), __ATOMIC_RELAXED);
    return moved;
}

int gpu_events_poll(void)
{
    if (!ew.started || !__atomic_load_n(&ew.any, __ATOMIC_RELAXED))
        return 0;
    if (pthread_mutex_trylock(&ew.mu)) /* the watcher is looking */
        return 0;
    /* the oldest few: an engine's layers are reached in the order it
     * said them ready, and a query costs about a microsecond */
    int moved = ew_scan(2);
    pthread_mutex_unlock(&ew.mu);
    if (moved)
        ew_on_async(&ew.async);
    return moved;
}

static void *ew_main(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "kvx-events");
    /* sleeps of gpu.event_poll_us, not the default slack's 50 us more */
    prctl(PR_SET_TIMERSLACK, 1000UL);
    long poll_ns = (long)kvxd.conf.gpu_event_poll_us * 1000;
    pthread_mutex_lock(&ew.mu);
    while (!ew.stop) {
        if (list_empty(&ew.pending)) {
            pthread_cond_wait(&ew.cv, &ew.mu);
            continue;
        }
        int moved = ew_scan(0);
        pthread_mutex_unlock(&ew.mu);
        if (moved)
            uv_async_send(&ew.async);
        struct timespec ts = {0, poll_ns}; /* at most 1 ms */
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&ew.mu);
    }
    pthread_mutex_unlock(&ew.mu);
    return NULL;
}

gpu_watch_t *gpu_event_watch(gpu_event_t *e, gpu_watch_cb cb, void *arg)
{
    if (!ew.started) {
        list_init(&ew.pending);
        list_init(&ew.done);
        if (uv_async_init(kvxd.loop, &ew.async, ew_on_async))
            return NULL;
        if (pthread_create(&ew.th, NULL, ew_main, NULL)) {
            uv_close((uv_handle_t *)&ew.async, NULL);
            return NULL;
        }
        ew.started = 1;
    }
    gpu_watch_t *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->e = e;
    e->refs++;
    w->cb = cb;
    w->arg = arg;
    list_init(&w->node);
    pthread_mutex_lock(&ew.mu);
    list_push(&ew.pending, &w->node);
    __atomic_store_n(&ew.any, 1, __ATOMIC_RELAXED);
    pthread_cond_signal(&ew.cv);
    pthread_mutex_unlock(&ew.mu);
    return w;
}

void gpu_event_unwatch(gpu_watch_t *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&ew.mu);
    if (w->done) { /* its callback is queued: ew_on_async frees it */
        w->cancelled = 1;
        pthread_mutex_unlock(&ew.mu);
        return;
    }
    list_remove(&w->node);
    __atomic_store_n(&ew.any, !list_empty(&ew.pending), __ATOMIC_RELAXED);
    pthread_mutex_unlock(&ew.mu);
    gpu_event_unref(w->e);
    free(w);
}

/* Launch l of part gp (bytes long) on the copy engines, if it goes
 * there (gpu_dma_launch(); host: a host staging slot is one side): a
 * cudaError_t, or -1 when it goes to the kernel (nothing issued). */
static int dma_launch(const gpu_part_t *gp, const gpu_launch_t *l, int d,
                      uint64_t bytes, int host)
{
    if (!gp->hdesc) /* made under gpu.copy_path kernel */
        return -1;
    return gpu_dma_launch(&gp->hplan, l, g.stream[d], bytes, gp->host || host);
}

int gpu_launch(gpu_part_t *gp, const gpu_work_t *w, gpu_done_cb done, void *arg)
{
    int d = gp->device;
    unsigned ctas = kvxd.conf.gpu_max_ctas ? kvxd.conf.gpu_max_ctas : 64;
    cudaSetDevice(d);
    uint8_t *packed = NULL;
    int e = cudaSuccess;
    if (w->packed && w->device) {
        packed = w->packed; /* a staging slot in GPU memory */
    } else if (w->packed) {
        /* a pinned staging slot in host memory, as the GPU sees it */
        e = cudaHostGetDevicePointer((void **)&packed, w->packed, 0);
        if (e != cudaSuccess)
            packed = NULL;
    }
    if (e == cudaSuccess) {
        gpu_launch_t l = {.u0 = w->unit_begin,
                          .u1 = w->unit_end,
                          .packed = packed,
                          .packed_mode = !w->packed  ? GPU_PACKED_NONE
                                         : w->gather ? GPU_PACKED_GATHER
                                                     : GPU_PACKED_SCATTER};
        /* plans uploaded on the other stream since the last launch (this
         * part's among them): a wait, unless they have already run */
        if (g.unwaited[d] &&
            (e = cudaEventQuery(g.uploaded[d])) == cudaErrorNotReady)
            e = cudaStreamWaitEvent(g.stream[d], g.uploaded[d], 0);
        if (e == cudaSuccess) {
            g.unwaited[d] = 0;
            e = dma_launch(gp, &l, d, w->bytes, w->packed && !w->device);
            if (e == -1) /* the kernel's: scattered blocks, or a layout
                            change */
                e = gpu_kernel_launch(&gp->plan, &l, w->bytes, ctas,
                                      g.stream[d]);
        }
        if (e == cudaSuccess) /* the waiter thread counts it done */
            __atomic_add_fetch(&g.inflight[d], 1, __ATOMIC_RELAXED);
    }
    if (e == cudaSuccess &&
        waiter_enqueue(d, g.stream[d], done, arg, NULL) != cudaSuccess) {
        /* the kernel runs, but its completion cannot be queued: wait for
         * it here (rare: out of memory), so it is not in flight when the
         * job comes back */
        log_error("gpu %d: cannot queue a completion; waiting for the "
                  "kernel on the loop",
                  d);
        cudaError_t ws = cudaStreamSynchronize(g.stream[d]);
        (void)cudaGetLastError();
        __atomic_sub_fetch(&g.inflight[d], 1, __ATOMIC_RELAXED);
        g.launches++;
        done(arg, ws == cudaSuccess ? 0 : KVX_ERR_IO);
        return 0;
    }
    if (e != cudaSuccess) {
        log_error("gpu %d: launch failed: %s", d,
                  cudaGetErrorString((cudaError_t)e));
        (void)cudaGetLastError();
        return KVX_ERR_IO;
    }
    g.launches++;
    return 0;
}

void gpu_stop(void)
{
    if (g.state <= 0)
        return;
    if (ew.started) { /* the offers, and their watches, are gone */
        pthread_mutex_lock(&ew.mu);
        ew.stop = 1;
        pthread_cond_signal(&ew.cv);
        pthread_mutex_unlock(&ew.mu);
        pthread_join(ew.th, NULL);
        uv_close((uv_handle_t *)&ew.async, NULL);
        ew.started = 0;
    }
    for (int d = 0; d < g.ndev; d++)
        if (wt[d].running) {
            pthread_mutex_lock(&wt[d].mu);
            wt[d].stop = 1;
            pthread_cond_signal(&wt[d].cv);
            pthread_mutex_unlock(&wt[d].mu);
            pthread_join(wt[d].th, NULL); /* after its queue is empty */
            wt[d].running = 0;
            assert(list_empty(&wt[d].queue));
            list_t *n;
            while ((n = list_pop(&wt[d].free_items))) {
                struct done_item *it = LIST_OWNER(n, struct done_item, node);
                cudaEventDestroy(it->ev);
                free(it);
            }
        }
}

void gpu_cleanup(void)
{
    if (g.state <= 0)
        return;
    gpu_stop();
    list_t *n;
    while ((n = list_first(&events))) /* the idle ones: the offers holding
                                         any are gone */
        event_close(EVENT(n));
    for (int d = 0; d < g.ndev; d++)
        if (g.used[d]) {
            cudaSetDevice(d);
            cudaStreamSynchronize(g.stream[d]);
            cudaStreamSynchronize(g.ustream[d]);
            cudaStreamDestroy(g.stream[d]);
            cudaStreamDestroy(g.ustream[d]);
            cudaEventDestroy(g.uploaded[d]);
        }
    for (int i = 0; i < pin_nall; i++) {
        cudaFreeHost(pin_all[i]->p);
        free(pin_all[i]);
    }
    pin_nall = 0;
    for (int k = 0; k < PIN_CLASSES; k++) /* their buffers are gone */
        list_init(&pin.free[k]);
    while (!list_empty(&imports)) {
        gpu_import_t *imp =
            LIST_OWNER(list_first(&imports), gpu_import_t, node);
        imp->refs = 1;
        gpu_import_unref(imp);
    }
}
