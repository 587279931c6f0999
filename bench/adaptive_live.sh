#!/usr/bin/env bash
# Live runs for bench/results/adaptive.md: adaptive vs fifo, bucketed (defaults), the best fixed
# bucketed config the simulator's grid found (bench/adaptive_sim.py), and the naive peer, on a
# control (mixed Poisson), ON/OFF bursts and length drift. Run under the exclusive CPU lock.
# Usage: bench/adaptive_live.sh OUT_DIR [DURATION_S]
set -euo pipefail
out=${1:?output folder}
dur=${2:-25}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cost=bench/results/cost_minilm_cpu.json
common=(--duration "$dur" --max-length 256 --no-progress --clients 16)
serve="--slo-ms 1000 --cost $cost"
run() {  # scenario rate strategies peers extra-serve-args folder
  .venv/bin/lenbatch bench --scenario "$1" --rate "$2" "${common[@]}" --strategies "$3" \
    ${4:+--peer "$4"} --serve-args "$serve $5" --report "$out/$6" >/dev/null
}
run onoff 20 fifo,bucketed,adaptive naive "" onoff
run onoff 20 bucketed "" "--max-batch 16 --max-wait-ms 5" onoff-best
run drift 20 fifo,bucketed,adaptive naive "" drift
run drift 20 bucketed "" "--max-batch 8 --max-wait-ms 0" drift-best
run mixed 10 bucketed,adaptive "" "" mixed
