#!/usr/bin/env python3
"""The daemon's layers, checked: the graph of includes and calls between
its files has no cycle, and no file reaches a layer above its own.

    scripts/layers.py [-v]      (-v: print every file's edges)

A file's module is its name without extension (xfer_remote.h belongs to
xfer, gpu_desc.h and gpu_walk.h to gpu, and so do xfer's request files,
ALIAS), and a file <module>_<part> beside <module>.c or <module>.h
belongs to that module (conf_keys.c to conf). An edge a -> b is an
#include of b's header or a call of a
function b defines. main.c (the table of
contents, daemon/main.c) stands above the layers and may reach every one.
The includes tell the truth too: a header of another folder is named with
its folder ("net/peer.h", "common/list.h"), a header of the file's own
folder by its bare name, and common/ includes only common/ and the public
header. Exits 1 naming the offending edges and includes.
"""
import collections
import glob
import os
import re
import sys

ORDER = ["core", "net", "copy", "xfer", "agree", "remote", "local", "main"]
RANK = {"core": 0, "net": 1, "copy": 2, "xfer": 3, "agree": 4, "remote": 4,
        "local": 5, "main": 6}
PUBLIC = ("kvxfer.h", "kvxfer.pb-c.h")
# xfer's request files are one module (one state machine: a request's
# publish, fetch, schedule and end call each other), split for reading
ALIAS = {"xfer_remote": "xfer", "gpu_desc": "gpu", "gpu_walk": "gpu",
         "xfer_int": "xfer", "offer": "xfer", "fetch": "xfer",
         "sched": "xfer", "end": "xfer", "params": "xfer"}
# peer is one module in several files (daemon/net/peer_int.h)
ALIAS.update({"peer_" + s: "peer" for s in
              ("int", "auth", "addr", "handshake", "init", "status")})


def module(path):
    name = os.path.basename(path).rsplit(".", 1)[0]
    if name in ALIAS:
        return ALIAS[name]
    # a file <module>_<part> beside <module>.c or .h is a room of that
    # module (conf_keys.c, conf_int.h of conf)
    head, folder = name.split("_", 1)[0], os.path.dirname(path)
    if head != name and any(os.path.exists(os.path.join(folder, head + e))
                            for e in (".c", ".h")):
        return head
    return name


def strip(text):
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    os.chdir(root)
    sources = [f for f in glob.glob("daemon/*/*.c")
               if not f.endswith("gpu_none.c")]  # gpu.c's stand-in
    sources.append("daemon/main.c")
    headers = glob.glob("daemon/*/*.h")
    layer = {module(f): f.split("/")[1] if f.count("/") > 1 else "main"
             for f in sources + headers}
    bad = []
    for f in glob.glob("daemon/**/*.[ch]", recursive=True) + \
            glob.glob("common/*.[ch]"):
        folder = os.path.dirname(f)
        for inc in re.findall(r'#include "([^"]+)"', strip(open(f).read())):
            if inc in PUBLIC:
                continue
            here = os.path.exists(os.path.join(folder, inc))
            if f.startswith("common/"):
                ok = here and "/" not in inc
            elif "/" not in inc:
                ok = here
            else:
                top = inc.split("/")[0]
                ok = (os.path.exists(os.path.join("daemon", inc)) and
                      "daemon/" + top != folder) or \
                    (top == "common" and os.path.exists(inc))
            if not ok:
                bad.append(f"{f}: #include \"{inc}\": name a header of "
                           "another folder with its folder, one of its own "
                           "folder by its bare name")
    defs = {}
    for f in sources:
        for m in re.finditer(r"^(?!static)[a-zA-Z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{",
                             strip(open(f).read()), flags=re.M):
            if m.group(1) not in ("if", "while", "for", "switch"):
                defs.setdefault(m.group(1), module(f))
    edges, why = collections.defaultdict(set), collections.defaultdict(set)
    for f in sources + headers:
        a, text = module(f), strip(open(f).read())
        for inc in re.findall(r'#include "((?:\w+/)?\w+\.h)"', text):
            b = module(os.path.join("daemon", inc) if "/" in inc else
                       os.path.join(os.path.dirname(f), inc))
            if b in layer and b != a:
                edges[a].add(b)
                why[a, b].add("#include")
        if f.endswith(".c"):
            for name, b in defs.items():
                if b != a and re.search(r"\b" + name + r"\s*\(", text):
                    edges[a].add(b)
                    why[a, b].add(name + "()")
    for a in sorted(edges):
        for b in sorted(edges[a]):
            la, lb = layer[a], layer[b]
            up = a != "main" and (RANK[lb] > RANK[la] or
                                  (RANK[lb] == RANK[la] and la != lb))
            if up:
                bad.append(f"{a} ({la}) -> {b} ({lb}): "
                           + " ".join(sorted(why[a, b])))
    # cycles: Tarjan's strongly connected components
    index, low, stack, on, sccs = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))
    for v in list(edges):
        if v not in index:
            visit(v)
    if "-v" in sys.argv:
        for name in ORDER:
            for a in sorted(m for m, l in layer.items() if l == name):
                if edges.get(a):
                    print(f"{name:7} {a:9} -> {' '.join(sorted(edges[a]))}")
    for c in sccs:
        bad.append("cycle: " + " ".join(c))
    if bad:
        print("layers: FAIL\n  " + "\n  ".join(bad))
        return 1
    print(f"layers: ok ({len(layer)} modules, "
          f"{sum(len(v) for v in edges.values())} edges, no cycle, "
          "none upward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
