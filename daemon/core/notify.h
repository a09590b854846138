/*
 * notify — the systemd readiness protocol, spoken directly on
 * $NOTIFY_SOCKET (no libsystemd). Silent no-op outside systemd.
 */
#ifndef KVX_NOTIFY_H
#define KVX_NOTIFY_H

/* Send state, e.g. "READY=1". Returns 0, or a negative errno. */
int notify_send(const char *state);

#endif
