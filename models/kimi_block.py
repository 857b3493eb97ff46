"""The Kimi-style vision block (Kimi-K2.x, Muse), built from the shared layers.

A block: LayerNorm (eps 1e-5) -> attention over packed segments (biased q, k, v and output projections,
axial rotary) -> residual -> LayerNorm -> Linear, activation, Linear -> residual. Two checkpoint layouts:
`kimi_block` (Muse, transformers' names: a models.layers.Block of `norm1`, `attn` with separate `q_proj` /
`k_proj` / `v_proj` fused into one GEMM after loading, `proj`, `norm2`, `mlp.fc1` / `fc2`) and
`PairwiseRotaryBlock` (Kimi-K2.x as released: `norm0`, `wqkv`, `wo`, `norm1`, `mlp.fc0` / `fc1`).

Their patch embeddings are models/patches.py's (a Conv2d over one frame; Muse's Linear, whose checkpoint
columns run (temporal, channel, pixels), reordered once after loading).
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers import Attention, Block, Mlp
from models.quantization import linear

KIMI_NORM_EPS = 1e-5  # the blocks' LayerNorms


class ProjAttention(Attention):
    """models.layers.Attention whose separate projections are called `q_proj`, `k_proj`, `v_proj`."""

    NAMES = ("q_proj", "k_proj", "v_proj")

    def __init__(self, dim: int, heads: int, backend: str) -> None:
        super().__init__(dim, heads, backend, separate=True)
        for short, name in zip(("q", "k", "v"), self.NAMES):
            setattr(self, name, getattr(self, short))
            delattr(self, short)

    @property
    def parts(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, name) for name in self.NAMES)  # type: ignore[return-value]

    def fuse(self) -> None:
        parts = self.parts
        weight = torch.cat([p.weight.data for p in parts])
        bias = torch.cat([p.bias.data for p in parts])
        start = 0
        for p in parts:
            end = start + p.weight.shape[0]
            p.weight.data, p.bias.data = weight[start:end], bias[start:end]
            start = end
        self.fused = (weight, bias)

    def projections(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        return linear(x, *self.fused)

    def fused_parts(self) -> tuple[nn.Module, ...]:
        return self.parts


def kimi_block(dim: int, heads: int, mlp: int, act: str, backend: str, eps: float = KIMI_NORM_EPS) -> Block:
    return Block(nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps), ProjAttention(dim, heads, backend),
                 Mlp(dim, mlp, act))


class PairwiseRotaryBlock(Attention):
    """The Kimi block as Moonshot's checkpoints lay it out (and transformers' save_pretrained writes it): the
    block holds `norm0`, one fused `wqkv`, `wo`, `norm1` and an `mlp` of `fc0` / `fc1`.

    Those checkpoints rotate q and k by pairs of adjacent channels (complex rotary); the tower rotates the two
    halves of each head (models.kernels.apply_rotary). After loading, `fuse` permutes each head's q and k
    rows in place from pairs (2j, 2j + 1) to (j, j + half), as transformers does when it loads them: the
    block then holds the permuted rows (a reload permutes the new ones again)."""

    def __init__(self, dim: int, heads: int, mlp: int, act: str, backend: str, eps: float = KIMI_NORM_EPS) -> None:
        super().__init__(dim, heads, backend)
        self.wqkv, self.wo = self._modules.pop("qkv"), self._modules.pop("proj")
        self.norm0, self.norm1 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, mlp, act, ("fc0", "fc1"))
        self.halves = False  # q and k rows in rotate-half order
        self._register_load_state_dict_pre_hook(self._loading)

    @property
    def qkv(self) -> nn.Linear:
        return self.wqkv

    @property
    def proj(self) -> nn.Linear:
        return self.wo

    def _loading(self, *args, **kwargs) -> None:
        self.halves = False

    def fuse(self) -> None:
        if self.halves:
            return
        rows = 2 * self.wqkv.out_features // 3  # q and k
        head = rows // (2 * self.heads)
        for p in (self.wqkv.weight, self.wqkv.bias):
            qk = p.data[:rows]
            qk.copy_(qk.reshape(2 * self.heads, head // 2, 2, -1).transpose(1, 2).reshape(qk.shape))
        self.halves = True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, short: bool = False) -> torch.Tensor:
        """One whole block: x + attention(norm0(x)), then + mlp(norm1(.))."""
        x = x + super().forward(self.norm0(x), cos, sin, cu_seqlens, max_seqlen, short)
        return x + self.mlp(self.norm1(x))
