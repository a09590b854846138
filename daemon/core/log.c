/* log — see log.h. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifdef KVX_JOURNAL
/* the caller's file and line would always be log.c's */
#define SD_JOURNAL_SUPPRESS_LOCATION
#include <systemd/sd-journal.h>
#endif

#include "kvxfer.h"
#include "log.h"

int kvx__log_level = LOG_INFO;

enum { FMT_TEXT, FMT_TTY, FMT_JSON, FMT_JOURNAL };
static const char *const fmt_names[] = {"text", "tty", "json", "journal"};
static int fmt = FMT_TEXT;

static const char *level_name(int prio)
{
    static const char *const n[] = {"emerg",   "alert",  "crit", "error",
                                    "warning", "notice", "info", "debug"};
    return prio >= 0 && prio <= LOG_DEBUG ? n[prio] : "info";
}

/* stderr is the stream journald gave the daemon ($JOURNAL_STREAM is
 * "DEVICE:INODE" of it, as systemd.exec(5) says to check). */
static int stderr_is_journal(void)
{
    const char *e = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (!e || sscanf(e, "%llu:%llu", &dev, &ino) != 2 || fstat(2, &st))
        return 0;
    return (unsigned long long)st.st_dev == dev &&
           (unsigned long long)st.st_ino == ino;
}

/* format's FMT_, or -1 with why (without the key's name) */
static int format_parse(const char *format, kvx_why_t *why)
{
#ifdef KVX_JOURNAL
    int journal = 1;
#else
    int journal = 0;
#endif
    if (!strcmp(format, "auto"))
        return journal && stderr_is_journal() ? FMT_JOURNAL
               : isatty(2)                    ? FMT_TTY
                                              : FMT_TEXT;
    if (!strcmp(format, "text"))
        return FMT_TEXT;
    if (!strcmp(format, "json"))
        return FMT_JSON;
    if (!strcmp(format, "journal") && journal)
        return FMT_JOURNAL;
    if (!strcmp(format, "journal"))
        return why_fail(why, -1,
                        "journal, but this kvxferd was built without "
                        "libsystemd (scripts/deps.sh installs "
                        "libsystemd-dev)");
    return why_fail(why, -1, "%.32s (expected auto, text, json or journal)",
                    format);
}

int log_format_check(const char *format, kvx_why_t *why)
{
    return format_parse(format, why) < 0 ? -1 : 0;
}

int log_set_format(const char *format, kvx_why_t *why)
{
    char w[200];
    int f = format_parse(format, KVX_WHY(w));
    if (f < 0)
        return why_fail(why, -1, "log.format: %s", w);
    fmt = f;
    return 0;
}

const char *log_format_name(void)
{
    return fmt_names[fmt];
}

/* s as a JSON string into out (cap bytes): control bytes and bytes past
 * ASCII escaped, so that any line parses whatever bytes a message holds. */
static size_t jstr(char *out, size_t cap, const char *s)
{
    static const char hexd[] = "0123456789abcdef";
    size_t o = 0;
    if (cap < 3)
        return 0;
    out[o++] = '"';
    for (; *s && o + 8 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[o++] = '\\';
            out[o++] = (char)c;
        } else if (c < 0x20 || c >= 0x7f) {
            memcpy(out + o, "\\u00", 4);
            out[o + 4] = hexd[c >> 4];
            out[o + 5] = hexd[c & 15];
            o += 6;
        } else {
            out[o++] = (char)c;
        }
    }
    out[o++] = '"';
    out[o] = 0;
    return o;
}

static void write_json(int prio, const log_fields_t *f, const char *msg)
{
    char line[4096], t[40];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(t, sizeof(t), "%Y-%m-%dT%H:%M:%S", &tm);
    size_t n = (size_t)snprintf(line, sizeof(line),
                                "{\"time\":\"%s.%06ldZ\",\"level\":\"%s\","
                                "\"priority\":%d,\"message\":",
                                t, ts.tv_nsec / 1000, level_name(prio), prio);
    n += jstr(line + n, sizeof(line) - n - 256, msg);
    const char *names[3] = {"instance", "key", "peer"};
    const char *vals[3] = {f ? f->instance : NULL, f ? f->key : NULL,
                           f ? f->peer : NULL};
    for (int i = 0; i < 3; i++) {
        if (!vals[i] || !vals[i][0] || n + 200 > sizeof(line))
            continue;
        n += (size_t)snprintf(line + n, sizeof(line) - n, ",\"%s\":", names[i]);
        n += jstr(line + n, sizeof(line) - n - 64, vals[i]);
    }
    if (f && f->code)
        n += (size_t)snprintf(line + n, sizeof(line) - n, ",\"code\":\"%s\"",
                              kvx_status_name(f->code));
    n += (size_t)snprintf(line + n, sizeof(line) - n, "}\n");
    if (n >= sizeof(line))
        n = sizeof(line) - 1;
    /* one write per line keeps lines whole when several threads log */
    (void)!write(2, line, n);
}

/* v as `width` decimal digits at out + *n */
static void put_num(char *out, size_t *n, unsigned long v, int width)
{
    for (int i = width - 1; i >= 0; i--, v /= 10)
        out[*n + (size_t)i] = (char)('0' + v % 10);
    *n += (size_t)width;
}

static void put_str(char *out, size_t *n, size_t cap, const char *s)
{
    while (*s && *n + 1 < cap)
        out[(*n)++] = *s++;
}

/* "YYYY-MM-DDTHH:MM:SS.uuuuuuZ" of t without gmtime_r(), which may take
 * glibc's time zone lock (days to a civil date: H. Hinnant's
 * civil_from_days). */
static void put_utc(char *out, size_t *n, const struct timespec *t)
{
    long s = (long)t->tv_sec, z = s / 86400 + 719468;
    long era = (z >= 0 ? z : z - 146096) / 146097;
    unsigned long doe = (unsigned long)(z - era * 146097);
    unsigned long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    unsigned long doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    unsigned long mp = (5 * doy + 2) / 153;
    unsigned long d = doy - (153 * mp + 2) / 5 + 1;
    unsigned long m = mp < 10 ? mp + 3 : mp - 9;
    unsigned long y = (unsigned long)((long)yoe + era * 400 + (m <= 2));
    unsigned long sod = (unsigned long)(s % 86400);
    put_num(out, n, y, 4);
    out[(*n)++] = '-';
    put_num(out, n, m, 2);
    out[(*n)++] = '-';
    put_num(out, n, d, 2);
    out[(*n)++] = 'T';
    put_num(out, n, sod / 3600, 2);
    out[(*n)++] = ':';
    put_num(out, n, sod / 60 % 60, 2);
    out[(*n)++] = ':';
    put_num(out, n, sod % 60, 2);
    out[(*n)++] = '.';
    put_num(out, n, (unsigned long)t->tv_nsec / 1000, 6);
    out[(*n)++] = 'Z';
}

void log_say(int prio, const char *msg)
{
    char line[1024];
    size_t n = 0;
    if (prio < 0 || prio > LOG_DEBUG)
        prio = LOG_INFO;
    if (fmt == FMT_JSON) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        put_str(line, &n, sizeof(line), "{\"time\":\"");
        put_utc(line, &n, &ts);
        put_str(line, &n, sizeof(line), "\",\"level\":\"");
        put_str(line, &n, sizeof(line), level_name(prio));
        put_str(line, &n, sizeof(line), "\",\"priority\":");
        put_num(line, &n, (unsigned long)prio, 1);
        put_str(line, &n, sizeof(line), ",\"message\":");
        n += jstr(line + n, sizeof(line) - n - 3, msg);
        put_str(line, &n, sizeof(line), "}\n");
    } else if (fmt == FMT_TTY) {
        put_str(line, &n, sizeof(line), level_name(prio));
        put_str(line, &n, sizeof(line), ": ");
        put_str(line, &n, sizeof(line) - 1, msg);
        line[n++] = '\n';
    } else {
        put_str(line, &n, sizeof(line), "<");
        put_num(line, &n, (unsigned long)prio, 1);
        put_str(line, &n, sizeof(line), ">kvxferd: ");
        put_str(line, &n, sizeof(line) - 1, msg);
        line[n++] = '\n';
    }
    (void)!write(2, line, n);
}

#ifdef KVX_JOURNAL
static void write_journal(int prio, const log_fields_t *f, const char *msg)
{
    char m[1100], p[16], fl[4][300];
    struct iovec iov[7];
    int n = 0;
    snprintf(m, sizeof(m), "MESSAGE=%s", msg);
    snprintf(p, sizeof(p), "PRIORITY=%d", prio);
    iov[n++] = (struct iovec){m, strlen(m)};
    iov[n++] = (struct iovec){p, strlen(p)};
    iov[n++] = (struct iovec){"SYSLOG_IDENTIFIER=kvxferd", 25};
    if (f && f->instance && f->instance[0]) {
        snprintf(fl[0], sizeof(fl[0]), "INSTANCE=%s", f->instance);
        iov[n++] = (struct iovec){fl[0], strlen(fl[0])};
    }
    if (f && f->key && f->key[0]) {
        snprintf(fl[1], sizeof(fl[1]), "KEY=%s", f->key);
        iov[n++] = (struct iovec){fl[1], strlen(fl[1])};
    }
    if (f && f->peer && f->peer[0]) {
        snprintf(fl[2], sizeof(fl[2]), "PEER=%s", f->peer);
        iov[n++] = (struct iovec){fl[2], strlen(fl[2])};
    }
    if (f && f->code) {
        snprintf(fl[3], sizeof(fl[3]), "CODE=%s", kvx_status_name(f->code));
        iov[n++] = (struct iovec){fl[3], strlen(fl[3])};
    }
    if (sd_journal_sendv(iov, n) < 0) /* journald gone: still say it */
        fprintf(stderr, "<%d>kvxferd: %s\n", prio, msg);
}
#endif

static void vlog(int prio, const log_fields_t *f, const char *fmt_, va_list ap)
{
    char line[1024];
    if (vsnprintf(line, sizeof(line), fmt_, ap) < 0)
        return;
    switch (fmt) {
    case FMT_JSON:
        write_json(prio, f, line);
        break;
#ifdef KVX_JOURNAL
    case FMT_JOURNAL:
        write_journal(prio, f, line);
        break;
#endif
    case FMT_TTY: {
        struct timespec ts;
        struct tm tm;
        char t[16];
        clock_gettime(CLOCK_REALTIME, &ts);
        localtime_r(&ts.tv_sec, &tm);
        strftime(t, sizeof(t), "%H:%M:%S", &tm);
        fprintf(stderr, "%s.%03ld %s: %s\n", t, ts.tv_nsec / 1000000,
                level_name(prio), line);
        break;
    }
    default:
        /* one write per line keeps lines whole when several processes
         * log */
        fprintf(stderr, "<%d>kvxferd: %s\n", prio, line);
        break;
    }
}

void kvx__log(int prio, const char *fmt_, ...)
{
    va_list ap;
    va_start(ap, fmt_);
    vlog(prio, NULL, fmt_, ap);
    va_end(ap);
}

void kvx__log_f(int prio, const log_fields_t *f, const char *fmt_, ...)
{
    if (prio > kvx__log_level)
        return;
    va_list ap;
    va_start(ap, fmt_);
    vlog(prio, f, fmt_, ap);
    va_end(ap);
}
