"""Item geometries beyond the Qwen-VL rule (models.protocol.Geometry), for towers whose attention or output
rows span more than one temporal patch.

* `ClipSegmentsGeometry`: attention spans clips of up to `segment_frames` temporal patches of an item (a
  video is cut into such segments, an image is one); one output row per merge block (MiniMax-M3).
* `TemporalPairGeometry`: attention within each temporal patch, but output rows merge each pair of temporal
  patches (an image pairs its one frame with itself): a video of t frames gives t/2 * h*w/merge**2 rows
  (ERNIE-4.5-VL).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.protocol import Capacity, Geometry, Grid


@dataclass(frozen=True)
class ClipSegmentsGeometry(Geometry):
    """Segments of `segment_frames` temporal patches (the last one shorter); 0: the whole clip, however long.
    Time positions restart in each segment (models.rotary.clip_positions), so nothing crosses a segment but
    the output is not split over time here (a split must fall on segment boundaries)."""

    whole_clip: bool = True
    segment_frames: int = 0

    def frames(self, grid: Grid) -> list[int]:
        """Temporal patches of each attention segment of one item."""
        t = grid[0]
        step = self.segment_frames or t
        return [min(step, t - start) for start in range(0, t, step)]

    def segment_lengths(self, grid: Grid) -> list[int]:
        _, h, w = grid
        return [n * h * w for n in self.frames(grid)]


@dataclass(frozen=True)
class TemporalPairGeometry(Geometry):
    """Output rows from pairs of temporal patches: frames 2k and 2k+1 of a video give one row per merge
    block (the last frame of an odd count pairs with none and gives none); an image (one frame) is paired
    with itself. Videos have at least two frames, so a video batch has at most half its blocks' rows."""

    def tokens(self, grid: Grid, modality: str = "image") -> int:
        t, h, w = grid
        return max(t // 2, 1) * h * w // self.merge_unit

    def output_rows(self, cap: Capacity) -> int:
        units = cap.patches // self.merge_unit
        return units if cap.modality == "image" else units // 2

    def describe(self) -> str:
        return f"max(floor(t/2),1)*h*w/{self.merge_unit}"

    @property
    def splits_over_time(self) -> bool:
        # a chunk boundary could fall inside a pair of frames
        return False
