#!/usr/bin/env bash
# The dev-trace comparison of issue 5: every strategy and both peers on the Azure conversation
# trace mapped to MiniLM (x0.05, clipped to 256: docs/traffic.md says why), in one run, with
# the simulator's prediction of each strategy beside the live figures. Run it on a quiet
# machine; it writes bench/results/replay-dev-trace/ (report.md, PNG plots, runs/*.json).
#
#   bench/replay_dev_trace.sh                 # the committed report's settings
#   RATE=3 DURATION=300 bench/replay_dev_trace.sh
#
# Needs the Ray extra for the ray peer: .venv/bin/pip install torch==2.13.0 -e '.[ray]'
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-3.5}          # arrival-rate multiplier: above fifo's capacity, below bucketed's
DURATION=${DURATION:-60}  # seconds of (scaled) traffic to replay per run
START=${START:-600}        # window start in the trace, seconds (minute 10: a typical stretch)
SWEEP=${SWEEP:-0.3,1}      # light load (x0.3 of RATE) and the main point
COST=${COST:-bench/results/cost_minilm_cpu.json}
OUT=${OUT:-bench/results/replay-dev-trace}
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/lenbatch bench azure-conv \
    --length-scale 0.05 --max-length 256 --rate-scale "$RATE" \
    --start "$START" --duration "$DURATION" --rate-sweep "$SWEEP" \
    --strategies static,fifo,sorted,bucketed --peer naive,ray \
    --serve-args '--config configs/minilm-azure-conv.toml' --cost "$COST" \
    --no-progress --conditions "quiet machine: no other jobs during the run" \
    --title "Dev trace on MiniLM: every strategy and two peers in one run" --report "$OUT"
