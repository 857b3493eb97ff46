"""What one media item may cost: the limits the estimate checks before decoding and the decoder enforces while
decoding.

`MediaLimits` is a frozen dataclass, cheap to pickle into worker processes. Every limit is per item:

* `max_image_pixels`: an image's size from its header (width x height) before anything is decoded.
* `max_frame_pixels`: one video frame (coded width x height), from the header and again for every frame the
  decoder returns.
* `max_stream_frames`: frames (packets) in the video stream. Bounds reading the metadata itself: the packet
  index is built by demuxing packet headers only (about 5 us a packet), and stops with `too_many_frames` once
  the stream holds more; a header that declares more is refused before demuxing anything.
* `max_decoded_frames`: packets sent to the decoder for one item. Decoding starts at the keyframe before each
  wanted frame, so this bounds the work whatever the sampling keeps: a clip with one keyframe and 100,000
  frames cannot make the decoder run through them to reach the last one.
* `max_decoded_pixels`: the sum of width x height of the frames the decoder returns (the work that scales with
  resolution).
* `max_tokens`: merged tokens of the item's grid (t*h*w / its modality's merge size**2), what the LLM and the tower see.

Defaults (2-core development machine, H.264 software decoding at about 0.35 Gpixel/s per core):
4096x4096 frames (4K yes, 8K no), 8192x8192 images, 36,000 stream frames (20 minutes at 30 fps), 7,200
decoded frames (4 minutes at 30 fps decoded through), 8 Gi decoded pixels (about 2 minutes of 1080p30 or
25 s of 2160p30 decoded through, some 25 s of one core) and 65,536 tokens per item.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# 4096 x 4096 per frame: covers 4K UHD and DCI 4K, refuses 8K (one 8K RGB frame is ~100 MB).
DEFAULT_MAX_FRAME_PIXELS = 4096 * 4096
# 8192 x 8192: generous for real photos, below Pillow's own bomb warning (~89.5 MP).
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
DEFAULT_MAX_STREAM_FRAMES = 36_000
DEFAULT_MAX_DECODED_FRAMES = 7_200
DEFAULT_MAX_DECODED_PIXELS = 8 * 2**30
DEFAULT_MAX_TOKENS = 65_536
# FFmpeg decoder (and swscale) threads per decode; parallelism comes from decoding several items at once.
DEFAULT_DECODE_THREADS = 1


@dataclass(frozen=True)
class MediaLimits:
    """Per-item limits; see the module docstring for what each one bounds."""

    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_frame_pixels: int = DEFAULT_MAX_FRAME_PIXELS
    max_stream_frames: int = DEFAULT_MAX_STREAM_FRAMES
    max_decoded_frames: int = DEFAULT_MAX_DECODED_FRAMES
    max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS
    max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        # Limits come from the server's configuration, not from clients: a bad one is a programming error.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MediaLimits.{f.name} must be an integer >= 1, got {value!r}")


DEFAULT_LIMITS = MediaLimits()
