"""Qwen-VL frame sampling and video preprocessing (service/media/video_sampling.py, video_preprocess.py).

The reference rules are transcribed here independently, as plainly as the sources read
(qwen-vl-utils 0.0.14 `vision_process.py` for Qwen2-VL/Qwen2.5-VL, transformers'
`Qwen3VLVideoProcessor` for Qwen3-VL), checked against hand-computed cases, and, where the real
reference imports without torchvision (torch.linspace, transformers' Qwen3-VL functions), against it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import av
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from models.config import ProcessorConfig
from service.media.errors import MediaError
from service.media.image_preprocess import smart_resize
from service.media.video_preprocess import patchify_video, preprocess_video_bytes
from service.media.video_sampling import (
    VideoOptions,
    frame_range,
    plan_sampling,
    qwen2_frame_pixel_bounds,
    qwen2_nframes,
    qwen3_max_pixels,
    qwen3_num_frames,
    qwen3_smart_resize,
    torch_linspace_round,
)
from tests.videos import QWEN2, QWEN3, QWEN25, decode_all, make_video, read_index

av.logging.set_level(av.logging.ERROR)

try:  # transformers' Qwen3-VL video processor imports without torchvision; Qwen2-VL's does not.
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_qwen3_smart_resize
    from transformers.video_utils import VideoMetadata

    HAVE_HF_QWEN3 = True
except ImportError:  # pragma: no cover - depends on the installed transformers
    HAVE_HF_QWEN3 = False

needs_hf_qwen3 = pytest.mark.skipif(not HAVE_HF_QWEN3, reason="transformers Qwen3-VL video processor missing")



# -- reference transcriptions ---------------------------------------------------------------------


def ref_smart_nframes(ele: dict[str, Any], total_frames: int, video_fps: float) -> int:
    """qwen-vl-utils `smart_nframes` (FRAME_FACTOR 2, FPS 2.0, FPS_MIN_FRAMES 4, FPS_MAX_FRAMES 768)."""
    if "nframes" in ele:
        nframes = round(ele["nframes"] / 2) * 2
    else:
        fps = ele.get("fps", 2.0)
        min_frames = math.ceil(ele.get("min_frames", 4) / 2) * 2
        max_frames = math.floor(ele.get("max_frames", min(768, total_frames)) / 2) * 2
        nframes = total_frames / video_fps * fps
        nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
        nframes = math.floor(nframes / 2) * 2
    if not (2 <= nframes and nframes <= total_frames):
        raise ValueError(nframes)
    return nframes


def ref_frame_range(ele: dict[str, Any], total_frames: int, video_fps: float) -> tuple[int, int, int]:
    """qwen-vl-utils `calculate_video_frame_range`."""
    start, end = ele.get("video_start"), ele.get("video_end")
    if start is None and end is None:
        return 0, total_frames - 1, total_frames
    max_duration = total_frames / video_fps
    start_frame = math.ceil(max(0.0, min(start, max_duration)) * video_fps) if start is not None else 0
    if end is not None:
        end_frame = min(math.floor(max(0.0, min(end, max_duration)) * video_fps), total_frames - 1)
    else:
        end_frame = total_frames - 1
    if start_frame >= end_frame:
        raise ValueError((start_frame, end_frame))
    return start_frame, end_frame, end_frame - start_frame + 1


def ref_qvu_indices(ele: dict[str, Any], total_frames: int, video_fps: float) -> list[int]:
    """The decord/torchcodec readers of qwen-vl-utils: range, nframes, torch.linspace().round()."""
    start, end, count = ref_frame_range(ele, total_frames, video_fps)
    nframes = ref_smart_nframes(ele, count, video_fps)
    return torch.linspace(start, end, nframes).round().long().tolist()


def ref_qvu_max_pixels(ele: dict[str, Any], nframes: int, factor: int, total_default: float) -> float:
    """qwen-vl-utils `fetch_video` per-frame max_pixels (VIDEO_MIN/MAX_TOKEN_NUM 128/768)."""
    min_pixels = ele.get("min_pixels", 128 * factor * factor)
    total_pixels = ele.get("total_pixels", total_default)
    max_pixels = max(min(768 * factor * factor, total_pixels / nframes * 2), int(min_pixels * 1.05))
    return min(ele.get("max_pixels", max_pixels), max_pixels)


def ref_qwen3_indices(
    total: int, video_fps: float, fps: float = 2, num_frames: int | None = None
) -> list[int]:
    """transformers Qwen3VLVideoProcessor.sample_frames with min_frames 4, max_frames 768."""
    if num_frames is None:
        num_frames = int(total / video_fps * fps)
        num_frames = min(max(num_frames, 4), 768, total)
    return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()


def ref_layout(frames: np.ndarray, p: int, m: int, tps: int) -> np.ndarray:
    """transformers' video patchify (view + permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)) on float
    [T, C, H, W] frames, with the batch axis of the reference kept."""
    t, c, h, w = frames.shape
    pad = -t % tps
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        t += pad
    videos = frames[None].astype(np.float64)
    gt, gh, gw = t // tps, h // p, w // p
    patches = videos.reshape(1, gt, tps, c, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(1, gt * gh * gw, c * tps * p * p)[0]


def unpatchify(pixels: np.ndarray, grid: tuple[int, int, int], p: int, m: int, tps: int) -> np.ndarray:
    """[F, h, w, 3] uint8 frames back from patch rows, to read which source frames were sampled."""
    gt, gh, gw = grid
    x = pixels.reshape(gt, gh // m, gw // m, m, m, 3, tps, p, p)
    x = x.transpose(0, 6, 1, 3, 7, 2, 4, 8, 5)  # (t, tps, bh, mh, ph, bw, mw, pw, c)
    return x.reshape(gt * tps, gh * p, gw * p, 3)


# -- index arithmetic -----------------------------------------------------------------------------


def test_torch_linspace_round_hand_cases() -> None:
    assert torch_linspace_round(0, 9, 4).tolist() == [0, 3, 6, 9]
    assert torch_linspace_round(0, 44, 8).tolist() == [0, 6, 13, 19, 25, 31, 38, 44]
    # 2.5 and 7.5 round half to even.
    assert torch_linspace_round(0, 10, 5).tolist() == [0, 2, 5, 8, 10]
    assert torch_linspace_round(20, 50, 6).tolist() == [20, 26, 32, 38, 44, 50]
    assert torch_linspace_round(7, 7, 1).tolist() == [7]


@settings(max_examples=400, deadline=None)
@given(
    total=st.integers(2, 3_000_000),
    steps=st.integers(2, 1000),
    start_frac=st.floats(0, 0.5),
)
def test_torch_linspace_round_matches_torch(total: int, steps: int, start_frac: float) -> None:
    """Long clips are where float32 rounding bites: numpy's float64 linspace differs there."""
    start = int(start_frac * total)
    expect = torch.linspace(start, total - 1, steps).round().long().tolist()
    assert torch_linspace_round(start, total - 1, steps).tolist() == expect


def test_torch_linspace_differs_from_float64_numpy() -> None:
    """Why the emulation exists: a case where np.linspace(...).round() picks another frame."""
    start, end, steps = 0, 107999, 768  # one hour at 30 fps, max_frames
    ours = torch_linspace_round(start, end, steps)
    assert ours.tolist() == torch.linspace(start, end, steps).round().long().tolist()
    assert not np.array_equal(ours, np.linspace(start, end, steps).round().astype(np.int64))


# -- Qwen2-VL / Qwen2.5-VL (qwen-vl-utils) --------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "video_fps", "options", "expect"),
    [
        (45, 10, {}, 8),  # 4.5 s * 2 fps = 9 -> floor to 8
        (900, 30, {}, 60),  # 30 s
        (30, 30, {}, 4),  # 1 s: 2 frames -> min_frames 4
        (5, 10, {}, 4),  # 0.5 s, 5 frames: min 4, then floor(min(4, 5)) = 4
        (3, 10, {}, 2),  # 3 frames: max_frames floor(min(768, 3)) = 2
        (30000, 30, {}, 768),  # 1000 s -> max_frames
        (30000, 30, {"max_frames": 101}, 100),
        (300, 30, {"min_frames": 7}, 20),
        (30, 30, {"min_frames": 7}, 8),  # ceil(7) = 8
        (300, 30, {"fps": 0.5}, 4),
        (300, 30, {"fps": 1.05}, 10),  # 10.5 -> 10
        (100, 10, {"nframes": 5}, 4),  # round(2.5) = 2 (half to even) -> 4
        (100, 10, {"nframes": 7}, 8),  # round(3.5) = 4 -> 8
        (100, 10, {"nframes": 9}, 8),
        (100, 10, {"nframes": 100}, 100),
    ],
)
def test_qwen2_nframes_hand_cases(total: int, video_fps: float, options: dict[str, Any], expect: int) -> None:
    assert ref_smart_nframes(options, total, video_fps) == expect
    got = qwen2_nframes(
        total,
        video_fps,
        fps=options.get("fps", 2.0),
        nframes=options.get("nframes"),
        min_frames=options.get("min_frames", 4),
        max_frames=options.get("max_frames"),
    )
    assert got == expect


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(1, 100_000),
    video_fps=st.sampled_from([1.0, 8.0, 23.976, 24.0, 25.0, 29.97, 30.0, 59.94, 60.0, 120.0]),
    fps=st.one_of(st.none(), st.floats(0.05, 10)),
    nframes=st.one_of(st.none(), st.integers(2, 1000)),
    min_frames=st.one_of(st.none(), st.integers(1, 50)),
    max_frames=st.one_of(st.none(), st.integers(1, 1000)),
)
def test_qwen2_nframes_matches_reference(total, video_fps, fps, nframes, min_frames, max_frames) -> None:
    ele: dict[str, Any] = {}
    if nframes is not None:
        ele["nframes"] = nframes
    else:
        for key, value in (("fps", fps), ("min_frames", min_frames), ("max_frames", max_frames)):
            if value is not None:
                ele[key] = value
    try:
        expect: int | None = ref_smart_nframes(ele, total, video_fps)
    except ValueError:
        expect = None
    kwargs = dict(
        fps=ele.get("fps", 2.0),
        nframes=ele.get("nframes"),
        min_frames=ele.get("min_frames", 4),
        max_frames=ele.get("max_frames"),
    )
    if expect is None:
        with pytest.raises(MediaError) as err:
            qwen2_nframes(total, video_fps, **kwargs)
        assert err.value.code in ("invalid_option", "too_few_frames")
    else:
        assert qwen2_nframes(total, video_fps, **kwargs) == expect


def test_frame_range_hand_cases() -> None:
    assert frame_range(100, 10) == (0, 99, 100)
    assert frame_range(100, 10, 2.0, 5.0) == (20, 50, 31)
    assert frame_range(100, 10, 2.05, None) == (21, 99, 79)  # ceil(20.5)
    assert frame_range(100, 10, None, 5.09) == (0, 50, 51)  # floor(50.9)
    assert frame_range(100, 10, 0.0, 99.0) == (0, 99, 100)  # clamped to the clip
    for start, end in ((11.0, None), (5.0, 5.05)):
        with pytest.raises(MediaError) as err:
            frame_range(100, 10, start, end)
        assert err.value.code == "invalid_option"


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(2, 5000),
    video_fps=st.sampled_from([10.0, 24.0, 29.97, 30.0]),
    start=st.one_of(st.none(), st.floats(0, 200)),
    end=st.one_of(st.none(), st.floats(0, 200)),
)
def test_range_and_indices_match_reference(total, video_fps, start, end) -> None:
    ele = {k: v for k, v in (("video_start", start), ("video_end", end)) if v is not None}
    try:
        expect: list[int] | None = ref_qvu_indices(ele, total, video_fps)
    except ValueError:
        expect = None
    try:
        plan = plan_sampling(QWEN2, total, video_fps, VideoOptions(video_start=start, video_end=end))
    except MediaError as err:
        assert expect is None, err
        assert err.code in ("invalid_option", "too_few_frames")
    else:
        assert plan.indices.tolist() == expect


def test_range_hand_case() -> None:
    # 10 s at 10 fps, 2 s .. 5 s: frames 20..50 (31 frames) -> 6 frames, evenly spaced.
    plan = plan_sampling(QWEN2, 100, 10.0, VideoOptions(video_start=2.0, video_end=5.0))
    assert plan.indices.tolist() == [20, 26, 32, 38, 44, 50]
    assert plan.sample_fps == pytest.approx(6 / 31 * 10)


def test_qwen2_pixel_bounds_hand_cases() -> None:
    total = 24576 * 28 * 28  # an explicit total_pixels (the early qwen-vl-utils default)
    assert qwen2_frame_pixel_bounds(60, min_pixels=100352, frame_max_pixels=602112, total_pixels=total) == (
        100352,
        602112,  # 19267584 / 60 * 2 = 642252.8 is above the 768-token cap
    )
    # 768 frames: the share (50176) falls below 1.05 * min_pixels = 105369.6 -> int -> 105369.
    assert (
        qwen2_frame_pixel_bounds(768, min_pixels=100352, frame_max_pixels=602112, total_pixels=total)[1]
        == 105369
    )
    assert qwen2_frame_pixel_bounds(
        100, min_pixels=100352, frame_max_pixels=602112, total_pixels=total, max_pixels=200000
    ) == (100352, 200000)
    # A requested max_pixels only lowers the bound.
    assert qwen2_frame_pixel_bounds(
        100, min_pixels=100352, frame_max_pixels=602112, total_pixels=total, max_pixels=10**9
    )[1] == pytest.approx(total / 100 * 2)


@settings(max_examples=200, deadline=None)
@given(
    nframes=st.integers(2, 768),
    min_pixels=st.one_of(st.none(), st.integers(1, 10**6)),
    max_pixels=st.one_of(st.none(), st.integers(1, 10**7)),
    total_pixels=st.one_of(st.none(), st.integers(1, 10**9)),
)
def test_qwen2_pixel_bounds_match_reference(nframes, min_pixels, max_pixels, total_pixels) -> None:
    ele = {
        k: v
        for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels), ("total_pixels", total_pixels))
        if v is not None
    }
    total_default = 24576 * 28 * 28  # stands in for the config default; both sides get the same value
    expect = ref_qvu_max_pixels(ele, nframes, 28, total_default)
    _, got = qwen2_frame_pixel_bounds(
        nframes,
        min_pixels=ele.get("min_pixels", 128 * 28 * 28),
        frame_max_pixels=768 * 28 * 28,
        total_pixels=ele.get("total_pixels", total_default),
        max_pixels=ele.get("max_pixels"),
    )
    assert got == expect


# -- Qwen3-VL (transformers) ----------------------------------------------------------------------


def test_qwen3_sampling_hand_cases() -> None:
    # 45 frames at 10 fps: int(4.5 * 2) = 9 frames; 5.5, 16.5, 27.5, 38.5 round half to even.
    assert ref_qwen3_indices(45, 10.0) == [0, 6, 11, 16, 22, 28, 33, 38, 44]
    assert plan_sampling(QWEN3, 45, 10.0).indices.tolist() == [0, 6, 11, 16, 22, 28, 33, 38, 44]
    assert qwen3_num_frames(3, 10.0) == 3  # min_frames 4, capped by the 3 frames there are
    assert qwen3_num_frames(100000, 30.0) == 768
    assert qwen3_num_frames(100, 10.0, num_frames=5) == 5  # no rounding to the temporal factor
    assert qwen3_smart_resize(9, 240, 320, factor=32, min_pixels=4096, max_pixels=602112) == (224, 288)


@needs_hf_qwen3
@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(2, 50_000),
    video_fps=st.sampled_from([5.0, 24.0, 25.0, 29.97, 30.0, 60.0]),
    fps=st.floats(0.1, 8),
    num_frames=st.one_of(st.none(), st.integers(2, 800)),
)
def test_qwen3_sampling_matches_transformers(total, video_fps, fps, num_frames) -> None:
    class Defaults:  # the processor's class defaults, without building one
        fps, min_frames, max_frames = 2, 4, 768

    metadata = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
    if num_frames is None:
        expect = Qwen3VLVideoProcessor.sample_frames(Defaults(), metadata, fps=fps)
    else:
        expect = Qwen3VLVideoProcessor.sample_frames(Defaults(), metadata, num_frames=num_frames)
    assert ref_qwen3_indices(total, video_fps, fps, num_frames) == expect.tolist()
    plan = plan_sampling(QWEN3, total, video_fps, VideoOptions(fps=None if num_frames else fps, nframes=num_frames))
    assert plan.indices.tolist() == expect.tolist()


@needs_hf_qwen3
@settings(max_examples=400, deadline=None)
@given(
    num_frames=st.integers(2, 800),
    height=st.integers(8, 3000),
    width=st.integers(8, 3000),
    factor=st.sampled_from([28, 32]),
    min_pixels=st.integers(1, 10**6),
    max_pixels=st.integers(10**5, 10**9),
)
def test_qwen3_smart_resize_matches_transformers(
    num_frames, height, width, factor, min_pixels, max_pixels
) -> None:
    try:
        expect: tuple[int, int] | None = hf_qwen3_smart_resize(
            num_frames,
            height,
            width,
            temporal_factor=2,
            factor=factor,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
    except ValueError:
        expect = None
    try:
        got = qwen3_smart_resize(
            num_frames,
            height,
            width,
            temporal_factor=2,
            factor=factor,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
    except MediaError as err:
        assert expect is None and err.code == "aspect_ratio"
    else:
        assert got == expect


def test_qwen3_per_frame_cap() -> None:
    # transformers Qwen3VLVideoProcessor.resize with cap_pixels_per_frame=True, factor 32:
    # per frame max(min(768*32*32, longest // T), int(shortest * 1.05)), times T.
    assert qwen3_max_pixels(
        10, factor=32, min_pixels=4096, max_pixels=25165824, cap_pixels_per_frame=True
    ) == (786432 * 10)
    assert qwen3_max_pixels(
        100, factor=32, min_pixels=4096, max_pixels=25165824, cap_pixels_per_frame=True
    ) == (251658 * 100)
    assert qwen3_max_pixels(
        100, factor=32, min_pixels=4096, max_pixels=25165824, cap_pixels_per_frame=False
    ) == (25165824)


# -- layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "m", "tps", "frames", "h", "w"), [(14, 2, 2, 4, 56, 84), (16, 2, 2, 2, 64, 32)]
)
def test_patch_layout_matches_reference(p: int, m: int, tps: int, frames: int, h: int, w: int) -> None:
    rng = np.random.default_rng(0)
    video = rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
    ours = patchify_video(video, p, m, tps)
    expect = ref_layout(video.transpose(0, 3, 1, 2), p, m, tps)
    np.testing.assert_array_equal(ours.astype(np.float64), expect)
    if HAVE_HF_QWEN3:  # the real transformers patchify (torch view/permute), same layout for every family
        hf, gt, gh, gw = Qwen3VLVideoProcessor.patchify(
            None, torch.from_numpy(video.transpose(0, 3, 1, 2).astype(np.float32))[None], p, m, tps
        )
        np.testing.assert_array_equal(ours.astype(np.float32), hf[0].numpy())
        assert (gt, gh, gw) == (frames // tps, h // p, w // p)


# -- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip() -> bytes:
    """2.3 s at 10 fps, 96x72, H.264 with B-frames: 23 frames, an odd count."""
    return make_video(23, fps=10, width=96, height=72, codec="libx264")


def expected_pixels(
    data: bytes, indices: list[int], size: tuple[int, int], cfg: ProcessorConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The plain pipeline: straight decode, pick frames, PIL bicubic resize, reference layout."""
    frames, times = decode_all(data)
    h, w = size
    picked = []
    for i in indices:
        image = Image.fromarray(frames[i])
        if image.size != (w, h):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        picked.append(np.asarray(image))
    video = np.stack(picked).transpose(0, 3, 1, 2)
    layout = ref_layout(video, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return layout.astype(np.uint8), times[indices]


@pytest.mark.parametrize("cfg", [QWEN2, QWEN25], ids=["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_end_to_end(clip: bytes, cfg: ProcessorConfig) -> None:
    out = preprocess_video_bytes(clip, cfg)
    ele: dict[str, Any] = {}
    indices = ref_qvu_indices(ele, 23, 10.0)
    assert indices == [0, 7, 15, 22]  # 2.3 s * 2 = 4.6 -> 4 frames
    max_pixels = ref_qvu_max_pixels(ele, len(indices), 28, cfg.video.total_pixels)
    size = smart_resize(72, 96, 28, 128 * 28 * 28, max_pixels)  # type: ignore[arg-type]
    pixels, times = expected_pixels(clip, indices, size, cfg)
    assert out.modality == "video" and out.pixels.dtype == np.uint8
    np.testing.assert_array_equal(out.pixels, pixels)
    assert out.grid_thw == (2, size[0] // 14, size[1] // 14)
    assert out.pixels.shape == (out.num_patches, cfg.patch_dim)
    back = unpatchify(out.pixels, out.grid_thw, 14, 2, 2)
    assert [read_index(f) for f in back] == indices
    meta = out.meta
    assert meta["frames"] == 4 and meta["frame_indices"] == indices
    np.testing.assert_allclose(meta["timestamps"], times)
    assert meta["fps"] == pytest.approx(4 / 23 * 10)  # qwen-vl-utils sample_fps
    assert meta["second_per_grid_ts"] == pytest.approx(2 / (4 / 23 * 10))
    assert meta["orig_size"] == (72, 96)


def test_qwen25_options_end_to_end(clip: bytes) -> None:
    ele = {"nframes": 6, "video_start": 0.35, "video_end": 2.0, "min_pixels": 784, "max_pixels": 30000}
    out = preprocess_video_bytes(
        clip, QWEN25, nframes=6, video_start=0.35, video_end=2.0, min_pixels=784, max_pixels=30000
    )
    indices = ref_qvu_indices(ele, 23, 10.0)
    assert indices == [4, 7, 10, 14, 17, 20]  # frames 4..20, 17 in range
    max_pixels = ref_qvu_max_pixels(ele, 6, 28, QWEN25.video.total_pixels)
    assert max_pixels == 30000
    size = smart_resize(72, 96, 28, 784, max_pixels)  # type: ignore[arg-type]
    pixels, _ = expected_pixels(clip, indices, size, QWEN25)
    np.testing.assert_array_equal(out.pixels, pixels)
    assert [read_index(f) for f in unpatchify(out.pixels, out.grid_thw, 14, 2, 2)] == indices


@needs_hf_qwen3
@pytest.mark.parametrize(("fps", "nframes"), [(2.6, None), (None, 5)])
def test_qwen3_end_to_end_odd_count(clip: bytes, fps: float | None, nframes: int | None) -> None:
    out = preprocess_video_bytes(clip, QWEN3, fps=fps, nframes=nframes)

    class Defaults:
        fps, min_frames, max_frames = 2, 4, 768

    metadata = VideoMetadata(total_num_frames=23, fps=10.0, duration=2.3)
    if nframes is None:
        indices = Qwen3VLVideoProcessor.sample_frames(Defaults(), metadata, fps=fps).tolist()
    else:
        indices = Qwen3VLVideoProcessor.sample_frames(Defaults(), metadata, num_frames=nframes).tolist()
    assert indices == ref_qwen3_indices(23, 10.0, fps or 2, nframes)
    assert len(indices) % 2 == 1  # odd: the last frame is repeated
    size = hf_qwen3_smart_resize(
        len(indices), 72, 96, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=4194304
    )
    pixels, times = expected_pixels(clip, indices, size, QWEN3)
    np.testing.assert_array_equal(out.pixels, pixels)
    t = (len(indices) + 1) // 2
    assert out.grid_thw == (t, size[0] // 16, size[1] // 16)
    back = [read_index(f) for f in unpatchify(out.pixels, out.grid_thw, 16, 2, 2)]
    assert back == indices + indices[-1:]
    assert out.meta["frames"] == len(indices) + 1 and out.meta["sampled_frames"] == len(indices)
    np.testing.assert_allclose(out.meta["timestamps"], list(times) + [times[-1]])


def test_workers_do_not_change_pixels(clip: bytes) -> None:
    one = preprocess_video_bytes(clip, QWEN2, nframes=12, workers=1)
    many = preprocess_video_bytes(clip, QWEN2, nframes=12, workers=3)
    np.testing.assert_array_equal(one.pixels, many.pixels)


def test_total_pixels_shrinks_frames(clip: bytes) -> None:
    big = preprocess_video_bytes(clip, QWEN2)
    small = preprocess_video_bytes(clip, QWEN2, total_pixels=4 * 20000 // 2, min_pixels=784)
    # 4 frames share 40000 pixels * FRAME_FACTOR: at most 20000 per frame.
    h, w = small.meta["resized"]
    assert h * w <= 20000 and small.num_patches < big.num_patches


def test_rotated_video_is_upright(clip: bytes) -> None:
    data = make_video(8, fps=10, width=96, height=72, codec="libx264", rotation=-90)
    out = preprocess_video_bytes(data, QWEN2)
    assert out.meta["orig_size"] == (96, 72)
    frames = unpatchify(out.pixels, out.grid_thw, 14, 2, 2)
    # Rotated back counter-clockwise, the pattern reads the sampled indices.
    assert [read_index(np.rot90(f, 1)) for f in frames] == out.meta["frame_indices"]


def test_variable_frame_rate_timestamps() -> None:
    pts = [0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1500, 2500, 3500, 3600, 3700]
    data = make_video(len(pts), pts=pts, time_base=Fraction(1, 1000), codec="libx264", container="matroska")
    out = preprocess_video_bytes(data, QWEN2, nframes=6)
    frames = unpatchify(out.pixels, out.grid_thw, 14, 2, 2)
    shown = [read_index(f) for f in frames]
    np.testing.assert_allclose(out.meta["timestamps"], np.asarray(pts)[shown] / 1000)
    # Indices 0, 3, 6, 8, 11, 14 of 15 map to times on the 3.8 s timeline, not to frame numbers.
    assert out.meta["frame_indices"] == [0, 3, 6, 8, 11, 14]
    step = 3.8 / 15
    expect = [
        int(np.searchsorted(np.asarray(pts) / 1000, i * step + 1e-3, side="right") - 1)
        for i in [0, 3, 6, 8, 11, 14]
    ]
    assert shown == expect


# -- bad options and bad videos -------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"fps": 0},
        {"fps": -1.0},
        {"fps": float("nan")},
        {"fps": 2.0, "nframes": 4},
        {"nframes": 1},
        {"nframes": 2.5},
        {"nframes": True},
        {"min_frames": 0},
        {"max_frames": 0},
        {"min_frames": 10, "max_frames": 4},
        {"video_start": -1.0},
        {"video_start": 2.0, "video_end": 1.0},
        {"video_start": 1.0, "video_end": 1.0},
        {"video_start": 50.0},
        {"min_pixels": 0},
        {"max_pixels": -5},
        {"min_pixels": 5000, "max_pixels": 4000},
        {"total_pixels": 0},
        {"max_frame_pixels": 0},
        {"nframes": 24},  # more than the 23 frames there are (qwen-vl-utils refuses)
    ],
)
def test_invalid_options(clip: bytes, options: dict[str, Any]) -> None:
    with pytest.raises(MediaError) as err:
        preprocess_video_bytes(clip, QWEN2, **options)
    assert err.value.code == "invalid_option", err.value


def test_single_frame_video() -> None:
    data = make_video(1, codec="libx264")
    for cfg in (QWEN2, QWEN3):
        with pytest.raises(MediaError) as err:
            preprocess_video_bytes(data, cfg)
        assert err.value.code == "too_few_frames"


def test_bad_bytes_are_media_errors() -> None:
    for data, code in ((b"", "empty"), (b"not a video", "unsupported_format")):
        with pytest.raises(MediaError) as err:
            preprocess_video_bytes(data, QWEN2)
        assert err.value.code == code


@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize(
    ("options", "adjusted_by"),
    [
        ({"fps": 0.5}, "min_frames"),  # 1.15 frames for 2.3 s, raised to min_frames = 4
        ({"fps": 2.0}, None),  # 4.6 -> 4: rounding only
        ({"fps": 4.0, "max_frames": 6}, "max_frames"),  # 9.2 frames, lowered to 6
        ({"fps": 30.0}, "frame_count"),  # 69 frames wanted, the clip has 23
        ({"nframes": 6}, None),  # no fps asked
    ],
)
def test_fps_adjustment_is_reported(clip: bytes, cfg: ProcessorConfig, options: dict[str, Any],
                                    adjusted_by: str | None) -> None:
    meta = preprocess_video_bytes(clip, cfg, **options).meta
    assert meta["requested_fps"] == options.get("fps")
    assert meta["fps_adjusted"] is (adjusted_by is not None)
    assert meta["fps_adjusted_by"] == adjusted_by
    if adjusted_by == "min_frames":
        assert meta["fps"] > options["fps"]  # the effective rate the response reports is higher
    elif adjusted_by is not None:
        assert meta["fps"] < options["fps"]
    assert meta["second_per_grid_ts"] == pytest.approx(2 / meta["fps"])


def test_config_fps_is_the_requested_fps(clip: bytes) -> None:
    meta = preprocess_video_bytes(clip, QWEN2).meta
    assert meta["requested_fps"] == QWEN2.video.fps and meta["fps_adjusted"] is False
