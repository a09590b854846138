#!/bin/sh
# clang-format (the checked-in .clang-format) on the lines changed since a
# base, not on whole files: the existing code is not fully formatted.
#   scripts/check-format.sh [BASE]
# BASE defaults to the merge-base with origin/main when that ref exists
# (HEAD~1 when that is HEAD itself, i.e. on main), else HEAD~1. Compares
# the working tree with BASE. Fails, printing the diff clang-format would
# apply, when that diff is not empty.
#
# Not `git clang-format --diff BASE`: it diffs without rename detection, so
# a moved file counts as changed on every line (dd284a1, the move to one
# folder per layer, would fail on 7000 lines of diff).
# `git diff -M` feeds clang-format-diff the same changed lines, renames
# excepted; both tools come with Debian's clang-format package.
set -eu
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
    base=$1
elif git rev-parse -q --verify origin/main >/dev/null; then
    base=$(git merge-base origin/main HEAD)
    [ "$base" != "$(git rev-parse HEAD)" ] || base=HEAD~1
else
    base=HEAD~1
fi
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
    echo "format-check: base $base not found (a shallow clone? fetch more history)" >&2
    exit 2
fi
if ! command -v clang-format-diff >/dev/null; then
    echo "format-check: clang-format-diff not found (Debian package clang-format)" >&2
    exit 2
fi
out=$(git diff -M -U0 --no-color "$base" -- '*.c' '*.h' '*.cu' |
      clang-format-diff -p1 -iregex '.*\.(c|h|cu)')
if [ -n "$out" ]; then
    printf '%s\n' "$out"
    echo "format-check: lines changed since $(git rev-parse --short "$base") are not formatted (diff above; apply it with: scripts/check-format.sh | patch -p0)"
    exit 1
fi
echo "format-check: lines changed since $(git rev-parse --short "$base") are formatted"
