"""Image preprocessing parity with transformers' Qwen2VLImageProcessorPil, layout and size rules."""

from __future__ import annotations

import io
import math
import warnings
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref_smart_resize

from models.config import ProcessorConfig
from service.media.errors import MediaError
from service.media.image_preprocess import patchify, preprocess_image, preprocess_image_bytes, smart_resize

# Real min_pixels, smaller max_pixels than the checkpoints so "beyond max_pixels" stays cheap.
QWEN2 = ProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
# Qwen3-VL's released preprocessor_config: patch 16, mean = std = 0.5, shortest_edge 65536.
QWEN3 = ProcessorConfig(
    family="qwen3_vl",
    patch_size=16,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    min_pixels=65536,
    max_pixels=32 * 32 * 256,
)
CONFIGS = {"qwen2_p14": QWEN2, "qwen3_p16": QWEN3}
TOL = 1e-5


@cache
def reference(
    cfg: ProcessorConfig, min_pixels: int | None = None, max_pixels: int | None = None, raw: bool = False
) -> Qwen2VLImageProcessorPil:
    # raw=True: no rescale/normalise, so the output is the resized uint8 values as float32.
    return Qwen2VLImageProcessorPil(
        do_rescale=not raw,
        do_normalize=not raw,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
        min_pixels=cfg.min_pixels if min_pixels is None else min_pixels,
        max_pixels=cfg.max_pixels if max_pixels is None else max_pixels,
    )


def run_reference(
    cfg: ProcessorConfig, image: Image.Image, raw: bool = False, **bounds: int
) -> tuple[np.ndarray, tuple]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = reference(cfg, bounds.get("min_pixels"), bounds.get("max_pixels"), raw)(image)
    return np.asarray(out["pixel_values"]), tuple(int(v) for v in out["image_grid_thw"][0])


def assert_parity(cfg: ProcessorConfig, ours, ref_pixels: np.ndarray, ref_grid: tuple) -> float:
    assert ours.grid_thw == ref_grid
    assert ours.pixels.dtype == np.uint8
    assert ours.pixels.shape == ref_pixels.shape == (math.prod(ref_grid), cfg.patch_dim)
    diff = float(np.abs(cfg.normalize(ours.pixels) - ref_pixels).max())
    assert diff <= TOL, diff
    return diff


def content(rng: np.random.Generator, height: int, width: int, channels: int) -> np.ndarray:
    """Noise (worst case for bicubic) or gradients with noise (photo-like), uint8 HWC."""
    if rng.random() < 0.5:
        return rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(yy * (c + 1) * 7 + xx * (3 - c) * 5) % 256 for c in range(channels)], -1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def random_size(rng: np.random.Generator, kind: str) -> tuple[int, int]:
    """(width, height) for a size class."""
    if kind == "tiny":
        return int(rng.integers(1, 9)), int(rng.integers(1, 9))
    if kind == "small":
        return int(rng.integers(9, 120)), int(rng.integers(9, 120))
    if kind == "medium":
        return int(rng.integers(120, 420)), int(rng.integers(120, 420))
    if kind == "large":  # beyond the test max_pixels
        return int(rng.integers(420, 900)), int(rng.integers(300, 900))
    short = int(rng.integers(1, 5))  # "thin": aspect ratio up to the 200 limit
    long = int(short * rng.uniform(150, 200))
    return (short, long) if rng.random() < 0.5 else (long, short)


def random_encoded_image(rng: np.random.Generator, mode: str, width: int, height: int) -> bytes:
    if mode in ("RGBA", "LA"):
        image = Image.fromarray(content(rng, height, width, 4), "RGBA").convert(mode)
    elif mode == "L":
        image = Image.fromarray(content(rng, height, width, 1)[..., 0], "L")
    else:
        image = Image.fromarray(content(rng, height, width, 3), "RGB")
        if mode in ("P", "P_trns"):
            image = image.quantize(64)
            if mode == "P_trns":
                image.info["transparency"] = 3
    out = io.BytesIO()
    # Lossy JPEG for some RGB images so the JPEG path is covered; PNG keeps every mode exact.
    fmt = "JPEG" if mode == "RGB" and rng.random() < 0.5 else "PNG"
    kwargs = {"transparency": image.info["transparency"]} if mode == "P_trns" else {}
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


MODES = ("RGB", "RGBA", "P", "P_trns", "LA", "L")
KINDS = ("tiny", "small", "medium", "large", "thin")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_random_images_from_bytes(name: str) -> None:
    """50 seeded images per patch size: bytes -> ours vs bytes -> PIL.open -> reference."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(1234 + cfg.patch_size)
    worst = 0.0
    seen_grids = set()
    for i in range(50):
        mode = MODES[i % len(MODES)]
        width, height = random_size(rng, KINDS[(i // len(MODES) + i) % len(KINDS)])
        data = random_encoded_image(rng, mode, width, height)
        ours = preprocess_image_bytes(data, cfg)
        ref_pixels, ref_grid = run_reference(cfg, Image.open(io.BytesIO(data)))
        worst = max(worst, assert_parity(cfg, ours, ref_pixels, ref_grid))
        assert ours.meta["orig_size"] == (height, width)
        if i % 3 == 0:  # stronger: the uint8 patches are bit-identical to the reference's resize
            raw_pixels, _ = run_reference(cfg, Image.open(io.BytesIO(data)), raw=True)
            np.testing.assert_array_equal(ours.pixels, raw_pixels)
        seen_grids.add(ref_grid)
    assert worst <= TOL
    assert len(seen_grids) > 20  # the sizes really varied


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "LA", "L", "P", "PA", "I;16", "CMYK", "1"])
def test_parity_pil_modes_direct(name: str, mode: str) -> None:
    """preprocess_image accepts any PIL mode and converts it exactly like the reference."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(content(rng, 97, 131, 4), "RGBA")
    image = rgba.convert(mode) if mode not in ("P", "PA") else rgba.convert("RGB").quantize(32)
    if mode == "PA":
        image = image.convert("PA")
    ref_pixels, ref_grid = run_reference(cfg, image)
    assert_parity(cfg, preprocess_image(image, cfg), ref_pixels, ref_grid)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    "bounds",
    [
        {"min_pixels": 28 * 28 * 4},
        {"max_pixels": 32 * 32 * 16},
        {"min_pixels": 200_000, "max_pixels": 400_000},  # min above the config's max
        {"max_pixels": 3000},  # max below the config's min (3136): both go to smart_resize, as sent
        {"min_pixels": 1, "max_pixels": 1},  # everything collapses to one merged token
        {"min_pixels": 1, "max_pixels": 10_000_000},
    ],
)
def test_per_item_pixel_bounds(name: str, bounds: dict[str, int]) -> None:
    cfg = CONFIGS[name]
    rng = np.random.default_rng(11)
    for width, height in [(37, 23), (300, 180), (640, 480)]:
        image = Image.fromarray(content(rng, height, width, 3), "RGB")
        ours = preprocess_image(image, cfg, **bounds)
        ref_pixels, ref_grid = run_reference(cfg, image, **bounds)
        assert_parity(cfg, ours, ref_pixels, ref_grid)
    # The override is per item: the config itself is unchanged.
    default = preprocess_image(image, cfg)
    ref_pixels, ref_grid = run_reference(cfg, image)
    assert_parity(cfg, default, ref_pixels, ref_grid)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("size", [(1, 1), (1, 2), (3, 1), (1, 200), (200, 1), (2, 400), (7, 1400), (4, 3)])
def test_tiny_and_extreme_aspect_match_reference(name: str, size: tuple[int, int]) -> None:
    """The reference upscales even a 1x1 image to min_pixels; ratio exactly 200 is allowed."""
    cfg = CONFIGS[name]
    image = Image.fromarray(content(np.random.default_rng(3), size[1], size[0], 3), "RGB")
    ref_pixels, ref_grid = run_reference(cfg, image)
    assert_parity(cfg, preprocess_image(image, cfg), ref_pixels, ref_grid)


@pytest.mark.parametrize("size", [(1, 201), (201, 1), (3, 700), (1000, 4)])
def test_aspect_ratio_above_200_is_refused_like_reference(size: tuple[int, int]) -> None:
    image = Image.new("RGB", size, (10, 20, 30))
    with pytest.raises(MediaError) as info:
        preprocess_image(image, QWEN2)
    assert info.value.code == "aspect_ratio"
    assert "aspect ratio" in info.value.reason and "200" in info.value.reason
    with pytest.raises(ValueError, match="aspect ratio"):
        run_reference(QWEN2, image)


def test_too_small() -> None:
    # min_pixels=0 turns off upscaling: a side that rounds to 0 cannot be patchified.
    with pytest.raises(MediaError) as info:
        preprocess_image(Image.new("RGB", (10, 10)), QWEN2, min_pixels=0)
    assert info.value.code == "too_small" and "too small" in info.value.reason
    with pytest.raises(MediaError) as info:
        preprocess_image(Image.new("RGB", (10, 300)), QWEN2, min_pixels=0)
    assert info.value.code == "too_small"
    with pytest.raises(MediaError) as info:
        preprocess_image(Image.new("RGB", (0, 0)), QWEN2)
    assert info.value.code == "too_small"
    # Big enough sides still work without upscaling.
    assert preprocess_image(Image.new("RGB", (20, 300)), QWEN2, min_pixels=0).meta["resized"] == (308, 28)


@pytest.mark.parametrize("bounds", [{"min_pixels": -1}, {"max_pixels": 0}, {"max_pixels": -5}])
def test_invalid_pixel_bounds(bounds: dict[str, int]) -> None:
    with pytest.raises(MediaError) as info:
        preprocess_image(Image.new("RGB", (64, 64)), QWEN2, **bounds)
    assert info.value.code == "invalid_pixel_bounds"


@settings(max_examples=400, deadline=None)
@given(
    height=st.integers(1, 20_000),
    width=st.integers(1, 20_000),
    factor=st.sampled_from([28, 32]),
    min_pixels=st.integers(1, 2_000_000),
    max_pixels=st.integers(1, 20_000_000),
)
def test_smart_resize_matches_reference(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> None:
    try:
        expected = ref_smart_resize(height, width, factor, min_pixels, max_pixels)
    except ValueError:
        with pytest.raises(MediaError) as info:
            smart_resize(height, width, factor, min_pixels, max_pixels)
        assert info.value.code == "aspect_ratio"
        return
    assert smart_resize(height, width, factor, min_pixels, max_pixels) == tuple(expected)


def test_smart_resize_known_values() -> None:
    assert smart_resize(1080, 1920, 28, 56 * 56, 28 * 28 * 1280) == (728, 1316)
    assert smart_resize(1, 1, 28, 56 * 56, 28 * 28 * 1280) == (56, 56)
    assert smart_resize(448, 448, 28, 56 * 56, 28 * 28 * 1280) == (448, 448)
    assert smart_resize(70, 42, 28) == (56, 56)  # round() is half-to-even: 2.5 -> 2, 1.5 -> 2
    assert smart_resize(1080, 1920, 32, 65536, 16777216) == (1088, 1920)


def test_layout_is_reference_row_order() -> None:
    """Independent check of the row order on an image that needs no resize."""
    cfg = QWEN2
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    rng = np.random.default_rng(5)
    arr = rng.integers(0, 256, (4 * p, 6 * p, 3), dtype=np.uint8)  # 56x84: already multiples of 28
    vi = preprocess_image(Image.fromarray(arr, "RGB"), cfg)
    assert vi.grid_thw == (1, 4, 6) and vi.meta["resized"] == (56, 84)
    assert vi.pixels.flags.c_contiguous
    rows = vi.pixels.reshape(-1, 3, t, p, p)
    k = 0
    for bh in range(4 // m):
        for bw in range(6 // m):
            for mh in range(m):
                for mw in range(m):
                    y, x = (bh * m + mh) * p, (bw * m + mw) * p
                    patch = arr[y : y + p, x : x + p].transpose(2, 0, 1)  # (C, P, P)
                    for tt in range(t):
                        np.testing.assert_array_equal(rows[k, :, tt], patch)
                    k += 1


def test_exact_size_is_not_resampled() -> None:
    arr = np.random.default_rng(9).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    image = Image.fromarray(arr, "RGB")
    vi = preprocess_image(image, ProcessorConfig())
    np.testing.assert_array_equal(vi.pixels, patchify(image, 14, 2, 2))
    assert vi.meta == {"orig_size": (448, 448), "resized": (448, 448)}
    assert vi.modality == "image" and vi.num_tokens(2) == 256


@pytest.mark.parametrize("temporal", [1, 2, 3])
def test_patchify_temporal_repeats(temporal: int) -> None:
    arr = np.random.default_rng(2).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    out = patchify(Image.fromarray(arr, "RGB"), 16, 2, temporal)
    assert out.shape == (4 * 6, 3 * temporal * 16 * 16)
    per_t = out.reshape(-1, 3, temporal, 256)
    for tt in range(1, temporal):
        np.testing.assert_array_equal(per_t[:, :, tt], per_t[:, :, 0])


def test_sample_asset_preprocesses() -> None:
    from pathlib import Path

    data = (Path(__file__).resolve().parents[1] / "service" / "assets" / "sample.jpg").read_bytes()
    assert len(data) < 60 * 1024
    vi = preprocess_image_bytes(data, ProcessorConfig())
    assert vi.meta["orig_size"] == (336, 448)
    ref_pixels, ref_grid = run_reference(ProcessorConfig(), Image.open(io.BytesIO(data)))
    assert_parity(ProcessorConfig(), vi, ref_pixels, ref_grid)
