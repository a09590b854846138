/*
 * test_why — kvx_why_t: messages land in the caller's buffer, truncated
 * and terminated; NULL and size 0 ask for none; why_fail returns the
 * code; why_prefix keeps the message whole where it fits and cuts its
 * tail where it does not.
 */
#include "../../common/why.c"

#include "tests/test.h"

#include <string.h>

#define CHECK_STR_EQ(a, b) CHECK(strcmp((a), (b)) == 0)

TEST(why_set_writes_and_truncates)
{
    char big[64], small[8];
    why_set(KVX_WHY(big), "n: %d is not > %d", 0, 0);
    CHECK_STR_EQ(big, "n: 0 is not > 0");
    why_set(KVX_WHY(small), "%s", "0123456789");
    CHECK_STR_EQ(small, "0123456");
}

TEST(why_fail_returns_the_code)
{
    char m[32] = "";
    CHECK_EQ(why_fail(KVX_WHY(m), -7, "blocks[%u]: out of range", 3u), -7);
    CHECK_STR_EQ(m, "blocks[3]: out of range");
    CHECK_EQ(why_fail(NULL, -3, "nobody reads this"), -3);
    kvx_why_t none = {m, 0};
    CHECK_EQ(why_fail(&none, -2, "x"), -2);
    CHECK_STR_EQ(m, "blocks[3]: out of range"); /* size 0: untouched */
}

TEST(why_prefix_adds_context)
{
    char m[40];
    kvx_why_t *w = KVX_WHY(m);
    why_set(w, "no such pool");
    why_prefix(w, "rank %u", 2u);
    CHECK_STR_EQ(m, "rank 2: no such pool");
    why_set(w, "%s", "0123456789012345678901234567890123456789");
    why_prefix(w, "fetch");
    CHECK_EQ(strlen(m), sizeof(m) - 1);
    CHECK_EQ(strncmp(m, "fetch: 0123", 11), 0);
    char tiny[6] = "abc";
    why_prefix(KVX_WHY(tiny), "longer than all");
    CHECK_STR_EQ(tiny, "longe");
    why_prefix(NULL, "nothing");
}
