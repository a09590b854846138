"""The GPU pace a rank sets while its engine computes
(KVXFER_SGLANG_GPU_PACE, KVXFER_SGLANG_GPU_PACE_HOLD_MS), driven as
SGLang's scheduler drives the backend: the daemon's status shows a
prefill rank's pace while its forwards send chunks, and a decode rank's
while it polls a fetch in flight; the pace lapses a hold after the calls
stop. Bad values are refused when the manager starts, naming the
variable."""

import time

import numpy as np
import pytest
from conftest import Daemon, Rank, server_args, wait_poll

import kvxfer
from kvxfer.sglang import KvxferKVManager, KvxferKVReceiver, KvxferKVSender
from kvxfer.sglang.bootstrap import group_locator
from sglang.srt.disaggregation.base.conn import KVPoll

PACE = 3 << 20  # bytes a millisecond
SHOWN = f"engines 1 (lowest {PACE} B/ms, 1 without a GPU pool)"

_rooms = iter(range(9_000_000_000_001, 9_500_000_000_000, 7919))


def gpu_status(obs):
    return obs.status()["gpu"]


def wait_unpaced(obs, poll=None, timeout=10.0):
    """Until the status names no engine pace (poll() runs meanwhile)."""
    end = time.monotonic() + timeout
    while "engines" in gpu_status(obs):
        assert time.monotonic() < end, gpu_status(obs)
        if poll is not None:
            poll()
        time.sleep(0.01)


def manager(bootstrap, rank, mode):
    return KvxferKVManager(rank.args, mode,
                           server_args(bootstrap.port, 1, mode), False)


def test_prefill_paces_while_it_sends_chunks(env, daemon, bootstrap):
    env.setenv("KVXFER_SGLANG_GPU_PACE", str(PACE))
    env.setenv("KVXFER_SGLANG_GPU_PACE_HOLD_MS", "300")
    src = Rank(seed=3, num_pages=16)
    pm = manager(bootstrap, src, "prefill")
    obs = kvxfer.Client(daemon.sock)
    try:
        s = KvxferKVSender(pm, bootstrap.address, next(_rooms))
        s.init(8, 0)
        assert s.poll() == KVPoll.WaitingForInput
        assert "engines" not in gpu_status(obs)  # no forward yet
        # the first chunk's forward ran: SGLang's send_kv_chunk
        s.send(np.asarray([1, 2], np.int32), None, num_kv_tokens=8)
        assert SHOWN in gpu_status(obs)
        # the prefill computes nothing more: the pace lapses a hold later
        wait_unpaced(obs)
        s.send(np.asarray([3, 4], np.int32), None, num_kv_tokens=8)
        assert SHOWN in gpu_status(obs)
        wait_unpaced(obs)
        # polls without a forward (the inflight queue's) keep no pace
        for _ in range(20):
            assert s.poll() == KVPoll.WaitingForInput
            time.sleep(0.01)
        assert "engines" not in gpu_status(obs)
        s.abort()
        assert s.poll() == KVPoll.Failed
    finally:
        obs.close()
        pm.close()


def test_decode_paces_while_its_fetch_runs(env, daemon, bootstrap):
    src, dst = Rank(seed=4, num_pages=16), Rank(seed=5, num_pages=16)
    pm = manager(bootstrap, src, "prefill")  # sets no pace
    env.setenv("KVXFER_SGLANG_GPU_PACE", str(PACE))  # the decode's
    dm = manager(bootstrap, dst, "decode")
    obs = kvxfer.Client(daemon.sock)
    try:
        rm = next(_rooms)
        r = KvxferKVReceiver(dm, bootstrap.address, rm)
        assert r.poll() == KVPoll.Bootstrapping
        assert dm.try_ensure_parallel_info(bootstrap.address)
        r.init(0)
        assert r.poll() == KVPoll.WaitingForInput
        assert "engines" not in gpu_status(obs)  # nothing moves yet
        # the fetch waits for the prefill's publish, in flight
        r.send_metadata(np.asarray([5, 6], np.int32), 1, [],
                        decode_prefix_len=0)
        assert r.poll() == KVPoll.Transferring
        assert SHOWN in gpu_status(obs)
        # the decode stops polling: the pace lapses a hold (200 ms) later
        wait_unpaced(obs)
        assert r.poll() == KVPoll.Transferring
        assert SHOWN in gpu_status(obs)
        # the prefill's forward publishes (its own sends set no pace)
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(2, 1)
        s.send(np.asarray([7, 8], np.int32), [], num_kv_tokens=6)
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
        # polls with no fetch in flight keep no pace
        wait_unpaced(obs, poll=r.poll)
        for _ in range(20):
            assert r.poll() == KVPoll.Success
            time.sleep(0.01)
        assert "engines" not in gpu_status(obs)
    finally:
        obs.close()
        dm.close()
        pm.close()


def test_pace_through_a_daemon_gone_and_back(env, bootstrap, tmp_path):
    """kill -9 of kvxferd while a prefill paces: its sends raise nothing
    (the room fails); after a new daemon on the same socket the next
    chunk sets the pace there, and the prefill's new daemon address
    reaches the bootstrap server, even when the pace's call was the one
    that reconnected."""
    own = Daemon(tmp_path)
    env.setenv("KVXFER_SGLANG_SOCKET", own.sock)
    env.setenv("KVXFER_SGLANG_GPU_PACE", str(PACE))
    env.setenv("KVXFER_SGLANG_GPU_PACE_HOLD_MS", "300")
    pm = manager(bootstrap, Rank(seed=6, num_pages=16), "prefill")
    try:
        s1 = KvxferKVSender(pm, bootstrap.address, next(_rooms))
        s1.init(4, 0)
        s1.send(np.asarray([1], np.int32), None, num_kv_tokens=4)
        obs = kvxfer.Client(own.sock)
        assert SHOWN in gpu_status(obs)
        obs.close()
        own.kill9()
        time.sleep(0.1)  # past a quarter of the hold: the pace calls
        s1.send(np.asarray([2], np.int32), None, num_kv_tokens=4)
        assert s1.poll() == KVPoll.Failed
        own.start()
        time.sleep(0.1)
        s2 = KvxferKVSender(pm, bootstrap.address, next(_rooms))
        s2.init(4, 0)
        s2.send(np.asarray([3], np.int32), None, num_kv_tokens=4)
        assert s2.poll() == KVPoll.WaitingForInput, s2._reason
        assert pm.client.incarnation == 1
        assert group_locator(bootstrap.address, 0).address == \
            pm.client.daemon_address
        obs = kvxfer.Client(own.sock)
        assert SHOWN in gpu_status(obs)
        obs.close()
        s2.abort()
    finally:
        pm.close()
        own.stop()


@pytest.mark.parametrize("given, message", [
    ({"KVXFER_SGLANG_GPU_PACE": "512MiB"},
     "KVXFER_SGLANG_GPU_PACE: '512MiB', expected bytes a millisecond "
     "(an integer in 0..1099511627776)"),
    ({"KVXFER_SGLANG_GPU_PACE": "-1"}, "KVXFER_SGLANG_GPU_PACE: -1"),
    ({"KVXFER_SGLANG_GPU_PACE": str((1 << 40) + 1)},
     "KVXFER_SGLANG_GPU_PACE: 1099511627777"),
    ({"KVXFER_SGLANG_GPU_PACE": "1048576",
      "KVXFER_SGLANG_GPU_PACE_HOLD_MS": "0"},
     "KVXFER_SGLANG_GPU_PACE_HOLD_MS: 0, expected milliseconds (an "
     "integer in 1..60000)"),
    ({"KVXFER_SGLANG_GPU_PACE": "1048576",
      "KVXFER_SGLANG_GPU_PACE_HOLD_MS": "1s"},
     "KVXFER_SGLANG_GPU_PACE_HOLD_MS: '1s'"),
])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_bad_pace_refused_at_start(env, bootstrap, given, message, mode):
    for k, v in given.items():
        env.setenv(k, v)
    with pytest.raises(kvxfer.InvalidArgument) as ei:
        manager(bootstrap, Rank(), mode).close()
    assert message in str(ei.value)
