"""A budget learned while serving against the default ladder (GPU):
`python tools/learned_budget_probe.py OUT.jsonl random:qwen3-vl-8b random:qwen3.5-35b-a3b`.

Per model and workload (1x448: 196 tokens; 32x224: 1568), with the graph pool as served (`plan_for(tower,
16384)`): the milliseconds of `GraphRunner.encode` (CUDA-event median; pixels already on the device, as `vitserve
bench` times it) and of the engine's device time for the batch (pixels staged in page-locked memory; events from
before the upload to the output's copy back, as the server's engine measures `device_s`), on the default ladder,
then after `learn_budget(tokens)`; and the floor (the tower's products and attention alone, one CUDA graph), timed
in alternation with them. One JSON line per model and workload.
"""

import json
import statistics
import sys

import torch

from graphs.learning import learn_budget
from graphs.runner import GraphRunner, concat_pixels, plan_for
from models import VisualInput, load_tower
from service.bench import towers

DEV = torch.device("cuda")


def engine_ms(runner: GraphRunner, items: list[VisualInput], runs: int = 30) -> float:
    """Median device time of the items' batches as the engine runs them, one after another (after 5 warm runs)."""
    batches = [(b, [items[i] for i in b.items]) for b in runner.pack_items(items)]
    staged = [concat_pixels([it.pixels for it in own], pin=True) for _, own in batches]
    times = []
    for _ in range(runs + 5):
        begun, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begun.record()
        for (batch, own), pixels in zip(batches, staged):
            rows = runner.run(batch, own, staged=pixels)
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)  # out before the next replay, as the engine does
        end.record()
        end.synchronize()
        times.append(begun.elapsed_time(end))
    return statistics.median(times[5:])


def measure(runner: GraphRunner, on_device: list[VisualInput], staged: list[VisualInput], floor) -> dict:
    encode, engine, fl = [], [], []
    for _ in range(5):
        encode.append(towers.cuda_time(lambda: runner.encode(on_device)))
        engine.append(engine_ms(runner, staged))
        fl.append(towers.cuda_time(floor))
    ms_encode, ms_engine, ms_floor = (statistics.median(x) for x in (encode, engine, fl))
    return dict(keys=[str(b.key) for b in runner.pack_items(on_device)], encode_ms=round(ms_encode, 3),
                engine_ms=round(ms_engine, 3), floor_ms=round(ms_floor, 3),
                encode_over_floor=round(ms_encode / ms_floor, 3), engine_over_floor=round(ms_engine / ms_floor, 3))


def main() -> None:
    out = open(sys.argv[1], "a")
    for name in sys.argv[2:]:
        tower = load_tower(name, device="cuda", dtype="bfloat16")
        runner = GraphRunner(tower, DEV, plan_for(tower, max_batch_tokens=16384))
        runner.capture()
        dims = towers.tower_dims(tower)
        best = tower.backend if tower.backend not in ("varlen", "sdpa") else "varlen"
        for workload in ("1x448", "32x224"):
            grids = towers.workloads(tower.processor.patch_size)[workload]
            on_device = towers.random_items(tower, grids)
            staged = [VisualInput(it.modality, it.pixels.cpu().numpy(), it.grid_thw) for it in on_device]
            floor = towers.floor_graph(dims, grids, tower, best)
            tokens = sum(t * h * w for t, h, w in grids) // tower.merge_unit
            with torch.inference_mode():
                default = measure(runner, on_device, staged, floor)
                learned = learn_budget(runner, tokens)
                after = measure(runner, on_device, staged, floor)
            row = dict(model=name, workload=workload, budget=tokens, learned=learned.ok, reason=learned.reason,
                       learn_s=round(learned.seconds, 3), default=default, learned_budget=after,
                       replay_cost_ms=round(dict(runner.cost.replays).get(tokens, 0) * 1e3, 3))
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()
        runner = tower = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
