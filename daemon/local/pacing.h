/*
 * pacing — the GPU paces engines set (GpuPace, 2.8): each session's
 * request, its lapse, and per GPU device the lowest of those of the
 * sessions that have a GPU pool there, which it hands to copy
 * (copy_set_gpu_pace(); copy combines it with gpu.pace). A device whose
 * GPU pools are of more than one user takes no engine's pace: one
 * tenant must not slow another's transfers (gpu.pace still binds). An engine
 * sets it while it decodes, every step, with a hold: when the engine stops
 * calling, the pace lapses and copies go at full speed again.
 *
 * Owns the sessions' records and the lapse timer. Knows sessions by id
 * only; session.c tells it of each call, of the devices of a session's
 * GPU pools and of a session's end. Never replies to clients.
 */
#ifndef KVX_PACING_H
#define KVX_PACING_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "copy/copy.h"

/* The bounds of a GpuPace: gpu.pace's own, and a minute of hold. */
#define PACING_MAX_PER_MS (1ull << 40)
#define PACING_MAX_HOLD_MS 60000u

/* Device d's bit in a devices mask: its lane's (copy_pace_device()). */
static inline uint64_t pacing_device_bit(int d)
{
    return 1ull << copy_pace_device(d);
}

int pacing_init(uv_loop_t *loop);
void pacing_cleanup(void);
/* Session sid's GpuPace: per_ms bytes a millisecond (0 withdraws it) on
 * the devices of its GPU pools (a mask, bit d for device d, the last
 * bit for devices 63 and up), for hold_ms from now (0: until changed or
 * the session ends). 0, or KVX_ERR_NOMEM (nothing changed). Whose
 * devices users share: as pacing_shared() says (no walk of the pools:
 * an engine calls it each step). */
int pacing_set(uint64_t sid, uint64_t per_ms, uint32_t hold_ms,
               uint64_t devices);
/* Session sid's GPU pools are now on these devices; called whenever a
 * session's GPU pool registers or leaves (whatever its pace), since the
 * devices that users share may change with it. */
void pacing_devices(uint64_t sid, uint64_t devices);
/* Session sid has ended: its pace with it. */
void pacing_end(uint64_t sid);
/* Sessions whose pace is in force now. */
uint32_t pacing_sessions(void);
/* Devices whose live GPU pools are of more than one user (a mask, as
 * above): no engine's pace binds them, read from the pools' uids. As
 * of the last GPU pool registered or gone (pacing_devices(),
 * pacing_end()). */
uint64_t pacing_shared(void);
/* Devices that have a GPU pool, or an engine's pace (a mask, as above). */
uint64_t pacing_devices_used(void);
/* What the status's "gpu" string says of the paces: gpu.pace, the
 * engines' and each paced device's (effective, and who set it); ""
 * when none is set. */
void pacing_status(char *buf, size_t len);

#endif /* KVX_PACING_H */
