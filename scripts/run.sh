#!/usr/bin/env bash
# Set up, write the default tiny model, and run a short offline generation with it.
# (Until the mesh lands, this is what "run meshserve" means: see docs/ROADMAP.md.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
[ -f models/tiny/model.safetensors ] || .venv/bin/meshserve model init models/tiny --preset tiny
cat > models/example.jsonl <<'JSONL'
{"id": "greedy", "prompt": "Kalo mine rusa vo", "max_tokens": 24, "temperature": 0.0}
{"id": "sampled", "prompt": "Def tazi(x1): return", "max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 3}
{"id": "tokens", "prompt_token_ids": [1, 52, 7, 300], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true}
{"id": "bad", "prompt_token_ids": [1, 99999], "max_tokens": 4}
JSONL
.venv/bin/meshserve generate --model models/tiny --input models/example.jsonl --output models/example.out.jsonl "$@"
cat models/example.out.jsonl
