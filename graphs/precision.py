"""`--quantization fp8` at load: the tower's products put in FP8 (models/quantization.py) only if, on seeded
inputs, its outputs agree with its own unquantized outputs.

Agreement is the cosine similarity of each output row (a merged token, DeepStack features beside it) with the
same row before quantization; an item's figure is the mean over its rows. The bar: a mean over the items of at
least `MEAN_COSINE` and no item below `WORST_COSINE`. A tower below it is refused (`QuantizationRefused`, with
the figures): the server does not start, rather than serve embeddings its language model was not trained on.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from graphs.runner import GraphRunner, joined, plan_for
from models.config import VisualInput
from models.quantization import cosine_per_row, quantize_tower

log = logging.getLogger("vitserve.graphs")

MEAN_COSINE = 0.995
WORST_COSINE = 0.99


class QuantizationRefused(RuntimeError):
    """The tower's FP8 outputs fall below the agreement bar; the message has the figures."""


def gate_items(tower: Any, video: bool) -> list[VisualInput]:
    """Seeded images of three shapes, and two short videos where the family takes video."""
    m, rng = tower.merge, np.random.default_rng(0)
    grids = [("image", (1, 8 * m, 8 * m)), ("image", (1, 4 * m, 12 * m)), ("image", (1, 2 * m, 3 * m))]
    if video:
        grids += [("video", (2, 4 * m, 4 * m)), ("video", (4, 2 * m, 4 * m))]
    return [VisualInput(modality, rng.integers(0, 256, (t * h * w, tower.processor.patch_dim), np.uint8), (t, h, w))
            for modality, (t, h, w) in grids]


def quantize_with_gate(tower: Any, device: torch.device, video: bool, mean_bar: float = MEAN_COSINE,
                       worst_bar: float = WORST_COSINE) -> dict[str, Any]:
    """Quantize `tower` in place and return the agreement figures, or raise QuantizationRefused."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise QuantizationRefused(f"{name} has no FP8 products (compute capability 8.9 or later: Ada, Hopper)")
    runner = GraphRunner(tower, device, plan_for(tower, max_batch_tokens=256), use_graphs=False,
                         modalities=("image", "video") if video else ("image",))
    items = gate_items(tower, video)

    def encode() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [joined(runner.eager(it.pixels, [it.grid_thw], it.modality)).float() for it in items]

    before = encode()
    products = quantize_tower(tower)
    after = encode()
    per_item = [cosine_per_row(a, b).mean().item() for a, b in zip(after, before)]
    worst = int(np.argmin(per_item))
    report = {"mode": "fp8", "products": products, "mean_cosine": round(float(np.mean(per_item)), 5),
              "worst_cosine": round(per_item[worst], 5),
              "worst_item": f"{items[worst].modality} {list(items[worst].grid_thw)}",
              "bar": {"mean": mean_bar, "worst": worst_bar}}
    if not all(np.isfinite(per_item)) or report["mean_cosine"] < mean_bar or report["worst_cosine"] < worst_bar:
        raise QuantizationRefused(
            f"FP8 outputs agree with the unquantized tower's at a mean cosine of {report['mean_cosine']} (worst "
            f"{report['worst_cosine']}, {report['worst_item']}), below the bar of {mean_bar} (worst {worst_bar}): "
            "serve it without --quantization")
    log.info("fp8: %d products quantized; outputs agree with the unquantized tower's at a mean cosine of %.5f "
             "(worst %.5f, %s)", products, report["mean_cosine"], report["worst_cosine"], report["worst_item"])
    return report
