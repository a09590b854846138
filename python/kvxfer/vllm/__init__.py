"""vLLM's KV connector on kvxfer: prefill/decode disaggregation in one
config line (tested against vLLM 0.33.0, the version this module pins)::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_producer"}'

(``kv_consumer`` on the decode instance; ``kv_both`` makes ranks of both
roles).

The flow is the one vLLM's proxy drives for its NIXL connector. A request
sent to the prefill instance with ``kv_transfer_params
{"do_remote_decode": true}`` and ``max_tokens 1`` finishes there; the
prefill scheduler reserves the request's offer on kvxferd
(:meth:`kvxfer.Client.reserve`) and returns its params, at once, in the
request's ``kv_transfer_params``; its workers publish the request's blocks
the next step and free them when kvxfer says the offer ended. The proxy
hands those params to the decode instance, whose scheduler allocates
blocks and whose workers fetch into them; the request runs once kvxfer's
COMPLETE arrives. Heterogeneous TP, PP and layouts between the two
instances are kvxferd's job; this module has no mapping code.

Hybrid models (vLLM's hybrid memory allocator; the connector is
``SupportsHMA``): every KV cache group is one kvxfer block table of the
request (:mod:`kvxfer.vllm.hybrid`): full attention whole, a sliding
window the blocks it keeps, Mamba state as a state slot.

Faults, as vLLM expects them: a fetch that fails (the prefill instance
died, the offer timed out, params that do not fit) reports the request's
blocks from ``get_block_ids_with_load_errors`` so that vLLM's
``kv_load_failure_policy`` applies (``recompute``: the decode computes the
prompt itself); a decode request aborted while its KV moves is cancelled
(fenced: no byte is written after the CANCELLED event) before vLLM frees
its blocks; a decode that needs no transfer (its prefix cache holds the
whole prompt) or is aborted before it started releases the prefill's
blocks at once.

The daemon going away (a restart, an upgrade, a crash) costs the requests
in flight, never the engine: no exception from kvxfer leaves a method
vLLM's step calls. A decode's fetch in flight reports its blocks as load
errors (``kv_load_failure_policy``), a prefill's send is reported finished
so that its blocks are freed; while the daemon is gone, a prefill returns
no params (its decode computes the prompt) and a decode fetches nothing
(load errors). The library reconnects by itself (pools stay registered);
a client it gave up on (reconnection off, a call that timed out) is made
again here. The next requests go through kvxfer again, without an engine
restart. Each outage is logged once, and the return.

``kv_connector_extra_config`` keys (all optional):

``socket``
    kvxferd's socket (default ``$KVXFER_SOCKET``, else
    ``/run/kvxfer/kvxferd.sock``).
``timeout_s``
    the timeout of each call to the daemon (default 10 s).
``instance_id``
    this instance's kvxfer name (default vLLM's ``engine_id``).
``kv_recompute_threshold``
    vLLM's name for it (its NIXL connector reads the same key): a decode
    that misses fewer prompt tokens than this (its prefix cache holds the
    rest) computes them itself and releases the prefill's blocks instead
    of fetching (default 0: always fetch what is missing).
    ``recompute_below_tokens`` is this connector's earlier name for it.
``rank_addresses``
    the daemon address of every rank, in kvxfer rank order (default: the
    workers' own, gathered through vLLM's handshake metadata:
    ``get_handshake_metadata`` on each worker, the scheduler's
    ``set_xfer_handshake_metadata_pp_aware``, then the next step's
    metadata to every worker).
``layerwise``
    a prefill's offer is reserved at its first scheduled chunk and
    published layer-wise from ``save_kv_layer``, each layer ready as the
    forward writes it (default true; false: whole requests, published
    the step after they finished). See :mod:`kvxfer.vllm.layerwise`.
``layerwise_load``
    the decode loads synchronously and ``wait_for_layer_load`` waits for
    each layer (``fetch_progress``), so its first token's forward runs
    while the last layers land (default false).
``bidirectional_kv_xfer``
    vLLM's NIXL key: multi-turn reuse. A decode offers a finished
    request's KV (prompt and generated tokens) for the next turn's
    prefill, which fetches what its prefix cache lacks (default false;
    both instances ``kv_both``). See :mod:`kvxfer.vllm.bidi`.
``decoder_kv_blocks_ttl``
    vLLM's NIXL key: the lease of such a decode's offer, seconds
    (default 480).

Metrics: ``vllm:kvxfer_*`` in vLLM's ``/metrics`` and stats log
(:mod:`kvxfer.vllm.metrics`).

A configuration the connector cannot serve is refused when vLLM makes it
(``__init__``), naming the option (:func:`kvxfer.vllm.common.check_config`).
"""

from kvxfer.vllm.common import (PARAMS_KEY, VLLM_VERSION,
                                KvxferConnectorMetadata, parallel_rank,
                                request_key)
from kvxfer.vllm.connector import KvxferConnector
from kvxfer.vllm.layout import layout_of_kv_caches

__all__ = ["KvxferConnector", "KvxferConnectorMetadata", "VLLM_VERSION",
           "PARAMS_KEY", "layout_of_kv_caches", "parallel_rank",
           "request_key"]
