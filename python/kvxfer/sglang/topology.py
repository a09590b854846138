"""Where a scheduler rank sits in its SGLang instance, and which kvxfer
instance it is a rank of.

SGLang's attention-DP groups (``--enable-dp-attention``) and the replicas
of its data-parallel controller (``--dp-size`` without it) each hold
their requests' KV on their own: a request lives in one group. Each
group is therefore a kvxfer instance of its own, on both sides, of
``attn_tp_size`` x ``pp_size`` ranks: a prefill group publishes its
requests, a decode group fetches its own, and neither waits for the
others' polls. The instance of group g is the SGLang instance's name with
``-dpG`` appended (nothing when there is one group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.disaggregation.base.conn import KVArgs

from ..errors import InvalidArgument, Unsupported


@dataclass(frozen=True)
class Topology:
    """The widths and ranks of one scheduler rank, as SGLang's
    ``get_parallel()`` gives them (CommonKVManager reads the same)."""

    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    pp_size: int
    pp_rank: int
    system_dp_size: int
    system_dp_rank: int
    load_balance_method: str = "follow_bootstrap_room"

    @property
    def dp_groups(self) -> int:
        """The groups a request may go to (the bootstrap server's
        ``dp_size``): attention DP, else the data-parallel replicas."""
        return (self.attn_dp_size if self.system_dp_size == 1
                else self.system_dp_size)

    @property
    def dp_group(self) -> int:
        """This rank's group (the bootstrap server's ``prefill_dp_rank``)."""
        return (self.attn_dp_rank if self.system_dp_size == 1
                else self.system_dp_rank)

    @property
    def rank(self) -> int:
        """This rank's kvxfer rank in its group's instance."""
        return self.pp_rank * self.attn_tp_size + self.attn_tp_rank

    @property
    def size(self) -> int:
        """Ranks of the group's instance."""
        return self.pp_size * self.attn_tp_size


def _published(args: KVArgs) -> Topology:
    """From SGLang's runtime context (raises RuntimeError or ValueError
    where the scheduler has not published it)."""
    from sglang.srt.runtime_context import get_parallel
    p = get_parallel()
    system_dp = int(p.dp_size or 1)
    return Topology(
        attn_tp_size=int(p.attn_tp_size), attn_tp_rank=int(p.attn_tp_rank),
        attn_dp_size=int(p.attn_dp_size), attn_dp_rank=int(p.attn_dp_rank),
        pp_size=int(p.pp_size), pp_rank=int(getattr(args, "pp_rank", 0)
                                            or 0),
        system_dp_size=system_dp,
        system_dp_rank=int(getattr(args, "system_dp_rank", 0) or 0),
        load_balance_method=str(getattr(p, "load_balance_method", None)
                                or "follow_bootstrap_room"))


def _from_server_args(args: KVArgs, sa: Any, mode: str) -> Topology:
    """Without a published runtime context: from ServerArgs and the
    engine rank, as SGLang's ``derive_attention_ranks`` places ranks."""
    tp = int(getattr(sa, "tp_size", 1) or 1)
    dp = int(getattr(sa, "dp_size", 1) or 1)
    dp_attention = bool(getattr(sa, "enable_dp_attention", False))
    attn_tp = tp // dp if dp_attention and dp > 1 else tp
    rank = int(args.engine_rank)
    if dp_attention and dp > 1 and mode == "decode":
        # a decode's engine_rank is its attention-TP rank only
        raise InvalidArgument(
            -1, "kvxfer.sglang: a decode with DP attention needs SGLang's "
            "published parallel context (get_parallel()) to know its "
            "attention-DP rank; engine_rank alone does not say it")
    if not 0 <= rank < tp:
        raise InvalidArgument(-1, f"kvxfer.sglang: engine_rank {rank} "
                              f"outside tp_size {tp}")
    return Topology(
        attn_tp_size=attn_tp, attn_tp_rank=rank % attn_tp,
        attn_dp_size=dp if dp_attention else 1,
        attn_dp_rank=rank // attn_tp if dp_attention else 0,
        pp_size=int(getattr(sa, "pp_size", 1) or 1),
        pp_rank=int(getattr(args, "pp_rank", 0) or 0),
        system_dp_size=1 if dp_attention else dp,
        system_dp_rank=int(getattr(args, "system_dp_rank", 0) or 0),
        load_balance_method=_load_balance(sa, mode))


def _load_balance(sa: Any, mode: str) -> str:
    """--load-balance-method as SGLang resolves "auto" (its
    handle_load_balance_method): follow_bootstrap_room on a prefill."""
    lb = str(getattr(sa, "load_balance_method", None) or "auto")
    if lb == "auto":
        return "follow_bootstrap_room" if mode == "prefill" else \
            "round_robin"
    return lb


def topology_of(args: KVArgs, sa: Any, mode: str) -> Topology:
    """This rank's topology: SGLang's published parallel context, else
    derived from ``sa`` (ServerArgs). Raises InvalidArgument for ranks
    outside their widths, Unsupported for context parallelism."""
    cp = int(getattr(sa, "attn_cp_size", 1) or 1)
    dcp = int(getattr(sa, "dcp_size", 1) or 1)
    if cp != 1 or dcp != 1:
        raise Unsupported(
            -15, f"kvxfer.sglang: context parallelism (--attn-cp-size {cp}, "
            f"--dcp-size {dcp}) is not supported: SGLang splits a "
            "request's tokens or pages over the CP ranks, and a kvxfer "
            "instance's ranks split heads and layers only (cp is refused "
            "by kvxferd's Hello). Run with --attn-cp-size 1 --dcp-size 1")
    try:
        t = _published(args)
    except (RuntimeError, ValueError):
        t = _from_server_args(args, sa, mode)
    for name, r, n in (("attn_tp_rank", t.attn_tp_rank, t.attn_tp_size),
                       ("attn_dp_rank", t.attn_dp_rank, t.attn_dp_size),
                       ("pp_rank", t.pp_rank, t.pp_size),
                       ("system_dp_rank", t.system_dp_rank,
                        t.system_dp_size)):
        if n < 1 or not 0 <= r < n:
            raise InvalidArgument(-1, f"kvxfer.sglang: {name} {r} outside "
                                  f"its width {n}")
    return t
