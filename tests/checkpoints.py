"""Small real checkpoints written by transformers, for parity and loader tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.families import FAMILIES
from models.presets import PRESETS, full_config

CLASSES = {name: family.hf_class for name, family in FAMILIES.items()}


def visual_of(model):
    """transformers' vision model inside a whole model (the Omni models keep it in their thinker)."""
    from service.bench.towers import vision_module

    return vision_module(model)


def reference_model(preset_name: str, seed: int = 0):
    """transformers' full model for a tiny preset, fp32, seeded random weights, sdpa attention (or the family's
    where it has no sdpa)."""
    import transformers

    from service.bench.towers import REFERENCE_ATTENTION

    preset = PRESETS[preset_name]
    cfg = full_config(preset)
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[preset.family])
    attention = REFERENCE_ATTENTION.get(preset.family, "sdpa")
    model = cls._from_config(cfg, dtype=torch.float32, attn_implementation=attention)
    # Non-trivial norms and biases, so a wrong wiring cannot hide behind ones and zeros.
    with torch.no_grad():
        for p in visual_of(model).parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def reference_features(model, pixels: torch.Tensor, grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' vision model on normalised patch rows: merged tokens and DeepStack features."""
    with torch.no_grad():
        out = visual_of(model)(pixels, grid_thw=torch.tensor(grids))
    if isinstance(out, tuple):
        return out[0], list(out[1]) if len(out) > 1 else []
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def checkpoint_vision_shapes(model, family: str, renamed: bool = True) -> dict[str, tuple[int, ...]]:
    """The vision tensors of transformers' `model` as the loader reads them from what its save_pretrained writes:
    names without the family's prefixes, shapes. `renamed=False`: the model's own names, before transformers'
    renames on saving."""
    from transformers.core_model_loading import revert_weight_conversion

    from models.loader import tower_name

    state = model.state_dict()
    if renamed:
        state = revert_weight_conversion(model, state)
    spec = FAMILIES[family]
    out = {}
    for key, tensor in state.items():
        name = tower_name(key, spec.prefixes, spec.renames)
        if name is not None:
            out[name] = tuple(tensor.shape)
    return out


def write_checkpoint(preset_name: str, folder: Path, seed: int = 0, max_shard_size: str | None = None):
    """save_pretrained of the ForConditionalGeneration class plus its preprocessor config."""
    model = reference_model(preset_name, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    preset = PRESETS[preset_name]
    (folder / "preprocessor_config.json").write_text(json.dumps(preset.preprocessor))
    if preset.video_preprocessor:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(preset.video_preprocessor))
    return model


# ---- what vLLM needs to parse and process requests for a tiny preset ---------------------------------
VLLM_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>", "<vision>", "</vision>", "<|VISION_START|>",
                       "<|VISION_END|>", "<|IMAGE_PAD|>", "<|VIDEO_PAD|>"]
# The architecture vLLM registers a family's model under, where it is not transformers' class name (the name the
# releases' config.json carries)
VLLM_ARCHITECTURES = {"cosmos3_omni": "Cosmos3ForConditionalGeneration"}
# (vision start, vision end, image pad, video pad) in each family's prompts, where not Qwen's
VLLM_MEDIA_TOKENS = {"exaone4_5": ("<vision>", "</vision>", "<|image_pad|>", "<|video_pad|>"),
                     "cohere_compass": ("<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>", "<|VIDEO_PAD|>"),
                     "qwen2_5_omni": ("<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>")}
# The Omni processors read their media tokens from the tokenizer's named special tokens (vLLM sizes
# placeholders by `processor.image_token` / `video_token`), audio ones included: the released names.
VLLM_OMNI_TOKENS = {
    "qwen2_5_omni": {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                     "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                     "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"},
    "qwen3_omni_moe": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
                       "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                       "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"},
}
VLLM_SPECIAL_TOKENS += sorted({t for named in VLLM_OMNI_TOKENS.values() for t in named.values()}
                              - set(VLLM_SPECIAL_TOKENS))
# The Qwen-VL chat layout reduced to what placeholders need: media parts become vision_start, one pad
# token, vision_end; vLLM's processor expands the pad to the item's tokens.
VLLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(folder: Path, special: list[str], config: dict) -> dict[str, int]:
    """A byte-level tokenizer (256 byte tokens, then `special`) and its config; the special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192, **config}))
    return {t: tok.token_to_id(t) for t in special}


# GLM's special tokens (the placeholders its processors, vLLM's and SGLang's look for), a chat layout reduced to
# them, and its tokenizer's settings.
GLM_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|begin_of_image|>", "<|image|>",
              "<|end_of_image|>", "<|begin_of_video|>", "<|video|>", "<|end_of_video|>"]
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>{% endif %}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GLM_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "pad_token": "<|endoftext|>", "chat_template": GLM_CHAT_TEMPLATE}


def write_vllm_model_folder(preset_name: str, folder: Path) -> Path:
    """A checkpoint folder vLLM's config, tokenizer and multimodal processor load without a hub: the full
    model's config (text hidden size = the tower's output size, as in the released models, so vLLM's
    embedding checks and Qwen3-VL's DeepStack split apply), the preprocessor configs, and a byte-level
    tokenizer (256 byte tokens plus the Qwen-VL special tokens) with a chat template. No weights: vLLM
    builds its model with dummy ones.

    The Omni models' thinker processor in vLLM loads an audio feature extractor too (its data parser reads the
    extractor's sampling rate) and takes its media tokens from the tokenizer's named special tokens: their
    folder adds those (`write_omni_processor`, `VLLM_OMNI_TOKENS`), and their config is the whole model's
    whose thinker holds the tower, the tiny text model and a tiny audio encoder."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[preset_name]
    omni = VLLM_OMNI_TOKENS.get(preset.family)
    start, end, image_pad, video_pad = VLLM_MEDIA_TOKENS.get(
        preset.family, ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))
    template = (VLLM_CHAT_TEMPLATE.replace("<|vision_start|>", start).replace("<|vision_end|>", end)
                .replace("<|image_pad|>", image_pad).replace("<|video_pad|>", video_pad))
    tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                        "chat_template": template}
    if omni:
        tokenizer_config["extra_special_tokens"] = omni
    ids = byte_tokenizer(folder, VLLM_SPECIAL_TOKENS, tokenizer_config)

    out_hidden = preset.vision.get("out_hidden_size", preset.vision.get("hidden_size"))
    text: dict = dict(hidden_size=out_hidden, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192,
                      bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    qwen3 = preset.family.startswith("qwen3") or preset.family in ("cohere_compass", "qwen4_exp", "cosmos3_omni")
    head_dim = 16 if qwen3 else out_hidden // text["num_attention_heads"]
    half = head_dim // 2  # vLLM's M-RoPE wants the sections to cover half the head
    rope: dict = {"rope_type": "default", "rope_theta": 10000.0,
                  "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    if qwen3:
        text["head_dim"] = head_dim
        rope["mrope_interleaved"] = True
    if preset.family.endswith("moe"):
        text.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if preset.family.startswith("qwen3_5"):
        text["layer_types"] = ["full_attention"]
    text["rope_parameters"] = rope
    if preset.family == "exaone4_5":  # EXAONE 4's text model: plain rotary, no M-RoPE
        text.update(model_type="exaone4", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if preset.family == "cohere_compass":  # rotary parameters per layer type
        text.update(layer_types=["full_attention"], rope_parameters={"full_attention": rope})
    top: dict = {}
    vision = preset.vision
    if preset.family in ("cosmos3_edge", "paddleocr_vl"):  # the projector's widths sit beside the vision config
        text["head_dim"] = head_dim  # Cosmos3-Edge's text config checks its M-RoPE sections against it
        vision = dict(preset.vision)
        vision.pop("out_hidden_size")
        top = {k: vision.pop(k) for k in ("projector_hidden_size",) if k in vision}
    media = dict(image_token_id=ids[image_pad], video_token_id=ids[video_pad],
                 vision_start_token_id=ids[start], vision_end_token_id=ids[end])
    if omni:
        audio = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80,
                     output_dim=out_hidden, n_window=4, max_source_positions=64)
        vision = dict(preset.vision)
        rate: dict = {}
        if preset.family == "qwen3_omni_moe":  # read by vLLM's tower, kept in the released config.json
            side = int(vision["num_position_embeddings"] ** 0.5)
            vision.update(image_size=side * vision["patch_size"], apply_vit_abs_pos_embed=True)
            rate["position_id_per_seconds"] = OMNI_POSITIONS_PER_SECOND[preset.family]
        else:
            vision["tokens_per_second"] = OMNI_POSITIONS_PER_SECOND[preset.family]
        thinker = dict(vision_config=vision, text_config=text, audio_config=audio, **rate,
                       audio_token_id=ids[omni["audio_token"]], audio_start_token_id=ids[omni["audio_bos_token"]],
                       audio_end_token_id=ids[omni["audio_eos_token"]], **media)
        if preset.family == "qwen2_5_omni":  # its thinker config keeps the *_token_index names
            thinker.update({f"{k}_token_index": thinker.pop(f"{k}_token_id") for k in ("image", "video", "audio")})
        cfg = AutoConfig.for_model(preset.family, enable_audio_output=False, thinker_config=thinker,
                                   im_end_token_id=ids["<|im_end|>"])
    else:
        cfg = AutoConfig.for_model(preset.family, vision_config=vision, text_config=text,
                                   bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], **media, **top)
    if preset.family == "cohere_compass":
        cfg.tie_word_embeddings = True  # as released; vLLM's model asserts it
    cfg.architectures = [VLLM_ARCHITECTURES.get(preset.family, CLASSES[preset.family])]
    cfg.save_pretrained(folder)
    if omni:
        write_omni_processor(preset, folder)
        return folder
    # the processor classes named as the releases name them (not every model_type is in the auto maps)
    image = {"image_processor_type": FAMILIES[preset.family].image_processor, **preset.preprocessor}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    if preset.video_preprocessor:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(preset.video_preprocessor))
    return folder


# M-RoPE positions per second of video in the Omni thinkers' configs (Qwen2.5-Omni: the vision config's
# `tokens_per_second`; Qwen3-Omni: the thinker's `position_id_per_seconds`), written explicitly so that tests
# know how far apart vLLM places temporal steps of known seconds.
OMNI_POSITIONS_PER_SECOND = {"qwen2_5_omni": 25, "qwen3_omni_moe": 13}
OMNI_PROCESSORS = {"qwen2_5_omni": "Qwen2_5OmniProcessor", "qwen3_omni_moe": "Qwen3OmniMoeProcessor"}


def write_omni_processor(preset, folder: Path) -> None:
    """The Omni processors' files as the releases ship them: one preprocessor_config.json holding the image
    processor's settings and the audio feature extractor's (transformers' WhisperFeatureExtractor with its
    default arguments), and the video processor's (Qwen2-VL's in both releases) beside it."""
    from transformers import WhisperFeatureExtractor

    processor = OMNI_PROCESSORS[preset.family]
    audio = WhisperFeatureExtractor().to_dict()
    image = {"image_processor_type": FAMILIES[preset.family].image_processor, **preset.preprocessor}
    video = {"video_processor_type": "Qwen2VLVideoProcessor", **(preset.video_preprocessor or preset.preprocessor)}
    (folder / "preprocessor_config.json").write_text(json.dumps({**audio, **image, "processor_class": processor}))
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**video, "processor_class": processor}))


# ---- the folders SGLang's language side loads, where vLLM's above does not fit the model -------------
def write_glm5_next_folder(preset_name: str, folder: Path) -> Path:
    """GLM-5-Next's folder for SGLang's language side: the whole model's config (its tiny text model as wide as
    the tower's output, GLM's media token ids), a byte-level tokenizer with GLM's special tokens, and the
    Glm5Next image and video processors' configs that `Glm5NextProcessor` loads."""
    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[preset_name]
    ids = byte_tokenizer(folder, GLM_TOKENS, GLM_TOKENIZER_CONFIG)
    cfg = full_config(preset)
    cfg.text_config.hidden_size = preset.vision["out_hidden_size"]
    cfg.text_config.vocab_size = 512
    cfg.text_config.eos_token_id = cfg.eos_token_id = ids["<|endoftext|>"]
    cfg.image_token_id, cfg.video_token_id = ids["<|image|>"], ids["<|video|>"]
    cfg.image_start_token_id, cfg.image_end_token_id = ids["<|begin_of_image|>"], ids["<|end_of_image|>"]
    cfg.video_start_token_id, cfg.video_end_token_id = ids["<|begin_of_video|>"], ids["<|end_of_video|>"]
    cfg.architectures = [CLASSES[preset.family]]
    cfg.save_pretrained(folder)
    # Without the sparse indexer's top-k, which transformers' config always writes: SGLang's argument resolution
    # for a model with one (DSA) reads the CUDA device's capability, which fails on the CPU. Its receiving code
    # and GLM's processor never read the text model's attention.
    written = json.loads((folder / "config.json").read_text())
    del written["text_config"]["index_topk"]
    (folder / "config.json").write_text(json.dumps(written, indent=2))
    write_glm5_processor_configs(folder, preset)
    return folder


def write_glm5_processor_configs(folder: Path, preset) -> None:
    """GLM-5.3-Flash's image and video processor configs, naming transformers' classes as its release does."""
    image = {**preset.preprocessor, "image_processor_type": "Glm5NextImageProcessor",
             "processor_class": "Glm5NextProcessor"}
    video = {**preset.video_preprocessor, "video_processor_type": "Glm5NextVideoProcessor",
             "processor_class": "Glm5NextProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))


# ---- what SGLang's language side needs for MiniMax-M3 -----------------------------------------------
# MiniMax-M3's media tokens, as its processors name them: the item markers (a prompt holds them bare), and the
# brackets the processors write around each image and each frame of a video
MINIMAX_TOKENS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]


def write_minimax_folder(preset_name: str, folder: Path) -> Path:
    """MiniMax-M3's folder as SGLang's language side loads it: the whole model's config (transformers', the
    tower's output width as the tiny text model's, the media token ids of the tokenizer), a byte-level tokenizer
    with MiniMax's media tokens, and the released preprocessor_config.json's layout, which SGLang's processor
    (`_get_minimax_m31_processor`) reads: its patch and merge sizes under `img_token_compression_config` and a
    `size` of [height, width] (the released [672, 672]; SGLang's own resizing reads it, the placeholders of
    an encoder's rows do not)."""
    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[preset_name]
    image, video = MINIMAX_TOKENS[:2]
    template = (VLLM_CHAT_TEMPLATE.replace("<|vision_start|>", "").replace("<|vision_end|>", "")
                .replace("<|image_pad|>", image).replace("<|video_pad|>", video))
    ids = byte_tokenizer(folder, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *MINIMAX_TOKENS], {
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "chat_template": template})
    cfg = full_config(preset)
    cfg.image_token_index, cfg.video_token_index = ids[image], ids[video]
    cfg.text_config.vocab_size = 512
    cfg.text_config.bos_token_id, cfg.text_config.eos_token_id = ids["<|endoftext|>"], ids["<|im_end|>"]
    cfg.architectures = [CLASSES[preset.family]]
    cfg.save_pretrained(folder)
    image_config = {k: v for k, v in preset.preprocessor.items() if k != "size"}
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": FAMILIES[preset.family].image_processor, **image_config, "size": [672, 672],
        "img_token_compression_config": {"spatial_merge_size": preset.preprocessor["merge_size"],
                                         "temporal_patch_size": preset.preprocessor["temporal_patch_size"]}}))
    return folder


# ---- what SGLang's language side needs for Muse-Spark-Open ------------------------------------------
# The Muse processors' media tokens (transformers' MuseSparkProcessor; SGLang's muse_spark_omni processor
# looks each up by name and refuses a tokenizer without it; the soft-audio pair is optional there)
MUSE_TOKENS = ["<|image_start|>", "<|image_end|>", "<|patch|>", "<|vid_start|>", "<|vid_end|>",
               "<|vid_frame_separator|>", "<|video|>", "<|audio|>", "<|soft_audio_start|>", "<|soft_audio_end|>",
               "<|begin_of_text|>", "<|end_of_text|>"]
# A chat layout reduced to what placeholders need: an image is a bare <|patch|>, a video a bare <|video|>,
# which the processors expand (start, tokens, end; a video's clips with their times).
MUSE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|patch|>{% elif part['type'] == 'video' %}<|video|>{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_muse_model_folder(preset_name: str, folder: Path) -> Path:
    """A Muse-Spark-Open folder SGLang's language-only server loads without weights or a hub: the whole
    model's config (the preset's, `full_config`: vision tower, adapter sizes, a tiny text model as wide as
    the tower's output and a tiny audio encoder) with the media token ids of a byte-level tokenizer (256 byte
    tokens plus `MUSE_TOKENS`), and transformers' MuseSparkProcessor's files: the image and video processors'
    settings (the preset's) and the audio feature extractor's."""
    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[preset_name]
    ids = byte_tokenizer(folder, MUSE_TOKENS, {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "chat_template": MUSE_CHAT_TEMPLATE})
    cfg = full_config(preset)
    cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id = ids["<|patch|>"], ids["<|video|>"], ids["<|audio|>"]
    cfg.text_config.vocab_size = 512
    cfg.text_config.bos_token_id, cfg.text_config.eos_token_id = ids["<|begin_of_text|>"], ids["<|end_of_text|>"]
    cfg.architectures = [CLASSES[preset.family]]
    cfg.save_pretrained(folder)
    processor = "MuseSparkProcessor"
    image = {"image_processor_type": FAMILIES[preset.family].image_processor, **preset.preprocessor,
             "processor_class": processor}
    video = {"video_processor_type": "MuseGlimmerVideoProcessor", **(preset.video_preprocessor or {}),
             "processor_class": processor}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    return folder


# ---- what SGLang's language side needs for Kimi-K2.5/K2.6 ---------------------------------------------
# Kimi-K2.5/K2.6 as released: the architecture SGLang registers, the media placeholder the prompt and
# SGLang's processor read (`media_placeholder_token_id`, `<|media_pad|>` inside
# `<|media_begin|>image<|media_content|>...<|media_end|>`; a video is `<|kimi_k25_video_placeholder|>` alone, which
# transformers' processor expands into its chunks), and a remote-code processor (`--trust-remote-code`)
# whose `media_processor.media_proc_cfg` SGLang's Kimi processor reads when it is built.
SGLANG_KIMI_TOKENS = {"start": "<|media_begin|>image<|media_content|>", "end": "<|media_end|>",
                      "image": "<|media_pad|>", "video": "<|kimi_k25_video_placeholder|>"}
SGLANG_KIMI_SPECIAL = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                       "<|kimi_k25_video_placeholder|>"]
# The released checkpoint's processor is Moonshot's code (not shipped here). This one is transformers' own
# Kimi-K2.5 processor under the two names the released one adds and SGLang reads: `media_processor`, whose
# `media_proc_cfg` holds the settings under the release's keys, and its `media_tokens_calculator`.
SGLANG_KIMI_PROCESSOR = '''"""transformers' Kimi-K2.5 processor with the released one's `media_processor`."""

from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor


class KimiK25MediaProcessor:
    """The image processor's settings as the release's `media_proc_cfg`, and its token count per image."""

    def __init__(self, image_processor, video_processor):
        self.image_processor = image_processor
        self.media_proc_cfg = {
            "patch_size": image_processor.patch_size, "merge_kernel_size": image_processor.merge_size,
            "in_patch_limit": image_processor.max_patches, "patch_limit_on_one_side": image_processor.size.max_height,
            "fixed_output_tokens": None, "in_patch_limit_each_frame": video_processor.max_patches,
            "temporal_merge_kernel_size": video_processor.temporal_patch_size,
            "sample_fps": float(video_processor.fps), "timestamp_mode": "hh:mm:ss.fff",
            "image_mean": list(image_processor.image_mean), "image_std": list(image_processor.image_std),
        }

    def media_tokens_calculator(self, media):
        if media["type"] != "image":
            raise ValueError(f"unsupported media type {media['type']}")
        cfg = self.media_proc_cfg
        width, height = media["image"].size
        _, (pad_h, pad_w) = navit_resize(height, width, cfg["patch_size"], cfg["merge_kernel_size"],
                                         cfg["in_patch_limit"], cfg["patch_limit_on_one_side"])
        unit = cfg["patch_size"] * cfg["merge_kernel_size"]
        return (pad_h // unit) * (pad_w // unit)


class KimiK25Processor(Kimi_K25Processor):
    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor, chat_template=chat_template, **kwargs)
        self.media_processor = KimiK25MediaProcessor(image_processor, video_processor)
'''


def write_sglang_kimi_folder(preset_name: str, folder: Path) -> Path:
    """vLLM's folder for a Kimi-K2.x preset, made what SGLang's Kimi-K2.5 language side loads: the released
    architecture name and `media_placeholder_token_id` in config.json, the media tokens in the tokenizer (and
    its chat template), and the remote-code processor above (SGLang needs `--trust-remote-code` for it)."""
    from tokenizers import AddedToken, Tokenizer

    write_vllm_model_folder(preset_name, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SGLANG_KIMI_SPECIAL])
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SGLANG_KIMI_SPECIAL}
    k = SGLANG_KIMI_TOKENS
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = (  # a video is its placeholder alone, which the processor expands
        VLLM_CHAT_TEMPLATE.replace("<|vision_start|><|video_pad|><|vision_end|>", k["video"])
        .replace("<|vision_start|>", k["start"]).replace("<|vision_end|>", k["end"])
        .replace("<|image_pad|>", k["image"]))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["KimiK25ForConditionalGeneration"], media_placeholder_token_id=ids[k["image"]],
                  image_token_id=ids[k["image"]], video_token_id=ids[k["video"]])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "kimi_k25_processor.py").write_text(SGLANG_KIMI_PROCESSOR)
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "KimiK25Processor", "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"}}))
    return folder
