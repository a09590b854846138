/*
 * records — one record per finished request (common/reqrec.h): kept in a
 * ring of records.ring entries, newest replacing oldest, that kvxferctl
 * requests --done reads; and, when records.file is set, appended to it
 * as one JSON line each, the file rotated past records.max_bytes
 * (records.keep files kept) and reopened on SIGHUP (records_reopen()).
 * The loop thread only. A file that cannot be written is logged once and
 * the ring goes on; recording never fails a request.
 */
#ifndef KVX_RECORDS_H
#define KVX_RECORDS_H

#include <stdint.h>

#include "common/reqrec.h"

/* Allocate the ring, open the file: 0, or -1 with the cause logged. */
int records_init(void);
void records_cleanup(void);
/* Keep r (copied) and write its line. */
void records_add(const reqrec_t *r);
/* Close the file and open records.file again (SIGHUP: after a move by
 * logrotate, or a changed key): 0, or -1 with the cause logged (the
 * records go on in the ring). */
int records_reopen(void);
/* The newest at most max records uid may see (only_uid < 0: all), oldest
 * first, into out (an array of max); returns how many. *total: the
 * records kept that uid may see, *recorded: every record since start. */
uint32_t records_list(reqrec_t *out, uint32_t max, int64_t only_uid,
                      uint32_t *total, uint64_t *recorded);

#endif /* KVX_RECORDS_H */
