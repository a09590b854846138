#!/bin/sh
# The GPU copy kernel's figures of issue 20 in one go, on one GPU (run
# from an unpacked bundle): scripts/gpu-kernel-curve.sh dist/kvxfer OUTDIR
#
# Both pools on GPU 0 (32 layers x 8 heads x 128 dim bf16, 16 requests x
# 1000 blocks, vllm-nhd: 32 KiB runs), at 8, 16, 32 and 132 CTAs and the
# default budget, each kvxfer-bench run with its own cudaMemcpy baseline
# of the same bytes; then a layout conversion (trtllm -> vllm-nhd, 256-byte
# runs). DAEMONS="name=path ..." runs it for these kvxferd builds instead
# of the bundle's (an older tree, a variant), named in the table; CTAS
# narrows the curve, CONVERT=0 leaves the conversion out.
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-kernel-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
export PATH="$B/bin:$PATH" LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
CTAS=${CTAS:-"8 16 32 132 default"}
M="--spawn-daemon --gpu --gen-device 0 --layers 32 --heads 8 --head-dim 128
   --tokens-per-block 16 --dtype bf16 --requests 16 --blocks 1000
   --pool-mib 40000 --json"
# name, kvxferd, args...: one JSON line to bench.jsonl, one row to stdout
run() {
    name=$1 daemon=$2
    shift 2
    line=$(KVXFERD=$daemon timeout 120 kvxfer-bench $M "$@" 2>>"$OUT/bench.err")
    echo "{\"run\":\"$name $*\",\"out\":$line}" >>"$OUT/bench.jsonl" 2>/dev/null ||
        true
    printf '%-44s %s\n' "$name $*" "$(echo "$line" |
        sed -n 's/.*"gbps":\([0-9.]*\),"baseline_gbps":\([0-9.]*\),"ratio":\([0-9.]*\).*/\1 GB\/s  cudaMemcpy \2 GB\/s  ratio \3/p')"
}
for d in ${DAEMONS:-"new=$B/bin/kvxferd"}; do
    name=${d%%=*} path=${d#*=}
    for c in $CTAS; do
        if [ "$c" = default ]; then
            run "$name" "$path" --layout vllm-nhd
        else
            run "$name" "$path" --layout vllm-nhd --ctas "$c"
        fi
    done
    [ "${CONVERT:-1}" = 0 ] ||
        run "$name" "$path" --ctx-layout trtllm --gen-layout vllm-nhd
done
