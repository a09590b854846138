/*
 * conf_int — what conf.c and conf_keys.c share, private to daemon/core:
 * the shape of a key and the table of keys itself.
 */
#ifndef KVX_CONF_INT_H
#define KVX_CONF_INT_H

#include <stddef.h>
#include <stdint.h>

#include "common/why.h"
#include "conf.h"

#define KiB (1024ull)
#define MiB (1024ull * KiB)
#define GiB (1024ull * MiB)

enum conf_type {
    CONF_STRING, /* char[] field; length bound by the field size */
    CONF_PATH,   /* CONF_STRING that must be an absolute path */
    CONF_MODE,   /* permission bits, octal as chmod reads them */
    CONF_U32,    /* plain decimal integer */
    CONF_SIZE,   /* bytes, optionally with a KiB/MiB/GiB suffix */
    CONF_MS,     /* duration, decimal integer milliseconds */
    CONF_IDS,    /* list of uint32 ids: uint32_t[] field + unsigned count */
    CONF_LEVEL,  /* log level name, stored as a syslog priority (int) */
};

struct conf_key {
    const char *name; /* "section.key" */
    enum conf_type type;
    size_t off;          /* offsetof(kvx_conf_t, field) */
    size_t size;         /* sizeof field (4 or 8 for numbers) */
    size_t count_off;    /* CONF_IDS: offsetof the entry count */
    uint64_t def;        /* numeric default */
    const char *def_str; /* CONF_STRING/CONF_PATH default */
    uint64_t min, max;   /* numeric bounds; CONF_IDS: bounds per id */
    int reloadable;      /* applied on SIGHUP without a restart */
    /* CONF_IDS: an entry may also be a group name, resolved to its gid
     * (getgrnam_r) each time the file is loaded */
    int group_names;
    /* Rules beyond type and bounds, checked once the whole file is read.
     * Returns 0, or 1 with the problem written to why. */
    int (*check)(const kvx_conf_t *conf, kvx_why_t *why);
    const char *help; /* one line, no '|' (it lands in a table) */
};

/* The table (conf_keys.c): a section's keys are together, the loader
 * relies on it. */
extern const struct conf_key conf_keys[];
extern const size_t conf_nkeys;

/* Room in the loader's per-key arrays; conf_keys.c checks that the
 * table fits. */
#define CONF_MAX_KEYS 128

/* A user's text made safe to print and short enough to read (conf.c). */
const char *conf_shown(const char *s, size_t len, char *buf, size_t n);

#endif /* KVX_CONF_INT_H */
