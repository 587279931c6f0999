#!/usr/bin/env bash
# Issue-7 benchmark through the replay tool: the dev trace (input and output lengths mapped to
# a tiny random Llama) replayed over HTTP, streamed /v1/completions, against `lenbatch serve`
# with FIFO and bucketed admission, in static and continuous decode mode (four servers, one
# after another). Writes bench/results/llm-replay-{static,continuous}/report.md.
#
#   bench/llm_replay.sh
#
# The in-process companion with transformers' own continuous batching as a peer is
# bench/llm_bench.py (results in bench/results/llm_tiny_cpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
MODEL=${MODEL:-out/tiny-llama}
DURATION=${DURATION:-60}
RATE=${RATE:-1}
if [[ ! -f "$MODEL/config.json" ]]; then
  .venv/bin/python -c "from lenbatch.runners.tiny import build_tiny_model as b; \
b('$MODEL', 'llama', hidden=256, layers=4, heads=8, max_positions=1024)"
fi
common=(azure-conv --endpoint completions --model "$MODEL"
  --length-scale 0.1 --max-length 400 --output-scale 0.25 --max-output 64
  --rate-scale "$RATE" --start 600 --duration "$DURATION" --strategies fifo,bucketed
  --max-batch 16 --max-wait-ms 20 --no-progress
  --conditions "quiet machine: no other jobs during the run")
for mode in static continuous; do
  .venv/bin/lenbatch bench "${common[@]}" \
    --serve-args "--decode-mode $mode --boundaries 19,37,44,222 --max-batch-tokens 4096" \
    --title "Causal LM ($mode decoding): dev trace replayed over HTTP" \
    --report "bench/results/llm-replay-$mode"
done
