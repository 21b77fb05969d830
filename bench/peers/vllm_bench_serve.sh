#!/usr/bin/env bash
# `vllm bench serve` (vLLM's own OpenAI-API load generator) against `vllm serve` and against `meshserve up`, one
# after the other on the same model folder, same requests, same 2 cores.
#   bash bench/peers/vllm_bench_serve.sh VLLM_VENV MODEL_DIR OUT_DIR
# VLLM_VENV: made by ../shared/peers/vllm_cpu/setup.sh. vLLM runs first: its request throughput at unlimited rate
# sets the light rate (half of it, printed and saved in OUT_DIR/light_rate), at which neither server queues, so
# TTFT and TPOT mean latency there. Every system runs at unlimited rate, the light rate and 4 req/s, each at the
# client's default sampling (no temperature sent: both servers sample at 1.0) and with --temperature 0 (greedy).
# Systems: vllm (float32), vllm-bf16; meshserve (one unified worker, both cores; a model folder's GGUF weights stay quantized);
# meshserve-f32 (the same in float32: quantization none); meshserve-bf16 (the same in bfloat16);
# meshserve-disagg (1 prefill + 1 decode worker);
# meshserve-split (the default before machine defaults: 1 prefill + 2 decode workers, quantized weights, float32);
# meshserve-default (`meshserve up` with no config: the defaults it picks for this machine, services/policy/machine.py).
# SYSTEMS, RATES ("inf light 4") and TEMPS ("default 0") select a subset (the light rate needs vllm's inf run, or LIGHT_RATE=R).
# Results: OUT_DIR/{system}-{inf,light,rate4}{,-t0}.json and a side-by-side table (bench/peers/summarize_bench_serve.py)
# with each run's completed requests and each server process's CPU seconds per 1,000 output tokens (bench/proc_cpu.py
# snapshots around every run); for meshserve, the gateway's and router's log lines that report a worker missing or
# forgotten are counted into OUT_DIR/{system}.missing.json. Never run in CI.
set -euo pipefail
VENV=${1:?vLLM venv}; MODEL=${2:?model folder}; OUT=${3:?output folder}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
CLI="$VENV/bin/python $HERE/../shared/peers/vllm_cpu/vllm_cli.py"
NAME=$(basename "$MODEL")
SYSTEMS=${SYSTEMS:-vllm meshserve meshserve-disagg meshserve-default}
RATES=${RATES:-inf light 4}
TEMPS=${TEMPS:-default 0}
mkdir -p "$OUT"
free_port() { "$HERE/.venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wants() { [[ " $SYSTEMS " == *" $1 "* ]]; }

light_rate_from() {  # $1 = vLLM's inf result: half its request throughput, 2 decimals
  "$HERE/.venv/bin/python" -c 'import json,sys; print("%.2f" % (json.load(open(sys.argv[1]))["request_throughput"] / 2))' "$1"
}

bench() {  # $1 = system label, $2 = base url, $3 = the server's root pid (CPU seconds of its process tree)
  for temp in $TEMPS; do
    for rate in $RATES; do
      extra=(); suffix=""
      if [ "$temp" != default ]; then extra=(--temperature "$temp"); suffix="-t$temp"; fi
      case $rate in
        inf) label=inf; r=inf;;
        light) label=light; r=${LIGHT_RATE:-$(cat "$OUT/light_rate" 2>/dev/null || true)}
               [ -n "$r" ] || { echo "no light rate: run vllm at inf first, or set LIGHT_RATE" >&2; continue; };;
        *) label=rate$rate; r=$rate;;
      esac
      run="$1-$label$suffix"
      echo "-- $run (rate $r)"
      (cd "$HERE" && .venv/bin/python -m bench.proc_cpu "$3" --out "$OUT/$run.cpu-before.json")
      $CLI bench serve --backend openai --base-url "$2" --endpoint /v1/completions --model "$NAME" \
        --tokenizer "$MODEL" --dataset-name random --random-input-len 256 --random-output-len 128 \
        --num-prompts 200 --request-rate "$r" --ignore-eos --seed 0 "${extra[@]}" \
        --percentile-metrics ttft,tpot,itl,e2el --save-result --result-dir "$OUT" \
        --result-filename "$run.json" 2>&1 | tail -25
      (cd "$HERE" && .venv/bin/python -m bench.proc_cpu "$3" --out "$OUT/$run.cpu-after.json")
      if [ "$1" = vllm ] && [ "$rate" = inf ] && [ -z "${LIGHT_RATE:-}" ] && [ ! -s "$OUT/light_rate" ]; then
        light_rate_from "$OUT/$run.json" > "$OUT/light_rate"  # RATES lists inf before light
        echo "light rate: $(cat "$OUT/light_rate") req/s (half of vLLM's measured request throughput)"
      fi
    done
  done
}

wait_http() {  # $1 = url
  for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done
  echo "no answer from $1" >&2; return 1
}


vllm_serve() {  # $1 = label, $2 = dtype: its CPU build, both cores, 2 GiB KV cache
  PORT=$(free_port)
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 setsid $CLI serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --dtype "$2" --served-model-name "$NAME" > "$OUT/$1-serve.log" 2>&1 &
  VS=$!
  trap 'kill -TERM -- -$VS 2>/dev/null || true' EXIT
  wait_http "http://127.0.0.1:$PORT"
  echo "== $1 serve (http://127.0.0.1:$PORT)"
  bench "$1" "http://127.0.0.1:$PORT" "$VS"
  kill -TERM -- -$VS; wait $VS || true
}
if wants vllm; then vllm_serve vllm float32; fi
if wants vllm-bf16; then vllm_serve vllm-bf16 bfloat16; fi

mesh() {  # $1 = system label, $2 = config file contents ("" = none)
  PORT=$(free_port)
  config=()
  if [ -n "$2" ]; then printf '%s\n' "$2" > "$OUT/$1.yaml"; config=(--config "$OUT/$1.yaml"); fi
  setsid "$HERE/.venv/bin/meshserve" up --model "$MODEL" "${config[@]}" --http-port "$PORT" \
    --port 0 --router-port 0 --kvstore-port 0 > "$OUT/$1-up.log" 2>&1 &
  UP=$!
  trap 'kill -TERM -- -$UP 2>/dev/null || true' EXIT
  for _ in $(seq 600); do grep -qw ready "$OUT/$1-up.log" && break; sleep 0.5; done
  grep -qw ready "$OUT/$1-up.log"
  logs=$(sed -n 's/.*logs in \([^ ]*\).*/\1/p' "$OUT/$1-up.log" | head -1)
  echo "== $1 (http://127.0.0.1:$PORT, logs in $logs)"
  bench "$1" "http://127.0.0.1:$PORT" "$UP"
  kill -TERM -- -$UP; wait $UP || true
  "$HERE/.venv/bin/python" - "$logs" "$OUT/$1.missing.json" <<'PY'
import json, pathlib, sys
logs = pathlib.Path(sys.argv[1])
count = lambda name, text: sum(ln.count(text) for ln in (logs / name).read_text(errors="replace").splitlines()) \
    if (logs / name).exists() else 0
out = {"gateway: no live worker": count("gateway.log", "no live"),
       "gateway: resumed": count("gateway.log", "resuming after"),
       "router: forgot a worker": sum(count(p.name, "forgetting worker") for p in logs.glob("router*.log"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(out) + "\n")
print("missing workers:", out)
PY
}

wants meshserve && mesh meshserve "mesh: {mode: unified, unified: 1}
engine: {kv_cache_gb: 2, threads: 2, max_num_seqs: 256, max_num_batched_tokens: 2048, quantization: auto}"
wants meshserve-f32 && mesh meshserve-f32 "mesh: {mode: unified, unified: 1}
engine: {kv_cache_gb: 2, threads: 2, max_num_seqs: 256, max_num_batched_tokens: 2048, quantization: none}"
wants meshserve-bf16 && mesh meshserve-bf16 "mesh: {mode: unified, unified: 1}
engine: {kv_cache_gb: 2, threads: 2, max_num_seqs: 256, max_num_batched_tokens: 2048, quantization: none, dtype: bfloat16}"
wants meshserve-disagg && mesh meshserve-disagg "mesh: {mode: disaggregated, prefill: 1, decode: 1}
engine: {kv_cache_gb: 1, threads: 1, max_num_seqs: 256, max_num_batched_tokens: 2048, quantization: auto}"
wants meshserve-split && mesh meshserve-split "mesh: {mode: disaggregated}
engine: {quantization: auto}"
wants meshserve-default && mesh meshserve-default ""
"$HERE/.venv/bin/python" "$HERE/bench/peers/summarize_bench_serve.py" "$OUT"
