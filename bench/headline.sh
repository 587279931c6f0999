#!/usr/bin/env bash
# The README's headline: lenbatch as `make serve` runs it against the strongest peers of
# bench/replay_peers.sh, in one `lenbatch bench` run on the same requests (the dev trace mapped
# to MiniLM, a fixed 120 s span from minute 10: ~600 requests at every rate).
#
#   lenbatch  adaptive and bucketed, both with configs/minilm-azure-conv.toml (tuned boundaries,
#             two batches in flight on one torch thread each) and serve's defaults otherwise
#             (--dtype auto: bf16 where the CPU has it; --execution auto: packed for MiniLM)
#   vLLM      model threads on every core, float32 (as in bench/replay_peers.sh) and bf16
#   Infinity  torch engine, float32
#
#   bench/headline.sh      # ~8 min on 2 cores; writes bench/results/headline/
# Peers install themselves on first use into .venv-peers/NAME (see bench/replay_peers.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/headline}
SWEEP=${SWEEP:-16,32,48,64}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
.venv/bin/lenbatch bench azure-conv --length-scale 0.05 --max-length 256 --start 600 --span 120 \
  --rate-sweep "$SWEEP" --keep-server \
  --serve-args "--config configs/minilm-azure-conv.toml --slo-ms 1000 --cost bench/results/cost_minilm_cpu.json" \
  --strategies adaptive,bucketed --peer vllm-allcores,vllm-bf16,infinity \
  --no-progress --conditions "quiet machine: no other jobs during the run" \
  --title "Headline: lenbatch (make serve) against vLLM and Infinity on the dev trace" \
  --report "$OUT"
