"""LFM3-VL's and dots3-note's video pixels against transformers' own video processor (Qwen3VLVideoProcessor,
as transformers maps both model types), as tests/test_video_hf_processors.py does for the Qwen families, whose
helpers this reuses: dots3-note's single-frame patch rows (temporal_patch_size 1: no frame padding, one temporal
patch per sampled frame) and LFM3-VL's 16-pixel patches over two frames.

The processor imports torchvision, which only the GPU machine has; elsewhere the module is skipped. Run there
with `python3 -m pytest -s tests/test_family_blocks_video.py`.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torchvision",
    reason="transformers' video processors need torchvision: these run on the GPU machine, where it exists",
)

import numpy as np  # noqa: E402

from models.config import ProcessorConfig  # noqa: E402
from models.presets import PRESETS  # noqa: E402
from service.media.video_preprocess import preprocess_video_bytes  # noqa: E402
from tests.test_video_hf_processors import (  # noqa: E402
    hf_target_size,
    make_clip,
    run_processor,
    sampled_frames,
    server_normalised,
)


def config(preset: str) -> ProcessorConfig:
    p = PRESETS[preset]
    return ProcessorConfig.from_dicts(p.family, p.preprocessor, p.video_preprocessor)


@pytest.mark.parametrize(
    ("preset", "height", "width", "options"),
    [
        ("tiny-dots3-note", 56, 84, {}),  # factor 28; an odd frame count needs no padding at one frame a patch
        ("tiny-dots3-note", 56, 84, {"nframes": 5}),
        ("tiny-lfm3-vl", 64, 96, {"nframes": 5}),  # factor 32; five frames padded to six
    ],
    ids=["dots3_note", "dots3_note-odd", "lfm3_vl-odd"],
)
def test_video_pixels_equal_the_familys_processor(preset: str, height: int, width: int, options: dict) -> None:
    cfg = config(preset)
    size = {"shortest_edge": cfg.video.min_pixels, "longest_edge": cfg.video.max_pixels}
    data = make_clip(width, height)
    out = preprocess_video_bytes(data, cfg, **options)
    assert out.meta["resized"] == (height, width)
    video = sampled_frames(data, out)
    assert out.grid_thw[0] == -(-len(video) // cfg.temporal_patch_size)
    assert hf_target_size(cfg, len(video), height, width, size) == (height, width)
    ours = server_normalised(out, cfg)
    pixels, grid = run_processor(cfg, video, do_resize=False, size=size)
    assert grid == out.grid_thw
    assert pixels.shape == ours.shape == (out.num_patches, cfg.patch_dim)
    assert float(np.abs(pixels.astype(np.float64) - ours).max()) <= 1e-5
