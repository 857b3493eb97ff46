"""PaddleOCR-VL's hand-off judged by vLLM 0.33.0's own code (vllm/model_executor/models/paddleocr_vl.py), as
tests/test_vllm_handoff_glm.py does for GLM: vLLM's PaddleOCR-VL takes pixels only (no `image_embeds` parts), so
a `vllm_ref` part keeps the client's media and names vitserve's cached output by uuid. A real vitserve server
answers; tests/vllm_driver.py feeds a chat holding those parts to vLLM's parser, PaddleOCR-VL processor, input
processor, model and `ECExampleConnector`.

Without VITSERVE_VLLM_PYTHON these tests skip (see tests/test_vllm_handoff.py).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from models.families import FAMILIES
from models.presets import PRESETS
from tests.checkpoints import byte_tokenizer
from tests.http_helpers import image_bytes
from tests.test_vllm_handoff import VLLM_DTYPE, encode_three_ways, reference, run_driver, vllm_python

NAME = "tiny-paddleocr-vl"
# A wide and a small image: the small one is scaled up to the processor's minimum.
IMAGES = [image_bytes(160, 120, seed=41, fmt="JPEG"), image_bytes(40, 30, seed=42, fmt="PNG")]
# PaddleOCR-VL's image tokens (vLLM's placeholder is start, placeholder, end) and a chat layout reduced to them.
TOKENS = ["<|endoftext|>", "<|begin_of_sentence|>", "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>",
          "<|VIDEO_PLACEHOLDER|>"]
CHAT_TEMPLATE = (
    "<|begin_of_sentence|>{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)


def write_vllm_paddleocr_folder(folder: Path) -> Path:
    """A folder vLLM's config, tokenizer and PaddleOCR-VL processor load without a hub: the whole model's config
    (text width = the projector's output), the processor config naming PaddleOCR-VL's processor classes, and a
    byte-level tokenizer naming its image token. No weights: vLLM builds its model with dummy ones."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[NAME]
    ids = byte_tokenizer(folder, TOKENS, {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": {"image_token": "<|IMAGE_PLACEHOLDER|>"}})
    vision = dict(preset.vision)
    out_hidden = vision.pop("out_hidden_size")
    head_dim = out_hidden // 4
    half = head_dim // 2  # M-RoPE sections cover half a head
    text = dict(hidden_size=out_hidden, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=head_dim, vocab_size=512, max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]},
                bos_token_id=ids["<|begin_of_sentence|>"], eos_token_id=ids["<|endoftext|>"])
    cfg = AutoConfig.for_model(
        preset.family, vision_config=vision, text_config=text, image_token_id=ids["<|IMAGE_PLACEHOLDER|>"],
        video_token_id=ids["<|VIDEO_PLACEHOLDER|>"], vision_start_token_id=ids["<|IMAGE_START|>"],
        vision_end_token_id=ids["<|IMAGE_END|>"])
    cfg.architectures = [FAMILIES[preset.family].hf_class]
    cfg.save_pretrained(folder)
    image = {**preset.preprocessor, "image_processor_type": FAMILIES[preset.family].image_processor,
             "processor_class": "PaddleOCRVLProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    return folder


def media_parts() -> list[dict[str, Any]]:
    mimes = ["image/jpeg", "image/png"]
    return [{"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
            for data, mime in zip(IMAGES, mimes)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    vllm_python()  # skips here, before any server starts, where vLLM's environment is not configured
    store = tmp_path_factory.mktemp("ec")
    work = tmp_path_factory.mktemp("vllm")
    items = [{"type": "image", "image": base64.b64encode(data).decode()} for data in IMAGES]
    got, chat = encode_three_ways(NAME, store, items, media_parts(), prompt="OCR:")
    cases = [{"name": "embeds", "parts": [e["content_part"] for e in got["vllm"]], "model": False},
             {"name": "ref", "messages": chat["messages"], "consumer": str(store), "model": True}]
    folder = write_vllm_paddleocr_folder(work / NAME)
    request = {"models": [{"name": NAME, "dir": str(folder), "dtype": "bfloat16", "cases": cases}],
               "tensors_out": str(work / "out.safetensors")}
    report = run_driver("vllm_driver.py", request, work)
    return {"http": got, "chat": chat, "cases": report["cases"], "tensors": load_file(request["tensors_out"])}


def test_reference_parts_keep_the_media_and_load_vitserves_tensors(run):
    """`vllm_ref`: the part names the image by uuid; the sidecar keeps each image part and adds the uuid; vLLM's
    PaddleOCR-VL processor sizes every placeholder from the image to exactly vitserve's token count, the
    connector finds and loads every file by the uuid, and the merge gives vitserve's rows."""
    case = run["cases"][f"{NAME}/ref"]
    assert case["ok"], case.get("error")
    ref = run["http"]["ref"]
    uuids = [e["content_part"]["uuid"] for e in ref]
    assert [e["content_part"] for e in ref] == [{"type": "image_url", "uuid": u} for u in uuids]
    sent = [p for p in run["chat"]["messages"][0]["content"] if p["type"] != "text"]
    assert [p["uuid"] for p in sent] == uuids and all(p["image_url"]["url"].startswith("data:") for p in sent)
    assert [f["identifier"] for f in case["features"]] == uuids
    assert case["has_cache"] == [True] * len(IMAGES) and case["loaded"] == sorted(uuids)
    for k, (feature, entry) in enumerate(zip(case["features"], run["http"]["float"])):
        main, _ = reference(entry)
        loaded = run["tensors"][f"{NAME}/ref.enc.{k}"]
        assert feature["num_embeds"] == feature["length"] == loaded.shape[0] == entry["num_tokens"]
        assert loaded.shape[1] == PRESETS[NAME].vision["out_hidden_size"]
        assert torch.equal(loaded, main)
        assert torch.equal(run["tensors"][f"{NAME}/ref.merged.{k}"], main.to(VLLM_DTYPE))


def test_inline_parts_are_refused_by_vllm_and_flagged(run):
    """vLLM 0.33's PaddleOCR-VL parses no `image_embeds` part: vitserve's inline answer says to use vllm_ref."""
    assert not run["cases"][f"{NAME}/embeds"]["ok"]
    for entry in run["http"]["vllm"]:
        assert entry["content_part"]["type"] == "image_embeds"
        assert "vllm_ref" in entry["warnings"][0]
    assert all("warnings" not in e for e in run["http"]["ref"])
