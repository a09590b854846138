#!/bin/sh
# Issue 39 on the GPU machine: what kvxfer's copies do to an engine's step
# on the same GPU, per copy path, without and with MPS, one run per case,
# alternated (scripts/gpu-engine-load.py: the engine alone, kvxfer alone,
# then both; each line carries its own baselines). Then the copy engines
# against the kernel on an idle GPU (32 KiB and 2 KiB runs) and the
# layer-wise exposed time on each path.
#   scripts/gpu-measure-share.sh dist/kvxfer OUTDIR
# PART=load (the engine cases only), PART=idle (the rest); default both.
# NOMPS and WITHMPS: the cases without and under MPS (names below; set
# empty, none);
# ROUNDS: the idle rounds (2); NOLW=1 leaves out the layer-wise runs.
# STEP=matmul or STEP=add keeps one half of the engine's step; SMI=1
# samples the SM clock and power (gpu-engine-load.py --step, --smi);
# TRACE=1 adds kvxfer-bench --trace: how long each launch's copies took
# on the GPU, alone and beside the engine.
# Cases: kernel, dma, kernel-low, dma-low, kernel-16 (16 CTAs),
# kernel-sm25 (gpu.sm_share 25), kernel-p512, dma-p512, kernel-p256
# (gpu.pace 512 or 256 MiB a millisecond, 16 MiB launches), kernel-sm10,
# kernel-p512-c64, kernel-p512-c32 (64 or 32 MiB launches), kernel-sm25-p512,
# dma-p1024, auto (gpu.copy_path auto).
# A case name ending in -seq (dma-seq, kernel-seq, mps-...) takes each
# request's blocks in order instead of shuffled: a layer's K or V of a
# request is then one run of 32 MiB on both sides. A name ending in -host
# (dma-seq-host) puts the generation side's pool in host memory: the
# copies cross PCIe (device to host) instead of staying in the GPU; one
# ending in -into (dma-seq-into) puts the context side's pool there
# instead: host to device, into the engine's GPU.
# SELF: cases without kvxfer, copies from the engine's own process and
# context (gpu-engine-load.py --self-copy, 32 GiB a pass, no MPS): self-dma
# (64 MiB cudaMemcpyAsync pieces), self-dma4 (4 MiB), self-kernel (64 MiB
# by an elementwise kernel), self-other (self-dma's copies from a second
# process: a context of its own, as kvxferd's); default none. A SELF case
# in WITHMPS (self-dma, self-other) runs it under MPS.
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-share-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B . "$B/env.sh"
HERE=$(cd "$(dirname "$0")" && pwd)
conf() { # name, gpu: lines...
    f=$OUT/$1.yaml; shift
    printf 'gpu:\n' >"$f"
    for l in "$@"; do printf '  %s\n' "$l" >>"$f"; done
    echo "$f"
}
K=$(conf kernel "copy_path: kernel")
KL=$(conf kernel-low "copy_path: kernel" "stream_priority: low")
K16=$(conf kernel-16 "copy_path: kernel" "max_ctas: 16")
KS=$(conf kernel-sm25 "copy_path: kernel" "sm_share: 25")
D=$(conf dma "copy_path: dma")
DL=$(conf dma-low "copy_path: dma" "stream_priority: low")
# gpu.pace: 16 MiB launches, at most 512 MiB a millisecond (537 GB/s)
KP=$(conf kernel-p512 "copy_path: kernel" "chunk_bytes: 16MiB" "pace: 512MiB")
DP=$(conf dma-p512 "copy_path: dma" "chunk_bytes: 16MiB" "pace: 512MiB")
KP2=$(conf kernel-p256 "copy_path: kernel" "chunk_bytes: 16MiB" "pace: 256MiB")
conf kernel-sm10 "copy_path: kernel" "sm_share: 10" >/dev/null
conf kernel-p512-c64 "copy_path: kernel" "chunk_bytes: 64MiB" "pace: 512MiB" >/dev/null
conf kernel-p512-c32 "copy_path: kernel" "chunk_bytes: 32MiB" "pace: 512MiB" >/dev/null
conf auto "copy_path: auto" >/dev/null
conf kernel-sm25-p512 "copy_path: kernel" "sm_share: 25" "chunk_bytes: 16MiB" "pace: 512MiB" >/dev/null
conf dma-p1024 "copy_path: dma" "chunk_bytes: 64MiB" "pace: 1GiB" >/dev/null
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
# 32 GiB a pass: 16 requests of 1,024 blocks of the 8B shape (2 MiB a
# block over 32 layers), shuffled block ids, 8 timed passes
M="--layers 32 --heads 8 --head-dim 128 --tokens-per-block 16 --dtype bf16 --layout vllm-nhd"
L="--spawn-daemon --gpu --gen-device 0 $M --requests 16 --blocks 1024 --window 4 --pool-mib 8192 --no-verify --passes 8${TRACE:+ --trace}"
summary() { # a JSON line of gpu-engine-load.py on stdin: its figures
    python3 -c 'import json,sys
try:
    r=json.loads(sys.stdin.read())
    s=r["slowdown"]; a=r["step_ms_alone"]
    print("step alone p50 %.3f ms p99 %.3f; slowdown p50 x%.3f p90 x%.3f p99 x%.3f; kvxfer %.1f GB/s under load, %.1f idle (%.3f); steps %d" % (a["p50"], a["p99"], s["p50"], s["p90"], s["p99"], r["kvxfer_gbps_load"], r["kvxfer_gbps_idle"], r["kvxfer_ratio"], r["steps_under_load"]))
    h = "submitted -> last copy done (thread)"
    ti, tl = r.get("trace_us_idle") or {}, r.get("trace_us_load") or {}
    if h in ti and h in tl:
        print("  copies on the GPU p50/p99 us: alone %.0f/%.0f, beside %.0f/%.0f; the daemon part beside %.0f/%.0f" % (*ti[h], *tl[h], *[v for k, v in tl.items() if k.startswith("made ->")][0]))
    for k in ("gpu_alone", "gpu_load", "gpu_copies_alone"):
        g = r.get(k)
        if g and g.get("samples"):
            n = lambda x: "n/a" if x is None else "%.0f" % x
            print("  %s: SM %s MHz, mem %s MHz, %s W, kernels %s%%, reasons %s (%d samples)" % (k, n(g["sm_mhz"]), n(g["mem_mhz"]), n(g["power_w"]), n(g["kernel_pct"]), g["reasons"], g["samples"]))
except Exception as e:
    print("FAILED", e)'
}
load() { # label (its case name, mps- first under MPS), case name
    c=${2%-host}
    c=${c%-into}
    case $2 in *-host) host=--gen-host ;; *-into) host=--ctx-host ;; *) host= ;; esac
    case $c in *-seq) sh= ;; *) sh=--shuffle ;; esac
    r=$(timeout 200 python3 "$HERE/gpu-engine-load.py" --bench "$B/bin/kvxfer-bench" \
        --label "$1${STEP:+-$STEP}" ${STEP:+--step $STEP} $([ "${SMI:-0}" = 1 ] && echo --smi) -- $L $sh $host --daemon-config "$OUT/${c%-seq}.yaml" 2>"$OUT/load-$1.err")
    echo "$r" >>"$OUT/load.jsonl"
    echo "$1 $(echo "$r" | summary)"
    [ -s "$OUT/load-$1.err" ] && tail -3 "$OUT/load-$1.err"
}
selfload() { # case, label (the case's name unless given)
    case $1 in
    self-dma) o="--piece-mib 64" ;;
    self-dma4) o="--piece-mib 4" ;;
    self-kernel) o="--piece-mib 64 --copy-kernel" ;;
    self-other) o="--piece-mib 64 --elsewhere" ;;
    *) echo "$1: no such SELF case"; return ;;
    esac
    n=${2:-$1}
    r=$(timeout 200 python3 "$HERE/gpu-engine-load.py" --self-copy 32 --passes 40 $o \
        --label "$n${STEP:+-$STEP}" ${STEP:+--step $STEP} $([ "${SMI:-0}" = 1 ] && echo --smi) 2>"$OUT/load-$n.err")
    echo "$r" >>"$OUT/load.jsonl"
    echo "$n $(echo "$r" | summary)"
    [ -s "$OUT/load-$n.err" ] && tail -3 "$OUT/load-$n.err"
}
bw() { # label, config, args...
    name=$1; cfgf=$2; shift 2
    # three passes: the first pays the pools' import and the first
    # launch; the last is the figure
    r=$(timeout 200 kvxfer-bench --spawn-daemon --gpu --gen-device 0 --json \
        --passes 3 --no-verify --daemon-config "$cfgf" "$@" 2>&1 | tail -1)
    echo "== $name: $*" >>"$OUT/idle.txt"; echo "$r" >>"$OUT/idle.txt"
    echo "$name $(echo "$r" | grep -o '"baseline_gbps":[0-9.]*') $(echo "$r" | grep -o '"pass_gbps":[^]]*]') $(echo "$r" | grep -o 'copy engines: [^)]*')"
}
if [ "${PART:-all}" != idle ]; then
    for c in ${SELF-}; do
        selfload "self-$c"
    done
    for c in ${NOMPS-kernel dma kernel-low dma-low kernel-16}; do
        load "$c" "$c"
    done
    if [ -n "$(echo ${WITHMPS-x})" ]; then
        mps_on
        for c in ${WITHMPS:-kernel dma kernel-sm25 dma-low}; do
            case $c in
            self-*) selfload "$c" "mps-$c" ;;
            *) load "mps-$c" "$c" ;;
            esac
        done
        mps_off
    fi
fi
if [ "${PART:-all}" != load ]; then
    S="$M --window 4 --pool-mib 8192 --shuffle"
    for i in $(seq "${ROUNDS:-2}"); do
        bw "kernel-32K-$i" "$K" $S --requests 16 --blocks 1024
        bw "dma-32K-$i" "$D" $S --requests 16 --blocks 1024
        bw "kernel-2K-$i" "$K" $S --tokens-per-block 1 --requests 4 --blocks 4096
        bw "dma-2K-$i" "$D" $S --tokens-per-block 1 --requests 4 --blocks 4096
        bw "kernel-32M-$i" "$K" ${S%--shuffle} --requests 16 --blocks 1024
        bw "dma-32M-$i" "$D" ${S%--shuffle} --requests 16 --blocks 1024
    done
    [ -z "$NOLW" ] && for c in kernel:$K dma:$D; do
        r=$(timeout 200 kvxfer-bench --spawn-daemon --json --gpu --gen-device 0 \
            --layerwise 1 --requests 9 --blocks 4096 --pool-mib 20000 --trace \
            --daemon-config "${c#*:}" 2>&1 | tail -1)
        echo "== layerwise ${c%%:*}" >>"$OUT/idle.txt"; echo "$r" >>"$OUT/idle.txt"
        echo "layerwise-${c%%:*} $(echo "$r" | grep -o '"exposed[a-z_]*":[0-9.]*' | tr '\n' ' ')"
    done
fi
