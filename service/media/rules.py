"""Which reference processor a model family's preprocessing follows.

Families differ in how they size an image and how they sample a video, not in the rest of the path
(decode, resize with PIL bicubic on uint8, patchify in the merge-block order, normalise on the device).
Each family names its rules (`image_sizing`, `video_sampling` in models/family.py); the image and video
paths branch on those names alone, so a family that preprocesses like another only names its rules.

* image sizing "qwen2": `Qwen2VLImageProcessor`'s smart_resize (bounds on H*W);
  "glm4v": `Glm4vImageProcessor`'s (an image is a clip of temporal_patch_size frames: bounds on T*H*W,
  tiny images scaled up first); "glm5": `Glm5NextImageProcessor`'s (bounds on T*H*W in tokens, sides
  rounded up, the content shrunk into that canvas and zero-padded, never enlarged above the minimum).
* image resize "pil": PIL bicubic on the uint8 image (the *ImageProcessorPil classes); "torch": torchvision's
  bicubic with antialias on a uint8 tensor (MiniMaxM3VLImageProcessor, which exists only with torchvision).
* video sampling "qwen2": qwen-vl-utils `fetch_video`; "qwen3": `Qwen3VLVideoProcessor`; "glm4v":
  `Glm4vVideoProcessor` (frames at fps up to max_duration seconds, repeats dropped, odd counts padded);
  "glm46v", "glmga", "glm5": GLM-4.6V's, GLMGA's and GLM-5's processors (a rate from the clip's length; a
  fixed rate up to max_frames; the same with GLM-5's own sizing and padding); "hy_v4_vl":
  `HYV4VLVideoProcessor`; "video_llama_3": `VideoLlama3VideoProcessor`.
"""

from __future__ import annotations

from models.config import ProcessorConfig


def _family(cfg: ProcessorConfig):
    from models.families import FAMILIES  # the registry; imported here to keep this module light

    return FAMILIES.get(cfg.family)


def image_sizing(cfg: ProcessorConfig) -> str:
    family = _family(cfg)
    return family.image_sizing if family else "qwen2"


def family_extra(cfg: ProcessorConfig) -> dict:
    """What the family's own rules read beyond the common fields (`Family.extra`)."""
    family = _family(cfg)
    return family.extra if family else {}


def image_resize(cfg: ProcessorConfig) -> str:
    """"pil" (PIL bicubic on uint8) or "torch" (torchvision's bicubic with antialias on uint8 tensors)."""
    family = _family(cfg)
    return family.image_resize if family else "pil"


def video_resize(cfg: ProcessorConfig) -> str:
    """The same choice for video frames (`Family.video_resize`)."""
    family = _family(cfg)
    return family.video_resize if family else "pil"


def takes_video(cfg: ProcessorConfig) -> bool:
    """False for a family whose vision model takes images only (Cohere Compass)."""
    family = _family(cfg)
    return family.video if family else True


# GLM checkpoints of one model_type ship either of GLM's video processors (GLM-4.6V's samples by the clip's
# length): the class the checkpoint names decides, as it does in transformers.
GLM_VIDEO_PROCESSORS = {"Glm4vVideoProcessor": "glm4v", "Glm46VVideoProcessor": "glm46v",
                        "GlmgaVideoProcessor": "glmga", "Glm5NextVideoProcessor": "glm5"}


def video_sampling(cfg: ProcessorConfig) -> str:
    """The family's video rules; a model_type no family claims is returned as is (and refused)."""
    family = _family(cfg)
    if family is None:
        return cfg.family
    if family.video_sampling in GLM_VIDEO_PROCESSORS.values():
        return GLM_VIDEO_PROCESSORS.get(cfg.video.processor_class, family.video_sampling)
    return family.video_sampling

