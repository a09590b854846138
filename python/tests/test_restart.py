"""The daemon killed under a Python client (issue 35): the requests in
flight end with one PEER_GONE event each, calls in the outage raise
Closed saying why, no byte lands after the event, and the client comes
back on its own with the pools it had."""

import re
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import ClientStatus, EventKind, Layout

from conftest import Daemon, open_rank, wait_event

LAYERS, HEADS, HEAD_DIM, TPB = 4, 2, 64, 16
BIG = 2048  # blocks of 32 KiB: a 64 MiB request
SLOW = ("copy:\n  worker_threads: 1\n  chunk_bytes: 4KiB\n"
        "  max_inflight_chunks: 1\n")


def layout(blocks):
    return Layout.preset("vllm-nhd", num_layers=LAYERS, num_heads=HEADS,
                         head_dim=HEAD_DIM, dtype="bf16",
                         tokens_per_block=TPB, num_blocks=blocks)


def block_bytes(lo, arr, block):
    per = lo.token_stride * TPB
    return np.concatenate([
        arr[lo.offset(layer, kv, block):lo.offset(layer, kv, block) + per]
        for layer in range(LAYERS) for kv in range(2)])


def until_back(client, timeout=10.0):
    """Poll until the client is connected again; the first batch then
    ends with the RECONNECTED event. Returns that batch."""
    end = time.monotonic() + timeout
    while True:
        try:
            batch = client.poll(0, 0)
        except kvxfer.Closed as e:
            assert "kvxferd went away" in e.message
            assert time.monotonic() < end, "not back in time"
            time.sleep(0.01)
            continue
        assert batch.events[-1].kind is EventKind.RECONNECTED
        assert batch.events[-1].key == b""
        assert "kvxferd is back" in batch.events[-1].message
        return batch


@pytest.fixture
def slow_daemon(tmp_path):
    d = Daemon(tmp_path, extra=SLOW)
    yield d
    d.stop()


def test_kill9_mid_transfer_ends_requests_then_reconnects(slow_daemon):
    d = slow_daemon
    ctx = open_rank(d.sock, "pyrs-ctx", "context", layers=LAYERS,
                    heads=HEADS)
    gen = open_rank(d.sock, "pyrs-gen", "generation", layers=LAYERS,
                    heads=HEADS)
    lo = layout(BIG + 8)
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    src.array[:] = 0x11
    dst.array[:] = 0xa5
    params = ctx.publish("big", src, range(BIG), num_tokens=BIG * TPB)
    ctx.publish("offer", src, [BIG], num_tokens=TPB)  # nobody fetches it
    gen.fetch("big", params, dst, range(BIG))
    assert ctx.state.in_flight == 2 and gen.state.in_flight == 1
    end = time.monotonic() + 10  # kill it with the copies running
    while (dst.array[::4096] != 0xa5).sum() < 16:
        assert time.monotonic() < end
        time.sleep(0.002)
    old_address = gen.daemon_address
    d.kill9()

    # the client sees it at once, without a call
    assert not gen.alive and not gen.closed
    assert gen.state.status is ClientStatus.RECONNECTING
    g = gen.poll(1, 5.0)
    assert [(e.kind, e.code, e.key) for e in g] == [
        (EventKind.ERROR, kvxfer.PeerGone.code, b"big")]
    assert g.events[0].message.startswith("kvxferd went away")
    assert isinstance(g.events[0].error, kvxfer.PeerGone)
    c = ctx.poll(1, 5.0)
    assert [e.key for e in c] == [b"big", b"offer"]  # ordered by key
    assert all(e.code == kvxfer.PeerGone.code for e in c)
    at_event = dst.array.copy()

    # the outage: calls raise at once, saying why
    with pytest.raises(kvxfer.Closed, match="kvxferd went away.*reconnect"):
        ctx.publish("next", src, [BIG + 1], num_tokens=TPB)
    with pytest.raises(kvxfer.Closed, match="kvxferd went away"):
        gen.poll(1, 1.0)
    assert "kvxferd went away" in gen.state.message

    d.start()
    until_back(gen)
    until_back(ctx)
    assert gen.alive and ctx.alive and not ctx.closed
    assert gen.incarnation == ctx.incarnation == 1
    # the new daemon's address (engines hand it to others: a bootstrap)
    new_address = re.findall(r"ready: .* address (\S+)", d.tail(400))[-1]
    assert new_address != old_address
    assert gen.daemon_address == ctx.daemon_address == new_address
    time.sleep(0.2)
    assert np.array_equal(dst.array, at_event)  # nothing landed after

    # the same Pool objects (their ids) move the next request
    src_blocks, dst_blocks = [BIG + 7, BIG + 2], [BIG + 3, BIG]
    rng = np.random.default_rng(7)
    for b in src_blocks:
        for layer in range(LAYERS):
            for kv in range(2):
                o = lo.offset(layer, kv, b)
                n = lo.token_stride * TPB
                src.array[o:o + n] = rng.integers(0, 256, n, dtype=np.uint8)
    params = ctx.publish("after", src, src_blocks, num_tokens=2 * TPB)
    gen.fetch("after", params, dst, dst_blocks)
    assert wait_event(gen, "after").ok
    assert wait_event(ctx, "after").ok
    want = at_event.copy()
    for s, t in zip(src_blocks, dst_blocks):
        for layer in range(LAYERS):
            for kv in range(2):
                o, p = lo.offset(layer, kv, t), lo.offset(layer, kv, s)
                n = lo.token_stride * TPB
                want[o:o + n] = src.array[p:p + n]
    assert np.array_equal(dst.array, want)
    gen.close()
    ctx.close()
    assert gen.closed and gen.state.status is ClientStatus.CLOSED


def test_reconnect_off_closes_the_client(tmp_path):
    d = Daemon(tmp_path)
    try:
        ctx = open_rank(d.sock, "pyro-ctx", "context", reconnect=False)
        pool = ctx.create_host_pool(layout(4))
        ctx.publish(9, pool, [1], num_tokens=TPB)
        d.kill9()
        assert ctx.closed and not ctx.alive
        (e,) = ctx.poll(1, 5.0)
        assert e.key == b"9" and e.code == kvxfer.PeerGone.code
        d.start()
        with pytest.raises(kvxfer.Closed, match="reconnection is off"):
            ctx.poll(0, 0)
        assert ctx.closed
        with pytest.raises(kvxfer.InvalidArgument, match="backoff"):
            ctx.set_reconnect(True, backoff=(2.0, 1.0))
        ctx.close()
    finally:
        d.stop()
