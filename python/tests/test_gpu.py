"""GPU pools from CUDA tensors (PyTorch) and CuPy arrays.

Run by `make test-gpu` on a GPU machine; elsewhere every test skips,
saying what is missing.
"""

import pytest

import kvxfer
from kvxfer import Layout

from conftest import wait_event

# the pair fixture's instances: 4 layers, 2 KV heads (conftest.open_rank)
LAYERS, HEADS, HEAD_DIM, TPB, BLOCKS = 4, 2, 128, 16, 32


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device"
    return torch, ""


def _cupy():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # ImportError, or no driver / device
        return None, f"cupy unusable: {e}"
    return cupy, ""


torch, torch_why = _torch_cuda()
cupy, cupy_why = _cupy()
needs_torch = pytest.mark.skipif(torch is None,
                                 reason=f"no CUDA torch: {torch_why}")
needs_cupy = pytest.mark.skipif(cupy is None, reason=cupy_why)


def layout(preset="vllm-nhd"):
    return Layout.preset(preset, num_layers=LAYERS, num_heads=HEADS,
                         head_dim=HEAD_DIM, dtype="bf16",
                         tokens_per_block=TPB, num_blocks=BLOCKS)


def register(client, memory, lo):
    try:
        return client.register_pool(memory, lo)
    except kvxfer.Unsupported as e:
        pytest.skip(f"GPU pools unsupported here: {e}")


def move(pair, names, src_mem, dst_mem, lo):
    ctx, gen = pair
    src, dst = register(ctx, src_mem, lo), register(gen, dst_mem, lo)
    assert src.kind == dst.kind == "gpu"
    req = names["req"]
    params = ctx.publish(req, src, list(range(BLOCKS)), BLOCKS * TPB)
    gen.fetch(req, params, dst, list(range(BLOCKS)))
    gen_ev, ctx_ev = wait_event(gen, req), wait_event(ctx, req)
    gen_ev.raise_for_status()
    ctx_ev.raise_for_status()


@needs_torch
@pytest.mark.parametrize("preset", ["vllm-nhd", "trtllm", "flashinfer"])
def test_torch_cuda_tensor_pools(pair, names, preset):
    lo = layout(preset)
    g = torch.Generator(device="cuda").manual_seed(7)
    src = torch.randint(0, 256, (lo.span,), dtype=torch.uint8,
                        device="cuda", generator=g)
    dst = torch.zeros(lo.span, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    move(pair, names, src, dst, lo)
    torch.cuda.synchronize()
    assert torch.equal(src, dst)


@needs_torch
def test_torch_separate_k_and_v_tensors(pair, names):
    """SGLang's pools: a K and a V tensor per layer, each its own
    allocation (torch.empty one by one), into per-layer tensors."""
    lo = layout("vllm-nhd")
    shape = (BLOCKS, TPB, HEADS, HEAD_DIM)
    ks = [torch.randn(shape, dtype=torch.bfloat16, device="cuda")
          for _ in range(LAYERS)]
    vs = [torch.randn(shape, dtype=torch.bfloat16, device="cuda")
          for _ in range(LAYERS)]
    dst = [torch.zeros((2,) + shape, dtype=torch.bfloat16, device="cuda")
           for _ in range(LAYERS)]
    torch.cuda.synchronize()
    move(pair, names, (ks, vs), dst, lo)
    torch.cuda.synchronize()
    for a in range(LAYERS):
        assert torch.equal(dst[a][0], ks[a]) and torch.equal(dst[a][1], vs[a])


@needs_torch
def test_torch_per_layer_tensors(pair, names):
    """One [2, blocks, tokens, heads, dim] bf16 tensor per layer, as vLLM
    keeps them, carved from one allocation: a region per layer, the
    allocation shared once."""
    lo = layout("vllm-nhd")
    shape = (2, BLOCKS, TPB, HEADS, HEAD_DIM)
    big_src = torch.randn((LAYERS,) + shape, dtype=torch.bfloat16,
                          device="cuda")
    big_dst = torch.zeros_like(big_src)
    src = [big_src[i] for i in range(LAYERS)]
    dst = [big_dst[i] for i in reversed(range(LAYERS))]  # any order
    torch.cuda.synchronize()
    move(pair, names, src, dst, lo)
    torch.cuda.synchronize()
    assert torch.equal(big_dst.flip(0), big_src)


@needs_torch
def test_torch_slice_of_a_larger_tensor(pair, names):
    lo = layout()
    big = torch.randint(0, 256, (3 * lo.span,), dtype=torch.uint8,
                        device="cuda")
    before = big.clone()
    src = torch.randint(0, 256, (lo.span,), dtype=torch.uint8,
                        device="cuda")
    dst = big[lo.span:2 * lo.span]
    torch.cuda.synchronize()
    move(pair, names, src, dst, lo)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    assert torch.equal(big[:lo.span], before[:lo.span])
    assert torch.equal(big[2 * lo.span:], before[2 * lo.span:])


@needs_cupy
def test_cupy_array_pools(pair, names):
    lo = layout()
    src = cupy.random.randint(0, 256, lo.span, dtype=cupy.uint8)
    dst = cupy.zeros(lo.span, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    move(pair, names, src, dst, lo)
    cupy.cuda.runtime.deviceSynchronize()
    assert bool((src == dst).all())


@needs_torch
def test_raw_device_pointer(pair, names):
    lo = layout()
    src = torch.randint(0, 256, (lo.span,), dtype=torch.uint8,
                        device="cuda")
    dst = torch.zeros(lo.span, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ctx, gen = pair
    with pytest.raises(kvxfer.InvalidArgument, match="device"):
        ctx.register_pool(src.data_ptr(), lo, size=lo.span)
    s = ctx.register_pool(src.data_ptr(), lo, size=lo.span, device="cuda")
    d = gen.register_pool(dst.data_ptr(), lo, size=lo.span, device="cuda")
    req = names["req"]
    gen.fetch(req, ctx.publish(req, s, [0, 1], 2 * TPB), d, [0, 1])
    wait_event(gen, req).raise_for_status()
    torch.cuda.synchronize()
    n = lo.offset(0, 0, 2)
    assert torch.equal(dst[:n], src[:n])


@needs_torch
def test_layerwise_with_a_torch_event(pair, names):
    """A layer-wise offer made ready by interprocess CUDA events recorded
    after each layer's writes (torch.cuda.Event(interprocess=True)); the
    engine never synchronises; every byte lands."""
    ctx, gen = pair
    lo = layout()
    src = torch.zeros(lo.span, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(lo.span, dtype=torch.uint8, device="cuda")
    sp, dp = register(ctx, src, lo), register(gen, dst, lo)
    req = names["req"]
    params = ctx.publish(req, sp, list(range(BLOCKS)), BLOCKS * TPB,
                         layerwise=True)
    gen.fetch(req, params, dp, list(range(BLOCKS)))
    want = torch.randint(0, 256, (lo.span,), dtype=torch.uint8,
                         device="cuda")
    per = lo.layer_stride  # vllm-nhd: the layers one after another
    events = []
    for layer in range(LAYERS):
        torch.cuda._sleep(2_000_000)  # a layer of a forward pass
        src[layer * per:(layer + 1) * per] = want[layer * per:
                                                 (layer + 1) * per]
        ev = torch.cuda.Event(interprocess=True)
        ev.record()
        events.append(ev)  # an event per layer, kept alive
        ctx.layers_ready(req, layer, event=ev)
    gen_ev, ctx_ev = wait_event(gen, req), wait_event(ctx, req)
    gen_ev.raise_for_status()
    ctx_ev.raise_for_status()
    assert torch.equal(dst, want)


@needs_torch
def test_chunked_prefill_with_torch_events(pair, names):
    """A chunked prefill on GPU pools: the first chunk's blocks at the
    publish, each chunk's tokens made ready per layer by an interprocess
    event, the second chunk's blocks appended; every byte lands."""
    ctx, gen = pair
    lo = layout()
    src = torch.zeros(lo.span, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(lo.span, dtype=torch.uint8, device="cuda")
    sp, dp = register(ctx, src, lo), register(gen, dst, lo)
    req = names["req"]
    half = BLOCKS // 2
    params = ctx.publish(req, sp, list(range(half)), BLOCKS * TPB,
                         layerwise=True)
    gen.fetch(req, params, dp, list(range(BLOCKS)))
    want = torch.randint(0, 256, (lo.span,), dtype=torch.uint8,
                         device="cuda")
    events = []
    for chunk in range(2):
        if chunk:
            ctx.append_blocks(req, sp, list(range(half, BLOCKS)))
        for layer in range(LAYERS):
            torch.cuda._sleep(1_000_000)
            for kv in range(2):
                o = lo.offset(layer, kv, chunk * half)
                n = lo.offset(layer, kv, half) - lo.offset(layer, kv, 0)
                src[o:o + n] = want[o:o + n]
            ev = torch.cuda.Event(interprocess=True)
            ev.record()
            events.append(ev)
            ctx.layers_ready(req, layer, tokens=(chunk + 1) * half * TPB,
                             event=ev)
    gen_ev, ctx_ev = wait_event(gen, req), wait_event(ctx, req)
    gen_ev.raise_for_status()
    ctx_ev.raise_for_status()
    assert torch.equal(dst, want)


@needs_torch
def test_groups_window_and_state_on_the_gpu(pair, names):
    """A hybrid request between GPU pools: the KV, a sliding-window group
    from its block 1, and a state slot (one-token blocks) land, each in
    its own tensor, and nothing else of the three changes."""
    ctx, gen = pair
    lo = layout()
    win = Layout.preset("vllm-nhd", num_layers=2, num_heads=HEADS,
                        head_dim=64, dtype="bf16", tokens_per_block=TPB,
                        num_blocks=BLOCKS)
    st = Layout.preset("vllm-nhd", num_layers=2, num_heads=HEADS,
                       head_dim=512, dtype="fp32", tokens_per_block=1,
                       num_blocks=4, kv_factor=1)
    g = torch.Generator(device="cuda").manual_seed(11)
    srcs = [torch.randint(0, 256, (x.span,), dtype=torch.uint8,
                          device="cuda", generator=g) for x in (lo, win, st)]
    dsts = [torch.zeros(x.span, dtype=torch.uint8, device="cuda")
            for x in (lo, win, st)]
    torch.cuda.synchronize()
    sp = [register(ctx, m, x) for m, x in zip(srcs, (lo, win, st))]
    dp = [register(gen, m, x) for m, x in zip(dsts, (lo, win, st))]
    req = names["req"]
    ntok = BLOCKS * TPB
    params = ctx.publish(req, sp[0], list(range(BLOCKS)), ntok, groups=[
        kvxfer.Group(sp[1], list(range(1, BLOCKS)), num_tokens=ntok,
                     first_block=1),
        kvxfer.Group.state(sp[2], 3)])
    gen.fetch(req, params, dp[0], list(range(BLOCKS)), groups=[
        kvxfer.Group(dp[1], list(range(1, BLOCKS)), first_block=1,
                     skip_tokens=TPB),
        kvxfer.Group.state(dp[2], 1)])
    for c in (gen, ctx):
        wait_event(c, req).raise_for_status()
    torch.cuda.synchronize()
    assert torch.equal(srcs[0], dsts[0])
    # window: every layer's blocks 1.. equal, block 0 untouched (zero)
    for ly in range(2):
        for kv in range(2):
            a, b = win.offset(ly, kv, 0), win.offset(ly, kv, 1)
            end = win.offset(ly, kv, BLOCKS - 1) + (b - a)
            assert torch.equal(dsts[1][b:end], srcs[1][b:end])
            assert int(dsts[1][a:b].count_nonzero()) == 0
    per = st.offset(0, 0, 1) - st.offset(0, 0, 0)
    for ly in range(2):
        s0, d0 = st.offset(ly, 0, 3), st.offset(ly, 0, 1)
        assert torch.equal(dsts[2][d0:d0 + per], srcs[2][s0:s0 + per])
        for b in (0, 2, 3):
            o = st.offset(ly, 0, b)
            assert int(dsts[2][o:o + per].count_nonzero()) == 0
