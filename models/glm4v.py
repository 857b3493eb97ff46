"""GLM-4.1V vision tower (also GLM-4.5V's, and GLM-OCR's without the position table).

Qwen2.5-VL-style patches followed by an RMSNorm, a learned position table resampled bicubically to
each frame's grid, RMSNorm blocks with a SwiGLU MLP and the same axial rotary, an RMSNorm after the
blocks, a Conv2d that merges each 2x2 block into one token, and a gated merger.

The resampling is metadata: transformers samples the table with `grid_sample(mode="bicubic",
align_corners=False, padding_mode="border")` at each patch's centre; that is 16 table rows and 16
weights per patch (4 per axis, the cubic convolution with A = -0.75, indices clamped to the border),
built on the CPU in float32 in merge-block order, so the device does one weighted gather
(`embedding_bag`), in float32 like the reference, and a graph replays it from static buffers.

The Conv2d's kernel equals its stride, so it is one matrix product over each merge block's
concatenated patches: after loading, its weight is stored in that product's layout and the
checkpoint's parameter stays a view of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.attention import packed_attention
from models.config import ProcessorConfig
from models.kernels import apply_rotary
from models.layers import Block, PatchEmbed, RMSNorm
from models.metadata import GRID_CACHE_SIZE, block_order_positions, frozen
from models.protocol import Capacity, Grid, TowerOutput
from models.qwen2_5_vl import GatedMlp
from models.tower import QwenTower

CUBIC_A = -0.75  # PyTorch's bicubic (grid_sample, interpolate)


class GlmAttention(nn.Module):
    """Fused q/k/v projection with the checkpoint's biases; GLM-OCR normalises q and k per head
    (RMSNorm over the head dim) before the rotary."""

    def __init__(self, dim: int, heads: int, backend: str, qkv_bias: bool, proj_bias: bool, qk_norm: bool,
                 eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.backend = backend
        if qk_norm:
            self.q_norm = RMSNorm(dim // heads, eps)
            self.k_norm = RMSNorm(dim // heads, eps)
        self.qk_norm = qk_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.heads, -1)
        qk = qkv[:, :2]
        if self.qk_norm:
            d = qkv.shape[-1]
            q = self.q_norm(qkv[:, 0].reshape(-1, d)).view(n, 1, self.heads, d)
            k = self.k_norm(qkv[:, 1].reshape(-1, d)).view(n, 1, self.heads, d)
            qk = torch.cat([q, k], dim=1)
        q, k = apply_rotary(qk, cos, sin).unbind(1)
        out = packed_attention(self.backend, q, k, qkv[:, 2], cu_seqlens, max_seqlen)
        return self.proj(out.reshape(n, -1))


class GlmGatedMlp(GatedMlp):
    """SwiGLU whose projections may have no bias (GLM-4.1V's have none, GLM-OCR's do)."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__(dim, hidden, act)
        if not bias:
            self.gate_proj = nn.Linear(dim, hidden, bias=False)
            self.up_proj = nn.Linear(dim, hidden, bias=False)
            self.down_proj = nn.Linear(hidden, dim, bias=False)

    def fuse(self) -> None:
        if self.gate_proj.bias is not None:
            super().fuse()
            return
        h, padded = self.hidden, -(-self.hidden // 64) * 64
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        weight = gate.weight.new_zeros(2 * padded, gate.weight.shape[1])
        down_weight = down.weight.new_zeros(down.weight.shape[0], padded)
        weight[:h], weight[padded : padded + h] = gate.weight.data, up.weight.data
        down_weight[:, :h] = down.weight.data
        gate.weight.data, up.weight.data = weight[:h], weight[padded : padded + h]
        down.weight.data = down_weight[:, :h]
        self.fused = (weight, None, down_weight, padded)


class GlmMerger(GlmGatedMlp):
    """proj -> LayerNorm -> GELU -> SwiGLU (gate/up/down), on each merged token."""

    def __init__(self, dim: int, context: int, act: str) -> None:
        super().__init__(dim, context, act, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return super().forward(x)


class MergeConv(nn.Conv2d):
    """The checkpoint's `downsample` Conv2d (kernel = stride = merge): one matrix product over each merge
    block's patches, concatenated in the processor's order (merge row, merge column, channel)."""

    def __init__(self, dim: int, out: int, merge: int) -> None:
        super().__init__(dim, out, kernel_size=merge, stride=merge)
        self.flat: torch.Tensor | None = None

    def fuse(self) -> None:
        flat = self.weight.data.permute(0, 2, 3, 1).contiguous()  # [out, m, m, dim]
        self.weight.data = flat.permute(0, 3, 1, 2)
        self.flat = flat.view(flat.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.flat if self.flat is not None else self.weight.permute(0, 2, 3, 1).reshape(self.out_channels, -1)
        return F.linear(x.view(-1, flat.shape[1]), flat, self.bias)


def cubic_weights(t: np.ndarray) -> np.ndarray:
    """[n, 4] float32 cubic-convolution weights of the taps at floor-1 .. floor+2 for fractions t (PyTorch's
    `get_cubic_upsample_coefficients`)."""
    a = np.float32(CUBIC_A)
    one = np.float32(1)

    def near(x: np.ndarray) -> np.ndarray:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + one

    def far(x: np.ndarray) -> np.ndarray:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return np.stack([far(t + one), near(t), near(one - t), far(2 - t)], axis=1).astype(np.float32)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Four table indices and weights per position along one axis: patch centre `index + 0.5` of `size`
    mapped to [-1, 1] and back onto `side` table cells (align_corners=False), float32 as the reference."""
    norm = (index.astype(np.float32) + np.float32(0.5)) / np.float32(size) * np.float32(2) - np.float32(1)
    src = (norm + np.float32(1)) * np.float32(side / 2) - np.float32(0.5)
    floor = np.floor(src)
    taps = floor.astype(np.int64)[:, None] + np.arange(-1, 3)
    return np.clip(taps, 0, side - 1), cubic_weights((src - floor).astype(np.float32))


@lru_cache(maxsize=GRID_CACHE_SIZE)
def frame_taps(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Table indices and weights [h*w, 16] of one frame's patches, in merge-block order (read-only)."""
    pos = block_order_positions(h, w, merge)
    row_taps, row_w = _axis_taps(pos[:, 0], h, side)
    col_taps, col_w = _axis_taps(pos[:, 1], w, side)
    idx = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 16)
    wts = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 16)
    return frozen(idx), frozen(wts)


class Glm4vVisionTower(QwenTower):
    family = "glm4v"

    def __init__(self, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        cfg = vision_config
        dim = cfg.hidden_size
        super().__init__(cfg, processor, backend, dim)
        self.family = processor.family
        ocr = processor.family == "glm_ocr"
        cin, tps, ps = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        self.patch_embed = PatchEmbed((cin, tps, ps, ps), dim, bias=True)
        eps = cfg.rms_norm_eps
        # GLM-4.1V's block MLP is out_hidden_size wide and bias-free; GLM-OCR's is intermediate_size wide,
        # with biases like its attention.
        mlp_width = cfg.intermediate_size if ocr else cfg.out_hidden_size
        self.blocks = nn.ModuleList(
            Block(
                RMSNorm(dim, eps),
                RMSNorm(dim, eps),
                GlmAttention(dim, self.heads, backend, cfg.attention_bias, proj_bias=ocr and cfg.attention_bias,
                             qk_norm=ocr, eps=eps),
                GlmGatedMlp(dim, mlp_width, cfg.hidden_act, bias=ocr and cfg.attention_bias),
            )
            for _ in range(cfg.depth)
        )
        self.has_positions = not ocr
        if self.has_positions:
            self.post_conv_layernorm = RMSNorm(dim, eps)
            self.embeddings = nn.Module()
            side = cfg.image_size // cfg.patch_size
            self.embeddings.position_embedding = nn.Embedding(side * side, dim)
            self.side = side
        self.post_layernorm = RMSNorm(dim, eps)
        out = cfg.out_hidden_size
        self.downsample = MergeConv(dim, out, self.merge)
        self.merger = GlmMerger(out, out * cin if ocr else cfg.intermediate_size, cfg.hidden_act)

    @property
    def out_hidden_size(self) -> int:
        return self.config.out_hidden_size

    def reset_buffers(self) -> None:
        super().reset_buffers()
        for blk in self.blocks:
            blk.mlp.fuse()
        self.merger.fuse()
        self.downsample.fuse()

    # ---- CPU half -------------------------------------------------------------------------
    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        if not self.has_positions:
            return meta
        # Padding rows read table row 0 with weight 0.
        idx = np.zeros((cap.patches, 16), dtype=np.int64)
        wts = np.zeros((cap.patches, 16), dtype=np.float32)
        offset = 0
        for t, h, w in grids:
            frame_idx, frame_w = frame_taps(h, w, self.merge, self.side)
            idx[offset : offset + t * h * w].reshape(t, h * w, 16)[:] = frame_idx
            wts[offset : offset + t * h * w].reshape(t, h * w, 16)[:] = frame_w
            offset += t * h * w
        meta.update(interp_idx=idx, interp_w=wts)
        return meta

    # ---- device half ----------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        delta = None
        if self.has_positions:
            x = self.post_conv_layernorm(x)
            table = self.embeddings.position_embedding.weight
            # A weighted sum of 16 rows per patch in one kernel, without a [patches, 16, dim] intermediate.
            pos = F.embedding_bag(meta["interp_idx"], table.float(), per_sample_weights=meta["interp_w"], mode="sum")
            delta = pos.to(table.dtype).to(x.dtype)
        x, _ = self.run_blocks(x, meta, cap, delta=delta)
        x = self.downsample(self.post_layernorm(x))
        return TowerOutput(self.merger(x), [])
