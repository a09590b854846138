"""The two ways SGLang 0.5.23 picks kvxfer, against the pinned wheel:
docs/engines/sglang-0.5.23-kvxfer.patch (site-packages, the fallback) and
the proposal docs/engines/sglang-0.5.23-transfer-backend-entry-points.patch
with the entry point python/pyproject.toml declares. Each applies exactly
(no offset, no fuzz) and makes the backend factory return kvxfer.sglang's
classes for "kvxfer"."""

import ast
import importlib.metadata
import os
import py_compile
import shutil
import subprocess
import tomllib

from conftest import REPO

import kvxfer.sglang
import sglang

PATCH = os.path.join(REPO, "docs", "engines", "sglang-0.5.23-kvxfer.patch")
PROPOSAL = os.path.join(REPO, "docs", "engines",
                        "sglang-0.5.23-transfer-backend-entry-points.patch")
FILES = ("sglang/srt/disaggregation/utils.py",
         "sglang/srt/arg_groups/choices.py")


def patched_copy(tmp_path, patch=PATCH):
    """The files the patch touches, copied from the installed wheel into
    tmp_path as site-packages holds them, then patched with patch -p1."""
    site = os.path.dirname(os.path.dirname(sglang.__file__))
    for f in FILES:
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(site, f), tmp_path / f)
    with open(patch, "rb") as p:
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


def test_proposal_applies_exactly_to_the_pinned_wheel(tmp_path):
    r = patched_copy(tmp_path, PROPOSAL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "offset" not in r.stdout and "fuzz" not in r.stdout, r.stdout
    for f in FILES:
        py_compile.compile(str(tmp_path / f), doraise=True)


def installed_entry_point(tmp_path, monkeypatch):
    """kvxfer installed as pip installs python/ (its dist-info with the
    entry points pyproject.toml declares), on sys.path."""
    with open(os.path.join(REPO, "python", "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]
    dist = tmp_path / "site" / "kvxfer-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvxfer\n"
                                   "Version: 0.0.0\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in m.items())
        for group, m in eps.items()))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return eps


def test_proposal_finds_kvxfer_by_its_entry_point(tmp_path, monkeypatch):
    """With the proposal applied and kvxfer installed, "kvxfer" is a CLI
    choice, TransferBackend("kvxfer") a member, and get_kv_class gives
    kvxfer.sglang's classes; a name no package provides still raises."""
    assert patched_copy(tmp_path, PROPOSAL).returncode == 0
    eps = installed_entry_point(tmp_path, monkeypatch)
    group = "sglang.disaggregation.transfer_backends"
    assert eps[group] == {"kvxfer": "kvxfer.sglang:kv_classes"}

    choices = {}  # the patched choices.py, run whole (it imports nothing)
    exec(compile((tmp_path / FILES[1]).read_text(), "choices.py", "exec"),
         choices)
    assert choices["DISAGG_TRANSFER_BACKEND_ENTRY_POINTS"] == group
    assert "kvxfer" in choices["DISAGG_TRANSFER_BACKEND_CHOICES"]
    import sglang.srt.arg_groups.choices as installed
    monkeypatch.setattr(installed, "DISAGG_TRANSFER_BACKEND_ENTRY_POINTS",
                        group, raising=False)

    tree = ast.parse((tmp_path / FILES[0]).read_text())
    wanted = [n for n in tree.body
              if isinstance(n, (ast.ClassDef, ast.FunctionDef))
              and n.name in ("TransferBackend", "KVClassType",
                             "_transfer_backend_entry_point", "get_kv_class")
              and not getattr(n, "decorator_list", None)]
    assert len(wanted) == 4
    ns = {}
    exec("from __future__ import annotations\n"
         "from enum import Enum\nfrom typing import Optional, Type\n", ns)
    exec(compile(ast.Module(body=wanted, type_ignores=[]),
                 "patched utils.py", "exec"), ns)
    tb, kc, get = ns["TransferBackend"], ns["KVClassType"], ns["get_kv_class"]
    backend = tb("kvxfer")
    assert isinstance(backend, tb) and tb("kvxfer") is backend
    assert backend.value == "kvxfer" and backend != tb.MOONCAKE
    assert get(backend, kc.MANAGER) is kvxfer.sglang.KvxferKVManager
    assert get(backend, kc.SENDER) is kvxfer.sglang.KvxferKVSender
    assert get(backend, kc.RECEIVER) is kvxfer.sglang.KvxferKVReceiver
    assert (get(backend, kc.BOOTSTRAP_SERVER)
            is kvxfer.sglang.KvxferKVBootstrapServer)
    assert tb("mooncake") is tb.MOONCAKE
    try:
        tb("nobody-provides-this")
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown backend name was accepted")
