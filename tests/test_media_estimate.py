"""The estimate (service/media/estimate.py): equal to the full preprocessing for well-formed files, and the limits
refuse work before decoding (estimate and preprocessing) and while decoding (the decoder's own counters)."""

from __future__ import annotations

import io
from dataclasses import replace
from fractions import Fraction
from typing import Any

import av
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from models.config import ProcessorConfig
from service.media.errors import HTTP_STATUS, MediaError, http_status
from service.media.estimate import estimate_image, estimate_video
from service.media.image_preprocess import preprocess_image_bytes
from service.media.limits import DEFAULT_LIMITS, MediaLimits
from service.media.video import VideoReader, decode_video, probe_video
from service.media.video_preprocess import preprocess_video_bytes
from tests.videos import QWEN2, QWEN3, QWEN25, make_video

av.logging.set_level(av.logging.ERROR)

VFR_PTS = [0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1500, 2500, 3500, 3600, 3700]


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    """Small real clips: containers, codecs, frame rates, rotations and odd sizes."""
    return {
        "h264_cfr_bframes": make_video(23, fps=10, width=96, height=72, codec="libx264"),
        "mpeg4_mp4": make_video(30, fps=25, width=64, height=48),
        "vfr_mkv": make_video(15, pts=VFR_PTS, time_base=Fraction(1, 1000), codec="libx264", container="matroska"),
        "vfr_mp4": make_video(15, pts=VFR_PTS, time_base=Fraction(1, 1000), codec="libx264"),
        "ntsc_mkv": make_video(40, fps=30000 / 1001, codec="libx264", container="matroska"),
        "vp9_webm": make_video(20, fps=12, width=80, height=60, codec="libvpx-vp9", container="webm"),
        "vp8_webm_odd": make_video(18, fps=9, width=66, height=50, codec="libvpx", container="webm"),
        "mjpeg_avi_odd": make_video(30, fps=25, width=51, height=37, codec="mjpeg", container="avi"),
        "h264_444_odd": make_video(21, fps=10, width=97, height=61, codec="libx264", pix_fmt="yuv444p"),
        "rot90_mp4": make_video(23, fps=10, width=96, height=72, codec="libx264", rotation=90),
        "rot270_hflip_mov": make_video(20, fps=10, width=96, height=64, codec="libx264", container="mov",
                                       rotation=-90, hflip=True),
        "rot90_mkv": make_video(20, fps=10, width=96, height=64, codec="libx264", container="matroska", rotation=90),
        "rot180_mp4": make_video(12, fps=10, width=64, height=48, codec="libx264", rotation=180),
        "audio_mp4": make_video(16, fps=8, width=64, height=48, codec="libx264", audio=True),
    }


OPTIONS: list[dict[str, Any]] = [
    {},
    {"fps": 0.5},  # raised by min_frames
    {"fps": 7.3},
    {"fps": 40.0},  # more than the clip has: lowered to the frame count
    {"nframes": 5},
    {"nframes": 8},
    {"fps": 1.0, "min_frames": 6, "max_frames": 10},
    {"fps": 6.0, "max_frames": 6},
    {"video_start": 0.25, "video_end": 1.7},
    {"video_start": 0.9},
    {"min_pixels": 784, "max_pixels": 20000},
    {"min_pixels": 40000},
    {"total_pixels": 60000},
    {"nframes": 40},  # above the frame count: refused (qwen2) or repeated frames (qwen3)
    {"video_start": 30.0},  # selects nothing
]
CONFIGS = {"qwen2_vl": QWEN2, "qwen2_5_vl": QWEN25, "qwen3_vl": QWEN3}


def outcome(fn, *args, **kwargs) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kwargs)
    except MediaError as err:
        return "error", err.code


@pytest.mark.parametrize("family", CONFIGS)
def test_video_estimate_equals_preprocessing(clips: dict[str, bytes], family: str) -> None:
    cfg = CONFIGS[family]
    options = OPTIONS + ([{"cap_pixels_per_frame": True}, {"fps": 3.0, "cap_pixels_per_frame": True}]
                         if family == "qwen3_vl" else [])
    compared = 0
    for name, data in clips.items():
        for opts in options:
            kind_e, est = outcome(estimate_video, data, cfg, **opts)
            kind_p, out = outcome(preprocess_video_bytes, data, cfg, **opts, workers=1)
            assert kind_e == kind_p, (name, opts, est, out)
            if kind_e == "error":
                assert est == out, (name, opts)
                continue
            compared += 1
            assert est.grid_thw == out.grid_thw, (name, opts)
            assert est.tokens == out.num_tokens(cfg.merge_size) == out.num_patches // 4
            assert est.resized == out.meta["resized"] and est.orig_size == out.meta["orig_size"], (name, opts)
            assert est.frames == len(set(out.meta["frame_indices"])) or est.frames <= out.meta["sampled_frames"]
            # The packets the plan counts must all be sent; the decoder may send a few more (reorder queue).
            assert est.decode_frames <= out.meta["decoded_frames"] <= est.decode_frames + 4, (name, opts)
            for key in ("fps", "requested_fps", "fps_adjusted", "fps_adjusted_by", "sampled_frames", "total_frames"):
                assert est.meta[key] == out.meta[key], (name, opts, key)
    assert compared > len(clips) * 8


@pytest.mark.parametrize("cfg", [ProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 64), QWEN3],
                         ids=["qwen2", "qwen3"])
def test_image_estimate_equals_preprocessing(cfg: ProcessorConfig) -> None:
    rng = np.random.default_rng(3)
    for fmt, mode in [("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGBA"), ("PNG", "P"), ("WEBP", "RGB"), ("GIF", "P"),
                      ("BMP", "RGB"), ("TIFF", "RGB")]:
        for width, height in [(1, 1), (7, 300), (64, 48), (333, 211), (1000, 40)]:
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)
            buf = io.BytesIO()
            image.save(buf, fmt)
            for bounds in ({}, {"max_pixels": 5000}, {"min_pixels": 30000}):
                kind_e, est = outcome(estimate_image, buf.getvalue(), cfg, **bounds)
                kind_p, out = outcome(preprocess_image_bytes, buf.getvalue(), cfg, **bounds)
                assert kind_e == kind_p, (fmt, mode, width, height, bounds, est, out)
                if kind_e == "ok":
                    assert est.grid_thw == out.grid_thw and est.tokens == out.num_tokens(cfg.merge_size)
                    assert est.orig_size == (height, width) and est.decode_frames == 1
                else:
                    assert est == out


def test_estimate_reads_no_frame(clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args: object) -> None:
        raise AssertionError("the estimate decoded a packet")

    monkeypatch.setattr(av.video.codeccontext.VideoCodecContext, "decode", no_decoding, raising=False)
    monkeypatch.setattr(VideoReader, "_send", no_decoding)
    for data in clips.values():
        assert estimate_video(data, QWEN2).tokens > 0


def test_rotation_comes_from_the_header(clips: dict[str, bytes]) -> None:
    for name in ("rot90_mp4", "rot270_hflip_mov", "rot90_mkv"):
        info = probe_video(clips[name])
        assert info.orientation[0] and info.upright_size == (info.width, info.height), name
        with VideoReader(clips[name]) as reader:
            reader.frames_at_positions([0])
            assert reader.orientation == info.orientation, name  # FFmpeg's frame matrix agrees
    assert probe_video(clips["rot180_mp4"]).orientation == (False, True, True)
    assert probe_video(clips["h264_cfr_bframes"]).orientation == (False, False, False)


# -- limits: refused before decoding --------------------------------------------------------------


def tiny_frames(n: int, **kwargs: Any) -> bytes:
    """n frames of 16x16: cheap to store, upscaled to min_pixels by the sampling rules."""
    def flat(i: int, w: int, h: int) -> np.ndarray:
        return np.full((h, w, 3), i % 251, np.uint8)

    return make_video(n, width=16, height=16, fps=30, codec="libx264", frame_fn=flat, **kwargs)


@pytest.fixture(scope="module")
def long_tiny() -> bytes:
    """600 tiny frames, one keyframe: what the issue's 10,000-frame clip is in small."""
    return tiny_frames(600, options={"g": "1000", "sc_threshold": "0", "bf": "0"})


def test_tokens_refused_before_decoding(long_tiny: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    est = estimate_video(long_tiny, QWEN2, fps=30.0)
    # 16x16 frames upscaled to min_pixels: 336x336, 144 tokens per temporal patch, decoded or not.
    assert est.frames == 600 and est.grid_thw == (300, 24, 24) and est.tokens == 300 * 144
    limits = MediaLimits(max_tokens=est.tokens - 1)
    monkeypatch.setattr(VideoReader, "_send", lambda *a: pytest.fail("decoded"))
    for call in (estimate_video, preprocess_video_bytes):
        with pytest.raises(MediaError) as err:
            call(long_tiny, QWEN2, fps=30.0, limits=limits)
        assert err.value.code == "too_many_item_tokens" and str(est.tokens - 1) in err.value.reason
        assert err.value.status == 413


def test_decode_work_refused_before_decoding(long_tiny: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    # The last frame lies 599 frames after the only keyframe.
    est = estimate_video(long_tiny, QWEN2, nframes=2)
    assert est.frames == 2 and est.decode_frames == 600
    limits = MediaLimits(max_decoded_frames=500)
    monkeypatch.setattr(VideoReader, "_send", lambda *a: pytest.fail("decoded"))
    for call in (estimate_video, preprocess_video_bytes):
        with pytest.raises(MediaError) as err:
            call(long_tiny, QWEN2, nframes=2, limits=limits)
        assert err.value.code == "too_much_work" and "500" in err.value.reason
    pixels = MediaLimits(max_decoded_pixels=600 * 16 * 16 - 1)
    with pytest.raises(MediaError) as err:
        estimate_video(long_tiny, QWEN2, nframes=2, limits=pixels)
    assert err.value.code == "too_much_work"
    # Within the range the sampling asks for, the same clip is cheap.
    assert estimate_video(long_tiny, QWEN2, nframes=2, video_end=1.0, limits=limits).decode_frames == 31


def test_decoder_stops_at_its_own_bound(long_tiny: bytes) -> None:
    """Whatever plan asked (here none: decode_video), the decoder refuses once it reaches the bound."""
    limits = MediaLimits(max_decoded_frames=100)
    with VideoReader(long_tiny, limits=limits) as reader:
        with pytest.raises(MediaError) as err:
            reader.frames_at_positions([599])
        assert err.value.code == "too_much_work"
        assert reader.stats["packets_decoded"] == 100
    with pytest.raises(MediaError) as err:
        decode_video(long_tiny, indices=[599], limits=MediaLimits(max_decoded_pixels=50 * 16 * 16))
    assert err.value.code == "too_much_work"
    assert decode_video(long_tiny, indices=[99], limits=limits).frames.shape == (1, 16, 16, 3)


def test_stream_frames_bound_the_index(long_tiny: bytes) -> None:
    # The MP4 header states 600 frames: refused before any packet is demuxed.
    with pytest.raises(MediaError) as err:
        probe_video(long_tiny, limits=MediaLimits(max_stream_frames=599))
    assert err.value.code == "too_many_frames" and "header declares 600" in err.value.reason
    assert probe_video(long_tiny, limits=MediaLimits(max_stream_frames=600)).num_frames == 600


def test_header_understating_the_length_is_bounded_by_the_scan() -> None:
    """A Matroska header claiming 1 s over 30 s of frames: the index counts packets, not the header's claim."""
    data = tiny_frames(300, container="matroska")
    assert b"00:00:10.000000000" in data
    lying = data.replace(b"00:00:10.000000000", b"00:00:01.000000000")
    with VideoReader(lying, index_only=True) as reader:
        assert reader.info.num_frames == 300  # exact: counted, not read from the header
    with pytest.raises(MediaError) as err:
        estimate_video(lying, QWEN2, limits=MediaLimits(max_stream_frames=120))
    assert err.value.code == "too_many_frames" and "holds more than 120" in err.value.reason
    # The true duration declared: refused from the header before demuxing.
    with pytest.raises(MediaError) as err:
        estimate_video(data, QWEN2, limits=MediaLimits(max_stream_frames=120))
    assert "header declares" in err.value.reason


def test_frame_pixels_and_image_limits() -> None:
    clip = make_video(4, width=64, height=48)
    with pytest.raises(MediaError) as err:
        estimate_video(clip, QWEN2, limits=MediaLimits(max_frame_pixels=64 * 48 - 1))
    assert err.value.code == "too_many_pixels"
    buf = io.BytesIO()
    Image.new("RGB", (300, 200)).save(buf, "PNG")
    for call in (estimate_image, preprocess_image_bytes):
        with pytest.raises(MediaError) as err:
            call(buf.getvalue(), QWEN2, limits=MediaLimits(max_image_pixels=300 * 200 - 1))
        assert err.value.code == "too_large" and err.value.status == 413
        with pytest.raises(MediaError) as err:
            call(buf.getvalue(), QWEN2, limits=MediaLimits(max_tokens=10))
        assert err.value.code == "too_many_item_tokens"


def test_limits_validate_and_defaults() -> None:
    assert DEFAULT_LIMITS == MediaLimits()
    assert replace(DEFAULT_LIMITS, max_tokens=5).max_tokens == 5
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError):
            MediaLimits(max_tokens=bad)  # type: ignore[arg-type]


def test_every_code_has_a_status() -> None:
    import service.media.errors as errors

    codes = {v for k, v in vars(errors).items() if k.isupper() and isinstance(v, str)}
    assert codes == set(HTTP_STATUS)
    over = {c for c, status in HTTP_STATUS.items() if status == 413}
    assert over == {"too_large", "too_many_pixels", "too_many_frames", "too_much_work", "too_many_item_tokens"}
    assert http_status("corrupt_video") == 422 and http_status("something new") == 422


def test_declared_frame_size_refused_before_ffmpeg_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.media.headers import declared_frame_sizes
    from service.media.sniff import sniff_container

    clips = [make_video(3, width=64, height=48, codec="libx264"),
             make_video(3, width=64, height=48, codec="libx264", container="mov"),
             make_video(3, width=64, height=48, codec="libvpx-vp9", container="webm"),
             make_video(3, width=64, height=48, codec="mjpeg", container="avi")]
    for data in clips:
        assert set(declared_frame_sizes(data, sniff_container(data))) == {(64, 48)}
    monkeypatch.setattr(av, "open", lambda *a, **k: pytest.fail("FFmpeg opened the file"))
    for data in clips:
        with pytest.raises(MediaError) as err:
            estimate_video(data, QWEN2, limits=MediaLimits(max_frame_pixels=64 * 48 - 1))
        assert err.value.code == "too_many_pixels" and "header declares 64x48" in err.value.reason


@pytest.fixture(scope="module")
def fuzz_seeds() -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    seeds = []
    for fmt, kwargs in (("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {})):
        buf = io.BytesIO()
        image.save(buf, fmt, **kwargs)
        seeds.append(("image", buf.getvalue()))
    seeds += [("video", make_video(6, codec="libx264", rotation=90)),
              ("video", make_video(6, codec="libx264", container="matroska", rotation=90)),
              ("video", make_video(6, codec="mjpeg", container="avi"))]
    return seeds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 5), cuts=st.lists(st.tuples(st.floats(0, 0.3), st.integers(0, 255)), max_size=6),
       keep=st.floats(0.05, 1.0))
def test_damaged_headers_are_media_errors_only(fuzz_seeds: list[tuple[str, bytes]], which: int, cuts,
                                               keep: float) -> None:
    """Flipped bytes (mostly in the headers the estimate walks) and cut files: a result or a MediaError."""
    kind, seed = fuzz_seeds[which]
    data = bytearray(seed)
    for where, value in cuts:
        data[min(int(where * len(data)), len(data) - 1)] = value
    blob = bytes(data[: max(1, int(keep * len(data)))])
    calls = ((estimate_image, preprocess_image_bytes) if kind == "image" else (estimate_video, preprocess_video_bytes))
    for call in calls:
        try:
            call(blob, QWEN2)
        except MediaError:
            pass


@pytest.mark.parametrize("container", ["mp4", "mov", "matroska"])
def test_header_matrix_equals_the_frames(container: str) -> None:
    """The matrix read from the header is, int for int, the one FFmpeg attaches to decoded frames."""
    from service.media.headers import container_display_matrix
    from service.media.sniff import sniff_container
    from service.media.video_frames import display_matrix

    for rotation, hflip in [(90, False), (-90, False), (180, False), (0, True), (90, True), (45, False), (None, False)]:
        data = make_video(2, codec="libx264", container=container, rotation=rotation, hflip=hflip)
        with av.open(io.BytesIO(data)) as c:
            stream = c.streams.video[0]
            frame = next(c.decode(stream))
            expected = display_matrix(frame)
            track_id = stream.id
        got = container_display_matrix(data, sniff_container(data), track_id=track_id, video_index=0)
        assert got == expected, (container, rotation, hflip)
