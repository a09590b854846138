"""Fixtures for kvxfer.sglang: a real kvxferd, SGLang's own KVArgs and
ServerArgs (SGLang 0.5.23 from PyPI, scripts/test-sglang.sh), and KV
buffers laid out as SGLang's memory pools lay them, in host memory.

The daemon fixture is python/tests/conftest.py's Daemon (loaded from
there, not copied): $KVX_BUILD/kvxferd on a private socket.
"""

import contextlib
import importlib.util
import itertools
import os
import socket
import sys
import time
import urllib.request

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))  # the package in the tree

_spec = importlib.util.spec_from_file_location(
    "kvxfer_python_conftest", os.path.join(REPO, "python", "tests",
                                           "conftest.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
Daemon = _base.Daemon
pytest_runtest_makereport = _base.pytest_runtest_makereport

import kvxfer  # noqa: E402
from sglang.srt.disaggregation.base.conn import (  # noqa: E402
    KVArgs, KVPoll, StateType)
from sglang.srt.server_args import ServerArgs  # noqa: E402

# fetches that wait for a publish give up after this (the timeout test)
FETCH_TIMEOUT_MS = 1500


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("kvxferd"),
               f"deadlines:\n  fetch_timeout_ms: {FETCH_TIMEOUT_MS}\n")
    yield d
    rc = d.stop()
    assert rc == 0, f"kvxferd exited {rc}:\n{d.tail()}"


@pytest.fixture
def env(daemon, monkeypatch):
    """The backend's settings: this daemon's socket, short bootstrap
    retries, nothing left from the caller's environment."""
    for k in list(os.environ):
        if k.startswith("KVXFER_SGLANG_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("KVXFER_SGLANG_SOCKET", daemon.sock)
    monkeypatch.setenv("KVXFER_SGLANG_BOOTSTRAP_TIMEOUT", "2")
    return monkeypatch


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def bootstrap():
    """SGLang's bootstrap server as the prefill's main process starts it
    (KvxferKVBootstrapServer is its CommonKVBootstrapServer)."""
    from kvxfer.sglang import KvxferKVBootstrapServer
    srv = KvxferKVBootstrapServer("127.0.0.1", free_port())
    wait_health(srv.address)
    yield srv
    srv.close()


def wait_health(addr, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{addr}/health",
                                        timeout=1) as r:
                if r.read() == b"OK":
                    return
        except OSError:
            if time.monotonic() > end:
                raise
        time.sleep(0.02)


@contextlib.contextmanager
def parallel(tp, dp=1, rank=0, pp=1, pp_rank=0, lb="follow_bootstrap_room"):
    """SGLang's get_parallel() of a scheduler rank, stated with its own
    override (what publishing a rank bundle gives): tensor parallel
    ``tp``, attention DP ``dp`` (attention TP tp / dp), TP rank ``rank``
    placed by SGLang's derive_attention_ranks, and the load balance."""
    from sglang.srt.runtime_context import (derive_attention_ranks,
                                            get_parallel)
    attn_tp = tp // dp
    attn_tp_rank, attn_dp_rank = derive_attention_ranks(
        tp_rank=rank, attn_tp_size=attn_tp, attn_cp_size=1)
    with get_parallel().override(
            tp_size=tp, tp_rank=rank, attn_tp_size=attn_tp,
            attn_tp_rank=attn_tp_rank, attn_dp_size=dp,
            attn_dp_rank=attn_dp_rank, attn_cp_size=1, attn_cp_rank=0,
            pp_size=pp, pp_rank=pp_rank, dp_size=dp,
            dp_rank=attn_dp_rank if dp > 1 else None,
            load_balance_method=lb):
        yield


_ports = itertools.count(31000)


def server_args(bootstrap_port, tp_size=1, mode="prefill", **kw):
    """SGLang's ServerArgs as a scheduler rank holds them (a port of its
    own per instance: the decode instance's name derives from it)."""
    return ServerArgs(model_path="unused", tp_size=tp_size,
                      port=next(_ports),
                      disaggregation_bootstrap_port=bootstrap_port,
                      disaggregation_mode=mode, **kw)


AUX_ROWS = 8


class Rank:
    """One scheduler rank's KV pool and metadata buffers as SGLang lays
    them out: MHA, a K and a V buffer per layer of [token][head][dim]
    (one padding page more than the pool's pages), or MLA, one buffer per
    layer of [token][1][latent]; the KV in kvxfer.HostBuffers, the aux
    rows in plain numpy arrays, as MetadataBuffers keeps them on the CPU.
    ``args`` is SGLang's own KVArgs, filled as its prefill/decode queues
    fill it."""

    def __init__(self, *, engine_rank=0, layers=3, heads=2, total_heads=2,
                 head_dim=8, page=4, num_pages=16, mla=False, seed=0,
                 mamba_slots=0, swa_layers=0):
        self.layers, self.heads, self.page = layers, heads, page
        self.mla = mla
        tokens = (num_pages + 1) * page
        shape = (tokens, 1 if mla else heads, head_dim)
        nbuf = layers if mla else 2 * layers
        one = int(np.prod(shape)) * 2  # float16
        self.buf = kvxfer.HostBuffer(nbuf * one)
        bufs = [self.buf.numpy(np.float16, shape, offset=i * one)
                for i in range(nbuf)]
        rng = np.random.default_rng(seed)
        for b in bufs:
            b[:] = rng.standard_normal(shape).astype(np.float16)
        self.k = bufs[:layers]
        self.v = [] if mla else bufs[layers:]
        self.aux = [np.zeros((AUX_ROWS, 16), np.int32),     # output ids
                    np.zeros((AUX_ROWS, 16), np.float32),   # logprobs
                    np.zeros((AUX_ROWS, 8), np.uint64)]     # bootstrap room
        a = KVArgs()
        a.engine_rank = engine_rank
        a.kv_data_ptrs = [b.ctypes.data for b in bufs]
        a.kv_data_lens = [b.nbytes for b in bufs]
        a.kv_item_lens = [b[0].nbytes * page for b in bufs]
        a.kv_cache_dtype_str = "float16"
        a.aux_data_ptrs = [x.ctypes.data for x in self.aux]
        a.aux_data_lens = [x.nbytes for x in self.aux]
        a.aux_item_lens = [x[0].nbytes for x in self.aux]
        a.page_size = page
        if not mla:
            a.kv_head_num = heads
            a.total_kv_head_num = total_heads
        a.state_types = []
        self.state = []
        if mamba_slots:
            self._mamba(a, mamba_slots, rng)
        if swa_layers:
            self._swa(a, swa_layers, shape, rng)
        a.num_draft_entries = 0
        a.pp_rank = 0
        a.system_dp_rank = None
        a.prefill_start_layer = 0
        a.gpu_id = 0
        self.args = a

    MAMBA_ITEMS = (48, 48, 48, 96, 96, 96)  # conv, then temporal, per layer

    def _mamba(self, a, slots, rng):
        """A Mamba pool as SGLang's MambaPool lays it: per layer a conv and
        a temporal state tensor of ``slots`` slots (and one padding slot),
        StateType.MAMBA, in HostBuffers."""
        self.state_buf = kvxfer.HostBuffer(
            sum(self.MAMBA_ITEMS) * (slots + 1))
        off = 0
        for item in self.MAMBA_ITEMS:
            t = self.state_buf.numpy(np.uint8, (slots + 1, item), offset=off)
            t[:] = rng.integers(0, 256, t.shape, dtype=np.uint8)
            self.state.append(t)
            off += t.nbytes
        a.state_types = [StateType.MAMBA]
        a.state_data_ptrs = [[t.ctypes.data for t in self.state]]
        a.state_data_lens = [[t.nbytes for t in self.state]]
        a.state_item_lens = [[t[0].nbytes for t in self.state]]

    def _swa(self, a, layers, shape, rng):
        """A hybrid model's sliding-window layers: SWAKVPool's MHA
        sub-pool (K of every SWA layer, then V, NHD pages as the KV's),
        StateType.SWA."""
        one = int(np.prod(shape)) * 2
        self.swa_buf = kvxfer.HostBuffer(2 * layers * one)
        bufs = [self.swa_buf.numpy(np.float16, shape, offset=i * one)
                for i in range(2 * layers)]
        for b in bufs:
            b[:] = rng.standard_normal(shape).astype(np.float16)
        self.swa = bufs
        a.state_types = list(a.state_types) + [StateType.SWA]
        a.state_data_ptrs = list(getattr(a, "state_data_ptrs", [])) + \
            [[b.ctypes.data for b in bufs]]
        a.state_data_lens = list(getattr(a, "state_data_lens", [])) + \
            [[b.nbytes for b in bufs]]
        a.state_item_lens = list(getattr(a, "state_item_lens", [])) + \
            [[b[0].nbytes * self.page for b in bufs]]
        a.swa_kv_cache_layout = "nhd"

    def buffers(self):
        """(layer, kind, array) of every KV buffer."""
        out = [(i, "k", b) for i, b in enumerate(self.k)]
        return out + [(i, "v", b) for i, b in enumerate(self.v)]

    def page_tokens(self, buf, page):
        return buf[page * self.page:(page + 1) * self.page]

    def set_aux(self, row, room, first_token):
        """What MetadataBuffers.set_buf writes on the prefill's last
        chunk: the first output token, its logprob, the room."""
        self.aux[0][row, 0] = first_token
        self.aux[1][row, 0] = -0.25
        self.aux[2][row, 0] = room


def wait_poll(obj, want, timeout=10.0):
    """Poll a sender or receiver as the scheduler does, every step, until
    it reaches ``want`` (or a terminal state); returns the state."""
    end = time.monotonic() + timeout
    while True:
        st = obj.poll()
        if st == want or st in (KVPoll.Success, KVPoll.Failed):
            return st
        if time.monotonic() > end:
            return st
        time.sleep(0.005)
