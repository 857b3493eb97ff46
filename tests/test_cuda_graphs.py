"""GPU only: bf16 parity of the full-size towers with transformers, and graph replays against eager.

Run on the GPU machine: `pytest -m cuda`. Skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from graphs.budgets import GraphKey
from graphs.learning import learn_budget
from graphs.runner import GraphRunner, plan_for
from models import VisualInput, load_tower
from models.families import FAMILIES
from service.bench.towers import hf_grid_thw, hf_outputs, hf_visual

pytestmark = pytest.mark.cuda
# Every family at its released size (Qwen3-VL-MoE and Qwen3-Omni share Qwen3-VL-30B-A3B's tower shape,
# Qwen3.5-MoE Qwen3.5's: one of each pair is enough for the kernels, both for the wiring).
FULL = ["random:qwen2-vl-7b", "random:qwen2.5-vl-7b", "random:qwen3-vl-8b", "random:glm-4.1v-9b",
        "random:qwen3-vl-30b-a3b", "random:qwen3.5-27b", "random:qwen2.5-omni-7b", "random:qwen3-omni-30b-a3b",
        "random:exaone-4.5-33b"]
FULL += ["random:lfm3-vl-2b", "random:dots3-note"]  # conv blocks beside attention; experts in the tower
FULL += ["random:paddleocr-vl", "random:cosmos3-edge"]
FULL += ["random:ernie-4.5-vl-28b-a3b", "random:minimax-m3"]
FULL += ["random:hunyuan-ocr", "random:hy4", "random:videollama3-7b"]
FULL += ["random:qwen3.8-flash-next", "random:cosmos3-nano", "random:hyperclovax-seed-think-32b",
         "random:glm-5.3-flash"]
DEV = torch.device("cuda")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference_forward(visual, tower, grids, pixels: np.ndarray, dtype=torch.bfloat16):
    x = torch.from_numpy(tower.processor.normalize(pixels)).to(DEV, dtype)
    with torch.inference_mode():
        out = visual(x, grid_thw=torch.tensor(hf_grid_thw(tower, grids), device=DEV))
    return hf_outputs(out)


def make_items(tower, grids, seed, modality="image"):
    rng = np.random.default_rng(seed)
    return [
        VisualInput(modality, rng.integers(0, 256, (t * h * w, tower.processor.patch_dim), dtype=np.uint8), (t, h, w))
        for t, h, w in grids
    ]


@pytest.fixture(scope="module", params=FULL)
def full_runner(request):
    tower = load_tower(request.param, device="cuda", dtype="bfloat16")
    plan = plan_for(tower, max_batch_tokens=2048)
    runner = GraphRunner(tower, DEV, plan)
    runner.capture()
    runner.exact = GraphRunner(float32_copy(tower), DEV, plan, use_graphs=False)
    yield runner
    del runner
    torch.cuda.empty_cache()


def float32_copy(tower):
    """The same weights in float32: the function both bf16 paths approximate."""
    exact = copy.deepcopy(tower).float()
    exact.reset_buffers()
    for module in exact.modules():  # FlashAttention has no float32 kernel: SDPA per segment
        if hasattr(module, "backend"):
            module.backend = "sdpa"
    return exact


def check_against_eager(runner, item, out, floor: float = 1e-2) -> None:
    """A graph replay must be as close to the float32 result as the bf16 eager forward of the item
    alone is. With these random full-size weights bf16 rounding alone gives 1-2e-2 (transformers'
    bf16 forward shows the same), and a kernel of another shape rounds differently, so the bound is
    1e-2 or twice the eager item's own bf16 error. Stale or foreign metadata gives errors near 1."""
    exact = runner.exact.eager(item.pixels, [item.grid_thw], item.modality).embeds  # a video's rows may merge
    eager = runner.eager(item.pixels, [item.grid_thw], item.modality).embeds  # otherwise (VideoLLaMA3, Hy4)
    assert out.embeds.shape == eager.shape
    assert torch.isfinite(out.embeds).all()
    bound = max(floor, 2 * rel_err(eager, exact))
    assert rel_err(out.embeds, exact) <= bound, (item.grid_thw, rel_err(out.embeds, exact), bound)


def test_full_size_bf16_parity_with_transformers(full_runner):
    """Against transformers in float32 carrying the same (bf16-rounded) weights: the function our bf16
    forward approximates. transformers' own bf16 forward is measured against it too, for scale."""
    tower = full_runner.tower
    visual = hf_visual(tower)
    m = tower.merge
    takes_video = FAMILIES[tower.family].video  # an image of two frames is a video to an image-only model
    grids = [(1, 32, 32), (1, 16, 24), (2 if takes_video else 1, 12, 12), (1, 4 * m, 6 * m)]
    items = make_items(tower, grids, 0)
    pixels = np.concatenate([i.pixels for i in items])
    ours = full_runner.encode(items)
    hf_bf16, _ = reference_forward(visual, tower, grids, pixels)
    ref, ref_ds = reference_forward(visual.float(), tower, grids, pixels, dtype=torch.float32)
    got = torch.cat([o.embeds for o in ours])
    ours_err, hf_err = rel_err(got, ref), rel_err(hf_bf16, ref)
    print(f"{tower.name}: ours bf16 vs fp32 reference {ours_err:.2e}; transformers bf16 vs the same {hf_err:.2e}")
    # Random full-size weights amplify bf16 rounding: transformers' own bf16 forward lands near 1.5e-2
    # from the float32 result, so the bound is 1e-2 or transformers' own bf16 error, whichever is larger.
    bound = max(1e-2, 1.1 * hf_err)
    assert ours_err <= bound
    for j, feat in enumerate(ref_ds):
        assert rel_err(torch.cat([o.deepstack[j] for o in ours]), feat) <= bound
    eager = full_runner.eager(pixels, grids).embeds
    assert rel_err(eager, ref) <= bound


def test_equal_tokens_different_boundaries(full_runner):
    """sglang PR #37043: equal token totals, different image boundaries, one graph."""
    tower = full_runner.tower
    a = make_items(tower, [(1, 16, 16), (1, 16, 16)], 1)  # 2 x 256 patches
    b = make_items(tower, [(1, 8, 16), (1, 24, 16)], 2)  # 128 + 384 patches, same total
    for items in (a, b, a):
        batches = full_runner.pack_items(items)
        outs = full_runner.encode(items)
        for it, out in zip(items, outs):
            check_against_eager(full_runner, it, out)
        assert all(bt.replays for bt in batches)  # full graphs: they replay, whatever the costs
    assert full_runner.stats.graph_items >= 6


def test_small_then_large_then_small(full_runner):
    """sglang issue #29216: a small graph replayed after a large one must still be right."""
    tower = full_runner.tower
    small = make_items(tower, [(1, 8, 8)], 3)
    large = make_items(tower, [(1, 64, 64), (1, 40, 48)], 4)
    first = full_runner.encode(small)[0]
    full_runner.encode(large)
    again = full_runner.encode(small)[0].embeds
    check_against_eager(full_runner, small[0], first)
    assert torch.equal(first.embeds, again)


def test_random_batches_match_eager(full_runner):
    """Seeded random batches mixing sizes and counts (70 per family: 210 over the three)."""
    tower = full_runner.tower
    rng = np.random.default_rng(7)
    m = tower.merge
    for trial in range(70):
        count = int(rng.integers(1, 9))
        grids = [(1, m * int(rng.integers(1, 20)), m * int(rng.integers(1, 20))) for _ in range(count)]
        items = make_items(tower, grids, 100 + trial)
        outs = full_runner.encode(items)
        for it, out in zip(items, outs):
            check_against_eager(full_runner, it, out)
    # Every batch replays a graph unless the calibrated padding rule judged eager cheaper.
    assert full_runner.stats.graph_items > 200
    assert set(full_runner.stats.eager_items) <= {"padding", "t_capture"}


def test_images_and_videos_with_fallback_reasons(full_runner):
    tower = full_runner.tower
    m = tower.merge
    short = make_items(tower, [(4, 6 * m, 6 * m)], 5, "video")
    long = make_items(tower, [(full_runner.plan.t_capture + 2, 4 * m, 4 * m)], 6, "video")
    images = make_items(tower, [(1, 8 * m, 8 * m)], 7)
    before = dict(full_runner.stats.eager_items)
    outs = full_runner.encode(short + long + images)
    for it, out in zip(short + long + images, outs):
        check_against_eager(full_runner, it, out)
    assert full_runner.stats.eager_items["t_capture"] == before.get("t_capture", 0) + 1
    assert any(k.startswith("video/") for k in full_runner.stats.replays)


def test_injected_capture_failure_serves_eagerly():
    tower = load_tower("random:qwen2-vl-7b", device="cuda", dtype="bfloat16")
    plan = plan_for(tower, max_batch_tokens=256)
    runner = GraphRunner(tower, DEV, plan, modalities=("image",))
    broken = GraphKey("image", 64, 256)
    capture_one = runner.pool._capture_one

    def failing(key, cap):
        if key == broken:
            raise RuntimeError("injected capture failure")
        return capture_one(key, cap)

    runner.pool._capture_one = failing
    runner.capture()
    assert broken in runner.pool.failed and broken not in runner.pool.graphs
    items = make_items(tower, [(1, 16, 16)], 8)
    assert (runner.pack_items(items)[0].key, runner.pack_items(items)[0].reason) == (broken, "capture_failed")
    out = runner.encode(items)[0].embeds
    assert rel_err(out, runner.eager(items[0].pixels, [(1, 16, 16)]).embeds) <= 1e-3
    assert runner.stats.eager_items["capture_failed"] == 1


def test_fused_kernels_enable_and_match_torch():
    from models import kernels

    errors = kernels.check_kernels(DEV)
    print("fused kernels, relative difference to torch (bf16):", errors)
    assert kernels.enable_triton(DEV), errors
    assert max(errors.values()) < 1e-2
    assert errors["fp8_rows"] == 0  # the same e4m3 bytes as the torch path
    assert errors["add_norm_fp8"] == errors["act_fp8"] == 0  # the bytes of the two kernels each fuses
    for heads, dim in [(16, 80), (16, 72), (4, 16)]:
        qkv = torch.randn(1000, 3, heads, dim, device=DEV).to(torch.bfloat16)
        cos, sin = torch.rand(1000, dim, device=DEV)[:, None, None], torch.rand(1000, dim, device=DEV)[:, None, None]
        assert rel_err(kernels.rotary_triton(qkv[:, :2], cos, sin), kernels.rotary_torch(qkv[:, :2], cos, sin)) < 1e-2
    h = torch.randn(3000, 2 * 3456, device=DEV).to(torch.bfloat16) * 3
    for act in kernels.ACT_CODES:
        assert rel_err(kernels.act_triton(h, act), kernels.act_torch(h, act)) < 1e-2
        assert rel_err(kernels.act_triton(h, act, 3420), kernels.act_torch(h, act, 3420)) < 1e-2
    # float32 (the reference towers of these tests run the same kernels): agreement to rounding
    x, d = torch.randn(2000, 1280, device=DEV), torch.randn(2000, 1280, device=DEV)
    norm = torch.nn.LayerNorm(1280, eps=1e-6, device=DEV)
    (s1, n1), (s2, n2) = kernels.add_norm_triton(x, d, norm), kernels.add_norm_torch(x, d, norm)
    assert rel_err(s1, s2) < 1e-6 and rel_err(n1, n2) < 1e-5
    # the steps before the blocks: pixels normalised to the bit, the rotary tables and a resampled position
    # table added inside the first norm to rounding
    pixels = torch.randint(0, 256, (3000, 1536), dtype=torch.uint8, device=DEV)
    mean, std = torch.rand(1536, device=DEV), torch.rand(1536, device=DEV) + 0.1
    assert torch.equal(kernels.normalize_triton(pixels, mean, std, 1 / 255),
                       kernels.normalize_torch(pixels, mean, std, 1 / 255))
    pos = torch.randint(0, 4096, (3000, 2), device=DEV)
    axis, freq = torch.arange(36, device=DEV) // 18, 1.0 / 10000 ** (torch.arange(36, device=DEV) % 18 / 18)
    tables = zip(kernels.rotary_tables_triton(pos, axis, freq), kernels.rotary_tables_torch(pos, axis, freq))
    print("rotary tables, largest difference to torch:", [(a - b).abs().max().item() for a, b in tables])
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(kernels.rotary_tables_triton(pos, axis, freq),
                                                    kernels.rotary_tables_torch(pos, axis, freq)))
    taps = kernels.Taps(torch.randn(2304, 1280, device=DEV), torch.randint(0, 2304, (2000, 4), device=DEV),
                        torch.rand(2000, 4, device=DEV))
    (s1, n1), (s2, n2) = kernels.add_norm_triton(x, taps, norm), kernels.add_norm_torch(x, taps, norm)
    assert rel_err(s1, s2) < 1e-6 and rel_err(n1, n2) < 1e-5


def test_video_chunking_equals_eager_on_the_gpu():
    tower = load_tower("random:qwen3-vl-8b", device="cuda", dtype="bfloat16")
    runner = GraphRunner(tower, DEV, plan_for(tower, max_batch_tokens=4096, t_capture=4), modalities=("video",),
                         video_chunking=True)
    runner.capture()
    exact_runner = GraphRunner(float32_copy(tower), DEV, runner.plan, use_graphs=False)
    videos = make_items(tower, [(11, 12, 16), (6, 8, 8)], 20, "video")
    for video, out in zip(videos, runner.encode(videos)):
        ref = exact_runner.eager(video.pixels, [video.grid_thw], "video")
        eager = runner.eager(video.pixels, [video.grid_thw], "video")
        bound = max(1e-2, 2 * rel_err(eager.embeds, ref.embeds))
        assert rel_err(out.embeds, ref.embeds) <= bound
        for a, b in zip(out.deepstack, ref.deepstack):
            assert rel_err(a, b) <= max(1e-2, 2 * bound)
    assert runner.stats.chunked_videos == 2


@pytest.mark.parametrize("name", ["random:qwen3-vl-8b", "random:qwen2.5-vl-7b"])
def test_a_learned_budget_matches_eager_on_the_gpu(name):
    """A budget captured after start-up (`graphs.learning.learn_budget`) into the pool and buffers the live graphs
    use: a lone 196-token image replays in it, right; equal tokens with other boundaries share it; a small
    replay after a large one is unchanged; the graphs captured at start-up still replay right after it."""
    tower = load_tower(name, device="cuda", dtype="bfloat16")
    runner = GraphRunner(tower, DEV, plan_for(tower, max_batch_tokens=2048))
    runner.capture()
    runner.exact = GraphRunner(float32_copy(tower), DEV, runner.plan, use_graphs=False)
    m = tower.merge
    lone = make_items(tower, [(1, 14 * m, 14 * m)], 31)  # 196 tokens: a 448x448 image of the Qwen3 line
    assert runner.pack_items(lone)[0].key.budget == 256
    check_against_eager(runner, lone[0], runner.encode(lone)[0])
    learned = learn_budget(runner, 196)
    assert learned.ok, learned.reason
    assert runner.plan.budgets[:4] == (64, 128, 196, 256) and 196 in dict(runner.cost.replays)
    assert all(k in runner.pool.graphs for k in runner.plan.budget_keys(196))
    print(f"{name}: replay ms {[(b, round(c * 1e3, 3)) for b, c in runner.cost.replays]}; "
          f"eager ms {[(t, round(c * 1e3, 3)) for t, c in runner.cost.eager]}")
    # Whether a batch replays or runs eagerly is the measured costs' call (tested on the CPU); here every batch
    # goes through the graphs, the learned one included.
    runner.cost = None
    [batch] = runner.pack_items(lone)
    assert batch.replays and batch.key.budget == 196
    first = runner.encode(lone)[0]
    check_against_eager(runner, lone[0], first)
    pair = make_items(tower, [(1, 10 * m, 10 * m), (1, 8 * m, 12 * m)], 32)  # 100 + 96 tokens, one length class
    other = make_items(tower, [(1, 12 * m, 9 * m), (1, 11 * m, 8 * m)], 33)  # 108 + 88
    for items in (pair, other, pair):
        [batch] = runner.pack_items(items)
        assert batch.replays and batch.key.budget == 196
        for it, out in zip(items, runner.encode(items)):
            check_against_eager(runner, it, out)
    large = make_items(tower, [(1, 40 * m, 40 * m), (1, 12 * m, 20 * m)], 34)
    for it, out in zip(large, runner.encode(large)):
        check_against_eager(runner, it, out)
    assert torch.equal(runner.encode(lone)[0].embeds, first.embeds)
    small = make_items(tower, [(1, 6 * m, 6 * m)], 35)  # a start-up graph after the learned one
    check_against_eager(runner, small[0], runner.encode(small)[0])
    assert not runner.stats.eager_items
