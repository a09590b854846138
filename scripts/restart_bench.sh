#!/bin/sh
# make restart-bench [BUILD=build]: how long engines take to move KV again
# after kvxferd restarts (issue 35). kill -9 of the daemon under a
# context and a generation rank polling every millisecond, a new daemon on
# the same socket path, 20 times: the time from its socket first
# accepting to a transfer verified byte for byte, p50 and p99, for the C
# library (BUILD/restart_bench) and the Python client
# (scripts/restart_bench.py). docs/benchmarks.md has the figures.
#   scripts/restart_bench.sh [BUILD] [RESTARTS]
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
N=${2:-20}
"$BUILD/restart_bench" "$BUILD/kvxferd" "$N" | tail -n 1 || exit 1
py=$BUILD/venv/bin/python
[ -x "$py" ] || py=python3
KVX_BUILD=$BUILD "$py" scripts/restart_bench.py "$BUILD/kvxferd" "$N" | tail -n 1
