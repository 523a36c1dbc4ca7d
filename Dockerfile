# compat-server images, built from this repository.
#
#   CPU (default target): serves the built-in tiny model.
#     docker build -t compat-server .
#     docker run -p 8000:8000 -v compat-data:/data compat-server
#   GPU: installs the [gpu] extra (CUDA torch + vLLM) and serves the model you name.
#     docker build --target gpu -t compat-server:gpu .
#     docker run --gpus all -p 8000:8000 -v compat-data:/data -v ~/.cache/huggingface:/data/hf compat-server:gpu \
#         --base-model Qwen/Qwen3-8B
#
# Every `compat-server serve` option is also an environment variable: --max-body-mb is COMPAT_SERVER_MAX_BODY_MB, and
# so on (see `docker run IMAGE --help`). The server listens on 0.0.0.0, so --auth defaults to `keys`: create one with
#     docker exec CONTAINER compat-server keys create --name me
# or run without keys on a trusted network: -e COMPAT_SERVER_AUTH=open -e COMPAT_SERVER_ALLOW_OPEN_AUTH=1.
#
# Build arguments: BASE (a Debian bookworm image); TORCH_INDEX_URL (where the CPU torch wheel comes from; empty to use
# WHEELS_DIR or the default index only); WHEELS_DIR (a directory of local wheels mounted at build time, e.g.
# `--volume /opt/wheels:/wheels:ro --build-arg WHEELS_DIR=/wheels`); CA_BUNDLE (a CA file mounted at build time, for
# networks whose HTTPS proxy re-signs certificates).

ARG BASE=debian:bookworm-slim

# ---- Python runtime shared by every stage ---------------------------------------------------------------------------
FROM ${BASE} AS python
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# ---- build: a virtualenv with the project and its dependencies -------------------------------------------------------
FROM python AS source
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
COPY pyproject.toml README.md constraints.txt /src/
COPY compat_server /src/compat_server
COPY shims /src/shims
COPY adapters /src/adapters
COPY contract /src/contract

FROM source AS build-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELS_DIR=
ARG CA_BUNDLE=
# torch first and alone: the pinned CPU build, not the multi-GB CUDA one a plain index would give. Everything at the
# versions of the lock CI tests (constraints.txt). (Set through the environment so that pip's build-isolation
# subprocesses see them too.)
RUN set -e; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi; \
    if [ -n "$WHEELS_DIR" ]; then export PIP_FIND_LINKS="$WHEELS_DIR"; fi; \
    export PIP_CONSTRAINT=/src/constraints.txt; \
    /opt/venv/bin/pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==2.13.0"; \
    /opt/venv/bin/pip install /src; \
    /opt/venv/bin/pip check; \
    find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

FROM source AS build-gpu
ARG CA_BUNDLE=
RUN set -e; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi; \
    export PIP_CONSTRAINT=/src/constraints.txt; \
    /opt/venv/bin/pip install "/src[gpu]"; \
    /opt/venv/bin/pip check

# ---- runtime: the virtualenv, a non-root user, the data volume ---------------------------------------------------------
FROM python AS runtime
RUN useradd --create-home --uid 1000 compat && mkdir /data && chown compat:compat /data
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    COMPAT_SERVER_HOST=0.0.0.0 \
    COMPAT_SERVER_PORT=8000 \
    COMPAT_SERVER_DATA_DIR=/data \
    COMPAT_SERVER_CACHE=/data/cache \
    HF_HOME=/data/hf
VOLUME /data
EXPOSE 8000
USER compat
# (Change the port with COMPAT_SERVER_PORT rather than --port, so that the health check follows it.)
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/api/v1/healthz' % os.environ['COMPAT_SERVER_PORT'], timeout=4)"]
ENTRYPOINT ["compat-server", "serve"]

FROM runtime AS gpu
COPY --from=build-gpu /opt/venv /opt/venv

FROM runtime AS cpu
COPY --from=build-cpu /opt/venv /opt/venv
