#!/bin/sh
# make demo-router: examples/router.py on the CPU, as a test. A router, a
# prefill server and a decode server (fp32 model, host pools) move the KV
# of real prompts through BUILD's kvxferd; the last line adds up the runs'
# "N passed, N failed":
#   1. by key (Client.fetch_by_key), tokens checked against a colocated run
#   2. by params, checked likewise
#   3. --fault released (by params): the router releases the offer before
#      the decode asks; the decode reports its event's error (NOT_FOUND),
#      the blocks came back at the release
#   4. --fault wrong-key: the decode waits for a key never published; the
#      router releases the offer it left held
# torch and transformers: python3's when it has both; else Debian's
# python3-torch (CPU; with OpenBLAS, without which its matrix products
# use the reference BLAS, 20 times slower) and transformers from PyPI in
# a virtual environment, BUILD/venv-router, that sees Debian's packages.
#   scripts/demo-router.sh [BUILD] [router.py arguments...]  (then one run)
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
[ $# -gt 0 ] && shift
case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac
TRANSFORMERS="transformers==4.46.3"  # the last that takes torch 1.13
fail() { echo "demo-router: $*"; echo "0 passed, 1 failed"; exit 1; }
[ -x "$BUILD/kvxferd" ] || fail "$BUILD/kvxferd not built (run make)"

if python3 -c 'import torch, transformers' 2>/dev/null; then
    py=python3
else
    venv=$BUILD/venv-router
    py=$venv/bin/python
    pkgs="python3-torch libopenblas0-pthread python3-venv"
    missing=""
    for p in $pkgs; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null |
            grep -q "install ok installed" || missing="$missing $p"
    done
    if [ -n "$missing" ]; then
        [ "$(id -u)" = 0 ] ||
            fail "missing packages; run: sudo apt-get install -y --no-install-recommends$missing"
        echo "demo-router: installing:$missing (Debian's CPU torch)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y --no-install-recommends $missing >/dev/null 2>&1 || {
            apt-get update >/dev/null &&
                apt-get install -y --no-install-recommends $missing >/dev/null; } ||
            fail "apt-get could not install$missing"
    fi
    if ! "$py" -c 'import torch, transformers' 2>/dev/null; then
        rm -rf "$venv"
        echo "demo-router: $TRANSFORMERS into $venv"
        # Debian's python3, whose dist-packages hold python3-torch
        /usr/bin/python3 -m venv --system-site-packages "$venv" ||
            fail "cannot make a virtual environment in $venv"
        "$py" -m pip install -q --disable-pip-version-check --no-cache-dir "$TRANSFORMERS" ||
            fail "pip could not install $TRANSFORMERS into $venv"
    fi
fi

export KVXFER_LIB="$BUILD/libkvxfer.so.2" PYTHONUNBUFFERED=1
router="$py examples/router.py --device cpu --kvxferd $BUILD/kvxferd"
if [ $# -gt 0 ]; then
    exec $router "$@"
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
passed=0; failed=0
run() { # one router run; its last line counts
    echo "== router.py $*"
    t0=$(date +%s)
    timeout 600 $router "$@" 2>&1 | grep -v -i "warn" | tee "$out"
    line=$(grep '^[0-9]* passed, [0-9]* failed$' "$out" | tail -n 1)
    echo "   ($(( $(date +%s) - t0 )) s)"
    if [ -z "$line" ]; then failed=$((failed + 1)); return; fi
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
}
run --check
run --check --by params --prompts 300,45
run --fault released --by params --prompts 45
run --fault wrong-key --fetch-timeout 2 --prompts 45
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
