/*
 * test_ucx — the guard against UCX's TCP transport freeing an endpoint
 * between its receive and send progress (daemon/net/ucx.c): the daemon's
 * ucs_event_set_wait() is the one the dynamic linker binds; a handler of
 * libuct never gets read and write in one call; every other handler gets
 * its events unchanged, through a real UCS event set. And the guard
 * against UCX 1.13 aborting on a purged wire-up REPLY: bound, and the
 * request fields it relabels.
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

/* ---- the guard against UCX 1.13's assertion on a purged wire-up REPLY */

/* libucp (which calls it through its PLT) binds to the daemon's
 * ucp_request_send_state_ff(), and this UCX (1.13) needs it */
TEST(wireup_guard_is_bound)
{
    void *bound = dlsym(RTLD_DEFAULT, "ucp_request_send_state_ff");
    CHECK(bound == (void *)ucp_request_send_state_ff);
    void *next = dlsym(RTLD_NEXT, "ucp_request_send_state_ff");
    CHECK(next != NULL && next != bound); /* libucp's, called on */
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    CHECK_EQ(ucx_wireup_guard(), maj == 1 && min == 13 ? 1 : 0);
}

/* A request laid out as UCX 1.13.1's ucp_request_t: a wire-up message
 * (pending function ucp_wireup_msg_progress) of type 0..2 becomes an
 * ACK (3), which UCX frees without its assertion; other types, and
 * requests of any other pending function, are left as they were. */
TEST(wireup_requests_relabelled_as_ack)
{
    if (ucx_wireup_guard() != 1)
        return; /* another UCX: nothing to relabel */
    uint8_t req[512];
    void *prog = dlsym(RTLD_DEFAULT, "ucp_wireup_msg_progress");
    CHECK(prog != NULL);
    for (int type = 0; type < 6; type++) {
        memset(req, 0, sizeof(req));
        memcpy(req + REQ_UCT_FUNC, &prog, sizeof(prog));
        req[REQ_WIREUP_TYPE] = (uint8_t)type;
        CHECK_EQ(wireup_relabel(req), type <= WIREUP_REPLY);
        CHECK_EQ(req[REQ_WIREUP_TYPE], type <= WIREUP_REPLY ? 3 : type);
        uint8_t rest[512];
        memcpy(rest, req, sizeof(rest));
        rest[REQ_WIREUP_TYPE] = 0;
        memset(rest + REQ_UCT_FUNC, 0, sizeof(prog));
        for (size_t i = 0; i < sizeof(rest); i++)
            CHECK_EQ(rest[i], 0); /* nothing else written */
    }
    /* another pending function: untouched */
    memset(req, 0, sizeof(req));
    void *other = (void *)ucp_request_send_state_ff;
    memcpy(req + REQ_UCT_FUNC, &other, sizeof(other));
    req[REQ_WIREUP_TYPE] = WIREUP_REPLY;
    CHECK_EQ(wireup_relabel(req), 0);
    CHECK_EQ(req[REQ_WIREUP_TYPE], WIREUP_REPLY);
}

/* The offsets are the 1.13.1 build's, and the guard is on only where
 * the installed libucp's own function reads them (wireup_layout_ok()):
 * so here, on 1.13.1; code without those instructions turns it off. */
TEST(wireup_offsets_checked_on_libucp)
{
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    const uint8_t *f = dlsym(RTLD_NEXT, "ucp_request_send_state_ff");
    CHECK(f != NULL);
    if (maj == 1 && min == 13 && rel == 1)
        CHECK_EQ(wireup_layout_ok(f), 1);
    static uint8_t other[FF_SCAN];
    memset(other, 0x90, sizeof(other)); /* nops: another build */
    CHECK_EQ(wireup_layout_ok(other), 0);
    memcpy(other + 16, "\x48\x8b\x83\xe0\0\0\0", 7); /* one of two */
    CHECK_EQ(wireup_layout_ok(other), 0);
    memcpy(other + 64, "\x0f\xb6\x83\xa8\0\0\0\x8d\x50\xfd\x80\xfa\x02", 13);
    CHECK_EQ(wireup_layout_ok(other), 1);
}
