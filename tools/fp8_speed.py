"""FP8 against bf16 per family (GPU): `python tools/fp8_speed.py OUT.jsonl 1x448,128x224 random:qwen2-vl-7b ...`.

Per model, in one process: the bf16 tower's graph pool as served (`plan_for(tower, 16384)`), `encode` timed per
workload (`service.bench.towers.workloads`, CUDA-event median of 10 after 3 warm-ups); then the same tower with
every block in FP8 (the gate's bars at 0: the speed of a tower that passes whole), captured and timed again, and
the FP8 floor (FP8 products + the served attention backend, `floor_graph(fp8=True)`) of the same shapes. One JSON
line per model is appended as it finishes, so a timeout keeps the finished ones.
"""
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from graphs.precision import quantize_with_gate
from graphs.runner import GraphRunner, plan_for
from models import load_tower
from models.families import FAMILIES
from service.bench import towers

out = Path(sys.argv[1])
only = sys.argv[2].split(",")
models = sys.argv[3:]
dev = torch.device("cuda")


def graph_rows(tower, tag):
    plan = plan_for(tower, max_batch_tokens=16384)
    graphs = GraphRunner(tower, dev, plan)
    t0 = time.perf_counter()
    graphs.capture()
    cap = time.perf_counter() - t0
    rows = {}
    for wname, grids in towers.workloads(tower.processor.patch_size).items():
        if wname not in only:
            continue
        items = towers.random_items(tower, grids)
        hits0, eager0 = graphs.stats.graph_items, sum(graphs.stats.eager_items.values())
        with torch.inference_mode():
            ms = towers.cuda_time(lambda: graphs.encode(items))  # noqa: B023
        hit = graphs.stats.graph_items - hits0
        miss = sum(graphs.stats.eager_items.values()) - eager0
        rows[wname] = dict(graph_ms=round(ms, 3), hit_rate=round(hit / max(hit + miss, 1), 3),
                           patches=sum(t * h * w for t, h, w in grids), grids=grids)
    info = dict(graphs=len(graphs.pool.graphs), capture_s=round(cap, 1), failures=len(graphs.pool.failed))
    print(tag, info, flush=True)
    return rows, info


with out.open("a") as f:
    import transformers
    f.write(json.dumps({"env": {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                                "torch": torch.__version__, "transformers": transformers.__version__}}) + "\n")
    for name in models:
        t0 = time.time()
        try:
            tower = load_tower(name, device="cuda", dtype="bfloat16")
            bf16, bf16_info = graph_rows(tower, f"{name} bf16")
            gc.collect()
            torch.cuda.empty_cache()
            report = quantize_with_gate(tower, dev, FAMILIES[tower.family].video, 0.0, 0.0)
            fp8, fp8_info = graph_rows(tower, f"{name} fp8")
            dims = towers.tower_dims(tower)
            best = tower.backend if tower.backend not in ("varlen", "sdpa") else "varlen"
            rows = []
            for wname, r in fp8.items():
                row = dict(model=name, workload=wname, patches=r["patches"],
                           bf16_graph_ms=bf16[wname]["graph_ms"], bf16_hit=bf16[wname]["hit_rate"],
                           fp8_graph_ms=r["graph_ms"], fp8_hit=r["hit_rate"],
                           vs_bf16=round(r["graph_ms"] / bf16[wname]["graph_ms"], 3))
                try:  # a floor that fails to capture costs its own figure, not the model's rows
                    ms_floor = towers.cuda_time(towers.floor_graph(dims, r["grids"], tower, best, fp8=True))
                    row.update(floor_fp8_ms=round(ms_floor, 3), over_floor_fp8=round(r["graph_ms"] / ms_floor, 2))
                except Exception as exc:  # noqa: BLE001
                    row.update(floor_error=repr(exc))
                    torch.cuda.synchronize()
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
            rec = dict(model=name, seconds=round(time.time() - t0, 1), gate=str(report), bf16=bf16_info,
                       fp8=fp8_info, rows=rows)
        except Exception as exc:  # noqa: BLE001
            rec = dict(model=name, seconds=round(time.time() - t0, 1), error=repr(exc))
            print(name, "failed", repr(exc), flush=True)
            traceback.print_exc()
        f.write(json.dumps(rec) + "\n")
        f.flush()
        tower = None
        gc.collect()
        torch.cuda.empty_cache()
        print(name, "done in", round(time.time() - t0, 1), "s", flush=True)
