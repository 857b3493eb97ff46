"""Towers whose checkpoints name their parts the SigLIP way (`layers.N.self_attn.q_proj`, `layer_norm1`, ...)
rather than Qwen-VL's (`blocks.N.attn.qkv`, `norm1`): the shared parts and the protocol plumbing.

A family's tower subclasses `ViTTower`, names its blocks with a `BlockNames` and adds its own embedding and
merger; the CPU half (capacity, cu_seqlens) and the block stack (pre-norm, residual adds fused with the next
norm, attention over packed segments, optional 2D rotary) are here once. Parameter names follow the
checkpoint (after the family's prefix), so a state dict loads as is; q, k and v are fused into one matrix
product after loading, the checkpoint's parameters kept as views into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.attention import packed_attention
from models.config import ProcessorConfig
from models.family import Dims, Family
from models.kernels import add_norm, apply_rotary
from models.layers import Mlp, Normalize, Rotary2D
from models.metadata import base_capacity, block_order_positions, padded_cumsum, segment_lengths
from models.protocol import Capacity, CapacityError, Geometry, Grid


class RowConv2d(nn.Conv2d):
    """A Conv2d whose kernel equals its stride, on rows that each hold one kernel window in (channel, row,
    column) order: one matrix product. The patch embedding over pixel rows of one frame's patch (temporal
    patch 1), or a 1x1 convolution over token rows."""

    def __init__(self, dim: int, out: int, kernel: int, bias: bool = True) -> None:
        super().__init__(dim, out, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), self.bias)


@dataclass(frozen=True)
class BlockNames:
    """What a checkpoint calls the parts of a pre-norm block."""

    norm1: str = "layer_norm1"
    norm2: str = "layer_norm2"
    attn: str = "self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    out: str = "out_proj"
    mlp: str = "mlp"
    fc1: str = "fc1"
    fc2: str = "fc2"


SIGLIP_NAMES = BlockNames()


class NamedAttention(nn.Module):
    """Multi-head attention over packed segments with separate q, k, v and output projections (all with
    biases), named as `names` says; 2D rotary positions where the caller gives cos and sin."""

    def __init__(self, dim: int, heads: int, backend: str, names: BlockNames) -> None:
        super().__init__()
        self.heads, self.names, self.backend = heads, names, backend
        for name in (names.q, names.k, names.v, names.out):
            setattr(self, name, nn.Linear(dim, dim))
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse(self) -> None:
        """One weight and bias holding q, k and v; the checkpoint's parameters become views into them."""
        parts = [getattr(self, n) for n in (self.names.q, self.names.k, self.names.v)]
        weight = torch.cat([p.weight.data for p in parts])
        bias = torch.cat([p.bias.data for p in parts])
        rows = parts[0].weight.shape[0]
        for i, p in enumerate(parts):
            p.weight.data, p.bias.data = weight[i * rows:(i + 1) * rows], bias[i * rows:(i + 1) * rows]
        self.fused = (weight, bias)

    def projections(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:  # not loaded yet (shape checks, reference comparisons)
            return torch.cat([getattr(self, n)(x) for n in (self.names.q, self.names.k, self.names.v)], dim=-1)
        return F.linear(x, *self.fused)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        n, heads = x.shape[0], self.heads
        rows = self.projections(x).view(n, 3 * heads, -1)
        q, k, v = rows[:, :heads], rows[:, heads:2 * heads], rows[:, 2 * heads:]
        if cos is not None and sin is not None:
            qk = apply_rotary(rows[:, :2 * heads].unsqueeze(1), cos, sin)[:, 0]
            q, k = qk[:, :heads], qk[:, heads:]
        out = packed_attention(self.backend, q, k, v, cu_seqlens, max_seqlen)
        return getattr(self, self.names.out)(out.reshape(n, -1))


class NamedBlock(nn.Module):
    """Pre-norm block (LayerNorm, attention, LayerNorm, fc2(act(fc1))) under the checkpoint's names. As
    models.layers.Block, it takes its input already normalised and returns the MLP output unadded."""

    def __init__(self, dims: Dims, act: str, eps: float, backend: str, names: BlockNames) -> None:
        super().__init__()
        self.names = names
        setattr(self, names.norm1, nn.LayerNorm(dims.hidden, eps=eps))
        setattr(self, names.norm2, nn.LayerNorm(dims.hidden, eps=eps))
        setattr(self, names.attn, NamedAttention(dims.hidden, dims.heads, backend, names))
        setattr(self, names.mlp, Mlp(dims.hidden, dims.mlp, act, (names.fc1, names.fc2)))

    @property
    def norm1(self) -> nn.Module:
        return getattr(self, self.names.norm1)

    def forward(self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        attn = getattr(self, self.names.attn)(normed, cos, sin, cu_seqlens, max_seqlen)
        x, normed = add_norm(x, attn, getattr(self, self.names.norm2))
        return x, getattr(self, self.names.mlp)(normed)


class ViTTower(nn.Module):
    """What every SigLIP-named tower shares: the protocol's attributes (models/protocol.py), the CPU half's
    capacity and attention segments, the device-side normalisation of each modality and the block stack. A
    family's subclass builds its embedding, `blocks` and merger, and its `forward`."""

    layout = None  # no window attention
    num_deepstack = 0
    deepstack_layers: list[int] = []

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str,
                 merge: int) -> None:
        super().__init__()
        self.spec, self.family, self.name = family, family.model_type, family.model_type
        self.config, self.processor, self.backend = vision_config, processor, backend
        self.dims = family.dims(vision_config)
        self.hidden, self.heads = self.dims.hidden, self.dims.heads
        self.merge = merge
        self.geometry = self.make_geometry()
        self.windows = None
        self.full_attention = frozenset(range(self.dims.depth))
        self.normalize = self._normalizer(processor.image_mean, processor.image_std)
        video = processor.video
        if video.image_mean is not None or video.image_std is not None:  # a video processor of other statistics
            self.video_normalize = self._normalizer(video.image_mean or processor.image_mean,
                                                    video.image_std or processor.image_std)

    def _normalizer(self, mean: Sequence[float], std: Sequence[float]) -> Normalize:
        cfg = self.processor
        per_channel = cfg.temporal_patch_size * cfg.patch_size**2
        return Normalize(torch.from_numpy(np.repeat(np.asarray(mean, np.float32), per_channel)),
                         torch.from_numpy(np.repeat(np.asarray(std, np.float32), per_channel)), cfg.rescale_factor)

    def make_geometry(self) -> Geometry:
        return Geometry(self.merge)

    def check_processor(self, patch_size: int, temporal_patch_size: int = 1) -> None:
        p = self.processor
        if (p.patch_size, p.temporal_patch_size) != (patch_size, temporal_patch_size):
            raise ValueError(f"preprocessor (patch {p.patch_size}, temporal {p.temporal_patch_size}) disagrees with "
                             f"the vision config ({patch_size}, {temporal_patch_size})")

    # ---- what the protocol names ------------------------------------------------------------
    @property
    def merge_unit(self) -> int:
        return self.merge * self.merge

    @property
    def out_hidden_size(self) -> int:
        return self.dims.out

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def blocks(self) -> list[NamedBlock]:
        """The block stack, wherever the checkpoint keeps it."""
        raise NotImplementedError

    def reset_buffers(self) -> None:
        """Derived state after the weights are in place: normalisation and rotary buffers, fused projections."""
        for module in self.modules():
            if isinstance(module, (Normalize, Rotary2D)):
                module.reset()
            elif module is not self and callable(getattr(module, "fuse", None)):  # q/k/v, merging convolutions
                module.fuse()

    def set_attention(self, backend: str) -> None:
        self.backend = backend
        for module in self.modules():
            if isinstance(module, NamedAttention):
                module.backend = backend

    def normalized(self, pixels: torch.Tensor, cap: Capacity) -> torch.Tensor:
        norm = self.video_normalize if cap.modality == "video" and hasattr(self, "video_normalize") else self.normalize
        return norm(pixels)

    # ---- CPU half -------------------------------------------------------------------------
    def required_capacity(self, grids: Sequence[Grid], modality: str = "image") -> Capacity:
        return base_capacity(grids, self.geometry, modality)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        need = self.required_capacity(grids, cap.modality)
        if not cap.fits(need):
            raise CapacityError(f"batch needs {need}, more than the capacity {cap}")
        return {"cu_seqlens": padded_cumsum(segment_lengths(grids, self.geometry), cap.segments)}

    # ---- device half ----------------------------------------------------------------------
    def run_blocks(self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity,
                   delta: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                   sin: torch.Tensor | None = None) -> torch.Tensor:
        """The block stack on x (+ delta), each residual add fused with the norm after it."""
        blocks = self.blocks
        x, normed = add_norm(x, delta, blocks[0].norm1)
        for i, blk in enumerate(blocks):
            x, mlp_out = blk(x, normed, cos, sin, meta["cu_seqlens"], cap.max_seqlen)
            if i + 1 < len(blocks):
                x, normed = add_norm(x, mlp_out, blocks[i + 1].norm1)
            else:
                x = x + mlp_out
        return x


def raster_to_blocks(h: int, w: int, merge: int) -> np.ndarray:
    """Raster indices of one frame's patches taken in merge-block order: gathering a raster-ordered frame
    (HunyuanOCR's and Hy4's processors) by them makes each merge block's patches contiguous."""
    pos = block_order_positions(h, w, merge)
    return pos[:, 0].astype(np.int64) * w + pos[:, 1]


def block_order_index(grids: Sequence[Grid], merge: int, patches: int) -> np.ndarray:
    """[patches] int64 gather index putting every frame of a batch in merge-block order; padding rows stay."""
    out = np.arange(patches, dtype=np.int64)
    offset = 0
    for t, h, w in grids:
        frame = raster_to_blocks(h, w, merge)
        out[offset:offset + t * h * w] = (offset + np.arange(t)[:, None] * (h * w) + frame[None]).reshape(-1)
        offset += t * h * w
    return out
