/* log — see log.h. */
#include <stdarg.h>
#include <stdio.h>

#include "log.h"

int kvx__log_level = LOG_INFO;

void kvx__log(int prio, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    /* one write per line keeps lines whole when several processes log */
    fprintf(stderr, "<%d>kvxferd: %s\n", prio, line);
}
