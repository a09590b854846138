/*
 * xfer_list — the pages of ListRequests; see xfer_infos_page() in xfer.h.
 *
 * A page costs the loop one pass over the request maps (to pick the
 * requests after the cursor) and the infos of at most max requests: a
 * listing of tens of thousands of requests is many short turns, never one
 * long one. The order is (instance id, side, request id), so a cursor
 * that names a request which ended meanwhile still says where to go on.
 */
#include <stdlib.h>
#include <string.h>

#include "core/daemon.h"
#include "xfer.h"

typedef struct {
    uint64_t key; /* side << 63 | request id: the order within an instance */
    void *req;    /* an offer (side 0) or a fetch (side 1), opaque */
} entry_t;

static int cmp_entry(const void *a, const void *b)
{
    uint64_t x = ((const entry_t *)a)->key, y = ((const entry_t *)b)->key;
    return x < y ? -1 : x > y;
}

static int cmp_inst(const void *a, const void *b)
{
    return strcmp((*(instance_t *const *)a)->id, (*(instance_t *const *)b)->id);
}

static void swap_entry(entry_t *a, entry_t *b)
{
    entry_t t = *a;
    *a = *b;
    *b = t;
}

/* Move the k smallest of v[0..n) to v[0..k) (in any order): quickselect,
 * the pivot from the middle (map order is a hash's, not sorted). */
static void select_smallest(entry_t *v, size_t n, size_t k)
{
    size_t lo = 0, hi = n; /* [0,lo) <= [lo,hi) <= [hi,n) */
    while (hi - lo > 1) {
        swap_entry(&v[lo + (hi - lo) / 2], &v[hi - 1]);
        uint64_t p = v[hi - 1].key;
        size_t s = lo;
        for (size_t j = lo; j < hi - 1; j++)
            if (v[j].key < p)
                swap_entry(&v[j], &v[s++]);
        swap_entry(&v[s], &v[hi - 1]);
        if (k == s || k == s + 1)
            return;
        if (k < s)
            hi = s;
        else
            lo = s + 1;
    }
}

/* The requests of instance i after the cursor key (all with after 0 and
 * !strict), as entries in *out. Returns how many, or -1 (no memory). */
static long inst_entries(instance_t *i, uint64_t after, int strict,
                         entry_t **out)
{
    uint32_t cnt = i->offers.n + i->fetches.n;
    void **all = malloc((cnt ? cnt : 1) * sizeof(void *));
    entry_t *v = malloc((cnt ? cnt : 1) * sizeof(*v));
    if (!all || !v) {
        free(all);
        free(v);
        return -1;
    }
    uint32_t no = map_values(&i->offers, all, cnt);
    uint32_t ng = map_values(&i->fetches, all + no, cnt - no);
    long n = 0;
    for (uint32_t k = 0; k < no + ng; k++) {
        uint64_t id = xfer_request_id(all[k], k >= no);
        /* request ids of the protocol are 64-bit; the side takes the top
         * bit, so ids of 2^63 and over sort with the low bit cleared
         * (listed, perhaps twice or once less at a page edge) */
        uint64_t key = (k < no ? 0 : 1ull << 63) | (id & ~(1ull << 63));
        if (strict && key <= after)
            continue;
        v[n].key = key;
        v[n].req = all[k];
        n++;
    }
    free(all);
    *out = v;
    return n;
}

size_t xfer_infos_page(const char *after_inst, int after_side,
                       uint64_t after_id, uint32_t max, int64_t only_uid,
                       Kvxfer__RequestInfo ***out, int *more)
{
    *out = NULL;
    *more = 0;
    if (!after_inst)
        after_inst = "";
    uint64_t after = (after_side ? 1ull << 63 : 0) | (after_id & ~(1ull << 63));
    size_t ninst = 0, k = 0;
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        ninst++;
    instance_t **insts = malloc((ninst ? ninst : 1) * sizeof(*insts));
    Kvxfer__RequestInfo **v = calloc(max ? max : 1, sizeof(*v));
    if (!insts || !v) {
        free(insts);
        free(v);
        return 0;
    }
    ninst = 0;
    for (instance_t *i = instance_first(); i; i = instance_next(i))
        if (only_uid < 0 || i->owner_uid == (uint64_t)only_uid)
            insts[ninst++] = i; /* another user's: not shown */
    qsort(insts, ninst, sizeof(*insts), cmp_inst);
    uint64_t now = kvxd_now_ms();
    for (size_t x = 0; x < ninst; x++) {
        instance_t *i = insts[x];
        int c = after_inst[0] ? strcmp(i->id, after_inst) : 1;
        if (c < 0)
            continue;
        if (!i->offers.n && !i->fetches.n)
            continue;
        if (k == max) { /* the page is full: anything left is more */
            entry_t *e;
            long n = inst_entries(i, after, c == 0, &e);
            free(e);
            if (n != 0) { /* -1: say more, to be safe */
                *more = 1;
                break;
            }
            continue;
        }
        entry_t *e;
        long n = inst_entries(i, after, c == 0, &e);
        if (n < 0)
            break;
        size_t want = max - k;
        if ((size_t)n > want) {
            select_smallest(e, (size_t)n, want);
            *more = 1;
        } else {
            want = (size_t)n;
        }
        qsort(e, want, sizeof(*e), cmp_entry);
        for (size_t j = 0; j < want; j++) {
            Kvxfer__RequestInfo *r =
                xfer_request_info(i, e[j].req, (int)(e[j].key >> 63), now);
            if (!r)
                break;
            v[k++] = r;
        }
        free(e);
        if (*more)
            break;
    }
    free(insts);
    *out = v;
    return k;
}
