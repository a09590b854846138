#!/bin/sh
# Run every test binary; the last line is the total the CI reads.
BUILD=${BUILD:-build}
export KVX_BUILD=$BUILD
passed=0; failed=0
for t in "$BUILD"/tests/test_* "$BUILD"/tests/integration; do
    [ -x "$t" ] || continue
    echo "== $(basename "$t")"
    out=$("$t" 2>&1); rc=$?
    echo "$out" | grep -v '^[0-9]* passed, [0-9]* failed$'
    line=$(echo "$out" | grep '^[0-9]* passed, [0-9]* failed$' | tail -n 1)
    if [ -z "$line" ]; then
        echo "FAIL $(basename "$t"): exited $rc without a summary"
        failed=$((failed + 1)); continue
    fi
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
