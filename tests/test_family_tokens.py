"""HunyuanOCR, Hy4 and VideoLLaMA3: towers whose output rows are not patches / 4, against transformers.

Each tiny preset's checkpoint is written by transformers' own model class (save_pretrained); our tower loads it
and must give, in float32 on the CPU, the model's own `get_image_features` / `get_video_features` to 1e-4, for
images larger and smaller than the 8x8 position tables, non-square, and (Hy4, VideoLLaMA3) videos; the rows per
item must be what the model returns and what the family's processor counts as placeholders (HunyuanOCR: a
newline per row of merged tokens and begin/end tokens; Hy4: newlines per frame; VideoLLaMA3: one row per patch
for images, 2x2 merged for videos). The same rows come out of the graph pool's fixed capacities, whose output
buffers (`Geometry.output_rows`) must hold any batch the packing gives them, and out of the HTTP server, whose
`num_tokens`, output sizes and `/info` follow the model's rule.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from graphs.budgets import BudgetPlan
from graphs.packing import PackItem, pack
from graphs.runner import GraphRunner, plan_for
from models import VisualInput, load_tower
from models.loader import check_model
from models.presets import PRESETS
from tests.checkpoints import reference_model
from tests.http_helpers import ServerThread, image_bytes, settings
from tests.videos import make_video

NAMES = ["tiny-hunyuan-vl", "tiny-hy4", "tiny-videollama3"]
# Even grids for the 2x2 mergers; VideoLLaMA3's images take any side. Position tables are 8x8.
IMAGE_GRIDS = {"tiny-hunyuan-vl": [(1, 8, 12), (1, 16, 8), (1, 2, 2), (1, 20, 36), (1, 8, 8)],
               "tiny-hy4": [(1, 8, 12), (1, 2, 2), (1, 20, 36), (1, 8, 8), (1, 4, 14)],
               "tiny-videollama3": [(1, 5, 7), (1, 3, 3), (1, 20, 11), (1, 9, 14), (1, 1, 2)]}
VIDEO_GRIDS = {"tiny-hy4": [(3, 8, 12), (2, 4, 4)], "tiny-videollama3": [(3, 8, 12), (2, 4, 4), (1, 10, 6)]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (our tower loaded from transformers' save_pretrained of the whole model, that model), made once
    per module; every vision parameter's norms and biases moved off their init (the projector's too, which lies
    outside VideoLLaMA3's vision model)."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name.replace(".", "_"))
            model = reference_model(name)
            with torch.no_grad():
                for key, p in model.named_parameters():
                    if "projector" in key and p.dim() == 1:
                        p.add_(torch.randn_like(p) * 0.1)
            model.save_pretrained(folder)
            preset = PRESETS[name]
            (folder / "preprocessor_config.json").write_text(json.dumps(preset.preprocessor))
            if preset.video_preprocessor:
                (folder / "video_preprocessor_config.json").write_text(json.dumps(preset.video_preprocessor))
            assert check_model(str(folder)) == preset.family  # the server's start-up check, from the headers
            made[name] = load_tower(str(folder), device="cpu", dtype="float32"), model
        return made[name]

    return get


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def items(tower, grids, modality: str, seed: int = 0) -> list[VisualInput]:
    rng = np.random.default_rng(seed)
    return [VisualInput(modality, rng.integers(0, 256, (t * h * w, tower.processor.patch_dim), np.uint8), (t, h, w))
            for t, h, w in grids]


def normalised(tower, pixels: np.ndarray, modality: str) -> torch.Tensor:
    """Rows rescaled and normalised with the statistics of the modality's own processor (Hy4's video processor
    takes 0.5 where its image processor takes CLIP's)."""
    cfg = tower.processor
    mean = np.asarray(cfg.video.image_mean or cfg.image_mean if modality == "video" else cfg.image_mean, np.float32)
    std = np.asarray(cfg.video.image_std or cfg.image_std if modality == "video" else cfg.image_std, np.float32)
    rows = pixels.reshape(len(pixels), 3, -1).astype(np.float32) * np.float32(cfg.rescale_factor)
    return torch.from_numpy(((rows - mean[:, None]) / std[:, None]).reshape(len(pixels), -1))


def reference(model, tower, inputs: list[VisualInput]) -> list[torch.Tensor]:
    """The model's own entry point on the normalised rows."""
    modality = inputs[0].modality
    x = normalised(tower, np.concatenate([it.pixels for it in inputs]), modality)
    grids = torch.tensor([it.grid_thw for it in inputs])
    kwargs = {}
    if tower.family == "video_llama_3":
        merge = tower.geometry.merge_of(modality)
        kwargs = {f"{modality}_merge_sizes" if modality == "video" else "image_merge_sizes":
                  torch.full((len(inputs),), merge)}
    with torch.no_grad():
        if modality == "video":
            out = model.model.get_video_features(x, grids, **kwargs)
        else:
            out = model.model.get_image_features(x, grids, **kwargs)
    return list(out.pooler_output)


def placeholders(name: str, tower, grid, modality: str) -> int:
    """What the family's processor puts in the prompt for an item of this grid (its own code)."""
    from transformers import HunYuanVLImageProcessorPil, HunYuanVLProcessor, HYV4VLProcessor, VideoLlama3Processor

    t, h, w = grid
    if name == "tiny-hy4":
        return t * HYV4VLProcessor._num_frame_tokens(h, w, tower.merge)
    if name == "tiny-hunyuan-vl":
        class Stand:  # the attributes replace_image_token reads; the processor itself wants a tokenizer
            image_token, cat_extra_token = "x", True
            image_processor = HunYuanVLImageProcessorPil()
        return len(HunYuanVLProcessor.replace_image_token(Stand(), {"image_grid_thw": [grid]}, 0))

    class Processor:
        image_token = "x"
        image_processor = type("P", (), {"merge_size": tower.processor.merge_size})()
    if modality == "image":
        return len(VideoLlama3Processor.replace_image_token(Processor(), {"image_grid_thw": torch.tensor([grid])}, 0))
    return t * h * w // tower.processor.video_merge_size**2  # every token, without the optional compression


@pytest.mark.parametrize("name", NAMES)
def test_images_equal_transformers(checkpoints, name) -> None:
    tower, model = checkpoints(name)
    inputs = items(tower, IMAGE_GRIDS[name], "image")
    expect = reference(model, tower, inputs)
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, max_batch_tokens=512, budgets=[64, 512]))
    runner.capture()
    for item, out, ref in zip(inputs, runner.encode(inputs), expect):
        assert out.embeds.shape == ref.shape == (tower.geometry.tokens(item.grid_thw, "image"), tower.out_hidden_size)
        assert out.embeds.shape[0] == placeholders(name, tower, item.grid_thw, "image")
        assert rel_err(out.embeds, ref) <= 1e-4, (name, item.grid_thw)
    eager = runner.eager(np.concatenate([it.pixels for it in inputs]), [it.grid_thw for it in inputs]).embeds
    assert rel_err(eager, torch.cat(expect)) <= 1e-4


@pytest.mark.parametrize("name", sorted(VIDEO_GRIDS))
def test_videos_equal_transformers(checkpoints, name) -> None:
    tower, model = checkpoints(name)
    inputs = items(tower, VIDEO_GRIDS[name], "video", seed=1)
    expect = reference(model, tower, inputs)
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, max_batch_tokens=512, budgets=[64, 512]))
    runner.capture()
    for item, out, ref in zip(inputs, runner.encode(inputs), expect):
        assert out.embeds.shape[0] == tower.geometry.tokens(item.grid_thw, "video") == ref.shape[0]
        assert out.embeds.shape[0] == placeholders(name, tower, item.grid_thw, "video")
        assert rel_err(out.embeds, ref) <= 1e-4, (name, item.grid_thw)


@pytest.mark.parametrize("name", NAMES)
def test_every_packed_batch_fits_its_capacity_and_output_rows(name) -> None:
    """Random mixes of items packed into a plan's graphs: a batch's patches fit its capacity (budget units round
    up: VideoLLaMA3's images have any patch count), its rows fit `output_rows`, and its metadata builds."""
    tower = load_tower(name, device="cpu", dtype="float32")
    plan = BudgetPlan.create(max_batch_tokens=256, budgets=[16, 64, 256], merge_unit=tower.merge_unit,
                             max_segment_patches=4096)
    rng = np.random.default_rng(3)
    step = 1 if name == "tiny-videollama3" else tower.merge
    for modality in ("image", "video") if name != "tiny-hunyuan-vl" else ("image",):
        grids = [(int(rng.integers(1, 4)) if modality == "video" else 1,
                  step * int(rng.integers(1, 12)), step * int(rng.integers(1, 12))) for _ in range(60)]
        if modality == "video":
            grids = [(t, h + h % 2, w + w % 2) for t, h, w in grids]  # videos merge 2x2
        packed = pack([PackItem.of(g, modality, tower.geometry) for g in grids], plan)
        for batch in packed:
            own = [grids[i] for i in batch.items]
            cap = plan.capacity(batch.key) if batch.key and batch.reason is None else tower.required_capacity(
                own, modality)
            assert sum(t * h * w for t, h, w in own) <= cap.patches
            rows = sum(tower.geometry.tokens(g, modality) for g in own)
            assert rows <= tower.geometry.output_rows(cap)
            meta = tower.build_metadata(own, cap)
            if "out_index" in meta:
                assert len(meta["out_index"]) == tower.geometry.output_rows(cap)
                assert meta["out_index"].max() < cap.patches // tower.merge_unit + 3


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("name", ["tiny-hunyuan-vl", "tiny-videollama3"])
def test_served_num_tokens_outputs_and_info_follow_the_model(name) -> None:
    """The server's answer: num_tokens, the shape and the rows it returns (through its shared-memory outputs), the
    usage and /info are the model's rule, not t*h*w/4."""
    video = name == "tiny-videollama3"
    media = [{"type": "image", "image": b64(image_bytes(150, 100, seed=1))},
             {"type": "image", "image": b64(image_bytes(90, 200, seed=2))}]
    if video:
        media.append({"type": "video", "video": b64(make_video(6, fps=2, width=96, height=64))})
    with ServerThread(settings(model=name)) as srv, srv.client() as c:
        info = c.get("/info").json()
        r = c.post("/encode", json={"items": media})
        assert r.status_code == 200, r.text
        body = r.json()
    tower = load_tower(name, device="cpu", dtype="float32")
    assert info["geometry"]["tokens"] == tower.geometry.describe()
    for entry in body["data"]:
        rows = tower.geometry.tokens(tuple(entry["grid_thw"]), entry["type"])
        assert entry["num_tokens"] == rows and entry["shape"] == [rows, tower.out_hidden_size]
        assert len(entry["embedding"]) == rows and np.isfinite(entry["embedding"]).all()
        t, h, w = entry["grid_thw"]
        if name == "tiny-hunyuan-vl":
            assert rows == (h // 2) * (w // 2 + 1) + 2
        else:
            assert rows == (h * w if entry["type"] == "image" else t * h * w // 4)
    assert body["usage"]["tokens"] == sum(e["num_tokens"] for e in body["data"])


@pytest.mark.parametrize("name", NAMES)
def test_the_gpu_tests_reference_carries_the_tower_s_weights(name) -> None:
    """tests/test_cuda_graphs.py and the benchmark compare with `hf_visual(tower)`: for these families transformers'
    whole model, its parameters found by transformers' own renaming of the checkpoint's names, called through its
    entry point. On the CPU in float32 it must give the tower's rows."""
    from service.bench.towers import hf_outputs, hf_visual

    tower = load_tower(name, device="cpu", dtype="float32")
    grids = [(1, 8, 12), (1, 4, 6)]
    inputs = items(tower, grids, "image", seed=5)
    with torch.no_grad():
        ref, _ = hf_outputs(hf_visual(tower)(torch.from_numpy(tower.processor.normalize(
            np.concatenate([it.pixels for it in inputs]))), grid_thw=torch.tensor(grids)))
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, max_batch_tokens=256), use_graphs=False)
    ours = torch.cat([o.embeds for o in runner.encode(inputs)])
    assert ours.shape == ref.shape and rel_err(ours, ref) <= 1e-4


def test_newline_layout_by_index() -> None:
    """Two items' rows, gathered from the batch's merged tokens then [newline, begin, end]: each item's begin, its
    rows of merged tokens each closed by the newline, its end; then padding (row 0). Begin and end are per item,
    so such an item cannot run as time chunks; frames alone (Hy4) can."""
    from models.protocol import Capacity
    from models.token_layout import NewlineGeometry

    geometry = NewlineGeometry(2, extra=2)
    cap = Capacity(patches=64, segments=3)  # 16 merged tokens, rows 16 (newline), 17 (begin), 18 (end)
    index = geometry.gather_index([(1, 4, 4), (1, 2, 6)], cap)  # 2x2 merged tokens, then 1x3
    assert index[:8].tolist() == [17, 0, 1, 16, 2, 3, 16, 18]
    assert index[8:14].tolist() == [17, 4, 5, 6, 16, 18]
    assert len(index) == geometry.output_rows(cap) and not index[14:].any()
    assert not geometry.splits_over_time and NewlineGeometry(2).splits_over_time
    assert NewlineGeometry(2).tokens((3, 4, 6)) == 3 * 2 * 4
