"""LFM3-VL (`lfm3_vl`): a linear patch embedding and an RMSNorm, then blocks that are either gated depthwise
convolutions over each frame's patch grid (models/blocks.py, FrameConv) or grouped-query attention with
per-head q/k RMSNorm and 2D rotary positions, each followed by a SwiGLU MLP; no norm after the blocks. The
projector outside the vision model (`model.multi_modal_projector`) normalises each patch, concatenates each
2x2 merge block and runs a GELU MLP into the language model's width. Preprocessing is Qwen2-VL's for images
and Qwen3-VL's for videos, as transformers maps the model type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from models.blocks import FrameConv, NamedAttention, NamedBlock, NamedGatedMlp, Renamed, frame_conv_metadata
from models.config import ProcessorConfig
from models.family import ConfigView, Dims, Family, register
from models.kernels import linear_act
from models.layers import RMSNorm, check_activation
from models.patches import LinearPatches
from models.protocol import Capacity, Grid, TowerOutput
from models.tower import QwenTower

# The checkpoint's names for the shared parts (after transformers' own renames on save: q_layernorm, ...).
BLOCK_NAMES = {"norm1": "operator_norm", "norm2": "ffn_norm", "mlp": "feed_forward"}
ATTENTION_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "proj": "out_proj", "q_norm": "q_layernorm",
                   "k_norm": "k_layernorm"}
MLP_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class Lfm3Tower(Renamed, QwenTower):
    """The shared tower with LFM3-VL's parts. It is built from the whole model's config: the projector's
    width and the language model's (its output width) live outside the vision config. The projector's
    parameters sit at the tower's top level (`layer_norm`, `linear_1`, `linear_2`), as the checkpoint names
    them once their prefix is read off."""

    def __init__(self, family: Family, config: Any, processor: ProcessorConfig, backend: str) -> None:
        vision = config.vision_config
        self.layer_kinds = iter(vision.layer_types)  # `make_block` builds layer after layer in this order
        super().__init__(family, ConfigView(vision, out_hidden_size=config.text_config.hidden_size), processor,
                         backend)
        dims = self.dims
        del self.layer_kinds, self.patch_embed, self.merger
        pre = processor  # a Linear over each patch row, in the processor's own order
        self.patchifier = LinearPatches(pre.in_channels, pre.temporal_patch_size, pre.patch_size, dims.hidden,
                                        pre.patch_layout, pre.patch_layout, bias=False)
        self.embedding_norm = RMSNorm(dims.hidden, vision.norm_eps)
        self.kernel = vision.conv_kernel_size
        self.conv_layers = frozenset(i for i, kind in enumerate(vision.layer_types) if kind == "conv")
        self.full_attention = frozenset(range(dims.depth)) - self.conv_layers
        width, inner = dims.hidden * self.merge_unit, config.projector_hidden_size
        self.layer_norm = nn.LayerNorm(dims.hidden, eps=1e-6)
        self.linear_1 = nn.Linear(width, inner, bias=config.projector_bias)
        self.linear_2 = nn.Linear(inner, dims.out, bias=config.projector_bias)
        self.projector_act = check_activation(config.projector_hidden_act)
        self.use_names({"blocks": "layers"})

    def make_block(self, dims: Dims) -> NamedBlock:
        kind, eps = next(self.layer_kinds), self.config.norm_eps
        if kind == "conv":
            mixer: nn.Module = FrameConv(dims.hidden, self.config.conv_kernel_size)
        else:
            mixer = NamedAttention(dims.hidden, dims.heads, self.backend, dims.kv_heads, separate=True, bias=False,
                                   proj_bias=False, qk_norm=True, eps=eps).use_names(ATTENTION_NAMES)
        mlp = NamedGatedMlp(dims.hidden, dims.mlp, "silu", bias=False).use_names(MLP_NAMES)
        names = {**BLOCK_NAMES, "attn": "conv" if kind == "conv" else "self_attn"}
        return NamedBlock(RMSNorm(dims.hidden, eps), RMSNorm(dims.hidden, eps), mixer, mlp).use_names(names)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        if self.conv_layers:
            meta.update(frame_conv_metadata(grids, cap, self.merge, self.kernel))
        return meta

    def layer_segments(self, layer: int, meta: dict[str, torch.Tensor], cap: Capacity
                       ) -> tuple[torch.Tensor, int, bool]:
        """A conv layer reads each patch's neighbour rows where an attention layer reads its segments."""
        if layer in self.conv_layers:
            return meta["conv_taps"], 0, False
        return super().layer_segments(layer, meta, cap)

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x, _ = self.run_blocks(self.embedding_norm(self.patchifier(self.normalize(pixels))), meta, cap)
        merged = self.layer_norm(x).view(-1, self.linear_1.in_features)
        return TowerOutput(self.linear_2(linear_act(merged, self.linear_1, self.projector_act)), [])


def lfm3_dims(cfg: Any) -> Dims:
    return Dims(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                mlp=cfg.intermediate_size, depth=cfg.num_hidden_layers, out=cfg.out_hidden_size)


LFM3_VL = register(Family(
    "lfm3_vl", "LFM3-VL", config_path=(), dims=lfm3_dims, mlp="gated", video_sampling="qwen3",
    # transformers' save_pretrained layout; a checkpoint saved from the bare model lacks the `model.`
    prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."),
    hf_class="Lfm3VlForConditionalGeneration", tower=Lfm3Tower,
    vllm_media=(),  # vLLM 0.33 serves LFM2-VL, not LFM3-VL
))
