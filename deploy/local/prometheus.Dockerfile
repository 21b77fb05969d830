# Prometheus for deploy/docker-compose.local.yml (Debian bookworm's package): it scrapes every service's /metrics.
ARG BASE=localhost/meshserve-base:bookworm
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/*
EXPOSE 9090
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/tmp/prometheus"]
