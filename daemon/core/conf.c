/*
 * conf — kvxferd configuration: everything generated from the one
 * declarative table of keys (conf_keys[], in conf_keys.c): the defaults,
 * the YAML loader and its checks, reload, the markdown reference and the
 * key/value listing.
 *
 * Owns: the key table and the parsing of config files. Must never depend on
 * another daemon module (no log.h) or touch daemon state: problems go to
 * the FILE * the caller passes, conf_load() fills a kvx_conf_t the caller
 * owns, and the caller decides what to apply.
 *
 * Adding a key is one line in keys[] and one field in kvx_conf_t; there is
 * no per-key code apart from an optional validator for rules the type and
 * bounds cannot express.
 */
#include "conf_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <yaml.h>

#include "kvxfer.h"

/* Config files are a few KiB; the cap stops a wrong --config (a log, a core
 * dump) from being read whole and fed to the parser. */
#define CONF_MAX_FILE_BYTES (1u << 20)

/* Sections of keys of lists: 3 levels; the rest is room for mistakes to
 * be reported as such rather than as nesting. */
#define CONF_MAX_DEPTH 16

/* How much of a user's value, and of a line, is echoed in a message. */
#define CONF_SHOW_MAX 40
#define CONF_SHOW_LINE_MAX 256

static const char *const type_names[] = {
    [CONF_STRING] = "string",    [CONF_PATH] = "path",
    [CONF_MODE] = "octal mode",  [CONF_U32] = "integer",
    [CONF_SIZE] = "size",        [CONF_MS] = "duration (ms)",
    [CONF_IDS] = "list of ids",  [CONF_LEVEL] = "log level",
};

static const struct {
    int level;
    const char *name;
} levels[] = {
    {LOG_ERR, "error"},   {LOG_WARNING, "warning"}, {LOG_NOTICE, "notice"},
    {LOG_INFO, "info"},   {LOG_DEBUG, "debug"},
};

int conf_log_level_parse(const char *name)
{
    if (!name)
        return -1;
    for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++)
        if (!strcmp(name, levels[i].name))
            return levels[i].level;
    return -1;
}

const char *conf_log_level_name(int level)
{
    for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++)
        if (levels[i].level == level)
            return levels[i].name;
    return "unknown";
}

/* ---- field access, generic over the table ---- */

static uint64_t num_get(const kvx_conf_t *c, const struct conf_key *k)
{
    const char *p = (const char *)c + k->off;
    if (k->size == sizeof(uint64_t)) {
        uint64_t v;
        memcpy(&v, p, sizeof(v));
        return v;
    }
    uint32_t v; /* uint32_t, unsigned and a non-negative int share bits */
    memcpy(&v, p, sizeof(v));
    return v;
}

static void num_set(kvx_conf_t *c, const struct conf_key *k, uint64_t v)
{
    char *p = (char *)c + k->off;
    if (k->size == sizeof(uint64_t)) {
        memcpy(p, &v, sizeof(v));
    } else {
        uint32_t v32 = (uint32_t)v;
        memcpy(p, &v32, sizeof(v32));
    }
}

static const char *str_get(const kvx_conf_t *c, const struct conf_key *k)
{
    return (const char *)c + k->off;
}

/* Zero the whole buffer so that equal strings compare equal with memcmp. */
static void str_set(kvx_conf_t *c, const struct conf_key *k, const char *s,
                    size_t len)
{
    char *p = (char *)c + k->off;
    memset(p, 0, k->size);
    memcpy(p, s, len < k->size ? len : k->size - 1);
}

static unsigned ids_cap(const struct conf_key *k)
{
    return (unsigned)(k->size / sizeof(uint32_t));
}

static unsigned ids_count(const kvx_conf_t *c, const struct conf_key *k)
{
    unsigned n;
    memcpy(&n, (const char *)c + k->count_off, sizeof(n));
    return n < ids_cap(k) ? n : ids_cap(k);
}

static uint32_t *ids(kvx_conf_t *c, const struct conf_key *k)
{
    return (uint32_t *)(void *)((char *)c + k->off);
}

static const uint32_t *ids_const(const kvx_conf_t *c,
                                 const struct conf_key *k)
{
    return (const uint32_t *)(const void *)((const char *)c + k->off);
}

static void ids_set_count(kvx_conf_t *c, const struct conf_key *k,
                          unsigned n)
{
    memcpy((char *)c + k->count_off, &n, sizeof(n));
}

static int key_equal(const kvx_conf_t *a, const kvx_conf_t *b,
                     const struct conf_key *k)
{
    switch (k->type) {
    case CONF_STRING:
    case CONF_PATH:
        return !strcmp(str_get(a, k), str_get(b, k));
    case CONF_IDS: {
        unsigned n = ids_count(a, k);
        return n == ids_count(b, k) &&
               !memcmp(ids_const(a, k), ids_const(b, k),
                       n * sizeof(uint32_t));
    }
    default:
        return num_get(a, k) == num_get(b, k);
    }
}

static void key_copy(kvx_conf_t *dst, const kvx_conf_t *src,
                     const struct conf_key *k)
{
    memcpy((char *)dst + k->off, (const char *)src + k->off, k->size);
    if (k->type == CONF_IDS)
        memcpy((char *)dst + k->count_off, (const char *)src + k->count_off,
               sizeof(unsigned));
}

/* ---- values as text: the same forms the loader accepts ---- */

static void fmt_num(const struct conf_key *k, uint64_t v, char *buf,
                    size_t n)
{
    unsigned long long u = (unsigned long long)v;
    if (k->type == CONF_MODE)
        snprintf(buf, n, "%04llo", u);
    else if (k->type == CONF_SIZE && u && u % GiB == 0)
        snprintf(buf, n, "%lluGiB", u / GiB);
    else if (k->type == CONF_SIZE && u && u % MiB == 0)
        snprintf(buf, n, "%lluMiB", u / MiB);
    else if (k->type == CONF_SIZE && u && u % KiB == 0)
        snprintf(buf, n, "%lluKiB", u / KiB);
    else
        snprintf(buf, n, "%llu", u);
}

static void fmt_value(const kvx_conf_t *c, const struct conf_key *k,
                      char *buf, size_t n)
{
    size_t len = 0;

    switch (k->type) {
    case CONF_STRING:
    case CONF_PATH:
        snprintf(buf, n, "%s", str_get(c, k));
        break;
    case CONF_LEVEL:
        snprintf(buf, n, "%s", conf_log_level_name((int)num_get(c, k)));
        break;
    case CONF_IDS:
        len = (size_t)snprintf(buf, n, "[");
        for (unsigned i = 0; i < ids_count(c, k) && len < n; i++)
            len += (size_t)snprintf(buf + len, n - len, "%s%u",
                                    i ? ", " : "", ids_const(c, k)[i]);
        if (len < n)
            snprintf(buf + len, n - len, "]");
        break;
    default:
        fmt_num(k, num_get(c, k), buf, n);
        break;
    }
}

/* The accepted range, short, for the reference table. */
static void fmt_range(const struct conf_key *k, char *buf, size_t n)
{
    char lo[32], hi[32];

    switch (k->type) {
    case CONF_STRING:
        snprintf(buf, n, "at most %zu characters", k->size - 1);
        return;
    case CONF_PATH:
        snprintf(buf, n, "absolute, at most %zu characters", k->size - 1);
        return;
    case CONF_IDS:
        snprintf(buf, n, "at most %u %s, each %llu..%llu", ids_cap(k),
                 k->group_names ? "group names or ids" : "ids",
                 (unsigned long long)k->min, (unsigned long long)k->max);
        return;
    case CONF_LEVEL: {
        size_t len = 0;
        buf[0] = '\0';
        for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]) && len < n;
             i++)
            len += (size_t)snprintf(buf + len, n - len, "%s%s",
                                    i ? ", " : "", levels[i].name);
        return;
    }
    default:
        fmt_num(k, k->min, lo, sizeof(lo));
        fmt_num(k, k->max, hi, sizeof(hi));
        snprintf(buf, n, "%s..%s", lo, hi);
        return;
    }
}

/* What a value should look like, for "(expected ...)". */
static void fmt_expected(const struct conf_key *k, char *buf, size_t n)
{
    char range[128];

    fmt_range(k, range, sizeof(range));
    switch (k->type) {
    case CONF_STRING:
        snprintf(buf, n, "a string of %s", range);
        break;
    case CONF_PATH:
        snprintf(buf, n, "an absolute path of at most %zu characters",
                 k->size - 1);
        break;
    case CONF_MODE:
        snprintf(buf, n, "an octal mode %s", range);
        break;
    case CONF_U32:
        snprintf(buf, n, "an integer %s", range);
        break;
    case CONF_SIZE:
        snprintf(buf, n, "a size %s, in bytes or with a KiB, MiB or GiB "
                         "suffix", range);
        break;
    case CONF_MS:
        snprintf(buf, n, "milliseconds %s", range);
        break;
    case CONF_IDS:
        snprintf(buf, n, "a list of at most %u %s, each %llu..%llu", ids_cap(k),
                 k->group_names ? "group names or ids" : "ids",
                 (unsigned long long)k->min, (unsigned long long)k->max);
        break;
    case CONF_LEVEL:
        snprintf(buf, n, "one of %s", range);
        break;
    }
}

/* ---- table lookups ---- */

static size_t section_len(const char *name)
{
    const char *dot = strchr(name, '.');
    return dot ? (size_t)(dot - name) : strlen(name);
}

static int section_is(const struct conf_key *k, const char *sec, size_t len)
{
    return section_len(k->name) == len && !strncmp(k->name, sec, len);
}

/* Index of the first key of section sec, or -1. */
static int section_find(const char *sec)
{
    for (size_t i = 0; i < conf_nkeys; i++)
        if (section_is(&conf_keys[i], sec, strlen(sec)))
            return (int)i;
    return -1;
}

/* Index of key name in the section starting at conf_keys[sec], or -1. */
static int key_find(int sec, const char *name)
{
    size_t len = section_len(conf_keys[sec].name);
    for (size_t i = (size_t)sec;
         i < conf_nkeys && section_is(&conf_keys[i], conf_keys[sec].name, len);
         i++)
        if (!strcmp(conf_keys[i].name + len + 1, name))
            return (int)i;
    return -1;
}

/* "socket, auth, ..." or, given a section, "path, mode, group". */
static void list_names(int sec, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < conf_nkeys && len < n; i++) {
        const char *name = conf_keys[i].name;
        size_t sl = section_len(name);
        if (sec < 0) {
            if (i && section_is(&conf_keys[i - 1], name, sl))
                continue;
            len += (size_t)snprintf(buf + len, n - len, "%s%.*s",
                                    len ? ", " : "", (int)sl, name);
        } else if (section_is(&conf_keys[sec], name, sl)) {
            len += (size_t)snprintf(buf + len, n - len, "%s%s",
                                    len ? ", " : "", name + sl + 1);
        }
    }
}

/* A user's text made safe to print and short enough to read. */
const char *conf_shown(const char *s, size_t len, char *buf, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < len && o + 4 < n && i < CONF_SHOW_MAX; i++) {
        unsigned char ch = (unsigned char)s[i];
        buf[o++] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
    }
    if (len > CONF_SHOW_MAX && o + 4 <= n) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

/* ---- defaults, reload, listings ---- */

void conf_defaults(kvx_conf_t *conf)
{
    memset(conf, 0, sizeof(*conf));
    for (size_t i = 0; i < conf_nkeys; i++) {
        const struct conf_key *k = &conf_keys[i];
        switch (k->type) {
        case CONF_STRING:
        case CONF_PATH:
            str_set(conf, k, k->def_str, strlen(k->def_str));
            break;
        case CONF_IDS:
            ids_set_count(conf, k, 0);
            break;
        default:
            num_set(conf, k, k->def);
            break;
        }
    }
}

int conf_apply_reloadable(kvx_conf_t *cur, const kvx_conf_t *next,
                          FILE *log_out)
{
    int changed = 0;

    for (size_t i = 0; i < conf_nkeys; i++) {
        const struct conf_key *k = &conf_keys[i];
        if (key_equal(cur, next, k))
            continue;
        if (k->reloadable) {
            key_copy(cur, next, k);
            changed++;
        } else if (log_out) {
            fprintf(log_out,
                    "%s: changed in file, needs a restart to take effect\n",
                    k->name);
        }
    }
    return changed;
}

void conf_print_markdown(FILE *out)
{
    kvx_conf_t def;
    char val[1024], range[128];

    conf_defaults(&def);
    fprintf(out, "| key | type | default | range | reloadable | "
                 "description |\n");
    fprintf(out, "|-----|------|---------|-------|------------|"
                 "-------------|\n");
    for (size_t i = 0; i < conf_nkeys; i++) {
        const struct conf_key *k = &conf_keys[i];
        fmt_value(&def, k, val, sizeof(val));
        fmt_range(k, range, sizeof(range));
        fprintf(out, "| `%s` | %s | `%s` | %s | %s | %s |\n", k->name,
                type_names[k->type], val[0] ? val : "\"\"", range,
                k->reloadable ? "yes" : "no", k->help);
    }
}

int conf_foreach(const kvx_conf_t *conf,
                 void (*fn)(const char *key, const char *value, void *arg),
                 void *arg)
{
    char val[1024];

    for (size_t i = 0; fn && i < conf_nkeys; i++) {
        fmt_value(conf, &conf_keys[i], val, sizeof(val));
        fn(conf_keys[i].name, val, arg);
    }
    return (int)conf_nkeys;
}

/* ---- the loader ---- */

struct loader {
    const char *path;
    const char *text; /* the whole file, for quoting lines */
    size_t len;
    FILE *err;
    int problems;
    yaml_document_t *doc;
    kvx_conf_t conf;
    size_t section_line[CONF_MAX_KEYS]; /* by first key index; 0 = not seen */
    size_t key_line[CONF_MAX_KEYS];     /* 0 = not in the file */
    yaml_mark_t value_mark[CONF_MAX_KEYS];
    int bad[CONF_MAX_KEYS]; /* the value was refused */
};

enum { PARSE_OK, PARSE_BAD, PARSE_RANGE };

/* Length of the line break at p (as libyaml counts them), or 0. */
static size_t line_break(const unsigned char *p, size_t left)
{
    if (p[0] == '\n')
        return 1;
    if (p[0] == '\r')
        return left > 1 && p[1] == '\n' ? 2 : 1;
    if (left > 1 && p[0] == 0xc2 && p[1] == 0x85)
        return 2;
    if (left > 2 && p[0] == 0xe2 && p[1] == 0x80 &&
        (p[2] == 0xa8 || p[2] == 0xa9))
        return 3;
    return 0;
}

static void show_line(const struct loader *ld, const yaml_mark_t *m)
{
    const unsigned char *t = (const unsigned char *)ld->text;
    size_t i = 0, line = 0, start, end, col = 0;

    while (line < m->line && i < ld->len) {
        size_t b = line_break(t + i, ld->len - i);
        i += b ? b : 1;
        line += b != 0;
    }
    if (line != m->line || i >= ld->len)
        return;
    start = end = i;
    while (end < ld->len && end - start < CONF_SHOW_LINE_MAX &&
           !line_break(t + end, ld->len - end))
        end++;
    for (i = start; i < end; i++)
        fputc(t[i] == '\t' || (t[i] >= 0x20 && t[i] != 0x7f) ? t[i] : '?',
              ld->err);
    fputs(end < ld->len && !line_break(t + end, ld->len - end) ? "...\n"
                                                               : "\n",
          ld->err);
    /* libyaml counts columns in characters: skip UTF-8 continuations. */
    for (i = start; i < end && col < m->column; i++) {
        if ((t[i] & 0xc0) == 0x80)
            continue;
        fputc(t[i] == '\t' ? '\t' : ' ', ld->err);
        col++;
    }
    if (col == m->column)
        fputs("^\n", ld->err);
}

/* One problem: "FILE:LINE:COL: key: what (expected ...)", then the line. */
__attribute__((format(printf, 4, 5))) static void
report(struct loader *ld, const yaml_mark_t *m, const char *key,
       const char *fmt, ...)
{
    va_list ap;

    ld->problems++;
    if (!ld->err)
        return;
    if (m)
        fprintf(ld->err, "%s:%zu:%zu: %s: ", ld->path, m->line + 1,
                m->column + 1, key);
    else
        fprintf(ld->err, "%s: %s: ", ld->path, key);
    va_start(ap, fmt);
    vfprintf(ld->err, fmt, ap);
    va_end(ap);
    fputc('\n', ld->err);
    if (m)
        show_line(ld, m);
}

static const char *node_kind(const yaml_node_t *n)
{
    switch (n->type) {
    case YAML_MAPPING_NODE:
        return "a mapping";
    case YAML_SEQUENCE_NODE:
        return "a sequence";
    default:
        return "a scalar";
    }
}

/* YAML 1.1's null forms, written plain: "key:" with nothing after it. */
static int node_is_null(const yaml_node_t *n)
{
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL"};
    if (n->type != YAML_SCALAR_NODE ||
        n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return 0;
    for (size_t i = 0; i < sizeof(nulls) / sizeof(nulls[0]); i++)
        if (n->data.scalar.length == strlen(nulls[i]) &&
            !memcmp(n->data.scalar.value, nulls[i], n->data.scalar.length))
            return 1;
    return 0;
}

static const char *scalar(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

/* Decimal digits only: YAML's 0x, +, 1_000 and 1e3 forms are refused so
 * that a value means the same to a reader and to the daemon. */
static int parse_digits(const char **s, uint64_t *out)
{
    const char *p = *s;
    uint64_t v = 0;
    int over = 0;

    if (*p < '0' || *p > '9')
        return PARSE_BAD;
    for (; *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10)
            over = 1;
        else
            v = v * 10 + d;
    }
    *s = p;
    *out = v;
    return over ? PARSE_RANGE : PARSE_OK;
}

static int parse_number(const struct conf_key *k, const char *s,
                        uint64_t *out)
{
    static const struct {
        const char *suffix;
        uint64_t mult;
    } units[] = {{"", 1}, {"KiB", KiB}, {"MiB", MiB}, {"GiB", GiB}};
    const char *p = s;
    uint64_t v = 0;
    int rc;

    switch (k->type) {
    case CONF_LEVEL: {
        int level = conf_log_level_parse(s);
        if (level < 0)
            return PARSE_BAD;
        *out = (uint64_t)level;
        return PARSE_OK;
    }
    case CONF_MODE:
        /* As chmod reads it: 0660, 660 and YAML 1.2's 0o660 are equal. */
        if (p[0] == '0' && p[1] == 'o')
            p += 2;
        if (*p < '0' || *p > '7')
            return PARSE_BAD;
        for (; *p >= '0' && *p <= '7'; p++)
            if (v <= 07777777)
                v = v * 8 + (uint64_t)(*p - '0');
        if (*p)
            return PARSE_BAD;
        break;
    default:
        if (*p == '-') { /* a well-formed negative number: say why */
            if (p[1] == '-') /* one sign only (and no recursion) */
                return PARSE_BAD;
            return parse_number(k, p + 1, &v) == PARSE_BAD ? PARSE_BAD
                                                           : PARSE_RANGE;
        }
        rc = parse_digits(&p, &v);
        if (rc == PARSE_BAD)
            return rc;
        if (k->type == CONF_SIZE) {
            size_t u;
            if (*p == ' ')
                p++;
            for (u = 0; u < sizeof(units) / sizeof(units[0]); u++)
                if (!strcmp(p, units[u].suffix))
                    break;
            if (u == sizeof(units) / sizeof(units[0]) || (p[-1] == ' ' && !*p))
                return PARSE_BAD;
            if (rc == PARSE_OK && v > UINT64_MAX / units[u].mult)
                rc = PARSE_RANGE;
            v *= units[u].mult;
        } else if (*p) {
            return PARSE_BAD;
        }
        if (rc != PARSE_OK)
            return rc;
        break;
    }
    if (v < k->min || v > k->max)
        return PARSE_RANGE;
    *out = v;
    return PARSE_OK;
}

/* A group's gid by name (the group database, NSS included): PARSE_OK,
 * PARSE_BAD when no such group exists, PARSE_RANGE when the lookup failed
 * or the gid is past max; err gets the lookup's errno, 0 if none. */
static int group_gid(const char *name, uint64_t max, uint64_t *v, int *err)
{
    struct group gr, *found = NULL;
    char buf[16384];
    int rc = getgrnam_r(name, &gr, buf, sizeof(buf), &found);

    *err = 0;
    if (rc && rc != ENOENT && rc != ESRCH) {
        *err = rc;
        return PARSE_RANGE;
    }
    if (!found)
        return PARSE_BAD;
    *v = found->gr_gid;
    return *v > max ? PARSE_RANGE : PARSE_OK;
}

/* An entry of a group list that is not a number: its gid, or the problem
 * reported at it. */
static int load_group_name(struct loader *ld, const struct conf_key *k,
                           const yaml_node_t *in, const char *name, uint64_t *v)
{
    char expected[256], what[64];
    int err = 0, rc;

    conf_shown(scalar(in), in->data.scalar.length, what, sizeof(what));
    fmt_expected(k, expected, sizeof(expected));
    rc = group_gid(scalar(in), k->max, v, &err);
    if (rc == PARSE_OK)
        return 0;
    if (err)
        report(ld, &in->start_mark, name,
               "looking up group \"%s\": %s (expected %s)", what, strerror(err),
               expected);
    else if (rc == PARSE_RANGE)
        report(ld, &in->start_mark, name,
               "group \"%s\" has gid %llu, out of range (expected %s)", what,
               (unsigned long long)*v, expected);
    else
        report(ld, &in->start_mark, name, "no group named \"%s\" (expected %s)",
               what, expected);
    return -1;
}

static void load_ids(struct loader *ld, int ki, const yaml_node_t *vn)
{
    const struct conf_key *k = &conf_keys[ki];
    /* Each entry reads as an integer with the list's bounds. */
    const struct conf_key id = {.type = CONF_U32, .min = k->min,
                                .max = k->max};
    char expected[256], what[64], name[96];
    unsigned n = 0;

    fmt_expected(k, expected, sizeof(expected));
    for (yaml_node_item_t *it = vn->data.sequence.items.start;
         it < vn->data.sequence.items.top; it++, n++) {
        const yaml_node_t *in = yaml_document_get_node(ld->doc, *it);
        uint64_t v = 0;
        int rc = PARSE_BAD;

        if (!in)
            continue;
        snprintf(name, sizeof(name), "%s[%u]", k->name, n);
        if (n >= ids_cap(k)) {
            report(ld, &in->start_mark, name,
                   "too many entries (expected %s)", expected);
            ld->bad[ki] = 1;
            return;
        }
        if (in->type != YAML_SCALAR_NODE) {
            report(ld, &in->start_mark, name, "got %s (expected %s)",
                   node_kind(in), expected);
            ld->bad[ki] = 1;
            continue;
        }
        if (strlen(scalar(in)) == in->data.scalar.length)
            rc = parse_number(&id, scalar(in), &v);
        if (rc == PARSE_BAD && k->group_names && in->data.scalar.length &&
            strlen(scalar(in)) == in->data.scalar.length) {
            if (load_group_name(ld, k, in, name, &v)) {
                ld->bad[ki] = 1;
                continue;
            }
            rc = PARSE_OK;
        }
        if (rc != PARSE_OK) {
            conf_shown(scalar(in), in->data.scalar.length, what, sizeof(what));
            if (rc == PARSE_RANGE)
                report(ld, &in->start_mark, name,
                       "%s is out of range (expected %s)", what, expected);
            else
                report(ld, &in->start_mark, name,
                       "invalid value \"%s\" (expected %s)", what, expected);
            ld->bad[ki] = 1;
            continue;
        }
        ids(&ld->conf, k)[n] = (uint32_t)v;
    }
    ids_set_count(&ld->conf, k, n);
}

static void load_value(struct loader *ld, int ki, const yaml_node_t *vn)
{
    const struct conf_key *k = &conf_keys[ki];
    char expected[256], what[64];
    const char *s;
    size_t len;
    uint64_t v = 0;
    int rc;

    fmt_expected(k, expected, sizeof(expected));
    if (k->type == CONF_IDS && vn->type == YAML_SEQUENCE_NODE) {
        load_ids(ld, ki, vn);
        return;
    }
    ld->bad[ki] = 1; /* until proven otherwise */
    if (vn->type != YAML_SCALAR_NODE || k->type == CONF_IDS) {
        report(ld, &vn->start_mark, k->name, "got %s (expected %s)",
               node_is_null(vn) ? "no value" : node_kind(vn), expected);
        return;
    }
    if (node_is_null(vn)) {
        report(ld, &vn->start_mark, k->name, "no value (expected %s)",
               expected);
        return;
    }
    s = scalar(vn);
    len = vn->data.scalar.length;
    conf_shown(s, len, what, sizeof(what));
    if (strlen(s) != len) {
        report(ld, &vn->start_mark, k->name,
               "value contains a NUL character (expected %s)", expected);
        return;
    }
    if (k->type == CONF_STRING || k->type == CONF_PATH) {
        if (len >= k->size) {
            report(ld, &vn->start_mark, k->name,
                   "value is too long, %zu characters (expected %s)", len,
                   expected);
            return;
        }
        if (k->type == CONF_PATH && s[0] != '/') {
            report(ld, &vn->start_mark, k->name,
                   "\"%s\" is not an absolute path (expected %s)", what,
                   expected);
            return;
        }
        str_set(&ld->conf, k, s, len);
        ld->bad[ki] = 0;
        return;
    }
    rc = parse_number(k, s, &v);
    if (rc == PARSE_RANGE) {
        report(ld, &vn->start_mark, k->name,
               "%s is out of range (expected %s)", what, expected);
        return;
    }
    if (rc != PARSE_OK) {
        report(ld, &vn->start_mark, k->name,
               "invalid value \"%s\" (expected %s)", what, expected);
        return;
    }
    num_set(&ld->conf, k, v);
    ld->bad[ki] = 0;
}

static void load_section(struct loader *ld, int sec, const yaml_node_t *sn)
{
    size_t sl = section_len(conf_keys[sec].name);
    char sname[32], names[256], what[64], full[128];

    snprintf(sname, sizeof(sname), "%.*s", (int)sl, conf_keys[sec].name);
    list_names(sec, names, sizeof(names));
    if (node_is_null(sn)) /* every key commented out: all defaults */
        return;
    if (sn->type != YAML_MAPPING_NODE) {
        report(ld, &sn->start_mark, sname,
               "got %s (expected a mapping with keys %s)", node_kind(sn),
               names);
        return;
    }
    for (yaml_node_pair_t *p = sn->data.mapping.pairs.start;
         p < sn->data.mapping.pairs.top; p++) {
        const yaml_node_t *kn = yaml_document_get_node(ld->doc, p->key);
        const yaml_node_t *vn = yaml_document_get_node(ld->doc, p->value);
        int ki;

        if (!kn || !vn)
            continue;
        if (kn->type != YAML_SCALAR_NODE) {
            report(ld, &kn->start_mark, sname,
                   "got %s as a key (expected one of %s)", node_kind(kn),
                   names);
            continue;
        }
        ki = strlen(scalar(kn)) == kn->data.scalar.length
                 ? key_find(sec, scalar(kn))
                 : -1;
        if (ki < 0) {
            snprintf(full, sizeof(full), "%s.%s", sname,
                     conf_shown(scalar(kn), kn->data.scalar.length, what,
                                sizeof(what)));
            report(ld, &kn->start_mark, full,
                   "unknown key (expected one of %s)", names);
            continue;
        }
        if (ld->key_line[ki]) {
            report(ld, &kn->start_mark, conf_keys[ki].name,
                   "duplicate key (expected it once; first at line %zu)",
                   ld->key_line[ki]);
            continue;
        }
        ld->key_line[ki] = kn->start_mark.line + 1;
        ld->value_mark[ki] = vn->start_mark;
        load_value(ld, ki, vn);
    }
}

static void load_root(struct loader *ld, const yaml_node_t *root)
{
    char sections[128], what[64];

    list_names(-1, sections, sizeof(sections));
    if (node_is_null(root)) /* a document of comments: all defaults */
        return;
    if (root->type != YAML_MAPPING_NODE) {
        report(ld, &root->start_mark, "(top level)",
               "got %s (expected a mapping with sections %s)",
               node_kind(root), sections);
        return;
    }
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start;
         p < root->data.mapping.pairs.top; p++) {
        const yaml_node_t *kn = yaml_document_get_node(ld->doc, p->key);
        const yaml_node_t *vn = yaml_document_get_node(ld->doc, p->value);
        int sec;

        if (!kn || !vn)
            continue;
        if (kn->type != YAML_SCALAR_NODE) {
            report(ld, &kn->start_mark, "(top level)",
                   "got %s as a section name (expected one of %s)",
                   node_kind(kn), sections);
            continue;
        }
        conf_shown(scalar(kn), kn->data.scalar.length, what, sizeof(what));
        sec = strlen(scalar(kn)) == kn->data.scalar.length &&
                      !strchr(scalar(kn), '.')
                  ? section_find(scalar(kn))
                  : -1;
        if (sec < 0) {
            report(ld, &kn->start_mark, what,
                   "unknown section (expected one of %s)", sections);
            continue;
        }
        if (ld->section_line[sec]) {
            report(ld, &kn->start_mark, what,
                   "duplicate section (expected it once; first at line %zu)",
                   ld->section_line[sec]);
            continue;
        }
        ld->section_line[sec] = kn->start_mark.line + 1;
        load_section(ld, sec, vn);
    }
}

/* libyaml's reader reports a byte offset, not a line and column. */
static yaml_mark_t mark_at(const struct loader *ld, size_t offset)
{
    const unsigned char *t = (const unsigned char *)ld->text;
    yaml_mark_t m = {0, 0, 0};

    for (size_t i = 0; i < offset && i < ld->len;) {
        size_t b = line_break(t + i, ld->len - i);
        if (b) {
            m.line++;
            m.column = 0;
            i += b;
        } else {
            m.column += (t[i] & 0xc0) != 0x80;
            i++;
        }
    }
    m.index = offset;
    return m;
}

static void report_yaml(struct loader *ld, const yaml_parser_t *parser)
{
    const char *problem = parser->problem ? parser->problem : "syntax error";
    yaml_mark_t m;

    switch (parser->error) {
    case YAML_MEMORY_ERROR:
        report(ld, NULL, "yaml", "out of memory (expected to be able to "
                                 "read the file)");
        break;
    case YAML_READER_ERROR:
        m = mark_at(ld, parser->problem_offset);
        if (parser->problem_value != -1)
            report(ld, &m, "yaml", "%s: #%X (expected UTF-8 text)", problem,
                   (unsigned)parser->problem_value);
        else
            report(ld, &m, "yaml", "%s (expected UTF-8 text)", problem);
        break;
    default:
        if (parser->context)
            report(ld, &parser->problem_mark, "yaml",
                   "%s %s at line %zu column %zu (expected valid YAML)",
                   problem, parser->context, parser->context_mark.line + 1,
                   parser->context_mark.column + 1);
        else
            report(ld, &parser->problem_mark, "yaml",
                   "%s (expected valid YAML)", problem);
        break;
    }
}

/*
 * libyaml has no nesting limit and its scanner slows down quadratically
 * with depth, so a file of brackets would take minutes to load. A config
 * needs three levels; this first pass, on events, stops at CONF_MAX_DEPTH
 * before anything is built. Syntax errors are left to the loading pass,
 * which reports them the same way.
 */
static int depth_ok(struct loader *ld)
{
    yaml_parser_t parser;
    yaml_event_t event;
    int depth = 0, ok = 1;

    if (!yaml_parser_initialize(&parser))
        return 1; /* the loading pass reports it */
    yaml_parser_set_input_string(&parser, (const unsigned char *)ld->text,
                                 ld->len);
    while (yaml_parser_parse(&parser, &event)) {
        yaml_event_type_t type = event.type;
        if (type == YAML_SEQUENCE_START_EVENT ||
            type == YAML_MAPPING_START_EVENT) {
            if (++depth > CONF_MAX_DEPTH) {
                report(ld, &event.start_mark, "yaml",
                       "nested deeper than %d levels (expected sections of "
                       "keys)", CONF_MAX_DEPTH);
                ok = 0;
            }
        } else if (type == YAML_SEQUENCE_END_EVENT ||
                   type == YAML_MAPPING_END_EVENT) {
            depth--;
        }
        yaml_event_delete(&event);
        if (!ok || type == YAML_STREAM_END_EVENT)
            break;
    }
    yaml_parser_delete(&parser);
    return ok;
}

/* 0, 1 when too large (reported), KVX_ERR_IO when unreadable or
 * KVX_ERR_NOMEM (reported). */
static int read_file(const char *path, char **text, size_t *len, FILE *err)
{
    FILE *f;
    char *buf;
    size_t n;
    int rc;

    f = fopen(path, "rb");
    if (!f) {
        if (err)
            fprintf(err, "%s: cannot open: %s\n", path, strerror(errno));
        return KVX_ERR_IO;
    }
    buf = malloc(CONF_MAX_FILE_BYTES + 1);
    if (!buf) {
        if (err)
            fprintf(err, "%s: cannot read: %s\n", path, strerror(ENOMEM));
        rc = KVX_ERR_NOMEM;
        goto err_close;
    }
    n = fread(buf, 1, CONF_MAX_FILE_BYTES + 1, f);
    if (ferror(f)) {
        if (err)
            fprintf(err, "%s: cannot read: %s\n", path, strerror(errno));
        rc = KVX_ERR_IO;
        goto err_free;
    }
    fclose(f);
    if (n > CONF_MAX_FILE_BYTES) {
        if (err)
            fprintf(err, "%s: file is larger than %u bytes (expected a "
                         "config file)\n", path, CONF_MAX_FILE_BYTES);
        free(buf);
        return 1;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return 0;

err_free:
    free(buf);
err_close:
    fclose(f);
    return rc;
}

int conf_load(const char *path, kvx_conf_t *conf, FILE *err)
{
    struct loader *ld;
    yaml_parser_t parser;
    yaml_document_t doc;
    char *text = NULL, why[256];
    size_t len = 0;
    int rc, problems;

    if (!path || !conf)
        return KVX_ERR_INVALID;
    rc = read_file(path, &text, &len, err);
    if (rc)
        return rc;
    ld = calloc(1, sizeof(*ld));
    if (!ld) {
        if (err)
            fprintf(err, "%s: cannot load: %s\n", path, strerror(ENOMEM));
        rc = KVX_ERR_NOMEM;
        goto err_free_text;
    }
    ld->path = path;
    ld->text = text;
    ld->len = len;
    ld->err = err;
    ld->doc = &doc;
    conf_defaults(&ld->conf);

    if (!depth_ok(ld))
        goto out;
    if (!yaml_parser_initialize(&parser)) {
        report(ld, NULL, "yaml", "out of memory (expected to be able to "
                                 "read the file)");
        goto out;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    for (int ndoc = 0;; ndoc++) {
        const yaml_node_t *root;
        /* On failure libyaml has already freed the document. */
        if (!yaml_parser_load(&parser, &doc)) {
            report_yaml(ld, &parser);
            break;
        }
        root = yaml_document_get_root_node(&doc);
        if (root && ndoc == 0)
            load_root(ld, root);
        else if (root)
            report(ld, &root->start_mark, "(top level)",
                   "a second YAML document (expected one document)");
        yaml_document_delete(&doc);
        if (!root || ndoc > 0)
            break;
    }
    yaml_parser_delete(&parser);

    /* Rules across keys, on the whole file; a refused value is not
     * checked again against its neighbours. */
    for (size_t i = 0; i < conf_nkeys; i++) {
        if (!conf_keys[i].check || ld->bad[i] ||
            conf_keys[i].check(&ld->conf, KVX_WHY(why)) == 0)
            continue;
        report(ld, ld->key_line[i] ? &ld->value_mark[i] : NULL,
               conf_keys[i].name, "%s", why);
    }

out:
    problems = ld->problems;
    if (!problems)
        memcpy(conf, &ld->conf, sizeof(*conf));
    free(ld);
    free(text);
    return problems;

err_free_text:
    free(text);
    return rc;
}
