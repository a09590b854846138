/* pool — pools of regions: host mappings, GPU imports; see pool.h. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/layout.h"
#include "copy.h"
#include "core/daemon.h"
#include "core/log.h"
#include "core/map.h"
#include "pool.h"

static map_t pools;
static uint32_t next_id = 1;

void pool_alloc_req_close(pool_alloc_req_t *a, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        if (a[i].gpu) {
            gpu_import_req_close(&a[i].req);
        } else if (a[i].fd >= 0) {
            close(a[i].fd);
            a[i].fd = -1;
        }
    }
}

/* Regions sorted by (allocation, offset), for the overlap check. */
static const pool_region_req_t *sort_regions;

static int region_cmp(const void *a, const void *b)
{
    const pool_region_req_t *x = &sort_regions[*(const uint32_t *)a],
                            *y = &sort_regions[*(const uint32_t *)b];
    if (x->alloc != y->alloc)
        return x->alloc < y->alloc ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* A host allocation: a memfd sealed against shrinking; *size its bytes,
 * *ino its identity (two entries for one file are refused). */
static int host_alloc_check(int fd, uint32_t i, uint64_t *size,
                            uint64_t *alloced, uint64_t ino[2], kvx_why_t *why)
{
    int rc = 0;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        rc = why_fail(why, KVX_ERR_IO,
                      "register_pool.allocations[%u]: fstat: %s", i,
                      strerror(errno));
        return rc;
    }
    if (!S_ISREG(st.st_mode)) {
        rc =
            why_fail(why, KVX_ERR_INVALID,
                     "register_pool.allocations[%u]: the fd is not a memfd", i);
        return rc;
    }
    /* A client that could shrink the file would make the daemon fault on
     * its next access: insist the size is sealed. */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        rc = why_fail(
            why, KVX_ERR_INVALID,
            "register_pool.allocations[%u]: memfd lacks F_SEAL_SHRINK (a "
            "client could truncate it under the daemon)",
            i);
        return rc;
    }
    *size = (uint64_t)st.st_size;
    *alloced = (uint64_t)st.st_blocks * 512; /* tmpfs: pages it holds */
    ino[0] = (uint64_t)st.st_dev;
    ino[1] = (uint64_t)st.st_ino;
    return 0;
}

/* Validate regions against their allocations (of asize bytes) and each
 * other, then the layout against the regions. Nothing is mapped yet. */
static int regions_check(const pool_region_req_t *r, uint32_t n,
                         const uint64_t *asize, const kvx_layout_t *layout,
                         kvx_why_t *why)
{
    int rc = 0;
    uint64_t *sizes = malloc(n * sizeof(*sizes));
    uint32_t *order = malloc(n * sizeof(*order));
    if (!sizes || !order) {
        rc = why_fail(why, KVX_ERR_NOMEM, "register_pool: out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (r[i].size == 0) {
            rc = why_fail(why, KVX_ERR_INVALID,
                          "register_pool.regions[%u].size: 0", i);
            goto out;
        }
        if (r[i].offset > asize[r[i].alloc] ||
            asize[r[i].alloc] - r[i].offset < r[i].size) {
            rc = why_fail(
                why, KVX_ERR_INVALID,
                "register_pool.regions[%u]: [%llu, +%llu) runs past the "
                "%llu bytes of allocations[%u]",
                i, (unsigned long long)r[i].offset,
                (unsigned long long)r[i].size,
                (unsigned long long)asize[r[i].alloc], r[i].alloc);
            goto out;
        }
        sizes[i] = r[i].size;
        order[i] = i;
    }
    /* two regions over the same bytes would let two parts alias: the
     * layout check sees each region alone */
    sort_regions = r; /* loop thread only */
    qsort(order, n, sizeof(*order), region_cmp);
    for (uint32_t k = 1; k < n; k++) {
        const pool_region_req_t *a = &r[order[k - 1]], *b = &r[order[k]];
        if (a->alloc == b->alloc && b->offset < a->offset + a->size) {
            rc = why_fail(why, KVX_ERR_INVALID,
                          "register_pool.regions[%u]: bytes [%llu, +%llu) of "
                          "allocations[%u] overlap regions[%u]",
                          order[k], (unsigned long long)b->offset,
                          (unsigned long long)b->size, b->alloc, order[k - 1]);
            goto out;
        }
    }
    rc = kvx__layout_check(layout, sizes, n, why);
out:
    free(sizes);
    free(order);
    return rc;
}

static void pool_unmap(pool_t *p);
static uint64_t used_bytes(const pool_t *p, uint32_t i);

int pool_register(const pool_reg_t *req, pool_t **out, kvx_why_t *why)
{
    const uint64_t session_id = req->session_id;
    pool_alloc_req_t *allocs = req->allocs;
    const uint32_t nallocs = req->nallocs, nregions = req->nregions;
    const pool_region_req_t *regions = req->regions;
    const kvx_layout_t *layout = req->layout;
    int rc = 0;
    int gpu = nallocs ? allocs[0].gpu : 0;
    uint64_t *asize = calloc(nallocs ? nallocs : 1, sizeof(*asize));
    uint64_t *abytes = calloc(nallocs ? nallocs : 1, sizeof(*abytes));
    uint64_t(*ino)[2] = calloc(nallocs ? nallocs : 1, sizeof(*ino));
    pool_t *p = calloc(1, sizeof(*p));
    if (!asize || !abytes || !ino || !p) {
        rc = why_fail(why, KVX_ERR_NOMEM, "register_pool: out of memory");
        goto err_close;
    }
    assert(nallocs && nregions && nregions <= KVX_MAX_REGIONS);
    for (uint32_t i = 0; i < nallocs; i++) {
        assert(allocs[i].gpu == gpu);
        if (gpu) {
            asize[i] = allocs[i].req.alloc_size;
            continue;
        }
        if ((rc = host_alloc_check(allocs[i].fd, i, &asize[i], &abytes[i],
                                   ino[i], why)))
            goto err_close;
        for (uint32_t k = 0; k < i; k++)
            if (ino[k][0] == ino[i][0] && ino[k][1] == ino[i][1]) {
                rc = why_fail(
                    why, KVX_ERR_INVALID,
                    "register_pool.allocations[%u]: the same memfd as "
                    "allocations[%u] (list it once; its regions name it)",
                    i, k);
                goto err_close;
            }
    }
    if ((rc = regions_check(regions, nregions, asize, layout, why)))
        goto err_close;

    uint32_t P = layout->parts ? layout->num_parts : 0;
    p->regions = calloc(nregions, sizeof(*p->regions));
    p->view = calloc(nregions, sizeof(*p->view));
    p->parts = P ? malloc(P * sizeof(*p->parts)) : NULL;
    p->imports = gpu ? calloc(nallocs, sizeof(*p->imports)) : NULL;
    if (!p->regions || !p->view || (P && !p->parts) || (gpu && !p->imports)) {
        rc = why_fail(why, KVX_ERR_NOMEM, "register_pool: out of memory");
        goto err_free;
    }
    p->gpu = gpu;
    p->pin_on_populate = -1;
    for (uint32_t i = 0; i < nregions; i++) {
        p->regions[i].alloc = regions[i].alloc;
        p->regions[i].offset = regions[i].offset;
        p->regions[i].size = regions[i].size;
        p->size += regions[i].size; /* no overflow: each inside a file */
    }
    /* GPU: import each allocation once (the cache shares it with other
     * pools in it), on one device */
    for (uint32_t i = 0; gpu && i < nallocs; i++) {
        uint8_t *base;
        int dev;
        allocs[i].req.offset = 0;
        allocs[i].req.size = allocs[i].req.alloc_size;
        if ((rc = gpu_import(&allocs[i].req, &p->imports[i], &base, &dev, why)))
            goto err_unmap;
        p->nimports = i + 1;
        if (i && dev != p->device) {
            rc = why_fail(
                why, KVX_ERR_UNSUPPORTED,
                "register_pool.allocations[%u]: on gpu %d, but "
                "allocations[0] is on gpu %d (a pool lies on one device)",
                i, dev, p->device);
            goto err_unmap;
        }
        p->device = dev;
    }
    for (uint32_t i = 0; i < nregions; i++) {
        pool_region_t *r = &p->regions[i];
        if (gpu) {
            uint8_t *base;
            rc = gpu_import_ptr(p->imports[r->alloc], p->device, &base, why);
            if (rc)
                goto err_unmap;
            p->view[i] = (plan_region_t){base + r->offset, r->size};
            continue;
        }
        /* mmap maps whole pages: from the page that holds the start */
        uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE), in_page = r->offset % pg;
        r->map_len = in_page + r->size;
        r->map = mmap(NULL, r->map_len, PROT_READ | PROT_WRITE, MAP_SHARED,
                      allocs[r->alloc].fd, (off_t)(r->offset - in_page));
        if (r->map == MAP_FAILED) {
            r->map = NULL;
            log_error("pool: mmap of %llu bytes: %m",
                      (unsigned long long)r->map_len);
            rc = why_fail(
                why, KVX_ERR_NOMEM,
                "register_pool.regions[%u]: mmap of %llu bytes failed: %s", i,
                (unsigned long long)r->map_len, strerror(errno));
            goto err_unmap;
        }
        p->view[i] = (plan_region_t){r->map + in_page, r->size};
    }
    pool_alloc_req_close(allocs, nallocs); /* the mappings hold them */
    p->nregions = nregions;
    p->layout = *layout;
    if (P) {
        memcpy(p->parts, layout->parts, P * sizeof(*p->parts));
        p->layout.parts = p->parts;
    }
    p->id = next_id++;
    p->session_id = session_id;
    p->users = 1; /* the registration itself */
    if (map_put(&pools, p->id, p)) {
        rc = why_fail(why, KVX_ERR_NOMEM, "register_pool: out of memory");
        goto err_unmap;
    }
    /* holes: per memfd, what copies can touch of it, but no more than
     * the pages the file lacks (st_blocks counts those it holds, written,
     * allocated or swapped out) */
    for (uint32_t a = 0; !gpu && a < nallocs; a++) {
        uint64_t span = 0;
        for (uint32_t i = 0; i < nregions; i++)
            if (p->regions[i].alloc == a)
                span += used_bytes(p, i);
        uint64_t lack = asize[a] > abytes[a] ? asize[a] - abytes[a] : 0;
        p->holes += span < lack ? span : lack;
    }
    free(asize);
    free(abytes);
    free(ino);
    *out = p;
    return 0;

err_unmap:
    p->nregions = nregions;
    pool_unmap(p);
err_free:
    free(p->regions);
    free(p->view);
    free(p->parts);
    free(p->imports);
err_close:
    pool_alloc_req_close(allocs, nallocs);
    free(p);
    free(asize);
    free(abytes);
    free(ino);
    return rc;
}

int pool_register_host(uint64_t session_id, int fd, uint64_t offset,
                       uint64_t size, const kvx_layout_t *layout, pool_t **out,
                       kvx_why_t *why)
{
    pool_alloc_req_t a = {.fd = fd};
    pool_region_req_t r = {0, offset, size};
    return pool_register(&(pool_reg_t){session_id, &a, 1, &r, 1, layout}, out,
                         why);
}

static uint64_t used_bytes(const pool_t *p, uint32_t i);

int pool_pin(pool_t *p, kvx_why_t *why)
{
    if (p->gpu || p->pinned)
        return 0;
    uint64_t t0 = kvxd_now_ms(), bytes = 0;
    for (uint32_t i = 0; i < p->nregions; i++) {
        if (gpu_host_register(p->regions[i].map, used_bytes(p, i), -1)) {
            while (i--)
                gpu_host_unregister(p->regions[i].map);
            return why_fail(
                why, KVX_ERR_IO,
                "pool %u: cannot register host memory with CUDA for a "
                "GPU copy",
                p->id);
        }
        bytes += used_bytes(p, i);
    }
    p->pinned = 1;
    log_info("pool %u: %llu host bytes in %u regions pinned for GPU copies "
             "in %llu ms",
             p->id, (unsigned long long)bytes, p->nregions,
             (unsigned long long)(kvxd_now_ms() - t0));
    return 0;
}

int pool_device_view(pool_t *p, int device, const plan_region_t **regions,
                     kvx_why_t *why)
{
    if (!p->gpu || device == p->device) {
        *regions = p->view; /* pinned host memory: same address (UVA) */
        return 0;
    }
    if (device < 0 || device >= POOL_MAX_DEV)
        return why_fail(why, KVX_ERR_INVALID, "pool %u: no view for gpu %d",
                        p->id, device);
    if (!p->view_on[device]) {
        /* each import maps its whole allocation; a region starts inside
         * it (a tensor slice, a tensor the caching allocator placed in a
         * segment, several regions in one allocation) */
        plan_region_t *v = calloc(p->nregions, sizeof(*v));
        if (!v)
            return why_fail(why, KVX_ERR_NOMEM, "pool %u: out of memory",
                            p->id);
        for (uint32_t i = 0; i < p->nregions; i++) {
            uint8_t *alloc;
            const pool_region_t *r = &p->regions[i];
            int rc = gpu_import_ptr(p->imports[r->alloc], device, &alloc, why);
            if (rc) {
                free(v);
                return rc;
            }
            v[i] = (plan_region_t){alloc + r->offset, r->size};
        }
        p->view_on[device] = v;
    }
    *regions = p->view_on[device];
    return 0;
}

plan_mem_t pool_mem(const pool_t *p, const uint32_t *blocks, uint32_t n)
{
    return (plan_mem_t){.regions = p->view,
                        .nregions = p->nregions,
                        .layout = &p->layout,
                        .blocks = blocks,
                        .num_blocks = n,
                        .pool = p->id,
                        .host = !p->gpu};
}

/* Undo the mappings and imports (what of them exists). */
static void pool_unmap(pool_t *p)
{
    for (uint32_t i = 0; i < p->nimports; i++)
        gpu_import_unref(p->imports[i]);
    for (uint32_t i = 0; !p->gpu && p->regions && i < p->nregions; i++) {
        if (!p->regions[i].map)
            continue;
        if (p->pinned)
            gpu_host_unregister(p->regions[i].map);
        munmap(p->regions[i].map, p->regions[i].map_len);
    }
    p->nimports = 0;
    p->nregions = 0;
}

static void pool_free(pool_t *p)
{
    kvxd_mem_release_uid(MEM_HOST, p->uid, p->mem_host);
    p->mem_host = 0;
    for (int d = 0; d < POOL_MAX_DEV; d++)
        free(p->view_on[d]);
    free(p->regions);
    free(p->view);
    free(p->parts);
    free(p->imports);
    free(p);
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
    pool_free(p);
}

void pool_release(pool_t *p)
{
    if (p->released)
        return;
    p->released = 1;
    pool_unref(p);
}

/* The bytes of host region i's mapping, from its map, that copies can
 * touch: up to the layout's span in it, whole pages (a client may
 * declare a sparse memfd far larger; faulting in or pinning all of it
 * would charge the daemon for the holes). */
static uint64_t used_bytes(const pool_t *p, uint32_t i)
{
    const pool_region_t *r = &p->regions[i];
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t u = (uint64_t)(p->view[i].base - r->map) +
                 kvx_layout_region_span(&p->layout, i);
    u = (u + pg - 1) / pg * pg;
    return u < r->map_len ? u : r->map_len;
}

uint64_t pool_holes(const pool_t *p)
{
    return p->holes;
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
    pool_t *p = j->owner; /* regions, layout and pin_on_populate: set
                             before, not changed while the job runs */
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    enum { STEP = 4096 }; /* pages looked at per mincore() */
    unsigned char vec[STEP];
    for (uint32_t r = 0; r < p->nregions; r++) {
        uint8_t *map = p->regions[r].map;
        uint64_t used = used_bytes(p, r);
        for (uint64_t off = 0; off < used;) {
            uint64_t n = (used - off + pg - 1) / pg;
            if (n > STEP)
                n = STEP;
            uint64_t len = n * pg < used - off ? n * pg : used - off;
            if (mincore(map + off, len, vec)) {
                off += len; /* only an optimization */
                continue;
            }
            for (uint64_t i = 0; i < n;) {
                uint64_t k = i;
                while (k < n && (vec[k] & 1))
                    k++;
                if (k > i) {
                    uint64_t b = off + i * pg, e = off + k * pg;
                    populate_range(map + b, (e < used ? e : used) - b);
                }
                i = k + 1;
            }
            off += len;
        }
    }
    /* the result travels in the job; the loop sets p->pinned */
    if (p->pin_on_populate >= 0) {
        j->status = 0;
        for (uint32_t r = 0; r < p->nregions && !j->status; r++)
            if (gpu_host_register(p->regions[r].map, used_bytes(p, r),
                                  p->pin_on_populate)) {
                while (r--)
                    gpu_host_unregister(p->regions[r].map);
                j->status = 1;
            }
    }
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
            pool_free(all[i]);
        }
        free(all);
    }
    map_free(&pools);
}
