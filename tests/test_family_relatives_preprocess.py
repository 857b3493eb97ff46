"""GLMGA's and GLM-5-Next's preprocessing against their own processors in transformers 5.24 (the Qwen-style
relatives, Qwen4-Exp, Cosmos3-Omni and HyperCLOVAX, take Qwen2-VL's image processor and are checked with the
other Qwen-style families in tests/test_family_preprocess.py).

Images: `GlmgaImageProcessorPil` and `Glm5NextImageProcessorPil` built from the preset's processor config, on
images smaller and larger than the token bounds, of odd sizes and aspects: grids equal, pixels (GLM-5's
padding included) equal to float32 rounding. GLM-5's canvas arithmetic against its `smart_resize` itself on
thousands of sizes and bounds. Videos: both video processors import torchvision, which CI lacks, so their own
methods are taken from their source and run here: `sample_frames` (which frames), and GLM-5's `resize` (the
canvas, the content size and the zero padding; its torchvision resize stands in as PIL's bicubic, which is what
vitserve resizes with, docs/video.md); the patch layout is `Glm4vVideoProcessor.patchify`'s (imported).
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
from transformers.models.glm5_next.image_processing_pil_glm5_next import smart_resize as glm5_smart_resize
from transformers.models.glmga.image_processing_pil_glmga import GlmgaImageProcessorPil
from transformers.video_utils import VideoMetadata

from models.loader import processor_config_from_folder
from models.presets import PRESETS
from service.media.errors import MediaError
from service.media.image_preprocess import budget_resize, preprocess_image_bytes
from service.media.rules import video_sampling
from service.media.video_preprocess import preprocess_video_bytes
from service.media.video_sampling import VideoOptions, glm5_frame_indices, glmga_frame_indices, plan_sampling
from tests.videos import decode_all, make_video

SIZES = [(97, 143), (300, 500), (37, 810), (64, 64), (5, 5), (1000, 800), (28, 28), (1, 300), (2000, 30), (56, 112)]
REFERENCE = {"glmga": GlmgaImageProcessorPil, "glm5_next": Glm5NextImageProcessorPil}
PRESET = {"glmga": "tiny-glmga", "glm5_next": "tiny-glm5-next"}


def folder_for(family: str, tmp_path: Path) -> Path:
    """The preset's processor configs as a checkpoint ships them."""
    preset = PRESETS[PRESET[family]]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preset.preprocessor))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(preset.video_preprocessor))
    return tmp_path


def image_bytes(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("family", sorted(REFERENCE))
def test_image_grids_and_pixels_equal_the_processor(family: str, tmp_path) -> None:
    folder = folder_for(family, tmp_path)
    cfg = processor_config_from_folder(folder, family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = REFERENCE[family].from_pretrained(str(folder))
    grids = set()
    for seed, (width, height) in enumerate(SIZES):
        data = image_bytes(width, height, seed)
        try:
            out = reference(Image.open(io.BytesIO(data)), return_tensors="np")
        except ValueError:  # GLMGA's sizing refuses an aspect ratio above 200 (GLM-5's has no such limit)
            with pytest.raises(MediaError):
                preprocess_image_bytes(data, cfg)
            continue
        ours = preprocess_image_bytes(data, cfg)
        assert ours.grid_thw == tuple(int(v) for v in out["image_grid_thw"][0]), (width, height)
        pixels = np.asarray(out["pixel_values"])
        assert pixels.shape == ours.pixels.shape
        assert float(np.abs(cfg.normalize(ours.pixels) - pixels).max()) <= 1e-5, (width, height)
        grids.add(ours.grid_thw)
    assert len(grids) >= 7


def test_glm5_images_are_padded_not_stretched(tmp_path) -> None:
    """A 300x200 image keeps its pixels (no resize: it is within the bounds) on a 308x224 canvas whose last
    rows and columns are zeros (the mean after normalisation), as the processor pads it. `resized` names the
    content's size (as for the other padded sizings), the grid covers the canvas."""
    cfg = processor_config_from_folder(folder_for("glm5_next", tmp_path), "glm5_next")
    data = image_bytes(300, 200, 1)
    ours = preprocess_image_bytes(data, cfg)
    assert ours.grid_thw == (1, 16, 22) and ours.meta["resized"] == (200, 300)
    patches = ours.pixels.reshape(8, 11, 2, 2, 3, 2, 14, 14)  # merge blocks, merge row/col, C, T, P, P
    canvas = patches[:, :, :, :, :, 0].transpose(0, 2, 5, 1, 3, 6, 4).reshape(224, 308, 3)
    np.testing.assert_array_equal(canvas[:200, :300], np.asarray(Image.open(io.BytesIO(data))))
    assert not canvas[200:].any() and not canvas[:, 300:].any()


@pytest.mark.parametrize("frames", [2, 3, 4, 16, 61])
def test_glm5_canvas_matches_its_smart_resize(frames: int) -> None:
    """`budget_resize` over pixel bounds = the reference over token bounds (tokens of 2 * 28 * 28 pixels)."""
    rng = np.random.default_rng(frames)
    sizes = [(int(rng.integers(1, 4000)), int(rng.integers(1, 4000))) for _ in range(250)]
    sizes += [(1, 1), (27, 28), (28, 27), (5, 900), (2000, 11), (14, 2800), (1, 200), (112, 112), (1, 40000)]
    for lo, hi in [(16, 8000), (16, 1280), (16, 240000), (1, 10**6), (500, 600), (16, 16)]:
        for h, w in sizes:
            try:
                expect = glm5_smart_resize(frames, h, w, temporal_factor=2, factor=28, min_pixels=lo, max_pixels=hi)
            except ValueError:
                with pytest.raises(MediaError):
                    budget_resize(frames, h, w, temporal_factor=2, factor=28, min_pixels=lo * 1568,
                                  max_pixels=hi * 1568)
                continue
            ours = budget_resize(frames, h, w, temporal_factor=2, factor=28, min_pixels=lo * 1568,
                                 max_pixels=hi * 1568)
            assert ours == expect, (frames, h, w, lo, hi)


def test_processor_defaults_fill_what_the_configs_leave_out(tmp_path) -> None:
    """GLM-5's processor classes bound images by 16-8000 tokens and videos by 16-240000 (at most 2048 frames);
    GLMGA's video processor allows 28*28*2*55790 pixels and 640 frames: a checkpoint whose configs name none of
    these gets them, and GLM-5's `size` placeholder ({"longest_edge": 1}) is no bound."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 1}}))
    glm5 = processor_config_from_folder(tmp_path, "glm5_next")
    assert (glm5.min_pixels, glm5.max_pixels) == (16 * 1568, 8000 * 1568)
    assert (glm5.video.min_pixels, glm5.video.max_pixels, glm5.video.max_frames) == (16 * 1568, 240000 * 1568, 2048)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({}))
    glmga = processor_config_from_folder(tmp_path, "glmga")
    assert (glmga.min_pixels, glmga.max_pixels) == (112 * 112, 28 * 28 * 15000)
    assert (glmga.video.max_pixels, glmga.video.max_frames, glmga.video.fps) == (28 * 28 * 2 * 55790, 640, 2.0)


def test_a_patch_expand_factor_other_than_one_is_refused(tmp_path) -> None:
    from models.loader import CheckpointError, _read_checkpoint_config
    from tests.checkpoints import write_checkpoint

    write_checkpoint("tiny-glmga", tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_expand_factor": 2}))
    with pytest.raises(CheckpointError, match="patch_expand_factor 2"):
        _read_checkpoint_config(tmp_path)


# ---- videos ------------------------------------------------------------------------------------------------


def processor_method(module: str, cls: str, name: str, scope: dict):
    """A method of one of transformers' video processor classes, from its source: the modules import
    torchvision, which CI lacks, and these methods need only what `scope` gives them."""
    import transformers.models

    source = (Path(inspect.getfile(transformers.models)).parent / module).read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    method = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)
    for arg in method.args.args + method.args.kwonlyargs:
        arg.annotation = None
    method.returns = None
    exec(compile(ast.Module(body=[method], type_ignores=[]), module, "exec"), scope)
    return scope[name]


SAMPLERS = {
    "glmga": ("glmga/video_processing_glmga.py", "GlmgaVideoProcessor",
              dict(fps=2, max_frames=640), glmga_frame_indices),
    "glm5": ("glm5_next/video_processing_glm5_next.py", "Glm5NextVideoProcessor",
             dict(fps=2, max_frames=2048, max_duration=0), glm5_frame_indices),
}


@pytest.mark.parametrize("rule", sorted(SAMPLERS))
@pytest.mark.parametrize("video_fps", [1.0, 10.0, 23.976, 25.0, 30.0, 60.0])
@pytest.mark.parametrize("fps", [None, 0.5, 3.0, 30.0])
def test_sampling_matches_the_processor(rule: str, video_fps: float, fps: float | None) -> None:
    module, cls, defaults, ours = SAMPLERS[rule]
    sample_frames = processor_method(module, cls, "sample_frames", {"np": np, "math": math})
    self = SimpleNamespace(**defaults)
    seconds = [0.05, 0.4, 1, 2.5, 29.9, 31, 299, 330, 1000]
    for total in sorted({max(1, int(s * video_fps)) for s in seconds} | {1, 2, 3, 7}):
        metadata = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
        expect = sample_frames(self, metadata, fps=fps)
        got = ours(total, video_fps, fps=defaults["fps"] if fps is None else fps, max_frames=defaults["max_frames"])
        np.testing.assert_array_equal(got, expect, err_msg=f"{rule}: {total} frames at {video_fps} fps")


def test_the_checkpoints_video_processor_class_picks_the_rule(tmp_path) -> None:
    for family, rule in [("glmga", "glmga"), ("glm5_next", "glm5")]:
        assert video_sampling(processor_config_from_folder(folder_for(family, tmp_path), family)) == rule
    from models.config import ProcessorConfig

    for named, rule in [("GlmgaVideoProcessor", "glmga"), ("Glm5NextVideoProcessor", "glm5"),
                        ("Glm46VVideoProcessor", "glm46v")]:
        assert video_sampling(ProcessorConfig.from_dicts("glmga", {}, {"video_processor_type": named})) == rule


def test_a_request_caps_the_frames(tmp_path) -> None:
    cfg = processor_config_from_folder(folder_for("glmga", tmp_path), "glmga")
    plan = plan_sampling(cfg, 600, 30.0, VideoOptions(max_frames=6))  # 20 s at 2 fps would be 40
    assert plan.indices.tolist() == glmga_frame_indices(600, 30.0, max_frames=6).tolist()
    assert len(plan.indices) == 6 and plan.fps_adjusted_by == "max_frames"


def glm5_reference_frames(frames: np.ndarray, min_tokens: int, max_tokens: int, tps: int = 2, factor: int = 28
                          ) -> torch.Tensor:
    """Glm5NextVideoProcessor.resize itself on [T, H, W, 3] uint8 frames: its canvas, content size and zero
    padding, with its torchvision resize replaced by PIL's bicubic (vitserve's)."""
    from transformers.image_utils import SizeDict

    class Backend:
        @staticmethod
        def resize(_, videos, size, resample=None):
            return torch.from_numpy(np.stack([
                np.asarray(Image.fromarray(f.permute(1, 2, 0).numpy()).resize((size.width, size.height),
                                                                               Image.Resampling.BICUBIC))
                for f in videos[0]]).transpose(0, 3, 1, 2))[None]

    pad = SimpleNamespace(pad=lambda v, p, fill=0: F.pad(v, (0, p[2], 0, p[3]), value=fill))
    resize = processor_method("glm5_next/video_processing_glm5_next.py", "Glm5NextVideoProcessor", "resize",
                              {"math": math, "smart_resize": glm5_smart_resize, "TorchvisionBackend": Backend,
                               "SizeDict": SizeDict, "tvF": pad})
    videos = torch.from_numpy(frames).permute(0, 3, 1, 2)[None]
    return resize(None, videos, None, factor, tps, min_tokens, max_tokens)


# (width, height, max tokens of the clip or the config's): kept and padded, enlarged to the minimum, shrunk
@pytest.mark.parametrize("case", [(96, 72, None), (40, 30, None), (300, 160, 60)])
def test_glm5_video_end_to_end(case: tuple[int, int, int | None], tmp_path) -> None:
    """The frames GLM-5's sampler picks, on its canvas (content resized or not, zeros around), in the GLM
    processors' patch layout."""
    width, height, max_tokens = case
    cfg = processor_config_from_folder(folder_for("glm5_next", tmp_path), "glm5_next")
    token = 2 * 28 * 28
    max_tokens = max_tokens or cfg.video.max_pixels // token
    clip = make_video(23, fps=10, width=width, height=height, codec="libx264")  # 2.3 s, an odd frame count
    out = preprocess_video_bytes(clip, cfg, max_pixels=max_tokens * token)
    indices = glm5_frame_indices(23, 10.0, fps=2.0, max_frames=2048).tolist()
    assert out.meta["frame_indices"] == indices and len(indices) % 2 == 0
    frames, _ = decode_all(clip)
    padded = glm5_reference_frames(frames[indices], cfg.video.min_pixels // token, max_tokens)
    patches, gt, gh, gw = Glm4vVideoProcessor.patchify(None, padded, 14, 2, 2)  # type: ignore[arg-type]
    assert out.grid_thw == (gt, gh, gw)
    np.testing.assert_array_equal(out.pixels, patches[0].numpy().astype(np.uint8))
    if max_tokens == 60:
        assert gt * gh * gw // 4 <= 60 < (width // 28) * (height // 28) * gt
