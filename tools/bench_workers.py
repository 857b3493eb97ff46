"""Preprocessing throughput against the number of worker processes (the server's own pool and jobs):
448x448 JPEGs decoded, resized and patchified for Qwen2.5-VL, written to shared memory, as many at once
as there are workers. Also what the isolation costs one lone image: the job through a worker against the
same preprocessing called in this process.

    python tools/bench_workers.py [--workers 1,2,4,8,14] [--images 400] [--json OUT]

Use it to choose `--preprocess-workers` on a new host, or after a change to the worker pool or its jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ProcessorConfig  # noqa: E402
from models.presets import PRESETS  # noqa: E402
from service import shm  # noqa: E402
from service.bench.http_client import bench_images  # noqa: E402
from service.media.image_preprocess import preprocess_image_bytes  # noqa: E402
from service.media.limits import MediaLimits  # noqa: E402
from service.workers.pool import Owner, WorkerPool  # noqa: E402


async def throughput(workers: int, images: list[bytes], cfg: ProcessorConfig, count: int) -> dict:
    pool = WorkerPool(workers)
    pool.start()
    names = shm.SegmentNames()
    try:
        async def one(i: int, owner: Owner) -> float:
            data = images[i % len(images)]
            source, pixels = names.next("in"), names.next("px")
            shm.write_array(source, np.frombuffer(data, dtype="uint8"))
            t0 = time.perf_counter()
            try:
                await pool.call(owner, "service.workers.jobs:prepare_media", source, len(data), "image", cfg, {},
                                MediaLimits(), pixels, on_ask=lambda cost: True)
            finally:
                shm.unlink(source)
                shm.unlink(pixels)
            return time.perf_counter() - t0

        for i in range(2 * workers):  # every worker has imported and run once
            await one(i, Owner())
        singles = [await one(i, Owner()) for i in range(20)]
        start = time.perf_counter()
        owners = [Owner() for _ in range(count)]
        await asyncio.gather(*(one(i, owners[i]) for i in range(count)))
        elapsed = time.perf_counter() - start
    finally:
        pool.stop()
    return {"workers": workers, "images": count, "images_per_s": round(count / elapsed, 1),
            "lone_image_ms": round(statistics.median(singles) * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="1,2,4,8,14")
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    preset = PRESETS["random:qwen2.5-vl-7b"]
    cfg = ProcessorConfig.from_dicts(preset.family, preset.preprocessor, preset.video_preprocessor)
    images = bench_images(8)
    in_process = []
    for i in range(40):
        t0 = time.perf_counter()
        preprocess_image_bytes(images[i % len(images)], cfg)
        in_process.append(time.perf_counter() - t0)
    rows = [{"workers": 0, "lone_image_ms": round(statistics.median(in_process[10:]) * 1e3, 3),
             "note": "in this process, no worker"}]
    for n in (int(x) for x in args.workers.split(",")):
        rows.append(asyncio.run(throughput(n, images, cfg, args.images)))
        print(json.dumps(rows[-1]), flush=True)
    result = {"cpus": os.cpu_count(), "rows": rows}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
