"""A small Llama and the paged KV pools around it, shared by the router
example (examples/router.py) and the real-model test
(tests/gpu/real_model.py).

The model has the Llama architecture (transformers' LlamaForCausalLM,
from a config: random weights from a fixed seed, nothing downloaded):
bf16 on CUDA, fp32 on the CPU. A prefill writes each layer's K/V into a
paged pool in vLLM's NHD layout (a tensor per layer: [2, blocks, tokens,
heads, dim]); a decode reads them from FlashInfer's layout (a tensor per
layer: [blocks, 2, tokens, heads, dim]) back into a transformers cache and
decodes greedily. Host pools lie in a ``kvxfer.HostBuffer`` (the daemon
maps the memfd); GPU pools are plain CUDA tensors.

Works with transformers 4.4x (the cache as key_cache / value_cache
lists, or a legacy tuple) and 4.5x / 5.x (cache.layers).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

L, HEADS, KV_HEADS, HIDDEN = 4, 8, 4, 512
HD = HIDDEN // HEADS
VOCAB = 1000

__all__ = ["L", "HEADS", "KV_HEADS", "HIDDEN", "HD", "VOCAB", "kvx",
           "device_dtype", "sync", "model", "prompt_of", "prefill",
           "decode_from", "colocated", "layer_kv", "vllm_nhd_tensors",
           "write_vllm_nhd", "flashinfer_tensors", "write_flashinfer",
           "read_flashinfer", "start_daemon"]


def kvx() -> Any:
    """The kvxfer package: the installed one, else this tree's python/
    (a bundle keeps it at ../../python from bin/tests)."""
    for d in (os.path.join(HERE, "..", "python"),
              os.path.join(HERE, "..", "..", "python")):
        if os.path.isdir(os.path.join(d, "kvxfer")) and d not in sys.path:
            sys.path.insert(0, d)
            break
    import kvxfer
    return kvxfer


def device_dtype(device: Optional[str] = None) -> Tuple[str, torch.dtype]:
    """The device ("cuda" when torch sees one, else "cpu", unless named)
    and the model's dtype there: bf16 on CUDA, fp32 on the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, (torch.bfloat16 if device.startswith("cuda")
                    else torch.float32)


def sync(device: str) -> None:
    """Wait for the device's queued work (timings, publish, reads)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def model(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> Any:
    """The model: the same weights in every process (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                      intermediate_size=2 * HIDDEN, num_hidden_layers=L,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      max_position_embeddings=16384)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).to(device).eval()


def prompt_of(n: int, seed: int = 1) -> torch.Tensor:
    """n token ids from a fixed seed (there is no tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


def _dynamic_cache(cache: Any) -> Any:
    """A cache the model updates in place (transformers 4.4x returns a
    tuple of tuples when it was given none)."""
    if isinstance(cache, tuple):
        from transformers import DynamicCache
        return DynamicCache.from_legacy_cache(cache)
    return cache


@torch.no_grad()
def prefill(m: Any, prompt: torch.Tensor) -> Tuple[int, Any]:
    """The first generated token and the prompt's cache."""
    dev = next(m.parameters()).device
    out = m(prompt[None].to(dev), use_cache=True)
    return int(out.logits[0, -1].argmax()), _dynamic_cache(out.past_key_values)


@torch.no_grad()
def decode_from(m: Any, cache: Any, first: int,
                n: int) -> Tuple[List[int], torch.Tensor]:
    """Greedy tokens after first (first included), and the last logits."""
    dev = next(m.parameters()).device
    cache = _dynamic_cache(cache)
    toks, tok = [first], torch.tensor([[first]], device=dev)
    out = None
    for _ in range(n - 1):
        out = m(tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(int(tok))
    assert out is not None, "decode_from: n must be at least 2"
    return toks, out.logits[0, -1].float().cpu()


@torch.no_grad()
def colocated(prompt: torch.Tensor, n: int, m: Any = None,
              device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16
              ) -> Tuple[List[int], torch.Tensor]:
    """Prefill and decode in one process: the reference."""
    m = m if m is not None else model(device, dtype)
    first, cache = prefill(m, prompt)
    return decode_from(m, cache, first, n)


def layer_kv(cache: Any, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[kv_heads, tokens, head_dim] keys and values of one layer."""
    if hasattr(cache, "layers"):  # transformers >= 4.54
        lay = cache.layers[layer]
        return lay.keys[0], lay.values[0]
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer][0], cache.value_cache[layer][0]
    return cache[layer][0][0], cache[layer][1][0]  # legacy tuple


def _alloc(shape: Sequence[int], dtype: torch.dtype,
           device: str) -> torch.Tensor:
    """Zeros for L per-layer tensors of shape: CUDA memory, or on the
    host one kvxfer.HostBuffer (memory the daemon can map)."""
    if device.startswith("cuda"):
        return torch.zeros(L, *shape, dtype=dtype, device=device)
    n = L * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = kvx().HostBuffer(n)  # a fresh memfd reads as zeros
    return buf.torch(dtype, (L, *shape))


def vllm_nhd_tensors(num_blocks: int, tokens_per_block: int, heads: int,
                     device: str, dtype: torch.dtype) -> List[torch.Tensor]:
    """vLLM's paged cache, a tensor per layer:
    [2 (K, V), blocks, tokens, heads, dim]."""
    if device.startswith("cuda"):  # as vLLM allocates them: one each
        return [torch.zeros(2, num_blocks, tokens_per_block, heads, HD,
                            dtype=dtype, device=device) for _ in range(L)]
    t = _alloc((2, num_blocks, tokens_per_block, heads, HD), dtype, device)
    return [t[i] for i in range(L)]


def write_vllm_nhd(tensors: List[torch.Tensor], cache: Any,
                   blocks: Sequence[int], tokens_per_block: int,
                   num_tokens: int, first_head: int = 0,
                   heads: Optional[int] = None) -> None:
    """Write the cache's tokens [0, num_tokens), KV heads [first_head,
    first_head + heads), into blocks (in order) of vLLM tensors."""
    for layer in range(L):
        k, v = layer_kv(cache, layer)
        n = heads if heads is not None else k.shape[0]
        k = k[first_head:first_head + n].transpose(0, 1)  # [T, heads, HD]
        v = v[first_head:first_head + n].transpose(0, 1)
        for i, b in enumerate(blocks):
            s, e = i * tokens_per_block, min(num_tokens,
                                             (i + 1) * tokens_per_block)
            if s >= e:
                break
            tensors[layer][0, b, :e - s] = k[s:e]
            tensors[layer][1, b, :e - s] = v[s:e]


def flashinfer_tensors(num_blocks: int, tokens_per_block: int,
                       device: str, dtype: torch.dtype
                       ) -> List[torch.Tensor]:
    """FlashInfer's paged cache, a tensor per layer:
    [blocks, 2 (K, V), tokens, heads, dim]."""
    if device.startswith("cuda"):
        return [torch.zeros(num_blocks, 2, tokens_per_block, KV_HEADS, HD,
                            dtype=dtype, device=device) for _ in range(L)]
    t = _alloc((num_blocks, 2, tokens_per_block, KV_HEADS, HD), dtype,
               device)
    return [t[i] for i in range(L)]


def write_flashinfer(tensors: List[torch.Tensor], cache: Any,
                     blocks: Sequence[int], tokens_per_block: int,
                     num_tokens: int) -> None:
    """Write the cache's tokens [0, num_tokens) into blocks (in order) of
    FlashInfer tensors (a decode that holds a prefix already)."""
    for layer in range(L):
        k, v = layer_kv(cache, layer)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [T, heads, HD]
        for t0 in range(0, num_tokens, tokens_per_block):
            b = blocks[t0 // tokens_per_block]
            e = min(num_tokens, t0 + tokens_per_block)
            tensors[layer][b, 0, :e - t0] = k[t0:e]
            tensors[layer][b, 1, :e - t0] = v[t0:e]


def read_flashinfer(tensors: List[torch.Tensor], blocks: Sequence[int],
                    num_tokens: int, device: str) -> Any:
    """A transformers cache of tokens [0, num_tokens) read from blocks
    (in order) of FlashInfer tensors, on device."""
    from transformers import DynamicCache
    cache = DynamicCache()
    idx = list(blocks)
    for layer in range(L):
        kv = tensors[layer][idx].to(device)  # [n, 2, tpb, H, HD]
        k = kv[:, 0].reshape(-1, KV_HEADS, HD)[:num_tokens].transpose(0, 1)
        v = kv[:, 1].reshape(-1, KV_HEADS, HD)[:num_tokens].transpose(0, 1)
        cache.update(k[None].contiguous(), v[None].contiguous(), layer)
    return cache


def start_daemon(kvxferd: str, d: str,
                 config: str = "") -> Tuple[subprocess.Popen, str]:
    """Start kvxferd on a socket in directory d (its log: d/kvxferd.log);
    ``config``: more YAML for its configuration file."""
    sock = os.path.join(d, "kvxferd.sock")
    cfg = os.path.join(d, "kvxferd.yaml")
    with open(cfg, "w") as f:
        f.write(f"socket:\n  path: {sock}\n{config}")
    log = open(os.path.join(d, "kvxferd.log"), "wb")
    p = subprocess.Popen([kvxferd, "--config", cfg], stdout=log,
                         stderr=subprocess.STDOUT)
    for _ in range(200):
        if os.path.exists(sock):
            return p, sock
        if p.poll() is not None:
            break
        time.sleep(0.05)
    p.kill()
    p.wait()
    raise SystemExit("kvxferd did not start: " + open(log.name).read())
