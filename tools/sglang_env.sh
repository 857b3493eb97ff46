#!/usr/bin/env bash
# Builds the Python environment in which tests/test_sglang_handoff.py runs SGLang's own receiving code
# (tests/sglang_driver.py): SGLang 0.5.23 and exactly what its imports need, in a folder of its own.
#
#   tools/sglang_env.sh [FOLDER]          # default: .ci/sglang-env (ignored by git)
#   VITSERVE_SGLANG_PYTHON=FOLDER/bin/python python -m pytest tests/test_sglang_handoff.py
#
# It stands on vLLM's environment (tools/vllm_env.sh; VITSERVE_VLLM_ENV, default .ci/vllm-env, built first):
# a .pth file puts that environment's packages behind this one's, so torch 2.14.1 (SGLang's pin) and
# torchvision, which transformers' Qwen-VL video processors need and which has no build for the CPU torch of
# this machine, come from there, and this folder holds about 270 MB. Installed here with --no-deps: sglang
# itself and tools/sglang_env.txt. None of SGLang's GPU packages (sgl-kernel, flashinfer, ...): the tested code
# never imports them. A folder built from this script, tools/sglang_env.txt and the same vLLM environment is
# kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${1:-${VITSERVE_SGLANG_ENV:-.ci/sglang-env}}"
BASE_DIR="${VITSERVE_VLLM_ENV:-.ci/vllm-env}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION=0.5.23
stamp="$ENV_DIR/.built-from"
if [ ! -x "$BASE_DIR/bin/python" ]; then
    echo "vLLM's environment is not in $BASE_DIR: build it first with tools/vllm_env.sh" >&2
    exit 1
fi
base_site="$("$BASE_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
want="$( (cat tools/sglang_env.sh tools/sglang_env.txt; echo "$base_site"; cat "$BASE_DIR/.built-from" 2>/dev/null) \
    | sha256sum | cut -c1-16)"

smoke() {
    SGLANG_HOST_IP=127.0.0.1 "$ENV_DIR/bin/python" - <<'PY'
import sglang
from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP  # noqa: F401
from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor  # noqa: F401
from sglang.srt.utils.common import safe_pickle_loads  # noqa: F401
print("SGLang", sglang.__version__)
PY
}

if [ -x "$ENV_DIR/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && smoke >/dev/null 2>&1; then
    echo "SGLang environment ready in $ENV_DIR"
    exit 0
fi
start=$SECONDS
rm -rf "$ENV_DIR"
"$PYTHON" -m venv "$ENV_DIR"
site="$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$base_site" > "$site/vllm-env.pth"
pip=("$ENV_DIR/bin/python" -m pip install -q --disable-pip-version-check --no-input --no-deps)
"${pip[@]}" "sglang==$SGLANG_VERSION"
"${pip[@]}" -r tools/sglang_env.txt
smoke
echo "$want" > "$stamp"
echo "SGLang environment built in $ENV_DIR in $((SECONDS - start)) s ($(du -sh "$ENV_DIR" | cut -f1))"
