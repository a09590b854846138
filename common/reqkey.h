/*
 * reqkey — request keys, shared by daemon and library: a request is named
 * by opaque bytes, 1 to KVX_MAX_KEY (vLLM's string request ids, SGLang's
 * bootstrap room). Pure functions; owns nothing.
 *
 * The uint64_t forms of the API name request n by the key of its decimal
 * digits ("42"), so they and the byte forms meet, and messages print it
 * as before. Keys of printable ASCII print as themselves, others as hex.
 */
#ifndef KVX_REQKEY_H
#define KVX_REQKEY_H

#include <stddef.h>
#include <stdint.h>

#include "kvxfer.h"
#include "why.h"

typedef struct reqkey {
    uint32_t len;
    uint8_t b[KVX_MAX_KEY];
} reqkey_t;

/* Longest reqkey_str() result, its NUL included: quotes and hex. */
#define REQKEY_STR_MAX (2 * KVX_MAX_KEY + 8)

/* *k from bytes: 0, or KVX_ERR_INVALID with why naming field (empty, or
 * over KVX_MAX_KEY). */
int reqkey_set(reqkey_t *k, const void *data, size_t len, const char *field,
               kvx_why_t *why);
/* The key of request n: its decimal digits. */
void reqkey_from_u64(reqkey_t *k, uint64_t n);
/* n when the key is the decimal digits of n (no sign, no leading zero),
 * else 0. */
uint64_t reqkey_to_u64(const uint8_t *b, size_t len);
int reqkey_eq(const reqkey_t *a, const reqkey_t *b);
/* For messages: 'vllm-req-1' as is, or 0x0102... (buf of REQKEY_STR_MAX
 * bytes); returns buf. */
const char *reqkey_str(const uint8_t *b, size_t len, char *buf);
/* A JSON string of the key (printable ASCII as is, escaped; else
 * "0x..."): at most REQKEY_STR_MAX + KVX_MAX_KEY bytes; returns buf. */
const char *reqkey_json(const uint8_t *b, size_t len, char *buf);

#endif /* KVX_REQKEY_H */
