"""An instance of the stand-in executor: its ranks (a KvxferTransceiver
each, over one KVCacheManager each, built in threads as TensorRT-LLM's
ranks are processes), its requests (one LlmRequest per rank, as each
rank has its own), and what the coordinator does with them."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import standin as s
from standin import LlmRequestState as St

from kvxfer.trtllm import KvxferTransceiver

LAYERS, HEADS, HEAD_DIM, TPB, BLOCKS = 4, 4, 8, 8, 48


def in_threads(n: int, fn: Callable[[int], Any]) -> List[Any]:
    """fn(0..n-1), each in its own thread; the first error re-raised."""
    out: List[Any] = [None] * n
    errs: List[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: B902 - handed to the caller
            errs.append(e)
    ts = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errs:
        raise errs[0]
    return out


class Instance:
    """tp x pp ranks of one TensorRT-LLM instance on kvxferd at sock."""

    def __init__(self, sock: str, name: str, tp: int = 1, pp: int = 1, *,
                 seed: int = 0, extra_tokens: int = 0,
                 config: Optional[s.CacheTransceiverConfig] = None,
                 instance_id: Optional[str] = None,
                 attention_dp: bool = False, **kw: Any) -> None:
        self.name, self.tp, self.pp = name, tp, pp
        world = tp * pp
        ex = s._Exchange(world)
        alloc = s.BlockAllocator(BLOCKS, seed)
        self.config = config or s.CacheTransceiverConfig(
            backend="DEFAULT", kv_transfer_poll_interval_ms=200,
            kv_transfer_sender_future_timeout_ms=200,
            kv_transfer_timeout_ms=20000)
        self.maps = [s.Mapping(world, r, tp, pp,
                               enable_attention_dp=attention_dp)
                     for r in range(world)]
        self.kvms = [s.KVCacheManager(
            m, alloc, num_layers=LAYERS, num_kv_heads=HEADS,
            head_dim=HEAD_DIM, tokens_per_block=TPB, num_blocks=BLOCKS,
            extra_tokens=extra_tokens) for m in self.maps]

        def make(r: int) -> KvxferTransceiver:
            return KvxferTransceiver(
                self.maps[r], s.Distributed(self.maps[r], ex), self.kvms[r],
                self.config, socket=sock, instance_id=instance_id, **kw)
        self.ranks: List[KvxferTransceiver] = in_threads(world, make)

    def close(self) -> None:
        for t in self.ranks:
            t.shutdown()

    # -- requests -----------------------------------------------------------

    def context_requests(self, rid: int, prompt_len: int,
                         **kw: Any) -> List[s.LlmRequest]:
        return [s.LlmRequest(rid, prompt_len, s.DisaggregatedParams(
            request_type="context_only", **kw), context_only=True)
            for _ in self.ranks]

    def generation_requests(self, rid: int, ctx: s.LlmRequest,
                            **kw: Any) -> List[s.LlmRequest]:
        """What the serving layer makes of the context response: its
        ContextPhaseParams' endpoint as ctx_info_endpoint."""
        cpp = ctx.context_phase_params
        ep = cpp.disagg_info_endpoint if cpp is not None else None
        return [s.LlmRequest(rid, ctx.prompt_len, s.DisaggregatedParams(
            request_type="generation_only", ctx_request_id=ctx.request_id,
            ctx_info_endpoint=ep, **kw)) for _ in self.ranks]

    # -- the model's KV -----------------------------------------------------

    def _ranges(self, r: int):
        m, kvm = self.maps[r], self.kvms[r]
        h = kvm.num_kv_heads_per_layer[0]
        first = 0 if m.enable_attention_dp else m.tp_rank * h
        return kvm.pp_layers, range(first, first + h)

    def write(self, reqs: List[s.LlmRequest], full: torch.Tensor) -> None:
        """The prefill: each rank writes its layers and heads of ``full``
        [layers, kv, heads, tokens, dim] into the request's blocks."""
        n = full.shape[3]
        for r, req in enumerate(reqs):
            kvm = self.kvms[r]
            table = kvm.get_cache_indices(req)
            v = kvm.view()
            layers, heads = self._ranges(r)
            for t in range(n):
                b, o = table[t // TPB], t % TPB
                for li, layer in enumerate(layers):
                    v[b, li, :, :, o, :] = full[layer, :, heads.start:
                                                heads.stop, t, :]

    def read(self, reqs: List[s.LlmRequest], n: int,
             ranks: Optional[List[int]] = None) -> torch.Tensor:
        """The KV the instance holds for tokens [0, n) of the request
        (its requests on ``ranks``, default all)."""
        out = torch.zeros(LAYERS, 2, HEADS, n, HEAD_DIM,
                          dtype=self.kvms[0].pool.dtype)
        for r, req in zip(ranks or range(len(reqs)), reqs):
            kvm = self.kvms[r]
            table = kvm.get_cache_indices(req)
            v = kvm.view()
            layers, heads = self._ranges(r)
            for t in range(n):
                b, o = table[t // TPB], t % TPB
                for li, layer in enumerate(layers):
                    out[layer, :, heads.start:heads.stop, t, :] = \
                        v[b, li, :, :, o, :]
        return out

    def untouched(self, tables: List[List[int]]) -> bool:
        """No byte outside those blocks was written, on any rank."""
        used = {b for t in tables for b in t}
        for kvm in self.kvms:
            rest = [b for b in range(BLOCKS) if b not in used]
            if kvm.pool[rest].count_nonzero().item():
                return False
        return True

    # -- what the coordinator does ------------------------------------------

    def send(self, reqs: List[s.LlmRequest]) -> None:
        for t, req in zip(self.ranks, reqs):
            t.respond_and_send_async(req)

    def receive(self, reqs: List[s.LlmRequest]) -> None:
        for t, req in zip(self.ranks, reqs):
            t.request_and_receive_async(req)

    def ctx_status(self, at_least: Optional[int] = 0,
                   mark_complete: bool = False) -> List[Any]:
        return [t.check_context_transfer_status(at_least, mark_complete)
                for t in self.ranks]

    def gen_status(self, at_least: Optional[int] = 0) -> List[Any]:
        return [t.check_gen_transfer_status(at_least) for t in self.ranks]

    def until(self, status: Callable[[], List[Any]], done: Callable[[],
              bool], timeout: float = 20.0) -> Dict[str, List[Any]]:
        """Call ``status`` (every rank, once a step) until ``done``; the
        ids and requests every rank reported, merged per rank."""
        got: Dict[str, List[Any]] = {}
        end = time.monotonic() + timeout
        while True:
            for r, st in enumerate(status()):
                for name, v in st._asdict().items():
                    got.setdefault(name, [[] for _ in self.ranks])
                    got[name][r] += list(v)
            if done():
                return got
            if time.monotonic() > end:
                raise AssertionError(f"{self.name}: not done in {timeout} s;"
                                     f" reported {got}")
            time.sleep(0.01)


def states(reqs: List[s.LlmRequest]) -> List[St]:
    return [r.state for r in reqs]


def settled(reqs: List[s.LlmRequest]) -> Callable[[], bool]:
    """None of the requests is still transferring."""
    moving = (St.DISAGG_GENERATION_TRANS_IN_PROGRESS,
              St.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
    return lambda: all(r.state not in moving for r in reqs)


def sent(inst: Instance, reqs: List[s.LlmRequest]) -> Callable[[], bool]:
    """No rank of inst has the requests in flight any more."""
    return lambda: not any(t.has_inflight_transfer(r)
                           for t, r in zip(inst.ranks, reqs))
