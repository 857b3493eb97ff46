"""Preprocessing configuration and the unit of work every layer passes around.

`ProcessorConfig` holds what a checkpoint's `preprocessor_config.json` (and
`video_preprocessor_config.json`) say about turning media into patches. `VisualInput` is one
preprocessed image or video: raw uint8 patches in the reference row order plus its grid. The
tower normalises on the device (rescale, then mean/std), so the host ships a quarter of the bytes
and the graph path normalises exactly like the eager one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

Modality = Literal["image", "video"]


@dataclass(frozen=True)
class VideoConfig:
    """Video sampling and per-frame pixel bounds (qwen-vl-utils / transformers video processors)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)  # qwen-vl-utils 0.0.14 default (VIDEO_TOTAL_PIXELS)
    processor_class: str = ""  # the checkpoint's `video_processor_type`, where it names one
    # A font file to draw each frame's time on it before resizing (ERNIE-4.5-VL's `draw_on_frames`); "": none.
    timestamp_font: str = ""
    # Where a family's video processor differs from its image processor (VideoLLaMA3 merges videos 2x2 and images
    # not at all; Hy4's normalises videos with other statistics): 0 / None take the image processor's.
    merge_size: int = 0
    frame_pixels: int = 0  # the video processor's own cap on a frame's pixels (Hy4's max_image_size); 0: none
    image_mean: tuple[float, float, float] | None = None
    image_std: tuple[float, float, float] | None = None


@dataclass(frozen=True)
class ProcessorConfig:
    """Everything preprocessing needs from a checkpoint; defaults are Qwen2-VL's."""

    family: str = "qwen2_vl"
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video: VideoConfig = field(default_factory=VideoConfig)
    # How the family's processor lays out pixel rows (the family's, not the checkpoint's: see `from_dicts`).
    # patch_layout, the values of one row: "chw" = (channel, temporal, patch row, patch col), the Qwen-VL
    # processors' Conv3d order; "hwc" = (patch row, patch col, channel, temporal), SigLIP2-style Linear patches.
    # patch_order, an item's rows: "block" = each merge block's patches contiguous, blocks row-major;
    # "raster" = patches row-major (the tower merges blocks itself).
    patch_layout: str = "chw"
    patch_order: str = "block"

    @property
    def factor(self) -> int:
        """Side lengths are resized to multiples of this (one merged token's edge in pixels)."""
        return self.patch_size * self.merge_size

    @property
    def video_merge_size(self) -> int:
        return self.video.merge_size or self.merge_size

    @property
    def video_factor(self) -> int:
        """A video frame's sides are resized to multiples of this."""
        return self.patch_size * self.video_merge_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def normalize(self, patches: np.ndarray) -> np.ndarray:
        """Reference normalisation on the host (the device path does the same in float32)."""
        x = patches.astype(np.float32) * np.float32(self.rescale_factor)
        mean, std = self.channel_vectors()
        return (x - mean) / std

    def channel_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std laid out along one patch row: (C, T, P, P), or (P, P, C, T) for "hwc" rows."""
        mean = np.asarray(self.image_mean, np.float32)
        std = np.asarray(self.image_std, np.float32)
        if self.patch_layout == "hwc":
            spread = lambda v: np.tile(np.repeat(v, self.temporal_patch_size), self.patch_size**2)  # noqa: E731
        else:
            spread = lambda v: np.repeat(v, self.temporal_patch_size * self.patch_size**2)  # noqa: E731
        return spread(mean), spread(std)

    @classmethod
    def from_dicts(
        cls, family: str, image: dict[str, Any], video: dict[str, Any] | None = None
    ) -> ProcessorConfig:
        """From a checkpoint's processor configs. A registered family (models.families) contributes its
        processor class's row layout and the defaults that class holds for keys a config may leave out."""
        from models.family import FAMILIES  # torch-free; filled once models.families is imported

        spec = FAMILIES.get(family)
        rows: dict[str, Any] = {}
        if spec is not None:
            rows = {"patch_layout": spec.patch_layout, "patch_order": spec.patch_order}
            defaults = spec.processor_defaults
            image = {**defaults.get("image", {}), **image}
            if not isinstance(image.get("size") or {}, dict):  # MiniMax-M3's release: [672, 672], which its
                image["size"] = defaults.get("image", {}).get("size", {})  # processor replaces by its default
            video = None if video is None else {**defaults.get("video", {}), **video}
        size = image.get("size") or {}
        min_pixels = image.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
        max_pixels = image.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
        for config in (image, video or {}):
            if int(config.get("patch_expand_factor") or 1) != 1:  # GLM's processors: resize to a coarser grid
                raise ValueError(f"patch_expand_factor {config['patch_expand_factor']} is not supported (only 1)")
        # GLM-5's processors bound an item by merged tokens, each temporal_patch_size frames of (patch * merge)**2
        # pixels: the same T*H*W bounds in other units (Muse's processors count their `max_image_tokens` otherwise:
        # its own reader, models/families/muse_glimmer.py, sets its bounds over these)
        token_pixels = int(image.get("temporal_patch_size", 2)) * (
            int(image.get("patch_size", 14)) * int(image.get("merge_size", 2))) ** 2
        if "min_image_tokens" in image:
            min_pixels = image["min_image_tokens"] * token_pixels
        if "max_image_tokens" in image:
            max_pixels = image["max_image_tokens"] * token_pixels
        video_cfg = VideoConfig()
        if video:
            vsize = video.get("size") or {}
            vmin = video.get("min_pixels") or vsize.get("shortest_edge") or video_cfg.min_pixels
            vmax = video.get("max_pixels") or vsize.get("longest_edge") or video_cfg.max_pixels
            if "min_image_tokens" in video:
                vmin = video["min_image_tokens"] * token_pixels
            if "max_image_tokens" in video:
                vmax = video["max_image_tokens"] * token_pixels
            video_cfg = VideoConfig(
                fps=float(video.get("fps", video_cfg.fps)),
                min_frames=int(video.get("min_frames", video_cfg.min_frames)),
                max_frames=int(video.get("max_frames", video_cfg.max_frames)),
                min_pixels=int(vmin),
                max_pixels=int(vmax),
                total_pixels=int(video.get("total_pixels", video_cfg.total_pixels)),
                processor_class=str(video.get("video_processor_type") or ""),
                timestamp_font=str(video.get("font") or "") if video.get("draw_on_frames") else "",
                merge_size=int(video.get("merge_size") or 0),
                frame_pixels=int((video.get("max_image_size") or {}).get("longest_edge", 0)),
                **_video_statistics(image, video),
            )
        return cls(
            family=family,
            patch_size=int(image.get("patch_size", 14)),
            temporal_patch_size=int(image.get("temporal_patch_size", 2)),
            merge_size=int(image.get("merge_size", 2)),
            image_mean=tuple(image.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(image.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(image.get("rescale_factor", 1 / 255)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            video=video_cfg,
            **rows,
        )


def _video_statistics(image: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """The video processor's mean and std where they differ from the image processor's."""
    out = {}
    for key in ("image_mean", "image_std"):
        default = OPENAI_CLIP_MEAN if key == "image_mean" else OPENAI_CLIP_STD
        if key in video and tuple(video[key]) != tuple(image.get(key, default)):
            out[key] = tuple(video[key])
    return out


@dataclass
class VisualInput:
    """One preprocessed image or video.

    pixels: uint8 [t*h*w, C*T*P*P] in the reference processor's row order (merge blocks
    contiguous unless the family's processor keeps rows row-major: `ProcessorConfig.patch_order`), not yet
    rescaled or normalised. grid_thw: (t, h, w) in patches.
    """

    modality: Modality
    pixels: np.ndarray
    grid_thw: tuple[int, int, int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def num_tokens(self, merge_size: int) -> int:
        return self.num_patches // (merge_size * merge_size)
