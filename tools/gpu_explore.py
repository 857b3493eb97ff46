"""GPU investigations behind the performance notes (H200): where capture memory goes, why a Qwen3-VL replay
can cost more than the same batch eager, and which matrix-product widths send cuBLAS to slow kernels.

    python3 tools/gpu_explore.py memory MODEL [--variant baseline|one-stream|expandable] [--json PATH]
    python3 tools/gpu_explore.py qwen3 [--json PATH]
    python3 tools/gpu_explore.py widths [--json PATH]

Each subcommand prints one JSON object per finding; `--json` also appends them to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30


def emit(record: dict, path: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# ---- capture memory ----------------------------------------------------------------------------
def segments_summary(torch) -> dict:
    """Reserved memory by (pool, stream), and the segments that are mostly free but pinned by a few
    live blocks (what empty_cache cannot give back)."""
    snap = torch.cuda.memory._snapshot()
    by_key: dict[str, dict] = defaultdict(lambda: {"segments": 0, "reserved": 0, "allocated": 0})
    pinned = []
    for seg in snap["segments"]:
        pool = seg.get("segment_pool_id", (0, 0))
        key = f"{'graph' if tuple(pool) != (0, 0) else 'normal'}:stream={seg['stream']}"
        entry = by_key[key]
        entry["segments"] += 1
        entry["reserved"] += seg["total_size"]
        entry["allocated"] += seg["allocated_size"]
        if tuple(pool) == (0, 0) and seg["allocated_size"] < 0.25 * seg["total_size"] and seg["total_size"] > 64 << 20:
            live = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
            frames = []
            for b in live[:3]:
                fr = [f"{f.get('filename', '?').split('/')[-1]}:{f.get('line', 0)}:{f.get('name', '?')}"
                      for f in (b.get("frames") or [])][:8]
                frames.append({"size": b["size"], "frames": fr})
            pinned.append({"segment_mib": round(seg["total_size"] / 2**20, 1),
                           "allocated_mib": round(seg["allocated_size"] / 2**20, 2),
                           "stream": seg["stream"], "live_blocks": len(live), "examples": frames})
    return {"by_pool_stream": {k: {"segments": v["segments"], "reserved_gib": round(v["reserved"] / GIB, 3),
                                   "allocated_gib": round(v["allocated"] / GIB, 3)} for k, v in by_key.items()},
            "mostly_free_segments": pinned[:20], "mostly_free_segments_total": len(pinned),
            "mostly_free_reserved_gib": round(sum(p["segment_mib"] for p in pinned) / 1024, 3)}


def memory(model: str, variant: str, path: str | None, attention: str = "auto") -> None:
    if variant == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    from graphs import pool as pool_module
    from graphs.runner import GraphRunner, plan_for
    from models import load_tower

    dev = torch.device("cuda", 0)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    total = torch.cuda.mem_get_info(dev)[1]

    def used() -> int:
        return total - torch.cuda.mem_get_info(dev)[0]

    torch.zeros(1, device=dev)
    stages = {"context": used()}
    tower = load_tower(model, device="cuda", dtype="bfloat16", attention=attention)
    torch.cuda.synchronize()
    stages["after_load"] = used()
    weights = sum(p.numel() * p.element_size() for p in tower.parameters())
    plan = plan_for(tower)
    runner = GraphRunner(tower, dev, plan)
    per_key = []
    original = runner.pool._capture_one
    if variant == "one-stream":  # every warm-up on one side stream instead of a pooled stream per key
        shared = torch.cuda.Stream(dev)
        pool = runner.pool

        def original(key, cap):
            inputs = pool._input_views(cap)
            shared.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(shared), torch.inference_mode():
                pool._forward_into_outputs(inputs, cap)
            torch.cuda.current_stream(dev).wait_stream(shared)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool._mempool):
                outputs = pool._forward_into_outputs(inputs, cap)
            return pool_module.CapturedGraph(key, cap, inputs, outputs, graph)

    def traced(key, cap):
        before = used()
        out = original(key, cap)
        torch.cuda.synchronize()
        per_key.append({"key": str(key), "used_delta_mib": round((used() - before) / 2**20, 1),
                        "reserved_gib": round(torch.cuda.memory_reserved(dev) / GIB, 3),
                        "allocated_gib": round(torch.cuda.memory_allocated(dev) / GIB, 3)})
        return out

    runner.pool._capture_one = traced
    t0 = time.perf_counter()
    runner.pool.capture(plan.keys(runner.modalities))
    capture_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    stages["after_capture"] = used()
    summary = segments_summary(torch)
    torch.cuda.empty_cache()
    stages["after_empty_cache"] = used()
    after = segments_summary(torch)
    stats = torch.cuda.memory_stats(dev)
    emit({"what": "memory", "model": model, "variant": variant, "attention": attention,
          "graphs": len(runner.pool.graphs),
          "capture_s": round(capture_s, 2), "weights_gib": round(weights / GIB, 3),
          "stages_gib": {k: round(v / GIB, 3) for k, v in stages.items()},
          "reserved_gib": round(torch.cuda.memory_reserved(dev) / GIB, 3),
          "allocated_gib": round(torch.cuda.memory_allocated(dev) / GIB, 3),
          "outside_allocator_gib": round((stages["after_empty_cache"] - torch.cuda.memory_reserved(dev)) / GIB, 3),
          "peak_allocated_gib": round(stats["allocated_bytes.all.peak"] / GIB, 3),
          "pool_bytes_stat_gib": round(runner.stats.pool_bytes / GIB, 3),
          "before_empty_cache": summary, "after_empty_cache": after,
          "largest_keys": sorted(per_key, key=lambda r: -r["used_delta_mib"])[:8]}, path)


# ---- Qwen3-VL: replay against eager -----------------------------------------------------------
def kernel_table(torch, fn, top: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kern = [(e.key, e.self_device_time_total / 1e3, e.count) for e in events if e.self_device_time_total > 0]
    kern.sort(key=lambda r: -r[1])
    return {"kernel_ms": round(sum(k[1] for k in kern), 3),
            "top": [{"name": n[:90], "ms": round(ms, 3), "calls": c} for n, ms, c in kern[:top]]}


def qwen3(path: str | None) -> None:
    import torch

    from graphs.runner import GraphRunner, plan_for
    from models import load_tower
    from service.bench.towers import cuda_time, random_items, workloads

    tower = load_tower("random:qwen3-vl-8b", device="cuda", dtype="bfloat16")
    dev = torch.device("cuda", 0)
    plan = plan_for(tower)
    graphs = GraphRunner(tower, dev, plan)
    graphs.capture()
    eager = GraphRunner(tower, dev, plan, use_graphs=False)
    for name in ("128x224", "32x224", "1x448", "video16f448"):
        grids = workloads(tower.processor.patch_size)[name]
        items = random_items(tower, grids)
        batches = graphs.pack_items(items)
        eager_batches = eager.pack_items(items)
        record = {"what": "qwen3", "workload": name,
                  "graph_batches": [(str(b.key), len(b.items), b.tokens) for b in batches],
                  "eager_batches": [(str(b.key), len(b.items), b.tokens) for b in eager_batches],
                  "cost": str(graphs.cost), "attention": getattr(tower.blocks[0].attn, "backend", "?")}
        with torch.inference_mode():
            record["graph_ms"] = round(cuda_time(lambda: graphs.encode(items)), 3)  # noqa: B023
            record["eager_ms"] = round(cuda_time(lambda: eager.encode(items)), 3)  # noqa: B023
            # The same batches, each through its graph and eagerly, one at a time.
            per_batch = []
            for b in batches:
                its = [items[i] for i in b.items]
                g_ms = cuda_time(lambda: graphs.run_batch(b, its))  # noqa: B023
                e_ms = cuda_time(lambda: eager.eager(torch.cat([i.pixels for i in its]),  # noqa: B023
                                                     [i.grid_thw for i in its]))  # noqa: B023
                per_batch.append({"key": str(b.key), "items": len(its), "tokens": b.tokens,
                                  "replay_ms": round(g_ms, 3), "eager_same_batch_ms": round(e_ms, 3)})
            record["per_batch"] = per_batch
            record["graph_kernels"] = kernel_table(torch, lambda: graphs.encode(items))  # noqa: B023
            record["eager_kernels"] = kernel_table(torch, lambda: eager.encode(items))  # noqa: B023
        emit(record, path)


# ---- cuBLAS widths ------------------------------------------------------------------------------
def widths(path: str | None) -> None:
    import torch

    from service.bench.towers import cuda_time

    cases = {  # (rows, in, out): the towers' products, and the width padded to a multiple of 64/128
        "qwen3 fc1 1152->4304": (25088, 1152, 4304), "qwen3 fc1 1152->4352": (25088, 1152, 4352),
        "qwen3 fc2 4304->1152": (25088, 4304, 1152), "qwen3 fc2 4352->1152": (25088, 4352, 1152),
        "qwen3 qkv 1152->3456": (25088, 1152, 3456), "qwen3 merger 4608->4608": (6272, 4608, 4608),
        "qwen3 merger 4608->4096": (6272, 4608, 4096),
        "qwen2 fc1 1280->5120": (25088, 1280, 5120), "qwen2 fc2 5120->1280": (25088, 5120, 1280),
        "qwen2.5 gate_up 1280->6912": (25088, 1280, 6912), "qwen2.5 down 3456->1280": (25088, 3456, 1280),
        "qwen2.5 down 3420->1280": (25088, 3420, 1280),
    }
    for name, (m, k, n) in cases.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ms = cuda_time(lambda: torch.nn.functional.linear(x, w, b), 5, 30)  # noqa: B023
        gelu = cuda_time(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True), 5, 30)  # noqa: B023
        emit({"what": "width", "case": name, "ms": round(ms, 4), "tflops": round(2 * m * k * n / ms / 1e9, 1),
              "gelu_epilogue_ms": round(gelu, 4)}, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["memory", "qwen3", "widths"])
    parser.add_argument("model", nargs="?", default="random:qwen2.5-vl-7b")
    parser.add_argument("--variant", default="baseline", choices=["baseline", "one-stream", "expandable"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--attention", default="auto")
    args = parser.parse_args()
    if args.what == "memory":
        memory(args.model, args.variant, args.json, args.attention)
    elif args.what == "qwen3":
        qwen3(args.json)
    else:
        widths(args.json)


if __name__ == "__main__":
    main()
