"""kvxfer.sglang with SGLang's data parallelism: attention-DP groups on
both sides (the usual DeepSeek P/D set-up), the prefill DP group of a
room chosen by SGLang's own decode code (the room modulo the groups, or
/query_dp_ranks of its bootstrap server), bytes checked per head."""

import types

import numpy as np
import pytest
from conftest import Rank, parallel, server_args, wait_poll
from test_backend import assert_landed, room, send_chunks

import kvxfer
from kvxfer.sglang import (KvxferKVManager, KvxferKVReceiver,
                           KvxferKVSender, KvxferTransferError)
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.disaggregation.decode import DecodePreallocQueue

P_TP, P_DP, HEADS = 4, 2, 4  # prefill: 2 groups of 2 ranks, 2 heads each
D_TP, D_DP = 2, 2  # decode: 2 groups of 1 rank, 4 heads each


def dp_prefill(bootstrap, lb="follow_bootstrap_room"):
    """The 4 ranks of a prefill with --tp 4 --dp 2 --enable-dp-attention,
    each built under its own rank's get_parallel()."""
    ranks, mgrs = [], []
    attn_tp = P_TP // P_DP
    for r in range(P_TP):
        rank = Rank(engine_rank=r, heads=HEADS // attn_tp,
                    total_heads=HEADS, seed=100 + r)
        rank.args.system_dp_rank = r // attn_tp
        sa = server_args(bootstrap.port, P_TP, dp_size=P_DP,
                         enable_dp_attention=True, load_balance_method=lb)
        with parallel(P_TP, P_DP, r, lb=lb):
            mgrs.append(KvxferKVManager(rank.args, "prefill", sa, False))
        ranks.append(rank)
    return ranks, mgrs


def dp_decode(bootstrap):
    """The 2 ranks of a decode with --tp 2 --dp 2 --enable-dp-attention:
    its engine_rank is the attention-TP rank (0), as decode.py sets it."""
    ranks, mgrs = [], []
    port = None
    for r in range(D_TP):
        rank = Rank(engine_rank=0, heads=HEADS, total_heads=HEADS,
                    seed=200 + r)
        rank.args.system_dp_rank = r
        sa = server_args(bootstrap.port, D_TP, "decode", dp_size=D_DP,
                         enable_dp_attention=True)
        if port is None:
            port = sa.port
        sa.port = port  # one SGLang instance
        with parallel(D_TP, D_DP, r):
            mgrs.append(KvxferKVManager(rank.args, "decode", sa, False))
        ranks.append(rank)
    return ranks, mgrs


def prefill_dp_rank(dm, bootstrap, rm):
    """The prefill DP group of room ``rm``, decided by SGLang's decode
    queue (DecodePreallocQueue._resolve_prefill_dp_rank) from the
    manager's prefill_info_table."""
    assert dm.try_ensure_parallel_info(bootstrap.address), \
        dm.lookup_error(bootstrap.address)
    queue = types.SimpleNamespace(kv_manager=dm)
    req = types.SimpleNamespace(bootstrap_host="127.0.0.1",
                                bootstrap_port=bootstrap.port,
                                bootstrap_room=rm,
                                disagg_prefill_dp_rank=None)
    return DecodePreallocQueue._resolve_prefill_dp_rank(queue, req)


def send_group(pranks, pmgrs, group, bootstrap, rm, pages, ntok):
    """The prefill ranks of ``group`` send room ``rm``."""
    attn_tp = P_TP // P_DP
    senders = []
    for r in range(group * attn_tp, (group + 1) * attn_tp):
        s = KvxferKVSender(pmgrs[r], bootstrap.address, rm)
        assert s.poll() == KVPoll.WaitingForInput, s._reason
        s.init(len(pages[r]), 1)
        pranks[r].set_aux(1, rm, 1000 + group)
        send_chunks(s, [pages[r]], ntok, 4)  # one chunk: every token
        senders.append(s)
    return senders


def close(*mgrs):
    for m in mgrs:
        m.close()


def test_dp_attention_groups_are_instances_of_their_own(env, bootstrap):
    pranks, pmgrs = dp_prefill(bootstrap)
    dranks, dmgrs = dp_decode(bootstrap)
    try:
        names = [m.instance_id for m in pmgrs]
        assert names[0] == names[1] and names[2] == names[3]
        assert names[0].endswith("-dp0") and names[2].endswith("-dp1")
        assert [m.rank for m in pmgrs] == [0, 1, 0, 1]
        dnames = [m.instance_id for m in dmgrs]
        assert dnames[0].endswith("-dp0") and dnames[1].endswith("-dp1")
        info = dmgrs[0].prefill_info_table
        assert dmgrs[0].try_ensure_parallel_info(bootstrap.address)
        assert info[bootstrap.address].dp_size == P_DP
        assert info[bootstrap.address].attn_tp_size == P_TP // P_DP
    finally:
        close(*pmgrs, *dmgrs)


@pytest.mark.parametrize("lb", ["follow_bootstrap_room", "round_robin"])
def test_dp_attention_prefill_to_dp_attention_decode(env, bootstrap, lb):
    """Two rooms, one per prefill DP group, each read by the other decode
    DP group: every head of every page lands from the prefill group the
    room went to. follow_bootstrap_room: SGLang's decode queue derives
    the group from the room; round_robin: the prefill registers the
    room's group and the decode asks /query_dp_ranks, SGLang's call."""
    pranks, pmgrs = dp_prefill(bootstrap, lb)
    dranks, dmgrs = dp_decode(bootstrap)
    try:
        attn_tp = P_TP // P_DP
        pages = [[3, 9], [5, 1], [7, 2], [11, 6]]  # per prefill rank
        dst_pages = [[4, 8], [12, 0]]  # per decode rank
        rooms = []
        for group in range(P_DP):
            rm = room()
            while lb == "follow_bootstrap_room" and rm % P_DP != group:
                rm = room()
            rooms.append(rm)
            senders = send_group(pranks, pmgrs, group, bootstrap, rm,
                                 pages, 6)
            for s in senders:
                assert s.poll() == KVPoll.Transferring, s._reason
            decode = 1 - group  # the other decode group reads it
            dm = dmgrs[decode]
            if lb == "follow_bootstrap_room":
                d = prefill_dp_rank(dm, bootstrap, rm)
            else:
                assert prefill_dp_rank(dm, bootstrap, rm) is None
                d = int(CommonKVReceiver.query_prefill_dp_ranks(
                    bootstrap.address, [rm])[str(rm)])
            assert d == group
            r = KvxferKVReceiver(dm, bootstrap.address, rm)
            r.init(d)
            assert r.poll() == KVPoll.WaitingForInput, r._reason
            r.send_metadata(np.asarray(dst_pages[decode], np.int32), 3, [])
            assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
            for s in senders:
                assert wait_poll(s, KVPoll.Success) == KVPoll.Success
            for k in range(attn_tp):
                pr = group * attn_tp + k
                heads = slice(k * HEADS // attn_tp,
                              (k + 1) * HEADS // attn_tp)
                assert_landed(pranks[pr], dranks[decode], pages[pr],
                              dst_pages[decode], 6, heads=heads)
            assert dranks[decode].aux[0][3, 0] == 1000 + group
            assert int(dranks[decode].aux[2][3, 0]) == rm
    finally:
        close(*pmgrs, *dmgrs)


def test_room_dispatched_to_the_wrong_group_fails_by_name(env, bootstrap):
    pranks, pmgrs = dp_prefill(bootstrap)
    try:
        rm = room()
        while rm % P_DP != 1:
            rm = room()
        s = KvxferKVSender(pmgrs[0], bootstrap.address, rm)  # group 0
        assert s.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="follow_bootstrap_room conflict: "
                           "dispatched to DP group 0 but bootstrap_room "
                           f"{rm} implies 1"):
            s.failure_exception()
        # the router named the group: no conflict
        s = KvxferKVSender(pmgrs[0], bootstrap.address, rm, True)
        assert s.poll() == KVPoll.WaitingForInput
        s.clear()
    finally:
        close(*pmgrs)


def test_prefill_dp_rank_outside_the_groups_fails(env, bootstrap):
    pranks, pmgrs = dp_prefill(bootstrap)
    dranks, dmgrs = dp_decode(bootstrap)
    try:
        r = KvxferKVReceiver(dmgrs[0], bootstrap.address, room())
        r.init(2)
        assert r.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="prefill_dp_rank 2: the prefill at .* has "
                           "2 DP groups"):
            r.failure_exception()
    finally:
        close(*pmgrs, *dmgrs)


def test_dp_attention_decode_without_sglangs_context_is_refused(env,
                                                                bootstrap):
    rank = Rank(engine_rank=0, heads=4, total_heads=4, seed=300)
    sa = server_args(bootstrap.port, 2, "decode", dp_size=2,
                     enable_dp_attention=True)
    with pytest.raises(kvxfer.InvalidArgument,
                       match="DP attention needs SGLang's published "
                       "parallel context"):
        KvxferKVManager(rank.args, "decode", sa, False)


def test_context_parallelism_is_refused_naming_the_options(env,
                                                           bootstrap):
    rank = Rank(seed=301)
    for kw, opt in (({"attn_cp_size": 2}, "--attn-cp-size 2"),
                    ({"dcp_size": 2}, "--dcp-size 2")):
        try:
            sa = server_args(bootstrap.port, 2, **kw)
        except Exception as e:  # ServerArgs refused the combination
            pytest.skip(f"ServerArgs({kw}): {e}")
        with pytest.raises(kvxfer.Unsupported,
                           match=f"context parallelism .*{opt}.*Run with "
                           "--attn-cp-size 1 --dcp-size 1"):
            KvxferKVManager(rank.args, "prefill", sa, False)


def pp_stage(bootstrap, layers, stage, mode="prefill", seed=0):
    """Stage ``stage`` of a --pp-size 2 instance (TP 1) holding
    ``layers`` layers, under its own rank's get_parallel()."""
    rank = Rank(layers=layers, seed=seed)
    rank.args.pp_rank = stage
    sa = server_args(bootstrap.port, 1, mode, pp_size=2)
    with parallel(1, pp=2, pp_rank=stage):
        return rank, KvxferKVManager(rank.args, mode, sa, False)


def test_prefill_pipeline_stages_to_one_decode(env, bootstrap):
    """A prefill in 2 PP stages (1 and 2 of 3 layers, SGLang's
    SGLANG_PP_LAYER_PARTITION) to a decode without PP: each layer lands
    from the stage that holds it, and the aux rows are the last stage's
    (the one that computed the first token)."""
    env.setenv("SGLANG_PP_LAYER_PARTITION", "1,2")
    s0, m0 = pp_stage(bootstrap, 1, 0, seed=60)
    s1, m1 = pp_stage(bootstrap, 2, 1, seed=61)
    dst = Rank(layers=3, seed=62)
    dm = KvxferKVManager(dst.args, "decode",
                         server_args(bootstrap.port, 1, "decode"), False)
    try:
        assert m0.instance_id == m1.instance_id
        assert (m0.rank, m1.rank) == (0, 1)
        rm = room()
        pages, dpages = [6, 2, 9], [1, 14, 7]
        senders = []
        for stage, (rank, m) in enumerate(((s0, m0), (s1, m1))):
            s = KvxferKVSender(m, bootstrap.address, rm)
            s.init(3, 2)
            rank.set_aux(2, rm, 555 + stage)  # only the last stage's go
            send_chunks(s, [pages[:2], pages[2:]], 1, 4)
            senders.append(s)
        assert dm.try_ensure_parallel_info(bootstrap.address)
        assert dm.prefill_info_table[bootstrap.address].pp_size == 2
        r = KvxferKVReceiver(dm, bootstrap.address, rm)
        r.init(0)
        assert r.poll() == KVPoll.WaitingForInput, r._reason
        r.send_metadata(np.asarray(dpages, np.int32), 4, [])
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        for s in senders:
            assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
        whole = Rank(layers=3, seed=63)  # the two stages as one model
        whole.k, whole.v = s0.k + s1.k, s0.v + s1.v
        assert_landed(whole, dst, pages, dpages, 9)
        assert dst.aux[0][4, 0] == 556 and int(dst.aux[2][4, 0]) == rm
    finally:
        close(m0, m1, dm)


def test_pipeline_without_sglangs_partition_is_refused(env, bootstrap):
    env.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    with pytest.raises(kvxfer.Unsupported,
                       match="pipeline parallelism .* set "
                       "SGLANG_PP_LAYER_PARTITION"):
        pp_stage(bootstrap, 1, 0)
    env.setenv("SGLANG_PP_LAYER_PARTITION", "2,2")
    with pytest.raises(kvxfer.InvalidArgument,
                       match="gives PP stage 0 2 layers; its KV buffers "
                       "hold 1"):
        pp_stage(bootstrap, 1, 0)


@pytest.mark.parametrize("force", ["1", "false"])
def test_forced_query_is_read_as_sglang_reads_it(env, bootstrap, force):
    """SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK, SGLang's own
    switch, read through its envs as its decode queue reads it: "1"
    registers the room's group for /query_dp_ranks (no conflict),
    "false" is off (the room's group is the room modulo the groups)."""
    env.setenv("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", force)
    pranks, pmgrs = dp_prefill(bootstrap)
    try:
        rm = room()
        while rm % P_DP != 1:
            rm = room()
        s = KvxferKVSender(pmgrs[0], bootstrap.address, rm)  # group 0
        got = CommonKVReceiver.query_prefill_dp_ranks(bootstrap.address,
                                                      [rm])
        if force == "1":
            assert s.poll() == KVPoll.WaitingForInput, s._reason
            assert got == {str(rm): 0}
        else:
            assert s.poll() == KVPoll.Failed
            assert "follow_bootstrap_room conflict" in s._reason
            assert got == {}
        s.clear()
    finally:
        close(*pmgrs)
