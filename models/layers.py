"""Building blocks shared by the Qwen-VL towers.

Parameter names follow the released checkpoints (after the `visual.` prefix) so a state dict loads
as is. Every forward is shape-static and sync-free: see models/protocol.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import packed_attention
from models.kernels import ACTIVATIONS, add_norm, apply_rotary, linear_act


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d whose kernel equals its stride: one matrix product per patch row."""

    def __init__(self, in_dim: tuple[int, int, int, int], embed_dim: int, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_dim[0], embed_dim, kernel_size=in_dim[1:], stride=in_dim[1:], bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class RMSNorm(nn.Module):
    """Normalise in float32, round to the input dtype, then scale, as the reference does."""

    rms = True  # read by models.kernels.add_norm

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_norm(x, None, self)[1]


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return name


class Mlp(nn.Module):
    """fc2(act(fc1(x))). The attribute names differ between families (`fc1` in Qwen2-VL,
    `linear_fc1` in Qwen3-VL), so the checkpoint's names are given."""

    def __init__(self, dim: int, hidden: int, act: str, names: tuple[str, str] = ("fc1", "fc2")) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(dim, hidden))
        setattr(self, names[1], nn.Linear(hidden, dim))
        self.act = check_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = (getattr(self, n) for n in self.names)
        return fc2(linear_act(x, fc1, self.act))


class Rotary2D(nn.Module):
    """Axial rotary embedding: half the rotated dims follow the row, half the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        quarter = self.head_dim // 2
        return 1.0 / (self.theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter))

    def reset(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos: [P, 2] integer (row, col) -> cos, signed sin: [P, 1, 1, head_dim] float32.

        The sign of rotate_half is folded into sin (first half negated), so that applying the
        rotation is x*cos + roll(x)*sin: three kernels for q and k together.
        """
        freqs = (pos.float()[..., None] * self.inv_freq).flatten(1)  # [P, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        half = freqs.shape[-1]
        sin = emb.sin()
        sin[:, :half].neg_()
        return emb.cos()[:, None, None], sin[:, None, None]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, backend: str) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.backend = backend

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.heads, -1)
        q, k = apply_rotary(qkv[:, :2], cos, sin).unbind(1)
        out = packed_attention(self.backend, q, k, qkv[:, 2], cu_seqlens, max_seqlen)
        return self.proj(out.reshape(n, -1))


class Block(nn.Module):
    """Pre-norm transformer block; the families differ only in their norm and MLP modules.

    The residual adds are fused with the norm that follows them (models.kernels.add_norm), so a
    block takes its input already normalised and returns the MLP output unadded: the caller adds
    it together with the next block's first norm (see QwenTower.run_blocks).
    """

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(
        self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        cu_seqlens: torch.Tensor, max_seqlen: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, normed: norm1(x) -> (x + attention, MLP output)."""
        x, normed = add_norm(x, self.attn(normed, cos, sin, cu_seqlens, max_seqlen), self.norm2)
        return x, self.mlp(normed)


class Normalize(nn.Module):
    """uint8 patch rows -> rescaled, mean/std-normalised float32 rows (the processor's last steps)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, rescale: float) -> None:
        super().__init__()
        self._mean, self._std = mean.float().clone(), std.float().clone()
        self.register_buffer("mean", self._mean.clone(), persistent=False)
        self.register_buffer("std", self._std.clone(), persistent=False)
        self.rescale = rescale

    def reset(self) -> None:
        self.mean = self._mean.to(self.mean.device)
        self.std = self._std.to(self.std.device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if not pixels.dtype == torch.uint8:
            return pixels  # already normalised (reference inputs, benchmarks)
        return (pixels.float() * self.rescale - self.mean) / self.std
