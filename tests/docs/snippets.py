#!/usr/bin/env python3
"""Run the code blocks of the docs as written (make check-docs).

    tests/docs/snippets.py [--build BUILD] [FILE.md ...]

Default files: README.md, docs/python.md, docs/engines/*.md. Each fenced
block is taken by its language:

- ```python: run in a process of its own (this interpreter: make
  check-docs uses BUILD/venv, which has numpy), with the package from
  python/ and a kvxferd this script started on a private socket: the
  default socket (kvxfer.client.DEFAULT_SOCKET) is that daemon's, and the
  literal path /run/kvxfer/kvxferd.sock in the block is replaced by its
  path. One daemon per file; a block must be complete (it defines what
  it uses).
- ```sh (bash, shell): a file's shell blocks run in order in one bash,
  from the repository root, under `set -eo pipefail`, so a daemon one
  block starts (`&`) serves the next; what it started in the background
  is stopped at the end. `python` and `pip` are those of a fresh virtual
  environment, so what a block installs lands there. /tmp/kvx.sock and
  /run/kvxfer/kvxferd.sock are replaced by paths in a private directory,
  $KVX_DOCTEST_DIR.
- a block whose comment right above is `<!-- doctest: excerpt of PATH
  -->` (the README's C, an entry point in TOML) must be a verbatim part
  of that file: the same lines in a row, indentation aside.
- a block whose comment right above is `<!-- doctest: run by SCRIPT -->`
  is run by that script (docs/engines/vllm-two-nodes.md's, by
  scripts/test-two-nodes.sh, also part of make check-docs): here the
  script must exist and name the page.
- a block whose comment right above is `<!-- doctest: skip (REASON) -->`
  is not run; the skips are counted and printed with their reasons.
- a block of another language, or of none (output, diagrams), is text.

Prints one line per block and, last, "N passed, N failed"; exits 1 if
any block failed.
"""

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, NamedTuple, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
DEFAULT_FILES = ["README.md", "docs/python.md"] + sorted(
    os.path.relpath(p, REPO)
    for p in glob.glob(os.path.join(REPO, "docs", "engines", "*.md")))
DIRECTIVE = re.compile(r"<!--\s*doctest:\s*(.*?)\s*-->")
RUN_LANGS = {"python": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
BLOCK_TIMEOUT = 300  # s, a whole file's shell blocks or one Python block


class Block(NamedTuple):
    path: str
    line: int  # of the opening fence
    lang: str
    code: str
    directive: Optional[str]


def blocks(path: str) -> List[Block]:
    """The fenced blocks of a Markdown file, with the doctest directive
    on the last non-blank line before each."""
    out: List[Block] = []
    lines = open(os.path.join(REPO, path), encoding="utf-8").read() \
        .splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(```+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        d = DIRECTIVE.search(lines[k]) if k >= 0 else None
        out.append(Block(path, start + 1, lang,
                         "\n".join(lines[start + 1:j]) + "\n",
                         d.group(1) if d else None))
        i = j + 1
    return out


def dedent(lines: List[str]) -> List[str]:
    ind = min((len(x) - len(x.lstrip()) for x in lines if x.strip()),
              default=0)
    return [x[ind:].rstrip() for x in lines]


def excerpt_ok(code: str, path: str) -> Optional[str]:
    """None when code's lines are lines of path in a row (indentation
    aside), else why not."""
    full = os.path.join(REPO, path)
    if not os.path.isfile(full):
        return "%s: no such file" % path
    want = dedent(code.rstrip("\n").splitlines())
    have = open(full, encoding="utf-8").read().splitlines()
    for i in range(len(have) - len(want) + 1):
        if dedent(have[i:i + len(want)]) == want:
            return None
    # the first line that is not in the file, to say what drifted
    stripped = [h.strip() for h in have]
    for w in want:
        if w.strip() not in stripped:
            return "not a verbatim part of %s: no line %r" % (path, w)
    return "not a verbatim part of %s (its lines, not in a row)" % path


class Daemon:
    """kvxferd on a private socket."""

    def __init__(self, build: str, tmp: str):
        self.sock = os.path.join(tmp, "kvxferd.sock")
        self.log = os.path.join(tmp, "kvxferd.log")
        cfg = os.path.join(tmp, "kvxferd.yaml")
        with open(cfg, "w") as f:
            f.write("socket:\n  path: %s\n" % self.sock)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [os.path.join(build, "kvxferd"), "--config", cfg],
                stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 10
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError("kvxferd did not start:\n" + self.tail())
            time.sleep(0.02)

    def tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-20:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


PY_PRELUDE = """\
import sys
sys.path.insert(0, {python!r})
import kvxfer.client
kvxfer.client.DEFAULT_SOCKET = {sock!r}
"""


def run_python(b: Block, daemon: Daemon, build: str) -> str:
    """'' when the block ran, else its output."""
    code = b.code.replace("/run/kvxfer/kvxferd.sock", daemon.sock)
    src = PY_PRELUDE.format(python=os.path.join(REPO, "python"),
                            sock=daemon.sock) + code
    env = dict(os.environ, KVX_BUILD=build, KVXFER_SOCKET=daemon.sock)
    env.pop("KVXFER_LIB", None)
    try:
        p = subprocess.run([sys.executable, "-c", src], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        return "timed out after %d s\n%s" % (
            BLOCK_TIMEOUT, (e.stdout or b"").decode(errors="replace"))
    out = p.stdout.decode(errors="replace")
    return "" if p.returncode == 0 else (
        "exit %d\n%s\n--- kvxferd log\n%s" % (p.returncode, out,
                                              daemon.tail()))


def run_shell(bs: List[Block], build: str, tmp: str) -> str:
    """Run a file's shell blocks in one bash; '' when all ran."""
    parts = ["set -eo pipefail",
             # stop what the blocks started in the background
             "trap 'for j in $(jobs -p); do kill $j 2>/dev/null; done; "
             "wait' EXIT"]
    for b in bs:
        code = b.code.replace("/tmp/kvx.sock", os.path.join(tmp, "kvx.sock"))
        code = code.replace("/run/kvxfer/kvxferd.sock",
                            os.path.join(tmp, "kvxferd.sock"))
        parts.append("echo '>>> %s:%d'" % (b.path, b.line))
        parts.append(code)
    # python and pip are a fresh virtual environment's: what a block
    # installs lands there, never in the machine's Python
    venv = os.path.join(tmp, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv],
                   check=True)
    subprocess.run([os.path.join(venv, "bin", "python"), "-m", "ensurepip",
                    "--default-pip"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    env = dict(os.environ, KVX_BUILD=build, KVX_DOCTEST_DIR=tmp,
               VIRTUAL_ENV=venv,
               PATH=os.path.join(venv, "bin") + os.pathsep +
               os.environ.get("PATH", ""))
    env.pop("PYTHONPATH", None)
    try:
        p = subprocess.run(["bash", "-c", "\n".join(parts)], cwd=REPO,
                           env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        return "timed out after %d s\n%s" % (
            BLOCK_TIMEOUT, (e.stdout or b"").decode(errors="replace"))
    out = p.stdout.decode(errors="replace")
    return "" if p.returncode == 0 else "exit %d\n%s" % (p.returncode, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.environ.get("KVX_BUILD", "build"))
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    args = ap.parse_args()
    build = os.path.join(REPO, args.build)
    passed = failed = 0
    skips: List[str] = []
    texts = 0
    for path in args.files:
        bs = blocks(path)
        shell: List[Block] = []
        tmp = tempfile.mkdtemp(prefix="kvx-doctest-")
        daemon: Optional[Daemon] = None
        try:
            for b in bs:
                where = "%s:%d" % (b.path, b.line)
                d = b.directive or ""
                if d.startswith("skip"):
                    skips.append("%s %s: %s" % (where, b.lang or "text",
                                                d[4:].strip(" ()")))
                    print("skip  %s %s: %s" % (where, b.lang,
                                               d[4:].strip(" ()")))
                    continue
                m = re.match(r"excerpt of (\S+)$", d)
                if m:
                    why = excerpt_ok(b.code, m.group(1))
                    if why:
                        failed += 1
                        print("FAIL  %s %s: %s" % (where, b.lang, why))
                    else:
                        passed += 1
                        print("ok    %s %s: a verbatim part of %s"
                              % (where, b.lang, m.group(1)))
                    continue
                m = re.match(r"run by (\S+)$", d)
                if m:
                    script = os.path.join(REPO, m.group(1))
                    if os.path.isfile(script) and \
                            b.path in open(script).read():
                        passed += 1
                        print("ok    %s %s: run by %s" % (where, b.lang,
                                                          m.group(1)))
                    else:
                        failed += 1
                        print("FAIL  %s: %s does not exist or does not run "
                              "%s" % (where, m.group(1), b.path))
                    continue
                if d:
                    failed += 1
                    print("FAIL  %s: unknown directive %r" % (where, d))
                    continue
                kind = RUN_LANGS.get(b.lang)
                if kind == "sh":
                    shell.append(b)
                    continue
                if kind != "python":
                    if b.lang in ("c", "cpp"):
                        failed += 1
                        print("FAIL  %s c: C is checked as an excerpt of a "
                              "program that is built: mark it" % where)
                    else:
                        texts += 1
                    continue
                if daemon is None:
                    daemon = Daemon(build, tmp)
                t0 = time.monotonic()
                err = run_python(b, daemon, build)
                if err:
                    failed += 1
                    print("FAIL  %s python:\n%s" % (where, err))
                else:
                    passed += 1
                    print("ok    %s python (%.1f s)"
                          % (where, time.monotonic() - t0))
            if shell:
                t0 = time.monotonic()
                err = run_shell(shell, build, tmp)
                where = ", ".join("%d" % b.line for b in shell)
                if err:
                    failed += len(shell)
                    print("FAIL  %s sh blocks at lines %s:\n%s"
                          % (path, where, err))
                else:
                    passed += len(shell)
                    print("ok    %s sh blocks at lines %s (%.1f s)"
                          % (path, where, time.monotonic() - t0))
        except RuntimeError as e:
            failed += 1
            print("FAIL  %s: %s" % (path, e))
        finally:
            if daemon:
                daemon.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    print("doc snippets: %d run or checked, %d skipped, %d text blocks "
          "(output, diagrams, configuration) not run"
          % (passed + failed, len(skips), texts))
    for s in skips:
        print("  skipped: " + s)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
