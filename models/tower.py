"""The Qwen-style vision tower, assembled from the shared layers as a `Family` describes it.

patch embedding (Conv3d as one GEMM) -> [learned positions, resampled] -> [window reorder] ->
pre-norm blocks (2D rotary attention over whole frames or windows, plain or gated MLP) -> merger,
plus DeepStack mergers tapping intermediate blocks -> [window order undone].

The CPU half (`required_capacity`, `layout`, `build_metadata`) works from `grid_thw` alone;
the device half (`forward`) runs at a fixed `Capacity` and never syncs (models/protocol.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from models.attention import SHORT_SEQLEN
from models.config import ProcessorConfig
from models.family import Dims, Family
from models.forward_scope import one_forward
from models.kernels import Taps, add_norm
from models.layers import (
    Attention,
    Block,
    GatedMlp,
    Merger,
    Mlp,
    Normalize,
    PatchEmbed,
    Rotary2D,
    make_norm,
    position_table,
)
from models.metadata import base_capacity, padded_cumsum, rotary_positions, segment_lengths
from models.positions import bilinear_metadata, resampled
from models.protocol import Capacity, CapacityError, Geometry, Grid, TowerOutput
from models.quantization import fp8_input_width
from models.windows import Windows


def rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


class TowerBase(nn.Module):
    """What every tower answers the same way from its `merge`, `dims`, `hidden` and `heads` (models/protocol.py)."""

    merge: int
    dims: Dims
    hidden: int
    heads: int

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with one_forward():
            return super().__call__(*args, **kwargs)

    def block_stack(self) -> Sequence[nn.Module]:
        """The transformer blocks, input side first (models/quantization.py can keep the first ones in bf16)."""
        return self.blocks

    def fuse_parts(self) -> None:
        """After the weights are in place: every part that keeps a fused or reordered copy of its weights
        (q/k/v, gate/up, patch embeddings, merging convolutions) makes it."""
        for module in self.modules():
            if module is not self and callable(getattr(module, "fuse", None)):
                module.fuse()


class QwenTower(TowerBase):
    """One tower of `family` built from its vision config. Parameter names follow the checkpoints
    (after the family's vision prefix), so a state dict loads as is."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        super().__init__()
        self.spec = family
        self.family = family.model_type
        self.name = family.model_type  # the loader names it after its preset or folder
        self.config = vision_config
        self.processor = processor
        self.backend = backend
        dims = self.dims = family.dims(vision_config)
        self.hidden, self.heads = dims.hidden, dims.heads
        self.merge = vision_config.spatial_merge_size
        self.geometry = self.make_geometry()
        cin, tps, ps = vision_config.in_channels, vision_config.temporal_patch_size, vision_config.patch_size
        if (ps, tps, self.merge) != (processor.patch_size, processor.temporal_patch_size, processor.merge_size):
            raise ValueError(
                f"preprocessor (patch {processor.patch_size}, temporal {processor.temporal_patch_size}, merge "
                f"{processor.merge_size}) disagrees with the vision config ({ps}, {tps}, {self.merge})"
            )
        mean, std = processor.channel_vectors()
        self.normalize = Normalize(torch.from_numpy(mean), torch.from_numpy(std), processor.rescale_factor)
        self.patch_embed = PatchEmbed((cin, tps, ps, ps), dims.hidden, bias=family.patch_bias)
        self.rotary = Rotary2D(dims.hidden // dims.heads, rope_theta(vision_config))
        if family.learned_positions:
            self.pos_embed = position_table(vision_config.num_position_embeddings, dims.hidden)
            self.side = int(vision_config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(self.make_block(dims) for _ in range(dims.depth))
        self.merger = Merger(dims.hidden, dims.out, self.merge_unit, family.norm, family.merger)
        self.deepstack_layers: list[int] = list(vision_config.deepstack_visual_indexes) if family.deepstack else []
        if family.deepstack:
            setattr(self, family.deepstack, nn.ModuleList(
                Merger(dims.hidden, dims.out, self.merge_unit, family.norm, family.merger, postshuffle=True)
                for _ in self.deepstack_layers))
        self.num_deepstack = len(self.deepstack_layers)
        self.windows: Windows | None = None  # also the tower's `layout` (models/protocol.py)
        self.full_attention: frozenset[int] = frozenset(range(dims.depth))
        if family.windows:
            # Window edge in merged tokens (112 px / 14 px / 2 = 4 for the released configs).
            self.windows = Windows(vision_config.window_size // self.merge // ps, self.merge)
            self.full_attention = frozenset(vision_config.fullatt_block_indexes)

    def make_geometry(self) -> Geometry:
        """The item rules of this tower (models/protocol.py); a family with other rules overrides it."""
        return Geometry(self.merge)

    def make_block(self, dims: Dims) -> Block:
        f, cfg = self.spec, self.config
        if f.mlp == "gated":
            mlp: nn.Module = GatedMlp(dims.hidden, dims.mlp, cfg.hidden_act, f.mlp_bias)
        else:
            mlp = Mlp(dims.hidden, dims.mlp, cfg.hidden_act, f.mlp_names)
        attn = Attention(dims.hidden, dims.heads, self.backend, dims.kv_heads, f.separate_qkv, f.qkv_bias,
                         f.proj_bias, f.qk_norm, f.norm_eps)
        return Block(make_norm(f.norm, dims.hidden, f.norm_eps), make_norm(f.norm, dims.hidden, f.norm_eps), attn, mlp)

    # ---- what the protocol names beyond TowerBase --------------------------------------------
    @property
    def deepstack_mergers(self) -> list[nn.Module]:
        return list(getattr(self, self.spec.deepstack)) if self.spec.deepstack else []

    def reset_buffers(self) -> None:
        """Recompute derived (non-checkpoint) state after the weights are in place: buffers left empty
        by building on the meta device, and the fused projections."""
        self.normalize.reset()
        self.rotary.reset()
        self.fuse_parts()

    def set_attention(self, backend: str) -> None:
        """Serve every attention layer with `backend` (see models/attention.py)."""
        self.backend = backend
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    @property
    def layout(self) -> Windows | None:
        return self.windows

    # ---- CPU half -------------------------------------------------------------------------

    def required_capacity(self, grids: Sequence[Grid], modality: str = "image") -> Capacity:
        base = base_capacity(grids, self.geometry, modality)
        return self.windows.required(base, grids) if self.windows else base

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        need = self.required_capacity(grids, cap.modality)
        if not cap.fits(need):
            raise CapacityError(f"batch needs {need}, more than the capacity {cap}")
        meta = {
            "cu_seqlens": padded_cumsum(segment_lengths(grids, self.geometry), cap.segments),
            "pos_ids": rotary_positions(grids, self.merge, cap.patches),
        }
        if self.spec.learned_positions:
            meta.update(bilinear_metadata(grids, cap, self.merge, self.side))
        if self.windows:
            meta.update(self.windows.metadata(grids, cap, meta["pos_ids"]))
        return meta

    # ---- device half ----------------------------------------------------------------------
    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.patch_embed(self.normalize(pixels))
        delta = resampled(self.pos_embed.weight, meta) if self.spec.learned_positions else None
        if self.windows:
            n, unit = x.shape[0], self.merge_unit
            x = x.view(n // unit, unit, -1)[meta["window_index"]].view(n, -1)
        x, tapped = self.run_blocks(x, meta, cap, taps=self.deepstack_layers, delta=delta)
        embeds = self.merger(x)
        deepstack = [merger(h) for merger, h in zip(self.deepstack_mergers, tapped)]
        if self.windows:
            embeds, deepstack = embeds[meta["reverse_index"]], [d[meta["reverse_index"]] for d in deepstack]
        return TowerOutput(embeds, deepstack)

    def layer_segments(self, layer: int, meta: dict[str, torch.Tensor], cap: Capacity
                       ) -> tuple[torch.Tensor, int, bool]:
        """The attention segments of one layer (cu_seqlens, longest-segment bound, whether every segment is
        short by construction: see models.attention.kernel_for): whole frames or windows."""
        if layer in self.full_attention:
            return meta["cu_seqlens"], cap.max_seqlen, False
        assert self.windows is not None
        return meta["cu_window_seqlens"], cap.max_window_seqlen, self.windows.patches <= SHORT_SEQLEN

    def run_blocks(
        self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity, taps=(),
        delta: torch.Tensor | Taps | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The block stack on x (+ delta); returns x and the hidden states after the `taps` layers.

        Each residual add runs fused with the norm after it, so the stream is carried as
        (x, norm(x)) from one block to the next.
        """
        # A tower without rotary positions builds no `pos_ids` (its attention takes cos = sin = None).
        cos, sin = self.rotary(meta["pos_ids"]) if "pos_ids" in meta else (None, None)
        tapped: dict[int, torch.Tensor] = {}
        blocks = list(self.blocks)
        x, normed = add_norm(x, delta, blocks[0].norm1, fp8_input_width(blocks[0].attn))
        for i, blk in enumerate(blocks):
            x, mlp_out = blk(x, normed, cos, sin, *self.layer_segments(i, meta, cap))
            if i + 1 < len(blocks):
                x, normed = add_norm(x, mlp_out, blocks[i + 1].norm1, fp8_input_width(blocks[i + 1].attn))
            else:
                x = x + mlp_out
            if i in taps:
                tapped[i] = x
        return x, [tapped[i] for i in taps]
