#!/usr/bin/env python3
"""Render config/grafana/kvxfer.json's panels from a real scrape, without
Grafana (issue 40): a PNG that shows what the dashboard shows.

    scripts/render-dashboard.py [--build build] [--seconds 25]
        [--out docs/img/dashboard.png] [--save FILE]
    scripts/render-dashboard.py --url http://127.0.0.1:9464 [--socket S]
    scripts/render-dashboard.py --from FILE [--out PNG]

1. starts BUILD/kvxferd with metrics.listen 127.0.0.1:0 (or, with --url,
   scrapes a running one, loaded over --socket when given);
2. drives a demo load over its socket: kvxfer-bench runs on host pools
   (the default shape, one-block requests, layer-wise), a few requests
   that end cancelled, timed out or refused, and (not with --url) a
   second kvxferd's rank fetching from it over the peer link (kvxfer,
   the Python package);
3. GETs /metrics every second, as Prometheus would (adding the
   instance and job labels Prometheus adds);
4. evaluates every panel's PromQL over those samples at each scrape's
   time, with a small PromQL of its own (Evaluator): selectors with = =~
   != !~, rate, irate, increase, sum/min/max/avg/count [by|without],
   histogram_quantile, + - * / and numbers; $instance is the dashboard's
   allValue (.*), $__rate_interval is Grafana's for a 1 s scrape and step
   (4 s). An expression outside that is drawn as "not rendered: why";
5. draws the panels in the dashboard's grid with matplotlib.

--save writes the scrapes (JSON lines: t, target, text), --from renders
a saved file. Needs matplotlib and prometheus_client (a venv:
python3 -m venv build/venv-dash; build/venv-dash/bin/pip install
matplotlib prometheus_client). The evaluation alone (load_scrapes,
evaluate_panels) needs only prometheus_client: python/tests/
test_dashboard.py runs it on a saved scrape.
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional, Sequence, Tuple

from prometheus_client.parser import text_string_to_metric_families

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(REPO, "config", "grafana", "kvxfer.json")
STEP = 1.0  # seconds between scrapes and between evaluated points
# Grafana: max($__interval + scrape interval, 4 * scrape interval)
RATE_INTERVAL = max(STEP + STEP, 4 * STEP)
LOOKBACK = 300.0  # Prometheus's lookback for an instant selector
TITLE = ("kvxfer dashboard panels, rendered from a real scrape by "
         "scripts/render-dashboard.py, not by Grafana")

Labels = Tuple[Tuple[str, str], ...]  # sorted (name, value), with __name__
Series = List[Tuple[float, float]]     # (t, value), t ascending
Vector = Dict[Labels, float]
Matrix = Dict[Labels, Series]


class Unsupported(Exception):
    """An expression outside this PromQL subset (the panel is drawn as
    not rendered, with this message)."""


# ---------------------------------------------------------------- scrapes

def parse_scrape(text: str, target: str) -> Dict[Labels, float]:
    """{labels: value} of one /metrics text, with the instance and job
    labels Prometheus adds to a target's samples."""
    out: Dict[Labels, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lab = dict(s.labels)
            lab.update(__name__=s.name, instance=target, job="kvxfer")
            out[tuple(sorted(lab.items()))] = float(s.value)
    return out


def load_scrapes(path: str) -> List[Tuple[float, Dict[Labels, float]]]:
    """The scrapes of a --save file: [(t, {labels: value})], t from 0."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append((float(r["t"]),
                             parse_scrape(r["text"], r["target"])))
    if not rows:
        raise ValueError(f"{path}: no scrapes")
    t0 = rows[0][0]
    return [(t - t0, s) for t, s in rows]


class Store:
    """The samples of every scrape, by series, as Prometheus's TSDB
    holds them."""

    def __init__(self, scrapes: Sequence[Tuple[float, Dict[Labels, float]]]):
        self.series: Dict[Labels, Series] = {}
        for t, s in scrapes:
            for lab, v in s.items():
                self.series.setdefault(lab, []).append((t, v))
        self.times = [t for t, _ in scrapes]


# ----------------------------------------------------------------- parser

TOKEN = re.compile(r"""\s*(?:
    (?P<num>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)
  | (?P<dur>\[[^\]]*\])
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<op>=~|!~|!=|[-+*/(){},=])
  | (?P<id>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<bad>\S))""", re.X)
AGGREGATIONS = ("sum", "min", "max", "avg", "count")
RANGE_FUNCS = ("rate", "irate", "increase")


def tokenize(expr: str) -> List[Tuple[str, str]]:
    out = []
    for m in TOKEN.finditer(expr):
        kind = m.lastgroup
        if kind == "bad":
            raise Unsupported(f"unexpected {m.group(kind)!r}")
        out.append((kind, m.group(kind)))
    return out


def duration(text: str) -> float:
    """Seconds of a [range]: [4s], [5m], or [$__rate_interval]."""
    body = text[1:-1].strip()
    if body == "$__rate_interval":
        return RATE_INTERVAL
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", body)
    if not m:
        raise Unsupported(f"range {text}")
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60,
                              "h": 3600}[m.group(2)]


class Parser:
    """Recursive descent over the subset; nodes are tuples."""

    def __init__(self, expr: str):
        self.toks = tokenize(expr)
        self.i = 0

    def peek(self) -> Tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("", "")

    def take(self, value: Optional[str] = None) -> Tuple[str, str]:
        tok = self.peek()
        if not tok[0] or (value is not None and tok[1] != value):
            raise Unsupported(f"expected {value or 'more'}, got "
                              f"{tok[1] or 'the end'!r}")
        self.i += 1
        return tok

    def parse(self) -> tuple:
        node = self.expr()
        if self.peek()[0]:
            raise Unsupported(f"unexpected {self.peek()[1]!r}")
        return node

    def expr(self) -> tuple:
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            node = ("bin", op, node, self.term())
        return node

    def term(self) -> tuple:
        node = self.unary()
        while self.peek()[1] in ("*", "/"):
            op = self.take()[1]
            node = ("bin", op, node, self.unary())
        return node

    def unary(self) -> tuple:
        if self.peek()[1] == "-":
            self.take()
            return ("bin", "*", ("num", -1.0), self.unary())
        return self.primary()

    def labels(self) -> List[str]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take()[1])
            if self.peek()[1] == ",":
                self.take()
        self.take(")")
        return names

    def primary(self) -> tuple:
        kind, val = self.peek()
        if kind == "num":
            self.take()
            return ("num", float(val))
        if val == "(":
            self.take()
            node = self.expr()
            self.take(")")
            return node
        if kind != "id":
            raise Unsupported(f"unexpected {val or 'end'!r}")
        self.take()
        if val in AGGREGATIONS:
            grouping = None
            if self.peek()[1] in ("by", "without"):
                grouping = (self.take()[1], self.labels())
            self.take("(")
            arg = self.expr()
            self.take(")")
            if self.peek()[1] in ("by", "without"):
                grouping = (self.take()[1], self.labels())
            return ("agg", val, grouping, arg)
        if val in RANGE_FUNCS:
            self.take("(")
            arg = self.primary()
            self.take(")")
            if arg[0] != "range":
                raise Unsupported(f"{val}() of something not a range")
            return ("rangefn", val, arg)
        if val == "histogram_quantile":
            self.take("(")
            q = self.expr()
            self.take(",")
            arg = self.expr()
            self.take(")")
            return ("hq", q, arg)
        if self.peek()[1] == "(":
            raise Unsupported(f"function {val}()")
        matchers = [("__name__", "=", val)]
        if self.peek()[1] == "{":
            self.take()
            while self.peek()[1] != "}":
                name = self.take()[1]
                op = self.take()[1]
                if op not in ("=", "!=", "=~", "!~"):
                    raise Unsupported(f"matcher {op}")
                kind2, lit = self.take()
                if kind2 != "str":
                    raise Unsupported(f"matcher value {lit}")
                matchers.append((name, op, json.loads(lit)))
                if self.peek()[1] == ",":
                    self.take()
            self.take("}")
        node = ("sel", tuple(matchers))
        if self.peek()[0] == "dur":
            node = ("range", node, duration(self.take()[1]))
        return node


def substitute(expr: str) -> str:
    """The dashboard's variables: $instance is its allValue."""
    expr = expr.replace("$instance", ".*")
    left = re.findall(r"\$\{?\w+", expr.replace("$__rate_interval", ""))
    if left:
        raise Unsupported(f"variable {left[0]}")
    return expr


# -------------------------------------------------------------- evaluator

def extrapolated_rate(pts: Series, lo: float, hi: float,
                      kind: str) -> Optional[float]:
    """Prometheus's rate/increase over the points in (lo, hi]: counter
    resets added back, extrapolated to the window's ends (up to half an
    interval past the first and last points)."""
    if len(pts) < 2:
        return None
    inc, prev = 0.0, pts[0][1]
    for _, v in pts[1:]:
        inc += v - prev if v >= prev else v
        prev = v
    first_t, last_t = pts[0][0], pts[-1][0]
    sampled = last_t - first_t
    avg = sampled / (len(pts) - 1)
    to_start, to_end = first_t - lo, hi - last_t
    if inc > 0 and pts[0][1] >= 0:
        to_zero = sampled * (pts[0][1] / inc)
        to_start = min(to_start, to_zero)
    threshold = avg * 1.1
    ext = sampled
    ext += to_start if to_start < threshold else avg / 2
    ext += to_end if to_end < threshold else avg / 2
    inc *= ext / sampled
    return inc / (hi - lo) if kind == "rate" else inc


def bucket_quantile(q: float, buckets: List[Tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over (le, cumulative count)."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = sorted(buckets)
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return math.nan
    for i in range(1, len(buckets)):  # monotonic, as Prometheus forces
        if buckets[i][1] < buckets[i - 1][1]:
            buckets[i] = (buckets[i][0], buckets[i - 1][1])
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, c) in enumerate(buckets) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, count = 0.0, buckets[b][1]
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    end = buckets[b][0]
    return start + (end - start) * (rank / count) if count else start


def drop_name(lab: Labels) -> Labels:
    return tuple(kv for kv in lab if kv[0] != "__name__")


class Evaluator:
    """Instant queries over a Store, at any time t."""

    def __init__(self, store: Store):
        self.store = store

    def select(self, matchers: tuple) -> List[Labels]:
        out = []
        for lab in self.store.series:
            d = dict(lab)
            ok = True
            for name, op, val in matchers:
                have = d.get(name, "")
                if op == "=":
                    ok = have == val
                elif op == "!=":
                    ok = have != val
                elif op == "=~":
                    ok = re.fullmatch(val, have) is not None
                else:
                    ok = re.fullmatch(val, have) is None
                if not ok:
                    break
            if ok:
                out.append(lab)
        return out

    def eval(self, node: tuple, t: float) -> Any:
        kind = node[0]
        if kind == "num":
            return node[1]
        if kind == "sel":
            out: Vector = {}
            for lab in self.select(node[1]):
                pts = [p for p in self.store.series[lab]
                       if t - LOOKBACK < p[0] <= t]
                if pts:
                    out[lab] = pts[-1][1]
            return out
        if kind == "range":
            m: Matrix = {}
            lo = t - node[2]
            for lab in self.select(node[1][1]):
                pts = [p for p in self.store.series[lab] if lo < p[0] <= t]
                if pts:
                    m[lab] = pts
            return m
        if kind == "rangefn":
            fn, (_, _, rng) = node[1], node[2]
            out = {}
            for lab, pts in self.eval(node[2], t).items():
                if fn == "irate":
                    if len(pts) < 2:
                        continue
                    (t1, v1), (t2, v2) = pts[-2], pts[-1]
                    v = (v2 - v1 if v2 >= v1 else v2) / (t2 - t1)
                else:
                    v = extrapolated_rate(pts, t - rng, t, fn)
                if v is not None:
                    out[drop_name(lab)] = v
            return out
        if kind == "agg":
            return self.aggregate(node, t)
        if kind == "hq":
            q = self.eval(node[1], t)
            if not isinstance(q, float):
                raise Unsupported("histogram_quantile's q is not a number")
            groups: Dict[Labels, List[Tuple[float, float]]] = {}
            for lab, v in self.eval(node[2], t).items():
                d = dict(drop_name(lab))
                if "le" not in d:
                    continue
                le = float(d.pop("le"))
                groups.setdefault(tuple(sorted(d.items())), []).append(
                    (le, v))
            return {lab: bucket_quantile(q, b) for lab, b in groups.items()}
        if kind == "bin":
            return self.binary(node[1], self.eval(node[2], t),
                               self.eval(node[3], t))
        raise Unsupported(kind)

    def aggregate(self, node: tuple, t: float) -> Vector:
        _, op, grouping, arg = node
        vec = self.eval(arg, t)
        if not isinstance(vec, dict):
            raise Unsupported(f"{op}() of a number")
        groups: Dict[Labels, List[float]] = {}
        for lab, v in vec.items():
            d = dict(drop_name(lab))
            if grouping is None:
                key: Labels = ()
            elif grouping[0] == "by":
                key = tuple(sorted((k, d[k]) for k in grouping[1]
                                   if k in d))
            else:
                key = tuple(sorted((k, x) for k, x in d.items()
                                   if k not in grouping[1]))
            groups.setdefault(key, []).append(v)
        fns = {"sum": sum, "min": min, "max": max, "count": len,
               "avg": lambda xs: sum(xs) / len(xs)}
        return {k: float(fns[op](vs)) for k, vs in groups.items()}

    @staticmethod
    def binary(op: str, a: Any, b: Any) -> Any:
        def f(x: float, y: float) -> float:
            if op == "+":
                return x + y
            if op == "-":
                return x - y
            if op == "*":
                return x * y
            if y == 0:
                return math.nan if x == 0 else math.copysign(math.inf, x)
            return x / y
        if not isinstance(a, dict) and not isinstance(b, dict):
            return f(a, b)
        if not isinstance(a, dict):
            return {drop_name(k): f(a, v) for k, v in b.items()}
        if not isinstance(b, dict):
            return {drop_name(k): f(v, b) for k, v in a.items()}
        right = {drop_name(k): v for k, v in b.items()}
        return {drop_name(k): f(v, right[drop_name(k)])
                for k, v in a.items() if drop_name(k) in right}


def legend(fmt: str, lab: Labels) -> str:
    d = dict(lab)
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in lab) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""),
                  fmt).strip()


def evaluate_panels(dash: dict, store: Store) -> List[dict]:
    """Every panel of the dashboard, evaluated at every scrape's time:
    [{panel, series: [(legend, [values])], error}], error None or why
    the panel is not rendered."""
    ev = Evaluator(store)
    out = []
    for p in dash["panels"]:
        res: Dict[str, Any] = {"panel": p, "series": [], "error": None}
        out.append(res)
        if p.get("type") == "row":
            continue
        if p.get("type") not in ("timeseries", "stat", "table"):
            res["error"] = f"panel type {p.get('type')}"
            continue
        try:
            for tgt in p.get("targets", []):
                if tgt.get("hide"):
                    continue
                node = Parser(substitute(tgt["expr"])).parse()
                by: Dict[Labels, List[float]] = {}
                for i, t in enumerate(store.times):
                    v = ev.eval(node, t)
                    if not isinstance(v, dict):
                        v = {(): v}
                    for lab, x in v.items():
                        by.setdefault(lab, [math.nan] * len(store.times))[
                            i] = x
                for lab in sorted(by):
                    res["series"].append(
                        (legend(tgt.get("legendFormat", ""), lab), by[lab],
                         lab))
        except (Unsupported, re.error) as e:
            res["error"] = str(e)
            res["series"] = []
    return out


# ----------------------------------------------------------------- drawing

def fmt_value(v: float, unit: str) -> str:
    """A value in the panel's unit, as Grafana would write it."""
    if v is None or math.isnan(v):
        return "No data"
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit in ("bytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for n, name in ((2 ** 40, "TiB"), (2 ** 30, "GiB"),
                        (2 ** 20, "MiB"), (2 ** 10, "KiB")):
            if abs(v) >= n:
                return f"{v / n:.3g} {name}{suffix}"
        return f"{v:.3g} B{suffix}"
    if unit == "s":
        if v == 0:
            return "0 s"
        if abs(v) >= 60:
            return f"{v / 60:.3g} min"
        if abs(v) >= 1:
            return f"{v:.3g} s"
        if abs(v) >= 1e-3:
            return f"{v * 1e3:.3g} ms"
        return f"{v * 1e6:.3g} µs"
    suffix = " ops/s" if unit == "ops" else ""
    for n, name in ((1e9, " B"), (1e6, " M"), (1e3, " K")):
        if abs(v) >= n:
            return f"{v / n:.3g}{name}{suffix}"
    return f"{v:.3g}{suffix}"


def draw(results: List[dict], times: List[float], out: str,
         note: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    matplotlib.rcParams["text.parse_math"] = False  # "$instance"
    from matplotlib.ticker import FuncFormatter

    rows = max(r["panel"]["gridPos"]["y"] + r["panel"]["gridPos"]["h"]
               for r in results)
    unit_h = 0.30  # inches per grid row
    top, bottom = 0.9, 0.25  # inches for the title and the note
    W, H = 20.0, rows * unit_h + top + bottom
    fig = plt.figure(figsize=(W, H), dpi=80)
    fig.text(0.5, 1 - 0.35 / H, TITLE, ha="center", va="center",
             fontsize=15, weight="bold")
    fig.text(0.5, 1 - 0.7 / H, note, ha="center", va="center",
             fontsize=10, color="#444")
    for r in results:
        p, g = r["panel"], r["panel"]["gridPos"]
        x0, w = g["x"] / 24, g["w"] / 24
        y0 = 1 - (top + (g["y"] + g["h"]) * unit_h) / H
        h = g["h"] * unit_h / H
        if p["type"] == "row":
            fig.text(x0 + 0.005, y0 + h / 2, p["title"], fontsize=13,
                     weight="bold", va="center")
            continue
        # the panel's box, then its plot inside with room for labels
        pad_x, pad_top, pad_bot = 0.75 / W, 0.45, 0.3
        box = fig.add_axes([x0 + 0.003, y0 + 0.05 / H, w - 0.006,
                            h - 0.35 / H])  # its title above, in the cell
        box.set_xticks([])
        box.set_yticks([])
        box.set_facecolor("#f7f7f9")
        box.set_title(p["title"], fontsize=10, loc="left")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        if r["error"]:
            box.text(0.5, 0.5, "not rendered: " + r["error"], ha="center",
                     va="center", fontsize=9, color="#a00", wrap=True)
            continue
        if p["type"] == "stat":
            s = r["series"]
            last = [next((v for v in reversed(vals) if not math.isnan(v)),
                         math.nan) for _, vals, _ in s] or [math.nan]
            box.text(0.5, 0.55, fmt_value(last[0], unit), ha="center",
                     va="center", fontsize=24, weight="bold",
                     color="#1f6f3f")
            if s:
                box.text(0.5, 0.15, s[0][0], ha="center", fontsize=8,
                         color="#555")
            continue
        if p["type"] == "table":
            lines = []
            for _, vals, lab in r["series"]:
                d = {k: v for k, v in lab if k != "__name__"}
                lines.append("  ".join(f"{k}={v}" for k, v in
                                       sorted(d.items())))
            box.text(0.03, 0.75, "\n".join(lines) or "No data", va="top",
                     fontsize=9, family="monospace")
            continue
        small = g["h"] <= 5  # no room for a legend below
        if small:
            pad_bot = 0.0
        ax = fig.add_axes([x0 + pad_x, y0 + (pad_bot + 0.45) / H,
                           w - pad_x - 0.01,
                           h - (pad_top + pad_bot + 0.6) / H])
        ax.tick_params(labelsize=7)
        ax.yaxis.set_major_formatter(
            FuncFormatter(lambda v, _, u=unit: fmt_value(v, u)))
        ax.grid(alpha=0.3)
        names = []
        for name, vals, _ in r["series"]:
            ax.plot(times, vals, linewidth=1.2)
            names.append(name)
        if not names:
            ax.text(0.5, 0.5, "No data", ha="center", va="center",
                    transform=ax.transAxes, color="#777")
        ax.set_xlim(times[0], times[-1])
        ax.set_xlabel("s into the run", fontsize=7, labelpad=1)
        if names and small:
            ax.legend(names, fontsize=7, loc="upper left")
        elif names:
            ax.legend(names, fontsize=7, loc="upper center", ncol=4,
                      bbox_to_anchor=(0.5, -0.22), frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


# ------------------------------------------------------------- the demo

class Scraper(threading.Thread):
    """GET url every STEP seconds into rows [(t, target, text)]."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.rows, self.stop = url, [], threading.Event()
        self.target = re.sub(r"^\w+://", "", url).split("/")[0]

    def run(self) -> None:
        nxt = time.monotonic()
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url + "/metrics",
                                            timeout=2) as r:
                    self.rows.append((time.time(), self.target,
                                      r.read().decode()))
            except OSError as e:
                print(f"render-dashboard: scrape failed: {e}",
                      file=sys.stderr)
            nxt += STEP
            self.stop.wait(max(0.0, nxt - time.monotonic()))


def bench(build: str, sock: str, *args: str) -> None:
    cmd = [os.path.join(build, "kvxfer-bench"), "--socket", sock,
           "--json", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    print(f"render-dashboard: kvxfer-bench {' '.join(args)}: "
          f"exit {r.returncode}", file=sys.stderr)


def kvxfer_package(build: str) -> Any:
    """The kvxfer package of this tree, over BUILD's libkvxfer."""
    os.environ.setdefault("KVXFER_LIB",
                          os.path.join(os.path.abspath(build),
                                       "libkvxfer.so.2"))
    if os.path.join(REPO, "python") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "python"))
    import kvxfer
    return kvxfer


def demo_layout(kvxfer: Any, blocks: int) -> Any:
    return kvxfer.Layout.preset("vllm-nhd", num_layers=4, num_heads=2,
                                head_dim=64, dtype="bf16",
                                tokens_per_block=16, num_blocks=blocks)


def failures(build: str, sock: str) -> None:
    """A few requests that do not complete: an offer cancelled, an offer
    whose lease expires unfetched, a fetch the daemon refuses."""
    kvxfer = kvxfer_package(build)
    par = kvxfer.Parallel(total_layers=4, total_kv_heads=2)
    lo = demo_layout(kvxfer, 64)
    with kvxfer.Client(sock, instance_id="demo-ctx", role="context",
                       parallel=par) as ctx, \
            kvxfer.Client(sock, instance_id="demo-gen", role="generation",
                          parallel=par) as gen:
        for c in (ctx, gen):
            c.join([c.daemon_address])
        src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
        for i in range(3):
            ctx.publish(f"cancel-{i}", src, [i], num_tokens=16)
            ctx.cancel(f"cancel-{i}")
            ctx.publish(f"expire-{i}", src, [i], num_tokens=16,
                        lease_ms=200)
            params = ctx.publish(f"bad-{i}", src, [i], num_tokens=16)
            try:  # a pool too small for block 1000
                gen.fetch(f"bad-{i}", params, dst, [1000])
            except kvxfer.Error:
                pass
            ctx.cancel(f"bad-{i}")
            time.sleep(0.5)
        time.sleep(1.0)
        ctx.poll(256, 0)


def between_daemons(build: str, sock: str, peer_sock: str) -> None:
    """Offers on the scraped daemon fetched by a rank of another daemon
    (peer_sock): its bytes out, per-peer bytes and peers up. 256 blocks
    of 16 KiB a request, a request at a time, for about 3 s."""
    kvxfer = kvxfer_package(build)
    par = kvxfer.Parallel(total_layers=4, total_kv_heads=2)
    lo = demo_layout(kvxfer, 256)
    with kvxfer.Client(sock, instance_id="demo-peer-ctx", role="context",
                       parallel=par) as ctx, \
            kvxfer.Client(peer_sock, instance_id="demo-peer-gen",
                          role="generation", parallel=par) as gen:
        for c in (ctx, gen):
            c.join([c.daemon_address])
        src, dst = ctx.create_host_pool(lo), gen.create_host_pool(lo)
        blocks = list(range(256))
        end, i = time.monotonic() + 3, 0
        while time.monotonic() < end:
            key = f"peer-{i}"
            gen.fetch(key, ctx.publish(key, src, blocks,
                                       num_tokens=256 * 16), dst, blocks)
            done = time.monotonic() + 20
            while time.monotonic() < done and not any(
                    e.key == key.encode() for e in gen.poll(1, 0.2)):
                pass
            ctx.poll(256, 0)
            i += 1


def demo(build: str, sock: str, peer_sock: Optional[str]) -> None:
    """The load: phases a second apart (about 45 s here, on 2 CPUs)."""
    time.sleep(1)
    bench(build, sock, "--requests", "32", "--blocks", "256")
    time.sleep(1)
    try:
        failures(build, sock)
    except Exception as e:  # the picture is still worth drawing
        print(f"render-dashboard: the failing requests: {e}",
              file=sys.stderr)
    bench(build, sock, "--requests", "20000", "--blocks", "1", "--layers",
          "1", "--heads", "1", "--head-dim", "64", "--window", "64")
    time.sleep(1)
    bench(build, sock, "--layerwise", "5", "--requests", "16")
    time.sleep(1)
    if peer_sock:
        try:
            between_daemons(build, sock, peer_sock)
        except Exception as e:
            print(f"render-dashboard: between daemons: {e}",
                  file=sys.stderr)
        time.sleep(1)
    bench(build, sock, "--requests", "16", "--blocks", "512", "--window",
          "4")
    time.sleep(3)


def start_daemon(build: str, tmp: str,
                 name: str) -> Tuple[subprocess.Popen, str, str]:
    """kvxferd NAME in tmp, metrics on and a peer listener (the secret
    tmp/secret): (process, socket, metrics URL)."""
    sock = os.path.join(tmp, name + ".sock")
    cfg = os.path.join(tmp, name + ".yaml")
    log = os.path.join(tmp, name + ".log")
    secret = os.path.join(tmp, "secret")
    if not os.path.exists(secret):
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
    with open(cfg, "w") as f:
        f.write(f"socket:\n  path: {sock}\nmetrics:\n"
                "  listen: 127.0.0.1:0\n  publish_ms: 1000\n"
                f"peer:\n  listen: 127.0.0.1:0\n  secret_file: {secret}\n")
    with open(log, "wb") as lf:
        proc = subprocess.Popen([os.path.join(build, "kvxferd"),
                                 "--config", cfg], stdout=lf,
                                stderr=subprocess.STDOUT)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        with open(log, errors="replace") as f:
            m = re.search(r"metrics: serving .* \(port (\d+)\)", f.read())
        if m and os.path.exists(sock):
            return proc, sock, f"http://127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    with open(log, errors="replace") as f:
        sys.exit("render-dashboard: kvxferd did not start:\n" + f.read())


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"),
                    help="kvxferd and kvxfer-bench's folder")
    ap.add_argument("--url", help="a running kvxferd's endpoint")
    ap.add_argument("--socket", help="with --url: load it over this")
    ap.add_argument("--from", dest="src", help="render a --save file")
    ap.add_argument("--save", help="write the scrapes here")
    ap.add_argument("--dashboard", default=DASHBOARD,
                    help="the dashboard JSON (default: the shipped one)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "img",
                                                  "dashboard.png"),
                    help="the PNG (default: docs/img/dashboard.png)")
    a = ap.parse_args()
    with open(a.dashboard) as f:
        dash = json.load(f)
    save = a.save
    tmp = tempfile.mkdtemp(prefix="render-dashboard.")
    try:
        if not a.src:
            procs: List[subprocess.Popen] = []
            peer_sock = None
            if a.url:
                url, sock = a.url.rstrip("/"), a.socket
            else:
                proc, sock, url = start_daemon(a.build, tmp, "kvxferd")
                procs.append(proc)
                proc, peer_sock, _ = start_daemon(a.build, tmp, "peer")
                procs.append(proc)
            sc = Scraper(url)
            sc.start()
            try:
                if sock:
                    demo(a.build, sock, peer_sock)
                else:
                    time.sleep(25)
            finally:
                sc.stop.set()
                sc.join()
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(10)
            save = save or os.path.join(tmp, "scrapes.jsonl")
            with open(save, "w") as f:
                for t, target, text in sc.rows:
                    f.write(json.dumps({"t": t, "target": target,
                                        "text": text}) + "\n")
        scrapes = load_scrapes(a.src or save)
        store = Store(scrapes)
        results = evaluate_panels(dash, store)
        bad = [(r["panel"]["title"], r["error"]) for r in results
               if r["error"]]
        for title, why in bad:
            print(f"render-dashboard: {title}: not rendered: {why}",
                  file=sys.stderr)
        note = (f"{len(store.times)} scrapes of /metrics, 1 s apart; "
                f"rate windows {RATE_INTERVAL:g} s ($__rate_interval); "
                f"$instance = all")
        draw(results, store.times, a.out, note)
        print(f"render-dashboard: {a.out}: {len(results)} panels, "
              f"{len(bad)} not rendered")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
