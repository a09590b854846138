#!/bin/sh
# make bundle: dist/kvxfer/{bin,lib,env.sh}. The libraries are taken from
# Debian's packages (apt-get download + dpkg -x), every non-glibc shared
# library the binaries need; glibc and the CUDA driver come from the node.
set -e
BUILD=${1:-build}
OUT=${2:-dist/kvxfer}
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib" "$OUT/bin/tests"
cp "$BUILD/kvxferd" "$BUILD/kvxferctl" "$BUILD/kvxfer-bench" "$OUT/bin/"
# the real file (libkvxfer.so.2.0.0) under its soname, what the loader opens
cp "$(readlink -f "$BUILD/libkvxfer.so")" "$OUT/lib/libkvxfer.so.2"
for t in gpu integration; do [ -x "$BUILD/tests/$t" ] && cp "$BUILD/tests/$t" "$OUT/bin/tests/"; done
[ -f "$BUILD/tests/libkvxtorch.so" ] && cp "$BUILD/tests/libkvxtorch.so" tests/gpu/torch_pools.py "$OUT/bin/tests/"
# the real-model test and demo, with the Python package they import
# (from bin/tests, ../../python)
if [ -d "$OUT/bin/tests" ]; then
    cp tests/gpu/real_model.py tests/gpu/vllm_layerwise.py \
        examples/paged_llama.py "$OUT/bin/tests/"
    mkdir -p "$OUT/python"
    cp -r python/kvxfer "$OUT/python/"
    rm -rf "$OUT/python/kvxfer/__pycache__" "$OUT/python/kvxfer/_libs"
fi
cp scripts/test-gpu.sh "$OUT/bin/"
# the baseline of kvxfer-bench --daemons 2 (Debian's ucx-utils)
[ -x /usr/bin/ucx_perftest ] && cp /usr/bin/ucx_perftest "$OUT/bin/"
# UCX transport modules: none (tcp, shared memory and self are in the core
# library); an empty module directory keeps UCX from loading a node's own,
# possibly different, UCX modules
mkdir -p "$OUT/lib/ucx"
libs=$(for b in "$OUT"/bin/kvxferd "$OUT"/bin/kvxferctl "$OUT"/bin/kvxfer-bench "$OUT"/bin/ucx_perftest "$OUT"/bin/tests/*; do
    ldd "$b" 2>/dev/null | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so')
tmp=$(mktemp -d)
for l in $libs; do
    pkg=""
    for cand in "$l" "/usr$l" "$(readlink -f "$l")" "/usr$(readlink -f "$l")"; do
        pkg=$(dpkg -S "$cand" 2>/dev/null | head -n1 | cut -d: -f1)
        [ -n "$pkg" ] && break
    done
    [ -n "$pkg" ] || { echo "bundle: no package owns $l" >&2; exit 1; }
    if [ ! -d "$tmp/$pkg" ]; then
        (cd "$tmp" && apt-get download "$pkg" >/dev/null 2>&1) || {
            echo "bundle: apt-get download $pkg failed" >&2; exit 1; }
        dpkg -x "$tmp"/"${pkg}"_*.deb "$tmp/$pkg"
    fi
    name=$(basename "$l")
    src=$(find "$tmp/$pkg" -name "$name" | head -n1)
    [ -n "$src" ] || { echo "bundle: $name not in $pkg" >&2; exit 1; }
    cp -L "$src" "$OUT/lib/$name"
    echo "bundle: $name from $pkg"
done
rm -rf "$tmp"
cat > "$OUT/env.sh" <<'ENV'
# . dist/kvxfer/env.sh — put the bundle first on PATH and the loader path
KVX_HOME=${KVX_HOME:-$(cd "$(dirname "${BASH_SOURCE:-$0}")" && pwd)}
export PATH="$KVX_HOME/bin:$PATH"
export LD_LIBRARY_PATH="$KVX_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVX_BUILD="$KVX_HOME/bin"
export UCX_MODULE_DIR="$KVX_HOME/lib/ucx"
ENV
echo "bundle: $OUT ($(du -sh "$OUT" | cut -f1))"
