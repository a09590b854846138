"""docs/engines/sglang-0.5.23-kvxfer.patch against the pinned SGLang wheel:
it applies exactly (no offset, no fuzz) and makes the backend factory
return kvxfer.sglang's classes for "kvxfer"."""

import ast
import importlib.metadata
import os
import py_compile
import shutil
import subprocess

from conftest import REPO

import kvxfer.sglang
import sglang

PATCH = os.path.join(REPO, "docs", "engines", "sglang-0.5.23-kvxfer.patch")
FILES = ("sglang/srt/disaggregation/utils.py",
         "sglang/srt/arg_groups/choices.py")


def patched_copy(tmp_path):
    """The files the patch touches, copied from the installed wheel into
    tmp_path as site-packages holds them, then patched with patch -p1."""
    site = os.path.dirname(os.path.dirname(sglang.__file__))
    for f in FILES:
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(site, f), tmp_path / f)
    with open(PATCH, "rb") as p:
        r = subprocess.run(["patch", "-p1", "--forward", "--batch"],
                           stdin=p, cwd=tmp_path, capture_output=True,
                           text=True)
    return r


def test_the_pinned_sglang_is_installed():
    assert importlib.metadata.version("sglang") == kvxfer.sglang.SGLANG_VERSION


def test_patch_applies_exactly_to_the_pinned_wheel(tmp_path):
    r = patched_copy(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "offset" not in r.stdout and "fuzz" not in r.stdout, r.stdout
    for f in FILES:
        py_compile.compile(str(tmp_path / f), doraise=True)


def test_patched_factory_returns_the_kvxfer_classes(tmp_path):
    assert patched_copy(tmp_path).returncode == 0
    tree = ast.parse((tmp_path / FILES[1]).read_text())
    choices = next(n.value for n in tree.body
                   if isinstance(n, ast.Assign)
                   and n.targets[0].id == "DISAGG_TRANSFER_BACKEND_CHOICES")
    assert "kvxfer" in ast.literal_eval(choices)

    # TransferBackend, KVClassType and get_kv_class of the patched
    # utils.py, run alone (the rest of the module imports half of SGLang)
    tree = ast.parse((tmp_path / FILES[0]).read_text())
    wanted = [n for n in tree.body
              if isinstance(n, ast.ClassDef)
              and n.name in ("TransferBackend", "KVClassType")]
    wanted += [n for n in tree.body
               if isinstance(n, ast.FunctionDef) and n.name == "get_kv_class"
               and not n.decorator_list]
    assert len(wanted) == 3
    mod = ast.Module(body=wanted, type_ignores=[])
    ns = {}
    exec("from __future__ import annotations\n"
         "from enum import Enum\nfrom typing import Optional, Type\n", ns)
    exec(compile(mod, "patched utils.py", "exec"), ns)
    tb, kc, get = ns["TransferBackend"], ns["KVClassType"], ns["get_kv_class"]
    backend = tb("kvxfer")  # what --disaggregation-transfer-backend gives
    assert get(backend, kc.MANAGER) is kvxfer.sglang.KvxferKVManager
    assert get(backend, kc.SENDER) is kvxfer.sglang.KvxferKVSender
    assert get(backend, kc.RECEIVER) is kvxfer.sglang.KvxferKVReceiver
    assert (get(backend, kc.BOOTSTRAP_SERVER)
            is kvxfer.sglang.KvxferKVBootstrapServer)
    from sglang.srt.disaggregation.base.conn import KVArgs
    assert get(backend, kc.KVARGS) is KVArgs
