/*
 * conf_keys — the table of configuration keys: for each its name, type,
 * field, default, bounds, whether SIGHUP applies it, and its one line of
 * help; and the validators for the rules that type and bounds cannot
 * express. Everything else (defaults, the loader, reload, the markdown
 * reference) is generic over this table, in conf.c.
 *
 * Adding a key is one entry here and one field in kvx_conf_t.
 */
#include "conf_int.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>

#include "kvxfer.h"
#include "log.h"

static int check_group(const kvx_conf_t *conf, kvx_why_t *why);
static int check_hello(const kvx_conf_t *conf, kvx_why_t *why);
static int check_listen(const kvx_conf_t *conf, kvx_why_t *why);
static int check_secret_file(const kvx_conf_t *conf, kvx_why_t *why);
static int check_log_format(const kvx_conf_t *conf, kvx_why_t *why)
{
    static const char *const ok[] = {"auto", "text", "json", "journal"};
    char w[200];
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
        if (!strcmp(conf->log_format, ok[i])) /* journal needs libsystemd */
            return log_format_check(ok[i], KVX_WHY(w))
                       ? why_fail(why, 1, "%s", w)
                       : 0;
    char what[64];
    return why_fail(why, 1, "%s (expected auto, text, json or journal)",
                    conf_shown(conf->log_format, strlen(conf->log_format), what,
                               sizeof(what)));
}
static int check_keepalive(const kvx_conf_t *conf, kvx_why_t *why);
static int check_metrics_listen(const kvx_conf_t *conf, kvx_why_t *why);
static int check_topology(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *t = conf->peer_topology;
    if (!strcmp(t, "auto") || !strcmp(t, "off"))
        return 0;
    char what[64];
    return why_fail(why, 1,
                    "\"%s\" is not a topology mode (expected auto "
                    "or off)",
                    conf_shown(t, strlen(t), what, sizeof(what)));
}

static int check_copy_path(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *t = conf->gpu_copy_path;
    if (!strcmp(t, "kernel") || !strcmp(t, "dma") || !strcmp(t, "auto"))
        return 0;
    char what[64];
    return why_fail(why, 1,
                    "\"%s\" is not a copy path (expected kernel, dma or "
                    "auto)",
                    conf_shown(t, strlen(t), what, sizeof(what)));
}

static int check_priority(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *t = conf->gpu_stream_priority;
    if (!strcmp(t, "normal") || !strcmp(t, "low"))
        return 0;
    char what[64];
    return why_fail(why, 1,
                    "\"%s\" is not a stream priority (expected normal or "
                    "low)",
                    conf_shown(t, strlen(t), what, sizeof(what)));
}

/* The length of the device name ("mlx5_0:1", "eth1") at s, ending at
 * one of the characters of ends; 0: none there. */
static size_t rail_name(const char *s, const char *ends)
{
    size_t l = 0, colon = 0;
    for (; s[l] && !strchr(ends, s[l]); l++) {
        char c = s[l];
        if (c == ':' && l && !colon)
            colon = l;
        else if (!(c >= 'a' && c <= 'z') && !(c >= 'A' && c <= 'Z') &&
                 !(c >= '0' && c <= '9') && c != '_' && c != '.' && c != '-')
            return 0;
        else if (colon && !(c >= '0' && c <= '9'))
            return 0;
    }
    return l && l < 64 && (!colon || l != colon + 1) ? l : 0;
}

/* RAIL,RAIL,...: at most 16 (a lane each at least: lane.h's LANES_MAX),
 * no name twice. */
static int check_rails(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *r = conf->peer_rails;
    char what[64];
    unsigned n = 0;
    if (!r[0])
        return 0;
    if (strcmp(conf->peer_topology, "auto"))
        return why_fail(why, 1, "needs peer.topology: auto");
    for (const char *s = r;; n++) {
        size_t l = rail_name(s, ",");
        if (!l)
            return why_fail(why, 1,
                            "\"%s\" is not a device name (expected names "
                            "as UCX_NET_DEVICES has them, e.g. "
                            "mlx5_0:1,eth1)",
                            conf_shown(s, strcspn(s, ","), what, sizeof(what)));
        for (const char *o = r; o < s; o += strcspn(o, ",") + 1)
            if (strcspn(o, ",") == l && !strncmp(o, s, l))
                return why_fail(why, 1, "\"%s\" is named twice",
                                conf_shown(s, l, what, sizeof(what)));
        if (n == 16)
            return why_fail(why, 1, "more than 16 rails (one lane each)");
        if (!s[l])
            return 0;
        s += l + 1;
    }
}

/* BUS_ID=RAIL[+RAIL...],...: a bus id as nvidia-smi (8 hex digits of
 * domain) or CUDA (4) writes it. */
static int check_gpu_rails(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *s = conf->peer_gpu_rails;
    char what[64];
    if (!s[0])
        return 0;
    if (strcmp(conf->peer_topology, "auto"))
        return why_fail(why, 1, "needs peer.topology: auto");
    for (;;) {
        size_t el = strcspn(s, ","), bl = strcspn(s, "=,");
        const char *form = bl == 16 ? "xxxxxxxx:xx:xx.x" : "xxxx:xx:xx.x";
        int ok = s[bl] == '=' && bl == strlen(form);
        for (size_t i = 0; ok && i < bl; i++)
            ok = form[i] == 'x' ? isxdigit((unsigned char)s[i])
                                : s[i] == form[i];
        if (!ok)
            return why_fail(why, 1,
                            "\"%s\" is not BUS_ID=RAIL[+RAIL...] (expected "
                            "e.g. 0000:1b:00.0=mlx5_0:1+mlx5_1:1)",
                            conf_shown(s, el, what, sizeof(what)));
        for (const char *p = s + bl + 1;;) {
            size_t l = rail_name(p, "+,");
            if (!l) {
                char rail[64];
                return why_fail(
                    why, 1,
                    "\"%s\": \"%s\" is not a device name (expected "
                    "names as UCX_NET_DEVICES has them, e.g. mlx5_0:1)",
                    conf_shown(s, bl, what, sizeof(what)),
                    conf_shown(p, strcspn(p, "+,"), rail, sizeof(rail)));
            }
            p += l;
            if (*p != '+')
                break;
            p++;
        }
        if (!s[el])
            return 0;
        s += el + 1;
    }
}

static int check_slots(const kvx_conf_t *conf, kvx_why_t *why);
static int check_ucx_ports(const kvx_conf_t *conf, kvx_why_t *why);
static int check_allowed(const kvx_conf_t *conf, kvx_why_t *why);
static int check_topology(const kvx_conf_t *conf, kvx_why_t *why);
static int check_rails(const kvx_conf_t *conf, kvx_why_t *why);
static int check_gpu_rails(const kvx_conf_t *conf, kvx_why_t *why);
static int check_copy_path(const kvx_conf_t *conf, kvx_why_t *why);
static int check_priority(const kvx_conf_t *conf, kvx_why_t *why);

#define FIELD(f)                                                               \
    .off = offsetof(kvx_conf_t, f), .size = sizeof(((kvx_conf_t *)0)->f)
#define IDS(f, nf) FIELD(f), .count_off = offsetof(kvx_conf_t, nf)

const struct conf_key conf_keys[] = {
    {.name = "socket.path",
     .type = CONF_PATH,
     FIELD(socket_path),
     .def_str = "/run/kvxfer/kvxferd.sock",
     .help = "Unix socket the daemon listens on; a missing directory is "
             "created (mode 0755) when its parent exists."},
    {.name = "socket.mode",
     .type = CONF_MODE,
     FIELD(socket_mode),
     .def = 0660,
     .min = 0,
     .max = 0777,
     .help = "Permission bits of the socket file; only peers that can "
             "write to it can connect."},
    {.name = "socket.group",
     .type = CONF_STRING,
     FIELD(socket_group),
     .def_str = "",
     .check = check_group,
     .help = "Group (name or number) that owns the socket file; empty "
             "means the daemon's own group."},

    {.name = "auth.allowed_uids",
     .type = CONF_IDS,
     IDS(allowed_uids, num_allowed_uids),
     .min = 0,
     .max = UINT32_MAX - 1,
     .help = "Peer uids allowed to connect, besides root and the daemon's "
             "own uid and group, which always are."},
    {.name = "auth.allowed_gids",
     .type = CONF_IDS,
     IDS(allowed_gids, num_allowed_gids),
     .min = 0,
     .max = UINT32_MAX - 1,
     .group_names = 1,
     .help = "Peer groups allowed to connect, by name or gid: a peer whose "
             "gid, or one of whose groups, is listed is let in. A name is "
             "looked up when the file is read (start, SIGHUP)."},
    {.name = "auth.admin_gids",
     .type = CONF_IDS,
     IDS(admin_gids, num_admin_gids),
     .min = 0,
     .max = UINT32_MAX - 1,
     .group_names = 1,
     .help = "Groups (names or gids) whose members see every user's "
             "sessions, pools, instances and requests in status and request "
             "lists, as root "
             "and the daemon's own uid do; other clients see their own "
             "uid's only."},

    {.name = "limits.max_frame_bytes",
     .type = CONF_SIZE,
     FIELD(max_frame_bytes),
     .def = 16 * MiB,
     .min = 4 * KiB,
     .max = 1 * GiB,
     .help = "Largest frame accepted from a client after Hello; a larger "
             "length prefix closes the connection."},
    {.name = "limits.hello_frame_bytes",
     .type = CONF_SIZE,
     FIELD(hello_frame_bytes),
     .def = 4096,
     .min = 256,
     .max = 64 * KiB,
     .check = check_hello,
     .help = "Largest frame accepted before Hello, the smaller cap for "
             "unauthenticated peers; at most limits.max_frame_bytes."},
    {.name = "limits.max_sessions",
     .type = CONF_U32,
     FIELD(max_sessions),
     .def = 1024,
     .min = 1,
     .max = 65536,
     .help = "Sessions that said Hello (ranks) open at once; a Hello "
             "past it is refused with KVX_ERR_LIMIT naming the key. "
             "Connections that have not said Hello count in "
             "limits.hello_sessions instead."},
    {.name = "limits.uid_sessions",
     .type = CONF_U32,
     FIELD(uid_sessions),
     .def = 0,
     .min = 0,
     .max = 65536,
     .help = "One uid's share of limits.max_sessions: a Hello past it is "
             "refused with KVX_ERR_LIMIT naming the key, so one tenant "
             "cannot take every slot; 0 is half of limits.max_sessions."},
    {.name = "limits.hello_sessions",
     .type = CONF_U32,
     FIELD(hello_sessions),
     .def = 64,
     .min = 1,
     .max = 65536,
     .help = "Connections that have not said Hello (observers: status, "
             "reserve, release; ranks before their Hello), beside "
             "limits.max_sessions. When they are all taken, a new "
             "connection takes the place of the one that has said nothing "
             "for longest (else of the one idle longest, of the uid "
             "holding most), so a flood of silent connections never locks "
             "out status."},
    {.name = "limits.max_requests",
     .type = CONF_U32,
     FIELD(max_requests),
     .def = 65536,
     .min = 1,
     .max = 1048576,
     .help = "Requests in flight in the whole daemon; more are refused "
             "with KVX_ERR_LIMIT."},
    {.name = "limits.max_pools",
     .type = CONF_U32,
     FIELD(max_pools),
     .def = 256,
     .min = 1,
     .max = 4096,
     .help = "Memory pools one session may register."},
    {.name = "limits.memory_bytes",
     .type = CONF_SIZE,
     FIELD(memory_bytes),
     .def = 2 * GiB,
     .min = 64 * MiB,
     .max = 1024 * GiB,
     .reloadable = 1,
     .help = "The daemon's memory budget for what it holds for others: "
             "client frames being read, replies queued, transfer plans "
             "and the staging slots between daemons (charged at start). "
             "Work that would pass it is refused with KVX_ERR_LIMIT, "
             "never an out-of-memory; a lower value on reload refuses new "
             "work until use falls under it. Also charged: requests "
             "(offers, reservations, fetches) with their block lists, aux "
             "payloads, and the pages of host pools not resident when "
             "they are registered (the daemon would fault them in)."},
    {.name = "limits.uid_memory_bytes",
     .type = CONF_SIZE,
     FIELD(uid_memory_bytes),
     .def = 0,
     .min = 0,
     .max = 1024 * GiB,
     .reloadable = 1,
     .help = "One uid's share of limits.memory_bytes: what that uid's "
             "clients make the daemon hold; work past it is refused with "
             "KVX_ERR_LIMIT naming the key, so one tenant cannot take the "
             "whole budget. 0 is half of limits.memory_bytes."},
    {.name = "limits.batches_kept",
     .type = CONF_U32,
     FIELD(batches_kept),
     .def = 4096,
     .min = 16,
     .max = 1048576,
     .help = "Sealed batches one instance keeps for ranks that have not "
             "read them; past it the oldest is dropped, and a rank that had "
             "not read it gets KVX_ERR_LIMIT at its next poll, then reads "
             "on. Every rank must poll, also one that fetched nothing "
             "(another attention-DP group), or its batches pile up to "
             "this. For instances made after a change (restart)."},
    {.name = "limits.max_blocks_per_request",
     .type = CONF_U32,
     FIELD(max_blocks_per_request),
     .def = 1048576,
     .min = 1,
     .max = 16777216,
     .help = "KV blocks one request may name."},
    {.name = "limits.session_queue_bytes",
     .type = CONF_SIZE,
     FIELD(session_queue_bytes),
     .def = 4 * MiB,
     .min = 64 * KiB,
     .max = 1 * GiB,
     .reloadable = 1,
     .help = "Reply bytes one session may have queued (its client not "
             "reading them yet); past it the daemon reads no more of its "
             "requests until the client has read them. A session without "
             "Hello gets at most 256KiB."},
    {.name = "limits.session_requests",
     .type = CONF_U32,
     FIELD(session_requests),
     .def = 1024,
     .min = 1,
     .max = 1048576,
     .reloadable = 1,
     .help = "Requests of one session awaiting their replies (held polls "
             "and cancels); more are refused with KVX_ERR_LIMIT. A session "
             "without Hello gets at most 8."},
    {.name = "limits.list_page_entries",
     .type = CONF_U32,
     FIELD(list_page_entries),
     .def = 1000,
     .min = 1,
     .max = 65536,
     .reloadable = 1,
     .help = "Requests one ListRequests reply lists at most; clients ask "
             "for the next page (libkvxfer and kvxferctl do)."},
    {.name = "limits.aux_bytes",
     .type = CONF_SIZE,
     FIELD(aux_bytes),
     .def = 64 * KiB,
     .min = 0,
     .max = 1 * MiB,
     .reloadable = 1,
     .help = "Largest aux payload (first token, logprobs) a publish may "
             "carry to the generation side's COMPLETE event; a larger one "
             "is refused with KVX_ERR_LIMIT, and one from a peer daemon "
             "fails its request. 0: none. A publish's frame holds it "
             "(limits.max_frame_bytes)."},

    {.name = "copy.worker_threads",
     .type = CONF_U32,
     FIELD(worker_threads),
     .def = 0,
     .min = 0,
     .max = 256,
     .help = "Copy worker threads; 0 means one per online CPU."},
    {.name = "copy.pin_threads",
     .type = CONF_U32,
     FIELD(copy_pin_threads),
     .def = 2,
     .min = 0,
     .max = 2,
     .help = "Each copy worker bound to a CPU of its own among those the "
             "daemon may use (in turn, when there are more workers than "
             "CPUs): 0 never, 1 always, 2 when it may use fewer than 4 "
             "CPUs. Two workers woken onto one CPU can share it for "
             "milliseconds (the scheduler keeps a thread that just ran "
             "where its cache is), and a request's last copy then takes "
             "up to twice as long; bound workers cannot move away from "
             "other busy threads either, which cost a 16-CPU host 8-15 % "
             "of its bandwidth."},
    {.name = "copy.chunk_bytes",
     .type = CONF_SIZE,
     FIELD(copy_chunk_bytes),
     .def = 4 * MiB,
     .min = 4 * KiB,
     .max = 1 * GiB,
     .reloadable = 1,
     .help = "A large transfer is cut into chunks of about this many bytes "
             "so that many requests progress together."},
    {.name = "copy.max_inflight_chunks",
     .type = CONF_U32,
     FIELD(max_inflight_chunks),
     .def = 0,
     .min = 0,
     .max = 4096,
     .reloadable = 1,
     .help = "Chunks queued to or running on the workers at once; 0 means "
             "twice the number of worker threads."},
    {.name = "copy.spin_us",
     .type = CONF_U32,
     FIELD(spin_us),
     .def = 20,
     .min = 0,
     .max = 1000,
     .help = "An idle copy worker (one at most) spins this long before "
             "sleeping; saves a wake-up per small request; 0 turns it "
             "off."},

    {.name = "copy.inline_bytes",
     .type = CONF_SIZE,
     FIELD(copy_inline_bytes),
     .def = 64 * KiB,
     .min = 0,
     .max = 16 * MiB,
     .help = "A host copy job whose whole plan moves this many bytes or "
             "fewer runs on the daemon's loop thread instead of waking a "
             "copy worker (two thread hand-offs cost more than copying a "
             "few blocks); 0: every job goes to the workers."},

    {.name = "copy.pace",
     .type = CONF_SIZE,
     FIELD(copy_pace),
     .def = 0,
     .min = 0,
     .max = 1024 * GiB,
     .reloadable = 1,
     .help = "Bytes a millisecond that host copies (the copy workers', "
             "pool to pool and into or out of the staging slots) may "
             "start, for memory bandwidth left to the engines; a chunk "
             "over the pace waits, in order, and a millisecond's worth "
             "may start at once after a pause; 0: no pace. A reload "
             "applies it to chunks already waiting."},

    {.name = "copy.busy_poll",
     .type = CONF_U32,
     FIELD(copy_busy_poll),
     .def = 1,
     .min = 0,
     .max = 2,
     .help = "While a request is in flight here (published and not yet "
             "consumed or ended, or fetched and not yet ended), the loop "
             "polls every turn instead of sleeping, so that the engine's "
             "next call (a fetch, a layer made ready), a CUDA event and "
             "the copies coming back are read within microseconds; it "
             "yields its CPU each turn, so that a copy worker or an "
             "engine's thread waiting there runs at once: 0 never, 1 "
             "always, 2 when the daemon may use 4 or more CPUs. Idle, it "
             "sleeps."},

    {.name = "gpu.max_ctas",
     .type = CONF_U32,
     FIELD(gpu_max_ctas),
     .def = 64,
     .min = 1,
     .max = 1024,
     .reloadable = 1,
     .help = "Thread blocks one GPU copy kernel may use; the GPUs are busy "
             "running the model."},
    {.name = "gpu.spin_us",
     .type = CONF_U32,
     FIELD(gpu_spin_us),
     .def = 50,
     .min = 0,
     .max = 1000,
     .help = "The thread that sees a GPU copy finish spins this long for "
             "the next one, and on each one, before it sleeps; saves two "
             "wake-ups per small request; 0 turns it off."},
    {.name = "gpu.event_poll_us",
     .type = CONF_U32,
     FIELD(gpu_event_poll_us),
     .def = 10,
     .min = 1,
     .max = 1000,
     .help = "How often a thread waiting for a GPU event looks at it: the "
             "engine's events of a layer-wise offer while any is watched, "
             "and a copy kernel still running after gpu.spin_us (up to 2 "
             "ms, then it blocks). Shorter finds a layer or a copy done "
             "sooner and costs more CPU while the GPU works."},
    {.name = "gpu.chunk_bytes",
     .type = CONF_SIZE,
     FIELD(gpu_chunk_bytes),
     .def = 2 * GiB,
     .min = 64 * KiB,
     .max = 4 * GiB,
     .reloadable = 1,
     .help = "Bytes one GPU kernel launch moves at most. Each launch "
             "costs about 20 us beyond its bytes (one H200: 0.81 of "
             "cudaMemcpy with 256MiB, 0.89 with 1GiB, 0.90 with 2GiB); a "
             "cancel waits for the request's launches already queued, at "
             "most copy.max_inflight_chunks of them."},
    {.name = "gpu.staging_bytes",
     .type = CONF_SIZE,
     FIELD(gpu_staging_bytes),
     .def = 64 * MiB,
     .min = 0,
     .max = 64 * GiB,
     .help = "GPU memory per device for the staging slots of transfers "
             "between daemons, where the loaded UCX moves CUDA memory "
             "(status ucx.staging \"gpu\"): half for each direction, in "
             "slots of peer.slot_bytes (fewer than 2 a direction: host "
             "slots); made on the device's first GPU pool that moves "
             "between daemons and kept until the daemon stops. A GPU "
             "pool's bytes then never cross host memory where UCX's "
             "transport does not (cuda_ipc within a node, GPUDirect RDMA). "
             "0, or a UCX without CUDA: the host slots (peer.slots), "
             "pinned."},
    {.name = "gpu.copy_path",
     .type = CONF_STRING,
     FIELD(gpu_copy_path),
     .def_str = "kernel",
     .check = check_copy_path,
     .help = "What moves a GPU pool's bytes within the node and into "
             "the staging slots: kernel, the daemon's copy kernel (every "
             "layout change, any run size; it takes SMs from the engine "
             "while it runs); dma, the GPU's copy engines "
             "(cudaMemcpyBatchAsync, one copy a contiguous run, runs that "
             "continue each other joined, no SMs); auto, dma where a "
             "launch's joined runs are gpu.dma_min_run long or longer on "
             "average (a request's blocks in order, in vLLM's layout), "
             "else kernel. See docs/operations.md, \"Sharing a GPU with "
             "the engine\"."},
    {.name = "gpu.dma_min_run",
     .type = CONF_SIZE,
     FIELD(gpu_dma_min_run),
     .def = 4 * MiB,
     .min = 256,
     .max = 1 * GiB,
     .reloadable = 1,
     .help = "With gpu.copy_path auto: the shortest average run (bytes "
             "in one piece on both sides, joined across blocks that lie "
             "in order on both sides) that the copy engines move; "
             "shorter runs go to the kernel. A copy costs the copy "
             "engines about 4.4 us whatever its size: on an H100 runs of "
             "32 KiB (one block) moved 11.5 GB/s, of 32 MiB (1,024 blocks "
             "in order) 1,248 GB/s, where the kernel moved 1,390 and "
             "1,410."},
    {.name = "gpu.dma_min_run_host",
     .type = CONF_SIZE,
     FIELD(gpu_dma_min_run_host),
     .def = 32 * KiB,
     .min = 256,
     .max = 1 * GiB,
     .reloadable = 1,
     .help = "gpu.dma_min_run for a launch that reads or writes host "
             "memory (a host pool, a host staging slot): its copies cross "
             "PCIe, where the copy engines keep up with the kernel, and "
             "without MPS they leave the engine's kernels alone (the "
             "kernel does not). A copy costs them about 0.7 us there: on "
             "an H100, host to GPU, runs of 2, 8 and 32 KiB moved 2.3-4.6, "
             "12 and 45 GB/s, the kernel 48, 50 and 51; beside a busy "
             "engine its step took x1.04 (the kernel: x3.44)."},
    {.name = "gpu.sm_share",
     .type = CONF_U32,
     FIELD(gpu_sm_share),
     .def = 0,
     .min = 0,
     .max = 100,
     .help = "Under MPS: the percentage of each GPU's SMs the daemon's "
             "kernels may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for its "
             "own context, set before CUDA starts); 0 leaves the "
             "environment's value. Without MPS it has no effect (the log "
             "says which)."},
    {.name = "gpu.stream_priority",
     .type = CONF_STRING,
     FIELD(gpu_stream_priority),
     .def_str = "normal",
     .check = check_priority,
     .help = "The priority of the daemon's copy streams: normal, or low "
             "(the device's lowest), so that work of higher priority in "
             "the same context is scheduled first; across processes it "
             "matters only under MPS."},
    {.name = "gpu.pace",
     .type = CONF_SIZE,
     FIELD(gpu_pace),
     .def = 0,
     .min = 0,
     .max = 1024 * GiB,
     .reloadable = 1,
     .help = "Bytes a millisecond that each GPU's copies (kernel or copy "
             "engines, pool to pool and into or out of the staging slots) "
             "may start, so that an engine on that GPU keeps most of it "
             "while kvxfer moves KV; a chunk over the pace waits, in "
             "order, and a millisecond's worth may start at once after a "
             "pause; 0: no pace. A reload (SIGHUP) changes it for chunks "
             "already waiting too. Engines may set their own for their "
             "GPUs (GpuPace): each GPU goes at the lowest that is set. "
             "See docs/operations.md, \"Sharing a GPU with the "
             "engine\"."},

    {.name = "peer.listen",
     .type = CONF_STRING,
     FIELD(peer_listen),
     .def_str = "",
     .check = check_listen,
     .help = "IP:PORT this daemon accepts peer daemons on and advertises "
             "in its address: a TCP socket of the daemon's own, where "
             "daemons authenticate before UCX is used; port 0 picks a free "
             "port; empty turns transfers between daemons off."},
    {.name = "peer.secret_file",
     .type = CONF_STRING,
     FIELD(peer_secret_file),
     .def_str = "",
     .check = check_secret_file,
     .help = "File holding the cluster secret (16 to 4096 bytes, readable "
             "by the owner only) that daemons prove to each other; "
             "required with peer.listen. An absolute path, or a bare name: "
             "a credential, the file of that name in "
             "$CREDENTIALS_DIRECTORY (systemd's LoadCredential=NAME:FILE)."},
    {.name = "peer.secret_previous_ms",
     .type = CONF_MS,
     FIELD(peer_secret_previous_ms),
     .def = 600000,
     .min = 0,
     .max = 86400000,
     .reloadable = 1,
     .help = "After SIGHUP brings a new secret in peer.secret_file, how "
             "long handshakes still accept the previous one (both MAC a "
             "daemon that has not rotated yet), so that a cluster "
             "rotates its secret without a restart."},
    {.name = "peer.net_devices",
     .type = CONF_STRING,
     FIELD(peer_net_devices),
     .def_str = "",
     .help = "The network devices UCX may use and listen on (its "
             "UCX_NET_DEVICES, e.g. \"eth1,mlx5_0:1\"); empty: the "
             "interface that holds peer.listen's IP and every RDMA "
             "device, so that UCX's TCP transport listens on no other "
             "interface; \"all\": every device. The environment's "
             "UCX_NET_DEVICES, when set, wins."},
    {.name = "peer.ucx_ports",
     .type = CONF_STRING,
     FIELD(peer_ucx_ports),
     .def_str = "",
     .check = check_ucx_ports,
     .help = "Port range LO-HI that UCX's TCP transport listens on for "
             "the connections of its endpoints (the loop's worker and "
             "each lane; open it in firewalls between daemons); empty: "
             "any free port."},
    {.name = "peer.allowed",
     .type = CONF_STRING,
     FIELD(peer_allowed),
     .def_str = "",
     .check = check_allowed,
     .help = "The networks other daemons are in, as IPs or CIDRs "
             "separated by commas (\"10.0.0.0/16,10.1.0.7\"): this daemon "
             "dials only daemons there, whatever a request's params name, "
             "and answers handshakes only from there; empty: the network "
             "of the interface that holds peer.listen's IP (its address "
             "and netmask)."},
    {.name = "peer.keepalive_interval_ms",
     .type = CONF_MS,
     FIELD(keepalive_interval_ms),
     .def = 1000,
     .min = 10,
     .max = 600000,
     .reloadable = 1,
     .check = check_keepalive,
     .help = "How often each peer daemon is pinged."},
    {.name = "peer.keepalive_timeout_ms",
     .type = CONF_MS,
     FIELD(keepalive_timeout_ms),
     .def = 5000,
     .min = 50,
     .max = 3600000,
     .reloadable = 1,
     .help = "A peer silent this long is lost: every transfer with it ends "
             "with KVX_ERR_PEER_GONE; the next use reconnects."},
    {.name = "peer.connect_timeout_ms",
     .type = CONF_MS,
     FIELD(peer_connect_timeout_ms),
     .def = 5000,
     .min = 10,
     .max = 600000,
     .reloadable = 1,
     .help = "Connecting to a peer and authenticating must finish within "
             "this."},
    {.name = "peer.slot_bytes",
     .type = CONF_SIZE,
     FIELD(slot_bytes),
     .def = 4 * MiB,
     .min = 64 * KiB,
     .max = 1 * GiB,
     .help = "Staging slot size: the most one pull asks for; its pieces "
             "(peer.message_bytes) are gathered, sent and scattered "
             "each on its own, pipelined."},
    {.name = "peer.slots",
     .type = CONF_U32,
     FIELD(slots),
     .def = 0,
     .min = 0,
     .max = 1024,
     .check = check_slots,
     .help = "Staging slots for each direction (sending and receiving); "
             "allocated and registered once, at start. 0: as many as "
             "fit in 32 MiB, at least 2 (8 of 4 MiB, 2 of 16 MiB); 1 is "
             "refused (one slot cannot overlap anything)."},
    {.name = "peer.message_bytes",
     .type = CONF_SIZE,
     FIELD(message_bytes),
     .def = 4 * MiB,
     .min = 64 * KiB,
     .max = 1 * GiB,
     .help = "Largest message UCX is given: a larger slot is sent as "
             "pieces of this size (at most 64), received straight into "
             "their place in the slot."},
    {.name = "peer.send_window",
     .type = CONF_U32,
     FIELD(send_window),
     .def = 4,
     .min = 1,
     .max = 1024,
     .help = "Messages in flight to one peer at once; more wait, "
             "gathered, in order, so that one slot finishes while the "
             "next is gathered and the one before is scattered."},
    {.name = "peer.lanes",
     .type = CONF_U32,
     FIELD(lanes),
     .def = 2,
     .min = 0,
     .max = 16,
     .help = "UCX workers, each on a thread of its own, that carry slot "
             "data to and from other daemons (a slot's pieces spread over "
             "them), so that the wire's copies run on that many cores; 0 "
             "carries data on the loop's worker. Their addresses are told "
             "only to authenticated daemons. Both daemons need lanes for a "
             "connection to use them. With several rails (peer.topology) "
             "that many on each rail, 16 in all at most."},
    {.name = "peer.direct",
     .type = CONF_U32,
     FIELD(direct),
     .def = 2,
     .min = 0,
     .max = 2,
     .help = "Slot data between daemons skips the staging slots where a "
             "host pool's runs allow: a piece is received by UCX straight "
             "into the destination blocks (an iov of their runs, unpacked "
             "on the lanes' threads) instead of into the receive slot and "
             "scattered from there, and sent by UCX straight from the "
             "source blocks instead of gathered into the send slot "
             "first: a copy fewer on each daemon, fewer threads copying. "
             "Only for pieces whose runs average 2 KiB or more, and only "
             "over lanes (where their stall check bounds how long a "
             "request's fence waits for UCX); GPU pools always go "
             "through the slots. 0 never, 1 always, 2 when the daemon may "
             "use fewer than 4 CPUs (where copies, not threads, are what "
             "is short) and UCX may use no RDMA device (an iov gives up "
             "UCX's zero-copy rendezvous there)."},
    {.name = "peer.busy_poll",
     .type = CONF_U32,
     FIELD(busy_poll),
     .def = 2,
     .min = 0,
     .max = 2,
     .help = "While transfers between daemons are in flight the loop "
             "polls UCX every turn instead of sleeping on its event fd: "
             "0 never, 1 always, 2 when the daemon may use 4 or more CPUs "
             "(with fewer, the "
             "spinning loop takes the copy threads' CPU). Idle, it always "
             "sleeps."},

    {.name = "peer.gather_ahead",
     .type = CONF_U32,
     FIELD(gather_ahead),
     .def = 0,
     .min = 0,
     .max = 8,
     .help = "Send slots a stream may gather before the generation daemon "
             "pulls them (the next units it will ask for), so that a PULL "
             "finds its data ready; only while no PULL waits for a slot "
             "and more than one slot is free; 0 turns it off."},
    {.name = "peer.topology",
     .type = CONF_STRING,
     FIELD(peer_topology),
     .def_str = "auto",
     .check = check_topology,
     .help = "auto: the lanes are grouped by NIC (rails, each lane's UCX "
             "limited to its NIC, peer.lanes lanes per rail), and a GPU "
             "pool's slot data goes over the lanes of the NICs nearest to "
             "its GPU (same PCIe switch, then host bridge, then NUMA "
             "node), read from sysfs at start; with one NIC (or none that "
             "UCX may use, or UCX_NET_DEVICES set) it is one rail, as "
             "off. off: one rail, every lane on the devices of "
             "peer.net_devices."},
    {.name = "peer.rails",
     .type = CONF_STRING,
     FIELD(peer_rails),
     .def_str = "",
     .check = check_rails,
     .help = "The NICs to use as rails, as UCX_NET_DEVICES names them, "
             "separated by commas (\"mlx5_0:1,mlx5_1:1\", or \"eth1,eth2\" "
             "for TCP); each must be up at start; empty: every RDMA port "
             "that is active and that peer.net_devices allows, else the "
             "one interface of peer.listen's IP (one rail)."},
    {.name = "peer.gpu_rails",
     .type = CONF_STRING,
     FIELD(peer_gpu_rails),
     .def_str = "",
     .check = check_gpu_rails,
     .help = "Rails chosen by hand for some GPUs, overriding the PCIe "
             "distance: BUS_ID=RAIL[+RAIL...] separated by commas "
             "(\"0000:1b:00.0=mlx5_0:1+mlx5_1:1,0000:3d:00.0=mlx5_2:1\"), "
             "the GPU's PCI bus id as nvidia-smi shows it; each rail "
             "must be one of the rails."},
    {.name = "peer.sysfs_root",
     .type = CONF_PATH,
     FIELD(peer_sysfs_root),
     .def_str = "/sys",
     .help = "Where peer.topology reads the NICs, GPUs and PCIe tree "
             "(a container that mounts the host's sysfs elsewhere; tests); "
             "one that cannot be read leaves one rail, with a warning."},

    {.name = "deadlines.offer_lease_ms",
     .type = CONF_MS,
     FIELD(offer_lease_ms),
     .def = 30000,
     .min = 1,
     .max = 86400000,
     .reloadable = 1,
     .help = "How long published KV stays held for a fetch before it is "
             "released and the request fails with KVX_ERR_TIMED_OUT."},
    {.name = "deadlines.offer_lease_max_ms",
     .type = CONF_MS,
     FIELD(offer_lease_max_ms),
     .def = 600000,
     .min = 1,
     .max = 86400000,
     .reloadable = 1,
     .help = "The longest lease a publish or reservation may ask for its "
             "offer (lease_ms); a longer one is refused. Renewals "
             "(kvx_renew) extend an offer by its own lease each."},
    {.name = "deadlines.fetch_timeout_ms",
     .type = CONF_MS,
     FIELD(fetch_timeout_ms),
     .def = 30000,
     .min = 1,
     .max = 86400000,
     .reloadable = 1,
     .help = "How long a fetch may wait for its data before it fails with "
             "KVX_ERR_TIMED_OUT."},
    {.name = "deadlines.poll_timeout_max_ms",
     .type = CONF_MS,
     FIELD(poll_timeout_max_ms),
     .def = 60000,
     .min = 0,
     .max = 3600000,
     .reloadable = 1,
     .help = "Longest a poll may be held waiting for events; a longer "
             "client timeout is cut to this."},
    {.name = "deadlines.drain_timeout_ms",
     .type = CONF_MS,
     FIELD(drain_timeout_ms),
     .def = 5000,
     .min = 0,
     .max = 600000,
     .reloadable = 1,
     .help = "On shutdown every request ends at once with SHUTDOWN; this "
             "bounds the wait for in-flight copies to be fenced and the "
             "last replies to be sent."},
    {.name = "deadlines.deadline_tick_ms",
     .type = CONF_MS,
     FIELD(deadline_tick_ms),
     .def = 10,
     .min = 1,
     .max = 1000,
     .reloadable = 1,
     .help = "Granularity of deadline checks: a deadline fires up to this "
             "late."},
    {.name = "deadlines.hello_timeout_ms",
     .type = CONF_MS,
     FIELD(hello_timeout_ms),
     .def = 10000,
     .min = 1,
     .max = 3600000,
     .reloadable = 1,
     .help = "A connection that has sent no request this long after "
             "connecting is closed. One that sends requests without Hello "
             "(an observer: status, lists, reserve) stays, under "
             "deadlines.session_idle_ms."},
    {.name = "deadlines.session_idle_ms",
     .type = CONF_MS,
     FIELD(session_idle_ms),
     .def = 600000,
     .min = 0,
     .max = 86400000,
     .reloadable = 1,
     .help = "A session (a rank, or an observer once it has sent a "
             "request) that holds no pool, waits for no reply and has sent "
             "nothing this long is closed, so idle clients cannot hold "
             "limits.max_sessions; 0 never."},
    {.name = "deadlines.reply_stall_ms",
     .type = CONF_MS,
     FIELD(reply_stall_ms),
     .def = 10000,
     .min = 1,
     .max = 3600000,
     .reloadable = 1,
     .help = "A session with more than limits.session_queue_bytes of "
             "replies queued whose client reads none of them this long is "
             "closed."},

    {.name = "log.level",
     .type = CONF_LEVEL,
     FIELD(log_level),
     .def = LOG_INFO,
     .min = LOG_ERR,
     .max = LOG_DEBUG,
     .reloadable = 1,
     .help = "Least severe message logged."},
    {.name = "log.trace_file",
     .type = CONF_STRING,
     FIELD(log_trace_file),
     .def_str = "",
     .help = "File (appended to) that gets one line per fetch as it ends, "
             "with the monotonic time of each hop (kvxfer-bench --trace "
             "reads it); empty: none."},
    {.name = "log.format",
     .type = CONF_STRING,
     FIELD(log_format),
     .def_str = "auto",
     .check = check_log_format,
     .reloadable = 1,
     .help = "How log lines are written: journal (sd_journal_send, with "
             "the fields INSTANCE, KEY, PEER, CODE), json (one JSON object "
             "a line on stderr, for Loki and the like), text (\"<6>kvxferd: "
             "...\" on stderr, the priority journald reads from a stream), "
             "or auto: journal when stderr is journald's stream "
             "($JOURNAL_STREAM), text with level names (\"info: ...\") on a "
             "terminal, else text."},

    /* ---- records: one per finished request (core/records.c) ---- */
    {.name = "records.ring",
     .type = CONF_U32,
     FIELD(records_ring),
     .def = 1024,
     .min = 0,
     .max = 100000,
     .help = "Finished requests kept in memory for kvxferctl requests "
             "--done (584 bytes each), newest replacing oldest; 0: "
             "none kept."},
    {.name = "records.file",
     .type = CONF_STRING,
     FIELD(records_file),
     .def_str = "",
     .reloadable = 1,
     .help = "File that gets one JSON line per finished request (appended "
             "to; reopened on SIGHUP, so logrotate may move it); empty: "
             "none."},
    {.name = "records.max_bytes",
     .type = CONF_SIZE,
     FIELD(records_max_bytes),
     .def = 64 * MiB,
     .min = 0,
     .max = 1ull << 40,
     .reloadable = 1,
     .help = "records.file is rotated once it passes this size: FILE "
             "becomes FILE.1, FILE.1 FILE.2 and so on, up to records.keep; "
             "0: never rotated by the daemon."},
    {.name = "records.keep",
     .type = CONF_U32,
     FIELD(records_keep),
     .def = 4,
     .min = 1,
     .max = 100,
     .reloadable = 1,
     .help = "Rotated records files kept (FILE.1 the newest); the oldest "
             "is removed."},

    {.name = "metrics.listen",
     .type = CONF_STRING,
     FIELD(metrics_listen),
     .def_str = "",
     .check = check_metrics_listen,
     .help = "IP:PORT of the HTTP endpoint serving /metrics (Prometheus "
             "text) and /health, on a thread of its own; empty: off (the "
             "default). 127.0.0.1:9464 keeps it on this host; port 0 picks "
             "a free port (logged)."},
    {.name = "metrics.publish_ms",
     .type = CONF_MS,
     FIELD(metrics_publish_ms),
     .def = 1000,
     .min = 10,
     .max = 60000,
     .reloadable = 1,
     .help = "How often the loop publishes the snapshot the endpoint "
             "serves: a scrape sees figures at most this old."},
    {.name = "metrics.health_max_lag_ms",
     .type = CONF_MS,
     FIELD(metrics_health_max_lag_ms),
     .def = 2000,
     .min = 1,
     .max = 600000,
     .reloadable = 1,
     .help = "/health (and kvxferctl health) answers 503 (exit 1) when the "
             "loop lags more than this, or has not published a snapshot "
             "for metrics.publish_ms plus this; also while draining."},
};

const size_t conf_nkeys = sizeof(conf_keys) / sizeof(conf_keys[0]);
_Static_assert(sizeof(conf_keys) / sizeof(conf_keys[0]) <= CONF_MAX_KEYS,
               "conf_keys[] outgrew CONF_MAX_KEYS");

/* ---- validators ---- */

/* Names as useradd accepts them, or a numeric gid: nothing that could be
 * read as an option or a path. */
static int check_group(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *g = conf->socket_group;
    size_t len = strlen(g);

    if (!len)
        return 0;
    for (size_t i = 0; i < len; i++) {
        char ch = g[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                 (ch >= '0' && ch <= '9') || ch == '_' || ch == '.' ||
                 (ch == '-' && i > 0) || (ch == '$' && i == len - 1 && i);
        if (!ok) {
            char what[64];
            return why_fail(why, 1,
                            "\"%s\" is not a group name (expected "
                            "letters, digits, '_', '.', '-' or a number)",
                            conf_shown(g, len, what, sizeof(what)));
        }
    }
    return 0;
}

static int check_hello(const kvx_conf_t *conf, kvx_why_t *why)
{
    if (conf->hello_frame_bytes <= conf->max_frame_bytes)
        return 0;
    return why_fail(why, 1,
                    "%u is larger than limits.max_frame_bytes (expected "
                    "at most %u)",
                    conf->hello_frame_bytes, conf->max_frame_bytes);
}

static int check_listen(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *l = conf->peer_listen;
    if (!l[0])
        return 0;
    const char *colon = strrchr(l, ':');
    char *end;
    if (!colon || colon == l)
        return why_fail(why, 1, "'%s' is not IP:PORT", l);
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (!colon[1] || *end || port > 65535)
        return why_fail(why, 1, "'%s': port must be 0..65535", l);
    if (!strncmp(l, "0.0.0.0:", 8))
        return why_fail(
            why, 1, "'%s': give the IP other daemons reach, not 0.0.0.0", l);
    if (!conf->peer_secret_file[0])
        return why_fail(why, 1, "needs peer.secret_file (the cluster secret)");
    return 0;
}

/* IP:PORT, an IPv4 or IPv6 address ([::1]:9464 or ::1:9464). */
static int check_metrics_listen(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *l = conf->metrics_listen;
    if (!l[0])
        return 0;
    const char *colon = strrchr(l, ':');
    char ip[64], *end;
    if (!colon || colon == l || (size_t)(colon - l) >= sizeof(ip))
        return why_fail(why, 1, "'%s' is not IP:PORT", l);
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (!colon[1] || *end || port > 65535)
        return why_fail(why, 1, "'%s': port must be 0..65535", l);
    size_t n = (size_t)(colon - l);
    if (l[0] == '[' && n > 2 && l[n - 1] == ']')
        snprintf(ip, sizeof(ip), "%.*s", (int)(n - 2), l + 1);
    else
        snprintf(ip, sizeof(ip), "%.*s", (int)n, l);
    uint8_t a[16];
    if (inet_pton(AF_INET, ip, a) != 1 && inet_pton(AF_INET6, ip, a) != 1)
        return why_fail(why, 1, "'%s': '%s' is not an IP address", l, ip);
    return 0;
}

/* An absolute path, or a credential's name: no '/', not "." or "..". */
static int check_secret_file(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *f = conf->peer_secret_file;
    if (!f[0] || f[0] == '/')
        return 0;
    if (strchr(f, '/') || !strcmp(f, ".") || !strcmp(f, ".."))
        return why_fail(why, 1,
                        "'%s' is neither an absolute path nor a credential "
                        "name (a name without '/')",
                        f);
    return 0;
}

static int check_ucx_ports(const kvx_conf_t *conf, kvx_why_t *why)
{
    const char *p = conf->peer_ucx_ports;
    unsigned lo, hi;
    int used = 0;
    if (!p[0])
        return 0;
    if (sscanf(p, "%u-%u%n", &lo, &hi, &used) != 2 || p[used] || !lo ||
        lo > hi || hi > 65535) {
        return why_fail(why, 1, "'%s' is not LO-HI with 1 <= LO <= HI <= 65535",
                        p);
    }
    return 0;
}

int conf_net_parse(const char *tok, int *family, uint8_t addr[16],
                   unsigned *bits)
{
    char t[64];
    while (*tok == ' ')
        tok++;
    if (strlen(tok) >= sizeof(t))
        return KVX_ERR_INVALID;
    strcpy(t, tok);
    char *slash = strchr(t, '/'), *end = NULL;
    long b = -1;
    if (slash) {
        *slash = 0;
        b = strtol(slash + 1, &end, 10);
    }
    int v4 = inet_pton(AF_INET, t, addr) == 1,
        v6 = !v4 && inet_pton(AF_INET6, t, addr) == 1;
    long max = v4 ? 32 : 128;
    if ((!v4 && !v6) || (slash && (!slash[1] || *end || b < 0 || b > max)))
        return KVX_ERR_INVALID;
    *family = v4 ? AF_INET : AF_INET6;
    *bits = slash ? (unsigned)b : (unsigned)max;
    return 0;
}

static int check_allowed(const kvx_conf_t *conf, kvx_why_t *why)
{
    char buf[sizeof(conf->peer_allowed)], *save = NULL;
    snprintf(buf, sizeof(buf), "%s", conf->peer_allowed);
    for (char *t = strtok_r(buf, ",", &save); t;
         t = strtok_r(NULL, ",", &save)) {
        int fam;
        uint8_t a[16];
        unsigned bits;
        if (conf_net_parse(t, &fam, a, &bits)) {
            while (*t == ' ')
                t++;
            return why_fail(why, 1, "'%.64s' is not an IP or IP/BITS", t);
        }
    }
    return 0;
}

static int check_slots(const kvx_conf_t *conf, kvx_why_t *why)
{
    if (conf->slots == 1) { /* one slot cannot overlap anything */
        return why_fail(why, 1,
                        "1: give 0 (as many as fit in 32 MiB) or 2..1024");
    }
    return 0;
}

static int check_keepalive(const kvx_conf_t *conf, kvx_why_t *why)
{
    if (conf->keepalive_interval_ms >= conf->keepalive_timeout_ms)
        return why_fail(
            why, 1, "%u ms is not below peer.keepalive_timeout_ms (%u)",
            conf->keepalive_interval_ms, conf->keepalive_timeout_ms);
    return 0;
}
