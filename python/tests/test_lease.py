"""Leases (2.6): an offer's own lease set by the prefill and carried in
its params, renewals (Client.renew) that keep it past its lease, and a
scheduler's step of reservations in one round trip (reserve_many)."""

import time

import numpy as np
import pytest

import kvxfer
from kvxfer import EventKind, Layout

from conftest import wait_event

LAYERS, HEADS, HEAD_DIM, TPB, BLOCKS = 4, 2, 64, 16, 8


def layout():
    return Layout.preset("vllm-nhd", num_layers=LAYERS, num_heads=HEADS,
                         head_dim=HEAD_DIM, dtype="bf16",
                         tokens_per_block=TPB, num_blocks=BLOCKS)


def test_lease_set_by_the_prefill_and_renewed(daemon, pair, names):
    """Two offers under a lease of 400 ms, one renewed by a scheduler
    client (no Hello) every 100 ms for 1.2 s: the other ends TIMED_OUT
    naming its lease; the renewed one is fetched after, every byte. The
    params say the lease."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    src.array[:] = np.random.default_rng(5).integers(0, 256, src.array.size,
                                                      dtype=np.uint8)
    a, b = names["req"], names["req"] + 1
    pa = ctx.publish(a, src, [0, 1], 2 * TPB, lease_ms=400)
    pb = ctx.publish(b, src, [2, 3], 2 * TPB, lease_ms=400)
    assert kvxfer.params_info(pa).lease_ms == 400
    with kvxfer.Client(daemon.sock) as sched:
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            assert sched.renew([pa]) == [None]
            time.sleep(0.1)
        ev = wait_event(ctx, b)
        assert ev.kind is EventKind.TIMED_OUT
        assert "offer lease of 400 ms expired" in ev.message
        gen.fetch(a, pa, dst, [4, 5])
        for c in (gen, ctx):
            assert wait_event(c, a).kind is EventKind.COMPLETE
        got = dst.array.reshape(LAYERS, 2, BLOCKS, -1)
        want = src.array.reshape(LAYERS, 2, BLOCKS, -1)
        assert np.array_equal(got[:, :, 4:6], want[:, :, 0:2])
        # ended now: each item on its own
        res = sched.renew([pa, pb])
        assert all(isinstance(r, kvxfer.NotFound) for r in res)
        assert "item 1" in str(res[1])
        with pytest.raises(kvxfer.InvalidArgument, match="1 to 256"):
            sched.renew([])
        with pytest.raises(kvxfer.InvalidArgument, match="is empty"):
            sched.renew([b""])
    del pb


def test_lease_bounds_and_default(daemon, pair, names):
    """No lease: the daemon's (30 s by default), said in the params; one
    over deadlines.offer_lease_max_ms is refused naming the field."""
    ctx, _ = pair
    src = ctx.create_host_pool(layout())
    req = names["req"]
    p = ctx.publish(req, src, [0], TPB)
    assert kvxfer.params_info(p).lease_ms == 30000
    with pytest.raises(kvxfer.InvalidArgument,
                       match="publish.lease_ms: 999999999 ms is over"):
        ctx.publish(req + 1, src, [1], TPB, lease_ms=999999999)
    ctx.cancel(req)


def test_reserve_many_one_round_trip(daemon, pair, names):
    """256 reservations in one call, item 9 with num_tokens 0: it alone
    fails, by name; every other gets its params with the lease asked; a
    rank's publish of one returns the same bytes."""
    ctx, _ = pair
    src = ctx.create_host_pool(layout())
    base = names["req"]
    items = [(base + i, 0 if i == 9 else 2 * TPB) for i in range(256)]
    with kvxfer.Client(daemon.sock) as sched:
        res = sched.reserve_many(names["ctx"], items, lease_ms=20000)
        assert len(res) == 256
        assert isinstance(res[9], kvxfer.InvalidArgument)
        assert "reserve.num_tokens: 0" in str(res[9])
        for i, r in enumerate(res):
            if i != 9:
                assert isinstance(r, bytes)
                assert kvxfer.params_info(r).lease_ms == 20000
        assert ctx.publish(base + 3, src, [0, 1], 2 * TPB) == res[3]
        with pytest.raises(kvxfer.InvalidArgument, match="at most 256"):
            sched.reserve_many(names["ctx"], items + [(1, 1)])
        ctx.cancel(base + 3)
        for i, r in enumerate(res):
            if i not in (3, 9):
                sched.release(r)
