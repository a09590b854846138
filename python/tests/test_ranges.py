"""Every integer and timeout is range-checked before it reaches ctypes.

ctypes converts a Python int to a C integer modulo its width without a
word: publish(..., num_tokens=2**32 + 16) published 16 tokens, and -1
became 4294967295. Each argument of each call is given a value above its
C type, below it, a float and a bool; each must raise InvalidArgument
naming the argument, the value and the range, before anything is sent.
"""

import dataclasses
import itertools
import math

import numpy as np
import pytest

import kvxfer
from kvxfer import DType, Group, HostBuffer, Layout, Parallel

from conftest import open_rank, wait_event

LAYERS, HEADS, HEAD_DIM, TPB, BLOCKS = 4, 2, 64, 16, 8
U32, U64, INT = 2**32 - 1, 2**64 - 1, 2**31 - 1
PAR = Parallel(total_layers=LAYERS, total_kv_heads=HEADS)
_ids = itertools.count()


def layout():
    return Layout.preset("vllm-nhd", num_layers=LAYERS, num_heads=HEADS,
                         head_dim=HEAD_DIM, dtype="bf16",
                         tokens_per_block=TPB, num_blocks=BLOCKS)


class Env:
    """A context rank, a generation rank and an observer on one daemon,
    a pool each, and one published offer."""

    def __init__(self, daemon):
        self.sock = daemon.sock
        self.ctx = open_rank(daemon.sock, "ranges-ctx", "context")
        self.gen = open_rank(daemon.sock, "ranges-gen", "generation")
        self.obs = kvxfer.Client(daemon.sock)
        self.lo = layout()
        self.src = self.ctx.create_host_pool(self.lo)
        self.dst = self.gen.create_host_pool(self.lo)
        self.params = self.ctx.publish("ranges-offer", self.src, [0], TPB)

    @staticmethod
    def key():
        return f"ranges-{next(_ids)}"

    def close(self):
        for c in (self.obs, self.gen, self.ctx):
            c.close()


@pytest.fixture(scope="module")
def env(daemon):
    e = Env(daemon)
    yield e
    e.close()


def assert_range_error(err, arg, bad, lo, hi):
    """err names arg, the value and the range."""
    assert isinstance(err, kvxfer.InvalidArgument) and err.code == -1
    assert err.message.startswith(f"{arg}: {bad!r}"), err.message
    assert f"expected an int in {lo}..{hi}" in err.message, err.message


def _par(**kw):
    return dataclasses.replace(PAR, **kw)


def _connect(e, **kw):
    return kvxfer.Client(e.sock, instance_id=e.key(),
                         **{"role": "context", "parallel": PAR, **kw})


# (argument, call(env, value), lo, hi): the call passes value as argument
CALLS = [
    # Client(), hello()
    ("rank", lambda e, v: _connect(e, rank=v), 0, U32),
    ("role", lambda e, v: _connect(e, role=v), 1, 3),
    *[(f"parallel.{f}", lambda e, v, f=f: _connect(e,
                                                   parallel=_par(**{f: v})),
       0, U32) for f in ("tp", "pp", "cp", "total_layers", "total_kv_heads",
                         "attention_dp")],
    ("parallel.layers_per_pp[1]",
     lambda e, v: _connect(e, parallel=_par(pp=2, layers_per_pp=[2, v])),
     0, U32),
    ("protocol_version[0]",
     lambda e, v: _connect(e, protocol_version=(v, 0)), 0, U32),
    ("protocol_version[1]",
     lambda e, v: _connect(e, protocol_version=(2, v)), 0, U32),
    ("spin_us", lambda e, v: kvxfer.Client(e.sock, spin_us=v), 0, U32),
    ("rank", lambda e, v: kvxfer.Client(e.sock).hello(
        e.key(), "context", rank=v, parallel=PAR), 0, U32),
    ("spin_us", lambda e, v: e.ctx.set_spin_us(v), 0, U32),
    # pools
    ("fd", lambda e, v: e.ctx.register_host_fd(v, 0, e.lo.span, e.lo),
     0, INT),
    ("offset", lambda e, v: e.ctx.register_host_fd(
        e.src.buffer.fd, v, e.lo.span, e.lo), 0, U64),
    ("size", lambda e, v: e.ctx.register_host_fd(
        e.src.buffer.fd, 0, v, e.lo), 0, U64),
    ("size", lambda e, v: e.ctx.create_host_pool(e.lo, size=v), 1, U64),
    ("size", lambda e, v: e.ctx.register_pool(e.src.buffer, e.lo, size=v),
     1, U64),
    ("size", lambda e, v: HostBuffer(v), 1, U64),
    ("pool", lambda e, v: e.ctx.deregister(v), 0, U32),
    # publish
    ("num_tokens", lambda e, v: e.ctx.publish(e.key(), e.src, [1], v),
     0, U32),
    ("pool", lambda e, v: e.ctx.publish(e.key(), v, [1], TPB), 0, U32),
    ("blocks[1]", lambda e, v: e.ctx.publish(e.key(), e.src, [1, v],
                                             2 * TPB), 0, U32),
    ("blocks[0]", lambda e, v: e.ctx.publish(e.key(), e.src, [v], TPB,
                                             layerwise=True), 0, U32),
    *[(f"groups[0].{f}", lambda e, v, f=f: e.ctx.publish(
        e.key(), e.src, [1], TPB,
        groups=[Group(e.src, [2], **{"num_tokens": TPB, f: v})]), 0, U32)
      for f in ("num_tokens", "first_block")],
    ("groups[0].pool", lambda e, v: e.ctx.publish(
        e.key(), e.src, [1], TPB, groups=[Group(v, [2], TPB)]), 0, U32),
    ("groups[0].blocks[0]", lambda e, v: e.ctx.publish(
        e.key(), e.src, [1], TPB, groups=[Group(e.src, [v], TPB)]), 0, U32),
    ("items[0].num_tokens", lambda e, v: e.ctx.publish_many(
        [(e.key(), e.src, [1], v)]), 0, U32),
    ("items[1].pool", lambda e, v: e.ctx.publish_many(
        [(e.key(), e.src, [1], TPB), (e.key(), v, [2], TPB)]), 0, U32),
    ("items[0].blocks[0]", lambda e, v: e.ctx.publish_many(
        [(e.key(), e.src, [v], TPB)]), 0, U32),
    # layer-wise offers
    ("first", lambda e, v: e.ctx.layers_ready(e.key(), v), 0, U32),
    ("count", lambda e, v: e.ctx.layers_ready(e.key(), 0, v), 0, U32),
    ("tokens", lambda e, v: e.ctx.layers_ready(e.key(), 0, tokens=v),
     0, U32),
    ("group", lambda e, v: e.ctx.layers_ready(e.key(), 0, group=v), 0, U32),
    ("pool", lambda e, v: e.ctx.append_blocks(e.key(), v, [1]), 0, U32),
    ("blocks[0]", lambda e, v: e.ctx.append_blocks(e.key(), e.src, [v]),
     0, U32),
    # fetch
    ("skip_tokens", lambda e, v: e.gen.fetch(
        e.key(), e.params, e.dst, [0], skip_tokens=v), 0, U32),
    ("dp_rank", lambda e, v: e.gen.fetch(
        e.key(), e.params, e.dst, [0], dp_rank=v), 0, U32),
    ("pool", lambda e, v: e.gen.fetch(e.key(), e.params, v, [0]), 0, U32),
    ("blocks[0]", lambda e, v: e.gen.fetch(e.key(), e.params, e.dst, [v]),
     0, U32),
    ("groups[0].skip_tokens", lambda e, v: e.gen.fetch(
        e.key(), e.params, e.dst, [0],
        groups=[Group(e.dst, [1], skip_tokens=v)]), 0, U32),
    ("items[0].skip_tokens", lambda e, v: e.gen.fetch_many(
        [(e.key(), e.params, e.dst, [0], v)]), 0, U32),
    ("skip_tokens", lambda e, v: e.gen.fetch_many(
        [(e.key(), e.params, e.dst, [0])], skip_tokens=v), 0, U32),
    ("items[0].pool", lambda e, v: e.gen.fetch_many(
        [(e.key(), e.params, v, [0])]), 0, U32),
    ("items[0].blocks[0]", lambda e, v: e.gen.fetch_many(
        [(e.key(), e.params, e.dst, [v])]), 0, U32),
    ("group", lambda e, v: e.gen.fetch_progress(e.key(), group=v), 0, U32),
    ("at_least", lambda e, v: e.gen.poll(v, 0), 0, U32),
    # by key
    ("num_tokens", lambda e, v: e.obs.reserve("ranges-ctx", e.key(), v),
     0, U32),
    ("pool", lambda e, v: e.obs.reserve("ranges-ctx", e.key(), TPB, pool=v),
     0, U32),
    *[(f"groups[0].{f}", lambda e, v, f=f: e.obs.reserve(
        "ranges-ctx", e.key(), TPB,
        groups=[Group(e.src, [], **{"num_tokens": TPB, f: v})]), 0, U32)
      for f in ("num_tokens", "first_block")],
    ("groups[0].pool", lambda e, v: e.obs.reserve(
        "ranges-ctx", e.key(), TPB, groups=[Group(v, [], TPB)]), 0, U32),
    # leases (2.6)
    ("lease_ms", lambda e, v: e.ctx.publish(e.key(), e.src, [0], TPB,
                                            lease_ms=v), 0, U32),
    ("lease_ms", lambda e, v: e.obs.reserve("ranges-ctx", e.key(), TPB,
                                            lease_ms=v), 0, U32),
    ("lease_ms", lambda e, v: e.obs.reserve_many(
        "ranges-ctx", [(e.key(), TPB)], lease_ms=v), 0, U32),
    ("items[0].num_tokens", lambda e, v: e.obs.reserve_many(
        "ranges-ctx", [(e.key(), v)]), 0, U32),
    *[(arg, lambda e, v, kw=kw: e.gen.fetch_by_key(
        e.key(), "ranges-ctx", e.ctx.daemon_address, e.key(),
        **{"pool": e.dst, "blocks": [0], **kw(v)}), 0, U32)
      for arg, kw in (("skip_tokens", lambda v: {"skip_tokens": v}),
                      ("dp_rank", lambda v: {"dp_rank": v}),
                      ("pool", lambda v: {"pool": v}),
                      ("blocks[0]", lambda v: {"blocks": [v]}))],
    # layouts
    *[(f, lambda e, v, f=f: Layout.preset(
        "vllm-nhd", **{"num_layers": LAYERS, "num_heads": HEADS,
                       "head_dim": HEAD_DIM, "dtype": "bf16",
                       "tokens_per_block": TPB, "num_blocks": BLOCKS,
                       f: v}), 0, U32)
      for f in ("num_layers", "kv_factor", "num_heads", "head_dim",
                "tokens_per_block", "num_blocks")],
    *[(f, lambda e, v, f=f: Layout.custom(**{
        "num_layers": LAYERS, "kv_factor": 2, "num_heads": HEADS,
        "head_dim": HEAD_DIM, "dtype": "bf16", "tokens_per_block": TPB,
        "num_blocks": BLOCKS, "kv_stride": 0, "block_stride": 4096,
        "token_stride": 256, "head_stride": 128, "layer_stride": 0,
        "elem_size": 2, f: v}), 0, U64 if f.endswith("stride") else
       1024 if f == "num_layers" else U32)
      for f in ("num_layers", "kv_factor", "num_heads", "head_dim",
                "tokens_per_block", "num_blocks", "elem_size", "kv_stride",
                "block_stride", "token_stride", "head_stride",
                "layer_stride")],
    ("parts[1].region", lambda e, v: e.lo.with_parts(
        [(0, 0), (v, 0)] + [(0, 0)] * (2 * LAYERS - 2)), 0, U32),
    ("parts[1].offset", lambda e, v: e.lo.with_parts(
        [(0, 0), (0, v)] + [(0, 0)] * (2 * LAYERS - 2)), 0, U64),
    ("layer_offsets[2]", lambda e, v: e.lo.with_layer_offsets(
        [0, 1, v, 3]), 0, U64),
    ("first_head", lambda e, v: e.lo.with_first_head(v), 0, U32 - 1),
    ("regions_per_layer", lambda e, v: e.lo.split(v), 0, U32),
    ("region", lambda e, v: e.lo.region_span(v), 0, U32),
    ("layer", lambda e, v: e.lo.region(v, 0), 0, LAYERS - 1),
    ("kv", lambda e, v: e.lo.region(0, v), 0, 1),
    *[(f, lambda e, v, i=i: e.lo.offset(*[v if j == i else 0
                                          for j in range(5)]), 0, hi)
      for i, (f, hi) in enumerate((("layer", LAYERS - 1), ("kv", 1),
                                   ("block", BLOCKS - 1), ("token", TPB - 1),
                                   ("head", HEADS - 1)))],
]


def _call_id(c):
    code = c[1].__code__
    return f"{c[0]}@{code.co_firstlineno}"


@pytest.mark.parametrize("which", ["above", "below", "float", "bool"])
@pytest.mark.parametrize("arg,call,lo,hi", CALLS,
                         ids=[_call_id(c) for c in CALLS])
def test_integer_arguments_are_range_checked(env, arg, call, lo, hi, which):
    """Above the C type (2**32 + 16 for a uint32_t, the issue's case),
    below it (-1 for an unsigned, the issue's other case), a float (even
    a whole one) and a bool: InvalidArgument naming the argument, the
    value and the range."""
    bad = {"above": hi + 17, "below": lo - 1, "float": lo + 2.0,
           "bool": True}[which]
    with pytest.raises(kvxfer.InvalidArgument) as e:
        call(env, bad)
    assert_range_error(e.value, arg, bad, lo, hi)


@pytest.mark.parametrize("bad", [max(DType) + 1, -1, True])
def test_dtype_as_an_int_is_a_dtype(bad):
    """DType.of(int) took any int (a bool as FP32); a float is parsed
    as a name (and refused as one)."""
    with pytest.raises(kvxfer.InvalidArgument) as e:
        DType.of(bad)
    assert_range_error(e.value, "dtype", bad, 0, max(DType))


@pytest.mark.parametrize("bad", [U64 + 1, -1, True])
def test_int_key_is_a_uint64(env, bad):
    """An int key is a uint64_t's decimal digits (kvx_publish's)."""
    with pytest.raises(kvxfer.InvalidArgument) as e:
        env.ctx.cancel(bad)
    assert_range_error(e.value, "key", bad, 0, U64)


@pytest.mark.parametrize("bad", [U64 + 1, -1, 0])
def test_raw_pointer_is_a_pointer(env, bad):
    """A raw device pointer is a uint64_t other than NULL: c_void_p(-1)
    is 0xffffffffffffffff."""
    with pytest.raises(kvxfer.InvalidArgument) as e:
        env.ctx.register_pool(bad, env.lo, size=4096, device="cuda")
    assert_range_error(e.value, "memory", bad, 1, U64)


@pytest.mark.parametrize("num_tokens", [2**32 + 16, -1])
def test_publish_out_of_range_num_tokens_sends_nothing(env, num_tokens):
    """The issue's cases: 2**32 + 16 published 16 tokens, -1 reached the
    daemon as 4294967295. Now nothing is sent: the key is still free, and
    the publish with the real count gives params saying that count."""
    key = env.key()
    with pytest.raises(kvxfer.InvalidArgument) as e:
        env.ctx.publish(key, env.src, [1, 2], num_tokens=num_tokens)
    assert e.value.message == (f"num_tokens: {num_tokens} is out of range; "
                               "expected an int in 0..4294967295")
    assert key.encode() not in [r.get("key", "").encode()
                                for r in env.ctx.requests()]
    params = env.ctx.publish(key, env.src, [1, 2], num_tokens=2 * TPB)
    assert kvxfer.params_info(params).num_tokens == 2 * TPB
    env.ctx.cancel(key)


BAD_BLOCKS = [
    ("blocks[1]", np.array([0, -1], dtype=np.int64), "-1 is out of range"),
    ("blocks[1]", np.array([0, 2**32], dtype=np.int64),
     "4294967296 is out of range"),
    ("blocks[0]", np.array([2**63], dtype=np.uint64),
     "9223372036854775808 is out of range"),
    ("blocks", np.array([0.0, 1.0]), "a 1-d float64 array"),
    ("blocks", np.array([True, False]), "a 1-d bool array"),
    ("blocks", np.zeros((2, 2), dtype=np.int32), "a 2-d int32 array"),
    ("blocks[1]", [0, True], "True (bool) is not an integer"),
    ("blocks[1]", [0, np.float64(1.0)], "np.float64(1.0) (float64) is not"),
    ("blocks[0]", [np.True_], "(bool) is not an integer"),
    ("blocks[2]", [0, 1, -5], "-5 is out of range"),
    ("blocks[0]", [2**32 + 16], "4294967312 is out of range"),
    ("blocks", "12", "str; expected a sequence of ints"),
    ("blocks", 7, "int is not a sequence of ints"),
]


@pytest.mark.parametrize("arg,blocks,says", BAD_BLOCKS,
                         ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_BLOCKS)])
def test_block_ids_are_never_cast(env, arg, blocks, says):
    """Block ids of every form (numpy arrays, lists, numpy scalars in a
    list) outside uint32_t, or of a type that would be cast, are refused
    naming the element."""
    with pytest.raises(kvxfer.InvalidArgument) as e:
        env.ctx.publish(env.key(), env.src, blocks, TPB)
    msg = e.value.message
    assert msg.startswith(f"{arg}: ") and says in msg, msg


BAD_TIMEOUTS = [math.nan, math.inf, -math.inf, -1, -0.5, True, "5", 1e10,
                (INT + 1) / 1000]
TIMED = [
    ("status", lambda e, v: e.obs.status(timeout=v)),
    ("requests", lambda e, v: e.obs.requests(timeout=v)),
    ("connect", lambda e, v: kvxfer.Client(e.sock, timeout=v)),
    ("publish", lambda e, v: e.ctx.publish(e.key(), e.src, [1], TPB,
                                           timeout=v)),
    ("fetch", lambda e, v: e.gen.fetch(e.key(), e.params, e.dst, [0],
                                       timeout=v)),
    ("cancel", lambda e, v: e.gen.cancel(e.key(), timeout=v)),
    ("release", lambda e, v: e.obs.release(e.params, timeout=v)),
    ("reserve", lambda e, v: e.obs.reserve("ranges-ctx", e.key(), TPB,
                                           timeout=v)),
    ("join", lambda e, v: e.ctx.join([e.ctx.daemon_address], timeout=v)),
    ("poll", lambda e, v: e.gen.poll(1, v)),
]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=map(repr, BAD_TIMEOUTS))
@pytest.mark.parametrize("name,call", TIMED, ids=[t[0] for t in TIMED])
def test_timeouts_are_range_checked(env, name, call, bad):
    """NaN, infinities, negative times, bools, strings and more than
    INT_MAX ms: InvalidArgument naming the timeout, the value and the
    range, never a wrapped, clamped or endless wait."""
    with pytest.raises(kvxfer.InvalidArgument) as e:
        call(env, bad)
    msg = e.value.message
    assert msg.startswith(f"timeout: {bad!r}"), msg
    assert "and at most 2147483.647, or None (no deadline)" in msg, msg


@pytest.mark.parametrize("name,call", TIMED[:-1],
                         ids=[t[0] for t in TIMED[:-1]])
def test_zero_timeout_is_refused_but_by_poll(env, name, call):
    """0 s is no time to wait for a reply (poll's 0, "now", passes in
    test_numpy_and_exact_values_pass)."""
    with pytest.raises(kvxfer.InvalidArgument) as e:
        call(env, 0)
    assert e.value.message == ("timeout: 0 is out of range; expected "
                               "seconds > 0 and at most 2147483.647, or "
                               "None (no deadline)")


def test_numpy_and_exact_values_pass(env):
    """What the checks let through reaches the daemon unchanged: numpy
    integer scalars and arrays (any integer dtype), a uint32_t's largest
    value, a short timeout (at least 1 ms), None, and 0 for poll."""
    key = env.key()
    blocks = np.array([3, 4], dtype=np.uint64)
    params = env.ctx.publish(key, env.src, blocks, np.int64(2 * TPB - 1),
                             timeout=np.float32(5.0))
    assert kvxfer.params_info(params).num_tokens == 2 * TPB - 1
    env.gen.fetch(key, params, np.uint32(env.dst.id), [np.int32(5), 6],
                  skip_tokens=np.uint8(1), timeout=5)
    assert wait_event(env.gen, key).ok
    assert wait_event(env.ctx, key).ok
    assert len(env.gen.poll(np.int64(0), 1e-4)) == 0  # 1 ms, not 0
    assert len(env.gen.poll(0, 0)) == 0
    assert env.lo.with_first_head(U32 - 1).first_head == U32 - 1
    assert env.lo.offset(np.int64(1), 1, 2) == env.lo.offset(1, 1, 2)
    # the largest uint32_t reaches the daemon as it is, and it says why not
    with pytest.raises(kvxfer.InvalidArgument,
                       match="cannot hold num_tokens 4294967295"):
        env.ctx.publish(env.key(), env.src, [1], U32)
    with pytest.raises(kvxfer.InvalidArgument, match="at most 100000"):
        env.ctx.set_spin_us(U32)  # the library's own limit and message
    with kvxfer.Client(env.sock, timeout=None) as c:
        # a timeout well under a second passes the check (not 1 ms here:
        # a loaded CI machine may not answer that fast)
        assert isinstance(c.status(timeout=0.25), dict)
