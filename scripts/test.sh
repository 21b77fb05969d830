#!/usr/bin/env bash
# Set up (with the test extras), check the code (ruff, the import contracts), then run the tests.
#   bash scripts/test.sh            everything (what .ci/run calls)
#   bash scripts/test.sh --fast     the fast lane for your own loop: no test that starts processes or runs long
#                                   (marker slow: every integration test, and those marked so) and none that
#                                   fetches the real model from the package registry (registry); under 3 minutes on
#                                   2 cores. The containers are checked apart (scripts/compose-check.sh, .ci/run).
# Other arguments go to pytest (a path, -k EXPR, -x ...). -rs lists every skipped test's reason at the end (the kernel
# levels this CPU cannot run, tests/support/levels.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check --quiet .
.venv/bin/lint-imports --no-cache >/dev/null || .venv/bin/lint-imports --no-cache  # quiet unless broken
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -q -rs -m "not slow and not registry" "$@"
fi
exec .venv/bin/python -m pytest -q -rs --durations=25 "$@"
