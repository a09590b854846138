#!/bin/sh
# The vLLM connector's layer-wise measurement, on the GPU machine from an
# unpacked bundle: the time from the prefill's last layer to the decode's
# first token, layer-wise against whole-request (the baseline, from the
# same run), through the connector's worker half
# (bin/tests/vllm_layerwise.py measure), 4,096-token prompts: the
# real-model test's model (4 layers) and the same width with 32 layers.
#   scripts/gpu-measure-layerwise.sh [dist/kvxfer] [OUTDIR]
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-gpu-out}
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B
. "$B/env.sh"
for layers in 4 32; do
    echo "== vllm_layerwise.py measure --tokens 4096 --layers $layers" |
        tee -a "$OUT/layerwise.txt"
    KVXFER_LIB=$B/lib/libkvxfer.so.2 PYTHONUNBUFFERED=1 timeout 300 \
        python3 "$B/bin/tests/vllm_layerwise.py" measure --tokens 4096 \
        --reps 9 --layers "$layers" --kvxferd "$B/bin/kvxferd" 2>&1 |
        grep -v -i warn | tee -a "$OUT/layerwise.txt"
done
