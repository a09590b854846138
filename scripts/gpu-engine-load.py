#!/usr/bin/env python3
"""What kvxfer's copies do to an engine's step on the same GPU (issue 39).

A stand-in engine runs a decode-like step loop on the GPU: four bf16
4096 x 4096 matmuls and a memory-bound add over 128 MiB tensors, each
step synchronized and timed (an engine waits for its step before it
samples the next token). The script measures, in one run:

1. the engine alone (its baseline step times);
2. kvxfer-bench alone with the given arguments (kvxfer's idle GB/s);
3. the engine while kvxfer-bench runs again: only the steps that lie
   wholly inside a timed pass (kvxfer-bench --pass-times) count.

It prints one JSON line: the step p50/p90/p99 alone and under load, their
ratios (the slowdown), kvxfer's GB/s under load against idle, and the
daemon's copy path as its status tells it. Needs PyTorch with CUDA.

--step matmul or --step add keeps one half of the step (compute bound, or
HBM bound), to tell which half the copies slow. --smi samples the GPU's
SM clock, power, kernel time (utilization.gpu) and clock-event reasons
with nvidia-smi every 100 ms and reports their medians over the steps
alone, over the steps under load and over kvxfer's passes alone (a GPU
at its power cap lowers its clock when copies add HBM traffic; copies
that the driver runs as a kernel show kernel time while kvxfer runs
alone, where the copy engines show none).

--self-copy GIB leaves kvxfer out: the engine's own process copies GIB
GiB a pass device to device on a side stream of its own context, in
--piece-mib pieces (cudaMemcpyAsync, or an elementwise kernel with
--copy-kernel). That is what an in-engine transfer layer does, and it
tells what copies cost the step when they do not time-slice with it.
--elsewhere runs the same copies from a second process (a context of
its own, as kvxferd's), the baseline for that comparison.

    python3 scripts/gpu-engine-load.py --bench dist/kvxfer/bin/kvxfer-bench \\
        --label kernel -- --spawn-daemon --gpu --gen-device 0 ...
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch


def pct(xs, q):
    """The q-quantile of xs (nearest rank)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


class Engine:
    """The stand-in engine's step: compute, then memory traffic."""

    def __init__(self, dev: int, kind: str = "both") -> None:
        torch.cuda.set_device(dev)
        self.kind = kind
        n = 4096
        self.w = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
                  for _ in range(4)]
        self.x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        m = 64 << 20  # 128 MiB of bf16 each
        self.a = torch.randn(m, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(m, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        for _ in range(20):
            self.step()

    def step(self) -> tuple:
        """One step: its start and end, CLOCK_MONOTONIC ns."""
        t0 = time.monotonic_ns()
        y = self.x
        if self.kind != "add":
            for w in self.w:
                y = torch.matmul(y, w)
        if self.kind != "matmul":
            torch.add(self.a, self.b, out=self.c)
        # its own stream only: a copy on a side stream (--self-copy)
        # must not be waited for
        torch.cuda.current_stream().synchronize()
        return t0, time.monotonic_ns()

    def run_for(self, seconds: float) -> list:
        end = time.monotonic_ns() + int(seconds * 1e9)
        steps = []
        while time.monotonic_ns() < end:
            steps.append(self.step())
        return steps


class SelfCopy:
    """Copies from the engine's own context: src to dst on a side stream,
    in pieces, at most 8 in flight; each pass's window is recorded."""

    def __init__(self, gib: float, piece_mib: int, kernel: bool,
                 passes: int) -> None:
        self.piece = piece_mib << 20
        self.n = max(1, int(gib * (1 << 30)) // self.piece)
        self.hold = min(self.n, max(1, (8 << 30) // self.piece))
        self.src = torch.empty(self.hold * self.piece, dtype=torch.uint8,
                               device="cuda")
        self.dst = torch.empty_like(self.src)
        self.kernel = kernel
        self.passes = passes
        self.stream = torch.cuda.Stream()
        self.wins = []
        self.run_pass()  # warm: first launches and allocations

    def run_pass(self) -> tuple:
        evs = []
        t0 = time.monotonic_ns()
        with torch.cuda.stream(self.stream):
            for i in range(self.n):
                o = (i % self.hold) * self.piece
                s = self.src[o:o + self.piece]
                d = self.dst[o:o + self.piece]
                if self.kernel:
                    torch.bitwise_or(s, 0, out=d)
                else:
                    d.copy_(s, non_blocking=True)
                e = torch.cuda.Event()
                e.record(self.stream)
                evs.append(e)
                if len(evs) >= 8:
                    evs.pop(0).synchronize()
        self.stream.synchronize()
        return t0, time.monotonic_ns()

    def run(self) -> dict:
        """passes timed; their windows and GB/s (the median pass)."""
        wins = [self.run_pass() for _ in range(self.passes)]
        self.wins = wins
        per = sorted(self.n * self.piece / (w1 - w0) for w0, w1 in wins)
        return {"gbps": per[len(per) // 2]}


class Smi:
    """nvidia-smi sampling the GPU every 100 ms, each line stamped with
    CLOCK_MONOTONIC as it arrives."""

    # utilization.gpu: the share of the sample in which any kernel ran
    # (copies on the copy engines alone leave it near 0)
    FIELDS = "clocks.sm,clocks.mem,power.draw,utilization.gpu,"

    def __init__(self, dev: int) -> None:
        self.rows = []  # (ns, sm MHz, mem MHz, W, kernel %, reasons)
        why = "clocks_event_reasons.active"  # clocks_throttle_ before 535
        if subprocess.run(["nvidia-smi", "--query-gpu=" + why,
                           "--format=csv"], capture_output=True).returncode:
            why = "clocks_throttle_reasons.active"
        self.p = subprocess.Popen(
            ["nvidia-smi", "-i", str(dev), "--query-gpu=" + self.FIELDS + why,
             "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    @staticmethod
    def _num(x: str):
        """A field's number; None for [N/A] or [Not Supported]."""
        try:
            return float(x)
        except ValueError:
            return None

    def _read(self) -> None:
        for ln in self.p.stdout:
            f = [x.strip() for x in ln.split(",")]
            if len(f) == 5:
                self.rows.append((time.monotonic_ns(),)
                                 + tuple(self._num(x) for x in f[:4])
                                 + (f[4],))

    def stop(self) -> None:
        self.p.terminate()
        self.p.wait()
        self.t.join(timeout=2)  # the lines still in the pipe

    def over(self, wins: list) -> dict:
        """Medians over the samples inside any (start, end) window; a
        field the GPU never gave is None."""
        rs = [r for r in self.rows
              if any(w0 <= r[0] <= w1 for w0, w1 in wins)]
        if not rs:
            return {"samples": 0}

        def med(i):
            v = [r[i] for r in rs if r[i] is not None]
            return pct(v, 0.5) if v else None
        why = {}
        for r in rs:
            why[r[5]] = why.get(r[5], 0) + 1
        return {"samples": len(rs), "sm_mhz": med(1), "mem_mhz": med(2),
                "power_w": med(3), "kernel_pct": med(4),
                "reasons": max(why, key=why.get)}


def start_smi(dev: int):
    """An Smi, or None (with a warning) where nvidia-smi cannot run."""
    try:
        return Smi(dev)
    except OSError as e:
        print("--smi: nvidia-smi: %s; no clocks sampled" % e,
              file=sys.stderr)
        return None


def bench_json(out: str) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("kvxfer-bench printed no JSON line:\n" + out[-2000:])


def marks_args(cmd: list, marks: str, copier: bool) -> list:
    """cmd, told to write its passes' windows to marks."""
    if copier:
        return cmd + ["--copier-out", marks]
    return cmd + ["--json", "--pass-times", marks]


def run_bench(cmd: list, marks: str, copier: bool = False) -> dict:
    p = subprocess.run(marks_args(cmd, marks, copier),
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError("kvxfer-bench failed (%d):\n%s%s" % (
            p.returncode, p.stdout[-2000:], p.stderr[-2000:]))
    return bench_json(p.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", help="kvxfer-bench to run")
    ap.add_argument("--self-copy", type=float, metavar="GIB",
                    help="no kvxfer: copy GIB GiB a pass in this process")
    ap.add_argument("--piece-mib", type=int, default=64,
                    help="--self-copy's piece (default 64 MiB)")
    ap.add_argument("--copy-kernel", action="store_true",
                    help="--self-copy with a kernel, not cudaMemcpyAsync")
    ap.add_argument("--passes", type=int, default=8,
                    help="--self-copy's timed passes (default 8)")
    ap.add_argument("--elsewhere", action="store_true",
                    help="--self-copy's copies from a second process")
    ap.add_argument("--copier-out", help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help="the case's name")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--alone-s", type=float, default=2.0,
                    help="seconds of steps alone (default 2)")
    ap.add_argument("--step", choices=("both", "matmul", "add"),
                    default="both", help="the step's halves (default both)")
    ap.add_argument("--smi", action="store_true",
                    help="sample clocks and power with nvidia-smi")
    ap.add_argument("args", nargs=argparse.REMAINDER,
                    help="-- then kvxfer-bench's arguments")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not a.bench and a.self_copy is None:
        ap.error("give --bench (kvxfer) or --self-copy GIB")
    if a.copier_out:  # --elsewhere's second process
        torch.cuda.set_device(a.device)
        c = SelfCopy(a.self_copy, a.piece_mib, a.copy_kernel, a.passes)
        r = c.run()
        with open(a.copier_out, "w") as f:
            f.write("".join("%d %d\n" % w for w in c.wins))
        print(json.dumps(r), flush=True)
        return 0
    eng = Engine(a.device, a.step)
    smi = start_smi(a.device) if a.smi else None
    try:
        return measure(a, args, eng, smi)
    finally:
        if smi:
            smi.stop()


def bench_beside(a, cmd: list, eng: "Engine", copier=False) -> tuple:
    """kvxfer-bench (or --elsewhere's copier) alone, then again while the
    engine steps: each run's JSON and pass windows, and the steps."""
    tmp = tempfile.mkdtemp(prefix="kvx-load-")
    idle = run_bench(cmd, os.path.join(tmp, "idle"), copier)
    with open(os.path.join(tmp, "idle")) as f:
        wins_idle = [tuple(int(x) for x in ln.split()) for ln in f
                     if ln.strip()]
    marks = os.path.join(tmp, "load")
    p = subprocess.Popen(marks_args(cmd, marks, copier),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    steps = []
    while p.poll() is None:
        steps.append(eng.step())
    out, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError("kvxfer-bench failed under load (%d):\n%s%s" % (
            p.returncode, out[-2000:], err[-2000:]))
    with open(marks) as f:
        wins = [tuple(int(x) for x in ln.split()) for ln in f if ln.strip()]
    return idle, wins_idle, bench_json(out), wins, steps


def copier_args(a) -> list:
    """The command of --elsewhere's copier, without --copier-out."""
    r = [sys.executable, os.path.abspath(__file__), "--device",
         str(a.device), "--self-copy", str(a.self_copy), "--piece-mib",
         str(a.piece_mib), "--passes", str(a.passes)]
    return r + (["--copy-kernel"] if a.copy_kernel else [])


def self_copy(a, eng: "Engine") -> tuple:
    """--self-copy: the same two phases with this process's own copies,
    the loaded one on a thread beside the steps (or, --elsewhere, in a
    second process, as bench_beside runs kvxfer-bench)."""
    what = "kernel" if a.copy_kernel else "cudaMemcpyAsync"
    if a.elsewhere:
        idle, wins_idle, load, wins, steps = bench_beside(
            a, copier_args(a), eng, copier=True)
        load["gpu_status"] = "copies from a second process: %s, %d MiB " \
            "pieces" % (what, a.piece_mib)
        return idle, wins_idle, load, wins, steps
    c = SelfCopy(a.self_copy, a.piece_mib, a.copy_kernel, a.passes)
    idle = c.run()
    wins_idle = c.wins
    load = {}
    t = threading.Thread(target=lambda: load.update(c.run()))
    t.start()
    steps = []
    while t.is_alive():
        steps.append(eng.step())
    t.join()
    load["gpu_status"] = "self-copy: %s, %d MiB pieces" % (what, a.piece_mib)
    return idle, wins_idle, load, c.wins, steps


def measure(a, args: list, eng: "Engine", smi) -> int:
    """The three phases and the JSON line (main's body)."""
    t_alone = time.monotonic_ns()
    alone = [e - s for s, e in eng.run_for(a.alone_s)]
    t_alone = (t_alone, time.monotonic_ns())
    if a.self_copy is not None:
        idle, wins_idle, load, wins, steps = self_copy(a, eng)
    else:
        idle, wins_idle, load, wins, steps = bench_beside(
            a, [a.bench] + args, eng)
    inside = [e - s for s, e in steps
              if any(w0 <= s and e <= w1 for w0, w1 in wins)]
    base = {q: pct(alone, q) for q in (0.5, 0.9, 0.99)}
    busy = {q: pct(inside, q) for q in (0.5, 0.9, 0.99)}
    r = {
        "label": a.label,
        "steps_alone": len(alone),
        "steps_under_load": len(inside),
        "step_ms_alone": {"p50": base[0.5] / 1e6, "p90": base[0.9] / 1e6,
                          "p99": base[0.99] / 1e6},
        "step_ms_load": {"p50": busy[0.5] / 1e6, "p90": busy[0.9] / 1e6,
                         "p99": busy[0.99] / 1e6},
        "slowdown": {"p50": busy[0.5] / base[0.5],
                     "p90": busy[0.9] / base[0.9],
                     "p99": busy[0.99] / base[0.99]},
        "kvxfer_gbps_idle": idle["gbps"],
        "kvxfer_gbps_load": load["gbps"],
        "kvxfer_ratio": load["gbps"] / idle["gbps"] if idle["gbps"] else 0,
        "gpu_status": load.get("gpu_status", ""),
        # kvxfer-bench --trace: each hop's p50 and p99 alone and beside
        "trace_us_idle": idle.get("trace_us"),
        "trace_us_load": load.get("trace_us"),
        "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        "step": a.step,
    }
    if smi:
        smi.stop()
        r["gpu_alone"] = smi.over([t_alone])
        r["gpu_copies_alone"] = smi.over(wins_idle)
        r["gpu_load"] = smi.over(wins)
    print(json.dumps(r), flush=True)
    if not inside:
        print("no step lay inside a timed pass: make the passes longer",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
