"""The console scripts of the wheel: ``kvxferd``, ``kvxferctl`` and
``kvxfer-bench`` on PATH, each replaced (``exec``) by the program of that
name that the wheel carries in ``kvxfer/_bin/``.

The programs find the shared libraries the wheel grafts (``kvxfer.libs/``)
through their run path. kvxferd's UCX is that of the ``libucx-cu13``
package, a dependency of the wheel: its run path names
``site-packages/libucx/lib`` and UCX loads its transport modules from
``libucx/lib/ucx`` beside its own libraries. Where ``libucx`` was
installed elsewhere (another site directory), its ``lib/`` is appended to
``LD_LIBRARY_PATH``; a ``LD_LIBRARY_PATH`` already set comes first, so a
site's UCX (one with InfiniBand) may stand in for the wheel's. Nothing
else is changed: arguments, environment, working directory and the
process id (a service manager sees kvxferd itself) stay as they are.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Dict, List, NoReturn, Optional

_BIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin")


def program(name: str) -> str:
    """The path of the bundled program NAME (``kvxfer/_bin/NAME``)."""
    return os.path.join(_BIN_DIR, name)


def ucx_lib_dir() -> Optional[str]:
    """The ``lib/`` folder of the installed ``libucx`` package (PyPI's
    ``libucx-cu13``), or None where it is not installed."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        lib = os.path.join(d, "lib")
        if os.path.exists(os.path.join(lib, "libucp.so.0")):
            return lib
    return None


def _env(name: str) -> Dict[str, str]:
    env = dict(os.environ)
    if name != "kvxferd":
        return env
    lib = ucx_lib_dir()
    if lib is None:
        return env  # the loader names what it misses
    here = os.path.dirname(os.path.dirname(_BIN_DIR))
    if os.path.dirname(os.path.dirname(lib)) == here:
        return env  # where kvxferd's run path looks already
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = old + ":" + lib if old else lib
    return env


def _exec(name: str, argv: Optional[List[str]] = None) -> NoReturn:
    path = program(name)
    args = sys.argv[1:] if argv is None else argv
    if not os.access(path, os.X_OK):
        sys.stderr.write(
            f"{name}: this kvxfer package carries no {name} ({path} "
            "missing or not executable): it was installed from a source "
            "tree, not from the wheel that `make wheel` builds; run the "
            f"{name} of the build, of `make install` or of the Debian "
            "packages\n")
        sys.exit(127)
    try:
        os.execve(path, [name] + args, _env(name))
    except OSError as e:
        sys.stderr.write(f"{name}: cannot run {path}: {e}\n")
        sys.exit(126)


def kvxferd() -> NoReturn:
    """``kvxferd``: the daemon (kvxferd(8))."""
    _exec("kvxferd")


def kvxferctl() -> NoReturn:
    """``kvxferctl``: the daemon's admin CLI (kvxferctl(1))."""
    _exec("kvxferctl")


def kvxfer_bench() -> NoReturn:
    """``kvxfer-bench``: the transfer benchmark (kvxfer-bench(1))."""
    _exec("kvxfer-bench")
