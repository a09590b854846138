/*
 * layout — layout descriptor math shared by daemon and library: presets,
 * the (region, offset) of every part, spans, and the validation the
 * daemon runs before it accepts a pool. Pure functions; owns nothing.
 */
#ifndef KVX_LAYOUT_H
#define KVX_LAYOUT_H

#include <stddef.h>

#include "kvxfer.h"
#include "why.h"

/* Part (layer, kv) of l: its byte offset in its region, *region which.
 * The one place that reads parts[] or the layer and kv strides, so every
 * address the daemon computes goes through it. No checks: l was checked
 * (kvx__layout_check) and layer < num_layers, kv < kv_factor. */
static inline uint64_t kvx__layout_part(const kvx_layout_t *l, uint32_t layer,
                                        uint32_t kv, uint32_t *region)
{
    if (l->parts) {
        const kvx_layout_part_t *p =
            &l->parts[(size_t)layer * l->kv_factor + kv];
        *region = p->region;
        return p->offset;
    }
    *region = 0;
    return (uint64_t)layer * l->layer_stride + (uint64_t)kv * l->kv_stride;
}

/* Bytes one (layer, kv) part spans from its offset (blocks, tokens,
 * heads and a row), or 0 on overflow. */
uint64_t kvx__layout_part_span(const kvx_layout_t *l);

/*
 * Check that layout is well formed and fits the pool's regions, of
 * region_size[0, nregions) bytes: every dimension in range, parts
 * (num_layers*kv_factor of them) in regions that exist, every region
 * holding a part, every byte a part can address inside its region (no
 * overflow), no two elements overlap. Returns 0, or KVX_ERR_LAYOUT with
 * why naming the field (the part's layer, kv and region).
 */
int kvx__layout_check(const kvx_layout_t *layout, const uint64_t *region_size,
                      uint32_t nregions, kvx_why_t *why);

#endif /* KVX_LAYOUT_H */
