"""Loading a tower on its device and capturing its graph pool, for whichever process serves it."""

from __future__ import annotations

import gc
import logging
import time

import torch

from graphs.runner import GraphRunner, plan_for
from graphs.self_check import self_check
from service.settings import ServeSettings

log = logging.getLogger("vitserve.engine")


def build_runner(settings: ServeSettings) -> GraphRunner:
    """Load the tower on `settings.device` and capture its graphs."""
    from models.loader import load_tower, resolve_device

    s = settings
    t0 = time.perf_counter()
    device = resolve_device(s.device)
    bind_device(device)
    tower = load_tower(s.model, device=s.device, dtype=s.dtype, attention=s.attention,
                       batch_invariant=s.batch_invariant)
    from models.families import FAMILIES

    video = FAMILIES[tower.family].video
    if s.quantization == "fp8":  # before the memory budget is fitted: FP8 weights take half the room
        from graphs.precision import quantize_with_gate

        tower.quantization = quantize_with_gate(tower, device, video)
    max_tokens, budgets = s.max_batch_tokens, s.budgets
    capped = s.gpu_memory is not None and device.type == "cuda"
    if capped:
        from service.engine.memory import fit_budget

        max_tokens, message = fit_budget(tower, device, s.gpu_memory, s.max_batch_tokens)
        log.info(message)
        if budgets:
            budgets = [b for b in budgets if b <= max_tokens] or [max_tokens]
    items = min(s.max_batch_items, max_tokens) if s.max_batch_items else None
    # Graphs for the modalities the family takes (an images-only tower captures no video keys).
    modalities = ("image", "video") if video else ("image",)
    while True:
        plan = plan_for(tower, max_tokens, budgets, items, s.t_capture, s.budget_steps)
        runner = GraphRunner(tower, device, plan, use_graphs=not s.eager, modalities=modalities,
                             video_chunking=s.video_chunking)
        # The backend in use, whatever --attention asked for (auto may have fallen back): operators check it.
        log.info("loaded %s (%s) on %s, attention: %s, in %.1fs; %s", s.model, tower.family, device, tower.backend,
                 time.perf_counter() - t0, runner.capture_plan())
        # Under a budget, calibration waits for the captures to fit: it runs a full batch, eagerly where
        # a capture failed, which would run out of the same memory.
        runner.capture(calibrate=not capped, stop_at_out_of_memory=capped)
        if not capped:
            self_check(runner)
            return runner
        smaller = _budgets_that_fit(runner, s.gpu_memory)
        if smaller is None:
            runner.calibrate()
            self_check(runner)
            return runner
        # The probe's estimate was off for the larger budgets: serving their keys eagerly would run out
        # of the same memory, so serve the budgets below the first that did not fit, captured afresh.
        del runner
        gc.collect()
        torch.cuda.empty_cache()
        budgets = smaller
        max_tokens, items = smaller[-1], min(items, smaller[-1]) if items else None


def _budgets_that_fit(runner: GraphRunner, setting: str) -> list[int] | None:
    """None when every capture fitted the memory budget; else the budgets below the smallest one that
    ran out of memory (MemoryBudgetError when there are none). Captures run largest first and stop at
    the first that runs out, so each attempt drops the budgets from that one up."""
    from service.engine.memory import MemoryBudgetError, out_of_memory

    short = sorted((k for k, why in runner.pool.failed.items() if out_of_memory(why)), key=lambda k: k.budget)
    if not short:
        return None
    smaller = [b for b in runner.plan.budgets if b < short[0].budget]
    names = ", ".join(str(k) for k in short[:3])
    if not smaller:
        raise MemoryBudgetError(f"--gpu-memory {setting}: {len(short)} graph(s) did not fit when captured ({names}"
                                f"{'...' if len(short) > 3 else ''}); lower --max-batch-tokens or raise --gpu-memory")
    log.warning("--gpu-memory %s: %d graph(s) did not fit when captured (%s%s); capturing again with budgets up to "
                "%d tokens", setting, len(short), names, "..." if len(short) > 3 else "", smaller[-1])
    return smaller


def bind_device(device: torch.device) -> None:
    # The current CUDA device is per thread: the loading and engine threads must use the served one.
    if device.type == "cuda":  # "cuda" without an index is the default device, as torch reads it
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
