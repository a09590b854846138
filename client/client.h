/*
 * client.h — what libkvxfer's files share: the client struct and the
 * calls each gives the others (kvx__, local to the library by its version
 * script). Not installed.
 *
 * conn.c owns the socket, its frames and call(); pool.c the pools (host
 * memfds, CUDA IPC handles and VMM fds); calls.c the requests (publish,
 * fetch, ready marks, poll, release); json.c the status as JSON;
 * reconnect.c what a client needs to outlive its daemon: the requests in
 * flight, what each pool was registered with, the Hello and the Join, and
 * the attempts.
 */
#ifndef KVX_CLIENT_H
#define KVX_CLIENT_H

#include <stdint.h>

#include "common/frame.h"
#include "common/list.h"
#include "kvxfer.h"
#include "kvxfer.pb-c.h"

/* A request key the library tracks: in flight (on a bucket of
 * kvx__revive.keys), or lost with the daemon (on gone). */
typedef struct kvx__key {
    struct kvx__key *next;
    uint32_t len;
    uint8_t b[KVX_MAX_KEY];
} kvx__key_t;

typedef struct kvx__revive {
    /* kvx_set_reconnect */
    int enabled;
    uint32_t backoff_min_ms, backoff_max_ms, attempt_timeout_ms;
    /* the connection was lost and is being made again */
    int gone;
    int reviving; /* inside an attempt: its calls may go, and a failure
                     of theirs is the attempt's */
    int off;      /* lost with reconnection off: the client is closed */
    uint32_t incarnation, attempts, backoff_ms;
    int64_t next_try_ms;
    char cause[200]; /* why it was lost */
    char last[200];  /* why the last attempt failed */
    /* a RECONNECTED event is owed to the next batch; that batch sets
     * seq_off so that this rank's numbers go on */
    int told, rebase;
    uint64_t next_seq, seq_off;
    /* what an attempt says again */
    int has_hello;
    kvx_hello_t hello; /* its pointers into the two below */
    char *instance_id;
    uint32_t *layers_per_pp;
    int has_join;
    char **addrs, **cons;
    uint32_t naddrs, ncons;
    /* requests in flight: a hash of keys (a key published and fetched by
     * one instance is there twice) */
    kvx__key_t **keys;
    uint32_t nbuckets, nkeys;
    /* lost requests, owed a PEER_GONE event each */
    kvx__key_t *gone_keys;
    uint32_t ngone;
    list_t pools; /* kvx__pool_t.node */
    /* the last GPU pace set (kvx_gpu_pace; per_ms 0: none), its hold
     * and when it was set: set again for what is left of the hold */
    uint64_t pace_per_ms;
    uint32_t pace_hold_ms;
    int64_t pace_at_ms;
} kvx__revive_t;

struct kvx_client {
    int fd;
    int broken; /* a call failed mid-way: no more calls */
    int eof;    /* the daemon closed the connection (send/recv saw it) */
    uint64_t next_id;
    frame_reader_t rd;
    char address[192];
    char path[108]; /* the socket's, for reconnecting */
    char err[512];
    list_t pools;          /* host_pool.node, the newest first */
    uint32_t daemon_minor; /* the daemon's protocol minor, from Hello */
    int answered;     /* the last call got the daemon's reply (kvx_outcome_t) */
    uint32_t spin_us; /* kvx_set_spin_us: look for a reply this long
                         before sleeping on the socket */
    kvx__revive_t rv;
};

/* One event of a batch being made: pointers into the daemon's reply or
 * the library's own strings. */
typedef struct kvx__ev {
    int kind, code;
    const char *message;
    const uint8_t *key, *aux;
    size_t key_len, aux_len;
} kvx__ev_t;

/* ---- conn.c, for the other files ---- */
int kvx__fail(kvx_client_t *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int64_t kvx__now_ms(void);
/* "ENOENT (No such file or directory)" (a thread's buffer) */
const char *kvx__errno_str(int e);
/* The message of the last connect (or kvx_params_info) that failed on
 * this thread: kvx_last_error(NULL). */
extern __thread char kvx__connect_err[512];
/* A reply's status as the library returns it: a code it does not know
 * (or a positive one) is the daemon breaking the protocol. */
int kvx__reply_code(int32_t status);
/* Send rq (its id is set here) with nfds fds and wait for its reply,
 * looked for spin_us before the thread sleeps. Returns the daemon's
 * status; *out (if not NULL) receives the reply on success. */
int kvx__call_spin(kvx_client_t *c, Kvxfer__Request *rq, const int *fds,
                   int nfds, int timeout_ms, uint32_t spin_us,
                   Kvxfer__Reply **out);
/* kvx__call_spin() with the client's spin. */
int kvx__call_fds(kvx_client_t *c, Kvxfer__Request *rq, const int *fds,
                  int nfds, int timeout_ms, Kvxfer__Reply **out);
/* kvx__call_fds() with one fd (fd_to_pass >= 0) or none. */
int kvx__call(kvx_client_t *c, Kvxfer__Request *rq, int fd_to_pass,
              int timeout_ms, Kvxfer__Reply **out);
/* rq[0, n) in one write, then their n replies: (*out)[i] answers rq[i]
 * (its status may be a refusal; free them with kvx__replies_free()). 0
 * when the exchange worked; else no reply is kept and, once anything was
 * sent, the connection is broken. */
int kvx__call_many(kvx_client_t *c, Kvxfer__Request *rq, size_t n,
                   int timeout_ms, Kvxfer__Reply ***out);
void kvx__replies_free(Kvxfer__Reply **rp, size_t n);
/* Connect c->fd to c->path. */
int kvx__open(kvx_client_t *c, int timeout_ms);
/* Close the socket and forget any partial frame. */
void kvx__shut(kvx_client_t *c);
int kvx__hello_send(kvx_client_t *c, const kvx_hello_t *h, int timeout_ms);
int kvx__join_send(kvx_client_t *c, char **addrs, uint32_t n, char **cons,
                   uint32_t ncons, int timeout_ms);
int kvx__register_send(kvx_client_t *c, Kvxfer__RegisterPool *m, const int *fds,
                       int nfds, int timeout_ms, uint32_t *daemon_id);
/* Send GpuPace{per_ms, hold_ms}: the daemon's status. */
int kvx__pace_send(kvx_client_t *c, uint64_t per_ms, uint32_t hold_ms,
                   int timeout_ms);
/* One allocation holding the batch, its events and their bytes. */
int kvx__batch_make(kvx_client_t *c, uint64_t seq, const kvx__ev_t *ev,
                    size_t n, kvx_batch_t **out);

/* ---- calls.c, for verbs.c ---- */
/* A key argument: 0, or KVX_ERR_INVALID with the message set (fn names
 * the call, or the item). */
int kvx__key_arg(kvx_client_t *c, const char *fn, const void *key,
                 size_t key_len);
/* What kvx__groups_msg() builds the GroupBlocks for. */
enum { KVX__GROUPS_PUBLISH, KVX__GROUPS_FETCH, KVX__GROUPS_RESERVE };
/* groups as GroupBlocks messages into m and mp (KVX_MAX_GROUPS - 1
 * each): a publish's with num_tokens, a fetch's with skip_tokens, a
 * reservation's with num_tokens and no blocks. 0, or an error of fn (c's
 * last error says which). */
int kvx__groups_msg(kvx_client_t *c, const char *fn, const kvx_group_t *groups,
                    uint32_t ngroups, int use, Kvxfer__GroupBlocks *m,
                    Kvxfer__GroupBlocks **mp);
/* The params a publish or reserve reply carries, copied into *params:
 * 0, or KVX_ERR_PROTOCOL / KVX_ERR_NOMEM with the message set. */
int kvx__params_take(kvx_client_t *c, const char *what, const Kvxfer__Reply *r,
                     kvx_context_params_t *params);
/* Call rq, a request that ends with an event for key: tracked once the
 * daemon took it, so that it ends even if the daemon goes (reconnect.c).
 * params: where a publish's go (NULL: a fetch). */
int kvx__tracked_call(kvx_client_t *c, Kvxfer__Request *rq, const void *key,
                      size_t key_len, kvx_context_params_t *params,
                      int timeout_ms);

/* ---- verbs.c, for compat.c ---- */
/* kvx_publish / kvx_fetch with fn naming the call in messages (a 2.x
 * wrapper's name). *replied (may be NULL): a batch's replies came back,
 * so its items' outcomes are the daemon's. */
int kvx__publish(kvx_client_t *c, const char *fn, const kvx_publish_args_t *a,
                 int *replied);
int kvx__fetch(kvx_client_t *c, const char *fn, const kvx_fetch_args_t *a,
               int *replied);
/* kvx_ready / kvx_progress / kvx_reserve with fn naming the call in
 * messages. */
int kvx__ready(kvx_client_t *c, const char *fn, const kvx_ready_args_t *a);
int kvx__progress(kvx_client_t *c, const char *fn,
                  const kvx_progress_args_t *a);
int kvx__reserve(kvx_client_t *c, const char *fn, const kvx_reserve_args_t *a);

/* ---- pool.c, for conn.c ---- */
/* Unmap and free the pools kvx_pool_create_host made (kvx_close). */
void kvx__host_pools_free(kvx_client_t *c);

/* ---- reconnect.c, for the other files ---- */
void kvx__rv_init(kvx_client_t *c);
void kvx__rv_cleanup(kvx_client_t *c);
/* The daemon closed the connection: end what was in flight, and reconnect
 * at the next call (or close the client, with reconnection off). */
void kvx__lost(kvx_client_t *c);
/* Before a call on a lost connection: 0 once connected again (deadline:
 * the call's, -1 none), else KVX_ERR_CLOSED saying why. */
int kvx__revive(kvx_client_t *c, int64_t deadline);
/* KVX_ERR_CLOSED with the message for a client lost for good. */
int kvx__closed(kvx_client_t *c);

/* A key to track once its request is taken (NULL: out of memory, the
 * client's error says so). */
kvx__key_t *kvx__key_new(kvx_client_t *c, const void *key, size_t len);
/* Track k (taken) as in flight. */
void kvx__track(kvx_client_t *c, kvx__key_t *k);
/* A terminal event for key: one of its entries ends. */
void kvx__untrack(kvx_client_t *c, const uint8_t *key, size_t len);

/* Keep what registered a pool (its message, dups of its fds), answered
 * with daemon_id; *id is the engine's id for it. */
int kvx__pool_keep(kvx_client_t *c, const Kvxfer__RegisterPool *m,
                   const int *fds, int nfds, uint32_t daemon_id, uint32_t *id);
/* The current daemon's id of the engine's pool id (id itself if none). */
uint32_t kvx__pool_daemon(const kvx_client_t *c, uint32_t id);
void kvx__pool_forget(kvx_client_t *c, uint32_t id);

/* Keep the Hello and the Join an attempt says again. */
int kvx__hello_keep(kvx_client_t *c, const kvx_hello_t *h);
int kvx__join_keep(kvx_client_t *c, const char *const *addrs, uint32_t n,
                   const char *const *cons, uint32_t ncons);

/* kvx_poll's part: the batch of PEER_GONE events owed (1, *out set), or
 * 0 when none is; < 0 on failure. */
int kvx__gone_batch(kvx_client_t *c, kvx_batch_t **out);
/* The seq of a batch the daemon numbered daemon_seq, and whether it owes
 * a RECONNECTED event (*ev filled, 1). */
uint64_t kvx__batch_seq(kvx_client_t *c, uint64_t daemon_seq);
int kvx__told(kvx_client_t *c, kvx__ev_t *ev, char *buf, size_t len);

#endif /* KVX_CLIENT_H */
