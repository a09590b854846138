#!/bin/bash
# docs/engines/vllm-two-nodes.md on one machine: its two daemon
# configurations as the page writes them but for the address: both on
# 127.0.0.1, each on a free port instead of 10.0.0.1:7411 and
# 10.0.0.2:7411 (a daemon listens only on an IP an interface holds, and
# the test never meets another daemon that way), each daemon given the one secret
# as systemd's LoadCredential= gives it ($CREDENTIALS_DIRECTORY), a
# request published on A's daemon and fetched into B's with the params
# (what the vLLM connector does through vLLM's proxy), every byte
# compared, then the page's step 6 run as written on node B (kvxferctl on
# B's socket) and its output checked: the peer connected, bytes in.
# Prints PASS/FAIL lines; exits 1 if any failed.
#   scripts/test-two-nodes.sh [BUILD]
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
PAGE=docs/engines/vllm-two-nodes.md
py=$BUILD/venv/bin/python
[ -x "$py" ] || py=python3
tmp=$(mktemp -d)
pids=""
cleanup() {
    for p in $pids; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
fatal() { echo "FAIL: $*"; for n in a b; do [ -f "$tmp/$n.log" ] && sed "s/^/  $n: /" "$tmp/$n.log" | tail -n 15; done; exit 1; }

# the page's blocks marked "run by scripts/test-two-nodes.sh": N-th
block() {
    "$py" - "$PAGE" "$1" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
blocks = re.findall(r"<!-- doctest: run by scripts/test-two-nodes.sh -->\n"
                    r"```\w*\n(.*?)```", text, re.S)
sys.stdout.write(blocks[int(sys.argv[2])])
PY
}
free_port() {
    "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
head -c 32 /dev/urandom >"$tmp/secret"
for n in a b; do
    i=$([ $n = a ] && echo 0 || echo 1)
    cfg=$(block $i) || fatal "no block $i in $PAGE"
    case "$cfg" in
    "# node ${n^^}: /etc/kvxfer/kvxferd.yaml"*) ;;
    *) fatal "$PAGE: block $i is not node ${n^^}'s configuration: $cfg" ;;
    esac
    mkdir -m 700 "$tmp/cred-$n"
    install -m 600 "$tmp/secret" "$tmp/cred-$n/peer.secret"
    { printf 'socket:\n  path: %s/%s.sock\n' "$tmp" $n
      echo "$cfg" | sed -e 's/10\.0\.0\.[12]:7411/127.0.0.1:'"$(free_port)"'/'
    } >"$tmp/$n.yaml"
    CREDENTIALS_DIRECTORY=$tmp/cred-$n "$BUILD/kvxferd" --config "$tmp/$n.yaml" \
        >"$tmp/$n.log" 2>&1 &
    pids="$pids $!"
done
for n in a b; do
    for _ in $(seq 100); do
        grep -q ' ready: ' "$tmp/$n.log" 2>/dev/null && break
        sleep 0.1
    done
    grep -q ' ready: ' "$tmp/$n.log" || fatal "node ${n^^}'s daemon did not start on $tmp/$n.yaml"
    pass "node ${n^^}: $(grep -o 'address kvx://[^ ]*' "$tmp/$n.log")"
done

# a request from A's daemon to B's, every byte compared
if out=$(PYTHONPATH=python KVX_BUILD=$BUILD "$py" - "$tmp" 2>&1 <<'PY'
import sys
import numpy as np
import kvxfer
tmp = sys.argv[1]
par = kvxfer.Parallel(tp=1, pp=1, cp=1, total_layers=4, total_kv_heads=8)
layout = kvxfer.Layout.preset("vllm-nhd", num_layers=4, num_heads=8,
                              head_dim=128, dtype="bf16",
                              tokens_per_block=16, num_blocks=64)
a = kvxfer.Client(tmp + "/a.sock", instance_id="prefill-0",
                  role="context", parallel=par)
a.join([a.daemon_address])
src = a.create_host_pool(layout)
src.array[:] = np.random.default_rng(7).integers(0, 256, src.array.size,
                                                 dtype=np.uint8)
params = a.publish("cmpl-1", src, [3, 4, 5, 6], num_tokens=60)
b = kvxfer.Client(tmp + "/b.sock", instance_id="decode-0",
                  role="generation", parallel=par)
b.join([b.daemon_address])
dst = b.create_host_pool(layout)
b.fetch("cmpl-1", params, dst, [10, 11, 12, 13])
evs = []
while not evs:
    evs = [e for e in b.poll(1, 10)]
evs[0].raise_for_status()
n = 0
for layer in range(4):
    for kv in range(2):
        for t in range(60):
            s = layout.offset(layer, kv, 3 + t // 16, t % 16, 0)
            d = layout.offset(layer, kv, 10 + t // 16, t % 16, 0)
            row = 8 * 128 * 2
            assert (src.array[s:s + row] == dst.array[d:d + row]).all(), \
                (layer, kv, t)
            n += row
print("%d bytes from %s to %s, equal" % (n, a.daemon_address,
                                        b.daemon_address))
PY
); then
    pass "a request moved between the daemons: $out"
else
    fatal "the transfer: $out"
fi

# step 6 as written, on node B: kvxferctl on B's socket
mkdir "$tmp/bin"
printf '#!/bin/sh\nexec %s --socket %s "$@"\n' "$PWD/$BUILD/kvxferctl" "$tmp/b.sock" \
    >"$tmp/bin/kvxferctl"
chmod +x "$tmp/bin/kvxferctl"
check=$(block 2)
if out=$(cd "$tmp" && PATH=$tmp/bin:$PATH bash -eo pipefail -c "$check" 2>&1); then
    pass "step 6 ran as written"
else
    fail "step 6: $out"
fi
echo "$out" | sed 's/^/  | /'
a_addr=$(grep -o 'kvx://127.0.0.1:[0-9]*/[0-9a-f]*' "$tmp/a.log" | head -n 1)
grep -qF "$a_addr" <<<"$out" && pass "kvxferctl peers lists node A, $a_addr" ||
    fail "kvxferctl peers does not list node A ($a_addr)"
grep -qE '^kvxfer_peers_up(\{[^}]*\})? 1$' <<<"$out" && pass "kvxfer_peers_up 1" ||
    fail "no 'kvxfer_peers_up 1' in the metrics"
grep -E '^kvxfer_peer_bytes_total' <<<"$out" | grep -qvE ' 0$' &&
    pass "kvxfer_peer_bytes_total: bytes moved" ||
    fail "kvxfer_peer_bytes_total shows no bytes"
grep -q 'COMPLETE\|complete' <<<"$out" && pass "kvxferctl requests --done: the fetch, COMPLETE" ||
    fail "kvxferctl requests --done shows no COMPLETE fetch"
[ $failed = 0 ] && echo "test-two-nodes: PASS" || echo "test-two-nodes: FAIL"
exit $failed
