/*
 * fuzz_config — conf_load on arbitrary file contents (written to a temp
 * file, as the daemon reads its config). daemon/core/conf.c is included to
 * check the result against its own key table: a load with no problems
 * yields values inside every key's bounds; a load with problems reports
 * each one against the file's name and leaves *conf untouched.
 */
#include "../../daemon/core/conf.c"

#include <unistd.h>

#define MUST(c)                                                             \
    do {                                                                    \
        if (!(c)) {                                                         \
            fprintf(stderr, "fuzz_config: %s:%d: %s\n", __FILE__, __LINE__, \
                    #c);                                                    \
            abort();                                                        \
        }                                                                   \
    } while (0)

static char path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    snprintf(path, sizeof(path), "/tmp/kvx_fuzz_config_XXXXXX");
    int fd = mkstemp(path);
    MUST(fd >= 0);
    close(fd);
    return 0;
}

static void check_valid(const kvx_conf_t *c)
{
    for (size_t i = 0; i < conf_nkeys; i++) {
        const struct conf_key *k = &conf_keys[i];
        switch (k->type) {
        case CONF_STRING:
        case CONF_PATH:
            MUST(memchr(str_get(c, k), '\0', k->size) != NULL);
            if (k->type == CONF_PATH)
                MUST(str_get(c, k)[0] == '/');
            break;
        case CONF_IDS: {
            unsigned n;
            memcpy(&n, (const char *)c + k->count_off, sizeof(n));
            MUST(n <= ids_cap(k));
            for (unsigned j = 0; j < n; j++)
                MUST(ids_const(c, k)[j] >= k->min &&
                     ids_const(c, k)[j] <= k->max);
            break;
        }
        default:
            MUST(num_get(c, k) >= k->min && num_get(c, k) <= k->max);
            break;
        }
    }
    MUST(c->hello_frame_bytes <= c->max_frame_bytes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    MUST(f != NULL);
    MUST(fwrite(data, 1, size, f) == size);
    MUST(fclose(f) == 0);

    kvx_conf_t c, before;
    memset(&c, 0xa5, sizeof(c));
    before = c;
    char *msg = NULL;
    size_t mlen = 0;
    FILE *err = open_memstream(&msg, &mlen);
    MUST(err != NULL);
    int rc = conf_load(path, &c, err);
    MUST(fclose(err) == 0);
    if (rc == 0) {
        check_valid(&c);
        /* and a second load of the same file agrees */
        kvx_conf_t d;
        MUST(conf_load(path, &d, NULL) == 0);
        MUST(!memcmp(&c, &d, sizeof(c)));
    } else {
        MUST(rc > 0); /* the file is readable: problems, not a KVX_ERR_* */
        MUST(!memcmp(&c, &before, sizeof(c)));
        MUST(mlen > 0 && strstr(msg, path) == msg);
    }
    free(msg);
    return 0;
}
