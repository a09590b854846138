/*
 * layout — layout descriptor math shared by daemon and library: presets,
 * element offsets, span, and the validation the daemon runs before it
 * accepts a pool. Pure functions; owns nothing.
 */
#ifndef KVX_LAYOUT_H
#define KVX_LAYOUT_H

#include <stddef.h>

#include "kvxfer.h"

/*
 * Check that layout is well formed and fits in pool_size bytes: every
 * dimension in range, every element's bytes inside the pool (no overflow),
 * no two elements overlap. Returns 0, or KVX_ERR_LAYOUT with why naming
 * the field.
 */
int kvx__layout_check(const kvx_layout_t *layout, uint64_t pool_size,
                      char *why, size_t why_len);

#endif /* KVX_LAYOUT_H */
