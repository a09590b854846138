#!/bin/sh
# The end-to-end demo: a real kvxferd, two context ranks handing KV blocks
# to two generation ranks (separate processes), every byte verified, and
# the bandwidth beside a memcpy baseline of the same bytes; then the same
# between two daemons over UCX.
#
# After each part it says how to read the figures: what a small machine
# (2 CPUs, like CI's VM; docs/benchmarks.md has its measured rows) shows,
# and which figures mean trouble.
set -e
BUILD=${1:-build}
# How to read the part above: what is expected, what means trouble.
read_it() {
    echo "   expected on a small machine: $1"
    echo "   trouble: $2"
}
DIR=$(mktemp -d /tmp/kvxfer-demo.XXXXXX)
SOCK=$DIR/kvxferd.sock
cleanup() { kill "$DPID" 2>/dev/null || true; wait "$DPID" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT INT TERM

echo "== starting kvxferd on $SOCK"
"$BUILD/kvxferd" --socket "$SOCK" 2>"$DIR/kvxferd.log" &
DPID=$!
i=0
while [ ! -S "$SOCK" ]; do
    i=$((i + 1)); [ $i -lt 100 ] || { cat "$DIR/kvxferd.log"; exit 1; }
    sleep 0.05
done

echo "== 2 context ranks -> 2 generation ranks, vllm-nhd, 1 GiB, verified"
"$BUILD/kvxfer-bench" --socket "$SOCK" --ctx-ranks 2 --gen-ranks 2 \
    --requests 16 --blocks 32 --window 4 --layout vllm-nhd

read_it "ratio 0.7 to 1.5 (kvxferd against memcpy of the same bytes;
     a 2-CPU VM swings about 2x from run to run), verified yes" \
    "verified anything but yes (stop: bytes went wrong), or a ratio below
     0.5 on an otherwise idle machine (copy threads starved: see
     copy.worker_threads, copy.pin_threads, other load)"

echo
echo "== the same through the trtllm layout"
"$BUILD/kvxfer-bench" --socket "$SOCK" --ctx-ranks 2 --gen-ranks 2 \
    --requests 16 --blocks 32 --window 4 --layout trtllm
read_it "as above: the layout changes the copy's runs, not the bytes" \
    "as above"

echo
echo "== one-block requests through the control plane (tiny blocks)"
"$BUILD/kvxfer-bench" --socket "$SOCK" --requests 5000 --blocks 1 \
    --layers 1 --heads 1 --head-dim 64 --window 64
read_it "read requests/s, not GB/s or the ratio (2 KiB requests measure
     the control plane): 7,000 to 30,000 on a 2-CPU VM (more with
     --batch), p99 a few ms with 64 in flight" \
    "under 2,000 requests/s, or a p99 over 50 ms (the loop is starved
     or the socket is slow: kvxferctl status, loop lag)"

echo
echo "== kvxferctl status"
"$BUILD/kvxferctl" --socket "$SOCK" status | sed -n '1,13p'
read_it "errors by code: none; every request state at 0 once the
     benches are done" \
    "requests still in flight after the benches ended (kvxferctl requests
     says which and in what state), or any error count"

echo
echo "== kvxferctl requests --done: the last finished requests"
"$BUILD/kvxferctl" --socket "$SOCK" requests --done | sed -n '1,2p;$p'
read_it "outcome complete, path host, bytes as the bench moved" \
    "any other outcome: its code says why (docs/operations.md)"

kill -TERM $DPID
wait $DPID && echo "== kvxferd drained and exited 0"

echo
echo "== between two daemons (two nodes, here on loopback): context ranks on"
echo "   daemon A, generation ranks on daemon B, UCX between them, verified;"
echo "   beside ucx_perftest on the same transports and message size"
"$BUILD/kvxfer-bench" --spawn-daemon --daemons 2 --ctx-ranks 2 --gen-ranks 2 \
    --requests 8 --blocks 32 --window 4 --layout vllm-nhd
read_it "over TCP on loopback 1 to 3.5 GB/s, a ratio of 0.3 to 1.7 against
     ucx_perftest (which is itself noisy here), verified yes" \
    "verified anything but yes, errors, a per-slot wait of seconds, or
     a ratio under 0.2 (look at kvxferctl peers and the UCX transports:
     a fallback transport or a lost peer)"
