#!/usr/bin/env bash
# lenbatch against what users would pick (issue 15), in two runs of `lenbatch bench`, each
# under ~8 minutes on 2 cores (vLLM takes about a minute to start, so every server is started
# once per run and replays every rate of the sweep: --keep-server):
#
#   emb   the dev trace mapped to MiniLM (as bench/replay_dev_trace.sh) with a fixed span of
#         trace time, from light load to past saturation: lenbatch (`make serve`'s config,
#         bucketed), fifo, Infinity, vLLM with its default thread binding and with its model
#         on every core, and the naive server;
#   llm   SmolLM2-135M completions at one fixed load: lenbatch continuous decoding, vLLM and
#         llama.cpp (TTFT, inter-token latency, output tokens/s).
#
#   bench/replay_peers.sh                 # both, into bench/results/peers/
#   PARTS=llm bench/replay_peers.sh       # one of them
#
# Infinity, vLLM and llama.cpp install themselves on first use into .venv-peers/NAME (1.4 GB,
# 3.4 GB, 0.2 GB; llama.cpp builds from source, ~3-13 min on 2 cores). vLLM wants Debian's
# libtcmalloc-minimal4. Run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${PARTS:-emb llm}
OUT=${OUT:-bench/results/peers}
START=${START:-600}        # trace window start, seconds (minute 10: a typical stretch)
SPAN=${SPAN:-120}          # seconds of trace time replayed at every rate (~600 requests)
SWEEP=${SWEEP:-4,16,32}    # x4 of the trace's rate (~22 req/s): light here; x32: past saturation
COST=${COST:-bench/results/cost_minilm_cpu.json}
CONFIG=configs/minilm-azure-conv.toml
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
EMB=(azure-conv --length-scale 0.05 --max-length 256 --start "$START" --span "$SPAN"
     --rate-sweep "$SWEEP" --keep-server --serve-args "--config $CONFIG" --cost "$COST"
     --no-progress --conditions "quiet machine: no other jobs during the run")
for part in $PARTS; do
  case $part in
    emb)
      .venv/bin/lenbatch bench "${EMB[@]}" --strategies bucketed,fifo \
        --peer infinity,vllm,vllm-allcores,naive \
        --title "Dev trace on MiniLM: lenbatch, Infinity, vLLM and the naive server" \
        --report "$OUT/embeddings" ;;
    llm)
      .venv/bin/lenbatch bench azure-conv --endpoint completions --model smollm2 \
        --length-scale 0.1 --max-length 256 --output-scale 0.1 --max-output 24 \
        --start "$START" --span "${LLM_SPAN:-5}" --rate-scale "${LLM_RATE:-0.25}" \
        --strategies bucketed --serve-args "--decode-mode continuous" --max-batch 16 \
        --max-wait-ms 20 --peer vllm,llamacpp --timeout 120 --no-progress \
        --conditions "quiet machine: no other jobs during the run" \
        --title "SmolLM2-135M completions at a fixed load: lenbatch, vLLM, llama.cpp" \
        --report "$OUT/completions" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
