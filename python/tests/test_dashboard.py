"""scripts/render-dashboard.py (issue 40): its PromQL subset evaluates
every panel of config/grafana/kvxfer.json (none drawn as "not
rendered") over a saved scrape of a demo run (data/dashboard-scrape.jsonl,
ten scrapes 1 s apart, taken by the script's --save), with Prometheus's
arithmetic for rate and histogram_quantile. No daemon, no matplotlib."""

import importlib.util
import json
import math
import os

import pytest

from conftest import REPO

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                       "dashboard-scrape.jsonl")


@pytest.fixture(scope="module")
def rd():
    path = os.path.join(REPO, "scripts", "render-dashboard.py")
    spec = importlib.util.spec_from_file_location("render_dashboard", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def panels(rd):
    with open(rd.DASHBOARD) as f:
        dash = json.load(f)
    store = rd.Store(rd.load_scrapes(FIXTURE))
    return {r["panel"]["title"]: r for r in rd.evaluate_panels(dash, store)
            if r["panel"]["type"] != "row"}


def peak(res, name):
    vals = [v for n, vs, _ in res["series"] if n == name for v in vs
            if not math.isnan(v)]
    assert vals, f"{name} not in {[n for n, _, _ in res['series']]}"
    return max(vals)


def test_every_panel_evaluates(panels):
    bad = {t: r["error"] for t, r in panels.items() if r["error"]}
    assert not bad, bad
    # every target of every panel gave series, except per-peer bytes
    # (no peer daemon in this demo: no such series at all)
    for title, r in panels.items():
        if title != "Bytes per peer (rate)":
            assert r["series"], title


def test_the_scrape_shows_the_demo(panels):
    # the one-block phase: 20000 host fetches in about 2 s
    assert peak(panels["Bytes in by path (rate)"], "host") > 0
    assert peak(panels["Transfers completed by path (rate)"],
                "host") > 1000
    ended = panels["Requests ended by side and outcome (rate)"]
    assert peak(ended, "offer cancelled") > 0
    assert peak(panels["Request errors by code (rate)"],
                "reply INVALID") > 0
    p99 = peak(panels["Transfer duration (p50, p99)"], "p99")
    assert 0 < p99 < 30


def test_unsupported_is_named_not_guessed(rd):
    store = rd.Store(rd.load_scrapes(FIXTURE))
    dash = {"panels": [
        {"type": "timeseries", "title": "x", "gridPos": {},
         "targets": [{"expr": "predict_linear(kvxfer_pools[5m], 60)"}]},
        {"type": "timeseries", "title": "y", "gridPos": {},
         "targets": [{"expr": "kvxfer_pools{node=\"$node\"}"}]}]}
    r = rd.evaluate_panels(dash, store)
    assert r[0]["error"] == "function predict_linear()"
    assert r[1]["error"] == "variable $node"


def test_rate_and_quantile_match_prometheus(rd):
    # a counter scraped every second, +10 a scrape, reset once to 5
    pts = [(1.0, 0.0), (2.0, 10.0), (3.0, 20.0), (4.0, 5.0)]
    # increase 10 + 10 + 5 over 3 s sampled; the window (0, 4] starts
    # 1 s before the first point (< 1.1 intervals), but the counter
    # reaches 0 there: extrapolated to 0 s back, so 25 over 4 s
    assert rd.extrapolated_rate(pts, 0.0, 4.0, "rate") == 25 / 4
    assert rd.extrapolated_rate(pts, 0.0, 4.0, "increase") == 25
    assert rd.extrapolated_rate(pts[:1], 0.0, 4.0, "rate") is None
    # 100 observations: 50 <= 0.1, 90 <= 0.5, 100 <= 1
    b = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (math.inf, 100.0)]
    assert rd.bucket_quantile(0.5, b) == pytest.approx(0.1)
    assert rd.bucket_quantile(0.7, b) == pytest.approx(0.3)
    assert rd.bucket_quantile(0.99, b) == pytest.approx(0.95)
    # in the +Inf bucket: the highest finite bound
    assert rd.bucket_quantile(0.99, [(1.0, 1.0), (math.inf, 2.0)]) == 1.0
    assert math.isnan(rd.bucket_quantile(0.5, [(1.0, 0.0),
                                               (math.inf, 0.0)]))
