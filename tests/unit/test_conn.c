/*
 * test_conn — client/conn.c's send_all(): fds travel in batches of
 * FRAME_FDS_PER_SEND, each with the first byte of its own piece of the
 * frame, so the daemon's receive buffer (that many fds) never truncates
 * them and each receive's fds lie in one frame. Checked against a reader
 * that receives as session.c does, through a small socket buffer (many
 * partial sends), and the refusal of more batches than the frame has
 * bytes. (calls.c, pool.c and reconnect.c come along: conn.c calls
 * them, and unit tests link the daemon's objects, not the library.)
 */
#include "../../client/calls.c"
#include "../../client/conn.c"
#include "../../client/pool.c"
#include "../../client/reconnect.c"

#include <sys/mman.h>
#include <sys/wait.h>

#include "tests/test.h"

/* The reader: receives as session.c does; writes to out the fds and
 * bytes it got, the receives that carried fds, the most in one, whether
 * any was truncated, and for each fd whether it is a memfd named by its
 * index. */
struct got {
    int fds, recv_with_fds, most, truncated, names_ok;
    size_t bytes;
    int bytes_ok;
};

static void reader(int sock, size_t len, const uint8_t *want, int out)
{
    struct got g = {0};
    g.names_ok = g.bytes_ok = 1;
    uint8_t *buf = malloc(len);
    while (g.bytes < len) {
        union {
            char b[CMSG_SPACE(FRAME_FDS_PER_SEND * sizeof(int))];
            struct cmsghdr align;
        } cm;
        struct iovec iov = {buf + g.bytes,
                            len - g.bytes > 1000 ? 1000 : len - g.bytes};
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = cm.b,
                            .msg_controllen = sizeof(cm.b)};
        ssize_t n = recvmsg(sock, &mh, 0);
        if (n <= 0)
            break;
        g.truncated |= (mh.msg_flags & MSG_CTRUNC) != 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c;
             c = CMSG_NXTHDR(&mh, c)) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *f = (int *)CMSG_DATA(c);
            g.recv_with_fds++;
            if (k > g.most)
                g.most = k;
            for (int i = 0; i < k; i++, g.fds++) {
                char path[64], name[128], want_name[64];
                snprintf(path, sizeof(path), "/proc/self/fd/%d", f[i]);
                ssize_t m = readlink(path, name, sizeof(name) - 1);
                name[m > 0 ? m : 0] = 0;
                snprintf(want_name, sizeof(want_name), "/memfd:fd-%d ", g.fds);
                g.names_ok &= strncmp(name, want_name, strlen(want_name)) == 0;
                close(f[i]);
            }
        }
        g.bytes += (size_t)n;
    }
    g.bytes_ok = g.bytes == len && !memcmp(buf, want, len);
    (void)!write(out, &g, sizeof(g));
    free(buf);
}

static struct got send_through(int nfds, size_t len, int *rc)
{
    int sv[2], p[2];
    CHECK(!socketpair(AF_UNIX, SOCK_STREAM, 0, sv) && !pipe(p));
    int small = 4096; /* partial sends, EAGAIN and waits */
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    uint8_t *frame = malloc(len);
    for (size_t i = 0; i < len; i++)
        frame[i] = (uint8_t)(i * 31 + 7);
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        reader(sv[1], len, frame, p[1]);
        _exit(0);
    }
    close(sv[1]);
    int *fds = malloc((size_t)(nfds ? nfds : 1) * sizeof(int));
    for (int i = 0; i < nfds; i++) {
        char name[32];
        snprintf(name, sizeof(name), "fd-%d", i);
        fds[i] = memfd_create(name, MFD_CLOEXEC);
        CHECK(fds[i] >= 0);
    }
    kvx_client_t *c = client_new();
    c->fd = sv[0];
    fcntl(c->fd, F_SETFL, O_NONBLOCK);
    *rc = send_all(c, frame, len, fds, nfds, kvx__now_ms() + 10000);
    close(sv[0]); /* the reader sees the end */
    c->fd = -1;
    struct got g = {0};
    if (read(p[0], &g, sizeof(g)) != (ssize_t)sizeof(g))
        memset(&g, 0, sizeof(g));
    waitpid(pid, NULL, 0);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    free(fds);
    free(frame);
    kvx_close(c);
    close(p[0]);
    close(p[1]);
    return g;
}

TEST(fds_travel_in_batches_with_their_piece)
{
    static const int counts[] = {1, 63, 64, 65, 200, 1000};
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
        int n = counts[i], rc;
        struct got g = send_through(n, 20000 + (size_t)n, &rc);
        if (rc || g.fds != n || !g.bytes_ok || g.truncated || !g.names_ok ||
            g.most > FRAME_FDS_PER_SEND ||
            g.recv_with_fds !=
                (n + FRAME_FDS_PER_SEND - 1) / FRAME_FDS_PER_SEND)
            fprintf(stderr,
                    "%d fds: rc %d, got %d in %d receives (most %d), "
                    "truncated %d, in order %d, bytes %d\n",
                    n, rc, g.fds, g.recv_with_fds, g.most, g.truncated,
                    g.names_ok, g.bytes_ok);
        CHECK_EQ(rc, 0);
        CHECK_EQ(g.fds, n);
        CHECK(g.bytes_ok && !g.truncated && g.names_ok);
        CHECK(g.most <= FRAME_FDS_PER_SEND);
        CHECK_EQ(g.recv_with_fds,
                 (n + FRAME_FDS_PER_SEND - 1) / FRAME_FDS_PER_SEND);
    }
}

TEST(more_batches_than_frame_bytes_refused)
{
    int rc;
    /* 3 batches, 2 bytes: an empty piece would lose its fds */
    struct got g = send_through(3 * FRAME_FDS_PER_SEND, 2, &rc);
    CHECK_EQ(rc, KVX_ERR_LIMIT);
    CHECK_EQ(g.fds, 0);
}
