"""Qwen2.5-VL: RMSNorm blocks with a SwiGLU MLP and window attention (all blocks but
`fullatt_block_indexes` attend within windows of `window_size` pixels)."""

from models.families.qwen2_vl import QWEN2_VL
from models.family import register, standard_dims

QWEN2_5_VL = register(QWEN2_VL.derive(
    model_type="qwen2_5_vl", title="Qwen2.5-VL", dims=standard_dims, norm="rms", mlp="gated", windows=True,
    vllm_video_seconds=1.0,  # vLLM's parser drops second_per_grid_ts from video embeddings, M-RoPE takes 1.0
    hf_class="Qwen2_5_VLForConditionalGeneration",
))
