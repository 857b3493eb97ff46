"""HunyuanOCR's, Hy4's and VideoLLaMA3's preprocessing against their own transformers processors, on the CPU.

Images: each family's image processor class (PIL backend), built from the preprocessor_config.json the server
reads: same grid, same pixels (to float32 rounding), same row order (raster for HunyuanOCR and Hy4; VideoLLaMA3
merges images by 1, so its merge-block order is raster too). Videos: HYV4VLVideoProcessor and
VideoLlama3VideoProcessor import torchvision, which CI lacks; their `sample_frames`, Hy4's `smart_resize` and
their `patchify` are taken from the classes' own source and run here (they need numpy and torch only), on the
frames the server decodes, resized as the server resizes them (PIL bicubic; transformers resizes with
torchvision, docs/video.md): frame indices, frame size, grid and every pixel row must agree.
"""

from __future__ import annotations

import ast
import io
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from models.families import FAMILIES
from models.loader import processor_config_from_folder
from models.presets import PRESETS
from service.media.image_preprocess import preprocess_image_bytes
from service.media.video_preprocess import preprocess_video_bytes
from service.media.video_sampling import hy4_frame_indices, hy4_frame_size, videollama3_frame_indices
from tests.videos import decode_all, make_video

PRESETS_OF = {"hunyuan_vl": "tiny-hunyuan-vl", "hy_v4_vl": "tiny-hy4", "video_llama_3": "tiny-videollama3"}
SIZES = [(97, 143), (300, 500), (37, 810), (64, 64), (1000, 30)]  # (width, height)


def config_folder(family: str, folder: Path, released: bool = False) -> Path:
    preset = PRESETS[PRESETS_OF[family]]
    (folder / "preprocessor_config.json").write_text(json.dumps({} if released else preset.preprocessor))
    if preset.video_preprocessor and not released:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(preset.video_preprocessor))
    return folder


def image_bytes(width: int, height: int, seed: int) -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("released", [False, True], ids=["preset", "class-defaults"])
@pytest.mark.parametrize("family", sorted(PRESETS_OF))
def test_images_equal_the_family_processor(family: str, released: bool, tmp_path) -> None:
    """With the preset's config, and with an empty one (the processor class's own defaults, which the family
    names where a checkpoint leaves keys out: VideoLLaMA3's images are not merged, Hunyuan's patches are 16)."""
    folder = config_folder(family, tmp_path, released)
    cfg = processor_config_from_folder(folder, family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = getattr(transformers, FAMILIES[family].image_processor + "Pil").from_pretrained(str(folder))
    for seed, (width, height) in enumerate(SIZES if not released else SIZES[:2]):
        data = image_bytes(width, height, seed)
        ours = preprocess_image_bytes(data, cfg)
        out = reference(Image.open(io.BytesIO(data)), return_tensors="np")
        assert ours.grid_thw == tuple(int(v) for v in out["image_grid_thw"][0])
        assert float(np.abs(cfg.normalize(ours.pixels) - out["pixel_values"]).max()) <= 1e-5


def class_method(package: str, cls_name: str, name: str):
    """A method of a transformers video processor, compiled from its own source without importing the module
    (which imports torchvision)."""
    source = (Path(transformers.__file__).parent / "models" / package / f"video_processing_{package}.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    for arg in method.args.args + method.args.kwonlyargs:
        arg.annotation = None
    method.returns, method.decorator_list = None, []
    scope = {"np": np, "torch": torch, "math": math, "logger": transformers.logging.get_logger(package)}
    exec(compile(ast.Module(body=[method], type_ignores=[]), f"video_processing_{package}.py", "exec"), scope)
    return scope[name]


class _Hy4:
    """What HYV4VLVideoProcessor.sample_frames reads from its instance (its class defaults)."""

    fps, min_frames, max_frames, num_frames = 2, 2, 1024, None


class _VideoLlama3:
    fps, num_frames, temporal_patch_size, min_frames, max_frames = 1, None, 1, 4, 180


def metadata(total: int, fps: float):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)


@pytest.mark.parametrize("video_fps", [1.0, 23.976, 29.97, 60.0])
def test_frame_sampling_matches_transformers(video_fps: float) -> None:
    hy4 = class_method("hy_v4_vl", "HYV4VLVideoProcessor", "sample_frames")
    vl3 = class_method("video_llama_3", "VideoLlama3VideoProcessor", "sample_frames")
    totals = [1, 2, 3, 5, 16, 61, 599, 600, 601, *np.random.default_rng(int(video_fps)).integers(1, 40_000, 4)]
    for total in map(int, totals):
        for fps in (0.5, 1.0, 2.0, 3.7):
            md = metadata(total, video_fps)
            np.testing.assert_array_equal(hy4_frame_indices(total, video_fps, fps=fps), hy4(_Hy4(), md, fps=fps))
            expect = vl3(_VideoLlama3(), md, fps=fps).numpy()
            np.testing.assert_array_equal(videollama3_frame_indices(total, video_fps, fps=fps), expect)
        for n in (2, 7, 16):  # a frame count asked for
            if n <= total:
                np.testing.assert_array_equal(hy4_frame_indices(total, video_fps, num_frames=n),
                                              hy4(_Hy4(), metadata(total, video_fps), num_frames=n))
                np.testing.assert_array_equal(videollama3_frame_indices(total, video_fps, num_frames=n),
                                              vl3(_VideoLlama3(), metadata(total, video_fps), num_frames=n).numpy())


def test_hy4_frame_size_matches_transformers() -> None:
    """Hy4's own search: never upscaled, a newline token per row counted against the clip's budget."""
    reference = class_method("hy_v4_vl", "HYV4VLVideoProcessor", "smart_resize")
    for height in (20, 33, 100, 480, 1080, 2000):
        for width in (17, 64, 333, 1280, 1920):
            for frames in (1, 2, 8, 64, 500):
                for budget, frame_cap in ((33554432, 1024 * 1024), (8 * 256 * 256, 256 * 256), (100000, 1 << 20)):
                    ours = hy4_frame_size(height, width, frames, factor=32, max_pixels=budget,
                                          max_frame_pixels=frame_cap)
                    assert ours == tuple(reference(height, width, frames, factor=32, max_pixels=budget,
                                                   max_image_size=frame_cap)), (height, width, frames, budget)


@pytest.mark.parametrize("family", ["hy_v4_vl", "video_llama_3"])
def test_videos_equal_the_family_processor(family: str, tmp_path) -> None:
    """Frames, size, grid and patch rows (raster per frame for Hy4, 2x2 blocks for VideoLLaMA3) of a decoded
    clip, against the class's own sampling, sizing and patchify on the same decoded frames."""
    cfg = processor_config_from_folder(config_folder(family, tmp_path), family)
    clip = make_video(37, fps=10, width=150, height=90, codec="libx264")
    out = preprocess_video_bytes(clip, cfg)
    frames, times = decode_all(clip)
    vcfg = cfg.video
    if family == "hy_v4_vl":
        indices = class_method("hy_v4_vl", "HYV4VLVideoProcessor", "sample_frames")(_Hy4(), metadata(37, 10.0))
        h, w = class_method("hy_v4_vl", "HYV4VLVideoProcessor", "smart_resize")(
            90, 150, len(indices), factor=32, max_pixels=vcfg.max_pixels, max_image_size=vcfg.frame_pixels)
        cls, merge, tokens = "HYV4VLVideoProcessor", 2, len(indices) * (h // 32) * (w // 32 + 1)
    else:
        indices = class_method("video_llama_3", "VideoLlama3VideoProcessor", "sample_frames")(
            _VideoLlama3(), metadata(37, 10.0)).numpy()
        from transformers.models.video_llama_3.image_processing_pil_video_llama_3 import smart_resize

        h, w = smart_resize(90, 150, 28, min_pixels=vcfg.min_pixels, max_pixels=vcfg.max_pixels // len(indices))
        cls, merge, tokens = "VideoLlama3VideoProcessor", 2, len(indices) * (h // 14) * (w // 14) // 4
    assert out.meta["frame_indices"] == [int(i) for i in indices]
    resized = np.stack([np.asarray(Image.fromarray(frames[i]).resize((w, h), Image.Resampling.BICUBIC))
                        for i in indices])
    video = torch.from_numpy(resized).permute(0, 3, 1, 2)[None]
    patchify = class_method(family, cls, "patchify")
    patches, gt, gh, gw = patchify(None, video, cfg.patch_size, merge, 1)
    assert out.grid_thw == (gt, gh, gw) == (len(indices), h // cfg.patch_size, w // cfg.patch_size)
    np.testing.assert_array_equal(out.pixels, patches[0].numpy().astype(np.uint8))
    np.testing.assert_allclose(out.meta["timestamps"], times[indices])
    assert out.num_tokens(cfg.video_merge_size) == gt * gh * gw // 4
    from service.media.video_sampling import plan_sampling  # what the admission counts is the tower's units

    assert plan_sampling(cfg, 37, 10.0).indices.tolist() == out.meta["frame_indices"]
    assert tokens >= out.num_tokens(cfg.video_merge_size)


def test_hunyuan_takes_no_videos(tmp_path) -> None:
    from service.media.errors import MediaError

    cfg = processor_config_from_folder(config_folder("hunyuan_vl", tmp_path), "hunyuan_vl")
    with pytest.raises(MediaError) as err:
        preprocess_video_bytes(make_video(4, fps=2, width=64, height=64), cfg)
    assert err.value.code == "unsupported_format"


def test_video_statistics_and_merge_follow_the_video_processor(tmp_path) -> None:
    """Hy4's video processor normalises with 0.5 where its image processor takes CLIP's; VideoLLaMA3's merges
    videos 2x2 and images not at all: each modality's rows are normalised and merged by its own processor's."""
    hy4 = processor_config_from_folder(config_folder("hy_v4_vl", tmp_path), "hy_v4_vl")
    assert hy4.video.image_mean == (0.5, 0.5, 0.5) and hy4.image_mean != hy4.video.image_mean
    vl3 = processor_config_from_folder(config_folder("video_llama_3", tmp_path), "video_llama_3")
    assert (vl3.merge_size, vl3.video_merge_size, vl3.factor, vl3.video_factor) == (1, 2, 14, 28)
    assert vl3.video.image_mean is None  # the same statistics: one normalisation
