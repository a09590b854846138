"""The wheel's console scripts (kvxfer/_cli.py) without a wheel: what a
source install's scripts say, and where kvxferd's UCX is looked for."""

import os
import sys

import pytest

from kvxfer import _cli


def test_a_source_install_says_it_has_no_daemon(monkeypatch, tmp_path,
                                                capsys):
    monkeypatch.setattr(_cli, "_BIN_DIR", str(tmp_path / "_bin"))
    monkeypatch.setattr(sys, "argv", ["kvxferd", "--version"])
    with pytest.raises(SystemExit) as e:
        _cli.kvxferd()
    assert e.value.code == 127
    err = capsys.readouterr().err
    assert "carries no kvxferd" in err and "make wheel" in err


def fake_libucx(root):
    lib = root / "libucx" / "lib"
    lib.mkdir(parents=True)
    (root / "libucx" / "__init__.py").write_text("")
    (lib / "libucp.so.0").write_bytes(b"")
    return str(lib)


def test_libucx_elsewhere_goes_after_the_callers_path(monkeypatch, tmp_path):
    lib = fake_libucx(tmp_path / "other-site")
    monkeypatch.syspath_prepend(str(tmp_path / "other-site"))
    monkeypatch.delitem(sys.modules, "libucx", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/ucx/lib")
    assert _cli.ucx_lib_dir() == lib
    env = _cli._env("kvxferd")
    assert env["LD_LIBRARY_PATH"] == "/opt/ucx/lib:" + lib
    # the other programs do not load UCX: their environment is the caller's
    assert _cli._env("kvxferctl")["LD_LIBRARY_PATH"] == "/opt/ucx/lib"


def test_libucx_beside_the_package_is_left_to_the_run_path(monkeypatch,
                                                           tmp_path):
    site = tmp_path / "site"
    fake_libucx(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "libucx", raising=False)
    monkeypatch.setattr(_cli, "_BIN_DIR", str(site / "kvxfer" / "_bin"))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert "LD_LIBRARY_PATH" not in _cli._env("kvxferd")
    assert _cli.program("kvxferd") == os.path.join(
        str(site), "kvxfer", "_bin", "kvxferd")
