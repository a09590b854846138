#!/bin/sh
# make UCX=wheel: PyPI's libucx-cu13 wheel (a UCX built with CUDA: the
# cuda_copy and cuda_ipc transports, cma; no InfiniBand), downloaded with
# pip and unpacked under DIR:
#   DIR/libucx/{include,lib,lib/ucx,bin}   the wheel's UCX
#   DIR/libucx_cu13.libs                   the CUDA runtime and libgomp its
#                                          modules and ucx_perftest need
#   scripts/ucx-wheel.sh [DIR]             (default build/ucx-wheel)
#   scripts/ucx-wheel.sh --version         the version it fetches
# Idempotent: a DIR that holds this version already is left as it is
# (DIR/libucx/.kvx-ok names it). Exits 3 when PyPI cannot be reached
# (no network), 1 on any other failure (a wheel whose sha256 is not the
# one known, for x86_64 only, included).
set -eu
VERSION=1.22.0
# sha256 of libucx_cu13-1.22.0-py3-none-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
SHA256_X86_64=c6e0aaa82dc6e49dc3ddaac465b530e014f48b6c1c6b5ae74fbdd199d824351b
[ "${1:-}" != --version ] || { echo "$VERSION"; exit 0; }
DIR=${1:-build/ucx-wheel}
ok="$DIR/libucx/.kvx-ok"
if [ -f "$ok" ] && [ "$(cat "$ok")" = "$VERSION" ]; then
    touch "$ok" # newer than this script: make asks no more
    exit 0
fi
tmp="$DIR/.fetch"
rm -rf "$tmp"
mkdir -p "$tmp"
# pip: python3's own, else a throw-away venv's (Debian's python3 has no
# pip; python3-venv, which scripts/deps.sh installs, brings one)
if python3 -m pip --version >/dev/null 2>&1; then
    pip="python3 -m pip"
else
    python3 -m venv "$tmp/venv" || {
        echo "ucx-wheel: no pip and no python3 -m venv (apt-get install python3-venv)" >&2
        exit 1; }
    pip="$tmp/venv/bin/python -m pip"
fi
echo "ucx-wheel: downloading libucx-cu13==$VERSION from PyPI into $DIR"
$pip download --quiet --no-deps --only-binary=:all: \
    "libucx-cu13==$VERSION" -d "$tmp/whl" || {
    rm -rf "$tmp"
    # 3 (skipped by CI) only where PyPI cannot be reached at all; a pip
    # that PyPI answers and that still fails (an old pip, no wheel for
    # this machine) is a failure
    if python3 -c 'import urllib.request as u; u.urlopen("https://pypi.org/simple/libucx-cu13/", timeout=10)' >/dev/null 2>&1; then
        echo "ucx-wheel: PyPI answers, but pip cannot download libucx-cu13==$VERSION (above)" >&2
        exit 1
    fi
    echo "ucx-wheel: cannot download libucx-cu13==$VERSION (no network to PyPI)" >&2
    exit 3; }
whl=$(ls "$tmp"/whl/libucx_cu13-"$VERSION"-*.whl)
# its checksum is known for x86_64 only: elsewhere the wheel is refused
[ "$(uname -m)" = x86_64 ] || {
    echo "ucx-wheel: no sha256 of the $(uname -m) wheel is known here; refused" >&2
    exit 1; }
sum=$(sha256sum "$whl" | cut -d' ' -f1)
[ "$sum" = "$SHA256_X86_64" ] || {
    echo "ucx-wheel: $(basename "$whl"): sha256 $sum, expected $SHA256_X86_64" >&2
    exit 1; }
python3 -m zipfile -e "$whl" "$tmp/x"
got=$(cat "$tmp/x/libucx/UCX_WHEEL_VERSION.txt")
[ "$got" = "$VERSION" ] || {
    echo "ucx-wheel: the wheel says UCX $got, expected $VERSION" >&2; exit 1; }
for f in include/ucp/api/ucp.h lib/libucp.so.0 lib/libucs.so.0 \
         lib/libuct.so.0 lib/libucm.so.0 lib/ucx bin/ucx_info bin/ucx_perftest; do
    [ -e "$tmp/x/libucx/$f" ] || {
        echo "ucx-wheel: the wheel has no libucx/$f" >&2; exit 1; }
done
# zip files keep no modes: the programs need their x bit
chmod +x "$tmp"/x/libucx/bin/*
rm -rf "$DIR/libucx" "$DIR/libucx_cu13.libs"
mv "$tmp/x/libucx" "$DIR/libucx"
[ ! -d "$tmp/x/libucx_cu13.libs" ] || mv "$tmp/x/libucx_cu13.libs" "$DIR/"
rm -rf "$tmp"
echo "$VERSION" > "$ok"
echo "ucx-wheel: UCX $VERSION in $DIR/libucx"
