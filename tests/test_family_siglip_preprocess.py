"""PaddleOCR-VL's and Cosmos3-Edge's preprocessing against their own transformers processors, on the CPU.

Images: `PaddleOCRVLImageProcessorPil` (its own `smart_resize`, rows row-major, (channel, row, col) values) and
`Cosmos3EdgeImageProcessorPil` (GLM's sizing, rows in merge blocks, (row, col, channel) values), built from the
preprocessor_config.json the server reads: the same grids, the same uint8 values before normalisation and the
same normalised pixels to float32 rounding.

Videos (Cosmos3-Edge): `Cosmos3EdgeVideoProcessor` imports torchvision, which CI lacks (the registry's wheel is a
CUDA build). Its module is loaded here with that one import left out; what runs without torchvision is its own:
`sample_frames`, `smart_resize`, and the whole processor call on frames already sampled and sized (resize,
RGB conversion and normalisation are torchvision's). Compared: the frame indices, the frame size, the grid and
every uint8 value of `pixel_values_videos` for frames resized as the server resizes them (PIL bicubic on
uint8, as for every family's videos: docs/video.md).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import sys
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from models.config import ProcessorConfig
from models.families import FAMILIES
from models.loader import processor_config_from_folder
from models.presets import PRESETS
from service.media.errors import MediaError
from service.media.image_preprocess import preprocess_image_bytes, upscaled_smart_resize
from service.media.video_preprocess import preprocess_video_bytes
from service.media.video_sampling import VideoOptions, plan_sampling
from tests.videos import decode_all, make_video

PRESET_OF = {"paddleocr_vl": "tiny-paddleocr-vl", "cosmos3_edge": "tiny-cosmos3-edge"}
# (width, height): non-square, sides below one merge block, an aspect ratio near the limit, already fitting.
SIZES = [(97, 143), (300, 500), (37, 810), (64, 64), (20, 300), (5, 5), (1000, 30), (112, 56)]


def image_bytes(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()


def processor_folder(family: str, tmp_path: Path) -> ProcessorConfig:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PRESETS[PRESET_OF[family]].preprocessor))
    return processor_config_from_folder(tmp_path, family)


@pytest.mark.parametrize("family", sorted(PRESET_OF))
def test_image_grids_and_pixels_equal_the_familys_processor(family: str, tmp_path) -> None:
    cfg = processor_folder(family, tmp_path)
    name = FAMILIES[family].image_processor + "Pil"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = getattr(transformers, name).from_pretrained(str(tmp_path))
        raw = getattr(transformers, name).from_pretrained(str(tmp_path), do_rescale=False, do_normalize=False)
    for seed, (width, height) in enumerate(SIZES):
        data = image_bytes(width, height, seed)
        ours = preprocess_image_bytes(data, cfg)
        out = reference(Image.open(io.BytesIO(data)), return_tensors="np")
        assert ours.grid_thw == tuple(int(v) for v in out["image_grid_thw"][0])
        pixels = np.asarray(out["pixel_values"]).reshape(len(ours.pixels), -1)  # PaddleOCR-VL's are [n, C, P, P]
        assert pixels.shape == ours.pixels.shape == (math.prod(ours.grid_thw), cfg.patch_dim)
        assert float(np.abs(cfg.normalize(ours.pixels) - pixels).max()) <= 1e-5
        values = np.asarray(raw(Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"])
        np.testing.assert_array_equal(ours.pixels, values.reshape(len(ours.pixels), -1))


def test_paddleocr_sizing_matches_transformers() -> None:
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import smart_resize

    rng = np.random.default_rng(0)
    sizes = [(int(rng.integers(1, 4000)), int(rng.integers(1, 4000))) for _ in range(300)]
    sizes += [(1, 1), (27, 28), (28, 27), (1, 200), (1, 201), (13, 2800), (2800, 13), (5, 900), (384, 384)]
    for lo, hi in [(384 * 384, 1536 * 1536), (3136, 401408), (1, 10**9), (147384, 2822400)]:
        for h, w in sizes:
            try:
                expect = smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)
            except ValueError:
                with pytest.raises(MediaError):
                    upscaled_smart_resize(h, w, 28, lo, hi)
                continue
            assert upscaled_smart_resize(h, w, 28, lo, hi) == expect, (h, w, lo, hi)


def test_family_processor_defaults_fill_what_a_config_leaves_out(tmp_path) -> None:
    """A preprocessor_config.json without patch, temporal or normalisation keys takes the processor class's
    defaults, not Qwen-VL's (PaddleOCR-VL and Cosmos3-Edge have one frame per patch)."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 401408}))
    paddle = processor_config_from_folder(tmp_path, "paddleocr_vl")
    cosmos = processor_config_from_folder(tmp_path, "cosmos3_edge")
    assert (paddle.patch_size, paddle.temporal_patch_size, paddle.patch_order, paddle.patch_layout) == (
        14, 1, "raster", "chw")
    assert (cosmos.patch_size, cosmos.temporal_patch_size, cosmos.image_mean, cosmos.patch_layout) == (
        16, 1, (0.5, 0.5, 0.5), "hwc")


def test_paddleocr_refuses_videos() -> None:
    cfg = ProcessorConfig.from_dicts("paddleocr_vl", PRESETS["tiny-paddleocr-vl"].preprocessor)
    with pytest.raises(MediaError) as err:
        preprocess_video_bytes(make_video(4, fps=2, width=64, height=64), cfg)
    assert err.value.code == "unsupported_format" and "images only" in err.value.reason


# ---- Cosmos3-Edge videos -----------------------------------------------------------------------


@cache
def cosmos_video_module():
    """transformers' video_processing_cosmos3_edge, loaded without its torchvision import (`tvF`, used only by
    the resize and normalisation this test leaves to the server)."""
    import transformers.models.cosmos3_edge as package

    path = Path(package.__file__).parent / "video_processing_cosmos3_edge.py"
    line = "from torchvision.transforms.v2 import functional as tvF"
    source = path.read_text()
    assert source.count(line) == 1
    name = "transformers.models.cosmos3_edge._video_processing_without_torchvision"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__, module.__file__ = "transformers.models.cosmos3_edge", str(path)
    sys.modules[name] = module
    exec(compile(source.replace(line, "tvF = None"), str(path), "exec"), module.__dict__)
    return module


def cosmos_video_config() -> ProcessorConfig:
    preset = PRESETS["tiny-cosmos3-edge"]
    return ProcessorConfig.from_dicts("cosmos3_edge", preset.preprocessor, preset.video_preprocessor)


def cosmos_video_processor(**overrides):
    return cosmos_video_module().Cosmos3EdgeVideoProcessor(**{**PRESETS["tiny-cosmos3-edge"].video_preprocessor,
                                                              **overrides})


@pytest.mark.parametrize("video_fps", [1.0, 2.0, 7.5, 23.976, 30.0, 60.0])
@pytest.mark.parametrize("fps", [None, 0.5, 2.0, 5.0])
def test_cosmos3_edge_sampling_matches_its_processor(video_fps: float, fps: float | None) -> None:
    from transformers.video_utils import VideoMetadata

    processor = cosmos_video_processor()
    cfg = cosmos_video_config()
    for total in [1, 2, 3, 4, 7, 16, 61, 600, 1801, 40000]:
        metadata = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
        expect = processor.sample_frames(metadata, fps=fps)
        plan = plan_sampling(cfg, total, video_fps, VideoOptions(fps=fps))
        np.testing.assert_array_equal(plan.indices, expect, err_msg=f"{total} frames at {video_fps} fps, {fps}")
        n = len(expect)
        for height, width in [(72, 96), (1080, 1920), (20, 700), (4000, 3000)]:
            size = cosmos_video_module().smart_resize(n, height, width, temporal_factor=1, factor=32,
                                                      min_pixels=4096, max_pixels=2097152)
            assert plan.size(height, width) == size


@pytest.mark.parametrize("fps", [None, 5.0])
def test_cosmos3_edge_video_rows_equal_its_processor(fps: float | None) -> None:
    """Frames the processor's sample_frames picks, sized by its smart_resize, laid out by the processor itself:
    every uint8 value in (time, merge block, row, col, channel) order, one temporal patch a frame."""
    from transformers.video_utils import VideoMetadata

    clip = make_video(23, fps=10, width=96, height=72, codec="libx264")
    cfg = cosmos_video_config()
    out = preprocess_video_bytes(clip, cfg, fps=fps)
    processor = cosmos_video_processor()
    indices = processor.sample_frames(VideoMetadata(total_num_frames=23, fps=10.0, duration=2.3), fps=fps).tolist()
    assert out.meta["frame_indices"] == indices
    h, w = out.meta["resized"]
    frames, _ = decode_all(clip)
    resized = np.stack([np.asarray(Image.fromarray(frames[i]).resize((w, h), Image.Resampling.BICUBIC))
                        for i in indices])
    ref = processor(videos=[resized], do_sample_frames=False, do_resize=False, do_convert_rgb=False,
                    do_rescale=False, do_normalize=False, return_tensors="pt")
    assert out.grid_thw == tuple(ref["video_grid_thw"][0].tolist()) == (len(indices), h // 16, w // 16)
    assert torch.equal(torch.from_numpy(out.pixels).float(), ref["pixel_values_videos"])
    assert out.pixels.shape[0] // 4 == processor.get_num_of_video_patches(len(indices), 72, 96) // 4
