/*
 * test_ucx — the guard against UCX's TCP transport freeing an endpoint
 * between its receive and send progress (daemon/net/ucx.c): the daemon's
 * ucs_event_set_wait() is the one the dynamic linker binds; a handler of
 * libuct never gets read and write in one call; every other handler gets
 * its events unchanged, through a real UCS event set. The guard
 * against UCX 1.13 aborting on a purged wire-up REPLY: bound, and the
 * request fields it relabels. And ucx_addr_check(), the walk of a
 * peer's worker address: real addresses (both formats, with a worker
 * name) pass; cut, padded and broken ones are refused, naming what and
 * where.
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

/* ---- ucx_addr_check() ---------------------------------------------------- */

/* A real worker address (UCX_ADDRESS_VERSION v1 or v2; debug: with the
 * worker's name) in buf; its length. */
static size_t real_address(const char *version, int debug, uint8_t *buf,
                           size_t cap)
{
    ucp_config_t *cfg;
    CHECK(ucp_config_read(NULL, NULL, &cfg) == UCS_OK);
    CHECK(ucp_config_modify(cfg, "UNIFIED_MODE", "n") == UCS_OK);
    CHECK(ucp_config_modify(cfg, "ADDRESS_VERSION", version) == UCS_OK);
    CHECK(ucp_config_modify(cfg, "ADDRESS_DEBUG_INFO", debug ? "y" : "n") ==
          UCS_OK);
    ucp_params_t up = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                       .features = UCP_FEATURE_AM};
    ucp_context_h ctx;
    CHECK(ucp_init(&up, cfg, &ctx) == UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucp_worker_h w;
    ucp_address_t *a;
    size_t len;
    CHECK(ucp_worker_create(ctx, &wp, &w) == UCS_OK);
    CHECK(ucp_worker_get_address(w, &a, &len) == UCS_OK);
    CHECK(len <= cap);
    memcpy(buf, a, len);
    ucp_worker_release_address(w, a);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    return len;
}

TEST(real_addresses_pass_cut_ones_do_not)
{
    static const char *const versions[] = {"v1", "v2"};
    uint8_t a[UCX_ADDR_MAX + 1];
    char why[200];
    for (int v = 0; v < 2; v++)
        for (int debug = 0; debug < 2; debug++) {
            size_t len = real_address(versions[v], debug, a, UCX_ADDR_MAX);
            uint64_t id = 0;
            if (ucx_addr_check(a, len, &id, why, sizeof(why)))
                fprintf(stderr, "%s%s: %s\n", versions[v],
                        debug ? " debug" : "", why);
            CHECK_EQ(ucx_addr_check(a, len, &id, why, sizeof(why)), 0);
            CHECK(id != 0);
            /* every shorter prefix runs past its end; one byte more is
             * left over */
            for (size_t n = 0; n < len; n++)
                CHECK_EQ(ucx_addr_check(a, n, NULL, why, sizeof(why)), -1);
            a[len] = 0;
            CHECK_EQ(ucx_addr_check(a, len + 1, NULL, why, sizeof(why)), -1);
            CHECK(strstr(why, "bytes after the last device") != NULL);
        }
}

TEST(broken_addresses_are_named)
{
    uint8_t a[UCX_ADDR_MAX + 1];
    char why[200];
    memset(a, 0xff, 64);
    CHECK_EQ(ucx_addr_check(a, 64, NULL, why, sizeof(why)), -1);
    CHECK_STR_CONTAINS(why, "header byte 0xff: address version 15");
    CHECK_EQ(ucx_addr_check(a, 1, NULL, why, sizeof(why)), -1);
    CHECK_STR_CONTAINS(why, "1 bytes");
    CHECK_EQ(ucx_addr_check(a, UCX_ADDR_MAX + 1, NULL, why, sizeof(why)), -1);
    /* v2 with a header flag UCX does not know */
    a[0] = 0x01;
    a[1] = 0x10;
    CHECK_EQ(ucx_addr_check(a, 64, NULL, why, sizeof(why)), -1);
    CHECK_STR_CONTAINS(why, "header flags");
    /* a real v1 address, its first transport's overhead made negative
     * (UCX asserts on the negative score it makes: select.c:294) */
    size_t len = real_address("v1", 0, a, UCX_ADDR_MAX);
    /* header 1, id 8; md 1, device length byte, device address; then
     * the transport: checksum 2, overhead (float) */
    size_t at = 1 + 8 + 1;
    uint8_t df = a[at];
    at += 1 + (df & 0x40 ? 1 : 0) + (df & 0x20 ? 1 : 0) + (df & 0x1f) + 2;
    float f = -1.0f;
    memcpy(a + at, &f, sizeof(f));
    CHECK_EQ(ucx_addr_check(a, len, NULL, why, sizeof(why)), -1);
    CHECK_STR_CONTAINS(why, "overhead is negative");
}
