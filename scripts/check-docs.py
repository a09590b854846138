#!/usr/bin/env python3
"""Check that the docs match the code: versions, links, sections, files.

Run from the repository root (make check-docs); exits 1 naming every
problem as FILE:LINE: what, or 0 printing what it checked.

- Versions: a doc that states the current version states the one the code
  has: the release (KVX_VERSION_STRING in client/include/kvxfer.h: as
  `kvxferd X.Y.Z`, `kvxferctl X.Y.Z`, `libkvxfer X.Y.Z`,
  `libkvxfer.so.X.Y.Z`), the protocol (`KVX_PROTOCOL_MAJOR.MINOR`, as
  `X.Y.Z (protocol P.Q`), the soname (`KVX_ABI_MAJOR`, as
  `libkvxfer.so.N` and the Debian package `libkvxferN`), the Python
  package (python/kvxfer/_version.py, as `kvxfer-X.Y.Z` in a wheel or
  sdist name) and the man pages' `.TH ... "kvxfer X.Y"`. A version named
  as history ("kvxfer 2.1", "(2.4)", "before 2.6") is not a statement of
  the current one and is left alone.
- Links: every Markdown link to a file names one in the repository, and
  its #anchor a heading of that file (GitHub's slugs); every reference
  written `docs/x.md, "Section"` names a heading of that file.
- Files: every repository path a doc names in backticks exists; no doc
  names a file outside the repository (DESIGN.md, STYLE.md, /work/...).
- docs/benchmarks.md is one table of the current figures, every row with
  its command, machine and date.
"""

import os
import re
import sys
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if len(sys.argv) == 3 and sys.argv[1] == "--root":
    ROOT = os.path.abspath(sys.argv[2])  # a copy of the tree (the tests)

# The docs checked: Markdown, man pages, the examples' comments.
DOC_GLOBS = ("README.md", "docs", "python/README.md", "man", "examples")

# Paths written in backticks that name repository files when they start
# with one of these directories (or are a top-level file).
REPO_DIRS = ("client/", "common/", "config/", "daemon/", "debian/",
             "docs/", "examples/", "man/", "proto/", "python/",
             "scripts/", "systemd/", "tests/", "tools/", ".ci/")

# Files the docs must not cite: they are not in the repository.
OUTSIDE = re.compile(r"\b(DESIGN\.md|STYLE\.md)\b|/work/(shared|notes|main)")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def header_define(text: str, name: str) -> str:
    m = re.search(r"^#define %s (\S+)" % name, text, re.M)
    if not m:
        sys.exit("check-docs: %s not found in kvxfer.h" % name)
    return m.group(1).strip('"')


def current() -> Dict[str, str]:
    """The versions the code has now."""
    h = read("client/include/kvxfer.h")
    py = re.search(r'__version__ = "([^"]+)"',
                   read("python/kvxfer/_version.py"))
    if not py:
        sys.exit("check-docs: no __version__ in python/kvxfer/_version.py")
    release = header_define(h, "KVX_VERSION_STRING")
    return {
        "release": release,
        "series": ".".join(release.split(".")[:2]),
        "protocol": "%s.%s" % (header_define(h, "KVX_PROTOCOL_MAJOR"),
                               header_define(h, "KVX_PROTOCOL_MINOR")),
        "abi": header_define(h, "KVX_ABI_MAJOR"),
        "python": py.group(1),
    }


def doc_files() -> List[str]:
    out = []
    for g in DOC_GLOBS:
        p = os.path.join(ROOT, g)
        if os.path.isfile(p):
            out.append(g)
            continue
        for d, _, names in os.walk(p):
            for n in sorted(names):
                rel = os.path.relpath(os.path.join(d, n), ROOT)
                if rel.startswith("docs/history/"):
                    continue  # dated records: they keep their versions
                if n.endswith((".md", ".1", ".5", ".8", ".c", ".py",
                               ".sh")):
                    out.append(rel)
    return sorted(out)


# (pattern, which version its group 1 must equal, what it is)
VERSION_RULES: List[Tuple[re.Pattern, str, str]] = [
    (re.compile(r"\b(?:kvxferd|kvxferctl|libkvxfer) (\d+\.\d+\.\d+)\b"),
     "release", "the release"),
    (re.compile(r"\blibkvxfer\.so\.(\d+\.\d+\.\d+)\b"),
     "release", "the library's real file"),
    (re.compile(r"\blibkvxfer\.so\.(\d+)\b(?!\.\d)"), "abi", "the soname"),
    (re.compile(r"\blibkvxfer(\d+)\b"), "abi", "the Debian package"),
    (re.compile(r"\b\d+\.\d+\.\d+ \(protocol (\d+\.\d+)\b"),
     "protocol", "the protocol"),
    (re.compile(r"\bkvxfer-(\d+\.\d+\.\d+)\b"), "python",
     "the Python package"),
    (re.compile(r'^\.TH .*"kvxfer (\d+\.\d+)"'), "series",
     "the man page's release"),
    (re.compile(r"KVX_VERSION_STRING[`]?,? (\d+\.\d+\.\d+)"), "release",
     "kvxfer.h's version"),
    (re.compile(r"\bkvxfer\.h`? \(?(\d+\.\d+(?:\.\d+)?)\b"), "release",
     "kvxfer.h's version"),
]


def check_versions(path: str, lines: List[str], cur: Dict[str, str],
                   errs: List[str]) -> int:
    n = 0
    for i, line in enumerate(lines, 1):
        for pat, which, what in VERSION_RULES:
            for m in pat.finditer(line):
                n += 1
                got, want = m.group(1), cur[which]
                ok = got == want or (which == "release"
                                     and want.startswith(got + "."))
                if not ok:
                    errs.append("%s:%d: '%s' names %s %s; the code's is %s"
                                % (path, i, m.group(0), what, got, want))
    return n


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"`", "", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


_headings: Dict[str, Tuple[Set[str], List[str]]] = {}


def headings(path: str) -> Tuple[Set[str], List[str]]:
    """The anchors (with GitHub's -1, -2 for repeats) and titles of a
    Markdown file."""
    if path not in _headings:
        anchors: Set[str] = set()
        titles: List[str] = []
        seen: Dict[str, int] = {}
        fence = False
        for line in read(path).splitlines():
            if line.startswith("```"):
                fence = not fence
            if fence:
                continue
            m = re.match(r"#{1,6} +(.*?)\s*#*\s*$", line)
            if m:
                t = m.group(1)
                titles.append(t.replace("`", ""))
                s = slug(t)
                k = seen.get(s, 0)
                seen[s] = k + 1
                anchors.add(s if k == 0 else "%s-%d" % (s, k))
        _headings[path] = (anchors, titles)
    return _headings[path]


def section_ok(title: str, titles: List[str]) -> bool:
    """A reference "Title" names a heading: the whole title, or the part
    before its colon or parenthesis."""
    t = title.replace("`", "")
    for h in titles:
        if h == t or re.match(re.escape(t) + r"(:| \(| —)", h):
            return True
    return False


LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r"((?:docs/)?[\w./-]+\.md)`?,? (?:section )?"
                         r"\"([^\"]+)\"")
BACKTICK_PATH = re.compile(r"`([\w./-]+)`")


_build_text: List[str] = []


def generated(path: str) -> bool:
    """A path the build makes (build/tests/x.so, debian/changelog): its
    name appears in the Makefile or a script that writes it."""
    if not _build_text:
        _build_text.append(read("Makefile"))
        for n in sorted(os.listdir(os.path.join(ROOT, "scripts"))):
            if n.endswith(".sh") and n != "test-check-docs.sh":
                _build_text.append(read("scripts/" + n))
    name = os.path.basename(path.rstrip("/"))
    return any(re.search(r"\b%s\b" % re.escape(name), t)
               for t in _build_text)


def resolve(doc: str, target: str) -> Optional[str]:
    """A link's file, relative to the repository root, or None for an
    external one."""
    if re.match(r"[a-z]+:", target):
        return None
    base = os.path.dirname(doc)
    return os.path.normpath(os.path.join(base, target)) if target else doc


def check_links(path: str, lines: List[str], errs: List[str]) -> int:
    n = 0
    fence = False
    for i, line in enumerate(lines, 1):
        if line.startswith("```"):
            fence = not fence
        if OUTSIDE.search(line):
            errs.append("%s:%d: cites a file outside the repository: %s"
                        % (path, i, OUTSIDE.search(line).group(0)))
        if fence or not path.endswith(".md"):
            continue
        for m in LINK.finditer(line):
            target, _, anchor = m.group(1).partition("#")
            f = resolve(path, target)
            if f is None:
                continue
            n += 1
            if not os.path.exists(os.path.join(ROOT, f)):
                errs.append("%s:%d: link to %s: no such file"
                            % (path, i, m.group(1)))
                continue
            if anchor and f.endswith(".md") \
                    and anchor not in headings(f)[0]:
                errs.append("%s:%d: link to %s: %s has no section #%s"
                            % (path, i, m.group(1), f, anchor))
        for m in SECTION_REF.finditer(line):
            f = m.group(1)
            if not f.startswith("docs/") and f != "README.md":
                f = os.path.normpath(os.path.join(os.path.dirname(path),
                                                  f))
            n += 1
            if not os.path.exists(os.path.join(ROOT, f)):
                errs.append("%s:%d: %s: no such file" % (path, i, f))
            elif not section_ok(m.group(2), headings(f)[1]):
                errs.append('%s:%d: %s has no section "%s"'
                            % (path, i, f, m.group(2)))
        for m in BACKTICK_PATH.finditer(line):
            p = m.group(1)
            if not p.startswith(REPO_DIRS) or "*" in p or "<" in p:
                continue
            n += 1
            if not os.path.exists(os.path.join(ROOT, p.rstrip("/"))) \
                    and not generated(p):
                errs.append("%s:%d: `%s`: no such file in the repository"
                            % (path, i, p))
    return n


def check_benchmarks(errs: List[str]) -> int:
    """docs/benchmarks.md is one table of the current figures, each row
    with its command (in backticks), machine and date (YYYY-MM-DD); the
    dated history is docs/history/benchmarks.md."""
    path = "docs/benchmarks.md"
    lines = read(path).splitlines()
    tables = [i for i, x in enumerate(lines, 1) if x.startswith("| ---")]
    if len(tables) != 1:
        errs.append("%s: %d tables; it keeps one table of the current "
                    "figures (the rest goes to docs/history/benchmarks.md)"
                    % (path, len(tables)))
        return 0
    head = [c.strip() for c in lines[tables[0] - 2].strip("|").split("|")]
    want = ("command", "machine", "date")
    if any(w not in head for w in want):
        errs.append("%s:%d: the table's columns %s lack one of %s"
                    % (path, tables[0] - 1, head, want))
        return 0
    col = {w: head.index(w) for w in want}
    n = 0
    for i in range(tables[0], len(lines)):
        if not lines[i].startswith("|"):
            break
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        n += 1
        if len(cells) != len(head):
            errs.append("%s:%d: %d cells, the header has %d"
                        % (path, i + 1, len(cells), len(head)))
            continue
        if "`" not in cells[col["command"]]:
            errs.append("%s:%d: no command (in backticks) in the row"
                        % (path, i + 1))
        if not cells[col["machine"]]:
            errs.append("%s:%d: no machine in the row" % (path, i + 1))
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[col["date"]]):
            errs.append("%s:%d: date %r is not YYYY-MM-DD"
                        % (path, i + 1, cells[col["date"]]))
    return n


def main() -> int:
    os.chdir(ROOT)
    cur = current()
    errs: List[str] = []
    nv = nl = 0
    files = doc_files()
    for path in files:
        lines = read(path).splitlines()
        nv += check_versions(path, lines, cur, errs)
        nl += check_links(path, lines, errs)
    nb = check_benchmarks(errs)
    for e in errs:
        print(e)
    print("check-docs: %d files, %d version statements (release %s, "
          "protocol %s, soname %s, python %s), %d links and paths, "
          "%d benchmark rows: %s"
          % (len(files), nv, cur["release"], cur["protocol"], cur["abi"],
             cur["python"], nl, nb,
             "%d problems" % len(errs) if errs else "ok"))
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
