#!/usr/bin/env python3
"""Wide signatures, checked: no function in daemon/, common/, client/ or
tools/ takes 8 or more parameters (pass a request or args struct), and no
declaration takes an error message as a (char *why, size_t why_len) pair
(take a kvx_why_t *, common/why.h). The exceptions are the 2.x public
calls kept for one release (deprecated wrappers and their ABI forms)
and callbacks whose signature a library fixes, named below with the
reason.

    scripts/params.py [-v]      (-v: every function with 8 or more)

Exits 1 naming each function that is neither narrow nor excepted. The
parse is textual (prototypes and definitions at the start of a line).
"""
import glob
import re
import sys

WIDE = 8
# public 2.x calls whose signatures are an ABI until 4.0 (kvxfer.h 3.0
# gives each its args form: kvx_publish, kvx_fetch, kvx_ready,
# kvx_progress, kvx_reserve)
EXCEPT = {
    "kvx_fetch_by_key_groups", "kvx_publish_groups", "kvx_fetch_groups",
    "kvx_fetch_by_key", "kvx_publish_layerwise", "kvx_publish_key",
    "kvx_fetch_key", "kvx_reserve_groups", "kvx_fetch_dp",
    "kvx_group_tokens_ready", "kvx_tokens_ready", "kvx_group_fetch_progress",
    "kvx__fetch_2", "kvx__publish_2",
    "kvx_layout_preset",  # 2.0's layout call, no args form yet
    # libmicrohttpd's MHD_AccessHandlerCallback: its signature, not ours
    # (daemon/local/http.c)
    "on_request",
}


def strip(t):
    t = re.sub(r"/\*.*?\*/", "", t, flags=re.S)
    return re.sub(r"//[^\n]*", "", t)


def main():
    files = [f for d in ("daemon", "common", "client", "tools")
             for f in glob.glob(d + "/**/*.[ch]", recursive=True)]
    wide, pairs = {}, []
    sig = re.compile(r"^[a-zA-Z_][\w \*]*?\b(\w+)\s*\(([^;{()]*(?:\([^()]*\)"
                     r"[^;{()]*)*)\)\s*[{;]", re.M)
    for f in sorted(files):
        t = strip(open(f).read())
        for m in sig.finditer(t):
            name, args = m.group(1), m.group(2).strip()
            if name in ("if", "while", "for", "switch", "return", "sizeof"):
                continue
            n = 0 if args in ("", "void") else args.count(",") + 1
            if n >= WIDE and n > wide.get(name, (0,))[0]:
                wide[name] = (n, f)
        for m in re.finditer(r"char\s*\*\s*\w+\s*,\s*size_t\s+why_len", t):
            pairs.append(f"{f}: a (why, why_len) pair: take a kvx_why_t *")
    bad = [f"{f}: {name}() takes {n} parameters: pass a struct"
           for name, (n, f) in sorted(wide.items()) if name not in EXCEPT]
    if "-v" in sys.argv:
        for name, (n, f) in sorted(wide.items(), key=lambda x: -x[1][0]):
            print(f"{n:3} {name} {f}{'' if name not in EXCEPT else ' (2.x)'}")
    if bad or pairs:
        print("params: FAIL\n  " + "\n  ".join(bad + pairs))
        return 1
    print(f"params: ok ({len(wide)} functions of {WIDE} or more parameters, "
          "all 2.x calls kept for one release; no why pair)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
