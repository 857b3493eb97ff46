"""The engine-only reference of `vitserve bench --http`: the server's model and plan loaded in this process
and timed on the same images, preprocessing plus `GraphRunner.encode`, without HTTP."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# The engine alone is also timed with this pause before each image: back to back its caches stay hot,
# while each of a server's processes handles a lone request after idling (2-core dev box: preprocessing
# one bench JPEG 1.20 ms back to back, 1.88 ms after a 6 ms sleep).
IDLE_GAP_S = 0.01


def engine_reference(images: Sequence[bytes], *, model: str, device: str, dtype: str, max_batch_tokens: int,
                     budgets: list[int] | None = None, max_batch_items: int | None = None, t_capture: int = 8,
                     budget_steps: int = 1, eager: bool = False, workers: int = 2, single_reps: int = 20,
                     batch_reps: int = 5) -> dict[str, Any]:
    """Preprocessing (`preprocess_image_bytes`, in a pool of the server's worker count) plus
    `GraphRunner.encode` up to a device sync, the server's model and plan, same images. Throughput: one
    full batch (the largest budget's worth of these images); latency: one image. Outputs stay on the
    device (the server also converts them to bf16 and copies them to the host)."""
    import torch

    from graphs.runner import GraphRunner, plan_for
    from models import load_tower
    from service.engine.loading import bind_device

    tower = load_tower(model, device=device, dtype=dtype)
    dev = next(tower.parameters()).device
    bind_device(dev)  # captures and replays run on the current device's streams: cuda:1 must be current
    plan = plan_for(tower, max_batch_tokens, budgets, max_batch_items, t_capture, budget_steps)
    runner = GraphRunner(tower, dev, plan, use_graphs=not eager)
    runner.capture()
    try:
        with torch.inference_mode():
            times = _time_engine(runner, images, workers, single_reps, batch_reps)
    finally:
        graphs = len(runner.pool.graphs)
        del runner, tower  # the server shares this device: give the memory back before the load
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": str(dev), "dtype": dtype, "graphs": graphs, **times,
            "single_reps": single_reps, "batch_reps": batch_reps}


def _time_engine(runner: Any, images: Sequence[bytes], workers: int, single_reps: int,
                 batch_reps: int) -> dict[str, Any]:
    import torch

    from service.media.image_preprocess import preprocess_image_bytes

    proc, dev = runner.tower.processor, runner.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def prep(data: bytes):
        return preprocess_image_bytes(data, proc)

    tokens = runner.tower.geometry.units(prep(images[0]).grid_thw)
    n = max(1, min(runner.plan.max_items, runner.plan.max_budget // tokens))
    batch_bytes = [images[i % len(images)] for i in range(n)]

    def single(i: int, idle_s: float = 0.0) -> tuple[float, float]:
        time.sleep(idle_s)
        t0 = time.perf_counter()
        item = prep(images[i % len(images)])
        t1 = time.perf_counter()
        runner.encode([item])
        sync()
        return t1 - t0, time.perf_counter() - t1

    with ThreadPoolExecutor(max(1, workers)) as pool:
        def batch() -> tuple[float, float]:
            t0 = time.perf_counter()
            items = list(pool.map(prep, batch_bytes))
            t1 = time.perf_counter()
            runner.encode(items)
            sync()
            return t1 - t0, time.perf_counter() - t1

        for i in range(min(3, single_reps)):  # warm-up
            single(i)
        batch()
        singles = [single(i) for i in range(single_reps)]
        after_idle = [single(i, IDLE_GAP_S) for i in range(single_reps)]
        batches = [batch() for _ in range(batch_reps)]

    def med(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    single_ms = med([a + b for a, b in singles])
    batch_ms = med([a + b for a, b in batches])
    return {
        "tokens_per_image": tokens,
        "single_ms": round(single_ms, 3), "single_preprocess_ms": round(med([a for a, _ in singles]), 3),
        "single_encode_ms": round(med([b for _, b in singles]), 3),
        "single_after_idle_ms": round(med([a + b for a, b in after_idle]), 3),
        "single_after_idle_preprocess_ms": round(med([a for a, _ in after_idle]), 3),
        "batch_images": n, "batch_ms": round(batch_ms, 3),
        "batch_preprocess_ms": round(med([a for a, _ in batches]), 3),
        "batch_encode_ms": round(med([b for _, b in batches]), 3),
        "images_per_s": round(n / batch_ms * 1e3, 3),
        "encode_only_images_per_s": round(n / med([b for _, b in batches]) * 1e3, 3),
    }
