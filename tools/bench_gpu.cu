/*
 * bench_gpu — what kvxfer-bench and the GPU tests need on the GPU, as an
 * engine would have it: allocations (cudaMalloc, or cuMemCreate VMM memory
 * exportable as a POSIX fd), the reference pattern written and checked by
 * kernels (so 100,000-block pools need no host round trip), and the
 * baselines: cudaMemcpyPeer, and pinned host <-> device copies for the
 * host-staged path between daemons.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
#include <string.h>

#include "bench_gpu.h"
#include "bench_pattern.h"

struct lay {
    const uint64_t *part; /* each (layer, kv) part's device address */
    const uint32_t *ids;  /* the request's pool blocks; NULL: block0 on */
    uint64_t block_stride, token_stride, head_stride;
    uint32_t layers, kv, heads, tpb, rowbytes;
    /* the rows: bgpu_rows_t's, and whether to check or write them */
    uint64_t r;
    uint32_t block0, nblocks, head0, layer0, tok_from, tok_to;
    int check;
};

static int set_err(char *err, size_t len, const char *what, cudaError_t e)
{
    snprintf(err, len, "%s: %s", what, cudaGetErrorString(e));
    return -1;
}

extern "C" int bgpu_device_count(void)
{
    int fd[2], n = 0;
    if (pipe(fd))
        return 0;
    pid_t p = fork();
    if (p == 0) {
        int k = 0;
        if (cudaGetDeviceCount(&k) != cudaSuccess)
            k = 0;
        (void)!write(fd[1], &k, sizeof(k));
        _exit(0);
    }
    close(fd[1]);
    if (p < 0 || read(fd[0], &n, sizeof(n)) != (ssize_t)sizeof(n))
        n = 0;
    close(fd[0]);
    if (p > 0)
        waitpid(p, NULL, 0);
    return n;
}

extern "C" int bgpu_alloc(int dev, uint64_t size, int vmm, uint64_t chunk,
                          void **ptr, char *err, size_t len)
{
    cudaError_t e;
    if ((e = cudaSetDevice(dev)) != cudaSuccess)
        return set_err(err, len, "cudaSetDevice", e);
    if (!vmm) {
        if ((e = cudaMalloc(ptr, size)) != cudaSuccess)
            return set_err(err, len, "cudaMalloc", e);
        return 0;
    }
    typedef CUresult (*create_t)(CUmemGenericAllocationHandle *, size_t,
                                 const CUmemAllocationProp *,
                                 unsigned long long);
    typedef CUresult (*gran_t)(size_t *, const CUmemAllocationProp *,
                               CUmemAllocationGranularity_flags);
    typedef CUresult (*reserve_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                  unsigned long long);
    typedef CUresult (*map_t)(CUdeviceptr, size_t, size_t,
                              CUmemGenericAllocationHandle,
                              unsigned long long);
    typedef CUresult (*access_t)(CUdeviceptr, size_t, const CUmemAccessDesc *,
                                 size_t);
    create_t create;
    gran_t gran;
    reserve_t reserve;
    map_t map;
    access_t access;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemCreate", (void **)&create,
                                         12000, cudaEnableDefault, &q) ||
        cudaGetDriverEntryPointByVersion(
            "cuMemGetAllocationGranularity", (void **)&gran, 12000,
            cudaEnableDefault, &q) ||
        cudaGetDriverEntryPointByVersion("cuMemAddressReserve",
                                         (void **)&reserve, 12000,
                                         cudaEnableDefault, &q) ||
        cudaGetDriverEntryPointByVersion("cuMemMap", (void **)&map, 12000,
                                         cudaEnableDefault, &q) ||
        cudaGetDriverEntryPointByVersion("cuMemSetAccess", (void **)&access,
                                         12000, cudaEnableDefault, &q)) {
        snprintf(err, len, "VMM entry points unavailable");
        return -1;
    }
    cudaFree(0); /* make the primary context current */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t g = 0;
    gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    /* one physical allocation, or (chunk > 0) several of chunk bytes
     * mapped back to back in one reserved range, as PyTorch's
     * expandable segments map theirs */
    size_t one = chunk ? (chunk + g - 1) / g * g : (size + g - 1) / g * g;
    size_t n = (size + one - 1) / one, sz = n * one;
    CUdeviceptr va;
    CUresult r;
    if ((r = reserve(&va, sz, 0, 0, 0))) {
        snprintf(err, len, "reserving %zu bytes: CUresult %d", sz, (int)r);
        return -1;
    }
    for (size_t k = 0; k < n; k++) {
        CUmemGenericAllocationHandle h;
        if ((r = create(&h, one, &prop, 0)) ||
            (r = map(va + k * one, one, 0, h, 0))) {
            snprintf(err, len,
                     "VMM allocation %zu of %zu (%zu bytes): "
                     "CUresult %d",
                     k, n, one, (int)r);
            return -1;
        }
    }
    CUmemAccessDesc a;
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = dev;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = access(va, sz, &a, 1))) {
        snprintf(err, len, "cuMemSetAccess: CUresult %d", (int)r);
        return -1;
    }
    *ptr = (void *)va;
    return 0;
}

extern "C" int bgpu_memset(int dev, void *p, int v, uint64_t n)
{
    cudaSetDevice(dev);
    return cudaMemset(p, v, n) == cudaSuccess && cudaDeviceSynchronize() ==
                                                     cudaSuccess
               ? 0
               : -1;
}

extern "C" int bgpu_copy_to_host(int dev, void *dst, const void *src,
                                 uint64_t n)
{
    cudaSetDevice(dev);
    return cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost) == cudaSuccess
               ? 0
               : -1;
}

/* One thread per row of (block, layer, kv, token, head). */
__global__ void pat_kernel(struct lay L, unsigned long long *bad)
{
    uint64_t rows = (uint64_t)L.nblocks * L.layers * L.kv * L.tpb * L.heads;
    unsigned long long mine = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
         i < rows; i += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t h = i % L.heads;
        uint64_t x = i / L.heads;
        uint32_t t = x % L.tpb;
        x /= L.tpb;
        uint32_t kv = x % L.kv;
        x /= L.kv;
        uint32_t l = x % L.layers;
        uint32_t b = (uint32_t)(x / L.layers);
        uint32_t gt = b * L.tpb + t;
        if (gt < L.tok_from || gt >= L.tok_to)
            continue;
        uint32_t blk = L.ids ? L.ids[b] : L.block0 + b;
        uint8_t *row = (uint8_t *)(uintptr_t)L.part[l * L.kv + kv] +
                       (uint64_t)blk * L.block_stride + t * L.token_stride +
                       h * L.head_stride;
        uint64_t seed = pat_seed(L.r, L.layer0 + l, kv, gt, L.head0 + h);
        if (!L.check) {
            if ((L.rowbytes & 7) == 0 && ((uintptr_t)row & 7) == 0)
                for (uint32_t k = 0; k < L.rowbytes; k += 8)
                    *(uint64_t *)(row + k) = pat_word(seed, k);
            else
                for (uint32_t k = 0; k < L.rowbytes; k++)
                    row[k] = pat_byte(seed, k);
        } else {
            int ok = 1;
            if ((L.rowbytes & 7) == 0 && ((uintptr_t)row & 7) == 0) {
                for (uint32_t k = 0; k < L.rowbytes; k += 8)
                    ok &= *(const uint64_t *)(row + k) == pat_word(seed, k);
            } else {
                for (uint32_t k = 0; k < L.rowbytes; k++)
                    ok &= row[k] == pat_byte(seed, k);
            }
            mine += !ok;
        }
    }
    if (mine)
        atomicAdd(bad, mine);
}

/* Write (check 0) or check the rows; *bad: the mismatched ones. */
static int run_pattern(const bgpu_rows_t *rows, int check, uint64_t *bad)
{
    const kvx_layout_t *l = rows->layout;
    cudaSetDevice(rows->dev);
    struct lay L;
    uint64_t *lo;
    uint32_t *dids = NULL;
    unsigned long long *dbad;
    size_t np = (size_t)l->num_layers * l->kv_factor;
    uint64_t *hp = (uint64_t *)malloc(np * 8);
    if (!hp)
        return -1;
    for (uint32_t a = 0; a < l->num_layers; a++)
        for (uint32_t k = 0; k < l->kv_factor; k++)
            hp[a * l->kv_factor + k] =
                (uintptr_t)rows->regions[kvx_layout_region(l, a, k)] +
                kvx_layout_offset(l, a, k, 0, 0, 0);
    if (cudaMalloc(&lo, np * 8) || cudaMalloc(&dbad, sizeof(*dbad))) {
        free(hp);
        return -1;
    }
    cudaMemcpy(lo, hp, np * 8, cudaMemcpyHostToDevice);
    free(hp);
    size_t idlen = (size_t)rows->nblocks * sizeof(uint32_t);
    if (rows->ids &&
        (cudaMalloc(&dids, idlen) ||
         cudaMemcpy(dids, rows->ids, idlen, cudaMemcpyHostToDevice))) {
        cudaFree(lo);
        cudaFree(dbad);
        return -1;
    }
    cudaMemset(dbad, 0, sizeof(*dbad));
    L.part = lo;
    L.ids = dids;
    L.block_stride = l->block_stride;
    L.token_stride = l->token_stride;
    L.head_stride = l->head_stride;
    L.layers = l->num_layers;
    L.kv = l->kv_factor;
    L.heads = l->num_heads;
    L.tpb = l->tokens_per_block;
    L.rowbytes = l->head_dim * l->elem_size;
    L.r = rows->request;
    L.block0 = rows->ids ? 0 : rows->block0;
    L.nblocks = rows->nblocks;
    L.head0 = rows->head0;
    L.layer0 = rows->layer0;
    L.tok_from = check ? rows->tok_from : 0;
    L.tok_to = check ? rows->tok_to : UINT32_MAX;
    L.check = check;
    pat_kernel<<<1024, 256>>>(L, dbad);
    unsigned long long hb = 0;
    cudaError_t e = cudaMemcpy(&hb, dbad, sizeof(hb), cudaMemcpyDeviceToHost);
    cudaFree(lo);
    cudaFree(dids);
    cudaFree(dbad);
    if (bad)
        *bad = hb;
    return e == cudaSuccess ? 0 : -1;
}

extern "C" int bgpu_fill(const bgpu_rows_t *rows)
{
    return run_pattern(rows, 0, NULL);
}

extern "C" int64_t bgpu_check(const bgpu_rows_t *rows)
{
    uint64_t bad = 0;
    if (run_pattern(rows, 1, &bad))
        return -1;
    return (int64_t)bad;
}

extern "C" double bgpu_peer_gbps(int src, int dst, uint64_t bytes)
{
    uint64_t len = bytes < (8ull << 30) ? bytes : (8ull << 30);
    void *a, *b;
    cudaSetDevice(src);
    if (cudaMalloc(&a, len))
        return 0;
    cudaSetDevice(dst);
    if (cudaMalloc(&b, len))
        return 0;
    if (src != dst) {
        cudaDeviceEnablePeerAccess(src, 0);
        cudaGetLastError();
    }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpyPeer(b, dst, a, src, len); /* warm up */
    cudaDeviceSynchronize();
    cudaEventRecord(e0, 0);
    for (uint64_t done = 0; done < bytes;) {
        uint64_t n = bytes - done < len ? bytes - done : len;
        cudaMemcpyPeerAsync(b, dst, a, src, n, 0);
        done += n;
    }
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaFree(b);
    cudaSetDevice(src);
    cudaFree(a);
    return ms > 0 ? (double)bytes / (ms * 1e-3) / 1e9 : 0;
}

/* Time cudaMemcpyAsync of bytes between host (pinned, len bytes) and a
 * fresh device buffer of len bytes, one warm-up copy first. */
static double host_copy(int dev, void *host, uint64_t len, uint64_t bytes,
                        int to_dev)
{
    void *d;
    if (cudaSetDevice(dev) || cudaMalloc(&d, len))
        return -1;
    cudaMemcpyKind kind = to_dev ? cudaMemcpyHostToDevice
                                 : cudaMemcpyDeviceToHost;
    void *dst = to_dev ? d : host;
    const void *src = to_dev ? host : d;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaError_t e = cudaMemcpy(dst, src, len, kind);
    cudaEventRecord(e0, 0);
    for (uint64_t done = 0; e == cudaSuccess && done < bytes;) {
        uint64_t n = bytes - done < len ? bytes - done : len;
        e = cudaMemcpyAsync(dst, src, n, kind, 0);
        done += n;
    }
    cudaEventRecord(e1, 0);
    if (e == cudaSuccess)
        e = cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(d);
    if (e != cudaSuccess || ms <= 0)
        return -1;
    return (double)bytes / (ms * 1e-3) / 1e9;
}

extern "C" int bgpu_host_gbps(int d2h_dev, int h2d_dev, uint64_t bytes,
                              double *d2h, double *h2d)
{
    /* past a few tens of MiB the rate no longer depends on the size;
     * 1 GiB keeps the pinning short */
    uint64_t len = bytes < (1ull << 30) ? bytes : (1ull << 30);
    void *host;
    *d2h = *h2d = 0;
    if (cudaSetDevice(d2h_dev >= 0 ? d2h_dev : h2d_dev) ||
        cudaHostAlloc(&host, len, cudaHostAllocPortable))
        return -1;
    memset(host, 1, len);
    int rc = 0;
    if (d2h_dev >= 0 && (*d2h = host_copy(d2h_dev, host, len, bytes, 0)) < 0)
        rc = -1;
    if (h2d_dev >= 0 && (*h2d = host_copy(h2d_dev, host, len, bytes, 1)) < 0)
        rc = -1;
    cudaFreeHost(host);
    return rc;
}

/* ---- kvxfer-bench --layerwise --------------------------------------- */

extern "C" int bgpu_stream(int dev, void **stream)
{
    cudaSetDevice(dev);
    return cudaStreamCreateWithFlags((cudaStream_t *)stream,
                                     cudaStreamNonBlocking) == cudaSuccess
               ? 0
               : -1;
}

extern "C" int bgpu_ipc_events(int dev, uint32_t n, void **events,
                               uint8_t *handles)
{
    cudaSetDevice(dev);
    for (uint32_t i = 0; i < n; i++) {
        cudaEvent_t e;
        cudaIpcEventHandle_t h;
        if (cudaEventCreateWithFlags(&e, cudaEventInterprocess |
                                             cudaEventDisableTiming) !=
                cudaSuccess ||
            cudaIpcGetEventHandle(&h, e) != cudaSuccess)
            return -1;
        events[i] = e;
        memcpy(handles + 64 * (size_t)i, &h, 64);
    }
    return 0;
}

/* One CTA that reads the global timer until ns have passed: a layer of
 * a prefill, as far as the copy engine can tell. */
__global__ void spin_kernel(uint64_t ns)
{
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

extern "C" int bgpu_spin(int dev, void *stream, uint64_t ns)
{
    cudaSetDevice(dev);
    spin_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(ns);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

extern "C" int bgpu_record(void *event, void *stream)
{
    return cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream) ==
                   cudaSuccess
               ? 0
               : -1;
}

extern "C" int bgpu_event_wait(void *event)
{
    /* spin on the host: a blocking wait would add its wake-up to the
     * moment the last layer is known to be done */
    cudaError_t e;
    while ((e = cudaEventQuery((cudaEvent_t)event)) == cudaErrorNotReady)
        ;
    return e == cudaSuccess ? 0 : -1;
}
