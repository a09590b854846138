"""The fixtures of kvxfer.trtllm's tests: python/tests' daemon (a real
kvxferd on a private socket), the stand-in TensorRT-LLM (standin.py, put
in sys.modules under TensorRT-LLM's names before kvxfer.trtllm is
imported) and the instances (harness.Instance) a test makes."""

import importlib.util
import itertools
import os
import sys
from typing import List

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, HERE)

import standin  # noqa: E402

standin.install_modules()

_spec = importlib.util.spec_from_file_location(
    "kvxfer_python_conftest", os.path.join(REPO, "python", "tests",
                                           "conftest.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

Daemon = _base.Daemon
daemon = _base.daemon
pytest_runtest_makereport = _base.pytest_runtest_makereport

from harness import Instance  # noqa: E402

_n = itertools.count(1)


@pytest.fixture
def instances(daemon):
    """make(tp, pp, sock=None, **kw): an Instance on the module's daemon
    (or on sock), shut down after the test."""
    made: List[Instance] = []

    def make(tp: int = 1, pp: int = 1, sock=None, **kw) -> Instance:
        n = next(_n)
        name = "ctx" if not made else "gen"
        inst = Instance(sock or daemon.sock, f"{name}-{n}", tp, pp,
                        seed=n, instance_id=kw.pop("instance_id",
                                                   f"trtllm-{name}-{n}"),
                        **kw)
        made.append(inst)
        return inst
    yield make
    for inst in made:
        inst.close()


@pytest.fixture
def own_daemon(tmp_path):
    """A daemon of the test's own, to kill and start again."""
    d = Daemon(tmp_path)
    yield d
    d.stop()
