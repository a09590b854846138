/* records — see records.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "records.h"

static struct {
    reqrec_t *ring;
    uint32_t cap, next, n; /* next: where the next one goes */
    uint64_t recorded;
    int fd;         /* records.file; -1: none */
    uint64_t size;  /* its bytes now */
    char path[108]; /* the file open now */
    int failed;     /* a write failed: logged once until reopened */
} rs = {.fd = -1};

static int file_open(void)
{
    const char *p = kvxd.conf.records_file;
    if (!p[0])
        return 0;
    int fd = open(p, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
    if (fd < 0) {
        log_error("records.file: cannot open %s: %m", p);
        return -1;
    }
    struct stat st;
    rs.size = fstat(fd, &st) == 0 ? (uint64_t)st.st_size : 0;
    rs.fd = fd;
    rs.failed = 0;
    snprintf(rs.path, sizeof(rs.path), "%s", p);
    return 0;
}

static void file_close(void)
{
    if (rs.fd >= 0)
        close(rs.fd);
    rs.fd = -1;
    rs.path[0] = 0;
}

int records_init(void)
{
    rs.cap = kvxd.conf.records_ring;
    if (rs.cap && !(rs.ring = calloc(rs.cap, sizeof(*rs.ring)))) {
        log_error("records.ring: out of memory for %u records", rs.cap);
        return -1;
    }
    if (file_open()) {
        free(rs.ring);
        rs.ring = NULL;
        return -1;
    }
    return 0;
}

void records_cleanup(void)
{
    file_close();
    free(rs.ring);
    rs.ring = NULL;
    rs.cap = rs.n = rs.next = 0;
}

int records_reopen(void)
{
    file_close();
    return file_open();
}

/* FILE -> FILE.1 -> ... -> FILE.keep (removed), then a new FILE. */
static void rotate(void)
{
    char from[160], to[160];
    uint32_t keep = kvxd.conf.records_keep;
    snprintf(to, sizeof(to), "%s.%u", rs.path, keep);
    (void)unlink(to);
    for (uint32_t i = keep; i > 1; i--) {
        snprintf(from, sizeof(from), "%s.%u", rs.path, i - 1);
        snprintf(to, sizeof(to), "%s.%u", rs.path, i);
        (void)rename(from, to);
    }
    snprintf(to, sizeof(to), "%s.1", rs.path);
    if (rename(rs.path, to))
        log_warn("records.file: cannot rotate %s to %s: %m", rs.path, to);
    (void)records_reopen();
}

static void file_write(const reqrec_t *r)
{
    char line[REQREC_JSON_MAX + 1];
    int n = reqrec_json(r, line, sizeof(line) - 1);
    if (n < 0 || n >= (int)sizeof(line) - 1)
        return; /* cannot happen: REQREC_JSON_MAX bounds every field */
    line[n++] = '\n';
    ssize_t w = write(rs.fd, line, (size_t)n); /* one write: whole lines */
    if (w != n) {
        if (!rs.failed)
            log_error("records.file: cannot write %s: %s (records go on "
                      "in memory; logged once until SIGHUP)",
                      rs.path, w < 0 ? strerror(errno) : "short write");
        rs.failed = 1;
        return;
    }
    rs.size += (uint64_t)n;
    if (kvxd.conf.records_max_bytes && rs.size >= kvxd.conf.records_max_bytes)
        rotate();
}

void records_add(const reqrec_t *r)
{
    rs.recorded++;
    if (rs.cap) {
        rs.ring[rs.next] = *r;
        rs.next = (rs.next + 1) % rs.cap;
        if (rs.n < rs.cap)
            rs.n++;
    }
    if (rs.fd >= 0)
        file_write(r);
}

uint32_t records_list(reqrec_t *out, uint32_t max, int64_t only_uid,
                      uint32_t *total, uint64_t *recorded)
{
    uint32_t seen = 0, k = 0;
    /* newest first, to take the newest max; then put them oldest first */
    for (uint32_t i = 0; i < rs.n; i++) {
        const reqrec_t *r = &rs.ring[(rs.next + rs.cap - 1 - i) % rs.cap];
        if (only_uid >= 0 && r->uid != (uint64_t)only_uid)
            continue;
        seen++;
        if (k < max)
            out[k++] = *r;
    }
    for (uint32_t i = 0; i < k / 2; i++) {
        reqrec_t t = out[i];
        out[i] = out[k - 1 - i];
        out[k - 1 - i] = t;
    }
    *total = seen;
    *recorded = rs.recorded;
    return k;
}
