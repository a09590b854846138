/*
 * test_pacing — the engines' GPU paces (daemon/local/pacing.c) on the
 * real copy lanes (daemon/copy/copy.c), with no GPU: each device's lane
 * goes at the lowest pace of the sessions with a pool there, beside
 * gpu.pace (and its reload); a pace without a device waits for one; a
 * lapse and a session's end give the lane back; the status says who set
 * each device's pace; a device that users share takes no engine's pace.
 * The integration tests (t_pace.c) see the same through the daemon, less
 * the devices, which the CPU build cannot have: here pacing.c sees a
 * table of pools the tests fill in place of the registry.
 */
#include "../../daemon/copy/pool.h"

static pool_t fake[8];
static uint32_t nfake;
static uint32_t fake_walks; /* pool_list() calls: walks of every pool */

static uint32_t fake_pool_count(void)
{
    return nfake;
}

static uint32_t fake_pool_list(pool_t **out, uint32_t max)
{
    uint32_t n = nfake < max ? nfake : max;
    fake_walks++;
    for (uint32_t i = 0; i < n; i++)
        out[i] = &fake[i];
    return n;
}

#define pool_count fake_pool_count
#define pool_list fake_pool_list
#include "../../daemon/local/pacing.c"
#undef pool_count
#undef pool_list

#include "tests/test.h"

#include <string.h>
#include <unistd.h>

static uv_loop_t loop;

/* A live GPU pool of user uid on device d in the table. */
static pool_t *gpu_pool(uint32_t uid, int d)
{
    pool_t *p = &fake[nfake++];
    memset(p, 0, sizeof(*p));
    p->gpu = 1;
    p->device = d;
    p->uid = uid;
    return p;
}

static void setup(void)
{
    nfake = 0;
    conf_defaults(&kvxd.conf);
    CHECK_EQ(uv_loop_init(&loop), 0);
    CHECK_EQ(copy_init(&loop, 1, 0, 0, 0), 0);
    CHECK_EQ(pacing_init(&loop), 0);
}

static uint64_t lane(int device)
{
    uint64_t engines;
    return copy_gpu_pace(device, &engines);
}

static uint64_t engines_of(int device)
{
    uint64_t engines;
    (void)copy_gpu_pace(device, &engines);
    return engines;
}

#define DEV(d) (1ull << (d))

/* Two sessions on device 0, one of them on device 1 too: each device at
 * its sessions' lowest; gpu.pace lower still wins, and a reload keeps
 * the sessions' paces. */
TEST(pacing_lowest_per_device_and_config)
{
    setup();
    CHECK_EQ(pacing_set(1, 8192, 0, DEV(0)), 0);
    CHECK_EQ(pacing_set(2, 1000, 0, DEV(0) | DEV(1)), 0);
    CHECK_EQ(lane(0), 1000);
    CHECK_EQ(lane(1), 1000);
    CHECK_EQ(lane(2), 0);
    CHECK_EQ(pacing_set(2, 0, 0, DEV(0) | DEV(1)), 0); /* withdrawn */
    CHECK_EQ(lane(0), 8192);
    CHECK_EQ(lane(1), 0);
    copy_set_pace(0, 4096); /* gpu.pace, as a reload sets it */
    CHECK_EQ(lane(0), 4096);
    CHECK_EQ(engines_of(0), 8192);
    CHECK_EQ(lane(1), 4096);
    copy_set_pace(0, 0); /* gpu.pace off: the engine's again */
    CHECK_EQ(lane(0), 8192);
    CHECK_EQ(lane(1), 0);
    pacing_cleanup();
    CHECK_EQ(lane(0), 0);
}

/* A pace set before any GPU pool applies once one registers, to its
 * device, and moves with the session's pools. */
TEST(pacing_waits_for_a_device)
{
    setup();
    CHECK_EQ(pacing_set(7, 5000, 0, 0), 0);
    for (int d = 0; d < COPY_PACE_DEVICES; d++)
        CHECK_EQ(lane(d), 0);
    CHECK_EQ(pacing_sessions(), 1);
    pacing_devices(7, DEV(3));
    CHECK_EQ(lane(3), 5000);
    pacing_devices(7, DEV(5));
    CHECK_EQ(lane(3), 0);
    CHECK_EQ(lane(5), 5000);
    pacing_devices(99, DEV(3)); /* a session without a pace: nothing */
    CHECK_EQ(lane(3), 0);
    pacing_end(7);
    CHECK_EQ(lane(5), 0);
    CHECK_EQ(pacing_sessions(), 0);
    pacing_cleanup();
}

/* A pace lapses hold_ms after its last call (the loop's timer); one of
 * hold 0 stays; calling again moves the lapse. */
TEST(pacing_lapses_on_the_loop)
{
    setup();
    CHECK_EQ(pacing_set(1, 3000, 50, DEV(0)), 0);
    CHECK_EQ(pacing_set(2, 9000, 0, DEV(0)), 0);
    CHECK_EQ(lane(0), 3000);
    uint64_t t0 = uv_now(&loop);
    while (lane(0) == 3000 && uv_now(&loop) - t0 < 5000)
        uv_run(&loop, UV_RUN_ONCE);
    CHECK(uv_now(&loop) - t0 >= 50); /* not before its hold */
    CHECK_EQ(lane(0), 9000);         /* session 2's, which stays */
    CHECK_EQ(pacing_sessions(), 1);
    CHECK_EQ(g.armed_ms, 0); /* nothing left to lapse */
    pacing_end(2);
    CHECK_EQ(lane(0), 0);
    pacing_cleanup();
}

/* A hold counts from the call, not from the start of the loop's turn
 * that took it: a turn that spent 120 ms before the call (an import, a
 * large request) leaves the loop's clock (uv_now) behind, and a hold of
 * 150 ms counted from it would lapse 120 ms early. */
TEST(pacing_hold_counts_from_the_call)
{
    setup();
    uv_update_time(&loop);
    usleep(120000); /* the turn's work before the GpuPace frame */
    uint64_t t0 = uv_hrtime();
    CHECK_EQ(pacing_set(1, 3000, 150, DEV(0)), 0);
    while (lane(0) == 3000 && uv_hrtime() - t0 < 5000000000ull)
        uv_run(&loop, UV_RUN_ONCE);
    CHECK_EQ(lane(0), 0);
    uint64_t held_ms = (uv_hrtime() - t0) / 1000000;
    if (held_ms < 150)
        fprintf(stderr, "lapsed %llu ms after the call\n",
                (unsigned long long)held_ms);
    CHECK(held_ms >= 150); /* never before its hold */
    pacing_cleanup();
}

/* The status names gpu.pace, the engines, and each device's pace with
 * who set it. */
TEST(pacing_status_says_who)
{
    setup();
    char buf[1024];
    pacing_status(buf, sizeof(buf));
    CHECK_EQ(buf[0], 0);
    kvxd.conf.gpu_pace = 4096;
    copy_set_pace(0, 4096);
    CHECK_EQ(pacing_set(1, 1000, 0, DEV(0)), 0);
    CHECK_EQ(pacing_set(2, 2000, 0, DEV(0)), 0);
    CHECK_EQ(pacing_set(3, 8192, 0, DEV(1)), 0);
    CHECK_EQ(pacing_set(4, 500, 0, 0), 0);
    pacing_status(buf, sizeof(buf));
    CHECK_STR_CONTAINS(buf, "gpu pace: config 4096 B/ms, engines 4 (lowest "
                            "500 B/ms, 1 without a GPU pool), device 0 "
                            "1000 B/ms (2 engines), device 1 4096 B/ms "
                            "(config)");
    pacing_cleanup();
}

/* Users who share a device: no engine's pace binds it (one tenant would
 * slow another's transfers), gpu.pace still does, and the status says
 * why; a device of one user keeps it. The rule follows the pools: the
 * other user's pool leaving gives the device the pace back, and one
 * arriving takes it away at once, with no call from the engine. */
TEST(pacing_not_across_users)
{
    setup();
    gpu_pool(1000, 0);
    pool_t *other = gpu_pool(2000, 0);
    gpu_pool(1000, 1);
    pacing_devices(2, DEV(0)); /* as each registration tells it */
    CHECK_EQ(pacing_set(1, 1000, 0, DEV(0) | DEV(1)), 0);
    CHECK_EQ(pacing_shared(), DEV(0));
    CHECK_EQ(lane(0), 0);
    CHECK_EQ(lane(1), 1000);
    char buf[1024];
    pacing_status(buf, sizeof(buf));
    CHECK_STR_CONTAINS(buf, "device 0 unpaced (1 engine's not applied: "
                            "users share it), device 1 1000 B/ms (1 "
                            "engine)");
    copy_set_pace(0, 4096); /* gpu.pace binds whoever shares the device */
    CHECK_EQ(lane(0), 4096);
    pacing_status(buf, sizeof(buf));
    CHECK_STR_CONTAINS(buf, "device 0 4096 B/ms (1 engine's not applied: "
                            "users share it)");
    copy_set_pace(0, 0);
    other->released = 1; /* the other user's pool leaves */
    pacing_devices(2, 0);
    CHECK_EQ(pacing_shared(), 0);
    CHECK_EQ(lane(0), 1000);
    gpu_pool(2000, 0); /* and another arrives: its registration alone */
    pacing_devices(2, DEV(0));
    CHECK_EQ(lane(0), 0);
    CHECK_EQ(lane(1), 1000);
    /* the other user's session ends: its pools are released first */
    fake[nfake - 1].released = 1;
    pacing_end(2);
    CHECK_EQ(lane(0), 1000);
    pacing_cleanup();
}

/* A GpuPace, which an engine sends each step, and its lapse walk none
 * of the daemon's pools: which devices users share is found when a GPU
 * pool comes or goes. Walked at each call, a flood of GpuPace from four
 * ranks, with 16384 host pools registered, held the loop 300 ms. */
TEST(pacing_set_walks_no_pool)
{
    setup();
    gpu_pool(1000, 0);
    gpu_pool(2000, 0);
    pacing_devices(2, DEV(0));
    CHECK_EQ(pacing_shared(), DEV(0));
    uint32_t walks = fake_walks;
    for (uint64_t i = 1; i <= 100; i++)
        CHECK_EQ(pacing_set(1, 1000 * i, 0, DEV(0)), 0);
    CHECK_EQ(pacing_set(1, 0, 0, DEV(0)), 0);
    CHECK_EQ(pacing_set(1, 4096, 20, DEV(0)), 0);
    uint64_t t0 = uv_now(&loop);
    while (pacing_sessions() && uv_now(&loop) - t0 < 5000)
        uv_run(&loop, UV_RUN_ONCE);
    CHECK_EQ(pacing_sessions(), 0); /* lapsed */
    CHECK_EQ(fake_walks, walks);
    CHECK_EQ(pacing_shared(), DEV(0)); /* still known */
    CHECK_EQ(lane(0), 0);
    pacing_cleanup();
}
