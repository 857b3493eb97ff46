"""An item's output bytes do not depend on what it is batched with, on the budget or graph key that runs
it, or on graph versus eager: every tiny preset (so every family, as it is added), in float32 on the CPU,
where each graph key runs as a fixed-shape forward over the same static buffers as on CUDA.

Content-addressed caches (and replicas sharing them) store whatever the first encode of an item gave;
if that depended on the load at the time, answers would not be reproducible. The same test runs on the
GPU for every dtype in tests/test_cuda_invariance.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphs.packing import Batch
from graphs.runner import GraphRunner, plan_for
from models import VisualInput, load_tower
from models.families import FAMILIES
from models.presets import PRESETS

TINY = sorted(name for name in PRESETS if name.startswith("tiny-"))


def items_for(tower, seed: int, video: bool, shape: tuple[int, int]) -> tuple[VisualInput, list[VisualInput]]:
    """A target image of `shape` merge blocks and neighbours of mixed sizes (and videos where the family
    takes them)."""
    m = tower.merge
    rng = np.random.default_rng(seed)

    def item(t: int, h: int, w: int, modality: str = "image") -> VisualInput:
        rows = t * h * w
        return VisualInput(modality, rng.integers(0, 256, (rows, tower.processor.patch_dim), np.uint8), (t, h, w))

    target = item(1, shape[0] * m, shape[1] * m)
    others = [item(1, 2 * m, 2 * m), item(1, 6 * m, 4 * m), item(1, 1 * m, 7 * m), item(1, 5 * m, 5 * m)]
    if video:
        others += [item(2, 4 * m, 3 * m, "video"), item(3, 2 * m, 2 * m, "video")]
    return target, others


# Targets of 1, 6 and 15 merge blocks: matrix products of 1-11 rows off a multiple of 4 take other kernels.
@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (3, 5)])
@pytest.mark.parametrize("name", TINY)
def test_an_item_s_bytes_are_the_same_alone_and_in_any_batch(name: str, shape: tuple[int, int]) -> None:
    tower = load_tower(name, device="cpu", dtype="float32")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, max_batch_tokens=256, budgets=[64, 256]))
    runner.capture()
    takes_video = FAMILIES[tower.family].video
    target, others = items_for(tower, 0, takes_video, shape)
    alone = runner.encode([target])[0]  # the smallest graph that holds it

    def rows_of(outs, index: int) -> torch.Tensor:
        return torch.cat([outs[index].embeds, *outs[index].deepstack], dim=-1)

    reference = rows_of([alone], 0)
    images = [it for it in others if it.modality == "image"]
    for count in (1, 3, len(images)):
        batch = [*images[:count], target]
        assert torch.equal(rows_of(runner.encode(batch), count), reference), (name, count)
    # the same item in the largest budget, and eagerly, alone and among the others
    big = runner.pack_items([target, *images])[0]
    big_key = next(k for k in runner.pool.graphs if k.modality == "image" and k.budget == 256
                   and k.length_class == big.key.length_class)
    forced = Batch(big_key, list(range(len(images) + 1)), reason=None)
    got = runner.run_batch(forced, [target, *images])
    assert torch.equal(rows_of(got, 0), reference), (name, "largest budget")
    eager = runner.run_batch(Batch(None, [0], reason="padding"), [target])
    assert torch.equal(rows_of(eager, 0), reference), (name, "eager alone")
    eager_all = runner.run_batch(Batch(None, list(range(len(images) + 1)), reason="padding"), [*images, target])
    assert torch.equal(rows_of(eager_all, len(images)), reference), (name, "eager batch")
    if takes_video:
        video = next(it for it in others if it.modality == "video")
        solo = rows_of(runner.encode([video]), 0)
        videos = [it for it in others if it.modality == "video"]
        assert torch.equal(rows_of(runner.encode(videos), 0), solo), (name, "video batched")
        eager_video = runner.run_batch(Batch(None, [0], reason="padding"), [video])
        assert torch.equal(rows_of(eager_video, 0), solo), (name, "video eager")


@pytest.mark.parametrize("name", TINY)
def test_patch_embeddings_are_fused_with_an_inner_dimension_of_8(name):
    """Every family's loaded tower carries its row-product patch embedding fused, inner dimension a multiple of 8:
    on the H200 a bias-free bf16 product over 588 inputs (ERNIE), and a fp16 one with a bias (Kimi), took
    kernels whose rows changed with the row count (models/patches.py)."""
    from models.patches import Conv2dPatches, LinearPatches

    tower = load_tower(name, device="cpu", dtype="float32")
    embeds = [m for m in tower.modules() if isinstance(m, (Conv2dPatches, LinearPatches))]
    for embed in embeds:
        assert embed.row_weight().shape[1] % 8 == 0, (name, type(embed).__name__, embed.row_weight().shape)
