#!/usr/bin/env bash
# Install vitserve's runtime dependencies -- not vitserve itself -- into the active Python environment.
#
# The Dockerfile runs this before the source code is copied in, so the (large) dependency layer is
# rebuilt only when pyproject.toml or this script changes. CI runs the very same script (tests/test_deploy.py),
# so a broken install line fails CI instead of the first image build.
#
# Usage: docker/install-deps.sh [--dry-run] [TORCH_SPEC]
#   TORCH_SPEC       the torch requirement, e.g. torch==2.13.0 (or env TORCH_SPEC; the argument wins);
#                    neither: the pin in docker/torch.txt, next to this script
#   TORCH_INDEX_URL  env: the index torch is taken from, e.g. https://download.pytorch.org/whl/cu130;
#                    empty or unset: pip's configured index (PyPI)
#   EXTRAS           env: optional-dependency groups of pyproject.toml to install too, e.g. "cuda"
#                    (installed with --no-deps: the cuda group's wheel needs nothing more at run time)
#   PYPROJECT        env: path of pyproject.toml (default: pyproject.toml in the current directory)
#   PYTHON           env: the interpreter whose pip installs (default: python3)
#   --dry-run        run every pip line with `pip install --dry-run`: resolve, change nothing
set -euo pipefail

dry_run=()
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=(--dry-run)
    shift
fi
torch_spec="${1:-${TORCH_SPEC:-}}"
pin_file="$(dirname "$0")/torch.txt"
if [[ -z "$torch_spec" && -f "$pin_file" ]]; then
    torch_spec="$(grep -v '^[[:space:]]*\(#\|$\)' "$pin_file" | head -n 1)"
fi
if [[ -z "$torch_spec" ]]; then
    echo "usage: $0 [--dry-run] TORCH_SPEC   (e.g. torch==2.13.0; or set TORCH_SPEC, or keep docker/torch.txt)" >&2
    exit 2
fi
python="${PYTHON:-python3}"
pyproject="${PYPROJECT:-pyproject.toml}"
if [[ ! -f "$pyproject" ]]; then
    echo "$0: $pyproject not found (set PYPROJECT)" >&2
    exit 2
fi

pip_install=("$python" -m pip install --no-cache-dir --disable-pip-version-check "${dry_run[@]}")

# 1. torch, alone and first, from its own index: the CUDA build lives on the PyTorch index, and a plain
#    `pip install torch` from PyPI would pick whatever CUDA version PyPI's default wheel was built for.
index_args=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    index_args=(--index-url "$TORCH_INDEX_URL")
fi
"${pip_install[@]}" "${index_args[@]}" "$torch_spec"

# 2. every [project].dependencies entry of pyproject.toml, with torch held to the spec above (as a
#    constraint) so that resolving the rest never swaps the CUDA build for another torch.
workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT
"$python" - "$pyproject" >"$workdir/requirements.txt" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
if not deps:
    sys.exit("no [project].dependencies in " + sys.argv[1])
print("\n".join(deps))
PY
printf '%s\n' "$torch_spec" >"$workdir/constraints.txt"
"${pip_install[@]}" -r "$workdir/requirements.txt" -c "$workdir/constraints.txt"

# 3. the optional groups named in EXTRAS (the image: "cuda", for cuDNN's fused attention).
if [[ -n "${EXTRAS:-}" ]]; then
    "$python" - "$pyproject" "$EXTRAS" >"$workdir/extras.txt" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    groups = tomllib.load(f)["project"].get("optional-dependencies", {})
for name in sys.argv[2].replace(",", " ").split():
    if name not in groups:
        sys.exit(f"no optional-dependencies group {name!r} in {sys.argv[1]} (there are: {', '.join(groups)})")
    print("\n".join(groups[name]))
PY
    "${pip_install[@]}" --no-deps -r "$workdir/extras.txt" -c "$workdir/constraints.txt"
fi
