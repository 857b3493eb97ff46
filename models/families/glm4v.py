"""GLM-4.1V (`glm4v`), GLM-4.5V (`glm4v_moe`) and GLM-4.6V (`glm46v`), one tower, and GLM-OCR (`glm_ocr`).

Patches as in Qwen2.5-VL (with a bias) followed by an RMSNorm, a learned position table resampled
bicubically to each frame (models/positions.py), RMSNorm blocks (eps 1e-5) with bias-free attention and
a bias-free SwiGLU MLP as wide as the output, an RMSNorm after the blocks, a Conv2d merging each 2x2
block into one token, and a gated merger. GLM-OCR has no position table nor the norm before it, biases
everywhere, per-head q/k norms and an MLP of `intermediate_size`. Images are sized as clips of two
frames, videos sampled as Glm4vVideoProcessor does (service/media/); GLM-4.6V's video processor picks its
frame rate from the clip's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.config import ProcessorConfig
from models.family import Dims, Family, register, standard_dims
from models.layers import GatedMlp, RMSNorm, position_table
from models.positions import bicubic_metadata, resample_float32
from models.protocol import Capacity, Grid, TowerOutput
from models.tower import QwenTower


class MergeConv(nn.Conv2d):
    """The checkpoint's `downsample` Conv2d (kernel = stride = merge): one matrix product over each merge
    block's patches concatenated in the processor's order (merge row, merge column, channel). After
    loading, the weight is stored in that product's layout; the parameter stays a view of it."""

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


class GlmMerger(GatedMlp):
    """proj -> LayerNorm -> GELU -> SwiGLU (gate/up/down, no biases; clamped at `limit` where given) on each
    merged token."""

    def __init__(self, dim: int, context: int, act: str, limit: float | None = None) -> None:
        super().__init__(dim, context, act, bias=False, limit=limit)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class GlmTower(QwenTower):
    """The shared tower plus GLM's own parts: the norm after the patches, the bicubic position table,
    the norm after the blocks, the merging Conv2d and the gated merger."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        super().__init__(family, vision_config, processor, backend)
        cfg, dims, eps = vision_config, self.dims, family.norm_eps
        self.position_table = family.extra.get("position_table", True)
        if self.position_table:
            self.post_conv_layernorm = RMSNorm(dims.hidden, eps)
            self.side = cfg.image_size // cfg.patch_size
            self.embeddings = nn.Module()
            self.embeddings.position_embedding = position_table(self.side * self.side, dims.hidden)
        self.post_layernorm = RMSNorm(dims.hidden, eps)
        self.downsample = MergeConv(dims.hidden, dims.out, self.merge)
        context = dims.out * cfg.in_channels if family.extra.get("merger_per_channel") else cfg.intermediate_size
        self.merger = GlmMerger(dims.out, context, cfg.hidden_act)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        if self.position_table:
            meta.update(bicubic_metadata(grids, cap, self.merge, self.side))
        return meta

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.patch_embed(self.normalize(pixels))
        delta = None
        if self.position_table:
            x = self.post_conv_layernorm(x)
            table = self.embeddings.position_embedding.weight
            delta = resample_float32(table, meta).to(table.dtype).to(x.dtype)
        x, _ = self.run_blocks(x, meta, cap, delta=delta)
        return TowerOutput(self.merger(self.downsample(self.post_layernorm(x))), [])


def glm4v_dims(cfg: Any) -> Dims:
    """GLM-4.1V's block MLP is `out_hidden_size` wide (its `intermediate_size` is the merger's)."""
    return Dims(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_heads, mlp=cfg.out_hidden_size,
                depth=cfg.depth, out=cfg.out_hidden_size)


GLM4V = register(Family(
    "glm4v", "GLM-4.1V", dims=glm4v_dims, norm="rms", norm_eps=1e-5, patch_bias=True, mlp="gated",
    qkv_bias=False, proj_bias=False, mlp_bias=False, image_sizing="glm4v", video_sampling="glm4v",
    image_processor="Glm4vImageProcessor", vllm_embedding_parts=False,
    hf_class="Glm4vForConditionalGeneration", tower=GlmTower,
    # transformers' GLM vision model takes each temporal step of a video as its own (1, h, w) grid
    # (`get_video_features` flattens them so); references and benchmarks call it that way.
    extra={"reference_frames_as_grids": True},
))
GLM4V_MOE = register(GLM4V.derive(
    model_type="glm4v_moe", title="GLM-4.5V", hf_class="Glm4vMoeForConditionalGeneration",
))
GLM46V = register(GLM4V.derive(
    model_type="glm46v", title="GLM-4.6V", hf_class="Glm46VForConditionalGeneration",
    image_processor="Glm46VImageProcessor", video_sampling="glm46v",
))
GLM_OCR = register(GLM4V.derive(
    model_type="glm_ocr", title="GLM-OCR", dims=standard_dims, qkv_bias=True, proj_bias=True, mlp_bias=True,
    qk_norm=True, hf_class="GlmOcrForConditionalGeneration",
    extra={"position_table": False, "merger_per_channel": True, "reference_frames_as_grids": True},
))
