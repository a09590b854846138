/*
 * server — the listening Unix socket: creation (mode, group, stale socket
 * check), or the one systemd passes (socket activation: LISTEN_FDS,
 * LISTEN_PID, fd 3), accept, and SO_PEERCRED authorization against the
 * allow-lists. Owns the listening fd and the socket file it creates (an
 * activated one is the socket unit's: never unlinked); hands each
 * accepted connection to session_start().
 */
#ifndef KVX_SERVER_H
#define KVX_SERVER_H

#include <stdint.h>

int server_init(void);
/* Accept again after a pause for want of fds (from the tick). */
void server_tick(uint64_t now_ms);
/* Stop accepting and remove the socket file (drain, exit); an activated
 * socket's file stays, and connections queue there for the next run. */
void server_cleanup(void);

#endif
