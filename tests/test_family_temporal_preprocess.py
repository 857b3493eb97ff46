"""ERNIE-4.5-VL's and MiniMax-M3's preprocessing against their own processor classes.

ERNIE images: `Ernie4_5_VLMoeImageProcessorPil` runs here (tests/test_family_preprocess.py covers it with the
other Qwen-sized families; here its one-frame patch rows and its defaults where a config leaves them out).
The processors that exist only with torchvision, which vitserve's environment lacks (MiniMax's image and video
processors, ERNIE's video processor), run in vLLM's environment (torch 2.14.1 and torchvision 0.29.1 on the
CPU, transformers 5.20.2, whose files for these classes differ from 5.24's only in imports and in MiniMax's
video grid being cut into attention segments, which the tower does here) through
tests/torchvision_processor_driver.py, on the same PNG files and decoded frames: their own frame picks (and
vLLM's MiniMax loader's), grids equal, pixels equal to float32 rounding. vitserve's side reproduces
torchvision's uint8 bicubic (torch's own antialiased kernel) without importing torchvision.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from models.loader import CheckpointError, check_model, processor_config_from_folder
from models.presets import PRESETS, full_config
from service.media.image_preprocess import preprocess_image_bytes
from service.media.navit_sizing import resize_bicubic_antialias
from tests.test_vllm_handoff import run_driver

SIZES = [(97, 143), (300, 500), (37, 810), (64, 64), (1000, 700), (41, 30)]  # (width, height)


def image_bytes(width: int, height: int, seed: int) -> bytes:
    """A photo-like image (smooth gradients plus noise), so that bicubic ringing and rounding both show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([128 + 100 * np.sin(x / (7 + c) + y / (11 + c)) for c in range(3)], -1)
    pixels = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def frame_colours(index: int, width: int, height: int) -> np.ndarray:
    """Smooth content, different in every channel and frame (so frame choice and channel order show)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    planes = [128 + 90 * np.sin(2 * np.pi * (x / width * 1.5 + index / 10)),
              128 + 90 * np.cos(2 * np.pi * (y / height * 1.2 - index / 13)),
              128 + 60 * np.sin(2 * np.pi * ((x + y) / (width + height) * 2 + index / 7))]
    return np.clip(np.stack(planes, axis=-1).round(), 0, 255).astype(np.uint8)


# (frames, fps, width, height) of the test clips: 1 fps sampling picks 3, 7 and 2 frames (odd counts are padded)
CLIPS = [(25, 10.0, 96, 64), (40, 6.0, 200, 120), (12, 8.0, 64, 64)]
# (total frames, video fps, requested fps) for the frame rule alone
SAMPLING = [(25, 10.0, 1.0), (300, 29.97, 1.0), (61, 30.0, 2.0), (7, 2.5, 1.0), (100, 24.0, 0.5), (1, 30.0, 1.0)]


def test_minimax_images_and_videos_equal_its_torchvision_processors(tmp_path):
    """Images: grids and pixels. Videos: vLLM's frame rule for the model picks the same frames as ours (vitserve
    decodes them; the video processor gets exactly those, unresized), then the processor's grid and pixels."""
    from service.media.video_preprocess import preprocess_video_bytes
    from service.media.video_sampling import minimax_frame_indices
    from tests.videos import decode_all, make_video

    config = dict(PRESETS["random:minimax-m3"].preprocessor)
    video_config = dict(PRESETS["random:minimax-m3"].video_preprocessor or {})
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    cfg = processor_config_from_folder(tmp_path, "minimax_m3_vl")
    paths = []
    for seed, (width, height) in enumerate(SIZES):
        path = tmp_path / f"image{seed}.png"
        path.write_bytes(image_bytes(width, height, seed))
        paths.append(str(path))
    videos, clips = [], []
    for k, (frames, fps, width, height) in enumerate(CLIPS):
        data = make_video(frames, fps=fps, width=width, height=height, codec="libx264", frame_fn=frame_colours)
        ours = preprocess_video_bytes(data, cfg)
        decoded, _ = decode_all(data)
        picked = decoded[np.asarray(ours.meta["frame_indices"])]
        np.save(tmp_path / f"video{k}.npy", np.ascontiguousarray(picked.transpose(0, 3, 1, 2)))
        videos.append(str(tmp_path / f"video{k}.npy"))
        clips.append(ours)
    request = {"class": "MiniMaxM3VLImageProcessor", "config": config, "images": paths,
               "video_class": "MiniMaxM3VLVideoProcessor", "video_config": video_config, "videos": videos,
               "minimax_sampling": [list(c) for c in SAMPLING] + [[f, fps, 1.0] for f, fps, _, _ in CLIPS]}
    report = run_driver("torchvision_processor_driver.py", request, tmp_path)
    assert report["class"] == "MiniMaxM3VLImageProcessor"
    for (total, video_fps, fps), sampled in zip(request["minimax_sampling"], report["sampled"]):
        assert minimax_frame_indices(total, video_fps, fps).tolist() == sampled, (total, video_fps, fps)
    reference = np.load(tmp_path / "processed.npz")
    for k, ours in enumerate(clips):
        assert ours.meta["frame_indices"] == report["sampled"][len(SAMPLING) + k]
        grid = reference[f"video_grid_thw_{k}"]
        assert ours.grid_thw == tuple(int(v) for v in grid[0]) and len(grid) == 1  # 5.20's processor: one grid
        pixels = reference[f"pixel_values_videos_{k}"]
        assert pixels.shape == ours.pixels.shape
        assert float(np.abs(cfg.normalize(ours.pixels) - pixels).max()) <= 1e-5, CLIPS[k]
    resized = 0
    for i, path in enumerate(paths):
        ours = preprocess_image_bytes(open(path, "rb").read(), cfg)
        assert ours.grid_thw == tuple(int(v) for v in reference[f"image_grid_thw_{i}"][0]), SIZES[i]
        pixels = reference[f"pixel_values_{i}"]
        assert pixels.shape == ours.pixels.shape
        assert float(np.abs(cfg.normalize(ours.pixels) - pixels).max()) <= 1e-5, SIZES[i]
        resized += ours.meta["resized"] != ours.meta["orig_size"]
    assert resized >= 4  # the resize itself was compared, not only copies


def test_torch_bicubic_differs_from_pil():
    """The two resizes are not interchangeable: a family's choice matters (MiniMax's is torchvision's)."""
    image = Image.open(io.BytesIO(image_bytes(300, 500, 1)))
    ours = resize_bicubic_antialias(np.asarray(image), 392, 224).astype(int)
    pil = np.asarray(image.resize((224, 392), Image.Resampling.BICUBIC)).astype(int)
    assert ours.shape == pil.shape and np.abs(ours - pil).max() >= 1


def test_ernie_rows_are_one_frame_and_defaults_fill_a_bare_config(tmp_path):
    """ERNIE's patch rows hold one frame (3*14*14); a preprocessor config without the patch settings gets the
    processor class's (one frame per row), not Qwen2-VL's two."""
    import transformers
    from PIL import ImageFont

    bare = {"image_processor_type": "Ernie4_5_VLMoeImageProcessor"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(bare))
    assert processor_config_from_folder(tmp_path, "ernie4_5_vl_moe").video.timestamp_font.endswith(
        "/Roboto-Regular.ttf")  # its video processor's font, by default: a checkpoint without it is refused
    (tmp_path / "config.json").write_text(full_config(PRESETS["tiny-ernie4.5-vl-moe"]).to_json_string())
    with pytest.raises(CheckpointError, match="Roboto-Regular.ttf"):
        check_model(str(tmp_path))
    (tmp_path / "Roboto-Regular.ttf").write_bytes(ImageFont.load_default(size=10).font_bytes)
    with pytest.raises(CheckpointError, match="safetensors"):  # past the font: no weights in this folder
        check_model(str(tmp_path))
    cfg = processor_config_from_folder(tmp_path, "ernie4_5_vl_moe")
    assert (cfg.temporal_patch_size, cfg.patch_dim) == (1, 588)
    reference = transformers.Ernie4_5_VLMoeImageProcessorPil()
    for seed, (width, height) in enumerate(SIZES[:4]):
        data = image_bytes(width, height, seed)
        ours = preprocess_image_bytes(data, cfg)
        out = reference(Image.open(io.BytesIO(data)), return_tensors="np")
        assert ours.grid_thw == tuple(int(v) for v in out["image_grid_thw"][0])
        assert float(np.abs(cfg.normalize(ours.pixels) - np.asarray(out["pixel_values"])).max()) <= 1e-5


def test_minimax_released_size_setting_is_replaced_by_the_processor_default(tmp_path):
    """MiniMax-M3's processor replaces the release's `size` of [672, 672] by its own bounds."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": [672, 672]}))
    cfg = processor_config_from_folder(tmp_path, "minimax_m3_vl")
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 451584)


# (frames, fps, width, height): every frame of a short clip (20, an even count), an odd count the processor
# pads (33), and fewer than its 16-frame floor (9: all of them, padded)
ERNIE_CLIPS = [(20, 10.0, 96, 64), (33, 8.0, 120, 200), (9, 3.0, 64, 96)]
ERNIE_SAMPLING = [(20, 10.0), (33, 8.0), (500, 30.0), (9, 3.0), (181, 24.0), (1000, 25.0)]


def test_ernie_videos_equal_its_processor(tmp_path):
    """`Ernie4_5_VLMoeVideoProcessor` (torchvision only) in vLLM's environment: its `sample_frames` picks our
    frames; on those frames (decoded by vitserve's reference decoder) with their indices and the clip's rate, it
    draws each frame's time in the checkpoint's font, pads an odd count, resizes and patchifies: our grid and
    pixels equal its. The font is Pillow's own (its embedded FreeType font, written to a file)."""
    from PIL import ImageFont

    from service.media.video_preprocess import preprocess_video_bytes
    from service.media.video_sampling import ernie_frame_indices
    from tests.videos import decode_all, make_video

    font = tmp_path / "label-font.ttf"
    font.write_bytes(ImageFont.load_default(size=10).font_bytes)
    video_config = {**(PRESETS["random:ernie-4.5-vl-28b-a3b"].video_preprocessor or {}), "draw_on_frames": True,
                    "font": font.name}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PRESETS["random:ernie-4.5-vl-28b-a3b"].preprocessor))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    cfg = processor_config_from_folder(tmp_path, "ernie4_5_vl_moe")
    assert cfg.video.timestamp_font == str(font) and cfg.temporal_patch_size == 1
    clips = [make_video(n, fps=fps, width=w, height=h, codec="libx264", frame_fn=frame_colours)
             for n, fps, w, h in ERNIE_CLIPS]
    ours = [preprocess_video_bytes(data, cfg) for data in clips]
    sampling = ERNIE_SAMPLING + [(n, fps) for n, fps, _, _ in ERNIE_CLIPS]
    reference_config = {k: v for k, v in video_config.items() if k != "fps"}  # the class has no rate
    reference_config["font"] = str(font)
    videos, metadata = [], []
    for k, (data, item) in enumerate(zip(clips, ours)):
        picked = item.meta["frame_indices"]
        picked = picked[:-1] if len(picked) > 1 and picked[-1] == picked[-2] else picked  # the processor pads
        decoded, _ = decode_all(data)
        np.save(tmp_path / f"ernie{k}.npy", np.ascontiguousarray(decoded[picked].transpose(0, 3, 1, 2)))
        videos.append(str(tmp_path / f"ernie{k}.npy"))
        metadata.append({"fps": ERNIE_CLIPS[k][1], "frames_indices": picked, "total_num_frames": ERNIE_CLIPS[k][0]})
    picks = run_driver("torchvision_processor_driver.py", {
        "class": "Ernie4_5_VLMoeImageProcessor", "config": {}, "images": [],
        "video_class": "Ernie4_5_VLMoeVideoProcessor", "video_config": reference_config, "videos": videos,
        "video_metadata": metadata, "sample_frames": [list(c) for c in sampling]}, tmp_path)["sampled"]
    for (total, video_fps), picked in zip(sampling, picks):
        padded = picked + picked[-1:] if len(picked) % 2 else picked
        assert ernie_frame_indices(total, video_fps).tolist() == padded, (total, video_fps)
    for k, meta in enumerate(metadata):  # our picks for the clips are the processor's own
        assert meta["frames_indices"] == picks[len(ERNIE_SAMPLING) + k]
    reference = np.load(tmp_path / "processed.npz")
    for k, item in enumerate(ours):
        assert item.grid_thw == tuple(int(v) for v in reference[f"video_grid_thw_{k}"][0]), ERNIE_CLIPS[k]
        pixels = reference[f"pixel_values_videos_{k}"]
        assert pixels.shape == item.pixels.shape
        assert float(np.abs(cfg.normalize(item.pixels) - pixels).max()) <= 1e-5, ERNIE_CLIPS[k]
