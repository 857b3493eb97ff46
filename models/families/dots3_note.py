"""dots3-note (`dots3_note`): Conv2d patches of one frame followed by an RMSNorm, RMSNorm blocks with per-head
q/k RMSNorm, 2D rotary positions and a SwiGLU MLP, the later blocks' MLP a mixture of routed experts
(models/moe.py: sigmoid router with a correction bias, top-k, no shared expert), an RMSNorm after the blocks
and a Qwen2-VL-style merger (`adapter`). Keys as the release and transformers' save_pretrained lay them out
(`vision_encoder.*`: `norm_1`, `mlp.fc1`/`fc3`/`fc2`, one module per expert, `post_trunk_norm`, `adapter`).
Patch rows are single frames (temporal_patch_size 1); preprocessing is Qwen2-VL's for images and Qwen3-VL's
for videos, as transformers maps the model type.
"""

from __future__ import annotations

from typing import Any

import torch

from models.blocks import NamedBlock, NamedGatedMlp, Renamed
from models.config import ProcessorConfig
from models.family import ConfigView, Dims, Family, register
from models.layers import Attention, Merger, RMSNorm
from models.moe import SparseMoe
from models.patches import Conv2dPatches, PatchProjection
from models.protocol import Capacity, TowerOutput
from models.tower import QwenTower

MLP_NAMES = {"gate_proj": "fc1", "up_proj": "fc3", "down_proj": "fc2"}


class Dots3Tower(Renamed, QwenTower):
    """The shared tower with dots3-note's patch embedding, expert MLPs, final norm and `adapter` merger."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        cfg = vision_config
        self.layer_mlps = iter(enumerate(cfg.mlp_layer_types))  # `make_block` builds layer after layer in order
        # A patch row is one frame's (C, P, P): the shared tower reads that as a temporal patch of 1.
        super().__init__(family, ConfigView(cfg, in_channels=cfg.num_channels, temporal_patch_size=1), processor,
                         backend)
        dims = self.dims
        del self.layer_mlps
        self.patch_embed = PatchProjection(Conv2dPatches(cfg.num_channels, dims.hidden, cfg.patch_size,
                                                         processor.patch_layout),
                                           norm=RMSNorm(dims.hidden, cfg.rms_norm_eps))
        self.post_trunk_norm = RMSNorm(dims.hidden, cfg.rms_norm_eps)
        self.merger = Merger(dims.hidden, dims.out, self.merge_unit, "layer", "mlp")
        self.use_names({"merger": "adapter"})

    def make_block(self, dims: Dims) -> NamedBlock:
        layer, kind = next(self.layer_mlps)
        cfg = self.config
        own = cfg.per_layer_config[layer]  # the layer's expert count where it has experts
        eps = cfg.rms_norm_eps
        attn = Attention(dims.hidden, dims.heads, self.backend, bias=cfg.attention_bias, proj_bias=cfg.attention_bias,
                         qk_norm=True, eps=eps)
        if kind == "sparse":
            mlp: torch.nn.Module = SparseMoe(dims.hidden, own.moe_intermediate_size, own.num_local_experts,
                                             own.num_experts_per_tok, cfg.hidden_act, cfg.router_scaling_factor,
                                             MLP_NAMES)
        else:
            mlp = NamedGatedMlp(dims.hidden, own.intermediate_size, cfg.hidden_act, cfg.mlp_bias).use_names(MLP_NAMES)
        norms = RMSNorm(dims.hidden, eps), RMSNorm(dims.hidden, eps)
        return NamedBlock(*norms, attn, mlp).use_names({"norm1": "norm_1", "norm2": "norm_2"})

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x, _ = self.run_blocks(self.patch_embed(self.normalize(pixels)), meta, cap)
        return TowerOutput(self.merger(self.post_trunk_norm(x)), [])


def dots3_dims(cfg: Any) -> Dims:
    heads = cfg.num_attention_heads
    return Dims(hidden=cfg.hidden_size, heads=heads, kv_heads=heads, mlp=cfg.intermediate_size,
                depth=cfg.num_hidden_layers, out=cfg.adapter_out_dim)


DOTS3_NOTE = register(Family(
    "dots3_note", "dots3-note", prefixes=("vision_encoder.",), dims=dots3_dims, mlp="gated", video_sampling="qwen3",
    hf_class="Dots3NoteForConditionalGeneration", tower=Dots3Tower,
    # vLLM 0.33's processor declares pixel fields only (its `vllm_ref` is the media part with the uuid) and
    # builds its own prompt for a video: frames as images between timestamps, with the audio
    vllm_embedding_parts=False, vllm_media=("image",),
))
