"""SigLIP-style towers over packed grids (PaddleOCR-VL, Cosmos3-Edge, and the towers built like them).

pixel rows -> patch embedding (Conv2d or Linear as one matrix product over rows in the processor's order,
models/patches.py) + a learned position table resampled to each frame (models/positions.py: bilinear at the
patch centres, or antialiased) -> pre-norm LayerNorm blocks (separate q/k/v projections fused after loading,
2D rotary positions or none, a plain MLP) -> post-LayerNorm -> a projector merging each block of patches
(models/mergers.py), after gathering the blocks together when the processor keeps rows row-major.

The checkpoint holds the vision model and its projector under two roots (`model.visual.*`,
`model.projector.*`); the family's prefixes map them to this tower's `visual.*` and `projector.*`, so the
tower's parameter names are the checkpoint's below those roots. What differs between the families is read
from `Family.extra` (see `SiglipTower`). The tower is handed the whole model's config (`config_path` empty):
the projector's widths live outside the vision config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from models.attention import packed_attention
from models.config import ProcessorConfig
from models.family import Dims, Family
from models.kernels import Taps, apply_rotary
from models.layers import Block, Mlp, Normalize, Rotary2D, position_table
from models.mergers import MlpMerger, raster_merge_index
from models.metadata import padded_cumsum, rotary_positions, segment_lengths
from models.patches import Conv2dPatches, LinearPatches
from models.positions import antialias_metadata, half_pixel_metadata, resample_separable, resampled
from models.protocol import Capacity, CapacityError, TowerOutput
from models.quantization import linear, width_of
from models.tower import QwenTower, rope_theta


def siglip_dims(config: Any) -> Dims:
    """SigLIP names in the vision config; the merged tokens are as wide as the language model."""
    v = config.vision_config
    return Dims(hidden=v.hidden_size, heads=v.num_attention_heads, kv_heads=v.num_attention_heads,
                mlp=v.intermediate_size, depth=v.num_hidden_layers, out=config.text_config.hidden_size)


class SiglipAttention(nn.Module):
    """Multi-head attention with separate q, k, v projections (named as the checkpoint does), one GEMM after
    `fuse`, and 2D rotary positions when given cos and sin (None: no rotary)."""

    def __init__(self, dim: int, heads: int, backend: str,
                 names: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "out_proj")) -> None:
        super().__init__()
        self.heads, self.backend, self.names = heads, backend, names
        for name in names:
            setattr(self, name, nn.Linear(dim, dim))
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse(self) -> None:
        """One weight and bias holding q, k and v; the checkpoint's parameters stay views into them."""
        parts = [getattr(self, n) for n in self.names[:3]]
        weight = torch.cat([p.weight.data for p in parts])
        bias = torch.cat([p.bias.data for p in parts])
        rows = parts[0].weight.shape[0]
        for i, p in enumerate(parts):
            p.weight.data, p.bias.data = weight[i * rows : (i + 1) * rows], bias[i * rows : (i + 1) * rows]
        self.fused = (weight, bias)

    def fused_parts(self) -> tuple[nn.Module, ...]:
        return tuple(getattr(self, n) for n in self.names[:3])

    def fp8_input(self) -> int | None:
        return width_of(self.fused[0]) if self.fused is not None else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cu_seqlens: torch.Tensor, max_seqlen: int, short: bool = False) -> torch.Tensor:
        n, heads = x.shape[0], self.heads
        if self.fused is None:  # not loaded yet (shape checks)
            rows = torch.cat([getattr(self, name)(x) for name in self.names[:3]], dim=-1)
        else:
            rows = linear(x, *self.fused)
        rows = rows.view(n, 3 * heads, -1)
        q, k, v = rows[:, :heads], rows[:, heads : 2 * heads], rows[:, 2 * heads :]
        if cos is not None:
            qk = apply_rotary(rows[:, : 2 * heads].unsqueeze(1), cos, sin)[:, 0]
            q, k = qk[:, :heads], qk[:, heads:]
        out = packed_attention(self.backend, q, k, v, cu_seqlens, max_seqlen, short)
        return getattr(self, self.names[3])(out.reshape(n, -1))


class SiglipBlock(Block):
    """A pre-norm block under SigLIP's names (`layer_norm1`, `self_attn`, `layer_norm2`, `mlp.fc1/fc2`); it runs
    as `Block` does (models/layers.py), its norms read under Block's names."""

    norm1 = property(lambda self: self.layer_norm1)
    norm2 = property(lambda self: self.layer_norm2)
    attn = property(lambda self: self.self_attn)

    def __init__(self, dims: Dims, act: str, eps: float, backend: str) -> None:
        nn.Module.__init__(self)
        self.layer_norm1 = nn.LayerNorm(dims.hidden, eps=eps)
        self.self_attn = SiglipAttention(dims.hidden, dims.heads, backend)
        self.layer_norm2 = nn.LayerNorm(dims.hidden, eps=eps)
        self.mlp = Mlp(dims.hidden, dims.mlp, act)


class SiglipTower(QwenTower):
    """A SigLIP-style tower as its family describes it. `Family.extra` names the parts:

    patch_embedding: "conv2d" (Conv2d, one frame) or "linear" (its inputs in `linear_layout` order);
    position_side(vision_config) -> the side of the square position table;
    positions: "half_pixel" (bilinear, align_corners=False, as transformers' packed helper) or "antialias"
    (F.interpolate's antialiased bilinear); rotary: 2D rotary positions in the attention;
    merger_names / merger_eps / merger_hidden(config): the projector's parameter names, LayerNorm eps and
    first width (None: the merge block's concatenated width).
    """

    def __init__(self, family: Family, config: Any, processor: ProcessorConfig, backend: str) -> None:
        nn.Module.__init__(self)
        x = family.extra
        vision = config.vision_config
        self.spec, self.family, self.name = family, family.model_type, family.model_type
        self.config, self.processor, self.backend = config, processor, backend
        dims = self.dims = family.dims(config)
        self.hidden, self.heads = dims.hidden, dims.heads
        self.merge = vision.spatial_merge_size
        self.geometry = self.make_geometry()
        patch = vision.patch_size
        if (patch, 1, self.merge) != (processor.patch_size, processor.temporal_patch_size, processor.merge_size):
            raise ValueError(
                f"preprocessor (patch {processor.patch_size}, temporal {processor.temporal_patch_size}, merge "
                f"{processor.merge_size}) disagrees with the vision config ({patch}, 1, {self.merge})")
        mean, std = processor.channel_vectors()
        self.normalize = Normalize(torch.from_numpy(mean), torch.from_numpy(std), processor.rescale_factor)
        self.visual = nn.Module()
        self.visual.embeddings = nn.Module()
        cin, rows = vision.num_channels, processor.patch_layout
        if x["patch_embedding"] == "conv2d":
            embed: nn.Module = Conv2dPatches(cin, dims.hidden, patch, rows)
        else:
            embed = LinearPatches(cin, 1, patch, dims.hidden, x["linear_layout"], rows)
        self.visual.embeddings.patch_embedding = embed
        self.side = x["position_side"](vision)
        self.visual.embeddings.position_embedding = position_table(self.side * self.side, dims.hidden)
        self.visual.encoder = nn.Module()
        eps = vision.layer_norm_eps
        self.visual.encoder.layers = nn.ModuleList(
            SiglipBlock(dims, vision.hidden_act, eps, backend) for _ in range(dims.depth))
        self.visual.post_layernorm = nn.LayerNorm(dims.hidden, eps=eps)
        hidden = x["merger_hidden"](config) if x.get("merger_hidden") else None
        self.projector = MlpMerger(dims.hidden, self.merge_unit, dims.out, x["merger_names"], hidden,
                                   eps=x["merger_eps"])
        self.rotary = Rotary2D(dims.hidden // dims.heads, rope_theta(vision)) if x["rotary"] else None
        # What QwenTower's block loop and the protocol read.
        self.blocks = list(self.visual.encoder.layers)  # a plain list: the layers are registered once, above
        self.deepstack_layers: list[int] = []
        self.num_deepstack = 0
        self.windows = None
        self.full_attention = frozenset(range(dims.depth))
        self.merger_products = self.projector.products

    @property
    def raster(self) -> bool:
        """Rows arrive row-major: positions follow that order and blocks are gathered before merging."""
        return self.processor.patch_order == "raster"

    def reset_buffers(self) -> None:
        self.normalize.reset()
        if self.rotary is not None:
            self.rotary.reset()
        self.visual.embeddings.patch_embedding.fuse()
        for module in self.modules():
            if isinstance(module, SiglipAttention):
                module.fuse()

    def set_attention(self, backend: str) -> None:
        self.backend = backend
        for module in self.modules():
            if isinstance(module, SiglipAttention):
                module.backend = backend

    # ---- CPU half -------------------------------------------------------------------------
    def build_metadata(self, grids: Sequence[tuple[int, int, int]], cap: Capacity) -> dict[str, np.ndarray]:
        need = self.required_capacity(grids, cap.modality)
        if not cap.fits(need):
            raise CapacityError(f"batch needs {need}, more than the capacity {cap}")
        order = 1 if self.raster else self.merge  # the rows' own order: merge 1 is row-major
        meta = {"cu_seqlens": padded_cumsum(segment_lengths(grids, self.geometry), cap.segments)}
        if self.rotary is not None:
            meta["pos_ids"] = rotary_positions(grids, order, cap.patches)
        if self.spec.extra["positions"] == "antialias":
            meta.update(antialias_metadata(grids, cap, order, self.side))
        else:
            meta.update(half_pixel_metadata(grids, cap, order, self.side))
        if self.raster:
            meta["merge_index"] = raster_merge_index(grids, self.merge, cap.patches)
        return meta

    # ---- device half ----------------------------------------------------------------------
    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        embeddings = self.visual.embeddings
        x = embeddings.patch_embedding(self.normalize(pixels))
        table = embeddings.position_embedding.weight
        if "pos_rows" in meta:
            delta: torch.Tensor | Taps = resample_separable(table, meta).to(table.dtype).to(x.dtype)
        else:
            delta = resampled(table, meta)
        x, _ = self.run_blocks(x, meta, cap, delta=delta)
        x = self.visual.post_layernorm(x)
        return TowerOutput(self.projector(x, meta.get("merge_index")), [])
