"""KvxferKVBootstrapServer: the prefill instance's bootstrap server."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any, Dict, Optional

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from .common import _BOOTSTRAP_MAX_BODY, _BOOTSTRAP_PATH, _http_host, log

# -- the bootstrap server -------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("kvxfer.sglang bootstrap: " + fmt, *args)

    def _reply(self, code: int, body: Any) -> None:
        data = (json.dumps(body) if not isinstance(body, str)
                else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json"
                         if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, "OK")
        elif self.path == _BOOTSTRAP_PATH:
            info = self.server.owner.prefill
            if info is None:
                self._reply(404, {"error": "no kvxfer prefill instance has "
                                  "registered here yet"})
            else:
                self._reply(200, info)
        else:
            self._reply(404, {"error": f"no such path {self.path}"})

    def do_PUT(self) -> None:
        if self.path != _BOOTSTRAP_PATH:
            self._reply(404, {"error": f"no such path {self.path}"})
            return
        try:
            n = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            n = -1
        if not 0 < n <= _BOOTSTRAP_MAX_BODY:
            self._reply(400, {"error": f"Content-Length: {n} (expected 1.."
                              f"{_BOOTSTRAP_MAX_BODY})"})
            return
        try:
            d = json.loads(self.rfile.read(n))
            info = {"instance_id": d["instance_id"], "address": d["address"],
                    "tp_size": int(d.get("tp_size", 1))}
            for k in ("instance_id", "address"):
                if not isinstance(info[k], str) or not 0 < len(info[k]) \
                        <= 192:
                    raise ValueError(f"{k}: expected a string of 1..192 "
                                     "characters")
        except (ValueError, KeyError, TypeError) as e:
            self._reply(400, {"error": f"bad registration: {e}"})
            return
        self.server.owner.prefill = info
        log.info("kvxfer.sglang bootstrap: prefill instance %s, rank 0 at "
                 "%s", info["instance_id"], info["address"])
        self._reply(200, {"ok": True})


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: "KvxferKVBootstrapServer"


class KvxferKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's bootstrap server (SGLang starts it in the
    prefill's main process on ``--disaggregation-bootstrap-port``).

    It serves one JSON object, ``GET /kvxfer/v1/prefill``: the instance's
    kvxfer name (``instance_id``), the daemon address of its rank 0
    (``address``) and its ``tp_size``, which its rank 0's manager puts
    there at start (``PUT`` of the same path); 404 until then. ``GET
    /health`` answers ``OK``. That is all a decode rank needs to fetch by
    key: the daemons do the rest. It runs in a daemon thread; ``port`` 0
    picks a free port (``self.port`` says which).
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.prefill: Optional[Dict[str, Any]] = None
        bind = "" if host in ("0.0.0.0", "") else host
        self._httpd = _HTTPServer((bind, int(port)), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="kvxfer-bootstrap", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """host:port a decode rank reaches it at (its bootstrap_addr)."""
        return f"{_http_host(self.host)}:{self.port}"

    def close(self) -> None:
        """Stop serving. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()

