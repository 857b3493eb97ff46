"""Packing, the graph pool and the eager fallback behind one call: items in, embeddings out.

This is what `vitserve encode` and the server's engine loop call. It knows nothing of HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphs.budgets import BudgetPlan
from graphs.packing import Batch, PackItem, pack
from graphs.pool import GraphPool
from graphs.stats import PoolStats
from models.config import VisualInput
from models.protocol import TowerOutput, VisionTower

log = logging.getLogger("vitserve.graphs")


@dataclass
class ItemOutput:
    """One item's merged tokens [tokens, out_hidden] and DeepStack features, on `device`."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


def plan_for(tower: VisionTower, max_batch_tokens: int = 16384, budgets: list[int] | None = None,
             max_items: int | None = None, t_capture: int = 8) -> BudgetPlan:
    proc = tower.processor
    patch_area = proc.patch_size**2
    largest_frame = max(proc.max_pixels, proc.video.max_pixels) // patch_area
    window = getattr(tower, "window", 0)
    return BudgetPlan.create(
        max_batch_tokens=max_batch_tokens,
        budgets=budgets,
        max_items=max_items,
        merge_unit=tower.merge_unit,
        t_capture=t_capture,
        max_segment_patches=max(largest_frame, tower.merge_unit),
        windows=bool(window),
        window_patches=window * window * tower.merge_unit,
    )


class GraphRunner:
    def __init__(self, tower: VisionTower, device: torch.device, plan: BudgetPlan, use_graphs: bool = True,
                 modalities: tuple[str, ...] = ("image", "video")) -> None:
        self.tower = tower
        self.device = device
        self.plan = plan
        self.use_graphs = use_graphs
        self.modalities = modalities
        self.stats = PoolStats()
        self.pool = GraphPool(tower, device, plan, self.stats)

    def capture(self) -> None:
        if self.use_graphs:
            self.pool.capture(self.plan.keys(self.modalities))

    def pack_items(self, items: Sequence[VisualInput]) -> list[Batch]:
        return pack([self.pack_item(it) for it in items], self.plan, graphs=self.use_graphs)

    def pack_item(self, item: VisualInput) -> PackItem:
        t, h, w = item.grid_thw
        return PackItem(item.num_patches // self.plan.merge_unit, item.modality, t, h * w)

    def run_batch(self, batch: Batch, items: Sequence[VisualInput]) -> list[ItemOutput]:
        """Run one packed batch; `items` are the batch's own items, in `batch.items` order."""
        grids = [it.grid_thw for it in items]
        pixels = concat_pixels([it.pixels for it in items])
        key = batch.key
        if key is not None and key in self.pool.graphs:
            out = self.pool.replay(key, pixels, grids)
        else:
            reason = batch.reason or ("capture_failed" if key in self.pool.failed else "graphs_disabled")
            out = self.eager(pixels, grids)
            self.stats.record_eager(reason, len(items))
        return split(out, [it.num_patches // self.plan.merge_unit for it in items])

    def eager(self, pixels: np.ndarray | torch.Tensor, grids: list) -> TowerOutput:
        cap = self.tower.required_capacity(grids)
        meta = {k: torch.from_numpy(v).to(self.device, non_blocking=True)
                for k, v in self.tower.build_metadata(grids, cap).items()}
        px = torch.as_tensor(pixels).to(self.device, non_blocking=True)
        with torch.inference_mode():
            return self.tower(px, meta, cap)

    def encode(self, items: Sequence[VisualInput]) -> list[ItemOutput]:
        """All items, packed and run; results in the caller's order."""
        results: list[ItemOutput | None] = [None] * len(items)
        for batch in self.pack_items(items):
            outs = self.run_batch(batch, [items[i] for i in batch.items])
            for i, out in zip(batch.items, outs):
                results[i] = out
        return results  # type: ignore[return-value]


def concat_pixels(parts: list) -> np.ndarray | torch.Tensor:
    """Items' pixel rows back to back; host arrays stay on the host, device tensors on the device."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return np.concatenate(parts)


def split(out: TowerOutput, tokens: list[int]) -> list[ItemOutput]:
    embeds = out.embeds.split(tokens)
    deepstack = [d.split(tokens) for d in out.deepstack]
    return [ItemOutput(e, [d[i] for d in deepstack]) for i, e in enumerate(embeds)]
