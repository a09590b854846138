/*
 * kvxfer.h — client library for kvxferd, the per-node KV cache transfer
 * daemon.
 *
 * One engine rank opens one connection (kvx_connect) and uses it from one
 * thread at a time. Every call blocks until the daemon answers or its
 * timeout (milliseconds; negative = wait forever; 0 is refused with
 * KVX_ERR_INVALID, nothing sent; kvx_poll alone takes 0, as "do not wait
 * for events") passes, and returns a
 * kvx_status_t: 0 on success, a negative KVX_ERR_* code otherwise. The codes
 * are the daemon's own: a refused request returns exactly the code the
 * daemon saw, and kvx_last_error() gives its message, which names the field
 * at fault. The library never logs, never aborts and never raises signals
 * (it uses MSG_NOSIGNAL).
 *
 * Life of a request:
 *   context rank:    kvx_publish() -> context params (opaque bytes)
 *   router:          hands the params to the generation instance
 *   generation rank: kvx_fetch(params) -> the daemon fills its blocks
 *   every rank:      kvx_poll() returns sealed batches of terminal events;
 *                    batch k is identical on every rank of an instance.
 *
 * Requests are named by keys: opaque bytes, 1 to KVX_MAX_KEY, unique
 * among an instance's requests in flight (vLLM's request id string,
 * SGLang's bootstrap room). The calls taking a uint64_t request_id
 * (kvx_cancel, kvx_fetch_dp, ...) are the same calls with the key of its
 * decimal digits: request 42 is the key "42".
 *
 * 3.0: one call per verb. kvx_publish() and kvx_fetch() take a struct of
 * arguments whose first member, field_mask, says which members the
 * caller set (UCX's ucp_params_t style): a later release adds members and
 * bits without new symbols, and a program built against an older header
 * sets none of them. Keys, DP rank, block tables, fetch by key,
 * layer-wise offers and batches are members or flags of these; so are
 * the layers, tokens, table and event of a ready mark (kvx_ready) and
 * the table of a fetch's progress (kvx_progress). The 2.x variants
 * (kvx_publish_key, kvx_fetch_groups, kvx_fetch_many, kvx_tokens_ready,
 * kvx_group_fetch_progress, ...) stay for this release as thin wrappers,
 * marked deprecated.
 */
#ifndef KVXFER_H
#define KVXFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the API: libkvxfer.so is built with -fvisibility=hidden and a
 * version script (client/libkvxfer.map), so a function is visible to engines
 * only if declared here with KVX_EXPORT. Everything else the library
 * holds (the daemon's common code, the generated protobuf-c kvxfer__*
 * functions, the kvx__* calls of internal.h) stays inside, free to change
 * without breaking an engine; kvxfer's own tools reach the internal calls
 * by linking libkvxfer.a. */
#if defined(__GNUC__) && __GNUC__ >= 4
#define KVX_EXPORT __attribute__((visibility("default")))
#else
#define KVX_EXPORT
#endif

/* This header's release. kvx_version() says the library's, which may be
 * newer than the header a program was built with. */
#define KVX_VERSION_MAJOR 3
#define KVX_VERSION_MINOR 2
#define KVX_VERSION_STRING "3.2.0"
/* The protocol the library and the daemon speak (Hello's version): 3.0
 * changed the API, not the wire; 2.6 added per-offer leases and their
 * renewal (kvx_renew); 2.7 the records of finished requests
 * (ListRequests.done) and an admin's Cancel of any instance's request;
 * 2.8 the GPU pace an engine sets (GpuPace, kvx_gpu_pace). */
#define KVX_PROTOCOL_MAJOR 2
#define KVX_PROTOCOL_MINOR 8
/* The soname's number: libkvxfer.so.2. 3.0 keeps it, because every
 * program built against 2.x still runs: the two calls whose signature
 * changed keep their 2.x forms under their old version nodes
 * (kvx_publish@KVXFER_2.0, kvx_fetch@KVXFER_2.0), as glibc keeps
 * libc.so.6 (docs/operations.md, "Library versions"). */
#define KVX_ABI_MAJOR 2

/* Marks the 2.x calls that 3.0 replaced: a program that calls one gets
 * a compiler warning naming its replacement. They go in the next major
 * release. kvxfer's own tools and tests, built with -Werror, define
 * KVX_ALLOW_DEPRECATED to call them without the warning. */
#if defined(__GNUC__) && !defined(KVX_ALLOW_DEPRECATED)
#define KVX_DEPRECATED(use) __attribute__((deprecated("use " use)))
#else
#define KVX_DEPRECATED(use)
#endif
#define KVX_DEPRECATED_PUBLISH                                                 \
    KVX_DEPRECATED("kvx_publish (kvxfer.h 3.0: its args say the form)")
#define KVX_DEPRECATED_FETCH                                                   \
    KVX_DEPRECATED("kvx_fetch (kvxfer.h 3.0: its args say the form)")
#define KVX_DEPRECATED_READY KVX_DEPRECATED("kvx_ready (kvxfer.h 3.0)")
#define KVX_DEPRECATED_PROGRESS KVX_DEPRECATED("kvx_progress (kvxfer.h 3.0)")
#define KVX_DEPRECATED_RESERVE                                                 \
    KVX_DEPRECATED("kvx_reserve (kvxfer.h 3.0: its args say the form)")

/* The library's release, "3.2.0" (KVX_VERSION_STRING of the library that
 * was loaded, not of the header the program was built with). */
KVX_EXPORT const char *kvx_version(void);

/* Longest request key, in bytes. */
#define KVX_MAX_KEY 128u

#define KVX_DEFAULT_SOCKET "/run/kvxfer/kvxferd.sock"

/* One status type for the daemon, the protocol and the library. */
typedef enum {
    KVX_OK = 0,
    KVX_ERR_INVALID = -1,      /* a field or argument is invalid */
    KVX_ERR_NOMEM = -2,        /* out of memory */
    KVX_ERR_IO = -3,           /* socket or system call failed */
    KVX_ERR_TIMEOUT = -4,      /* the call's own timeout passed */
    KVX_ERR_PROTOCOL = -5,     /* malformed or oversized frame */
    KVX_ERR_VERSION = -6,      /* protocol major version differs */
    KVX_ERR_PERM = -7,         /* peer not allowed by uid/gid lists */
    KVX_ERR_NOT_FOUND = -8,    /* unknown request, pool or instance */
    KVX_ERR_EXISTS = -9,       /* already published/fetched/registered */
    KVX_ERR_STATE = -10,       /* not allowed in this state */
    KVX_ERR_AUTH = -11,        /* capability token does not match */
    KVX_ERR_CANCELLED = -12,   /* request was cancelled */
    KVX_ERR_TIMED_OUT = -13,   /* a daemon deadline (lease, fetch) expired */
    KVX_ERR_PEER_GONE = -14,   /* the other side disconnected */
    KVX_ERR_UNSUPPORTED = -15, /* not available in this build/config */
    KVX_ERR_LIMIT = -16,       /* a configured limit was reached */
    KVX_ERR_SHUTDOWN = -17,    /* the daemon is draining */
    KVX_ERR_LAYOUT = -18,      /* layout invalid or does not fit the pool */
    KVX_ERR_MISMATCH = -19,    /* the two sides' configurations differ */
    KVX_ERR_CLOSED = -20,      /* the connection is closed */
    KVX_ERR_BUSY = -21,        /* resource in use */
} kvx_status_t;

#define KVX_ERR_LAST KVX_ERR_BUSY

/* Static string naming the code, e.g. "capability token mismatch". */
KVX_EXPORT const char *kvx_status_str(int status);
/* Short identifier, e.g. "AUTH"; used in status counters and logs. */
KVX_EXPORT const char *kvx_status_name(int status);

typedef enum {
    KVX_ROLE_CONTEXT = 1,
    KVX_ROLE_GENERATION = 2,
    KVX_ROLE_BOTH = 3,
} kvx_role_t;

typedef enum {
    KVX_DTYPE_UNSPECIFIED = 0,
    KVX_DTYPE_FP32 = 1,
    KVX_DTYPE_FP16 = 2,
    KVX_DTYPE_BF16 = 3,
    KVX_DTYPE_FP8 = 4,
    KVX_DTYPE_INT8 = 5,
} kvx_dtype_t;

/* Returns 0 and sets *out for "fp32", "fp16", "bf16", "fp8", "int8". */
KVX_EXPORT int kvx_dtype_parse(const char *name, kvx_dtype_t *out);
KVX_EXPORT const char *kvx_dtype_name(kvx_dtype_t dtype);
KVX_EXPORT unsigned kvx_dtype_size(kvx_dtype_t dtype);

#define KVX_MAX_LAYERS 1024u
#define KVX_MAX_RANKS 1024u
/* Physical allocations one GPU pool may span (VMM memory mapped back to
 * back, as PyTorch's expandable segments do). */
#define KVX_MAX_POOL_CHUNKS 16384u

/* Which KV heads a TP rank holds (its pool holds those heads only):
 * with tp <= total_kv_heads (tp must divide it), TP rank t holds heads
 * [t * H/tp, (t + 1) * H/tp); with tp > total_kv_heads (total_kv_heads
 * must divide tp), heads are replicated and TP rank t holds the one head
 * t / (tp / total_kv_heads), as vLLM, SGLang and TensorRT-LLM place
 * them. A pool laid out under another convention moves the wrong heads:
 * the layout's num_heads must be the count above. Layers: PP rank p holds
 * layers_per_pp[p] consecutive layers, in order. */
typedef struct {
    uint32_t tp, pp, cp;
    uint32_t total_layers;   /* layers of the whole model */
    uint32_t total_kv_heads; /* KV heads of the whole model */
    /* Layers held by each PP rank; NULL/0 = even split, remainder to the
     * first ranks. */
    const uint32_t *layers_per_pp;
    uint32_t num_layers_per_pp;
    /* Generation side only: attention data parallelism. The tp ranks form
     * attention_dp groups of tp/attention_dp ranks; a request goes to one
     * group (kvx_fetch_dp), whose ranks split all KV heads. 0/1 = off. */
    uint32_t attention_dp;
} kvx_parallel_t;

/* Memory regions one pool may be made of (one per layer tensor, or per
 * K and V tensor: 2 x KVX_MAX_LAYERS). */
#define KVX_MAX_REGIONS 4096u

/* Where one (layer, kv) part of a layout lies: the pool's region that
 * holds it and the byte offset of its first element (block 0, token 0,
 * head 0) in that region. */
typedef struct {
    uint32_t region;   /* index into the pool's regions */
    uint32_t reserved; /* 0 */
    uint64_t offset;
} kvx_layout_part_t;

/*
 * Layout descriptor of one pool. A pool is a list of memory regions
 * (one allocation, or one tensor per layer, or separate K and V tensors
 * per layer); the layout says in which region, and where in it, each
 * element lies:
 *   offset(layer, kv, block, token, head, d) = part(layer, kv).offset
 *       + block*block_stride + token*token_stride + head*head_stride
 *       + d*elem_size                       in region part(layer, kv).region
 * where, with parts NULL (what the presets fill: one region),
 *   part(layer, kv) = {region 0, layer*layer_stride + kv*kv_stride}
 * and otherwise part(layer, kv) = parts[layer*kv_factor + kv], num_parts =
 * num_layers*kv_factor entries (layer_stride and kv_stride are then not
 * used). parts is the caller's: it must stay valid while the layout is
 * used (a call that takes a layout copies what it needs). Every region
 * of a pool must hold at least one part, and every byte a part can
 * address must lie inside its region.
 * num_layers / num_heads are this rank's (after PP / TP split).
 */
typedef struct {
    char preset[16];
    uint32_t num_layers, kv_factor, num_heads, head_dim, elem_size;
    kvx_dtype_t dtype;
    uint32_t tokens_per_block, num_blocks;
    uint64_t layer_stride, kv_stride, block_stride, token_stride, head_stride;
    const kvx_layout_part_t *parts; /* NULL: one region, strides above */
    uint32_t num_parts;
    /* Which of the model's KV heads the pool holds, said so the daemon
     * can check it: 0, not said (the rule above kvx_parallel_t is
     * assumed); else 1 + the model's index of the pool's first head. A
     * pool that says another first head than the rule gives its rank is
     * refused at publish and fetch (KVX_ERR_LAYOUT, naming both) rather
     * than moving the wrong heads. */
    uint32_t first_head;
} kvx_layout_t;

/*
 * Fill *out from a named preset: "trtllm", "vllm-nhd", "vllm-hnd",
 * "flashinfer", "sglang", "mla". The pool is one region; per-layer
 * presets place the layers one after another in it (layer_stride). Returns
 * KVX_ERR_INVALID for an unknown preset or zero dimensions; "sglang" needs
 * tokens_per_block 1, "mla" needs kv_factor 1 and num_heads 1.
 */
KVX_EXPORT int kvx_layout_preset(const char *preset, uint32_t num_layers,
                                 uint32_t kv_factor, uint32_t num_heads,
                                 uint32_t head_dim, kvx_dtype_t dtype,
                                 uint32_t tokens_per_block, uint32_t num_blocks,
                                 kvx_layout_t *out);
/*
 * Move the parts of a one-region layout into regions of their own, for
 * engines that keep one tensor per layer (regions_per_layer 1: region
 * `layer`, as vLLM) or a K and a V tensor per layer (2, kv_factor 2:
 * region layer*2 + kv, as SGLang). Each part keeps its shape and lands at
 * the same offset from its layer's (or its own) first byte; size each
 * region with kvx_layout_region_span(). Writes num_layers*kv_factor
 * entries to parts (num_parts of room) and points layout->parts at them.
 * KVX_ERR_INVALID: a layout already split, regions_per_layer not 1 or 2
 * (2 with kv_factor 1), or parts too small.
 */
KVX_EXPORT int kvx_layout_split(kvx_layout_t *layout,
                                uint32_t regions_per_layer,
                                kvx_layout_part_t *parts, uint32_t num_parts);
/* Regions the layout addresses: the highest part's region + 1 (1 with
 * parts NULL). */
KVX_EXPORT uint32_t kvx_layout_num_regions(const kvx_layout_t *layout);
/* Bytes the layout spans in region: the smallest region size that holds
 * every part in it (0 if none is, or on overflow). */
KVX_EXPORT uint64_t kvx_layout_region_span(const kvx_layout_t *layout,
                                           uint32_t region);
/* Bytes a one-region layout spans: the smallest pool size that holds it.
 * 0 for a layout over several regions (see kvx_layout_region_span). */
KVX_EXPORT uint64_t kvx_layout_span(const kvx_layout_t *layout);
/* Byte offset of one element in its region (kvx_layout_region says
 * which). */
KVX_EXPORT uint64_t kvx_layout_offset(const kvx_layout_t *layout,
                                      uint32_t layer, uint32_t kv,
                                      uint32_t block, uint32_t token,
                                      uint32_t head);
/* The region that holds part (layer, kv). */
KVX_EXPORT uint32_t kvx_layout_region(const kvx_layout_t *layout,
                                      uint32_t layer, uint32_t kv);

typedef struct kvx_client kvx_client_t;

typedef struct {
    const char *instance_id; /* unique in the cluster, <= 128 bytes */
    kvx_role_t role;
    uint32_t rank; /* pp*(tp*cp) + tp_rank*cp + cp_rank */
    kvx_parallel_t parallel;
    /* 0 = this library's protocol version (tests set others) */
    uint32_t version_major, version_minor;
} kvx_hello_t;

/* Connect to the daemon at socket_path (NULL = KVX_DEFAULT_SOCKET) and say
 * hello. On success *out is a new client; free it with kvx_close(). While
 * the daemon's listen backlog is full (its loop busy or stopped) the
 * connect is tried again until timeout_ms, then KVX_ERR_TIMEOUT. */
KVX_EXPORT int kvx_connect(const char *socket_path, const kvx_hello_t *hello,
                           int timeout_ms, kvx_client_t **out);
KVX_EXPORT void kvx_close(kvx_client_t *client);

/* The two halves of kvx_connect, for callers that want the daemon's
 * message when Hello is refused: connect without Hello (enough for
 * status and requests), then say it. */
KVX_EXPORT int kvx_connect_observer(const char *socket_path, int timeout_ms,
                                    kvx_client_t **out);
KVX_EXPORT int kvx_hello(kvx_client_t *client, const kvx_hello_t *hello,
                         int timeout_ms);

/* The daemon's message for the last failed call ("" if none). Valid until
 * the next call on this client. Errors of system calls name the errno
 * ("connect /run/kvxfer/kvxferd.sock: ENOENT (No such file or directory):
 * ..."). With client NULL: the message of the last kvx_connect() or
 * kvx_connect_observer() that failed on this thread (its client is gone),
 * e.g. a refused connection ("connection refused: the daemon has 1024
 * sessions open, its limits.max_sessions; closing"). */
KVX_EXPORT const char *kvx_last_error(const kvx_client_t *client);

/* How long each call looks for the daemon's reply before its thread
 * sleeps on the socket (2.4). Waking a sleeping thread costs tens of
 * microseconds (more on a VM), often more than the daemon takes to answer
 * a fetch or to deliver a small request's event; looking costs that
 * thread's CPU for at most spin_us per reply (yielding it at each look,
 * so that a daemon thread on the same CPU runs). Default: the
 * environment's KVXFER_SPIN_US, else 50; 0: never spin. At most
 * KVX_SPIN_US_MAX; more is KVX_ERR_INVALID. */
/* With a spin, a kvx_poll that waits for one event also asks the daemon
 * to wake it early (Poll.early) once a fetch of its instance has its
 * last copies out (on that daemon, to a copy thread or a GPU), and then
 * spins (up to 20 ms) for the event instead of sleeping through the end
 * of the transfer. */
#define KVX_SPIN_US_MAX 100000
KVX_EXPORT int kvx_set_spin_us(kvx_client_t *client, uint32_t spin_us);

/* This daemon's address, to share with the instance's other ranks (engines
 * allgather it at start-up) and pass to kvx_join(). */
KVX_EXPORT int kvx_daemon_address(const kvx_client_t *client, char *buf,
                                  size_t len);

/*
 * 2.5, a daemon that goes away (a restart, an upgrade, a crash): the
 * client outlives it.
 *
 * When the daemon closes the connection (EOF, EPIPE, ECONNRESET: its
 * process died or exited), every request of this client still in flight
 * (published, or fetched, by key or with params, and not yet ended by an
 * event this client's kvx_poll returned) ends with one terminal event:
 * kind KVX_EVENT_ERROR, code KVX_ERR_PEER_GONE, message "kvxferd went
 * away: ...". The library makes these events itself and returns them in
 * the next kvx_poll, as one batch (seq: the next number of this rank),
 * ordered by key (shorter keys first, then bytewise), so every rank of
 * an instance that had the same requests in flight gets the same batch.
 * A rank that had none in flight gets no such batch. A daemon killed
 * (kill -9, a crash) never writes a block after that: its copies died
 * with it, and the next daemon knows nothing of the requests.
 * What the library cannot know it cannot end: requests a rank never
 * named (another attention-DP group's fetches) end only on the ranks
 * that fetched them.
 *
 * Reconnection is on by default (off: kvx_set_reconnect, or the
 * environment's KVXFER_RECONNECT=0 at connect). The library has no
 * thread: it tries again inside the calls that find the daemon gone,
 * the first call at once; after an attempt that found no daemon (no
 * socket file, nobody listening: one connect()) the next may go 5 ms
 * later; after one a daemon refused (its Hello, a pool), backoff_min_ms
 * later, doubling up to backoff_max_ms. An attempt connects to the
 * same socket path, says the same Hello, joins with the same rank
 * addresses and consumers (each occurrence of this rank's old daemon address
 * replaced by the new daemon's: ranks on one daemon all move to its new
 * address; ranks on other daemons keep theirs, so when one of those restarts
 * too the engine must kvx_join again with the new list), and registers every
 * pool again from what it kept at registration: its layout and regions,
 * a dup of each memfd (kvx_pool_register_host*: the caller may close
 * its own), the library's own memfd (kvx_pool_create_host), the GPU
 * pool's CUDA IPC handle or its exported VMM fds (kept open, one per
 * allocation). Pool ids stay what the engine was given: the library maps
 * them to the new daemon's ids in every call that takes one (the
 * daemon's messages name its own ids). A pool kvx_pool_deregister()ed
 * while the daemon is gone is forgotten, and the call returns 0.
 *
 * While the daemon is gone every call but kvx_poll's delivery of the
 * events above fails at once with KVX_ERR_CLOSED, and kvx_last_error()
 * says "kvxferd went away: <cause>; reconnecting: ..." (the attempt that
 * failed and why, or when the next one goes) or, with reconnection off,
 * "... reconnection is off: the client is closed". An attempt takes at
 * most attempt_timeout_ms and never more than the call's own timeout; a
 * call that reconnects then goes on under what is left of its timeout.
 * Once reconnected, the next batch kvx_poll returns (the first the new
 * daemon sealed) carries one more event, last: kind
 * KVX_EVENT_RECONNECTED, no key, message "kvxferd is back: ...".
 * Batch numbers (seq) go on from the last one: the new daemon's first
 * batch is this rank's next.
 *
 * A call that timed out, or a reply the library cannot decode, still
 * leaves the connection unusable (KVX_CLIENT_CLOSED): the daemon may
 * still run and hold this client's requests; close the client and
 * connect again. So does a daemon that closes the connection saying why
 * (an idle session, limits.max_sessions): the call returns its code and
 * message. kvx_client_state() looks at the socket without reading: a
 * daemon that hung up shows at once, before a call finds it.
 */
typedef enum {
    KVX_CLIENT_CONNECTED = 1,    /* connected to a daemon */
    KVX_CLIENT_RECONNECTING = 2, /* the daemon went away; calls reconnect */
    KVX_CLIENT_CLOSED = 3,       /* unusable for good: kvx_close() it */
} kvx_client_status_t;

typedef struct {
    uint32_t size; /* in: sizeof(kvx_client_state_t) */
    kvx_client_status_t status;
    uint32_t incarnation;     /* reconnections so far (0: the first
                                 daemon) */
    uint32_t attempts;        /* failed attempts since the loss */
    uint32_t in_flight;       /* requests the library tracks */
    uint32_t next_attempt_ms; /* RECONNECTING: the next attempt may go
                                 this many ms from now (0: at once) */
    char message[512];        /* not CONNECTED: why ("kvxferd went
                                 away: ..."); else "" */
} kvx_client_state_t;

/* The client's state into *out (out->size: at least
 * sizeof(kvx_client_state_t) of 2.5). Sends nothing, changes nothing. */
KVX_EXPORT int kvx_client_state(const kvx_client_t *client,
                                kvx_client_state_t *out);

typedef struct {
    uint32_t size;               /* sizeof(kvx_reconnect_t) */
    int enabled;                 /* 0: a lost connection leaves the
                                    client KVX_CLIENT_CLOSED */
    uint32_t backoff_min_ms;     /* 0: 50 */
    uint32_t backoff_max_ms;     /* 0: 1000 */
    uint32_t attempt_timeout_ms; /* 0: 2000 */
} kvx_reconnect_t;

/* How this client reconnects (see above). KVX_ERR_INVALID: size smaller
 * than the 2.5 struct, or backoff_min_ms over backoff_max_ms. */
KVX_EXPORT int kvx_set_reconnect(kvx_client_t *client,
                                 const kvx_reconnect_t *opts);

/* Tell the daemon where every rank of this instance is served. Every local
 * rank must join with the same list before publish/fetch are accepted. */
KVX_EXPORT int kvx_join(kvx_client_t *client, const char *const *rank_addresses,
                        uint32_t num_ranks, int timeout_ms);

/* kvx_join for a context instance that says which generation instances
 * may fetch or release its requests by key (kvx_fetch_by_key):
 * consumers[0..n), each "INSTANCE" (that instance of this instance's
 * uid) or "UID:INSTANCE" (that instance of uid UID), on any daemon of the
 * cluster; or NULL/0 for the default, every instance of this instance's
 * uid. A name alone never lets another uid in. Every local rank passes
 * the same list (else KVX_ERR_MISMATCH). Fetches with params need no such
 * leave: the params' token is the right. */
KVX_EXPORT int kvx_join_consumers(kvx_client_t *client,
                                  const char *const *rank_addresses,
                                  uint32_t num_ranks,
                                  const char *const *consumers,
                                  uint32_t num_consumers, int timeout_ms);

/* Create a host-memory pool of layout->... (memfd, shared with the daemon)
 * and register it as one region. *base is this process's mapping;
 * *pool_id names it. */
KVX_EXPORT int kvx_pool_create_host(kvx_client_t *client,
                                    const kvx_layout_t *layout, uint64_t size,
                                    void **base, uint32_t *pool_id,
                                    int timeout_ms);
/* Register bytes [offset, offset + size) of a memfd the caller made as a
 * pool of one region (host memory the engine already has: an offload
 * buffer, one pool of several in one file). The memfd must be sealed
 * against shrinking (F_SEAL_SHRINK); offset need not be page-aligned. The
 * caller keeps fd and its own mapping; the daemon maps only the pool's
 * pages. */
KVX_EXPORT int kvx_pool_register_host(kvx_client_t *client,
                                      const kvx_layout_t *layout, int fd,
                                      uint64_t offset, uint64_t size,
                                      uint32_t *pool_id, int timeout_ms);
/* Register GPU memory [dev_ptr, dev_ptr + size) of the calling process as
 * a pool of one region. dev_ptr may point inside a larger allocation
 * (e.g. PyTorch's caching allocator): the library finds the allocation
 * and shares it with the daemon, by a legacy cudaIpcMemHandle (cudaMalloc
 * memory) or a POSIX fd (cuMemCreate/VMM memory, which must be created
 * exportable as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). VMM memory may
 * span several physical allocations mapped back to back (PyTorch's
 * expandable_segments), up to KVX_MAX_POOL_CHUNKS: each is exported and
 * the daemon maps them back to back again. Uses the process's CUDA
 * driver through dlopen; KVX_ERR_UNSUPPORTED when there is none or the
 * daemon was built without CUDA. */
KVX_EXPORT int kvx_pool_register_gpu(kvx_client_t *client,
                                     const kvx_layout_t *layout, void *dev_ptr,
                                     uint64_t size, uint32_t *pool_id,
                                     int timeout_ms);

/* One region of a host pool: bytes [offset, offset + size) of memfd fd
 * (sealed against shrinking). Several regions may lie in one memfd (the
 * library shares it once) but must not overlap. */
typedef struct {
    int fd;
    uint64_t offset, size;
} kvx_host_region_t;

/* One region of a GPU pool: device memory [dev_ptr, dev_ptr + size) of
 * the calling process, e.g. one layer's tensor. Regions inside one
 * allocation (the caching allocator's segments) share it once, and must
 * not overlap. */
typedef struct {
    void *dev_ptr;
    uint64_t size;
} kvx_gpu_region_t;

/* Register a pool made of regions[0, num_regions) (1..KVX_MAX_REGIONS;
 * layout's parts name them by index): host memfd ranges, or GPU memory
 * on one device, as kvx_pool_register_host / kvx_pool_register_gpu
 * describe for one. Refused: a region of 0 bytes or past its memfd or
 * allocation (KVX_ERR_INVALID), regions that overlap (KVX_ERR_INVALID),
 * more than KVX_MAX_REGIONS (KVX_ERR_LIMIT), GPU regions on two devices
 * (KVX_ERR_UNSUPPORTED), a region that holds no part of the layout or a
 * part that runs past its region (KVX_ERR_LAYOUT); the message names the
 * region, or the layer and kv of the part. */
KVX_EXPORT int kvx_pool_register_host_regions(kvx_client_t *client,
                                              const kvx_layout_t *layout,
                                              const kvx_host_region_t *regions,
                                              uint32_t num_regions,
                                              uint32_t *pool_id,
                                              int timeout_ms);
KVX_EXPORT int kvx_pool_register_gpu_regions(kvx_client_t *client,
                                             const kvx_layout_t *layout,
                                             const kvx_gpu_region_t *regions,
                                             uint32_t num_regions,
                                             uint32_t *pool_id, int timeout_ms);
/* Deregister (and unmap, for pools created by kvx_pool_create_host). */
KVX_EXPORT int kvx_pool_deregister(kvx_client_t *client, uint32_t pool_id,
                                   int timeout_ms);

typedef struct {
    uint8_t *data;
    size_t len;
} kvx_context_params_t;

KVX_EXPORT void kvx_context_params_free(kvx_context_params_t *params);

/* What a context params blob says, for a router or a generation rank that
 * must size its blocks before fetching. A generation rank with
 * tokens_per_block T passes ceil(num_tokens / T) blocks to kvx_fetch
 * (whatever skip_tokens). */
typedef struct {
    char instance_id[129];    /* the context instance */
    uint8_t key[KVX_MAX_KEY]; /* the context side's request key */
    uint32_t key_len;
    uint64_t request_id; /* key's uint64_t form; 0 when it is none */
    uint32_t num_tokens;
    uint32_t tokens_per_block; /* the context side's */
    uint32_t context_ranks;    /* tp * pp * cp of the context instance */
    uint32_t num_layers;       /* of the model */
    uint32_t num_kv_heads;     /* of the model */
    char rank0_address[192];   /* the daemon of context rank 0 */
} kvx_params_info_t;

/* Decode params into *info. KVX_OK, or KVX_ERR_INVALID (not params of
 * this version: kvx_last_error(NULL) says why). */
KVX_EXPORT int kvx_params_info(const void *params, size_t params_len,
                               kvx_params_info_t *info);

/* Offer the KV of request key (key_len bytes) in blocks[0..num_blocks)
 * of pool_id. Every context rank publishes its own blocks under the same
 * key and num_tokens. On success *params (free with
 * kvx_context_params_free) is identical on every rank.
 *
 * aux (aux_len bytes, at most the daemon's limits.aux_bytes, 64 KiB by
 * default; NULL/0: none) is an opaque payload (SGLang's first output
 * token and logprobs) delivered with the KV: the generation side's
 * COMPLETE event of the request carries it (kvx_event_t.aux), on every
 * generation rank. Any context rank may pass it; the request keeps the
 * first non-empty one, and another rank's must be the same bytes or
 * empty (else KVX_ERR_MISMATCH). The event carries the aux that had
 * reached the offer when the generation side's transfer completed: a
 * fetch that needs only some context ranks (replicated KV heads, MLA)
 * may complete before the others publish, so pass the same aux on every
 * rank (or at least on each rank that publishes before its data is
 * needed). With context ranks on several daemons, each daemon holds what
 * its ranks published, and the event carries the first non-empty aux a
 * source daemon sent. Error, cancel and timeout events, and the context
 * side's events, carry none. aux_len over limits.aux_bytes:
 * KVX_ERR_LIMIT naming it, and nothing is kept.
 *
 * Errors name the field: KVX_ERR_INVALID (an empty or over-long key,
 * blocks that cannot hold num_tokens, aux NULL with aux_len > 0),
 * KVX_ERR_EXISTS (this rank published key already), KVX_ERR_MISMATCH
 * (num_tokens, the layout or the aux differ from another rank's),
 * KVX_ERR_LIMIT (aux over limits.aux_bytes, or over the daemon's memory
 * budget). */
KVX_EXPORT KVX_DEPRECATED_PUBLISH int
kvx_publish_key(kvx_client_t *client, const void *key, size_t key_len,
                uint32_t pool_id, const uint32_t *blocks, uint32_t num_blocks,
                uint32_t num_tokens, const void *aux, size_t aux_len,
                kvx_context_params_t *params, int timeout_ms);
/* 2.1, layer-wise offers: kvx_publish_key, but before the KV exists.
 * The offer (and its params) is made at once, so a fetch may start and
 * wait; no layer of this rank's part is read until kvx_layers_ready names
 * it. A generation rank's copies of a layer start as soon as the context
 * ranks it reads from have it ready, lowest layer first, so the transfer
 * runs behind the prefill's forward pass and what is left after its last
 * layer is about one layer's copy. Every rank of the instance may publish
 * layer-wise or whole; the offer's lease and the fetch's timeout bound
 * the wait for layers. Between daemons a rank's part moves once all its
 * layers are ready. Errors as kvx_publish_key's. */
KVX_EXPORT KVX_DEPRECATED_PUBLISH int
kvx_publish_layerwise(kvx_client_t *client, const void *key, size_t key_len,
                      uint32_t pool_id, const uint32_t *blocks,
                      uint32_t num_blocks, uint32_t num_tokens, const void *aux,
                      size_t aux_len, kvx_context_params_t *params,
                      int timeout_ms);

/* Layers [first, first + count) of this rank's pool hold request key's
 * KV (layer numbers of the pool's layout: this rank's layers). Host
 * pools: call it once the KV is written. GPU pools, without blocking
 * the engine: record an event (cudaEventCreateWithFlags with
 * cudaEventInterprocess | cudaEventDisableTiming, on the pool's device)
 * on the stream after the work that writes those layers, and pass its
 * cudaIpcGetEventHandle bytes (64) as cuda_event: the daemon watches it
 * (polling it on a thread of its own, never waiting on it on the GPU)
 * and copies those layers once the record is reached. Use an event per
 * layer (or a ring deeper than the layers in flight): one recorded again
 * before the daemon saw the earlier record makes the earlier layers wait
 * for the later one. NULL: ready now. A layer named twice stays ready (a new
 * event replaces the old). A mark after the offer's transfer finished
 * (consumed, complete or released) answers 0: short prompts and
 * replicated heads reach it in normal use. Errors: KVX_ERR_NOT_FOUND (no
 * such offer: never published, or ended with an error),
 * KVX_ERR_CANCELLED (cancelled), KVX_ERR_STATE (not published
 * layer-wise by this rank, or ending), KVX_ERR_INVALID (layers outside
 * the pool's, an event for a host pool or one CUDA cannot open). */
KVX_EXPORT KVX_DEPRECATED_READY int
kvx_layers_ready(kvx_client_t *client, const void *key, size_t key_len,
                 uint32_t first, uint32_t count, const void *cuda_event,
                 int timeout_ms);

/* A chunked prefill on a layer-wise offer: kvx_layers_ready for the
 * tokens [0, tokens) of those layers only (tokens 0: all of them). A
 * layer-wise publish may give only the blocks of the first chunk;
 * kvx_append_blocks adds the next ones, in token order (pool_id: the
 * pool it was published from), before their tokens are said ready. A
 * fetch copies a layer's tokens as they become ready and waits for the
 * rest under its deadline; num_tokens (the whole prompt) is fixed at the
 * publish. Errors: KVX_ERR_INVALID (tokens beyond num_tokens or beyond
 * the blocks given; more blocks than num_tokens needs; a block given
 * twice), else kvx_layers_ready's. */
KVX_EXPORT KVX_DEPRECATED_READY int
kvx_tokens_ready(kvx_client_t *client, const void *key, size_t key_len,
                 uint32_t first, uint32_t count, uint32_t tokens,
                 const void *cuda_event, int timeout_ms);
KVX_EXPORT int kvx_append_blocks(kvx_client_t *client, const void *key,
                                 size_t key_len, uint32_t pool_id,
                                 const uint32_t *blocks, uint32_t num_blocks,
                                 int timeout_ms);

/* How far this generation rank's fetch of key has come: layers
 * [0, *layers_done) of its pool (*num_layers in all) have landed, so
 * attention on them may start while later layers arrive (vLLM's
 * wait_for_layer_load); with several block tables, the plain table's
 * layers (the others are covered by the event). *ended (may be NULL):
 * the fetch has ended and its event is coming. Between daemons layers_done
 * stays 0 until the fetch completes. KVX_ERR_NOT_FOUND: no such fetch in
 * flight. */
KVX_EXPORT KVX_DEPRECATED_PROGRESS int
kvx_fetch_progress(kvx_client_t *client, const void *key, size_t key_len,
                   uint32_t *layers_done, uint32_t *num_layers, int *ended,
                   int timeout_ms);
/* kvx_fetch_progress of one block table of a fetch with groups
 * (kvx_fetch_groups): group 0 the plain table, k + 1 groups[k]; its
 * layers, in its own pool's numbering. KVX_ERR_INVALID: no such table;
 * KVX_ERR_VERSION: the daemon is older than 2.3. */
KVX_EXPORT KVX_DEPRECATED_PROGRESS int
kvx_group_fetch_progress(kvx_client_t *client, const void *key, size_t key_len,
                         uint32_t group, uint32_t *layers_done,
                         uint32_t *num_layers, int *ended, int timeout_ms);

/* kvx_reserve, the scheduler's reservation of an offer: see the 3.0
 * section below (its 2.x form, kvx_reserve(client, instance_id, key,
 * key_len, num_tokens, params, timeout_ms), stays as
 * kvx_reserve@KVXFER_2.0 and under KVX_API_2X). */
/* 2.2, several block tables (hybrid models): one more block table of
 * a request, in a pool of its own layout (registered as any pool):
 *   - a KV group: layers of another shape or kept otherwise, such as
 *     sliding-window layers, whose table may start at first_block (the
 *     blocks before the window are not offered, and a fetch must skip
 *     their tokens);
 *   - a state slot (Mamba's convolution or SSM state, any fixed-size
 *     per-request buffer): a pool of one-token blocks (tokens_per_block
 *     1), num_tokens 1, and the slot as the one block; its "heads" are
 *     the units TP splits it by, head_dim * elem_size bytes each.
 * The pool's layers and heads are this rank's share; they split over TP
 * and PP evenly, as the KV's do, and the plan moves each group between
 * any TP/PP layout as it moves the KV. The request still has one lease,
 * one fence and one terminal event. */
typedef struct kvx_group {
    uint32_t pool_id;
    const uint32_t *blocks;
    uint32_t num_blocks;
    uint32_t num_tokens;  /* publish: the group's tokens (a state slot: 1) */
    uint32_t first_block; /* blocks[0] holds the group's block first_block */
    uint32_t skip_tokens; /* fetch: the group's tokens not moved */
} kvx_group_t;
#define KVX_MAX_GROUPS 8 /* block tables of a request, the first included */

/* kvx_reserve for a request with ngroups more block tables (2.4; see
 * kvx_publish_groups): each group names a pool of its layout that a rank
 * of the instance registered on this daemon (pool_id), its num_tokens
 * and first_block, and no blocks; the ranks then publish the same groups
 * (else MISMATCH, "... that the reservation made"). pool_id: the plain
 * table's pool, needed when the instance's pools differ in layout (a
 * hybrid model's always do); 0: the one layout they share. A daemon
 * before 2.4 ignores the groups: VERSION. */
KVX_EXPORT KVX_DEPRECATED_RESERVE int
kvx_reserve_groups(kvx_client_t *client, const char *instance_id,
                   const void *key, size_t key_len, uint32_t num_tokens,
                   uint32_t pool_id, const kvx_group_t *groups,
                   uint32_t ngroups, kvx_context_params_t *params,
                   int timeout_ms);

/* kvx_publish_key with ngroups more block tables (every context rank
 * gives the same groups, in the same order); layerwise: as
 * kvx_publish_layerwise, every table's layers made ready on their own
 * (kvx_group_tokens_ready).
 * The params carry each group's layout summary. Errors as
 * kvx_publish_key's, naming "groups[k]": KVX_ERR_INVALID (num_tokens 0,
 * blocks that cannot hold them), KVX_ERR_MISMATCH (another rank's groups
 * differ), KVX_ERR_LAYOUT (a pool that does not hold this rank's share),
 * KVX_ERR_LIMIT (more than KVX_MAX_GROUPS - 1), KVX_ERR_VERSION (a 2.1
 * daemon). */
KVX_EXPORT KVX_DEPRECATED_PUBLISH int
kvx_publish_groups(kvx_client_t *client, const void *key, size_t key_len,
                   uint32_t pool_id, const uint32_t *blocks,
                   uint32_t num_blocks, uint32_t num_tokens,
                   const kvx_group_t *groups, uint32_t ngroups, const void *aux,
                   size_t aux_len, int layerwise, kvx_context_params_t *params,
                   int timeout_ms);
/* A layer-wise offer with groups (kvx_publish_groups with layerwise): the
 * layers [first, first + count) of this rank's pool of table group (0:
 * the plain table, k + 1: groups[k]) hold tokens [0, tokens) of it (0:
 * all), as kvx_tokens_ready says of the plain table; each table's layers
 * are made ready on their own. A chunked prefill appends blocks to the
 * plain table only: the other tables give all their blocks at the
 * publish. KVX_ERR_INVALID: no such table. */
KVX_EXPORT KVX_DEPRECATED_READY int
kvx_group_tokens_ready(kvx_client_t *client, const void *key, size_t key_len,
                       uint32_t group, uint32_t first, uint32_t count,
                       uint32_t tokens, const void *cuda_event, int timeout_ms);

/* ---- 3.0: kvx_publish and kvx_fetch -------------------------------------
 *
 * Each takes a struct of arguments. field_mask, its first member, says
 * which members the caller set (bits KVX_PUBLISH_FIELD_* /
 * KVX_FETCH_FIELD_*); the library reads only those, so a later release
 * may add members (and bits) at the end without a new symbol, and a
 * member not in the mask takes its default. A bit this library does not
 * know is KVX_ERR_INVALID naming it ("kvx_publish: field_mask bit 0x400
 * is unknown to libkvxfer 3.2.0"), never ignored: a program built
 * against a newer header learns that an older library cannot do what it
 * asked. A required member missing is KVX_ERR_INVALID naming the field.
 *
 * Outcome: the call returns 0 or a kvx_status_t, and kvx_last_error()
 * gives the message. With KVX_*_FIELD_OUTCOME, *outcome also receives
 * the code and the message (its own copy, valid after later calls): the
 * way a batch item tells its own error.
 *
 * Batches (KVX_*_FIELD_ITEMS): items[0, num_items) are requests of any
 * form (with aux, layer-wise, with block tables, by key, each with its
 * own field_mask), at most KVX_MANY_MAX, sent in one write and answered
 * in one round trip (an engine's step schedules a batch of them): n
 * items cost one wake-up of each side instead of n. The daemon takes
 * them in order and answers each on its own, so each item gets its own
 * code and message in its outcome (and a publish its own params). An
 * item sets neither ITEMS nor TIMEOUT: the batch's timeout is the call's.
 * The call returns 0 when every item succeeded, else the code of the
 * first that failed, and kvx_last_error() names it ("kvx_fetch: item 3
 * (key ...): ..."); items after a refused one are still taken. An item
 * invalid before anything is sent (a NULL key, an unknown bit) fails the
 * call with nothing sent, its outcome saying why. When the exchange
 * itself fails (connection lost, timeout) its code is returned and the
 * items' outcomes say it too: which items the daemon took is unknown, as
 * after a single call that times out. */

/* The message room of an outcome (kvx_last_error()'s is as long). */
#define KVX_MESSAGE_MAX 512

/* One request's result. */
typedef struct {
    int code; /* 0 or a kvx_status_t */
    /* 1: code is the daemon's answer to this request; 0: the request
     * was refused before it was sent, or its answer was lost with the
     * connection (the daemon may hold it: see KVX_ERR_TIMEOUT) */
    int answered;
    char message[KVX_MESSAGE_MAX]; /* the message naming the field at
                                      fault; "" when code is 0 */
} kvx_outcome_t;

/* A call's timeout when its field_mask lacks KVX_*_FIELD_TIMEOUT. */
#define KVX_TIMEOUT_DEFAULT_MS 5000

/* kvx_publish_args_t.field_mask bits */
/* Required: KEY, BLOCKS (pool_id, blocks, num_blocks), NUM_TOKENS,
 * PARAMS; each bit names its members. */
#define KVX_PUBLISH_FIELD_KEY (1ull << 0)
#define KVX_PUBLISH_FIELD_BLOCKS (1ull << 1)
#define KVX_PUBLISH_FIELD_NUM_TOKENS (1ull << 2)
#define KVX_PUBLISH_FIELD_PARAMS (1ull << 3)
#define KVX_PUBLISH_FIELD_AUX (1ull << 4)
#define KVX_PUBLISH_FIELD_GROUPS (1ull << 5) /* groups, num_groups */
#define KVX_PUBLISH_FIELD_FLAGS (1ull << 6)
#define KVX_PUBLISH_FIELD_OUTCOME (1ull << 7)
#define KVX_PUBLISH_FIELD_TIMEOUT (1ull << 8)
#define KVX_PUBLISH_FIELD_ITEMS (1ull << 9)  /* items, num_items */
#define KVX_PUBLISH_FIELD_LEASE (1ull << 10) /* lease_ms (2.6) */

/* kvx_publish_args_t.flags bits */
/* Layer-wise: the offer is made before the KV exists; no layer of this
 * rank's part is read until kvx_layers_ready / kvx_tokens_ready names it
 * (see kvx_publish_layerwise below for the rules). Needs a 2.1 daemon
 * (else KVX_ERR_VERSION). */
#define KVX_PUBLISH_LAYERWISE (1u << 0)

typedef struct kvx_publish_args {
    uint64_t field_mask;
    /* The request's key, 1 to KVX_MAX_KEY bytes: every context rank
     * publishes its own blocks under the same key and num_tokens. */
    const void *key;
    size_t key_len;
    /* This rank's blocks of pool_id that hold the request's tokens (a
     * layer-wise offer may give only the first chunk's, then
     * kvx_append_blocks). */
    uint32_t pool_id;
    const uint32_t *blocks;
    uint32_t num_blocks;
    uint32_t num_tokens; /* the prompt's tokens, every rank the same */
    /* Out: the context params, identical on every rank (free with
     * kvx_context_params_free). */
    kvx_context_params_t *params;
    /* Opaque payload delivered with the KV (see kvx_publish_key below);
     * default none. */
    const void *aux;
    size_t aux_len;
    /* The request's other block tables (kvx_group_t, below); every rank
     * the same, in the same order; at most KVX_MAX_GROUPS - 1. Default
     * none. */
    const struct kvx_group *groups;
    uint32_t num_groups;
    uint32_t flags;         /* KVX_PUBLISH_LAYERWISE; default 0 */
    kvx_outcome_t *outcome; /* out; default none */
    int timeout_ms;         /* default KVX_TIMEOUT_DEFAULT_MS */
    /* A batch: these requests, and no other member but timeout_ms and
     * outcome. */
    const struct kvx_publish_args *items;
    size_t num_items;
    /* 2.6: the offer's lease, ms: how long the daemon holds it for a
     * fetch before it ends TIMED_OUT, unless renewed (kvx_renew). 0 or
     * not set: the daemon's deadlines.offer_lease_ms; more than its
     * deadlines.offer_lease_max_ms: KVX_ERR_INVALID naming lease_ms. The
     * rank whose publish (or the reservation) makes the offer sets it;
     * a later rank's must be the same or 0 (else KVX_ERR_MISMATCH). The
     * params carry it (kvx_params_lease). A daemon before 2.6:
     * KVX_ERR_VERSION. */
    uint32_t lease_ms;
} kvx_publish_args_t;

/* Offer a request's KV (or, with ITEMS, many requests'). Errors name the
 * field: KVX_ERR_INVALID (an empty or over-long key, blocks that cannot
 * hold num_tokens, aux NULL with aux_len > 0, a field_mask or flags bit
 * unknown, a required field missing), KVX_ERR_EXISTS (this rank
 * published key already), KVX_ERR_MISMATCH (num_tokens, the layout, the
 * groups or the aux differ from another rank's), KVX_ERR_LIMIT (aux over
 * limits.aux_bytes, more groups than KVX_MAX_GROUPS - 1, over the
 * daemon's memory budget), KVX_ERR_LAYOUT (a pool that does not hold
 * this rank's share), KVX_ERR_VERSION (a daemon too old for layer-wise
 * (2.1) or block tables (2.2)). */
#ifndef KVX_API_2X /* (see below) */
KVX_EXPORT int kvx_publish(kvx_client_t *client,
                           const kvx_publish_args_t *args);
#endif

/* kvx_fetch_args_t.field_mask bits */
/* Required: KEY, BLOCKS (pool_id, blocks, num_blocks), and one of
 * PARAMS (params, params_len) or CONTEXT (context_instance,
 * context_address, context_key, context_key_len). */
#define KVX_FETCH_FIELD_KEY (1ull << 0)
#define KVX_FETCH_FIELD_BLOCKS (1ull << 1)
#define KVX_FETCH_FIELD_PARAMS (1ull << 2)
#define KVX_FETCH_FIELD_CONTEXT (1ull << 3)
#define KVX_FETCH_FIELD_SKIP_TOKENS (1ull << 4)
#define KVX_FETCH_FIELD_DP_RANK (1ull << 5)
#define KVX_FETCH_FIELD_GROUPS (1ull << 6) /* groups, num_groups */
#define KVX_FETCH_FIELD_OUTCOME (1ull << 7)
#define KVX_FETCH_FIELD_TIMEOUT (1ull << 8)
#define KVX_FETCH_FIELD_ITEMS (1ull << 9) /* items, num_items */

typedef struct kvx_fetch_args {
    uint64_t field_mask;
    /* The generation side's own name of the request (its events and
     * kvx_cancel_key use it; it may differ from the context side's). */
    const void *key;
    size_t key_len;
    /* This rank's blocks, covering tokens [0, num_tokens) of the
     * request. */
    uint32_t pool_id;
    const uint32_t *blocks;
    uint32_t num_blocks;
    /* Which offer: exactly one of PARAMS (the context params that
     * kvx_publish returned on the context side) or CONTEXT (fetch by key:
     * request context_key of context_instance, whose rank 0 is served by
     * the daemon at context_address; see kvx_fetch_by_key below). */
    const uint8_t *params;
    size_t params_len;
    const char *context_instance;
    const char *context_address;
    const void *context_key;
    size_t context_key_len;
    uint32_t skip_tokens; /* tokens not written (a prefix cache hit);
                             default 0 */
    uint32_t dp_rank;     /* attention DP: the group that receives (see
                             kvx_fetch_key below); default 0 */
    /* The destination of each of the offer's other block tables, in its
     * order (pool_id, blocks, first_block, skip_tokens). Default none. */
    const struct kvx_group *groups;
    uint32_t num_groups;
    kvx_outcome_t *outcome; /* out; default none */
    int timeout_ms;         /* default KVX_TIMEOUT_DEFAULT_MS */
    /* A batch: these requests, and no other member but timeout_ms and
     * outcome. */
    const struct kvx_fetch_args *items;
    size_t num_items;
} kvx_fetch_args_t;

/* Fill blocks with the KV of an offer, writing only tokens >=
 * skip_tokens (or, with ITEMS, many). Returns once the daemon accepted
 * the fetch; its end arrives as an event in kvx_poll(). Errors:
 * KVX_ERR_INVALID (the key, both or neither of PARAMS and CONTEXT, a
 * field_mask bit unknown, a required field missing), KVX_ERR_EXISTS
 * (key fetched already), KVX_ERR_MISMATCH (not as many groups as the
 * offer has), KVX_ERR_AUTH (params whose token is not the offer's), else
 * as the 2.x calls below say. */
#ifndef KVX_API_2X
KVX_EXPORT int kvx_fetch(kvx_client_t *client, const kvx_fetch_args_t *args);
#else  /* KVX_API_2X */
/* KVX_API_2X, for a program not moved to 3.0 yet (for 3.x only):
 * kvx_publish and kvx_fetch are the 2.x calls, bound to their 2.x
 * symbols (kvx_publish@KVXFER_2.0), and the 3.0 calls are kvx_publish3
 * and kvx_fetch3. */
KVX_EXPORT KVX_DEPRECATED_PUBLISH int
kvx_publish(kvx_client_t *client, uint64_t request_id, uint32_t pool_id,
            const uint32_t *blocks, uint32_t num_blocks, uint32_t num_tokens,
            kvx_context_params_t *params,
            int timeout_ms) __asm__("kvx__publish_2x");
__asm__(".symver kvx__publish_2x, kvx_publish@KVXFER_2.0");
KVX_EXPORT KVX_DEPRECATED_FETCH int
kvx_fetch(kvx_client_t *client, uint64_t request_id, const uint8_t *params,
          size_t params_len, uint32_t pool_id, const uint32_t *blocks,
          uint32_t num_blocks, uint32_t skip_tokens,
          int timeout_ms) __asm__("kvx__fetch_2x");
__asm__(".symver kvx__fetch_2x, kvx_fetch@KVXFER_2.0");
int kvx_publish3(kvx_client_t *client,
                 const kvx_publish_args_t *args) __asm__("kvx_publish");
int kvx_fetch3(kvx_client_t *client,
               const kvx_fetch_args_t *args) __asm__("kvx_fetch");
#endif /* KVX_API_2X */

/* ---- 3.0: kvx_ready and kvx_progress ------------------------------------
 *
 * The layer-wise verbs, in the same style: an args struct whose
 * field_mask says which members are set, unknown bits refused by name,
 * a required one missing refused naming it. */

/* kvx_ready_args_t.field_mask bits */
/* Required: KEY, LAYERS (first, count). */
#define KVX_READY_FIELD_KEY (1ull << 0)
#define KVX_READY_FIELD_LAYERS (1ull << 1) /* first, count */
#define KVX_READY_FIELD_TOKENS (1ull << 2)
#define KVX_READY_FIELD_GROUP (1ull << 3)
#define KVX_READY_FIELD_CUDA_EVENT (1ull << 4)
#define KVX_READY_FIELD_TIMEOUT (1ull << 5)

typedef struct kvx_ready_args {
    uint64_t field_mask;
    /* The key this rank published layer-wise. */
    const void *key;
    size_t key_len;
    /* Layers [first, first + count) of the table's pool (this rank's
     * layer numbers); count at least 1. */
    uint32_t first;
    uint32_t count;
    /* A chunked prefill: tokens [0, tokens) of those layers are ready;
     * default 0, all of them. */
    uint32_t tokens;
    /* The block table: 0 the plain table, k + 1 the offer's groups[k];
     * default 0. */
    uint32_t group;
    /* The 64 bytes of a cudaIpcGetEventHandle recorded after the work
     * that writes those layers (GPU pools); default NULL, ready now. */
    const void *cuda_event;
    int timeout_ms; /* default KVX_TIMEOUT_DEFAULT_MS */
} kvx_ready_args_t;

/* Layers of a layer-wise offer (kvx_publish with KVX_PUBLISH_LAYERWISE)
 * hold its KV: the one call for kvx_layers_ready, kvx_tokens_ready and
 * kvx_group_tokens_ready, whose comments below give the rules (events,
 * chunked prefill, block tables). A mark after the offer's transfer
 * finished (consumed, complete or released) answers 0. Errors:
 * KVX_ERR_INVALID (a field_mask bit unknown, a required field missing,
 * the key, count 0, layers or tokens outside the offer's, no such
 * table, an event for a host pool), KVX_ERR_NOT_FOUND (no such offer),
 * KVX_ERR_CANCELLED, KVX_ERR_STATE (not published layer-wise by this
 * rank), KVX_ERR_VERSION (GROUP other than 0 and a daemon before 2.2).
 * kvx_append_blocks stays its own call: it grows the offer's block
 * list, a different verb with one form. */
KVX_EXPORT int kvx_ready(kvx_client_t *client, const kvx_ready_args_t *args);

/* kvx_progress_args_t.field_mask bits */
/* Required: KEY, LAYERS (layers_done, num_layers). */
#define KVX_PROGRESS_FIELD_KEY (1ull << 0)
#define KVX_PROGRESS_FIELD_GROUP (1ull << 1)
#define KVX_PROGRESS_FIELD_LAYERS (1ull << 2) /* layers_done, num_layers */
#define KVX_PROGRESS_FIELD_ENDED (1ull << 3)
#define KVX_PROGRESS_FIELD_TIMEOUT (1ull << 4)

/* The answers are out-pointers among the args, as kvx_publish_args_t's
 * params and outcome are: a later release adds an answer as a member
 * and a bit, without a new symbol and without a second struct to grow. */
typedef struct kvx_progress_args {
    uint64_t field_mask;
    /* The generation side's key of the fetch. */
    const void *key;
    size_t key_len;
    /* The block table: 0 the plain table, k + 1 the fetch's groups[k]
     * (its layers in its own pool's numbering); default 0. */
    uint32_t group;
    /* Out: layers [0, *layers_done) of the table's pool, *num_layers in
     * all, have landed. */
    uint32_t *layers_done;
    uint32_t *num_layers;
    /* Out: 1 once the fetch has ended and its event is coming; default
     * not asked. */
    int *ended;
    int timeout_ms; /* default KVX_TIMEOUT_DEFAULT_MS */
} kvx_progress_args_t;

/* How far this generation rank's fetch of key has come, so that
 * attention on landed layers may start while later layers arrive (vLLM's
 * wait_for_layer_load): the one call for kvx_fetch_progress and
 * kvx_group_fetch_progress. Errors: KVX_ERR_INVALID (a field_mask bit
 * unknown, a required field missing, the key, no such table),
 * KVX_ERR_NOT_FOUND (no such fetch in flight), KVX_ERR_VERSION (GROUP
 * other than 0 and a daemon before 2.3). */
KVX_EXPORT int kvx_progress(kvx_client_t *client,
                            const kvx_progress_args_t *args);

/* kvx_reserve_args_t.field_mask bits */
/* Required: KEY, INSTANCE, NUM_TOKENS, PARAMS. */
#define KVX_RESERVE_FIELD_KEY (1ull << 0)
#define KVX_RESERVE_FIELD_INSTANCE (1ull << 1)
#define KVX_RESERVE_FIELD_NUM_TOKENS (1ull << 2)
#define KVX_RESERVE_FIELD_PARAMS (1ull << 3)
#define KVX_RESERVE_FIELD_POOL (1ull << 4)
#define KVX_RESERVE_FIELD_GROUPS (1ull << 5) /* groups, num_groups */
#define KVX_RESERVE_FIELD_TIMEOUT (1ull << 6)
#define KVX_RESERVE_FIELD_LEASE (1ull << 7)   /* lease_ms (2.6) */
#define KVX_RESERVE_FIELD_OUTCOME (1ull << 8) /* outcome */
#define KVX_RESERVE_FIELD_ITEMS (1ull << 9)   /* items, num_items */

typedef struct kvx_reserve_args {
    uint64_t field_mask;
    /* The request's key, 1 to KVX_MAX_KEY bytes, as the ranks will
     * publish it. */
    const void *key;
    size_t key_len;
    const char *instance_id; /* the context instance */
    uint32_t num_tokens;     /* the prompt's tokens, at least 1 */
    /* Out: the context params (free with kvx_context_params_free). */
    kvx_context_params_t *params;
    /* The plain table's pool, needed when the instance's pools differ in
     * layout (a hybrid model's always do); default 0, the one layout they
     * share. */
    uint32_t pool_id;
    /* The request's other block tables (2.4, hybrid models): each names
     * a pool of its layout that a rank of the instance registered on
     * this daemon (pool_id), its num_tokens and first_block, and no
     * blocks; the ranks then publish the same groups (else MISMATCH,
     * "... that the reservation made"). A daemon before 2.4 ignores
     * them: KVX_ERR_VERSION. Default none. */
    const struct kvx_group *groups;
    uint32_t num_groups;
    int timeout_ms; /* default KVX_TIMEOUT_DEFAULT_MS */
    /* 2.6: the offer's lease, as kvx_publish_args_t.lease_ms; the
     * ranks' publishes give the same or 0. */
    uint32_t lease_ms;
    kvx_outcome_t *outcome; /* out; default none */
    /* A batch (a scheduler's step: kvx_reserve_many): these
     * reservations, at most KVX_MANY_MAX, sent in one write and answered
     * in one round trip, each with its own outcome and params, as
     * kvx_publish's batches; no other member but timeout_ms and
     * outcome. */
    const struct kvx_reserve_args *items;
    size_t num_items;
} kvx_reserve_args_t;

/* For the instance's scheduler (vLLM's and SGLang's scheduler process,
 * which is not a rank: connected with kvx_connect_observer, under the
 * uid that owns the instance): reserve the offer of request key of
 * instance_id for num_tokens tokens, and get its context params at once,
 * identical to what the ranks' kvx_publish will return. The ranks
 * publish their blocks later under the same key and num_tokens; a fetch
 * that comes first waits for them (under its fetch timeout); an offer no
 * rank publishes ends TIMED_OUT at deadlines.offer_lease_ms, an event for
 * the instance's ranks. Call it on the daemon of the instance's rank 0,
 * once a rank there has registered a pool (its layout goes into the
 * params). Errors: KVX_ERR_NOT_FOUND (no such instance on this daemon),
 * KVX_ERR_STATE (not joined or incomplete, no pool registered yet, rank
 * 0 served elsewhere, local pools of different layouts), KVX_ERR_EXISTS
 * (key reserved or published already), KVX_ERR_INVALID (the key,
 * num_tokens 0). An instance of another uid is NOT_FOUND, as one that
 * does not exist. KVX_ERR_INVALID also names a field_mask bit unknown or
 * a required field missing. */
#ifndef KVX_API_2X
KVX_EXPORT int kvx_reserve(kvx_client_t *client,
                           const kvx_reserve_args_t *args);
#else  /* KVX_API_2X */
/* The 2.x kvx_reserve, bound to kvx_reserve@KVXFER_2.0; the 3.0 call is
 * kvx_reserve3. */
KVX_EXPORT KVX_DEPRECATED_RESERVE int
kvx_reserve(kvx_client_t *client, const char *instance_id, const void *key,
            size_t key_len, uint32_t num_tokens, kvx_context_params_t *params,
            int timeout_ms) __asm__("kvx__reserve_2x");
__asm__(".symver kvx__reserve_2x, kvx_reserve@KVXFER_2.0");
int kvx_reserve3(kvx_client_t *client,
                 const kvx_reserve_args_t *args) __asm__("kvx_reserve");
#endif /* KVX_API_2X */
/* With KVX_RESERVE_FIELD_ITEMS, kvx_reserve takes a batch: the
 * scheduler reserves every request of its step in one round trip
 * instead of one each (a step of 256 costs one wake-up of each side).
 * The rules are kvx_publish's batches' (above): each item its own
 * field_mask, outcome and params; 0 when every item succeeded, else the
 * code of the first that failed, kvx_last_error() naming it ("kvx_reserve:
 * item 3 (key ...): ..."); an item invalid before anything is sent fails
 * the call with nothing sent. kvx_reserve_many is this form. A daemon
 * before 2.6 takes the batch but ignores lease_ms: an item that set one
 * gets KVX_ERR_VERSION (its reservation ends at the daemon's lease). */

/* ---- 2.6: leases -------------------------------------------------------
 *
 * An offer is held for its lease (kvx_publish_args_t.lease_ms, else the
 * daemon's deadlines.offer_lease_ms), counted from its making, then ends
 * TIMED_OUT unless a fetch took it. A generation side that holds the
 * params longer (a request waiting in a decode queue) renews the lease:
 * each renewal moves the deadline to now + the lease. The params say the
 * lease; renew about every third of it. */

/* The lease the params' offer was made with, in ms, into *lease_ms (0:
 * params of a daemon before 2.6, whose lease is its
 * deadlines.offer_lease_ms). KVX_ERR_INVALID: not params of this
 * version (kvx_last_error(NULL) says why). */
KVX_EXPORT int kvx_params_lease(const void *params, size_t params_len,
                                uint32_t *lease_ms);

/* kvx_renew_args_t.field_mask bits */
/* Required: PARAMS (params, num_params). */
#define KVX_RENEW_FIELD_PARAMS (1ull << 0)   /* params, num_params */
#define KVX_RENEW_FIELD_OUTCOMES (1ull << 1) /* outcomes */
#define KVX_RENEW_FIELD_TIMEOUT (1ull << 2)

typedef struct kvx_renew_args {
    uint64_t field_mask;
    /* The params of the offers to renew, as kvx_publish or kvx_reserve
     * returned them, 1 to KVX_MANY_MAX: one write, one round trip. */
    const kvx_context_params_t *params;
    size_t num_params;
    /* Out: outcomes[i] is params[i]'s (num_params of them); default
     * none. */
    kvx_outcome_t *outcomes;
    int timeout_ms; /* default KVX_TIMEOUT_DEFAULT_MS */
} kvx_renew_args_t;

/* Renew the leases of offers (the generation side: a rank, or a router or
 * scheduler process connected with kvx_connect_observer): on every
 * daemon of each offer's context ranks, its deadline becomes now + its
 * lease (or + the params' lease, kvx_params_lease, when that is longer:
 * a spread instance's offer on a daemon whose ranks named no lease). The
 * params' token is the right to it, as for kvx_release. Each
 * offer's renewal succeeds or fails on its own (its outcome): 0, also
 * for an offer being fetched (the fetch's timeout bounds it, not the
 * lease); KVX_ERR_NOT_FOUND (the offer ended: fetched, released, expired,
 * cancelled, or never made); KVX_ERR_AUTH (a token that is not the
 * offer's); KVX_ERR_INVALID (not params); KVX_ERR_UNSUPPORTED (a daemon of
 * a rank speaks a protocol before 2.6, or transfers between daemons are
 * off here); KVX_ERR_PEER_GONE / KVX_ERR_TIMED_OUT (a daemon of a rank
 * did not answer). Returns 0 when every renewal succeeded, else the code
 * of the first that failed, kvx_last_error() naming it ("kvx_renew: item
 * 3 (key ...): ..."). KVX_ERR_VERSION: the daemon (said at Hello) is
 * before 2.6; an observer's daemon before 2.6 answers
 * KVX_ERR_PROTOCOL. */
KVX_EXPORT int kvx_renew(kvx_client_t *client, const kvx_renew_args_t *args);

/* Set the pace at which the daemon's copies may start on the GPUs of
 * this rank's pools (3.2, protocol 2.8): bytes_per_ms bytes a
 * millisecond, on every device where this client has a GPU pool, now
 * or registered later (a client without one yet: recorded, 0). Each
 * device goes at the lowest of gpu.pace and the paces of every live
 * client with a GPU pool there, unless the GPU pools there are of more
 * than one uid: such a device takes gpu.pace only (one user cannot slow
 * the copies on a GPU it shares with another). bytes_per_ms 0 withdraws this
 * client's pace. The pace lapses hold_ms after the call unless the client calls
 * again (an engine calls it each step while it decodes, so that copies
 * go at full speed once it stops); hold_ms 0: it holds until changed or
 * the client's session ends. A reconnection to a restarted daemon sets
 * the last pace again for what is left of its hold. Errors:
 * KVX_ERR_INVALID (bytes_per_ms over 1 TiB, hold_ms over 60000: the
 * message names the field), KVX_ERR_STATE (no Hello: only a rank sets
 * a pace), KVX_ERR_VERSION (the daemon, said at Hello, is before 2.8). */
KVX_EXPORT int kvx_gpu_pace(kvx_client_t *client, uint64_t bytes_per_ms,
                            uint32_t hold_ms, int timeout_ms);

/* ---- 2.x calls, deprecated by kvx_publish / kvx_fetch ------------------
 * Each is kvx_publish or kvx_fetch with the members it names; they stay
 * for 3.x and go in 4.0. The 2.x kvx_publish(client, request_id, ...)
 * and kvx_fetch(client, request_id, ...) remain for programs built
 * against 2.x (their symbols' version KVXFER_2.0); a program built
 * against this header gets the 3.0 calls. */

/* Fill blocks (covering tokens [0, num_tokens) of the request) with the KV
 * named by params, writing only tokens >= skip_tokens. key is the
 * generation side's own name of the request (its events and kvx_cancel
 * use it; it may differ from the context side's). dp_rank: with
 * attention DP, the group that receives; only that group's ranks fetch,
 * and the request completes when they all have their blocks (0 without
 * DP). Returns once the daemon accepted the fetch; its end arrives as an
 * event in kvx_poll(). */
KVX_EXPORT KVX_DEPRECATED_FETCH int
kvx_fetch_key(kvx_client_t *client, const void *key, size_t key_len,
              const uint8_t *params, size_t params_len, uint32_t pool_id,
              const uint32_t *blocks, uint32_t num_blocks, uint32_t skip_tokens,
              uint32_t dp_rank, int timeout_ms);
/* kvx_fetch_key for an offer with groups (kvx_publish_groups): the
 * destination of each of its other groups, in the offer's order
 * (pool_id, blocks, first_block, skip_tokens; a state slot: its one
 * block, skip 0). The request completes once every group of every rank
 * has landed, on one daemon as between daemons. KVX_ERR_MISMATCH: not as
 * many groups as the offer has. */
KVX_EXPORT KVX_DEPRECATED_FETCH int
kvx_fetch_groups(kvx_client_t *client, const void *key, size_t key_len,
                 const uint8_t *params, size_t params_len, uint32_t pool_id,
                 const uint32_t *blocks, uint32_t num_blocks,
                 uint32_t skip_tokens, uint32_t dp_rank,
                 const kvx_group_t *groups, uint32_t ngroups, int timeout_ms);
/* kvx_fetch_key without params: fetch request context_key of
 * context_instance, whose rank 0 is served by the daemon at
 * context_address (its kvx_daemon_address()), as SGLang's decode does
 * with a bootstrap room and TensorRT-LLM's generation-first mode. The
 * daemons find the offer and wait for it to be published or reserved,
 * under deadlines.fetch_timeout_ms (then TIMED_OUT, naming the key); the
 * context instance must let this instance fetch by key
 * (kvx_join_consumers; by default any instance of its own uid, on any
 * daemon), else the request ends with KVX_ERR_PERM.
 * blocks must hold the offer's tokens (known to the engine: its prompt),
 * else the request ends with KVX_ERR_INVALID. As kvx_fetch_key, this
 * returns once the daemon accepted the fetch; the rest arrives as an
 * event; kvx_cancel_key(key) ends a fetch still waiting. */
KVX_EXPORT KVX_DEPRECATED_FETCH int
kvx_fetch_by_key(kvx_client_t *client, const void *key, size_t key_len,
                 const char *context_instance, const char *context_address,
                 const void *context_key, size_t context_key_len,
                 uint32_t pool_id, const uint32_t *blocks, uint32_t num_blocks,
                 uint32_t skip_tokens, uint32_t dp_rank, int timeout_ms);
/* kvx_fetch_by_key for an offer with groups: the destination of each of
 * its other groups, as kvx_fetch_groups. */
KVX_EXPORT KVX_DEPRECATED_FETCH int kvx_fetch_by_key_groups(
    kvx_client_t *client, const void *key, size_t key_len,
    const char *context_instance, const char *context_address,
    const void *context_key, size_t context_key_len, uint32_t pool_id,
    const uint32_t *blocks, uint32_t num_blocks, uint32_t skip_tokens,
    uint32_t dp_rank, const kvx_group_t *groups, uint32_t ngroups,
    int timeout_ms);
/* kvx_fetch_key with the key of request_id's digits. */
KVX_EXPORT KVX_DEPRECATED_FETCH int
kvx_fetch_dp(kvx_client_t *client, uint64_t request_id, const uint8_t *params,
             size_t params_len, uint32_t pool_id, const uint32_t *blocks,
             uint32_t num_blocks, uint32_t skip_tokens, uint32_t dp_rank,
             int timeout_ms);

/* Many requests in one round trip (an engine's step schedules a batch of
 * them): one write carries every item's request, then every reply is
 * read; the daemon takes them in order and answers them in one write, so
 * n items cost one wake-up of each side instead of n. Each item is what
 * its single call takes (key, pool, blocks, ...) and gets its own status
 * (0 or a kvx_status_t) and, for a publish, its own params (free each
 * with kvx_context_params_free). At most KVX_MANY_MAX items a call.
 * Returns 0 when every item succeeded; else the status of the first that
 * failed, and kvx_last_error() names it ("kvx_fetch_many: item 3 (key
 * ...): ..."); items after a refused one are still taken. An invalid
 * item (NULL key, ...) sends nothing. When the exchange itself fails
 * (connection lost, timeout) its code is returned and every status is
 * left 0: which items the daemon took is unknown, as after a single
 * call that times out. */
#define KVX_MANY_MAX 256
typedef struct {
    const void *key;
    size_t key_len;
    uint32_t pool_id;
    const uint32_t *blocks;
    uint32_t num_blocks;
    uint32_t num_tokens;
    kvx_context_params_t params; /* out, when status is 0 */
    int status;                  /* out */
} kvx_publish_item_t;
KVX_EXPORT KVX_DEPRECATED_PUBLISH int
kvx_publish_many(kvx_client_t *client, kvx_publish_item_t *items, size_t n,
                 int timeout_ms);
typedef struct {
    const void *key; /* the generation side's name of the request */
    size_t key_len;
    const uint8_t *params; /* the context params */
    size_t params_len;
    uint32_t pool_id;
    const uint32_t *blocks;
    uint32_t num_blocks;
    uint32_t skip_tokens;
    uint32_t dp_rank;
    int status; /* out */
} kvx_fetch_item_t;
KVX_EXPORT KVX_DEPRECATED_FETCH int kvx_fetch_many(kvx_client_t *client,
                                                   kvx_fetch_item_t *items,
                                                   size_t n, int timeout_ms);

typedef enum {
    KVX_EVENT_COMPLETE = 1,
    KVX_EVENT_ERROR = 2,
    KVX_EVENT_CANCELLED = 3,
    KVX_EVENT_TIMED_OUT = 4,
    /* 2.5: made by the library, not a request's end: the client is
     * connected to a new daemon (kvx_client_state) */
    KVX_EVENT_RECONNECTED = 5,
} kvx_event_kind_t;

typedef struct {
    uint64_t request_id; /* key's uint64_t form; 0 when it is none */
    kvx_event_kind_t kind;
    int code;            /* kvx_status_t, 0 for COMPLETE */
    const char *message; /* owned by the batch */
    const uint8_t *key;  /* the request's key (this side's), owned by
                            the batch */
    uint32_t key_len;
    const uint8_t *aux; /* generation side, COMPLETE: the aux payload
                           published with the KV (NULL/0: none; see
                           kvx_publish_key); owned by the batch */
    uint32_t aux_len;
} kvx_event_t;

typedef struct {
    uint64_t seq; /* batch number k, 0, 1, 2, ... per rank */
    uint32_t num_events;
    kvx_event_t *events;
} kvx_batch_t;

/* Get this rank's next batch; every rank of the instance receives the
 * same batch k. Free with kvx_batch_free(). timeout_ms is how long to
 * wait for events, by the rule of every call, where 0 has the meaning
 * only a wait for events can have:
 *   > 0: the batch is sealed once at_least events are pending or
 *        timeout_ms passes (then it holds what is pending, possibly
 *        nothing);
 *   0:   sealed now, with what is pending now (possibly nothing): the
 *        call waits for the daemon's reply, never for events. Engines
 *        poll so every scheduler step;
 *   < 0: sealed once at_least events are pending, however long that
 *        takes. The daemon still seals a waiting batch at its own bound,
 *        deadlines.poll_timeout_max_ms (60 s): an empty one is read past
 *        and polled again, a non-empty one is returned even with fewer
 *        than at_least events.
 * at_least 0 seals now whatever timeout_ms. A batch sealed by another
 * rank's poll is returned as it is. The deadline is checked every
 * deadlines.deadline_tick_ms, so a positive timeout may come back that
 * much later.
 * Every rank of the instance must poll, also one with nothing in flight
 * (a generation rank of another attention-DP group, a context rank whose
 * request was fetched elsewhere): the daemon keeps each batch until every
 * rank has read it, at most limits.batches_kept (4096) of them; past
 * that the oldest is dropped, and a rank that had not read it gets
 * KVX_ERR_LIMIT, naming the batches it missed, at its next poll (the poll
 * after reads on). */
KVX_EXPORT int kvx_poll(kvx_client_t *client, uint32_t at_least, int timeout_ms,
                        kvx_batch_t **out);
KVX_EXPORT void kvx_batch_free(kvx_batch_t *batch);

/* Cancel request key (published or fetched by this rank's instance).
 * When it returns 0, the daemon will never again read or write its
 * blocks. */
KVX_EXPORT int kvx_cancel_key(kvx_client_t *client, const void *key,
                              size_t key_len, int timeout_ms);
/* kvx_cancel_key with the key of request_id's digits. */
KVX_EXPORT int kvx_cancel(kvx_client_t *client, uint64_t request_id,
                          int timeout_ms);

/* Release a published request without a transfer: the generation side
 * (a rank, or a router or scheduler process connected with
 * kvx_connect_observer) no longer wants it, so its offer ends at once on
 * every daemon of its context ranks: their ranks get COMPLETE with the
 * message "released" in their next batch, and the blocks are free (not
 * held until deadlines.offer_lease_ms). params are the ones publish
 * returned; their token is the right to it. Errors: KVX_ERR_NOT_FOUND (no
 * such offer: never published, a daemon of a rank that has not published
 * yet, or released or complete already; a second release always answers
 * this), KVX_ERR_STATE (it is being fetched: cancel that fetch instead;
 * or it is ending), KVX_ERR_AUTH (a token that is not the offer's),
 * KVX_ERR_PEER_GONE / KVX_ERR_TIMED_OUT (a daemon of a rank did not
 * answer). */
KVX_EXPORT int kvx_release(kvx_client_t *client, const void *params,
                           size_t params_len, int timeout_ms);

/* kvx_release by key, with no params in hand: the request context_key of
 * context_instance, whose rank 0 is served by the daemon at
 * context_address. The daemons find its params as kvx_fetch_by_key does
 * (on rank 0's daemon: a process of the instance's uid; from another
 * daemon: a generation rank whose instance and uid the context instance
 * lets fetch by key, kvx_join_consumers),
 * then release as kvx_release does. KVX_ERR_NOT_FOUND when it is not published
 * or reserved (now: a release does not wait), KVX_ERR_PERM when the instance
 * does not let it, else kvx_release's errors. */
KVX_EXPORT int kvx_release_by_key(kvx_client_t *client,
                                  const char *context_instance,
                                  const char *context_address,
                                  const void *context_key,
                                  size_t context_key_len, int timeout_ms);

/* The daemon's status as one JSON object (malloc'd, caller frees). */
KVX_EXPORT int kvx_status_json(kvx_client_t *client, char **json,
                               int timeout_ms);
/* In-flight requests as a JSON array (malloc'd, caller frees). */
KVX_EXPORT int kvx_requests_json(kvx_client_t *client, char **json,
                                 int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* KVXFER_H */
