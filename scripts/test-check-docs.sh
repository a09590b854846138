#!/bin/bash
# scripts/check-docs.py must fail on what it is there to catch: a copy of
# the tree's docs with one planted problem each (a stale version, a dead
# link, a section that does not exist, a file outside the repository)
# makes it exit 1 naming the line; the unchanged copy passes.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

copy() {
    rm -rf "$tmp/t"
    mkdir -p "$tmp/t"
    tar -cf - --exclude=./build --exclude=./.git --exclude=./dist . |
        tar -xf - -C "$tmp/t"
}

# expect NAME FILE TEXT WANT: append TEXT to FILE in a fresh copy; the
# check must fail and print WANT
expect() {
    local name=$1 file=$2 text=$3 want=$4 out rc=0
    copy
    printf '%s\n' "$text" >>"$tmp/t/$file"
    out=$(python3 scripts/check-docs.py --root "$tmp/t" 2>&1) || rc=$?
    if [ "$rc" = 1 ] && grep -qF -- "$want" <<<"$out"; then
        echo "ok: $name: $(grep -F -- "$want" <<<"$out" | head -n 1)"
    else
        echo "FAIL: $name: exit $rc, wanted '$want' in:"
        echo "$out"
        fail=1
    fi
}

copy
if python3 scripts/check-docs.py --root "$tmp/t" >/dev/null; then
    echo "ok: the unchanged docs pass"
else
    echo "FAIL: the unchanged docs fail"
    fail=1
fi
expect "stale daemon version" docs/operations.md \
    'It prints `kvxferd 1.0.0 (protocol 2.7, build: host-only)`.' \
    "names the release 1.0.0"
expect "stale protocol" README.md \
    'kvxferctl 3.1.0 (protocol 2.0)' "names the protocol 2.0"
expect "stale soname" docs/python.md \
    'The package loads `libkvxfer.so.1`.' "names the soname 1"
expect "stale Debian package" README.md \
    'apt install libkvxfer3' "names the Debian package 3"
expect "stale wheel" docs/python.md \
    'pip install dist/kvxfer-1.0.0-py3-none-any.whl' \
    "names the Python package 1.0.0"
expect "stale header version" docs/python.md \
    'It binds kvxfer.h (1.0).' "names kvxfer.h's version 1.0"
expect "dead file link" README.md \
    'See [the guide](docs/guide.md).' "docs/guide.md: no such file"
expect "dead anchor" README.md \
    'See [peers](docs/operations.md#peers-between-galaxies).' \
    "has no section #peers-between-galaxies"
expect "dead section reference" docs/engines/vllm.md \
    'See docs/operations.md, "Peers between galaxies".' \
    'has no section "Peers between galaxies"'
expect "file outside the repository" docs/architecture.md \
    'The rules are in DESIGN.md.' "cites a file outside the repository"
expect "missing repository path" docs/python.md \
    'Run `examples/no_such.py`.' '`examples/no_such.py`: no such file'
expect "a second benchmark table" docs/benchmarks.md \
    $'\n| a | b |\n| --- | --- |\n| 1 | 2 |' "2 tables; it keeps one table"
copy
sed -i 's/| VM | 2026-12-02 |$/| VM | last week |/' "$tmp/t/docs/benchmarks.md"
if out=$(python3 scripts/check-docs.py --root "$tmp/t" 2>&1); then
    echo "FAIL: a benchmark row without a date passes"; fail=1
elif grep -q "date 'last week' is not YYYY-MM-DD" <<<"$out"; then
    echo "ok: a benchmark row without a date: $(grep -m1 'last week' <<<"$out")"
else
    echo "FAIL: a benchmark row without a date: $out"; fail=1
fi
exit $fail
