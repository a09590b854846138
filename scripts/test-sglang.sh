#!/bin/sh
# make test-sglang: kvxfer.sglang's tests (tests/sglang, pytest) against
# SGLang's own disaggregation base classes, pinned, and BUILD's kvxferd
# and libkvxfer.so.2. The last line is "N passed, N failed", as
# scripts/test-python.sh's; skipped tests are named above it.
#   scripts/test-sglang.sh [BUILD] [pytest arguments...]
# The tests run in BUILD/venv-sglang, made here from PyPI. Importing
# sglang.srt.disaggregation.base.conn imports most of sglang.srt, and that
# imports torch and triton; a full "pip install sglang" would bring CUDA
# kernels for a GPU. The smallest set that imports, found by trying: the
# wheels of sglang, torch, torchvision and triton without their
# dependencies, the Python packages sglang.srt imports (transformers among
# them: SGLang's own bootstrap server and decode queue, which the tests
# drive, import it), and the four CUDA libraries torch's libraries link
# that the CUDA toolkit on this kind of machine lacks (it has the others).
# Where torch then does not import (no CUDA 13 toolkit), torch is
# installed again with all its CUDA packages (several GB more). About 2
# minutes and 3.3 GB the first time; a venv made before the bootstrap
# server was SGLang's gets the missing packages (about 1 minute).
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
[ $# -gt 0 ] && shift
SGLANG=0.5.23   # kvxfer.sglang.SGLANG_VERSION
TORCH=2.14.1    # what sglang 0.5.23 pins
venv=$BUILD/venv-sglang
py=$venv/bin/python
fail() { echo "test-sglang: $*"; echo "0 passed, 1 failed"; exit 1; }
pip() { "$py" -m pip install -q --disable-pip-version-check --no-cache-dir "$@" 2>&1 |
        grep -v "requires\|dependency conflicts\|dependency resolver"; }
ready() { "$py" -c 'import pytest, numpy, torch
from sglang.srt.disaggregation.base.conn import BaseKVManager
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
from sglang.srt.disaggregation.decode import DecodePreallocQueue' 2>/dev/null; }
if [ ! -x "$py" ]; then
    ${PYTHON:-python3} -m venv "$venv" ||
        fail "cannot make a virtual environment in $venv (Debian: apt-get install python3-venv)"
fi
if ! ready; then
    echo "test-sglang: installing sglang $SGLANG's base classes into $venv (about 2 minutes)"
    start=$(date +%s)
    pip --no-deps sglang==$SGLANG torch==$TORCH triton==3.8.0 \
        torchvision==0.29.1 \
        nvidia-cufile==1.15.1.6 nvidia-cusparselt-cu13==0.8.1 \
        nvidia-nvshmem-cu13==3.4.5 nvidia-nccl-cu13==2.30.7
    pip pytest numpy filelock fsspec jinja2 networkx sympy typing_extensions \
        orjson psutil pybase64 requests pillow starlette msgspec pydantic \
        pyzmq tqdm ipython aiohttp
    # what the bootstrap server (common/conn.py) and the decode queue
    # (decode.py) import beyond the base classes
    pip transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi dill \
        sentencepiece compressed-tensors gguf openai partial-json-parser \
        einops
    if ! "$py" -c 'import torch' 2>/dev/null; then
        echo "test-sglang: torch needs its CUDA packages here; installing them"
        pip torch==$TORCH
    fi
    ready || { "$py" -c 'from sglang.srt.disaggregation.base.conn import BaseKVManager' 2>&1 | tail -3
               fail "sglang $SGLANG's base classes do not import in $venv"; }
    echo "test-sglang: installed in $(($(date +%s) - start)) s"
fi
[ -f "$BUILD/libkvxfer.so.2" ] || fail "$BUILD/libkvxfer.so.2 not built (run make)"
[ -x "$BUILD/kvxferd" ] || fail "$BUILD/kvxferd not built (run make)"
command -v patch >/dev/null || fail "patch(1) is missing (Debian: apt-get install patch)"
[ $# -gt 0 ] || set -- tests/sglang
exec scripts/run-pytest.sh "$BUILD" "$py" test-sglang "$@"
