"""Before a runner serves: one real encode through every kind of path it will serve, compared with eager.

A backend that cannot run the dtype made every capture fail and every request 500 while the server
reported ready. So readiness is earned by encoding: for each modality a seeded sample item runs eagerly
(the reference, and the path of everything no graph holds), then through the smallest graph that holds
it and through the largest budget of that graph's length class (its buffers reach furthest). A graph
path that fails or disagrees with eager is dropped (its keys run eagerly, as a failed capture's do); an
eager path that fails is marked so that the batches only it could run fail with the reason. If nothing
can encode an item kind, `SelfCheckError` says why and the server does not become ready.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from models.config import VisualInput

if TYPE_CHECKING:
    from graphs.budgets import GraphKey
    from graphs.runner import GraphRunner

log = logging.getLogger("vitserve.graphs")

# Relative difference to eager above which a replay is wrong rather than rounded differently: stale or
# foreign metadata gives errors near 1; bf16 rounding of another kernel stays near 1e-2 at worst.
TOLERANCE = 5e-2
OK = "ok"


class SelfCheckError(RuntimeError):
    """No path of the runner can encode: every one failed its check (the message names each reason)."""


def sample_item(runner: GraphRunner, modality: str) -> VisualInput:
    """A seeded item that the smallest budget holds: a square image, or a video of two temporal patches."""
    m, plan = runner.tower.merge, runner.plan
    t = min(2, plan.t_capture) if modality == "video" else 1
    side = 1
    while t * (side + 1) ** 2 <= plan.budgets[0] and side < 8:
        side += 1
    grid = (t, side * m, side * m)
    rows = t * (side * m) ** 2
    pixels = np.random.default_rng(0).integers(0, 256, (rows, runner.tower.processor.patch_dim), np.uint8)
    return VisualInput(modality, pixels, grid)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_replay(runner: GraphRunner, key: GraphKey, item: VisualInput, reference: torch.Tensor | None) -> None:
    """Replay `item` alone through `key`'s graph; raise unless it agrees with the eager `reference` rows (or,
    without one, is finite)."""
    with torch.inference_mode():
        rows = runner.pool.replay(key, item.pixels, [item.grid_thw]).clone()
    if reference is None:
        if not torch.isfinite(rows.float()).all():
            raise ValueError("non-finite output")
        return
    diff = relative_difference(rows, reference)
    if not diff <= TOLERANCE:
        raise ValueError(f"differs from eager by {diff:.2e} (relative)")


def self_check(runner: GraphRunner) -> dict[str, str]:
    """Check every path; drop what fails (see the module docstring). Returns path -> "ok" or the reason,
    also kept in `runner.stats.self_check`. Raises SelfCheckError when no path can serve."""
    results: dict[str, str] = {}
    snapshot = runner.stats.as_dict()
    for modality in runner.modalities:
        item = sample_item(runner, modality)
        reference = None
        try:
            with torch.inference_mode():
                reference = runner.eager(item.pixels, [item.grid_thw], modality).joined().clone()
            if not torch.isfinite(reference.float()).all():
                raise ValueError("non-finite output")
            results[f"eager/{modality}"] = OK
        except Exception as exc:  # noqa: BLE001 - any failure of the path is its reason
            results[f"eager/{modality}"] = f"{type(exc).__name__}: {exc}"
            reference = None
        keys = sorted((k for k in runner.pool.graphs if k.modality == modality),
                      key=lambda k: (k.budget, k.length_class))
        if not keys:
            continue
        small = runner.pack_items([item])[0].key
        # the largest budget of the same length class: it holds the sample, and the longest buffers
        large = max((k for k in keys if small is not None and k.length_class == small.length_class),
                    key=lambda k: k.budget, default=None)
        chosen = [k for k in (small, large) if k in runner.pool.graphs]
        reason = OK
        for key in dict.fromkeys(chosen):  # the smallest that holds it, then the largest
            try:
                check_replay(runner, key, item, reference)
            except Exception as exc:  # noqa: BLE001
                reason = f"{key}: {type(exc).__name__}: {exc}"
                break
        results[f"graphs/{modality}"] = reason
        if reason != OK:
            runner.pool.fail(keys, f"self-check: {reason}")  # served eagerly, as a failed capture's keys are
            log.error("self-check: %s graphs dropped, served eagerly: %s", modality, reason)
    runner.stats.reset_to(snapshot)  # the checks are not traffic
    runner.stats.self_check = results
    runner.eager_errors = {m: results[f"eager/{m}"] for m in runner.modalities if results[f"eager/{m}"] != OK}
    for path, result in results.items():
        if result != OK:
            log.error("self-check: %s failed: %s", path, result)
    dead = [m for m in runner.eager_errors if not any(k.modality == m for k in runner.pool.graphs)]
    if dead:
        raise SelfCheckError(f"no path can encode {' or '.join(m + 's' for m in dead)}: "
                             + "; ".join(f"{p}: {r}" for p, r in results.items() if r != OK))
    log.info("self-check: %s", ", ".join(f"{p} {'ok' if r == OK else 'FAILED'}" for p, r in results.items()))
    return results
