/*
 * kvxferd — the per-node KV cache transfer daemon.
 *
 * This file is the table of contents: parse the command line, load the
 * configuration, bring the modules up in order (copy engine, sessions,
 * socket, peer daemons: peer.c for UCX, remote.c for its slots), run the
 * loop, and on SIGTERM/SIGINT drain and take them down in reverse.
 * SIGHUP reloads the reloadable configuration keys. The tick drives every
 * deadline: requests (xfer), peers' keep-alive (peer), opens asked again
 * (remote), polls (instance), hellos (session).
 */
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include "agree/agree.h"
#include "copy/copy.h"
#include "copy/gpu.h"
#include "copy/plan.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "core/fault.h"
#include "core/log.h"
#include "core/notify.h"
#include "core/records.h"
#include "local/http.h"
#include "local/metrics.h"
#include "local/pacing.h"
#include "local/server.h"
#include "local/session.h"
#include "net/peer.h"
#include "remote/keyed.h"
#include "remote/release.h"
#include "remote/remote.h"
#include "xfer/instance.h"
#include "xfer/xfer.h"

/* The UCX version built against: the Makefile's (its pkg-config or the
 * wheel's), else the headers' major.minor */
#define KVX_STR_(x) #x
#define KVX_STR(x) KVX_STR_(x)
#ifndef KVX_UCX_BUILT
#define KVX_UCX_BUILT ""
#endif

static uv_signal_t sig_term, sig_int, sig_hup;
static uv_timer_t tick;
/* A drain: requests may finish until ending_at; then they end, and the
 * fences and replies get until drain_deadline. */
static struct {
    uint64_t started, ending_at, drain_deadline;
    int ended, told;
    uint32_t at_start, ended_n;
    char who[48];
} dr;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvxferd [--config FILE] [--socket PATH] [--check-config]\n"
            "               [--print-config-table] [--version] [--help]\n"
            "\n"
            "  --config FILE         YAML configuration (default: built-in "
            "defaults)\n"
            "  --socket PATH         listen here instead of socket.path\n"
            "  --check-config        validate the configuration and exit\n"
            "  --print-config-table  print the configuration keys as a "
            "markdown table\n"
            "  --version             print the version, the build and "
            "UCX's\n"
            "  --help                this text\n");
}

/* --version: the build, then the UCX built against and the one the loader
 * found, with its file: the daemon runs on any UCX >= 1.13 and what it can
 * do (transports, memory types) is the loaded one's. */
static void print_version(void)
{
    printf("kvxferd %s (protocol %d.%d, build: %s)\n", KVX_VERSION_STRING,
           KVX_PROTOCOL_MAJOR, KVX_PROTOCOL_MINOR, gpu_build_info());
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    Dl_info di;
    void *fn = dlsym(RTLD_DEFAULT, "ucp_get_version");
    const char *file =
        fn && dladdr(fn, &di) && di.dli_fname ? di.dli_fname : "unknown file";
    printf("UCX: built against %s, loaded %u.%u.%u (%s)\n",
           KVX_UCX_BUILT[0] ? KVX_UCX_BUILT
                            : KVX_STR(UCP_API_MAJOR) "." KVX_STR(UCP_API_MINOR),
           maj, min, rel, file);
}

/* Load a config file, logging every problem; 0 on success. */
static int load_config(const char *path, kvx_conf_t *out, FILE *errs)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = errs ? NULL : open_memstream(&buf, &len);
    int n = conf_load(path, out, errs ? errs : mem ? mem : stderr);
    if (mem) {
        fclose(mem);
        for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n"))
            log_error("%s", line);
        free(buf);
    }
    return n;
}

/* The address without a peer listener: kvx://HOST/ID. ID is the boot
 * id: its first half names the daemon on this host (a hash of its
 * socket path), the second half is random per start, so that params of
 * an earlier run are told from another daemon's (peer_address_alias()).
 * peer_init() keeps ID with the listener's IP:PORT. */
static void make_address(void)
{
    char host[64] = "localhost";
    uint8_t id[8] = {0};
    gethostname(host, sizeof(host) - 1);
    uint32_t h = 2166136261u; /* FNV-1a */
    for (const char *p = kvxd.conf.socket_path; *p; p++)
        h = (h ^ (uint8_t)*p) * 16777619u;
    memcpy(id, &h, 4);
    if (getrandom(id + 4, 4, 0) != 4)
        memcpy(id + 4, &kvxd.start_ms, 4);
    snprintf(kvxd.address, sizeof(kvxd.address),
             "kvx://%s/%02x%02x%02x%02x%02x%02x%02x%02x", host, id[0], id[1],
             id[2], id[3], id[4], id[5], id[6], id[7]);
}

static void stop_loop(void)
{
    uv_timer_stop(&tick);
    uv_stop(kvxd.loop);
}

static void on_tick(uv_timer_t *t)
{
    (void)t;
    uint64_t now = kvxd_now_ms();
    metrics_tick();
    xfer_tick(now);
    peer_tick(now);
    remote_tick(now);
    release_tick(now);
    keyed_tick(now);
    agree_tick(now);
    instance_tick(now);
    session_tick(now);
    server_tick(now);
    if (!kvxd.draining)
        return;
    if (!dr.ended && (now >= dr.ending_at || xfer_count() == 0)) {
        /* the grace is over (or nothing is left): what is in flight ends */
        char msg[96];
        snprintf(msg, sizeof(msg), "daemon shutting down (%s)", dr.who);
        dr.ended = 1;
        dr.ended_n = xfer_count();
        dr.drain_deadline = now + kvxd.conf.drain_timeout_ms;
        xfer_end_all(KVX_ERR_SHUTDOWN, msg);
    }
    instance_flush_all(); /* answer waiting polls with the final events */
    if (!dr.ended)
        return;
    int done = xfer_count() == 0 && copy_inflight() == 0;
    if ((done || now >= dr.drain_deadline) && !dr.told) {
        if (!done)
            log_warn("drain: %u requests still open after %u ms; exiting",
                     xfer_count(), kvxd.conf.drain_timeout_ms);
        char msg[256];
        snprintf(msg, sizeof(msg),
                 "drained in %llu ms: %u requests were in flight, %u "
                 "finished, %u ended SHUTDOWN%s; kvxferd exits 0",
                 (unsigned long long)(now - dr.started), dr.at_start,
                 dr.at_start > dr.ended_n ? dr.at_start - dr.ended_n : 0,
                 dr.ended_n, done ? "" : " (some copies were not fenced)");
        log_notice("drain: %s", msg);
        session_drained(msg);
        dr.told = 1;
    }
    if (dr.told && (session_unflushed() == 0 || now >= dr.drain_deadline))
        stop_loop();
}

static int drain_start(const char *who, uint32_t grace_ms)
{
    if (kvxd.draining)
        return 1;
    uint64_t now = kvxd_now_ms();
    dr.at_start = xfer_count();
    log_notice("%s: draining: %u requests in flight%s", who, dr.at_start,
               grace_ms ? "; they may finish for a while" : "");
    if (grace_ms)
        log_notice("%s: requests still in flight in %u ms end then", who,
                   grace_ms);
    notify_send("STOPPING=1");
    kvxd.draining = 1;
    snprintf(dr.who, sizeof(dr.who), "%s", who);
    dr.started = now;
    dr.ending_at = now + grace_ms;
    server_cleanup();
    http_publish(); /* /health answers 503 from now on */
    on_tick(&tick);
    return 0;
}

static void drain(const char *signame)
{
    (void)drain_start(signame, 0);
}

static int socket_overridden; /* --socket given */

static void reload(void)
{
    notify_send("RELOADING=1");
    if (!kvxd.config_path) {
        log_notice("SIGHUP: no --config file; records.file reopened");
        (void)records_reopen();
    } else {
        kvx_conf_t next = kvxd.conf;
        if (load_config(kvxd.config_path, &next, NULL) == 0) {
            /* --socket overrides the file for the daemon's whole life
             * (without it, a changed socket.path is logged as needing a
             * restart, like any other key) */
            if (socket_overridden)
                memcpy(next.socket_path, kvxd.conf.socket_path,
                       sizeof(next.socket_path));
            char *buf = NULL;
            size_t len = 0;
            FILE *mem = open_memstream(&buf, &len);
            int n =
                conf_apply_reloadable(&kvxd.conf, &next, mem ? mem : stderr);
            if (mem) {
                fclose(mem);
                for (char *l = strtok(buf, "\n"); l; l = strtok(NULL, "\n"))
                    log_warn("reload: %s", l);
                free(buf);
            }
            kvx__log_level = kvxd.conf.log_level;
            char lw[160];
            if (log_set_format(kvxd.conf.log_format, KVX_WHY(lw)))
                log_error("reload: %s; the log stays %s", lw,
                          log_format_name());
            uv_timer_set_repeat(&tick, kvxd.conf.deadline_tick_ms);
            copy_set_pace(kvxd.conf.copy_pace, kvxd.conf.gpu_pace);
            log_notice("SIGHUP: reloaded %s: %d keys changed", kvxd.config_path,
                       n);
            (void)records_reopen();     /* it logs what failed */
            (void)peer_reload_secret(); /* it logs what it did */
        } else {
            log_error("SIGHUP: %s has errors; keeping the running "
                      "configuration",
                      kvxd.config_path);
        }
    }
    notify_send("READY=1");
}

static void on_signal(uv_signal_t *h, int signum)
{
    (void)h;
    if (signum == SIGHUP && kvxd.draining) /* READY=1 after STOPPING=1 */
        log_notice("SIGHUP: ignored while draining");
    else if (signum == SIGHUP)
        reload();
    else
        drain(signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* ---- signals while the daemon starts ----------------------------------
 * Until the loop runs, libuv's watchers could only queue a signal, and a
 * start stuck in UCX or CUDA would then never stop. So the start has
 * plain handlers: a SIGTERM or SIGINT is kept, and handed to the loop's
 * watchers once the start is done (the daemon then drains and exits 0);
 * a second one, or a start still going START_SIGNAL_WAIT_S after the
 * first, ends the daemon at once (exit 1). A SIGHUP is kept for the loop
 * too. Only async-signal-safe calls here. */
#define START_SIGNAL_WAIT_S 10

/* start_over: loop_signals() has handed the signals to the loop. The
 * flags are taken with atomic exchanges: a handler may run on any thread
 * (the copy workers exist by then; libuv blocks every signal on the main
 * thread while it installs a watcher, so one that comes then goes to
 * another thread), even while loop_signals() runs. */
static volatile sig_atomic_t start_stop, start_hup, start_over;

#define STR_(x) #x
#define STR(x) STR_(x)
#define START_WAIT STR(START_SIGNAL_WAIT_S) " s"
static const char start_kept[] =
    "SIGTERM or SIGINT while starting: draining once started (a second "
    "one, or " START_WAIT " more, ends it now)";
static const char start_late[] =
    "the start did not finish within " START_WAIT " of SIGTERM or SIGINT: "
    "exiting now, not drained";

/* The loop's watchers took over while this handler ran: if the flag it
 * set is still there (loop_signals() looked before it was set), the
 * handler hands the signal on itself; the exchange makes it one of the
 * two, never both. */
static void start_handoff(volatile sig_atomic_t *flag, int signum)
{
    if (__atomic_load_n(&start_over, __ATOMIC_SEQ_CST) &&
        __atomic_exchange_n(flag, 0, __ATOMIC_SEQ_CST))
        kill(getpid(), signum);
}

static void on_start_signal(int signum)
{
    int saved = errno; /* write() and kill() may set it */
    if (__atomic_load_n(&start_over, __ATOMIC_SEQ_CST)) {
        kill(getpid(), signum); /* libuv's handler has it now */
    } else if (signum == SIGHUP) {
        __atomic_store_n(&start_hup, 1, __ATOMIC_SEQ_CST);
        start_handoff(&start_hup, SIGHUP);
    } else if (__atomic_exchange_n(&start_stop, signum, __ATOMIC_SEQ_CST)) {
        log_say(LOG_ERR, "a second SIGTERM or SIGINT while starting: "
                         "exiting now, not drained");
        _exit(1);
    } else {
        log_say(LOG_NOTICE, start_kept);
        alarm(START_SIGNAL_WAIT_S);
        start_handoff(&start_stop, signum);
    }
    errno = saved;
}

static void on_start_alarm(int signum)
{
    (void)signum;
    if (__atomic_load_n(&start_over, __ATOMIC_SEQ_CST))
        return; /* armed by a handler that ran beside loop_signals() */
    log_say(LOG_ERR, start_late);
    _exit(1);
}

static void start_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sigemptyset(&sa.sa_mask); /* no handler nests in another */
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaddset(&sa.sa_mask, SIGHUP);
    sigaddset(&sa.sa_mask, SIGALRM);
    sa.sa_flags = SA_RESTART; /* as libuv's: UCX and CUDA see no EINTR */
    sa.sa_handler = on_start_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sa.sa_handler = on_start_alarm;
    sigaction(SIGALRM, &sa, NULL);
}

/* The start is done: the loop's watchers take over (libuv installs its
 * own handlers), and what came during the start is raised again for
 * them. SIGALRM keeps on_start_alarm(), which now ignores it: a handler
 * on another thread may arm the alarm after alarm(0) here, and SIGALRM's
 * default would kill the daemon 10 s later. */
static void loop_signals(void)
{
    uv_signal_init(kvxd.loop, &sig_term);
    uv_signal_init(kvxd.loop, &sig_int);
    uv_signal_init(kvxd.loop, &sig_hup);
    uv_signal_start(&sig_term, on_signal, SIGTERM);
    uv_signal_start(&sig_int, on_signal, SIGINT);
    uv_signal_start(&sig_hup, on_signal, SIGHUP);
    __atomic_store_n(&start_over, 1, __ATOMIC_SEQ_CST);
    alarm(0);
    int stop = __atomic_exchange_n(&start_stop, 0, __ATOMIC_SEQ_CST);
    if (stop)
        raise(stop);
    /* after a stop, a reload would only say READY=1 after STOPPING=1 */
    if (__atomic_exchange_n(&start_hup, 0, __ATOMIC_SEQ_CST) && !stop)
        raise(SIGHUP);
}

/* ---- signals while the daemon takes down -----------------------------
 * Once the loop has stopped, its watchers no longer run, and a take-down
 * stuck in UCX or CUDA would wait for systemd's SIGKILL. So the take-down
 * has plain handlers too: a SIGTERM or SIGINT then (a stop asked again:
 * the drain is over) ends the daemon at once with exit 1, and so does a
 * take-down still going TAKEDOWN_WAIT_S after it began (under the unit's
 * TimeoutStopSec with the default drain). Both name the step it was in.
 * A SIGHUP is ignored. The request records are written as each request
 * ends, so an early exit loses none. */
#define TAKEDOWN_WAIT_S 20
#define DOWN_WAIT STR(TAKEDOWN_WAIT_S) " s"
static const char down_late[] =
    "the take-down did not finish within " DOWN_WAIT ": exiting now";

static const char *volatile down_at = "";

static void down_exit(const char *why)
{
    char m[200];
    size_t n = 0;
    const char *at = down_at;
    for (const char *p = why; *p && n < 120; p++)
        m[n++] = *p;
    for (const char *p = " (in "; *p; p++)
        m[n++] = *p;
    for (const char *p = at; *p && n < sizeof(m) - 3; p++)
        m[n++] = *p;
    m[n++] = ')';
    m[n] = 0;
    log_say(LOG_ERR, m);
    _exit(1);
}

static void on_down_signal(int signum)
{
    (void)signum;
    down_exit("a SIGTERM or SIGINT while taking down: exiting now");
}

static void on_down_alarm(int signum)
{
    (void)signum;
    down_exit(down_late);
}

/* The loop is done: these handlers take the signals from its watchers.
 * The watchers stay started: stopping or closing one sets its signal to
 * its default action (libuv), and one that came before sigaction() here
 * would kill the daemon; close_walk() leaves them. */
static void takedown_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sigfillset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sa.sa_handler = on_down_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_down_alarm;
    sigaction(SIGALRM, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGHUP, &sa, NULL);
    alarm(TAKEDOWN_WAIT_S);
}

/* A step of the take-down, named for the lines above. */
#define DOWN(fn, ...) (down_at = #fn, fn(__VA_ARGS__))

static void close_walk(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (h->type == UV_SIGNAL) { /* takedown_signals() has the signal */
        uv_unref(h);
        return;
    }
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

/* Plans are charged to the daemon's memory budget (limits.memory_bytes)
 * as they are built, and to the uid of the fetch they serve once it owns
 * them (plan_own()). */
static int plan_charge(uint64_t bytes, kvx_why_t *why)
{
    if (!kvxd_mem_charge(MEM_PLANS, bytes))
        return 0;
    char w[200];
    kvxd_mem_why(KVXD_UID_NONE, bytes, w, sizeof(w));
    return why_fail(why, KVX_ERR_LIMIT, "plan: its %llu bytes %s",
                    (unsigned long long)bytes, w);
}

static int plan_own_uid(uint32_t uid, uint64_t bytes, kvx_why_t *why)
{
    if (!kvxd_mem_claim_uid(MEM_PLANS, uid, bytes))
        return 0;
    char w[200];
    kvxd_mem_why(uid, bytes, w, sizeof(w));
    return why_fail(why, KVX_ERR_LIMIT, "plan: its %llu bytes %s",
                    (unsigned long long)bytes, w);
}

static void plan_release(uint32_t uid, uint64_t bytes)
{
    /* PLAN_OWNER_NONE is KVXD_UID_NONE: the total only */
    kvxd_mem_release_uid(MEM_PLANS, uid, bytes);
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"socket", required_argument, NULL, 's'},
        {"check-config", no_argument, NULL, 'k'},
        {"print-config-table", no_argument, NULL, 'p'},
        {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    const char *socket_override = NULL;
    int check_only = 0, opt;
    while ((opt = getopt_long(argc, argv, "c:s:kpVh", opts, NULL)) != -1) {
        switch (opt) {
        case 'c':
            kvxd.config_path = optarg;
            break;
        case 's':
            socket_override = optarg;
            break;
        case 'k':
            check_only = 1;
            break;
        case 'p':
            conf_print_markdown(stdout);
            return 0;
        case 'V':
            print_version();
            return 0;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvxferd: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }

    /* configuration (its errors logged as log.format auto has them) */
    (void)log_set_format("auto", NULL);
    conf_defaults(&kvxd.conf);
    if (kvxd.config_path) {
        int n = load_config(kvxd.config_path, &kvxd.conf,
                            check_only ? stderr : NULL);
        if (n) {
            if (check_only)
                fprintf(stderr, "%s: %d problem%s\n", kvxd.config_path,
                        n < 0 ? 1 : n, n == 1 ? "" : "s");
            return 1;
        }
    }
    if (check_only) {
        printf("%s: ok\n",
               kvxd.config_path ? kvxd.config_path : "built-in defaults");
        return 0;
    }
    if (socket_override) {
        if (strlen(socket_override) >= sizeof(kvxd.conf.socket_path)) {
            fprintf(stderr, "kvxferd: --socket: path longer than %zu bytes\n",
                    sizeof(kvxd.conf.socket_path) - 1);
            return 2;
        }
        strcpy(kvxd.conf.socket_path, socket_override);
        socket_overridden = 1;
    }
    kvx__log_level = kvxd.conf.log_level;
    char lwhy[160];
    if (log_set_format(kvxd.conf.log_format, KVX_WHY(lwhy))) {
        fprintf(stderr, "kvxferd: %s\n", lwhy);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    /* the soft open-file limit up to the hard one: pools over many VMM
     * allocations arrive as one fd each (sessions queue at most half) */
    struct rlimit nofile;
    if (!getrlimit(RLIMIT_NOFILE, &nofile) &&
        nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &nofile);
    }
    char fwhy[256];
    if (fault_init(KVX_WHY(fwhy))) {
        fprintf(stderr, "kvxferd: %s\n", fwhy);
        return 2;
    }

    kvxd.loop = uv_default_loop();
    kvxd.start_ms = kvxd_now_ms();
    make_address();
    unsigned nthreads = kvxd.conf.worker_threads;
    if (!nthreads) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        nthreads = n > 0 ? (unsigned)n : 1;
    }

    /* Signals are caught before the socket listens: a SIGTERM that comes
     * while the rest starts (UCX, CUDA) drains the daemon once started
     * (exit 0), rather than killing it half started (start_signals()). */
    start_signals();

    /* bring up, in order */
    int rc = 1;
    gpu_env(); /* before UCX or a pool starts CUDA */
    xfer_init();
    if (kvxd_defer_init(kvxd.loop))
        goto out;
    plan_set_budget(&(plan_budget_t){plan_charge, plan_own_uid, plan_release});
    if (kvxd.conf.log_trace_file[0] &&
        !(kvxd.trace = fopen(kvxd.conf.log_trace_file, "ae"))) {
        log_error("log.trace_file: cannot open %s: %s",
                  kvxd.conf.log_trace_file, strerror(errno));
        goto err_defer;
    }
    if (kvxd.trace)
        setvbuf(kvxd.trace, NULL, _IOLBF, 0);
    if (records_init())
        goto err_trace;
    if (copy_init(kvxd.loop, nthreads, (int)kvxd.conf.copy_pin_threads,
                  kvxd.conf.spin_us, kvxd.conf.copy_inline_bytes))
        goto err_records;
    copy_set_pace(kvxd.conf.copy_pace, kvxd.conf.gpu_pace);
    if (pacing_init(kvxd.loop) || session_init())
        goto err_copy;
    if (server_init())
        goto err_copy;
    if (fault_armed(FAULT_START_HOLD)) { /* a start stuck, signals or not */
        uint64_t end = kvxd_now_ms() + 1000 * fault_value(FAULT_START_HOLD);
        for (uint64_t t; (t = kvxd_now_ms()) < end;)
            usleep((useconds_t)((end - t) * 1000));
    }
    char why[512];
    /* net first; the layers above register with what is below them */
    if (peer_init(KVX_WHY(why)) || remote_init(KVX_WHY(why)) || agree_init()) {
        log_error("%s", why);
        goto err_server;
    }
    release_init(); /* after remote and agree: its loss callback last */
    keyed_init();
    metrics_set_sessions(session_count);
    if (http_init(KVX_WHY(why))) { /* last: its snapshot reads them all */
        log_error("%s", why);
        goto err_server;
    }
    kvxd_set_drain(drain_start);
    loop_signals();
    uv_timer_init(kvxd.loop, &tick);
    uv_timer_start(&tick, on_tick, kvxd.conf.deadline_tick_ms,
                   kvxd.conf.deadline_tick_ms);

    log_notice("kvxferd %s ready: %s, %u copy threads, address %s",
               KVX_VERSION_STRING, kvxd.conf.socket_path, nthreads,
               kvxd.address);
    notify_send("READY=1");
    uv_run(kvxd.loop, UV_RUN_DEFAULT);

    /* take down, in reverse */
    takedown_signals();
    if (fault_armed(FAULT_DOWN_HOLD)) { /* a take-down stuck */
        down_at = "a held take-down (KVXFERD_FAULT=down_hold)";
        uint64_t end = kvxd_now_ms() + 1000 * fault_value(FAULT_DOWN_HOLD);
        for (uint64_t t; (t = kvxd_now_ms()) < end;)
            usleep((useconds_t)((end - t) * 1000));
    }
    rc = 0;
    DOWN(http_cleanup);
    DOWN(session_close_all, "daemon exiting");
err_server:
    DOWN(server_cleanup);
    DOWN(peer_cleanup);
err_copy:
    DOWN(pacing_cleanup); /* the engines' paces, before their lanes go */
    DOWN(gpu_stop); /* GPU completions are all handed to the copy engine */
    DOWN(copy_cleanup);
    DOWN(remote_cleanup); /* after the copies that use the slots */
    DOWN(peer_shutdown);  /* after the slots' UCX registrations */
    DOWN(instance_cleanup);
    DOWN(agree_cleanup);
    DOWN(release_cleanup);
    DOWN(keyed_cleanup); /* its waiting fetches hold pools */
    DOWN(pool_cleanup);  /* drops the pools' GPU imports */
    DOWN(gpu_cleanup);   /* frees what is left of CUDA */
err_records:
    DOWN(records_cleanup); /* after every request has ended */
err_trace:
    if (kvxd.trace)
        fclose(kvxd.trace);
    kvxd.trace = NULL;
err_defer:
    DOWN(kvxd_defer_cleanup); /* last: drops what the cleanups above queued */
    uv_walk(kvxd.loop, close_walk, NULL);
    uv_run(kvxd.loop, UV_RUN_DEFAULT);
    uv_loop_close(kvxd.loop); /* UV_EBUSY: the signal watchers stay */
out:
    log_notice("kvxferd exiting (%s)", rc ? "error" : "drained");
    /* Past here a signal changes nothing, and UCX's library, on its way
     * out, sets SIGHUP (its debug signal) back to its default: one then
     * would kill the daemon by it. The threads that take signals are
     * gone; blocked, they die with the process. */
    sigset_t quiet;
    sigemptyset(&quiet);
    sigaddset(&quiet, SIGHUP);
    sigaddset(&quiet, SIGTERM);
    sigaddset(&quiet, SIGINT);
    pthread_sigmask(SIG_BLOCK, &quiet, NULL);
    return rc;
}
