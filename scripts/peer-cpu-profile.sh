#!/bin/bash
# Where the CPU goes between two daemons on one host: per-thread CPU time
# of both daemons (and of ucx_perftest, for comparison) during a long
# kvxfer-bench --daemons 2 run, from /proc/PID/task/*/stat. Run from an
# unpacked bundle:
#   scripts/peer-cpu-profile.sh dist/kvxfer OUTDIR [bench args...]
B=${1:-dist/kvxfer}
OUT=${2:-/tmp/kvx-prof-out}
shift 2
mkdir -p "$OUT"
B=$(cd "$B" && pwd)
KVX_HOME=$B . "$B/env.sh"
HZ=$(getconf CLK_TCK)
snap() { # pid-pattern -> "tid comm utime stime" lines
    for p in $(pgrep -x "$1"); do
        for t in /proc/$p/task/*; do
            # comm may hold spaces in parentheses; fields after it count from ')'
            s=$(cat "$t/stat" 2>/dev/null) || continue
            rest=${s##*) }
            read -r -a g <<<"$rest"
            echo "$p ${t##*/} $(cat "$t/comm") ${g[11]} ${g[12]}"
        done
    done
}
diff_snaps() { # before after seconds
    join -j 1 <(awk '{print $1"/"$2, $3, $4, $5}' "$1" | sort) \
              <(awk '{print $1"/"$2, $4, $5}' "$2" | sort) |
        awk -v hz="$HZ" -v s="$3" '{u=($5-$3)/hz/s*100; k=($6-$4)/hz/s*100;
            if (u+k > 3) printf "  %-22s %-16s user %5.1f%% sys %5.1f%%\n", $1, $2, u, k}'
}
{
    echo "== host"; nproc; lscpu | grep -E "Model name|Socket|Core|Thread|L3|NUMA node" ; uname -r
    echo "== kvxfer-bench $*"
    kvxfer-bench --spawn-daemon --daemons 2 --json --baseline-runs 1 "$@" >"$OUT/prof-bench.json" 2>"$OUT/prof-bench.err" &
    bp=$!
    # one line per busy thread for each second of the run (setup, warm-up
    # and the timed pass alike: the pass is where the main threads, which
    # run the loop and UCX, are busy)
    snap kvxferd >"$OUT/a"
    n=0
    while kill -0 $bp 2>/dev/null; do
        sleep 1; n=$((n + 1))
        snap kvxferd >"$OUT/b"
        echo " second $n"
        diff_snaps "$OUT/a" "$OUT/b" 1
        mv "$OUT/b" "$OUT/a"
    done
    wait $bp
    tail -c 1500 "$OUT/prof-bench.json"; echo
    echo "== ucx_perftest ucp_am_bw 4 MiB"
    ucx_perftest -t ucp_am_bw -s 4194304 -n 4000 -p 13337 >"$OUT/srv.txt" 2>&1 &
    sp=$!
    sleep 1
    ucx_perftest 127.0.0.1 -t ucp_am_bw -s 4194304 -n 4000 -p 13337 -f >"$OUT/cli.txt" 2>&1 &
    cp=$!
    sleep 1
    snap ucx_perftest >"$OUT/a"; sleep 2; snap ucx_perftest >"$OUT/b"
    diff_snaps "$OUT/a" "$OUT/b" 2
    wait $cp; wait $sp
    tail -3 "$OUT/cli.txt"
} 2>&1 | tee "$OUT/profile.txt"
