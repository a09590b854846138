/* server — listening socket and peer authorization; see server.h. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <libgen.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/frame.h"
#include "core/daemon.h"
#include "core/log.h"
#include "kvxfer.pb-c.h"
#include "server.h"
#include "session.h"

static struct {
    int fd;
    uv_poll_t poll;
    int open;
    uint64_t paused_until; /* accept failed for want of fds: 0, or when */
    uint64_t warned_ms;    /* the last time that was logged */
    uint64_t refused_ms;   /* ... and the last refusal for want of fds */
    int spare;             /* an fd held for telling a client, when the
                              daemon is out of fds, why it is refused */
    int activated;         /* the fd came from systemd (LISTEN_FDS): the
                              socket file is its, never unlinked here */
    char path[108];
} srv = {.fd = -1, .spare = -1};

/* Out of fds at accept: the spare is given up for a moment, so that the
 * waiting client is accepted, told LIMIT and closed, instead of waiting
 * in the backlog (the way Redis and others keep an fd in reserve). 1: one
 * was turned away; 0: none was waiting (accept fails with EMFILE before
 * it looks at the queue); -1: no spare, or accept failed. */
static int refuse_for_fds(void)
{
    if (srv.spare < 0 &&
        (srv.spare = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0)
        return -1;
    close(srv.spare);
    srv.spare = -1;
    int fd = accept4(srv.fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    int e = errno;
    if (fd >= 0) {
        struct rlimit rl;
        getrlimit(RLIMIT_NOFILE, &rl);
        char msg[200];
        snprintf(msg, sizeof(msg),
                 "connection refused: the daemon is out of file descriptors "
                 "(EMFILE/ENFILE: RLIMIT_NOFILE %llu, or the system's "
                 "limit); try again later",
                 (unsigned long long)rl.rlim_cur);
        session_refuse(fd, KVX_ERR_LIMIT, msg);
    }
    srv.spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd >= 0)
        return 1;
    return e == EAGAIN || e == EWOULDBLOCK ? 0 : -1;
}

static int gid_in(gid_t gid, const uint32_t *v, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        if (v[i] == gid)
            return 1;
    return 0;
}

/* Supplementary groups of the peer, from /proc (SO_PEERCRED gives only
 * the primary group). The peer could exit and its pid be reused between
 * accept and here; that race only ever refuses, never admits, since the
 * new process must itself be in an allowed group. */
static int groups_in(pid_t pid, const uint32_t *v, unsigned n)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int ok = 0;
    char *line = NULL; /* whole lines: a long Groups: line is not cut */
    size_t cap = 0;
    while (!ok && getline(&line, &cap, f) > 0) {
        if (strncmp(line, "Groups:", 7))
            continue;
        char *p = line + 7, *end;
        for (;;) {
            unsigned long g = strtoul(p, &end, 10);
            if (end == p)
                break;
            ok |= gid_in((gid_t)g, v, n);
            p = end;
        }
    }
    free(line);
    fclose(f);
    return ok;
}

/* The daemon's own group, when it is not root's: its members may connect
 * (under systemd/kvxferd.service the group kvxfer, which also owns the
 * socket). */
static int own_group(gid_t gid, pid_t pid)
{
    uint32_t own = (uint32_t)getgid();
    return own != 0 && (gid == own || groups_in(pid, &own, 1));
}

static int peer_allowed(uid_t uid, gid_t gid, pid_t pid)
{
    const kvx_conf_t *c = &kvxd.conf;
    if (uid == 0 || uid == getuid() || own_group(gid, pid))
        return 1;
    for (unsigned i = 0; i < c->num_allowed_uids; i++)
        if (c->allowed_uids[i] == uid)
            return 1;
    return gid_in(gid, c->allowed_gids, c->num_allowed_gids) ||
           (c->num_allowed_gids &&
            groups_in(pid, c->allowed_gids, c->num_allowed_gids));
}

/* Sees every user's sessions, pools, instances and requests in status:
 * root, the daemon's own uid, and members of auth.admin_gids. */
static int peer_admin(uid_t uid, gid_t gid, pid_t pid)
{
    const kvx_conf_t *c = &kvxd.conf;
    return uid == 0 || uid == getuid() ||
           gid_in(gid, c->admin_gids, c->num_admin_gids) ||
           (c->num_admin_gids &&
            groups_in(pid, c->admin_gids, c->num_admin_gids));
}

/* Tell a refused peer why, in a Reply frame with id 0, then close. */
static void refuse(int fd, uid_t uid)
{
    char msg[160];
    snprintf(msg, sizeof(msg),
             "connection refused: uid %u is not in auth.allowed_uids and "
             "none of its groups is in auth.allowed_gids",
             (unsigned)uid);
    session_refuse(fd, KVX_ERR_PERM, msg);
}

static void on_accept(uv_poll_t *h, int status, int events)
{
    (void)h;
    (void)events;
    if (status < 0)
        return;
    for (;;) {
        int fd = accept4(srv.fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return;
            /* out of fds: the client waiting is told so with the spare
             * fd; out of memory, or no spare: the connection stays
             * queued and the socket readable, so stop listening for a
             * moment rather than spin on it (server_tick() listens
             * again) */
            int e = errno;
            uint64_t now = kvxd_now_ms();
            int r = e == EMFILE || e == ENFILE ? refuse_for_fds() : -1;
            if (r == 0)
                return; /* nobody was waiting */
            if (r == 1) {
                if (now >= srv.refused_ms + 10000) {
                    srv.refused_ms = now;
                    log_warn("server: out of file descriptors: clients are "
                             "refused with LIMIT");
                }
                continue;
            }
            errno = e;
            if (now >= srv.warned_ms + 10000) { /* once in 10 s at most */
                srv.warned_ms = now;
                log_warn("server: accept: %m; not accepting for 100 ms");
            }
            srv.paused_until = now + 100;
            uv_poll_stop(&srv.poll);
            return;
        }
        struct ucred cr;
        socklen_t len = sizeof(cr);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) {
            log_warn("server: SO_PEERCRED: %m");
            close(fd);
            continue;
        }
        if (!peer_allowed(cr.uid, cr.gid, cr.pid)) {
            log_warn("server: refused pid %d uid %u gid %u: not in "
                     "auth.allowed_uids or auth.allowed_gids",
                     (int)cr.pid, (unsigned)cr.uid, (unsigned)cr.gid);
            refuse(fd, cr.uid);
            continue;
        }
        session_start(fd, cr.pid, cr.uid, cr.gid,
                      peer_admin(cr.uid, cr.gid, cr.pid));
    }
}

/* A socket file left by a dead daemon is removed; one with a live daemon
 * behind it is an error. */
static int clear_stale(const char *path)
{
    struct stat st;
    if (lstat(path, &st) < 0)
        return 0;
    if (!S_ISSOCK(st.st_mode)) {
        log_error("server: %s exists and is not a socket", path);
        return KVX_ERR_EXISTS;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        log_error("server: socket: %m");
        return KVX_ERR_IO;
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa)), err = errno;
    close(fd);
    /* only a refused connection proves nobody listens: a daemon that is
     * busy (EAGAIN, a full backlog) or that we may not reach (EACCES)
     * keeps its socket */
    if (rc == 0 || err == EAGAIN) {
        log_error("server: another daemon is listening on %s", path);
        return KVX_ERR_EXISTS;
    }
    if (err != ECONNREFUSED) {
        log_error("server: cannot tell whether a daemon listens on %s: "
                  "connect: %s",
                  path, strerror(err));
        return KVX_ERR_EXISTS;
    }
    unlink(path);
    return 0;
}

/* Socket activation (sd_listen_fds(3), read here without libsystemd):
 * LISTEN_PID is this process and LISTEN_FDS is 1: fd 3
 * (SD_LISTEN_FDS_START) is the listening socket, bound and kept by the
 * socket unit, so that the path outlives this process and clients that
 * connect while no daemon runs wait in its backlog. 1 with srv.fd set;
 * 0: not activated; or an error, logged. */
static int take_activated(void)
{
    const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
    char *end;
    if (!pid || !fds)
        return 0;
    unsigned long p = strtoul(pid, &end, 10);
    /* for another process (an ancestor's): not ours */
    if (*end || p != (unsigned long)getpid())
        return 0;
    /* never passed on to children */
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
    unsigned long n = strtoul(fds, &end, 10);
    if (*end || n != 1) {
        log_error("server: socket activation: LISTEN_FDS=%s; kvxferd takes "
                  "exactly one socket (ListenStream= once in the .socket "
                  "unit)",
                  fds);
        return KVX_ERR_INVALID;
    }
    const int fd = 3; /* SD_LISTEN_FDS_START */
    int dom = 0, type = 0, acc = 0;
    socklen_t l1 = sizeof(dom), l2 = sizeof(type), l3 = sizeof(acc);
    struct sockaddr_un sa;
    socklen_t sl = sizeof(sa);
    const char *bad = NULL;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &l1) < 0 ||
        getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l2) < 0 ||
        getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &l3) < 0)
        bad = strerror(errno);
    else if (dom != AF_UNIX)
        bad = "not an AF_UNIX socket";
    else if (type != SOCK_STREAM)
        bad = "not a stream socket";
    else if (!acc)
        bad = "not listening";
    else if (getsockname(fd, (struct sockaddr *)&sa, &sl) < 0 ||
             sl <= offsetof(struct sockaddr_un, sun_path) || !sa.sun_path[0])
        bad = "not bound to a path";
    if (bad) {
        log_error("server: socket activation: fd 3 (LISTEN_FDS=1) must be a "
                  "listening AF_UNIX stream socket bound to a path: %s",
                  bad);
        return KVX_ERR_INVALID;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 ||
        fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
        log_error("server: socket activation: fcntl fd 3: %m");
        return KVX_ERR_IO;
    }
    snprintf(srv.path, sizeof(srv.path), "%.*s",
             (int)(sl - offsetof(struct sockaddr_un, sun_path)), sa.sun_path);
    if (strcmp(srv.path, kvxd.conf.socket_path))
        log_warn("server: socket activation: the socket unit listens on %s, "
                 "not socket.path %s; clients must use %s",
                 srv.path, kvxd.conf.socket_path, srv.path);
    srv.fd = fd;
    srv.activated = 1;
    return 1;
}

/* Accepting, on the bound and listening srv.fd. */
static int server_start(void)
{
    int rc = uv_poll_init(kvxd.loop, &srv.poll, srv.fd);
    if (rc) {
        log_error("server: uv_poll_init: %s", uv_strerror(rc));
        return KVX_ERR_IO;
    }
    srv.open = 1;
    srv.spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    uv_poll_start(&srv.poll, UV_READABLE, on_accept);
    return 0;
}

/* What a daemon that is not root and may not write the socket's folder
 * (the default /run/kvxfer, a wheel's daemon) is told to do
 * (docs/operations.md, "From a wheel"). */
static const char *not_root_hint(int err)
{
    if ((err != EACCES && err != EPERM) || geteuid() == 0)
        return "";
    return " (kvxferd runs as a user that may not write there: give it a "
           "socket in a folder it may write, --socket PATH or socket.path)";
}

int server_init(void)
{
    const kvx_conf_t *c = &kvxd.conf;
    int rc = take_activated();
    if (rc < 0)
        return rc;
    if (rc) {
        if ((rc = server_start()))
            return rc;
        log_info("listening on %s (socket activation: fd 3; its mode and "
                 "group are the socket unit's)",
                 srv.path);
        return 0;
    }
    snprintf(srv.path, sizeof(srv.path), "%s", c->socket_path);
    char dir[108];
    snprintf(dir, sizeof(dir), "%s", c->socket_path);
    if (mkdir(dirname(dir), 0755) < 0 && errno != EEXIST) {
        int err = errno;
        log_error("server: mkdir %s: %s%s", dir, strerror(err),
                  not_root_hint(err));
        return KVX_ERR_IO;
    }
    if ((rc = clear_stale(srv.path)))
        return rc;
    srv.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (srv.fd < 0) {
        log_error("server: socket: %m");
        return KVX_ERR_IO;
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", srv.path);
    mode_t old = umask(0177);
    rc = bind(srv.fd, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (rc < 0) {
        int err = errno;
        log_error("server: bind %s: %s%s", srv.path, strerror(err),
                  not_root_hint(err));
        goto err_close_fd;
    }
    if (chmod(srv.path, c->socket_mode) < 0) {
        log_error("server: chmod %s %o: %m", srv.path, c->socket_mode);
        goto err_unlink;
    }
    if (c->socket_group[0]) {
        /* a name, or else a number (a gid with no name is allowed) */
        struct group *g = getgrnam(c->socket_group);
        char *end = NULL;
        unsigned long num = strtoul(c->socket_group, &end, 10);
        int numeric = *end == 0 && num < (gid_t)-1;
        gid_t gid = g ? g->gr_gid : (gid_t)num;
        if (!g && !numeric) {
            log_error("server: socket.group: no group named '%s'",
                      c->socket_group);
            goto err_unlink;
        }
        if (chown(srv.path, (uid_t)-1, gid) < 0) {
            log_error("server: chown %s to group %s: %m", srv.path,
                      c->socket_group);
            goto err_unlink;
        }
    }
    if (listen(srv.fd, 512) < 0) {
        log_error("server: listen %s: %m", srv.path);
        goto err_unlink;
    }
    if (server_start())
        goto err_unlink;
    log_info("listening on %s (mode %04o)", srv.path, c->socket_mode);
    return 0;

err_unlink:
    unlink(srv.path);
err_close_fd:
    close(srv.fd);
    srv.fd = -1;
    return KVX_ERR_IO;
}

void server_tick(uint64_t now_ms)
{
    if (srv.open && srv.paused_until && now_ms >= srv.paused_until) {
        srv.paused_until = 0;
        uv_poll_start(&srv.poll, UV_READABLE, on_accept);
    }
}

void server_cleanup(void)
{
    if (srv.open) {
        uv_poll_stop(&srv.poll);
        uv_close((uv_handle_t *)&srv.poll, NULL);
        srv.open = 0;
    }
    if (srv.fd >= 0) {
        close(srv.fd);
        srv.fd = -1;
        /* an activated socket stays: its unit holds it, and clients
         * that connect now wait for the next daemon */
        if (!srv.activated)
            unlink(srv.path);
    }
    if (srv.spare >= 0) {
        close(srv.spare);
        srv.spare = -1;
    }
}
