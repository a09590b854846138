#!/bin/sh
# The code blocks of README.md, docs/python.md and docs/engines/*.md run as
# written (tests/docs/snippets.py says how, and what the doctest comments
# mean), with BUILD's kvxferd, in BUILD/venv (numpy: made as make
# test-python makes it when missing). The last line is "N passed, N
# failed".
#   scripts/test-doc-snippets.sh [BUILD] [FILE.md ...]
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
[ $# -gt 0 ] && shift
py=$BUILD/venv/bin/python
if ! "$py" -c 'import numpy' 2>/dev/null; then
    echo "test-doc-snippets: installing numpy into $BUILD/venv"
    { [ -x "$py" ] || ${PYTHON:-python3} -m venv "$BUILD/venv"; } &&
        "$py" -m pip install -q --disable-pip-version-check \
            --no-cache-dir numpy ||
        { echo "test-doc-snippets: no numpy in $BUILD/venv"; exit 1; }
fi
# docs/python.md installs the wheel that make wheel writes to dist/
if ! ls dist/kvxfer-*-manylinux_*.whl >/dev/null 2>&1; then
    echo "test-doc-snippets: no wheel in dist/: make wheel"
    ${MAKE:-make} --no-print-directory wheel >/dev/null ||
        echo "test-doc-snippets: make wheel failed; docs/python.md's install block will fail"
fi
exec "$py" tests/docs/snippets.py --build "$BUILD" "$@"
