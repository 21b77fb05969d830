# Redis for deploy/docker-compose.local.yml where redis:7.4-alpine cannot be pulled: Debian bookworm's redis-server
# (7.0) on the base scripts/container-images.sh makes.
ARG BASE=localhost/meshserve-base:bookworm
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*
EXPOSE 6379
CMD ["redis-server", "--save", "", "--appendonly", "no", "--protected-mode", "no", "--bind", "0.0.0.0"]
