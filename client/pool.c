/*
 * pool — libkvxfer's pools: a layout as its message, host pools (memfds
 * the library makes or the engine gives) and GPU pools (the allocation a
 * device pointer lives in, shared as a CUDA IPC handle or VMM fds through
 * the driver the engine loaded); see kvxfer.h. reconnect.c keeps what
 * registered each pool, to register it again with a new daemon.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client.h"
#include "common/frame.h"
#include "common/list.h"
#include "common/reqkey.h"
#include "internal.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"

struct host_pool {
    uint32_t id;
    void *base;
    uint64_t size;
    list_t node; /* on kvx_client.pools */
};

#define HOST_POOL(n) LIST_OWNER(n, struct host_pool, node)

void kvx__host_pools_free(kvx_client_t *c)
{
    list_t *n;
    while ((n = list_pop(&c->pools))) {
        munmap(HOST_POOL(n)->base, HOST_POOL(n)->size);
        free(HOST_POOL(n));
    }
}

/* The Layout message of l; its part lists (malloc'd) are freed with
 * layout_msg_free(). 0, or KVX_ERR_NOMEM / KVX_ERR_INVALID. */
static int layout_to_msg(kvx_client_t *c, const kvx_layout_t *l,
                         Kvxfer__Layout *lay)
{
    kvxfer__layout__init(lay);
    lay->preset = (char *)l->preset;
    lay->num_layers = l->num_layers;
    lay->kv_factor = l->kv_factor;
    lay->num_heads = l->num_heads;
    lay->head_dim = l->head_dim;
    lay->elem_size = l->elem_size;
    lay->dtype = l->dtype;
    lay->tokens_per_block = l->tokens_per_block;
    lay->num_blocks = l->num_blocks;
    lay->layer_stride = l->layer_stride;
    lay->kv_stride = l->kv_stride;
    lay->block_stride = l->block_stride;
    lay->token_stride = l->token_stride;
    lay->head_stride = l->head_stride;
    lay->first_head = l->first_head;
    if (!l->parts)
        return 0;
    /* what the daemon checks too; here so that the copy is bounded */
    if (l->num_parts == 0 || l->num_parts > 2 * KVX_MAX_LAYERS)
        return kvx__fail(
            c, KVX_ERR_LAYOUT,
            "layout.num_parts: %u (expected num_layers x kv_factor, "
            "at most %u)",
            l->num_parts, 2 * KVX_MAX_LAYERS);
    lay->part_region = malloc(l->num_parts * sizeof(uint32_t));
    lay->part_offset = malloc(l->num_parts * sizeof(uint64_t));
    if (!lay->part_region || !lay->part_offset) {
        free(lay->part_region);
        free(lay->part_offset);
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    }
    for (uint32_t i = 0; i < l->num_parts; i++) {
        lay->part_region[i] = l->parts[i].region;
        lay->part_offset[i] = l->parts[i].offset;
    }
    lay->n_part_region = lay->n_part_offset = l->num_parts;
    return 0;
}

static void layout_msg_free(Kvxfer__Layout *lay)
{
    free(lay->part_region);
    free(lay->part_offset);
}

/* Send RegisterPool m with nfds fds and take the pool id: the engine's,
 * which outlives a daemon restart (reconnect.c keeps what registers the
 * pool again and maps the id). */
static int register_pool(kvx_client_t *c, Kvxfer__RegisterPool *m,
                         const int *fds, int nfds, int timeout_ms,
                         uint32_t *pool_id)
{
    uint32_t id;
    int rc = kvx__register_send(c, m, fds, nfds, timeout_ms, &id);
    if (rc)
        return rc;
    if ((rc = kvx__pool_keep(c, m, fds, nfds, id, pool_id))) {
        /* a pool that could not be registered again is not registered */
        char why[sizeof(c->err)];
        memcpy(why, c->err, sizeof(why));
        Kvxfer__DeregisterPool d = KVXFER__DEREGISTER_POOL__INIT;
        d.pool_id = id;
        Kvxfer__Request rq = KVXFER__REQUEST__INIT;
        rq.body_case = KVXFER__REQUEST__BODY_DEREGISTER_POOL;
        rq.deregister_pool = &d;
        kvx__call(c, &rq, -1, timeout_ms, NULL);
        memcpy(c->err, why, sizeof(why));
    }
    return rc;
}

int kvx__register_send(kvx_client_t *c, Kvxfer__RegisterPool *m, const int *fds,
                       int nfds, int timeout_ms, uint32_t *pool_id)
{
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_REGISTER_POOL;
    rq.register_pool = m;
    Kvxfer__Reply *r;
    int rc = kvx__call_fds(c, &rq, fds, nfds, timeout_ms, &r);
    if (rc)
        return rc;
    if (r->body_case != KVXFER__REPLY__BODY_REGISTER_POOL) {
        kvxfer__reply__free_unpacked(r, NULL);
        return kvx__fail(c, KVX_ERR_PROTOCOL,
                         "register_pool: reply without a "
                         "pool id");
    }
    *pool_id = r->register_pool->pool_id;
    kvxfer__reply__free_unpacked(r, NULL);
    return 0;
}

/* A RegisterPool being built: its allocations and regions (messages and
 * the arrays of pointers protobuf-c wants), the fds to send. */
struct pool_msg {
    Kvxfer__RegisterPool m;
    Kvxfer__Layout lay;
    Kvxfer__Allocation *allocs, **allocs_p;
    Kvxfer__Region *regions, **regions_p;
    int *fds;
    int nfds;
    /* GPU: per allocation, the VMM chunk sizes (malloc'd) */
    uint64_t **chunks;
    uint8_t (*uuid)[16];
    uint8_t (*ipc)[64];
};

static int pool_msg_init(kvx_client_t *c, struct pool_msg *pm,
                         const kvx_layout_t *l, uint32_t nallocs,
                         uint32_t nregions, int gpu)
{
    memset(pm, 0, sizeof(*pm));
    kvxfer__register_pool__init(&pm->m);
    int rc = layout_to_msg(c, l, &pm->lay);
    if (rc)
        return rc;
    pm->m.layout = &pm->lay;
    pm->allocs = calloc(nallocs, sizeof(*pm->allocs));
    pm->allocs_p = calloc(nallocs, sizeof(*pm->allocs_p));
    pm->regions = calloc(nregions, sizeof(*pm->regions));
    pm->regions_p = calloc(nregions, sizeof(*pm->regions_p));
    pm->fds = gpu ? NULL : calloc(nallocs, sizeof(*pm->fds));
    pm->chunks = gpu ? calloc(nallocs, sizeof(*pm->chunks)) : NULL;
    pm->uuid = gpu ? calloc(nallocs, sizeof(*pm->uuid)) : NULL;
    pm->ipc = gpu ? calloc(nallocs, sizeof(*pm->ipc)) : NULL;
    if (!pm->allocs || !pm->allocs_p || !pm->regions || !pm->regions_p ||
        (gpu ? !pm->chunks || !pm->uuid || !pm->ipc : !pm->fds))
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    for (uint32_t i = 0; i < nallocs; i++) {
        kvxfer__allocation__init(&pm->allocs[i]);
        pm->allocs_p[i] = &pm->allocs[i];
    }
    for (uint32_t i = 0; i < nregions; i++) {
        kvxfer__region__init(&pm->regions[i]);
        pm->regions_p[i] = &pm->regions[i];
    }
    pm->m.allocations = pm->allocs_p;
    pm->m.regions = pm->regions_p;
    pm->m.n_regions = nregions;
    return 0;
}

/* gpu: the fds are the library's own (exported), closed here. */
static void pool_msg_free(struct pool_msg *pm, int gpu)
{
    layout_msg_free(&pm->lay);
    if (gpu)
        for (int i = 0; i < pm->nfds; i++)
            close(pm->fds[i]);
    for (size_t i = 0; pm->chunks && i < pm->m.n_allocations; i++)
        free(pm->chunks[i]);
    free(pm->allocs);
    free(pm->allocs_p);
    free(pm->regions);
    free(pm->regions_p);
    free(pm->fds);
    free(pm->chunks);
    free(pm->uuid);
    free(pm->ipc);
}

int kvx_pool_register_host_regions(kvx_client_t *c, const kvx_layout_t *l,
                                   const kvx_host_region_t *r, uint32_t n,
                                   uint32_t *pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !r || !pool_id || !n)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    if (n > KVX_MAX_REGIONS)
        return kvx__fail(c, KVX_ERR_LIMIT,
                         "%s: %u regions (at most %u, KVX_MAX_REGIONS)",
                         __func__, n, KVX_MAX_REGIONS);
    struct pool_msg pm;
    uint64_t(*ino)[2] = calloc(n, sizeof(*ino));
    int rc = ino ? pool_msg_init(c, &pm, l, n, n, 0)
                 : kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    /* one allocation per memfd, however many regions lie in it (and
     * however many fds name it): the daemon refuses a file listed twice */
    uint32_t na = 0;
    for (uint32_t i = 0; !rc && i < n; i++) {
        struct stat st;
        if (r[i].fd < 0 || fstat(r[i].fd, &st) < 0) {
            rc = kvx__fail(c, KVX_ERR_INVALID, "regions[%u].fd: %d: %s", i,
                           r[i].fd,
                           r[i].fd < 0 ? "negative" : kvx__errno_str(errno));
            break;
        }
        uint32_t a = 0;
        while (a < na && !(ino[a][0] == (uint64_t)st.st_dev &&
                           ino[a][1] == (uint64_t)st.st_ino))
            a++;
        if (a == na) {
            ino[na][0] = (uint64_t)st.st_dev;
            ino[na][1] = (uint64_t)st.st_ino;
            pm.allocs[na].kind = KVXFER__POOL_KIND__POOL_HOST_MEMFD;
            pm.fds[na++] = r[i].fd;
        }
        pm.regions[i].allocation = a;
        pm.regions[i].offset = r[i].offset;
        pm.regions[i].size = r[i].size;
    }
    if (!rc) {
        pm.m.n_allocations = na;
        rc = register_pool(c, &pm.m, pm.fds, (int)na, timeout_ms, pool_id);
    }
    if (ino)
        pool_msg_free(&pm, 0);
    free(ino);
    return rc;
}

int kvx_pool_register_host(kvx_client_t *c, const kvx_layout_t *l, int fd,
                           uint64_t offset, uint64_t size, uint32_t *pool_id,
                           int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || fd < 0 || !pool_id || !size)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL, negative or 0",
                         __func__);
    kvx_host_region_t r = {fd, offset, size};
    return kvx_pool_register_host_regions(c, l, &r, 1, pool_id, timeout_ms);
}

int kvx_pool_create_host(kvx_client_t *c, const kvx_layout_t *l, uint64_t size,
                         void **base, uint32_t *pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !base || !pool_id || !size)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    struct host_pool *hp = calloc(1, sizeof(*hp));
    if (!hp)
        return kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    int rc;
    int fd = memfd_create("kvxfer-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        rc =
            kvx__fail(c, KVX_ERR_IO, "memfd_create: %s", kvx__errno_str(errno));
        goto err_free;
    }
    if (ftruncate(fd, (off_t)size) < 0) {
        rc = kvx__fail(c, KVX_ERR_NOMEM, "ftruncate %llu: %s",
                       (unsigned long long)size, kvx__errno_str(errno));
        goto err_close_fd;
    }
    /* its pages allocated here, charged to this process: the daemon
     * charges a pool's holes to its budget (its copies would fault them
     * in, charged to the daemon) */
    if (fallocate(fd, 0, 0, (off_t)size) < 0) {
        rc = kvx__fail(c, KVX_ERR_NOMEM, "fallocate %llu: %s",
                       (unsigned long long)size, kvx__errno_str(errno));
        goto err_close_fd;
    }
    /* sealed size: the daemon refuses a pool that could shrink under it */
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
        rc = kvx__fail(c, KVX_ERR_IO, "F_ADD_SEALS: %s", kvx__errno_str(errno));
        goto err_close_fd;
    }
    hp->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (hp->base == MAP_FAILED) {
        rc = kvx__fail(c, KVX_ERR_NOMEM, "mmap %llu: %s",
                       (unsigned long long)size, kvx__errno_str(errno));
        goto err_close_fd;
    }
    hp->size = size;
    kvx_host_region_t r = {fd, 0, size};
    if ((rc = kvx_pool_register_host_regions(c, l, &r, 1, &hp->id, timeout_ms)))
        goto err_unmap;
    close(fd);
    list_unshift(&c->pools, &hp->node);
    *base = hp->base;
    *pool_id = hp->id;
    return 0;

err_unmap:
    munmap(hp->base, size);
err_close_fd:
    close(fd);
err_free:
    free(hp);
    return rc;
}

int kvx_pool_deregister(kvx_client_t *c, uint32_t pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    Kvxfer__DeregisterPool m = KVXFER__DEREGISTER_POOL__INIT;
    m.pool_id = kvx__pool_daemon(c, pool_id);
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.body_case = KVXFER__REQUEST__BODY_DEREGISTER_POOL;
    rq.deregister_pool = &m;
    int rc = kvx__call(c, &rq, -1, timeout_ms, NULL);
    /* with the daemon gone no daemon holds it: forgotten, done */
    if (rc && !(rc == KVX_ERR_CLOSED && c->rv.gone))
        return rc;
    kvx__pool_forget(c, pool_id);
    c->err[0] = 0;
    list_t *n, *t;
    LIST_FOREACH_SAFE(n, t, &c->pools)
    {
        struct host_pool *hp = HOST_POOL(n);
        if (hp->id == pool_id) {
            list_remove(&hp->node);
            munmap(hp->base, hp->size);
            free(hp);
            break;
        }
    }
    return 0;
}

/* ---- GPU pools ----------------------------------------------------------
 * The library finds the allocation a device pointer lives in and shares it
 * with the daemon, through the CUDA driver the engine already loaded. It
 * opens libcuda.so.1 with dlopen, so host-only users never need CUDA. The
 * few driver types are declared here (ABI-stable since CUDA 11). */

typedef int cu_result;
typedef unsigned long long cu_ptr;
typedef unsigned long long cu_handle;
typedef struct {
    uint8_t b[16];
} cu_uuid;
typedef struct {
    uint8_t b[64];
} cu_ipc_handle;
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1

static struct {
    int loaded;
    cu_result (*ptr_attr)(void *, int, cu_ptr);
    cu_result (*dev_get)(int *, int);
    cu_result (*dev_uuid)(cu_uuid *, int);
    cu_result (*addr_range)(cu_ptr *, size_t *, cu_ptr);
    cu_result (*retain)(cu_handle *, void *);
    cu_result (*export_fd)(void *, cu_handle, int, unsigned long long);
    cu_result (*release)(cu_handle);
    cu_result (*ipc_get)(cu_ipc_handle *, cu_ptr);
} cu;

/* Once per process, whatever thread asks first (clients of several
 * threads may register GPU pools at once). */
static void cu_load_once(void);
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static int cu_load(void)
{
    pthread_once(&cu_once, cu_load_once);
    return cu.loaded > 0 ? 0 : -1;
}

static void cu_load_once(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        cu.loaded = -1;
        return;
    }
    cu.ptr_attr =
        (cu_result(*)(void *, int, cu_ptr))dlsym(h, "cuPointerGetAttribute");
    cu.dev_get = (cu_result(*)(int *, int))dlsym(h, "cuDeviceGet");
    cu.dev_uuid = (cu_result(*)(cu_uuid *, int))dlsym(h, "cuDeviceGetUuid_v2");
    if (!cu.dev_uuid)
        cu.dev_uuid = (cu_result(*)(cu_uuid *, int))dlsym(h, "cuDeviceGetUuid");
    cu.addr_range = (cu_result(*)(cu_ptr *, size_t *, cu_ptr))dlsym(
        h, "cuMemGetAddressRange_v2");
    cu.retain = (cu_result(*)(cu_handle *, void *))dlsym(
        h, "cuMemRetainAllocationHandle");
    cu.export_fd =
        (cu_result(*)(void *, cu_handle, int, unsigned long long))dlsym(
            h, "cuMemExportToShareableHandle");
    cu.release = (cu_result(*)(cu_handle))dlsym(h, "cuMemRelease");
    cu.ipc_get =
        (cu_result(*)(cu_ipc_handle *, cu_ptr))dlsym(h, "cuIpcGetMemHandle");
    cu.loaded =
        cu.ptr_attr && cu.dev_get && cu.dev_uuid && cu.addr_range && cu.ipc_get
            ? 1
            : -1;
}

/* Export the VMM allocations that cover [base, base + need): the one at
 * base (asize bytes) and those mapped right after it, as PyTorch's
 * expandable segments map theirs. *fds and *sizes (malloc'd, *n each)
 * in address order; on failure nothing is left open. */
static int vmm_export(kvx_client_t *c, cu_ptr base, size_t asize, uint64_t need,
                      int **fds, uint64_t **sizes, int *n)
{
    int *f = NULL, k = 0, cap = 0, rc = 0;
    uint64_t *sz = NULL, covered = 0;
    cu_ptr at = base;
    size_t len = asize;
    while (covered < need) {
        if (k == (int)KVX_MAX_POOL_CHUNKS) {
            rc = kvx__fail(c, KVX_ERR_LIMIT,
                           "GPU pool: spans more than %u VMM allocations",
                           KVX_MAX_POOL_CHUNKS);
            goto err_close;
        }
        if (k) { /* the next allocation must be mapped right here */
            cu_ptr b = 0;
            cu_result r = cu.addr_range(&b, &len, at);
            if (r || b != at) {
                rc = kvx__fail(c, KVX_ERR_INVALID,
                               "GPU pool: needs %llu bytes mapped from %p, but "
                               "the mapping ends at %p, %llu bytes in (nothing "
                               "mapped there)",
                               (unsigned long long)need,
                               (void *)(uintptr_t)base, (void *)(uintptr_t)at,
                               (unsigned long long)covered);
                goto err_close;
            }
        }
        if (k == cap) {
            cap = cap ? cap * 2 : 4;
            int *nf = realloc(f, (size_t)cap * sizeof(*f));
            if (nf)
                f = nf;
            uint64_t *ns = nf ? realloc(sz, (size_t)cap * sizeof(*sz)) : NULL;
            if (ns)
                sz = ns;
            if (!nf || !ns) {
                rc = kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
                goto err_close;
            }
        }
        cu_handle h;
        cu_result r = cu.retain(&h, (void *)(uintptr_t)at);
        if (r) {
            rc = kvx__fail(
                c, KVX_ERR_INVALID,
                "GPU pool: the memory at %p, %llu bytes in, is not VMM "
                "memory like the rest (CUresult %d)",
                (void *)(uintptr_t)at, (unsigned long long)covered, r);
            goto err_close;
        }
        int fd = -1;
        r = cu.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        cu.release(h);
        if (r || fd < 0) {
            struct rlimit rl = {0};
            getrlimit(RLIMIT_NOFILE, &rl);
            rc = kvx__fail(
                c, KVX_ERR_UNSUPPORTED,
                "GPU pool: exporting VMM allocation %d as a POSIX fd "
                "failed (CUresult %d): it must be created with "
                "requestedHandleTypes POSIX_FILE_DESCRIPTOR, and this "
                "process needs one open fd per allocation (%d so far, "
                "ulimit -n %llu)",
                k, r, k, (unsigned long long)rl.rlim_cur);
            goto err_close;
        }
        fcntl(fd, F_SETFD, FD_CLOEXEC); /* not into a child another thread
                                           execs */
        f[k] = fd;
        sz[k] = len;
        k++;
        covered += len;
        at += len;
    }
    *fds = f;
    *sizes = sz;
    *n = k;
    return 0;

err_close:
    for (int i = 0; i < k; i++)
        close(f[i]);
    free(f);
    free(sz);
    return rc;
}

int kvx_pool_register_gpu_regions(kvx_client_t *c, const kvx_layout_t *l,
                                  const kvx_gpu_region_t *r, uint32_t n,
                                  uint32_t *pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !r || !pool_id || !n)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    if (n > KVX_MAX_REGIONS)
        return kvx__fail(c, KVX_ERR_LIMIT,
                         "%s: %u regions (at most %u, KVX_MAX_REGIONS)",
                         __func__, n, KVX_MAX_REGIONS);
    for (uint32_t i = 0; i < n; i++)
        if (!r[i].dev_ptr || !r[i].size)
            return kvx__fail(c, KVX_ERR_INVALID,
                             "regions[%u]: dev_ptr NULL or size 0", i);
    if (cu_load())
        return kvx__fail(c, KVX_ERR_UNSUPPORTED,
                         "GPU pool: cannot load libcuda.so.1 (no CUDA driver)");
    struct pool_msg pm;
    /* per allocation: its base, size and the end of the furthest region
     * in it (what must be exported of VMM memory) */
    struct {
        cu_ptr base;
        size_t asize;
        uint64_t need;
    } *al = calloc(n, sizeof(*al));
    int rc = al ? pool_msg_init(c, &pm, l, n, n, 1)
                : kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
    uint32_t na = 0;
    for (uint32_t i = 0; !rc && i < n; i++) {
        cu_ptr p = (cu_ptr)(uintptr_t)r[i].dev_ptr, base = 0;
        size_t asize = 0;
        int ordinal = -1, dev;
        cu_uuid uuid;
        cu_result e;
        if ((e = cu.ptr_attr(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                             p)) ||
            (e = cu.dev_get(&dev, ordinal)) || (e = cu.dev_uuid(&uuid, dev))) {
            rc = kvx__fail(
                c, KVX_ERR_INVALID,
                "GPU pool: regions[%u]: %p is not device memory of this "
                "process (CUresult %d)",
                i, r[i].dev_ptr, e);
            break;
        }
        if ((e = cu.addr_range(&base, &asize, p))) {
            rc = kvx__fail(c, KVX_ERR_INVALID,
                           "GPU pool: regions[%u]: cuMemGetAddressRange failed "
                           "(CUresult %d)",
                           i, e);
            break;
        }
        if (p < base || p - base > asize) {
            rc = kvx__fail(
                c, KVX_ERR_INVALID,
                "GPU pool: regions[%u]: %p lies outside the allocation "
                "the driver names for it",
                i, r[i].dev_ptr);
            break;
        }
        if (i && memcmp(uuid.b, pm.uuid[0], 16)) {
            rc = kvx__fail(c, KVX_ERR_UNSUPPORTED,
                           "GPU pool: regions[%u] is on another GPU than "
                           "regions[0] (a pool lies on one device)",
                           i);
            break;
        }
        /* one allocation however many regions lie in it: shared once */
        uint32_t a = 0;
        while (a < na && al[a].base != base)
            a++;
        if (a == na) {
            al[na].base = base;
            al[na].asize = asize;
            memcpy(pm.uuid[na], uuid.b, 16);
            na++;
        }
        uint64_t end = p - base + r[i].size;
        if (end > al[a].need)
            al[a].need = end;
        pm.regions[i].allocation = a;
        pm.regions[i].offset = p - base;
        pm.regions[i].size = r[i].size;
    }
    for (uint32_t a = 0; !rc && a < na; a++) {
        Kvxfer__Allocation *m = &pm.allocs[a];
        m->gpu_uuid.data = pm.uuid[a];
        m->gpu_uuid.len = 16;
        m->alloc_id = al[a].base;
        cu_handle h;
        /* VMM memory (cuMemCreate: PyTorch expandable segments, newer
         * TensorRT-LLM pools) has an allocation handle; cudaMalloc
         * memory does not and goes by the legacy IPC handle */
        if (cu.retain && cu.export_fd && cu.release &&
            cu.retain(&h, (void *)(uintptr_t)al[a].base) == 0) {
            cu.release(h);
            int *f = NULL, k = 0;
            uint64_t *sizes = NULL;
            if ((rc = vmm_export(c, al[a].base, al[a].asize, al[a].need, &f,
                                 &sizes, &k)))
                break;
            int *nf = realloc(pm.fds, (size_t)(pm.nfds + k) * sizeof(int));
            if (!nf) {
                for (int i = 0; i < k; i++)
                    close(f[i]);
                free(f);
                free(sizes);
                rc = kvx__fail(c, KVX_ERR_NOMEM, "out of memory");
                break;
            }
            pm.fds = nf;
            memcpy(pm.fds + pm.nfds, f, (size_t)k * sizeof(int));
            pm.nfds += k;
            free(f);
            pm.chunks[a] = sizes;
            m->kind = KVXFER__POOL_KIND__POOL_GPU_VMM_FD;
            for (int i = 0; i < k; i++)
                m->alloc_size += sizes[i];
            if (k > 1) { /* one allocation: the field stays empty */
                m->n_chunk_sizes = (size_t)k;
                m->chunk_sizes = sizes;
            }
        } else {
            if (al[a].need > al[a].asize) {
                rc = kvx__fail(c, KVX_ERR_INVALID,
                               "GPU pool: a region ends %llu bytes into an "
                               "allocation of %zu bytes (cudaMalloc memory: a "
                               "region lies inside one allocation)",
                               (unsigned long long)al[a].need, al[a].asize);
                break;
            }
            cu_result e;
            if ((e = cu.ipc_get((cu_ipc_handle *)pm.ipc[a], al[a].base))) {
                rc = kvx__fail(
                    c, KVX_ERR_UNSUPPORTED,
                    "GPU pool: cuIpcGetMemHandle failed (CUresult %d)", e);
                break;
            }
            m->kind = KVXFER__POOL_KIND__POOL_GPU_IPC;
            m->alloc_size = al[a].asize;
            m->ipc_handle.data = pm.ipc[a];
            m->ipc_handle.len = 64;
        }
    }
    if (!rc) {
        pm.m.n_allocations = na;
        rc = register_pool(c, &pm.m, pm.fds, pm.nfds, timeout_ms, pool_id);
    }
    if (al) {
        pm.m.n_allocations = na;
        pool_msg_free(&pm, 1);
    }
    free(al);
    return rc;
}

int kvx_pool_register_gpu(kvx_client_t *c, const kvx_layout_t *l, void *dev_ptr,
                          uint64_t size, uint32_t *pool_id, int timeout_ms)
{
    if (!c)
        return KVX_ERR_INVALID;
    if (!l || !dev_ptr || !size || !pool_id)
        return kvx__fail(c, KVX_ERR_INVALID,
                         "%s: a required argument is NULL or 0", __func__);
    kvx_gpu_region_t r = {dev_ptr, size};
    return kvx_pool_register_gpu_regions(c, l, &r, 1, pool_id, timeout_ms);
}
