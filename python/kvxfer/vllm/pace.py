"""The GPU pace a worker sets while its engine computes
(kv_connector_extra_config ``gpu_pace``, ``gpu_pace_hold_ms``): at each
step that runs a forward, at most once a quarter of the hold, the worker
tells its daemon (``Client.gpu_pace``) that kvxfer's copies on its GPU
may start at most ``gpu_pace`` bytes a millisecond for the next hold. An
idle engine stops calling, the pace lapses, and copies go at full speed
(docs/operations.md, "A pace the engine sets"). The pacer is kvxfer's
(kvxfer/_pace.py, which kvxfer.sglang shares); this module reads the
extra config."""

from __future__ import annotations

import logging
from typing import Any, Dict, Tuple

from kvxfer import _pace
from kvxfer._pace import HOLD_MS, MAX_HOLD_MS, MAX_PER_MS

__all__ = ["HOLD_MS", "MAX_PER_MS", "MAX_HOLD_MS", "pace_config",
           "GpuPacer"]

log = logging.getLogger("kvxfer.vllm")

_KEYS = ("kv_connector_extra_config.gpu_pace",
         "kv_connector_extra_config.gpu_pace_hold_ms")


def pace_config(extra: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes a millisecond, hold in ms) from the extra config; 0 bytes:
    no pace (``gpu_pace`` absent or 0). Raises InvalidArgument naming the
    key."""
    return _pace.pace_config(extra.get("gpu_pace", 0),
                             extra.get("gpu_pace_hold_ms", HOLD_MS), _KEYS)


class GpuPacer(_pace.GpuPacer):
    """One worker's pace (kvxfer/_pace.py's), from the extra config."""

    def __init__(self, extra: Dict[str, Any]) -> None:
        super().__init__(*pace_config(extra), log, "gpu_pace")
