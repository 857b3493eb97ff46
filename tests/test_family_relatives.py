"""The relatives of the Qwen and GLM towers (Qwen4-Exp, Cosmos3-Omni, GLMGA, HyperCLOVAX-SEED Vision V2,
GLM-5-Next) against transformers' own models, loaded from the checkpoints transformers' `save_pretrained`
writes for them (fp32, CPU): images through the model's `get_image_features` and videos through its
`get_video_features`, the entry points the released models call (HyperCLOVAX's include its projection, GLM's
run each frame pair as its own grid); DeepStack where the family has it; grids larger and smaller than the
position tables, square and not; the rows per item; the key layouts each family's checkpoints use; the part
each family adds (the clamp, the projection) shown to matter; the released-size presets' parameters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import load_tower
from models.loader import build_tower, check_model, family_of, family_processor_config
from models.presets import PRESETS, full_config
from tests.checkpoints import CLASSES, reference_model
from tests.test_towers import assert_cli_encode_equals_reference, normalized, random_pixels, rel_err, run_ours

NAMES = ["tiny-qwen4-exp", "tiny-cosmos3-omni", "tiny-glmga", "tiny-hyperclovax-vision-v2", "tiny-glm5-next"]
# Larger and smaller than the tiny position tables (8x8 patches), square and not, odd window tilings.
IMAGE_GRIDS = [(1, 8, 12), (1, 16, 8), (1, 2, 2), (1, 20, 36), (1, 10, 6)]
VIDEO_GRIDS = [(2, 8, 12), (1, 6, 6), (3, 10, 6)]
TOL = 1e-5


def write_family_checkpoint(name: str, folder):
    """tests.checkpoints.write_checkpoint, with every vector of the model's vision side (the projection's bias
    too, which transformers initialises to zeros) made non-trivial."""
    model = reference_model(name)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "projector" in key:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    preset = PRESETS[name]
    (folder / "preprocessor_config.json").write_text(json.dumps(preset.preprocessor))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(preset.video_preprocessor or preset.preprocessor))
    return model


@pytest.fixture(scope="module", params=NAMES)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    reference = write_family_checkpoint(request.param, folder)
    return request.param, folder, reference


def features(out) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Merged tokens, DeepStack features and rows per item of a get_*_features output."""
    deepstack = [torch.cat(f) for f in (getattr(out, "deepstack_features", None) or [])]
    return torch.cat(out.pooler_output), deepstack, [len(x) for x in out.pooler_output]


def assert_equal_to_reference(name: str, tower, ours, out, grids, modality: str) -> None:
    embeds, deepstack, rows = features(out)
    assert ours.embeds.shape == embeds.shape
    assert rows == [tower.geometry.tokens(g, modality) for g in grids]
    assert rel_err(ours.embeds, embeds) <= TOL
    levels = len(PRESETS[name].vision.get("deepstack_visual_indexes", [])) if tower.spec.deepstack else 0
    assert len(ours.deepstack) == len(deepstack) == levels
    for a, b in zip(ours.deepstack, deepstack):
        assert rel_err(a, b) <= TOL


def test_image_parity_with_transformers(checkpoint):
    name, folder, reference = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    pixels = random_pixels(tower, IMAGE_GRIDS)
    ours = run_ours(tower, IMAGE_GRIDS, pixels)
    with torch.no_grad():
        out = reference.model.get_image_features(pixel_values=normalized(tower, pixels),
                                                 image_grid_thw=torch.tensor(IMAGE_GRIDS))
    assert_equal_to_reference(name, tower, ours, out, IMAGE_GRIDS, "image")


def test_video_parity_with_transformers(checkpoint):
    name, folder, reference = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    pixels = random_pixels(tower, VIDEO_GRIDS, 7)
    cap = tower.required_capacity(VIDEO_GRIDS, "video")
    meta = {k: torch.from_numpy(v) for k, v in tower.build_metadata(VIDEO_GRIDS, cap).items()}
    with torch.no_grad():
        ours = tower(pixels, meta, cap)
        out = reference.model.get_video_features(pixel_values_videos=normalized(tower, pixels),
                                                 video_grid_thw=torch.tensor(VIDEO_GRIDS))
    assert_equal_to_reference(name, tower, ours, out, VIDEO_GRIDS, "video")


def test_the_checkpoint_passes_the_header_check(checkpoint):
    name, folder, _ = checkpoint
    assert check_model(str(folder)) == PRESETS[name].family


RELAYOUT = {
    # save_pretrained writes Cosmos3's vision tensors flat, as its releases keep them; a re-saved copy that
    # kept transformers' names has them under `model.visual.`
    "tiny-cosmos3-omni": ("blocks.0.attn.qkv.weight", lambda k: k if k.startswith(("layers.", "embed_tokens.",
                                                                                   "norm.", "lm_head."))
                          else f"model.visual.{k}"),
    # the released name of the projection, and the one transformers gives it once loaded
    "tiny-hyperclovax-vision-v2": ("model.vision_projector.weight",
                                   lambda k: k.replace("model.vision_projector.", "model.projector.")),
}


@pytest.mark.parametrize("checkpoint", sorted(RELAYOUT), indirect=True)
def test_both_key_layouts_load(checkpoint, tmp_path):
    name, folder, _ = checkpoint
    key, rename = RELAYOUT[name]
    state = load_file(str(folder / "model.safetensors"))
    assert key in state and not any(k.startswith("model.visual.") for k in state)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    renamed = {rename(k): v for k, v in state.items()}
    assert set(renamed) != set(state)
    save_file(renamed, str(other / "model.safetensors"), metadata={"format": "pt"})
    base = load_tower(str(folder), device="cpu", dtype="float32")
    tower = load_tower(str(other), device="cpu", dtype="float32")
    pixels = random_pixels(base, IMAGE_GRIDS)
    assert torch.equal(run_ours(tower, IMAGE_GRIDS, pixels).embeds, run_ours(base, IMAGE_GRIDS, pixels).embeds)


@pytest.mark.parametrize("checkpoint", ["tiny-hyperclovax-vision-v2"], indirect=True)
def test_a_config_naming_the_hub_s_model_type_loads(checkpoint, tmp_path):
    """HyperCLOVAX's config class takes `model_type: "vlm"` (and a "qwen2_5_vl" vision config), which transformers'
    registry does not know: the loader reads such a folder with that class, to the same tower."""
    _, folder, _ = checkpoint
    other = tmp_path / "vlm"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"], config["vision_config"]["model_type"] = "vlm", "qwen2_5_vl"
    (other / "config.json").write_text(json.dumps(config))
    assert check_model(str(other)) == "hyperclovax_vision_v2"
    base = load_tower(str(folder), device="cpu", dtype="float32")
    tower = load_tower(str(other), device="cpu", dtype="float32")
    pixels = random_pixels(base, IMAGE_GRIDS)
    assert torch.equal(run_ours(tower, IMAGE_GRIDS, pixels).embeds, run_ours(base, IMAGE_GRIDS, pixels).embeds)


def test_the_parts_these_families_add_matter():
    """GLM-5's clamp changes its output (the tiny preset clamps at 0.1, which its activations pass), and
    HyperCLOVAX's output is the projection's: the language model's width (64), not the merger's (80)."""
    tower = load_tower("tiny-glm5-next", device="cpu", dtype="float32")
    pixels = random_pixels(tower, IMAGE_GRIDS)
    clamped = run_ours(tower, IMAGE_GRIDS, pixels).embeds
    for module in tower.modules():
        if hasattr(module, "limit"):
            module.limit = None
    assert rel_err(run_ours(tower, IMAGE_GRIDS, pixels).embeds, clamped) > 1e-2
    tower = load_tower("tiny-hyperclovax-vision-v2", device="cpu", dtype="float32")
    assert tower.out_hidden_size == 64 and tower.dims.out == 80
    assert run_ours(tower, IMAGE_GRIDS, random_pixels(tower, IMAGE_GRIDS)).embeds.shape[1] == 64


@pytest.mark.parametrize("preset", ["random:qwen3.8-flash-next", "random:cosmos3-nano",
                                    "random:hyperclovax-seed-think-32b", "random:glm-5.3-flash"])
def test_full_size_parameters_match_transformers(preset):
    """The released-size presets build the towers transformers builds for those configs (names and shapes,
    the projection included)."""
    import transformers

    p = PRESETS[preset]
    cfg = full_config(p)
    vision = family_of(p.family).vision_config(cfg)
    ours = build_tower(p.family, vision, family_processor_config(p.family, p.preprocessor, p.video_preprocessor),
                       "sdpa")
    with torch.device("meta"):
        model = getattr(transformers, CLASSES[p.family])._from_config(cfg).model
    visual = model.vision_model if hasattr(model, "vision_model") else model.visual
    expected = {k: tuple(v.shape) for k, v in visual.state_dict().items()}
    if hasattr(model, "projector"):
        expected.update({f"projector.{k}": tuple(v.shape) for k, v in model.projector.state_dict().items()})
        assert vision.projection_size == cfg.text_config.hidden_size == 5120
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == expected


@pytest.mark.parametrize("checkpoint", ["tiny-glm5-next"], indirect=True)
def test_vitserve_encode_serves_a_glm5_checkpoint(checkpoint, tmp_path):
    """`vitserve encode --model <folder>` on a GLM-5-Next checkpoint: an image and a video, sized and padded by
    its own rules, encoded equal to transformers' model on those pixels."""
    _, folder, reference = checkpoint
    assert_cli_encode_equals_reference(folder, reference, tmp_path, TOL)
