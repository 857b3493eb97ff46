"""`python -m tests.cuda_dtype_check DTYPE[+fp8] [PRESET ...]`: every family served in DTYPE (its products in FP8
with `+fp8`) on the GPU, one JSON line per preset (tests/test_cuda_invariance.py runs it, one fresh process per
dtype).

For each preset: load, capture the graphs of two budgets, pass the start-up self-check, then
- batch invariance: a target image's bytes alone, batched with 1, 7 and 31 others of mixed sizes (in the
  graph that holds them all and in the largest budget of its class), and eagerly alone and batched; a
  video's alone, beside other videos and eagerly;
- accuracy: the target against the same weights in float32 (dense SDPA), within 1e-2 or twice the eager
  forward's own error in this dtype, and its mean cosine similarity per output row.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from graphs.packing import Batch
from graphs.precision import float32_copy, quantize_with_gate
from graphs.runner import GraphRunner, plan_for
from graphs.self_check import OK, self_check
from models import VisualInput, load_tower
from models.families import FAMILIES
from models.presets import PRESETS
from models.quantization import cosine_per_row

DEV = torch.device("cuda")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rows(out) -> torch.Tensor:
    return torch.cat([out.embeds, *out.deepstack], dim=-1)


def make(tower, grid, modality, rng) -> VisualInput:
    t, h, w = grid
    return VisualInput(modality, rng.integers(0, 256, (t * h * w, tower.processor.patch_dim), np.uint8), grid)


def check(name: str, dtype: str) -> dict:
    """`dtype` may carry `+fp8`: the tower quantized (graphs/precision.py), measured against its float32 self."""
    dtype, _, quantization = dtype.partition("+")
    tower = load_tower(name, device="cuda", dtype=dtype)
    video = FAMILIES[tower.family].video
    exact = None
    if quantization:
        exact = float32_copy(tower)
        tower.quantization = quantize_with_gate(tower, DEV, video)
    plan = plan_for(tower, max_batch_tokens=2048, budgets=[256, 2048])
    runner = GraphRunner(tower, DEV, plan, modalities=("image", "video") if video else ("image",))
    runner.capture()
    report: dict = {"preset": name, "dtype": dtype, "quantization": getattr(tower, "quantization", None),
                    "backend": tower.backend, "failed_keys": len(runner.pool.failed)}
    report["self_check"] = self_check(runner)
    m, rng = tower.merge, np.random.default_rng(0)
    target = make(tower, (1, 8 * m, 10 * m), "image", rng)
    others = [make(tower, (1, m * int(rng.integers(1, 12)), m * int(rng.integers(1, 12))), "image", rng)
              for _ in range(31)]
    alone = rows(runner.encode([target])[0])
    differs = []
    for count in (1, 7, 31):
        batch = [*others[:count], target]
        if not torch.equal(rows(runner.encode(batch)[count]), alone):
            differs.append(f"packed with {count}")
        # all of them in one graph: the class of the longest frame, the smallest budget that holds them
        fit = runner.pack_items(batch)
        keys = [b.key for b in fit if b.key is not None]
        longest = max(keys, key=lambda k: k.length_class)
        for budget in plan.budgets:
            key = type(longest)("image", budget, longest.length_class)
            if key not in runner.pool.graphs or sum(it.num_patches for it in batch) > budget * tower.merge_unit:
                continue
            try:
                got = runner.run_batch(Batch(key, list(range(len(batch)))), batch)
            except ValueError:  # more segments than the key holds
                continue
            if not torch.equal(rows(got[count]), alone):
                differs.append(f"with {count} in {key}")
        eager = runner.run_batch(Batch(None, list(range(len(batch))), reason="padding"), batch)
        if not torch.equal(rows(eager[count]), alone):
            differs.append(f"eager with {count}")
    if not torch.equal(rows(runner.run_batch(Batch(None, [0], reason="padding"), [target])[0]), alone):
        differs.append("eager alone")
    if video:
        clips = [make(tower, (2, 6 * m, 4 * m), "video", rng), make(tower, (4, 4 * m, 4 * m), "video", rng)]
        solo = rows(runner.encode(clips[:1])[0])
        if not torch.equal(rows(runner.encode(clips)[0]), solo):
            differs.append("video beside another")
        if not torch.equal(rows(runner.run_batch(Batch(None, [0], reason="padding"), clips[:1])[0]), solo):
            differs.append("video eager")
    report["differs"] = differs
    exact = exact if exact is not None else float32_copy(tower)
    ref = GraphRunner(exact, DEV, plan, use_graphs=False).eager(target.pixels, [target.grid_thw]).embeds
    eager_err = rel_err(runner.eager(target.pixels, [target.grid_thw]).embeds, ref)
    report["error"], report["eager_error"] = rel_err(alone[:, :tower.out_hidden_size], ref), eager_err
    report["cosine"] = cosine_per_row(alone[:, :tower.out_hidden_size], ref).mean().item()
    report["bound"] = max(1e-2, 2 * eager_err) if dtype != "float32" else 1e-4
    report["ok"] = (not differs and report["error"] <= report["bound"]
                    and all(r == OK for r in report["self_check"].values()) and not runner.pool.failed)
    del runner, exact
    torch.cuda.empty_cache()
    return report


def main() -> None:
    dtype, names = sys.argv[1], sys.argv[2:]
    for name in names or [n for n in PRESETS if n.startswith("tiny-")]:
        try:
            print(json.dumps(check(name, dtype)), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the caller fails on it
            print(json.dumps({"preset": name, "dtype": dtype, "ok": False, "exception": repr(exc)}), flush=True)


if __name__ == "__main__":
    main()
