"""The GPU pace a worker sets while its engine computes
(kv_connector_extra_config ``gpu_pace``, ``gpu_pace_hold_ms``): at each
step that runs a forward, at most once a quarter of the hold, the worker
tells its daemon (``Client.gpu_pace``) that kvxfer's copies on its GPU
may start at most ``gpu_pace`` bytes a millisecond for the next hold. An
idle engine stops calling, the pace lapses, and copies go at full speed
(docs/operations.md, "A pace the engine sets")."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Tuple

import kvxfer
from kvxfer._outage import DAEMON_GONE

log = logging.getLogger("kvxfer.vllm")

HOLD_MS = 200  # gpu_pace_hold_ms's default
MAX_PER_MS = 1 << 40  # the daemon's bound (gpu.pace's)
MAX_HOLD_MS = 60000


def _count(extra: Dict[str, Any], key: str, default: int, lo: int,
           hi: int, what: str) -> int:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise kvxfer.InvalidArgument(
            -1, f"kv_connector_extra_config.{key}: {v!r}, expected {what} "
            f"(an integer in {lo}..{hi})")
    return v


def pace_config(extra: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes a millisecond, hold in ms) from the extra config; 0 bytes:
    no pace (``gpu_pace`` absent or 0). Raises InvalidArgument naming the
    key."""
    per_ms = _count(extra, "gpu_pace", 0, 0, MAX_PER_MS,
                    "bytes a millisecond")
    hold = _count(extra, "gpu_pace_hold_ms", HOLD_MS, 1, MAX_HOLD_MS,
                  "milliseconds")
    return per_ms, hold


class GpuPacer:
    """One worker's pace: set at the steps that run a forward, never
    more often than a quarter of the hold, its failures logged once."""

    def __init__(self, extra: Dict[str, Any]) -> None:
        self.per_ms, self.hold_ms = pace_config(extra)
        self._next = 0.0  # monotonic time the next call may go
        self._failing = False  # a failure was logged; none since

    def step(self, client: Optional[kvxfer.Client]
             ) -> Optional[kvxfer.Error]:
        """A step that runs a forward. Returns the error of a daemon gone
        (the worker's outage handles it), else None; other failures are
        logged (once until a call succeeds) and the step goes on."""
        if not self.per_ms or client is None:
            return None
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.hold_ms / 4000.0
        try:
            client.gpu_pace(self.per_ms, self.hold_ms)
        except DAEMON_GONE as e:
            return e
        except kvxfer.Error as e:
            if not self._failing:
                log.warning("kvxfer: the GPU pace (gpu_pace %d bytes a ms) "
                            "was not set: %s; copies go unpaced",
                            self.per_ms, e)
                self._failing = True
            return None
        if self._failing:
            log.info("kvxfer: the GPU pace is set again")
            self._failing = False
        return None
