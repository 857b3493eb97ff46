"""Token budgets and layout classes: the finite, start-up-known set of graph keys.

A graph is keyed on (modality, budget, length class). The budget bounds the merged tokens of a
batch. The length class L bounds its longest attention segment (a frame, in patches): the
attention kernel's grid is sized by `max_seqlen` at capture, so a graph for L serves batches whose
segments all lie in (L/2, L] and holds at most P / (L/2 + 1) of them, which keeps the kernel's work
proportional to the budget whatever the image sizes. Never the exact boundaries: those are
per-replay data in static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from models.protocol import Capacity, Layout

MIN_LENGTH_CLASS = 64  # patches: segments up to 64 patches (an 8x8-patch frame) share the lowest class
# Items per batch unless set: enough that a full budget of small images is one batch (the limit was the
# smallest budget, 64: 128 images of 224x224 then made two batches and twice the padding).
DEFAULT_MAX_ITEMS = 256
MODALITIES = ("image", "video")


class BudgetError(ValueError):
    """Settings that cannot make a valid graph plan; the message says what to change."""


def auto_budgets(max_batch_tokens: int, smallest: int = 64, steps_per_octave: int = 1) -> list[int]:
    """From `smallest` up to the maximum, `steps_per_octave` evenly spaced budgets per doubling (powers of two
    by default; with 4, 1, 1.25, 1.5 and 1.75 times each), plus the maximum itself.

    A replay costs its whole budget: between powers of two a batch pays up to twice its tokens, and common
    image sizes of 32-pixel tokens fall just past one (a 448x448 image is 196 tokens: its replay in 256 took
    3.39 ms, in 224 3.27, in 196 3.12; 32 of 224x224, 1568 tokens: 16.2 ms split over 1024, 512 and 128,
    15.4 in 1792, 14.0 in 1568; H200, Qwen3-VL-8B). Four steps bound the padding to 25%, for about four times
    the graphs to capture (243 image graphs in 18-26 s against 63 in 6-13 s, in the same pool memory)."""
    budgets = []
    b = smallest
    while b < max_batch_tokens:
        for step in range(steps_per_octave):
            budget = b + b * step // steps_per_octave
            if budget < max_batch_tokens and (not budgets or budget > budgets[-1]):
                budgets.append(budget)
        b *= 2
    budgets.append(max_batch_tokens)
    return budgets


@dataclass(frozen=True)
class GraphKey:
    modality: str
    budget: int  # merged tokens
    length_class: int  # longest segment, patches

    def __str__(self) -> str:
        return f"{self.modality}/b{self.budget}/L{self.length_class}"


@dataclass(frozen=True)
class BudgetPlan:
    budgets: tuple[int, ...]
    max_items: int
    merge_unit: int  # patches per merged token
    t_capture: int  # temporal patches per video slot
    max_segment_patches: int  # the largest frame the preprocessing can produce
    # The tower's layout beyond whole frames (e.g. windows): it adds its own bounds to a class's
    # patches, segments and longest segment. None: nothing beyond those.
    layout: Layout | None = None
    # Attention spans a whole clip (models.protocol.Geometry.whole_clip): a video slot is one segment of up
    # to t_capture frames, not t_capture segments of one frame.
    whole_clip: bool = False
    # length_classes and capacity by argument: the packing asks them for every item and budget of every batch
    # (32 images packed in 185 us, 128 in 547, on the development machine, before they were kept).
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @classmethod
    def create(
        cls,
        *,
        max_batch_tokens: int = 16384,
        budgets: list[int] | None = None,
        max_items: int | None = None,
        merge_unit: int = 4,
        t_capture: int = 8,
        max_segment_patches: int = 65536,
        layout: Layout | None = None,
        whole_clip: bool = False,
        steps_per_octave: int = 1,
    ) -> BudgetPlan:
        if max_batch_tokens < 1:
            raise BudgetError(f"--max-batch-tokens must be positive, got {max_batch_tokens}")
        if steps_per_octave < 1:
            raise BudgetError(f"--budget-steps must be at least 1, got {steps_per_octave}")
        chosen = sorted(set(budgets)) if budgets else auto_budgets(max_batch_tokens, steps_per_octave=steps_per_octave)
        if chosen[0] < 1:
            raise BudgetError(f"--budgets must be positive token counts, got {chosen}")
        items = min(DEFAULT_MAX_ITEMS, chosen[-1]) if max_items is None else max_items
        if not 1 <= items <= chosen[-1]:
            raise BudgetError(f"--max-batch-items must be between 1 and the largest budget ({chosen[-1]}), got {items}")
        if t_capture < 1:
            raise BudgetError(f"--t-capture must be at least 1, got {t_capture}")
        return cls(tuple(chosen), items, merge_unit, t_capture, max_segment_patches, layout, whole_clip)

    @property
    def max_budget(self) -> int:
        return self.budgets[-1]

    def with_budget(self, budget: int) -> BudgetPlan:
        """The same plan with one more budget (learned from traffic: `graphs.learning.learn_budget`). Not above the
        largest: that one sizes the shared input buffers and the item limit."""
        if not 1 <= budget < self.max_budget:
            raise BudgetError(f"a budget added to the plan must lie between 1 and {self.max_budget - 1}, got {budget}")
        if budget in self.budgets:
            return self
        return replace(self, budgets=tuple(sorted((*self.budgets, budget))))

    def budget_keys(self, budget: int, modalities: tuple[str, ...] = MODALITIES) -> list[GraphKey]:
        """The graphs of one budget: every length class it can hold, for each modality."""
        return [GraphKey(m, budget, L) for m in modalities for L in self.length_classes(budget)]

    def length_class(self, segment_patches: int) -> int:
        L = MIN_LENGTH_CLASS
        while L < segment_patches:
            L *= 2
        return L

    def length_classes(self, budget: int) -> tuple[int, ...]:
        """Classes a budget can hold: up to its patches and the largest frame preprocessing makes."""
        classes = self._memo.get(("classes", budget))
        if classes is None:
            top = min(budget * self.merge_unit, self.max_segment_patches)
            found, L = [MIN_LENGTH_CLASS], MIN_LENGTH_CLASS
            while L < top:
                L *= 2
                found.append(L)
            classes = self._memo[("classes", budget)] = tuple(found)
        return classes

    def max_segments(self, modality: str) -> int:
        per_item = self.t_capture if modality == "video" and not self.whole_clip else 1
        return self.max_items * per_item

    def capacity(self, key: GraphKey) -> Capacity:
        cap = self._memo.get(key)
        if cap is None:
            cap = self._memo[key] = self._capacity(key)
        return cap

    def _capacity(self, key: GraphKey) -> Capacity:
        patches = key.budget * self.merge_unit
        lower = 0 if key.length_class == MIN_LENGTH_CLASS else key.length_class // 2
        min_segment = max(lower + 1, self.merge_unit)  # a frame is at least one merge block
        segments = min(self.max_segments(key.modality), patches // min_segment)
        base = Capacity(patches=patches, segments=segments, max_seqlen=min(key.length_class, patches),
                        modality=key.modality)
        return self.layout.class_capacity(base) if self.layout else base

    def keys(self, modalities: tuple[str, ...] = MODALITIES) -> list[GraphKey]:
        """Every graph to capture, largest capacity first (so smaller ones reuse its memory)."""
        keys = [key for b in self.budgets for key in self.budget_keys(b, modalities)]
        return sorted(keys, key=lambda k: (-k.budget, -k.length_class, k.modality))
