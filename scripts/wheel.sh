#!/bin/sh
# make wheel: dist/kvxfer-VERSION-py3-none-linux_ARCH.whl, the Python
# package with libkvxfer.so.2 and the shared libraries it needs beyond
# glibc (libprotobuf-c from Debian's package), in kvxfer/_libs/, so that it
# installs with pip on a machine without our Debian packages. Then it is
# installed into a fresh virtual environment and imported there, and the
# libraries the process mapped must be the wheel's.
#   scripts/wheel.sh [BUILD] [DIST]
set -e
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DIST=${2:-dist}
PY=${PYTHON:-python3}
lib=$BUILD/libkvxfer.so.2
[ -f "$lib" ] || { echo "wheel: $lib not built (run make)" >&2; exit 1; }
stage=$BUILD/wheel-libs
rm -rf "$stage" python/build python/kvxfer.egg-info
mkdir -p "$stage" "$DIST"
cp -L "$lib" "$stage/"
# everything ldd resolves except glibc's own libraries, under the names
# the loader asks for (the sonames ldd prints)
ldd "$lib" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' |
while read -r name path; do
    case $name in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libresolv.so.*) ;;
    *) cp -L "$path" "$stage/$name"; echo "wheel: bundles $name ($path)" ;;
    esac
done
# debug info is for the build tree; the wheel carries the code
command -v strip >/dev/null && strip --strip-debug "$stage"/*
rm -f "$DIST"/kvxfer-*.whl
# a venv of its own for pip (Debian's python3 refuses pip install)
venv=$BUILD/venv-wheel
[ -x "$venv/bin/pip" ] || "$PY" -m venv "$venv"
KVXFER_BUNDLE_DIR=$PWD/$stage "$venv/bin/pip" wheel -q --no-deps \
    --disable-pip-version-check -w "$DIST" ./python
rm -rf python/build python/kvxfer.egg-info
whl=$(ls "$DIST"/kvxfer-*.whl)
echo "wheel: $whl, $(stat -c %s "$whl") bytes"
"$venv/bin/python" -m zipfile -l "$whl" | sed 's/^/  /'
# the check: a fresh venv, the wheel, import, and the wheel's libraries
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$PY" -m venv "$check/v"
"$check/v/bin/pip" install -q --disable-pip-version-check "$whl"
(cd "$check" && env -u KVXFER_LIB "$check/v/bin/python" -c '
import os, kvxfer
print("wheel: fresh venv: kvxfer.version() =", kvxfer.version())
print("wheel: library:", kvxfer.library_path())
libs = os.path.dirname(kvxfer.library_path())
maps = open("/proc/self/maps").read()
for name in os.listdir(libs):
    path = os.path.join(libs, name)
    assert path in maps, name + " was not loaded from the wheel"
    print("wheel: loaded from the wheel:", name)
')
