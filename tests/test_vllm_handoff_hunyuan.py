"""HunyuanOCR's hand-off judged by vLLM 0.33.0's own code: vLLM serves it through its Transformers modeling backend
(`TransformersMultiModalForCausalLM`, vllm/model_executor/models/transformers/multimodal.py), whose processor
sizes each image's placeholder by running transformers' HunYuanVLProcessor on the media. As for GLM-4.1V
(tests/test_vllm_handoff_glm.py): a real vitserve server answers, tests/vllm_driver.py feeds its parts to vLLM's
parser, processor, input processor and `ECExampleConnector`.

Hy4 and VideoLLaMA3 are not served by vLLM 0.33 (no model class for `hy_v4_vl`; `video_llama_3` is in no
registry), so nothing of theirs is handed off to it here.

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

NAME = "tiny-hunyuan-vl"
IMAGES = [image_bytes(160, 120, seed=41, fmt="JPEG"), image_bytes(200, 96, seed=42, fmt="PNG")]
# HunyuanOCR's media tokens, named on the tokenizer as its processor reads them, and a chat layout reduced to them.
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<img_start>", "<img>", "<img_end>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<img_start><img><img_end>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_vllm_hunyuan_folder(folder: Path) -> Path:
    """What vLLM's config, tokenizer and HunYuanVLProcessor load without a hub: the whole model's config (text
    width = the tower's output width), the image processor's config naming the processor class, and a byte-level
    tokenizer whose named special tokens are the image, begin and end tokens. No weights."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[NAME]
    ids = byte_tokenizer(folder, TOKENS, {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": {"image_token": "<img>", "image_start_token": "<img_start>",
                                 "image_end_token": "<img_end>"}})
    width = preset.text["hidden_size"]
    text = dict(hidden_size=width, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=width // 4, vocab_size=512, max_position_embeddings=8192,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"])
    cfg = AutoConfig.for_model("hunyuan_vl", vision_config=preset.vision, text_config=text,
                               image_token_id=ids["<img>"], im_start_id=ids["<img_start>"], im_end_id=ids["<img_end>"])
    cfg.architectures = [FAMILIES["hunyuan_vl"].hf_class]
    cfg.save_pretrained(folder)
    image = {**preset.preprocessor, "image_processor_type": "HunYuanVLImageProcessor",
             "processor_class": "HunYuanVLProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    return folder


def items() -> list[dict[str, Any]]:
    return [{"type": "image", "image": base64.b64encode(data).decode()} for data in IMAGES]


def media_parts() -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
            for data, mime in zip(IMAGES, ["image/jpeg", "image/png"])]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    vllm_python()  # skips here, before any server starts, where vLLM's environment is not configured
    store = tmp_path_factory.mktemp("ec")
    work = tmp_path_factory.mktemp("vllm")
    got, chat = encode_three_ways(NAME, store, items(), media_parts())
    cases = [{"name": "embeds", "parts": [e["content_part"] for e in got["vllm"]], "model": False},
             {"name": "ref", "messages": chat["messages"], "consumer": str(store), "model": True}]
    folder = write_vllm_hunyuan_folder(work / NAME)
    request = {"models": [{"name": NAME, "dir": str(folder), "dtype": "bfloat16", "cases": cases}],
               "tensors_out": str(work / "out.safetensors")}
    report = run_driver("vllm_driver.py", request, work)
    return {"http": got, "chat": chat, "cases": report["cases"], "tensors": load_file(request["tensors_out"])}


def test_reference_parts_keep_the_media_and_load_vitserves_tensors(run):
    """`vllm_ref`: the part names the image by uuid, the sidecar keeps the media part and adds the uuid; vLLM's
    processor sizes each placeholder from the image to vitserve's rows (a newline per row of merged tokens, begin
    and end tokens), the connector finds and loads vitserve's file by the uuid, and vLLM's model merges those
    rows into the prompt."""
    case = run["cases"][f"{NAME}/ref"]
    assert case["ok"], case.get("error")
    ref = run["http"]["ref"]
    uuids = [e["content_part"]["uuid"] for e in ref]
    assert [e["content_part"] for e in ref] == [{"type": "image_url", "uuid": u} for u in uuids]
    sent = [p for p in run["chat"]["messages"][0]["content"] if p["type"] != "text"]
    assert [p["uuid"] for p in sent] == uuids
    assert [f["identifier"] for f in case["features"]] == uuids
    assert case["has_cache"] == [True, True] and case["loaded"] == sorted(uuids)
    for k, (feature, entry) in enumerate(zip(case["features"], run["http"]["float"])):
        t, h, w = entry["grid_thw"]
        assert feature["num_embeds"] == entry["num_tokens"] == (h // 2) * (w // 2 + 1) + 2
        main, _ = reference(entry)
        loaded = run["tensors"][f"{NAME}/ref.enc.{k}"]
        assert loaded.shape[0] == feature["num_embeds"] and torch.equal(loaded, main)
        assert torch.equal(run["tensors"][f"{NAME}/ref.merged.{k}"], main.to(VLLM_DTYPE))  # into the prompt
    assert len({f["num_embeds"] for f in case["features"]}) == 2  # two image shapes, two counts


def test_inline_parts_are_refused_by_vllm_and_flagged(run):
    """vLLM 0.33's Transformers backend takes no `image_embeds` for this model: vitserve's answer says so."""
    case = run["cases"][f"{NAME}/embeds"]
    assert not case["ok"] and "HunYuanVLProcessor" in case["error"]  # it takes the embeddings for images
    for entry in run["http"]["vllm"]:
        assert entry["content_part"]["type"] == "image_embeds" and "vllm_ref" in entry["warnings"][0]
    assert all("warnings" not in e for e in run["http"]["ref"])

