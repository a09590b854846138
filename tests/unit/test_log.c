/*
 * test_log — the log's forms (log.format): a JSON line escapes what a
 * message holds and carries the fields; journal sends MESSAGE, PRIORITY
 * and INSTANCE=, KEY=, PEER=, CODE= to journald's socket (a socket of the
 * test's own, in a mount namespace of its own: needs root, else skipped);
 * auto picks journal for journald's stream, tty for a terminal (level
 * names), text otherwise ("<6>").
 */
#include "../../daemon/core/log.c"

#include "tests/test.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/un.h>

/* Run fn with stderr going to a temp file; what it wrote, in out. */
static void capture(void (*fn)(void), char *out, size_t cap)
{
    char path[] = "/tmp/kvx-log-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    unlink(path);
    fflush(stderr);
    int saved = dup(2);
    CHECK(saved >= 0 && dup2(fd, 2) == 2);
    fn();
    fflush(stderr);
    CHECK(dup2(saved, 2) == 2);
    close(saved);
    ssize_t n = pread(fd, out, cap - 1, 0);
    CHECK(n >= 0);
    out[n] = 0;
    close(fd);
}

static void log_one_json(void)
{
    char w[160];
    CHECK_EQ(log_set_format("json", KVX_WHY(w)), 0);
    kvx__log_level = LOG_INFO;
    log_f(LOG_WARNING,
          &(log_fields_t){.instance = "gen\"0",
                          .key = "req-9",
                          .peer = "kvx://10.0.0.2:7000/ab",
                          .code = KVX_ERR_TIMED_OUT},
          "fetch %s ended: \"late\"\tby \x01 \xff", "x");
    log_f(LOG_DEBUG, &(log_fields_t){.instance = "a"}, "below the level");
    log_info("no fields");
}

TEST(json_line_escapes_and_carries_fields)
{
    char out[4096];
    capture(log_one_json, out, sizeof(out));
    fprintf(stderr, "%s", out);
    CHECK_EQ(strcmp(log_format_name(), "json"), 0);
    CHECK_STR_CONTAINS(out, "{\"time\":\"");
    CHECK_STR_CONTAINS(out, "Z\",\"level\":\"warning\",\"priority\":4,"
                            "\"message\":\"fetch x ended: \\\"late\\\"\\u0009"
                            "by \\u0001 \\u00ff\",\"instance\":\"gen\\\"0\","
                            "\"key\":\"req-9\",\"peer\":\"kvx://10.0.0.2:"
                            "7000/ab\",\"code\":\"TIMED_OUT\"}\n");
    CHECK(strstr(out, "below the level") == NULL);
    CHECK_STR_CONTAINS(out, "\"level\":\"info\",\"priority\":6,\"message\":"
                            "\"no fields\"}\n");
    /* two lines, nothing else */
    int lines = 0;
    for (const char *p = out; (p = strchr(p, '\n')); p++)
        lines++;
    CHECK_EQ(lines, 2);
}

static void log_text_and_tty(void)
{
    char w[160];
    CHECK_EQ(log_set_format("text", KVX_WHY(w)), 0);
    log_notice("plain %d", 1);
}

TEST(text_keeps_the_priority_prefix)
{
    char out[1024];
    capture(log_text_and_tty, out, sizeof(out));
    CHECK_EQ(strcmp(out, "<5>kvxferd: plain 1\n"), 0);
}

/* auto on a terminal: level names, no "<6>". */
TEST(auto_on_a_terminal_names_levels)
{
    int m = posix_openpt(O_RDWR | O_NOCTTY);
    CHECK(m >= 0);
    CHECK(grantpt(m) == 0 && unlockpt(m) == 0);
    int s = open(ptsname(m), O_RDWR | O_NOCTTY);
    CHECK(s >= 0);
    unsetenv("JOURNAL_STREAM");
    fflush(stderr);
    int saved = dup(2);
    CHECK(dup2(s, 2) == 2);
    char w[160];
    int rc = log_set_format("auto", KVX_WHY(w));
    const char *name = log_format_name();
    log_error("cannot open %s", "x");
    fflush(stderr);
    dup2(saved, 2);
    CHECK_EQ(rc, 0);
    CHECK_EQ(strcmp(name, "tty"), 0);
    char out[512];
    ssize_t n = read(m, out, sizeof(out) - 1);
    CHECK(n > 0);
    out[n] = 0;
    CHECK_STR_CONTAINS(out, " error: cannot open x");
    CHECK(strstr(out, "<3>") == NULL);
    /* not a terminal, not journald's stream: text */
    char path[] = "/tmp/kvx-log-XXXXXX";
    int f = mkstemp(path);
    CHECK(f >= 0);
    unlink(path);
    dup2(f, 2);
    rc = log_set_format("auto", KVX_WHY(w));
    name = log_format_name();
    dup2(saved, 2);
    CHECK_EQ(rc, 0);
    CHECK_EQ(strcmp(name, "text"), 0);
    CHECK_EQ(log_set_format("loud", KVX_WHY(w)), -1);
    CHECK_STR_CONTAINS(w, "log.format: loud (expected auto, text, json or "
                          "journal)");
    CHECK_EQ(strcmp(log_format_name(), "text"), 0); /* unchanged */
}

#ifdef KVX_JOURNAL
/* journald's socket, ours: /run is a tmpfs of this process's own mount
 * namespace (private, so nothing reaches the host's). 0, or -1: skip. */
static int fake_journal(void)
{
    if (getuid() != 0 || unshare(CLONE_NEWNS) ||
        mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) ||
        mount("tmpfs", "/run", "tmpfs", 0, "mode=0755")) {
        fprintf(stderr,
                "journal: no mount namespace of our own (%s); "
                "skipped\n",
                strerror(errno));
        return -1;
    }
    CHECK(mkdir("/run/systemd", 0755) == 0);
    CHECK(mkdir("/run/systemd/journal", 0755) == 0);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "/run/systemd/journal/socket");
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

TEST(journal_sends_the_fields)
{
    int fd = fake_journal();
    if (fd < 0)
        return;
    /* auto picks journal when stderr is the stream $JOURNAL_STREAM names */
    struct stat st;
    CHECK(fstat(2, &st) == 0);
    char env[64];
    snprintf(env, sizeof(env), "%llu:%llu", (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);
    setenv("JOURNAL_STREAM", env, 1);
    char w[160];
    CHECK_EQ(log_set_format("auto", KVX_WHY(w)), 0);
    CHECK_EQ(strcmp(log_format_name(), "journal"), 0);
    kvx__log_level = LOG_INFO;
    log_f(LOG_INFO,
          &(log_fields_t){.instance = "gen-0",
                          .key = "req-9",
                          .peer = "kvx://10.0.0.2:7000/ab",
                          .code = KVX_ERR_TIMED_OUT},
          "fetch gen-0/req-9 ended: %s", "fetch timeout");
    char dg[4096];
    ssize_t n = recv(fd, dg, sizeof(dg) - 1, 0);
    CHECK(n > 0);
    dg[n] = 0;
    fprintf(stderr, "journal got:\n%s", dg);
    CHECK_STR_CONTAINS(dg, "MESSAGE=fetch gen-0/req-9 ended: fetch timeout\n");
    CHECK_STR_CONTAINS(dg, "PRIORITY=6\n");
    CHECK_STR_CONTAINS(dg, "SYSLOG_IDENTIFIER=kvxferd\n");
    CHECK_STR_CONTAINS(dg, "INSTANCE=gen-0\n");
    CHECK_STR_CONTAINS(dg, "KEY=req-9\n");
    CHECK_STR_CONTAINS(dg, "PEER=kvx://10.0.0.2:7000/ab\n");
    CHECK_STR_CONTAINS(dg, "CODE=TIMED_OUT\n");
    /* a message without fields has none of them */
    log_notice("ready");
    n = recv(fd, dg, sizeof(dg) - 1, 0);
    CHECK(n > 0);
    dg[n] = 0;
    CHECK_STR_CONTAINS(dg, "MESSAGE=ready\n");
    CHECK(strstr(dg, "INSTANCE=") == NULL && strstr(dg, "CODE=") == NULL);
    close(fd);
}
#else
TEST(journal_refused_without_libsystemd)
{
    char w[200];
    CHECK_EQ(log_set_format("journal", KVX_WHY(w)), -1);
    CHECK_STR_CONTAINS(w, "libsystemd-dev");
}
#endif

/* log_say()'s own UTC time (a signal handler may not call gmtime_r())
 * agrees with strftime() over gmtime_r(), leap days and years included. */
TEST(signal_time_matches_gmtime)
{
    static const long days[] = {0,     59,    60,    365,   789,   10957,
                                11016, 11017, 11323, 20429, 20794, 24855,
                                47540, 47541, 47542, 95000};
    for (size_t i = 0; i < sizeof(days) / sizeof(days[0]); i++)
        for (long sec = 0; sec < 86400; sec += 86399 / 7) {
            struct timespec ts = {.tv_sec = days[i] * 86400 + sec,
                                  .tv_nsec = 123456789};
            char got[40], want[40];
            size_t n = 0;
            put_utc(got, &n, &ts);
            got[n] = 0;
            struct tm tm;
            gmtime_r(&ts.tv_sec, &tm);
            strftime(want, sizeof(want), "%Y-%m-%dT%H:%M:%S.123456Z", &tm);
            if (strcmp(got, want))
                fprintf(stderr, "day %ld s %ld: %s, want %s\n", days[i], sec,
                        got, want);
            CHECK_EQ(strcmp(got, want), 0);
        }
}

static void say_text(void)
{
    char w[160];
    CHECK_EQ(log_set_format("text", KVX_WHY(w)), 0);
    log_say(LOG_ERR, "stuck \"here\"");
    CHECK_EQ(log_set_format("json", KVX_WHY(w)), 0);
    log_say(LOG_NOTICE, "stuck \"here\"\t");
    CHECK_EQ(log_set_format("text", KVX_WHY(w)), 0);
}

/* log_say(): the text form with its priority, the JSON object escaped. */
TEST(signal_lines_in_the_format)
{
    char out[2048];
    capture(say_text, out, sizeof(out));
    CHECK(!strncmp(out, "<3>kvxferd: stuck \"here\"\n{\"time\":\"", 33));
    CHECK(strstr(out, "Z\",\"level\":\"notice\",\"priority\":5,\"message\":"
                      "\"stuck \\\"here\\\"\\u0009\"}\n") != NULL);
}
