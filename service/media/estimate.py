"""What an item will cost, from its header alone: grid, tokens and decoding work before any pixel is decoded.

Contract (stable; pure functions of the bytes and options, no global state, safe in a worker process):

* `estimate_image(data, cfg, *, min_pixels=None, max_pixels=None, limits=None) -> Estimate`
* `estimate_video(data, cfg, *, limits=None, **video_options) -> Estimate`, with the options of
  `preprocess_video_bytes` (fps, nframes, min_frames, max_frames, video_start, video_end, min_pixels,
  max_pixels, total_pixels, max_frame_pixels, cap_pixels_per_frame).

Both raise `MediaError` (stable code, reason naming the limit; `service.media.errors.HTTP_STATUS` maps codes
to 413/422) for bad input and for input above `limits`, exactly where the full preprocessing would, and
return an `Estimate` otherwise.

How: an image's size comes from Pillow's lazy open (header only; for JPEG also the data-versus-header bound
of `service.media.images`), then `smart_resize`. A video's comes from the packet index (`VideoReader` with
`index_only=True`: packet headers are demuxed, nothing is decoded, at most `limits.max_stream_frames` of
them, and a header declaring more is refused before demuxing), the container's display matrix
(`service.media.headers`) and the family's sampling rule (`plan_video`, the very function the full
preprocessing runs).

Exactness: for well-formed files the estimate's `grid_thw` (hence `tokens`) equals the one
`preprocess_image_bytes` / `preprocess_video_bytes` return (tested over generated clips and images). It
can differ only where the header does not describe the pixels: a GIF whose first frame grows the canvas, a
video whose frames are not the size its header says or whose rotation comes from the bitstream rather than
the container. The full preprocessing then recomputes the grid from the decoded frames and refuses again
anything above the limits. `decode_frames` is what the decoder must be sent at least; it may send a few more
(frames waiting in a B-frame reorder queue), never past `limits.max_decoded_frames`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.config import ProcessorConfig
from service.media.image_preprocess import check_tokens, image_grid
from service.media.images import ImageHeader, read_header
from service.media.limits import DEFAULT_LIMITS, MediaLimits
from service.media.video import VideoReader
from service.media.video_preprocess import plan_video
from service.media.video_sampling import VideoOptions


@dataclass(frozen=True)
class Estimate:
    """The cost of one item, known before decoding it."""

    modality: str  # "image" or "video"
    grid_thw: tuple[int, int, int]
    tokens: int  # t*h*w / merge_size**2: what admission counts
    orig_size: tuple[int, int]  # upright (H, W) from the header
    resized: tuple[int, int]  # (h, w) of every frame after smart_resize
    frames: int  # distinct frames decoded and converted (1 for an image)
    decode_frames: int  # frames (packets) the decoder is sent (1 for an image)
    decode_pixels: int  # decode_frames x coded width x height
    meta: dict[str, Any] = field(default_factory=dict)  # video: sampling facts (fps, requested_fps, ...)

    @property
    def patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def estimate_image(
    data: bytes | bytearray | memoryview,
    cfg: ProcessorConfig,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    limits: MediaLimits | None = None,
    header: ImageHeader | None = None,
) -> Estimate:
    """Grid and tokens of an image from its header; MediaError where `preprocess_image_bytes` would refuse it
    before decoding (format, header size, JPEG data shorter than its header, pixel bounds, tokens).
    `header`: what `read_header` returned for these bytes and `limits`, to skip reading it again."""
    limits = limits or DEFAULT_LIMITS
    header = header or read_header(data, limits.max_image_pixels)
    width, height = header.width, header.height
    resized, grid = image_grid(height, width, cfg, min_pixels, max_pixels)
    tokens = check_tokens(grid, cfg, limits.max_tokens)
    return Estimate(
        modality="image",
        grid_thw=grid,
        tokens=tokens,
        orig_size=(height, width),
        resized=resized,
        frames=1,
        decode_frames=1,
        decode_pixels=width * height,
        meta={"format": header.format},
    )


def estimate_video(
    data: bytes | bytearray | memoryview, cfg: ProcessorConfig, *, limits: MediaLimits | None = None, **options: Any
) -> Estimate:
    """Grid, tokens and decoding work of a video from its header and packet index; MediaError where
    `preprocess_video_bytes` would refuse it before decoding (options, container, stream, limits)."""
    opts = VideoOptions(**options)
    opts.check()
    with VideoReader(data, max_frame_pixels=opts.max_frame_pixels, limits=limits, index_only=True) as reader:
        plan = plan_video(reader, cfg, opts, reader.limits)
    return Estimate(
        modality="video",
        grid_thw=plan.grid_thw,
        tokens=plan.tokens,
        orig_size=plan.orig_size,
        resized=plan.resized,
        frames=plan.frames,
        decode_frames=plan.packets,
        decode_pixels=plan.decode_pixels,
        meta=plan.meta(),
    )
