"""Qwen-VL video preprocessing on the host: video bytes -> uint8 patches in the reference row order.

Frame sampling and per-frame sizes follow the reference each model family ships with
(`service.media.video_sampling`: qwen-vl-utils for Qwen2-VL / Qwen2.5-VL, transformers'
`Qwen3VLVideoProcessor` for Qwen3-VL).

Frames are resized one by one with PIL bicubic on uint8, like the image path (the references
resize torch tensors with torchvision bicubic+antialias; see docs/video.md), or with that very torch
kernel where the family says so (`Family.video_resize`: ERNIE-4.5-VL, MiniMax-M3), and patchified into
`pixel_values_videos` order: rows (t, h-block, w-block, merge-row, merge-col), columns
(channel, temporal, patch-row, patch-col), or the family's own layout (service/media/patch_layout.py). A
frame count off a multiple of the temporal patch size is padded with the last frame.

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

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from models.config import ProcessorConfig, VisualInput
from service.media.errors import TOO_MANY_ITEM_TOKENS, TOO_MUCH_WORK, MediaError
from service.media.frame_labels import draw_label, time_label
from service.media.limits import DEFAULT_DECODE_THREADS, DEFAULT_LIMITS, MediaLimits
from service.media.navit_sizing import resize_bicubic_antialias, resize_image
from service.media.patch_layout import frame_values, is_qwen_layout, temporal_axis, value_shape
from service.media.rules import video_resize, video_sampling
from service.media.video import VideoInfo, VideoReader
from service.media.video_sampling import SamplingPlan, VideoOptions, plan_sampling

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
        content: Callable[[int, int], tuple[int, int]] | None = None,
        labels: dict[int, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.content = content  # resize to this, then zero-pad to `size` (the Kimi, Muse and GLM-5 processors)
        # where frames are sized so, the family's rule resizes them (navit_sizing.resize_image); else bicubic
        self.method = video_sampling(cfg) if content is not None else "bicubic"
        self.labels = labels or {}  # text drawn on the frame at a position before resizing (frame_labels)
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
        p, m, tps = self.cfg.patch_size, self.cfg.video_merge_size, self.cfg.temporal_patch_size
        h, w = self.size(height, width)
        self.orig_size, self.resized = (height, width), (h, w)
        bh, bw = h // (p * m), w // (p * m)
        if self.max_tokens is not None:
            # The plan checked the header's size; the frames themselves decide (a header may lie).
            grid = (self.num_slots // tps, h // p, w // p)
            _check_tokens(video_tokens(grid, self.cfg), self.max_tokens, grid)
        if not is_qwen_layout(self.cfg):  # the family's own row layout: [T, rows of a frame, *value axes]
            self._out = np.empty((self.num_slots // tps, bh * bw * m * m, *value_shape(self.cfg)), np.uint8)
            return
        self._out = np.empty((self.num_slots // tps, bh, bw, m, m, 3, tps, p * p), np.uint8)
        # Patch rows (P contiguous bytes in source and destination) move as single void items.
        self._dst = self._out.view(np.dtype((np.void, p))).reshape(self._out.shape[:-1] + (p,))

    def _write(self, position: int, rgb: np.ndarray) -> None:
        assert self._out is not None and self.resized is not None
        p, m, tps = self.cfg.patch_size, self.cfg.video_merge_size, self.cfg.temporal_patch_size
        h, w = self.resized
        image = Image.fromarray(rgb)
        if position in self.labels:
            image = draw_label(image, self.labels[position], self.cfg.video.timestamp_font)
        if self.method != "bicubic":
            content = self.content(*rgb.shape[:2]) if self.content else (h, w)
            image = resize_image(image, self.method, content, (h, w))
        elif image.size != (w, h) and video_resize(self.cfg) == "torch":
            image = Image.fromarray(resize_bicubic_antialias(np.asarray(image), h, w))
        elif image.size != (w, h):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        if self._dst is None:
            values = frame_values(np.asarray(image), self.cfg)
            axis = 1 + temporal_axis(self.cfg)
            for slot in self.slots_of[position]:
                np.moveaxis(self._out[slot // tps], axis, 0)[slot % tps] = np.moveaxis(values, axis, 0)[0]
            return
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


# -- planning -----------------------------------------------------------------------------------


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
    tokens: int  # t*h*w / video merge size**2
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


def video_tokens(grid: tuple[int, int, int], cfg: ProcessorConfig) -> int:
    """Merged tokens of a video's grid: t*h*w / video merge size**2."""
    return grid[0] * grid[1] * grid[2] // cfg.video_merge_size**2


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
    tokens = video_tokens(grid, cfg)
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
        labels = None
        if cfg.video.timestamp_font:  # each frame's time, from its index and the video's rate
            labels = {int(p): time_label(int(i) / plan.info.fps) for p, i in zip(plan.positions, plan.sampling.indices)}
        writer = _PatchWriter(
            cfg, slots_of, len(slots), plan.sampling.size, max(1, n_workers), max_tokens=limits.max_tokens,
            content=plan.sampling.content_size, labels=labels,
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
