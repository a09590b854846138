#!/bin/sh
# The vLLM connector's layer-wise measurement, on the GPU machine from an
# unpacked bundle: the time from the prefill's last layer to the decode's
# first token, layer-wise against whole-request (the baseline, from the
# same run), through the connector's worker half
# (bin/tests/vllm_layerwise.py measure), 4,096-token prompts: the
# real-model test's model and wider/deeper shapes, one daemon and two
# (below).
#   scripts/gpu-measure-layerwise.sh [dist/kvxfer] [OUTDIR]
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-gpu-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B
. "$B/env.sh"
# the test model (4 layers), 32 layers of its width, and Llama-3-8B's
# shape (32 layers, hidden 4096, 32 heads, 8 KV heads of 128), on one
# daemon; then the 8B shape with the decode on a daemon of its own (a
# transfer between daemons, UCX on 127.0.0.1)
B8="--layers 32 --hidden 4096 --heads 32 --kv-heads 8"
for shape in "--layers 4" "--layers 32" "$B8" "$B8 --daemons 2"; do
    echo "== vllm_layerwise.py measure --tokens 4096 $shape" |
        tee -a "$OUT/layerwise.txt"
    # shellcheck disable=SC2086 # $shape is the options, split
    KVXFER_LIB=$B/lib/libkvxfer.so.2 PYTHONUNBUFFERED=1 timeout 300 \
        python3 "$B/bin/tests/vllm_layerwise.py" measure --tokens 4096 \
        --reps 9 $shape --kvxferd "$B/bin/kvxferd" 2>&1 |
        grep -v -i warn | tee -a "$OUT/layerwise.txt"
done
