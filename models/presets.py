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
# LFM3-VL: Qwen2-VL's image processor and Qwen3-VL's video processor with its 16-pixel patches.
LFM3_PRE = {**QWEN3_PRE}
LFM3_VIDEO_PRE = {**QWEN3_VIDEO_PRE}
LFM3_VL_VISION = dict(hidden_size=1024, intermediate_size=2560, num_hidden_layers=14, num_attention_heads=16,
                      num_key_value_heads=8, patch_size=16, conv_kernel_size=3)
# dots3-note: single-frame patch rows (temporal_patch_size 1) of 14 pixels.
DOTS3_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 1, "min_pixels": 3136, "max_pixels": 11289600}
DOTS3_VIDEO_PRE = {**DOTS3_PRE, "size": {"shortest_edge": 3136, "longest_edge": 25165824}, "fps": 2}
DOTS3_VISION = dict(hidden_size=1536, intermediate_size=4224, num_hidden_layers=42, num_attention_heads=24,
                    patch_size=14, moe_intermediate_size=2112, adapter_in_dim=1536, adapter_out_dim=5120)


# Kimi-K2.x (transformers' Kimi_K25 processors' defaults) and Muse (MuseGlimmer's processors' defaults).
KIMI_PRE = {"patch_size": 14, "merge_size": 2, "max_patches": 16384, "size": {"max_height": 512, "max_width": 512},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
KIMI_VIDEO_PRE = {**KIMI_PRE, "max_patches": 4096, "temporal_patch_size": 4, "fps": 2}
KIMI_VISION = dict(patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4, num_attention_heads=16,
                   num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, hidden_act="gelu_pytorch_tanh")
TINY_KIMI = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=4,
                 num_hidden_layers=3, hidden_size=64, intermediate_size=96, hidden_act="gelu_pytorch_tanh",
                 out_hidden_size=80)
MUSE_PRE = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "max_image_tokens": 4096,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
MUSE_VIDEO_PRE = {**MUSE_PRE, "max_video_frame_tokens": 144, "num_frames": 96, "fps": 2.0}
MUSE_VISION = dict(patch_size=14, pos_emb_height=32, pos_emb_width=32, num_attention_heads=16, num_hidden_layers=50,
                   hidden_size=1536, intermediate_size=8960, hidden_act="gelu", patch_temporal=2, merge_size=2)
# Three blocks: two in 8x8-patch windows, the last over whole frames.
TINY_MUSE = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, max_position_embeddings=64, num_attention_heads=4,
                 num_hidden_layers=3, hidden_size=64, intermediate_size=96, hidden_act="gelu", patch_temporal=2,
                 merge_size=2, out_hidden_size=80, projector_hidden_size=48)


PADDLEOCR_VL_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                          image_size=384, patch_size=14, spatial_merge_size=2, hidden_act="gelu_pytorch_tanh")
PADDLEOCR_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 1,
                 "size": {"shortest_edge": 384 * 384, "longest_edge": 1536 * 1536}}
COSMOS3_EDGE_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           patch_size=16, num_patches=256, spatial_merge_size=2, hidden_act="gelu_pytorch_tanh")
COSMOS3_EDGE_PRE = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 1, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}}
COSMOS3_EDGE_VIDEO_PRE = {**COSMOS3_EDGE_PRE, "size": {"shortest_edge": 64 * 64, "longest_edge": 24 * 1024 * 1024},
                          "fps": 2, "min_frames": 4, "max_frames": 768}


# ERNIE-4.5-VL: Ernie4_5_VLMoeImageProcessorPil's defaults (one frame per patch row).
ERNIE_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 1,
             "size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 6177}}
# Ernie4_5_VLMoeVideoProcessor's defaults but for the timestamps it draws (presets ship no font).
ERNIE_VIDEO_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "fps": 0, "min_frames": 16,
                   "max_frames": 180, "draw_on_frames": False,
                   "size": {"shortest_edge": 299 * 28 * 28, "longest_edge": 1196 * 28 * 28}}
# `out_hidden_size` of the ERNIE and MiniMax presets is the text width (their projectors' output), and
# MiniMax's `projector_hidden_size` the projector's: both live outside the vision config (see full_config).
ERNIE_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=5120, num_heads=16, patch_size=14,
                       hidden_act="quick_gelu", out_hidden_size=2560)
# MiniMax-M3: MiniMaxM3VLImageProcessor's defaults.
MINIMAX_PRE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
               "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 451584}}
MINIMAX_VIDEO_PRE = {**MINIMAX_PRE, "fps": 1.0, "min_pixels": 4 * 28 * 28, "max_pixels": 768 * 28 * 28,
                     "min_frames": 4, "max_frames": 768}
MINIMAX_M3_VISION = dict(num_hidden_layers=32, hidden_size=1280, intermediate_size=5120, num_attention_heads=16,
                         patch_size=14, temporal_patch_size=2, hidden_act="gelu", out_hidden_size=6144,
                         projector_hidden_size=6144)
# The settings above that are not the vision config's.
OUTSIDE_VISION = ("out_hidden_size", "projector_hidden_size")


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
    # Beside the vision config, where a tower reads from the whole model's config (a projector outside the
    # vision model): the text config's fields that differ from full_config's tiny one (its width is such a
    # tower's output width) and the whole config's own fields.
    text: dict[str, Any] | None = None
    outer: dict[str, Any] | None = None


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
    # Kimi-K2.6's released vision config (transformers' defaults) and its text model's width (DeepSeek-V3's);
    # the tiny one has an 8x8 position table, so test grids are both larger and smaller than it.
    "random:kimi-k2.6": Preset("kimi_k25", {**KIMI_VISION, "out_hidden_size": 7168}, KIMI_PRE, KIMI_VIDEO_PRE),
    "tiny-kimi-k2.5": Preset("kimi_k25", TINY_KIMI, {**KIMI_PRE, "max_patches": 1024},
                             {**KIMI_VIDEO_PRE, "max_patches": 256}),
    # Muse-Glimmer-30B's and Muse-Spark-Open's released vision configs (transformers' defaults), adapter and
    # text widths.
    "random:muse-glimmer-30b": Preset("muse_glimmer", {**MUSE_VISION, "out_hidden_size": 6656,
                                                       "projector_hidden_size": 4096}, MUSE_PRE, MUSE_VIDEO_PRE),
    "random:muse-spark-open": Preset("muse_spark", {**MUSE_VISION, "out_hidden_size": 8192,
                                                    "projector_hidden_size": 4096}, MUSE_PRE, MUSE_VIDEO_PRE),
    "tiny-muse-glimmer": Preset("muse_glimmer", TINY_MUSE, {**MUSE_PRE, "max_image_tokens": 256},
                                {**MUSE_VIDEO_PRE, "max_video_frame_tokens": 64, "num_frames": 16}),
    "tiny-muse-spark": Preset("muse_spark", TINY_MUSE, {**MUSE_PRE, "max_image_tokens": 256},
                              {**MUSE_VIDEO_PRE, "max_video_frame_tokens": 64, "num_frames": 16}),
    # LFM3-VL-2B's vision config (its config class's defaults), projector and language model widths.
    "random:lfm3-vl-2b": Preset(
        "lfm3_vl", LFM3_VL_VISION, LFM3_PRE, LFM3_VIDEO_PRE, text={"hidden_size": 2048},
        outer={"projector_hidden_size": 4096},
    ),
    # Conv, conv, attention, conv: both block kinds, grouped key/value heads, a merged-token width of its own.
    "tiny-lfm3-vl": Preset(
        "lfm3_vl",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             patch_size=16),
        {**LFM3_PRE, "size": {"shortest_edge": 65536, "longest_edge": 1048576}},
        {**LFM3_VIDEO_PRE, "size": {"shortest_edge": 4096, "longest_edge": 4194304}},
        text={"hidden_size": 48}, outer={"projector_hidden_size": 72},
    ),
    # dots3-note's vision config (its config class's defaults: experts in the last 17 of 42 blocks, 4 to 64
    # of them, top-2), merged into the language model's 5120.
    "random:dots3-note": Preset("dots3_note", DOTS3_VISION, DOTS3_PRE, DOTS3_VIDEO_PRE),
    # A dense block, then blocks of 4 and 6 experts with top-2 routing.
    "tiny-dots3-note": Preset(
        "dots3_note",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, patch_size=14,
             moe_intermediate_size=32, adapter_in_dim=64, adapter_out_dim=48, pyramid_num_routed=[-1, 4, 6],
             capacity_factor=2),
        {**DOTS3_PRE, "max_pixels": 1003520},
        {**DOTS3_VIDEO_PRE, "size": {"shortest_edge": 3136, "longest_edge": 4014080}},
    ),
    # PaddleOCR-VL(-1.5): the released vision config (PaddleOCRVisionConfig's defaults) and ERNIE-4.5-0.3B's
    # width; `out_hidden_size` is the language model's (full_config moves it there). The processor's class
    # defaults (CLIP mean and std, 384*384 to 1536*1536 pixels).
    "random:paddleocr-vl": Preset("paddleocr_vl", {**PADDLEOCR_VL_VISION, "out_hidden_size": 1024}, PADDLEOCR_PRE),
    # Cosmos3-Edge: Cosmos3EdgeVisionConfig's and Cosmos3EdgeConfig's defaults, the released sizes.
    "random:cosmos3-edge": Preset(
        "cosmos3_edge", {**COSMOS3_EDGE_VISION, "out_hidden_size": 2048, "projector_hidden_size": 11520},
        COSMOS3_EDGE_PRE, COSMOS3_EDGE_VIDEO_PRE,
    ),
    # 8x8 position tables, so test grids are both larger and smaller than them.
    "tiny-paddleocr-vl": Preset(
        "paddleocr_vl",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=112,
             patch_size=14, out_hidden_size=80),
        {**PADDLEOCR_PRE, "size": {"shortest_edge": 3136, "longest_edge": 401408}},
    ),
    "tiny-cosmos3-edge": Preset(
        "cosmos3_edge",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, patch_size=16,
             num_patches=64, out_hidden_size=80, projector_hidden_size=112),
        {**COSMOS3_EDGE_PRE, "size": {"shortest_edge": 4096, "longest_edge": 524288}},
        {**COSMOS3_EDGE_VIDEO_PRE, "size": {"shortest_edge": 4096, "longest_edge": 2097152}},
    ),
    # ERNIE-4.5-VL-28B-A3B's vision config (the transformers defaults), its text width as the output width.
    "random:ernie-4.5-vl-28b-a3b": Preset("ernie4_5_vl_moe", ERNIE_VL_VISION, ERNIE_PRE, ERNIE_VIDEO_PRE),
    "tiny-ernie4.5-vl-moe": Preset(
        "ernie4_5_vl_moe",
        dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=80),
        {**ERNIE_PRE, "size": {"shortest_edge": 3136, "longest_edge": 1003520}},
        {**ERNIE_VIDEO_PRE, "size": {"shortest_edge": 3136, "longest_edge": 200704}},
    ),
    # MiniMax-M3's vision config (the transformers defaults), its projector and text widths.
    "random:minimax-m3": Preset("minimax_m3_vl", MINIMAX_M3_VISION, MINIMAX_PRE, MINIMAX_VIDEO_PRE),
    "tiny-minimax-m3": Preset(
        "minimax_m3_vl",
        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             out_hidden_size=80, projector_hidden_size=48),
        {**MINIMAX_PRE, "size": {"shortest_edge": 3136, "longest_edge": 1003520}},
        {**MINIMAX_VIDEO_PRE, "max_pixels": 200704},
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
}

DEFAULT_MODEL = "tiny-qwen2-vl"


def full_config(preset: Preset):
    """A transformers config of the whole model (with a tiny text part, and a tiny audio part for the
    Omni models, which are built without their talker) holding the vision config."""
    from transformers import AutoConfig

    if preset.family in ("kimi_k25", "muse_glimmer", "muse_spark"):
        return kimi_muse_config(preset)
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
    if preset.family == "glm4v_moe":  # a small mixture: the text part is never run, only written
        text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
    if family == "lfm3_vl":  # LFM3's text config: no M-RoPE; its padding token id is beyond this vocabulary
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=None)
    if family == "dots3_note":
        return dots3_config(preset)
    text.update(preset.text or {})
    if family in ("paddleocr_vl", "cosmos3_edge"):  # the projector's widths live outside the vision config
        vision = dict(preset.vision)
        text["hidden_size"] = vision.pop("out_hidden_size")
        top = {k: vision.pop(k) for k in ("projector_hidden_size",) if k in vision}
        if family == "cosmos3_edge":  # its text config checks that M-RoPE covers half the head
            text.update(head_dim=16, rope_parameters={**rope, "mrope_section": [4, 2, 2]})
        return AutoConfig.for_model(preset.family, vision_config=vision, text_config=text, bos_token_id=None,
                                    eos_token_id=None, **top)
    if family in ("ernie4_5_vl_moe", "minimax_m3_vl"):
        return _projected_config(preset, text)
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
        preset.family, vision_config=preset.vision, text_config=text, bos_token_id=None, eos_token_id=None,
        **(preset.outer or {}),
    )

def kimi_muse_config(preset: Preset):
    """Kimi-K2.x and Muse: the projector's sizes live in the whole model's config, so the preset's vision dict
    carries the text width (`out_hidden_size`) and Muse's adapter width (`projector_hidden_size`); the text
    model (and Muse-Spark's audio encoder) is tiny."""
    from transformers import AutoConfig

    vision = dict(preset.vision)
    out = vision.pop("out_hidden_size")
    common = dict(hidden_size=out, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=256,
                  bos_token_id=None, eos_token_id=None)
    if preset.family == "kimi_k25":
        text = dict(model_type="deepseek_v3", **common, num_key_value_heads=4, moe_intermediate_size=16,
                    n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None,
                    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        return AutoConfig.for_model("kimi_k25", vision_config=vision, text_config=text,
                                    projection_hidden_size=vision["hidden_size"])
    projector = vision.pop("projector_hidden_size")
    text = dict(**common, num_key_value_heads=2, head_dim=16, pad_token_id=None)
    extra: dict[str, Any] = {}
    if preset.family == "muse_spark":
        text.update(moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=32)
        extra["audio_config"] = dict(patch_sizes=[4, 2], hidden_sizes=[16, 32], depths=[1, 1], num_hidden_layers=2,
                                     out_hidden_size=out)
    merge = vision.get("merge_size", 2)
    return AutoConfig.for_model(preset.family, vision_config=vision, text_config=text, projector_hidden_size=projector,
                                out_hidden_size=vision["hidden_size"] * merge * merge, **extra)


def dots3_config(preset: Preset):
    """dots3-note's whole config: a tiny text model of its own kind (latent attention, routed experts) and a
    tiny audio encoder, both as wide as the vision adapter's output, as the config requires."""
    from transformers import AutoConfig

    width = preset.vision.get("adapter_out_dim", 5120)
    text = dict(hidden_size=width, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=256, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_experts_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8, head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
                use_sliding_window=False, **{k: v for k, v in (preset.text or {}).items() if k != "hidden_size"})
    audio = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, feature_size=16,
                 downsample_hidden_size=8, adapter_input_size=32, adapter_out_dim=width)
    return AutoConfig.for_model(preset.family, vision_config=preset.vision, text_config=text, audio_config=audio,
                                **(preset.outer or {}))


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
BENCH_FAMILY_MODELS += ["random:paddleocr-vl", "random:cosmos3-edge"]
BENCH_FAMILY_MODELS += ["random:qwen3.8-flash-next", "random:cosmos3-nano", "random:hyperclovax-seed-think-32b",
                        "random:glm-5.3-flash"]


def _projected_config(preset: Preset, text: dict[str, Any]):
    """ERNIE-4.5-VL's and MiniMax-M3's whole config: their tower's output width is the text model's width, so
    the tiny text part takes the preset's `out_hidden_size` (and MiniMax's projector its hidden size)."""
    from transformers import AutoConfig

    vision = {k: v for k, v in preset.vision.items() if k not in OUTSIDE_VISION}
    width = preset.vision["out_hidden_size"]
    text = {**text, "hidden_size": width}
    half = width // text["num_attention_heads"] // 2  # rotary frequencies per head
    if preset.family == "ernie4_5_vl_moe":
        t = half // 4
        text.update(moe_num_experts=2, moe_k=1, moe_intermediate_size=[32, 32], moe_num_shared_experts=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [(half - t) // 2, half - t - (half - t) // 2, t]})
        return AutoConfig.for_model(preset.family, vision_config=vision, text_config=text)
    text.update(num_local_experts=2, num_experts_per_tok=1, head_dim=16, rotary_dim=8, dense_intermediate_size=64,
                shared_intermediate_size=32, index_head_dim=16)
    text.pop("rope_parameters", None)
    return AutoConfig.for_model(preset.family, vision_config=vision, text_config=text,
                                projector_hidden_size=preset.vision["projector_hidden_size"])
