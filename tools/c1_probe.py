"""A lone request with one engine and with two, alternated, and what each idle server does to the host.

    OUT=out python tools/c1_probe.py [--model random:qwen2.5-vl-7b] [--rounds 2] [--engines 1,2]

For `vitserve bench --http`'s figure "p50 at c=1 with --data-parallel 2 no worse than with one engine":
one engine's and two engines' servers take turns (1, 2, 1, 2, ...), each measured at c=1 for 10 s with
its phases. Before each level, with the server idle, it records the busiest threads of the server's
processes over 5 s and times pure CPU work in a fresh process (preprocessing the bench's JPEGs, and a
Python loop): if that work is slower while one server idles than while the other does, the difference
is the host's, not the request path's. Results in $OUT/c1_probe.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.bench.http_client import bench_images, check_response, request_body, run_level  # noqa: E402
from service.bench.http_server import ServerProcess, server_stage_totals, stage_means  # noqa: E402

CPU_WORK = """
import statistics, sys, time
sys.path.insert(0, sys.argv[1])
from service.bench.http_client import bench_images
from service.media.image_preprocess import ProcessorConfig, preprocess_image_bytes
images, cfg = bench_images(), ProcessorConfig()
for i in range(20):
    preprocess_image_bytes(images[i % 4], cfg)
times = []
for i in range(200):
    start = time.perf_counter()
    preprocess_image_bytes(images[i % 4], cfg)
    times.append(time.perf_counter() - start)
start, total = time.perf_counter(), 0
for i in range(2_000_000):
    total += i
print(statistics.median(times) * 1e3, (time.perf_counter() - start) * 1e3)
"""


def cpu_work() -> dict[str, float]:
    """Median ms to preprocess one bench image, and ms of a 2M-step Python loop, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CPU_WORK, str(ROOT)], capture_output=True, text=True, check=True)
    preprocess, loop = (float(x) for x in out.stdout.split())
    return {"preprocess_ms": round(preprocess, 3), "loop_ms": round(loop, 1)}


def process_tree(pid: int) -> set[int]:
    found, grew = {pid}, True
    while grew:
        grew = False
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                parent = int(open(stat).read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            child = int(stat.split("/")[2])
            if parent in found and child not in found:
                found.add(child)
                grew = True
    return found


def thread_ticks(pids: set[int]) -> dict[tuple[str, str], int]:
    ticks = {}
    for pid in pids:
        for task in glob.glob(f"/proc/{pid}/task/*"):
            try:
                raw = open(task + "/stat").read()
            except OSError:
                continue
            fields = raw.rsplit(")", 1)[1].split()
            ticks[(task, raw[raw.index("(") + 1:raw.rindex(")")])] = int(fields[11]) + int(fields[12])
    return ticks


def busiest_threads(pids: set[int], seconds: float = 5.0, top: int = 5) -> list[tuple[float, str]]:
    """(CPU cores used, thread name) of the busiest threads of `pids` over `seconds`."""
    before = thread_ticks(pids)
    time.sleep(seconds)
    after = thread_ticks(pids)
    hz = os.sysconf("SC_CLK_TCK")
    used = [((after[k] - before.get(k, 0)) / hz / seconds, k[1]) for k in after]
    return sorted((round(c, 4), name) for c, name in used if c > 0)[-top:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen2.5-vl-7b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default="1,2", help="engine counts to alternate, comma-separated")
    parser.add_argument("--level-s", type=float, default=10.0)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    bodies = [request_body(image) for image in bench_images()]
    results: list[dict] = [{"server": None, "cpu_work": [cpu_work(), cpu_work()]}]
    print(json.dumps(results[0]), flush=True)
    for round_ in range(args.rounds):
        for engines in (int(n) for n in args.engines.split(",")):
            flags = ["--max-batch-tokens", "16384", "--cache-bytes", "0", "--data-parallel", str(engines)]
            with ServerProcess(args.model, flags, out / f"server_dp{engines}_{round_}.log", 900) as srv:
                for i in range(8):
                    check_response(srv.url, bodies[i % len(bodies)], None)
                time.sleep(2)
                assert srv.proc is not None
                pids = process_tree(srv.proc.pid)
                row: dict = {"server": f"dp{engines}", "round": round_, "processes": len(pids),
                             "idle_busiest_threads": busiest_threads(pids), "cpu_work": [cpu_work(), cpu_work()]}
                before = server_stage_totals(srv.url)
                level = run_level(srv.url, bodies, 1, 10**6, args.level_s)
                row.update(p50_ms=level["p50_ms"], p90_ms=level["p90_ms"],
                           server_ms=stage_means(before, server_stage_totals(srv.url), level["elapsed_s"]))
            results.append(row)
            print(json.dumps(row), flush=True)
    (out / "c1_probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
