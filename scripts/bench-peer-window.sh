#!/bin/bash
# The CPU path between two daemons on one host, under several daemon
# settings, interleaved so that drift hits every setting alike; each run
# has its own ucx_perftest baseline (the median of BASELINE_RUNS runs,
# 3). Run from an unpacked bundle:
#   scripts/bench-peer-window.sh dist/kvxfer OUTDIR
# VARIANTS: ';'-separated lists of kvxfer-bench arguments.
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-window-out}
RUNS=${RUNS:-3}
VARIANTS=${VARIANTS:-"--slot-bytes 4194304;--slot-bytes 16777216"}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B . "$B/env.sh"
IFS=';' read -r -a V <<<"$VARIANTS"
for i in $(seq 1 "$RUNS"); do
    for v in "${V[@]}"; do
        eval "args=($v)"
        r=$(timeout 180 kvxfer-bench --spawn-daemon --daemons 2 --json \
            --baseline-runs "${BASELINE_RUNS:-3}" \
            --requests 16 --blocks 32 --window 4 "${args[@]}" 2>&1 | tail -1)
        echo "[$v] run=$i $r" >>"$OUT/window.txt"
        g=$(echo "$r" | grep -o '"gbps":[0-9.]*,"baseline_gbps":[0-9.]*,"ratio":[0-9.]*')
        t=$(echo "$r" | grep -o '"slot_us":{[^}]*}[^}]*}')
        echo "[$v] run=$i ${g:-$r} $t"
    done
done
