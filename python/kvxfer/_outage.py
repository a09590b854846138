"""What the engine adapters (kvxfer.vllm, kvxfer.sglang) share about a
daemon that goes away: which errors mean it is not there, one retry for
the call that found it gone, and one log line per outage.

The library ends the requests in flight itself (``PEER_GONE`` events in
the next poll) and reconnects inside later calls (docs/protocol.md, "When
the daemon goes away"); an adapter only has to keep kvxfer's exceptions
out of its engine's step, turn the affected requests into the engine's
own failures, and make a client again when the library gave one up.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from .client import Client, ClientStatus, Event
from .errors import (CallTimeout, Closed, IOFailure, PeerGone,
                     ShuttingDown)

__all__ = ["DAEMON_GONE", "Outage", "retrying", "gone_event", "nudge"]

# What a call raises when the daemon is not there to serve it: gone
# (restarting, crashed), never there, draining, or not answering.
DAEMON_GONE = (Closed, IOFailure, CallTimeout, ShuttingDown)


class Outage:
    """Logs a daemon loss once per outage (the first error seen), then the
    daemon's return; the errors in between go to debug."""

    def __init__(self, log: logging.Logger, who: str) -> None:
        self.log = log
        self.who = who
        self.down = False

    def lost(self, e: BaseException, consequence: str) -> None:
        if self.down:
            self.log.debug("%s: %s", self.who, e)
            return
        self.down = True
        self.log.warning("%s: kvxferd unavailable (%s); %s until it is "
                         "back", self.who, e, consequence)

    def back(self, why: str) -> None:
        if self.down:
            self.log.warning("%s: %s; transfers resume", self.who, why)
        self.down = False


def retrying(client: Client, fn: Any, *args: Any, **kw: Any) -> Any:
    """fn(*args, **kw), once more when the call was the one that found the
    daemon gone: that call fails with Closed, and the library tries to
    reconnect inside the next one, so a daemon that is back already serves
    the second. Nothing is doubled: the first went to the dead daemon."""
    try:
        return fn(*args, **kw)
    except Closed:
        st = client.state
        if st.status != ClientStatus.RECONNECTING or st.attempts:
            raise
        return fn(*args, **kw)


def nudge(client: Client) -> None:
    """Before a step's calls while the daemon is gone: when a daemon
    listens again and the library's next attempt is a few milliseconds
    away (it looks again 5 ms after finding nobody), wait for it, so that
    this step's call reconnects instead of failing (a request that came
    just after the daemon would be lost). One connect() of our own, made
    only in an outage."""
    st = client.state
    if st.status != ClientStatus.RECONNECTING or \
            not 0 < st.next_attempt <= 0.01:
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(client.socket_path)
    except OSError:
        return  # nobody listens yet
    finally:
        s.close()
    time.sleep(st.next_attempt)


def gone_event(ev: Event) -> bool:
    """The library's end of a request the daemon took with it."""
    return ev.code == PeerGone.code and \
        ev.message.startswith("kvxferd went away")
