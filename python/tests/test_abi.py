"""The ctypes mirrors match kvxfer.h: sizes, offsets, functions, codes."""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

import kvxfer
from kvxfer import _lib

from conftest import REPO

HEADER = os.path.join(REPO, "client", "include", "kvxfer.h")

STRUCTS = {
    "kvx_parallel_t": _lib.Parallel,
    "kvx_layout_part_t": _lib.LayoutPart,
    "kvx_layout_t": _lib.Layout,
    "kvx_host_region_t": _lib.HostRegion,
    "kvx_gpu_region_t": _lib.GpuRegion,
    "kvx_hello_t": _lib.Hello,
    "kvx_context_params_t": _lib.ContextParams,
    "kvx_event_t": _lib.Event,
    "kvx_batch_t": _lib.Batch,
    "kvx_params_info_t": _lib.ParamsInfo,
    "kvx_group_t": _lib.Group,
    "kvx_publish_item_t": _lib.PublishItem,
    "kvx_fetch_item_t": _lib.FetchItem,
    "kvx_outcome_t": _lib.Outcome,
    "kvx_publish_args_t": _lib.PublishArgs,
    "kvx_fetch_args_t": _lib.FetchArgs,
    "kvx_client_state_t": _lib.ClientState,
    "kvx_reconnect_t": _lib.Reconnect,
}


def header():
    with open(HEADER) as f:
        return f.read()


def test_struct_layout_matches_c(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler to compare the structs with")
    lines = []
    for cname, py in STRUCTS.items():
        lines.append(f'printf("{cname} size %zu\\n", sizeof({cname}));')
        for fname, _ in py._fields_:
            lines.append(f'printf("{cname} {fname} %zu\\n", '
                         f'offsetof({cname}, {fname}));')
    src = tmp_path / "abi.c"
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n'
                   '#include "kvxfer.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "abi"
    subprocess.run([cc, "-I", os.path.dirname(HEADER), "-o", str(exe),
                    str(src)], check=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True,
                         text=True).stdout.split("\n")
    want = []
    for cname, py in STRUCTS.items():
        want.append(f"{cname} size {ctypes.sizeof(py)}")
        for fname, _ in py._fields_:
            want.append(f"{cname} {fname} {getattr(py, fname).offset}")
    assert got[:-1] == want


def test_layout_struct_size():
    # preset[16] + 8 four-byte fields, 5 strides, the parts pointer and
    # count (padded): no large inline array
    assert ctypes.sizeof(_lib.Layout) == 16 + 8 * 4 + 5 * 8 + 8 + 8
    assert ctypes.sizeof(_lib.Layout) < 128


def test_binds_every_exported_function():
    declared = set(re.findall(r"KVX_EXPORT[^;(]*?\b(kvx_\w+)\s*\(",
                              header()))
    assert set(_lib._PROTOS) == declared, (
        "kvxfer.h and python/kvxfer/_lib.py disagree: bind the new calls")
    lib = _lib.lib()
    for name in declared:
        assert getattr(lib, name).argtypes is not None


def test_version_is_the_headers():
    m = re.search(r'#define KVX_VERSION_STRING "([^"]+)"', header())
    assert kvxfer.version() == kvxfer.__version__ == m.group(1)


def test_every_status_code_has_its_class():
    codes = dict((int(v), n) for n, v in re.findall(
        r"KVX_ERR_(\w+) = (-\d+),", header()))
    assert len(codes) == 21
    lib = _lib.lib()
    for code, name in codes.items():
        cls = kvxfer.error_class(code)
        assert cls is not kvxfer.Error and issubclass(cls, kvxfer.Error)
        assert cls.code == code
        assert cls.name == name == lib.kvx_status_name(code).decode()
        assert getattr(kvxfer, cls.__name__) is cls
        e = cls(code, "")
        assert str(e) == f"{name}: {lib.kvx_status_str(code).decode()}"
    assert kvxfer.error_class(-999) is kvxfer.Error
    assert kvxfer.error_class(-1) is kvxfer.InvalidArgument
    assert issubclass(kvxfer.InvalidArgument, ValueError)
    assert kvxfer.error_class(-11) is kvxfer.AuthError
    assert kvxfer.error_class(-13) is kvxfer.TimedOut


def test_library_lookup_honours_kvxfer_lib(monkeypatch):
    monkeypatch.setenv("KVXFER_LIB", "/nonexistent/libkvxfer.so.2")
    cands = _lib.candidates()
    assert cands[0] == "/nonexistent/libkvxfer.so.2"
    assert cands[1].endswith(os.path.join("kvxfer", "_libs",
                                          "libkvxfer.so.2"))
    assert os.path.exists(kvxfer.library_path())
