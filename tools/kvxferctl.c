/*
 * kvxferctl — the operator's view of a running kvxferd.
 *
 *   kvxferctl [--socket PATH] COMMAND [options]    (kvxferctl --help)
 *
 * The commands are one table (cmds[]): a name, the function that runs it,
 * its synopsis and its help; `kvxferctl COMMAND --help` prints the last
 * two and exits 0. Commands that ask the daemon connect without Hello
 * (any allowed uid may look); drain and cancel are for admins, which the
 * daemon decides; plan is computed locally with the daemon's own planner.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <yaml.h>

#include "client/internal.h"
#include "common/reqkey.h"
#include "common/reqrec.h"
#include "copy/plan.h"

#define TIMEOUT_MS 5000

static const char *role_name(int role)
{
    switch (role) {
    case 1:
        return "context";
    case 2:
        return "generation";
    case 3:
        return "both";
    default:
        return "-";
    }
}

static void human_bytes(char *buf, size_t len, uint64_t b)
{
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int i = 0;
    while (v >= 1024 && i < 4) {
        v /= 1024;
        i++;
    }
    snprintf(buf, len, i ? "%.1f %s" : "%.0f %s", v, u[i]);
}

static kvx_client_t *open_daemon(const char *sock)
{
    kvx_client_t *c;
    int rc = kvx_connect_observer(sock, TIMEOUT_MS, &c);
    if (rc) {
        /* the library's message names the errno and what to check */
        fprintf(stderr, "kvxferctl: cannot connect to %s: %s: %s\n",
                sock ? sock : KVX_DEFAULT_SOCKET, kvx_status_name(rc),
                kvx_last_error(NULL));
        exit(1);
    }
    return c;
}

/* --json: print what the library renders. */
static int print_json(kvx_client_t *c, const char *what,
                      int (*get)(kvx_client_t *, char **, int))
{
    char *j;
    int rc = get(c, &j, TIMEOUT_MS);
    if (rc)
        fprintf(stderr, "kvxferctl: %s: %s: %s\n", what, kvx_status_str(rc),
                kvx_last_error(c));
    else
        printf("%s\n", j);
    free(rc ? NULL : j);
    kvx_close(c);
    return rc ? 1 : 0;
}

/* status: the rails (NICs the lanes are grouped by) and each GPU's. */
static void status_rails(const Kvxfer__UcxInfo *u)
{
    if (!u || !u->listen[0] || !u->n_rails)
        return;
    printf("rails          %s:", u->topology);
    for (size_t i = 0; i < u->n_rails; i++) {
        const Kvxfer__RailInfo *r = u->rails[i];
        char numa[16] = "?";
        if (r->numa >= 0)
            snprintf(numa, sizeof(numa), "%d", (int)r->numa);
        printf("%s %s (pci %s, numa %s, %u lanes)", i ? "," : "",
               r->nic[0] ? r->nic : "UCX's devices", r->pci[0] ? r->pci : "-",
               numa, r->lanes);
    }
    printf("\n");
    for (size_t i = 0; i < u->n_gpu_rails; i++) {
        const Kvxfer__GpuRails *g = u->gpu_rails[i];
        printf("  gpu %s ->", g->gpu);
        for (size_t k = 0; k < g->n_rails; k++)
            printf("%s %s", k ? "," : "",
                   g->rails[k][0] ? g->rails[k] : "UCX's devices");
        printf(" (%s)\n", g->distance);
    }
}

/* status: the peer section (UCX, slot times, each peer). */
static void status_peers(const Kvxfer__StatusReply *s)
{
    if (s->ucx && s->ucx->listen[0])
        printf("peers          UCX %s, %s staging, %u x %llu-byte slots "
               "sent as %llu-byte messages, %u at once per peer, %u lanes, "
               "transports %s\n",
               s->ucx->version, s->ucx->staging, s->ucx->slots,
               (unsigned long long)s->ucx->slot_bytes,
               (unsigned long long)s->ucx->message_bytes, s->ucx->send_window,
               s->ucx->lanes, s->ucx->transports[0] ? s->ucx->transports : "-");
    else
        printf("peers          off (peer.listen is empty)\n");
    if (s->ucx && s->ucx->listen[0]) {
        /* per slot, averaged since start */
        const Kvxfer__SlotTimes *t[2] = {s->ucx->received, s->ucx->sent};
        static const char *const what[2][2] = {{"received", "scatter"},
                                               {"sent", "gather"}};
        for (int i = 0; i < 2; i++) {
            const Kvxfer__SlotTimes *x = t[i];
            if (!x || !x->slots)
                continue;
            double n = (double)x->slots;
            char ahead[64] = "";
            if (x->ahead)
                snprintf(ahead, sizeof(ahead), ", %llu gathered ahead",
                         (unsigned long long)x->ahead);
            else if (x->direct)
                snprintf(ahead, sizeof(ahead), ", %llu pieces %s the pool",
                         (unsigned long long)x->direct,
                         i ? "sent from" : "received into");
            char gpu[96] = "";
            if (x->gpu_slots)
                snprintf(gpu, sizeof(gpu),
                         " (%u in GPU memory, %.1f MiB through them)",
                         x->gpu_slots, x->gpu_bytes / 1048576.0);
            printf("slots %-8s %llu (%.1f MiB), per slot: wait %.0f us, "
                   "wire %.0f us, %s %.0f us (loop lag %.0f us)%s; %u of "
                   "%u free%s\n",
                   what[i][0], (unsigned long long)x->slots,
                   x->bytes / 1048576.0, x->wait_ns / n / 1e3,
                   x->wire_ns / n / 1e3, what[i][1], x->copy_ns / n / 1e3,
                   x->loop_lag_ns / n / 1e3, ahead, x->free_slots,
                   s->ucx->slots + x->gpu_slots, gpu);
        }
    }
    status_rails(s->ucx);
    if (s->n_peers) {
        uint32_t up = 0;
        for (size_t i = 0; i < s->n_peers; i++)
            up += !strcmp(s->peers[i]->state, "connected");
        printf("  %u of %zu peer daemons connected (kvxferctl peers)\n", up,
               s->n_peers);
    }
}

/* peers: one line per peer daemon this daemon knows. */
static void peers_print(const Kvxfer__StatusReply *s)
{
    if (!s->ucx || !s->ucx->listen[0]) {
        printf("no peer daemons: peer.listen is empty\n");
        return;
    }
    if (!s->n_peers) {
        printf("no peer daemons yet (this one listens on %s)\n",
               s->ucx->listen);
        return;
    }
    printf("%-40s %-10s %-3s %14s %14s %6s %5s %12s  %s\n", "PEER", "STATE",
           "DIR", "SENT", "RECEIVED", "ERRORS", "LANES", "HEARD_FROM",
           "TRANSPORTS");
    for (size_t i = 0; i < s->n_peers; i++) {
        const Kvxfer__PeerInfo *x = s->peers[i];
        char seen[24];
        snprintf(seen, sizeof(seen), "%llu ms ago",
                 (unsigned long long)x->last_seen_ms);
        printf("%-40s %-10s %-3s %14llu %14llu %6llu %5u %12s  %s\n",
               x->address, x->state, x->direction,
               (unsigned long long)x->bytes_sent,
               (unsigned long long)x->bytes_received,
               (unsigned long long)x->errors, x->lanes, seen,
               x->transports && x->transports[0] ? x->transports : "-");
    }
}

/* status: the sessions and instances, a table each. */
static void status_sessions(const Kvxfer__StatusReply *s)
{
    if (s->sessions_total > s->n_sessions)
        printf("\n\nsessions (%u, the first %zu shown):\n", s->sessions_total,
               s->n_sessions);
    else
        printf("\n\nsessions (%zu):\n", s->n_sessions);
    if (s->n_sessions)
        printf("  %-8s %-8s %-6s %-24s %-5s %-11s %s\n", "SESSION", "PID",
               "UID", "INSTANCE", "RANK", "ROLE", "POOLS");
    for (size_t i = 0; i < s->n_sessions; i++) {
        const Kvxfer__SessionInfo *x = s->sessions[i];
        printf("  %-8llu %-8d %-6u %-24s %-5u %-11s %u\n",
               (unsigned long long)x->session_id, x->pid, x->uid,
               x->instance_id[0] ? x->instance_id : "-", x->rank,
               role_name(x->role), x->pools);
    }
    if (s->instances_total > s->n_instances)
        printf("\ninstances (%u, the first %zu shown):\n", s->instances_total,
               s->n_instances);
    else
        printf("\ninstances (%zu):\n", s->n_instances);
    if (s->n_instances)
        printf("  %-24s %-11s %-5s %-5s %-5s %-6s %-5s %-5s %-5s %s\n",
               "INSTANCE", "ROLE", "RANKS", "LOCAL", "CONN", "NEXT", "KEPT",
               "AWAY", "REQS", "ROOT");
    for (size_t i = 0; i < s->n_instances; i++) {
        const Kvxfer__InstanceInfo *x = s->instances[i];
        char next[24];
        snprintf(next, sizeof(next), "%llu", (unsigned long long)x->next_batch);
        int member = x->spread && strcmp(x->root, s->daemon_address);
        printf("  %-24s %-11s %-5u %-5u %-5u %-6s %-5u %-5u %-5u %s\n", x->id,
               role_name(x->role), x->ranks, x->local_ranks, x->connected,
               member ? "-" : next, x->batches_kept, x->ranks_away, x->requests,
               !x->joined   ? "(not joined)"
               : !x->spread ? "-"
               : member     ? x->root
                            : "this daemon");
    }
}

/* status: the pools, then the config in effect. */
static void status_pools(const Kvxfer__StatusReply *s)
{
    char b1[32];
    if (s->pools_total > s->n_pools)
        printf("\npools (%u, the first %zu shown):\n", s->pools_total,
               s->n_pools);
    else
        printf("\npools (%zu):\n", s->n_pools);
    if (s->n_pools)
        printf("  %-6s %-8s %-16s %-10s %-12s %s\n", "POOL", "SESSION", "KIND",
               "PRESET", "SIZE", "BLOCKS/USERS");
    for (size_t i = 0; i < s->n_pools; i++) {
        const Kvxfer__PoolInfo *x = s->pools[i];
        human_bytes(b1, sizeof(b1), x->size);
        printf("  %-6u %-8llu %-16s %-10s %-12s %u/%u\n", x->pool_id,
               (unsigned long long)x->session_id, x->kind, x->preset, b1,
               x->num_blocks, x->users);
    }
}

/* The flags a command takes (each "--NAME", no value): set[i] = 1 for
 * each one given. 0, or 2 (the exit status) naming what is not one. */
static int flags(int argc, char **argv, const char *const names[], int set[])
{
    for (int k = 1; k < argc; k++) {
        int i = 0;
        while (names[i] && strcmp(argv[k], names[i]))
            i++;
        if (!names[i]) {
            fprintf(stderr,
                    "kvxferctl: %s: unknown option '%s' (kvxferctl %s "
                    "--help)\n",
                    argv[0], argv[k], argv[0]);
            return 2;
        }
        set[i] = 1;
    }
    return 0;
}

/* status --config: the configuration in effect, one key=value a line. */
static void status_config(const Kvxfer__StatusReply *s)
{
    for (size_t i = 0; i < s->n_config; i++)
        printf("%s\n", s->config[i]->name);
}

static int cmd_status(const char *sock, int argc, char **argv)
{
    static const char *const names[] = {"--json", "--config", NULL};
    int set[2] = {0, 0}, rc;
    if ((rc = flags(argc, argv, names, set)))
        return rc;
    if (set[0] && set[1]) {
        fprintf(stderr, "kvxferctl: status: --json carries the "
                        "configuration already (its \"config\" list)\n");
        return 2;
    }
    kvx_client_t *c = open_daemon(sock);
    if (set[0])
        return print_json(c, "status", kvx_status_json);
    Kvxfer__Reply *r;
    if ((rc = kvx__status_get(c, &r, TIMEOUT_MS)))
        goto fail;
    const Kvxfer__StatusReply *s = r->status_reply;
    if (set[1]) {
        status_config(s);
        kvxfer__reply__free_unpacked(r, NULL);
        kvx_close(c);
        return 0;
    }
    char b1[32];
    printf("kvxferd %s (%s), up %llu.%03llu s\n", s->version, s->build,
           (unsigned long long)(s->uptime_ms / 1000),
           (unsigned long long)(s->uptime_ms % 1000));
    printf("address        %s\n", s->daemon_address);
    printf("copy threads   %u\n", s->worker_threads);
    printf("gpu            %s\n", s->gpu[0] ? s->gpu : "-");
    status_peers(s);
    human_bytes(b1, sizeof(b1), s->bytes_moved);
    printf("bytes moved    %s (%llu)\n", b1,
           (unsigned long long)s->bytes_moved);
    printf("transfers done %llu\n", (unsigned long long)s->transfers_done);
    printf("batches sealed %llu\n", (unsigned long long)s->batches_sealed);
    printf("batches resent %llu\n", (unsigned long long)s->batches_resent);
    if (s->n_memory) { /* "budget", then the kinds charged */
        uint64_t used = 0;
        for (size_t i = 1; i < s->n_memory; i++)
            used += s->memory[i]->value;
        char b2[32];
        human_bytes(b1, sizeof(b1), used);
        human_bytes(b2, sizeof(b2), s->memory[0]->value);
        printf("memory         %s of %s (limits.memory_bytes):", b1, b2);
        for (size_t i = 1; i < s->n_memory; i++) {
            human_bytes(b1, sizeof(b1), s->memory[i]->value);
            printf(" %s %s", s->memory[i]->name, b1);
        }
        printf("\n");
    }
    printf("\nrequests by state:");
    for (size_t i = 0; i < s->n_requests_by_state; i++)
        printf(" %s=%llu", s->requests_by_state[i]->name,
               (unsigned long long)s->requests_by_state[i]->value);
    printf("\nerrors by code:   ");
    if (!s->n_errors_by_code)
        printf(" none");
    for (size_t i = 0; i < s->n_errors_by_code; i++)
        printf(" %s=%llu", s->errors_by_code[i]->name,
               (unsigned long long)s->errors_by_code[i]->value);
    status_sessions(s);
    status_pools(s);
    kvxfer__reply__free_unpacked(r, NULL);
    kvx_close(c);
    return 0;
fail:
    fprintf(stderr, "kvxferctl: status: %s: %s\n", kvx_status_str(rc),
            kvx_last_error(c));
    kvx_close(c);
    return 1;
}

/* requests --done: the records of finished requests, newest last. */
static int requests_done(const char *sock, int json)
{
    kvx_client_t *c = open_daemon(sock);
    Kvxfer__Reply *r;
    int rc = kvx__done_get(c, 0, &r, TIMEOUT_MS);
    if (rc) {
        fprintf(stderr, "kvxferctl: requests --done: %s: %s\n",
                kvx_status_str(rc), kvx_last_error(c));
        kvx_close(c);
        return 1;
    }
    const Kvxfer__RequestsReply *q = r->requests;
    if (!json && !q->n_done)
        printf("no finished requests recorded (records.ring %s)\n",
               q->done_recorded ? "keeps none of this uid's" : "is empty");
    else if (!json)
        printf("%zu finished requests shown, %u kept, %llu since start\n"
               "%-20s %-20s %-10s %-20s %-5s %12s %-27s %10s %12s  %s\n",
               q->n_done, q->done_kept, (unsigned long long)q->done_recorded,
               "INSTANCE", "KEY", "SIDE", "OTHER_SIDE", "PATH", "BYTES",
               "START", "US", "MB/S", "OUTCOME");
    if (json)
        printf("[");
    for (size_t i = 0; i < q->n_done; i++) {
        const Kvxfer__DoneRecord *d = q->done[i];
        reqrec_t x = {0};
        snprintf(x.instance, sizeof(x.instance), "%s", d->instance_id);
        snprintf(x.context, sizeof(x.context), "%s", d->context_instance);
        snprintf(x.generation, sizeof(x.generation), "%s",
                 d->generation_instance);
        x.side = d->side[0] ? d->side : "generation";
        x.key_len = d->key.len <= KVX_MAX_KEY ? (uint32_t)d->key.len : 0;
        memcpy(x.key, d->key.data, x.key_len);
        x.path = d->path[0] ? d->path : NULL;
        x.bytes = d->bytes;
        x.start_us = d->start_us;
        x.end_us = d->end_us;
        x.outcome = (int)d->outcome;
        x.code = d->code;
        if (json) {
            char line[REQREC_JSON_MAX];
            reqrec_json(&x, line, sizeof(line));
            printf("%s%s", i ? "," : "", line);
            continue;
        }
        char ks[REQKEY_STR_MAX], t[40];
        time_t sec = (time_t)(x.start_us / 1000000);
        struct tm tm;
        gmtime_r(&sec, &tm);
        strftime(t, sizeof(t), "%Y-%m-%dT%H:%M:%S", &tm);
        int gen = !strcmp(x.side, "generation");
        const char *other = gen ? x.context : x.generation;
        printf("%-20s %-20s %-10s %-20s %-5s %12llu %s.%06lluZ %10llu "
               "%12.1f  %s",
               x.instance, reqkey_str(x.key, x.key_len, ks), x.side,
               other[0]         ? other
               : x.path && !gen ? "(peer daemons)"
                                : "-",
               x.path ? x.path : "-", (unsigned long long)x.bytes, t,
               (unsigned long long)(x.start_us % 1000000),
               (unsigned long long)(x.end_us > x.start_us
                                        ? x.end_us - x.start_us
                                        : 0),
               reqrec_bandwidth(&x) / 1e6, reqrec_outcome(x.outcome));
        if (x.code)
            printf(" %s", kvx_status_name(x.code));
        printf("\n");
    }
    if (json)
        printf("]\n");
    kvxfer__reply__free_unpacked(r, NULL);
    kvx_close(c);
    return 0;
}

static int cmd_requests(const char *sock, int argc, char **argv)
{
    static const char *const names[] = {"--json", "--done", NULL};
    int set[2] = {0, 0}, rc;
    if ((rc = flags(argc, argv, names, set)))
        return rc;
    if (set[1])
        return requests_done(sock, set[0]);
    kvx_client_t *c = open_daemon(sock);
    if (set[0])
        return print_json(c, "requests", kvx_requests_json);
    Kvxfer__Reply *r;
    if ((rc = kvx__requests_get(c, &r, TIMEOUT_MS)))
        goto fail;
    const Kvxfer__RequestsReply *q = r->requests;
    if (!q->n_requests)
        printf("no requests in flight\n");
    else
        printf("%-20s %-20s %-10s %-15s %10s %12s  %s\n", "INSTANCE", "REQUEST",
               "SIDE", "STATE", "AGE_MS", "DONE/TOTAL", "DETAIL");
    for (size_t i = 0; i < q->n_requests; i++) {
        const Kvxfer__RequestInfo *x = q->requests[i];
        char prog[48] = "-";
        if (x->bytes_total)
            snprintf(
                prog, sizeof(prog), "%llu%%",
                (unsigned long long)(x->bytes_done * 100 / x->bytes_total));
        char ks[REQKEY_STR_MAX];
        printf("%-20s %-20s %-10s %-15s %10llu %12s  %s\n", x->instance_id,
               reqkey_str(x->key.data, x->key.len, ks), x->side, x->state,
               (unsigned long long)x->age_ms, prog, x->detail);
    }
    kvxfer__reply__free_unpacked(r, NULL);
    kvx_close(c);
    return 0;
fail:
    fprintf(stderr, "kvxferctl: requests: %s: %s\n", kvx_status_str(rc),
            kvx_last_error(c));
    kvx_close(c);
    return 1;
}

static uint32_t num(const char *name, const char *v)
{
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    if (!*v || *end || x > 1000000000ul) {
        fprintf(stderr, "kvxferctl: plan: --%s: '%s' is not a number\n", name,
                v);
        exit(2);
    }
    return (uint32_t)x;
}

/* ---- kvxferctl plan --from FILE -----------------------------------------
 * context: / generation: {tp, pp, layers_per_pp: [..], tokens_per_block,
 * head_dim, dtype, attention_dp}; model: {layers, kv_heads, head_dim,
 * dtype, mla}; request: {tokens, skip_tokens}. Unknown keys are errors
 * that name FILE:LINE:COL. */

struct plan_req {
    uint32_t tokens, skip;
};

static int yerr(const char *file, const yaml_mark_t *m, const char *what,
                const char *key)
{
    fprintf(stderr, "%s:%zu:%zu: %s: %s\n", file, m->line + 1, m->column + 1,
            key, what);
    return 1;
}

static int set_u32(const char *file, const yaml_event_t *ev, const char *key,
                   uint32_t *out)
{
    char *end;
    const char *v = (const char *)ev->data.scalar.value;
    unsigned long x = strtoul(v, &end, 10);
    if (!*v || *end || x > 1000000000ul)
        return yerr(file, &ev->start_mark, "not a non-negative integer", key);
    *out = (uint32_t)x;
    return 0;
}

static int side_key(const char *file, yaml_parser_t *p, yaml_event_t *kev,
                    plan_side_t *s)
{
    char key[64];
    snprintf(key, sizeof(key), "%s", (const char *)kev->data.scalar.value);
    yaml_event_t v;
    if (!yaml_parser_parse(p, &v))
        return yerr(file, &p->problem_mark, p->problem, "yaml");
    int rc = 0;
    if (!strcmp(key, "layers_per_pp")) {
        if (v.type != YAML_SEQUENCE_START_EVENT) {
            rc = yerr(file, &v.start_mark, "expected a list of integers", key);
        } else {
            s->num_layers_per_pp = 0;
            for (;;) {
                yaml_event_t e;
                if (!yaml_parser_parse(p, &e)) {
                    rc = yerr(file, &p->problem_mark, p->problem, "yaml");
                    break;
                }
                if (e.type == YAML_SEQUENCE_END_EVENT) {
                    yaml_event_delete(&e);
                    break;
                }
                if (e.type != YAML_SCALAR_EVENT || s->num_layers_per_pp >= 64 ||
                    set_u32(file, &e, key,
                            &s->layers_per_pp[s->num_layers_per_pp++])) {
                    rc = rc ? rc
                            : yerr(file, &e.start_mark,
                                   "expected up to 64 integers", key);
                    yaml_event_delete(&e);
                    break;
                }
                yaml_event_delete(&e);
            }
        }
        yaml_event_delete(&v);
        return rc;
    }
    if (v.type != YAML_SCALAR_EVENT) {
        rc = yerr(file, &v.start_mark, "expected a scalar", key);
    } else if (!strcmp(key, "tp")) {
        rc = set_u32(file, &v, key, &s->tp);
    } else if (!strcmp(key, "pp")) {
        rc = set_u32(file, &v, key, &s->pp);
    } else if (!strcmp(key, "tokens_per_block")) {
        rc = set_u32(file, &v, key, &s->tokens_per_block);
    } else if (!strcmp(key, "head_dim")) {
        rc = set_u32(file, &v, key, &s->head_dim);
    } else if (!strcmp(key, "attention_dp")) {
        rc = set_u32(file, &v, key, &s->attention_dp);
    } else if (!strcmp(key, "layers")) {
        rc = set_u32(file, &v, key, &s->total_layers);
    } else if (!strcmp(key, "kv_heads")) {
        rc = set_u32(file, &v, key, &s->total_heads);
    } else if (!strcmp(key, "dtype")) {
        kvx_dtype_t dt;
        if (kvx_dtype_parse((const char *)v.data.scalar.value, &dt)) {
            rc = yerr(file, &v.start_mark,
                      "unknown dtype (expected fp32, fp16, bf16, fp8, int8)",
                      key);
        } else {
            s->dtype = dt;
            s->elem_size = kvx_dtype_size(dt);
        }
    } else if (!strcmp(key, "mla")) {
        const char *b = (const char *)v.data.scalar.value;
        if (!strcmp(b, "true")) {
            s->kv_factor = 1;
            s->total_heads = 1;
        } else if (!strcmp(b, "false")) {
            s->kv_factor = 2; /* K and V again; kv_heads says how many */
        } else {
            rc = yerr(file, &v.start_mark, "expected true or false", key);
        }
    } else {
        rc = yerr(file, &kev->start_mark,
                  "unknown key (expected tp, pp, layers_per_pp, "
                  "tokens_per_block, head_dim, dtype, attention_dp, "
                  "layers, kv_heads, mla)",
                  key);
    }
    yaml_event_delete(&v);
    return rc;
}

static int load_plan_file(const char *file, plan_side_t *src, plan_side_t *dst,
                          struct plan_req *rq)
{
    FILE *f = fopen(file, "r");
    if (!f) {
        fprintf(stderr, "kvxferctl: plan: %s: %s\n", file, strerror(errno));
        return 1;
    }
    yaml_parser_t p;
    yaml_parser_initialize(&p);
    yaml_parser_set_input_file(&p, f);
    int rc = 0, depth = 0;
    plan_side_t *cur[2] = {NULL, NULL}; /* sides the section applies to */
    int in_request = 0;
    char section[32] = "";
    for (int done = 0; !done && !rc;) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&p, &ev)) {
            rc = yerr(file, &p.problem_mark,
                      p.problem ? p.problem : "syntax error", "yaml");
            break;
        }
        switch (ev.type) {
        case YAML_STREAM_END_EVENT:
            done = 1;
            break;
        case YAML_MAPPING_START_EVENT:
            depth++;
            break;
        case YAML_MAPPING_END_EVENT:
            depth--;
            break;
        case YAML_SCALAR_EVENT:
            if (depth == 1) {
                snprintf(section, sizeof(section), "%s",
                         (const char *)ev.data.scalar.value);
                in_request = !strcmp(section, "request");
                cur[0] = !strcmp(section, "context")      ? src
                         : !strcmp(section, "generation") ? dst
                         : !strcmp(section, "model")      ? src
                                                          : NULL;
                cur[1] = !strcmp(section, "model") ? dst : NULL;
                if (!cur[0] && !in_request)
                    rc = yerr(file, &ev.start_mark,
                              "unknown section (expected context, "
                              "generation, model, request)",
                              section);
            } else if (depth == 2 && in_request) {
                char key[32];
                snprintf(key, sizeof(key), "%s",
                         (const char *)ev.data.scalar.value);
                yaml_event_t v;
                if (!yaml_parser_parse(&p, &v)) {
                    rc = yerr(file, &p.problem_mark, p.problem, "yaml");
                    break;
                }
                if (v.type != YAML_SCALAR_EVENT)
                    rc = yerr(file, &v.start_mark, "expected an integer", key);
                else if (!strcmp(key, "tokens"))
                    rc = set_u32(file, &v, key, &rq->tokens);
                else if (!strcmp(key, "skip_tokens"))
                    rc = set_u32(file, &v, key, &rq->skip);
                else
                    rc =
                        yerr(file, &ev.start_mark,
                             "unknown key (expected tokens, skip_tokens)", key);
                yaml_event_delete(&v);
            } else if (depth == 2 && !cur[0]) {
                /* a key that is not a scalar at the top (a complex key) */
                rc = yerr(file, &ev.start_mark, "expected section: key: value",
                          "yaml");
            } else if (depth == 2 && cur[1] &&
                       strcmp((const char *)ev.data.scalar.value, "layers") &&
                       strcmp((const char *)ev.data.scalar.value, "kv_heads") &&
                       strcmp((const char *)ev.data.scalar.value, "head_dim") &&
                       strcmp((const char *)ev.data.scalar.value, "dtype") &&
                       strcmp((const char *)ev.data.scalar.value, "mla")) {
                /* tp, pp and the like belong to one side, not the model */
                rc = yerr(file, &ev.start_mark,
                          "not a model key (expected layers, kv_heads, "
                          "head_dim, dtype, mla; parallelism goes under "
                          "context: or generation:)",
                          (const char *)ev.data.scalar.value);
            } else if (depth == 2) {
                char key[32];
                snprintf(key, sizeof(key), "%s",
                         (const char *)ev.data.scalar.value);
                rc = side_key(file, &p, &ev, cur[0]);
                if (!rc && cur[1]) {
                    /* a model key applies to both sides: the fields it
                     * names, whatever either side held before */
                    plan_side_t *a = cur[0], *o = cur[1];
                    if (!strcmp(key, "layers"))
                        o->total_layers = a->total_layers;
                    else if (!strcmp(key, "kv_heads"))
                        o->total_heads = a->total_heads;
                    else if (!strcmp(key, "head_dim"))
                        o->head_dim = a->head_dim;
                    else if (!strcmp(key, "dtype"))
                        o->dtype = a->dtype, o->elem_size = a->elem_size;
                    else if (!strcmp(key, "mla"))
                        o->kv_factor = a->kv_factor,
                        o->total_heads = a->total_heads;
                }
            } else {
                rc = yerr(file, &ev.start_mark, "expected section: key: value",
                          "yaml");
            }
            break;
        default:
            break;
        }
        yaml_event_delete(&ev);
    }
    yaml_parser_delete(&p);
    fclose(f);
    return rc;
}

static int cmd_plan(const char *sock, int argc, char **argv)
{
    (void)sock; /* computed here, with the daemon's planner */
    plan_side_t src = {.tp = 1,
                       .pp = 1,
                       .cp = 1,
                       .total_layers = 32,
                       .total_heads = 8,
                       .kv_factor = 2,
                       .head_dim = 128,
                       .elem_size = 2,
                       .dtype = KVX_DTYPE_BF16,
                       .tokens_per_block = 16};
    plan_side_t dst = src;
    uint32_t tokens = 0, skip = 0;
    static const struct option lo[] = {
        {"ctx-tp", required_argument, NULL, 1},
        {"ctx-pp", required_argument, NULL, 2},
        {"gen-tp", required_argument, NULL, 3},
        {"gen-pp", required_argument, NULL, 4},
        {"heads", required_argument, NULL, 5},
        {"layers", required_argument, NULL, 6},
        {"ctx-tokens-per-block", required_argument, NULL, 7},
        {"gen-tokens-per-block", required_argument, NULL, 8},
        {"tokens", required_argument, NULL, 9},
        {"skip-tokens", required_argument, NULL, 10},
        {"head-dim", required_argument, NULL, 11},
        {"ctx-head-dim", required_argument, NULL, 12},
        {"gen-head-dim", required_argument, NULL, 13},
        {"ctx-dtype", required_argument, NULL, 14},
        {"gen-dtype", required_argument, NULL, 15},
        {"mla", no_argument, NULL, 16},
        {"gen-dp", required_argument, NULL, 17},
        {"from", required_argument, NULL, 18},
        {NULL, 0, NULL, 0}};
    int opt;
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        kvx_dtype_t dt;
        switch (opt) {
        case 1:
            src.tp = num("ctx-tp", optarg);
            break;
        case 2:
            src.pp = num("ctx-pp", optarg);
            break;
        case 3:
            dst.tp = num("gen-tp", optarg);
            break;
        case 4:
            dst.pp = num("gen-pp", optarg);
            break;
        case 5:
            src.total_heads = dst.total_heads = num("heads", optarg);
            break;
        case 6:
            src.total_layers = dst.total_layers = num("layers", optarg);
            break;
        case 7:
            src.tokens_per_block = num("ctx-tokens-per-block", optarg);
            break;
        case 8:
            dst.tokens_per_block = num("gen-tokens-per-block", optarg);
            break;
        case 9:
            tokens = num("tokens", optarg);
            break;
        case 10:
            skip = num("skip-tokens", optarg);
            break;
        case 11:
            src.head_dim = dst.head_dim = num("head-dim", optarg);
            break;
        case 12:
            src.head_dim = num("ctx-head-dim", optarg);
            break;
        case 13:
            dst.head_dim = num("gen-head-dim", optarg);
            break;
        case 14:
        case 15:
            if (kvx_dtype_parse(optarg, &dt)) {
                fprintf(stderr, "kvxferctl: plan: unknown dtype '%s'\n",
                        optarg);
                return 2;
            }
            if (opt == 14) {
                src.dtype = dt;
                src.elem_size = kvx_dtype_size(dt);
            } else {
                dst.dtype = dt;
                dst.elem_size = kvx_dtype_size(dt);
            }
            break;
        case 16:
            src.kv_factor = dst.kv_factor = 1;
            src.total_heads = dst.total_heads = 1;
            break;
        case 17:
            dst.attention_dp = num("gen-dp", optarg);
            break;
        case 18: {
            struct plan_req rq = {tokens, skip};
            if (load_plan_file(optarg, &src, &dst, &rq))
                return 1;
            tokens = rq.tokens;
            skip = rq.skip;
            break;
        }
        default:
            fprintf(stderr, "kvxferctl: plan: see kvxferctl plan --help\n");
            return 2;
        }
    }
    if (!src.tokens_per_block || !dst.tokens_per_block) {
        fprintf(stderr, "kvxferctl: plan: tokens per block must be >= 1\n");
        return 2;
    }
    if (!tokens)
        tokens = src.tokens_per_block * 4;
    char why[256];
    int rc;
    if ((rc = plan_side_check(&src, KVX_WHY(why)))) {
        fprintf(stderr, "kvxferctl: plan: context: %s\n", why);
        return 1;
    }
    if ((rc = plan_side_check(&dst, KVX_WHY(why)))) {
        fprintf(stderr, "kvxferctl: plan: generation: %s\n", why);
        return 1;
    }
    printf("context:    tp %u pp %u, %u layers, %u KV heads, %u tokens/block\n",
           src.tp, src.pp, src.total_layers, src.total_heads,
           src.tokens_per_block);
    printf("generation: tp %u pp %u, %u layers, %u KV heads, %u tokens/block\n",
           dst.tp, dst.pp, dst.total_layers, dst.total_heads,
           dst.tokens_per_block);
    printf("request:    tokens [%u, %u)\n\n", skip, tokens);
    uint32_t n = plan_side_ranks(&dst);
    uint64_t total = 0;
    if (dst.attention_dp > 1)
        printf("attention DP: %u groups of %u ranks; a request goes to one "
               "group (the plan of group 0 is shown; others are alike)\n\n",
               dst.attention_dp, dst.tp / dst.attention_dp);
    for (uint32_t r = 0; r < n; r++) {
        plan_t *p;
        plan_side_t eff;
        uint32_t er;
        if (plan_dp_view(&dst, r, &eff, &er) != 0)
            continue; /* not in group 0 */
        if ((rc = plan_build(&src, &eff, er, tokens, skip, &p, KVX_WHY(why)))) {
            fprintf(stderr, "kvxferctl: plan: refused: %s (%s)\n", why,
                    kvx_status_name(rc));
            return 1;
        }
        printf("generation rank %u: %u slices, %u token segments, %llu "
               "bytes\n",
               r, p->nslices, p->nsegs, (unsigned long long)p->bytes);
        for (uint32_t i = 0; i < p->nslices; i++) {
            const plan_slice_t *s = &p->slices[i];
            printf("  <- context rank %-3u layers [%u, %u)  heads [%u, "
                   "%u)\n",
                   s->src_rank, s->layer0, s->layer0 + s->nlayers, s->head0,
                   s->head0 + s->nheads);
        }
        total += p->bytes;
        plan_free(p);
    }
    printf("\ntotal %llu bytes\n", (unsigned long long)total);
    return 0;
}

static int cmd_drain(const char *sock, int argc, char **argv)
{
    double secs = 0;
    int wait = 1;
    for (int k = 1; k < argc; k++) {
        char *end = NULL;
        if (!strcmp(argv[k], "--no-wait")) {
            wait = 0;
        } else if (!strcmp(argv[k], "--deadline") && k + 1 < argc) {
            secs = strtod(argv[++k], &end);
            if (*end || end == argv[k] || !(secs >= 0 && secs <= 86400)) {
                fprintf(stderr,
                        "kvxferctl: drain: --deadline '%s': seconds "
                        "from 0 to 86400 expected\n",
                        argv[k]);
                return 2;
            }
        } else {
            fprintf(stderr, "kvxferctl: drain: unknown option '%s'\n", argv[k]);
            return 2;
        }
    }
    uint32_t ms = (uint32_t)(secs * 1000 + 0.5);
    kvx_client_t *c = open_daemon(sock);
    char msg[512];
    /* the drain's grace, then at most deadlines.drain_timeout_ms */
    int rc = kvx__drain(c, ms, wait, msg, sizeof(msg),
                        wait ? (int)(ms + 600000) : TIMEOUT_MS);
    if (rc) {
        fprintf(stderr, "kvxferctl: drain: %s: %s\n", kvx_status_str(rc),
                kvx_last_error(c));
        kvx_close(c);
        return 1;
    }
    printf("kvxferctl: %s: %s\n", sock ? sock : KVX_DEFAULT_SOCKET, msg);
    kvx_close(c);
    return 0;
}

static int cmd_peers(const char *sock, int argc, char **argv)
{
    static const char *const names[] = {NULL};
    int rc;
    if ((rc = flags(argc, argv, names, NULL)))
        return rc;
    kvx_client_t *c = open_daemon(sock);
    Kvxfer__Reply *r;
    if ((rc = kvx__status_get(c, &r, TIMEOUT_MS))) {
        fprintf(stderr, "kvxferctl: peers: %s: %s\n", kvx_status_str(rc),
                kvx_last_error(c));
        kvx_close(c);
        return 1;
    }
    peers_print(r->status_reply);
    kvxfer__reply__free_unpacked(r, NULL);
    kvx_close(c);
    return 0;
}

/* cancel KEY [--instance ID]: without --instance, the one instance
 * that has KEY in flight (listed by requests). */
static int cmd_cancel(const char *sock, int argc, char **argv)
{
    const char *key = NULL, *inst = NULL;
    for (int k = 1; k < argc; k++) {
        if (!strcmp(argv[k], "--instance") && k + 1 < argc)
            inst = argv[++k];
        else if (argv[k][0] == '-' && argv[k][1]) {
            fprintf(stderr,
                    "kvxferctl: cancel: unknown option '%s' (kvxferctl "
                    "cancel --help)\n",
                    argv[k]);
            return 2;
        } else if (!key)
            key = argv[k];
        else {
            fprintf(stderr, "kvxferctl: cancel: one KEY at a time ('%s')\n",
                    argv[k]);
            return 2;
        }
    }
    if (!key || !key[0] || strlen(key) > KVX_MAX_KEY) {
        fprintf(stderr,
                "kvxferctl: cancel: a KEY of 1 to %u bytes is "
                "required (kvxferctl cancel --help)\n",
                KVX_MAX_KEY);
        return 2;
    }
    kvx_client_t *c = open_daemon(sock);
    char found[256] = "";
    int rc;
    if (!inst) {
        Kvxfer__Reply *r;
        if ((rc = kvx__requests_get(c, &r, TIMEOUT_MS)))
            goto fail;
        const Kvxfer__RequestsReply *q = r->requests;
        int n = 0;
        for (size_t i = 0; i < q->n_requests; i++) {
            const Kvxfer__RequestInfo *x = q->requests[i];
            if (x->key.len != strlen(key) ||
                memcmp(x->key.data, key, x->key.len))
                continue;
            if (n && !strcmp(x->instance_id, found))
                continue; /* its other side, or another rank's */
            if (n++ == 0)
                snprintf(found, sizeof(found), "%s", x->instance_id);
            else
                fprintf(stderr, "%s%s", n == 2 ? "" : ", ", x->instance_id);
            if (n == 2)
                fprintf(stderr,
                        "kvxferctl: cancel: %s is in flight in several "
                        "instances; name one with --instance: %s, ",
                        key, found);
        }
        kvxfer__reply__free_unpacked(r, NULL);
        if (n > 1) {
            fprintf(stderr, "\n");
            kvx_close(c);
            return 2;
        }
        if (!n) {
            fprintf(stderr,
                    "kvxferctl: cancel: no request %s in flight "
                    "(kvxferctl requests)\n",
                    key);
            kvx_close(c);
            return 1;
        }
        inst = found;
    }
    if ((rc = kvx__cancel_admin(c, inst, (const uint8_t *)key, strlen(key),
                                TIMEOUT_MS)))
        goto fail;
    printf("kvxferctl: cancelled request %s of instance %s: the daemon "
           "touches its blocks no more\n",
           key, inst);
    kvx_close(c);
    return 0;
fail:
    fprintf(stderr, "kvxferctl: cancel: %s: %s\n", kvx_status_str(rc),
            kvx_last_error(c));
    kvx_close(c);
    return 1;
}

/* metrics, health: the MetricsReply, as text or as an exit status (0
 * healthy, 1 not, or no answer: open_daemon exits 1). */
static int metrics_get(const char *sock, int argc, char **argv, int health)
{
    static const char *const names[] = {NULL};
    int rc;
    if ((rc = flags(argc, argv, names, NULL)))
        return rc;
    kvx_client_t *c = open_daemon(sock);
    Kvxfer__Reply *r = NULL;
    if ((rc = kvx__metrics_get(c, &r, TIMEOUT_MS))) {
        fprintf(stderr, "kvxferctl: %s: %s: %s\n", argv[0], kvx_status_str(rc),
                kvx_last_error(c));
        kvx_close(c);
        return 1;
    }
    const Kvxfer__MetricsReply *m = r->metrics;
    if (health)
        printf("%s\n", m->healthy ? "ok" : m->health);
    else
        fputs(m->text, stdout);
    int out = health && !m->healthy;
    kvxfer__reply__free_unpacked(r, NULL);
    kvx_close(c);
    return out;
}

static int cmd_metrics(const char *sock, int argc, char **argv)
{
    return metrics_get(sock, argc, argv, 0);
}

static int cmd_health(const char *sock, int argc, char **argv)
{
    return metrics_get(sock, argc, argv, 1);
}

/* ---- the commands ------------------------------------------------------ */

/* One entry per command: `kvxferctl NAME ...` runs run(socket, argc,
 * argv) with argv[0] the name; `kvxferctl NAME --help` prints synopsis
 * and help and exits 0. A new command is one entry here. */
typedef struct ctl_cmd {
    const char *name;
    int (*run)(const char *sock, int argc, char **argv);
    const char *synopsis; /* the options, after the name */
    const char *summary;  /* one line for kvxferctl --help */
    const char *help;     /* what it prints or does; its defaults */
} ctl_cmd_t;

static const ctl_cmd_t cmds[] = {
    {"status", cmd_status, "[--json | --config]",
     "the daemon in one page: version, peers, counters, sessions, pools",
     "Version, uptime, address, copy threads, GPU, the peer daemons in\n"
     "one line each kind, bytes moved, transfers, batches, the memory\n"
     "budget, requests by state, errors by code, then the sessions,\n"
     "instances and pools (the first limits.list_page_entries of each).\n"
     "\n"
     "  --json     everything, the configuration included, as JSON\n"
     "  --config   the configuration in effect, one key=value a line\n"},
    {"requests", cmd_requests, "[--done] [--json]",
     "requests in flight with age and state; --done: finished ones",
     "Every request in flight: instance, key, side, state, age and bytes\n"
     "done; what to run when something looks stuck.\n"
     "\n"
     "  --done     the finished requests instead, newest last (the daemon\n"
     "             keeps records.ring of them; one reply lists at most\n"
     "             limits.list_page_entries): instance, key, the instance\n"
     "             the KV came from, path (host, gpu, peer), bytes, start,\n"
     "             duration in microseconds, bandwidth, outcome and code\n"
     "  --json     the same as JSON (--done: the lines of records.file)\n"},
    {"peers", cmd_peers, "",
     "the peer daemons: state, bytes each way, errors, lanes",
     "One line per peer daemon this daemon knows: its address, state\n"
     "(connecting, connected, lost), who connected (out: this daemon),\n"
     "bytes sent and received, errors, lanes, when it was last heard\n"
     "from and the UCX transports its endpoints use.\n"},
    {"drain", cmd_drain, "[--deadline S] [--no-wait]",
     "the upgrade step: finish or end what is in flight, then exit 0",
     "The daemon stops taking connections and requests, lets those in\n"
     "flight finish for S seconds, ends the rest SHUTDOWN and exits 0;\n"
     "kvxferctl waits for that and says what it did.\n"
     "Admins only: root, the daemon's uid and auth.admin_gids.\n"
     "\n"
     "  --deadline S   seconds requests may still finish (default 0)\n"
     "  --no-wait      return once the drain started\n"},
    {"cancel", cmd_cancel, "KEY [--instance ID]",
     "end one request now, as its engine's cancel would (admins)",
     "The request KEY (its key as kvxferctl requests shows it) ends\n"
     "CANCELLED, as a cancel from its own instance would end it: its\n"
     "ranks get the event, its peer daemons are told, and once kvxferctl\n"
     "returns the daemon touches its blocks no more.\n"
     "Admins only: root, the daemon's uid and auth.admin_gids (the rule\n"
     "drain follows).\n"
     "\n"
     "  --instance ID   the instance whose request it is (default: the one\n"
     "                  instance that has KEY in flight; when several do,\n"
     "                  kvxferctl names them and exits 2)\n"},
    {"metrics", cmd_metrics, "",
     "the daemon's metrics as Prometheus text (what /metrics serves)",
     "The daemon's metrics in the Prometheus text format: what its HTTP\n"
     "endpoint (metrics.listen) serves at /metrics, asked over the socket\n"
     "and fresh, whether the endpoint is on or not.\n"},
    {"health", cmd_health, "",
     "ok and exit 0 while the daemon is healthy, else why and exit 1",
     "Prints ok and exits 0 while the daemon is healthy: its loop turns,\n"
     "it is not draining, its loop lag is within\n"
     "metrics.health_max_lag_ms. Else prints why not and exits 1, as also\n"
     "when it does not answer (in 5 s). For exec probes; the HTTP\n"
     "endpoint's /health answers the same.\n"},
    {"plan", cmd_plan, "[options] | --from FILE",
     "the slices each generation rank would pull (no daemon needed)",
     "The plan the daemon would build for two instance configurations,\n"
     "computed here with its planner: per generation rank, the context\n"
     "ranks, layers and heads it pulls, and the bytes.\n"
     "\n"
     "  --ctx-tp N, --gen-tp N      tensor parallel size (default 1)\n"
     "  --ctx-pp N, --gen-pp N      pipeline parallel size (default 1)\n"
     "  --heads H                   total KV heads (default 8)\n"
     "  --layers L                  total layers (default 32)\n"
     "  --head-dim D                both sides' head dim (default 128)\n"
     "  --ctx-head-dim/--gen-head-dim D   one side's (default 128)\n"
     "  --ctx-dtype/--gen-dtype T   fp32, fp16, bf16, fp8, int8\n"
     "                              (default bf16)\n"
     "  --ctx-tokens-per-block T, --gen-tokens-per-block T\n"
     "                              (default 16)\n"
     "  --tokens N                  tokens of the request (default 4\n"
     "                              context blocks: 64)\n"
     "  --skip-tokens N             prefix already on the generation\n"
     "                              side (default 0)\n"
     "  --gen-dp D                  attention DP groups (default 1: none)\n"
     "  --mla                       one latent head, K only (default off)\n"
     "  --from FILE                 a YAML file with sections context:,\n"
     "                              generation:, model:, request:\n"
     "                              (docs/operations.md); options before\n"
     "                              it are its defaults, after it win\n"},
};

#define NCMDS (sizeof(cmds) / sizeof(cmds[0]))

static void usage(FILE *f)
{
    fprintf(f, "usage: kvxferctl [--socket PATH] COMMAND [options]\n"
               "       kvxferctl COMMAND --help\n"
               "       kvxferctl --version\n\ncommands:\n");
    for (size_t i = 0; i < NCMDS; i++)
        fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].summary);
    fprintf(f,
            "\n  --socket PATH   daemon socket (default %s)\n"
            "  --version       kvxferctl's version and protocol\n",
            KVX_DEFAULT_SOCKET);
}

static void cmd_help(const ctl_cmd_t *c)
{
    printf("usage: kvxferctl [--socket PATH] %s %s\n\n%s", c->name, c->synopsis,
           c->help);
}

int main(int argc, char **argv)
{
    const char *sock = NULL;
    int i = 1;
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc)
            sock = argv[++i];
        else if (!strncmp(argv[i], "--socket=", 9))
            sock = argv[i] + 9;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--version")) {
            printf("kvxferctl %s (protocol %d.%d)\n", KVX_VERSION_STRING,
                   KVX_PROTOCOL_MAJOR, KVX_PROTOCOL_MINOR);
            return 0;
        } else
            break;
    }
    if (i >= argc) {
        usage(stderr);
        return 2;
    }
    const ctl_cmd_t *c = NULL;
    for (size_t k = 0; k < NCMDS && !c; k++)
        if (!strcmp(argv[i], cmds[k].name))
            c = &cmds[k];
    if (!c) {
        fprintf(stderr, "kvxferctl: unknown command '%s'\n", argv[i]);
        usage(stderr);
        return 2;
    }
    for (int k = i + 1; k < argc; k++)
        if (!strcmp(argv[k], "--help") || !strcmp(argv[k], "-h")) {
            cmd_help(c);
            return 0;
        }
    return c->run(sock, argc - i, argv + i);
}
