"""Which products make a tower's FP8 outputs fall below the gate's bar: the tower's linear layers grouped by their
place (block numbers folded: `blocks.*.attn.proj`; a holder of several fused weights one group per weight,
`blocks.*.mlp#0` for its weight at position 0 of `fused`: a gated MLP's gate/up, `#2` its down), and for each group
the gate's figures (mean and worst item cosine against float32, on the gate's seeded items) with only that group in
FP8, and with every product in FP8 but that group. One JSON line per model and group.
    python3 tools/fp8_groups_probe.py OUT.jsonl MODEL [MODEL ...]     # GPU (compute capability 8.9 or later)
    --cpu (anywhere): torch's e4m3 on the CPU (slow at full size: minutes a group)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graphs.precision import float32_copy, gate_items, item_agreement  # noqa: E402
from graphs.runner import GraphRunner, plan_for  # noqa: E402
from models import load_tower  # noqa: E402
from models.families import FAMILIES  # noqa: E402
from models.quantization import Quantized, quantize_tower  # noqa: E402


def group_of(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def probe(model: str, dev: torch.device) -> list[dict]:
    tower = load_tower(model, device=str(dev), dtype="bfloat16")
    video = FAMILIES[tower.family].video
    items = gate_items(tower, video)
    runner = GraphRunner(tower, dev, plan_for(tower, max_batch_tokens=256), use_graphs=False,
                         modalities=("image", "video") if video else ("image",))

    def encode(r: GraphRunner) -> list[list[torch.Tensor]]:
        with torch.inference_mode():
            outs = [r.eager(it.pixels, [it.grid_thw], it.modality) for it in items]
        return [[o.embeds.float(), *(d.float() for d in o.deepstack)] for o in outs]

    exact = float32_copy(tower)
    ref = encode(GraphRunner(exact, dev, plan_for(exact, max_batch_tokens=256), use_graphs=False,
                             modalities=runner.modalities))
    del exact

    def figures() -> dict:
        per_item = [item_agreement(got, r) for got, r in zip(encode(runner), ref)]
        return {"mean": round(float(np.mean(per_item)), 5), "worst": round(float(np.min(per_item)), 5)}

    names = {id(m): n for n, m in tower.named_modules()}

    def fused_groups(module: torch.nn.Module) -> list[tuple[int, str]]:
        """(position, group) of each weight a fused holder quantizes."""
        base, positions = group_of(names[id(module)]), getattr(module, "FUSED_WEIGHTS", (0,))
        return [(i, base if len(positions) == 1 else f"{base}#{i}") for i in positions]

    def swap_group(swap: tuple) -> str:
        parent, name, _ = swap
        return group_of(f"{names[id(parent)]}.{name}")

    def only(selected: set[str]) -> Quantized:
        """Every product in FP8, then all but the groups in `selected` put back; returns what is left to undo."""
        q = quantize_tower(tower)
        for module, old, _ in q.fused:  # the selected weights stay quantized, the others go back
            chosen = {i for i, g in fused_groups(module) if g in selected}
            module.fused = tuple(v if i in chosen else old[i] for i, v in enumerate(module.fused))
        keep, back = [], []
        for swap in q.swaps:
            (keep if swap_group(swap) in selected else back).append(swap)
        Quantized(0, 0, [], back).undo()
        return Quantized(0, 0, q.fused, keep)

    whole = quantize_tower(tower)
    groups = sorted({g for module, _, _ in whole.fused for _, g in fused_groups(module)}
                    | {swap_group(swap) for swap in whole.swaps})
    rows = [{"model": model, "group": "(all)", "products": whole.products, **figures()}]
    whole.undo()
    for g in groups:
        q = only({g})
        alone = figures()
        q.undo()
        q = only(set(groups) - {g})
        rest = figures()
        q.undo()
        rows.append({"model": model, "group": g, "only_this_fp8": alone, "all_but_this_fp8": rest})
    return rows


def main(out_path: str, *models: str, device: str = "cuda") -> None:
    for model in models:
        rows = probe(model, torch.device(device))
        with open(out_path, "a") as f:
            for row in rows:
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    main(*args, device="cpu" if len(args) < len(sys.argv) - 1 else "cuda")
