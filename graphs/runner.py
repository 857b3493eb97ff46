"""Packing, the graph pool and the eager fallback behind one call: items in, embeddings out.

This is what `vitserve encode` and the server's engine loop call. It knows nothing of HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphs.budgets import BudgetPlan
from graphs.packing import Batch, PackItem, pack
from graphs.pool import GraphPool
from graphs.stats import PoolStats
from models.config import VisualInput
from models.protocol import CapacityError, TowerOutput, VisionTower

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
                 modalities: tuple[str, ...] = ("image", "video"), video_chunking: bool = False,
                 eager_when_cheaper: bool = True) -> None:
        self.tower = tower
        self.device = device
        self.plan = plan
        self.use_graphs = use_graphs
        # Long videos: split into chunks of at most t_capture temporal patches, which keeps them on
        # graphs. Exact, because no attention, merge or position term crosses a temporal patch.
        self.video_chunking = video_chunking
        self.modalities = modalities
        self.stats = PoolStats()
        self.pool = GraphPool(tower, device, plan, self.stats)
        # Eager runs below this many patches are bound by kernel launches, not the GPU; set by calibrate().
        # Until then (and on the CPU, where nothing is saved by a graph) every batch that fits replays.
        self.launch_bound_patches = float("inf")
        # Off in the server: there the engine thread shares the GIL with request handling, and an
        # eager forward's thousand-odd launches wait on it (3x slower under load on an H200), while a
        # replay is one call. Measured once at start-up, eager looks cheaper than it will be.
        self.eager_when_cheaper = eager_when_cheaper
        # The fixed cost of one replay in tokens of GPU time (calibrate()); None: never split a batch.
        self.replay_overhead_tokens: float | None = None

    def capture(self) -> None:
        if self.use_graphs:
            self.pool.capture(self.plan.keys(self.modalities))
            if self.device.type == "cuda" and self.pool.graphs:
                self.calibrate()
        else:
            self.stats.graph_mode, self.stats.no_graphs_reason = "off", "graphs disabled (--eager)"

    def capture_plan(self) -> str:
        """What `capture()` is about to do, in words for the start-up log. (For the engine's loader,
        service/engine/loading.py, whose own line still says "capturing N graphs" on the CPU too.)"""
        keys = len(self.plan.keys(self.modalities))
        if not self.use_graphs:
            return "no CUDA graphs (eager)"
        if self.device.type != "cuda":
            return f"no CUDA graphs on the CPU ({keys} fixed-shape eager keys)"
        return f"capturing {keys} CUDA graphs"

    def calibrate(self) -> None:
        """Measure what a replay costs beyond its budget's GPU time, and when padding costs more than
        launches. A replay costs its whole budget's GPU time plus a fixed overhead (host work,
        copies, a small batch's idle GPU), which the packing weighs when it splits a batch across
        budgets. An eager run costs the larger of its own patches' GPU time and the time to launch
        its kernels (a constant: a small eager forward measures it). In patches: replay costs the
        budget, eager costs max(patches, launch_bound_patches). With `eager_when_cheaper`, batches
        where eager is cheaper run eagerly (reason "padding"); everything else replays."""
        merge = self.tower.merge
        side = 16 * merge  # a 32x32-patch frame, a typical mid-sized image
        pixels = np.random.default_rng(0).integers(0, 256, (side * side, self.tower.processor.patch_dim), np.uint8)
        frame = VisualInput("image", pixels, (1, side, side))  # random, not zeros: zeros time faster
        count = max(1, min(self.plan.max_items, self.plan.max_budget // frame.num_tokens(merge)))
        small, big = [frame], [frame] * count

        def timed(fn, reps: int = 5) -> float:
            """The fastest of `reps` synchronised runs: the least disturbed by the host."""
            fn()
            best = float("inf")
            for _ in range(reps):
                torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize(self.device)
                best = min(best, time.perf_counter() - start)
            return best

        stats = self.stats.as_dict()
        graph_small = timed(lambda: self._run(small, force_eager=False))
        eager_small = timed(lambda: self._run(small, force_eager=True))
        big_batches = self.pack_items(big)
        graph_big = timed(lambda: self._run(big, force_eager=False), reps=3)
        budget_patches = sum(b.key.budget for b in big_batches if b.key) * self.plan.merge_unit
        per_patch = graph_big / max(budget_patches, 1)
        self.launch_bound_patches = eager_small / per_patch if per_patch > 0 else float("inf")
        small_key = self.pack_items(small)[0].key
        if per_patch > 0 and small_key is not None:
            per_token = per_patch * self.plan.merge_unit
            self.replay_overhead_tokens = max(0.0, graph_small / per_token - small_key.budget)
        self.stats.reset_to(stats)  # calibration runs are not traffic
        log.info("calibration: small batch %.2f ms eager, %.2f ms replayed; %.3f us per patch: eager is launch-bound "
                 "below %d patches%s; a replay's fixed cost is %s tokens", eager_small * 1e3, graph_small * 1e3,
                 per_patch * 1e6, self.launch_bound_patches, "" if self.eager_when_cheaper else " (not used)",
                 "unknown" if self.replay_overhead_tokens is None else f"{self.replay_overhead_tokens:.0f}")

    def _run(self, items: Sequence[VisualInput], force_eager: bool) -> list[ItemOutput]:
        outs = []
        for batch in self.pack_items(items):
            if force_eager:
                batch.reason = "calibration"
            outs += self.run_batch(batch, [items[i] for i in batch.items])
        return outs

    def pack_items(self, items: Sequence[VisualInput]) -> list[Batch]:
        return pack([self.pack_item(it) for it in items], self.plan, self.replay_overhead_tokens)

    def pack_item(self, item: VisualInput) -> PackItem:
        return to_pack_item(item, self.plan)

    def run_batch(self, batch: Batch, items: Sequence[VisualInput]) -> list[ItemOutput]:
        """Run one packed batch; `items` are the batch's own items, in `batch.items` order."""
        if batch.reason in ("t_capture", "over_budget") and self.chunkable(items[0]):
            return [self.encode_chunked(items[0])]
        grids = [it.grid_thw for it in items]
        pixels = concat_pixels([it.pixels for it in items], pin=self.device.type == "cuda")
        reason = batch.reason or self.eager_reason(batch, grids)
        if reason is None:
            try:
                out = self.pool.replay(batch.key, pixels, grids)
            except CapacityError:  # e.g. more Qwen2.5-VL windows than the class holds; nothing ran yet
                reason = "layout_capacity"
        if reason is not None:
            out = self.eager(pixels, grids)
            self.stats.record_eager(reason, len(items))
        return split(out, [it.num_patches // self.plan.merge_unit for it in items])

    def eager_reason(self, batch: Batch, grids: list) -> str | None:
        """Why a packed batch cannot (or should not) replay its graph, or None to replay."""
        if not self.use_graphs:
            return "graphs_disabled"
        if batch.key in self.pool.failed:
            return "capture_failed"
        graph = self.pool.graphs.get(batch.key)
        if graph is None:
            return "no_graph"
        patches = sum(t * h * w for t, h, w in grids)
        eager_cost = max(patches, self.launch_bound_patches)
        if self.eager_when_cheaper and eager_cost < 0.95 * graph.capacity.patches:  # 5%: the graph wins ties
            return "padding"
        return None

    def eager(self, pixels: np.ndarray | torch.Tensor, grids: list) -> TowerOutput:
        cap = self.tower.required_capacity(grids)
        meta = {k: torch.from_numpy(v).to(self.device, non_blocking=True)
                for k, v in self.tower.build_metadata(grids, cap).items()}
        px = torch.as_tensor(pixels).to(self.device, non_blocking=True)
        with torch.inference_mode():
            return self.tower(px, meta, cap)

    def chunkable(self, item: VisualInput) -> bool:
        t, h, w = item.grid_thw
        chunk_tokens = min(t, self.plan.t_capture) * h * w // self.plan.merge_unit
        return (self.video_chunking and self.use_graphs and item.modality == "video" and t > 1
                and chunk_tokens <= self.plan.max_budget)

    def encode_chunked(self, video: VisualInput) -> ItemOutput:
        """One long video as chunks of t_capture temporal patches (rows are t-major), re-joined."""
        t, h, w = video.grid_thw
        rows, step = h * w, self.plan.t_capture
        chunks = [VisualInput("video", video.pixels[s * rows:(s + min(step, t - s)) * rows], (min(step, t - s), h, w))
                  for s in range(0, t, step)]
        outs = self.encode(chunks)
        self.stats.record_chunked(len(chunks))
        deepstack = [torch.cat([o.deepstack[j] for o in outs]) for j in range(len(outs[0].deepstack))]
        return ItemOutput(torch.cat([o.embeds for o in outs]), deepstack)

    def encode(self, items: Sequence[VisualInput]) -> list[ItemOutput]:
        """All items, packed and run; results in the caller's order."""
        results: list[ItemOutput | None] = [None] * len(items)
        for batch in self.pack_items(items):
            outs = self.run_batch(batch, [items[i] for i in batch.items])
            for i, out in zip(batch.items, outs):
                results[i] = out
        return results  # type: ignore[return-value]


def to_pack_item(item: VisualInput, plan: BudgetPlan) -> PackItem:
    t, h, w = item.grid_thw
    return PackItem(item.num_patches // plan.merge_unit, item.modality, t, h * w)


def pack_inputs(items: Sequence[VisualInput], plan: BudgetPlan, replay_overhead: float | None = None) -> list[Batch]:
    """What `GraphRunner.pack_items` does, from the plan alone (a multi-engine server packs in its front)."""
    return pack([to_pack_item(it, plan) for it in items], plan, replay_overhead)


def concat_pixels(parts: list, pin: bool = False) -> np.ndarray | torch.Tensor:
    """Items' pixel rows back to back; device tensors stay on the device. Host arrays stay on the
    host, written straight into page-locked memory with `pin` (one copy, and the upload that follows
    is asynchronous; torch's host allocator keeps the block until that copy has run)."""
    if isinstance(parts[0], torch.Tensor):
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    if not pin:
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    rows = sum(len(p) for p in parts)
    staged = torch.empty((rows, *parts[0].shape[1:]), dtype=torch.from_numpy(parts[0][:0]).dtype, pin_memory=True)
    np.concatenate(parts, out=staged.numpy())
    return staged


def split(out: TowerOutput, tokens: list[int]) -> list[ItemOutput]:
    embeds = out.embeds.split(tokens)
    deepstack = [d.split(tokens) for d in out.deepstack]
    return [ItemOutput(e, [d[i] for d in deepstack]) for i, e in enumerate(embeds)]
