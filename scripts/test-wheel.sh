#!/bin/sh
# make test-wheel: the wheel of make wheel installed into a fresh venv and
# a node run from it alone.
#   scripts/test-wheel.sh [DIST [UCX_LIB]]   (DIST: default dist; UCX_LIB:
#                                            the build's libucx-cu13 lib/)
# Steps, each a PASS or FAIL line:
#   1. auditwheel show: the symbol versions allow the manylinux tag the
#      file name carries, and the only libraries outside the wheel and the
#      policy are UCX's (libucx-cu13's, a dependency);
#   2. a fresh venv, of another Python than the build's where one is on
#      PATH, in a folder of its own: pip install of the wheel (and so of
#      libucx-cu13 from PyPI); no build tree on any path, LD_LIBRARY_PATH,
#      PYTHONPATH, KVXFER_LIB and KVX_BUILD unset, run from that folder;
#   3. kvxferd --version from the console script and kvxfer/_bin/kvxferd
#      directly: the package's version, UCX loaded from the venv;
#   4. as an unprivileged user (nobody when run as root, else the caller):
#      kvxferd on a socket in a folder it may not write fails, naming
#      --socket; kvxferd --socket in a folder of that user's (peers on
#      loopback: UCX starts and loads its modules), kvxferctl status, one
#      transfer through the Python client (publish, fetch into other
#      blocks, every byte compared); every library the daemon mapped is
#      the venv's or glibc's, the client's libkvxfer and its libraries
#      the venv's; kvxfer-bench --daemons 2: two daemons of the wheel
#      move verified bytes over UCX;
#   5. SIGTERM: the daemon drains and exits 0.
# Exits 0 when every step passed, 1 when one failed, 3 when it cannot run
# here (no network to PyPI for libucx-cu13), saying why. Offline (a GPU
# machine): PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR, DIR holding the
# libucx-cu13 wheel (pip download libucx-cu13==1.22.0), and
# AUDITWHEEL=none where the build venv is not.
set -u
cd "$(dirname "$0")/.." || exit 1
DIST=${1:-dist}
UCX_LIB=${2:-build/ucx-wheel/libucx/lib}
AW=${AUDITWHEEL:-build-ucx-wheel/venv-wheel/bin/auditwheel}
start=$(date +%s)
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
skip() { echo "test-wheel: SKIP: $*"; exit 3; }
whl=$(ls "$DIST"/kvxfer-*.whl 2>/dev/null | head -n 1)
[ -n "$whl" ] || { echo "FAIL: no $DIST/kvxfer-*.whl (make wheel)"; exit 1; }
whl=$(readlink -f "$whl")
UCX_LIB=$(readlink -f "$UCX_LIB")
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' python/kvxfer/_version.py)

# --- 1. the tag ------------------------------------------------------------
tag=$(basename "$whl" .whl | sed 's/^kvxfer-[^-]*-py3-none-//')
case $tag in
manylinux_2_*_x86_64|manylinux_2_*_aarch64) pass "file name tag $tag" ;;
*) fail "file name tag $tag, not manylinux_2_NN" ;;
esac
# UCX resolved to libucx-cu13's (what pip installs beside the wheel), not
# to a UCX of this machine's
out=$(LD_LIBRARY_PATH=$UCX_LIB "$AW" show --json "$whl" 2>/dev/null)
if [ "$AW" = none ]; then
    echo "SKIP: auditwheel show (AUDITWHEEL=none: a machine without the build venv)"
elif [ ! -x "$AW" ]; then
    fail "auditwheel show: no $AW (make wheel makes it; AUDITWHEEL=PATH, or none to skip)"
elif res=$(echo "$out" | python3 -c '
import json, sys
tag = sys.argv[1]
try:
    d = json.load(sys.stdin)
except ValueError:
    sys.exit("no JSON from auditwheel show")
ucx = {"libucp.so.0", "libuct.so.0", "libucs.so.0", "libucm.so.0"}
ext = set(d["external_libs"])
bad = []
if d["sym_tag"] != tag:
    bad.append("the symbol versions allow %s" % d["sym_tag"])
if ext - ucx:
    bad.append("libraries outside the wheel: %s" % sorted(ext - ucx))
glibc = sorted((v for s in d["versioned_symbols"].values() for v in s
                if v.startswith("GLIBC_")),
               key=lambda v: [int(x) for x in v[6:].split(".")])
print("; ".join(bad) if bad else "symbols allow %s (newest glibc symbol "
      "version: %s), external: %s (libucx-cu13)" % (d["sym_tag"], glibc[-1],
      " ".join(sorted(ext))))
sys.exit(1 if bad else 0)' "$tag"); then
    pass "auditwheel show: $res"
else
    fail "auditwheel show --json (with $AW): ${res:-$(echo "$out" | head -c 300)}"
fi

# --- 2. a fresh venv ---------------------------------------------------------
tmp=$(mktemp -d /tmp/kvxfer-wheel.XXXXXX)
chmod 755 "$tmp"
pid=""
cleanup() {
    [ -z "$pid" ] || kill "$pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
# the unprivileged user: nobody where we are root
if [ "$(id -u)" = 0 ] && id nobody >/dev/null 2>&1 && command -v setpriv >/dev/null; then
    user=nobody
    as() { setpriv --reuid=nobody --regid="$(id -g nobody)" --clear-groups "$@"; }
else
    user=$(id -un)
    as() { "$@"; }
fi
mkdir -p "$tmp/home" "$tmp/run"
chown "$user" "$tmp/home" "$tmp/run" 2>/dev/null
chmod 700 "$tmp/run"
# a clean environment: nothing of the build on any path
clean() { as env -i PATH="$tmp/v/bin:/usr/bin:/bin" HOME="$tmp/home" LANG=C.UTF-8 "$@"; }
build_py=$(python3 -c 'import sys; print(sys.executable)')
py=""
for c in ${TEST_PYTHON:-} python3.13 python3.12 python3.10 python3.9 /usr/bin/python3 python3; do
    exe=$("$c" -c 'import sys, venv; print(sys.executable)' 2>/dev/null) || continue
    # the user must run it (pyenv's under /root: not nobody)
    (cd "$tmp" && as "$exe" -c 'import venv' 2>/dev/null) || continue
    [ -z "$py" ] && py=$exe
    [ "$exe" != "$build_py" ] && { py=$exe; break; }
done
[ -n "$py" ] || { fail "no python3 that $user can run"; exit 1; }
"$py" -m venv "$tmp/v" || { fail "$py -m venv"; exit 1; }
if out=$(cd "$tmp" && env -u LD_LIBRARY_PATH -u PYTHONPATH -u KVXFER_LIB \
        "$tmp/v/bin/pip" install -q --disable-pip-version-check \
        "$whl" 2>&1); then
    pass "pip install $(basename "$whl") into a fresh venv of $("$tmp/v/bin/python" -V 2>&1) ($py; the build's: $build_py)"
else
    if ! python3 -c 'import urllib.request as u; u.urlopen("https://pypi.org/simple/libucx-cu13/", timeout=10)' >/dev/null 2>&1; then
        skip "cannot install libucx-cu13 (no network to PyPI)"
    fi
    fail "pip install: $out"; exit 1
fi
site=$("$tmp/v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# --- 3. kvxferd --version ----------------------------------------------------
for k in "$tmp/v/bin/kvxferd" "$site/kvxfer/_bin/kvxferd"; do
    out=$(cd "$tmp" && clean "$k" --version 2>&1)
    loaded=$(echo "$out" | sed -n 's/^UCX: .*, loaded [0-9.]* (\(.*\))$/\1/p')
    if echo "$out" | head -n 1 | grep -q "^kvxferd $version " &&
        [ -n "$loaded" ] &&
        [ "$(readlink -f "$loaded")" = "$(readlink -f "$site/libucx/lib/libucp.so.0")" ]; then
        pass "$(echo "$k" | sed "s|$tmp/v|VENV|") --version: $(echo "$out" | tr '\n' ' ' | sed "s|$tmp/v|VENV|g")"
    else
        fail "$k --version (wanted kvxferd $version, UCX from $site/libucx): $out"
    fi
done
out=$(cd "$tmp" && clean kvxferctl --version 2>&1)
if echo "$out" | grep -q "$version"; then
    pass "kvxferctl --version: $out"
else
    fail "kvxferctl --version: $out"
fi

# --- 4. a node, unprivileged -------------------------------------------------
# a socket where the user may not write (the default /run/kvxfer, for a
# user other than root): the daemon fails, saying what to do
mkdir -p "$tmp/ro"
chmod 555 "$tmp/ro"
out=$(cd "$tmp" && clean timeout 10 kvxferd --socket "$tmp/ro/kvxferd.sock" 2>&1)
rc=$?
if [ "$rc" != 0 ] && echo "$out" | grep -q "Permission denied.*--socket PATH"; then
    pass "kvxferd as $user on a folder it may not write: exit $rc, $(echo "$out" | grep -- --socket | sed "s|$tmp|TMP|g")"
else
    fail "kvxferd as $user on a folder it may not write: exit $rc, $out"
fi
sock=$tmp/run/kvxferd.sock
# peers on (loopback): UCX starts, and loads its transport modules
head -c 32 /dev/urandom > "$tmp/run/peer.secret"
chmod 600 "$tmp/run/peer.secret"
cat > "$tmp/run/kvxferd.yaml" <<EOF
peer:
  listen: "127.0.0.1:0"
  secret_file: "$tmp/run/peer.secret"
EOF
chown "$user" "$tmp/run/peer.secret" "$tmp/run/kvxferd.yaml" 2>/dev/null
(cd "$tmp" && clean kvxferd --config "$tmp/run/kvxferd.yaml" --socket "$sock" \
    >"$tmp/kvxferd.log" 2>&1) &
pid=$!
i=0
while ! grep -q " ready: " "$tmp/kvxferd.log" && [ $i -lt 100 ] &&
    kill -0 "$pid" 2>/dev/null; do
    sleep 0.1; i=$((i + 1))
done
if [ -S "$sock" ]; then
    pass "kvxferd as $user (uid $(as id -u)) on $sock: $(grep -E " ready: |peers: UCX .* listening" "$tmp/kvxferd.log" | sed "s|$tmp|TMP|g" | tr '\n' ' ')"
else
    fail "kvxferd as $user did not listen on $sock: $(cat "$tmp/kvxferd.log")"
    exit 1
fi
# the daemon's process is kvxferd itself (the console script execs it)
dpid=$(pgrep -P "$pid" -x kvxferd || echo "$pid")
if out=$(cd "$tmp" && clean kvxferctl --socket "$sock" status 2>&1) &&
    echo "$out" | grep -q "kvxferd $version"; then
    pass "kvxferctl status as $user: $(echo "$out" | head -n 1)"
else
    fail "kvxferctl status as $user: $out"
fi
cat > "$tmp/transfer.py" <<'PY'
import os, sys, time
import kvxfer

sock, site = sys.argv[1], sys.argv[2]
assert kvxfer.library_path().startswith(site), kvxfer.library_path()
par = kvxfer.Parallel(tp=1, pp=1, cp=1, total_layers=2, total_kv_heads=2)
layout = kvxfer.Layout.preset("vllm-nhd", num_layers=2, num_heads=2,
                              head_dim=16, dtype="fp16",
                              tokens_per_block=4, num_blocks=8)
ctx = kvxfer.Client(sock, instance_id="wheel-prefill", role="context",
                    rank=0, parallel=par)
ctx.join([ctx.daemon_address])
gen = kvxfer.Client(sock, instance_id="wheel-decode", role="generation",
                    rank=0, parallel=par)
gen.join([gen.daemon_address])
src, dst = ctx.create_host_pool(layout), gen.create_host_pool(layout)
s, d = src.memoryview(), dst.memoryview()
s[:] = os.urandom(len(s))
params = ctx.publish("wheel-1", pool=src, blocks=[1, 2, 3], num_tokens=12)
gen.fetch("wheel-1", params, dst, [5, 6, 7])
end = time.monotonic() + 20
ev = None
while ev is None and time.monotonic() < end:
    for e in gen.poll(at_least=1, timeout=0.2):
        if e.key == b"wheel-1":
            ev = e
assert ev is not None, "no event for wheel-1 in 20 s"
ev.raise_for_status()
n = 16 * 2  # head_dim fp16
checked = 0
for layer in range(2):
    for kv in range(2):
        for sb, db in zip([1, 2, 3], [5, 6, 7]):
            for tok in range(4):
                for head in range(2):
                    a = layout.offset(layer, kv, sb, tok, head)
                    b = layout.offset(layer, kv, db, tok, head)
                    assert s[a:a + n] == d[b:b + n], (layer, kv, sb, tok)
                    checked += n
maps = open("/proc/self/maps").read()
libs = sorted({l.split()[-1] for l in maps.splitlines()
               if ".so" in l.split()[-1]})
print("transfer: %s, %d bytes compared; libkvxfer: %s; libraries: %s"
      % (ev.kind.name if hasattr(ev.kind, "name") else ev.kind, checked,
         kvxfer.library_path(), " ".join(libs)))
gen.close()
ctx.close()
PY
if out=$(cd "$tmp" && clean python transfer.py "$sock" "$site" 2>&1); then
    pass "$(echo "$out" | sed -e "s|$site|SITE|g" -e 's/; libraries:.*//')"
else
    fail "a transfer through the Python client as $user: $out"
fi
# what the daemon mapped: the venv's libraries, or glibc's; what the
# client mapped of kvxfer's: the venv's (the interpreter maps its own)
glibc='/(libc|libm|libdl|librt|libpthread|libgcc_s|ld-linux[^/]*|libnss_[a-z]*)[.]so'
ours='/(libkvxfer|libprotobuf-c|libuv|libyaml|libuc[pstm])[-.][^/]*$'
for what in client daemon; do
    if [ $what = client ]; then
        libs=$(echo "$out" | sed -n 's/.*; libraries: //p' | tr ' ' '\n')
        foreign=$(echo "$libs" | grep -E "$ours" | grep -v "^$tmp/v/" | tr '\n' ' ')
    else
        libs=$(awk '$6 ~ /[.]so/ {print $6}' "/proc/$dpid/maps" | sort -u)
        foreign=$(echo "$libs" | grep -v "^$tmp/v/" | grep -vE "$glibc" | tr '\n' ' ')
    fi
    if [ -n "$libs" ] && [ -z "$foreign" ]; then
        pass "$what: the libraries mapped are the venv's$([ $what = daemon ] && echo " or glibc's") ($(echo "$libs" | grep -c "^$tmp/v/") from the venv)"
    else
        fail "$what maps libraries from outside the venv: ${foreign:-none mapped at all}"
    fi
done
# the daemon's UCX is libucx-cu13's, with its transport modules
modules=$(grep -o "$site/libucx/lib/ucx/lib[a-z_]*" "/proc/$dpid/maps" | sort -u | sed 's|.*/||' | tr '\n' ' ')
if grep -q "$site/libucx/lib/libucp.so.0" "/proc/$dpid/maps" && [ -n "$modules" ]; then
    pass "daemon: UCX from $(echo "$site" | sed "s|$tmp/v|VENV|")/libucx/lib, its modules from lib/ucx: $modules"
else
    fail "daemon: UCX not from the venv's libucx, or no module of its lib/ucx loaded ($modules): $(grep -E 'libuc[pstm]' "/proc/$dpid/maps" | awk '{print $6}' | sort -u | tr '\n' ' ')"
fi

# two daemons of the wheel, a transfer between them over UCX (kvxfer-bench
# spawns them from kvxfer/_bin, beside itself), every row verified
if out=$(cd "$tmp" && clean timeout 120 kvxfer-bench --spawn-daemon --daemons 2 \
        --requests 4 --blocks 8 2>&1) && echo "$out" | grep -q 'verified *yes'; then
    pass "kvxfer-bench --daemons 2 as $user: $(echo "$out" | grep -E 'UCX_TLS|verified' | tr -s ' ' | tr '\n' ' ')"
else
    fail "kvxfer-bench --daemons 2 as $user: $out"
fi

# --- 5. SIGTERM --------------------------------------------------------------
kill -TERM "$dpid"
wait "$pid"
rc=$?
pid=""
if [ "$rc" = 0 ] && grep -q "exiting (drained)" "$tmp/kvxferd.log"; then
    pass "SIGTERM: kvxferd drained and exited 0"
else
    fail "SIGTERM: kvxferd exited $rc: $(tail -n 5 "$tmp/kvxferd.log")"
fi
echo "test-wheel: $(basename "$whl"), $(($(date +%s) - start)) s"
[ "$failed" = 0 ] && echo "test-wheel: all passed" || echo "test-wheel: FAILED"
exit "$failed"
