"""The GLM towers (GLM-4.1V, GLM-4.5V, GLM-OCR) against transformers' own, loaded from the same safetensors
(fp32, CPU): images through `get_image_features`, videos through `get_video_features` (which runs each
frame pair as its own grid), both key layouts, a sharded checkpoint, and the bicubic position taps
against `grid_sample` itself."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models import load_tower
from models.config import ProcessorConfig
from models.loader import build_tower
from models.positions import bicubic_frame_taps
from models.presets import PRESETS, full_config
from tests.checkpoints import CLASSES, write_checkpoint
from tests.test_towers import (
    assert_cli_encode_equals_reference,
    normalized,
    random_pixels,
    rel_err,
    run_ours,
    run_padded,
    swap_layout,
)

FAMILIES = ["tiny-glm4v", "tiny-glm4v-moe", "tiny-glm46v", "tiny-glm-ocr"]
# Grids larger and smaller than the tiny presets' 8x8 position table, square and not.
IMAGE_GRIDS = [(1, 8, 12), (1, 16, 8), (1, 2, 2), (1, 20, 36), (1, 4, 4), (1, 10, 6)]
VIDEO_GRIDS = [(4, 8, 12), (1, 6, 6), (3, 10, 6)]
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    reference = write_checkpoint(request.param, folder)
    return request.param, folder, reference


def test_image_parity_with_transformers(checkpoint):
    _, folder, reference = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    for seed, grids in enumerate([IMAGE_GRIDS, IMAGE_GRIDS[:1], IMAGE_GRIDS[::-1]]):
        pixels = random_pixels(tower, grids, seed)
        ours = run_ours(tower, grids, pixels)
        with torch.no_grad():
            out = reference.model.get_image_features(
                pixel_values=normalized(tower, pixels), image_grid_thw=torch.tensor(grids)
            )
        expected = torch.cat(out.pooler_output)
        assert ours.embeds.shape == expected.shape == (sum(h * w for _, h, w in grids) // 4, tower.out_hidden_size)
        assert ours.deepstack == []
        assert rel_err(ours.embeds, expected) <= TOL


def test_video_parity_with_transformers(checkpoint):
    _, folder, reference = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    pixels = random_pixels(tower, VIDEO_GRIDS, 5)
    ours = run_ours(tower, VIDEO_GRIDS, pixels)
    with torch.no_grad():
        out = reference.model.get_video_features(
            pixel_values_videos=normalized(tower, pixels), video_grid_thw=torch.tensor(VIDEO_GRIDS)
        )
    assert rel_err(ours.embeds, torch.cat(out.pooler_output)) <= TOL


def test_padding_to_a_larger_capacity_changes_nothing(checkpoint):
    _, folder, _ = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    grids = VIDEO_GRIDS[:2] + IMAGE_GRIDS[:2]
    pixels = random_pixels(tower, grids)
    exact = run_ours(tower, grids, pixels)
    out, _ = run_padded(tower, grids, pixels)
    tokens = exact.embeds.shape[0]
    assert rel_err(out.embeds[:tokens], exact.embeds) < 1e-6


def test_other_key_layout_and_shards(checkpoint, tmp_path):
    name, folder, _ = checkpoint
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    state = load_file(str(other / "model.safetensors"))
    renamed = {swap_layout(k): v for k, v in state.items()}
    assert set(renamed) != set(state)
    save_file(renamed, str(other / "model.safetensors"), metadata={"format": "pt"})

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    write_checkpoint(name, sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1

    base = load_tower(str(folder), device="cpu", dtype="float32")
    pixels = random_pixels(base, IMAGE_GRIDS)
    expected = run_ours(base, IMAGE_GRIDS, pixels).embeds
    for path in (other, sharded):
        tower = load_tower(str(path), device="cpu", dtype="float32")
        assert torch.equal(run_ours(tower, IMAGE_GRIDS, pixels).embeds, expected)


@pytest.mark.parametrize("size", [(2, 2), (4, 6), (8, 8), (24, 24), (10, 36), (56, 4), (96, 54)])
@pytest.mark.parametrize("side", [8, 24])
def test_bicubic_taps_equal_grid_sample(size, side):
    """16 taps and weights per patch reproduce grid_sample(bicubic, align_corners=False, border)."""
    h, w = size
    gen = torch.Generator().manual_seed(h * 100 + w)
    table = torch.randn(side * side, 32, generator=gen)
    idx, wts = bicubic_frame_taps(h, w, 2, side)
    ours = F.embedding_bag(torch.tensor(idx), table, per_sample_weights=torch.tensor(wts), mode="sum")
    from models.metadata import block_order_positions

    pos = torch.tensor(block_order_positions(h, w, 2)).float()
    grid = torch.stack([(pos[:, 1] + 0.5) / w * 2 - 1, (pos[:, 0] + 0.5) / h * 2 - 1], -1)[None, :, None]
    image = table.view(side, side, -1).permute(2, 0, 1)[None]
    ref = F.grid_sample(image, grid, mode="bicubic", align_corners=False, padding_mode="border")
    ref = ref[0, :, :, 0].T
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_metadata_is_host_only(checkpoint):
    _, folder, _ = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    need = tower.required_capacity(IMAGE_GRIDS)
    meta = tower.build_metadata(IMAGE_GRIDS, need)
    assert all(isinstance(v, np.ndarray) for v in meta.values())
    if "interp_w" in meta:
        np.testing.assert_allclose(meta["interp_w"].sum(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("preset", ["random:glm-4.1v-9b"])
def test_full_size_parameters_match_transformers(preset):
    import transformers

    p = PRESETS[preset]
    cfg = full_config(p)
    processor = ProcessorConfig.from_dicts(p.family, p.preprocessor, p.video_preprocessor)
    ours = build_tower(p.family, cfg.vision_config, processor, "sdpa")
    with torch.device("meta"):
        ref = getattr(transformers, CLASSES[p.family])._from_config(cfg).model.visual
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in ref.state_dict().items()
    }
    assert sum(x.numel() for x in ours.parameters()) > 850e6


def test_vitserve_encode_serves_a_glm_checkpoint(tmp_path):
    """`vitserve encode --model <folder>` on a GLM-4.1V checkpoint: an image and a video, preprocessed by the
    GLM rules, encoded equal to transformers' GLM on those pixels."""
    folder = tmp_path / "glm"
    reference = write_checkpoint("tiny-glm4v", folder)
    assert_cli_encode_equals_reference(folder, reference, tmp_path, TOL)
