#!/bin/sh
# The cost of the metrics endpoint on the hot path (issue 40): each case
# runs alternately with no endpoint (the default, metrics.listen empty:
# the baseline) and with the endpoint on and scraped every second, in
# one run, so that the machine's drift falls on both alike. Prints every
# value, the medians, scraped/baseline and the median of each round's
# ratio (target: within 2 %).
#   scripts/bench-metrics.sh [BUILD] [rounds]      (default: build 5)
# (rounds 0: only the CPU costs at the end)
# Cases: one-block requests per second (window 64, 200000 requests: a few
# seconds, several scrapes) and kvxfer-bench's default shape (64
# requests of 256 blocks, 5 timed passes). Then, on idle daemons, what
# each part costs in CPU time, which a busy machine cannot hide the way
# it hides a few percent of throughput: the loop's per snapshot (one
# daemon publishing every 10 ms for 20 s against one without the
# endpoint) and the HTTP thread's per scrape (2000 scrapes).
set -eu
BUILD=${1:-build}
N=${2:-5}
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
med() { tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
TMP=$(mktemp -d /tmp/bench-metrics.XXXXXX)
scraper=""
cleanup() {
    [ -z "$scraper" ] || kill "$scraper" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
# a free port for the endpoint (asked of the kernel, then let go)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
: > "$TMP/off.yaml"
printf 'metrics:\n  listen: 127.0.0.1:%s\n  publish_ms: 1000\n' "$port" > "$TMP/on.yaml"
# GET /metrics every second; counts the scrapes that answered 200
cat > "$TMP/scrape.py" <<'PY'
import sys, time, urllib.request
url, out = f"http://127.0.0.1:{sys.argv[1]}/metrics", sys.argv[2]
n = 0
while True:
    t = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            r.read()
            n += r.status == 200
            with open(out, "w") as f:
                f.write(str(n))
    except OSError:
        pass
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
PY
# label | field | arguments
cat > "$TMP/cases" <<'CASES'
one-block requests/s, window 64|requests_per_s|--requests 200000 --blocks 1 --layers 1 --heads 1 --head-dim 64 --window 64
default shape, GB/s|gbps|--passes 5
CASES
echo "bench-metrics: $BUILD, $N rounds, $(nproc) CPUs; endpoint at 127.0.0.1:$port, scraped every 1 s"
i=0
while [ $i -lt "$N" ]; do
    i=$((i + 1))
    n=0
    while IFS='|' read -r label f args; do
        n=$((n + 1))
        for side in off on; do
            if [ $side = on ]; then
                rm -f "$TMP/scrapes"
                python3 "$TMP/scrape.py" "$port" "$TMP/scrapes" &
                scraper=$!
            fi
            # shellcheck disable=SC2086
            out=$("$BUILD/kvxfer-bench" --spawn-daemon --daemon-config \
                  "$TMP/$side.yaml" --json $args) ||
                { echo "$label ($side): run failed" >&2; exit 1; }
            if [ $side = on ]; then
                kill "$scraper"; wait "$scraper" 2>/dev/null || true
                scraper=""
                s=$(cat "$TMP/scrapes" 2>/dev/null || echo 0)
                [ "$s" -gt 0 ] ||
                    { echo "$label: no scrape answered: is the endpoint up?" >&2; exit 1; }
                echo "$s" >> "$TMP/$n.scrapes"
            fi
            echo "$out" | grep -q '"verified":true' ||
                { echo "$label ($side): NOT verified: $out" >&2; exit 1; }
            echo "$out" | field "$f" >> "$TMP/$n.$side"
        done
    done < "$TMP/cases"
done
[ "$N" -gt 0 ] &&
    printf '%-34s %-12s %-12s %s\n' "case (median of $N)" "no endpoint" "scraped" "ratio"
n=0
[ "$N" -gt 0 ] && while IFS='|' read -r label f args; do
    n=$((n + 1))
    a=$(med < "$TMP/$n.off")
    b=$(med < "$TMP/$n.on")
    printf '%-34s %-12s %-12s %s\n' "$label" "$a" "$b" \
        "$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", a ? b / a : 0 }')"
    # each round's scraped / no endpoint: drift between rounds cancels
    r=$(paste -d' ' "$TMP/$n.off" "$TMP/$n.on" |
        awk '{ if ($1) printf "%.3f\n", $2 / $1 }' | med)
    echo "    median of the rounds' ratios: $r"
    echo "    no endpoint: $(tr '\n' ' ' < "$TMP/$n.off")"
    echo "    scraped:     $(tr '\n' ' ' < "$TMP/$n.on") (scrapes a run: $(tr '\n' ' ' < "$TMP/$n.scrapes"))"
done < "$TMP/cases"

# ---- CPU per snapshot and per scrape, idle daemons ----------------------
cpu() { awk '{print $14 + $15}' "/proc/$1/task/$2/stat"; } # 1/100 s
hz=$(getconf CLK_TCK)
printf 'socket:\n  path: %s/a.sock\n' "$TMP" > "$TMP/a.yaml"
printf 'socket:\n  path: %s/b.sock\nmetrics:\n  listen: 127.0.0.1:%s\n  publish_ms: 10\n' \
    "$TMP" "$port" > "$TMP/b.yaml"
"$BUILD/kvxferd" --config "$TMP/a.yaml" > "$TMP/a.log" 2>&1 &
pa=$!
"$BUILD/kvxferd" --config "$TMP/b.yaml" > "$TMP/b.log" 2>&1 &
pb=$!
sleep 1
mhd=$(grep -l MHD "/proc/$pb/task/"*/comm | sed 's|.*/task/\([0-9]*\)/comm|\1|')
a0=$(cpu $pa $pa); b0=$(cpu $pb $pb)
sleep 20
a1=$(cpu $pa $pa); b1=$(cpu $pb $pb)
m0=$(cpu $pb "$mhd")
python3 - "$port" <<'PY'
import sys, urllib.request
for _ in range(2000):
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read()
PY
m1=$(cpu $pb "$mhd")
kill $pa $pb; wait $pa $pb 2>/dev/null || true
awk -v a=$((a1 - a0)) -v b=$((b1 - b0)) -v m=$((m1 - m0)) -v hz="$hz" 'BEGIN {
    snap = (b - a) / hz / 2000 * 1e6; scrape = m / hz / 2000 * 1e6
    printf "loop CPU per snapshot: %.0f us (20 s: %d ticks publishing every 10 ms, %d without); at the default 1 s: %.4f %% of the loop\n", snap, b, a, snap / 1e4
    printf "HTTP thread CPU per scrape: %.0f us (2000 scrapes: %d ticks of %d Hz); none on the loop\n", scrape, m, hz }'
