"""kvxfer.sglang with state beside the KV: a Mamba model's conv and
temporal states (KVArgs.state_types MAMBA) move as kvxfer state slots
with the request's pages, slot to slot, byte for byte."""

import numpy as np
import pytest
from conftest import Rank, server_args, wait_poll
from test_backend import assert_landed, decode, prefill, receiver, room

import kvxfer
from kvxfer.sglang import (KvxferKVManager, KvxferKVSender,
                           KvxferTransferError)
from sglang.srt.disaggregation.base.conn import KVPoll, StateType

SLOTS = 6


def test_mamba_state_slot_moves_with_the_kv(env, bootstrap):
    """The prefill's request holds state slot 4, the decode's slot 1:
    every state tensor's slot 1 on the decode gets the prefill's slot 4,
    no other slot changes, and the KV lands as without state. The state
    indices are given as prefill.py and decode.py give a Mamba slot: a
    list holding an array of one index, on the last chunk only."""
    src = Rank(seed=50, mamba_slots=SLOTS)
    dst = Rank(seed=51, mamba_slots=SLOTS)
    before = [t.copy() for t in dst.state]
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm = room()
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(3, 0)
        src.set_aux(0, rm, 99)
        s.send(np.asarray([2, 5], np.int32), None, num_kv_tokens=8)
        s.send(np.asarray([7], np.int32), [[np.asarray([4])]],
               num_kv_tokens=3)
        assert s.poll() == KVPoll.Transferring, s._reason
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray([9, 0, 3], np.int32), 2,
                        [[np.asarray([1])]])
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
        assert_landed(src, dst, [2, 5, 7], [9, 0, 3], 11)
        for i, (t_src, t_dst, t0) in enumerate(zip(src.state, dst.state,
                                                   before)):
            assert np.array_equal(t_dst[1], t_src[4]), i
            others = [k for k in range(SLOTS + 1) if k != 1]
            assert np.array_equal(t_dst[others], t0[others]), i
        assert dst.aux[0][2, 0] == 99
    finally:
        pm.close()
        dm.close()


def test_state_slot_between_attention_tp_sizes_is_refused(env, bootstrap):
    p0 = Rank(engine_rank=0, heads=1, total_heads=2, seed=52,
              mamba_slots=SLOTS)
    p1 = Rank(engine_rank=1, heads=1, total_heads=2, seed=53,
              mamba_slots=SLOTS)
    dst = Rank(heads=2, total_heads=2, seed=54, mamba_slots=SLOTS)
    m0, m1 = prefill(bootstrap, p0, 2), prefill(bootstrap, p1, 2)
    dm = decode(bootstrap, dst)
    try:
        r = receiver(dm, bootstrap.address, room())
        r.send_metadata(np.asarray([1], np.int32), 0, [[np.asarray([1])]])
        assert r.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="state slots .* move between equal "
                           "attention TP sizes only: prefill 2, decode 1"):
            r.failure_exception()
    finally:
        for m in (m0, m1, dm):
            m.close()


def test_state_indices_that_do_not_fit_fail_by_name(env, bootstrap):
    src = Rank(seed=55, mamba_slots=SLOTS)
    pm = prefill(bootstrap, src)
    try:
        s = KvxferKVSender(pm, bootstrap.address, room())
        s.init(1, 0)
        s.send(np.asarray([2], np.int32), [], num_kv_tokens=3)
        assert s.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="state_indices: 0 entries for 1 state"):
            s.failure_exception()
        assert pm.client.requests() == []
    finally:
        pm.close()


def test_other_state_types_are_refused_at_start(env, bootstrap):
    src = Rank(seed=56, mamba_slots=SLOTS)
    src.args.state_types = [StateType.DSA]
    with pytest.raises(kvxfer.Unsupported,
                       match=r"state_types\[0\] dsa is not supported yet"):
        KvxferKVManager(src.args, "prefill", server_args(bootstrap.port),
                        False)
    src = Rank(seed=57, swa_layers=2)
    src.args.swa_kv_cache_layout = "hnd"
    with pytest.raises(kvxfer.Unsupported,
                       match=r"state_types\[0\] swa in a hnd layout"):
        KvxferKVManager(src.args, "prefill", server_args(bootstrap.port),
                        False)


@pytest.mark.parametrize("prefix", [0, 4])
def test_swa_window_moves_from_its_first_page(env, bootstrap, prefix):
    """A hybrid SWA model: the request's 5 pages (18 tokens) of full
    attention KV, and its sliding window, the last 2 pages of the SWA
    sub-pool (prefill.py's window from page 3), move; the decode's window
    pages get tokens [12, 18) of the SWA layers and nothing else of its
    SWA pool is written. With a decode radix prefix (prefix 4) the full
    KV skips it as before; the window lies after it."""
    src = Rank(seed=58, swa_layers=2)
    dst = Rank(seed=59, swa_layers=2)
    before = [b.copy() for b in dst.swa]
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm, P = room(), src.page
        pages, dpages = [2, 9, 4, 11, 6], [8, 1, 13, 5, 10]
        swa_src, swa_dst = [3, 8], [1, 6]  # window pages, SWA pool ids
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(5, 0)
        src.set_aux(0, rm, 7)
        s.send(np.asarray(pages[:3], np.int32), None, num_kv_tokens=12)
        s.send(np.asarray(pages[3:], np.int32), [np.asarray(swa_src)],
               num_kv_tokens=6)
        assert s.poll() == KVPoll.Transferring, s._reason
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray(dpages[prefix // P:], np.int32), 0,
                        [np.asarray(swa_dst)], decode_prefix_len=prefix)
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
        assert_landed(src, dst, pages[prefix // P:], dpages[prefix // P:],
                      18 - prefix)
        for b_src, b_dst, b0 in zip(src.swa, dst.swa, before):
            assert np.array_equal(b_dst[1 * P:2 * P], b_src[3 * P:4 * P])
            assert np.array_equal(b_dst[6 * P:6 * P + 2],
                                  b_src[8 * P:8 * P + 2])
            rest = [t for t in range(len(b0))
                    if not (P <= t < 2 * P or 6 * P <= t < 6 * P + 2)]
            assert np.array_equal(b_dst[rest], b0[rest])
    finally:
        pm.close()
        dm.close()
