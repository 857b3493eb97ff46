"""Pixel rows in any family's layout: uint8 frames -> [rows, C*T*P*P] as the family's processor orders them.

`ProcessorConfig.patch_order` orders an item's rows ("block": merge blocks contiguous, blocks row-major;
"raster": patches row-major), `patch_layout` the values within a row ("chw": channel, temporal, patch row,
patch column; "hwc": patch row, patch column, channel, temporal); frames of a video follow each other.
The Qwen-VL layout ("chw" in "block" order) keeps its faster writers (image_preprocess.patchify and the
video patch writer); every other layout goes through here.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from models.config import ProcessorConfig

# Axes of frames.reshape(T', tps, bh, m, p, bw, m, p, C): 0 temporal patch, 1 frame within it, 2 block row,
# 3 merge row, 4 patch row, 5 block column, 6 merge column, 7 patch column, 8 channel.
ROW_AXES = {"block": (0, 2, 5, 3, 6), "raster": (0, 2, 3, 5, 6)}
VALUE_AXES = {"chw": (8, 1, 4, 7), "hwc": (4, 7, 8, 1)}


def is_qwen_layout(cfg: ProcessorConfig) -> bool:
    return cfg.patch_layout == "chw" and cfg.patch_order == "block"


def patch_rows(frames: np.ndarray, cfg: ProcessorConfig) -> np.ndarray:
    """uint8 [F, H, W, C] frames (F a multiple of temporal_patch_size, sides multiples of patch * merge) ->
    [F / T * (H / P) * (W / P), C * T * P * P] rows in the config's layout."""
    f, height, width, c = frames.shape
    p, m, tps = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if f % tps or height % (p * m) or width % (p * m):
        raise ValueError(f"{f}x{height}x{width} is not a multiple of ({tps}, {p * m}, {p * m})")
    x = frames.reshape(f // tps, tps, height // (p * m), m, p, width // (p * m), m, p, c)
    x = x.transpose(ROW_AXES[cfg.patch_order] + VALUE_AXES[cfg.patch_layout])
    return np.ascontiguousarray(x).reshape(-1, c * tps * p * p)


def image_rows(rgb: np.ndarray, cfg: ProcessorConfig) -> np.ndarray:
    """One uint8 [H, W, 3] image as a clip of temporal_patch_size identical frames."""
    return patch_rows(np.broadcast_to(rgb[None], (cfg.temporal_patch_size, *rgb.shape)), cfg)


def value_shape(cfg: ProcessorConfig) -> tuple[int, ...]:
    """The sizes of a row's value axes in the config's layout (temporal axis included)."""
    sizes = {8: cfg.in_channels, 1: cfg.temporal_patch_size, 4: cfg.patch_size, 7: cfg.patch_size}
    return tuple(sizes[a] for a in VALUE_AXES[cfg.patch_layout])


def temporal_axis(cfg: ProcessorConfig) -> int:
    """Where the temporal axis sits among a row's value axes."""
    return VALUE_AXES[cfg.patch_layout].index(1)


def frame_values(rgb: np.ndarray, cfg: ProcessorConfig) -> np.ndarray:
    """One uint8 [H, W, 3] frame's share of its rows: [rows of a frame, *value axes] with a temporal axis of
    one, to be written at the frame's slot of that axis."""
    rows = patch_rows(rgb[None], replace(cfg, temporal_patch_size=1, merge_size=cfg.video_merge_size))
    shape = list(value_shape(cfg))
    shape[temporal_axis(cfg)] = 1
    return rows.reshape(rows.shape[0], *shape)
