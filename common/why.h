/*
 * why — the one error-message type. A call that can fail takes a
 * kvx_why_t * last and, when it fails, writes there what went wrong,
 * naming the field or the problem; its return value is the code. The
 * message's storage stays with the caller, who knows where it goes (a
 * reply's error, a log line, a connection's last cut): kvx_why_t is a
 * view of that buffer, made from an array by KVX_WHY(). A NULL why, or
 * one of size 0, asks for no message.
 *
 *     char msg[256];
 *     if ((rc = pool_register(..., KVX_WHY(msg))))
 *         return reply_error(rc, msg);
 *
 *     static int check(const thing_t *t, kvx_why_t *why)
 *     {
 *         if (!t->n)
 *             return why_fail(why, KVX_ERR_INVALID, "n: must be > 0");
 *         ...
 *     }
 */
#ifndef KVX_WHY_H
#define KVX_WHY_H

#include <stddef.h>

typedef struct kvx_why {
    char *msg;   /* where the message goes, NUL-terminated, truncated */
    size_t size; /* msg's size in bytes */
} kvx_why_t;

/* 0, or a compile error when buf is a pointer rather than an array */
#define WHY_ARRAY_(buf)                                                        \
    (sizeof(struct {                                                           \
         int not_an_array : __builtin_types_compatible_p(                      \
                                __typeof__(buf), __typeof__(&(buf)[0]))        \
                            ? -1                                               \
                            : 1;                                               \
     }) *                                                                      \
     0)

/* A kvx_why_t * over the char array buf, alive to the end of the block. */
#define KVX_WHY(buf) (&(kvx_why_t){(buf), sizeof(buf) + WHY_ARRAY_(buf)})

/* Writes the message (printf-style) into why. */
void why_set(kvx_why_t *why, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Writes the message into why and returns code, so that a failure reads
 * `return why_fail(why, KVX_ERR_INVALID, "n: must be > 0");`. */
int why_fail(kvx_why_t *why, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Puts "prefix: " (printf-style) before the message already in why, as a
 * caller adds the context it knows to a callee's message. */
void why_prefix(kvx_why_t *why, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
