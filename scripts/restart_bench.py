#!/usr/bin/env python3
"""The Python half of scripts/restart_bench.sh: kill -9 of kvxferd under a
context and a generation kvxfer.Client polling every millisecond, a new
daemon on the same socket path, RESTARTS times; prints, per restart, the
time from the new socket first accepting to a transfer verified byte for
byte, then p50 and p99.

    scripts/restart_bench.py KVXFERD RESTARTS
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "python"))
import numpy as np  # noqa: E402

import kvxfer  # noqa: E402

TPB = 4


def main():
    exe, n = sys.argv[1], int(sys.argv[2])
    d = tempfile.mkdtemp(prefix="kvx-restart-py-")
    sock, cfg = os.path.join(d, "kvxferd.sock"), os.path.join(d, "kvxferd.yaml")
    with open(cfg, "w") as f:
        f.write(f"socket:\n  path: {sock}\n")
    log = open(os.path.join(d, "kvxferd.log"), "ab")

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
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    par = kvxfer.Parallel(total_layers=4, total_kv_heads=4)
    ctx = kvxfer.Client(sock, instance_id="rbp-ctx", role="context",
                        parallel=par)
    gen = kvxfer.Client(sock, instance_id="rbp-gen", role="generation",
                        parallel=par)
    for c in (ctx, gen):
        c.join([c.daemon_address])
    lo = kvxfer.Layout.preset("vllm-nhd", num_layers=4, num_heads=4,
                              head_dim=32, dtype="bf16", tokens_per_block=TPB,
                              num_blocks=64)
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    rng = np.random.default_rng(1)

    def wait(c, key):
        while True:
            for e in c.poll(1, 5.0):
                if e.key == key:
                    e.raise_for_status()
                    return

    def transfer(key, i):
        cb = [(i * 7 + k) % 64 for k in range(3)]
        gb = [(i * 5 + 9 + k) % 64 for k in range(3)]
        src.array[:] = rng.integers(0, 256, src.array.size, dtype=np.uint8)
        params = ctx.publish(key, src, cb, num_tokens=3 * TPB)
        gen.fetch(key, params, dst, gb)
        wait(gen, key.encode())
        wait(ctx, key.encode())
        per = lo.token_stride * TPB
        for s, g in zip(cb, gb):
            for layer in range(4):
                for kv in range(2):
                    a, b = lo.offset(layer, kv, s), lo.offset(layer, kv, g)
                    if not np.array_equal(src.array[a:a + per],
                                          dst.array[b:b + per]):
                        sys.exit(f"restart_bench.py: {key}: bytes differ")

    def step(c):
        try:
            b = c.poll(0, 0)
        except kvxfer.Closed:
            return False
        return len(b) > 0 and b.events[-1].kind == kvxfer.EventKind.RECONNECTED

    transfer("warm", 1)
    out = []
    for i in range(n):
        ctx.publish("lost", src, [63], num_tokens=TPB)  # in flight
        proc.kill()
        proc.wait()
        ready[0] = 0.0
        proc = run()
        t = threading.Thread(target=probe)
        t.start()
        cback = gback = False
        first_back = 0.0
        while not (cback and gback):
            cback = cback or step(ctx)
            gback = gback or step(gen)
            if (cback or gback) and not first_back:
                first_back = time.monotonic()
            time.sleep(0.001)
        transfer(f"after-{i}", i + 2)
        done = time.monotonic()
        t.join()
        ms = (done - min(ready[0], first_back)) * 1000
        out.append(ms)
        print(f"restart {i + 1}: {ms:.1f} ms from socket ready to a "
              "verified transfer")
    out.sort()
    p99 = out[-(-n * 99 // 100) - 1]
    print(f"Python client, {n} restarts: p50 {out[(n - 1) // 2]:.1f} ms, "
          f"p99 {p99:.1f} ms, max {out[-1]:.1f} ms")
    ctx.close()
    gen.close()
    proc.terminate()
    proc.wait()
    shutil.rmtree(d)


if __name__ == "__main__":
    main()
