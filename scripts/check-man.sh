#!/bin/sh
# make check-man [BUILD=build]: the man pages render and are current.
#   - man -l renders each of man/*.[158] with no warning from groff
#     (man --warnings) and a NAME section;
#   - man/kvxferd.yaml.5 is what scripts/man-yaml.py writes from the
#     built kvxferd's --print-config-table (the keys as the daemon has
#     them);
#   - each of kvxferd, kvxferctl, kvxfer-bench has its page.
set -u
BUILD=${1:-build}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! command -v man >/dev/null; then
    echo "check-man: FAIL: no man (apt-get install man-db)"
    exit 1
fi
for p in kvxferd.8 kvxferctl.1 kvxfer-bench.1 kvxferd.yaml.5; do
    [ -f "man/$p" ] || fail "man/$p missing"
done
for m in man/*.1 man/*.5 man/*.8; do
    [ -f "$m" ] || continue
    if MANWIDTH=80 man --warnings -E UTF-8 -l "$m" >"$tmp/out" 2>"$tmp/err" &&
        [ ! -s "$tmp/err" ] && grep -q '^NAME' "$tmp/out"; then
        pass "man -l $m: $(wc -l <"$tmp/out") lines, no warning"
    else
        fail "man -l $m: $(head -n 5 "$tmp/err")"
    fi
done
if "$BUILD/kvxferd" --print-config-table | scripts/man-yaml.py >"$tmp/yaml.5" &&
    cmp -s "$tmp/yaml.5" man/kvxferd.yaml.5; then
    pass "man/kvxferd.yaml.5 is current (scripts/man-yaml.py)"
else
    diff -u man/kvxferd.yaml.5 "$tmp/yaml.5" | head -n 20
    fail "man/kvxferd.yaml.5 is stale: $BUILD/kvxferd --print-config-table | scripts/man-yaml.py > man/kvxferd.yaml.5"
fi
if [ $failed -eq 0 ]; then echo "check-man: PASS"; else echo "check-man: FAIL"; fi
exit $failed
