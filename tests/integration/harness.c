/*
 * harness.c — what every integration test stands on (included first by
 * integration.c): small utilities; kvxferd started in a temp dir,
 * stopped, its log and status read; library call checks; rank processes
 * and the shared flag that stops them; the model, an engine rank's share
 * of it and its host pool; the reference pattern, filled and checked;
 * events polled and matched; raw sockets for hand-built frames.
 */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvxfer.h"
#include "kvxfer.pb-c.h"
#include "tests/test.h"

#define T_MS 10000 /* timeout of one library call */

/* ---- small utilities -------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static void *shm_alloc(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    CHECK(p != MAP_FAILED);
    return p;
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return strdup("");
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (cap - len < 4096) {
            cap = cap ? cap * 2 : 8192;
            char *nb = realloc(buf, cap + 1);
            CHECK(nb != NULL);
            buf = nb;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        if (n == 0)
            break;
        len += n;
    }
    fclose(f);
    buf[len] = 0;
    return buf;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs(text, f);
    CHECK(fclose(f) == 0);
}

/* Number of non-overlapping occurrences of needle in hay. */
static int count_str(const char *hay, const char *needle)
{
    int n = 0;
    size_t l = strlen(needle);
    for (const char *p = hay; (p = strstr(p, needle)); p += l)
        n++;
    return n;
}

/* The unsigned number after "key": in a JSON text, or -1. */
static long long json_num(const char *json, const char *key)
{
    char pat[128];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(json, pat);
    if (!p)
        return -1;
    return strtoll(p + strlen(pat), NULL, 10);
}

/* ---- the daemon ------------------------------------------------------- */

typedef struct daemon {
    pid_t pid;
    int reaped, status;
    int lfd; /* socket activation: the listening socket (0: none) */
    char dir[96], sock[128], log[128], cfg[128];
} daemon_t;

#define MAX_DAEMONS 40 /* peer_handshake_flood starts 33 */
static daemon_t h_daemons[MAX_DAEMONS];
static int h_ndaemons;
static pid_t h_owner;            /* the test process */
static _Atomic int *h_fail_flag; /* shared with rank processes */
static int h_dir_seq;
/* Peer tests (peer_harness.c): the network namespace the next daemon_start2
 * runs in (NULL: ours), and what h_cleanup undoes after the daemons. */
static const char *h_netns;
static const char *h_preload; /* LD_PRELOAD of the next daemon_start() */
/* The next daemon_start() is socket-activated: the test binds and
 * listens on its socket path and passes it as fd 3 (LISTEN_FDS=1,
 * LISTEN_PID), at every daemon_restart() too, as systemd does. */
static int h_activate;
static void (*h_cleanup_hook)(void);

static const char *build_dir(void)
{
    const char *b = getenv("KVX_BUILD");
    return b && *b ? b : "build";
}

static void dump_tail(const char *path, int lines)
{
    char *text = read_file(path);
    size_t len = strlen(text);
    const char *p = text + len;
    int n = 0;
    while (p > text && n <= lines) {
        p--;
        if (*p == '\n')
            n++;
    }
    if (*p == '\n')
        p++;
    fprintf(stderr, "---- %s (last %d lines) ----\n%s---- end ----\n", path,
            lines, p);
    free(text);
}

static void h_cleanup(int failed)
{
    for (int i = 0; i < h_ndaemons; i++) {
        daemon_t *d = &h_daemons[i];
        if (failed)
            dump_tail(d->log, 40);
        if (!d->reaped && d->pid > 0) {
            kill(d->pid, SIGKILL);
            waitpid(d->pid, NULL, 0);
            d->reaped = 1;
        }
        if (!failed) {
            char cmd[160];
            snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
            (void)!system(cmd);
        }
    }
    h_ndaemons = 0;
    if (h_cleanup_hook)
        h_cleanup_hook();
}

static void h_on_exit(int status, void *arg)
{
    (void)arg;
    if (getpid() != h_owner) { /* a rank process */
        if (status != 0 && h_fail_flag)
            atomic_store(h_fail_flag, 1);
        return;
    }
    h_cleanup(status != 0);
}

static void h_on_alarm(int sig)
{
    (void)sig;
    if (getpid() == h_owner) {
        fprintf(stderr, "timeout: the test ran past its limit\n");
        h_cleanup(1);
    }
    signal(SIGALRM, SIG_DFL);
    raise(SIGALRM);
}

static void h_init(void)
{
    if (h_owner == getpid())
        return;
    h_owner = getpid();
    h_ndaemons = 0;
    h_fail_flag = shm_alloc(sizeof(*h_fail_flag));
    on_exit(h_on_exit, NULL);
    signal(SIGALRM, h_on_alarm);
}

static void daemon_exec(daemon_t *d);

/* Start kvxferd with socket.path in a fresh temp dir. socket_extra: more
 * lines of the socket section ("  mode: 0666\n"); extra: whole sections. */
static daemon_t *daemon_start2(const char *socket_extra, const char *extra)
{
    h_init();
    CHECK(h_ndaemons < MAX_DAEMONS);
    daemon_t *d = &h_daemons[h_ndaemons];
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/kvx-it-%d-%d", (int)getpid(),
             h_dir_seq++);
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
    (void)!system(cmd);
    CHECK(mkdir(d->dir, 0755) == 0);
    chmod(d->dir, 0755);
    char dir[sizeof(d->dir)];
    memcpy(dir, d->dir, sizeof(dir));
    snprintf(d->sock, sizeof(d->sock), "%s/kvxferd.sock", dir);
    snprintf(d->log, sizeof(d->log), "%s/kvxferd.log", dir);
    snprintf(d->cfg, sizeof(d->cfg), "%s/kvxferd.yaml", dir);
    char cfg[4096];
    snprintf(cfg, sizeof(cfg), "socket:\n  path: %s\n%s%s", d->sock,
             socket_extra ? socket_extra : "", extra ? extra : "");
    write_file(d->cfg, cfg);
    h_ndaemons++;
    daemon_exec(d);
    return d;
}

/* Run kvxferd on d's config and wait for its socket. */
static void daemon_exec(daemon_t *d)
{
    char exe[256];
    snprintf(exe, sizeof(exe), "%s/kvxferd", build_dir());
    if (h_activate && !d->lfd) {
        int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        CHECK(strlen(d->sock) < sizeof(sa.sun_path));
        memcpy(sa.sun_path, d->sock, strlen(d->sock) + 1);
        CHECK(l >= 0);
        if (l <= 3) { /* dup2(l, 3) below must make a copy */
            int h = fcntl(l, F_DUPFD_CLOEXEC, 10);
            CHECK(h > 3);
            close(l);
            l = h;
        }
        CHECK(bind(l, (struct sockaddr *)&sa, sizeof(sa)) == 0);
        CHECK(listen(l, 64) == 0);
        d->lfd = l;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        if (d->lfd) { /* sd_listen_fds(): fd 3, for this pid */
            char pidbuf[24];
            dup2(d->lfd, 3); /* the copy has no FD_CLOEXEC */
            snprintf(pidbuf, sizeof(pidbuf), "%d", (int)getpid());
            setenv("LISTEN_FDS", "1", 1);
            setenv("LISTEN_PID", pidbuf, 1);
        }
        signal(SIGALRM, SIG_DFL);
        alarm(0);
        if (h_preload) {
            setenv("LD_PRELOAD", h_preload, 1);
            /* an ASan daemon: its runtime no longer comes first */
            const char *a = getenv("ASAN_OPTIONS");
            char opt[512];
            snprintf(opt, sizeof(opt), "%s%sverify_asan_link_order=0",
                     a ? a : "", a && *a ? ":" : "");
            setenv("ASAN_OPTIONS", opt, 1);
        }
        if (h_netns) /* ip execs in place: the pid stays the daemon's */
            execlp("ip", "ip", "netns", "exec", h_netns, exe, "--config",
                   d->cfg, (char *)NULL);
        else
            execl(exe, exe, "--config", d->cfg, (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", exe, strerror(errno));
        _exit(127);
    }
    d->pid = pid;
    int64_t end = now_ms() + 10000;
    for (;;) {
        kvx_client_t *c;
        if (kvx_connect_observer(d->sock, 200, &c) == 0) {
            /* an activated socket connects before the daemon runs: its
             * answer says it does */
            char *json = NULL;
            int rc = d->lfd ? kvx_status_json(c, &json, 200) : 0;
            free(json);
            kvx_close(c);
            if (!rc)
                break;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            d->reaped = 1;
            d->status = st;
            fprintf(stderr, "daemon exited during start (status %d)\n", st);
            CHECK(!"daemon started");
        }
        CHECK(now_ms() < end);
        sleep_ms(10);
    }
}

/* A new kvxferd on the config, socket path and log of d, whose process
 * has ended (killed, stopped): a restart. */
static void daemon_restart(daemon_t *d)
{
    CHECK(d->reaped);
    d->reaped = 0;
    d->status = 0;
    daemon_exec(d);
}

static daemon_t *daemon_start(const char *extra)
{
    return daemon_start2(NULL, extra);
}

/* daemon_start() with KVXFERD_FAULT=fault (fault.h) for this daemon only */
static daemon_t *daemon_start_fault(const char *fault, const char *extra)
{
    setenv("KVXFERD_FAULT", fault, 1);
    daemon_t *d = daemon_start(extra);
    unsetenv("KVXFERD_FAULT");
    return d;
}

/* Wait for the daemon to exit within timeout_ms; returns the wait status,
 * or -1 on timeout. */
static int daemon_wait(daemon_t *d, int timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    while (!d->reaped) {
        int st;
        pid_t p = waitpid(d->pid, &st, WNOHANG);
        if (p == d->pid) {
            d->reaped = 1;
            d->status = st;
            break;
        }
        if (now_ms() >= end)
            return -1;
        sleep_ms(5);
    }
    return d->status;
}

/* The last daemon started, reaped, is forgotten (its directory removed),
 * so that a test can start another in its place, again and again. */
static void daemon_forget(daemon_t *d)
{
    CHECK(h_ndaemons > 0 && d == &h_daemons[h_ndaemons - 1] && d->reaped);
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
    (void)!system(cmd);
    h_ndaemons--;
}

/* SIGTERM, wait; returns the wait status (-1: did not exit in 10 s). */
static int daemon_stop(daemon_t *d)
{
    if (!d->reaped)
        kill(d->pid, SIGTERM);
    return daemon_wait(d, 10000);
}

static void daemon_stop_ok(daemon_t *d)
{
    int st = daemon_stop(d);
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "daemon did not exit 0 on SIGTERM (status %d%s)\n", st,
                st == -1 ? ": still running" : "");
        CHECK(!"daemon exits 0");
    }
}

static int log_contains(daemon_t *d, const char *what)
{
    char *t = read_file(d->log);
    int r = strstr(t, what) != NULL;
    free(t);
    return r;
}

/* Wait up to timeout_ms for the daemon log to contain what. */
static int log_wait(daemon_t *d, const char *what, int timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        if (log_contains(d, what))
            return 1;
        if (now_ms() >= end)
            return 0;
        sleep_ms(10);
    }
}

/* How many times the daemon log holds what. */
static int log_count(daemon_t *d, const char *what)
{
    char *t = read_file(d->log);
    int n = 0;
    for (const char *p = t; (p = strstr(p, what)); p += strlen(what))
        n++;
    free(t);
    return n;
}

/* Wait up to timeout_ms for what to be in the log more than n times: a
 * line that an earlier event also wrote (a second SIGHUP's). */
static int log_wait_more(daemon_t *d, const char *what, int n, int timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    while (log_count(d, what) <= n) {
        if (now_ms() >= end)
            return 0;
        sleep_ms(10);
    }
    return 1;
}

/* The daemon answers a status request on a fresh connection. */
static void daemon_healthy(daemon_t *d)
{
    CHECK(!d->reaped && waitpid(d->pid, NULL, WNOHANG) == 0);
    kvx_client_t *c;
    int rc = kvx_connect_observer(d->sock, T_MS, &c);
    CHECK_EQ(rc, 0);
    char *json = NULL;
    rc = kvx_status_json(c, &json, T_MS);
    if (rc)
        fprintf(stderr, "status: %s: %s\n", kvx_status_name(rc),
                kvx_last_error(c));
    CHECK_EQ(rc, 0);
    CHECK_STR_CONTAINS(json, "\"version\":\"" KVX_VERSION_STRING "\"");
    free(json);
    kvx_close(c);
}

static char *status_json(daemon_t *d)
{
    kvx_client_t *c;
    CHECK_EQ(kvx_connect_observer(d->sock, T_MS, &c), 0);
    char *json = NULL;
    CHECK_EQ(kvx_status_json(c, &json, T_MS), 0);
    kvx_close(c);
    return json;
}

/* Pools listed in the top-level "pools" array of a status JSON. */
static int json_pool_count(const char *json)
{
    const char *p = strstr(json, "\"pools\":[");
    CHECK(p != NULL);
    const char *e = strchr(p, ']');
    CHECK(e != NULL);
    int n = 0;
    for (const char *q = p; (q = strstr(q, "\"pool_id\":")) && q < e; q++)
        n++;
    return n;
}

/* Counts /proc/PID/fd with readdir, never with popen("ls"): the child of a
 * popen() can list the parent's fds before the parent has closed its end of
 * the pipe, and so count one fd too many now and then. For our own pid the
 * directory's own fd is counted every time, which cancels in comparisons. */
static int count_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *dir = opendir(path);
    CHECK(dir != NULL);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)))
        if (e->d_name[0] != '.')
            n++;
    closedir(dir);
    return n;
}

/* CPU seconds process pid has used (user + system). */
static double cpu_seconds(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    /* after "(comm) ": state is field 3, utime 14, stime 15 */
    char *p = strrchr(buf, ')');
    CHECK(p != NULL);
    unsigned long long ut = 0, st = 0;
    CHECK(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                 &ut, &st) == 2);
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static int count_pool_maps(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
    char *t = read_file(path);
    int n = count_str(t, "kvxfer-pool");
    free(t);
    return n;
}

/* ---- library call checks ---------------------------------------------- */

#define CHECK_KVX(call, client)                                                \
    do {                                                                       \
        int rc_ = (call);                                                      \
        if (rc_) {                                                             \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__,       \
                    #call, kvx_status_name(rc_),                               \
                    (client) ? kvx_last_error(client) : "");                   \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

/* call must fail with code, and the daemon's message must contain text. */
#define CHECK_FAILS(call, client, code, text)                                  \
    do {                                                                       \
        int rc_ = (call);                                                      \
        if (rc_ != (code)) {                                                   \
            fprintf(stderr, "%s:%d: %s -> %s (%d), expected %s: %s\n",         \
                    __FILE__, __LINE__, #call, kvx_status_name(rc_), rc_,      \
                    kvx_status_name(code), kvx_last_error(client));            \
            exit(1);                                                           \
        }                                                                      \
        CHECK_STR_CONTAINS(kvx_last_error(client), (text));                    \
    } while (0)

/* ---- rank processes --------------------------------------------------- */

static pid_t spawn(void (*fn)(void *), void *arg)
{
    h_init();
    fflush(stdout);
    fflush(stderr);
    pid_t p = fork();
    CHECK(p >= 0);
    if (p == 0) {
        signal(SIGALRM, SIG_DFL);
        fn(arg);
        fflush(stdout);
        fflush(stderr);
        _exit(0);
    }
    return p;
}

static int failed_flag(void)
{
    return h_fail_flag && atomic_load(h_fail_flag);
}

/* A rank process bails out when another failed. */
static void bail_if_failed(void)
{
    if (failed_flag()) {
        fflush(stderr);
        _exit(3);
    }
}

/* Wait for every child; 1 if all exited 0 within timeout_ms. */
static int wait_children(const pid_t *pids, int n, int timeout_ms)
{
    int ok = 1, left = n;
    int done[64] = {0};
    CHECK(n <= 64);
    int64_t end = now_ms() + timeout_ms;
    while (left > 0) {
        for (int i = 0; i < n; i++) {
            if (done[i])
                continue;
            int st;
            pid_t p = waitpid(pids[i], &st, WNOHANG);
            if (p != pids[i])
                continue;
            done[i] = 1;
            left--;
            if (!WIFEXITED(st) || WEXITSTATUS(st)) {
                fprintf(stderr, "rank process %d failed: %s %d\n", (int)pids[i],
                        WIFSIGNALED(st) ? "signal" : "exit",
                        WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
                ok = 0;
                if (h_fail_flag)
                    atomic_store(h_fail_flag, 1);
            }
        }
        if (left && now_ms() > end) {
            fprintf(stderr, "rank processes still running after %d ms\n",
                    timeout_ms);
            for (int i = 0; i < n; i++)
                if (!done[i]) {
                    kill(pids[i], SIGKILL);
                    waitpid(pids[i], NULL, 0);
                }
            return 0;
        }
        if (left)
            sleep_ms(2);
    }
    return ok;
}

/* Spin until *ctr reaches n (or another process failed / 15 s pass). */
static void wait_count(_Atomic int *ctr, int n)
{
    int64_t end = now_ms() + 15000;
    while (atomic_load(ctr) < n) {
        bail_if_failed();
        if (now_ms() > end) {
            fprintf(stderr, "wait_count: %d of %d after 15 s\n",
                    atomic_load(ctr), n);
            exit(1);
        }
        sleep_ms(1);
    }
}

static void barrier(_Atomic int *ctr, int n)
{
    atomic_fetch_add(ctr, 1);
    wait_count(ctr, n);
}

/* Context params passed from a context rank to generation ranks. */
#define SLOT_MAX 4096
typedef struct pslot {
    _Atomic int ready;
    uint32_t len;
    uint8_t data[SLOT_MAX];
} pslot_t;

static void slot_put(pslot_t *s, const kvx_context_params_t *p)
{
    CHECK(p->len <= SLOT_MAX);
    memcpy(s->data, p->data, p->len);
    s->len = (uint32_t)p->len;
    atomic_store(&s->ready, 1);
}

static void slot_wait(pslot_t *s)
{
    wait_count(&s->ready, 1);
}

/* ---- the model, ranks and pools --------------------------------------- */

typedef struct model {
    uint32_t layers, heads, head_dim, kv;
    kvx_dtype_t dtype;
} model_t;

typedef struct side {
    const char *inst;
    kvx_role_t role;
    uint32_t tp, pp;
    const char *preset;
    uint32_t tpb;
    const uint32_t *layers_per_pp; /* NULL: even split */
    uint32_t dp;                   /* attention DP groups (0/1: none) */
    /* regions of each rank's pool: 0 one allocation, 1 a region per
     * layer (vLLM), 2 a K and a V region per layer (SGLang); split pools
     * lie in one memfd, in reverse order with gaps (left at the
     * sentinel, checked) */
    uint32_t split;
} side_t;

typedef struct rank {
    kvx_client_t *c;
    const model_t *m;
    const side_t *s;
    uint32_t rank, tp_rank, pp_rank;
    uint32_t layer0, nlayers, head0, nheads; /* global ranges held */
    kvx_layout_t lay;
    uint8_t *base; /* split pools: the memfd holding every region */
    uint64_t size;
    uint32_t pool;
    char addr[192];
    kvx_layout_part_t parts[2 * 64]; /* split pools: lay.parts */
    uint64_t roff[2 * 64];           /* each region's offset from base */
} rank_t;

/* This rank's share of the model, computed here from the design's rules
 * (heads split evenly over tp, replicated when tp > heads; layers split
 * by layers_per_pp or evenly with the remainder to the first PP ranks). */
static void rank_share(rank_t *r)
{
    const model_t *m = r->m;
    const side_t *s = r->s;
    r->tp_rank = r->rank % s->tp;
    r->pp_rank = r->rank / s->tp;
    /* attention DP: heads split inside a group of tp/dp ranks */
    uint32_t tp = s->dp > 1 ? s->tp / s->dp : s->tp;
    uint32_t tpr = r->tp_rank % tp;
    if (tp <= m->heads) {
        r->nheads = m->heads / tp;
        r->head0 = tpr * r->nheads;
    } else {
        r->nheads = 1;
        r->head0 = tpr / (tp / m->heads);
    }
    if (s->layers_per_pp) {
        r->layer0 = 0;
        for (uint32_t i = 0; i < r->pp_rank; i++)
            r->layer0 += s->layers_per_pp[i];
        r->nlayers = s->layers_per_pp[r->pp_rank];
    } else {
        uint32_t base = m->layers / s->pp, rem = m->layers % s->pp;
        r->layer0 = r->pp_rank * base + (r->pp_rank < rem ? r->pp_rank : rem);
        r->nlayers = base + (r->pp_rank < rem);
    }
}

static kvx_hello_t rank_hello(const rank_t *r)
{
    kvx_hello_t h = {
        .instance_id = r->s->inst,
        .role = r->s->role,
        .rank = r->rank,
        .parallel = {.tp = r->s->tp,
                     .pp = r->s->pp,
                     .cp = 1,
                     .total_layers = r->m->layers,
                     .total_kv_heads = r->m->heads,
                     .layers_per_pp = r->s->layers_per_pp,
                     .num_layers_per_pp = r->s->layers_per_pp ? r->s->pp : 0,
                     .attention_dp = r->s->dp}};
    return h;
}

/* Connect and say hello (no join). */
static void rank_hello_only(daemon_t *d, const model_t *m, const side_t *s,
                            uint32_t rank, rank_t *r)
{
    memset(r, 0, sizeof(*r));
    r->m = m;
    r->s = s;
    r->rank = rank;
    rank_share(r);
    kvx_hello_t h = rank_hello(r);
    int rc = kvx_connect(d->sock, &h, T_MS, &r->c);
    if (rc)
        fprintf(stderr, "connect %s rank %u: %s\n", s->inst, rank,
                kvx_status_name(rc));
    CHECK_EQ(rc, 0);
    CHECK_KVX(kvx_daemon_address(r->c, r->addr, sizeof(r->addr)), r->c);
}

static void rank_join(rank_t *r)
{
    uint32_t n = r->s->tp * r->s->pp;
    const char *addrs[64];
    CHECK(n <= 64);
    for (uint32_t i = 0; i < n; i++)
        addrs[i] = r->addr; /* every rank on this one daemon */
    CHECK_KVX(kvx_join(r->c, addrs, n, T_MS), r->c);
}

static void rank_layout(rank_t *r, uint32_t nblocks, kvx_layout_t *out)
{
    int rc =
        kvx_layout_preset(r->s->preset, r->nlayers, r->m->kv, r->nheads,
                          r->m->head_dim, r->m->dtype, r->s->tpb, nblocks, out);
    if (rc)
        fprintf(stderr, "kvx_layout_preset(%s) refused the shape\n",
                r->s->preset);
    CHECK_EQ(rc, 0);
}

/* A pool of regions (side split): one memfd, regions placed last first
 * with a gap of 64 + region bytes after each. */
static void rank_pool_split(rank_t *r)
{
    kvx_layout_t *l = &r->lay;
    CHECK(l->num_layers * l->kv_factor <= 2 * 64);
    CHECK_KVX(kvx_layout_split(l, r->s->split, r->parts, 2 * 64), r->c);
    uint32_t n = kvx_layout_num_regions(l);
    kvx_host_region_t reg[2 * 64];
    uint64_t at = 0;
    for (uint32_t i = n; i-- > 0;) {
        r->roff[i] = at;
        at += kvx_layout_region_span(l, i) + 64 + i;
    }
    r->size = at;
    int fd = memfd_create("kvx-regions", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0 && ftruncate(fd, (off_t)r->size) == 0 &&
          fallocate(fd, 0, 0, (off_t)r->size) == 0 &&
          fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    r->base = mmap(NULL, r->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(r->base != MAP_FAILED);
    for (uint32_t i = 0; i < n; i++)
        reg[i] =
            (kvx_host_region_t){fd, r->roff[i], kvx_layout_region_span(l, i)};
    CHECK_KVX(kvx_pool_register_host_regions(r->c, l, reg, n, &r->pool, T_MS),
              r->c);
    close(fd); /* the daemon and our mapping keep it */
}

/* Where element (local layer, kv, block, token, local head) of r's pool
 * lies in this process. */
static uint8_t *rank_at(const rank_t *r, uint8_t *base, uint32_t ly,
                        uint32_t kv, uint32_t blk, uint32_t tok, uint32_t h)
{
    const kvx_layout_t *l = &r->lay;
    uint64_t ro = l->parts ? r->roff[kvx_layout_region(l, ly, kv)] : 0;
    return base + ro + kvx_layout_offset(l, ly, kv, blk, tok, h);
}

static void rank_pool(rank_t *r, uint32_t nblocks)
{
    rank_layout(r, nblocks, &r->lay);
    if (r->s->split) {
        rank_pool_split(r);
        return;
    }
    r->size = kvx_layout_span(&r->lay);
    CHECK(r->size > 0);
    void *base;
    CHECK_KVX(
        kvx_pool_create_host(r->c, &r->lay, r->size, &base, &r->pool, T_MS),
        r->c);
    r->base = base;
}

/* Connect, join and register a pool of nblocks. */
static void rank_open(daemon_t *d, const model_t *m, const side_t *s,
                      uint32_t rank, uint32_t nblocks, rank_t *r)
{
    rank_hello_only(d, m, s, rank, r);
    rank_join(r);
    rank_pool(r, nblocks);
}

static void rank_close(rank_t *r)
{
    kvx_close(r->c);
    r->c = NULL;
}

/* ---- the reference pattern -------------------------------------------- */

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* The bytes of the head_dim elements of (request, global layer, kv,
 * global token, global head): a function of those and of d only. */
static void row_fill(uint8_t *dst, uint32_t rowbytes, uint64_t req, uint32_t l,
                     uint32_t kv, uint32_t t, uint32_t h)
{
    uint64_t seed = mix64(req * 0x9E3779B97F4A7C15ULL ^
                          mix64(((uint64_t)l << 40) ^ ((uint64_t)kv << 36) ^
                                ((uint64_t)t << 12) ^ h));
    for (uint32_t i = 0; i < rowbytes; i += 8) {
        uint64_t w = mix64(seed + i);
        uint32_t n = rowbytes - i < 8 ? rowbytes - i : 8;
        memcpy(dst + i, &w, n);
    }
}

/* Block i of a request's block table. */
typedef uint32_t (*block_fn)(uint32_t req_index, uint32_t i);

/* Write the pattern of tokens [0, ntok) of req into the rank's pool. */
static void fill_req(const rank_t *r, uint64_t req, const uint32_t *blocks,
                     uint32_t ntok)
{
    const kvx_layout_t *l = &r->lay;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    for (uint32_t t = 0; t < ntok; t++)
        for (uint32_t ly = 0; ly < l->num_layers; ly++)
            for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                for (uint32_t h = 0; h < l->num_heads; h++)
                    row_fill(rank_at(r, r->base, ly, kv,
                                     blocks[t / l->tokens_per_block],
                                     t % l->tokens_per_block, h),
                             rowbytes, req, r->layer0 + ly, kv, t,
                             r->head0 + h);
}

typedef struct expect {
    uint64_t req;
    const uint32_t *blocks;
    uint32_t ntok, skip;
} expect_t;

/* Compare the whole pool with what it must hold: the pattern of tokens
 * [skip, ntok) of every expected request, the sentinel everywhere else.
 * Returns the number of differing bytes (first few described). */
static uint64_t check_pool(const rank_t *r, const expect_t *e, int n,
                           uint8_t sentinel)
{
    const kvx_layout_t *l = &r->lay;
    uint32_t rowbytes = l->head_dim * l->elem_size;
    uint8_t *img = malloc(r->size);
    CHECK(img != NULL);
    memset(img, sentinel, r->size);
    for (int k = 0; k < n; k++)
        for (uint32_t t = e[k].skip; t < e[k].ntok; t++)
            for (uint32_t ly = 0; ly < l->num_layers; ly++)
                for (uint32_t kv = 0; kv < l->kv_factor; kv++)
                    for (uint32_t h = 0; h < l->num_heads; h++)
                        row_fill(rank_at(r, img, ly, kv,
                                         e[k].blocks[t / l->tokens_per_block],
                                         t % l->tokens_per_block, h),
                                 rowbytes, e[k].req, r->layer0 + ly, kv, t,
                                 r->head0 + h);
    uint64_t bad = 0;
    if (memcmp(img, r->base, r->size)) {
        for (uint64_t i = 0; i < r->size; i++)
            if (img[i] != r->base[i]) {
                if (bad < 3)
                    fprintf(stderr,
                            "%s rank %u pool byte %llu: 0x%02x, expected "
                            "0x%02x\n",
                            r->s->inst, r->rank, (unsigned long long)i,
                            r->base[i], img[i]);
                bad++;
            }
        fprintf(stderr, "%s rank %u: %llu of %llu pool bytes differ\n",
                r->s->inst, r->rank, (unsigned long long)bad,
                (unsigned long long)r->size);
    }
    free(img);
    return bad;
}

/* ---- events ----------------------------------------------------------- */

typedef struct ev {
    uint64_t req;
    int kind, code;
    char msg[200];
    uint8_t key[KVX_MAX_KEY];
    uint32_t key_len;
    uint32_t aux_len; /* the event's aux payload: its length, */
    uint64_t aux_sum; /* aux_sum() of its bytes (0 without), */
    uint8_t aux[16];  /* and its first bytes */
} ev_t;

/* FNV-1a of n bytes: an event's aux compared without keeping it. */
static uint64_t aux_sum(const void *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
    return n ? h : 0;
}

static const char *kind_name(int k)
{
    switch (k) {
    case KVX_EVENT_COMPLETE:
        return "COMPLETE";
    case KVX_EVENT_ERROR:
        return "ERROR";
    case KVX_EVENT_CANCELLED:
        return "CANCELLED";
    case KVX_EVENT_TIMED_OUT:
        return "TIMED_OUT";
    default:
        return "?";
    }
}

/* Poll until want events arrived or timeout_ms passed; returns how many
 * arrived (events beyond max are counted, not stored). */
static int collect(kvx_client_t *c, ev_t *out, int max, int want,
                   int timeout_ms)
{
    int n = 0;
    int64_t end = now_ms() + timeout_ms;
    while (n < want) {
        int64_t left = end - now_ms();
        if (left <= 0)
            break;
        kvx_batch_t *b;
        int rc = kvx_poll(c, (uint32_t)(want - n),
                          (uint32_t)(left < 300 ? left : 300), &b);
        if (rc) {
            fprintf(stderr, "poll: %s: %s\n", kvx_status_name(rc),
                    kvx_last_error(c));
            CHECK_EQ(rc, 0);
        }
        for (uint32_t i = 0; i < b->num_events; i++, n++)
            if (n < max) {
                out[n].req = b->events[i].request_id;
                out[n].kind = b->events[i].kind;
                out[n].code = b->events[i].code;
                snprintf(out[n].msg, sizeof(out[n].msg), "%s",
                         b->events[i].message);
                out[n].key_len = b->events[i].key_len;
                memcpy(out[n].key, b->events[i].key, b->events[i].key_len);
                const kvx_event_t *e = &b->events[i];
                CHECK((e->aux == NULL) == (e->aux_len == 0));
                out[n].aux_len = e->aux_len;
                out[n].aux_sum = aux_sum(e->aux, e->aux_len);
                memset(out[n].aux, 0, sizeof(out[n].aux));
                if (e->aux_len)
                    memcpy(out[n].aux, e->aux,
                           e->aux_len < sizeof(out[n].aux)
                               ? e->aux_len
                               : sizeof(out[n].aux));
            }
        kvx_batch_free(b);
    }
    return n;
}

static void print_events(const char *who, const ev_t *e, int n)
{
    for (int i = 0; i < n; i++)
        fprintf(stderr, "  %s event: request %llu %s %s \"%s\"\n", who,
                (unsigned long long)e[i].req, kind_name(e[i].kind),
                kvx_status_name(e[i].code), e[i].msg);
}

/* Exactly one event for req among e[0..n), of this kind and code. */
static const ev_t *expect_event(const ev_t *e, int n, uint64_t req, int kind,
                                int code)
{
    const ev_t *found = NULL;
    int count = 0;
    for (int i = 0; i < n; i++)
        if (e[i].req == req) {
            found = &e[i];
            count++;
        }
    if (count != 1 || found->kind != kind || found->code != code) {
        fprintf(stderr,
                "request %llu: expected one %s event with code %s, got %d "
                "event(s):\n",
                (unsigned long long)req, kind_name(kind), kvx_status_name(code),
                count);
        print_events("got", e, n);
        CHECK(!"expected event");
    }
    return found;
}

/* Poll until the event of req arrives and check it; any other event on
 * the way is a failure (tests consume every event they cause). */
static ev_t wait_event(kvx_client_t *c, uint64_t req, int kind, int code,
                       int timeout_ms)
{
    ev_t e[16];
    int64_t end = now_ms() + timeout_ms;
    int n = 0;
    while (n == 0) {
        int64_t left = end - now_ms();
        if (left <= 0)
            break;
        n = collect(c, e, 16, 1, (int)left);
    }
    if (n == 0)
        fprintf(stderr, "no event for request %llu within %d ms\n",
                (unsigned long long)req, timeout_ms);
    CHECK(n >= 1);
    if (n > 16)
        n = 16;
    for (int i = 0; i < n; i++)
        if (e[i].req != req) {
            fprintf(stderr,
                    "unexpected event while waiting for request "
                    "%llu:\n",
                    (unsigned long long)req);
            print_events("got", e, n);
            CHECK(!"only the expected event");
        }
    return *expect_event(e, n, req, kind, code);
}

/* ---- raw sockets ------------------------------------------------------ */

static int raw_connect(daemon_t *d)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    CHECK(strlen(d->sock) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, d->sock, strlen(d->sock) + 1);
    CHECK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    return fd;
}

static void raw_send(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        CHECK(k > 0);
        p += k;
        n -= (size_t)k;
    }
}

static void raw_send_len(int fd, uint32_t len)
{
    uint8_t h[4] = {len & 0xff, (len >> 8) & 0xff, (len >> 16) & 0xff,
                    (len >> 24) & 0xff};
    raw_send(fd, h, 4);
}

static void raw_send_request(int fd, Kvxfer__Request *rq)
{
    size_t n = kvxfer__request__get_packed_size(rq);
    uint8_t *buf = malloc(n + 1);
    CHECK(buf != NULL);
    kvxfer__request__pack(rq, buf);
    raw_send_len(fd, (uint32_t)n);
    raw_send(fd, buf, n);
    free(buf);
}

/* Read exactly n bytes; 0 on EOF/timeout before that. */
static int raw_read(int fd, void *buf, size_t n, int timeout_ms)
{
    uint8_t *p = buf;
    int64_t end = now_ms() + timeout_ms;
    while (n) {
        struct pollfd pf = {fd, POLLIN, 0};
        int64_t left = end - now_ms();
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
            return 0;
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return 0;
        p += k;
        n -= (size_t)k;
    }
    return 1;
}

/* The next reply frame, or NULL (closed / nothing within timeout). */
static Kvxfer__Reply *raw_reply(int fd, int timeout_ms)
{
    uint8_t h[4];
    if (!raw_read(fd, h, 4, timeout_ms))
        return NULL;
    uint32_t len = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                   (uint32_t)h[3] << 24;
    CHECK(len < (1u << 24));
    uint8_t *buf = malloc(len + 1);
    CHECK(buf != NULL);
    CHECK(raw_read(fd, buf, len, timeout_ms));
    Kvxfer__Reply *r = kvxfer__reply__unpack(NULL, len, buf);
    free(buf);
    CHECK(r != NULL);
    return r;
}

/* 1 if the daemon closes the connection within timeout_ms (any bytes
 * still queued are drained first). */
static int raw_closed(int fd, int timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        struct pollfd pf = {fd, POLLIN, 0};
        int64_t left = end - now_ms();
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
            return 0;
        uint8_t buf[4096];
        ssize_t k = recv(fd, buf, sizeof(buf), 0);
        if (k == 0)
            return 1;
        if (k < 0 && errno != EINTR)
            return errno == ECONNRESET;
    }
}
