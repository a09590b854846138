#!/usr/bin/env python3
"""A real transformer, disaggregated through kvxfer (make test-gpu,
make demo-gpu).

A small Llama-architecture model (random weights from a fixed seed,
nothing downloaded, bf16 on the GPU) prefills a prompt in a "prefill"
process, which writes the prompt's K/V into a paged GPU pool (vLLM's NHD
layout, 16 tokens per block, a tensor per layer, registered with kvxfer
as a pool of regions) and publishes it, with the first generated token as
the aux payload. A "decode" process with its own paged pool in another
layout and block size (FlashInfer, 32 tokens per block) fetches it
through the daemon, rebuilds its attention cache from its blocks and
decodes greedily. Its tokens must equal those of the same model decoding
after a colocated prefill, and its last logits agree within bf16
rounding. Cases: prefill TP 1 -> decode TP 1; prefill split as TP 2 (two
processes, each storing half of the KV heads) -> TP 1; and a decode that
holds a prefix of the prompt already (skip_tokens).

  real_model.py test [--kvxferd PATH]     the three cases; last line
                                          "N passed, N failed"
  real_model.py demo [--tokens 4096]      prefill, transfer and decode
                                          times for one long prompt

Needs torch with CUDA and transformers; the kvxfer package and library
from this tree (KVXFER_LIB, PYTHONPATH) and a CUDA-built kvxferd. The
model and the paged pools are examples/paged_llama.py's (shared with the
router example, examples/router.py).
"""
import argparse
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# the model and the paged pools (examples/paged_llama.py; a bundle keeps
# it beside this file)
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "examples")]
from paged_llama import (HD, KV_HEADS, L, decode_from,  # noqa: E402
                         flashinfer_tensors, kvx, model, prompt_of,
                         read_flashinfer, start_daemon, vllm_nhd_tensors,
                         write_flashinfer, write_vllm_nhd)
from paged_llama import colocated as _colocated  # noqa: E402

NEW = 32  # tokens decoded
LOGIT_TOL = 0.1  # bf16 rounding of a rebuilt cache (notes: <= 0.02 seen)


def colocated(prompt):
    return _colocated(prompt, NEW, device="cuda", dtype=torch.bfloat16)


def prefill_main(sock, rank, tp, prompt, key, q, times):
    kvxfer = kvx()
    torch.cuda.set_device(0)
    m = model()
    T, tpb = len(prompt), 16
    nb = math.ceil(T / tpb) + 3
    kvh = KV_HEADS // tp
    c = kvxfer.Client(sock, instance_id="prefill", role="context", rank=rank,
                      parallel=kvxfer.Parallel(tp=tp, total_layers=L,
                                               total_kv_heads=KV_HEADS),
                      timeout=30)
    c.join([c.daemon_address] * tp)  # every rank on this one daemon
    lay = kvxfer.Layout.preset("vllm-nhd", num_layers=L, num_heads=kvh,
                               head_dim=HD, dtype="bf16",
                               tokens_per_block=tpb, num_blocks=nb)
    lay = lay.with_first_head(rank * kvh)
    # vLLM keeps a tensor per layer: [2 (K, V), blocks, tokens, heads, dim]
    tensors = vllm_nhd_tensors(nb, tpb, kvh, "cuda", torch.bfloat16)
    pool = c.register_pool(tensors, lay)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = m(prompt[None].cuda(), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    need = math.ceil(T / tpb)
    blocks = list(range(nb - 1, nb - 1 - need, -1))  # any order works
    write_vllm_nhd(tensors, out.past_key_values, blocks, tpb, T,
                   first_head=rank * kvh, heads=kvh)
    torch.cuda.synchronize()
    times["prefill_s"] = time.perf_counter() - t0
    end = time.time() + 60
    while True:  # until every rank of the instance said hello
        try:
            params = c.publish(key, pool, blocks, num_tokens=T,
                               aux=first.to_bytes(4, "little"))
            break
        except kvxfer.StateError:
            if time.time() > end:
                raise
            time.sleep(0.05)
    times["published_at"] = time.time()
    if rank == 0:
        q.put(params)
    while True:  # every rank polls until the offer is complete
        done = [e for e in c.poll(1, 0.2) if e.key == key.encode()]
        if done:
            done[0].raise_for_status()
            break
    c.close()


def decode_main(sock, q, res, T, skip, prompt, key, times):
    kvxfer = kvx()
    torch.cuda.set_device(0)
    m = model()
    tpb = 32
    nb = math.ceil(T / tpb) + 5
    c = kvxfer.Client(sock, instance_id="decode", role="generation",
                      parallel=kvxfer.Parallel(tp=1, total_layers=L,
                                               total_kv_heads=KV_HEADS),
                      timeout=30)
    c.join([c.daemon_address])
    lay = kvxfer.Layout.preset("flashinfer", num_layers=L,
                               num_heads=KV_HEADS, head_dim=HD, dtype="bf16",
                               tokens_per_block=tpb, num_blocks=nb)
    # FlashInfer's paged cache per layer: [blocks, 2, tokens, heads, dim]
    tensors = flashinfer_tensors(nb, tpb, "cuda", torch.bfloat16)
    pool = c.register_pool(tensors, lay)
    need = math.ceil(T / tpb)
    import random
    blocks = random.Random(3).sample(range(nb), need)  # scattered
    if skip:  # the decode side holds a prefix already: its own prefill
        with torch.no_grad():
            out = m(prompt[:skip][None].cuda(), use_cache=True)
        write_flashinfer(tensors, out.past_key_values, blocks, tpb, skip)
        torch.cuda.synchronize()
    params = q.get()
    t0 = time.time()
    c.fetch("dec-" + key, params, pool, blocks, skip_tokens=skip)
    while True:
        got = [e for e in c.poll(1, 0.2) if e.key == ("dec-" + key).encode()]
        if got:
            ev = got[0].raise_for_status()
            break
    times["transfer_s"] = time.time() - max(t0, times.get("published_at", 0))
    first = int.from_bytes(ev.aux, "little")
    cache = read_flashinfer(tensors, blocks, T, "cuda")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    toks, logits = decode_from(m, cache, first, NEW)
    torch.cuda.synchronize()
    times["decode_s_per_token"] = (time.perf_counter() - t1) / (NEW - 1)
    res.put((toks, logits.tolist()))  # plain data: this process ends
    c.close()


def run_case(kvxferd, T, tp, skip, key):
    """Disaggregated tokens and logits, and the timings."""
    prompt = prompt_of(T)
    ctx = mp.get_context("spawn")
    mgr = ctx.Manager()
    times = mgr.dict()
    with tempfile.TemporaryDirectory() as d:
        daemon, sock = start_daemon(kvxferd, d)
        try:
            q, res = ctx.Queue(), ctx.Queue()
            procs = [ctx.Process(target=prefill_main,
                                 args=(sock, r, tp, prompt, key, q, times))
                     for r in range(tp)]
            procs.append(ctx.Process(target=decode_main,
                                     args=(sock, q, res, T, skip, prompt, key,
                                           times)))
            for p in procs:
                p.start()
            import queue
            end = time.time() + 600
            while True:  # a process that dies ends the case at once
                try:
                    toks, logits = res.get(timeout=1)
                    logits = torch.tensor(logits)
                    break
                except queue.Empty:
                    bad = [p for p in procs if p.exitcode not in (None, 0)]
                    if bad or time.time() > end:
                        for p in procs:
                            p.kill()
                        raise RuntimeError(
                            "a process failed" if bad else "no result in "
                            "600 s")
            for p in procs:
                p.join(60)
                if p.exitcode:
                    raise RuntimeError(f"a process failed ({p.exitcode})")
        finally:
            daemon.terminate()
            daemon.wait(10)
    return toks, logits, dict(times)


def test(kvxferd, only=None):
    T = 300
    ref_toks, ref_logits = colocated(prompt_of(T))
    passed = failed = 0
    for name, tp, skip in (("tp1-to-tp1", 1, 0), ("tp2-to-tp1", 2, 0),
                           ("prefix-held", 1, 100)):
        if only and name != only:
            continue
        try:
            toks, logits, _ = run_case(kvxferd, T, tp, skip, "req-" + name)
            diff = float((logits - ref_logits).abs().max())
            ok = toks == ref_toks and diff <= LOGIT_TOL
            print(f"{'ok' if ok else 'FAIL'} real_model {name}: "
                  f"{NEW} tokens {'equal' if toks == ref_toks else 'DIFFER'}"
                  f", last logits max |diff| {diff:.4f} (bf16 tolerance "
                  f"{LOGIT_TOL})", flush=True)
            if toks != ref_toks:
                print(f"  colocated {ref_toks}\n  disagg    {toks}")
        except Exception as e:  # one failing case does not hide the others
            import traceback
            ok = False
            print(f"FAIL real_model {name}: {e!r}", flush=True)
            traceback.print_exc()
        passed += ok
        failed += not ok
    print(f"{passed} passed, {failed} failed")
    return failed == 0


def demo(kvxferd, tokens):
    prompt = prompt_of(tokens)
    t0 = time.perf_counter()
    ref_toks, _ = colocated(prompt)
    colo = time.perf_counter() - t0
    toks, logits, t = run_case(kvxferd, tokens, 1, 0, "demo")
    kv_bytes = tokens * L * 2 * KV_HEADS * HD * 2
    print(f"prompt {tokens} tokens, {L} layers x {KV_HEADS} KV heads x "
          f"{HD} dim, bf16: {kv_bytes / 2**20:.1f} MiB of KV")
    print(f"prefill              {t['prefill_s'] * 1e3:9.1f} ms")
    print(f"transfer (kvxfer)    {t['transfer_s'] * 1e3:9.1f} ms "
          f"(publish to the decode's COMPLETE)")
    print(f"decode               {t['decode_s_per_token'] * 1e3:9.2f} ms per "
          f"token")
    print(f"colocated run        {colo:9.2f} s (prefill + {NEW} tokens, "
          f"model load included)")
    print(f"tokens equal to the colocated run: {toks == ref_toks}")
    return toks == ref_toks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["test", "demo"])
    ap.add_argument("--kvxferd", default=os.environ.get(
        "KVXFERD", os.path.join(HERE, "..", "..", "build", "kvxferd")))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--only", help="test: this case only")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("real_model: skipped: no CUDA torch")
        print("0 passed, 0 failed")
        return 0
    ok = (test(a.kvxferd, a.only) if a.what == "test"
          else demo(a.kvxferd, a.tokens))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
