#!/bin/sh
# The GPU measurements of the GPU data plane issue, in one go (run from an
# unpacked bundle: scripts/gpu-measure.sh dist/kvxfer OUTDIR).
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-gpu-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd); export PATH="$B/bin:$PATH" LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
run() { # name, args...
    name=$1; shift
    echo "== $name: kvxfer-bench $*" | tee -a "$OUT/bench.txt"
    timeout 60 kvxfer-bench --spawn-daemon --gpu --json "$@" >>"$OUT/bench.txt" 2>&1 ||
        echo "FAILED rc=$?" >>"$OUT/bench.txt"
}
M="--layers 32 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --pool-mib 40000"
run vllm-nhd $M --layout vllm-nhd --requests 16 --blocks 1000 --window 4
run trtllm $M --layout trtllm --requests 16 --blocks 1000 --window 4
for c in 8 16 32 64 132; do
    run "ctas-$c" $M --layout vllm-nhd --requests 16 --blocks 1000 --window 4 --ctas $c
done
run latency-1block $M --layout vllm-nhd --requests 2000 --blocks 1 --window 1
S="--layers 4 --heads 8 --head-dim 128 --tokens-per-block 16 --pool-mib 60000 --window 1"
run scale-1000 $S --requests 4 --blocks 1000
run scale-100000 $S --requests 1 --blocks 100000
run hetero-tp4-tp2 $M --ctx-ranks 4 --gen-ranks 2 --ctx-layout trtllm --gen-layout vllm-nhd --requests 16 --blocks 1000 --window 4
run same-tp2-tp2 $M --ctx-ranks 2 --gen-ranks 2 --ctx-layout vllm-nhd --gen-layout vllm-nhd --requests 16 --blocks 1000 --window 4
