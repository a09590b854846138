/* fault — failures injected for tests; see fault.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "kvxfer.h"
#include "log.h"

static const char *const names[FAULT_NSITES] = {
    "gather",    "scatter",  "batch",      "lanes",      "lane_hold",
    "conn_hold", "own_addr", "loop_stall", "start_hold", "down_hold"};
static unsigned long when[FAULT_NSITES]; /* 0: never */
static unsigned long seen[FAULT_NSITES];

int fault_init(kvx_why_t *why)
{
    const char *env = getenv("KVXFERD_FAULT");
    if (!env || !*env)
        return 0;
    char buf[256];
    if (strlen(env) >= sizeof(buf))
        return why_fail(why, KVX_ERR_INVALID,
                        "KVXFERD_FAULT: longer than %zu bytes",
                        sizeof(buf) - 1);
    strcpy(buf, env);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t;
         t = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(t, ':'), *end = NULL;
        int site = -1;
        for (int i = 0; colon && i < FAULT_NSITES; i++)
            if ((size_t)(colon - t) == strlen(names[i]) &&
                !strncmp(t, names[i], strlen(names[i])))
                site = i;
        unsigned long n = colon ? strtoul(colon + 1, &end, 10) : 0;
        if (site < 0 || !n || !end || *end)
            return why_fail(why, KVX_ERR_INVALID,
                            "KVXFERD_FAULT: '%.64s' is not SITE:N "
                            "(N >= 1; sites: gather, scatter, batch, lanes, "
                            "lane_hold, conn_hold, own_addr, "
                            "loop_stall, start_hold, down_hold)",
                            t);
        when[site] = n;
        log_warn("fault injection (tests only): %s %lu fails", names[site], n);
    }
    return 0;
}

int fault_hit(fault_site_t site)
{
    if (!when[site])
        return 0;
    return __atomic_add_fetch(&seen[site], 1, __ATOMIC_RELAXED) == when[site];
}

int fault_armed(fault_site_t site)
{
    return when[site] != 0;
}

unsigned long fault_value(fault_site_t site)
{
    return when[site];
}
