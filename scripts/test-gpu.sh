#!/bin/sh
# make test-gpu: the GPU tests, or a clear skip. Works from a build tree
# (scripts/test-gpu.sh build) and from a bundle (bin/test-gpu.sh).
BUILD=${1:-build}
[ $# -gt 0 ] && shift
if [ ! -x "$BUILD/tests/gpu" ]; then
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
if [ -x "$BUILD/tests/gpu" ]; then T="$BUILD/tests/gpu"; else T="$BUILD/bin/tests/gpu"; fi
KVX_BUILD=$BUILD "$T" "$@"
