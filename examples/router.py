#!/usr/bin/env python3
"""A router in front of a prefill server and a decode server: the whole
disaggregated flow through kvxfer, on the CPU or on a GPU.

::

    router.py [--device cpu|cuda] [--by key|params] [--prompts 300,45,1000]
              [--tokens 32] [--check] [--socket PATH | --kvxferd PATH]
              [--fault released|wrong-key]

The router (this script's main) starts a kvxferd on a private socket
(or uses ``--socket``'s), then two long-lived worker processes, each an
instance of its own with its own paged pool and a small HTTP/JSON API on
127.0.0.1 (the standard library's http.server):

* the **prefill server**, instance ``prefill-0`` (role context): vLLM's
  NHD layout, 16 tokens per block, a tensor per layer.
  ``POST /prefill {"key", "prompt"}`` prefills, writes the prompt's K/V
  into free blocks, publishes them under the router's key with the first
  token as the aux payload, and answers with the first token, the params
  (base64), its instance id and daemon address. A thread polls the
  instance's events: a block is free again once its offer's terminal event
  comes (the decode's transfer, a release, the lease's end).
  ``GET /offers/KEY`` says whether the offer is held or how it ended.
* the **decode server**, instance ``decode-0`` (role generation):
  FlashInfer's layout, 32 tokens per block. ``POST /decode`` takes the
  params (``--by params``) or only the key, the context instance and its
  daemon address (``--by key``: ``Client.fetch_by_key``), fetches into
  scattered blocks, waits for the fetch's event, rebuilds its cache from
  the blocks and decodes greedily; it answers with the tokens, or with the
  event's error.

For each prompt the router posts it to the prefill server, hands the key
(or the params) to the decode server, prints the tokens and each hop's
time, checks that the prefill's blocks came back, and with ``--check``
compares the tokens with a colocated run (prefill and decode in one
process). A decode that fails prints the error its event carried, and the
router releases the offer (``Client.release`` on a connection without
Hello) so that the prefill's blocks are free at once. ``--fault`` makes a
decode fail on purpose. Every HTTP call and every wait has a timeout.

The model is examples/paged_llama.py's small Llama (random weights from a
fixed seed): bf16 in GPU pools on CUDA, fp32 in host pools (on
``kvxfer.HostBuffer`` memory) on the CPU. Needs torch and transformers,
and the kvxfer package and library (this tree's python/ and build/, or
KVXFER_LIB). The last line is ``N passed, N failed`` (a prompt passes when
its decode succeeded, its tokens are the colocated run's under
``--check``, and the prefill's blocks were freed; under ``--fault``, when
the decode failed with an error and the blocks were freed).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from paged_llama import (HD, KV_HEADS, L, decode_from,  # noqa: E402
                         device_dtype, flashinfer_tensors, kvx, model,
                         prefill, prompt_of, read_flashinfer, start_daemon,
                         sync, vllm_nhd_tensors, write_vllm_nhd)

PREFILL_ID, DECODE_ID = "prefill-0", "decode-0"
PREFILL_TPB, DECODE_TPB = 16, 32  # tokens per block of each pool
MAX_BODY = 16 << 20  # the largest request body a server reads
# last logits of a rebuilt cache against the colocated run's
LOGIT_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}

Json = Dict[str, Any]


class ServerError(Exception):
    """A server answered with an error (its JSON "error" object)."""

    def __init__(self, error: Json) -> None:
        self.error = error
        super().__init__(f"{error.get('name', 'ERROR')}: "
                         f"{error.get('message', '')}")


def _error_json(e: BaseException) -> Json:
    """An exception as the "error" object of a reply."""
    name = getattr(e, "name", None) or type(e).__name__
    return {"name": name, "code": getattr(e, "code", None),
            "message": getattr(e, "message", None) or str(e)}


def _event_json(ev: Any) -> Json:
    """A kvxfer.Event as JSON (its error's name when it failed)."""
    kind = getattr(ev.kind, "name", str(ev.kind))
    err = ev.error
    return {"kind": kind, "code": ev.code, "message": ev.message,
            "name": err.name if err is not None else "OK"}


# -- the servers -----------------------------------------------------------

Route = Callable[[str, Json], Tuple[int, Json]]


class _Handler(BaseHTTPRequestHandler):
    """JSON in, JSON out; the app's routes do the work."""

    server: "_Server"
    protocol_version = "HTTP/1.0"

    def _reply(self, status: int, body: Json) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        route = self.server.app.route(method, path)
        if route is None:
            self._reply(404, {"error": {"name": "NOT_FOUND",
                                        "message": f"no {method} {path}"}})
            return
        body: Json = {}
        if method == "POST":
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 <= n <= MAX_BODY:
                self._reply(413, {"error": {"name": "LIMIT", "message":
                                            f"body of {n} bytes"}})
                return
            try:
                body = json.loads(self.rfile.read(n) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("expected a JSON object")
            except ValueError as e:
                self._reply(400, {"error": {"name": "INVALID",
                                            "message": f"body: {e}"}})
                return
        try:
            status, out = route(path, body)
        except Exception as e:  # reported to the router, not raised here
            if hasattr(e, "code"):  # a kvxfer.Error
                status, out = 500, {"error": _error_json(e)}
            elif isinstance(e, (KeyError, TypeError, ValueError)):
                status, out = 400, {"error": {"name": "INVALID",
                                              "message": f"body: {e!r}"}}
            else:
                status, out = 500, {"error": _error_json(e)}
        self._reply(status, out)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def log_message(self, fmt: str, *args: Any) -> None:
        sys.stderr.write(f"{self.server.app.name}: {fmt % args}\n")


class _Server(HTTPServer):
    app: "_App"


class _App:
    """What both servers share: a kvxfer client of one instance, a paged
    pool and its free blocks."""

    name = "server"

    def __init__(self, sock: str, device: str, num_blocks: int) -> None:
        self.kvxfer = kvx()
        self.num_blocks = num_blocks
        self.device, self.dtype = device_dtype(device)
        self.model = model(self.device, self.dtype)
        self.lock = threading.Lock()  # the free list
        self.client: Any = None
        self.free: List[int] = []

    def route(self, method: str, path: str) -> Optional[Route]:
        """The handler of a request, or None (404)."""
        if (method, path) == ("GET", "/health"):
            return lambda p, b: (200, self.health())
        return None

    def health(self) -> Json:
        """Who this is and how many blocks are free."""
        with self.lock:
            free = len(self.free)
        return {"name": self.name, "device": self.device,
                "dtype": str(self.dtype).replace("torch.", ""),
                "daemon_address": self.client.daemon_address,
                "free_blocks": free, "num_blocks": self.num_blocks}

    def take(self, n: int) -> List[int]:
        """n free blocks, or LimitReached."""
        with self.lock:
            if n > len(self.free):
                raise self.kvxfer.LimitReached(
                    -16, f"{self.name}: {n} blocks needed, "
                    f"{len(self.free)} of {self.num_blocks} free")
            out, self.free = self.free[:n], self.free[n:]
            return out

    def give(self, blocks: List[int]) -> None:
        """Blocks the daemon no longer touches."""
        with self.lock:
            self.free.extend(blocks)

    def close(self) -> None:
        """End the instance (the daemon drops its pool and requests)."""
        if self.client is not None:
            self.client.close()


class PrefillServer(_App):
    """The context instance: prefill, write the KV, publish, and free each
    offer's blocks at its terminal event."""

    name = "prefill"

    def __init__(self, sock: str, device: str, num_blocks: int) -> None:
        super().__init__(sock, device, num_blocks)
        kvxfer = self.kvxfer
        self.client = kvxfer.Client(
            sock, instance_id=PREFILL_ID, role="context",
            parallel=kvxfer.Parallel(tp=1, total_layers=L,
                                     total_kv_heads=KV_HEADS), timeout=30)
        self.client.join([self.client.daemon_address])
        layout = kvxfer.Layout.preset(
            "vllm-nhd", num_layers=L, num_heads=KV_HEADS, head_dim=HD,
            dtype=self.dtype, tokens_per_block=PREFILL_TPB,
            num_blocks=num_blocks)
        self.tensors = vllm_nhd_tensors(num_blocks, PREFILL_TPB, KV_HEADS,
                                        self.device, self.dtype)
        self.pool = self.client.register_pool(self.tensors, layout)
        self.free = list(range(num_blocks))
        self.offers: Dict[bytes, Tuple[List[int], float]] = {}
        self.ended: Dict[bytes, Json] = {}  # the last 1000 offers' ends
        self.stop = threading.Event()
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()

    def route(self, method: str, path: str) -> Optional[Route]:
        if (method, path) == ("POST", "/prefill"):
            return lambda p, b: (200, self.do_prefill(b))
        if method == "GET" and path.startswith("/offers/"):
            return lambda p, b: (200, self.offer(
                urllib.parse.unquote(p[len("/offers/"):])))
        return super().route(method, path)

    def do_prefill(self, body: Json) -> Json:
        """Prefill body["prompt"] (token ids), publish its KV under
        body["key"]; the first token and the params."""
        key = str(body["key"])
        prompt = torch.tensor([int(t) for t in body["prompt"]])
        T = len(prompt)
        if T < 1:
            raise ValueError("prompt: empty")
        blocks = self.take(math.ceil(T / PREFILL_TPB))
        try:
            sync(self.device)
            t0 = time.perf_counter()
            first, cache = prefill(self.model, prompt)
            write_vllm_nhd(self.tensors, cache, blocks, PREFILL_TPB, T)
            sync(self.device)  # the daemon reads the blocks from now on
            t1 = time.perf_counter()
            with self.lock:  # an event for the key finds its blocks
                params = self.client.publish(key, self.pool, blocks,
                                             num_tokens=T,
                                             aux=first.to_bytes(4, "little"))
                self.offers[key.encode()] = (blocks, time.perf_counter())
        except BaseException:
            self.give(blocks)
            raise
        return {"key": key, "first_token": first, "num_tokens": T,
                "blocks": len(blocks),
                "params": base64.b64encode(params).decode(),
                "context_instance": PREFILL_ID,
                "context_address": self.client.daemon_address,
                "prefill_s": t1 - t0,
                "publish_s": time.perf_counter() - t1}

    def offer(self, key: str) -> Json:
        """{"state": "held"}, or how the offer ended and the blocks it
        gave back, or {"state": "unknown"}."""
        k = key.encode()
        with self.lock:
            if k in self.offers:
                return {"state": "held", "blocks": len(self.offers[k][0])}
            if k in self.ended:
                return dict(self.ended[k], state="ended")
        return {"state": "unknown"}

    def _poll(self) -> None:
        """The instance's events: each ends an offer and frees its blocks.
        A non-blocking poll, so that a publish never waits on it."""
        while not self.stop.is_set():
            try:
                batch = self.client.poll(1, 0)
            except self.kvxfer.Error as e:  # closed, or the daemon gone
                if not self.stop.is_set():
                    sys.stderr.write(f"prefill: poll: {e}\n")
                return
            for ev in batch:
                with self.lock:
                    blocks, t0 = self.offers.pop(ev.key, ([], 0.0))
                    self.free.extend(blocks)
                    self.ended[ev.key] = dict(
                        _event_json(ev), freed_blocks=len(blocks),
                        held_s=time.perf_counter() - t0 if t0 else None)
                    while len(self.ended) > 1000:
                        del self.ended[next(iter(self.ended))]
            if not len(batch):
                self.stop.wait(0.01)

    def close(self) -> None:
        self.stop.set()
        self.poller.join(5)
        super().close()


class DecodeServer(_App):
    """The generation instance: fetch (by params or by key), rebuild the
    cache from its blocks, decode."""

    name = "decode"

    def __init__(self, sock: str, device: str, num_blocks: int) -> None:
        super().__init__(sock, device, num_blocks)
        kvxfer = self.kvxfer
        self.client = kvxfer.Client(
            sock, instance_id=DECODE_ID, role="generation",
            parallel=kvxfer.Parallel(tp=1, total_layers=L,
                                     total_kv_heads=KV_HEADS), timeout=30)
        self.client.join([self.client.daemon_address])
        layout = kvxfer.Layout.preset(
            "flashinfer", num_layers=L, num_heads=KV_HEADS, head_dim=HD,
            dtype=self.dtype, tokens_per_block=DECODE_TPB,
            num_blocks=num_blocks)
        self.tensors = flashinfer_tensors(num_blocks, DECODE_TPB,
                                          self.device, self.dtype)
        self.pool = self.client.register_pool(self.tensors, layout)
        self.free = random.Random(3).sample(range(num_blocks), num_blocks)

    def route(self, method: str, path: str) -> Optional[Route]:
        if (method, path) == ("POST", "/decode"):
            return lambda p, b: (200, self.do_decode(b))
        return super().route(method, path)

    def _wait(self, key: bytes, wait_s: float) -> Any:
        """The terminal event of key, or None after wait_s seconds.
        Events of other keys (a fetch given up earlier) are dropped."""
        end = time.monotonic() + wait_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            for ev in self.client.poll(1, min(0.2, left)):
                if ev.key == key:
                    return ev

    def do_decode(self, body: Json) -> Json:
        """Fetch the KV of body["key"] (with body["params"], or by key from
        body["context_instance"] at body["context_address"]), then decode
        body["new_tokens"] tokens. {"ok": false, "error": ...} when the
        fetch is refused, fails or has no event in body["wait_s"]."""
        key = str(body["key"])
        T, n = int(body["num_tokens"]), int(body["new_tokens"])
        wait_s = float(body.get("wait_s", 30))
        if T < 1 or n < 2 or wait_s <= 0:
            raise ValueError("num_tokens >= 1, new_tokens >= 2, wait_s > 0")
        mine = "dec-" + key  # this side's name of the request
        blocks = self.take(math.ceil(T / DECODE_TPB))
        try:
            t0 = time.perf_counter()
            try:
                if body.get("params"):
                    self.client.fetch(mine, base64.b64decode(body["params"]),
                                      self.pool, blocks)
                else:
                    self.client.fetch_by_key(
                        mine, str(body["context_instance"]),
                        str(body["context_address"]),
                        str(body.get("context_key", key)), self.pool, blocks)
            except self.kvxfer.Error as e:  # refused: the call's own fields
                return {"ok": False, "error": dict(_error_json(e),
                                                   kind="REFUSED")}
            ev = self._wait(mine.encode(), wait_s)
            transfer_s = time.perf_counter() - t0
            if ev is None:  # after cancel() the daemon leaves the blocks
                self.client.cancel(mine)
                return {"ok": False, "transfer_s": transfer_s, "error": {
                    "name": "TIMEOUT", "kind": "NO_EVENT", "message":
                    f"no event for {mine} in {wait_s:g} s (fetch cancelled)"}}
            if not ev.ok:
                return {"ok": False, "transfer_s": transfer_s,
                        "error": _event_json(ev)}
            first = int.from_bytes(ev.aux, "little")
            cache = read_flashinfer(self.tensors, blocks, T, self.device)
        finally:
            self.give(blocks)  # read_flashinfer copied them
        sync(self.device)
        t1 = time.perf_counter()
        toks, logits = decode_from(self.model, cache, first, n)
        sync(self.device)
        return {"ok": True, "tokens": toks, "first_token": first,
                "blocks": len(blocks), "transfer_s": transfer_s,
                "decode_s_per_token": (time.perf_counter() - t1) / (n - 1),
                "last_logits": logits.tolist()}


def serve(role: str, sock: str, device: str, num_blocks: int) -> int:
    """A server's main: build the app, print one JSON line (the port) on
    stdout, serve until SIGTERM."""
    cls = PrefillServer if role == "prefill" else DecodeServer
    app = cls(sock, device, num_blocks)
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.app = app
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    print(json.dumps({"ready": role, "port": httpd.server_address[1]}),
          flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()
        app.close()
    return 0


# -- the router ------------------------------------------------------------

def call(url: str, body: Optional[Json], timeout: float) -> Json:
    """GET (body None) or POST JSON, within timeout seconds. A server's
    error reply raises ServerError; no answer raises TimeoutError or
    ConnectionError."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read()).get("error") or {}
        except ValueError:
            err = {}
        raise ServerError(err or {"name": f"HTTP {e.code}",
                                  "message": str(e)}) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            raise TimeoutError(f"{url}: no answer in {timeout:g} s") from None
        raise ConnectionError(f"{url}: {reason}") from None


class Worker:
    """A server process the router started, and its URL."""

    def __init__(self, role: str, sock: str, device: str, num_blocks: int,
                 logdir: str, timeout: float) -> None:
        self.role = role
        self.log = os.path.join(logdir, f"{role}.log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve", role,
                 "--socket", sock, "--device", device, "--blocks",
                 str(num_blocks)], stdout=subprocess.PIPE, stderr=log,
                env=env)
        self.url = ""
        self._timeout = timeout

    def ready(self) -> None:
        """Wait for the ready line (the model loads first)."""
        assert self.proc.stdout is not None
        end = time.monotonic() + self._timeout
        while time.monotonic() < end:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    break  # it exited
                msg = json.loads(line)
                self.url = f"http://127.0.0.1:{msg['port']}"
                return
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"the {self.role} server did not start in "
                           f"{self._timeout:g} s:\n{self.tail()}")

    def tail(self, n: int = 20) -> str:
        """The last lines of its log."""
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def offer_end(prefill_url: str, key: str, wait: float,
              timeout: float) -> Json:
    """The prefill server's word on the offer of key, waiting up to
    wait seconds for it to end (each call within timeout)."""
    end = time.monotonic() + wait
    while True:
        st = call(f"{prefill_url}/offers/{urllib.parse.quote(key)}", None,
                  timeout)
        if st["state"] != "held" or time.monotonic() > end:
            return st
        time.sleep(0.01)


def release(sock: str, pre: Json, by: str, timeout: float) -> str:
    """Release the offer from the router (a client without Hello), by
    its params or by key; what happened, in words."""
    kvxfer = kvx()
    try:
        with kvxfer.Client(sock, timeout=timeout) as c:
            if by == "params":
                c.release(base64.b64decode(pre["params"]))
            else:
                c.release(context_instance=pre["context_instance"],
                          context_address=pre["context_address"],
                          context_key=pre["key"])
        return "released by the router"
    except kvxfer.Error as e:
        return f"release refused: {e}"


def ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


Reference = Optional[Tuple[List[int], torch.Tensor]]


def route_one(a: argparse.Namespace, pre_url: str, dec_url: str,
              sock: str, prompt: List[int], ref: Reference,
              tol: float) -> bool:
    """One request through prefill, transfer and decode; True when it
    went as expected."""
    key = "req-" + uuid.uuid4().hex[:12]
    T = len(prompt)
    t0 = time.perf_counter()
    pre = call(f"{pre_url}/prefill", {"key": key, "prompt": prompt},
               a.timeout)
    hop1 = time.perf_counter() - t0
    print(f"{key}: prompt {T} tokens -> prefill {ms(pre['prefill_s'])}, "
          f"publish {ms(pre['publish_s'])} ({pre['blocks']} blocks of "
          f"{PREFILL_TPB}; HTTP {ms(hop1)}), first token "
          f"{pre['first_token']}, params {len(pre['params']) * 3 // 4} B")
    if a.fault == "released":  # the offer ends before the decode asks
        what = release(sock, pre, a.by, a.timeout)
        st = offer_end(pre_url, key, a.release_wait, a.timeout)
        print(f"  fault: {what}; the offer is {st['state']}")
    body: Json = {"key": key, "num_tokens": T, "new_tokens": a.tokens,
                  "wait_s": a.transfer_timeout}
    if a.by == "params":
        body["params"] = pre["params"]
    else:
        body.update(context_instance=pre["context_instance"],
                    context_address=pre["context_address"],
                    context_key=key + ("-gone" if a.fault == "wrong-key"
                                       else ""))
    t1 = time.perf_counter()
    try:
        dec = call(f"{dec_url}/decode", body, a.timeout)
    except (ServerError, TimeoutError, ConnectionError) as e:
        dec = {"ok": False, "error": {"kind": "HTTP", "message": str(e),
                                      "name": type(e).__name__}}
    hop2 = time.perf_counter() - t1
    ok = True
    if dec["ok"]:
        print(f"  transfer {ms(dec['transfer_s'])} (by {a.by}, "
              f"{dec['blocks']} blocks of {DECODE_TPB}), decode "
              f"{dec['decode_s_per_token'] * 1e3:.2f} ms/token x "
              f"{a.tokens - 1} (HTTP {ms(hop2)})")
        print(f"  tokens {dec['tokens']}")
        if ref is not None:
            diff = float((torch.tensor(dec["last_logits"]) -
                          ref[1]).abs().max())
            same = dec["tokens"] == ref[0]
            ok = same and diff <= tol
            print(f"  {'ok' if ok else 'FAIL'}: tokens "
                  f"{'equal to' if same else 'DIFFER from'} the colocated "
                  f"run's, last logits max |diff| {diff:.4f} (tolerance "
                  f"{tol:g})")
            if not same:
                print(f"  colocated {ref[0]}")
        ok = ok and not a.fault
    else:
        err = dec["error"]
        print(f"  decode failed ({err.get('kind')}): {err['name']}: "
              f"{err['message']} (after {ms(dec.get('transfer_s'))})")
        ok = bool(a.fault)
    # a transfer ends the offer; after a failed decode it may stay held
    st = offer_end(pre_url, key, a.release_wait if dec["ok"] else 0,
                   a.timeout)
    if st["state"] == "held":  # the decode gave up: release it now
        print(f"  prefill offer still held: "
              f"{release(sock, pre, a.by, a.timeout)}")
        st = offer_end(pre_url, key, a.release_wait, a.timeout)
    if st["state"] == "ended":
        print(f"  prefill: {st['freed_blocks']} blocks freed at the offer's "
              f"{st['kind']}{': ' + st['message'] if st['message'] else ''}"
              f" ({ms(st['held_s'])} after publish)")
        ok = ok and st["freed_blocks"] == pre["blocks"]
    else:
        print(f"  FAIL: the prefill offer is {st['state']} after "
              f"{a.release_wait:g} s")
        ok = False
    return ok


def router(a: argparse.Namespace) -> int:
    """Start what is missing, route every prompt, stop what it started."""
    device, dtype = device_dtype(a.device)
    lengths = [int(x) for x in a.prompts.split(",")]
    daemon = None
    workers: List[Worker] = []
    passed = failed = 0
    with tempfile.TemporaryDirectory(prefix="kvxfer-router-") as d:
        try:
            if a.socket:
                sock = a.socket
            else:
                daemon, sock = start_daemon(a.kvxferd, d, (
                    f"deadlines:\n  fetch_timeout_ms: "
                    f"{int(a.fetch_timeout * 1000)}\n"
                    if a.fetch_timeout else ""))
            for role, nb in (("prefill", a.prefill_blocks),
                             ("decode", a.decode_blocks)):
                workers.append(Worker(role, sock, device, nb, d,
                                      a.start_timeout))
            refs: List[Reference] = [None] * len(lengths)
            if a.check:  # the colocated runs, while the servers load
                m = model(device, dtype)
                t0 = time.perf_counter()
                for i, n in enumerate(lengths):
                    first, cache = prefill(m, prompt_of(n, seed=i + 1))
                    refs[i] = decode_from(m, cache, first, a.tokens)
                colo = time.perf_counter() - t0
                del m
            for w in workers:
                w.ready()
            pre, dec = (call(w.url + "/health", None, a.timeout)
                        for w in workers)
            print(f"kvxfer router: {device} ({pre['dtype']}), by {a.by}, "
                  f"kvxferd {sock}" + (f", fault {a.fault}" if a.fault
                                       else ""))
            print(f"  prefill server {workers[0].url}: {PREFILL_ID}, "
                  f"vllm-nhd {PREFILL_TPB} tokens/block, "
                  f"{pre['num_blocks']} blocks, daemon "
                  f"{pre['daemon_address']}")
            print(f"  decode server  {workers[1].url}: {DECODE_ID}, "
                  f"flashinfer {DECODE_TPB} tokens/block, "
                  f"{dec['num_blocks']} blocks")
            if a.check:
                print(f"  colocated runs: {colo:.2f} s for {len(lengths)} "
                      f"prompts x {a.tokens} tokens")
            for i, n in enumerate(lengths):
                try:
                    ok = route_one(a, workers[0].url, workers[1].url, sock,
                                   prompt_of(n, seed=i + 1).tolist(),
                                   refs[i], LOGIT_TOL[dtype])
                except (ServerError, TimeoutError, ConnectionError) as e:
                    print(f"  FAIL: {type(e).__name__}: {e}")
                    ok = False
                passed += ok
                failed += not ok
            for w in workers:  # every block back where it was
                h = call(w.url + "/health", None, a.timeout)
                if h["free_blocks"] != h["num_blocks"]:
                    print(f"FAIL: {w.role} server: {h['free_blocks']} of "
                          f"{h['num_blocks']} blocks free at the end")
                    failed += 1
        except Exception as e:
            print(f"FAIL router: {type(e).__name__}: {e}")
            for w in workers:
                print(f"--- {w.role} server log (last lines)\n{w.tail()}")
            failed += 1
        finally:
            for w in workers:
                w.stop()
            if daemon is not None:
                daemon.terminate()
                try:
                    daemon.wait(10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Route prompts through a prefill server and a decode "
        "server that move the KV cache with kvxfer.")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when "
                    "torch sees a GPU)")
    ap.add_argument("--by", choices=["key", "params"], default="key",
                    help="what the decode gets: the key (fetch_by_key) or "
                    "the params")
    ap.add_argument("--prompts", default="300,45,1000",
                    help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--tokens", type=int, default=32,
                    help="tokens decoded per prompt (the first included)")
    ap.add_argument("--check", action="store_true",
                    help="compare with a colocated run")
    ap.add_argument("--socket", help="a running kvxferd's socket (default: "
                    "start one)")
    ap.add_argument("--kvxferd", default=os.environ.get(
        "KVXFERD", os.path.join(HERE, "..", "build", "kvxferd")),
        help="the daemon to start (default: $KVXFERD, else this tree's "
        "build/kvxferd)")
    ap.add_argument("--fault", choices=["released", "wrong-key"],
                    help="make each decode fail: the router releases the "
                    "offer first, or the decode asks for a key never "
                    "published (--by key)")
    ap.add_argument("--prefill-blocks", type=int, default=256,
                    help="blocks of 16 tokens in the prefill pool")
    ap.add_argument("--decode-blocks", type=int, default=128,
                    help="blocks of 32 tokens in the decode pool")
    ap.add_argument("--timeout", type=float, default=120,
                    help="seconds for any HTTP call")
    ap.add_argument("--fetch-timeout", type=float,
                    help="seconds: deadlines.fetch_timeout_ms of the "
                    "kvxferd the router starts (default: the daemon's, "
                    "30)")
    ap.add_argument("--transfer-timeout", type=float,
                    help="seconds the decode server waits for a fetch's "
                    "event before it cancels it (default: the fetch "
                    "timeout + 5)")
    ap.add_argument("--start-timeout", type=float, default=180,
                    help="seconds for a server to load and answer")
    ap.add_argument("--release-wait", type=float, default=10,
                    help="seconds to wait for a prefill offer to end")
    ap.add_argument("--serve", choices=["prefill", "decode"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve, a.socket, a.device or "cpu", a.blocks)
    if a.tokens < 2:
        ap.error("--tokens: at least 2")
    if a.fault == "wrong-key" and a.by != "key":
        ap.error("--fault wrong-key needs --by key")
    if a.transfer_timeout is None:
        a.transfer_timeout = (a.fetch_timeout or 30) + 5
    if a.timeout <= a.transfer_timeout:
        ap.error("--timeout must be more than --transfer-timeout")
    return router(a)


if __name__ == "__main__":
    sys.exit(main())
