/* stats — the Status reply; see stats.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agree/agree.h"
#include "copy/copy.h"
#include "copy/gpu.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "net/peer.h"
#include "pacing.h"
#include "remote/remote.h"
#include "stats.h"
#include "xfer/instance.h"
#include "xfer/xfer.h"

struct conf_acc {
    Kvxfer__Count **v;
    size_t n, cap;
};

static void add_conf(const char *key, const char *value, void *arg)
{
    struct conf_acc *a = arg;
    if (a->n == a->cap)
        return;
    Kvxfer__Count *c = malloc(sizeof(*c));
    if (!c)
        return;
    kvxfer__count__init(c);
    /* config entries carry "key=value" in name; value unused */
    size_t len = strlen(key) + strlen(value) + 2;
    c->name = malloc(len);
    if (!c->name) {
        free(c);
        return;
    }
    snprintf(c->name, len, "%s=%s", key, value);
    a->v[a->n++] = c;
}

void stats_fill(Kvxfer__StatusReply *st, int64_t only_uid, uint32_t cap)
{
    st->version = KVX_VERSION_STRING;
    static char gpu[2048];
    st->build = (char *)gpu_build_info();
    gpu_status(gpu, sizeof(gpu));
    uint64_t pj, pns;
    unsigned held;
    copy_pace_stats(&pj, &pns, &held);
    if (kvxd.conf.gpu_pace || kvxd.conf.copy_pace || pj) {
        size_t n = strlen(gpu);
        snprintf(gpu + n, sizeof(gpu) - n,
                 "%spaced: %llu jobs held %.3f ms, %u now", n ? "; " : "",
                 (unsigned long long)pj, (double)pns / 1e6, held);
    }
    char paces[1024];
    pacing_status(paces, sizeof(paces));
    if (paces[0]) {
        size_t n = strlen(gpu);
        snprintf(gpu + n, sizeof(gpu) - n, "%s%s", n ? "; " : "", paces);
    }
    st->gpu = gpu;
    st->uptime_ms = kvxd_now_ms() - kvxd.start_ms;
    st->daemon_address = kvxd.address;
    st->worker_threads = copy_threads();

    struct conf_acc a = {calloc(64, sizeof(Kvxfer__Count *)), 0, 64};
    if (a.v)
        conf_foreach(&kvxd.conf, add_conf, &a);
    st->config = a.v;
    st->n_config = a.n;

    uint32_t np = pool_count();
    pool_t **pools = calloc(np ? np : 1, sizeof(*pools));
    st->pools = calloc(np ? np : 1, sizeof(*st->pools));
    if (pools && st->pools) {
        np = pool_list(pools, np);
        for (uint32_t i = 0; i < np; i++) {
            if (only_uid >= 0 && pools[i]->uid != (uint64_t)only_uid)
                continue; /* another user's */
            if (st->pools_total++ >= cap)
                continue; /* counted, not listed */
            Kvxfer__PoolInfo *pi = malloc(sizeof(*pi));
            if (!pi)
                break;
            kvxfer__pool_info__init(pi);
            pi->pool_id = pools[i]->id;
            pi->session_id = pools[i]->session_id;
            static const char *const kinds[2][2] = {{"host", "host (released)"},
                                                    {"gpu", "gpu (released)"}};
            pi->kind = (char *)kinds[pools[i]->gpu][pools[i]->released];
            pi->size = pools[i]->size;
            pi->preset = pools[i]->layout.preset;
            pi->num_blocks = pools[i]->layout.num_blocks;
            pi->regions = pools[i]->nregions;
            pi->users = pools[i]->users - !pools[i]->released -
                        (pools[i]->populating ? 1 : 0);
            st->pools[st->n_pools++] = pi;
        }
    }
    free(pools);

    st->n_requests_by_state = xfer_states(&st->requests_by_state);
    st->bytes_moved = kvxd.stats.bytes_moved;
    st->transfers_done = kvxd.stats.transfers_done;
    st->polls_woken_early = kvxd.stats.polls_woken_early;

    st->errors_by_code = calloc(32, sizeof(*st->errors_by_code));
    for (int i = 1; st->errors_by_code && i < 32; i++) {
        if (!kvxd.stats.errors_by_code[i])
            continue;
        Kvxfer__Count *c = malloc(sizeof(*c));
        if (!c)
            break;
        kvxfer__count__init(c);
        c->name = strdup(kvx_status_name(-i));
        c->value = kvxd.stats.errors_by_code[i];
        st->errors_by_code[st->n_errors_by_code++] = c;
    }
    st->memory = calloc(MEM_KINDS + 1, sizeof(*st->memory));
    for (int k = -1; st->memory && k < MEM_KINDS; k++) {
        Kvxfer__Count *c = malloc(sizeof(*c));
        if (!c)
            break;
        kvxfer__count__init(c);
        c->name = strdup(k < 0 ? "budget" : kvxd_mem_name((kvxd_mem_t)k));
        c->value =
            k < 0 ? kvxd.conf.memory_bytes : kvxd_mem_used((kvxd_mem_t)k);
        st->memory[st->n_memory++] = c;
    }
    uint64_t sealed = kvxd.stats.batches_sealed;
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        sealed += i->batches.sealed_total;
    st->batches_sealed = sealed;
    st->batches_resent = kvxd.stats.batches_resent;
    size_t ni = 0;
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        ni++;
    st->instances = calloc(ni ? ni : 1, sizeof(*st->instances));
    for (instance_t *i = instance_first(); st->instances && i;
         i = instance_next(i)) {
        if (only_uid >= 0 && i->owner_uid != (uint64_t)only_uid)
            continue; /* another user's */
        if (st->instances_total++ >= cap)
            continue; /* counted, not listed */
        Kvxfer__InstanceInfo *x = malloc(sizeof(*x));
        if (!x)
            break;
        kvxfer__instance_info__init(x);
        int spread = instance_spread(i), member = spread && !i->local[0];
        x->id = i->id;
        x->role = (Kvxfer__Role)i->role;
        x->ranks = i->nranks;
        x->local_ranks = i->nlocal;
        x->connected = i->nconnected;
        x->joined = i->joined;
        x->spread = spread;
        x->root = spread ? i->addresses[0] : "";
        x->next_batch = member ? 0 : i->batches.next_seq;
        uint32_t kept = batch_kept(&i->batches), away = 0;
        for (uint32_t r = 0; r < i->nranks; r++)
            away += i->batches.present[r] && i->batches.away[r];
        x->batches_kept = member ? agree_kept(i) : kept;
        x->ranks_away = member ? 0 : away;
        x->requests = i->offers.n + i->fetches.n;
        x->epoch = i->epoch;
        st->instances[st->n_instances++] = x;
    }
    st->n_peers = peer_infos(&st->peers);
    static Kvxfer__UcxInfo ucx;
    kvxfer__ucx_info__init(&ucx);
    peer_ucx_info(&ucx);
    remote_ucx_info(&ucx);
    st->ucx = &ucx;
}

void stats_free(Kvxfer__StatusReply *st)
{
    xfer_free_counts(st->config, st->n_config);
    for (size_t i = 0; i < st->n_pools; i++)
        free(st->pools[i]);
    free(st->pools);
    xfer_free_counts(st->requests_by_state, st->n_requests_by_state);
    xfer_free_counts(st->errors_by_code, st->n_errors_by_code);
    xfer_free_counts(st->memory, st->n_memory);
    peer_free_infos(st->peers, st->n_peers);
    for (size_t i = 0; i < st->n_instances; i++)
        free(st->instances[i]);
    free(st->instances);
}
