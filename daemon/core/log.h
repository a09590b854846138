/*
 * log — kvxferd's logging: one line per message to stderr, prefixed with
 * the syslog priority ("<3>") so journald keeps the level. The first place
 * that detects an error logs it, once, in lower case.
 */
#ifndef KVX_LOG_H
#define KVX_LOG_H

#include <syslog.h>

extern int kvx__log_level;

void kvx__log(int prio, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define log_at(prio, ...)                                                   \
    do {                                                                    \
        if ((prio) <= kvx__log_level)                                       \
            kvx__log((prio), __VA_ARGS__);                                  \
    } while (0)
#define log_error(...) log_at(LOG_ERR, __VA_ARGS__)
#define log_warn(...) log_at(LOG_WARNING, __VA_ARGS__)
#define log_notice(...) log_at(LOG_NOTICE, __VA_ARGS__)
#define log_info(...) log_at(LOG_INFO, __VA_ARGS__)
#define log_debug(...) log_at(LOG_DEBUG, __VA_ARGS__)

#endif /* KVX_LOG_H */
