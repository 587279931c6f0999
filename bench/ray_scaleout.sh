#!/usr/bin/env bash
# Issue 13: lenbatch on Ray Serve. Two replicas (1 torch thread each) with length-aware routing
# (`ray-lenbatch`), the same two replicas with Ray's default routing, power of two choices
# (`ray-lenbatch-p2c`), and one `lenbatch serve --strategy bucketed` using both cores, on the
# same dev trace (Azure conversation lengths mapped to MiniLM, as bench/replay_dev_trace.sh) at
# the same rates, in one `lenbatch bench` run; then bench/ray_scaleout_table.py turns the runs
# into the tables of bench/results/ray_scaleout.md. All three read the same configuration
# (configs/minilm-azure-conv.toml: the peers through LENBATCH_CONFIG).
#
#   bench/ray_scaleout.sh                                  # SWEEP=3,5,7 DURATION=120
#   SWEEP=7 OUT=bench/results/ray-scaleout-x7 bench/ray_scaleout.sh   # a rate on its own
#
# Needs the Ray extra (make install does it). Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-1}
SWEEP=${SWEEP:-3,5,7}
DURATION=${DURATION:-120}  # seconds of trace at x1: ~550 requests, replayed at each rate
START=${START:-600}
CONFIG=${CONFIG:-configs/minilm-azure-conv.toml}
OUT=${OUT:-bench/results/ray-scaleout}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 LENBATCH_CONFIG="$CONFIG"
# Ray starts its workers (the replicas, the ingress) at nice 15 by default; the single server
# runs at nice 0. Run both at 0, so that a niced background job on a shared machine does not
# take CPU from one side only.
export RAY_worker_niceness=${RAY_worker_niceness:-0}
exec .venv/bin/lenbatch bench azure-conv \
    --length-scale 0.05 --max-length 256 --rate-scale "$RATE" \
    --start "$START" --duration "$DURATION" --rate-sweep "$SWEEP" \
    --strategies bucketed --peer ray-lenbatch,ray-lenbatch-p2c \
    --serve-args "--config $CONFIG" --no-progress \
    --conditions "exclusive CPU lock: no other benchmark or test during the run" \
    --title "lenbatch on Ray Serve: 2 replicas, length-aware vs default routing, vs one server" \
    --report "$OUT"
