/*
 * bench_pattern — the reference KV bytes the bench and the tests check
 * against: one row (head_dim elements) per (request, layer, kv, token,
 * head), in global coordinates, so the expected destination bytes follow
 * from the two configurations alone, never from the daemon's plan.
 * Shared by host C and CUDA code.
 */
#ifndef KVX_BENCH_PATTERN_H
#define KVX_BENCH_PATTERN_H

#include <stdint.h>

#ifdef __CUDACC__
#define PAT_FN static inline __host__ __device__
#else
#define PAT_FN static inline
#endif

PAT_FN uint64_t pat_mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

PAT_FN uint64_t pat_seed(uint64_t r, uint32_t l, uint32_t kv, uint32_t t,
                         uint32_t h)
{
    return pat_mix(r * 0x9E3779B97F4A7C15ULL ^ ((uint64_t)l << 48) ^
                   ((uint64_t)kv << 47) ^ ((uint64_t)t << 20) ^ h);
}

/* Byte i of the row with this seed. */
PAT_FN uint8_t pat_byte(uint64_t seed, uint32_t i)
{
    uint64_t w = seed + (uint64_t)(i & ~7u) * 0x9E3779B97F4A7C15ULL;
    return (uint8_t)(w >> (8 * (i & 7)));
}

/* Eight bytes at i (a multiple of 8), little-endian. */
PAT_FN uint64_t pat_word(uint64_t seed, uint32_t i)
{
    return seed + (uint64_t)i * 0x9E3779B97F4A7C15ULL;
}

#endif
