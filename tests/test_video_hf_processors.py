"""Video pixels against transformers' own video processors (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor).

tests/test_video_preprocess.py checks sampling, sizes, padding and layout exactly against transcribed
references; this file feeds the frames our pipeline sampled to the real processors and compares the
final `pixel_values_videos`:

* no resize (the frame size is already a multiple of patch*merge within the pixel bounds): our uint8
  patches, normalised as the tower does on the device (`models.layers.Normalize`), equal the
  processor's to float32 rounding, and `video_grid_thw` equals our grid_thw;
* resize: the processor resizes the original frames itself (torchvision bicubic + antialias on
  tensors; we use PIL bicubic on uint8, docs/video.md), to the same size; the difference is measured
  in 0..255 levels, bounded, and printed (`pytest -s`).

Both processors import torchvision, which only the GPU machine has; elsewhere the module is skipped.
Run there with `python3 -m pytest -s tests/test_video_hf_processors.py`.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torchvision",
    reason="transformers' video processors need torchvision: these run on the GPU machine, where it exists",
)

from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import av  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor  # noqa: E402
from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize as hf_qwen2_smart_resize  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_qwen3_smart_resize  # noqa: E402

from models.config import ProcessorConfig, VisualInput  # noqa: E402
from models.layers import Normalize  # noqa: E402
from service.media.rules import video_sampling  # noqa: E402
from service.media.video_preprocess import preprocess_video_bytes  # noqa: E402
from tests.videos import QWEN2, QWEN3, QWEN25, decode_all, make_video  # noqa: E402

av.logging.set_level(av.logging.ERROR)

CONFIGS = {"qwen2_vl": QWEN2, "qwen2_5_vl": QWEN25, "qwen3_vl": QWEN3,
           # families that sample like these: the same configs under their own model_type
           "qwen3_5": replace(QWEN3, family="qwen3_5"), "exaone4_5": replace(QWEN2, family="exaone4_5"),
           "qwen3_omni_moe": replace(QWEN3, family="qwen3_omni_moe")}

# Resize bounds, in 0..255 levels. docs/video.md measured PIL against torch's float antialiased bicubic
# at mean 0.13, max 9 on a real 1280x720 clip with sharp edges; these clips are smooth. Measured here on
# the GPU machine (torch 2.11, torchvision 0.26, transformers 5.17): on CPU torchvision resizes uint8
# natively (fixed point, like PIL): mean <= 0.008, max 2; on CUDA it resizes in float32, then clamps and
# rounds: mean <= 0.21, max 1.
MAX_MEAN_LEVELS = 1.0
MAX_ABS_LEVELS = 8.0

CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the processor's CUDA resize needs a GPU")
)


def colour_field(index: int, width: int, height: int) -> np.ndarray:
    """Smooth RGB content, different in every channel and every frame (so frame choice and channel
    order show), with no sharp edges (so the resize comparison measures interpolation, not clamping)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 128 + 90 * np.sin(2 * np.pi * (x / width * 1.5 + index / 10))
    g = 128 + 90 * np.cos(2 * np.pi * (y / height * 1.2 - index / 13))
    b = 128 + 60 * np.sin(2 * np.pi * ((x + y) / (width + height) * 2 + index / 7))
    return np.clip(np.stack([r, g, b], axis=-1).round(), 0, 255).astype(np.uint8)


def make_clip(width: int, height: int, n_frames: int = 12) -> bytes:
    """1.2 s at 10 fps, H.264 (B-frames), smooth colour content."""
    return make_video(n_frames, fps=10, width=width, height=height, codec="libx264", frame_fn=colour_field)


def sampled_frames(data: bytes, out: VisualInput) -> torch.Tensor:
    """The frames our pipeline sampled, decoded straight through: uint8 [T, C, H, W], unresized and
    unpadded, as a video processor takes them with do_sample_frames=False."""
    frames, _ = decode_all(data)
    picked = frames[np.asarray(out.meta["frame_indices"])]
    assert len(picked) == out.meta["sampled_frames"]
    return torch.from_numpy(np.ascontiguousarray(picked.transpose(0, 3, 1, 2)))


def server_normalised(out: VisualInput, cfg: ProcessorConfig) -> np.ndarray:
    """Our uint8 patches normalised as the tower does (float32 (x * rescale - mean) / std)."""
    mean, std = cfg.channel_vectors()
    normalize = Normalize(torch.from_numpy(mean), torch.from_numpy(std), cfg.rescale_factor)
    with torch.no_grad():
        return normalize(torch.from_numpy(out.pixels)).numpy()


def run_processor(
    cfg: ProcessorConfig,
    video: torch.Tensor,
    *,
    do_resize: bool,
    size: dict[str, int],
    device: str = "cpu",
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """transformers' video processor of cfg.family on one uint8 [T, C, H, W] video, no frame sampling,
    with our config's normalisation and patch sizes: (pixel_values_videos, video_grid_thw)."""
    cls: Any = Qwen3VLVideoProcessor if video_sampling(cfg) == "qwen3" else Qwen2VLVideoProcessor
    processor = cls()
    result = processor(
        [video],
        do_sample_frames=False,
        do_resize=do_resize,
        size=dict(size),
        do_rescale=True,
        rescale_factor=cfg.rescale_factor,
        do_normalize=True,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        cap_pixels_per_frame=False,
        input_data_format="channels_first",
        device=device,
        return_tensors="pt",
    )
    pixels = result["pixel_values_videos"].detach().cpu().numpy()
    grid = result["video_grid_thw"].cpu().tolist()
    assert len(grid) == 1, grid
    return pixels, (int(grid[0][0]), int(grid[0][1]), int(grid[0][2]))


def hf_target_size(cfg: ProcessorConfig, frames: int, height: int, width: int, size: dict[str, int]) -> tuple[int, int]:
    """The size the processor's own smart_resize picks for these frames and bounds."""
    lo, hi = size["shortest_edge"], size["longest_edge"]
    if video_sampling(cfg) == "qwen3":
        tps = cfg.temporal_patch_size
        return hf_qwen3_smart_resize(
            frames, height, width, temporal_factor=tps, factor=cfg.factor, min_pixels=lo, max_pixels=hi
        )
    return hf_qwen2_smart_resize(height, width, factor=cfg.factor, min_pixels=lo, max_pixels=hi)


# -- no resize: exact ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "height", "width", "options", "size"),
    [
        # Qwen2-VL / 2.5-VL, factor 28: 56x84 stays 56x84 once min_pixels is below 56*84.
        ("qwen2_vl", 56, 84, {"min_pixels": 3136}, {"shortest_edge": 3136, "longest_edge": 602112}),
        ("qwen2_5_vl", 56, 84, {"min_pixels": 3136}, {"shortest_edge": 3136, "longest_edge": 602112}),
        # Qwen3-VL, factor 32: 64x96 stays within [4096, 4194304] for the whole clip.
        ("qwen3_vl", 64, 96, {}, {"shortest_edge": 4096, "longest_edge": 4194304}),
        # An odd frame count: both pad by repeating the last frame.
        ("qwen3_vl", 64, 96, {"nframes": 5}, {"shortest_edge": 4096, "longest_edge": 4194304}),
        # Families sampling by these rules (Qwen3-Omni: patch 16, but Qwen2-VL's video processor).
        ("qwen3_5", 64, 96, {}, {"shortest_edge": 4096, "longest_edge": 4194304}),
        ("exaone4_5", 56, 84, {"min_pixels": 3136}, {"shortest_edge": 3136, "longest_edge": 602112}),
        ("qwen3_omni_moe", 64, 96, {"min_pixels": 4096}, {"shortest_edge": 4096, "longest_edge": 602112}),
    ],
    ids=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl-odd", "qwen3_5", "exaone4_5", "qwen3_omni_moe"],
)
def test_pixels_equal_processor_without_resize(
    family: str, height: int, width: int, options: dict[str, Any], size: dict[str, int]
) -> None:
    cfg = CONFIGS[family]
    data = make_clip(width, height)
    out = preprocess_video_bytes(data, cfg, **options)
    assert out.meta["resized"] == (height, width)  # no resize on our side either
    video = sampled_frames(data, out)
    n = len(video)
    if "nframes" in options:
        assert n == options["nframes"] and n % 2 == 1
        assert out.meta["frames"] == n + 1
    assert hf_target_size(cfg, n, height, width, size) == (height, width)
    ours = server_normalised(out, cfg)
    for do_resize in (False, True):  # resizing to the same size is a no-op in torchvision too
        pixels, grid = run_processor(cfg, video, do_resize=do_resize, size=size)
        assert grid == out.grid_thw
        assert pixels.shape == ours.shape == (out.num_patches, cfg.patch_dim)
        diff = float(np.abs(pixels.astype(np.float64) - ours).max())
        print(f"\n{family} {height}x{width} T={n} do_resize={do_resize}: max |diff| {diff:.3g} (normalised)")
        assert diff <= 1e-5


def test_each_family_names_transformers_own_video_processor() -> None:
    """transformers' own mapping (complete where torchvision exists) against the families' rules."""
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    from models.families import FAMILIES

    rules = {"Qwen2VLVideoProcessor": "qwen2", "Qwen3VLVideoProcessor": "qwen3", "Glm4vVideoProcessor": "glm4v"}
    for name, family in FAMILIES.items():
        mapped = VIDEO_PROCESSOR_MAPPING_NAMES.get(name)
        if isinstance(mapped, dict):  # transformers 5.2x: per backend; earlier 5.x: the class name
            mapped = mapped.get("torchvision")
        if mapped in rules and family.video:
            assert rules[mapped] == family.video_sampling, (name, mapped)


# -- resize: bounded difference -----------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(
    ("family", "height", "width", "options", "size"),
    [
        # Downscale 72x96 -> 56x84 (max_pixels 6000 per frame).
        (
            "qwen2_vl",
            72,
            96,
            {"min_pixels": 3136, "max_pixels": 6000},
            {"shortest_edge": 3136, "longest_edge": 6000},
        ),
        # Upscale with the default bounds: 72x96 -> 280x392 (min_pixels 128 tokens).
        ("qwen2_vl", 72, 96, {}, {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}),
        # 72x96 -> 64x96 with 5 frames (odd: padded).
        ("qwen3_vl", 72, 96, {"nframes": 5}, {"shortest_edge": 4096, "longest_edge": 4194304}),
        # Downscale 96x128 -> 64x96: 5 frames share at most 40000 pixels.
        ("qwen3_vl", 96, 128, {"nframes": 5, "max_pixels": 40000}, {"shortest_edge": 4096, "longest_edge": 40000}),
    ],
    ids=["qwen2_vl-down", "qwen2_vl-up", "qwen3_vl-odd", "qwen3_vl-down"],
)
def test_pixels_close_to_processor_with_resize(
    family: str, height: int, width: int, options: dict[str, Any], size: dict[str, int], device: str
) -> None:
    cfg = CONFIGS[family]
    data = make_clip(width, height)
    out = preprocess_video_bytes(data, cfg, **options)
    resized = out.meta["resized"]
    assert resized != (height, width)
    video = sampled_frames(data, out)
    assert hf_target_size(cfg, len(video), height, width, size) == resized
    pixels, grid = run_processor(cfg, video, do_resize=True, size=size, device=device)
    assert grid == out.grid_thw
    assert pixels.shape == out.pixels.shape
    # Back to 0..255 levels: processor value * std / rescale + mean / rescale against our uint8.
    mean, std = cfg.channel_vectors()
    rescale = np.float64(cfg.rescale_factor)
    levels = pixels.astype(np.float64) * std / rescale + mean / rescale
    diff = np.abs(levels - out.pixels.astype(np.float64))
    mean_diff, max_diff = float(diff.mean()), float(diff.max())
    over_one = float((diff > 1.5).mean())
    print(
        f"\n{family} {height}x{width} -> {resized[0]}x{resized[1]} T={len(video)} resize on {device}: "
        f"PIL vs torchvision |diff| mean {mean_diff:.4f}, max {max_diff:.2f} levels, "
        f"{over_one:.2e} of values more than 1 apart"
    )
    assert mean_diff <= MAX_MEAN_LEVELS
    assert max_diff <= MAX_ABS_LEVELS


# -- GLM-4.1V: the processor samples too --------------------------------------------------------------

GLM_VIDEO = ProcessorConfig.from_dicts(
    "glm4v",
    {"size": {"shortest_edge": 12544, "longest_edge": 9633792}},
    {"size": {"shortest_edge": 12544, "longest_edge": 28 * 28 * 2 * 64}, "fps": 2},
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("fps", [2.0, 5.0, 30.0])
def test_glm_video_processor_picks_the_same_frames_grid_and_pixels(fps: float, device: str) -> None:
    """transformers' Glm4vVideoProcessor given the whole decoded clip and its metadata samples the frames
    itself: the same frames, the same grid, pixels within the resize bounds above."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    cfg = GLM_VIDEO
    data = make_clip(96, 72, n_frames=23)  # 2.3 s at 10 fps: an odd frame count
    out = preprocess_video_bytes(data, cfg, fps=fps)
    frames, _ = decode_all(data)
    video = torch.from_numpy(np.ascontiguousarray(frames.transpose(0, 3, 1, 2)))
    metadata = VideoMetadata(total_num_frames=len(frames), fps=10.0, duration=len(frames) / 10.0)
    result = Glm4vVideoProcessor()(
        [video], video_metadata=[metadata], do_sample_frames=True, fps=fps,
        size={"shortest_edge": cfg.video.min_pixels, "longest_edge": cfg.video.max_pixels},
        input_data_format="channels_first", device=device, return_tensors="pt", return_metadata=True,
    )
    assert result["video_metadata"][0].frames_indices.tolist() == out.meta["frame_indices"]
    assert tuple(int(v) for v in result["video_grid_thw"][0]) == out.grid_thw
    pixels = result["pixel_values_videos"].detach().cpu().numpy()
    assert pixels.shape == out.pixels.shape
    mean, std = cfg.channel_vectors()
    rescale = np.float64(cfg.rescale_factor)
    levels = pixels.astype(np.float64) * std / rescale + mean / rescale
    diff = np.abs(levels - out.pixels.astype(np.float64))
    print(f"\nglm4v fps {fps} on {device}: grid {out.grid_thw}, |diff| mean {diff.mean():.4f}, max {diff.max():.2f}")
    assert float(diff.mean()) <= MAX_MEAN_LEVELS and float(diff.max()) <= MAX_ABS_LEVELS
