#!/bin/sh
# make check-lib [BUILD=build]: libkvxfer shows only its API (STYLE.md
# habit 13) and installs as an engine's build expects it.
#   - the real file, libkvxfer.so.X.Y.Z (X.Y.Z = KVX_VERSION_STRING), has
#     soname libkvxfer.so.A (A = KVX_ABI_MAJOR) and links libkvxfer.so.A,
#     libkvxfer.so to it;
#   - nm -D lists exactly the functions kvxfer.h declares KVX_EXPORT: no
#     kvx__ call, no protobuf-c kvxfer__ function, nothing else;
#   - make install into a temporary prefix, as a user that is not root,
#     lays down the file, its links (LIBDIR: lib/<multiarch>) and
#     kvxfer.pc, the configuration under PREFIX/etc and the units, and
#     writes nothing outside the prefix; pkg-config --cflags --libs kvxfer works there, a
#     program built with those flags alone links and runs, and one that
#     calls an internal kvx__ function does not link; make uninstall
#     removes every file again;
#   - a program linked against a 2.5 library (a stub of the 2.5 API with
#     2.5's version node) runs against this one: its kvx_publish,
#     kvx_fetch and kvx_reserve bind the 2.x forms,
#     kvx_publish@KVXFER_2.0; one built
#     with KVX_API_2X binds them too; a program calling a 2.x variant gets
#     a deprecation warning naming kvx_publish / kvx_fetch.
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
abi=$(sed -n 's/^#define KVX_ABI_MAJOR \([0-9]*\)/\1/p' client/include/kvxfer.h)
soname=libkvxfer.so.$abi
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
# (the KVX_API_2X block declares the 2.x forms and names the 3.0 calls
# otherwise: not what a program sees by default); a declaration whose
# name clang-format put on the next line is joined to its first
sed -e '/^#else  *\/\* KVX_API_2X \*\/$/,/^#endif \/\* KVX_API_2X \*\//d' \
    -e '/^KVX_EXPORT .*[a-z]$/{N;s/\n/ /;}' client/include/kvxfer.h \
    >"$tmp/kvxfer.h"
sed -n 's/^KVX_EXPORT .*[ *]\(kvx_[a-z0-9_]*\)(.*/\1/p' "$tmp/kvxfer.h" |
    sort -u >"$tmp/declared"
# a function kvxfer.h declares without KVX_EXPORT would be hidden
grep -E '^[A-Za-z_].*[ *]kvx_[a-z0-9_]+\(' "$tmp/kvxfer.h" |
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
# As a user that is not root, straight into a prefix it owns (no DESTDIR):
# every file lands under the prefix (the GNU directory variables:
# SYSCONFDIR, the units, LIBDIR multiarch), nothing outside it is needed.
# As root the install runs as nobody; a user that is not root runs it as
# itself.
prefix=$tmp/prefix
mkdir -p "$prefix"
ma=$($CC -print-multiarch 2>/dev/null)
lib=$prefix/lib${ma:+/$ma}
as_user=""
if [ "$(id -u)" = 0 ]; then
    chown nobody "$prefix" && chmod 755 "$tmp" &&
        as_user="setpriv --reuid=nobody --regid=$(id -g nobody) --clear-groups"
fi
# shellcheck disable=SC2086 # as_user is words
if $as_user $MAKE --no-print-directory BUILD="$BUILD" install \
        PREFIX="$prefix" >"$tmp/install.log" 2>&1; then
    pass "make install PREFIX=$prefix${as_user:+ as nobody}"
else
    tail -n 40 "$tmp/install.log"
    fatal "make install PREFIX=$prefix${as_user:+ as nobody}"
fi
# what a make install under DESTDIR writes: only paths below DESTDIR$prefix
if $MAKE --no-print-directory BUILD="$BUILD" install DESTDIR="$tmp/stage" \
        PREFIX="$prefix" >"$tmp/stage.log" 2>&1; then
    (cd "$tmp/stage" && find . ! -type d | sed 's|^\.||') | sort >"$tmp/staged"
    grep -v "^$prefix/" "$tmp/staged" >"$tmp/outside"
    if [ -s "$tmp/outside" ]; then
        fail "make install PREFIX=$prefix writes outside the prefix: $(some "$tmp/outside")"
    else
        pass "make install DESTDIR=… PREFIX=$prefix: all $(wc -l <"$tmp/staged") files under the prefix"
    fi
else
    tail -n 20 "$tmp/stage.log"
    fail "make install DESTDIR=$tmp/stage PREFIX=$prefix"
fi
# the secret the unit's LoadCredential= reads: 32 random bytes, 0600
if [ "$(stat -c %a:%s "$prefix/etc/kvxfer/peer.secret" 2>/dev/null)" = 600:32 ]; then
    pass "installed etc/kvxfer/peer.secret (0600, 32 bytes)"
else
    fail "etc/kvxfer/peer.secret: $(stat -c 'mode %a, %s bytes' "$prefix/etc/kvxfer/peer.secret" 2>&1)"
fi
if [ -e "$tmp/stage$prefix/etc/kvxfer/peer.secret" ]; then
    fail "make install DESTDIR=… writes a secret (a package would carry it)"
else
    pass "make install DESTDIR=… writes no secret"
fi
for f in "bin/kvxferd" "etc/kvxfer/kvxferd.yaml" "include/kvxfer.h" \
    "lib/systemd/system/kvxferd.service" "lib/systemd/system/kvxferd.socket" \
    "lib/sysusers.d/kvxfer.conf" "lib${ma:+/$ma}/pkgconfig/kvxfer.pc"; do
    if [ -f "$prefix/$f" ]; then pass "installed $f"
    else fail "$f not installed under $prefix"; fi
done
# the unit runs the installed daemon on the installed configuration
want="ExecStart=$prefix/bin/kvxferd --config $prefix/etc/kvxfer/kvxferd.yaml"
if grep -qxF "$want" "$prefix/lib/systemd/system/kvxferd.service"; then
    pass "kvxferd.service: $want"
else
    fail "kvxferd.service: no line '$want': $(grep '^ExecStart' "$prefix/lib/systemd/system/kvxferd.service")"
fi
if "$prefix/bin/kvxferd" --check-config --config "$prefix/etc/kvxfer/kvxferd.yaml" \
        >"$tmp/check.log" 2>&1; then
    pass "the installed kvxferd accepts the installed kvxferd.yaml"
else
    fail "kvxferd --check-config on the installed yaml: $(cat "$tmp/check.log")"
fi
if [ -f "$lib/$real" ] && [ ! -L "$lib/$real" ]; then pass "installed ${lib#"$prefix/"}/$real"
else fail "${lib#"$prefix/"}/$real not installed as a plain file"; fi
for l in "$soname:$real" "libkvxfer.so:$soname"; do
    link=${l%%:*} want=${l#*:}
    got=$(readlink "$lib/$link")
    if [ "$got" = "$want" ]; then pass "installed ${lib#"$prefix/"}/$link -> $want"
    else fail "installed ${lib#"$prefix/"}/$link -> '$got', expected a link to $want"; fi
done
# PREFIX=/usr: the configuration in /etc, the units where systemd.pc says
dirs=$($MAKE --no-print-directory -s BUILD="$BUILD" print-install-dirs PREFIX=/usr)
unitdir=$(pkg-config --variable=systemdsystemunitdir systemd 2>/dev/null)
case "$dirs" in
*"SYSCONFDIR=/etc
"*) pass "PREFIX=/usr: SYSCONFDIR=/etc" ;;
*) fail "PREFIX=/usr: SYSCONFDIR is not /etc: $dirs" ;;
esac
if [ -z "$unitdir" ] || echo "$dirs" | grep -qxF "SYSTEMDUNITDIR=$unitdir"; then
    pass "PREFIX=/usr: SYSTEMDUNITDIR=${unitdir:-(no systemd.pc: the default)}"
else
    fail "PREFIX=/usr: SYSTEMDUNITDIR is not pkg-config's $unitdir: $dirs"
fi
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

# --- programs built against 2.x ------------------------------------------
# kvx_publish, kvx_fetch and kvx_reserve changed their signature in 3.0;
# their 2.x forms keep their 2.x version. A program linked against 2.5 (here: a stub
# library with 2.5's soname and version node, as the 2.5 library had)
# references kvx_publish@KVXFER_2.0; run against this library, with every
# symbol bound at start, it must find them.
cat >"$tmp/stub25.c" <<'EOF'
#include <stdint.h>
int kvx_publish(void *c, uint64_t id, uint32_t pool, const uint32_t *b,
                uint32_t nb, uint32_t nt, void *params, int t)
{ return 0; }
int kvx_fetch(void *c, uint64_t id, const uint8_t *p, unsigned long pl,
              uint32_t pool, const uint32_t *b, uint32_t nb, uint32_t skip,
              int t)
{ return 0; }
int kvx_reserve(void *c, const char *inst, const void *k, unsigned long kl,
                uint32_t nt, void *params, int t)
{ return 0; }
const char *kvx_status_name(int s) { return "stub"; }
EOF
printf 'KVXFER_2.0 { global: kvx_[a-z]*; local: *; };\n' >"$tmp/stub25.map"
cat >"$tmp/old.c" <<'EOF'
#include <stdint.h>
#include <stdio.h>
/* what kvxfer.h 2.5 declared */
int kvx_publish(void *c, uint64_t id, uint32_t pool, const uint32_t *b,
                uint32_t nb, uint32_t nt, void *params, int t);
int kvx_fetch(void *c, uint64_t id, const uint8_t *p, unsigned long pl,
              uint32_t pool, const uint32_t *b, uint32_t nb, uint32_t skip,
              int t);
int kvx_reserve(void *c, const char *inst, const void *k, unsigned long kl,
                uint32_t nt, void *params, int t);
const char *kvx_status_name(int s);
int main(void)
{
    /* no client: the 2.x forms refuse it, INVALID */
    int a = kvx_publish(NULL, 42, 1, NULL, 0, 7, NULL, 100);
    int b = kvx_fetch(NULL, 42, NULL, 0, 1, NULL, 0, 0, 100);
    int r = kvx_reserve(NULL, "i", "k", 1, 7, NULL, 100);
    printf("%s %s %s\n", kvx_status_name(a), kvx_status_name(b),
           kvx_status_name(r));
    return !(a == -1 && b == -1 && r == -1);
}
EOF
mkdir -p "$tmp/stub"
if $CC -shared -fPIC -o "$tmp/stub/$soname" "$tmp/stub25.c" \
        -Wl,-soname,"$soname" -Wl,--version-script="$tmp/stub25.map" \
        2>"$tmp/cc.err" &&
    ln -sf "$soname" "$tmp/stub/libkvxfer.so" &&
    $CC -o "$tmp/old" "$tmp/old.c" -L"$tmp/stub" -lkvxfer 2>>"$tmp/cc.err"; then
    refs=$(readelf --dyn-syms -W "$tmp/old" |
        awk '/UND kvx_(publish|fetch|reserve)@/ { print $8 }' | sort |
        tr '\n' ' ')
    if [ "$refs" = "kvx_fetch@KVXFER_2.0 kvx_publish@KVXFER_2.0 kvx_reserve@KVXFER_2.0 " ]; then
        pass "a program linked against 2.5 needs $refs"
    else
        fail "a program linked against 2.5 needs '$refs'"
    fi
    if out=$(LD_BIND_NOW=1 LD_LIBRARY_PATH="$lib" "$tmp/old" 2>&1); then
        pass "it runs against $real (LD_BIND_NOW), its 2.x calls answering $out"
    else
        fail "a 2.5 program against $real: $out"
    fi
else
    fail "building the 2.5 stub and program: $(cat "$tmp/cc.err")"
fi
# built now, with KVX_API_2X: the 2.x forms, bound to their 2.x symbols
cat >"$tmp/api2x.c" <<'EOF'
#include <kvxfer.h>
int main(void)
{
    int a = kvx_publish(NULL, 42, 1, NULL, 0, 7, NULL, 100);
    int b = kvx_fetch(NULL, 42, NULL, 0, 1, NULL, 0, 0, 100);
    int r = kvx_reserve(NULL, "i", "k", 1, 7, NULL, 100);
    return !(a == KVX_ERR_INVALID && b == KVX_ERR_INVALID &&
             r == KVX_ERR_INVALID);
}
EOF
# shellcheck disable=SC2086
if $CC -Wall -Werror -DKVX_API_2X -DKVX_ALLOW_DEPRECATED -o "$tmp/api2x" \
        "$tmp/api2x.c" $flags 2>"$tmp/cc.err" &&
    readelf --dyn-syms -W "$tmp/api2x" | grep -q 'UND kvx_publish@KVXFER_2.0' &&
    readelf --dyn-syms -W "$tmp/api2x" | grep -q 'UND kvx_reserve@KVXFER_2.0' &&
    LD_BIND_NOW=1 LD_LIBRARY_PATH="$lib" "$tmp/api2x"; then
    pass "KVX_API_2X: kvx_publish, kvx_fetch, kvx_reserve bind kvx_*@KVXFER_2.0 and run"
else
    fail "KVX_API_2X program: $(cat "$tmp/cc.err")"
fi
# a 2.x variant warns, naming its replacement; KVX_ALLOW_DEPRECATED quiets it
cat >"$tmp/dep.c" <<'EOF'
#include <kvxfer.h>
int main(void)
{
    return kvx_fetch_key(NULL, "k", 1, NULL, 0, 1, NULL, 0, 0, 0, 100) !=
           KVX_ERR_INVALID;
}
EOF
# shellcheck disable=SC2086
$CC -Wall -o "$tmp/dep" "$tmp/dep.c" $flags >"$tmp/dep.err" 2>&1
if grep -q "deprecated.*use kvx_fetch" "$tmp/dep.err"; then
    pass "kvx_fetch_key warns: $(grep -o "is deprecated.*" "$tmp/dep.err" | head -n 1)"
else
    fail "kvx_fetch_key does not warn as deprecated: $(cat "$tmp/dep.err")"
fi
# shellcheck disable=SC2086
if $CC -Wall -Werror -DKVX_ALLOW_DEPRECATED -o "$tmp/dep" "$tmp/dep.c" $flags \
        2>"$tmp/cc.err" && LD_LIBRARY_PATH="$lib" "$tmp/dep"; then
    pass "with KVX_ALLOW_DEPRECATED it builds under -Werror and runs"
else
    fail "KVX_ALLOW_DEPRECATED: $(cat "$tmp/cc.err")"
fi

# --- make uninstall ---------------------------------------------------------
# (it keeps the configuration, which may hold the operator's edits)
if $MAKE --no-print-directory BUILD="$BUILD" uninstall DESTDIR= \
        PREFIX="$prefix" >"$tmp/uninstall.log" 2>&1; then
    find "$prefix" ! -type d ! -path "$prefix/etc/kvxfer/kvxferd.yaml" \
        ! -path "$prefix/etc/kvxfer/peer.secret" >"$tmp/left"
    if [ -s "$tmp/left" ]; then fail "make uninstall left: $(some "$tmp/left")"
    else pass "make uninstall removed every file but etc/kvxfer/kvxferd.yaml and peer.secret"; fi
else
    tail -n 20 "$tmp/uninstall.log"
    fail "make uninstall PREFIX=$prefix"
fi

if [ $failed -eq 0 ]; then echo "check-lib: PASS"; else echo "check-lib: FAIL"; fi
exit $failed
