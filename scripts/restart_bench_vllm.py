#!/usr/bin/env python3
"""The vLLM connector's half of scripts/restart_bench.sh: a prefill and a
decode vLLM instance (vLLM's own Scheduler and the connector's worker
side, as tests/vllm drives them: the Engine class is that test's), kill -9
of kvxferd with a prefill's offer in flight, a new daemon on the same
socket path, RESTARTS times. The engines step every millisecond, as a
busy engine's loop does. Prints, per restart, the time from the new
socket first accepting to a request moved through kvxfer (prefill,
reserve, publish, the decode's fetch, vLLM told the KV is in) and its
39 loaded tokens verified against what the prefill wrote; then p50 and
p99, and how many requests fell back to recompute after the daemon was
back (each is retried with a new request, and counted).

    scripts/restart_bench_vllm.py KVXFERD RESTARTS   (in build/venv-vllm)
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import harness as t  # noqa: E402


def main():
    exe, n = sys.argv[1], int(sys.argv[2])
    d = tempfile.mkdtemp(prefix="kvx-restart-vllm-")
    sock, cfg = os.path.join(d, "kvxferd.sock"), os.path.join(d, "kvxferd.yaml")
    with open(cfg, "w") as f:
        f.write(f"socket:\n  path: {sock}\n")
    log = open(os.path.join(d, "kvxferd.log"), "ab")
    model = os.path.join(d, "tiny-llama")
    LlamaConfig(vocab_size=1000, hidden_size=t.HEAD * 8,
                intermediate_size=256, num_hidden_layers=t.LAYERS,
                num_attention_heads=8, num_key_value_heads=t.KV_HEADS,
                max_position_embeddings=1024).save_pretrained(model)

    def run():
        return subprocess.Popen([exe, "--config", cfg], stdout=log,
                                stderr=subprocess.STDOUT)

    ready = [0.0]

    def probe():
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(sock)
                ready[0] = time.monotonic()
                return
            except OSError:
                time.sleep(0.0002)
            finally:
                s.close()

    proc = run()
    th = threading.Thread(target=probe)
    th.start()
    th.join()
    p = t.Engine(model, sock, "rbv-prefill", salt=0.5)
    dec = t.Engine(model, sock, "rbv-decode")
    seq = iter(range(1, 1 << 30))

    def step_both():
        p.step()
        dec.step()
        time.sleep(0.001)

    def until(cond, timeout=20.0):
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                sys.exit("restart_bench_vllm.py: stuck")
            step_both()

    def transfer():
        """One request through kvxfer, verified; False when it fell back
        to recompute (no params, or its load failed)."""
        i = next(seq)
        rid, prompt = f"rb-{i}", t.prompt_of(40, 1000 + i)
        p.add(rid, prompt, 1, {"do_remote_decode": True})
        until(lambda: rid in p.outputs)
        params = p.outputs[rid].kv_transfer_params
        if not params:
            return False
        dec.add(rid, prompt, 1, dict(params))
        seen = {}

        def loaded():
            if t.landed(dec, rid) and "kv" not in seen:
                seen["kv"] = dec.kv_of(rid, 40)
            return rid in dec.outputs
        until(loaded)
        if dec.computed[rid][0] != 1 or "kv" not in seen:
            return False  # a load error: recomputed
        for layer in range(t.LAYERS):
            want = t.pattern(prompt, 0, 39, layer, range(t.KV_HEADS),
                             p.salt)
            if not torch.equal(seen["kv"][layer][:39], want):
                sys.exit(f"restart_bench_vllm.py: {rid}: bytes differ")
        return True

    if not transfer():
        sys.exit("restart_bench_vllm.py: the first transfer fell back")
    out, fallbacks = [], 0
    for i in range(n):
        # an offer in flight: published, no decode fetches it
        lost = f"lost-{i}"
        p.add(lost, t.prompt_of(40, 500 + i), 1, {"do_remote_decode": True})
        until(lambda: lost in p.outputs)
        p.step()  # its workers publish
        proc.kill()
        proc.wait()
        until(lambda: not p.sched.requests)  # its send ended (PEER_GONE)
        ready[0] = 0.0
        proc = run()
        th = threading.Thread(target=probe)
        th.start()
        while not ready[0]:
            step_both()
        while not transfer():
            fallbacks += 1
        ms = (time.monotonic() - ready[0]) * 1000
        th.join()
        out.append(ms)
        print(f"restart {i + 1}: {ms:.1f} ms from socket ready to a "
              "verified transfer")
    out.sort()
    p99 = out[-(-n * 99 // 100) - 1]
    print(f"vLLM connector, {n} restarts: p50 {out[(n - 1) // 2]:.1f} ms, "
          f"p99 {p99:.1f} ms, max {out[-1]:.1f} ms; {fallbacks} requests "
          "recomputed after the daemon was back")
    p.close()
    dec.close()
    proc.terminate()
    proc.wait()
    shutil.rmtree(d)


if __name__ == "__main__":
    main()
