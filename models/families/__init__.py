"""Every served family, one module each; importing this package registers them all in
`models.family.FAMILIES` (keyed by the checkpoint's `model_type`)."""

from models.families import (  # noqa: F401  (registration)
    cohere_compass,
    cosmos3_edge,
    cosmos3_omni,
    dots3_note,
    ernie4_5_vl_moe,
    exaone4_5,
    glm4v,
    glm5_next,
    glmga,
    hunyuan_vl,
    hy_v4_vl,
    hyperclovax_vision_v2,
    kimi_k25,
    lfm3_vl,
    minimax_m3_vl,
    muse_glimmer,
    muse_spark,
    paddleocr_vl,
    qwen2_5_omni,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    qwen3_omni_moe,
    qwen3_vl,
    qwen3_vl_moe,
    qwen4_exp,
    video_llama_3,
)
from models.family import FAMILIES, Family

__all__ = ["FAMILIES", "Family"]
