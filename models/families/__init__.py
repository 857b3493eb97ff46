"""Every served family, one module each; importing this package registers them all in
`models.family.FAMILIES` (keyed by the checkpoint's `model_type`)."""

from models.families import (  # noqa: F401  (registration)
    cohere_compass,
    cosmos3_omni,
    exaone4_5,
    glm4v,
    glm5_next,
    glmga,
    hyperclovax_vision_v2,
    qwen2_5_omni,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    qwen3_omni_moe,
    qwen3_vl,
    qwen3_vl_moe,
    qwen4_exp,
)
from models.family import FAMILIES, Family

__all__ = ["FAMILIES", "Family"]
