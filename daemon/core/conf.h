/*
 * conf — kvxferd configuration: one declarative table of keys, the YAML
 * loader and the checks.
 *
 * Owns: the key table and the parsing of config files. Never touches
 * daemon state: conf_load() fills a kvx_conf_t the caller owns, and the
 * caller decides what to apply (see conf_apply_reloadable()).
 */
#ifndef KVX_CONF_H
#define KVX_CONF_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#define CONF_MAX_IDS 64

typedef struct kvx_conf {
    /* socket */
    char socket_path[108];
    unsigned socket_mode;  /* e.g. 0660 */
    char socket_group[64]; /* "" = daemon's group */
    /* auth: the daemon's own uid and root are always allowed */
    uint32_t allowed_uids[CONF_MAX_IDS];
    unsigned num_allowed_uids;
    uint32_t allowed_gids[CONF_MAX_IDS];
    unsigned num_allowed_gids;
    uint32_t admin_gids[CONF_MAX_IDS];
    unsigned num_admin_gids;
    /* limits */
    uint32_t max_frame_bytes;
    uint32_t hello_frame_bytes;
    uint32_t max_sessions;
    uint32_t uid_sessions;   /* one uid's share of them; 0: half */
    uint32_t hello_sessions; /* connections before Hello, beside them */
    uint32_t max_requests;
    uint32_t max_pools;
    uint32_t max_blocks_per_request;
    uint64_t session_queue_bytes; /* reply bytes queued to one session */
    uint32_t session_requests;    /* one session's requests awaiting replies */
    uint32_t list_page_entries;   /* requests in one ListRequests reply */
    uint64_t memory_bytes;        /* limits.memory_bytes: the budget */
    uint64_t uid_memory_bytes;    /* one uid's share of it; 0: half */
    uint32_t batches_kept;        /* sealed batches one instance keeps */
    uint32_t aux_bytes;           /* limits.aux_bytes: one aux payload */
    /* copy */
    uint32_t worker_threads;
    uint32_t copy_pin_threads; /* each worker on a CPU of its own */
    uint64_t copy_chunk_bytes;
    uint32_t max_inflight_chunks;
    uint32_t spin_us;
    uint32_t gpu_spin_us;
    uint32_t copy_busy_poll;    /* 0 never, 1 layer-wise waits, 2 auto */
    uint32_t gpu_event_poll_us; /* GPU event polling interval */
    /* gpu */
    uint32_t gpu_max_ctas;
    uint64_t gpu_chunk_bytes;
    uint64_t gpu_staging_bytes;
    char gpu_copy_path[8];       /* "kernel", "dma" or "auto" */
    uint64_t gpu_dma_min_run;    /* auto: DMA for runs of this or more */
    uint64_t gpu_dma_min_run_host; /* the same, a launch over PCIe */
    uint32_t gpu_sm_share;       /* MPS: % of SMs; 0: as the environment */
    char gpu_stream_priority[8]; /* "normal" or "low" */
    uint64_t gpu_pace;           /* bytes a ms a GPU's copies start; 0 off */
    /* peer daemons (UCX) */
    char peer_listen[64]; /* "IP:PORT"; "" = no peers */
    char peer_secret_file[108];
    char peer_net_devices[256]; /* UCX_NET_DEVICES; "" = derived */
    char peer_ucx_ports[32];    /* "LO-HI": UCX_TCP_PORT_RANGE; "" */
    char peer_allowed[256];     /* "CIDR,..." other daemons may be in */
    uint32_t keepalive_interval_ms;
    uint32_t keepalive_timeout_ms;
    uint32_t peer_secret_previous_ms;
    uint32_t peer_connect_timeout_ms;
    uint64_t slot_bytes;
    uint32_t slots;
    uint64_t message_bytes;   /* largest UCX message */
    uint32_t send_window;     /* messages in flight to one peer */
    uint32_t lanes;           /* peer.lanes: data worker threads */
    uint32_t direct;          /* peer.direct: receive into blocks, 2 auto */
    uint32_t busy_poll;       /* 0 never, 1 in flight, 2 auto */
    uint32_t gather_ahead;    /* send slots gathered before a PULL */
    char peer_topology[8];    /* "auto" or "off" */
    char peer_rails[256];     /* "NIC,NIC": the rails; "" = found */
    char peer_gpu_rails[512]; /* "BUS_ID=NIC+NIC,...": by hand */
    char peer_sysfs_root[108];
    /* deadlines, milliseconds */
    uint32_t offer_lease_ms;
    uint32_t offer_lease_max_ms; /* the longest lease a client may ask */
    uint32_t fetch_timeout_ms;
    uint32_t poll_timeout_max_ms;
    uint32_t drain_timeout_ms;
    uint32_t deadline_tick_ms;
    uint32_t hello_timeout_ms;
    uint32_t session_idle_ms; /* 0: never */
    uint32_t reply_stall_ms;
    /* log */
    int log_level;            /* syslog priority, LOG_ERR..LOG_DEBUG */
    char log_trace_file[108]; /* "" = no request trace */
    char log_format[16];      /* auto, text, json, journal */
    /* records (core/records.c) */
    uint32_t records_ring;      /* entries kept; 0: none */
    char records_file[108];     /* "" = no file */
    uint64_t records_max_bytes; /* rotate past this; 0: never */
    uint32_t records_keep;      /* rotated files kept */
    uint64_t copy_inline_bytes; /* host jobs this small: on the loop */
    uint64_t copy_pace;         /* bytes a ms host copies start; 0 off */
    /* metrics (local/http.c, local/metrics.c) */
    char metrics_listen[64];            /* IP:PORT of /metrics; "" off */
    uint32_t metrics_publish_ms;        /* the snapshot's period */
    uint32_t metrics_health_max_lag_ms; /* /health 503 past this lag */
} kvx_conf_t;

/* Fill every key with its default. */
void conf_defaults(kvx_conf_t *conf);

/*
 * Load path over the defaults into *conf. Every problem is written to err
 * (one line each, "FILE:LINE:COL: key: problem (expected ...)" followed by
 * the offending line) and the function returns the number of problems
 * (0 = ok, *conf valid), or a negative KVX_ERR_* code: KVX_ERR_IO if the
 * file cannot be opened or read, KVX_ERR_NOMEM (message written to err),
 * KVX_ERR_INVALID for a NULL path or conf. *conf is only written when there
 * are no problems.
 */
int conf_load(const char *path, kvx_conf_t *conf, FILE *err);

/*
 * Copy the reloadable keys of *next into *cur; write to log_out one line per
 * changed non-reloadable key ("key: changed, needs restart"). Returns the
 * number of reloadable keys that changed.
 */
int conf_apply_reloadable(kvx_conf_t *cur, const kvx_conf_t *next,
                          FILE *log_out);

/* Print the markdown table of keys (for docs/configuration.md). */
void conf_print_markdown(FILE *out);

/* Iterate "key" / "value as text" pairs of conf (for status). Returns the
 * number of keys; calls fn for each. */
int conf_foreach(const kvx_conf_t *conf,
                 void (*fn)(const char *key, const char *value, void *arg),
                 void *arg);

/* Log level name ("error", "warning", "notice", "info", "debug") <-> syslog
 * priority. */
int conf_log_level_parse(const char *name);
const char *conf_log_level_name(int level);

/* One entry of peer.allowed, "IP" or "IP/BITS" (IPv4 or IPv6, leading
 * spaces skipped): 0 with its family, address (network order) and prefix
 * length (the whole address without /BITS), or KVX_ERR_INVALID. */
int conf_net_parse(const char *tok, int *family, uint8_t addr[16],
                   unsigned *bits);

#endif /* KVX_CONF_H */
