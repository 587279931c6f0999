#!/usr/bin/env bash
# Issue 16's benchmark with the peers in ONE `lenbatch bench` run: SmolLM2-135M-Instruct, the dev
# trace mapped as in the issue (input x0.1 clipped at 400, output x0.25 clipped at 64,
# ignore_eos), streamed /v1/completions, the same 30 s of the trace from t=600 s replayed at
# every rate of the sweep (a light load and one near lenbatch's capacity on a 2-core CPU).
#
#   lenbatch  `lenbatch serve --model smollm2` as shipped (continuous, --dtype auto: float32 on
#             a CPU without native bf16); --compile is left off (see llm_decode_cpu.md)
#   vLLM      vllm-allcores: model threads on every core, float32 (the GGUF dequantized to an
#             HF folder)
#   llama.cpp the GGUF itself (Q4_1 weights), every core, one request at a time
#
#   LENBATCH_PEERS_DIR=/work/peers flock /tmp/lenbatch-bench.lock bench/llm_decode_peers.sh
# Peers whose venv is missing install themselves on first use (minutes); PEERS=vllm-allcores
# leaves llama.cpp out.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-bench/results/llm-decode-peers}
.venv/bin/lenbatch bench azure-conv --endpoint completions --model smollm2 \
  --length-scale 0.1 --max-length 400 --output-scale 0.25 --max-output 64 \
  --start 600 --span "${SPAN:-30}" --rate-sweep "${SWEEP:-0.15,0.3}" --keep-server \
  --strategies bucketed --peer "${PEERS:-vllm-allcores,llamacpp}" --timeout 120 --no-progress \
  --conditions "${CONDITIONS:-2-core CPU shared with other jobs}" \
  --title "SmolLM2-135M completions, issue 16's mapping: lenbatch, vLLM and llama.cpp" \
  --report "$OUT"
