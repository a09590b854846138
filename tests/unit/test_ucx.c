/*
 * test_ucx — the guard against UCX's TCP transport freeing an endpoint
 * between its receive and send progress (daemon/net/ucx.c): the daemon's
 * ucs_event_set_wait() is the one the dynamic linker binds; a handler of
 * libuct never gets read and write in one call; every other handler gets
 * its events unchanged, through a real UCS event set. And
 * ucx_addr_check(), the walk of a peer's worker address: real addresses
 * (both formats, with a worker name) pass; cut, padded and broken ones
 * are refused, naming what and where.
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
