"""Where one lone batch's `GraphRunner.encode` spends its time beyond the graph's replay (GPU): 1x448 in a budget
learned for it (196 tokens), each stage added on in turn and timed with CUDA events, in alternation with the floor.

    python3 tools/encode_stages.py OUT.jsonl random:qwen3-vl-8b [MODEL ...]     ROUNDS=7 (the environment)

device_ms (medians of ROUNDS rounds, each a median of 20 calls; spread: min and max of the rounds): `replay` the
graph alone; `uploads_replay` with the pixels' copy and the metadata (not copied again while the budget's buffers
hold it, as a recurring size is served); `forced_replay` with the metadata copied; `pool_replay`, `run`, `encode`
the serving calls. host_us: medians of one call's host time, the device idle before it (the launch, not the work).
"""

import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from graphs.learning import learn_budget
from graphs.pool import _upload
from graphs.runner import GraphRunner, plan_for, split
from models import load_tower
from service.bench import towers

DEV = torch.device("cuda")


def host_us(fn: Callable[[], object], n: int = 300) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 1)


def stages(name: str, rounds: int) -> dict:
    tower = load_tower(name, device="cuda", dtype="bfloat16")
    runner = GraphRunner(tower, DEV, plan_for(tower, 16384))
    runner.capture()
    grids = towers.workloads(tower.processor.patch_size)["1x448"]
    items = towers.random_items(tower, grids)
    tokens = sum(tower.geometry.units(g) for g in grids)
    with torch.inference_mode():
        learned = learn_budget(runner, tokens)
    dims = towers.tower_dims(tower)
    [batch] = runner.pack_items(items)
    pool = runner.pool
    g = pool.graphs[batch.key]
    region = pool._regions[g.capacity.patches]
    pixels, batch_grids = items[0].pixels, [items[0].grid_thw]

    def uploads(force: bool = False) -> None:
        _upload(g.inputs["pixels"][: len(pixels)], pixels)
        if force:
            region.loaded = None
        region.load(pool._staged_metadata(batch.key, batch_grids, g))

    def with_uploads(force: bool) -> None:
        uploads(force)
        g.graph.replay()

    steps = dict(floor_varlen=towers.floor_graph(dims, grids, tower, "varlen"),
                 floor_served=towers.floor_graph(dims, grids, tower, tower.backend), replay=g.graph.replay,
                 uploads_replay=lambda: with_uploads(False), forced_replay=lambda: with_uploads(True),
                 pool_replay=lambda: pool.replay(batch.key, pixels, batch_grids),
                 run=lambda: runner.run(batch, items), encode=lambda: runner.encode(items))
    with torch.inference_mode():
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(rounds):
            for k, fn in steps.items():
                times[k].append(towers.cuda_time(fn, 3, 20))
        rows = pool.replay(batch.key, pixels, batch_grids)
        host = dict(pack=host_us(lambda: runner.pack_items(items)), uploads=host_us(uploads),
                    forced_uploads=host_us(lambda: uploads(True)), replay_launch=host_us(g.graph.replay),
                    pool_replay=host_us(lambda: pool.replay(batch.key, pixels, batch_grids)),
                    split=host_us(lambda: split(rows, [tokens], tower.out_hidden_size)),
                    encode=host_us(lambda: runner.encode(items)))
    return dict(model=name, attention=tower.backend, key=str(batch.key), learned=learned.reason,
                device_ms={k: round(statistics.median(v), 4) for k, v in times.items()},
                spread={k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()}, host_us=host)


def main() -> None:
    rounds = int(os.environ.get("ROUNDS", 7))
    with open(sys.argv[1], "a") as out:
        for name in sys.argv[2:]:
            row = stages(name, rounds)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
