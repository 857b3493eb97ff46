"""What padding a batch to its graph's budget costs: one workload replayed in the budget the packing picks
with powers of two, with `--budget-steps 4`, and with a budget of exactly its tokens; each with its batches,
the host time of one `encode`, the calibrated costs the packing weighed, and the kernel table of one replay
(torch.profiler).

    python3 tools/padding_probe.py OUT.txt [MODEL] [WORKLOAD ...]   # defaults: random:qwen3-vl-8b 1x448 32x224
    --no-batch-invariant (anywhere): the products as torch picks them (split reductions allowed), floor included

Run it on the GPU when the budget ladder, the packing's cost model or a family's token size changes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphs.budgets import auto_budgets  # noqa: E402
from graphs.runner import GraphRunner, plan_for  # noqa: E402
from models import load_tower  # noqa: E402
from service.bench.towers import cuda_time, floor_graph, random_items, tower_dims, workloads  # noqa: E402


def main(out_path: str, name: str = "random:qwen3-vl-8b", *names: str, invariant: bool = True) -> None:
    out = open(out_path, "a")
    tower = load_tower(name, device="cuda", dtype="bfloat16", batch_invariant=invariant)
    dims = tower_dims(tower)
    dev = torch.device("cuda")
    for wname in names or ("1x448", "32x224"):
        grids = workloads(tower.processor.patch_size)[wname]
        items = random_items(tower, grids)
        tokens = sum(tower.geometry.units(g) for g in grids)
        with torch.inference_mode():
            floor = cuda_time(floor_graph(dims, grids, tower))
            ladders = {"powers_of_two": auto_budgets(16384), "steps_4": auto_budgets(16384, steps_per_octave=4),
                       "exact": sorted(set(auto_budgets(16384)) | {tokens})}
            for label, budgets in ladders.items():
                runner = GraphRunner(tower, dev, plan_for(tower, budgets=budgets), modalities=("image",))
                t0 = time.perf_counter()
                runner.capture()
                capture_s = time.perf_counter() - t0
                ms = cuda_time(lambda r=runner, batch=items: r.encode(batch))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.encode(items)
                host_ms = (time.perf_counter() - t0) * 1e3
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    runner.encode(items)
                    torch.cuda.synchronize()
                events = prof.key_averages()
                row = dict(model=name, workload=wname, tokens=tokens, budgets=label, batch_invariant=invariant,
                           graph_ms=round(ms, 3),
                           floor_ms=round(floor, 3), over_floor=round(ms / floor, 3), host_ms=round(host_ms, 3),
                           kernel_ms=round(sum(e.self_device_time_total for e in events) / 1e3, 3),
                           batches=[(str(b.key), b.reason, b.tokens) for b in runner.pack_items(items)],
                           image_graphs=len(runner.pool.graphs), capture_s=round(capture_s, 1),
                           calibration_ms=None if runner.cost is None else {  # what the packing weighed
                               kind: [(n, round(c * 1e3, 2)) for n, c in points]
                               for kind, points in (("replays", runner.cost.replays), ("eager", runner.cost.eager))})
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.write(events.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60) + "\n")
                runner.pool.graphs.clear()
                del runner
                torch.cuda.empty_cache()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-batch-invariant"]
    main(*args, invariant=len(args) == len(sys.argv) - 1)
