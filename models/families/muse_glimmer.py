"""Muse-Glimmer (`muse_glimmer`) and Muse-Spark-Open (`muse_spark`): one vision tower.

A Linear patch embedding over two frames (no bias; the reference lays a row out (temporal, channel, ...),
models/kimi_block.py permutes it once), a learned 32x32 position table resampled bilinearly with zero
padding and read as a (w, h) grid (models/raster.py), a LayerNorm, Kimi blocks whose axial rotary takes
(column + 1, row + 1), attention within windows of 32x32 patches (the table's side) except every 4th block
and the last, which attend over whole frames, a LayerNorm, a pixel-shuffle of each 2x2 block
(models/token_merge.py), then the adapter (Linear, GELU, Linear, GELU, no biases), the projection to the
text width and an RMSNorm without a scale. Images and videos as in Qwen2.5-VL: one segment per temporal
patch of two frames, h*w/4 tokens each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from models.attention import SHORT_SEQLEN
from models.config import ProcessorConfig
from models.families.kimi_k25 import reference_features
from models.family import Dims, Family, register
from models.kernels import ACTIVATIONS
from models.kimi_block import kimi_block
from models.layers import Attention, Normalize, Rotary2D, check_activation, position_table
from models.metadata import base_capacity, padded_cumsum, segment_lengths
from models.patches import LinearPatches
from models.positions import resample, tap_metadata
from models.protocol import Capacity, CapacityError, Geometry, Grid, TowerOutput
from models.raster import raster_rotary_positions, raster_taps
from models.token_merge import pixel_shuffle
from models.tower import TowerBase, rope_theta
from models.windows import Windows

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


def muse_dims(config: Any) -> Dims:
    """From the whole model's config: the tokens are as wide as the text model."""
    cfg = config.vision_config
    return Dims(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_attention_heads,
                mlp=cfg.intermediate_size, depth=cfg.num_hidden_layers, out=config.text_config.hidden_size)


class MuseTower(TowerBase):
    """The Muse vision tower with its adapter and projection. Parameter names are the checkpoint's after the
    prefix `model.vision_` (`tower.*`, `adapter.*`, `projection.*`)."""

    def __init__(self, family: Family, config: Any, processor: ProcessorConfig, backend: str) -> None:
        """`config`: the whole model's (the adapter's sizes are outside the vision config)."""
        super().__init__()
        cfg = config.vision_config
        self.spec, self.family, self.name, self.config, self.backend = family, family.model_type, family.model_type, \
            cfg, backend
        self.merge = cfg.merge_size
        if cfg.pos_emb_height != cfg.pos_emb_width or cfg.pos_emb_height % self.merge:
            raise ValueError(f"square position tables a multiple of the merge size only, got "
                             f"{cfg.pos_emb_height}x{cfg.pos_emb_width}")
        if (processor.patch_size, processor.temporal_patch_size, processor.merge_size) != (
                cfg.patch_size, cfg.patch_temporal, self.merge):
            raise ValueError(f"preprocessor (patch {processor.patch_size}, temporal {processor.temporal_patch_size}, "
                             f"merge {processor.merge_size}) disagrees with the vision config ({cfg.patch_size}, "
                             f"{cfg.patch_temporal}, {self.merge})")
        self.processor = processor
        self.geometry = Geometry(self.merge)
        dims = self.dims = muse_dims(config)
        self.hidden, self.heads, self.side = dims.hidden, dims.heads, cfg.pos_emb_height
        mean, std = processor.channel_vectors()
        self.normalize = Normalize(torch.from_numpy(mean), torch.from_numpy(std), processor.rescale_factor)
        self.tower = nn.Module()
        tower = self.tower
        tower.patch_embedder = nn.Module()
        # the checkpoint's Linear reads (temporal, channel, pixels); a reordered copy serves the rows
        tower.patch_embedder.patch_embedding = LinearPatches(3, cfg.patch_temporal, cfg.patch_size, dims.hidden, "tchw",
                                                             processor.patch_layout, bias=False)
        tower.patch_embedder.position_embedding_table = position_table(self.side * self.side, dims.hidden)
        tower.ln_pre = nn.LayerNorm(dims.hidden, eps=cfg.layer_norm_eps)
        tower.layers = nn.ModuleList(kimi_block(dims.hidden, dims.heads, dims.mlp, cfg.hidden_act, backend)
                                     for _ in range(dims.depth))
        tower.ln_post = nn.LayerNorm(dims.hidden, eps=cfg.layer_norm_eps)
        self.rotary = Rotary2D(dims.hidden // dims.heads, rope_theta(cfg))
        # Windows of the position table's side in patches, in merge blocks (they never cut a block).
        self.windows = Windows(self.side // self.merge, self.merge)
        self.full_attention = frozenset(i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention")
        self.adapter = nn.Module()
        self.adapter.fc1 = nn.Linear(config.out_hidden_size, config.projector_hidden_size, bias=False)
        self.adapter.fc2 = nn.Linear(config.projector_hidden_size, config.projector_hidden_size, bias=False)
        self.adapter_act = check_activation(config.projector_hidden_act)
        self.projection = nn.Linear(config.projector_hidden_size, dims.out, bias=False)
        self.out_eps = config.text_config.rms_norm_eps
        if config.out_hidden_size != dims.hidden * self.merge_unit:
            raise ValueError(f"out_hidden_size {config.out_hidden_size} is not hidden_size x merge_size**2")
        self.num_deepstack = 0

    # ---- what the protocol names beyond models.tower.TowerBase -------------------------------

    @property
    def layout(self) -> Windows:
        return self.windows

    def reset_buffers(self) -> None:
        self.normalize.reset()
        self.rotary.reset()
        self.tower.patch_embedder.patch_embedding.fuse()
        for module in self.modules():
            if isinstance(module, Attention):
                module.fuse()

    def set_attention(self, backend: str) -> None:
        self.backend = backend
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    # ---- CPU half -------------------------------------------------------------------------
    def required_capacity(self, grids: Sequence[Grid], modality: str = "image") -> Capacity:
        return self.windows.required(base_capacity(grids, self.geometry, modality), grids)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        need = self.required_capacity(grids, cap.modality)
        if not cap.fits(need):
            raise CapacityError(f"batch needs {need}, more than the capacity {cap}")
        meta = {"cu_seqlens": padded_cumsum(segment_lengths(grids, self.geometry), cap.segments)}
        meta.update(tap_metadata(grids, cap, 4, lambda h, w: raster_taps(h, w, self.merge, self.side, "bilinear",
                                                                         zero_pad=True, transposed=True)))
        meta.update(self.windows.metadata(grids, cap, raster_rotary_positions(grids, self.merge, cap.patches, 1)))
        return meta

    # ---- device half ----------------------------------------------------------------------
    def block_stack(self) -> nn.ModuleList:
        return self.tower.layers

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        tower, unit = self.tower, self.merge_unit
        x = tower.patch_embedder.patch_embedding(self.normalize(pixels))
        x = x + resample(tower.patch_embedder.position_embedding_table.weight, meta).to(x.dtype)
        x = tower.ln_pre(x)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[meta["window_index"]].view(n, -1)
        cos, sin = self.rotary(meta["pos_ids"])
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # the reference rounds its angles to the stream's dtype
        for i, blk in enumerate(tower.layers):
            if i in self.full_attention:
                segments, bound, short = meta["cu_seqlens"], cap.max_seqlen, False
            else:
                segments, bound, short = meta["cu_window_seqlens"], cap.max_window_seqlen, \
                    self.windows.patches <= SHORT_SEQLEN
            x, mlp_out = blk(x, blk.norm1(x), cos, sin, segments, bound, short)
            x = x + mlp_out
        x = tower.ln_post(x)
        tokens = pixel_shuffle(x, unit)[meta["reverse_index"]]
        act = ACTIVATIONS[self.adapter_act]
        h = act(self.adapter.fc2(act(self.adapter.fc1(tokens))))
        out = self.projection(h).float()
        out = out * torch.pow(out.pow(2).mean(-1, keepdim=True) + self.out_eps, -0.5)
        return TowerOutput(out.to(h.dtype), [])


def muse_processor_config(family: str, image: dict[str, Any], video: dict[str, Any] | None) -> ProcessorConfig:
    """The Muse processors' settings: a cap on merged tokens (`max_image_tokens`, 4096; a video frame's
    `max_video_frame_tokens`, 144), kept as pixels (tokens x (patch x merge)**2); up to `num_frames` (96)
    frames at `fps` (2)."""
    defaults = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "image_mean": IMAGENET_STANDARD,
                "image_std": IMAGENET_STANDARD}
    base = ProcessorConfig.from_dicts(family, {**defaults, **image}, video)
    token_area = base.factor * base.factor
    video = video or {}
    frames = replace(base.video, fps=float(video.get("fps", 2.0)), max_frames=int(video.get("num_frames", 96)),
                     min_frames=base.temporal_patch_size, min_pixels=0,
                     max_pixels=int(video.get("max_video_frame_tokens", 144)) * token_area)
    return replace(base, min_pixels=0, max_pixels=int(image.get("max_image_tokens", 4096)) * token_area, video=frames)


MUSE_GLIMMER = register(Family(
    "muse_glimmer", "Muse-Glimmer", config_path=(), dims=muse_dims,
    prefixes=("model.vision_", "vision_"), image_processor="MuseGlimmerImageProcessor",
    hf_class="MuseGlimmerForConditionalGeneration", image_sizing="muse", video_sampling="muse",
    tower=MuseTower, extra={"processor_config": muse_processor_config, "reference_features": reference_features},
))
