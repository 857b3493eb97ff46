"""FP8 beside bf16, each against the same tower in float32 (`vitserve bench --accuracy`, GPU).

Per model: the bf16 tower as it serves, its FP8 form as `--quantization fp8` makes it (the load-time gate picks
how many first blocks stay bf16; where it refuses the tower, every block in FP8, marked `refused`), and a float32
copy with dense SDPA attention as the reference. Each item runs
alone, eagerly. Per item: the mean over its output rows of their cosine similarity to the reference rows, and
the relative error of all its rows, for the merged embedding and, where the tower has them, the DeepStack
features; per model: the mean over items and the worst item. Inputs are seeded random pixels of the benchmark's
shapes (one 448x448 image, a 224x224 one, a 1344x756 one, and a 16-frame 448x448 video where the family takes
video), the same in every run.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

from graphs.precision import QuantizationRefused, float32_copy, quantize_with_gate
from graphs.runner import GraphRunner, plan_for
from models import load_tower
from models.families import FAMILIES
from models.quantization import cosine_per_row
from service.bench.towers import random_items, workloads

SHAPES = ("1x448", "32x224", "1x1344x756", "video16f448")


def figures(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(mean cosine of the rows, relative error of the whole) of `got` against `ref`."""
    got, ref = got.float(), ref.float()
    return cosine_per_row(got, ref).mean().item(), ((got - ref).norm() / ref.norm()).item()


def measure(name: str, device: str = "cuda") -> list[dict]:
    dev = torch.device(device)
    tower = load_tower(name, device=device, dtype="bfloat16")
    video = FAMILIES[tower.family].video
    exact = float32_copy(tower)
    quantized = copy.deepcopy(tower)
    quantized.reset_buffers()
    try:  # as `--quantization fp8` serves it
        gate = quantize_with_gate(quantized, dev, video)
    except QuantizationRefused as exc:  # every block in FP8: the figures of a tower the server would refuse
        gate = {**quantize_with_gate(quantized, dev, video, mean_bar=0.0, worst_bar=0.0), "refused": str(exc)}
    grids = [workloads(tower.processor.patch_size)[s][0] for s in SHAPES if video or not s.startswith("video")]
    runners = {label: GraphRunner(t, dev, plan_for(t, max_batch_tokens=16384), use_graphs=False,
                                  modalities=("image", "video") if video else ("image",))
               for label, t in (("fp32", exact), ("bf16", tower), ("fp8", quantized))}
    rows = []
    for item in random_items(tower, grids, device=device):
        with torch.inference_mode():
            outs = {label: r.eager(item.pixels, [item.grid_thw], item.modality) for label, r in runners.items()}
        row: dict = {"model": name, "item": f"{item.modality} {list(item.grid_thw)}"}
        for label in ("bf16", "fp8"):
            row[f"{label}_cos"], row[f"{label}_err"] = figures(outs[label].embeds, outs["fp32"].embeds)
            if outs["fp32"].deepstack:
                levels = [figures(a, b) for a, b in zip(outs[label].deepstack, outs["fp32"].deepstack)]
                row[f"{label}_deepstack_cos"] = min(c for c, _ in levels)  # the worst level
                row[f"{label}_deepstack_err"] = max(e for _, e in levels)
        rows.append(row)
    # the gate's own figures (FP8 against float32 on its seeded items, each item's worst output) and what it kept
    rows.append({"model": name, "item": "_gate", **gate})
    return rows


def summary(rows: list[dict]) -> dict:
    """Per model: the mean and worst item cosine and the mean relative error, bf16 and FP8."""
    items = [r for r in rows if not r["item"].startswith("_")]
    out: dict = {"model": items[0]["model"], "items": len(items)}
    for label in ("bf16", "fp8"):
        cos = [r[f"{label}_cos"] for r in items]
        worst = int(np.argmin(cos))
        out[label] = {"mean_cos": round(float(np.mean(cos)), 5), "worst_cos": round(cos[worst], 5),
                      "worst_item": items[worst]["item"],
                      "mean_err": round(float(np.mean([r[f"{label}_err"] for r in items])), 4)}
        if f"{label}_deepstack_cos" in items[0]:
            out[label]["deepstack_worst_cos"] = round(min(r[f"{label}_deepstack_cos"] for r in items), 5)
    gate = next((r for r in rows if r["item"] == "_gate"), {})
    out["bf16_blocks"], out["refused"] = gate.get("bf16_blocks"), "refused" in gate
    return out


def run(models: list[str], out_path: Path) -> list[dict]:
    summaries = []
    for name in models:
        try:
            rows = measure(name)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a line; the others still run
            rows = [{"model": name, "item": "_failed", "error": repr(exc)}]
            print(json.dumps(rows[0]), flush=True)
            torch.cuda.empty_cache()
            continue
        torch.cuda.empty_cache()
        with open(out_path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        summaries.append(summary(rows))
        print(json.dumps(summaries[-1]), flush=True)
    return summaries
