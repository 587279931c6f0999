#!/usr/bin/env bash
# Issue-16 benchmark: SmolLM2-135M-Instruct behind `lenbatch serve`, the dev trace mapped as in
# the issue (input x0.1 clipped at 400, output x0.25 clipped at 64, 60 s from t=600 s), streamed
# /v1/completions driven by `lenbatch replay`, one server at a time on 127.0.0.1.
#
#   bench/llm_decode_replay.sh RATE LABEL[:SERVE_ARGS] ...
#   e.g. BEFORE_SRC=/tmp/base/src bench/llm_decode_replay.sh 0.3 before "after:--dtype auto"
#
# A label starting with "before" runs the tree at $BEFORE_SRC (PYTHONPATH, e.g. an unpacked
# `git archive` of main) with the same venv; every other label runs this worktree. Each run
# writes bench/results/llm-decode-replay/<label>-x<RATE>.json (the replay summary) and its
# server's /stats as <label>-x<RATE>.stats.json. Summarise with bench/llm_decode_table.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RATE=$1
shift
PORT=${PORT:-8500}
MODEL=${MODEL:-smollm2}
DURATION=${DURATION:-60}
OUT=${OUT:-bench/results/llm-decode-replay}
mkdir -p "$OUT"
TOK=$MODEL
if [[ "$MODEL" == smollm2 ]]; then
  # `lenbatch replay` sizes bodies with a tokenizer folder; SmolLM2 ships as GGUF only.
  TOK=out/smollm2-tokenizer
  [[ -f $TOK/config.json ]] || .venv/bin/python -c "
from transformers import AutoConfig, AutoTokenizer
from lenbatch.runners.causal import SMOLLM2_GGUF as G, smollm2_folder as f
AutoTokenizer.from_pretrained(f(), gguf_file=G).save_pretrained('$TOK')
AutoConfig.from_pretrained(f(), gguf_file=G).save_pretrained('$TOK')"
fi
pid=""
trap '[[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null; true' EXIT
for spec in "$@"; do
  label=${spec%%:*}
  args=""
  [[ "$spec" == *:* ]] && args=${spec#*:}
  pypath=""
  [[ "$label" == before* ]] && pypath=${BEFORE_SRC:?set BEFORE_SRC to the old tree\'s src}
  # shellcheck disable=SC2086
  PYTHONPATH=$pypath .venv/bin/lenbatch serve --model "$MODEL" --port "$PORT" \
    --log-level warning $args > "$OUT/$label-x$RATE.server.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 0.5
  done
  .venv/bin/lenbatch replay azure-conv --endpoint completions --model "$TOK" --served-model "$MODEL" \
    --length-scale 0.1 --max-length 400 --output-scale 0.25 --max-output 64 \
    --rate-scale "$RATE" --start 600 --duration "$DURATION" --timeout 120 --no-progress \
    --url "http://127.0.0.1:$PORT" --json "$OUT/$label-x$RATE.json"
  curl -sf "http://127.0.0.1:$PORT/stats" > "$OUT/$label-x$RATE.stats.json" || true
  kill -TERM "$pid"
  wait "$pid" || true
  pid=""
done
