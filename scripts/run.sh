#!/usr/bin/env bash
# Set up .venv and run the whole mesh on loopback (tiny default model, embedded Redis).
# Prints the gateway address and a ready line; Ctrl-C stops every service.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/meshserve up "$@"
