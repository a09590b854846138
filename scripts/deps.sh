#!/bin/sh
# Install the Debian packages kvxfer builds against, if any is missing
# (python3-venv: make test puts pytest and numpy into a venv;
# libsystemd-dev: log.format journal).
# As root: installs them. Otherwise: prints the exact apt-get line and fails.
set -e
PKGS="build-essential pkg-config libuv1-dev libucx-dev libprotobuf-c-dev protobuf-c-compiler libyaml-dev libssl-dev libsystemd-dev libmicrohttpd-dev ucx-utils iproute2 python3 python3-venv"
# `deps.sh deb`: also what make deb and make test-deb use (debian/control's
# Build-Depends, dpkg-buildpackage, lintian, debootstrap; man-db: make
# check-man; systemd: systemd-analyze for make check-units)
DEB_PKGS="debhelper dpkg-dev fakeroot lintian debootstrap man-db systemd"
[ "${1:-}" != deb ] || PKGS="$PKGS $DEB_PKGS"
# `deps.sh ci`: also what .ci/run uses (make lint, make fuzz, make
# format-check, make deb; buildah: make test-container)
[ "${1:-}" != ci ] || PKGS="$PKGS clang libclang-rt-dev clang-format cppcheck buildah $DEB_PKGS"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    echo "deps: installing:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends $missing >/dev/null 2>&1 || {
        apt-get update >/dev/null && apt-get install -y --no-install-recommends $missing; }
else
    echo "deps: missing packages:$missing" >&2
    echo "deps: run: sudo apt-get install -y$missing" >&2
    exit 1
fi
