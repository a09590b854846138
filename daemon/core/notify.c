/* notify — see notify.h. */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "log.h"
#include "notify.h"

int notify_send(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (!path || !*path)
        return 0;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t n = strlen(path);
    if (n >= sizeof(sa.sun_path) || (path[0] != '/' && path[0] != '@')) {
        log_warn("notify: NOTIFY_SOCKET '%s' is not a usable path", path);
        return -EINVAL;
    }
    memcpy(sa.sun_path, path, n);
    if (path[0] == '@')
        sa.sun_path[0] = 0; /* abstract namespace */
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        log_warn("notify: socket: %m");
        return -errno;
    }
    int rc = 0;
    socklen_t len = offsetof(struct sockaddr_un, sun_path) + n;
    if (sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa,
               len) < 0) {
        rc = -errno;
        log_warn("notify: sendto %s: %m", path);
    }
    close(fd);
    return rc;
}
