"""Device memory: where it goes, and a budget an operator can set (`--gpu-memory`).

A served tower holds its weights; the CUDA context and the libraries' handles and workspaces (outside
PyTorch's allocator); the graph pool (the largest graph's activations, which every smaller graph reuses)
with the static input and output buffers; and room for eager forwards (oversize items, and batches that
the padding rule runs at their exact size), whose activations are as large as a graph's of the same
tokens. All but the weights and the context grow with the largest token budget.

With a budget, the largest token budget is the largest power of two whose measured needs fit: the
bytes per token are measured by capturing one probe graph after the weights are loaded, and the
allocator is capped first at what the budget leaves after the memory outside it, so that an eager
forward that would pass the budget fails alone (an out-of-memory error for its batch) instead of
taking memory another process on the GPU counts on. The probe is an estimate (one graph at 1024
tokens; the full pool holds many): when a capture under the cap runs out of memory all the same, the
engine captures again with the budgets below it (`loading.build_runner`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

log = logging.getLogger("vitserve.engine")

GIB = 2**30
MIB = 2**20
MARGIN = 256 * MIB  # for the allocator's rounding and fragmentation
PROBE_TOKENS = 1024
FRAGMENTATION = 1.1  # the probe's peak, scaled up: larger segments round and fragment too
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


class MemoryBudgetError(ValueError):
    """Even the smallest useful graph pool does not fit the budget; the message says how much it needs."""


def parse_memory(text: str | None) -> tuple[float | None, int | None]:
    """(fraction of the device, bytes): `0.5` is a fraction, `4GiB`/`4096MiB`/`4000000000` are bytes."""
    if text is None or not str(text).strip():
        return None, None
    value = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", value)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"--gpu-memory takes bytes (4GiB, 4096MiB, 4000000000) or a fraction of the device "
                         f"(0.5), got {text!r}")
    number, unit = float(m.group(1)), m.group(2)
    if not unit and number <= 1:
        if number <= 0:
            raise ValueError(f"--gpu-memory must be above 0, got {text!r}")
        return number, None
    return None, int(number * _UNITS[unit])


@dataclass
class MemoryReport:
    """Bytes on the device, as /info and /metrics show them."""

    total: int
    limit: int | None  # the budget (--gpu-memory), None without one
    weights: int
    graph_pool: int  # the graphs' shared pool and the static buffers
    other_allocated: int  # the allocator's other blocks (eager forwards, metadata cache...)
    outside_allocator: int  # CUDA context, library handles and workspaces, kernel images
    peak_reserved: int
    free: int  # on the whole device, whoever holds the rest

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def process_bytes(device: torch.device) -> int | None:
    """This process's device memory as the driver counts it (NVML), or None where NVML cannot say."""
    try:
        import os

        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - no NVML, no per-process accounting in this container: estimate instead
        return None
    return None


def _physical_index(index: int) -> int:
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v for v in visible.split(",") if v.strip()]
    return int(ids[index]) if index < len(ids) and ids[index].strip().isdigit() else index


def outside_allocator(device: torch.device) -> int:
    """Memory this process holds outside PyTorch's allocator: from NVML where it reports this process,
    else the device's used memory less the allocator's (which counts other processes' memory too)."""
    reserved = torch.cuda.memory_reserved(device)
    used = process_bytes(device)
    if used is None:
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    return max(0, used - reserved)


def weights_bytes(tower: Any) -> int:
    return sum(p.numel() * p.element_size() for p in tower.parameters())


def capture_bytes_per_token(tower: Any, device: torch.device) -> float:
    """Peak reserved bytes per merged token of capturing one graph at PROBE_TOKENS, through the pool's
    own steps (warm-up forward, then capture into a private pool), with its static buffers.

    Measured, not derived from one forward's activations: a capture's peak also holds the warm-up's
    activations (still allocated while the capture runs) and the private pool's segment rounding. On an
    H200 (Qwen2.5-VL) that was about twice an eager forward's peak, which a 4 GiB budget sized on one
    forward ran out of in its first capture."""
    from graphs.budgets import GraphKey
    from graphs.pool import GraphPool
    from graphs.runner import plan_for
    from graphs.stats import PoolStats

    plan = plan_for(tower, PROBE_TOKENS, [PROBE_TOKENS])
    key = GraphKey("image", PROBE_TOKENS, plan.length_classes(PROBE_TOKENS)[-1])
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    pool = GraphPool(tower, device, plan, PoolStats())
    pool.capture([key])
    if pool.failed:
        why = pool.failed[key]
        error = MemoryBudgetError if out_of_memory(why) else RuntimeError
        raise error(f"the probe capture of {PROBE_TOKENS} tokens failed: {why}")
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    log.info("memory probe: %d tokens captured with a peak of %.0f MiB reserved (%.0f MiB allocated) over the "
             "weights", PROBE_TOKENS, (peak - base) / MIB, (torch.cuda.max_memory_allocated(device) - allocated) / MIB)
    del pool
    torch.cuda.empty_cache()
    return (peak - base) / PROBE_TOKENS


def out_of_memory(failure: str) -> bool:
    """Whether a capture failure (`GraphPool.failed`'s text) was the device running out of memory."""
    return "out of memory" in failure.lower()


def limit_bytes(setting: str | None, device: torch.device) -> int | None:
    fraction, size = parse_memory(setting)
    if fraction is not None:
        return int(fraction * torch.cuda.mem_get_info(device)[1])
    return size


def fit_budget(tower: Any, device: torch.device, setting: str, max_batch_tokens: int) -> tuple[int, str]:
    """The largest token budget (a power of two, at most `max_batch_tokens`) whose graph pool, buffers and
    eager headroom fit `--gpu-memory` beside the weights and the memory outside the allocator; caps the
    allocator at what the budget leaves it, before the probe, so that nothing at start-up passes the
    budget either. Returns (budget, a line saying what was chosen and why)."""
    total = torch.cuda.mem_get_info(device)[1]
    limit = limit_bytes(setting, device)
    assert limit is not None
    outside = outside_allocator(device)
    # The memory outside the allocator grows after this (cuDNN plans and CUDA graphs are built during
    # capture; measured on an H200: 52 MiB past a 4 GiB budget without this margin).
    allocator_cap = limit - outside - MARGIN
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(device)

    def too_small(needed: str) -> MemoryBudgetError:
        return MemoryBudgetError(
            f"--gpu-memory {setting} ({limit / GIB:.2f} GiB) is too small: the weights and the CUDA context take "
            f"{(held + outside) / GIB:.2f} GiB and the smallest graph pool (64 tokens) needs {needed} GiB in all")

    fixed = held + outside + 2 * MARGIN  # before any graph
    if allocator_cap <= held:
        raise too_small(f"more than {fixed / GIB:.2f}")
    torch.cuda.set_per_process_memory_fraction(min(1.0, allocator_cap / total), device)
    try:
        per_token = capture_bytes_per_token(tower, device) * FRAGMENTATION
    except MemoryBudgetError as exc:  # the probe itself did not fit under the cap
        raise too_small(f"more than {fixed / GIB:.2f}") from exc
    room = allocator_cap - held
    budget = 0
    b = 64
    while b <= max_batch_tokens and b * per_token <= room:
        budget = b
        b *= 2
    if max_batch_tokens not in (budget, *(64 * 2**k for k in range(20))) and max_batch_tokens * per_token <= room:
        budget = max_batch_tokens
    if budget == 0:
        raise too_small(f"{(fixed + 64 * per_token) / GIB:.2f}")
    full = fixed + max_batch_tokens * per_token
    message = (f"--gpu-memory {limit / GIB:.2f} GiB: weights {weights_bytes(tower) / GIB:.2f} GiB, CUDA context and "
               f"libraries {outside / GIB:.2f} GiB, {per_token / 1024:.0f} KiB per token to capture a graph "
               f"(measured at {PROBE_TOKENS} tokens; an eager batch needs less) -> budgets up to {budget} tokens"
               + ("" if budget == max_batch_tokens else f" ({max_batch_tokens} would need {full / GIB:.2f} GiB)"))
    return budget, message


def report(runner: Any, setting: str | None) -> dict[str, Any] | None:
    """The engine's device memory now (None on the CPU)."""
    device = runner.device
    if device.type != "cuda":
        return None
    tower, pool_bytes, limit = runner.tower, runner.stats.pool_bytes, limit_bytes(setting, device)
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    weights = weights_bytes(tower)
    return MemoryReport(total=total, limit=limit, weights=weights, graph_pool=pool_bytes,
                        other_allocated=max(0, allocated - weights - pool_bytes),
                        outside_allocator=outside_allocator(device),
                        peak_reserved=torch.cuda.max_memory_reserved(device), free=free).as_dict()
