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


# HunyuanOCR's and Hy4's vision configs (HunYuanVLVisionConfig's, HYV4VLVisionConfig's defaults) and processors
# (their image processors' defaults: 512x512 to 2048x2048 pixels, CLIP statistics, rows in raster order); Hy4's
# video processor's (a clip budget of 32 Mi pixels, 1 Mi per frame, 0.5 statistics, 2 fps).
HUNYUAN_OCR_VISION = dict(num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, num_attention_heads=16,
                          patch_size=16, spatial_merge_size=2, max_image_size=2048, hidden_act="gelu")
HY4_VISION = dict(num_hidden_layers=40, hidden_size=1536, intermediate_size=6144, num_attention_heads=16,
                  out_hidden_size=6144, patch_size=16, spatial_merge_size=2, max_image_size=2048, hidden_act="gelu")
HUNYUAN_PRE = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 1,
               "size": {"shortest_edge": 512 * 512, "longest_edge": 2048 * 2048}}
HY4_VIDEO_PRE = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 1, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 4096, "longest_edge": 33554432},
                 "max_image_size": {"longest_edge": 1024 * 1024}, "fps": 2, "min_frames": 2, "max_frames": 1024}
# VideoLLaMA3-7B's vision encoder (SigLIP so400m at patch 14) and its processors: images not merged (merge 1,
# sides multiples of 14), videos merged 2x2 (sides multiples of 28, the clip budget shared by its frames).
VIDEOLLAMA3_VISION = dict(num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, num_attention_heads=16,
                          patch_size=14)
VIDEOLLAMA3_PRE = {"patch_size": 14, "merge_size": 1, "temporal_patch_size": 1, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}}
VIDEOLLAMA3_VIDEO_PRE = {**VIDEOLLAMA3_PRE, "merge_size": 2, "fps": 1, "min_frames": 4, "max_frames": 180,
                         "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}}
TINY_HUNYUAN = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, patch_size=16,
                    max_image_size=128)
TINY_HUNYUAN_PRE = {**HUNYUAN_PRE, "size": {"shortest_edge": 64 * 64, "longest_edge": 512 * 512}}
TINY_HY4_VIDEO_PRE = {**HY4_VIDEO_PRE, "size": {"shortest_edge": 4096, "longest_edge": 8 * 256 * 256},
                      "max_image_size": {"longest_edge": 256 * 256}}
TINY_VIDEOLLAMA3 = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        patch_size=14)
TINY_VIDEOLLAMA3_PRE = {**VIDEOLLAMA3_PRE, "size": {"shortest_edge": 56 * 56, "longest_edge": 14 * 14 * 1024}}
TINY_VIDEOLLAMA3_VIDEO_PRE = {**VIDEOLLAMA3_VIDEO_PRE, "size": {"shortest_edge": 28 * 28 * 4,
                                                                "longest_edge": 28 * 28 * 1024}}


@dataclass(frozen=True)
class Preset:
    family: str  # transformers model_type of the full model
    vision: dict[str, Any]  # vision_config kwargs
    preprocessor: dict[str, Any]
    video_preprocessor: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # the text config's sizes a tower reads (its output width), where it does


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
    "random:hunyuan-ocr": Preset("hunyuan_vl", HUNYUAN_OCR_VISION, HUNYUAN_PRE, text={"hidden_size": 3072}),
    "random:hy4": Preset("hy_v4_vl", HY4_VISION, HUNYUAN_PRE, HY4_VIDEO_PRE),
    "random:videollama3-7b": Preset("video_llama_3", VIDEOLLAMA3_VISION, VIDEOLLAMA3_PRE, VIDEOLLAMA3_VIDEO_PRE,
                                    text={"hidden_size": 3584}),
    # 8x8 position tables (128 px / 16 px), so test grids are both larger and smaller than them.
    "tiny-hunyuan-vl": Preset("hunyuan_vl", TINY_HUNYUAN, TINY_HUNYUAN_PRE, text={"hidden_size": 48}),
    "tiny-hy4": Preset("hy_v4_vl", {**TINY_HUNYUAN, "out_hidden_size": 48}, TINY_HUNYUAN_PRE, TINY_HY4_VIDEO_PRE),
    "tiny-videollama3": Preset("video_llama_3", TINY_VIDEOLLAMA3, TINY_VIDEOLLAMA3_PRE, TINY_VIDEOLLAMA3_VIDEO_PRE,
                               text={"hidden_size": 48}),
}

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
    if preset.family == "glm4v_moe":  # a small mixture: the text part is never run, only written
        text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
    if preset.text:  # the text model's width is the tower's output width
        text.update(preset.text)
    if family in ("hunyuan_vl", "hy_v4_vl", "video_llama_3"):
        return _text_and_vision_config(preset, text)
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

def _text_and_vision_config(preset: Preset, text: dict[str, Any]):
    """HunyuanOCR, Hy4 and VideoLLaMA3: their own text models' configs, as small."""
    from transformers import AutoConfig

    text = {k: v for k, v in text.items() if k != "rope_parameters"}
    heads = text["num_attention_heads"]
    if preset.family == "hunyuan_vl":
        text["head_dim"] = text["hidden_size"] // heads
    elif preset.family == "hy_v4_vl":  # a tiny mixture with latent attention: the text part is never run
        text.update(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32,
                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, index_topk=8,
                    index_head_dim=16, index_n_heads=2, hc_mult=2, pad_token_id=None, num_hidden_layers=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    else:
        text["model_type"] = "qwen2"
    return AutoConfig.for_model(preset.family, vision_config=preset.vision, text_config=text)


# What `vitserve bench` runs by default, and the other families' presets it names in its help (`--models`
# takes any `random:` preset above).
BENCH_MODELS = ["random:qwen2-vl-7b", "random:qwen2.5-vl-7b", "random:qwen3-vl-8b", "random:glm-4.1v-9b"]
BENCH_FAMILY_MODELS = ["random:qwen3.5-27b", "random:qwen3-vl-30b-a3b", "random:exaone-4.5-33b",
                       "random:qwen2.5-omni-7b", "random:qwen3-omni-30b-a3b", "random:qwen3.5-35b-a3b"]
