"""SGLang's bootstrap protocol: the server, and what the ranks say to it.

The server is SGLang's own ``CommonKVBootstrapServer`` (the one Mooncake
and NIXL run), so everything that speaks to a prefill's bootstrap port
finds what it expects there: ``PUT /route`` (a prefill rank's row), ``GET
/route`` (the prefill's parallel info, or one rank's row),
``/register_dp_rank`` and ``/query_dp_ranks`` (the DP rank of a room when
the prefill balances its DP groups itself), ``/health``; and in
``SGLANG_RUST_SERVER`` mode SGLang's Rust registry stands in for it, as
for the built-in backends.

A kvxfer rank's row is SGLang's with its ``rank_ip`` naming kvxfer's
end instead of a ZMQ socket: ``kvx://...#INSTANCE``, the daemon that
serves the rank, then its kvxfer instance (``rank_port`` is the kvxfer
rank). A decode reads the row of rank 0 of the prefill DP group a room
goes to, which is all that fetch by key needs.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, Optional

from sglang.srt.disaggregation.common.conn import (CommonKVBootstrapServer,
                                                   PrefillServerInfo)

from .common import _http_host

_MAX_BODY = 65536  # a route answer is a few hundred bytes
_TIMEOUT = 2.0  # seconds, one HTTP exchange


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """The prefill instance's bootstrap server: SGLang's
    ``CommonKVBootstrapServer``, unchanged (SGLang starts it in the
    prefill's main process on ``--disaggregation-bootstrap-port``)."""

    @property
    def address(self) -> str:
        """host:port a decode reaches it at (its ``bootstrap_addr``)."""
        return f"{_http_host(self.host)}:{self.port}"


class BootstrapError(Exception):
    """An exchange with a bootstrap server failed; the message says
    which URL and why (its status and text, or the connection error)."""


def _exchange(url: str, method: str = "GET",
              body: Optional[Dict[str, Any]] = None) -> Any:
    """One HTTP exchange; the JSON answer (or its text), else
    BootstrapError."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method,
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=_TIMEOUT) as r:
            raw = r.read(_MAX_BODY + 1)
    except urllib.error.HTTPError as e:
        why = e.read(512).decode(errors="replace").strip()
        raise BootstrapError(f"{method} {url}: {e.code} {why}") from None
    except (urllib.error.URLError, OSError) as e:
        raise BootstrapError(f"{method} {url}: {e}") from None
    if len(raw) > _MAX_BODY:
        raise BootstrapError(f"{method} {url}: an answer over {_MAX_BODY} "
                             "bytes")
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def put_route(bootstrap: str, row: Dict[str, Any], timeout: float) -> None:
    """``PUT /route`` of a prefill rank's row, retried until ``timeout``
    seconds (the server starts beside the schedulers)."""
    end = time.monotonic() + timeout
    while True:
        try:
            _exchange(f"http://{bootstrap}/route", "PUT", row)
            return
        except BootstrapError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.2)


def prefill_info(bootstrap: str) -> PrefillServerInfo:
    """The prefill's parallel info (``GET /route`` with -1 ranks), as
    SGLang's decode queue reads it; BootstrapError until every prefill
    rank registered (503)."""
    url = (f"http://{bootstrap}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
           "&target_tp_rank=-1&target_pp_rank=-1")
    d = _exchange(url)
    try:
        fields = set(PrefillServerInfo.__dataclass_fields__)
        return PrefillServerInfo(**{k: v for k, v in d.items()
                                    if k in fields})
    except (AttributeError, TypeError, ValueError) as e:
        raise BootstrapError(f"GET {url}: not a prefill's parallel info "
                             f"({e}): {str(d)[:200]}") from None


@dataclass(frozen=True)
class GroupLocator:
    """Where a decode fetches a prefill DP group's requests from."""

    instance_id: str  # the group's kvxfer instance
    address: str  # the daemon of its rank 0


def locator_ip(address: str, instance_id: str) -> str:
    """The ``rank_ip`` of a kvxfer rank's row."""
    return f"{address}#{instance_id}"


def group_locator(bootstrap: str, dp_group: int) -> GroupLocator:
    """The row of rank 0 (TP 0, PP 0) of prefill DP group ``dp_group``;
    BootstrapError when the server has none, or a row that is not a
    kvxfer rank's (another backend's prefill)."""
    q = urllib.parse.urlencode({"prefill_dp_rank": dp_group,
                                "prefill_cp_rank": 0, "target_tp_rank": 0,
                                "target_pp_rank": 0})
    url = f"http://{bootstrap}/route?{q}"
    d = _exchange(url)
    ip = d.get("rank_ip") if isinstance(d, dict) else None
    address, sep, instance = str(ip).partition("#")
    if not sep or not address.startswith("kvx://") or not instance:
        raise BootstrapError(
            f"GET {url}: rank_ip {ip!r} is not a kvxfer rank's "
            "(kvx://...#INSTANCE): the prefill there runs another "
            "transfer backend")
    return GroupLocator(instance, address)


def register_dp_rank(bootstrap: str, room: int, dp_group: int) -> None:
    """``POST /register_dp_rank``: the DP group that took ``room``, for a
    decode that asks ``/query_dp_ranks`` (the prefill balances its DP
    groups itself)."""
    _exchange(f"http://{bootstrap}/register_dp_rank", "POST",
              {"bootstrap_room": int(room), "dp_rank": int(dp_group)})
