"""Qwen3-VL: LayerNorm blocks with a tanh-GELU MLP, a learned position table resampled bilinearly to
each grid, and DeepStack mergers tapping the `deepstack_visual_indexes` blocks. Video embeddings
travel to vLLM with timestamps."""

from models.family import Family, register

QWEN3_VL = register(Family(
    "qwen3_vl", "Qwen3-VL", patch_bias=True, mlp_names=("linear_fc1", "linear_fc2"), learned_positions=True,
    merger="linear_fc", deepstack="deepstack_merger_list", video_sampling="qwen3",
    video_timestamps=True,
    hf_class="Qwen3VLForConditionalGeneration",
))
