"""GLM-5-Next's and HyperCLOVAX-SEED Vision V2's hand-off judged by vLLM 0.33.0's own code, as
tests/test_vllm_handoff_glm.py does for GLM-4.1V: a real vitserve server answers, tests/vllm_driver.py feeds its
parts to vLLM's parser, the model's processor, the input processor and `ECExampleConnector` (and, for
HyperCLOVAX, whose model vLLM builds on the CPU, to the model).

Neither takes vitserve's inline parts: vLLM's GLM-5 processor (GLM-4.1V's) and HyperCLOVAX's both read
embedding parts as media and fail; HyperCLOVAX's model would besides run its own projection over `image_embeds`
(the tower's rows before the projection), while the model's image features (transformers' `get_image_features`,
what its language model consumes, what vLLM's encoder cache holds) are after it. Both hand off by reference:
the media part with the uuid, sized by vLLM's processor from the media to vitserve's token count, the rows
loaded from the shared folder. Without VITSERVE_VLLM_PYTHON these tests skip (see tests/test_vllm_handoff.py).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from models.presets import PRESETS, full_config
from tests.checkpoints import CLASSES, byte_tokenizer, write_glm5_processor_configs
from tests.test_vllm_handoff import VLLM_DTYPE, encode_three_ways, reference, run_driver, vllm_python
from tests.test_vllm_handoff_glm import GLM_TOKENS, MEDIA, media_parts, write_vllm_glm_folder

# preset -> whether vLLM's model is built on the CPU here (GLM-5's text model is not: its kernels need a GPU, so
# its cases stop after the processor and the connector)
MODELS = {"tiny-glm5-next": False, "tiny-hyperclovax-vision-v2": True}
# HyperCLOVAX's media tokens as vLLM's model names them (V2_IMAGE_TOKEN, V2_VIDEO_TOKEN), a chat layout reduced
# to them and a tokenizer that names its pad tokens as the processor reads them (`tokenizer.image_token`).
HCX_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_start|>", "<|IMAGE_PAD|>", "<|image_end|>",
              "<|video_start|>", "<|VIDEO_PAD|>", "<|video_end|>"]
HCX_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|image_start|><|IMAGE_PAD|><|image_end|>"
    "{% elif part['type'] == 'video' %}<|video_start|><|VIDEO_PAD|><|video_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_glm5_folder(folder: Path, name: str) -> Path:
    """GLM's tokenizer and chat layout (tests/test_vllm_handoff_glm.py's folder), GLM-5-Next's config (its tiny
    text part as full_config builds it, as wide as the tower's output) and its processor classes, which the
    release's processor config names, with the preset's token bounds."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig

    write_vllm_glm_folder(folder, "tiny-glm-ocr")
    ids = {t: Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(t) for t in GLM_TOKENS}
    preset = PRESETS[name]
    text = {**full_config(preset).text_config.to_dict(), "hidden_size": preset.vision["out_hidden_size"],
            "vocab_size": 512, "max_position_embeddings": 8192, "eos_token_id": ids["<|endoftext|>"]}
    for key in ("model_type", "architectures", "transformers_version", "dtype"):
        text.pop(key, None)
    cfg = AutoConfig.for_model(
        preset.family, vision_config=preset.vision, text_config=text,
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
    )
    cfg.architectures = [CLASSES[preset.family]]
    cfg.save_pretrained(folder)
    write_glm5_processor_configs(folder, preset)
    return folder


def write_hcx_folder(folder: Path, name: str) -> Path:
    """HyperCLOVAX's folder for vLLM: the whole model's config under the architecture vLLM registers
    (HCXVisionV2ForCausalLM) with the language model as wide as the projection (full_config's 64), Qwen2-VL's
    image and video processors and a byte-level tokenizer holding its media tokens. No weights."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[name]
    ids = byte_tokenizer(folder, HCX_TOKENS, {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": HCX_CHAT_TEMPLATE,
        "extra_special_tokens": {"image_token": "<|IMAGE_PAD|>", "video_token": "<|VIDEO_PAD|>"}})
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    cfg = AutoConfig.for_model(preset.family, vision_config=preset.vision, text_config=text,
                               image_token_id=ids["<|IMAGE_PAD|>"], video_token_id=ids["<|VIDEO_PAD|>"])
    cfg.architectures = ["HCXVisionV2ForCausalLM"]
    cfg.save_pretrained(folder)
    image = {**preset.preprocessor, "image_processor_type": "Qwen2VLImageProcessor",
             "processor_class": "HyperCLOVAXVisionV2Processor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    # its video processor (Qwen2VLVideoProcessor) at its own defaults, which vitserve's Qwen2-VL video rules are
    (folder / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "HyperCLOVAXVisionV2Processor"}))
    return folder


WRITERS = {"tiny-glm5-next": write_glm5_folder, "tiny-hyperclovax-vision-v2": write_hcx_folder}


def items() -> list[dict[str, Any]]:
    return [{"type": kind, kind: base64.b64encode(data).decode()} for kind, data in MEDIA]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    vllm_python()  # skips here, before any server starts, where vLLM's environment is not configured
    store = tmp_path_factory.mktemp("ec")
    work = tmp_path_factory.mktemp("vllm")
    http: dict[str, Any] = {}
    chats: dict[str, Any] = {}
    request: dict[str, Any] = {"models": [], "tensors_out": str(work / "out.safetensors")}
    for name, builds in MODELS.items():
        got, chats[name] = encode_three_ways(name, store, items(), media_parts())
        http[name] = got
        cases = [
            {"name": "embeds", "parts": [e["content_part"] for e in got["vllm"]], "model": builds},
            {"name": "image_embeds", "parts": [e["content_part"] for e in got["vllm"][:2]], "model": builds},
            {"name": "ref", "messages": chats[name]["messages"], "consumer": str(store), "model": builds},
        ]
        folder = WRITERS[name](work / name, name)
        request["models"].append({"name": name, "dir": str(folder), "dtype": "bfloat16", "cases": cases,
                                  "hybrid": name == "tiny-glm5-next"})
    report = run_driver("vllm_driver.py", request, work)
    return {"http": http, "chat": chats, "cases": report["cases"], "tensors": load_file(request["tensors_out"])}


@pytest.mark.parametrize("model", list(MODELS))
def test_reference_parts_keep_the_media_and_load_vitserves_tensors(run, model):
    """`vllm_ref`: the part names the media by uuid, the sidecar keeps each media part and adds the uuid; vLLM's
    processor sizes every placeholder from the media to exactly vitserve's token count, the connector loads
    every file by the uuid, and the model's merge gives vitserve's rows (HyperCLOVAX's: the projection's)."""
    case = run["cases"][f"{model}/ref"]
    assert case["ok"], case.get("error")
    ref = run["http"][model]["ref"]
    uuids = [e["content_part"]["uuid"] for e in ref]
    assert [e["content_part"] for e in ref] == [{"type": f"{k}_url", "uuid": u} for (k, _), u in zip(MEDIA, uuids)]
    sent = [p for p in run["chat"][model]["messages"][0]["content"] if p["type"] != "text"]
    assert [p["uuid"] for p in sent] == uuids
    assert [f["identifier"] for f in case["features"]] == uuids
    assert case["has_cache"] == [True] * len(MEDIA) and case["loaded"] == sorted(uuids)
    for k, (feature, entry) in enumerate(zip(case["features"], run["http"][model]["float"])):
        main, _ = reference(entry)
        loaded = run["tensors"][f"{model}/ref.enc.{k}"]
        assert feature["num_embeds"] == loaded.shape[0] == entry["num_tokens"]
        assert torch.equal(loaded, main)
        if MODELS[model]:
            assert torch.equal(run["tensors"][f"{model}/ref.merged.{k}"], main.to(VLLM_DTYPE))


@pytest.mark.parametrize("model", list(MODELS))
def test_inline_parts_do_not_fit_vllm_and_are_flagged(run, model):
    """Inline parts fail in vLLM: both processors read them as media (and HyperCLOVAX's model, were they parsed,
    would run its projection over rows projected already), and vitserve says so."""
    for name in ("embeds", "image_embeds"):  # with a video part, and images alone
        assert not run["cases"][f"{model}/{name}"]["ok"]
    if model == "tiny-hyperclovax-vision-v2":  # the embedding dict goes to the HF processor as an image
        error = run["cases"][f"{model}/image_embeds"]["error"]
        assert "Failed to apply HyperCLOVAXVisionV2Processor" in error and "'images': ['image" in error, error
    for entry in run["http"][model]["vllm"]:
        assert "vllm_ref" in entry["warnings"][0]
    assert all("warnings" not in e for e in run["http"][model]["ref"])

