"""A mixture-of-experts MLP inside a vision tower (dots3-note's later blocks), sync-free and batch-invariant.

Routing as the reference routes: a float32 router's sigmoid scores; the top-k experts by score plus a
per-expert correction bias; their scores, renormalised to sum to one and scaled, are the weights. Each
expert is a SwiGLU MLP.

The experts run as a dense pass: every expert over every row, each output times the row's weight for that
expert (zero unless chosen) and added in expert order, which is the reference's order of adds for each
row. Shapes are static, nothing is read back to the host, no row is dropped, and a row's output depends on
that row alone, so a graph captures it and an item's bytes do not depend on its batch. The price is compute:
num_experts / top_k times the expert FLOPs of routed execution. dots3-note at its released size runs 608
expert passes over its 17 sparse blocks where top-2 routing needs 34: the whole tower does 5.1x the FLOPs of
routed execution on a 448x448 image (13.9 against 2.7 GFLOP per patch) and 4.0x on a 1344x756 one, whose
longer attention weighs more. A grouped product over rows sorted by expert (torch._grouped_mm with offsets
on the device) would do the routed FLOPs; whether its rows come out the same in every batch needs checking
on the GPU first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import NamedGatedMlp
from models.layers import GatedMlp


class SparseMoe(nn.Module):
    """Routed SwiGLU experts without a shared expert.

    Parameters as dots3-note's checkpoints name them: `experts.<e>.<gate, up, down>` (`expert_names` maps
    GatedMlp's gate_proj / up_proj / down_proj to the checkpoint's), `gate_weight` [experts, dim] (the
    router) and `router_bias` [experts] (the correction added to the scores for the choice only). The
    router stays float32 whatever the tower's dtype, as transformers keeps it: in bf16 it would choose
    other experts.
    """

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, act: str, scaling: float = 1.0,
                 expert_names: dict[str, str] | None = None, bias: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top-{top_k} routing over {experts} experts")
        self.top_k, self.scaling = top_k, scaling

        def expert() -> GatedMlp:
            return NamedGatedMlp(dim, hidden, act, bias).use_names(expert_names) if expert_names \
                else GatedMlp(dim, hidden, act, bias)

        self.experts = nn.ModuleList(expert() for _ in range(experts))
        self.gate_weight = nn.Parameter(torch.empty(experts, dim))
        self.router_bias = nn.Parameter(torch.empty(experts))

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        super()._apply(fn, recurse)
        for p in (self.gate_weight, self.router_bias):  # dtype casts of the tower leave the router in float32
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, experts] float32 weights: the chosen experts' renormalised, scaled scores, zero elsewhere."""
        scores = F.linear(x.float(), self.gate_weight).sigmoid()
        _, chosen = torch.topk(scores + self.router_bias, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return torch.zeros_like(scores).scatter(1, chosen, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):  # a fixed number of experts, never of items
            weight = route[:, e : e + 1]
            # where, not a product alone: an expert's inf on a row that did not choose it must not make NaN
            out = out + torch.where(weight > 0, expert(x) * weight, 0.0).to(x.dtype)
        return out
