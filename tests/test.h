/*
 * test.h — a tiny test runner in the manner of libuv's: each TEST() is a
 * small named function run in its own child process with a timeout, so a
 * crash or hang fails that test alone. A test binary prints one line per
 * test ("ok NAME" / "FAIL NAME: why") and "N passed, N failed" last.
 *
 *   ./test_x            run every test
 *   ./test_x NAME...    run the named tests
 */
#ifndef KVX_TEST_H
#define KVX_TEST_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef void (*test_fn)(void);
struct test_entry {
    const char *name;
    test_fn fn;
    unsigned timeout_s;
};

/* Filled by the constructors TEST_T() makes, before main(), in the order
 * the tests are written; grows as needed: a binary holds any number of
 * tests (out of memory, it says so and exits before running any). */
static struct test_entry *test_table;
static int test_count, test_cap;

static void test_register(const char *name, test_fn fn, unsigned secs)
{
    if (test_count == test_cap) {
        int cap = test_cap ? 2 * test_cap : 64;
        struct test_entry *t = realloc(test_table, cap * sizeof(*t));
        if (!t) {
            fprintf(stderr, "test.h: out of memory registering test %s\n",
                    name);
            exit(1);
        }
        test_table = t;
        test_cap = cap;
    }
    test_table[test_count++] = (struct test_entry){name, fn, secs};
}

#define TEST_T(name, secs)                                                     \
    static void test_##name(void);                                             \
    __attribute__((constructor)) static void test_reg_##name(void)             \
    {                                                                          \
        test_register(#name, test_##name, (secs));                             \
    }                                                                          \
    static void test_##name(void)
#define TEST(name) TEST_T(name, 30)

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__,          \
                    __LINE__, #cond);                                       \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

#define CHECK_EQ(a, b)                                                      \
    do {                                                                    \
        long long va_ = (long long)(a), vb_ = (long long)(b);               \
        if (va_ != vb_) {                                                   \
            fprintf(stderr, "%s:%d: %s == %s failed: %lld != %lld\n",       \
                    __FILE__, __LINE__, #a, #b, va_, vb_);                  \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                     \
    do {                                                                    \
        const char *h_ = (hay), *n_ = (needle);                             \
        if (!h_ || !strstr(h_, n_)) {                                       \
            fprintf(stderr, "%s:%d: \"%s\" does not contain \"%s\"\n",      \
                    __FILE__, __LINE__, h_ ? h_ : "(null)", n_);            \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

static int test_run_one(const struct test_entry *t)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        alarm(t->timeout_s);
        t->fn();
        exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    kill(-pid, SIGKILL); /* reap anything the test left behind */
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
        printf("ok %s\n", t->name);
        return 1;
    }
    if (WIFSIGNALED(st))
        printf("FAIL %s: %s%s\n", t->name, strsignal(WTERMSIG(st)),
               WTERMSIG(st) == SIGALRM ? " (timeout)" : "");
    else
        printf("FAIL %s: exit %d\n", t->name, WEXITSTATUS(st));
    return 0;
}

int main(int argc, char **argv)
{
    int passed = 0, failed = 0;
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int a = 1; a < argc; a++) {
        int known = 0;
        for (int i = 0; i < test_count; i++)
            known |= !strcmp(argv[a], test_table[i].name);
        if (!known) {
            printf("FAIL %s: no such test\n", argv[a]);
            failed++;
        }
    }
    for (int i = 0; i < test_count; i++) {
        int want = argc < 2;
        for (int a = 1; a < argc; a++)
            want |= !strcmp(argv[a], test_table[i].name);
        if (!want)
            continue;
        if (test_run_one(&test_table[i]))
            passed++;
        else
            failed++;
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

#endif /* KVX_TEST_H */
