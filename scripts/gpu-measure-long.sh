#!/bin/sh
# Longer GPU runs (32 requests x 1000 blocks x 2 MiB = 67 GB per side), to
# see the steady state past the fixed start/end costs of a bench run.
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-gpu-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd); export PATH="$B/bin:$PATH" LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
run() {
    name=$1; shift
    echo "== $name: kvxfer-bench $*" | tee -a "$OUT/bench-long.txt"
    timeout 90 kvxfer-bench --spawn-daemon --gpu --json "$@" >>"$OUT/bench-long.txt" 2>&1 ||
        echo "FAILED rc=$?" >>"$OUT/bench-long.txt"
}
M="--layers 32 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --pool-mib 70000 --requests 32 --blocks 1000 --window 4"
run vllm-nhd-default $M --layout vllm-nhd
run trtllm-default $M --layout trtllm
run vllm-nhd-ctas-132 $M --layout vllm-nhd --ctas 132
run hetero-tp4-tp2 $M --ctx-ranks 4 --gen-ranks 2 --ctx-layout trtllm --gen-layout vllm-nhd
run same-tp2-tp2 $M --ctx-ranks 2 --gen-ranks 2 --layout vllm-nhd
