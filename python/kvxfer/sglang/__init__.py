"""SGLang's disaggregation transfer backend on kvxfer (SGLang 0.5.23).

The four classes SGLang's scheduler builds for a transfer backend
(``sglang/srt/disaggregation/base/conn.py``), moving the KV cache through
kvxferd by **fetch by key**: the key of a request is its bootstrap room
(an int; kvxfer sends its decimal digits), so nothing but the room has to
travel between the prefill and the decode instance.

* :class:`KvxferKVManager` (manager.py), one per scheduler rank: a
  :class:`kvxfer.Client` for the rank in its DP group's instance
  (topology.py), its KV buffers registered as one pool of regions and
  its state tables as pools of their own (state.py), the event pump, and
  (prefill) its row on the bootstrap server.
* :class:`KvxferKVSender` (sender.py, prefill): streams each chunk's
  pages into a layer-wise offer of the room, and publishes the room's end
  offer (aux rows, state) with the last chunk.
* :class:`KvxferKVReceiver` (receiver.py, decode): finds the room's
  prefill DP group on its bootstrap server, fetches both offers by key
  into its pages (skipping a decode radix prefix), and writes the aux
  rows the prefill published into its own metadata buffers.
* :class:`KvxferKVBootstrapServer` (bootstrap.py): SGLang's own
  ``CommonKVBootstrapServer``; a kvxfer rank's row names its daemon and
  instance.

Heterogeneous TP and PP, deadlines and cancellation are the daemon's.
SGLang 0.5.23's backend list is closed: :func:`kv_classes` is the entry
point an SGLang with the proposed registry finds, and
docs/engines/sglang.md gives the site-packages patch for one without it,
and lists what is not supported.

Settings come from the environment (SGLang has no free-form backend
config): ``KVXFER_SGLANG_SOCKET`` (the daemon's socket),
``KVXFER_SGLANG_INSTANCE`` (this instance's kvxfer name),
``KVXFER_SGLANG_DEVICE`` (``auto``, ``cuda`` or ``host``),
``KVXFER_SGLANG_RANK_ADDRESSES`` (the daemon addresses of the ranks of
this rank's DP group, for a group spread over several nodes),
``KVXFER_SGLANG_BOOTSTRAP_TIMEOUT`` (seconds, default 30),
``KVXFER_SGLANG_AUX_BYTES`` (the daemon's ``limits.aux_bytes``, default
65536), ``KVXFER_SGLANG_STREAM`` (0: publish a room's pages at its
last chunk), ``KVXFER_SGLANG_GPU_PACE`` (bytes a millisecond: the pace
each rank sets for kvxfer's copies on its GPU while the engine computes,
kvxfer/_pace.py) and ``KVXFER_SGLANG_GPU_PACE_HOLD_MS`` (its hold,
default 200).
"""

from .bootstrap import KvxferKVBootstrapServer
from .common import SGLANG_VERSION, KvxferTransferError
from .manager import KvxferKVManager
from .receiver import KvxferKVReceiver
from .sender import KvxferKVSender

__all__ = ["KvxferKVManager", "KvxferKVSender", "KvxferKVReceiver",
           "KvxferKVBootstrapServer", "KvxferTransferError",
           "SGLANG_VERSION", "kv_classes"]


def kv_classes() -> dict:
    """The backend's classes by SGLang's KVClassType value: what the
    entry point ``kvxfer`` of the group
    ``sglang.disaggregation.transfer_backends`` gives an SGLang that looks
    transfer backends up there
    (docs/engines/sglang-0.5.23-transfer-backend-entry-points.patch)."""
    return {"manager": KvxferKVManager, "sender": KvxferKVSender,
            "receiver": KvxferKVReceiver,
            "bootstrap_server": KvxferKVBootstrapServer}
