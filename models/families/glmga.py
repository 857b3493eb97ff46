"""GLMGA: transformers builds GLM-4.6V's model for it (Glm46VForConditionalGeneration, GLM-4.1V's tower and key
layout); only its processors are its own. Images: GlmgaImageProcessor sizes as GLM-4.6V's (its
`patch_expand_factor` must stay 1; the PIL backend ignores it, the torchvision one coarsens the grid).
Videos: GlmgaVideoProcessor samples at a fixed rate (2 fps unless the config says) up to 640 frames, its own
frame choice (service/media/video_sampling.py), and a larger default pixel budget."""

from models.families.glm4v import GLM46V
from models.family import register

GLMGA = register(GLM46V.derive(
    model_type="glmga", title="GLMGA", image_processor="GlmgaImageProcessor", video_sampling="glmga",
    hf_class="Glm46VForConditionalGeneration",
    processor_defaults={
        "image": {"size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000}},
        "video": {"size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 55790}, "fps": 2,
                  "max_frames": 640},
    },
))
