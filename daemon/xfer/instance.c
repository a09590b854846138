/* instance — replicas, ranks, join and batches; see instance.h. */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "core/daemon.h"
#include "core/log.h"
#include "instance.h"
#include "net/peer.h"

/* newest first */
static list_t instances = {&instances, &instances};

#define INST(n) LIST_OWNER(n, instance_t, node)

instance_t *instance_find(const char *id)
{
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        if (!strcmp(i->id, id))
            return i;
    return NULL;
}

instance_t *instance_first(void)
{
    list_t *n = list_first(&instances);
    return n ? INST(n) : NULL;
}

instance_t *instance_next(const instance_t *inst)
{
    return inst->node.next == &instances ? NULL : INST(inst->node.next);
}

int instance_batch_events(const batch_t *b, Kvxfer__Event **ev,
                          Kvxfer__Event ***evp)
{
    *ev = calloc(b->nevents ? b->nevents : 1, sizeof(**ev));
    *evp = calloc(b->nevents ? b->nevents : 1, sizeof(**evp));
    if (!*ev || !*evp) {
        free(*ev);
        free(*evp);
        return KVX_ERR_NOMEM;
    }
    for (uint32_t i = 0; i < b->nevents; i++) {
        kvxfer__event__init(&(*ev)[i]);
        (*ev)[i].key.data = (uint8_t *)b->events[i].key.b;
        (*ev)[i].key.len = b->events[i].key.len;
        (*ev)[i].kind = b->events[i].kind;
        (*ev)[i].code = b->events[i].code;
        (*ev)[i].message = b->events[i].message;
        (*ev)[i].aux.data = b->events[i].aux;
        (*ev)[i].aux.len = b->events[i].aux_len;
        (*evp)[i] = &(*ev)[i];
    }
    return 0;
}

/* The agreement layer's part (instance.h): a batch for a waiting poll,
 * an instance's end. Without it, nothing is delivered. */
static instance_hooks_t H;

void instance_set_hooks(const instance_hooks_t *h)
{
    H = *h;
}

static int deliver(void *arg, uint32_t rank, uint64_t req_id, const batch_t *b)
{
    return H.deliver ? H.deliver(arg, rank, req_id, b) : 0;
}

int instance_spread(const instance_t *inst)
{
    return inst->joined && inst->nlocal < inst->nranks && peer_enabled();
}

static void instance_free(instance_t *inst)
{
    assert(list_linked(&inst->node));
    list_remove(&inst->node);
    if (H.forget)
        H.forget(inst);
    kvxd.stats.batches_sealed += inst->batches.sealed_total;
    batch_cleanup(&inst->batches);
    map_free(&inst->offers);
    map_free(&inst->fetches);
    if (inst->addresses)
        for (uint32_t r = 0; r < inst->nranks; r++)
            free(inst->addresses[r]);
    free(inst->addresses);
    if (inst->consumers)
        kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid,
                             strlen(inst->consumers) + 1);
    free(inst->consumers);
    free(inst->local);
    free(inst->rank_sid);
    free(inst);
}

int instance_attach(const instance_hello_t *h, instance_t **out, kvx_why_t *why)
{
    const char *id = h->id;
    uint32_t uid = h->uid, rank = h->rank;
    kvx_role_t role = h->role;
    const plan_side_t *side = h->side;
    uint64_t sid = h->sid;
    int rc;
    if ((rc = plan_side_check(side, why)))
        return rc;
    uint32_t nranks = plan_side_ranks(side);
    if (rank >= nranks)
        return why_fail(why, KVX_ERR_INVALID,
                        "hello.rank: %u outside the %u ranks of tp*pp*cp", rank,
                        nranks);
    instance_t *inst = instance_find(id);
    if (inst) {
        /* an instance is its first rank's user's: another uid cannot
         * become one of its ranks (and so cancel its requests or read
         * its batches), root included */
        if (inst->owner_uid != uid)
            return why_fail(
                why, KVX_ERR_PERM,
                "hello.instance_id: instance %s belongs to uid %u; uid %u "
                "cannot join it (instance names are first come, first "
                "served: give each user's engines their own)",
                id, inst->owner_uid, uid);
        if (inst->role != role)
            return why_fail(why, KVX_ERR_MISMATCH,
                            "hello.role: instance %s has another role", id);
        if (inst->side.tp != side->tp || inst->side.pp != side->pp ||
            inst->side.cp != side->cp)
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "hello.parallel: tp/pp/cp %u/%u/%u differ from instance %s's "
                "%u/%u/%u",
                side->tp, side->pp, side->cp, id, inst->side.tp, inst->side.pp,
                inst->side.cp);
        if (inst->side.attention_dp != side->attention_dp)
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "hello.parallel.attention_dp: %u differs from instance %s's "
                "%u",
                side->attention_dp, id, inst->side.attention_dp);
        if (inst->side.total_layers != side->total_layers ||
            inst->side.total_heads != side->total_heads ||
            inst->side.num_layers_per_pp != side->num_layers_per_pp ||
            memcmp(inst->side.layers_per_pp, side->layers_per_pp,
                   sizeof(side->layers_per_pp)))
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "hello.parallel: layers or heads differ from instance %s's",
                id);
        if (inst->rank_sid[rank])
            return why_fail(
                why, KVX_ERR_EXISTS,
                "hello.rank: rank %u of instance %s is already connected", rank,
                id);
        if (inst->joined && !inst->local[rank])
            return why_fail(
                why, KVX_ERR_INVALID,
                "hello.rank: rank %u of instance %s is served by daemon %s "
                "(its join), not this one",
                rank, id, inst->addresses[rank]);
    } else {
        inst = calloc(1, sizeof(*inst));
        if (!inst)
            return why_fail(why, KVX_ERR_NOMEM, "hello: out of memory");
        snprintf(inst->id, sizeof(inst->id), "%s", id);
        inst->owner_uid = uid;
        inst->role = role;
        inst->side = *side;
        inst->nranks = nranks;
        inst->rank_sid = calloc(nranks, sizeof(*inst->rank_sid));
        if (getrandom(&inst->epoch, sizeof(inst->epoch), 0) !=
            sizeof(inst->epoch))
            inst->epoch = kvxd_now_ms() ^ (uintptr_t)inst;
        inst->epoch |= 1; /* nonzero */
        if (!inst->rank_sid ||
            batch_init(&inst->batches, nranks, deliver, inst)) {
            free(inst->rank_sid);
            free(inst);
            return why_fail(why, KVX_ERR_NOMEM, "hello: out of memory");
        }
        inst->batches.kept_max = kvxd.conf.batches_kept;
        list_unshift(&instances, &inst->node);
        log_info("instance %s created by uid %u: tp %u pp %u, %u ranks", id,
                 uid, side->tp, side->pp, nranks);
    }
    inst->rank_sid[rank] = sid;
    inst->nconnected++;
    batch_rank_join(&inst->batches, rank);
    *out = inst;
    return 0;
}

int instance_detach(instance_t *inst, uint32_t rank)
{
    if (!inst->rank_sid[rank])
        return 0;
    inst->rank_sid[rank] = 0;
    inst->nconnected--;
    batch_rank_leave(&inst->batches, rank);
    /* freed by instance_tick() once its requests are fenced and gone; the
     * caller ends them (xfer_end_instance) */
    return 1;
}

int instance_join(instance_t *inst, uint32_t rank, char *const *addr, size_t n,
                  kvx_why_t *why)
{
    if (n != inst->nranks)
        return why_fail(why, KVX_ERR_INVALID,
                        "join.rank_addresses: %zu addresses for %u ranks", n,
                        inst->nranks);
    for (size_t i = 0; i < n; i++)
        if (!addr[i][0] || strlen(addr[i]) >= sizeof(kvxd.address))
            return why_fail(
                why, KVX_ERR_INVALID,
                "join.rank_addresses[%zu]: empty or longer than %zu bytes", i,
                sizeof(kvxd.address) - 1);
    /* an earlier run's address first: that is why it is not this one */
    for (size_t i = 0; i < n; i++) {
        char w[400];
        if (peer_address_alias(addr[i], KVX_WHY(w)))
            return why_fail(why, KVX_ERR_INVALID,
                            "join.rank_addresses[%zu]: %s", i, w);
    }
    if (strcmp(addr[rank], kvxd.address))
        return why_fail(
            why, KVX_ERR_INVALID,
            "join.rank_addresses[%u]: '%s' is not this daemon ('%s')", rank,
            addr[rank], kvxd.address);
    if (inst->joined) {
        for (size_t i = 0; i < n; i++)
            if (strcmp(addr[i], inst->addresses[i]))
                return why_fail(
                    why, KVX_ERR_MISMATCH,
                    "join.rank_addresses[%zu]: '%s' differs from '%s' given "
                    "by another rank",
                    i, addr[i], inst->addresses[i]);
        return 0;
    }
    /* a rank connected here must be this daemon's in the list (the
     * first join of a spread instance decides which ranks are local) */
    for (size_t i = 0; i < n; i++)
        if (inst->rank_sid[i] && strcmp(addr[i], kvxd.address))
            return why_fail(
                why, KVX_ERR_INVALID,
                "join.rank_addresses[%zu]: '%s', but rank %zu is connected "
                "to this daemon ('%s')",
                i, addr[i], i, kvxd.address);
    inst->addresses = calloc(n, sizeof(char *));
    inst->local = calloc(n, 1);
    if (!inst->addresses || !inst->local)
        goto err_nomem;
    inst->nlocal = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(inst->addresses[i] = strdup(addr[i])))
            goto err_nomem;
        inst->local[i] = !strcmp(addr[i], kvxd.address);
        inst->nlocal += inst->local[i];
    }
    inst->joined = 1;
    return 0;

err_nomem:
    if (inst->addresses)
        for (size_t i = 0; i < n; i++)
            free(inst->addresses[i]);
    free(inst->addresses);
    free(inst->local);
    inst->addresses = NULL;
    inst->local = NULL;
    return why_fail(why, KVX_ERR_NOMEM, "join: out of memory");
}

/* A consumers entry e (len bytes): "INSTANCE", the owner's uid, or
 * "UID:INSTANCE". 0 with *uid, *name and *nlen set; -1: malformed. */
static int consumer_parse(const char *e, size_t len, uint32_t owner,
                          uint32_t *uid, const char **name, size_t *nlen)
{
    size_t d = 0;
    uint64_t v = 0;
    for (; d < len && e[d] >= '0' && e[d] <= '9'; d++)
        if (v <= UINT32_MAX)
            v = v * 10 + (uint64_t)(e[d] - '0');
    if (d && d < len && e[d] == ':') {
        if (v > UINT32_MAX || d + 1 == len)
            return -1;
        *uid = (uint32_t)v;
        *name = e + d + 1;
        *nlen = len - d - 1;
        return 0;
    }
    *uid = owner;
    *name = e;
    *nlen = len;
    return 0;
}

int instance_consumers(instance_t *inst, char *const *list, size_t n,
                       kvx_why_t *why)
{
    size_t len = 0;
    if (n > INSTANCE_CONSUMERS_MAX)
        return why_fail(why, KVX_ERR_LIMIT,
                        "join.consumers: %zu entries, at most %u", n,
                        INSTANCE_CONSUMERS_MAX);
    for (size_t i = 0; i < n; i++) {
        size_t l = strlen(list[i]), nl;
        uint32_t u;
        const char *nm;
        if (!l || strchr(list[i], '\n') ||
            consumer_parse(list[i], l, inst->owner_uid, &u, &nm, &nl) ||
            nl > INSTANCE_ID_MAX)
            return why_fail(
                why, KVX_ERR_INVALID,
                "join.consumers[%zu]: '%.160s' is not INSTANCE or "
                "UID:INSTANCE (an instance of 1 to %u bytes, no newline; a "
                "uid up to %u)",
                i, list[i], INSTANCE_ID_MAX, UINT32_MAX);
        len += l + 1;
    }
    char *c = NULL;
    if (n && !(c = malloc(len)))
        return why_fail(why, KVX_ERR_NOMEM, "join: out of memory");
    for (size_t i = 0, o = 0; i < n; i++) {
        size_t l = strlen(list[i]);
        memcpy(c + o, list[i], l);
        c[o + l] = i + 1 < n ? '\n' : 0;
        o += l + 1;
    }
    if (inst->joined) {
        int same = (!c && !inst->consumers) ||
                   (c && inst->consumers && !strcmp(c, inst->consumers));
        free(c);
        if (!same)
            return why_fail(
                why, KVX_ERR_MISMATCH,
                "join.consumers: differ from those another rank gave");
        return 0;
    }
    /* kept as long as the instance: its owner's to pay for */
    if (c && kvxd_mem_charge_uid(MEM_REQUESTS, inst->owner_uid, len)) {
        char m[256];
        kvxd_mem_why(inst->owner_uid, len, m, sizeof(m));
        free(c);
        return why_fail(why, KVX_ERR_LIMIT, "join.consumers: %zu bytes %s", len,
                        m);
    }
    if (inst->consumers)
        kvxd_mem_release_uid(MEM_REQUESTS, inst->owner_uid,
                             strlen(inst->consumers) + 1);
    free(inst->consumers);
    inst->consumers = c;
    return 0;
}

int instance_allows(const instance_t *inst, const char *consumer,
                    uint32_t consumer_uid)
{
    if (!inst->consumers) /* the default: the owner's uid, any daemon */
        return consumer_uid == inst->owner_uid;
    size_t l = strlen(consumer);
    for (const char *p = inst->consumers; p;) {
        const char *end = strchr(p, '\n');
        size_t el = end ? (size_t)(end - p) : strlen(p), nl;
        uint32_t u;
        const char *nm;
        if (!consumer_parse(p, el, inst->owner_uid, &u, &nm, &nl) &&
            u == consumer_uid && nl == l && !memcmp(nm, consumer, l))
            return 1;
        p = end ? end + 1 : NULL;
    }
    return 0;
}

int instance_ready(const instance_t *inst, kvx_why_t *why)
{
    if (!inst->joined)
        return why_fail(why, KVX_ERR_STATE,
                        "instance %s has not joined (call kvx_join first)",
                        inst->id);
    for (uint32_t r = 0; r < inst->nranks; r++)
        if (inst->local[r] && !inst->rank_sid[r])
            return why_fail(
                why, KVX_ERR_STATE,
                "instance %s is incomplete: local rank %u has not said hello",
                inst->id, r);
    return 0;
}

void instance_tick(uint64_t now_ms)
{
    for (instance_t *i = instance_first(), *n; i; i = n) {
        n = instance_next(i);
        if (i->nconnected == 0 && i->offers.n == 0 && i->fetches.n == 0) {
            log_info("instance %s: last rank left", i->id);
            if (H.ends)
                H.ends(i);
            instance_free(i);
            continue;
        }
        batch_tick(&i->batches, now_ms);
    }
}

void instance_flush_all(void)
{
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        batch_flush(&i->batches);
}

void instance_cleanup(void)
{
    while (!list_empty(&instances))
        instance_free(INST(list_first(&instances)));
}
