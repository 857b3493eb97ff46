"""Why a long video (over t_capture, so eager on both paths) costs more through a captured runner than
through an eager one (GPU only):  python tools/video_eager_probe.py random:qwen3-vl-8b OUT_DIR"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from graphs.runner import GraphRunner, plan_for
from models.config import VisualInput
from models.loader import load_tower
from service.bench.towers import cuda_time, workloads


def kernels(fn) -> tuple[float, str, int]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    total = sum(e.self_device_time_total for e in ev) / 1e3
    calls = sum(e.count for e in ev if e.self_device_time_total > 0)
    return total, ev.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), calls


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    workload = sys.argv[3] if len(sys.argv) > 3 else "4xvideo32f336"
    out.mkdir(parents=True, exist_ok=True)
    tower = load_tower(name, device="cuda", dtype="bfloat16")
    plan = plan_for(tower, max_batch_tokens=16384)
    rng = np.random.default_rng(0)
    items = [VisualInput("video" if t > 1 else "image",
                         torch.from_numpy(rng.integers(0, 256, (t * h * w, tower.processor.patch_dim),
                                                       dtype=np.uint8)).cuda(), (t, h, w))
             for t, h, w in workloads(tower.processor.patch_size)[workload]]
    lines = [f"{name} {workload} backend={getattr(tower, 'backend', '?')}"]
    eager = GraphRunner(tower, torch.device("cuda"), plan, use_graphs=False)
    with torch.inference_mode():
        lines.append(f"eager runner before capture: {cuda_time(lambda: eager.encode(items)):.2f} ms")
        one = items[:1]
        lines.append(f"eager runner, one video: {cuda_time(lambda: eager.encode(one)):.2f} ms")
        k_before = kernels(lambda: eager.encode(items))
        graphs = GraphRunner(tower, torch.device("cuda"), plan)
        graphs.capture()
        lines.append(f"graph runner: {cuda_time(lambda: graphs.encode(items)):.2f} ms; "
                     f"eager runner after capture: {cuda_time(lambda: eager.encode(items)):.2f} ms; "
                     f"graph runner again: {cuda_time(lambda: graphs.encode(items)):.2f} ms")
        for label, runner in (("graph", graphs), ("eager", eager)):
            batches = [(b.key and str(b.key), b.reason, b.items) for b in runner.pack_items(items)]
            lines.append(f"{label} runner batches: {batches}")
        k_graph = kernels(lambda: graphs.encode(items))
        k_after = kernels(lambda: eager.encode(items))
    for label, (total, table, calls) in [("eager before capture", k_before), ("graph runner", k_graph),
                                         ("eager after capture", k_after)]:
        lines.append(f"== {label}: {total:.2f} ms of kernels in {calls} kernel calls\n{table}")
    text = "\n".join(lines)
    (out / f"video_probe_{name.split(':')[-1]}.txt").write_text(text)
    print(text[:3000], flush=True)


if __name__ == "__main__":
    main()
