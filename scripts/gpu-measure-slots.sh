#!/bin/sh
# Issue 38 on the GPU machine: two daemons on one host, GPU pools, a UCX
# that moves CUDA memory (a bundle built with the libucx-cu13 wheel's
# UCX). GPU slots against host staging (gpu.staging_bytes 0), one run
# each, alternated. Each run prints its own baseline, measured in the
# same run: ucx_perftest ucp_am_bw -m cuda on the same transports with
# GPU slots, the slowest of D2H, H2D and ucx_perftest with host slots.
#   scripts/gpu-measure-slots.sh dist/kvxfer OUTDIR
# Prints one line per run: GB/s, baseline, ratio, the baseline's name,
# the bytes through GPU slots (B received, A sent) and the transports.
# MPS=1 runs each GPU case twice, alternated: without MPS, then with
# nvidia-cuda-mps-control -d (needs the right to start it; names end in
# -mps). QUICK=1 runs only the 4 MiB and 64 MiB cases, once each.
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-slots-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B . "$B/env.sh"
TLS=${TLS:-cuda_ipc,cuda_copy,tcp}
host=$OUT/host-slots.yaml
printf 'gpu:\n  staging_bytes: 0\n' >"$host"
big=$OUT/gpu-2g.yaml
printf 'gpu:\n  staging_bytes: 2GiB\n' >"$big"
mps_on() {
    export CUDA_MPS_PIPE_DIRECTORY="$OUT/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$OUT/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS would not start"; exit 1; }
}
mps_off() {
    echo quit | nvidia-cuda-mps-control
    sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
run1() { # name, args...
    name=$1; shift
    r=$(timeout 240 kvxfer-bench --spawn-daemon --gpu --gen-device 0 \
        --daemons 2 --json --ucx-tls "$TLS" "$@" 2>&1 | tail -1)
    echo "== $name: kvxfer-bench $*" >>"$OUT/bench-slots.txt"
    echo "$r" >>"$OUT/bench-slots.txt"
    g=$(echo "$r" | grep -o '"gbps":[0-9.]*,"baseline_gbps":[0-9.]*,"ratio":[0-9.]*')
    n=$(echo "$r" | grep -o '"baseline":"[^"]*"')
    s=$(echo "$r" | grep -o '"gpu_slot_bytes":{[^}]*}')
    t=$(echo "$r" | grep -o '"transports":"[^"]*"')
    echo "$name ${g:-FAILED: $r} $n $s $t"
}
run() { # name, args...: without MPS, then (MPS=1) with it
    run1 "$@"
    if [ "${MPS:-0}" = 1 ]; then
        name=$1; shift
        mps_on; run1 "$name-mps" "$@"; mps_off
    fi
}
M=${M:-"--layers 32 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --pool-mib 20000 --layout vllm-nhd"}
C="--requests 16 --blocks 128 --window 4"
if [ "${QUICK:-0}" = 1 ]; then
    run "gpu-slots-64M" $M $C --slot-bytes 67108864 --daemon-config "$big"
    run "gpu-slots-4M" $M $C
    run "host-slots-4M" $M $C --daemon-config "$host"
    exit 0
fi
for i in 1 2; do
    run "host-slots-4M-$i" $M $C --daemon-config "$host"
    run "gpu-slots-4M-$i" $M $C
    run "host-slots-64M-$i" $M $C --slot-bytes 67108864 --daemon-config "$host"
    run "gpu-slots-64M-$i" $M $C --slot-bytes 67108864 --daemon-config "$big"
done
# 16 MiB slots (a GPU slot goes as one message, whatever
# peer.message_bytes), and 64 MiB ones with 4 lanes
run "gpu-slots-16M" $M $C --slot-bytes 16777216 --daemon-config "$big"
run "gpu-slots-64M-4lanes" $M $C --slot-bytes 67108864 --daemon-config "$big" --peer-config "lanes: 4"
# a layout change (the gather and scatter reorder): trtllm -> vllm-nhd
run "gpu-slots-64M-trtllm-nhd" $M $C --ctx-layout trtllm --gen-layout vllm-nhd --slot-bytes 67108864 --daemon-config "$big"
run "host-slots-64M-trtllm-nhd" $M $C --ctx-layout trtllm --gen-layout vllm-nhd --slot-bytes 67108864 --daemon-config "$host"
# host pools (the CPU path) with this UCX, on TCP: the segment sizes the
# daemon sets for UCX 1.13 (128k/512k; no RMA lanes there) against UCX's
# own (8k/64k), which the environment's values override
[ "${CPU:-1}" = 1 ] && for i in 1 2; do
    TLS=tcp run "cpu-host-seg-kvx-$i" --requests 16 --blocks 32 --window 4 --ctx-host --gen-host
    UCX_TCP_TX_SEG_SIZE=8kb UCX_TCP_RX_SEG_SIZE=64kb TLS=tcp run "cpu-host-seg-ucx-$i" --requests 16 --blocks 32 --window 4 --ctx-host --gen-host
done
