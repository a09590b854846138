/*
 * test_ucx — the guard against UCX's TCP transport freeing an endpoint
 * between its receive and send progress (daemon/net/ucx.c): the daemon's
 * ucs_event_set_wait() is the one the dynamic linker binds; a handler of
 * libuct never gets read and write in one call; every other handler gets
 * its events unchanged, through a real UCS event set. The guard
 * against UCX 1.13 aborting on a purged wire-up REPLY: bound, and the
 * request fields it relabels. And ucx_addr_check(), the walk of a
 * peer's worker address: real addresses (both formats, with a worker
 * name; the loaded UCX's, and kept ones of UCX 1.13 and 1.22, walked as
 * each UCX version reads them) pass; cut, padded and broken ones are
 * refused, naming what and where. And ucx_addr_fit().
 */
#include "../../daemon/net/ucx.c"
#include "../../daemon/net/ucx_addr.c"

#include "tests/test.h"

#include <sys/socket.h>
#include <sys/wait.h>
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
    uint8_t req[512];
    void *prog = dlsym(RTLD_DEFAULT, "ucp_wireup_msg_progress");
    if (ucx_wireup_guard() != 1) {
        /* another UCX (1.14 and later: no assertion): whatever a request
         * holds, it is left as it was */
        memset(req, 0, sizeof(req));
        memcpy(req + REQ_UCT_FUNC, &prog, sizeof(prog));
        CHECK_EQ(wireup_relabel(req), 0);
        CHECK_EQ(req[REQ_WIREUP_TYPE], 0);
        return;
    }
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
            if (ucx_addr_check(a, len, &id, KVX_WHY(why)))
                fprintf(stderr, "%s%s: %s\n", versions[v],
                        debug ? " debug" : "", why);
            CHECK_EQ(ucx_addr_check(a, len, &id, KVX_WHY(why)), 0);
            CHECK(id != 0);
            /* every shorter prefix runs past its end; one byte more is
             * left over */
            for (size_t n = 0; n < len; n++)
                CHECK_EQ(ucx_addr_check(a, n, NULL, KVX_WHY(why)), -1);
            a[len] = 0;
            CHECK_EQ(ucx_addr_check(a, len + 1, NULL, KVX_WHY(why)), -1);
            CHECK(strstr(why, "bytes after the last device") != NULL);
        }
}

TEST(broken_addresses_are_named)
{
    uint8_t a[UCX_ADDR_MAX + 1];
    char why[200];
    memset(a, 0xff, 64);
    CHECK_EQ(ucx_addr_check(a, 64, NULL, KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "header byte 0xff: address version 15");
    CHECK_EQ(ucx_addr_check(a, 1, NULL, KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "1 bytes");
    CHECK_EQ(ucx_addr_check(a, UCX_ADDR_MAX + 1, NULL, KVX_WHY(why)), -1);
    /* v2 with a header flag UCX does not know */
    a[0] = 0x01;
    a[1] = 0x10;
    CHECK_EQ(ucx_addr_check(a, 64, NULL, KVX_WHY(why)), -1);
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
    CHECK_EQ(ucx_addr_check(a, len, NULL, KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "overhead is negative");
}

/* ---- the formats of UCX 1.13 to 1.22 ------------------------------------
 *
 * Real addresses of a daemon-like worker on loopback (the same context as
 * daemon_like("lo"), as tests/integration's daemons make them), taken from
 * each UCX once and kept here, so that either build walks both. */

/* UCX 1.13.1, version 1 (the default): 186 bytes; MD bytes with 1.13's
 * flags (0x20: registers) */
static const uint8_t a113_lo[186] = {
    0x20, 0x3b, 0x48, 0xc3, 0xc2, 0x8f, 0x76, 0x8f, 0x59, 0x20, 0x00, 0x63,
    0x75, 0x77, 0xcc, 0x2b, 0x32, 0x00, 0xf8, 0xd7, 0x4f, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x4f, 0x03, 0x00, 0x88, 0xcb, 0x6f, 0x65, 0x55, 0x2e, 0x22,
    0x8c, 0x08, 0x21, 0x12, 0x01, 0x02, 0xa7, 0x23, 0x4a, 0xdf, 0xcc, 0x1c,
    0x25, 0xbe, 0xf9, 0xff, 0xff, 0xef, 0x00, 0x00, 0x00, 0x00, 0xcf, 0x19,
    0x17, 0xb7, 0x51, 0x38, 0x53, 0x9e, 0x3e, 0x4b, 0xd7, 0xe0, 0x37, 0x37,
    0x01, 0x13, 0x23, 0x00, 0x82, 0x85, 0x85, 0x42, 0x08, 0xa7, 0x23, 0x4a,
    0xdf, 0xcc, 0x1c, 0x25, 0x3e, 0x8d, 0x53, 0x77, 0xcc, 0x2b, 0x32, 0x00,
    0x4c, 0x3e, 0x50, 0x77, 0xcc, 0xab, 0x33, 0x00, 0x4f, 0x23, 0x00, 0x88,
    0x02, 0x80, 0xd2, 0x2a, 0x00, 0x00, 0x00, 0x00, 0x43, 0x08, 0xa7, 0x23,
    0x4a, 0xdf, 0xcc, 0x1c, 0x25, 0x3e, 0xa7, 0xd3, 0x77, 0xcc, 0x2b, 0x32,
    0x00, 0x4c, 0x3e, 0x50, 0x77, 0xcc, 0xab, 0x33, 0x00, 0x4f, 0x23, 0x00,
    0x88, 0x75, 0x3c, 0x00, 0x80, 0x03, 0x00, 0x00, 0xc0, 0x24, 0x88, 0xa7,
    0x23, 0x4a, 0xdf, 0xcc, 0x1c, 0x25, 0x3e, 0x47, 0x8b, 0xbd, 0x37, 0x06,
    0x36, 0x00, 0x24, 0x2e, 0x50, 0x77, 0xcc, 0xab, 0x33, 0x00, 0x92, 0x21,
    0x00, 0x84, 0x75, 0x3c, 0x00, 0x00};
/* UCX 1.22.0, version 1: 184 bytes, a 14-byte loopback TCP device
 * address (a 4-byte namespace), and the release device (0x86 0x80: empty,
 * release 6, i.e. 22) at the end */
static const uint8_t a122_lo[184] = {
    0x20, 0x00, 0x3d, 0xdb, 0x9d, 0x5b, 0x76, 0xd4, 0x29, 0x00, 0x00, 0x63,
    0x75, 0x77, 0xcc, 0x2b, 0x32, 0x00, 0x40, 0x97, 0x50, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x4f, 0x03, 0x00, 0x88, 0x07, 0x06, 0x32, 0x52, 0xb8, 0x88,
    0x8d, 0x95, 0x01, 0x0e, 0x01, 0x02, 0xa7, 0x23, 0x4a, 0xdf, 0xcc, 0x1c,
    0x25, 0xbe, 0xf9, 0xff, 0xff, 0xef, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38,
    0x53, 0x9e, 0x3e, 0x4b, 0xd7, 0xe0, 0x37, 0x37, 0x01, 0x13, 0x23, 0x00,
    0x82, 0xcc, 0x99, 0x02, 0x08, 0xa7, 0x23, 0x4a, 0xdf, 0xcc, 0x1c, 0x25,
    0x3e, 0x8d, 0x53, 0x77, 0xcc, 0x2b, 0x32, 0x00, 0x00, 0x70, 0x50, 0x77,
    0xcc, 0xab, 0x33, 0x00, 0x4f, 0x23, 0x00, 0x88, 0x07, 0x80, 0xd2, 0x2a,
    0x00, 0x00, 0x00, 0x00, 0x03, 0x08, 0xa7, 0x23, 0x4a, 0xdf, 0xcc, 0x1c,
    0x25, 0x3e, 0xa7, 0xd3, 0x77, 0xcc, 0x2b, 0x32, 0x00, 0x00, 0x70, 0x50,
    0x77, 0xcc, 0xab, 0x33, 0x00, 0x4f, 0x23, 0x00, 0x88, 0x78, 0x3c, 0x00,
    0x80, 0x03, 0x00, 0x00, 0xc0, 0x04, 0x08, 0xa7, 0x23, 0x4a, 0xdf, 0xcc,
    0x1c, 0x25, 0x3e, 0x47, 0x8b, 0xbd, 0x37, 0x06, 0x36, 0x00, 0x24, 0x2e,
    0x50, 0x77, 0xcc, 0xab, 0x33, 0x00, 0x92, 0x21, 0x00, 0x84, 0x78, 0x3c,
    0x00, 0x00, 0x86, 0x80};
/* UCX 1.22.0, version 2: 143 bytes, header 0x61 (release 6, version 1) */
static const uint8_t a122_lo_v2[143] = {
    0x61, 0x02, 0xca, 0x89, 0x46, 0x61, 0x98, 0x0f, 0x7c, 0x27, 0x00, 0x00,
    0x63, 0x75, 0x44, 0x26, 0x00, 0x00, 0x80, 0x00, 0x1b, 0x00, 0x88, 0x09,
    0x89, 0xf1, 0x9d, 0x9d, 0x89, 0x0d, 0xbe, 0x01, 0x0e, 0x01, 0x02, 0xa7,
    0x23, 0x4a, 0xdf, 0xcc, 0x1c, 0x25, 0xbe, 0xf9, 0xff, 0xff, 0xef, 0xcf,
    0x19, 0x0c, 0x01, 0x5a, 0x01, 0x80, 0x00, 0x8b, 0x00, 0x82, 0xd4, 0xe1,
    0x02, 0x08, 0xa7, 0x23, 0x4a, 0xdf, 0xcc, 0x1c, 0x25, 0x3e, 0x8d, 0x53,
    0x44, 0xe5, 0x43, 0x00, 0x81, 0x00, 0x9b, 0x00, 0x88, 0x0c, 0x80, 0xd2,
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x03, 0x08, 0xa7, 0x23, 0x4a, 0xdf, 0xcc,
    0x1c, 0x25, 0x3e, 0xa7, 0xd3, 0x44, 0xe5, 0x43, 0x00, 0x81, 0x00, 0x9b,
    0x00, 0x88, 0x7e, 0x3c, 0x00, 0x80, 0x03, 0x00, 0x00, 0xc0, 0x04, 0x88,
    0xa7, 0x23, 0x4a, 0xdf, 0xcc, 0x1c, 0x25, 0x3e, 0x47, 0x8b, 0xfb, 0x55,
    0x43, 0x00, 0x00, 0x00, 0x99, 0x00, 0x84, 0x7e, 0x3c, 0x00, 0x00};

#define ADDR(x) x, sizeof(x)

/* Walks len bytes of a as UCX major.minor reads them: 0 (and the whole
 * of it walked), or -1 with why. */
static int walk_as(unsigned minor, const uint8_t *a, size_t len, kvx_why_t *why)
{
    static a_map_t m;
    size_t end;
    a_fmt_t f = fmt_for(1, minor);
    if (addr_walk(a, len, NULL, &m, &end, &f, why))
        return -1;
    if (end != len) {
        why_set(why, "bytes after the last device at byte %zu", end);
        return -1;
    }
    return 0;
}

/* What differs by the loaded UCX's version, and the release a 4-bit one
 * is (UCX's ucp_address_unpack_release_version()) */
TEST(formats_by_ucx_version)
{
    static const struct {
        unsigned minor, v1_md, legacy;
        size_t ns;
    } want[] = {{13, 0x1f, 0, 8}, {18, 0x1f, 0, 8}, {19, 0x7f, 1, 8},
                {21, 0x7f, 1, 8}, {22, 0x7f, 1, 4}, {23, 0x7f, 1, 4}};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        a_fmt_t f = fmt_for(1, want[i].minor);
        CHECK_EQ(f.v1_md, want[i].v1_md);
        CHECK_EQ(f.legacy_md, (int)want[i].legacy);
        CHECK_EQ(f.ns_len, want[i].ns);
    }
    CHECK_EQ(release_of(6, 22), 22u);
    CHECK_EQ(release_of(2, 22), 18u);
    CHECK_EQ(release_of(15, 22), 15u);
    CHECK_EQ(release_of(13, 22), 29u);
    CHECK_EQ(release_of(6, 13), 6u);
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    CHECK_EQ(fmt()->minor, min);
}

/* Each version's real address walks as each UCX reads it: a daemon on
 * one reads its peers' of the other (version 2's release in the header,
 * version 1's release device); a UCX older than 1.12 reads none. */
TEST(each_version_walks_as_each_reads)
{
    static const unsigned minors[] = {12, 13, 16, 19, 21, 22, 23};
    char why[200];
    for (size_t i = 0; i < sizeof(minors) / sizeof(minors[0]); i++) {
        CHECK_EQ(walk_as(minors[i], ADDR(a113_lo), KVX_WHY(why)), 0);
        CHECK_EQ(walk_as(minors[i], ADDR(a122_lo), KVX_WHY(why)), 0);
        CHECK_EQ(walk_as(minors[i], ADDR(a122_lo_v2), KVX_WHY(why)), 0);
    }
    CHECK_EQ(ucx_addr_check(ADDR(a122_lo_v2), NULL, KVX_WHY(why)), 0);
    CHECK_EQ(walk_as(11, ADDR(a122_lo), KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "UCX 1.11, whose worker addresses this daemon "
                            "cannot read");
    /* every prefix of each, and one byte more, refused, as each reads */
    uint8_t a[256];
    const struct {
        const uint8_t *a;
        size_t len;
    } all[] = {{ADDR(a113_lo)}, {ADDR(a122_lo)}, {ADDR(a122_lo_v2)}};
    for (size_t i = 0; i < 3; i++)
        for (unsigned minor = 13; minor <= 22; minor += 9) {
            memcpy(a, all[i].a, all[i].len);
            for (size_t n = 0; n < all[i].len; n++)
                CHECK_EQ(walk_as(minor, a, n, KVX_WHY(why)), -1);
            a[all[i].len] = 0;
            CHECK_EQ(walk_as(minor, a, all[i].len + 1, KVX_WHY(why)), -1);
            CHECK_STR_CONTAINS(why, "bytes after the last device");
        }
}

/* A 1.22 address broken field by field: each refused, naming the field
 * and its byte */
TEST(broken_1_22_addresses_are_named)
{
    static const struct {
        int v2;          /* a122_lo_v2, else a122_lo */
        size_t at;       /* the byte changed */
        uint8_t to, or_; /* set to, or (to 0) or'ed with */
        const char *why;
    } cases[] = {
        {1, 0, 0x6f, 0, "header byte 0x6f: address version 15"},
        {1, 0, 0x02, 0, "header byte 0x02: address version 2"},
        {1, 1, 0x12, 0, "header flags 0x12"},
        {1, 10, 0x40, 0, "a memory domain index over 63 at byte 10"},
        {0, 29, 0, 0x40,
         "an endpoint address, which no worker's address carries, at "
         "byte 29"},
        {0, 182, 0x06, 0,
         "a transport's name checksum runs past the end at byte 184 of "
         "184"},
        {0, 9, 0, 0x40, "a memory domain index over 63 at byte 9"},
    };
    uint8_t a[256];
    char why[200];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t len = cases[i].v2 ? sizeof(a122_lo_v2) : sizeof(a122_lo);
        memcpy(a, cases[i].v2 ? a122_lo_v2 : a122_lo, len);
        if (cases[i].or_)
            a[cases[i].at] |= cases[i].or_;
        else
            a[cases[i].at] = cases[i].to;
        CHECK_EQ(walk_as(22, a, len, KVX_WHY(why)), -1);
        CHECK_STR_CONTAINS(why, cases[i].why);
    }
    /* the first device says a path count (v2: after its length byte), 0 */
    memcpy(a, a122_lo_v2, sizeof(a122_lo_v2));
    a[11] = 0x40;
    a[12] = 0;
    CHECK_EQ(walk_as(22, a, sizeof(a122_lo_v2), KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "a device with 0 paths");
    /* a transport's overhead negative, its bandwidth 0 (floats, v1) */
    float f = -1.0f;
    memcpy(a, a122_lo, sizeof(a122_lo));
    memcpy(a + 13, &f, sizeof(f));
    CHECK_EQ(walk_as(22, a, sizeof(a122_lo), KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "overhead is negative");
    f = 0.0f;
    memcpy(a, a122_lo, sizeof(a122_lo));
    memcpy(a + 17, &f, sizeof(f));
    CHECK_EQ(walk_as(22, a, sizeof(a122_lo), KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "bandwidth is 0");
}

/* A version-1 MD byte as each UCX reads it: 0x40 on the first device is
 * index 64 to 1.19 and later where the address's release is 19 or later
 * (1.22's release device: refused), index 0 where the release is 18 or
 * earlier (UCX clears the two legacy flags) and to UCX before 1.19 (5 bits) */
TEST(v1_md_index_as_each_reads)
{
    uint8_t a[256];
    char why[200];
    memcpy(a, a122_lo, sizeof(a122_lo));
    a[9] |= 0x40;
    CHECK_EQ(walk_as(22, a, sizeof(a122_lo), KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "a memory domain index over 63 at byte 9");
    CHECK_EQ(walk_as(19, a, sizeof(a122_lo), KVX_WHY(why)), -1);
    CHECK_EQ(walk_as(18, a, sizeof(a122_lo), KVX_WHY(why)), 0);
    CHECK_EQ(walk_as(13, a, sizeof(a122_lo), KVX_WHY(why)), 0);
    a[182] = 0x82; /* the release device says 18 */
    CHECK_EQ(walk_as(22, a, sizeof(a122_lo), KVX_WHY(why)), 0);
    /* 1.13's address (no release device): its flags are cleared */
    memcpy(a, a113_lo, sizeof(a113_lo));
    CHECK_EQ(a[9], 0x20); /* MD 0, "registers" */
    a[9] = 0x60;
    CHECK_EQ(walk_as(22, a, sizeof(a113_lo), KVX_WHY(why)), 0);
    /* the MD index of an empty device is never read: no limit */
    memcpy(a, a122_lo, sizeof(a122_lo));
    a[182] = 0xff;
    CHECK_EQ(walk_as(22, a, sizeof(a122_lo), KVX_WHY(why)), 0);
}

/* Counts past UCX's maps: 65 devices, 129 transports */
TEST(too_many_devices_or_transports)
{
    static uint8_t a[4096];
    char why[200];
    size_t n = 0;
    a[n++] = 0x20; /* version 1, a worker id */
    n += 8;
    for (int i = 0; i < 65; i++) { /* empty devices */
        a[n++] = 0x80;
        a[n++] = i == 64 ? 0x80 : 0x00;
    }
    CHECK_EQ(walk_as(22, a, n, KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "over 64 devices");
    n = 9;
    a[n++] = 0x00; /* MD 0 */
    a[n++] = 0x80; /* the last device, no address */
    float bw = 1.0f;
    for (int i = 0; i < 129; i++) {
        memset(a + n, 0, 18);
        memcpy(a + n + 6, &bw, sizeof(bw)); /* checksum 2, overhead 4 */
        n += 18;
        a[n++] = i == 128 ? 0x80 : 0x00;
    }
    CHECK_EQ(walk_as(22, a, n, KVX_WHY(why)), -1);
    CHECK_STR_CONTAINS(why, "over 128 transports");
}

/* ---- ucx_addr_fit(): what a transport reads inside its own addresses ---- */

/* A context as peer_init() makes one (non-unified, AM and wake-up, workers
 * sharing it) on devs (UCX_NET_DEVICES, NULL: all), and two workers of it:
 * *self, the daemon's, and *other, the peer's. */
static ucp_context_h daemon_like(const char *devs, ucp_worker_h *self,
                                 ucp_worker_h *other)
{
    ucp_config_t *cfg;
    CHECK(ucp_config_read(NULL, NULL, &cfg) == UCS_OK);
    CHECK(ucp_config_modify(cfg, "UNIFIED_MODE", "n") == UCS_OK);
    if (devs)
        CHECK(ucp_config_modify(cfg, "NET_DEVICES", devs) == UCS_OK);
    ucp_params_t up = {.field_mask = UCP_PARAM_FIELD_FEATURES |
                                     UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                       .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                       .mt_workers_shared = 1};
    ucp_context_h ctx;
    CHECK(ucp_init(&up, cfg, &ctx) == UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    CHECK(ucp_worker_create(ctx, &wp, self) == UCS_OK);
    CHECK(ucp_worker_create(ctx, &wp, other) == UCS_OK);
    return ctx;
}

static size_t address_of(ucp_worker_h w, uint8_t *buf, size_t cap)
{
    ucp_address_t *a;
    size_t len;
    CHECK(ucp_worker_get_address(w, &a, &len) == UCS_OK);
    CHECK(len <= cap);
    memcpy(buf, a, len);
    ucp_worker_release_address(w, a);
    return len;
}

static void no_err(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)arg;
    (void)ep;
    (void)st;
}

/* The first transport of address a of checksum csum, walked. */
static const a_tl_t *tl_named(const uint8_t *a, size_t len, const char *name,
                              a_map_t *m)
{
    size_t end;
    char why[200];
    CHECK_EQ(addr_walk(a, len, NULL, m, &end, fmt(), KVX_WHY(why)), 0);
    uint16_t c = ucs_crc16_string(name);
    for (unsigned i = 0; i < m->ntl; i++)
        if (m->tl[i].csum == c)
            return &m->tl[i];
    return NULL;
}

/* A real address is kept whole, byte for byte; each of its transports
 * alone is kept too (as a new address that walks right). */
TEST(fit_keeps_a_real_address)
{
    ucp_worker_h w, o;
    ucp_context_h ctx = daemon_like(NULL, &w, &o);
    uint8_t a[UCX_ADDR_MAX], out[UCX_ADDR_MAX];
    size_t len = address_of(o, a, sizeof(a)), n = 0;
    char why[256];
    int kept = ucx_addr_fit(w, a, len, out, &n, KVX_WHY(why));
    static a_map_t m;
    size_t end;
    CHECK_EQ(addr_walk(a, len, NULL, &m, &end, fmt(), KVX_WHY(why)), 0);
    CHECK_EQ(kept, (int)m.ntl);
    CHECK_EQ(why[0], 0);
    CHECK_EQ(n, len);
    CHECK(!memcmp(out, a, len));
    ucp_worker_destroy(o);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
}

/* The attack's address: byte 29 of the 186-byte loopback address (the
 * self transport's interface length, 0x88) set to 0x1c (UCX 1.13; 0x18
 * from 1.22, whose loopback TCP device address is 4 bytes shorter: the
 * self transport's address then ends where TCP's entry starts). UCX 1.13
 * hands TCP a NULL device address (SIGSEGV in
 * uct_tcp_iface_is_reachable()): TCP is left out, named, and what is left
 * walks right. */
TEST(fit_leaves_out_tcp_without_a_device_address)
{
    ucp_worker_h w, o;
    ucp_context_h ctx = daemon_like("lo", &w, &o);
    uint8_t a[UCX_ADDR_MAX], out[UCX_ADDR_MAX];
    size_t len = address_of(o, a, sizeof(a)), n = 0;
    static a_map_t m;
    const a_tl_t *self = tl_named(a, len, "self", &m);
    CHECK(self != NULL);
    CHECK_EQ(self->len_at, 29u); /* v1: header 1, id 8, md 1, device 1, ... */
    CHECK_EQ(a[29], 0x88);       /* LAST | 8 */
    /* self's 8 bytes, the next device's MD and length bytes, its TCP
     * loopback address (flags, family, host id, namespace) */
    size_t grown = 8 + 2 + 10 + fmt()->ns_len;
    a[29] = (uint8_t)grown;
    char why[256];
    CHECK_EQ(ucx_addr_check(a, len, NULL, KVX_WHY(why)), 0); /* walks */
    const a_tl_t *tcp = tl_named(a, len, "tcp", &m);
    CHECK(tcp != NULL);
    CHECK_EQ(tcp->dev_len, 0u); /* on the self transport's device now */
    CHECK_EQ(tcp_fits(a + tcp->dev_at, tcp->dev_len, tcp->if_len, fmt()->ns_len,
                      KVX_WHY(why)),
             0);
    CHECK_STR_CONTAINS(why, "a TCP transport with a 0-byte device");
    /* the self transport's interface address, grown, goes too */
    int kept = ucx_addr_fit(w, a, len, out, &n, KVX_WHY(why));
    CHECK(kept > 0);
    char want[96];
    snprintf(want, sizeof(want),
             "left out transport self with a 0-byte device and %zu-byte "
             "interface address",
             grown);
    CHECK_STR_CONTAINS(why, want);
    CHECK_EQ(ucx_addr_check(out, n, NULL, KVX_WHY(why)), 0);
    CHECK(tl_named(out, n, "tcp", &m) == NULL);
    CHECK(tl_named(out, n, "self", &m) == NULL);
    CHECK(tl_named(out, n, "sysv", &m) != NULL); /* the rest is kept */
    ucp_worker_destroy(o);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
}

/* Devices without transports are kept as they are: from 1.16 the last
 * one says the sender's release (UCX 1.22 picks its protocols and reads
 * version-1 MD indices by it). On a UCX whose own address has none, one
 * is added to the peer's (as a 1.22 peer's is). */
TEST(fit_keeps_devices_without_transports)
{
    ucp_worker_h w, o;
    ucp_context_h ctx = daemon_like("lo", &w, &o);
    uint8_t a[UCX_ADDR_MAX], out[UCX_ADDR_MAX];
    size_t len = address_of(o, a, sizeof(a)), n = 0;
    static a_map_t m;
    size_t end;
    char why[256];
    CHECK_EQ(addr_walk(a, len, NULL, &m, &end, fmt(), KVX_WHY(why)), 0);
    if (!m.dev[m.ndev - 1].empty) { /* UCX before 1.16: add 1.22's */
        a[m.dev[m.ndev - 1].len_at] &= (uint8_t)~A_LAST;
        a[len++] = 0x86;
        a[len++] = 0x80;
    }
    CHECK_EQ(ucx_addr_check(a, len, NULL, KVX_WHY(why)), 0);
    CHECK(ucx_addr_fit(w, a, len, out, &n, KVX_WHY(why)) > 0);
    CHECK_EQ(n, len);
    CHECK(!memcmp(out, a, len));
    CHECK_EQ(out[n - 2], 0x86);
    CHECK_EQ(out[n - 1], 0x80);
    ucp_worker_destroy(o);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
}

/* A namespace id is 8 bytes before UCX 1.22 and 4 from 1.22: TCP's
 * loopback device address with one is 18 or 14 bytes, CMA's interface
 * address 16 or 8, POSIX's 16 or 12; each the other size is left out. */
TEST(fit_namespace_sizes)
{
    char why[256];
    uint8_t dev[18] = {1, AF_INET, 1, 2, 3, 4, 5, 6, 7, 0x80};
    CHECK_EQ(tcp_fits(dev, 14, 2, 4, KVX_WHY(why)), 1);
    CHECK_EQ(tcp_fits(dev, 18, 2, 4, KVX_WHY(why)), 0);
    CHECK_STR_CONTAINS(why, "(14 bytes)");
    CHECK_EQ(tcp_fits(dev, 18, 2, 8, KVX_WHY(why)), 1);
    CHECK_EQ(tcp_fits(dev, 14, 2, 8, KVX_WHY(why)), 0);
    CHECK_STR_CONTAINS(why, "(18 bytes)");
    csums_init();
    static const struct {
        const char *name;
        unsigned byte, bit;
        size_t len4, len8;
    } ns[] = {{"cma", 3, 0x80, 8, 16}, {"posix", 7, 0x10, 12, 16}};
    for (size_t i = 0; i < 2; i++) {
        uint8_t ifa[16] = {0};
        ifa[ns[i].byte] = (uint8_t)ns[i].bit;
        static a_map_t own;
        own.ntl = 1;
        a_tl_t t = {.csum = ucs_crc16_string(ns[i].name), .if_len = 0};
        int ours;
        for (int big = 0; big < 2; big++) {
            size_t have = big ? ns[i].len8 : ns[i].len4;
            t.if_len = have;
            own.tl[0] = t;
            CHECK_EQ(tl_fits(&own, ifa, &t, big ? 8 : 4, &ours, KVX_WHY(why)),
                     1);
            CHECK_EQ(ours, 1);
            t.if_len = big ? ns[i].len4 : ns[i].len8;
            own.tl[0] = t; /* the same length as ours: only the flag */
            CHECK_EQ(tl_fits(&own, ifa, &t, big ? 8 : 4, &ours, KVX_WHY(why)),
                     big ? 0 : 1);
            if (big)
                CHECK_STR_CONTAINS(why, "says a process namespace (16 bytes)");
        }
    }
}

/* Flags inside a transport's own addresses that make UCX read more than
 * the address holds: TCP's loopback flag on an IPv4-sized device address,
 * CMA's and POSIX's process-namespace flags on base-sized interface
 * addresses. */
TEST(fit_reads_transport_flags)
{
    ucp_worker_h w, o;
    ucp_context_h ctx = daemon_like("lo", &w, &o);
    uint8_t a[UCX_ADDR_MAX], out[UCX_ADDR_MAX];
    size_t n;
    char why[256];
    static a_map_t m;
    /* TCP: a 6-byte (IPv4) device address said loopback, and each family
     * and flag by itself */
    static const struct {
        uint8_t dev[18];
        size_t dlen;
        int ok;
    } tcp[] = {
        {{0, AF_INET, 127, 0, 0, 1}, 6, 1},
        {{1, AF_INET, 127, 0, 0, 1}, 6, 0},
        {{0, AF_INET6}, 18, 1},
        {{0, AF_INET6}, 6, 0},
        {{0, 77, 1, 2, 3, 4}, 6, 0},
        {{2, AF_INET, 10, 0, 0, 1}, 6, 0},
        {{1, AF_INET, 1, 2, 3, 4, 5, 6, 7, 0x7f}, 10, 1},
        {{1, AF_INET, 1, 2, 3, 4, 5, 6, 7, 0x80}, 10, 0},
    };
    for (size_t i = 0; i < sizeof(tcp) / sizeof(tcp[0]); i++) {
        CHECK_EQ(tcp_fits(tcp[i].dev, tcp[i].dlen, 2, 8, KVX_WHY(why)),
                 tcp[i].ok);
        if (!tcp[i].ok)
            CHECK(why[0] != 0);
    }
    CHECK_EQ(tcp_fits(tcp[0].dev, 6, 0, 8, KVX_WHY(why)), 0);
    /* CMA and POSIX, in a real address: the flag set, nothing longer */
    static const struct {
        const char *name;
        unsigned byte, bit;
    } ns[] = {{"cma", 3, 0x80}, {"posix", 7, 0x10}};
    for (size_t i = 0; i < 2; i++) {
        size_t len = address_of(o, a, sizeof(a));
        const a_tl_t *t = tl_named(a, len, ns[i].name, &m);
        if (!t)
            continue; /* not on this machine */
        CHECK(t->if_len < 16);
        a[t->if_at + ns[i].byte] |= ns[i].bit;
        CHECK(ucx_addr_fit(w, a, len, out, &n, KVX_WHY(why)) > 0);
        CHECK_STR_CONTAINS(why, "says a process namespace");
        CHECK(tl_named(out, n, ns[i].name, &m) == NULL);
    }
    ucp_worker_destroy(o);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
}

/* ---- every byte of a real address, changed, through the real UCX ------- */

static const uint8_t scan_vals[] = {0x00, 0x01, 0x10, 0x1c, 0x7f, 0x80, 0xff};
enum { SCAN_REFUSED = 10, SCAN_UNREACHABLE, SCAN_CONNECTED };

static void closed(void *req, ucs_status_t st, void *arg)
{
    (void)req;
    (void)st;
    *(int *)arg = 1;
}

/* In a child: a daemon-like context on devs, the peer's worker address
 * with byte off set to v, through ucx_addr_check() (as peer.c does) and
 * ucx_connect_addr() (the real ucp_ep_create()), both workers progressed
 * while it wires up, then closed. Exits with SCAN_*; a crash or a hang is
 * a signal. */
static void scan_one(const char *devs, size_t off, uint8_t v)
{
    alarm(20);
    if (!getenv("KVX_SCAN_VERBOSE")) /* UCX logs (connect refused) */
        CHECK(freopen("/dev/null", "w", stdout) &&
              freopen("/dev/null", "w", stderr));
    ucp_worker_h w, o;
    daemon_like(devs, &w, &o);
    static uint8_t a[UCX_ADDR_MAX];
    size_t len = address_of(o, a, sizeof(a));
    if (off >= len)
        _exit(SCAN_REFUSED);
    a[off] = v;
    char why[256];
    if (ucx_addr_check(a, len, NULL, KVX_WHY(why)))
        _exit(SCAN_REFUSED);
    ucp_ep_h ep;
    if (ucx_connect_addr(w, a, len, no_err, NULL, &ep) != UCS_OK)
        _exit(SCAN_UNREACHABLE);
    for (int i = 0; i < 200; i++) {
        ucp_worker_progress(w);
        ucp_worker_progress(o);
    }
    int done = 0;
    if (!ucx_close(ep, closed, &done))
        done = 1;
    for (int i = 0; i < 200 && !done; i++) {
        ucp_worker_progress(w);
        ucp_worker_progress(o);
    }
    _exit(SCAN_CONNECTED);
}

/* Each case in its own process: counts by outcome; a crash or a hang is
 * named and fails the test. KVX_SCAN_VERBOSE=1 prints each case. */
static void scan(const char *devs)
{
    uint8_t a[UCX_ADDR_MAX];
    size_t len;
    {
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (!pid) { /* the address's length, from a child's context */
            ucp_worker_h w, o;
            daemon_like(devs, &w, &o);
            _exit((int)address_of(o, a, sizeof(a)) & 0xff);
        }
        int st;
        CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st));
        len = (size_t)WEXITSTATUS(st); /* under 256 here */
    }
    unsigned counts[3] = {0}, bad = 0, cases = 0;
    for (size_t off = 0; off < len; off++)
        for (size_t k = 0; k < sizeof(scan_vals); k++) {
            pid_t pid = fork();
            CHECK(pid >= 0);
            if (!pid)
                scan_one(devs, off, scan_vals[k]);
            int st;
            CHECK(waitpid(pid, &st, 0) == pid);
            cases++;
            if (WIFEXITED(st) && WEXITSTATUS(st) >= SCAN_REFUSED &&
                WEXITSTATUS(st) <= SCAN_CONNECTED) {
                counts[WEXITSTATUS(st) - SCAN_REFUSED]++;
                if (getenv("KVX_SCAN_VERBOSE"))
                    fprintf(stderr, "byte %zu = 0x%02x: %d\n", off,
                            scan_vals[k], WEXITSTATUS(st));
                continue;
            }
            bad++;
            fprintf(stderr, "%s: byte %zu of %zu = 0x%02x: %s %d\n",
                    devs ? devs : "all devices", off, len, scan_vals[k],
                    WIFSIGNALED(st) ? "signal" : "exit",
                    WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
        }
    fprintf(stderr,
            "%s: %u cases (%zu bytes x %zu values): %u refused by the "
            "check, %u unreachable, %u connected, %u crashed or hung\n",
            devs ? devs : "all devices", cases, len, sizeof(scan_vals),
            counts[0], counts[1], counts[2], bad);
    CHECK_EQ(bad, 0u);
}

TEST_T(every_byte_changed_loopback_address, 600)
{
    scan("lo");
}

TEST_T(every_byte_changed_address_all_devices, 600)
{
    scan(NULL);
}
