#!/usr/bin/env bash
# One call on the GPU machine: the cuda-marked tests, then the benchmark. Logs under $OUT.
# Use it for a GPU run of record: the figures in docs/performance.md come from it (or from `vitserve bench`).
#   CUDA=0|1  CUDA_TESTS="files"  CUDA_SHARDS=N (the tests in N processes side by side)
#   BENCH=0|1  MODELS=a,b  ONLY=w1,w2  QUANT=fp8 (FP8 rows too)  PROFILE="model@workload ..."  CHUNKING=model
#   HF_VIDEO=1: pixels against transformers' video processors (needs torchvision: this machine)
#   HTTP="model": `vitserve bench --http` against a real server (needs the .whl packages carried);
#   HTTP_VARIANTS="label=serve flags|...": one run per variant; HTTP_CLIENTS: client processes
#   HTTP_REQUESTS: a level stops after this many requests or HTTP_LEVEL_S, whichever first (default: time)
#   HTTP_PYSPY=1: profile that run, server and client, with py-spy (carry its wheel);
#   HTTP_PYSPY=gil: sample only the thread holding the GIL (where a GIL-bound server spends it)
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/cuda_tests.log"
CUDA_TESTS=${CUDA_TESTS:-tests/test_cuda_graphs.py tests/test_cuda_http.py}
if [ "${CUDA:-1}" = 1 ] && [ "${CUDA_SHARDS:-1}" -gt 1 ]; then
  # side by side, each preset's tests in one process (tools/cuda_shards.py); a log per shard, the totals here
  for k in $(seq 0 $((CUDA_SHARDS - 1))); do
    # shellcheck disable=SC2086 # CUDA_TESTS may name several files
    ids=$(python3 tools/cuda_shards.py "$CUDA_SHARDS" "$k" $CUDA_TESTS) || { echo "shard $k: collection failed"; continue; }
    [ -n "$ids" ] || continue  # no ids would run every test
    # shellcheck disable=SC2086 # one argument per test id
    python3 -m pytest -v -m cuda -p no:cacheprovider $ids > "$OUT/cuda_shard_$k.log" 2>&1 &
  done
  wait
  grep -hE " (FAILED|ERROR)|^=+ .*(passed|failed|error|skipped)" "$OUT"/cuda_shard_*.log | tee -a "$OUT/cuda_tests.log"
elif [ "${CUDA:-1}" = 1 ]; then
  # shellcheck disable=SC2086 # CUDA_TESTS may name several files
  python3 -m pytest -q -m cuda -s $CUDA_TESTS 2>&1 | tee -a "$OUT/cuda_tests.log"
fi
if [ "${HF_VIDEO:-0}" = 1 ]; then
  python3 -m pytest -q -s -p no:cacheprovider tests/test_video_hf_processors.py 2>&1 | tee "$OUT/video_hf.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 -c "import sys; from pathlib import Path; from service.bench.towers import run; \
run(sys.argv[1].split(','), Path('$OUT'), only=(sys.argv[2].split(',') if sys.argv[2] else None), \
quantization=sys.argv[3])" "${MODELS:-random:qwen2-vl-7b,random:qwen2.5-vl-7b,random:qwen3-vl-8b}" "${ONLY:-}" \
    "${QUANT:-none}" 2>&1 | tee "$OUT/bench.log"
fi
if [ -n "${PROFILE:-}" ]; then
  for spec in $PROFILE; do
    python3 -c "import sys; from pathlib import Path; from service.bench.towers import profile; \
profile(sys.argv[1], sys.argv[2], Path('$OUT/profile.txt'))" "${spec%%@*}" "${spec##*@}" 2>&1 | tail -3
  done
fi
if [ -n "${CHUNKING:-}" ]; then
  python3 -c "import sys; from pathlib import Path; from service.bench.towers import bench_chunking; \
bench_chunking(sys.argv[1], Path('$OUT/chunking.jsonl'))" "$CHUNKING" 2>&1 | grep -v RANDOM | tail -4
fi
if [ -n "${HTTP:-}" ]; then
  profiler=()
  if [ "${HTTP_PYSPY:-0}" != 0 ]; then  # wheels installed with --target put the binary in site/bin
    pyspy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    mode=(--idle)
    [ "$HTTP_PYSPY" = gil ] && mode=(--gil)
    profiler=("$pyspy" record --subprocesses "${mode[@]}" --rate 100 --format speedscope -o "$OUT/http_pyspy.json" --)
  fi
  # HTTP_VARIANTS="label=serve flags|label2=more flags": one run each, into http_bench_<label>.json
  IFS='|' read -ra variants <<< "${HTTP_VARIANTS:-default=}"
  for variant in "${variants[@]}"; do
    label=${variant%%=*}
    timeout "${HTTP_TIMEOUT:-420}" "${profiler[@]}" python3 -m service.cli bench --http --model "$HTTP" \
      --concurrency "${HTTP_LEVELS:-1,4,16,64,256}" --requests-per-level "${HTTP_REQUESTS:-1000000}" \
      --level-time-s "${HTTP_LEVEL_S:-15}" --client-processes "${HTTP_CLIENTS:-1}" --serve-flags "${variant#*=}" \
      --out "$OUT/http_bench_$label.json" 2>&1 | grep -v RANDOM | tee "$OUT/http_$label.log"
  done
fi
