"""Qwen2-VL: LayerNorm blocks with a QuickGELU MLP (width from `mlp_ratio`), one merger."""

from typing import Any

from models.family import Dims, Family, register


def dims(cfg: Any) -> Dims:
    """Qwen2-VL names its residual width `embed_dim` and its output width `hidden_size`."""
    return Dims(hidden=cfg.embed_dim, heads=cfg.num_heads, kv_heads=cfg.num_heads,
                mlp=int(cfg.embed_dim * cfg.mlp_ratio), depth=cfg.depth, out=cfg.hidden_size)


QWEN2_VL = register(Family("qwen2_vl", "Qwen2-VL", dims=dims, hf_class="Qwen2VLForConditionalGeneration"))
