"""Building blocks shared by the Qwen-style towers (models/tower.py assembles them as a family says).

Parameter names follow the released checkpoints (after the `visual.` prefix) so a state dict loads
as is. Every forward is shape-static and sync-free: see models/protocol.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import packed_attention
from models.kernels import (
    ACTIVATIONS,
    activate,
    add_norm,
    apply_rotary,
    clamped_swiglu,
    linear_act,
    normalize_pixels,
    rotary_tables,
)
from models.quantization import Fp8Linear, fp8_input_width, linear, width_of


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

    def fp8_input(self) -> int | None:
        fc1 = getattr(self, self.names[0])
        return width_of(fc1.weight) if isinstance(fc1, Fp8Linear) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = (getattr(self, n) for n in self.names)
        if isinstance(fc2, Fp8Linear):  # the activation writes fc2's e4m3 rows itself
            return fc2(activate(fc1(x), self.act, fp8_width=width_of(fc2.weight)))
        return fc2(linear_act(x, fc1, self.act))


class GatedMlp(nn.Module):
    """SwiGLU. After loading, gate and up projections share one weight so a single GEMM computes
    both, and the intermediate width is zero-padded to a multiple of 64 (Qwen2.5-VL's 3420 is not
    a multiple of 8, which pushes cuBLAS onto slow kernels); padded units are exactly zero. The
    checkpoint's parameter names stay as views into the fused tensors.

    `limit` (GLM-5): the gate is clamped to at most limit and the up projection to [-limit, limit] before
    the activation (padded units stay zero)."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool = True, limit: float | None = None) -> None:
        super().__init__()
        self.hidden = hidden
        self.limit = limit
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = check_activation(act)
        self.fused: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int] | None = None

    def fuse(self) -> None:
        h, padded = self.hidden, -(-self.hidden // 64) * 64
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if self.fused is not None and isinstance(self.fused[0], torch.Tensor) \
                and self.fused[0].data_ptr() == gate.weight.data_ptr() \
                and self.fused[0].dtype == gate.weight.dtype:  # still in place (not cast or moved since)
            return
        weight = gate.weight.new_zeros(2 * padded, gate.weight.shape[1])
        down_weight = down.weight.new_zeros(down.weight.shape[0], padded)
        weight[:h], weight[padded : padded + h] = gate.weight.data, up.weight.data
        down_weight[:, :h] = down.weight.data
        gate.weight.data, up.weight.data = weight[:h], weight[padded : padded + h]
        down.weight.data = down_weight[:, :h]
        bias = None
        if gate.bias is not None:
            bias = gate.bias.new_zeros(2 * padded)
            bias[:h], bias[padded : padded + h] = gate.bias.data, up.bias.data
            gate.bias.data, up.bias.data = bias[:h], bias[padded : padded + h]
        self.fused = (weight, bias, down_weight, padded)

    FUSED_WEIGHTS = (0, 2)  # the positions in `fused` of the gate/up and down weights (models/quantization.py)

    def fused_parts(self) -> tuple[nn.Module, ...]:
        return (self.gate_proj, self.up_proj, self.down_proj)

    def fp8_input(self) -> int | None:
        return width_of(self.fused[0]) if self.fused is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            if self.limit is not None:
                both = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
                return self.down_proj(clamped_swiglu(both, self.act, self.hidden, self.limit))
            return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))
        weight, bias, down_weight, padded = self.fused
        if self.limit is None:  # an FP8 down product gets its e4m3 rows from the activation
            hidden = activate(linear(x, weight, bias), self.act, gated_width=padded, fp8_width=width_of(down_weight))
        else:
            hidden = clamped_swiglu(linear(x, weight, bias), self.act, padded, self.limit)
        return linear(hidden, down_weight, self.down_proj.bias)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose own calls (a merger's norm) take the fused kernel's single pass, as the blocks' norms do
    through `add_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.elementwise_affine or self.bias is None:
            return super().forward(x)
        return add_norm(x, None, self)[1]


def make_norm(kind: str, dim: int, eps: float = 1e-6) -> nn.Module:
    """The families' two norms: "layer" (LayerNorm) or "rms" (RMSNorm); eps 1e-6 unless a family says."""
    if kind == "layer":
        return LayerNorm(dim, eps=eps)
    if kind == "rms":
        return RMSNorm(dim, eps)
    raise ValueError(f"unknown norm {kind!r}: layer or rms")


class Merger(nn.Module):
    """Merge each block of `unit` patches into one token: norm, concatenate, fc1, GELU, fc2.

    `postshuffle` normalises the concatenated block (DeepStack mergers) rather than each patch.
    `layout` names the parameters as the checkpoints do: "mlp" is `ln_q` and `mlp.0` / `mlp.2`
    (Qwen2-VL, Qwen2.5-VL, the Omni models), "linear_fc" is `norm`, `linear_fc1`, `linear_fc2` (Qwen3-VL).
    """

    def __init__(self, dim: int, out_dim: int, unit: int, norm: str, layout: str = "mlp",
                 postshuffle: bool = False) -> None:
        super().__init__()
        self.width = dim * unit
        self.postshuffle = postshuffle
        self.layout = layout
        normed = make_norm(norm, self.width if postshuffle else dim)
        fc1, fc2 = nn.Linear(self.width, self.width), nn.Linear(self.width, out_dim)
        if layout == "mlp":
            self.ln_q = normed
            self.mlp = nn.Sequential(fc1, nn.GELU(), fc2)
        elif layout == "linear_fc":
            self.norm, self.linear_fc1, self.act_fn, self.linear_fc2 = normed, fc1, nn.GELU(), fc2
        else:
            raise ValueError(f"unknown merger layout {layout!r}: mlp or linear_fc")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.ln_q if self.layout == "mlp" else self.norm
        x = norm(x.view(-1, self.width)) if self.postshuffle else norm(x).view(-1, self.width)
        if self.layout == "mlp":
            return self.mlp(x)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


def position_table(rows: int, dim: int) -> nn.Embedding:
    """A learned position table, left uninitialised: towers are built on the meta device and then loaded or
    seeded, and initialising it there runs torch's Python reference of `normal_`, whose first call imports
    torch._dynamo (1.5 s of a server's start on 2 cores)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class Rotary2D(nn.Module):
    """Axial rotary embedding: half the rotated dims follow the row, half the column."""

    axes = 2  # coordinates per position

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        # Made on the CPU even while the tower is built on the meta device (`reset` makes them again on the
        # tower's device): arange on meta runs torch's Python reference, which imports torch._dynamo.
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)
        axis, freq = self.angle_columns()
        self.register_buffer("angle_axis", axis, persistent=False)
        self.register_buffer("angle_freq", freq, persistent=False)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        quarter = self.head_dim // 2
        return 1.0 / (self.theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter))

    def angle_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(coordinate, frequency) of each angle column: axis-major, every frequency for the row, then for the
        column (and further axes)."""
        band = self.inv_freq.shape[0]
        return torch.arange(self.axes * band, device=self.inv_freq.device) // band, self.inv_freq.repeat(self.axes)

    def reset(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        self.angle_axis, self.angle_freq = self.angle_columns()

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos: [P, axes] integer (row, col) -> cos, signed sin: [P, 1, 1, head_dim] float32.

        The sign of rotate_half is folded into sin (first half negated), so that applying the
        rotation is x*cos + roll(x)*sin: three kernels for q and k together.
        """
        return rotary_tables(pos, self.angle_axis, self.angle_freq)


class Attention(nn.Module):
    """Multi-head attention over packed segments with 2D rotary positions.

    The checkpoint holds one `qkv` projection (rows q, then k, then v) or, with `separate`, three
    (`q`, `k`, `v`: Qwen2.5-Omni), fused after loading into one GEMM as `fuse` says. `kv_heads` below
    `heads` is grouped-query attention (EXAONE 4.5): each key/value head serves `heads / kv_heads`
    consecutive query heads, expanded before the kernel so every backend sees plain multi-head inputs.
    `qk_norm` normalises each head of q and k (RMSNorm over the head dim, `q_norm` / `k_norm`) before
    the rotary (GLM-OCR). `bias` / `proj_bias`: whether the input and output projections have biases.
    """

    def __init__(self, dim: int, heads: int, backend: str, kv_heads: int | None = None,
                 separate: bool = False, bias: bool = True, proj_bias: bool = True, qk_norm: bool = False,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads or heads
        if heads % self.kv_heads:
            raise ValueError(f"{heads} attention heads cannot share {self.kv_heads} key/value heads")
        head_dim = dim // heads
        kv_dim = self.kv_heads * head_dim
        self.separate = separate
        if separate:
            self.q = nn.Linear(dim, dim, bias=bias)
            self.k = nn.Linear(dim, kv_dim, bias=bias)
            self.v = nn.Linear(dim, kv_dim, bias=bias)
        else:
            self.qkv = nn.Linear(dim, dim + 2 * kv_dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.backend = backend
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse(self) -> None:
        """Separate projections: one weight and bias holding q, k and v, the checkpoint's parameters
        kept as views into it (so a state dict still reads and writes them)."""
        if not self.separate:
            return
        parts = (self.q, self.k, self.v)
        weight = torch.cat([p.weight.data for p in parts])
        bias = torch.cat([p.bias.data for p in parts])
        start = 0
        for p in parts:
            end = start + p.weight.shape[0]
            p.weight.data, p.bias.data = weight[start:end], bias[start:end]
            start = end
        self.fused = (weight, bias)

    def projections(self, x: torch.Tensor) -> torch.Tensor:
        if not self.separate:
            return self.qkv(x)
        if self.fused is None:  # not loaded yet (shape checks, reference comparisons)
            return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)
        return linear(x, *self.fused)

    def fused_parts(self) -> tuple[nn.Module, ...]:
        return (self.q, self.k, self.v) if self.separate else ()

    def fp8_input(self) -> int | None:
        if self.separate:
            return width_of(self.fused[0]) if self.fused is not None else None
        return width_of(self.qkv.weight) if isinstance(self.qkv, Fp8Linear) else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
        short: bool = False,
    ) -> torch.Tensor:
        """`short`: this layer's segments are at most SHORT_SEQLEN rows by construction (models/attention.py)."""
        n, heads, kv = x.shape[0], self.heads, self.kv_heads
        rows = self.projections(x).view(n, heads + 2 * kv, -1)
        # q and k rotate together: one [n, 1, heads + kv, head_dim] view of the projection's rows
        qk = rows[:, : heads + kv]
        if self.qk_norm:
            d = rows.shape[-1]
            q = self.q_norm(rows[:, :heads].reshape(-1, d)).view(n, heads, d)
            qk = torch.cat([q, self.k_norm(rows[:, heads : heads + kv].reshape(-1, d)).view(n, kv, d)], dim=1)
        qk = apply_rotary(qk.unsqueeze(1), cos, sin)[:, 0]
        q, k, v = qk[:, :heads], qk[:, heads:], rows[:, heads + kv :]
        if kv != heads:
            k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        out = packed_attention(self.backend, q, k, v, cu_seqlens, max_seqlen, short)
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
        cu_seqlens: torch.Tensor, max_seqlen: int, short: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, normed: norm1(x) -> (x + attention, MLP output)."""
        x, normed = add_norm(x, self.attn(normed, cos, sin, cu_seqlens, max_seqlen, short), self.norm2,
                             fp8_input_width(self.mlp))
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
        return normalize_pixels(pixels, self.mean, self.std, self.rescale)

