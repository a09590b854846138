#!/bin/sh
# Transfers between two daemons (issue #4): kvxfer-bench --daemons 2 spawns
# daemon A for the context ranks and daemon B for the generation ranks on
# this host; every byte crosses over UCX. Each case runs N times (3) on
# fresh daemons; prints every run and the median. The baseline, in the same
# run, is ucx_perftest ucp_am_bw (package ucx-utils) with the same message
# (slot) size and UCX_TLS, the median of 3 runs. Usage:
#   scripts/bench-peer.sh [build]
# UCX_TLS=tcp scripts/bench-peer.sh    # a transport list for all of it
B=${1:-build}
N=${N:-3}
med() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
run() { # label args...
    label=$1; shift
    ratios="" gbps="" base=""
    for i in $(seq "$N"); do
        out=$("$B/kvxfer-bench" --spawn-daemon --daemons 2 --json --baseline-runs 3 "$@") || { echo "$label: run failed"; return 1; }
        echo "$out" | grep -q '"verified":true' || { echo "$label: NOT verified: $out"; return 1; }
        ratios="$ratios $(echo "$out" | field ratio)"
        gbps="$gbps $(echo "$out" | field gbps)"
        base="$base $(echo "$out" | field baseline_gbps)"
    done
    echo "$label ratio:$ratios  -> median $(echo $ratios | tr ' ' '\n' | med)"
    echo "$label GB/s:$gbps  -> median $(echo $gbps | tr ' ' '\n' | med)"
    echo "$label baseline GB/s (median of 3 ucx_perftest runs):$base  -> median $(echo $base | tr ' ' '\n' | med)"
}
echo "== 1 GiB (16 requests x 32 blocks of 2 MiB), window 4, UCX_TLS ${UCX_TLS:-(default)}"
run "slot 4 MiB: " --slot-bytes 4194304 --requests 16 --blocks 32 --window 4
run "slot 16 MiB:" --slot-bytes 16777216 --requests 16 --blocks 32 --window 4
