"""Synthetic test videos made with PyAV, with content that says which frame it is.

Every frame shows its index in binary as a grid of black/white cells (`index_pattern`), coarse
enough to survive lossy codecs and chroma subsampling, so a test can read back WHICH source frames
a sampler picked (`read_index`). Videos are built in memory; nothing touches the network.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable, Sequence
from fractions import Fraction

import av
import numpy as np

from models.config import ProcessorConfig, VideoConfig

# The video processor configs the video tests run against (Qwen3-VL's as released).
QWEN2 = ProcessorConfig(family="qwen2_vl")
QWEN25 = ProcessorConfig(family="qwen2_5_vl")
QWEN3 = ProcessorConfig(
    family="qwen3_vl",
    patch_size=16,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    video=VideoConfig(min_pixels=4096, max_pixels=4194304),
)

GRID_COLS, GRID_ROWS = 4, 3  # 12 bits: indices up to 4095
CONTAINER_EXT = {"mp4": "mp4", "mov": "mov", "matroska": "mkv", "webm": "webm", "avi": "avi"}


def index_pattern(index: int, width: int, height: int) -> np.ndarray:
    """uint8 RGB [height, width, 3]: bit k of `index` is cell k (row-major) white, else black."""
    if not 0 <= index < 2 ** (GRID_COLS * GRID_ROWS):
        raise ValueError(f"index {index} does not fit the {GRID_COLS}x{GRID_ROWS} grid")
    img = np.zeros((height, width, 3), np.uint8)
    for bit in range(GRID_COLS * GRID_ROWS):
        if index >> bit & 1:
            r, c = divmod(bit, GRID_COLS)
            img[_span(r, GRID_ROWS, height), _span(c, GRID_COLS, width)] = 255
    return img


def read_index(frame: np.ndarray) -> int:
    """Inverse of `index_pattern` on a decoded (possibly lossy, resized) upright frame."""
    height, width = frame.shape[:2]
    gray = frame.astype(np.float32).mean(axis=2)
    index = 0
    for bit in range(GRID_COLS * GRID_ROWS):
        r, c = divmod(bit, GRID_COLS)
        rows, cols = _span(r, GRID_ROWS, height), _span(c, GRID_COLS, width)
        # Sample the cell's centre half: edges blur under compression and resizing.
        h, w = rows.stop - rows.start, cols.stop - cols.start
        centre = gray[rows.start + h // 4 : rows.stop - h // 4, cols.start + w // 4 : cols.stop - w // 4]
        if centre.mean() > 128:
            index |= 1 << bit
    return index


def _span(i: int, n: int, length: int) -> slice:
    return slice(i * length // n, (i + 1) * length // n)


def make_video(
    n_frames: int,
    *,
    fps: float = 10,
    width: int = 64,
    height: int = 48,
    codec: str = "mpeg4",
    container: str = "mp4",
    pix_fmt: str | None = None,
    pts: Sequence[int] | None = None,
    time_base: Fraction | None = None,
    rotation: int | None = None,
    hflip: bool = False,
    audio: bool = False,
    gop: int | None = None,
    options: dict[str, str] | None = None,
    container_options: dict[str, str] | None = None,
    frame_fn: Callable[[int, int, int], np.ndarray] = index_pattern,
) -> bytes:
    """Encode `n_frames` frames of `frame_fn(i, width, height)` and return the file's bytes.

    pts/time_base: explicit presentation times (in time_base units) for variable frame rate.
    rotation/hflip: display matrix written to the container (counter-clockwise degrees).
    audio: add a short silent AAC/Opus track so the file has two streams.
    """
    rate = Fraction(fps).limit_denominator(1001)
    codec_options = dict(options or {})
    if codec in ("libx264", "libx265"):
        # Deterministic, fast, and quiet: one thread, no scene-cut keyframes.
        codec_options.setdefault("preset", "veryfast" if codec == "libx264" else "ultrafast")
        if codec == "libx265":
            codec_options.setdefault("x265-params", "log-level=error:pools=1:frame-threads=1")
    # mp4 with the index first needs a seekable real file; a temp file covers every container.
    fd, path = tempfile.mkstemp(suffix="." + CONTAINER_EXT.get(container, container))
    os.close(fd)
    try:
        with av.open(path, "w", format=container, options=container_options or {}) as out:
            stream = out.add_stream(codec, rate=rate, options=codec_options)
            stream.width, stream.height = width, height
            stream.pix_fmt = pix_fmt or ("yuvj420p" if codec == "mjpeg" else "yuv420p")
            if gop is not None:
                stream.codec_context.gop_size = gop
            if time_base is not None:
                stream.time_base = time_base
                stream.codec_context.time_base = time_base
            if rotation is not None or hflip:
                stream.set_display_rotation(rotation or 0, hflip=hflip)
            audio_stream = _add_audio(out, container) if audio else None
            for i in range(n_frames):
                frame = av.VideoFrame.from_ndarray(frame_fn(i, width, height), format="rgb24")
                if pts is not None:
                    frame.pts = int(pts[i])
                    frame.time_base = time_base
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
            if audio_stream is not None:
                _write_silence(out, audio_stream, seconds=n_frames / float(rate))
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def make_audio_only(container: str = "mp4", seconds: float = 1.0) -> bytes:
    """A file with one audio stream and no video at all."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = _add_audio(out, container)
        _write_silence(out, stream, seconds)
    return buf.getvalue()


def _add_audio(out: av.container.OutputContainer, container: str) -> av.audio.stream.AudioStream:
    codec = "libopus" if container == "webm" else "aac"
    return out.add_stream(codec, rate=48000)


def _write_silence(
    out: av.container.OutputContainer, stream: av.audio.stream.AudioStream, seconds: float
) -> None:
    samples = max(1, int(seconds * 48000))
    frame_size = 960
    for start in range(0, samples, frame_size):
        n = min(frame_size, samples - start)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, n), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 48000
        frame.pts = start
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)


def decode_all(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of the first video stream, decoded straight through: ([N,H,W,3], times in s).

    The simplest possible reader (no seeking, no threads), the baseline the decoder is tested against.
    """
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        frames, times = [], []
        for frame in c.decode(stream):
            frames.append(frame.to_ndarray(format="rgb24"))
            times.append(float(frame.pts * stream.time_base))
    return np.stack(frames), np.asarray(times)
