"""Our towers against transformers' vision models loaded from the same safetensors (fp32, CPU), for
every family: checkpoints written by transformers' own classes (save_pretrained), images and videos,
DeepStack where the family has it, both key layouts, a sharded checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models import CheckpointError, load_tower
from models.families import FAMILIES as SPECS
from models.loader import build_tower
from models.presets import PRESETS, full_config
from tests.checkpoints import reference_features, write_checkpoint

# The first three are the towers every other family derives from: they get the longer checks (more grid
# sets, a sharded checkpoint written by save_pretrained itself); the rest are kept quick for CI.
BASES = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl")
FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5",
            "tiny-qwen3.5-moe", "tiny-qwen2.5-omni", "tiny-qwen3-omni-moe", "tiny-exaone4.5", "tiny-cohere-compass"]
# Sizes chosen to cover odd window tilings (Qwen2.5-VL), non-square grids, videos (t > 1) and
# grids larger and smaller than Qwen3-VL's 8x8 position table.
GRIDS = [(1, 8, 12), (1, 16, 8), (2, 4, 4), (1, 2, 2), (1, 20, 36), (3, 10, 6)]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    reference = write_checkpoint(request.param, folder)
    return request.param, folder, reference


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_ours(tower, grids, pixels):
    cap = tower.required_capacity(grids)
    meta = {k: torch.from_numpy(v) for k, v in tower.build_metadata(grids, cap).items()}
    with torch.no_grad():
        return tower(pixels, meta, cap)


def run_reference(model, tower, grids, pixels):
    x = torch.from_numpy(tower.processor.normalize(pixels.numpy()))
    if hasattr(model, "model") and hasattr(model.model, "get_image_features"):  # the model's own entry point
        with torch.no_grad():
            out = model.model.get_image_features(pixel_values=x, image_grid_thw=torch.tensor(grids))
        deepstack = [torch.cat(f) for f in (getattr(out, "deepstack_features", None) or [])]
        return torch.cat(out.pooler_output), deepstack
    return reference_features(model, x, grids)  # the Omni models: their thinker's vision encoder


def normalized(tower, pixels: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(tower.processor.normalize(pixels.numpy()))


def assert_cli_encode_equals_reference(folder, reference, tmp_path, tol: float) -> None:
    """`vitserve encode --model <folder>` on the sample image and video: each sized by the family's own rules
    and encoded equal (relative error <= `tol`) to transformers' `reference` model on those pixels."""
    from safetensors import safe_open

    from service.media.image_preprocess import preprocess_image_bytes
    from service.media.video_preprocess import preprocess_video_bytes
    from tests.test_cli import SAMPLE, VIDEO, vitserve

    out = tmp_path / "out.safetensors"
    done = vitserve("encode", "--model", str(folder), "-o", str(out), str(SAMPLE), str(VIDEO))
    assert done.returncode == 0, done.stderr
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    image = preprocess_image_bytes(SAMPLE.read_bytes(), tower.processor)
    video = preprocess_video_bytes(VIDEO.read_bytes(), tower.processor)
    with torch.no_grad():
        ref_image = reference.model.get_image_features(
            pixel_values=normalized(tower, torch.from_numpy(image.pixels)),
            image_grid_thw=torch.tensor([image.grid_thw]))
        ref_video = reference.model.get_video_features(
            pixel_values_videos=normalized(tower, torch.from_numpy(video.pixels)),
            video_grid_thw=torch.tensor([video.grid_thw]))
    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("grid_thw.0").tolist() == [list(image.grid_thw)]
        assert f.get_tensor("grid_thw.1").tolist() == [list(video.grid_thw)]
        assert rel_err(f.get_tensor("embeds.0"), torch.cat(ref_image.pooler_output)) <= tol
        assert rel_err(f.get_tensor("embeds.1"), torch.cat(ref_video.pooler_output)) <= tol


def run_padded(tower, grids, pixels, modality: str = "image"):
    """The forward of `grids` at a capacity larger than they need, as a graph key runs it: 64 more merge units
    of rows (filled with 77), 5 more segments, 7 more windows where the family has them, longer sequences.
    Its output and that capacity."""
    need = tower.required_capacity(grids, modality)
    cap = dataclasses.replace(need, patches=need.patches + 64 * tower.merge_unit, segments=need.segments + 5,
                              windows=need.windows + 7 if need.windows else 0, max_seqlen=need.max_seqlen * 2,
                              max_window_seqlen=need.max_window_seqlen * 2)
    padded = torch.full((cap.patches, pixels.shape[1]), 77, dtype=torch.uint8)
    padded[: len(pixels)] = pixels
    meta = {k: torch.from_numpy(v) for k, v in tower.build_metadata(grids, cap).items()}
    with torch.no_grad():
        return tower(padded, meta, cap), cap


def random_pixels(tower, grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, tower.processor.patch_dim), dtype=torch.uint8, generator=gen)


def test_parity_with_transformers(checkpoint):
    name, folder, reference = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    for seed, grids in enumerate([GRIDS, GRIDS[:1], GRIDS[::-1]] if name in BASES else [GRIDS]):
        pixels = random_pixels(tower, grids, seed)
        ours = run_ours(tower, grids, pixels)
        embeds, deepstack = run_reference(reference, tower, grids, pixels)
        assert ours.embeds.shape == embeds.shape
        assert rel_err(ours.embeds, embeds) <= 1e-5
        expected_layers = len(PRESETS[name].vision.get("deepstack_visual_indexes", []))
        assert tower.num_deepstack == expected_layers
        assert len(ours.deepstack) == len(deepstack) == expected_layers
        for a, b in zip(ours.deepstack, deepstack):
            assert rel_err(a, b) <= 1e-5


def test_padding_to_a_larger_capacity_changes_nothing(checkpoint):
    """The graph path runs at a fixed capacity: padded rows and empty segments must not leak."""
    _, folder, _ = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    grids = GRIDS[:3]
    pixels = random_pixels(tower, grids)
    exact = run_ours(tower, grids, pixels)
    out, _ = run_padded(tower, grids, pixels)
    tokens = exact.embeds.shape[0]
    assert torch.equal(out.embeds[:tokens], exact.embeds) or rel_err(out.embeds[:tokens], exact.embeds) < 1e-6


def test_legacy_visual_keys_and_shards(checkpoint, tmp_path):
    """The other key layout of each family (Qwen2/2.5-VL releases store `visual.*`, transformers 5 writes
    `model.visual.*`; an Omni thinker saved alone stores `visual.*`, the whole model `thinker.visual.*`);
    large checkpoints are sharded with an index."""
    name, folder, reference = checkpoint
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    state = load_file(str(legacy / "model.safetensors"))
    if SPECS[PRESETS[name].family].config_path != ("vision_config",):
        renamed = thinker_alone(legacy, state)
    else:
        renamed = {swap_layout(k): v for k, v in state.items()}
    assert set(renamed) != set(state)
    save_file(renamed, str(legacy / "model.safetensors"), metadata={"format": "pt"})

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    if name in BASES:
        write_checkpoint(name, sharded, max_shard_size="100KB")
    else:  # the same layout, split here: save_pretrained's own sharding is covered by the bases
        reshard(folder, sharded, parts=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1

    base = load_tower(str(folder), device="cpu", dtype="float32")
    pixels = random_pixels(base, GRIDS)
    expected = run_ours(base, GRIDS, pixels).embeds
    for other in (legacy, sharded):
        tower = load_tower(str(other), device="cpu", dtype="float32")
        assert torch.equal(run_ours(tower, GRIDS, pixels).embeds, expected)


def reshard(folder, dest, parts: int) -> None:
    """`folder`'s one safetensors file as `parts` shards with an index, as save_pretrained lays them out."""
    for f in folder.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dest / f.name)
    state = load_file(str(folder / "model.safetensors"))
    keys = sorted(state)
    weight_map = {}
    for i in range(parts):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = keys[i::parts]
        save_file({k: state[k] for k in chunk}, str(dest / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, name))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def thinker_alone(folder, state: dict) -> dict:
    """An Omni checkpoint rewritten as its thinker saved alone: the thinker's config at the top (its own
    model_type), tensors without the `thinker.` prefix, nothing else."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config["thinker_config"]))
    return {k.removeprefix("thinker."): v for k, v in state.items() if k.startswith("thinker.")}


def swap_layout(key: str) -> str:
    """`model.visual.x` <-> `visual.x`: whichever layout transformers wrote, test the other one."""
    if key.startswith("model.visual."):
        return key[len("model.") :]
    if key.startswith("visual."):
        return "model." + key
    return key


def test_missing_unexpected_and_misshaped_tensors_are_reported_together(tmp_path):
    folder = tmp_path / "bad"
    write_checkpoint("tiny-qwen2-vl", folder)
    state = load_file(str(folder / "model.safetensors"))
    prefix = "visual." if "visual.merger.mlp.0.bias" in state else "model.visual."
    state.pop(prefix + "blocks.0.attn.qkv.weight")
    state[prefix + "blocks.0.extra.weight"] = torch.zeros(3)
    state[prefix + "merger.mlp.0.bias"] = torch.zeros(7)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_tower(str(folder), device="cpu")
    msg = str(err.value)
    assert "missing 1: blocks.0.attn.qkv.weight" in msg
    assert "unexpected 1: blocks.0.extra.weight" in msg
    assert "mis-shaped 1: merger.mlp.0.bias" in msg


def test_folder_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a preset name"):
        load_tower(str(tmp_path / "nowhere"), device="cpu")
    folder = tmp_path / "noweights"
    write_checkpoint("tiny-qwen2-vl", folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors"):
        load_tower(str(folder), device="cpu")
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        load_tower(str(folder), device="cpu")
    with pytest.raises(CheckpointError, match="unsupported model_type"):
        build_tower("llava", None, None, "sdpa")


# Kimi-K2.x and Muse read their processor configs their own way and are counted in tests/test_family_kimi.py.
@pytest.mark.parametrize("preset", [name for name in PRESETS if name.startswith("random:")
                                    and "processor_config" not in SPECS[PRESETS[name].family].extra])
def test_full_size_parameter_counts_match_transformers(preset):
    import transformers

    from models.config import ProcessorConfig
    from tests.checkpoints import CLASSES, checkpoint_vision_shapes, visual_of

    p = PRESETS[preset]
    cfg = full_config(p)
    processor = ProcessorConfig.from_dicts(p.family, p.preprocessor)
    ours = build_tower(p.family, SPECS[p.family].vision_config(cfg), processor, "sdpa")
    with torch.device("meta"):
        model = getattr(transformers, CLASSES[p.family])._from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    # what save_pretrained writes of the vision model (where transformers renames tensors on saving, as for
    # LFM3-VL and dots3-note, under those names), read as the loader reads it
    assert shapes == checkpoint_vision_shapes(model, p.family)
    ref = visual_of(model)
    if set(ref.state_dict()) == set(shapes):  # the vision module holds the tower's tensors under its names
        count = lambda m: sum(x.numel() for x in m.parameters())  # noqa: E731
        assert count(ours) == count(ref)
    assert sum(math.prod(s) for s in shapes.values()) > 150e6


def test_metadata_is_host_only_and_padded(checkpoint):
    _, folder, _ = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    need = tower.required_capacity(GRIDS)
    cap = type(need)(need.patches + 16, need.segments + 3, need.windows + 2 if need.windows else 0,
                     need.max_seqlen, need.max_window_seqlen)
    meta = tower.build_metadata(GRIDS, cap)
    assert all(isinstance(v, np.ndarray) for v in meta.values())
    cu = meta["cu_seqlens"]
    assert cu.shape == (cap.segments + 1,) and cu[-1] == need.patches and (np.diff(cu) >= 0).all()
    if "window_index" in meta:
        assert sorted(meta["window_index"]) == list(range(cap.patches // tower.merge_unit))
    with pytest.raises(ValueError, match="capacity"):
        tower.build_metadata(GRIDS, type(need)(need.patches, need.segments - 1, need.windows,
                                               need.max_seqlen, need.max_window_seqlen))


def test_video_parity_with_transformers(checkpoint):
    """Videos through transformers' own video entry point (`get_video_features`): one segment per
    temporal patch, frames repeated in position, DeepStack per frame."""
    _, folder, reference = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    grids = [(4, 8, 12), (1, 6, 6), (3, 10, 6)]
    pixels = random_pixels(tower, grids, 5)
    ours = run_ours(tower, grids, pixels)
    x = torch.from_numpy(tower.processor.normalize(pixels.numpy()))
    if not hasattr(reference, "model") or not hasattr(reference.model, "get_video_features"):
        embeds, deepstack = reference_features(reference, x, grids)  # the Omni thinker's vision encoder
    else:
        with torch.no_grad():
            out = reference.model.get_video_features(pixel_values_videos=x, video_grid_thw=torch.tensor(grids))
        embeds = torch.cat(out.pooler_output)
        deepstack = [torch.cat(b) for b in getattr(out, "deepstack_features", None) or []]
    assert rel_err(ours.embeds, embeds) <= 1e-5
    assert len(ours.deepstack) == len(deepstack) == tower.num_deepstack
    for a, b in zip(ours.deepstack, deepstack):
        assert rel_err(a, b) <= 1e-5
