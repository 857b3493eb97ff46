"""HunyuanOCR (`hunyuan_vl`), and the tower Hy4 (`hy_v4_vl`, models/families/hy_v4_vl.py) shares with it.

Conv2d patches (temporal patch 1) plus a learned position table of (max_image_size / patch)^2 rows after a
class row, resampled bilinearly to each frame (models/positions.py); LayerNorm blocks without
rotary (separate q/k/v/o projections, fc2(GELU(fc1))); then the "perceive" merger: RMSNorm, a 2x2 Conv2d,
GELU, a 1x1 Conv2d, and the learned tokens transformers concatenates per image, laid out by index here
(models/token_layout.py): each row of merged tokens closed by a newline token, HunyuanOCR's image between
begin and end tokens after a Linear to the text width and a last RMSNorm over every row.

The processors give patch rows in raster order (row by row, not merge block by merge block); the tower
gathers each frame into merge-block order first (attention and positions do not care about the order), so
the 2x2 Conv2d is one matrix product over four contiguous rows. Images only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ProcessorConfig
from models.families.glm4v import MergeConv
from models.family import Dims, Family, register
from models.kernels import ACTIVATIONS
from models.layers import RMSNorm, check_activation, position_table
from models.mergers import raster_merge_index
from models.patches import Conv2dPatches
from models.positions import half_pixel_metadata, resample_float32
from models.protocol import Capacity, Grid, TowerOutput
from models.token_layout import NewlineGeometry, lay_out
from models.vit_tower import BlockNames, ViTTower, named_block

HUNYUAN_NAMES = BlockNames(norm1="input_layernorm", norm2="post_attention_layernorm", out="o_proj",
                           fc1="dense_h_to_4h", fc2="dense_4h_to_h")


class Perceive(nn.Module):
    """The merger: norm, 2x2 Conv2d (`proj.0`), activation, 1x1 Conv2d (`proj.2`) on each merge block, then
    the newline token. HunyuanOCR (`text_width` given): a Linear (`mlp`) to the text width over the merged
    tokens and the newline, the begin and end tokens, and an RMSNorm over every row (`after_rms`); its norm
    before is `before_rms`. Hy4: the 1x1 Conv2d gives the output width itself, the norm is `norm`."""

    def __init__(self, dim: int, wide: int, out: int, merge: int, act: str, eps: float,
                 text_width: int | None = None) -> None:
        super().__init__()
        self.act = check_activation(act)
        self.text = text_width is not None
        setattr(self, "before_rms" if self.text else "norm", RMSNorm(dim, eps))
        self.proj = nn.ModuleList([MergeConv(dim, wide, merge), nn.Identity(), Conv2dPatches(wide, out, 1)])
        self.image_newline = nn.Parameter(torch.empty(out))
        if text_width is not None:
            self.mlp = nn.Linear(out, text_width)
            self.image_begin = nn.Parameter(torch.empty(text_width))
            self.image_end = nn.Parameter(torch.empty(text_width))
            self.image_sep = nn.Parameter(torch.empty(text_width))  # in the checkpoint; a prompt's, not the tower's
            self.after_rms = RMSNorm(text_width, eps)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x: [patches, dim] in merge-block order -> the output rows `index` (models/token_layout.py) lays out."""
        norm = self.before_rms if self.text else self.norm
        merged = self.proj[2](ACTIVATIONS[self.act](self.proj[0](norm(x))))
        if not self.text:
            return lay_out(merged, self.image_newline[None], index)
        rows = self.mlp(torch.cat([merged, self.image_newline[None].to(merged.dtype)]))
        n = merged.shape[0]
        extras = torch.cat([rows[n:], self.image_begin[None].to(rows.dtype), self.image_end[None].to(rows.dtype)])
        return self.after_rms(lay_out(rows[:n], extras, index))


class HunyuanTower(ViTTower):
    """The shared parts (models/vit_tower.py) plus Hunyuan's embedding, position table and merger."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        cfg = vision_config
        super().__init__(family, cfg, processor, backend, cfg.spatial_merge_size)
        self.check_processor(cfg.patch_size, 1)
        if processor.merge_size != self.merge:
            raise ValueError(f"preprocessor merge {processor.merge_size} disagrees with the vision config's "
                             f"{self.merge}")
        dims, eps = self.dims, cfg.rms_norm_eps
        self.side = cfg.max_image_size // cfg.patch_size
        self.position_offset = family.extra.get("position_offset")  # Hy4 samples its table by (size + 0.1) / side
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = Conv2dPatches(cfg.num_channels, dims.hidden, cfg.patch_size)
        self.embeddings.position_embedding = position_table(self.side * self.side + 1, dims.hidden)
        self.layers = nn.ModuleList(named_block(dims, cfg.hidden_act, eps, backend, HUNYUAN_NAMES)
                                    for _ in range(dims.depth))
        if family.extra.get("text_tokens", True):  # HunyuanOCR: 2x, 4x the width, then a Linear to the text's
            self.perceive = Perceive(dims.hidden, 2 * dims.hidden, 4 * dims.hidden, self.merge, cfg.hidden_act, eps,
                                     text_width=dims.out)
        else:
            self.perceive = Perceive(dims.hidden, dims.hidden * self.merge_unit, dims.out, self.merge,
                                     cfg.hidden_act, eps)

    def make_geometry(self) -> NewlineGeometry:
        return NewlineGeometry(self.merge, extra=2 if self.spec.extra.get("text_tokens", True) else 0)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        meta["patch_order"] = raster_merge_index(grids, self.merge, cap.patches)
        meta.update(half_pixel_metadata(grids, cap, self.merge, self.side, first=1, offset=self.position_offset,
                                        kernel="interpolate"))
        meta["out_index"] = self.geometry.gather_index(grids, cap)
        return meta

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.embeddings.patch_embedding(self.normalized(pixels[meta["patch_order"]], cap))
        table = self.embeddings.position_embedding.weight
        delta = resample_float32(table, meta).to(x.dtype)
        x = self.run_blocks(x, meta, cap, delta=delta)
        return TowerOutput(self.perceive(x, meta["out_index"]), [])


def hunyuan_dims(cfg: Any) -> Dims:
    """The merger ends at the text model's width (`text_hidden_size`, kept in step with the text config)."""
    return Dims(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_attention_heads,
                mlp=cfg.intermediate_size, depth=cfg.num_hidden_layers, out=cfg.text_hidden_size)


def reference_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' own entry point (the benchmarks' and GPU tests' reference): every image's rows, the merger's
    learned tokens laid out, back to back."""
    return torch.cat(list(model.model.get_image_features(pixels, grid_thw).pooler_output))


# HunYuanVLImageProcessor's defaults where Qwen2-VL's differ (512x512 to 2048x2048 pixels, 16-pixel patches, one
# frame), for the keys a checkpoint's preprocessor config leaves out.
HUNYUAN_IMAGE_DEFAULTS = {"patch_size": 16, "temporal_patch_size": 1, "merge_size": 2,
                          "size": {"shortest_edge": 512 * 512, "longest_edge": 2048 * 2048}}
HUNYUAN_VL = register(Family(
    "hunyuan_vl", "HunyuanOCR", prefixes=("vit.", "model.vision_tower."), dims=hunyuan_dims,
    patch_order="raster", video=False, image_processor="HunYuanVLImageProcessor",
    # vLLM 0.33 serves it through its Transformers backend, whose processor takes no image_embeds parts (it fails
    # on them): the hand-off keeps the media and names the cached encoder output by uuid, as for GLM-4.1V.
    vllm_embedding_parts=False,
    processor_defaults={"image": HUNYUAN_IMAGE_DEFAULTS},
    hf_class="HunYuanVLForConditionalGeneration", tower=HunyuanTower,
    extra={"reference_features": reference_features},
))
