#!/bin/sh
# make test-gpu: the GPU tests, or a clear skip. Works from a build tree
# (scripts/test-gpu.sh build) and from a bundle (bin/test-gpu.sh).
# The C tests (tests/gpu), then PyTorch tensors as pools
# (tests/gpu/torch_pools.py, with and without expandable segments) where
# python3 has torch, then the kvxfer package's GPU tests (python/tests/
# test_gpu.py, from a build tree); the last line adds them up.
BUILD=${1:-build}
[ $# -gt 0 ] && shift
# a build tree has tests/gpu, a bundle bin/tests/gpu
if [ -x "$BUILD/tests/gpu" ]; then T="$BUILD/tests"; KB=$BUILD
else T="$BUILD/bin/tests"; KB="$BUILD/bin"
    # the bundle's libraries (the tests have no run path to them), and
    # its ucx_perftest (kvxfer-bench --daemons 2's baseline)
    export LD_LIBRARY_PATH="$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$(cd "$BUILD/bin" && pwd):$PATH"
fi
if [ ! -x "$T/gpu" ]; then
    echo "test-gpu: skipped: this build has no CUDA (nvcc was not found)"
    echo "0 passed, 0 failed"
    exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "test-gpu: skipped: no NVIDIA GPU or driver on this machine"
    echo "0 passed, 0 failed"
    exit 0
fi
nvidia-smi -L
passed=0; failed=0
add() { # the summary line of one run's output file
    line=$(grep '^[0-9]* passed, [0-9]* failed$' "$1" | tail -n 1)
    if [ -z "$line" ]; then failed=$((failed + 1)); return; fi
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
}
out=$(mktemp)
KVX_BUILD=$KB "$T/gpu" "$@" 2>&1 | tee "$out"
add "$out"
src=$(dirname "$0")/../tests/gpu/torch_pools.py
[ -f "$T/torch_pools.py" ] && src="$T/torch_pools.py"
if [ $# -gt 0 ]; then
    : # named C tests only
elif ! python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "test-gpu: torch tests skipped: python3 has no torch with CUDA"
elif [ ! -f "$T/libkvxtorch.so" ]; then
    echo "test-gpu: torch tests skipped: $T/libkvxtorch.so was not built"
else
    dir=$(mktemp -d)
    "$KB/kvxferd" --socket "$dir/s.sock" 2>"$dir/d.log" &
    dpid=$!
    i=0; while [ ! -S "$dir/s.sock" ] && [ $i -lt 300 ]; do sleep 0.01; i=$((i + 1)); done
    for conf in "" "expandable_segments:True"; do
        PYTORCH_CUDA_ALLOC_CONF=$conf PYTHONUNBUFFERED=1 \
            python3 "$src" "$dir/s.sock" "$T/libkvxtorch.so" >"$out" 2>&1
        cat "$out"
        add "$out"
    done
    kill "$dpid"; wait "$dpid" || { echo "FAIL kvxferd of the torch tests exited $?"; tail -20 "$dir/d.log"; failed=$((failed + 1)); }
    rm -rf "$dir"
fi
# a real transformer disaggregated through the daemon (tests/gpu/
# real_model.py): the same tokens as a colocated run, three cases
rm_src=$(dirname "$0")/../tests/gpu/real_model.py
[ -f "$T/real_model.py" ] && rm_src="$T/real_model.py"
lib="$BUILD/libkvxfer.so.2"
[ -f "$lib" ] || lib="$BUILD/lib/libkvxfer.so.2"
if [ $# -gt 0 ]; then
    : # named C tests only
elif ! python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "test-gpu: real-model test skipped: python3 has no CUDA torch or no transformers"
else
    KVXFER_LIB=$lib PYTHONUNBUFFERED=1 python3 "$rm_src" test \
        --kvxferd "$KB/kvxferd" >"$out" 2>&1
    grep -v -i warn "$out"
    add "$out"
    # the same model layer-wise through the vLLM connector's worker half
    vl_src=$(dirname "$rm_src")/vllm_layerwise.py
    KVXFER_LIB=$lib PYTHONUNBUFFERED=1 python3 "$vl_src" test \
        --kvxferd "$KB/kvxferd" >"$out" 2>&1
    grep -v -i warn "$out"
    add "$out"
fi
# the Python package's GPU tests: a build tree only (a bundle has no
# python/); they skip, saying why, without CUDA torch or CuPy
py=$(dirname "$0")/test-python.sh
if [ $# -gt 0 ] || [ ! -x "$py" ] || [ ! -x "$BUILD/tests/gpu" ]; then
    : # named C tests only, or a bundle
elif ! python3 -c 'import torch' 2>/dev/null && ! python3 -c 'import cupy' 2>/dev/null; then
    echo "test-gpu: kvxfer package tests skipped: python3 has neither torch nor cupy"
else
    "$py" "$BUILD" --gpu python/tests/test_gpu.py >"$out" 2>&1
    cat "$out"
    add "$out"
fi
rm -f "$out"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
