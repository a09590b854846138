/* pool — host pool mappings; see pool.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "copy.h"
#include "daemon.h"
#include "layout.h"
#include "log.h"
#include "map.h"
#include "pool.h"

static map_t pools;
static uint32_t next_id = 1;

#define WHY(code, ...)                                                      \
    do {                                                                    \
        snprintf(why, why_len, __VA_ARGS__);                                \
        rc = (code);                                                        \
    } while (0)

int pool_register_host(uint64_t session_id, int fd, uint64_t offset,
                       uint64_t size, const kvx_layout_t *layout, pool_t **out,
                       char *why, size_t why_len)
{
    int rc = 0;
    struct stat st;
    if (size == 0) {
        WHY(KVX_ERR_INVALID, "register_pool.size: 0");
        goto err_close_fd;
    }
    if (fstat(fd, &st) < 0) {
        WHY(KVX_ERR_IO, "register_pool: fstat: %s", strerror(errno));
        goto err_close_fd;
    }
    if (!S_ISREG(st.st_mode)) {
        WHY(KVX_ERR_INVALID, "register_pool: the fd is not a memfd");
        goto err_close_fd;
    }
    /* A client that could shrink the file would make the daemon fault on
     * its next access: insist the size is sealed. */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        WHY(KVX_ERR_INVALID,
            "register_pool: memfd lacks F_SEAL_SHRINK (a client could "
            "truncate it under the daemon)");
        goto err_close_fd;
    }
    if (offset > (uint64_t)st.st_size || (uint64_t)st.st_size - offset < size) {
        WHY(KVX_ERR_INVALID,
            "register_pool.size: [%llu, +%llu) runs past the memfd's %llu "
            "bytes",
            (unsigned long long)offset, (unsigned long long)size,
            (unsigned long long)st.st_size);
        goto err_close_fd;
    }
    if ((rc = kvx__layout_check(layout, size, why, why_len)))
        goto err_close_fd;

    pool_t *p = calloc(1, sizeof(*p));
    if (!p) {
        WHY(KVX_ERR_NOMEM, "register_pool: out of memory");
        goto err_close_fd;
    }
    /* mmap maps whole pages: from the page that holds the pool's start */
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE), in_page = offset % pg;
    p->map_len = in_page + size;
    p->map = mmap(NULL, p->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                  (off_t)(offset - in_page));
    if (p->map == MAP_FAILED) {
        log_error("pool: mmap of %llu bytes: %m",
                  (unsigned long long)p->map_len);
        WHY(KVX_ERR_NOMEM, "register_pool: mmap of %llu bytes failed: %s",
            (unsigned long long)p->map_len, strerror(errno));
        goto err_free_pool;
    }
    p->base = p->map + in_page;
    p->offset = offset;
    p->id = next_id++;
    p->session_id = session_id;
    p->size = size;
    p->layout = *layout;
    p->pin_on_populate = -1;
    p->users = 1; /* the registration itself */
    if (map_put(&pools, p->id, p)) {
        WHY(KVX_ERR_NOMEM, "register_pool: out of memory");
        goto err_unmap;
    }
    close(fd);
    *out = p;
    return 0;

err_unmap:
    munmap(p->map, p->map_len);
err_free_pool:
    free(p);
err_close_fd:
    close(fd);
    return rc;
}

int pool_register_gpu(uint64_t session_id, gpu_import_req_t *req,
                      const kvx_layout_t *layout, pool_t **out, char *why,
                      size_t why_len)
{
    int rc;
    if (req->size == 0) {
        gpu_import_req_close(req);
        snprintf(why, why_len, "register_pool.size: 0");
        return KVX_ERR_INVALID;
    }
    if ((rc = kvx__layout_check(layout, req->size, why, why_len))) {
        gpu_import_req_close(req);
        return rc;
    }
    pool_t *p = calloc(1, sizeof(*p));
    if (!p) {
        gpu_import_req_close(req);
        snprintf(why, why_len, "register_pool: out of memory");
        return KVX_ERR_NOMEM;
    }
    if ((rc = gpu_import(req, &p->import, &p->base, &p->device, why,
                         why_len)))
        goto err_free;
    p->gpu = 1;
    p->offset = req->offset;
    p->id = next_id++;
    p->session_id = session_id;
    p->size = req->size;
    p->layout = *layout;
    p->users = 1;
    if (map_put(&pools, p->id, p)) {
        snprintf(why, why_len, "register_pool: out of memory");
        rc = KVX_ERR_NOMEM;
        goto err_unimport;
    }
    *out = p;
    return 0;

err_unimport:
    gpu_import_unref(p->import);
err_free:
    free(p);
    return rc;
}

static uint64_t used_bytes(const pool_t *p);

int pool_pin(pool_t *p, char *why, size_t why_len)
{
    if (p->gpu || p->pinned)
        return 0;
    uint64_t t0 = kvxd_now_ms();
    if (gpu_host_register(p->map, used_bytes(p), -1)) {
        snprintf(why, why_len,
                 "pool %u: cannot register host memory with CUDA for a "
                 "GPU copy",
                 p->id);
        return KVX_ERR_IO;
    }
    p->pinned = 1;
    log_info("pool %u: %llu host bytes pinned for GPU copies in %llu ms",
             p->id, (unsigned long long)used_bytes(p),
             (unsigned long long)(kvxd_now_ms() - t0));
    return 0;
}

int pool_device_base(pool_t *p, int device, uint8_t **base, char *why,
                     size_t why_len)
{
    if (!p->gpu) {
        *base = p->base; /* pinned host memory: same address (UVA) */
        return 0;
    }
    /* the import maps the whole allocation; the pool starts inside it
     * (a tensor slice, a tensor the caching allocator placed in a
     * segment, several pools in one allocation) */
    uint8_t *alloc;
    int rc = gpu_import_ptr(p->import, device, &alloc, why, why_len);
    if (rc)
        return rc;
    *base = alloc + p->offset;
    return 0;
}

plan_mem_t pool_mem(const pool_t *p, const uint32_t *blocks, uint32_t n)
{
    return (plan_mem_t){.base = p->base,
                        .layout = &p->layout,
                        .blocks = blocks,
                        .num_blocks = n,
                        .size = p->size,
                        .pool = p->id};
}

static void pool_unmap(pool_t *p)
{
    if (p->gpu) {
        gpu_import_unref(p->import);
        return;
    }
    if (p->pinned)
        gpu_host_unregister(p->map);
    munmap(p->map, p->map_len);
}

pool_t *pool_find(uint32_t id)
{
    pool_t *p = map_get(&pools, id);
    return p && !p->released ? p : NULL;
}

void pool_ref(pool_t *p) { p->users++; }

void pool_unref(pool_t *p)
{
    if (--p->users)
        return;
    map_del(&pools, p->id);
    pool_unmap(p);
    log_debug("pool %u unmapped", p->id);
    free(p);
}

void pool_release(pool_t *p)
{
    if (p->released)
        return;
    p->released = 1;
    pool_unref(p);
}

/* The bytes of a host pool's mapping, from p->map, that copies can
 * touch: up to its layout's span, whole pages (a client may declare a
 * sparse memfd far larger; faulting in or pinning all of it would charge
 * the daemon for the holes). */
static uint64_t used_bytes(const pool_t *p)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t u = (uint64_t)(p->base - p->map) + kvx_layout_span(&p->layout);
    u = (u + pg - 1) / pg * pg;
    return u < p->map_len ? u : p->map_len;
}

/* Map the pages of [a, a + len) in, so the first transfer does not take
 * a page fault per 4 KiB; they exist already (resident in the memfd). */
static void populate_range(uint8_t *a, uint64_t len)
{
#ifdef MADV_POPULATE_WRITE
    if (madvise(a, len, MADV_POPULATE_WRITE) == 0)
        return;
#endif
    /* older kernels: touch one byte per page (reading keeps data) */
    long pg = sysconf(_SC_PAGESIZE);
    for (uint64_t off = 0; off < len; off += (uint64_t)pg)
        (void)*(volatile uint8_t *)(a + off);
}

/* Worker thread: map in the pages of the used part that the client's
 * memfd already holds (mincore), never its holes: a page the daemon
 * faults in first is charged to the daemon's memory cgroup, so a sparse
 * pool (a client may declare far more than it touches) would make the
 * daemon pay for memory nobody uses. Holes are faulted in by the
 * transfers that write them, and only those. Blocking work, never on the
 * loop. */
static void populate_run(copy_job_t *j)
{
    pool_t *p = j->owner; /* base, size and pin_on_populate: set before */
    uint64_t used = used_bytes(p);
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    enum { STEP = 4096 }; /* pages looked at per mincore() */
    unsigned char vec[STEP];
    for (uint64_t off = 0; off < used;) {
        uint64_t n = (used - off + pg - 1) / pg;
        if (n > STEP)
            n = STEP;
        uint64_t len = n * pg < used - off ? n * pg : used - off;
        if (mincore(p->map + off, len, vec)) {
            off += len; /* only an optimization */
            continue;
        }
        for (uint64_t i = 0; i < n;) {
            uint64_t k = i;
            while (k < n && (vec[k] & 1))
                k++;
            if (k > i) {
                uint64_t b = off + i * pg, e = off + k * pg;
                populate_range(p->map + b, (e < used ? e : used) - b);
            }
            i = k + 1;
        }
        off += len;
    }
    /* the result travels in the job; the loop sets p->pinned */
    if (p->pin_on_populate >= 0)
        j->status = gpu_host_register(p->map, used, p->pin_on_populate) ? 1 : 0;
}

static void populate_done(copy_job_t *j)
{
    pool_t *p = j->owner;
    if (p->pin_on_populate >= 0 && j->status == 0)
        p->pinned = 1;
    p->populating = 0;
    pool_unref(p);
    free(j);
}

void pool_populate(pool_t *p)
{
    if (p->gpu)
        return;
    copy_job_t *j = calloc(1, sizeof(*j));
    if (!j)
        return; /* only an optimization */
    j->run = populate_run;
    j->done = populate_done;
    j->owner = p;
    /* with GPUs in use, pin here too, off the loop: a mixed GPU/host copy
     * would otherwise pin on the loop thread at its first use */
    p->pin_on_populate = gpu_started();
    pool_ref(p); /* the mapping outlives the job */
    p->populating = 1;
    copy_submit(j);
}

uint32_t pool_list(pool_t **out, uint32_t max)
{
    return map_values(&pools, (void **)out, max);
}

uint32_t pool_count(void) { return pools.n; }

void pool_cleanup(void)
{
    uint32_t n = pools.n;
    pool_t **all = calloc(n ? n : 1, sizeof(*all));
    if (all) {
        n = map_values(&pools, (void **)all, n);
        for (uint32_t i = 0; i < n; i++) {
            pool_unmap(all[i]);
            free(all[i]);
        }
        free(all);
    }
    map_free(&pools);
}
