"""Kimi-K2.5 / K2.6 (`kimi_k25`): Moonshot's MoonViT tower.

A Conv2d patch embedding (one frame a patch), a learned 64x64 position table resampled bicubically to each
frame (align_corners=False, models/raster.py) plus a sinusoidal term per frame of a clip (none for a single
frame), Kimi blocks (models/kimi_block.py) with an axial rotary whose column and row angles interleave, a
final LayerNorm, then a mean over the frames of a clip (models/token_merge.py) and the projector: a
LayerNorm per patch, the 2x2 block concatenated, Linear, GELU, Linear.

Attention spans a whole clip. A video is cut into chunks of `pos_emb_time` (4) frames, each one clip: one
attention segment and one frame's worth of tokens (h*w/4), so a video of F frames gives ceil(F/4) * h*w/4
tokens, as transformers' processor counts its placeholders. vitserve serves a video as one item whose
grid is (F, h, w); transformers' processor gives the same video as ceil(F/4) grids (n, h, w), n <= 4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ProcessorConfig
from models.family import Dims, Family, register
from models.kimi_block import KIMI_NORM_EPS, PairwiseRotaryBlock
from models.layers import Attention, Normalize
from models.metadata import base_capacity, block_order_positions, padded_cumsum, segment_lengths
from models.patches import Conv2dPatches, PatchProjection
from models.positions import resample_float32, tap_metadata
from models.protocol import Capacity, CapacityError, Geometry, Grid, TowerOutput
from models.raster import InterleavedRotary2D, raster_rotary_positions, raster_taps
from models.token_merge import temporal_mean, temporal_mean_metadata
from models.tower import TowerBase, rope_theta

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ChunkedClipGeometry(Geometry):
    """Attention over chunks of `chunk` frames of an item (the last may be shorter), each chunk pooled over
    its frames into one frame's worth of tokens."""

    chunk: int = 4
    whole_clip: bool = True

    def segment_lengths(self, grid: Grid) -> list[int]:
        t, h, w = grid
        return [min(self.chunk, t - s) * h * w for s in range(0, t, self.chunk)]

    def tokens(self, grid: Grid, modality: str = "image") -> int:
        t, h, w = grid
        return math.ceil(t / self.chunk) * h * w // self.merge_unit

    def describe(self) -> str:
        return f"ceil(t/{self.chunk})*h*w/{self.merge_unit}"


def kimi_dims(config: Any) -> Dims:
    """From the whole model's config: the tokens are as wide as the text model."""
    cfg = config.vision_config
    return Dims(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_attention_heads,
                mlp=cfg.intermediate_size, depth=cfg.num_hidden_layers, out=config.text_config.hidden_size)


def sinusoid_table(frames: int, dim: int) -> torch.Tensor:
    """[frames + 1, dim] float32: a zero row (single frames get no time term), then sin | cos of each frame. On
    the CPU whatever the default device (on the meta device torch runs these as Python references, whose first
    call imports torch._dynamo)."""
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).float() / dim))
    freqs = torch.outer(torch.arange(frames, dtype=torch.float32, device=cpu), inv_freq)
    return torch.cat([torch.zeros(1, dim, device=cpu), torch.cat([freqs.sin(), freqs.cos()], dim=1)])


def time_index(grids: Sequence[Grid], patches: int, chunk: int) -> np.ndarray:
    """[patches] int64 row of the sinusoid table per patch: frame f of a chunk of n > 1 frames reads f + 1,
    single-frame chunks (images) read the zero row."""
    out = np.zeros(patches, dtype=np.int64)
    start = 0
    for t, h, w in grids:
        for first in range(0, t, chunk):
            n = min(chunk, t - first)
            if n > 1:
                out[start : start + n * h * w] = np.repeat(np.arange(1, n + 1), h * w)
            start += n * h * w
    return out


class KimiTower(TowerBase):
    """The Kimi-K2.x vision tower and its projector. Parameter names are the checkpoint's (Moonshot's layout,
    which transformers' save_pretrained writes too) after its `vision_tower.` and `mm_projector.` prefixes."""

    def __init__(self, family: Family, config: Any, processor: ProcessorConfig, backend: str) -> None:
        """`config`: the whole model's (the projector's sizes are outside the vision config)."""
        super().__init__()
        cfg = config.vision_config
        self.spec, self.family, self.name, self.config, self.backend = family, family.model_type, family.model_type, \
            cfg, backend
        kernel = tuple(cfg.merge_kernel_size)
        if kernel[0] != kernel[1] or cfg.pos_emb_height != cfg.pos_emb_width:
            raise ValueError(f"square merge kernels and position tables only, got {kernel}, "
                             f"{cfg.pos_emb_height}x{cfg.pos_emb_width}")
        self.merge = kernel[0]
        if (processor.patch_size, processor.temporal_patch_size, processor.merge_size) != (cfg.patch_size, 1,
                                                                                          self.merge):
            raise ValueError(f"preprocessor (patch {processor.patch_size}, temporal {processor.temporal_patch_size}, "
                             f"merge {processor.merge_size}) disagrees with the vision config ({cfg.patch_size}, 1, "
                             f"{self.merge})")
        self.processor = processor
        self.geometry = ChunkedClipGeometry(self.merge, chunk=cfg.pos_emb_time)
        dims = self.dims = kimi_dims(config)
        self.hidden, self.heads, self.side = dims.hidden, dims.heads, cfg.pos_emb_height
        mean, std = processor.channel_vectors()
        self.normalize = Normalize(torch.from_numpy(mean), torch.from_numpy(std), processor.rescale_factor)
        # Moonshot's layout (what save_pretrained writes): the position table beside the encoder, the patch
        # Conv2d, blocks and final norm inside it, the projector's two Linears as `proj.0` / `proj.2`.
        self.patch_embed = nn.Module()
        self.patch_embed.pos_emb = nn.Module()
        self.patch_embed.pos_emb.weight = nn.Parameter(torch.empty(self.side, self.side, dims.hidden))
        self.encoder = nn.Module()
        self.encoder.patch_embed = PatchProjection(Conv2dPatches(3, dims.hidden, cfg.patch_size))
        self.encoder.blocks = nn.ModuleList(PairwiseRotaryBlock(dims.hidden, dims.heads, dims.mlp, cfg.hidden_act,
                                                                backend) for _ in range(dims.depth))
        self.encoder.final_layernorm = nn.LayerNorm(dims.hidden, eps=KIMI_NORM_EPS)
        # Made on the CPU while the tower is built on the meta device; `reset_buffers` makes it on the device.
        self.register_buffer("time_table", sinusoid_table(cfg.pos_emb_time, dims.hidden).to(
            torch.get_default_device()), persistent=False)
        self.rotary = InterleavedRotary2D(dims.hidden // dims.heads, rope_theta(cfg))
        self.pre_norm = nn.LayerNorm(config.projection_hidden_size, eps=config.projection_layer_norm_eps)
        width = dims.hidden * self.merge_unit
        self.proj = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, dims.out))
        self.num_deepstack = 0
        self.layout = None

    # ---- what the protocol names beyond models.tower.TowerBase -------------------------------

    def reset_buffers(self) -> None:
        self.normalize.reset()
        self.rotary.reset()
        self.encoder.patch_embed.proj.fuse()  # its 588 inputs padded to 592 (models/patches.py)
        self.time_table = sinusoid_table(self.config.pos_emb_time, self.hidden).to(self.time_table.device)
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
        return base_capacity(grids, self.geometry, modality)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        need = self.required_capacity(grids, cap.modality)
        if not cap.fits(need):
            raise CapacityError(f"batch needs {need}, more than the capacity {cap}")
        meta = {
            "cu_seqlens": padded_cumsum(segment_lengths(grids, self.geometry), cap.segments),
            "pos_ids": raster_rotary_positions(grids, self.merge, cap.patches),
            "time_index": time_index(grids, cap.patches, self.geometry.chunk),
        }
        meta.update(tap_metadata(grids, cap, 16, lambda h, w: raster_taps(h, w, self.merge, self.side, "bicubic")))
        meta.update(temporal_mean_metadata(grids, self.geometry.output_rows(cap), self.merge_unit,
                                           self.geometry.chunk))
        return meta

    # ---- device half ----------------------------------------------------------------------
    def block_stack(self) -> nn.ModuleList:
        return self.encoder.blocks

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.encoder.patch_embed(self.normalize(pixels))
        table = self.patch_embed.pos_emb.weight.flatten(0, 1)
        pos = resample_float32(table, meta) + self.time_table[meta["time_index"]].float()
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary(meta["pos_ids"])
        for blk in self.encoder.blocks:
            x = blk(x, cos, sin, meta["cu_seqlens"], cap.max_seqlen)
        x = self.encoder.final_layernorm(x)
        pooled = temporal_mean(x, meta, self.merge_unit).to(x.dtype)  # [rows, unit, hidden]
        return TowerOutput(self.proj(self.pre_norm(pooled).view(pooled.shape[0], -1)), [])


def kimi_processor_config(family: str, image: dict[str, Any], video: dict[str, Any] | None) -> ProcessorConfig:
    """The Kimi processors' settings: patches of one frame; `max_patches` (16384 for images, 4096 for video
    frames) bounds patches of a frame, kept as pixels (max_patches * patch**2); frames are never upscaled."""
    base = ProcessorConfig.from_dicts(family, {"temporal_patch_size": 1, "image_mean": IMAGENET_STANDARD,
                                               "image_std": IMAGENET_STANDARD, **image}, video)
    patch = base.patch_size
    area = patch * patch
    video = video or {}
    frames = replace(base.video, fps=float(video.get("fps", 2)), min_pixels=0,
                     max_pixels=int(video.get("max_patches", 4096)) * area)
    return replace(base, temporal_patch_size=1, min_pixels=0, max_pixels=int(image.get("max_patches", 16384)) * area,
                   video=frames)


def raster_rows(pixels: torch.Tensor, grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """Packed patch rows (each frame in merge-block order) in each frame's raster order, as transformers' Kimi
    and Muse models take them."""
    out, start = torch.empty_like(pixels), 0
    for t, h, w in grids:
        pos = block_order_positions(h, w, merge)
        raster = torch.from_numpy(pos[:, 0] * w + pos[:, 1]).to(pixels.device)
        for _ in range(t):
            out[start + raster] = pixels[start : start + h * w]
            start += h * w
    return out


def reference_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor, video: bool = False) -> torch.Tensor:
    """transformers' features (Kimi's or Muse's `get_image_features`, or `get_video_features`) for packed
    normalised rows: rows in raster order, Kimi's as [N, 3, p, p] patches, Muse's with the temporal axis first in
    each row (the tests' and benchmarks' reference; `grid_thw` as the model takes it, Kimi's video in chunks)."""
    vision = model.config.vision_config
    p = vision.patch_size
    grids = [tuple(g) for g in grid_thw.tolist()]
    if hasattr(vision, "merge_kernel_size"):  # Kimi: one frame per patch, a Conv2d
        x = raster_rows(pixels, grids, vision.merge_kernel_size[0]).view(-1, 3, p, p)
    else:  # Muse: rows of (temporal, channel, pixels)
        x = raster_rows(pixels, grids, vision.merge_size)
        x = x.view(len(x), 3, vision.patch_temporal, p * p).transpose(1, 2).reshape(len(x), -1)
    if video:
        return torch.cat(model.model.get_video_features(pixel_values_videos=x, video_grid_thw=grid_thw).pooler_output)
    return torch.cat(model.model.get_image_features(pixel_values=x, image_grid_thw=grid_thw).pooler_output)


KIMI_K25 = register(Family(
    "kimi_k25", "Kimi-K2.5 / K2.6", config_path=(), dims=kimi_dims,
    prefixes=("vision_tower.", "model.mm_projector.", "mm_projector."),
    image_processor="Kimi_K25ImageProcessor", hf_class="Kimi_K25ForConditionalGeneration",
    image_sizing="kimi", video_sampling="kimi",
    # vLLM 0.33 serves Kimi-K2.5 through its own "vision_chunk" items and refuses embeddings for them
    vllm_embedding_parts=False, tower=KimiTower,
    extra={"processor_config": kimi_processor_config, "max_side_patches": 512,
           "reference_features": reference_features},
))
