"""What the three Qwen-VL towers share: input normalisation, patch embedding, rotary positions,
the block stack and the protocol methods. Each family module adds its own metadata and forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ProcessorConfig
from models.kernels import add_norm
from models.layers import Attention, Normalize, PatchEmbed, Rotary2D
from models.metadata import base_capacity, padded_cumsum, rotary_positions, segment_lengths
from models.protocol import Capacity, CapacityError, Grid, TowerOutput


def rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


class QwenTower(nn.Module):
    """Base class: subclasses build `self.blocks`, the merger(s) and `_encode`."""

    family: str = ""
    num_deepstack: int = 0

    def __init__(self, vision_config: Any, processor: ProcessorConfig, backend: str, hidden: int) -> None:
        super().__init__()
        self.config = vision_config
        self.processor = processor
        self.backend = backend
        self.hidden = hidden
        self.heads = vision_config.num_heads
        self.merge = vision_config.spatial_merge_size
        cin, tps, ps = vision_config.in_channels, vision_config.temporal_patch_size, vision_config.patch_size
        if (ps, tps, self.merge) != (processor.patch_size, processor.temporal_patch_size, processor.merge_size):
            raise ValueError(
                f"preprocessor (patch {processor.patch_size}, temporal {processor.temporal_patch_size}, merge "
                f"{processor.merge_size}) disagrees with the vision config ({ps}, {tps}, {self.merge})"
            )
        mean, std = processor.channel_vectors()
        self.normalize = Normalize(torch.from_numpy(mean), torch.from_numpy(std), processor.rescale_factor)
        self.patch_embed = PatchEmbed((cin, tps, ps, ps), hidden, bias=self.family == "qwen3_vl")
        self.rotary = Rotary2D(hidden // self.heads, rope_theta(vision_config))

    def reset_buffers(self) -> None:
        """Recompute the derived (non-checkpoint) buffers, e.g. after building on the meta device."""
        self.normalize.reset()
        self.rotary.reset()

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def set_attention(self, backend: str) -> None:
        """Serve every attention layer with `backend` (see models/attention.py)."""
        self.backend = backend
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    @property
    def merge_unit(self) -> int:
        return self.merge * self.merge

    @property
    def out_hidden_size(self) -> int:
        raise NotImplementedError

    # ---- CPU half -------------------------------------------------------------------------
    def required_capacity(self, grids: Sequence[Grid]) -> Capacity:
        return base_capacity(grids)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        need = self.required_capacity(grids)
        if not cap.fits(need):
            raise CapacityError(f"batch needs {need}, more than the capacity {cap}")
        return {
            "cu_seqlens": padded_cumsum(segment_lengths(grids), cap.segments),
            "pos_ids": rotary_positions(grids, self.merge, cap.patches),
        }

    # ---- device half ----------------------------------------------------------------------
    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.patch_embed(self.normalize(pixels))
        return self._encode(x, meta, cap)

    def _encode(self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        raise NotImplementedError

    def layer_segments(self, layer: int, meta: dict[str, torch.Tensor], cap: Capacity) -> tuple[torch.Tensor, int]:
        """The attention segments of one layer (cu_seqlens, longest-segment bound): whole frames here."""
        return meta["cu_seqlens"], cap.max_seqlen

    def run_blocks(
        self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity, taps=(), delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The block stack on x (+ delta); returns x and the hidden states after the `taps` layers.

        Each residual add runs fused with the norm after it, so the stream is carried as
        (x, norm(x)) from one block to the next.
        """
        cos, sin = self.rotary(meta["pos_ids"])
        tapped: dict[int, torch.Tensor] = {}
        blocks = list(self.blocks)
        x, normed = add_norm(x, delta, blocks[0].norm1)
        for i, blk in enumerate(blocks):
            x, mlp_out = blk(x, normed, cos, sin, *self.layer_segments(i, meta, cap))
            if i + 1 < len(blocks):
                x, normed = add_norm(x, mlp_out, blocks[i + 1].norm1)
            else:
                x = x + mlp_out
            if i in taps:
                tapped[i] = x
        return x, [tapped[i] for i in taps]
