"""The metrics endpoint (issue 40): /metrics scraped during transfers
moves its byte counters by exactly the bytes moved and its request
counters by the requests; the text passes Prometheus's parser (and
promtool where it is installed); /health says 503 while the daemon
drains and while its loop is stuck; kvxferctl metrics and health answer
over the socket; the Grafana dashboard names only metrics that exist."""

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxfer import EventKind, Layout

from conftest import REPO, Daemon, build_dir, open_rank, wait_event

LAYERS, HEADS, HEAD_DIM, TPB, BLOCKS = 4, 2, 64, 16, 2056
# a snapshot every 20 ms; copies slow enough to scrape one mid-way
CONF = ("metrics:\n  listen: 127.0.0.1:0\n  publish_ms: 20\n"
        "  health_max_lag_ms: 500\n"
        "copy:\n  worker_threads: 1\n  chunk_bytes: 4KiB\n"
        "  max_inflight_chunks: 1\n")


def layout():
    return Layout.preset("vllm-nhd", num_layers=LAYERS, num_heads=HEADS,
                         head_dim=HEAD_DIM, dtype="bf16",
                         tokens_per_block=TPB, num_blocks=BLOCKS)


def block_bytes(lo, arr, block):
    per = lo.token_stride * TPB
    return np.concatenate([
        arr[lo.offset(layer, kv, block):lo.offset(layer, kv, block) + per]
        for layer in range(LAYERS) for kv in range(2)])


def block_size(lo):
    """The bytes of one block: every layer's K and V."""
    return LAYERS * 2 * lo.token_stride * TPB


def wait_all(client, keys, timeout=20.0):
    """{key: kind} of the terminal events of keys (str)."""
    got, end = {}, time.monotonic() + timeout
    while set(got) != set(keys):
        assert time.monotonic() < end, f"events of {set(keys) - set(got)}"
        for e in client.poll(1, 0.2):
            if e.key.decode() in keys:
                got[e.key.decode()] = e.kind
    return got


def http_port(d, timeout=10.0):
    """The port the daemon logged for metrics.listen's port 0."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(d.log, errors="replace") as f:
            m = re.search(r"metrics: serving .* \(port (\d+)\)", f.read())
        if m:
            return int(m.group(1))
        time.sleep(0.02)
    raise AssertionError("no metrics line in the log:\n" + d.tail())


def get(port, path):
    """(status, body) of GET path."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}",
                                    timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text):
    """{(name, sorted labels): value} of every sample, parsed by
    prometheus_client's parser (which raises on a malformed text)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(s, name, **labels):
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape(port):
    status, text = get(port, "/metrics")
    assert status == 200
    return samples(text)


def scrape_until(port, cond, timeout=20.0):
    end = time.monotonic() + timeout
    while True:
        s = scrape(port)
        if cond(s):
            return s
        assert time.monotonic() < end, "the scrape never showed it"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def mdaemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("kvxferd-metrics"), extra=CONF)
    d.port = http_port(d)
    yield d
    rc = d.stop()
    assert rc == 0, f"kvxferd exited {rc}:\n{d.tail()}"


def test_scrape_during_transfers_counts_exact_bytes_and_requests(mdaemon):
    d, port = mdaemon, mdaemon.port
    ctx = open_rank(d.sock, "m-ctx", "context", layers=LAYERS, heads=HEADS)
    gen = open_rank(d.sock, "m-gen", "generation", layers=LAYERS,
                    heads=HEADS)
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    src.array[:] = np.arange(src.array.size, dtype=np.uint8) % 251
    dst.array[:] = 0
    before = scrape(port)
    # two requests: 64 MiB in 4 KiB copies (scraped mid-way) and 3 blocks
    reqs = {"big": list(range(2048)), "small": [2049, 2051, 2053]}
    params = {k: ctx.publish(k, src, b, num_tokens=len(b) * TPB)
              for k, b in reqs.items()}
    gen.fetch("big", params["big"], dst, reqs["big"])
    gen.fetch("small", params["small"], dst, reqs["small"])
    host = ("kvxfer_bytes_total", {"direction": "in", "path": "host"})
    big = len(reqs["big"]) * block_size(lo)

    def moving(s):
        d = val(s, host[0], **host[1]) - val(before, host[0], **host[1])
        return 0 < d < big

    mid = scrape_until(port, moving)
    assert sum(v for (n, _), v in mid.items()
               if n == "kvxfer_requests_in_flight") >= 2  # offer, fetch
    for c in (gen, ctx):
        assert wait_all(c, reqs) == {k: EventKind.COMPLETE for k in reqs}
    moved = sum(len(b) for b in reqs.values()) * block_size(lo)
    sent = set(reqs["big"] + reqs["small"])
    for b in range(BLOCKS):  # what moved is right, nothing else moved
        got = block_bytes(lo, dst.array, b)
        if b in sent:
            assert np.array_equal(got, block_bytes(lo, src.array, b))
        else:
            assert not got.any()

    def fetches(s):
        return val(s, "kvxfer_requests_total", side="fetch",
                   outcome="complete")

    after = scrape_until(port, lambda s: fetches(s) - fetches(before) == 2
                         and val(s, "kvxfer_requests_total", side="offer",
                                 outcome="complete")
                         - val(before, "kvxfer_requests_total",
                               side="offer", outcome="complete") == 2)
    assert (val(before, host[0], **host[1]) <= val(mid, host[0], **host[1])
            < val(before, host[0], **host[1]) + moved)
    assert val(after, host[0], **host[1]) - val(before, host[0],
                                                **host[1]) == moved
    for p in ("same_gpu", "gpu_to_gpu", "peer"):
        assert val(after, "kvxfer_bytes_total", direction="in", path=p) == \
            val(before, "kvxfer_bytes_total", direction="in", path=p)
    assert val(after, "kvxfer_transfers_total", path="host") - \
        val(before, "kvxfer_transfers_total", path="host") == 2
    for side in ("offer", "fetch"):
        for o in ("error", "cancelled", "timed_out"):
            assert val(after, "kvxfer_requests_total", side=side,
                       outcome=o) == val(before, "kvxfer_requests_total",
                                         side=side, outcome=o)
    # the histograms took the two fetches, their sizes in their buckets
    for h in ("kvxfer_transfer_duration_seconds",
              "kvxfer_transfer_size_bytes"):
        assert val(after, h + "_count") - val(before, h + "_count") == 2
    assert val(after, "kvxfer_transfer_size_bytes_sum") - \
        val(before, "kvxfer_transfer_size_bytes_sum") == moved
    small = 3 * block_size(lo)  # 96 KiB: at most 262144, above 65536
    assert val(after, "kvxfer_transfer_size_bytes_bucket", le="262144") \
        - val(before, "kvxfer_transfer_size_bytes_bucket",
              le="262144") == 1
    assert 65536 < small <= 262144
    # and it settles: a later snapshot says the same
    time.sleep(0.1)
    assert val(scrape(port), host[0], **host[1]) == val(after, host[0],
                                                        **host[1])
    gen.close()
    ctx.close()


def test_cancel_counts_cancelled_on_both_sides(mdaemon):
    d, port = mdaemon, mdaemon.port
    ctx = open_rank(d.sock, "m-ctx2", "context", layers=LAYERS, heads=HEADS)
    lo = layout()
    src = ctx.create_host_pool(lo)
    before = scrape(port)
    ctx.publish("gone", src, [0, 1], num_tokens=2 * TPB)
    ctx.cancel("gone")
    assert wait_event(ctx, "gone").kind is EventKind.CANCELLED
    scrape_until(port, lambda s: val(
        s, "kvxfer_requests_total", side="offer", outcome="cancelled")
        - val(before, "kvxfer_requests_total", side="offer",
              outcome="cancelled") == 1)
    ctx.close()


def lint(text):
    """What promtool's lint asks and the issue names: a HELP and TYPE per
    family, _total on counters only, base units, bounded labels."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.M))
    assert types and set(types) == helps
    for name, t in types.items():
        assert name.startswith("kvxfer_")
        assert name.endswith("_total") == (t == "counter"), name
        assert not re.search(r"_(ms|us|ns|milliseconds|kib|mib|kb|mb)(_|$)",
                             name), name
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = re.match(r"[a-z_]+", line).group(0)
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(base) == "histogram", line
        for k in re.findall(r'([a-z_]+)="', line):
            assert k not in ("key", "request", "pid", "instance", "uid"), line


def test_text_passes_the_parsers(mdaemon):
    status, text = get(mdaemon.port, "/metrics")
    assert status == 200 and text.endswith("\n")
    fams = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert fams["kvxfer_bytes"] == "counter"  # the parser drops _total
    assert fams["kvxfer_transfer_duration_seconds"] == "histogram"
    # bounds written exactly, not rounded to 9 digits
    assert 'kvxfer_transfer_size_bytes_bucket{le="17179869184"}' in text
    assert 'kvxfer_transfer_duration_seconds_bucket{le="0.00025"}' in text
    lint(text)
    promtool = shutil.which("promtool")
    if promtool:  # Debian's prometheus package
        r = subprocess.run([promtool, "check", "metrics"], input=text,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def ctl(d, *args):
    return subprocess.run([os.path.join(build_dir(), "kvxferctl"),
                           "--socket", d.sock, *args],
                          capture_output=True, text=True, timeout=30)


def test_kvxferctl_metrics_and_health_over_the_socket(mdaemon):
    r = ctl(mdaemon, "metrics")
    assert r.returncode == 0, r.stderr
    lint(r.stdout)
    assert set(samples(r.stdout)) - {("kvxfer_uptime_seconds", ())} <= \
        set(scrape(mdaemon.port)) | set(samples(r.stdout))
    h = ctl(mdaemon, "health")
    assert (h.returncode, h.stdout) == (0, "ok\n")
    for sub in ("metrics", "health"):
        r = ctl(mdaemon, sub, "--help")
        assert r.returncode == 0 and r.stdout.startswith("usage:")
        r = ctl(mdaemon, sub, "--bogus")
        assert r.returncode == 2 and "unknown option '--bogus'" in r.stderr


def test_unknown_path_and_method(mdaemon):
    assert get(mdaemon.port, "/nope")[0] == 404
    req = urllib.request.Request(f"http://127.0.0.1:{mdaemon.port}/metrics",
                                 data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405


def test_health_is_503_while_draining(tmp_path):
    d = Daemon(tmp_path, extra=CONF)
    port = http_port(d)
    assert get(port, "/health") == (200, "ok\n")
    ctx = open_rank(d.sock, "m-drain", "context", layers=LAYERS,
                    heads=HEADS)
    src = ctx.create_host_pool(layout())
    ctx.publish("held", src, [0], num_tokens=TPB)  # in flight: a grace
    r = ctl(d, "drain", "--deadline", "3", "--no-wait")
    assert r.returncode == 0, r.stderr
    status, body = get(port, "/health")  # published as the drain started
    assert (status, body) == (503, "draining\n")
    s = scrape(port)
    assert val(s, "kvxfer_draining") == 1
    # the socket takes no connection: the exec probe fails too
    assert ctl(d, "health").returncode == 1
    assert wait_event(ctx, "held").kind is EventKind.ERROR
    ctx.close()
    assert d.proc.wait(20) == 0


def test_health_is_503_while_the_loop_is_stuck(tmp_path):
    os.environ["KVXFERD_FAULT"] = "loop_stall:1"
    try:
        d = Daemon(tmp_path, extra=CONF)
    finally:
        del os.environ["KVXFERD_FAULT"]
    try:
        port = http_port(d)
        assert get(port, "/health") == (200, "ok\n")
        stuck = subprocess.Popen(
            [os.path.join(build_dir(), "kvxferctl"), "--socket", d.sock,
             "metrics"], stdout=subprocess.DEVNULL)
        end = time.monotonic() + 2.5  # the stall lasts 3 s
        while True:
            status, body = get(port, "/health")
            if status == 503:
                break
            assert time.monotonic() < end, "no 503 while the loop stalls"
            time.sleep(0.05)
        assert "the loop has published nothing for" in body
        assert stuck.wait(20) == 0
        # the lag is seen once the loop turns again (until its next
        # snapshot the old one is still stale), and passes
        status, body = get(port, "/health")
        assert status == 200 or (status == 503 and (
            "loop lag" in body or "has published nothing" in body)), body
        end = time.monotonic() + 10
        while get(port, "/health")[0] != 200:
            assert time.monotonic() < end, "still unhealthy"
            time.sleep(0.05)
        s = scrape(port)
        assert val(s, "kvxfer_loop_lag_seconds_bucket", le="+Inf") - \
            val(s, "kvxfer_loop_lag_seconds_bucket", le="2.5") >= 1
    finally:
        assert d.stop() == 0


def dashboard_metrics():
    with open(os.path.join(REPO, "config", "grafana", "kvxfer.json")) as f:
        dash = json.load(f)
    exprs = []

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("expr"), str):
                exprs.append(x["expr"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(dash)
    return dash, exprs


def test_dashboard_names_only_metrics_that_exist(mdaemon):
    dash, exprs = dashboard_metrics()
    assert dash["title"] and dash["panels"] and exprs
    status, text = get(mdaemon.port, "/metrics")
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    exist = set(types)
    for name, t in types.items():
        if t == "histogram":
            exist |= {name + "_bucket", name + "_sum", name + "_count"}
    named = {n for e in exprs for n in re.findall(r"\bkvxfer_[a-z_]+", e)}
    assert named and named <= exist, sorted(named - exist)
    # every family is on the dashboard
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in named}
    missing = {n for n in types
               if n not in shown and n not in ("kvxfer_build_info",)}
    assert not missing, sorted(missing)


def test_between_daemons_bytes_in_and_out_and_per_peer(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    peer = (f"peer:\n  listen: 127.0.0.1:0\n  secret_file: {secret}\n"
            "metrics:\n  listen: 127.0.0.1:0\n  publish_ms: 20\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Daemon(tmp_path / "a", extra=peer)
    b = Daemon(tmp_path / "b", extra=peer)
    try:
        pa, pb = http_port(a), http_port(b)
        lo = layout()
        ctx = open_rank(a.sock, "p-ctx", "context", layers=LAYERS,
                        heads=HEADS)
        gen = open_rank(b.sock, "p-gen", "generation", layers=LAYERS,
                        heads=HEADS)
        src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
        src.array[:] = 7
        dst.array[:] = 0
        a0, b0 = scrape(pa), scrape(pb)
        blocks = list(range(32))
        params = ctx.publish("r", src, blocks, num_tokens=32 * TPB)
        gen.fetch("r", params, dst, blocks)
        for c in (gen, ctx):
            assert wait_event(c, "r").kind is EventKind.COMPLETE
        for blk in blocks:
            assert np.array_equal(block_bytes(lo, dst.array, blk),
                                  block_bytes(lo, src.array, blk))
        moved = len(blocks) * block_size(lo)

        def delta(s0, s, **labels):
            return (val(s, "kvxfer_bytes_total", **labels)
                    - val(s0, "kvxfer_bytes_total", **labels))

        b1 = scrape_until(pb, lambda s: val(
            s, "kvxfer_transfers_total", path="peer") == 1)
        assert delta(b0, b1, direction="in", path="peer") == moved
        assert delta(b0, b1, direction="in", path="host") == 0
        a1 = scrape_until(pa, lambda s: delta(
            a0, s, direction="out", path="peer") >= moved)
        assert delta(a0, a1, direction="out", path="peer") == moved
        for s, conn in ((a1, "in"), (b1, "out")):  # b dialled a
            assert val(s, "kvxfer_peers_up") == 1
            sent = [v for (n, lab), v in s.items()
                    if n == "kvxfer_peer_bytes_total"
                    and dict(lab)["conn"] == conn]
            assert len(sent) == 2 and max(sent) >= moved
        for p in (pa, pb):
            lint(get(p, "/metrics")[1])
        gen.close()
        ctx.close()
    finally:
        assert b.stop() == 0 and a.stop() == 0


def test_layerwise_exposed_time_is_counted(mdaemon):
    d, port = mdaemon, mdaemon.port
    ctx = open_rank(d.sock, "m-lw-ctx", "context", layers=LAYERS,
                    heads=HEADS)
    gen = open_rank(d.sock, "m-lw-gen", "generation", layers=LAYERS,
                    heads=HEADS)
    lo = layout()
    src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
    before = scrape(port)
    params = ctx.publish("lw", src, [0, 1], num_tokens=2 * TPB,
                         layerwise=True)
    gen.fetch("lw", params, dst, [0, 1])
    for layer in range(LAYERS):  # the prefill's layers, one by one
        time.sleep(0.01)
        ctx.layers_ready("lw", layer)
    for c in (gen, ctx):
        assert wait_event(c, "lw").kind is EventKind.COMPLETE
    h = "kvxfer_layerwise_exposed_seconds"
    after = scrape_until(port, lambda s: val(s, h + "_count")
                         - val(before, h + "_count") == 1)
    # exposed: after the last layer, less than the whole transfer took
    exposed = val(after, h + "_sum") - val(before, h + "_sum")
    took = (val(after, "kvxfer_transfer_duration_seconds_sum")
            - val(before, "kvxfer_transfer_duration_seconds_sum"))
    assert 0 <= exposed < took
    gen.close()
    ctx.close()
