"""SGLang's disaggregation transfer backend on kvxfer (SGLang 0.5.23).

The four classes SGLang's scheduler builds for a transfer backend
(``sglang/srt/disaggregation/base/conn.py``), moving the KV cache through
kvxferd by **fetch by key**: the key of a request is its bootstrap room
(an int; kvxfer sends its decimal digits), so nothing but the room has to
travel between the prefill and the decode instance.

* :class:`KvxferKVManager`, one per scheduler rank: a :class:`kvxfer.Client`
  for the rank, its KV buffers registered as one pool of regions (a K and a
  V buffer per layer, or one latent buffer per layer for MLA), the event
  pump, and (prefill rank 0) the registration with the bootstrap server.
* :class:`KvxferKVSender` (prefill): collects the pages of every prefill
  chunk and publishes them once, with the aux rows, on the last one.
* :class:`KvxferKVReceiver` (decode): looks the prefill instance up on its
  bootstrap server, fetches by key into its pages, and writes the aux rows
  the prefill published into its own metadata buffers on completion.
* :class:`KvxferKVBootstrapServer` (prefill main process): a small HTTP
  server that maps its address to the prefill instance's kvxfer name and
  the daemon address of its rank 0.

Heterogeneous TP, deadlines and cancellation are the daemon's: each rank
says its TP rank and size in its Hello, and the daemons plan the slices.
SGLang's backend list is closed; docs/engines/sglang.md gives the patch
that makes ``--disaggregation-transfer-backend kvxfer`` pick these classes,
and lists what is not supported yet.

Settings come from the environment (SGLang has no free-form backend
config): ``KVXFER_SGLANG_SOCKET`` (the daemon's socket),
``KVXFER_SGLANG_INSTANCE`` (this instance's kvxfer name),
``KVXFER_SGLANG_DEVICE`` (``auto``, ``cuda`` or ``host``),
``KVXFER_SGLANG_RANK_ADDRESSES`` (every rank's daemon address, in rank
order, for an instance spread over several nodes),
``KVXFER_SGLANG_BOOTSTRAP_TIMEOUT`` (seconds, default 30) and
``KVXFER_SGLANG_AUX_BYTES`` (the daemon's ``limits.aux_bytes``, default
65536).
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
