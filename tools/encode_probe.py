"""Where the host's share of one `GraphRunner.encode` goes, and what the tower's product layouts and output copies
cost (Qwen3-VL-8B, 32x224 and 1x448, each in a budget of exactly its tokens).

    python3 tools/encode_probe.py OUT.jsonl

"host" rows: `*_us` are host medians of back-to-back calls (a call that launches device work waits once the
device's queue is full, so a replay's reads as the replay itself); `*_ms` are CUDA-event medians, synchronized
between calls (encode: packing, staging, replay and the split into items; run: without the split; replay: the
graph alone; split and clone: the output's copy into items, and a plain copy of it); a cProfile of 50 encodes is
printed. "layout" rows: one product captured 20 times in a graph, us each: the weight as stored ([out, in], `tn`)
or transposed ([in, out], `nn`), without bias, with it or with the GELU epilogue, and the last merger product
written into the joined output directly (`out_strided`) against a product and a copy.

Found (H200, aa1dba5, `docs/bench/encode_host_h200_aa1dba5.jsonl`): the split cost 0.46 ms of host time for 32 items
(fixed in e5d2831), packing 106 us; `nn` no quicker than `tn` (slower at 4304 inputs); a strided output saves 2 us
of 106 and gives other bytes. At e19750b (docs/bench/products_bias_h200_e19750b.jsonl, in git history) the qkv
product of 6272 rows took 75.4 us with its bias, 81.9 without, 81.0 as `nn` without: not why the tower's is slower
than the floor's in its graph (79 against 67); at 2db844d, without cuBLAS's workspace, the tower's products and GELU
take what the floor's do (docs/performance.md).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphs.runner import GraphRunner, concat_pixels, plan_for, split  # noqa: E402
from models import load_tower  # noqa: E402
from service.bench.towers import cuda_time, random_items, workloads  # noqa: E402


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Median host microseconds of back-to-back calls of fn."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def graph_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds of one call of fn, captured `reps` times in a CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return round(statistics.median(times), 2)


def host_row(tower, wname: str) -> dict:
    grids = workloads(tower.processor.patch_size)[wname]
    items = random_items(tower, grids)
    tokens = sum(tower.geometry.units(g) for g in grids)
    runner = GraphRunner(tower, torch.device("cuda"), plan_for(tower, budgets=[tokens]), modalities=("image",))
    runner.capture()
    batch = runner.pack_items(items)[0]
    graph = runner.pool.graphs[batch.key]
    pixels = concat_pixels([it.pixels for it in items])
    grid_list = [it.grid_thw for it in items]
    rows = runner.run(batch, items)
    counts = [tower.geometry.tokens(it.grid_thw, it.modality) for it in items]
    hidden = tower.out_hidden_size
    row = dict(probe="host", workload=wname,
               pack_us=host_us(lambda: runner.pack_items(items)),
               concat_us=host_us(lambda: concat_pixels([it.pixels for it in items])),
               replay_call_us=host_us(lambda: runner.pool.replay(batch.key, pixels, grid_list), n=50),
               graph_launch_us=host_us(lambda: graph.graph.replay(), n=50),
               split_host_us=host_us(lambda: split(rows, counts, hidden), n=50),
               encode_host_us=host_us(lambda: runner.encode(items), n=50),
               encode_ms=round(cuda_time(lambda: runner.encode(items), iters=30), 3),
               run_ms=round(cuda_time(lambda: runner.run(batch, items), iters=30), 3),
               replay_ms=round(cuda_time(graph.graph.replay, iters=30), 3),
               split_ms=round(cuda_time(lambda: split(rows, counts, hidden), iters=30), 3),
               clone_ms=round(cuda_time(lambda: rows.clone(), iters=30), 3))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(50):
        runner.encode(items)
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[:5000], flush=True)
    runner.pool.graphs.clear()
    return row


def layout_row(m: int, k: int, n: int, act: str | None) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 30
    wt = w.t().contiguous()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    row = dict(probe="layout", shape=f"{m}x{k}x{n}", act=act,
               tn_bias=graph_us(lambda: F.linear(x, w, b)), nn_bias=graph_us(lambda: torch.addmm(b, x, wt)),
               tn=graph_us(lambda: F.linear(x, w)), nn=graph_us(lambda: torch.mm(x, wt)))
    if act:
        row["tn_gelubias"] = graph_us(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
        row["nn_gelubias"] = graph_us(lambda: torch._addmm_activation(b, x, wt, use_gelu=True))
        row["tn_bias_then_gelu"] = graph_us(lambda: F.gelu(F.linear(x, w, b), approximate="tanh"))
    if n == 4096:  # the merger's last product, into the joined output [tokens, 4 levels x 4096]
        joined = torch.empty(m, 4 * n, device="cuda", dtype=torch.bfloat16)
        row["tn_bias_copy"] = graph_us(lambda: joined[:, :n].copy_(F.linear(x, w, b)))
        row["tn_bias_out_strided"] = graph_us(lambda: torch.addmm(b, x, w.t(), out=joined[:, :n]))
        torch.addmm(b, x, w.t(), out=joined[:, :n])
        row["strided_equal"] = bool(torch.equal(F.linear(x, w, b), joined[:, :n]))
    return row


def main(out_path: str) -> None:
    tower = load_tower("random:qwen3-vl-8b", device="cuda", dtype="bfloat16")
    with open(out_path, "w") as out, torch.inference_mode():
        rows = [host_row(tower, wname) for wname in ("32x224", "1x448")]
        torch.cuda.empty_cache()
        for patches in (6272, 784):
            for k, n, act in ((1152, 3456, None), (1152, 1152, None), (1152, 4304, "gelu"), (4304, 1152, None),
                              (4608, 4608, "gelu"), (4608, 4096, None)):
                rows.append(layout_row(patches if k != 4608 else patches // 4, k, n, act))
                print(json.dumps(rows[-1]), flush=True)
        for row in rows:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
