"""The batching policy: greedy token-budget packing of pending items into batches, and for each batch
whether it replays a graph or runs eagerly. Pure and deterministic: the same items, plan and costs
always give the same batches. The server's batcher and the offline runner both call `pack`.

Items are grouped by (modality, length class), taken smallest first, and added to the open batch
while its tokens stay within the largest budget and its item count within the limit. Each batch
then replays in the smallest budget that holds it. Items no graph can hold run eagerly, alone.

A replay costs its whole budget, so a batch just over a budget (nine 256-token images in a 4096
budget) wastes nearly half of it. Given the engine's measured costs (`CostModel`, from
`GraphRunner.calibrate`), a batch is split into parts that fill smaller budgets when their replays cost
less than the one padded replay (nine images become a 2048 and a 256 replay), and a batch still mostly
padding runs eagerly when that costs less than its replay (reason "padding"). A batch whose graph failed
to capture runs eagerly too ("capture_failed").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphs.budgets import BudgetPlan, GraphKey
from models.protocol import Geometry, Grid


@dataclass(frozen=True)
class PackItem:
    tokens: int  # budget units: patches / merge_unit, rounded up (Geometry.units)
    modality: str = "image"
    segments: int = 1  # attention segments (one per temporal patch, or one for a whole clip)
    segment_patches: int = 0  # patches of the longest segment
    temporal: int = 1  # temporal patches (t of the grid)

    @classmethod
    def of(cls, grid: Grid, modality: str, geometry: Geometry) -> PackItem:
        return _pack_item(tuple(grid), modality, geometry)


@functools.lru_cache(maxsize=4096)  # a server sees few distinct sizes; packing asks for every item of every batch
def _pack_item(grid: tuple[int, int, int], modality: str, geometry: Geometry) -> PackItem:
    lengths = geometry.segment_lengths(grid)
    return PackItem(geometry.units(grid), modality, len(lengths), max(lengths), grid[0])


@dataclass
class Batch:
    """`reason` set: runs eagerly (`key` is the graph it would have used, if any). `items`: indices
    into the packed sequence."""

    key: GraphKey | None
    items: list[int] = field(default_factory=list)
    tokens: int = 0
    segments: int = 0
    reason: str | None = None

    @property
    def replays(self) -> bool:
        return self.reason is None and self.key is not None


@dataclass(frozen=True)
class CostModel:
    """One engine's costs as measured at start-up (seconds, or any one unit): a replay of each budget, and
    eager forwards at a few token counts. Between measured points a cost is interpolated; below the first,
    it is the first point's (a small eager forward costs its kernel launches, not its arithmetic); above
    the last, it grows by the largest replay's cost per token (the same kernels, bound by the GPU)."""

    replays: tuple[tuple[int, float], ...]  # (budget, cost of one replay), budgets ascending
    eager: tuple[tuple[int, float], ...]  # (tokens, cost of one eager forward), tokens ascending

    def __post_init__(self) -> None:
        if not self.replays or not self.eager:
            raise ValueError("a cost model needs at least one replay and one eager measurement")

    def replay_cost(self, budget: int) -> float:
        return _interpolate(self.replays, budget, self._slope())

    def eager_cost(self, tokens: int) -> float:
        return _interpolate(self.eager, tokens, self._slope())

    def _slope(self) -> float:
        """Cost per token of the largest replay: what more tokens cost once the GPU, not the host, binds (its
        average, not the difference to the next budget down, which two close budgets would make noise)."""
        budget, cost = self.replays[-1]
        return cost / budget


def _interpolate(points: tuple[tuple[int, float], ...], x: int, slope: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    x_last, y_last = points[-1]
    return y_last + slope * (x - x_last)


PADDING_MARGIN = 0.95  # eager must beat the replay by 5%: the graph wins ties


def eager_reason(item: PackItem, plan: BudgetPlan) -> str | None:
    """Why an item cannot go through any graph (so runs eagerly on its own), or None."""
    if item.tokens > plan.max_budget:
        return "over_budget"
    if item.modality == "video" and item.temporal > plan.t_capture:
        return "t_capture"
    if plan.length_class(item.segment_patches) not in plan.length_classes(plan.max_budget):
        return "segment_too_long"
    if item.segments > plan.max_segments(item.modality):  # a clip cut into more attention segments than a slot
        return "too_many_segments"
    return None


def pack(items: Sequence[PackItem], plan: BudgetPlan, cost: CostModel | None = None,
         failed: frozenset[GraphKey] | set[GraphKey] = frozenset()) -> list[Batch]:
    """Batches of `items` (indices into it), each with its graph key or its eager reason. Without a
    `cost` (the CPU, or before calibration) batches are never split nor sent eagerly for padding."""
    batches: list[Batch] = []
    groups: dict[tuple[str, int], list[int]] = {}
    for i, item in enumerate(items):
        reason = eager_reason(item, plan)
        if reason:
            batches.append(Batch(None, [i], item.tokens, item.segments, reason))
            continue
        groups.setdefault((item.modality, plan.length_class(item.segment_patches)), []).append(i)

    for (modality, length_class), members in sorted(groups.items()):
        members.sort(key=lambda i: (items[i].tokens, i))
        top = plan.capacity(GraphKey(modality, plan.max_budget, length_class))
        group = _Group(items, plan, modality, length_class, cost)
        open_batch: list[int] = []
        tokens = segments = 0
        for i in members:
            item = items[i]
            if open_batch and (
                tokens + item.tokens > plan.max_budget
                or len(open_batch) >= plan.max_items
                or segments + item.segments > top.segments
            ):
                batches += group.close(open_batch)
                open_batch, tokens, segments = [], 0, 0
            open_batch.append(i)
            tokens += item.tokens
            segments += item.segments
        if open_batch:
            batches += group.close(open_batch)
    for batch in batches:
        if batch.key in failed and batch.reason is None:
            batch.reason = "capture_failed"
    return batches


@dataclass
class _Group:
    """Closes the batches of one (modality, length class) group."""

    items: Sequence[PackItem]
    plan: BudgetPlan
    modality: str
    length_class: int
    cost: CostModel | None

    def fit(self, members: list[int]) -> Batch:
        batch = Batch(None, sorted(members, key=lambda i: (self.items[i].tokens, i)))
        batch.tokens = sum(self.items[i].tokens for i in members)
        batch.segments = sum(self.items[i].segments for i in members)
        return _fit(batch, self.plan, self.modality, self.length_class)

    def price(self, batch: Batch) -> float:
        """What a batch costs: its budget's replay, or an eager forward of its own tokens."""
        assert self.cost is not None and batch.key is not None
        if batch.reason == "padding":
            return self.cost.eager_cost(batch.tokens)
        return self.cost.replay_cost(batch.key.budget)

    def close(self, members: list[int]) -> list[Batch]:
        """The cheapest way to run these items: one replay in the smallest budget that holds them;
        parts of them replayed in smaller budgets (the largest items first fill the next budget down,
        the rest is closed the same way); or one eager forward at their exact size ("padding"), which
        must beat the best replays by `PADDING_MARGIN`, or a split with an eager part by anything.
        Without measured costs: one replay."""
        whole = self.fit(members)
        assert whole.key is not None
        if self.cost is None:
            return [whole]
        best = [whole]
        smaller = [b for b in self.plan.budgets if b < whole.key.budget]
        if len(members) > 1 and smaller:
            head: list[int] = []
            rest: list[int] = []
            tokens = 0
            for i in sorted(members, key=lambda i: (-self.items[i].tokens, i)):
                if tokens + self.items[i].tokens <= smaller[-1]:
                    head.append(i)
                    tokens += self.items[i].tokens
                else:
                    rest.append(i)
            if head and rest:
                parts = [self.fit(head), *self.close(rest)]
                if sum(map(self.price, parts)) < self.price(whole):
                    best = parts
        # The graph wins ties against an eager pass, not against a split that already runs a part eagerly:
        # that is one forward more than running everything eagerly (8 images 1344x756: a 8192-token replay
        # of six and an eager pass of two cost 2.5-4% more than one eager pass of all, H200, every family).
        eager = Batch(whole.key, whole.items, whole.tokens, whole.segments, "padding")
        split = sum(self.price(b) for b in best)
        margin = 1.0 if any(b.reason is not None for b in best) else PADDING_MARGIN
        return [eager] if self.price(eager) < margin * split else best


def _fit(batch: Batch, plan: BudgetPlan, modality: str, length_class: int) -> Batch:
    """Smallest budget that holds the batch's tokens and segments for this length class."""
    for budget in plan.budgets:
        if budget < batch.tokens or length_class not in plan.length_classes(budget):
            continue
        key = GraphKey(modality, budget, length_class)
        if plan.capacity(key).segments >= batch.segments:
            batch.key = key
            return batch
    raise AssertionError(f"no budget holds {batch}; the plan's capacities are inconsistent")
