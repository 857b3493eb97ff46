"""The cuda-marked tests of some files dealt into N shards that can run side by side on one GPU, each preset's
tests in one shard (its module-scoped tower loads once, and N towers, not N per worker, share the device: under
pytest-xdist's `-n 4`, which loads every preset in every worker, 14 of tests/test_cuda_graphs.py's fixtures failed).

    python3 tools/cuda_shards.py N K FILE...   # prints shard K's test ids, one per line
    CUDA_SHARDS=3 tools/gpu_run.sh            # the tests in 3 processes, a log per shard

Shards are balanced by test count, the largest groups first; a test without a parameter is a group of its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict


def shards(ids: list[str], n: int) -> list[list[str]]:
    """`ids` grouped by their parameter (`test_x[random:qwen3-vl-8b]` and `test_y[random:qwen3-vl-8b]` share
    a group), the groups dealt largest first to the shard holding fewest tests; each shard in collection order."""
    groups: dict[str, list[str]] = defaultdict(list)
    for test_id in ids:
        param = re.search(r"\[([^\]]*)\]$", test_id)
        groups[param.group(1) if param else test_id].append(test_id)
    dealt: list[list[str]] = [[] for _ in range(n)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(dealt, key=len).extend(members)
    order = {test_id: i for i, test_id in enumerate(ids)}
    return [sorted(shard, key=order.__getitem__) for shard in dealt]


def collect(files: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", *files], capture_output=True, text=True, check=True)
    return [line for line in proc.stdout.splitlines() if "::" in line]


if __name__ == "__main__":
    n, k, *files = sys.argv[1:]
    print("\n".join(shards(collect(files), int(n))[int(k)]))
