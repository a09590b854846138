#!/bin/sh
# make test-gpu: the GPU tests, or a clear skip. Works from a build tree
# (scripts/test-gpu.sh build) and from a bundle (bin/test-gpu.sh).
BUILD=${1:-build}
[ $# -gt 0 ] && shift
# a build tree has tests/gpu, a bundle bin/tests/gpu
if [ -x "$BUILD/tests/gpu" ]; then T="$BUILD/tests/gpu"; KB=$BUILD
else T="$BUILD/bin/tests/gpu"; KB="$BUILD/bin"; fi
if [ ! -x "$T" ]; then
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
KVX_BUILD=$KB "$T" "$@"
