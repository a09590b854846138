/*
 * log — kvxferd's logging: one line per message, in the form log.format
 * says (log_set_format()):
 *   text     "<3>kvxferd: ..." on stderr, the syslog priority first so
 *            that journald keeps the level of a captured stream;
 *   tty      "12:00:01.234 error: ..." on stderr, for a person;
 *   json     one JSON object a line on stderr (time, level, message and
 *            the fields below), for Loki and other collectors;
 *   journal  sd_journal_send(): MESSAGE, PRIORITY and the fields
 *            INSTANCE=, KEY=, PEER=, CODE= that journalctl can match.
 * A message may name what it is about (log_fields_t; log_f()); text and
 * tty show only the message, which says it in words as well. The first
 * place that detects an error logs it, once, in lower case. Safe from
 * any thread (each line is formatted on the stack and written whole).
 */
#ifndef KVX_LOG_H
#define KVX_LOG_H

#include <syslog.h>

#include "common/why.h"

extern int kvx__log_level;

/* What a message is about; NULL (or code 0) for what it is not. */
typedef struct log_fields {
    const char *instance; /* an instance id */
    const char *key;      /* a request key, as reqkey_str() prints it */
    const char *peer;     /* a peer daemon's address */
    int code;             /* a kvx_status_t */
} log_fields_t;

void kvx__log(int prio, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void kvx__log_f(int prio, const log_fields_t *f, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* log.format: "auto" (journal when stderr is journald's stream, i.e.
 * $JOURNAL_STREAM names it; tty on a terminal; else text), "text",
 * "json" or "journal". 0, or -1 with why (journal in a build without
 * libsystemd); the format in force is unchanged then. */
int log_set_format(const char *format, kvx_why_t *why);
/* Whether log_set_format() would take format: 0, or -1 with why (what
 * is wrong, without the key's name), as --check-config must say it. */
int log_format_check(const char *format, kvx_why_t *why);
/* The format in force: "text", "tty", "json" or "journal". */
const char *log_format_name(void);
/* One line from a signal handler: async-signal-safe (one write(), no
 * stdio, locale or lock), whatever the level. json gives the same
 * object as log_error() (its time in UTC), journal the text form (its
 * "<3>" is the priority journald reads from the daemon's stderr), tty
 * the level without the time. */
void log_say(int prio, const char *msg);

#define log_at(prio, ...)                                                      \
    do {                                                                       \
        if ((prio) <= kvx__log_level)                                          \
            kvx__log((prio), __VA_ARGS__);                                     \
    } while (0)
/* A message with the fields it is about: log_f(LOG_INFO, &(log_fields_t)
 * {.instance = id}, "...", ...). A function, not a macro (a compound
 * literal's commas would split a macro's arguments): it checks the level
 * itself. */
#define log_f kvx__log_f
#define log_error(...) log_at(LOG_ERR, __VA_ARGS__)
#define log_warn(...) log_at(LOG_WARNING, __VA_ARGS__)
#define log_notice(...) log_at(LOG_NOTICE, __VA_ARGS__)
#define log_info(...) log_at(LOG_INFO, __VA_ARGS__)
#define log_debug(...) log_at(LOG_DEBUG, __VA_ARGS__)

#endif /* KVX_LOG_H */
