#!/bin/sh
# make restart-bench [BUILD=build]: how long engines take to move KV again
# after kvxferd restarts (issue 35). kill -9 of the daemon under a
# context and a generation rank polling every millisecond, a new daemon on
# the same socket path, 20 times: the time from its socket first
# accepting to a transfer verified byte for byte, p50 and p99, for the C
# library (BUILD/restart_bench), the Python client
# (scripts/restart_bench.py) and, where make test-vllm installed
# BUILD/venv-vllm, the vLLM connector under vLLM's own scheduler
# (scripts/restart_bench_vllm.py). docs/benchmarks.md has the figures.
#   scripts/restart_bench.sh [BUILD] [RESTARTS]
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
N=${2:-20}
"$BUILD/restart_bench" "$BUILD/kvxferd" "$N" | tail -n 1 || exit 1
py=$BUILD/venv/bin/python
[ -x "$py" ] || py=python3
KVX_BUILD=$BUILD "$py" scripts/restart_bench.py "$BUILD/kvxferd" "$N" | tail -n 1
vpy=$BUILD/venv-vllm/bin/python
if [ -x "$vpy" ]; then
    KVX_BUILD=$BUILD KVXFER_LIB=$PWD/$BUILD/libkvxfer.so.2 \
        "$vpy" scripts/restart_bench_vllm.py "$BUILD/kvxferd" "$N" 2>/dev/null |
        tail -n 1
else
    echo "vLLM connector: skipped ($vpy missing: run make test-vllm first)"
fi
