/*
 * plan — which bytes a destination rank needs from which source ranks,
 * and the host copy engine that executes a plan.
 *
 * A plan is computed once, by the generation-side daemon, from the two
 * instances' parallel configs and layout summaries. It lists slices
 * (source rank x layer range x head range) and token segments (runs of
 * tokens that lie inside one source block and one destination block). Its
 * work is cut into units (slice, layer, segment): the scheduler hands out
 * unit ranges, the copy engine executes them. Nothing here knows about
 * sessions, requests or threads; plan_exec() only reads the plan and the
 * memory it is bound to.
 */
#ifndef KVX_PLAN_H
#define KVX_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "common/why.h"
#include "kvxfer.h"

/* One instance as the plan sees it. */
typedef struct plan_side {
    uint32_t tp, pp, cp;
    uint32_t total_layers, total_heads;
    uint32_t num_layers_per_pp;
    uint32_t layers_per_pp[64];  /* empty = even split */
    uint32_t kv_factor, head_dim, elem_size, dtype, tokens_per_block;
    uint32_t attention_dp;       /* generation side; 0/1 = off */
} plan_side_t;

typedef struct plan_slice {
    uint32_t src_rank;
    uint32_t layer0, nlayers;          /* global layer range */
    uint32_t head0, nheads;            /* global head range */
    uint32_t src_layer_base, src_head_base;
    uint32_t dst_layer_base, dst_head_base;
    uint64_t unit_begin;               /* first unit of this slice */
} plan_slice_t;

typedef struct plan_seg {
    uint32_t src_blk, src_tok;         /* index into the source block table */
    uint32_t dst_blk, dst_tok;         /* index into the destination table */
    uint32_t n;
} plan_seg_t;

/* One region of a pool as the executing engine sees it: its own start
 * (not its allocation's) and its bytes. */
typedef struct plan_region {
    uint8_t *base;
    uint64_t size;
} plan_region_t;

/* Memory a plan reads or writes: a mapped pool (its regions), its layout,
 * a block table. The layout's parts name regions[]; sizes let
 * plan_check_bounds() prove every access lies inside its region. pool
 * names it in errors. An unbound side (packed, between daemons) has
 * blocks NULL. */
typedef struct plan_mem {
    const plan_region_t *regions;
    uint32_t nregions;
    const kvx_layout_t *layout;
    const uint32_t *blocks;
    uint32_t num_blocks;
    uint32_t pool;
    uint8_t host; /* host memory (a host pool): copies to a GPU cross PCIe */
} plan_mem_t;

typedef struct plan {
    uint32_t dst_rank;
    uint32_t nslices;
    plan_slice_t *slices;
    uint32_t nsegs;
    plan_seg_t *segs;
    uint64_t nunits;
    uint64_t bytes;
    uint32_t src_blocks_needed;        /* highest source block index + 1 */
    uint32_t dst_blocks_needed;
    /* Binding, set by the owner before plan_exec(): src[i] for slice i. */
    plan_mem_t *src;
    plan_mem_t dst;
    uint64_t mem;   /* bytes charged to the memory budget (plan_free) */
    uint32_t owner; /* whose they are (plan_own()); PLAN_OWNER_NONE */
} plan_t;

#define PLAN_OWNER_NONE UINT32_MAX

/* The daemon's memory budget, for the plans plan_build() makes: charge
 * returns 0 or an error (with why) that plan_build() returns; own makes
 * charged bytes an owner's too (a uid's share: plan_own()); release
 * gives them back, the owner's with them. Set once at start by the
 * daemon; without it nothing is charged. */
typedef struct plan_budget {
    int (*charge)(uint64_t bytes, kvx_why_t *why);
    int (*own)(uint32_t owner, uint64_t bytes, kvx_why_t *why);
    void (*release)(uint32_t owner, uint64_t bytes);
} plan_budget_t;
void plan_set_budget(const plan_budget_t *b);
/* p's bytes are owner's too (the uid of the fetch it serves), within
 * what the budget's own allows: 0, or its error with why (p stays
 * nobody's; the caller frees it). */
int plan_own(plan_t *p, uint32_t owner, kvx_why_t *why);

/* Ranks of a side: tp*pp*cp. */
uint32_t plan_side_ranks(const plan_side_t *s);
/* Layer range [*first, *first + return) of PP rank p. */
uint32_t plan_pp_layers(const plan_side_t *s, uint32_t p, uint32_t *first);
/* Head range [*first, *first + return) of TP rank t. */
uint32_t plan_tp_heads(const plan_side_t *s, uint32_t t, uint32_t *first);

/* Is side s itself consistent (heads divide over tp, layers over pp)?
 * Returns 0 or KVX_ERR_INVALID / KVX_ERR_UNSUPPORTED with why. */
int plan_side_check(const plan_side_t *s, kvx_why_t *why);

/* Are s's layout fields (tokens_per_block, head_dim, elem_size,
 * kv_factor) in range? They come from params and peers, not only from
 * checked pools. 0, or KVX_ERR_INVALID naming the field. */
int plan_side_layout_check(const plan_side_t *s, kvx_why_t *why);

/* A rank of a side with attention DP, seen as a rank of the plain side
 * the plan works on: *eff is the side with tp/attention_dp ranks per
 * group, *eff_rank the rank inside its group, return value the group. */
uint32_t plan_dp_view(const plan_side_t *s, uint32_t rank, plan_side_t *eff,
                      uint32_t *eff_rank);

/* Do a and b describe the same side, field for field? */
int plan_side_equal(const plan_side_t *a, const plan_side_t *b);

/* Can src feed dst? 0, or KVX_ERR_MISMATCH naming the mismatch. */
int plan_compat(const plan_side_t *src, const plan_side_t *dst, kvx_why_t *why);

/* Build the plan for destination rank dst_rank moving tokens
 * [skip_tokens, num_tokens). *out is malloc'd; free with plan_free(). */
int plan_build(const plan_side_t *src, const plan_side_t *dst,
               uint32_t dst_rank, uint32_t num_tokens, uint32_t skip_tokens,
               plan_t **out, kvx_why_t *why);
void plan_free(plan_t *p);

/* Bytes moved by units [u0, u1). */
uint64_t plan_units_bytes(const plan_t *p, uint64_t u0, uint64_t u1);

/* The end of the run of whole units from u0 (up to u_end) that fits in
 * max bytes, and its size in *bytes: what one PULL asks for, made the
 * same way by the daemon that pulls and by one gathering ahead. u0 when
 * unit u0 alone is larger (or u0 == u_end). */
uint64_t plan_units_fit(const plan_t *p, uint64_t u0, uint64_t u_end,
                        uint64_t max, uint64_t *bytes);

/* A piece of a packed run: whole units [u0, u1), bytes [off, off + len)
 * from the run's start. */
typedef struct plan_piece {
    uint64_t u0, u1, off, len;
} plan_piece_t;

/* Cut units [u0, u1) into at most max pieces on unit boundaries: each
 * takes whole units while it stays within pb bytes (a unit larger than
 * pb is a piece alone), and the last allowed piece takes the rest.
 * Deterministic, so two daemons holding the same plan make the same cut.
 * Returns the number of pieces written to pc (u0 < u1, max >= 1). */
uint32_t plan_cut_pieces(const plan_t *p, uint64_t u0, uint64_t u1,
                         uint64_t pb, plan_piece_t *pc, uint32_t max);

/* Does every byte the bound sides' units touch lie inside their pools?
 * For each slice and segment: the block table index, the block, the
 * layer, head and token ranges against the layout, and the furthest byte
 * of every (layer, kv) part against its region's size. 0, or
 * KVX_ERR_INVALID naming the pool, the region and the range; run before any
 * copy is launched (a wrong plan must fail, not write over an engine's memory).
 */
int plan_check_bounds(const plan_t *p, kvx_why_t *why);

/* Execute units [u0, u1) with memcpy on the calling thread. */
void plan_exec(const plan_t *p, uint64_t u0, uint64_t u1);

/* Between daemons the units travel packed: unit after unit, each as
 * [kv][token][head][row], plan_units_bytes() long in all. Gather units
 * [u0, u1) from the bound sources into buf (gather != 0), or scatter them
 * from buf into the bound destination. Only the side used must be bound;
 * p->dst.layout gives the row shape either way. */
void plan_exec_packed(const plan_t *p, uint64_t u0, uint64_t u1,
                      uint8_t *buf, int gather);

/* The same packed bytes as runs of pool memory instead of copies: emit
 * is called with each run of units [u0, u1), in packed order, on the
 * bound source (gather != 0) or destination: its address, its length and
 * its region; runs next to each other in one region are merged. A
 * non-zero return of emit stops the walk and is returned. The iov UCX
 * unpacks a piece into, straight into the pool (peer.direct). */
typedef int (*plan_run_fn)(void *arg, uint8_t *addr, uint64_t len,
                           uint32_t region);
int plan_runs_packed(const plan_t *p, uint64_t u0, uint64_t u1, int gather,
                     plan_run_fn emit, void *arg);

#endif /* KVX_PLAN_H */
