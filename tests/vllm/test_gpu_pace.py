"""The GPU pace the worker sets while its engine computes (issue 39,
kv_connector_extra_config ``gpu_pace``): through vLLM's own Scheduler
and worker connectors (harness.Engine), the daemon's status shows the
worker's pace while steps run forwards, and it lapses once the engine
stops stepping, or steps with nothing to compute. Bad values are
refused at init, naming the key."""

from __future__ import annotations

import time

import pytest

from vllm.distributed.kv_transfer.kv_connector.factory import \
    KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import \
    KVConnectorRole
from vllm.v1.request import RequestStatus

import kvxfer

from harness import prompt_of, vllm_config

PACE = 3 << 20  # bytes a millisecond
SHOWN = f"engines 1 (lowest {PACE} B/ms, 1 without a GPU pool)"


def gpu_status(obs: kvxfer.Client) -> str:
    return obs.status()["gpu"]


def wait_unpaced(obs: kvxfer.Client, step=None, timeout: float = 10.0
                 ) -> None:
    """Until the status names no engine pace (step() runs meanwhile)."""
    end = time.monotonic() + timeout
    while "engines" in gpu_status(obs):
        assert time.monotonic() < end, gpu_status(obs)
        if step is not None:
            step()
        time.sleep(0.01)


def test_pace_while_computing_lapses_when_idle(daemon, engines):
    e = engines(extra={"gpu_pace": PACE, "gpu_pace_hold_ms": 300})
    obs = kvxfer.Client(daemon.sock)
    try:
        e.step()  # no request: no forward, no pace
        assert "engines" not in gpu_status(obs)
        e.add("pace-1", prompt_of(24, 5), 400)
        end = time.monotonic() + 10
        while SHOWN not in gpu_status(obs):  # set by the steps' forwards
            assert time.monotonic() < end, gpu_status(obs)
            e.step()
        assert "pace-1" not in e.outputs  # still decoding
        # the engine stops stepping: the pace lapses a hold later
        wait_unpaced(obs)
        # steps again: set again
        e.step()
        assert SHOWN in gpu_status(obs)
        # steps with nothing to compute keep no pace
        e.sched.finish_requests(["pace-1"], RequestStatus.FINISHED_ABORTED)
        wait_unpaced(obs, step=e.step)
        for _ in range(20):
            e.step()
        assert "engines" not in gpu_status(obs)
    finally:
        obs.close()


def test_no_pace_without_the_key(daemon, engines):
    e = engines()
    obs = kvxfer.Client(daemon.sock)
    try:
        e.add("pace-2", prompt_of(24, 6), 20)
        for _ in range(10):
            e.step()
        assert "engines" not in gpu_status(obs)
    finally:
        obs.close()


@pytest.mark.parametrize("extra, message", [
    ({"gpu_pace": "512MiB"},
     "kv_connector_extra_config.gpu_pace: '512MiB', expected bytes a "
     "millisecond"),
    ({"gpu_pace": -1}, "kv_connector_extra_config.gpu_pace: -1"),
    ({"gpu_pace": (1 << 40) + 1}, "kv_connector_extra_config.gpu_pace"),
    ({"gpu_pace": 1 << 20, "gpu_pace_hold_ms": 0},
     "kv_connector_extra_config.gpu_pace_hold_ms: 0, expected "
     "milliseconds (an integer in 1..60000)"),
    ({"gpu_pace": 1 << 20, "gpu_pace_hold_ms": 60001},
     "kv_connector_extra_config.gpu_pace_hold_ms: 60001"),
])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER,
                                  KVConnectorRole.WORKER])
def test_bad_pace_refused_at_init(model_dir, daemon, extra, message, role):
    vc = vllm_config(model_dir, daemon.sock, "pace-cfg", extra=extra)
    with pytest.raises(kvxfer.InvalidArgument) as ei:
        KVConnectorFactory.create_connector(vc, role, None)
    assert message in str(ei.value)
