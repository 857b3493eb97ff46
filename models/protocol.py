"""The contract between a vision tower and the graph pool.

A tower is two halves. `build_metadata` runs on the CPU from `grid_thw` alone (numpy, no torch
device work) and lays every per-batch quantity out at a fixed `Capacity`. `forward` runs on the
device over tensors of exactly those shapes and never reads a value back to the host, so the same
call can be captured once into a CUDA graph and replayed for any batch that fits the capacity.
Eager execution is the same forward at a capacity that fits the batch exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from models.config import ProcessorConfig

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class Capacity:
    """Static shapes of one forward: what a captured graph is specialised on.

    patches: rows of pixel input (a multiple of merge_size**2); segments: attention sequences
    (one per temporal patch of each item); windows: window-attention sequences (0 for families without).
    max_seqlen / max_window_seqlen: bounds handed to the attention kernel at capture time.
    """

    patches: int
    segments: int
    windows: int = 0
    max_seqlen: int = 0
    max_window_seqlen: int = 0
    # The items' modality: a batch holds one, and a family may treat images and videos differently
    # (a merge size per modality, frames pooled over time).
    modality: str = "image"

    def fits(self, need: Capacity) -> bool:
        return (
            need.modality == self.modality
            and need.patches <= self.patches
            and need.segments <= self.segments
            and need.windows <= self.windows
            and need.max_seqlen <= self.max_seqlen
            and need.max_window_seqlen <= self.max_window_seqlen
        )


@dataclass(frozen=True)
class Geometry:
    """How an item's grid (t, h, w) maps onto a tower's work and output, as a small picklable value: the
    packing, the graph pool, the engine and the front processes all read it. This default is the Qwen-VL
    rule (attention within each temporal patch, one output row per merge block of patches); a family whose
    rule differs gives a subclass in its own module.

    merge: patches per merged-token side; `merge_unit` = merge**2 patches are one unit of a token budget.
    whole_clip: attention spans all temporal patches of an item (one segment) instead of one per temporal
    patch.
    """

    merge: int = 2
    whole_clip: bool = False

    @property
    def merge_unit(self) -> int:
        return self.merge * self.merge

    def units(self, grid: Grid) -> int:
        """Budget units of one item: its patches over `merge_unit`, rounded up (an image a family does not merge,
        VideoLLaMA3's, may have any patch count), so that a batch within a budget fits its capacity's patches."""
        t, h, w = grid
        return -(-t * h * w // self.merge_unit)

    def segment_lengths(self, grid: Grid) -> list[int]:
        """Patches of each attention segment of one item."""
        t, h, w = grid
        return [t * h * w] if self.whole_clip else [h * w] * t

    def tokens(self, grid: Grid, modality: str = "image") -> int:
        """Output rows of one item: what the language model sees."""
        t, h, w = grid
        return t * h * w // self.merge_unit

    def output_rows(self, cap: Capacity) -> int:
        """Output rows a forward at `cap` writes (the items' rows first, in order, then padding)."""
        return cap.patches // self.merge_unit

    def describe(self) -> str:
        """The output-row rule of an item of grid (t, h, w), in words for `/info`."""
        return f"t*h*w/{self.merge_unit}"

    @property
    def splits_over_time(self) -> bool:
        """An item's output is its temporal chunks' outputs back to back (nothing crosses a temporal patch),
        so a long video may run as chunks."""
        return not self.whole_clip


class CapacityError(ValueError):
    """A batch needs more of some capacity (segments, windows, patches) than a graph was captured with."""


@dataclass
class TowerOutput:
    """Merged tokens [tokens, out_hidden] in item order, and DeepStack features (one per level, as wide)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]

    def joined(self) -> torch.Tensor:
        """The main embedding and each DeepStack level side by side: [tokens, out_hidden * (1 + levels)]."""
        return torch.cat([self.embeds, *self.deepstack], dim=-1) if self.deepstack else self.embeds


class Layout(Protocol):
    """A family's attention layout beyond whole frames (window attention), as a small picklable value:
    graph plans hold it and travel between processes."""

    def class_capacity(self, base: Capacity) -> Capacity:
        """A graph class's full capacity from its patches, segments and longest segment: the bounds of
        this layout added (how many windows, and the longest)."""
        ...


class VisionTower(Protocol):
    """Everything `graphs/` and the engine read from a model family; nothing else is assumed.

    name: the preset or checkpoint folder it was loaded from; family: the checkpoint's `model_type`.
    merge: patches per merged-token side (`merge_unit` = merge**2 patches are one unit of a token budget).
    geometry: the item rules (segments, output rows) graphs/ and the service read.
    out_hidden_size: width of a merged token; num_deepstack: DeepStack levels, each as wide.
    layout: what graph classes must hold beyond whole frames; None for families without windows.
    """

    name: str
    family: str
    processor: ProcessorConfig
    out_hidden_size: int
    num_deepstack: int
    merge: int
    layout: Layout | None
    geometry: Geometry

    @property
    def merge_unit(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype: parameters and outputs."""
        ...

    def __call__(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        """`forward` (an nn.Module's call)."""
        ...

    def required_capacity(self, grids: Sequence[Grid], modality: str = "image") -> Capacity: ...

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]: ...

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput: ...
