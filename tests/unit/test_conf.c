/*
 * test_conf — the key table, the YAML loader and its messages, reload, the
 * generated docs. Includes conf.c to reach the table and its helpers. Runs
 * from the repository root (config/ and docs/ are read from there).
 */
#include "../../daemon/core/conf.c"
#include "../../daemon/core/log.h"

#include "tests/test.h"

#include <grp.h>
#include <stdint.h>

#define EXAMPLE "config/kvxferd.yaml"
#define DOCS "docs/configuration.md"

/* ---- helpers ---- */

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;

    CHECK(f != NULL);
    CHECK(fseek(f, 0, SEEK_END) == 0);
    n = ftell(f);
    CHECK(n >= 0);
    rewind(f);
    buf = malloc((size_t)n + 1);
    CHECK(buf != NULL);
    CHECK(fread(buf, 1, (size_t)n, f) == (size_t)n);
    buf[n] = '\0';
    fclose(f);
    if (len)
        *len = (size_t)n;
    return buf;
}

/* Replace every occurrence of from in s (freed) by to. */
static char *replace_all(char *s, const char *from, const char *to)
{
    size_t fl = strlen(from), tl = strlen(to), n = 0;
    char *out, *o;
    const char *p;

    for (p = s; (p = strstr(p, from)); p += fl)
        n++;
    out = malloc(strlen(s) + n * tl + 1);
    CHECK(out != NULL);
    o = out;
    for (p = s;;) {
        const char *q = strstr(p, from);
        if (!q) {
            strcpy(o, p);
            break;
        }
        memcpy(o, p, (size_t)(q - p));
        o += q - p;
        memcpy(o, to, tl);
        o += tl;
        p = q + fl;
    }
    free(s);
    return out;
}

static char tmp_path[64];

static void tmp_write(const void *text, size_t len)
{
    FILE *f;
    if (!tmp_path[0]) {
        int fd;
        snprintf(tmp_path, sizeof(tmp_path), "/tmp/kvx_test_conf_XXXXXX");
        fd = mkstemp(tmp_path);
        CHECK(fd >= 0);
        close(fd);
    }
    f = fopen(tmp_path, "wb");
    CHECK(f != NULL);
    CHECK(fwrite(text, 1, len, f) == len);
    CHECK(fclose(f) == 0);
}

/* Load text from a temp file; *err gets the messages with the file's
 * name replaced by "F" so that expected texts can be literal. */
static int load_bytes(const void *text, size_t len, kvx_conf_t *conf,
                      char **err)
{
    char *buf = NULL;
    size_t blen = 0;
    FILE *mem = open_memstream(&buf, &blen);
    int rc;

    CHECK(mem != NULL);
    tmp_write(text, len);
    rc = conf_load(tmp_path, conf, mem);
    CHECK(fclose(mem) == 0);
    buf = replace_all(buf, tmp_path, "F");
    if (err)
        *err = buf;
    else
        free(buf);
    return rc;
}

static int load_text(const char *text, kvx_conf_t *conf, char **err)
{
    return load_bytes(text, strlen(text), conf, err);
}

/* The whole error output must be exactly want, and rc the problem count. */
static void expect_errors(const char *yaml, int want_rc, const char *want)
{
    kvx_conf_t c, before;
    char *err;
    int rc;

    memset(&c, 0x5a, sizeof(c));
    memcpy(&before, &c, sizeof(c));
    rc = load_text(yaml, &c, &err);
    if (strcmp(err, want)) {
        fprintf(stderr, "got:\n%s\nwant:\n%s\n", err, want);
        CHECK(!"error text differs");
    }
    CHECK_EQ(rc, want_rc);
    /* *conf is only written when there are no problems. */
    CHECK(!memcmp(&c, &before, sizeof(c)));
    free(err);
    unlink(tmp_path);
}

/* Load a file that must be good, over garbage. */
static void load_ok(const char *yaml, kvx_conf_t *c)
{
    char *err;
    memset(c, 0xa5, sizeof(*c));
    int rc = load_text(yaml, c, &err);
    if (rc != 0 || err[0])
        fprintf(stderr, "unexpected problems (%d):\n%s", rc, err);
    CHECK_EQ(rc, 0);
    CHECK_EQ(err[0], '\0');
    free(err);
    unlink(tmp_path);
}

static void check_equal_per_field(const kvx_conf_t *a, const kvx_conf_t *b)
{
    CHECK(!strcmp(a->socket_path, b->socket_path));
    CHECK_EQ(a->socket_mode, b->socket_mode);
    CHECK(!strcmp(a->socket_group, b->socket_group));
    CHECK_EQ(a->num_allowed_uids, b->num_allowed_uids);
    CHECK(!memcmp(a->allowed_uids, b->allowed_uids,
                  a->num_allowed_uids * sizeof(uint32_t)));
    CHECK_EQ(a->num_allowed_gids, b->num_allowed_gids);
    CHECK(!memcmp(a->allowed_gids, b->allowed_gids,
                  a->num_allowed_gids * sizeof(uint32_t)));
    CHECK_EQ(a->max_frame_bytes, b->max_frame_bytes);
    CHECK_EQ(a->hello_frame_bytes, b->hello_frame_bytes);
    CHECK_EQ(a->max_sessions, b->max_sessions);
    CHECK_EQ(a->max_requests, b->max_requests);
    CHECK_EQ(a->max_pools, b->max_pools);
    CHECK_EQ(a->max_blocks_per_request, b->max_blocks_per_request);
    CHECK_EQ(a->worker_threads, b->worker_threads);
    CHECK_EQ(a->copy_chunk_bytes, b->copy_chunk_bytes);
    CHECK_EQ(a->max_inflight_chunks, b->max_inflight_chunks);
    CHECK_EQ(a->offer_lease_ms, b->offer_lease_ms);
    CHECK_EQ(a->offer_lease_max_ms, b->offer_lease_max_ms);
    CHECK_EQ(a->fetch_timeout_ms, b->fetch_timeout_ms);
    CHECK_EQ(a->poll_timeout_max_ms, b->poll_timeout_max_ms);
    CHECK_EQ(a->drain_timeout_ms, b->drain_timeout_ms);
    CHECK_EQ(a->deadline_tick_ms, b->deadline_tick_ms);
    CHECK_EQ(a->log_level, b->log_level);
}

/* Every value of a loaded config obeys the table. */
static void check_valid(const kvx_conf_t *c)
{
    for (size_t i = 0; i < conf_nkeys; i++) {
        const struct conf_key *k = &conf_keys[i];
        switch (k->type) {
        case CONF_STRING:
        case CONF_PATH:
            CHECK(memchr(str_get(c, k), '\0', k->size) != NULL);
            if (k->type == CONF_PATH)
                CHECK_EQ(str_get(c, k)[0], '/');
            break;
        case CONF_IDS: {
            unsigned n;
            memcpy(&n, (const char *)c + k->count_off, sizeof(n));
            CHECK(n <= ids_cap(k));
            for (unsigned j = 0; j < n; j++)
                CHECK(ids_const(c, k)[j] <= k->max);
            break;
        }
        default:
            CHECK(num_get(c, k) >= k->min && num_get(c, k) <= k->max);
            break;
        }
    }
    CHECK(c->hello_frame_bytes <= c->max_frame_bytes);
}

/* ---- defaults and the table ---- */

TEST(defaults_sane)
{
    kvx_conf_t c;
    memset(&c, 0xff, sizeof(c));
    conf_defaults(&c);
    CHECK(!strcmp(c.socket_path, "/run/kvxfer/kvxferd.sock"));
    CHECK_EQ(c.socket_mode, 0660);
    CHECK(!strcmp(c.socket_group, ""));
    CHECK_EQ(c.num_allowed_uids, 0);
    CHECK_EQ(c.num_allowed_gids, 0);
    CHECK_EQ(c.max_frame_bytes, 16u << 20);
    CHECK_EQ(c.hello_frame_bytes, 4096);
    CHECK_EQ(c.max_sessions, 1024);
    CHECK_EQ(c.max_requests, 65536);
    CHECK_EQ(c.max_pools, 256);
    CHECK_EQ(c.max_blocks_per_request, 1048576);
    CHECK_EQ(c.worker_threads, 0);
    CHECK_EQ(c.copy_chunk_bytes, 4u << 20);
    CHECK_EQ(c.max_inflight_chunks, 0);
    CHECK_EQ(c.offer_lease_ms, 30000);
    CHECK_EQ(c.fetch_timeout_ms, 30000);
    CHECK_EQ(c.poll_timeout_max_ms, 60000);
    CHECK_EQ(c.drain_timeout_ms, 5000);
    CHECK_EQ(c.deadline_tick_ms, 10);
    CHECK_EQ(c.log_level, LOG_INFO);
    /* The defaults pass the loader's own rules. */
    check_valid(&c);
    for (size_t i = 0; i < conf_nkeys; i++) {
        if (conf_keys[i].check) {
            char why[256];
            CHECK_EQ(conf_keys[i].check(&c, KVX_WHY(why)), 0);
        }
    }
    /* Fully written: no byte depends on what was there before. */
    kvx_conf_t z;
    memset(&z, 0, sizeof(z));
    conf_defaults(&z);
    CHECK(!memcmp(&c, &z, sizeof(c)));
}

TEST(table_sane)
{
    static const char *const names[] = {"socket.path",
                                        "socket.mode",
                                        "socket.group",
                                        "auth.allowed_uids",
                                        "auth.allowed_gids",
                                        "auth.admin_gids",
                                        "limits.max_frame_bytes",
                                        "limits.hello_frame_bytes",
                                        "limits.max_sessions",
                                        "limits.uid_sessions",
                                        "limits.hello_sessions",
                                        "limits.max_requests",
                                        "limits.max_pools",
                                        "limits.memory_bytes",
                                        "limits.uid_memory_bytes",
                                        "limits.batches_kept",
                                        "limits.max_blocks_per_request",
                                        "limits.session_queue_bytes",
                                        "limits.session_requests",
                                        "limits.list_page_entries",
                                        "limits.aux_bytes",
                                        "copy.worker_threads",
                                        "copy.pin_threads",
                                        "copy.chunk_bytes",
                                        "copy.max_inflight_chunks",
                                        "copy.spin_us",
                                        "copy.inline_bytes",
                                        "copy.pace",
                                        "copy.busy_poll",
                                        "gpu.max_ctas",
                                        "gpu.spin_us",
                                        "gpu.event_poll_us",
                                        "gpu.chunk_bytes",
                                        "gpu.staging_bytes",
                                        "gpu.copy_path",
                                        "gpu.dma_min_run",
                                        "gpu.dma_min_run_host",
                                        "gpu.sm_share",
                                        "gpu.stream_priority",
                                        "gpu.pace",
                                        "peer.listen",
                                        "peer.secret_file",
                                        "peer.secret_previous_ms",
                                        "peer.net_devices",
                                        "peer.ucx_ports",
                                        "peer.allowed",
                                        "peer.keepalive_interval_ms",
                                        "peer.keepalive_timeout_ms",
                                        "peer.connect_timeout_ms",
                                        "peer.slot_bytes",
                                        "peer.slots",
                                        "peer.message_bytes",
                                        "peer.send_window",
                                        "peer.lanes",
                                        "peer.direct",
                                        "peer.busy_poll",
                                        "peer.gather_ahead",
                                        "peer.topology",
                                        "peer.rails",
                                        "peer.gpu_rails",
                                        "peer.sysfs_root",
                                        "deadlines.offer_lease_ms",
                                        "deadlines.offer_lease_max_ms",
                                        "deadlines.fetch_timeout_ms",
                                        "deadlines.poll_timeout_max_ms",
                                        "deadlines.drain_timeout_ms",
                                        "deadlines.deadline_tick_ms",
                                        "deadlines.hello_timeout_ms",
                                        "deadlines.session_idle_ms",
                                        "deadlines.reply_stall_ms",
                                        "log.level",
                                        "log.trace_file",
                                        "log.format",
                                        "records.ring",
                                        "records.file",
                                        "records.max_bytes",
                                        "records.keep",
                                        "metrics.listen",
                                        "metrics.publish_ms",
                                        "metrics.health_max_lag_ms"};
    static const char *const reloadable[] = {"limits.memory_bytes",
                                             "limits.uid_memory_bytes",
                                             "limits.session_queue_bytes",
                                             "limits.session_requests",
                                             "limits.list_page_entries",
                                             "limits.aux_bytes",
                                             "copy.chunk_bytes",
                                             "copy.max_inflight_chunks",
                                             "copy.pace",
                                             "gpu.max_ctas",
                                             "gpu.chunk_bytes",
                                             "gpu.dma_min_run",
                                             "gpu.dma_min_run_host",
                                             "gpu.pace",
                                             "peer.secret_previous_ms",
                                             "peer.keepalive_interval_ms",
                                             "peer.keepalive_timeout_ms",
                                             "peer.connect_timeout_ms",
                                             "deadlines.offer_lease_ms",
                                             "deadlines.offer_lease_max_ms",
                                             "deadlines.fetch_timeout_ms",
                                             "deadlines.poll_timeout_max_ms",
                                             "deadlines.drain_timeout_ms",
                                             "deadlines.deadline_tick_ms",
                                             "deadlines.hello_timeout_ms",
                                             "deadlines.session_idle_ms",
                                             "deadlines.reply_stall_ms",
                                             "log.level",
                                             "log.format",
                                             "records.file",
                                             "records.max_bytes",
                                             "records.keep",
                                             "metrics.publish_ms",
                                             "metrics.health_max_lag_ms"};
    /* Every member of kvx_conf_t; each must belong to some key. */
    static const struct {
        size_t off, size;
    } members[] = {
#define M(f) {offsetof(kvx_conf_t, f), sizeof(((kvx_conf_t *)0)->f)}
        M(socket_path),
        M(socket_mode),
        M(socket_group),
        M(allowed_uids),
        M(num_allowed_uids),
        M(allowed_gids),
        M(num_allowed_gids),
        M(admin_gids),
        M(num_admin_gids),
        M(max_frame_bytes),
        M(hello_frame_bytes),
        M(max_sessions),
        M(uid_sessions),
        M(hello_sessions),
        M(max_requests),
        M(max_pools),
        M(max_blocks_per_request),
        M(memory_bytes),
        M(uid_memory_bytes),
        M(batches_kept),
        M(aux_bytes),
        M(session_queue_bytes),
        M(session_requests),
        M(list_page_entries),
        M(worker_threads),
        M(copy_pin_threads),
        M(copy_chunk_bytes),
        M(max_inflight_chunks),
        M(spin_us),
        M(copy_inline_bytes),
        M(copy_pace),
        M(copy_busy_poll),
        M(gpu_max_ctas),
        M(gpu_spin_us),
        M(gpu_event_poll_us),
        M(gpu_chunk_bytes),
        M(gpu_staging_bytes),
        M(gpu_copy_path),
        M(gpu_dma_min_run),
        M(gpu_dma_min_run_host),
        M(gpu_sm_share),
        M(gpu_stream_priority),
        M(gpu_pace),
        M(peer_listen),
        M(peer_secret_file),
        M(peer_secret_previous_ms),
        M(peer_net_devices),
        M(peer_ucx_ports),
        M(peer_allowed),
        M(keepalive_interval_ms),
        M(keepalive_timeout_ms),
        M(peer_connect_timeout_ms),
        M(slot_bytes),
        M(slots),
        M(message_bytes),
        M(send_window),
        M(lanes),
        M(direct),
        M(busy_poll),
        M(gather_ahead),
        M(peer_topology),
        M(peer_rails),
        M(peer_gpu_rails),
        M(peer_sysfs_root),
        M(offer_lease_ms),
        M(offer_lease_max_ms),
        M(fetch_timeout_ms),
        M(poll_timeout_max_ms),
        M(drain_timeout_ms),
        M(deadline_tick_ms),
        M(hello_timeout_ms),
        M(session_idle_ms),
        M(reply_stall_ms),
        M(log_level),
        M(log_trace_file),
        M(log_format),
        M(records_ring),
        M(records_file),
        M(records_max_bytes),
        M(records_keep),
        M(metrics_listen),
        M(metrics_publish_ms),
        M(metrics_health_max_lag_ms),
#undef M
    };

    CHECK_EQ(conf_nkeys, sizeof(names) / sizeof(names[0]));
    for (size_t i = 0; i < conf_nkeys; i++) {
        const struct conf_key *k = &conf_keys[i];
        int rl = 0;
        CHECK(!strcmp(k->name, names[i]));
        CHECK(strchr(k->name, '.') == strrchr(k->name, '.'));
        CHECK(strchr(k->name, '.') != NULL);
        /* A section's keys are together: the loader relies on it. */
        if (i && !section_is(&conf_keys[i - 1], k->name, section_len(k->name)))
            for (size_t j = 0; j < i; j++)
                CHECK(
                    !section_is(&conf_keys[j], k->name, section_len(k->name)));
        CHECK(k->help && k->help[0]);
        CHECK(!strchr(k->help, '|') && !strchr(k->help, '\n'));
        CHECK(type_names[k->type] != NULL);
        for (size_t j = 0; j < sizeof(reloadable) / sizeof(*reloadable); j++)
            rl |= !strcmp(k->name, reloadable[j]);
        CHECK_EQ(k->reloadable, rl);
        CHECK(k->min <= k->max);
        if (k->type == CONF_STRING || k->type == CONF_PATH) {
            CHECK(k->def_str != NULL && strlen(k->def_str) < k->size);
        } else if (k->type == CONF_IDS) {
            CHECK_EQ(ids_cap(k), CONF_MAX_IDS);
            CHECK(k->max <= UINT32_MAX);
        } else {
            CHECK(k->size == 4 || k->size == 8);
            if (k->size == 4)
                CHECK(k->max <= UINT32_MAX);
            CHECK(k->def >= k->min && k->def <= k->max);
        }
        CHECK(k->off + k->size <= sizeof(kvx_conf_t));
    }
    for (size_t m = 0; m < sizeof(members) / sizeof(members[0]); m++) {
        int covered = 0;
        for (size_t i = 0; i < conf_nkeys; i++) {
            covered |= conf_keys[i].off == members[m].off &&
                       conf_keys[i].size == members[m].size;
            covered |= conf_keys[i].type == CONF_IDS &&
                       conf_keys[i].count_off == members[m].off;
        }
        if (!covered)
            fprintf(stderr, "member at offset %zu has no key\n",
                    members[m].off);
        CHECK(covered);
    }
}

TEST(log_levels)
{
    static const char *const names[] = {"error", "warning", "notice", "info",
                                        "debug"};
    static const int prio[] = {LOG_ERR, LOG_WARNING, LOG_NOTICE, LOG_INFO,
                               LOG_DEBUG};
    for (int i = 0; i < 5; i++) {
        CHECK_EQ(conf_log_level_parse(names[i]), prio[i]);
        CHECK(!strcmp(conf_log_level_name(prio[i]), names[i]));
    }
    CHECK_EQ(conf_log_level_parse("verbose"), -1);
    CHECK_EQ(conf_log_level_parse("INFO"), -1);
    CHECK_EQ(conf_log_level_parse(""), -1);
    CHECK_EQ(conf_log_level_parse(NULL), -1);
    CHECK(!strcmp(conf_log_level_name(LOG_EMERG), "unknown"));
}

/* ---- loading good files ---- */

TEST(example_equals_defaults)
{
    kvx_conf_t def, c;
    char *err = NULL, *text;
    size_t elen = 0;
    FILE *mem = open_memstream(&err, &elen);

    CHECK(mem != NULL);
    conf_defaults(&def);
    memset(&c, 0x33, sizeof(c));
    CHECK_EQ(conf_load(EXAMPLE, &c, mem), 0);
    fclose(mem);
    CHECK_EQ(elen, 0);
    free(err);
    check_equal_per_field(&c, &def);
    CHECK(!memcmp(&c, &def, sizeof(c)));

    /* The example spells out every key, each under a comment. */
    text = read_all(EXAMPLE, NULL);
    for (size_t i = 0; i < conf_nkeys; i++) {
        char sec[64], key[80];
        const char *s, *kl, *prev;
        size_t sl = section_len(conf_keys[i].name);
        snprintf(sec, sizeof(sec), "\n%.*s:\n", (int)sl, conf_keys[i].name);
        snprintf(key, sizeof(key), "\n  %s:", conf_keys[i].name + sl + 1);
        s = strstr(text, sec);
        CHECK(s != NULL);
        kl = strstr(s, key);
        if (!kl)
            fprintf(stderr, "%s missing from the example\n", conf_keys[i].name);
        CHECK(kl != NULL);
        /* kl is the '\n' ending the line above the key: a comment. */
        for (prev = kl - 1; prev > text && prev[-1] != '\n'; prev--)
            ;
        CHECK(!strncmp(prev, "  #", 3));
    }
    free(text);
}

TEST(empty_file_is_defaults)
{
    static const char *const empties[] = {
        "",    "\n",        "# only a comment\n", "---\n", "---\n...\n",
        "~\n", "socket:\n", "socket:\ncopy: ~\n", "{}\n"};
    kvx_conf_t def, c;

    conf_defaults(&def);
    for (size_t i = 0; i < sizeof(empties) / sizeof(empties[0]); i++) {
        load_ok(empties[i], &c);
        CHECK(!memcmp(&c, &def, sizeof(c)));
    }
}

TEST(values_load)
{
    kvx_conf_t c;
    load_ok("socket:\n"
            "  path: \"/tmp/k v.sock\"\n"
            "  mode: 0600\n"
            "  group: kvxfer\n"
            "auth:\n"
            "  allowed_uids: [1000, 0, 4294967294]\n"
            "  allowed_gids:\n"
            "    - 27\n"
            "    - 100\n"
            "limits:\n"
            "  max_frame_bytes: 1GiB\n"
            "  hello_frame_bytes: 256\n"
            "  max_sessions: 65536\n"
            "  max_requests: 1\n"
            "  max_pools: 4096\n"
            "  max_blocks_per_request: 16777216\n"
            "copy:\n"
            "  worker_threads: 256\n"
            "  chunk_bytes: 1GiB\n"
            "  max_inflight_chunks: 4096\n"
            "deadlines:\n"
            "  offer_lease_ms: 86400000\n"
            "  fetch_timeout_ms: 1\n"
            "  poll_timeout_max_ms: 0\n"
            "  drain_timeout_ms: 600000\n"
            "  deadline_tick_ms: 1000\n"
            "log:\n"
            "  level: debug\n",
            &c);
    CHECK(!strcmp(c.socket_path, "/tmp/k v.sock"));
    CHECK_EQ(c.socket_mode, 0600);
    CHECK(!strcmp(c.socket_group, "kvxfer"));
    CHECK_EQ(c.num_allowed_uids, 3);
    CHECK_EQ(c.allowed_uids[0], 1000);
    CHECK_EQ(c.allowed_uids[1], 0);
    CHECK_EQ(c.allowed_uids[2], 4294967294u);
    CHECK_EQ(c.num_allowed_gids, 2);
    CHECK_EQ(c.allowed_gids[0], 27);
    CHECK_EQ(c.allowed_gids[1], 100);
    CHECK_EQ(c.max_frame_bytes, 1u << 30);
    CHECK_EQ(c.hello_frame_bytes, 256);
    CHECK_EQ(c.max_sessions, 65536);
    CHECK_EQ(c.max_requests, 1);
    CHECK_EQ(c.max_pools, 4096);
    CHECK_EQ(c.max_blocks_per_request, 16777216);
    CHECK_EQ(c.worker_threads, 256);
    CHECK_EQ(c.copy_chunk_bytes, 1ull << 30);
    CHECK_EQ(c.max_inflight_chunks, 4096);
    CHECK_EQ(c.offer_lease_ms, 86400000);
    CHECK_EQ(c.fetch_timeout_ms, 1);
    CHECK_EQ(c.poll_timeout_max_ms, 0);
    CHECK_EQ(c.drain_timeout_ms, 600000);
    CHECK_EQ(c.deadline_tick_ms, 1000);
    CHECK_EQ(c.log_level, LOG_DEBUG);
}

TEST(sizes_with_suffixes)
{
    static const struct {
        const char *text;
        uint64_t want;
    } good[] = {
        {"4096", 4096},
        {"4KiB", 4096},
        {"8KiB", 8192},
        {"16MiB", 16ull << 20},
        {"\"16MiB\"", 16ull << 20},
        {"16 MiB", 16ull << 20},
        {"1GiB", 1ull << 30},
        {"1024MiB", 1ull << 30},
        {"1048576KiB", 1ull << 30},
        {"5000", 5000},
    };
    static const char *const bad[] = {"16MB",    "16k",   "16KB",      "1.5GiB",
                                      "0x1000",  "\"\"",  "\"4KiB \"", "KiB",
                                      "16  MiB", "16mib", "+4096",     "4_096"};
    static const char *const range[] = {
        "4095",          "1025MiB",
        "2GiB",          "0",
        "-4KiB",         "99999999999999999999GiB",
        "17179869184GiB"};
    char yaml[128], *err;
    kvx_conf_t c;

    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        snprintf(yaml, sizeof(yaml), "copy:\n  chunk_bytes: %s\n",
                 good[i].text);
        load_ok(yaml, &c);
        CHECK_EQ(c.copy_chunk_bytes, good[i].want);
        /* The same parser serves 32-bit size fields. */
        snprintf(yaml, sizeof(yaml), "limits:\n  max_frame_bytes: %s\n",
                 good[i].text);
        load_ok(yaml, &c);
        CHECK_EQ(c.max_frame_bytes, good[i].want);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(yaml, sizeof(yaml), "copy:\n  chunk_bytes: %s\n", bad[i]);
        CHECK_EQ(load_text(yaml, &c, &err), 1);
        CHECK_STR_CONTAINS(err, "F:2:16: copy.chunk_bytes: invalid value");
        CHECK_STR_CONTAINS(err, "(expected a size 4KiB..1GiB, in bytes or "
                                "with a KiB, MiB or GiB suffix)\n");
        free(err);
    }
    for (size_t i = 0; i < sizeof(range) / sizeof(range[0]); i++) {
        snprintf(yaml, sizeof(yaml), "copy:\n  chunk_bytes: %s\n", range[i]);
        CHECK_EQ(load_text(yaml, &c, &err), 1);
        CHECK_STR_CONTAINS(err, "F:2:16: copy.chunk_bytes: ");
        CHECK_STR_CONTAINS(err, " is out of range (expected a size");
        free(err);
    }
    unlink(tmp_path);
}

TEST(octal_mode)
{
    static const struct {
        const char *text;
        unsigned want;
    } good[] = {{"0660", 0660}, {"\"0660\"", 0660}, {"'0600'", 0600},
                {"660", 0660},  {"0o640", 0640},    {"0", 0},
                {"0777", 0777}, {"00644", 0644},    {"7", 07}};
    kvx_conf_t c;
    char yaml[96];

    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        snprintf(yaml, sizeof(yaml), "socket:\n  mode: %s\n", good[i].text);
        load_ok(yaml, &c);
        CHECK_EQ(c.socket_mode, good[i].want);
    }
    expect_errors("socket:\n  mode: 01000\n", 1,
                  "F:2:9: socket.mode: 01000 is out of range (expected an "
                  "octal mode 0000..0777)\n"
                  "  mode: 01000\n"
                  "        ^\n");
    expect_errors("socket:\n  mode: 0999\n", 1,
                  "F:2:9: socket.mode: invalid value \"0999\" (expected an "
                  "octal mode 0000..0777)\n"
                  "  mode: 0999\n"
                  "        ^\n");
    expect_errors("socket:\n  mode: rw-rw----\n", 1,
                  "F:2:9: socket.mode: invalid value \"rw-rw----\" (expected "
                  "an octal mode 0000..0777)\n"
                  "  mode: rw-rw----\n"
                  "        ^\n");
    expect_errors("socket:\n  mode: 0x1b0\n", 1,
                  "F:2:9: socket.mode: invalid value \"0x1b0\" (expected an "
                  "octal mode 0000..0777)\n"
                  "  mode: 0x1b0\n"
                  "        ^\n");
}

TEST(id_lists)
{
    kvx_conf_t c;
    char yaml[2048];
    size_t len;

    load_ok("auth:\n  allowed_uids: []\n  allowed_gids: [5]\n", &c);
    CHECK_EQ(c.num_allowed_uids, 0);
    CHECK_EQ(c.num_allowed_gids, 1);
    CHECK_EQ(c.allowed_gids[0], 5);

    /* Exactly CONF_MAX_IDS fit. */
    len = (size_t)snprintf(yaml, sizeof(yaml), "auth:\n  allowed_uids:\n");
    for (int i = 0; i < CONF_MAX_IDS; i++)
        len += (size_t)snprintf(yaml + len, sizeof(yaml) - len, "    - %d\n",
                                1000 + i);
    load_ok(yaml, &c);
    CHECK_EQ(c.num_allowed_uids, CONF_MAX_IDS);
    for (int i = 0; i < CONF_MAX_IDS; i++)
        CHECK_EQ(c.allowed_uids[i], 1000 + i);

    /* One more is a problem at the extra entry. */
    snprintf(yaml + len, sizeof(yaml) - len, "    - 7\n");
    expect_errors(yaml, 1,
                  "F:67:7: auth.allowed_uids[64]: too many entries (expected "
                  "a list of at most 64 ids, each 0..4294967294)\n"
                  "    - 7\n"
                  "      ^\n");

    expect_errors("auth:\n  allowed_gids: [1, -2, x, [3], 4294967295]\n", 4,
                  "F:2:21: auth.allowed_gids[1]: -2 is out of range "
                  "(expected a list of at most 64 group names or ids, each "
                  "0..4294967294)\n"
                  "  allowed_gids: [1, -2, x, [3], 4294967295]\n"
                  "                    ^\n"
                  "F:2:25: auth.allowed_gids[2]: no group named \"x\" "
                  "(expected a list of at most 64 group names or ids, each "
                  "0..4294967294)\n"
                  "  allowed_gids: [1, -2, x, [3], 4294967295]\n"
                  "                        ^\n"
                  "F:2:28: auth.allowed_gids[3]: got a sequence "
                  "(expected a list of at most 64 group names or ids, each "
                  "0..4294967294)\n"
                  "  allowed_gids: [1, -2, x, [3], 4294967295]\n"
                  "                           ^\n"
                  "F:2:33: auth.allowed_gids[4]: 4294967295 is out of range "
                  "(expected a list of at most 64 group names or ids, each "
                  "0..4294967294)\n"
                  "  allowed_gids: [1, -2, x, [3], 4294967295]\n"
                  "                                ^\n");
    /* Groups by name: resolved to their gids at load */
    struct group *root = getgrnam("root");
    CHECK(root != NULL);
    load_ok("auth:\n  allowed_gids: [root, 5]\n  admin_gids: [\"root\"]\n", &c);
    CHECK_EQ(c.num_allowed_gids, 2);
    CHECK_EQ(c.allowed_gids[0], root->gr_gid);
    CHECK_EQ(c.allowed_gids[1], 5);
    CHECK_EQ(c.num_admin_gids, 1);
    CHECK_EQ(c.admin_gids[0], root->gr_gid);
    expect_errors("auth:\n  admin_gids: [kvx-no-such-group]\n", 1,
                  "F:2:16: auth.admin_gids[0]: no group named "
                  "\"kvx-no-such-group\" (expected a list of at most 64 "
                  "group names or ids, each 0..4294967294)\n"
                  "  admin_gids: [kvx-no-such-group]\n"
                  "               ^\n");
    /* uids stay numbers */
    expect_errors("auth:\n  allowed_uids: [root]\n", 1,
                  "F:2:18: auth.allowed_uids[0]: invalid value \"root\" "
                  "(expected a list of at most 64 ids, each 0..4294967294)\n"
                  "  allowed_uids: [root]\n"
                  "                 ^\n");
    expect_errors("auth:\n  allowed_uids: 1000\n", 1,
                  "F:2:17: auth.allowed_uids: got a scalar (expected a list "
                  "of at most 64 ids, each 0..4294967294)\n"
                  "  allowed_uids: 1000\n"
                  "                ^\n");
}

/* ---- each class of problem, exact text ---- */

TEST(err_unknown_section)
{
    expect_errors("sockets:\n  path: /x\n", 1,
                  "F:1:1: sockets: unknown section (expected one of socket, "
                  "auth, limits, copy, gpu, peer, deadlines, log, records, "
                  "metrics)\n"
                  "sockets:\n"
                  "^\n");
    /* A dotted key at top level is not a shorthand. */
    expect_errors(
        "log.level: info\n", 1,
        "F:1:1: log.level: unknown section (expected one of "
        "socket, auth, limits, copy, gpu, peer, deadlines, log, records, "
        "metrics)\n"
        "log.level: info\n"
        "^\n");
}

TEST(err_unknown_key)
{
    expect_errors("socket:\n  path: /run/x.sock\n  pth: /x\n", 1,
                  "F:3:3: socket.pth: unknown key (expected one of path, "
                  "mode, group)\n"
                  "  pth: /x\n"
                  "  ^\n");
    /* A key of another section. */
    expect_errors("log:\n  max_sessions: 5\n", 1,
                  "F:2:3: log.max_sessions: unknown key (expected one of "
                  "level, trace_file, format)\n"
                  "  max_sessions: 5\n"
                  "  ^\n");
}

TEST(err_duplicate_key)
{
    expect_errors("limits:\n  max_pools: 8\n  max_sessions: 2\n"
                  "  max_pools: 9\n",
                  1,
                  "F:4:3: limits.max_pools: duplicate key (expected it once; "
                  "first at line 2)\n"
                  "  max_pools: 9\n"
                  "  ^\n");
}

TEST(err_duplicate_section)
{
    expect_errors("log:\n  level: info\ncopy: {}\nlog:\n  level: debug\n", 1,
                  "F:4:1: log: duplicate section (expected it once; first "
                  "at line 1)\n"
                  "log:\n"
                  "^\n");
}

TEST(err_wrong_type)
{
    expect_errors("limits:\n  max_sessions:\n    a: 1\n", 1,
                  "F:3:5: limits.max_sessions: got a mapping (expected an "
                  "integer 1..65536)\n"
                  "    a: 1\n"
                  "    ^\n");
    expect_errors("limits:\n  max_sessions: abc\n", 1,
                  "F:2:17: limits.max_sessions: invalid value \"abc\" "
                  "(expected an integer 1..65536)\n"
                  "  max_sessions: abc\n"
                  "                ^\n");
    expect_errors("deadlines:\n  fetch_timeout_ms: 1.5\n", 1,
                  "F:2:21: deadlines.fetch_timeout_ms: invalid value \"1.5\" "
                  "(expected milliseconds 1..86400000)\n"
                  "  fetch_timeout_ms: 1.5\n"
                  "                    ^\n");
    expect_errors("socket: [path]\n", 1,
                  "F:1:9: socket: got a sequence (expected a mapping with "
                  "keys path, mode, group)\n"
                  "socket: [path]\n"
                  "        ^\n");
    expect_errors("log:\n  level: verbose\n", 1,
                  "F:2:10: log.level: invalid value \"verbose\" (expected one "
                  "of error, warning, notice, info, debug)\n"
                  "  level: verbose\n"
                  "         ^\n");
    expect_errors("limits:\n  max_pools:\n", 1,
                  "F:2:13: limits.max_pools: no value (expected an integer "
                  "1..4096)\n"
                  "  max_pools:\n"
                  "            ^\n");
    /* A long value is echoed cut short, control characters masked. */
    expect_errors("limits:\n  max_sessions: \"0123456789abcdefghij0123456789"
                  "abcdefghij\\tXYZ\"\n",
                  1,
                  "F:2:17: limits.max_sessions: invalid value \"0123456789"
                  "abcdefghij0123456789abcdefghij...\" (expected an integer "
                  "1..65536)\n"
                  "  max_sessions: \"0123456789abcdefghij0123456789abcdefghij"
                  "\\tXYZ\"\n"
                  "                ^\n");
    expect_errors("limits:\n  max_sessions: \"1\\x01\"\n", 1,
                  "F:2:17: limits.max_sessions: invalid value \"1?\" "
                  "(expected an integer 1..65536)\n"
                  "  max_sessions: \"1\\x01\"\n"
                  "                ^\n");
    expect_errors("socket:\n  group: \"a\\0b\"\n", 1,
                  "F:2:10: socket.group: value contains a NUL character "
                  "(expected a string of at most 63 characters)\n"
                  "  group: \"a\\0b\"\n"
                  "         ^\n");
}

TEST(err_out_of_range)
{
    expect_errors("limits:\n  max_sessions: 0\n", 1,
                  "F:2:17: limits.max_sessions: 0 is out of range (expected "
                  "an integer 1..65536)\n"
                  "  max_sessions: 0\n"
                  "                ^\n");
    expect_errors("limits:\n  max_sessions: 65537\n", 1,
                  "F:2:17: limits.max_sessions: 65537 is out of range "
                  "(expected an integer 1..65536)\n"
                  "  max_sessions: 65537\n"
                  "                ^\n");
    expect_errors("copy:\n  worker_threads: -1\n", 1,
                  "F:2:19: copy.worker_threads: -1 is out of range (expected "
                  "an integer 0..256)\n"
                  "  worker_threads: -1\n"
                  "                  ^\n");
    expect_errors("deadlines:\n  deadline_tick_ms: 18446744073709551616\n", 1,
                  "F:2:21: deadlines.deadline_tick_ms: 18446744073709551616 "
                  "is out of range (expected milliseconds 1..1000)\n"
                  "  deadline_tick_ms: 18446744073709551616\n"
                  "                    ^\n");
    expect_errors("limits:\n  max_frame_bytes: 2GiB\n", 1,
                  "F:2:20: limits.max_frame_bytes: 2GiB is out of range "
                  "(expected a size 4KiB..1GiB, in bytes or with a KiB, MiB "
                  "or GiB suffix)\n"
                  "  max_frame_bytes: 2GiB\n"
                  "                   ^\n");
}

TEST(err_strings)
{
    char yaml[256], want[1024], longpath[120];

    memset(longpath, 'a', sizeof(longpath));
    longpath[0] = '/';
    longpath[108] = '\0'; /* 108 characters: one too many */
    snprintf(yaml, sizeof(yaml), "socket:\n  path: %s\n", longpath);
    snprintf(want, sizeof(want),
             "F:2:9: socket.path: value is too long, 108 characters "
             "(expected an absolute path of at most 107 characters)\n"
             "  path: %s\n"
             "        ^\n",
             longpath);
    expect_errors(yaml, 1, want);
    longpath[107] = '\0'; /* 107 fit */
    snprintf(yaml, sizeof(yaml), "socket:\n  path: %s\n", longpath);
    kvx_conf_t c;
    load_ok(yaml, &c);
    CHECK(!strcmp(c.socket_path, longpath));

    expect_errors("socket:\n  path: run/kvx.sock\n", 1,
                  "F:2:9: socket.path: \"run/kvx.sock\" is not an absolute "
                  "path (expected an absolute path of at most 107 "
                  "characters)\n"
                  "  path: run/kvx.sock\n"
                  "        ^\n");
    expect_errors("socket:\n  group: \"kv xfer\"\n", 1,
                  "F:2:10: socket.group: \"kv xfer\" is not a group name "
                  "(expected letters, digits, '_', '.', '-' or a number)\n"
                  "  group: \"kv xfer\"\n"
                  "         ^\n");
    expect_errors("socket:\n  group: -g\n", 1,
                  "F:2:10: socket.group: \"-g\" is not a group name "
                  "(expected letters, digits, '_', '.', '-' or a number)\n"
                  "  group: -g\n"
                  "         ^\n");
}

TEST(err_cross_key)
{
    expect_errors("limits:\n  hello_frame_bytes: 64KiB\n"
                  "  max_frame_bytes: 8KiB\n",
                  1,
                  "F:2:22: limits.hello_frame_bytes: 65536 is larger than "
                  "limits.max_frame_bytes (expected at most 8192)\n"
                  "  hello_frame_bytes: 64KiB\n"
                  "                     ^\n");
    kvx_conf_t c;
    load_ok("limits:\n  hello_frame_bytes: 8KiB\n  max_frame_bytes: 8KiB\n",
            &c);
    CHECK_EQ(c.hello_frame_bytes, 8192);
}

/* gpu.copy_path, gpu.stream_priority, gpu.sm_share: each bad value
 * named, the good ones loaded */
TEST(err_gpu_share_keys)
{
    kvx_conf_t c;
    load_ok("gpu:\n  copy_path: auto\n  dma_min_run: 64KiB\n  sm_share: 25\n"
            "  stream_priority: low\n  pace: 64MiB\ncopy:\n  pace: 4096\n",
            &c);
    CHECK_EQ(c.gpu_pace, 64 * 1024 * 1024);
    CHECK_EQ(c.copy_pace, 4096);
    CHECK(!strcmp(c.gpu_copy_path, "auto"));
    CHECK_EQ(c.gpu_dma_min_run, 65536);
    CHECK_EQ(c.gpu_sm_share, 25);
    CHECK(!strcmp(c.gpu_stream_priority, "low"));
    expect_errors("gpu:\n  copy_path: ce\n", 1,
                  "F:2:14: gpu.copy_path: \"ce\" is not a copy path "
                  "(expected kernel, dma or auto)\n"
                  "  copy_path: ce\n"
                  "             ^\n");
    expect_errors("gpu:\n  stream_priority: high\n", 1,
                  "F:2:20: gpu.stream_priority: \"high\" is not a stream "
                  "priority (expected normal or low)\n"
                  "  stream_priority: high\n"
                  "                   ^\n");
    expect_errors("gpu:\n  sm_share: 101\n", 1,
                  "F:2:13: gpu.sm_share: 101 is out of range (expected an "
                  "integer 0..100)\n"
                  "  sm_share: 101\n"
                  "            ^\n");
}

/* peer.topology, peer.rails, peer.gpu_rails: each bad value named */
TEST(err_topology_keys)
{
    /* a one-character interface is a name; 16 rails are the most (a lane
     * each at least), 17 are refused at load, not at start */
    kvx_conf_t one;
    load_ok("peer:\n  rails: e\n", &one);
    CHECK(!strcmp(one.peer_rails, "e"));
    load_ok("peer:\n  rails: \"a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p\"\n", &one);
    expect_errors("peer:\n  rails: \"a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q\"\n", 1,
                  "F:2:10: peer.rails: more than 16 rails (one lane each)\n"
                  "  rails: \"a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q\"\n"
                  "         ^\n");
    expect_errors("peer:\n  topology: on\n", 1,
                  "F:2:13: peer.topology: \"on\" is not a topology mode "
                  "(expected auto or off)\n"
                  "  topology: on\n"
                  "            ^\n");
    expect_errors("peer:\n  rails: \"mlx5_0:1,,eth1\"\n", 1,
                  "F:2:10: peer.rails: \"\" is not a device name (expected "
                  "names as UCX_NET_DEVICES has them, e.g. mlx5_0:1,eth1)\n"
                  "  rails: \"mlx5_0:1,,eth1\"\n"
                  "         ^\n");
    expect_errors("peer:\n  rails: \"mlx5_0:x\"\n", 1,
                  "F:2:10: peer.rails: \"mlx5_0:x\" is not a device name "
                  "(expected names as UCX_NET_DEVICES has them, e.g. "
                  "mlx5_0:1,eth1)\n"
                  "  rails: \"mlx5_0:x\"\n"
                  "         ^\n");
    expect_errors("peer:\n  rails: \"eth1,eth 2\"\n", 1,
                  "F:2:10: peer.rails: \"eth 2\" is not a device name "
                  "(expected names as UCX_NET_DEVICES has them, e.g. "
                  "mlx5_0:1,eth1)\n"
                  "  rails: \"eth1,eth 2\"\n"
                  "         ^\n");
    expect_errors("peer:\n  rails: \"eth1,mlx5_0:1,eth1\"\n", 1,
                  "F:2:10: peer.rails: \"eth1\" is named twice\n"
                  "  rails: \"eth1,mlx5_0:1,eth1\"\n"
                  "         ^\n");
    expect_errors("peer:\n  topology: \"off\"\n  rails: eth1\n", 1,
                  "F:3:10: peer.rails: needs peer.topology: auto\n"
                  "  rails: eth1\n"
                  "         ^\n");
    expect_errors("peer:\n  gpu_rails: \"1b:00.0=mlx5_0:1\"\n", 1,
                  "F:2:14: peer.gpu_rails: \"1b:00.0=mlx5_0:1\" is not "
                  "BUS_ID=RAIL[+RAIL...] (expected e.g. "
                  "0000:1b:00.0=mlx5_0:1+mlx5_1:1)\n"
                  "  gpu_rails: \"1b:00.0=mlx5_0:1\"\n"
                  "             ^\n");
    expect_errors("peer:\n  gpu_rails: \"0000:1b:00.0\"\n", 1,
                  "F:2:14: peer.gpu_rails: \"0000:1b:00.0\" is not "
                  "BUS_ID=RAIL[+RAIL...] (expected e.g. "
                  "0000:1b:00.0=mlx5_0:1+mlx5_1:1)\n"
                  "  gpu_rails: \"0000:1b:00.0\"\n"
                  "             ^\n");
    expect_errors("peer:\n  gpu_rails: \"0000:1b:00.0=mlx5_0:1+,x\"\n", 1,
                  "F:2:14: peer.gpu_rails: \"0000:1b:00.0\": \"\" is not a "
                  "device name (expected names as UCX_NET_DEVICES has "
                  "them, e.g. mlx5_0:1)\n"
                  "  gpu_rails: \"0000:1b:00.0=mlx5_0:1+,x\"\n"
                  "             ^\n");
    expect_errors("peer:\n  topology: \"off\"\n"
                  "  gpu_rails: \"0000:1b:00.0=eth1\"\n",
                  1,
                  "F:3:14: peer.gpu_rails: needs peer.topology: auto\n"
                  "  gpu_rails: \"0000:1b:00.0=eth1\"\n"
                  "             ^\n");
    expect_errors("peer:\n  sysfs_root: sys\n", 1,
                  "F:2:15: peer.sysfs_root: \"sys\" is not an absolute path "
                  "(expected an absolute path of at most 107 characters)\n"
                  "  sysfs_root: sys\n"
                  "              ^\n");
    kvx_conf_t c;
    load_ok("peer:\n  topology: auto\n  rails: \"mlx5_0:1,mlx5_1:1,eth1\"\n"
            "  gpu_rails: \"0000:1b:00.0=mlx5_0:1+mlx5_1:1,"
            "00000000:3D:00.0=eth1\"\n  sysfs_root: /tmp/sys\n",
            &c);
    CHECK(!strcmp(c.peer_topology, "auto"));
    CHECK(!strcmp(c.peer_rails, "mlx5_0:1,mlx5_1:1,eth1"));
    CHECK(!strcmp(c.peer_gpu_rails,
                  "0000:1b:00.0=mlx5_0:1+mlx5_1:1,00000000:3D:00.0=eth1"));
    CHECK(!strcmp(c.peer_sysfs_root, "/tmp/sys"));
    load_ok("peer:\n  topology: \"off\"\n", &c);
    CHECK(!strcmp(c.peer_topology, "off"));
}

TEST(err_metrics_listen)
{
    expect_errors("metrics:\n  listen: foo:80\n", 1,
                  "F:2:11: metrics.listen: 'foo:80': 'foo' is not an IP "
                  "address\n"
                  "  listen: foo:80\n"
                  "          ^\n");
    expect_errors("metrics:\n  listen: 127.0.0.1:99999\n", 1,
                  "F:2:11: metrics.listen: '127.0.0.1:99999': port must be "
                  "0..65535\n"
                  "  listen: 127.0.0.1:99999\n"
                  "          ^\n");
    expect_errors("metrics:\n  listen: 9464\n", 1,
                  "F:2:11: metrics.listen: '9464' is not IP:PORT\n"
                  "  listen: 9464\n"
                  "          ^\n");
    kvx_conf_t c;
    conf_defaults(&c);
    CHECK(!strcmp(c.metrics_listen, "")); /* off by default */
    CHECK_EQ(load_text("metrics:\n  listen: \"[::1]:0\"\n", &c, NULL), 0);
    CHECK(!strcmp(c.metrics_listen, "[::1]:0"));
    CHECK_EQ(load_text("metrics:\n  listen: 127.0.0.1:9464\n", &c, NULL), 0);
    unlink(tmp_path);
}

TEST(err_top_level)
{
    expect_errors(
        "- socket\n- log\n", 1,
        "F:1:1: (top level): got a sequence (expected a mapping "
        "with sections socket, auth, limits, copy, gpu, peer, deadlines, "
        "log, records, "
        "metrics)\n"
        "- socket\n"
        "^\n");
    expect_errors(
        "hello\n", 1,
        "F:1:1: (top level): got a scalar (expected a mapping "
        "with sections socket, auth, limits, copy, gpu, peer, deadlines, "
        "log, records, "
        "metrics)\n"
        "hello\n"
        "^\n");
    expect_errors("log: {level: info}\n---\nlog: {level: debug}\n", 1,
                  "F:3:1: (top level): a second YAML document (expected one "
                  "document)\n"
                  "log: {level: debug}\n"
                  "^\n");
}

TEST(err_yaml_syntax)
{
    expect_errors("socket:\n  path: /x\n mode: 0660\n", 1,
                  "F:3:2: yaml: did not find expected key while parsing a "
                  "block mapping at line 1 column 1 (expected valid YAML)\n"
                  " mode: 0660\n"
                  " ^\n");
    expect_errors("socket:\n  path: a: b\n", 1,
                  "F:2:10: yaml: mapping values are not allowed in this "
                  "context (expected valid YAML)\n"
                  "  path: a: b\n"
                  "         ^\n");
    expect_errors("socket:\n  path: \"/x\n", 1,
                  "F:3:1: yaml: found unexpected end of stream while "
                  "scanning a quoted scalar at line 2 column 9 (expected "
                  "valid YAML)\n");
    expect_errors("log:\n  level: *nope\n", 1,
                  "F:2:10: yaml: found undefined alias (expected valid "
                  "YAML)\n"
                  "  level: *nope\n"
                  "         ^\n");
    expect_errors("log:\n  level: \xff\n", 1,
                  "F:2:10: yaml: invalid leading UTF-8 octet: #FF (expected "
                  "UTF-8 text)\n"
                  "  level: \xff\n"
                  "         ^\n");
}

TEST(err_collects_all)
{
    expect_errors("socket:\n"
                  "  mode: 9\n"
                  "  oops: 1\n"
                  "limits:\n"
                  "  max_pools: 0\n"
                  "  max_pools: 1\n"
                  "bogus: {}\n"
                  "log:\n"
                  "  level: loud\n",
                  6,
                  "F:2:9: socket.mode: invalid value \"9\" (expected an "
                  "octal mode 0000..0777)\n"
                  "  mode: 9\n"
                  "        ^\n"
                  "F:3:3: socket.oops: unknown key (expected one of path, "
                  "mode, group)\n"
                  "  oops: 1\n"
                  "  ^\n"
                  "F:5:14: limits.max_pools: 0 is out of range (expected an "
                  "integer 1..4096)\n"
                  "  max_pools: 0\n"
                  "             ^\n"
                  "F:6:3: limits.max_pools: duplicate key (expected it once; "
                  "first at line 5)\n"
                  "  max_pools: 1\n"
                  "  ^\n"
                  "F:7:1: bogus: unknown section (expected one of socket, "
                  "auth, limits, copy, gpu, peer, deadlines, log, records, "
                  "metrics)\n"
                  "bogus: {}\n"
                  "^\n"
                  "F:9:10: log.level: invalid value \"loud\" (expected one of "
                  "error, warning, notice, info, debug)\n"
                  "  level: loud\n"
                  "         ^\n");
}

TEST(err_cannot_open)
{
    kvx_conf_t c, before;
    char *err = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&err, &len);

    memset(&c, 0x11, sizeof(c));
    memcpy(&before, &c, sizeof(c));
    CHECK(mem != NULL);
    CHECK_EQ(conf_load("/nonexistent/kvxferd.yaml", &c, mem), KVX_ERR_IO);
    fclose(mem);
    CHECK(!strcmp(err, "/nonexistent/kvxferd.yaml: cannot open: No such "
                       "file or directory\n"));
    CHECK(!memcmp(&c, &before, sizeof(c)));
    free(err);
    /* NULL err is allowed: count only. */
    CHECK_EQ(conf_load("/nonexistent/kvxferd.yaml", &c, NULL), KVX_ERR_IO);
    tmp_write("log: {level: x}\n", 16);
    CHECK_EQ(conf_load(tmp_path, &c, NULL), 1);
    unlink(tmp_path);
}

/* ---- reload, listings, docs ---- */

TEST(reload_applies_only_reloadable)
{
    kvx_conf_t cur, next, orig;
    char *out = NULL;
    size_t len = 0;
    FILE *mem;

    conf_defaults(&cur);
    memcpy(&orig, &cur, sizeof(cur));
    load_ok("limits:\n  max_sessions: 8\n"
            "auth:\n  allowed_uids: [1000]\n"
            "copy:\n  chunk_bytes: 8MiB\n"
            "deadlines:\n  deadline_tick_ms: 5\n"
            "log:\n  level: debug\n"
            "socket:\n  path: /run/other.sock\n",
            &next);

    mem = open_memstream(&out, &len);
    CHECK(mem != NULL);
    CHECK_EQ(conf_apply_reloadable(&cur, &next, mem), 3);
    fclose(mem);
    CHECK(!strcmp(out, "socket.path: changed in file, needs a restart to "
                       "take effect\n"
                       "auth.allowed_uids: changed in file, needs a restart "
                       "to take effect\n"
                       "limits.max_sessions: changed in file, needs a "
                       "restart to take effect\n"));
    free(out);
    /* Reloadable keys took the new values... */
    CHECK_EQ(cur.copy_chunk_bytes, 8u << 20);
    CHECK_EQ(cur.deadline_tick_ms, 5);
    CHECK_EQ(cur.log_level, LOG_DEBUG);
    /* ...and the others kept theirs. */
    CHECK_EQ(cur.max_sessions, orig.max_sessions);
    CHECK_EQ(cur.num_allowed_uids, 0);
    CHECK(!strcmp(cur.socket_path, orig.socket_path));

    /* Applying again changes nothing reloadable; the restart list stays. */
    CHECK_EQ(conf_apply_reloadable(&cur, &next, NULL), 0);
    /* Same config: nothing at all. */
    mem = open_memstream(&out, &len);
    CHECK_EQ(conf_apply_reloadable(&orig, &orig, mem), 0);
    fclose(mem);
    CHECK_EQ(len, 0);
    free(out);
}

struct collect {
    char text[8192];
    size_t len;
    int n;
};

static void collect_fn(const char *key, const char *value, void *arg)
{
    struct collect *c = arg;
    CHECK(!strcmp(key, conf_keys[c->n].name));
    c->len += (size_t)snprintf(c->text + c->len, sizeof(c->text) - c->len,
                               "%s=%s\n", key, value);
    c->n++;
}

TEST(foreach_lists_every_key)
{
    struct collect col = {.len = 0};
    kvx_conf_t c;

    load_ok("auth:\n  allowed_uids: [1000, 1001]\n"
            "socket:\n  mode: 0640\n  group: kvx\n"
            "copy:\n  chunk_bytes: 12288\n"
            "limits:\n  hello_frame_bytes: 1000\n"
            "log:\n  level: warning\n",
            &c);
    CHECK_EQ(conf_foreach(&c, collect_fn, &col), (int)conf_nkeys);
    CHECK_EQ(col.n, (int)conf_nkeys);
    CHECK_STR_CONTAINS(col.text, "\nauth.allowed_uids=[1000, 1001]\n");
    CHECK_STR_CONTAINS(col.text, "\nauth.allowed_gids=[]\n");
    CHECK_STR_CONTAINS(col.text, "socket.mode=0640\n");
    CHECK_STR_CONTAINS(col.text, "\nsocket.group=kvx\n");
    CHECK_STR_CONTAINS(col.text, "\ncopy.chunk_bytes=12KiB\n");
    CHECK_STR_CONTAINS(col.text, "\nlimits.hello_frame_bytes=1000\n");
    CHECK_STR_CONTAINS(col.text, "\nlimits.max_frame_bytes=16MiB\n");
    CHECK_STR_CONTAINS(col.text, "\nlog.level=warning\n");
    CHECK_STR_CONTAINS(col.text, "\ndeadlines.offer_lease_ms=30000\n");
}

/* Writes the listing back as YAML: one block per section, values quoted
 * (lists as they are), so that every printed form must read back. */
static void yaml_fn(const char *key, const char *value, void *arg)
{
    struct collect *c = arg;
    size_t sl = section_len(key);

    if (!c->n || strncmp(conf_keys[c->n - 1].name, key, sl + 1))
        c->len += (size_t)snprintf(c->text + c->len, sizeof(c->text) - c->len,
                                   "%.*s:\n", (int)sl, key);
    c->len += (size_t)snprintf(
        c->text + c->len, sizeof(c->text) - c->len,
        value[0] == '[' ? "  %s: %s\n" : "  %s: \"%s\"\n", key + sl + 1, value);
    c->n++;
}

TEST(foreach_round_trips)
{
    kvx_conf_t c, back;
    struct collect col = {.len = 0};
    char *err;

    load_ok("socket:\n  mode: 0604\n  group: g\n  path: /a/b\n"
            "auth:\n  allowed_gids: [0, 7, 4294967294]\n"
            "copy:\n  chunk_bytes: 12MiB\n  worker_threads: 3\n"
            "limits:\n  hello_frame_bytes: 1000\n"
            "log:\n  level: notice\n",
            &c);
    conf_foreach(&c, yaml_fn, &col);
    CHECK_EQ(col.n, (int)conf_nkeys);
    memset(&back, 0, sizeof(back));
    CHECK_EQ(load_text(col.text, &back, &err), 0);
    CHECK_EQ(err[0], '\0');
    check_equal_per_field(&c, &back);
    CHECK(!memcmp(&c, &back, sizeof(c)));
    free(err);
    unlink(tmp_path);
}

static char *markdown(void)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    CHECK(mem != NULL);
    conf_print_markdown(mem);
    CHECK(fclose(mem) == 0);
    return buf;
}

TEST(markdown_table)
{
    char *md = markdown(), *line, *save;
    int rows = 0;

    CHECK(!strncmp(md,
                   "| key | type | default | range | reloadable | "
                   "description |\n|---",
                   61));
    for (line = strtok_r(md, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save), rows++) {
        int bars = 0;
        for (char *p = line; *p; p++)
            bars += *p == '|';
        CHECK_EQ(bars, 7);
        if (rows >= 2) {
            char want[96];
            snprintf(want, sizeof(want), "| `%s` |", conf_keys[rows - 2].name);
            CHECK(!strncmp(line, want, strlen(want)));
        }
    }
    CHECK_EQ(rows, (int)conf_nkeys + 2);
    free(md);
    md = markdown();
    CHECK_STR_CONTAINS(md, "| `socket.path` | path | "
                           "`/run/kvxfer/kvxferd.sock` | absolute, at most "
                           "107 characters | no |");
    CHECK_STR_CONTAINS(md, "| `socket.mode` | octal mode | `0660` | "
                           "0000..0777 | no |");
    CHECK_STR_CONTAINS(md, "| `socket.group` | string | `\"\"` |");
    CHECK_STR_CONTAINS(md, "| `limits.max_frame_bytes` | size | `16MiB` | "
                           "4KiB..1GiB | no |");
    CHECK_STR_CONTAINS(md, "| `copy.chunk_bytes` | size | `4MiB` | "
                           "4KiB..1GiB | yes |");
    CHECK_STR_CONTAINS(md, "| `log.level` | log level | `info` | error, "
                           "warning, notice, info, debug | yes |");
    free(md);
}

TEST(markdown_matches_docs)
{
    static const char begin[] = "<!-- BEGIN CONFIG TABLE -->\n";
    static const char end[] = "<!-- END CONFIG TABLE -->";
    char *doc = read_all(DOCS, NULL), *md = markdown(), *b, *e;

    b = strstr(doc, begin);
    CHECK(b != NULL);
    b += strlen(begin);
    e = strstr(b, end);
    CHECK(e != NULL);
    *e = '\0';
    if (strcmp(b, md))
        fprintf(stderr,
                "docs/configuration.md is stale; regenerate the "
                "block with kvxferd --print-config-table:\n%s",
                md);
    CHECK(!strcmp(b, md));
    free(doc);
    free(md);
}

/* ---- robustness ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Count the "F:..: key: ..." header lines of an error output. */
static int count_problems(const char *err)
{
    int n = 0;
    for (const char *p = err; *p;) {
        if (!strncmp(p, "F:", 2) || !strncmp(p, "F: ", 3))
            n++;
        p = strchr(p, '\n');
        if (!p)
            break;
        p++;
    }
    return n;
}

TEST_T(fuzz_mutated_example, 300)
{
    static const char interesting[] = ":-[]{}\n #&*!|>'\"\\\t%0123456789,?~";
    size_t elen;
    char *example = read_all(EXAMPLE, &elen);
    size_t cap = elen * 2 + 4096;
    char *buf = malloc(cap);
    int ok = 0, bad = 0;

    CHECK(buf != NULL);
    for (int iter = 0; iter < 2000; iter++) {
        size_t len;
        kvx_conf_t c;
        char *err;
        int rc;

        if (iter % 10 == 9) { /* pure noise */
            len = rng() % 512;
            for (size_t i = 0; i < len; i++)
                buf[i] = (char)rng();
        } else {
            memcpy(buf, example, elen);
            len = elen;
            for (int m = 0, nm = 1 + (int)(rng() % 4); m < nm; m++) {
                switch (rng() % 6) {
                case 0: /* flip bytes */
                    for (int f = 0, nf = 1 + (int)(rng() % 8); f < nf && len;
                         f++)
                        buf[rng() % len] = (char)rng();
                    break;
                case 1: /* structural characters */
                    for (int f = 0, nf = 1 + (int)(rng() % 8); f < nf && len;
                         f++)
                        buf[rng() % len] =
                            interesting[rng() % (sizeof(interesting) - 1)];
                    break;
                case 2: /* truncate */
                    len = len ? rng() % len : 0;
                    break;
                case 3: { /* delete a range */
                    if (!len)
                        break;
                    size_t at = rng() % len, n = rng() % 64;
                    if (n > len - at)
                        n = len - at;
                    memmove(buf + at, buf + at + n, len - at - n);
                    len -= n;
                    break;
                }
                case 4: { /* duplicate a range (repeated keys, sections) */
                    if (!len)
                        break;
                    size_t at = rng() % len, n = rng() % 200;
                    if (n > len - at)
                        n = len - at;
                    if (len + n > cap)
                        break;
                    memmove(buf + at + n, buf + at, len - at);
                    len += n;
                    break;
                }
                default: { /* insert random bytes */
                    size_t at = len ? rng() % len : 0, n = 1 + rng() % 16;
                    if (len + n > cap)
                        break;
                    memmove(buf + at + n, buf + at, len - at);
                    for (size_t i = 0; i < n; i++)
                        buf[at + i] = (char)rng();
                    len += n;
                    break;
                }
                }
            }
        }
        memset(&c, 0, sizeof(c));
        rc = load_bytes(buf, len, &c, &err);
        CHECK(rc >= -1);
        CHECK(rc != -1); /* the file always exists */
        if (rc == 0) {
            CHECK_EQ(err[0], '\0');
            check_valid(&c);
            ok++;
        } else {
            /* One header line per problem counted. */
            if (count_problems(err) != rc)
                fprintf(stderr, "rc %d for:\n%s", rc, err);
            CHECK_EQ(count_problems(err), rc);
            bad++;
        }
        free(err);
    }
    /* Both outcomes happened: the mutations reached the loader's checks. */
    CHECK(ok > 0 && bad > 0);
    free(buf);
    free(example);
    unlink(tmp_path);
}

TEST(deep_and_odd_yaml)
{
    size_t n = 100000, len = 0;
    char *buf = malloc(2 * n + 64);
    kvx_conf_t c;
    char *err;

    CHECK(buf != NULL);
    /* Deep nesting where a value is expected. */
    len = (size_t)sprintf(buf, "log:\n  level: ");
    for (size_t i = 0; i < n; i++)
        buf[len++] = '[';
    for (size_t i = 0; i < n; i++)
        buf[len++] = ']';
    buf[len++] = '\n';
    CHECK_EQ(load_bytes(buf, len, &c, &err), 1);
    /* Reported where it got too deep; the long line shown cut short. */
    CHECK(!strncmp(err,
                   "F:2:24: yaml: nested deeper than 16 levels "
                   "(expected sections of keys)\n  level: [[[[",
                   75));
    CHECK_STR_CONTAINS(err, "[[[...\n                       ^\n");
    CHECK(strlen(err) < 600);
    free(err);
    free(buf);
    /* 16 levels (two mappings, 14 lists) are still read, and refused for
     * what they are; a 17th is the nesting problem. */
    expect_errors("log:\n  level: [[[[[[[[[[[[[[1]]]]]]]]]]]]]]\n", 1,
                  "F:2:10: log.level: got a sequence (expected one of error, "
                  "warning, notice, info, debug)\n"
                  "  level: [[[[[[[[[[[[[[1]]]]]]]]]]]]]]\n"
                  "         ^\n");
    expect_errors("log:\n  level: [[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]\n", 1,
                  "F:2:24: yaml: nested deeper than 16 levels (expected "
                  "sections of keys)\n"
                  "  level: [[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]\n"
                  "                       ^\n");

    /* Aliases resolve like the anchored value; a cycle does not loop. */
    load_ok("copy:\n  worker_threads: &n 4\n"
            "limits:\n  max_pools: *n\n",
            &c);
    CHECK_EQ(c.worker_threads, 4);
    CHECK_EQ(c.max_pools, 4);
    CHECK_EQ(load_text("log: &a {level: *a}\n", &c, &err) >= 1, 1);
    free(err);
    CHECK_EQ(load_text("&a [*a]\n", &c, &err) >= 1, 1);
    free(err);
    unlink(tmp_path);

    /* Too large a file is one problem, not an attempt to parse it. */
    size_t big = CONF_MAX_FILE_BYTES + 1;
    buf = malloc(big);
    CHECK(buf != NULL);
    memset(buf, '#', big);
    CHECK_EQ(load_bytes(buf, big, &c, &err), 1);
    CHECK_STR_CONTAINS(err, "F: file is larger than 1048576 bytes");
    free(err);
    free(buf);
    unlink(tmp_path);
}

/* log.format journal passes a check only where the daemon can start
 * with it: a build without libsystemd refused it only at start (exit 2)
 * after --check-config had said the file was fine. */
TEST(log_format_journal_as_the_log_takes_it)
{
    char w[200];
    int log_takes = log_format_check("journal", KVX_WHY(w)) == 0;
    if (log_takes) {
        kvx_conf_t c;
        load_ok("log:\n  format: journal\n", &c);
        CHECK(!strcmp(c.log_format, "journal"));
    } else {
        expect_errors("log:\n  format: journal\n", 1,
                      "F:2:11: log.format: journal, but this kvxferd was "
                      "built without libsystemd (scripts/deps.sh installs "
                      "libsystemd-dev)\n"
                      "  format: journal\n"
                      "          ^\n");
    }
    printf("log_format_journal_as_the_log_takes_it: this build %s "
           "journal\n",
           log_takes ? "takes" : "refuses");
}
