/*
 * bench_rank — the rank processes: each connects, joins its instance and
 * registers its pool as an engine's rank would; context ranks fill their
 * blocks and publish, generation ranks fetch with up to --window requests
 * outstanding and check what landed. The parent plays the router
 * (context params travel through the shared params slots) and drives the
 * ranks through warm-up, the timed passes and their exit.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#ifdef KVX_CUDA
#include "bench_gpu.h"
#endif

static uint32_t my_pair; /* which instance pair this rank process is in */

/* --regions: register the rank's pool as o.regions regions, each its own
 * allocation as an engine's per-layer tensors are: a region per layer
 * (o.regions = the rank's layers) or a K and a V region per layer (twice
 * that), memfds mapped one by one, or GPU allocations one by one. */
static kvx_client_t *rank_open_regions(kvx_client_t *c, rank_view_t *v,
                                       uint32_t layers, int on_gpu, int ctx)
{
    uint32_t per = o.regions == layers ? 1 : 2;
    (void)ctx; /* which GPU: a CUDA build's */
    if (o.regions != layers && (o.regions != 2 * layers || kvf != 2))
        die("--regions %u: a rank holds %u layers; give %u (a region per "
            "layer)%s",
            o.regions, layers, layers,
            kvf == 2 ? " or twice that (a K and a V region per layer)" : "");
    if (kvx_layout_split(&v->layout, per, v->parts, 2 * KVX_MAX_LAYERS))
        die("--regions: the layout cannot be split");
    v->nregions = o.regions;
    kvx_host_region_t *hr = calloc(o.regions, sizeof(*hr));
    kvx_gpu_region_t *gr = calloc(o.regions, sizeof(*gr));
    if (!hr || !gr)
        die("out of memory");
    for (uint32_t i = 0; i < o.regions; i++) {
        uint64_t n = v->rsize[i] = kvx_layout_region_span(&v->layout, i);
        if (on_gpu) {
#ifdef KVX_CUDA
            char err[256];
            void *p;
            v->device = ctx ? o.ctx_device : o.gen_device;
            if (bgpu_alloc(v->device, n, o.vmm, o.vmm_chunk, &p, err,
                           sizeof(err)))
                die("GPU %d: %s", v->device, err);
            if (bgpu_memset(v->device, p, 0, n))
                die("GPU %d: memset failed", v->device);
            v->rbase[i] = p;
            gr[i] = (kvx_gpu_region_t){p, n};
#endif
            continue;
        }
        int fd = memfd_create("kvxfer-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, (off_t)n) < 0 ||
            fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
            die("memfd of %llu bytes: %s", (unsigned long long)n,
                strerror(errno));
        v->rbase[i] = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (v->rbase[i] == MAP_FAILED)
            die("mmap of %llu bytes: %s", (unsigned long long)n,
                strerror(errno));
        memset(v->rbase[i], 0, n); /* fault the pages in before timing */
        hr[i] = (kvx_host_region_t){fd, 0, n};
    }
    v->base = v->rbase[0];
    if (on_gpu)
        CHECK_KVX(kvx_pool_register_gpu_regions(c, &v->layout, gr, o.regions,
                                                &v->pool, TIMEOUT_MS),
                  c);
    else
        CHECK_KVX(kvx_pool_register_host_regions(c, &v->layout, hr, o.regions,
                                                 &v->pool, TIMEOUT_MS),
                  c);
    for (uint32_t i = 0; !on_gpu && i < o.regions; i++)
        close(hr[i].fd);
    free(hr);
    free(gr);
    return c;
}

/* Connect rank `rank` of instance inst and join it; rank 0 of the first
 * pair leaves its daemon's address in the shared memory. */
static kvx_client_t *rank_connect(const char *inst, kvx_role_t role,
                                  uint32_t rank)
{
    int ctx = role == KVX_ROLE_CONTEXT;
    uint32_t tp = ctx ? o.ctx_ranks : o.gen_ranks;
    uint32_t pp = ctx ? o.ctx_pp : o.gen_pp;
    uint32_t nranks = tp * pp;
    kvx_hello_t h = {.instance_id = inst,
                     .role = role,
                     .rank = rank,
                     .parallel = {.tp = tp,
                                  .pp = pp,
                                  .cp = 1,
                                  .total_layers = o.layers,
                                  .total_kv_heads = o.heads}};
    kvx_client_t *c;
    const char *sock = ctx ? o.socket : o.gen_socket;
    int rc = kvx_connect(sock, &h, TIMEOUT_MS, &c);
    if (rc)
        die("connect %s rank %u to %s: %s", inst, rank, sock,
            kvx_status_str(rc));
    char addr[192];
    CHECK_KVX(kvx_daemon_address(c, addr, sizeof(addr)), c);
    if (rank == 0 && my_pair == 0)
        snprintf(ctx ? sh->address : sh->gen_address, sizeof(sh->address), "%s",
                 addr);
    /* engines allgather the addresses; here all ranks of an instance are
     * on one daemon (with --daemons 2, each side on its own) */
    const char **addrs = calloc(nranks, sizeof(char *));
    for (uint32_t i = 0; i < nranks; i++)
        addrs[i] = addr;
    CHECK_KVX(kvx_join(c, addrs, nranks, TIMEOUT_MS), c);
    free(addrs);
    return c;
}

/* The pool as one allocation: a GPU one, a memfd of the bench's own with
 * guard bands (--pool-offset), or one the daemon creates. */
static void rank_open_pool(kvx_client_t *c, rank_view_t *v, int on_gpu, int ctx)
{
    uint64_t size = kvx_layout_span(&v->layout);
    void *ptr;
    uint64_t off = o.pool_offset, tail = o.guard ? GUARD_TAIL : 0;
    v->alloc = NULL;
    v->alloc_len = off + size + tail;
    if (on_gpu) {
#ifdef KVX_CUDA
        char err[256];
        v->device = ctx ? o.ctx_device : o.gen_device;
        void *alloc;
        if (bgpu_alloc(v->device, v->alloc_len, o.vmm, o.vmm_chunk, &alloc, err,
                       sizeof(err)))
            die("GPU %d: %s", v->device, err);
        ptr = (uint8_t *)alloc + off;
        if ((o.guard && (bgpu_memset(v->device, alloc, GUARD_BYTE, off) ||
                         bgpu_memset(v->device, (uint8_t *)ptr + size,
                                     GUARD_BYTE, tail))) ||
            bgpu_memset(v->device, ptr, 0, size))
            die("GPU %d: memset failed", v->device);
        CHECK_KVX(kvx_pool_register_gpu(c, &v->layout, ptr, size, &v->pool,
                                        TIMEOUT_MS),
                  c);
        v->base = ptr;
        v->rbase[0] = v->base;
        v->rsize[0] = size;
        v->alloc = alloc;
        return;
#endif
    }
    (void)ctx;
    if (o.guard) { /* a pool inside a larger memfd of the bench's own */
        int fd = memfd_create("kvxfer-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, (off_t)v->alloc_len) < 0 ||
            fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
            die("memfd of %llu bytes: %s", (unsigned long long)v->alloc_len,
                strerror(errno));
        v->alloc =
            mmap(NULL, v->alloc_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (v->alloc == MAP_FAILED)
            die("mmap of %llu bytes: %s", (unsigned long long)v->alloc_len,
                strerror(errno));
        memset(v->alloc, GUARD_BYTE, v->alloc_len);
        v->base = v->alloc + off;
        v->rbase[0] = v->base;
        v->rsize[0] = size;
        memset(v->base, 0, size);
        CHECK_KVX(kvx_pool_register_host(c, &v->layout, fd, off, size, &v->pool,
                                         TIMEOUT_MS),
                  c);
        close(fd);
        return;
    }
    CHECK_KVX(
        kvx_pool_create_host(c, &v->layout, size, &ptr, &v->pool, TIMEOUT_MS),
        c);
    v->base = ptr;
    v->rbase[0] = v->base;
    v->rsize[0] = size;
    memset(v->base, 0, size); /* fault the pages in before timing */
}

/* Connect rank `rank` (pp_rank * tp + tp_rank) of one side, join, and
 * register its pool (its id in v->pool): its share of layers (PP) and
 * heads (TP; replicated when tp > heads) in the side's layout. */
kvx_client_t *rank_open(const char *inst, kvx_role_t role, uint32_t rank,
                        rank_view_t *v)
{
    int ctx = role == KVX_ROLE_CONTEXT;
    uint32_t tp = ctx ? o.ctx_ranks : o.gen_ranks;
    uint32_t pp = ctx ? o.ctx_pp : o.gen_pp;
    uint32_t tpb = ctx ? o.ctx_tpb : o.gen_tpb;
    kvx_client_t *c = rank_connect(inst, role, rank);
    uint32_t tpr = rank % tp, ppr = rank / tp;
    uint32_t heads = o.heads >= tp ? o.heads / tp : 1;
    v->head0 = o.heads >= tp ? tpr * heads : tpr / (tp / o.heads);
    uint32_t base = o.layers / pp, rem = o.layers % pp;
    uint32_t layers = base + (ppr < rem);
    v->layer0 = ppr * base + (ppr < rem ? ppr : rem);
    v->bpr = (num_tokens + tpb - 1) / tpb;
    uint32_t nblocks = reqs_in_pool * v->bpr;
    v->perm = o.shuffle ? shuffled_blocks(nblocks, ctx ? 1 : 2) : NULL;
    const char *preset = ctx ? o.ctx_layout : o.gen_layout;
    if (kvx_layout_preset(preset, layers, kvf, heads, o.head_dim, o.dtype, tpb,
                          nblocks, &v->layout))
        die("layout preset '%s' rejects these dimensions", preset);
    v->device = -1;
    int on_gpu = o.gpu && !(ctx ? o.ctx_host : o.gen_host);
    v->nregions = 1;
    if (o.regions)
        return rank_open_regions(c, v, layers, on_gpu, ctx);
    rank_open_pool(c, v, on_gpu, ctx);
    return c;
}

static void barrier(_Atomic uint32_t *ready, _Atomic uint32_t *go)
{
    atomic_fetch_add(ready, 1);
    while (!atomic_load(go) && !atomic_load(&sh->failed))
        usleep(100);
    if (atomic_load(&sh->failed)) /* another rank failed: stop too */
        exit(1);
}

/* Request r's key on each side: its digits (the uint64_t calls), or
 * with --keyed/--by-key/--reserve vLLM-like strings. */
static size_t ctx_key(uint64_t r, char *k, size_t n)
{
    return (size_t)snprintf(k, n, "cmpl-%llu-0", (unsigned long long)r);
}

static size_t gen_key(uint64_t r, char *k, size_t n)
{
    return (size_t)snprintf(k, n, "decode-%llu", (unsigned long long)r);
}

/* The key a side names request r by: with --keyed its own (ctx_key,
 * gen_key), else r's digits, as kvx_publish and kvx_fetch make it. */
static size_t req_key(int ctx_side, uint64_t r, char *k, size_t n)
{
    if (o.keyed)
        return ctx_side ? ctx_key(r, k, n) : gen_key(r, k, n);
    return (size_t)snprintf(k, n, "%llu", (unsigned long long)r);
}

/* Slot of request r: its params, for the generation ranks (rank 0). */
static void params_to_slot(uint64_t r, const kvx_context_params_t *p)
{
    if (p->len > PARAMS_SLOT - 8)
        die("context params of %zu bytes", p->len);
    uint8_t *s = slot_of(r);
    memcpy(s + 8, p->data, p->len);
    ((uint32_t *)s)[1] = (uint32_t)p->len;
    atomic_store_explicit((_Atomic uint32_t *)s, 1, memory_order_release);
}

/* The request an event names: the digits after its key's first '-'. */
static uint64_t event_req(const kvx_event_t *e)
{
    if (!o.keyed)
        return e->request_id;
    uint64_t r = 0;
    uint32_t i = 0;
    while (i < e->key_len && e->key[i] != '-')
        i++;
    for (i++; i < e->key_len && e->key[i] >= '0' && e->key[i] <= '9'; i++)
        r = r * 10 + (uint64_t)(e->key[i] - '0');
    return r;
}

/* A rank process: its connection, its pool and its rank in its side. */
typedef struct rank {
    kvx_client_t *c;
    rank_view_t v;
    uint32_t rank;
} rank_t;

/* One run of a rank over requests [first, first + count): the warm-up,
 * or a timed pass. Request first + k's blocks are reused by request
 * first + k + reqs_in_pool, which may start once fin[k] is set. */
typedef struct run {
    uint64_t first, count;
    uint8_t *fin; /* request's offer complete (context), fetched (gen) */
    int fill;     /* context: write each request's bytes before its publish */
    /* generation */
    int timed;           /* a timed pass: latencies, first and last times */
    int check, sample;   /* check every byte, or sampled() rows */
    uint32_t window;     /* requests outstanding at most */
    uint64_t next, done; /* fetches made, completions seen */
    uint64_t *t0;        /* each request's fetch call, monotonic ns */
    uint64_t bad;        /* mismatched rows */
    uint64_t *checked;   /* requests checked in full */
} run_t;

/* ---- context ranks -------------------------------------------------- */

static kvx_client_t *sched; /* --reserve: context rank 0's scheduler */

/* --batch: publish the requests from first + published on that may go
 * now (their blocks free), up to the run's end and KVX_MANY_MAX, in one
 * kvx_publish_many; returns how many. */
static uint64_t ctx_publish_many(rank_t *k, const run_t *run,
                                 uint64_t published)
{
    static kvx_publish_item_t it[KVX_MANY_MAX];
    static char keys[KVX_MANY_MAX][24];
    static uint32_t *bt;
    rank_view_t *v = &k->v;
    uint64_t r0 = run->first + published, left = run->count - published;
    if (!bt && !(bt = malloc((size_t)KVX_MANY_MAX * v->bpr * 4)))
        die("out of memory");
    size_t n = 0;
    while (n < KVX_MANY_MAX && n < left) {
        uint64_t r = r0 + n, i = r - run->first;
        if (i >= reqs_in_pool && !run->fin[i - reqs_in_pool])
            break;
        if (run->fill)
            fill_request(v, r);
        uint32_t *b = bt + n * v->bpr;
        for (uint32_t j = 0; j < v->bpr; j++)
            b[j] = req_block(v, r, j);
        memset(&it[n], 0, sizeof(it[n]));
        it[n].key_len = req_key(1, r, keys[n], sizeof(keys[n]));
        it[n].key = keys[n];
        it[n].pool_id = v->pool;
        it[n].blocks = b;
        it[n].num_blocks = v->bpr;
        it[n].num_tokens = num_tokens;
        n++;
    }
    CHECK_KVX(kvx_publish_many(k->c, it, n, TIMEOUT_MS), k->c);
    for (size_t i = 0; i < n; i++) {
        if (k->rank == 0)
            params_to_slot(r0 + i, &it[i].params);
        kvx_context_params_free(&it[i].params);
    }
    return n;
}

/* Publish request r (its blocks in bt); rank 0 leaves its params in the
 * request's slot, or with --reserve the scheduler's, reserved first. */
static void ctx_publish_one(rank_t *k, uint64_t r, uint32_t *bt)
{
    kvx_client_t *c = k->c;
    rank_view_t *v = &k->v;
    for (uint32_t i = 0; i < v->bpr; i++)
        bt[i] = req_block(v, r, i);
    kvx_context_params_t p, rp = {0};
    char key[64];
    size_t kl = ctx_key(r, key, sizeof(key));
    if (o.reserve && k->rank == 0) {
        /* the scheduler's params, before the publish: the
         * generation side may fetch with them at once */
        char inst[32];
        snprintf(inst, sizeof(inst), "bench-ctx-%u", my_pair);
        CHECK_KVX(
            kvx_reserve(sched, inst, key, kl, num_tokens, &rp, TIMEOUT_MS),
            sched);
        params_to_slot(r, &rp);
    }
    if (o.keyed)
        CHECK_KVX(kvx_publish_key(c, key, kl, v->pool, bt, v->bpr, num_tokens,
                                  NULL, 0, &p, TIMEOUT_MS),
                  c);
    else
        CHECK_KVX(
            kvx_publish(c, r, v->pool, bt, v->bpr, num_tokens, &p, TIMEOUT_MS),
            c);
    if (rp.data) { /* the same bytes as the reservation's */
        if (rp.len != p.len || memcmp(rp.data, p.data, p.len))
            die("request %llu: the publish's params differ from the "
                "reservation's",
                (unsigned long long)r);
        kvx_context_params_free(&rp);
    } else if (k->rank == 0) {
        params_to_slot(r, &p);
    }
    kvx_context_params_free(&p);
}

/* Context rank: publish requests [first, first + count), keeping at most
 * reqs_in_pool offers open, until all are consumed; fill: write each
 * request's bytes before its publish. */
static void ctx_run(rank_t *k, uint64_t first, uint64_t count, int fill)
{
    uint32_t *bt = malloc(k->v.bpr * sizeof(uint32_t));
    run_t run = {.first = first, .count = count, .fill = fill};
    run.fin = calloc(count, 1); /* request's offer complete */
    uint64_t published = 0, done = 0;
    /* every request is published, even one already complete: with
     * replicated heads a consumer may take an offer before this rank
     * publishes its part, which then only closes the offer */
    while (done < count || published < count) {
        /* blocks are reused every reqs_in_pool requests: publish k only
         * once k - reqs_in_pool is complete (they complete in any order) */
        if (published < count &&
            (published < reqs_in_pool || run.fin[published - reqs_in_pool])) {
            if (o.batch) {
                published += ctx_publish_many(k, &run, published);
                continue;
            }
            if (fill)
                fill_request(&k->v, first + published);
            ctx_publish_one(k, first + published, bt);
            published++;
            continue;
        }
        kvx_batch_t *b;
        CHECK_KVX(kvx_poll(k->c, 1, 1000, &b), k->c);
        for (uint32_t i = 0; i < b->num_events; i++) {
            if (b->events[i].kind != KVX_EVENT_COMPLETE)
                die("context request %llu: %s",
                    (unsigned long long)b->events[i].request_id,
                    b->events[i].message);
            run.fin[event_req(&b->events[i]) - first] = 1;
            done++;
        }
        kvx_batch_free(b);
    }
    free(run.fin);
    free(bt);
}

static void ctx_main(uint32_t rank)
{
    rank_t k = {.rank = rank};
    char name[32];
    snprintf(name, sizeof(name), "bench-ctx-%u", my_pair);
    k.c = rank_open(name, KVX_ROLE_CONTEXT, rank, &k.v);
    if (o.reserve && rank == 0 &&
        kvx_connect_observer(o.socket, TIMEOUT_MS, &sched))
        die("--reserve: the scheduler cannot connect: %s",
            kvx_last_error(NULL));
    uint64_t per = o.requests / o.pairs, first = my_pair * per;
    uint64_t warm = WARM_BASE + my_pair * reqs_in_pool;
    int reuse = reqs_in_pool < per;
    barrier(&sh->ready, &sh->go);
    if (!o.no_warmup)
        ctx_run(&k, warm, reqs_in_pool, 0);
    if ((!reuse || sampled()) && !o.no_verify)
        for (uint64_t r = first; r < first + (reuse ? reqs_in_pool : per); r++)
            fill_request(&k.v, r);
    barrier(&sh->ready2, &sh->go2);
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        if (ps && !o.no_warmup) /* the links idled through the baseline */
            ctx_run(&k, warm, reqs_in_pool, 0);
        if (ps) /* every pair's warm-up is over before any timed fetch */
            barrier(&sh->warm_ready[ps], &sh->warm_go[ps]);
        ctx_run(&k, first, per, reuse && !o.no_verify && !sampled());
        barrier(&sh->pass_ready[ps], &sh->pass_go[ps]);
    }
    atomic_fetch_add(&sh->guard_changed, guard_changed(&k.v));
    /* a rank that leaves ends its instance's requests: with replicated
     * heads other ranks may still be publishing theirs */
    barrier(&sh->ready3, &sh->go3);
    kvx_close(k.c);
    exit(0);
}

/* ---- generation ranks ----------------------------------------------- */

/* Whether request run->next may be fetched now: within the window, and
 * its blocks free. */
static int gen_may_fetch(const run_t *run, uint64_t next)
{
    return next < run->count && next - run->done < run->window &&
           (next < reqs_in_pool || run->fin[next - reqs_in_pool]);
}

/* Whether request r's params are in its slot. */
static int slot_ready(uint64_t r)
{
    return atomic_load_explicit((_Atomic uint32_t *)slot_of(r),
                                memory_order_acquire) != 0;
}

/* The first fetch call of a timed pass starts its clock. */
static void gen_started(const run_t *run, uint64_t t)
{
    uint64_t zero = 0;
    if (run->timed)
        atomic_compare_exchange_strong(&sh->first_fetch_ns, &zero, t);
}

/* --batch: fetch the requests from run->next on whose params are there
 * and whose blocks are free, within the window, up to KVX_MANY_MAX, in
 * one kvx_fetch_many (request next is ready); returns how many. */
static uint64_t gen_fetch_many(rank_t *k, run_t *run)
{
    static kvx_fetch_item_t it[KVX_MANY_MAX];
    static char keys[KVX_MANY_MAX][24];
    static uint32_t *bt;
    rank_view_t *v = &k->v;
    if (!bt && !(bt = malloc((size_t)KVX_MANY_MAX * v->bpr * 4)))
        die("out of memory");
    size_t n = 0;
    uint64_t now = now_ns();
    while (n < KVX_MANY_MAX && gen_may_fetch(run, run->next + n)) {
        uint64_t r = run->first + run->next + n;
        if (!slot_ready(r))
            break;
        uint8_t *s = slot_of(r);
        uint32_t *b = bt + n * v->bpr;
        for (uint32_t i = 0; i < v->bpr; i++)
            b[i] = req_block(v, r, i);
        memset(&it[n], 0, sizeof(it[n]));
        it[n].key_len = req_key(0, r, keys[n], sizeof(keys[n]));
        it[n].key = keys[n];
        it[n].params = s + 8;
        it[n].params_len = ((uint32_t *)s)[1];
        it[n].pool_id = v->pool;
        it[n].blocks = b;
        it[n].num_blocks = v->bpr;
        it[n].skip_tokens = o.skip;
        run->t0[run->next + n] = now;
        n++;
    }
    if (n)
        gen_started(run, now);
    CHECK_KVX(kvx_fetch_many(k->c, it, n, TIMEOUT_MS), k->c);
    return n;
}

/* Fetch request run->next (its params are in its slot) into blocks bt. */
static void gen_fetch_one(rank_t *k, run_t *run, uint32_t *bt)
{
    kvx_client_t *c = k->c;
    rank_view_t *v = &k->v;
    uint64_t r = run->first + run->next;
    uint8_t *s = slot_of(r);
    for (uint32_t i = 0; i < v->bpr; i++)
        bt[i] = req_block(v, r, i);
    run->t0[run->next] = now_ns();
    gen_started(run, run->t0[run->next]);
    char gk[64], ck[64], ci[32];
    size_t gkl = gen_key(r, gk, sizeof(gk));
    if (o.by_key) {
        size_t ckl = ctx_key(r, ck, sizeof(ck));
        snprintf(ci, sizeof(ci), "bench-ctx-%u", my_pair);
        CHECK_KVX(kvx_fetch_by_key(c, gk, gkl, ci, sh->address, ck, ckl,
                                   v->pool, bt, v->bpr, o.skip, 0, TIMEOUT_MS),
                  c);
    } else if (o.keyed)
        CHECK_KVX(kvx_fetch_key(c, gk, gkl, s + 8, ((uint32_t *)s)[1], v->pool,
                                bt, v->bpr, o.skip, 0, TIMEOUT_MS),
                  c);
    else
        CHECK_KVX(kvx_fetch(c, r, s + 8, ((uint32_t *)s)[1], v->pool, bt,
                            v->bpr, o.skip, TIMEOUT_MS),
                  c);
}

/* Take the completions there are (waiting up to a second for one):
 * latencies (rank 0 of a timed pass) and the check of what landed. */
static void gen_poll(rank_t *k, run_t *run)
{
    kvx_batch_t *b;
    CHECK_KVX(kvx_poll(k->c, 1, 1000, &b), k->c);
    uint64_t t = now_ns(), first = run->first;
    for (uint32_t i = 0; i < b->num_events; i++) {
        const kvx_event_t *e = &b->events[i];
        if (e->kind != KVX_EVENT_COMPLETE)
            die("generation request %llu: %s (%s)",
                (unsigned long long)e->request_id, e->message,
                kvx_status_name(e->code));
        uint64_t er = event_req(e), j = er - first;
        if (run->timed && k->rank == 0) {
            lat_ns[first + j] = t - run->t0[j];
            call_ns[first + j] = run->t0[j];
            ev_ns[first + j] = t;
        }
        if (run->sample) { /* the slot's last request stays whole */
            run->bad += sample_check(&k->v, er, pat_of(er, first),
                                     j + reqs_in_pool < run->count);
            atomic_fetch_add(&sh->sampled_reqs, 1);
        } else if (run->check) {
            run->bad += check_request(&k->v, er);
            (*run->checked)++;
        }
        run->fin[j] = 1;
        run->done++;
    }
    kvx_batch_free(b);
}

/* Generation rank: fetch requests [first, first + count) with up to
 * window outstanding; record latency (rank 0) and verify. Returns the
 * mismatched rows. */
static uint64_t gen_run(rank_t *k, uint64_t first, uint64_t count, int timed,
                        uint64_t *checked)
{
    run_t run = {.first = first, .count = count, .timed = timed};
    run.check = timed && !o.no_verify && reqs_in_pool < count;
    run.sample = run.check && sampled();
    run.t0 = calloc(count, sizeof(uint64_t));
    run.fin = calloc(count, 1);
    run.window = o.window < reqs_in_pool ? o.window : reqs_in_pool;
    run.checked = checked;
    uint32_t *bt = malloc(k->v.bpr * sizeof(uint32_t));
    while (run.done < count) {
        if (gen_may_fetch(&run, run.next)) {
            if (slot_ready(first + run.next)) {
                if (o.batch) {
                    run.next += gen_fetch_many(k, &run);
                } else {
                    gen_fetch_one(k, &run, bt);
                    run.next++;
                }
                continue;
            }
            if (run.next == run.done) { /* nothing to poll for: wait */
                if (atomic_load(&sh->failed))
                    exit(1); /* its context rank failed */
                struct timespec ts = {0, 2000};
                nanosleep(&ts, NULL);
                continue;
            }
        }
        gen_poll(k, &run);
    }
    if (timed) {
        uint64_t end = now_ns(), prev = atomic_load(&sh->last_done_ns);
        while (end > prev &&
               !atomic_compare_exchange_weak(&sh->last_done_ns, &prev, end))
            ;
    }
    free(run.fin);
    free(run.t0);
    free(bt);
    return run.bad;
}

static void gen_main(uint32_t rank)
{
    rank_t k = {.rank = rank};
    char name[32];
    snprintf(name, sizeof(name), "bench-gen-%u", my_pair);
    k.c = rank_open(name, KVX_ROLE_GENERATION, rank, &k.v);
    uint64_t per = o.requests / o.pairs, first = my_pair * per;
    uint64_t warm = WARM_BASE + my_pair * reqs_in_pool;
    uint64_t checked = 0, bad;
    barrier(&sh->ready, &sh->go);
    if (!o.no_warmup)
        gen_run(&k, warm, reqs_in_pool, 0, &checked);
    barrier(&sh->ready2, &sh->go2);
    bad = 0;
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        if (ps && !o.no_warmup) /* the links idled through the baseline:
                                    TCP starts slow again */
            gen_run(&k, warm, reqs_in_pool, 0, &checked);
        if (ps) { /* each pass writes every byte again, checked again */
            pool_clear(&k.v);
            barrier(&sh->warm_ready[ps], &sh->warm_go[ps]);
        }
        bad += gen_run(&k, first, per, 1, &checked);
        if (reqs_in_pool >= per && !o.no_verify)
            for (uint64_t r = first; r < first + per; r++, checked++)
                bad += check_request(&k.v, r);
        else if (sampled()) /* every byte of every slot, after the pass */
            for (uint64_t r = first; r < first + reqs_in_pool; r++)
                bad += check_request(&k.v, r);
        barrier(&sh->pass_ready[ps], &sh->pass_go[ps]);
    }
    uint64_t per_req = (uint64_t)(num_tokens - o.skip) * k.v.layout.num_layers *
                       kvf * k.v.layout.num_heads * o.head_dim *
                       kvx_dtype_size(o.dtype);
    atomic_fetch_add(&sh->mismatches, bad);
    atomic_fetch_add(&sh->verified_bytes, checked * per_req);
    atomic_fetch_add(&sh->guard_changed, guard_changed(&k.v));
    barrier(&sh->ready3, &sh->go3);
    kvx_close(k.c);
    exit(0);
}

/* ---- the parent ----------------------------------------------------- */

/* The rank processes, as the parent reaps them. */
typedef struct kids {
    pid_t *pid;
    int *st, *done;
    uint32_t n;
} kids_t;

/* Reap the ranks that exited (without waiting for the others); one that
 * failed, or died of a signal, marks the run failed. Then a moment's
 * sleep: the caller polls. */
static void kids_watch(kids_t *k)
{
    for (uint32_t i = 0; i < k->n; i++)
        if (!k->done[i] &&
            waitpid(k->pid[i], &k->st[i], WNOHANG) == k->pid[i]) {
            k->done[i] = 1;
            if (!WIFEXITED(k->st[i]) || WEXITSTATUS(k->st[i]))
                atomic_fetch_add(&sh->failed, 1);
        }
    usleep(1000);
}

/* Until every rank is at the barrier of `ready`, or the run failed: a
 * rank that dies (a signal, or exit before its barrier) fails the run,
 * so the others stop instead of waiting for it. */
static void kids_await(kids_t *k, _Atomic uint32_t *ready)
{
    while (atomic_load(ready) < k->n && !atomic_load(&sh->failed))
        kids_watch(k);
}

/* Fork every rank: each pair's context ranks, then its generation ranks.
 * A child never returns. */
static void kids_fork(kids_t *k)
{
    uint32_t nctx = o.ctx_ranks * o.ctx_pp, ngen = o.gen_ranks * o.gen_pp;
    uint32_t per_pair = nctx + ngen;
    k->n = per_pair * o.pairs;
    k->pid = calloc(k->n, sizeof(pid_t));
    k->st = calloc(k->n, sizeof(int));
    k->done = calloc(k->n, sizeof(int));
    if (!k->pid || !k->st || !k->done)
        die("out of memory");
    for (uint32_t i = 0; i < k->n; i++) {
        pid_t p = fork();
        if (p < 0) { /* the ranks already started stop at their barrier */
            atomic_fetch_add(&sh->failed, 1);
            for (uint32_t j = 0; j < i; j++)
                waitpid(k->pid[j], NULL, 0);
            die("fork: %s", strerror(errno));
        }
        if (p == 0) {
            my_pair = i / per_pair;
            uint32_t r = i % per_pair;
            if (r < nctx)
                ctx_main(r);
            else
                gen_main(r - nctx);
        }
        k->pid[i] = p;
    }
}

/* Each timed pass: its time; with --daemons 2 and several passes, one
 * ucx_perftest run right after it, while the daemons idle, so that each
 * pass has a baseline measured beside it (a busy host drifts). */
static void kids_passes(kids_t *k, const char *perftest, uint64_t total,
                        ranks_result_t *res)
{
    for (uint32_t ps = 0; ps < o.passes; ps++) {
        if (ps) {
            kids_await(k, &sh->warm_ready[ps]);
            atomic_store(&sh->warm_go[ps], 1);
        }
        kids_await(k, &sh->pass_ready[ps]);
        if (atomic_load(&sh->failed))
            break;
        res->pass_secs[ps] =
            (double)(sh->last_done_ns - sh->first_fetch_ns) / 1e9;
        if (o.pass_times) {
            FILE *f = fopen(o.pass_times, "a");
            if (f) {
                fprintf(f, "%llu %llu\n",
                        (unsigned long long)sh->first_fetch_ns,
                        (unsigned long long)sh->last_done_ns);
                fclose(f);
            }
        }
        atomic_store(&sh->first_fetch_ns, 0);
        atomic_store(&sh->last_done_ns, 0);
        if (o.daemons == 2 && o.passes > 1) {
            if (ps == 0) /* UCX_TLS for the runs */
                res->message_bytes = peers_read();
            uint64_t mb = res->message_bytes;
            res->pass_ucx[ps] =
                perftest_gbps(perftest, "ucp_am_bw", o.slot_bytes, total, 0);
            if (mb && mb < o.slot_bytes)
                res->pass_msg[ps] =
                    perftest_gbps(perftest, "ucp_am_bw", mb, total, 0);
        }
        /* the params slots are published again (warm-up ones too) */
        for (uint64_t r = 0; r < o.requests; r++)
            atomic_store((_Atomic uint32_t *)slot_of(r), 0);
        for (uint64_t r = 0; r < (uint64_t)o.pairs * reqs_in_pool; r++)
            atomic_store((_Atomic uint32_t *)slot_of(WARM_BASE + r), 0);
        atomic_store(&sh->pass_go[ps], 1);
    }
}

/* Every rank exits; after a failure, one still there after 10 s (in a
 * call that never returns) is killed. Returns whether the run failed. */
static int kids_reap(kids_t *k)
{
    uint64_t kill_at = 0;
    for (uint32_t left = k->n; left;) {
        kids_watch(k);
        left = 0;
        for (uint32_t i = 0; i < k->n; i++)
            left += !k->done[i];
        if (atomic_load(&sh->failed) && !kill_at)
            kill_at = now_ns() + 10000000000ull;
        for (uint32_t i = 0; kill_at && now_ns() > kill_at && i < k->n; i++)
            if (!k->done[i])
                kill(k->pid[i], SIGKILL);
    }
    int failed = atomic_load(&sh->failed) != 0;
    for (uint32_t i = 0; i < k->n; i++)
        failed |= !WIFEXITED(k->st[i]) || WEXITSTATUS(k->st[i]);
    return failed;
}

void ranks_run(const char *perftest, uint64_t total, ranks_result_t *res)
{
    kids_t k;
    kids_fork(&k);
    kids_await(&k, &sh->ready);
    atomic_store(&sh->go, 1);
    kids_await(&k, &sh->ready2);
    atomic_store(&sh->go2, 1);
    kids_passes(&k, perftest, total, res);
    kids_await(&k, &sh->ready3);
    atomic_store(&sh->go3, 1);
    res->failed = kids_reap(&k);
    free(k.pid);
    free(k.st);
    free(k.done);
}
