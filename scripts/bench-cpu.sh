#!/bin/sh
# The host-memory targets of the foundation issue, each run 5 times on a
# fresh daemon; prints every run and the median. Usage:
#   scripts/bench-cpu.sh [build]
B=${1:-build}
N=${N:-5}
med() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
run() { # label field args...
    label=$1; f=$2; shift 2
    vals=""
    for i in $(seq "$N"); do
        out=$("$B/kvxfer-bench" --spawn-daemon --json "$@") || { echo "$label: run failed"; return 1; }
        echo "$out" | grep -q '"verified":true' || { echo "$label: NOT verified: $out"; return 1; }
        vals="$vals $(echo "$out" | field "$f")"
    done
    echo "$label:$vals  -> median $(echo $vals | tr ' ' '\n' | med)"
}
echo "== 1 GiB (16 requests x 32 blocks of 2 MiB; 32 KiB runs per block-layer)"
run "ratio to memcpy" ratio --requests 16 --blocks 32 --window 4
run "GB/s          " gbps  --requests 16 --blocks 32 --window 4
echo "== one-block requests (1 layer, 1 head, 64 dim: 4 KiB blocks)"
run "requests/s, 2 pairs, window 64" requests_per_s --pairs 2 --requests 24000 --blocks 1 --layers 1 --heads 1 --head-dim 64 --window 64
run "requests/s, 1 pair,  window 64" requests_per_s --requests 24000 --blocks 1 --layers 1 --heads 1 --head-dim 64 --window 64
run "p99 us, window 1     " p99_us --requests 20000 --blocks 1 --layers 1 --heads 1 --head-dim 64 --window 1
run "p50 us, window 1     " p50_us --requests 20000 --blocks 1 --layers 1 --heads 1 --head-dim 64 --window 1
