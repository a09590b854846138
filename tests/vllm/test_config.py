"""kvxfer.vllm's configuration through vLLM's own classes: the roles of
vLLM's config line, kv_recompute_threshold, the ranks' daemon addresses
through vLLM's handshake metadata, and configurations refused at
__init__ naming the option."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.factory import \
    KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import \
    KVConnectorRole

import kvxfer
import kvxfer.vllm as kv_vllm

from harness import (KV_HEADS, LAYERS, landed, pattern, prefill,
                     prompt_of, reported, run, vllm_config, worker)


def test_producer_and_consumer_roles(engines):
    """kv_producer on the prefill, kv_consumer on the decode (the roles
    vLLM's P/D examples give): the KV moves, byte for byte, and each
    rank said Hello with the matching kvxfer role."""
    p = engines(role="kv_producer")
    d = engines(role="kv_consumer", layout="LBHNC")
    assert worker(p).client is not None
    prompt = prompt_of(40, 21)
    params = prefill(p, "req-r", prompt)
    d.add("req-r", prompt, 2, params)
    seen = {}

    def loaded():
        if landed(d, "req-r") and "kv" not in seen:
            seen["kv"] = d.kv_of("req-r", 39)
        return "req-r" in d.outputs
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(seen["kv"][layer],
                           pattern(prompt, 0, 39, layer, range(KV_HEADS)))
    assert kv_vllm.common._role("kv_producer") == kvxfer.Role.CONTEXT
    assert kv_vllm.common._role("kv_consumer") == kvxfer.Role.GENERATION


@pytest.mark.parametrize("key", ["kv_recompute_threshold",
                                 "recompute_below_tokens"])
def test_kv_recompute_threshold(engines, key):
    """vLLM's kv_recompute_threshold (the name its NIXL connector reads;
    recompute_below_tokens is this connector's old name for it): a
    decode missing 1 token of 33 computes it and releases the prefill's
    blocks, nothing is fetched; with the threshold at 1 it fetches."""
    p = engines()
    d = engines(extra={key: 16})
    d1 = engines(extra={key: 1})
    prompt = prompt_of(33, 22)
    for e in (d, d1):
        e.add("warm", prompt, 1)  # caches 32 of 33 tokens
        run([e], lambda: "warm" in e.outputs)
    p_free = p.free_blocks()
    params = prefill(p, "req-t", prompt)
    d.add("req-t", prompt, 2, params)
    run([p, d], lambda: "req-t" in d.outputs and p.free_blocks() == p_free)
    assert reported(d, "finished_recving", "req-t") == 0  # released
    params = prefill(p, "req-u", prompt)
    d1.add("req-u", prompt, 2, params)
    run([p, d1],
        lambda: "req-u" in d1.outputs and p.free_blocks() == p_free)
    assert reported(d1, "finished_recving", "req-u") == 1  # fetched


def test_addresses_through_vllm_handshake(engines):
    """Each worker gives its rank and daemon address as vLLM handshake
    metadata; vLLM's EngineCore merges them for the scheduler, which
    hands them to the workers; the ranks join with them (no
    torch.distributed gather, no "this node's daemon for every rank")."""
    p = engines(tp=2)
    for r in range(2):
        m = p.ranks[r]["conn"].get_handshake_metadata()
        assert isinstance(m, kv_vllm.common.KvxferHandshakeMetadata)
        assert (m.rank, m.address) == (r, worker(p, r).client
                                       .daemon_address)
    # not joined until the scheduler's first metadata brings the addresses
    assert not worker(p, 0)._joined and not worker(p, 1)._joined
    p.step()
    want = [worker(p, r).client.daemon_address for r in range(2)]
    for r in range(2):
        assert worker(p, r)._joined
        assert worker(p, r)._gathered == want


def test_addresses_missing_rank_logged(engines, caplog):
    """A handshake without every rank: logged naming the ranks missing;
    the ranks do not join (no silent fallback)."""
    p = engines(tp=2)
    p.sched.connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): p.ranks[0]["conn"].get_handshake_metadata()})
    assert "no daemon address from ranks [1] of 2" in caplog.text


def _make(model_dir: str, sock: str, side: KVConnectorRole, **kw: Any
          ) -> Any:
    extra = kw.pop("extra", None)
    vc = vllm_config(model_dir, sock, "cfg", extra=extra, **kw)
    return KVConnectorFactory.create_connector(vc, side, None)


@pytest.mark.parametrize("kw, message", [
    ({"extra": {"timeout_s": 0}},
     "kv_connector_extra_config.timeout_s: 0, expected seconds > 0"),
    ({"extra": {"timeout_s": "10"}},
     "kv_connector_extra_config.timeout_s: '10'"),
    ({"extra": {"kv_recompute_threshold": -1}},
     "kv_connector_extra_config.kv_recompute_threshold: -1, expected a "
     "token count"),
    ({"extra": {"kv_recompute_threshold": 8,
                "recompute_below_tokens": 16}},
     "kv_recompute_threshold 8 and recompute_below_tokens 16 differ"),
    ({"extra": {"rank_addresses": ["kvx://a/1"]}, "tp": 2},
     "rank_addresses: 1 addresses for 2 ranks"),
    ({"extra": {"rank_addresses": "kvx://a/1"}},
     "rank_addresses: expected a list of daemon addresses"),
    ({"tp": 8, "decode_context_parallel_size": 2},
     "parallel_config.decode_context_parallel_size: 2"),
])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER,
                                  KVConnectorRole.WORKER])
def test_refused_at_init(model_dir, daemon, kw, message, role):
    """Configurations the connector cannot serve are refused when vLLM
    makes the connector (KVConnectorFactory), scheduler and worker alike,
    naming the option, before any KV cache exists."""
    with pytest.raises(kvxfer.Error) as e:
        _make(model_dir, daemon.sock, role, **kw)
    assert message in str(e.value)


def test_good_config_accepted(model_dir, daemon):
    c = _make(model_dir, daemon.sock, KVConnectorRole.SCHEDULER,
              extra={"kv_recompute_threshold": 8,
                     "recompute_below_tokens": 8}, role="kv_producer")
    assert c._sched.recompute_below == 8
    c.shutdown()


PEER = """peer:
  listen: "127.0.0.1:0"
  secret_file: {secret}
"""


def test_ranks_on_two_daemons(engines, tmp_path):
    """A prefill whose two TP ranks run on two "nodes" (a daemon each,
    peers over UCX), with no torch.distributed: each rank joins with
    both daemons' addresses from vLLM's handshake (before, each took its
    own daemon for every rank, and nothing moved); the decode on the
    first node gets every head, rank 1's from the other daemon."""
    from conftest import Daemon
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    da = Daemon(tmp_path / "a", PEER.format(secret=secret))
    db = Daemon(tmp_path / "b", PEER.format(secret=secret))
    try:
        p = engines(tp=2, sock=da.sock, rank_socks=[da.sock, db.sock])
        d = engines(tp=1, sock=da.sock)
        a0 = worker(p, 0).client.daemon_address
        a1 = worker(p, 1).client.daemon_address
        assert a0 != a1
        prompt = prompt_of(40, 23)
        p_free = p.free_blocks()
        params = prefill(p, "req-n", prompt)
        for r in range(2):
            assert worker(p, r)._gathered == [a0, a1]
        d.add("req-n", prompt, 2, params)
        got = {}

        def loaded():
            if landed(d, "req-n") and not got:
                got["kv"] = d.kv_of("req-n", 39)
            return "req-n" in d.outputs and p.free_blocks() == p_free
        run([p, d], loaded, timeout=30)
        for layer in range(LAYERS):
            assert torch.equal(got["kv"][layer],
                               pattern(prompt, 0, 39, layer,
                                       range(KV_HEADS)))
    except BaseException:
        print("daemon A:\n" + da.tail(30) + "\ndaemon B:\n" +
              db.tail(30))
        raise
    finally:
        da.stop()
        db.stop()


@pytest.mark.parametrize("field, value, message", [
    ("head_size_v", 16, "kv_cache_groups[0] (FullAttentionSpec)"
     ".head_size_v: 16, head_size 32"),
    ("state_content_bytes", 100, "kv_cache_groups[0] (FullAttentionSpec)"
     ".state_content_bytes: 100"),
])
def test_pages_refused_at_init(model_dir, daemon, field, value, message):
    """A KV cache page the connector cannot describe (K and V of other
    sizes, a packed page) is refused when vLLM makes the connector, from
    its KVCacheConfig, not at register_kv_caches."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec,
                                            KVCacheConfig, KVCacheGroupSpec)
    from harness import BLOCK, HEAD
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS,
                             head_size=HEAD, dtype=torch.float32,
                             **{field: value})
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    vc = vllm_config(model_dir, daemon.sock, "cfg-page")
    for side in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(kvxfer.Unsupported) as e:
            KVConnectorFactory.create_connector(vc, side, kcc)
        assert message in str(e.value)


def _moves(p: Any, d: Any, rid: str, seed: int) -> None:
    """A request prefilled on p (TP 2) gets params and its decode on d
    every byte of both ranks' heads."""
    prompt = prompt_of(40, seed)
    params = prefill(p, rid, prompt)
    d.add(rid, prompt, 2, params)
    seen = {}

    def loaded():
        if landed(d, rid) and "kv" not in seen:
            seen["kv"] = d.kv_of(rid, 39)
        return rid in d.outputs
    run([p, d], loaded)
    for layer in range(LAYERS):
        assert torch.equal(seen["kv"][layer],
                           pattern(prompt, 0, 39, layer, range(KV_HEADS)))


@pytest.mark.parametrize("reconnect", ["1", "0"])
def test_join_after_restart_before_first_step(engines, own_daemon,
                                              monkeypatch, reconnect):
    """kvxferd restarted (a new address) after vLLM's handshake gathered
    the ranks' addresses and before the first step: the ranks join with
    the new daemon's address where the handshake named the old one (the
    old one is refused: not this daemon), and the prefill's requests get
    params and move."""
    monkeypatch.setenv("KVXFER_RECONNECT", reconnect)
    p = engines(tp=2, sock=own_daemon.sock)
    d = engines(sock=own_daemon.sock)
    own_daemon.kill9()
    own_daemon.start()
    d.step()
    _moves(p, d, "req-j1", 41)
    assert all(worker(p, r)._joined for r in range(2))
    _moves(p, d, "req-j2", 42)


def test_join_retried_after_daemon_gone(engines, own_daemon):
    """The daemon gone when the first step's metadata brings the
    addresses: the join fails, and is made again at the next steps, once
    a daemon is back (else the instance never joins: every reservation
    refused, no request moves)."""
    p = engines(tp=2, sock=own_daemon.sock)
    d = engines(sock=own_daemon.sock)
    own_daemon.kill9()
    p.add("req-jg", prompt_of(20, 43), 1, {"do_remote_decode": True})
    run([p], lambda: "req-jg" in p.outputs)
    assert p.outputs["req-jg"].kv_transfer_params is None
    own_daemon.start()
    d.step()
    _moves(p, d, "req-j3", 44)


def test_rejoin_after_restart_reconnection_off(engines, own_daemon,
                                               monkeypatch):
    """Joined, then kvxferd restarted with the library's reconnection
    off: each worker makes its client again and joins with the new
    daemon's address in place of the old (the old is refused)."""
    monkeypatch.setenv("KVXFER_RECONNECT", "0")
    p = engines(tp=2, sock=own_daemon.sock)
    d = engines(sock=own_daemon.sock)
    _moves(p, d, "req-j4", 45)
    own_daemon.kill9()
    own_daemon.start()
    for _ in range(2):  # the clients find the daemon gone, and are made
        p.step()        # again (a request finishing then has no params)
        d.step()
    assert all(worker(p, r)._joined for r in range(2))
    _moves(p, d, "req-j5", 46)
