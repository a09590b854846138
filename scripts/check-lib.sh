#!/bin/sh
# make check-lib [BUILD=build]: libkvxfer shows only its API (STYLE.md
# habit 13) and installs as an engine's build expects it.
#   - the real file, libkvxfer.so.X.Y.Z (X.Y.Z = KVX_VERSION_STRING), has
#     soname libkvxfer.so.X and links libkvxfer.so.X, libkvxfer.so to it;
#   - nm -D lists exactly the functions kvxfer.h declares KVX_EXPORT: no
#     kvx__ call, no protobuf-c kvxfer__ function, nothing else;
#   - make install into a temporary prefix lays down the file, its links
#     and kvxfer.pc; pkg-config --cflags --libs kvxfer works there, a
#     program built with those flags alone links and runs, and one that
#     calls an internal kvx__ function does not link; make uninstall
#     removes every file again.
# Prints PASS/FAIL lines; exits 1 if any check failed.
set -u
BUILD=${1:-build}
MAKE=${MAKE:-make}
CC=${CC:-cc}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
# a failure the later checks cannot go on from
fatal() { echo "FAIL: $*"; echo "check-lib: FAIL"; exit 1; }
# the first lines of a list, on one line
some() { head -n 20 "$1" | tr '\n' ' '; [ "$(wc -l <"$1")" -le 20 ] || echo "..."; }

version=$(sed -n 's/^#define KVX_VERSION_STRING "\(.*\)"/\1/p' client/include/kvxfer.h)
real=libkvxfer.so.$version
soname=libkvxfer.so.${version%%.*}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! $MAKE --no-print-directory BUILD="$BUILD" all >"$tmp/build.log" 2>&1; then
    tail -n 40 "$tmp/build.log"
    fatal "make BUILD=$BUILD all"
fi
pass "make BUILD=$BUILD all"

# --- the built library --------------------------------------------------
if [ -f "$BUILD/$real" ] && [ ! -L "$BUILD/$real" ]; then
    pass "$BUILD/$real is the real file"
else
    fatal "$BUILD/$real missing or not a plain file"
fi
got=$(readelf -d "$BUILD/$real" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
if [ "$got" = "$soname" ]; then pass "soname $soname"
else fail "soname is '$got', expected $soname"; fi
for l in "$soname:$real" "libkvxfer.so:$soname"; do
    link=${l%%:*} want=${l#*:}
    got=$(readlink "$BUILD/$link")
    if [ "$got" = "$want" ]; then pass "$BUILD/$link -> $want"
    else fail "$BUILD/$link -> '$got', expected a link to $want"; fi
done

# Exported: every defined dynamic symbol but the version node (an
# absolute symbol named after it); nm may append @@VERSION to names.
nm -D --defined-only "$BUILD/$real" |
    awk '!($2 == "A" && $3 ~ /^KVXFER_/) { sub(/@.*/, "", $3); print $3 }' |
    sort -u >"$tmp/exported"
sed -n 's/^KVX_EXPORT .*[ *]\(kvx_[a-z0-9_]*\)(.*/\1/p' client/include/kvxfer.h |
    sort -u >"$tmp/declared"
# a function kvxfer.h declares without KVX_EXPORT would be hidden
grep -E '^[A-Za-z_].*[ *]kvx_[a-z0-9_]+\(' client/include/kvxfer.h |
    grep -v '^KVX_EXPORT ' >"$tmp/unmarked"
grep -v '^kvx_[a-z0-9]' "$tmp/exported" >"$tmp/foreign"
comm -23 "$tmp/declared" "$tmp/exported" >"$tmp/missing"
comm -13 "$tmp/declared" "$tmp/exported" | grep '^kvx_[a-z0-9]' >"$tmp/extra"
n=$(wc -l <"$tmp/exported")
if [ -s "$tmp/foreign" ]; then
    fail "$real exports $(wc -l <"$tmp/foreign") symbols that are not kvx_*: $(some "$tmp/foreign")"
elif [ ! -s "$tmp/declared" ]; then
    fail "no KVX_EXPORT declarations found in client/include/kvxfer.h"
else
    pass "nm -D --defined-only $real: $n symbols, all kvx_*"
fi
[ -s "$tmp/missing" ] &&
    fail "declared KVX_EXPORT in kvxfer.h but not exported: $(some "$tmp/missing")"
[ -s "$tmp/extra" ] &&
    fail "exported but not declared KVX_EXPORT in kvxfer.h: $(some "$tmp/extra")"
[ -s "$tmp/unmarked" ] &&
    fail "declared in kvxfer.h without KVX_EXPORT (hidden): $(some "$tmp/unmarked")"
[ -s "$tmp/missing" ] || [ -s "$tmp/extra" ] || [ -s "$tmp/unmarked" ] ||
    pass "exported = the $(wc -l <"$tmp/declared") KVX_EXPORT functions of kvxfer.h"
if readelf -V "$BUILD/$real" | grep -q 'Name: KVXFER_'; then
    pass "symbols versioned (client/libkvxfer.map)"
else
    fail "no KVXFER_ version definition: was client/libkvxfer.map passed?"
fi

# --- make install ---------------------------------------------------------
# Staged under DESTDIR (install also writes DESTDIR/etc), then moved to
# PREFIX, as a package manager would unpack it.
prefix=$tmp/prefix
if $MAKE --no-print-directory BUILD="$BUILD" install DESTDIR="$tmp/stage" \
        PREFIX="$prefix" >"$tmp/install.log" 2>&1 &&
    mv "$tmp/stage$prefix" "$prefix"; then
    pass "make install PREFIX=$prefix"
else
    tail -n 40 "$tmp/install.log"
    fatal "make install PREFIX=$prefix"
fi
lib=$prefix/lib
if [ -f "$lib/$real" ] && [ ! -L "$lib/$real" ]; then pass "installed lib/$real"
else fail "lib/$real not installed as a plain file"; fi
for l in "$soname:$real" "libkvxfer.so:$soname"; do
    link=${l%%:*} want=${l#*:}
    got=$(readlink "$lib/$link")
    if [ "$got" = "$want" ]; then pass "installed lib/$link -> $want"
    else fail "installed lib/$link -> '$got', expected a link to $want"; fi
done

export PKG_CONFIG_PATH="$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
if flags=$(pkg-config --cflags --libs kvxfer 2>"$tmp/pc.err"); then
    pass "pkg-config --cflags --libs kvxfer: $flags"
else
    fatal "pkg-config --cflags --libs kvxfer: $(cat "$tmp/pc.err")"
fi
got=$(pkg-config --modversion kvxfer)
if [ "$got" = "$version" ]; then pass "pkg-config --modversion kvxfer: $got"
else fail "pkg-config --modversion kvxfer is '$got', expected $version"; fi
if got=$(pkg-config --static --libs kvxfer 2>"$tmp/pc.err"); then
    pass "pkg-config --static --libs kvxfer: $got"
else
    fail "pkg-config --static --libs kvxfer: $(cat "$tmp/pc.err")"
fi

# A program built from the pkg-config flags alone, run against the
# installed library (not the build dir's).
cat >"$tmp/use.c" <<'EOF'
#include <kvxfer.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    const char *s = kvx_status_str(KVX_ERR_AUTH);
    puts(s);
    return strcmp(s, "capability token mismatch") != 0;
}
EOF
# shellcheck disable=SC2086 # flags are words
if $CC -o "$tmp/use" "$tmp/use.c" $flags 2>"$tmp/cc.err"; then
    pass "cc use.c \$(pkg-config --cflags --libs kvxfer)"
    if readelf -d "$tmp/use" | grep -q "NEEDED.*\[$soname\]"; then
        pass "the program needs $soname"
    else
        fail "the program does not record NEEDED $soname"
    fi
    loaded=$(LD_LIBRARY_PATH="$lib" ldd "$tmp/use" | awk '$1 == "'"$soname"'" { print $3 }')
    if out=$(LD_LIBRARY_PATH="$lib" "$tmp/use" 2>&1) &&
        [ "$loaded" = "$lib/$soname" ]; then
        pass "runs with LD_LIBRARY_PATH=$lib: kvx_status_str(KVX_ERR_AUTH) = \"$out\""
    else
        fail "run with LD_LIBRARY_PATH=$lib (loaded '$loaded'): $out"
    fi
else
    fail "cc use.c \$(pkg-config --cflags --libs kvxfer): $(cat "$tmp/cc.err")"
fi

# The internal calls must not link through the shared library.
cat >"$tmp/internal.c" <<'EOF'
int kvx__layout_check(void);
int main(void) { return kvx__layout_check(); }
EOF
# shellcheck disable=SC2086
if $CC -o "$tmp/internal" "$tmp/internal.c" $flags >/dev/null 2>&1; then
    fail "a program calling kvx__layout_check links against the installed $real"
else
    pass "kvx__layout_check does not link through -lkvxfer"
fi

# --- make uninstall ---------------------------------------------------------
if $MAKE --no-print-directory BUILD="$BUILD" uninstall DESTDIR= \
        PREFIX="$prefix" >"$tmp/uninstall.log" 2>&1; then
    find "$prefix" ! -type d >"$tmp/left"
    if [ -s "$tmp/left" ]; then fail "make uninstall left: $(some "$tmp/left")"
    else pass "make uninstall removed every file"; fi
else
    tail -n 20 "$tmp/uninstall.log"
    fail "make uninstall PREFIX=$prefix"
fi

if [ $failed -eq 0 ]; then echo "check-lib: PASS"; else echo "check-lib: FAIL"; fi
exit $failed
