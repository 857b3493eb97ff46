"""GPU only: the benchmark's floor graph keeps alive everything its replays read.

A floor that let its weights, inputs and segment boundaries go back to the allocator timed whatever the next
tensors held: in alternation with the tower (tools/replay_timeline.py) its attention ran over boundaries
overwritten by other work (faster, and at times out of bounds)."""

from __future__ import annotations

import gc

import pytest
import torch

from models import load_tower
from service.bench.towers import floor_graph, tower_dims, workloads

pytestmark = pytest.mark.cuda


def test_floor_graph_holds_what_it_reads() -> None:
    tower = load_tower("tiny-qwen3-vl", device="cuda", dtype="bfloat16")
    dims = tower_dims(tower)
    grids = workloads(tower.processor.patch_size)["32x224"]
    rows = sum(t * h * w for t, h, w in grids)
    # the smallest things the graph reads: the layer weights (shared by the layers) and the input rows
    h, kv = dims["hidden"], dims["hidden"] * dims["kv_heads"] // dims["heads"]
    inter = (2 if dims["gated"] else 1) * dims["inter"]
    weights = dims["cin"] * h + h * (h + 2 * kv) + h * h + h * inter + dims["inter"] * h
    held_at_least = 2 * (weights + rows * dims["cin"])  # bf16
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    floor = floor_graph(dims, grids, tower)
    gc.collect()
    assert torch.cuda.memory_allocated() - before >= held_at_least
    # whatever is made next cannot land in the floor's memory: replays after heavy allocation stay sound
    junk = [torch.full((1 << 20,), 1 << 30, dtype=torch.int32, device="cuda") for _ in range(64)]
    for _ in range(3):
        floor()
    torch.cuda.synchronize()
    del junk
