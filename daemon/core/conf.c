/*
 * conf — kvxferd configuration: one declarative table of keys (keys[]) and
 * everything generated from it: the defaults, the YAML loader and its
 * checks, reload, the markdown reference and the key/value listing.
 *
 * Owns: the key table and the parsing of config files. Must never depend on
 * another daemon module (no log.h) or touch daemon state: problems go to
 * the FILE * the caller passes, conf_load() fills a kvx_conf_t the caller
 * owns, and the caller decides what to apply.
 *
 * Adding a key is one line in keys[] and one field in kvx_conf_t; there is
 * no per-key code apart from an optional validator for rules the type and
 * bounds cannot express.
 */
#include "conf.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <yaml.h>

#include "kvxfer.h"

#define KiB (1024ull)
#define MiB (1024ull * KiB)
#define GiB (1024ull * MiB)

/* Config files are a few KiB; the cap stops a wrong --config (a log, a core
 * dump) from being read whole and fed to the parser. */
#define CONF_MAX_FILE_BYTES (1u << 20)

/* Sections of keys of lists: 3 levels; the rest is room for mistakes to
 * be reported as such rather than as nesting. */
#define CONF_MAX_DEPTH 16

/* How much of a user's value, and of a line, is echoed in a message. */
#define CONF_SHOW_MAX 40
#define CONF_SHOW_LINE_MAX 256

enum conf_type {
    CONF_STRING, /* char[] field; length bound by the field size */
    CONF_PATH,   /* CONF_STRING that must be an absolute path */
    CONF_MODE,   /* permission bits, octal as chmod reads them */
    CONF_U32,    /* plain decimal integer */
    CONF_SIZE,   /* bytes, optionally with a KiB/MiB/GiB suffix */
    CONF_MS,     /* duration, decimal integer milliseconds */
    CONF_IDS,    /* list of uint32 ids: uint32_t[] field + unsigned count */
    CONF_LEVEL,  /* log level name, stored as a syslog priority (int) */
};

static const char *const type_names[] = {
    [CONF_STRING] = "string",    [CONF_PATH] = "path",
    [CONF_MODE] = "octal mode",  [CONF_U32] = "integer",
    [CONF_SIZE] = "size",        [CONF_MS] = "duration (ms)",
    [CONF_IDS] = "list of ids",  [CONF_LEVEL] = "log level",
};

struct conf_key {
    const char *name;      /* "section.key" */
    enum conf_type type;
    size_t off;            /* offsetof(kvx_conf_t, field) */
    size_t size;           /* sizeof field (4 or 8 for numbers) */
    size_t count_off;      /* CONF_IDS: offsetof the entry count */
    uint64_t def;          /* numeric default */
    const char *def_str;   /* CONF_STRING/CONF_PATH default */
    uint64_t min, max;     /* numeric bounds; CONF_IDS: bounds per id */
    int reloadable;        /* applied on SIGHUP without a restart */
    /* Rules beyond type and bounds, checked once the whole file is read.
     * Returns 0, or 1 with the problem written to why. */
    int (*check)(const kvx_conf_t *conf, char *why, size_t n);
    const char *help;      /* one line, no '|' (it lands in a table) */
};

static int check_group(const kvx_conf_t *conf, char *why, size_t n);
static int check_hello(const kvx_conf_t *conf, char *why, size_t n);
static int check_listen(const kvx_conf_t *conf, char *why, size_t n);
static int check_keepalive(const kvx_conf_t *conf, char *why, size_t n);
static int check_slots(const kvx_conf_t *conf, char *why, size_t n);
static int check_ucx_ports(const kvx_conf_t *conf, char *why, size_t n);
static int check_allowed(const kvx_conf_t *conf, char *why, size_t n);

#define FIELD(f) .off = offsetof(kvx_conf_t, f), .size = sizeof(((kvx_conf_t *)0)->f)
#define IDS(f, nf) FIELD(f), .count_off = offsetof(kvx_conf_t, nf)

static const struct conf_key keys[] = {
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
     .help = "Peer uids allowed to connect, besides the daemon's own uid "
             "and root, which always are."},
    {.name = "auth.allowed_gids",
     .type = CONF_IDS,
     IDS(allowed_gids, num_allowed_gids),
     .min = 0,
     .max = UINT32_MAX - 1,
     .help = "Peer gids allowed to connect: a peer whose gid is listed is "
             "let in."},
    {.name = "auth.admin_gids",
     .type = CONF_IDS,
     IDS(admin_gids, num_admin_gids),
     .min = 0,
     .max = UINT32_MAX - 1,
     .help = "Groups whose members see every user's sessions, pools, "
             "instances and requests in status and request lists, as root "
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
     .help = "GPU staging buffer per device with pools, kept for GPU-memory "
             "slots between daemons (with a CUDA-aware UCX; not used yet); "
             "allocated once, on the first pool; 0: none. The host staging "
             "is the peer slots."},

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
     .help = "File holding the cluster secret (16 to 4096 bytes, readable "
             "by the owner only) that daemons prove to each other; "
             "required with peer.listen."},
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
             "fit in 32 MiB, at least 2 (8 of 4 MiB, 2 of 16 MiB)."},
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
             "connection to use them."},
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

    {.name = "deadlines.offer_lease_ms",
     .type = CONF_MS,
     FIELD(offer_lease_ms),
     .def = 30000,
     .min = 1,
     .max = 86400000,
     .reloadable = 1,
     .help = "How long published KV stays held for a fetch before it is "
             "released and the request fails with KVX_ERR_TIMED_OUT."},
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
};

#define NKEYS (sizeof(keys) / sizeof(keys[0]))

static const struct {
    int level;
    const char *name;
} levels[] = {
    {LOG_ERR, "error"},   {LOG_WARNING, "warning"}, {LOG_NOTICE, "notice"},
    {LOG_INFO, "info"},   {LOG_DEBUG, "debug"},
};

int conf_log_level_parse(const char *name)
{
    if (!name)
        return -1;
    for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++)
        if (!strcmp(name, levels[i].name))
            return levels[i].level;
    return -1;
}

const char *conf_log_level_name(int level)
{
    for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++)
        if (levels[i].level == level)
            return levels[i].name;
    return "unknown";
}

/* ---- field access, generic over the table ---- */

static uint64_t num_get(const kvx_conf_t *c, const struct conf_key *k)
{
    const char *p = (const char *)c + k->off;
    if (k->size == sizeof(uint64_t)) {
        uint64_t v;
        memcpy(&v, p, sizeof(v));
        return v;
    }
    uint32_t v; /* uint32_t, unsigned and a non-negative int share bits */
    memcpy(&v, p, sizeof(v));
    return v;
}

static void num_set(kvx_conf_t *c, const struct conf_key *k, uint64_t v)
{
    char *p = (char *)c + k->off;
    if (k->size == sizeof(uint64_t)) {
        memcpy(p, &v, sizeof(v));
    } else {
        uint32_t v32 = (uint32_t)v;
        memcpy(p, &v32, sizeof(v32));
    }
}

static const char *str_get(const kvx_conf_t *c, const struct conf_key *k)
{
    return (const char *)c + k->off;
}

/* Zero the whole buffer so that equal strings compare equal with memcmp. */
static void str_set(kvx_conf_t *c, const struct conf_key *k, const char *s,
                    size_t len)
{
    char *p = (char *)c + k->off;
    memset(p, 0, k->size);
    memcpy(p, s, len < k->size ? len : k->size - 1);
}

static unsigned ids_cap(const struct conf_key *k)
{
    return (unsigned)(k->size / sizeof(uint32_t));
}

static unsigned ids_count(const kvx_conf_t *c, const struct conf_key *k)
{
    unsigned n;
    memcpy(&n, (const char *)c + k->count_off, sizeof(n));
    return n < ids_cap(k) ? n : ids_cap(k);
}

static uint32_t *ids(kvx_conf_t *c, const struct conf_key *k)
{
    return (uint32_t *)(void *)((char *)c + k->off);
}

static const uint32_t *ids_const(const kvx_conf_t *c,
                                 const struct conf_key *k)
{
    return (const uint32_t *)(const void *)((const char *)c + k->off);
}

static void ids_set_count(kvx_conf_t *c, const struct conf_key *k,
                          unsigned n)
{
    memcpy((char *)c + k->count_off, &n, sizeof(n));
}

static int key_equal(const kvx_conf_t *a, const kvx_conf_t *b,
                     const struct conf_key *k)
{
    switch (k->type) {
    case CONF_STRING:
    case CONF_PATH:
        return !strcmp(str_get(a, k), str_get(b, k));
    case CONF_IDS: {
        unsigned n = ids_count(a, k);
        return n == ids_count(b, k) &&
               !memcmp(ids_const(a, k), ids_const(b, k),
                       n * sizeof(uint32_t));
    }
    default:
        return num_get(a, k) == num_get(b, k);
    }
}

static void key_copy(kvx_conf_t *dst, const kvx_conf_t *src,
                     const struct conf_key *k)
{
    memcpy((char *)dst + k->off, (const char *)src + k->off, k->size);
    if (k->type == CONF_IDS)
        memcpy((char *)dst + k->count_off, (const char *)src + k->count_off,
               sizeof(unsigned));
}

/* ---- values as text: the same forms the loader accepts ---- */

static void fmt_num(const struct conf_key *k, uint64_t v, char *buf,
                    size_t n)
{
    unsigned long long u = (unsigned long long)v;
    if (k->type == CONF_MODE)
        snprintf(buf, n, "%04llo", u);
    else if (k->type == CONF_SIZE && u && u % GiB == 0)
        snprintf(buf, n, "%lluGiB", u / GiB);
    else if (k->type == CONF_SIZE && u && u % MiB == 0)
        snprintf(buf, n, "%lluMiB", u / MiB);
    else if (k->type == CONF_SIZE && u && u % KiB == 0)
        snprintf(buf, n, "%lluKiB", u / KiB);
    else
        snprintf(buf, n, "%llu", u);
}

static void fmt_value(const kvx_conf_t *c, const struct conf_key *k,
                      char *buf, size_t n)
{
    size_t len = 0;

    switch (k->type) {
    case CONF_STRING:
    case CONF_PATH:
        snprintf(buf, n, "%s", str_get(c, k));
        break;
    case CONF_LEVEL:
        snprintf(buf, n, "%s", conf_log_level_name((int)num_get(c, k)));
        break;
    case CONF_IDS:
        len = (size_t)snprintf(buf, n, "[");
        for (unsigned i = 0; i < ids_count(c, k) && len < n; i++)
            len += (size_t)snprintf(buf + len, n - len, "%s%u",
                                    i ? ", " : "", ids_const(c, k)[i]);
        if (len < n)
            snprintf(buf + len, n - len, "]");
        break;
    default:
        fmt_num(k, num_get(c, k), buf, n);
        break;
    }
}

/* The accepted range, short, for the reference table. */
static void fmt_range(const struct conf_key *k, char *buf, size_t n)
{
    char lo[32], hi[32];

    switch (k->type) {
    case CONF_STRING:
        snprintf(buf, n, "at most %zu characters", k->size - 1);
        return;
    case CONF_PATH:
        snprintf(buf, n, "absolute, at most %zu characters", k->size - 1);
        return;
    case CONF_IDS:
        snprintf(buf, n, "at most %u ids, each %llu..%llu", ids_cap(k),
                 (unsigned long long)k->min, (unsigned long long)k->max);
        return;
    case CONF_LEVEL: {
        size_t len = 0;
        buf[0] = '\0';
        for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]) && len < n;
             i++)
            len += (size_t)snprintf(buf + len, n - len, "%s%s",
                                    i ? ", " : "", levels[i].name);
        return;
    }
    default:
        fmt_num(k, k->min, lo, sizeof(lo));
        fmt_num(k, k->max, hi, sizeof(hi));
        snprintf(buf, n, "%s..%s", lo, hi);
        return;
    }
}

/* What a value should look like, for "(expected ...)". */
static void fmt_expected(const struct conf_key *k, char *buf, size_t n)
{
    char range[128];

    fmt_range(k, range, sizeof(range));
    switch (k->type) {
    case CONF_STRING:
        snprintf(buf, n, "a string of %s", range);
        break;
    case CONF_PATH:
        snprintf(buf, n, "an absolute path of at most %zu characters",
                 k->size - 1);
        break;
    case CONF_MODE:
        snprintf(buf, n, "an octal mode %s", range);
        break;
    case CONF_U32:
        snprintf(buf, n, "an integer %s", range);
        break;
    case CONF_SIZE:
        snprintf(buf, n, "a size %s, in bytes or with a KiB, MiB or GiB "
                         "suffix", range);
        break;
    case CONF_MS:
        snprintf(buf, n, "milliseconds %s", range);
        break;
    case CONF_IDS:
        snprintf(buf, n, "a list of at most %u ids, each %llu..%llu",
                 ids_cap(k), (unsigned long long)k->min,
                 (unsigned long long)k->max);
        break;
    case CONF_LEVEL:
        snprintf(buf, n, "one of %s", range);
        break;
    }
}

/* ---- table lookups ---- */

static size_t section_len(const char *name)
{
    const char *dot = strchr(name, '.');
    return dot ? (size_t)(dot - name) : strlen(name);
}

static int section_is(const struct conf_key *k, const char *sec, size_t len)
{
    return section_len(k->name) == len && !strncmp(k->name, sec, len);
}

/* Index of the first key of section sec, or -1. */
static int section_find(const char *sec)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (section_is(&keys[i], sec, strlen(sec)))
            return (int)i;
    return -1;
}

/* Index of key name in the section starting at keys[sec], or -1. */
static int key_find(int sec, const char *name)
{
    size_t len = section_len(keys[sec].name);
    for (size_t i = (size_t)sec;
         i < NKEYS && section_is(&keys[i], keys[sec].name, len); i++)
        if (!strcmp(keys[i].name + len + 1, name))
            return (int)i;
    return -1;
}

/* "socket, auth, ..." or, given a section, "path, mode, group". */
static void list_names(int sec, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < NKEYS && len < n; i++) {
        const char *name = keys[i].name;
        size_t sl = section_len(name);
        if (sec < 0) {
            if (i && section_is(&keys[i - 1], name, sl))
                continue;
            len += (size_t)snprintf(buf + len, n - len, "%s%.*s",
                                    len ? ", " : "", (int)sl, name);
        } else if (section_is(&keys[sec], name, sl)) {
            len += (size_t)snprintf(buf + len, n - len, "%s%s",
                                    len ? ", " : "", name + sl + 1);
        }
    }
}

/* ---- validators ---- */

/* A user's text made safe to print and short enough to read. */
static const char *shown(const char *s, size_t len, char *buf, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < len && o + 4 < n && i < CONF_SHOW_MAX; i++) {
        unsigned char ch = (unsigned char)s[i];
        buf[o++] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
    }
    if (len > CONF_SHOW_MAX && o + 4 <= n) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}


/* Names as useradd accepts them, or a numeric gid: nothing that could be
 * read as an option or a path. */
static int check_group(const kvx_conf_t *conf, char *why, size_t n)
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
            snprintf(why, n, "\"%s\" is not a group name (expected "
                             "letters, digits, '_', '.', '-' or a number)",
                     shown(g, len, what, sizeof(what)));
            return 1;
        }
    }
    return 0;
}

static int check_hello(const kvx_conf_t *conf, char *why, size_t n)
{
    if (conf->hello_frame_bytes <= conf->max_frame_bytes)
        return 0;
    snprintf(why, n, "%u is larger than limits.max_frame_bytes (expected "
                     "at most %u)", conf->hello_frame_bytes,
             conf->max_frame_bytes);
    return 1;
}

static int check_listen(const kvx_conf_t *conf, char *why, size_t n)
{
    const char *l = conf->peer_listen;
    if (!l[0])
        return 0;
    const char *colon = strrchr(l, ':');
    char *end;
    if (!colon || colon == l) {
        snprintf(why, n, "'%s' is not IP:PORT", l);
        return 1;
    }
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (!colon[1] || *end || port > 65535) {
        snprintf(why, n, "'%s': port must be 0..65535", l);
        return 1;
    }
    if (!strncmp(l, "0.0.0.0:", 8)) {
        snprintf(why, n, "'%s': give the IP other daemons reach, not 0.0.0.0",
                 l);
        return 1;
    }
    if (!conf->peer_secret_file[0]) {
        snprintf(why, n, "needs peer.secret_file (the cluster secret)");
        return 1;
    }
    return 0;
}

static int check_ucx_ports(const kvx_conf_t *conf, char *why, size_t n)
{
    const char *p = conf->peer_ucx_ports;
    unsigned lo, hi;
    int used = 0;
    if (!p[0])
        return 0;
    if (sscanf(p, "%u-%u%n", &lo, &hi, &used) != 2 || p[used] || !lo ||
        lo > hi || hi > 65535) {
        snprintf(why, n, "'%s' is not LO-HI with 1 <= LO <= HI <= 65535", p);
        return 1;
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

static int check_allowed(const kvx_conf_t *conf, char *why, size_t n)
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
            snprintf(why, n, "'%.64s' is not an IP or IP/BITS", t);
            return 1;
        }
    }
    return 0;
}

static int check_slots(const kvx_conf_t *conf, char *why, size_t n)
{
    if (conf->slots == 1) { /* one slot cannot overlap anything */
        snprintf(why, n, "1: give 0 (as many as fit in 32 MiB) or 2..1024");
        return 1;
    }
    return 0;
}

static int check_keepalive(const kvx_conf_t *conf, char *why, size_t n)
{
    if (conf->keepalive_interval_ms >= conf->keepalive_timeout_ms) {
        snprintf(why, n, "%u ms is not below peer.keepalive_timeout_ms (%u)",
                 conf->keepalive_interval_ms, conf->keepalive_timeout_ms);
        return 1;
    }
    return 0;
}

/* ---- defaults, reload, listings ---- */

void conf_defaults(kvx_conf_t *conf)
{
    memset(conf, 0, sizeof(*conf));
    for (size_t i = 0; i < NKEYS; i++) {
        const struct conf_key *k = &keys[i];
        switch (k->type) {
        case CONF_STRING:
        case CONF_PATH:
            str_set(conf, k, k->def_str, strlen(k->def_str));
            break;
        case CONF_IDS:
            ids_set_count(conf, k, 0);
            break;
        default:
            num_set(conf, k, k->def);
            break;
        }
    }
}

int conf_apply_reloadable(kvx_conf_t *cur, const kvx_conf_t *next,
                          FILE *log_out)
{
    int changed = 0;

    for (size_t i = 0; i < NKEYS; i++) {
        const struct conf_key *k = &keys[i];
        if (key_equal(cur, next, k))
            continue;
        if (k->reloadable) {
            key_copy(cur, next, k);
            changed++;
        } else if (log_out) {
            fprintf(log_out,
                    "%s: changed in file, needs a restart to take effect\n",
                    k->name);
        }
    }
    return changed;
}

void conf_print_markdown(FILE *out)
{
    kvx_conf_t def;
    char val[1024], range[128];

    conf_defaults(&def);
    fprintf(out, "| key | type | default | range | reloadable | "
                 "description |\n");
    fprintf(out, "|-----|------|---------|-------|------------|"
                 "-------------|\n");
    for (size_t i = 0; i < NKEYS; i++) {
        const struct conf_key *k = &keys[i];
        fmt_value(&def, k, val, sizeof(val));
        fmt_range(k, range, sizeof(range));
        fprintf(out, "| `%s` | %s | `%s` | %s | %s | %s |\n", k->name,
                type_names[k->type], val[0] ? val : "\"\"", range,
                k->reloadable ? "yes" : "no", k->help);
    }
}

int conf_foreach(const kvx_conf_t *conf,
                 void (*fn)(const char *key, const char *value, void *arg),
                 void *arg)
{
    char val[1024];

    for (size_t i = 0; fn && i < NKEYS; i++) {
        fmt_value(conf, &keys[i], val, sizeof(val));
        fn(keys[i].name, val, arg);
    }
    return (int)NKEYS;
}

/* ---- the loader ---- */

struct loader {
    const char *path;
    const char *text; /* the whole file, for quoting lines */
    size_t len;
    FILE *err;
    int problems;
    yaml_document_t *doc;
    kvx_conf_t conf;
    size_t section_line[NKEYS]; /* by first key index; 0 = not seen */
    size_t key_line[NKEYS];     /* 0 = not in the file */
    yaml_mark_t value_mark[NKEYS];
    int bad[NKEYS];             /* the value was refused */
};

enum { PARSE_OK, PARSE_BAD, PARSE_RANGE };

/* Length of the line break at p (as libyaml counts them), or 0. */
static size_t line_break(const unsigned char *p, size_t left)
{
    if (p[0] == '\n')
        return 1;
    if (p[0] == '\r')
        return left > 1 && p[1] == '\n' ? 2 : 1;
    if (left > 1 && p[0] == 0xc2 && p[1] == 0x85)
        return 2;
    if (left > 2 && p[0] == 0xe2 && p[1] == 0x80 &&
        (p[2] == 0xa8 || p[2] == 0xa9))
        return 3;
    return 0;
}

static void show_line(const struct loader *ld, const yaml_mark_t *m)
{
    const unsigned char *t = (const unsigned char *)ld->text;
    size_t i = 0, line = 0, start, end, col = 0;

    while (line < m->line && i < ld->len) {
        size_t b = line_break(t + i, ld->len - i);
        i += b ? b : 1;
        line += b != 0;
    }
    if (line != m->line || i >= ld->len)
        return;
    start = end = i;
    while (end < ld->len && end - start < CONF_SHOW_LINE_MAX &&
           !line_break(t + end, ld->len - end))
        end++;
    for (i = start; i < end; i++)
        fputc(t[i] == '\t' || (t[i] >= 0x20 && t[i] != 0x7f) ? t[i] : '?',
              ld->err);
    fputs(end < ld->len && !line_break(t + end, ld->len - end) ? "...\n"
                                                               : "\n",
          ld->err);
    /* libyaml counts columns in characters: skip UTF-8 continuations. */
    for (i = start; i < end && col < m->column; i++) {
        if ((t[i] & 0xc0) == 0x80)
            continue;
        fputc(t[i] == '\t' ? '\t' : ' ', ld->err);
        col++;
    }
    if (col == m->column)
        fputs("^\n", ld->err);
}

/* One problem: "FILE:LINE:COL: key: what (expected ...)", then the line. */
__attribute__((format(printf, 4, 5))) static void
report(struct loader *ld, const yaml_mark_t *m, const char *key,
       const char *fmt, ...)
{
    va_list ap;

    ld->problems++;
    if (!ld->err)
        return;
    if (m)
        fprintf(ld->err, "%s:%zu:%zu: %s: ", ld->path, m->line + 1,
                m->column + 1, key);
    else
        fprintf(ld->err, "%s: %s: ", ld->path, key);
    va_start(ap, fmt);
    vfprintf(ld->err, fmt, ap);
    va_end(ap);
    fputc('\n', ld->err);
    if (m)
        show_line(ld, m);
}

static const char *node_kind(const yaml_node_t *n)
{
    switch (n->type) {
    case YAML_MAPPING_NODE:
        return "a mapping";
    case YAML_SEQUENCE_NODE:
        return "a sequence";
    default:
        return "a scalar";
    }
}

/* YAML 1.1's null forms, written plain: "key:" with nothing after it. */
static int node_is_null(const yaml_node_t *n)
{
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL"};
    if (n->type != YAML_SCALAR_NODE ||
        n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return 0;
    for (size_t i = 0; i < sizeof(nulls) / sizeof(nulls[0]); i++)
        if (n->data.scalar.length == strlen(nulls[i]) &&
            !memcmp(n->data.scalar.value, nulls[i], n->data.scalar.length))
            return 1;
    return 0;
}

static const char *scalar(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

/* Decimal digits only: YAML's 0x, +, 1_000 and 1e3 forms are refused so
 * that a value means the same to a reader and to the daemon. */
static int parse_digits(const char **s, uint64_t *out)
{
    const char *p = *s;
    uint64_t v = 0;
    int over = 0;

    if (*p < '0' || *p > '9')
        return PARSE_BAD;
    for (; *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10)
            over = 1;
        else
            v = v * 10 + d;
    }
    *s = p;
    *out = v;
    return over ? PARSE_RANGE : PARSE_OK;
}

static int parse_number(const struct conf_key *k, const char *s,
                        uint64_t *out)
{
    static const struct {
        const char *suffix;
        uint64_t mult;
    } units[] = {{"", 1}, {"KiB", KiB}, {"MiB", MiB}, {"GiB", GiB}};
    const char *p = s;
    uint64_t v = 0;
    int rc;

    switch (k->type) {
    case CONF_LEVEL: {
        int level = conf_log_level_parse(s);
        if (level < 0)
            return PARSE_BAD;
        *out = (uint64_t)level;
        return PARSE_OK;
    }
    case CONF_MODE:
        /* As chmod reads it: 0660, 660 and YAML 1.2's 0o660 are equal. */
        if (p[0] == '0' && p[1] == 'o')
            p += 2;
        if (*p < '0' || *p > '7')
            return PARSE_BAD;
        for (; *p >= '0' && *p <= '7'; p++)
            if (v <= 07777777)
                v = v * 8 + (uint64_t)(*p - '0');
        if (*p)
            return PARSE_BAD;
        break;
    default:
        if (*p == '-') { /* a well-formed negative number: say why */
            if (p[1] == '-') /* one sign only (and no recursion) */
                return PARSE_BAD;
            return parse_number(k, p + 1, &v) == PARSE_BAD ? PARSE_BAD
                                                           : PARSE_RANGE;
        }
        rc = parse_digits(&p, &v);
        if (rc == PARSE_BAD)
            return rc;
        if (k->type == CONF_SIZE) {
            size_t u;
            if (*p == ' ')
                p++;
            for (u = 0; u < sizeof(units) / sizeof(units[0]); u++)
                if (!strcmp(p, units[u].suffix))
                    break;
            if (u == sizeof(units) / sizeof(units[0]) || (p[-1] == ' ' && !*p))
                return PARSE_BAD;
            if (rc == PARSE_OK && v > UINT64_MAX / units[u].mult)
                rc = PARSE_RANGE;
            v *= units[u].mult;
        } else if (*p) {
            return PARSE_BAD;
        }
        if (rc != PARSE_OK)
            return rc;
        break;
    }
    if (v < k->min || v > k->max)
        return PARSE_RANGE;
    *out = v;
    return PARSE_OK;
}

static void load_ids(struct loader *ld, int ki, const yaml_node_t *vn)
{
    const struct conf_key *k = &keys[ki];
    /* Each entry reads as an integer with the list's bounds. */
    const struct conf_key id = {.type = CONF_U32, .min = k->min,
                                .max = k->max};
    char expected[256], what[64], name[96];
    unsigned n = 0;

    fmt_expected(k, expected, sizeof(expected));
    for (yaml_node_item_t *it = vn->data.sequence.items.start;
         it < vn->data.sequence.items.top; it++, n++) {
        const yaml_node_t *in = yaml_document_get_node(ld->doc, *it);
        uint64_t v = 0;
        int rc = PARSE_BAD;

        if (!in)
            continue;
        snprintf(name, sizeof(name), "%s[%u]", k->name, n);
        if (n >= ids_cap(k)) {
            report(ld, &in->start_mark, name,
                   "too many entries (expected %s)", expected);
            ld->bad[ki] = 1;
            return;
        }
        if (in->type != YAML_SCALAR_NODE) {
            report(ld, &in->start_mark, name, "got %s (expected %s)",
                   node_kind(in), expected);
            ld->bad[ki] = 1;
            continue;
        }
        if (strlen(scalar(in)) == in->data.scalar.length)
            rc = parse_number(&id, scalar(in), &v);
        if (rc != PARSE_OK) {
            shown(scalar(in), in->data.scalar.length, what, sizeof(what));
            if (rc == PARSE_RANGE)
                report(ld, &in->start_mark, name,
                       "%s is out of range (expected %s)", what, expected);
            else
                report(ld, &in->start_mark, name,
                       "invalid value \"%s\" (expected %s)", what, expected);
            ld->bad[ki] = 1;
            continue;
        }
        ids(&ld->conf, k)[n] = (uint32_t)v;
    }
    ids_set_count(&ld->conf, k, n);
}

static void load_value(struct loader *ld, int ki, const yaml_node_t *vn)
{
    const struct conf_key *k = &keys[ki];
    char expected[256], what[64];
    const char *s;
    size_t len;
    uint64_t v = 0;
    int rc;

    fmt_expected(k, expected, sizeof(expected));
    if (k->type == CONF_IDS && vn->type == YAML_SEQUENCE_NODE) {
        load_ids(ld, ki, vn);
        return;
    }
    ld->bad[ki] = 1; /* until proven otherwise */
    if (vn->type != YAML_SCALAR_NODE || k->type == CONF_IDS) {
        report(ld, &vn->start_mark, k->name, "got %s (expected %s)",
               node_is_null(vn) ? "no value" : node_kind(vn), expected);
        return;
    }
    if (node_is_null(vn)) {
        report(ld, &vn->start_mark, k->name, "no value (expected %s)",
               expected);
        return;
    }
    s = scalar(vn);
    len = vn->data.scalar.length;
    shown(s, len, what, sizeof(what));
    if (strlen(s) != len) {
        report(ld, &vn->start_mark, k->name,
               "value contains a NUL character (expected %s)", expected);
        return;
    }
    if (k->type == CONF_STRING || k->type == CONF_PATH) {
        if (len >= k->size) {
            report(ld, &vn->start_mark, k->name,
                   "value is too long, %zu characters (expected %s)", len,
                   expected);
            return;
        }
        if (k->type == CONF_PATH && s[0] != '/') {
            report(ld, &vn->start_mark, k->name,
                   "\"%s\" is not an absolute path (expected %s)", what,
                   expected);
            return;
        }
        str_set(&ld->conf, k, s, len);
        ld->bad[ki] = 0;
        return;
    }
    rc = parse_number(k, s, &v);
    if (rc == PARSE_RANGE) {
        report(ld, &vn->start_mark, k->name,
               "%s is out of range (expected %s)", what, expected);
        return;
    }
    if (rc != PARSE_OK) {
        report(ld, &vn->start_mark, k->name,
               "invalid value \"%s\" (expected %s)", what, expected);
        return;
    }
    num_set(&ld->conf, k, v);
    ld->bad[ki] = 0;
}

static void load_section(struct loader *ld, int sec, const yaml_node_t *sn)
{
    size_t sl = section_len(keys[sec].name);
    char sname[32], names[256], what[64], full[128];

    snprintf(sname, sizeof(sname), "%.*s", (int)sl, keys[sec].name);
    list_names(sec, names, sizeof(names));
    if (node_is_null(sn)) /* every key commented out: all defaults */
        return;
    if (sn->type != YAML_MAPPING_NODE) {
        report(ld, &sn->start_mark, sname,
               "got %s (expected a mapping with keys %s)", node_kind(sn),
               names);
        return;
    }
    for (yaml_node_pair_t *p = sn->data.mapping.pairs.start;
         p < sn->data.mapping.pairs.top; p++) {
        const yaml_node_t *kn = yaml_document_get_node(ld->doc, p->key);
        const yaml_node_t *vn = yaml_document_get_node(ld->doc, p->value);
        int ki;

        if (!kn || !vn)
            continue;
        if (kn->type != YAML_SCALAR_NODE) {
            report(ld, &kn->start_mark, sname,
                   "got %s as a key (expected one of %s)", node_kind(kn),
                   names);
            continue;
        }
        ki = strlen(scalar(kn)) == kn->data.scalar.length
                 ? key_find(sec, scalar(kn))
                 : -1;
        if (ki < 0) {
            snprintf(full, sizeof(full), "%s.%s", sname,
                     shown(scalar(kn), kn->data.scalar.length, what,
                           sizeof(what)));
            report(ld, &kn->start_mark, full,
                   "unknown key (expected one of %s)", names);
            continue;
        }
        if (ld->key_line[ki]) {
            report(ld, &kn->start_mark, keys[ki].name,
                   "duplicate key (expected it once; first at line %zu)",
                   ld->key_line[ki]);
            continue;
        }
        ld->key_line[ki] = kn->start_mark.line + 1;
        ld->value_mark[ki] = vn->start_mark;
        load_value(ld, ki, vn);
    }
}

static void load_root(struct loader *ld, const yaml_node_t *root)
{
    char sections[128], what[64];

    list_names(-1, sections, sizeof(sections));
    if (node_is_null(root)) /* a document of comments: all defaults */
        return;
    if (root->type != YAML_MAPPING_NODE) {
        report(ld, &root->start_mark, "(top level)",
               "got %s (expected a mapping with sections %s)",
               node_kind(root), sections);
        return;
    }
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start;
         p < root->data.mapping.pairs.top; p++) {
        const yaml_node_t *kn = yaml_document_get_node(ld->doc, p->key);
        const yaml_node_t *vn = yaml_document_get_node(ld->doc, p->value);
        int sec;

        if (!kn || !vn)
            continue;
        if (kn->type != YAML_SCALAR_NODE) {
            report(ld, &kn->start_mark, "(top level)",
                   "got %s as a section name (expected one of %s)",
                   node_kind(kn), sections);
            continue;
        }
        shown(scalar(kn), kn->data.scalar.length, what, sizeof(what));
        sec = strlen(scalar(kn)) == kn->data.scalar.length &&
                      !strchr(scalar(kn), '.')
                  ? section_find(scalar(kn))
                  : -1;
        if (sec < 0) {
            report(ld, &kn->start_mark, what,
                   "unknown section (expected one of %s)", sections);
            continue;
        }
        if (ld->section_line[sec]) {
            report(ld, &kn->start_mark, what,
                   "duplicate section (expected it once; first at line %zu)",
                   ld->section_line[sec]);
            continue;
        }
        ld->section_line[sec] = kn->start_mark.line + 1;
        load_section(ld, sec, vn);
    }
}

/* libyaml's reader reports a byte offset, not a line and column. */
static yaml_mark_t mark_at(const struct loader *ld, size_t offset)
{
    const unsigned char *t = (const unsigned char *)ld->text;
    yaml_mark_t m = {0, 0, 0};

    for (size_t i = 0; i < offset && i < ld->len;) {
        size_t b = line_break(t + i, ld->len - i);
        if (b) {
            m.line++;
            m.column = 0;
            i += b;
        } else {
            m.column += (t[i] & 0xc0) != 0x80;
            i++;
        }
    }
    m.index = offset;
    return m;
}

static void report_yaml(struct loader *ld, const yaml_parser_t *parser)
{
    const char *problem = parser->problem ? parser->problem : "syntax error";
    yaml_mark_t m;

    switch (parser->error) {
    case YAML_MEMORY_ERROR:
        report(ld, NULL, "yaml", "out of memory (expected to be able to "
                                 "read the file)");
        break;
    case YAML_READER_ERROR:
        m = mark_at(ld, parser->problem_offset);
        if (parser->problem_value != -1)
            report(ld, &m, "yaml", "%s: #%X (expected UTF-8 text)", problem,
                   (unsigned)parser->problem_value);
        else
            report(ld, &m, "yaml", "%s (expected UTF-8 text)", problem);
        break;
    default:
        if (parser->context)
            report(ld, &parser->problem_mark, "yaml",
                   "%s %s at line %zu column %zu (expected valid YAML)",
                   problem, parser->context, parser->context_mark.line + 1,
                   parser->context_mark.column + 1);
        else
            report(ld, &parser->problem_mark, "yaml",
                   "%s (expected valid YAML)", problem);
        break;
    }
}

/*
 * libyaml has no nesting limit and its scanner slows down quadratically
 * with depth, so a file of brackets would take minutes to load. A config
 * needs three levels; this first pass, on events, stops at CONF_MAX_DEPTH
 * before anything is built. Syntax errors are left to the loading pass,
 * which reports them the same way.
 */
static int depth_ok(struct loader *ld)
{
    yaml_parser_t parser;
    yaml_event_t event;
    int depth = 0, ok = 1;

    if (!yaml_parser_initialize(&parser))
        return 1; /* the loading pass reports it */
    yaml_parser_set_input_string(&parser, (const unsigned char *)ld->text,
                                 ld->len);
    while (yaml_parser_parse(&parser, &event)) {
        yaml_event_type_t type = event.type;
        if (type == YAML_SEQUENCE_START_EVENT ||
            type == YAML_MAPPING_START_EVENT) {
            if (++depth > CONF_MAX_DEPTH) {
                report(ld, &event.start_mark, "yaml",
                       "nested deeper than %d levels (expected sections of "
                       "keys)", CONF_MAX_DEPTH);
                ok = 0;
            }
        } else if (type == YAML_SEQUENCE_END_EVENT ||
                   type == YAML_MAPPING_END_EVENT) {
            depth--;
        }
        yaml_event_delete(&event);
        if (!ok || type == YAML_STREAM_END_EVENT)
            break;
    }
    yaml_parser_delete(&parser);
    return ok;
}

/* 0, 1 when too large (reported), KVX_ERR_IO when unreadable or
 * KVX_ERR_NOMEM (reported). */
static int read_file(const char *path, char **text, size_t *len, FILE *err)
{
    FILE *f;
    char *buf;
    size_t n;
    int rc;

    f = fopen(path, "rb");
    if (!f) {
        if (err)
            fprintf(err, "%s: cannot open: %s\n", path, strerror(errno));
        return KVX_ERR_IO;
    }
    buf = malloc(CONF_MAX_FILE_BYTES + 1);
    if (!buf) {
        if (err)
            fprintf(err, "%s: cannot read: %s\n", path, strerror(ENOMEM));
        rc = KVX_ERR_NOMEM;
        goto err_close;
    }
    n = fread(buf, 1, CONF_MAX_FILE_BYTES + 1, f);
    if (ferror(f)) {
        if (err)
            fprintf(err, "%s: cannot read: %s\n", path, strerror(errno));
        rc = KVX_ERR_IO;
        goto err_free;
    }
    fclose(f);
    if (n > CONF_MAX_FILE_BYTES) {
        if (err)
            fprintf(err, "%s: file is larger than %u bytes (expected a "
                         "config file)\n", path, CONF_MAX_FILE_BYTES);
        free(buf);
        return 1;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return 0;

err_free:
    free(buf);
err_close:
    fclose(f);
    return rc;
}

int conf_load(const char *path, kvx_conf_t *conf, FILE *err)
{
    struct loader *ld;
    yaml_parser_t parser;
    yaml_document_t doc;
    char *text = NULL, why[256];
    size_t len = 0;
    int rc, problems;

    if (!path || !conf)
        return KVX_ERR_INVALID;
    rc = read_file(path, &text, &len, err);
    if (rc)
        return rc;
    ld = calloc(1, sizeof(*ld));
    if (!ld) {
        if (err)
            fprintf(err, "%s: cannot load: %s\n", path, strerror(ENOMEM));
        rc = KVX_ERR_NOMEM;
        goto err_free_text;
    }
    ld->path = path;
    ld->text = text;
    ld->len = len;
    ld->err = err;
    ld->doc = &doc;
    conf_defaults(&ld->conf);

    if (!depth_ok(ld))
        goto out;
    if (!yaml_parser_initialize(&parser)) {
        report(ld, NULL, "yaml", "out of memory (expected to be able to "
                                 "read the file)");
        goto out;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    for (int ndoc = 0;; ndoc++) {
        const yaml_node_t *root;
        /* On failure libyaml has already freed the document. */
        if (!yaml_parser_load(&parser, &doc)) {
            report_yaml(ld, &parser);
            break;
        }
        root = yaml_document_get_root_node(&doc);
        if (root && ndoc == 0)
            load_root(ld, root);
        else if (root)
            report(ld, &root->start_mark, "(top level)",
                   "a second YAML document (expected one document)");
        yaml_document_delete(&doc);
        if (!root || ndoc > 0)
            break;
    }
    yaml_parser_delete(&parser);

    /* Rules across keys, on the whole file; a refused value is not
     * checked again against its neighbours. */
    for (size_t i = 0; i < NKEYS; i++) {
        if (!keys[i].check || ld->bad[i] || keys[i].check(&ld->conf, why,
                                                         sizeof(why)) == 0)
            continue;
        report(ld, ld->key_line[i] ? &ld->value_mark[i] : NULL,
               keys[i].name, "%s", why);
    }

out:
    problems = ld->problems;
    if (!problems)
        memcpy(conf, &ld->conf, sizeof(*conf));
    free(ld);
    free(text);
    return problems;

err_free_text:
    free(text);
    return rc;
}
