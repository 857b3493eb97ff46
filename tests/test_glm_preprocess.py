"""GLM-4.1V preprocessing against transformers' own GLM processors: sizes, grids and pixels.

Images: `Glm4vImageProcessorPil` (the processor transformers uses without torchvision; the torchvision one
sizes identically and resizes on tensors). Videos: `Glm4vVideoProcessor.sample_frames` and the GLM
`smart_resize` (the video processor itself needs torchvision: its pixels are compared on the GPU machine
by tests/test_video_hf_processors.py).
"""

from __future__ import annotations

import io
import math
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as ref_smart_resize

from models.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ProcessorConfig
from models.loader import processor_config_from_folder
from service.media.errors import MediaError
from service.media.image_preprocess import clip_smart_resize, preprocess_image, preprocess_image_bytes
from service.media.video_sampling import glm_frame_indices
from tests.test_preprocess_images import KINDS, MODES, content, random_encoded_image, random_size

# GLM-4.1V's released preprocessor_config (shortest_edge 112*112), a smaller longest_edge so large
# images stay cheap.
GLM = ProcessorConfig(
    family="glm4v",
    image_mean=OPENAI_CLIP_MEAN,
    image_std=OPENAI_CLIP_STD,
    min_pixels=112 * 112,
    max_pixels=28 * 28 * 2 * 64,
)
TOL = 1e-5


@cache
def reference(min_pixels: int, max_pixels: int, raw: bool = False) -> Glm4vImageProcessorPil:
    return Glm4vImageProcessorPil(
        do_rescale=not raw,
        do_normalize=not raw,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )


def run_reference(image: Image.Image, raw: bool = False, **bounds: int) -> tuple[np.ndarray, tuple]:
    proc = reference(bounds.get("min_pixels", GLM.min_pixels), bounds.get("max_pixels", GLM.max_pixels), raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(image)
    return np.asarray(out["pixel_values"]), tuple(int(v) for v in out["image_grid_thw"][0])


def assert_parity(ours, ref_pixels: np.ndarray, ref_grid: tuple) -> None:
    assert ours.grid_thw == ref_grid
    assert ours.pixels.shape == ref_pixels.shape == (math.prod(ref_grid), GLM.patch_dim)
    assert float(np.abs(GLM.normalize(ours.pixels) - ref_pixels).max()) <= TOL


@pytest.mark.parametrize("frames", [2, 3, 4, 16, 33])
def test_clip_smart_resize_matches_transformers(frames: int) -> None:
    rng = np.random.default_rng(frames)
    sizes = [(int(rng.integers(1, 3000)), int(rng.integers(1, 3000))) for _ in range(300)]
    sizes += [(1, 1), (27, 28), (28, 27), (5, 900), (2000, 11), (14, 2800), (1, 200), (112, 112)]
    for lo, hi in [(112 * 112, 28 * 28 * 2 * 6144), (112 * 112, 28 * 28 * 2 * 64), (1, 10**9), (10**6, 2 * 10**6)]:
        for h, w in sizes:
            try:
                expect = ref_smart_resize(frames, h, w, temporal_factor=2, factor=28, min_pixels=lo, max_pixels=hi)
            except ValueError:
                with pytest.raises(MediaError):
                    clip_smart_resize(frames, h, w, temporal_factor=2, factor=28, min_pixels=lo, max_pixels=hi)
                continue
            assert clip_smart_resize(frames, h, w, temporal_factor=2, factor=28, min_pixels=lo, max_pixels=hi) == expect


def test_clip_smart_resize_refuses_one_frame() -> None:
    with pytest.raises(MediaError) as info:
        clip_smart_resize(1, 100, 100)
    assert info.value.code == "too_few_frames"


def test_parity_random_images_from_bytes() -> None:
    """18 seeded images of every mode and size class: bytes -> ours vs bytes -> PIL.open -> reference."""
    rng = np.random.default_rng(4242)
    grids = set()
    for i in range(18):
        mode = MODES[i % len(MODES)]
        width, height = random_size(rng, KINDS[(i // len(MODES) + i) % len(KINDS)])
        data = random_encoded_image(rng, mode, width, height)
        ours = preprocess_image_bytes(data, GLM)
        ref_pixels, ref_grid = run_reference(Image.open(io.BytesIO(data)))
        assert_parity(ours, ref_pixels, ref_grid)
        if i % 3 == 0:  # the uint8 patches are the reference's resized values exactly
            raw_pixels, _ = run_reference(Image.open(io.BytesIO(data)), raw=True)
            np.testing.assert_array_equal(ours.pixels, raw_pixels)
        grids.add(ref_grid)
    assert len(grids) > 8


@pytest.mark.parametrize(
    "bounds",
    [{"min_pixels": 28 * 28 * 8}, {"max_pixels": 28 * 28 * 2 * 16}, {"min_pixels": 1, "max_pixels": 10_000_000}],
)
def test_per_item_pixel_bounds_are_the_processor_size(bounds: dict[str, int]) -> None:
    rng = np.random.default_rng(5)
    for width, height in [(37, 23), (300, 180), (640, 480)]:
        image = Image.fromarray(content(rng, height, width, 3), "RGB")
        ref_pixels, ref_grid = run_reference(image, **bounds)
        assert_parity(preprocess_image(image, GLM, **bounds), ref_pixels, ref_grid)


@pytest.mark.parametrize("size", [(1, 1), (3, 1), (1, 150), (27, 5), (4, 3), (28, 28)])
def test_tiny_images_are_scaled_up_like_the_reference(size: tuple[int, int]) -> None:
    image = Image.fromarray(content(np.random.default_rng(3), size[1], size[0], 3), "RGB")
    ref_pixels, ref_grid = run_reference(image)
    assert_parity(preprocess_image(image, GLM), ref_pixels, ref_grid)


def test_glm_sizing_differs_from_qwen2() -> None:
    """The GLM bounds count T*H*W: the same image gets fewer tokens than under Qwen2-VL's rule."""
    image = Image.new("RGB", (1000, 800))
    qwen = ProcessorConfig(min_pixels=GLM.min_pixels, max_pixels=GLM.max_pixels)
    assert preprocess_image(image, GLM).grid_thw != preprocess_image(image, qwen).grid_thw


class _GlmDefaults:
    """What `Glm4vVideoProcessor.sample_frames` reads from its instance (the class needs torchvision)."""

    fps = 2
    max_duration = 300


@pytest.mark.parametrize("video_fps", [1.0, 2.0, 5.0, 23.976, 24.0, 29.97, 30.0, 60.0])
@pytest.mark.parametrize("fps", [None, 0.5, 1.0, 2.0, 3.0, 7.5, 100.0])
def test_glm_sampling_matches_transformers(video_fps: float, fps: float | None) -> None:
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(int(video_fps * 100) + int((fps or 0) * 10))
    totals = [1, 2, 3, 7, 16, 61, 599, 600, 601, int(300 * video_fps), int(300 * video_fps) + 1]
    totals += [int(x) for x in rng.integers(1, 40_000, 6)]
    for total in totals:
        metadata = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
        expect = Glm4vVideoProcessor.sample_frames(_GlmDefaults(), metadata, fps=fps)  # type: ignore[arg-type]
        ours = glm_frame_indices(total, video_fps, fps=_GlmDefaults.fps if fps is None else fps)
        np.testing.assert_array_equal(ours, expect, err_msg=f"{total} frames at {video_fps} fps, sampled at {fps}")
        assert len(ours) % 2 == 0


GLM_VIDEO = ProcessorConfig.from_dicts(
    "glm4v",
    {"size": {"shortest_edge": 12544, "longest_edge": 9633792}},
    {"size": {"shortest_edge": 12544, "longest_edge": 28 * 28 * 2 * 40}, "fps": 2},
)


@pytest.mark.parametrize("fps", [None, 3.0, 30.0])
def test_glm_video_end_to_end(fps: float | None) -> None:
    """Frames GLM's sample_frames picks, sized by GLM's smart_resize, in the processor's patch layout."""
    import torch
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    from service.media.video_preprocess import preprocess_video_bytes
    from tests.videos import decode_all, make_video

    clip = make_video(23, fps=10, width=96, height=72, codec="libx264")  # 2.3 s, an odd frame count
    out = preprocess_video_bytes(clip, GLM_VIDEO, fps=fps)
    metadata = VideoMetadata(total_num_frames=23, fps=10.0, duration=2.3)
    indices = Glm4vVideoProcessor.sample_frames(_GlmDefaults(), metadata, fps=fps).tolist()  # type: ignore[arg-type]
    assert out.meta["frame_indices"] == indices and len(indices) % 2 == 0
    h, w = ref_smart_resize(len(indices), 72, 96, temporal_factor=2, factor=28, min_pixels=12544,
                            max_pixels=28 * 28 * 2 * 40)
    frames, times = decode_all(clip)
    resized = np.stack([np.asarray(Image.fromarray(frames[i]).resize((w, h), Image.Resampling.BICUBIC))
                        for i in indices])
    video = torch.from_numpy(resized).permute(0, 3, 1, 2)[None]
    patches, gt, gh, gw = Glm4vVideoProcessor.patchify(None, video, 14, 2, 2)  # type: ignore[arg-type]
    assert out.grid_thw == (gt, gh, gw) == (len(indices) // 2, h // 14, w // 14)
    np.testing.assert_array_equal(out.pixels, patches[0].numpy().astype(np.uint8))
    np.testing.assert_allclose(out.meta["timestamps"], times[indices])


def test_glm_single_frame_video_is_one_temporal_patch() -> None:
    from service.media.video_preprocess import preprocess_video_bytes
    from tests.videos import make_video

    out = preprocess_video_bytes(make_video(1, fps=10, width=64, height=48), GLM_VIDEO)
    assert out.grid_thw[0] == 1 and out.meta["frame_indices"] == [0, 0]


def test_glm_max_frames_spreads_frames_over_the_clip() -> None:
    from service.media.video_sampling import VideoOptions, plan_sampling

    plan = plan_sampling(GLM_VIDEO, 600, 30.0, VideoOptions(max_frames=6))  # 20 s at 2 fps would be 40
    assert plan.indices.tolist() == glm_frame_indices(600, 30.0, nframes=6).tolist() == [0, 120, 240, 360, 480, 599]
    assert plan.fps_adjusted_by == "max_frames"


def test_a_missing_video_config_falls_back_to_the_image_one_as_transformers_does(tmp_path) -> None:
    import json

    image = {"size": {"shortest_edge": 12544, "longest_edge": 28 * 28 * 2 * 99}, "patch_size": 14}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image))
    cfg = processor_config_from_folder(tmp_path, "glm4v")
    assert (cfg.video.min_pixels, cfg.video.max_pixels) == (12544, 28 * 28 * 2 * 99)
    qwen2 = processor_config_from_folder(tmp_path, "qwen2_vl")  # qwen-vl-utils' own defaults stay
    assert qwen2.video.max_pixels == ProcessorConfig().video.max_pixels


class _Glm46VDefaults:
    temporal_patch_size = 2


def glm46v_sample_frames():
    """transformers' own `Glm46VVideoProcessor.sample_frames`, taken from its source: the module imports
    torchvision, which CI lacks, and the method needs only numpy."""
    import ast
    import inspect

    import transformers.models.glm46v as package

    source = (Path(inspect.getfile(package)).parent / "video_processing_glm46v.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Glm46VVideoProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    method.args.args[1].annotation = None  # VideoMetadata: not imported here
    scope: dict = {"np": np}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "video_processing_glm46v.py", "exec"), scope)
    return scope["sample_frames"]


@pytest.mark.parametrize("video_fps", [1.0, 10.0, 23.976, 25.0, 30.0, 60.0])
def test_glm46v_sampling_matches_transformers(video_fps: float) -> None:
    """GLM-4.6V picks its own rate from the clip's length (3, 1 or 0.5 frame pairs a second)."""
    from transformers.video_utils import VideoMetadata

    from service.media.video_sampling import glm46v_frame_indices

    sample_frames = glm46v_sample_frames()

    seconds = [0.1, 1, 2.5, 29.9, 30, 31, 299, 301, 1000, 2500]
    for total in sorted({max(1, int(s * video_fps)) for s in seconds} | {1, 2, 3, 7}):
        metadata = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
        expect = sample_frames(_Glm46VDefaults(), metadata)
        np.testing.assert_array_equal(glm46v_frame_indices(total, video_fps), expect, err_msg=f"{total} frames")


def test_glm46v_plan_uses_its_rate_unless_asked_for_one() -> None:
    from service.media.video_sampling import VideoOptions, glm46v_frame_indices, plan_sampling

    cfg = ProcessorConfig.from_dicts("glm46v", {"size": {"shortest_edge": 12544, "longest_edge": 9633792}})
    plan = plan_sampling(cfg, 600, 30.0)  # 20 s: 3 pairs a second
    assert plan.indices.tolist() == glm46v_frame_indices(600, 30.0).tolist() and len(plan.indices) == 120
    assert plan.requested_fps is None
    fixed = plan_sampling(cfg, 600, 30.0, VideoOptions(fps=1.0))
    assert fixed.indices.tolist() == glm_frame_indices(600, 30.0, fps=1.0).tolist() and fixed.requested_fps == 1.0


def test_the_checkpoints_video_processor_class_picks_the_glm_rule() -> None:
    from service.media.rules import video_sampling

    image = {"size": {"shortest_edge": 12544, "longest_edge": 9633792}}
    for family in ("glm4v", "glm4v_moe", "glm46v"):
        for named, rule in [("Glm46VVideoProcessor", "glm46v"), ("Glm4vVideoProcessor", "glm4v")]:
            cfg = ProcessorConfig.from_dicts(family, image, {"video_processor_type": named, "fps": 2})
            assert video_sampling(cfg) == rule
    assert video_sampling(ProcessorConfig.from_dicts("glm46v", image)) == "glm46v"
    assert video_sampling(ProcessorConfig.from_dicts("glm4v", image)) == "glm4v"


def test_processor_configs_saved_by_transformers_5_are_read(tmp_path) -> None:
    """transformers 5's processor.save_pretrained writes one processor_config.json with the image and video
    processors nested, and no preprocessor_config.json: the server reads it, as transformers does first."""
    import json

    image = {"size": {"shortest_edge": 12544, "longest_edge": 28 * 28 * 2 * 77},
             "image_processor_type": "Glm4vImageProcessor"}
    video = {"size": {"shortest_edge": 12544, "longest_edge": 28 * 28 * 2 * 55}, "fps": 3,
             "video_processor_type": "Glm46VVideoProcessor"}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": image, "video_processor": video}))
    cfg = processor_config_from_folder(tmp_path, "glm4v")
    assert (cfg.max_pixels, cfg.video.max_pixels, cfg.video.fps) == (28 * 28 * 2 * 77, 28 * 28 * 2 * 55, 3.0)
    assert cfg.video.processor_class == "Glm46VVideoProcessor"
    (tmp_path / "processor_config.json").write_text(json.dumps({"tokenizer": {}}))
    with pytest.raises(FileNotFoundError):
        processor_config_from_folder(tmp_path, "glm4v")
