"""Greedy token-budget packing of pending items into batches, each bound for one graph or eager.

Items are grouped by (modality, length class), taken smallest first, and added to the open batch
while its tokens stay within the largest budget and its item count within the limit. Each batch
then replays in the smallest budget that holds it. Items no graph can hold run eagerly, alone.
Pure and deterministic: the same items always give the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from graphs.budgets import BudgetPlan, GraphKey


@dataclass(frozen=True)
class PackItem:
    tokens: int
    modality: str = "image"
    segments: int = 1  # temporal patches
    segment_patches: int = 0  # patches of one frame (h * w)


@dataclass
class Batch:
    """`key` None: eager, with `reason`. `items`: indices into the packed sequence."""

    key: GraphKey | None
    items: list[int] = field(default_factory=list)
    tokens: int = 0
    segments: int = 0
    reason: str | None = None


def eager_reason(item: PackItem, plan: BudgetPlan) -> str | None:
    """Why an item cannot go through any graph (so runs eagerly on its own), or None."""
    if item.tokens > plan.max_budget:
        return "over_budget"
    if item.modality == "video" and item.segments > plan.t_capture:
        return "t_capture"
    if plan.length_class(item.segment_patches) not in plan.length_classes(plan.max_budget):
        return "segment_too_long"
    return None


def smallest_budget(plan: BudgetPlan, tokens: int) -> int:
    return next(b for b in plan.budgets if b >= tokens)


def pack(items: Sequence[PackItem], plan: BudgetPlan) -> list[Batch]:
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
        open_batch = Batch(None)
        for i in members:
            item = items[i]
            if open_batch.items and (
                open_batch.tokens + item.tokens > plan.max_budget
                or len(open_batch.items) >= plan.max_items
                or open_batch.segments + item.segments > top.segments
            ):
                batches.append(_close(open_batch, plan, modality, length_class))
                open_batch = Batch(None)
            open_batch.items.append(i)
            open_batch.tokens += item.tokens
            open_batch.segments += item.segments
        if open_batch.items:
            batches.append(_close(open_batch, plan, modality, length_class))
    return batches


def _close(batch: Batch, plan: BudgetPlan, modality: str, length_class: int) -> Batch:
    """Smallest budget that holds the batch's tokens and segments for this length class."""
    for budget in plan.budgets:
        if budget < batch.tokens or length_class not in plan.length_classes(budget):
            continue
        key = GraphKey(modality, budget, length_class)
        if plan.capacity(key).segments >= batch.segments:
            batch.key = key
            return batch
    raise AssertionError(f"no budget holds {batch}; the plan's capacities are inconsistent")
