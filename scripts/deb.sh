#!/bin/sh
# make deb: kvxferd, libkvxfer2, libkvxfer-dev and kvxfer-tools as .debs
# in OUT (default dist/deb), then lintian on them.
#   scripts/deb.sh [OUT]
# dpkg-buildpackage (debhelper, debian/) runs on a copy of the tree's
# files (tracked, and untracked ones git does not ignore; outside git,
# every file but build*/ and dist*/), so that the
# tree's own build folders play no part; debian/changelog is written there
# for the version of client/include/kvxfer.h, dated by the last commit.
# lintian: any error fails; warnings are printed.
set -eu
OUT=${1:-dist/deb}
version=$(sed -n 's/^#define KVX_VERSION_STRING "\(.*\)"/\1/p' client/include/kvxfer.h)
[ -n "$version" ] || { echo "deb: no KVX_VERSION_STRING in client/include/kvxfer.h" >&2; exit 1; }
for t in dpkg-buildpackage dh lintian; do
    command -v "$t" >/dev/null || {
        echo "deb: $t missing: scripts/deps.sh deb installs what make deb needs" >&2
        exit 1
    }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
src=$tmp/kvxfer-$version
mkdir -p "$src"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z -co --exclude-standard | grep -zv '^build' |
        xargs -0 cp --parents -P -t "$src" 2>/dev/null || true
else
    # no git (the Dockerfile's build, a tarball): every file but the
    # build folders and packages
    tar -c --exclude='./build*' --exclude='./dist*' --exclude=./.git . |
        tar -x -C "$src"
fi
for f in Makefile debian/rules debian/control client/include/kvxfer.h; do
    [ -e "$src/$f" ] || { echo "deb: copying the tree: $f missing" >&2; exit 1; }
done
date=$(git log -1 --format=%aD 2>/dev/null || date -R)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
cat >"$src/debian/changelog" <<EOT
kvxfer ($version) unstable; urgency=medium

  * Built from commit $commit of the kvxfer repository.

 -- kvxfer developers <kvxfer@example.org>  $date
EOT
echo "deb: building kvxfer $version (commit $commit) in $src"
(cd "$src" && dpkg-checkbuilddeps) || {
    echo "deb: missing build dependencies: scripts/deps.sh deb" >&2
    exit 1
}
if ! (cd "$src" && dpkg-buildpackage -b -us -uc -j"$(nproc)") >"$tmp/build.log" 2>&1; then
    tail -n 60 "$tmp/build.log"
    echo "deb: dpkg-buildpackage failed" >&2
    exit 1
fi
mkdir -p "$OUT"
rm -f "$OUT"/*.deb "$OUT"/*.changes "$OUT"/*.buildinfo
cp "$tmp"/*.deb "$tmp"/*.changes "$tmp"/*.buildinfo "$OUT"/
ls -l "$OUT"/*.deb
changes=$(ls "$OUT"/*.changes)
# lintian: E: fails, W:/I: are shown
lintian --fail-on error --info "$changes" >"$tmp/lintian.log" 2>&1
rc=$?
cat "$tmp/lintian.log"
if [ $rc -ne 0 ]; then
    echo "deb: lintian reports errors" >&2
    exit 1
fi
echo "deb: $(ls "$OUT"/*.deb | wc -l) packages in $OUT, lintian: no error"
