# One image for every meshserve service: the command picks the service (`python -m services.<name> ...`) or a
# `meshserve` subcommand. CPU by default, with the pinned CPU build of torch; `--build-arg VARIANT=cuda` installs
# the CUDA build instead (the CUDA runtime comes with its wheels; the host needs the NVIDIA driver).
#
#   docker build -t meshserve .                       # from the repository root
#   docker run --rm meshserve meshserve --help
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
RUN python -m venv /opt/meshserve
ENV PATH=/opt/meshserve/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: anything that pulls an unpinned torch drags in a multi-GB CUDA build
RUN if [ "$VARIANT" = "cuda" ]; then pip install "torch==${TORCH_VERSION}"; \
    else pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu; fi
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY bench /src/bench
RUN pip install /src

FROM ${PYTHON_IMAGE} AS base
# g++ builds the optional C++ kernels on their first use (torch's extension loader; without a compiler the engine
# runs pure PyTorch); the non-root user owns only its home (the kernel cache) and the model volume
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 meshserve && mkdir /models && chown meshserve /models
COPY --from=build /opt/meshserve /opt/meshserve
ENV PATH=/opt/meshserve/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MESHSERVE_HOST=0.0.0.0 \
    TORCH_EXTENSIONS_DIR=/home/meshserve/.cache/torch_extensions
USER meshserve
WORKDIR /home/meshserve
VOLUME ["/models"]
# gateway gRPC and HTTP, router, kvstore, autoscaler (workers take the port their command gives)
EXPOSE 50051 8000 50052 50053 50054
CMD ["meshserve", "--help"]

# The autoscaler with the Compose actuator (`--target autoscaler`): it runs `docker compose`, so it needs the docker
# CLI and the compose plugin (v2: `docker compose`, not Debian's v1 `docker-compose`) and the host's socket mounted.
FROM base AS autoscaler
COPY --from=docker:27-cli /usr/local/bin/docker /usr/local/bin/docker
COPY --from=docker/compose-bin:v2.29.7 /docker-compose /usr/local/lib/docker/cli-plugins/docker-compose

# The default target: every service
FROM base
