#!/bin/sh
# examples/hello.c, the README's C example, built as a user of an
# installed kvxfer builds it: make install into a temporary prefix (as
# check-lib does), then cc with `pkg-config --cflags --libs kvxfer` of
# that prefix and nothing else, run against the installed kvxferd on a
# private socket. Prints PASS/FAIL lines; exits 1 if any failed.
#   scripts/test-hello.sh [BUILD]
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
MAKE=${MAKE:-make}
CC=${CC:-cc}
tmp=$(mktemp -d)
pid=""
cleanup() {
    [ -z "$pid" ] || kill "$pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

prefix=$tmp/prefix
$MAKE --no-print-directory BUILD="$BUILD" install PREFIX="$prefix" \
    >"$tmp/install.log" 2>&1 ||
    { tail -n 20 "$tmp/install.log"; fail "make install PREFIX=$prefix"; }
ma=$($CC -print-multiarch 2>/dev/null)
lib=$prefix/lib${ma:+/$ma}
export PKG_CONFIG_PATH="$lib/pkgconfig"
flags=$(pkg-config --cflags --libs kvxfer) ||
    fail "pkg-config --cflags --libs kvxfer in $lib/pkgconfig"
# shellcheck disable=SC2086 # flags are words
$CC -std=c11 -O2 -Wall -Wextra -Werror -o "$tmp/hello" examples/hello.c \
    $flags 2>"$tmp/cc.err" ||
    fail "cc examples/hello.c $flags: $(cat "$tmp/cc.err")"
echo "PASS: cc -std=c11 -Wall -Wextra -Werror examples/hello.c $flags"

printf 'socket:\n  path: %s/kvxferd.sock\n' "$tmp" >"$tmp/kvxferd.yaml"
"$prefix/bin/kvxferd" --config "$tmp/kvxferd.yaml" >"$tmp/kvxferd.log" 2>&1 &
pid=$!
i=0
while [ ! -S "$tmp/kvxferd.sock" ]; do
    i=$((i + 1))
    if [ $i -ge 200 ] || ! kill -0 "$pid" 2>/dev/null; then
        cat "$tmp/kvxferd.log"
        fail "the installed kvxferd did not start"
    fi
    sleep 0.05
done
if out=$(LD_LIBRARY_PATH="$lib" "$tmp/hello" "$tmp/kvxferd.sock" 2>&1); then
    echo "PASS: ./hello $tmp/kvxferd.sock: $out"
else
    cat "$tmp/kvxferd.log"
    fail "./hello: $out"
fi
loaded=$(LD_LIBRARY_PATH="$lib" ldd "$tmp/hello" | awk '$1 ~ /^libkvxfer/ { print $3 }')
case "$loaded" in
"$lib"/*) echo "PASS: it ran on the installed $loaded" ;;
*) fail "it loaded '$loaded', not the installed library" ;;
esac
