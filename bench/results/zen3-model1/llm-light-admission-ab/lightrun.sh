#!/bin/bash
# $1 tag, $2 src dir (PYTHONPATH), rest: extra serve args
cd /work/main
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T=$1; SRC=$2; shift 2
exec 9>/tmp/lenbatch-bench.lock; flock 9
PYTHONPATH=$SRC .venv/bin/lenbatch serve --model smollm2 --log-level warning --strategy adaptive --port 8797 "$@" > /tmp/s21/$T.server.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8797/health >/dev/null && break; sleep 1; done
.venv/bin/lenbatch replay azure-conv --endpoint completions --length-scale 0.1 --max-length 400 --output-scale 0.25 --max-output 64 --model out/smollm2-tokenizer --served-model smollm2 --rate-scale 0.3 --start 600 --duration 180 --timeout 120 --no-progress --url http://127.0.0.1:8797 --json /tmp/s21/$T.json > /tmp/s21/$T.log 2>&1
curl -s http://127.0.0.1:8797/stats > /tmp/s21/$T.stats.json
kill -INT $SP; wait $SP
