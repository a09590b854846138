#!/bin/sh
# One test, many times, on a loaded machine: peer_link_down_mid_transfer
# (64 requests of 4 MiB between two daemons, the link cut mid-transfer
# and back after both gave each other up) run N times (100) while L busy
# loops (the CPU count) load the CPUs. Counts the runs that failed and
# those whose daemon died of a signal in UCX ("Caught signal" in the log
# the harness prints) or on a UCX assertion ("Assertion"). This is how
# the UCX TCP freed-endpoint crash (docs/architecture.md, "A link that
# comes back ...") was found, in about 1% of runs before the guard in
# daemon/net/ucx.c (5 in about 480; none in 300 of them run through this
# script). Not part of CI.
# Usage:
#   scripts/stress-peer-lost.sh [build]       # N=100 L=$(nproc)
#   N=300 L=0 scripts/stress-peer-lost.sh     # unloaded
#   TEST=peer_gen_lost_while_connecting N=10 scripts/stress-peer-lost.sh
#       # 10 x 50 generation daemons stopped or killed while they
#       # connect (KVX_PEER_LOST_ROUNDS=N rounds a run); UCX 1.13's
#       # "got REP message" abort (docs/operations.md)
# A failed run's whole output is kept in $KEEP (a new directory in /tmp).
B=${1:-build}
N=${N:-100}
L=${L:-$(nproc)}
TEST=${TEST:-peer_link_down_mid_transfer}
[ -x "$B/tests/integration" ] || { echo "no $B/tests/integration: make first" >&2; exit 2; }
hogs=""
i=0
while [ "$i" -lt "$L" ]; do
    sh -c 'while :; do :; done' &
    hogs="$hogs $!"
    i=$((i + 1))
done
trap 'kill $hogs 2>/dev/null' EXIT INT TERM
failed=0 crashed=0
KEEP=${KEEP:-$(mktemp -d /tmp/stress-peer-lost.XXXXXX)}
mkdir -p "$KEEP" || exit 2
log=$KEEP/run.log
for i in $(seq "$N"); do
    if ! KVX_BUILD=$B "$B/tests/integration" "$TEST" >"$log" 2>&1 ||
        ! grep -q '1 passed, 0 failed' "$log"; then
        failed=$((failed + 1))
        if grep -q 'Caught signal\|Assertion' "$log"; then
            crashed=$((crashed + 1))
            echo "run $i: a daemon died of a signal or a UCX assertion:"
        else
            echo "run $i: failed:"
        fi
        grep -a 'Caught signal\|Assertion\|failed\|FAIL' "$log" | head -5
        cp "$log" "$KEEP/run-$i.log"
    fi
done
rm -f "$log"
echo "$TEST: $N runs with $L busy loops: $failed failed, $crashed with a daemon killed by a signal or a UCX assertion (failed runs' output: $KEEP)"
[ "$failed" -eq 0 ]
