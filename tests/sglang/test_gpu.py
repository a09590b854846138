"""kvxfer.sglang with the KV on the GPU, as SGLang keeps it: raw CUDA
pointers of per-layer K and V tensors (PyTorch), registered as CUDA
memory without being told (KVXFER_SGLANG_DEVICE auto). Skips without a
CUDA PyTorch (the venv of make test-sglang has a CPU-only one)."""

import numpy as np
import pytest
from conftest import AUX_ROWS, Rank, server_args, wait_poll

from kvxfer.sglang import KvxferKVManager, KvxferKVReceiver, KvxferKVSender
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device"
    return torch, ""


torch, why = _torch_cuda()
pytestmark = pytest.mark.skipif(torch is None, reason=f"no CUDA torch: {why}")


class CudaRank:
    """Rank's layout with the K and V buffers as CUDA tensors (bf16), one
    allocation each, and the aux rows on the CPU as SGLang has them."""

    def __init__(self, *, engine_rank=0, layers=4, heads=2, total_heads=2,
                 head_dim=64, page=16, num_pages=32, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        shape = ((num_pages + 1) * page, heads, head_dim)
        self.k = [torch.randn(shape, generator=g, device="cuda",
                              dtype=torch.bfloat16) for _ in range(layers)]
        self.v = [torch.randn(shape, generator=g, device="cuda",
                              dtype=torch.bfloat16) for _ in range(layers)]
        self.page = page
        host = Rank(layers=1)  # only for its aux arrays
        self.aux = host.aux
        a = KVArgs()
        bufs = self.k + self.v
        a.engine_rank = engine_rank
        a.kv_data_ptrs = [b.data_ptr() for b in bufs]
        a.kv_data_lens = [b.numel() * b.element_size() for b in bufs]
        a.kv_item_lens = [b[0].numel() * b.element_size() * page
                          for b in bufs]
        a.kv_cache_dtype_str = "bfloat16"
        a.aux_data_ptrs = [x.ctypes.data for x in self.aux]
        a.aux_data_lens = [x.nbytes for x in self.aux]
        a.aux_item_lens = [x[0].nbytes for x in self.aux]
        a.page_size = page
        a.kv_head_num = heads
        a.total_kv_head_num = total_heads
        a.state_types = []
        a.num_draft_entries = 0
        self.args = a


def test_cuda_kv_prefill_tp2_to_decode_tp1(env, bootstrap):
    p = [CudaRank(engine_rank=r, heads=2, total_heads=4, seed=r + 1)
         for r in range(2)]
    dst = CudaRank(heads=4, total_heads=4, seed=9)
    mgrs = [KvxferKVManager(x.args, "prefill",
                            server_args(bootstrap.port, 2), False)
            for x in p]
    dm = KvxferKVManager(dst.args, "decode",
                         server_args(bootstrap.port, 1, "decode"), False)
    try:
        assert {m.pool.kind for m in mgrs + [dm]} == {"gpu"}
        room, P, n = 4242, dst.page, 100  # 7 pages, the last partial
        src_pages = [[3, 9, 1, 30, 12, 5, 20], [8, 2, 17, 4, 11, 25, 6]]
        dst_pages = [10, 0, 31, 7, 15, 22, 3]
        torch.cuda.synchronize()  # the forward that wrote the KV is done
        senders = []
        for m, x, pages in zip(mgrs, p, src_pages):
            s = KvxferKVSender(m, bootstrap.address, room)
            s.init(len(pages), 1)
            x.aux[0][1, 0] = 555
            x.aux[2][1, 0] = room
            s.send(np.asarray(pages[:4], np.int32), None,
                   num_kv_tokens=4 * P)
            s.send(np.asarray(pages[4:], np.int32), [],
                   num_kv_tokens=n - 4 * P)
            senders.append(s)
        assert dm.try_ensure_parallel_info(bootstrap.address)
        r = KvxferKVReceiver(dm, bootstrap.address, room)
        r.init(0)
        r.send_metadata(np.asarray(dst_pages, np.int32), 2, [])
        assert wait_poll(r, KVPoll.Success, 30) == KVPoll.Success, r._reason
        torch.cuda.synchronize()
        for rank, (x, pages) in enumerate(zip(p, src_pages)):
            heads = slice(2 * rank, 2 * rank + 2)
            for src_bufs, dst_bufs in ((x.k, dst.k), (x.v, dst.v)):
                for layer, (sb, db) in enumerate(zip(src_bufs, dst_bufs)):
                    for i, (sp, dp) in enumerate(zip(pages, dst_pages)):
                        t = min(P, n - i * P)
                        want = sb[sp * P:sp * P + t]
                        got = db[dp * P:dp * P + t, heads]
                        assert torch.equal(got, want), (rank, layer, i)
        assert dst.aux[0][2, 0] == 555 and int(dst.aux[2][2, 0]) == room
        assert not dst.aux[0][[i for i in range(AUX_ROWS) if i != 2]].any()
        for s in senders:
            assert wait_poll(s, KVPoll.Success) == KVPoll.Success, s._reason
    finally:
        for m in mgrs + [dm]:
            m.close()
