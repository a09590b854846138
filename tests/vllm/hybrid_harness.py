"""A hybrid model's vLLM instance for tests/vllm/test_hybrid.py: the
KVCacheConfig vLLM makes from per-layer specs (full attention, sliding
window, Mamba) with its own planning functions, its Scheduler with the
hybrid memory allocator, and the workers' caches as vLLM's
allocate_kv_cache views them (the groups overlay one allocation)."""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Dict, List, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.factory import \
    KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import \
    KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import \
    KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import (get_global_kv_cache_groups,
                                            get_kv_cache_configs)
from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                         get_request_block_hasher,
                                         resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec,
                                        SlidingWindowSpec,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.structured_output import StructuredOutputManager
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateShapeCalculator, is_conv_state_dim_first)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

import kvxfer
import kvxfer.vllm as kv_vllm

from harness import BLOCK, HEAD, KV_HEADS, Engine, pattern, vllm_config

HY_BLOCKS = 128
WINDOW = 24  # tokens of the sliding-window layers
MAMBA_BLOCK = 512  # max_model_len: one state block a request
# a Mamba2 mixer: 4 heads of 8, 2 groups, state 16, kernel 4; its conv
# channels are x (32) | B (32) | C (32)
M_HEADS, M_HEAD_DIM, M_GROUPS, M_STATE, M_KERNEL = 4, 8, 2, 16, 4
M_INTER = M_HEADS * M_HEAD_DIM
M_CONV = M_INTER + 2 * M_GROUPS * M_STATE


def layer_of(name: str) -> int:
    return int(name.split(".")[2])


def specs_of(kinds: str, tp: int) -> Dict[str, Any]:
    """Rank specs of a model whose layer i is kinds[i]: "F" full
    attention, "W" sliding window, "M" Mamba (this rank's share)."""
    heads = KV_HEADS // tp
    out: Dict[str, Any] = {}
    for i, k in enumerate(kinds):
        if k == "F":
            out[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=heads, head_size=HEAD,
                dtype=torch.float32)
        elif k == "W":
            out[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                block_size=BLOCK, num_kv_heads=heads, head_size=HEAD,
                dtype=torch.float32, sliding_window=WINDOW)
        else:
            page = heads * BLOCK * 2 * HEAD * 4  # the attention page
            # the shapes a Mamba2 mixer gives (MambaMixer2's
            # get_state_shape), in the conv layout vLLM is set to
            shapes = MambaStateShapeCalculator.mamba2_state_shape(
                tp, M_INTER, M_GROUPS, M_HEADS, M_HEAD_DIM, M_STATE,
                M_KERNEL)
            out[f"model.layers.{i}.mixer"] = MambaSpec(
                shapes=shapes, dtypes=(torch.float32, torch.float32),
                block_size=MAMBA_BLOCK, page_size_padded=page,
                mamba_type=MambaAttentionBackendEnum.MAMBA2)
    return out


def state_pattern(tokens: List[int], end: int, layer: int, tp: int,
                  r: int, salt: int = 0) -> torch.Tensor:
    """The bytes of TP rank r's state page of a Mamba2 layer after tokens
    [0, end): the model's state (a hash of the tokens, layer and salt),
    rank r's share of it in vLLM's layout: its x, B and C channels of
    the conv state, in the conv layout vLLM is set to, then its heads of
    the SSM state."""
    h = hashlib.sha256(repr((tokens[:end], layer, salt)).encode())
    seed = int.from_bytes(h.digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(M_CONV, M_KERNEL - 1, generator=g)
    ssm = torch.randn(M_HEADS, M_HEAD_DIM, M_STATE, generator=g)
    x, bc = M_INTER // tp, M_GROUPS * M_STATE // tp
    b0 = M_INTER
    c0 = M_INTER + M_GROUPS * M_STATE
    mine = torch.cat([conv[r * x:(r + 1) * x],
                      conv[b0 + r * bc:b0 + (r + 1) * bc],
                      conv[c0 + r * bc:c0 + (r + 1) * bc]])
    if not is_conv_state_dim_first():
        mine = mine.T  # SD: (kernel - 1, channels)
    hs = M_HEADS // tp
    return torch.cat([mine.contiguous().view(-1).view(torch.int8),
                      ssm[r * hs:(r + 1) * hs].contiguous().view(-1)
                      .view(torch.int8)])


class HybridEngine(Engine):
    """Engine (tests/vllm/harness.py) for a hybrid model: its groups, as
    vLLM's planning functions make them, each with its block table."""

    def __init__(self, model: str, sock: str, name: str, kinds: str,
                 tp: int = 1, layout: str = "LBNHC",
                 extra: Optional[dict] = None, role: str = "kv_both",
                 salt: float = 0.0) -> None:
        self.name, self.tp, self.salt = name, tp, salt
        self.per_layer = False  # Engine's forward, not layer by layer
        self.after_layer = None
        self.stats: List[Any] = []
        self.vc = vllm_config(model, sock, name, tp=tp, layout=layout,
                              extra=extra, role=role)
        # vLLM keeps its hybrid memory allocator for a connector that
        # supports it, on a platform that has it (a GPU's; this CPU
        # platform's support_hybrid_kv_cache() is False, so set it here)
        assert KVConnectorFactory.supports_hma_config(
            self.vc.kv_transfer_config)
        self.vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        self.vc.cache_config.num_gpu_blocks_override = HY_BLOCKS
        self.vc.cache_config.mamba_block_size = MAMBA_BLOCK
        if "M" in kinds:
            # as vLLM's engine core does for Mamba in mamba_cache_mode
            # "none": no prefix caching
            self.vc.cache_config.enable_prefix_caching = False
        self.heads = KV_HEADS // tp
        specs = [specs_of(kinds, tp) for _ in range(tp)]
        groups = get_global_kv_cache_groups(self.vc, specs)
        cfgs = get_kv_cache_configs(self.vc, specs, [1 << 30] * tp, groups)
        kcc = generate_scheduler_kv_cache_config(cfgs)
        self.kcc = kcc
        self.vc.cache_config.num_gpu_blocks = kcc.num_blocks
        bs, hbs = resolve_kv_cache_block_sizes(kcc, self.vc)
        self.sched = Scheduler(
            vllm_config=self.vc, kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(self.vc),
            block_size=bs, hash_block_size=hbs, log_stats=False)
        self.hasher = get_request_block_hasher(hbs, sha256)
        self.specs = specs[0]
        self.layer_names = sorted(self.specs, key=layer_of)
        self.ranks: List[Dict[str, Any]] = []
        for r in range(tp):
            vcr = copy.copy(self.vc)
            vcr.parallel_config = copy.copy(self.vc.parallel_config)
            vcr.parallel_config.rank = r
            buf, caches = self._allocate(cfgs[r], KVCacheLayout[layout])
            conn = KVConnectorFactory.create_connector(
                vcr, KVConnectorRole.WORKER, cfgs[r])
            assert isinstance(conn, kv_vllm.KvxferConnector)
            conn.register_kv_caches(caches)
            self.ranks.append({"conn": conn, "caches": caches, "buf": buf,
                               "vc": vcr})
        self.handshake()
        self.agg = KVOutputAggregator(expected_finished_count=tp)
        self.outputs: Dict[str, Any] = {}
        self.tokens: Dict[str, List[int]] = {}
        self.computed: Dict[str, List[int]] = {}
        self.kv_outputs: List[Any] = []

    @staticmethod
    def _allocate(cfg: Any, layout: KVCacheLayout) -> Any:
        """vLLM's allocate_kv_cache (vllm/v1/worker/utils.py) over a
        kvxfer.HostBuffer instead of torch.zeros: one allocation, each
        KVCacheTensor's layers viewed with create_kv_cache_views."""
        sizes = {t.size for t in cfg.kv_cache_tensors}
        assert len(sizes) == 1
        buf = kvxfer.HostBuffer(sizes.pop())
        raw = buf.torch(torch.int8)
        caches: Dict[str, torch.Tensor] = {}
        for t in cfg.kv_cache_tensors:
            g = next(g for g in cfg.kv_cache_groups
                     if t.layers[0] in g.layer_names)
            views = create_kv_cache_views(raw, g.kv_cache_spec,
                                          cfg.num_blocks_of(t), layout, t)
            caches.update(zip(t.layers, views))
        return buf, caches

    def group_of(self, name: str) -> int:
        return next(i for i, g in enumerate(self.kcc.kv_cache_groups)
                    if name in g.layer_names)

    def blocks_in(self, rid: str, name: str) -> List[int]:
        """The request's block ids of the group of layer name."""
        return list(self.sched.kv_cache_manager.get_block_ids(rid)
                    [self.group_of(name)])

    def _forward(self, so: Any, r: int, caches: Dict[str, torch.Tensor]
                 ) -> None:
        """Attention layers: each computed token's KV into its block (not
        into null blocks); Mamba layers: the state after the computed
        tokens into the request's state block."""
        heads = range(r * self.heads, (r + 1) * self.heads)
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens
            start = end - n
            toks = list(req.all_token_ids)
            for name in self.layer_names:
                layer = layer_of(name)
                blocks = self.blocks_in(rid, name)
                c = caches[name]
                if isinstance(self.specs[name], MambaSpec):
                    slot = [b for b in blocks if b][0]
                    st = state_pattern(toks, end, layer, self.tp, r,
                                       int(self.salt * 10))
                    c[slot, 0, 0, :st.numel()] = st
                    continue
                vals = pattern(toks, start, end, layer, heads, self.salt)
                for p in range(start, end):
                    b = blocks[p // BLOCK]
                    if b:
                        c[b, :, p % BLOCK] = vals[p - start]
