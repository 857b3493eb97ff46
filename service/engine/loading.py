"""Loading a tower on its device and capturing its graph pool, for whichever process serves it."""

from __future__ import annotations

import logging
import time

import torch

from graphs.runner import GraphRunner, plan_for
from service.settings import ServeSettings

log = logging.getLogger("vitserve.engine")


def build_runner(settings: ServeSettings) -> GraphRunner:
    """Load the tower on `settings.device` and capture its graphs."""
    from models.loader import load_tower, resolve_device

    s = settings
    t0 = time.perf_counter()
    device = resolve_device(s.device)
    bind_device(device)
    tower = load_tower(s.model, device=s.device, dtype=s.dtype, attention=s.attention)
    max_tokens, budgets = s.max_batch_tokens, s.budgets
    if s.gpu_memory is not None and device.type == "cuda":
        from service.engine.memory import fit_budget

        max_tokens, message = fit_budget(tower, device, s.gpu_memory, s.max_batch_tokens)
        log.info(message)
        if budgets:
            budgets = [b for b in budgets if b <= max_tokens] or [max_tokens]
    items = min(s.max_batch_items, max_tokens) if s.max_batch_items else None
    plan = plan_for(tower, max_tokens, budgets, items, s.t_capture)
    runner = GraphRunner(tower, device, plan, use_graphs=not s.eager, video_chunking=s.video_chunking)
    log.info("loaded %s (%s) on %s in %.1fs; %s", s.model, tower.family, device, time.perf_counter() - t0,
             runner.capture_plan())
    runner.capture()
    if s.gpu_memory is not None and device.type == "cuda":
        from service.engine.memory import MemoryBudgetError

        short = sorted(str(k) for k, why in runner.pool.failed.items() if "out of memory" in why.lower())
        if short:  # serving those keys eagerly would run out of the same memory: refuse instead
            raise MemoryBudgetError(f"--gpu-memory {s.gpu_memory}: {len(short)} graph(s) did not fit when captured "
                                    f"({', '.join(short[:3])}...); lower --max-batch-tokens or raise --gpu-memory")
    return runner


def bind_device(device: torch.device) -> None:
    # The current CUDA device is per thread: the loading and engine threads must use the served one.
    if device.type == "cuda":  # "cuda" without an index is the default device, as torch reads it
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
