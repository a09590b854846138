#!/bin/sh
# Build the libFuzzer targets into build/fuzz/ with clang (see README.md).
#   tests/fuzz/build.sh [frame request params config]
# Each target is compiled together with the daemon sources it does not
# include itself, all instrumented; host-only (gpu_none.c).
set -eu
cd "$(dirname "$0")/../.."
CC=${CC:-clang}
OUT=${OUT:-build/fuzz}
PKGS="libuv libprotobuf-c yaml-0.1 ucx libcrypto libmicrohttpd"
[ -f build/gen/kvxfer.pb-c.c ] || make build/gen/kvxfer.pb-c.c
mkdir -p "$OUT"
# the daemon's sources, from the Makefile (one list), host-only
SRC="$(make -s --no-print-directory print-daemon-src CUDA=0) build/gen/kvxfer.pb-c.c"
FLAGS="${FUZZ_CFLAGS:-} -g -O1 -std=gnu11 -D_GNU_SOURCE -fno-omit-frame-pointer -Itests/fuzz
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -Werror=implicit-function-declaration
       -Ibuild/gen -Iclient/include -I. -Idaemon
       $(pkg-config --cflags $PKGS)"
for t in ${*:-frame request params config peer peer_auth}; do
    # sources the target includes itself, or replaces ("fuzz-exclude:")
    inc="$(sed -n 's|^#include "\.\./\.\./\(.*\.c\)"|\1|p' "tests/fuzz/fuzz_$t.c")
         $(sed -n 's|^ \* fuzz-exclude: \(.*\)$|\1|p' "tests/fuzz/fuzz_$t.c")"
    inc=$(echo $inc)
    src=
    for s in $SRC; do
        case " $inc " in *" $s "*) ;; *) src="$src $s" ;; esac
    done
    echo "building $OUT/fuzz_$t"
    # shellcheck disable=SC2086
    $CC $FLAGS -w -o "$OUT/fuzz_$t" "tests/fuzz/fuzz_$t.c" $src \
        $(pkg-config --libs $PKGS) -lpthread
done
