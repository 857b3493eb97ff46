"""What the HTTP front spends per request, against an engine that answers at once.

    python tools/front_cost.py --concurrency 16 --seconds 10 [--serve-flags "..."]

Use it after a change to the HTTP path (parsing, rendering, workers, fronts): it measures the server's own
cost per request without a GPU.

The server is the real one (`service.http.server`, its worker processes, the batcher, the in-process
backend) with the tiny model's preprocessing and plan, but the engine returns zeros as wide as
Qwen2.5-VL-7B's output (3584 columns, bf16): each 448x448 image gets the 2.4 MB answer of the GPU
benchmark, and what is measured is the server's own work. Per level it prints images/s, the server
process's CPU milliseconds per request (`process_cpu_seconds_total` from /metrics: the front, not its
workers; with `--data-parallel 2 --fronts 1` not its engines either, as on a GPU), those of its main
thread alone (the event loop's, which bounds what one front can serve), p50 and the
server's phase means (`server_ms`, as in `vitserve bench --http`, the event loop's lag among them).
On a small machine the clients and workers share the cores with the front, so compare runs of one
machine, not absolute rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTH = 3584  # Qwen2.5-VL-7B's merged-token width
SERVING = "FRONT_COST_SERVING"


def patch_engine() -> None:
    """In the server process: the model loads and plans as usual, then answers with zeros at once."""
    from service.engine import backends
    from service.engine.types import ModelInfo

    build = backends.build_runner

    def build_instant(settings):  # type: ignore[no-untyped-def]
        runner = build(settings)
        merge = runner.plan.merge_unit

        def run(batch, items, staged=None):  # type: ignore[no-untyped-def]
            tokens = sum(t * h * w for t, h, w in (it.grid_thw for it in items)) // merge
            return torch.zeros((tokens, WIDTH), dtype=torch.bfloat16)

        runner.run = run
        return runner

    from_runner = ModelInfo.from_runner

    def wide(cls, runner):  # type: ignore[no-untyped-def]
        return dataclasses.replace(from_runner(runner), out_hidden_size=WIDTH, dtype=torch.bfloat16)

    backends.build_runner = build_instant
    ModelInfo.from_runner = classmethod(wide)  # type: ignore[method-assign, assignment]


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU time of the process's main thread, the event loop's (user and system, from /proc)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(url: str) -> float:
    from service.bench.http_server import server_metrics

    return sum(s.value for s in server_metrics(url) if s.name == "process_cpu_seconds_total")


# The server, and its engine processes (spawned: they import this file again as their main module).
if os.environ.get(SERVING) == "1":
    patch_engine()


def main() -> int:
    if os.environ.get(SERVING) == "1":
        from service.http.server import main as serve

        return serve()

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16", help="levels, comma-separated (default 1,16)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per level (default 10)")
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--serve-flags", default="", help="more `vitserve serve` flags")
    parser.add_argument("--out", type=Path, help="JSON lines, one per level")
    args = parser.parse_args()

    from service.bench.http_client import bench_images, request_body, run_level
    from service.bench.http_server import ServerProcess, server_stage_totals, stage_means

    flags = ["--device", "cpu", "--dtype", "bfloat16", "--cache-bytes", "0", *shlex.split(args.serve_flags)]
    bodies = [request_body(img) for img in bench_images(4)]
    os.environ[SERVING] = "1"  # the server started below patches its engine (see the top of this file)
    with tempfile.TemporaryDirectory() as folder, ServerProcess(
            "tiny-qwen2-vl", flags, Path(folder) / "server.log", 120, launcher=[str(Path(__file__).resolve())]) as srv:
        url = srv.url
        run_level(url, bodies, 2, 8, 30)  # warm-up: workers spawned, caches filled
        for c in (int(x) for x in args.concurrency.split(",")):
            cpu0, stages0 = cpu_seconds(url), server_stage_totals(url)
            loop0 = main_thread_cpu_seconds(srv.proc.pid)
            level = run_level(url, bodies, c, 10**9, args.seconds, processes=min(args.client_processes, c))
            cpu1, stages1 = cpu_seconds(url), server_stage_totals(url)
            loop1 = main_thread_cpu_seconds(srv.proc.pid)
            row = {"concurrency": c, "ok": level["ok"], "errors": level["errors"],
                   "images_per_s": level["images_per_s"], "p50_ms": level["p50_ms"],
                   "front_cpu_ms_per_request": round((cpu1 - cpu0) / max(level["ok"], 1) * 1e3, 3),
                   "loop_thread_cpu_ms_per_request": round((loop1 - loop0) / max(level["ok"], 1) * 1e3, 3),
                   "server_ms": stage_means(stages0, stages1, level["elapsed_s"]),
                   "serve_flags": args.serve_flags, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
