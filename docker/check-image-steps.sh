#!/usr/bin/env bash
# The image's install steps without Docker, then the server started briefly: shows on a GPU machine that
# the image's environment serves cuDNN attention (the start-up line "loaded ... attention: cudnn, ...").
#
# Usage, from the repository root:  OUT=out bash docker/check-image-steps.sh [WHEELS_DIR]
#   WHEELS_DIR  wheels of the packages the machine lacks (pip --find-links); with it, pip uses no index
#   MODEL       model to serve (default random:qwen2.5-vl-7b: a released vision config, head dim 80)
#   DEVICE      default cuda
#   EXTRAS      optional groups to install, as the Dockerfile does (default cuda)
#   EXPECT      the attention backend the log must name (default cudnn)
#   READY_S     how long to wait for /ready (default 600)
#
# What differs from the image: torch is the machine's own build, held to its installed version (a machine
# without network cannot fetch docker/torch.txt's CUDA build), and the environment is a virtual environment
# that also sees the machine's packages, where the image starts from an empty one. Logs go to $OUT.
# Exit 0 when the log names EXPECT, 1 when it names another backend or the server never loaded.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-out}"
mkdir -p "$out"
model="${MODEL:-random:qwen2.5-vl-7b}"
device="${DEVICE:-cuda}"
expect="${EXPECT:-cudnn}"
ready_s="${READY_S:-600}"
if [[ -n "${1:-}" ]]; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS
    PIP_FIND_LINKS="$(cd "$1" && pwd)"
fi

# A virtual environment that sees the machine's packages: through a .pth file, since the machine's python3
# may itself live in a virtual environment, whose packages --system-site-packages would not show. It has no
# pip of its own: the machine's installs into it (no ensurepip needed).
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv --without-pip --system-site-packages "$venv"
python="$venv/bin/python"
python3 -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
    >"$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-packages.pth"
torch_spec="torch==$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')"
echo "== install steps (docker/install-deps.sh, EXTRAS=${EXTRAS-cuda}, $torch_spec)" | tee "$out/check-image-steps.log"
PYTHON="$python" EXTRAS="${EXTRAS-cuda}" bash docker/install-deps.sh "$torch_spec" 2>&1 | tee -a "$out/check-image-steps.log"
# The image installs the package with --no-deps; without network the build backend must come from the machine.
if ! "$python" -m pip install --no-deps --no-build-isolation --no-cache-dir . >>"$out/check-image-steps.log" 2>&1; then
    echo "(the package did not install without network: running it from the source tree)" | tee -a "$out/check-image-steps.log"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
rm -rf build ./*.egg-info

port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$out/check-image-server.log"
echo "== vitserve serve --model $model --device $device --port $port (log: $log)"
"$python" -m service.cli serve --model "$model" --device "$device" --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
server=$!
ready=0
for _ in $(seq "$ready_s"); do
    if ! kill -0 "$server" 2>/dev/null; then
        break
    fi
    if "$python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/ready', timeout=2)" 2>/dev/null; then
        ready=1
        break
    fi
    sleep 1
done
kill -TERM "$server" 2>/dev/null || true
wait "$server" || true

grep -E "attention: |loaded " "$log" || true
echo "ready: $ready"
if grep -q "attention: $expect," "$log"; then
    echo "PASS: the server names $expect attention"
    exit 0
fi
echo "FAIL: the log does not name $expect attention (see $log)"
exit 1
