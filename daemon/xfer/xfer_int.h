/*
 * xfer_int — what the files of daemon/xfer share and nothing else sees:
 * the request types' fields, the lists and records they live on, and the
 * helpers each file calls in another. Included by the .c files of daemon/xfer only.
 */
#ifndef KVX_XFER_INT_H
#define KVX_XFER_INT_H

#include "common/why.h"

/* A kvx_why_t * as the (buffer, size) pair of the calls in other folders
 * that still take one. */
#define WHY_PAIR(w) ((w) ? (w)->msg : NULL), ((w) ? (w)->size : 0)

#endif /* KVX_XFER_INT_H */
