#!/bin/sh
# Issue #4 on the GPU machine, two daemons on one host:
#  - GPU pools on GPU 0 (context) and GPU 1 (generation), host-staged
#    through UCX; baseline: the slowest of D2H, H2D and ucx_perftest;
#  - host pools (the CPU path); baseline: ucx_perftest, the better of
#    slot-sized and piece-sized messages;
# every baseline the median of 3 ucx_perftest runs, measured in the same
# run on the daemons' transports. With PIN=1 the CPU cases run again with
# daemon A and the perftest client on CPUs 0-15, B and the server on
# 16-31. Run from an unpacked bundle:
#   scripts/gpu-measure-peer.sh dist/kvxfer OUTDIR
# Prints one line per run: GB/s, baseline, ratio, and the per-slot times
# (B received: wait/wire/scatter; A sent: wait/gather/wire, microseconds).
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-gpu-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B . "$B/env.sh"
run() { # name, args...
    name=$1; shift
    r=$(timeout 240 kvxfer-bench --spawn-daemon --daemons 2 --json \
        --baseline-runs 3 "$@" 2>&1 | tail -1)
    echo "== $name: kvxfer-bench $*" >>"$OUT/bench-peer.txt"
    echo "$r" >>"$OUT/bench-peer.txt"
    g=$(echo "$r" | grep -o '"gbps":[0-9.]*,"baseline_gbps":[0-9.]*,"ratio":[0-9.]*')
    t=$(echo "$r" | grep -o '"slot_us":{[^}]*}[^}]*}')
    echo "$name ${g:-FAILED: $r} $t"
}
M=${M:-"--layers 32 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --pool-mib 20000"}
C="--requests 16 --blocks 32 --window 4"
for i in 1 2 3; do
    run "cpu-slot4M-$i" $C --slot-bytes 4194304
    run "cpu-slot16M-$i" $C --slot-bytes 16777216
done
if [ "${PIN:-0}" = 1 ]; then
    P="--cpus-a 0-15 --cpus-b 16-31"
    for i in 1 2; do
        run "cpu-pinned-slot4M-$i" $C $P --slot-bytes 4194304
        run "cpu-pinned-slot16M-$i" $C $P --slot-bytes 16777216
    done
fi
for i in 1 2 3; do
    run "gpu-vllm-nhd-slot4M-$i" --gpu $M --layout vllm-nhd --requests 16 --blocks 128 --window 4
done
run gpu-trtllm-slot4M --gpu $M --layout trtllm --requests 16 --blocks 128 --window 4
for i in 1 2; do
    # the default (peer.slots 0: 2 slots of 16 MiB) beside 8 slots
    run "gpu-vllm-nhd-slot16M-$i" --gpu $M --layout vllm-nhd --requests 16 --blocks 128 --window 4 --slot-bytes 16777216
    run "gpu-vllm-nhd-slot16M-8slots-$i" --gpu $M --layout vllm-nhd --requests 16 --blocks 128 --window 4 --slot-bytes 16777216 --peer-config 'slots: 8'
done
