#!/bin/sh
# The end-to-end demo: a real kvxferd, two context ranks handing KV blocks
# to two generation ranks (separate processes), every byte verified, and
# the bandwidth beside a memcpy baseline of the same bytes; then the same
# between two daemons over UCX.
set -e
BUILD=${1:-build}
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

echo
echo "== the same through the trtllm layout"
"$BUILD/kvxfer-bench" --socket "$SOCK" --ctx-ranks 2 --gen-ranks 2 \
    --requests 16 --blocks 32 --window 4 --layout trtllm

echo
echo "== one-block requests through the control plane (tiny blocks)"
"$BUILD/kvxfer-bench" --socket "$SOCK" --requests 5000 --blocks 1 \
    --layers 1 --heads 1 --head-dim 64 --window 64

echo
echo "== kvxferctl status"
"$BUILD/kvxferctl" --socket "$SOCK" status | sed -n '1,12p'

kill -TERM $DPID
wait $DPID && echo "== kvxferd drained and exited 0"

echo
echo "== between two daemons (two nodes, here on loopback): context ranks on"
echo "   daemon A, generation ranks on daemon B, UCX between them, verified;"
echo "   beside ucx_perftest on the same transports and message size"
"$BUILD/kvxfer-bench" --spawn-daemon --daemons 2 --ctx-ranks 2 --gen-ranks 2 \
    --requests 8 --blocks 32 --window 4 --layout vllm-nhd
