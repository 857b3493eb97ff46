"""The SigLIP-style towers (PaddleOCR-VL, Cosmos3-Edge) against transformers' own models, loaded from the same
safetensors (fp32, CPU): images through `get_image_features` (PaddleOCR-VL's row-major patches, Cosmos3-Edge's
(row, col, channel) ones), Cosmos3-Edge's videos through `get_video_features`, the releases' tensor names,
and each new shared part against the function it reproduces: the antialiased position resampling against
F.interpolate and transformers' own, the half-pixel taps against transformers' helper, the raster merge
against the projector's reshape, the patch embeddings' column orders."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models import load_tower
from models.mergers import raster_merge_index
from models.patches import Conv2dPatches, LinearPatches
from models.positions import antialias_metadata, half_pixel_frame_taps, resample_separable
from models.protocol import Capacity
from tests.checkpoints import write_checkpoint
from tests.test_towers import random_pixels, rel_err, run_ours, run_padded

PRESETS = ["tiny-paddleocr-vl", "tiny-cosmos3-edge"]
# Grids larger and smaller than the tiny presets' 8x8 position tables, square and not, down to one merge block.
IMAGE_GRIDS = [(1, 8, 12), (1, 16, 8), (1, 2, 2), (1, 12, 18), (1, 4, 4), (1, 10, 6), (1, 2, 14)]
VIDEO_GRIDS = [(4, 8, 12), (1, 6, 6), (3, 2, 10)]
TOL = 1e-4


@pytest.fixture(scope="module", params=PRESETS)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = write_checkpoint(request.param, folder)
    return request.param, folder, reference, load_tower(str(folder), device="cpu", dtype="float32")


def reference_features(tower, reference, pixels: torch.Tensor, grids, video: bool = False) -> torch.Tensor:
    x = torch.from_numpy(tower.processor.normalize(pixels.numpy()))
    with torch.no_grad():
        if video:
            out = reference.model.get_video_features(pixel_values_videos=x, video_grid_thw=torch.tensor(grids))
            return torch.cat(out.pooler_output)
        return tower.spec.extra["reference_features"](reference, x, torch.tensor(grids))


def test_image_parity_with_transformers(checkpoint):
    _, _, reference, tower = checkpoint
    for seed, grids in enumerate([IMAGE_GRIDS, IMAGE_GRIDS[2:3]]):
        pixels = random_pixels(tower, grids, seed)
        ours = run_ours(tower, grids, pixels)
        expected = reference_features(tower, reference, pixels, grids)
        assert ours.embeds.shape == expected.shape == (sum(h * w for _, h, w in grids) // 4, tower.out_hidden_size)
        assert [tower.geometry.tokens(g) for g in grids] == [h * w // 4 for _, h, w in grids]
        assert ours.deepstack == []
        assert rel_err(ours.embeds, expected) <= TOL


def test_cosmos3_edge_video_parity_with_transformers(checkpoint):
    name, _, reference, tower = checkpoint
    if not tower.spec.video:
        pytest.skip(f"{name} takes images only")
    pixels = random_pixels(tower, VIDEO_GRIDS, 5)
    ours = run_ours(tower, VIDEO_GRIDS, pixels)
    assert tower.required_capacity(VIDEO_GRIDS).segments == sum(t for t, _, _ in VIDEO_GRIDS)  # a segment a frame
    assert rel_err(ours.embeds, reference_features(tower, reference, pixels, VIDEO_GRIDS, video=True)) <= TOL


def test_padding_to_a_larger_capacity_changes_nothing(checkpoint):
    _, _, _, tower = checkpoint
    grids = IMAGE_GRIDS[:3]
    pixels = random_pixels(tower, grids)
    exact = run_ours(tower, grids, pixels)
    out, cap = run_padded(tower, grids, pixels)
    meta = tower.build_metadata(grids, cap)
    assert all(isinstance(v, np.ndarray) and v.shape[0] in (cap.patches, cap.segments + 1) for v in meta.values())
    assert out.embeds.shape[0] == tower.geometry.output_rows(cap)
    assert torch.equal(out.embeds[: exact.embeds.shape[0]], exact.embeds)


def test_released_tensor_names_load(checkpoint, tmp_path):
    """PaddleOCR-VL: save_pretrained writes the releases' names (`visual.vision_model.*`, the projector as
    `mlp_AR.*`), the model's own are `model.visual.*` / `model.projector.*`; the releases also carry a pooling
    head and a packing position table the served path never runs. Cosmos3-Edge: the blocks' `q_proj` / `fc1`,
    where save_pretrained writes `to_q` / `up_proj`."""
    name, folder, _, tower = checkpoint
    state = load_file(str(folder / "model.safetensors"))
    if name == "tiny-paddleocr-vl":
        def released(k: str) -> str:
            for old, new in [("visual.", "model.visual."), ("mlp_AR.", "model.projector.")]:
                if k.startswith(old):
                    return new + k[len(old):]
            return k
        assert any(k.startswith("mlp_AR.") for k in state)  # what save_pretrained wrote
        extra = {"model.visual.vision_model.head.probe": torch.zeros(1, 1, 64),
                 "model.visual.vision_model.embeddings.packing_position_embedding.weight": torch.zeros(64, 64),
                 "visual.vision_model.head.probe": torch.zeros(1, 1, 64)}
    else:
        def released(k: str) -> str:
            for old, new in [("to_q.", "q_proj."), ("to_k.", "k_proj."), ("to_v.", "v_proj."),
                             ("mlp.up_proj.", "mlp.fc1."), ("mlp.down_proj.", "mlp.fc2.")]:
                k = k.replace(old, new) if k.startswith("model.visual.") else k
            return k
        extra = {}
        assert any(".self_attn.to_q." in k for k in state)  # what save_pretrained wrote
    renamed = {released(k): v for k, v in state.items()}
    assert set(renamed) != set(state)
    other = tmp_path / "released"
    other.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    save_file({**renamed, **extra}, str(other / "model.safetensors"), metadata={"format": "pt"})
    again = load_tower(str(other), device="cpu", dtype="float32")
    pixels = random_pixels(tower, IMAGE_GRIDS)
    assert torch.equal(run_ours(again, IMAGE_GRIDS, pixels).embeds, run_ours(tower, IMAGE_GRIDS, pixels).embeds)


@pytest.mark.parametrize("side", [8, 16, 27])
def test_antialias_weights_equal_interpolate(side):
    """Per-patch row and column weights reproduce F.interpolate(bilinear, antialias=True) of the whole table,
    up- and downsampling, in merge-block and row-major order."""
    gen = torch.Generator().manual_seed(side)
    table = torch.randn(side * side, 24, generator=gen)
    image = table.view(side, side, -1).permute(2, 0, 1)[None]
    for h, w in [(2, 2), (2, 14), (4, 6), (8, 8), (16, 16), (26, 28), (10, 36), (56, 4), (96, 54)]:
        full = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=False, antialias=True)[0]
        for merge in (1, 2):
            cap = Capacity(patches=h * w, segments=1)
            meta = {k: torch.from_numpy(v) for k, v in antialias_metadata([(1, h, w)], cap, merge, side).items()}
            ours = resample_separable(table, meta)
            rows = full.permute(1, 2, 0).reshape(h // merge, merge, w // merge, merge, -1).transpose(1, 2)
            assert (ours - rows.reshape(h * w, -1)).abs().max() <= 1e-6 * full.abs().max()


def test_antialias_positions_equal_cosmos3_edge_own():
    from transformers.models.cosmos3_edge.modeling_cosmos3_edge import Cosmos3EdgeVisionEmbeddings

    table = torch.randn(256, 32, generator=torch.Generator().manual_seed(3))
    grids = [(1, 8, 12), (1, 2, 2), (3, 6, 4), (1, 40, 18)]
    cap = Capacity(patches=sum(t * h * w for t, h, w in grids) + 8, segments=9)
    meta = {k: torch.from_numpy(v) for k, v in antialias_metadata(grids, cap, 2, 16).items()}
    ours = resample_separable(table, meta)
    ref = Cosmos3EdgeVisionEmbeddings.resize_positional_embeddings(table.view(16, 16, -1), torch.tensor(grids), 2)
    assert (ours[: len(ref)] - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.equal(ours[len(ref):], torch.zeros(8, 32))  # padding rows weigh nothing


@pytest.mark.parametrize("merge", [1, 2])
def test_half_pixel_taps_equal_transformers_helper(merge):
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    for h, w in [(2, 2), (4, 6), (8, 8), (24, 24), (10, 36), (56, 4)]:
        idx, wts = get_vision_interpolation_indices_and_weights(
            torch.tensor([[1, h, w]]), num_grid_per_side=27, mode="bilinear", align_corners=False,
            spatial_merge_size=merge)
        ours_idx, ours_w = half_pixel_frame_taps(h, w, merge, 27)
        np.testing.assert_array_equal(ours_idx, idx.numpy())
        np.testing.assert_array_equal(ours_w, wts.numpy())


def test_raster_merge_index_equals_the_projector_reshape():
    grids = [(1, 4, 6), (3, 2, 4), (1, 6, 2)]
    n = sum(t * h * w for t, h, w in grids)
    x = torch.arange(n)
    index = raster_merge_index(grids, 2, n + 8)
    expected, start = [], 0
    for t, h, w in grids:  # PaddleOCRProjector's reshape of a row-major item
        item = x[start : start + t * h * w].reshape(t, h // 2, 2, w // 2, 2).transpose(2, 3)
        expected.append(item.reshape(-1))
        start += t * h * w
    assert torch.equal(x[torch.from_numpy(index[:n])], torch.cat(expected))
    assert (index[n:] == np.arange(n, n + 8)).all()


def test_patch_embeddings_read_rows_in_either_layout():
    """A Conv2d checkpoint on (row, col, channel) rows, and a Linear one trained on those rows fed
    (channel, row, col) ones: each gives the convolution's result once its columns are reordered."""
    gen = torch.Generator().manual_seed(0)
    patches = torch.randn(5, 3, 4, 4, generator=gen)
    chw, hwc = patches.reshape(5, -1), patches.permute(0, 2, 3, 1).reshape(5, -1)
    conv = Conv2dPatches(3, 8, 4, rows="hwc")
    expected = conv._conv_forward(patches, conv.weight, conv.bias).flatten(1)
    for fused in (False, True):
        if fused:
            conv.fuse()
        assert torch.allclose(conv(hwc), expected, atol=1e-6)
    plain = Conv2dPatches(3, 8, 4, rows="chw")
    plain.load_state_dict(conv.state_dict())
    assert torch.allclose(plain(chw), expected, atol=1e-6)
    linear = LinearPatches(3, 1, 4, 8, weight_layout="hwc", rows="chw")
    with torch.no_grad():
        linear.weight.copy_(conv.weight.permute(0, 2, 3, 1).reshape(8, -1))
        linear.bias.copy_(conv.bias)
    linear.fuse()
    assert torch.allclose(linear(chw), expected, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_patch_embeddings_pad_their_inner_dimension_to_a_multiple_of_8(bias):
    """A 14x14 RGB patch is 588 inputs: fused, the weight carries 4 zero columns (what kept cuBLAS on kernels
    whose rows do not change with the row count) and the rows are padded to match, with the same result."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(7, 588, generator=gen)
    for embed in (Conv2dPatches(3, 16, 14, bias=bias), LinearPatches(3, 1, 14, 16, "chw", "chw", bias=bias)):
        expected = embed(rows)
        embed.fuse()
        assert embed.flat is not None and embed.flat.shape == (16, 592)
        assert torch.equal(embed.flat[:, 588:], torch.zeros(16, 4))
        assert torch.allclose(embed(rows), expected, atol=1e-6)



def sample_items(tower):
    from service.media.image_preprocess import preprocess_image_bytes
    from service.media.video_preprocess import preprocess_video_bytes
    from tests.test_cli import SAMPLE, VIDEO

    items = [preprocess_image_bytes(SAMPLE.read_bytes(), tower.processor)]
    if tower.spec.video:
        items.append(preprocess_video_bytes(VIDEO.read_bytes(), tower.processor))
    return items


def check_against_transformers(tower, reference, item, got: torch.Tensor) -> None:
    expected = reference_features(tower, reference, torch.from_numpy(item.pixels), [item.grid_thw],
                                  video=item.modality == "video")
    assert got.shape == expected.shape == (math.prod(item.grid_thw) // 4, tower.out_hidden_size)
    assert rel_err(got, expected) <= TOL


def test_sample_media_through_the_graph_pool(checkpoint):
    """The bundled sample image (and video) preprocessed by the family's rules and encoded through the pool of
    fixed-shape forwards the server runs, equal to transformers' model on those pixels."""
    from graphs.runner import GraphRunner, plan_for

    _, _, reference, tower = checkpoint
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, max_batch_tokens=1024))
    runner.capture()
    items = sample_items(tower)
    for item, out in zip(items, runner.encode(items)):
        check_against_transformers(tower, reference, item, out.embeds)


def test_vitserve_encode_serves_a_cosmos3_edge_checkpoint(tmp_path):
    """`vitserve encode --model <folder>` on an image and a video, in its own process."""
    from safetensors import safe_open

    from tests.test_cli import SAMPLE, VIDEO, vitserve

    folder = tmp_path / "cosmos3-edge"
    reference = write_checkpoint("tiny-cosmos3-edge", folder)
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    out = tmp_path / "out.safetensors"
    done = vitserve("encode", "--model", str(folder), "--max-batch-tokens", "1024", "-o", str(out), str(SAMPLE),
                    str(VIDEO))
    assert done.returncode == 0, done.stderr
    with safe_open(str(out), "pt") as f:
        for k, item in enumerate(sample_items(tower)):
            assert f.get_tensor(f"grid_thw.{k}").tolist() == [list(item.grid_thw)]
            check_against_transformers(tower, reference, item, f.get_tensor(f"embeds.{k}"))
