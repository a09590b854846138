/*
 * session — one client connection: socket I/O, frames, the SCM_RIGHTS
 * fds that arrive with them, and the protocol edge. Every request is
 * validated here, field by field, before any module acts on it; error
 * replies name the field.
 *
 * Owns the connection fd, its buffers and received fds, and the pools the
 * client registered (released when it goes). Other modules hold session
 * ids, never pointers, so a late reply to a gone session is dropped.
 */
#ifndef KVX_SESSION_H
#define KVX_SESSION_H

#include <stdint.h>
#include <sys/types.h>

#include <uv.h>

#include "kvxfer.pb-c.h"

struct instance;

typedef struct session session_t;

/* Register the reply sink (kvxd_set_reply_sink): lower layers answer
 * clients through it, by session id. */
int session_init(void);

/* Refuse a connection: one Reply with id 0, code and message, then close
 * fd. */
void session_refuse(int fd, int code, const char *message);

/* Take a connected socket (nonblocking). At limits.max_sessions it is
 * refused with KVX_ERR_LIMIT, naming the key. Returns 0 or a negative
 * status. */
/* admin: the client sees every user's sessions and requests in status
 * (else only its uid's). */
int session_start(int fd, pid_t pid, uid_t uid, gid_t gid, int admin);

/* Reply to request req_id of session sid, if it is still connected. */
void session_reply(uint64_t sid, uint64_t req_id, int status,
                   const char *message);
void session_reply_msg(uint64_t sid, Kvxfer__Reply *reply);

/* Close connections that stayed without Hello past the deadline. */
void session_tick(uint64_t now_ms);
/* Close every session (drain, exit). */
void session_close_all(const char *why);
/* Sessions whose output is not yet flushed. */
unsigned session_unflushed(void);
/* The drain is over (what: what it did): the Drain requests that wait
 * for it are answered with that (main.c, before the daemon exits). */
void session_drained(const char *what);
unsigned session_count(void);

/* For status: fill infos (malloc'd, caller frees with
 * session_infos_free). */
/* only_uid: that uid's sessions, or -1 for all; at most cap of them,
 * *total counting them all. */
size_t session_infos(Kvxfer__SessionInfo ***out, int64_t only_uid, uint32_t cap,
                     uint32_t *total);
void session_infos_free(Kvxfer__SessionInfo **infos, size_t n);

#endif /* KVX_SESSION_H */
