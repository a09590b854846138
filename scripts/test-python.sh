#!/bin/sh
# make test-python: the Python package's tests (python/tests, pytest)
# against BUILD's kvxferd and libkvxfer.so.2. The last line is
# "N passed, N failed", as tests/run.sh's, which adds it into make test;
# skipped tests are named above it and count as neither.
#   scripts/test-python.sh [BUILD] [--gpu|--vllm|--trtllm] [pytest args...]
# pytest, numpy and prometheus_client (test_metrics.py parses the
# metrics text with it) come from a virtual environment, BUILD/venv, made here
# (pip from PyPI). --gpu (make test-gpu): python3 itself when it has
# pytest and numpy, else BUILD/venv-gpu, which sees the system's packages
# (torch, cupy). --vllm (make test-vllm): tests/vllm, the vLLM connector
# against vLLM's own scheduler, in BUILD/venv-vllm with the vLLM release
# kvxfer.vllm pins: vLLM and what pip resolves for it, less the GPU kernel
# packages and torch's CUDA libraries (scripts/vllm-lean.py; installed once,
# about 4 minutes and 3.8 GB, where a full install takes 9.4 GB and
# as much again in pip's cache; no pip cache is kept). --trtllm (make
# test-trtllm): tests/trtllm, kvxfer.trtllm against a stand-in TensorRT-LLM
# (tests/trtllm/standin.py), needing only torch and pytest: it runs in
# BUILD/venv-vllm, made as --vllm makes it when it lacks them.
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
[ $# -gt 0 ] && shift
venv=$BUILD/venv; venv_flags=""; py=""
pkgs="pytest numpy prometheus_client"; need="import pytest, numpy, prometheus_client"
tests=python/tests; lean=0
case "${1:-}" in
--gpu)
    shift
    venv=$BUILD/venv-gpu; venv_flags=--system-site-packages
    python3 -c "$need" 2>/dev/null && py=python3 ;;
--vllm)
    shift
    vllm=$(sed -n 's/^VLLM_VERSION = "\(.*\)".*/\1/p' python/kvxfer/vllm/common.py)
    venv=$BUILD/venv-vllm; pkgs="vllm==$vllm pytest"; tests=tests/vllm; lean=1
    need="import pytest, vllm; assert vllm.__version__ == '$vllm', vllm.__version__" ;;
--trtllm)
    shift
    vllm=$(sed -n 's/^VLLM_VERSION = "\(.*\)".*/\1/p' python/kvxfer/vllm/common.py)
    venv=$BUILD/venv-vllm; pkgs="vllm==$vllm pytest"; tests=tests/trtllm; lean=1
    need="import pytest, torch" ;;
esac
fail() { echo "test-python: $*"; echo "0 passed, 1 failed"; exit 1; }
# no pip cache: it would hold a second copy of every wheel (CI's disk is small)
pip_install() { "$py" -m pip install -q --disable-pip-version-check --no-cache-dir "$@"; }
# vLLM without its GPU packages: resolve, drop them, install the rest
# without dependencies
install_lean() {
    report=$venv/resolved.json
    pip_install --dry-run --ignore-installed --report "$report" $pkgs ||
        fail "pip could not resolve $pkgs"
    "$py" scripts/vllm-lean.py "$report" > "$venv/lean.txt" ||
        fail "cannot read pip's report $report"
    pip_install --no-deps -r "$venv/lean.txt" ||
        fail "pip could not install $pkgs into $venv"
    if ! "$py" -c 'import torch' 2>/dev/null; then
        echo "test-python: torch needs its CUDA packages here; installing them"
        torch=$(grep '^torch==' "$venv/lean.txt")
        pip_install "$torch" || fail "pip could not install $torch"
    fi
}
if [ -z "$py" ]; then
    py=$venv/bin/python
    if [ ! -x "$py" ]; then
        ${PYTHON:-python3} -m venv $venv_flags "$venv" ||
            fail "cannot make a virtual environment in $venv (Debian: apt-get install python3-venv)"
    fi
    if ! "$py" -c "$need" 2>/dev/null; then
        echo "test-python: installing $pkgs into $venv"
        if [ $lean = 1 ]; then
            install_lean
        else
            pip_install $pkgs || fail "pip could not install $pkgs into $venv"
        fi
    fi
fi
[ -f "$BUILD/libkvxfer.so.2" ] || fail "$BUILD/libkvxfer.so.2 not built (run make)"
[ $# -gt 0 ] || set -- $tests
exec scripts/run-pytest.sh "$BUILD" "$py" test-python "$@"
