"""Hy4 (`hy_v4_vl`): HunyuanOCR's tower (models/families/hunyuan_vl.py) with its merger ending at the output
width in the 1x1 Conv2d (no Linear, no begin and end tokens, no last norm), a position table sampled by the
scale factor (size + 0.1) / side, and videos: each frame merged on its own, every row of merged tokens closed
by the newline token, frames back to back ((h/2) x (w/2 + 1) rows per frame). Frames are sampled and sized
as HYV4VLVideoProcessor does (service/media/video_sampling.py), with its own mean and std."""

from __future__ import annotations

from typing import Any

from models.families.hunyuan_vl import HUNYUAN_IMAGE_DEFAULTS, HUNYUAN_VL, reference_features
from models.family import Dims, register


def hy4_dims(cfg: Any) -> Dims:
    return Dims(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_attention_heads,
                mlp=cfg.intermediate_size, depth=cfg.num_hidden_layers, out=cfg.out_hidden_size)


HY_V4_VL = register(HUNYUAN_VL.derive(
    model_type="hy_v4_vl", title="Hy4", dims=hy4_dims, video=True, video_sampling="hy_v4_vl",
    image_processor="HYV4VLImageProcessor", hf_class="HYV4VLForConditionalGeneration",
    vllm_embedding_parts=True,  # vLLM 0.33 does not serve Hy4's vision model: parts as for the Qwen-VL families
    processor_defaults={"image": HUNYUAN_IMAGE_DEFAULTS,
                        "video": {"patch_size": 16, "temporal_patch_size": 1, "merge_size": 2, "fps": 2,
                                  "min_frames": 2, "max_frames": 1024, "image_mean": [0.5, 0.5, 0.5],
                                  "image_std": [0.5, 0.5, 0.5], "max_image_size": {"longest_edge": 1024 * 1024},
                                  "size": {"shortest_edge": 4096, "longest_edge": 33554432}}},
    extra={"text_tokens": False, "position_offset": 0.1, "reference_features": reference_features},
))
