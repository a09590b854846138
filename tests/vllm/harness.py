"""The vLLM harness of tests/vllm: two vLLM "engines" in this process
driven as vLLM's model runner drives them (see test_vllm_connector.py)."""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import torch

from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig,
                         ModelConfig, ParallelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import \
    KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import \
    KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import \
    KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher,
                                         init_none_hash)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                        KVCacheGroupSpec, KVCacheTensor,
                                        compute_layout_strides,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import \
    KVConnectorModelRunnerMixin

import kvxfer
import kvxfer.vllm as kv_vllm


LAYERS, KV_HEADS, HEAD = 2, 4, 32
BLOCK = 16
NUM_BLOCKS = 64
TOKEN = 7  # what the "model" samples

init_none_hash(sha256)


def pattern(tokens: List[int], start: int, end: int, layer: int,
            heads: range, salt: float = 0.0) -> torch.Tensor:
    """[end - start, len(heads), 2 * HEAD] K|V values of the positions
    [start, end): exact float32 integers, distinct per token, position,
    layer, head and element (plus salt: an engine's own, so that KV it
    computed differs from KV it received)."""
    pos = torch.arange(start, end)
    tok = torch.tensor(tokens[start:end])
    base = ((tok * 31 + pos * 7) % 997).to(torch.float32)  # < 997
    h = torch.tensor(list(heads), dtype=torch.float32)
    c = torch.arange(2 * HEAD, dtype=torch.float32)
    return (base[:, None, None] + 1000 * c[None, None, :]
            + 100000 * h[None, :, None] + 1000000 * layer + salt)


def kv_tensor(spec: Any, num_blocks: int, names: List[str],
              layout: KVCacheLayout) -> KVCacheTensor:
    """The placement of the layers in one allocation, as vLLM's
    compute_layout_strides gives it for the layout."""
    strides = compute_layout_strides(spec, num_blocks, len(names), layout)
    return KVCacheTensor(size=len(names) * num_blocks
                         * spec.page_size_bytes, layers=names,
                         layer_stride=strides[0], block_stride=strides[1])


def vllm_config(model: str, sock: str, name: str, tp: int = 1,
                layout: str = "LBNHC", extra: Optional[dict] = None,
                policy: str = "recompute", role: str = "kv_both",
                chunk: int = 1024, num_blocks: int = NUM_BLOCKS,
                **parallel: Any) -> VllmConfig:
    """The VllmConfig of an instance: the connector's config line, this
    test's socket, a small CPU model (chunk: the scheduler's token budget
    a step, chunked prefill below 512; num_blocks: the KV cache's blocks;
    parallel: ParallelConfig's other fields)."""
    mc = ModelConfig(model=model, skip_tokenizer_init=True,
                     dtype="float32", max_model_len=512, seed=0)
    sc = SchedulerConfig(max_num_seqs=min(16, chunk),
                         max_num_batched_tokens=chunk,
                         max_model_len=512, is_encoder_decoder=False,
                         enable_chunked_prefill=chunk < 512)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    cc.kv_cache_layout = layout
    kv = KVTransferConfig(
        kv_connector="KvxferConnector",
        kv_connector_module_path="kvxfer.vllm", kv_role=role,
        engine_id=name, kv_load_failure_policy=policy,
        kv_connector_extra_config={"socket": sock, "timeout_s": 5,
                                   **(extra or {})})
    return VllmConfig(model_config=mc, scheduler_config=sc,
                      cache_config=cc, kv_transfer_config=kv,
                      device_config=DeviceConfig("cpu"),
                      parallel_config=ParallelConfig(
                          tensor_parallel_size=tp, **parallel))


class Engine:
    """One vLLM instance: its real Scheduler and a worker connector per
    TP rank, each with KV caches in a kvxfer.HostBuffer."""

    def __init__(self, model: str, sock: str, name: str, tp: int = 1,
                 layout: str = "LBNHC", extra: Optional[dict] = None,
                 policy: str = "recompute", salt: float = 0.0,
                 role: str = "kv_both",
                 rank_socks: Optional[List[str]] = None,
                 per_layer: bool = False, chunk: int = 1024,
                 log_stats: bool = False,
                 num_blocks: int = NUM_BLOCKS) -> None:
        """per_layer: the forward goes layer by layer inside the
        connector's step, calling wait_for_layer_load before a layer and
        save_kv_layer after it, as vLLM's attention layers do (and
        after_layer(engine, rank, layer) then, when set); chunk: the
        scheduler's token budget a step (chunked prefill below 512);
        log_stats: the scheduler's stats, each step's in self.stats;
        num_blocks: the KV cache's blocks (few: vLLM preempts)."""
        self.name, self.tp, self.salt = name, tp, salt
        self.per_layer = per_layer
        self.after_layer: Optional[Callable[[Any, int, int], None]] = None
        self.vc = vllm_config(model, sock, name, tp=tp, layout=layout,
                              extra=extra, policy=policy, role=role,
                              chunk=chunk, num_blocks=num_blocks)
        self.heads = KV_HEADS // tp
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads,
                                 head_size=HEAD, dtype=torch.float32)
        self.layer_names = [f"model.layers.{i}.self_attn.attn"
                            for i in range(LAYERS)]
        kt = kv_tensor(spec, num_blocks, self.layer_names,
                       KVCacheLayout[layout])
        kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[kt],
                            kv_cache_groups=[KVCacheGroupSpec(
                                self.layer_names, spec)])
        self.sched = Scheduler(
            vllm_config=self.vc, kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(self.vc),
            block_size=BLOCK, log_stats=log_stats)
        self.stats: List[Any] = []  # SchedulerStats (log_stats)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.ranks: List[Dict[str, Any]] = []
        for r in range(tp):
            vcr = copy.copy(self.vc)
            vcr.parallel_config = copy.copy(self.vc.parallel_config)
            vcr.parallel_config.rank = r
            if rank_socks:  # ranks on several "nodes": a daemon each
                vcr.kv_transfer_config = copy.copy(self.vc.kv_transfer_config)
                vcr.kv_transfer_config.kv_connector_extra_config = {
                    **self.vc.kv_transfer_config.kv_connector_extra_config,
                    "socket": rank_socks[r]}
            buf = kvxfer.HostBuffer(kt.size)
            raw = buf.torch(torch.int8)
            views = create_kv_cache_views(raw, spec, num_blocks,
                                          KVCacheLayout[layout], kt)
            caches = dict(zip(self.layer_names, views))
            conn = KVConnectorFactory.create_connector(
                vcr, KVConnectorRole.WORKER, kcc)
            assert isinstance(conn, kv_vllm.KvxferConnector)
            conn.register_kv_caches(caches)
            self.ranks.append({"conn": conn, "caches": caches, "buf": buf,
                               "vc": vcr})
        self.handshake()
        self.agg = KVOutputAggregator(expected_finished_count=tp)
        self.outputs: Dict[str, Any] = {}  # request id -> EngineCoreOutput
        self.tokens: Dict[str, List[int]] = {}
        self.computed: Dict[str, List[int]] = {}  # tokens computed per step
        self.kv_outputs: List[Any] = []  # each step's KVConnectorOutput

    def handshake(self) -> None:
        """What vLLM's EngineCore does once the workers registered their
        caches: each worker's get_handshake_metadata keyed by (pp_rank,
        tp_rank) (as gpu_worker's get_kv_connector_handshake_metadata),
        merged and handed to the scheduler's connector by EngineCore's own
        _set_kv_connector_handshake_metadata."""
        per_worker = []
        for r, rank in enumerate(self.ranks):
            m = rank["conn"].get_handshake_metadata()
            per_worker.append(None if m is None else {(0, r): m})
        core = SimpleNamespace(
            scheduler=self.sched, model_executor=SimpleNamespace(
                get_kv_connector_handshake_metadata=lambda: per_worker))
        EngineCore._set_kv_connector_handshake_metadata(core)

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, rid: str, prompt: List[int], max_tokens: int,
            params: Optional[dict] = None) -> Request:
        req = Request(request_id=rid, prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(
                          max_tokens=max_tokens, ignore_eos=True),
                      pooling_params=None, block_hasher=self.hasher)
        req.kv_transfer_params = params
        self.sched.add_request(req)
        self.tokens[rid] = []
        self.computed[rid] = []
        return req

    def blocks_of(self, rid: str) -> List[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def step(self) -> None:
        so = self.sched.schedule()
        outs = []
        for r, rank in enumerate(self.ranks):
            # vLLM's model runner, before the forward
            rank["conn"].handle_preemptions(so.kv_connector_metadata)
            if not self.per_layer:
                self._forward(so, r, rank["caches"])
            kv_transfer_state._KV_CONNECTOR_AGENT = rank["conn"]
            try:
                if self.per_layer:
                    out = self._forward_in_step(so, r, rank)
                else:
                    out = (KVConnectorModelRunnerMixin
                           .kv_connector_no_forward(so, rank["vc"]))
                # a copy, as vLLM's RPC from a worker process is: an empty
                # output is vLLM's EMPTY_MODEL_RUNNER_OUTPUT, which
                # KVOutputAggregator.aggregate writes into, and the
                # engines of this process would share what it wrote
                outs.append(copy.copy(out))
            finally:
                kv_transfer_state._KV_CONNECTOR_AGENT = None
        kvo = self.agg.aggregate(outs).kv_connector_output
        self.kv_outputs.append(kvo)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([TOKEN] if done else [])
            self.computed[rid].append(so.num_scheduled_tokens[rid])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kvo)
        for eco in self.sched.update_from_output(so, mro).values():
            if eco.scheduler_stats is not None:
                self.stats.append(eco.scheduler_stats)
            for o in eco.outputs:
                self.tokens[o.request_id] += list(o.new_token_ids)
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o

    def _forward(self, so: Any, r: int, caches: Dict[str, torch.Tensor],
                 conn: Any = None) -> None:
        """What the model's forward writes: the KV of every scheduled
        token, into the request's blocks (this rank's heads), layer by
        layer; with conn, each layer between the connector's
        wait_for_layer_load and save_kv_layer (vLLM's
        maybe_transfer_kv_layer), then after_layer."""
        heads = range(r * self.heads, (r + 1) * self.heads)
        hooks = conn is not None and so.total_num_scheduled_tokens > 0 \
            and conn.has_connector_metadata()
        for layer, name in enumerate(self.layer_names):
            if hooks:
                conn.wait_for_layer_load(name)
            for rid, n in so.num_scheduled_tokens.items():
                req = self.sched.requests[rid]
                end = req.num_computed_tokens  # advanced at schedule time
                start = end - n
                toks = list(req.all_token_ids)
                blocks = self.blocks_of(rid)
                vals = pattern(toks, start, end, layer, heads, self.salt)
                for p in range(start, end):
                    caches[name][blocks[p // BLOCK], :, p % BLOCK] = \
                        vals[p - start]
            if hooks:
                conn.save_kv_layer(name, caches[name], None)
            if conn is not None and self.after_layer is not None:
                self.after_layer(self, r, layer)

    def _forward_in_step(self, so: Any, r: int, rank: Dict[str, Any]
                         ) -> ModelRunnerOutput:
        """One rank's step as vLLM's GPU model runner runs it: the
        connector's lifecycle around the forward (start_load_kv before it
        when a load is synchronous, else after it; wait_for_save, then
        the finished transfers)."""
        with set_forward_context(None, rank["vc"]), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(
                    so) as out:
            self._forward(so, r, rank["caches"], rank["conn"])
        return ModelRunnerOutput.with_kv_conn_output_only(out)

    def kv_of(self, rid: str, n: int, r: int = 0) -> List[torch.Tensor]:
        """Per layer: [n, heads, 2 * HEAD] of rank r's blocks of rid."""
        return self.kv_in(self.blocks_of(rid), n, r)

    def kv_in(self, blocks: List[int], n: int, r: int = 0
              ) -> List[torch.Tensor]:
        """Per layer: [n, heads, 2 * HEAD] of the first n tokens of blocks
        (a finished request's, freed but not reused)."""
        caches = self.ranks[r]["caches"]
        out = []
        for name in self.layer_names:
            c = caches[name]
            out.append(torch.stack([c[blocks[p // BLOCK], :, p % BLOCK]
                                    for p in range(n)]))
        return out

    def close(self) -> None:
        for rank in self.ranks:
            rank["conn"].shutdown()
        if self.sched.connector is not None:
            self.sched.connector.shutdown()


def run(engines: List[Engine], until, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not until():
        if time.monotonic() > end:
            raise AssertionError(f"not done in {timeout} s")
        for e in engines:
            e.step()
        time.sleep(0.002)


def landed(d: Engine, rid: str) -> bool:
    """The decode's workers reported rid's KV in; vLLM has not run it."""
    return rid in d.sched.finished_recving_kv_req_ids


def prompt_of(n: int, seed: int) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def prefill(p: Engine, rid: str, prompt: List[int]) -> dict:
    """The prefill's part: max_tokens 1 and do_remote_decode, as vLLM's
    proxy sends it; returns the kv_transfer_params it hands the decode."""
    p.add(rid, prompt, 1, {"do_remote_decode": True})
    run([p], lambda: rid in p.outputs)
    out = p.outputs[rid]
    assert p.tokens[rid] == [TOKEN]
    params = out.kv_transfer_params
    assert params and params["do_remote_prefill"] is True, params
    assert params["remote_num_tokens"] == len(prompt)
    return dict(params)


def reported(e: Engine, field: str, rid: str) -> int:
    """How many steps' outputs named rid in field (finished_sending,
    finished_recving)."""
    return sum(rid in (getattr(k, field) or ()) for k in e.kv_outputs)


def load_errors(e: Engine) -> List[set]:
    """The steps' invalid_block_ids that were not empty."""
    return [set(k.invalid_block_ids) for k in e.kv_outputs
            if k.invalid_block_ids]


def worker(e: Engine, r: int = 0) -> Any:
    return e.ranks[r]["conn"]._worker
