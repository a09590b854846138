/*
 * test_ucx — the guard against UCX's TCP transport freeing an endpoint
 * between its receive and send progress (daemon/net/ucx.c): the daemon's
 * ucs_event_set_wait() is the one the dynamic linker binds; a handler of
 * libuct never gets read and write in one call; every other handler gets
 * its events unchanged, through a real UCS event set.
 */
#include "../../daemon/net/ucx.c"

#include "test.h"

#include <sys/socket.h>
#include <uct/api/uct.h>
#include <unistd.h>

typedef struct seen {
    int calls;
    ucs_event_set_types_t events;
    void *data;
} seen_t;

static void record(void *data, ucs_event_set_types_t events, void *arg)
{
    seen_t *s = arg;
    s->calls++;
    s->events = events;
    s->data = data;
}

/* libuct (which calls it) binds to the daemon's definition, not libucs's */
TEST(daemon_definition_is_the_one_bound)
{
    void *bound = dlsym(RTLD_DEFAULT, "ucs_event_set_wait");
    CHECK(bound == (void *)ucs_event_set_wait);
    void *next = dlsym(RTLD_NEXT, "ucs_event_set_wait");
    CHECK(next != NULL && next != bound); /* libucs's, called on */
    CHECK_EQ(ucx_tcp_guard_bound(), 1);   /* what peer_start() logs on */
}

TEST(only_libuct_handlers_are_filtered)
{
    CHECK_EQ(in_libuct((ucs_event_set_handler_t)(void *)uct_worker_create), 1);
    CHECK_EQ(in_libuct(record), 0);
    CHECK_EQ(in_libuct(record), 0); /* the kept answers */
    CHECK_EQ(in_libuct((ucs_event_set_handler_t)(void *)uct_worker_create), 1);
}

/* read and write together: read alone (write comes back at the next
 * wait, the descriptors being level-triggered); anything else unchanged */
TEST(read_and_write_become_read)
{
    static const struct {
        ucs_event_set_types_t in, out;
    } cases[] = {
        {UCS_EVENT_SET_EVREAD | UCS_EVENT_SET_EVWRITE, UCS_EVENT_SET_EVREAD},
        {UCS_EVENT_SET_EVREAD | UCS_EVENT_SET_EVWRITE | UCS_EVENT_SET_EVERR,
         UCS_EVENT_SET_EVREAD | UCS_EVENT_SET_EVERR},
        {UCS_EVENT_SET_EVREAD, UCS_EVENT_SET_EVREAD},
        {UCS_EVENT_SET_EVWRITE, UCS_EVENT_SET_EVWRITE},
        {UCS_EVENT_SET_EVWRITE | UCS_EVENT_SET_EVERR,
         UCS_EVENT_SET_EVWRITE | UCS_EVENT_SET_EVERR},
    };
    int tag;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        seen_t s = {0};
        read_first_t r = {record, &s};
        read_first(&tag, cases[i].in, &r);
        CHECK_EQ(s.calls, 1);
        CHECK_EQ((int)s.events, (int)cases[i].out);
        CHECK(s.data == &tag);
    }
}

/* Through a real event set: a socket with bytes to read and room to
 * write is reported with both to a handler outside libuct. */
TEST(other_handlers_see_both_through_ucs)
{
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    CHECK(write(sv[1], "x", 1) == 1);
    ucs_sys_event_set_t *set;
    CHECK(ucs_event_set_create(&set) == UCS_OK);
    int tag;
    CHECK(ucs_event_set_add(set, sv[0],
                            UCS_EVENT_SET_EVREAD | UCS_EVENT_SET_EVWRITE,
                            &tag) == UCS_OK);
    seen_t s = {0};
    unsigned n = 4;
    CHECK(ucs_event_set_wait(set, &n, 1000, record, &s) == UCS_OK);
    CHECK_EQ(n, 1u);
    CHECK_EQ(s.calls, 1);
    CHECK(s.data == &tag);
    CHECK_EQ((int)(s.events & (UCS_EVENT_SET_EVREAD | UCS_EVENT_SET_EVWRITE)),
             (int)(UCS_EVENT_SET_EVREAD | UCS_EVENT_SET_EVWRITE));
    ucs_event_set_cleanup(set);
    close(sv[0]);
    close(sv[1]);
}
