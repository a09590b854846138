/*
 * server — the listening Unix socket: creation (mode, group, stale socket
 * check), accept, and SO_PEERCRED authorization against the allow-lists.
 * Owns the listening fd and the socket file; hands each accepted
 * connection to session_start().
 */
#ifndef KVX_SERVER_H
#define KVX_SERVER_H

#include <stdint.h>

int server_init(void);
/* Accept again after a pause for want of fds (from the tick). */
void server_tick(uint64_t now_ms);
/* Stop accepting and remove the socket file (drain, exit). */
void server_cleanup(void);

#endif
