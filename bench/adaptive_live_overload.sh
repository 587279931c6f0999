#!/usr/bin/env bash
# Live runs past this CPU's capacity (bench/results/adaptive.md, second table): ON/OFF bursts
# and length drift at a higher reference rate, adaptive vs bucketed (defaults) and the naive
# peer. Run under the exclusive CPU lock. Usage: bench/adaptive_live_overload.sh OUT RATE [DUR]
set -euo pipefail
out=${1:?output folder}
rate=${2:?reference rate}
dur=${3:-25}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
serve="--slo-ms 1000 --cost bench/results/cost_minilm_cpu.json"
for sc in onoff drift; do
  .venv/bin/lenbatch bench --scenario "$sc" --rate "$rate" --duration "$dur" --max-length 256 \
    --no-progress --clients 16 --strategies bucketed,adaptive --peer naive \
    --serve-args "$serve" --report "$out/$sc" >/dev/null
done
