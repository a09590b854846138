#!/bin/sh
# make check-units [BUILD=build]: the systemd units as make install writes
# them.
#   - systemd-analyze verify passes on kvxferd.service and kvxferd.socket
#     (installed into a temporary prefix, so that ExecStart= names a
#     daemon that exists);
#   - systemd-analyze security --offline rates kvxferd.service (as
#     installed with PREFIX=/usr) at MAX_EXPOSURE or lower (default 2.5,
#     "OK"), and it runs as User=kvxfer with an empty
#     CapabilityBoundingSet=;
#   - the socket is root:kvxfer 0660 (SocketGroup=kvxfer, SocketMode=0660).
# Skips, saying so, where systemd-analyze is missing.
set -u
BUILD=${1:-build}
MAKE=${MAKE:-make}
MAX_EXPOSURE=${MAX_EXPOSURE:-2.5}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
if ! command -v systemd-analyze >/dev/null; then
    echo "check-units: SKIP: no systemd-analyze (apt-get install systemd)"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

prefix=$tmp/prefix
if ! $MAKE --no-print-directory BUILD="$BUILD" install PREFIX="$prefix" \
        >"$tmp/install.log" 2>&1 ||
    ! $MAKE --no-print-directory BUILD="$BUILD" install PREFIX=/usr \
        DESTDIR="$tmp/stage" >>"$tmp/install.log" 2>&1; then
    tail -n 30 "$tmp/install.log"
    echo "FAIL: make install"
    echo "check-units: FAIL"
    exit 1
fi
units=$prefix/lib/systemd/system
# any line verify prints is a problem (an unknown key is only a warning
# to it), but for "sysinit.target not found" where no systemd runs
(cd "$units" && systemd-analyze verify kvxferd.service kvxferd.socket) \
    >"$tmp/verify.log" 2>&1
grep -v 'Unit sysinit.target not found' "$tmp/verify.log" >"$tmp/verify.bad"
if [ -s "$tmp/verify.bad" ]; then
    fail "systemd-analyze verify: $(cat "$tmp/verify.bad")"
else
    pass "systemd-analyze verify kvxferd.service kvxferd.socket: no warning"
fi

unitdir=$(cd "$tmp/stage" && find . -name kvxferd.service | head -n 1)
unitdir=$tmp/stage/$(dirname "$unitdir")
(cd "$unitdir" && systemd-analyze security --offline=true kvxferd.service) \
    >"$tmp/security.log" 2>&1
level=$(sed -n 's/.*Overall exposure level for kvxferd.service: \([0-9.]*\).*/\1/p' \
    "$tmp/security.log")
if [ -z "$level" ]; then
    fail "systemd-analyze security: no level: $(tail -n 5 "$tmp/security.log")"
elif awk -v l="$level" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(l <= m) }'; then
    pass "systemd-analyze security --offline kvxferd.service: $level (at most $MAX_EXPOSURE)"
else
    grep '✗' "$tmp/security.log"
    fail "systemd-analyze security: $level, over $MAX_EXPOSURE"
fi
svc=$unitdir/kvxferd.service
sock=$unitdir/kvxferd.socket
for l in "User=kvxfer" "Group=kvxfer" "CapabilityBoundingSet=" \
    "LoadCredential=peer.secret:/etc/kvxfer/peer.secret" \
    "ExecStart=/usr/bin/kvxferd --config /etc/kvxfer/kvxferd.yaml"; do
    if grep -qxF "$l" "$svc"; then pass "kvxferd.service: $l"
    else fail "kvxferd.service has no line $l"; fi
done
for l in "SocketGroup=kvxfer" "SocketMode=0660" "SocketUser=root"; do
    if grep -qxF "$l" "$sock"; then pass "kvxferd.socket: $l"
    else fail "kvxferd.socket has no line $l"; fi
done
if [ $failed -eq 0 ]; then echo "check-units: PASS"; else echo "check-units: FAIL"; fi
exit $failed
