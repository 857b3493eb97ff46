"""EXAONE 4.5 (EXAONE-4.5-33B): Qwen2.5-VL's tower whose attention groups its keys and values
(`num_key_value_heads` in the vision config); one `attn.qkv` holds q, then the fewer k and v heads."""

from models.families.qwen2_5_vl import QWEN2_5_VL
from models.family import register

EXAONE4_5 = register(QWEN2_5_VL.derive(
    model_type="exaone4_5", title="EXAONE 4.5", hf_class="Exaone4_5_ForConditionalGeneration",
    vllm_video_seconds=None,  # vLLM's M-RoPE for its video is not checked here (its test config: plain rotary)
))
