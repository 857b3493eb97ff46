"""Towers whose checkpoints name their parts the SigLIP way (`layers.N.self_attn.q_proj`, `layer_norm1`, ...)
rather than Qwen-VL's (`blocks.N.attn.qkv`, `norm1`): the shared parts and the protocol plumbing.

A family's tower subclasses `ViTTower`, names its blocks with a `BlockNames` and adds its own embedding and
merger; the CPU half (capacity, cu_seqlens) and the block stack (pre-norm, residual adds fused with the next
norm, attention over packed segments, optional 2D rotary) are here once. Parameter names follow the
checkpoint (after the family's prefix), so a state dict loads as is. The blocks are the shared ones:
models.layers.Block under the checkpoint's names (models/blocks.py), with SigLIP's attention
(models/siglip.py: q, k and v fused into one matrix product after loading, the checkpoint's parameters kept as
views into it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from models.blocks import NamedBlock
from models.config import ProcessorConfig
from models.family import Dims, Family
from models.kernels import Taps, add_norm
from models.layers import Mlp, Normalize, Rotary2D
from models.metadata import base_capacity, padded_cumsum, segment_lengths
from models.protocol import Capacity, CapacityError, Geometry, Grid
from models.quantization import fp8_input_width
from models.siglip import SiglipAttention
from models.tower import TowerBase


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



def named_block(dims: Dims, act: str, eps: float, backend: str, names: BlockNames) -> NamedBlock:
    """A pre-norm block (LayerNorm, attention with separate q/k/v/out projections, LayerNorm, fc2(act(fc1)))
    under the checkpoint's names: models.layers.Block run as it is, its parts renamed (models/blocks.py)."""
    attn = SiglipAttention(dims.hidden, dims.heads, backend, (names.q, names.k, names.v, names.out))
    block = NamedBlock(nn.LayerNorm(dims.hidden, eps=eps), nn.LayerNorm(dims.hidden, eps=eps), attn,
                       Mlp(dims.hidden, dims.mlp, act, (names.fc1, names.fc2)))
    return block.use_names({"norm1": names.norm1, "norm2": names.norm2, "attn": names.attn, "mlp": names.mlp})


class ViTTower(TowerBase):
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
        """The processor's statistics `mean` and `std`, spread along a row in its layout."""
        cfg = replace(self.processor, image_mean=tuple(mean), image_std=tuple(std))
        row_mean, row_std = cfg.channel_vectors()
        return Normalize(torch.from_numpy(row_mean), torch.from_numpy(row_std), cfg.rescale_factor)

    def make_geometry(self) -> Geometry:
        return Geometry(self.merge)

    def check_processor(self, patch_size: int, temporal_patch_size: int = 1) -> None:
        p = self.processor
        if (p.patch_size, p.temporal_patch_size) != (patch_size, temporal_patch_size):
            raise ValueError(f"preprocessor (patch {p.patch_size}, temporal {p.temporal_patch_size}) disagrees with "
                             f"the vision config ({patch_size}, {temporal_patch_size})")

    # ---- what the protocol names beyond models.tower.TowerBase -------------------------------

    @property
    def blocks(self) -> list[nn.Module]:
        """The block stack, wherever the checkpoint keeps it."""
        raise NotImplementedError

    def reset_buffers(self) -> None:
        """Derived state after the weights are in place: normalisation and rotary buffers, fused projections."""
        for module in self.modules():
            if isinstance(module, (Normalize, Rotary2D)):
                module.reset()
        self.fuse_parts()

    def set_attention(self, backend: str) -> None:
        self.backend = backend
        for module in self.modules():
            if isinstance(module, SiglipAttention):
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
                   delta: torch.Tensor | Taps | None = None, cos: torch.Tensor | None = None,
                   sin: torch.Tensor | None = None) -> torch.Tensor:
        """The block stack on x (+ delta), each residual add fused with the norm after it."""
        blocks = self.blocks
        x, normed = add_norm(x, delta, blocks[0].norm1, fp8_input_width(blocks[0].attn))
        for i, blk in enumerate(blocks):
            x, mlp_out = blk(x, normed, cos, sin, meta["cu_seqlens"], cap.max_seqlen)
            if i + 1 < len(blocks):
                x, normed = add_norm(x, mlp_out, blocks[i + 1].norm1, fp8_input_width(blocks[i + 1].attn))
            else:
                x = x + mlp_out
        return x
