#!/bin/sh
# kvxfer beside NIXL, one run (issue 20): kvxfer-bench and NIXL move the
# same KV blocks between the same pools on one GPU, each beside the
# cudaMemcpy baseline of the same bytes.
#
#   [MEM=vram|dram] [REQUESTS=16] [BLOCKS=1000] [WINDOW=4] [PASSES=3]
#   [ORDERS="same shuffled"] [CTX_DEVICE=0] [GEN_DEVICE=0]
#       scripts/compare-nixl.sh BUNDLE WHEELS OUTDIR
#
# BUNDLE is an unpacked `make bundle` (dist/kvxfer); WHEELS a folder with
# the nixl-cu13 wheel from PyPI (`pip download --no-deps nixl-cu13`; a
# wheel slimmed by scripts/wheel-drop.py does too), installed with pip,
# offline, into a temporary folder; OUTDIR gets five files: kvxfer.jsonl
# and nixl.jsonl (one JSON line per run), nixl-ucx.log (NIXL's UCX with
# UCX_PROTO_INFO=y: the protocols and transports it chose), run.log and
# summary.txt (the table).
#
# The shape is vLLM's for an 8B model: 32 layers, 8 KV heads of 128, bf16,
# 16-token blocks, so one block of one layer's K or V is 32 KiB; each
# side's pool is an allocation per layer ([2, blocks, 16, 8, 128]) holding
# REQUESTS x BLOCKS blocks, and request r uses blocks r*BLOCKS.. on both
# sides. ORDERS: "same" is kvxfer-bench's block ids (a request's blocks
# are neighbours, so NIXL merges its 32 KiB descriptors into one per
# region); "shuffled" gives each side a random permutation of its pool
# (kvxfer-bench --shuffle, nixl_bench.py --order shuffled), as an engine's
# block tables look after reuse: one 32 KiB descriptor per block, vLLM's
# case. kvxfer runs first, then NIXL; the GPU holds one pair of pools at a
# time. MEM=dram runs both on host memory (a CPU machine's dry run).
# CTX_DEVICE and GEN_DEVICE put the prefill (context) and decode
# (generation) pools on two GPUs: on one H200 NIXL's UCX did not READ
# through CUDA IPC (docs/history/benchmarks.md, "kvxfer beside NIXL"); between
# NVLink peers it should. UCX_* variables set here reach NIXL's UCX.
#
# Exits 2 with a message when there is no GPU (MEM=vram), no wheel or no
# bundle; 1 when a run failed or moved wrong bytes.
set -u
usage() {
    echo "usage: [MEM=vram|dram] [REQUESTS=16] [BLOCKS=1000] [WINDOW=4]" \
         "[PASSES=3] [ORDERS=\"same shuffled\"] [CTX_DEVICE=0]" \
         "[GEN_DEVICE=0]" \
         "scripts/compare-nixl.sh BUNDLE WHEELS OUTDIR" >&2
    exit 2
}
[ $# -eq 3 ] || usage
B=$1; WHEELS=$2; OUT=$3
MEM=${MEM:-vram}; REQUESTS=${REQUESTS:-16}; BLOCKS=${BLOCKS:-1000}
WINDOW=${WINDOW:-4}; PASSES=${PASSES:-3}; ORDERS=${ORDERS:-"same shuffled"}
CTX_DEVICE=${CTX_DEVICE:-0}; GEN_DEVICE=${GEN_DEVICE:-0}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
die() { echo "compare-nixl: $*" >&2; exit 2; }

[ -x "$B/bin/kvxfer-bench" ] && [ -f "$B/env.sh" ] ||
    die "$B is not a kvxfer bundle (make bundle makes dist/kvxfer)"
B=$(cd "$B" && pwd)
# the bundle's environment (its libraries, its UCX) for kvxfer alone
kvx() { (KVX_HOME=$B; export KVX_HOME; . "$B/env.sh"; "$@"); }
help=$(kvx kvxfer-bench --help 2>&1)
case $help in *--spawn-daemon*) ;; *)
    die "$B/bin/kvxfer-bench does not run here: $help" ;;
esac
case " $ORDERS " in *" shuffled "*)
    case $help in *--shuffle*) ;; *)
        die "$B/bin/kvxfer-bench has no --shuffle (a bundle older than" \
            "this script); rebuild it or give ORDERS=same" ;;
    esac ;;
esac
case $MEM in
vram)
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 ||
        die "no NVIDIA GPU or driver here (MEM=dram runs on host memory)"
    "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
        2>/dev/null || die "$PY has no torch that sees a GPU"
    ;;
dram) ;;
*) usage ;;
esac
mkdir -p "$OUT" || die "cannot make $OUT"
OUT=$(cd "$OUT" && pwd)
: >"$OUT/kvxfer.jsonl"; : >"$OUT/nixl.jsonl"; : >"$OUT/nixl-ucx.log"
log() { echo "$*" | tee -a "$OUT/run.log"; }
: >"$OUT/run.log"

# NIXL: the wheel, installed offline into a folder of its own; its UCX is
# the wheel's (nixl_cu13.libs), not the bundle's
SITE=$(mktemp -d /tmp/compare-nixl.XXXXXX) || die "mktemp failed"
trap 'rm -rf "$SITE"' EXIT
set -- "$WHEELS"/nixl_cu13-*.whl
[ -f "$1" ] || die "no nixl_cu13-*.whl in $WHEELS (pip download --no-deps" \
    "--only-binary=:all: nixl-cu13 -d $WHEELS, with --python-version and" \
    "--platform for another machine's Python)"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "$@" >>"$OUT/run.log" 2>&1 ||
    die "pip could not install $* (see $OUT/run.log)"
log "nixl: $(basename "$1") ($(du -k "$1" | cut -f1) KiB)"

SHAPE="--layers 32 --heads 8 --head-dim 128 --tokens-per-block 16"
# a block across its layers: 32 layers x K, V x 32 KiB = 2 MiB
POOL_MIB=$((REQUESTS * BLOCKS * 2 + 64))
if [ "$MEM" = vram ]; then
    KGPU="--gpu --ctx-device $CTX_DEVICE --gen-device $GEN_DEVICE"
else
    KGPU=""
fi
rc=0
for order in $ORDERS; do
    case $order in
    same) kflag="" ;;
    shuffled) kflag="--shuffle" ;;
    *) die "ORDERS: '$order' is neither same nor shuffled" ;;
    esac
    cmd="kvxfer-bench --spawn-daemon $KGPU $SHAPE --dtype bf16 --layout vllm-nhd --regions 32 --requests $REQUESTS --blocks $BLOCKS --window $WINDOW --pool-mib $POOL_MIB --passes $PASSES --json $kflag"
    log "== kvxfer, $order: $cmd"
    kvx timeout 150 $cmd >"$OUT/kvxfer.tmp" 2>>"$OUT/run.log" || {
        log "kvxfer, $order: failed (rc $?)"; rc=1; }
    grep '^{' "$OUT/kvxfer.tmp" | sed "s/^{/{\"order\":\"$order\",/" \
        >>"$OUT/kvxfer.jsonl"
    rm -f "$OUT/kvxfer.tmp"

    nargs="--mem $MEM --device $GEN_DEVICE --remote-device $CTX_DEVICE $SHAPE --elem-bytes 2 --requests $REQUESTS --blocks $BLOCKS --window $WINDOW --passes $PASSES --order $order"
    log "== NIXL, $order: UCX_PROTO_INFO=y nixl_bench.py $nargs"
    echo "==== $order" >>"$OUT/nixl-ucx.log"
    # UCX prints its protocol tables on stdout and stderr
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" UCX_PROTO_INFO=y \
        timeout 150 "$PY" "$HERE/nixl_bench.py" $nargs --out "$OUT/nixl.jsonl" \
        >>"$OUT/nixl-ucx.log" 2>&1 || {
        log "NIXL, $order: failed (rc $?; the end of nixl-ucx.log says why)"
        rc=1; }
done
"$PY" "$HERE/nixl_bench.py" --report "$OUT/kvxfer.jsonl" "$OUT/nixl.jsonl" \
    "$OUT/nixl-ucx.log" | tee "$OUT/summary.txt"
exit $rc
