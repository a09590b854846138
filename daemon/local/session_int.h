/*
 * session_int — what session.c (the protocol edge: one handler per
 * request, the replies), session_pool.c (the edge's pool requests) and
 * session_conn.c (the connection: bytes and fds in and out, a session's
 * start, tick and close, the table of sessions) share; private to
 * daemon/local.
 */
#ifndef KVX_SESSION_INT_H
#define KVX_SESSION_INT_H

#include <stdint.h>
#include <sys/types.h>

#include <uv.h>

#include "common/frame.h"
#include "common/list.h"
#include "copy/pool.h"
#include "core/daemon.h"
#include "core/map.h"
#include "kvxfer.h"
#include "session.h"
#include "xfer/instance.h"

/* fds received and not yet taken by a request: a GPU pool over many VMM
 * allocations brings one each; more are closed as they come */
#define MAX_FDS (KVX_MAX_POOL_CHUNKS + 8)
#define OUT_MAX (256u << 20) /* a client this far behind is dropped */
/* Fair use of the loop. One session gets at most this many frames, or
 * replies of this many bytes, handled in one turn of the loop; the rest
 * wait for the next turn, after every other session's. */
#define TURN_FRAMES 32
#define TURN_BYTES (256u << 10)
/* A session without Hello (an observer) gets these caps at most. */
#define HELLO_QUEUE_MAX (256u << 10)
#define HELLO_REQUESTS_MAX 8u
/* An input buffer no larger than this is kept while it holds part of a
 * frame; an empty one is given back (charged only while it holds bytes).
 * Over the budget a read still gets IN_MIN bytes (the headroom, as a
 * small reply's), enough to learn which request a frame is. */
#define IN_KEEP (128u << 10)
#define IN_MIN 4096u

struct session {
    uint64_t id;
    int fd;
    uv_poll_t poll;
    int poll_events;
    pid_t pid;
    uid_t uid;
    int admin; /* sees every user's sessions and requests (status) */
    gid_t gid;
    frame_reader_t rd;
    uint8_t *out;
    size_t out_len, out_off, out_cap;
    int *fds;        /* received with SCM_RIGHTS, not yet used */
    uint64_t *fd_at; /* each one's place in the byte stream: the
                        last byte of the receive it came with,
                        which lies in the frame it came with */
    uint32_t nfds, fds_cap;
    uint64_t rx_bytes;  /* received so far */
    uint64_t frame_end; /* stream offset just past the frame being
                           handled: its fds are those before it */
    int hello;          /* Hello accepted */
    instance_t *inst;
    uint32_t rank;
    kvx_role_t role;
    map_t pools; /* pool_id -> pool_t, registered here */
    int closing;
    const char *close_why; /* set: close at the next safe point */
    uint64_t connected_ms;
    uint64_t last_rx_ms; /* bytes last arrived (idle deadline) */
    int spoke;           /* a whole request has arrived: no longer under
                            the Hello deadline (an observer) */
    uint64_t last_tx_ms; /* the client last took replies, or the
                            queue last started from empty */
    uint64_t out_total;  /* reply bytes queued since connect */
    /* bytes of rd's and out's buffers charged to the memory budget */
    uint64_t mem_in, mem_out;
    uint32_t awaiting;    /* requests read and not answered yet */
    uint64_t skip_left;   /* bytes of a frame over the memory budget
                             still to be read and dropped (it was
                             answered LIMIT) */
    int ranked;           /* said Hello: holds one of limits.max_sessions
                             (else one of limits.hello_sessions) */
    int in_paused;        /* over the queue budget: not reading */
    int resume_queued;    /* a deferred pump() is queued */
    int fds_lost;         /* fds of a receive were dropped: */
    uint64_t fds_lost_at; /* ... its last byte in the stream */
    const char *fds_lost_why;
    list_t flush_node; /* on flushq: replies queued, not yet sent */
};

/* Session slots: those that said Hello (limits.max_sessions, per uid
 * limits.uid_sessions) and those that have not (limits.hello_sessions),
 * counted in all and per uid (an entry while the uid holds any). */
typedef struct uid_slots {
    uint32_t ranks, pre;
} uid_slots_t;

/* ---- session_conn.c: the table of sessions and what they share ---- */

extern map_t sessions;         /* live sessions by id */
extern uint32_t fds_queued;    /* received fds not yet taken, all sessions */
extern uint32_t nranked, npre; /* sessions that said Hello, and not yet */

/* uid's slots, made (make) when it has none; NULL without memory. */
uid_slots_t *session_slots(uid_t uid, int make);
/* Forget uid's slots once it holds none. */
void session_slots_put(uid_t uid);
/* fds all sessions together may queue: half the open-file limit, so a
 * client sending many cannot starve the daemon of fds. */
uint32_t session_fds_cap(void);
/* Drop the first n queued fds of s (closing them unless taken). */
void session_fds_drop(session_t *s, uint32_t n, int close_them);
/* Write what the socket takes of s's replies; pause or resume reading. */
void session_flush(session_t *s);
/* Close s now: its pools released, its requests ended, the fd closed
 * in the poll handle's close callback. */
void session_close(session_t *s, const char *why);
/* Close s at a safe point (kvxd_defer): nothing more in or out. */
void session_close_later(session_t *s, const char *why);

/* ---- session.c: the protocol edge ---- */

/* Decode one Request frame of s and hand it to its handler. */
void session_handle_frame(session_t *s, const uint8_t *buf, uint32_t len);
/* Pool id of s, or NULL when s has none by that id (or it is released). */
pool_t *session_own_pool(session_t *s, uint32_t id);
/* The GPU devices of s's pools, as pacing.h counts them. */
uint64_t session_gpu_devices(const session_t *s);

/* ---- session_pool.c: the edge's pool requests ---- */

/* RegisterPool: check it, take the fds that came with its frame, and
 * register the pool; one reply either way. */
void session_on_register_pool(session_t *s, const Kvxfer__Request *rq);
/* DeregisterPool: release a pool of s that no request uses. */
void session_on_deregister_pool(session_t *s, const Kvxfer__Request *rq);

/* ---- a session's queue and its caps ---- */

/* Reply bytes queued, not yet sent. */
static inline size_t queued(const session_t *s)
{
    return s->out_len - s->out_off;
}

/* Reply bytes a session may have queued before its input is paused. */
static inline size_t queue_cap(const session_t *s)
{
    uint64_t c = kvxd.conf.session_queue_bytes;
    return (size_t)(!s->hello && c > HELLO_QUEUE_MAX ? HELLO_QUEUE_MAX : c);
}

/* Requests a session may have awaiting replies before its input is
 * paused. */
static inline uint32_t requests_cap(const session_t *s)
{
    uint32_t c = kvxd.conf.session_requests;
    return !s->hello && c > HELLO_REQUESTS_MAX ? HELLO_REQUESTS_MAX : c;
}

#endif /* KVX_SESSION_INT_H */
