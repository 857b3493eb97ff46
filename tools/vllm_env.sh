#!/usr/bin/env bash
# Builds the Python environment in which tests/test_vllm_handoff.py runs vLLM's own code (tests/vllm_driver.py):
# vLLM 0.33.0 and exactly the packages its imports need, in a folder of its own, apart from vitserve's.
#
#   tools/vllm_env.sh [FOLDER]          # default: .ci/vllm-env (ignored by git)
#   VITSERVE_VLLM_PYTHON=FOLDER/bin/python python -m pytest tests/test_vllm_handoff.py
#
# vLLM pins its own torch, transformers and fastapi, which differ from vitserve's, hence the second
# environment. Not installed: vLLM's GPU kernels and their packages (flashinfer, cutlass, ...), which the
# tested code never imports. torch is 2.14.1 with torchvision 0.29.1 (vLLM asks for 2.14.0 / 0.29.0): the
# Qwen-VL processors import torchvision, and no CPU build of torchvision matches the CPU torch on this
# machine; this CUDA build (about 5.5 GB with its libraries) runs on the CPU. A folder already built from
# this script and tools/vllm_env.txt is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${1:-${VITSERVE_VLLM_ENV:-.ci/vllm-env}}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION=0.33.0
stamp="$ENV_DIR/.built-from"
want="$(cat tools/vllm_env.sh tools/vllm_env.txt | sha256sum | cut -c1-16)"

smoke() {
    VLLM_TARGET_DEVICE=cpu "$ENV_DIR/bin/python" - <<'EOF'
import torchvision  # noqa: F401
import vllm
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector  # noqa: F401
from vllm.model_executor.models import qwen2_5_vl, qwen2_vl, qwen3_vl  # noqa: F401
from vllm.renderers.chat_utils import parse_chat_messages  # noqa: F401
print("vLLM", vllm.__version__)
EOF
}

if [ -x "$ENV_DIR/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && smoke >/dev/null 2>&1; then
    echo "vLLM environment ready in $ENV_DIR"
    exit 0
fi
start=$SECONDS
rm -rf "$ENV_DIR"
"$PYTHON" -m venv "$ENV_DIR"
pip=("$ENV_DIR/bin/python" -m pip install -q --disable-pip-version-check --no-input)
"${pip[@]}" torch==2.14.1 torchvision==0.29.1
"${pip[@]}" --no-deps "vllm==$VLLM_VERSION" xgrammar==0.2.8
"${pip[@]}" --no-deps -r tools/vllm_env.txt
smoke
echo "$want" > "$stamp"
echo "vLLM environment built in $ENV_DIR in $((SECONDS - start)) s ($(du -sh "$ENV_DIR" | cut -f1))"
