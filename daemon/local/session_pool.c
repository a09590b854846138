/*
 * session_pool — the edge's pool requests: RegisterPool (its layout,
 * allocations and regions checked field by field, the fds that came
 * with its frame taken) and DeregisterPool. What a pool is, and how its
 * memory is imported, is copy/pool.c's; the other requests, and the
 * replies, are session.c's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "copy/pool.h"
#include "core/daemon.h"
#include "core/log.h"
#include "core/map.h"
#include "pacing.h"
#include "remote/keyed.h"
#include "session_int.h"
#include "xfer/xfer.h"

/* Answer rq with code and a message, and return. Replies go by id,
 * through session_reply(), as session_conn.c's do. */
#define FAIL(code, ...)                                                        \
    do {                                                                       \
        snprintf(why, sizeof(why), __VA_ARGS__);                               \
        session_reply(s->id, rq->id, (code), why);                             \
        return;                                                                \
    } while (0)

static int layout_from_msg(const Kvxfer__Layout *m, kvx_layout_t *l,
                           kvx_why_t *why)
{
    memset(l, 0, sizeof(*l));
    if (!m)
        return why_fail(why, KVX_ERR_INVALID, "register_pool.layout: missing");
    if (strlen(m->preset) >= sizeof(l->preset))
        return why_fail(why, KVX_ERR_INVALID,
                        "layout.preset: longer than %zu bytes",
                        sizeof(l->preset) - 1);
    for (const char *p = m->preset; *p; p++)
        if (*p < 0x21 || *p > 0x7e) { /* status shows it: no odd bytes */
            return why_fail(why, KVX_ERR_INVALID,
                            "layout.preset: byte 0x%02x at %zu is "
                            "not printable ASCII",
                            (unsigned char)*p, (size_t)(p - m->preset));
        }
    if (m->n_part_region != m->n_part_offset)
        return why_fail(
            why, KVX_ERR_LAYOUT,
            "layout.part_region: %zu entries, but layout.part_offset "
            "has %zu",
            m->n_part_region, m->n_part_offset);
    if (m->n_part_region &&
        m->n_part_region != (uint64_t)m->num_layers * m->kv_factor)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.part_region: %zu parts for num_layers %u x "
                        "kv_factor %u",
                        m->n_part_region, m->num_layers, m->kv_factor);
    if (m->n_part_region > 2 * KVX_MAX_LAYERS)
        return why_fail(why, KVX_ERR_LAYOUT,
                        "layout.part_region: %zu parts (at most %u)",
                        m->n_part_region, 2 * KVX_MAX_LAYERS);
    if (m->dtype > KVX_DTYPE_INT8)
        return why_fail(why, KVX_ERR_LAYOUT, "layout.dtype: unknown value %u",
                        m->dtype);
    strcpy(l->preset, m->preset);
    l->num_layers = m->num_layers;
    l->kv_factor = m->kv_factor;
    l->num_heads = m->num_heads;
    l->head_dim = m->head_dim;
    l->elem_size = m->elem_size;
    l->dtype = m->dtype;
    l->tokens_per_block = m->tokens_per_block;
    l->num_blocks = m->num_blocks;
    if (m->n_part_region) {
        /* the caller frees it (layout_msg_free) */
        kvx_layout_part_t *pt = malloc(m->n_part_region * sizeof(*pt));
        if (!pt)
            return why_fail(why, KVX_ERR_NOMEM,
                            "layout.part_region: out of memory");
        for (size_t i = 0; i < m->n_part_region; i++)
            pt[i] =
                (kvx_layout_part_t){m->part_region[i], 0, m->part_offset[i]};
        l->parts = pt;
        l->num_parts = (uint32_t)m->n_part_region;
    }
    l->layer_stride = m->layer_stride;
    l->kv_stride = m->kv_stride;
    l->block_stride = m->block_stride;
    l->token_stride = m->token_stride;
    l->head_stride = m->head_stride;
    l->first_head = m->first_head;
    return 0;
}

/* Free what layout_from_msg() allocated. */
static void layout_msg_free(kvx_layout_t *l)
{
    free((void *)l->parts);
    l->parts = NULL;
}

/* fds allocation a of a RegisterPool comes with: a memfd, or one per
 * physical allocation of VMM memory, none with a legacy IPC handle. */
static size_t alloc_fds(const Kvxfer__Allocation *a)
{
    if (a->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD)
        return 1;
    if (a->kind == KVXFER__POOL_KIND__POOL_GPU_VMM_FD)
        return a->n_chunk_sizes ? a->n_chunk_sizes : 1;
    return 0;
}

/* The allocations and regions of a RegisterPool, and the fds they need
 * (need expected, got taken, queued: what was left). 0, or the code with
 * why naming the field. */
static int pool_msg_check(const Kvxfer__RegisterPool *m, size_t need,
                          uint32_t got, uint32_t queued, kvx_why_t *why)
{
    if (m->n_regions > KVX_MAX_REGIONS)
        return why_fail(why, KVX_ERR_LIMIT,
                        "register_pool.regions: %zu regions (at most %u, "
                        "KVX_MAX_REGIONS)",
                        m->n_regions, KVX_MAX_REGIONS);
    if (m->n_allocations > m->n_regions || m->n_allocations == 0 ||
        m->n_regions == 0)
        return why_fail(
            why,
            m->n_allocations > KVX_MAX_REGIONS ? KVX_ERR_LIMIT
                                               : KVX_ERR_INVALID,
            "register_pool: %zu allocations for %zu regions (expected "
            "1..%u regions, each in one allocation, every allocation "
            "holding one)",
            m->n_allocations, m->n_regions, KVX_MAX_REGIONS);
    size_t fds = 0;
    for (size_t i = 0; i < m->n_allocations; i++) {
        const Kvxfer__Allocation *a = m->allocations[i];
        int vmm = a->kind == KVXFER__POOL_KIND__POOL_GPU_VMM_FD;
        uint64_t sum = 0;
        int bad = 0;
        if (a->kind > KVXFER__POOL_KIND__POOL_GPU_VMM_FD)
            return why_fail(
                why, KVX_ERR_INVALID,
                "register_pool.allocations[%zu].kind: unknown value %d", i,
                a->kind);
        if ((a->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD) !=
            (m->allocations[0]->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD))
            return why_fail(
                why, KVX_ERR_UNSUPPORTED,
                "register_pool.allocations[%zu].kind: GPU and host memory "
                "in one pool (unsupported: register them as two pools)",
                i);
        if (a->n_chunk_sizes > KVX_MAX_POOL_CHUNKS)
            return why_fail(why, KVX_ERR_LIMIT,
                            "register_pool.allocations[%zu].chunk_sizes: %zu "
                            "allocations (at most %u)",
                            i, a->n_chunk_sizes, KVX_MAX_POOL_CHUNKS);
        for (size_t k = 0; k < a->n_chunk_sizes; k++)
            bad |= !a->chunk_sizes[k] ||
                   __builtin_add_overflow(sum, a->chunk_sizes[k], &sum);
        if (a->n_chunk_sizes && !vmm)
            return why_fail(
                why, KVX_ERR_INVALID,
                "register_pool.allocations[%zu].chunk_sizes: only VMM "
                "memory spans several physical allocations",
                i);
        if (a->n_chunk_sizes && (bad || sum != a->alloc_size))
            return why_fail(
                why, KVX_ERR_INVALID,
                "register_pool.allocations[%zu].chunk_sizes: a size of 0, "
                "or sizes that do not sum to alloc_size %llu",
                i, (unsigned long long)a->alloc_size);
        if (a->kind != KVXFER__POOL_KIND__POOL_HOST_MEMFD) {
            if (a->gpu_uuid.len != 16)
                return why_fail(
                    why, KVX_ERR_INVALID,
                    "register_pool.allocations[%zu].gpu_uuid: %zu bytes "
                    "(expected 16)",
                    i, a->gpu_uuid.len);
            if (!vmm && a->ipc_handle.len != 64)
                return why_fail(
                    why, KVX_ERR_INVALID,
                    "register_pool.allocations[%zu].ipc_handle: %zu bytes "
                    "(expected 64)",
                    i, a->ipc_handle.len);
            /* one import per allocation: listed twice, it would be
             * imported as two and its regions could overlap unseen */
            for (size_t k = 0; k < i; k++)
                if (m->allocations[k]->alloc_id == a->alloc_id &&
                    m->allocations[k]->gpu_uuid.len == 16 &&
                    !memcmp(m->allocations[k]->gpu_uuid.data, a->gpu_uuid.data,
                            16))
                    return why_fail(
                        why, KVX_ERR_INVALID,
                        "register_pool.allocations[%zu]: the same "
                        "allocation as allocations[%zu] (list it once; its "
                        "regions name it)",
                        i, k);
        }
        fds += alloc_fds(a);
    }
    if (fds > KVX_MAX_POOL_CHUNKS)
        return why_fail(
            why, KVX_ERR_LIMIT,
            "register_pool.allocations: %zu fds in all (at most %u)", fds,
            KVX_MAX_POOL_CHUNKS);
    uint8_t *used = calloc(m->n_allocations, 1);
    if (!used)
        return why_fail(why, KVX_ERR_NOMEM, "register_pool: out of memory");
    for (size_t i = 0; i < m->n_regions; i++) {
        if (m->regions[i]->allocation >= m->n_allocations) {
            free(used);
            return why_fail(
                why, KVX_ERR_INVALID,
                "register_pool.regions[%zu].allocation: %u, but there are "
                "%zu allocations",
                i, m->regions[i]->allocation, m->n_allocations);
        }
        used[m->regions[i]->allocation] = 1;
    }
    for (size_t i = 0; i < m->n_allocations; i++)
        if (!used[i]) {
            free(used);
            return why_fail(
                why, KVX_ERR_INVALID,
                "register_pool.allocations[%zu]: no region lies in it", i);
        }
    free(used);
    if (got < need)
        return why_fail(
            why, KVX_ERR_INVALID,
            "register_pool: %zu fd(s) expected with the request, %u "
            "arrived (send them with SCM_RIGHTS)",
            need, queued);
    return 0;
}

void session_on_register_pool(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    const Kvxfer__RegisterPool *m = rq->register_pool;
    /* host memfd: one fd per allocation; VMM: one per physical one */
    size_t need = 0;
    for (size_t i = 0; i < m->n_allocations && need <= KVX_MAX_POOL_CHUNKS; i++)
        need += alloc_fds(m->allocations[i]);
    if (need > KVX_MAX_POOL_CHUNKS || m->n_allocations > KVX_MAX_REGIONS)
        need = 0; /* refused below; what came is closed after the frame */
    /* the fds travel with this frame: take them first so every path
     * below closes them */
    int *fds = NULL;
    uint32_t nfds = 0, mine = 0;
    int rc = 0;
    while (mine < s->nfds && s->fd_at[mine] < s->frame_end)
        mine++; /* came with this frame (earlier ones are closed) */
    if (need && mine == need) {
        fds = malloc(need * sizeof(int));
        if (!fds) {
            snprintf(why, sizeof(why), "register_pool: out of memory");
            rc = KVX_ERR_NOMEM;
        } else {
            nfds = (uint32_t)need;
            memcpy(fds, s->fds, need * sizeof(int));
            session_fds_drop(s, (uint32_t)need, 0);
        }
    }
    if (!rc && need && nfds < need && s->fds_lost &&
        s->fds_lost_at < s->frame_end) {
        /* the client sent them: the daemon could not take them */
        snprintf(why, sizeof(why),
                 "register_pool: the fd(s) sent with the request were "
                 "dropped on arrival: %s; the request itself is fine, try "
                 "again later",
                 s->fds_lost_why);
        rc = KVX_ERR_LIMIT;
    }
    if (!rc)
        rc = pool_msg_check(m, need, nfds, mine, KVX_WHY(why));
    if (!rc && s->pools.n >= kvxd.conf.max_pools) {
        snprintf(why, sizeof(why), "register_pool: %u pools (limits.max_pools)",
                 s->pools.n);
        rc = KVX_ERR_LIMIT;
    }
    kvx_layout_t l;
    memset(&l, 0, sizeof(l));
    if (!rc)
        rc = layout_from_msg(m->layout, &l, KVX_WHY(why));
    uint32_t na = (uint32_t)m->n_allocations, nr = (uint32_t)m->n_regions;
    pool_alloc_req_t *al = NULL;
    pool_region_req_t *rg = NULL;
    if (!rc) {
        al = calloc(na, sizeof(*al));
        rg = calloc(nr, sizeof(*rg));
        if (!al || !rg) {
            snprintf(why, sizeof(why), "register_pool: out of memory");
            rc = KVX_ERR_NOMEM;
        }
    }
    if (rc) {
        for (uint32_t i = 0; i < nfds; i++)
            close(fds[i]);
        free(fds);
        free(al);
        free(rg);
        layout_msg_free(&l);
        session_reply(s->id, rq->id, rc, why);
        return;
    }
    /* hand the fds on, in allocation order: pool_register() closes them */
    for (uint32_t i = 0, f = 0; i < na; i++) {
        const Kvxfer__Allocation *a = m->allocations[i];
        uint32_t k = (uint32_t)alloc_fds(a);
        if (a->kind == KVXFER__POOL_KIND__POOL_HOST_MEMFD) {
            al[i].fd = fds[f];
        } else {
            al[i].gpu = 1;
            al[i].req = (gpu_import_req_t){
                .vmm = a->kind == KVXFER__POOL_KIND__POOL_GPU_VMM_FD,
                .fds = fds + f,
                .nfds = k,
                .chunk_sizes = a->chunk_sizes,
                .alloc_id = a->alloc_id,
                .alloc_size = a->alloc_size,
                .owner = s->id};
            memcpy(al[i].req.uuid, a->gpu_uuid.data, 16);
            if (!al[i].req.vmm)
                memcpy(al[i].req.ipc_handle, a->ipc_handle.data,
                       sizeof(al[i].req.ipc_handle));
        }
        f += k;
    }
    for (uint32_t i = 0; i < nr; i++)
        rg[i] = (pool_region_req_t){m->regions[i]->allocation,
                                    m->regions[i]->offset, m->regions[i]->size};
    pool_t *p;
    rc = pool_register(&(pool_reg_t){s->id, al, na, rg, nr, &l}, &p,
                       KVX_WHY(why));
    free(fds); /* closed by pool_register, on every path */
    free(al);
    free(rg);
    layout_msg_free(&l);
    if (rc) {
        session_reply(s->id, rq->id, rc, why);
        return;
    }
    p->uid = (uint32_t)s->uid;
    /* the pages its memfds do not hold yet would be faulted in by the
     * daemon's copies and charged to the daemon's memory (a sparse
     * memfd costs its client nothing): charged to the uid now */
    uint64_t holes = pool_holes(p);
    if (holes && kvxd_mem_charge_uid(MEM_HOST, s->uid, holes)) {
        char w[200];
        kvxd_mem_why(s->uid, holes, w, sizeof(w));
        pool_release(p);
        FAIL(KVX_ERR_LIMIT,
             "register_pool: %llu bytes of the pool are not in its memory "
             "yet (holes of a sparse memfd, or pages swapped out), which "
             "the daemon would fault in; they %s (write the memory before "
             "registering it)",
             (unsigned long long)holes, w);
    }
    p->mem_host = holes;
    if (map_put(&s->pools, p->id, p)) {
        pool_release(p);
        FAIL(KVX_ERR_NOMEM, "register_pool: out of memory");
    }
    pool_populate(p);
    if (p->gpu)
        pacing_devices(s->id, session_gpu_devices(s));
    log_info("session %llu: pool %u registered: %s %s, %u blocks, %llu "
             "bytes in %u regions",
             (unsigned long long)s->id, p->id, p->gpu ? "gpu" : "host",
             p->layout.preset, p->layout.num_blocks,
             (unsigned long long)p->size, p->nregions);
    Kvxfer__RegisterPoolReply pr = KVXFER__REGISTER_POOL_REPLY__INIT;
    pr.pool_id = p->id;
    Kvxfer__Reply r = KVXFER__REPLY__INIT;
    r.id = rq->id;
    r.message = "";
    r.body_case = KVXFER__REPLY__BODY_REGISTER_POOL;
    r.register_pool = &pr;
    session_reply_msg(s->id, &r);
}

void session_on_deregister_pool(session_t *s, const Kvxfer__Request *rq)
{
    char why[512];
    uint32_t id = rq->deregister_pool->pool_id;
    pool_t *p = session_own_pool(s, id);
    if (!p)
        FAIL(KVX_ERR_NOT_FOUND,
             "deregister_pool.pool_id: no pool %u registered by this session",
             id);
    uint32_t users = xfer_pool_users(p) + keyed_pool_users(p);
    if (users)
        FAIL(KVX_ERR_BUSY,
             "deregister_pool.pool_id: pool %u is used by %u requests; "
             "cancel them first",
             id, users);
    int gpu = p->gpu;
    map_del(&s->pools, id);
    pool_release(p);
    if (gpu) /* as at its registration: a host pool changes no pace */
        pacing_devices(s->id, session_gpu_devices(s));
    session_reply(s->id, rq->id, 0, "");
}
