/* frame — length-prefixed frame reassembly; see frame.h. */
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "kvxfer.h"

void frame_reader_init(frame_reader_t *r) { memset(r, 0, sizeof(*r)); }

void frame_reader_cleanup(frame_reader_t *r)
{
    free(r->buf);
    memset(r, 0, sizeof(*r));
}

/* The capacity that holds want more bytes after the consumed frames are
 * dropped: the current one, or doubled from it until it does. */
static size_t cap_for(const frame_reader_t *r, size_t want)
{
    size_t len = r->len - r->off, ncap = r->cap ? r->cap : 4096;
    while (ncap - len < want)
        ncap *= 2;
    return ncap > r->cap ? ncap : r->cap;
}

size_t frame_reader_cap_for(const frame_reader_t *r, size_t want)
{
    return cap_for(r, want);
}

uint8_t *frame_reader_space(frame_reader_t *r, size_t want, size_t *room)
{
    if (r->off > 0 && (r->off == r->len || r->cap - r->len < want)) {
        /* drop consumed frames before growing */
        memmove(r->buf, r->buf + r->off, r->len - r->off);
        r->len -= r->off;
        r->off = 0;
    }
    if (r->cap - r->len < want) {
        size_t ncap = cap_for(r, want);
        uint8_t *nb = realloc(r->buf, ncap);
        if (!nb)
            return NULL;
        r->buf = nb;
        r->cap = ncap;
    }
    *room = r->cap - r->len;
    return r->buf + r->len;
}

size_t frame_reader_shrink(frame_reader_t *r, size_t min_cap)
{
    size_t held = r->len - r->off;
    if (!held) {
        frame_reader_cleanup(r);
        return 0;
    }
    if (held > r->cap / 4 || r->cap <= min_cap)
        return r->cap;
    memmove(r->buf, r->buf + r->off, held);
    r->len = held;
    r->off = 0;
    size_t ncap = held * 2 > min_cap ? held * 2 : min_cap;
    uint8_t *nb = realloc(r->buf, ncap);
    if (nb) { /* else the larger buffer stays */
        r->buf = nb;
        r->cap = ncap;
    }
    return r->cap;
}

void frame_reader_commit(frame_reader_t *r, size_t n) { r->len += n; }

int frame_reader_next(frame_reader_t *r, uint32_t max_len,
                      const uint8_t **msg, uint32_t *len)
{
    size_t avail = r->len - r->off;
    if (avail < FRAME_HDR)
        return 0;
    uint32_t n = frame_get_len(r->buf + r->off);
    if (n > max_len) {
        *len = n;
        return KVX_ERR_PROTOCOL;
    }
    if (avail < FRAME_HDR + (size_t)n)
        return 0;
    *msg = r->buf + r->off + FRAME_HDR;
    *len = n;
    r->off += FRAME_HDR + n;
    return 1;
}
