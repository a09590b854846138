"""A real kvxferd: host-pool transfers, errors, status, events, cancel."""

import threading
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import EventKind, HostBuffer, Layout

from conftest import open_rank, wait_event

LAYERS, HEADS, HEAD_DIM, TPB, BLOCKS = 4, 2, 64, 16, 8


def layout(preset="vllm-nhd", blocks=BLOCKS):
    return Layout.preset(preset, num_layers=LAYERS, num_heads=HEADS,
                         head_dim=HEAD_DIM, dtype="bf16",
                         tokens_per_block=TPB, num_blocks=blocks)


def fill(a, seed):
    a[:] = np.random.default_rng(seed).integers(0, 256, a.size,
                                                dtype=np.uint8)


def block_bytes(lo, arr, block):
    """Every byte of one block, layer by layer, K then V."""
    per = lo.token_stride * TPB
    return np.concatenate([
        arr[lo.offset(layer, kv, block):lo.offset(layer, kv, block) + per]
        for layer in range(LAYERS) for kv in range(2)])


def test_observer_status_is_a_dict(daemon):
    with kvxfer.Client(daemon.sock) as obs:
        st = obs.status()
        assert isinstance(st, dict)
        assert st["version"] == kvxfer.version()
        assert st["sessions_total"] >= 1
        assert isinstance(obs.requests(), list)


def test_host_transfer_bytes_arrive(pair, names):
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    assert src.kind == "host" and src.size == lo.span
    fill(src.array, 1)
    before = dst.array.copy()
    req = names["req"]
    src_blocks, dst_blocks = [5, 2, 7], np.array([0, 3, 6], dtype=np.int64)
    params = ctx.publish(req, src, src_blocks, num_tokens=3 * TPB)
    assert isinstance(params, bytes) and params
    gen.fetch(req, params, dst, dst_blocks)
    for c in (gen, ctx):
        ev = wait_event(c, req)
        assert ev.kind is EventKind.COMPLETE and ev.ok and ev.code == 0
        assert ev.error is None and ev.raise_for_status() is ev
    for s, d in zip(src_blocks, dst_blocks):
        assert np.array_equal(block_bytes(lo, dst.array, d),
                              block_bytes(lo, src.array, s))
    for b in set(range(BLOCKS)) - set(dst_blocks.tolist()):
        assert np.array_equal(block_bytes(lo, dst.array, b),
                              block_bytes(lo, before, b))


def test_skip_tokens_moves_only_the_suffix(pair, names):
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    fill(src.array, 2)
    req = names["req"]
    params = ctx.publish(req, src, [0, 1], num_tokens=2 * TPB)
    gen.fetch(req, params, dst, [0, 1], skip_tokens=TPB)
    assert wait_event(gen, req).ok
    a, b = dst.array, src.array
    first = lo.offset(0, 0, 0)
    assert not a[first:first + lo.token_stride * TPB].any()  # block 0 kept
    second = lo.offset(0, 0, 1)
    assert np.array_equal(a[second:second + lo.token_stride * TPB],
                          b[second:second + lo.token_stride * TPB])


def test_numpy_views_and_per_layer_arrays_as_pools(pair, names):
    """Pools from numpy arrays on HostBuffers: a slice of one, and a list
    of per-layer arrays (as vLLM keeps one tensor per layer)."""
    ctx, gen = pair
    lo = layout()
    buf = HostBuffer(lo.span + 4096)
    view = buf.numpy()[4096:]  # a pool need not start at the memfd's start
    fill(view, 3)
    src = ctx.register_pool(view, lo)
    assert src.kind == "host" and src.size == lo.span
    # per-layer arrays in reverse order, with gaps between them
    per = lo.layer_span
    dbuf = HostBuffer(LAYERS * (per + 512))
    layers = [dbuf.numpy()[i * (per + 512):i * (per + 512) + per]
              for i in reversed(range(LAYERS))]
    dst = gen.register_pool(layers, lo)
    # a region per array: the layout split per layer
    assert dst.layout.num_regions == LAYERS
    assert dst.layout.parts[2] == (1, 0) and dst.layout.parts[3] == \
        (1, lo.kv_stride)
    assert dst.size == LAYERS * per
    req = names["req"]
    params = ctx.publish(req, src, list(range(BLOCKS)), BLOCKS * TPB)
    gen.fetch(req, params, dst, list(range(BLOCKS)))
    assert wait_event(gen, req).ok
    for i in range(LAYERS):
        lay = lo.layer_offsets[i]
        assert np.array_equal(layers[i], view[lay:lay + per])
    src.deregister()
    dst.deregister()
    assert not src.registered


def test_k_and_v_arrays_in_several_buffers_as_a_pool(pair, names):
    """SGLang keeps a K and a V tensor per layer: a pool of 2 x LAYERS
    regions, K in one HostBuffer and V in another, both ways."""
    ctx, gen = pair
    lo = Layout.preset("sglang", num_layers=LAYERS, num_heads=HEADS,
                       head_dim=HEAD_DIM, dtype="bf16", tokens_per_block=1,
                       num_blocks=BLOCKS * TPB)
    one = lo.span // (2 * LAYERS)  # one K (or V) tensor
    kbuf, vbuf = HostBuffer(LAYERS * one), HostBuffer(LAYERS * one + 64)
    ks = [kbuf.numpy()[i * one:(i + 1) * one] for i in range(LAYERS)]
    vs = [vbuf.numpy()[64 + i * one:64 + (i + 1) * one]
          for i in reversed(range(LAYERS))]
    for i, a in enumerate(ks + vs):
        fill(a, 10 + i)
    src = ctx.register_pool((ks, vs), lo)
    assert src.layout.num_regions == 2 * LAYERS
    assert src.layout.region(1, 1) == 3 and src.layout.part_span == one
    # the destination in one allocation, vLLM's layout
    dlo = layout()
    dst = gen.create_host_pool(dlo)
    req = names["req"]
    ntok = 3 * TPB
    params = ctx.publish(req, src, list(range(ntok)), num_tokens=ntok)
    gen.fetch(req, params, dst, [4, 1, 6])
    assert wait_event(gen, req).ok
    row = HEADS * HEAD_DIM * 2  # one token of one layer's K (or V)
    for a in range(LAYERS):
        for kv, t in ((0, ks[a]), (1, vs[a])):
            for tok in range(ntok):
                want = t[tok * row:(tok + 1) * row]
                o = dlo.offset(a, kv, [4, 1, 6][tok // TPB], tok % TPB)
                assert np.array_equal(dst.array[o:o + row], want)
    src.deregister()


def test_regions_refused_with_the_daemons_message(pair):
    ctx, _ = pair
    lo = layout()
    per = lo.layer_span
    buf = HostBuffer(LAYERS * per)
    arrs = [buf.numpy()[i * per:(i + 1) * per] for i in range(LAYERS)]
    # a region one byte short of its layer: the part past it is named
    short = arrs[:2] + [arrs[2][:-1]] + arrs[3:]
    with pytest.raises(kvxfer.LayoutError) as ei:
        ctx.register_pool(short, lo)
    assert "layer 2 kv 1 ends at byte" in ei.value.message
    assert "of region 2, past its" in ei.value.message
    # two regions over the same bytes
    with pytest.raises(kvxfer.InvalidArgument, match="overlap regions"):
        ctx.register_pool([arrs[0], arrs[0], arrs[2], arrs[3]], lo)
    # a list that is not one per layer
    with pytest.raises(kvxfer.InvalidArgument, match="per-layer"):
        ctx.register_pool(arrs[:3], lo)
    # more regions than KVX_MAX_REGIONS
    with pytest.raises(kvxfer.InvalidArgument, match="1..4096"):
        ctx.register_regions(lo.split(), [arrs[0]] * 4097)
    # a region no part lies in
    with pytest.raises(kvxfer.LayoutError, match="holds no part"):
        ctx.register_regions(lo.split(), arrs + [HostBuffer(64).numpy()])
    assert ctx.status()["pools_total"] == 0


def test_plain_numpy_memory_is_refused_with_advice(pair):
    ctx, _ = pair
    with pytest.raises(kvxfer.InvalidArgument, match="HostBuffer"):
        ctx.register_pool(np.zeros(layout().span, np.uint8), layout())


def test_garbage_params_raise_invalid_with_the_daemons_message(pair, names):
    _, gen = pair
    dst = gen.create_host_pool(layout())
    with pytest.raises(kvxfer.InvalidArgument) as ei:
        gen.fetch(names["req"], b"garbage", dst, [0])
    assert ei.value.code == -1 and ei.value.name == "INVALID"
    assert "fetch.context_params" in ei.value.message
    assert "fetch.context_params" in str(ei.value)


def _flip_token(params):
    """params with one byte of ContextParams.token (field 4) changed."""
    b, i = bytearray(params), 0

    def varint():
        nonlocal i
        v = s = 0
        while True:
            v |= (b[i] & 0x7F) << s
            s += 7
            i += 1
            if not b[i - 1] & 0x80:
                return v
    while i < len(b):
        key = varint()
        if key & 7 == 0:
            varint()
        elif key & 7 == 2:
            n = varint()
            if key >> 3 == 4:
                b[i] ^= 0xFF
                return bytes(b)
            i += n
        else:
            raise AssertionError(f"wire type {key & 7}")
    raise AssertionError("no token in the params")


def test_wrong_token_raises_auth_error(pair, names):
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    req = names["req"]
    params = ctx.publish(req, src, [0], num_tokens=TPB)
    gen.fetch(req, _flip_token(params), dst, [0])  # accepted; the event says
    ev = wait_event(gen, req)
    assert ev.kind is EventKind.ERROR and isinstance(ev.error, kvxfer.AuthError)
    assert "context side: capability token" in ev.message
    gen.fetch(req, params, dst, [0])  # the right one still works
    assert wait_event(gen, req).ok


def test_more_refusals_map_to_their_classes(daemon, pair, names):
    ctx, gen = pair
    with pytest.raises(kvxfer.NotFound, match="cancel.key"):
        ctx.cancel(names["req"] + 999)
    with pytest.raises(kvxfer.IOFailure, match="ENOENT"):
        kvxfer.Client(daemon.sock + ".missing", timeout=0.5)
    with pytest.raises(kvxfer.VersionMismatch):
        kvxfer.Client(daemon.sock, instance_id="old", role="context",
                      parallel=kvxfer.Parallel(total_layers=4,
                                               total_kv_heads=2),
                      protocol_version=(99, 0))
    with pytest.raises(kvxfer.LayoutError):  # the pool is too small
        buf = HostBuffer(4096)
        ctx.register_pool(buf, layout())
    with pytest.raises(kvxfer.InvalidArgument, match="timeout"):
        ctx.status(timeout=0)
    with pytest.raises(kvxfer.InvalidArgument, match="blocks"):
        ctx.publish(1, 1, [-1], 1)
    lo = layout()
    dst = gen.create_host_pool(lo)
    src = ctx.create_host_pool(lo)
    params = ctx.publish(names["req"], src, [0], TPB)
    with pytest.raises(kvxfer.Error) as ei:  # 1 block of 16 for 16 tokens
        gen.fetch(names["req"], params, dst, [0, 0])
    assert ei.value.message


def test_poll_batches_are_numbered_and_may_be_empty(pair):
    ctx, _ = pair
    b0 = ctx.poll(1, 0.05)
    b1 = ctx.poll(1, 0.05)
    assert isinstance(b0, kvxfer.Batch) and len(b0) == 0
    assert b1.seq == b0.seq + 1
    with pytest.raises(kvxfer.InvalidArgument):
        ctx.poll(1, -1)


def test_poll_timeout_zero_is_now_and_none_waits(pair, names):
    ctx, _ = pair
    t0 = time.monotonic()
    b0 = ctx.poll(1, 0)  # sealed now: no wait for events
    assert len(b0) == 0 and time.monotonic() - t0 < 0.15
    src = ctx.create_host_pool(layout())
    req = names["req"]
    ctx.publish(req, src, [0], num_tokens=TPB)
    ctx.cancel(req)
    b = ctx.poll(1, None)  # no deadline: the event is there
    assert [e.kind for e in b] == [EventKind.CANCELLED]
    assert b.seq == b0.seq + 1


def test_cancel_ends_both_sides(pair, names):
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    req = names["req"]
    params = ctx.publish(req, src, [0, 1], 2 * TPB)
    ctx.cancel(req)
    ev = wait_event(ctx, req)
    assert ev.kind is EventKind.CANCELLED and ev.code == -12
    assert isinstance(ev.error, kvxfer.Cancelled)
    with pytest.raises(kvxfer.Cancelled):
        ev.raise_for_status()
    # the offer is gone: a fetch of it is accepted and ends with an
    # ERROR event naming why, on one daemon as across two
    gen.fetch(req, params, dst, [0, 1])
    ev = wait_event(gen, req)
    assert ev.kind is EventKind.ERROR
    assert isinstance(ev.error, kvxfer.Cancelled)
    assert "context side: cancelled by the context side" in ev.message


def test_pool_in_use_is_busy_then_free(pair, names):
    ctx, _ = pair
    src = ctx.create_host_pool(layout())
    ctx.publish(names["req"], src, [0], TPB)
    with pytest.raises(kvxfer.Busy, match="pool"):
        src.deregister()
    ctx.cancel(names["req"])
    ctx.deregister(src.id)


def test_closed_client_raises_closed(daemon, names):
    c = open_rank(daemon.sock, names["ctx"], "context")
    with c:
        assert not c.closed
    assert c.closed
    with pytest.raises(kvxfer.Closed):
        c.status()
    c.close()  # idempotent


def test_threads_share_a_client(daemon):
    with kvxfer.Client(daemon.sock) as obs:
        errors = []

        def work():
            try:
                for _ in range(20):
                    obs.status()
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)
        ts = [threading.Thread(target=work) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors


def test_release_by_router(daemon, pair, names):
    """A router (a client without Hello) releases a published request:
    the context side gets COMPLETE "released", the pool is free at once,
    and a second release or a fetch finds nothing."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    req = names["req"]
    params = ctx.publish(req, src, [0, 1], 2 * TPB)
    with kvxfer.Client(daemon.sock) as router:
        with pytest.raises(kvxfer.InvalidArgument, match="context_params"):
            router.release(b"junk")
        router.release(params)
        ev = wait_event(ctx, req)
        assert ev.kind is EventKind.COMPLETE and ev.message == "released"
        with pytest.raises(kvxfer.NotFound, match="no offer of request"):
            router.release(params)
    gen.fetch(req, params, dst, [0, 1])
    ev = wait_event(gen, req)
    assert ev.kind is EventKind.ERROR and isinstance(ev.error, kvxfer.NotFound)
    assert "released" in ev.message  # remembered: not "no offer"
    src.deregister()  # no one holds it any more


def test_params_info(pair, names):
    """kvxfer.params_info decodes what a router needs from params, and
    names what is wrong with garbage."""
    ctx, _ = pair
    src = ctx.create_host_pool(layout())
    params = ctx.publish(names["req"], src, [0, 1], 2 * TPB - 1)
    info = kvxfer.params_info(params)
    assert info.instance_id == names["ctx"]
    assert info.request_id == names["req"]
    assert info.num_tokens == 2 * TPB - 1
    assert info.tokens_per_block == TPB
    assert info.context_ranks == 1
    assert info.blocks_for(TPB) == 2 and info.blocks_for(1) == 2 * TPB - 1
    assert info.rank0_address.startswith("kvx://")
    with pytest.raises(kvxfer.InvalidArgument, match="kvx_params_info"):
        kvxfer.params_info(b"\xff\xff")
    ctx.cancel(names["req"])


def test_string_and_bytes_keys(pair, names):
    """Keys as engines name requests: a vLLM-style str on the context
    side, bytes with a zero on the generation side; the events carry each
    side's key, the params the context key; an int key is its digits."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    fill(src.array, 3)
    ck = f"cmpl-{names['req']}-0"
    gk = b"\x00decode-" + ck.encode()
    params = ctx.publish(ck, src, [1, 4], num_tokens=2 * TPB)
    info = kvxfer.params_info(params)
    assert info.key == ck.encode() and info.request_id == 0
    gen.fetch(gk, params, dst, [6, 2])
    ev = wait_event(gen, gk)
    assert ev.ok and ev.key == gk and ev.request_id == 0
    ev = wait_event(ctx, ck)
    assert ev.ok and ev.key == ck.encode()
    for s, d in zip([1, 4], [6, 2]):
        assert np.array_equal(block_bytes(lo, dst.array, d),
                              block_bytes(lo, src.array, s))
    assert kvxfer.key_bytes(42) == b"42"
    with pytest.raises(kvxfer.InvalidArgument, match="129 bytes"):
        ctx.publish(b"k" * 129, src, [1], num_tokens=1)
    with pytest.raises(kvxfer.InvalidArgument, match="0 bytes"):
        ctx.cancel("")
    with pytest.raises(kvxfer.NotFound, match="cancel.key: no request nope"):
        ctx.cancel("nope")


def test_scheduler_reserves_then_decode_fetches_by_key(daemon, pair, names):
    """vLLM's flow: the scheduler (no Hello) reserves and gets the params
    before the worker publishes; SGLang's flow: decode fetches by key
    before the prefill publishes. The bytes land; the publish returns the
    reserved params."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    fill(src.array, 5)
    key = f"cmpl-{names['req']}-0"
    with kvxfer.Client(daemon.sock) as sched:
        params = sched.reserve(names["ctx"], key, num_tokens=2 * TPB)
    assert kvxfer.params_info(params).key == key.encode()
    gen.fetch_by_key("d-" + key, names["ctx"], ctx.daemon_address, key, dst,
                     [3, 0])
    assert not gen.poll(1, 0.2).events  # waits for the publish
    assert ctx.publish(key, src, [2, 6], num_tokens=2 * TPB) == params
    assert wait_event(gen, "d-" + key).ok
    assert wait_event(ctx, key).ok
    for s, d in zip([2, 6], [3, 0]):
        assert np.array_equal(block_bytes(lo, dst.array, d),
                              block_bytes(lo, src.array, s))
    with kvxfer.Client(daemon.sock) as sched:
        with pytest.raises(kvxfer.NotFound, match="reserve.instance_id"):
            sched.reserve("no-such-instance", key, 4)
    # a waiting fetch by key is cancelled by its key
    gen.fetch_by_key("d-2", names["ctx"], ctx.daemon_address, "never", dst,
                     [1])
    gen.cancel("d-2")
    ev = wait_event(gen, "d-2")
    assert ev.kind is EventKind.CANCELLED


def test_aux_payload_reaches_the_generation_complete(pair, names):
    """publish(aux=) bytes (zeros included) come back as Event.aux on the
    generation side's COMPLETE only; over limits.aux_bytes (64 KiB by
    default) raises LimitReached naming it, and nothing is kept."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    fill(src.array, 5)
    ck, gk = f"aux-{names['req']}", f"g-aux-{names['req']}"
    aux = bytes(range(256)) * 256  # 64 KiB, exactly the limit
    with pytest.raises(kvxfer.LimitReached, match="limits.aux_bytes"):
        ctx.publish(ck, src, [1, 4], num_tokens=2 * TPB, aux=aux + b"!")
    params = ctx.publish(ck, src, [1, 4], num_tokens=2 * TPB, aux=aux)
    gen.fetch(gk, params, dst, [6, 2])
    ev = wait_event(gen, gk)
    assert ev.ok and ev.aux == aux
    ev = wait_event(ctx, ck)
    assert ev.ok and ev.aux == b""
    # without aux, and a cancelled fetch: no aux either
    params = ctx.publish(ck + "-2", src, [1], num_tokens=TPB)
    gen.fetch(gk + "-2", params, dst, [3])
    assert wait_event(gen, gk + "-2").aux == b""
    params = ctx.publish(ck + "-3", src, [1], num_tokens=TPB, aux=b"x\0y")
    ctx.cancel(ck + "-3")
    assert wait_event(ctx, ck + "-3").aux == b""


def test_pool_that_says_another_first_head_is_refused(pair, names):
    """A pool may say which of the model's KV heads it holds; one that
    does not match the TP rule for its rank is refused at publish."""
    ctx, gen = pair
    lo = layout()
    assert lo.first_head is None and lo.with_first_head(0).first_head == 0
    wrong = ctx.create_host_pool(lo.with_first_head(1))
    with pytest.raises(kvxfer.LayoutError, match="holds heads from 1"):
        ctx.publish(names["req"], wrong, [0], num_tokens=1)
    right = ctx.create_host_pool(lo.with_first_head(0))
    assert ctx.publish(names["req"], right, [0], num_tokens=1)


def test_release_by_key_from_a_router(daemon, pair, names):
    """A router without params releases by the context key; the context
    rank gets COMPLETE "released"; again it is NotFound."""
    ctx, gen = pair
    src = ctx.create_host_pool(layout())
    key = f"rk-{names['req']}"
    ctx.publish(key, src, [0], num_tokens=1)
    with kvxfer.Client(daemon.sock) as router:
        router.release(context_instance=names["ctx"],
                       context_address=ctx.daemon_address, context_key=key)
        ev = wait_event(ctx, key)
        assert ev.ok and ev.message == "released"
        with pytest.raises(kvxfer.NotFound, match=key):
            router.release(context_instance=names["ctx"],
                           context_address=ctx.daemon_address,
                           context_key=key)
        with pytest.raises(kvxfer.InvalidArgument, match="not both"):
            router.release(b"x", context_key=key)


def test_layerwise_offer_moves_layers_as_they_are_ready(pair, names):
    """publish(layerwise=True) offers blocks before their KV exists; a
    fetch waits, layers_ready lets layers move, fetch_progress counts the
    leading layers landed; a layer's bytes written before its
    layers_ready are the ones that arrive."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    src.array[:] = 0x11  # no KV yet
    dst.array[:] = 0xA5
    ck, gk = f"lw-{names['req']}", f"g-lw-{names['req']}"
    sb, db = [5, 2], [0, 6]
    params = ctx.publish(ck, src, sb, num_tokens=2 * TPB, layerwise=True)
    gen.fetch(gk, params, dst, db)
    assert gen.fetch_progress(gk) == (0, LAYERS, False)
    want = np.random.default_rng(9).integers(0, 256, src.array.size,
                                             dtype=np.uint8)

    def layer_bytes(arr, layer, blocks):
        per = lo.token_stride * TPB
        return np.concatenate([arr[lo.offset(layer, kv, b):
                                   lo.offset(layer, kv, b) + per]
                               for b in blocks for kv in range(2)])
    for layer in range(LAYERS):
        for b in sb:  # "the forward pass" writes this layer
            for kv in range(2):
                o = lo.offset(layer, kv, b)
                src.array[o:o + lo.token_stride * TPB] = \
                    want[o:o + lo.token_stride * TPB]
        ctx.layers_ready(ck, layer)
        if layer + 1 == LAYERS:
            break  # the fetch completes: its event says so
        end = time.monotonic() + 5
        while gen.fetch_progress(gk)[0] <= layer and \
                time.monotonic() < end:
            time.sleep(0.005)
        assert gen.fetch_progress(gk)[0] == layer + 1
        # the next layer has not moved
        assert (layer_bytes(dst.array, layer + 1, db) == 0xA5).all()
    assert wait_event(gen, gk).ok and wait_event(ctx, ck).ok
    for layer in range(LAYERS):
        assert np.array_equal(layer_bytes(dst.array, layer, db),
                              layer_bytes(src.array, layer, sb))
    with pytest.raises(kvxfer.NotFound, match="no fetch of request"):
        gen.fetch_progress(gk)
    with pytest.raises(kvxfer.StateError, match="published whole"):
        ctx.publish(ck + "w", src, sb, num_tokens=TPB)
        ctx.layers_ready(ck + "w", 0)
    with pytest.raises(kvxfer.InvalidArgument, match="64"):
        ctx.layers_ready(ck + "w", 0, event=b"short")


def test_chunked_prefill_appends_blocks_and_tokens(pair, names):
    """A layer-wise publish with the first chunk's blocks; append_blocks
    and layers_ready(tokens=) for the next chunk; the bytes arrive."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    fill(src.array, 11)
    ck, gk = f"ch-{names['req']}", f"g-ch-{names['req']}"
    sb, db = [3, 1], [4, 7]
    params = ctx.publish(ck, src, sb[:1], num_tokens=2 * TPB, layerwise=True)
    gen.fetch(gk, params, dst, db)
    with pytest.raises(kvxfer.InvalidArgument, match="1 appended"):
        ctx.layers_ready(ck, 0, LAYERS, tokens=TPB + 1)
    ctx.layers_ready(ck, 0, LAYERS, tokens=TPB)
    ctx.append_blocks(ck, src, sb[1:])
    ctx.layers_ready(ck, 0, LAYERS)  # every token
    assert wait_event(gen, gk).ok and wait_event(ctx, ck).ok
    for s, d in zip(sb, db):
        assert np.array_equal(block_bytes(lo, dst.array, d),
                              block_bytes(lo, src.array, s))


def test_groups_move_a_window_and_a_state_slot(pair, names):
    """A hybrid request: KV, a sliding-window group whose table starts at
    block 1, and a state slot (one-token blocks); every group's bytes
    arrive, nothing else of the three pools changes; a fetch without the
    groups is refused naming them."""
    ctx, gen = pair
    lo = layout()
    win = Layout.preset("vllm-nhd", num_layers=2, num_heads=HEADS,
                        head_dim=32, dtype="bf16", tokens_per_block=TPB,
                        num_blocks=BLOCKS)
    st = Layout.preset("vllm-nhd", num_layers=2, num_heads=HEADS,
                       head_dim=256, dtype="fp32", tokens_per_block=1,
                       num_blocks=4, kv_factor=1)
    src = [ctx.create_host_pool(x) for x in (lo, win, st)]
    dst = [gen.create_host_pool(x) for x in (lo, win, st)]
    for i, p in enumerate(src):
        fill(p.array, 10 + i)
    before = [p.array.copy() for p in dst]
    req = names["req"]
    ntok = 2 * TPB + 5
    params = ctx.publish(req, src[0], [5, 2, 7], num_tokens=ntok, groups=[
        kvxfer.Group(src[1], [4, 6], num_tokens=ntok, first_block=1),
        kvxfer.Group.state(src[2], 3)])
    with pytest.raises(kvxfer.ConfigMismatch, match="block tables"):
        gen.fetch(req, params, dst[0], [0, 3, 6])
    gen.fetch(req, params, dst[0], [0, 3, 6], groups=[
        kvxfer.Group(dst[1], [1, 2], first_block=1, skip_tokens=TPB),
        kvxfer.Group.state(dst[2], 0)])
    for c in (gen, ctx):
        assert wait_event(c, req).kind is EventKind.COMPLETE

    def tokens(lo, arr, block, t0, t1, layers):
        per = lo.token_stride
        return np.concatenate([
            arr[lo.offset(ly, kv, block) + t0 * per:
                lo.offset(ly, kv, block) + t1 * per]
            for ly in range(layers) for kv in range(lo.kv_factor)])

    for s, d, n in zip([5, 2, 7], [0, 3, 6], [TPB, TPB, 5]):
        assert np.array_equal(tokens(lo, dst[0].array, d, 0, n, LAYERS),
                              tokens(lo, src[0].array, s, 0, n, LAYERS))
    # the window: tokens [16, 32) of block 4 -> 1, [32, 37) of block 6 -> 2
    assert np.array_equal(tokens(win, dst[1].array, 1, 0, TPB, 2),
                          tokens(win, src[1].array, 4, 0, TPB, 2))
    assert np.array_equal(tokens(win, dst[1].array, 2, 0, 5, 2),
                          tokens(win, src[1].array, 6, 0, 5, 2))
    assert np.array_equal(tokens(win, dst[1].array, 2, 5, TPB, 2),
                          tokens(win, before[1], 2, 5, TPB, 2))
    for b in (0, 3, 4, 5, 6, 7):
        assert np.array_equal(tokens(win, dst[1].array, b, 0, TPB, 2),
                              tokens(win, before[1], b, 0, TPB, 2))
    assert np.array_equal(tokens(st, dst[2].array, 0, 0, 1, 2),
                          tokens(st, src[2].array, 3, 0, 1, 2))
    for b in (1, 2, 3):
        assert np.array_equal(tokens(st, dst[2].array, b, 0, 1, 2),
                              tokens(st, before[2], b, 0, 1, 2))


def test_groups_reserved_by_the_scheduler(daemon, pair, names):
    """A scheduler (no Hello) reserves a hybrid request with its other
    tables (reserve(pool=, groups=)): the rank's publish with the same
    groups returns the reservation's params and the window's bytes land;
    a reservation naming blocks, or without the plain pool among pools of
    several layouts, is refused naming it."""
    ctx, gen = pair
    lo = layout()
    win = Layout.preset("vllm-nhd", num_layers=2, num_heads=HEADS,
                        head_dim=32, dtype="bf16", tokens_per_block=TPB,
                        num_blocks=BLOCKS)
    src = [ctx.create_host_pool(x) for x in (lo, win)]
    dst = [gen.create_host_pool(x) for x in (lo, win)]
    fill(src[0].array, 3)
    fill(src[1].array, 4)
    req, ntok = names["req"], 2 * TPB
    with kvxfer.Client(daemon.sock) as sched:
        with pytest.raises(kvxfer.InvalidArgument, match="names no blocks"):
            sched.reserve(names["ctx"], req, ntok, pool=src[0], groups=[
                kvxfer.Group(src[1], [4], num_tokens=ntok)])
        with pytest.raises(kvxfer.StateError, match="plain table's pool"):
            sched.reserve(names["ctx"], req, ntok)
        rp = sched.reserve(names["ctx"], req, ntok, pool=src[0], groups=[
            kvxfer.Group(src[1], [], num_tokens=ntok)])
    params = ctx.publish(req, src[0], [5, 2], num_tokens=ntok, groups=[
        kvxfer.Group(src[1], [4, 6], num_tokens=ntok)])
    assert params == rp
    gen.fetch(req, rp, dst[0], [0, 3], groups=[
        kvxfer.Group(dst[1], [1, 7])])
    for c in (gen, ctx):
        assert wait_event(c, req).kind is EventKind.COMPLETE
    def wbytes(arr, b):
        per = win.token_stride * TPB
        return np.concatenate([arr[win.offset(ly, kv, b):
                                   win.offset(ly, kv, b) + per]
                               for ly in range(2) for kv in range(2)])

    for s, d in zip([4, 6], [1, 7]):
        assert np.array_equal(wbytes(dst[1].array, d),
                              wbytes(src[1].array, s))
    for s, d in zip([5, 2], [0, 3]):
        assert np.array_equal(block_bytes(lo, dst[0].array, d),
                              block_bytes(lo, src[0].array, s))


def test_groups_layerwise_tables_move_when_ready(pair, names):
    """A layer-wise offer with a state slot beside the KV: the state
    moves only once layers_ready(group=1) names its layers."""
    ctx, gen = pair
    lo = layout()
    st = Layout.preset("vllm-nhd", num_layers=2, num_heads=HEADS,
                       head_dim=256, dtype="fp32", tokens_per_block=1,
                       num_blocks=4, kv_factor=1)
    src = [ctx.create_host_pool(x) for x in (lo, st)]
    dst = [gen.create_host_pool(x) for x in (lo, st)]
    for i, p in enumerate(src):
        fill(p.array, 20 + i)
    req = names["req"]
    params = ctx.publish(req, src[0], [1, 2], num_tokens=2 * TPB,
                         layerwise=True,
                         groups=[kvxfer.Group.state(src[1], 3)])
    gen.fetch(req, params, dst[0], [4, 5],
              groups=[kvxfer.Group.state(dst[1], 0)])
    ctx.layers_ready(req, 0, LAYERS)
    with pytest.raises(kvxfer.InvalidArgument, match="group"):
        ctx.layers_ready(req, 0, 1, group=2)
    time.sleep(0.2)
    per = st.offset(0, 0, 1) - st.offset(0, 0, 0)
    assert not dst[1].array[st.offset(0, 0, 0):st.offset(0, 0, 0) + per].any()
    # each table's own progress: the KV's every layer, the state's none
    assert gen.fetch_progress(req) == (LAYERS, LAYERS, False)
    assert gen.fetch_progress(req, group=1) == (0, 2, False)
    with pytest.raises(kvxfer.InvalidArgument, match="fetch_progress.group"):
        gen.fetch_progress(req, group=2)
    ctx.layers_ready(req, 0, 2, group=1)
    for c in (gen, ctx):
        assert wait_event(c, req).kind is EventKind.COMPLETE
    for ly in range(2):
        s0, d0 = st.offset(ly, 0, 3), st.offset(ly, 0, 0)
        assert (dst[1].array[d0:d0 + per] == src[1].array[s0:s0 + per]).all()


def test_publish_many_and_fetch_many(pair, names):
    """Three requests published in one call and fetched in one call: each
    item's params are its own, every byte lands; an item naming no pool
    fails alone (an error instance in its place, the others taken)."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    fill(src.array, 77)
    base = names["req"]
    sb, db = [[0, 1], [2, 3], [4, 5]], [[7, 6], [5, 4], [3, 2]]
    params = ctx.publish_many([(base + i, src, sb[i], 2 * TPB)
                               for i in range(3)])
    assert all(isinstance(p, bytes) and p for p in params)
    assert len(set(params)) == 3
    out = gen.fetch_many([(base + i, params[i], dst, db[i])
                          for i in range(3)])
    assert out == [None, None, None]
    seen, end = {}, time.monotonic() + 20
    while len(seen) < 3 and time.monotonic() < end:
        for e in gen.poll(1, 0.2):
            seen[e.key] = e.kind
    assert seen == {kvxfer.key_bytes(base + i): EventKind.COMPLETE
                    for i in range(3)}
    for i in range(3):
        for s, d in zip(sb[i], db[i]):
            assert np.array_equal(block_bytes(lo, dst.array, d),
                                  block_bytes(lo, src.array, s))
    res = ctx.publish_many([(base + 10, src, [6, 7], TPB),
                            (base + 11, 999, [6, 7], TPB),
                            (base + 12, 998, [6, 7], TPB)])
    assert isinstance(res[0], bytes)
    assert isinstance(res[1], kvxfer.Error)
    assert "item 1" in str(res[1]) and "999" in str(res[1])
    # each item has the daemon's own message for it (3.0): item 2's
    # names its pool 998, not item 1's words
    assert type(res[2]) is type(res[1])
    assert "item 2" in str(res[2]) and "item 1" not in str(res[2])
    assert "998" in str(res[2]) and "999" not in str(res[2])
    ctx.cancel(base + 10)
    # fetches failing alone, each with its own message: params that are
    # not params, a pool that does not exist
    out = gen.fetch_many([(base + 20, b"junk", dst, db[0]),
                          (base + 21, params[0], 997, db[0])])
    assert isinstance(out[0], kvxfer.InvalidArgument)
    assert "params" in str(out[0]) and "item 0" in str(out[0])
    assert isinstance(out[1], kvxfer.Error) and "item 1" in str(out[1])
    assert "997" in str(out[1]) and "997" not in str(out[0])


def test_version_is_the_loaded_librarys():
    """kvxfer.version() asks the library (kvx_version, 3.0)."""
    assert kvxfer.version() == "3.2.0"
    assert kvxfer._lib.lib().kvx_version() == b"3.2.0"


def test_spin_us_reads_the_same_bytes(daemon, names):
    """Clients that look for their replies before sleeping (spin_us, the
    constructor's or set_spin_us) move the same bytes; a bad spin is
    refused, named."""
    ctx = open_rank(daemon.sock, names["ctx"], "context", spin_us=300)
    gen = open_rank(daemon.sock, names["gen"], "generation")
    try:
        gen.set_spin_us(100000)
        with pytest.raises(kvxfer.InvalidArgument, match="at most 100000"):
            gen.set_spin_us(100001)
        with pytest.raises(kvxfer.InvalidArgument, match="spin_us"):
            gen.set_spin_us(-1)
        lo = layout()
        src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
        fill(src.array, 5)
        req = names["req"]
        params = ctx.publish(req, src, [3, 1], num_tokens=2 * TPB)
        gen.fetch(req, params, dst, [4, 6])
        assert wait_event(gen, req).ok
        for s, d in zip([3, 1], [4, 6]):
            assert np.array_equal(block_bytes(lo, dst.array, d),
                                  block_bytes(lo, src.array, s))
        gen.set_spin_us(0)
        assert list(gen.poll(1, 0.02)) == []
    finally:
        gen.close()
        ctx.close()
    with pytest.raises(kvxfer.InvalidArgument, match="at most"):
        kvxfer.Client(daemon.sock, spin_us=10**6)


def test_layerwise_calls_go_through_the_3_0_verbs(pair, names):
    """layers_ready, fetch_progress and reserve call kvx_ready,
    kvx_progress and kvx_reserve (3.0 args structs): the library's own
    refusal names kvx_ready, and the layers, tokens and progress still
    move and count as before."""
    ctx, gen = pair
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    fill(src.array, 31)
    req = names["req"]
    params = ctx.publish(req, src, [1, 2], num_tokens=2 * TPB,
                         layerwise=True)
    gen.fetch(req, params, dst, [4, 5])
    with pytest.raises(kvxfer.InvalidArgument, match="kvx_ready: count 0"):
        ctx.layers_ready(req, 0, 0)
    assert gen.fetch_progress(req) == (0, LAYERS, False)
    ctx.layers_ready(req, 0, 1, tokens=2 * TPB)
    deadline = time.monotonic() + 3
    while gen.fetch_progress(req)[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gen.fetch_progress(req, group=0)[:2] == (1, LAYERS)
    ctx.layers_ready(req, 1, LAYERS - 1)
    for c in (gen, ctx):
        assert wait_event(c, req).kind is EventKind.COMPLETE
    a, b = lo.offset(0, 0, 1), lo.offset(0, 0, 4)
    n = lo.offset(0, 0, 3) - a
    assert (dst.array[b:b + n] == src.array[a:a + n]).all()


def test_gpu_pace_set_withdrawn_and_bounded(daemon, pair):
    ctx, gen = pair
    obs = kvxfer.Client(daemon.sock)
    try:
        gen.gpu_pace(512 << 20)  # hold 0: until withdrawn
        gpu = obs.status()["gpu"]
        assert ("engines 1 (lowest 536870912 B/ms, 1 without a GPU pool)"
                in gpu), gpu
        with pytest.raises(kvxfer.InvalidArgument, match="gpu_pace.hold_ms"):
            gen.gpu_pace(1000, hold_ms=60001)
        with pytest.raises(kvxfer.InvalidArgument,
                           match="gpu_pace.bytes_per_ms"):
            gen.gpu_pace((1 << 40) + 1)
        with pytest.raises(kvxfer.InvalidArgument, match="bytes_per_ms"):
            gen.gpu_pace(-1)
        with pytest.raises(kvxfer.StateError, match="hello"):
            obs.gpu_pace(1000)
        assert "lowest 536870912 B/ms" in obs.status()["gpu"]
        gen.gpu_pace(0)
        assert "engines" not in obs.status()["gpu"]
    finally:
        obs.close()
