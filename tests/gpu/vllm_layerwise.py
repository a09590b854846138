#!/usr/bin/env python3
"""The vLLM connector's worker half on a real transformer, layer-wise
(make test-gpu; the measurement: scripts/gpu-measure-layerwise.sh).

A prefill process runs examples/paged_llama.py's model (a random-weight
Llama, bf16 on the GPU). A forward hook on each decoder layer writes the
layer's K/V into KV caches shaped as vLLM 0.33's (a [blocks, heads,
tokens, K|V] view per layer over one NHD allocation, 16 tokens a block),
then goes through the connector's save_kv_layer path
(``kvxfer.vllm.worker._Worker.save_layer``: the layer-wise publish at the
first layer, one interprocess CUDA event per layer recorded on the
forward's stream, kvx_ready), and the forward ends with wait_for_save's
(``end_save``). A decode process, another worker half (HND, 32 tokens a
block), fetches the request as vLLM's decode does (start_load_kv's
metadata, then get_finished each step), rebuilds the cache of the
prompt's first T - 1 tokens from its blocks, computes the last prompt
token (vLLM's decode does the same) and decodes greedily: its tokens
must equal a colocated run's.

  vllm_layerwise.py test [--kvxferd PATH]
      layer-wise, 300 and 4096 tokens; last line "N passed, N failed"
  vllm_layerwise.py measure [--tokens 4096] [--reps 9] [--layers 4]
                            [--hidden 512 --heads 8 --kv-heads 4]
                            [--daemons 1|2]
      the time from the prefill's last layer (the GPU reached its end)
      to the decode's first token, layer-wise and whole-request (the
      baseline: the offer published after the forward and the sampled
      token, as vLLM publishes a finished request), both from this run,
      medians and their ratio; and, to read them by, the prefill's
      forward (GPU time) and the decode's part after its KV landed
      (cache rebuild, forward). The decode's fetch is made before the
      prefill's forward in both (it waits for the offer), so the two
      differ only in when the prefill's layers may move. Another shape
      than the test model's is built on the GPU (random weights, bf16).
      --daemons 2: the decode on a daemon of its own, the two peers over
      UCX on 127.0.0.1 (a transfer between daemons, as between nodes).

No vLLM is needed (the GPU machine has none): the worker half imports
only ``KVConnectorMetadata`` and ``KVConnectorHandshakeMetadata`` from
vLLM, which a short shim provides
(``shim_vllm``), and ``kvxfer.vllm``'s package ``__init__`` (which loads
the vLLM-facing connector) is skipped by registering the package's path
alone. With vLLM installed, the real classes are used.
"""

import argparse
import math
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import types
from typing import Any, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "examples")]
import paged_llama as pl  # noqa: E402

NEW = 32  # tokens decoded in the check
P_TPB, D_TPB = 16, 32  # tokens per block: prefill (vLLM's), decode
_KEEP: List[Any] = []  # host buffers behind the host pools


def set_shape(shape: Dict[str, int]) -> None:
    """The model's shape in paged_llama's constants (every process)."""
    for k, v in shape.items():
        setattr(pl, k, v)
    pl.HD = pl.HIDDEN // pl.HEADS


def build_model(dev: str, dtype: torch.dtype) -> Any:
    """paged_llama's model; another shape: made on the device in dtype
    (a large one would not fit the host's fp32 first)."""
    if (pl.HIDDEN, pl.HEADS, pl.KV_HEADS) == (512, 8, 4):
        return pl.model(dev, dtype)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=pl.VOCAB, hidden_size=pl.HIDDEN,
                      intermediate_size=2 * pl.HIDDEN,
                      num_hidden_layers=pl.L, num_attention_heads=pl.HEADS,
                      num_key_value_heads=pl.KV_HEADS,
                      max_position_embeddings=16384)
    torch.manual_seed(0)
    was = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(was)


def shim_vllm() -> Any:
    """kvxfer.vllm's worker half without vLLM's package: the kvxfer
    package, a kvxfer.vllm package that skips its __init__ (the
    vLLM-facing connector), and, when vLLM is missing, the one vLLM class
    the worker half's metadata derives from."""
    kvxfer = pl.kvx()
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
                 "vllm.distributed.kv_transfer.kv_connector",
                 "vllm.distributed.kv_transfer.kv_connector.v1",
                 "vllm.distributed.kv_transfer.kv_connector.v1.base"]
        for n in names:
            if sys.modules.get(n) is None:
                sys.modules[n] = types.ModuleType(n)
        base = sys.modules[names[-1]]
        base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
        base.KVConnectorHandshakeMetadata = type(
            "KVConnectorHandshakeMetadata", (), {})
    if "kvxfer.vllm" not in sys.modules:
        pkg = types.ModuleType("kvxfer.vllm")
        pkg.__path__ = [os.path.join(os.path.dirname(kvxfer.__file__),
                                     "vllm")]
        sys.modules["kvxfer.vllm"] = pkg
    return kvxfer


def config(sock: str, name: str, role: str, tpb: int,
           extra: Dict[str, Any]) -> Any:
    """The parts of vLLM's VllmConfig the worker half reads."""
    ns = types.SimpleNamespace
    return ns(
        model_config=ns(get_head_size=lambda: pl.HD,
                        get_total_num_kv_heads=lambda: pl.KV_HEADS,
                        get_total_num_hidden_layers=lambda: pl.L,
                        use_mla=False),
        cache_config=ns(block_size=tpb),
        kv_transfer_config=ns(kv_role=role, engine_id=name,
                              kv_connector_extra_config={
                                  "socket": sock, "timeout_s": 30, **extra}),
        parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1,
                           rank=0))


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def kv_caches(nb: int, tpb: int, nhd: bool, device: str,
              dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """vLLM 0.33's per-layer [blocks, heads, tokens, K|V] views over one
    allocation; NHD (tokens before heads) underneath, or HND. Host: a
    kvxfer.HostBuffer (memory the daemon maps)."""
    shape = (pl.L, nb, tpb, pl.KV_HEADS, 2 * pl.HD) if nhd else \
        (pl.L, nb, pl.KV_HEADS, tpb, 2 * pl.HD)
    if device == "cuda":
        raw = torch.zeros(shape, dtype=dtype, device="cuda")
    else:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buf = pl.kvx().HostBuffer(n)
        _KEEP.append(buf)
        raw = buf.torch(dtype, shape)
    return {layer_name(i): raw[i].permute(0, 2, 1, 3) if nhd else raw[i]
            for i in range(pl.L)}


def write_layer(view: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                blocks: torch.Tensor, tpb: int) -> None:
    """Write [heads, T, dim] keys and values into blocks (in order) of a
    [blocks, heads, tokens, K|V] view."""
    T = k.shape[1]
    pad = len(blocks) * tpb - T
    kv = torch.cat([k, v], dim=-1)  # [H, T, 2 dim]
    kv = torch.nn.functional.pad(kv, (0, 0, 0, pad))
    kv = kv.view(kv.shape[0], len(blocks), tpb, kv.shape[-1])
    view[blocks] = kv.permute(1, 0, 2, 3).to(view.dtype)


def read_cache(caches: Dict[str, torch.Tensor], blocks: List[int],
               n: int) -> Any:
    """A transformers cache of tokens [0, n) read from blocks (in
    order) of the views."""
    from transformers import DynamicCache
    cache = DynamicCache()
    for i in range(pl.L):
        t = caches[layer_name(i)][blocks]  # [nb, H, tpb, 2 dim]
        t = t.permute(1, 0, 2, 3).reshape(pl.KV_HEADS, -1, 2 * pl.HD)[:, :n]
        cache.update(t[None, :, :, :pl.HD].contiguous(),
                     t[None, :, :, pl.HD:].contiguous(), i)
    return cache


def prefill_main(sock, device, shape, prompts, jobs, to_decode, started,
                 results):
    set_shape(shape)
    kvxfer = shim_vllm()
    from kvxfer.vllm.common import (KvxferConnectorMetadata, LayerChunk,
                                    Send)
    from kvxfer.vllm.worker import _Worker
    dev, dtype = pl.device_dtype(device)
    m = build_model(dev, dtype)
    Tmax = max(len(p) for p in prompts.values())
    nb = math.ceil(Tmax / P_TPB) + 8
    caches = kv_caches(nb, P_TPB, True, dev, dtype)
    w = _Worker(config(sock, "prefill", "kv_producer", P_TPB, {}))
    w.register(caches)
    sched = kvxfer.Client(sock, timeout=30)  # the scheduler half's
    while True:
        job = jobs.get()
        if job is None:
            break
        rid, mode, name = job
        prompt = prompts[name]
        T = len(prompt)
        key = rid.encode()
        need = math.ceil(T / P_TPB)
        blocks = list(range(nb - 1, nb - 1 - need, -1))  # any order
        bt = torch.tensor(blocks, device=dev)
        # the scheduler: reserve; the params go to the decode, whose
        # fetch waits for the offer
        params = sched.reserve("prefill", key, T)
        to_decode.put((rid, name, params))
        assert started.get(timeout=60) == rid
        lw = mode == "layerwise"
        meta = KvxferConnectorMetadata(chunks={rid: LayerChunk(
            key=key, blocks=blocks, num_tokens=T, tokens=T, publish=True)}
            if lw else {})
        from transformers import DynamicCache
        cache = DynamicCache()
        last = torch.cuda.Event(enable_timing=True) if dev == "cuda" \
            else None
        begin = torch.cuda.Event(enable_timing=True) if last else None
        if begin is not None:
            begin.record()
        hooks = []
        cpu_last: List[float] = []  # host: the last layer's end, here

        def after(i):
            def hook(mod, args, out):
                lay = cache.layers[i]
                name_i = layer_name(i)
                write_layer(caches[name_i], lay.keys[0], lay.values[0], bt,
                            P_TPB)
                if lw:  # vLLM's maybe_transfer_kv_layer: save_kv_layer
                    w.save_layer(meta, name_i, caches[name_i])
                if i == pl.L - 1 and last is not None:
                    last.record()
                elif i == pl.L - 1:
                    cpu_last.append(time.time())
            return hook
        for i, layer in enumerate(m.model.layers):
            hooks.append(layer.register_forward_hook(after(i)))
        try:
            with torch.no_grad():
                out = m(prompt[None].to(dev), past_key_values=cache,
                        use_cache=True)
            if lw:
                w.end_save(meta)  # wait_for_save
        finally:
            for h in hooks:
                h.remove()
        if last is not None:
            last.synchronize()
        # the GPU reached the end of the last layer (host: it ended then)
        t_last = cpu_last[0] if cpu_last else time.time()
        fwd_ms = begin.elapsed_time(last) if begin is not None else 0.0
        first = int(out.logits[0, -1].argmax())  # sampled: request done
        if lw:
            # the next step's metadata: vLLM finished the request
            done = KvxferConnectorMetadata(lw_finished={rid: True})
        else:
            # vLLM's whole-request publish, the step after it finished
            done = KvxferConnectorMetadata(sends={rid: Send(
                key=key, block_ids=blocks, num_tokens=T)})
            w.start(done)
        w.end_save(done)
        end = time.time() + 60
        while True:  # the offer ended: vLLM may free the blocks
            sending, _ = w.get_finished()
            if sending and rid in sending:
                break
            if time.time() > end:
                raise RuntimeError(f"{rid}: the offer did not end")
            time.sleep(0.0005)
        results.put(("prefill", rid, {"t_last": t_last, "first": first,
                                      "marks": w.lw.marks_made,
                                      "forward_ms": fwd_ms}))
    w.close()
    sched.close()


def decode_main(sock, device, shape, prompts, to_decode, started,
                results, new):
    set_shape(shape)
    shim_vllm()
    from kvxfer.vllm.common import KvxferConnectorMetadata, Recv
    from kvxfer.vllm.worker import _Worker
    dev, dtype = pl.device_dtype(device)
    m = build_model(dev, dtype)
    Tmax = max(len(p) for p in prompts.values())
    nb = math.ceil(Tmax / D_TPB) + 8
    caches = kv_caches(nb, D_TPB, False, dev, dtype)
    w = _Worker(config(sock, "decode", "kv_consumer", D_TPB, {}))
    w.register(caches)
    import random
    while True:
        job = to_decode.get()
        if job is None:
            break
        rid, name, params = job
        prompt = prompts[name]
        T = len(prompt)
        blocks = random.Random(3).sample(range(nb), math.ceil(T / D_TPB))
        w.start(KvxferConnectorMetadata(recvs={rid: Recv(
            key=rid.encode(), params=params, block_ids=blocks,
            skip_tokens=0, num_tokens=T)}))
        started.put(rid)
        end = time.time() + 60
        while True:  # the engine's steps: get_finished each
            _, recving = w.get_finished()
            if recving and rid in recving:
                t_landed = time.time()
                break
            if time.time() > end:
                raise RuntimeError(f"{rid}: the fetch did not end")
            time.sleep(0.0001)
        errors = w.take_load_errors()
        if errors:
            raise RuntimeError(f"{rid}: load errors in {sorted(errors)}")
        # vLLM's decode: the prompt's first T - 1 tokens loaded, the last
        # one computed, its logits give the first token
        cache = read_cache(caches, blocks, T - 1)
        with torch.no_grad():
            out = m(prompt[T - 1:][None].to(dev), past_key_values=cache,
                    use_cache=True)
        first = int(out.logits[0, -1].argmax())
        t_first = time.time()
        toks = pl.decode_from(m, cache, first, new)[0] if new else [first]
        results.put(("decode", rid, {"t_first": t_first, "toks": toks,
                                     "t_landed": t_landed}))
    w.close()


def start_daemons(kvxferd: str, d: str, n: int) -> List[Any]:
    """n daemons (1 or 2: the prefill's and the decode's, peers over
    UCX on 127.0.0.1 with a fresh secret): [(process, socket)]."""
    if n == 1:
        return [pl.start_daemon(kvxferd, d)]
    secret = os.path.join(d, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    cfg = f'peer:\n  listen: "127.0.0.1:0"\n  secret_file: "{secret}"\n'
    out = []
    for name in ("prefill", "decode"):
        os.mkdir(os.path.join(d, name))
        out.append(pl.start_daemon(kvxferd, os.path.join(d, name), cfg))
    return out


def run(kvxferd, device, shape, prompts, plan, new, daemons=1):
    """Run plan ([(request id, mode, prompt name)]) through a prefill
    and a decode process (on one daemon, or each on its own); {request
    id: what both said of it}."""
    ctx = mp.get_context("spawn")
    jobs, to_decode, started, results = (ctx.Queue() for _ in range(4))
    out: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        ds = start_daemons(kvxferd, d, daemons)
        procs = [ctx.Process(target=prefill_main, args=(
                     ds[0][1], device, shape, prompts, jobs, to_decode,
                     started, results)),
                 ctx.Process(target=decode_main, args=(
                     ds[-1][1], device, shape, prompts, to_decode, started,
                     results, new))]
        try:
            for p in procs:
                p.start()
            for rid, mode, name in plan:
                jobs.put((rid, mode, name))
                got: Dict[str, Any] = {}
                end = time.time() + 300
                while "prefill" not in got or "decode" not in got:
                    try:
                        who, r, said = results.get(timeout=1)
                        assert r == rid, (r, rid)
                        got.update(said)
                        got[who] = True
                    except queue.Empty:
                        bad = [p for p in procs if p.exitcode is not None]
                        if bad or time.time() > end:
                            raise RuntimeError(
                                "a process ended" if bad else
                                f"{rid}: no result in 300 s")
                out[rid] = got
            jobs.put(None)
            to_decode.put(None)
            for p in procs:
                p.join(60)
                if p.exitcode:
                    raise RuntimeError(f"a process failed ({p.exitcode})")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for daemon, _ in ds:
                daemon.terminate()
                daemon.wait(10)
    return out


def test(kvxferd, device):
    passed = failed = 0
    prompts = {"300": pl.prompt_of(300), "4096": pl.prompt_of(4096, 2)}
    refs = {n: pl.colocated(p, NEW, device=device,
                            dtype=pl.device_dtype(device)[1])[0]
            for n, p in prompts.items()}
    plan = [(f"lw-{n}", "layerwise", n) for n in prompts]
    try:
        res = run(kvxferd, device, {}, prompts, plan, NEW)
    except Exception as e:  # reported as a failure, with its trace
        import traceback
        traceback.print_exc()
        print(f"FAIL vllm_layerwise: {e!r}")
        print(f"0 passed, {len(plan)} failed")
        return False
    for rid, _, n in plan:
        toks, first, marks = (res[rid][k] for k in ("toks", "first",
                                                    "marks"))
        ok = toks == refs[n] and first == refs[n][0] and marks > 0
        print(f"{'ok' if ok else 'FAIL'} vllm_layerwise {n} tokens: "
              f"layer-wise through the worker half ({marks} layers marked "
              f"so far), {NEW} tokens "
              f"{'equal' if toks == refs[n] else 'DIFFER'} to the colocated "
              "run's", flush=True)
        if toks != refs[n]:
            print(f"  colocated {refs[n]}\n  disagg    {toks}")
        passed += ok
        failed += not ok
    print(f"{passed} passed, {failed} failed")
    return failed == 0


def measure(kvxferd, device, tokens, reps, shape, daemons):
    prompts = {"p": pl.prompt_of(tokens, 5)}
    plan = [("warm-w", "whole", "p"), ("warm-l", "layerwise", "p")]
    for i in range(reps):  # alternated: drift falls on both
        plan += [(f"w{i}", "whole", "p"), (f"l{i}", "layerwise", "p")]
    res = run(kvxferd, device, shape, prompts, plan, 0, daemons)
    set_shape(shape)
    gap: Dict[str, List[float]] = {"whole": [], "layerwise": []}
    tail: Dict[str, List[float]] = {"whole": [], "layerwise": []}
    land: Dict[str, List[float]] = {"whole": [], "layerwise": []}
    fwd: Dict[str, List[float]] = {"whole": [], "layerwise": []}
    for rid, mode, _ in plan:
        if rid.startswith("warm"):
            continue
        r = res[rid]
        gap[mode].append((r["t_first"] - r["t_last"]) * 1e3)
        tail[mode].append((r["t_first"] - r["t_landed"]) * 1e3)
        land[mode].append((r["t_landed"] - r["t_last"]) * 1e3)
        fwd[mode].append(r["forward_ms"])
    kv = tokens * pl.L * 2 * pl.KV_HEADS * pl.HD * \
        torch.empty((), dtype=pl.device_dtype(device)[1]).element_size()
    dt = str(pl.device_dtype(device)[1]).replace("torch.", "")
    print(f"model: {pl.L} layers, hidden {pl.HIDDEN}, {pl.HEADS} heads, "
          f"{pl.KV_HEADS} KV heads x {pl.HD} dim, {dt}; prompt {tokens} "
          f"tokens: {kv / 2**20:.1f} MiB of KV; {reps} requests each, "
          "alternated; " + ("one daemon" if daemons == 1 else
                            "two daemons (the prefill's and the decode's, "
                            "UCX on 127.0.0.1)"))
    med = statistics.median
    print("the prefill's last layer -> the decode's first token (ms):")
    for mode in ("whole", "layerwise"):
        xs = gap[mode]
        print(f"  {mode:10s} median {med(xs):8.3f}  min {min(xs):8.3f}  "
              f"max {max(xs):8.3f}   (prefill forward {med(fwd[mode]):.3f}"
              f" ms GPU; decode after its KV landed {med(tail[mode]):.3f} "
              "ms)")
    r = med(gap["whole"]) / med(gap["layerwise"])
    print(f"ratio whole / layer-wise (medians): {r:.2f}x")
    print("of which the prefill's last layer -> the KV landed at the "
          "decode (its get_finished; ms):")
    for mode in ("whole", "layerwise"):
        xs = land[mode]
        print(f"  {mode:10s} median {med(xs):8.3f}  min {min(xs):8.3f}  "
              f"max {max(xs):8.3f}")
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["test", "measure"])
    ap.add_argument("--kvxferd", default=os.environ.get(
        "KVXFERD", os.path.join(HERE, "..", "..", "build", "kvxferd")))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=pl.L)
    ap.add_argument("--hidden", type=int, default=pl.HIDDEN)
    ap.add_argument("--heads", type=int, default=pl.HEADS)
    ap.add_argument("--kv-heads", type=int, default=pl.KV_HEADS)
    ap.add_argument("--daemons", type=int, choices=(1, 2), default=1,
                    help="measure: 2 puts the decode on a daemon of its "
                    "own (a transfer between daemons)")
    ap.add_argument("--device", default=None,
                    help="cpu: host pools and fp32 (a check of this script "
                    "without a GPU)")
    a = ap.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() else "")
    if not device:
        print("vllm_layerwise: skipped: no CUDA torch")
        print("0 passed, 0 failed")
        return 0
    if a.what == "test":
        ok = test(a.kvxferd, device)
    else:
        ok = measure(a.kvxferd, device, a.tokens, a.reps, {
            "L": a.layers, "HIDDEN": a.hidden, "HEADS": a.heads,
            "KV_HEADS": a.kv_heads}, a.daemons)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
