"""Which reference processor a model family's preprocessing follows.

Families differ in how they size an image and how they sample a video, not in the rest of the path
(decode, resize with PIL bicubic on uint8, patchify in the merge-block order, normalise on the device).
Each family names one rule set; the image and video paths branch on that name alone, so a new family
that preprocesses like an existing one only names it.

* `qwen2_vl`: `Qwen2VLImageProcessor` (area bounds on H*W) and qwen-vl-utils `fetch_video`
  (Qwen2-VL, Qwen2.5-VL).
* `qwen3_vl`: `Qwen2VLImageProcessor` for images, `Qwen3VLVideoProcessor` for videos (bounds on T*H*W).
* `glm4v`: `Glm4vImageProcessor` (an image is a clip of `temporal_patch_size` frames: bounds on T*H*W,
  tiny images scaled up first) and `Glm4vVideoProcessor` (frames at `fps` up to `max_duration` seconds,
  duplicates dropped, an odd count padded with the last frame).
"""

from __future__ import annotations

from models.config import ProcessorConfig

QWEN2_VL = "qwen2_vl"
QWEN3_VL = "qwen3_vl"
GLM4V = "glm4v"

FAMILY_RULES: dict[str, str] = {
    "qwen2_vl": QWEN2_VL,
    "qwen2_5_vl": QWEN2_VL,
    "qwen3_vl": QWEN3_VL,
    "glm4v": GLM4V,
    "glm4v_moe": GLM4V,
    "glm_ocr": GLM4V,
}


def rules_of(cfg: ProcessorConfig) -> str:
    """The rule set of `cfg`'s family (a family not listed is its own name, which the paths refuse or
    treat as Qwen2-VL's where every family agrees)."""
    return FAMILY_RULES.get(cfg.family, cfg.family)
