/*
 * test_runner — tests/test.h itself: a binary of many tests runs every
 * one of them. The table once held 256 and dropped the rest without a
 * word, so a test past that never ran and never failed.
 */
#include "tests/test.h"

/* one past the old table's 256 (the checker is the first entry) */
#define RUNNER_MANY 256

static int runner_index(const char *name)
{
    for (int i = 0; i < test_count; i++)
        if (!strcmp(test_table[i].name, name))
            return i;
    return -1;
}

/* Registered first, so it runs whatever the table drops: every test
 * after it is in the table, in the order written (the child sees the
 * table main() runs). */
TEST(runner_holds_every_test)
{
    CHECK_EQ(test_count, RUNNER_MANY + 1);
    CHECK_EQ(runner_index("runner_holds_every_test"), 0);
    CHECK_EQ(runner_index("runner_nop_000"), 1);
    CHECK_EQ(runner_index("runner_nop_255"), RUNNER_MANY);
}

/* RUNNER_MANY tests that pass */
#define NOP_TEST(name)                                                         \
    TEST(name) {}
#define NOP_10(p)                                                              \
    NOP_TEST(p##0)                                                             \
    NOP_TEST(p##1)                                                             \
    NOP_TEST(p##2)                                                             \
    NOP_TEST(p##3)                                                             \
    NOP_TEST(p##4)                                                             \
    NOP_TEST(p##5)                                                             \
    NOP_TEST(p##6)                                                             \
    NOP_TEST(p##7)                                                             \
    NOP_TEST(p##8)                                                             \
    NOP_TEST(p##9)
#define NOP_100(p)                                                             \
    NOP_10(p##0)                                                               \
    NOP_10(p##1)                                                               \
    NOP_10(p##2)                                                               \
    NOP_10(p##3)                                                               \
    NOP_10(p##4)                                                               \
    NOP_10(p##5)                                                               \
    NOP_10(p##6)                                                               \
    NOP_10(p##7)                                                               \
    NOP_10(p##8)                                                               \
    NOP_10(p##9)

NOP_100(runner_nop_0)
NOP_100(runner_nop_1)
NOP_10(runner_nop_20)
NOP_10(runner_nop_21)
NOP_10(runner_nop_22)
NOP_10(runner_nop_23)
NOP_10(runner_nop_24)
NOP_TEST(runner_nop_250)
NOP_TEST(runner_nop_251)
NOP_TEST(runner_nop_252)
NOP_TEST(runner_nop_253)
NOP_TEST(runner_nop_254)
NOP_TEST(runner_nop_255)
