"""Kimi-K2.x and Muse preprocessing against their own processors' code in transformers 5.24.

Those processors import torchvision, which this CPU machine lacks (the index's wheel is a CUDA build), so
their modules are imported with a stand-in for the `torchvision` import line only, and what is compared
is their own code: Kimi's `navit_resize`, `Kimi_K25ImageProcessor.patchify` and
`Kimi_K25VideoProcessor.patchify` (chunks of 4 frames), Muse's `smart_resize`,
`MuseGlimmerImageProcessor.patchify`, `MuseGlimmerVideoProcessor.patchify` and `.sample_frames`, and
`BaseVideoProcessor`'s default frame spread. The resize between sizing and patchify is the op
torchvision's tensor path runs for Kimi on the CPU (torch's uint8 antialiased bicubic, then a zero pad on
the right and bottom, `TorchvisionBackend.pad`), and PIL's Lanczos for Muse (what Muse's reference and
vLLM's processors use; transformers' torchvision >= 0.27 Lanczos is not importable here). Rescale and
normalise are the processors' (x / 255 - mean) / std on the same uint8 values.
"""

from __future__ import annotations

import enum
import importlib
import io
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from models import load_tower
from models.metadata import block_order_positions
from service.media.image_preprocess import preprocess_image_bytes
from service.media.navit_sizing import kimi_frame_indices, muse_frame_indices
from service.media.video_preprocess import preprocess_video_bytes
from tests.videos import decode_all, make_video


def _import_without_torchvision():
    import transformers  # noqa: F401  (finds torchvision absent before the stand-in exists)

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    functional = sys.modules[names[-1]]
    sys.modules[names[2]].functional = functional  # type: ignore[attr-defined]
    functional.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC LANCZOS")  # annotations
    try:
        # the modules themselves, not the package's lazy names (which check for torchvision when used)
        modules = [importlib.import_module(f"transformers.models.{m}") for m in (
            "kimi_k25.image_processing_kimi_k25", "kimi_k25.video_processing_kimi_k25",
            "muse_glimmer.image_processing_muse_glimmer", "muse_glimmer.video_processing_muse_glimmer")]
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module
    return modules


KIMI_IMAGE, KIMI_VIDEO, MUSE_IMAGE, MUSE_VIDEO = _import_without_torchvision()
# (height, width): tiny, odd, wide, tall, and beyond each tiny preset's caps
SIZES = [(20, 30), (97, 211), (300, 500), (640, 180), (1200, 900), (14, 700)]


def png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = 128 + 100 * np.sin(x[..., None] / 17.0 + y[..., None] / 29.0 + np.arange(3))
    return np.clip(smooth + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)


def ours_raster(tower, pixels: np.ndarray, grid) -> torch.Tensor:
    """Our normalised rows in raster order per frame, columns (channel, temporal, pixels)."""
    x = torch.from_numpy(tower.processor.normalize(pixels))
    t, h, w = grid
    pos = block_order_positions(h, w, tower.merge)
    raster = torch.from_numpy(pos[:, 0] * w + pos[:, 1])
    out = torch.empty_like(x)
    for f in range(t):
        out[f * h * w + raster] = x[f * h * w : (f + 1) * h * w]
    return out


def normalised(frames: torch.Tensor) -> torch.Tensor:
    """The processors' rescale and normalise (mean = std = 0.5) of uint8 [..., 3, H, W]."""
    return (frames.float() * (1 / 255) - 0.5) / 0.5


def kimi_reference_frames(rgb: np.ndarray, tower, video: bool) -> torch.Tensor:
    cfg = tower.processor
    max_pixels = cfg.video.max_pixels if video else cfg.max_pixels
    (h, w), (ph, pw) = KIMI_IMAGE.navit_resize(rgb.shape[0], rgb.shape[1], patch_size=14, merge_kernel_size=2,
                                               max_patches=max_pixels // 196, max_size_per_side=512)
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None].contiguous()
    if (h, w) != rgb.shape[:2]:
        x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    return F.pad(x, (0, pw - w, 0, ph - h))[0]


@pytest.mark.parametrize("size", SIZES)
def test_kimi_image_equals_its_processor(size):
    tower = load_tower("tiny-kimi-k2.5", device="cpu", dtype="float32")
    rgb = picture(*size)
    item = preprocess_image_bytes(png(rgb), tower.processor)
    frame = kimi_reference_frames(rgb, tower, video=False)
    patches, gh, gw = KIMI_IMAGE.Kimi_K25ImageProcessor.patchify(None, normalised(frame)[None], 14)
    assert item.grid_thw == (1, gh, gw)
    assert torch.allclose(ours_raster(tower, item.pixels, item.grid_thw), patches.reshape(gh * gw, -1), atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
def test_muse_image_sizing_and_layout_equal_its_processor(size):
    tower = load_tower("tiny-muse-glimmer", device="cpu", dtype="float32")
    rgb = picture(*size, seed=1)
    item = preprocess_image_bytes(png(rgb), tower.processor)
    h, w = MUSE_IMAGE.smart_resize(size[0], size[1], patch_size=28, max_tokens=tower.processor.max_pixels // 784)
    resized = np.array(Image.fromarray(rgb).resize((w, h), Image.Resampling.LANCZOS))  # writable, as torch wants
    frame = normalised(torch.from_numpy(resized).permute(2, 0, 1))[None]
    patches, gh, gw = MUSE_IMAGE.MuseGlimmerImageProcessor.patchify(None, frame, 14, 2)
    assert item.grid_thw == (1, gh, gw) == (1, h // 14, w // 14)
    ours = ours_raster(tower, item.pixels, item.grid_thw).view(-1, 3, 2, 196).transpose(1, 2).reshape(gh * gw, -1)
    assert torch.allclose(ours, patches[0], atol=1e-6)


def test_muse_sizing_agrees_over_many_shapes():
    from service.media.navit_sizing import kimi_size, muse_size

    rng = np.random.default_rng(3)
    for h, w in rng.integers(1, 3000, (400, 2)):
        assert muse_size(int(h), int(w), 28, 144) == MUSE_IMAGE.smart_resize(int(h), int(w), 28, 144)
        assert kimi_size(int(h), int(w), 14, 2, 4096, 512) == KIMI_IMAGE.navit_resize(int(h), int(w), 14, 2,
                                                                                       4096, 512)


def test_frame_sampling_equals_the_processors():
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    muse = MUSE_VIDEO.MuseGlimmerVideoProcessor.__new__(MUSE_VIDEO.MuseGlimmerVideoProcessor)
    muse.fps, muse.num_frames = 2.0, 96
    for count, fps in [(30, 10), (301, 29.97), (17, 24), (1000, 25), (3, 30), (90, 2)]:
        meta = VideoMetadata(total_num_frames=count, fps=fps)
        assert kimi_frame_indices(count, fps, 2, None).tolist() == default_sample_indices_fn(meta, fps=2).tolist()
        expected = muse.sample_frames(meta, temporal_patch_size=2)
        assert muse_frame_indices(count, fps, 2.0, 96, 2).tolist() == expected.tolist()


@pytest.mark.parametrize("name", ["tiny-kimi-k2.5", "tiny-muse-glimmer"])
def test_video_equals_its_processor(name):
    """Frames decoded from a real H.264 clip, sampled, sized and patchified as the family's video processor
    does: Kimi in chunks of 4 frames (grids (n, h, w) with n <= 4, tokens counted per chunk), Muse in
    temporal patches of 2 frames (the last repeated to an even count)."""
    tower = load_tower(name, device="cpu", dtype="float32")
    data = make_video(23, fps=10, width=200, height=150, codec="libx264")
    item = preprocess_video_bytes(data, tower.processor)
    frames = decode_all(data)[0][item.meta["frame_indices"]]  # uint8 [n, H, W, 3]
    if name == "tiny-kimi-k2.5":
        video = torch.stack([kimi_reference_frames(f, tower, video=True) for f in frames])
        chunks = [normalised(video[s : s + 4])[None] for s in range(0, len(video), 4)]
        parts = [KIMI_VIDEO.Kimi_K25VideoProcessor.patchify(None, c, 14) for c in chunks]
        expected = torch.cat([p[0].reshape(-1, 3 * 196) for p in parts])
        grids = [(p[1], p[2], p[3]) for p in parts]
        assert item.grid_thw == (len(frames), grids[0][1], grids[0][2])
        assert tower.geometry.tokens(item.grid_thw, "video") == sum(h * w // 4 for _, h, w in grids)
        assert tower.geometry.segment_lengths(item.grid_thw) == [t * h * w for t, h, w in grids]
        assert torch.allclose(ours_raster(tower, item.pixels, item.grid_thw), expected, atol=1e-6)
    else:
        h, w = MUSE_VIDEO.smart_resize(150, 200, patch_size=28, max_tokens=tower.processor.video.max_pixels // 784)
        resized = [np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.LANCZOS)) for f in frames]
        video = normalised(torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2))[None]
        patches, gt, gh, gw = MUSE_VIDEO.MuseGlimmerVideoProcessor.patchify(None, video, 14, 2)
        assert item.grid_thw == (gt, gh, gw)
        ours = ours_raster(tower, item.pixels, item.grid_thw).view(-1, 3, 2, 196).transpose(1, 2)
        assert torch.allclose(ours.reshape(len(ours), -1), patches[0], atol=1e-6)
