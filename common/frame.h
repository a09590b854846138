/*
 * frame — the wire framing shared by daemon and library: a u32
 * little-endian length, then one protobuf message of that many bytes.
 *
 * frame_reader accumulates stream bytes and hands out whole frames. It
 * checks the length prefix against the caller's cap before it grows its
 * buffer, so a peer cannot make it allocate more than cap + 4 bytes.
 */
#ifndef KVX_FRAME_H
#define KVX_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define FRAME_HDR 4
/* fds (SCM_RIGHTS) that travel with one send: the library sends more in
 * batches of this many, each with the first byte of its own piece of the
 * frame, and the daemon's receive buffer holds this many. */
#define FRAME_FDS_PER_SEND 64

typedef struct frame_reader {
    uint8_t *buf;
    size_t len;   /* bytes held */
    size_t cap;   /* bytes allocated */
    size_t off;   /* start of the next unconsumed frame */
} frame_reader_t;

void frame_reader_init(frame_reader_t *r);
void frame_reader_cleanup(frame_reader_t *r);
/* Space for at least want more bytes; returns pointer and writes *room. */
uint8_t *frame_reader_space(frame_reader_t *r, size_t want, size_t *room);
void frame_reader_commit(frame_reader_t *r, size_t n);
/* The capacity frame_reader_space(r, want) would leave r with (its
 * current one when no growth is needed): for charging memory first. */
size_t frame_reader_cap_for(const frame_reader_t *r, size_t want);
/* Give back memory the reader no longer needs: none when it holds no
 * bytes (capacity 0), else drop the consumed frames and, when what is
 * left fits a quarter of the buffer, shrink it to min_cap or to twice
 * what is left, whichever is larger. Returns the new capacity. */
size_t frame_reader_shrink(frame_reader_t *r, size_t min_cap);
/*
 * Next whole frame: returns 1 and sets *msg and *len (valid until the next
 * call), 0 if more bytes are needed, KVX_ERR_PROTOCOL if the announced
 * length exceeds max_len (*len holds the announced length).
 */
int frame_reader_next(frame_reader_t *r, uint32_t max_len,
                      const uint8_t **msg, uint32_t *len);

static inline void frame_put_len(uint8_t *p, uint32_t len)
{
    p[0] = len & 0xff;
    p[1] = (len >> 8) & 0xff;
    p[2] = (len >> 16) & 0xff;
    p[3] = (len >> 24) & 0xff;
}

static inline uint32_t frame_get_len(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}

#endif /* KVX_FRAME_H */
