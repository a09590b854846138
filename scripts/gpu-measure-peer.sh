#!/bin/sh
# Issue #4 on the GPU machine: two daemons on one host, GPU pools on
# GPU 0 (context) and GPU 1 (generation), host-staged through UCX; the
# baseline is the slowest of D2H, H2D and ucx_perftest on the daemons'
# transports, measured in the same run. Run from an unpacked bundle:
#   scripts/gpu-measure-peer.sh dist/kvxfer OUTDIR
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-gpu-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B . "$B/env.sh"
run() { # name, args...
    name=$1; shift
    echo "== $name: kvxfer-bench $*" | tee -a "$OUT/bench-peer.txt"
    timeout 180 kvxfer-bench --spawn-daemon --daemons 2 --json --baseline-runs 3 "$@" \
        >>"$OUT/bench-peer.txt" 2>&1 || echo "FAILED rc=$?" >>"$OUT/bench-peer.txt"
}
M="--layers 32 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --pool-mib 20000"
for i in 1 2 3; do
    run "gpu-vllm-nhd-slot4M-$i" --gpu $M --layout vllm-nhd --requests 16 --blocks 128 --window 4
done
run gpu-vllm-nhd-slot16M --gpu $M --layout vllm-nhd --requests 16 --blocks 128 --window 4 --slot-bytes 16777216
run gpu-trtllm-slot4M --gpu $M --layout trtllm --requests 16 --blocks 128 --window 4
# host pools on this 32-core host (the CPU path), 1 GiB
for i in 1 2 3; do
    run "cpu-slot4M-$i" --requests 16 --blocks 32 --window 4 --slot-bytes 4194304
    run "cpu-slot16M-$i" --requests 16 --blocks 32 --window 4 --slot-bytes 16777216
done
