"""Decoding many videos leaves no frames, threads or memory behind, without help from the garbage collector."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator

import av
import numpy as np
import pytest

from service.media.errors import MediaError
from service.media.limits import MediaLimits
from service.media.video import VideoReader, decode_video
from service.media.video_preprocess import preprocess_video_bytes
from tests.videos import QWEN2, make_video

av.logging.set_level(av.logging.ERROR)


def os_threads() -> int:
    """Threads of this process as the kernel counts them (FFmpeg's and swscale's included)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def settled_threads(at_most: int) -> int:
    """Thread count once exiting threads are gone: a joined thread's kernel task can outlive the join briefly."""
    deadline = time.monotonic() + 2.0
    count = os_threads()
    while count > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
        count = os_threads()
    return count


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def live_frames() -> int:
    return sum(type(o) is av.VideoFrame for o in gc.get_objects())


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def rotated_clip() -> bytes:
    """Rotated (so the display matrix is read) and large enough that leaked frames would show in RSS."""

    def texture(i: int, w: int, h: int) -> np.ndarray:
        rng = np.random.default_rng(i // 5)
        return np.repeat(np.repeat(rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8), 8, 0), 8, 1)

    return make_video(30, fps=15, width=480, height=360, codec="libx264", rotation=90, frame_fn=texture,
                      options={"g": "10"})


def test_many_decodes_leave_nothing_behind(rotated_clip: bytes, no_gc: None) -> None:
    base_py, base_os = threading.active_count(), os_threads()
    peak_os, warm_rss = base_os, 0.0
    for i in range(24):
        # Decoder threads 1 and 2 (frame threading), resize threads, all three families' paths share this.
        out = preprocess_video_bytes(rotated_clip, QWEN2, nframes=6, threads=1 + i % 2, workers=2)
        assert out.meta["orig_size"] == (480, 360)  # rotation still applied
        peak_os = max(peak_os, os_threads())
        if i == 3:
            warm_rss = rss_mb()
        assert threading.active_count() == base_py, i
        # FFmpeg's threads end with each decode; one thread some libraries start once is allowed.
        assert settled_threads(base_os + 1) <= base_os + 1, (i, os_threads(), base_os)
    assert live_frames() == 0
    assert rss_mb() - warm_rss < 40, (warm_rss, rss_mb())
    assert peak_os <= base_os + 1 + 2  # + the 2 resize workers while they run


def test_decode_video_and_error_paths_leave_nothing_behind(rotated_clip: bytes, no_gc: None) -> None:
    base_os = os_threads()
    for i in range(16):
        got = decode_video(rotated_clip, indices=[0, 7, 29], threads=2)
        assert got.frames.shape == (3, 480, 360, 3)
        # A decode refused half-way (work limit) and a damaged file: containers closed, frames freed.
        with pytest.raises(MediaError):
            decode_video(rotated_clip, indices=[29], threads=2, limits=MediaLimits(max_decoded_frames=3))
        with pytest.raises(MediaError):
            decode_video(rotated_clip[: len(rotated_clip) // 2 + i], indices=[0])
        assert settled_threads(base_os + 1) <= base_os + 1, (i, os_threads(), base_os)
    del got
    assert live_frames() == 0


def test_reader_close_frees_the_decoder(rotated_clip: bytes) -> None:
    reader = VideoReader(rotated_clip, threads=2)
    reader.frames_at_positions([3, 20])
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(RuntimeError):
        reader.frames_at_positions([0])
    with VideoReader(rotated_clip, index_only=True) as probe:
        with pytest.raises(RuntimeError):
            probe.frames_at_positions([0])


def test_threads_are_bounded_while_decoding(rotated_clip: bytes) -> None:
    """The default decode runs on the calling thread: no FFmpeg or swscale thread appears at all."""
    base_os = os_threads()
    seen: list[int] = []
    with VideoReader(rotated_clip) as reader:
        reader.read([0, 10, 20, 29], lambda position, rgb: seen.append(os_threads()))
    assert seen and max(seen) <= base_os + 1
    with pytest.raises(ValueError):
        VideoReader(rotated_clip, threads=-1)
    assert os.cpu_count()
