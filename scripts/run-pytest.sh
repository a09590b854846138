#!/bin/sh
# Run pytest with PY against BUILD's kvxferd and libkvxfer.so.2 and print
# "N passed, N failed" last, counted from pytest's JUnit XML; pytest's own
# exit status decides as well (5, no test collected, is a failure);
# skipped tests are named above it and count as neither. What
# scripts/test-python.sh (make test-python, test-vllm, test-gpu) and
# scripts/test-sglang.sh run once their environment is ready.
#   scripts/run-pytest.sh BUILD PY NAME [pytest arguments...]
# NAME labels the messages and the XML file (BUILD/pytest-NAME.xml).
BUILD=$1 py=$2 name=$3
shift 3
xml=$BUILD/pytest-$name.xml
rm -f "$xml"
KVX_BUILD=$BUILD KVXFER_LIB=$PWD/$BUILD/libkvxfer.so.2 PYTHONDONTWRITEBYTECODE=1 \
    "$py" -m pytest -p no:cacheprovider -rs -q --junitxml="$xml" "$@"
rc=$?
counts=$("$py" - "$xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 0"); sys.exit()
suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
t = f = s = 0
for x in suites:
    t += int(x.get("tests", 0)); s += int(x.get("skipped", 0))
    f += int(x.get("failures", 0)) + int(x.get("errors", 0))
print(t - f - s, f, s)
PY
)
set -- $counts
passed=$1; failed=$2; skipped=$3
case $rc in
0) ;;
5) echo "$name: FAIL: pytest collected no tests (exit 5)"; failed=$((failed + 1)) ;;
*) [ "$failed" -gt 0 ] || { echo "$name: FAIL: pytest exited $rc"; failed=1; } ;;
esac
[ "$skipped" = 0 ] || echo "$name: $skipped skipped (reasons above)"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
