#!/usr/bin/env bash
# The container check (.ci/run runs it after the tests, under its own time limit): a container engine (made where
# none is), the images, then scripts/compose_check.py against `docker compose up` of deploy/docker-compose.yml.
# Skipped, with the reason printed, only where no container engine can be made.
#
#   bash scripts/compose-check.sh [RESULTS_DIR]      # figures as JSON there; MESHSERVE_KV_HOP_MB=256 adds the KV hop
#
# Two runs of scripts/compose_check.py: the mesh (up, Paris, one trace, scale to 3, kill under load, crash, down),
# then the autoscaler profile (a burst makes its Compose actuator add decode containers that serve, down).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
start=$SECONDS
if ! engine=$(bash scripts/container-engine.sh); then
    echo "compose-check: SKIPPED: no container engine here and none can be made (see the lines above)"
    exit 0
fi
eval "$engine"
bash scripts/container-images.sh
local_override=()
docker image inspect localhost/meshserve-base:bookworm > /dev/null 2>&1 && local_override=(--local)
# the model as a user gets it: the `model` service fetches it into the project's volume (from the package registry)
echo "compose-check: engine and images ready in $((SECONDS - start)) s"
out=${1:-}
[ -n "$out" ] && mkdir -p "$out"
"$PY" scripts/compose_check.py "${local_override[@]}" ${out:+--out "$out/compose-check.json"} \
    ${MESHSERVE_KV_HOP_MB:+--kv-hop "$MESHSERVE_KV_HOP_MB"}
"$PY" scripts/compose_check.py "${local_override[@]}" --autoscaler --project meshserve-autoscale \
    ${out:+--out "$out/compose-autoscaler.json"}
echo "compose-check: passed in $((SECONDS - start)) s"
