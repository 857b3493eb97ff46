#!/usr/bin/env bash
# One call on the GPU machine: the cuda-marked tests, then the benchmark. Logs under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m cuda -s ${CUDA_TESTS:-tests/test_cuda_graphs.py} 2>&1 | tee "$OUT/cuda_tests.log"
if [ "${BENCH:-1}" = 1 ]; then
  python3 -c "import sys; from pathlib import Path; from service.bench import run; \
run(sys.argv[1].split(','), Path('$OUT'), only=(sys.argv[2].split(',') if sys.argv[2] else None))" \
    "${MODELS:-random:qwen2-vl-7b,random:qwen2.5-vl-7b,random:qwen3-vl-8b}" "${ONLY:-}" 2>&1 | tee "$OUT/bench.log"
fi
if [ -n "${PROFILE:-}" ]; then
  for spec in $PROFILE; do
    python3 -c "import sys; from pathlib import Path; from service.bench import profile; \
profile(sys.argv[1], sys.argv[2], Path('$OUT/profile.txt'))" "${spec%%@*}" "${spec##*@}" 2>&1 | tail -3
  done
fi
if [ -n "${CHUNKING:-}" ]; then
  python3 -c "import sys; from pathlib import Path; from service.bench import bench_chunking; \
bench_chunking(sys.argv[1], Path('$OUT/chunking.jsonl'))" "$CHUNKING" 2>&1 | grep -v RANDOM | tail -4
fi
