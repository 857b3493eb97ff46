"""Every served family, one module each; importing this package registers them all in
`models.family.FAMILIES` (keyed by the checkpoint's `model_type`)."""

from models.families import glm4v, qwen2_5_vl, qwen2_vl, qwen3_vl  # noqa: F401  (registration)
from models.family import FAMILIES, Family

__all__ = ["FAMILIES", "Family"]
