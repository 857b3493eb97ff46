"""Qwen-VL video preprocessing on the host: video bytes -> uint8 patches in the reference row order.

Frame sampling and per-frame sizes follow the reference each model family ships with:

* Qwen2-VL / Qwen2.5-VL: qwen-vl-utils 0.0.14 `fetch_video` with its decord/torchcodec readers
  (`smart_nframes`, `calculate_video_frame_range`, `torch.linspace(...).round()` indices, the
  per-frame pixel budget of `fetch_video`), resize with `smart_resize` (factor patch*merge).
* Qwen3-VL: transformers' `Qwen3VLVideoProcessor` (`sample_frames`, and its own `smart_resize`
  that bounds T*H*W of the whole clip between size.shortest_edge and size.longest_edge).

Frames are resized one by one with PIL bicubic on uint8, like the image path (the references
resize torch tensors with torchvision bicubic+antialias; see docs/video.md), and patchified into
`pixel_values_videos` order: rows (t, h-block, w-block, merge-row, merge-col), columns
(channel, temporal, patch-row, patch-col). An odd frame count is padded with the last frame.

Contract (stable; safe in a worker process, no global state):

* `preprocess_video_bytes(data, cfg, **options, limits=None, threads=1, workers=None) -> VisualInput`:
  every failure is a `MediaError` with a code (`service.media.errors`). `limits` (`MediaLimits`) are
  checked on the plan before any frame is decoded (tokens, decoding work) and by the decoder while it
  decodes (frames sent, pixels decoded, frame size). `threads` bounds FFmpeg's threads for this item.
* `plan_video(reader, cfg, **options, limits=None) -> VideoPlan`: the same plan from a reader's packet
  index, what `service.media.estimate.estimate_video` reports.
* `meta` of the result: `fps` (the sampled rate), `requested_fps` and `fps_adjusted` / `fps_adjusted_by`
  (min_frames raised, or max_frames / the frame count lowered, the requested rate), timestamps, work done.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from models.config import ProcessorConfig, VisualInput
from service.media.errors import (
    ASPECT_RATIO,
    INVALID_OPTION,
    TOO_FEW_FRAMES,
    TOO_MANY_ITEM_TOKENS,
    TOO_MUCH_WORK,
    MediaError,
)
from service.media.image_preprocess import MAX_ASPECT_RATIO, smart_resize
from service.media.limits import DEFAULT_DECODE_THREADS, DEFAULT_LIMITS, MediaLimits
from service.media.video import VideoInfo, VideoReader

QWEN2_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
QWEN3_FAMILIES = ("qwen3_vl",)

# qwen-vl-utils' FRAME_FACTOR; it is the temporal_patch_size of every Qwen-VL checkpoint.
FRAME_FACTOR = 2
# Qwen3VLVideoProcessor.max_video_tokens: per-frame token ceiling when cap_pixels_per_frame is on.
QWEN3_MAX_VIDEO_TOKENS = 768


# -- rounding helpers (qwen-vl-utils) -------------------------------------------------------------


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def torch_linspace_round(start: float, end: float, steps: int) -> np.ndarray:
    """`torch.linspace(start, end, steps).round().long()` (default float32) with numpy.

    numpy's float64 linspace rounds differently on long clips. torch's CPU kernel computes the
    first half as start + step*i and the second half as end - step*(steps-1-i), each as one fused
    multiply-add rounded once to float32, with step = (end - start) / (steps - 1) in float32. The
    float64 product and sum are exact here (24-bit step times an index below 2**29), so one cast to
    float32 is that single rounding. Rounding is half to even in both libraries.
    """
    if steps < 1:
        return np.zeros(0, dtype=np.int64)
    s32, e32 = np.float32(start), np.float32(end)
    if steps == 1:
        return np.round(np.asarray([s32])).astype(np.int64)
    step = np.float64(np.float32(e32 - s32) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    head = (np.float64(s32) + step * i).astype(np.float32)
    tail = (np.float64(e32) - step * (steps - 1 - i)).astype(np.float32)
    values = np.where(np.arange(steps) < steps // 2, head, tail)
    return np.round(values).astype(np.int64)


# -- Qwen2-VL / Qwen2.5-VL: qwen-vl-utils ---------------------------------------------------------


def frame_range(
    total_frames: int, video_fps: float, video_start: float | None = None, video_end: float | None = None
) -> tuple[int, int, int]:
    """(first, last, count) frame indices inside [video_start, video_end] seconds.

    qwen-vl-utils `calculate_video_frame_range`: times are clamped to the clip, the first index is
    ceil(start * fps), the last floor(end * fps) capped at the last frame.
    """
    if video_start is None and video_end is None:
        return 0, total_frames - 1, total_frames
    max_duration = total_frames / video_fps
    first = 0
    if video_start is not None:
        first = math.ceil(max(0.0, min(video_start, max_duration)) * video_fps)
    last = total_frames - 1
    if video_end is not None:
        last = min(math.floor(max(0.0, min(video_end, max_duration)) * video_fps), total_frames - 1)
    if first >= last:
        raise MediaError(
            reason=f"video_start/video_end select no frames: frames {first}..{last} of a "
            f"{max_duration:.2f} s clip ({total_frames} frames at {video_fps:.3f} fps)",
            code=INVALID_OPTION,
        )
    return first, last, last - first + 1


def qwen2_nframes(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    nframes: int | None = None,
    min_frames: int = 4,
    max_frames: int | None = None,
    default_max_frames: int = 768,
) -> int:
    """qwen-vl-utils `smart_nframes`: how many frames to sample.

    nframes given: round it to FRAME_FACTOR. Otherwise total/video_fps*fps, clamped to
    [ceil2(min_frames), floor2(max_frames)] and to total_frames, then floored to FRAME_FACTOR;
    max_frames defaults to min(default_max_frames, total_frames). The result must lie in
    [FRAME_FACTOR, total_frames].
    """
    if nframes is not None:
        n = round_by_factor(nframes, FRAME_FACTOR)
    else:
        lo = ceil_by_factor(min_frames, FRAME_FACTOR)
        hi = floor_by_factor(
            max_frames if max_frames is not None else min(default_max_frames, total_frames), FRAME_FACTOR
        )
        wanted = total_frames / video_fps * fps
        n = floor_by_factor(min(min(max(wanted, lo), hi), total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= total_frames:
        if total_frames < FRAME_FACTOR:
            raise MediaError(
                reason=f"the video has {total_frames} frame(s) in range; at least {FRAME_FACTOR} are needed",
                code=TOO_FEW_FRAMES,
            )
        raise MediaError(
            reason=f"sampling asks for {n} frames; it must lie in [{FRAME_FACTOR}, {total_frames}] "
            f"(frames in range)",
            code=INVALID_OPTION,
        )
    return n


def qwen2_frame_pixel_bounds(
    nframes: int,
    *,
    min_pixels: int,
    frame_max_pixels: int,
    total_pixels: float,
    max_pixels: float | None = None,
) -> tuple[int, float]:
    """qwen-vl-utils `fetch_video` per-frame bounds: the total budget shared by the frames.

    max = max(min(frame_max_pixels, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05)),
    then lowered (never raised) by a requested max_pixels. frame_max_pixels plays
    VIDEO_MAX_TOKEN_NUM * factor**2 (768 tokens), min_pixels VIDEO_MIN_TOKEN_NUM * factor**2.
    """
    budget = max(min(frame_max_pixels, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05))
    if max_pixels is not None:
        budget = min(max_pixels, budget)
    return min_pixels, budget


# -- Qwen3-VL: transformers Qwen3VLVideoProcessor -------------------------------------------------


def qwen3_num_frames(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    num_frames: int | None = None,
    min_frames: int = 4,
    max_frames: int = 768,
) -> int:
    """Qwen3VLVideoProcessor.sample_frames: int(total/video_fps*fps) clamped to [min_frames,
    max_frames] and to total_frames; an explicit num_frames is used as is (no rounding)."""
    if num_frames is not None:
        return int(num_frames)
    n = int(total_frames / video_fps * fps)
    return min(max(n, min_frames), max_frames, total_frames)


def qwen3_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int = 2,
    factor: int = 32,
    min_pixels: float = 128 * 32 * 32,
    max_pixels: float = 32 * 32 * 768,
) -> tuple[int, int]:
    """The Qwen3-VL video `smart_resize`: sides multiples of `factor`, with T*H*W (T rounded to
    temporal_factor) kept within [min_pixels, max_pixels] by a common scale of H and W."""
    if num_frames < temporal_factor:
        raise MediaError(
            reason=f"{num_frames} frame(s) sampled; Qwen3-VL needs at least {temporal_factor}",
            code=TOO_FEW_FRAMES,
        )
    if height < factor or width < factor:
        # Tiny frames are first scaled up so the short side reaches one factor.
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(
            reason=f"aspect ratio {ratio:.1f} of {width}x{height} frames is above {MAX_ASPECT_RATIO}",
            code=ASPECT_RATIO,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen3_max_pixels(
    num_frames: int, *, factor: int, min_pixels: float, max_pixels: float, cap_pixels_per_frame: bool
) -> float:
    """Upper T*H*W bound for `qwen3_smart_resize`; with the optional per-frame cap of
    Qwen3VLVideoProcessor.resize (qwen-vl-utils style), each frame gets at most
    min(768 tokens, max_pixels // T) pixels, floored at int(min_pixels * 1.05)."""
    if not cap_pixels_per_frame:
        return max_pixels
    frame_cap = QWEN3_MAX_VIDEO_TOKENS * factor * factor
    per_frame = max(min(frame_cap, int(max_pixels) // num_frames), int(min_pixels * 1.05))
    return per_frame * num_frames


# -- planning -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingPlan:
    """Which frames to take and how large to make them, before anything is decoded."""

    indices: np.ndarray  # int64 [n] frame indices on the stream's timeline
    sample_fps: float  # frames per second of the sample (qwen-vl-utils' sample_fps)
    size: Callable[[int, int], tuple[int, int]]  # upright (H, W) -> resized (h, w)
    requested_fps: float | None = None  # the fps the count was derived from (None when nframes was given)
    # What moved the count away from duration * requested fps (beyond rounding): "min_frames" raised it,
    # "max_frames" or "frame_count" (fewer frames in range than that fps needs) lowered it; None: nothing.
    fps_adjusted_by: str | None = None


def _fps_adjustment(wanted: float, clamped: float, cap: int, count: int) -> str | None:
    """Which bound the sampling rule clamped `wanted` frames to, if any: min_frames raised it, or the smaller
    of max_frames (`cap`) and the frames in range (`count`) lowered it."""
    if clamped > wanted:
        return "min_frames"
    if clamped < wanted:
        return "max_frames" if cap < count else "frame_count"
    return None


def plan_sampling(
    cfg: ProcessorConfig, total_frames: int, video_fps: float, options: VideoOptions | None = None
) -> SamplingPlan:
    """Frame indices and the resize rule for a video with `total_frames` frames at `video_fps`."""
    o = options or VideoOptions()
    fps, nframes, min_frames, max_frames = o.fps, o.nframes, o.min_frames, o.max_frames
    video_start, video_end = o.video_start, o.video_end
    min_pixels, max_pixels, total_pixels = o.min_pixels, o.max_pixels, o.total_pixels
    if total_frames < 1 or not video_fps > 0:
        raise MediaError(
            reason=f"the video has {total_frames} frames at {video_fps} fps", code=TOO_FEW_FRAMES
        )
    vcfg = cfg.video
    adjusted: str | None = None
    first, last, count = frame_range(total_frames, video_fps, video_start, video_end)
    want_fps = vcfg.fps if fps is None else fps
    lo_px = vcfg.min_pixels if min_pixels is None else min_pixels
    factor = cfg.factor
    if cfg.family in QWEN2_FAMILIES:
        n = qwen2_nframes(
            count,
            video_fps,
            fps=want_fps,
            nframes=nframes,
            min_frames=vcfg.min_frames if min_frames is None else min_frames,
            max_frames=max_frames,
            default_max_frames=vcfg.max_frames,
        )
        indices = torch_linspace_round(first, last, n)
        if nframes is None:
            cap = vcfg.max_frames if max_frames is None else max_frames
            lo_n = ceil_by_factor(vcfg.min_frames if min_frames is None else min_frames, FRAME_FACTOR)
            hi_n = floor_by_factor(min(cap, count) if max_frames is None else cap, FRAME_FACTOR)
            wanted = count / video_fps * want_fps
            adjusted = _fps_adjustment(wanted, min(min(max(wanted, lo_n), hi_n), count), cap, count)
        lo, hi = qwen2_frame_pixel_bounds(
            n,
            min_pixels=lo_px,
            frame_max_pixels=vcfg.max_pixels,
            total_pixels=vcfg.total_pixels if total_pixels is None else total_pixels,
            max_pixels=max_pixels,
        )
        if hi < lo:
            raise MediaError(
                reason=f"max_pixels {hi:g} per frame is below min_pixels {lo}", code=INVALID_OPTION
            )

        def size(height: int, width: int) -> tuple[int, int]:
            return smart_resize(height, width, factor, lo, hi)  # type: ignore[arg-type]

    elif cfg.family in QWEN3_FAMILIES:
        n = qwen3_num_frames(
            count,
            video_fps,
            fps=want_fps,
            num_frames=nframes,
            min_frames=vcfg.min_frames if min_frames is None else min_frames,
            max_frames=vcfg.max_frames if max_frames is None else max_frames,
        )
        if n < cfg.temporal_patch_size:
            raise MediaError(
                reason=f"{n} frame(s) sampled from {count} in range; Qwen3-VL needs at least "
                f"{cfg.temporal_patch_size}",
                code=TOO_FEW_FRAMES,
            )
        indices = np.linspace(first, last, n).round().astype(np.int64)
        if nframes is None:
            cap = vcfg.max_frames if max_frames is None else max_frames
            adjusted = _fps_adjustment(int(count / video_fps * want_fps), n, cap, count)
        hi_budget: float = vcfg.max_pixels if max_pixels is None else max_pixels
        if total_pixels is not None:
            hi_budget = min(hi_budget, total_pixels)
        hi = qwen3_max_pixels(
            n,
            factor=factor,
            min_pixels=lo_px,
            max_pixels=hi_budget,
            cap_pixels_per_frame=o.cap_pixels_per_frame,
        )
        tps = cfg.temporal_patch_size

        def size(height: int, width: int) -> tuple[int, int]:
            return qwen3_smart_resize(
                n, height, width, temporal_factor=tps, factor=factor, min_pixels=lo_px, max_pixels=hi
            )

    else:
        raise ValueError(f"no video sampling rules for model family {cfg.family!r}")
    sample_fps = n / max(count, 1e-6) * video_fps
    return SamplingPlan(
        indices=indices,
        sample_fps=sample_fps,
        size=size,
        requested_fps=None if nframes is not None else float(want_fps),
        fps_adjusted_by=adjusted,
    )


# -- patches --------------------------------------------------------------------------------------


# Decoded RGB frames waiting for a resize thread, at most (besides the one being resized by each thread).
_INFLIGHT_BYTES = 128 * 2**20


class _PatchWriter:
    """Receives decoded frames, resizes each with PIL and writes its patches straight into the
    output, so full-size frames never pile up; resizing runs on a small thread pool (PIL releases
    the GIL) while the decoder continues."""

    def __init__(
        self,
        cfg: ProcessorConfig,
        slots_of: dict[int, list[int]],
        num_slots: int,
        size: Callable[[int, int], tuple[int, int]],
        workers: int,
        max_tokens: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.slots_of = slots_of
        self.num_slots = num_slots
        self.size = size
        self.orig_size: tuple[int, int] | None = None
        self.resized: tuple[int, int] | None = None
        self._out: np.ndarray | None = None
        self._dst: np.ndarray | None = None
        self._pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 else None
        self._inflight: deque[Future[None]] = deque()
        self._max_inflight = 2 * workers

    def __call__(self, position: int, rgb: np.ndarray) -> None:
        if self._out is None:
            self._allocate(rgb.shape[0], rgb.shape[1])
            # Full-size frames wait for a resize thread: bound them by bytes too (a 4096x4096 frame is 50 MB).
            self._max_inflight = max(1, min(self._max_inflight, _INFLIGHT_BYTES // max(1, rgb.nbytes)))
        if self._pool is None:
            self._write(position, rgb)
            return
        self._inflight.append(self._pool.submit(self._write, position, rgb))
        while len(self._inflight) > self._max_inflight:
            self._inflight.popleft().result()

    def _allocate(self, height: int, width: int) -> None:
        p, m, tps = self.cfg.patch_size, self.cfg.merge_size, self.cfg.temporal_patch_size
        h, w = self.size(height, width)
        self.orig_size, self.resized = (height, width), (h, w)
        bh, bw = h // (p * m), w // (p * m)
        if self.max_tokens is not None:
            # The plan checked the header's size; the frames themselves decide (a header may lie).
            _check_tokens((self.num_slots // tps) * bh * bw, self.max_tokens, (self.num_slots // tps, h // p, w // p))
        self._out = np.empty((self.num_slots // tps, bh, bw, m, m, 3, tps, p * p), np.uint8)
        # Patch rows (P contiguous bytes in source and destination) move as single void items.
        self._dst = self._out.view(np.dtype((np.void, p))).reshape(self._out.shape[:-1] + (p,))

    def _write(self, position: int, rgb: np.ndarray) -> None:
        assert self._dst is not None and self.resized is not None
        p, m, tps = self.cfg.patch_size, self.cfg.merge_size, self.cfg.temporal_patch_size
        h, w = self.resized
        image = Image.fromarray(rgb)
        if image.size != (w, h):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        row = np.dtype((np.void, p))
        for channel, band in enumerate("RGB"):
            # Planar bytes from PIL, viewed as (block row, merge row, patch row, block col, merge col).
            plane = np.frombuffer(image.tobytes("raw", band), dtype=row).reshape(
                h // (p * m), m, p, w // (p * m), m
            )
            blocks = plane.transpose(0, 3, 1, 4, 2)
            for slot in self.slots_of[position]:
                self._dst[slot // tps, :, :, :, :, channel, slot % tps] = blocks

    def finish(self) -> np.ndarray:
        try:
            while self._inflight:
                self._inflight.popleft().result()
        finally:
            self.close()
        assert self._out is not None
        p, tps = self.cfg.patch_size, self.cfg.temporal_patch_size
        return self._out.reshape(-1, 3 * tps * p * p)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def patchify_video(
    frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
) -> np.ndarray:
    """uint8 [F, H, W, 3] frames (F a multiple of temporal_patch_size) -> [t*h*w, 3*T*P*P] rows in
    `pixel_values_videos` order. A plain numpy version of what _PatchWriter writes incrementally."""
    f, height, width, c = frames.shape
    p, m, tps = patch_size, merge_size, temporal_patch_size
    if f % tps or height % (p * m) or width % (p * m):
        raise ValueError(f"{f}x{height}x{width} is not a multiple of ({tps}, {p * m}, {p * m})")
    x = frames.reshape(f // tps, tps, height // (p * m), m, p, width // (p * m), m, p, c)
    # -> (t, block row, block col, merge row, merge col, channel, temporal, patch row, patch col)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(x).reshape(-1, c * tps * p * p)


# -- public entry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoOptions:
    """One video item's options; None takes the config's video default (see `preprocess_video_bytes`)."""

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    video_start: float | None = None
    video_end: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    max_frame_pixels: int | None = None
    cap_pixels_per_frame: bool = False

    def check(self) -> None:
        """Per-request options come from clients: refuse nonsense with a MediaError, not a crash."""
        fps, nframes, min_frames, max_frames = self.fps, self.nframes, self.min_frames, self.max_frames
        video_start, video_end = self.video_start, self.video_end
        min_pixels, max_pixels, total_pixels = self.min_pixels, self.max_pixels, self.total_pixels
        max_frame_pixels = self.max_frame_pixels

        def bad(reason: str) -> MediaError:
            return MediaError(reason=reason, code=INVALID_OPTION)

        def is_int(x: object) -> bool:
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return (
                isinstance(x, (int, float, np.integer, np.floating))
                and not isinstance(x, bool)
                and math.isfinite(x)
            )

        if fps is not None and nframes is not None:
            raise bad("give fps or nframes, not both")
        if fps is not None and not (is_num(fps) and fps > 0):
            raise bad(f"fps must be a positive number, got {fps!r}")
        if nframes is not None and not (is_int(nframes) and nframes >= 2):
            raise bad(f"nframes must be an integer >= 2, got {nframes!r}")
        for name, value in (("min_frames", min_frames), ("max_frames", max_frames)):
            if value is not None and not (is_int(value) and value >= 1):
                raise bad(f"{name} must be an integer >= 1, got {value!r}")
        if min_frames is not None and max_frames is not None and min_frames > max_frames:
            raise bad(f"min_frames {min_frames} is above max_frames {max_frames}")
        for name, value in (("video_start", video_start), ("video_end", video_end)):
            if value is not None and not (is_num(value) and value >= 0):
                raise bad(f"{name} must be a number of seconds >= 0, got {value!r}")
        if video_start is not None and video_end is not None and video_start >= video_end:
            raise bad(f"video_start {video_start} must be before video_end {video_end}")
        for name, value in (
            ("min_pixels", min_pixels),
            ("max_pixels", max_pixels),
            ("total_pixels", total_pixels),
            ("max_frame_pixels", max_frame_pixels),
        ):
            if value is not None and not (is_int(value) and value >= 1):
                raise bad(f"{name} must be an integer >= 1, got {value!r}")
        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            raise bad(f"min_pixels {min_pixels} is above max_pixels {max_pixels}")


@dataclass(frozen=True)
class VideoPlan:
    """Everything about one video's preprocessing that is known before any frame is decoded."""

    info: VideoInfo
    sampling: SamplingPlan
    positions: np.ndarray  # int64 [n] presentation positions of the sampled frames
    slots: np.ndarray  # int64 [T] positions padded to a multiple of temporal_patch_size (last one repeated)
    orig_size: tuple[int, int]  # upright (H, W) the header describes
    resized: tuple[int, int]  # (h, w) every frame is resized to
    grid_thw: tuple[int, int, int]
    tokens: int  # t*h*w / merge_size**2
    packets: int  # packets the decoder must be sent (VideoReader.packets_needed)
    decode_pixels: int  # packets x coded width x height

    @property
    def frames(self) -> int:
        """Distinct frames to decode and convert."""
        return len(np.unique(self.positions))

    def meta(self) -> dict[str, Any]:
        """What the plan says of the sampling and the stream, as an item's meta reports it."""
        sampling, info = self.sampling, self.info
        return {
            "fps": sampling.sample_fps,
            "requested_fps": sampling.requested_fps,
            "fps_adjusted": sampling.fps_adjusted_by is not None,
            "fps_adjusted_by": sampling.fps_adjusted_by,
            "sampled_frames": len(self.positions),
            "video_fps": info.fps,
            "total_frames": info.num_frames,
            "duration": info.duration,
            "container": info.container,
            "codec": info.codec,
        }


def _check_tokens(tokens: int, max_tokens: int, grid: tuple[int, int, int]) -> None:
    if tokens > max_tokens:
        raise MediaError(
            reason=f"the item would be {tokens} tokens (grid {grid[0]}x{grid[1]}x{grid[2]}), above the limit of "
            f"{max_tokens} per item: ask for fewer frames or fewer pixels",
            code=TOO_MANY_ITEM_TOKENS,
        )


def plan_video(
    reader: VideoReader, cfg: ProcessorConfig, options: VideoOptions | None = None, limits: MediaLimits | None = None
) -> VideoPlan:
    """Sampling, sizes, grid and decoding work of one video from its reader's index (nothing decoded),
    refused with a MediaError when above `limits`."""
    limits = limits or DEFAULT_LIMITS
    info = reader.info
    sampling = plan_sampling(cfg, info.num_frames, info.fps, options)
    positions = reader.positions_at(reader.index_times(sampling.indices))
    tps = cfg.temporal_patch_size
    # Pad to a multiple of temporal_patch_size by repeating the last sampled frame.
    slots = np.concatenate([positions, np.repeat(positions[-1:], -len(positions) % tps)])
    orig = info.upright_size
    h, w = sampling.size(*orig)
    grid = (len(slots) // tps, h // cfg.patch_size, w // cfg.patch_size)
    tokens = grid[0] * grid[1] * grid[2] // (cfg.merge_size * cfg.merge_size)
    packets = reader.packets_needed(positions)
    plan = VideoPlan(
        info=info,
        sampling=sampling,
        positions=positions,
        slots=slots,
        orig_size=orig,
        resized=(h, w),
        grid_thw=grid,
        tokens=tokens,
        packets=packets,
        decode_pixels=packets * info.width * info.height,
    )
    _check_tokens(tokens, limits.max_tokens, grid)
    if packets > limits.max_decoded_frames:
        raise MediaError(
            reason=f"the {plan.frames} sampled frames need {packets} frames decoded from their keyframes, above "
            f"the limit of {limits.max_decoded_frames} per video: ask for fewer frames or a shorter range "
            "(video_start/video_end), or send a video with more keyframes",
            code=TOO_MUCH_WORK,
        )
    if plan.decode_pixels > limits.max_decoded_pixels:
        raise MediaError(
            reason=f"the sampled frames need {packets} frames of {info.width}x{info.height} decoded "
            f"({plan.decode_pixels} pixels), above the limit of {limits.max_decoded_pixels} per video",
            code=TOO_MUCH_WORK,
        )
    return plan


def preprocess_video_bytes(
    data: bytes | bytearray | memoryview,
    cfg: ProcessorConfig,
    *,
    limits: MediaLimits | None = None,
    threads: int = DEFAULT_DECODE_THREADS,
    workers: int | None = None,
    **options: Any,
) -> VisualInput:
    """Decode, sample, resize and patchify one video; every bad or over-limit input raises MediaError.

    `options` (the fields of `VideoOptions`) override the config's video defaults for this item. For
    Qwen3-VL, min_pixels/max_pixels bound T*H*W of the whole clip (size.shortest_edge/longest_edge) and
    total_pixels, if given, lowers that upper bound; cap_pixels_per_frame applies transformers'
    optional per-frame cap (Qwen3-VL only). limits: per-item bounds (`MediaLimits`, defaults if None),
    checked on the plan before decoding and by the decoder while it decodes; max_frame_pixels, if
    given, overrides limits.max_frame_pixels. threads: FFmpeg decoder threads (default 1; 0 = one per
    core); workers: resize threads (default min(4, cores)).
    """
    opts = VideoOptions(**options)
    opts.check()
    if cfg.in_channels != 3:
        raise ValueError(f"videos are RGB, the config wants {cfg.in_channels} channels")
    limits = limits or DEFAULT_LIMITS
    tps = cfg.temporal_patch_size
    with VideoReader(data, max_frame_pixels=opts.max_frame_pixels, threads=threads, limits=limits) as reader:
        plan = plan_video(reader, cfg, opts, reader.limits)
        slots = plan.slots
        slots_of: dict[int, list[int]] = {}
        for slot, position in enumerate(slots.tolist()):
            slots_of.setdefault(position, []).append(slot)
        n_workers = workers if workers is not None else min(4, os.cpu_count() or 1)
        writer = _PatchWriter(
            cfg, slots_of, len(slots), plan.sampling.size, max(1, n_workers), max_tokens=limits.max_tokens
        )
        try:
            reader.read(plan.positions, writer)
            pixels = writer.finish()
        finally:
            writer.close()
        timestamps = reader.frame_times[slots]
        work = dict(reader.stats)
    assert writer.resized is not None and writer.orig_size is not None
    h, w = writer.resized
    grid = (len(slots) // tps, h // cfg.patch_size, w // cfg.patch_size)
    sampling = plan.sampling
    return VisualInput(
        modality="video",
        pixels=pixels,
        grid_thw=grid,
        meta={
            **plan.meta(),
            "timestamps": [round(float(t), 6) for t in timestamps],
            "second_per_grid_ts": tps / sampling.sample_fps,
            "frames": len(slots),
            "frame_indices": sampling.indices.tolist(),
            "orig_size": writer.orig_size,
            "resized": (h, w),
            "decoded_frames": work["packets_decoded"],
            "decoded_pixels": work["decoded_pixels"],
        },
    )
