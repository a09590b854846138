/*
 * reqkey — request keys; see reqkey.h.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "reqkey.h"

int reqkey_set(reqkey_t *k, const void *data, size_t len, const char *field,
               kvx_why_t *why)
{
    if (len == 0 || len > KVX_MAX_KEY)
        return why_fail(why, KVX_ERR_INVALID,
                        "%s: %zu bytes (a key is 1 to %u bytes)", field, len,
                        KVX_MAX_KEY);
    k->len = (uint32_t)len;
    memcpy(k->b, data, len);
    return 0;
}

void reqkey_from_u64(reqkey_t *k, uint64_t n)
{
    char d[24];
    int len = snprintf(d, sizeof(d), "%" PRIu64, n);
    k->len = (uint32_t)len;
    memcpy(k->b, d, (size_t)len);
}

uint64_t reqkey_to_u64(const uint8_t *b, size_t len)
{
    if (len == 0 || len > 20 || (len > 1 && b[0] == '0'))
        return 0;
    uint64_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (b[i] < '0' || b[i] > '9')
            return 0;
        uint64_t d = (uint64_t)(b[i] - '0');
        if (n > (UINT64_MAX - d) / 10)
            return 0;
        n = n * 10 + d;
    }
    return n;
}

int reqkey_eq(const reqkey_t *a, const reqkey_t *b)
{
    return a->len == b->len && !memcmp(a->b, b->b, a->len);
}

static int printable(const uint8_t *b, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (b[i] < 0x20 || b[i] > 0x7e)
            return 0;
    return len > 0;
}

static void hex(const uint8_t *b, size_t len, char *out)
{
    static const char x[] = "0123456789abcdef";
    *out++ = '0';
    *out++ = 'x';
    for (size_t i = 0; i < len; i++) {
        *out++ = x[b[i] >> 4];
        *out++ = x[b[i] & 15];
    }
    *out = 0;
}

const char *reqkey_str(const uint8_t *b, size_t len, char *buf)
{
    if (len > KVX_MAX_KEY)
        len = KVX_MAX_KEY;
    if (printable(b, len)) {
        memcpy(buf, b, len);
        buf[len] = 0;
    } else
        hex(b, len, buf);
    return buf;
}

const char *reqkey_json(const uint8_t *b, size_t len, char *buf)
{
    if (len > KVX_MAX_KEY)
        len = KVX_MAX_KEY;
    char *o = buf;
    *o++ = '"';
    if (printable(b, len)) {
        for (size_t i = 0; i < len; i++) {
            if (b[i] == '"' || b[i] == '\\')
                *o++ = '\\';
            *o++ = (char)b[i];
        }
    } else {
        hex(b, len, o);
        o += strlen(o);
    }
    *o++ = '"';
    *o = 0;
    return buf;
}
