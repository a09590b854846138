/*
 * bench_daemon — the kvxferd daemons the bench spawns: one on a socket
 * of its own (--spawn-daemon), or with --daemons 2 two that talk over
 * UCX, context ranks on A and generation ranks on B, with a fresh peer
 * secret and configs in a temp dir removed at exit; and what their
 * status says after the run.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

/* The kvxferd next to this binary, or $KVXFERD. */
static void daemon_binary(char *daemon, size_t len)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0)
        die("readlink /proc/self/exe: %s", strerror(errno));
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    *slash = 0;
    const char *env = getenv("KVXFERD");
    if (env)
        snprintf(daemon, len, "%s", env);
    else
        snprintf(daemon, len, "%s/kvxferd", exe);
}

/* Wait until the daemon accepts connections on sock; with a log, show it
 * when the daemon dies first. */
static void daemon_await(pid_t pid, const char *daemon, const char *sock,
                         const char *log, int tries)
{
    for (int i = 0; i < tries; i++) { /* 10 ms each */
        kvx_client_t *c;
        if (kvx_connect_observer(sock, 100, &c) == 0) {
            kvx_close(c);
            return;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            if (log)
                print_log(log, 4096);
            die("daemon %s exited during start%s", daemon,
                log ? " (its log is above)" : "");
        }
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    if (log)
        print_log(log, 4096);
    die("daemon %s did not start listening on %s", daemon, sock);
}

const char *trace_path(void)
{
    static char p[128];
    if (!p[0])
        snprintf(p, sizeof(p), "/tmp/kvxfer-bench-%d.trace",
                 o.spawn ? (int)getpid() : 0);
    return p;
}
static pid_t spawn_daemon(char *sock, size_t len)
{
    char daemon[PATH_MAX + 16];
    daemon_binary(daemon, sizeof(daemon));
    snprintf(sock, len, "/tmp/kvxfer-bench-%d.sock", (int)getpid());
    (void)trace_path(); /* named here, the same in the child */
    pid_t pid = fork();
    if (pid == 0) {
        if (!getenv("KVX_BENCH_DAEMON_LOG")) {
            int fd = open("/dev/null", O_WRONLY);
            if (fd >= 0)
                dup2(fd, 2);
        }
        char cfg[128];
        if ((o.ctas && !o.daemon_config) || o.trace) {
            snprintf(cfg, sizeof(cfg), "/tmp/kvxfer-bench-%d.yaml",
                     (int)getppid());
            FILE *f = fopen(cfg, "w");
            if (f) {
                if (o.ctas && !o.daemon_config)
                    fprintf(f, "gpu:\n  max_ctas: %u\n", o.ctas);
                if (o.trace)
                    fprintf(f, "log:\n  trace_file: \"%s\"\n", trace_path());
                if (o.daemon_config) { /* its own lines after ours */
                    FILE *in = fopen(o.daemon_config, "r");
                    char line[1024];
                    while (in && fgets(line, sizeof(line), in))
                        fputs(line, f);
                    if (in)
                        fclose(in);
                }
                fclose(f);
                o.daemon_config = cfg;
            }
        }
        if (o.daemon_config)
            execl(daemon, daemon, "--socket", sock, "--config", o.daemon_config,
                  (char *)NULL);
        else
            execl(daemon, daemon, "--socket", sock, (char *)NULL);
        fprintf(stderr, "kvxfer-bench: exec %s: %s\n", daemon, strerror(errno));
        _exit(127);
    }
    daemon_await(pid, daemon, sock, NULL, 500);    /* up to 5 s */
    if ((o.ctas && !o.daemon_config) || o.trace) { /* read at start */
        char cfg[128];
        snprintf(cfg, sizeof(cfg), "/tmp/kvxfer-bench-%d.yaml", (int)getpid());
        unlink(cfg);
    }
    return pid;
}

void cpus_apply(int k)
{
    if (o.cpus[k] && sched_setaffinity(0, sizeof(cpuset[k]), &cpuset[k]))
        fprintf(stderr, "kvxfer-bench: sched_setaffinity(%s): %s\n", o.cpus[k],
                strerror(errno));
}

/* ---- two daemons: temp dir, peer secret, configs ------------------- *
 * Everything lives in one mkdtemp directory under /tmp (mode 0700), which
 * the parent removes at exit, on a signal too; children of the parent
 * (ranks) inherit the handlers but leave the cleanup to it. */

enum {
    F_SECRET,
    F_CFG_A,
    F_CFG_B,
    F_SOCK_A,
    F_SOCK_B,
    F_LOG_A,
    F_LOG_B,
    F_PERFTEST,
    F_NUM
};
static const char *const peer_file_names[F_NUM] = {
    "secret", "a.yaml", "b.yaml", "a.sock",
    "b.sock", "a.log",  "b.log",  "perftest.log"};
static char peer_dir[64];          /* "" until created */
static char peer_files[F_NUM][96]; /* built once: unlink in a handler */
static pid_t parent_pid;
/* daemons A and B, then the ucx_perftest server and client */
volatile pid_t owned[4];

/* Async-signal-safe: kill, waitpid, unlink and rmdir only. */
static void peer_cleanup(void)
{
    if (getpid() != parent_pid)
        return;
    if (sh) /* ranks waiting at a barrier leave (a lock-free store) */
        atomic_fetch_add(&sh->failed, 1);
    for (int i = 0; i < 4; i++) {
        pid_t p = owned[i];
        if (p > 0) {
            owned[i] = 0;
            kill(p, SIGKILL);
            waitpid(p, NULL, 0);
        }
    }
    if (!peer_dir[0])
        return;
    for (int i = 0; i < F_NUM; i++)
        unlink(peer_files[i]);
    rmdir(peer_dir);
    peer_dir[0] = 0;
}

static void peer_on_signal(int sig)
{
    peer_cleanup();
    signal(sig, SIG_DFL);
    raise(sig);
}

void print_log(const char *path, long tail)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char buf[4096];
    if (tail > (long)sizeof(buf))
        tail = sizeof(buf);
    fseek(f, 0, SEEK_END);
    long end = ftell(f);
    fseek(f, end > tail ? end - tail : 0, SEEK_SET);
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    if (n) {
        fprintf(stderr, "---- %s%s\n", path, end > tail ? " (end)" : "");
        fwrite(buf, 1, n, stderr);
        if (buf[n - 1] != '\n')
            fputc('\n', stderr);
    }
}

/* Write one daemon's config: the peer section the bench needs, gpu.max_ctas
 * with --ctas, then --daemon-config appended as is. */
static void peer_write_config(const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f)
        die("create %s: %s", path, strerror(errno));
    fprintf(f,
            "# written by kvxfer-bench --daemons 2; removed when it exits\n"
            "peer:\n  listen: \"127.0.0.1:0\"\n  secret_file: \"%s\"\n"
            "  slot_bytes: %llu\n",
            peer_files[F_SECRET], (unsigned long long)o.slot_bytes);
    for (uint32_t i = 0; i < o.npeer_config; i++)
        fprintf(f, "  %s\n", o.peer_config[i]);
    if (o.ctas)
        fprintf(f, "gpu:\n  max_ctas: %u\n", o.ctas);
    if (o.daemon_config) {
        FILE *in = fopen(o.daemon_config, "r");
        if (!in)
            die("--daemon-config %s: %s", o.daemon_config, strerror(errno));
        char buf[4096];
        size_t n;
        int last = '\n';
        fprintf(f, "# from %s\n", o.daemon_config);
        while ((n = fread(buf, 1, sizeof(buf), in)) > 0) {
            fwrite(buf, 1, n, f);
            last = buf[n - 1];
        }
        fclose(in);
        if (last != '\n')
            fputc('\n', f);
    }
    if (fclose(f))
        die("write %s: %s", path, strerror(errno));
}

static void peer_setup(void)
{
    parent_pid = getpid();
    snprintf(peer_dir, sizeof(peer_dir), "/tmp/kvxfer-bench-XXXXXX");
    if (!mkdtemp(peer_dir)) {
        int e = errno;
        peer_dir[0] = 0;
        die("mkdtemp /tmp/kvxfer-bench-XXXXXX: %s", strerror(e));
    }
    for (int i = 0; i < F_NUM; i++)
        snprintf(peer_files[i], sizeof(peer_files[i]), "%s/%s", peer_dir,
                 peer_file_names[i]);
    atexit(peer_cleanup);
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction old;
        /* a signal ignored by whoever started us (nohup, &) stays so */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
            signal(sigs[i], peer_on_signal);
    }

    /* the cluster secret: 32 random bytes, readable by the owner only (the
     * daemon refuses a secret others can read) */
    uint8_t secret[32];
    if (getrandom(secret, sizeof(secret), 0) != (ssize_t)sizeof(secret))
        die("getrandom: %s", strerror(errno));
    int fd = open(peer_files[F_SECRET], O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        die("create %s: %s", peer_files[F_SECRET], strerror(errno));
    if (write(fd, secret, sizeof(secret)) != (ssize_t)sizeof(secret) ||
        close(fd))
        die("write %s: %s", peer_files[F_SECRET], strerror(errno));
    peer_write_config(peer_files[F_CFG_A]);
    peer_write_config(peer_files[F_CFG_B]);
}

/* Start daemon k (0: A, 1: B) on its socket and config; its stderr goes to
 * its log in the temp dir ($KVX_BENCH_DAEMON_LOG: to ours). */
static pid_t peer_spawn(int k)
{
    char daemon[PATH_MAX + 16];
    daemon_binary(daemon, sizeof(daemon));
    const char *sock = peer_files[F_SOCK_A + k];
    const char *cfg = peer_files[F_CFG_A + k];
    const char *log = peer_files[F_LOG_A + k];
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        if (!getenv("KVX_BENCH_DAEMON_LOG")) {
            int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (fd >= 0)
                dup2(fd, 2);
        }
        cpus_apply(k);
        execl(daemon, daemon, "--socket", sock, "--config", cfg, (char *)NULL);
        fprintf(stderr, "kvxfer-bench: exec %s: %s\n", daemon, strerror(errno));
        _exit(127);
    }
    owned[k] = pid;
    /* UCX initialization makes the start slower: up to 10 s */
    daemon_await(pid, daemon, sock, getenv("KVX_BENCH_DAEMON_LOG") ? NULL : log,
                 1000);
    return pid;
}

/* --daemons 2: where the slots' time went, from the daemons' status
 * ("ucx.received" of B, "ucx.sent" of A). */
peers_stats_t peers;

static void slot_times_of(const char *json, const char *key, double out[8])
{
    const char *p = json ? strstr(json, key) : NULL;
    memset(out, 0, 8 * sizeof(double));
    if (!p)
        return;
    static const char *const f[8] = {
        "\"slots\":",       "\"wait_ns\":", "\"wire_ns\":", "\"copy_ns\":",
        "\"loop_lag_ns\":", "\"ahead\":",   "\"direct\":",  "\"gpu_bytes\":"};
    /* this direction's object only: "direct" may be absent from it */
    const char *end = strchr(p, '}');
    double v[8];
    for (int i = 0; i < 8; i++) {
        const char *q = strstr(p, f[i]);
        v[i] = q && (!end || q < end) ? strtod(q + strlen(f[i]), NULL) : 0;
    }
    out[0] = v[0];
    for (int i = 1; i < 5; i++)
        out[i] = v[0] > 0 ? v[i] / v[0] / 1e3 : 0;
    out[5] = v[5];
    out[6] = v[6];
    out[7] = v[7];
}

/* --daemons 2: what the daemons' status says: the slot times (peers.rx,
 * peers.tx) and, unless UCX_TLS is set, the transports their connection
 * used ("ucx.transports", "tl/dev"), put in UCX_TLS for the baseline.
 * Returns the size of the pieces they send slots in ("ucx.message_bytes"),
 * or 0. Sets peers.lanes: the lanes daemon A's slot data goes over (its
 * first connection's "lanes"). */

/* The status JSON of the daemon on sock into *json (free()), or NULL. */
static void status_of(const char *sock, char **json)
{
    kvx_client_t *c;
    *json = NULL;
    if (kvx_connect_observer(sock, 2000, &c) == 0) {
        kvx_status_json(c, json, 2000);
        kvx_close(c);
    }
}

uint64_t peers_read(void)
{
    static char used_tls[128];
    uint64_t message_bytes = 0;
    int want_tls = !getenv("UCX_TLS");
    char *json;
    status_of(o.gen_socket, &json);
    const char *t = json ? strstr(json, "\"transports\":\"") : NULL;
    if (t)
        snprintf(peers.transports, sizeof(peers.transports), "%.*s",
                 (int)strcspn(t + 14, "\""), t + 14);
    if (t && want_tls) {
        t += 14;
        size_t n = 0;
        while (*t && *t != '"') {
            char tl[32];
            size_t k = 0;
            while (*t && *t != '/' && *t != '"' && k + 1 < sizeof(tl))
                tl[k++] = *t++;
            tl[k] = 0;
            while (*t && *t != ',' && *t != '"')
                t++;
            if (*t == ',')
                t++;
            if (k && !strstr(used_tls, tl) && n + k + 2 < sizeof(used_tls))
                n += snprintf(used_tls + n, sizeof(used_tls) - n, "%s%s",
                              n ? "," : "", tl);
        }
    }
    /* the daemons send a slot as pieces of ucx.message_bytes */
    const char *mb = json ? strstr(json, "\"message_bytes\":") : NULL;
    if (mb)
        message_bytes = strtoull(mb + 16, NULL, 10);
    slot_times_of(json, "\"received\":{", peers.rx);
    free(json);
    status_of(o.socket, &json);
    slot_times_of(json, "\"sent\":{", peers.tx);
    const char *ln = json ? strstr(json, "\"lanes\":") : NULL;
    if (ln)
        peers.lanes = (uint32_t)strtoul(ln + 8, NULL, 10);
    free(json);
    if (want_tls && used_tls[0])
        setenv("UCX_TLS", used_tls, 1);
    return message_bytes;
}

void gpu_status_read(void)
{
    char *json;
    status_of(o.gen_socket, &json);
    const char *t = json ? strstr(json, "\"gpu\":\"") : NULL;
    if (t)
        snprintf(peers.gpu, sizeof(peers.gpu), "%.*s",
                 (int)strcspn(t + 7, "\""), t + 7);
    free(json);
}

/* The ucx_perftest runs' log, in the temp dir of the two daemons. */
const char *perftest_log(void)
{
    return peer_files[F_PERFTEST];
}

void daemons_start(daemons_t *d)
{
    static char sock[128];
    d->ctx = d->gen = -1;
    if (o.spawn && o.daemons == 2) {
        peer_setup();
        d->ctx = peer_spawn(0);
        d->gen = peer_spawn(1);
        o.socket = peer_files[F_SOCK_A];
        o.gen_socket = peer_files[F_SOCK_B];
    } else if (o.spawn) {
        d->ctx = spawn_daemon(sock, sizeof(sock));
        o.socket = sock;
    }
    if (!o.gen_socket)
        o.gen_socket = o.socket;
}

void daemons_stop(daemons_t *d)
{
    if (d->ctx > 0) {
        kill(d->ctx, SIGTERM);
        waitpid(d->ctx, NULL, 0);
        owned[0] = 0;
    }
    if (d->gen > 0) {
        kill(d->gen, SIGTERM);
        waitpid(d->gen, NULL, 0);
        owned[1] = 0;
    }
}

void daemons_print_logs(void)
{
    if (o.daemons == 2 && !getenv("KVX_BENCH_DAEMON_LOG")) {
        print_log(peer_files[F_LOG_A], 2048);
        print_log(peer_files[F_LOG_B], 2048);
    }
}
