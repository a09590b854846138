"""kvxfer.sglang driven as SGLang 0.5.23's scheduler drives a transfer
backend (prefill.py, decode.py), with host-memory KV buffers and a real
kvxferd: the bytes of every page, the aux rows and the KVPoll states."""

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import (AUX_ROWS, FETCH_TIMEOUT_MS, Daemon, Rank, server_args,
                      wait_poll)

import kvxfer
from kvxfer.sglang import (KvxferKVBootstrapServer, KvxferKVManager,
                           KvxferKVReceiver, KvxferKVSender,
                           KvxferTransferError)
from kvxfer.sglang.bootstrap import group_locator
from sglang.srt.disaggregation.base.conn import (BaseKVBootstrapServer,
                                                 BaseKVManager,
                                                 BaseKVReceiver,
                                                 BaseKVSender, KVPoll)
from sglang.srt.disaggregation.common.conn import (CommonKVBootstrapServer,
                                                   PrefillServerInfo)

_rooms = iter(range(7_000_000_000_001, 8_000_000_000_000, 7919))


def room():
    """A bootstrap room as SGLang's router makes them: a large int."""
    return next(_rooms)


def prefill(bootstrap, rank, tp_size=1):
    return KvxferKVManager(rank.args, "prefill",
                           server_args(bootstrap.port, tp_size), False)


def decode(bootstrap, rank, tp_size=1, mla=False):
    return KvxferKVManager(rank.args, "decode",
                           server_args(bootstrap.port, tp_size, "decode"),
                           mla)


def receiver(mgr, addr, rm):
    """A receiver through the decode queue's steps up to send_metadata:
    the prefill's parallel info (try_ensure_parallel_info when the table
    lacks it), prefill DP rank 0 (dp_size 1), init."""
    r = KvxferKVReceiver(mgr, addr, rm)
    assert r.poll() == KVPoll.Bootstrapping
    if mgr.prefill_info_table.get(addr) is None:
        assert mgr.try_ensure_parallel_info(addr), mgr.lookup_error(addr)
    assert mgr.prefill_info_table[addr].dp_size == 1
    r.init(0)
    assert r.poll() == KVPoll.WaitingForInput
    return r


def send_chunks(sender, chunks, last_tokens, page):
    """The prefill's send_kv_chunk calls: full pages of every chunk but
    the last, then the last chunk with its partial page and the state
    indices list (empty: no state types)."""
    for pages in chunks[:-1]:
        if sender.should_send_kv_chunk(len(pages), False):
            sender.send(np.asarray(pages, np.int32), None,
                        num_kv_tokens=len(pages) * page)
        assert sender.poll() == KVPoll.WaitingForInput  # nothing published
    last = chunks[-1]
    assert sender.should_send_kv_chunk(len(last), True)
    sender.send(np.asarray(last, np.int32), [], num_kv_tokens=last_tokens)


def assert_landed(src, dst, src_pages, dst_pages, num_tokens, heads=None):
    """Every token < num_tokens of every layer's K and V moved from the
    prefill's pages to the decode's (heads: the decode's head range the
    prefill rank holds)."""
    P = src.page
    for (layer, kind, s), (_, _, d) in zip(src.buffers(), dst.buffers()):
        for i, (sp, dp) in enumerate(zip(src_pages, dst_pages)):
            n = min(P, num_tokens - i * P)
            got = d[dp * P:dp * P + n]
            if heads is not None:
                got = got[:, heads]
            want = s[sp * P:sp * P + n]
            assert np.array_equal(got, want), \
                f"layer {layer} {kind} page {i} ({sp} -> {dp})"


def test_classes_are_sglangs_base_classes():
    assert issubclass(KvxferKVManager, BaseKVManager)
    assert issubclass(KvxferKVSender, BaseKVSender)
    assert issubclass(KvxferKVReceiver, BaseKVReceiver)
    assert issubclass(KvxferKVBootstrapServer, BaseKVBootstrapServer)


@pytest.mark.parametrize("stream", ["1", "0"])
def test_transfer_in_several_chunks_lands_every_page(env, bootstrap, stream):
    """Streaming (the default) or not: every token lands, no other page
    is written; streaming moves whole pages (a chunk does not know the
    prompt's length), so the last page's tail is the prefill's too."""
    env.setenv("KVXFER_SGLANG_STREAM", stream)
    src, dst = Rank(seed=1, num_pages=16), Rank(seed=2, num_pages=16)
    before = [b.copy() for _, _, b in dst.buffers()]
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm, P = room(), src.page
        num_tokens = 37  # 10 pages, the last one partial
        src_pages = [11, 3, 7, 0, 15, 9, 2, 12, 5, 14]
        dst_pages = [4, 10, 1, 13, 6, 8, 0, 15, 3, 11]
        s = KvxferKVSender(pm, bootstrap.address, rm)
        assert s.poll() == KVPoll.WaitingForInput  # no handshake to wait for
        s.init(len(src_pages), 2)
        src.set_aux(2, rm, 1234)
        send_chunks(s, [src_pages[:4], src_pages[4:8], src_pages[8:]],
                    num_tokens - 8 * P, P)
        assert s.poll() == KVPoll.Transferring  # published, not yet read
        time.sleep(0.1)
        assert s.poll() == KVPoll.Transferring

        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray(dst_pages, np.int32), 5, [],
                        decode_prefix_len=0)
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
        assert_landed(src, dst, src_pages, dst_pages, num_tokens)
        # nothing else was written: other pages, the last page's tail
        # (streaming: the prefill's tail)
        for (_, _, d), b, (_, _, sb) in zip(dst.buffers(), before,
                                            src.buffers()):
            for p in set(range(16)) - set(dst_pages):
                assert np.array_equal(d[p * P:(p + 1) * P],
                                      b[p * P:(p + 1) * P])
            tail = dst_pages[-1] * P + num_tokens % P
            want = b if stream == "0" else sb
            at = src_pages[-1] * P + num_tokens % P if stream == "1" \
                else tail
            assert np.array_equal(d[tail:(dst_pages[-1] + 1) * P],
                                  want[at:at + P - num_tokens % P])
        m = s.get_transfer_metric()
        assert m.transfer_total_bytes == 10 * sum(src.args.kv_item_lens)
        assert m.transfer_latency_s is not None
        s.clear()
        r.clear()
    finally:
        pm.close()
        dm.close()


def landed(src, dst, src_pages, dst_pages, num_tokens):
    try:
        assert_landed(src, dst, src_pages, dst_pages, num_tokens)
        return True
    except AssertionError:
        return False


def test_streaming_moves_each_chunk_before_the_last(env, bootstrap):
    """The decode fetches first; the prefill sends 2 chunks of 3 full
    pages: their tokens reach the decode's pages while the request is
    still WaitingForInput on the prefill (kvxfer's layer-wise offer,
    append_blocks and the chunk's ready tokens), and nothing else does;
    the last chunk completes it, aux rows included."""
    src, dst = Rank(seed=44, num_pages=16), Rank(seed=45, num_pages=16)
    before = [b.copy() for _, _, b in dst.buffers()]
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm, P = room(), src.page
        src_pages = [5, 1, 9, 12, 3, 8, 14, 0]  # 30 tokens
        dst_pages = [7, 2, 11, 4, 15, 6, 10, 13]
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray(dst_pages, np.int32), 1, [])
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(len(src_pages), 3)
        for k in (0, 1):
            chunk = src_pages[3 * k:3 * k + 3]
            s.send(np.asarray(chunk, np.int32), None, num_kv_tokens=12)
            assert s.poll() == KVPoll.WaitingForInput, s._reason
            end = time.monotonic() + 5
            while not landed(src, dst, src_pages[:3 * k + 3],
                             dst_pages[:3 * k + 3], 12 * (k + 1)):
                assert time.monotonic() < end, f"chunk {k} did not move"
                assert r.poll() == KVPoll.Transferring, r._reason
                time.sleep(0.01)
            for (_, _, d), b in zip(dst.buffers(), before):
                for p in dst_pages[3 * k + 3:]:  # the pages to come
                    assert np.array_equal(d[p * P:(p + 1) * P],
                                          b[p * P:(p + 1) * P])
        assert r.poll() == KVPoll.Transferring  # no aux yet
        assert not dst.aux[2].any()
        src.set_aux(3, rm, 808)
        s.send(np.asarray(src_pages[6:], np.int32), [], num_kv_tokens=6)
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
        assert_landed(src, dst, src_pages, dst_pages, 30)
        assert dst.aux[0][1, 0] == 808 and int(dst.aux[2][1, 0]) == rm
    finally:
        pm.close()
        dm.close()


def test_aux_rows_reach_the_decode_metadata_buffers(env, bootstrap):
    src, dst = Rank(seed=3), Rank(seed=4)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm = room()
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(2, 6)
        src.set_aux(6, rm, 31337)
        src.aux[1][6, :4] = [-0.5, -1.5, -2.5, -3.5]  # top logprobs
        r = receiver(dm, bootstrap.address, rm)
        # the decode sends its pages first: fetch by key waits
        r.send_metadata(np.asarray([1, 2], np.int32), 3, [])
        assert r.poll() == KVPoll.Transferring
        send_chunks(s, [[5, 9]], 6, src.page)
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        for a_src, a_dst in zip(src.aux, dst.aux):
            assert np.array_equal(a_dst[3], a_src[6])
            others = [i for i in range(AUX_ROWS) if i != 3]
            assert not a_dst[others].any()
        # what SGLang's metadata gate reads before it lets Success through
        assert int(dst.aux[2][3, 0]) == rm
        assert dst.aux[0][3, 0] == 31337
        assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
    finally:
        pm.close()
        dm.close()


def test_prefill_tp2_to_decode_tp1_gets_every_head(env, bootstrap):
    """Two prefill ranks of one instance hold 2 of the 4 KV heads each;
    the one decode rank gets all 4 from the two of them."""
    p0 = Rank(engine_rank=0, heads=2, total_heads=4, seed=5)
    p1 = Rank(engine_rank=1, heads=2, total_heads=4, seed=6)
    dst = Rank(heads=4, total_heads=4, seed=7)
    m0, m1 = prefill(bootstrap, p0, 2), prefill(bootstrap, p1, 2)
    dm = decode(bootstrap, dst)
    try:
        assert m0.instance_id == m1.instance_id
        assert dm.try_ensure_parallel_info(bootstrap.address)
        assert dm.prefill_info_table[bootstrap.address].attn_tp_size == 2
        rm, P = room(), p0.page
        s0 = KvxferKVSender(m0, bootstrap.address, rm)
        s1 = KvxferKVSender(m1, bootstrap.address, rm)
        pages = [[8, 1, 6], [2, 12, 4]]  # each rank allocates its own
        for s, rank, pg in ((s0, p0, pages[0]), (s1, p1, pages[1])):
            s.init(3, 1)
            rank.set_aux(1, rm, 77)  # every rank writes the same row
            send_chunks(s, [pg[:2], pg[2:]], 10 - 2 * P, P)
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray([9, 0, 5], np.int32), 0, [])
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert_landed(p0, dst, pages[0], [9, 0, 5], 10, heads=slice(0, 2))
        assert_landed(p1, dst, pages[1], [9, 0, 5], 10, heads=slice(2, 4))
        assert dst.aux[0][0, 0] == 77
        for s in (s0, s1):
            assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
    finally:
        m0.close()
        m1.close()
        dm.close()


def test_mla_latent_buffers(env, bootstrap):
    src = Rank(mla=True, head_dim=12, seed=8)
    dst = Rank(mla=True, head_dim=12, seed=9)
    pm = KvxferKVManager(src.args, "prefill",
                         server_args(bootstrap.port), True)
    dm = decode(bootstrap, dst, mla=True)
    try:
        rm = room()
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(2, 0)
        send_chunks(s, [[3], [7]], 3, src.page)
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray([10, 11], np.int32), 0, [])
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert_landed(src, dst, [3, 7], [10, 11], 7)
    finally:
        pm.close()
        dm.close()


def test_abort_a_receiver_waiting_for_input(env, bootstrap):
    dst = Rank(seed=10)
    dm = decode(bootstrap, dst)
    src = Rank(seed=11)
    pm = prefill(bootstrap, src)
    try:
        r = receiver(dm, bootstrap.address, room())
        r.abort()
        assert r.poll() == KVPoll.Failed
        assert r.key not in dm._waiters  # SGLang may never clear() it
        with pytest.raises(KvxferTransferError, match="aborted"):
            r.failure_exception()
        assert dm.client.requests() == []  # no fetch was ever made
    finally:
        pm.close()
        dm.close()


def test_abort_a_transferring_receiver_then_no_write(env, bootstrap):
    src, dst = Rank(seed=12), Rank(seed=13)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm = room()
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray([1, 2, 3], np.int32), 2, [])
        assert r.poll() == KVPoll.Transferring  # waits for the publish
        before = [b.copy() for _, _, b in dst.buffers()]
        r.abort()
        assert r.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError) as ei:
            r.failure_exception()
        assert "aborted" in str(ei.value) and ei.value.bootstrap_room == rm
        # the prefill publishes after the abort: nothing reaches the pages
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(3, 0)
        src.set_aux(0, rm, 5)
        send_chunks(s, [[4, 5, 6]], 12, src.page)
        time.sleep(0.3)
        for _ in range(5):
            dm.pump(force=True)
        for (_, _, d), b in zip(dst.buffers(), before):
            assert np.array_equal(d, b)
        assert not dst.aux[2].any()
        s.abort()  # the offer no decode will read
        assert s.poll() == KVPoll.Failed
    finally:
        pm.close()
        dm.close()


def test_abort_a_sender_before_its_last_chunk_publishes_nothing(env,
                                                                bootstrap):
    src = Rank(seed=14)
    pm = prefill(bootstrap, src)
    try:
        s = KvxferKVSender(pm, bootstrap.address, room())
        s.init(4, 0)
        s.send(np.asarray([1, 2], np.int32), None, num_kv_tokens=8)
        assert s.poll() == KVPoll.WaitingForInput
        s.abort()  # aborted mid-prefill
        assert s.poll() == KVPoll.Failed
        s.send(np.asarray([3, 4], np.int32), [], num_kv_tokens=6)
        assert s.poll() == KVPoll.Failed
        assert pm.client.requests() == []  # nothing was offered
        with pytest.raises(KvxferTransferError, match="aborted"):
            s.failure_exception()
    finally:
        pm.close()


@pytest.mark.parametrize("stream", ["1", "0"])
def test_abort_published_senders_fails_the_waiting_decode(env, bootstrap,
                                                          stream):
    """TP 2 prefill: rank 0 published, rank 1 not yet, the decode's fetch
    waits for rank 1; SGLang aborts the request on both ranks: the
    decode fails at once, cancelled by the context side. Without
    streaming nothing reached its pages; streaming, the chunks sent did
    (the pages are the failed request's own)."""
    env.setenv("KVXFER_SGLANG_STREAM", stream)
    p0 = Rank(engine_rank=0, heads=1, total_heads=2, seed=15)
    p1 = Rank(engine_rank=1, heads=1, total_heads=2, seed=36)
    dst = Rank(heads=2, total_heads=2, seed=16)
    m0, m1 = prefill(bootstrap, p0, 2), prefill(bootstrap, p1, 2)
    dm = decode(bootstrap, dst)
    try:
        rm = room()
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray([7, 8], np.int32), 0, [])
        before = [b.copy() for _, _, b in dst.buffers()]
        s0 = KvxferKVSender(m0, bootstrap.address, rm)
        s1 = KvxferKVSender(m1, bootstrap.address, rm)
        s0.init(2, 0)
        s1.init(2, 0)
        send_chunks(s0, [[2, 3]], 5, p0.page)
        s1.send(np.asarray([4], np.int32), None, num_kv_tokens=4)
        assert s0.poll() == KVPoll.Transferring
        assert r.poll() == KVPoll.Transferring
        t = time.monotonic()
        s0.abort()
        s1.abort()
        assert s0.poll() == KVPoll.Failed and s1.poll() == KVPoll.Failed
        assert wait_poll(r, KVPoll.Success) == KVPoll.Failed
        assert time.monotonic() - t < 1.0
        with pytest.raises(KvxferTransferError,
                           match="CANCELLED: context side"):
            r.failure_exception()
        for (_, _, d), b in zip(dst.buffers(), before):
            assert stream == "1" or np.array_equal(d, b)
    finally:
        m0.close()
        m1.close()
        dm.close()


def test_prefill_rank_gone_mid_transfer_fails_the_decode(env, bootstrap):
    """TP 2 prefill: rank 0 published, rank 1's process goes away (its
    client closes) before publishing: the decode fails at once."""
    p0 = Rank(engine_rank=0, heads=1, total_heads=2, seed=17)
    p1 = Rank(engine_rank=1, heads=1, total_heads=2, seed=18)
    dst = Rank(heads=2, total_heads=2, seed=19)
    m0, m1 = prefill(bootstrap, p0, 2), prefill(bootstrap, p1, 2)
    dm = decode(bootstrap, dst)
    try:
        rm = room()
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray([1, 2], np.int32), 0, [])
        s0 = KvxferKVSender(m0, bootstrap.address, rm)
        s0.init(2, 0)
        send_chunks(s0, [[3, 4]], 6, p0.page)
        assert r.poll() == KVPoll.Transferring
        t = time.monotonic()
        m1.close()
        assert wait_poll(r, KVPoll.Success) == KVPoll.Failed
        assert time.monotonic() - t < 1.0  # not a timeout
        with pytest.raises(KvxferTransferError, match="PEER_GONE.*rank 1"):
            r.failure_exception()
        assert wait_poll(s0, KVPoll.Success) == KVPoll.Failed
        with pytest.raises(KvxferTransferError, match="PEER_GONE"):
            s0.failure_exception()
    finally:
        m0.close()
        dm.close()


def test_prefill_instance_gone_before_the_fetch_fails_the_decode(env,
                                                                 bootstrap):
    src, dst = Rank(seed=20), Rank(seed=21)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm = room()
        assert dm.try_ensure_parallel_info(bootstrap.address)
        s = KvxferKVSender(pm, bootstrap.address, rm)
        s.init(1, 0)
        send_chunks(s, [[1]], 2, src.page)
        pm.close()  # the whole prefill instance goes away
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray([5], np.int32), 0, [])
        assert wait_poll(r, KVPoll.Success,
                         FETCH_TIMEOUT_MS / 1000 + 5) == KVPoll.Failed
        with pytest.raises(KvxferTransferError, match="TIMED_OUT"):
            r.failure_exception()
    finally:
        pm.close()
        dm.close()


def test_unknown_room_times_out_with_kvxfers_message(env, bootstrap):
    src, dst = Rank(seed=22), Rank(seed=23)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm = room()
        r = receiver(dm, bootstrap.address, rm)
        t = time.monotonic()
        r.send_metadata(np.asarray([5, 6], np.int32), 0, [])
        assert wait_poll(r, KVPoll.Success,
                         FETCH_TIMEOUT_MS / 1000 + 5) == KVPoll.Failed
        assert time.monotonic() - t >= FETCH_TIMEOUT_MS / 1000 - 0.1
        with pytest.raises(KvxferTransferError) as ei:
            r.failure_exception()
        msg = str(ei.value)
        assert msg.startswith(f"kvxfer transfer of room {rm} failed: "
                              "TIMED_OUT: fetch_by_key: no offer of request "
                              f"{rm} of instance {pm.instance_id}"), msg
        assert ei.value.code == kvxfer.TimedOut.code
    finally:
        pm.close()
        dm.close()


def test_no_prefill_at_the_bootstrap_address_fails_the_receiver(env,
                                                                bootstrap):
    env.setenv("KVXFER_SGLANG_BOOTSTRAP_TIMEOUT", "0.3")
    dst = Rank(seed=24)
    dm = decode(bootstrap, dst)
    try:
        # a server nobody registered with: 503 until the timeout
        assert not dm.try_ensure_parallel_info(bootstrap.address)
        assert "503" in dm.lookup_error(bootstrap.address)
        r = KvxferKVReceiver(dm, bootstrap.address, room())
        r.init(0)
        assert r.poll() == KVPoll.Bootstrapping
        assert wait_poll(r, KVPoll.WaitingForInput, 3) == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="no kvxfer prefill instance at bootstrap "
                           "server .* 503 Prefill server not fully "
                           "registered"):
            r.failure_exception()
    finally:
        dm.close()


def test_bootstrap_server_is_sglangs_and_serves_the_ranks_rows(
        env, bootstrap):
    """The server is SGLang's CommonKVBootstrapServer; it answers SGLang's
    own decode-side reads (/route, the parallel info as PrefillServerInfo)
    with what the prefill ranks registered, rank_ip naming kvxfer's end."""
    assert issubclass(KvxferKVBootstrapServer, CommonKVBootstrapServer)
    info_url = (f"http://{bootstrap.address}/route?prefill_dp_rank=-1&"
                "prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(info_url, timeout=2)
    assert ei.value.code == 503  # no prefill rank registered yet
    with urllib.request.urlopen(f"http://{bootstrap.address}/health",
                                timeout=2) as r:
        assert r.read() == b"OK"
    p0 = Rank(engine_rank=0, heads=1, total_heads=2, seed=25)
    p1 = Rank(engine_rank=1, heads=1, total_heads=2, seed=39)
    m0 = prefill(bootstrap, p0, 2)
    try:
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(info_url, timeout=2)
        assert ei.value.code == 503  # rank 1 missing
        m1 = prefill(bootstrap, p1, 2)
        with urllib.request.urlopen(info_url, timeout=2) as r:
            info = PrefillServerInfo(**json.loads(r.read()))
        assert (info.attn_tp_size, info.dp_size, info.pp_size,
                info.page_size, info.kv_cache_dtype) == (2, 1, 1, 4,
                                                         "float16")
        assert info.follow_bootstrap_room
        for rank, m in ((0, m0), (1, m1)):
            url = (f"http://{bootstrap.address}/route?prefill_dp_rank=0&"
                   f"prefill_cp_rank=0&target_tp_rank={rank}&"
                   "target_pp_rank=0")
            with urllib.request.urlopen(url, timeout=2) as r:
                row = json.loads(r.read())
            assert row == {"rank_ip": f"{m.client.daemon_address}#"
                           f"{m.instance_id}", "rank_port": rank}
        m1.close()
    finally:
        m0.close()


def test_daemon_gone_fails_the_requests_not_the_scheduler(env, bootstrap,
                                                          tmp_path):
    """kvxferd stops under a waiting fetch: the receiver polls Failed with
    the library's reason; nothing raises into SGLang's loop."""
    own = Daemon(tmp_path)
    env.setenv("KVXFER_SGLANG_SOCKET", own.sock)
    src, dst = Rank(seed=37), Rank(seed=38)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        r = receiver(dm, bootstrap.address, room())
        r.send_metadata(np.asarray([1], np.int32), 0, [])
        assert r.poll() == KVPoll.Transferring
        own.stop()
        assert wait_poll(r, KVPoll.Success) == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="PEER_GONE: kvxferd went away"):
            r.failure_exception()
    finally:
        pm.close()
        dm.close()
        own.stop()


def kill9_mid_transfer(env, bootstrap, tmp_path):
    """A daemon of the test's own; room 1 published by the prefill (no
    fetch yet), room 2 fetched by the decode (no publish yet); then
    kill -9 of the daemon. Returns what the test needs."""
    own = Daemon(tmp_path)
    env.setenv("KVXFER_SGLANG_SOCKET", own.sock)
    src, dst = Rank(seed=41), Rank(seed=42)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    s1 = KvxferKVSender(pm, bootstrap.address, room())
    s1.init(2, 1)
    send_chunks(s1, [[1, 2]], 8, src.page)
    assert s1.poll() == KVPoll.Transferring
    r2 = receiver(dm, bootstrap.address, room())
    r2.send_metadata(np.asarray([3, 4, 5], np.int32), 2, [])
    assert r2.poll() == KVPoll.Transferring
    # a room is two offers and two fetches (the room's and its end)
    assert pm.client.state.in_flight == 2 and dm.client.state.in_flight == 2
    own.kill9()
    return own, src, dst, pm, dm, s1, r2


def after_restart(own, bootstrap, src, dst, pm, dm, r2, before):
    """A new daemon on the same socket: a later room moves byte for byte
    (the prefill's new daemon address reaches the bootstrap server), and
    nothing reaches room 2's pages."""
    own.start()
    rm, P = room(), src.page
    s3 = KvxferKVSender(pm, bootstrap.address, rm)
    s3.init(3, 4)
    src.set_aux(4, rm, 4242)
    send_chunks(s3, [[6, 7], [8]], 3, P)  # 2 pages, then 3 tokens
    assert s3.poll() == KVPoll.Transferring, s3._reason
    assert group_locator(bootstrap.address, 0).address == \
        pm.client.daemon_address
    r3 = receiver(dm, bootstrap.address, rm)
    r3.send_metadata(np.asarray([9, 10, 11], np.int32), 6, [])
    assert wait_poll(r3, KVPoll.Success) == KVPoll.Success, r3._reason
    assert wait_poll(s3, KVPoll.Success) == KVPoll.Success, s3._reason
    assert_landed(src, dst, [6, 7, 8], [9, 10, 11], 2 * P + 3)
    assert dst.aux[0][6, 0] == 4242
    for (_, _, d), b in zip(dst.buffers(), before):
        for pg in (3, 4, 5):  # room 2's pages: as they were
            assert np.array_equal(d[pg * P:(pg + 1) * P],
                                  b[pg * P:(pg + 1) * P])
    assert not dst.aux[2][2].any()  # room 2's aux row


def test_daemon_killed_fails_rooms_in_flight_then_reconnects(env, bootstrap,
                                                             tmp_path):
    """kill -9 of kvxferd with a published room and a waiting fetch: each
    polls Failed once (PEER_GONE, the library's), no exception reaches
    SGLang's loop, a room started in the outage fails at once; after a
    new daemon on the same socket, the library's reconnection carries the
    managers on and a later room moves byte for byte."""
    own, src, dst, pm, dm, s1, r2 = kill9_mid_transfer(env, bootstrap,
                                                       tmp_path)
    try:
        before = [b.copy() for _, _, b in dst.buffers()]
        assert wait_poll(s1, KVPoll.Success) == KVPoll.Failed
        assert wait_poll(r2, KVPoll.Success) == KVPoll.Failed
        for x in (s1, r2):
            with pytest.raises(KvxferTransferError,
                               match="PEER_GONE: kvxferd went away") as ei:
                x.failure_exception()
            assert ei.value.code == kvxfer.PeerGone.code
        # in the outage: a room fails at its publish, nothing raises
        s = KvxferKVSender(pm, bootstrap.address, room())
        s.init(1, 0)
        send_chunks(s, [[12]], 4, src.page)
        assert s.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError, match="CLOSED: kvxferd "
                           "went away"):
            s.failure_exception()
        for m in (pm, dm):
            m.pump(force=True)
            assert m.client.state.status == kvxfer.ClientStatus.RECONNECTING
        after_restart(own, bootstrap, src, dst, pm, dm, r2, before)
        for m in (pm, dm):
            assert m.client.state.status == kvxfer.ClientStatus.CONNECTED
            assert m.client.incarnation == 1
    finally:
        pm.close()
        dm.close()
        own.stop()


def test_daemon_killed_reconnection_off_makes_clients_again(env, bootstrap,
                                                            tmp_path):
    """The same with the library's reconnection off (KVXFER_RECONNECT=0):
    the managers close the clients it gave up and make new ones once the
    daemon is back."""
    env.setenv("KVXFER_RECONNECT", "0")
    own, src, dst, pm, dm, s1, r2 = kill9_mid_transfer(env, bootstrap,
                                                       tmp_path)
    try:
        before = [b.copy() for _, _, b in dst.buffers()]
        assert wait_poll(s1, KVPoll.Success) == KVPoll.Failed
        assert wait_poll(r2, KVPoll.Success) == KVPoll.Failed
        for m in (pm, dm):
            m.pump(force=True)
            assert m.client.closed
        after_restart(own, bootstrap, src, dst, pm, dm, r2, before)
        for m in (pm, dm):
            assert m.client.alive and m.client.incarnation == 0
    finally:
        pm.close()
        dm.close()
        own.stop()


# -- bad input --------------------------------------------------------------

def test_kv_pointer_outside_a_host_buffer_is_refused(env, bootstrap):
    src = Rank(seed=26)
    plain = np.zeros_like(src.v[1])
    src.args.kv_data_ptrs[src.layers + 1] = plain.ctypes.data
    with pytest.raises(kvxfer.InvalidArgument,
                       match=r"kv_data_ptrs\[4\] .* does not lie in a "
                       "kvxfer.HostBuffer"):
        prefill(bootstrap, src)
    env.setenv("KVXFER_SGLANG_DEVICE", "host")
    with pytest.raises(kvxfer.InvalidArgument, match="HostBuffer"):
        prefill(bootstrap, src)


def test_kv_pointers_in_no_host_buffer_say_cuda_failed(env, bootstrap):
    src = Rank(seed=27)
    plain = [np.zeros_like(b) for _, _, b in src.buffers()]
    src.args.kv_data_ptrs = [p.ctypes.data for p in plain]
    with pytest.raises(kvxfer.Error, match="registered as CUDA memory, "
                       "which failed: .*HostBuffer"):
        prefill(bootstrap, src)


def test_mismatched_lengths_are_refused(env, bootstrap):
    src = Rank(seed=28)
    src.args.kv_data_lens = src.args.kv_data_lens[:-1]
    with pytest.raises(kvxfer.InvalidArgument,
                       match="kv_data_ptrs .6., kv_data_lens .5. and "
                       "kv_item_lens .6."):
        prefill(bootstrap, src)
    src = Rank(seed=29)
    src.args.aux_item_lens = src.args.aux_item_lens[:2]
    with pytest.raises(kvxfer.InvalidArgument, match="aux_data_ptrs"):
        prefill(bootstrap, src)
    src = Rank(seed=30)
    src.args.kv_data_ptrs = src.args.kv_data_ptrs[:5]
    src.args.kv_data_lens = src.args.kv_data_lens[:5]
    src.args.kv_item_lens = src.args.kv_item_lens[:5]
    with pytest.raises(kvxfer.InvalidArgument, match="K and a V buffer"):
        prefill(bootstrap, src)
    src = Rank(seed=31)
    src.args.kv_item_lens[2] = 4
    with pytest.raises(kvxfer.InvalidArgument,
                       match="kv_item_lens differ"):
        prefill(bootstrap, src)


def test_unsupported_sglang_features_are_named(env, bootstrap):
    src = Rank(seed=32)
    sa = server_args(bootstrap.port, pp_size=2)
    with pytest.raises(kvxfer.Unsupported, match="pipeline parallelism"):
        KvxferKVManager(src.args, "prefill", sa, False)
    sa = server_args(bootstrap.port, attn_cp_size=2)
    with pytest.raises(kvxfer.Unsupported, match="context parallelism"):
        KvxferKVManager(src.args, "prefill", sa, False)
    src.args.num_draft_entries = 2
    with pytest.raises(kvxfer.Unsupported, match="draft model"):
        KvxferKVManager(src.args, "prefill", server_args(bootstrap.port),
                        False)


def test_aux_rows_over_the_daemons_limit_are_refused_at_start(env,
                                                              bootstrap):
    env.setenv("KVXFER_SGLANG_AUX_BYTES", "200")
    with pytest.raises(kvxfer.InvalidArgument,
                       match="aux rows take 212 bytes .* limits.aux_bytes "
                       "200"):
        prefill(bootstrap, Rank(seed=33))


def test_decode_radix_prefix_moves_only_the_suffix(env, bootstrap):
    """The decode radix cache holds the first 3 pages of the prompt:
    send_metadata gets the suffix's pages and decode_prefix_len 12, as
    decode.py passes them; the prefill sends the whole prompt
    (pop_decode_prefix_len 0). Every token from 12 lands in the suffix's
    pages, and no other page of the decode, the cached prefix's included,
    is written."""
    src, dst = Rank(seed=34, num_pages=16), Rank(seed=35, num_pages=16)
    before = [b.copy() for _, _, b in dst.buffers()]
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        rm, P = room(), src.page
        num_tokens, prefix = 37, 12  # 10 pages, 3 of them cached
        src_pages = [11, 3, 7, 0, 15, 9, 2, 12, 5, 14]
        cached = [1, 2, 3]  # the decode's radix cache holds these
        dst_suffix = [13, 6, 8, 10, 15, 4, 9]
        s = KvxferKVSender(pm, bootstrap.address, rm)
        assert s.pop_decode_prefix_len() == 0
        s.init(len(src_pages), 2)
        src.set_aux(2, rm, 4321)
        send_chunks(s, [src_pages[:5], src_pages[5:]], num_tokens - 5 * P,
                    P)
        r = receiver(dm, bootstrap.address, rm)
        r.send_metadata(np.asarray(dst_suffix, np.int32), 5, [],
                        decode_prefix_len=prefix)
        assert wait_poll(r, KVPoll.Success) == KVPoll.Success, r._reason
        assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
        assert_landed(src, dst, src_pages[3:], dst_suffix,
                      num_tokens - prefix)
        assert dst.aux[0][5, 0] == 4321
        for (_, _, d), b in zip(dst.buffers(), before):
            for p in set(range(17)) - set(dst_suffix):
                assert np.array_equal(d[p * P:(p + 1) * P],
                                      b[p * P:(p + 1) * P]), p
        assert set(cached) <= set(range(17)) - set(dst_suffix)
    finally:
        pm.close()
        dm.close()


def test_decode_prefix_not_page_aligned_fails_by_name(env, bootstrap):
    src, dst = Rank(seed=40), Rank(seed=43)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        r = receiver(dm, bootstrap.address, room())
        r.send_metadata(np.asarray([1, 2], np.int32), 0, [],
                        decode_prefix_len=6)
        assert r.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="decode_prefix_len 6 is not a whole "
                           "number of pages of 4 tokens"):
            r.failure_exception()
        assert dm.client.requests() == []
    finally:
        pm.close()
        dm.close()


def test_host_destination_is_refused_saying_why(env, bootstrap):
    from sglang.srt.disaggregation.base.conn import KVTransferDestination
    src, dst = Rank(seed=46), Rank(seed=47)
    pm, dm = prefill(bootstrap, src), decode(bootstrap, dst)
    try:
        assert dm.supports_host_destination is False
        r = receiver(dm, bootstrap.address, room())
        r.send_metadata(np.asarray([1], np.int32), 0, [],
                        destination=KVTransferDestination.HOST)
        assert r.poll() == KVPoll.Failed
        with pytest.raises(KvxferTransferError,
                           match="host KV destination .* pinned memory, "
                           "which kvxferd cannot map"):
            r.failure_exception()
        assert dm.client.requests() == []
    finally:
        pm.close()
        dm.close()
