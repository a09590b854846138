#!/bin/bash
# The CPU path between two daemons on one host, under several daemon
# settings (and builds), interleaved so that drift hits every setting
# alike; each run has its own ucx_perftest baseline (the median of
# BASELINE_RUNS runs, 3). Run from an unpacked bundle:
#   scripts/bench-peer-window.sh dist/kvxfer OUTDIR
# VARIANTS: ';'-separated lists of kvxfer-bench arguments.
# PASSES: N > 1 runs each bench with --passes N (a ucx_perftest run beside
# each timed pass; the ratio is the median of the passes' ratios).
# BUNDLES: space-separated bundle folders to compare (default: the first
# argument); each run of each variant goes through each of them in turn.
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-window-out}
RUNS=${RUNS:-3}
VARIANTS=${VARIANTS:-"--slot-bytes 4194304;--slot-bytes 16777216"}
mkdir -p "$OUT"
IFS=';' read -r -a V <<<"$VARIANTS"
read -r -a BS <<<"${BUNDLES:-$B}"
for i in $(seq 1 "$RUNS"); do
    for v in "${V[@]}"; do
        for b in "${BS[@]}"; do
            eval "args=($v)"
            tag="[$v]"
            [ ${#BS[@]} -gt 1 ] && tag="[$(basename "$b")] $tag"
            r=$(KVX_HOME=$(cd "$b" && pwd) && . "$KVX_HOME/env.sh" &&
                timeout 180 kvxfer-bench --spawn-daemon --daemons 2 --json \
                $(if [ "${PASSES:-1}" -gt 1 ]; then
                      echo --passes "$PASSES"
                  else echo --baseline-runs "${BASELINE_RUNS:-3}"; fi) \
                --requests 16 --blocks 32 --window 4 "${args[@]}" 2>&1 |
                tail -1)
            echo "$tag run=$i $r" >>"$OUT/window.txt"
            g=$(echo "$r" | grep -o '"gbps":[0-9.]*,"baseline_gbps":[0-9.]*,"ratio":[0-9.]*')
            t=$(echo "$r" | grep -o '"slot_us":{[^}]*}[^}]*}')
            echo "$tag run=$i ${g:-$r} $t"
        done
    done
done
