"""The hand-off of the families beyond Qwen2/2.5/3-VL, judged by vLLM 0.33.0's own code.

As tests/test_vllm_handoff.py (whose helpers and driver this reuses), on fewer cases: each family's
inline parts (`encoding_format: "vllm"`) through vLLM's parser, processor and, where vLLM's model can be
built on the CPU, its `embed_input_ids` (the cast, the DeepStack split, the merge); and its reference
parts (`"vllm_ref"`) through `ECExampleConnector`. What each family must get right: the output width
(out_hidden_size times one plus the DeepStack levels), placeholders as long as the item's tokens, and
video timestamps exactly where vLLM's parser for that family asks for them.

The Omni models are not here: vLLM serves them through their thinker's processor, which needs the
audio feature extractor's files as well; their towers and preprocessing are tested against
transformers in tests/test_towers.py and tests/test_family_preprocess.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from models.families import FAMILIES
from models.presets import PRESETS
from tests.checkpoints import write_vllm_model_folder
from tests.http_helpers import ROOT, ServerThread, settings
from tests.test_vllm_handoff import HOW, IMAGES, VIDEO, VLLM_DTYPE, post, reference, vllm_python

# preset -> whether vLLM's model is built on the CPU here: for Qwen3-VL-MoE and Qwen3.5(-MoE) its text
# part does not build from these tiny configs, so those cases stop after the processor and the connector
MODELS = {"tiny-qwen3-vl-moe": False, "tiny-qwen3.5": False, "tiny-qwen3.5-moe": False, "tiny-exaone4.5": True,
          "tiny-cohere-compass": True}


def media(name: str) -> list[tuple[str, bytes]]:
    takes_video = FAMILIES[PRESETS[name].family].video
    return [("image", IMAGES[0]), ("image", IMAGES[1])] + ([("video", VIDEO)] if takes_video else [])


def items(name: str) -> list[dict]:
    import base64

    return [{"type": kind, kind: base64.b64encode(data).decode()} for kind, data in media(name)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    python = vllm_python()
    store = tmp_path_factory.mktemp("ec")
    work = tmp_path_factory.mktemp("vllm")
    http: dict = {}
    request: dict = {"models": [], "tensors_out": str(work / "out.safetensors")}
    for name, builds in MODELS.items():
        cfg = settings(model=name, ec_shared_storage=str(store), cache_bytes=64 << 20)
        with ServerThread(cfg) as srv, srv.client() as c:
            got = {
                "float": post(c, {"items": items(name), "include_deepstack": True}),
                "vllm": post(c, {"items": items(name), "encoding_format": "vllm"}),
                "ref": post(c, {"items": items(name), "encoding_format": "vllm_ref"}),
            }
        http[name] = got
        parts = {k: [e["content_part"] for e in got[k]["body"]["data"]] for k in ("vllm", "ref")}
        cases = [{"name": "embeds", "parts": parts["vllm"], "model": builds},
                 {"name": "ref", "parts": parts["ref"], "consumer": str(store), "model": builds}]
        folder = write_vllm_model_folder(name, work / name)
        request["models"].append({"name": name, "dir": str(folder), "dtype": "bfloat16", "cases": cases})
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2", PYTHONPATH="")
    proc = subprocess.run([python, str(ROOT / "tests" / "vllm_driver.py")], input=json.dumps(request), text=True,
                          capture_output=True, timeout=900, cwd=work, env=env)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"vLLM's driver failed (exit {proc.returncode}); {HOW}\n{proc.stderr[-6000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return http, report["cases"], load_file(request["tensors_out"])


@pytest.mark.parametrize("name", list(MODELS))
def test_inline_parts_parse_size_and_merge(run, name):
    http, cases, tensors = run
    case = cases[f"{name}/embeds"]
    assert case["ok"], case.get("error")
    data = http[name]["vllm"]["body"]["data"]
    assert [f["num_embeds"] for f in case["features"]] == [e["num_tokens"] for e in data]
    assert [f["modality"] for f in case["features"]] == [kind for kind, _ in media(name)]
    family = FAMILIES[PRESETS[name].family]
    for entry in data:
        video = entry["content_part"].get("video_embeds")
        if video is not None:
            assert ("timestamps" in video) == family.video_timestamps
    floats = http[name]["float"]["body"]["data"]
    levels = len(PRESETS[name].vision.get("deepstack_visual_indexes", [])) if family.deepstack else 0
    out_hidden = PRESETS[name].vision["out_hidden_size"]
    for k, entry in enumerate(floats):
        main, deepstack = reference(entry)
        assert main.shape[1] == out_hidden and len(deepstack) == levels
        if not MODELS[name]:
            continue
        enc = tensors[f"{name}/embeds.enc.{k}"]
        assert enc.shape[1] == out_hidden * (1 + levels)
        assert torch.equal(enc, torch.cat([main, *deepstack], -1).to(VLLM_DTYPE))
        assert torch.equal(tensors[f"{name}/embeds.merged.{k}"], main.to(VLLM_DTYPE))
        for j, layer in enumerate(deepstack):
            assert torch.equal(tensors[f"{name}/embeds.deepstack.{k}.{j}"], layer.to(VLLM_DTYPE))


REFS_REFUSED = {"tiny-cohere-compass"}  # vLLM 0.33's parser for it requires the embeddings in every part


@pytest.mark.parametrize("name", [m for m in MODELS if m not in REFS_REFUSED])
def test_reference_parts_load_from_the_shared_folder(run, name):
    http, cases, tensors = run
    case = cases[f"{name}/ref"]
    assert case["ok"], case.get("error")
    data = http[name]["ref"]["body"]["data"]
    assert [f["identifier"] for f in case["features"]] == [e["content_part"]["uuid"] for e in data]
    assert case["has_cache"] == [True] * len(data)
    for k, (feature, entry) in enumerate(zip(case["features"], http[name]["float"]["body"]["data"])):
        main, deepstack = reference(entry)
        loaded = tensors[f"{name}/ref.enc.{k}"]
        assert torch.equal(loaded, torch.cat([main, *deepstack], -1))
        assert feature["num_embeds"] == loaded.shape[0] == entry["num_tokens"]


@pytest.mark.parametrize("name", sorted(REFS_REFUSED))
def test_vllm_refuses_reference_parts_of_some_families(run, name):
    """Cohere Compass's parser in vLLM 0.33 (`CohereCompassMultiModalDataParser`) declares no metadata fields
    (a JSON grid is refused) and requires `image_embeds` in every part (a tensor grid alone is refused too),
    even on an encoder-cache consumer: only inline parts reach that model."""
    _, cases, _ = run
    case = cases[f"{name}/ref"]
    assert not case["ok"] and "image_grid_thw" in case["error"]
