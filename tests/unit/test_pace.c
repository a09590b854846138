/*
 * test_pace — the pace's arithmetic (daemon/copy/pace.h): when a lane's
 * next copy may start, the burst an idle lane allows, and no overflow at
 * the keys' bounds.
 */
#include "copy/pace.h"

#include "tests/test.h"

#define MS 1000000ull

/* No pace: every copy starts now, and the clock never moves. */
TEST(pace_off_never_waits)
{
    pace_t p = {0};
    pace_charge(&p, 5 * MS, 1ull << 40);
    CHECK_EQ(pace_wait(&p, 5 * MS), 0);
    CHECK_EQ(p.t_ns, 0);
}

/* 1 MiB a millisecond: an idle lane starts a millisecond's worth at
 * once; past that each MiB waits its millisecond, in order. */
TEST(pace_burst_then_rate)
{
    pace_t p = {.per_ms = 1 << 20};
    uint64_t now = 100 * MS;
    CHECK_EQ(pace_wait(&p, now), 0);
    pace_charge(&p, now, 1 << 20); /* paid from the burst */
    CHECK_EQ(p.t_ns, now);
    CHECK_EQ(pace_wait(&p, now), 0);
    pace_charge(&p, now, 1 << 20); /* the next MiB: a millisecond ahead */
    CHECK_EQ(pace_wait(&p, now), MS);
    CHECK_EQ(pace_wait(&p, now + MS / 2), MS / 2);
    CHECK_EQ(pace_wait(&p, now + MS), 0);
    /* half a MiB: half a millisecond */
    pace_charge(&p, now + MS, 1 << 19);
    CHECK_EQ(pace_wait(&p, now + MS), MS / 2);
}

/* A long pause saves up no more than one burst. */
TEST(pace_idle_saves_one_burst)
{
    pace_t p = {.per_ms = 4096};
    pace_charge(&p, 10 * MS, 4096);
    uint64_t later = 10 * 1000 * MS; /* ten seconds idle */
    pace_charge(&p, later, 4096);
    CHECK_EQ(pace_wait(&p, later), 0);
    pace_charge(&p, later, 4096);
    CHECK_EQ(pace_wait(&p, later), MS);
}

/* The keys' bounds: 1 TiB a millisecond, and a charge of 1 TiB at one
 * byte a millisecond (10^18 ns), neither overflows. */
TEST(pace_bounds_no_overflow)
{
    pace_t p = {.per_ms = 1ull << 40};
    pace_charge(&p, 0, (1ull << 40) * 3);
    CHECK_EQ(p.t_ns, 3 * MS); /* at 0, no burst behind it */
    pace_t q = {.per_ms = 1};
    pace_charge(&q, 0, 1ull << 40);
    CHECK_EQ(q.t_ns, (1ull << 40) * MS);
    pace_t r = {.per_ms = 3};
    pace_charge(&r, 0, 1);
    CHECK_EQ(r.t_ns, MS / 3);
}

/* A new pace applies to what the lane owes: 8 s owed at 128 bytes a
 * millisecond (one MiB started) is 16 us at 64 MiB, then 16 s at 64;
 * off, it owes nothing, and a pace set again starts from an idle lane. */
TEST(pace_set_applies_to_what_is_owed)
{
    pace_t p = {.per_ms = 128};
    uint64_t now = 100 * MS;
    pace_charge(&p, now, 1 << 20); /* 8192 ms, less the burst */
    CHECK_EQ(pace_wait(&p, now), 8191 * MS);
    pace_set(&p, now, 64 << 20);
    CHECK_EQ(p.per_ms, 64 << 20);
    CHECK_EQ(pace_wait(&p, now), 8191 * MS / (512 * 1024)); /* 15.6 us */
    pace_set(&p, now, 64);
    CHECK_EQ(pace_wait(&p, now), 15623ull << 20); /* 16.4 s */
    pace_set(&p, now, 0);
    CHECK_EQ(pace_wait(&p, now), 0);
    pace_set(&p, now, 1 << 20);
    CHECK_EQ(pace_wait(&p, now), 0);
    pace_charge(&p, now, 1 << 20); /* from an idle lane's burst */
    CHECK_EQ(pace_wait(&p, now), 0);
    /* the bounds: 2^60 bytes started at a TiB a millisecond, owed at
     * one byte a millisecond, are capped, not wrapped */
    pace_t q = {.per_ms = 1ull << 40};
    pace_charge(&q, 0, 1ull << 60);
    pace_set(&q, 0, 1);
    CHECK_EQ(q.t_ns, 1ull << 62);
    pace_set(&q, 0, 1ull << 40);
    CHECK_EQ(q.t_ns, (1ull << 62) >> 40);
}

/* A lane bound by several paces (gpu.pace, the engines' GpuPace) goes
 * at the lowest that is set. */
TEST(pace_lowest_of_those_set)
{
    CHECK_EQ(pace_lowest(0, 0), 0);
    CHECK_EQ(pace_lowest(4096, 0), 4096);
    CHECK_EQ(pace_lowest(0, 4096), 4096);
    CHECK_EQ(pace_lowest(4096, 1000), 1000);
    CHECK_EQ(pace_lowest(1000, 4096), 1000);
    CHECK_EQ(pace_lowest(1ull << 40, 1ull << 40), 1ull << 40);
}
