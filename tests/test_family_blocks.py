"""LFM3-VL (conv blocks beside attention blocks) and dots3-note (experts in the later blocks) against
transformers' own model classes, on checkpoints written by their save_pretrained, fp32 on the CPU: images of
several sizes and videos through each model's `get_image_features` / `get_video_features`, the tokens per item
its processor counts, padding, the two new parts alone against transformers' modules, and each family served
end to end by a real server on loopback."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers.models.dots3_note import modeling_dots3_note as dots_hf
from transformers.models.lfm3_vl import modeling_lfm3_vl as lfm_hf

from graphs.runner import GraphRunner, plan_for
from models import load_tower
from models.blocks import FrameConv, frame_conv_metadata
from models.moe import SparseMoe
from models.presets import PRESETS, full_config
from models.protocol import Capacity
from service.media.image_preprocess import preprocess_image_bytes
from service.media.video_preprocess import preprocess_video_bytes
from tests.checkpoints import visual_of, write_checkpoint
from tests.http_helpers import ServerThread, b64, image_bytes, settings
from tests.test_towers import random_pixels, rel_err, run_ours, run_padded
from tests.videos import make_video

PRESETS_HERE = ["tiny-lfm3-vl", "tiny-dots3-note"]
# Non-square, a single merge block, and grids larger than any test image of the other families.
IMAGE_GRIDS = [(1, 8, 12), (1, 16, 8), (1, 2, 2), (1, 20, 36), (1, 10, 6)]
VIDEO_GRIDS = [(3, 8, 12), (1, 6, 6), (2, 10, 6)]


@pytest.fixture(scope="module", params=PRESETS_HERE)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(request.param, folder)
    if PRESETS[request.param].family == "dots3_note":
        # transformers starts the routers' correction biases at zero: saved again with biases that count, and
        # routers spread enough that rows choose different experts
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for module in visual_of(model).modules():
                if isinstance(module, dots_hf.Dots3NoteVisionMoE):
                    bias, router = module.e_score_correction_bias, module.gate.weight
                    bias.copy_(torch.randn(bias.shape, generator=gen) * 0.02)
                    router.copy_(torch.randn(router.shape, generator=gen) * 0.1)
        model.save_pretrained(folder)
    return request.param, folder, model


def reference(model, grids, pixels: torch.Tensor, tower, video: bool = False) -> tuple[torch.Tensor, list[int]]:
    """transformers' merged tokens of the items (the model's own entry point) and its rows per item."""
    x = torch.from_numpy(tower.processor.normalize(pixels.numpy()))
    with torch.no_grad():
        if video:
            out = model.model.get_video_features(pixel_values_videos=x, video_grid_thw=torch.tensor(grids))
        else:
            out = model.model.get_image_features(pixel_values=x, image_grid_thw=torch.tensor(grids))
    return torch.cat(out.pooler_output), [len(p) for p in out.pooler_output]


def test_images_equal_transformers(checkpoint):
    name, folder, model = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    chosen: list[torch.Tensor] = []  # dots3-note: the experts each sparse block's rows chose
    hooks = [m.register_forward_pre_hook(lambda m, args: chosen.append((m.route(args[0]) > 0).sum(0)))
             for m in tower.modules() if isinstance(m, SparseMoe)]
    for seed, grids in enumerate([IMAGE_GRIDS, IMAGE_GRIDS[2:3]]):
        pixels = random_pixels(tower, grids, seed)
        ours = run_ours(tower, grids, pixels)
        embeds, rows = reference(model, grids, pixels, tower)
        assert ours.embeds.shape == embeds.shape and ours.deepstack == []
        assert rel_err(ours.embeds, embeds) <= 1e-5
        assert rows == [tower.geometry.tokens(g) for g in grids]
    for hook in hooks:
        hook.remove()
    if tower.family == "dots3_note":  # the routers spread the rows over their experts: the test routes for real
        assert len(chosen) == 4 and all(int((c > 0).sum()) >= 3 for c in chosen[:2])


def test_videos_equal_transformers(checkpoint):
    name, folder, model = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    pixels = random_pixels(tower, VIDEO_GRIDS, 7)
    ours = run_ours(tower, VIDEO_GRIDS, pixels)
    embeds, rows = reference(model, VIDEO_GRIDS, pixels, tower, video=True)
    assert rel_err(ours.embeds, embeds) <= 1e-5
    assert rows == [tower.geometry.tokens(g, "video") for g in VIDEO_GRIDS]


def test_placeholders_are_the_items_rows(checkpoint):
    """Each processor's own placeholder count (transformers' `replace_image_token` / `replace_video_token`)
    is the tower's rows per item."""
    name, folder, _ = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    merge = types.SimpleNamespace(merge_size=tower.merge, temporal_patch_size=tower.processor.temporal_patch_size)
    if tower.family == "lfm3_vl":
        from transformers.models.lfm3_vl.processing_lfm3_vl import Lfm3VlProcessor as cls
    else:
        from transformers.models.dots3_note.processing_dots3_note import Dots3NoteProcessor as cls
    fake = types.SimpleNamespace(image_processor=merge, video_processor=merge, image_token="I", video_token="V",
                                 vision_start_token="<", vision_end_token=">",
                                 _calculate_timestamps=lambda *a: cls._calculate_timestamps(None, *a))
    for grid in IMAGE_GRIDS:
        text = cls.replace_image_token(fake, {"image_grid_thw": torch.tensor([grid])}, 0)
        assert text.count("I") == tower.geometry.tokens(grid)
    for grid in VIDEO_GRIDS:
        frames = grid[0] * tower.processor.temporal_patch_size
        meta = types.SimpleNamespace(fps=2.0, frames_indices=list(range(frames)))
        text = cls.replace_video_token(fake, {"video_grid_thw": torch.tensor([grid]), "video_metadata": [meta]}, 0)
        assert text.count("V") == tower.geometry.tokens(grid, "video")


def test_padding_to_a_larger_capacity_changes_nothing(checkpoint):
    _, folder, _ = checkpoint
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    grids = IMAGE_GRIDS[:3]
    pixels = random_pixels(tower, grids)
    exact = run_ours(tower, grids, pixels)
    out, _ = run_padded(tower, grids, pixels)
    # on the CPU a matrix product over more rows may round differently (the runner pads eager rows for that)
    tokens = exact.embeds.shape[0]
    assert torch.equal(out.embeds[:tokens], exact.embeds) or rel_err(out.embeds[:tokens], exact.embeds) < 1e-6


@pytest.mark.parametrize("kernel", [3, 5])
def test_frame_conv_equals_transformers_short_conv(kernel):
    """The gathered convolution against transformers' own block (Conv2d over each item's frames) on mixed
    items, videos among them, and kernels of 3 and 5."""
    torch.manual_seed(kernel)
    cfg = full_config(PRESETS["tiny-lfm3-vl"]).vision_config
    cfg.conv_kernel_size = kernel
    theirs = lfm_hf.Lfm3VlVisionShortConv(cfg, 0).eval()
    ours = FrameConv(cfg.hidden_size, kernel).eval()
    ours.load_state_dict(theirs.state_dict())
    grids = [(1, 6, 4), (2, 4, 8), (1, 2, 2), (3, 2, 6)]
    patches = sum(t * h * w for t, h, w in grids)
    x = torch.randn(patches, cfg.hidden_size)
    cap = Capacity(patches=patches + 12, segments=8)
    taps = torch.from_numpy(frame_conv_metadata(grids, cap, cfg.spatial_merge_size, kernel)["conv_taps"])
    padded = torch.cat([x, torch.full((12, cfg.hidden_size), float("nan"))])  # padding rows are never read
    with torch.no_grad():
        got = ours(padded, None, None, taps)[:patches]
        want = theirs(x, [list(g) for g in grids])
    assert rel_err(got, want) <= 1e-6


def test_experts_equal_transformers_and_the_router_stays_float32():
    torch.manual_seed(3)
    cfg = full_config(PRESETS["tiny-dots3-note"]).vision_config
    theirs = dots_hf.Dots3NoteVisionMoE(cfg, 2).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.1)
        theirs.e_score_correction_bias.normal_(0, 0.05)
    layer = cfg.per_layer_config[2]
    ours = SparseMoe(cfg.hidden_size, layer.moe_intermediate_size, layer.num_local_experts, layer.num_experts_per_tok,
                     cfg.hidden_act, cfg.router_scaling_factor, {"gate_proj": "fc1", "up_proj": "fc3",
                                                                 "down_proj": "fc2"})
    state = {"gate_weight": theirs.gate.weight, "router_bias": theirs.e_score_correction_bias}
    for e in range(layer.num_local_experts):
        gate, up = theirs.experts.gate_up_proj[e].chunk(2)
        state.update({f"experts.{e}.fc1.weight": gate, f"experts.{e}.fc3.weight": up,
                      f"experts.{e}.fc2.weight": theirs.experts.down_proj[e]})
    ours.load_state_dict(state)
    x = torch.randn(50, cfg.hidden_size)
    with torch.no_grad():
        want = theirs(x)
        assert rel_err(ours(x), want) <= 1e-6
        for m in ours.modules():
            if hasattr(m, "fuse"):
                m.fuse()
        assert rel_err(ours(x), want) <= 1e-6
        # the routed pass (CUDA bf16 serves it; the CPU's grouped product runs it here) over the stacked
        # weights, which the experts' own parameters are views of, not copies
        assert ours.experts[1].fc1.weight.data_ptr() == ours.stacked[0][1].data_ptr()
        assert rel_err(ours.forward_routed(x), want) <= 1e-6
        # every expert is chosen by some row: the routing is not degenerate
        assert (ours.route(x) > 0).any(0).all()
    ours.to(torch.bfloat16)
    assert ours.gate_weight.dtype == ours.router_bias.dtype == torch.float32
    assert ours.experts[0].fc1.weight.dtype == torch.bfloat16
    with torch.no_grad():
        ours.fuse()
        xb = x.bfloat16()
        assert ours.stacked[0].dtype == torch.bfloat16
        assert rel_err(ours.forward_routed(xb), ours(xb)) <= 1e-2  # the dense pass: the same sums, other kernels


@pytest.fixture(scope="module")
def served(checkpoint):
    name, folder, model = checkpoint
    cfg = settings(model=str(folder), max_batch_tokens=256)
    with ServerThread(cfg) as srv:
        yield name, folder, model, srv


def test_served_end_to_end(served):
    """A real server answers images and a video with transformers' features of the same preprocessed media,
    and with what the graph runner gives locally."""
    name, folder, model, srv = served
    images = [image_bytes(200, 150, seed=1, fmt="PNG"), image_bytes(96, 320, seed=2, fmt="JPEG")]
    video = make_video(8, fps=4, width=96, height=64)
    with srv.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(d)} for d in images]
                                    + [{"type": "video", "video": b64(video)}]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, 256))
    runner.capture()
    visuals = [preprocess_image_bytes(d, tower.processor) for d in images] + [
        preprocess_video_bytes(video, tower.processor)]
    for entry, visual in zip(data, visuals):
        got = torch.tensor(entry["embedding"])
        assert entry["grid_thw"] == list(visual.grid_thw)
        assert entry["num_tokens"] == got.shape[0] == tower.geometry.tokens(visual.grid_thw, visual.modality)
        want, _ = reference(model, [visual.grid_thw], torch.from_numpy(np.asarray(visual.pixels)), tower,
                            video=visual.modality == "video")
        assert rel_err(got, want) <= 1e-5
        assert torch.equal(got, runner.encode([visual])[0].embeds)


def test_vllm_parts_say_what_vllm_does_not_take(served):
    """vLLM 0.33 does not serve LFM3-VL, and takes dots3-note's images only as media (its processor declares
    pixel fields only) and its videos as a prompt of its own: each part says so."""
    name, _, _, srv = served
    items = [{"type": "image", "image": b64(image_bytes(64, 64, seed=5))},
             {"type": "video", "video": b64(make_video(4, fps=2, width=64, height=64))}]
    with srv.client() as c:
        r = c.post("/encode", json={"items": items, "encoding_format": "vllm"})
    assert r.status_code == 200, r.text
    image, video = r.json()["data"]
    if name == "tiny-lfm3-vl":
        unserved = ["vLLM 0.33 does not serve LFM3-VL: no vLLM model takes this part"]
        assert image["warnings"] == video["warnings"] == unserved
    else:
        assert "takes no image_embeds parts" in image["warnings"][0]
        assert "builds a prompt of its own for a video" in video["warnings"][0]


def test_the_benchmarks_reference_carries_the_towers_weights(checkpoint):
    """`vitserve bench` and the GPU parity tests compare a preset's tower with transformers' model built
    around the same weights; for these families transformers renames tensors between checkpoints and
    modules (and LFM3-VL's projector sits outside its vision model), so the reference loads them through
    transformers' own conversions: checked here against the tower in float32."""
    from service.bench.towers import hf_outputs, hf_visual

    name, _, _ = checkpoint
    tower = load_tower(name, device="cpu", dtype="float32")
    tower.name = name
    grids = [(1, 8, 12), (2, 4, 6)]
    pixels = random_pixels(tower, grids, 3)
    x = torch.from_numpy(tower.processor.normalize(pixels.numpy()))
    with torch.no_grad():
        embeds, _ = hf_outputs(hf_visual(tower)(x, grid_thw=torch.tensor(grids)))
    assert rel_err(run_ours(tower, grids, pixels).embeds, embeds) <= 1e-5
