# syntax=docker/dockerfile:1
#
# vitserve: vision-encoding inference server (Qwen-VL vision towers, CUDA graphs, one GPU per container).
#
#   docker build -t vitserve:0.1.0 .
#   docker run --rm --gpus all -p 8000:8000 -v /models:/models:ro vitserve:0.1.0 \
#       --model /models/Qwen2.5-VL-7B-Instruct
#
# Arguments after the image name are `vitserve serve` flags; `docker run --rm vitserve:0.1.0 --help` lists every
# one with its default. Every flag can also be set with an environment variable VITSERVE_<FLAG_IN_UPPER_SNAKE>
# (`docker run -e VITSERVE_MAX_BATCH_TOKENS=32768 ...`); a flag given on the command line wins over its
# variable. This image sets VITSERVE_HOST=0.0.0.0. docs/deployment.md has the table of flags and variables.
#
# The server's processes (worker processes, engine processes) pass pixels and embeddings through /dev/shm:
# give the container room there (`--shm-size 4g`, or `--ipc host`); Docker's default of 64 MiB is too small.
#
# Endpoints: GET /health (liveness), GET /ready (readiness), GET /metrics (Prometheus), POST /encode.
# On SIGTERM the server drains (ready -> 503, in-flight requests finish) and exits within the request timeout:
# give `docker stop -t` at least VITSERVE_REQUEST_TIMEOUT_S plus a margin.

# The runtime image brings the CUDA user-space libraries and the variables the NVIDIA container toolkit reads
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES). The host driver must support CUDA 13.0 (R580 or newer).
ARG BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# The CUDA build of PyTorch, from the PyTorch index; its CUDA version matches the base image's. TORCH_SPEC
# empty: the project's one pin, docker/torch.txt (CI installs the CPU build of the same version).
ARG TORCH_SPEC=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python from the distribution (Ubuntu 24.04: 3.12), in a virtual environment (the system one is
# externally managed); a numeric non-root user that Kubernetes' runAsNonRoot can verify.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && groupadd --system --gid 10001 vitserve \
    && useradd --system --uid 10001 --gid vitserve --home-dir /home/vitserve --create-home \
        --shell /usr/sbin/nologin vitserve

WORKDIR /opt/vitserve

# Dependencies only: this layer depends on pyproject.toml, the torch pin and the install script, not on the
# source code. The `cuda` extra brings cuDNN's fused attention, which `--attention auto` serves on Hopper
# when it passes its load-time check; the start-up log names the backend in use ("attention: cudnn").
COPY pyproject.toml ./
COPY docker/install-deps.sh docker/torch.txt ./docker/
RUN TORCH_INDEX_URL="$TORCH_INDEX_URL" EXTRAS=cuda bash docker/install-deps.sh "$TORCH_SPEC"

# The package itself, without touching the dependencies installed above.
# README.md is the package's long description; the glob lets a checkout without one build too.
COPY pyproject.toml README.md* ./
COPY models ./models
COPY graphs ./graphs
COPY service ./service
RUN python3 -m pip install --no-cache-dir --no-deps . \
    && rm -rf build ./*.egg-info

# Caches that PyTorch, Triton and Hugging Face libraries may write go to /tmp, which stays writable when the
# root filesystem is mounted read-only (Kubernetes mounts an emptyDir there).
ENV HOME=/home/vitserve \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    VITSERVE_HOST=0.0.0.0 \
    VITSERVE_PORT=8000

USER 10001:10001
EXPOSE 8000

# Liveness only (/health); /ready turns 200 once weights are loaded and CUDA graphs captured. It polls
# VITSERVE_PORT: move the port with that variable rather than --port so that the check follows.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('VITSERVE_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["vitserve", "serve"]
CMD []
