"""kvxfer.trtllm.KvxferTransceiver driven as TensorRT-LLM's executor
drives a KvCacheTransceiver (its DisaggTransferCoordinator's calls),
against the stand-in TensorRT-LLM (standin.py) and a real kvxferd. The
bytes the generation instance holds are checked against what the context
instance's prefill wrote."""

import base64
import logging

import pytest
import torch

import kvxfer
import standin as s
from harness import HEAD_DIM, HEADS, LAYERS, sent, settled, states
from standin import LlmRequestState as St

import kvxfer.trtllm as kt


def model_kv(n: int, seed: int) -> torch.Tensor:
    """Random fp16 bits for n tokens: [layers, kv, heads, tokens, dim]."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-32768, 32767, (LAYERS, 2, HEADS, n, HEAD_DIM),
                         dtype=torch.int16, generator=g)
    bits[bits == 0] = 1  # nonzero: a byte not written shows as 0
    return bits.view(torch.float16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def prefill(ctx, rid, n, seed=None):
    """A finished prefill on every context rank, sent: its requests and
    the KV it wrote."""
    reqs = ctx.context_requests(rid, n)
    full = model_kv(n, rid if seed is None else seed)
    ctx.write(reqs, full)
    ctx.send(reqs)
    return reqs, full


@pytest.mark.parametrize("ctx_par,gen_par", [
    ((1, 1), (1, 1)), ((2, 1), (2, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)),
    ((1, 2), (2, 1)), ((2, 2), (1, 2))],
    ids=["tp1-tp1", "tp2-tp2", "tp2-tp1", "tp1-tp2", "pp2-tp2", "tp2pp2-pp2"])
def test_context_to_generation_bytes(instances, ctx_par, gen_par):
    """A context instance's prefill lands in the generation instance's
    blocks, byte for byte, across TP and PP; the states follow the ABC's
    postconditions; no other block is written."""
    ctx, gen = instances(*ctx_par), instances(*gen_par, extra_tokens=16)
    creqs, full = prefill(ctx, 101, 37)  # 5 blocks, the last partly
    assert states(creqs) == [St.DISAGG_CONTEXT_TRANS_IN_PROGRESS] * \
        len(creqs)
    ep = creqs[0].context_phase_params.disagg_info_endpoint
    assert ep.startswith(kt.ENDPOINT_PREFIX)
    # every context rank hands out the same params
    assert {r.context_phase_params.disagg_info_endpoint for r in creqs} == \
        {ep}
    assert creqs[0].context_phase_params.req_id == 101
    greqs = gen.generation_requests(501, creqs[0])
    gen.receive(greqs)
    assert states(greqs) == [St.DISAGG_GENERATION_TRANS_IN_PROGRESS] * \
        len(greqs)
    assert all(t.has_inflight_transfer(r) for t, r in zip(gen.ranks, greqs))
    got = gen.until(gen.gen_status, settled(greqs))
    assert states(greqs) == [St.DISAGG_GENERATION_TRANS_COMPLETE] * \
        len(greqs)
    assert got["completed_request_ids"] == [[501]] * len(greqs)
    assert got["error_request_ids"] == [[]] * len(greqs)
    assert all(t.check_gen_transfer_complete() for t in gen.ranks)
    assert same(gen.read(greqs, 37), full)
    tables = [gen.kvms[0].get_cache_indices(greqs[0])]
    assert gen.untouched(tables)
    # the context side: complete once the generation side took it
    done = ctx.until(lambda: ctx.ctx_status(0, mark_complete=True),
                     settled(creqs))
    assert done["completed_request_ids"] == [[101]] * len(creqs)
    assert states(creqs) == [St.DISAGG_CONTEXT_COMPLETE] * len(creqs)
    assert not any(t.has_inflight_transfer(r)
                   for t, r in zip(ctx.ranks, creqs))


def test_blocking_polls_and_sync_receive(instances):
    """at_least N > 0 waits for the events (bounded), None drains a side;
    request_and_receive_sync settles the request before it returns."""
    ctx, gen = instances(), instances()
    creqs, full = prefill(ctx, 102, 20)
    greqs = gen.generation_requests(502, creqs[0])
    gen.ranks[0].request_and_receive_sync(greqs[0])
    assert greqs[0].state == St.DISAGG_GENERATION_TRANS_COMPLETE
    assert same(gen.read(greqs, 20), full)
    # reported once: the sync call settled it
    assert gen.gen_status(0)[0].completed_request_ids == []
    st = ctx.ranks[0].check_context_transfer_status(None)
    assert st.completed_request_ids == [102]
    assert creqs[0].state == St.DISAGG_CONTEXT_TRANS_IN_PROGRESS
    # N > 0 with nothing in flight returns at once, empty
    assert ctx.ranks[0].check_context_transfer_status(1) == ([], [])
    creqs, full = prefill(ctx, 103, 9)
    greqs = gen.generation_requests(503, creqs[0])
    gen.receive(greqs)
    got = gen.until(lambda: gen.gen_status(1), settled(greqs))
    assert got["completed_request_ids"] == [[503]]
    assert same(gen.read(greqs, 9), full)


def test_disagg_request_id_names_both(instances):
    """With a disagg_request_id both sides track the request by it."""
    ctx, gen = instances(), instances()
    creqs = ctx.context_requests(7, 16, disagg_request_id=9001)
    ctx.write(creqs, model_kv(16, 7))
    ctx.send(creqs)
    assert creqs[0].context_phase_params.req_id == 9001
    greqs = gen.generation_requests(8, creqs[0], disagg_request_id=9002)
    gen.receive(greqs)
    got = gen.until(gen.gen_status, settled(greqs))
    assert got["completed_request_ids"] == [[9002]]
    got = ctx.until(ctx.ctx_status, lambda: not ctx.ranks[0]._send)
    assert got["completed_request_ids"] == [[9001]]


def test_generation_cancel(instances):
    """A generation request cancelled while it moves: cancel_request is
    True, the request is forgotten (no status reports it); the context
    side's send ends once, reported (the generation side gave it up)."""
    ctx, gen = instances(), instances()
    creqs, full = prefill(ctx, 104, 24)
    greqs = gen.generation_requests(504, creqs[0])
    gen.receive(greqs)
    t = gen.ranks[0]
    assert t.cancel_request(greqs[0]) is True
    assert not t.has_inflight_transfer(greqs[0])
    assert t.check_gen_transfer_complete()
    got = gen.until(gen.gen_status, lambda: True)
    assert got == {"completed_request_ids": [[]], "error_request_ids": [[]],
                   "cancelled_requests": [[]]}
    # cancelling again, or a request never seen, is True too
    assert t.cancel_request(greqs[0]) is True
    assert t.cancel_request(s.LlmRequest(999, 8)) is True
    got = ctx.until(ctx.ctx_status, sent(ctx, creqs))
    assert got["completed_request_ids"] + got["error_request_ids"] in \
        ([[104], []], [[], [104]])


def test_context_cancel_ends_the_generation(instances):
    """The context side cancels its send (the executor's timeout path):
    True, not reported by its status calls (the caller's bookkeeping);
    a generation request that then asks is reported cancelled by the
    context side, its state left to the caller (the ABC's rule), and no
    byte lands."""
    ctx, gen = instances(), instances()
    creqs, _ = prefill(ctx, 105, 24)
    assert ctx.ranks[0].cancel_request(creqs[0]) is True
    assert not ctx.ranks[0].has_inflight_transfer(creqs[0])
    got = ctx.until(ctx.ctx_status, lambda: True)
    assert got == {"completed_request_ids": [[]],
                   "error_request_ids": [[]]}
    greqs = gen.generation_requests(506, creqs[0])
    gen.receive(greqs)
    got = gen.until(gen.gen_status, sent(gen, greqs))
    assert got["cancelled_requests"] == [[greqs[0]]]
    assert got["completed_request_ids"] == [[]]
    assert greqs[0].state == St.DISAGG_GENERATION_TRANS_IN_PROGRESS
    assert gen.untouched([])


def test_context_death_is_an_error_state(instances, caplog):
    """The context instance dies after handing out params: the
    generation request ends in DISAGG_TRANS_ERROR, no exception."""
    ctx, gen = instances(2), instances(2)
    creqs, _ = prefill(ctx, 106, 30)
    ctx.close()  # its ranks leave: the daemon ends its offers
    greqs = gen.generation_requests(507, creqs[0])
    with caplog.at_level(logging.WARNING, "kvxfer.trtllm"):
        gen.receive(greqs)
        got = gen.until(gen.gen_status, settled(greqs))
    assert states(greqs) == [St.DISAGG_TRANS_ERROR] * 2
    assert got["error_request_ids"] == [[507]] * 2
    assert gen.untouched([])
    # the closed context side answers its calls without raising
    assert ctx.ranks[0].check_context_transfer_status(0) == ([], [])
    assert ctx.ranks[0].cancel_request(creqs[0]) is True


def test_generation_death_fails_the_send(instances):
    """The generation instance dies while it fetches: the context side
    reports the send failed (DISAGG_TRANS_ERROR) or complete (when the
    copy finished first), never hangs."""
    ctx, gen = instances(), instances()
    creqs, _ = prefill(ctx, 107, 40)
    greqs = gen.generation_requests(508, creqs[0])
    gen.receive(greqs)
    gen.close()
    got = ctx.until(ctx.ctx_status, sent(ctx, creqs))
    assert got["completed_request_ids"] + got["error_request_ids"] in \
        ([[107], []], [[], [107]])
    if got["error_request_ids"] == [[107]]:
        assert creqs[0].state == St.DISAGG_TRANS_ERROR


def test_params_that_are_not_kvxfers(instances):
    """A generation request without kvxfer params (another transceiver's
    endpoint, none, or bad base64): DISAGG_TRANS_ERROR and an error id,
    a log line naming the field, no exception."""
    gen = instances()
    reqs = []
    for rid, ep in ((601, None), (602, "tcp://10.0.0.1:5000"),
                    (603, kt.ENDPOINT_PREFIX + "not base64!")):
        r = s.LlmRequest(rid, 16, s.DisaggregatedParams(
            request_type="generation_only", ctx_request_id=1,
            ctx_info_endpoint=ep))
        gen.ranks[0].request_and_receive_async(r)
        assert r.state == St.DISAGG_TRANS_ERROR
        reqs.append(r)
    st = gen.ranks[0].check_gen_transfer_status(0)
    assert st.error_request_ids == [601, 602, 603]
    with pytest.raises(kvxfer.InvalidArgument, match="ctx_info_endpoint"):
        kt.params_of(reqs[1])
    # well-formed base64 of bytes that are not params: the daemon refuses
    r = s.LlmRequest(604, 16, s.DisaggregatedParams(
        request_type="generation_only", ctx_request_id=1,
        ctx_info_endpoint=kt.ENDPOINT_PREFIX +
        base64.b64encode(b"\x00" * 64).decode()))
    gen.ranks[0].request_and_receive_async(r)
    assert r.state == St.DISAGG_TRANS_ERROR
    assert gen.ranks[0].check_gen_transfer_status(0).error_request_ids == \
        [604]


def test_daemon_restart(instances, own_daemon):
    """kvxferd killed under both instances: the send in flight fails
    (DISAGG_TRANS_ERROR, reported), calls while it is gone fail requests
    without raising, and after a restart on the same socket the next
    request moves every byte."""
    d = own_daemon
    ctx, gen = instances(2, sock=d.sock), instances(sock=d.sock)
    creqs, full = prefill(ctx, 110, 24)
    greqs = gen.generation_requests(510, creqs[0])
    gen.receive(greqs)
    gen.until(gen.gen_status, settled(greqs))
    assert greqs[0].state == St.DISAGG_GENERATION_TRANS_COMPLETE
    ctx.until(ctx.ctx_status, sent(ctx, creqs))
    # a send in flight when the daemon dies
    creqs, _ = prefill(ctx, 111, 24)
    d.kill9()
    got = ctx.until(ctx.ctx_status, settled(creqs))
    assert got["error_request_ids"] == [[111], [111]]
    assert states(creqs) == [St.DISAGG_TRANS_ERROR] * 2
    # while it is gone: a send and a receive fail, nothing raises
    creqs, _ = prefill(ctx, 112, 8)
    assert states(creqs) == [St.DISAGG_TRANS_ERROR] * 2
    assert [st.error_request_ids for st in ctx.ctx_status(0)] == \
        [[112], [112]]
    g = gen.generation_requests(512, creqs[0])
    g[0].py_disaggregated_params.ctx_info_endpoint = \
        greqs[0].py_disaggregated_params.ctx_info_endpoint
    gen.receive(g)
    assert g[0].state == St.DISAGG_TRANS_ERROR
    assert gen.gen_status(0)[0].error_request_ids == [512]
    d.start()
    # an executor iteration's status calls: every rank is back (a publish
    # before its peers are is refused: the instance is not complete)
    ctx.ctx_status(0)
    gen.gen_status(0)
    creqs, full = prefill(ctx, 113, 33)
    assert states(creqs) == [St.DISAGG_CONTEXT_TRANS_IN_PROGRESS] * 2, \
        "the send after the restart was refused"
    greqs = gen.generation_requests(513, creqs[0])
    gen.receive(greqs)
    gen.until(gen.gen_status, settled(greqs))
    assert greqs[0].state == St.DISAGG_GENERATION_TRANS_COMPLETE
    assert same(gen.read(greqs, 33), full)


def test_install_replaces_the_factory(daemon):
    """install() makes TensorRT-LLM's factory (and the executor creator's
    name for it) build KvxferTransceiver; a config without a backend
    still turns transfers off."""
    import tensorrt_llm._torch.disaggregation.kv_cache_transceiver as m
    import tensorrt_llm._torch.pyexecutor.py_executor_creator as pc
    kt.install()
    kt.install()  # idempotent
    assert m.create_kv_cache_transceiver is pc.create_kv_cache_transceiver
    mp = s.Mapping()
    kvm = s.KVCacheManager(mp, s.BlockAllocator(8, 0), num_layers=LAYERS,
                           num_kv_heads=HEADS, head_dim=HEAD_DIM,
                           tokens_per_block=8, num_blocks=8)
    dist = s.Distributed(mp, s._Exchange(1))
    assert pc.create_kv_cache_transceiver(
        mp, dist, kvm, None, s.CacheTransceiverConfig()) is None
    import os
    os.environ["KVXFER_SOCKET"] = daemon.sock
    try:
        t = pc.create_kv_cache_transceiver(
            mp, dist, kvm, None, s.CacheTransceiverConfig(backend="UCX"))
    finally:
        del os.environ["KVXFER_SOCKET"]
    try:
        assert isinstance(t, kt.KvxferTransceiver)
        assert isinstance(t, s.KvCacheTransceiver)
        assert t.kv_transfer_timeout_ms == 60000
        ep = t.get_disaggregated_params()["ctx_info_endpoint"]
        assert ep[0].startswith(kt.BY_KEY_PREFIX)
        assert t.supports_inflight_request_cancellation() is False
    finally:
        t.shutdown()


def test_no_daemon_is_a_clear_error(tmp_path):
    """Built where no kvxferd listens: the constructor raises kvxfer's
    error naming the socket (the executor does not start)."""
    mp = s.Mapping()
    kvm = s.KVCacheManager(mp, s.BlockAllocator(8, 0), num_layers=LAYERS,
                           num_kv_heads=HEADS, head_dim=HEAD_DIM,
                           tokens_per_block=8, num_blocks=8)
    sock = str(tmp_path / "nobody.sock")
    with pytest.raises(kvxfer.Error, match="nobody.sock"):
        kt.KvxferTransceiver(mp, s.Distributed(mp, s._Exchange(1)), kvm,
                             s.CacheTransceiverConfig(backend="UCX"),
                             socket=sock, timeout=1.0)


def test_one_rank_refused(instances):
    """One context rank's publish is refused (a block id outside its
    pool) while the other's is taken: the refusing rank cancels the key,
    so both ranks report the send failed, in the same status call, and a
    generation request for it is reported cancelled by the context
    side."""
    ctx, gen = instances(2), instances(2)
    creqs = ctx.context_requests(120, 24)
    ctx.write(creqs, model_kv(24, 120))
    real = ctx.kvms[1].get_cache_indices
    ctx.kvms[1].get_cache_indices = lambda req, w=None: [999] + real(req)[1:]
    ctx.send(creqs)
    assert states(creqs) == [St.DISAGG_CONTEXT_TRANS_IN_PROGRESS,
                             St.DISAGG_TRANS_ERROR]
    first = ctx.ctx_status(0)
    assert [st.error_request_ids for st in first] == [[120], [120]]
    assert states(creqs) == [St.DISAGG_TRANS_ERROR] * 2
    assert not any(t.has_inflight_transfer(r)
                   for t, r in zip(ctx.ranks, creqs))
    greqs = gen.generation_requests(520, creqs[0])
    gen.receive(greqs)
    got = gen.until(gen.gen_status, sent(gen, greqs))
    assert got["cancelled_requests"] == [[greqs[0]], [greqs[1]]]
    assert gen.untouched([])


def test_context_process_killed(instances, daemon):
    """The context instance's process is killed (SIGKILL) after handing
    out params: the generation request ends in DISAGG_TRANS_ERROR, no
    exception, no byte lands."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    gen = instances(2)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(here, "context_process.py"),
         daemon.sock, "trtllm-ctx-killed", "2", "130", "30"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ep = proc.stdout.readline().strip()
        assert ep.startswith(kt.ENDPOINT_PREFIX), ep
    finally:
        proc.kill()
        proc.wait()
    ctx_req = s.LlmRequest(130, 30, context_only=True)
    ctx_req.context_phase_params = s.ContextPhaseParams(
        [], 130, None, None, 0, ep)
    greqs = gen.generation_requests(530, ctx_req)
    gen.receive(greqs)
    got = gen.until(gen.gen_status, settled(greqs))
    assert states(greqs) == [St.DISAGG_TRANS_ERROR] * 2
    assert got["error_request_ids"] == [[530]] * 2
    assert gen.untouched([])


def test_attention_dp_generation(instances):
    """A generation instance under attention DP (tp 2, each rank its own
    requests, every head): each rank fetches its request with its
    dp_rank; the other rank's events pass it by."""
    ctx, gen = instances(2), instances(2, attention_dp=True)
    assert all(t.role == kvxfer.Role.GENERATION for t in gen.ranks)
    a, full_a = prefill(ctx, 140, 20)
    b, full_b = prefill(ctx, 141, 28)
    ga = gen.generation_requests(540, a[0])[0]
    gb = gen.generation_requests(541, b[0])[0]
    gen.ranks[0].request_and_receive_async(ga)
    gen.ranks[1].request_and_receive_async(gb)
    got = gen.until(gen.gen_status, settled([ga, gb]))
    assert got["completed_request_ids"] == [[540], [541]]
    assert same(gen.read([ga], 20, [0]), full_a)
    assert same(gen.read([gb], 28, [1]), full_b)
    # a context (or both) instance under attention DP is refused
    with pytest.raises(kvxfer.Unsupported, match="attention DP"):
        instances(2, attention_dp=True, role="both")


def test_daemon_restart_reconnection_off(instances, own_daemon,
                                         monkeypatch):
    """With the library's reconnection off (KVXFER_RECONNECT=0) a lost
    daemon closes the clients: the transfers in flight fail at once, and
    the transceiver connects again by itself once a daemon listens (a new
    client, the pool registered again), without a collective."""
    monkeypatch.setenv("KVXFER_RECONNECT", "0")
    d = own_daemon
    ctx, gen = instances(2, sock=d.sock), instances(sock=d.sock)
    creqs, _ = prefill(ctx, 150, 16)
    d.kill9()
    got = ctx.until(ctx.ctx_status, settled(creqs))
    assert got["error_request_ids"] == [[150], [150]]
    assert all(t.client is None for t in ctx.ranks)
    creqs, _ = prefill(ctx, 151, 16)  # nobody listens: fails, no raise
    assert states(creqs) == [St.DISAGG_TRANS_ERROR] * 2
    d.start()
    # an executor iteration's status calls: every rank connects again
    ctx.ctx_status(0)
    old = [id(t) for t in ctx.ranks]
    creqs, full = prefill(ctx, 152, 40)
    assert states(creqs) == [St.DISAGG_CONTEXT_TRANS_IN_PROGRESS] * 2, \
        "the send after the restart was refused"
    assert [id(t) for t in ctx.ranks] == old
    greqs = gen.generation_requests(552, creqs[0])
    gen.receive(greqs)
    gen.until(gen.gen_status, settled(greqs))
    assert greqs[0].state == St.DISAGG_GENERATION_TRANS_COMPLETE
    assert same(gen.read(greqs, 40), full)


def generation_first(rid, n, ep):
    return s.LlmRequest(rid, n, s.DisaggregatedParams(
        request_type="generation_only", disagg_request_id=rid,
        schedule_style=s.DisaggScheduleStyle.GENERATION_FIRST,
        ctx_info_endpoint=ep, ctx_dp_rank=0))


def test_generation_first(instances):
    """Generation-first: the generation request (its id shared with the
    context side, the context instance's get_disaggregated_params as its
    endpoint) fetches by key before the prefill; the context request is
    schedulable at once, publishes with its first and draft tokens, and
    the generation side gets the KV, byte for byte, and those tokens."""
    ctx, gen = instances(2), instances()
    ep = ctx.ranks[0].get_disaggregated_params()
    assert [t.get_disaggregated_params() for t in ctx.ranks] == [ep] * 2
    assert ep["ctx_dp_rank"] == 0
    greqs = [generation_first(9100, 30, ep["ctx_info_endpoint"])]
    gen.receive(greqs)
    assert greqs[0].state == St.DISAGG_GENERATION_TRANS_IN_PROGRESS
    assert gen.gen_status(0)[0].completed_request_ids == []
    creqs = ctx.context_requests(
        9100, 30, disagg_request_id=9100,
        schedule_style=s.DisaggScheduleStyle.GENERATION_FIRST)
    for t, r in zip(ctx.ranks, creqs):
        r.state = St.DISAGG_CONTEXT_WAIT_SCHEDULER
        t.prepare_context_requests([r])
        r.last_tokens, r.py_draft_tokens = [4242], [7, 8]
    assert states(creqs) == [St.CONTEXT_INIT] * 2
    full = model_kv(30, 9100)
    ctx.write(creqs, full)
    ctx.send(creqs)
    got = gen.until(gen.gen_status, settled(greqs))
    assert got["completed_request_ids"] == [[9100]]
    assert greqs[0].state == St.DISAGG_GENERATION_TRANS_COMPLETE
    assert same(gen.read(greqs, 30), full)
    assert greqs[0].py_first_gen_tokens == [4242]
    assert greqs[0].py_draft_tokens == [7, 8]
    assert greqs[0].context_phase_params.first_gen_tokens == [4242]
    assert greqs[0].context_phase_params.draft_tokens == [7, 8]
    got = ctx.until(lambda: ctx.ctx_status(0, mark_complete=True),
                    settled(creqs))
    assert got["completed_request_ids"] == [[9100], [9100]]


def test_generation_first_cancelled_before_the_prefill(instances):
    """A generation-first request cancelled while it waits for the
    prefill: True, forgotten, and no byte lands when the context side
    publishes later."""
    ctx, gen = instances(), instances()
    ep = ctx.ranks[0].get_disaggregated_params()["ctx_info_endpoint"]
    greqs = [generation_first(9200, 16, ep)]
    gen.receive(greqs)
    assert gen.ranks[0].cancel_request(greqs[0]) is True
    assert gen.ranks[0].check_gen_transfer_complete()
    creqs = ctx.context_requests(
        9200, 16, disagg_request_id=9200,
        schedule_style=s.DisaggScheduleStyle.GENERATION_FIRST)
    ctx.write(creqs, model_kv(16, 9200))
    ctx.send(creqs)
    assert creqs[0].state == St.DISAGG_CONTEXT_TRANS_IN_PROGRESS
    got = gen.until(gen.gen_status, lambda: True)
    assert got["completed_request_ids"] == [[]]
    ctx.ctx_status(0)
    assert gen.untouched([])


def test_generation_first_endpoint_errors(instances):
    """A by-key endpoint without a shared id, or malformed: the request
    fails with DISAGG_TRANS_ERROR, no exception."""
    gen = instances()
    bad = s.LlmRequest(9300, 16, s.DisaggregatedParams(
        request_type="generation_only",
        schedule_style=s.DisaggScheduleStyle.GENERATION_FIRST,
        ctx_info_endpoint=[kt.BY_KEY_PREFIX + "inst@kvx://x/1"]))
    gen.ranks[0].request_and_receive_async(bad)
    assert bad.state == St.DISAGG_TRANS_ERROR
    with pytest.raises(kvxfer.InvalidArgument, match="disagg_request_id"):
        kt.source_of(bad)
    odd = generation_first(9301, 16, kt.BY_KEY_PREFIX + "no-address")
    gen.ranks[0].request_and_receive_async(odd)
    assert odd.state == St.DISAGG_TRANS_ERROR
    assert gen.ranks[0].check_gen_transfer_status(0).error_request_ids == \
        [9300, 9301]
