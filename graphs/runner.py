"""Packing, the graph pool and the eager fallback behind one call: items in, embeddings out.

This is what `vitserve encode` and the server's engine loop call. It knows nothing of HTTP.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from graphs.budgets import BudgetPlan
from graphs.packing import Batch, CostModel, PackItem, pack
from graphs.pool import GraphPool
from graphs.stats import PoolStats
from models.config import VisualInput
from models.metadata import EAGER_ROW_QUANTUM
from models.protocol import CapacityError, Geometry, TowerOutput, VisionTower

log = logging.getLogger("vitserve.graphs")


class EagerUnavailable(RuntimeError):
    """A batch only an eager forward can run, where the eager path failed its start-up check."""


@dataclass
class ItemOutput:
    """One item's merged tokens [tokens, out_hidden] and DeepStack features, on `device`."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


def plan_for(tower: VisionTower, max_batch_tokens: int = 16384, budgets: list[int] | None = None,
             max_items: int | None = None, t_capture: int = 8, steps_per_octave: int = 1) -> BudgetPlan:
    proc = tower.processor
    patch_area = proc.patch_size**2
    largest_frame = max(max(proc.max_pixels, proc.video.max_pixels) // patch_area, tower.merge_unit)
    whole_clip = tower.geometry.whole_clip
    return BudgetPlan.create(
        max_batch_tokens=max_batch_tokens,
        budgets=budgets,
        max_items=max_items,
        merge_unit=tower.merge_unit,
        t_capture=t_capture,
        max_segment_patches=largest_frame * (t_capture if whole_clip else 1),
        layout=tower.layout,
        whole_clip=whole_clip,
        steps_per_octave=steps_per_octave,
    )


class GraphRunner:
    """One tower on one device: its graph pool, the eager fallback and the measured costs. `run` executes
    a batch as `pack` routed it; `encode` packs and runs a list of items (the offline entry point)."""

    def __init__(self, tower: VisionTower, device: torch.device, plan: BudgetPlan, use_graphs: bool = True,
                 modalities: tuple[str, ...] = ("image", "video"), video_chunking: bool = False) -> None:
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
        # Measured by calibrate() on CUDA; None (the CPU, before calibration): never split nor pad-route.
        self.cost: CostModel | None = None
        # Modalities whose eager path failed its self-check (graphs/self_check.py), with the reason.
        self.eager_errors: dict[str, str] = {}

    @property
    def width(self) -> int:
        """Columns of a joined output row: the main embedding, then each DeepStack level."""
        return self.tower.out_hidden_size * (1 + self.tower.num_deepstack)

    def capture(self, calibrate: bool = True, stop_at_out_of_memory: bool = False) -> None:
        """Capture every key of the plan (see `GraphPool.capture`), then `calibrate` on the graphs."""
        if self.use_graphs:
            self.pool.capture(self.plan.keys(self.modalities), stop_at_out_of_memory)
            if calibrate and self.device.type == "cuda":  # the CPU's fixed-shape keys are not worth weighing
                self.calibrate()
        else:
            self.stats.graph_mode, self.stats.no_graphs_reason = "off", "graphs disabled (--eager)"

    def capture_plan(self) -> str:
        """What `capture()` is about to do, in words for the start-up log."""
        keys = len(self.plan.keys(self.modalities))
        if not self.use_graphs:
            return "no CUDA graphs (eager)"
        if self.device.type != "cuda":
            return f"no CUDA graphs on the CPU ({keys} fixed-shape eager keys)"
        return f"capturing {keys} CUDA graphs"

    def calibrate(self) -> None:
        """Measure what the packing weighs (see `CostModel`): a replay of each budget, full of small
        frames, and eager forwards of one and of eight mid-sized frames (a 32x32-patch frame, a
        typical image). Eager time is the median of its runs (it is bound by the host, whose noise is part
        of its price); a replay's the fastest. Without graphs there is no replay to weigh; `capture` calibrates
        on CUDA only. Calibration runs no eager forward larger than eight frames: under a memory cap
        the graphs' pool leaves no room for a large one's activations."""
        if not self.pool.graphs:
            return
        stats = self.stats.as_dict()
        self.cost = None  # packing without costs: one replay per batch, in the smallest budget holding it
        replays = [(budget, cost) for budget in self.plan.budgets if (cost := self.replay_cost(budget)) is not None]
        mid = self._frame(16, 16)
        top = max(1, min(8, self.plan.max_items, self.plan.max_budget // mid.num_tokens(self.tower.merge)))
        eager = [(len(batch) * mid.num_tokens(self.tower.merge), self._timed(batch, True, reps=5))
                 for batch in ([mid], [mid] * top)[: 2 if top > 1 else 1]]
        self.stats.reset_to(stats)  # calibration runs are not traffic
        if replays:
            self.cost = CostModel(tuple(replays), tuple(eager))
        log.info("calibration (ms): replays %s; eager %s", ", ".join(f"b{b} {c * 1e3:.2f}" for b, c in replays),
                 ", ".join(f"{t} tokens {c * 1e3:.2f}" for t, c in eager))

    @functools.cache  # noqa: B019 - a handful of frames per runner, kept for its life
    def _frame(self, rows: int, cols: int) -> VisualInput:
        """One frame of rows x cols tokens, seeded random pixels (zeros time faster)."""
        merge = self.tower.merge
        h, w = rows * merge, cols * merge
        rng = np.random.default_rng(rows * 1000 + cols)
        pixels = rng.integers(0, 256, (h * w, self.tower.processor.patch_dim), np.uint8)
        modality = "image" if "image" in self.modalities else self.modalities[0]  # a one-frame video otherwise
        return VisualInput(modality, pixels, (1, h, w))

    def replay_cost(self, budget: int) -> float | None:
        """Seconds of one replay of `budget` full of small frames (33 to 64 tokens: strips two tokens high, one
        length class), the fastest of three; None if the packing does not route them to that budget's graph."""
        count = -(-budget // 64)
        # Even sizes (frames two tokens high) where the budget allows: a strip one token high has more
        # attention windows than a class of Qwen2.5-VL's holds, and its batch then ran eagerly.
        halves = [budget // 2 // count + (1 if i < budget // 2 % count else 0) for i in range(count)]
        sizes = [2 * h for h in halves]
        sizes[-1] += budget % 2
        items = [self._frame(2, t // 2) if t % 2 == 0 else self._frame(1, t) for t in sizes]
        batches = self.pack_items(items)
        key = batches[0].key
        if len(batches) != 1 or not batches[0].replays or key not in self.pool.graphs or key.budget != budget:
            return None
        replayed = self.stats.graph_items
        seconds = self._timed(items, False, reps=3)
        # every run a replay, or the figure is an eager forward's (a batch the graph cannot hold falls back)
        return seconds if self.stats.graph_items - replayed == 4 * len(items) else None

    def _timed(self, items: list[VisualInput], force_eager: bool, reps: int) -> float:
        """Seconds of running `items` as packed: a replay's fastest run, eager's median (it is bound by the
        host, whose noise is part of its price)."""
        self._run_all(items, force_eager)  # warm: plans, autotuning, allocator
        runs = []
        for _ in range(reps):
            self._sync()
            start = time.perf_counter()
            self._run_all(items, force_eager)
            self._sync()
            runs.append(time.perf_counter() - start)
        return min(runs) if not force_eager else float(np.median(runs))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run_all(self, items: Sequence[VisualInput], force_eager: bool) -> None:
        for batch in self.pack_items(items):
            if force_eager:
                batch.reason = "calibration"
            self.run(batch, [items[i] for i in batch.items])

    def pack_items(self, items: Sequence[VisualInput]) -> list[Batch]:
        return pack([to_pack_item(it, self.tower.geometry) for it in items], self.plan, self.cost,
                    set(self.pool.failed))

    def run(self, batch: Batch, items: Sequence[VisualInput], staged: np.ndarray | torch.Tensor | None = None
            ) -> torch.Tensor:
        """Run one packed batch (`items`: its own items, in `batch.items` order). Returns the joined output
        rows [tokens, width] of all its items, on the device; a replay's rows are a view of the graph's
        static output, valid until the next replay: copy them out (on this stream) before running again.
        `staged`: the items' pixel rows already back to back (page-locked on CUDA), so not copied again."""
        if batch.reason in ("t_capture", "over_budget") and self.chunkable(items[0]):
            return self.encode_chunked(items[0])
        grids = [it.grid_thw for it in items]
        pixels = staged if staged is not None else concat_pixels([it.pixels for it in items],
                                                                 pin=self.device.type == "cuda")
        reason = batch.reason
        if reason is None and not self.use_graphs:
            reason = "graphs_disabled"
        if reason is None and batch.key not in self.pool.graphs:
            reason = "capture_failed" if batch.key in self.pool.failed else "no_graph"
        if reason is None:
            try:
                return self.pool.replay(batch.key, pixels, grids)  # type: ignore[arg-type]
            except CapacityError:  # e.g. more attention windows than the class holds; nothing ran yet
                reason = "layout_capacity"
        self.stats.record_eager(reason, len(items))
        error = self.eager_errors.get(items[0].modality)
        if error is not None:
            raise EagerUnavailable(f"this batch needs the eager path ({reason}), which failed its self-check: {error}")
        return self.eager(pixels, grids, items[0].modality).joined()

    def run_batch(self, batch: Batch, items: Sequence[VisualInput]) -> list[ItemOutput]:
        """`run`, split into each item's own output tensors (copies: they outlive the next replay)."""
        rows = self.run(batch, items)
        tokens = [self.tower.geometry.tokens(it.grid_thw, it.modality) for it in items]
        return split(rows, tokens, self.tower.out_hidden_size)

    def eager(self, pixels: np.ndarray | torch.Tensor, grids: list, modality: str = "image") -> TowerOutput:
        """One forward at the batch's own capacity, its patches padded to `EAGER_ROW_QUANTUM` budget units
        (so its matrix products take the kernels a graph's do); the output rows of the batch's items."""
        need = self.tower.required_capacity(grids, modality)
        quantum = EAGER_ROW_QUANTUM * self.tower.merge_unit
        cap = replace(need, patches=-(-need.patches // quantum) * quantum)
        meta = {k: torch.from_numpy(v).to(self.device, non_blocking=True)
                for k, v in self.tower.build_metadata(grids, cap).items()}
        px = torch.as_tensor(pixels).to(self.device, non_blocking=True)
        if px.shape[0] < cap.patches:
            px = torch.cat([px, px.new_zeros(cap.patches - px.shape[0], *px.shape[1:])])
        rows = sum(self.tower.geometry.tokens(g, modality) for g in grids)
        with torch.inference_mode():
            out = self.tower(px, meta, cap)
        return TowerOutput(out.embeds[:rows], [d[:rows] for d in out.deepstack])

    def chunkable(self, item: VisualInput) -> bool:
        t, h, w = item.grid_thw
        chunk_tokens = self.tower.geometry.units((min(t, self.plan.t_capture), h, w))
        return (self.video_chunking and self.use_graphs and item.modality == "video" and t > 1
                and self.tower.geometry.splits_over_time and chunk_tokens <= self.plan.max_budget)

    def encode_chunked(self, video: VisualInput) -> torch.Tensor:
        """One long video as chunks of t_capture temporal patches (rows are t-major), re-joined."""
        t, h, w = video.grid_thw
        rows, step = h * w, self.plan.t_capture
        chunks = [VisualInput("video", video.pixels[s * rows:(s + min(step, t - s)) * rows], (min(step, t - s), h, w))
                  for s in range(0, t, step)]
        parts: list[torch.Tensor] = [torch.empty(0)] * len(chunks)
        for batch in self.pack_items(chunks):
            own = [chunks[i] for i in batch.items]
            rows = self.run(batch, own).clone()  # out of the static output before the next replay
            tokens = [self.tower.geometry.tokens(c.grid_thw, c.modality) for c in own]
            for i, part in zip(batch.items, rows.split(tokens)):
                parts[i] = part
        self.stats.record_chunked(len(chunks))
        return torch.cat(parts)

    def encode(self, items: Sequence[VisualInput]) -> list[ItemOutput]:
        """All items, packed and run; results in the caller's order."""
        results: list[ItemOutput | None] = [None] * len(items)
        for batch in self.pack_items(items):
            outs = self.run_batch(batch, [items[i] for i in batch.items])
            for i, out in zip(batch.items, outs):
                results[i] = out
        return results  # type: ignore[return-value]


def to_pack_item(item: VisualInput, geometry: Geometry) -> PackItem:
    return PackItem.of(item.grid_thw, item.modality, geometry)


def concat_pixels(parts: list, pin: bool = False) -> np.ndarray | torch.Tensor:
    """Items' pixel rows back to back; device tensors stay on the device. Host arrays stay on the
    host, written straight into page-locked memory with `pin` (one copy, and the upload that follows
    is asynchronous; torch's host allocator keeps the block until that copy has run)."""
    if isinstance(parts[0], torch.Tensor):
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    if not pin:
        if len(parts) > 1:
            return np.concatenate(parts)
        return parts[0] if parts[0].flags.writeable else parts[0].copy()  # torch wants writable arrays
    rows = sum(len(p) for p in parts)
    staged = torch.empty((rows, *parts[0].shape[1:]), dtype=torch.from_numpy(parts[0][:0]).dtype, pin_memory=True)
    np.concatenate(parts, out=staged.numpy())
    return staged


def split(rows: torch.Tensor, tokens: list[int], hidden: int) -> list[ItemOutput]:
    """Each item's main embedding and DeepStack levels out of joined rows: one copy of the whole batch,
    level-major ([levels, tokens, hidden], so every item's level is a contiguous row range of it), and
    views into it. One kernel, not one per item and level (128 for 32 Qwen3-VL images)."""
    levels = rows.shape[1] // hidden
    own = rows.view(rows.shape[0], levels, hidden).transpose(0, 1).clone(memory_format=torch.contiguous_format)
    # Every item's view of a level in one call per level: per-item slicing cost 14 us an item on the host
    # (32 images: 0.46 ms, H200 machine), longer than the copy itself.
    embeds, *deepstack = (level.split(tokens) for level in own.unbind(0))
    return [ItemOutput(e, list(d)) for e, *d in zip(embeds, *deepstack)]
