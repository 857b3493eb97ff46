"""Qwen4-Exp (Qwen3.8-Flash-Next): Qwen3.5-MoE's vision tower, config and key layout unchanged (its vision
classes are Qwen3.5-MoE's under another name); the text model's novelties (hyper-connections, n-gram
embeddings, sparse attention) are the LLM's. Images as Qwen2-VL's processor, videos as Qwen3-VL's."""

from models.families.qwen3_5 import QWEN3_5_MOE
from models.family import register

QWEN4_EXP = register(QWEN3_5_MOE.derive(
    model_type="qwen4_exp", title="Qwen4-Exp", hf_class="Qwen4ExpForConditionalGeneration",
))
