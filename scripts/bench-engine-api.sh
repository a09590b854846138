#!/bin/sh
# The engine API's figures (docs/history/benchmarks.md, "Engine API"): pools of
# regions against one allocation (host, and GPU where there is one), and
# the keyed flows (string keys, reserve, fetch by key) against plain
# uint64 requests, each run R times, interleaved, one JSON line a run.
# Usage: scripts/bench-engine-api.sh [BENCH] [RUNS] > results.jsonl
B=${1:-build/kvxfer-bench}
R=${2:-3}
run() { # label, args...
    label=$1; shift
    out=$("$B" --spawn-daemon --json "$@" 2>/dev/null | tail -n 1)
    echo "{\"label\":\"$label\",\"args\":\"$*\",\"result\":${out:-null}}"
}
H="--layers 64 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --layout vllm-nhd --requests 16 --blocks 16 --window 4 --pool-mib 4096"
K="--layers 8 --heads 8 --head-dim 128 --tokens-per-block 16 --requests 2000 --blocks 2 --window 16 --pool-mib 1024"
for i in $(seq "$R"); do
    run host-one $H
    run host-regions64 $H --regions 64
    run keys-uint64 $K
    run keys-strings $K --keyed
    run keys-reserve $K --reserve
    run keys-by-key $K --by-key
done
if [ -n "$GPU" ]; then
    G="--gpu --gen-device 0 --layers 32 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --layout vllm-nhd --requests 16 --blocks 1000 --window 4 --pool-mib 40000"
    for i in $(seq "$R"); do
        run gpu-one $G
        run gpu-regions64 $G --regions 64
        run gpu-regions32 $G --regions 32
    done
fi
