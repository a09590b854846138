/*
 * fuzz_frame — frame_reader reassembly, and every whole frame through the
 * Request decoder.
 *
 * Input: two bytes of cap (little-endian), one byte seeding the chunk
 * sizes, then the byte stream. The stream is fed twice, once whole and
 * once in seeded chunks through frame_reader_space/commit; both feeds
 * must yield the same frames (each exactly the bytes after its length
 * prefix, never longer than the cap) and stop at the same place with the
 * same outcome.
 */
#include "../../common/frame.c"

#include <stdio.h>

#include "kvxfer.pb-c.h"
#include "pb_quirk.h"

#define MUST(c)                                                             \
    do {                                                                    \
        if (!(c)) {                                                         \
            fprintf(stderr, "fuzz_frame: %s:%d: %s\n", __FILE__, __LINE__,  \
                    #c);                                                    \
            abort();                                                        \
        }                                                                   \
    } while (0)

struct outcome {
    size_t pos;      /* stream bytes taken by whole frames */
    int rc;          /* 0, or KVX_ERR_PROTOCOL */
    uint32_t frames;
};

static void feed(const uint8_t *data, size_t size, uint32_t cap,
                 uint32_t seed, struct outcome *o)
{
    frame_reader_t r;
    frame_reader_init(&r);
    memset(o, 0, sizeof(*o));
    size_t in = 0;
    while (in < size && o->rc == 0) {
        size_t n = size - in, room;
        if (seed) {
            seed = seed * 1103515245u + 12345u;
            n = 1 + (seed >> 16) % 97;
            if (n > size - in)
                n = size - in;
        }
        uint8_t *p = frame_reader_space(&r, n, &room);
        MUST(p != NULL && room >= n);
        memcpy(p, data + in, n);
        frame_reader_commit(&r, n);
        in += n;
        const uint8_t *msg;
        uint32_t len;
        int rc;
        while ((rc = frame_reader_next(&r, cap, &msg, &len)) == 1) {
            MUST(len <= cap);
            MUST(o->pos + FRAME_HDR + len <= size);
            MUST(frame_get_len(data + o->pos) == len);
            MUST(memcmp(msg, data + o->pos + FRAME_HDR, len) == 0);
            o->pos += FRAME_HDR + len;
            o->frames++;
            Kvxfer__Request *rq = kvxfer__request__unpack(NULL, len, msg);
            if (rq) {
                size_t pn = kvxfer__request__get_packed_size(rq);
                uint8_t *pb = malloc(pn ? pn : 1);
                MUST(pb != NULL);
                MUST(kvxfer__request__pack(rq, pb) == pn);
                Kvxfer__Request *again = kvxfer__request__unpack(NULL, pn, pb);
                MUST(again != NULL || has_field0(&rq->base));
                MUST(!again || again->body_case == rq->body_case);
                if (again)
                    kvxfer__request__free_unpacked(again, NULL);
                free(pb);
                kvxfer__request__free_unpacked(rq, NULL);
            }
        }
        if (rc < 0) {
            MUST(rc == KVX_ERR_PROTOCOL);
            MUST(len > cap);
            MUST(o->pos + FRAME_HDR <= size);
            MUST(frame_get_len(data + o->pos) == len);
            o->rc = rc;
        }
    }
    if (o->rc == 0) /* what is left is an incomplete frame */
        MUST(size - o->pos < FRAME_HDR ||
             size - o->pos < FRAME_HDR + (size_t)frame_get_len(data + o->pos));
    frame_reader_cleanup(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3)
        return 0;
    uint32_t cap = (uint32_t)data[0] | (uint32_t)data[1] << 8;
    uint32_t seed = data[2] | 1u;
    data += 3;
    size -= 3;
    struct outcome whole, chunked;
    feed(data, size, cap, 0, &whole);
    feed(data, size, cap, seed, &chunked);
    MUST(whole.pos == chunked.pos);
    MUST(whole.rc == chunked.rc);
    MUST(whole.frames == chunked.frames);
    return 0;
}
