"""The daemon fixture of python/tests (a real kvxferd on a private
socket), for the vLLM connector's tests."""

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

_spec = importlib.util.spec_from_file_location(
    "kvxfer_python_conftest", os.path.join(REPO, "python", "tests",
                                           "conftest.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

Daemon = _base.Daemon
daemon = _base.daemon
pytest_runtest_makereport = _base.pytest_runtest_makereport
