#!/bin/sh
# soak.sh — many small requests through one daemon; prints the daemon's
# open fds and memory after each round, which must stay flat.
#
#   scripts/soak.sh [ROUNDS] [REQUESTS_PER_ROUND]   (default 8 x 25000)
#
# Each round is one kvxfer-bench run (context and generation ranks as
# processes of their own, every byte verified) against the same daemon.
set -eu
BUILD=${BUILD:-build}
ROUNDS=${1:-8}
PER=${2:-25000}
dir=$(mktemp -d /tmp/kvx-soak.XXXXXX)
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
printf 'socket:\n  path: %s/s.sock\nlimits:\n  max_requests: 1048576\n' \
    "$dir" > "$dir/k.yaml"
"$BUILD/kvxferd" --config "$dir/k.yaml" 2> "$dir/log" &
pid=$!
for i in $(seq 50); do [ -S "$dir/s.sock" ] && break; sleep 0.1; done
mem() {
    fds=$(ls /proc/$pid/fd | wc -l)
    rss=$(awk '/^VmRSS/ {print $2}' /proc/$pid/status)
    anon=$(awk '/^RssAnon/ {print $2}' /proc/$pid/status)
    echo "$1 requests: fds $fds, VmRSS $rss kB, RssAnon $anon kB"
}
mem 0
total=0
for r in $(seq "$ROUNDS"); do
    "$BUILD/kvxfer-bench" --socket "$dir/s.sock" --requests "$PER" \
        --blocks 1 --layers 1 --heads 1 --head-dim 8 --tokens-per-block 1 \
        --window 64 --no-warmup > "$dir/bench.$r" 2>&1 ||
        { cat "$dir/bench.$r"; exit 1; }
    total=$((total + PER))
    mem "$total"
done
