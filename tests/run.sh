#!/bin/sh
# Run every test binary, then (KVX_PYTHON_TESTS=1, as make test sets) the
# Python package's tests; the last line is the total the CI reads.
BUILD=${BUILD:-build}
export KVX_BUILD=$BUILD
passed=0; failed=0
# run NAME CMD...: CMD's output without its "N passed, N failed" line,
# which is added to the totals (a run without one is a failure)
run() {
    name=$1; shift
    echo "== $name"
    out=$("$@" 2>&1); rc=$?
    echo "$out" | grep -v '^[0-9]* passed, [0-9]* failed$'
    line=$(echo "$out" | grep '^[0-9]* passed, [0-9]* failed$' | tail -n 1)
    if [ -z "$line" ]; then
        echo "FAIL $name: exited $rc without a summary"
        failed=$((failed + 1)); return
    fi
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
}
for t in "$BUILD"/tests/test_* "$BUILD"/tests/integration; do
    [ -x "$t" ] || continue
    run "$(basename "$t")" "$t"
done
if [ "${KVX_PYTHON_TESTS:-0}" = 1 ]; then
    run python "$(dirname "$0")/../scripts/test-python.sh" "$BUILD"
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
