# syntax=docker/dockerfile:1
#
# vitserve: vision-encoding inference server (Qwen-VL vision towers, CUDA graphs, one GPU per container).
#
#   docker build -t vitserve:0.1.0 .
#   docker run --rm --gpus all -p 8000:8000 -v /models:/models:ro vitserve:0.1.0 \
#       --model /models/Qwen2.5-VL-7B-Instruct
#
# Arguments after the image name are `vitserve serve` flags. Every flag can also be set with an environment
# variable VITSERVE_<FLAG_IN_UPPER_SNAKE> (`docker run -e VITSERVE_MAX_BATCH_TOKENS=32768 ...`); a flag given
# on the command line wins over its variable. The variables:
#
#   VITSERVE_MODEL                    checkpoint folder (mounted read-only) or preset; tiny-qwen2-vl
#   VITSERVE_HOST                     bind address; 0.0.0.0 in this image (the server alone: 127.0.0.1)
#   VITSERVE_PORT                     listen port; 8000
#   VITSERVE_DEVICE                   cuda | cpu | auto; auto
#   VITSERVE_DTYPE                    bfloat16 | float16 | float32 | auto; auto
#   VITSERVE_SERVED_MODEL_NAME        model name reported by the API
#   VITSERVE_MAX_BATCH_TOKENS         token budget of one batch; 16384
#   VITSERVE_BUDGETS                  comma list of CUDA-graph token budgets; auto
#   VITSERVE_T_CAPTURE                temporal size captured into graphs; 8
#   VITSERVE_MAX_WAIT_MS              batching window in ms; 2
#   VITSERVE_MAX_QUEUED_TOKENS        queue bound in tokens; 8 x max batch tokens
#   VITSERVE_MAX_CONCURRENT_REQUESTS  in-flight request bound; 512
#   VITSERVE_MAX_BATCH_ITEMS          images/videos in one batch
#   VITSERVE_MAX_ITEMS_PER_REQUEST    images/videos in one request; 64
#   VITSERVE_PREPROCESS_WORKERS       CPU workers decoding and preprocessing media
#   VITSERVE_MAX_PAYLOAD_BYTES        request body limit; 64 MiB
#   VITSERVE_REQUEST_TIMEOUT_S        per-request timeout, also the drain deadline on SIGTERM; 60
#   VITSERVE_API_KEY                  API key; a secret: use --env-file, not the command line
#   VITSERVE_LOG_LEVEL                critical | error | warning | info | debug | trace; info
#   VITSERVE_EAGER                    true: no CUDA graphs (eager PyTorch)
#   VITSERVE_ALLOW_URL                true: accept image/video URLs (off by default)
#   VITSERVE_ALLOWED_HOSTS            hosts URLs may point at, with VITSERVE_ALLOW_URL
#   VITSERVE_URL_TIMEOUT_S            timeout of one URL fetch
#   VITSERVE_VIDEO_CHUNKING           video chunking (not implemented yet: leave unset)
#   VITSERVE_EC_SHARED_STORAGE        folder shared with an LLM server's encoder-cache connector
#   VITSERVE_EC_MAX_BYTES             bound of that folder, oldest entries out first; 8 GiB (0: none)
#   VITSERVE_CACHE_BYTES              host memory of the encoder-output cache; 1 GiB (0: off)
#   VITSERVE_DATA_PARALLEL            encoder replicas (one GPU each) in this process; only 1 for now
#
# Endpoints: GET /health (liveness), GET /ready (readiness), GET /metrics (Prometheus), POST /encode.
# On SIGTERM the server drains (ready -> 503, in-flight requests finish) and exits within the request timeout:
# give `docker stop -t` at least VITSERVE_REQUEST_TIMEOUT_S plus a margin.

# The runtime image brings the CUDA user-space libraries and the variables the NVIDIA container toolkit reads
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES). The host driver must support CUDA 12.8.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# The CUDA build of PyTorch, from the PyTorch index; its CUDA version matches the base image's.
ARG TORCH_SPEC=torch==2.9.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

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

# Dependencies only: this layer depends on pyproject.toml and the install script, not on the source code.
COPY pyproject.toml ./
COPY docker/install-deps.sh ./docker/
RUN TORCH_INDEX_URL="$TORCH_INDEX_URL" bash docker/install-deps.sh "$TORCH_SPEC"

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
