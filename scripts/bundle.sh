#!/bin/sh
# make bundle: dist/kvxfer/{bin,lib,env.sh}. The libraries are taken from
# Debian's packages (apt-get download + dpkg -x), every non-glibc shared
# library the binaries need; glibc and the CUDA driver come from the node.
#   scripts/bundle.sh BUILD OUT [UCX_PREFIX [UCX_EXTRA_LIBS]]
# With UCX_PREFIX (make UCX=wheel or UCX=/prefix) the bundle carries that
# UCX instead of Debian's: its libraries, its modules (PREFIX/lib/ucx) in
# lib/ucx, its ucx_perftest and ucx_info, and every library in the folder
# UCX_EXTRA_LIBS (the wheel's libucx_cu13.libs: the CUDA runtime its
# modules need).
set -e
BUILD=${1:-build}
OUT=${2:-dist/kvxfer}
UCX_PREFIX=${3:-}
UCX_EXTRA=${4:-}
ucx_lib=""
if [ -n "$UCX_PREFIX" ]; then
    for d in "$UCX_PREFIX/lib" "$UCX_PREFIX/lib64"; do
        [ -e "$d/libucp.so.0" ] && ucx_lib=$d && break
    done
    [ -n "$ucx_lib" ] || { echo "bundle: no libucp.so.0 under $UCX_PREFIX/lib or lib64" >&2; exit 1; }
    # ldd below finds this UCX's libraries (ucx_perftest's run path may
    # name a folder that exists only where the wheel was built)
    export LD_LIBRARY_PATH="$ucx_lib${UCX_EXTRA:+:$UCX_EXTRA}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
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
# the baseline of kvxfer-bench --daemons 2 and the transports UCX sees,
# from the UCX the daemon was built with (Debian's: ucx-utils)
mkdir -p "$OUT/lib/ucx"
if [ -z "$UCX_PREFIX" ]; then
    for p in ucx_perftest ucx_info; do
        [ ! -x /usr/bin/$p ] || cp /usr/bin/$p "$OUT/bin/"
    done
    # UCX transport modules: none (tcp, shared memory and self are in the
    # core library); an empty module directory keeps UCX from loading a
    # node's own, possibly different, UCX modules
else
    for p in ucx_perftest ucx_info; do
        cp "$UCX_PREFIX/bin/$p" "$OUT/bin/"
        chmod +x "$OUT/bin/$p"
    done
    # this UCX's modules (the wheel: uct_cuda for cuda_copy and cuda_ipc,
    # ucm_cuda, uct_cma, ucx_perftest_cuda), under the names UCX opens
    for m in "$ucx_lib"/ucx/lib*.so.0; do
        [ ! -e "$m" ] || cp -L "$m" "$OUT/lib/ucx/"
    done
    for l in "$UCX_EXTRA"/*.so*; do
        [ -z "$UCX_EXTRA" ] || [ ! -e "$l" ] || cp -L "$l" "$OUT/lib/"
    done
fi
bins="$OUT/bin/kvxferd $OUT/bin/kvxferctl $OUT/bin/kvxfer-bench $OUT/bin/ucx_perftest $OUT/bin/ucx_info $(ls "$OUT"/bin/tests/* 2>/dev/null)"
libs=$(for b in $bins; do
    ldd "$b" 2>/dev/null | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so')
for b in $bins; do # not in the bundle, and the node may not have it either
    ldd "$b" 2>/dev/null | awk -v b="$(basename "$b")" '/not found/ {
        print "bundle: warning: " b " needs " $1 ", which the loader does not find here" }' >&2
done
tmp=$(mktemp -d)
for l in $libs; do
    # the UCX built with, as it is
    if [ -n "$ucx_lib" ] && { [ "${l#"$ucx_lib"/}" != "$l" ] ||
        { [ -n "$UCX_EXTRA" ] && [ "${l#"$UCX_EXTRA"/}" != "$l" ]; }; }; then
        cp -L "$l" "$OUT/lib/$(basename "$l")"
        echo "bundle: $(basename "$l") from $(dirname "$l")"
        continue
    fi
    pkg=""
    for cand in "$l" "/usr$l" "$(readlink -f "$l")" "/usr$(readlink -f "$l")"; do
        pkg=$(dpkg -S "$cand" 2>/dev/null | head -n1 | cut -d: -f1)
        [ -n "$pkg" ] && break
    done
    if [ -z "$pkg" ] && [ -n "$ucx_lib" ]; then
        # a site UCX's own dependencies (the wheel's libgomp, a CUDA
        # toolkit outside Debian's packages), from where the loader found them
        cp -L "$l" "$OUT/lib/$(basename "$l")"
        echo "bundle: $(basename "$l") from $(dirname "$l") (no Debian package owns it)"
        continue
    fi
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
# debug sections only: the bundle is carried to a GPU machine with a size
# limit (64 MiB), and symbols stay for backtraces
find "$OUT/bin" "$OUT/lib" -type f | while read -r f; do
    case $(head -c4 "$f" | od -An -c | tr -d ' ') in
    177ELF) strip --strip-debug "$f" ;;
    esac
done
cat > "$OUT/env.sh" <<'ENV'
# . dist/kvxfer/env.sh — put the bundle first on PATH and the loader path
KVX_HOME=${KVX_HOME:-$(cd "$(dirname "${BASH_SOURCE:-$0}")" && pwd)}
export PATH="$KVX_HOME/bin:$PATH"
export LD_LIBRARY_PATH="$KVX_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVX_BUILD="$KVX_HOME/bin"
# UCX's modules: the bundle's own (none for Debian's UCX, whose TCP,
# shared memory and self need none), never the node's
export UCX_MODULE_DIR="$KVX_HOME/lib/ucx"
ENV
echo "bundle: $OUT ($(du -sh "$OUT" | cut -f1))"
