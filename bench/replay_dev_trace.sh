#!/usr/bin/env bash
# The dev-trace comparison of issue 5: every strategy and both peers on the Azure conversation
# trace mapped to MiniLM, in one run. Run it on a quiet machine; it writes
# bench/results/replay-dev-trace/ (report.md, PNG plots, runs/*.json).
#
#   bench/replay_dev_trace.sh                 # defaults below
#   RATE=3 DURATION=600 bench/replay_dev_trace.sh
#   COST=cost.json bench/replay_dev_trace.sh  # with the simulator's predictions
#
# Needs the Ray extra for the ray peer: .venv/bin/pip install torch==2.13.0 'lenbatch[ray]'
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-2}            # arrival-rate multiplier of the trace (pick one near fifo's capacity)
DURATION=${DURATION:-300}  # seconds of (scaled) traffic to replay
START=${START:-0}          # window start in the trace, seconds
SWEEP=${SWEEP:-1}          # e.g. 0.5,1,1.5 for a rate sweep
OUT=${OUT:-bench/results/replay-dev-trace}
extra=()
if [[ -n "${COST:-}" ]]; then extra+=(--cost "$COST"); fi
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/lenbatch bench azure-conv \
    --length-scale 0.0625 --max-length 256 --rate-scale "$RATE" \
    --start "$START" --duration "$DURATION" --rate-sweep "$SWEEP" \
    --strategies static,fifo,sorted,bucketed --peer naive,ray \
    --no-progress --report "$OUT" "${extra[@]}"
