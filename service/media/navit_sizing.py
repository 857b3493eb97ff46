"""Sizing, resizing and frame sampling of the Kimi-K2.x and Muse processors (torchvision-backed only in
transformers 5.24; reproduced here without torchvision, tests/test_family_kimi_preprocess.py).

* Kimi (`Kimi_K25ImageProcessor`, `Kimi_K25VideoProcessor`): a frame is scaled down (never up) so that its
  patches (floor(H / 14) * floor(W / 14)) stay within `max_patches` and each side within `max_side`
  patches, truncating; then resized with torchvision's tensor path (bicubic with antialiasing on uint8,
  which on the CPU is torch's own uint8 kernel: `F.interpolate` on the uint8 image) and zero-padded on the
  right and bottom to a multiple of 28. Videos take `fps` frames a second of the clip, spread as
  `BaseVideoProcessor` spreads them, and no frame is repeated: chunks of 4 frames (the last shorter) are
  the model's business (models/families/kimi_k25.py).
* Muse (`MuseGlimmerImageProcessor`, `MuseGlimmerVideoProcessor`): the merged-token grid closest to the
  image's aspect ratio among the floor/ceil candidates under a token cap, resized with Lanczos (PIL's, as
  Muse's reference preprocessing and vLLM's do; transformers resizes with torchvision >= 0.27's CPU Lanczos
  and falls back to bicubic below it). Videos: `fps` frames a second up to `num_frames`, a multiple of 2,
  spread by `linspace` and truncated.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


def kimi_size(height: int, width: int, patch: int, merge: int, max_patches: int, max_side: int
              ) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) of a height x width frame."""
    patches = max(1.0, height // patch) * max(1.0, width // patch)
    side_px = max_side * patch
    scale = min(1.0, math.sqrt(max_patches / patches), side_px / height, side_px / width)
    new_h = min(max(1, int(height * scale)), side_px)
    new_w = min(max(1, int(width * scale)), side_px)
    factor = merge * patch
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def muse_size(height: int, width: int, factor: int, max_tokens: int) -> tuple[int, int]:
    """(h, w), multiples of `factor` (one merged token's side): the candidate grid whose aspect ratio is
    closest to the image's, the image scaled to `max_tokens` tokens first when above it."""
    rows, cols = height / factor, width / factor
    ratio = cols / rows if rows > 0 else 1.0
    if rows * cols > max_tokens:
        rows = (max_tokens / ratio) ** 0.5
        cols = rows * ratio
    # A set, iterated as the reference iterates it, so that ties between candidates resolve the same way.
    candidates = [c for c in set(itertools.product([math.floor(rows), math.ceil(rows)],
                                                   [math.floor(cols), math.ceil(cols)]))
                  if c[0] >= 1 and c[1] >= 1 and c[0] * c[1] <= max_tokens]
    if not candidates:
        candidates = [(max(1, round(rows)), max(1, round(cols)))]
    best = min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))
    return best[0] * factor, best[1] * factor


def resize_bicubic_antialias(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] -> [height, width, 3]: torch's antialiased bicubic on uint8 (what torchvision's
    tensor resize runs on the CPU); the same size is returned as is. Every family that resizes as a
    torchvision-only processor does uses it (Kimi, MiniMax-M3 and ERNIE-4.5-VL's frames: `Family.image_resize`,
    `video_resize`)."""
    if rgb.shape[:2] == (height, width):
        return rgb
    x = torch.from_numpy(np.array(rgb)).permute(2, 0, 1)[None].contiguous()
    y = F.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return y[0].permute(1, 2, 0).numpy()


def pad_bottom_right(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] zero-padded to [height, width, 3]."""
    if rgb.shape[:2] == (height, width):
        return rgb
    out = np.zeros((height, width, rgb.shape[2]), np.uint8)
    out[: rgb.shape[0], : rgb.shape[1]] = rgb
    return out


def resize_image(image: Image.Image, rule: str, resized: tuple[int, int], padded: tuple[int, int]) -> Image.Image:
    """An RGB image resized to `resized` (h, w) and zero-padded on the bottom and right to `padded` as the
    family's processor does: Kimi's torch kernel, Muse's Lanczos, PIL bicubic otherwise (GLM-5's)."""
    if rule == "kimi":
        rgb = resize_bicubic_antialias(np.asarray(image), *resized)
        return Image.fromarray(pad_bottom_right(rgb, *padded))
    if (image.height, image.width) != resized:
        method = Image.Resampling.LANCZOS if rule == "muse" else Image.Resampling.BICUBIC
        image = image.resize((resized[1], resized[0]), method)
    if resized == padded:
        return image
    return Image.fromarray(pad_bottom_right(np.asarray(image), *padded))


def kimi_frame_indices(count: int, video_fps: float, fps: float | None, nframes: int | None) -> np.ndarray:
    """`BaseVideoProcessor`'s spread: n = floor(count / video_fps * fps) (at least 1) frames, or `nframes`,
    at index i * count // n."""
    n = nframes if nframes is not None else max(1, int(count / video_fps * fps))  # type: ignore[operator]
    n = min(n, count)
    return np.arange(n, dtype=np.int64) * count // n


def muse_frame_indices(count: int, video_fps: float, fps: float, max_frames: int, temporal: int) -> np.ndarray:
    """`MuseGlimmerVideoProcessor.sample_frames`: min(count * fps / video_fps, max_frames, count) frames
    rounded down to a multiple of `temporal` (at least `temporal`, at most count), spread by linspace."""
    n = min(int(count * fps / video_fps), max_frames, count)
    n = min(max(temporal, n // temporal * temporal), count)
    return torch.linspace(0, count - 1, n).long().numpy()
