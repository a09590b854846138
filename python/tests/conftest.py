"""Fixtures: a real kvxferd on a private socket, and connected ranks.

The daemon is $KVX_BUILD/kvxferd (default: the repository's build/),
started as tests/integration/harness.c does: a config file naming the
socket, the log in the temporary directory (printed when a test fails).
"""

import itertools
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # the package from the source tree

import kvxfer  # noqa: E402


def build_dir():
    b = os.environ.get("KVX_BUILD", "build")
    return b if os.path.isabs(b) else os.path.join(REPO, b)


class Daemon:
    def __init__(self, tmp, extra=""):
        self.dir = str(tmp)
        self.sock = os.path.join(self.dir, "kvxferd.sock")
        self.log = os.path.join(self.dir, "kvxferd.log")
        cfg = os.path.join(self.dir, "kvxferd.yaml")
        with open(cfg, "w") as f:
            f.write(f"socket:\n  path: {self.sock}\n{extra}")
        self.cfg = cfg
        self.start()

    def start(self):
        """Run kvxferd on this config and wait for its socket (again after
        kill9(): a restart on the same path)."""
        exe = os.path.join(build_dir(), "kvxferd")
        if not os.access(exe, os.X_OK):
            pytest.fail(f"{exe} not built (run make)")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([exe, "--config", self.cfg],
                                         stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 10
        while True:
            try:
                kvxfer.Client(self.sock, timeout=0.2).close()
                return
            except kvxfer.Error:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                pytest.fail("kvxferd did not start:\n" + self.tail())
            time.sleep(0.02)

    def kill9(self):
        """SIGKILL, and wait for the process: a crash."""
        self.proc.kill()
        self.proc.wait()

    def tail(self, n=40):
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self):
        """SIGTERM; the exit status (0: drained)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("kvxferd"))
    yield d
    rc = d.stop()
    assert rc == 0, f"kvxferd exited {rc}:\n{d.tail()}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that used the daemon shows the end of its log."""
    out = yield
    rep = out.get_result()
    d = getattr(item, "funcargs", {}).get("daemon")
    if rep.failed and isinstance(d, Daemon):
        rep.sections.append(("kvxferd log (last 40 lines)", d.tail()))


_ids = itertools.count(1)


@pytest.fixture
def names():
    """Unique instance ids and request ids within the daemon."""
    n = next(_ids)
    return {"ctx": f"prefill-{n}", "gen": f"decode-{n}", "req": n * 1000}


def open_rank(sock, instance_id, role, layers=4, heads=2, **kw):
    c = kvxfer.Client(sock, instance_id=instance_id, role=role,
                      parallel=kvxfer.Parallel(total_layers=layers,
                                               total_kv_heads=heads), **kw)
    c.join([c.daemon_address])
    return c


@pytest.fixture
def pair(daemon, names):
    """(context rank, generation rank), joined, one rank each."""
    ctx = open_rank(daemon.sock, names["ctx"], "context")
    gen = open_rank(daemon.sock, names["gen"], "generation")
    yield ctx, gen
    gen.close()
    ctx.close()


def wait_event(client, request_id, timeout=20.0):
    """The terminal event of request_id, an int or a key (bytes or str)
    (single-rank tests only: it drops the other events of the batches it
    reads)."""
    end = time.monotonic() + timeout
    key = kvxfer.key_bytes(request_id)
    while time.monotonic() < end:
        for e in client.poll(1, 0.2):
            if e.key == key:
                return e
    raise AssertionError(f"no event for request {request_id} in {timeout} s")
