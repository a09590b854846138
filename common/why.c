/* why — see why.h. */
#include "why.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static void vset(kvx_why_t *why, const char *fmt, va_list ap)
{
    if (why && why->msg && why->size)
        vsnprintf(why->msg, why->size, fmt, ap);
}

void why_set(kvx_why_t *why, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vset(why, fmt, ap);
    va_end(ap);
}

int why_fail(kvx_why_t *why, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vset(why, fmt, ap);
    va_end(ap);
    return code;
}

void why_prefix(kvx_why_t *why, const char *fmt, ...)
{
    char head[256];
    va_list ap;
    size_t hl, ml;

    if (!why || !why->msg || !why->size)
        return;
    va_start(ap, fmt);
    vsnprintf(head, sizeof(head), fmt, ap);
    va_end(ap);
    hl = strlen(head);
    ml = strnlen(why->msg, why->size - 1);
    if (hl + 2 >= why->size) { /* room for the prefix alone */
        snprintf(why->msg, why->size, "%s", head);
        return;
    }
    if (hl + 2 + ml >= why->size) /* the message's tail is cut */
        ml = why->size - hl - 3;
    memmove(why->msg + hl + 2, why->msg, ml);
    memcpy(why->msg, head, hl);
    memcpy(why->msg + hl, ": ", 2);
    why->msg[hl + 2 + ml] = 0;
}
