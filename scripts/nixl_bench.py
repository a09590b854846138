#!/usr/bin/env python3
"""NIXL moving KV cache blocks the way vLLM's NixlConnector does, timed.

    scripts/nixl_bench.py [--mem vram|dram] [--device N] [--remote-device M]
        [--layers 32] [--heads 8] [--head-dim 128] [--tokens-per-block 16]
        [--elem-bytes 2] [--requests 16] [--blocks 1000] [--window 4]
        [--passes 3] [--budget-s 30] [--order same|shuffled]
        [--json] [--out FILE]
    scripts/nixl_bench.py --report KVXFER.jsonl NIXL.jsonl UCX.log

Two processes, as in a disaggregated vLLM: a prefill agent that owns the
source pool and a decode agent that READs from it. Each pool is one
allocation per layer shaped [2 (K, V), blocks, block_size, heads, dim]
(vLLM's per-layer KV cache tensor); each layer's K half and V half are
registered as two regions, and every region is cut into one 32 KiB
descriptor per block, as NixlConnectorWorker.register_kv_caches,
register_local_xfer_handler and add_remote_agent do. A request reads
its blocks with one make_prepped_xfer("READ", ...) over the descriptor
ids vLLM's _get_block_descs_ids computes (region * num_blocks + block),
then transfer() and check_xfer_state() until DONE, at most --window
requests in flight.

Block ids follow kvxfer-bench: request r uses blocks r * B .. r * B + B - 1
on both sides (--order same), so both programs move the same bytes
between the same blocks. --order shuffled gives each side its own random
permutation, as a long-running engine's block tables look: a request's
neighbouring descriptors are then seldom neighbours in memory.

One request, then a pass over the timed requests, warm up first (opening
the peer's handles), as kvxfer-bench's warm-up pass does. When that one
request shows that a pass would take longer than --budget-s (NIXL falling
back to software emulation over TCP), only the first requests are timed
(requests_timed in the output) and the warm-up pass is left out; as many
passes as fit are timed, at least one. The decode pool is on --device,
the prefill pool on --remote-device (default the same GPU). The pools are
filled with a pattern per region before the timed passes and the decode
side checks every byte it read after them. Prints one line per figure,
or one JSON object with --json; --out FILE appends the JSON line to FILE
instead, for UCX_PROTO_INFO=y prints UCX's protocol tables on stdout
too. Exits 0 when every byte arrived, 1 when some did
not, 2 when it cannot run (no NIXL, no GPU).

--report prints scripts/compare-nixl.sh's table from kvxfer-bench's and
this program's JSON lines, and the transports NIXL's UCX chose for its
READs (the "remote memory read" tables of UCX_PROTO_INFO=y).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any


def import_nixl() -> tuple[Any, Any]:
    """nixl._api as vLLM imports it, or the CUDA 13 wheel's own module."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


@dataclass
class Shape:
    layers: int
    heads: int
    head_dim: int
    tokens_per_block: int
    elem_bytes: int
    num_blocks: int

    @property
    def block_len(self) -> int:
        """Bytes of one block of one region (K or V of one layer)."""
        return (self.tokens_per_block * self.heads * self.head_dim *
                self.elem_bytes)

    @property
    def region_len(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def regions(self) -> int:
        return 2 * self.layers


class Pool:
    """One side's KV cache: an allocation per layer, K half then V half.

    VRAM pools are torch tensors on the device (vLLM's own allocation);
    DRAM pools are numpy arrays, for a run on a machine without a GPU.
    """

    def __init__(self, shape: Shape, mem: str, device: int) -> None:
        self.shape = shape
        self.mem = mem
        self.device = device
        self.layers: list[Any] = []
        if mem == "vram":
            import torch
            self.torch = torch
            torch.cuda.set_device(device)
            for _ in range(shape.layers):
                self.layers.append(torch.empty(2 * shape.region_len,
                                               dtype=torch.uint8,
                                               device=f"cuda:{device}"))
        else:
            import numpy as np
            self.np = np
            for _ in range(shape.layers):
                self.layers.append(np.empty(2 * shape.region_len,
                                            dtype=np.uint8))

    def base(self, layer: int) -> int:
        t = self.layers[layer]
        return t.data_ptr() if self.mem == "vram" else t.ctypes.data

    def region_bases(self) -> list[int]:
        """vLLM's seen_base_addresses: K then V of each layer."""
        out = []
        for layer in range(self.shape.layers):
            out.append(self.base(layer))
            out.append(self.base(layer) + self.shape.region_len)
        return out

    def region_words(self, region: int) -> Any:
        """Region `region` as [num_blocks, block_len / 4] int32 words."""
        layer, kv = divmod(region, 2)
        n = self.shape.region_len
        t = self.layers[layer][kv * n:(kv + 1) * n]
        if self.mem == "vram":
            return t.view(self.torch.int32).view(self.shape.num_blocks, -1)
        return t.view(self.np.int32).reshape(self.shape.num_blocks, -1)

    def pattern(self, region: int) -> Any:
        """The words the prefill side writes into region `region`."""
        n = self.shape.region_len // 4
        if self.mem == "vram":
            torch = self.torch
            w = torch.arange(n, dtype=torch.int64,
                             device=f"cuda:{self.device}")
            w = (w * 2654435761 + region * 40503 + 1) & 0x7FFFFFFF
            return w.to(torch.int32).view(self.shape.num_blocks, -1)
        np = self.np
        w = np.arange(n, dtype=np.int64)
        w = (w * 2654435761 + region * 40503 + 1) & 0x7FFFFFFF
        return w.astype(np.int32).reshape(self.shape.num_blocks, -1)

    def fill(self) -> None:
        for r in range(self.shape.regions):
            self.region_words(r)[:] = self.pattern(r)
        self.sync()

    def zero(self) -> None:
        for t in self.layers:
            t.fill(0) if self.mem == "dram" else t.zero_()
        self.sync()

    def sync(self) -> None:
        if self.mem == "vram":
            self.torch.cuda.synchronize(self.device)

    def mismatched_blocks(self, local: list[int], remote: list[int]) -> int:
        """Blocks of `local` whose words differ from the prefill pattern
        of the `remote` block read into them, over every region."""
        bad = 0
        for r in range(self.shape.regions):
            got = self.region_words(r)
            want = self.pattern(r)
            if self.mem == "vram":
                li = self.torch.tensor(local, device=got.device)
                ri = self.torch.tensor(remote, device=got.device)
                bad += int((got[li] != want[ri]).any(dim=1).sum().item())
            else:
                bad += int((got[local] != want[remote]).any(axis=1).sum())
        return bad


def reg_descs(pool: Pool) -> list[tuple[int, int, int, str]]:
    """register_kv_caches: one region per K or V of a layer."""
    return [(b, pool.shape.region_len, pool.device, "")
            for b in pool.region_bases()]


def block_descs(bases: list[int], shape: Shape,
                device: int) -> list[tuple[int, int, int]]:
    """register_local_xfer_handler / add_remote_agent: one descriptor per
    block per region, region-major."""
    out = []
    for base in bases:
        for block in range(shape.num_blocks):
            out.append((base + block * shape.block_len, shape.block_len,
                        device))
    return out


def desc_ids(shape: Shape, block_ids: list[int]) -> Any:
    """vLLM's _get_block_descs_ids: region * num_blocks + block, all
    regions, region-major."""
    import numpy as np
    region_ids = np.arange(shape.regions)[:, None]
    blocks = np.array(block_ids)[None, :]
    return (region_ids * shape.num_blocks + blocks).flatten()


def agent_config(nixl_agent_config: Any) -> Any:
    # vLLM's: 4 UCX threads, telemetry read for every finished request
    return nixl_agent_config(num_threads=4, capture_telemetry=True)


def prefill_main(args: argparse.Namespace, shape: Shape, conn: Any) -> None:
    """The prefill worker: register, hand over its metadata, then take
    notifications (vLLM's get_finished) until the decode side is done."""
    pool = Pool(shape, args.mem, args.remote_device)  # torch first, as vLLM
    pool.fill()
    nixl_agent, nixl_agent_config = import_nixl()
    agent = nixl_agent(str(uuid.uuid4()), agent_config(nixl_agent_config))
    mem_type = "VRAM" if args.mem == "vram" else "DRAM"
    descs = agent.get_reg_descs(reg_descs(pool), mem_type)
    agent.register_memory(descs)
    conn.send({"agent_metadata": agent.get_agent_metadata(),
               "kv_caches_base_addr": pool.region_bases(),
               "device_id": pool.device,
               "num_blocks": shape.num_blocks,
               "block_len": shape.block_len})
    notifs = 0
    while not conn.poll(0.001):
        for msgs in agent.get_new_notifs().values():
            notifs += len(msgs)
    conn.recv()
    for msgs in agent.get_new_notifs().values():
        notifs += len(msgs)
    conn.send({"notifs": notifs})
    agent.deregister_memory(descs)
    # NIXL's threads can outlive the interpreter's teardown and crash it
    os._exit(0)


def run_pass(agent: Any, shape: Shape, local_h: Any, remote_h: Any,
             local_ids: list[list[int]], remote_ids: list[list[int]],
             window: int, tag: str) -> tuple[float, list[float], int]:
    """All requests once, at most `window` in flight: seconds, each
    request's latency, and the most descriptors NIXL posted for one
    request (after its merging of neighbours), from its telemetry."""
    inflight: dict[int, tuple[Any, float]] = {}
    lat: list[float] = []
    nxt = 0
    posted = 0
    t0 = time.perf_counter()
    while nxt < len(local_ids) or inflight:
        while nxt < len(local_ids) and len(inflight) < window:
            ts = time.perf_counter()
            h = agent.make_prepped_xfer(
                "READ", local_h, desc_ids(shape, local_ids[nxt]), remote_h,
                desc_ids(shape, remote_ids[nxt]),
                notif_msg=f"{tag}-{nxt}:1".encode())
            if agent.transfer(h) == "ERR":
                raise RuntimeError(f"request {nxt}: transfer() returned ERR")
            inflight[nxt] = (h, ts)
            nxt += 1
        for r in list(inflight):
            h, ts = inflight[r]
            st = agent.check_xfer_state(h)
            if st == "DONE":
                lat.append(time.perf_counter() - ts)
                # vLLM records every finished request's telemetry
                posted = max(posted, int(agent.get_xfer_telemetry(h)
                                         .descCount))
                agent.release_xfer_handle(h)
                del inflight[r]
            elif st != "PROC":
                raise RuntimeError(f"request {r}: transfer state {st}")
    return time.perf_counter() - t0, lat, posted


def memcpy_gbps(pool: Pool, nbytes: int) -> float:
    """The baseline: one plain copy of `nbytes` within the device
    (cudaMemcpyAsync D2D through torch) or host (numpy memcpy)."""
    chunk = min(nbytes, 1 << 31)
    reps = max(1, nbytes // chunk)
    if pool.mem == "vram":
        torch = pool.torch
        dev = f"cuda:{pool.device}"
        a = torch.empty(chunk, dtype=torch.uint8, device=dev)
        b = torch.empty(chunk, dtype=torch.uint8, device=dev)
        a.fill_(1)
        b.copy_(a)
        torch.cuda.synchronize(pool.device)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                b.copy_(a)
            torch.cuda.synchronize(pool.device)
            best = max(best, chunk * reps / (time.perf_counter() - t0) / 1e9)
        del a, b
        return best
    np = pool.np
    a = np.ones(chunk, dtype=np.uint8)
    b = np.empty(chunk, dtype=np.uint8)
    np.copyto(b, a)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            np.copyto(b, a)
        best = max(best, chunk * reps / (time.perf_counter() - t0) / 1e9)
    return best


BlockTables = tuple[list[list[int]], list[list[int]]]


def block_tables(args: argparse.Namespace) -> BlockTables:
    """Each request's local (decode) and remote (prefill) block ids."""
    n = args.requests * args.blocks
    if args.order == "same":
        ids = [list(range(r * args.blocks, (r + 1) * args.blocks))
               for r in range(args.requests)]
        return ids, ids
    import random
    rng = random.Random(20)
    local = list(range(n))
    remote = list(range(n))
    rng.shuffle(local)
    rng.shuffle(remote)
    cut = [(r * args.blocks, (r + 1) * args.blocks)
           for r in range(args.requests)]
    return [local[a:b] for a, b in cut], [remote[a:b] for a, b in cut]


def decode_main(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(args.layers, args.heads, args.head_dim,
                  args.tokens_per_block, args.elem_bytes,
                  args.requests * args.blocks)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    prefill = ctx.Process(target=prefill_main, args=(args, shape, child))
    prefill.start()
    try:
        return decode_run(args, shape, parent)
    finally:
        # it leaves once told "done"; after a failure here it never is
        prefill.join(timeout=15)
        if prefill.is_alive():
            prefill.kill()


def decode_run(args: argparse.Namespace, shape: Shape,
               conn: Any) -> dict[str, Any]:
    pool = Pool(shape, args.mem, args.device)
    pool.zero()
    nixl_agent, nixl_agent_config = import_nixl()
    agent = nixl_agent(str(uuid.uuid4()), agent_config(nixl_agent_config))
    mem_type = "VRAM" if args.mem == "vram" else "DRAM"
    t_setup = time.perf_counter()
    descs = agent.get_reg_descs(reg_descs(pool), mem_type)
    agent.register_memory(descs)
    local_descs = agent.get_xfer_descs(
        block_descs(pool.region_bases(), shape, pool.device), mem_type)
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs)
    meta = conn.recv()
    if meta["block_len"] != shape.block_len or \
            meta["num_blocks"] != shape.num_blocks:
        raise RuntimeError("the prefill pool differs from the decode pool")
    remote = agent.add_remote_agent(meta["agent_metadata"])
    remote_descs = agent.get_xfer_descs(
        block_descs(meta["kv_caches_base_addr"], shape, meta["device_id"]),
        mem_type)
    remote_h = agent.prep_xfer_dlist(remote, remote_descs)
    setup_s = time.perf_counter() - t_setup
    local_ids, remote_ids = block_tables(args)

    # warm-up: one request opens the peer's handles (IPC or rkeys) for
    # every region and tells whether a pass fits the budget; then a pass,
    # as kvxfer-bench's warm-up pass
    t0 = time.perf_counter()
    run_pass(agent, shape, local_h, remote_h, local_ids[:1], remote_ids[:1],
             1, "warm")
    one_s = time.perf_counter() - t0
    # a slow transport (software emulation over TCP) moves the first
    # requests only, and as few passes as fit, at least one
    timed = args.requests
    if one_s * args.requests > args.budget_s:
        timed = max(min(args.window, args.requests),
                    int(args.budget_s // one_s))
    local_ids, remote_ids = local_ids[:timed], remote_ids[:timed]
    warm_s = one_s
    if timed == args.requests:
        warm_s, _, _ = run_pass(agent, shape, local_h, remote_h, local_ids,
                                remote_ids, args.window, "warm")
    pool.zero()
    passes = max(1, min(args.passes,
                        int(args.budget_s // max(warm_s, one_s * timed))))
    nbytes = timed * args.blocks * shape.regions * shape.block_len
    secs, lats = [], []
    posted = 0
    for p in range(passes):
        s, lat, n = run_pass(agent, shape, local_h, remote_h, local_ids,
                             remote_ids, args.window, f"pass{p}")
        secs.append(s)
        lats += lat
        posted = max(posted, n)
    bad = pool.mismatched_blocks(sum(local_ids, []), sum(remote_ids, []))

    # one request alone: the per-descriptor cost, with telemetry
    tel = telemetry(agent, shape, local_h, remote_h, local_ids[0],
                    remote_ids[0])
    conn.send("done")
    notifs = conn.recv()["notifs"]
    base = memcpy_gbps(pool, min(nbytes, 8 << 30))
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(descs)

    gbps = [nbytes / s / 1e9 for s in secs]
    lats.sort()
    med = statistics.median(gbps)
    return {
        "what": "nixl", "mem": args.mem, "order": args.order,
        "device": args.device, "remote_device": args.remote_device,
        "gbps": round(med, 3), "pass_gbps": [round(g, 3) for g in gbps],
        "baseline_gbps": round(base, 3),
        "ratio": round(med / base, 4) if base else None,
        "bytes": nbytes, "requests": args.requests, "blocks": args.blocks,
        "requests_timed": timed,
        "window": args.window, "passes": passes,
        "warmup_s": round(warm_s, 3), "ucx_version": ucx_version(),
        "nixl_version": nixl_version(),
        "descs_per_request": shape.regions * args.blocks,
        "descs_posted_per_request": posted,
        "desc_bytes": shape.block_len,
        "p50_us": round(lats[len(lats) // 2] * 1e6, 1),
        "p99_us": round(lats[min(len(lats) - 1, len(lats) * 99 // 100)]
                        * 1e6, 1),
        "mismatched_blocks": bad, "verified": bad == 0,
        "notifs": notifs, "setup_s": round(setup_s, 2),
        "telemetry": tel,
    }


def telemetry(agent: Any, shape: Shape, local_h: Any, remote_h: Any,
              local: list[int], remote: list[int]) -> dict[str, Any]:
    """One request, alone, with NIXL's own numbers where it has them:
    the descriptors it posted (after merging) and the backend."""
    h = agent.make_prepped_xfer("READ", local_h, desc_ids(shape, local),
                                remote_h, desc_ids(shape, remote),
                                notif_msg=b"one:1")
    t0 = time.perf_counter()
    agent.transfer(h)
    while (st := agent.check_xfer_state(h)) == "PROC":
        pass
    us = (time.perf_counter() - t0) * 1e6
    out: dict[str, Any] = {"one_request_us": round(us, 1), "state": st}
    try:
        out["backend"] = agent.query_xfer_backend(h)
    except Exception as e:  # older wheels lack it
        out["backend"] = f"unknown ({e})"
    try:
        t = agent.get_xfer_telemetry(h)
        out["desc_count"] = int(t.descCount)
        out["total_bytes"] = int(t.totalBytes)
        out["post_us"] = int(t.postDuration)
        out["xfer_us"] = int(t.xferDuration)
    except Exception as e:  # telemetry is off unless the agent asked
        out["telemetry"] = f"off ({type(e).__name__})"
    agent.release_xfer_handle(h)
    return out


def nixl_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("nixl-cu13")
    except metadata.PackageNotFoundError:
        return "unknown"


def ucx_version() -> str:
    """The version of the UCX that NIXL's wheel carries (its own copy)."""
    import ctypes
    import glob
    try:
        import nixl_cu13
        libs = os.path.join(os.path.dirname(nixl_cu13.__file__), "..",
                            "nixl_cu13.libs", "libucp-*.so*")
        f = ctypes.CDLL(glob.glob(libs)[0]).ucp_get_version_string
        f.restype = ctypes.c_char_p
        return f().decode()
    except (ImportError, IndexError, OSError, AttributeError):
        return "unknown"


def read_tables(log: str) -> list[tuple[str, str, list[str]]]:
    """UCX_PROTO_INFO=y tables of remote memory reads, once each: (scope,
    operation, ["range: description: config", ...])."""
    out: list[tuple[str, str, list[str]]] = []
    rows: list[str] = []
    with open(log, errors="replace") as f:
        for line in f:
            cut = line.find("]   ")  # past "[time] [host:pid:thread]"
            if cut < 0:
                continue
            rows.append(line[cut + 4:].strip())
    i = 0
    while i < len(rows):
        cells = [c.strip() for c in rows[i].strip("|").split("|")]
        if (len(cells) == 1 and "remote memory read" in cells[0] and i > 0
                and i + 4 < len(rows)):
            scope = rows[i - 1].strip("| ")
            scope = " ".join(scope.split()[1:])  # past the agent's name
            body = []
            j = i + 4  # past +---, the column names, +---
            while j < len(rows) and not rows[j].startswith("+"):
                c = [x.strip() for x in rows[j].strip("|").split("|")]
                body.append(": ".join(c))
                j += 1
            entry = (scope, cells[0], body)
            if entry not in out:
                out.append(entry)
            i = j
        i += 1
    return out


def report(kvx_path: str, nixl_path: str, log: str) -> int:
    def lines(path: str) -> list[dict[str, Any]]:
        try:
            with open(path) as f:
                return [json.loads(x) for x in f if x.startswith("{")]
        except OSError:
            return []

    kvx = {r["order"]: r for r in lines(kvx_path)}
    nixl = {r["order"]: r for r in lines(nixl_path)}
    orders = [o for o in ("same", "shuffled") if o in kvx or o in nixl]
    if not orders:
        print("compare-nixl: no results (see run.log)")
        return 1
    one = next(iter(nixl.values()), None) or next(iter(kvx.values()))
    gpu = one.get("mem", "vram" if one.get("gpu") else "dram") == "vram"
    where = "host memory"
    if gpu:
        a, b = one.get("remote_device", 0), one.get("device", 0)
        where = f"GPU {a}" + ("" if a == b else f" to GPU {b}")
    print(f"kvxfer beside NIXL, {where}: "
          f"{one['requests']} requests x {one['blocks']} blocks of 2 MiB "
          f"(32 layers x K, V x 32 KiB), window {one['window']}")
    head = ("order", "kvxfer GB/s", "NIXL GB/s", "memcpy GB/s",
            "kvxfer/memcpy", "NIXL/memcpy", "kvxfer/NIXL",
            "NIXL descs/request", "verified")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def f(x: Any, d: int = 1) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    def ratio(x: Any) -> str:
        if x is None:
            return "-"
        return (f"{x:.0f}" if x >= 100 else f"{x:.3f}" if x >= 0.01 else
                f"{x:.1e}")

    for o in orders:
        k, n = kvx.get(o, {}), nixl.get(o, {})
        kg, ng = k.get("gbps"), n.get("gbps")
        base = k.get("baseline_gbps") or n.get("baseline_gbps")
        descs = (f"{n['descs_per_request']} given, "
                 f"{n['descs_posted_per_request']} posted" if n else "-")
        ver = ("yes" if k.get("verified") and n.get("verified") else
               f"kvxfer {k.get('verified')}, NIXL {n.get('verified')}")
        print(f"| {o} | {f(kg)} | {f(ng)} | {f(base)} | "
              f"{ratio(kg / base if kg and base else None)} | "
              f"{ratio(ng / base if ng and base else None)} | "
              f"{ratio(kg / ng if kg and ng else None)} | {descs} | {ver} |")
    for o in orders:
        for name, got in (("kvxfer", kvx), ("NIXL", nixl)):
            if o not in got:
                print(f"{name} {o}: no result (it failed or ran out of "
                      "time: run.log and nixl-ucx.log say which)")
    own = ", ".join(f"{o} {f(nixl[o]['baseline_gbps'])}"
                    for o in orders if o in nixl)
    print("memcpy: kvxfer-bench's baseline in the same run (" +
          ("cudaMemcpy, or cudaMemcpyPeer between two GPUs" if gpu else
           "memcpy") + "); NIXL's process measured " +
          ("within its GPU " if gpu else "") + own + " GB/s")
    for o in orders:
        n = nixl.get(o)
        if n:
            t = n.get("telemetry", {})
            part = ("" if n.get("requests_timed", n["requests"]) ==
                    n["requests"] else
                    f" of the first {n['requests_timed']} requests (a pass "
                    "of all would not fit --budget-s)")
            print(f"NIXL {o}: nixl-cu13 {n.get('nixl_version')}, UCX "
                  f"{n.get('ucx_version')}; {n['passes']} timed passes"
                  f"{part} {n['pass_gbps']}; p50 {n['p50_us']} us, p99 "
                  f"{n['p99_us']} us a request; one request alone "
                  f"{t.get('one_request_us')} us, posting it "
                  f"{t.get('post_us')} us")
    print("NIXL's UCX, READ (UCX_PROTO_INFO=y):")
    tables = read_tables(log) if os.path.exists(log) else []
    if not tables:
        print("  no 'remote memory read' table in " + log)
    for scope, op, body in tables:
        print(f"  {scope}: {op}: " + "; ".join(body))
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--report":
        return report(*sys.argv[2:5])
    ap = argparse.ArgumentParser(
        description="NIXL READs of KV cache blocks, vLLM's way")
    ap.add_argument("--mem", choices=["vram", "dram"], default="vram")
    ap.add_argument("--device", type=int, default=0,
                    help="the decode pool's GPU")
    ap.add_argument("--remote-device", type=int, default=None,
                    help="the prefill pool's GPU (default: --device)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--elem-bytes", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=30.0,
                    help="timed passes (and, when one pass would not fit, "
                    "the requests of a pass) are cut to what fits in this "
                    "many seconds at the first request's pace")
    ap.add_argument("--order", choices=["same", "shuffled"], default="same")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="append the JSON line to this file")
    args = ap.parse_args()
    if args.remote_device is None:
        args.remote_device = args.device
    if args.mem == "vram":
        try:
            import torch
        except ImportError:
            print("nixl_bench: --mem vram needs torch", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("nixl_bench: no CUDA device (try --mem dram)",
                  file=sys.stderr)
            return 2
    try:
        import_nixl()
    except ImportError as e:
        print(f"nixl_bench: NIXL is not importable: {e}", file=sys.stderr)
        return 2
    res = decode_main(args)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    elif args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:24s} {v}")
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # NIXL's threads can outlive the interpreter's teardown and crash it
    os._exit(rc)
