#!/bin/sh
# Two builds measured alternately in one run, so that a change's effect
# on the figures is told apart from the machine's drift: each round runs
# every case on build A, then on build B (each build's kvxfer-bench
# spawns its own kvxferd). Prints every value, the medians and B/A.
#   scripts/ab-bench.sh BUILD_A BUILD_B [rounds]
# e.g. after `git worktree add /tmp/base <commit> && make -C /tmp/base`:
#   scripts/ab-bench.sh /tmp/base/build build 5
set -eu
A=${1:?build A}
B=${2:?build B}
N=${3:-5}
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
med() { tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
TMP=$(mktemp -d /tmp/ab-bench.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
# label | field | arguments
cat > "$TMP/cases" <<'CASES'
1 GiB host, GB/s|gbps|--requests 16 --blocks 32 --window 4
1 GiB host, ratio to memcpy|ratio|--requests 16 --blocks 32 --window 4
one-block requests/s, window 64|requests_per_s|--requests 20000 --blocks 1 --layers 1 --heads 1 --head-dim 64 --window 64
one-block p50 us, window 1|p50_us|--requests 10000 --blocks 1 --layers 1 --heads 1 --head-dim 64 --window 1
two daemons, GB/s|gbps|--daemons 2 --ctx-ranks 2 --gen-ranks 2 --requests 8 --blocks 32 --window 4
CASES
i=0
while [ $i -lt "$N" ]; do
    i=$((i + 1))
    n=0
    while IFS='|' read -r label f args; do
        n=$((n + 1))
        for side in A B; do
            eval "dir=\$$side"
            # shellcheck disable=SC2086
            out=$("$dir/kvxfer-bench" --spawn-daemon --json $args) ||
                { echo "$label ($side): run failed" >&2; exit 1; }
            echo "$out" | grep -q '"verified":true' ||
                { echo "$label ($side): NOT verified: $out" >&2; exit 1; }
            echo "$out" | field "$f" >> "$TMP/$n.$side"
        done
    done < "$TMP/cases"
done
printf '%-34s %-12s %-12s %s\n' "case (median of $N)" "A" "B" "B/A"
n=0
while IFS='|' read -r label f args; do
    n=$((n + 1))
    a=$(med < "$TMP/$n.A")
    b=$(med < "$TMP/$n.B")
    printf '%-34s %-12s %-12s %s\n' "$label" "$a" "$b" \
        "$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", a ? b / a : 0 }')"
    echo "    A: $(tr '\n' ' ' < "$TMP/$n.A")  B: $(tr '\n' ' ' < "$TMP/$n.B")"
done < "$TMP/cases"
