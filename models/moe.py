"""A mixture-of-experts MLP inside a vision tower (dots3-note's later blocks), sync-free and batch-invariant.

Routing as the reference routes: a float32 router's sigmoid scores; the top-k experts by score plus a
per-expert correction bias; their scores, renormalised to sum to one and scaled, are the weights. Each
expert is a SwiGLU MLP.

Two ways to run the experts, both with static shapes and nothing read back to the host, so a graph
captures either:

* routed (CUDA, bfloat16): the (row, expert) pairs sorted by expert, every expert's rows in one grouped
  product (`torch._grouped_mm`, offsets on the device) over the experts' weights stacked [experts, ...],
  then each row's outputs added in expert order, the reference's order of adds. It does the routed FLOPs.
* dense (elsewhere: the CPU, whose grouped product loops over the groups and reads their sizes back, and
  CUDA fp16/fp32, which torch's grouped product serves the same way): every expert over every row, each
  output times the row's weight for that expert (zero unless chosen), added in expert order. The price is
  num_experts / top_k times the expert FLOPs: dots3-note runs 608 expert passes over its 17 sparse blocks
  where top-2 routing needs 34.

Either way no row is dropped and a row's output depends on that row alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import NamedGatedMlp
from models.kernels import activate
from models.layers import GatedMlp


class SparseMoe(nn.Module):
    """Routed SwiGLU experts without a shared expert.

    Parameters as dots3-note's checkpoints name them: `experts.<e>.<gate, up, down>` (`expert_names` maps
    GatedMlp's gate_proj / up_proj / down_proj to the checkpoint's), `gate_weight` [experts, dim] (the
    router) and `router_bias` [experts] (the correction added to the scores for the choice only). The
    router stays float32 whatever the tower's dtype, as transformers keeps it: in bf16 it would choose
    other experts.
    """

    keeps_precision = True  # --quantization fp8 leaves the router and the stacked experts as they are

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
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # `fuse`: the experts' weights, stacked

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        super()._apply(fn, recurse)
        for p in (self.gate_weight, self.router_bias):  # dtype casts of the tower leave the router in float32
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def choose(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts [rows, top_k] in ascending order and their float32 weights: renormalised,
        scaled scores."""
        scores = F.linear(x.float(), self.gate_weight).sigmoid()
        _, chosen = torch.topk(scores + self.router_bias, self.top_k, dim=-1, sorted=False)
        chosen, _ = chosen.sort(dim=-1)
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, experts] float32 weights: the chosen experts' weights, zero elsewhere."""
        chosen, weights = self.choose(x)
        return x.new_zeros(x.shape[0], len(self.experts), dtype=torch.float32).scatter(1, chosen, weights)

    def forward_routed(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.choose(x)
        rows, k = chosen.shape
        experts = chosen.reshape(-1)
        order = torch.argsort(experts, stable=True)  # pairs grouped by expert, rows ascending within one
        ends = torch.searchsorted(experts[order], torch.arange(1, len(self.experts) + 1, device=x.device))
        ends = ends.to(torch.int32)
        up, down = self.stacked
        padded = self.experts[0].fused[3]
        hidden = torch._grouped_mm(x[order // k], up.transpose(1, 2), offs=ends)
        hidden = activate(hidden, self.experts[0].act, gated_width=padded)
        out = torch._grouped_mm(hidden, down.transpose(1, 2), offs=ends)
        # each pair's output times its weight, rounded as the dense pass rounds it, back in (row, expert) order
        pairs = torch.empty_like(out)
        pairs[order] = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        pairs = pairs.view(rows, k, -1)
        total = pairs[:, 0]
        for j in range(1, k):  # expert order, as the dense pass adds
            total = total + pairs[:, j]
        return total

    @torch.no_grad()
    def fuse(self) -> None:
        """The experts' fused weights stacked, [experts, 2 x padded hidden, dim] and [experts, dim, padded hidden],
        each expert's parameters left as views into them (no second copy)."""
        for expert in self.experts:
            expert.fuse()
        if self.stacked is not None and self.stacked[0].data_ptr() == self.experts[0].fused[0].data_ptr():
            return
        up = torch.stack([e.fused[0] for e in self.experts])
        down = torch.stack([e.fused[2] for e in self.experts])
        for i, e in enumerate(self.experts):
            _, bias, _, padded = e.fused
            h = e.hidden
            e.gate_proj.weight.data, e.up_proj.weight.data = up[i, :h], up[i, padded : padded + h]
            e.down_proj.weight.data = down[i, :, :h]
            e.fused = (up[i], bias, down[i], padded)
        self.stacked = (up, down)

    def routed(self, x: torch.Tensor) -> bool:
        return (self.stacked is not None and x.is_cuda and x.dtype == torch.bfloat16 and self.experts[0].limit is None
                and self.experts[0].down_proj.bias is None and self.experts[0].fused[1] is None
                and torch.cuda.get_device_capability(x.device) >= (9, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.routed(x):
            return self.forward_routed(x)
        route = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):  # a fixed number of experts, never of items
            weight = route[:, e : e + 1]
            # where, not a product alone: an expert's inf on a row that did not choose it must not make NaN
            out = out + torch.where(weight > 0, expert(x) * weight, 0.0).to(x.dtype)
        return out
