#!/usr/bin/env bash
# Create .venv with meshserve and its pinned dependencies (idempotent).
# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
# The C++ kernels, built now for this CPU, so that no start compiles (services/engine/layers/kernels.py).
.venv/bin/python -m services.engine.layers.kernels
if [ "$extras" = test ]; then  # the kernel tests run every level this CPU can: build them now, not in the tests
  .venv/bin/python -m services.engine.layers.kernels --runnable-levels
fi
echo "meshserve installed in .venv"
