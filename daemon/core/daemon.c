/* daemon — the shared state and its small helpers; see daemon.h. */
#include <time.h>

#include "daemon.h"

kvxd_t kvxd;

uint64_t kvxd_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void kvxd_count_error(int code)
{
    if (code < 0 && -code < 32)
        kvxd.stats.errors_by_code[-code]++;
}
