"""Built-in models that need no download.

`random:*` are the released vision configs at full size with seeded random weights (benchmarks);
`tiny-*` are small configs for tests and the embedded default. Their weights are random: the
embeddings mean nothing, and the loader says so loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN2_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 12845056}
QWEN3_PRE = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
QWEN3_VIDEO_PRE = {**QWEN3_PRE, "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2}
# GLM-4.1V-9B-Thinking's released processor configs: bounds on T*H*W, CLIP mean and std (the defaults).
GLM_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
           "size": {"shortest_edge": 12544, "longest_edge": 9633792}}
GLM_VIDEO_PRE = {**GLM_PRE, "size": {"shortest_edge": 12544, "longest_edge": 47040000}, "fps": 2}
# GLM-4.1V-9B-Thinking's vision_config (GLM-4.5V's is the same).
GLM41V_VISION = dict(depth=24, hidden_size=1536, intermediate_size=13696, out_hidden_size=4096, num_heads=12,
                     patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2,
                     rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False)


@dataclass(frozen=True)
class Preset:
    family: str  # transformers model_type of the full model
    vision: dict[str, Any]  # vision_config kwargs
    preprocessor: dict[str, Any]
    video_preprocessor: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # text_config settings over full_config's tiny ones (e.g. its width)


# Released vision configs (config.json's vision_config) by family.
QWEN2_5_VL_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=3584, num_heads=16,
                     patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")
QWEN3_VL_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                       num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
DEEPSTACK = dict(deepstack_visual_indexes=[8, 16, 24])
TINY_QWEN2_5 = dict(depth=3, hidden_size=64, intermediate_size=96, out_hidden_size=80, num_heads=4, patch_size=14,
                    window_size=112, fullatt_block_indexes=[1], hidden_act="silu")
TINY_QWEN3 = dict(depth=3, hidden_size=64, intermediate_size=96, out_hidden_size=80, num_heads=4, patch_size=16,
                  num_position_embeddings=64)
TINY_QWEN2_PRE = {**QWEN2_PRE, "max_pixels": 1003520}
TINY_QWEN3_PRE = {**QWEN3_PRE, "size": {"shortest_edge": 65536, "longest_edge": 1048576}}
TINY_QWEN3_VIDEO_PRE = {**QWEN3_VIDEO_PRE, "size": {"shortest_edge": 4096, "longest_edge": 4194304}}

PRESETS: dict[str, Preset] = {
    "random:qwen2-vl-7b": Preset(
        "qwen2_vl",
        dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, num_heads=16, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2),
        QWEN2_PRE,
    ),
    "random:qwen2.5-vl-7b": Preset("qwen2_5_vl", QWEN2_5_VL_7B, QWEN2_PRE),
    "random:qwen3-vl-8b": Preset(
        "qwen3_vl", {**QWEN3_VL_VISION, **DEEPSTACK, "out_hidden_size": 4096}, QWEN3_PRE, QWEN3_VIDEO_PRE
    ),
    "random:qwen3-vl-30b-a3b": Preset(
        "qwen3_vl_moe", {**QWEN3_VL_VISION, **DEEPSTACK, "out_hidden_size": 2048}, QWEN3_PRE, QWEN3_VIDEO_PRE
    ),
    "random:qwen3.5-27b": Preset("qwen3_5", {**QWEN3_VL_VISION, "out_hidden_size": 5120}, QWEN3_PRE, QWEN3_VIDEO_PRE),
    "random:qwen3.5-35b-a3b": Preset(
        "qwen3_5_moe", {**QWEN3_VL_VISION, "out_hidden_size": 2048}, QWEN3_PRE, QWEN3_VIDEO_PRE
    ),
    "random:qwen2.5-omni-7b": Preset("qwen2_5_omni", QWEN2_5_VL_7B, QWEN2_PRE),
    "random:qwen3-omni-30b-a3b": Preset(
        "qwen3_omni_moe", {**QWEN3_VL_VISION, **DEEPSTACK, "out_hidden_size": 2048}, QWEN3_PRE
    ),
    "random:exaone-4.5-33b": Preset(
        "exaone4_5",
        dict(depth=28, hidden_size=2048, intermediate_size=5120, out_hidden_size=5120, num_heads=32,
             num_key_value_heads=8, patch_size=14, window_size=112, fullatt_block_indexes=[6, 13, 20, 27],
             hidden_act="silu"),
        QWEN2_PRE,
    ),
    "random:glm-4.1v-9b": Preset("glm4v", GLM41V_VISION, GLM_PRE, GLM_VIDEO_PRE),
    "tiny-qwen2-vl": Preset(
        "qwen2_vl",
        dict(depth=2, embed_dim=64, hidden_size=96, mlp_ratio=2, num_heads=4, patch_size=14),
        TINY_QWEN2_PRE,
    ),
    "tiny-qwen2.5-vl": Preset("qwen2_5_vl", TINY_QWEN2_5, TINY_QWEN2_PRE),
    "tiny-qwen3-vl": Preset(
        "qwen3_vl", {**TINY_QWEN3, "deepstack_visual_indexes": [0, 2]}, TINY_QWEN3_PRE, TINY_QWEN3_VIDEO_PRE
    ),
    "tiny-qwen3-vl-moe": Preset(
        "qwen3_vl_moe", {**TINY_QWEN3, "deepstack_visual_indexes": [1]}, TINY_QWEN3_PRE, TINY_QWEN3_VIDEO_PRE
    ),
    "tiny-qwen3.5": Preset("qwen3_5", TINY_QWEN3, TINY_QWEN3_PRE, TINY_QWEN3_VIDEO_PRE),
    "tiny-qwen3.5-moe": Preset("qwen3_5_moe", TINY_QWEN3, TINY_QWEN3_PRE, TINY_QWEN3_VIDEO_PRE),
    "tiny-qwen2.5-omni": Preset("qwen2_5_omni", TINY_QWEN2_5, TINY_QWEN2_PRE),
    "tiny-qwen3-omni-moe": Preset(
        "qwen3_omni_moe", {**TINY_QWEN3, "deepstack_visual_indexes": [0, 2]}, TINY_QWEN3_PRE
    ),
    "tiny-exaone4.5": Preset("exaone4_5", {**TINY_QWEN2_5, "num_key_value_heads": 2}, TINY_QWEN2_PRE),
    "tiny-cohere-compass": Preset(
        "cohere_compass", {**TINY_QWEN3, "deepstack_visual_indexes": [1, 2]}, TINY_QWEN3_PRE
    ),
    # An 8x8 position table, so test grids are both larger and smaller than it.
    "tiny-glm4v": Preset(
        "glm4v",
        dict(depth=3, hidden_size=64, intermediate_size=96, out_hidden_size=80, num_heads=4, patch_size=14,
             image_size=112),
        {**GLM_PRE, "size": {"shortest_edge": 12544, "longest_edge": 2007040}},
        {**GLM_VIDEO_PRE, "size": {"shortest_edge": 12544, "longest_edge": 8028160}},
    ),
    "tiny-glm4v-moe": Preset(
        "glm4v_moe",
        dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=80, num_heads=4, patch_size=14,
             image_size=112),
        {**GLM_PRE, "size": {"shortest_edge": 12544, "longest_edge": 2007040}},
        {**GLM_VIDEO_PRE, "size": {"shortest_edge": 12544, "longest_edge": 8028160}},
    ),
    "tiny-glm46v": Preset(
        "glm46v",
        dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=80, num_heads=4, patch_size=14,
             image_size=112),
        {**GLM_PRE, "size": {"shortest_edge": 12544, "longest_edge": 2007040}},
        {**GLM_VIDEO_PRE, "size": {"shortest_edge": 12544, "longest_edge": 8028160}},
    ),
    "tiny-glm-ocr": Preset(
        "glm_ocr",
        dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=48, num_heads=4, patch_size=14,
             attention_bias=True),
        {**GLM_PRE, "size": {"shortest_edge": 12544, "longest_edge": 2007040}},
        {**GLM_VIDEO_PRE, "size": {"shortest_edge": 12544, "longest_edge": 8028160}},
    ),
}

# GLM-5.3-Flash: Glm5NextVisionConfig's defaults; its processors' token bounds (images 16-8000 tokens, videos
# 16-240000 over the clip) and frame sampling (2 fps, at most 2048 frames).
GLM5_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=1536, num_heads=16,
                   patch_size=14, image_size=336, projection_intermediate_size=10240, swiglu_limit=10.0,
                   attention_bias=True, hidden_act="silu")
GLM5_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_image_tokens": 16,
            "max_image_tokens": 8000}
GLM5_VIDEO_PRE = {**GLM5_PRE, "max_image_tokens": 240000, "fps": 2, "max_frames": 2048}
# GlmgaVideoProcessor's defaults: 2 fps, at most 640 frames, up to 28*28*2*55790 pixels over the clip.
GLMGA_VIDEO_PRE = {**GLM_VIDEO_PRE, "size": {"shortest_edge": 12544, "longest_edge": 28 * 28 * 2 * 55790},
                   "max_frames": 640}
TINY_GLM = dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=80, num_heads=4, patch_size=14,
                image_size=112)
TINY_GLM_PRE = {**GLM_PRE, "size": {"shortest_edge": 12544, "longest_edge": 2007040}}

PRESETS.update({
    # Qwen3.8-Flash-Next: Qwen3.5-MoE's vision config, merging to its language model's 2048.
    "random:qwen3.8-flash-next": Preset(
        "qwen4_exp", {**QWEN3_VL_VISION, "out_hidden_size": 2048}, QWEN3_PRE, QWEN3_VIDEO_PRE
    ),
    # Cosmos3-Nano: Qwen3-VL's vision config (transformers' defaults for it) with DeepStack, at the width of its
    # Qwen3-VL language model (4096).
    "random:cosmos3-nano": Preset(
        "cosmos3_omni", {**QWEN3_VL_VISION, **DEEPSTACK, "out_hidden_size": 4096}, QWEN3_PRE, QWEN3_VIDEO_PRE
    ),
    # HyperCLOVAX-SEED-Think-32B: a Qwen2.5-VL ViT (Qwen2.5-VL-7B's size) and its projection to the 32B language
    # model's width (5120).
    "random:hyperclovax-seed-think-32b": Preset("hyperclovax_vision_v2", QWEN2_5_VL_7B, QWEN2_PRE,
                                                text={"hidden_size": 5120}),
    "random:glm-5.3-flash": Preset("glm5_next", GLM5_VISION, GLM5_PRE, GLM5_VIDEO_PRE),
    "tiny-qwen4-exp": Preset("qwen4_exp", TINY_QWEN3, TINY_QWEN3_PRE, TINY_QWEN3_VIDEO_PRE),
    "tiny-cosmos3-omni": Preset(
        "cosmos3_omni", {**TINY_QWEN3, "deepstack_visual_indexes": [0, 2]}, TINY_QWEN3_PRE, TINY_QWEN3_VIDEO_PRE
    ),
    "tiny-glmga": Preset("glmga", TINY_GLM, TINY_GLM_PRE, {**GLMGA_VIDEO_PRE, "size": {"shortest_edge": 12544,
                                                                                        "longest_edge": 8028160}}),
    # The projection (80 -> 64, full_config's text width) after Qwen2.5-VL's tiny tower.
    "tiny-hyperclovax-vision-v2": Preset("hyperclovax_vision_v2", TINY_QWEN2_5, TINY_QWEN2_PRE),
    # A clamp at 0.1: the tiny random weights' SwiGLU inputs reach past it, in the blocks and in the merger.
    "tiny-glm5-next": Preset(
        "glm5_next",
        dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=48, num_heads=4, patch_size=14,
             attention_bias=True, projection_intermediate_size=72, swiglu_limit=0.1),
        {**GLM5_PRE, "max_image_tokens": 1280},
        {**GLM5_VIDEO_PRE, "max_image_tokens": 5120},
    ),
})

DEFAULT_MODEL = "tiny-qwen2-vl"


def full_config(preset: Preset):
    """A transformers config of the whole model (with a tiny text part, and a tiny audio part for the
    Omni models, which are built without their talker) holding the vision config."""
    from transformers import AutoConfig

    family = preset.family.removesuffix("_thinker")
    text: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, bos_token_id=None, eos_token_id=None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if family.startswith("qwen3") or family == "cohere_compass":
        text["head_dim"] = 16
        rope["mrope_interleaved"] = True
    if family.startswith("qwen") and family.endswith("moe"):
        text.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family.startswith("qwen3_5"):
        text["layer_types"] = ["full_attention"]
    if family == "cohere_compass":  # rope parameters per layer type
        text.update(layer_types=["full_attention"], rope_parameters={"full_attention": rope})
    elif family == "exaone4_5":
        text.update(model_type="exaone4", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        text["rope_parameters"] = rope
    if family in ("qwen4_exp", "cosmos3_omni"):  # Qwen3.5-MoE's and Qwen3-VL's text models
        text["head_dim"] = 16
        text["rope_parameters"] = {**rope, "mrope_interleaved": True}
    if family == "qwen4_exp":  # linear attention only (its other layers need the sparse indexer's settings)
        text.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    layer_types=["linear_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
                    linear_key_head_dim=16, linear_value_head_dim=16, hc_lowrank=8)
    if family == "glm5_next":  # one linear-attention layer, a dense MLP, small hyper-connections
        text.update(num_key_value_heads=4, pad_token_id=None, moe_intermediate_size=32, n_routed_experts=4,
                    num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, v_head_dim=16, qk_nope_head_dim=16,
                    index_topk=16, index_kpool=4, index_head_dim=16, index_n_heads=2, linear_head_dim=16,
                    linear_num_heads=4, hc_mult=2)
    if family in ("hyperclovax_vision_v2", "glm5_next"):  # plain rotary: no M-RoPE sections
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    text.update(preset.text or {})
    if preset.family == "glm4v_moe":  # a small mixture: the text part is never run, only written
        text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
    if family in ("qwen2_5_omni", "qwen3_omni_moe"):
        audio = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                     output_dim=64, n_window=4, max_source_positions=64)
        thinker = dict(vision_config=preset.vision, text_config=text, audio_config=audio)
        if preset.family.endswith("_thinker"):
            return AutoConfig.for_model(preset.family, **thinker)
        return AutoConfig.for_model(family, enable_audio_output=False, thinker_config=thinker)
    return AutoConfig.for_model(
        preset.family, vision_config=preset.vision, text_config=text, bos_token_id=None, eos_token_id=None
    )

# What `vitserve bench` runs by default, and the other families' presets it names in its help (`--models`
# takes any `random:` preset above).
BENCH_MODELS = ["random:qwen2-vl-7b", "random:qwen2.5-vl-7b", "random:qwen3-vl-8b", "random:glm-4.1v-9b"]
BENCH_FAMILY_MODELS = ["random:qwen3.5-27b", "random:qwen3-vl-30b-a3b", "random:exaone-4.5-33b",
                       "random:qwen2.5-omni-7b", "random:qwen3-omni-30b-a3b", "random:qwen3.5-35b-a3b"]
BENCH_FAMILY_MODELS += ["random:qwen3.8-flash-next", "random:cosmos3-nano", "random:hyperclovax-seed-think-32b",
                        "random:glm-5.3-flash"]
