/* reqrec — see reqrec.h. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "reqkey.h"
#include "reqrec.h"

const char *reqrec_outcome(int kind)
{
    switch (kind) {
    case KVX_EVENT_COMPLETE:
        return "complete";
    case KVX_EVENT_ERROR:
        return "error";
    case KVX_EVENT_CANCELLED:
        return "cancelled";
    case KVX_EVENT_TIMED_OUT:
        return "timed_out";
    default:
        return "unknown";
    }
}

uint64_t reqrec_bandwidth(const reqrec_t *r)
{
    uint64_t us = r->end_us > r->start_us ? r->end_us - r->start_us : 0;
    if (!us)
        return 0;
    return (uint64_t)((double)r->bytes * 1e6 / (double)us);
}

/* s as a JSON string: quotes, backslashes and control bytes escaped. */
static void jstr(char *out, size_t cap, const char *s)
{
    size_t o = 0;
    out[o++] = '"';
    for (; *s && o + 8 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            o += (size_t)snprintf(out + o, cap - o, "\\%c", c);
        else if (c < 0x20)
            o += (size_t)snprintf(out + o, cap - o, "\\u%04x", c);
        else
            out[o++] = (char)c;
    }
    out[o++] = '"';
    out[o] = 0;
}

/* RFC 3339, UTC, microseconds. */
static void stamp(char *out, size_t cap, uint64_t us)
{
    time_t t = (time_t)(us / 1000000);
    struct tm tm;
    gmtime_r(&t, &tm);
    char d[32];
    strftime(d, sizeof(d), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, cap, "%s.%06lluZ", d, (unsigned long long)(us % 1000000));
}

int reqrec_json(const reqrec_t *r, char *buf, size_t len)
{
    char inst[2 * REQREC_INSTANCE_MAX + 8], ctx[2 * REQREC_INSTANCE_MAX + 8];
    char gen[2 * REQREC_INSTANCE_MAX + 8];
    char key[REQKEY_STR_MAX + KVX_MAX_KEY], t0[40], t1[40];
    jstr(inst, sizeof(inst), r->instance);
    jstr(ctx, sizeof(ctx), r->context);
    jstr(gen, sizeof(gen), r->generation);
    reqkey_json(r->key, r->key_len, key);
    stamp(t0, sizeof(t0), r->start_us);
    stamp(t1, sizeof(t1), r->end_us);
    return snprintf(
        buf, len,
        "{\"instance\":%s,\"key\":%s,\"side\":\"%s\","
        "\"context_instance\":%s,\"generation_instance\":%s,"
        "\"path\":\"%s\",\"bytes\":%llu,"
        "\"start\":\"%s\",\"end\":\"%s\",\"duration_us\":%llu,"
        "\"bandwidth_bytes_per_s\":%llu,\"outcome\":\"%s\",\"code\":\"%s\"}",
        inst, key, r->side ? r->side : "generation", ctx, gen,
        r->path ? r->path : "-", (unsigned long long)r->bytes, t0, t1,
        (unsigned long long)(r->end_us > r->start_us ? r->end_us - r->start_us
                                                     : 0),
        (unsigned long long)reqrec_bandwidth(r), reqrec_outcome(r->outcome),
        r->code ? kvx_status_name(r->code) : "OK");
}
