#!/bin/sh
# make test-container: the Dockerfile built with buildah (no Docker engine
# needed), then the image's own entrypoint, user and health check run in
# its root file system and checked.
#   scripts/test-container.sh [DOCKERFILE]     (default: ./Dockerfile)
# Needs root, buildah and debootstrap (scripts/deps.sh ci) and the Debian
# mirror (scripts/debroot.sh: KVX_DEB_MIRROR, KVX_DEB_SUITE). No image
# registry is reached: the base images debian:SUITE and debian:SUITE-slim
# are both made here from one debootstrap --variant=minbase root (Docker
# Hub's are other builds of the same release), in a buildah store of its
# own under /tmp (vfs, chroot isolation: no container engine, no overlay,
# no user namespace). The build runs with CUDA=none: NVIDIA's repository
# is not reached, so the CUDA toolkit's install line is not run.
# Steps, each a PASS or FAIL line:
#   1. the base images;
#   2. buildah bud of the Dockerfile: both stages, make deb inside;
#   3. the image's configuration: its user (not root, numeric), entrypoint
#      and command, the volume /run/kvxfer, the health check; no
#      peer.secret in it;
#   4. its entrypoint and command run in its root file system as its user
#      (setpriv: no capability, no supplementary group), a configuration
#      bind-mounted read-only over /etc/kvxfer/kvxferd.yaml as a ConfigMap
#      is; the socket is the user's, group-writable;
#   5. the health check's command as the image's user, and GET /health
#      on metrics.listen (the liveness probe of deploy/kubernetes/);
#   6. an engine's user, another uid with the daemon's gid as a
#      supplementary group (a pod's supplementalGroups), runs kvxferctl
#      status and a kvxfer-bench transfer, every byte verified; a uid
#      without that group is refused;
#   7. SIGTERM: the daemon drains and exits 0;
#   8. deploy/kubernetes/kvxferd-daemonset.yaml in the image, as far as a
#      node without Kubernetes can: its setup init container's script, as
#      root with CHOWN and FOWNER only, over stand-ins of its volumes (the
#      ConfigMap's file, empty folders for the emptyDirs, a fresh root-owned
#      0755 socket folder for the hostPath, a root 0400 secret as a Secret
#      volume gives) with NODE_IP=127.0.0.1 and the ports made 0 (no
#      clash on this machine), the rest of the image read-only
#      (readOnlyRootFilesystem); the daemon with the container's args and
#      volumes on the result, the peer link (UCX) on; the readiness probe's
#      command, GET /health (liveness), then the preStop command drains it.
# Exits 0 when every step passed, 1 when one failed, 3 when it cannot run
# here (not root, no buildah or debootstrap, no mirror), saying why.
set -u
DOCKERFILE=${1:-Dockerfile}
. "$(dirname "$0")/debroot.sh"
start=$(date +%s)
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
skip() { echo "test-container: SKIP: $*"; exit 3; }
[ "$(id -u)" = 0 ] || skip "needs root (buildah's chroot isolation, chroot)"
command -v buildah >/dev/null || skip "no buildah (scripts/deps.sh ci)"
command -v debootstrap >/dev/null || skip "no debootstrap (scripts/deps.sh ci)"
[ -f "$DOCKERFILE" ] || { echo "FAIL: $DOCKERFILE: no such file"; exit 1; }

tmp=$(mktemp -d /tmp/kvxfer-ctr.XXXXXX)
log=$tmp/log
B="buildah --root $tmp/store --runroot $tmp/run --storage-driver vfs"
pid=""
cfg_mnt=""
mounts="" # step 8's, newest first
cleanup() {
    [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null
    [ -z "$cfg_mnt" ] || umount -l "$cfg_mnt" 2>/dev/null
    for m in $mounts; do umount -l "$m" 2>/dev/null; done
    [ -z "${root:-}" ] || debroot_umount
    $B rm -a >/dev/null 2>&1
    $B rmi -a -f >/dev/null 2>&1
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# --- 1. base images from a debootstrap root ------------------------------
root=$tmp/base
mkdir -p "$root"
t0=$(date +%s)
debroot_make "$log"
case $? in
0) ;;
3) skip "debootstrap $SUITE from $MIRROR failed: no mirror?" ;;
*) fail "debootstrap --variant=minbase $SUITE"; exit 1 ;;
esac
c=$($B from scratch) && m=$($B mount "$c") && cp -a "$root/." "$m/" &&
    $B umount "$c" >/dev/null &&
    $B config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd bash "$c" &&
    $B commit -q --format docker "$c" "docker.io/library/debian:$SUITE" >/dev/null &&
    $B tag "docker.io/library/debian:$SUITE" "docker.io/library/debian:$SUITE-slim" &&
    $B rm "$c" >/dev/null
if [ $? = 0 ]; then
    pass "base images debian:$SUITE and debian:$SUITE-slim from debootstrap --variant=minbase ($(( $(date +%s) - t0 )) s)"
else
    fail "base images from $root"
    exit 1
fi
rm -rf "$root"
root=""

# --- 2. the build ---------------------------------------------------------
t0=$(date +%s)
if $B bud --isolation chroot --format docker --pull=never --layers=false \
        --build-arg CUDA=none --build-arg DEBIAN="$SUITE" \
        -f "$DOCKERFILE" -t localhost/kvxferd:test . >"$log" 2>&1; then
    pass "buildah bud -f $DOCKERFILE --build-arg CUDA=none ($(( $(date +%s) - t0 )) s)"
else
    tail -n 40 "$log"
    fail "buildah bud -f $DOCKERFILE --build-arg CUDA=none"
    exit 1
fi

# --- 3. the image's configuration ------------------------------------------
$B inspect --type image localhost/kvxferd:test >"$tmp/inspect.json"
# KEY=VALUE lines of what the checks below use
python3 - "$tmp/inspect.json" >"$tmp/config" <<'PY'
import json, shlex, sys
c = json.load(open(sys.argv[1]))["Docker"]["config"]
print("user=" + shlex.quote(c.get("User") or ""))
print("argv=" + shlex.quote(" ".join((c.get("Entrypoint") or []) + (c.get("Cmd") or []))))
print("env=" + shlex.quote(" ".join(c.get("Env") or [])))
print("volumes=" + shlex.quote(" ".join(sorted(c.get("Volumes") or {}))))
print("health=" + shlex.quote(json.dumps((c.get("Healthcheck") or {}).get("Test"))))
PY
. "$tmp/config"
uid=${user%%:*}
gid=${user#*:}
case $user in
[1-9]*:[1-9]*) pass "image user $user (numeric, not root: runAsNonRoot can check it)" ;;
*) fail "image user '$user' (expected UID:GID, not root)" ;;
esac
[ "$argv" = "kvxferd --config /etc/kvxfer/kvxferd.yaml" ] &&
    pass "entrypoint and command: $argv" ||
    fail "entrypoint and command: '$argv'"
[ "$volumes" = /run/kvxfer ] && pass "volume /run/kvxfer" ||
    fail "volumes: '$volumes' (expected /run/kvxfer)"
[ "$health" = '["CMD", "kvxferctl", "health"]' ] &&
    pass "health check $health" || fail "health check: $health"
for v in $env; do
    case $v in *" "*) fail "image environment: '$v' has a space" ;; esac
done
echo "$env" | grep -q 'NVIDIA_VISIBLE_DEVICES=all' &&
    pass "NVIDIA_VISIBLE_DEVICES=all in the image's environment" ||
    fail "no NVIDIA_VISIBLE_DEVICES=all in the image's environment: $env"

c=$($B from --pull=never localhost/kvxferd:test)
root=$($B mount "$c")
if [ -e "$root/etc/kvxfer/peer.secret" ]; then
    fail "the image holds /etc/kvxfer/peer.secret (every container would share it)"
else
    pass "no /etc/kvxfer/peer.secret in the image"
fi
got=$(stat -c '%u:%g %a' "$root/run/kvxfer" 2>&1)
[ "$got" = "$uid:$gid 750" ] && pass "/run/kvxfer: $got" ||
    fail "/run/kvxfer: $got (expected $uid:$gid 750)"

# --- 4. the daemon as the image runs it -------------------------------------
debroot_mount
cat >"$tmp/kvxferd.yaml" <<'YAML'
# a mounted configuration (as deploy/kubernetes/'s ConfigMap is)
metrics:
  listen: 127.0.0.1:0
log:
  level: info
YAML
cfg_mnt=$root/etc/kvxfer/kvxferd.yaml
mount --bind "$tmp/kvxferd.yaml" "$cfg_mnt" && mount -o remount,bind,ro "$cfg_mnt"
# in the image's root, with its environment, as UID:GID and groups
# (EXEC=exec: the command replaces the shell, so that $! is its pid)
as_image() {
    u=$1 g=$2 groups=$3
    shift 3
    # shellcheck disable=SC2086 # the image's environment: no spaces (step 3)
    ${EXEC:-} chroot "$root" /usr/bin/env -i $env setpriv --reuid="$u" --regid="$g" \
        $groups --bounding-set=-all --inh-caps=-all --no-new-privs "$@"
}
# shellcheck disable=SC2086 # argv: the image's words
EXEC=exec as_image "$uid" "$gid" --clear-groups $argv >"$tmp/kvxferd.log" 2>&1 &
pid=$!
sock=$root/run/kvxfer/kvxferd.sock
if wait_socket "$sock" && kill -0 "$pid" 2>/dev/null; then
    u=$(awk '/^Uid:/ { print $2 }' /proc/"$pid"/status)
    g=$(awk '/^Gid:/ { print $2 }' /proc/"$pid"/status)
    bnd=$(awk '/^CapBnd:/ { print $2 }' /proc/"$pid"/status)
    if [ "$u:$g" = "$uid:$gid" ] && [ "$bnd" = 0000000000000000 ]; then
        pass "kvxferd runs as $u:$g, capability bounding set $bnd"
    else
        fail "kvxferd runs as $u:$g (image user $uid:$gid), capability bounding set $bnd"
    fi
else
    cat "$tmp/kvxferd.log"
    fail "kvxferd did not start from the image"
    exit 1
fi
got=$(stat -c '%u:%g %a' "$sock")
[ "$got" = "$uid:$gid 660" ] && pass "socket $got" ||
    fail "socket is $got, expected $uid:$gid 660"

# --- 5. health --------------------------------------------------------------
# the health check's command: the words after CMD
hc=$(echo "$health" | python3 -c 'import json,sys; print(" ".join(json.load(sys.stdin)[1:]))')
# shellcheck disable=SC2086
if out=$(as_image "$uid" "$gid" --clear-groups $hc 2>&1) && [ "$out" = ok ]; then
    pass "health check ($hc) as $uid:$gid: $out"
else
    fail "health check ($hc): $out"
fi
port=$(sed -n 's/.*metrics: serving .* (port \([0-9]*\)).*/\1/p' "$tmp/kvxferd.log" | head -n 1)
if [ -z "$port" ]; then
    fail "no metrics line in the log (the mounted configuration not read?): $(cat "$tmp/kvxferd.log")"
elif ! command -v curl >/dev/null; then
    echo "note: no curl here: GET /health not tried"
elif out=$(curl -sf "http://127.0.0.1:$port/health" 2>&1); then
    pass "GET /health on port $port (from the mounted configuration): $out"
else
    fail "GET /health on port $port: $out"
fi

# --- 6. an engine's user: the daemon's gid as a supplementary group ---------
if out=$(as_image 20000 20000 --groups="$gid" kvxferctl status 2>&1) &&
    echo "$out" | grep -q 'kvxferd 3'; then
    pass "kvxferctl status as uid 20000 with group $gid: $(echo "$out" | head -n 1)"
else
    fail "kvxferctl status as uid 20000 with group $gid: $out"
fi
if out=$(as_image 20000 20000 --groups="$gid" kvxfer-bench \
        --socket /run/kvxfer/kvxferd.sock --requests 8 --blocks 16 2>&1) &&
    echo "$out" | grep -q 'verified *yes'; then
    pass "kvxfer-bench as uid 20000 with group $gid: $(echo "$out" | grep verified | tr -s ' ')"
else
    fail "kvxfer-bench as uid 20000 with group $gid: $out"
fi
if out=$(as_image 20001 20001 --clear-groups kvxferctl status 2>&1); then
    fail "kvxferctl status as uid 20001, not in group $gid, was let in: $out"
else
    pass "kvxferctl status as uid 20001, not in group $gid: refused ($(echo "$out" | head -n 1))"
fi

# --- 7. drain ----------------------------------------------------------------
kill -TERM "$pid"
wait "$pid"
rc=$?
pid=""
if [ "$rc" = 0 ] && grep -q 'exiting (drained)' "$tmp/kvxferd.log"; then
    pass "SIGTERM: kvxferd exiting (drained), exit 0"
else
    fail "SIGTERM: exit $rc: $(tail -n 3 "$tmp/kvxferd.log")"
fi

# --- 8. the DaemonSet's setup and configuration, in the image --------------
ds=deploy/kubernetes/kvxferd-daemonset.yaml
umount -l "$cfg_mnt" && cfg_mnt=""
# its parts as shell words: the setup script, the ConfigMap's file, the
# kvxferd container's args and probe and preStop commands
py=python3
[ -x build/venv-deploy/bin/python ] && py=build/venv-deploy/bin/python
if ! "$py" - "$ds" "$tmp/ds" >"$tmp/ds.sh" <<'PY'
import os, shlex, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
cm = next(d for d in docs if d["kind"] == "ConfigMap")
ds = next(d for d in docs if d["kind"] == "DaemonSet")
spec = ds["spec"]["template"]["spec"]
setup = spec["initContainers"][0]
main = spec["containers"][0]
os.makedirs(sys.argv[2])
# the ports made 0: this machine may use the manifest's
conf = cm["data"]["kvxferd.yaml"].replace(":7400", ":0").replace(":9464", ":0")
open(sys.argv[2] + "/kvxferd.yaml", "w").write(conf)
open(sys.argv[2] + "/setup.sh", "w").write(setup["command"][2])
q = lambda v: shlex.quote(" ".join(v))
print("setup_cmd=" + q(setup["command"][:2]))
print("setup_mounts=" + q(m["mountPath"] for m in setup["volumeMounts"]))
print("main_args=" + q(main["args"]))
print("main_mounts=" + q(m["mountPath"] for m in main["volumeMounts"]))
print("ready_cmd=" + q(main["readinessProbe"]["exec"]["command"]))
print("live_path=" + shlex.quote(main["livenessProbe"]["httpGet"]["path"]))
print("stop_cmd=" + q(main["lifecycle"]["preStop"]["exec"]["command"]))
print("uid=%d gid=%d" % (spec["securityContext"]["runAsUser"],
                         spec["securityContext"]["runAsGroup"]))
PY
then
    fail "$ds: cannot read its parts (PyYAML in $py?)"
else
    . "$tmp/ds.sh"
    # stand-ins for the pod's volumes: the ConfigMap's file, the Secret
    # (root's, 0400), empty folders (emptyDir: 0777) and a fresh hostPath
    # folder (root's, 0755); the rest of the image read-only
    # (readOnlyRootFilesystem)
    for d in $setup_mounts $main_mounts; do mkdir -p "$root$d"; done
    mount --rbind "$root" "$root" && mounts="$root $mounts" &&
        mount -o remount,bind,ro "$root"
    for d in $(echo $setup_mounts $main_mounts | tr ' ' '\n' | sort -u); do
        case $d in
        /run/kvxfer) mode=0755 ;;
        *) mode=0777 ;;
        esac
        mount -t tmpfs -o mode=$mode kvx-$(basename "$d") "$root$d" &&
            mounts="$root$d $mounts"
    done
    cp "$tmp/ds/kvxferd.yaml" "$root/config/kvxferd.yaml"
    head -c 32 /dev/urandom >"$root/secret/peer.secret"
    chmod 0400 "$root/secret/peer.secret"
    mount --bind /sys "$root/sys" && mounts="$root/sys $mounts"
    if touch "$root/usr/kvx-rw" 2>/dev/null; then
        rm -f "$root/usr/kvx-rw"
        fail "the image's root is writable: readOnlyRootFilesystem not imitated"
    fi
    # shellcheck disable=SC2086 # setup_cmd: sh -ec
    if out=$(chroot "$root" /usr/bin/env -i $env NODE_IP=127.0.0.1 \
            setpriv --bounding-set=-all,+chown,+fowner --inh-caps=-all \
            --no-new-privs $setup_cmd "$(cat "$tmp/ds/setup.sh")" 2>&1); then
        pass "the setup container's script as root with CHOWN and FOWNER: $(echo "$out" | tail -n 1)"
    else
        fail "the setup container's script: $out"
    fi
    got="$(stat -c '%u:%g %a' "$root/run/kvxfer-secret/peer.secret" 2>&1), $(stat -c '%u:%g %a' "$root/run/kvxfer" 2>&1)"
    [ "$got" = "$uid:$gid 600, $uid:$gid 750" ] &&
        pass "the secret's copy and the socket folder: $got" ||
        fail "the secret's copy and the socket folder: $got (expected $uid:$gid 600, $uid:$gid 750)"
    grep -q 'listen: "127.0.0.1:0"' "$root/etc/kvxfer/kvxferd.yaml" &&
        pass "the node's IP written into the configuration" ||
        fail "no node IP in $(cat "$root/etc/kvxfer/kvxferd.yaml")"
    # the kvxferd container: its args, as the pod's user
    # shellcheck disable=SC2086
    EXEC=exec as_image "$uid" "$gid" --clear-groups kvxferd $main_args \
        >"$tmp/kvxferd2.log" 2>&1 &
    pid=$!
    if wait_socket "$root/run/kvxfer/kvxferd.sock" && kill -0 "$pid" 2>/dev/null; then
        pass "kvxferd with the DaemonSet's configuration and secret ($main_args)"
    else
        cat "$tmp/kvxferd2.log"
        fail "kvxferd with the DaemonSet's configuration did not start"
    fi
    # shellcheck disable=SC2086
    if out=$(as_image "$uid" "$gid" --clear-groups $ready_cmd 2>&1); then
        pass "readiness probe ($ready_cmd): $out"
    else
        fail "readiness probe ($ready_cmd): $out"
    fi
    out=$(as_image "$uid" "$gid" --clear-groups kvxferctl status 2>&1)
    echo "$out" | grep -q '^peers  *UCX' && echo "$out" | grep -q '127\.0\.0\.1:' &&
        pass "the peer link on: $(echo "$out" | grep -m1 '127\.0\.0\.1:' | tr -s ' ' | cut -c1-100)" ||
        fail "the peer link is not on: $out"
    port=$(sed -n 's/.*metrics: serving .* (port \([0-9]*\)).*/\1/p' "$tmp/kvxferd2.log" | head -n 1)
    if [ -n "$port" ] && command -v curl >/dev/null &&
        out=$(curl -sf "http://127.0.0.1:$port$live_path" 2>&1); then
        pass "liveness probe: GET $live_path: $out"
    elif command -v curl >/dev/null; then
        fail "liveness probe: GET $live_path on port '$port': $out"
    fi
    # shellcheck disable=SC2086
    out=$(as_image "$uid" "$gid" --clear-groups $stop_cmd 2>&1)
    wait "$pid"
    rc=$?
    pid=""
    [ "$rc" = 0 ] && echo "$out" | grep -q 'drained' &&
        pass "preStop ($stop_cmd): $out" ||
        fail "preStop ($stop_cmd): exit $rc: $out $(tail -n 3 "$tmp/kvxferd2.log")"
fi

echo "test-container: $( [ $failed = 0 ] && echo PASS || echo FAIL) in $(( $(date +%s) - start )) s"
exit $failed
