/*
 * test_frame — the u32 little-endian length prefix and frame_reader:
 * reassembly across any split point, the cap checked before anything is
 * allocated, compaction of consumed frames, and a few thousand random and
 * mutated streams through the reader and the Request decoder.
 */
#include "../../common/frame.c"

#include "tests/test.h"

#include <stdint.h>

#include "kvxfer.pb-c.h"
#include "../fuzz/pb_quirk.h"

/* ---- helpers ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void)
{
    /* xorshift64*: deterministic, so a failure reproduces */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static uint32_t rnd_below(uint32_t n) { return n ? rnd() % n : 0; }

/* A stream of nframes frames; frame i has len[i] bytes of payload whose
 * byte j is (i * 31 + j) & 0xff. */
typedef struct stream {
    uint8_t *bytes;
    size_t len;
    uint32_t nframes;
    uint32_t *flen;
} stream_t;

static uint8_t payload_byte(uint32_t frame, uint32_t j)
{
    return (uint8_t)(frame * 31u + j * 7u + (j >> 8));
}

static void stream_make(stream_t *s, uint32_t nframes, uint32_t maxlen)
{
    s->nframes = nframes;
    s->flen = calloc(nframes ? nframes : 1, sizeof(uint32_t));
    CHECK(s->flen != NULL);
    s->len = 0;
    for (uint32_t i = 0; i < nframes; i++) {
        /* some empty frames, some exactly at a power of two */
        uint32_t r = rnd_below(8);
        s->flen[i] = r == 0 ? 0 : r == 1 ? 4096 % (maxlen + 1)
                                         : rnd_below(maxlen + 1);
        s->len += FRAME_HDR + s->flen[i];
    }
    s->bytes = malloc(s->len ? s->len : 1);
    CHECK(s->bytes != NULL);
    size_t o = 0;
    for (uint32_t i = 0; i < nframes; i++) {
        frame_put_len(s->bytes + o, s->flen[i]);
        o += FRAME_HDR;
        for (uint32_t j = 0; j < s->flen[i]; j++)
            s->bytes[o++] = payload_byte(i, j);
    }
    CHECK_EQ(o, s->len);
}

static void stream_free(stream_t *s)
{
    free(s->bytes);
    free(s->flen);
}

/* Feed the stream in chunks chosen by chunk(), with space requests of
 * want(); every frame must come out whole, in order, exactly once. Returns
 * the largest buffer capacity seen. */
static size_t feed(const stream_t *s, uint32_t max_len,
                   size_t (*chunk)(void), size_t (*want)(void))
{
    frame_reader_t r;
    frame_reader_init(&r);
    size_t in = 0, maxcap = 0;
    uint32_t got = 0;
    while (in < s->len) {
        size_t room = 0, w = want();
        uint8_t *p = frame_reader_space(&r, w, &room);
        CHECK(p != NULL);
        CHECK(room >= w);
        CHECK(p == r.buf + r.len);
        CHECK(r.len + room == r.cap);
        size_t n = chunk();
        if (n > room)
            n = room;
        if (n > s->len - in)
            n = s->len - in;
        memcpy(p, s->bytes + in, n);
        frame_reader_commit(&r, n);
        in += n;
        const uint8_t *msg;
        uint32_t len;
        int rc;
        while ((rc = frame_reader_next(&r, max_len, &msg, &len)) == 1) {
            CHECK(got < s->nframes);
            CHECK_EQ(len, s->flen[got]);
            CHECK(msg >= r.buf && msg + len <= r.buf + r.len);
            for (uint32_t j = 0; j < len; j++)
                if (msg[j] != payload_byte(got, j)) {
                    fprintf(stderr, "frame %u byte %u: %u != %u\n", got, j,
                            msg[j], payload_byte(got, j));
                    CHECK(!"payload differs");
                }
            got++;
        }
        CHECK_EQ(rc, 0);
        if (r.cap > maxcap)
            maxcap = r.cap;
    }
    CHECK_EQ(got, s->nframes);
    CHECK_EQ(r.off, r.len); /* nothing left over */
    frame_reader_cleanup(&r);
    CHECK(r.buf == NULL && r.len == 0 && r.cap == 0 && r.off == 0);
    return maxcap;
}

static size_t one(void) { return 1; }
static size_t small_random(void) { return 1 + rnd_below(13); }
static size_t big_random(void) { return 1 + rnd_below(20000); }
static size_t want_one(void) { return 1; }
static size_t want_64k(void) { return 65536; }
static size_t want_random(void) { return 1 + rnd_below(9000); }

/* ---- the length prefix ---- */

TEST(len_prefix_is_little_endian)
{
    uint8_t p[4];
    frame_put_len(p, 0x04030201u);
    CHECK_EQ(p[0], 1);
    CHECK_EQ(p[1], 2);
    CHECK_EQ(p[2], 3);
    CHECK_EQ(p[3], 4);
    frame_put_len(p, 0xffffffffu);
    CHECK(p[0] == 0xff && p[1] == 0xff && p[2] == 0xff && p[3] == 0xff);
    frame_put_len(p, 0);
    CHECK(p[0] == 0 && p[1] == 0 && p[2] == 0 && p[3] == 0);
    const uint8_t q[4] = {0x78, 0x56, 0x34, 0x12};
    CHECK_EQ(frame_get_len(q), 0x12345678u);
    const uint8_t hi[4] = {0, 0, 0, 0x80};
    CHECK_EQ(frame_get_len(hi), 0x80000000u);
}

TEST(len_prefix_round_trips)
{
    uint8_t p[4];
    for (int i = 0; i < 100000; i++) {
        uint32_t v = rnd() >> rnd_below(32);
        frame_put_len(p, v);
        CHECK_EQ(frame_get_len(p), v);
        /* independent of host order */
        CHECK_EQ(p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24, v);
    }
}

/* ---- reassembly ---- */

TEST(needs_a_whole_header)
{
    frame_reader_t r;
    frame_reader_init(&r);
    const uint8_t msg[] = {5, 0, 0, 0, 'h', 'e', 'l', 'l', 'o'};
    const uint8_t *m = NULL;
    uint32_t len = 77;
    for (size_t i = 0; i < sizeof(msg); i++) {
        CHECK_EQ(frame_reader_next(&r, 100, &m, &len), 0);
        CHECK(m == NULL); /* outputs untouched while incomplete */
        CHECK_EQ(len, 77);
        size_t room;
        uint8_t *p = frame_reader_space(&r, 1, &room);
        CHECK(p != NULL && room >= 1);
        *p = msg[i];
        frame_reader_commit(&r, 1);
    }
    CHECK_EQ(frame_reader_next(&r, 100, &m, &len), 1);
    CHECK_EQ(len, 5);
    CHECK(!memcmp(m, "hello", 5));
    CHECK_EQ(frame_reader_next(&r, 100, &m, &len), 0);
    frame_reader_cleanup(&r);
}

TEST(empty_frame)
{
    frame_reader_t r;
    frame_reader_init(&r);
    size_t room;
    uint8_t *p = frame_reader_space(&r, 8, &room);
    CHECK(p != NULL);
    memset(p, 0, 8); /* two empty frames */
    frame_reader_commit(&r, 8);
    const uint8_t *m;
    uint32_t len = 1;
    CHECK_EQ(frame_reader_next(&r, 0, &m, &len), 1);
    CHECK_EQ(len, 0);
    CHECK_EQ(frame_reader_next(&r, 0, &m, &len), 1);
    CHECK_EQ(len, 0);
    CHECK_EQ(frame_reader_next(&r, 0, &m, &len), 0);
    frame_reader_cleanup(&r);
}

TEST(byte_by_byte)
{
    stream_t s;
    stream_make(&s, 200, 700);
    feed(&s, 700, one, want_one);
    feed(&s, 700, one, want_64k);
    stream_free(&s);
}

TEST(random_chunks)
{
    for (int round = 0; round < 40; round++) {
        stream_t s;
        uint32_t maxlen = 1 + rnd_below(round < 20 ? 300 : 70000);
        stream_make(&s, 1 + rnd_below(150), maxlen);
        size_t c1 = feed(&s, maxlen, small_random, want_random);
        size_t c2 = feed(&s, maxlen, big_random, want_random);
        size_t c3 = feed(&s, maxlen, big_random, want_64k);
        /* the buffer is bounded by one frame plus one request, doubled */
        size_t bound = 2 * ((size_t)maxlen + FRAME_HDR + 65536) + 4096;
        CHECK(c1 <= bound && c2 <= bound && c3 <= bound);
        stream_free(&s);
    }
}

TEST(every_split_point_of_three_frames)
{
    /* Every (a, b) cut of a 3-frame stream into three chunks. */
    stream_t s;
    rng_state = 42;
    s.nframes = 3;
    s.flen = calloc(3, sizeof(uint32_t));
    CHECK(s.flen);
    s.flen[0] = 3;
    s.flen[1] = 0;
    s.flen[2] = 9;
    s.len = 3 * FRAME_HDR + 12;
    s.bytes = malloc(s.len);
    CHECK(s.bytes);
    size_t o = 0;
    for (uint32_t i = 0; i < 3; i++) {
        frame_put_len(s.bytes + o, s.flen[i]);
        o += FRAME_HDR;
        for (uint32_t j = 0; j < s.flen[i]; j++)
            s.bytes[o++] = payload_byte(i, j);
    }
    for (size_t a = 0; a <= s.len; a++)
        for (size_t b = a; b <= s.len; b++) {
            frame_reader_t r;
            frame_reader_init(&r);
            size_t cuts[4] = {0, a, b, s.len};
            uint32_t got = 0;
            for (int c = 0; c < 3; c++) {
                size_t n = cuts[c + 1] - cuts[c], room;
                uint8_t *p = frame_reader_space(&r, n ? n : 1, &room);
                CHECK(p && room >= n);
                memcpy(p, s.bytes + cuts[c], n);
                frame_reader_commit(&r, n);
                const uint8_t *m;
                uint32_t len;
                int rc;
                while ((rc = frame_reader_next(&r, 16, &m, &len)) == 1) {
                    CHECK(got < 3);
                    CHECK_EQ(len, s.flen[got]);
                    for (uint32_t j = 0; j < len; j++)
                        CHECK_EQ(m[j], payload_byte(got, j));
                    got++;
                }
                CHECK_EQ(rc, 0);
            }
            CHECK_EQ(got, 3);
            frame_reader_cleanup(&r);
        }
    stream_free(&s);
}

/* ---- the cap ---- */

TEST(cap_refuses_4gib_before_allocating)
{
    frame_reader_t r;
    frame_reader_init(&r);
    size_t room;
    uint8_t *p = frame_reader_space(&r, 16, &room);
    CHECK(p != NULL);
    size_t cap0 = r.cap;
    CHECK(cap0 < 65536);
    frame_put_len(p, 0xffffffffu);
    frame_reader_commit(&r, FRAME_HDR);
    const uint8_t *m = NULL;
    uint32_t len = 0;
    CHECK_EQ(frame_reader_next(&r, 4096, &m, &len), KVX_ERR_PROTOCOL);
    CHECK_EQ(len, 0xffffffffu); /* the announced length, for the message */
    CHECK(m == NULL);
    CHECK_EQ(r.cap, cap0);      /* nothing grew */
    CHECK_EQ(r.off, 0);         /* nothing consumed */
    /* asked again, the same answer: the error is sticky */
    len = 0;
    CHECK_EQ(frame_reader_next(&r, 4096, &m, &len), KVX_ERR_PROTOCOL);
    CHECK_EQ(len, 0xffffffffu);
    /* the session's next read asks for its usual 64 KiB, not for 4 GiB */
    p = frame_reader_space(&r, 65536, &room);
    CHECK(p != NULL);
    CHECK(r.cap <= 2 * 65536 + 4096);
    frame_reader_cleanup(&r);
}

TEST(cap_is_inclusive)
{
    for (uint32_t cap = 0; cap < 300; cap += 7) {
        for (int over = 0; over <= 1; over++) {
            frame_reader_t r;
            frame_reader_init(&r);
            uint32_t n = cap + (uint32_t)over;
            size_t room;
            uint8_t *p = frame_reader_space(&r, FRAME_HDR + n, &room);
            CHECK(p);
            frame_put_len(p, n);
            memset(p + FRAME_HDR, 0xab, n);
            /* the refusal needs only the header, not the payload */
            frame_reader_commit(&r, FRAME_HDR);
            const uint8_t *m;
            uint32_t len = 0;
            int rc = frame_reader_next(&r, cap, &m, &len);
            if (over) {
                CHECK_EQ(rc, KVX_ERR_PROTOCOL);
                CHECK_EQ(len, n);
            } else {
                CHECK_EQ(rc, n == 0 ? 1 : 0);
                frame_reader_commit(&r, n);
                if (n) {
                    CHECK_EQ(frame_reader_next(&r, cap, &m, &len), 1);
                    CHECK_EQ(len, n);
                }
            }
            frame_reader_cleanup(&r);
        }
    }
}

TEST(cap_refusal_after_good_frames)
{
    /* good frames come out; the oversized one after them is refused */
    frame_reader_t r;
    frame_reader_init(&r);
    size_t room;
    uint8_t *p = frame_reader_space(&r, 64, &room);
    CHECK(p);
    frame_put_len(p, 2);
    p[4] = 'o';
    p[5] = 'k';
    frame_put_len(p + 6, 1u << 30);
    frame_reader_commit(&r, 10);
    const uint8_t *m;
    uint32_t len;
    CHECK_EQ(frame_reader_next(&r, 1000, &m, &len), 1);
    CHECK_EQ(len, 2);
    CHECK(!memcmp(m, "ok", 2));
    CHECK_EQ(frame_reader_next(&r, 1000, &m, &len), KVX_ERR_PROTOCOL);
    CHECK_EQ(len, 1u << 30);
    frame_reader_cleanup(&r);
}

TEST(uncapped_huge_length_waits)
{
    /* with a cap of UINT32_MAX, a 4 GiB announcement just needs bytes:
     * no overflow in "header + length" */
    frame_reader_t r;
    frame_reader_init(&r);
    size_t room;
    uint8_t *p = frame_reader_space(&r, 64, &room);
    CHECK(p);
    frame_put_len(p, 0xffffffffu);
    memset(p + 4, 0, 60);
    frame_reader_commit(&r, 64);
    const uint8_t *m;
    uint32_t len = 0;
    CHECK_EQ(frame_reader_next(&r, UINT32_MAX, &m, &len), 0);
    CHECK_EQ(frame_reader_next(&r, UINT32_MAX - 1, &m, &len),
             KVX_ERR_PROTOCOL);
    frame_reader_cleanup(&r);
}

/* ---- compaction ---- */

TEST(compaction_moves_the_partial_frame_to_the_front)
{
    frame_reader_t r;
    frame_reader_init(&r);
    size_t room;
    uint8_t *p = frame_reader_space(&r, 100, &room);
    CHECK(p);
    size_t cap0 = r.cap;
    /* fill the buffer with frames of 100 bytes */
    size_t o = 0;
    uint32_t k = 0;
    while (cap0 - o >= FRAME_HDR + 100) {
        frame_put_len(p + o, 100);
        for (uint32_t j = 0; j < 100; j++)
            p[o + FRAME_HDR + j] = payload_byte(k, j);
        o += FRAME_HDR + 100;
        k++;
    }
    frame_reader_commit(&r, o);
    const uint8_t *m;
    uint32_t len;
    for (uint32_t i = 0; i < k; i++)
        CHECK_EQ(frame_reader_next(&r, 200, &m, &len), 1);
    CHECK_EQ(frame_reader_next(&r, 200, &m, &len), 0);
    CHECK_EQ(r.off, r.len);
    /* everything consumed: space() starts over at the front */
    p = frame_reader_space(&r, 1, &room);
    CHECK_EQ(r.off, 0);
    CHECK_EQ(r.len, 0);
    CHECK(p == r.buf);
    CHECK_EQ(r.cap, cap0);

    /* now one whole frame and half of the next, then consume the first */
    frame_put_len(p, 100);
    memset(p + FRAME_HDR, 1, 100);
    frame_put_len(p + 104, 100);
    for (uint32_t j = 0; j < 50; j++)
        p[108 + j] = payload_byte(9, j);
    frame_reader_commit(&r, 158);
    CHECK_EQ(frame_reader_next(&r, 200, &m, &len), 1);
    CHECK_EQ(r.off, 104);
    /* asking for more than the tail room compacts before growing */
    size_t want = r.cap - r.len + 1;
    p = frame_reader_space(&r, want, &room);
    CHECK(p);
    CHECK_EQ(r.off, 0);
    CHECK_EQ(r.len, 54);
    CHECK_EQ(r.cap, cap0); /* compaction alone made the room */
    CHECK_EQ(frame_get_len(r.buf), 100);
    for (uint32_t j = 0; j < 50; j++)
        CHECK_EQ(r.buf[FRAME_HDR + j], payload_byte(9, j));
    for (uint32_t j = 50; j < 100; j++)
        p[j - 50] = payload_byte(9, j);
    frame_reader_commit(&r, 50);
    CHECK_EQ(frame_reader_next(&r, 200, &m, &len), 1);
    CHECK_EQ(len, 100);
    for (uint32_t j = 0; j < 100; j++)
        CHECK_EQ(m[j], payload_byte(9, j));
    frame_reader_cleanup(&r);
}

TEST(steady_stream_keeps_a_small_buffer)
{
    /* 20000 frames of 1000 bytes through one reader: consumed frames are
     * dropped, so the buffer never grows past its first size */
    frame_reader_t r;
    frame_reader_init(&r);
    uint8_t f[1004];
    frame_put_len(f, 1000);
    memset(f + 4, 0x5a, 1000);
    size_t cap = 0;
    for (int i = 0; i < 20000; i++) {
        size_t room, n = 0;
        while (n < sizeof(f)) {
            uint8_t *p = frame_reader_space(&r, 512, &room);
            CHECK(p);
            size_t c = sizeof(f) - n < 300 ? sizeof(f) - n : 300;
            memcpy(p, f + n, c);
            frame_reader_commit(&r, c);
            n += c;
        }
        const uint8_t *m;
        uint32_t len;
        CHECK_EQ(frame_reader_next(&r, 1000, &m, &len), 1);
        CHECK_EQ(len, 1000);
        CHECK_EQ(m[999], 0x5a);
        if (!cap)
            cap = r.cap;
        CHECK_EQ(r.cap, cap);
    }
    frame_reader_cleanup(&r);
}

/* ---- random and mutated input through reader and decoder ---- */

/* A valid packed Request of a random kind. */
static size_t request_sample(uint8_t *out, size_t max)
{
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    Kvxfer__Hello h = KVXFER__HELLO__INIT;
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    Kvxfer__Publish pub = KVXFER__PUBLISH__INIT;
    Kvxfer__Fetch fe = KVXFER__FETCH__INIT;
    Kvxfer__RegisterPool rp = KVXFER__REGISTER_POOL__INIT;
    Kvxfer__Layout lay = KVXFER__LAYOUT__INIT;
    Kvxfer__Poll po = KVXFER__POLL__INIT;
    uint32_t blocks[5] = {1, 2, 3, 400000, 5};
    uint64_t offs[3] = {0, 1u << 20, 1ull << 40};
    uint32_t pr[3] = {0, 1, 2};
    Kvxfer__Allocation al = KVXFER__ALLOCATION__INIT, *alp = &al;
    Kvxfer__Region rg[3] = {KVXFER__REGION__INIT, KVXFER__REGION__INIT,
                            KVXFER__REGION__INIT};
    Kvxfer__Region *rgp[3] = {&rg[0], &rg[1], &rg[2]};
    for (int i = 0; i < 3; i++) {
        rg[i].offset = (uint64_t)i << 30;
        rg[i].size = 1u << 30;
    }
    uint32_t lpp[2] = {3, 5};
    uint8_t params[24];
    for (size_t i = 0; i < sizeof(params); i++)
        params[i] = (uint8_t)rnd();
    rq.id = rnd();
    switch (rnd_below(5)) {
    case 0:
        rq.body_case = KVXFER__REQUEST__BODY_HELLO;
        rq.hello = &h;
        h.version_major = 1;
        h.instance_id = "inst-a";
        h.role = KVXFER__ROLE__ROLE_CONTEXT;
        h.parallel = &pc;
        pc.tp = 2;
        pc.pp = 2;
        pc.n_layers_per_pp = 2;
        pc.layers_per_pp = lpp;
        break;
    case 1:
        rq.body_case = KVXFER__REQUEST__BODY_PUBLISH;
        rq.publish = &pub;
        pub.key.data = (uint8_t *)"7";
        pub.key.len = 1;
        pub.n_blocks = 5;
        pub.blocks = blocks;
        pub.num_tokens = 77;
        break;
    case 2:
        rq.body_case = KVXFER__REQUEST__BODY_FETCH;
        rq.fetch = &fe;
        fe.context_params.data = params;
        fe.context_params.len = sizeof(params);
        fe.n_blocks = 5;
        fe.blocks = blocks;
        break;
    case 3:
        rq.body_case = KVXFER__REQUEST__BODY_REGISTER_POOL;
        rq.register_pool = &rp;
        rp.layout = &lay;
        lay.preset = "vllm-nhd";
        lay.num_layers = 3;
        lay.kv_factor = 1;
        lay.n_part_offset = lay.n_part_region = 3;
        lay.part_offset = offs;
        lay.part_region = pr;
        rp.n_allocations = 1;
        rp.allocations = &alp;
        rp.n_regions = 3;
        rp.regions = rgp;
        break;
    default:
        rq.body_case = KVXFER__REQUEST__BODY_POLL;
        rq.poll = &po;
        po.at_least = 3;
        po.timeout_ms = 100;
        break;
    }
    size_t n = kvxfer__request__get_packed_size(&rq);
    CHECK(n <= max);
    return kvxfer__request__pack(&rq, out);
}

static void mutate(uint8_t *b, size_t *len, size_t max)
{
    int k = 1 + (int)rnd_below(6);
    for (int i = 0; i < k; i++) {
        switch (rnd_below(5)) {
        case 0: /* flip a bit */
            if (*len)
                b[rnd_below((uint32_t)*len)] ^= (uint8_t)(1u << rnd_below(8));
            break;
        case 1: /* random byte */
            if (*len)
                b[rnd_below((uint32_t)*len)] = (uint8_t)rnd();
            break;
        case 2: /* truncate */
            *len = rnd_below((uint32_t)*len + 1);
            break;
        case 3: /* interesting varint bytes */
            if (*len)
                b[rnd_below((uint32_t)*len)] =
                    (uint8_t[]){0x00, 0x7f, 0x80, 0xff, 0x0a, 0x12}[rnd_below(6)];
            break;
        default: /* append random bytes */
            while (*len < max && rnd_below(4))
                b[(*len)++] = (uint8_t)rnd();
            break;
        }
    }
}

TEST_T(random_streams_and_requests, 120)
{
    uint32_t decoded = 0, refused = 0, frames = 0;
    for (int iter = 0; iter < 4000; iter++) {
        uint8_t buf[1024];
        size_t len;
        if (iter % 4 == 0) {
            len = rnd_below(sizeof(buf) + 1);
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rnd();
        } else {
            /* a frame around a valid request, then mutated */
            size_t n = request_sample(buf + FRAME_HDR, sizeof(buf) - 64);
            frame_put_len(buf, (uint32_t)n);
            len = FRAME_HDR + n;
            if (iter % 4 != 1)
                mutate(buf, &len, sizeof(buf));
        }
        uint32_t cap = 1 + rnd_below(2048);
        frame_reader_t r;
        frame_reader_init(&r);
        size_t in = 0;
        int done = 0;
        while (in < len && !done) {
            size_t room;
            uint8_t *p = frame_reader_space(&r, 1 + rnd_below(64), &room);
            CHECK(p);
            size_t c = 1 + rnd_below(97);
            if (c > room)
                c = room;
            if (c > len - in)
                c = len - in;
            memcpy(p, buf + in, c);
            frame_reader_commit(&r, c);
            in += c;
            const uint8_t *m;
            uint32_t fl;
            int rc;
            while ((rc = frame_reader_next(&r, cap, &m, &fl)) == 1) {
                frames++;
                CHECK(fl <= cap);
                CHECK(m >= r.buf && m + fl <= r.buf + r.len);
                Kvxfer__Request *rq = kvxfer__request__unpack(NULL, fl, m);
                if (rq) {
                    decoded++;
                    /* a decoded message packs again to a decodable one */
                    size_t pn = kvxfer__request__get_packed_size(rq);
                    uint8_t *pb = malloc(pn ? pn : 1);
                    CHECK(pb);
                    CHECK_EQ(kvxfer__request__pack(rq, pb), pn);
                    Kvxfer__Request *again =
                        kvxfer__request__unpack(NULL, pn, pb);
                    CHECK(again != NULL || has_field0(&rq->base));
                    if (again) {
                        CHECK_EQ(again->id, rq->id);
                        CHECK_EQ(again->body_case, rq->body_case);
                        kvxfer__request__free_unpacked(again, NULL);
                    }
                    free(pb);
                    kvxfer__request__free_unpacked(rq, NULL);
                }
            }
            if (rc < 0) {
                CHECK_EQ(rc, KVX_ERR_PROTOCOL);
                CHECK(fl > cap);
                refused++;
                done = 1;
            }
        }
        frame_reader_cleanup(&r);
    }
    /* the mix reached every outcome */
    CHECK(decoded > 100);
    CHECK(refused > 100);
    CHECK(frames > decoded);
}
