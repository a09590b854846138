#!/bin/sh
# make test-deb: the .debs of make deb installed, run and purged in a fresh
# Debian root, not on the build machine.
#   scripts/test-deb.sh [DEBS]        (DEBS: default dist/deb)
# Needs root, debootstrap and the Debian mirror (KVX_DEB_MIRROR, default
# http://deb.debian.org/debian; KVX_DEB_SUITE, default this machine's
# codename). Steps, each a PASS or FAIL line:
#   1. debootstrap --variant=minbase into a folder under /tmp, then
#      apt-get install there of systemd (systemd-sysusers, as on a server)
#      and the four packages;
#   2. the user and group kvxfer exist (sysusers.d), the YAML is a
#      conffile, /etc/kvxfer/peer.secret is root's, 0600, 32 bytes;
#   3. kvxferd started directly (no systemd in a chroot) as kvxfer, with
#      no capability (setpriv: as the unit's User= and empty
#      CapabilityBoundingSet=), on /run/kvxfer/kvxferd.sock;
#   4. a user in the group kvxfer runs kvxferctl status and a transfer
#      with kvxfer-bench, every byte verified; a user outside it is
#      refused by the socket's mode;
#   5. SIGTERM: the daemon drains and exits 0;
#   6. apt-get purge: no file of the packages left, /etc/kvxfer and
#      /var/lib/kvxfer gone.
# Exits 0 when every step passed, 1 when one failed, 3 when it cannot run
# here (not root, no debootstrap, no mirror), saying why.
set -u
DEBS=${1:-dist/deb}
. "$(dirname "$0")/debroot.sh"
start=$(date +%s)
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
skip() { echo "test-deb: SKIP: $*"; exit 3; }
[ "$(id -u)" = 0 ] || skip "needs root (debootstrap, chroot)"
command -v debootstrap >/dev/null || skip "no debootstrap (scripts/deps.sh deb)"
set -- "$DEBS"/kvxferd_*.deb "$DEBS"/libkvxfer2_*.deb "$DEBS"/libkvxfer-dev_*.deb \
    "$DEBS"/kvxfer-tools_*.deb
for d in "$@"; do
    [ -f "$d" ] || { echo "FAIL: $d: no such package (make deb)"; exit 1; }
done

root=$(mktemp -d /tmp/kvxfer-debroot.XXXXXX)
log=$root.log
cleanup() {
    if [ -f "$root/tmp/kvxferd.pid" ]; then
        kill "$(cat "$root/tmp/kvxferd.pid")" 2>/dev/null
    fi
    debroot_umount
    rm -rf "$root" "$log"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# --- 1. a fresh root, the packages ---------------------------------------
t0=$(date +%s)
debroot_make "$log"
case $? in
0) pass "debootstrap --variant=minbase $SUITE $root ($(( $(date +%s) - t0 )) s)" ;;
3) skip "debootstrap $SUITE from $MIRROR failed: no mirror?" ;;
*) fail "debootstrap --variant=minbase $SUITE $root"; exit 1 ;;
esac
debroot_mount
mkdir -p "$root/tmp/debs"
cp "$@" "$root/tmp/debs/"
t0=$(date +%s)
if in_root apt-get install -y --no-install-recommends systemd >"$log" 2>&1 &&
    in_root sh -c 'apt-get install -y --no-install-recommends /tmp/debs/*.deb' \
        >>"$log" 2>&1; then
    pass "apt-get install systemd and $(ls "$root/tmp/debs" | tr '\n' ' ')($(( $(date +%s) - t0 )) s)"
else
    tail -n 30 "$log"
    fail "apt-get install of the packages"
    exit 1
fi

# --- 2. what the packages set up -------------------------------------------
if pw=$(in_root getent passwd kvxfer) && in_root getent group kvxfer >/dev/null; then
    pass "user and group kvxfer: $pw"
else
    fail "no user or group kvxfer after install"
fi
if in_root dpkg-query -W -f='${Conffiles}\n' kvxferd | grep -q '/etc/kvxfer/kvxferd.yaml'; then
    pass "/etc/kvxfer/kvxferd.yaml is a conffile"
else
    fail "/etc/kvxfer/kvxferd.yaml is not a conffile of kvxferd"
fi
got=$(stat -c '%U %a %s' "$root/etc/kvxfer/peer.secret" 2>&1)
if [ "$got" = "root 600 32" ]; then pass "/etc/kvxfer/peer.secret: root, 0600, 32 bytes"
else fail "/etc/kvxfer/peer.secret: $got"; fi
for f in /lib/systemd/system/kvxferd.service /lib/systemd/system/kvxferd.socket \
    /usr/lib/sysusers.d/kvxfer.conf /usr/share/man/man8/kvxferd.8.gz \
    /usr/share/man/man5/kvxferd.yaml.5.gz /usr/share/man/man1/kvxferctl.1.gz \
    /usr/share/man/man1/kvxfer-bench.1.gz /usr/include/kvxfer.h \
    /usr/lib/x86_64-linux-gnu/pkgconfig/kvxfer.pc; do
    case $f in */x86_64-linux-gnu/*)
        f=$(echo "$f" | sed "s|x86_64-linux-gnu|$(in_root dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || dpkg-architecture -qDEB_HOST_MULTIARCH)|") ;;
    esac
    [ -e "$root$f" ] || fail "$f not installed"
done
if (cd "$root/lib/systemd/system" &&
    chroot "$root" systemd-analyze verify /lib/systemd/system/kvxferd.service \
        /lib/systemd/system/kvxferd.socket) >"$log" 2>&1 ||
    ! grep -v 'sysinit.target not found' "$log" | grep -q .; then
    pass "systemd-analyze verify on the installed units"
else
    fail "systemd-analyze verify: $(cat "$log")"
fi

# --- 3. the daemon, as kvxfer, no capability -------------------------------
# /run/kvxfer as the unit's RuntimeDirectory= makes it
install -d -o "$(in_root id -u kvxfer)" -g "$(in_root id -g kvxfer)" -m 0755 "$root/run/kvxfer"
in_root setpriv --reuid=kvxfer --regid=kvxfer --init-groups --bounding-set=-all \
    --inh-caps=-all --no-new-privs \
    sh -c '/usr/bin/kvxferd --config /etc/kvxfer/kvxferd.yaml >/tmp/kvxferd.log 2>&1 &
           echo $! >/tmp/kvxferd.pid'
sock=$root/run/kvxfer/kvxferd.sock
wait_socket "$sock"
pid=$(cat "$root/tmp/kvxferd.pid")
kuid=$(in_root id -u kvxfer)
kgid=$(in_root id -g kvxfer)
if [ -S "$sock" ] && kill -0 "$pid" 2>/dev/null; then
    # (the host may name the uid otherwise: numbers)
    uid=$(awk '/^Uid:/ { print $2 }' /proc/"$pid"/status)
    bnd=$(awk '/^CapBnd:/ { print $2 }' /proc/"$pid"/status)
    if [ "$uid" = "$kuid" ] && [ "$bnd" = 0000000000000000 ]; then
        pass "kvxferd runs as kvxfer (uid $uid), capability bounding set $bnd"
    else
        fail "kvxferd runs as uid $uid (kvxfer: $kuid), capability bounding set $bnd"
    fi
else
    cat "$root/tmp/kvxferd.log"
    fail "kvxferd did not start as kvxfer"
    exit 1
fi
got=$(stat -c '%u:%g %a' "$sock")
if [ "$got" = "$kuid:$kgid 660" ]; then pass "socket kvxfer:kvxfer ($got)"
else fail "socket is $got, expected kvxfer:kvxfer ($kuid:$kgid) 660"; fi

# --- 4. an engine's user, kvxferctl, a transfer ----------------------------
in_root adduser --quiet --disabled-password --gecos "" engine >/dev/null &&
    in_root adduser --quiet engine kvxfer >/dev/null &&
    in_root adduser --quiet --disabled-password --gecos "" other >/dev/null
if out=$(as engine kvxferctl status 2>&1) && echo "$out" | grep -q 'kvxferd 3'; then
    pass "kvxferctl status as engine (group kvxfer): $(echo "$out" | head -n 1)"
else
    fail "kvxferctl status as engine: $out"
fi
if out=$(as engine kvxfer-bench --socket /run/kvxfer/kvxferd.sock \
        --requests 8 --blocks 16 2>&1) &&
    echo "$out" | grep -q 'verified *yes'; then
    pass "kvxfer-bench as engine: $(echo "$out" | grep -E 'kvxferd +[0-9]' | tr -s ' '), $(echo "$out" | grep verified | tr -s ' ')"
else
    fail "kvxfer-bench as engine: $out"
fi
if out=$(as other kvxferctl status 2>&1); then
    fail "kvxferctl status as other (not in kvxfer) was let in: $out"
else
    pass "kvxferctl status as other, not in kvxfer: refused ($(echo "$out" | head -n 1))"
fi

# --- 5. drain ----------------------------------------------------------------
kill -TERM "$pid"
if ! wait_exit "$pid"; then
    fail "kvxferd still runs 10 s after SIGTERM"
elif grep -q 'exiting (drained)' "$root/tmp/kvxferd.log"; then
    pass "SIGTERM: kvxferd exiting (drained)"
else
    fail "SIGTERM: $(tail -n 3 "$root/tmp/kvxferd.log")"
fi
rm -f "$root/tmp/kvxferd.pid"

# --- 6. purge ------------------------------------------------------------------
files=$(in_root dpkg -L kvxferd libkvxfer2 libkvxfer-dev kvxfer-tools 2>/dev/null |
    while read -r f; do
        # files and links to files (not /lib, a link to a folder)
        if [ ! -d "$root$f" ] && { [ -e "$root$f" ] || [ -L "$root$f" ]; }; then
            echo "$f"
        fi
    done)
if in_root apt-get purge -y kvxferd libkvxfer2 libkvxfer-dev kvxfer-tools >"$log" 2>&1; then
    left=""
    n=$(echo "$files" | wc -l)
    for f in $files /etc/kvxfer /var/lib/kvxfer; do
        [ -e "$root$f" ] || [ -L "$root$f" ] && left="$left $f"
    done
    if [ -z "$left" ]; then pass "apt-get purge: none of the $n files left, /etc/kvxfer and /var/lib/kvxfer gone"
    else fail "apt-get purge left:$left"; fi
else
    tail -n 20 "$log"
    fail "apt-get purge"
fi

echo "test-deb: $( [ $failed = 0 ] && echo PASS || echo FAIL) in $(( $(date +%s) - start )) s"
exit $failed
