"""ERNIE-4.5-VL and MiniMax-M3 against transformers' own models, loaded from the same safetensors written by
`save_pretrained` (fp32, CPU): images through `get_image_features`, videos through `get_video_features`,
several sizes and batches; the token count per item (ERNIE: a video's frames pair up) against the reference's
and its processor's placeholder count; padding to a larger capacity; the item geometries the packing reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models import load_tower
from models.config import ProcessorConfig
from models.geometries import ClipSegmentsGeometry, TemporalPairGeometry
from models.loader import build_tower
from models.presets import PRESETS, full_config
from models.rotary import AxialRotary
from tests.checkpoints import CLASSES
from tests.test_towers import normalized, random_pixels, rel_err, run_ours, run_padded

TOL = 1e-4
PRESET_NAMES = ["tiny-ernie4.5-vl-moe", "tiny-minimax-m3"]
IMAGE_GRIDS = [(1, 8, 12), (1, 16, 8), (1, 2, 2), (1, 20, 36), (1, 10, 6)]
# ERNIE: even frame counts (its processor repeats the last frame of an odd count: transformers' model fails on
# an odd one, whose last frame its resampler drops but its split counts); MiniMax: clips longer than
# its four-temporal-patch attention segments, and one shorter.
VIDEO_GRIDS = {"tiny-ernie4.5-vl-moe": [(4, 8, 12), (2, 6, 6), (6, 4, 10)],
               "tiny-minimax-m3": [(6, 8, 12), (3, 6, 6), (9, 4, 4)]}


def reference_model(name: str, seed: int = 0):
    """transformers' whole model for a tiny preset, fp32, seeded, with non-trivial norms and biases in the
    tower and its projector, and matrices scaled to their fan-in, so that attention mixes patches as much as a
    trained tower's does (transformers' 0.02 init leaves it near uniform: a wrong segment or position would
    hide in the tolerance). The text part is never run."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[PRESETS[name].family])._from_config(
        full_config(PRESETS[name]), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "language_model" in key:
                continue
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, p[0].numel() ** -0.5)
    return model.eval()


@pytest.fixture(scope="module", params=PRESET_NAMES)
def checkpoint(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name.replace(".", "_"))
    model = reference_model(name)
    write_folder(name, model, folder)
    return name, load_tower(str(folder), device="cpu", dtype="float32"), model


def write_folder(name: str, model, folder) -> None:
    """save_pretrained plus the preset's preprocessor configs (ERNIE's draws no timestamps: no font ships)."""
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PRESETS[name].preprocessor))
    if PRESETS[name].video_preprocessor:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(PRESETS[name].video_preprocessor))


def test_image_parity_with_transformers(checkpoint):
    _, tower, model = checkpoint
    for seed, grids in enumerate([IMAGE_GRIDS, IMAGE_GRIDS[:1], IMAGE_GRIDS[::-1]]):
        pixels = random_pixels(tower, grids, seed)
        ours = run_ours(tower, grids, pixels)
        with torch.no_grad():
            out = model.model.get_image_features(pixel_values=normalized(tower, pixels),
                                                 image_grid_thw=torch.tensor(grids))
        expected = torch.cat(out.pooler_output)
        assert [len(p) for p in out.pooler_output] == [tower.geometry.tokens(g, "image") for g in grids]
        assert ours.embeds.shape == expected.shape == (sum(h * w for _, h, w in grids) // 4, tower.out_hidden_size)
        assert rel_err(ours.embeds, expected) <= TOL


def test_video_parity_with_transformers(checkpoint):
    """A video item is one grid here; transformers' MiniMax takes it as its processor cuts it (one grid per
    attention segment of four temporal patches, positions restarting in each)."""
    name, tower, model = checkpoint
    grids = VIDEO_GRIDS[name]
    pixels = random_pixels(tower, grids, 3)
    cap = tower.required_capacity(grids, "video")
    meta = {k: torch.from_numpy(v) for k, v in tower.build_metadata(grids, cap).items()}
    with torch.no_grad():
        ours = tower(pixels, meta, cap).embeds
    reference_grids = grids
    if isinstance(tower.geometry, ClipSegmentsGeometry):
        reference_grids = [(n, h, w) for t, h, w in grids for n in tower.geometry.frames((t, h, w))]
    with torch.no_grad():
        out = model.model.get_video_features(pixel_values_videos=normalized(tower, pixels),
                                             video_grid_thw=torch.tensor(reference_grids))
    expected = torch.cat(out.pooler_output)
    tokens = [tower.geometry.tokens(g, "video") for g in grids]
    assert ours.shape[0] == tower.geometry.output_rows(cap) == sum(tokens) == expected.shape[0]
    assert rel_err(ours, expected) <= TOL


def test_padding_to_a_larger_capacity_changes_nothing(checkpoint):
    name, tower, _ = checkpoint
    for modality, grids in (("image", IMAGE_GRIDS[:3]), ("video", VIDEO_GRIDS[name][:2])):
        pixels = random_pixels(tower, grids)
        need = tower.required_capacity(grids, modality)
        exact_meta = {k: torch.from_numpy(v) for k, v in tower.build_metadata(grids, need).items()}
        with torch.no_grad():
            exact = tower(pixels, exact_meta, need).embeds
        result, cap = run_padded(tower, grids, pixels, modality)
        out = result.embeds
        assert all(isinstance(v, np.ndarray) for v in tower.build_metadata(grids, cap).values())
        assert out.shape[0] == tower.geometry.output_rows(cap)
        assert rel_err(out[: exact.shape[0]], exact) < 1e-6, modality


def test_geometries():
    pair = TemporalPairGeometry(2)
    assert pair.tokens((1, 8, 12)) == 24 and pair.tokens((6, 8, 12), "video") == 72
    assert pair.segment_lengths((6, 8, 12)) == [96] * 6 and not pair.splits_over_time
    clip = ClipSegmentsGeometry(2, segment_frames=4)
    assert clip.frames((9, 4, 4)) == [4, 4, 1] and clip.segment_lengths((9, 4, 4)) == [64, 64, 16]
    assert clip.tokens((9, 4, 4)) == 36 and clip.whole_clip and not clip.splits_over_time
    assert ClipSegmentsGeometry(2).frames((9, 4, 4)) == [9]


def test_a_one_frame_video_is_refused_for_ernie():
    """A video's rows are at most half its blocks (what a graph's output holds): its processor pads one frame
    to two, and a grid of one frame is refused rather than overrun."""
    tower = load_tower("tiny-ernie4.5-vl-moe", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="at least two frames"):
        tower.required_capacity([(1, 4, 4)], "video")


def test_ernie_placeholders_equal_the_tokens():
    """Ernie4_5_VLMoeProcessor's own placeholder expansion (its methods, on the settings its image and video
    processors hold) gives each item as many tokens as the geometry: the rows vitserve returns."""
    from types import SimpleNamespace

    from transformers.models.ernie4_5_vl_moe.processing_ernie4_5_vl_moe import Ernie4_5_VLMoeProcessor

    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2), image_token="I", video_token="V",
                                video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2))
    geometry = TemporalPairGeometry(2)
    for t, h, w in [(1, 8, 12), (4, 8, 12), (2, 6, 6), (10, 20, 4)]:
        grid = torch.tensor([[t, h, w]])
        if t == 1:
            text = Ernie4_5_VLMoeProcessor.replace_image_token(processor, {"image_grid_thw": grid}, 0)
        else:
            text = Ernie4_5_VLMoeProcessor.replace_video_token(processor, {"video_grid_thw": grid}, 0)
        assert len(text) == geometry.tokens((t, h, w), "image" if t == 1 else "video")


def test_minimax_rotary_bands_match_transformers():
    """AxialRotary over three axes has MiniMax's frequencies and rotated width (a partial rotary)."""
    from transformers import AutoConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLVisionRotaryEmbedding

    for heads, hidden in ((16, 1280), (4, 64), (8, 96)):
        cfg = AutoConfig.for_model("minimax_m3_vl", vision_config=dict(hidden_size=hidden, num_attention_heads=heads))
        ref = MiniMaxM3VLVisionRotaryEmbedding(cfg.vision_config)
        ours = AxialRotary(hidden // heads, 10000.0, axes=3)
        assert torch.equal(ours.inv_freq, ref.inv_freq)
        pos = torch.tensor([[0, 1, 2], [3, 5, 7]])
        cos, _ = ref(torch.zeros(1), pos)
        ours_cos, _ = ours(pos)
        assert ours_cos.shape[-1] == cos.shape[-1] == ours.rotated_dims <= hidden // heads
        assert torch.allclose(ours_cos[:, 0, 0], cos)


@pytest.mark.parametrize("preset", ["random:ernie-4.5-vl-28b-a3b", "random:minimax-m3"])
def test_full_size_parameters_match_transformers(preset):
    """The released sizes: our tower holds as many parameters, of the same shapes, as transformers' tower and
    projector."""
    import transformers

    p = PRESETS[preset]
    cfg = full_config(p)
    processor = ProcessorConfig.from_dicts(p.family, p.preprocessor, p.video_preprocessor)
    ours = build_tower(p.family, tower_config(p.family, cfg), processor, "sdpa")
    with torch.device("meta"):
        ref = getattr(transformers, CLASSES[p.family])._from_config(cfg).model
    shapes = sorted(tuple(v.shape) for k, v in ref.state_dict().items() if "language_model" not in k)
    assert sorted(tuple(v.shape) for v in ours.state_dict().values()) == shapes
    assert sum(x.numel() for x in ours.parameters()) > 600e6


def tower_config(family: str, cfg):
    from models.families import FAMILIES

    return FAMILIES[family].vision_config(cfg)


def test_a_clip_of_more_segments_than_a_graph_holds_runs_eagerly():
    """MiniMax cuts a video into attention segments of four temporal patches: with one item per batch, a video
    of eight temporal patches (two segments) is beyond every graph's segments and runs eagerly, not crashing
    the packing."""
    from graphs.packing import eager_reason, pack
    from graphs.runner import plan_for, to_pack_item
    from models.config import VisualInput

    tower = load_tower("tiny-minimax-m3", device="cpu", dtype="float32")
    video = VisualInput("video", np.zeros((8 * 16, tower.processor.patch_dim), np.uint8), (8, 4, 4))
    one = plan_for(tower, max_batch_tokens=256, budgets=[64, 256], max_items=1)
    item = to_pack_item(video, tower.geometry)
    assert item.segments == 2 and eager_reason(item, one) == "too_many_segments"
    assert [b.reason for b in pack([item], one)] == ["too_many_segments"]
    two = plan_for(tower, max_batch_tokens=256, budgets=[64, 256], max_items=2)
    assert eager_reason(item, two) is None and pack([item], two)[0].replays


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_benchmark_reference_carries_the_tower_s_weights(name):
    """service.bench.towers.hf_visual (the GPU tests' and `vitserve bench`'s reference) for a family with a
    projector beside its vision model: transformers' whole model loaded from the tower's weights under the
    checkpoints' names, equal to the tower on images and (MiniMax: cut into segments) videos."""
    from service.bench.towers import hf_grid_thw, hf_visual

    tower = load_tower(name, device="cpu", dtype="float32")
    reference = hf_visual(tower)
    for modality, grids in (("image", IMAGE_GRIDS[:3]), ("video", VIDEO_GRIDS[name][:2])):
        pixels = random_pixels(tower, grids, 1)
        cap = tower.required_capacity(grids, modality)
        meta = {k: torch.from_numpy(v) for k, v in tower.build_metadata(grids, cap).items()}
        with torch.no_grad():
            ours = tower(pixels, meta, cap).embeds
            expected = reference(normalized(tower, pixels), grid_thw=torch.tensor(hf_grid_thw(tower, grids)))
        assert rel_err(ours, expected) <= TOL, modality


def test_vitserve_encode_serves_both_checkpoints(checkpoint, tmp_path):
    """`vitserve encode --model <folder>`: an image and a video, preprocessed by the family's rules, encoded
    equal to transformers on those pixels, with the family's own token counts (ERNIE: a video's frames pair)."""
    from safetensors import safe_open

    from service.bench.towers import hf_grid_thw
    from service.media.image_preprocess import preprocess_image_bytes
    from service.media.video_preprocess import preprocess_video_bytes
    from tests.test_cli import SAMPLE, VIDEO, vitserve

    name, tower, model = checkpoint
    folder = tmp_path / "model"
    write_folder(name, model, folder)
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    media = [str(SAMPLE), str(VIDEO)]
    out = tmp_path / "out.safetensors"
    done = vitserve("encode", "--model", str(folder), "-o", str(out), *media)
    assert done.returncode == 0, done.stderr
    image = preprocess_image_bytes(SAMPLE.read_bytes(), tower.processor)
    with torch.no_grad():
        expected = [torch.cat(model.model.get_image_features(
            pixel_values=normalized(tower, torch.from_numpy(image.pixels)),
            image_grid_thw=torch.tensor([image.grid_thw])).pooler_output)]
    video = preprocess_video_bytes(VIDEO.read_bytes(), tower.processor)
    grids = hf_grid_thw(tower, [video.grid_thw])  # MiniMax: one grid per attention segment
    with torch.no_grad():
        expected.append(torch.cat(model.model.get_video_features(
            pixel_values_videos=normalized(tower, torch.from_numpy(video.pixels)),
            video_grid_thw=torch.tensor(grids)).pooler_output))
    assert expected[1].shape[0] == tower.geometry.tokens(video.grid_thw, "video")
    with safe_open(str(out), "pt") as f:
        for k, want in enumerate(expected):
            got = f.get_tensor(f"embeds.{k}")
            assert got.shape == want.shape and rel_err(got, want) <= TOL


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_server_counts_each_item_s_rows(name):
    """A real server on loopback (`/encode`, float output): an image and a video batched together, each item's
    `num_tokens` and embedding rows as the family's geometry counts them (ERNIE's video: half its blocks), the
    bytes equal to the item's eager forward alone."""
    import base64

    from graphs.runner import GraphRunner, plan_for
    from models.config import VisualInput
    from service.media.image_preprocess import preprocess_image_bytes
    from service.media.video_preprocess import preprocess_video_bytes
    from tests.http_helpers import ServerThread, image_bytes, settings
    from tests.videos import make_video

    media = [("image", image_bytes(150, 100, seed=3)), ("video", make_video(20, fps=10, width=96, height=64))]
    body = {"items": [{"type": kind, kind: base64.b64encode(data).decode()} for kind, data in media]}
    with ServerThread(settings(model=name)) as srv, srv.client() as client:
        response = client.post("/encode", json=body)
    assert response.status_code == 200, response.text
    tower = load_tower(name, device="cpu", dtype="float32")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower), use_graphs=False)
    items: list[VisualInput] = [preprocess_image_bytes(media[0][1], tower.processor),
                                preprocess_video_bytes(media[1][1], tower.processor)]
    for entry, item in zip(response.json()["data"], items):
        rows = tower.geometry.tokens(item.grid_thw, item.modality)
        assert entry["grid_thw"] == list(item.grid_thw) and entry["num_tokens"] == rows
        got = torch.tensor(entry["embedding"], dtype=torch.float32)
        assert got.shape == (rows, tower.out_hidden_size)
        alone = runner.encode([item])[0].embeds
        assert rel_err(got, alone) <= 1e-6
    if name.startswith("tiny-ernie"):
        t, h, w = items[1].grid_thw
        assert t % 2 == 0 and response.json()["data"][1]["num_tokens"] == t // 2 * h * w // 4
