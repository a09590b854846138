"""The GPU pace an engine adapter sets while its engine computes (what
kvxfer.vllm and kvxfer.sglang share): at each step that runs a forward,
at most once a quarter of the hold, a rank tells its daemon
(``Client.gpu_pace``) that kvxfer's copies on its GPU may start at most
``per_ms`` bytes a millisecond for the next hold. An idle engine stops
calling, the pace lapses, and copies go at full speed
(docs/operations.md, "A pace the engine sets"). Each adapter names the
two settings its own way (vLLM's extra config keys, SGLang's
environment variables); a refusal names them so."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Tuple

from .client import Client
from .errors import Error, InvalidArgument
from ._outage import DAEMON_GONE

__all__ = ["HOLD_MS", "MAX_PER_MS", "MAX_HOLD_MS", "pace_config",
           "GpuPacer"]

HOLD_MS = 200  # the hold's default
MAX_PER_MS = 1 << 40  # the daemon's bound (gpu.pace's)
MAX_HOLD_MS = 60000


def _count(name: str, v: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidArgument(
            -1, f"{name}: {v!r}, expected {what} (an integer in "
            f"{lo}..{hi})")
    return v


def pace_config(per_ms: Any, hold_ms: Any, names: Tuple[str, str]
                ) -> Tuple[int, int]:
    """(bytes a millisecond, hold in ms) from the two settings as given
    (0 bytes: no pace); ``names`` are the settings' names, which a
    refusal gives. Raises InvalidArgument naming the setting."""
    return (_count(names[0], per_ms, 0, MAX_PER_MS, "bytes a millisecond"),
            _count(names[1], hold_ms, 1, MAX_HOLD_MS, "milliseconds"))


class GpuPacer:
    """One rank's pace: set at the steps that run a forward, never more
    often than a quarter of the hold, its failures logged once (to
    ``log``, naming the setting ``name``)."""

    def __init__(self, per_ms: int, hold_ms: int, log: logging.Logger,
                 name: str) -> None:
        self.per_ms, self.hold_ms = per_ms, hold_ms
        self._log = log
        self._name = name
        self._next = 0.0  # monotonic time the next call may go
        self._failing = False  # a failure was logged; none since

    def step(self, client: Optional[Client]) -> Optional[Error]:
        """A step that runs a forward. Returns the error of a daemon gone
        (the adapter's outage handling takes it), else None; other
        failures are logged (once until a call succeeds) and the step
        goes on."""
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
        except Error as e:
            if not self._failing:
                self._log.warning("kvxfer: the GPU pace (%s %d bytes a ms) "
                                  "was not set: %s; copies go unpaced",
                                  self._name, self.per_ms, e)
                self._failing = True
            return None
        if self._failing:
            self._log.info("kvxfer: the GPU pace is set again")
            self._failing = False
        return None
