"""Qwen3-Omni (Qwen3-Omni-30B-A3B): Qwen3-VL-MoE's tower with DeepStack inside the thinker (config under
`thinker_config.vision_config`, tensors under `thinker.visual.*`, or `visual.*` in a thinker saved alone),
its mergers named as Qwen2-VL's (`ln_q`, `mlp.0`, `mlp.2`) and the DeepStack ones `merger_list.*`.
Videos are sampled by Qwen2-VL's rules (its processor's video half is Qwen2VLVideoProcessor) and travel to
vLLM with their seconds per temporal step, not Qwen3-VL's timestamps."""

from models.families.qwen3_vl import QWEN3_VL
from models.family import register

QWEN3_OMNI_MOE = register(QWEN3_VL.derive(
    model_type="qwen3_omni_moe", title="Qwen3-Omni-MoE", config_path=("thinker_config", "vision_config"),
    prefixes=("thinker.visual.", "thinker.model.visual."), merger="mlp", deepstack="merger_list",
    video_sampling="qwen2",
    video_timestamps=False, hf_class="Qwen3OmniMoeForConditionalGeneration",
    # vLLM's thinker parser keeps second_per_grid_ts (no timestamps); without it M-RoPE takes 2.0 s per step
    video_second_per_grid=True, vllm_video_seconds=2.0,
))
QWEN3_OMNI_MOE_THINKER = register(QWEN3_OMNI_MOE.derive(
    model_type="qwen3_omni_moe_thinker", config_path=("vision_config",), prefixes=("visual.", "model.visual."),
    hf_class="Qwen3OmniMoeThinkerForConditionalGeneration",
))
