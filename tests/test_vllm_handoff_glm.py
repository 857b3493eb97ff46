"""GLM-4.1V's and GLM-OCR's hand-off judged by vLLM 0.33.0's own code (vllm/model_executor/models/glm4_1v.py), as
tests/test_vllm_handoff.py does for the Qwen-VL families: a real vitserve server answers, tests/vllm_driver.py
feeds its parts to vLLM's parser, GLM processor, input processor, model and `ECExampleConnector`.

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
from tests.checkpoints import GLM_TOKENIZER_CONFIG, GLM_TOKENS, byte_tokenizer
from tests.http_helpers import image_bytes
from tests.test_vllm_handoff import VLLM_DTYPE, encode_three_ways, reference, run_driver, vllm_python
from tests.videos import make_video

MODELS = ["tiny-glm4v", "tiny-glm-ocr"]
IMAGES = [image_bytes(160, 120, seed=31, fmt="JPEG"), image_bytes(96, 96, seed=32, fmt="PNG")]
VIDEO = make_video(8, fps=4, width=64, height=48)
MEDIA = [("image", IMAGES[0]), ("image", IMAGES[1]), ("video", VIDEO)]

def write_vllm_glm_folder(folder: Path, name: str) -> Path:
    """A folder for the GLM preset `name` that vLLM's config, tokenizer and GLM processor load without a hub:
    the whole model's config (text width = the tower's output width), GLM's processor configs and a
    byte-level tokenizer holding GLM's special tokens. No weights: vLLM builds its model with dummy ones."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[name]
    ids = byte_tokenizer(folder, GLM_TOKENS, GLM_TOKENIZER_CONFIG)
    out_hidden = preset.vision["out_hidden_size"]
    half = out_hidden // 4 // 4  # M-RoPE sections cover half of the rotated half of a head
    text = dict(hidden_size=out_hidden, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]},
                bos_token_id=None, eos_token_id=ids["<|endoftext|>"])
    cfg = AutoConfig.for_model(
        preset.family, vision_config=preset.vision, text_config=text,
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
    )
    cfg.architectures = [FAMILIES[preset.family].hf_class]
    cfg.save_pretrained(folder)
    image = {**preset.preprocessor, "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor"}
    video = {**(preset.video_preprocessor or {}), "video_processor_type": "Glm4vVideoProcessor",
             "processor_class": "Glm4vProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    return folder


def items() -> list[dict[str, Any]]:
    return [{"type": kind, kind: base64.b64encode(data).decode()} for kind, data in MEDIA]


def media_parts() -> list[dict[str, Any]]:
    mimes = ["image/jpeg", "image/png", "video/mp4"]
    return [{"type": f"{kind}_url", f"{kind}_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
            for (kind, data), mime in zip(MEDIA, mimes)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    vllm_python()  # skips here, before any server starts, where vLLM's environment is not configured
    store = tmp_path_factory.mktemp("ec")
    work = tmp_path_factory.mktemp("vllm")
    http: dict[str, Any] = {}
    chats: dict[str, Any] = {}
    request: dict[str, Any] = {"models": [], "tensors_out": str(work / "out.safetensors")}
    for name in MODELS:
        got, chats[name] = encode_three_ways(name, store, items(), media_parts())
        http[name] = got
        cases = [
            {"name": "embeds", "parts": [e["content_part"] for e in got["vllm"]], "model": False},
            {"name": "ref", "messages": chats[name]["messages"], "consumer": str(store), "model": True},
        ]
        folder = write_vllm_glm_folder(work / name, name)
        request["models"].append({"name": name, "dir": str(folder), "dtype": "bfloat16", "cases": cases})
    report = run_driver("vllm_driver.py", request, work)
    return {"http": http, "chat": chats, "cases": report["cases"], "tensors": load_file(request["tensors_out"])}


@pytest.mark.parametrize("model", MODELS)
def test_reference_parts_keep_the_media_and_load_vitserves_tensors(run, model):
    """`vllm_ref` for GLM-4.1V: the part names the media by uuid; the sidecar keeps each media part and adds the
    uuid; vLLM's GLM processor sizes every placeholder from the media to exactly vitserve's token count, the
    connector finds and loads every file by the uuid, and the merge gives vitserve's rows."""
    case = run["cases"][f"{model}/ref"]
    assert case["ok"], case.get("error")
    ref = run["http"][model]["ref"]
    uuids = [e["content_part"]["uuid"] for e in ref]
    assert [e["content_part"] for e in ref] == [{"type": f"{k}_url", "uuid": u} for (k, _), u in zip(MEDIA, uuids)]
    sent = [p for p in run["chat"][model]["messages"][0]["content"] if p["type"] != "text"]
    assert [p["uuid"] for p in sent] == uuids and all(p[p["type"]]["url"].startswith("data:") for p in sent)
    assert [f["identifier"] for f in case["features"]] == uuids == [e["content_id"] for e in ref]
    assert case["has_cache"] == [True] * 3 and case["loaded"] == sorted(uuids)
    for k, (feature, entry) in enumerate(zip(case["features"], run["http"][model]["float"])):
        main, _ = reference(entry)
        loaded = run["tensors"][f"{model}/ref.enc.{k}"]
        assert feature["num_embeds"] == loaded.shape[0] == entry["num_tokens"]
        assert loaded.dtype == torch.float32 and torch.equal(loaded, main)
        assert torch.equal(run["tensors"][f"{model}/ref.merged.{k}"], main.to(VLLM_DTYPE))
    video = case["features"][2]
    assert video["modality"] == "video" and video["length"] > video["num_embeds"]  # GLM's per-frame timestamps


@pytest.mark.parametrize("model", MODELS)
def test_inline_parts_are_refused_by_vllm_and_flagged(run, model):
    """vLLM 0.33's GLM-4.1V parser reads an `image_embeds` part as images and fails: vitserve's answer says so."""
    case = run["cases"][f"{model}/embeds"]
    assert not case["ok"]
    for entry in run["http"][model]["vllm"]:
        assert entry["content_part"]["type"] == f"{entry['type']}_embeds"
        assert "vllm_ref" in entry["warnings"][0]
    assert all("warnings" not in e for e in run["http"][model]["ref"])


def test_handed_off_keeps_the_media_of_a_media_reference():
    from service.handoff.vllm import handed_off, reference_part

    media = {"type": "image_url", "image_url": {"url": "http://x/cat.jpg"}}
    glm = reference_part("image", (1, 4, 4), {}, "vit-1", "glm4v")
    assert glm == {"type": "image_url", "uuid": "vit-1"}
    assert handed_off(media, glm) == {**media, "uuid": "vit-1"}
    qwen = reference_part("image", (1, 4, 4), {}, "vit-2", "qwen2_vl")
    assert qwen["type"] == "image_embeds" and handed_off(media, qwen) == qwen
