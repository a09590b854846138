/*
 * bench_baseline — what a run's figure is compared with, measured in the
 * same run: memcpy of the same bytes (one daemon, host pools), with
 * --daemons 2 ucx_perftest ucp_am_bw between two processes of this host
 * with the daemons' slot size and UCX_TLS (the daemons move slots as UCX
 * active messages), and with GPU pools cudaMemcpy, cudaMemcpyPeer or the
 * slowest of device-to-host, UCX and host-to-device (the host-staged
 * path).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#ifdef KVX_CUDA
#include "bench_gpu.h"
#endif

/* ucx_perftest on $PATH, or $KVX_UCX_PERFTEST; NULL when there is none. */
const char *perftest_binary(void)
{
    static char buf[PATH_MAX];
    const char *env = getenv("KVX_UCX_PERFTEST");
    if (env)
        return access(env, X_OK) == 0 ? env : NULL;
    const char *path = getenv("PATH");
    if (!path || !*path)
        path = "/usr/bin:/bin";
    while (*path) {
        size_t n = strcspn(path, ":");
        if (n && n < sizeof(buf) - 16) {
            snprintf(buf, sizeof(buf), "%.*s/ucx_perftest", (int)n, path);
            if (access(buf, X_OK) == 0)
                return buf;
        }
        path += n + (path[n] == ':');
    }
    return NULL;
}

/* A TCP port nobody listens on now (the server binds it a moment later;
 * a lost race is retried with another). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t alen = sizeof(a);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) ||
        getsockname(fd, (struct sockaddr *)&a, &alen))
        die("find a free TCP port: %s", strerror(errno));
    close(fd);
    return ntohs(a.sin_port);
}

/* waitpid with a deadline; SIGKILL past it. Returns the status, or -1. */
static int wait_until(pid_t pid, uint64_t deadline_ns)
{
    int st;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return st;
        if (r < 0)
            return -1;
        if (now_ns() > deadline_ns) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            return -1;
        }
        usleep(2000);
    }
}

/* The memory ucx_perftest moves: host (NULL), or "cuda" when the
 * daemons' slots were in GPU memory (baseline_measure()). */
static const char *pt_mem;

/* One ucx_perftest run's arguments, as its command line has them. */
typedef struct pt_args {
    const char *bin, *test;
    char s[24], n[24], w[24], p[8];
} pt_args_t;

/* The ucx_perftest server on a.p, its output to log. */
static pid_t perftest_server(const pt_args_t *a, const char *log)
{
    pid_t srv = fork();
    if (srv < 0)
        die("fork: %s", strerror(errno));
    if (srv == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        cpus_apply(1); /* the server receives, as daemon B */
        /* -f: final figures only; -v: as CSV */
        if (pt_mem)
            execl(a->bin, a->bin, "-t", a->test, "-s", a->s, "-n", a->n, "-w",
                  a->w, "-p", a->p, "-f", "-v", "-m", pt_mem, (char *)NULL);
        else
            execl(a->bin, a->bin, "-t", a->test, "-s", a->s, "-n", a->n, "-w",
                  a->w, "-p", a->p, "-f", "-v", (char *)NULL);
        _exit(127);
    }
    owned[2] = srv;
    return srv;
}

/* One try of the ucx_perftest client: its stdout into out (up to the
 * deadline); returns its wait status, or -1. */
static int perftest_client(const pt_args_t *a, uint64_t deadline, char *out,
                           size_t outlen)
{
    int pfd[2];
    if (pipe(pfd))
        die("pipe: %s", strerror(errno));
    pid_t cli = fork();
    if (cli < 0)
        die("fork: %s", strerror(errno));
    if (cli == 0) {
        dup2(pfd[1], 1);
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0)
            dup2(fd, 2);
        close(pfd[0]);
        cpus_apply(0); /* the client sends, as daemon A */
        if (pt_mem)
            execl(a->bin, a->bin, "127.0.0.1", "-t", a->test, "-s", a->s, "-n",
                  a->n, "-w", a->w, "-p", a->p, "-f", "-v", "-m", pt_mem,
                  (char *)NULL);
        else
            execl(a->bin, a->bin, "127.0.0.1", "-t", a->test, "-s", a->s, "-n",
                  a->n, "-w", a->w, "-p", a->p, "-f", "-v", (char *)NULL);
        _exit(127);
    }
    owned[3] = cli;
    close(pfd[1]);
    size_t len = 0;
    for (;;) {
        struct pollfd pf = {.fd = pfd[0], .events = POLLIN};
        int64_t left = (int64_t)(deadline - now_ns()) / 1000000;
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
            break;
        ssize_t r = read(pfd[0], out + len, outlen - 1 - len);
        if (r <= 0)
            break;
        len += (size_t)r;
        if (len == outlen - 1)
            break;
    }
    out[len] = 0;
    close(pfd[0]);
    int st = wait_until(cli, deadline);
    owned[3] = 0;
    return st;
}

/* The overall bandwidth in the client's CSV output, or 0: the line after
 * "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,
 * avg_mr,overall_mr". */
static double perftest_bw(const char *out)
{
    const char *line = strstr(out, "iterations,");
    line = line ? strchr(line, '\n') : NULL;
    double bw = 0;
    if (line) {
        const char *f = line + 1;
        for (int i = 0; i < 5 && f; i++)
            if ((f = strchr(f, ',')))
                f++;
        if (f)
            bw = strtod(f, NULL);
    }
    return bw;
}

/* One ucx_perftest run, a server and a client process on 127.0.0.1 with
 * this environment (UCX_TLS included); returns the client's overall
 * bandwidth as printed: MB/s meaning 2^20 bytes per second. */
static double perftest_once(const char *bin, const char *test, uint64_t size,
                            uint64_t iters)
{
    pt_args_t a = {.bin = bin, .test = test};
    snprintf(a.s, sizeof(a.s), "%llu", (unsigned long long)size);
    snprintf(a.n, sizeof(a.n), "%llu", (unsigned long long)iters);
    /* warm-up: a tenth of the iterations (ucx_perftest's default is
     * 10000, and it caps that the same way) */
    snprintf(a.w, sizeof(a.w), "%llu",
             (unsigned long long)(iters / 10
                                      ? (iters / 10 < 100 ? iters / 10 : 100)
                                      : 1));
    const char *log = perftest_log();
    for (int attempt = 0; attempt < 3; attempt++) {
        snprintf(a.p, sizeof(a.p), "%d", free_port());
        pid_t srv = perftest_server(&a, log);
        uint64_t deadline = now_ns() + 120ull * 1000000000ull;
        /* the client fails at once (connection refused) until the server
         * listens: try again while the server waits */
        for (int tries = 0; tries < 200; tries++) {
            int st;
            if (waitpid(srv, &st, WNOHANG) == srv) {
                owned[2] = 0;
                break; /* port taken, most likely: another port */
            }
            char out[4096];
            st = perftest_client(&a, deadline, out, sizeof(out));
            if (st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
                double bw = perftest_bw(out);
                wait_until(srv, now_ns() + 10ull * 1000000000ull);
                owned[2] = 0;
                if (!(bw > 0))
                    die("ucx_perftest -t %s: no bandwidth in its output: "
                        "%.300s",
                        test, out);
                return bw;
            }
            if (now_ns() > deadline)
                break;
            usleep(50000);
        }
        if (owned[2]) {
            kill(srv, SIGKILL);
            waitpid(srv, NULL, 0);
            owned[2] = 0;
        }
        if (now_ns() > deadline)
            break;
    }
    print_log(log, 2048);
    die("ucx_perftest -t %s -s %s -n %s failed (the server's output is "
        "above)",
        test, a.s, a.n);
}

/* ucx_perftest `test` with messages of size bytes, in GB/s (1e9 bytes/s):
 * a 100-iteration run first (also a warm-up); unless probe_only, then one
 * moving about `total` bytes, at least 100 iterations and about 2 s at
 * most, which is the figure returned. */
double perftest_gbps(const char *bin, const char *test, uint64_t size,
                     uint64_t total, int probe_only)
{
    uint64_t want = (total + size - 1) / size;
    double mibps = perftest_once(bin, test, size, 100);
    if (!probe_only && want > 100) {
        double per_iter = (double)size / (mibps * 1048576.0);
        uint64_t cap = (uint64_t)(2.0 / per_iter);
        uint64_t iters = want < cap ? want : cap;
        if (iters > 100)
            mibps = perftest_once(bin, test, size, iters);
    }
    /* ucx_perftest's "MB/s" is 2^20 bytes per second */
    return mibps * 1048576.0 / 1e9;
}

double memcpy_baseline(uint64_t total)
{
    uint64_t len = total < (1ull << 30) ? total : (1ull << 30);
    uint8_t *a = malloc(len), *b = malloc(len);
    if (!a || !b)
        die("baseline: out of memory for 2 x %llu bytes",
            (unsigned long long)len);
    memset(a, 1, len);
    memset(b, 2, len);
    uint64_t t0 = now_ns(), done = 0;
    while (done < total) {
        uint64_t n = total - done < len ? total - done : len;
        memcpy(b, a, n);
        done += n;
    }
    uint64_t dt = now_ns() - t0;
    volatile uint8_t sink = b[len / 2];
    (void)sink;
    free(a);
    free(b);
    return (double)total / (double)dt;
}

/* --daemons 2: ucx_perftest between two processes of this host, on host
 * memory, moving about the same bytes in messages of a slot. */
static void baseline_ucx(const char *perftest, uint64_t total,
                         const ranks_result_t *res, baseline_t *b)
{
    if (o.passes > 1) {
        /* the runs beside the passes */
        b->nruns = o.passes;
        memcpy(b->runs[0], res->pass_ucx, sizeof(res->pass_ucx));
        memcpy(b->runs[1], res->pass_msg, sizeof(res->pass_msg));
        b->ucx_gbps = median(b->runs[0], b->nruns);
        b->ucx_msg_gbps =
            res->pass_msg[0] > 0 ? median(b->runs[1], b->nruns) : 0;
        b->ucx_put_gbps =
            perftest_gbps(perftest, "ucp_put_bw", o.slot_bytes, total, 1);
        b->gbps = b->ucx_gbps > b->ucx_msg_gbps ? b->ucx_gbps : b->ucx_msg_gbps;
        return;
    }
    /* --baseline-runs N: the median of N runs (the figure moves from run
     * to run on a busy host); slots that went as smaller messages: UCX
     * with those too, and the baseline is the better of the two medians */
    uint64_t mb = res->message_bytes;
    int pieces = mb && mb < o.slot_bytes;
    for (uint32_t i = 0; i < o.baseline_runs; i++) {
        b->runs[0][i] =
            perftest_gbps(perftest, "ucp_am_bw", o.slot_bytes, total, 0);
        if (pieces)
            b->runs[1][i] = perftest_gbps(perftest, "ucp_am_bw", mb, total, 0);
    }
    b->ucx_gbps = median(b->runs[0], o.baseline_runs);
    b->ucx_msg_gbps = pieces ? median(b->runs[1], o.baseline_runs) : 0;
    /* put: an extra figure, the 100-iteration run only */
    b->ucx_put_gbps =
        perftest_gbps(perftest, "ucp_put_bw", o.slot_bytes, total, 1);
    b->gbps = b->ucx_gbps > b->ucx_msg_gbps ? b->ucx_gbps : b->ucx_msg_gbps;
}

#ifdef KVX_CUDA
/* GPU pools: with two daemons the host-staged path's slowest stage, else
 * the copy a single daemon makes. CUDA must not be initialized before
 * the ranks fork: this runs after they are done. */
static void baseline_gpu(uint64_t total, baseline_t *b)
{
    int ctx_gpu = o.gpu && !o.ctx_host, gen_gpu = o.gpu && !o.gen_host;
    if (o.gpu && o.daemons == 2 && pt_mem) {
        /* GPU slots both sides: UCX moving CUDA memory is the baseline */
        return;
    } else if (o.gpu && o.daemons == 2) {
        /* host-staged: D2H on the context GPU, UCX between the daemons,
         * H2D on the generation GPU; the slowest stage bounds it */
        if ((ctx_gpu || gen_gpu) && bgpu_host_gbps(ctx_gpu ? o.ctx_device : -1,
                                                   gen_gpu ? o.gen_device : -1,
                                                   total, &b->d2h, &b->h2d))
            die("GPU host copy baseline failed");
        if (ctx_gpu && b->d2h < b->gbps)
            b->gbps = b->d2h;
        if (gen_gpu && b->h2d < b->gbps)
            b->gbps = b->h2d;
        if (ctx_gpu)
            b->gpu_cap = b->d2h;
        if (gen_gpu && b->h2d < b->gpu_cap)
            b->gpu_cap = b->h2d;
    } else if (o.gpu && ctx_gpu && gen_gpu) {
        b->gbps = bgpu_peer_gbps(o.ctx_device, o.gen_device, total);
    } else if (o.gpu && (ctx_gpu || gen_gpu)) {
        /* one side on the host: its copy crosses PCIe, one way */
        if (bgpu_host_gbps(ctx_gpu ? o.ctx_device : -1,
                           gen_gpu ? o.gen_device : -1, total, &b->d2h,
                           &b->h2d))
            die("GPU host copy baseline failed");
        b->gbps = ctx_gpu ? b->d2h : b->h2d;
    } else if (o.gpu) {
        b->gbps = memcpy_baseline(total); /* both pools on the host */
    }
}
#endif

void baseline_measure(const char *perftest, uint64_t total,
                      const ranks_result_t *res, baseline_t *b)
{
    b->ucx_gbps = b->ucx_put_gbps = b->ucx_msg_gbps = b->d2h = b->h2d = 0;
    b->gpu_cap = INFINITY;
    memset(b->runs, 0, sizeof(b->runs));
    b->nruns = o.baseline_runs;
    /* both daemons' slots were in GPU memory: ucx_perftest moves CUDA
     * memory too, on the transports the daemons used (UCX_TLS) */
    pt_mem = o.gpu && o.daemons == 2 && peers.rx[7] > 0 && peers.tx[7] > 0
                 ? "cuda"
                 : NULL;
    /* ucx_perftest allocates CUDA memory through cuda_copy, which the
     * daemons' own list (their connection's transports) may not name */
    const char *tls = getenv("UCX_TLS");
    if (pt_mem && tls && !strstr(tls, "cuda_copy")) {
        char t[256];
        snprintf(t, sizeof(t), "%s,cuda_copy", tls);
        setenv("UCX_TLS", t, 1);
    }
    if (o.daemons == 2)
        baseline_ucx(perftest, total, res, b);
#ifdef KVX_CUDA
    baseline_gpu(total, b);
#endif
    b->name =
        o.daemons == 1 ? NULL
        : pt_mem       ? "ucx_perftest ucp_am_bw -m cuda (GPU slots both sides)"
        : (!o.gpu || (o.ctx_host && o.gen_host))
            ? (b->ucx_msg_gbps > 0 ? "ucx_perftest ucp_am_bw, the better of "
                                     "slot-sized and piece-sized messages"
                                   : "ucx_perftest ucp_am_bw")
        : o.ctx_host ? "min(H2D,ucx_perftest)"
        : o.gen_host ? "min(D2H,ucx_perftest)"
                     : "min(D2H,H2D,ucx_perftest)";
}
