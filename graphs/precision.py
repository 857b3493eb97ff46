"""`--quantization fp8` at load: the tower's products put in FP8 (models/quantization.py) only if, on seeded
inputs, its outputs agree with the same tower's in float32 (the reference the accuracy figures use).

Agreement is the cosine similarity of each output row (a merged token) with the same row of the float32 tower,
for the embedding and each DeepStack level apart; an item's figure is the worst of its outputs' means over their
rows (the levels side by side would hide a worse embedding behind better early levels: on a random Qwen3-VL-8B,
0.99515 joined against 0.99460 for the embedding alone, the gate's 16x16-patch image with its first block in bf16).
The bar: a mean over the items of at least `MEAN_COSINE` and no item below `WORST_COSINE`. Where the whole tower
falls below it, its first blocks are kept in bf16 (an early error passes through every later block), as few as
pass; a tower below it with half its blocks in bf16 is refused (`QuantizationRefused`, with the figures): the
server does not start, rather than serve embeddings its language model was not trained on.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import torch

from graphs.runner import GraphRunner, plan_for
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


def float32_copy(tower: Any) -> Any:
    """The tower in float32 with dense SDPA attention: the reference FP8 is held to (a copy, for as long as
    the gate runs: twice the served weights' room again)."""
    exact = copy.deepcopy(tower).float()
    exact.reset_buffers()
    exact.set_attention("sdpa")
    return exact


def item_agreement(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """One item's figure: the worst, over its embedding and DeepStack levels, of the mean row cosine."""
    return min(cosine_per_row(a, b).mean().item() for a, b in zip(got, ref))


def bf16_block_counts(depth: int) -> list[int]:
    """The gate's tries: every block in FP8, then the first 1, 2, 4, ... blocks kept in bf16, up to half."""
    counts, k = [0], 1
    while k <= depth // 2:
        counts.append(k)
        k *= 2
    return counts


def quantize_with_gate(tower: Any, device: torch.device, video: bool, mean_bar: float = MEAN_COSINE,
                       worst_bar: float = WORST_COSINE) -> dict[str, Any]:
    """Quantize `tower` in place and return the agreement figures, or raise QuantizationRefused.

    An error made in an early block passes through every later one, so where the whole tower falls below the
    bar, the first blocks are kept in bf16 (1, 2, 4, ... up to half of them) until it passes."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise QuantizationRefused(f"{name} has no FP8 products (compute capability 8.9 or later: Ada, Hopper)")
    items = gate_items(tower, video)

    def runner_of(model: Any) -> GraphRunner:
        return GraphRunner(model, device, plan_for(model, max_batch_tokens=256), use_graphs=False,
                           modalities=("image", "video") if video else ("image",))

    def encode(runner: GraphRunner) -> list[list[torch.Tensor]]:
        """Each item's outputs: its embedding, then each DeepStack level."""
        with torch.inference_mode():
            outs = [runner.eager(it.pixels, [it.grid_thw], it.modality) for it in items]
        return [[o.embeds.float(), *(d.float() for d in o.deepstack)] for o in outs]

    served = runner_of(tower)  # the same tower object through every try
    before = encode(runner_of(float32_copy(tower)) if tower.dtype != torch.float32 else served)
    best: dict[str, Any] = {}
    for bf16_blocks in bf16_block_counts(len(tower.block_stack())):
        quantized = quantize_tower(tower, bf16_blocks)
        per_item = [item_agreement(got, ref) for got, ref in zip(encode(served), before)]
        worst = int(np.argmin(per_item))
        report = {"mode": "fp8", "products": quantized.products, "bf16_blocks": bf16_blocks,
                  "mean_cosine": round(float(np.mean(per_item)), 5), "worst_cosine": round(per_item[worst], 5),
                  "worst_item": f"{items[worst].modality} {list(items[worst].grid_thw)}",
                  "bar": {"mean": mean_bar, "worst": worst_bar}}
        # the figures unrounded: a mean of 0.994996 is below a bar of 0.995
        if all(np.isfinite(per_item)) and np.mean(per_item) >= mean_bar and per_item[worst] >= worst_bar:
            quantized.commit()
            log.info("fp8: %d products quantized (the first %d blocks kept in bf16); outputs agree with the "
                     "tower's float32 outputs at a mean cosine of %.5f (worst %.5f, %s)", quantized.products,
                     bf16_blocks, report["mean_cosine"], report["worst_cosine"], report["worst_item"])
            return report
        quantized.undo()
        if not best or report["mean_cosine"] > best["mean_cosine"]:
            best = report
    raise QuantizationRefused(
        f"FP8 outputs agree with the tower's float32 outputs at a mean cosine of {best['mean_cosine']} (worst "
        f"{best['worst_cosine']}, {best['worst_item']}; the first {best['bf16_blocks']} blocks in bf16), below "
        f"the bar of {mean_bar} (worst {worst_bar}): serve it without --quantization")
