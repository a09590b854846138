"""What streaming a chunked prefill's pages saves: kvxfer.sglang's
sender and receiver on a real kvxferd (host pools), a prompt prefilled
in CHUNKS chunks with FORWARD seconds of (simulated) compute each; the
time from the last chunk's send() to the decode's Success, with
KVXFER_SGLANG_STREAM=0 (the baseline: every page moves after the last
chunk) and =1 (each chunk moves during the next one's compute), in the
same run, and their ratio. Every byte is checked.

    build/venv-sglang/bin/python scripts/bench-sglang-stream.py [BUILD]
"""

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1
                        else os.path.join(REPO, "build"))
os.environ.setdefault("KVXFER_LIB", os.path.join(BUILD, "libkvxfer.so.2"))
sys.path.insert(0, os.path.join(REPO, "python"))

import kvxfer  # noqa: E402
from kvxfer.sglang import (KvxferKVBootstrapServer, KvxferKVManager,  # noqa
                           KvxferKVReceiver, KvxferKVSender)
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
CHUNKS, CHUNK_PAGES, FORWARD, ROUNDS = 4, 64, 0.15, 5
PAGES = CHUNKS * CHUNK_PAGES  # 4096 tokens, 256 MiB of KV per side


class Side:
    """One rank's KV (K and V per layer, [token][head][dim] fp16) in a
    HostBuffer, as SGLang's MHA pool lays it, and its KVArgs."""

    def __init__(self, seed):
        shape = ((PAGES + 1) * PAGE, HEADS, HEAD_DIM)
        one = int(np.prod(shape)) * 2
        self.buf = kvxfer.HostBuffer(2 * LAYERS * one)
        self.kv = [self.buf.numpy(np.float16, shape, offset=i * one)
                   for i in range(2 * LAYERS)]
        rng = np.random.default_rng(seed)
        for b in self.kv:
            b[:] = rng.standard_normal(shape).astype(np.float16)
        self.aux = [np.zeros((4, 8), np.int64)]
        a = KVArgs()
        a.engine_rank, a.page_size, a.pp_rank = 0, PAGE, 0
        a.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        a.kv_data_lens = [b.nbytes for b in self.kv]
        a.kv_item_lens = [b[0].nbytes * PAGE for b in self.kv]
        a.kv_cache_dtype_str = "float16"
        a.kv_head_num = a.total_kv_head_num = HEADS
        a.aux_data_ptrs = [x.ctypes.data for x in self.aux]
        a.aux_data_lens = [x.nbytes for x in self.aux]
        a.aux_item_lens = [x[0].nbytes for x in self.aux]
        a.state_types, a.num_draft_entries = [], 0
        a.system_dp_rank = None
        self.args = a


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(obj, timeout=60.0):
    end = time.monotonic() + timeout
    while True:
        st = obj.poll()
        if st in (KVPoll.Success, KVPoll.Failed):
            return st
        if time.monotonic() > end:
            raise SystemExit("timed out")
        time.sleep(0.0005)


def one_room(pm, dm, boot, src, dst, room):
    """A prefill in CHUNKS chunks, the decode fetching from the start;
    returns seconds from the last send() to the decode's Success."""
    rng = np.random.default_rng(room)
    sp = [int(x) for x in rng.permutation(PAGES)]
    dp = [int(x) for x in rng.permutation(PAGES)]
    r = KvxferKVReceiver(dm, boot.address, room)
    assert dm.try_ensure_parallel_info(boot.address)
    r.init(0)
    assert r.poll() == KVPoll.WaitingForInput, r._reason
    r.send_metadata(np.asarray(dp, np.int32), 0, [])
    s = KvxferKVSender(pm, boot.address, room)
    s.init(PAGES, 0)
    src.aux[0][0, 0] = room
    for k in range(CHUNKS):
        time.sleep(FORWARD)  # the chunk's forward
        t = time.perf_counter()
        s.send(np.asarray(sp[k * CHUNK_PAGES:(k + 1) * CHUNK_PAGES],
                          np.int32), [] if k == CHUNKS - 1 else None,
               num_kv_tokens=CHUNK_PAGES * PAGE)
    if wait(r) != KVPoll.Success:
        raise SystemExit(f"room {room}: {r._reason}")
    took = time.perf_counter() - t
    assert wait(s) == KVPoll.Success, s._reason
    for a, b in zip(src.kv, dst.kv):
        pa = a.reshape(PAGES + 1, PAGE, HEADS, HEAD_DIM)
        pb = b.reshape(PAGES + 1, PAGE, HEADS, HEAD_DIM)
        assert np.array_equal(pb[dp], pa[sp]), "bytes differ"
    assert dst.aux[0][0, 0] == room
    r.clear()
    s.clear()
    return took


def main():
    tmp = tempfile.mkdtemp(prefix="kvxfer-bench-sglang-")
    sock = os.path.join(tmp, "kvxferd.sock")
    cfg = os.path.join(tmp, "kvxferd.yaml")
    with open(cfg, "w") as f:
        f.write(f"socket:\n  path: {sock}\n")
    log = open(os.path.join(tmp, "kvxferd.log"), "wb")
    daemon = subprocess.Popen([os.path.join(BUILD, "kvxferd"), "--config",
                               cfg], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(500):
            try:
                kvxfer.Client(sock, timeout=0.2).close()
                break
            except kvxfer.Error:
                time.sleep(0.02)
        os.environ["KVXFER_SGLANG_SOCKET"] = sock
        boot = KvxferKVBootstrapServer("127.0.0.1", free_port())
        src, dst = Side(1), Side(2)
        results = {}
        room = 1000
        for stream in ("0", "1"):
            os.environ["KVXFER_SGLANG_STREAM"] = stream
            bp = boot.port
            pm = KvxferKVManager(src.args, "prefill", ServerArgs(
                model_path="x", port=free_port(),
                disaggregation_bootstrap_port=bp,
                disaggregation_mode="prefill"), False)
            dm = KvxferKVManager(dst.args, "decode", ServerArgs(
                model_path="x", port=free_port(),
                disaggregation_bootstrap_port=bp,
                disaggregation_mode="decode"), False)
            times = []
            for _ in range(ROUNDS):
                room += 1
                times.append(one_room(pm, dm, boot, src, dst, room))
            results[stream] = statistics.median(times)
            pm.close()
            dm.close()
        mib = 2 * LAYERS * PAGES * PAGE * HEADS * HEAD_DIM * 2 / 2 ** 20
        print(f"prompt {PAGES * PAGE} tokens ({mib:.0f} MiB of KV), "
              f"{CHUNKS} chunks, {FORWARD * 1000:.0f} ms of compute each, "
              f"host pools, median of {ROUNDS}")
        print(f"last send -> decode Success, whole (baseline): "
              f"{results['0'] * 1000:8.1f} ms")
        print(f"last send -> decode Success, streaming:        "
              f"{results['1'] * 1000:8.1f} ms")
        print(f"ratio streaming / whole: {results['1'] / results['0']:.2f}")
        boot.close()
    finally:
        daemon.terminate()
        daemon.wait()


if __name__ == "__main__":
    main()
