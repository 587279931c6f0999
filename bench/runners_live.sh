#!/usr/bin/env bash
# Issue 14's live comparison on the dev trace (Azure conv mapped to MiniLM: x0.05, clipped at
# 256): lenbatch bucketed in fp32 padded, bf16 padded and bf16 packed, with the naive peer, at
# rates from light load to past saturation, plus the thread/concurrency split. One `lenbatch
# bench` per target (the serve flags differ), each its own report under $OUT/<target>/;
# bench/summarize_runners_live.py tabulates them. Run it on a quiet machine.
# Each target's light-load run is under $OUT/light/, its load runs under $OUT/load/.
#
#   bench/runners_live.sh                       # every target
#   TARGETS="bf16-packed naive" bench/runners_live.sh
#
# Target `before` serves the tree before issue 14 (git archive of $BEFORE) for the event-loop
# CPU per request that `lenbatch calibrate` measures; it needs nothing but git.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-20}  # light load: seconds of traffic at x1.5
LOAD_DURATION=${LOAD_DURATION:-12}  # load: seconds of traffic at the target's highest rate
SAT_DURATION=${SAT_DURATION:-10}  # saturation: seconds of traffic at x28
START=${START:-600}
OUT=${OUT:-bench/results/runners-live}
COST=${COST:-bench/results/cost_minilm_cpu.json}
BEFORE=${BEFORE:-427fde8}
TARGETS=${TARGETS:-before light fp32-padded naive bf16-padded bf16-packed bf16-packed-split}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
CONFIG='--config configs/minilm-azure-conv.toml'

bench() {  # bench NAME SWEEP BENCH-ARGS...
    local name=$1 sweep=$2
    shift 2
    .venv/bin/lenbatch bench azure-conv --length-scale 0.05 --max-length 256 \
        --start "$START" --rate-sweep "$sweep" --no-progress \
        --conditions "exclusive CPU lock: no other benchmark or test during the run" \
        --title "Dev trace on MiniLM: $name" --report "$OUT/$name" "$@"
}

# Light load: the first $DURATION s at x1.5 (94 requests). Load: the first $LOAD_DURATION s at the
# target's highest rate, replayed at fractions of it (`--rate-sweep` scales the same requests'
# arrival times, so every load point holds the same requests and a slower rate runs longer).
light() {  # light NAME BENCH-ARGS...
    local name=$1
    shift
    bench "light/$name" 1 --rate-scale 1.5 --duration "$DURATION" "$@"
}
load() {  # load NAME MAX-RATE FRACTIONS BENCH-ARGS...
    local name=$1 top=$2 fractions=$3
    shift 3
    bench "load/$name" "$fractions" --rate-scale "$top" --duration "$LOAD_DURATION" "$@"
}

for t in $TARGETS; do
    case $t in
    before)
        base=$(mktemp -d)
        git archive "$BEFORE" src | tar -x -C "$base"
        PYTHONPATH="$base/src" light before --strategies bucketed --peer '' \
            --serve-args "$CONFIG" --cost "$COST"
        rm -rf "$base" ;;
    light)
        light fp32-padded --strategies bucketed \
            --serve-args "$CONFIG --dtype float32 --execution padded" --cost "$COST"
        light naive --strategies '' --peer naive
        light bf16-padded --strategies bucketed \
            --serve-args "$CONFIG --dtype bfloat16 --execution padded"
        light bf16-packed --strategies bucketed \
            --serve-args "$CONFIG --dtype bfloat16 --execution packed" ;;
    fp32-padded)  # x5, x7
        load "$t" 7 0.714,1 --strategies bucketed \
            --serve-args "$CONFIG --dtype float32 --execution padded" ;;
    naive)  # x3.5, x5
        load "$t" 5 0.7,1 --strategies '' --peer naive ;;
    bf16-padded)  # x7, x10, x14
        load "$t" 14 0.5,0.714,1 --strategies bucketed \
            --serve-args "$CONFIG --dtype bfloat16 --execution padded" ;;
    bf16-packed)
        load "$t" 14 0.5,0.714,1 --strategies bucketed \
            --serve-args "$CONFIG --dtype bfloat16 --execution packed" ;;
    bf16-packed-split)  # one torch thread, two batches in flight, at x14
        LENBATCH_MODEL__TORCH_THREADS=1 LENBATCH_BATCHING__MAX_CONCURRENT_BATCHES=2 \
            load "$t" 14 1 --strategies bucketed \
            --serve-args "$CONFIG --dtype bfloat16 --execution packed" ;;
    saturation)  # far past capacity (x28, $SAT_DURATION s of traffic): the most real tok/s
        for cfg in "float32 padded" "bfloat16 padded" "bfloat16 packed"; do
            set -- $cfg
            bench "saturation/$1-$2" 1 --rate-scale 28 --duration "$SAT_DURATION" \
                --strategies bucketed --serve-args "$CONFIG --dtype $1 --execution $2"
        done
        # the split: one torch thread, two batches in flight
        LENBATCH_MODEL__TORCH_THREADS=1 LENBATCH_BATCHING__MAX_CONCURRENT_BATCHES=2 \
            bench "saturation/bfloat16-packed-1thread-2batches" 1 --rate-scale 28 \
            --duration "$SAT_DURATION" --strategies bucketed \
            --serve-args "$CONFIG --dtype bfloat16 --execution packed" ;;
    saturation-split)  # the split alone at x28
        LENBATCH_MODEL__TORCH_THREADS=1 LENBATCH_BATCHING__MAX_CONCURRENT_BATCHES=2 \
            bench "saturation/bfloat16-packed-1thread-2batches" 1 --rate-scale 28 \
            --duration "$SAT_DURATION" --strategies bucketed \
            --serve-args "$CONFIG --dtype bfloat16 --execution packed" ;;
    *) echo "unknown target $t" >&2; exit 2 ;;
    esac
done
