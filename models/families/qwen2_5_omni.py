"""Qwen2.5-Omni (Qwen2.5-Omni-7B): Qwen2.5-VL's tower with separate q/k/v projections, inside the
thinker: config under `thinker_config.vision_config`, tensors under `thinker.visual.*` (`visual.*` in a
thinker saved alone, model_type `qwen2_5_omni_thinker`). Audio encoder, talker and token2wav weights
are never read. Video embeddings travel to vLLM with their seconds per temporal step."""

from models.families.qwen2_5_vl import QWEN2_5_VL
from models.family import register

QWEN2_5_OMNI = register(QWEN2_5_VL.derive(
    model_type="qwen2_5_omni", title="Qwen2.5-Omni", config_path=("thinker_config", "vision_config"),
    prefixes=("thinker.visual.", "thinker.model.visual."), separate_qkv=True,
    video_second_per_grid=True,  # vLLM's thinker parser keeps it; without it M-RoPE takes 1.0 s per step
    hf_class="Qwen2_5OmniForConditionalGeneration",
))
QWEN2_5_OMNI_THINKER = register(QWEN2_5_OMNI.derive(
    model_type="qwen2_5_omni_thinker", config_path=("vision_config",), prefixes=("visual.", "model.visual."),
    hf_class="Qwen2_5OmniThinkerForConditionalGeneration",
))
